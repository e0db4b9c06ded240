//! Choosing how many tokens to draft each round.
//!
//! The controller keeps running estimates (exponentially weighted) of
//!
//! * `a[i]`: the chance the target keeps draft position `i` given it kept the ones before
//!   (a position never drafted yet borrows the estimate of the deepest one drafted before it:
//!   a draft that keeps matching tends to go on matching, and a fixed prior below the measured
//!   acceptance held the length down for dozens of rounds). The average is weighted by the
//!   normalized weights, so that its first observations count in full: started from the
//!   prior and moved 15% of the way per observation, three kept drafts left an estimate of
//!   0.75 (now 0.92), and drafts stayed at two tokens for the first dozen rounds of a code edit
//!   whose every draft was kept;
//! * `c(k)`: the wall time of a verify pass over `1 + k` tokens, rewinding included (when
//!   experts stream, the expert reads the pass waits for are in it): a length's own running
//!   measurement where it has one (leaning on a line until measured a few times), else a line
//!   fitted through the lengths measured — or, where lower, through the shorter lengths
//!   measured. The cost is not a line: the batched kernels work in panels of tokens, and a
//!   pass one token past a full panel pays for most of another (on an AVX2 EPYC, 17 tokens of
//!   Qwen2.5-Coder-0.5B took 1.6× the time of 16). A line through every length kept choosing
//!   the length past the step, and once that length was measured, it overestimated the ones
//!   just below it, which were then not tried for dozens of rounds;
//! * `d`: the proposer's time per drafted token;
//!
//! and drafts the `k` in `[draft_min, draft_max]` that maximizes the expected tokens per
//! second, `(1 + a[1] + a[1]a[2] + … + a[1]…a[k]) / (c(k) + k·d)`. The first round drafts
//! `draft_min` (usually none: a plain step), so the line has a measured anchor at the short
//! end — extrapolated from long drafts alone, the cost of a short pass can be overestimated
//! several times over when experts stream (a pass's misses grow with its tokens), and the
//! controller then never tries it (the first round's own time is not kept: a cold start).
//! Exploration rounds try a length next to the current choice, one longer and one shorter in
//! turn, so estimates on both sides keep being measured; a longer turn first tries the longest
//! length never measured that could pay if all its drafts were kept, if any, since the cost can
//! fall per token past a hump that steps of one do not cross (batches of a few tokens run a
//! kernel that pays more per token than the panels of 16 longer passes use, so a line through
//! the short lengths makes 15 drafts look far dearer than they are). They come every eighth
//! round while the best length moves, and each one that leaves it where it was doubles the
//! interval (up to 128 rounds): every eighth round, a draft model that cannot pay cost a
//! catch-up on the tokens since its last draft each time. With adaptation off it always drafts
//! `draft_max`.

use std::collections::BTreeMap;

/// Weight of a new observation in the running estimates.
const ALPHA: f64 = 0.15;
/// The acceptance estimate before any position was observed.
const PRIOR_ACCEPT: f64 = 0.6;
/// A verify pass's extra cost per drafted token, as a fraction of a one-token pass, before
/// two lengths have been measured.
const PRIOR_SLOPE: f64 = 0.1;
/// How many measurements the fitted line counts as, beside a length's own running cost.
const LINE_WEIGHT: f64 = 2.0;

pub struct Adapt {
    min: usize,
    max: usize,
    adaptive: bool,
    /// Per draft position, once drafted: the exponentially weighted sums of its outcomes (1:
    /// kept) and of the weights, starting from the estimate it borrowed as one observation.
    accept: Vec<Option<(f64, f64)>>,
    /// Per drafted length 0..=max: the running verify cost in seconds, once measured.
    cost: Vec<Option<f64>>,
    /// Per drafted length: how many passes were measured.
    seen: Vec<u64>,
    draft_cost: Option<f64>,
    rounds: u64,
    /// The round of the next exploration, the rounds between explorations, and how many
    /// explorations there were (even: one longer, odd: one shorter).
    next_explore: u64,
    explore_every: u64,
    explorations: u64,
    /// The length the last choice found best.
    last_best: Option<usize>,
    /// Whether a round was observed: the first is not measured (the first step after the
    /// prompt ran about twice as long as the next ones, and as the only plain step measured
    /// it made drafting that could not pay look as if it did).
    warm: bool,
}

/// Rounds between explorations while the best length keeps changing; each exploration that
/// leaves the best length as it was doubles the interval, up to `EXPLORE_MAX`.
const EXPLORE_MIN: u64 = 8;
const EXPLORE_MAX: u64 = 128;

/// Why a round drafted the length it did.
pub const REASON_BEST: &str = "best expected rate";
pub const REASON_EXPLORE: &str = "exploring one longer";
pub const REASON_EXPLORE_DOWN: &str = "exploring one shorter";
pub const REASON_EXPLORE_UNSEEN: &str = "exploring the longest length not measured";
pub const REASON_ANCHOR: &str = "measuring the shortest length first";
pub const REASON_LIMIT: &str = "token budget or context limit";
pub const REASON_FIXED: &str = "fixed (--draft-max)";

impl Adapt {
    pub fn new(min: usize, max: usize, adaptive: bool) -> Adapt {
        Adapt {
            min,
            max,
            adaptive,
            accept: vec![None; max],
            cost: vec![None; max + 1],
            seen: vec![0; max + 1],
            draft_cost: None,
            rounds: 0,
            next_explore: EXPLORE_MIN,
            explore_every: EXPLORE_MIN,
            explorations: 0,
            last_best: None,
            warm: false,
        }
    }

    /// The draft length for the next round, at most `room`, and why.
    pub fn choose(&mut self, room: usize) -> (usize, &'static str) {
        self.rounds += 1;
        let hi = self.max.min(room);
        if hi < self.min.max(1) {
            return (hi, REASON_LIMIT);
        }
        if !self.adaptive {
            return (hi, if hi < self.max { REASON_LIMIT } else { REASON_FIXED });
        }
        if self.cost[self.min].is_none() {
            return (self.min, REASON_ANCHOR);
        }
        let mut best = (self.min, f64::MIN);
        for k in self.min..=hi {
            let r = self.expected_tokens(k) / self.round_cost(k).max(1e-9);
            if r > best.1 * (1.0 + 1e-9) {
                best = (k, r);
            }
        }
        let k = best.0;
        if self.last_best != Some(k) {
            // The best length moved: explore around it often again.
            self.last_best = Some(k);
            self.explore_every = EXPLORE_MIN;
            self.next_explore = self.next_explore.min(self.rounds + EXPLORE_MIN);
        }
        if self.rounds >= self.next_explore {
            let down = self.explorations % 2 == 1;
            self.explorations += 1;
            self.next_explore = self.rounds + self.explore_every;
            self.explore_every = (2 * self.explore_every).min(EXPLORE_MAX);
            if down && k > self.min {
                return (k - 1, REASON_EXPLORE_DOWN);
            }
            // Only a length that could beat the choice if every draft were kept: a proposer
            // that costs as much as a plain step per token (a draft model nearly the target's
            // size) would pay for a long draft with nothing to gain.
            let could_win = |u: usize| (u + 1) as f64 / self.round_cost(u).max(1e-9) > best.1;
            if let Some(u) = (k + 2..=hi).rev().find(|&u| self.cost[u].is_none() && could_win(u)) {
                return (u, REASON_EXPLORE_UNSEEN);
            }
            if k < hi {
                return (k + 1, REASON_EXPLORE);
            }
        }
        (k, if k == hi && hi < self.max { REASON_LIMIT } else { REASON_BEST })
    }

    /// Expected tokens a round with `k` drafts produces: the kept drafts plus the target's own.
    pub fn expected_tokens(&self, k: usize) -> f64 {
        let mut e = 1.0;
        let mut run = 1.0;
        for i in 0..k {
            run *= self.acceptance(i);
            e += run;
        }
        e
    }

    /// The acceptance estimate of draft position `i`: its own once drafted, else that of the
    /// deepest position drafted before it, else the prior.
    fn acceptance(&self, i: usize) -> f64 {
        self.accept[..=i].iter().rev().find_map(|a| a.map(|(hits, n)| hits / n)).unwrap_or(PRIOR_ACCEPT)
    }

    /// Estimated seconds of a round drafting `k`: drafting plus verifying.
    pub fn round_cost(&self, k: usize) -> f64 {
        k as f64 * self.draft_cost.unwrap_or(0.0) + self.verify_cost(k)
    }

    /// Estimated seconds of a verify pass with `k` drafts: its own running cost where `k` was
    /// measured, averaged with `line_cost(k)` as if the line were `LINE_WEIGHT` more
    /// measurements (one noisy pass does not decide); `line_cost(k)` where it was not.
    pub fn verify_cost(&self, k: usize) -> f64 {
        let line = self.line_cost(k);
        match self.cost.get(k).copied().flatten() {
            Some(c) => {
                let n = self.seen[k].min(20) as f64;
                (n * c + LINE_WEIGHT * line) / (n + LINE_WEIGHT)
            }
            None => line,
        }
    }

    /// The lower of two lines at `k`: the one fitted through every measured length, and the
    /// one fitted through the measured lengths shorter than `k` where there are two or more (a
    /// step in the cost above `k` then does not count against `k`).
    fn line_cost(&self, k: usize) -> f64 {
        let all = self.fit(self.cost.len(), k);
        let shorter = self.cost[..k.min(self.cost.len())].iter().filter(|c| c.is_some()).count();
        if shorter >= 2 {
            all.min(self.fit(k, k))
        } else {
            all
        }
    }

    /// A line `a + b·k` fitted through the lengths below `upto` measured (each weighted by
    /// how often it was measured, up to 20), with `0 ≤ b ≤ a` (a pass over `1 + k` tokens
    /// costs no more than `1 + k` one-token passes), at `k`.
    fn fit(&self, upto: usize, k: usize) -> f64 {
        let seen: Vec<(f64, f64, f64)> = self
            .cost
            .iter()
            .zip(&self.seen)
            .take(upto)
            .enumerate()
            .filter_map(|(k, (c, n))| c.map(|c| (k as f64, c, (*n).min(20) as f64)))
            .collect();
        let k = k as f64;
        match seen.len() {
            0 => 1.0 + PRIOR_SLOPE * k,
            1 => {
                let (k0, c0, _) = seen[0];
                let a = c0 / (1.0 + PRIOR_SLOPE * k0);
                a * (1.0 + PRIOR_SLOPE * k)
            }
            _ => {
                let w: f64 = seen.iter().map(|s| s.2).sum();
                let mx = seen.iter().map(|s| s.2 * s.0).sum::<f64>() / w;
                let my = seen.iter().map(|s| s.2 * s.1).sum::<f64>() / w;
                let sxx: f64 = seen.iter().map(|s| s.2 * (s.0 - mx).powi(2)).sum();
                let sxy: f64 = seen.iter().map(|s| s.2 * (s.0 - mx) * (s.1 - my)).sum();
                let mut b = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
                let mut a = my - b * mx;
                if a <= 0.0 || b > a {
                    // Refit with b = a: c = a·(1 + k), least squares in a.
                    let num: f64 = seen.iter().map(|s| s.2 * s.1 * (1.0 + s.0)).sum();
                    let den: f64 = seen.iter().map(|s| s.2 * (1.0 + s.0).powi(2)).sum();
                    a = num / den;
                    b = a;
                }
                (a + b * k).max(1e-9)
            }
        }
    }

    /// Records a round: `drafted` tokens proposed, `kept` of them accepted, the verify pass
    /// (with its rewind) took `verify_s` and drafting `draft_s`.
    pub fn observe(&mut self, drafted: usize, kept: usize, verify_s: f64, draft_s: f64) {
        for i in 0..drafted.min(kept + 1).min(self.max) {
            let hit = if i < kept { 1.0 } else { 0.0 };
            let (hits, n) = self.accept[i].unwrap_or((self.acceptance(i), 1.0));
            self.accept[i] = Some(((1.0 - ALPHA) * hits + hit, (1.0 - ALPHA) * n + 1.0));
        }
        if !std::mem::replace(&mut self.warm, true) {
            return;
        }
        self.seen[drafted.min(self.max)] += 1;
        let c = &mut self.cost[drafted.min(self.max)];
        *c = Some(match *c {
            Some(v) => v + ALPHA * (verify_s - v),
            None => verify_s,
        });
        if drafted > 0 {
            let per = draft_s / drafted as f64;
            self.draft_cost = Some(match self.draft_cost {
                Some(v) => v + ALPHA * (per - v),
                None => per,
            });
        }
    }

    /// The current estimates, for `--stats`.
    pub fn summary(&self) -> serde_json::Value {
        let cost: BTreeMap<String, f64> =
            self.cost.iter().enumerate().filter_map(|(k, c)| c.map(|c| (k.to_string(), c * 1e3))).collect();
        serde_json::json!({
            "acceptance_by_position": self.accept.iter().map(|a| a.map(|(hits, n)| hits / n)).collect::<Vec<_>>(),
            "verify_ms_by_k": cost,
            "draft_ms_per_token": self.draft_cost.map(|c| c * 1e3),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `rounds` rounds of `a` (room `room`); `outcome(round, k)` says how the round that
    /// drafted `k` went: (kept, verify seconds, draft seconds). Returns the lengths chosen.
    fn simulate(
        a: &mut Adapt,
        rounds: usize,
        room: usize,
        mut outcome: impl FnMut(usize, usize) -> (usize, f64, f64),
    ) -> Vec<usize> {
        (0..rounds)
            .map(|round| {
                let (k, _) = a.choose(room);
                let (kept, verify, draft) = outcome(round, k);
                a.observe(k, kept, verify, draft);
                k
            })
            .collect()
    }

    /// A xorshift step.
    fn next(rng: &mut u32) -> u32 {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 17;
        *rng ^= *rng << 5;
        *rng
    }

    /// Verify costs as measured for Qwen2.5-Coder-0.5B (2 threads, AVX2 EPYC): 27 ms for a
    /// plain step, ~18 ms a draft up to 10, the 16-token panel from 11 drafts to 15, a second
    /// panel at 16.
    fn qwen_verify(k: usize) -> f64 {
        match k {
            0..=10 => 0.027 + 0.018 * k as f64,
            11..=15 => 0.012 * (k + 1) as f64,
            _ => 0.280,
        }
    }

    #[test]
    fn long_drafts_when_they_are_kept_and_short_when_not() {
        let mut a = Adapt::new(0, 8, true);
        for _ in 0..60 {
            let (k, _) = a.choose(100);
            // Everything kept; a pass costs 10 ms plus 1 ms per draft.
            a.observe(k, k, 0.010 + 0.001 * k as f64, 0.0);
        }
        assert_eq!(a.choose(100).0, 8);
        // Longer drafts are reached in a few rounds when every draft is kept: positions not
        // drafted yet are estimated from the deepest one drafted, not from the prior.
        let mut a = Adapt::new(0, 16, true);
        let chosen = simulate(&mut a, 24, 100, |_, k| (k, 0.010 + 0.001 * k as f64, 0.0));
        assert!(chosen[12..].iter().all(|k| *k >= 15), "{chosen:?}");
        let mut a = Adapt::new(0, 8, true);
        for _ in 0..80 {
            let (k, _) = a.choose(100);
            // Nothing kept: drafting only costs.
            a.observe(k, 0, 0.010 + 0.003 * k as f64, 0.002 * k as f64);
        }
        let (k, why) = a.choose(100);
        assert!(k <= 1, "{k} {why}");
        // Limits and fixed lengths.
        assert_eq!(a.choose(0).0, 0);
        // Streamed experts: a plain step is cheap, any draft brings a pass's worth of misses,
        // and about half the drafts are kept. Drafting does not pay; the controller must
        // find that although long drafts are what it tries first.
        // (Measured so on a synthetic OLMoE-shape model streamed through a 1 GiB cache: a plain
        // step 0.4–0.9 s, passes of 3–6 drafts about 4 s whatever their length.)
        let mut a = Adapt::new(0, 8, true);
        let mut rng = 0x9E37_79B9u32;
        let chosen = simulate(&mut a, 80, 100, |_, k| {
            // Each position kept with probability 0.55, until the first refusal.
            let kept = (0..k).take_while(|_| next(&mut rng) % 100 < 55).count();
            (kept, if k == 0 { 0.4 } else { 4.0 }, 0.05 * k as f64)
        });
        assert_eq!(chosen[0], 0, "the first round measures a plain step");
        assert_eq!(a.choose(100).0, 0, "{:?}", a.summary());
        assert!(chosen[40..].iter().filter(|k| **k == 0).count() > 30, "{chosen:?}");
        // A verify cost with a step: passes work in panels of 16 tokens, and 17 tokens (16
        // drafts) cost 1.6× as much as 16. Every draft kept. The controller must settle below
        // the step, not on the longest length a line through the measurements favours.
        let mut a = Adapt::new(0, 16, true);
        let chosen = simulate(&mut a, 120, 1000, |_, k| {
            let base = 0.020 + 0.008 * (k + 1) as f64;
            (k, if k == 16 { 1.6 * 0.020 + 1.6 * 0.008 * 16.0 } else { base }, 0.0)
        });
        assert!(chosen[60..].iter().filter(|k| **k == 15).count() > 45, "{chosen:?}");
        assert!(chosen[60..].iter().filter(|k| **k == 16).count() <= 4, "only exploring: {chosen:?}");
        // The cost the small-batch kernels give (measured on an AVX2 EPYC, Qwen2.5-Coder-0.5B at
        // 600 tokens of context): up to 11 tokens each costs ~18 ms, a pass of 12 to 16 tokens
        // ~10 ms a token on the tiled kernel, 17 tokens 260 ms. A line through the short lengths
        // says 15 drafts cost 300 ms; they cost 160.
        let cost = |k: usize| match k {
            0..=10 => 0.027 + 0.018 * k as f64,
            11..=15 => 0.010 * (k + 1) as f64,
            _ => 0.260,
        };
        let mut a = Adapt::new(0, 16, true);
        let chosen = simulate(&mut a, 120, 1000, |_, k| (k, cost(k), 0.0));
        assert!(chosen[60..].iter().filter(|k| **k == 15).count() > 45, "{chosen:?}");
        let mut f = Adapt::new(2, 5, false);
        assert_eq!(f.choose(100), (5, REASON_FIXED));
        assert_eq!(f.choose(3), (3, REASON_LIMIT));
    }

    #[test]
    fn a_refusal_deep_in_a_draft_is_not_held_against_that_position_forever() {
        // Drafts are kept except at an edit, which falls anywhere in a draft about one round
        // in ten.
        let mut a = Adapt::new(0, 16, true);
        let mut rng = 0x2545_F491u32;
        let chosen = simulate(&mut a, 400, 1000, |_, k| {
            let r = next(&mut rng);
            let kept = if r.is_multiple_of(10) && k > 0 { (r / 10) as usize % k } else { k };
            (kept, qwen_verify(k), 0.0)
        });
        let long = chosen[100..].iter().filter(|k| **k >= 13).count();
        assert!(long > 200, "{long} of 300 rounds drafted 13 or more: {chosen:?}");
    }

    #[test]
    fn drafts_grow_within_a_few_rounds_when_kept() {
        // Every draft kept.
        let mut a = Adapt::new(0, 16, true);
        let chosen = simulate(&mut a, 40, 1000, |_, k| (k, qwen_verify(k), 0.0));
        let long = chosen[..20].iter().filter(|k| **k >= 13).count();
        assert!(long >= 10, "{long} of the first 20 rounds drafted 13 or more: {chosen:?}");
    }

    #[test]
    fn a_draft_that_cannot_pay_is_left_alone() {
        // A draft model that is the target requantized (as measured with Qwen2.5-Coder-0.5B and
        // its Q2_K copy): every draft kept, 18 ms a drafted token and as much for the token it
        // catches up on, against 25 ms plain steps (the first one 48 ms, a cold start).
        let cost = |k: usize| match k {
            0..=10 => 0.025 + 0.018 * k as f64,
            _ => 0.012 * (k + 1) as f64,
        };
        let mut a = Adapt::new(0, 16, true);
        let chosen = simulate(&mut a, 200, 1000, |round, k| {
            let verify = if round == 0 { 0.048 } else { cost(k) };
            (k, verify, if k == 0 { 0.0 } else { 0.018 * (k + 1) as f64 })
        });
        let plain = chosen[40..].iter().filter(|k| **k == 0).count();
        assert!(plain > 140, "{plain} of 160 rounds plain: {chosen:?} {:?}", a.summary());
    }
}
