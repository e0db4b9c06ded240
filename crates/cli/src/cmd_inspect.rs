use anyhow::{bail, Result};
use sluice_model::config::{MixerKind, QkNorm};
use sluice_model::gguf::GgufCheckpoint;
use sluice_model::hf::HfCheckpoint;
use sluice_model::ModelConfig;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face model directory or a GGUF file, or either at an http(s):// or s3:// URL
    /// (its header and dense weights are fetched into the local tier, as `run` would).
    path: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    remote: crate::common::RemoteArgs,
}

/// Whether a tensor name belongs to a routed expert.
fn is_routed_expert(name: &str) -> bool {
    name.contains(".experts.") || name.contains("_exps.")
}

/// Whether a tensor belongs to a part of the checkpoint the language model does not use.
fn is_unused(name: &str) -> bool {
    name.starts_with("model.visual.") || name.starts_with("visual.")
}

/// Whether a tensor belongs to the multi-token-prediction head.
fn is_mtp(c: &ModelConfig, name: &str) -> bool {
    name.starts_with("mtp.") || name.contains(".nextn.") || {
        // GGUF keeps the MTP layer as the blocks after the trunk's.
        name.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|l| l >= c.n_layer)
    }
}

/// "3× Gated DeltaNet + 1× attention (layers 3)", "3× latent attention (MLA)": how the layers
/// are composed.
fn composition(c: &ModelConfig) -> String {
    let of = |f: fn(&MixerKind) -> bool| -> Vec<usize> { (0..c.n_layer).filter(|l| f(&c.layers[*l].mixer)).collect() };
    let attn = of(|m| matches!(m, MixerKind::Attention { .. }));
    let delta = of(|m| matches!(m, MixerKind::GatedDeltaNet)).len();
    let mla = of(|m| matches!(m, MixerKind::Mla)).len();
    let windows = (0..c.n_layer).filter(|l| c.window(*l).is_some()).count();
    let mut parts = Vec::new();
    if delta > 0 {
        let list = if attn.len() <= 16 {
            format!(" (layers {})", attn.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", "))
        } else {
            String::new()
        };
        parts.push(format!("{delta}× Gated DeltaNet + {}× attention{list}", attn.len()));
    } else if mla > 0 {
        parts.push(format!("{mla}× latent attention (MLA)"));
        if !attn.is_empty() {
            parts.push(format!("{}× attention", attn.len()));
        }
    } else {
        parts.push(format!("{}× attention", attn.len()));
    }
    if windows > 0 {
        parts.push(format!("{windows} with a sliding window"));
    }
    parts.join(", ")
}

pub fn main(mut a: Args) -> Result<()> {
    let name = a.path.to_string_lossy().to_string();
    if sluice_remote::is_remote(&name) {
        a.path = crate::common::open_remote(&name, &a.remote.options()?)?.local;
    }
    if !a.path.exists() {
        bail!("{}: no such file or directory", a.path.display());
    }
    // (name, dtype, bytes) of every tensor, and the config.
    let mut notes = Vec::new();
    let (format, c, tensors): (&str, ModelConfig, Vec<(String, String, usize)>) = if a.path.is_dir() {
        let ck = HfCheckpoint::open(&a.path)?;
        notes.extend(ck.notes.iter().cloned());
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
        notes.extend(ck.notes.iter().cloned());
        if let Some(r) = ck.file.get(sluice_model::synth::ROUTING_KEY).and_then(|v| v.as_str()) {
            notes.push(sluice_model::synth::routing_caveat(r));
        }
        let t = ck.file.tensors.iter().map(|t| (t.name.clone(), t.dtype.name().to_string(), t.size as usize)).collect();
        ("gguf", ck.config, t)
    } else {
        bail!("{}: expected a Hugging Face model directory or a GGUF file", a.path.display());
    };
    let mut dtypes: BTreeMap<String, usize> = BTreeMap::new();
    let (mut dense, mut experts, mut embd, mut unused, mut mtp) = (0usize, 0usize, 0usize, 0usize, 0usize);
    for (name, dtype, bytes) in &tensors {
        *dtypes.entry(dtype.clone()).or_default() += bytes;
        if is_unused(name) {
            unused += bytes;
        } else if is_mtp(&c, name) {
            mtp += bytes;
        } else if is_routed_expert(name) {
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
        "composition": composition(&c),
        "attention": {
            "rotary_dims": c.rope.dim,
            "qk_norm": format!("{:?}", c.qk_norm),
            "output_gate": c.attn_output_gate,
        },
        "delta_net": c.delta_net.map(|d| serde_json::json!({
            "key_heads": d.n_k_heads, "value_heads": d.n_v_heads, "key_dim": d.d_k, "value_dim": d.d_v,
            "conv_kernel": d.conv_kernel, "head_order": format!("{:?}", d.head_order), "projections": format!("{:?}", d.proj),
        })),
        "state_bytes_per_token": c.kv_bytes_per_token(),
        "state_bytes_fixed": c.recurrent_bytes(),
        "state_bytes_window": c.window_bytes(),
        "kv_bytes_per_token_by_layer": (0..c.n_layer).map(|l| { let (k, v) = c.kv_widths(l); 4 * (k + v) }).collect::<Vec<_>>(),
        "latent_attention": c.mla.map(|m| serde_json::json!({
            "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope": m.qk_nope,
            "qk_rope": m.qk_rope, "v_head": m.v_head, "cached_values_per_token": m.cache_width(),
        })),
        "attention_sinks": c.attn_sinks,
        "router": c.moe.as_ref().map(|m| format!("{:?}", m.gating)),
        "mtp": c.mtp.map(|m| serde_json::json!({"layers": m.n_layer, "bytes": mtp})),
        "unused_bytes": unused,
        "notes": notes,
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
    println!("  layers: {}", composition(&c));
    println!(
        "  attention: rotary {} of {} dims{}{}",
        c.rope.dim,
        c.head_dim,
        match c.qk_norm {
            QkNorm::None => "",
            QkNorm::PerHead => ", QK-norm per head",
            QkNorm::Full => ", QK-norm over the projection",
        },
        if c.attn_output_gate { ", output gate" } else { "" }
    );
    if let Some(d) = c.delta_net {
        println!(
            "  Gated DeltaNet: {} key heads × {}, {} value heads × {}, conv kernel {}, head order {:?}, projections {:?}",
            d.n_k_heads, d.d_k, d.n_v_heads, d.d_v, d.conv_kernel, d.head_order, d.proj
        );
    }
    if let Some(m) = c.mla {
        println!(
            "  latent attention: q rank {}, kv rank {}, per head nope {} + rope {}, value {}; caches {} values ({:.2} KiB) per token per layer: the latent and the rope key, never expanded keys and values",
            m.q_lora_rank.map_or("none (plain q)".to_string(), |r| r.to_string()),
            m.kv_lora_rank,
            m.qk_nope,
            m.qk_rope,
            m.v_head,
            m.cache_width(),
            (4 * m.cache_width()) as f64 / 1024.0
        );
    }
    println!(
        "  sequence state: {:.1} KiB per token (KV of the attention layers){}{}",
        c.kv_bytes_per_token() as f64 / 1024.0,
        if c.window_bytes() > 0 {
            format!(" + at most {:.2} MiB (sliding windows)", mib(c.window_bytes() as usize))
        } else {
            String::new()
        },
        if c.recurrent_bytes() > 0 {
            format!(" + {:.2} MiB fixed (recurrent)", mib(c.recurrent_bytes() as usize))
        } else {
            String::new()
        },
    );
    if let Some(m) = c.mtp {
        println!(
            "  multi-token prediction: {} layer(s), {:.2} MiB (loaded for speculative decoding)",
            m.n_layer,
            mib(mtp)
        );
    }
    for n in &notes {
        println!("  note: {n}");
    }
    if unused > 0 {
        println!("  unused by sluice: {:.2} MiB", mib(unused));
    }
    println!("  tensors: {count}");
    println!("  dense weights: {:.2} MiB   routed experts: {:.2} MiB", mib(dense), mib(experts));
    println!("  weights read per decoded token: {:.2} MiB", mib(active));
    for (d, b) in &dtypes {
        println!("  {d}: {:.2} MiB", mib(*b));
    }
    Ok(())
}
