//! `sluice fit` against what the engine does: the placement it predicts is the one `run`
//! makes, its quota is the rule's, and the hit rate it predicts from a trace is the one a
//! streamed run measures at that quota (prefetch off: the trace replay is the cache alone).

mod common;

use common::{ok, s, scratch, sluice, sluice_in, synth_tiny, trace, PROMPT};

#[test]
fn fit_predicts_the_placement_and_hit_rate_a_run_gets() {
    let dir = scratch("fit");
    // Where fit keeps the rates it measured: the second call must find them.
    let cache = dir.join("cache");
    let (m, t) = (dir.join("m.gguf"), dir.join("m.trace"));
    synth_tiny(&m, "skewed", &[]);
    trace(&m, &t, PROMPT, 24);
    let fit = |mem: &str| -> serde_json::Value {
        let out = ok(sluice_in(
            Some(&cache),
            &["fit", "-m", &s(&m), "--memory", mem, "--trace", &s(&t), "--ctx", "64", "--seconds", "0.2", "--json"],
        ));
        serde_json::from_str(&out).unwrap()
    };
    // Plenty of memory: resident.
    let big = fit("64GiB");
    assert_eq!(big["prediction"]["placement"], "resident");
    assert!(big["prediction"]["stream_tok_s"].is_null());
    // 1.2 GiB: 1 GiB + 1/20 of it is headroom; the rest, less dense weights and state, is the
    // cache.
    let small = fit("1.2GiB");
    let p = &small["prediction"];
    assert_eq!(p["placement"], "stream");
    let sz = &small["sizes"];
    let avail = (1.2 * (1u64 << 30) as f64) as u64;
    let want =
        avail - sz["dense_bytes"].as_u64().unwrap() - sz["state_bytes"].as_u64().unwrap() - ((1 << 30) + avail / 20);
    assert_eq!(p["quota_bytes"].as_u64().unwrap(), want);
    // Bounds: streaming cannot beat resident; both are finite and positive.
    let (res, st) = (p["resident_tok_s"].as_f64().unwrap(), p["stream_tok_s"].as_f64().unwrap());
    assert!(st > 0.0 && st <= res, "stream {st} resident {res}");
    // The second call used the rates measured by the first.
    assert_eq!(small["rates"]["cached"], true);

    // The run at that quota, prefetch off, hits the cache as the replay predicted.
    let quota = p["quota_bytes"].as_u64().unwrap().to_string();
    let out = ok(sluice(&[
        "run",
        "-m",
        &s(&m),
        "--expert-mode",
        "stream",
        "--expert-cache",
        &quota,
        "--no-prefetch",
        "--no-pressure",
        "--ctx",
        "64",
        "--prompt-tokens",
        PROMPT,
        "-n",
        "24",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let measured = v["experts"]["hit_rate"].as_f64().unwrap();
    let predicted = p["hit_rate"]["rate"].as_f64().unwrap();
    assert_eq!(p["hit_rate"]["source"], "trace");
    assert!((measured - predicted).abs() < 0.02, "predicted {predicted}, measured {measured}");

    // Errors name the problem.
    let out = sluice_in(Some(&cache), &["fit", "-m", &s(&m), "--memory", "100MiB", "--seconds", "0.2"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not fit"), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}
