//! The pack: an offload-ready copy of a model's routed experts. One 4 KiB-aligned,
//! contiguous record per (layer, expert) holding gate | up | down in the kernels' form (their
//! stored format; an expert stored otherwise, like gpt-oss's fused Hugging Face tensors, is
//! rewritten as it is packed), so a miss is one aligned read straight into a slot; an index
//! with a checksum per record; and the fingerprint of the model it was made from (a pack
//! refuses any other model).
//!
//! File: `SLUICEPK`, u32 version, u32 0, u64 index length, the index (JSON), zero padding to
//! 4 KiB, then the records.

use crate::layout::{align_up, ExpertPlan, Layout, PartLoc, ALIGN};
use crate::{ExpertError, Result};
use sluice_kernels::DType;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"SLUICEPK";
const VERSION: u32 = 1;

#[derive(serde::Serialize, serde::Deserialize)]
struct Index {
    format: String,
    version: u32,
    fingerprint: String,
    source: String,
    layers: usize,
    records: Vec<Record>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    layer: usize,
    expert: usize,
    offset: u64,
    /// (dtype, rows, cols, bytes) of gate, up, down.
    parts: Vec<(String, usize, usize, u64)>,
    checksum: String,
}

/// Writes a pack of `layout`'s experts to `out`. `progress(bytes)` is called as records land.
pub fn write_pack(
    layout: &Layout,
    fingerprint: &str,
    source: &str,
    out: &Path,
    mut progress: impl FnMut(u64),
) -> Result<u64> {
    fn io(p: &Path) -> impl Fn(std::io::Error) -> ExpertError + '_ {
        move |e| ExpertError::Io { path: p.to_path_buf(), source: e }
    }
    let files: Vec<std::fs::File> =
        layout.files.iter().map(|p| std::fs::File::open(p).map_err(io(p))).collect::<Result<_>>()?;
    // Offsets first (the index goes before the records).
    let mut records = Vec::new();
    let mut body = 0u64;
    for (l, layer) in layout.experts.iter().enumerate() {
        for (e, plan) in layer.iter().enumerate() {
            records.push(Record {
                layer: l,
                expert: e,
                offset: body,
                parts: plan.parts.iter().map(|p| (p.dtype.name().to_string(), p.rows, p.cols, p.len)).collect(),
                checksum: String::new(),
            });
            body += align_up(plan.payload_bytes());
        }
    }
    // Checksums need the bytes: compute them in a first pass so the index is final.
    let mut raw = Vec::new();
    let mut read_expert = |plan: &ExpertPlan, buf: &mut Vec<u8>| -> Result<()> {
        buf.clear();
        if let Some(r) = &plan.reform {
            // Stored in another form: records hold the kernels' matrices.
            raw.clear();
            raw.resize(r.raw_bytes as usize, 0);
            for (&(f, offset, len), &at) in r.sources.iter().zip(&r.raw_offsets) {
                let dst = &mut raw[at as usize..][..len as usize];
                files[f].read_exact_at(dst, offset).map_err(io(&layout.files[f]))?;
            }
            let [g, u, d] = plan.parts.each_ref().map(|p| p.len);
            buf.resize((g + u + d) as usize, 0);
            return r
                .apply(&raw, buf, &[0, g, g + u])
                .map_err(|m| ExpertError::Model(format!("{}: {m}", layout.files[r.sources[0].0].display())));
        }
        for p in &plan.parts {
            let start = buf.len();
            buf.resize(start + p.len as usize, 0);
            files[p.file].read_exact_at(&mut buf[start..], p.offset).map_err(io(&layout.files[p.file]))?;
        }
        Ok(())
    };
    let mut buf = Vec::new();
    let mut i = 0;
    for layer in &layout.experts {
        for plan in layer {
            read_expert(plan, &mut buf)?;
            // A pack holds only what the kernels can take: no weight has an MXFP4 scale of 0xFF
            // (a rewritten expert was checked as it was rewritten).
            let [g, u, _] = plan.parts.each_ref().map(|p| p.len);
            let bad = if plan.reform.is_some() { None } else { plan.check(&buf, &[0, g, g + u]) };
            if let Some(m) = bad {
                return Err(ExpertError::Model(format!(
                    "layer {} expert {}: {m}",
                    records[i].layer, records[i].expert
                )));
            }
            records[i].checksum = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&buf));
            i += 1;
        }
    }
    let index = Index {
        format: "sluice-pack".into(),
        version: VERSION,
        fingerprint: fingerprint.into(),
        source: source.into(),
        layers: layout.experts.len(),
        records,
    };
    let json = serde_json::to_vec(&index).map_err(|e| ExpertError::Model(e.to_string()))?;
    let header = align_up(24 + json.len() as u64);
    let tmp = out.with_extension("partial");
    let f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
    let mut head = Vec::with_capacity(header as usize);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&0u32.to_le_bytes());
    head.extend_from_slice(&(json.len() as u64).to_le_bytes());
    head.extend_from_slice(&json);
    head.resize(header as usize, 0);
    w.write_all(&head).map_err(io(&tmp))?;
    for layer in &layout.experts {
        for plan in layer {
            read_expert(plan, &mut buf)?;
            let padded = align_up(buf.len() as u64) as usize;
            buf.resize(padded, 0);
            w.write_all(&buf).map_err(io(&tmp))?;
            progress(padded as u64);
        }
    }
    let f = w.into_inner().map_err(|e| ExpertError::Io { path: tmp.clone(), source: e.into_error() })?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, out).map_err(io(out))?;
    Ok(header + body)
}

/// Opens a pack and checks it belongs to the model with `fingerprint`.
pub fn open_pack(path: &Path, fingerprint: &str) -> Result<Layout> {
    let bad = |m: String| ExpertError::Pack { path: path.to_path_buf(), msg: m };
    let f = std::fs::File::open(path).map_err(|e| ExpertError::Io { path: path.to_path_buf(), source: e })?;
    let len = f.metadata().map_err(|e| ExpertError::Io { path: path.to_path_buf(), source: e })?.len();
    let mut head = [0u8; 24];
    f.read_exact_at(&mut head, 0).map_err(|_| bad("too short to be a pack".into()))?;
    if &head[..8] != MAGIC {
        return Err(bad("not a sluice pack (bad magic)".into()));
    }
    let version = u32::from_le_bytes(head[8..12].try_into().expect("4"));
    if version != VERSION {
        return Err(bad(format!("pack version {version} is not supported (expected {VERSION})")));
    }
    let jlen = u64::from_le_bytes(head[16..24].try_into().expect("8"));
    if jlen > len.saturating_sub(24) {
        return Err(bad(format!("index of {jlen} bytes runs past the end of the file (truncated?)")));
    }
    let mut json = vec![0u8; jlen as usize];
    f.read_exact_at(&mut json, 24).map_err(|e| ExpertError::Io { path: path.to_path_buf(), source: e })?;
    let index: Index = serde_json::from_slice(&json).map_err(|e| bad(format!("index is not valid: {e}")))?;
    if index.fingerprint != fingerprint {
        return Err(bad(format!(
            "made from a different model ({}; fingerprint {} here, {} expected): repack it with `sluice pack`",
            index.source, index.fingerprint, fingerprint
        )));
    }
    let header = align_up(24 + jlen);
    // Every number below comes from the file: bound it before allocating or adding.
    if index.layers > MAX_LAYERS {
        return Err(bad(format!("index claims {} layers (at most {MAX_LAYERS} are plausible)", index.layers)));
    }
    let mut experts: Vec<Vec<ExpertPlan>> = vec![Vec::new(); index.layers];
    for r in index.records {
        if r.parts.len() != 3 || r.layer >= index.layers {
            return Err(bad(format!("record for layer {} expert {} is malformed", r.layer, r.expert)));
        }
        let mut parts = Vec::with_capacity(3);
        for (dt, rows, cols, bytes) in &r.parts {
            let dtype = DType::from_name(dt).ok_or_else(|| bad(format!("unknown dtype {dt}")))?;
            let need = dtype.row_bytes(*cols).and_then(|b| b.checked_mul(*rows)).map(|b| b as u64);
            if need != Some(*bytes) {
                return Err(bad(format!(
                    "record for layer {} expert {}: a {rows}x{cols} {dt} matrix cannot take {bytes} bytes",
                    r.layer, r.expert
                )));
            }
            parts.push(PartLoc { file: 0, offset: 0, len: *bytes, dtype, rows: *rows, cols: *cols });
        }
        let total = parts.iter().try_fold(0u64, |a, p| a.checked_add(p.len));
        let end = header.checked_add(r.offset).and_then(|o| Some((o, o.checked_add(total?)?)));
        let Some((offset, _)) = end.filter(|(o, e)| o.is_multiple_of(ALIGN) && *e <= len) else {
            return Err(bad(format!(
                "record for layer {} expert {} runs past the end of the file (truncated?)",
                r.layer, r.expert
            )));
        };
        let sum = u64::from_str_radix(&r.checksum, 16).map_err(|_| bad("bad checksum field".into()))?;
        let layer = &mut experts[r.layer];
        if layer.len() != r.expert {
            return Err(bad(format!("records out of order at layer {} expert {}", r.layer, r.expert)));
        }
        let parts: [PartLoc; 3] = parts.try_into().expect("3 parts");
        layer.push(ExpertPlan::from_record(0, offset, parts, sum));
    }
    Ok(Layout { files: vec![PathBuf::from(path)], experts })
}

/// No model has more layers than this; a pack index that says so is damaged.
const MAX_LAYERS: usize = 1 << 12;

/// Checks that a pack's layout describes the same experts as the model's own: the same layers,
/// experts, and for each part the same format and shape. The fingerprint ties a pack to its
/// model; this keeps a damaged index from steering the kernels outside a slot.
pub fn check_matches(pack: &Layout, model: &Layout, path: &Path) -> Result<()> {
    let bad = |m: String| ExpertError::Pack { path: path.to_path_buf(), msg: m };
    if pack.experts.len() != model.experts.len() {
        return Err(bad(format!("has {} layers, the model {}", pack.experts.len(), model.experts.len())));
    }
    for (l, (a, b)) in pack.experts.iter().zip(&model.experts).enumerate() {
        if a.len() != b.len() {
            return Err(bad(format!("layer {l} has {} experts, the model {}", a.len(), b.len())));
        }
        for (e, (x, y)) in a.iter().zip(b).enumerate() {
            for (p, q) in x.parts.iter().zip(&y.parts) {
                if (p.dtype, p.rows, p.cols, p.len) != (q.dtype, q.rows, q.cols, q.len) {
                    return Err(bad(format!(
                        "layer {l} expert {e}: {}x{} {} in the pack, {}x{} {} in the model",
                        p.rows,
                        p.cols,
                        p.dtype.name(),
                        q.rows,
                        q.cols,
                        q.dtype.name()
                    )));
                }
            }
        }
    }
    Ok(())
}
