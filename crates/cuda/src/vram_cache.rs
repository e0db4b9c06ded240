//! The VRAM tier of the expert cache: equal slots in one device allocation, each holding one
//! expert's matrices as stored, under a hard byte quota, least recently used out first.
//! Missed experts are copied from host memory on a copy stream of their own, so the copies
//! of one layer's misses overlap the kernels already queued on the compute stream (the host
//! waits for the copies before `acquire` returns, as the host bytes are only borrowed;
//! page-locked host memory, `Gpu::register_host`, copies at the bus's rate).
//!
//! Invariants:
//! - slots × slot bytes ≤ quota, always: nothing is placed past it;
//! - the compute stream reads a slot only after the copy that filled it (it waits on the
//!   slot's `ready` event before the batch's kernels);
//! - a slot is overwritten only after every kernel that read its previous expert (the copy
//!   stream waits on the slot's `used` event, recorded when a `Resident` is dropped, after
//!   the caller queued its kernels);
//! - the experts of one `acquire` stay put until its `Resident` is dropped: a batch that
//!   needs more experts than there are slots is refused, never half-served;
//! - hits, misses, evictions and bytes copied are counted always.
//!
//! Results do not depend on the quota: a slot holds the stored bytes, and the kernels compute
//! on them exactly as on any other copy (the tests compare every quota to the CPU reference).

use crate::device::{Gpu, GpuError};
use crate::matmul::DeviceMat;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
use sluice_kernels::DType;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Parts start at multiples of this within a slot (the kernels load 16 bytes at a time).
const PART_ALIGN: usize = 256;
/// Bytes of each of the two staging buffers for copies from ordinary host memory.
const STAGE_BYTES: usize = 4 << 20;

/// An expert of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    pub layer: u32,
    pub expert: u32,
}

/// One matrix of an expert in host memory, as stored (gate, up and down, say).
#[derive(Clone, Copy, Debug)]
pub struct HostPart<'h> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'h [u8],
}

/// Counters of the VRAM tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VramStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Bytes copied from host memory into slots.
    pub bytes_copied: u64,
    /// Time the caller waited on those copies (queueing them and their completion).
    pub copy_ns: u64,
    /// Experts placed before use (`place`), and their bytes: not counted as misses or
    /// copies above.
    pub placed: u64,
    pub bytes_placed: u64,
    pub slots: usize,
    pub slot_bytes: usize,
}

struct Slot {
    key: Option<ExpertKey>,
    /// (dtype, rows, cols, offset in the slot) of each part of the expert it holds.
    parts: Vec<(DType, usize, usize, usize)>,
    last_use: u64,
    ready: Option<CudaEvent>,
    used: Option<Arc<CudaEvent>>,
}

pub struct VramExperts {
    slab: CudaSlice<u8>,
    slot_bytes: usize,
    slots: Vec<Slot>,
    index: HashMap<ExpertKey, usize>,
    tick: u64,
    copy: Arc<CudaStream>,
    /// Page-locked staging buffers for copies from ordinary host memory, each with the
    /// event of the last copy that read it.
    stage: Vec<(PinnedHostSlice<u8>, Option<CudaEvent>)>,
    next_stage: usize,
    stats: VramStats,
}

/// Where parts of these byte sizes start in a slot, and the bytes they span.
fn part_offsets(sizes: impl IntoIterator<Item = usize>) -> (Vec<usize>, usize) {
    let mut at = 0usize;
    let offsets = sizes
        .into_iter()
        .map(|len| {
            let off = at.next_multiple_of(PART_ALIGN);
            at = off + len;
            off
        })
        .collect();
    (offsets, at)
}

/// Bytes a slot needs for an expert of these parts.
pub fn slot_bytes_for(parts: &[(DType, usize, usize)]) -> Option<usize> {
    let sizes: Option<Vec<usize>> = parts.iter().map(|&(d, rows, cols)| Some(rows * d.row_bytes(cols)?)).collect();
    Some(part_offsets(sizes?).1.next_multiple_of(PART_ALIGN))
}

/// Bytes a slot needs for any expert of `n_parts` parts that together hold `bytes`.
pub fn slot_bytes_bound(bytes: usize, n_parts: usize) -> usize {
    (bytes + n_parts * PART_ALIGN).next_multiple_of(PART_ALIGN)
}

impl VramExperts {
    /// As many slots of `slot_bytes` as fit in `quota_bytes` (at least one, or an error).
    pub fn new(gpu: &Gpu, slot_bytes: usize, quota_bytes: usize) -> Result<VramExperts, GpuError> {
        let slot_bytes = slot_bytes.next_multiple_of(PART_ALIGN);
        let n = quota_bytes / slot_bytes.max(1);
        if n == 0 {
            return Err(GpuError::Shape(format!(
                "a VRAM expert quota of {quota_bytes} bytes holds no expert of {slot_bytes} bytes"
            )));
        }
        let slab = gpu.stream.alloc_zeros::<u8>(n * slot_bytes)?;
        // The copy stream writes into the slab: the allocation must be complete first.
        gpu.stream.synchronize()?;
        let slots =
            (0..n).map(|_| Slot { key: None, parts: Vec::new(), last_use: 0, ready: None, used: None }).collect();
        let copy = gpu.copy_stream()?;
        let stats = VramStats { slots: n, slot_bytes, ..Default::default() };
        Ok(VramExperts {
            slab,
            slot_bytes,
            slots,
            index: HashMap::new(),
            tick: 0,
            copy,
            stage: Vec::new(),
            next_stage: 0,
            stats,
        })
    }

    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Whether `key` is in a slot now.
    pub fn holds(&self, key: ExpertKey) -> bool {
        self.index.contains_key(&key)
    }

    /// The parts of `key` where its slot holds them, counted as no access: for a caller that
    /// computes on every expert of the model without asking for each (the tier holds them
    /// all, so no acquire can evict one: a miss is what evicts, and none can miss).
    pub(crate) fn parts_of_held(&self, gpu: &Gpu, key: ExpertKey) -> Option<Vec<DeviceMat<'_>>> {
        let s = *self.index.get(&key)?;
        if let Some(ev) = &self.slots[s].ready {
            // The copy that filled it is done before anyone reads it without `acquire`.
            ev.synchronize().ok()?;
        }
        Some(self.slot_parts(gpu, s))
    }

    /// Slot `s`'s parts, as device matrices.
    fn slot_parts(&self, gpu: &Gpu, s: usize) -> Vec<DeviceMat<'_>> {
        let (base, _sync) = self.slab.device_ptr(&gpu.stream);
        let base = base + (s * self.slot_bytes) as u64;
        self.slots[s]
            .parts
            .iter()
            .map(|&(dtype, rows, cols, off)| DeviceMat {
                dtype,
                rows,
                cols,
                ptr: base + off as u64,
                _owner: std::marker::PhantomData,
            })
            .collect()
    }

    pub fn stats(&self) -> VramStats {
        self.stats.clone()
    }

    /// Makes `keys` resident (copying the misses from `host`) and returns their slots, which
    /// stay put until the `Resident` is dropped. Drop it after queueing the kernels that
    /// read them.
    pub fn acquire<'c, 'h>(
        &'c mut self,
        gpu: &'c Gpu,
        keys: &[ExpertKey],
        host: &dyn Fn(ExpertKey) -> Result<Vec<HostPart<'h>>, GpuError>,
    ) -> Result<Resident<'c>, GpuError> {
        if keys.len() > self.slots.len() {
            return Err(GpuError::Shape(format!(
                "a batch of {} experts at once; the VRAM tier holds {}",
                keys.len(),
                self.slots.len()
            )));
        }
        self.tick += 1;
        for (i, key) in keys.iter().enumerate() {
            if keys[..i].contains(key) {
                return Err(GpuError::Shape(format!("expert {key:?} asked for twice in one batch")));
            }
        }
        // Hits first, so that a miss never evicts an expert the same batch is about to use.
        let mut at: Vec<Option<usize>> = keys.iter().map(|k| self.index.get(k).copied()).collect();
        for s in at.iter().flatten() {
            self.stats.hits += 1;
            self.slots[*s].last_use = self.tick;
        }
        let mut filled: Vec<usize> = Vec::new();
        for i in 0..keys.len() {
            if at[i].is_some() {
                continue;
            }
            self.stats.misses += 1;
            let parts = host(keys[i])?;
            let victim = (0..self.slots.len())
                .filter(|s| !at.contains(&Some(*s)))
                .min_by_key(|&s| (self.slots[s].key.is_some(), self.slots[s].last_use))
                .expect("no more keys than slots");
            let t0 = Instant::now();
            self.stats.bytes_copied += self.fill(gpu, victim, keys[i], &parts)? as u64;
            self.stats.copy_ns += t0.elapsed().as_nanos() as u64;
            filled.push(victim);
            at[i] = Some(victim);
        }
        let taken: Vec<usize> = at.into_iter().map(|s| s.expect("every key placed")).collect();
        // The batch's kernels wait for the copies that filled its slots; and the host does
        // too, before the borrowed host bytes may go (a copy from page-locked memory runs
        // asynchronously; from ordinary memory the driver has staged it already).
        let t0 = Instant::now();
        for &s in &filled {
            if let Some(ev) = &self.slots[s].ready {
                gpu.stream.wait(ev)?;
            }
        }
        if let Some(ev) = filled.last().and_then(|&s| self.slots[s].ready.as_ref()) {
            ev.synchronize()?;
        }
        self.stats.copy_ns += t0.elapsed().as_nanos() as u64;
        Ok(Resident { cache: self, gpu, slots: taken })
    }

    /// Copies `key` into a free slot ahead of use (warming the tier at load): false when it
    /// is held already or no slot is free. The copies run on the copy stream; `settle` waits
    /// for them, and must be called before the host bytes may go and before any `acquire`
    /// relies on these slots.
    pub fn place(&mut self, gpu: &Gpu, key: ExpertKey, parts: &[HostPart<'_>]) -> Result<bool, GpuError> {
        if self.index.contains_key(&key) {
            return Ok(false);
        }
        let Some(free) = self.slots.iter().position(|s| s.key.is_none()) else { return Ok(false) };
        self.stats.bytes_placed += self.fill(gpu, free, key, parts)? as u64;
        self.stats.placed += 1;
        Ok(true)
    }

    /// Waits for every copy `place` queued.
    pub fn settle(&self) -> Result<(), GpuError> {
        Ok(self.copy.synchronize()?)
    }

    /// Whether every slot holds an expert.
    pub fn is_full(&self) -> bool {
        self.index.len() == self.slots.len()
    }

    /// Queues the copies of `parts` into slot `s` for `key`; returns their bytes.
    fn fill(&mut self, gpu: &Gpu, s: usize, key: ExpertKey, parts: &[HostPart<'_>]) -> Result<usize, GpuError> {
        for p in parts {
            let need = p.dtype.row_bytes(p.cols).map(|rb| rb * p.rows);
            if need != Some(p.data.len()) {
                return Err(GpuError::Shape(format!(
                    "expert {key:?}: a {} {}x{} part of {} bytes",
                    p.dtype,
                    p.rows,
                    p.cols,
                    p.data.len()
                )));
            }
        }
        let (offsets, at) = part_offsets(parts.iter().map(|p| p.data.len()));
        let layout: Vec<_> = parts.iter().zip(offsets).map(|(p, off)| (p.dtype, p.rows, p.cols, off)).collect();
        if at > self.slot_bytes {
            return Err(GpuError::Shape(format!(
                "expert {key:?} needs {at} bytes; a VRAM slot holds {}",
                self.slot_bytes
            )));
        }
        let slot = &mut self.slots[s];
        if let Some(old) = slot.key.take() {
            self.index.remove(&old);
            self.stats.evictions += 1;
        }
        // Kernels that read the previous expert must be done before it is overwritten.
        if let Some(used) = &slot.used {
            self.copy.wait(used)?;
        }
        let slab = self.slab.device_ptr(&self.copy).0;
        let base = slab + (s * self.slot_bytes) as u64;
        let mut bytes = 0;
        for (p, &(_, _, _, off)) in parts.iter().zip(&layout) {
            self.copy_part(gpu, base + off as u64, p.data)?;
            bytes += p.data.len();
        }
        let ready = self.copy.record_event(None)?;
        let slot = &mut self.slots[s];
        slot.ready = Some(ready);
        slot.parts = layout;
        slot.key = Some(key);
        slot.last_use = self.tick;
        self.index.insert(key, s);
        Ok(bytes)
    }

    /// Queues the copy of `src` to device address `dst` on the copy stream. Page-locked host
    /// memory is copied from directly; other memory goes through two page-locked staging
    /// buffers in turn (the host fills one while the bus drains the other), several times
    /// faster than the driver's own staging of ordinary memory. `src` must stay untouched
    /// until the copy stream has passed this copy (`acquire` waits for it).
    fn copy_part(&mut self, gpu: &Gpu, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        self.copy.context().bind_to_thread()?;
        if gpu.is_locked(src) {
            // SAFETY: `dst` lies in this tier's slab (the caller's slot), `src` is page-locked
            // and outlives the copy (acquire synchronizes before its borrow ends).
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.copy.cu_stream()) }?;
            return Ok(());
        }
        if self.stage.is_empty() {
            for _ in 0..2 {
                // SAFETY: a fresh page-locked allocation; it is written only below, after the
                // copy that last read it has completed.
                let buf = unsafe { self.copy.context().alloc_pinned::<u8>(STAGE_BYTES) }?;
                self.stage.push((buf, None));
            }
        }
        for (i, chunk) in src.chunks(STAGE_BYTES).enumerate() {
            let at = dst + (i * STAGE_BYTES) as u64;
            let which = self.next_stage;
            self.next_stage ^= 1;
            let (buf, done) = &mut self.stage[which];
            if let Some(ev) = done.take() {
                ev.synchronize()?;
            }
            let staged = &mut buf.as_mut_slice()?[..chunk.len()];
            staged.copy_from_slice(chunk);
            // SAFETY: `at..at + chunk.len()` lies in the slot being filled; the staging
            // buffer is page-locked and is not written again until `done` has completed.
            unsafe { cudarc::driver::result::memcpy_htod_async(at, staged, self.copy.cu_stream()) }?;
            *done = Some(self.copy.record_event(None)?);
        }
        Ok(())
    }
}

/// The slots of one acquired batch, in the order of its keys.
pub struct Resident<'c> {
    cache: &'c mut VramExperts,
    gpu: &'c Gpu,
    slots: Vec<usize>,
}

impl Resident<'_> {
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The parts of the batch's expert `i`, as device matrices.
    pub fn expert(&self, i: usize) -> Vec<DeviceMat<'_>> {
        self.cache.slot_parts(self.gpu, self.slots[i])
    }
}

impl Drop for Resident<'_> {
    fn drop(&mut self) {
        // Marks the end of the kernels queued so far: the copy stream waits for it before it
        // overwrites one of these slots. If recording fails the context is broken, and the
        // next call on it reports that.
        let used = self.gpu.stream.record_event(None).ok().map(Arc::new);
        for &s in &self.slots {
            self.cache.slots[s].used = used.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_aligned_apart_and_fit_the_bound() {
        let shapes = [(DType::Q4_K, 768, 2048), (DType::Q4_K, 768, 2048), (DType::Q6_K, 2048, 768)];
        let sizes: Vec<usize> = shapes.iter().map(|&(d, r, c)| r * d.row_bytes(c).unwrap()).collect();
        let (offsets, end) = part_offsets(sizes.iter().copied());
        for (i, off) in offsets.iter().enumerate() {
            assert_eq!(off % PART_ALIGN, 0);
            if i > 0 {
                assert!(*off >= offsets[i - 1] + sizes[i - 1], "parts {} and {i} overlap", i - 1);
            }
        }
        assert_eq!(end, offsets[2] + sizes[2]);
        let need = slot_bytes_for(&shapes).unwrap();
        assert!(need >= end && need <= slot_bytes_bound(sizes.iter().sum(), 3), "{need}");
        // A part of 1 byte after one of 1 byte still starts on the next boundary.
        assert_eq!(part_offsets([1, 1]).0, vec![0, PART_ALIGN]);
    }
}
