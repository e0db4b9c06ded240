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

mod device;
mod matmul;

pub use device::{Gpu, GpuError};
pub use matmul::{GpuAct, GpuMatrix, HostAct};

/// Weight formats the CUDA matmul computes on directly.
pub fn supports(dtype: sluice_kernels::DType) -> bool {
    matmul::kernel_name(dtype).is_some()
}
