//! `sluice serve` end to end: a server on an ephemeral port with golden checkpoints (and the
//! real Qwen2.5-Coder GGUF where a slow model is needed), driven over HTTP.

mod common;

use common::*;
use serde_json::{json, Value};
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};
use sluice_server::{Loaded, ServerOptions, SpecMethod};
use std::time::{Duration, Instant};

const CHAT: &str = "/v1/chat/completions";
const COMP: &str = "/v1/completions";

/// Eight requests of different lengths and kinds: chat and completions, streamed and not,
/// greedy and sampled, all with log-probabilities.
fn mixed_requests() -> Vec<(&'static str, Value)> {
    let mut v = Vec::new();
    for i in 0..8usize {
        let stream = i % 3 != 0;
        let temp = if i % 2 == 0 { 0.0 } else { 0.9 };
        let n = 6 + 9 * i;
        if i % 2 == 0 {
            let words = "the quick brown fox ".repeat(1 + i / 2);
            v.push((
                COMP,
                json!({"prompt": format!("{i}: {words}"), "max_tokens": n, "temperature": temp, "seed": 100 + i,
                       "logprobs": 3, "stream": stream, "ignore_eos": true}),
            ));
        } else {
            v.push((
                CHAT,
                json!({"messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": format!("question {i}: {}", "why? ".repeat(i))}],
                       "max_tokens": n, "temperature": temp, "top_p": 0.95, "top_k": 40, "min_p": 0.01, "seed": 7 * i,
                       "presence_penalty": 0.3, "frequency_penalty": 0.2,
                       "logprobs": true, "top_logprobs": 2, "stream": stream, "ignore_eos": true}),
            ));
        }
    }
    v
}

async fn run_alone(s: &Srv, reqs: &[(&'static str, Value)]) -> Vec<Out> {
    let mut out = Vec::new();
    for (p, b) in reqs {
        out.push(complete(s, p, b).await);
    }
    out
}

async fn run_together(s: &Srv, reqs: &[(&'static str, Value)]) -> Vec<Out> {
    let futs = reqs.iter().map(|(p, b)| complete(s, p, b));
    futures_join_all(futs).await
}

/// Awaits all futures concurrently (on this task), in order.
async fn futures_join_all<F: std::future::Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let handles: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut results: Vec<Option<F::Output>> = handles.iter().map(|_| None).collect();
    let mut pending: Vec<(usize, std::pin::Pin<Box<F>>)> = handles.into_iter().enumerate().collect();
    std::future::poll_fn(|cx| {
        pending.retain_mut(|(i, f)| match f.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => {
                results[*i] = Some(v);
                false
            }
            std::task::Poll::Pending => true,
        });
        if pending.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    results.into_iter().map(|r| r.expect("every future finished")).collect()
}

fn with_stream(b: &Value, stream: bool) -> Value {
    let mut b = b.clone();
    b["stream"] = json!(stream);
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    } else if let Some(o) = b.as_object_mut() {
        o.remove("stream_options");
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streamed_text_is_the_non_streamed_text() {
    let s = start(golden("qwen3_moe"), opts(), resident()).await;
    for (path, body) in mixed_requests().into_iter().take(4) {
        let whole = complete(&s, path, &with_stream(&body, false)).await;
        let streamed = complete(&s, path, &with_stream(&body, true)).await;
        assert!(!whole.text.is_empty());
        assert_eq!(whole.text, streamed.text, "{path}");
        assert_eq!(whole.logprobs, streamed.logprobs, "{path}");
        assert_eq!(whole.finish, streamed.finish);
        assert_eq!(whole.logprobs.len() as u64, whole.usage["completion_tokens"].as_u64().unwrap());
        // include_usage: the last chunk carries the same counts.
        assert_eq!(whole.usage["completion_tokens"], streamed.usage["completion_tokens"]);
        assert_eq!(whole.usage["prompt_tokens"], streamed.usage["prompt_tokens"]);
    }
    s.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_get_the_bits_they_get_alone() {
    let s = start(golden("qwen3_moe"), ServerOptions { prefix_cache_bytes: 0, ..opts() }, resident()).await;
    let reqs = mixed_requests();
    let alone = run_alone(&s, &reqs).await;
    let (b0, c0) = (s.metric("sluice_batch_size_sum", &[]).await, s.metric("sluice_batch_size_count", &[]).await);
    let together = run_together(&s, &reqs).await;
    let (b1, c1) = (s.metric("sluice_batch_size_sum", &[]).await, s.metric("sluice_batch_size_count", &[]).await);
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "request {i} differs when run beside the others");
        assert!(!a.logprobs.is_empty());
    }
    // They did share forward passes.
    assert!((b1 - b0) / (c1 - c0) > 1.5, "mean batch size {}", (b1 - b0) / (c1 - c0));
    // Sampled requests with different seeds differ (the samplers are per request).
    let mut r = reqs[1].1.clone();
    r["seed"] = json!(12345);
    let other = complete(&s, CHAT, &with_stream(&r, false)).await;
    assert_ne!(other.logprobs, alone[1].logprobs);
    s.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let s = start(golden("qwen3_moe"), ServerOptions { max_body_bytes: 16 << 10, ..opts() }, resident()).await;
    let check = |status: u16, v: &Value, want: u16, param: Option<&str>| {
        assert_eq!(status, want, "{v}");
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string() && e["code"].is_string(), "{v}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{v}");
        }
    };
    // Malformed JSON.
    let r = s.post(CHAT).header("content-type", "application/json").body("{\"messages\": [").send().await.unwrap();
    let status = r.status().as_u16();
    check(status, &r.json::<Value>().await.unwrap(), 400, None);
    // Negative max_tokens, a type error, missing messages, n > 1, bad prompt tokens.
    let (st, v) = s.post_json(CHAT, &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5})).await;
    check(st, &v, 400, Some("max_tokens"));
    let (st, v) = s.post_json(COMP, &json!({"prompt": "hi", "temperature": "hot"})).await;
    check(st, &v, 400, Some("temperature"));
    let (st, v) = s.post_json(CHAT, &json!({"model": "x"})).await;
    check(st, &v, 400, Some("messages"));
    let (st, v) = s.post_json(CHAT, &json!({"messages": [{"role": "user", "content": "hi"}], "n": 3})).await;
    check(st, &v, 400, Some("n"));
    let (st, v) = s.post_json(COMP, &json!({"prompt": [1, 2, 999999]})).await;
    check(st, &v, 400, Some("prompt"));
    let (st, v) = s.post_json(CHAT, &json!({"messages": [{"content": "no role"}]})).await;
    check(st, &v, 400, Some("messages"));
    // More than the context: the prompt alone, and prompt + max_tokens.
    let (st, v) = s.post_json(COMP, &json!({"prompt": "word ".repeat(400)})).await;
    check(st, &v, 400, Some("prompt"));
    let (st, v) = s.post_json(COMP, &json!({"prompt": "hi", "max_tokens": 10_000})).await;
    check(st, &v, 400, Some("max_tokens"));
    // An oversize body.
    // The server reads no more of it, so it closes the connection and says so (a keep-alive
    // client would otherwise send its next request into the closing socket).
    let big = json!({"prompt": "x".repeat(64 << 10)});
    let r = s.post(COMP).json(&big).send().await.unwrap();
    let (st, close) = (r.status().as_u16(), r.headers().get("connection").cloned());
    check(st, &r.json::<Value>().await.unwrap(), 413, None);
    assert_eq!(close.as_ref().and_then(|c| c.to_str().ok()), Some("close"), "{close:?}");
    // Unknown endpoint, wrong method.
    let (st, text) = s.get_text("/v1/nothing").await;
    check(st, &serde_json::from_str(&text).unwrap(), 404, None);
    let (st, text) = s.get_text(CHAT).await;
    check(st, &serde_json::from_str(&text).unwrap(), 405, None);
    // Still serving.
    let ok = complete(&s, COMP, &json!({"prompt": "hello", "max_tokens": 4, "ignore_eos": true})).await;
    assert_eq!(ok.usage["completion_tokens"], 4);
    assert!(s.metric("sluice_http_requests_total", &["status=\"400\""]).await >= 8.0);
    s.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_key_is_required_on_v1() {
    let mut s =
        start(golden("qwen3_moe"), ServerOptions { api_key: Some("sekrit".into()), ..opts() }, resident()).await;
    let body = json!({"prompt": "hi", "max_tokens": 2});
    let r = s.client.post(format!("{}{COMP}", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let r = s.client.post(format!("{}{COMP}", s.base)).bearer_auth("wrong").json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = s.client.get(format!("{}/v1/models", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 401);
    // /health, /metrics and the page need no key.
    assert_eq!(s.client.get(format!("{}/health", s.base)).send().await.unwrap().status(), 200);
    assert_eq!(s.client.get(format!("{}/", s.base)).send().await.unwrap().status(), 200);
    // The right key works.
    let (st, v) = s.post_json(COMP, &body).await;
    assert_eq!(st, 200, "{v}");
    let (st, models) = s.get_text("/v1/models").await;
    assert_eq!(st, 200);
    assert!(models.contains("test-model"));
    s.key = None;
    s.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_is_503_while_loading_and_requests_wait_for_nothing() {
    let model = golden("qwen3_moe");
    let loader: sluice_server::Loader = Box::new(move || {
        std::thread::sleep(Duration::from_millis(1500));
        load(model, resident()).map(Into::into)
    });
    let handle = sluice_server::spawn(opts(), loader).unwrap();
    let base = format!("http://{}", handle.addr);
    let c = reqwest::Client::new();
    let r = c.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let r = c.post(format!("{base}{COMP}")).json(&json!({"prompt": "hi"})).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("loading"));
    let s = Srv { handle: Some(handle), base, client: c, key: None };
    s.wait_ready().await;
    s.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queue_limit_and_memory_admission() {
    // One slot, no queue: a second request while one runs is turned away with 429.
    let model = real_model("qwen2.5-coder-0.5b-q4_k_m.gguf");
    let o = ServerOptions { parallel: 1, max_queue: 0, ctx_size: 512, ..opts() };
    let s = start(model.clone(), o, ExpertOptions::default()).await;
    let long =
        json!({"prompt": "def fib(n):", "max_tokens": 200, "ignore_eos": true, "temperature": 0, "stream": true});
    let r = s.post(COMP).json(&long).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (st, v) = s.post_json(COMP, &json!({"prompt": "hi", "max_tokens": 2})).await;
    assert_eq!(st, 429, "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    drop(r);
    s.shutdown();
    // Memory for one sequence of 300 positions: a request needing more is a 400 naming
    // max_tokens; two that fit one at a time run one after the other.
    let cfg_bytes = |n: usize| {
        let e = load(model.clone(), ExpertOptions::default()).unwrap();
        e.model.cfg.state_bytes(n)
    };
    let budget = cfg_bytes(300);
    let o = ServerOptions { parallel: 4, ctx_size: 512, state_memory: Some(budget), prefix_cache_bytes: 0, ..opts() };
    let s = start(model, o, ExpertOptions::default()).await;
    let (st, v) = s.post_json(COMP, &json!({"prompt": "hi", "max_tokens": 400})).await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "max_tokens");
    let b = json!({"prompt": "def add(a, b):", "max_tokens": 150, "ignore_eos": true, "temperature": 0});
    let alone = complete(&s, COMP, &b).await;
    let both = futures_join_all([complete(&s, COMP, &b), complete(&s, COMP, &b)]).await;
    assert_eq!(both[0], alone);
    assert_eq!(both[1], alone);
    // They never ran together.
    assert_eq!(
        s.metric("sluice_batch_size_bucket", &["le=\"1\""]).await,
        s.metric("sluice_batch_size_count", &[]).await
    );
    s.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_frees_its_slot() {
    // A model slow enough that 400 tokens take seconds; one slot.
    let o = ServerOptions { parallel: 1, ctx_size: 512, ..opts() };
    let s = start(real_model("qwen2.5-coder-0.5b-q4_k_m.gguf"), o, ExpertOptions::default()).await;
    let long = json!({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true, "stream": true});
    let mut r = s.post(COMP).json(&long).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut got = 0;
    while got < 3 {
        let c = r.chunk().await.unwrap().expect("stream goes on");
        got += String::from_utf8_lossy(&c).matches("data: ").count();
    }
    drop(r); // the client goes away mid-stream
    let t0 = Instant::now();
    let next = complete(&s, COMP, &json!({"prompt": "Hello", "max_tokens": 5, "ignore_eos": true})).await;
    assert_eq!(next.usage["completion_tokens"], 5);
    assert!(t0.elapsed() < Duration::from_secs(6), "the slot was not freed: {:?}", t0.elapsed());
    assert!(s.metric("sluice_requests_cancelled_total", &[]).await >= 1.0);
    // A non-streamed request whose client gives up is cancelled too.
    let before = s.metric("sluice_requests_cancelled_total", &[]).await;
    let slow = s.post(COMP).json(&json!({"prompt": "Once", "max_tokens": 400, "ignore_eos": true})).send();
    let _ = tokio::time::timeout(Duration::from_millis(700), slow).await;
    let t0 = Instant::now();
    let next = complete(&s, COMP, &json!({"prompt": "Hi", "max_tokens": 3, "ignore_eos": true})).await;
    assert_eq!(next.usage["completion_tokens"], 3);
    assert!(t0.elapsed() < Duration::from_secs(6), "the slot was not freed: {:?}", t0.elapsed());
    assert!(s.metric("sluice_requests_cancelled_total", &[]).await >= before + 1.0);
    // The gauge drops when the scheduler retires the request, just after its last bytes are
    // sent: give it a moment on a busy machine, but it must reach zero.
    let t0 = Instant::now();
    while s.metric("sluice_active_requests", &[]).await != 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "a request stayed active after every client left");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.shutdown();
}

/// A chat's turns, run on a server that reuses prefixes and on one that does not.
async fn prefix_reuse(model: &str) {
    let with = start(golden(model), opts(), resident()).await;
    let without = start(golden(model), ServerOptions { prefix_cache_bytes: 0, ..opts() }, resident()).await;
    let turn = |msgs: &Value| {
        json!({"messages": msgs, "max_tokens": 12, "temperature": 0.7, "seed": 5, "logprobs": true, "top_logprobs": 2,
               "ignore_eos": true})
    };
    let m1 = json!([{"role": "user", "content": "tell me about the sea"}]);
    let a1 = complete(&with, CHAT, &turn(&m1)).await;
    let b1 = complete(&without, CHAT, &turn(&m1)).await;
    assert_eq!(a1, b1);
    let m2 = json!([{"role": "user", "content": "tell me about the sea"},
                    {"role": "assistant", "content": a1.text},
                    {"role": "user", "content": "and the mountains"}]);
    // The next turn continues from the first's state; the same prompt again from its end;
    // a different branch from where it parts.
    let m3 = json!([{"role": "user", "content": "tell me about the sea"},
                    {"role": "assistant", "content": a1.text},
                    {"role": "user", "content": "and rivers"}]);
    for (i, m) in [&m2, &m2, &m3].into_iter().enumerate() {
        for stream in [false, true] {
            let a = complete(&with, CHAT, &with_stream(&turn(m), stream)).await;
            let b = complete(&without, CHAT, &with_stream(&turn(m), stream)).await;
            assert_eq!(a.text, b.text, "{model} turn {i}");
            assert_eq!(a.logprobs, b.logprobs, "{model} turn {i}");
            let cached = a.usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
            assert!(cached > 0, "{model} turn {i}: nothing reused: {}", a.usage);
            assert_eq!(b.usage["prompt_tokens_details"]["cached_tokens"], 0);
            if i == 1 {
                // The same prompt as before: nothing of it runs again.
                assert_eq!(a.usage["prompt_tokens_details"]["cached_tokens"], a.usage["prompt_tokens"]);
            }
        }
    }
    assert!(with.metric("sluice_prompt_tokens_reused_total", &[]).await > 0.0);
    with.shutdown();
    without.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefix_reuse_gives_the_bits_of_recomputing_attention() {
    prefix_reuse("qwen3_moe").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefix_reuse_gives_the_bits_of_recomputing_recurrent() {
    prefix_reuse("qwen3_next").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_experts_through_a_small_cache_gives_the_resident_bits() {
    let model = golden("qwen3_moe");
    // The slot size of this model's experts, from a streaming load with room to spare.
    let probe = load(
        model.clone(),
        ExpertOptions { mode: ExpertMode::Stream, cache_bytes: Some(1 << 30), ..Default::default() },
    )
    .unwrap();
    let slot = probe.streaming.as_ref().expect("streams").slot_bytes() as u64;
    drop(probe);
    let reqs = mixed_requests();
    let resident_srv = start(model.clone(), opts(), resident()).await;
    let want = run_together(&resident_srv, &reqs).await;
    resident_srv.shutdown();
    let experts =
        ExpertOptions { mode: ExpertMode::Stream, cache_bytes: Some(3 * slot), pressure: false, ..Default::default() };
    let s = start(model, opts(), experts).await;
    let got = run_together(&s, &reqs).await;
    // Text, logprobs and token counts, not `cached_tokens`: how much of a prompt an earlier
    // request's prefix covered depends on which requests finished first, a matter of timing that
    // differs between the two servers (the bits must not).
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        let msg = format!("request {i}: streamed through 3 slots differs from resident");
        assert_eq!((&w.text, &w.logprobs, &w.finish), (&g.text, &g.logprobs, &g.finish), "{msg}");
        for field in ["prompt_tokens", "completion_tokens"] {
            assert_eq!(w.usage[field], g.usage[field], "{msg}: {field}");
        }
    }
    let (_, stats) = s.get_text("/v1/sluice/stats").await;
    let v: Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(v["experts"]["streaming"], true);
    assert!(v["experts"]["misses"].as_u64().unwrap() > 0);
    assert!(v["experts"]["resident"].as_array().unwrap().iter().flat_map(|l| l.as_array().unwrap()).count() <= 3);
    assert!(s.metric("sluice_expert_cache_events_total", &["event=\"miss\"", "model=\"test-model\""]).await > 0.0);
    assert!(s.metric("sluice_expert_cache_bytes", &["kind=\"quota\""]).await > 0.0);
    s.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_page_and_stats_are_served() {
    let s = start(golden("qwen3_moe"), opts(), resident()).await;
    complete(&s, COMP, &json!({"prompt": "hi", "max_tokens": 3, "ignore_eos": true})).await;
    let (st, m) = s.get_text("/metrics").await;
    assert_eq!(st, 200);
    for name in [
        "sluice_http_requests_total",
        "sluice_request_duration_seconds",
        "sluice_time_to_first_token_seconds",
        "sluice_generated_tokens_total",
        "sluice_batch_size",
        "sluice_queue_depth",
        "sluice_expert_cache_events_total",
        "sluice_expert_cache_stall_nanoseconds_total",
    ] {
        assert!(m.contains(name), "{name} missing from /metrics");
    }
    assert_eq!(s.metric("sluice_generated_tokens_total", &[]).await, 3.0);
    let (st, page) = s.get_text("/").await;
    assert_eq!(st, 200);
    assert!(page.contains("/v1/chat/completions") && page.contains("/v1/sluice/stats"));
    let (st, stats) = s.get_text("/v1/sluice/stats").await;
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(v["experts"]["n_layer"], 3);
    assert!(v["scheduler"]["tokens_generated"].as_u64().unwrap() >= 3);
    s.shutdown();
}

/// Reads a streamed response to its end.
async fn rest_of(mut r: reqwest::Response, mut text: String) -> String {
    while let Some(c) = r.chunk().await.expect("the stream reads") {
        text.push_str(&String::from_utf8_lossy(&c));
    }
    text
}

/// Sends a streamed request and returns once its first event arrived.
async fn started(s: &Srv, body: &Value) -> (reqwest::Response, String) {
    let mut r = s.post(COMP).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut text = String::new();
    while !text.contains("data: ") {
        let c = r.chunk().await.unwrap().expect("the stream goes on");
        text.push_str(&String::from_utf8_lossy(&c));
    }
    (r, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_lets_running_requests_finish_and_refuses_new_ones() {
    let model = real_model("qwen2.5-coder-0.5b-q4_k_m.gguf");
    let body = json!({"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": true, "temperature": 0,
                      "logprobs": 2, "stream": true});
    let mut s =
        start(model.clone(), ServerOptions { parallel: 2, ctx_size: 512, ..opts() }, ExpertOptions::default()).await;
    let alone = complete(&s, COMP, &body).await;
    let (r, head) = started(&s, &body).await;
    let h = s.handle.take().expect("running");
    let stopping = tokio::task::spawn_blocking(move || h.shutdown());
    tokio::time::sleep(Duration::from_millis(300)).await;
    // No new work once shutting down: the connection is refused, or the request gets a 503.
    match s.post(COMP).json(&json!({"prompt": "hi", "max_tokens": 2})).send().await {
        Err(_) => {}
        Ok(r) => assert_eq!(r.status(), 503, "{}", r.text().await.unwrap_or_default()),
    }
    // The running request finishes whole, with the bits it has when nothing stops.
    let finished = parse_sse(&rest_of(r, head).await, false);
    assert_eq!(finished, alone);
    stopping.await.unwrap().expect("a clean shutdown");

    // A grace period shorter than the request: it ends with an error event, then [DONE], and
    // the server stops soon after the grace, not when the request would have ended.
    let o = ServerOptions { parallel: 2, ctx_size: 512, shutdown_grace: Duration::from_millis(300), ..opts() };
    let mut s = start(model, o, ExpertOptions::default()).await;
    let long = json!({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true, "stream": true});
    let (r, head) = started(&s, &long).await;
    let h = s.handle.take().expect("running");
    let t0 = Instant::now();
    let stopping = tokio::task::spawn_blocking(move || h.shutdown());
    let text = rest_of(r, head).await;
    stopping.await.unwrap().expect("a clean shutdown");
    assert!(t0.elapsed() < Duration::from_secs(5), "shutdown took {:?} with a 300 ms grace", t0.elapsed());
    let events: Vec<&str> = text.split("\n\n").map(str::trim).filter(|e| e.starts_with("data: ")).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    let err: Value = serde_json::from_str(&events[events.len() - 2]["data: ".len()..]).unwrap();
    assert_eq!(err["error"]["code"], "service_unavailable", "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("shutting down"), "{err}");
    assert!(events.len() < 400, "the request ran to its end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_waiting_for_memory_gets_503_with_retry_after() {
    let model = real_model("qwen2.5-coder-0.5b-q4_k_m.gguf");
    let budget = load(model.clone(), ExpertOptions::default()).unwrap().model.cfg.state_bytes(300);
    // Two slots but memory for one sequence, and no queue beyond the free slots.
    let o = ServerOptions {
        parallel: 2,
        max_queue: 0,
        ctx_size: 512,
        state_memory: Some(budget),
        prefix_cache_bytes: 0,
        ..opts()
    };
    let s = start(model, o, ExpertOptions::default()).await;
    let b = json!({"prompt": "def add(a, b):", "max_tokens": 150, "ignore_eos": true, "temperature": 0, "logprobs": 1});
    let alone = complete(&s, COMP, &b).await;
    let (running, head) = started(&s, &with_stream(&b, true)).await;
    // The second takes the free slot's place in the queue and waits for memory.
    let waiting = tokio::spawn({
        let (c, url) = (s.client.clone(), format!("{}{COMP}", s.base));
        let b = b.clone();
        async move { c.post(url).json(&b).send().await.unwrap().json::<Value>().await.unwrap() }
    });
    let t0 = Instant::now();
    while s.metric("sluice_queue_depth", &[]).await < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the second request never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A third finds the queue full of requests waiting for memory: 503, try again later.
    let r = s.post(COMP).json(&json!({"prompt": "hi", "max_tokens": 2})).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "2");
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("memory"), "{v}");
    assert_eq!(s.metric("sluice_requests_rejected_total", &["memory"]).await, 1.0);
    // The two admitted ones finish with the bits they get alone.
    let first = parse_sse(&rest_of(running, head).await, false);
    assert_eq!(first.text, alone.text);
    assert_eq!(first.logprobs, alone.logprobs);
    let second = waiting.await.unwrap();
    assert_eq!(second["choices"][0]["text"].as_str(), Some(alone.text.as_str()), "{second}");
    s.shutdown();
}

/// Requests whose greedy output repeats its prompt's phrases, so that n-gram drafts are kept.
fn repeating_requests() -> Vec<(&'static str, Value)> {
    let mut v = Vec::new();
    for i in 0..4usize {
        let phrase = ["one two three four five ", "a b c d e f g ", "red green blue ", "x = x + 1; "][i];
        let body = json!({"prompt": phrase.repeat(6), "max_tokens": 40 + 7 * i, "temperature": 0.0,
                          "logprobs": 2, "stream": i % 2 == 1, "ignore_eos": true});
        v.push((COMP, body));
    }
    v
}

/// `req` asking to speculate by `method`.
fn with_spec(req: &(&'static str, Value), method: &str) -> (&'static str, Value) {
    let mut b = req.1.clone();
    b["spec"] = json!(method);
    (req.0, b)
}

/// The greedy requests the speculation tests run: ones that repeat their prompt's phrases, and
/// the greedy ones of `mixed_requests`.
fn greedy_requests() -> Vec<(&'static str, Value)> {
    let mut reqs = repeating_requests();
    reqs.extend(mixed_requests().into_iter().filter(|(_, b)| b["temperature"] == json!(0.0)));
    reqs
}

/// `reqs` sampled at temperature 0.8 (with `seed` where given) and speculating by `method`.
fn sampled_with_spec(reqs: Vec<(&'static str, Value)>, seed: Option<u64>, method: &str) -> Vec<(&'static str, Value)> {
    reqs.into_iter()
        .map(|(p, mut b)| {
            b["temperature"] = json!(0.8);
            if let Some(seed) = seed {
                b["seed"] = json!(seed);
            }
            with_spec(&(p, b), method)
        })
        .collect()
}

/// Greedy `reqs` speculating by `method` get the bits they get without: alone, in a batch of
/// speculating ones, and beside the plain ones.
async fn assert_plain_bits(s: &Srv, what: &str, reqs: &[(&'static str, Value)], method: &str) {
    let plain = run_alone(s, reqs).await;
    let spec_reqs: Vec<_> = reqs.iter().map(|r| with_spec(r, method)).collect();
    let alone = run_alone(s, &spec_reqs).await;
    let mut mixed = spec_reqs.clone();
    mixed.extend(reqs.iter().cloned());
    let together = run_together(s, &mixed).await;
    for (i, p) in plain.iter().enumerate() {
        assert_eq!(p, &alone[i], "{what}: request {i} speculating alone differs from plain decode");
        assert_eq!(p, &together[i], "{what}: request {i} speculating in a batch differs from plain decode");
        assert_eq!(p, &together[reqs.len() + i], "{what}: request {i} beside speculating requests differs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn speculating_requests_get_plain_decode_bits() {
    for model in ["qwen3_moe", "qwen3_next"] {
        let s = start(golden(model), ServerOptions { prefix_cache_bytes: 0, ..opts() }, resident()).await;
        // Greedy: speculating gives plain decode's tokens and log-probabilities, alone and
        // beside other requests (speculating or not).
        let reqs = greedy_requests();
        run_alone(&s, &reqs).await;
        let d0 = s.metric("sluice_spec_drafted_tokens_total", &[]).await;
        assert_plain_bits(&s, model, &reqs, "ngram").await;
        let (d1, a1) = (
            s.metric("sluice_spec_drafted_tokens_total", &[]).await,
            s.metric("sluice_spec_accepted_tokens_total", &[]).await,
        );
        assert_eq!(d0, 0.0, "{model}: plain requests drafted");
        assert!(d1 > 0.0 && a1 > 0.0, "{model}: drafted {d1}, kept {a1}: nothing was verified");
        // Sampled: the same bits alone and in a batch (a fixed draft length: what a request
        // draws does not depend on timing or neighbours).
        let sampled =
            sampled_with_spec(mixed_requests().into_iter().chain(repeating_requests()).collect(), Some(31), "ngram");
        let alone = run_alone(&s, &sampled).await;
        let together = run_together(&s, &sampled).await;
        assert_eq!(alone, together, "{model}: sampled speculating requests differ in a batch");
        s.shutdown();
    }
    // A server speculating by default: a request may turn it off; bad values are named.
    let s = ServerOptions { spec: Some(SpecMethod::Ngram), draft_max: 4, prefix_cache_bytes: 0, ..opts() };
    let s = start(golden("qwen3_moe"), s, resident()).await;
    let (p, b) = &repeating_requests()[0];
    let mut off = b.clone();
    off["spec"] = json!("none");
    let d0 = s.metric("sluice_spec_drafted_tokens_total", &[]).await;
    let plain = complete(&s, p, &off).await;
    assert_eq!(s.metric("sluice_spec_drafted_tokens_total", &[]).await, d0, "\"spec\": \"none\" drafted");
    assert_eq!(complete(&s, p, b).await, plain);
    assert!(s.metric("sluice_spec_drafted_tokens_total", &[]).await > d0, "the server's default did not draft");
    for (field, value, says) in [
        ("spec", json!("draft"), "this server has none"),
        ("spec", json!("mtp"), "this model has none"),
        ("spec", json!(3), "\"ngram\", \"draft\", \"mtp\", \"self\" or \"none\""),
        ("draft_max", json!(0), "1 to 64"),
        ("draft_max", json!(65), "1 to 64"),
    ] {
        let mut bad = b.clone();
        bad[field] = value;
        let (status, v) = s.post_json(COMP, &bad).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], json!(field), "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{v}");
    }
    s.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_drafting_with_a_draft_model_get_plain_decode_bits() {
    // The q8_0 conversion drafts for the bf16 one: close, not the same model, so drafts are
    // both kept and refused. A hybrid: the draft's own state rewinds by snapshot.
    let (target, draft) = (golden("gguf/qwen3_next-bf16.gguf"), golden("gguf/qwen3_next-q8_0.gguf"));
    // A random tiny model is never confident: draft whatever the probability.
    let o = ServerOptions { prefix_cache_bytes: 0, draft_p_min: 0.0, draft_max: 6, ..opts() };
    let (t, d) = (target.clone(), draft.clone());
    let loader: sluice_server::Loader =
        Box::new(move || Ok(Loaded { target: load(t, resident())?, draft: Some(load(d, resident())?) }));
    let s = start_with(o, loader).await;
    let completions = || {
        repeating_requests()
            .into_iter()
            .chain(mixed_requests().into_iter().filter(|(p, _)| *p == COMP))
            .collect::<Vec<_>>()
    };
    let reqs: Vec<_> = completions().into_iter().filter(|(_, b)| b["temperature"] == json!(0.0)).collect();
    assert_plain_bits(&s, "draft model", &reqs, "draft").await;
    let drafted = s.metric("sluice_spec_drafted_tokens_total", &[]).await;
    let kept = s.metric("sluice_spec_accepted_tokens_total", &[]).await;
    assert!(kept > 0.0 && kept < drafted, "drafted {drafted}, kept {kept}: drafts must be both kept and refused");
    // Sampled: the same bits alone and in a batch.
    let sampled = sampled_with_spec(completions(), Some(5), "draft");
    let alone = run_alone(&s, &sampled).await;
    let together = run_together(&s, &sampled).await;
    assert_eq!(alone, together, "sampled drafting requests differ in a batch");
    s.shutdown();

    // A draft model of another vocabulary: the server does not start, and says why.
    let (t, d) = (real_model("qwen2.5-coder-0.5b-q4_k_m.gguf"), target.clone());
    let loader: sluice_server::Loader =
        Box::new(move || Ok(Loaded { target: load(t, ExpertOptions::default())?, draft: Some(load(d, resident())?) }));
    let handle = sluice_server::spawn(opts(), loader).unwrap();
    let (c, url) = (reqwest::Client::new(), format!("http://{}/health", handle.addr));
    for _ in 0..600 {
        match c.get(&url).send().await {
            Ok(r) if r.status() == 503 => tokio::time::sleep(Duration::from_millis(100)).await,
            _ => break, // failed (500), or already stopped
        }
    }
    let err = handle.shutdown().unwrap_err();
    assert!(err.contains("vocabulary"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_drafting_from_the_cached_experts_get_plain_decode_bits() {
    // Streamed through a cache that holds a few experts, so drafts leave experts out and
    // differ from the model's own choices; a hybrid whose state rewinds by snapshot too.
    for model in ["qwen3_moe", "qwen3_next"] {
        let streamed = ExpertOptions { mode: ExpertMode::Stream, cache_bytes: Some(96 << 10), ..Default::default() };
        let o = ServerOptions { prefix_cache_bytes: 0, draft_p_min: 0.0, draft_max: 4, ..opts() };
        let s = start(golden(model), o, streamed).await;
        let reqs = greedy_requests();
        assert_plain_bits(&s, model, &reqs, "self").await;
        let drafted = s.metric("sluice_spec_drafted_tokens_total", &[]).await;
        let kept = s.metric("sluice_spec_accepted_tokens_total", &[]).await;
        assert!(kept > 0.0 && kept < drafted, "{model}: drafted {drafted}, kept {kept}");
        // Sampled requests decode plainly (drafts from the cache would make their bits depend
        // on their neighbours): the bits of the same request without `spec`.
        let sampled: Vec<_> = mixed_requests().into_iter().filter(|(_, b)| b["temperature"] != json!(0.0)).collect();
        let plain = run_alone(&s, &sampled).await;
        let spec_sampled: Vec<_> = sampled.iter().map(|r| with_spec(r, "self")).collect();
        assert_eq!(run_together(&s, &spec_sampled).await, plain, "{model}: sampled \"self\" requests");
        assert_eq!(
            s.metric("sluice_spec_drafted_tokens_total", &[]).await,
            drafted,
            "{model}: a sampled request drafted"
        );
        s.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_drafting_with_the_mtp_head_get_plain_decode_bits() {
    // The checkpoints' own heads: a hybrid (Qwen3-Next) and an MoE with dense first layers (GLM).
    for model in ["qwen3_next", "glm4_moe_mtp"] {
        let path = golden(model);
        let loader: sluice_server::Loader = Box::new(move || {
            let o = EngineOptions { threads: 2, experts: resident(), mtp: true, ..Default::default() };
            Engine::load(&path, o).map(Into::into).map_err(|e| e.to_string())
        });
        let o = ServerOptions { prefix_cache_bytes: 0, draft_p_min: 0.0, draft_max: 4, ..opts() };
        let s = start_with(o, loader).await;
        let reqs = greedy_requests();
        assert_plain_bits(&s, model, &reqs, "mtp").await;
        let drafted = s.metric("sluice_spec_drafted_tokens_total", &[]).await;
        assert!(drafted > 0.0, "{model}: the head drafted nothing");
        // Sampled: the same bits alone and in a batch (the head drafts greedily). A random
        // tiny head never agrees with its random model, so every draft is refused; a sampled
        // request drafts a fixed length, so each of its steps after the first drafts up to 4
        // tokens — unless the head lost track of the positions (it would stop drafting).
        let sampled = sampled_with_spec(mixed_requests(), None, "mtp");
        let alone = run_alone(&s, &sampled).await;
        let steps: f64 = sampled.iter().map(|(_, b)| b["max_tokens"].as_f64().unwrap() - 1.0).sum();
        let d = s.metric("sluice_spec_drafted_tokens_total", &[]).await - drafted;
        assert!(d >= 2.0 * steps, "{model}: {d} drafts over {steps} steps: the head stopped drafting");
        assert_eq!(alone, run_together(&s, &sampled).await, "{model}: sampled mtp requests differ in a batch");
        s.shutdown();
    }
}
