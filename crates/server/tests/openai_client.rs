//! The official `openai` Python client (installed by tools/test.sh into ~/.cache/sluice/pylib)
//! against the real Qwen2.5-Coder GGUF: chat completion, streaming, logprobs, errors.

mod common;

use common::*;
use sluice_runtime::placement::ExpertOptions;
use sluice_server::ServerOptions;
use std::path::PathBuf;

fn pylib() -> PathBuf {
    std::env::var_os("SLUICE_PYLIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/sluice/pylib"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_openai_python_client_works() {
    let lib = pylib();
    let probe = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .env("PYTHONPATH", &lib)
        .output()
        .expect("python3 runs");
    assert!(
        probe.status.success(),
        "the `openai` Python package is not installed in {}: run the tests with tools/test.sh, which installs it ({})",
        lib.display(),
        String::from_utf8_lossy(&probe.stderr)
    );
    let o = ServerOptions {
        api_key: Some("test-key".into()),
        model_id: "qwen".into(),
        ctx_size: 1024,
        max_body_bytes: 64 << 10,
        ..opts()
    };
    let s = start(real_model("qwen2.5-coder-0.5b-q4_k_m.gguf"), o, ExpertOptions::default()).await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let base = s.base.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3").arg(script).arg(base).env("PYTHONPATH", lib).output()
    })
    .await
    .unwrap()
    .expect("python3 runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "openai client checks failed:\n{text}");
    assert!(text.contains("all checks passed"), "{text}");
    s.shutdown();
}
