use crate::common::{
    expert_stats_json, expert_stats_line, parse_tokens, ChatArgs, ModelArgs, SamplingArgs, SpecArgs, TraceObserver,
};
use anyhow::{bail, Result};
use sluice_formats::chat_template::parse_tool_calls;
use sluice_formats::{Message, TextStream};
use sluice_runtime::generate;
use std::io::Write;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text (tokenized with the model's tokenizer).
    #[arg(long, short = 'p', conflicts_with = "prompt_tokens")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long)]
    prompt_tokens: Option<String>,
    /// Send the prompt as one user turn through the model's chat template (with `--system`,
    /// after a system message), and stop at the end of the assistant's turn.
    #[arg(long, conflicts_with = "prompt_tokens")]
    chat: bool,
    #[command(flatten)]
    chat_args: ChatArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    spec: SpecArgs,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Print expert-cache statistics at the end (hit rate, bytes read, IO stall, prefetch).
    #[arg(long)]
    stats: bool,
    /// Record every routing decision to this file (see `sluice trace simulate`).
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
}

pub fn main(a: Args) -> Result<()> {
    if !a.chat && a.chat_args.any() {
        bail!("--system, --chat-template, --tools and --no-thinking apply to chat prompts: add --chat");
    }
    let method = a.spec.method()?;
    if method.is_some() && a.trace.is_some() {
        bail!("--trace records plain decoding; leave out --spec to trace");
    }
    let mtp = method == Some(sluice_runtime::spec::SpecMethod::Mtp);
    let mut engine = a.model.load_with_mtp(mtp).map_err(|e| {
        if mtp {
            e.context("--spec mtp drafts with the model's multi-token-prediction head")
        } else {
            e
        }
    })?;
    let mut opts = a.sampling.generate_options();
    let render = a.chat_args.render_options()?;
    let prompt = match (&a.prompt, &a.prompt_tokens) {
        (Some(p), _) if a.chat => {
            a.chat_args.apply_template(&mut engine)?;
            let mut messages: Vec<Message> = a.chat_args.system.iter().map(Message::system).collect();
            messages.push(Message::user(p.as_str()));
            opts.stop_tokens = engine.chat_stop_tokens();
            engine.chat_tokens(&messages, &render)?
        }
        (Some(p), _) => engine.encode(p)?,
        (None, Some(t)) => parse_tokens(t)?,
        (None, None) if a.chat => bail!("give the user's message with --prompt TEXT (or talk with `sluice chat`)"),
        (None, None) => bail!("give a prompt with --prompt TEXT or --prompt-tokens 1,2,3"),
    };
    let mut kv = engine.new_state();
    let mut stream = TextStream::new();
    let tok = engine.tokenizer.as_ref();
    let stdout = std::io::stdout();
    // A reader that went away (`sluice run … | head`) stops the generation; nothing more is
    // written to it.
    let closed = std::cell::Cell::new(false);
    let mut on_token = |id: u32| {
        if !a.json {
            let mut out = stdout.lock();
            let written = match tok {
                Some(t) => out.write_all(stream.push(t, id).as_bytes()),
                None => write!(out, "{id} "),
            };
            if written.and_then(|_| out.flush()).is_err() {
                closed.set(true);
                return false;
            }
        }
        true
    };
    let mut tracer = match &a.trace {
        Some(p) => Some(TraceObserver::create(p, &engine)?),
        None => None,
    };
    let obs = tracer.as_mut().map(|t| t as &mut dyn sluice_model::trace::Observer);
    let (g, spec_stats) = match method {
        None => (generate(&engine, &mut kv, &prompt, &opts, &mut on_token, obs)?, None),
        Some(m) => {
            let spec_opts = a.spec.options();
            let draft = a.spec.load_draft(&a.model, &engine)?;
            let mut proposer = sluice_runtime::spec::proposer(m, &engine, draft, &opts, &spec_opts)?;
            let (g, s) = sluice_runtime::spec::generate_spec(
                &engine,
                &mut kv,
                &prompt,
                &opts,
                &spec_opts,
                proposer.as_mut(),
                &mut |t, _| on_token(t),
            )?;
            (g, Some(s))
        }
    };
    if let Some(t) = tracer {
        if let Some(e) = t.error {
            anyhow::bail!("writing the trace: {e}");
        }
        let n = t.writer.map(|w| w.finish()).transpose()?.unwrap_or(0);
        eprintln!("sluice: wrote {n} routing records to {}", a.trace.as_ref().expect("set").display());
    }
    let n_tok = g.prompt_tokens + g.tokens.len();
    let text = tok.map(|t| t.decode(&g.tokens, true));
    // With tools, the calls the model wrote, taken out of the text.
    let (text, tool_calls) = match text {
        Some(t) if a.chat && render.tools.is_some() => {
            let (rest, calls) = parse_tool_calls(&t);
            (Some(rest), calls)
        }
        t => (t, Vec::new()),
    };
    let calls_json: Vec<serde_json::Value> = tool_calls
        .iter()
        .map(|c| serde_json::json!({"type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect();
    if a.json {
        let mut v = serde_json::json!({
            "token_ids": g.tokens,
            "text": text,
            "prompt_tokens": g.prompt_tokens,
            "stop": g.stop.as_str(),
            "timings": {
                "prefill_s": g.prefill_secs,
                "decode_s": g.decode_secs,
                "prefill_tok_s": g.prefill_tok_s(),
                "decode_tok_s": g.decode_tok_s(),
            },
            "experts": if a.stats || engine.model.cfg.is_moe() { expert_stats_json(&engine, n_tok) } else { serde_json::Value::Null },
        });
        if a.chat_args.tools.is_some() {
            v["tool_calls"] = calls_json.into();
        }
        if let Some(s) = &spec_stats {
            v["spec"] = if a.stats { s.details() } else { s.json() };
        }
        // Written, not printed: a closed output is not worth a panic.
        let _ = writeln!(stdout.lock(), "{v}");
    } else {
        if !closed.get() {
            let mut out = stdout.lock();
            let rest = tok.map(|t| stream.finish(t)).unwrap_or_default();
            let _ = writeln!(out, "{rest}");
        }
        for c in &tool_calls {
            eprintln!("[tool call: {} {}]", c.name, c.arguments);
        }
        eprintln!(
            "[{} prompt tokens, {:.1} tok/s prefill; {} generated, {:.1} tok/s decode; stop: {}]",
            g.prompt_tokens,
            g.prefill_tok_s(),
            g.tokens.len(),
            g.decode_tok_s(),
            g.stop.as_str()
        );
        if a.stats && engine.model.cfg.is_moe() {
            eprintln!("[{}]", expert_stats_line(&engine, n_tok));
        }
        if let Some(s) = &spec_stats {
            if a.stats {
                eprintln!("[{}]", s.lines());
            } else {
                eprintln!(
                    "[spec {}: {} of {} drafted tokens kept, {:.2} tokens per target pass]",
                    s.method,
                    s.accepted,
                    s.drafted,
                    s.tokens_per_pass()
                );
            }
        }
    }
    Ok(())
}
