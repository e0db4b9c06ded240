//! Block layouts of GGUF's quantized formats: reference dequantization and quantization.
//!
//! Layouts (bytes within one block; `d`, `m`, `dmin` are f16 unless noted):
//!
//! | type | elems | bytes | layout |
//! |---|---|---|---|
//! | Q4_0 | 32 | 18 | d, qs[16]: element j = low nibble of qs[j], element j+16 = high nibble; x = (q − 8)·d |
//! | Q4_1 | 32 | 20 | d, m, qs[16] as Q4_0; x = q·d + m |
//! | Q5_0 | 32 | 22 | d, qh[4] (u32: bit j = 5th bit of element j), qs[16]; x = (q − 16)·d |
//! | Q5_1 | 32 | 24 | d, m, qh[4], qs[16]; x = q·d + m |
//! | Q8_0 | 32 | 34 | d, qs[32] (i8); x = q·d |
//! | Q2_K | 256 | 84 | scales[16] (low nibble scale, high nibble min), qs[64] (2-bit), d, dmin |
//! | Q3_K | 256 | 110 | hmask[32], qs[64] (2-bit), scales[12] (16 packed 6-bit, offset 32), d |
//! | Q4_K | 256 | 144 | d, dmin, scales[12] (8 packed 6-bit scales and mins), qs[128] |
//! | Q5_K | 256 | 176 | d, dmin, scales[12], qh[32], qs[128] |
//! | Q6_K | 256 | 210 | ql[128], qh[64], scales[16] (i8), d; x = d·scale·(q − 32) |
//! | MXFP4 | 32 | 17 | e (E8M0 exponent), qs[16]: nibbles index an FP4 (E2M1) table |
//!
//! The IQ formats (codebook quants) are laid out in `iq`.

use crate::dtype::DType;
use half::f16;

#[inline(always)]
pub fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

#[inline(always)]
pub fn put_f16(b: &mut [u8], i: usize, v: f32) {
    b[i..i + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// The 6-bit (scale, min) pair `j` (0..8) of a Q4_K/Q5_K `scales[12]` field.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Packs eight 6-bit scales and mins into Q4_K's 12 bytes (inverse of `scale_min_k4`).
pub fn pack_scale_min_k4(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..8 {
        let (s, m) = (sc[j] & 63, mn[j] & 63);
        if j < 4 {
            q[j] = s;
            q[j + 4] = m;
        } else {
            q[j + 4] = (s & 0xF) | ((m & 0xF) << 4);
            q[j - 4] |= (s >> 4) << 6;
            q[j] |= (m >> 4) << 6;
        }
    }
    q
}

/// The sixteen signed 6-bit scales of a Q3_K block (already minus 32).
pub fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// E8M0 exponent to the MXFP4 block scale (half of 2^(e − 127), as the FP4 table is doubled).
pub fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        // 2^(e − 128) underflows the normal range for e = 0 and e = 1.
        (2.0f64.powi(e as i32 - 128)) as f32
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// FP4 (E2M1) values, doubled so they are integers.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Widens one block (`dtype.block_elems()` values) to f32.
pub fn dequantize_block(dtype: DType, b: &[u8], y: &mut [f32]) {
    match dtype {
        DType::Q4_0 => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                y[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
                y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        DType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for j in 0..16 {
                y[j] = (b[4 + j] & 0xF) as f32 * d + m;
                y[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            let d = f16_at(b, 0);
            let (m, o) = if dtype == DType::Q5_1 { (f16_at(b, 2), 4) } else { (0.0, 2) };
            let qh = u32::from_le_bytes(b[o..o + 4].try_into().expect("4"));
            let qs = &b[o + 4..o + 20];
            for j in 0..16 {
                let lo = (qs[j] & 0xF) as i32 | ((((qh >> j) & 1) as i32) << 4);
                let hi = (qs[j] >> 4) as i32 | ((((qh >> (j + 16)) & 1) as i32) << 4);
                if dtype == DType::Q5_0 {
                    y[j] = (lo - 16) as f32 * d;
                    y[j + 16] = (hi - 16) as f32 * d;
                } else {
                    y[j] = lo as f32 * d + m;
                    y[j + 16] = hi as f32 * d + m;
                }
            }
        }
        DType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        DType::MXFP4 => {
            let d = e8m0_half(b[0]);
            for j in 0..16 {
                y[j] = MXFP4_VALUES[(b[1 + j] & 0xF) as usize] as f32 * d;
                y[j + 16] = MXFP4_VALUES[(b[1 + j] >> 4) as usize] as f32 * d;
            }
        }
        DType::Q2_K => {
            let (sc, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            let mut k = 0;
            for n in 0..2 {
                let q = &qs[32 * n..32 * n + 32];
                for j in 0..4 {
                    for half in 0..2 {
                        let s = sc[n * 8 + j * 2 + half];
                        let (dl, ml) = (d * (s & 0xF) as f32, dmin * (s >> 4) as f32);
                        for l in 0..16 {
                            y[k] = dl * ((q[16 * half + l] >> (2 * j)) & 3) as f32 - ml;
                            k += 1;
                        }
                    }
                }
            }
        }
        DType::Q3_K => {
            let (hm, qs) = (&b[0..32], &b[32..96]);
            let scales = q3k_scales(&b[96..108]);
            let d = f16_at(b, 108);
            let mut k = 0;
            for n in 0..2 {
                let q = &qs[32 * n..32 * n + 32];
                for j in 0..4 {
                    let mbit = 1u8 << (n * 4 + j);
                    for half in 0..2 {
                        let dl = d * scales[n * 8 + j * 2 + half] as f32;
                        for l in 0..16 {
                            let i = 16 * half + l;
                            let q2 = ((q[i] >> (2 * j)) & 3) as i32;
                            let v = q2 - if hm[i] & mbit != 0 { 0 } else { 4 };
                            y[k] = dl * v as f32;
                            k += 1;
                        }
                    }
                }
            }
        }
        DType::Q4_K | DType::Q5_K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let sc = &b[4..16];
            let (qh, qs) = if dtype == DType::Q5_K { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
            for c in 0..4 {
                let (s1, m1) = scale_min_k4(2 * c, sc);
                let (s2, m2) = scale_min_k4(2 * c + 1, sc);
                let (d1, mm1, d2, mm2) = (d * s1 as f32, dmin * m1 as f32, d * s2 as f32, dmin * m2 as f32);
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    let (mut lo, mut hi) = ((q & 0xF) as u32, (q >> 4) as u32);
                    if dtype == DType::Q5_K {
                        lo += (((qh[l] >> (2 * c)) & 1) as u32) << 4;
                        hi += (((qh[l] >> (2 * c + 1)) & 1) as u32) << 4;
                    }
                    y[64 * c + l] = d1 * lo as f32 - mm1;
                    y[64 * c + 32 + l] = d2 * hi as f32 - mm2;
                }
            }
        }
        DType::Q6_K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for n in 0..2 {
                let (ql, qh, sc, y) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..], &mut y[128 * n..]);
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        DType::Q8_K => {
            let d = f32::from_le_bytes(b[0..4].try_into().expect("4"));
            for j in 0..256 {
                y[j] = (b[4 + j] as i8) as f32 * d;
            }
        }
        DType::IQ4_NL
        | DType::IQ4_XS
        | DType::IQ3_XXS
        | DType::IQ3_S
        | DType::IQ2_XXS
        | DType::IQ2_XS
        | DType::IQ2_S
        | DType::IQ1_S
        | DType::IQ1_M => super::iq::dequantize(dtype, b, y),
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("float types have no blocks"),
    }
}

/// Round half to even, as GGML's `nearest_int` (exact for |v| < 2^22, as GGML assumes):
/// adding 1.5·2^23 leaves the rounded integer in the low mantissa bits.
#[inline(always)]
pub fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0).to_bits();
    (bits & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Round half away from zero (C's `roundf`) without a library call.
#[inline(always)]
pub fn round_away(v: f32) -> i32 {
    let a = v.abs();
    let i = a as i32;
    let r = if a - i as f32 >= 0.5 { i + 1 } else { i };
    if v < 0.0 {
        -r
    } else {
        r
    }
}

/// Quantizes one block of `dtype.block_elems()` values (a simple, deterministic quantizer:
/// for tests and synthetic models, not an optimal one).
pub fn quantize_block(dtype: DType, x: &[f32], b: &mut [u8]) {
    let amax = |v: &[f32]| v.iter().fold(0f32, |a, x| a.max(x.abs()));
    match dtype {
        DType::Q8_0 => {
            let d = amax(x) / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            put_f16(b, 0, d);
            for j in 0..32 {
                b[2 + j] = nearest_int(x[j] * id).clamp(-127, 127) as i8 as u8;
            }
        }
        DType::Q4_0 | DType::Q5_0 => {
            let (levels, off) = if dtype == DType::Q4_0 { (8.0, 8) } else { (16.0, 16) };
            // Signed max maps to −levels, as GGML does, so the full range is used.
            let mut mx = 0f32;
            for v in x {
                if v.abs() > mx.abs() {
                    mx = *v;
                }
            }
            let d = mx / -levels;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            put_f16(b, 0, d);
            let q: Vec<u8> = x.iter().map(|v| (nearest_int(v * id) + off).clamp(0, 2 * off - 1) as u8).collect();
            pack_nibbles(dtype, &q, b);
        }
        DType::Q4_1 | DType::Q5_1 => {
            let maxq = if dtype == DType::Q4_1 { 15.0 } else { 31.0 };
            let (mn, mx) = x.iter().fold((f32::MAX, f32::MIN), |(a, b), v| (a.min(*v), b.max(*v)));
            let d = (mx - mn) / maxq;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            put_f16(b, 0, d);
            put_f16(b, 2, mn);
            let q: Vec<u8> = x.iter().map(|v| nearest_int((v - mn) * id).clamp(0, maxq as i32) as u8).collect();
            pack_nibbles(dtype, &q, b);
        }
        DType::Q4_K | DType::Q5_K => {
            let maxq = if dtype == DType::Q4_K { 15.0 } else { 31.0 };
            let mut scales = [0f32; 8];
            let mut mins = [0f32; 8];
            for j in 0..8 {
                let s = &x[32 * j..32 * j + 32];
                let (mn, mx) = s.iter().fold((0f32, f32::MIN), |(a, b), v| (a.min(*v), b.max(*v)));
                scales[j] = (mx - mn) / maxq;
                mins[j] = -mn;
            }
            let ms = scales.iter().fold(0f32, |a, v| a.max(*v));
            let mm = mins.iter().fold(0f32, |a, v| a.max(*v));
            let d = ms / 63.0;
            let dmin = mm / 63.0;
            let mut sc = [0u8; 8];
            let mut mn = [0u8; 8];
            for j in 0..8 {
                sc[j] = if d > 0.0 { nearest_int(scales[j] / d).clamp(0, 63) as u8 } else { 0 };
                mn[j] = if dmin > 0.0 { nearest_int(mins[j] / dmin).clamp(0, 63) as u8 } else { 0 };
            }
            put_f16(b, 0, d);
            put_f16(b, 2, dmin);
            b[4..16].copy_from_slice(&pack_scale_min_k4(&sc, &mn));
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let mut q = [0u8; 256];
            for j in 0..8 {
                let (ds, dm) = (d * sc[j] as f32, dmin * mn[j] as f32);
                for l in 0..32 {
                    let v = if ds > 0.0 { nearest_int((x[32 * j + l] + dm) / ds) } else { 0 };
                    q[32 * j + l] = v.clamp(0, maxq as i32) as u8;
                }
            }
            let qs_off = if dtype == DType::Q5_K { 48 } else { 16 };
            if dtype == DType::Q5_K {
                b[16..48].fill(0);
            }
            for c in 0..4 {
                for l in 0..32 {
                    let (lo, hi) = (q[64 * c + l], q[64 * c + 32 + l]);
                    b[qs_off + 32 * c + l] = (lo & 0xF) | ((hi & 0xF) << 4);
                    if dtype == DType::Q5_K {
                        b[16 + l] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1));
                    }
                }
            }
        }
        DType::Q6_K => {
            let mut scales = [0f32; 16];
            for (g, s) in scales.iter_mut().enumerate() {
                let sub = &x[16 * g..16 * g + 16];
                let mut mx = 0f32;
                for v in sub {
                    if v.abs() > mx.abs() {
                        mx = *v;
                    }
                }
                *s = mx / -32.0;
            }
            let ms = scales.iter().fold(0f32, |a, v| if v.abs() > a.abs() { *v } else { a });
            let d = ms / -128.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut sc = [0i8; 16];
            for g in 0..16 {
                sc[g] = nearest_int(scales[g] * id).clamp(-128, 127) as i8;
            }
            put_f16(b, 208, d);
            let d = f16_at(b, 208);
            let mut q = [0u8; 256];
            for g in 0..16 {
                let ds = d * sc[g] as f32;
                for l in 0..16 {
                    let v = if ds != 0.0 { nearest_int(x[16 * g + l] / ds) } else { 0 };
                    q[16 * g + l] = (v.clamp(-32, 31) + 32) as u8;
                }
            }
            b[0..208].fill(0);
            for (g, s) in sc.iter().enumerate() {
                b[192 + g] = *s as u8;
            }
            for n in 0..2 {
                for l in 0..32 {
                    let q1 = q[128 * n + l];
                    let q2 = q[128 * n + l + 32];
                    let q3 = q[128 * n + l + 64];
                    let q4 = q[128 * n + l + 96];
                    b[64 * n + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
                    b[64 * n + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
                    b[128 + 32 * n + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
                }
            }
        }
        DType::Q8_K => {
            let mut mx = 0f32;
            for v in x {
                if v.abs() > mx.abs() {
                    mx = *v;
                }
            }
            b.fill(0);
            if mx == 0.0 {
                return;
            }
            let iscale = -127.0 / mx;
            for j in 0..256 {
                b[4 + j] = nearest_int(iscale * x[j]).min(127) as i8 as u8;
            }
            for g in 0..16 {
                let s: i32 = (0..16).map(|l| b[4 + 16 * g + l] as i8 as i32).sum();
                b[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
            }
            b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        }
        DType::MXFP4 => {
            // The smallest power-of-two scale that brings max|x| within the table's ±12, then
            // each value to its nearest entry (the first of equals).
            let a = amax(x);
            let e = if a > 0.0 { (128.0 + (a as f64 / 12.0).log2().ceil()).clamp(1.0, 254.0) as u8 } else { 127 };
            let s = e8m0_half(e);
            b[0] = e;
            let code = |v: f32| {
                let m = (v / s).abs();
                let k = (0..8).min_by(|&i, &j| {
                    let (di, dj) = ((MXFP4_VALUES[i] as f32 - m).abs(), (MXFP4_VALUES[j] as f32 - m).abs());
                    di.total_cmp(&dj).then(i.cmp(&j))
                });
                let k = k.expect("eight entries") as u8;
                if v < 0.0 && k != 0 {
                    k | 8
                } else {
                    k
                }
            };
            for j in 0..16 {
                b[1 + j] = code(x[j]) | (code(x[j + 16]) << 4);
            }
        }
        d if super::iq::is_iq(d) => super::iq::quantize(d, x, b),
        other => {
            // Q2_K, Q3_K: dequantize-only here; a tiny fixed block (all zero codes).
            b.fill(0);
            let _ = other;
        }
    }
}

fn pack_nibbles(dtype: DType, q: &[u8], b: &mut [u8]) {
    let (qh_off, qs_off) = match dtype {
        DType::Q4_0 => (None, 2),
        DType::Q4_1 => (None, 4),
        DType::Q5_0 => (Some(2), 6),
        DType::Q5_1 => (Some(4), 8),
        _ => unreachable!(),
    };
    let mut qh = 0u32;
    for j in 0..16 {
        b[qs_off + j] = (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4);
        qh |= (((q[j] >> 4) & 1) as u32) << j;
        qh |= (((q[j + 16] >> 4) & 1) as u32) << (j + 16);
    }
    if let Some(o) = qh_off {
        b[o..o + 4].copy_from_slice(&qh.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wave(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.731 + seed).sin() * 1.7 + (i as f32 * 0.05).cos() * 0.3).collect()
    }

    #[test]
    fn quantize_then_dequantize_is_close() {
        for (dtype, tol) in [
            (DType::Q8_0, 0.01),
            (DType::Q4_0, 0.15),
            (DType::Q4_1, 0.15),
            (DType::Q5_0, 0.08),
            (DType::Q5_1, 0.08),
            (DType::Q4_K, 0.2),
            (DType::Q5_K, 0.1),
            (DType::Q6_K, 0.05),
            (DType::Q8_K, 0.02),
            // max|x| ≈ 1.97 takes the scale 2^-2 (doubled values up to 8 here, gaps at most 2).
            (DType::MXFP4, 0.26),
        ] {
            let n = dtype.block_elems();
            let x = wave(n, 0.3);
            let mut b = vec![0u8; dtype.block_bytes()];
            quantize_block(dtype, &x, &mut b);
            let mut y = vec![0f32; n];
            dequantize_block(dtype, &b, &mut y);
            let err = crate::compare::max_abs_diff(&x, &y).unwrap();
            assert!(err < tol, "{dtype}: max error {err}");
        }
    }

    #[test]
    fn k4_scale_packing_round_trips() {
        let sc = [1, 63, 17, 40, 0, 33, 62, 5];
        let mn = [9, 0, 63, 31, 32, 1, 2, 60];
        let q = pack_scale_min_k4(&sc, &mn);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &q), (sc[j], mn[j]));
        }
    }

    #[test]
    fn hand_built_q4_0_block() {
        // d = 0.5, nibbles 0..16 low and 15..=0 high.
        let mut b = vec![0u8; 18];
        put_f16(&mut b, 0, 0.5);
        for j in 0..16 {
            b[2 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut y = vec![0f32; 32];
        dequantize_block(DType::Q4_0, &b, &mut y);
        assert_eq!(y[0], -4.0);
        assert_eq!(y[15], 3.5);
        assert_eq!(y[16], 3.5);
        assert_eq!(y[31], -4.0);
    }

    #[test]
    fn roundings_match_the_library() {
        for i in -40000..40000 {
            let v = i as f32 * 0.01 + 0.005;
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
            assert_eq!(round_away(v), v.round() as i32, "{v}");
        }
        for v in [0.5f32, 1.5, 2.5, -0.5, -1.5, 0.49999997, -2.5, 126.5] {
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
            assert_eq!(round_away(v), v.round() as i32, "{v}");
        }
    }

    #[test]
    fn e8m0_scale() {
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(127), 0.5);
        assert_eq!(e8m0_half(130), 4.0);
        assert!(e8m0_half(0) > 0.0);
    }
}
