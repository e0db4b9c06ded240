//! Gated DeltaNet: linear attention with a recurrent state (Qwen3-Next, Qwen3.5).
//!
//! ```text
//! q, k, v, z, b, a = projections of x        q, k: (n_k_heads, d_k)  v, z: (n_v_heads, d_v)
//!                                              b, a: (n_v_heads)
//! [q | k | v] ← silu(causal depthwise conv over the last `kernel` tokens)
//! q, k ← q / ‖q‖, k / ‖k‖ (eps 1e-6);  q ← q / √d_k
//! β = σ(b);  g = A · softplus(a + dt_bias)    A = −exp(A_log) < 0, so exp(g) ∈ (0, 1)
//! per value head h, reading key head k_head(h), token by token:
//!     S ← exp(g)·S;  S ← S + k (β (v − Sᵀk))ᵀ;  o = Sᵀq
//! o ← rms_norm(o) · w · silu(z)   per head (w is a plain scale, not 1 + w)
//! out = o · W_outᵀ
//! ```
//!
//! The recurrence runs token after token (no chunked parallel form), so a prompt gives the
//! same bits in one call, token by token, or in any chunks. The state lives in `SeqState`
//! (the convolution's last `kernel − 1` inputs and S per value head).

use crate::config::{DeltaNetConfig, DeltaNetProj, ModelConfig};
use crate::error::{ModelError, Result};
use crate::model::{observe, Model};
use crate::state::SeqState;
use crate::trace::Observer;
use crate::weights::{vector, Key, TensorSource, Weight};
use sluice_kernels::{recurrent, SendPtr};

/// ε of the L2 normalization of q and k (the reference implementation's constant).
const L2_EPS: f32 = 1e-6;

/// The input projections in the layout the checkpoint stores them.
pub enum InProj {
    /// (2·key_dim + 2·value_dim, hidden) and (2·n_v_heads, hidden), interleaved per key head.
    FusedPerGroup { qkvz: Weight, ba: Weight },
    /// [q | k | v], z, and b/a interleaved per key head.
    QkvGateBa { qkv: Weight, z: Weight, ba: Weight },
    /// [q | k | v], z, b, a.
    Separate { qkv: Weight, z: Weight, b: Weight, a: Weight },
}

pub struct DeltaNetWeights {
    pub proj: InProj,
    /// (conv_dim, kernel): channel c's taps, oldest first.
    pub conv: Vec<f32>,
    /// (n_v_heads)
    pub dt_bias: Vec<f32>,
    /// (n_v_heads): A = −exp(A_log).
    pub a: Vec<f32>,
    /// (d_v): the gated norm's scale.
    pub norm: Vec<f32>,
    /// (hidden, value_dim)
    pub out: Weight,
}

impl DeltaNetWeights {
    pub fn load(src: &dyn TensorSource, cfg: &ModelConfig, l: usize) -> Result<DeltaNetWeights> {
        let d = cfg.delta_net.ok_or_else(|| ModelError::Invalid("Gated DeltaNet layer without dimensions".into()))?;
        let h = cfg.hidden;
        let (kd, vd, nv) = (d.key_dim(), d.value_dim(), d.n_v_heads);
        let mat = |key, rows, cols| Weight::from_tensor(src.require(key, Some(l))?, rows, cols);
        let proj = match d.proj {
            DeltaNetProj::FusedPerGroup => {
                InProj::FusedPerGroup { qkvz: mat(Key::SsmQkvz, 2 * kd + 2 * vd, h)?, ba: mat(Key::SsmBa, 2 * nv, h)? }
            }
            DeltaNetProj::QkvGateBa => InProj::QkvGateBa {
                qkv: mat(Key::SsmQkv, 2 * kd + vd, h)?,
                z: mat(Key::SsmZ, vd, h)?,
                ba: mat(Key::SsmBa, 2 * nv, h)?,
            },
            DeltaNetProj::Separate => InProj::Separate {
                qkv: mat(Key::SsmQkv, 2 * kd + vd, h)?,
                z: mat(Key::SsmZ, vd, h)?,
                b: mat(Key::SsmBeta, nv, h)?,
                a: mat(Key::SsmAlpha, nv, h)?,
            },
        };
        let a = match src.get(Key::SsmA, Some(l))? {
            Some(t) => vector(t, nv)?,
            None => {
                let t = src.get(Key::SsmALog, Some(l))?.ok_or_else(|| {
                    ModelError::Invalid(format!(
                        "{}: layer {l} is a Gated DeltaNet layer but its decay (A_log / ssm_a) is missing",
                        src.describe()
                    ))
                })?;
                vector(t, nv)?.iter().map(|v| -v.exp()).collect()
            }
        };
        if let Some(bad) = a.iter().find(|v| !(v.is_finite() && **v < 0.0)) {
            return Err(ModelError::Invalid(format!(
                "{}: layer {l}: the DeltaNet decay A = −exp(A_log) must be negative and finite, found {bad}",
                src.describe()
            )));
        }
        Ok(DeltaNetWeights {
            proj,
            conv: conv_taps(src.require(Key::SsmConv1d, Some(l))?, d.conv_dim(), d.conv_kernel)?,
            dt_bias: vector(src.require(Key::SsmDtBias, Some(l))?, nv)?,
            a,
            norm: vector(src.require(Key::SsmNorm, Some(l))?, d.d_v)?,
            out: mat(Key::SsmOut, h, vd)?,
        })
    }

    pub fn bytes(&self) -> usize {
        let p = match &self.proj {
            InProj::FusedPerGroup { qkvz, ba } => qkvz.bytes() + ba.bytes(),
            InProj::QkvGateBa { qkv, z, ba } => qkv.bytes() + z.bytes() + ba.bytes(),
            InProj::Separate { qkv, z, b, a } => qkv.bytes() + z.bytes() + b.bytes() + a.bytes(),
        };
        p + self.out.bytes() + 4 * (self.conv.len() + self.dt_bias.len() + self.a.len() + self.norm.len())
    }
}

/// The convolution's taps: HF stores (conv_dim, 1, kernel), GGUF (conv_dim, kernel).
fn conv_taps(t: sluice_formats::safetensors::TensorData, channels: usize, kernel: usize) -> Result<Vec<f32>> {
    let ok = match t.shape.as_slice() {
        [c, 1, k] | [c, k] => *c == channels && *k == kernel,
        _ => false,
    };
    if !ok {
        return Err(ModelError::Invalid(format!(
            "{}: tensor `{}` has shape {:?}, expected [{channels}, {kernel}] (conv channels, kernel)",
            t.file.display(),
            t.name,
            t.shape
        )));
    }
    let mut out = vec![0f32; channels * kernel];
    sluice_kernels::quant::dequantize_row(t.dtype, &t.data, &mut out)
        .map_err(|e| ModelError::Invalid(format!("{}: tensor `{}`: {e}", t.file.display(), t.name)))?;
    Ok(out)
}

/// The per-token inputs of the recurrence, in the checkpoint's head order.
struct Projected {
    /// (n, conv_dim): [q | k | v] before the convolution.
    qkv: Vec<f32>,
    /// (n, value_dim)
    z: Vec<f32>,
    /// (n, n_v_heads)
    b: Vec<f32>,
    a: Vec<f32>,
}

fn project(m: &Model, d: &DeltaNetConfig, w: &DeltaNetWeights, x: &[f32], n: usize) -> Projected {
    let (kd, vd, nv, nk) = (d.key_dim(), d.value_dim(), d.n_v_heads, d.n_k_heads);
    let r = nv / nk; // value heads per key head
    let mut p = Projected {
        qkv: vec![0f32; n * d.conv_dim()],
        z: vec![0f32; n * vd],
        b: vec![0f32; n * nv],
        a: vec![0f32; n * nv],
    };
    // b/a interleaved per key head: [b (r) | a (r)] for each group.
    let split_ba = |ba: &[f32], p: &mut Projected| {
        for t in 0..n {
            for g in 0..nk {
                let src = &ba[t * 2 * nv + g * 2 * r..t * 2 * nv + (g + 1) * 2 * r];
                p.b[t * nv + g * r..t * nv + (g + 1) * r].copy_from_slice(&src[..r]);
                p.a[t * nv + g * r..t * nv + (g + 1) * r].copy_from_slice(&src[r..]);
            }
        }
    };
    match &w.proj {
        InProj::FusedPerGroup { qkvz, ba } => {
            // Per key head g: [q_g (d_k) | k_g (d_k) | v_g (r·d_v) | z_g (r·d_v)].
            let width = 2 * kd + 2 * vd;
            let mut all = vec![0f32; n * width];
            let mut bav = vec![0f32; n * 2 * nv];
            m.project(&[qkvz, ba], x, n, &mut [&mut all, &mut bav]);
            let gw = 2 * d.d_k + 2 * r * d.d_v;
            for t in 0..n {
                let (row, dst) =
                    (&all[t * width..(t + 1) * width], &mut p.qkv[t * d.conv_dim()..(t + 1) * d.conv_dim()]);
                for g in 0..nk {
                    let src = &row[g * gw..(g + 1) * gw];
                    let (q, rest) = src.split_at(d.d_k);
                    let (k, rest) = rest.split_at(d.d_k);
                    let (v, z) = rest.split_at(r * d.d_v);
                    dst[g * d.d_k..(g + 1) * d.d_k].copy_from_slice(q);
                    dst[kd + g * d.d_k..kd + (g + 1) * d.d_k].copy_from_slice(k);
                    dst[2 * kd + g * r * d.d_v..2 * kd + (g + 1) * r * d.d_v].copy_from_slice(v);
                    p.z[t * vd + g * r * d.d_v..t * vd + (g + 1) * r * d.d_v].copy_from_slice(z);
                }
            }
            split_ba(&bav, &mut p);
        }
        InProj::QkvGateBa { qkv, z, ba } => {
            let mut bav = vec![0f32; n * 2 * nv];
            m.project(&[qkv, z, ba], x, n, &mut [&mut p.qkv, &mut p.z, &mut bav]);
            split_ba(&bav, &mut p);
        }
        InProj::Separate { qkv, z, b, a } => {
            m.project(&[qkv, z, b, a], x, n, &mut [&mut p.qkv, &mut p.z, &mut p.b, &mut p.a]);
        }
    }
    p
}

/// The Gated DeltaNet of layer `l` for `n` tokens of `x` (normed, (n, hidden)); reads the
/// layer's committed state, writes the next one, and the output projection to `out`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    m: &Model,
    l: usize,
    w: &DeltaNetWeights,
    x: &[f32],
    n: usize,
    state: &mut SeqState,
    out: &mut [f32],
    obs: &mut Option<&mut dyn Observer>,
) {
    let d = m.cfg.delta_net.expect("a DeltaNet layer has dimensions");
    let (kd, vd, nv, dk, dv, cd, kern) =
        (d.key_dim(), d.value_dim(), d.n_v_heads, d.d_k, d.d_v, d.conv_dim(), d.conv_kernel);
    let p = project(m, &d, w, x, n);
    observe(obs, "linear_attn_qkv_mixed", Some(l), &p.qkv, n);

    let rec = state.recurrent(l);
    let (conv_old, s_old, conv_new, s_new) = rec.split();

    // 1. Causal convolution over [last kernel−1 inputs | n new ones], then SiLU.
    let mut xs = Vec::with_capacity((kern - 1 + n) * cd);
    xs.extend_from_slice(conv_old);
    xs.extend_from_slice(&p.qkv);
    let mut conv = vec![0f32; n * cd]; // (n, conv_dim)
    recurrent::conv1d_silu(&xs, &w.conv, kern, n, &mut conv);
    conv_new.copy_from_slice(&xs[n * cd..]);
    observe(obs, "conv_output_silu", Some(l), &conv, n);

    // 2. Per head inputs of the recurrence, gathered head-major: q, k normalized per key
    //    head; β and the decay per value head.
    let scale = 1.0 / (dk as f32).sqrt();
    let mut qh = vec![0f32; d.n_k_heads * n * dk]; // (n_k_heads, n, d_k)
    let mut kh = vec![0f32; d.n_k_heads * n * dk];
    let mut vh = vec![0f32; nv * n * dv]; // (n_v_heads, n, d_v)
    for t in 0..n {
        let row = &conv[t * cd..(t + 1) * cd];
        for g in 0..d.n_k_heads {
            let q = &mut qh[(g * n + t) * dk..(g * n + t + 1) * dk];
            q.copy_from_slice(&row[g * dk..(g + 1) * dk]);
            recurrent::l2_normalize(q, L2_EPS);
            q.iter_mut().for_each(|v| *v *= scale);
            let k = &mut kh[(g * n + t) * dk..(g * n + t + 1) * dk];
            k.copy_from_slice(&row[kd + g * dk..kd + (g + 1) * dk]);
            recurrent::l2_normalize(k, L2_EPS);
        }
        for h in 0..nv {
            vh[(h * n + t) * dv..(h * n + t + 1) * dv].copy_from_slice(&row[2 * kd + h * dv..2 * kd + (h + 1) * dv]);
        }
    }
    let mut beta = vec![0f32; nv * n]; // (n_v_heads, n)
    let mut decay = vec![0f32; nv * n];
    for t in 0..n {
        for h in 0..nv {
            beta[h * n + t] = sluice_kernels::ops::sigmoid(p.b[t * nv + h]);
            let g = w.a[h] * recurrent::softplus(p.a[t * nv + h] + w.dt_bias[h]);
            decay[h * n + t] = g.exp();
        }
    }

    // 3. The recurrence: value heads are independent tasks.
    let mut o = vec![0f32; nv * n * dv]; // (n_v_heads, n, d_v)
    let o_ptr = SendPtr(o.as_mut_ptr());
    let s_ptr = SendPtr(s_new.as_mut_ptr());
    let per_head = dk * dv;
    m.pool.for_ranges(nv, 1, &|heads| {
        for h in heads {
            let g = d.k_head(h);
            // SAFETY: head h owns its slice of the next state and of the output.
            let (s_h, o_h) = unsafe {
                (
                    std::slice::from_raw_parts_mut(s_ptr.get().add(h * per_head), per_head),
                    std::slice::from_raw_parts_mut(o_ptr.get().add(h * n * dv), n * dv),
                )
            };
            recurrent::delta_rule(
                &s_old[h * per_head..(h + 1) * per_head],
                s_h,
                dk,
                &qh[g * n * dk..(g + 1) * n * dk],
                &kh[g * n * dk..(g + 1) * n * dk],
                &vh[h * n * dv..(h + 1) * n * dv],
                &beta[h * n..(h + 1) * n],
                &decay[h * n..(h + 1) * n],
                o_h,
            );
        }
    });

    // 4. Gated norm per head, back to token-major (n, value_dim), and the output projection.
    let mut y = vec![0f32; n * vd];
    for t in 0..n {
        for h in 0..nv {
            let zh = &p.z[t * vd + h * dv..t * vd + (h + 1) * dv];
            recurrent::gated_rms_norm(
                &o[(h * n + t) * dv..(h * n + t + 1) * dv],
                zh,
                &w.norm,
                m.cfg.rms_eps,
                &mut y[t * vd + h * dv..t * vd + (h + 1) * dv],
            );
        }
    }
    observe(obs, "attn_output", Some(l), &y, n);
    m.project(&[&w.out], &y, n, &mut [out]);
    observe(obs, "linear_attn_out", Some(l), out, n);
}
