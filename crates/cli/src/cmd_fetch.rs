//! `sluice fetch`: prepare a remote model ahead of use — its dense weights, the experts a
//! routing trace says are hot (into the disk tier), or a whole local copy.

use crate::common::RemoteArgs;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The model's URL (http(s):// or s3://): a .gguf file or a Hugging Face model directory.
    pub url: String,
    /// Make a whole local copy at --output instead (resumable: run again to continue).
    #[arg(long)]
    pub all: bool,
    /// Where --all writes the copy (a file for a .gguf, else a directory).
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// Bring the experts this routing trace (from `run --trace`) used most into the disk tier,
    /// most used first, as many as --disk-cache-size holds.
    #[arg(long, value_name = "TRACE")]
    pub experts: Option<PathBuf>,
    #[command(flatten)]
    pub remote: RemoteArgs,
    /// Range requests in flight.
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Print what was done as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn main(a: Args) -> Result<()> {
    if !sluice_remote::is_remote(&a.url) {
        bail!("{}: not a URL (http://, https:// or s3://)", a.url);
    }
    let mut o = a.remote.options()?;
    o.parallel = a.parallel.max(1);
    if a.all {
        let out = a.output.context("--all needs --output PATH for the local copy")?;
        let f = sluice_remote::fetch::all(&a.url, &o, &out).with_context(|| format!("fetching {}", a.url))?;
        report(&a.url, "whole copy", &f, a.json, Some(&out));
        return Ok(());
    }
    if a.output.is_some() {
        bail!("--output goes with --all");
    }
    let m = crate::common::open_remote(&a.url, &o)?;
    if let Some(trace) = &a.experts {
        let layout = sluice_remote::fetch::layout(&m)?;
        let n_expert = layout.experts.iter().map(|l| l.len()).max().unwrap_or(0);
        let ranked = sluice_runtime::prewarm::ranked(trace, layout.experts.len(), n_expert)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let keys: Vec<(u32, u32)> = ranked.iter().map(|r| r.0).collect();
        let f = sluice_remote::fetch::experts(&m, &layout, &keys, o.parallel)
            .with_context(|| format!("fetching the experts of {}", trace.display()))?;
        let total: u64 = ranked.iter().map(|r| r.1).sum();
        let covered: u64 = ranked[..f.items].iter().map(|r| r.1).sum();
        report(&a.url, "hot experts", &f, a.json, None);
        eprintln!(
            "sluice: the disk tier holds {} of the {} experts the trace used ({:.0}% of its routing decisions)",
            f.items,
            ranked.len(),
            if total == 0 { 0.0 } else { 100.0 * covered as f64 / total as f64 }
        );
    }
    Ok(())
}

fn report(url: &str, what: &str, f: &sluice_remote::fetch::Fetched, json: bool, out: Option<&std::path::Path>) {
    if json {
        println!("{}", serde_json::json!({"url": url, "what": what, "result": f, "output": out}));
    } else {
        eprintln!(
            "sluice: {url}: {what}: {} items, {:.1} MB fetched in {:.1} s ({:.1} MB/s){}{}",
            f.items,
            f.bytes as f64 / 1e6,
            f.seconds,
            f.bytes as f64 / 1e6 / f.seconds.max(1e-9),
            if f.left_out > 0 { format!(", {} left out (the disk tier is full)", f.left_out) } else { String::new() },
            out.map_or(String::new(), |p| format!(" into {}", p.display()))
        );
    }
}
