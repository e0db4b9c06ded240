//! `sluice chat`: a conversation through the model's chat template, one message per line of
//! standard input, each reply streamed as it comes. The sequence state is kept between turns,
//! so a turn runs only the tokens it adds to the conversation.

use crate::common::{ChatArgs, ModelArgs, SamplingArgs};
use anyhow::Result;
use sluice_runtime::{ChatSession, StopReason};
use std::io::{BufRead, IsTerminal, Write};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    chat: ChatArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// After each reply, print its prompt tokens (and how many were reused from the previous
    /// turn), speeds and why it stopped.
    #[arg(long)]
    stats: bool,
}

pub fn main(a: Args) -> Result<()> {
    let mut engine = a.model.load()?;
    a.chat.apply_template(&mut engine)?;
    let mut chat = ChatSession::new(&engine, a.chat.system.clone(), a.sampling.generate_options())?;
    chat.render = a.chat.render_options()?;
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    if interactive {
        eprintln!("sluice chat: one message per line; /reset starts over, /exit (or Ctrl-D) quits.");
    }
    let stdout = std::io::stdout();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                chat.reset();
                if interactive {
                    eprintln!("[conversation cleared]");
                }
                continue;
            }
            _ => {}
        }
        // A reader that went away (`sluice chat … | head`) stops the reply, then the session.
        let mut closed = false;
        let mut on_text = |t: &str| {
            let mut out = stdout.lock();
            closed = out.write_all(t.as_bytes()).and_then(|_| out.flush()).is_err();
            !closed
        };
        let turn = match chat.say(&line, &mut on_text) {
            Ok(t) => t,
            Err(e) if interactive => {
                eprintln!("error: {e}");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if closed || writeln!(stdout.lock()).is_err() {
            break;
        }
        for c in &turn.tool_calls {
            eprintln!("[tool call: {} {}]", c.name, c.arguments);
        }
        let g = &turn.generation;
        if g.stop == StopReason::Length {
            eprintln!("[the reply was cut at {} tokens; -n sets the limit]", g.tokens.len());
        }
        if a.stats {
            eprintln!(
                "[{} prompt tokens, {} reused, {} run at {:.1} tok/s; {} generated, {:.1} tok/s; stop: {}]",
                g.prompt_tokens,
                g.reused_tokens,
                g.prompt_tokens - g.reused_tokens,
                g.prefill_tok_s(),
                g.tokens.len(),
                g.decode_tok_s(),
                g.stop.as_str()
            );
        }
    }
    Ok(())
}
