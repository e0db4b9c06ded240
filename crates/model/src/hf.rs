//! A Hugging Face model directory as a `TensorSource`: `config.json` + safetensors shards.
//! Routed experts are found in either layout the hub uses: a tensor per expert matrix, or a
//! layer's experts fused into `experts.gate_up_proj` and `experts.down_proj`.

use crate::config::{Arch, FfnKind, ModelConfig, MtpConfig};
use crate::error::{ModelError, Result};
use crate::families::gpt_oss::FusedExpert;
use crate::families::{self, HfNames};
use crate::weights::{ExpertPart, Key, TensorSource};
use sluice_formats::safetensors::{SafetensorsModel, TensorData};
use sluice_formats::JsonConfig;
use std::path::{Path, PathBuf};

pub struct HfCheckpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub names: HfNames,
    /// What of the checkpoint sluice does not use, for `inspect`.
    pub notes: Vec<String>,
    pub st: SafetensorsModel,
}

/// Where one expert matrix lies: a byte range of a shard.
#[derive(Clone, Debug)]
pub struct ExpertLoc {
    pub file: PathBuf,
    /// Absolute offset in the file.
    pub offset: u64,
    pub len: u64,
    pub dtype: sluice_kernels::DType,
    pub rows: usize,
    pub cols: usize,
}

impl HfCheckpoint {
    pub fn open(dir: &Path) -> Result<HfCheckpoint> {
        let cpath = dir.join("config.json");
        if !cpath.exists() {
            return Err(ModelError::Invalid(format!("{}: missing config.json in the model directory", dir.display())));
        }
        let c = JsonConfig::open(&cpath)?;
        let m = families::hf_model(&c)?;
        let st = SafetensorsModel::open(dir)?;
        let mut ck = HfCheckpoint { dir: dir.to_path_buf(), config: m.config, names: m.names, notes: m.notes, st };
        ck.find_mtp();
        ck.check_layer_count()?;
        Ok(ck)
    }

    /// No layer tensor past the trunk's `num_hidden_layers` (and the prediction layers that
    /// follow it): a count smaller than the checkpoint's would run the model with its last
    /// layers left out and say nothing.
    fn check_layer_count(&self) -> Result<()> {
        let first = self.names.name(Key::AttnNorm, Some(0));
        let Some(at) = first.find("layers.0.") else { return Ok(()) };
        let prefix = &first[..at + "layers.".len()];
        let n_layer = self.config.n_layer;
        let mtp = if self.names.mtp_in_layers() { self.config.mtp.map_or(0, |m| m.n_layer) } else { 0 };
        for name in self.st.names() {
            let Some(i) = name.strip_prefix(prefix).and_then(|r| r.split('.').next()?.parse::<usize>().ok()) else {
                continue;
            };
            if i >= n_layer + mtp {
                return Err(ModelError::Invalid(format!(
                    "{}: tensor `{name}` is in layer {i}, but num_hidden_layers is {n_layer}",
                    self.describe()
                )));
            }
        }
        Ok(())
    }

    /// A multi-token-prediction head, if the checkpoint ships one (`mtp.*`).
    fn find_mtp(&mut self) {
        let n_layer = self.config.n_layer;
        let n = if self.names.mtp_in_layers() {
            // `layers.{n_layer + i}` with its own `eh_proj`.
            (0..).take_while(|i| self.st.contains(&self.names.name(Key::MtpEhProj, Some(n_layer + i)))).count()
        } else {
            if self.config.delta_net.is_none() || !self.st.contains(&self.names.name(Key::MtpEhProj, None)) {
                return;
            }
            (0..).take_while(|i| self.st.names().any(|t| t.starts_with(&format!("mtp.layers.{i}.")))).count()
        };
        if n > 0 {
            let ffn = if self.config.moe.is_some() { FfnKind::Moe } else { FfnKind::Dense };
            self.config.mtp = Some(MtpConfig { n_layer: n, ffn });
        }
    }

    fn named(&self, name: &str) -> Result<Option<TensorData>> {
        if !self.st.contains(name) {
            return Ok(None);
        }
        Ok(Some(self.st.tensor(name)?))
    }

    fn missing(&self, name: &str) -> ModelError {
        ModelError::Invalid(format!("{}: missing tensor `{name}`", self.describe()))
    }

    /// Where expert `e`'s `part` of layer `l` lies, in either layout.
    pub fn expert_location(&self, part: ExpertPart, l: usize, e: usize) -> Result<ExpertLoc> {
        if self.config.arch == Arch::GptOss {
            return Err(ModelError::Invalid(format!(
                "{}: gpt-oss's experts are not stored in the kernels' form (see `gpt_oss_expert`)",
                self.describe()
            )));
        }
        let name = self.names.expert(part, l, e);
        if let Some(info) = self.st.info(&name) {
            let t = self.st.tensor(&name)?;
            let [rows, cols] = match t.shape.as_slice() {
                [r, c] => [*r, *c],
                s => {
                    return Err(ModelError::Invalid(format!(
                        "{}: `{name}` has shape {s:?}, expected 2 dimensions",
                        self.describe()
                    )))
                }
            };
            let file = self.st.file_of(&name).expect("info found it").to_path_buf();
            return Ok(ExpertLoc {
                file,
                offset: info.start as u64,
                len: (info.end - info.start) as u64,
                dtype: t.dtype,
                rows,
                cols,
            });
        }
        let (gate_up, down) = self.names.fused_experts(l);
        let fused = if part == ExpertPart::Down { &down } else { &gate_up };
        let Some(info) = self.st.info(fused) else {
            return Err(ModelError::Invalid(format!(
                "{}: missing tensor `{name}` (nor are the layer's experts fused in `{fused}`)",
                self.describe()
            )));
        };
        let t = self.st.tensor(fused)?;
        let [n_exp, rows, cols] = match t.shape.as_slice() {
            [a, b, c] => [*a, *b, *c],
            s => {
                return Err(ModelError::Invalid(format!(
                    "{}: `{fused}` has shape {s:?}, expected (experts, rows, cols)",
                    self.describe()
                )))
            }
        };
        if e >= n_exp {
            return Err(ModelError::Invalid(format!(
                "{}: `{fused}` holds {n_exp} experts; expert {e} asked for",
                self.describe()
            )));
        }
        let row_bytes = t.dtype.row_bytes(cols).ok_or_else(|| {
            ModelError::Invalid(format!("{}: `{fused}`: rows of {cols} {} values", self.describe(), t.dtype))
        })? as u64;
        // gate_up_proj holds each expert's gate rows, then its up rows.
        let (first_row, n_rows) = match part {
            ExpertPart::Down => (e * rows, rows),
            ExpertPart::Gate => (e * rows, rows / 2),
            ExpertPart::Up => (e * rows + rows / 2, rows / 2),
        };
        if part != ExpertPart::Down && rows % 2 != 0 {
            return Err(ModelError::Invalid(format!(
                "{}: `{fused}` has an odd number of gate/up rows ({rows})",
                self.describe()
            )));
        }
        let file = self.st.file_of(fused).expect("info found it").to_path_buf();
        Ok(ExpertLoc {
            file,
            offset: info.start as u64 + first_row as u64 * row_bytes,
            len: n_rows as u64 * row_bytes,
            dtype: t.dtype,
            rows: n_rows,
            cols,
        })
    }
}

impl HfCheckpoint {
    /// Where gpt-oss's expert `e` of layer `l` lies in the fused tensors, and how it becomes
    /// the kernels' matrices.
    pub fn gpt_oss_expert(&self, l: usize, e: usize) -> Result<FusedExpert> {
        let ff = self.config.moe.as_ref().map_or(0, |m| m.expert_ff);
        FusedExpert::locate(&self.st, &self.names.prefix, l, e, self.config.hidden, ff)
    }
}

impl TensorSource for HfCheckpoint {
    fn describe(&self) -> String {
        self.dir.display().to_string()
    }

    fn get(&self, key: Key, layer: Option<usize>) -> Result<Option<TensorData>> {
        self.named(&self.names.name(key, layer))
    }

    fn require(&self, key: Key, layer: Option<usize>) -> Result<TensorData> {
        let name = self.names.name(key, layer);
        self.named(&name)?.ok_or_else(|| self.missing(&name))
    }

    fn expert_bytes(&self, part: ExpertPart, layer: usize, expert: usize) -> Result<u64> {
        if self.config.arch == Arch::GptOss {
            return Ok(self.gpt_oss_expert(layer, expert)?.bytes(part) as u64);
        }
        Ok(self.expert(part, layer, expert)?.data.len() as u64)
    }

    fn expert(&self, part: ExpertPart, layer: usize, expert: usize) -> Result<TensorData> {
        if self.config.arch == Arch::GptOss {
            return families::gpt_oss::hf_expert(&self.st, &self.gpt_oss_expert(layer, expert)?, part);
        }
        let name = self.names.expert(part, layer, expert);
        if let Some(t) = self.named(&name)? {
            return Ok(t);
        }
        let loc = self.expert_location(part, layer, expert)?;
        let (gate_up, down) = self.names.fused_experts(layer);
        let fused = if part == ExpertPart::Down { down } else { gate_up };
        let whole = self.st.tensor(&fused)?;
        let start = self.st.info(&fused).expect("located").start as u64;
        Ok(TensorData {
            name: format!("{fused}[{expert}].{part:?}"),
            file: loc.file,
            dtype: loc.dtype,
            shape: vec![loc.rows, loc.cols],
            data: whole.data.slice((loc.offset - start) as usize, loc.len as usize),
        })
    }
}
