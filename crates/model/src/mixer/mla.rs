//! Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), computed in its absorbed form: the
//! cache holds one compressed latent per token, and every head attends over it directly.
//!
//! ```text
//! q     = q_b(rms_norm(q_a(x)))  or  q(x)         (n, heads, nope + rope), each head [q_n | q_r]
//! [c|kr]= kv_a(x)                                  (n, rank + rope): latent c, one rotary key kr
//! c     ← rms_norm(c);  q_r, kr ← RoPE (interleaved pairs)
//! cache ← [c | kr]                                 (rank + rope values per token per layer)
//! q̃_h   = W_UK[h]ᵀ q_n,h                           (rank)  — the key up-projection folded into q
//! s_h,j = scale · ([q̃_h | q_r,h] · cache_j)        over the visible positions j
//! o_h   = W_UV[h] · Σ_j softmax(s_h)_j c_j          (v_head) — the value up-projection after
//! out   = o · W_oᵀ
//! ```
//!
//! `W_UK[h]` (nope × rank) and `W_UV[h]` (v_head × rank) are the two halves of head h's rows
//! of the checkpoint's `kv_b_proj`; GGUF stores them split (`attn_k_b` already transposed).
//! Scores equal the reference's decompressed `q_h · [W_UK[h] c_j | kr_j]` up to rounding.

use crate::config::{MlaConfig, ModelConfig};
use crate::error::{ModelError, Result};
use crate::model::{observe, Model};
use crate::state::SeqState;
use crate::trace::Observer;
use crate::weights::{vector, Key, Linear, TensorSource, Weight};
use sluice_formats::safetensors::TensorData;
use sluice_formats::Blob;
use sluice_kernels::float::{dots_f32, softmax};
use sluice_kernels::{matmul, ops, DType, SendPtr, ThreadPool};

pub struct MlaWeights {
    /// q's down projection (q_lora_rank, hidden) and its norm, when q is low-rank.
    pub q_a: Option<(Linear, Vec<f32>)>,
    /// (heads·(nope + rope), q_lora_rank or hidden)
    pub q: Linear,
    /// (rank + rope, hidden)
    pub kv_a: Linear,
    /// (rank)
    pub kv_norm: Vec<f32>,
    /// Per head `W_UK[h]ᵀ`: (rank, nope).
    pub k_b: Vec<Weight>,
    /// Per head `W_UV[h]`: (v_head, rank).
    pub v_b: Vec<Weight>,
    /// (hidden, heads·v_head)
    pub o: Linear,
}

impl MlaWeights {
    pub fn load(src: &dyn TensorSource, cfg: &ModelConfig, l: usize) -> Result<MlaWeights> {
        let m = cfg.mla.expect("validated: latent-attention layers have dimensions");
        let (h, nh) = (cfg.hidden, cfg.n_head);
        let dk = m.qk_nope + m.qk_rope;
        let lin = |key: Key, rows: usize, cols: usize| -> Result<Linear> {
            Ok(Linear { w: Weight::from_tensor(src.require(key, Some(l))?, rows, cols)?, b: None })
        };
        let q_a = match m.q_lora_rank {
            Some(qr) => Some((lin(Key::AttnQA, qr, h)?, vector(src.require(Key::AttnQANorm, Some(l))?, qr)?)),
            None => None,
        };
        let q = match m.q_lora_rank {
            Some(qr) => lin(Key::AttnQB, nh * dk, qr)?,
            None => lin(Key::AttnQ, nh * dk, h)?,
        };
        let (k_b, v_b) = match src.get(Key::AttnKB, Some(l))? {
            Some(kb) => {
                let vb = src.require(Key::AttnVB, Some(l))?;
                (per_head(kb, nh, m.kv_lora_rank, m.qk_nope)?, per_head(vb, nh, m.v_head, m.kv_lora_rank)?)
            }
            None => split_kv_b(src.require(Key::AttnKvB, Some(l))?, nh, &m)?,
        };
        Ok(MlaWeights {
            q_a,
            q,
            kv_a: lin(Key::AttnKvAMqa, m.cache_width(), h)?,
            kv_norm: vector(src.require(Key::AttnKvANorm, Some(l))?, m.kv_lora_rank)?,
            k_b,
            v_b,
            o: lin(Key::AttnO, h, nh * m.v_head)?,
        })
    }

    pub fn bytes(&self) -> usize {
        let heads: usize = self.k_b.iter().chain(&self.v_b).map(Weight::bytes).sum();
        self.q_a.as_ref().map_or(0, |(w, _)| w.w.bytes())
            + self.q.w.bytes()
            + self.kv_a.w.bytes()
            + heads
            + self.o.w.bytes()
    }
}

/// A stacked (heads, rows, cols) tensor as one matrix per head.
fn per_head(t: TensorData, nh: usize, rows: usize, cols: usize) -> Result<Vec<Weight>> {
    let ok = match t.shape.as_slice() {
        [a, b, c] => (*a, *b, *c) == (nh, rows, cols),
        [b, c] => (*b, *c) == (nh * rows, cols),
        _ => false,
    };
    if !ok {
        return Err(ModelError::Invalid(format!(
            "{}: tensor `{}` has shape {:?}, expected [{nh}, {rows}, {cols}]",
            t.file.display(),
            t.name,
            t.shape
        )));
    }
    let per = t.data.len() / nh;
    (0..nh)
        .map(|hd| {
            let part = TensorData {
                name: format!("{}[head {hd}]", t.name),
                file: t.file.clone(),
                dtype: t.dtype,
                shape: vec![rows, cols],
                data: t.data.slice(hd * per, per),
            };
            Weight::from_tensor(part, rows, cols)
        })
        .collect()
}

/// Hugging Face's whole `kv_b_proj` (heads·(nope + v), rank): per head, the value rows are
/// used as stored and the key rows transposed (a float copy, since a transpose crosses
/// quantization blocks).
fn split_kv_b(t: TensorData, nh: usize, m: &MlaConfig) -> Result<(Vec<Weight>, Vec<Weight>)> {
    let (dn, dv, r) = (m.qk_nope, m.v_head, m.kv_lora_rank);
    let origin = t.file.display().to_string();
    if t.shape != [nh * (dn + dv), r] {
        return Err(ModelError::Invalid(format!(
            "{origin}: tensor `{}` has shape {:?}, expected [{}, {r}]",
            t.name,
            t.shape,
            nh * (dn + dv)
        )));
    }
    let size = match t.dtype {
        DType::F32 => 4,
        DType::F16 | DType::BF16 => 2,
        other => {
            return Err(ModelError::Invalid(format!(
                "{origin}: tensor `{}` is {other:?}; a Hugging Face kv_b_proj must be f32, f16 or bf16",
                t.name
            )))
        }
    };
    let row = r * size;
    let (mut k_b, mut v_b) = (Vec::with_capacity(nh), Vec::with_capacity(nh));
    for hd in 0..nh {
        let base = hd * (dn + dv);
        // W_UK[h]ᵀ: element (i, j) = kv_b[base + j][i], i < rank, j < nope.
        let mut tr = vec![0u8; r * dn * size];
        for j in 0..dn {
            let src_row = &t.data[(base + j) * row..(base + j + 1) * row];
            for i in 0..r {
                tr[(i * dn + j) * size..(i * dn + j + 1) * size].copy_from_slice(&src_row[i * size..(i + 1) * size]);
            }
        }
        let kt = TensorData {
            name: format!("{}[head {hd} key, transposed]", t.name),
            file: t.file.clone(),
            dtype: t.dtype,
            shape: vec![r, dn],
            data: Blob::from_vec(tr),
        };
        k_b.push(Weight::from_tensor(kt, r, dn)?);
        let vt = TensorData {
            name: format!("{}[head {hd} value]", t.name),
            file: t.file.clone(),
            dtype: t.dtype,
            shape: vec![dv, r],
            data: t.data.slice((base + dn) * row, dv * row),
        };
        v_b.push(Weight::from_tensor(vt, dv, r)?);
    }
    Ok((k_b, v_b))
}

/// Latent attention of `n` tokens at the next positions of `state`: appends their latents to
/// layer `l`'s cache and writes the output projection to `out` (n, hidden).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    m: &Model,
    l: usize,
    w: &MlaWeights,
    h: &[f32],
    n: usize,
    state: &mut SeqState,
    out: &mut [f32],
    obs: &mut Option<&mut dyn Observer>,
) {
    let cfg = &m.cfg;
    let mla = cfg.mla.expect("validated");
    let pool = &*m.pool;
    let pos0 = state.len();
    let nh = cfg.n_head;
    let (dn, dr, dv, r) = (mla.qk_nope, mla.qk_rope, mla.v_head, mla.kv_lora_rank);
    let (dk, cw) = (dn + dr, mla.cache_width());

    let mut q = vec![0f32; n * nh * dk]; // (n, heads, nope + rope)
    let mut ckv = vec![0f32; n * cw]; // (n, rank + rope)

    // The products of the layer's input in one call: q's down projection (or q itself) and
    // the compressed KV.
    match &w.q_a {
        Some((qa, norm)) => {
            let mut lat = vec![0f32; n * norm.len()];
            m.linear(&[qa, &w.kv_a], h, n, &mut [&mut lat, &mut ckv]);
            for row in lat.chunks_exact_mut(norm.len()) {
                ops::rms_norm_inplace(row, norm, mla.latent_norm_eps);
            }
            m.linear(&[&w.q], &lat, n, &mut [&mut q]);
        }
        None => m.linear(&[&w.q, &w.kv_a], h, n, &mut [&mut q, &mut ckv]),
    }
    for row in ckv.chunks_exact_mut(cw) {
        ops::rms_norm_inplace(&mut row[..r], &w.kv_norm, mla.latent_norm_eps);
    }
    let rope = &m.rope;
    let (mut cos, mut sin) = (vec![0f32; dr / 2], vec![0f32; dr / 2]);
    for t in 0..n {
        rope.cos_sin(pos0 + t, &mut cos, &mut sin);
        for head in q[t * nh * dk..(t + 1) * nh * dk].chunks_exact_mut(dk) {
            rope.apply(&mut head[dn..], &cos, &sin);
        }
        rope.apply(&mut ckv[t * cw + r..(t + 1) * cw], &cos, &sin);
    }
    observe(obs, "q", Some(l), &q, n);
    observe(obs, "kv_cmpr", Some(l), &ckv, n);
    state.append_kv(l, &ckv, &[]);
    let (cache, _) = state.kv(l);

    // Absorbed queries (n, heads, rank + rope): q̃_h = W_UK[h]ᵀ q_n,h next to the rotated q_r,h.
    // One head per task, each through a single-threaded product.
    let mut qa = vec![0f32; n * nh * cw];
    let qa_ptr = SendPtr(qa.as_mut_ptr());
    let qr = &q;
    pool.for_ranges(nh, 1, &|heads| {
        let serial = ThreadPool::serial();
        let (mut qn, mut qt) = (vec![0f32; n * dn], vec![0f32; n * r]);
        for hd in heads {
            for t in 0..n {
                qn[t * dn..(t + 1) * dn].copy_from_slice(&qr[(t * nh + hd) * dk..][..dn]);
            }
            matmul(serial, w.k_b[hd].mat(), &qn, n, &mut qt);
            for t in 0..n {
                // SAFETY: head hd's slots of `qa` belong to this task alone.
                let dst = unsafe { std::slice::from_raw_parts_mut(qa_ptr.get().add((t * nh + hd) * cw), cw) };
                dst[..r].copy_from_slice(&qt[t * r..(t + 1) * r]);
                dst[r..].copy_from_slice(&qr[(t * nh + hd) * dk + dn..][..dr]);
            }
        }
    });

    // Each (token, head): scores over the visible latents, softmax, weighted latent sum.
    let mut lat = vec![0f32; n * nh * r]; // (n, heads, rank)
    let lat_ptr = SendPtr(lat.as_mut_ptr());
    let scale = cfg.attn_scale;
    let qa = &qa;
    pool.for_ranges(n * nh, 1, &|tasks| {
        let mut scores = Vec::with_capacity(pos0 + n);
        for task in tasks {
            let (t, hd) = (task / nh, task % nh);
            let p = pos0 + t;
            scores.clear();
            scores.resize(p + 1, 0.0);
            dots_f32(&qa[task * cw..(task + 1) * cw], cache, cw, p + 1, scale, &mut scores);
            softmax(&mut scores, None);
            // SAFETY: task (t, head) owns this rank-sized slice of `lat`.
            let o = unsafe { std::slice::from_raw_parts_mut(lat_ptr.get().add((t * nh + hd) * r), r) };
            o.fill(0.0);
            for (j, s) in scores.iter().enumerate() {
                ops::axpy(o, *s, &cache[j * cw..j * cw + r]);
            }
        }
    });

    // Per head, back up to its value dimensions: o_h = W_UV[h] · latent sum.
    let mut att = vec![0f32; n * nh * dv]; // (n, heads·v_head)
    let att_ptr = SendPtr(att.as_mut_ptr());
    let lat = &lat;
    pool.for_ranges(nh, 1, &|heads| {
        let serial = ThreadPool::serial();
        let (mut li, mut vo) = (vec![0f32; n * r], vec![0f32; n * dv]);
        for hd in heads {
            for t in 0..n {
                li[t * r..(t + 1) * r].copy_from_slice(&lat[(t * nh + hd) * r..][..r]);
            }
            matmul(serial, w.v_b[hd].mat(), &li, n, &mut vo);
            for t in 0..n {
                // SAFETY: head hd's slots of `att` belong to this task alone.
                let dst = unsafe { std::slice::from_raw_parts_mut(att_ptr.get().add((t * nh + hd) * dv), dv) };
                dst.copy_from_slice(&vo[t * dv..(t + 1) * dv]);
            }
        }
    });
    observe(obs, "kqv_out", Some(l), &att, n);
    m.linear(&[&w.o], &att, n, &mut [out]);
    observe(obs, "attn_out", Some(l), out, n);
}
