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
/// `correction` is the per-expert selection bias of `Gating::Grouped`. With `allowed`, the
/// experts outside it do not exist for this token (pinned routing): the top k is taken over
/// the allowed ones (fewer if fewer are allowed) and the weights are the gating's over them.
pub fn route(
    gating: Gating,
    logits: &[f32],
    correction: Option<&[f32]>,
    k: usize,
    allowed: Option<&[bool]>,
    experts: &mut Vec<u32>,
    weights: &mut Vec<f32>,
) {
    experts.clear();
    weights.clear();
    let masked: Vec<f32>;
    let (logits, k) = match allowed {
        None => (logits, k),
        Some(m) => {
            masked = logits.iter().zip(m).map(|(v, ok)| if *ok { *v } else { f32::NEG_INFINITY }).collect();
            (&masked[..], k.min(m.iter().filter(|x| **x).count()))
        }
    };
    let is_allowed = |e: usize| allowed.is_none_or(|m| m[e]);
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
            for (e, c) in choice.iter_mut().enumerate() {
                if !is_allowed(e) {
                    *c = f32::NEG_INFINITY;
                }
            }
            let unlimited = choice.clone();
            if n_group > 1 {
                // Only the best `topk_group` groups compete, a group scored by the sum of its
                // two best biased scores (of its allowed experts).
                let per = choice.len() / n_group;
                let group_score: Vec<f32> = choice
                    .chunks_exact(per)
                    .map(|g| {
                        let r = ranked(g);
                        let second = r.get(1).map_or(0.0, |i| g[*i as usize]);
                        g[r[0] as usize] + if second.is_finite() { second } else { 0.0 }
                    })
                    .collect();
                let keep = &ranked(&group_score)[..topk_group];
                for (gi, g) in choice.chunks_exact_mut(per).enumerate() {
                    if !keep.contains(&(gi as u32)) {
                        g.fill(f32::NEG_INFINITY);
                    }
                }
            }
            experts.extend(ranked(&choice).into_iter().filter(|e| choice[*e as usize].is_finite()).take(k));
            if experts.len() < k {
                // Pinned routing left the kept groups short: the best allowed experts of the
                // other groups fill in.
                for e in ranked(&unlimited) {
                    if experts.len() == k {
                        break;
                    }
                    if !experts.contains(&e) {
                        experts.push(e);
                    }
                }
            }
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
        route(g, &logits, Some(&bias), 2, None, &mut e, &mut w);
        assert_eq!(e, vec![0, 2], "the bias lifts expert 0 to the top");
        assert!((w[0] - 2.0 * 0.5).abs() < 1e-6 && (w[1] - 2.0 * ops::sigmoid(2.0)).abs() < 1e-6);
        // Groups: {0,1} and {2,3}; with one group kept, only the better pair competes.
        let g = grouped(2, 1, true, 1.0);
        route(g, &[5.0, -5.0, 1.0, 1.0], None, 2, None, &mut e, &mut w);
        assert_eq!(e, vec![2, 3], "group {{2,3}} sums higher than {{0,1}} though expert 0 is best");
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn pinned_routing_takes_the_top_k_over_the_allowed_experts() {
        let (mut e, mut w) = (Vec::new(), Vec::new());
        let logits = [3.0f32, 2.0, 1.0, 0.0, -1.0, -2.0];
        let allowed = [false, true, false, true, true, false];
        route(Gating::SoftmaxTopK { norm_topk: true }, &logits, None, 2, Some(&allowed), &mut e, &mut w);
        assert_eq!(e, vec![1, 3]);
        let want = 2f32.exp() / (2f32.exp() + 1.0);
        assert!((w[0] - want).abs() < 1e-6 && (w.iter().sum::<f32>() - 1.0).abs() < 1e-6, "{w:?}");
        // Unnormalized: probabilities over the allowed experts, as if the others were pruned.
        route(Gating::SoftmaxTopK { norm_topk: false }, &logits, None, 2, Some(&allowed), &mut e, &mut w);
        let z = 2f32.exp() + 1.0 + (-1f32).exp();
        assert!((w.iter().sum::<f32>() - (2f32.exp() + 1.0) / z).abs() < 1e-6, "{w:?}");
        // Every expert allowed: the unrestricted choice, to the bit.
        let every = [true; 6];
        for g in [Gating::SoftmaxTopK { norm_topk: false }, Gating::TopKSoftmax, grouped(3, 2, true, 2.5)] {
            let (mut e2, mut w2) = (Vec::new(), Vec::new());
            route(g, &logits, Some(&[0.1; 6]), 3, None, &mut e, &mut w);
            route(g, &logits, Some(&[0.1; 6]), 3, Some(&every), &mut e2, &mut w2);
            assert_eq!(
                (e.clone(), w.iter().map(|x| x.to_bits()).collect::<Vec<_>>()),
                (e2, w2.iter().map(|x| x.to_bits()).collect())
            );
        }
        // Grouped, one group kept, and it holds one allowed expert: the best allowed expert of
        // the other groups fills in (groups {0,1} {2,3} {4,5}).
        let allowed = [true, false, false, false, true, true];
        route(grouped(3, 1, true, 1.0), &[5.0, 0.0, 0.0, 0.0, -1.0, -1.0], None, 2, Some(&allowed), &mut e, &mut w);
        assert_eq!(e, vec![0, 4]);
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn topk_then_softmax() {
        let (mut e, mut w) = (Vec::new(), Vec::new());
        route(Gating::TopKSoftmax, &[1.0, 3.0, 2.0], None, 2, None, &mut e, &mut w);
        assert_eq!(e, vec![1, 2]);
        let want = 1.0 / (1.0 + (-1.0f32).exp());
        assert!((w[0] - want).abs() < 1e-6 && (w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
