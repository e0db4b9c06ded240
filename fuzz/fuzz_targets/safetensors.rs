//! The safetensors header parser: nothing may panic on any input, and every tensor it accepts
//! must lie inside the data section with as many bytes as its shape and dtype need.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_formats::safetensors::parse_header_bytes;

fuzz_target!(|data: &[u8]| {
    let Ok(tensors) = parse_header_bytes(data) else { return };
    let data_start = 8 + u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    for info in tensors.values() {
        assert!(data_start <= info.start && info.start <= info.end && info.end <= data.len());
        let _ = info.numel();
        std::hint::black_box(&data[info.start..info.end]);
    }
});
