use crate::common::parse_size;
use anyhow::{Context, Result};

#[derive(clap::Args)]
pub struct Args {
    /// File to read (e.g. the model).
    #[arg(long)]
    file: std::path::PathBuf,
    /// Bytes per read (use the expert size).
    #[arg(long, default_value = "3MiB")]
    size: String,
    /// Reads in flight.
    #[arg(long, default_value_t = 32)]
    depth: usize,
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Use the pread pool instead of io_uring.
    #[arg(long)]
    pread: bool,
    #[arg(long)]
    json: bool,
}

pub fn main(a: Args) -> Result<()> {
    let block = parse_size(&a.size)? as usize;
    let (bps, direct) = sluice_experts::io::read_bandwidth(&a.file, block, a.depth, a.seconds, !a.pread)
        .with_context(|| format!("reading {}", a.file.display()))?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({"file": a.file.display().to_string(), "block_bytes": block, "depth": a.depth,
                "engine": if a.pread { "pread" } else { "io_uring" }, "o_direct": direct, "gb_s": bps / 1e9})
        );
    } else {
        println!(
            "{:.2} GB/s random reads of {} bytes, {} in flight ({}, {})",
            bps / 1e9,
            block,
            a.depth,
            if a.pread { "pread" } else { "io_uring" },
            if direct { "O_DIRECT" } else { "buffered" }
        );
    }
    Ok(())
}
