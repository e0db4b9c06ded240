use crate::common::parse_size;
use anyhow::{bail, Result};
use sluice_experts::trace::stats::{shift, stats, TraceStats};
use sluice_experts::trace::{read, requests, sweep, QuotaRow, Record, TraceHeader};
use sluice_experts::Policy;
use std::path::{Path, PathBuf};

#[derive(clap::Subcommand)]
pub enum TraceCmd {
    /// Replay a routing trace through each eviction policy and Belady's optimum.
    Simulate(SimArgs),
    /// Expert locality of one or more traces: coverage, windows, stability, layer-to-layer
    /// predictability, hit rate against quota, and the shift between traces.
    Stats(StatsArgs),
}

#[derive(clap::Args)]
pub struct SimArgs {
    /// A trace written by `sluice run --trace FILE`.
    file: PathBuf,
    /// Cache sizes to simulate (e.g. 2GiB 4GiB); repeat the flag or list several.
    #[arg(long, num_args = 1.., required = true)]
    quota: Vec<String>,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct StatsArgs {
    /// Traces written by `sluice run --trace FILE` (two or more also get their shift).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Window sizes in tokens for the distinct-experts and stability figures.
    #[arg(long, num_args = 1.., default_values_t = [1usize, 4, 16, 64, 256])]
    window: Vec<usize>,
    /// Cache sizes for the hit-rate sweep (default: 2% to 100% of the routed experts).
    #[arg(long, num_args = 1..)]
    quota: Vec<String>,
    /// Write SVG plots (coverage, windows, hit rate, heat map) for each trace here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Print each layer's figures too.
    #[arg(long)]
    per_layer: bool,
}

fn load(file: &Path) -> Result<(TraceHeader, Vec<Record>)> {
    let (h, recs) = read(file).map_err(|e| anyhow::anyhow!(e))?;
    if recs.is_empty() {
        bail!("{}: the trace holds no routing records", file.display());
    }
    Ok((h, recs))
}

fn routed_layers(recs: &[Record]) -> usize {
    recs.iter().map(|r| r.layer).collect::<std::collections::BTreeSet<_>>().len()
}

fn slots_for(quotas: &[String], h: &TraceHeader) -> Result<Vec<usize>> {
    quotas
        .iter()
        .map(|q| {
            let slots = (parse_size(q)? / h.slot_bytes) as usize;
            if slots == 0 {
                bail!("--quota {q} is smaller than one expert slot ({} bytes)", h.slot_bytes);
            }
            Ok(slots)
        })
        .collect()
}

pub fn main(c: TraceCmd) -> Result<()> {
    match c {
        TraceCmd::Simulate(a) => simulate(a),
        TraceCmd::Stats(a) => stats_cmd(a),
    }
}

fn simulate(a: SimArgs) -> Result<()> {
    let (h, recs) = load(&a.file)?;
    let reqs = requests(&recs);
    let layers = routed_layers(&recs);
    let total_experts = h.n_expert * layers;
    let slots = slots_for(&a.quota, &h)?;
    let tokens = recs.len() / layers.max(1);
    let rows = sweep(&reqs, &h, &slots, tokens);
    if a.json {
        let v: Vec<_> = rows
            .iter()
            .zip(&a.quota)
            .map(|(r, q)| serde_json::json!({"quota": q, "bytes": r.bytes, "slots": r.slots, "results": r.results}))
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
    for (q, r) in a.quota.iter().zip(&rows) {
        print!("{q:>10} {:>7}", r.slots);
        for x in &r.results {
            print!(" {:>9.1}%", 100.0 * x.hit_rate);
        }
        let best = r.results[..r.results.len() - 1].iter().map(|x| x.hit_rate).fold(0.0, f64::max);
        let opt = r.results.last().expect("belady").hit_rate;
        println!(" {:>11.1}%", if opt > 0.0 { 100.0 * best / opt } else { 100.0 });
    }
    Ok(())
}

struct Analysed {
    file: PathBuf,
    header: TraceHeader,
    stats: TraceStats,
    rows: Vec<QuotaRow>,
}

fn stats_cmd(a: StatsArgs) -> Result<()> {
    if a.window.contains(&0) {
        bail!("--window must be at least one token");
    }
    let mut all = Vec::new();
    for f in &a.files {
        let (h, recs) = load(f)?;
        let st = stats(&h, &recs, &a.window);
        let slots = if a.quota.is_empty() {
            let total = h.n_expert * st.layers.len();
            let mut v: Vec<usize> = [0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]
                .iter()
                .map(|f| ((total as f64 * f).round() as usize).max(h.n_expert_used.max(1)))
                .collect();
            v.dedup();
            v
        } else {
            slots_for(&a.quota, &h)?
        };
        let rows = sweep(&requests(&recs), &h, &slots, st.tokens);
        all.push(Analysed { file: f.clone(), header: h, stats: st, rows });
    }
    let mut shifts = Vec::new();
    for i in 0..all.len() {
        for j in i + 1..all.len() {
            let s = shift(&all[i].stats, &all[j].stats)
                .map_err(|e| anyhow::anyhow!("{} and {}: {e}", all[i].file.display(), all[j].file.display()))?;
            shifts.push((i, j, s));
        }
    }
    let mut plots = Vec::new();
    if let Some(dir) = &a.svg {
        for t in &all {
            let stem = t.file.file_stem().map_or("trace".into(), |s| s.to_string_lossy().into_owned());
            plots.extend(crate::plot::trace_plots(dir, &stem, &stem, &t.stats, &t.rows)?);
        }
    }
    if a.json {
        let traces: Vec<_> = all
            .iter()
            .map(|t| {
                serde_json::json!({
                    "trace": t.file.display().to_string(), "model": t.header.model,
                    "slot_bytes": t.header.slot_bytes, "expert_bytes": t.header.expert_bytes,
                    "stats": t.stats, "quotas": t.rows,
                })
            })
            .collect();
        let sh: Vec<_> = shifts
            .iter()
            .map(|(i, j, s)| {
                serde_json::json!({"a": all[*i].file.display().to_string(), "b": all[*j].file.display().to_string(), "shift": s})
            })
            .collect();
        let plots: Vec<String> = plots.iter().map(|p| p.display().to_string()).collect();
        println!("{}", serde_json::json!({"traces": traces, "shift": sh, "plots": plots}));
        return Ok(());
    }
    for t in &all {
        print_stats(t, a.per_layer);
    }
    for (i, j, s) in &shifts {
        println!(
            "shift {} → {}: total variation {:.3}, weighted Jaccard {:.3} (mean over {} layers; 0 and 1 for the same distribution)",
            all[*i].file.display(),
            all[*j].file.display(),
            s.total_variation,
            s.weighted_jaccard,
            s.per_layer.len()
        );
    }
    for p in &plots {
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

fn print_stats(t: &Analysed, per_layer: bool) {
    let (s, h, o) = (&t.stats, &t.header, &t.stats.overall);
    println!(
        "{}: {} tokens through {} routed layers, {} of {} experts per token ({})",
        t.file.display(),
        s.tokens,
        s.layers.len(),
        s.n_expert_used,
        s.n_expert,
        h.model
    );
    println!(
        "  expert use:   top 10% of experts take {}, top 20% take {}; entropy {:.3} of uniform  (uniform: 10%, 20%, 1)",
        pct(o.top10_share),
        pct(o.top20_share),
        o.entropy_ratio
    );
    println!(
        "  token→token:  first choice repeats {} (uniform {}), experts reused {} (uniform {})",
        pct(o.top1_repeat),
        pct(o.uniform.top1_repeat),
        pct(o.reuse),
        pct(o.uniform.reuse)
    );
    if let (Some(p), Some(pp)) = (o.next_layer_precision, o.popularity_precision) {
        println!(
            "  layer→layer:  the layer before predicts {} of a token's experts (popularity alone {}, uniform {}; learned on the first half, scored on the second)",
            pct(p),
            pct(pp),
            pct(o.uniform.precision)
        );
    }
    println!(
        "  LRU per layer: {} hits with k = {} experts cached per layer, {} with 2k  (uniform {}, {})",
        pct(o.lru_k),
        s.n_expert_used,
        pct(o.lru_2k),
        pct(o.uniform.lru_k),
        pct(o.uniform.lru_2k)
    );
    println!("  {:>8} {:>10} {:>10} {:>9} {:>9}", "window", "distinct", "uniform", "Jaccard", "uniform");
    for w in &o.windows {
        if w.windows == 0 {
            println!("  {:>8} {:>10}   (the trace is shorter than the window)", w.w, "-");
            continue;
        }
        println!(
            "  {:>8} {:>10.1} {:>10.1} {:>9.3} {:>9.3}",
            w.w, w.distinct, w.uniform_distinct, w.jaccard, w.uniform_jaccard
        );
    }
    print!("  {:>10} {:>7}", "quota", "slots");
    let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).chain(["belady"]).collect();
    for n in &names {
        print!(" {n:>10}");
    }
    for n in &names {
        print!(" {:>11}", format!("{n} MB/t"));
    }
    println!(" {:>12}", "best/belady");
    for r in &t.rows {
        print!("  {:>10} {:>7}", format!("{:.2}GiB", r.bytes as f64 / (1u64 << 30) as f64), r.slots);
        for x in &r.results {
            print!(" {:>10}", pct(x.hit_rate));
        }
        for b in &r.bytes_per_token {
            print!(" {:>11.2}", b / 1e6);
        }
        let opt = *r.bytes_per_token.last().expect("belady");
        let best = r.bytes_per_token[..r.bytes_per_token.len() - 1].iter().copied().fold(f64::INFINITY, f64::min);
        println!(" {:>11.2}×", if opt > 0.0 { best / opt } else { 1.0 });
    }
    if per_layer {
        println!("  {:>6} {:>8} {:>8} {:>8} {:>8}", "layer", "top 20%", "entropy", "repeat", "reuse");
        for l in &s.layers {
            println!(
                "  {:>6} {:>8} {:>8.3} {:>8} {:>8}",
                l.layer,
                pct(top20(&l.coverage)),
                l.entropy_ratio,
                pct(l.top1_repeat),
                pct(l.reuse)
            );
        }
    }
}

fn top20(cov: &[f64]) -> f64 {
    sluice_experts::trace::stats::top_share(cov, 0.2)
}
