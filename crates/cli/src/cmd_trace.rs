use crate::common::parse_size;
use anyhow::{bail, Result};
use sluice_experts::trace::{read, requests, simulate_belady, simulate_policy};
use sluice_experts::Policy;

#[derive(clap::Subcommand)]
pub enum TraceCmd {
    /// Replay a routing trace through each eviction policy and Belady's optimum.
    Simulate(SimArgs),
}

#[derive(clap::Args)]
pub struct SimArgs {
    /// A trace written by `sluice run --trace FILE`.
    file: std::path::PathBuf,
    /// Cache sizes to simulate (e.g. 2GiB 4GiB); repeat the flag or list several.
    #[arg(long, num_args = 1.., required = true)]
    quota: Vec<String>,
    #[arg(long)]
    json: bool,
}

pub fn main(c: TraceCmd) -> Result<()> {
    let TraceCmd::Simulate(a) = c;
    let (h, recs) = read(&a.file).map_err(|e| anyhow::anyhow!(e))?;
    if recs.is_empty() {
        bail!("{}: the trace holds no routing records", a.file.display());
    }
    let reqs = requests(&recs);
    let total_experts = h.n_expert * recs.iter().map(|r| r.layer).collect::<std::collections::BTreeSet<_>>().len();
    let mut rows = Vec::new();
    for q in &a.quota {
        let bytes = parse_size(q)?;
        let slots = (bytes / h.slot_bytes) as usize;
        if slots == 0 {
            bail!("--quota {q} is smaller than one expert slot ({} bytes)", h.slot_bytes);
        }
        let mut results: Vec<_> = Policy::ALL.iter().map(|p| simulate_policy(&reqs, *p, slots)).collect();
        results.push(simulate_belady(&reqs, slots));
        rows.push((q.clone(), bytes, slots, results));
    }
    if a.json {
        let v: Vec<_> = rows
            .iter()
            .map(|(q, b, s, r)| serde_json::json!({"quota": q, "bytes": b, "slots": s, "results": r}))
            .collect();
        println!(
            "{}",
            serde_json::json!({"trace": a.file.display().to_string(), "model": h.model, "records": recs.len(), "requests": reqs.len(), "slot_bytes": h.slot_bytes, "quotas": v})
        );
        return Ok(());
    }
    println!(
        "{}: {} routing records, {} layer requests, {} experts in use, slot {:.2} MiB",
        a.file.display(),
        recs.len(),
        reqs.len(),
        total_experts,
        h.slot_bytes as f64 / (1u64 << 20) as f64
    );
    print!("{:>10} {:>7}", "quota", "slots");
    for p in Policy::ALL {
        print!(" {:>10}", p.name());
    }
    println!(" {:>10} {:>12}", "belady", "best/belady");
    for (q, _, slots, r) in &rows {
        print!("{q:>10} {slots:>7}");
        for x in r {
            print!(" {:>9.1}%", 100.0 * x.hit_rate);
        }
        let best = r[..r.len() - 1].iter().map(|x| x.hit_rate).fold(0.0, f64::max);
        let opt = r.last().expect("belady").hit_rate;
        println!(" {:>11.1}%", if opt > 0.0 { 100.0 * best / opt } else { 100.0 });
    }
    Ok(())
}
