//! How a Q2_K or Q3_K block unpacks for the AVX2 kernels: the decode and small-batch kernels of
//! `x86` take the unpacked form, and the tiled prefill kernels (`tiled_avx2`, `x86_512`) its
//! codes.
//!
//! Both formats keep 2-bit codes in `qs[64]`: code vector k (elements 32k..32k + 32, k = 4n + j)
//! is bits 2j..2j + 2 of bytes 32n..32n + 32, and its low 16 lanes belong to 16-value group 2k,
//! its high 16 lanes to group 2k + 1. Q3_K adds a third bit from `hmask` (bit k of byte i for
//! element 32k + i), taken here as +4, so its codes are unsigned 0..7 and the stored −4 comes
//! off through the activations' 16-value sums: Σ s·(q − 4)·x = Σ s·q·x − 4·Σ s·bsum. Codes go
//! through `vpmaddubsw` (a pair is at most 2·7·127 = 1778: no saturation) and `vpmaddwd` with
//! the group's scale, so each block's `isum` (and Q2_K's `mins`, Σ min·bsum) is the exact
//! integer of `dot_ref::block_ints`. The float side is `dot_ref::accumulate` block after block:
//! `fma(d·dx, isum, acc)`, then for Q2_K `fma(−(dmin·dx), mins, acc)`; rows (decode) or tokens
//! (prefill) sit in separate chains or lanes, so every result equals the scalar reference to the
//! bit, whatever the batch or the thread count.

// Index loops over blocks, rows and tokens read most plainly in kernel code.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

/// The sixteen signed scales of a Q3_K block (6-bit, minus 32) as bytes, in group order, from
/// its 12 scale bytes at `s`: group j's low four bits are a nibble of bytes 0..7 (low nibbles for
/// groups 0..7, high for 8..15), its top two bits bits 2(j/4)..2(j/4) + 2 of byte 8 + j % 4.
///
/// # Safety
///
/// `s` is valid for reading 12 bytes; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn q3_scales(s: *const u8) -> __m128i {
    let a = (s as *const u32).read_unaligned();
    let b = (s.add(4) as *const u32).read_unaligned();
    let h = (s.add(8) as *const u32).read_unaligned();
    const LO: u32 = 0x0F0F_0F0F;
    const HI: u32 = 0x0303_0303;
    let g0 = (a & LO) | ((h & HI) << 4);
    let g1 = (b & LO) | (((h >> 2) & HI) << 4);
    let g2 = ((a >> 4) & LO) | (((h >> 4) & HI) << 4);
    let g3 = ((b >> 4) & LO) | (((h >> 6) & HI) << 4);
    _mm_sub_epi8(_mm_set_epi32(g3 as i32, g2 as i32, g1 as i32, g0 as i32), _mm_set1_epi8(32))
}

/// The `vpshufb` control that puts i16 lane `2k % 8` of the low 128-bit half in every i16 of the
/// low half, and lane `(2k + 1) % 8` of the high half in every i16 of the high half.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn pick_ctrl(k: usize) -> __m256i {
    let (a, b) = ((2 * k % 8) as i16, ((2 * k + 1) % 8) as i16);
    let lo = ((2 * a + 1) << 8) | (2 * a);
    let hi = ((2 * b + 1) << 8) | (2 * b);
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

/// The eight i16 scale vectors of a block's code vectors (vector k: group 2k's scale in the low
/// half, group 2k + 1's in the high half), from the sixteen scales as i16 (`s16`).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn scale_vectors(s16: __m256i) -> [__m256i; 8] {
    // Groups 0..7 in both halves, then groups 8..15 in both halves.
    let lo8 = _mm256_permute2x128_si256(s16, s16, 0x00);
    let hi8 = _mm256_permute2x128_si256(s16, s16, 0x11);
    let mut sv = [_mm256_setzero_si256(); 8];
    for k in 0..8 {
        sv[k] = _mm256_shuffle_epi8(if k < 4 { lo8 } else { hi8 }, pick_ctrl(k));
    }
    sv
}

/// A block's unpacked form: its eight code vectors (unsigned, element order) and their scale
/// vectors, plus the sixteen scales (Q3_K) or mins (Q2_K) as i16 for the 16-value sums.
pub(crate) struct Unpacked {
    pub(crate) u: [__m256i; 8],
    sv: [__m256i; 8],
    /// Q2_K: the mins; Q3_K: the scales (the −4 correction).
    s16: __m256i,
}

impl Unpacked {
    /// (codes, scale vectors, the 16-value sums' factors), as the K-quant kernels of `x86`
    /// take them.
    #[inline(always)]
    pub(crate) fn parts(self) -> ([__m256i; 8], [__m256i; 8], __m256i) {
        (self.u, self.sv, self.s16)
    }
}

/// Unpacks the block at `blk`.
///
/// # Safety
///
/// `blk` points to one whole block of the format; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn unpack<const Q3: bool>(blk: *const u8) -> Unpacked {
    let three = _mm256_set1_epi8(3);
    let (qs, s16, sc16) = if Q3 {
        let s16 = _mm256_cvtepi8_epi16(q3_scales(blk.add(96)));
        (blk.add(32), s16, s16)
    } else {
        let sc = _mm_loadu_si128(blk as *const __m128i);
        let nib = _mm_set1_epi8(0x0F);
        let scales = _mm256_cvtepu8_epi16(_mm_and_si128(sc, nib));
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), nib));
        (blk.add(16), mins, scales)
    };
    let q = [_mm256_loadu_si256(qs as *const __m256i), _mm256_loadu_si256(qs.add(32) as *const __m256i)];
    let hm = if Q3 { _mm256_loadu_si256(blk as *const __m256i) } else { _mm256_setzero_si256() };
    let mut u = [_mm256_setzero_si256(); 8];
    // Code vector k: bits 2j..2j + 2 of q[n] (k = 4n + j); for Q3_K, bit k of each hmask byte
    // moved to bit 2 (the +4) by the shift `$h` (`$hs` places).
    macro_rules! code {
        ($k:literal, $h:ident, $hs:literal) => {{
            let v = _mm256_srli_epi16(q[$k / 4], 2 * ($k % 4));
            let mut c = _mm256_and_si256(v, three);
            if Q3 {
                c = _mm256_or_si256(c, _mm256_and_si256($h(hm, $hs), _mm256_set1_epi8(4)));
            }
            u[$k] = c;
        }};
    }
    code!(0, _mm256_slli_epi16, 2);
    code!(1, _mm256_slli_epi16, 1);
    code!(2, _mm256_srli_epi16, 0);
    code!(3, _mm256_srli_epi16, 1);
    code!(4, _mm256_srli_epi16, 2);
    code!(5, _mm256_srli_epi16, 3);
    code!(6, _mm256_srli_epi16, 4);
    code!(7, _mm256_srli_epi16, 5);
    Unpacked { u, sv: scale_vectors(sc16), s16 }
}

#[cfg(test)]
mod tests {
    use crate::cpu::Isa;
    use crate::matmul::matmul_with_isa;
    use crate::quant::blocks::q3k_scales;
    use crate::{DType, MatRef, ThreadPool};

    fn lcg(seed: u64) -> impl FnMut() -> u32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u32
        }
    }

    /// A finite f16 (as bits): mostly a realistic scale (either sign, magnitude 2^−10..2^1),
    /// and where `edges`, one in five an extreme (±0, the smallest subnormal, the largest normal,
    /// the smallest normal).
    fn f16_bits(next: &mut impl FnMut() -> u32, edges: bool) -> u16 {
        if edges && next().is_multiple_of(5) {
            return [0x0000, 0x8000, 0x0001, 0x8001, 0x7BFF, 0xFBFF, 0x0400][(next() % 7) as usize];
        }
        let sign = ((next() & 1) as u16) << 15;
        sign | ((5 + next() % 11) as u16) << 10 | (next() & 0x3FF) as u16
    }

    /// Random rows of `dtype`: random bytes with finite f16 scales; where `edges`, one block in
    /// four with its scale bytes, codes or high bits all set or all clear.
    fn random_rows(dtype: DType, rows: usize, cols: usize, seed: u64, edges: bool) -> Vec<u8> {
        let mut next = lcg(seed);
        let bb = dtype.block_bytes();
        let mut v: Vec<u8> = (0..rows * dtype.row_bytes(cols).unwrap()).map(|_| next() as u8).collect();
        let (scales, codes, high, f16s): (_, _, _, &[usize]) = match dtype {
            DType::Q2_K => (0..16, 16..80, 0..0, &[80, 82]),
            _ => (96..108, 32..96, 0..32, &[108]),
        };
        for b in v.chunks_exact_mut(bb) {
            for &o in f16s {
                let bits = f16_bits(&mut next, edges);
                b[o..o + 2].copy_from_slice(&bits.to_le_bytes());
            }
            if edges && next().is_multiple_of(4) {
                for range in [scales.clone(), codes.clone(), high.clone()] {
                    match next() % 3 {
                        0 => b[range].fill(0xFF),
                        1 => b[range].fill(0),
                        _ => {}
                    }
                }
            }
        }
        v
    }

    /// Rows quantized from smooth values (the codes a real quantizer picks).
    fn quantized_rows(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let v: Vec<f32> =
            (0..rows * cols).map(|i| (i as f32 * 0.37 + seed as f32).sin() * (1.0 + (i % 97) as f32 * 0.02)).collect();
        crate::quant::quantize_rows(dtype, &v, cols)
    }

    /// Activations of varied magnitude; every third token all ±1 (codes all ±127: the
    /// largest integer sums).
    fn xs(n: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut next = lcg(seed);
        (0..n * cols)
            .map(|i| {
                let r = next();
                if (i / cols) % 3 == 2 {
                    if r & 1 == 0 {
                        1.0
                    } else {
                        -1.0
                    }
                } else {
                    (r as f32 / (1u64 << 31) as f32 - 1.0) * [1.0, 0.02, 7.0][i / 96 % 3]
                }
            })
            .collect()
    }

    fn check(dtype: DType, w: &[u8], rows: usize, cols: usize, n: usize, pools: &[ThreadPool]) {
        let m = MatRef::new(dtype, rows, cols, w).unwrap();
        let x = xs(n, cols, 9 + n as u64);
        let mut want = vec![0f32; n * rows];
        crate::matmul_ref(m, &x, n, &mut want);
        for pool in pools {
            for isa in Isa::supported() {
                let got = matmul_with_isa(isa, pool, m, &x, n);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{dtype} {isa:?} {rows}x{cols} n={n} threads={} element {i}: {a} vs {b}",
                        pool.n_threads()
                    );
                }
            }
        }
    }

    #[test]
    fn q3k_scales_equal_the_reference() {
        if !Isa::supported().contains(&Isa::Avx2) {
            return;
        }
        let mut next = lcg(5);
        for case in 0..200 {
            let s: [u8; 12] = std::array::from_fn(|_| match case {
                0 => 0xFF,
                1 => 0,
                _ => next() as u8,
            });
            let mut got = [0i8; 16];
            // SAFETY: AVX2 is present (checked above); `s` holds 12 bytes.
            unsafe {
                use std::arch::x86_64::*;
                _mm_storeu_si128(got.as_mut_ptr() as *mut __m128i, super::q3_scales(s.as_ptr()))
            };
            assert_eq!(got, q3k_scales(&s), "{s:?}");
        }
    }

    #[test]
    fn every_isa_matches_the_reference_bit_for_bit() {
        let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
        for dtype in [DType::Q2_K, DType::Q3_K] {
            // Rows left over after groups of four; blocks left over after groups of eight.
            for (rows, cols) in [(1, 256), (3, 768), (4, 2304), (5, 4096), (7, 256), (9, 2304), (17, 1280), (6, 3584)] {
                for edges in [false, true] {
                    let w = random_rows(dtype, rows, cols, rows as u64 * 31 + cols as u64 + edges as u64, edges);
                    for n in 1..=9 {
                        check(dtype, &w, rows, cols, n, &pools);
                    }
                }
            }
            let w = quantized_rows(dtype, 6, 2048, 4);
            for n in [1, 2, 5, 9, 33] {
                check(dtype, &w, 6, 2048, n, &pools);
            }
        }
    }

    #[test]
    fn batch_and_threads_do_not_change_a_row() {
        for dtype in [DType::Q2_K, DType::Q3_K] {
            let (rows, cols) = (13, 2304);
            let w = random_rows(dtype, rows, cols, 77, true);
            let m = MatRef::new(dtype, rows, cols, &w).unwrap();
            let n = 9;
            let x = xs(n, cols, 1);
            let mut all = vec![0f32; n * rows];
            crate::matmul(&ThreadPool::new(2), m, &x, n, &mut all);
            for threads in 1..=3 {
                let pool = ThreadPool::new(threads);
                // Each token alone (decode), and the batch split at every point.
                for t in 0..n {
                    let mut one = vec![0f32; rows];
                    crate::matmul(&pool, m, &x[t * cols..(t + 1) * cols], 1, &mut one);
                    assert!(crate::compare::same_bits(&one, &all[t * rows..(t + 1) * rows]), "{dtype} token {t}");
                    let mut tail = vec![0f32; (n - t) * rows];
                    crate::matmul(&pool, m, &x[t * cols..], n - t, &mut tail);
                    assert!(crate::compare::same_bits(&tail, &all[t * rows..]), "{dtype} tokens {t}..");
                }
            }
        }
    }
}
