//! The reader the expert cache's IO pool calls for a remote model: the disk tier first, then
//! the remote file; what the remote sends is kept in the disk tier for next time.

use crate::disk::{DiskStats, DiskTier};
use crate::http::{Http, Remote};
use sluice_experts::io::RangeReader;
use sluice_model::expert::TierStat;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One remote file and the local stand-in the model was opened from.
#[derive(Clone, Debug)]
pub struct Source {
    pub remote: Remote,
    /// The local file (header and dense weights filled in, experts left as holes).
    pub local: PathBuf,
    /// The disk tier's name for this file (changes when the file does).
    pub key: String,
}

#[derive(Default, Debug, Clone, Copy, serde::Serialize)]
pub struct RemoteStats {
    pub reads: u64,
    pub bytes: u64,
    /// Summed wall time of the remote reads, and the slowest one.
    pub read_ns: u64,
    pub max_read_ns: u64,
    pub errors: u64,
    /// Disk-tier writes that failed (the read itself still succeeded).
    pub keep_errors: u64,
    /// Reads of the expert cache served by one request together with the read before them
    /// (back-to-back ranges coalesced): requests saved.
    pub coalesced: u64,
}

/// Both tiers' counters.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct TierStats {
    pub remote: RemoteStats,
    pub disk: Option<DiskStats>,
}

pub struct TieredReader {
    http: Arc<Http>,
    files: Vec<Source>,
    disk: Option<Arc<DiskTier>>,
    stats: Mutex<RemoteStats>,
}

impl TieredReader {
    pub fn new(http: Arc<Http>, files: Vec<Source>, disk: Option<Arc<DiskTier>>) -> TieredReader {
        TieredReader { http, files, disk, stats: Mutex::new(RemoteStats::default()) }
    }

    pub fn stats(&self) -> TierStats {
        TierStats {
            remote: *self.stats.lock().unwrap_or_else(|e| e.into_inner()),
            disk: self.disk.as_ref().map(|d| d.stats()),
        }
    }

    pub fn files(&self) -> &[Source] {
        &self.files
    }

    /// The protocol the server answers with (`HTTP/2.0` where it offers HTTP/2).
    pub fn protocol(&self) -> Option<String> {
        self.http.protocol()
    }

    pub fn disk(&self) -> Option<&Arc<DiskTier>> {
        self.disk.as_ref()
    }
}

/// Most bytes of back-to-back reads one request fetches.
const MERGE_BYTES: usize = 64 << 20;

impl TieredReader {
    /// One remote request, counted.
    fn fetch(&self, f: &Source, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        let t = Instant::now();
        let got = self.http.read_at(&f.remote, offset, dst);
        let ns = t.elapsed().as_nanos() as u64;
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        match &got {
            Ok(n) => {
                s.reads += 1;
                s.bytes += *n as u64;
                s.read_ns += ns;
                s.max_read_ns = s.max_read_ns.max(ns);
            }
            Err(_) => s.errors += 1,
        }
        got
    }

    /// Keeps what the remote sent in the disk tier, if there is one.
    fn keep(&self, f: &Source, offset: u64, asked: usize, data: &[u8]) {
        if let Some(d) = &self.disk {
            if d.put(&f.key, offset, asked, data).is_err() {
                self.stats.lock().unwrap_or_else(|e| e.into_inner()).keep_errors += 1;
            }
        }
    }
}

impl RangeReader for TieredReader {
    fn name(&self) -> String {
        let url = self.files.first().map_or("", |f| f.remote.url.as_str());
        let disk = match &self.disk {
            Some(d) => format!("disk tier {} of {:.2} GiB", d.dir().display(), d.quota() as f64 / (1u64 << 30) as f64),
            None => "no disk tier".into(),
        };
        let proto = self.http.protocol().map_or(String::new(), |p| format!(" over {p}"));
        format!("remote reads of {url}{proto}, {disk}")
    }

    fn file_index(&self, path: &Path) -> io::Result<usize> {
        self.files.iter().position(|f| f.local == path).ok_or_else(|| {
            io::Error::other(format!("{}: not a file of the remote model this reader serves", path.display()))
        })
    }

    fn tiers(&self) -> Vec<TierStat> {
        let s = self.stats();
        let mut v = Vec::new();
        if let Some(d) = s.disk {
            v.push(TierStat {
                tier: "disk".into(),
                reads: d.hits,
                bytes: d.hit_bytes,
                read_ns: d.read_ns,
                errors: d.bad_records,
                merged: 0,
            });
        }
        v.push(TierStat {
            tier: "remote".into(),
            reads: s.remote.reads,
            bytes: s.remote.bytes,
            read_ns: s.remote.read_ns,
            errors: s.remote.errors,
            merged: s.remote.coalesced,
        });
        v
    }

    fn merge_bytes(&self) -> usize {
        MERGE_BYTES
    }

    fn read_run(&self, file: usize, reads: &mut [(u64, &mut [u8])]) -> Vec<io::Result<usize>> {
        let f = &self.files[file];
        let mut results: Vec<Option<io::Result<usize>>> = reads
            .iter_mut()
            .map(|(off, d)| self.disk.as_ref().and_then(|disk| disk.get(&f.key, *off, d)).map(Ok))
            .collect();
        // The misses in runs that touch or overlap, each run fetched with one request.
        let mut i = 0;
        while i < reads.len() {
            if results[i].is_some() {
                i += 1;
                continue;
            }
            let start = reads[i].0;
            let mut end = start + reads[i].1.len() as u64;
            let mut group = vec![i];
            let mut j = i + 1;
            while j < reads.len() {
                if results[j].is_none() {
                    if reads[j].0 > end {
                        break;
                    }
                    end = end.max(reads[j].0 + reads[j].1.len() as u64);
                    group.push(j);
                }
                j += 1;
            }
            let mut buf = vec![0u8; (end - start) as usize];
            match self.fetch(f, start, &mut buf) {
                Ok(n) => {
                    self.stats.lock().unwrap_or_else(|e| e.into_inner()).coalesced += (group.len() - 1) as u64;
                    for &k in &group {
                        let (off, d) = &mut reads[k];
                        let at = (*off - start) as usize;
                        let len = d.len().min(n.saturating_sub(at));
                        d[..len].copy_from_slice(&buf[at..at + len]);
                        self.keep(f, *off, d.len(), &d[..len]);
                        results[k] = Some(Ok(len));
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    for &k in &group {
                        results[k] = Some(Err(io::Error::new(e.kind(), msg.clone())));
                    }
                }
            }
            i += 1;
        }
        results.into_iter().map(|r| r.expect("every read answered")).collect()
    }

    fn read_at(&self, file: usize, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        let f = &self.files[file];
        if let Some(d) = &self.disk {
            if let Some(n) = d.get(&f.key, offset, dst) {
                return Ok(n);
            }
        }
        let n = self.fetch(f, offset, dst)?;
        self.keep(f, offset, dst.len(), &dst[..n]);
        Ok(n)
    }
}
