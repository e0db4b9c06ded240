//! Where each expert's bytes are in the files, and how they land in a cache slot.
//!
//! An expert is three matrices (gate, up, down). A store names, for each, a byte range in a
//! file. Reads go straight into the slot with O_DIRECT, which needs file offset, length and
//! memory address aligned to `ALIGN`: each range is widened to aligned bounds, read whole,
//! and the matrix starts at its offset inside that landing zone. A pack record is one
//! contiguous aligned range holding all three. An expert not stored in the kernels' form
//! (gpt-oss's fused Hugging Face tensors) lands its source ranges the same way and is then
//! rewritten into the three matrices (`Reform`) before anyone uses the slot.

use sluice_kernels::DType;
use sluice_model::families::gpt_oss::FusedExpert;
use sluice_model::weights::{mxfp4_scale_check, ExpertPart};

/// O_DIRECT alignment of file offsets, lengths and buffers.
pub const ALIGN: u64 = 4096;

pub fn align_down(v: u64) -> u64 {
    v & !(ALIGN - 1)
}

pub fn align_up(v: u64) -> u64 {
    v.div_ceil(ALIGN) * ALIGN
}

/// One matrix of an expert. For a reformed expert (`ExpertPlan::reform`), `file` and
/// `offset` are unused: the matrix is made from the plan's source ranges.
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
    /// Set when the bytes read are not the kernels' form.
    pub reform: Option<Reform>,
}

/// An expert whose stored bytes must be rewritten into the kernels' matrices once read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reform {
    pub fused: FusedExpert,
    /// (file, offset, length) of each source range, in `fused.sources`' order.
    pub sources: Vec<(usize, u64, u64)>,
    /// Where each source range's first byte lands in the slot.
    pub raw_offsets: Vec<u64>,
    /// Bytes of slot the landed source ranges span.
    pub raw_bytes: u64,
}

impl Reform {
    /// Writes the three matrices into `out` at `offsets` from `raw`, the source ranges as the
    /// reads landed them (`raw_bytes` long).
    pub fn apply(&self, raw: &[u8], out: &mut [u8], offsets: &[u64; 3]) -> Result<(), String> {
        let src: Vec<&[u8]> =
            self.raw_offsets.iter().zip(&self.sources).map(|(&o, s)| &raw[o as usize..][..s.2 as usize]).collect();
        for (p, &at) in ExpertPart::ALL.into_iter().zip(offsets) {
            let n = self.fused.bytes(p);
            self.fused.reform(p, &src, &mut out[at as usize..][..n])?;
        }
        Ok(())
    }
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
        ExpertPlan { reads, part_offsets: offsets, parts, checksum: None, reform: None }
    }

    /// gpt-oss's fused Hugging Face expert: its source ranges (in `files`, indexed by
    /// `file_of`) read into the slot like `from_parts`, then rewritten into the three matrices,
    /// which start at the slot's beginning (each 64-byte aligned).
    pub fn reformed(fused: FusedExpert, file_of: impl Fn(&std::path::Path) -> usize) -> ExpertPlan {
        let mut reads = Vec::with_capacity(fused.sources.len());
        let mut raw_offsets = Vec::with_capacity(fused.sources.len());
        let mut sources = Vec::with_capacity(fused.sources.len());
        let mut at = 0u64;
        for r in &fused.sources {
            let file = file_of(&r.file);
            let start = align_down(r.offset);
            let end = align_up(r.offset + r.len);
            reads.push(Read { file, offset: start, len: end - start, slot_offset: at, need: r.offset + r.len - start });
            raw_offsets.push(at + (r.offset - start));
            sources.push((file, r.offset, r.len));
            at += end - start;
        }
        let mut offsets = [0u64; 3];
        let mut end = 0u64;
        let parts = ExpertPart::ALL.map(|p| {
            let (dtype, rows, cols) = fused.shape(p);
            let len = fused.bytes(p) as u64;
            offsets[p as usize] = end;
            end = (end + len).next_multiple_of(64);
            PartLoc { file: 0, offset: 0, len, dtype, rows, cols }
        });
        let reform = Reform { fused, sources, raw_offsets, raw_bytes: at };
        ExpertPlan { reads, part_offsets: offsets, parts, checksum: None, reform: Some(reform) }
    }

    /// The exact byte ranges (file, offset, length) of the expert in the files.
    pub fn ranges(&self) -> Vec<(usize, u64, u64)> {
        match &self.reform {
            Some(r) => r.sources.clone(),
            None if self.checksum.is_some() => {
                vec![(self.reads[0].file, self.reads[0].offset, self.payload_bytes())]
            }
            None => self.parts.iter().map(|p| (p.file, p.offset, p.len)).collect(),
        }
    }

    /// Checks the three matrices, at `offsets` in `bytes`, for values no weight has: an MXFP4
    /// scale of 0xFF.
    pub fn check(&self, bytes: &[u8], offsets: &[u64; 3]) -> Option<String> {
        for (i, p) in self.parts.iter().enumerate() {
            if p.dtype == DType::MXFP4 {
                let data = &bytes[offsets[i] as usize..][..p.len as usize];
                if let Some(m) = mxfp4_scale_check(data, p.cols) {
                    return Some(format!("{:?}: {m}", ExpertPart::ALL[i]));
                }
            }
        }
        None
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
            reform: None,
        }
    }

    /// Bytes of slot this expert needs.
    pub fn slot_bytes(&self) -> u64 {
        let read = self.reads.iter().map(|r| r.slot_offset + r.len).max().unwrap_or(0);
        let parts = self.parts.iter().zip(self.part_offsets).map(|(p, o)| o + p.len).max().unwrap_or(0);
        read.max(parts)
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
