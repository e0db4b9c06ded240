//! The IO engine: aligned reads of expert bytes straight into cache slots.
//!
//! * `UringIo`: io_uring, O_DIRECT files, the arena's slots as registered buffers when the
//!   system allows (else plain reads); up to `depth` reads in flight. The buffer table is
//!   sparse: a slot is registered (its pages pinned) before its first read and unregistered
//!   when the cache gives it back (`release_slot`), so a released slot's memory really returns
//!   to the system and a regrown slot's reads land in the pages the process maps.
//! * `PreadIo`: a pool of threads calling `pread`, for systems without io_uring.
//! * `PoolIo::over`: the same pool over a `RangeReader` instead of local files — a remote
//!   tier (an HTTP server or an object store, with a local disk tier before it).
//!
//! All take requests only while they have room (`room()`), so the caller decides priority:
//! it hands over demand reads before prefetch reads. `FaultyIo` wraps either and injects
//! errors, short reads and corruption for tests.

use crate::arena::Arena;
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

#[derive(Clone, Copy, Debug)]
pub struct IoRequest {
    pub tag: u64,
    pub file: usize,
    pub offset: u64,
    pub len: usize,
    /// Destination inside the arena's slot `slot`.
    pub slot: usize,
    pub slot_offset: usize,
}

#[derive(Debug)]
pub struct IoCompletion {
    pub tag: u64,
    pub result: io::Result<usize>,
}

pub trait IoEngine: Send {
    fn name(&self) -> String;
    /// How many more reads may be started now.
    fn room(&self) -> usize;
    /// Starts a read (the caller respects `room`).
    fn start(&mut self, r: IoRequest) -> io::Result<()>;
    /// Collects finished reads into `out`; waits until at least `min` have finished.
    fn reap(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> io::Result<()>;
    fn in_flight(&self) -> usize;
    /// Whether every file was opened with O_DIRECT (else reads go through the page cache).
    fn direct(&self) -> bool;
    /// Slot `s` is about to be handed back to the system (no read into it is in flight): drop
    /// whatever the engine holds on its memory.
    fn release_slot(&mut self, _s: usize) -> io::Result<()> {
        Ok(())
    }
}

/// Opens every file with `open_direct`; the flag says whether all of them got O_DIRECT.
fn open_all(paths: &[PathBuf]) -> io::Result<(Vec<File>, bool)> {
    let mut files = Vec::with_capacity(paths.len());
    let mut direct = true;
    for p in paths {
        let (f, d) = open_direct(p)?;
        direct &= d;
        files.push(f);
    }
    Ok((files, direct))
}

/// Opens `path` for direct IO if the file system allows it, else for buffered reads.
pub fn open_direct(path: &Path) -> io::Result<(File, bool)> {
    match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((File::open(path)?, false)),
        Err(e) => Err(e),
    }
}

pub struct UringIo {
    ring: io_uring::IoUring,
    files: Vec<File>,
    arena: Arc<Arena>,
    depth: usize,
    in_flight: usize,
    /// Whether the ring has a (sparse) registered-buffer table with an entry per slot.
    registered: bool,
    /// Slots whose entry currently holds the slot's buffer.
    slot_registered: Vec<bool>,
    /// A submit that failed with entries left in the queue (retried by the next `reap`).
    submit_error: Option<io::Error>,
    pub direct: bool,
}

impl UringIo {
    pub fn new(paths: &[PathBuf], arena: Arc<Arena>, depth: usize, register: bool) -> io::Result<UringIo> {
        let depth = depth.clamp(1, 4096);
        let ring = io_uring::IoUring::new(depth.next_power_of_two() as u32)?;
        let (files, direct) = open_all(paths)?;
        // A sparse table (Linux 5.19+); without one, plain reads. A table registered whole
        // would pin every slot for the ring's life, defeating the release of slots.
        let registered = register
            && arena.n_slots <= 16384
            && ring.submitter().register_buffers_sparse(arena.n_slots as u32).is_ok();
        let slot_registered = vec![false; if registered { arena.n_slots } else { 0 }];
        Ok(UringIo { ring, files, arena, depth, in_flight: 0, registered, slot_registered, submit_error: None, direct })
    }

    /// Hands queued entries to the kernel, retrying when interrupted or when the kernel asks
    /// to try again.
    fn submit_pending(&mut self) -> io::Result<()> {
        let mut tries = 0;
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY)) && tries < 100 => {
                    tries += 1;
                    std::thread::yield_now();
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits for every read in flight (their buffers must outlive them). Returns how many
    /// completions were collected.
    pub fn drain(&mut self) -> usize {
        let mut n = 0;
        let mut out = Vec::new();
        while self.in_flight > 0 {
            out.clear();
            match self.reap(self.in_flight, &mut out) {
                Ok(()) => n += out.len(),
                Err(_) => {
                    // The ring cannot wait any more; cancel what is left and collect what
                    // the kernel still reports, without blocking forever.
                    let cancel = io_uring::opcode::AsyncCancel2::new(io_uring::types::CancelBuilder::any())
                        .build()
                        .user_data(u64::MAX);
                    // SAFETY: a cancel request refers to no buffer.
                    let _ = unsafe { self.ring.submission().push(&cancel) };
                    let _ = self.ring.submit_and_wait(1);
                    let before = self.in_flight;
                    for cqe in self.ring.completion() {
                        if cqe.user_data() != u64::MAX {
                            self.in_flight = self.in_flight.saturating_sub(1);
                            n += 1;
                        }
                    }
                    if self.in_flight == before {
                        break;
                    }
                }
            }
        }
        n
    }

    /// Puts slot `s`'s buffer in its table entry (pinning its pages); false if the kernel refused.
    fn register_slot(&mut self, s: usize) -> bool {
        if self.slot_registered[s] {
            return true;
        }
        let iov =
            [libc::iovec { iov_base: self.arena.slot_ptr(s) as *mut libc::c_void, iov_len: self.arena.slot_bytes }];
        // SAFETY: the iovec covers slot `s` of the arena, which outlives the ring (the ring is
        // declared first, so it is dropped first).
        self.slot_registered[s] =
            unsafe { self.ring.submitter().register_buffers_update(s as u32, &iov, None) }.is_ok();
        self.slot_registered[s]
    }
}

impl IoEngine for UringIo {
    fn name(&self) -> String {
        format!(
            "io_uring (depth {}, {}, {})",
            self.depth,
            if self.direct { "O_DIRECT" } else { "buffered" },
            if self.registered { "registered buffers" } else { "plain buffers" }
        )
    }

    fn room(&self) -> usize {
        self.depth - self.in_flight
    }

    fn start(&mut self, r: IoRequest) -> io::Result<()> {
        use io_uring::{opcode, types};
        let fd = types::Fd(self.files[r.file].as_raw_fd());
        // SAFETY: slot_offset + len lies inside the slot (the layout guarantees it).
        let dst = unsafe { self.arena.slot_ptr(r.slot).add(r.slot_offset) };
        let e = if self.registered && self.register_slot(r.slot) {
            opcode::ReadFixed::new(fd, dst, r.len as u32, r.slot as u16).offset(r.offset).build()
        } else {
            opcode::Read::new(fd, dst, r.len as u32).offset(r.offset).build()
        };
        let e = e.user_data(r.tag);
        // SAFETY: the buffer stays valid and untouched until the completion is reaped: the
        // cache keeps the slot Loading until then, and `Drop` waits for every read in flight.
        let pushed = unsafe { self.ring.submission().push(&e).is_ok() };
        if !pushed {
            // The submission queue is full of entries not yet handed to the kernel.
            self.submit_pending()?;
            // SAFETY: as above.
            unsafe { self.ring.submission().push(&e) }
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        // From here the entry is in the ring: the kernel will complete it whatever happens
        // next, so it counts as in flight. A failed submit leaves it queued; the next submit
        // (here or in `reap`) hands it over, and only then is an error final.
        self.in_flight += 1;
        if let Err(e) = self.submit_pending() {
            self.submit_error = Some(e);
        }
        Ok(())
    }

    fn reap(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> io::Result<()> {
        if self.submit_error.take().is_some() {
            // Entries left in the queue by a failed submit: hand them over now, or fail.
            self.submit_pending()?;
        }
        let want = min.min(self.in_flight);
        if want > 0 {
            loop {
                match self.ring.submit_and_wait(want) {
                    Ok(_) => break,
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                    Err(e) => return Err(e),
                }
            }
        }
        for cqe in self.ring.completion() {
            self.in_flight = self.in_flight.saturating_sub(1);
            let res = cqe.result();
            out.push(IoCompletion {
                tag: cqe.user_data(),
                result: if res < 0 { Err(io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) },
            });
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn direct(&self) -> bool {
        self.direct
    }

    fn release_slot(&mut self, s: usize) -> io::Result<()> {
        if self.registered && self.slot_registered[s] {
            // An empty entry: the kernel drops its pin once no request uses the buffer.
            let empty = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }];
            // SAFETY: an empty iovec registers nothing.
            unsafe { self.ring.submitter().register_buffers_update(s as u32, &empty, None) }?;
            self.slot_registered[s] = false;
        }
        Ok(())
    }
}

impl Drop for UringIo {
    fn drop(&mut self) {
        // Reads still in flight write into the arena; it may be unmapped (and its addresses
        // reused) right after the ring goes, so wait for them first.
        self.drain();
    }
}

/// A source of byte ranges other than local files (a remote tier): what `PoolIo` reads from.
/// A worker thread calls `read_at` and blocks until the range is in `dst` or has failed.
pub trait RangeReader: Send + Sync {
    fn name(&self) -> String;
    /// The index this reader gives the file that stands at `path` in the expert layout.
    fn file_index(&self, path: &Path) -> io::Result<usize>;
    /// Reads `dst.len()` bytes at `offset` of file `file` (fewer only at its end); returns
    /// how many arrived.
    fn read_at(&self, file: usize, offset: u64, dst: &mut [u8]) -> io::Result<usize>;
    /// What each tier behind the reader served so far (running totals).
    fn tiers(&self) -> Vec<sluice_model::expert::TierStat> {
        Vec::new()
    }
    /// Most bytes of reads of one file the pool hands over together to `read_run` (0: one at
    /// a time; a reader whose requests cost a round trip each gains from fewer, larger ones).
    fn merge_bytes(&self) -> usize {
        0
    }
    /// Reads a run of ranges of `file`, `(offset, buffer)` in order of offset, each starting
    /// at or before the end of those before it (they touch or overlap: together one range);
    /// one result per buffer.
    fn read_run(&self, file: usize, reads: &mut [(u64, &mut [u8])]) -> Vec<io::Result<usize>> {
        reads.iter_mut().map(|(off, d)| self.read_at(file, *off, d)).collect()
    }
}

/// Local files read with `pread`.
struct LocalFiles(Vec<File>);

impl RangeReader for LocalFiles {
    fn name(&self) -> String {
        "pread".into()
    }
    fn file_index(&self, _path: &Path) -> io::Result<usize> {
        unreachable!("local files are indexed by their place in the layout")
    }
    fn read_at(&self, file: usize, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        read_full_at(&self.0[file], dst, offset)
    }
}

/// Reads `dst.len()` bytes at `offset` of `f` with `pread`, retrying short reads and
/// interruptions; fewer only where the file ends. Returns how many arrived.
pub fn read_full_at(f: &File, dst: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < dst.len() {
        match f.read_at(&mut dst[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// The pool's queue of reads not yet taken by a worker.
struct Jobs {
    queue: Mutex<(VecDeque<IoRequest>, bool)>,
    ready: std::sync::Condvar,
}

impl Jobs {
    /// The next read, with the reads queued behind it that continue it in the same file (up
    /// to `merge` bytes in all); `None` once the pool is closed and the queue empty.
    fn take(&self, merge: usize) -> Option<Vec<IoRequest>> {
        let mut g = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(first) = g.0.pop_front() {
                // Reads that continue the run: starting inside it or where it ends, reaching
                // past its end (ranges widened to 4 KiB overlap their neighbours by a block).
                let mut run = vec![first];
                let mut end = first.offset + first.len as u64;
                let continues = |q: &IoRequest, end: u64| {
                    q.file == first.file && q.offset >= first.offset && q.offset <= end && q.offset + q.len as u64 > end
                };
                while let Some(i) = (merge > 0).then(|| g.0.iter().position(|q| continues(q, end))).flatten() {
                    let q_end = g.0[i].offset + g.0[i].len as u64;
                    if q_end - first.offset > merge as u64 {
                        break;
                    }
                    run.push(g.0.remove(i).expect("found"));
                    end = q_end;
                }
                return Some(run);
            }
            if g.1 {
                return None;
            }
            g = self.ready.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Reads on a pool of threads, each blocking in a `RangeReader`: `pread` on local files
/// (`PreadIo`), or a remote tier (whose back-to-back reads a worker takes together).
pub struct PoolIo {
    jobs: Arc<Jobs>,
    rx: mpsc::Receiver<IoCompletion>,
    workers: Vec<std::thread::JoinHandle<()>>,
    depth: usize,
    in_flight: usize,
    label: String,
    pub direct: bool,
}

/// The pread pool of local files.
pub type PreadIo = PoolIo;

impl PoolIo {
    /// A pread pool over local files, opened with O_DIRECT where the file system allows.
    pub fn new(paths: &[PathBuf], arena: Arc<Arena>, depth: usize) -> io::Result<PoolIo> {
        let (files, direct) = open_all(paths)?;
        let index = (0..files.len()).collect();
        let mut io = PoolIo::spawn(Arc::new(LocalFiles(files)), index, arena, depth, 16);
        io.direct = direct;
        io.label = format!("pread pool (depth {}, {})", io.depth, if direct { "O_DIRECT" } else { "buffered" });
        Ok(io)
    }

    /// A pool reading the layout's files (`paths`) through `reader`, with up to `threads`
    /// workers. Such a reader keeps no copy of what it reads in the page cache (it reads
    /// memory or the network, or drops the pages of the local files it reads), so the pool
    /// counts as direct.
    pub fn over(
        reader: Arc<dyn RangeReader>,
        paths: &[PathBuf],
        arena: Arc<Arena>,
        depth: usize,
        threads: usize,
    ) -> io::Result<PoolIo> {
        let files = paths.iter().map(|p| reader.file_index(p)).collect::<io::Result<Vec<_>>>()?;
        let mut io = PoolIo::spawn(reader.clone(), files, arena, depth, threads);
        io.label = format!("{} (depth {}, {} connections)", reader.name(), io.depth, io.workers.len());
        io.direct = true;
        Ok(io)
    }

    fn spawn(
        reader: Arc<dyn RangeReader>,
        files: Vec<usize>,
        arena: Arc<Arena>,
        depth: usize,
        threads: usize,
    ) -> PoolIo {
        let depth = depth.clamp(1, 256);
        let files = Arc::new(files);
        let jobs = Arc::new(Jobs { queue: Mutex::new((VecDeque::new(), false)), ready: std::sync::Condvar::new() });
        let (done_tx, rx) = mpsc::channel();
        let merge = reader.merge_bytes();
        let workers = (0..depth.min(threads.max(1)))
            .map(|i| {
                let (reader, files, arena, jobs, done) =
                    (reader.clone(), files.clone(), arena.clone(), jobs.clone(), done_tx.clone());
                std::thread::Builder::new()
                    .name(format!("sluice-io-{i}"))
                    .spawn(move || {
                        while let Some(run) = jobs.take(merge) {
                            // SAFETY: each read's slot range is reserved for it until its
                            // completion; the reads of one run are distinct reads.
                            let mut reads: Vec<(u64, &mut [u8])> = run
                                .iter()
                                .map(|r| {
                                    (r.offset, unsafe {
                                        std::slice::from_raw_parts_mut(arena.slot_ptr(r.slot).add(r.slot_offset), r.len)
                                    })
                                })
                                .collect();
                            let results = if run.len() == 1 {
                                vec![reader.read_at(files[run[0].file], run[0].offset, reads[0].1)]
                            } else {
                                reader.read_run(files[run[0].file], &mut reads)
                            };
                            for (r, result) in run.iter().zip(results) {
                                if done.send(IoCompletion { tag: r.tag, result }).is_err() {
                                    return;
                                }
                            }
                        }
                    })
                    .expect("spawning an IO thread")
            })
            .collect();
        PoolIo { jobs, rx, workers, depth, in_flight: 0, label: String::new(), direct: false }
    }
}

impl IoEngine for PoolIo {
    fn name(&self) -> String {
        self.label.clone()
    }

    fn room(&self) -> usize {
        self.depth - self.in_flight
    }

    fn start(&mut self, r: IoRequest) -> io::Result<()> {
        if self.workers.iter().all(|w| w.is_finished()) {
            return Err(io::Error::other("IO threads are gone"));
        }
        self.jobs.queue.lock().unwrap_or_else(|e| e.into_inner()).0.push_back(r);
        self.jobs.ready.notify_one();
        self.in_flight += 1;
        Ok(())
    }

    fn reap(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> io::Result<()> {
        let mut got = 0;
        while got < min.min(self.in_flight + got) && self.in_flight > 0 {
            let c = self.rx.recv().map_err(|_| io::Error::other("IO threads are gone"))?;
            self.in_flight -= 1;
            out.push(c);
            got += 1;
        }
        while let Ok(c) = self.rx.try_recv() {
            self.in_flight -= 1;
            out.push(c);
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn direct(&self) -> bool {
        self.direct
    }
}

impl Drop for PoolIo {
    fn drop(&mut self) {
        self.jobs.queue.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.jobs.ready.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// What `FaultyIo` does to a read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The read fails with EIO.
    Eio,
    /// The read returns half of what was asked.
    Short,
    /// The read succeeds but one byte comes back flipped.
    Corrupt,
    /// Starting the read fails (as a refused submit would).
    SubmitFail,
}

/// Faults to inject: `(n, fault)` applies to the n-th read started (counting from 0).
#[derive(Default)]
pub struct FaultPlan {
    pub faults: VecDeque<(u64, Fault)>,
    pub started: u64,
    /// Report buffered IO, as on a file system that refuses O_DIRECT.
    pub force_buffered: bool,
}

/// Wraps an engine and injects faults (tests).
pub struct FaultyIo {
    pub inner: Box<dyn IoEngine>,
    pub plan: Arc<Mutex<FaultPlan>>,
    pub arena: Arc<Arena>,
    pending: Vec<(u64, Fault, IoRequest)>,
}

impl FaultyIo {
    pub fn new(inner: Box<dyn IoEngine>, arena: Arc<Arena>, plan: Arc<Mutex<FaultPlan>>) -> FaultyIo {
        FaultyIo { inner, plan, arena, pending: Vec::new() }
    }
}

impl IoEngine for FaultyIo {
    fn name(&self) -> String {
        format!("{} with fault injection", self.inner.name())
    }
    fn room(&self) -> usize {
        self.inner.room()
    }
    fn release_slot(&mut self, s: usize) -> io::Result<()> {
        self.inner.release_slot(s)
    }
    fn start(&mut self, r: IoRequest) -> io::Result<()> {
        let mut p = self.plan.lock().unwrap_or_else(|e| e.into_inner());
        let n = p.started;
        p.started += 1;
        if let Some(i) = p.faults.iter().position(|(k, _)| *k == n) {
            let (_, f) = p.faults.remove(i).expect("found");
            if f == Fault::SubmitFail {
                return Err(io::Error::from_raw_os_error(libc::EAGAIN));
            }
            self.pending.push((r.tag, f, r));
        }
        drop(p);
        self.inner.start(r)
    }
    fn reap(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> io::Result<()> {
        let start = out.len();
        self.inner.reap(min, out)?;
        for c in &mut out[start..] {
            if let Some(i) = self.pending.iter().position(|(t, _, _)| *t == c.tag) {
                let (_, f, r) = self.pending.remove(i);
                match f {
                    Fault::Eio => c.result = Err(io::Error::from_raw_os_error(libc::EIO)),
                    Fault::Short => {
                        if let Ok(n) = c.result {
                            c.result = Ok(n / 2);
                        }
                    }
                    Fault::SubmitFail => {}
                    Fault::Corrupt => {
                        // SAFETY: the read's destination, still reserved for it.
                        unsafe {
                            let p = self.arena.slot_ptr(r.slot).add(r.slot_offset + r.len / 2);
                            *p ^= 0x5A;
                        }
                    }
                }
            }
        }
        Ok(())
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    fn direct(&self) -> bool {
        self.inner.direct() && !self.plan.lock().unwrap_or_else(|e| e.into_inner()).force_buffered
    }
}

/// Measures random-read bandwidth of `path` with reads of `block` bytes (rounded to 4 KiB),
/// `depth` in flight, for about `seconds`, through the same engine the cache uses. This is the
/// disk bound a streaming benchmark reports its speed against.
pub fn read_bandwidth(path: &Path, block: usize, depth: usize, seconds: f64, uring: bool) -> io::Result<(f64, bool)> {
    let block = block.div_ceil(4096).max(1) * 4096;
    let len = std::fs::metadata(path)?.len();
    if len < block as u64 {
        return Err(io::Error::other(format!("{} is smaller than one {block}-byte read", path.display())));
    }
    let depth = depth.max(1);
    let arena = Arc::new(Arena::new(depth, block)?);
    let paths = [path.to_path_buf()];
    let (mut eng, direct): (Box<dyn IoEngine>, bool) = if uring {
        let u = UringIo::new(&paths, arena.clone(), depth, true)?;
        let d = u.direct;
        (Box::new(u), d)
    } else {
        let p = PreadIo::new(&paths, arena.clone(), depth)?;
        let d = p.direct;
        (Box::new(p), d)
    };
    let slots_in_file = (len - block as u64) / 4096;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next_off = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % slots_in_file.max(1)) * 4096
    };
    let t0 = std::time::Instant::now();
    let mut free: Vec<usize> = (0..depth).collect();
    let mut slot_of: HashMap<u64, usize> = HashMap::new();
    let (mut bytes, mut tag) = (0u64, 0u64);
    let mut done = Vec::new();
    loop {
        let elapsed = t0.elapsed().as_secs_f64();
        while elapsed < seconds && eng.room() > 0 {
            let Some(slot) = free.pop() else { break };
            tag += 1;
            slot_of.insert(tag, slot);
            eng.start(IoRequest { tag, file: 0, offset: next_off(), len: block, slot, slot_offset: 0 })?;
        }
        if eng.in_flight() == 0 {
            break;
        }
        done.clear();
        eng.reap(1, &mut done)?;
        for c in &done {
            bytes += c.result.as_ref().map_err(|e| io::Error::new(e.kind(), e.to_string()))?.to_owned() as u64;
            free.push(slot_of.remove(&c.tag).expect("tag started"));
        }
    }
    Ok((bytes as f64 / t0.elapsed().as_secs_f64(), direct))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(len: usize, tag: &str) -> (PathBuf, Vec<u8>) {
        let path = sluice_formats::scratch_root().join(format!("sluice-io-{tag}-{}.bin", std::process::id()));
        let data: Vec<u8> = (0..len).map(|i| (i * 31 + (i >> 12)) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        (path, data)
    }

    #[test]
    fn dropping_the_ring_waits_for_reads_in_flight() {
        // Reads in flight at drop must land before the engine is gone (their buffers may be
        // unmapped right after): after the drop, every slot holds its data.
        let slot = 4 << 20;
        let n = 12;
        let (path, data) = file_of(n * slot, "drain");
        let arena = Arc::new(Arena::new(n, slot).unwrap());
        let mut io = UringIo::new(std::slice::from_ref(&path), arena.clone(), n, false).unwrap();
        for s in 0..n {
            io.start(IoRequest {
                tag: s as u64,
                file: 0,
                offset: (s * slot) as u64,
                len: slot,
                slot: s,
                slot_offset: 0,
            })
            .unwrap();
        }
        assert_eq!(io.in_flight(), n);
        drop(io);
        for s in 0..n {
            // SAFETY: no read is in flight any more; the arena is alive.
            let got = unsafe { std::slice::from_raw_parts(arena.slot_ptr(s), slot) };
            assert!(got == &data[s * slot..(s + 1) * slot], "slot {s} incomplete after drop");
        }
        std::fs::remove_file(path).ok();
    }

    #[test]
    fn drain_collects_every_read_in_flight() {
        let slot = 1 << 20;
        let (path, _) = file_of(8 * slot, "drain2");
        let arena = Arc::new(Arena::new(8, slot).unwrap());
        let mut io = UringIo::new(std::slice::from_ref(&path), arena, 8, true).unwrap();
        for s in 0..8 {
            io.start(IoRequest {
                tag: s as u64,
                file: 0,
                offset: (s * slot) as u64,
                len: slot,
                slot: s,
                slot_offset: 0,
            })
            .unwrap();
        }
        assert_eq!(io.drain(), 8);
        assert_eq!(io.in_flight(), 0);
        std::fs::remove_file(path).ok();
    }

    #[test]
    fn injected_faults_reach_the_completion() {
        let slot = 4096;
        let (path, _) = file_of(4 * slot, "faults");
        let arena = Arc::new(Arena::new(4, slot).unwrap());
        let inner = Box::new(PreadIo::new(std::slice::from_ref(&path), arena.clone(), 4).unwrap());
        let plan = Arc::new(Mutex::new(FaultPlan::default()));
        plan.lock().unwrap().faults.extend([(0, Fault::Eio), (1, Fault::Short), (2, Fault::SubmitFail)]);
        let mut io = FaultyIo::new(inner, arena, plan);
        let req = |s: usize| IoRequest {
            tag: s as u64,
            file: 0,
            offset: (s * slot) as u64,
            len: slot,
            slot: s,
            slot_offset: 0,
        };
        io.start(req(0)).unwrap();
        io.start(req(1)).unwrap();
        assert!(io.start(req(2)).is_err(), "a refused submit is an error of start");
        io.start(req(3)).unwrap();
        let mut out = Vec::new();
        while out.len() < 3 {
            io.reap(1, &mut out).unwrap();
        }
        out.sort_by_key(|c| c.tag);
        assert!(out[0].result.is_err());
        assert_eq!(*out[1].result.as_ref().unwrap(), slot / 2);
        assert_eq!(*out[2].result.as_ref().unwrap(), slot);
        assert_eq!(io.in_flight(), 0);
        std::fs::remove_file(path).ok();
    }

    #[test]
    fn a_worker_takes_the_reads_that_continue_the_first_together_within_the_limit() {
        let r = |tag, file, offset: u64| IoRequest { tag, file, offset, len: 4096, slot: 0, slot_offset: 0 };
        let jobs = Jobs { queue: Mutex::new((VecDeque::new(), false)), ready: std::sync::Condvar::new() };
        let fill = || {
            let mut q = jobs.queue.lock().unwrap();
            q.0.clear();
            // In file 0: 1 overlaps the end of 0 by a block, 3 starts where 1 ends, 5 lies
            // inside the run (reaches no further), 4 is a gap away; 2 is another file.
            let span = |tag, file, a: u64, b: u64| IoRequest { len: (b - a) as usize, ..r(tag, file, a) };
            q.0.extend([
                span(0, 0, 0, 8192),
                span(2, 1, 8192, 12288),
                span(1, 0, 4096, 12288),
                span(3, 0, 12288, 16384),
                span(5, 0, 2048, 6144),
                span(4, 0, 20480, 24576),
            ]);
        };
        let tags = |v: Vec<IoRequest>| v.iter().map(|x| x.tag).collect::<Vec<_>>();
        fill();
        assert_eq!(tags(jobs.take(1 << 20).unwrap()), [0, 1, 3]);
        assert_eq!(tags(jobs.take(1 << 20).unwrap()), [2]);
        assert_eq!(tags(jobs.take(1 << 20).unwrap()), [5]);
        assert_eq!(tags(jobs.take(1 << 20).unwrap()), [4]);
        fill();
        assert_eq!(tags(jobs.take(12288).unwrap()), [0, 1], "at most the limit");
        fill();
        assert_eq!(tags(jobs.take(0).unwrap()), [0], "no merging: one at a time, in order");
        jobs.queue.lock().unwrap().0.clear();
        jobs.queue.lock().unwrap().1 = true;
        assert!(jobs.take(1 << 20).is_none(), "closed and empty");
    }
}
