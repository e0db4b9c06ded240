//! sluice's CUDA backend.
//!
//! CUDA's driver and NVRTC are loaded when a device is opened, not linked, so every build of
//! sluice carries this crate and runs where no CUDA is installed; `Gpu::open` then says what
//! is missing. Kernels are CUDA C (`src/kernels/`) compiled at start for the device's
//! architecture and cached on disk.
//!
//! Quantized matmul works on the stored GGUF blocks and is bit-identical to the CPU scalar
//! reference (`sluice_kernels::quant::dot_ref`): the same activation quantization, the same
//! exact integer sums, the same float formula applied block after block. So a row's result
//! depends neither on the batch nor on which backend computed it.
//!
//! `dense` holds the model's dense matrices in VRAM and computes their products for the
//! CPU's forward pass (the model's `DenseCompute` seam), the CPU's bits.
//! `experts` computes a MoE layer's routed experts for the CPU's forward pass (the model's
//! `ExpertCompute` seam): `split` decides which of them the GPU takes, `vram_cache` is the
//! expert cache's VRAM tier (slots on the device under a hard quota, filled from host
//! memory on a copy stream of their own).

use sluice_kernels::DType;

pub mod dense;
mod device;
pub mod experts;
mod matmul;
pub mod split;
pub mod step;
pub mod vram_cache;

pub use device::{compile_kernels, Gpu, GpuError, HostRegistration};
pub use matmul::{DeviceMat, GpuAct, GpuMatrix, HostAct};

/// Weight formats the CUDA matmul computes on directly.
pub fn supports(dtype: DType) -> bool {
    matmul::kernel_name(dtype).is_some()
}

/// Every kernel the host code launches (the tests check that the compiled PTX has them).
pub fn kernel_entry_points() -> Vec<String> {
    let mut v = vec!["quantize_q8k".to_string(), "quantize_q16".to_string()];
    v.extend(step::KERNELS.iter().map(|k| k.to_string()));
    for d in [DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::Q2_K, DType::Q3_K, DType::Q8_0] {
        let base = matmul::kernel_name(d).expect("a CUDA format");
        for lanes in [8, 16] {
            for nt in [1, 8] {
                v.push(format!("{base}_g{lanes}_{nt}"));
                v.push(format!("{base}_g{lanes}_{nt}_ids"));
            }
        }
    }
    v
}
