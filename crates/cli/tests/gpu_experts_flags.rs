//! `--gpu-experts`: bad values and models without routed experts are refused with errors
//! that name the flag; on a machine without an NVIDIA GPU the error says what is missing; on
//! one with a GPU, `sluice logits` prints the same logits with and without the flag (dense
//! weights on the GPU or, with `--cpu-dense`, on the CPU).

mod common;

use common::{ok, s, scratch, sluice, synth_tiny};
use std::path::PathBuf;

fn stderr_of_failure(args: &[&str]) -> String {
    let out = sluice(args);
    assert!(!out.status.success(), "{args:?} succeeded");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn gpu_experts_refuses_bad_input_and_names_what_is_missing() {
    let dir = scratch("gpu-experts-flags");
    let m = dir.join("tiny.gguf");
    synth_tiny(&m, "uniform", &[]);
    let ms = s(&m);

    let err = stderr_of_failure(&["logits", "-m", &ms, "--tokens", "1,2,3", "--gpu-experts", "lots"]);
    assert!(err.contains("--gpu-experts") && err.contains("not a size"), "{err}");

    let dense = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/llama");
    let err = stderr_of_failure(&["logits", "-m", &s(&dense), "--tokens", "1,2,3", "--gpu-experts", "1GiB"]);
    assert!(err.contains("--gpu-experts") && err.contains("has no routed experts"), "{err}");

    let err = stderr_of_failure(&["logits", "-m", &ms, "--tokens", "1,2,3", "--cpu-dense"]);
    assert!(err.contains("--cpu-dense") && err.contains("--gpu-experts"), "{err}");

    let plain = ok(sluice(&["logits", "-m", &ms, "--tokens", "1,2,3,4"]));
    let gpu = sluice(&["logits", "-m", &ms, "--tokens", "1,2,3,4", "--gpu-experts", "64MiB"]);
    match sluice_cuda::Gpu::open(0) {
        Ok(_) => {
            assert!(gpu.status.success(), "{}", String::from_utf8_lossy(&gpu.stderr));
            assert_eq!(String::from_utf8_lossy(&gpu.stdout), plain, "GPU experts and dense weights changed the logits");
            let cpu_dense =
                ok(sluice(&["logits", "-m", &ms, "--tokens", "1,2,3,4", "--gpu-experts", "64MiB", "--cpu-dense"]));
            assert_eq!(cpu_dense, plain, "GPU experts with CPU dense products changed the logits");
        }
        Err(e) => {
            let err = String::from_utf8_lossy(&gpu.stderr);
            assert!(!gpu.status.success() && err.contains("--gpu-experts") && err.contains(&e.to_string()), "{err}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
