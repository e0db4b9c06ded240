//! The dense products of the forward pass — the token mixers' projections, dense and
//! shared-expert FFNs, the output head and a multi-token-prediction head's — and the seam
//! through which they run off the CPU's threads (on a GPU, by `sluice-cuda`). An
//! implementation holds device copies of the weights it took and must give the bits the
//! CPU's kernels give, so that where a product runs never changes the output; whatever it
//! does not take (a format without a kernel, a weight it does not hold, a failed launch) the
//! CPU computes.

use crate::ffn::FfnWeights;
use crate::mixer::delta_net::InProj;
use crate::mixer::Mixer;
use crate::model::Model;
use crate::weights::{Linear, Weight};
use sluice_kernels::{matmul, matvecs, ops};

pub trait DenseCompute: Send + Sync {
    /// `outs[i] = x · ws[i]ᵀ` (each `n × ws[i].rows`) for weights that share the input `x`
    /// (`n × cols`), and true; or false, when it does not take all of them (the CPU computes
    /// them then: `outs` may have been written and will be overwritten).
    fn matmul(&self, ws: &[&Weight], x: &[f32], n: usize, outs: &mut [&mut [f32]]) -> bool;

    /// Where dense products run and what it holds, for the placement line.
    fn describe(&self) -> String;

    /// Its counters so far, for `--stats`.
    fn stats_line(&self) -> String;
}

impl Model {
    /// Every matrix the forward pass multiplies through `project`, in forward order (the
    /// multi-token-prediction head's last): what a `DenseCompute` may hold.
    pub fn projected_weights(&self) -> Vec<&Weight> {
        let mut v = Vec::new();
        for l in self.layers.iter().chain(self.mtp.as_ref().map(|h| &h.layer)) {
            match &l.mixer {
                Mixer::Attention(a) => v.extend([&a.q.w, &a.k.w, &a.v.w, &a.o.w]),
                Mixer::Mla(a) => {
                    v.extend(a.q_a.as_ref().map(|(qa, _)| &qa.w));
                    v.extend([&a.q.w, &a.kv_a.w, &a.o.w]);
                }
                Mixer::GatedDeltaNet(d) => {
                    match &d.proj {
                        InProj::FusedPerGroup { qkvz, ba } => v.extend([qkvz, ba]),
                        InProj::QkvGateBa { qkv, z, ba } => v.extend([qkv, z, ba]),
                        InProj::Separate { qkv, z, b, a } => v.extend([qkv, z, b, a]),
                    }
                    v.push(&d.out);
                }
            }
            match &l.ffn {
                FfnWeights::Dense(f) => v.extend([&f.gate, &f.up, &f.down]),
                FfnWeights::Moe(w) => v.extend(w.shared.iter().flat_map(|sh| [&sh.ffn.gate, &sh.ffn.up, &sh.ffn.down])),
            }
        }
        v.push(&self.output);
        v.extend(self.mtp.as_ref().map(|h| &h.eh_proj));
        v
    }

    /// `outs[i] = x · ws[i]ᵀ` for weights sharing one input: on the dense device when the
    /// model has one and it takes them, else on the pool. The same bits either way.
    pub fn project(&self, ws: &[&Weight], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        debug_assert_eq!(ws.len(), outs.len());
        if let Some(d) = &self.dense_compute {
            if d.matmul(ws, x, n, outs) {
                return;
            }
        }
        if n == 1 && ws.len() > 1 {
            // One token: all the matrices in one dispatch (`matvecs`), same bits.
            let mats: Vec<_> = ws.iter().map(|w| w.mat()).collect();
            return matvecs(&self.pool, &mats, x, outs, &|_| {});
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            matmul(&self.pool, w.mat(), x, n, out);
        }
    }

    /// `project` of linear layers, each output then offset by its bias.
    pub fn linear(&self, ls: &[&Linear], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        let ws: Vec<&Weight> = ls.iter().map(|l| &l.w).collect();
        self.project(&ws, x, n, outs);
        for (l, out) in ls.iter().zip(outs.iter_mut()) {
            if let Some(b) = &l.b {
                for row in out.chunks_exact_mut(b.len()) {
                    ops::add_inplace(row, b);
                }
            }
        }
    }

    /// down(act(gate·x) ⊙ up·x) for `n` rows of `x` with resident weights, into `out`
    /// (n, hidden): gate and up as one `project` call, the combine on the host.
    pub(crate) fn gated_ffn(&self, gate: &Weight, up: &Weight, down: &Weight, x: &[f32], n: usize, out: &mut [f32]) {
        let ff = gate.rows;
        let mut g = vec![0f32; n * ff]; // (n, ff)
        let mut u = vec![0f32; n * ff]; // (n, ff)
        if n == 1 && self.dense_compute.is_none() {
            // One token on the CPU: gate and up in one dispatch, each thread combining its rows.
            let act = self.cfg.activation;
            matvecs(&self.pool, &[gate.mat(), up.mat()], x, &mut [&mut g, &mut u], &|gu| {
                let (gs, us) = gu.split_at_mut(1);
                crate::ffn::combine(act, gs[0], us[0]);
            });
        } else {
            self.project(&[gate, up], x, n, &mut [&mut g, &mut u]);
            crate::ffn::combine(self.cfg.activation, &mut g, &u);
        }
        self.project(&[down], &g, n, &mut [out]);
    }
}
