//! The local disk tier: byte ranges of remote files kept as verified records under a byte
//! quota, shared by every sluice process that names the same directory.
//!
//! A record is one file, `<dir>/<source>/<offset>-<len>.rec`: a 4 KiB header block (magic,
//! length, CRC-32 of the payload) and the payload, so that the payload can be read
//! with O_DIRECT straight into an expert cache slot (no copy left in the page cache). It is written under a temporary
//! name, synced, and renamed into place, then the directory is synced — so a record is
//! visible only once it is complete, and a crash leaves at most a temporary file (removed
//! when its writer is gone). Every read checks the header and the checksum; a record that
//! fails is removed and reported as a miss, so the range is fetched again. The directory is
//! the index: it survives restarts; `last used` is the record's modification time.
//!
//! Eviction keeps the bytes of records at or under the quota, least recently used first.
//! Another process may remove a record this one is reading: the open file stays readable
//! (Unix keeps unlinked files alive while open), and a record removed before it is opened is
//! simply a miss. Two processes writing the same range write the same bytes; the last rename
//! wins and both are whole.

use sluice_experts::io::read_full_at;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

const MAGIC: &[u8; 8] = b"SLUICER3";
/// Bytes of a record before its payload (one O_DIRECT block).
pub const HEADER: usize = 4096;

#[derive(Default, Debug, Clone, Copy, serde::Serialize)]
pub struct DiskStats {
    pub hits: u64,
    pub hit_bytes: u64,
    pub misses: u64,
    pub writes: u64,
    pub written_bytes: u64,
    pub evicted: u64,
    /// Records that failed their check (torn, truncated or altered) and were dropped.
    pub bad_records: u64,
    pub read_ns: u64,
}

struct Index {
    /// Record path → (bytes on disk, last use as a tick of `clock`).
    records: HashMap<PathBuf, (u64, u64)>,
    total: u64,
    clock: u64,
}

pub struct DiskTier {
    dir: PathBuf,
    quota: u64,
    index: Mutex<Index>,
    stats: Mutex<DiskStats>,
    tmp_counter: AtomicU64,
    /// When the directory was last counted (every process's records).
    last_scan: Mutex<std::time::Instant>,
}

/// How often eviction counts the directory again (other processes' records); in between it
/// evicts from what this process knows, so a full tier does not walk the directory per write.
const RESCAN: std::time::Duration = std::time::Duration::from_secs(1);

fn record_name(offset: u64, len: usize) -> String {
    format!("{offset:016x}-{len:x}.rec")
}

impl DiskTier {
    /// Opens (creating) the tier at `dir` with a quota of `quota` bytes of records (0: keep
    /// nothing), after removing temporary files whose writers are gone.
    pub fn open(dir: &Path, quota: u64) -> io::Result<DiskTier> {
        fs::create_dir_all(dir).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
        let t = DiskTier {
            dir: dir.to_path_buf(),
            quota,
            index: Mutex::new(Index { records: HashMap::new(), total: 0, clock: 0 }),
            stats: Mutex::new(DiskStats::default()),
            tmp_counter: AtomicU64::new(0),
            last_scan: Mutex::new(std::time::Instant::now()),
        };
        t.rescan()?;
        Ok(t)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn quota(&self) -> u64 {
        self.quota
    }

    pub fn stats(&self) -> DiskStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes of records on disk, as this process last counted them.
    pub fn used(&self) -> u64 {
        self.index.lock().unwrap_or_else(|e| e.into_inner()).total
    }

    /// Rebuilds the index from the directory (every process's records), oldest first by
    /// modification time; drops abandoned temporary files.
    fn rescan(&self) -> io::Result<()> {
        let mut found: Vec<(SystemTime, PathBuf, u64)> = Vec::new();
        for sub in fs::read_dir(&self.dir)? {
            let sub = sub?.path();
            if !sub.is_dir() {
                continue;
            }
            for f in fs::read_dir(&sub)? {
                let Ok(f) = f else { continue };
                let p = f.path();
                let name = f.file_name().to_string_lossy().to_string();
                if let Some(pid) = tmp_writer(&name) {
                    if !Path::new(&format!("/proc/{pid}")).exists() {
                        let _ = fs::remove_file(&p);
                    }
                    continue;
                }
                if !name.ends_with(".rec") {
                    continue;
                }
                if let Ok(m) = f.metadata() {
                    found.push((m.modified().unwrap_or(SystemTime::UNIX_EPOCH), p, m.len()));
                }
            }
        }
        found.sort();
        let mut ix = self.index.lock().unwrap_or_else(|e| e.into_inner());
        ix.records.clear();
        ix.total = 0;
        for (i, (_, p, len)) in found.into_iter().enumerate() {
            ix.total += len;
            ix.records.insert(p, (len, i as u64));
        }
        ix.clock = ix.records.len() as u64;
        Ok(())
    }

    fn path(&self, source: &str, offset: u64, len: usize) -> PathBuf {
        self.dir.join(source).join(record_name(offset, len))
    }

    /// Fills `dst` from the record of the range of `source` at `offset` asked for with
    /// `dst.len()` bytes, if there is a sound one; returns how many bytes it holds (fewer
    /// than asked where the file ends). A record that fails its check is removed.
    pub fn get(&self, source: &str, offset: u64, dst: &mut [u8]) -> Option<usize> {
        let t = std::time::Instant::now();
        let p = self.path(source, offset, dst.len());
        let mut n = 0;
        let ok = match open_record(&p) {
            Ok(f) => match read_record(&p, &f, dst) {
                Ok(got) => {
                    n = got;
                    let _ = f.0.set_modified(SystemTime::now());
                    if !f.1 {
                        drop_pages(&f.0);
                    }
                    true
                }
                Err(_) => {
                    let _ = fs::remove_file(&p);
                    self.forget(&p);
                    self.stats.lock().unwrap_or_else(|e| e.into_inner()).bad_records += 1;
                    false
                }
            },
            Err(_) => false,
        };
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        if ok {
            s.hits += 1;
            s.hit_bytes += n as u64;
            s.read_ns += t.elapsed().as_nanos() as u64;
            drop(s);
            let mut ix = self.index.lock().unwrap_or_else(|e| e.into_inner());
            ix.clock += 1;
            let tick = ix.clock;
            let size = (HEADER + n) as u64;
            match ix.records.get_mut(&p) {
                Some(r) => r.1 = tick,
                None => {
                    ix.records.insert(p, (size, tick));
                    ix.total += size;
                }
            }
        } else {
            s.misses += 1;
        }
        ok.then_some(n)
    }

    fn forget(&self, p: &Path) {
        let mut ix = self.index.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((len, _)) = ix.records.remove(p) {
            ix.total -= len;
        }
    }

    /// Keeps `data` as the record of the range of `source` at `offset` asked for with
    /// `asked` bytes (`data` is shorter only where the file ends), evicting the least
    /// recently used records to stay within the quota. A range larger than the quota is not
    /// kept.
    pub fn put(&self, source: &str, offset: u64, asked: usize, data: &[u8]) -> io::Result<()> {
        let size = (HEADER + data.len()) as u64;
        if size > self.quota || data.len() > asked {
            return Ok(());
        }
        let p = self.path(source, offset, asked);
        let dir = p.parent().expect("a record has a directory");
        fs::create_dir_all(dir)?;
        let tmp = dir.join(format!(
            ".{}.tmp.{}.{}",
            record_name(offset, asked),
            std::process::id(),
            self.tmp_counter.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            let mut f = File::create(&tmp)?;
            let mut h = vec![0u8; HEADER];
            h[..8].copy_from_slice(MAGIC);
            h[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
            h[16..24].copy_from_slice(&checksum(data).to_le_bytes());
            f.write_all(&h)?;
            f.write_all(data)?;
            f.sync_all()?;
            drop_pages(&f);
            fs::rename(&tmp, &p)?;
            File::open(dir)?.sync_all()
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        {
            let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            s.writes += 1;
            s.written_bytes += data.len() as u64;
        }
        let over = {
            let mut ix = self.index.lock().unwrap_or_else(|e| e.into_inner());
            ix.clock += 1;
            let tick = ix.clock;
            if let Some((old, _)) = ix.records.insert(p, (size, tick)) {
                ix.total -= old;
            }
            ix.total += size;
            ix.total > self.quota
        };
        if over {
            self.evict()?;
        }
        Ok(())
    }

    /// Removes the least recently used records until the total is within the quota, after
    /// counting every process's records again if that was last done more than `RESCAN` ago.
    fn evict(&self) -> io::Result<()> {
        // One evicting process at a time, so two do not both remove what one would have.
        let lock = File::create(self.dir.join(".evict.lock"))?;
        // SAFETY: flock on a descriptor this function owns.
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
        let due = {
            let mut last = self.last_scan.lock().unwrap_or_else(|e| e.into_inner());
            let due = last.elapsed() >= RESCAN;
            if due {
                *last = std::time::Instant::now();
            }
            due
        };
        if due {
            self.rescan()?;
        }
        let mut ix = self.index.lock().unwrap_or_else(|e| e.into_inner());
        let mut by_age: Vec<(u64, PathBuf, u64)> = ix.records.iter().map(|(p, (l, t))| (*t, p.clone(), *l)).collect();
        by_age.sort();
        let mut evicted = 0;
        for (_, p, len) in by_age {
            if ix.total <= self.quota {
                break;
            }
            if fs::remove_file(&p).is_ok() || !p.exists() {
                ix.records.remove(&p);
                ix.total -= len;
                evicted += 1;
            }
        }
        drop(ix);
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).evicted += evicted;
        Ok(())
    }
}

/// Drops a record's pages from the page cache: the expert cache holds what it needs, and a
/// second copy in the page cache would grow memory use past the quota.
fn drop_pages(f: &File) {
    // SAFETY: advice on a descriptor the caller owns; it changes no data.
    unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(f), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// The writer's pid of a temporary record name (`.NAME.tmp.PID.N`).
fn tmp_writer(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('.')?;
    let i = rest.find(".tmp.")?;
    rest[i + 5..].split('.').next()?.parse().ok()
}

/// A record's checksum: CRC-32 (crc32fast picks the carry-less-multiply kernel at run time:
/// about twice xxh3's rate without AVX2 at compile time; every hit checks its whole payload).
fn checksum(data: &[u8]) -> u64 {
    crc32fast::hash(data) as u64
}

/// Opens a record for reading, with O_DIRECT where the file system allows it.
fn open_record(p: &Path) -> io::Result<(File, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    match fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(p) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((File::open(p)?, false)),
        Err(e) => Err(e),
    }
}

/// One aligned block for reading a record's header with O_DIRECT.
struct Block(*mut u8);

impl Block {
    fn layout() -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(HEADER, HEADER).expect("a valid layout")
    }
    fn new() -> Block {
        // SAFETY: a non-zero size; the pointer is checked.
        let p = unsafe { std::alloc::alloc_zeroed(Block::layout()) };
        assert!(!p.is_null(), "allocating a 4 KiB block");
        Block(p)
    }
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `HEADER` bytes owned by this block.
        unsafe { std::slice::from_raw_parts_mut(self.0, HEADER) }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.0, Block::layout()) }
    }
}

/// Reads and checks a record into `dst`; returns its payload length.
fn read_record(path: &Path, (f, direct): &(File, bool), dst: &mut [u8]) -> io::Result<usize> {
    let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_string());
    let mut block = Block::new();
    let h = block.bytes();
    let n = f.read_at(h, 0)?;
    if n < 24 || &h[..8] != MAGIC {
        return Err(bad("bad magic"));
    }
    let len = u64::from_le_bytes(h[8..16].try_into().expect("8"));
    let sum = u64::from_le_bytes(h[16..24].try_into().expect("8"));
    if len > dst.len() as u64 || f.metadata()?.len() != HEADER as u64 + len {
        return Err(bad("wrong length"));
    }
    let len = len as usize;
    // O_DIRECT wants the address and length aligned: an expert cache slot is (its reads are
    // whole 4 KiB blocks); anything else reads through the page cache.
    let aligned = len.div_ceil(HEADER) * HEADER;
    let got = if *direct && (dst.as_ptr() as usize).is_multiple_of(HEADER) && aligned <= dst.len() {
        read_full_at(f, &mut dst[..aligned], HEADER as u64)?
    } else if *direct {
        // Opened anew without O_DIRECT, for a destination that is not aligned.
        read_full_at(&File::open(path)?, &mut dst[..len], HEADER as u64)?
    } else {
        read_full_at(f, &mut dst[..len], HEADER as u64)?
    };
    if got < len {
        return Err(bad("record ends early"));
    }
    let dst = &mut dst[..len];
    if checksum(dst) != sum {
        return Err(bad("checksum mismatch"));
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d = sluice_formats::scratch_root().join(format!("sluice-disk-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn records_round_trip_survive_reopening_and_fail_their_check_when_damaged() {
        let d = tmpdir("roundtrip");
        let t = DiskTier::open(&d, 1 << 20).unwrap();
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        t.put("src", 4096, data.len(), &data).unwrap();
        let mut out = vec![0u8; data.len()];
        assert_eq!(t.get("src", 4096, &mut out), Some(data.len()));
        assert_eq!(out, data);
        assert!(t.get("src", 0, &mut out).is_none(), "another offset is a miss");
        drop(t);
        let t = DiskTier::open(&d, 1 << 20).unwrap();
        assert_eq!(t.used(), (HEADER + data.len()) as u64, "the index is the directory");
        // Flip a payload byte: the record fails its checksum, is dropped, and is a miss.
        let p = t.path("src", 4096, data.len());
        let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.write_all_at(&[data[100] ^ 1], (HEADER + 100) as u64).unwrap();
        out.fill(0);
        assert!(t.get("src", 4096, &mut out).is_none());
        assert!(!p.exists());
        assert_eq!(t.stats().bad_records, 1);
        // A torn record (cut short) is a miss too.
        t.put("src", 4096, data.len(), &data).unwrap();
        fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(1000).unwrap();
        assert!(t.get("src", 4096, &mut out).is_none());
        assert_eq!(t.stats().bad_records, 2);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_quota_evicts_least_recently_used_and_abandoned_temporaries_go() {
        let d = tmpdir("quota");
        let rec = 1000usize;
        let t = DiskTier::open(&d, 3 * (HEADER + rec) as u64).unwrap();
        let data = vec![1u8; rec];
        let mut out = vec![0u8; rec];
        for i in 0..3u64 {
            t.put("s", i * 4096, rec, &data).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(t.get("s", 0, &mut out).is_some(), "touch the oldest");
        t.put("s", 3 * 4096, rec, &data).unwrap();
        assert!(t.used() <= t.quota());
        assert!(t.get("s", 0, &mut out).is_some(), "recently used stays");
        assert!(t.get("s", 4096, &mut out).is_none(), "least recently used went");
        assert_eq!(t.stats().evicted, 1);
        // Larger than the whole quota: not kept, not an error.
        let big = 3 * (HEADER + rec);
        t.put("s", 1 << 30, big, &vec![0u8; big]).unwrap();
        assert!(t.get("s", 1 << 30, &mut vec![0u8; big]).is_none());
        // A range that ends at the end of its file keeps the bytes there were.
        t.put("s", 8 << 20, 4096, &data[..10]).unwrap();
        let mut page = vec![0u8; 4096];
        assert_eq!(t.get("s", 8 << 20, &mut page), Some(10));
        // A temporary file left by a writer that no longer runs is removed on open.
        let stale = d.join("s").join(".0000000000000000-10.rec.tmp.4000000000.0");
        fs::write(&stale, b"partial").unwrap();
        drop(DiskTier::open(&d, 1 << 20).unwrap());
        assert!(!stale.exists());
        fs::remove_dir_all(&d).unwrap();
    }
}
