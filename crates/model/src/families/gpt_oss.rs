//! gpt-oss (gpt-oss-20b, gpt-oss-120b; GGUF `gpt-oss`): attention with q/k/v/o biases and a
//! learned sink logit per head, sliding-window (128) layers alternating with full ones (the
//! even layers slide), YaRN rope; every layer routed: a router with a bias, the top k of its
//! raw logits softmaxed, experts with biases and a clamped SwiGLU
//! (`min(g, limit)·σ(α·min(g, limit))·(clamp(u, ±limit) + 1)`).
//!
//! Hugging Face keeps each layer's experts fused and input-major — `gate_up_proj` (experts,
//! hidden, 2·ff) with gate and up in alternate columns, `down_proj` (experts, ff, hidden) —
//! or, as published, in MXFP4: `*_blocks` (experts, rows, groups, 16 bytes, two codes a byte)
//! with E8M0 `*_scales` (experts, rows, groups), gate and up in alternate rows. An expert's
//! matrices are cut out of those here: floats transposed, MXFP4 repacked (not dequantized)
//! into GGUF's MXFP4 blocks, which the kernels compute on.

use crate::config::{Activation, Arch, FfnKind, Gating, LayerSpec, MixerKind, ModelConfig, MoeConfig};
use crate::error::{ModelError, Result};
use crate::weights::ExpertPart;
use sluice_formats::gguf::GgufFile;
use sluice_formats::safetensors::{SafetensorsModel, TensorData};
use sluice_formats::{Blob, JsonConfig};
use sluice_kernels::DType;

/// The clamped SwiGLU's constants when a config does not name them.
const ALPHA: f32 = 1.702;
const LIMIT: f32 = 7.0;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::GptOss)?;
    cfg.qkv_bias = c.opt_bool("attention_bias")?.unwrap_or(true);
    cfg.attn_sinks = true;
    cfg.activation = Activation::SwigluOai {
        alpha: c.opt_f64("swiglu_alpha")?.unwrap_or(ALPHA as f64) as f32,
        limit: c.opt_f64("swiglu_limit")?.unwrap_or(LIMIT as f64) as f32,
    };
    let n_expert = super::n_expert(c)?;
    cfg.moe = Some(MoeConfig {
        n_expert,
        n_expert_used: c.usize("num_experts_per_tok")?,
        // `intermediate_size` is one expert's width.
        expert_ff: c.usize("intermediate_size")?,
        gating: Gating::TopKSoftmax,
        router_bias: true,
        expert_bias: true,
        ..MoeConfig::PLAIN
    });
    cfg.ff = 0;
    // Without `layer_types` the reference alternates, sliding on even layers.
    let window = c.opt_usize("sliding_window")?.filter(|w| *w > 0);
    let has_types = c.get("layer_types").is_some();
    for (l, spec) in cfg.layers.iter_mut().enumerate() {
        spec.ffn = FfnKind::Moe;
        if !has_types {
            spec.mixer = MixerKind::Attention { window: window.filter(|_| l % 2 == 0) };
        }
    }
    Ok(cfg)
}

/// What a `gpt-oss` GGUF adds to the common reading. llama.cpp's converter writes no layer
/// pattern (its loader slides on even layers), no SwiGLU constants (fixed at 1.702 and 7) and
/// no YaRN truncation flag. llama.cpp always rounds YaRN's correction range to whole
/// dimensions; the model's reference implementation (and transformers, `truncate: false`)
/// does not, which moves the frequencies of the dimensions in between — sluice follows the
/// reference.
pub fn gguf(f: &GgufFile, key: &dyn Fn(&str) -> String, cfg: &mut ModelConfig) -> Result<()> {
    if let crate::rope::RopeScaling::Yarn { truncate, .. } = &mut cfg.rope.scaling {
        *truncate = false;
    }
    let window = f.meta_opt_u64(&key("attention.sliding_window"))?.map(|w| w as usize).filter(|w| *w > 0);
    cfg.layers = (0..cfg.n_layer)
        .map(|l| LayerSpec { mixer: MixerKind::Attention { window: window.filter(|_| l % 2 == 0) }, ffn: FfnKind::Moe })
        .collect();
    cfg.attn_sinks = true;
    cfg.activation = Activation::SwigluOai { alpha: ALPHA, limit: LIMIT };
    let moe = cfg.moe.as_mut().ok_or_else(|| f.error("a gpt-oss file without expert_count"))?;
    moe.gating = Gating::TopKSoftmax;
    moe.router_bias = true;
    moe.expert_bias = true;
    Ok(())
}

/// The Hugging Face tensor names of layer `l`'s experts: (gate_up, down) as floats, or with
/// `_blocks`/`_scales` suffixes in MXFP4.
fn fused_names(prefix: &str, l: usize) -> (String, String) {
    (format!("{prefix}layers.{l}.mlp.experts.gate_up_proj"), format!("{prefix}layers.{l}.mlp.experts.down_proj"))
}

/// Expert `e`'s `part` of layer `l`, rows × cols like any weight (gate, up: (ff, hidden);
/// down: (hidden, ff)), cut out of the fused tensors.
pub fn hf_expert(st: &SafetensorsModel, prefix: &str, part: ExpertPart, l: usize, e: usize) -> Result<TensorData> {
    let (gate_up, down) = fused_names(prefix, l);
    let base = if part == ExpertPart::Down { down } else { gate_up };
    if st.contains(&format!("{base}_blocks")) {
        mxfp4_expert(st, &base, part, e)
    } else {
        float_expert(st, &base, part, e)
    }
}

fn invalid(st: &SafetensorsModel, msg: String) -> ModelError {
    ModelError::Invalid(format!("{}: {msg}", st.dir.display()))
}

/// Floats, input-major: gate/up are alternate columns of (hidden, 2·ff); down is (ff, hidden).
fn float_expert(st: &SafetensorsModel, name: &str, part: ExpertPart, e: usize) -> Result<TensorData> {
    let t = st.tensor(name)?;
    let [ne, rows_in, cols_in] = match t.shape.as_slice() {
        [a, b, c] => [*a, *b, *c],
        s => return Err(invalid(st, format!("`{name}` has shape {s:?}, expected (experts, in, out)"))),
    };
    if e >= ne {
        return Err(invalid(st, format!("`{name}` holds {ne} experts; expert {e} asked for")));
    }
    let size = if t.dtype == DType::F32 { 4 } else { 2 };
    // Output matrix (rows = out features, cols = in features), taking every `step`-th
    // column of the stored (in, out) matrix from `first`.
    let (step, first) = match part {
        ExpertPart::Gate => (2, 0),
        ExpertPart::Up => (2, 1),
        ExpertPart::Down => (1, 0),
    };
    if step == 2 && cols_in % 2 != 0 {
        return Err(invalid(st, format!("`{name}` has an odd number of gate/up columns ({cols_in})")));
    }
    let rows = cols_in / step;
    let cols = rows_in;
    let src = &t.data[e * rows_in * cols_in * size..(e + 1) * rows_in * cols_in * size];
    let mut out = vec![0u8; rows * cols * size];
    for i in 0..cols {
        for r in 0..rows {
            let s = (i * cols_in + r * step + first) * size;
            let d = (r * cols + i) * size;
            out[d..d + size].copy_from_slice(&src[s..s + size]);
        }
    }
    Ok(TensorData {
        name: format!("{name}[{e}].{part:?}"),
        file: t.file,
        dtype: t.dtype,
        shape: vec![rows, cols],
        data: Blob::from_vec(out),
    })
}

/// MXFP4: rows are output rows (gate and up alternate in gate_up), each `groups` blocks of 32
/// codes (16 bytes, element 2i in byte i's low nibble, 2i+1 in its high one) with one E8M0
/// scale byte apiece. GGUF's block puts the scale first and element j, j+16 in byte j's low
/// and high nibbles.
fn mxfp4_expert(st: &SafetensorsModel, base: &str, part: ExpertPart, e: usize) -> Result<TensorData> {
    let (bname, sname) = (format!("{base}_blocks"), format!("{base}_scales"));
    let (blocks, binfo) = st.raw(&bname)?;
    let (scales, sinfo) = st.raw(&sname)?;
    if binfo.dtype != "U8" || sinfo.dtype != "U8" {
        return Err(invalid(st, format!("`{bname}`/`{sname}` must be U8, found {}/{}", binfo.dtype, sinfo.dtype)));
    }
    let [ne, rows_all, groups, sixteen] = match binfo.shape.as_slice() {
        [a, b, c, d] => [*a, *b, *c, *d],
        s => return Err(invalid(st, format!("`{bname}` has shape {s:?}, expected (experts, rows, groups, 16)"))),
    };
    if sixteen != 16 || sinfo.shape != [ne, rows_all, groups] {
        return Err(invalid(
            st,
            format!("`{bname}` {:?} and `{sname}` {:?} do not describe MXFP4 blocks", binfo.shape, sinfo.shape),
        ));
    }
    if e >= ne {
        return Err(invalid(st, format!("`{bname}` holds {ne} experts; expert {e} asked for")));
    }
    let (step, first) = match part {
        ExpertPart::Gate => (2, 0),
        ExpertPart::Up => (2, 1),
        ExpertPart::Down => (1, 0),
    };
    let rows = rows_all / step;
    let mut out = vec![0u8; rows * groups * 17];
    for r in 0..rows {
        let src_row = e * rows_all + r * step + first;
        for g in 0..groups {
            let scale = scales[src_row * groups + g];
            if scale == 0xFF {
                return Err(invalid(
                    st,
                    format!(
                        "`{sname}`: expert {e} row {src_row} block {g} has scale 0xFF, which MXFP4 does not define"
                    ),
                ));
            }
            let src = &blocks[(src_row * groups + g) * 16..][..16];
            let dst = &mut out[(r * groups + g) * 17..][..17];
            dst[0] = scale;
            let code = |k: usize| if k & 1 == 0 { src[k / 2] & 0xF } else { src[k / 2] >> 4 };
            for j in 0..16 {
                dst[1 + j] = code(j) | (code(j + 16) << 4);
            }
        }
    }
    Ok(TensorData {
        name: format!("{base}[{e}].{part:?}"),
        file: st.file_of(&bname).expect("found").to_path_buf(),
        dtype: DType::MXFP4,
        shape: vec![rows, groups * 32],
        data: Blob::from_vec(out),
    })
}
