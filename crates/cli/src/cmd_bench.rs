use crate::common::{gpu_stats_json, gpu_stats_lines, stats_json, stats_line, ModelArgs};
use anyhow::Result;
use sluice_runtime::bench::{bench, BenchOptions};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens of the prefill test (0: skip it).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    prompt: usize,
    /// Decode steps of the generation test (0: skip it).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    gen: usize,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 3)]
    reps: usize,
    /// Tokens per forward pass during prefill.
    #[arg(long, default_value_t = 512)]
    ubatch: usize,
    #[arg(long)]
    json: bool,
}

pub fn main(a: Args) -> Result<()> {
    let mut model = a.model.clone();
    model.ctx = model.ctx.max(a.prompt.max(a.gen) + 16);
    let engine = model.load()?;
    let o = BenchOptions { prompt: a.prompt, gen: a.gen, reps: a.reps.max(1), ubatch: a.ubatch, ..Default::default() };
    let r = bench(&engine, &o)?;
    let threads = engine.model.pool.n_threads();
    if a.json {
        let mut v = serde_json::json!({
            "model": engine.path.display().to_string(),
            "threads": threads,
            "n_prompt": a.prompt, "n_gen": a.gen, "reps": o.reps,
            "prefill_tok_s": r.prefill_mean(), "prefill_tok_s_stdev": r.prefill_stdev(),
            "decode_tok_s": r.decode_mean(), "decode_tok_s_stdev": r.decode_stdev(),
            "prefill_runs": r.prefill_tok_s, "decode_runs": r.decode_tok_s,
            "dense_bytes": engine.model.dense_bytes(),
            "experts": {
                "placement": engine.placement,
                "routing_note": engine.routing_note(),
                "prefill": stats_json(&r.prefill_experts_total(), &engine.placement, o.reps * a.prompt),
                "decode": stats_json(&r.decode_experts_total(), &engine.placement, o.reps * a.gen),
                "prefill_runs": r.prefill_experts.iter().map(|s| stats_json(s, &engine.placement, a.prompt)).collect::<Vec<_>>(),
                "decode_runs": r.decode_experts.iter().map(|s| stats_json(s, &engine.placement, a.gen)).collect::<Vec<_>>(),
            },
        });
        // The GPU's counters cover both tests (its backends count per process).
        gpu_stats_json(&engine, &mut v);
        println!("{v}");
    } else {
        println!("{}  threads {threads}", engine.path.display());
        if a.prompt > 0 {
            println!("  pp{:<5} {:8.2} ± {:.2} tok/s", a.prompt, r.prefill_mean(), r.prefill_stdev());
        }
        if a.gen > 0 {
            println!("  tg{:<5} {:8.2} ± {:.2} tok/s", a.gen, r.decode_mean(), r.decode_stdev());
        }
        if engine.streaming.is_some() {
            if a.prompt > 0 {
                println!("  pp {}", stats_line(&r.prefill_experts_total(), o.reps * a.prompt));
            }
            if a.gen > 0 {
                println!("  tg {}", stats_line(&r.decode_experts_total(), o.reps * a.gen));
            }
            if let Some(note) = engine.routing_note() {
                println!("  note: {note}");
            }
        }
        for g in gpu_stats_lines(&engine) {
            println!("  {g}");
        }
    }
    Ok(())
}
