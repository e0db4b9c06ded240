//! Routers: how a token's router logits become its experts and their weights. Every variant
//! ranks by value with the lower expert id first on ties, so the choice is deterministic.

use crate::config::{Gating, Score};
use sluice_kernels::ops;

/// Expert ids ordered by `score`, highest first, the lower id winning a tie.
fn ranked(score: &[f32]) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..score.len() as u32).collect();
    idx.sort_by(|a, b| score[*b as usize].total_cmp(&score[*a as usize]).then(a.cmp(b)));
    idx
}

/// The router's choice for one token: expert ids in rank order and their weights.
/// `correction` is the per-expert selection bias of `Gating::Grouped`.
pub fn route(
    gating: Gating,
    logits: &[f32],
    correction: Option<&[f32]>,
    k: usize,
    experts: &mut Vec<u32>,
    weights: &mut Vec<f32>,
) {
    experts.clear();
    weights.clear();
    match gating {
        Gating::SoftmaxTopK { norm_topk } => {
            let mut p = logits.to_vec();
            ops::softmax(&mut p);
            experts.extend_from_slice(&ranked(&p)[..k]);
            weights.extend(experts.iter().map(|e| p[*e as usize]));
            if norm_topk {
                let s: f32 = weights.iter().sum();
                weights.iter_mut().for_each(|w| *w /= s);
            }
        }
        Gating::TopKSoftmax => {
            experts.extend_from_slice(&ranked(logits)[..k]);
            weights.extend(experts.iter().map(|e| logits[*e as usize]));
            ops::softmax(weights);
        }
        Gating::Grouped { score, n_group, topk_group, norm_topk, norm_eps, scale, .. } => {
            let s: Vec<f32> = match score {
                Score::Sigmoid => logits.iter().map(|v| ops::sigmoid(*v)).collect(),
                Score::Softmax => {
                    let mut p = logits.to_vec();
                    ops::softmax(&mut p);
                    p
                }
            };
            let mut choice: Vec<f32> = match correction {
                Some(b) => s.iter().zip(b).map(|(x, y)| x + y).collect(),
                None => s.clone(),
            };
            if n_group > 1 {
                // Only the best `topk_group` groups compete, a group scored by the sum of its
                // two best biased scores.
                let per = choice.len() / n_group;
                let group_score: Vec<f32> = choice
                    .chunks_exact(per)
                    .map(|g| {
                        let r = ranked(g);
                        g[r[0] as usize] + r.get(1).map_or(0.0, |i| g[*i as usize])
                    })
                    .collect();
                let keep = &ranked(&group_score)[..topk_group];
                for (gi, g) in choice.chunks_exact_mut(per).enumerate() {
                    if !keep.contains(&(gi as u32)) {
                        g.fill(f32::NEG_INFINITY);
                    }
                }
            }
            experts.extend_from_slice(&ranked(&choice)[..k]);
            weights.extend(experts.iter().map(|e| s[*e as usize]));
            if norm_topk {
                let sum: f32 = weights.iter().sum::<f32>() + norm_eps;
                weights.iter_mut().for_each(|w| *w /= sum);
            }
            if scale != 1.0 {
                weights.iter_mut().for_each(|w| *w *= scale);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grouped(n_group: usize, topk_group: usize, norm_topk: bool, scale: f32) -> Gating {
        Gating::Grouped {
            score: Score::Sigmoid,
            selection_bias: true,
            n_group,
            topk_group,
            norm_topk,
            norm_eps: 0.0,
            scale,
        }
    }

    #[test]
    fn sigmoid_routing_chooses_by_biased_scores_and_weighs_by_unbiased_ones() {
        let logits = [0.0f32, 1.0, 2.0, -1.0];
        let bias = [3.0f32, 0.0, 0.0, 0.0];
        let (mut e, mut w) = (Vec::new(), Vec::new());
        let g = grouped(1, 1, false, 2.0);
        route(g, &logits, Some(&bias), 2, &mut e, &mut w);
        assert_eq!(e, vec![0, 2], "the bias lifts expert 0 to the top");
        assert!((w[0] - 2.0 * 0.5).abs() < 1e-6 && (w[1] - 2.0 * ops::sigmoid(2.0)).abs() < 1e-6);
        // Groups: {0,1} and {2,3}; with one group kept, only the better pair competes.
        let g = grouped(2, 1, true, 1.0);
        route(g, &[5.0, -5.0, 1.0, 1.0], None, 2, &mut e, &mut w);
        assert_eq!(e, vec![2, 3], "group {{2,3}} sums higher than {{0,1}} though expert 0 is best");
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn topk_then_softmax() {
        let (mut e, mut w) = (Vec::new(), Vec::new());
        route(Gating::TopKSoftmax, &[1.0, 3.0, 2.0], None, 2, &mut e, &mut w);
        assert_eq!(e, vec![1, 2]);
        let want = 1.0 / (1.0 + (-1.0f32).exp());
        assert!((w[0] - want).abs() < 1e-6 && (w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
