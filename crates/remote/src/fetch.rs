//! `sluice fetch`: bring a remote model's experts into the disk tier ahead of use (the hot
//! ones a routing trace names), or make a whole local copy.

use crate::mirror::{expert_layout, Mirror, RemoteOptions};
use sluice_experts::io::RangeReader;
use sluice_experts::layout::Layout;
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

#[derive(Debug, serde::Serialize)]
pub struct Fetched {
    /// Experts (or chunks of a whole copy) now local, and bytes fetched from the remote now.
    pub items: usize,
    pub bytes: u64,
    pub seconds: f64,
    /// Experts left out because the disk tier's quota was full.
    pub left_out: usize,
}

/// The routed experts' layout of an opened remote model.
pub fn layout(m: &Mirror) -> io::Result<Layout> {
    expert_layout(&m.local, m.local.extension().is_some_and(|x| x == "gguf"))?
        .ok_or_else(|| io::Error::other(format!("{}: not a mixture-of-experts model", m.url)))
}

/// Brings `experts` (layer, expert), in order, into `m`'s disk tier until its quota is full.
pub fn experts(m: &Mirror, layout: &Layout, experts: &[(u32, u32)], parallel: usize) -> io::Result<Fetched> {
    let disk = m
        .reader
        .disk()
        .ok_or_else(|| io::Error::other("no disk tier to fetch into: give --disk-cache-size (and --disk-cache DIR)"))?;
    let files: Vec<usize> = layout.files.iter().map(|p| m.reader.file_index(p)).collect::<io::Result<_>>()?;
    // As many as the quota holds (each record carries a small header).
    let mut budget = disk.quota();
    let mut take = Vec::new();
    for &(l, e) in experts {
        let Some(plan) = layout.experts.get(l as usize).and_then(|v| v.get(e as usize)) else {
            return Err(io::Error::other(format!("layer {l} expert {e}: not in this model")));
        };
        let need: u64 = plan.reads.iter().map(|r| r.len + crate::disk::HEADER as u64).sum();
        if need > budget {
            break;
        }
        budget -= need;
        take.push(plan.clone());
    }
    let before = m.reader.stats().remote.bytes;
    let t = Instant::now();
    crate::each_parallel(&take, parallel, |plan, buf| {
        for r in &plan.reads {
            buf.resize(r.len as usize, 0);
            m.reader.read_at(files[r.file], r.offset, buf)?;
        }
        Ok(())
    })?;
    Ok(Fetched {
        items: take.len(),
        bytes: m.reader.stats().remote.bytes - before,
        seconds: t.elapsed().as_secs_f64(),
        left_out: experts.len() - take.len(),
    })
}

/// Chunk size of a whole copy; the unit of resumption.
const CHUNK: u64 = 16 << 20;

/// A whole local copy of the model at `url` at `out` (a file for a `.gguf`, else a directory),
/// resumable: chunks done are logged beside the partial file and skipped when run again; the
/// file takes its name only once every chunk is in and synced.
pub fn all(url: &str, o: &RemoteOptions, out: &Path) -> io::Result<Fetched> {
    let (http, files, _) = crate::mirror::remote_files(url, o)?;
    let t = Instant::now();
    let mut fetched = Fetched { items: 0, bytes: 0, seconds: 0.0, left_out: 0 };
    let single = files.len() == 1 && files[0].0.ends_with(".gguf") && !out.is_dir();
    for (name, remote, small) in &files {
        let dest = if single { out.to_path_buf() } else { out.join(name) };
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent)?;
        }
        if let Some(bytes) = small {
            fs::write(&dest, bytes)?;
            continue;
        }
        let remote = remote.as_ref().expect("a large file has a remote");
        let part = PathBuf::from(format!("{}.part", dest.display()));
        let log_path = PathBuf::from(format!("{}.part.done", dest.display()));
        // The log names the file it belongs to; a different remote file starts over.
        let tag = format!("{}\n", serde_json::to_string(remote).expect("serializable"));
        let mut done = std::collections::HashSet::new();
        match fs::read_to_string(&log_path) {
            Ok(text) if text.starts_with(&tag) && part.exists() => {
                for l in text[tag.len()..].lines() {
                    if let Ok(i) = l.parse::<u64>() {
                        done.insert(i);
                    }
                }
            }
            _ => {
                let _ = fs::remove_file(&part);
                fs::write(&log_path, &tag)?;
            }
        }
        let f = fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&part)?;
        f.set_len(remote.len)?;
        let log = Mutex::new(fs::OpenOptions::new().append(true).open(&log_path)?);
        let chunks: Vec<u64> = (0..remote.len.div_ceil(CHUNK)).filter(|i| !done.contains(i)).collect();
        let bytes = Mutex::new(0u64);
        crate::each_parallel(&chunks, o.parallel, |&i, buf| {
            let off = i * CHUNK;
            buf.resize(CHUNK.min(remote.len - off) as usize, 0);
            if http.read_at(remote, off, buf)? != buf.len() {
                return Err(io::Error::other(format!("{}: ended early", remote.url)));
            }
            f.write_all_at(buf, off)?;
            f.sync_data()?;
            let mut l = log.lock().unwrap_or_else(|e| e.into_inner());
            writeln!(l, "{i}")?;
            l.sync_data()?;
            *bytes.lock().unwrap_or_else(|e| e.into_inner()) += buf.len() as u64;
            Ok(())
        })?;
        f.sync_all()?;
        fs::rename(&part, &dest)?;
        File::open(dest.parent().unwrap_or(Path::new(".")))?.sync_all()?;
        let _ = fs::remove_file(&log_path);
        fetched.items += chunks.len();
        fetched.bytes += bytes.into_inner().unwrap_or_else(|e| e.into_inner());
    }
    drop(http);
    fetched.seconds = t.elapsed().as_secs_f64();
    Ok(fetched)
}
