//! Starting a server on an ephemeral port with a golden model, and talking to it.
#![allow(dead_code)]

use serde_json::{json, Value};
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};
use sluice_server::{ServerHandle, ServerOptions};
use std::path::PathBuf;
use std::time::Duration;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn golden(name: &str) -> PathBuf {
    let p = repo().join("tests/golden").join(name);
    assert!(p.exists(), "{} is missing: the golden checkpoints are part of the repository", p.display());
    p
}

pub fn opts() -> ServerOptions {
    ServerOptions { port: 0, parallel: 8, model_id: "test-model".into(), ..Default::default() }
}

pub fn resident() -> ExpertOptions {
    ExpertOptions { mode: ExpertMode::Resident, ..Default::default() }
}

pub struct Srv {
    pub handle: Option<ServerHandle>,
    pub base: String,
    pub client: reqwest::Client,
    pub key: Option<String>,
}

/// Starts a server on `model` and waits until it is ready.
pub async fn start(model: PathBuf, o: ServerOptions, experts: ExpertOptions) -> Srv {
    start_with(o, Box::new(move || load(model, experts).map(Into::into))).await
}

pub fn load(model: PathBuf, experts: ExpertOptions) -> Result<Engine, String> {
    Engine::load(&model, EngineOptions { threads: 2, experts, ..Default::default() }).map_err(|e| e.to_string())
}

pub async fn start_with(o: ServerOptions, loader: sluice_server::Loader) -> Srv {
    let key = o.api_key.clone();
    let handle = sluice_server::spawn(o, loader).expect("server starts");
    let base = format!("http://{}", handle.addr);
    let client = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().expect("client");
    let s = Srv { handle: Some(handle), base, client, key };
    s.wait_ready().await;
    s
}

impl Srv {
    pub async fn wait_ready(&self) {
        for _ in 0..600 {
            if let Ok(r) = self.client.get(format!("{}/health", self.base)).send().await {
                if r.status() == 200 {
                    return;
                }
                assert_ne!(r.status(), 500, "the model failed to load: {}", r.text().await.unwrap_or_default());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the server did not become ready");
    }

    pub fn post(&self, path: &str) -> reqwest::RequestBuilder {
        let r = self.client.post(format!("{}{path}", self.base));
        match &self.key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let mut r = self.client.get(format!("{}{path}", self.base));
        if let Some(k) = &self.key {
            r = r.bearer_auth(k);
        }
        let r = r.send().await.expect("request");
        (r.status().as_u16(), r.text().await.expect("body"))
    }

    /// POSTs `body`; returns the status and the JSON body.
    pub async fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.post(path).json(body).send().await.expect("request");
        let status = r.status().as_u16();
        let text = r.text().await.expect("body");
        let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
        (status, v)
    }

    /// A metric's value (summed over label sets whose text contains every `labels` part).
    pub async fn metric(&self, name: &str, labels: &[&str]) -> f64 {
        let (_, text) = self.get_text("/metrics").await;
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split([' ', '{']).next() == Some(name))
            .filter(|l| labels.iter().all(|p| l.contains(p)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub fn shutdown(mut self) {
        if let Some(h) = self.handle.take() {
            h.shutdown().expect("clean shutdown");
        }
    }
}

/// The result of a completion, streamed or not, in one shape: text, per-token logprobs,
/// finish reason, usage.
#[derive(Debug, Clone, PartialEq)]
pub struct Out {
    pub text: String,
    pub logprobs: Vec<Value>,
    pub finish: String,
    pub usage: Value,
}

/// Runs a chat or completion request (streamed if the body says so) and collects it.
pub async fn complete(s: &Srv, path: &str, body: &Value) -> Out {
    let chat = path.contains("chat");
    if body["stream"] == json!(true) {
        let r = s.post(path).json(body).send().await.expect("request");
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
        let text = r.text().await.expect("body");
        parse_sse(&text, chat)
    } else {
        let (status, v) = s.post_json(path, body).await;
        assert_eq!(status, 200, "{v}");
        let c = &v["choices"][0];
        let (text, logprobs) = if chat {
            (c["message"]["content"].as_str().unwrap_or("").to_string(), lp_entries_chat(&c["logprobs"]))
        } else {
            (c["text"].as_str().expect("text").to_string(), lp_entries_completion(&c["logprobs"]))
        };
        Out {
            text,
            logprobs,
            finish: c["finish_reason"].as_str().expect("finish").to_string(),
            usage: v["usage"].clone(),
        }
    }
}

fn lp_entries_chat(v: &Value) -> Vec<Value> {
    v["content"].as_array().cloned().unwrap_or_default()
}

/// Completions logprobs as one entry per token.
fn lp_entries_completion(v: &Value) -> Vec<Value> {
    let Some(toks) = v["tokens"].as_array() else { return Vec::new() };
    (0..toks.len())
        .map(|i| {
            json!({"token": toks[i], "logprob": v["token_logprobs"][i], "top": v["top_logprobs"][i], "offset": v["text_offset"][i]})
        })
        .collect()
}

/// Parses a whole SSE body: every event is `data: ...`, the last `data: [DONE]`.
pub fn parse_sse(body: &str, chat: bool) -> Out {
    let mut out = Out { text: String::new(), logprobs: Vec::new(), finish: String::new(), usage: Value::Null };
    let mut done = false;
    for ev in body.split("\n\n").map(str::trim).filter(|e| !e.is_empty()) {
        if ev.starts_with(':') {
            continue; // keep-alive comment
        }
        let data = ev.strip_prefix("data: ").unwrap_or_else(|| panic!("not an SSE data event: {ev:?}"));
        assert!(!done, "data after [DONE]");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("bad chunk {data}: {e}"));
        assert!(v.get("error").is_none(), "error in stream: {v}");
        if !v["usage"].is_null() {
            out.usage = v["usage"].clone();
        }
        let Some(c) = v["choices"].as_array().and_then(|a| a.first()) else { continue };
        if chat {
            assert_eq!(v["object"], "chat.completion.chunk");
            if let Some(t) = c["delta"]["content"].as_str() {
                out.text.push_str(t);
            }
            out.logprobs.extend(lp_entries_chat(&c["logprobs"]));
        } else {
            assert_eq!(v["object"], "text_completion");
            out.text.push_str(c["text"].as_str().expect("text"));
            out.logprobs.extend(lp_entries_completion(&c["logprobs"]));
        }
        if let Some(f) = c["finish_reason"].as_str() {
            out.finish = f.to_string();
        }
    }
    assert!(done, "the stream did not end with [DONE]: {body}");
    out
}

/// A real GGUF model fetched by tools/models/fetch.sh (a missing one fails the test).
pub fn real_model(name: &str) -> PathBuf {
    let dir = std::env::var_os("SLUICE_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/sluice/models"));
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is missing: run the tests with tools/test.sh, which fetches the real models (or run tools/models/fetch.sh, or set SLUICE_MODELS)",
        p.display()
    );
    p
}
