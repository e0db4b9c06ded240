//! Expert stores: where a model's routed experts are read from. Each produces a `Layout`
//! (file ranges per expert). A GGUF file is read directly (an expert is a slice of each
//! stacked `ffn_*_exps` tensor), so are Hugging Face safetensors (per-expert or fused tensors,
//! across shards; gpt-oss's fused experts are rewritten once read); a pack (see `pack`) is the
//! read-optimised alternative.

use crate::layout::{ExpertPlan, Layout, PartLoc};
use crate::{ExpertError, Result};
use sluice_model::gguf::GgufCheckpoint;
use sluice_model::hf::HfCheckpoint;
use sluice_model::weights::ExpertPart;
use sluice_model::{Arch, ModelConfig};
use std::path::{Path, PathBuf};

/// The experts of a GGUF model as ranges of the file itself.
pub fn layout_from_gguf(ck: &GgufCheckpoint) -> Result<Layout> {
    let cfg = &ck.config;
    if cfg.moe.is_none() {
        return Err(ExpertError::NotMoe(ck.file.path.display().to_string()));
    }
    let experts = cfg.map_experts(|l, e| -> Result<ExpertPlan> {
        let part = |p: ExpertPart| -> Result<PartLoc> {
            let (r, dtype, [rows, cols]) = ck.expert_range(p, l, e)?;
            check_shape(cfg, p, rows, cols, &ck.file.path)?;
            Ok(PartLoc { file: r.file, offset: r.offset, len: r.len, dtype, rows, cols })
        };
        Ok(ExpertPlan::from_parts([part(ExpertPart::Gate)?, part(ExpertPart::Up)?, part(ExpertPart::Down)?]))
    })?;
    Ok(Layout { files: ck.file.files.iter().map(|f| f.0.clone()).collect(), experts })
}

/// The experts of a Hugging Face checkpoint as ranges of its safetensors shards.
pub fn layout_from_hf(ck: &HfCheckpoint) -> Result<Layout> {
    let cfg = &ck.config;
    if cfg.moe.is_none() {
        return Err(ExpertError::NotMoe(ck.dir.display().to_string()));
    }
    let files: Vec<PathBuf> = ck.st.files.iter().map(|f| f.path.clone()).collect();
    if cfg.arch == Arch::GptOss {
        let experts = cfg.map_experts(|l, e| -> Result<ExpertPlan> {
            let fused = ck.gpt_oss_expert(l, e).map_err(|err| ExpertError::Model(err.to_string()))?;
            for p in ExpertPart::ALL {
                let (_, rows, cols) = fused.shape(p);
                check_shape(cfg, p, rows, cols, &ck.dir)?;
            }
            Ok(ExpertPlan::reformed(fused, |f| files.iter().position(|x| x == f).expect("shard listed")))
        })?;
        return Ok(Layout { files, experts });
    }
    let experts = cfg.map_experts(|l, e| -> Result<ExpertPlan> {
        let part = |p: ExpertPart| -> Result<PartLoc> {
            let loc = ck.expert_location(p, l, e).map_err(|err| ExpertError::Model(err.to_string()))?;
            let file = files.iter().position(|f| *f == loc.file).expect("shard listed");
            check_shape(cfg, p, loc.rows, loc.cols, &loc.file)?;
            Ok(PartLoc { file, offset: loc.offset, len: loc.len, dtype: loc.dtype, rows: loc.rows, cols: loc.cols })
        };
        Ok(ExpertPlan::from_parts([part(ExpertPart::Gate)?, part(ExpertPart::Up)?, part(ExpertPart::Down)?]))
    })?;
    Ok(Layout { files, experts })
}

fn check_shape(cfg: &ModelConfig, p: ExpertPart, rows: usize, cols: usize, path: &Path) -> Result<()> {
    let moe = cfg.moe.as_ref().expect("MoE");
    let want = match p {
        ExpertPart::Down => [cfg.hidden, moe.expert_ff],
        _ => [moe.expert_ff, cfg.hidden],
    };
    if [rows, cols] != want {
        return Err(ExpertError::Model(format!(
            "{}: expert {p:?} matrix is {rows}x{cols}, expected {}x{}",
            path.display(),
            want[0],
            want[1]
        )));
    }
    Ok(())
}

/// A cheap identity of a model's files: a hash of their headers (tensor tables included) and
/// their sizes. A pack records it and refuses to serve any other model.
pub fn fingerprint(files: &[PathBuf], header_bytes: &[u64]) -> Result<String> {
    use std::io::Read;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for (p, n) in files.iter().zip(header_bytes) {
        let f = std::fs::File::open(p).map_err(|e| ExpertError::Io { path: p.clone(), source: e })?;
        let len = f.metadata().map_err(|e| ExpertError::Io { path: p.clone(), source: e })?.len();
        let mut buf = Vec::new();
        f.take(*n).read_to_end(&mut buf).map_err(|e| ExpertError::Io { path: p.clone(), source: e })?;
        h.update(&buf);
        h.update(&len.to_le_bytes());
    }
    Ok(format!("{:016x}", h.digest()))
}

/// The fingerprint of a GGUF model (header and tensor table, file size).
pub fn gguf_fingerprint(ck: &GgufCheckpoint) -> Result<String> {
    let (paths, starts): (Vec<_>, Vec<_>) = ck.file.files.iter().cloned().unzip();
    fingerprint(&paths, &starts)
}

/// The fingerprint of a Hugging Face checkpoint (every shard's header, sizes).
pub fn hf_fingerprint(ck: &HfCheckpoint) -> Result<String> {
    let files: Vec<PathBuf> = ck.st.files.iter().map(|f| f.path.clone()).collect();
    let heads: Vec<u64> =
        ck.st.files.iter().map(|f| f.tensors.values().map(|t| t.start as u64).min().unwrap_or(8)).collect();
    fingerprint(&files, &heads)
}
