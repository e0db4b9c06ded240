//! The model: resident weights and the forward pass, top to bottom.
//!
//! Every family sluice supports is a pre-norm decoder whose layers are each a token mixer
//! and a feed-forward block, chosen per layer from the config:
//!
//! ```text
//! x = embed(tokens)                                  // (n, hidden)
//! for each layer:
//!     x = x + mixer(rms_norm(x))                     // attention (mixer/attention.rs) or
//!                                                    // Gated DeltaNet (mixer/delta_net.rs)
//!     x = x + ffn(rms_norm(x))                       // dense MLP or routed experts (ffn/)
//! logits = rms_norm(x) · outputᵀ                     // (n, vocab)
//! ```
//!
//! Family files map a checkpoint onto these blocks; Gemma's extra post-norms and embedding
//! scale are its own switches here.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::expert::ExpertSource;
use crate::ffn::{moe::moe_ffn, FfnWeights};
use crate::mixer::Mixer;
use crate::rope::Rope;
use crate::state::SeqState;
use crate::trace::Observer;
use crate::weights::{embedding_row, norm, Key, TensorSource, Weight};
use sluice_kernels::{ops, ThreadPool};
use std::sync::Arc;

pub struct Layer {
    /// (hidden) the norm before the mixer.
    pub attn_norm: Vec<f32>,
    pub mixer: Mixer,
    pub attn_post_norm: Option<Vec<f32>>,
    /// (hidden) the norm before the FFN.
    pub ffn_norm: Vec<f32>,
    pub ffn: FfnWeights,
    pub ffn_post_norm: Option<Vec<f32>>,
}

pub struct Model {
    pub cfg: ModelConfig,
    /// (vocab, hidden)
    pub tok_embd: Weight,
    pub layers: Vec<Layer>,
    /// (hidden)
    pub output_norm: Vec<f32>,
    /// (vocab, hidden); the embedding table itself when tied.
    pub output: Weight,
    pub rope: Rope,
    pub rope_local: Option<Rope>,
    pub experts: Arc<dyn ExpertSource>,
    pub pool: Arc<ThreadPool>,
    /// The multi-token-prediction head, once loaded (`load_mtp`).
    pub mtp: Option<crate::mtp::MtpHead>,
    /// Where routed experts are computed when not by `pool` (a GPU); the same bits either way.
    pub expert_compute: Option<Arc<dyn crate::ffn::offload::ExpertCompute>>,
    /// Where dense products run when not on `pool` (a GPU holding the dense weights); the
    /// same bits either way.
    pub dense_compute: Option<Arc<dyn crate::dense::DenseCompute>>,
    /// Where single-token steps of one sequence run whole when not here (a GPU holding the
    /// dense weights, the KV cache and the experts): its own bits, not the CPU's.
    pub step_compute: Option<Arc<dyn crate::step::StepCompute>>,
}

/// A pass's (logits, final-normed hidden rows) per sequence.
type PassOutput = Vec<(Vec<f32>, Vec<f32>)>;

/// Which rows of logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
    None,
    /// Rows `from..n` of this call's tokens.
    From(usize),
    /// No logits: only the final-normed hidden states of every row (`forward_hidden`), for a
    /// multi-token-prediction head to read.
    HiddenOnly,
}

impl Model {
    /// Builds the model from a tensor source; `experts` serves the routed experts.
    pub fn load(
        cfg: ModelConfig,
        src: &dyn TensorSource,
        experts: Arc<dyn ExpertSource>,
        pool: Arc<ThreadPool>,
    ) -> Result<Model> {
        cfg.validate().map_err(|e| ModelError::Invalid(format!("{}: {e}", src.describe())))?;
        crate::mixer::attention::check_bias(src, &cfg)?;
        let origin = src.describe();
        let h = cfg.hidden;
        let mat = |key, layer, rows, cols| Weight::from_tensor(src.require(key, layer)?, rows, cols);
        let norm_of = |key, layer| norm(src, &cfg, key, layer, h);
        let opt_norm = |key, layer: Option<usize>| -> Result<Option<Vec<f32>>> {
            if src.get(key, layer)?.is_none() {
                return Ok(None);
            }
            norm(src, &cfg, key, layer, h).map(Some)
        };

        let tok_embd = mat(Key::TokEmbd, None, cfg.vocab_size, h)?;
        let output = match src.get(Key::Output, None)? {
            Some(t) => Weight::from_tensor(t, cfg.vocab_size, h)?,
            None if cfg.tie_embeddings => tok_embd.clone(),
            None => return Err(ModelError::Invalid(format!("{origin}: missing output (lm_head) tensor"))),
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for l in 0..cfg.n_layer {
            let gemma = cfg.gemma;
            layers.push(Layer {
                attn_norm: norm_of(Key::AttnNorm, Some(l))?,
                mixer: Mixer::load(src, &cfg, l)?,
                attn_post_norm: if gemma {
                    Some(norm_of(Key::AttnPostNorm, Some(l))?)
                } else {
                    opt_norm(Key::AttnPostNorm, Some(l))?
                },
                ffn_norm: norm_of(Key::FfnNorm, Some(l))?,
                ffn: FfnWeights::load(src, &cfg, l)?,
                ffn_post_norm: if gemma {
                    Some(norm_of(Key::FfnPostNorm, Some(l))?)
                } else {
                    opt_norm(Key::FfnPostNorm, Some(l))?
                },
            });
        }
        let output_norm = norm_of(Key::OutputNorm, None)?;
        let rope = Rope::new(cfg.rope.clone());
        let rope_local = cfg.rope_local.clone().map(Rope::new);
        Ok(Model {
            cfg,
            tok_embd,
            layers,
            output_norm,
            output,
            rope,
            rope_local,
            experts,
            pool,
            mtp: None,
            expert_compute: None,
            dense_compute: None,
            step_compute: None,
        })
    }

    /// A fresh sequence state for up to `max_len` positions (the model's own maximum if 0).
    pub fn new_state(&self, max_len: usize) -> SeqState {
        let max_len = if max_len == 0 { self.cfg.max_position } else { max_len };
        SeqState::new(&self.cfg, max_len)
    }

    /// An upper bound on the working memory one forward pass of `n` tokens allocates beside
    /// the weights, the expert cache and the KV cache (with `ctx` positions): the residual
    /// stream and block buffers, projections, router logits and expert outputs, FFN
    /// intermediates, quantized activations, attention scores and the logits. The memory
    /// promise is: peak RSS ≤ dense weights + expert-cache quota + KV cache +
    /// `scratch_bytes` + `FIXED_SLACK`.
    pub fn scratch_bytes(&self, n: usize, ctx: usize) -> usize {
        let c = &self.cfg;
        let (ne, k, eff, sff) = c
            .moe
            .as_ref()
            .map_or((0, 0, 0, 0), |m| (m.n_expert, m.n_expert_used, m.expert_ff, m.shared_expert_ff.unwrap_or(0)));
        let ff = c.ff.max(eff).max(sff);
        let mla_rows = c.mla.map_or(0, |m| {
            n * (c.n_head * (m.qk_nope + m.qk_rope + m.cache_width() + m.kv_lora_rank + m.v_head) + m.cache_width())
        });
        let window_rows: usize = (0..c.n_layer)
            .filter(|l| c.window(*l).is_some())
            .map(|l| {
                let (k, v) = c.kv_widths(l);
                n * (k + v)
            })
            .sum();
        let widest = c.hidden.max(ff).max(c.q_dim());
        let f32s = n * (3 * c.hidden          // x, h, y
            + 2 * c.q_dim() + 2 * c.kv_dim()  // q, k, v, attention output
            + ne + 2 * k * c.hidden           // router logits, expert outputs (and their gather)
            + 2 * ff + c.hidden               // gate and up intermediates, shared expert output
            + c.vocab_size)                   // logits
            + self.pool.n_threads() * ctx // attention scores per worker
            + mla_rows                        // latent attention's per-head buffers
            + window_rows; // rows a pass appends to the sliding windows
                           // Quantized activations: one byte per value plus per-block scales, of the widest input.
        4 * f32s + 2 * n * widest
    }

    /// What the process holds beyond weights, caches and `scratch_bytes`: thread stacks,
    /// allocator slack, the tokenizer's tables, code.
    pub const FIXED_SLACK: usize = 8 << 20;

    /// Bytes of resident dense weights (everything but the routed experts).
    pub fn dense_bytes(&self) -> usize {
        let mut b = self.tok_embd.bytes();
        if !std::ptr::eq(self.output.data.as_ptr(), self.tok_embd.data.as_ptr()) {
            b += self.output.bytes();
        }
        for l in &self.layers {
            b += l.mixer.bytes() + l.ffn.dense_bytes();
        }
        b
    }

    /// Runs `tokens` at the next positions of `state` and returns the requested logits
    /// (`n × vocab` for `All`, `vocab` for `Last`).
    ///
    /// On error the state is left as it was before the call.
    pub fn forward(
        &self,
        kv: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        obs: Option<&mut dyn Observer>,
    ) -> Result<Vec<f32>> {
        self.forward_hidden(kv, tokens, want, obs).map(|(logits, _)| logits)
    }

    /// `forward`, also returning the final-normed hidden state of the same rows (`rows ×
    /// hidden`): what a multi-token-prediction head reads.
    pub fn forward_hidden(
        &self,
        kv: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        obs: Option<&mut dyn Observer>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut items = [BatchItem { state: kv, tokens, want }];
        let mut out = self.forward_batch(&mut items, obs)?;
        Ok(out.pop().expect("one item"))
    }

    /// Several sequences in one pass: their tokens share every matrix product and each MoE
    /// layer fetches the union of their experts once, while attention and recurrent state stay
    /// per sequence. A sequence's results are the same bits as when it runs alone (the
    /// kernels compute each row on its own; expert outputs are combined in rank order).
    /// Returns (logits, final-normed hidden rows) per item. On error every state is left as it
    /// was.
    pub fn forward_batch(
        &self,
        items: &mut [BatchItem<'_>],
        obs: Option<&mut dyn Observer>,
    ) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        self.forward_batch_via(&*self.experts, items, obs)
    }

    /// `forward` with the routed experts served by `experts` instead of the model's own
    /// source: a view of it such as `CachedOnly` (drafting from the resident experts), which
    /// may change the output — the model's own source never does.
    pub fn forward_via(
        &self,
        experts: &dyn ExpertSource,
        kv: &mut SeqState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<Vec<f32>> {
        let mut items = [BatchItem { state: kv, tokens, want }];
        let mut out = self.forward_batch_via(experts, &mut items, None)?;
        Ok(out.pop().expect("one item").0)
    }

    fn forward_batch_via(
        &self,
        experts: &dyn ExpertSource,
        items: &mut [BatchItem<'_>],
        mut obs: Option<&mut dyn Observer>,
    ) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        for it in items.iter() {
            let (n, pos0) = (it.tokens.len(), it.state.len());
            if n == 0 {
                return Err(ModelError::Input("no tokens to run".into()));
            }
            if pos0 + n > it.state.max_len() {
                return Err(ModelError::Input(format!(
                    "context full: {pos0} positions used + {n} new > {} allowed",
                    it.state.max_len()
                )));
            }
            self.check_tokens(it.tokens)?;
        }
        let r = match self.whole_step(experts, items, obs.is_some()) {
            Some(r) => r,
            None => self.forward_layers(experts, items, &mut obs),
        };
        for it in items.iter_mut() {
            match &r {
                Ok(_) => it.state.commit(it.tokens.len()),
                Err(_) => it.state.abort(),
            }
        }
        r
    }

    /// The pass through `step_compute`, when there is one and it takes it: one token of one
    /// sequence, experts from the model's own source, nothing observed.
    fn whole_step(
        &self,
        experts: &dyn ExpertSource,
        items: &mut [BatchItem<'_>],
        observed: bool,
    ) -> Option<Result<PassOutput>> {
        let s = self.step_compute.as_ref()?;
        let [it] = items else { return None };
        if observed || it.tokens.len() != 1 || !std::ptr::addr_eq(experts, &*self.experts) {
            return None;
        }
        s.step(self, it.state, it.tokens[0], it.want).map(|r| r.map(|out| vec![out]))
    }

    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(t) = tokens.iter().find(|t| **t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::Input(format!(
                "token id {t} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        Ok(())
    }

    fn forward_layers(
        &self,
        experts: &dyn ExpertSource,
        items: &mut [BatchItem<'_>],
        obs: &mut Option<&mut dyn Observer>,
    ) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        let cfg = &self.cfg;
        let hd = cfg.hidden;
        let n: usize = items.iter().map(|it| it.tokens.len()).sum();
        let mut x = vec![0f32; n * hd]; // (n, hidden) the residual stream, sequence after sequence
        let mut positions = Vec::with_capacity(n); // each row's position in its sequence
        for (t, (tok, pos)) in items.iter().flat_map(|it| it.tokens.iter().zip(it.state.len()..)).enumerate() {
            embedding_row(&self.tok_embd, *tok as usize, &mut x[t * hd..(t + 1) * hd]);
            positions.push(pos);
        }
        if cfg.gemma {
            // Gemma scales embeddings by sqrt(hidden).
            let s = (hd as f32).sqrt();
            x.iter_mut().for_each(|v| *v *= s);
        }
        observe(obs, "inp_embd", None, &x, n);

        let wants: Vec<(usize, Logits)> = items.iter().map(|it| (it.tokens.len(), it.want)).collect();
        let mut segs = Vec::with_capacity(items.len());
        let mut start = 0;
        for it in items.iter_mut() {
            segs.push(Seg { state: &mut *it.state, start, len: it.tokens.len() });
            start += it.tokens.len();
        }
        let mut scratch = LayerScratch::new(n, hd);
        for (l, lw) in self.layers.iter().enumerate() {
            lw.forward(self, l, &mut x, &mut segs, &positions, experts, &mut scratch, obs)?;
        }
        self.heads(&x, &wants, obs)
    }

    /// The final norm and the output projection of the rows each sequence of a batch wants
    /// (`wants`: each one's rows of `x`, in order, and what it wants): (logits, normed hidden
    /// rows) per sequence, with one output projection over all the rows that want logits: the
    /// output matrix — often the largest single matrix of a small model — is read once per
    /// step, not once per sequence. The kernels give a row the same bits whatever rows run
    /// beside it, so each sequence gets the bits it gets alone.
    fn heads(
        &self,
        x: &[f32],
        wants: &[(usize, Logits)],
        obs: &mut Option<&mut dyn Observer>,
    ) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        let cfg = &self.cfg;
        let hd = cfg.hidden;
        let mut spans = Vec::with_capacity(wants.len()); // each sequence's rows of `x` to normalize
        let mut start = 0;
        for &(len, want) in wants {
            let rows = match want {
                Logits::None => start..start,
                Logits::All | Logits::HiddenOnly => start..start + len,
                Logits::Last => start + len - 1..start + len,
                Logits::From(f) => start + f.min(len)..start + len,
            };
            spans.push(rows);
            start += len;
        }
        let m: usize = spans.iter().map(|r| r.len()).sum();
        let mut hn = vec![0f32; m * hd];
        let mut at = 0;
        for r in &spans {
            let k = r.len();
            rms_norm_rows(
                &x[r.start * hd..r.end * hd],
                &self.output_norm,
                cfg.rms_eps,
                &mut hn[at * hd..(at + k) * hd],
            );
            at += k;
        }
        // Only the rows of sequences that want logits go through the output projection.
        let mut proj = Vec::new();
        let mut at = 0;
        for (r, &(_, want)) in spans.iter().zip(wants) {
            if want != Logits::HiddenOnly {
                proj.extend_from_slice(&hn[at * hd..(at + r.len()) * hd]);
            }
            at += r.len();
        }
        let logits = if proj.is_empty() { Vec::new() } else { self.output_logits(&proj) };
        let v = cfg.vocab_size;
        let mut out = Vec::with_capacity(wants.len());
        let (mut at, mut lat) = (0, 0);
        for (r, &(_, want)) in spans.iter().zip(wants) {
            let k = r.len();
            if want == Logits::None {
                out.push((Vec::new(), Vec::new()));
                continue;
            }
            let h = hn[at * hd..(at + k) * hd].to_vec();
            at += k;
            observe(obs, "result_norm", None, &h, k);
            if want == Logits::HiddenOnly {
                out.push((Vec::new(), h));
                continue;
            }
            let l = logits[lat * v..(lat + k) * v].to_vec();
            lat += k;
            observe(obs, "result_output", None, &l, k);
            out.push((l, h));
        }
        Ok(out)
    }

    /// Logits of final-normed hidden rows (`rows × hidden`, as `forward_hidden` returns them):
    /// the same bits the forward pass gives for those rows.
    pub fn output_logits(&self, hn: &[f32]) -> Vec<f32> {
        let cfg = &self.cfg;
        let m = hn.len() / cfg.hidden;
        let mut logits = vec![0f32; m * cfg.vocab_size];
        self.project(&[&self.output], hn, m, &mut [&mut logits]);
        if let Some(cap) = cfg.final_logit_softcap {
            logits.iter_mut().for_each(|v| *v = (*v / cap).tanh() * cap);
        }
        logits
    }
}

/// One sequence's part of a batched forward pass.
pub struct BatchItem<'a> {
    pub state: &'a mut SeqState,
    pub tokens: &'a [u32],
    pub want: Logits,
}

/// A sequence's rows `start..start + len` of a batched pass, and its state.
pub(crate) struct Seg<'a> {
    pub state: &'a mut SeqState,
    pub start: usize,
    pub len: usize,
}

/// Buffers a layer's forward pass reuses: the normed input of a block and its output.
pub(crate) struct LayerScratch {
    /// (n, hidden)
    h: Vec<f32>,
    /// (n, hidden)
    y: Vec<f32>,
}

impl LayerScratch {
    pub(crate) fn new(n: usize, hidden: usize) -> LayerScratch {
        LayerScratch { h: vec![0f32; n * hidden], y: vec![0f32; n * hidden] }
    }
}

impl Layer {
    /// One decoder layer on the residual stream `x` (n, hidden), in place:
    /// `x += mixer(norm(x)); x += ffn(norm(x))`. The mixer runs per sequence (`segs`); norms
    /// and the FFN run on every row at once (`positions`: each row's position, for routing
    /// traces).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        m: &Model,
        l: usize,
        x: &mut [f32],
        segs: &mut [Seg<'_>],
        positions: &[usize],
        experts: &dyn ExpertSource,
        s: &mut LayerScratch,
        obs: &mut Option<&mut dyn Observer>,
    ) -> Result<()> {
        let cfg = &m.cfg;
        let (hd, n) = (cfg.hidden, positions.len());
        let (h, y) = (&mut s.h, &mut s.y);
        rms_norm_rows(x, &self.attn_norm, cfg.rms_eps, h);
        observe(obs, "attn_norm", Some(l), h, n);
        for seg in segs.iter_mut() {
            let rows = seg.start * hd..(seg.start + seg.len) * hd;
            self.mixer.forward(m, l, &h[rows.clone()], seg.len, seg.state, &mut y[rows], obs);
        }
        if let Some(w) = &self.attn_post_norm {
            rms_norm_rows_inplace(y, w, cfg.rms_eps);
        }
        ops::add_inplace(x, y);
        observe(obs, "ffn_inp", Some(l), x, n);

        rms_norm_rows(x, &self.ffn_norm, cfg.rms_eps, h);
        observe(obs, "ffn_norm", Some(l), h, n);
        match &self.ffn {
            FfnWeights::Dense(f) => m.gated_ffn(&f.gate, &f.up, &f.down, h, n, y),
            FfnWeights::Moe(w) => moe_ffn(m, experts, l, w, h, positions, y, obs)?,
        }
        if let Some(w) = &self.ffn_post_norm {
            rms_norm_rows_inplace(y, w, cfg.rms_eps);
        }
        observe(obs, "ffn_out", Some(l), y, n);
        ops::add_inplace(x, y);
        observe(obs, "l_out", Some(l), x, n);
        Ok(())
    }
}

pub(crate) fn observe(
    obs: &mut Option<&mut dyn Observer>,
    name: &'static str,
    layer: Option<usize>,
    data: &[f32],
    n: usize,
) {
    if let Some(o) = obs.as_deref_mut() {
        o.tensor(name, layer, data, n);
    }
}

/// RMSNorm of each row of `x` (rows of `w.len()`).
pub(crate) fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        ops::rms_norm(xr, w, eps, or);
    }
}

pub(crate) fn rms_norm_rows_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    for r in x.chunks_exact_mut(w.len()) {
        ops::rms_norm_inplace(r, w, eps);
    }
}
