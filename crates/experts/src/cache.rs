//! The expert cache's bookkeeping: which expert sits in which slot, in what state, pinned by
//! how many holders, and which slot to give up next. Pure logic, no IO: `source` drives it.
//!
//! Invariants (checked by `check` in tests):
//! * `slots.len() × slot_bytes ≤ quota` at all times: the byte quota is hard, alignment and
//!   slack included, because every slot has the same size;
//! * a key maps to at most one slot, and a slot holds at most one key;
//! * every holder of a slot holds a `Pin` token of its own, and `pins` counts the tokens;
//!   a pinned slot is never evicted or reused, so a token always refers to the slot it was
//!   given for (no holder can release another holder's pin);
//! * a `Loading` slot is never handed to a reader before its data has fully arrived; a read
//!   that fails turns the slot `Failed`: its key is forgotten at once (the next request reads
//!   again), and the slot stays out of use until its last holder has seen the failure;
//! * counters only grow.

use std::collections::{BTreeSet, HashMap};

/// (layer, expert)
pub type Key = (u32, u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Evict the least recently used expert.
    Lru,
    /// Evict the least frequently used expert; counts halve every `aging_period` accesses so
    /// that old popularity fades (ties broken by recency).
    LfuAging,
}

impl Policy {
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "lru" => Some(Policy::Lru),
            "lfu" | "lfu-aging" => Some(Policy::LfuAging),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::LfuAging => "lfu-aging",
        }
    }

    pub const ALL: [Policy; 2] = [Policy::Lru, Policy::LfuAging];
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Free,
    /// Reads in flight; `prefetch` says who asked first.
    Loading {
        prefetch: bool,
    },
    Ready,
    /// Its reads failed; kept (key forgotten) until every holder has released its pin.
    Failed,
}

/// One holder's claim on a slot: while it lives the slot is neither evicted nor reused.
/// Given back with `Cache::unpin`; neither `Clone` nor `Copy`, so each holder releases its
/// own claim exactly once.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a pin must be given back with Cache::unpin"]
pub struct Pin(usize);

impl Pin {
    pub fn slot(&self) -> usize {
        self.0
    }
}

#[derive(Clone, Debug)]
pub struct Slot {
    pub key: Option<Key>,
    pub state: SlotState,
    pub pins: u32,
    /// Filled by a prefetch and not yet asked for.
    pub prefetched_unused: bool,
    prio: Option<(u64, u64)>,
    /// The eviction priority the slot had when `pin_ready` took it out of the evictable set,
    /// restored when the last pin goes if no demand touched it meanwhile.
    quiet_prio: Option<(u64, u64)>,
}

impl Slot {
    fn free() -> Slot {
        Slot { key: None, state: SlotState::Free, pins: 0, prefetched_unused: false, prio: None, quiet_prio: None }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Demands served by a prefetch (ready or still in flight).
    pub prefetch_hits: u64,
    pub prefetch_issued: u64,
    /// Prefetched experts evicted before anyone asked for them.
    pub prefetch_wasted: u64,
}

/// What `acquire` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Resident; pinned for the caller.
    Ready(Pin),
    /// Already being read; pinned for the caller.
    Loading(Pin),
    /// Not resident; a slot was reserved and pinned, the caller must read into it.
    Reserved(Pin),
    /// Not resident and every slot is in use: try again after some unpin.
    Full,
}

pub struct Cache {
    pub slot_bytes: usize,
    quota: usize,
    pub slots: Vec<Slot>,
    map: HashMap<Key, usize>,
    /// Keys in `map` per layer (index: layer).
    per_layer: Vec<usize>,
    policy: Policy,
    /// Unpinned ready slots, lowest priority first.
    evictable: BTreeSet<((u64, u64), usize)>,
    free: Vec<usize>,
    tick: u64,
    freq: HashMap<Key, u64>,
    aging_period: u64,
    pub counters: Counters,
}

impl Cache {
    /// A cache of `quota` bytes in slots of `slot_bytes`; at least one slot must fit.
    pub fn new(quota: usize, slot_bytes: usize, policy: Policy) -> Result<Cache, String> {
        if slot_bytes == 0 || quota < slot_bytes {
            return Err(format!("an expert cache of {quota} bytes cannot hold one expert slot of {slot_bytes} bytes"));
        }
        let n = quota / slot_bytes;
        Ok(Cache {
            slot_bytes,
            quota,
            slots: (0..n).map(|_| Slot::free()).collect(),
            map: HashMap::new(),
            per_layer: Vec::new(),
            policy,
            evictable: BTreeSet::new(),
            free: (0..n).rev().collect(),
            tick: 0,
            freq: HashMap::new(),
            aging_period: (n as u64 * 8).max(64),
            counters: Counters::default(),
        })
    }

    pub fn quota(&self) -> usize {
        self.quota
    }

    pub fn capacity_slots(&self) -> usize {
        self.slots.len()
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Slots holding or loading an expert.
    pub fn used_slots(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn resident_bytes(&self) -> usize {
        self.used_slots() * self.slot_bytes
    }

    /// Experts of `layer` resident or loading.
    pub fn held_in_layer(&self, layer: u32) -> usize {
        self.per_layer.get(layer as usize).copied().unwrap_or(0)
    }

    fn map_insert(&mut self, key: Key, s: usize) {
        let l = key.0 as usize;
        if self.per_layer.len() <= l {
            self.per_layer.resize(l + 1, 0);
        }
        self.per_layer[l] += 1;
        self.map.insert(key, s);
    }

    fn map_remove(&mut self, key: Key) {
        if self.map.remove(&key).is_some() {
            self.per_layer[key.0 as usize] -= 1;
        }
    }

    /// Keys of the experts resident now (read and ready), in slot order.
    pub fn resident_keys(&self) -> impl Iterator<Item = Key> + '_ {
        self.slots.iter().filter(|s| s.state == SlotState::Ready).filter_map(|s| s.key)
    }

    pub fn slot_of(&self, key: Key) -> Option<usize> {
        self.map.get(&key).copied()
    }

    fn touch(&mut self, key: Key) {
        self.tick += 1;
        if self.policy == Policy::LfuAging {
            *self.freq.entry(key).or_insert(0) += 1;
            if self.tick.is_multiple_of(self.aging_period) {
                self.freq.retain(|_, c| {
                    *c /= 2;
                    *c > 0
                });
            }
        }
    }

    fn priority(&self, key: Key) -> (u64, u64) {
        match self.policy {
            Policy::Lru => (self.tick, 0),
            Policy::LfuAging => (self.freq.get(&key).copied().unwrap_or(0), self.tick),
        }
    }

    fn make_evictable(&mut self, s: usize) {
        let key = self.slots[s].key.expect("a ready slot has a key");
        let p = self.slots[s].quiet_prio.take().unwrap_or_else(|| self.priority(key));
        self.slots[s].prio = Some(p);
        self.evictable.insert((p, s));
    }

    fn not_evictable(&mut self, s: usize) {
        if let Some(p) = self.slots[s].prio.take() {
            self.evictable.remove(&(p, s));
        }
    }

    /// Pins `key` for a demand if resident or loading; otherwise reserves a slot (evicting
    /// the policy's victim if needed) and pins it: the caller must then read into it.
    pub fn acquire(&mut self, key: Key) -> Lookup {
        if let Some(&s) = self.map.get(&key) {
            self.touch(key);
            if self.slots[s].prefetched_unused {
                self.slots[s].prefetched_unused = false;
                self.counters.prefetch_hits += 1;
            }
            // Resident, or in flight (usually a prefetch): either way the read is paid for.
            self.counters.hits += 1;
            let slot = &mut self.slots[s];
            slot.pins += 1;
            slot.quiet_prio = None;
            let ready = slot.state == SlotState::Ready;
            self.not_evictable(s);
            return if ready { Lookup::Ready(Pin(s)) } else { Lookup::Loading(Pin(s)) };
        }
        let Some(s) = self.take_slot() else { return Lookup::Full };
        self.counters.misses += 1;
        self.touch(key);
        self.occupy(s, key, false);
        self.slots[s].pins = 1;
        Lookup::Reserved(Pin(s))
    }

    /// Pins `key` if it is resident and ready, as if nobody had asked: no counter moves, and
    /// when the last pin goes the slot gets back the eviction priority it had (unless a demand
    /// touched it meanwhile). For passes that use what the cache holds without being part of
    /// its workload (drafting from the resident experts).
    pub fn pin_ready(&mut self, key: Key) -> Option<Pin> {
        let s = *self.map.get(&key)?;
        if self.slots[s].state != SlotState::Ready {
            return None;
        }
        if self.slots[s].pins == 0 {
            let p = self.slots[s].prio;
            self.not_evictable(s);
            self.slots[s].quiet_prio = p;
        }
        self.slots[s].pins += 1;
        Some(Pin(s))
    }

    /// Reserves a slot for reading `key` ahead of demand, unpinned (a `Loading` slot is never
    /// evicted, so none is needed). `None` if `key` is resident or on its way already, or no
    /// slot is free or evictable.
    pub fn reserve_prefetch(&mut self, key: Key) -> Option<usize> {
        if self.map.contains_key(&key) {
            return None;
        }
        let s = self.take_slot()?;
        self.counters.prefetch_issued += 1;
        self.occupy(s, key, true);
        Some(s)
    }

    /// Reserves a slot for warming the cache with `key` before any demand (its reads are the
    /// caller's to issue): unlike a prefetch, it is not counted as one, so hits on it are
    /// plain hits and prefetch precision stays about the prefetcher.
    pub fn reserve_warm(&mut self, key: Key) -> Option<usize> {
        if self.map.contains_key(&key) {
            return None;
        }
        let s = self.take_slot()?;
        self.occupy(s, key, false);
        Some(s)
    }

    /// A free slot, evicting the policy's victim if there is none.
    fn take_slot(&mut self) -> Option<usize> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let (_, victim) = self.evictable.iter().next().copied()?;
        self.evict(victim);
        self.free.pop()
    }

    fn occupy(&mut self, s: usize, key: Key, prefetch: bool) {
        let slot = &mut self.slots[s];
        slot.key = Some(key);
        slot.state = SlotState::Loading { prefetch };
        slot.pins = 0;
        slot.prefetched_unused = prefetch;
        self.map_insert(key, s);
    }

    fn evict(&mut self, s: usize) {
        self.not_evictable(s);
        let slot = &mut self.slots[s];
        debug_assert_eq!(slot.pins, 0);
        if slot.prefetched_unused {
            self.counters.prefetch_wasted += 1;
        }
        let key = slot.key.take();
        slot.state = SlotState::Free;
        slot.prefetched_unused = false;
        if let Some(k) = key {
            self.map_remove(k);
        }
        self.counters.evictions += 1;
        self.free.push(s);
    }

    /// The reads of slot `s` completed.
    pub fn loaded(&mut self, s: usize) {
        let slot = &mut self.slots[s];
        debug_assert!(matches!(slot.state, SlotState::Loading { .. }));
        slot.state = SlotState::Ready;
        if slot.pins == 0 {
            self.make_evictable(s);
        }
    }

    /// The reads of slot `s` failed: forget its key (the next request reads again). Its
    /// holders learn of the failure from the slot's state and release their pins; the slot
    /// is free once the last one has.
    pub fn failed(&mut self, s: usize) {
        self.not_evictable(s);
        if let Some(k) = self.slots[s].key {
            if self.map.get(&k) == Some(&s) {
                self.map_remove(k);
            }
        }
        let slot = &mut self.slots[s];
        slot.state = SlotState::Failed;
        slot.prefetched_unused = false;
        if slot.pins == 0 {
            self.free_slot(s);
        }
    }

    fn free_slot(&mut self, s: usize) {
        let slot = &mut self.slots[s];
        slot.key = None;
        slot.state = SlotState::Free;
        slot.prefetched_unused = false;
        self.free.push(s);
    }

    /// Gives back one holder's pin.
    pub fn unpin(&mut self, pin: Pin) {
        let s = pin.0;
        let slot = &mut self.slots[s];
        assert!(slot.pins > 0, "slot {s}: a pin was given back twice");
        slot.pins -= 1;
        if slot.pins == 0 {
            match slot.state {
                SlotState::Ready => self.make_evictable(s),
                SlotState::Failed => self.free_slot(s),
                _ => {}
            }
        }
    }

    /// The state of slot `s` (for holders waiting on it).
    pub fn state(&self, s: usize) -> SlotState {
        self.slots[s].state
    }

    /// Bytes of slots filled by prefetch and not used yet.
    pub fn prefetched_unused_bytes(&self) -> usize {
        self.slots.iter().filter(|s| s.prefetched_unused).count() * self.slot_bytes
    }

    /// Changes the quota: shrinking drops unpinned slots from the end (returns them so their
    /// memory can be released); grows add free slots. Returns the slots removed.
    pub fn set_quota(&mut self, quota: usize) -> Vec<usize> {
        let target = (quota / self.slot_bytes).max(1);
        let mut removed = Vec::new();
        while self.slots.len() > target {
            let s = self.slots.len() - 1;
            if self.slots[s].pins > 0 || matches!(self.slots[s].state, SlotState::Loading { .. } | SlotState::Failed) {
                break; // in use: shrink again later
            }
            if self.slots[s].state == SlotState::Ready {
                self.evict(s);
            }
            self.free.retain(|f| *f != s);
            self.slots.pop();
            removed.push(s);
        }
        while self.slots.len() < target {
            self.free.push(self.slots.len());
            self.slots.push(Slot::free());
        }
        self.quota = self.slots.len() * self.slot_bytes;
        self.aging_period = (self.slots.len() as u64 * 8).max(64);
        removed
    }

    /// Verifies the invariants (tests call it after every step).
    pub fn check(&self) {
        assert!(self.slots.len() * self.slot_bytes <= self.quota.max(self.slot_bytes));
        for (k, s) in &self.map {
            assert_eq!(self.slots[*s].key, Some(*k));
        }
        let mut keyed = 0;
        for (i, s) in self.slots.iter().enumerate() {
            match s.state {
                SlotState::Free => {
                    assert!(s.key.is_none() && s.pins == 0 && self.free.contains(&i));
                }
                SlotState::Failed => {
                    // Forgotten by the map, waiting for its holders.
                    assert!(s.pins > 0 && !self.free.contains(&i), "failed slot {i} without holders");
                    assert!(s.key.is_none_or(|k| self.map.get(&k) != Some(&i)));
                }
                _ => {
                    keyed += 1;
                    assert!(self.map.get(&s.key.expect("keyed")) == Some(&i));
                    assert!(!self.free.contains(&i));
                }
            }
            let in_set = s.prio.is_some_and(|p| self.evictable.contains(&(p, i)));
            assert_eq!(in_set, s.state == SlotState::Ready && s.pins == 0, "slot {i} evictable flag");
        }
        assert_eq!(keyed, self.map.len());
        for (l, n) in self.per_layer.iter().enumerate() {
            assert_eq!(*n, self.map.keys().filter(|k| k.0 as usize == l).count(), "layer {l} count");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Acquires `key`; if it had to be read, pretends the read succeeded.
    fn get(c: &mut Cache, key: Key) -> Pin {
        match c.acquire(key) {
            Lookup::Reserved(p) => {
                c.loaded(p.slot());
                p
            }
            Lookup::Ready(p) | Lookup::Loading(p) => p,
            Lookup::Full => panic!("cache full"),
        }
    }

    #[test]
    fn quota_smaller_than_a_slot_is_refused() {
        assert!(Cache::new(100, 200, Policy::Lru).is_err());
        assert_eq!(Cache::new(450, 200, Policy::Lru).unwrap().capacity_slots(), 2);
    }

    #[test]
    fn a_quiet_pin_moves_no_counter_and_keeps_the_eviction_order() {
        for policy in [Policy::Lru, Policy::LfuAging] {
            let mut c = Cache::new(3 * 10, 10, policy).unwrap();
            for e in 0..3 {
                let p = get(&mut c, (0, e));
                c.unpin(p);
            }
            let before = c.counters.clone();
            // Expert 0 is the victim; pinning it quietly (twice, as two layers' passes might)
            // neither counts nor refreshes it.
            let (a, b) = (c.pin_ready((0, 0)).unwrap(), c.pin_ready((0, 0)).unwrap());
            assert!(c.pin_ready((0, 7)).is_none(), "not resident: nothing to pin");
            c.unpin(a);
            c.unpin(b);
            c.check();
            assert_eq!(c.counters, before, "{policy:?}");
            let p = get(&mut c, (0, 3));
            c.unpin(p);
            assert!(c.slot_of((0, 0)).is_none(), "{policy:?}: expert 0 should have been evicted first");
            // While quietly pinned it is not evictable; a demand touch meanwhile counts.
            let q = c.pin_ready((0, 1)).unwrap();
            let p = get(&mut c, (0, 1));
            c.unpin(q);
            c.unpin(p);
            let p = get(&mut c, (0, 4));
            c.unpin(p);
            assert!(c.slot_of((0, 1)).is_some(), "{policy:?}: the demand touched expert 1, so 2 goes");
            assert!(c.slot_of((0, 2)).is_none(), "{policy:?}");
            c.check();
        }
    }

    #[test]
    fn lru_evicts_the_least_recent_and_never_a_pinned_slot() {
        let mut c = Cache::new(3 * 10, 10, Policy::Lru).unwrap();
        for e in 0..3 {
            let p = get(&mut c, (0, e));
            c.unpin(p);
            c.check();
        }
        // Touch expert 0 so expert 1 is the oldest.
        let p0 = get(&mut c, (0, 0));
        c.unpin(p0);
        let Lookup::Reserved(p9) = c.acquire((0, 9)) else { panic!() };
        assert!(c.slot_of((0, 1)).is_none(), "expert 1 should be evicted");
        assert!(c.slot_of((0, 0)).is_some() && c.slot_of((0, 2)).is_some());
        // Pin everything: a new key cannot get a slot.
        let Lookup::Ready(a) = c.acquire((0, 0)) else { panic!() };
        let Lookup::Ready(b) = c.acquire((0, 2)) else { panic!() };
        assert_eq!(c.acquire((0, 7)), Lookup::Full);
        assert_eq!(c.reserve_prefetch((0, 7)), None);
        c.check();
        assert_eq!(c.counters.evictions, 1);
        for p in [a, b, p9] {
            c.unpin(p);
        }
        c.check();
    }

    #[test]
    fn experts_held_per_layer_follow_reservations_evictions_and_failures() {
        let mut c = Cache::new(3 * 10, 10, Policy::Lru).unwrap();
        let Lookup::Reserved(a) = c.acquire((2, 0)) else { panic!() };
        let b = c.reserve_prefetch((2, 1)).unwrap();
        let Lookup::Reserved(d) = c.acquire((5, 0)) else { panic!() };
        assert_eq!((c.held_in_layer(2), c.held_in_layer(5), c.held_in_layer(9)), (2, 1, 0));
        c.failed(b);
        assert_eq!(c.held_in_layer(2), 1);
        for p in [a, d] {
            c.loaded(p.slot());
            c.unpin(p);
        }
        // A new layer-7 expert evicts the least recent one, layer 2's.
        let x = get(&mut c, (7, 3));
        let y = get(&mut c, (7, 4));
        assert_eq!((c.held_in_layer(2), c.held_in_layer(5), c.held_in_layer(7)), (0, 1, 2));
        c.unpin(x);
        c.unpin(y);
        c.check();
    }

    #[test]
    fn resident_keys_are_the_ready_slots() {
        let mut c = Cache::new(3 * 10, 10, Policy::Lru).unwrap();
        let Lookup::Reserved(a) = c.acquire((1, 4)) else { panic!() };
        let Lookup::Reserved(b) = c.acquire((0, 2)) else { panic!() };
        assert_eq!(c.resident_keys().count(), 0, "loading is not resident");
        c.loaded(a.slot());
        c.unpin(a);
        assert_eq!(c.resident_keys().collect::<Vec<_>>(), vec![(1, 4)]);
        c.failed(b.slot());
        c.unpin(b);
        assert_eq!(c.resident_keys().collect::<Vec<_>>(), vec![(1, 4)]);
    }

    #[test]
    fn lfu_keeps_the_popular_expert() {
        let mut c = Cache::new(2 * 10, 10, Policy::LfuAging).unwrap();
        let use_once = |c: &mut Cache, e| {
            let p = get(c, (0, e));
            c.unpin(p);
        };
        for _ in 0..5 {
            use_once(&mut c, 0);
        }
        use_once(&mut c, 1);
        use_once(&mut c, 2); // evicts 1 (used once), not 0 (used 5 times) though 0 is older
        assert!(c.slot_of((0, 0)).is_some());
        assert!(c.slot_of((0, 1)).is_none());
        c.check();
    }

    #[test]
    fn prefetch_accounting_and_failures() {
        let mut c = Cache::new(2 * 10, 10, Policy::Lru).unwrap();
        let s = c.reserve_prefetch((1, 3)).unwrap();
        assert_eq!(c.reserve_prefetch((1, 3)), None, "already on its way");
        assert_eq!(c.prefetched_unused_bytes(), 10);
        c.loaded(s);
        c.check();
        let Lookup::Ready(p) = c.acquire((1, 3)) else { panic!() };
        assert_eq!(p.slot(), s);
        assert_eq!(c.counters.prefetch_hits, 1);
        assert_eq!(c.prefetched_unused_bytes(), 0);
        c.unpin(p);
        // A failed read with no holder frees the slot and forgets the key at once.
        let Lookup::Reserved(f) = c.acquire((2, 0)) else { panic!() };
        c.unpin(f);
        c.check();
    }

    #[test]
    fn a_failure_keeps_the_slot_until_every_holder_has_let_go() {
        // Two holders wait on one read; it fails. Neither may lose its pin to the other,
        // and the slot must not be reused while either still holds it.
        let mut c = Cache::new(2 * 10, 10, Policy::Lru).unwrap();
        let Lookup::Reserved(first) = c.acquire((0, 1)) else { panic!() };
        let Lookup::Loading(second) = c.acquire((0, 1)) else { panic!() };
        let s = first.slot();
        c.failed(s);
        c.check();
        assert_eq!(c.state(s), SlotState::Failed);
        assert!(c.slot_of((0, 1)).is_none(), "the key is forgotten at once");
        // A new request reads again, into another slot; the failed one is not reused.
        let Lookup::Reserved(again) = c.acquire((0, 1)) else { panic!() };
        assert_ne!(again.slot(), s);
        assert_eq!(c.acquire((0, 2)), Lookup::Full, "the failed slot is still held");
        c.unpin(first);
        assert_eq!(c.state(s), SlotState::Failed);
        c.check();
        c.unpin(second);
        assert_eq!(c.state(s), SlotState::Free);
        c.check();
        c.loaded(again.slot());
        c.unpin(again);
        c.check();
    }

    #[test]
    fn shrinking_never_drops_a_pinned_slot() {
        let mut c = Cache::new(4 * 10, 10, Policy::Lru).unwrap();
        let pinned: Vec<Pin> = (0..4).map(|e| get(&mut c, (0, e))).collect();
        // Everything pinned: nothing can go.
        assert!(c.set_quota(20).is_empty());
        assert_eq!(c.capacity_slots(), 4);
        for p in pinned {
            c.unpin(p);
        }
        assert_eq!(c.set_quota(20).len(), 2);
        assert_eq!(c.capacity_slots(), 2);
        c.check();
        c.set_quota(30);
        assert_eq!(c.capacity_slots(), 3);
        c.check();
    }
}
