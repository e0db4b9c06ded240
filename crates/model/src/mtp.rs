//! The multi-token-prediction head some checkpoints ship (Qwen3-Next, Qwen3.5): one extra
//! full-attention decoder layer that predicts the token after next from the model's last
//! hidden state and the next token's embedding. Speculative decoding drafts with it.
//!
//! ```text
//! position p:  e = embed(token p+1)            h = the model's final-normed hidden at p
//! x = [enorm(e) | hnorm(h)] · W_ehᵀ            (2·hidden → hidden)
//! x = decoder layer (attention at position p, its own KV cache; the model's FFN kind)
//! h' = norm(x);  logits = h' · outputᵀ          (the model's own output matrix)
//! ```
//!
//! The head is loaded on request (`Model::load_mtp`); its routed experts stay in the file's
//! mapping (resident when touched), apart from the trunk's expert cache.

use crate::config::{FfnKind, MixerKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::expert::{ExpertSource, ResidentExperts};
use crate::ffn::FfnWeights;
use crate::mixer::Mixer;
use crate::model::{observe, rms_norm_rows, Layer, LayerScratch, Logits, Model, Seg};
use crate::state::SeqState;
use crate::trace::Observer;
use crate::weights::{embedding_row, norm, Key, TensorSource, Weight};

pub struct MtpHead {
    /// (hidden, 2·hidden): input [embedding | hidden].
    pub eh_proj: Weight,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// The norm before the shared output matrix.
    pub norm: Vec<f32>,
    /// The decoder layer, at layer index `n_layer`.
    pub layer: Layer,
    pub experts: Box<dyn ExpertSource>,
}

impl MtpHead {
    /// Loads the head of `cfg` (which must declare one) from `src`.
    pub fn load(src: &dyn TensorSource, cfg: &ModelConfig) -> Result<MtpHead> {
        let mtp = cfg.mtp.ok_or_else(|| {
            ModelError::Invalid(format!("{}: the checkpoint has no multi-token-prediction head", src.describe()))
        })?;
        if mtp.n_layer != 1 {
            return Err(ModelError::Invalid(format!(
                "{}: {} multi-token-prediction layers; sluice runs heads of one layer",
                src.describe(),
                mtp.n_layer
            )));
        }
        let (h, l) = (cfg.hidden, cfg.n_layer);
        // The head's layer is full attention of the model's kind with the model's FFN kind,
        // at index n_layer.
        let mut with_head = cfg.clone();
        with_head.layers.push(crate::config::LayerSpec { mixer: head_mixer(cfg), ffn: mtp.ffn });
        with_head.n_layer += 1;
        let layer = Layer {
            attn_norm: norm(src, cfg, Key::AttnNorm, Some(l), h)?,
            mixer: Mixer::load(src, &with_head, l)?,
            attn_post_norm: None,
            ffn_norm: norm(src, cfg, Key::FfnNorm, Some(l), h)?,
            ffn: FfnWeights::load(src, &with_head, l)?,
            ffn_post_norm: None,
        };
        let experts: Box<dyn ExpertSource> = match mtp.ffn {
            FfnKind::Moe => Box::new(ResidentExperts::load_layers(src, &with_head, &[l], false)?),
            FfnKind::Dense => Box::new(ResidentExperts::empty()),
        };
        Ok(MtpHead {
            eh_proj: Weight::from_tensor(src.require(Key::MtpEhProj, Some(l))?, h, 2 * h)?,
            enorm: norm(src, cfg, Key::MtpEnorm, Some(l), h)?,
            hnorm: norm(src, cfg, Key::MtpHnorm, Some(l), h)?,
            norm: norm(src, cfg, Key::MtpNorm, Some(l), h)?,
            layer,
            experts,
        })
    }

    /// Bytes of the head's resident weights (its experts not counted).
    pub fn bytes(&self) -> usize {
        self.eh_proj.bytes() + self.layer.mixer.bytes() + self.layer.ffn.dense_bytes()
    }
}

/// The head's mixer: latent attention in a latent-attention model, full attention otherwise.
fn head_mixer(cfg: &ModelConfig) -> MixerKind {
    if cfg.mla.is_some() {
        MixerKind::Mla
    } else {
        MixerKind::Attention { window: None }
    }
}

impl Model {
    /// Loads the checkpoint's multi-token-prediction head (an error if it has none).
    pub fn load_mtp(&mut self, src: &dyn TensorSource) -> Result<()> {
        self.mtp = Some(MtpHead::load(src, &self.cfg)?);
        Ok(())
    }

    /// A state for the head's attention layer (its KV cache), up to `max_len` positions.
    pub fn new_mtp_state(&self, max_len: usize) -> SeqState {
        let max_len = if max_len == 0 { self.cfg.max_position } else { max_len };
        let mut cfg = self.cfg.clone();
        // Layers before the head's hold nothing: attention layers with empty caches.
        cfg.layers =
            vec![crate::config::LayerSpec { mixer: head_mixer(&self.cfg), ffn: FfnKind::Dense }; cfg.n_layer + 1];
        cfg.n_layer += 1;
        SeqState::new(&cfg, max_len)
    }

    /// The head at the next positions of `state`: `hidden` holds the model's final-normed
    /// hidden states of those positions (`n × hidden`, as `forward_hidden` returns them) and
    /// `next` the token that followed each. Returns the head's logits for the token after
    /// (rows as `want` asks) and its own normed hidden states of the same rows.
    pub fn mtp_forward(
        &self,
        state: &mut SeqState,
        hidden: &[f32],
        next: &[u32],
        want: Logits,
        mut obs: Option<&mut dyn Observer>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let head = self
            .mtp
            .as_ref()
            .ok_or_else(|| ModelError::Input("the multi-token-prediction head is not loaded".into()))?;
        let (n, hd) = (next.len(), self.cfg.hidden);
        if n == 0 || hidden.len() != n * hd {
            return Err(ModelError::Input(format!(
                "the head needs one hidden state of {hd} values per token: {} values for {n} tokens",
                hidden.len()
            )));
        }
        let pos0 = state.len();
        if pos0 + n > state.max_len() {
            return Err(ModelError::Input(format!(
                "context full: {pos0} positions used + {n} new > {} allowed",
                state.max_len()
            )));
        }
        self.check_tokens(next)?;
        let r = self.mtp_layers(head, state, hidden, next, want, &mut obs);
        if r.is_err() {
            state.abort();
        }
        r
    }

    fn mtp_layers(
        &self,
        head: &MtpHead,
        state: &mut SeqState,
        hidden: &[f32],
        next: &[u32],
        want: Logits,
        obs: &mut Option<&mut dyn Observer>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (n, hd, eps) = (next.len(), self.cfg.hidden, self.cfg.rms_eps);
        let l = self.cfg.n_layer;
        // [enorm(embedding) | hnorm(hidden)] per token, then the projection.
        let mut cat = vec![0f32; n * 2 * hd]; // (n, 2·hidden)
        let mut e = vec![0f32; hd];
        for (t, tok) in next.iter().enumerate() {
            embedding_row(&self.tok_embd, *tok as usize, &mut e);
            let row = &mut cat[t * 2 * hd..(t + 1) * 2 * hd];
            rms_norm_rows(&e, &head.enorm, eps, &mut row[..hd]);
            rms_norm_rows(&hidden[t * hd..(t + 1) * hd], &head.hnorm, eps, &mut row[hd..]);
        }
        let mut x = vec![0f32; n * hd]; // (n, hidden)
        self.project(&[&head.eh_proj], &cat, n, &mut [&mut x]);
        observe(obs, "mtp_eh_proj", Some(l), &x, n);
        let positions: Vec<usize> = (state.len()..state.len() + n).collect();
        let mut scratch = LayerScratch::new(n, hd);
        let mut segs = [Seg { state: &mut *state, start: 0, len: n }];
        head.layer.forward(self, l, &mut x, &mut segs, &positions, &*head.experts, &mut scratch, obs)?;
        state.commit(n);
        let rows = match want {
            Logits::None => return Ok((Vec::new(), Vec::new())),
            Logits::All | Logits::HiddenOnly => 0..n,
            Logits::Last => n - 1..n,
            Logits::From(f) => f.min(n)..n,
        };
        let m = rows.len();
        let mut hn = vec![0f32; m * hd];
        rms_norm_rows(&x[rows.start * hd..rows.end * hd], &head.norm, eps, &mut hn);
        if want == Logits::HiddenOnly {
            return Ok((Vec::new(), hn));
        }
        let mut logits = vec![0f32; m * self.cfg.vocab_size];
        self.project(&[&self.output], &hn, m, &mut [&mut logits]);
        observe(obs, "mtp_logits", Some(l), &logits, m);
        Ok((logits, hn))
    }
}
