//! Where each expert's bytes are in the files, and how they land in a cache slot.
//!
//! An expert is three matrices (gate, up, down). A store names, for each, a byte range in a
//! file. Reads go straight into the slot with O_DIRECT, which needs file offset, length and
//! memory address aligned to `ALIGN`: each range is widened to aligned bounds, read whole,
//! and the matrix starts at its offset inside that landing zone. A pack record is one
//! contiguous aligned range holding all three.

use sluice_kernels::DType;
use sluice_model::weights::ExpertPart;

/// O_DIRECT alignment of file offsets, lengths and buffers.
pub const ALIGN: u64 = 4096;

pub fn align_down(v: u64) -> u64 {
    v & !(ALIGN - 1)
}

pub fn align_up(v: u64) -> u64 {
    v.div_ceil(ALIGN) * ALIGN
}

/// One matrix of an expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartLoc {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

/// One aligned read: `len` bytes at `offset` of `file` into the slot at `slot_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Read {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
    pub slot_offset: u64,
    /// Bytes that must arrive for the read to count as complete (it may stop at end of file).
    pub need: u64,
}

/// How one expert maps onto a slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertPlan {
    pub reads: Vec<Read>,
    /// Offset in the slot where each matrix (gate, up, down) starts.
    pub part_offsets: [u64; 3],
    pub parts: [PartLoc; 3],
    /// Pack records carry a checksum of their bytes (gate | up | down).
    pub checksum: Option<u64>,
}

impl ExpertPlan {
    /// Three separate ranges (GGUF tensors, safetensors tensors), each widened to alignment.
    pub fn from_parts(parts: [PartLoc; 3]) -> ExpertPlan {
        let mut reads = Vec::with_capacity(3);
        let mut offsets = [0u64; 3];
        let mut at = 0u64;
        for (i, p) in parts.iter().enumerate() {
            let start = align_down(p.offset);
            let end = align_up(p.offset + p.len);
            reads.push(Read {
                file: p.file,
                offset: start,
                len: end - start,
                slot_offset: at,
                need: p.offset + p.len - start,
            });
            offsets[i] = at + (p.offset - start);
            at += end - start;
        }
        ExpertPlan { reads, part_offsets: offsets, parts, checksum: None }
    }

    /// One contiguous aligned record holding the three matrices back to back.
    pub fn from_record(file: usize, offset: u64, parts: [PartLoc; 3], checksum: u64) -> ExpertPlan {
        let total: u64 = parts.iter().map(|p| p.len).sum();
        debug_assert_eq!(offset % ALIGN, 0);
        let mut offsets = [0u64; 3];
        let mut at = 0;
        for (i, p) in parts.iter().enumerate() {
            offsets[i] = at;
            at += p.len;
        }
        ExpertPlan {
            reads: vec![Read { file, offset, len: align_up(total), slot_offset: 0, need: total }],
            part_offsets: offsets,
            parts,
            checksum: Some(checksum),
        }
    }

    /// Bytes of slot this expert needs.
    pub fn slot_bytes(&self) -> u64 {
        self.reads.iter().map(|r| r.slot_offset + r.len).max().unwrap_or(0)
    }

    /// Bytes the kernels use (what the expert weighs).
    pub fn payload_bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.len).sum()
    }

    pub fn part(&self, p: ExpertPart) -> &PartLoc {
        &self.parts[p as usize]
    }
}

/// Every routed expert of a model: `[layer][expert]`, empty for dense layers.
#[derive(Clone, Debug)]
pub struct Layout {
    pub files: Vec<std::path::PathBuf>,
    pub experts: Vec<Vec<ExpertPlan>>,
}

impl Layout {
    /// The slot size that fits every expert.
    pub fn slot_bytes(&self) -> usize {
        align_up(self.experts.iter().flatten().map(|e| e.slot_bytes()).max().unwrap_or(0)) as usize
    }

    pub fn total_payload(&self) -> u64 {
        self.experts.iter().flatten().map(|e| e.payload_bytes()).sum()
    }

    pub fn plan(&self, layer: usize, expert: usize) -> Option<&ExpertPlan> {
        self.experts.get(layer)?.get(expert)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(offset: u64, len: u64) -> PartLoc {
        PartLoc { file: 0, offset, len, dtype: DType::Q4_K, rows: 1, cols: 256 }
    }

    #[test]
    fn unaligned_ranges_land_inside_aligned_reads() {
        let p = ExpertPlan::from_parts([part(100, 5000), part(9000, 144), part(4096, 4096)]);
        for (r, (p, off)) in p.reads.iter().zip(p.parts.iter().zip(p.part_offsets)) {
            assert_eq!(r.offset % ALIGN, 0);
            assert_eq!(r.len % ALIGN, 0);
            assert_eq!(r.slot_offset % ALIGN, 0);
            // The matrix lies wholly inside its read.
            assert!(off >= r.slot_offset && off + p.len <= r.slot_offset + r.len);
            assert_eq!(off - r.slot_offset, p.offset - r.offset);
        }
        assert_eq!(p.reads[0].len, 8192);
        assert_eq!(p.reads[2].len, 4096);
        assert_eq!(p.slot_bytes(), 8192 + 4096 + 4096);
    }
}
