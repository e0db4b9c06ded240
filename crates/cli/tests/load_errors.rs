//! Every way a checkpoint can be broken ends in a one-line error that names the file and the
//! problem, never a panic.

use std::path::{Path, PathBuf};
use std::process::Command;

fn golden(fam: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(fam)
}

/// A scratch copy of a golden model directory.
fn copy_model(fam: &str, tag: &str) -> PathBuf {
    let dst = sluice_formats::scratch_root().join(format!("sluice-err-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(golden(fam)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

/// Runs `sluice logits` on `model`; returns stderr, asserting a clean failure.
fn fails(model: &Path) -> String {
    fails_with(model, &[])
}

/// `fails` with more arguments.
fn fails_with(model: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["logits", "--model"])
        .arg(model)
        .args(["--tokens", "5,6,7"])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "expected exit 1, stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    err
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Rewrites a safetensors header in place, keeping the data section.
fn edit_header(file: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(h.as_object_mut().unwrap());
    let mut hb = serde_json::to_vec(&h).unwrap();
    while !hb.len().is_multiple_of(8) {
        hb.push(b' ');
    }
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&hb);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(file, out).unwrap();
}

/// Rewrites a safetensors file without tensor `name`: its header entry and its bytes, the
/// later tensors moved down (a file written without it, as the format requires it to be laid
/// out: back to back, no gap).
fn remove_tensor(file: &Path, name: &str) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let gone = h.as_object_mut().unwrap().remove(name).unwrap_or_else(|| panic!("no tensor {name}"));
    let [a, b] = [0, 1].map(|i| gone["data_offsets"][i].as_u64().unwrap());
    for (_, e) in h.as_object_mut().unwrap().iter_mut().filter(|(k, _)| *k != "__metadata__") {
        for i in 0..2 {
            let o = e["data_offsets"][i].as_u64().unwrap();
            if o >= b {
                e["data_offsets"][i] = (o - (b - a)).into();
            }
        }
    }
    let mut hb = serde_json::to_vec(&h).unwrap();
    while !hb.len().is_multiple_of(8) {
        hb.push(b' ');
    }
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&hb);
    out.extend_from_slice(&data[..a as usize]);
    out.extend_from_slice(&data[b as usize..]);
    std::fs::write(file, out).unwrap();
}

#[test]
fn missing_path() {
    let e = fails(Path::new("/nonexistent/sluice-model"));
    assert!(e.contains("/nonexistent/sluice-model") && e.contains("no such file"), "{e}");
}

#[test]
fn missing_config() {
    let d = copy_model("qwen3", "noconfig");
    std::fs::remove_file(d.join("config.json")).unwrap();
    let e = fails(&d);
    assert!(e.contains("missing config.json"), "{e}");
}

#[test]
fn missing_weights_file() {
    let d = copy_model("qwen3", "noweights");
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    let e = fails(&d);
    assert!(e.contains("no *.safetensors files"), "{e}");
}

#[test]
fn truncated_safetensors() {
    let d = copy_model("qwen3_moe", "trunc");
    let p = d.join("model.safetensors");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() / 2]).unwrap();
    let e = fails(&d);
    assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");
}

#[test]
fn unknown_architecture() {
    let d = copy_model("llama", "arch");
    edit_config(&d, |c| {
        c.insert("model_type".into(), "gpt_neox".into());
    });
    let e = fails(&d);
    assert!(e.contains("config.json") && e.contains("unsupported architecture") && e.contains("gpt_neox"), "{e}");
}

#[test]
fn wrong_weight_dtype() {
    let d = copy_model("llama", "dtype");
    edit_header(&d.join("model.safetensors"), |h| {
        let t = h.get_mut("model.layers.0.self_attn.q_proj.weight").unwrap().as_object_mut().unwrap();
        // Same byte size: 96×64 bf16 = 96×32 i32.
        t.insert("dtype".into(), "I32".into());
        t.insert("shape".into(), serde_json::json!([96, 32]));
    });
    let e = fails(&d);
    assert!(e.contains("model.safetensors") && e.contains("q_proj.weight") && e.contains("dtype I32"), "{e}");
}

#[test]
fn shapes_inconsistent_with_config() {
    let d = copy_model("qwen2_moe", "shape");
    edit_config(&d, |c| {
        c.insert("num_key_value_heads".into(), 1.into());
    });
    let e = fails(&d);
    assert!(e.contains("model.safetensors") && e.contains("k_proj.weight") && e.contains("expected [16, 64]"), "{e}");
}

#[test]
fn missing_tensor() {
    let d = copy_model("mixtral", "missing");
    remove_tensor(&d.join("model.safetensors"), "model.layers.1.block_sparse_moe.experts.3.w2.weight");
    let e = fails(&d);
    assert!(e.contains("missing tensor `model.layers.1.block_sparse_moe.experts.3.w2.weight`"), "{e}");
}

#[test]
fn config_value_of_wrong_type() {
    let d = copy_model("olmoe", "type");
    edit_config(&d, |c| {
        c.insert("hidden_size".into(), "big".into());
    });
    let e = fails(&d);
    assert!(e.contains("config.json") && e.contains("`hidden_size`"), "{e}");
}

#[test]
fn impossible_expert_count() {
    let d = copy_model("qwen3_moe", "topk");
    edit_config(&d, |c| {
        c.insert("num_experts_per_tok".into(), 9.into());
    });
    let e = fails(&d);
    assert!(e.contains("9 experts per token out of 8"), "{e}");
}

#[test]
fn token_outside_vocabulary() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["logits", "--model"])
        .arg(golden("qwen2"))
        .args(["--tokens", "1,99999"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("token id 99999 is outside the vocabulary of 384"), "{err}");
}

#[test]
fn absurd_dimensions_in_config_json_are_refused_before_allocating() {
    for (key, value, expect) in [
        ("head_dim", serde_json::json!(0), "head_dim is 0"),
        ("num_hidden_layers", serde_json::json!(1u64 << 40), "number of layers is 1099511627776"),
        ("vocab_size", serde_json::json!(1u64 << 34), "vocabulary size is 17179869184"),
        ("num_key_value_heads", serde_json::json!(0), "key/value heads is 0"),
        ("max_position_embeddings", serde_json::json!(0), "context length 0"),
    ] {
        let d = copy_model("qwen3_moe", &format!("absurd-{key}"));
        edit_config(&d, |c| {
            c.insert(key.into(), value.clone());
        });
        let e = fails(&d);
        assert!(e.contains("config.json") && e.contains(expect), "{key}: {e}");
    }
}

/// A copy of a golden GGUF with its metadata edited.
fn edited_gguf(name: &str, tag: &str, edit: impl FnOnce(&mut sluice_formats::gguf::GgufWriter)) -> PathBuf {
    let src = golden("gguf").join(name);
    let f = sluice_formats::gguf::GgufFile::open(&src).unwrap();
    let dst = sluice_formats::scratch_root().join(format!("sluice-err-{tag}-{}.gguf", std::process::id()));
    sluice_formats::gguf::rewrite(&f, &dst, edit).unwrap();
    dst
}

fn set_meta(w: &mut sluice_formats::gguf::GgufWriter, key: &str, v: sluice_formats::gguf::Value) {
    w.metadata.retain(|(k, _)| k != key);
    w.metadata.push((key.into(), v));
}

#[test]
fn absurd_dimensions_in_gguf_metadata_are_refused_before_allocating() {
    use sluice_formats::gguf::Value;
    for (key, value, expect) in [
        ("olmoe.attention.key_length", Value::U32(0), "head_dim is 0"),
        ("olmoe.block_count", Value::U64(1 << 40), "number of layers is 1099511627776"),
        ("olmoe.embedding_length", Value::U64(1 << 33), "hidden size is 8589934592"),
        ("olmoe.rope.dimension_count", Value::U64(1 << 40), "rope.dimension_count"),
        ("olmoe.expert_used_count", Value::U32(99), "99 experts per token out of 8"),
    ] {
        let p = edited_gguf("olmoe-bf16.gguf", &format!("gguf-{key}"), |w| set_meta(w, key, value.clone()));
        let e = fails(&p);
        assert!(e.contains(".gguf") && e.contains(expect), "{key}: {e}");
    }
}

#[test]
fn gguf_numbers_that_are_not_a_model_are_named() {
    use sluice_formats::gguf::Value;
    for (file, key, value, expect) in [
        ("olmoe-bf16.gguf", "olmoe.rope.freq_base", Value::F32(f32::NAN), "RoPE base"),
        ("olmoe-bf16.gguf", "olmoe.rope.freq_base", Value::F32(-1.0), "RoPE base"),
        ("olmoe-bf16.gguf", "olmoe.rope.dimension_count", Value::U32(0), "rotary dimension 0"),
        ("qwen3-bf16.gguf", "qwen3.rope.scaling.factor", Value::F32(f32::INFINITY), "RoPE scaling factor inf"),
        ("deepseek_v3-bf16.gguf", "deepseek2.expert_weights_scale", Value::F32(-1.0), "routed scaling factor -1"),
        ("deepseek_v3-bf16.gguf", "deepseek2.rope.scaling.yarn_log_multiplier", Value::F32(f32::NAN), "attention"),
    ] {
        let p = edited_gguf(file, &format!("num-{key}"), |w| set_meta(w, key, value.clone()));
        let e = fails(&p);
        assert!(e.contains(".gguf") && e.contains(expect), "{key} = {value:?}: {e}");
    }
}

#[test]
fn gguf_counts_that_disagree_with_the_tensors_are_named() {
    use sluice_formats::gguf::Value;
    // Fewer blocks than the file holds: the last layer would be left out.
    let p = edited_gguf("olmoe-bf16.gguf", "blocks", |w| set_meta(w, "olmoe.block_count", Value::U32(1)));
    let e = fails(&p);
    assert!(e.contains("tensor `blk.1.") && e.contains("block_count is 1"), "{e}");
    // A trunk layer counted as a prediction layer, and a prediction layer as a trunk one.
    let p = edited_gguf("glm4_moe-bf16.gguf", "nextn1", |w| set_meta(w, "glm4moe.nextn_predict_layers", Value::U32(1)));
    let e = fails(&p);
    assert!(e.contains("block 2 is counted as a multi-token-prediction layer"), "{e}");
    let p =
        edited_gguf("glm4_moe_mtp-bf16.gguf", "nextn0", |w| set_meta(w, "glm4moe.nextn_predict_layers", Value::U32(0)));
    let e = fails(&p);
    assert!(e.contains("`blk.3.nextn.") && e.contains("one of the 4 trunk layers"), "{e}");
    // More experts in a tensor than expert_count says.
    let p = edited_gguf("olmoe-bf16.gguf", "experts", |w| {
        let t = w.tensors.iter_mut().find(|t| t.0 == "blk.1.ffn_up_exps.weight").unwrap();
        t.1[2] *= 2;
    });
    let e = fails(&p);
    assert!(e.contains("`blk.1.ffn_up_exps.weight` holds 16 experts, but expert_count is 8"), "{e}");
}

#[test]
fn fewer_layers_in_config_json_than_in_the_weights_is_named() {
    let d = copy_model("olmoe", "layers");
    edit_config(&d, |c| {
        c.insert("num_hidden_layers".into(), 1.into());
    });
    let e = fails(&d);
    assert!(e.contains("tensor `model.layers.1.") && e.contains("num_hidden_layers is 1"), "{e}");
}

#[test]
fn a_tensor_missing_from_one_layer_of_a_kind_is_named() {
    // Attention biases are read off the first attention layer: without it there, the other
    // layers' biases would be skipped.
    for (file, drop, expect) in [
        ("qwen2-bf16.gguf", "blk.0.attn_q.bias", "block 0 has no tensor `blk.0.attn_q.bias`, which block 1"),
        ("glm4_moe-bf16.gguf", "blk.0.attn_q.bias", "block 0 has no tensor `blk.0.attn_q.bias`, which block 1"),
        ("glm4_moe-bf16.gguf", "blk.2.attn_q_norm.weight", "block 2 has no tensor `blk.2.attn_q_norm.weight`"),
    ] {
        let p = edited_gguf(file, &format!("drop-{drop}"), |w| w.tensors.retain(|t| t.0 != drop));
        let e = fails(&p);
        assert!(e.contains(".gguf") && e.contains(expect), "{file} without {drop}: {e}");
    }
}

#[test]
fn a_huge_vocabulary_in_the_embedding_shape_is_refused() {
    // The header declares 2^34 embedding rows; no data follows (the file is a few KB). The
    // loader must refuse it without trying to allocate or read 2^34 rows.
    let src = sluice_formats::gguf::GgufFile::open(&golden("gguf").join("olmoe-bf16.gguf")).unwrap();
    let mut w = sluice_formats::gguf::GgufWriter { alignment: src.alignment, ..Default::default() };
    w.metadata = src.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    w.tensors = src.tensors.iter().map(|t| (t.name.clone(), t.dims.clone(), t.dtype)).collect();
    let t = w.tensors.iter_mut().find(|t| t.0 == "token_embd.weight").unwrap();
    t.1 = vec![t.1[0], 1 << 34];
    let p = sluice_formats::scratch_root().join(format!("sluice-err-vocab-{}.gguf", std::process::id()));
    let mut f = std::fs::File::create(&p).unwrap();
    // The writer refuses to finish a file without the data; its header is already out.
    assert!(w.write(&mut f, |_, _| Ok(())).is_err());
    drop(f);
    let e = fails(&p);
    assert!(
        e.contains(".gguf") && (e.contains("vocabulary size is 17179869184") || e.contains("runs past the end")),
        "{e}"
    );
}

/// A GGUF header whose tensor `blk.0.attn_q.weight` is declared as `dtype` with `dims`, and
/// no tensor data after it.
fn header_only_with(dtype: sluice_kernels::DType, dims: Vec<u64>, tag: &str) -> PathBuf {
    let src = sluice_formats::gguf::GgufFile::open(&golden("gguf").join("olmoe-bf16.gguf")).unwrap();
    let mut w = sluice_formats::gguf::GgufWriter { alignment: src.alignment, ..Default::default() };
    w.metadata = src.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    w.tensors = src.tensors.iter().map(|t| (t.name.clone(), t.dims.clone(), t.dtype)).collect();
    // First in the file, so that it is the first tensor the loader checks.
    let i = w.tensors.iter().position(|t| t.0 == "blk.0.attn_q.weight").unwrap();
    let mut t = w.tensors.remove(i);
    (t.1, t.2) = (dims, dtype);
    w.tensors.insert(0, t);
    let p = sluice_formats::scratch_root().join(format!("sluice-err-{tag}-{}.gguf", std::process::id()));
    let mut f = std::fs::File::create(&p).unwrap();
    // The writer refuses to finish a file without the data; its header is already out.
    assert!(w.write(&mut f, |_, _| Ok(())).is_err());
    p
}

#[test]
fn an_iq_tensor_that_is_not_whole_blocks_or_not_in_the_file_is_named() {
    use sluice_kernels::DType;
    // Rows of 100 values are not whole 256-value blocks.
    let e = fails(&header_only_with(DType::IQ2_XS, vec![100, 64], "iq-rows"));
    assert!(e.contains("blk.0.attn_q.weight") && e.contains("not a whole number of IQ2_XS blocks"), "{e}");
    // Whole blocks, but the file ends before the tensor's bytes.
    let e = fails(&header_only_with(DType::IQ3_S, vec![256, 1 << 20], "iq-size"));
    assert!(e.contains("blk.0.attn_q.weight") && e.contains("runs past the end"), "{e}");
}

#[test]
fn inconsistent_deltanet_head_counts_are_named() {
    let d = copy_model("qwen3_next", "dn-heads");
    edit_config(&d, |c| {
        c.insert("linear_num_value_heads".into(), 3.into());
    });
    let e = fails(&d);
    assert!(
        e.contains("config.json") && e.contains("linear_num_value_heads 3") && e.contains("linear_num_key_heads 2"),
        "{e}"
    );
    // Consistent counts that disagree with the tensors: the projection is named.
    let d = copy_model("qwen3_next", "dn-heads2");
    edit_config(&d, |c| {
        c.insert("linear_num_value_heads".into(), 8.into());
    });
    let e = fails(&d);
    assert!(e.contains("in_proj_qkvz.weight") && e.contains("has shape"), "{e}");
}

#[test]
fn missing_deltanet_tensors_are_named() {
    for (tensor, expect) in [
        ("model.layers.2.linear_attn.conv1d.weight", "missing tensor `model.layers.2.linear_attn.conv1d.weight`"),
        (
            "model.layers.0.linear_attn.A_log",
            "layer 0 is a Gated DeltaNet layer but its decay (A_log / ssm_a) is missing",
        ),
        ("model.layers.3.linear_attn.dt_bias", "missing tensor `model.layers.3.linear_attn.dt_bias`"),
    ] {
        let d = copy_model("qwen3_next", &format!("dn-missing-{}", tensor.len()));
        remove_tensor(&d.join("model.safetensors"), tensor);
        let e = fails(&d);
        assert!(e.contains(expect), "{tensor}: {e}");
    }
}

#[test]
fn unknown_layer_type_is_named() {
    let d = copy_model("qwen3_next", "dn-type");
    edit_config(&d, |c| {
        c.insert(
            "layer_types".into(),
            serde_json::json!(["linear_attention", "mamba", "linear_attention", "full_attention"]),
        );
    });
    let e = fails(&d);
    assert!(
        e.contains("config.json") && e.contains("unknown layer type \"mamba\"") && e.contains("layer_types"),
        "{e}"
    );
}

#[test]
fn missing_deltanet_tensor_in_gguf_is_named() {
    let p = edited_gguf("qwen3_5_moe-bf16.gguf", "gguf-dn-conv", |w| {
        w.tensors.retain(|t| t.0 != "blk.1.ssm_conv1d.weight")
    });
    let e = fails(&p);
    // Named as missing, or as missing beside the other DeltaNet layers that have it.
    assert!(
        e.contains("no tensor `blk.1.ssm_conv1d.weight`") || e.contains("missing tensor `blk.1.ssm_conv1d.weight`"),
        "{e}"
    );
    let p = edited_gguf("qwen3_next-bf16.gguf", "gguf-dn-rank", |w| {
        set_meta(w, "qwen3next.ssm.time_step_rank", sluice_formats::gguf::Value::U32(3))
    });
    let e = fails(&p);
    assert!(e.contains("value heads") || e.contains("ssm.inner_size"), "{e}");
}

#[test]
fn an_inconsistent_latent_rank_is_named() {
    let d = copy_model("deepseek_v3", "mla-rank");
    edit_config(&d, |c| {
        c.insert("kv_lora_rank".into(), 20.into());
    });
    // The first latent tensor read names the mismatch: kv_b_proj is (heads·(nope + v), rank).
    let e = fails(&d);
    assert!(e.contains("self_attn.kv_b_proj.weight") && e.contains("expected [112, 20]"), "{e}");
    let p = edited_gguf("deepseek_v3-bf16.gguf", "gguf-mla-rank", |w| {
        set_meta(w, "deepseek2.attention.kv_lora_rank", sluice_formats::gguf::Value::U32(20))
    });
    let e = fails(&p);
    assert!(e.contains("attn_k_b.weight") && e.contains("expected [4, 20, 16]"), "{e}");
}

#[test]
fn a_sinks_tensor_of_the_wrong_size_is_named() {
    let p = edited_gguf("gpt_oss-bf16.gguf", "gguf-sinks", |w| {
        for t in &mut w.tensors {
            if t.0 == "blk.1.attn_sinks.weight" {
                t.1 = vec![3];
            }
        }
    });
    let e = fails(&p);
    assert!(e.contains("blk.1.attn_sinks.weight") && e.contains("expected [4]"), "{e}");
}

/// Writes a copy of `src` to `dst` with byte `offset` set to `v`.
fn poke(src: &Path, dst: &Path, offset: usize, v: u8) {
    let mut b = std::fs::read(src).unwrap();
    b[offset] = v;
    std::fs::write(dst, b).unwrap();
}

#[test]
fn an_mxfp4_scale_outside_the_format_is_named() {
    // E8M0 exponent 0xFF is the format's NaN. Hugging Face blocks: a byte of `*_scales`, in
    // every expert (a streamed run reads only the experts it routes to).
    let d = copy_model("gpt_oss_mxfp4", "mxfp4-scale");
    let st = d.join("model.safetensors");
    let name = "model.layers.1.mlp.experts.down_proj_scales";
    let m = sluice_formats::safetensors::SafetensorsModel::open(&d).unwrap();
    let info = m.info(name).unwrap().clone();
    drop(m);
    let per_expert = (info.end - info.start) / info.shape[0];
    for e in 0..info.shape[0] {
        poke(&st.clone(), &st, info.start + e * per_expert + 5, 0xFF);
    }
    let e = fails(&d);
    assert!(e.contains(name) && e.contains("0xFF"), "{e}");
    // Streamed, the expert is rewritten into the kernels' form as it lands, and refused there.
    let e = fails_with(&d, &["--expert-mode", "stream", "--expert-cache", "128KiB"]);
    assert!(e.contains("layer 1 expert") && e.contains(name) && e.contains("0xFF"), "{e}");
    // GGUF: the exponent byte that opens a block of `ffn_up_exps`, in every expert.
    let src = golden("gguf").join("gpt_oss_mxfp4-bf16.gguf");
    let f = sluice_formats::gguf::GgufFile::open(&src).unwrap();
    let t = f.tensor_info("blk.2.ffn_up_exps.weight").unwrap();
    let n_exp = *t.dims.last().unwrap() as usize;
    let (start, per_expert) = (t.offset as usize, t.size as usize / n_exp);
    drop(f);
    let dst = sluice_formats::scratch_root().join(format!("sluice-err-mxfp4-{}.gguf", std::process::id()));
    std::fs::copy(&src, &dst).unwrap();
    for e in 0..n_exp {
        poke(&dst.clone(), &dst, start + e * per_expert + 17 * 3, 0xFF);
    }
    let e = fails(&dst);
    assert!(e.contains("blk.2.ffn_up_exps.weight") && e.contains("0xFF"), "{e}");
    // Streamed: checked as each expert lands (a whole-file scan would read every expert).
    let e = fails_with(&dst, &["--expert-mode", "stream", "--expert-cache", "128KiB"]);
    assert!(e.contains("layer 2 expert") && e.contains("Up") && e.contains("0xFF"), "{e}");
    let _ = std::fs::remove_file(&dst);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn an_unknown_router_type_is_named() {
    let p = edited_gguf("deepseek_v3-bf16.gguf", "gguf-gating", |w| {
        set_meta(w, "deepseek2.expert_gating_func", sluice_formats::gguf::Value::U32(7))
    });
    let e = fails(&p);
    assert!(e.contains("unsupported router type") && e.contains("expert_gating_func = 7"), "{e}");
    let d = copy_model("minimax_m2", "scoring");
    edit_config(&d, |c| {
        c.insert("scoring_func".into(), "sqrtsoftplus".into());
    });
    let e = fails(&d);
    assert!(e.contains("scoring_func") && e.contains("sqrtsoftplus"), "{e}");
}
