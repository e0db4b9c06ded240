//! Chat prompts and multi-turn chat.
//!
//! * The real GGUF models (tools/models/fetch.sh) turn the conversations of tests/chat into
//!   exactly the prompt token ids llama-server (`--jinja`) used for them
//!   (tools/golden/make_chat_goldens.py): the model's own template, special tokens parsed in
//!   the rendered text, BOS added only where the model adds it and the template did not.
//!   Without the models the tests fail, naming the step that fetches them.
//! * A chat keeps its sequence state between turns and runs only what a turn adds; every
//!   reply is the one a fresh run of the whole prompt gives, for attention (cut back where
//!   prompts part) and recurrent state (restored from the snapshot at the last prompt's end).

use sluice_formats::chat_template::JsonValue;
use sluice_formats::{ChatTemplate, Message, RenderOptions};
use sluice_runtime::{generate, generate_cached, ChatSession, Engine, EngineOptions, GenerateOptions, PromptCache};
use std::path::PathBuf;

fn tests_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests")
}

fn models_dir() -> PathBuf {
    std::env::var_os("SLUICE_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sluice/models"))
}

fn real_model(stem: &str) -> Engine {
    let path = models_dir().join(format!("{stem}.gguf"));
    if !path.exists() {
        panic!(
            "{} is missing: run the tests with tools/test.sh, which fetches the real models (or run tools/models/fetch.sh, or set SLUICE_MODELS)",
            path.display()
        );
    }
    Engine::load(&path, EngineOptions { threads: 2, max_context: 2048, ..Default::default() }).unwrap()
}

fn ids(v: &JsonValue) -> Vec<u32> {
    (0..v.len()).map(|i| v.at(i).unwrap().as_u64().unwrap() as u32).collect()
}

/// Every conversation of `tests/chat/<stem>.json` gives llama-server's prompt token ids.
fn check_llama_server_tokens(stem: &str) {
    let mut e = real_model(stem);
    // Parsed keeping the order of object keys (the tools' JSON is rendered in that order).
    let rec =
        JsonValue::parse(&std::fs::read_to_string(tests_dir().join(format!("chat/{stem}.json"))).unwrap()).unwrap();
    let (bos, eos) = e.special_texts();
    assert_eq!(Some(bos.as_str()), rec.get("bos_token").unwrap().as_str(), "{stem}: bos_token");
    assert_eq!(Some(eos.as_str()), rec.get("eos_token").unwrap().as_str(), "{stem}: eos_token");
    if rec.get("template").unwrap().as_str() == Some("chatml-fallback") {
        // The file has no template: sluice says so, and llama.cpp's fallback gives its tokens.
        let err = e.chat_template().unwrap_err().to_string();
        assert!(err.contains("no chat template") && err.contains("--chat-template"), "{err}");
        e.set_chat_template(ChatTemplate::chatml(&bos, &eos));
    }
    let convs = rec.get("conversations").unwrap();
    for i in 0..convs.len() {
        let c = convs.at(i).unwrap();
        let name = c.get("name").unwrap().as_str().unwrap().to_string();
        let messages = Message::list_from_value(&c.get("messages").unwrap()).unwrap();
        let opts = RenderOptions {
            add_generation_prompt: c.get("add_generation_prompt").unwrap().as_bool().unwrap(),
            tools: c.get("tools"),
            ..Default::default()
        };
        let got = e.chat_tokens(&messages, &opts).unwrap();
        let want = ids(&c.get("tokens").unwrap());
        if got != want {
            let at = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            panic!(
                "{stem}: {name}: prompt tokens differ from llama-server's at position {at} (ours {:?}, theirs {:?})",
                &got[at..(at + 8).min(got.len())],
                &want[at..(at + 8).min(want.len())]
            );
        }
    }
    assert!(convs.len() >= 5, "{stem}: only {} recorded conversations", convs.len());
}

#[test]
fn qwen25_prompt_tokens_equal_llama_servers() {
    check_llama_server_tokens("qwen2.5-coder-0.5b-q4_k_m");
}

#[test]
fn smollm2_prompt_tokens_equal_llama_servers() {
    check_llama_server_tokens("smollm2-135m-instruct-q4_1");
}

#[test]
fn gemma3_without_a_template_says_so_and_chatml_gives_llama_servers_tokens() {
    check_llama_server_tokens("gemma3-270m-q4_k_m");
}

#[test]
fn end_of_turn_tokens_stop_a_chat_reply() {
    let e = real_model("qwen2.5-coder-0.5b-q4_k_m");
    let im_end = e.tokenizer().unwrap().token_id("<|im_end|>").unwrap();
    assert!(e.chat_stop_tokens().contains(&im_end));
    // A short greedy chat: the reply ends at <|im_end|> (or the token budget), and the
    // end-of-turn marker is not part of its text.
    let opts = GenerateOptions { max_new_tokens: 48, ..Default::default() };
    let mut chat = ChatSession::new(&e, Some("Answer with one word.".into()), opts).unwrap();
    let mut streamed = String::new();
    let t = chat
        .say("What is the capital of France?", &mut |s| {
            streamed.push_str(s);
            true
        })
        .unwrap();
    assert_eq!(streamed, t.text);
    assert!(!t.text.contains("<|im_end|>"));
    assert!(t.text.contains("Paris"), "{:?}", t.text);
    assert_eq!(t.generation.tokens.last(), Some(&im_end), "{:?}", t.generation.stop);
}

/// Three turns; each reply must be what a fresh run of its whole prompt gives, and every turn
/// after the first must reuse the previous prompt.
fn chat_reuses_and_matches_fresh_runs(e: &Engine, messages: &[&str]) {
    let opts = GenerateOptions { max_new_tokens: 12, ..Default::default() };
    let mut chat = ChatSession::new(e, Some("You are a test.".into()), opts.clone()).unwrap();
    let mut last_prompt = 0;
    for (turn, m) in messages.iter().enumerate() {
        let mut with_user = chat.messages.clone();
        with_user.push(Message::user(*m));
        let prompt = e.chat_tokens(&with_user, &RenderOptions::default()).unwrap();
        let t = chat.say(m, &mut |_| true).unwrap();
        let mut kv = e.new_state();
        let stop = GenerateOptions { stop_tokens: e.chat_stop_tokens(), ..opts.clone() };
        let fresh = generate(e, &mut kv, &prompt, &stop, &mut |_| true, None).unwrap();
        assert_eq!(t.generation.tokens, fresh.tokens, "turn {turn}: the reply differs from a fresh run");
        assert_eq!(t.generation.prompt_tokens, prompt.len());
        if turn > 0 {
            assert!(
                t.generation.reused_tokens >= last_prompt.min(prompt.len() - 1) || e.new_state().has_recurrent(),
                "turn {turn}: reused {} of {} prompt tokens, the previous prompt had {last_prompt}",
                t.generation.reused_tokens,
                prompt.len()
            );
            assert!(t.generation.reused_tokens > 0, "turn {turn}: nothing reused");
        }
        last_prompt = prompt.len();
    }
    // After a reset the system prompt's tokens are still reused by attention state; a
    // recurrent state has no snapshot there and starts over. Either way: a fresh run's reply.
    chat.reset();
    let t = chat.say(messages[0], &mut |_| true).unwrap();
    assert_eq!(t.generation.reused_tokens > 0, !e.new_state().has_recurrent());
    assert_eq!(chat.messages.len(), 3);
}

#[test]
fn chat_turns_reuse_state_on_a_real_model() {
    let e = real_model("smollm2-135m-instruct-q4_1");
    chat_reuses_and_matches_fresh_runs(&e, &["Hello!", "Name three colours.", "Which one is the darkest?"]);
}

fn golden(name: &str) -> Engine {
    Engine::load(&tests_dir().join("golden").join(name), EngineOptions { threads: 2, ..Default::default() }).unwrap()
}

#[test]
fn chat_turns_reuse_state_on_attention_and_recurrent_goldens() {
    // Hugging Face checkpoints whose tokenizer_config.json carries a ChatML template.
    for name in ["qwen3", "qwen3_next"] {
        let e = golden(name);
        assert!(e.chat_template().unwrap().origin().contains("tokenizer_config.json"));
        chat_reuses_and_matches_fresh_runs(&e, &["hi", "more", "again"]);
    }
}

/// `generate_cached` on token ids: extending, parting after the previous prompt, parting
/// inside it, and an identical prompt, each equal to a fresh `generate`.
#[test]
fn cached_generation_rewinds_where_prompts_part() {
    for name in ["qwen3", "qwen3_next"] {
        let e = golden(name);
        let recurrent = e.new_state().has_recurrent();
        let opts = GenerateOptions { max_new_tokens: 6, ignore_eos: true, ..Default::default() };
        let mut kv = e.new_state();
        let mut cache = PromptCache::new();
        let mut run = |prompt: &[u32]| {
            let g = generate_cached(&e, &mut kv, &mut cache, prompt, &opts, &mut |_| true, None).unwrap();
            let mut fresh_kv = e.new_state();
            let fresh = generate(&e, &mut fresh_kv, prompt, &opts, &mut |_| true, None).unwrap();
            assert_eq!(g.tokens, fresh.tokens, "{name}: {prompt:?}");
            g
        };
        let a: Vec<u32> = (10..30).collect();
        let g = run(&a);
        assert_eq!(g.reused_tokens, 0);
        // The prompt extends what the state holds: the previous prompt and reply (but its last
        // token, never run) are kept.
        let mut b = a.clone();
        b.extend(&g.tokens);
        b.extend([40, 41, 42]);
        let g = run(&b);
        assert_eq!(g.reused_tokens, a.len() + 5, "{name}");
        // Parts from the state after the previous prompt, inside its reply: attention keeps
        // everything before the parting; recurrent state returns to the previous prompt's end.
        let mut c = b.clone();
        c.extend(&g.tokens[..2]);
        c.push(g.tokens[2] ^ 1);
        c.push(7);
        let g = run(&c);
        assert_eq!(g.reused_tokens, if recurrent { b.len() } else { b.len() + 2 }, "{name}");
        // Parts inside the previous prompt: attention is cut there; recurrent starts over.
        let mut d = c[..25].to_vec();
        d.extend([3, 4, 5]);
        let g = run(&d);
        assert_eq!(g.reused_tokens, if recurrent { 0 } else { 25 }, "{name}");
        // The same prompt again: all but its last token are kept (attention).
        let g = run(&d);
        assert_eq!(g.reused_tokens, if recurrent { 0 } else { d.len() - 1 }, "{name}");
    }
}
