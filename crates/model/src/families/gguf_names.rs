//! GGUF's tensor names (`blk.N.attn_q.weight` ...), shared by every architecture.

use crate::config::Arch;
use crate::weights::{ExpertPart, Key};

/// The GGUF name of `key`, or `None` where the architecture has no such tensor.
pub fn name(arch: Arch, key: Key, layer: Option<usize>) -> Option<String> {
    // These conversions file the pre-FFN norm (HF post_attention_layernorm) under
    // `post_attention_norm`, so they have no separate post-attention norm.
    let post_as_ffn = matches!(arch, Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe | Arch::GptOss | Arch::Glm4Moe);
    if post_as_ffn && key == Key::AttnPostNorm {
        return None;
    }
    Some(name_of(post_as_ffn, key, layer))
}

fn name_of(post_as_ffn: bool, key: Key, layer: Option<usize>) -> String {
    let l = layer.unwrap_or(0);
    let b = |s: &str| format!("blk.{l}.{s}");
    match key {
        Key::TokEmbd => "token_embd.weight".into(),
        Key::OutputNorm => "output_norm.weight".into(),
        Key::Output => "output.weight".into(),
        Key::AttnNorm => b("attn_norm.weight"),
        Key::AttnQ => b("attn_q.weight"),
        Key::AttnK => b("attn_k.weight"),
        Key::AttnV => b("attn_v.weight"),
        Key::AttnO => b("attn_output.weight"),
        Key::AttnQBias => b("attn_q.bias"),
        Key::AttnKBias => b("attn_k.bias"),
        Key::AttnVBias => b("attn_v.bias"),
        Key::AttnOBias => b("attn_output.bias"),
        Key::AttnQNorm => b("attn_q_norm.weight"),
        Key::AttnKNorm => b("attn_k_norm.weight"),
        Key::AttnPostNorm => b("post_attention_norm.weight"),
        // The hybrid Qwen conversions file the pre-FFN norm under its HF name's kind.
        Key::FfnNorm if post_as_ffn => b("post_attention_norm.weight"),
        Key::FfnNorm => b("ffn_norm.weight"),
        Key::FfnPostNorm => b("post_ffw_norm.weight"),
        Key::FfnGate => b("ffn_gate.weight"),
        Key::FfnUp => b("ffn_up.weight"),
        Key::FfnDown => b("ffn_down.weight"),
        Key::FfnGateInp => b("ffn_gate_inp.weight"),
        Key::ShexpGate => b("ffn_gate_shexp.weight"),
        Key::ShexpUp => b("ffn_up_shexp.weight"),
        Key::ShexpDown => b("ffn_down_shexp.weight"),
        Key::ShexpGateInp => b("ffn_gate_inp_shexp.weight"),
        Key::SsmQkvz => b("ssm_in.weight"),
        Key::SsmQkv => b("attn_qkv.weight"),
        Key::SsmZ => b("attn_gate.weight"),
        Key::SsmBa => b("ssm_ba.weight"),
        Key::SsmBeta => b("ssm_beta.weight"),
        Key::SsmAlpha => b("ssm_alpha.weight"),
        Key::SsmConv1d => b("ssm_conv1d.weight"),
        Key::SsmDtBias => b("ssm_dt.bias"),
        // GGUF stores A = −exp(A_log) under `ssm_a` (no `.weight`); it has no A_log.
        Key::SsmA => b("ssm_a"),
        Key::SsmALog => b("ssm_a_log"),
        Key::SsmNorm => b("ssm_norm.weight"),
        Key::SsmOut => b("ssm_out.weight"),
        Key::AttnQA => b("attn_q_a.weight"),
        Key::AttnQANorm => b("attn_q_a_norm.weight"),
        Key::AttnQB => b("attn_q_b.weight"),
        Key::AttnKvAMqa => b("attn_kv_a_mqa.weight"),
        Key::AttnKvANorm => b("attn_kv_a_norm.weight"),
        Key::AttnKvB => b("attn_kv_b.weight"),
        Key::AttnKB => b("attn_k_b.weight"),
        Key::AttnVB => b("attn_v_b.weight"),
        Key::AttnSinks => b("attn_sinks.weight"),
        Key::FfnGateInpBias => b("ffn_gate_inp.bias"),
        Key::FfnExpProbsB => b("exp_probs_b.bias"),
        Key::FfnGateExpsBias => b("ffn_gate_exps.bias"),
        Key::FfnUpExpsBias => b("ffn_up_exps.bias"),
        Key::FfnDownExpsBias => b("ffn_down_exps.bias"),
        Key::MtpEhProj => b("nextn.eh_proj.weight"),
        Key::MtpEnorm => b("nextn.enorm.weight"),
        Key::MtpHnorm => b("nextn.hnorm.weight"),
        Key::MtpNorm => b("nextn.shared_head_norm.weight"),
    }
}

/// The stacked 3-D tensor holding every expert's `part` of layer `l`.
pub fn experts(part: ExpertPart, l: usize) -> String {
    match part {
        ExpertPart::Gate => format!("blk.{l}.ffn_gate_exps.weight"),
        ExpertPart::Up => format!("blk.{l}.ffn_up_exps.weight"),
        ExpertPart::Down => format!("blk.{l}.ffn_down_exps.weight"),
    }
}
