use crate::common::{cache_dir, parse_size};
use anyhow::{bail, Context, Result};
use sluice_runtime::fit::{predict, rates};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file or a Hugging Face model directory.
    #[arg(long, short = 'm')]
    model: PathBuf,
    /// Memory available to sluice (default: what the system reports available now).
    #[arg(long)]
    memory: Option<String>,
    /// A file (or a directory: its largest file) on the disk the model would stream from
    /// (default: the model itself).
    #[arg(long)]
    disk: Option<PathBuf>,
    /// A routing trace (`sluice run --trace`) of a task like yours, for the hit rate; without
    /// one, routing is assumed to have no locality (the pessimistic case).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Context length the sequence state is sized for (0: the model's own, at most 8192).
    #[arg(long, default_value_t = 0)]
    ctx: usize,
    #[arg(long, short = 't', default_value_t = 0)]
    threads: usize,
    /// Seconds per disk measurement.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Measure again instead of using the rates measured before for this disk.
    #[arg(long)]
    remeasure: bool,
    #[arg(long)]
    json: bool,
}

pub fn main(a: Args) -> Result<()> {
    let sizes = sluice_runtime::engine::model_sizes(&a.model, a.ctx)?;
    if sizes.experts == 0 {
        bail!("{}: not an MoE model; `fit` predicts where routed experts go", a.model.display());
    }
    let memory = match &a.memory {
        Some(m) => parse_size(m)?,
        None => sluice_runtime::placement::mem_available().context("available memory is unknown: give --memory")?,
    };
    let threads = if a.threads == 0 { sluice_kernels::pool::available_threads() } else { a.threads };
    if a.seconds.is_nan() || a.seconds <= 0.0 {
        bail!("--seconds must be positive");
    }
    let disk = a.disk.clone().unwrap_or_else(|| a.model.clone());
    let r = rates(
        &disk,
        sizes.slot_bytes as usize,
        threads,
        a.seconds,
        Some(&cache_dir().join("fit-rates.json")),
        a.remeasure,
    )?;
    let p = predict(&sizes, memory, &r, a.trace.as_deref())?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({"model": a.model.display().to_string(), "sizes": sizes, "rates": r, "prediction": p})
        );
        return Ok(());
    }
    let gb = |b: u64| b as f64 / 1e9;
    println!(
        "{}: {:.2} GB dense, {:.2} GB in {} experts ({} per token in {} sparse layers), {:.2} GB of state for {} tokens",
        a.model.display(),
        gb(sizes.dense_bytes),
        gb(sizes.expert_bytes),
        sizes.experts,
        sizes.experts_per_token,
        sizes.sparse_layers,
        gb(sizes.state_bytes),
        sizes.ctx
    );
    println!(
        "machine: memory {:.2} GB available, read at {:.1} GB/s ({} threads); disk {:.2} GB/s in expert reads, {:.2} GB/s in 128 KiB reads{}",
        gb(memory),
        r.memory_gb_s,
        r.threads,
        r.disk_gb_s,
        r.disk_small_gb_s,
        if r.cached { " (measured before; --remeasure to redo)" } else { "" }
    );
    println!("placement: {} — {}", p.placement, p.reason);
    if let Some(h) = &p.hit_rate {
        println!(
            "expert cache: {} slots, hit rate {:.1}% ({})",
            h.slots,
            100.0 * h.rate,
            if h.source == "trace" {
                "the trace replayed through LRU"
            } else {
                "no trace: routing without locality assumed"
            }
        );
    }
    println!("decode upper bounds (bytes moved only; compute-bound models run below them):");
    println!(
        "  resident {:8.2} tok/s  ({:.1} MB from memory per token)",
        p.resident_tok_s,
        gb(p.memory_bytes_per_token) * 1e3
    );
    if let (Some(s), Some(d)) = (p.stream_tok_s, p.stream_disk_bytes_per_token) {
        println!("  streamed {s:8.2} tok/s  (+{:.1} MB from disk per token)", gb(d) * 1e3);
    }
    if let (Some(m), Some(d), Some(h)) = (p.mmap_tok_s, p.mmap_disk_bytes_per_token, &p.mmap_hit_rate) {
        println!(
            "  mmap     {m:8.2} tok/s  (+{:.1} MB from disk per token in page faults; page cache hit rate {:.1}%)",
            gb(d) * 1e3,
            100.0 * h.rate
        );
    }
    Ok(())
}
