use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sluice_model::gguf::GgufCheckpoint;
use sluice_model::hf::HfCheckpoint;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The model (GGUF file or Hugging Face directory) whose experts to pack.
    #[arg(long, short = 'm')]
    model: PathBuf,
    #[arg(long, short = 'o')]
    out: PathBuf,
}

pub fn main(a: Args) -> Result<()> {
    let (layout, fp) = if a.model.is_dir() {
        let c = HfCheckpoint::open(&a.model)?;
        (sluice_experts::store::layout_from_hf(&c)?, sluice_experts::store::hf_fingerprint(&c)?)
    } else {
        let c = GgufCheckpoint::open(&a.model)?;
        (sluice_experts::store::layout_from_gguf(&c)?, sluice_experts::store::gguf_fingerprint(&c)?)
    };
    let total = layout.total_payload();
    eprintln!(
        "packing {} experts ({:.2} GB) of {} into {}",
        layout.experts.iter().map(|l| l.len()).sum::<usize>(),
        total as f64 / 1e9,
        a.model.display(),
        a.out.display()
    );
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}").expect("template"),
    );
    let t0 = std::time::Instant::now();
    let name = a.model.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let bytes = sluice_experts::pack::write_pack(&layout, &fp, &name, &a.out, |n| bar.inc(n))
        .with_context(|| format!("writing {}", a.out.display()))?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {:.2} GB in {:.1} s; use it with --pack {}",
        bytes as f64 / 1e9,
        t0.elapsed().as_secs_f64(),
        a.out.display()
    );
    Ok(())
}
