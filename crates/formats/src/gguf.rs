//! GGUF files (versions 2 and 3): metadata of every type, tensor infos, aligned data.
//!
//! The reader memory-maps the file and parses the header with bounds checks on every read:
//! a count or length that cannot fit in what is left of the file is an error before anything
//! is allocated for it, so a corrupt or truncated file gives a message, never a panic or an
//! absurd allocation. Tensor data stays in the map; a tensor is a `Blob` into it.

use crate::blob::{Backing, Blob};
use crate::error::{FormatError, Result};
use crate::safetensors::TensorData;
use sluice_kernels::DType;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A typed metadata array (token lists hold hundreds of thousands of entries).
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
    /// Arrays of arrays: allowed by the format, used by no model we know.
    Nested(Vec<Array>),
}

impl Array {
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Nested(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Integer elements as i64 (any integer element type).
    pub fn as_ints(&self) -> Option<Vec<i64>> {
        Some(match self {
            Array::U8(v) => v.iter().map(|x| *x as i64).collect(),
            Array::I8(v) => v.iter().map(|x| *x as i64).collect(),
            Array::U16(v) => v.iter().map(|x| *x as i64).collect(),
            Array::I16(v) => v.iter().map(|x| *x as i64).collect(),
            Array::U32(v) => v.iter().map(|x| *x as i64).collect(),
            Array::I32(v) => v.iter().map(|x| *x as i64).collect(),
            Array::U64(v) => v.iter().map(|x| *x as i64).collect(),
            Array::I64(v) => v.clone(),
            _ => return None,
        })
    }
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64).or(match *self {
                Value::I8(v) => Some(v as f64),
                Value::I16(v) => Some(v as f64),
                Value::I32(v) => Some(v as f64),
                Value::I64(v) => Some(v as f64),
                _ => None,
            }),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
}

/// A tensor's header entry.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the contiguous (row) dimension.
    pub dims: Vec<u64>,
    pub dtype: DType,
    /// Absolute byte offset in its file.
    pub offset: u64,
    pub size: u64,
    /// Which file of a split model holds it (0 for a single file).
    pub file: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row-major shape, outermost first (the reverse of GGML's order).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|d| *d as usize).collect()
    }
}

/// A GGUF model: one file, or the files of a split model (`NAME-00001-of-0000N.gguf` …, as
/// llama.cpp's `gguf-split` writes them: the metadata in the first, the tensors spread over
/// all, each file with a header of its own), opened from its first file.
pub struct GgufFile {
    /// The first (or only) file.
    pub path: PathBuf,
    /// Every file, in split order, with the start of its tensor data.
    pub files: Vec<(PathBuf, u64)>,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    index: BTreeMap<String, usize>,
    pub alignment: u64,
    pub data_offset: u64,
    maps: Vec<Arc<memmap2::Mmap>>,
}

/// Bounds-checked little-endian reader over the header bytes.
struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
    path: &'a Path,
    /// Set when a read ran past the end of `b` (the bytes end inside the header).
    ran_out: bool,
}

impl<'a> Reader<'a> {
    fn err(&self, msg: impl Into<String>) -> FormatError {
        FormatError::invalid(self.path, format!("{} (at byte {})", msg.into(), self.pos))
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if self.b.len() - self.pos < n {
            self.ran_out = true;
            return Err(self.err(format!("file ends inside {what} (truncated?)")));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn remaining(&self) -> usize {
        self.b.len() - self.pos
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().expect("2")))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4")))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8")))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        if n > self.remaining() as u64 {
            self.ran_out = true;
            return Err(self.err(format!("{what}: string of {n} bytes runs past the end of the file")));
        }
        let bytes = self.take(n as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err(format!("{what}: string is not valid UTF-8")))
    }

    /// Checks that `count` elements of at least `min_size` bytes each can still fit.
    fn check_count(&mut self, count: u64, min_size: u64, what: &str) -> Result<usize> {
        if count.checked_mul(min_size).is_none_or(|b| b > self.remaining() as u64) {
            self.ran_out = true;
            return Err(self.err(format!("{what}: {count} elements cannot fit in the rest of the file")));
        }
        Ok(count as usize)
    }

    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.u8(what)?),
            1 => Value::I8(self.u8(what)? as i8),
            2 => Value::U16(self.u16(what)?),
            3 => Value::I16(self.u16(what)? as i16),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(self.u32(what)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(what)?)),
            7 => match self.u8(what)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("{what}: boolean byte {b} is neither 0 nor 1"))),
            },
            8 => Value::String(self.string(what)?),
            9 => Value::Array(self.array(what, depth)?),
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(self.u64(what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(what)?)),
            t => return Err(self.err(format!("{what}: unknown metadata value type {t}"))),
        })
    }

    fn array(&mut self, what: &str, depth: usize) -> Result<Array> {
        if depth > 8 {
            return Err(self.err(format!("{what}: arrays nested too deeply")));
        }
        let ty = self.u32(what)?;
        let count = self.u64(what)?;
        macro_rules! prim {
            ($variant:ident, $size:expr, $read:expr) => {{
                let n = self.check_count(count, $size, what)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push($read(self)?);
                }
                Array::$variant(v)
            }};
        }
        Ok(match ty {
            0 => prim!(U8, 1, |r: &mut Self| r.u8(what)),
            1 => prim!(I8, 1, |r: &mut Self| r.u8(what).map(|v| v as i8)),
            2 => prim!(U16, 2, |r: &mut Self| r.u16(what)),
            3 => prim!(I16, 2, |r: &mut Self| r.u16(what).map(|v| v as i16)),
            4 => prim!(U32, 4, |r: &mut Self| r.u32(what)),
            5 => prim!(I32, 4, |r: &mut Self| r.u32(what).map(|v| v as i32)),
            6 => prim!(F32, 4, |r: &mut Self| r.u32(what).map(f32::from_bits)),
            7 => prim!(Bool, 1, |r: &mut Self| r.u8(what).map(|v| v != 0)),
            8 => prim!(String, 8, |r: &mut Self| r.string(what)),
            9 => prim!(Nested, 12, |r: &mut Self| r.array(what, depth + 1)),
            10 => prim!(U64, 8, |r: &mut Self| r.u64(what)),
            11 => prim!(I64, 8, |r: &mut Self| r.u64(what).map(|v| v as i64)),
            12 => prim!(F64, 8, |r: &mut Self| r.u64(what).map(f64::from_bits)),
            t => return Err(self.err(format!("{what}: unknown array element type {t}"))),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let mut first = Self::open_one(path)?;
        let count = first.get("split.count").and_then(Value::as_u64).unwrap_or(1);
        if count <= 1 {
            return Ok(first);
        }
        let no = first.get("split.no").and_then(Value::as_u64).unwrap_or(0);
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if no != 0 {
            let hint = split_name(name, 0, count as usize).unwrap_or_else(|| "the first file".into());
            return Err(FormatError::invalid(
                path,
                format!("part {} of a model split in {count}: open {hint}", no + 1),
            ));
        }
        for i in 1..count as usize {
            let sibling = split_name(name, i, count as usize).ok_or_else(|| {
                FormatError::invalid(
                    path,
                    format!("split in {count} files, but not named NAME-00001-of-{count:05}.gguf"),
                )
            })?;
            let p = path.with_file_name(&sibling);
            let part = Self::open_one(&p)?;
            let (pno, pcount) =
                (part.get("split.no").and_then(Value::as_u64), part.get("split.count").and_then(Value::as_u64));
            if pno != Some(i as u64) || pcount != Some(count) {
                return Err(FormatError::invalid(
                    &p,
                    format!(
                        "expected part {} of {count} (split.no {i}); it says split.no {pno:?} of {pcount:?}",
                        i + 1
                    ),
                ));
            }
            for mut t in part.tensors {
                t.file = i;
                if first.index.insert(t.name.clone(), first.tensors.len()).is_some() {
                    return Err(FormatError::invalid(&p, format!("tensor `{}` is also in another part", t.name)));
                }
                first.tensors.push(t);
            }
            first.files.extend(part.files);
            first.maps.extend(part.maps);
        }
        if let Some(n) = first.get("split.tensors.count").and_then(Value::as_u64) {
            if n != first.tensors.len() as u64 {
                return Err(FormatError::invalid(
                    path,
                    format!("split.tensors.count is {n}, the {count} parts hold {}", first.tensors.len()),
                ));
            }
        }
        Ok(first)
    }

    fn open_one(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|e| FormatError::io(path, e))?;
        // SAFETY: read-only map; see `SafetensorsFile::open`.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| FormatError::io(path, e))?;
        Self::parse(path, Arc::new(map))
    }

    fn parse(path: &Path, map: Arc<memmap2::Mmap>) -> Result<GgufFile> {
        let bytes: &[u8] = &map;
        let mut r = Reader { b: bytes, pos: 0, path, ran_out: false };
        let h = parse_header(&mut r)?;
        let Header { version, metadata, mut tensors, index, alignment, data_offset } = h;
        let file_len = bytes.len() as u64;
        for t in &mut tensors {
            let start = data_offset.checked_add(t.offset);
            match start.and_then(|s| s.checked_add(t.size)) {
                Some(end) if end <= file_len => t.offset = start.expect("checked"),
                _ => {
                    return Err(FormatError::invalid(
                        path,
                        format!(
                        "tensor `{}` ({} bytes at data offset {}) runs past the end of the file ({} bytes; truncated?)",
                        t.name, t.size, t.offset, file_len
                    ),
                    ))
                }
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            files: vec![(path.to_path_buf(), data_offset)],
            version,
            metadata,
            tensors,
            index,
            alignment,
            data_offset,
            maps: vec![map],
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|i| &self.tensors[*i])
    }

    /// A tensor's bytes and row-major shape.
    pub fn tensor(&self, name: &str) -> Option<TensorData> {
        let t = self.tensor_info(name)?;
        Some(TensorData {
            name: t.name.clone(),
            file: self.files[t.file].0.clone(),
            dtype: t.dtype,
            shape: t.shape(),
            data: Blob::new(self.maps[t.file].clone() as Arc<dyn Backing>, t.offset as usize, t.size as usize),
        })
    }

    /// Bytes of every file of the model.
    pub fn file_len(&self) -> u64 {
        self.maps.iter().map(|m| m.len() as u64).sum()
    }

    // Typed metadata accessors with errors naming the file and key.

    pub fn meta_u64(&self, key: &str) -> Result<u64> {
        let v =
            self.get(key).ok_or_else(|| FormatError::invalid(&self.path, format!("missing metadata key `{key}`")))?;
        v.as_u64().ok_or_else(|| FormatError::invalid(&self.path, format!("metadata key `{key}` is not an integer")))
    }

    pub fn meta_opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key).map(|_| self.meta_u64(key)).transpose()
    }

    pub fn meta_opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| FormatError::invalid(&self.path, format!("metadata key `{key}` is not a number"))),
        }
    }

    pub fn meta_str(&self, key: &str) -> Result<&str> {
        let v =
            self.get(key).ok_or_else(|| FormatError::invalid(&self.path, format!("missing metadata key `{key}`")))?;
        v.as_str().ok_or_else(|| FormatError::invalid(&self.path, format!("metadata key `{key}` is not a string")))
    }

    pub fn meta_opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| FormatError::invalid(&self.path, format!("metadata key `{key}` is not a boolean"))),
        }
    }

    pub fn meta_array(&self, key: &str) -> Option<&Array> {
        self.get(key).and_then(|v| v.as_array())
    }

    /// An error about this file.
    pub fn error(&self, msg: impl Into<String>) -> FormatError {
        FormatError::invalid(&self.path, msg)
    }
}

/// Writes a copy of `f` to `out` after `edit` has changed its metadata and tensor list (a
/// tensor kept under its name keeps its data; one added or resized gets zeros). For tools
/// that rename or patch keys, and for tests that make broken files.
pub fn rewrite(f: &GgufFile, out: &std::path::Path, edit: impl FnOnce(&mut GgufWriter)) -> std::io::Result<()> {
    let mut w = GgufWriter { alignment: f.alignment, ..Default::default() };
    w.metadata =
        f.metadata.iter().filter(|(k, _)| *k != "general.alignment").map(|(k, v)| (k.clone(), v.clone())).collect();
    w.tensors = f.tensors.iter().map(|t| (t.name.clone(), t.dims.clone(), t.dtype)).collect();
    edit(&mut w);
    let mut file = std::io::BufWriter::new(std::fs::File::create(out)?);
    let tensors = w.tensors.clone();
    w.write(&mut file, |i, o| {
        let (name, dims, dtype) = &tensors[i];
        let size = GgufWriter::tensor_size(dims, *dtype) as usize;
        match f.tensor(name).filter(|t| t.data.len() == size) {
            Some(t) => o.write_all(&t.data),
            None => {
                let zeros = [0u8; 1 << 16];
                let mut left = size;
                while left > 0 {
                    let n = left.min(zeros.len());
                    o.write_all(&zeros[..n])?;
                    left -= n;
                }
                Ok(())
            }
        }
    })?;
    file.into_inner().map_err(|e| e.into_error())?.sync_all()
}

/// Writes a GGUF v3 file: metadata, tensor infos, then each tensor's data, aligned. Tensor
/// data is produced by a callback so that a writer never holds a whole model in memory.
pub struct GgufWriter {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<(String, Vec<u64>, DType)>,
    pub alignment: u64,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter { metadata: Vec::new(), tensors: Vec::new(), alignment: DEFAULT_ALIGNMENT }
    }
}

fn write_string(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_value(w: &mut impl Write, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&[*x as u8]),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[*x as u8]),
        Value::String(s) => write_string(w, s),
        Value::Array(a) => write_array(w, a),
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

fn write_array(w: &mut impl Write, a: &Array) -> std::io::Result<()> {
    macro_rules! prim {
        ($ty:expr, $v:expr, $f:expr) => {{
            w.write_all(&($ty as u32).to_le_bytes())?;
            w.write_all(&($v.len() as u64).to_le_bytes())?;
            for x in $v {
                $f(&mut *w, x)?;
            }
            Ok(())
        }};
    }
    match a {
        Array::U8(v) => prim!(0, v, |w: &mut dyn Write, x: &u8| w.write_all(&[*x])),
        Array::I8(v) => prim!(1, v, |w: &mut dyn Write, x: &i8| w.write_all(&[*x as u8])),
        Array::U16(v) => prim!(2, v, |w: &mut dyn Write, x: &u16| w.write_all(&x.to_le_bytes())),
        Array::I16(v) => prim!(3, v, |w: &mut dyn Write, x: &i16| w.write_all(&x.to_le_bytes())),
        Array::U32(v) => prim!(4, v, |w: &mut dyn Write, x: &u32| w.write_all(&x.to_le_bytes())),
        Array::I32(v) => prim!(5, v, |w: &mut dyn Write, x: &i32| w.write_all(&x.to_le_bytes())),
        Array::F32(v) => prim!(6, v, |w: &mut dyn Write, x: &f32| w.write_all(&x.to_le_bytes())),
        Array::Bool(v) => prim!(7, v, |w: &mut dyn Write, x: &bool| w.write_all(&[*x as u8])),
        Array::String(v) => {
            w.write_all(&8u32.to_le_bytes())?;
            w.write_all(&(v.len() as u64).to_le_bytes())?;
            for s in v {
                write_string(w, s)?;
            }
            Ok(())
        }
        Array::U64(v) => prim!(10, v, |w: &mut dyn Write, x: &u64| w.write_all(&x.to_le_bytes())),
        Array::I64(v) => prim!(11, v, |w: &mut dyn Write, x: &i64| w.write_all(&x.to_le_bytes())),
        Array::F64(v) => prim!(12, v, |w: &mut dyn Write, x: &f64| w.write_all(&x.to_le_bytes())),
        Array::Nested(v) => {
            w.write_all(&9u32.to_le_bytes())?;
            w.write_all(&(v.len() as u64).to_le_bytes())?;
            for x in v {
                write_array(w, x)?;
            }
            Ok(())
        }
    }
}

impl GgufWriter {
    pub fn add(&mut self, key: &str, v: Value) {
        self.metadata.push((key.to_string(), v));
    }

    /// Declares a tensor (GGML dim order: `dims[0]` contiguous).
    pub fn add_tensor(&mut self, name: &str, dims: Vec<u64>, dtype: DType) {
        self.tensors.push((name.to_string(), dims, dtype));
    }

    fn tensor_size(dims: &[u64], dtype: DType) -> u64 {
        dims.iter().product::<u64>() / dtype.block_elems() as u64 * dtype.block_bytes() as u64
    }

    /// Writes the header, then asks `data(i, out)` for each declared tensor's bytes in order.
    pub fn write<W: Write + ?Sized>(
        &self,
        out: &mut W,
        mut data: impl FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
    ) -> std::io::Result<u64> {
        let mut h: Vec<u8> = Vec::new();
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&3u32.to_le_bytes());
        h.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        let has_align = self.metadata.iter().any(|(k, _)| k == "general.alignment");
        let n_kv = self.metadata.len() + usize::from(!has_align && self.alignment != DEFAULT_ALIGNMENT);
        h.extend_from_slice(&(n_kv as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_string(&mut h, k)?;
            h.extend_from_slice(&v.type_id().to_le_bytes());
            write_value(&mut h, v)?;
        }
        if !has_align && self.alignment != DEFAULT_ALIGNMENT {
            write_string(&mut h, "general.alignment")?;
            h.extend_from_slice(&4u32.to_le_bytes());
            h.extend_from_slice(&(self.alignment as u32).to_le_bytes());
        }
        let mut off = 0u64;
        for (name, dims, dtype) in &self.tensors {
            write_string(&mut h, name)?;
            h.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&dtype.ggml_id().to_le_bytes());
            h.extend_from_slice(&off.to_le_bytes());
            off = (off + Self::tensor_size(dims, *dtype)).div_ceil(self.alignment) * self.alignment;
        }
        let pad = (h.len() as u64).div_ceil(self.alignment) * self.alignment - h.len() as u64;
        h.extend(std::iter::repeat_n(0u8, pad as usize));
        out.write_all(&h)?;
        let mut written = h.len() as u64;
        for (i, (name, dims, dtype)) in self.tensors.iter().enumerate() {
            let size = Self::tensor_size(dims, *dtype);
            let mut counter = CountingWriter { inner: &mut *out, n: 0 };
            data(i, &mut counter)?;
            if counter.n != size {
                return Err(std::io::Error::other(format!(
                    "tensor `{name}`: wrote {} bytes, expected {size}",
                    counter.n
                )));
            }
            let padded = size.div_ceil(self.alignment) * self.alignment;
            out.write_all(&vec![0u8; (padded - size) as usize])?;
            written += padded;
        }
        Ok(written)
    }
}

struct CountingWriter<'a, W: Write + ?Sized> {
    inner: &'a mut W,
    n: u64,
}

impl<W: Write + ?Sized> Write for CountingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.n += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// What a GGUF header says, before its tensors are checked against the file's length.
struct Header {
    version: u32,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    index: BTreeMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

fn parse_header(r: &mut Reader) -> Result<Header> {
    let path = r.path;
    let magic = r.take(4, "the magic number").map_err(|_| FormatError::invalid(path, "not a GGUF file (too short)"))?;
    if magic != MAGIC {
        return Err(FormatError::invalid(path, "not a GGUF file (bad magic number)"));
    }
    let version = r.u32("the version")?;
    match version {
        2 | 3 => {}
        1 => return Err(FormatError::invalid(path, "GGUF version 1 is not supported (re-convert the model)")),
        v if v.swap_bytes() <= 3 => return Err(FormatError::invalid(path, "big-endian GGUF files are not supported")),
        v => return Err(FormatError::invalid(path, format!("unknown GGUF version {v}"))),
    }
    let n_tensors = r.u64("the tensor count")?;
    let n_kv = r.u64("the metadata count")?;
    // Each metadata entry takes at least 8 + 4 + 1 bytes; each tensor info at least 8 + 4 + 4 + 8.
    r.check_count(n_kv, 13, "metadata")?;
    r.check_count(n_tensors, 24, "tensor infos")?;

    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string("a metadata key")?;
        let ty = r.u32(&key)?;
        let v = r.value(ty, &key, 0)?;
        metadata.insert(key, v);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => return Err(FormatError::invalid(path, format!("general.alignment {v:?} is not a power of two"))),
        },
    };

    let mut tensors = Vec::new();
    let mut index = BTreeMap::new();
    for i in 0..n_tensors {
        let name = r.string("a tensor name")?;
        let nd = r.u32(&name)?;
        if nd == 0 || nd > MAX_DIMS {
            return Err(r.err(format!("tensor `{name}` has {nd} dimensions (1 to {MAX_DIMS} allowed)")));
        }
        let mut dims = Vec::with_capacity(nd as usize);
        for _ in 0..nd {
            dims.push(r.u64(&name)?);
        }
        let ty = r.u32(&name)?;
        let dtype = DType::from_ggml_id(ty)
            .ok_or_else(|| r.err(format!("tensor `{name}` has unknown or unsupported quantization type {ty}")))?;
        let offset = r.u64(&name)?;
        let numel = dims.iter().try_fold(1u64, |a, d| a.checked_mul(*d));
        let size = numel
            .filter(|n| n % dtype.block_elems() as u64 == 0 && dims[0] % dtype.block_elems() as u64 == 0)
            .and_then(|n| (n / dtype.block_elems() as u64).checked_mul(dtype.block_bytes() as u64))
            .ok_or_else(|| {
                r.err(format!("tensor `{name}` of dims {dims:?} is not a whole number of {dtype} blocks"))
            })?;
        if offset % alignment != 0 {
            return Err(r.err(format!("tensor `{name}` data offset {offset} is not aligned to {alignment}")));
        }
        if index.insert(name.clone(), i as usize).is_some() {
            return Err(r.err(format!("tensor `{name}` appears twice")));
        }
        tensors.push(TensorInfo { name, dims, dtype, offset, size, file: 0 });
    }
    let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
    Ok(Header { version, metadata, tensors, index, alignment, data_offset })
}

/// How many bytes the header of a GGUF file takes (up to the aligned start of its tensor
/// data), read from the file's first bytes: `Ok(None)` when `prefix` ends inside the header
/// (read more and ask again). What a remote model's opener fetches before anything else.
pub fn header_len(prefix: &[u8]) -> Result<Option<u64>> {
    let mut r = Reader { b: prefix, pos: 0, path: Path::new("<header>"), ran_out: false };
    match parse_header(&mut r) {
        Ok(h) => Ok(Some(h.data_offset)),
        Err(_) if r.ran_out => Ok(None),
        Err(e) => Err(e),
    }
}

/// The name of part `no` (from 0) of a model split in `count` files, from the name of any
/// of its parts (`NAME-00001-of-00004.gguf` → `NAME-0000{no+1}-of-00004.gguf`); `None` when
/// `name` does not follow that pattern for `count`.
pub fn split_name(name: &str, no: usize, count: usize) -> Option<String> {
    let stem = name.strip_suffix(".gguf")?;
    let tail = format!("-of-{count:05}");
    let base = stem.strip_suffix(&tail)?;
    let (prefix, digits) = base.rsplit_once('-')?;
    if digits.len() != 5 || !digits.bytes().all(|b| b.is_ascii_digit()) || no >= count {
        return None;
    }
    Some(format!("{prefix}-{:05}{tail}.gguf", no + 1))
}

/// Parses GGUF bytes held in memory (the fuzz harness and tests use it).
pub fn parse_bytes(bytes: &[u8]) -> Result<GgufFile> {
    if bytes.is_empty() {
        return Err(FormatError::invalid("<memory>", "not a GGUF file (too short)"));
    }
    let mut anon = memmap2::MmapMut::map_anon(bytes.len()).map_err(|e| FormatError::io("<memory>", e))?;
    anon.copy_from_slice(bytes);
    let map = anon.make_read_only().map_err(|e| FormatError::io("<memory>", e))?;
    GgufFile::parse(Path::new("<memory>"), Arc::new(map))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut w = GgufWriter::default();
        w.add("general.architecture", Value::String("llama".into()));
        w.add("llama.block_count", Value::U32(2));
        w.add("some.f64", Value::F64(0.5));
        w.add("tokenizer.ggml.tokens", Value::Array(Array::String(vec!["a".into(), "bc".into()])));
        w.add("tokenizer.ggml.scores", Value::Array(Array::F32(vec![0.0, -1.5])));
        w.add("nested", Value::Array(Array::Nested(vec![Array::I32(vec![1, 2]), Array::Bool(vec![true])])));
        w.add_tensor("a", vec![32, 2], DType::Q8_0);
        w.add_tensor("b", vec![3], DType::F32);
        let mut out = Vec::new();
        w.write(&mut out, |i, o| if i == 0 { o.write_all(&[7u8; 68]) } else { o.write_all(&[1u8; 12]) }).unwrap();
        out
    }

    #[test]
    fn split_names_follow_gguf_split() {
        assert_eq!(split_name("m-00001-of-00004.gguf", 2, 4).as_deref(), Some("m-00003-of-00004.gguf"));
        assert_eq!(split_name("a-b-00003-of-00012.gguf", 0, 12).as_deref(), Some("a-b-00001-of-00012.gguf"));
        assert_eq!(split_name("m-00001-of-00004.gguf", 4, 4), None);
        assert_eq!(split_name("m-00001-of-00004.gguf", 0, 3), None);
        assert_eq!(split_name("m.gguf", 0, 2), None);
    }

    #[test]
    fn header_len_reads_the_header_from_a_prefix_and_asks_for_more_when_it_is_cut() {
        let b = sample();
        let f = parse_bytes(&b).unwrap();
        assert_eq!(header_len(&b).unwrap(), Some(f.data_offset));
        assert_eq!(header_len(&b[..f.data_offset as usize]).unwrap(), Some(f.data_offset));
        for cut in [0, 3, 10, 30, 100, f.data_offset as usize - 40] {
            assert_eq!(header_len(&b[..cut]).unwrap(), None, "cut at {cut}");
        }
        let mut bad = b.clone();
        bad[0] = b'X';
        assert!(header_len(&bad).is_err(), "not GGUF is an error, not a request for more");
    }

    #[test]
    fn round_trips_metadata_and_tensors() {
        let f = parse_bytes(&sample()).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.meta_str("general.architecture").unwrap(), "llama");
        assert_eq!(f.meta_u64("llama.block_count").unwrap(), 2);
        assert_eq!(f.meta_opt_f64("some.f64").unwrap(), Some(0.5));
        assert_eq!(f.meta_array("tokenizer.ggml.tokens").unwrap().len(), 2);
        let a = f.tensor("a").unwrap();
        assert_eq!(a.shape, vec![2, 32]);
        assert_eq!(a.dtype, DType::Q8_0);
        assert!(a.data.iter().all(|b| *b == 7) && a.data.len() == 68);
        let b = f.tensor("b").unwrap();
        assert_eq!(b.data.len(), 12);
        assert_eq!(b.data.as_ptr() as usize % 32, f.maps[0].as_ptr() as usize % 32);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = sample();
        let f = parse_bytes(&full).unwrap();
        let end = f.tensors.iter().map(|t| t.offset + t.size).max().unwrap() as usize;
        // Cutting only the final padding leaves a valid file; cutting anything before is an error.
        for n in 0..end {
            assert!(parse_bytes(&full[..n]).is_err(), "prefix of {n} bytes parsed");
        }
    }

    #[test]
    fn corrupt_fields_are_named() {
        let mut b = sample();
        b[0] = b'X';
        assert!(parse_bytes(&b).err().unwrap().to_string().contains("bad magic"));
        let mut b = sample();
        b[4] = 9;
        assert!(parse_bytes(&b).err().unwrap().to_string().contains("unknown GGUF version 9"));
        // A metadata count no file could hold.
        let mut b = sample();
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse_bytes(&b).err().unwrap().to_string().contains("cannot fit"));
        // An unknown tensor type: find tensor `b`'s type field (after its name and dims).
        let b0 = sample();
        let pos = b0.windows(9).position(|w| w == b"\x01\x00\x00\x00\x00\x00\x00\x00b").unwrap() + 9;
        let ty = pos + 4 + 8;
        let mut b = b0.clone();
        b[ty..ty + 4].copy_from_slice(&77u32.to_le_bytes());
        let e = parse_bytes(&b).err().unwrap().to_string();
        assert!(e.contains("tensor `b`") && e.contains("quantization type 77"), "{e}");
        // A tensor whose data runs past the end.
        let mut b = b0.clone();
        b[ty + 4..ty + 12].copy_from_slice(&(1u64 << 20).to_le_bytes());
        let e = parse_bytes(&b).err().unwrap().to_string();
        assert!(e.contains("runs past the end"), "{e}");
    }
}
