//! AVX2 kernels of the K-quants: decode (one token over several rows) and small batches
//! (several rows against up to `SMALL_BATCH` tokens), each block unpacked once for all the
//! tokens; and the helpers other x86 kernels share. They run on every x86-64 CPU with AVX2;
//! larger batches go to the tiled kernels (`tiled_avx2`, `x86_512`). The 32-element block
//! formats have their own kernels (`block32_x86`).
//!
//! Integer sums are exact; the float side is `dot_ref::accumulate`, block after block, so
//! results equal the scalar reference to the bit.

// Index loops over lanes, rows and blocks read most plainly in kernel code.
#![allow(clippy::needless_range_loop)]

use super::act::QuantAct;
use super::{BatchOut, BatchScratch, SMALL_BATCH};
use crate::DType;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// 32 four-bit codes: low nibbles of `q` then high nibbles (the Q4_0/Q4_1/Q5 order).
///
/// # Safety
///
/// The pointer must be valid for reading one block (or vector) of the format at hand; the CPU
/// has the instruction set this is compiled for ({isa}, checked by `cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn nibbles_split16(q: *const u8) -> __m256i {
    let v = _mm_loadu_si128(q as *const __m128i);
    let m = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, m);
    let hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    _mm256_set_m128i(hi, lo)
}

/// The fifth bit of 32 codes from a little-endian u32 (bit j → byte j), as 0 or 16.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn fifth_bits(qh: u32) -> __m256i {
    // Spread the 32 bits over 32 bytes: byte j takes byte j/8 of qh, then every bit but bit
    // j%8 is set, so the byte is all ones exactly where bit j is (one operation fewer than
    // masking the bit and comparing with it).
    let v = _mm256_set1_epi32(qh as i32);
    let idx = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let others = _mm256_set1_epi64x(0x7FBF_DFEF_F7FB_FDFEu64 as i64);
    let hit = _mm256_cmpeq_epi8(_mm256_or_si256(_mm256_shuffle_epi8(v, idx), others), _mm256_set1_epi8(-1));
    _mm256_and_si256(hit, _mm256_set1_epi8(16))
}

/// Runs `$body` with `$j` each of the constants 0..8 below `$m`, unrolled (callers pass a
/// constant 8 for whole groups, so the bounds fold away there).
macro_rules! blocks8 {
    ($m:expr, $j:ident, $body:block) => {{
        macro_rules! one {
            ($k:literal) => {{
                const $j: usize = $k;
                if $j < $m {
                    $body
                }
            }};
        }
        one!(0);
        one!(1);
        one!(2);
        one!(3);
        one!(4);
        one!(5);
        one!(6);
        one!(7);
    }};
}

pub(crate) use blocks8;

/// Runs `$body` with `$r` each of the constants 0..4 below `$n` (a kernel's row count, a const
/// generic), unrolled, so that per-row terms indexed by r stay in registers; as a loop over r
/// they went to the stack and back for `accumulate4`'s transposes. Used by the MXFP4 decode
/// (one token, one thread, 2880×2880: 1.15–1.20×; gpt-oss-20b decode faster too). Not by the
/// block-32 and K-quant decodes: there the kernel lab saw no change, but a whole Qwen2.5-0.5B
/// decode step ran 0.89× (47.1 → 41.8 tok/s) — most likely the four-fold larger bodies of
/// the many kernels a step runs crowding the instruction caches, which a lab timing one kernel
/// does not see. The IQ decodes gained 2–6% in the lab but were not checked on a whole model,
/// so they stay loops as well.
macro_rules! rows4 {
    ($n:expr, $r:ident, $body:block) => {{
        macro_rules! one {
            ($k:literal) => {{
                #[allow(non_upper_case_globals)]
                const $r: usize = $k;
                if $r < $n {
                    $body
                }
            }};
        }
        one!(0);
        one!(1);
        one!(2);
        one!(3);
    }};
}

pub(crate) use rows4;

/// Runs `$group(b0, m)` over a row's `$nb` blocks in groups of eight, `m` the constant 8 for
/// every whole group and the remainder last.
macro_rules! by_groups {
    ($nb:expr, $group:expr) => {{
        let nb = $nb;
        let mut b0 = 0;
        while b0 + 8 <= nb {
            $group(b0, 8);
            b0 += 8;
        }
        if b0 < nb {
            $group(b0, nb - b0);
        }
    }};
}
pub(crate) use by_groups;

/// Eight vectors of 8 partial sums → one vector of their 8 totals, in order.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn reduce8x8(a: &[__m256i; 8]) -> __m256i {
    let h1 = _mm256_hadd_epi32(a[0], a[1]);
    let h2 = _mm256_hadd_epi32(a[2], a[3]);
    let h3 = _mm256_hadd_epi32(a[4], a[5]);
    let h4 = _mm256_hadd_epi32(a[6], a[7]);
    let g1 = _mm256_hadd_epi32(h1, h2);
    let g2 = _mm256_hadd_epi32(h3, h4);
    _mm256_add_epi32(_mm256_permute2x128_si256(g1, g2, 0x20), _mm256_permute2x128_si256(g1, g2, 0x31))
}

/// How far ahead of its reads a kernel that walks its rows as one sequential stream (the
/// K-quant decode) asks for lines: far enough that a line arrives from memory before the
/// kernel's compute reaches it. Asking for the next group of eight blocks only (1.1 KiB of
/// Q4_K) left the reads waiting: kernel lab, Intel Xeon, 2048×2048 decode, one thread, the
/// next group → 4 KiB ahead, GB/s: AVX-512 Q4_K 8.6 → 9.3, Q2_K 7.0 → 8.1, Q3_K 7.6 → 8.7, Q5_K
/// 9.1 → 9.5, Q6_K 10.8 → 11.7; AVX2 Q2_K 6.5 → 7.1, Q3_K 6.5 → 7.2, Q5_K 9.0 → 9.6, Q6_K 9.9
/// → 10.3 (2 KiB and 4 KiB about equal). Asking for the next group had itself replaced asking
/// for the next row's blocks (AVX-512 EPYC, Q6_K 4096×14336 decode with 2 threads 18.8 → 26.7
/// GB/s); no AMD machine has measured the longer distance. On that Xeon (Q4_K 2048×2048, one
/// thread, medians of three alternated runs, GB/s) every other way measured was slower or
/// the same: no software prefetch 7.0 against 9.6 (the hardware streamer alone; with the
/// thread's rows walked as two interleaved halves, 7.3); one line in two (the adjacent-line
/// prefetcher fetching its pair) 9.0 against 10.1; `T0` instead of `T1` 10.4 against 10.2;
/// the matrices in 2 MiB pages 10.6 against 9.5 at this shape but 10.2 against 10.4 at an
/// OLMoE expert's 1024×2048, and no change in OLMoE's decode.
const STREAM_AHEAD: usize = 4096;

/// Asks for the `len` bytes that lie `STREAM_AHEAD` past `p`: for a kernel reading its
/// weights in memory order, what it will read a little later.
///
/// # Safety
///
/// As `prefetch_rows` (what is asked for may lie past the matrix: prefetches never fault, and
/// the pointer arithmetic wraps).
#[inline(always)]
pub(crate) unsafe fn prefetch_stream(p: *const u8, len: usize) {
    prefetch_rows(p.wrapping_add(STREAM_AHEAD), len);
}

/// Asks for the cache lines of `len` bytes at `p`, into L2 (`T1`), not L1: a prefetch into L1
/// holds one of the core's few L1 miss buffers until its line arrives, which capped a matvec's
/// misses in flight — and its read rate — well below the memory's (MXFP4 and Q8_0 decode on two
/// threads ran 19–20 GB/s with `T0` and 26–34 GB/s with `T1` on an AMD EPYC). The kernels read
/// the line soon after, from L2.
///
/// # Safety
///
/// Prefetches never fault, but the caller keeps `p .. p + len` inside one allocation (pointer
/// arithmetic); the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn prefetch_rows(p: *const u8, len: usize) {
    let mut o = 0;
    while o < len {
        _mm_prefetch(p.wrapping_add(o) as *const i8, _MM_HINT_T1);
        o += 64;
    }
}

#[inline(always)]
pub(crate) fn f16_bits(w: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([w[o], w[o + 1]])
}

/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// (qh offset, qs offset, code offset) of a 32-block format.
#[inline(always)]
pub(crate) fn layout32(dtype: DType) -> (Option<usize>, usize, i32) {
    match dtype {
        DType::Q4_0 => (None, 2, 8),
        DType::Q4_1 => (None, 4, 0),
        DType::Q5_0 => (Some(2), 6, 16),
        DType::Q5_1 => (Some(4), 8, 0),
        _ => (None, 2, 0), // Q8_0
    }
}

/// The 32 codes of a block in element order: unsigned (0..32), except Q8_0's, which stay
/// signed here.
///
/// # Safety
///
/// The pointer must be valid for reading one block (or vector) of the format at hand; the CPU
/// has the instruction set this is compiled for ({isa}, checked by `cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn codes32(dtype: DType, w: *const u8) -> __m256i {
    let (qh, qs, _) = layout32(dtype);
    if dtype == DType::Q8_0 {
        return _mm256_loadu_si256(w.add(2) as *const __m256i);
    }
    let mut u = nibbles_split16(w.add(qs));
    if let Some(o) = qh {
        let h = u32::from_le_bytes([*w.add(o), *w.add(o + 1), *w.add(o + 2), *w.add(o + 3)]);
        u = _mm256_or_si256(u, fifth_bits(h));
    }
    u
}

/// Codes of Q4_K/Q5_K superblock chunk `c` (elements 64c..64c+32 and 64c+32..64c+64).
///
/// # Safety
///
/// The CPU supports the features named in `target_feature` (AVX2; the dispatcher checks
/// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
/// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
#[inline(always)]
pub(crate) unsafe fn codes_q4k(q5: bool, w: &[u8], c: usize) -> (__m256i, __m256i) {
    let mask = _mm256_set1_epi8(0x0F);
    let qs = if q5 { w.as_ptr().add(48) } else { w.as_ptr().add(16) };
    let q = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
    let mut lo = _mm256_and_si256(q, mask);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
    if q5 {
        let one = _mm256_set1_epi8(1);
        let hbits = _mm256_loadu_si256(w.as_ptr().add(16) as *const __m256i);
        let b0 = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * c as i32)), one);
        let b1 = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * c as i32 + 1)), one);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
    }
    (lo, hi)
}

/// Codes (0..63) of a Q6_K superblock, elements 32j..32j+32 in `out[j]`.
///
/// # Safety
///
/// The CPU supports the features named in `target_feature` (AVX2; the dispatcher checks
/// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
/// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
#[inline(always)]
pub(crate) unsafe fn codes_q6k(w: &[u8]) -> [__m256i; 8] {
    let (ql, qh) = (w.as_ptr(), w.as_ptr().add(128));
    let mask = _mm256_set1_epi8(0x0F);
    // Bits 4–5 of each byte: where a code's two high bits go.
    let top = _mm256_set1_epi8(0x30);
    let mut u = [_mm256_setzero_si256(); 8];
    for nn in 0..2 {
        let a = _mm256_loadu_si256(ql.add(64 * nn) as *const __m256i);
        let b = _mm256_loadu_si256(ql.add(64 * nn + 32) as *const __m256i);
        let h = _mm256_loadu_si256(qh.add(32 * nn) as *const __m256i);
        // Bit pair k of each qh byte moved straight to bits 4–5 (a 16-bit shift by 4 − 2k;
        // the mask drops what crosses from the neighbouring byte).
        let h0 = _mm256_and_si256(_mm256_slli_epi16(h, 4), top);
        let h1 = _mm256_and_si256(_mm256_slli_epi16(h, 2), top);
        let h2 = _mm256_and_si256(h, top);
        let h3 = _mm256_and_si256(_mm256_srli_epi16(h, 2), top);
        u[4 * nn] = _mm256_or_si256(_mm256_and_si256(a, mask), h0);
        u[4 * nn + 1] = _mm256_or_si256(_mm256_and_si256(b, mask), h1);
        u[4 * nn + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), mask), h2);
        u[4 * nn + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), mask), h3);
    }
    u
}

/// Σ (u8·i8 pairs as i16) · scale16 into 8 lanes.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn dp_scaled(acc: __m256i, u: __m256i, x: __m256i, scale16: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale16))
}

/// Decode (one token) over R ≤ 4 rows of a K-quant (ids as in `KFormat`) at once, eight blocks
/// at a time. Each block's integer sums stay in vector lanes until eight are reduced together,
/// the scale products are formed eight at a time, and the rows' per-block float additions —
/// the operations of `accumulate`, block after block — run in the lanes of one vector. Rows of
/// four blocks or fewer share their reductions two by two (row r's blocks in lanes 0..4, row
/// r + 1's in lanes 4..8), so a short row does not pay for eight. Longer rows are walked one
/// after another, each whole (in pieces of 128 blocks past that), their groups' terms kept
/// until the R rows' chains run together.
///
/// # Safety
///
/// The CPU supports the features named in `target_feature` (AVX2; the dispatcher checks
/// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
/// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rowsk_decode<const R: usize, const K: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    out: &mut [f32; 4],
) {
    decode_body::<R, K, false, false>(w, row_bytes, act, out)
}

/// `rowsk_decode` with each block unpacked into 512-bit vectors (`k512_x86`) and its
/// products taken 64 values per instruction; the integer sums are the same, so are the bits.
///
/// # Safety
///
/// As `rowsk_decode`, and the CPU has AVX-512 F and BW (checked by `cpu::isa()`).
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn rowsk_decode_zmm<const R: usize, const K: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    out: &mut [f32; 4],
) {
    decode_body::<R, K, true, false>(w, row_bytes, act, out)
}

/// `rowsk_decode_zmm` with each block's products taken unscaled by the AVX-512 VNNI
/// `vpdpbusd` and its sub-block scales applied to the sums (`k512_x86::Packed`); the
/// integer sums are the same, so are the bits.
///
/// # Safety
///
/// As `rowsk_decode_zmm`, and the CPU has AVX-512 VNNI (checked by `Isa::uses_vnni`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn rowsk_decode_vnni<const R: usize, const K: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    out: &mut [f32; 4],
) {
    decode_body::<R, K, true, true>(w, row_bytes, act, out)
}

/// The body of `rowsk_decode` (Z = false), `rowsk_decode_zmm` (Z) and `rowsk_decode_vnni`
/// (Z and V), inlined into each with its instruction set.
///
/// # Safety
///
/// As `rowsk_decode` (and `rowsk_decode_zmm` where Z, `rowsk_decode_vnni` where V); only
/// called from those three.
#[inline(always)]
unsafe fn decode_body<const R: usize, const K: u32, const Z: bool, const V: bool>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    out: &mut [f32; 4],
) {
    const { assert!(R >= 1 && R <= 4) };
    let f = const { KFormat::of(K) };
    let bb = f.dtype.block_bytes();
    let nb = act.blocks_per_row();
    if nb <= 4 {
        // One group: rows two by two; lanes of `acc` (see `accumulate_pairs`): 0 row 0, 1 row
        // 2, 4 row 1, 5 row 3.
        let dx = _mm256_loadu_ps(act.d.as_ptr().add(act.idx(0, 0)));
        let dx = _mm256_permute2f128_ps(dx, dx, 0x00);
        let mut t = Terms::new();
        for p in 0..R.div_ceil(2) {
            let rows = (R - 2 * p).min(2);
            let mut g = KGroup::new();
            for h in 0..rows {
                let base = w.as_ptr().add((2 * p + h) * row_bytes);
                prefetch_rows(base.wrapping_add(R * row_bytes), row_bytes);
                g.blocks::<K, Z, V>(base, act, 0, nb, 4 * h);
            }
            g.terms(f, dx, &mut t, p);
        }
        let acc = if nb == 4 {
            accumulate_pairs(f.m_at.is_some(), _mm256_setzero_ps(), &t, 4)
        } else {
            accumulate_pairs(f.m_at.is_some(), _mm256_setzero_ps(), &t, nb)
        };
        let mut v = [0f32; 8];
        _mm256_storeu_ps(v.as_mut_ptr(), acc);
        let lanes = [0, 4, 1, 5];
        for r in 0..R {
            out[r] = v[lanes[r]];
        }
        return;
    }
    // Longer rows: each walked whole, in memory order, one after another (a single sequential
    // stream), its groups' terms kept; then the rows' float chains run together, one row per
    // lane (`accumulate4`). Terms of up to MAXG groups (8 KiB) at a time.
    const MAXG: usize = 16;
    let groups = nb.div_ceil(8);
    let mut acc = _mm_setzero_ps();
    let mut ts: [MaybeUninit<Terms>; MAXG] = [const { MaybeUninit::uninit() }; MAXG];
    let mut g0 = 0;
    while g0 < groups {
        let g1 = (g0 + MAXG).min(groups);
        for r in 0..R {
            for g in g0..g1 {
                let (b0, m) = (8 * g, (nb - 8 * g).min(8));
                // Activation rows are padded with zero blocks to whole groups of eight.
                let dx = _mm256_loadu_ps(act.d.as_ptr().add(act.idx(0, b0)));
                let base = w.as_ptr().add(r * row_bytes + b0 * bb);
                prefetch_stream(base.wrapping_add(m * bb), m * bb);
                if r == 0 {
                    Terms::zero_rows(ts[g - g0].as_mut_ptr(), R);
                }
                let mut kg = KGroup::new();
                kg.blocks::<K, Z, V>(base, act, b0, m, 0);
                // Rows 0..R are written here, rows R..4 were zeroed above.
                kg.terms(f, dx, ts[g - g0].as_mut_ptr(), r);
            }
        }
        for g in g0..g1 {
            let (m, t) = ((nb - 8 * g).min(8), ts[g - g0].assume_init_ref());
            acc = if m == 8 {
                accumulate4(f.m_at.is_some(), acc, t, 8)
            } else {
                accumulate4(f.m_at.is_some(), acc, t, m)
            };
        }
        g0 = g1;
    }
    let mut v = [0f32; 4];
    _mm_storeu_ps(v.as_mut_ptr(), acc);
    out[..R].copy_from_slice(&v[..R]);
}

/// The integer sums and scale bits of up to eight blocks (of one row, or of two rows' four),
/// slot j for block j. The sums start unwritten: `blocks` writes its slots and zeroes those
/// after them, so a whole group costs no zeroing (zeroing the 512 bytes of every group was a
/// call to `memset` per eight blocks).
struct KGroup {
    a: [MaybeUninit<__m256i>; 8],
    mn: [MaybeUninit<__m256i>; 8],
    dbits: [u16; 8],
    mbits: [u16; 8],
}

impl KGroup {
    /// # Safety
    ///
    /// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
    #[inline(always)]
    unsafe fn new() -> KGroup {
        KGroup { a: [MaybeUninit::uninit(); 8], mn: [MaybeUninit::uninit(); 8], dbits: [0; 8], mbits: [0; 8] }
    }

    /// Blocks `b0..b0 + m` of the row whose block `b0` is at `base`, into slots `slot..`, and
    /// zero sums into the slots after them; with `Z`, unpacked and multiplied in 512-bit
    /// vectors, with `V` by VNNI.
    ///
    /// # Safety
    ///
    /// `base` holds the m blocks; `act` one token's activations for the row; `slot + m ≤ 8`;
    /// slots below `slot` were written by an earlier call; AVX2, AVX-512 F and BW where `Z`,
    /// and VNNI where `V`.
    #[inline(always)]
    unsafe fn blocks<const K: u32, const Z: bool, const V: bool>(
        &mut self,
        base: *const u8,
        act: &QuantAct,
        b0: usize,
        m: usize,
        slot: usize,
    ) {
        let f = const { KFormat::of(K) };
        let bb = f.dtype.block_bytes();
        let i0 = act.idx(0, b0);
        for j in 0..m {
            let blk = base.add(j * bb);
            let xi = i0 + j;
            let xq = act.qs.as_ptr().add(xi * 256);
            let bs = _mm256_loadu_si256(act.bsums.as_ptr().add(xi * 16) as *const __m256i);
            let (a, mn) = if V {
                super::k512_x86::unpack_packed::<K>(blk).dot(f.offset_shift, xq, bs)
            } else if Z {
                let (u, sv, sums16) = super::k512_x86::unpack::<K>(blk);
                super::x86_512::dot_unpacked(f.offset_shift, &u, &sv, sums16, xq, bs)
            } else {
                let (u, sv, sums16) = unpack::<K>(blk);
                dot_unpacked(f.offset_shift, &u, &sv, sums16, xq, bs)
            };
            self.a[slot + j].write(a);
            self.mn[slot + j].write(mn);
            self.dbits[slot + j] = (blk.add(f.d_at) as *const u16).read_unaligned();
            if let Some(m_at) = f.m_at {
                self.mbits[slot + j] = (blk.add(m_at) as *const u16).read_unaligned();
            }
        }
        for j in slot + m..8 {
            self.a[j].write(_mm256_setzero_si256());
            self.mn[j].write(_mm256_setzero_si256());
        }
    }

    /// The float terms of the eight slots into `t`'s vectors `i`: `d·dx` and the sums, and for
    /// a format with minima `−(dmin·dx)` and the min sums (zero for the others).
    ///
    /// # Safety
    ///
    /// `blocks` has written all eight slots; `t` points to a `Terms` (whose other vectors may
    /// be unwritten); the CPU has AVX2 and F16C (checked by `cpu::isa()`).
    #[inline(always)]
    unsafe fn terms(&self, f: KFormat, dx: __m256, t: *mut Terms, i: usize) {
        let (a, mn) = (self.a.as_ptr() as *const [__m256i; 8], self.mn.as_ptr() as *const [__m256i; 8]);
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(self.dbits.as_ptr() as *const __m128i));
        (*t).ddx[i] = _mm256_mul_ps(dw, dx);
        (*t).isf[i] = _mm256_cvtepi32_ps(reduce8x8(&*a));
        let (mut m, mut sx) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        if f.m_at.is_some() {
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(self.mbits.as_ptr() as *const __m128i));
            m = _mm256_xor_ps(_mm256_mul_ps(mw, dx), _mm256_set1_ps(-0.0));
            sx = _mm256_cvtepi32_ps(reduce8x8(&*mn));
        }
        ((*t).m[i], (*t).sx[i]) = (m, sx);
    }
}

/// The float terms of four (row or (row, token)) pairs for `accumulate4`, eight blocks each
/// (block j in lane j; absent pairs and blocks zero): a block's step is `fma(ddx, isf, acc)`,
/// then for formats with a second term `fma(m, sx, acc)` (Q4_1/Q5_1: the block minimum and the
/// activation sum; the K-quants with minima: `−(dmin·dx)` and the min sums).
pub(crate) struct Terms {
    pub(crate) ddx: [__m256; 4],
    pub(crate) isf: [__m256; 4],
    pub(crate) m: [__m256; 4],
    pub(crate) sx: [__m256; 4],
}

impl Terms {
    /// # Safety
    ///
    /// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
    #[inline(always)]
    pub(crate) unsafe fn new() -> Terms {
        let z = [_mm256_setzero_ps(); 4];
        Terms { ddx: z, isf: z, m: z, sx: z }
    }

    /// Zero vectors `from..4` of the `Terms` at `t` (the pairs a kernel of fewer than four
    /// rows leaves unwritten), leaving the others as they are.
    ///
    /// # Safety
    ///
    /// `t` is valid for writes; AVX2 is present.
    #[inline(always)]
    unsafe fn zero_rows(t: *mut Terms, from: usize) {
        for i in from..4 {
            let z = _mm256_setzero_ps();
            ((*t).ddx[i], (*t).isf[i], (*t).m[i], (*t).sx[i]) = (z, z, z, z);
        }
    }

    /// The four term vectors transposed (`transpose4`); the second pair only with `second`.
    ///
    /// # Safety
    ///
    /// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
    #[inline(always)]
    unsafe fn transposed(&self, second: bool) -> [[__m256; 4]; 4] {
        let (dt, st) = (transpose4(&self.ddx), transpose4(&self.isf));
        let (mt, xt) = if second { (transpose4(&self.m), transpose4(&self.sx)) } else { (dt, st) };
        [dt, st, mt, xt]
    }
}

/// `acc` (lane r: pair r's sum) after `m` blocks' steps of `accumulate`, block after block:
/// lane r of block j is `fma(ddx[r][j], isf[r][j], acc[r])`, then with `second`
/// `fma(m[r][j], sx[r][j], acc[r])`; the terms are transposed so that one `vfmadd` serves the
/// four pairs.
///
/// # Safety
///
/// The CPU has AVX2 and FMA (checked by `cpu::isa()`); `m ≤ 8`.
#[inline(always)]
pub(crate) unsafe fn accumulate4(second: bool, acc: __m128, t: &Terms, m: usize) -> __m128 {
    let [dt, st, mt, xt] = t.transposed(second);
    let mut acc = acc;
    for j in 0..m {
        let (k, hi) = (j % 4, j >= 4);
        let h = |v: __m256| if hi { _mm256_extractf128_ps(v, 1) } else { _mm256_castps256_ps128(v) };
        acc = _mm_fmadd_ps(h(dt[k]), h(st[k]), acc);
        if second {
            acc = _mm_fmadd_ps(h(mt[k]), h(xt[k]), acc);
        }
    }
    acc
}

/// As `accumulate4` for rows of at most four blocks whose terms come two rows a vector
/// (`t`'s vector p: row 2p in lanes 0..4, row 2p + 1 in lanes 4..8): the transposed terms of
/// block j hold rows 0, 2 in lanes 0, 1 and rows 1, 3 in lanes 4, 5, and so does `acc`.
///
/// # Safety
///
/// The CPU has AVX2 and FMA (checked by `cpu::isa()`); `m ≤ 4`.
#[inline(always)]
unsafe fn accumulate_pairs(second: bool, acc: __m256, t: &Terms, m: usize) -> __m256 {
    let [dt, st, mt, xt] = t.transposed(second);
    let mut acc = acc;
    for j in 0..m {
        acc = _mm256_fmadd_ps(dt[j], st[j], acc);
        if second {
            acc = _mm256_fmadd_ps(mt[j], xt[j], acc);
        }
    }
    acc
}

/// Lanes 0..4 (`J < 4`) or 4..8 of `v`.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn half<const J: usize>(v: __m256) -> __m128 {
    if J < 4 {
        _mm256_castps256_ps128(v)
    } else {
        _mm256_extractf128_ps(v, 1)
    }
}

/// Lanes j and j + 4 of four vectors → (lane r: lane j of vector r, for j in 0..4; the high
/// 128-bit lane likewise for j + 4).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn transpose4(v: &[__m256; 4]) -> [__m256; 4] {
    let (a, b) = (_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
    let (c, e) = (_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
    [
        _mm256_shuffle_ps(a, c, 0x44),
        _mm256_shuffle_ps(a, c, 0xEE),
        _mm256_shuffle_ps(b, e, 0x44),
        _mm256_shuffle_ps(b, e, 0xEE),
    ]
}

/// Tokens `t0..t0 + n` (n ≤ `SMALL_BATCH`) over R rows of a K-quant (ids as in `rowsk_decode`): each
/// block's codes and scales are unpacked once for all the tokens (four at a time), each
/// token's integer sums stay in vector lanes until eight blocks are reduced together, and
/// each (row, token) pair is its own float chain through the blocks in order — the
/// operations of `rowsk_decode`, token by token, so every value has the decode kernel's
/// bits. `out[t][r]` receives row r, token t0 + t.
///
/// # Safety
///
/// As `rowsk_decode`; `t0 + n` tokens exist in `act`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rowsk_batch<const R: usize, const K: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    t0: usize,
    n: usize,
    out: &mut BatchOut,
    s: &mut BatchScratch,
) {
    batch_body::<R, K, false, false>(w, row_bytes, act, t0, n, out, s)
}

/// `rowsk_batch` with each token's products in 512-bit vectors (two 32-value sub-blocks per
/// instruction, half the instructions per token); the integer sums are the same, so are the
/// bits.
///
/// # Safety
///
/// As `rowsk_batch`, and the CPU has AVX-512 F and BW (checked by `cpu::isa()`).
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn rowsk_batch_zmm<const R: usize, const K: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    t0: usize,
    n: usize,
    out: &mut BatchOut,
    s: &mut BatchScratch,
) {
    batch_body::<R, K, true, false>(w, row_bytes, act, t0, n, out, s)
}

/// `rowsk_batch_zmm` with each block's products taken unscaled by the AVX-512 VNNI `vpdpbusd`
/// and its scales applied to the sums (`k512_x86::Packed`, unpacked once for all the tokens);
/// the integer sums are the same, so are the bits.
///
/// # Safety
///
/// As `rowsk_batch_zmm`, and the CPU has AVX-512 VNNI (checked by `Isa::uses_vnni`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn rowsk_batch_vnni<const R: usize, const K: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    t0: usize,
    n: usize,
    out: &mut BatchOut,
    s: &mut BatchScratch,
) {
    batch_body::<R, K, true, true>(w, row_bytes, act, t0, n, out, s)
}

/// The body of `rowsk_batch` (Z = false), `rowsk_batch_zmm` (Z) and `rowsk_batch_vnni` (Z and
/// V), inlined into each with its instruction set.
///
/// # Safety
///
/// As `rowsk_batch` (and `rowsk_batch_zmm` where Z, `rowsk_batch_vnni` where V); only called
/// from those three, whose instruction sets it is compiled with.
#[inline(always)]
unsafe fn batch_body<const R: usize, const K: u32, const Z: bool, const V: bool>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    t0: usize,
    n: usize,
    out: &mut BatchOut,
    s: &mut BatchScratch,
) {
    let f = const { KFormat::of(K) };
    let dtype = f.dtype;
    debug_assert!((1..=SMALL_BATCH).contains(&n));
    let bb = dtype.block_bytes();
    let nb = act.blocks_per_row();
    let mut acc = [[0f32; SMALL_BATCH]; R];
    // Scratch of the thread: every group overwrites what it reads (zero lanes are only needed
    // past the row's last block, in its last group).
    let mut dx = [_mm256_setzero_ps(); SMALL_BATCH];
    // [row][token][block] products of scales and integer sums, as `rowsk_decode` forms them.
    let BatchScratch { ddx, isf, mdx, minf, a, mn, .. } = s;
    let mut dbits = [0u16; 8];
    let mut mbits = [0u16; 8];
    let mut b0 = 0;
    while b0 < nb {
        let m = (nb - b0).min(8);
        if m < 8 {
            for t in 0..n {
                a[t][m..].fill(_mm256_setzero_si256());
                mn[t][m..].fill(_mm256_setzero_si256());
            }
        }
        // Activation rows are padded with zero blocks to whole groups of eight.
        for t in 0..n {
            dx[t] = _mm256_loadu_ps(act.d.as_ptr().add(act.idx(t0 + t, b0)));
        }
        for r in 0..R {
            let base = w.as_ptr().add(r * row_bytes + b0 * bb);
            prefetch_rows(base.wrapping_add(R * row_bytes), m * bb);
            for j in 0..m {
                let blk = base.add(j * bb);
                if V {
                    let k = super::k512_x86::unpack_packed::<K>(blk);
                    for t in 0..n {
                        let xi = act.idx(t0 + t, b0 + j);
                        let xq = act.qs.as_ptr().add(xi * 256);
                        let bs = _mm256_loadu_si256(act.bsums.as_ptr().add(xi * 16) as *const __m256i);
                        (a[t][j], mn[t][j]) = k.dot(f.offset_shift, xq, bs);
                    }
                } else if Z {
                    let (u, sv, sums16) = super::k512_x86::unpack::<K>(blk);
                    for t in 0..n {
                        let xi = act.idx(t0 + t, b0 + j);
                        let xq = act.qs.as_ptr().add(xi * 256);
                        let bs = _mm256_loadu_si256(act.bsums.as_ptr().add(xi * 16) as *const __m256i);
                        (a[t][j], mn[t][j]) = super::x86_512::dot_unpacked(f.offset_shift, &u, &sv, sums16, xq, bs);
                    }
                } else {
                    let (u, sv, sums16) = unpack::<K>(blk);
                    for t in 0..n {
                        let xi = act.idx(t0 + t, b0 + j);
                        let xq = act.qs.as_ptr().add(xi * 256);
                        let bs = _mm256_loadu_si256(act.bsums.as_ptr().add(xi * 16) as *const __m256i);
                        (a[t][j], mn[t][j]) = dot_unpacked(f.offset_shift, &u, &sv, sums16, xq, bs);
                    }
                }
                dbits[j] = (blk.add(f.d_at) as *const u16).read_unaligned();
                if let Some(m_at) = f.m_at {
                    mbits[j] = (blk.add(m_at) as *const u16).read_unaligned();
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(dbits.as_ptr() as *const __m128i));
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(mbits.as_ptr() as *const __m128i));
            for t in 0..n {
                _mm256_storeu_ps(ddx[r][t].as_mut_ptr(), _mm256_mul_ps(dw, dx[t]));
                _mm256_storeu_ps(isf[r][t].as_mut_ptr(), _mm256_cvtepi32_ps(reduce8x8(&a[t])));
                if f.m_at.is_some() {
                    let neg = _mm256_xor_ps(_mm256_mul_ps(mw, dx[t]), _mm256_set1_ps(-0.0));
                    _mm256_storeu_ps(mdx[r][t].as_mut_ptr(), neg);
                    _mm256_storeu_ps(minf[r][t].as_mut_ptr(), _mm256_cvtepi32_ps(reduce8x8(&mn[t])));
                }
            }
        }
        for j in 0..m {
            for r in 0..R {
                for t in 0..n {
                    // accumulate(): fma(d·dx, isum, acc), then fma(−(dmin·dx), mins, acc).
                    acc[r][t] = ddx[r][t][j].mul_add(isf[r][t][j], acc[r][t]);
                    if f.m_at.is_some() {
                        acc[r][t] = mdx[r][t][j].mul_add(minf[r][t][j], acc[r][t]);
                    }
                }
            }
        }
        b0 += m;
    }
    for r in 0..R {
        for t in 0..n {
            out[t][r] = acc[r][t];
        }
    }
}

/// A Q4_K/Q5_K block's eight 6-bit scales and eight mins as bytes `[s0..s7, m0..m7]` in both
/// 128-bit halves, unpacked with byte shuffles from the block's first 16 bytes (d, dmin and
/// the 12 scale bytes).
///
/// Sub-blocks 0..3 keep scale and min in the low six bits of scale bytes 0..3 and 4..7;
/// sub-blocks 4..7 take their low four bits from a nibble of bytes 8..11 and their top two
/// bits from the top of bytes 0..3 (scales) or 4..7 (mins).
///
/// # Safety
///
/// `blk` points to a whole block (at least 16 bytes); the CPU has AVX2 (checked by
/// `cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn k4_scale_bytes(blk: *const u8) -> __m256i {
    // Block bytes 4..7 = a (low scales), 8..11 = b (low mins), 12..15 = c (high nibbles).
    let v = _mm_loadu_si128(blk as *const __m128i);
    let acbc = _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    let zazb = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    let (s, c, z) = (0x3F, 0x0F, 0);
    // The masks keep each byte's own bits after the 16-bit shifts.
    let low = _mm_and_si128(acbc, _mm_setr_epi8(s, s, s, s, c, c, c, c, s, s, s, s, z, z, z, z));
    let c_hi = _mm_and_si128(_mm_srli_epi16(acbc, 4), _mm_setr_epi8(z, z, z, z, z, z, z, z, z, z, z, z, c, c, c, c));
    let t = 0x30;
    let top = _mm_and_si128(_mm_srli_epi16(zazb, 2), _mm_setr_epi8(z, z, z, z, t, t, t, t, z, z, z, z, t, t, t, t));
    _mm256_broadcastsi128_si256(_mm_or_si128(_mm_or_si128(low, c_hi), top))
}

/// i16 lanes all equal to byte `k` of each 128-bit half of `v` (a `vpshufb` control whose odd
/// bytes clear).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn pick_byte16(v: __m256i, k: i32) -> __m256i {
    _mm256_shuffle_epi8(v, _mm256_set1_epi16((0x8000u32 as i32 | k) as i16))
}

/// Where the K-quant kernels of this file find a format's fields (by GGML id: Q2_K = 10,
/// Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14).
#[derive(Clone, Copy)]
pub(crate) struct KFormat {
    pub(crate) dtype: DType,
    /// Byte offset of the f16 super-block scale `d`.
    d_at: usize,
    /// Byte offset of the f16 `dmin`, for the formats with minima (Q2_K, Q4_K, Q5_K).
    m_at: Option<usize>,
    /// log2 of the offset stored in every code (Q3_K: 4, Q6_K: 32), taken off through the
    /// 16-value sums.
    offset_shift: Option<i32>,
}

impl KFormat {
    pub(crate) const fn of(id: u32) -> KFormat {
        let (dtype, d_at, m_at, offset_shift) = match id {
            10 => (DType::Q2_K, 80, Some(82), None),
            11 => (DType::Q3_K, 108, None, Some(2)),
            12 => (DType::Q4_K, 0, Some(2), None),
            13 => (DType::Q5_K, 0, Some(2), None),
            14 => (DType::Q6_K, 208, None, Some(5)),
            _ => panic!("not a K-quant handled here"),
        };
        KFormat { dtype, d_at, m_at, offset_shift }
    }
}

/// The block at `blk` of K-quant `K` unpacked for dot products with any number of tokens:
/// its codes in element order (unsigned, 32 per vector), each vector's scales as i16 lanes,
/// and the i16 factors of the 16-value sums (the mins, or for formats with a stored offset
/// the scales).
///
/// # Safety
///
/// `blk` points to one whole block; AVX2 is present.
#[inline(always)]
pub(crate) unsafe fn unpack<const K: u32>(blk: *const u8) -> ([__m256i; 8], [__m256i; 8], __m256i) {
    match K {
        10 => super::k23_x86::unpack::<false>(blk).parts(),
        11 => super::k23_x86::unpack::<true>(blk).parts(),
        12 => unpack_q4k(false, blk),
        13 => unpack_q4k(true, blk),
        _ => unpack_q6k(blk),
    }
}

/// The `vpshufb` control that spreads the mins of `k4_scale_bytes` (bytes 8..15) as i16, each
/// twice (one per 16-value sum): min j into i16 lanes 2j and 2j + 1, odd bytes cleared.
pub(crate) const MINS_TWICE: [i8; 32] = [
    8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1, 11, -1, 12, -1, 12, -1, 13, -1, 13, -1, 14, -1, 14, -1, 15, -1,
    15, -1,
];

/// A Q4_K/Q5_K block unpacked for dot products with any number of tokens: its codes in
/// element order (32 per vector), each vector's sub-block scale as i16 lanes, and its mins
/// each twice (one per 16-value sum).
///
/// # Safety
///
/// `blk` points to one whole block; AVX2 is present.
#[inline(always)]
unsafe fn unpack_q4k(q5: bool, blk: *const u8) -> ([__m256i; 8], [__m256i; 8], __m256i) {
    let sb = k4_scale_bytes(blk);
    let w = std::slice::from_raw_parts(blk, if q5 { 176 } else { 144 });
    let mut u = [_mm256_setzero_si256(); 8];
    let mut sv = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        (u[2 * c], u[2 * c + 1]) = codes_q4k(q5, w, c);
        sv[2 * c] = pick_byte16(sb, 2 * c as i32);
        sv[2 * c + 1] = pick_byte16(sb, 2 * c as i32 + 1);
    }
    let mins2 = _mm256_shuffle_epi8(sb, _mm256_loadu_si256(MINS_TWICE.as_ptr() as *const __m256i));
    (u, sv, mins2)
}

/// A Q6_K block unpacked likewise: codes 0..63 (32 per vector), each vector's two 16-value
/// scales as i16 lanes (one per 128-bit half), and the sixteen scales as i16.
///
/// # Safety
///
/// `blk` points to one whole block; AVX2 is present.
#[inline(always)]
unsafe fn unpack_q6k(blk: *const u8) -> ([__m256i; 8], [__m256i; 8], __m256i) {
    let u = codes_q6k(std::slice::from_raw_parts(blk, 210));
    let sc = _mm_loadu_si128(blk.add(192) as *const __m128i);
    let lo8 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc));
    let hi8 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc, 8)));
    let mut sv = [_mm256_setzero_si256(); 8];
    for (j, v) in sv.iter_mut().enumerate() {
        *v = _mm256_shuffle_epi8(if j < 4 { lo8 } else { hi8 }, q6k_scale_ctrl(j));
    }
    (u, sv, _mm256_cvtepi8_epi16(sc))
}

/// The `vpshufb` control that spreads, from i16 scales of 16-value groups, group 2j's scale
/// over the low half and group 2j+1's over the high half (code vector j holds both groups).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn q6k_scale_ctrl(j: usize) -> __m256i {
    let k = 2 * (j % 4) as i32;
    let lo = ((2 * k + 1) << 8 | (2 * k)) as i16;
    let hi = ((2 * k + 3) << 8 | (2 * k + 2)) as i16;
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

/// One unpacked K-quant block (`unpack`) against one token's Q8_K codes `xq` and 16-value sums
/// `bs`: (Σ scale·code·x in 8 lanes, Σ min·(16-value sums) in 8 lanes). Where the codes carry
/// a stored offset (`offset_shift`: Q3_K's 4, Q6_K's 32 as powers of two), it is taken off the
/// first through the sums and the second is zero.
///
/// # Safety
///
/// `xq` points to the block's 256 activation codes; AVX2 is present.
#[inline(always)]
pub(crate) unsafe fn dot_unpacked(
    offset_shift: Option<i32>,
    u: &[__m256i; 8],
    sv: &[__m256i; 8],
    sums16: __m256i,
    xq: *const i8,
    bs: __m256i,
) -> (__m256i, __m256i) {
    let mut v = _mm256_setzero_si256();
    for k in 0..8 {
        v = dp_scaled(v, u[k], _mm256_loadu_si256(xq.add(32 * k) as *const __m256i), sv[k]);
    }
    offset_or_mins(offset_shift, v, _mm256_madd_epi16(sums16, bs))
}

/// A block's (scaled sums `v`, `m` = its 16-value activation sums times their factors) as
/// the K-quant kernels return them: where the codes carry a stored offset (`offset_shift`,
/// log2 of it), `m` times the offset comes off `v` and the second part is zero; otherwise `m`
/// is the min sums, kept.
///
/// # Safety
///
/// Needs only AVX2 (the callers' target features include it).
#[inline(always)]
pub(crate) unsafe fn offset_or_mins(offset_shift: Option<i32>, v: __m256i, m: __m256i) -> (__m256i, __m256i) {
    match offset_shift {
        Some(sh) => (_mm256_sub_epi32(v, _mm256_sll_epi32(m, _mm_cvtsi32_si128(sh))), _mm256_setzero_si256()),
        None => (v, m),
    }
}
