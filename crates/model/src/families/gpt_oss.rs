//! gpt-oss (gpt-oss-20b, gpt-oss-120b; GGUF `gpt-oss`): attention with q/k/v/o biases and a
//! learned sink logit per head, sliding-window (128) layers alternating with full ones (the
//! even layers slide), YaRN rope; every layer routed: a router with a bias, the top k of its
//! raw logits softmaxed, experts with biases and a clamped SwiGLU
//! (`min(g, limit)·σ(α·min(g, limit))·(clamp(u, ±limit) + 1)`).
//!
//! Hugging Face keeps each layer's experts fused and input-major — `gate_up_proj` (experts,
//! hidden, 2·ff) with gate and up in alternate columns, `down_proj` (experts, ff, hidden) —
//! or, as published, in MXFP4: `*_blocks` (experts, rows, groups, 16 bytes, two codes a byte)
//! with E8M0 `*_scales` (experts, rows, groups), gate and up in alternate rows. An expert is
//! one slice of each fused tensor (`FusedExpert`), which the resident loader and the
//! streaming store both turn into the kernels' matrices the same way: floats transposed,
//! MXFP4 repacked (not dequantized) into GGUF's MXFP4 blocks.

use crate::config::{Activation, Arch, FfnKind, Gating, LayerSpec, MixerKind, ModelConfig, MoeConfig};
use crate::error::{ModelError, Result};
use crate::weights::ExpertPart;
use sluice_formats::gguf::GgufFile;
use sluice_formats::safetensors::{SafetensorsModel, TensorData};
use sluice_formats::{Blob, JsonConfig};
use sluice_kernels::DType;
use std::path::PathBuf;

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

/// A gpt-oss expert as Hugging Face stores it: where its bytes lie in the layer's fused
/// tensors, and how they become the three matrices the kernels take. The resident loader and
/// the streaming store both go through `reform`, so both hand the kernels the same bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedExpert {
    pub layer: usize,
    pub expert: usize,
    /// The byte ranges to read, in order. MXFP4: gate_up blocks, gate_up scales, down blocks,
    /// down scales; floats: gate_up, down.
    pub sources: Vec<FileRange>,
    pub form: FusedForm,
    pub hidden: usize,
    pub ff: usize,
    /// The fused tensors' base names (gate_up, down), for messages.
    names: [String; 2],
}

/// A byte range of one of the checkpoint's files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileRange {
    pub file: PathBuf,
    /// Absolute offset in the file.
    pub offset: u64,
    pub len: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedForm {
    /// `*_blocks` (experts, rows, groups, 16) with E8M0 `*_scales` (experts, rows, groups);
    /// gate and up in alternate rows. Repacked (not dequantized) into GGUF's MXFP4 blocks.
    Mxfp4,
    /// Input-major floats: `gate_up_proj` (experts, hidden, 2·ff) with gate and up in
    /// alternate columns, `down_proj` (experts, ff, hidden). Transposed.
    Float(DType),
}

impl FusedExpert {
    /// Where expert `e` of layer `l` lies in `st`, after checking the fused tensors' shapes
    /// against the model's `hidden` and expert width `ff`.
    pub fn locate(st: &SafetensorsModel, prefix: &str, l: usize, e: usize, hidden: usize, ff: usize) -> Result<Self> {
        let names = [
            format!("{prefix}layers.{l}.mlp.experts.gate_up_proj"),
            format!("{prefix}layers.{l}.mlp.experts.down_proj"),
        ];
        let mut sources = Vec::new();
        // Expert `e`'s slice of a tensor whose first dimension counts experts.
        let mut slice = |name: &str, dtypes: &[&str], want: &[usize]| -> Result<()> {
            let info = st.info(name).ok_or_else(|| invalid(st, format!("missing tensor `{name}`")))?;
            if !dtypes.contains(&info.dtype.as_str()) {
                return Err(invalid(st, format!("`{name}` is {}, expected one of {dtypes:?}", info.dtype)));
            }
            if info.shape.len() != want.len() + 1 || info.shape[1..] != *want {
                return Err(invalid(
                    st,
                    format!("`{name}` has shape {:?}, expected (experts, {})", info.shape, dims(want)),
                ));
            }
            let n_exp = info.shape[0];
            if e >= n_exp {
                return Err(invalid(st, format!("`{name}` holds {n_exp} experts; expert {e} asked for")));
            }
            let len = ((info.end - info.start) / n_exp) as u64;
            let file = st.file_of(name).expect("info found it").to_path_buf();
            sources.push(FileRange { file, offset: info.start as u64 + e as u64 * len, len });
            Ok(())
        };
        let form = if st.contains(&format!("{}_blocks", names[0])) {
            for (base, [rows, cols]) in names.iter().zip([[2 * ff, hidden], [hidden, ff]]) {
                if cols % 32 != 0 {
                    return Err(invalid(
                        st,
                        format!("`{base}_blocks`: rows of {cols} values are not whole MXFP4 blocks"),
                    ));
                }
                slice(&format!("{base}_blocks"), &["U8"], &[rows, cols / 32, 16])?;
                slice(&format!("{base}_scales"), &["U8"], &[rows, cols / 32])?;
            }
            FusedForm::Mxfp4
        } else {
            let info = st.info(&names[0]).ok_or_else(|| invalid(st, format!("missing tensor `{}`", names[0])))?;
            let dtype = match info.dtype.as_str() {
                "F32" => DType::F32,
                "F16" => DType::F16,
                "BF16" => DType::BF16,
                d => return Err(invalid(st, format!("`{}` is {d}; expected F32, F16 or BF16", names[0]))),
            };
            slice(&names[0], &[&info.dtype.clone()], &[hidden, 2 * ff])?;
            slice(&names[1], &[&info.dtype.clone()], &[ff, hidden])?;
            FusedForm::Float(dtype)
        };
        Ok(FusedExpert { layer: l, expert: e, sources, form, hidden, ff, names })
    }

    /// The kernels' form of `part`: (dtype, rows, cols).
    pub fn shape(&self, part: ExpertPart) -> (DType, usize, usize) {
        let dtype = match self.form {
            FusedForm::Mxfp4 => DType::MXFP4,
            FusedForm::Float(d) => d,
        };
        match part {
            ExpertPart::Down => (dtype, self.hidden, self.ff),
            _ => (dtype, self.ff, self.hidden),
        }
    }

    /// Bytes of `part` in the kernels' form.
    pub fn bytes(&self, part: ExpertPart) -> usize {
        let (dtype, rows, cols) = self.shape(part);
        dtype.row_bytes(cols).expect("checked at locate") * rows
    }

    /// Writes `part` in the kernels' form into `out` (`bytes(part)` long) from the bytes of
    /// `sources` (`raw[i]` holds `sources[i]`). Fails on an MXFP4 scale the format leaves
    /// undefined, naming where it is.
    pub fn reform(&self, part: ExpertPart, raw: &[&[u8]], out: &mut [u8]) -> std::result::Result<(), String> {
        assert_eq!(raw.len(), self.sources.len());
        assert_eq!(out.len(), self.bytes(part));
        // Output row r is stored row `r * step + first` (gate and up alternate).
        let (step, first) = match part {
            ExpertPart::Gate => (2, 0),
            ExpertPart::Up => (2, 1),
            ExpertPart::Down => (1, 0),
        };
        let down = part == ExpertPart::Down;
        let (_, rows, cols) = self.shape(part);
        match self.form {
            FusedForm::Mxfp4 => {
                let (blocks, scales) = if down { (raw[2], raw[3]) } else { (raw[0], raw[1]) };
                let groups = cols / 32;
                for r in 0..rows {
                    let src_row = r * step + first;
                    for g in 0..groups {
                        let scale = scales[src_row * groups + g];
                        if scale == 0xFF {
                            return Err(format!(
                                "`{}_scales`: expert {} row {src_row} block {g} has scale 0xFF, which MXFP4 does not define",
                                self.names[down as usize], self.expert
                            ));
                        }
                        let src: &[u8; 16] = blocks[(src_row * groups + g) * 16..][..16].try_into().expect("16");
                        let dst = &mut out[(r * groups + g) * 17..][..17];
                        dst[0] = scale;
                        // Stored: codes 2i and 2i+1 in byte i (low, high). GGUF: codes j and
                        // j+16 in byte j. So byte 2i takes the low nibbles of bytes i and
                        // 8+i, byte 2i+1 their high nibbles.
                        for i in 0..8 {
                            let (a, b) = (src[i], src[8 + i]);
                            dst[1 + 2 * i] = (a & 0x0F) | (b << 4);
                            dst[2 + 2 * i] = (a >> 4) | (b & 0xF0);
                        }
                    }
                }
            }
            FusedForm::Float(dtype) => {
                let size = dtype.row_bytes(1).expect("a float");
                let src = if down { raw[1] } else { raw[0] };
                // Stored (cols, stored_cols): output (r, c) is stored (c, r * step + first).
                let stored_cols = rows * step;
                for c in 0..cols {
                    let row = &src[c * stored_cols * size..][..stored_cols * size];
                    for r in 0..rows {
                        let s = (r * step + first) * size;
                        let d = (r * cols + c) * size;
                        out[d..d + size].copy_from_slice(&row[s..s + size]);
                    }
                }
            }
        }
        Ok(())
    }
}

fn dims(d: &[usize]) -> String {
    d.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

/// Expert `e`'s `part` of layer `l`, rows × cols like any weight (gate, up: (ff, hidden);
/// down: (hidden, ff)), cut out of the fused tensors.
pub fn hf_expert(st: &SafetensorsModel, fused: &FusedExpert, part: ExpertPart) -> Result<TensorData> {
    let raw: Vec<Blob> = fused
        .sources
        .iter()
        .map(|r| {
            let f = st.files.iter().find(|f| f.path == r.file).expect("located in this checkpoint");
            f.range(r.offset as usize, r.len as usize)
        })
        .collect();
    let slices: Vec<&[u8]> = raw.iter().map(|b| &b[..]).collect();
    let mut out = vec![0u8; fused.bytes(part)];
    fused.reform(part, &slices, &mut out).map_err(|m| invalid(st, m))?;
    let (dtype, rows, cols) = fused.shape(part);
    Ok(TensorData {
        name: format!("{}[{}].{part:?}", fused.names[(part == ExpertPart::Down) as usize], fused.expert),
        file: fused.sources[0].file.clone(),
        dtype,
        shape: vec![rows, cols],
        data: Blob::from_vec(out),
    })
}

fn invalid(st: &SafetensorsModel, msg: String) -> ModelError {
    ModelError::Invalid(format!("{}: {msg}", st.dir.display()))
}
