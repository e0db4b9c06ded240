//! Feed-forward blocks, one variant per file: the dense gated MLP (here) and the routed
//! mixture of experts (`moe`, its router in `router`).

pub mod moe;
pub mod offload;
pub mod router;

use crate::config::{Activation, FfnKind, ModelConfig};
use crate::error::Result;
use crate::weights::{Key, TensorSource, Weight};
use sluice_kernels::{matmul, ops, MatRef, ThreadPool};

/// A gated FFN: down(act(gate(x)) * up(x)).
pub struct DenseFfnWeights {
    /// (ff, hidden)
    pub gate: Weight,
    /// (ff, hidden)
    pub up: Weight,
    /// (hidden, ff)
    pub down: Weight,
}

impl DenseFfnWeights {
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
}

#[allow(clippy::large_enum_variant)]
pub enum FfnWeights {
    Dense(DenseFfnWeights),
    Moe(moe::MoeWeights),
}

impl FfnWeights {
    pub fn load(src: &dyn TensorSource, cfg: &ModelConfig, l: usize) -> Result<FfnWeights> {
        let h = cfg.hidden;
        let mat = |key, rows, cols| Weight::from_tensor(src.require(key, Some(l))?, rows, cols);
        Ok(match cfg.layers[l].ffn {
            FfnKind::Dense => FfnWeights::Dense(DenseFfnWeights {
                gate: mat(Key::FfnGate, cfg.ff, h)?,
                up: mat(Key::FfnUp, cfg.ff, h)?,
                down: mat(Key::FfnDown, h, cfg.ff)?,
            }),
            FfnKind::Moe => FfnWeights::Moe(moe::MoeWeights::load(src, cfg, l)?),
        })
    }

    /// Bytes of the resident part (router and shared expert for MoE layers).
    pub fn dense_bytes(&self) -> usize {
        match self {
            FfnWeights::Dense(f) => f.bytes(),
            FfnWeights::Moe(m) => m.dense_bytes(),
        }
    }
}

/// `gate = act(gate) ⊙ up` for the FFN's activation (gpt-oss's clamped form included).
pub fn combine(a: Activation, gate: &mut [f32], up: &[f32]) {
    match a {
        Activation::Silu => ops::glu(gate, up, ops::GluAct::Silu),
        Activation::GeluTanh => ops::glu(gate, up, ops::GluAct::GeluTanh),
        Activation::SwigluOai { alpha, limit } => {
            for (g, u) in gate.iter_mut().zip(up) {
                let x = g.min(limit);
                let y = u.clamp(-limit, limit);
                *g = x * ops::sigmoid(alpha * x) * (y + 1.0);
            }
        }
    }
}

/// down(act(gate·x) ⊙ up·x) for `n` rows of `x`, written to `out` (n, hidden).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gated_ffn(
    pool: &ThreadPool,
    act: Activation,
    gate: MatRef<'_>,
    up: MatRef<'_>,
    down: MatRef<'_>,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let ff = gate.rows;
    let mut g = vec![0f32; n * ff]; // (n, ff)
    let mut u = vec![0f32; n * ff]; // (n, ff)
    if n == 1 {
        // One token: gate and up in one dispatch, each thread combining its rows (same bits).
        sluice_kernels::matvecs(pool, &[gate, up], x, &mut [&mut g, &mut u], &|gu| {
            let (gs, us) = gu.split_at_mut(1);
            combine(act, gs[0], us[0]);
        });
    } else {
        matmul(pool, gate, x, n, &mut g);
        matmul(pool, up, x, n, &mut u);
        combine(act, &mut g, &u);
    }
    matmul(pool, down, &g, n, out);
}
