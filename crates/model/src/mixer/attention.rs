//! Grouped-query self-attention: RoPE (full or partial), optional QK-norm (per head or over
//! the whole projection), bias, Q/K/V clamp, sliding window, an output gate, and learned
//! per-head sink logits (a softmax term with no value: gpt-oss).
//!
//! ```text
//! q = x·Wqᵀ (+b)   (n, n_head·head_dim)      with an output gate: (n, n_head·2·head_dim),
//! k = x·Wkᵀ (+b)   (n, n_head_kv·head_dim)     each head [q | gate]
//! v = x·Wvᵀ (+b)   (n, n_head_kv·head_dim)
//! q, k ← rms_norm (per head or whole row), then RoPE at each token's position
//! o_h  = softmax(q_h·K_gᵀ · scale over visible positions) · V_g      g = h / (n_head / n_head_kv)
//! o    ← o ⊙ σ(gate)                          (output gate)
//! out  = o·Woᵀ (+b)
//! ```

use crate::config::{ModelConfig, QkNorm};
use crate::error::{ModelError, Result};
use crate::model::{observe, Model};
use crate::state::SeqState;
use crate::trace::Observer;
use crate::weights::{vector, Key, Linear, TensorSource, Weight};
use sluice_kernels::float::{dots_f32_multi, softmax, weighted_rows_multi};
use sluice_kernels::{ops, SendPtr};

/// Most query heads of one KV group scored together (the float tile's four tokens): each key
/// is read once for them all.
const HEADS_PER_TASK: usize = 4;

pub struct AttentionWeights {
    /// (n_head·head_dim, hidden), or (n_head·2·head_dim, hidden) with the output gate.
    pub q: Linear,
    /// (n_head_kv·head_dim, hidden)
    pub k: Linear,
    /// (n_head_kv·head_dim, hidden)
    pub v: Linear,
    /// (hidden, n_head·head_dim)
    pub o: Linear,
    /// (head_dim) per head, or (n_head·head_dim) over the whole projection.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// (n_head) sink logits.
    pub sinks: Option<Vec<f32>>,
}

impl AttentionWeights {
    pub fn load(src: &dyn TensorSource, cfg: &ModelConfig, l: usize) -> Result<AttentionWeights> {
        let (h, qd, kvd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim());
        let q_rows = if cfg.attn_output_gate { 2 * qd } else { qd };
        let lin = |wk: Key, bk: Key, rows: usize, cols: usize, bias: bool| -> Result<Linear> {
            let w = Weight::from_tensor(src.require(wk, Some(l))?, rows, cols)?;
            let b = if bias { Some(vector(src.require(bk, Some(l))?, rows)?) } else { None };
            Ok(Linear { w, b })
        };
        let norm = |key: Key, len: usize| -> Result<Option<Vec<f32>>> {
            match cfg.qk_norm {
                QkNorm::None => Ok(None),
                _ => Ok(Some(crate::weights::norm(src, cfg, key, Some(l), len)?)),
            }
        };
        let (qn, kn) = match cfg.qk_norm {
            QkNorm::Full => (qd, kvd),
            _ => (cfg.head_dim, cfg.head_dim),
        };
        Ok(AttentionWeights {
            q: lin(Key::AttnQ, Key::AttnQBias, q_rows, h, cfg.qkv_bias)?,
            k: lin(Key::AttnK, Key::AttnKBias, kvd, h, cfg.qkv_bias)?,
            v: lin(Key::AttnV, Key::AttnVBias, kvd, h, cfg.qkv_bias)?,
            o: Linear {
                w: Weight::from_tensor(src.require(Key::AttnO, Some(l))?, h, qd)?,
                b: src.get(Key::AttnOBias, Some(l))?.map(|t| vector(t, h)).transpose()?,
            },
            q_norm: norm(Key::AttnQNorm, qn)?,
            k_norm: norm(Key::AttnKNorm, kn)?,
            sinks: if cfg.attn_sinks { Some(vector(src.require(Key::AttnSinks, Some(l))?, cfg.n_head)?) } else { None },
        })
    }

    pub fn bytes(&self) -> usize {
        self.q.w.bytes() + self.k.w.bytes() + self.v.w.bytes() + self.o.w.bytes()
    }
}

/// Self-attention of `n` tokens at positions `pos0..pos0 + n` of layer `l`; appends their keys
/// and values to the state and writes the output projection to `out` (n, hidden).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    m: &Model,
    l: usize,
    w: &AttentionWeights,
    h: &[f32],
    n: usize,
    state: &mut SeqState,
    out: &mut [f32],
    obs: &mut Option<&mut dyn Observer>,
) {
    let cfg = &m.cfg;
    let pool = &*m.pool;
    let pos0 = state.len();
    let (hd, nh, nkv) = (cfg.head_dim, cfg.n_head, cfg.n_head_kv);
    let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
    let mut q = vec![0f32; n * qd]; // (n, n_head·head_dim)
    let mut gate = Vec::new(); // (n, n_head·head_dim) with an output gate
    let mut k = vec![0f32; n * kvd]; // (n, n_head_kv·head_dim)
    let mut v = vec![0f32; n * kvd];
    if cfg.attn_output_gate {
        // Each head's projection is [q | gate]: split them apart.
        let mut qg = vec![0f32; n * 2 * qd];
        m.linear(&[&w.q, &w.k, &w.v], h, n, &mut [&mut qg, &mut k, &mut v]);
        gate = vec![0f32; n * qd];
        for (t, row) in qg.chunks_exact(2 * qd).enumerate() {
            for (head, pair) in row.chunks_exact(2 * hd).enumerate() {
                let at = t * qd + head * hd;
                q[at..at + hd].copy_from_slice(&pair[..hd]);
                gate[at..at + hd].copy_from_slice(&pair[hd..]);
            }
        }
    } else {
        m.linear(&[&w.q, &w.k, &w.v], h, n, &mut [&mut q, &mut k, &mut v]);
    }
    if let Some(c) = cfg.clip_qkv {
        for x in q.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
            *x = x.clamp(-c, c);
        }
    }
    if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
        for r in q.chunks_exact_mut(qn.len()) {
            ops::rms_norm_inplace(r, qn, cfg.rms_eps);
        }
        for r in k.chunks_exact_mut(kn.len()) {
            ops::rms_norm_inplace(r, kn, cfg.rms_eps);
        }
    }
    observe(obs, "q", Some(l), &q, n);
    observe(obs, "k", Some(l), &k, n);
    observe(obs, "v", Some(l), &v, n);

    // Rotate every head of q and k at its token's position.
    let window = cfg.window(l);
    let rope = match (&m.rope_local, window) {
        (Some(local), Some(_)) => local,
        _ => &m.rope,
    };
    let half = rope.cfg.dim / 2;
    let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
    for t in 0..n {
        rope.cos_sin(pos0 + t, &mut cos, &mut sin);
        for head in q[t * qd..(t + 1) * qd].chunks_exact_mut(hd) {
            rope.apply(head, &cos, &sin);
        }
        for head in k[t * kvd..(t + 1) * kvd].chunks_exact_mut(hd) {
            rope.apply(head, &cos, &sin);
        }
    }
    state.append_kv(l, &k, &v);
    let (kc, vc) = state.kv(l);
    // Row j of the cache is position kv0 + j (a sliding window keeps only its tail).
    let kv0 = state.kv_start(l);

    // Each (token, up to four heads of one KV group) is one independent task: scores over the
    // token's visible positions, softmax, weighted sum of values, each key and value read once
    // for the task's heads. A head's arithmetic never depends on the other heads or tasks.
    let mut att = vec![0f32; n * qd]; // (n, n_head·head_dim)
    let att_ptr = SendPtr(att.as_mut_ptr());
    let group = nh / nkv;
    // Fewer heads a task where four would leave threads without one (one token, few groups).
    let heads_per_task =
        (1..=HEADS_PER_TASK).rev().find(|h| n * nkv * group.div_ceil(*h) >= pool.n_threads()).unwrap_or(1);
    let per_group = group.div_ceil(heads_per_task);
    let scale = cfg.attn_scale;
    let qr = &q;
    pool.for_ranges(n * nkv * per_group, 1, &|tasks| {
        let mut scores = Vec::with_capacity(heads_per_task * (pos0 + n));
        for task in tasks {
            let (t, g, c) = (task / (nkv * per_group), task / per_group % nkv, task % per_group);
            let heads = g * group + c * heads_per_task..(g * group + (c + 1) * heads_per_task).min((g + 1) * group);
            let p = pos0 + t;
            let first = window.map_or(0, |w| (p + 1).saturating_sub(w));
            debug_assert!(first >= kv0, "the window reaches before what the cache holds");
            let len = p + 1 - first;
            // The task's heads in the first `nq` places of fixed arrays (no allocation a task).
            let nq = heads.len();
            let mut qs: [&[f32]; HEADS_PER_TASK] = [&[]; HEADS_PER_TASK];
            for (q, h) in qs.iter_mut().zip(heads.clone()) {
                *q = &qr[t * qd + h * hd..t * qd + (h + 1) * hd];
            }
            scores.clear();
            scores.resize(nq * len, 0.0);
            let mut chunks = scores.chunks_exact_mut(len);
            let mut rows: [&mut [f32]; HEADS_PER_TASK] = std::array::from_fn(|_| chunks.next().unwrap_or_default());
            let at = (first - kv0) * kvd + g * hd;
            dots_f32_multi(&qs[..nq], &kc[at..], kvd, len, scale, &mut rows[..nq]);
            let mut outs: [&mut [f32]; HEADS_PER_TASK] = Default::default();
            for ((head, sc), o) in heads.zip(rows.iter_mut()).zip(outs.iter_mut()) {
                softmax(sc, w.sinks.as_ref().map(|s| s[head]));
                // SAFETY: this task alone owns head `head`'s head_dim slice of token t in `att`.
                *o = unsafe { std::slice::from_raw_parts_mut(att_ptr.get().add(t * qd + head * hd), hd) };
            }
            let probs: [&[f32]; HEADS_PER_TASK] = std::array::from_fn(|i| &*rows[i]);
            weighted_rows_multi(&mut outs[..nq], &probs[..nq], &vc[at..], kvd);
        }
    });
    if cfg.attn_output_gate {
        for (o, g) in att.iter_mut().zip(&gate) {
            *o *= ops::sigmoid(*g);
        }
    }
    observe(obs, "kqv_out", Some(l), &att, n);
    m.linear(&[&w.o], &att, n, &mut [out]);
    observe(obs, "attn_out", Some(l), out, n);
}

/// Checks that a family's attention switches agree with the tensors present (in the first
/// attention layer).
pub fn check_bias(src: &dyn TensorSource, cfg: &ModelConfig) -> Result<()> {
    let Some(l) = (0..cfg.n_layer).find(|l| matches!(cfg.layers[*l].mixer, crate::config::MixerKind::Attention { .. }))
    else {
        return Ok(());
    };
    let has = src.get(Key::AttnQBias, Some(l))?.is_some();
    if has != cfg.qkv_bias {
        return Err(ModelError::Invalid(format!(
            "{}: the config says attention bias is {}, but the checkpoint {} a q_proj bias",
            src.describe(),
            cfg.qkv_bias,
            if has { "has" } else { "lacks" }
        )));
    }
    Ok(())
}
