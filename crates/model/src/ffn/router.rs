//! Routers: how a token's router logits become its experts and their weights.

use crate::config::Gating;
use sluice_kernels::ops;

/// The router's choice for one token: expert ids in rank order and their weights.
pub fn route(gating: Gating, logits: &[f32], k: usize, experts: &mut Vec<u32>, weights: &mut Vec<f32>) {
    match gating {
        Gating::SoftmaxTopK { norm_topk } => {
            let mut p = logits.to_vec();
            ops::softmax(&mut p);
            let mut idx: Vec<u32> = (0..p.len() as u32).collect();
            // Highest probability first; the lower id wins a tie.
            idx.sort_by(|a, b| p[*b as usize].total_cmp(&p[*a as usize]).then(a.cmp(b)));
            experts.clear();
            experts.extend_from_slice(&idx[..k]);
            weights.clear();
            weights.extend(experts.iter().map(|e| p[*e as usize]));
            if norm_topk {
                let s: f32 = weights.iter().sum();
                weights.iter_mut().for_each(|w| *w /= s);
            }
        }
    }
}
