//! Token mixers, one variant per file: attention (`attention`), latent attention (`mla`) and
//! Gated DeltaNet (`delta_net`). A layer holds one; the model calls it with the layer's sequence state.

pub mod attention;
pub mod delta_net;
pub mod mla;

use crate::config::{MixerKind, ModelConfig};
use crate::error::Result;
use crate::model::Model;
use crate::state::SeqState;
use crate::trace::Observer;
use crate::weights::TensorSource;

pub enum Mixer {
    Attention(attention::AttentionWeights),
    GatedDeltaNet(delta_net::DeltaNetWeights),
    Mla(mla::MlaWeights),
}

impl Mixer {
    pub fn load(src: &dyn TensorSource, cfg: &ModelConfig, l: usize) -> Result<Mixer> {
        Ok(match cfg.layers[l].mixer {
            MixerKind::Attention { .. } => Mixer::Attention(attention::AttentionWeights::load(src, cfg, l)?),
            MixerKind::GatedDeltaNet => Mixer::GatedDeltaNet(delta_net::DeltaNetWeights::load(src, cfg, l)?),
            MixerKind::Mla => Mixer::Mla(mla::MlaWeights::load(src, cfg, l)?),
        })
    }

    /// Mixes `n` tokens of `h` (normed, (n, hidden)) at the next positions of `state`,
    /// writing (n, hidden) to `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        m: &Model,
        l: usize,
        h: &[f32],
        n: usize,
        state: &mut SeqState,
        out: &mut [f32],
        obs: &mut Option<&mut dyn Observer>,
    ) {
        match self {
            Mixer::Attention(w) => attention::forward(m, l, w, h, n, state, out, obs),
            Mixer::GatedDeltaNet(w) => delta_net::forward(m, l, w, h, n, state, out, obs),
            Mixer::Mla(w) => mla::forward(m, l, w, h, n, state, out, obs),
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            Mixer::Attention(w) => w.bytes(),
            Mixer::GatedDeltaNet(w) => w.bytes(),
            Mixer::Mla(w) => w.bytes(),
        }
    }
}
