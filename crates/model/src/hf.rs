//! A Hugging Face model directory as a `TensorSource`: `config.json` + safetensors shards.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::families;
use crate::weights::{ExpertPart, Key, TensorSource};
use sluice_formats::safetensors::{SafetensorsModel, TensorData};
use sluice_formats::JsonConfig;
use std::path::{Path, PathBuf};

pub struct HfCheckpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub st: SafetensorsModel,
}

impl HfCheckpoint {
    pub fn open(dir: &Path) -> Result<HfCheckpoint> {
        let cpath = dir.join("config.json");
        if !cpath.exists() {
            return Err(ModelError::Invalid(format!("{}: missing config.json in the model directory", dir.display())));
        }
        let c = JsonConfig::open(&cpath)?;
        let config = families::from_hf_config(&c)?;
        let st = SafetensorsModel::open(dir)?;
        Ok(HfCheckpoint { dir: dir.to_path_buf(), config, st })
    }

    fn named(&self, name: &str) -> Result<Option<TensorData>> {
        if !self.st.contains(name) {
            return Ok(None);
        }
        Ok(Some(self.st.tensor(name)?))
    }
}

impl TensorSource for HfCheckpoint {
    fn describe(&self) -> String {
        self.dir.display().to_string()
    }

    fn get(&self, key: Key, layer: Option<usize>) -> Result<Option<TensorData>> {
        self.named(&families::hf_name(self.config.arch, key, layer))
    }

    fn require(&self, key: Key, layer: Option<usize>) -> Result<TensorData> {
        let name = families::hf_name(self.config.arch, key, layer);
        self.named(&name)?.ok_or_else(|| ModelError::Invalid(format!("{}: missing tensor `{name}`", self.describe())))
    }

    fn expert(&self, part: ExpertPart, layer: usize, expert: usize) -> Result<TensorData> {
        let name = families::hf_expert_name(self.config.arch, part, layer, expert);
        self.named(&name)?.ok_or_else(|| ModelError::Invalid(format!("{}: missing tensor `{name}`", self.describe())))
    }
}
