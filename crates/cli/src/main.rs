//! `sluice`: run Mixture-of-Experts models larger than memory.

mod cmd_bench;
mod cmd_bench_io;
mod cmd_chat;
mod cmd_demo;
mod cmd_fetch;
mod cmd_fit;
mod cmd_inspect;
mod cmd_logits;
mod cmd_pack;
mod cmd_perplexity;
mod cmd_run;
mod cmd_serve;
mod cmd_synth;
mod cmd_tokenize;
mod cmd_trace;
mod common;
mod plot;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "sluice", version, about = "Run Mixture-of-Experts language models larger than memory")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The main job: stream a synthetic MoE model several times larger than the expert cache,
    /// with live statistics, and verify the output against a fully resident run.
    Demo(cmd_demo::Args),
    /// Generate text from a prompt, streaming it as it comes (`--chat`: through the model's
    /// chat template).
    Run(cmd_run::Args),
    /// Talk with a model through its chat template: one message per line of standard input,
    /// replies streamed, history kept (/reset, /exit).
    Chat(cmd_chat::Args),
    /// An OpenAI-compatible HTTP server with continuous batching (and a web page at /).
    Serve(cmd_serve::Args),
    /// Print float32 logits for every position of a token sequence.
    Logits(cmd_logits::Args),
    /// Describe a model: architecture, dimensions, tensors, bytes of dense weights vs experts.
    Inspect(cmd_inspect::Args),
    /// Token ids of a text, with the model's own tokenizer.
    Tokenize(cmd_tokenize::Args),
    /// Perplexity of a text file (llama-perplexity's chunking).
    Perplexity(cmd_perplexity::Args),
    /// Prefill and decode speed (llama-bench's protocol).
    Bench(cmd_bench::Args),
    /// Write a synthetic MoE model of a real shape as GGUF (for benchmarks and demos).
    Synth(cmd_synth::Args),
    /// Write an offload-ready pack of a model's experts (one aligned record per expert).
    Pack(cmd_pack::Args),
    /// Random-read bandwidth of a file with expert-sized direct reads (the streaming bound).
    BenchIo(cmd_bench_io::Args),
    /// Will a model fit, and how fast will it decode: placement, hit rate and decode bounds
    /// from its sizes, the memory available and measured memory and disk rates.
    Fit(cmd_fit::Args),
    /// Prepare a model at a URL: its dense weights, the experts a routing trace used most
    /// (into the disk tier), or a whole local copy (`--all`, resumable).
    Fetch(cmd_fetch::Args),
    /// Routing traces: locality statistics and plots, and replay through the cache policies and Belady's optimum.
    #[command(subcommand)]
    Trace(cmd_trace::TraceCmd),
}

fn main() {
    let cli = Cli::parse();
    // A server keeps serving whatever becomes of its standard output (it prints nothing there).
    if !matches!(cli.cmd, Cmd::Serve(_)) {
        quiet_on_closed_stdout();
    }
    let r = match cli.cmd {
        Cmd::Demo(a) => cmd_demo::main(a),
        Cmd::Run(a) => cmd_run::main(a),
        Cmd::Chat(a) => cmd_chat::main(a),
        Cmd::Serve(a) => cmd_serve::main(a),
        Cmd::Logits(a) => cmd_logits::main(a),
        Cmd::Inspect(a) => cmd_inspect::main(a),
        Cmd::Tokenize(a) => cmd_tokenize::main(a),
        Cmd::Perplexity(a) => cmd_perplexity::main(a),
        Cmd::Bench(a) => cmd_bench::main(a),
        Cmd::Synth(a) => cmd_synth::main(a),
        Cmd::Pack(a) => cmd_pack::main(a),
        Cmd::BenchIo(a) => cmd_bench_io::main(a),
        Cmd::Trace(c) => cmd_trace::main(c),
        Cmd::Fit(a) => cmd_fit::main(a),
        Cmd::Fetch(a) => cmd_fetch::main(a),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Output piped into `head` and the like: a print to standard output that finds its reader gone
/// ends the command quietly, as command-line tools end, rather than with the panic std's print
/// macros raise (`run` and `chat`, which stream tokens, stop generating at the first failed
/// write on their own). Only that panic is caught; every other one reports as before.
fn quiet_on_closed_stdout() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg =
            payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied());
        if msg.is_some_and(|m| m.starts_with("failed printing to stdout") && m.contains("Broken pipe")) {
            std::process::exit(0);
        }
        report(info)
    }));
}
