//! The local tier of a remote model under processes that die or run side by side. A process
//! killed while it writes the stand-in of the dense weights, the disk tier's expert records,
//! or a whole copy leaves nothing that a restart trusts wrongly: the restart gives the local
//! file's output, and a copy resumes where it stopped and ends identical to the served file.
//! Processes sharing one disk tier (its quota small enough that they evict each other's
//! records) each give the local file's output.

mod common;
#[path = "../../remote/tests/common/mod.rs"]
mod server;

use common::{ok, s, sluice};
use server::{FaultProxy, Nginx};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn files_under(d: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(d) else { return out };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p, suffix));
        } else if p.to_string_lossy().ends_with(suffix) {
            out.push(p);
        }
    }
    out
}

/// Starts `sluice args` and kills it (SIGKILL) once `ready` holds, or after `limit`.
fn kill_when(args: &[String], ready: impl Fn() -> bool, limit: Duration) -> bool {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !ready() && t.elapsed() < limit {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    true
}

#[test]
fn a_run_killed_while_writing_the_local_tier_restarts_with_the_local_files_output() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests");
    let nginx = Nginx::start(&root);
    let proxy = FaultProxy::start(nginx.port);
    let rel = "golden/gguf/olmoe-bf16.gguf";
    let run = |model: &str, disk: &Path| -> Vec<String> {
        [
            "run",
            "-m",
            model,
            "--prompt-tokens",
            "1,2,3,4,5,6,7,8",
            "-n",
            "24",
            "--expert-cache",
            "256KiB",
            "--disk-cache",
            &s(disk),
            "--disk-cache-size",
            "1GiB",
            "--no-pressure",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };
    let scratch = common::scratch("remote-kill");
    let local = ok(sluice(&run(&s(&root.join(rel)), &scratch).iter().map(String::as_str).collect::<Vec<_>>()));
    assert!(!local.trim().is_empty());
    let disk = scratch.join("tier");
    // Slow answers, so the kills land while the files are being written.
    proxy.slow_ms.store(30, Ordering::Relaxed);
    let url = proxy.url(rel);
    // 1: killed while the stand-in of the dense weights is being filled (no marker yet).
    let killed =
        kill_when(&run(&url, &disk), || !files_under(&disk, "olmoe-bf16.gguf").is_empty(), Duration::from_secs(20));
    assert!(killed, "the run ended before it could be killed");
    assert!(files_under(&disk, "dense.json").is_empty(), "killed before the stand-in was complete");
    // 2: killed while expert records are being written.
    let killed = kill_when(&run(&url, &disk), || files_under(&disk, ".rec").len() >= 3, Duration::from_secs(30));
    assert!(killed, "the run ended before it could be killed");
    assert!(!files_under(&disk, "dense.json").is_empty());
    proxy.slow_ms.store(0, Ordering::Relaxed);
    // The restart completes and says the same tokens as the local file.
    let out = sluice(&run(&url, &disk).iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(ok(out), local);
    // And once more, with everything local now.
    let requests = proxy.requests.load(Ordering::Relaxed);
    let out = sluice(&run(&url, &disk).iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(ok(out), local);
    assert!(
        proxy.requests.load(Ordering::Relaxed) - requests <= 2,
        "a warm tier asks the server only for the file's identity"
    );
    std::fs::remove_dir_all(&scratch).unwrap();
}

#[test]
fn a_whole_copy_killed_midway_resumes_and_ends_identical() {
    // A real model of several chunks (tools/models/fetch.sh brings it).
    let models = std::env::var_os("HOME").map(PathBuf::from).unwrap().join(".cache/sluice/models");
    let name = "qwen2.5-coder-0.5b-q4_k_m.gguf";
    assert!(models.join(name).exists(), "{} missing: run tools/models/fetch.sh", models.join(name).display());
    let nginx = Nginx::start(&models);
    let proxy = FaultProxy::start(nginx.port);
    let scratch = common::scratch("remote-copy");
    let out = scratch.join("copy.gguf");
    let args: Vec<String> = ["fetch", &proxy.url(name), "--all", "-o", &s(&out), "--parallel", "2", "--json"]
        .iter()
        .map(|x| x.to_string())
        .collect();
    proxy.slow_ms.store(150, Ordering::Relaxed);
    let log = PathBuf::from(format!("{}.part.done", out.display()));
    let done = || std::fs::read_to_string(&log).map(|t| t.lines().count() > 4).unwrap_or(false);
    assert!(kill_when(&args, done, Duration::from_secs(60)), "the copy ended before it could be killed");
    assert!(!out.exists(), "a partial copy never takes the final name");
    proxy.slow_ms.store(0, Ordering::Relaxed);
    let r: serde_json::Value =
        serde_json::from_str(ok(sluice(&args.iter().map(String::as_str).collect::<Vec<_>>())).trim()).unwrap();
    let total = std::fs::metadata(models.join(name)).unwrap().len();
    let fetched = r["result"]["bytes"].as_u64().unwrap();
    assert!(fetched < total, "resumed: {fetched} of {total} bytes fetched the second time");
    let same = Command::new("cmp").arg(&out).arg(models.join(name)).status().unwrap();
    assert!(same.success(), "the copy differs from the served file");
    assert!(!log.exists());
    std::fs::remove_dir_all(&scratch).unwrap();
}

#[test]
fn processes_sharing_one_disk_tier_each_give_the_local_files_output() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests");
    let nginx = Nginx::start(&root);
    let rel = "golden/gguf/deepseek_v3-bf16.gguf";
    let scratch = common::scratch("remote-shared");
    let disk = scratch.join("tier");
    let args = |model: &str, prompt: &str| -> Vec<String> {
        [
            "run",
            "-m",
            model,
            "--prompt-tokens",
            prompt,
            "-n",
            "16",
            "--expert-cache",
            "128KiB",
            "--disk-cache",
            &s(&disk),
            "--disk-cache-size",
            "96KiB",
            "--no-pressure",
            "--stats",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };
    let prompts = ["1,2,3,4", "9,8,7,6,5", "11,12,13", "4,4,2,2"];
    let local: Vec<String> = prompts
        .iter()
        .map(|p| ok(sluice(&args(&s(&root.join(rel)), p).iter().map(String::as_str).collect::<Vec<_>>())))
        .collect();
    let url = nginx.url(rel);
    for round in 0..2 {
        let children: Vec<_> = prompts
            .iter()
            .map(|p| {
                Command::new(env!("CARGO_BIN_EXE_sluice"))
                    .args(args(&url, p))
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (i, c) in children.into_iter().enumerate() {
            let out = c.wait_with_output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "round {round}, prompt {}: {err}", prompts[i]);
            assert_eq!(String::from_utf8_lossy(&out.stdout), local[i], "round {round}, prompt {}", prompts[i]);
            assert!(err.contains("disk tier:") && !err.contains("errors"), "{err}");
        }
    }
    std::fs::remove_dir_all(&scratch).unwrap();
}

#[test]
fn inspect_reads_a_model_at_a_url_and_names_each_kind_of_layer() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests");
    let nginx = Nginx::start(&root);
    let scratch = common::scratch("remote-inspect");
    let inspect = |model: &str| -> serde_json::Value {
        serde_json::from_str(&ok(sluice(&["inspect", model, "--json", "--disk-cache", &s(&scratch)]))).unwrap()
    };
    for (rel, layers) in [
        ("golden/gguf/deepseek_v3-bf16.gguf", "3× latent attention (MLA)"),
        ("golden/gguf/split/deepseek_v3-bf16-00001-of-00006.gguf", "3× latent attention (MLA)"),
        ("golden/gguf/olmoe-bf16.gguf", "2× attention"),
    ] {
        let local = inspect(&s(&root.join(rel)));
        let remote = inspect(&nginx.url(rel));
        assert_eq!(local["composition"], layers, "{rel}");
        for k in ["composition", "architecture", "expert_bytes", "dense_bytes", "tensors"] {
            assert_eq!(remote[k], local[k], "{rel}: {k}");
        }
    }
    std::fs::remove_dir_all(&scratch).unwrap();
}
