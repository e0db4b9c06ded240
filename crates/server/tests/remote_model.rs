//! The server on a model read from a URL (nginx, started by the test): completions give the
//! same text as the local file's, and /metrics reports the tiers below the expert cache.

mod common;
#[path = "../../remote/tests/common/mod.rs"]
mod remote;

use common::{complete, golden, opts, start, start_with};
use serde_json::json;
use sluice_experts::IoKind;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};

fn streamed(io: IoKind) -> ExpertOptions {
    ExpertOptions { mode: ExpertMode::Stream, cache_bytes: Some(256 << 10), io, pressure: false, ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_served_remote_model_answers_as_the_local_file_and_reports_its_tiers() {
    let nginx = remote::Nginx::start(&remote::tests_dir());
    let url = nginx.url("golden/gguf/olmoe-bf16.gguf");
    let dir = remote::scratch("served");
    let o =
        sluice_remote::RemoteOptions { dir: dir.clone(), disk_quota: 1 << 30, ..sluice_remote::RemoteOptions::new() };
    // The loader opens the URL (blocking HTTP) the way `sluice serve -m URL` does.
    let loader: sluice_server::Loader = Box::new(move || {
        let m = sluice_remote::open(&url, &o).map_err(|e| e.to_string())?;
        let opts =
            EngineOptions { threads: 2, experts: streamed(IoKind::Ranges(m.reader.clone())), ..Default::default() };
        Engine::load(&m.local, opts).map(Into::into).map_err(|e| e.to_string())
    });
    let srv = start_with(opts(), loader).await;
    let local = start(golden("gguf/olmoe-bf16.gguf"), opts(), streamed(IoKind::Auto)).await;
    for stream in [false, true] {
        let body = json!({"prompt": "The remote tier", "max_tokens": 12, "temperature": 0, "stream": stream});
        let a = complete(&srv, "/v1/completions", &body).await;
        let b = complete(&local, "/v1/completions", &body).await;
        assert_eq!(a.text, b.text, "stream {stream}");
        assert_eq!(a.finish, b.finish);
    }
    let reads = srv.metric("sluice_expert_tier_events_total", &["tier=\"remote\"", "event=\"read\""]).await;
    let bytes = srv.metric("sluice_expert_tier_events_total", &["tier=\"remote\"", "event=\"byte\""]).await;
    assert!(reads > 0.0 && bytes > 0.0, "remote reads {reads}, bytes {bytes}");
    // The second request re-reads what the small expert cache evicted: from the disk tier.
    let hits = srv.metric("sluice_expert_tier_events_total", &["tier=\"disk\"", "event=\"read\""]).await;
    assert!(hits > 0.0, "disk-tier hits {hits}");
    assert_eq!(local.metric("sluice_expert_tier_events_total", &[]).await, 0.0, "a local model has no tiers");
    srv.shutdown();
    local.shutdown();
    std::fs::remove_dir_all(&dir).unwrap();
}
