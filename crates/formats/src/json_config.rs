//! Typed access to a JSON config (`config.json`, `generation_config.json`) with errors that
//! name the file and the key.

use crate::error::{FormatError, Result};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug)]
pub struct JsonConfig {
    pub path: PathBuf,
    pub map: Map<String, Value>,
}

impl JsonConfig {
    pub fn open(path: &Path) -> Result<JsonConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| FormatError::io(path, e))?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<JsonConfig> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| FormatError::invalid(path, format!("not valid JSON: {e}")))?;
        match v {
            Value::Object(map) => Ok(JsonConfig { path: path.to_path_buf(), map }),
            _ => Err(FormatError::invalid(path, "expected a JSON object at the top level")),
        }
    }

    /// A nested object as a config of its own (errors still name this file; keys are prefixed).
    pub fn sub(&self, key: &str) -> Result<Option<JsonConfig>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(JsonConfig { path: self.path.clone(), map: m.clone() })),
            Some(other) => Err(self.wrong(key, "an object", other)),
        }
    }

    /// The value at `key`; JSON `null` counts as absent.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn wrong(&self, key: &str, want: &str, got: &Value) -> FormatError {
        FormatError::invalid(&self.path, format!("key `{key}` must be {want}, got {got}"))
    }

    pub fn missing(&self, key: &str) -> FormatError {
        FormatError::invalid(&self.path, format!("missing key `{key}`"))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| self.wrong(key, "a non-negative integer", v)),
        }
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key))
    }

    /// The first of `keys` that is present (config dialects name the same thing differently).
    pub fn usize_any(&self, keys: &[&str]) -> Result<usize> {
        for k in keys {
            if let Some(v) = self.opt_usize(k)? {
                return Ok(v);
            }
        }
        Err(FormatError::invalid(
            &self.path,
            format!("missing key `{}`", keys.join("` (or `")) + &")".repeat(keys.len() - 1),
        ))
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.wrong(key, "a number", v)),
        }
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong(key, "true or false", v)),
        }
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.wrong(key, "a string", v)),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        self.opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    /// An integer list; a single integer counts as a list of one (as `eos_token_id` allows).
    pub fn opt_usize_list(&self, key: &str) -> Result<Option<Vec<usize>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|n| n as usize))
                .collect::<Option<Vec<_>>>()
                .map(Some)
                .ok_or_else(|| self.wrong(key, "a list of integers", &Value::Array(a.clone()))),
            Some(v) => {
                v.as_u64().map(|n| Some(vec![n as usize])).ok_or_else(|| self.wrong(key, "an integer or a list", v))
            }
        }
    }

    /// An error about this file, for a value that parsed but makes no sense.
    pub fn error(&self, msg: impl Into<String>) -> FormatError {
        FormatError::invalid(&self.path, msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_file_and_key() {
        let c = JsonConfig::parse(Path::new("config.json"), r#"{"a": 3, "b": "x", "c": null, "l": [1,2], "s": 7}"#)
            .unwrap();
        assert_eq!(c.usize("a").unwrap(), 3);
        assert_eq!(c.opt_usize("c").unwrap(), None);
        let e = c.usize("b").unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("`b`") && e.contains("integer"), "{e}");
        let e = c.usize("zz").unwrap_err().to_string();
        assert!(e.contains("missing key `zz`"), "{e}");
        assert_eq!(c.usize_any(&["zz", "a"]).unwrap(), 3);
        let e = c.usize_any(&["p", "q"]).unwrap_err().to_string();
        assert!(e.contains("`p` (or `q`)"), "{e}");
        assert_eq!(c.opt_usize_list("l").unwrap(), Some(vec![1, 2]));
        assert_eq!(c.opt_usize_list("s").unwrap(), Some(vec![7]));
    }
}
