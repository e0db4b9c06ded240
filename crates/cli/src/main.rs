//! `sluice`: run Mixture-of-Experts models larger than memory.

mod cmd_inspect;
mod cmd_logits;
mod cmd_run;
mod common;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "sluice", version, about = "Run Mixture-of-Experts language models larger than memory")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt, streaming it as it comes.
    Run(cmd_run::Args),
    /// Print float32 logits for every position of a token sequence.
    Logits(cmd_logits::Args),
    /// Describe a model: architecture, dimensions, tensors, bytes of dense weights vs experts.
    Inspect(cmd_inspect::Args),
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Run(a) => cmd_run::main(a),
        Cmd::Logits(a) => cmd_logits::main(a),
        Cmd::Inspect(a) => cmd_inspect::main(a),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
