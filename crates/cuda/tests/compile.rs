//! The kernels' CUDA C compiles with NVRTC for the architectures sluice targets, and every
//! kernel the host code launches is in the result. Needs NVRTC (not a GPU): the test command
//! installs NVIDIA's NVRTC wheel from PyPI and puts it on LD_LIBRARY_PATH.

#[test]
fn kernels_compile_for_every_target_architecture() {
    for arch in ["compute_75", "compute_80", "compute_90"] {
        let ptx = sluice_cuda::compile_kernels(arch)
            .unwrap_or_else(|e| panic!("{arch}: {e} (tools/test.sh installs NVRTC into ~/.cache/sluice/nvrtc)"));
        for name in sluice_cuda::kernel_entry_points() {
            assert!(ptx.contains(&format!(".entry {name}(")), "{arch}: no kernel {name} in the PTX");
        }
    }
}
