//! The web page in a real browser (headless Chromium through ChromeDriver): a chat message gets
//! a streamed reply and the cache panel updates. Opt-in, as CI has no browser:
//!
//! ```sh
//! apt-get install -y chromium chromium-driver
//! cargo test --release -p sluice-server --test browser -- --ignored
//! ```

mod common;

use common::*;
use sluice_runtime::placement::ExpertOptions;
use sluice_server::ServerOptions;
use std::path::PathBuf;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs Debian's chromium and chromium-driver; run with --ignored"]
async fn the_web_page_chats_and_shows_the_cache() {
    let o = ServerOptions { ctx_size: 1024, ..opts() };
    let s = start(real_model("qwen2.5-coder-0.5b-q4_k_m.gguf"), o, ExpertOptions::default()).await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/browser.py");
    let base = s.base.clone();
    let out = tokio::task::spawn_blocking(move || std::process::Command::new("python3").arg(script).arg(base).output())
        .await
        .unwrap()
        .expect("python3 runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "browser test failed:\n{text}");
    assert!(text.contains("cache panel updated"), "{text}");
    s.shutdown();
}
