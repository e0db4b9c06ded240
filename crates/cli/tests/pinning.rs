//! `--pin-experts N --pin-trace TRACE` is lossy and says so: a LOSSY line on stderr, the choice
//! in `--json`, and `sluice perplexity` with the same flags reports the exact perplexity beside
//! the pinned one and their divergence. Half a flag pair is refused.

mod common;

use common::{ok, s, scratch, sluice};
use std::path::PathBuf;

fn repo(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(p)
}

#[test]
fn pinning_is_labelled_lossy_and_its_cost_is_reported() {
    let dir = scratch("pin-cli");
    let (m, t) = (s(&repo("tests/golden/qwen3_moe")), s(&dir.join("t.trace")));
    ok(sluice(&["run", "-m", &m, "--prompt-tokens", "5,9,13,17,21,25,29", "-n", "16", "--trace", &t]));
    let out = sluice(&[
        "run",
        "-m",
        &m,
        "--prompt-tokens",
        "5,9,13",
        "-n",
        "4",
        "--pin-experts",
        "4",
        "--pin-trace",
        &t,
        "--json",
    ]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let v: serde_json::Value = serde_json::from_str(&ok(out)).unwrap();
    assert!(err.contains("LOSSY") && err.contains("4 of its 8 experts"), "{err}");
    let p = &v["experts"]["pinned_routing"];
    assert_eq!((p["lossy"].as_bool(), p["per_layer"].as_u64()), (Some(true), Some(4)), "{p}");

    let ppl = |extra: &[&str]| -> serde_json::Value {
        let mut a = vec!["perplexity", "-m", &m, "-f", "tests/data/gpl-3.txt", "-c", "32", "--chunks", "2", "--json"];
        a.extend(extra);
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
        c.args(&a).current_dir(repo(""));
        serde_json::from_str(&ok(c.output().unwrap())).unwrap()
    };
    let plain = ppl(&[]);
    let pinned = ppl(&["--pin-experts", "4", "--pin-trace", &t]);
    assert_eq!(pinned["ppl_exact"], plain["ppl"], "{pinned}");
    assert!(pinned["kl_mean"].as_f64().unwrap() > 0.0, "{pinned}");
    assert_ne!(pinned["ppl"], plain["ppl"]);

    let out = sluice(&["run", "-m", &m, "--prompt-tokens", "5", "-n", "1", "--pin-experts", "4"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--pin-trace"));
    let _ = std::fs::remove_dir_all(&dir);
}
