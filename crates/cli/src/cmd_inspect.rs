use anyhow::{bail, Result};
use sluice_model::gguf::GgufCheckpoint;
use sluice_model::hf::HfCheckpoint;
use sluice_model::ModelConfig;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face model directory or a GGUF file.
    path: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Whether a tensor name belongs to a routed expert.
fn is_routed_expert(name: &str) -> bool {
    name.contains(".experts.") || name.contains("_exps.")
}

pub fn main(a: Args) -> Result<()> {
    if !a.path.exists() {
        bail!("{}: no such file or directory", a.path.display());
    }
    // (name, dtype, bytes) of every tensor, and the config.
    let (format, c, tensors): (&str, ModelConfig, Vec<(String, String, usize)>) = if a.path.is_dir() {
        let ck = HfCheckpoint::open(&a.path)?;
        let t = ck
            .st
            .names()
            .map(|n| {
                let i = ck.st.info(n).expect("listed");
                (n.clone(), i.dtype.clone(), i.end - i.start)
            })
            .collect();
        ("safetensors", ck.config, t)
    } else if sluice_runtime::engine::is_gguf(&a.path)? {
        let ck = GgufCheckpoint::open(&a.path)?;
        let t = ck.file.tensors.iter().map(|t| (t.name.clone(), t.dtype.name().to_string(), t.size as usize)).collect();
        ("gguf", ck.config, t)
    } else {
        bail!("{}: expected a Hugging Face model directory or a GGUF file", a.path.display());
    };
    let mut dtypes: BTreeMap<String, usize> = BTreeMap::new();
    let (mut dense, mut experts, mut embd) = (0usize, 0usize, 0usize);
    for (name, dtype, bytes) in &tensors {
        *dtypes.entry(dtype.clone()).or_default() += bytes;
        if is_routed_expert(name) {
            experts += bytes;
        } else {
            dense += bytes;
        }
        if name == "token_embd.weight" || name == "model.embed_tokens.weight" {
            embd += bytes;
        }
    }
    let count = tensors.len();
    let moe = c.moe.as_ref();
    // Bytes a decode step reads: every dense weight but the embedding table (one row of it),
    // plus the chosen fraction of each sparse layer's experts.
    let tied = c.tie_embeddings;
    let active = dense - if tied { 0 } else { embd } + moe.map_or(0, |m| experts * m.n_expert_used / m.n_expert);
    let v = serde_json::json!({
        "path": a.path.display().to_string(),
        "format": format,
        "architecture": c.arch.name(),
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden,
        "layers": c.n_layer,
        "heads": c.n_head,
        "kv_heads": c.n_head_kv,
        "head_dim": c.head_dim,
        "ffn": c.ff,
        "experts": moe.map(|m| m.n_expert),
        "experts_per_token": moe.map(|m| m.n_expert_used),
        "expert_ffn": moe.map(|m| m.expert_ff),
        "sparse_layers": (0..c.n_layer).filter(|l| c.is_sparse(*l)).count(),
        "max_position": c.max_position,
        "tensors": count,
        "dense_bytes": dense,
        "expert_bytes": experts,
        "embedding_bytes": embd,
        "decode_bytes_per_token": active,
        "dtype_bytes": dtypes,
    });
    if a.json {
        println!("{v}");
        return Ok(());
    }
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    println!("{}  ({})", a.path.display(), c.arch.name());
    println!(
        "  dims: vocab {}  hidden {}  layers {}  heads {}/{} kv  head_dim {}  ffn {}",
        c.vocab_size, c.hidden, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.ff
    );
    if let Some(m) = moe {
        println!(
            "  experts: {} per layer, top-{}, ffn {}, {} of {} layers sparse{}",
            m.n_expert,
            m.n_expert_used,
            m.expert_ff,
            (0..c.n_layer).filter(|l| c.is_sparse(*l)).count(),
            c.n_layer,
            m.shared_expert_ff.map(|s| format!(", shared expert ffn {s}")).unwrap_or_default()
        );
    }
    println!("  tensors: {count}");
    println!("  dense weights: {:.2} MiB   routed experts: {:.2} MiB", mib(dense), mib(experts));
    println!("  weights read per decoded token: {:.2} MiB", mib(active));
    for (d, b) in &dtypes {
        println!("  {d}: {:.2} MiB", mib(*b));
    }
    Ok(())
}
