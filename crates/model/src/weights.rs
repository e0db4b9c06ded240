//! Logical tensor names, the `TensorSource` seam between file formats and the model, and the
//! resident weight types the forward pass holds.

use crate::error::{ModelError, Result};
use sluice_formats::safetensors::TensorData;
use sluice_kernels::{DType, MatRef};

/// A tensor's role in the model, independent of how a format names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    TokEmbd,
    OutputNorm,
    Output,
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnO,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    AttnOBias,
    AttnQNorm,
    AttnKNorm,
    /// Gemma's norm after attention, before the residual add.
    AttnPostNorm,
    FfnNorm,
    FfnPostNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    /// The router: n_expert × hidden.
    FfnGateInp,
    ShexpGate,
    ShexpUp,
    ShexpDown,
    /// The shared expert's sigmoid gate: 1 × hidden.
    ShexpGateInp,
    // Gated DeltaNet (the checkpoint's own vocabulary in comments: HF `linear_attn.*`, GGUF).
    /// HF Qwen3-Next `in_proj_qkvz`: q, k, v, z interleaved per key head.
    SsmQkvz,
    /// `in_proj_qkv` / `attn_qkv`: [q | k | v].
    SsmQkv,
    /// `in_proj_z` / `attn_gate`: the output gate z.
    SsmZ,
    /// `in_proj_ba` / `ssm_ba`: b and a interleaved per key head.
    SsmBa,
    /// `in_proj_b` / `ssm_beta`.
    SsmBeta,
    /// `in_proj_a` / `ssm_alpha`.
    SsmAlpha,
    /// `conv1d.weight` / `ssm_conv1d`: (conv_dim, kernel).
    SsmConv1d,
    /// `dt_bias` / `ssm_dt.bias`.
    SsmDtBias,
    /// HF `A_log` (the decay's log-magnitude).
    SsmALog,
    /// GGUF `ssm_a` = −exp(A_log).
    SsmA,
    /// `norm.weight` / `ssm_norm`: the gated RMSNorm's scale (d_v), never offset by 1.
    SsmNorm,
    /// `out_proj` / `ssm_out`: (hidden, value_dim).
    SsmOut,
    // Latent attention (HF names `self_attn.*`; GGUF `attn_*`).
    /// q's down projection (q_a_proj): (q_lora_rank, hidden).
    AttnQA,
    /// Its norm (q_a_layernorm).
    AttnQANorm,
    /// q's up projection (q_b_proj): (heads·(nope + rope), q_lora_rank).
    AttnQB,
    /// kv_a_proj_with_mqa: (kv_lora_rank + rope, hidden): the latent, then the shared rope key.
    AttnKvAMqa,
    /// kv_a_layernorm: (kv_lora_rank).
    AttnKvANorm,
    /// HF kv_b_proj: (heads·(nope + v), kv_lora_rank), per head its nope-key rows then value rows.
    AttnKvB,
    /// GGUF attn_k_b: per head the key half of kv_b transposed, (heads, kv_lora_rank, nope).
    AttnKB,
    /// GGUF attn_v_b: per head the value half of kv_b, (heads, v, kv_lora_rank).
    AttnVB,
    /// Per-head sink logits (gpt-oss): (heads).
    AttnSinks,
    /// The router's bias (gpt-oss): (n_expert).
    FfnGateInpBias,
    /// The router's correction bias, for choosing experts only: (n_expert).
    FfnExpProbsB,
    /// Expert biases, every expert's together: gate and up (n_expert, ff), down (n_expert, hidden).
    /// HF gpt-oss keeps gate and up interleaved in one `gate_up_proj_bias` (n_expert, 2·ff).
    FfnGateExpsBias,
    FfnUpExpsBias,
    FfnDownExpsBias,
    // Multi-token prediction head (its decoder layer uses the per-layer keys at layer n_layer).
    /// Projection of [embedding | hidden] to hidden: (hidden, 2·hidden).
    MtpEhProj,
    /// Norm of the next token's embedding.
    MtpEnorm,
    /// Norm of the hidden state.
    MtpHnorm,
    /// Final norm before the shared output head.
    MtpNorm,
}

/// One of an expert's three matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertPart {
    Gate,
    Up,
    Down,
}

impl ExpertPart {
    pub const ALL: [ExpertPart; 3] = [ExpertPart::Gate, ExpertPart::Up, ExpertPart::Down];
}

/// Where a format keeps its tensors. Implemented for Hugging Face safetensors and GGUF.
pub trait TensorSource {
    /// The file or directory, for messages.
    fn describe(&self) -> String;
    /// The tensor for `key` (of `layer` for per-layer keys); `Ok(None)` when the file has none.
    fn get(&self, key: Key, layer: Option<usize>) -> Result<Option<TensorData>>;
    /// One expert's matrix, shaped rows × cols like any other weight.
    fn expert(&self, part: ExpertPart, layer: usize, expert: usize) -> Result<TensorData>;

    /// Bytes of that matrix as the kernels take it. Sources that must rewrite an expert to
    /// produce it say so without doing the work.
    fn expert_bytes(&self, part: ExpertPart, layer: usize, expert: usize) -> Result<u64> {
        Ok(self.expert(part, layer, expert)?.data.len() as u64)
    }

    fn require(&self, key: Key, layer: Option<usize>) -> Result<TensorData> {
        self.get(key, layer)?.ok_or_else(|| {
            let at = layer.map(|l| format!(" of layer {l}")).unwrap_or_default();
            ModelError::Invalid(format!("{}: missing tensor {key:?}{at}", self.describe()))
        })
    }
}

/// A projection with an optional bias (`Model::linear` computes it).
pub struct Linear {
    pub w: Weight,
    pub b: Option<Vec<f32>>,
}

/// An RMSNorm weight as the forward pass uses it: `1 + w` when the checkpoint stores norms
/// zero-centred (`ModelConfig::norm_plus_one`), `w` otherwise.
pub fn norm(
    src: &dyn TensorSource,
    cfg: &crate::config::ModelConfig,
    key: Key,
    layer: Option<usize>,
    len: usize,
) -> Result<Vec<f32>> {
    let mut w = vector(src.require(key, layer)?, len)?;
    if cfg.norm_plus_one {
        w.iter_mut().for_each(|v| *v += 1.0);
    }
    Ok(w)
}

/// Finds an MXFP4 scale the format leaves undefined: E8M0 exponent 0xFF is its NaN, and no
/// weight has it. `data` holds rows of `cols` values in GGUF's blocks (scale byte first).
pub fn mxfp4_scale_check(data: &[u8], cols: usize) -> Option<String> {
    // Sixteen blocks a branch (a streamed expert is scanned as it lands), then the first one.
    let mut from = 0;
    for group in data.chunks_exact(17 * 16) {
        if (0..16).fold(false, |any, i| any | (group[17 * i] == 0xFF)) {
            break;
        }
        from += 16;
    }
    let b = from + data[17 * from..].chunks_exact(17).position(|blk| blk[0] == 0xFF)?;
    let per_row = (cols / 32).max(1);
    Some(format!(
        "MXFP4 block {} of row {} has scale exponent 0xFF, which the format leaves undefined (NaN)",
        b % per_row,
        b / per_row
    ))
}

/// A resident weight matrix in its stored format.
#[derive(Clone, Debug)]
pub struct Weight {
    pub name: String,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: sluice_formats::Blob,
}

impl Weight {
    /// Checks a tensor against the expected `rows × cols` and that a kernel can use it.
    pub fn from_tensor(t: TensorData, rows: usize, cols: usize) -> Result<Weight> {
        let origin = t.file.display();
        let ok = match t.shape.as_slice() {
            [r, c] => *r == rows && *c == cols,
            [c] => rows == 1 && *c == cols,
            _ => false,
        };
        if !ok {
            return Err(ModelError::Invalid(format!(
                "{origin}: tensor `{}` has shape {:?}, expected [{rows}, {cols}]",
                t.name, t.shape
            )));
        }
        MatRef::new(t.dtype, rows, cols, &t.data)
            .map_err(|e| ModelError::Invalid(format!("{origin}: tensor `{}`: {e}", t.name)))?;
        if t.dtype == DType::MXFP4 {
            if let Some(msg) = mxfp4_scale_check(&t.data, cols) {
                return Err(ModelError::Invalid(format!("{origin}: tensor `{}`: {msg}", t.name)));
            }
        }
        Ok(Weight { name: t.name, dtype: t.dtype, rows, cols, data: t.data })
    }

    pub fn mat(&self) -> MatRef<'_> {
        MatRef { dtype: self.dtype, rows: self.rows, cols: self.cols, data: &self.data }
    }

    pub fn bytes(&self) -> usize {
        self.data.len()
    }
}

/// A small vector (norm weight, bias) widened to f32: a few KB per layer.
pub fn vector(t: TensorData, len: usize) -> Result<Vec<f32>> {
    let origin = t.file.display();
    let n: usize = t.shape.iter().product();
    if n != len || t.shape.len() > 2 {
        return Err(ModelError::Invalid(format!(
            "{origin}: tensor `{}` has shape {:?}, expected [{len}]",
            t.name, t.shape
        )));
    }
    let mut out = vec![0f32; len];
    sluice_kernels::quant::dequantize_row(t.dtype, &t.data, &mut out)
        .map_err(|e| ModelError::Invalid(format!("{origin}: tensor `{}`: {e}", t.name)))?;
    Ok(out)
}

/// `out` = row `r` of an embedding table, widened to f32.
pub fn embedding_row(w: &Weight, r: usize, out: &mut [f32]) {
    let m = w.mat();
    sluice_kernels::quant::dequantize_row(w.dtype, m.row(r), out).expect("validated at load");
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_formats::Blob;

    #[test]
    fn an_mxfp4_scale_of_0xff_is_found_wherever_it_is() {
        // 3 rows of 96 values (3 blocks a row) beyond sixteen-block groups: 37 blocks.
        let (cols, blocks) = (96, 37);
        let mut data = vec![0x7Fu8; blocks * 17];
        for b in 0..blocks {
            data[b * 17 + 1..b * 17 + 17].fill(0xFF); // codes may be anything
        }
        assert_eq!(mxfp4_scale_check(&data, cols), None);
        for bad in [0, 15, 16, 31, 32, 36] {
            let mut d = data.clone();
            d[bad * 17] = 0xFF;
            // A later one too: the first is named.
            d[36 * 17] = 0xFF;
            let m = mxfp4_scale_check(&d, cols).unwrap();
            assert!(m.starts_with(&format!("MXFP4 block {} of row {} ", bad % 3, bad / 3)), "{bad}: {m}");
        }
    }

    fn tensor(name: &str, dtype: DType, shape: Vec<usize>, bytes: usize) -> TensorData {
        TensorData {
            name: name.into(),
            file: "model.gguf".into(),
            dtype,
            shape,
            data: Blob::from_vec(vec![0u8; bytes]),
        }
    }

    #[test]
    fn a_block_quantized_tensor_of_the_wrong_size_is_an_error_naming_it() {
        // Every block format, the IQ formats included, goes through MatRef::new's size check.
        for dtype in DType::ALL.into_iter().filter(|d| !d.is_float() && sluice_kernels::supports_matmul(*d)) {
            let (rows, cols) = (3, 2 * 256);
            let need = rows * dtype.row_bytes(cols).unwrap();
            assert!(
                Weight::from_tensor(tensor("blk.0.ffn_down.weight", dtype, vec![rows, cols], need), rows, cols).is_ok()
            );
            for bytes in [need - 1, need + dtype.block_bytes(), 0] {
                let e =
                    Weight::from_tensor(tensor("blk.0.ffn_down.weight", dtype, vec![rows, cols], bytes), rows, cols)
                        .unwrap_err()
                        .to_string();
                assert!(
                    e.contains("`blk.0.ffn_down.weight`") && e.contains(&format!("needs {need} bytes")),
                    "{dtype}: {e}"
                );
            }
            // Rows that are not whole blocks.
            let cols = 2 * 256 + 32 * (dtype.block_elems() / 64);
            if cols % dtype.block_elems() != 0 {
                let e = Weight::from_tensor(tensor("blk.1.attn_q.weight", dtype, vec![1, cols], 4096), 1, cols)
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("`blk.1.attn_q.weight`") && e.contains("whole number of blocks"), "{dtype}: {e}");
            }
        }
    }
}
