//! What a routing trace says about a model's expert locality, beside what uniform routing
//! would give: how concentrated each layer's expert use is (coverage curve), how many
//! distinct experts a window of tokens touches and how much of that set the next window
//! reuses (stability), how well one layer's experts predict the next layer's, and how far two
//! traces' expert distributions lie apart (shift).
//!
//! Tokens are counted per layer in trace order: the i-th routing record of a layer is the
//! i-th token through it, so prefill chunks and decode steps count alike.

use super::{Record, TraceHeader};

/// One routed layer's figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LayerStats {
    pub layer: usize,
    pub tokens: usize,
    /// Routing decisions (tokens × experts per token).
    pub decisions: u64,
    /// How often each expert was chosen.
    pub counts: Vec<u64>,
    /// `coverage[n - 1]`: share of the decisions taken by the `n` most used experts.
    pub coverage: Vec<f64>,
    /// Entropy of the expert distribution over that of uniform use (1 = uniform).
    pub entropy_ratio: f64,
    /// Share of consecutive tokens whose first-ranked expert is the same.
    pub top1_repeat: f64,
    /// Mean share of a token's experts that the previous token also used.
    pub reuse: f64,
    pub windows: Vec<WindowStats>,
}

/// Distinct experts per window of `w` consecutive tokens (non-overlapping windows), and the
/// Jaccard index of consecutive windows' expert sets.
#[derive(Clone, Debug, serde::Serialize)]
pub struct WindowStats {
    pub w: usize,
    pub windows: usize,
    pub distinct: f64,
    pub jaccard: f64,
}

/// Consecutive routed layers `from → to`: precision of predicting `to`'s experts for a token
/// from `from`'s, with co-occurrence counts learned on the first half of the trace and scored
/// on the second, beside predicting `to`'s most popular experts (what skew alone gives).
#[derive(Clone, Debug, serde::Serialize)]
pub struct LayerLink {
    pub from: usize,
    pub to: usize,
    pub tested: usize,
    pub precision: f64,
    pub popularity_precision: f64,
}

/// A whole trace's figures, per layer and as means over its routed layers.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TraceStats {
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub tokens: usize,
    pub layers: Vec<LayerStats>,
    pub links: Vec<LayerLink>,
    pub overall: Overall,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Overall {
    /// Mean over layers of the coverage curve.
    pub coverage: Vec<f64>,
    /// Share of decisions taken by the top 10% and 20% of each layer's experts (mean).
    pub top10_share: f64,
    pub top20_share: f64,
    pub entropy_ratio: f64,
    pub top1_repeat: f64,
    pub reuse: f64,
    /// Means over layers, with what uniform routing would give beside them.
    pub windows: Vec<WindowSummary>,
    pub next_layer_precision: Option<f64>,
    pub popularity_precision: Option<f64>,
    /// Hit rate of an LRU cache of k and of 2k experts per layer (k experts per token): the
    /// figure published measurements of real models report most often.
    pub lru_k: f64,
    pub lru_2k: f64,
    pub uniform: UniformBaseline,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct WindowSummary {
    pub w: usize,
    /// Whole windows in the trace (fewest over layers); 0 when the trace is shorter than `w`.
    pub windows: usize,
    pub distinct: f64,
    pub jaccard: f64,
    pub uniform_distinct: f64,
    pub uniform_jaccard: f64,
}

/// What independent uniform routing (k of E experts per token) would give.
#[derive(Clone, Debug, serde::Serialize)]
pub struct UniformBaseline {
    pub top1_repeat: f64,
    pub reuse: f64,
    pub precision: f64,
    /// LRU of k per layer under uniform routing: k/E.
    pub lru_k: f64,
    pub lru_2k: f64,
}

/// Hits of an LRU cache of `cap` experts replaying one layer's tokens.
pub fn layer_lru(seq: &[&[u16]], cap: usize) -> (u64, u64) {
    let mut order: Vec<u16> = Vec::with_capacity(cap + 1); // most recent last
    let (mut hits, mut acc) = (0u64, 0u64);
    for s in seq {
        for e in *s {
            acc += 1;
            if let Some(i) = order.iter().position(|x| x == e) {
                hits += 1;
                order.remove(i);
            } else if order.len() == cap {
                // Evict the least recent expert this token does not use.
                if let Some(i) = order.iter().position(|x| !s.contains(x)) {
                    order.remove(i);
                } else {
                    order.remove(0);
                }
            }
            order.push(*e);
        }
    }
    (hits, acc)
}

/// The expert sets of each layer's tokens, in trace order (rank order within a token).
fn per_layer<'a>(h: &TraceHeader, recs: &'a [Record]) -> Vec<Vec<&'a [u16]>> {
    let mut v: Vec<Vec<&[u16]>> = vec![Vec::new(); h.n_layer];
    for r in recs {
        v[r.layer as usize].push(&r.experts);
    }
    v
}

/// Expected distinct experts in `w` tokens choosing `k` of `e` uniformly, and the expected
/// Jaccard index of two such windows (ratio of the expected intersection and union).
pub fn uniform_window(e: usize, k: usize, w: usize) -> (f64, f64) {
    let p = 1.0 - (1.0 - k as f64 / e as f64).powi(w as i32);
    (e as f64 * p, p / (2.0 - p))
}

fn jaccard(a: &[bool], b: &[bool]) -> f64 {
    let (mut i, mut u) = (0usize, 0usize);
    for (x, y) in a.iter().zip(b) {
        i += (*x && *y) as usize;
        u += (*x || *y) as usize;
    }
    if u == 0 {
        1.0
    } else {
        i as f64 / u as f64
    }
}

/// Share of decisions covered by the top n experts, n = 1..=E.
pub fn coverage(counts: &[u64]) -> Vec<f64> {
    let total: u64 = counts.iter().sum();
    let mut c = counts.to_vec();
    c.sort_unstable_by(|a, b| b.cmp(a));
    let mut acc = 0u64;
    c.iter()
        .map(|x| {
            acc += x;
            if total == 0 {
                0.0
            } else {
                acc as f64 / total as f64
            }
        })
        .collect()
}

/// Share covered by the top `frac` of the experts (rounded up, at least one).
pub fn top_share(cov: &[f64], frac: f64) -> f64 {
    if cov.is_empty() {
        return 0.0;
    }
    let n = ((cov.len() as f64 * frac).ceil() as usize).clamp(1, cov.len());
    cov[n - 1]
}

/// Entropy of the distribution `counts` describe over that of uniform use (1 = uniform).
pub fn entropy_ratio(counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 || counts.len() < 2 {
        return 1.0;
    }
    let h: f64 = counts
        .iter()
        .filter(|c| **c > 0)
        .map(|c| {
            let p = *c as f64 / total as f64;
            -p * p.ln()
        })
        .sum();
    h / (counts.len() as f64).ln()
}

fn layer_stats(layer: usize, seq: &[&[u16]], n_expert: usize, windows: &[usize]) -> LayerStats {
    let mut counts = vec![0u64; n_expert];
    for s in seq {
        for e in *s {
            counts[*e as usize] += 1;
        }
    }
    let (mut rep, mut reuse, mut pairs) = (0usize, 0f64, 0usize);
    for p in seq.windows(2) {
        let (a, b) = (p[0], p[1]);
        if a.is_empty() || b.is_empty() {
            continue;
        }
        pairs += 1;
        rep += (a[0] == b[0]) as usize;
        reuse += b.iter().filter(|e| a.contains(e)).count() as f64 / b.len() as f64;
    }
    let pair_share = |x: f64| if pairs == 0 { 0.0 } else { x / pairs as f64 };
    let wins = windows
        .iter()
        .map(|&w| {
            let sets: Vec<Vec<bool>> = seq
                .chunks_exact(w.max(1))
                .map(|c| {
                    let mut s = vec![false; n_expert];
                    for t in c {
                        for e in *t {
                            s[*e as usize] = true;
                        }
                    }
                    s
                })
                .collect();
            let n = sets.len();
            let distinct = sets.iter().map(|s| s.iter().filter(|x| **x).count()).sum::<usize>() as f64;
            let jac: f64 = sets.windows(2).map(|p| jaccard(&p[0], &p[1])).sum();
            WindowStats {
                w,
                windows: n,
                distinct: if n == 0 { 0.0 } else { distinct / n as f64 },
                jaccard: if n < 2 { 0.0 } else { jac / (n - 1) as f64 },
            }
        })
        .collect();
    LayerStats {
        layer,
        tokens: seq.len(),
        decisions: counts.iter().sum(),
        coverage: coverage(&counts),
        entropy_ratio: entropy_ratio(&counts),
        counts,
        top1_repeat: pair_share(rep as f64),
        reuse: pair_share(reuse),
        windows: wins,
    }
}

/// The `k` highest-scoring experts (ties: the more popular first, then the lower id).
fn top_k(score: &[f64], popularity: &[u64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..score.len()).collect();
    idx.sort_by(|a, b| score[*b].total_cmp(&score[*a]).then(popularity[*b].cmp(&popularity[*a])).then(a.cmp(b)));
    idx.truncate(k);
    idx
}

fn link(from: usize, to: usize, a: &[&[u16]], b: &[&[u16]], n_expert: usize, k: usize) -> Option<LayerLink> {
    let n = a.len().min(b.len());
    let train = n / 2;
    if train == 0 || n - train == 0 {
        return None;
    }
    let mut co = vec![0u64; n_expert * n_expert];
    let mut pop = vec![0u64; n_expert];
    for t in 0..train {
        for x in a[t] {
            for y in b[t] {
                co[*x as usize * n_expert + *y as usize] += 1;
            }
        }
        for y in b[t] {
            pop[*y as usize] += 1;
        }
    }
    let zero = vec![0.0; n_expert];
    let by_pop = top_k(&zero, &pop, k);
    let (mut hit, mut hit_pop, mut total) = (0usize, 0usize, 0usize);
    let mut score = vec![0f64; n_expert];
    for t in train..n {
        score.iter_mut().for_each(|s| *s = 0.0);
        for x in a[t] {
            for (y, s) in score.iter_mut().enumerate() {
                *s += co[*x as usize * n_expert + y] as f64;
            }
        }
        let pred = top_k(&score, &pop, k);
        let actual = b[t];
        hit += pred.iter().filter(|e| actual.contains(&(**e as u16))).count();
        hit_pop += by_pop.iter().filter(|e| actual.contains(&(**e as u16))).count();
        total += actual.len();
    }
    let r = |h: usize| if total == 0 { 0.0 } else { h as f64 / total as f64 };
    Some(LayerLink { from, to, tested: n - train, precision: r(hit), popularity_precision: r(hit_pop) })
}

fn mean(it: impl Iterator<Item = f64>) -> f64 {
    let (mut s, mut n) = (0.0, 0usize);
    for x in it {
        s += x;
        n += 1;
    }
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// All the figures for one trace; `windows` are the window sizes (tokens) to measure.
pub fn stats(h: &TraceHeader, recs: &[Record], windows: &[usize]) -> TraceStats {
    let seqs = per_layer(h, recs);
    let (ne, k) = (h.n_expert, h.n_expert_used.max(1));
    let routed: Vec<usize> = (0..h.n_layer).filter(|l| !seqs[*l].is_empty()).collect();
    let layers: Vec<LayerStats> = routed.iter().map(|&l| layer_stats(l, &seqs[l], ne, windows)).collect();
    let links: Vec<LayerLink> =
        routed.windows(2).filter_map(|p| link(p[0], p[1], &seqs[p[0]], &seqs[p[1]], ne, k)).collect();
    let coverage = (0..ne).map(|i| mean(layers.iter().map(|l| l.coverage[i]))).collect::<Vec<_>>();
    let lru = |cap: usize| {
        mean(routed.iter().map(|l| {
            let (h, a) = layer_lru(&seqs[*l], cap);
            h as f64 / a.max(1) as f64
        }))
    };
    let wsum = windows
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            let (ud, uj) = uniform_window(ne, k, w);
            let with = || layers.iter().filter(|l| l.windows[i].windows > 0);
            WindowSummary {
                w,
                windows: layers.iter().map(|l| l.windows[i].windows).min().unwrap_or(0),
                distinct: mean(with().map(|l| l.windows[i].distinct)),
                jaccard: mean(layers.iter().filter(|l| l.windows[i].windows > 1).map(|l| l.windows[i].jaccard)),
                uniform_distinct: ud,
                uniform_jaccard: uj,
            }
        })
        .collect();
    let overall = Overall {
        top10_share: top_share(&coverage, 0.1),
        top20_share: top_share(&coverage, 0.2),
        coverage,
        entropy_ratio: mean(layers.iter().map(|l| l.entropy_ratio)),
        top1_repeat: mean(layers.iter().map(|l| l.top1_repeat)),
        reuse: mean(layers.iter().map(|l| l.reuse)),
        windows: wsum,
        next_layer_precision: (!links.is_empty()).then(|| mean(links.iter().map(|l| l.precision))),
        popularity_precision: (!links.is_empty()).then(|| mean(links.iter().map(|l| l.popularity_precision))),
        lru_k: lru(k),
        lru_2k: lru(2 * k),
        uniform: UniformBaseline {
            top1_repeat: 1.0 / ne as f64,
            reuse: k as f64 / ne as f64,
            precision: k as f64 / ne as f64,
            lru_k: (k as f64 / ne as f64).min(1.0),
            lru_2k: (2.0 * k as f64 / ne as f64).min(1.0),
        },
    };
    TraceStats {
        n_expert: ne,
        n_expert_used: k,
        tokens: layers.iter().map(|l| l.tokens).max().unwrap_or(0),
        layers,
        links,
        overall,
    }
}

/// How far two traces' expert distributions lie apart, per layer both route.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Shift {
    /// Mean over layers of the total-variation distance (0 = same distribution, 1 = disjoint).
    pub total_variation: f64,
    /// Mean over layers of the weighted Jaccard index Σ min(p, q) / Σ max(p, q).
    pub weighted_jaccard: f64,
    pub per_layer: Vec<(usize, f64, f64)>,
}

pub fn shift(a: &TraceStats, b: &TraceStats) -> Result<Shift, String> {
    if a.n_expert != b.n_expert {
        return Err(format!("the traces route over {} and {} experts: not the same model", a.n_expert, b.n_expert));
    }
    let mut per_layer = Vec::new();
    for la in &a.layers {
        let Some(lb) = b.layers.iter().find(|l| l.layer == la.layer) else { continue };
        let (ta, tb) = (la.decisions.max(1) as f64, lb.decisions.max(1) as f64);
        let (mut tv, mut mn, mut mx) = (0.0, 0.0, 0.0);
        for (x, y) in la.counts.iter().zip(&lb.counts) {
            let (p, q) = (*x as f64 / ta, *y as f64 / tb);
            tv += (p - q).abs();
            mn += p.min(q);
            mx += p.max(q);
        }
        per_layer.push((la.layer, tv / 2.0, if mx > 0.0 { mn / mx } else { 1.0 }));
    }
    if per_layer.is_empty() {
        return Err("the traces share no routed layer".into());
    }
    Ok(Shift {
        total_variation: mean(per_layer.iter().map(|p| p.1)),
        weighted_jaccard: mean(per_layer.iter().map(|p| p.2)),
        per_layer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(n_layer: usize, n_expert: usize, k: usize) -> TraceHeader {
        TraceHeader { model: "t".into(), n_layer, n_expert, n_expert_used: k, slot_bytes: 4096, expert_bytes: 4000 }
    }

    fn rec(layer: u16, pos: u32, e: &[u16]) -> Record {
        Record { layer, pos, experts: e.to_vec() }
    }

    #[test]
    fn coverage_entropy_and_repeats_match_hand_counts() {
        // One layer, 4 experts, top-1: tokens pick 0 0 0 1 → counts 3,1,0,0.
        let h = header(1, 4, 1);
        let r: Vec<Record> = [0u16, 0, 0, 1].iter().enumerate().map(|(i, e)| rec(0, i as u32, &[*e])).collect();
        let s = stats(&h, &r, &[2]);
        let l = &s.layers[0];
        assert_eq!(l.counts, vec![3, 1, 0, 0]);
        assert_eq!(l.coverage, vec![0.75, 1.0, 1.0, 1.0]);
        // 3 consecutive pairs, 2 repeat the first choice.
        assert!((l.top1_repeat - 2.0 / 3.0).abs() < 1e-12);
        assert!((l.reuse - 2.0 / 3.0).abs() < 1e-12);
        // Entropy of (3/4, 1/4) over ln 4.
        let want = (-(0.75f64 * 0.75f64.ln()) - 0.25 * 0.25f64.ln()) / 4f64.ln();
        assert!((l.entropy_ratio - want).abs() < 1e-12);
        // Windows of 2: {0}, {0,1}: distinct 1 and 2, Jaccard 1/2.
        assert_eq!(l.windows[0].windows, 2);
        assert!((l.windows[0].distinct - 1.5).abs() < 1e-12);
        assert!((l.windows[0].jaccard - 0.5).abs() < 1e-12);
        assert_eq!(s.overall.top20_share, 0.75); // ceil(0.8) = one expert of four
                                                 // LRU of one expert: hits on the two repeats; of two: on all three zeros after the first.
        assert!((s.overall.lru_k - 0.5).abs() < 1e-12);
        assert!((s.overall.lru_2k - 0.5).abs() < 1e-12);
    }

    #[test]
    fn uniform_expectations_are_exact_for_small_cases() {
        // One token choosing 2 of 8: exactly 2 distinct.
        let (d, _) = uniform_window(8, 2, 1);
        assert!((d - 2.0).abs() < 1e-12);
        // Two tokens choosing 1 of 2: 1.5 distinct on average.
        let (d, _) = uniform_window(2, 1, 2);
        assert!((d - 1.5).abs() < 1e-12);
    }

    #[test]
    fn a_deterministic_layer_map_is_predicted_and_popularity_is_not_enough() {
        // Layer 1 uses expert (e + 1) mod 8 whenever layer 0 uses e; layer 0 cycles 0..8.
        let h = header(2, 8, 1);
        let mut r = Vec::new();
        for t in 0..64u32 {
            let e = (t % 8) as u16;
            r.push(rec(0, t, &[e]));
            r.push(rec(1, t, &[(e + 1) % 8]));
        }
        let s = stats(&h, &r, &[4]);
        assert_eq!(s.links.len(), 1);
        assert_eq!(s.links[0].tested, 32);
        assert_eq!(s.links[0].precision, 1.0);
        // Each expert of layer 1 is used equally: guessing the most popular is right 1 in 8.
        assert!((s.links[0].popularity_precision - 0.125).abs() < 1e-12);
        // Cycling through all 8 experts: coverage is uniform, nothing repeats.
        assert!((s.overall.entropy_ratio - 1.0).abs() < 1e-12);
        assert_eq!(s.overall.top1_repeat, 0.0);
        // Windows of 4 hold 4 distinct experts; consecutive windows are disjoint.
        assert_eq!(s.overall.windows[0].distinct, 4.0);
        assert_eq!(s.overall.windows[0].jaccard, 0.0);
    }

    #[test]
    fn shift_is_zero_for_the_same_trace_and_one_for_disjoint_ones() {
        let h = header(1, 4, 1);
        let a: Vec<Record> = (0..8).map(|t| rec(0, t, &[(t % 2) as u16])).collect();
        let b: Vec<Record> = (0..8).map(|t| rec(0, t, &[2 + (t % 2) as u16])).collect();
        let c: Vec<Record> = (0..8).map(|t| rec(0, t, &[(t % 4 / 2) as u16 + 1])).collect();
        let (sa, sb, sc) = (stats(&h, &a, &[1]), stats(&h, &b, &[1]), stats(&h, &c, &[1]));
        let same = shift(&sa, &sa).unwrap();
        assert_eq!((same.total_variation, same.weighted_jaccard), (0.0, 1.0));
        let apart = shift(&sa, &sb).unwrap();
        assert_eq!((apart.total_variation, apart.weighted_jaccard), (1.0, 0.0));
        // a: {0: 1/2, 1: 1/2}; c: {1: 1/2, 2: 1/2} → TV 1/2, weighted Jaccard (1/2)/(3/2).
        let half = shift(&sa, &sc).unwrap();
        assert!((half.total_variation - 0.5).abs() < 1e-12);
        assert!((half.weighted_jaccard - 1.0 / 3.0).abs() < 1e-12);
        let other = stats(&header(1, 8, 1), &a, &[1]);
        assert!(shift(&sa, &other).unwrap_err().contains("not the same model"));
    }
}
