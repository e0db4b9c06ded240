//! Opening a model by URL: the header and every dense byte are fetched once into a local
//! stand-in of each remote file (same length, same offsets, the experts' ranges left as
//! holes of a sparse file), and the model is opened from the stand-ins as from a local copy.
//! The expert cache then reads experts through a `TieredReader`, never from the holes.
//!
//! A stand-in is complete only when its marker (`dense.json`: the remote files as opened,
//! and a checksum of every range fetched) is in place; the marker is written after the data
//! is synced, under a temporary name and renamed. On the next start the marker must name
//! the same files (URL, length, validator) and every range must still match its checksum;
//! anything else is fetched again. One process builds a stand-in at a time (a lock file);
//! others wait and then use it.

use crate::disk::DiskTier;
use crate::http::{Http, HttpOptions, Remote};
use crate::tiered::{Source, TieredReader};
use sluice_experts::layout::Layout;
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct RemoteOptions {
    /// Where stand-ins and the disk tier's records live.
    pub dir: PathBuf,
    /// Bytes of expert records the disk tier may keep (0: none; dense weights are kept
    /// apart from this quota).
    pub disk_quota: u64,
    /// Endpoint of an S3-compatible store for `s3://` URLs.
    pub s3_endpoint: Option<String>,
    pub http: HttpOptions,
    /// Range requests in flight while fetching dense weights.
    pub parallel: usize,
}

impl RemoteOptions {
    /// Defaults: `~/.cache/sluice/remote`, no expert records kept, Hugging Face's token from
    /// the environment for its hosts.
    pub fn new() -> RemoteOptions {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
        RemoteOptions {
            dir: home.join(".cache/sluice/remote"),
            disk_quota: 0,
            s3_endpoint: None,
            http: HttpOptions::from_env(),
            parallel: 8,
        }
    }
}

impl Default for RemoteOptions {
    fn default() -> Self {
        Self::new()
    }
}

/// A remote model opened for running.
pub struct Mirror {
    pub url: String,
    /// What to open: the stand-in GGUF file, or the directory of a Hugging Face checkpoint.
    pub local: PathBuf,
    pub reader: Arc<TieredReader>,
    /// Dense bytes fetched now (0 when the stand-ins were already complete) and how long
    /// that took.
    pub fetched_bytes: u64,
    pub fetch_seconds: f64,
    /// Bytes of the header and dense weights the stand-ins hold.
    pub dense_bytes: u64,
}

/// Whether `s` names a remote model rather than a local path.
pub fn is_remote(s: &str) -> bool {
    s.starts_with("http://") || s.starts_with("https://") || s.starts_with("s3://")
}

#[derive(serde::Serialize, serde::Deserialize, PartialEq)]
struct Marker {
    files: Vec<(String, Remote)>,
    /// (file, offset, length, xxh3) of every range fetched into the stand-ins.
    ranges: Vec<(usize, u64, u64, u64)>,
}

/// The files of the model at `url`: the weights files (with their remote descriptions) and,
/// for a Hugging Face directory, the small files beside them (with their bytes). The flag
/// says whether it is a single GGUF file.
pub(crate) type Files = Vec<(String, Option<Remote>, Option<Vec<u8>>)>;

pub(crate) fn remote_files(url: &str, o: &RemoteOptions) -> io::Result<(Arc<Http>, Files, bool)> {
    let mut http_opts = o.http.clone();
    let target = if url.starts_with("s3://") {
        let t = crate::s3::resolve(url, o.s3_endpoint.as_deref()).map_err(io::Error::other)?;
        http_opts.s3 = t.auth;
        t.url
    } else {
        url.to_string()
    };
    let http = Arc::new(Http::new(http_opts)?);
    let gguf = target.split(['?', '#']).next().unwrap_or("").ends_with(".gguf");
    if gguf {
        // One file, or every part of a split model (`NAME-00001-of-0000N.gguf` …).
        let path = target.split(['?', '#']).next().unwrap_or("");
        let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
        let query = &target[path.len()..];
        let count = name
            .rsplit_once("-of-")
            .and_then(|(_, c)| c.strip_suffix(".gguf"))
            .and_then(|c| c.parse::<usize>().ok())
            .filter(|c| *c > 1 && sluice_formats::gguf::split_name(name, 0, *c).is_some());
        let names: Vec<String> = match count {
            Some(c) => (0..c).map(|i| sluice_formats::gguf::split_name(name, i, c).expect("checked")).collect(),
            None => vec![name.to_string()],
        };
        let mut files: Files = Vec::new();
        for n in names {
            let r = http.open(&format!("{dir}/{n}{query}"))?;
            files.push((n, Some(r), None));
        }
        return Ok((http, files, true));
    }
    let base = target.trim_end_matches('/');
    let mut files: Files = Vec::new();
    let small = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"];
    for n in small.iter().chain(&["chat_template.jinja", "special_tokens_map.json"]) {
        match http.get_small(&format!("{base}/{n}"))? {
            Some(b) => files.push((n.to_string(), None, Some(b))),
            None if *n == "config.json" => {
                return Err(io::Error::other(format!(
                    "{url}: neither a .gguf file nor a Hugging Face model directory ({base}/config.json not found)"
                )))
            }
            None => {}
        }
    }
    let shards = match http.get_small(&format!("{base}/model.safetensors.index.json"))? {
        Some(b) => {
            let names =
                shard_names(&b).map_err(|e| io::Error::other(format!("{base}/model.safetensors.index.json: {e}")))?;
            files.push(("model.safetensors.index.json".into(), None, Some(b)));
            names
        }
        None => vec!["model.safetensors".to_string()],
    };
    for s in shards {
        let r = http.open(&format!("{base}/{s}"))?;
        files.push((s, Some(r), None));
    }
    Ok((http, files, false))
}

/// Opens the model at `url` (a `.gguf` file, or a Hugging Face checkpoint directory with
/// `config.json` and `model.safetensors[.index.json]`).
pub fn open(url: &str, o: &RemoteOptions) -> io::Result<Mirror> {
    let name = if url.ends_with(".gguf") { url.to_string() } else { format!("{}/", url.trim_end_matches('/')) };
    let model_dir = o.dir.join(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(name.as_bytes())));
    fs::create_dir_all(&model_dir).map_err(|e| at(&model_dir, e))?;
    let lock = File::create(model_dir.join("build.lock")).map_err(|e| at(&model_dir, e))?;
    // SAFETY: flock on a descriptor this function owns; released when `lock` drops.
    unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
    let (http, all, gguf) = remote_files(url, o)?;

    // The remote files and their stand-ins, under their own names (the parts of a split GGUF
    // find each other by name); small files are written whole.
    let base = model_dir.join(if gguf { "gguf" } else { "hf" });
    fs::create_dir_all(&base).map_err(|e| at(&base, e))?;
    let local = if gguf { base.join(&all[0].0) } else { base.clone() };
    let mut files: Vec<(String, Remote, PathBuf)> = Vec::new();
    for (n, remote, small) in all {
        let p = base.join(&n);
        if let Some(b) = small {
            write_atomic(&p, &b)?;
        }
        if let Some(r) = remote {
            files.push((n, r, p));
        }
    }

    let sources: Vec<Source> = files
        .iter()
        .map(|(_, r, p)| Source {
            remote: r.clone(),
            local: p.clone(),
            key: format!(
                "{:016x}",
                xxhash_rust::xxh3::xxh3_64(format!("{}|{}|{:?}", r.url, r.len, r.validator).as_bytes())
            ),
        })
        .collect();
    let marker_path = model_dir.join("dense.json");
    let want: Vec<(String, Remote)> = files.iter().map(|(n, r, _)| (n.clone(), r.clone())).collect();
    let t = Instant::now();
    let (fetched, dense) = match read_marker(&marker_path, &want, &sources) {
        Some(dense) => (0, dense),
        None => {
            let _ = fs::remove_file(&marker_path);
            let ranges = build(&http, &sources, gguf, &local, o.parallel.max(1))?;
            let dense: u64 = ranges.iter().map(|r| r.2).sum();
            let m = Marker { files: want, ranges };
            write_atomic(&marker_path, &serde_json::to_vec(&m).expect("serializable"))?;
            (dense, dense)
        }
    };
    let disk =
        if o.disk_quota > 0 { Some(Arc::new(DiskTier::open(&o.dir.join("experts"), o.disk_quota)?)) } else { None };
    Ok(Mirror {
        url: url.to_string(),
        local,
        reader: Arc::new(TieredReader::new(http, sources, disk)),
        fetched_bytes: fetched,
        fetch_seconds: t.elapsed().as_secs_f64(),
        dense_bytes: dense,
    })
}

fn at(p: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", p.display()))
}

fn shard_names(index: &[u8]) -> Result<Vec<String>, String> {
    let v: serde_json::Value = serde_json::from_slice(index).map_err(|e| format!("not valid JSON: {e}"))?;
    let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or("no `weight_map` object")?;
    let mut names: Vec<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
    names.sort();
    names.dedup();
    if let Some(n) = names.iter().find(|n| n.contains('/') || n.contains("..") || n.is_empty()) {
        return Err(format!("shard name `{n}` is not a plain file name"));
    }
    Ok(names)
}

/// Writes `bytes` to `path` so that the file is either absent, the old one, or whole.
fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let r = (|| {
        fs::write(&tmp, bytes)?;
        File::open(&tmp)?.sync_all()?;
        fs::rename(&tmp, path)?;
        File::open(path.parent().expect("a file has a directory"))?.sync_all()
    })();
    r.map_err(|e| at(path, e))
}

/// The marker's dense byte count if it names exactly `want` and every range it lists still
/// holds the bytes it was fetched with.
fn read_marker(path: &Path, want: &[(String, Remote)], sources: &[Source]) -> Option<u64> {
    let m: Marker = serde_json::from_slice(&fs::read(path).ok()?).ok()?;
    if m.files != want {
        return None;
    }
    let handles: Vec<File> = sources.iter().map(|s| File::open(&s.local)).collect::<io::Result<_>>().ok()?;
    for (h, s) in handles.iter().zip(sources) {
        if h.metadata().ok()?.len() != s.remote.len {
            return None;
        }
    }
    let mut buf = Vec::new();
    for &(f, off, len, sum) in &m.ranges {
        buf.resize(len as usize, 0);
        handles.get(f)?.read_exact_at(&mut buf, off).ok()?;
        if xxhash_rust::xxh3::xxh3_64(&buf) != sum {
            return None;
        }
    }
    Some(m.ranges.iter().map(|r| r.2).sum())
}

/// Largest range one request fetches while filling stand-ins.
const CHUNK: u64 = 16 << 20;

/// Fills the stand-ins: each file's header first (enough to read its tensor table), then
/// every byte outside the routed experts' ranges. Returns the ranges fetched with their
/// checksums.
fn build(
    http: &Http,
    sources: &[Source],
    gguf: bool,
    local: &Path,
    parallel: usize,
) -> io::Result<Vec<(usize, u64, u64, u64)>> {
    let mut handles = Vec::new();
    let mut headers = Vec::new();
    // Every range fetched, with its checksum: (file, offset, length, xxh3).
    let mut done: Vec<(usize, u64, u64, u64)> = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        // A new file renamed over the old one: a process still running from the old stand-in
        // keeps its own (the old inode), and nobody trusts the new one before the marker.
        let tmp = s.local.with_extension(format!("building.{}", std::process::id()));
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| at(&tmp, e))?;
        f.set_len(s.remote.len).map_err(|e| at(&tmp, e))?;
        let head = fetch_header(http, &s.remote, gguf)?;
        f.write_all_at(&head, 0).map_err(|e| at(&tmp, e))?;
        fs::rename(&tmp, &s.local).map_err(|e| at(&s.local, e))?;
        headers.push(head.len() as u64);
        done.push((i, 0, head.len() as u64, xxhash_rust::xxh3::xxh3_64(&head)));
        handles.push(f);
    }
    // With headers in place the checkpoint opens; its expert layout says what not to fetch.
    let layout = expert_layout(local, gguf)?;
    let mut todo: Vec<(usize, u64, u64)> = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        let mut experts: Vec<(u64, u64)> = Vec::new();
        if let Some(l) = &layout {
            let fi = l.files.iter().position(|p| p == &s.local);
            for plan in l.experts.iter().flatten() {
                for (file, offset, len) in plan.ranges() {
                    if Some(file) == fi {
                        experts.push((offset, offset + len));
                    }
                }
            }
        }
        experts.sort();
        let mut at = headers[i];
        let mut gaps = Vec::new();
        for (a, b) in experts {
            if a > at {
                gaps.push((at, a));
            }
            at = at.max(b);
        }
        if at < s.remote.len {
            gaps.push((at, s.remote.len));
        }
        for (a, b) in gaps {
            let mut x = a;
            while x < b {
                let n = CHUNK.min(b - x);
                todo.push((i, x, n));
                x += n;
            }
        }
    }
    let results = Mutex::new(Vec::new());
    crate::each_parallel(&todo, parallel, |&(i, off, len), buf| {
        buf.resize(len as usize, 0);
        let n = http.read_at(&sources[i].remote, off, buf)?;
        if n as u64 != len {
            return Err(io::Error::other(format!("{}: ended early", sources[i].remote.url)));
        }
        handles[i].write_all_at(buf, off).map_err(|e| at(&sources[i].local, e))?;
        results.lock().unwrap_or_else(|e| e.into_inner()).push((i, off, len, xxhash_rust::xxh3::xxh3_64(buf)));
        Ok(())
    })?;
    done.extend(results.into_inner().unwrap_or_else(|e| e.into_inner()));
    done.sort();
    for (h, s) in handles.iter().zip(sources) {
        h.sync_all().map_err(|e| at(&s.local, e))?;
    }
    Ok(done)
}

/// The bytes of a file's header: a GGUF header up to its tensor data, or a safetensors
/// length prefix and JSON header.
fn fetch_header(http: &Http, r: &Remote, gguf: bool) -> io::Result<Vec<u8>> {
    let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {m}", r.url));
    if !gguf {
        let mut n = [0u8; 8];
        if http.read_at(r, 0, &mut n)? != 8 {
            return Err(bad("too short for a safetensors file".into()));
        }
        let len = u64::from_le_bytes(n);
        if len > 100 << 20 || 8 + len > r.len {
            return Err(bad(format!("safetensors header length {len} is not plausible")));
        }
        let mut b = vec![0u8; 8 + len as usize];
        http.read_at(r, 0, &mut b)?;
        return Ok(b);
    }
    let mut want = (1u64 << 20).min(r.len);
    loop {
        let mut b = vec![0u8; want as usize];
        let n = http.read_at(r, 0, &mut b)?;
        b.truncate(n);
        match sluice_formats::gguf::header_len(&b).map_err(|e| bad(e.to_string()))? {
            Some(h) if h <= b.len() as u64 => {
                b.truncate(h as usize);
                return Ok(b);
            }
            Some(h) => want = h.min(r.len),
            None if want >= r.len || want >= 1 << 30 => return Err(bad("the GGUF header does not end".into())),
            None => want = (want * 4).min(r.len),
        }
    }
}

/// The routed experts' layout of the checkpoint at `local` (`None` for a dense model).
pub(crate) fn expert_layout(local: &Path, gguf: bool) -> io::Result<Option<Layout>> {
    let err = |e: String| io::Error::new(io::ErrorKind::InvalidData, e);
    let l = if gguf {
        let c = sluice_model::gguf::GgufCheckpoint::open(local).map_err(|e| err(e.to_string()))?;
        sluice_experts::store::layout_from_gguf(&c)
    } else {
        let c = sluice_model::hf::HfCheckpoint::open(local).map_err(|e| err(e.to_string()))?;
        sluice_experts::store::layout_from_hf(&c)
    };
    match l {
        Ok(l) => Ok(Some(l)),
        Err(sluice_experts::ExpertError::NotMoe(_)) => Ok(None),
        Err(e) => Err(err(e.to_string())),
    }
}
