//! The VRAM expert tier: every quota, from one slot to every expert, gives the CPU
//! reference's bits, and its counters add up. Needs an NVIDIA GPU (ignored by default; run
//! with `--ignored` on a CUDA machine).

use sluice_cuda::vram_cache::{slot_bytes_for, ExpertKey, HostPart, VramExperts};
use sluice_cuda::{Gpu, GpuError};
use sluice_kernels::compare::first_difference;
use sluice_kernels::testdata::{quantized, uniform as rng};
use sluice_kernels::{matmul_ref, DType, MatRef};

const FF: usize = 256;
const HIDDEN: usize = 512;

/// An expert: gate and up (ff × hidden, Q4_K), down (hidden × ff, Q6_K), as a Q4_K_M file has.
struct HostExpert {
    gate: Vec<u8>,
    up: Vec<u8>,
    down: Vec<u8>,
}

fn parts(e: &HostExpert) -> Vec<HostPart<'_>> {
    vec![
        HostPart { dtype: DType::Q4_K, rows: FF, cols: HIDDEN, data: &e.gate },
        HostPart { dtype: DType::Q4_K, rows: FF, cols: HIDDEN, data: &e.up },
        HostPart { dtype: DType::Q6_K, rows: HIDDEN, cols: FF, data: &e.down },
    ]
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn every_quota_gives_the_reference_bits_and_counts_add_up() {
    let gpu = Gpu::open(0).unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"));
    let n_expert = 12;
    let experts: Vec<HostExpert> = (0..n_expert as u64)
        .map(|e| HostExpert {
            gate: quantized(DType::Q4_K, FF, HIDDEN, 3 * e),
            up: quantized(DType::Q4_K, FF, HIDDEN, 3 * e + 1),
            down: quantized(DType::Q6_K, HIDDEN, FF, 3 * e + 2),
        })
        .collect();
    let slot = slot_bytes_for(&[(DType::Q4_K, FF, HIDDEN), (DType::Q4_K, FF, HIDDEN), (DType::Q6_K, HIDDEN, FF)])
        .expect("whole blocks");
    // Ten steps of one token routed to 4 of the 12 experts each.
    let steps: Vec<Vec<u32>> =
        (0..10u32).map(|t| (0..4).map(|k| (t * 5 + k * 3) % n_expert as u32).collect()).collect();
    let mut r = rng(77);
    let x: Vec<f32> = (0..HIDDEN).map(|_| r()).collect();
    let h: Vec<f32> = (0..FF).map(|_| r()).collect();
    for n_slots in [1, 2, 4, n_expert] {
        // One quota copies from page-locked host memory, the others from ordinary memory.
        let _locked: Vec<_> = if n_slots == 4 {
            experts.iter().flat_map(|e| [&e.gate, &e.up, &e.down]).map(|v| gpu.register_host(v).unwrap()).collect()
        } else {
            Vec::new()
        };
        let mut cache = VramExperts::new(&gpu, slot, n_slots * slot).unwrap();
        assert_eq!(cache.slots(), n_slots);
        let host = |k: ExpertKey| -> Result<Vec<HostPart<'_>>, GpuError> { Ok(parts(&experts[k.expert as usize])) };
        let xd = gpu.stream().clone_htod(&x).unwrap();
        let hd = gpu.stream().clone_htod(&h).unwrap();
        let ax = gpu.quantize(DType::Q4_K, &xd, 1, HIDDEN).unwrap();
        let ah = gpu.quantize(DType::Q6_K, &hd, 1, FF).unwrap();
        let mut requests = 0;
        for step in &steps {
            for chunk in step.chunks(n_slots.min(step.len())) {
                let keys: Vec<ExpertKey> = chunk.iter().map(|&e| ExpertKey { layer: 0, expert: e }).collect();
                requests += keys.len() as u64;
                let res = cache.acquire(&gpu, &keys, &host).unwrap();
                let gates: Vec<_> = (0..res.len()).map(|i| (res.expert(i)[0], i..i + 1)).collect();
                let downs: Vec<_> = (0..res.len()).map(|i| (res.expert(i)[2], i..i + 1)).collect();
                let mut g = gpu.stream().alloc_zeros::<f32>(keys.len() * FF).unwrap();
                let mut d = gpu.stream().alloc_zeros::<f32>(keys.len() * HIDDEN).unwrap();
                gpu.matmul_ids(&gates, &ax, &vec![0; keys.len()], &mut g).unwrap();
                gpu.matmul_ids(&downs, &ah, &vec![0; keys.len()], &mut d).unwrap();
                drop(res);
                let (g, d) = (gpu.stream().clone_dtoh(&g).unwrap(), gpu.stream().clone_dtoh(&d).unwrap());
                for (i, &e) in chunk.iter().enumerate() {
                    let ex = &experts[e as usize];
                    let mut want_g = vec![0f32; FF];
                    matmul_ref(MatRef::new(DType::Q4_K, FF, HIDDEN, &ex.gate).unwrap(), &x, 1, &mut want_g);
                    let mut want_d = vec![0f32; HIDDEN];
                    matmul_ref(MatRef::new(DType::Q6_K, HIDDEN, FF, &ex.down).unwrap(), &h, 1, &mut want_d);
                    let (dg, dd) = (
                        first_difference(&want_g, &g[i * FF..(i + 1) * FF]),
                        first_difference(&want_d, &d[i * HIDDEN..(i + 1) * HIDDEN]),
                    );
                    assert_eq!(dg, None, "{n_slots} slots: expert {e} gate differs from the CPU at row {dg:?}");
                    assert_eq!(dd, None, "{n_slots} slots: expert {e} down differs from the CPU at row {dd:?}");
                }
            }
        }
        let st = cache.stats();
        assert_eq!(st.hits + st.misses, requests, "{n_slots} slots: {st:?}");
        assert_eq!(st.evictions, st.misses.saturating_sub(n_slots as u64), "{n_slots} slots: {st:?}");
        assert_eq!(st.bytes_copied, st.misses * (2 * experts[0].gate.len() + experts[0].down.len()) as u64);
        if n_slots == n_expert {
            let distinct: std::collections::BTreeSet<u32> = steps.iter().flatten().copied().collect();
            assert_eq!(st.misses, distinct.len() as u64, "every expert is copied once when all fit: {st:?}");
        }
        if n_slots == 1 {
            assert_eq!(st.hits, 0, "one slot and no repeated expert in a row: {st:?}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn a_batch_larger_than_the_tier_is_refused_and_a_tiny_quota_is_an_error() {
    let gpu = Gpu::open(0).unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"));
    let slot = slot_bytes_for(&[(DType::Q4_K, FF, HIDDEN)]).unwrap();
    let e = vec![0u8; DType::Q4_K.row_bytes(HIDDEN).unwrap() * FF];
    let host = |_k: ExpertKey| -> Result<Vec<HostPart<'_>>, GpuError> {
        Ok(vec![HostPart { dtype: DType::Q4_K, rows: FF, cols: HIDDEN, data: &e }])
    };
    let mut cache = VramExperts::new(&gpu, slot, 2 * slot).unwrap();
    let keys: Vec<ExpertKey> = (0..3).map(|i| ExpertKey { layer: 1, expert: i }).collect();
    let err = cache.acquire(&gpu, &keys, &host).err().expect("three experts in two slots");
    assert!(err.to_string().contains("a batch of 3 experts at once; the VRAM tier holds 2"), "{err}");
    let twice = [keys[0], keys[0]];
    assert!(cache.acquire(&gpu, &twice, &host).err().unwrap().to_string().contains("asked for twice"));
    let small = VramExperts::new(&gpu, slot, slot - 1).err().expect("no slot fits");
    assert!(small.to_string().contains("holds no expert"), "{small}");
}
