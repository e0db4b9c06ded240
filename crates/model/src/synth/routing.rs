//! How a synthetic model routes. `Uniform`: each token's experts are pseudo-random and
//! uniform (pessimistic for a cache). `Skewed`: three properties real MoE routing is
//! reported to have, each made by the weights themselves so that sluice and llama.cpp run the
//! same routing:
//!
//! * **popularity skew** — each router row (one expert) is scaled by a log-normal factor
//!   (`pop` is the spread of its logarithm), so some experts win the top-k far more often;
//! * **topics** — every token belongs to one of `topics` topics; the first eighth of the
//!   hidden coordinates of its embedding (`model_span`) are its topic's prototype, and a share `share` of
//!   each router's logit variance reads those coordinates. Tokens of a topic route alike, and
//!   because every layer reads the same topic, one layer's experts predict the next's;
//! * **persistence** — the output head's rows carry their token's topic prototype too, scaled
//!   by `stay`, so generated text tends to stay in its topic from token to token and its
//!   routing with it.
//!
//! The figures a trace of such a model gives (`sluice trace stats`) are what to compare with
//! published measurements; the defaults are chosen so they land in the ranges those report.

use super::{FastRng, Role, SynthSpec, TensorPlan};
use sluice_kernels::quant::quantize_rows;
use sluice_kernels::DType;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    Uniform,
    Skewed(Skew),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Skew {
    /// Spread (σ of the logarithm) of the router rows' scale factors.
    pub pop: f32,
    /// Number of token topics.
    pub topics: usize,
    /// Share of a router logit's variance that comes from the token's topic.
    pub share: f32,
    /// Strength of the output head's pull towards the current token's topic.
    pub stay: f32,
}

impl Skew {
    pub const DEFAULT: Skew = Skew { pop: 0.5, topics: 32, share: 0.7, stay: 0.2 };
}

impl Routing {
    /// `uniform`, `skewed`, or `skewed:pop=0.5,topics=32,share=0.7,stay=0.2` (any subset).
    pub fn parse(s: &str) -> Result<Routing, String> {
        if s == "uniform" {
            return Ok(Routing::Uniform);
        }
        let Some(rest) = s.strip_prefix("skewed") else {
            return Err(format!("unknown routing `{s}` (uniform, skewed, or skewed:pop=…,topics=…,share=…,stay=…)"));
        };
        let mut k = Skew::DEFAULT;
        let rest = rest.strip_prefix(':').unwrap_or(rest);
        for kv in rest.split(',').filter(|x| !x.is_empty()) {
            let (key, v) = kv.split_once('=').ok_or_else(|| format!("`{kv}`: expected key=value"))?;
            let num = |lo: f32, hi: f32| -> Result<f32, String> {
                let x: f32 = v.parse().map_err(|_| format!("`{kv}`: not a number"))?;
                if !(lo..=hi).contains(&x) {
                    return Err(format!("`{kv}`: {key} must lie in {lo}..={hi}"));
                }
                Ok(x)
            };
            match key {
                "pop" => k.pop = num(0.0, 4.0)?,
                "share" => k.share = num(0.0, 1.0)?,
                "stay" => k.stay = num(0.0, 10.0)?,
                "topics" => k.topics = num(1.0, 65536.0)? as usize,
                _ => return Err(format!("`{kv}`: unknown key (pop, topics, share, stay)")),
            }
        }
        Ok(Routing::Skewed(k))
    }

    /// The name written into the model's metadata (and parsed back by `parse`).
    pub fn name(&self) -> String {
        match self {
            Routing::Uniform => "uniform".into(),
            Routing::Skewed(k) => {
                format!("skewed:pop={},topics={},share={},stay={}", k.pop, k.topics, k.share, k.stay)
            }
        }
    }
}

/// Hidden coordinates that carry the topic: about an eighth of them, whole blocks of `d`;
/// none where a block is more than half the row.
pub fn topic_span(hidden: usize, d: DType) -> usize {
    let be = d.block_elems();
    if 2 * be > hidden {
        return 0;
    }
    (hidden / 8).div_ceil(be) * be
}

/// The topic span of model `s`: whole blocks of both its embedding and output formats.
pub fn model_span(s: &SynthSpec) -> usize {
    let h = s.hidden as u64;
    let (e, o) = (super::matrix_dtype(s, None, "embd", false, h), super::matrix_dtype(s, None, "output", false, h));
    // Block sizes are powers of two: the larger is a multiple of the smaller.
    topic_span(s.hidden, if e.block_elems() >= o.block_elems() { e } else { o })
}

/// The topic of token `tok`.
pub fn topic_of(tok: usize, topics: usize, seed: u64) -> usize {
    let mut r = FastRng::new(seed ^ (tok as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
    (r.next_u64() % topics as u64) as usize
}

/// Topic `c`'s prototype: `span` values of unit spread, the same for every tensor.
fn prototype(c: usize, span: usize, seed: u64) -> Vec<f32> {
    let mut r = FastRng::new(seed.wrapping_mul(7919).wrapping_add(c as u64 + 1));
    (0..span).map(|_| r.normalish()).collect()
}

/// Whether tensor `t` is one the skewed routing writes differently.
pub fn shapes(t: &TensorPlan) -> bool {
    matches!(t.role, Role::Embedding | Role::Output) || is_router(t)
}

fn is_router(t: &TensorPlan) -> bool {
    t.role == Role::Router && t.name.ends_with("ffn_gate_inp.weight")
}

fn layer_of(name: &str) -> usize {
    name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|n| n.parse().ok()).unwrap_or(0)
}

/// Rewrites rows `r0..r0 + rows` of `t` (already filled at random in `buf`) for skewed routing.
pub fn reshape_rows(s: &SynthSpec, k: &Skew, t: &TensorPlan, r0: usize, rows: usize, buf: &mut [u8]) {
    let cols = t.dims[0] as usize;
    let row_bytes = buf.len() / rows;
    if is_router(t) {
        // Row e (expert e): topic coordinates carry `share` of the variance, the rest the
        // remainder, and the whole row is scaled by the expert's popularity factor.
        let span = model_span(s).min(cols);
        let l = layer_of(&t.name);
        let mut pr = FastRng::new(s.seed.wrapping_mul(31).wrapping_add(l as u64 * 1_000_003 + 17));
        let scales: Vec<f32> = (0..s.n_expert).map(|_| (k.pop * pr.normalish()).exp()).collect();
        let rms = (scales.iter().map(|x| x * x).sum::<f32>() / scales.len() as f32).sqrt();
        let (a, b) = (
            (k.share * cols as f32 / span as f32).sqrt(),
            ((1.0 - k.share) * cols as f32 / (cols - span).max(1) as f32).sqrt(),
        );
        for (i, row) in buf.chunks_exact_mut(row_bytes).enumerate() {
            let g = scales[(r0 + i) % scales.len()] / rms;
            for (j, v) in row.chunks_exact_mut(4).enumerate() {
                let x = f32::from_le_bytes(v.try_into().expect("4 bytes"));
                let y = x * g * if j < span { a } else { b };
                v.copy_from_slice(&y.to_le_bytes());
            }
        }
        return;
    }
    // Embedding and output rows (tokens): their first `span` coordinates are the token's
    // topic prototype, at the tensor's own spread (times `stay` for the output head).
    let span = model_span(s);
    if span == 0 || span > cols {
        return;
    }
    let scale = t.sigma * if t.role == Role::Output { k.stay } else { 1.0 };
    let span_bytes = span / t.dtype.block_elems() * t.dtype.block_bytes();
    let mut cache: Vec<Option<Vec<u8>>> = vec![None; k.topics];
    for (i, row) in buf.chunks_exact_mut(row_bytes).enumerate() {
        let c = topic_of(r0 + i, k.topics, s.seed);
        let q = cache[c].get_or_insert_with(|| {
            let p: Vec<f32> = prototype(c, span, s.seed).iter().map(|x| x * scale).collect();
            quantize_rows(t.dtype, &p, span)
        });
        row[..span_bytes].copy_from_slice(q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_names_parse_back_and_bad_ones_are_named() {
        for r in [Routing::Uniform, Routing::Skewed(Skew::DEFAULT), Routing::parse("skewed:pop=1,topics=8").unwrap()] {
            assert_eq!(Routing::parse(&r.name()).unwrap(), r);
        }
        assert_eq!(Routing::parse("skewed:topics=8").unwrap(), Routing::Skewed(Skew { topics: 8, ..Skew::DEFAULT }));
        assert!(Routing::parse("zipf").unwrap_err().contains("unknown routing"));
        assert!(Routing::parse("skewed:share=2").unwrap_err().contains("0..=1"));
        assert!(Routing::parse("skewed:colour=red").unwrap_err().contains("unknown key"));
    }

    #[test]
    fn topic_spans_are_whole_blocks() {
        assert_eq!(topic_span(2048, DType::Q4_K), 256);
        assert_eq!(topic_span(2880, DType::Q8_0), 384);
        assert_eq!(topic_span(128, DType::F32), 16);
        assert_eq!(topic_span(256, DType::Q4_K), 0);
        assert_eq!(topic_span(512, DType::Q4_K), 256);
        assert_eq!(topic_span(1024, DType::Q4_K), 256);
    }
}
