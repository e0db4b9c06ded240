//! `StreamingExperts`: the `ExpertSource` that serves routed experts from disk through the
//! hard-quota cache.
//!
//! A layer's request pins what is resident, reserves slots for the misses and starts all their
//! reads at once (demand reads go to the IO engine before any prefetch read); `next()` hands
//! out resident experts first and then each miss as its reads complete, so the kernels work
//! while reads land. When the quota is smaller than a layer's experts, the request proceeds in
//! waves: an expert whose slot could not be reserved retries as soon as the MoE block drops a
//! view. A failed, short or corrupt read (or one the engine refuses to start) fails every
//! request waiting on that expert with a message naming the expert and the file; the cache
//! forgets the key at once, so the next request reads it again, and frees the slot once every
//! holder has let go of it.

use crate::arena::Arena;
use crate::cache::{Cache, Key, Lookup, Pin, Policy, SlotState};
use crate::io::{FaultPlan, FaultyIo, IoCompletion, IoEngine, IoRequest, PoolIo, PreadIo, RangeReader, UringIo};
use crate::layout::{Layout, Read};
use crate::{ExpertError, Result};
use sluice_kernels::MatRef;
use sluice_model::expert::{ExpertFetch, ExpertSource, ExpertStats, ExpertView, ExpertWeights};
use sluice_model::ModelError;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Clone)]
pub enum IoKind {
    /// io_uring if the system allows it, else a pread pool.
    Auto,
    Uring,
    Pread,
    /// The layout's files are stand-ins: every read goes to this reader (a remote tier), on a
    /// pool of up to `depth` threads.
    Ranges(Arc<dyn RangeReader>),
}

impl std::fmt::Debug for IoKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoKind::Auto => f.write_str("Auto"),
            IoKind::Uring => f.write_str("Uring"),
            IoKind::Pread => f.write_str("Pread"),
            IoKind::Ranges(r) => write!(f, "Ranges({})", r.name()),
        }
    }
}

#[derive(Clone)]
pub struct StreamOptions {
    pub quota: usize,
    pub policy: Policy,
    pub prefetch: bool,
    /// Most bytes of prefetched-but-unused experts at any time (0: two layers' worth).
    pub prefetch_budget: usize,
    pub depth: usize,
    pub io: IoKind,
    pub register_buffers: bool,
    /// Inject IO faults (tests).
    pub faults: Option<Arc<Mutex<FaultPlan>>>,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            quota: 0,
            policy: Policy::Lru,
            prefetch: true,
            prefetch_budget: 0,
            depth: 32,
            io: IoKind::Auto,
            register_buffers: true,
            faults: None,
        }
    }
}

struct Job {
    slot: usize,
    read: Read,
}

/// The cache's bookkeeping and the read queues: held only for short, non-blocking work.
struct Book {
    cache: Cache,
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
    /// Per slot: reads not yet completed, the first error among them, and (once the slot
    /// has failed) the message its holders report.
    reads_left: Vec<u32>,
    slot_error: Vec<Option<String>>,
    failure: Vec<Option<String>>,
    tags: HashMap<u64, (usize, Read)>,
    next_tag: u64,
    /// Per (layer, expert): its bytes were read once and passed `verify`'s value checks.
    checked: Vec<Vec<bool>>,
    /// Reads handed to the engine and not yet applied here.
    in_flight: usize,
    /// A holder of the engine is blocked waiting for a completion; others wait on `changed`.
    reaping: bool,
    /// Slots removed by a quota shrink whose memory is given back by the next holder of the
    /// engine (it must drop its registration first).
    to_release: Vec<usize>,
    bytes_read: u64,
    /// Payload bytes of the experts made resident (demand misses and prefetches).
    loaded_bytes: u64,
    stall_ns: u64,
    quota_changes: Vec<(f64, u64, u64, String)>,
}

thread_local! {
    /// A reformed expert's raw bytes while its matrices are written over them.
    static RAW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// How long a request waits for a slot that other holders keep pinned before it gives up.
const SLOT_WAIT: Duration = Duration::from_secs(60);

/// The streaming expert source.
///
/// Locking: `io` (the engine) is taken before `book`, never after; a thread holding `book`
/// only `try_lock`s the engine. Nobody waits for a read while holding `book`: one thread
/// at a time (`Book::reaping`) blocks in the engine holding only `io`, then applies what
/// finished and wakes the others through `changed`. So the pressure monitor can shrink the
/// quota, and other requests can pin what is resident, while a layer's reads are in flight.
pub struct StreamingExperts {
    layout: Layout,
    arena: Arc<Arena>,
    io: Mutex<Box<dyn IoEngine>>,
    book: Mutex<Book>,
    changed: Condvar,
    io_name: String,
    direct: bool,
    prefetch: bool,
    prefetch_budget: usize,
    max_quota: usize,
    started: Instant,
    /// The reader behind the IO pool, when reads do not go to local files.
    reader: Option<Arc<dyn RangeReader>>,
}

impl StreamingExperts {
    pub fn new(layout: Layout, o: StreamOptions) -> Result<StreamingExperts> {
        let slot_bytes = layout.slot_bytes();
        let cache = Cache::new(o.quota, slot_bytes, o.policy)
            .map_err(|_| ExpertError::QuotaTooSmall { quota: o.quota as u64, min: slot_bytes as u64 })?;
        let n = cache.capacity_slots();
        let arena = Arc::new(
            Arena::new(n, slot_bytes).map_err(|e| ExpertError::Model(format!("allocating the expert cache: {e}")))?,
        );
        let io: Box<dyn IoEngine> = match &o.io {
            // `depth` workers (connections) and twice as many reads in flight: reads queued
            // behind busy workers are taken together with the reads they continue (one
            // request for back-to-back experts where the reader merges).
            IoKind::Ranges(reader) => Box::new(
                PoolIo::over(reader.clone(), &layout.files, arena.clone(), o.depth * 2, o.depth)
                    .map_err(|e| io_err(&layout, e))?,
            ),
            IoKind::Pread => {
                Box::new(PreadIo::new(&layout.files, arena.clone(), o.depth).map_err(|e| io_err(&layout, e))?)
            }
            IoKind::Uring => Box::new(
                UringIo::new(&layout.files, arena.clone(), o.depth, o.register_buffers)
                    .map_err(|e| io_err(&layout, e))?,
            ),
            IoKind::Auto => match UringIo::new(&layout.files, arena.clone(), o.depth, o.register_buffers) {
                Ok(u) => Box::new(u),
                Err(_) => {
                    Box::new(PreadIo::new(&layout.files, arena.clone(), o.depth).map_err(|e| io_err(&layout, e))?)
                }
            },
        };
        let io: Box<dyn IoEngine> = match &o.faults {
            Some(plan) => Box::new(FaultyIo::new(io, arena.clone(), plan.clone())),
            None => io,
        };
        let io_name = io.name();
        let direct = io.direct();
        let per_layer = layout.experts.iter().map(|l| l.len()).max().unwrap_or(1).max(1);
        let budget = if o.prefetch_budget > 0 {
            o.prefetch_budget
        } else {
            (slot_bytes * per_layer.min(16) * 2).min(n * slot_bytes / 2)
        };
        Ok(StreamingExperts {
            book: Mutex::new(Book {
                cache,
                demand: VecDeque::new(),
                prefetch: VecDeque::new(),
                reads_left: vec![0; n],
                slot_error: vec![None; n],
                failure: vec![None; n],
                tags: HashMap::new(),
                checked: layout.experts.iter().map(|l| vec![false; l.len()]).collect(),
                next_tag: 1,
                in_flight: 0,
                reaping: false,
                to_release: Vec::new(),
                bytes_read: 0,
                loaded_bytes: 0,
                stall_ns: 0,
                quota_changes: Vec::new(),
            }),
            io: Mutex::new(io),
            changed: Condvar::new(),
            layout,
            arena,
            io_name,
            direct,
            prefetch: o.prefetch,
            prefetch_budget: budget,
            max_quota: n * slot_bytes,
            started: Instant::now(),
            reader: match &o.io {
                IoKind::Ranges(r) => Some(r.clone()),
                _ => None,
            },
        })
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn engine(&self) -> MutexGuard<'_, Box<dyn IoEngine>> {
        self.io.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The engine if no one else holds it (callers holding `book` must not block on it).
    fn try_engine(&self) -> Option<MutexGuard<'_, Box<dyn IoEngine>>> {
        match self.io.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    pub fn slot_bytes(&self) -> usize {
        self.arena.slot_bytes
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn policy(&self) -> Policy {
        self.book().cache.policy()
    }

    /// Whether every expert file was opened with O_DIRECT. When not (tmpfs, some network
    /// file systems), reads go through the page cache, which then holds a second copy of
    /// what was read: the memory bound no longer holds.
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// Sets the quota (bytes, clamped to what was allocated); returns the new quota. Slots in
    /// use keep their memory until they are released, so shrinking may take effect gradually.
    /// Never waits for reads: it may run while a layer streams.
    pub fn set_quota(&self, quota: usize, reason: &str) -> usize {
        let mut b = self.book();
        let old = b.cache.quota();
        let q = quota.min(self.max_quota).max(self.arena.slot_bytes);
        let removed = b.cache.set_quota(q);
        b.to_release.extend(removed);
        if let Some(mut io) = self.try_engine() {
            self.release_removed(&mut **io, &mut b);
        }
        let new = b.cache.quota();
        if new != old {
            let t = self.started.elapsed().as_secs_f64();
            b.quota_changes.push((t, old as u64, new as u64, reason.to_string()));
        }
        new
    }

    pub fn quota(&self) -> usize {
        self.book().cache.quota()
    }

    pub fn max_quota(&self) -> usize {
        self.max_quota
    }

    /// Gives the memory of slots dropped by a shrink back to the system (unless a regrow
    /// took them back first).
    fn release_removed(&self, io: &mut dyn IoEngine, b: &mut Book) {
        let n = b.cache.capacity_slots();
        for s in std::mem::take(&mut b.to_release) {
            // A slot the engine could not let go of keeps its pages (and stays consistent).
            if s >= n && io.release_slot(s).is_ok() {
                self.arena.release(s);
            }
        }
    }

    /// Queues the reads of `slot` for expert `key`.
    fn enqueue(&self, b: &mut Book, key: Key, slot: usize, prefetch: bool) {
        let plan = self.layout.plan(key.0 as usize, key.1 as usize).expect("layout covers the key");
        b.reads_left[slot] = plan.reads.len() as u32;
        b.slot_error[slot] = None;
        b.failure[slot] = None;
        let q = if prefetch { &mut b.prefetch } else { &mut b.demand };
        for r in &plan.reads {
            q.push_back(Job { slot, read: *r });
        }
    }

    /// Moves queued prefetch reads of `slot` ahead of everything (a demand caught up with them).
    fn promote(b: &mut Book, slot: usize) {
        let mut keep = VecDeque::new();
        while let Some(j) = b.prefetch.pop_front() {
            if j.slot == slot {
                b.demand.push_front(j);
            } else {
                keep.push_back(j);
            }
        }
        b.prefetch = keep;
    }

    /// Starts queued reads while the engine has room, demand first. A read the engine
    /// refuses fails its expert (its holders get the error); the others go on.
    fn pump(&self, io: &mut dyn IoEngine, b: &mut Book) {
        self.release_removed(io, b);
        while io.room() > 0 {
            let Some(j) = b.demand.pop_front().or_else(|| b.prefetch.pop_front()) else { break };
            let tag = b.next_tag;
            b.next_tag += 1;
            let req = IoRequest {
                tag,
                file: j.read.file,
                offset: j.read.offset,
                len: j.read.len as usize,
                slot: j.slot,
                slot_offset: j.read.slot_offset as usize,
            };
            match io.start(req) {
                Ok(()) => {
                    b.tags.insert(tag, (j.slot, j.read));
                    b.in_flight += 1;
                }
                Err(e) => self.complete_read(b, j.slot, j.read, Err(e)),
            }
        }
    }

    /// Starts queued reads if the engine is free now; otherwise its holder will.
    fn try_pump(&self, b: &mut Book) {
        if let Some(mut io) = self.try_engine() {
            self.pump(&mut **io, b);
        }
    }

    /// Applies finished reads to the cache.
    fn complete(&self, b: &mut Book, done: Vec<IoCompletion>) {
        for c in done {
            let Some((slot, read)) = b.tags.remove(&c.tag) else { continue };
            b.in_flight -= 1;
            self.complete_read(b, slot, read, c.result);
        }
    }

    fn complete_read(&self, b: &mut Book, slot: usize, read: Read, result: std::io::Result<usize>) {
        let file = self.layout.files[read.file].display();
        match result {
            Ok(n) if n as u64 >= read.need => b.bytes_read += n as u64,
            Ok(n) => {
                b.bytes_read += n as u64;
                b.slot_error[slot].get_or_insert(format!(
                    "short read from {file}: {n} of {} bytes at offset {}",
                    read.need, read.offset
                ));
            }
            Err(e) => {
                b.slot_error[slot].get_or_insert(format!("read error in {file} at offset {}: {e}", read.offset));
            }
        }
        b.reads_left[slot] -= 1;
        if b.reads_left[slot] > 0 {
            return;
        }
        let key = b.cache.slots[slot].key.expect("a loading slot has a key");
        let mut err = b.slot_error[slot].take();
        if err.is_none() {
            let (l, e) = (key.0 as usize, key.1 as usize);
            err = self.verify(key, slot, !b.checked[l][e]);
            b.checked[l][e] = err.is_none();
        }
        match err {
            None => {
                b.loaded_bytes += self.layout.plan(key.0 as usize, key.1 as usize).map_or(0, |p| p.payload_bytes());
                b.cache.loaded(slot)
            }
            Some(msg) => {
                b.failure[slot] = Some(format!("layer {} expert {}: {msg}", key.0, key.1));
                b.cache.failed(slot);
            }
        }
    }

    /// Makes a slot whose reads all completed ready for the kernels: checks a pack record's
    /// checksum, rewrites an expert not stored in the kernels' form, and, the first time the
    /// expert is read (`first`), refuses values no weight has (an MXFP4 scale of 0xFF; a
    /// rewrite checks those every time, as it goes). Returns what is wrong, if anything.
    fn verify(&self, key: Key, slot: usize, first: bool) -> Option<String> {
        let plan = self.layout.plan(key.0 as usize, key.1 as usize)?;
        // SAFETY: the slot's reads completed; the slot is still Loading, so no one else uses
        // it, and a slot holds `slot_bytes` (≥ every plan's `slot_bytes`).
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.arena.slot_ptr(slot), self.arena.slot_bytes) };
        if let Some(want) = plan.checksum {
            let got = xxhash_rust::xxh3::xxh3_64(&bytes[..plan.payload_bytes() as usize]);
            if got != want {
                return Some(format!(
                    "checksum mismatch in pack record at offset {} of {} (stored {want:016x}, read {got:016x})",
                    plan.reads[0].offset,
                    self.layout.files[0].display()
                ));
            }
        }
        if let Some(r) = &plan.reform {
            // The matrices overwrite the raw bytes they are made from: copy those out first.
            let landed = RAW.with_borrow_mut(|raw| {
                raw.clear();
                raw.extend_from_slice(&bytes[..r.raw_bytes as usize]);
                r.apply(raw, bytes, &plan.part_offsets)
            });
            if let Err(m) = landed {
                return Some(format!("{}: {m}", self.layout.files[r.sources[0].0].display()));
            }
            return None;
        }
        // The bytes cannot change between reads (as for any mapped weight), so once is enough:
        // a scan of a 13 MB MXFP4 expert costs about a millisecond of a 2-thread decode step.
        if !first {
            return None;
        }
        plan.check(bytes, &plan.part_offsets)
            .map(|m| format!("{}: {m}", self.layout.files[plan.reads[0].file].display()))
    }

    /// Collects finished reads without waiting, if the engine is free.
    fn poll(&self, b: &mut Book) -> Result<()> {
        let Some(mut io) = self.try_engine() else { return Ok(()) };
        let mut done = Vec::new();
        io.reap(0, &mut done).map_err(|e| io_err(&self.layout, e))?;
        self.complete(b, done);
        self.pump(&mut **io, b);
        Ok(())
    }

    /// Blocks until at least one read finishes and applies what finished. The caller has
    /// set `reaping` and holds neither lock. Returns false when nothing was in flight.
    fn reap_blocking(&self) -> Result<bool> {
        let mut io = self.engine();
        {
            let mut b = self.book();
            self.pump(&mut **io, &mut b);
            if b.in_flight == 0 {
                return Ok(false);
            }
        }
        let mut done = Vec::new();
        let r = io.reap(1, &mut done);
        let mut b = self.book();
        self.complete(&mut b, done);
        self.pump(&mut **io, &mut b);
        r.map_err(|e| io_err(&self.layout, e))?;
        Ok(true)
    }

    fn view(&self, pin: Pin, key: Key) -> Box<dyn ExpertView + '_> {
        let plan = self.layout.plan(key.0 as usize, key.1 as usize).expect("layout covers the key");
        let base = self.arena.slot_ptr(pin.slot());
        let mat = |i: usize| {
            let p = &plan.parts[i];
            // SAFETY: the slot is Ready and pinned for this view: its bytes are complete and
            // nothing writes to them until the view unpins it on drop.
            let data = unsafe { std::slice::from_raw_parts(base.add(plan.part_offsets[i] as usize), p.len as usize) };
            MatRef { dtype: p.dtype, rows: p.rows, cols: p.cols, data }
        };
        let w = ExpertWeights { gate: mat(0), up: mat(1), down: mat(2) };
        Box::new(SlotView { src: self, pin: Some(pin), w })
    }

    /// Gives a pin back and wakes anyone waiting for a slot.
    fn release(&self, b: &mut Book, pin: Pin) {
        b.cache.unpin(pin);
        self.changed.notify_all();
    }

    /// Reads `keys` (layer, expert) into the cache, in order, up to its capacity, and waits for
    /// them: warming the cache before the first token. Returns how many are resident after.
    /// A failed read leaves its expert out (a later demand reads it again and reports it).
    pub fn prewarm(&self, keys: &[(u32, u32)]) -> Result<usize> {
        {
            let mut b = self.book();
            let cap = b.cache.capacity_slots();
            for &(l, e) in keys.iter().take(cap) {
                if self.layout.experts.get(l as usize).is_none_or(|x| e as usize >= x.len()) {
                    continue;
                }
                if let Some(s) = b.cache.reserve_warm((l, e)) {
                    self.enqueue(&mut b, (l, e), s, false);
                }
            }
            self.try_pump(&mut b);
        }
        loop {
            let mut b = self.book();
            if b.in_flight == 0 && b.demand.is_empty() {
                break;
            }
            if b.reaping {
                drop(self.changed.wait(b).unwrap_or_else(|e| e.into_inner()));
                continue;
            }
            b.reaping = true;
            drop(b);
            let r = self.reap_blocking();
            self.book().reaping = false;
            self.changed.notify_all();
            if !r? {
                break;
            }
        }
        let b = self.book();
        let resident: std::collections::HashSet<Key> = b.cache.resident_keys().collect();
        Ok(keys.iter().filter(|k| resident.contains(k)).count())
    }

    /// The experts resident now, per layer (index: layer), each list sorted: what the cache
    /// holds at this moment, for display. Read-only; takes the bookkeeping lock briefly.
    pub fn resident_experts(&self) -> Vec<Vec<u32>> {
        let mut out = vec![Vec::new(); self.layout.experts.len()];
        for (l, e) in self.book().cache.resident_keys() {
            if let Some(v) = out.get_mut(l as usize) {
                v.push(e);
            }
        }
        out.iter_mut().for_each(|v| v.sort_unstable());
        out
    }

    /// Checks the cache's invariants (tests).
    pub fn check(&self) {
        self.book().cache.check();
    }
}

fn io_err(layout: &Layout, e: std::io::Error) -> ExpertError {
    ExpertError::Io { path: layout.files.first().cloned().unwrap_or_default(), source: e }
}

struct SlotView<'s> {
    src: &'s StreamingExperts,
    pin: Option<Pin>,
    w: ExpertWeights<'s>,
}

// SAFETY: the view only reads pinned arena memory; unpinning goes through the mutex.
unsafe impl Send for SlotView<'_> {}

impl ExpertView for SlotView<'_> {
    fn weights(&self) -> ExpertWeights<'_> {
        self.w
    }
}

impl Drop for SlotView<'_> {
    fn drop(&mut self) {
        if let Some(pin) = self.pin.take() {
            self.src.release(&mut self.src.book(), pin);
        }
    }
}

enum Item {
    /// Pinned; resident, or its reads are in flight.
    Pinned(Pin),
    /// No slot could be reserved yet.
    NoSlot,
    Done,
}

struct StreamFetch<'s> {
    src: &'s StreamingExperts,
    layer: u32,
    experts: Vec<u32>,
    items: Vec<Item>,
    /// Indices of requested experts that will not be handed out (`fetch_resident`).
    missing: Vec<usize>,
}

impl<'s> StreamFetch<'s> {
    /// An empty request for `experts` of `layer`, checked against the layout.
    fn new(src: &'s StreamingExperts, layer: usize, experts: &[u32]) -> sluice_model::Result<StreamFetch<'s>> {
        let Some(ids) = src.layout.experts.get(layer).filter(|l| !l.is_empty()) else {
            return Err(ModelError::Expert(format!("layer {layer} has no routed experts")));
        };
        if let Some(e) = experts.iter().find(|e| **e as usize >= ids.len()) {
            return Err(ModelError::Expert(format!("expert {e} out of range in layer {layer}")));
        }
        Ok(StreamFetch {
            src,
            layer: layer as u32,
            experts: experts.to_vec(),
            items: Vec::with_capacity(experts.len()),
            missing: Vec::new(),
        })
    }

    /// An item whose slot is ready or failed, handed out (or reported) now.
    fn settled(&mut self, b: &mut Book) -> Option<sluice_model::Result<usize>> {
        for i in 0..self.items.len() {
            let Item::Pinned(pin) = &self.items[i] else { continue };
            match b.cache.state(pin.slot()) {
                SlotState::Ready => return Some(Ok(i)),
                SlotState::Failed => {
                    let msg = b.failure[pin.slot()].clone().unwrap_or_else(|| "read failed".into());
                    let Item::Pinned(pin) = std::mem::replace(&mut self.items[i], Item::Done) else { unreachable!() };
                    self.src.release(b, pin);
                    return Some(Err(ModelError::Expert(msg)));
                }
                _ => {}
            }
        }
        None
    }

    /// Tries again to reserve slots for experts that had none.
    fn retry_reservations(&mut self, b: &mut Book) {
        for i in 0..self.items.len() {
            if !matches!(self.items[i], Item::NoSlot) {
                continue;
            }
            let key = (self.layer, self.experts[i]);
            self.items[i] = match b.cache.acquire(key) {
                Lookup::Ready(p) => Item::Pinned(p),
                Lookup::Loading(p) => {
                    StreamingExperts::promote(b, p.slot());
                    Item::Pinned(p)
                }
                Lookup::Reserved(p) => {
                    self.src.enqueue(b, key, p.slot(), false);
                    Item::Pinned(p)
                }
                Lookup::Full => Item::NoSlot,
            };
        }
    }
}

impl<'s> ExpertFetch<'s> for StreamFetch<'s> {
    /// Every requested expert pinned and resident: `next` will hand each out without waiting.
    fn all_resident(&self) -> bool {
        let b = self.src.book();
        self.items.iter().all(|i| match i {
            Item::Pinned(p) => b.cache.state(p.slot()) == SlotState::Ready,
            Item::NoSlot => false,
            Item::Done => true,
        })
    }

    fn missing(&self) -> &[usize] {
        &self.missing
    }

    fn next(&mut self) -> Option<sluice_model::Result<(usize, Box<dyn ExpertView + 's>)>> {
        let src = self.src;
        let mut b = src.book();
        let mut waited: Option<Instant> = None;
        let mut slot_wait_from: Option<Instant> = None;
        let result = loop {
            match self.settled(&mut b) {
                Some(Ok(i)) => {
                    let Item::Pinned(pin) = std::mem::replace(&mut self.items[i], Item::Done) else { unreachable!() };
                    break Some(Ok((i, pin)));
                }
                Some(Err(e)) => break Some(Err(e)),
                None => {}
            }
            self.retry_reservations(&mut b);
            if self.items.iter().all(|i| matches!(i, Item::Done)) {
                break None;
            }
            if self.items.iter().any(|i| matches!(i, Item::Pinned(p) if b.cache.state(p.slot()) == SlotState::Ready)) {
                continue;
            }
            // Nothing to hand out yet: wait, never holding `book` while the engine blocks.
            waited.get_or_insert_with(Instant::now);
            src.try_pump(&mut b);
            if b.reaping {
                b = src.changed.wait(b).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            if b.in_flight > 0 || !b.demand.is_empty() || !b.prefetch.is_empty() {
                b.reaping = true;
                drop(b);
                let r = src.reap_blocking();
                b = src.book();
                b.reaping = false;
                src.changed.notify_all();
                match r {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(e) => break Some(Err(ModelError::Expert(e.to_string()))),
                }
            }
            // No read in flight and none queued: every slot is held by other holders.
            // Their pins are given back as they finish; wait for one, within reason.
            let since = *slot_wait_from.get_or_insert_with(Instant::now);
            let left = SLOT_WAIT.saturating_sub(since.elapsed());
            if left.is_zero() {
                let n = b.cache.capacity_slots();
                break Some(Err(ModelError::Expert(format!(
                    "the expert cache's {n} slots stayed in use for {} s; raise --expert-cache",
                    SLOT_WAIT.as_secs()
                ))));
            }
            b = src.changed.wait_timeout(b, left.min(Duration::from_millis(50))).unwrap_or_else(|e| e.into_inner()).0;
        };
        if let Some(t) = waited {
            b.stall_ns += t.elapsed().as_nanos() as u64;
        }
        drop(b);
        match result {
            None => None,
            Some(Err(e)) => Some(Err(e)),
            Some(Ok((i, pin))) => {
                let key = (self.layer, self.experts[i]);
                Some(Ok((i, src.view(pin, key))))
            }
        }
    }
}

impl Drop for StreamFetch<'_> {
    fn drop(&mut self) {
        // Give back whatever was pinned but not handed out (an error cut the request short).
        let mut b = self.src.book();
        for item in std::mem::take(&mut self.items) {
            if let Item::Pinned(pin) = item {
                self.src.release(&mut b, pin);
            }
        }
    }
}

impl ExpertSource for StreamingExperts {
    fn fetch<'s>(&'s self, layer: usize, experts: &[u32]) -> sluice_model::Result<Box<dyn ExpertFetch<'s> + 's>> {
        let mut fetch = StreamFetch::new(self, layer, experts)?;
        let mut b = self.book();
        self.poll(&mut b).map_err(|e| ModelError::Expert(e.to_string()))?;
        fetch.items.extend(experts.iter().map(|_| Item::NoSlot));
        fetch.retry_reservations(&mut b);
        self.try_pump(&mut b);
        drop(b);
        Ok(Box::new(fetch))
    }

    fn fetch_resident<'s>(
        &'s self,
        layer: usize,
        experts: &[u32],
    ) -> sluice_model::Result<Box<dyn ExpertFetch<'s> + 's>> {
        let mut fetch = StreamFetch::new(self, layer, experts)?;
        let mut b = self.book();
        for (i, &e) in experts.iter().enumerate() {
            match b.cache.pin_ready((layer as u32, e)) {
                Some(p) => fetch.items.push(Item::Pinned(p)),
                None => {
                    fetch.items.push(Item::Done);
                    fetch.missing.push(i);
                }
            }
        }
        drop(b);
        Ok(Box::new(fetch))
    }

    fn wants_prefetch(&self, layer: usize) -> bool {
        self.prefetch
            && self.layout.experts.get(layer).is_some_and(|l| self.book().cache.held_in_layer(layer as u32) < l.len())
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        if !self.prefetch || self.layout.experts.get(layer).is_none_or(|l| l.is_empty()) {
            return;
        }
        let mut b = self.book();
        for &e in experts {
            if e as usize >= self.layout.experts[layer].len() {
                continue;
            }
            if b.cache.prefetched_unused_bytes() + self.arena.slot_bytes > self.prefetch_budget {
                break;
            }
            let key = (layer as u32, e);
            if let Some(s) = b.cache.reserve_prefetch(key) {
                self.enqueue(&mut b, key, s, true);
            }
        }
        self.try_pump(&mut b);
    }

    fn resident_bytes(&self) -> usize {
        self.book().cache.resident_bytes()
    }

    fn expert_bytes(&self) -> usize {
        self.layout.experts.iter().flatten().map(|p| p.payload_bytes() as usize).max().unwrap_or(0)
    }

    fn describe(&self) -> String {
        let b = self.book();
        format!(
            "streaming experts: {:.2} GiB cache ({} slots of {:.2} MiB), {} eviction, prefetch {}, {}{}",
            b.cache.quota() as f64 / (1u64 << 30) as f64,
            b.cache.capacity_slots(),
            self.arena.slot_bytes as f64 / (1u64 << 20) as f64,
            b.cache.policy().name(),
            if self.prefetch { "on" } else { "off" },
            self.io_name,
            if self.direct {
                ""
            } else {
                "; WARNING: O_DIRECT refused by the file system, reads go through the page cache, which keeps its own copy of what was read (memory use may exceed the quota)"
            }
        )
    }

    fn stats(&self) -> ExpertStats {
        let b = self.book();
        let c = &b.cache.counters;
        ExpertStats {
            hits: c.hits,
            misses: c.misses,
            evictions: c.evictions,
            bytes_read: b.bytes_read,
            loaded_bytes: b.loaded_bytes,
            stall_ns: b.stall_ns,
            prefetch_issued: c.prefetch_issued,
            prefetch_hits: c.prefetch_hits,
            prefetch_wasted: c.prefetch_wasted,
            quota_bytes: b.cache.quota() as u64,
            resident_bytes: b.cache.resident_bytes() as u64,
            quota_changes: b.quota_changes.clone(),
            buffered_io: !self.direct,
            tiers: self.reader.as_ref().map_or_else(Vec::new, |r| r.tiers()),
        }
    }
}
