//! safetensors checkpoints, single file or sharded (`model.safetensors.index.json`).
//!
//! Files are memory-mapped; a tensor is a `Blob` into the map, so opening a checkpoint reads
//! only its headers. Every header is validated against the file size before any tensor is
//! handed out: offsets in order, inside the file, and matching shape × dtype.

use crate::blob::{Backing, Blob};
use crate::error::{FormatError, Result};
use sluice_kernels::DType;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Header entry of one tensor.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// As written in the file ("BF16", "F32", "I64", ...).
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

fn elem_size(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        _ => return None,
    })
}

/// One safetensors file, mapped.
pub struct SafetensorsFile {
    pub path: PathBuf,
    map: Arc<memmap2::Mmap>,
    pub tensors: BTreeMap<String, TensorInfo>,
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<SafetensorsFile> {
        let file = std::fs::File::open(path).map_err(|e| FormatError::io(path, e))?;
        // SAFETY: the map is read-only; a checkpoint changing under a running model is outside
        // what any loader can defend against, as for every mmap-based reader.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| FormatError::io(path, e))?;
        let tensors = parse_header(path, &map)?;
        Ok(SafetensorsFile { path: path.to_path_buf(), map: Arc::new(map), tensors })
    }

    pub fn blob(&self, info: &TensorInfo) -> Blob {
        Blob::new(self.map.clone() as Arc<dyn Backing>, info.start, info.end - info.start)
    }

    /// `len` bytes of the file from absolute offset `start` (within the file).
    pub fn range(&self, start: usize, len: usize) -> Blob {
        assert!(start.checked_add(len).is_some_and(|end| end <= self.map.len()), "range inside the file");
        Blob::new(self.map.clone() as Arc<dyn Backing>, start, len)
    }

    pub fn file_len(&self) -> usize {
        self.map.len()
    }
}

/// Parses and validates a safetensors file held in memory: its header against its length.
/// Errors name `<memory>` as the file (the fuzz harness and tests use it).
pub fn parse_header_bytes(bytes: &[u8]) -> Result<BTreeMap<String, TensorInfo>> {
    parse_header(Path::new("<memory>"), bytes)
}

/// Parses and validates a safetensors header against the file's length.
fn parse_header(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, TensorInfo>> {
    let bad = |msg: String| FormatError::invalid(path, msg);
    if bytes.len() < 8 {
        return Err(bad(format!("file is {} bytes, too short for a safetensors header", bytes.len())));
    }
    let hlen = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    if hlen > bytes.len() - 8 {
        return Err(bad(format!(
            "header claims {hlen} bytes but the file has only {} after the length prefix (truncated?)",
            bytes.len() - 8
        )));
    }
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + hlen]).map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    let data_start = 8 + hlen;
    let data_len = bytes.len() - data_start;
    let mut tensors = BTreeMap::new();
    for (name, v) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = v
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad(format!("tensor `{name}` has no dtype")))?
            .to_string();
        let shape: Vec<usize> = v
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .ok_or_else(|| bad(format!("tensor `{name}` has no valid shape")))?;
        let offs: Vec<usize> = v
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .filter(|o: &Vec<usize>| o.len() == 2)
            .ok_or_else(|| bad(format!("tensor `{name}` has no valid data_offsets")))?;
        let (s, e) = (offs[0], offs[1]);
        if s > e || e > data_len {
            return Err(bad(format!(
                "tensor `{name}` spans bytes {s}..{e} of the data section, which has {data_len} bytes (truncated?)"
            )));
        }
        let esz = elem_size(&dtype).ok_or_else(|| bad(format!("tensor `{name}` has unknown dtype {dtype}")))?;
        // Checked: a shape whose size overflows would otherwise wrap (or panic) and could pass
        // for a tensor of the right size.
        let need = shape.iter().try_fold(esz, |a, d| a.checked_mul(*d)).ok_or_else(|| {
            bad(format!("tensor `{name}` of shape {shape:?} and dtype {dtype} is larger than memory can address"))
        })?;
        if need != e - s {
            return Err(bad(format!(
                "tensor `{name}` of shape {shape:?} and dtype {dtype} needs {need} bytes but spans {}",
                e - s
            )));
        }
        tensors.insert(name, TensorInfo { dtype, shape, start: data_start + s, end: data_start + e });
    }
    // As the format's reference reader requires, the tensors cover the data section back to
    // back: an overlap or a gap means a header that does not describe its data (a tensor
    // shifted or dropped from it) and is refused, not read at the offsets it claims.
    let mut spans: Vec<(usize, usize, &str)> = tensors.iter().map(|(n, t)| (t.start, t.end, n.as_str())).collect();
    spans.sort_unstable();
    let mut at = data_start;
    for (start, end, name) in spans {
        if start != at {
            return Err(bad(format!(
                "tensor `{name}` starts at byte {} of the data section where the tensors before it end at {}: the header's offsets {} the data",
                start - data_start,
                at - data_start,
                if start < at { "overlap in" } else { "leave a gap in" }
            )));
        }
        at = end;
    }
    if at != bytes.len() {
        return Err(bad(format!(
            "the tensors end at byte {} of the data section, which has {data_len} bytes",
            at - data_start
        )));
    }
    Ok(tensors)
}

/// A checkpoint's tensors across one or more safetensors files.
pub struct SafetensorsModel {
    pub dir: PathBuf,
    pub files: Vec<SafetensorsFile>,
    /// Tensor name → (file index, header entry).
    index: BTreeMap<String, (usize, TensorInfo)>,
}

/// A tensor whose bytes are ready for a kernel.
#[derive(Clone, Debug)]
pub struct TensorData {
    pub name: String,
    /// The file holding it (for messages).
    pub file: PathBuf,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Blob,
}

impl SafetensorsModel {
    /// Opens `dir/model.safetensors.index.json` with its shards, or else every `*.safetensors`
    /// file in `dir`.
    pub fn open(dir: &Path) -> Result<SafetensorsModel> {
        let index_path = dir.join("model.safetensors.index.json");
        let file_names: Vec<String> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| FormatError::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| FormatError::invalid(&index_path, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| FormatError::invalid(&index_path, "no `weight_map` object"))?;
            let mut names: Vec<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
            names.sort();
            names.dedup();
            for n in &names {
                if n.contains('/') || n.contains("..") {
                    return Err(FormatError::invalid(
                        &index_path,
                        format!("shard name `{n}` is not a plain file name"),
                    ));
                }
            }
            names
        } else {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .map_err(|e| FormatError::io(dir, e))?
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            names.sort();
            names
        };
        if file_names.is_empty() {
            return Err(FormatError::invalid(dir, "no *.safetensors files in the model directory"));
        }
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for (i, n) in file_names.iter().enumerate() {
            let f = SafetensorsFile::open(&dir.join(n))?;
            for (name, info) in &f.tensors {
                if let Some((prev, _)) = index.insert(name.clone(), (i, info.clone())) {
                    return Err(FormatError::invalid(
                        dir.join(n),
                        format!("tensor `{name}` also appears in {}", file_names[prev]),
                    ));
                }
            }
            files.push(f);
        }
        Ok(SafetensorsModel { dir: dir.to_path_buf(), files, index })
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.index.keys()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|(_, i)| i)
    }

    /// The file that holds `name`.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.index.get(name).map(|(f, _)| self.files[*f].path.as_path())
    }

    /// A tensor's bytes as stored, whatever its dtype (packed formats such as MXFP4 blocks
    /// and their U8 scales), with its header entry.
    pub fn raw(&self, name: &str) -> Result<(crate::Blob, &TensorInfo)> {
        let (fi, info) =
            self.index.get(name).ok_or_else(|| FormatError::invalid(&self.dir, format!("missing tensor `{name}`")))?;
        Ok((self.files[*fi].blob(info), info))
    }

    /// A weight tensor; floats only (F32, F16, BF16), which is all a checkpoint's weights use.
    pub fn tensor(&self, name: &str) -> Result<TensorData> {
        let (fi, info) =
            self.index.get(name).ok_or_else(|| FormatError::invalid(&self.dir, format!("missing tensor `{name}`")))?;
        let file = &self.files[*fi];
        let dtype = match info.dtype.as_str() {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            other => {
                return Err(FormatError::invalid(
                    &file.path,
                    format!("tensor `{name}` has dtype {other}; weights must be F32, F16 or BF16"),
                ))
            }
        };
        Ok(TensorData {
            name: name.to_string(),
            file: file.path.clone(),
            dtype,
            shape: info.shape.clone(),
            data: file.blob(info),
        })
    }
}

/// Writes a safetensors file (used by tests and tools that make small checkpoints).
pub fn write(path: &Path, tensors: &[(&str, &str, &[usize], &[u8])]) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, dtype, shape, data) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + data.len()]}),
        );
        off += data.len();
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header))?;
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + off);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    std::fs::write(path, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = crate::scratch_root().join(format!("sluice-st-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn reads_back_what_it_wrote() {
        let d = tmpdir("rw");
        let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let b = vec![0u8; 6];
        write(&d.join("model.safetensors"), &[("a", "F32", &[2, 2], &a), ("b", "BF16", &[3], &b)]).unwrap();
        let m = SafetensorsModel::open(&d).unwrap();
        let t = m.tensor("a").unwrap();
        assert_eq!(t.dtype, DType::F32);
        assert_eq!(t.shape, vec![2, 2]);
        assert_eq!(&t.data[..], &a[..]);
        assert_eq!(m.tensor("b").unwrap().dtype, DType::BF16);
        let e = m.tensor("c").unwrap_err().to_string();
        assert!(e.contains("missing tensor `c`"), "{e}");
    }

    #[test]
    fn truncated_file_is_named_and_explained() {
        let d = tmpdir("trunc");
        let a = vec![0u8; 64];
        let p = d.join("model.safetensors");
        write(&p, &[("a", "F32", &[16], &a)]).unwrap();
        let full = std::fs::read(&p).unwrap();
        std::fs::write(&p, &full[..full.len() - 10]).unwrap();
        let e = SafetensorsModel::open(&d).err().unwrap().to_string();
        assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");
        std::fs::write(&p, &full[..4]).unwrap();
        let e = SafetensorsModel::open(&d).err().unwrap().to_string();
        assert!(e.contains("too short"), "{e}");
        std::fs::write(&p, &full[..20]).unwrap();
        let e = SafetensorsModel::open(&d).err().unwrap().to_string();
        assert!(e.contains("header claims"), "{e}");
    }

    #[test]
    fn shape_that_disagrees_with_bytes_is_refused() {
        let d = tmpdir("shape");
        let a = vec![0u8; 12];
        write(&d.join("model.safetensors"), &[("a", "F32", &[4], &a)]).unwrap();
        let e = SafetensorsModel::open(&d).err().unwrap().to_string();
        assert!(e.contains("needs 16 bytes but spans 12"), "{e}");
    }

    #[test]
    fn shape_whose_size_overflows_is_refused() {
        // Found while writing the fuzz harness (fuzz/fuzz_targets/safetensors.rs): the element
        // count, or the count times the element size, overflowed: a panic with overflow checks,
        // and without them a wrapped size of 0 that matched an empty byte range.
        for shape in ["[4294967296,4294967296]", "[4611686018427387904]", "[4294967296,4294967296,0]"] {
            let h = format!(r#"{{"a":{{"dtype":"F32","shape":{shape},"data_offsets":[0,0]}}}}"#);
            let mut b = (h.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(h.as_bytes());
            let e = parse_header_bytes(&b).unwrap_err().to_string();
            assert!(e.contains("tensor `a`") && e.contains("larger than memory can address"), "{e}");
        }
        // A zero dimension first is fine: an empty tensor.
        let h = r#"{"a":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}}"#;
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(h.as_bytes());
        assert_eq!(parse_header_bytes(&b).unwrap()["a"].numel(), 0);
    }

    #[test]
    fn offsets_that_overlap_or_leave_gaps_are_refused() {
        let file = |tensors: &[(&str, [usize; 2])], data: usize| {
            let entries: Vec<String> = tensors
                .iter()
                .map(|(n, [a, b])| format!(r#""{n}":{{"dtype":"U8","shape":[{}],"data_offsets":[{a},{b}]}}"#, b - a))
                .collect();
            let h = format!("{{{}}}", entries.join(","));
            let mut b = (h.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(h.as_bytes());
            b.resize(b.len() + data, 0);
            parse_header_bytes(&b)
        };
        assert_eq!(file(&[("a", [0, 4]), ("b", [4, 8])], 8).unwrap().len(), 2);
        let e = file(&[("a", [0, 8]), ("b", [4, 12])], 12).unwrap_err().to_string();
        assert!(e.contains("tensor `b` starts at byte 4") && e.contains("overlap"), "{e}");
        let e = file(&[("a", [0, 4]), ("b", [8, 12])], 12).unwrap_err().to_string();
        assert!(e.contains("tensor `b` starts at byte 8") && e.contains("gap"), "{e}");
        let e = file(&[("a", [0, 4])], 8).unwrap_err().to_string();
        assert!(e.contains("end at byte 4 of the data section, which has 8 bytes"), "{e}");
    }

    #[test]
    fn non_float_weight_dtype_is_refused_by_name() {
        let d = tmpdir("dtype");
        write(&d.join("model.safetensors"), &[("ids", "I64", &[2], &[0u8; 16])]).unwrap();
        let m = SafetensorsModel::open(&d).unwrap();
        let e = m.tensor("ids").unwrap_err().to_string();
        assert!(e.contains("`ids` has dtype I64"), "{e}");
    }

    #[test]
    fn sharded_index_is_followed() {
        let d = tmpdir("shard");
        write(&d.join("model-00001-of-00002.safetensors"), &[("a", "F32", &[1], &[0u8; 4])]).unwrap();
        write(&d.join("model-00002-of-00002.safetensors"), &[("b", "F32", &[1], &[0u8; 4])]).unwrap();
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let m = SafetensorsModel::open(&d).unwrap();
        assert!(m.contains("a") && m.contains("b"));
        assert!(m.file_of("b").unwrap().ends_with("model-00002-of-00002.safetensors"));
        std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
        let e = SafetensorsModel::open(&d).err().unwrap().to_string();
        assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
    }
}
