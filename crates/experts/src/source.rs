//! `StreamingExperts`: the `ExpertSource` that serves routed experts from disk through the
//! hard-quota cache.
//!
//! A layer's request pins what is resident, reserves slots for the misses and starts all their
//! reads at once (demand reads go to the IO engine before any prefetch read); `next()` hands
//! out resident experts first and then each miss as its reads complete, so the kernels work
//! while reads land. When the quota is smaller than a layer's experts, the request proceeds in
//! waves: an expert whose slot could not be reserved retries as soon as the MoE block drops a
//! view. A failed, short or corrupt read fails the request with a message naming the expert and
//! the file, and frees the slot, so the cache stays consistent and the next request retries.

use crate::arena::Arena;
use crate::cache::{Cache, Key, Lookup, Policy, SlotState};
use crate::io::{FaultPlan, FaultyIo, IoCompletion, IoEngine, IoRequest, PreadIo, UringIo};
use crate::layout::{Layout, Read};
use crate::{ExpertError, Result};
use sluice_kernels::MatRef;
use sluice_model::expert::{ExpertFetch, ExpertSource, ExpertStats, ExpertView, ExpertWeights};
use sluice_model::ModelError;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoKind {
    /// io_uring if the system allows it, else a pread pool.
    Auto,
    Uring,
    Pread,
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

struct State {
    cache: Cache,
    io: Box<dyn IoEngine>,
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
    /// Per slot: reads not yet completed, and the first error among them.
    reads_left: Vec<u32>,
    slot_error: Vec<Option<String>>,
    /// Keys whose reads failed, with the message for whoever waits on them.
    failed: HashMap<Key, String>,
    tags: HashMap<u64, (usize, Read)>,
    next_tag: u64,
    bytes_read: u64,
    /// Payload bytes of the experts made resident (demand misses and prefetches).
    loaded_bytes: u64,
    stall_ns: u64,
    quota_changes: Vec<(f64, u64, u64, String)>,
}

pub struct StreamingExperts {
    layout: Layout,
    arena: Arc<Arena>,
    state: Mutex<State>,
    io_name: String,
    prefetch: bool,
    prefetch_budget: usize,
    max_quota: usize,
    started: Instant,
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
        let io: Box<dyn IoEngine> = match o.io {
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
        let per_layer = layout.experts.iter().map(|l| l.len()).max().unwrap_or(1).max(1);
        let budget = if o.prefetch_budget > 0 {
            o.prefetch_budget
        } else {
            (slot_bytes * per_layer.min(16) * 2).min(n * slot_bytes / 2)
        };
        Ok(StreamingExperts {
            state: Mutex::new(State {
                cache,
                io,
                demand: VecDeque::new(),
                prefetch: VecDeque::new(),
                reads_left: vec![0; n],
                slot_error: vec![None; n],
                failed: HashMap::new(),
                tags: HashMap::new(),
                next_tag: 1,
                bytes_read: 0,
                loaded_bytes: 0,
                stall_ns: 0,
                quota_changes: Vec::new(),
            }),
            layout,
            arena,
            io_name,
            prefetch: o.prefetch,
            prefetch_budget: budget,
            max_quota: n * slot_bytes,
            started: Instant::now(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn slot_bytes(&self) -> usize {
        self.arena.slot_bytes
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn policy(&self) -> Policy {
        self.lock().cache.policy()
    }

    /// Sets the quota (bytes, clamped to what was allocated); returns the new quota. Slots in
    /// use keep their memory until they are released, so shrinking may take effect gradually.
    pub fn set_quota(&self, quota: usize, reason: &str) -> usize {
        let mut st = self.lock();
        let old = st.cache.quota();
        let q = quota.min(self.max_quota).max(self.arena.slot_bytes);
        if st.io.in_flight() > 0 && q < old {
            return old; // shrink between reads only
        }
        for s in st.cache.set_quota(q) {
            // A slot the engine could not let go of keeps its pages (and stays consistent).
            if st.io.release_slot(s).is_ok() {
                self.arena.release(s);
            }
        }
        let new = st.cache.quota();
        if new != old {
            let t = self.started.elapsed().as_secs_f64();
            st.quota_changes.push((t, old as u64, new as u64, reason.to_string()));
        }
        new
    }

    pub fn quota(&self) -> usize {
        self.lock().cache.quota()
    }

    pub fn max_quota(&self) -> usize {
        self.max_quota
    }

    /// Queues the reads of `slot` for expert `key`.
    fn enqueue(&self, st: &mut State, key: Key, slot: usize, prefetch: bool) {
        let plan = self.layout.plan(key.0 as usize, key.1 as usize).expect("layout covers the key");
        st.reads_left[slot] = plan.reads.len() as u32;
        st.slot_error[slot] = None;
        let q = if prefetch { &mut st.prefetch } else { &mut st.demand };
        for r in &plan.reads {
            q.push_back(Job { slot, read: *r });
        }
    }

    /// Moves queued prefetch reads of `slot` ahead of everything (a demand caught up with them).
    fn promote(st: &mut State, slot: usize) {
        let mut keep = VecDeque::new();
        while let Some(j) = st.prefetch.pop_front() {
            if j.slot == slot {
                st.demand.push_front(j);
            } else {
                keep.push_back(j);
            }
        }
        st.prefetch = keep;
    }

    /// Starts queued reads while the engine has room, demand first.
    fn pump(&self, st: &mut State) -> Result<()> {
        while st.io.room() > 0 {
            let Some(j) = st.demand.pop_front().or_else(|| st.prefetch.pop_front()) else { break };
            let tag = st.next_tag;
            st.next_tag += 1;
            st.tags.insert(tag, (j.slot, j.read));
            let req = IoRequest {
                tag,
                file: j.read.file,
                offset: j.read.offset,
                len: j.read.len as usize,
                slot: j.slot,
                slot_offset: j.read.slot_offset as usize,
            };
            if let Err(e) = st.io.start(req) {
                st.tags.remove(&tag);
                return Err(io_err(&self.layout, e));
            }
        }
        Ok(())
    }

    /// Applies finished reads to the cache.
    fn complete(&self, st: &mut State, done: Vec<IoCompletion>) {
        for c in done {
            let Some((slot, read)) = st.tags.remove(&c.tag) else { continue };
            let file = self.layout.files[read.file].display();
            match c.result {
                Ok(n) if n as u64 >= read.need => st.bytes_read += n as u64,
                Ok(n) => {
                    st.bytes_read += n as u64;
                    st.slot_error[slot].get_or_insert(format!(
                        "short read from {file}: {n} of {} bytes at offset {}",
                        read.need, read.offset
                    ));
                }
                Err(e) => {
                    st.slot_error[slot].get_or_insert(format!("read error in {file} at offset {}: {e}", read.offset));
                }
            }
            st.reads_left[slot] -= 1;
            if st.reads_left[slot] > 0 {
                continue;
            }
            let key = st.cache.slots[slot].key.expect("a loading slot has a key");
            let mut err = st.slot_error[slot].take();
            if err.is_none() {
                err = self.verify(key, slot);
            }
            match err {
                None => {
                    st.loaded_bytes +=
                        self.layout.plan(key.0 as usize, key.1 as usize).map_or(0, |p| p.payload_bytes());
                    st.cache.loaded(slot)
                }
                Some(msg) => {
                    st.failed.insert(key, format!("layer {} expert {}: {msg}", key.0, key.1));
                    st.cache.failed(slot);
                }
            }
        }
    }

    /// Checks a pack record's checksum.
    fn verify(&self, key: Key, slot: usize) -> Option<String> {
        let plan = self.layout.plan(key.0 as usize, key.1 as usize)?;
        let want = plan.checksum?;
        let len = plan.payload_bytes() as usize;
        // SAFETY: the slot's reads completed; the slot is still Loading, so no one else uses it.
        let bytes = unsafe { std::slice::from_raw_parts(self.arena.slot_ptr(slot), len) };
        let got = xxhash_rust::xxh3::xxh3_64(bytes);
        (got != want).then(|| {
            format!(
                "checksum mismatch in pack record at offset {} of {} (stored {want:016x}, read {got:016x})",
                plan.reads[0].offset,
                self.layout.files[0].display()
            )
        })
    }

    /// Waits for at least one read and applies what finished.
    fn wait(&self, st: &mut State) -> Result<()> {
        let t0 = Instant::now();
        let mut done = Vec::new();
        st.io.reap(1, &mut done).map_err(|e| io_err(&self.layout, e))?;
        st.stall_ns += t0.elapsed().as_nanos() as u64;
        self.complete(st, done);
        self.pump(st)
    }

    fn poll(&self, st: &mut State) -> Result<()> {
        let mut done = Vec::new();
        st.io.reap(0, &mut done).map_err(|e| io_err(&self.layout, e))?;
        self.complete(st, done);
        self.pump(st)
    }

    fn view(&self, slot: usize, key: Key) -> Box<dyn ExpertView + '_> {
        let plan = self.layout.plan(key.0 as usize, key.1 as usize).expect("layout covers the key");
        let base = self.arena.slot_ptr(slot);
        let mat = |i: usize| {
            let p = &plan.parts[i];
            // SAFETY: the slot is Ready and pinned for this view: its bytes are complete and
            // nothing writes to them until the view unpins it on drop.
            let data = unsafe { std::slice::from_raw_parts(base.add(plan.part_offsets[i] as usize), p.len as usize) };
            MatRef { dtype: p.dtype, rows: p.rows, cols: p.cols, data }
        };
        Box::new(SlotView { src: self, slot, w: ExpertWeights { gate: mat(0), up: mat(1), down: mat(2) } })
    }
}

fn io_err(layout: &Layout, e: std::io::Error) -> ExpertError {
    ExpertError::Io { path: layout.files.first().cloned().unwrap_or_default(), source: e }
}

struct SlotView<'s> {
    src: &'s StreamingExperts,
    slot: usize,
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
        self.src.lock().cache.unpin(self.slot);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Item {
    /// Pinned and resident.
    Ready(usize),
    /// Pinned, reads in flight.
    Waiting(usize),
    /// No slot could be reserved yet.
    NoSlot,
    Done,
}

struct StreamFetch<'s> {
    src: &'s StreamingExperts,
    layer: u32,
    experts: Vec<u32>,
    items: Vec<Item>,
}

impl<'s> ExpertFetch<'s> for StreamFetch<'s> {
    fn next(&mut self) -> Option<sluice_model::Result<(usize, Box<dyn ExpertView + 's>)>> {
        let src = self.src;
        let mut st = src.lock();
        loop {
            // 1. Anything resident now?
            for i in 0..self.items.len() {
                let key = (self.layer, self.experts[i]);
                match self.items[i] {
                    Item::Ready(s) => {
                        self.items[i] = Item::Done;
                        drop(st);
                        return Some(Ok((i, src.view(s, key))));
                    }
                    Item::Waiting(s) => {
                        if let Some(msg) = st.failed.remove(&key) {
                            self.items[i] = Item::Done;
                            return Some(Err(ModelError::Expert(msg)));
                        }
                        if st.cache.slots[s].state == SlotState::Ready && st.cache.slots[s].key == Some(key) {
                            self.items[i] = Item::Done;
                            drop(st);
                            return Some(Ok((i, src.view(s, key))));
                        }
                    }
                    _ => {}
                }
            }
            // 2. Experts still without a slot: retry (views dropped since may have freed one).
            for i in 0..self.items.len() {
                if self.items[i] != Item::NoSlot {
                    continue;
                }
                let key = (self.layer, self.experts[i]);
                match st.cache.lookup_or_reserve(key, false) {
                    Lookup::Ready(s) => self.items[i] = Item::Ready(s),
                    Lookup::Loading(s) => {
                        StreamingExperts::promote(&mut st, s);
                        self.items[i] = Item::Waiting(s);
                    }
                    Lookup::Reserved(s) => {
                        src.enqueue(&mut st, key, s, false);
                        self.items[i] = Item::Waiting(s);
                    }
                    Lookup::Full => {}
                }
            }
            if self.items.iter().all(|i| *i == Item::Done) {
                return None;
            }
            if self.items.iter().any(|i| matches!(i, Item::Ready(_))) {
                continue;
            }
            if let Err(e) = src.pump(&mut st) {
                return Some(Err(ModelError::Expert(e.to_string())));
            }
            if st.io.in_flight() == 0 {
                // Nothing in flight and nothing resident: no progress is possible.
                let n = st.cache.capacity_slots();
                return Some(Err(ModelError::Expert(format!(
                    "the expert cache's {n} slots are all in use; raise --expert-cache"
                ))));
            }
            if let Err(e) = src.wait(&mut st) {
                return Some(Err(ModelError::Expert(e.to_string())));
            }
        }
    }
}

impl Drop for StreamFetch<'_> {
    fn drop(&mut self) {
        // Unpin whatever was reserved but not handed out (an error cut the request short).
        let mut st = self.src.lock();
        for (i, item) in self.items.iter().enumerate() {
            if let Item::Ready(s) | Item::Waiting(s) = item {
                if st.cache.slots[*s].key == Some((self.layer, self.experts[i])) {
                    st.cache.unpin(*s);
                }
            }
        }
    }
}

impl ExpertSource for StreamingExperts {
    fn fetch<'s>(&'s self, layer: usize, experts: &[u32]) -> sluice_model::Result<Box<dyn ExpertFetch<'s> + 's>> {
        if self.layout.experts.get(layer).is_none_or(|l| l.is_empty()) {
            return Err(ModelError::Expert(format!("layer {layer} has no routed experts")));
        }
        let mut st = self.lock();
        self.poll(&mut st).map_err(|e| ModelError::Expert(e.to_string()))?;
        let mut items = Vec::with_capacity(experts.len());
        for &e in experts {
            if e as usize >= self.layout.experts[layer].len() {
                return Err(ModelError::Expert(format!("expert {e} out of range in layer {layer}")));
            }
            let key = (layer as u32, e);
            st.failed.remove(&key);
            items.push(match st.cache.lookup_or_reserve(key, false) {
                Lookup::Ready(s) => Item::Ready(s),
                Lookup::Loading(s) => {
                    Self::promote(&mut st, s);
                    Item::Waiting(s)
                }
                Lookup::Reserved(s) => {
                    self.enqueue(&mut st, key, s, false);
                    Item::Waiting(s)
                }
                Lookup::Full => Item::NoSlot,
            });
        }
        self.pump(&mut st).map_err(|e| ModelError::Expert(e.to_string()))?;
        Ok(Box::new(StreamFetch { src: self, layer: layer as u32, experts: experts.to_vec(), items }))
    }

    fn wants_prefetch(&self, layer: usize) -> bool {
        self.prefetch
            && self.layout.experts.get(layer).is_some_and(|l| self.lock().cache.held_in_layer(layer as u32) < l.len())
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        if !self.prefetch || self.layout.experts.get(layer).is_none_or(|l| l.is_empty()) {
            return;
        }
        let mut st = self.lock();
        for &e in experts {
            if e as usize >= self.layout.experts[layer].len() {
                continue;
            }
            if st.cache.prefetched_unused_bytes() + self.arena.slot_bytes > self.prefetch_budget {
                break;
            }
            let key = (layer as u32, e);
            if let Lookup::Reserved(s) = st.cache.lookup_or_reserve(key, true) {
                self.enqueue(&mut st, key, s, true);
            }
        }
        let _ = self.pump(&mut st);
    }

    fn resident_bytes(&self) -> usize {
        self.lock().cache.resident_bytes()
    }

    fn expert_bytes(&self) -> usize {
        self.layout.experts.iter().flatten().map(|p| p.payload_bytes() as usize).max().unwrap_or(0)
    }

    fn describe(&self) -> String {
        let st = self.lock();
        format!(
            "streaming experts: {:.2} GiB cache ({} slots of {:.2} MiB), {} eviction, prefetch {}, {}",
            st.cache.quota() as f64 / (1u64 << 30) as f64,
            st.cache.capacity_slots(),
            self.arena.slot_bytes as f64 / (1u64 << 20) as f64,
            st.cache.policy().name(),
            if self.prefetch { "on" } else { "off" },
            self.io_name
        )
    }

    fn stats(&self) -> ExpertStats {
        let st = self.lock();
        let c = &st.cache.counters;
        ExpertStats {
            hits: c.hits,
            misses: c.misses,
            evictions: c.evictions,
            bytes_read: st.bytes_read,
            loaded_bytes: st.loaded_bytes,
            stall_ns: st.stall_ns,
            prefetch_issued: c.prefetch_issued,
            prefetch_hits: c.prefetch_hits,
            prefetch_wasted: c.prefetch_wasted,
            quota_bytes: st.cache.quota() as u64,
            resident_bytes: st.cache.resident_bytes() as u64,
            quota_changes: st.quota_changes.clone(),
        }
    }
}
