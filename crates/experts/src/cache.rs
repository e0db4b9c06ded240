//! The expert cache's bookkeeping: which expert sits in which slot, in what state, pinned by
//! how many users, and which slot to give up next. Pure logic, no IO: `source` drives it.
//!
//! Invariants (checked by `check` in tests):
//! * `slots.len() × slot_bytes ≤ quota` at all times: the byte quota is hard, alignment and
//!   slack included, because every slot has the same size;
//! * a key maps to at most one slot, and a slot holds at most one key;
//! * a pinned slot is never chosen for eviction, and a `Loading` slot is never handed to a
//!   reader before its data has fully arrived;
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
}

#[derive(Clone, Debug)]
pub struct Slot {
    pub key: Option<Key>,
    pub state: SlotState,
    pub pins: u32,
    /// Filled by a prefetch and not yet asked for.
    pub prefetched_unused: bool,
    prio: Option<(u64, u64)>,
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

/// What `lookup_or_reserve` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Resident; pinned for the caller.
    Ready(usize),
    /// Already being read; pinned for the caller.
    Loading(usize),
    /// Not resident; a slot was reserved and pinned, the caller must read into it.
    Reserved(usize),
    /// Not resident and every slot is pinned: try again after some unpin.
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
            slots: (0..n)
                .map(|_| Slot { key: None, state: SlotState::Free, pins: 0, prefetched_unused: false, prio: None })
                .collect(),
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
        let p = self.priority(key);
        self.slots[s].prio = Some(p);
        self.evictable.insert((p, s));
    }

    fn not_evictable(&mut self, s: usize) {
        if let Some(p) = self.slots[s].prio.take() {
            self.evictable.remove(&(p, s));
        }
    }

    /// Pins `key` if resident or loading; otherwise reserves a slot (evicting the policy's
    /// victim if needed) and pins it. `prefetch` marks a reservation made ahead of demand.
    pub fn lookup_or_reserve(&mut self, key: Key, prefetch: bool) -> Lookup {
        if let Some(&s) = self.map.get(&key) {
            if !prefetch {
                self.touch(key);
                if self.slots[s].prefetched_unused {
                    self.slots[s].prefetched_unused = false;
                    self.counters.prefetch_hits += 1;
                }
            }
            let slot = &mut self.slots[s];
            let was_ready = slot.state == SlotState::Ready;
            // A prefetch of something already resident or loading changes nothing.
            if prefetch {
                return if was_ready { Lookup::Ready(s) } else { Lookup::Loading(s) };
            }
            slot.pins += 1;
            self.not_evictable(s);
            return if was_ready {
                self.counters.hits += 1;
                Lookup::Ready(s)
            } else {
                // In flight (usually a prefetch): the read is already paid for.
                self.counters.hits += 1;
                Lookup::Loading(s)
            };
        }
        let s = match self.free.pop() {
            Some(s) => s,
            None => match self.evictable.iter().next().copied() {
                Some((_, victim)) => {
                    self.evict(victim);
                    self.free.pop().expect("evict frees the slot")
                }
                None => return Lookup::Full,
            },
        };
        if prefetch {
            self.counters.prefetch_issued += 1;
        } else {
            self.counters.misses += 1;
            self.touch(key);
        }
        let slot = &mut self.slots[s];
        slot.key = Some(key);
        slot.state = SlotState::Loading { prefetch };
        slot.pins = u32::from(!prefetch);
        slot.prefetched_unused = prefetch;
        self.map_insert(key, s);
        Lookup::Reserved(s)
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

    /// The reads of slot `s` failed: forget its key and free it (its users get the error).
    pub fn failed(&mut self, s: usize) {
        self.not_evictable(s);
        let slot = &mut self.slots[s];
        let key = slot.key.take();
        slot.state = SlotState::Free;
        slot.pins = 0;
        slot.prefetched_unused = false;
        if let Some(k) = key {
            self.map_remove(k);
        }
        self.free.push(s);
    }

    /// Releases one pin of slot `s`.
    pub fn unpin(&mut self, s: usize) {
        let slot = &mut self.slots[s];
        if slot.pins == 0 {
            return; // the slot failed and was freed while a user held it
        }
        slot.pins -= 1;
        if slot.pins == 0 && slot.state == SlotState::Ready {
            self.make_evictable(s);
        }
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
            if self.slots[s].pins > 0 || matches!(self.slots[s].state, SlotState::Loading { .. }) {
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
            self.slots.push(Slot { key: None, state: SlotState::Free, pins: 0, prefetched_unused: false, prio: None });
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

    #[test]
    fn quota_smaller_than_a_slot_is_refused() {
        assert!(Cache::new(100, 200, Policy::Lru).is_err());
        assert_eq!(Cache::new(450, 200, Policy::Lru).unwrap().capacity_slots(), 2);
    }

    #[test]
    fn lru_evicts_the_least_recent_and_never_a_pinned_slot() {
        let mut c = Cache::new(3 * 10, 10, Policy::Lru).unwrap();
        for e in 0..3 {
            let Lookup::Reserved(s) = c.lookup_or_reserve((0, e), false) else { panic!() };
            c.loaded(s);
            c.unpin(s);
            c.check();
        }
        // Touch expert 0 so expert 1 is the oldest.
        let Lookup::Ready(s0) = c.lookup_or_reserve((0, 0), false) else { panic!() };
        c.unpin(s0);
        let Lookup::Reserved(_) = c.lookup_or_reserve((0, 9), false) else { panic!() };
        assert!(c.slot_of((0, 1)).is_none(), "expert 1 should be evicted");
        assert!(c.slot_of((0, 0)).is_some() && c.slot_of((0, 2)).is_some());
        // Pin everything: a new key cannot get a slot.
        let Lookup::Ready(_) = c.lookup_or_reserve((0, 0), false) else { panic!() };
        let Lookup::Ready(_) = c.lookup_or_reserve((0, 2), false) else { panic!() };
        assert_eq!(c.lookup_or_reserve((0, 7), false), Lookup::Full);
        c.check();
        assert_eq!(c.counters.evictions, 1);
    }

    #[test]
    fn experts_held_per_layer_follow_reservations_evictions_and_failures() {
        let mut c = Cache::new(3 * 10, 10, Policy::Lru).unwrap();
        let Lookup::Reserved(a) = c.lookup_or_reserve((2, 0), false) else { panic!() };
        let Lookup::Reserved(b) = c.lookup_or_reserve((2, 1), true) else { panic!() };
        let Lookup::Reserved(d) = c.lookup_or_reserve((5, 0), false) else { panic!() };
        assert_eq!((c.held_in_layer(2), c.held_in_layer(5), c.held_in_layer(9)), (2, 1, 0));
        c.failed(b);
        assert_eq!(c.held_in_layer(2), 1);
        for s in [a, d] {
            c.loaded(s);
            c.unpin(s);
        }
        // A new layer-7 expert evicts the least recent one, layer 2's.
        let Lookup::Reserved(_) = c.lookup_or_reserve((7, 3), false) else { panic!() };
        let Lookup::Reserved(_) = c.lookup_or_reserve((7, 4), false) else { panic!() };
        assert_eq!((c.held_in_layer(2), c.held_in_layer(5), c.held_in_layer(7)), (0, 1, 2));
        c.check();
    }

    #[test]
    fn lfu_keeps_the_popular_expert() {
        let mut c = Cache::new(2 * 10, 10, Policy::LfuAging).unwrap();
        let get = |c: &mut Cache, e| match c.lookup_or_reserve((0, e), false) {
            Lookup::Reserved(s) => {
                c.loaded(s);
                c.unpin(s)
            }
            Lookup::Ready(s) => c.unpin(s),
            other => panic!("{other:?}"),
        };
        for _ in 0..5 {
            get(&mut c, 0);
        }
        get(&mut c, 1);
        get(&mut c, 2); // evicts 1 (used once), not 0 (used 5 times) though 0 is older
        assert!(c.slot_of((0, 0)).is_some());
        assert!(c.slot_of((0, 1)).is_none());
        c.check();
    }

    #[test]
    fn prefetch_accounting_and_failures() {
        let mut c = Cache::new(2 * 10, 10, Policy::Lru).unwrap();
        let Lookup::Reserved(s) = c.lookup_or_reserve((1, 3), true) else { panic!() };
        assert_eq!(c.prefetched_unused_bytes(), 10);
        c.loaded(s);
        c.check();
        let Lookup::Ready(s2) = c.lookup_or_reserve((1, 3), false) else { panic!() };
        assert_eq!(s, s2);
        assert_eq!(c.counters.prefetch_hits, 1);
        assert_eq!(c.prefetched_unused_bytes(), 0);
        c.unpin(s);
        // A failed read frees the slot and forgets the key.
        let Lookup::Reserved(f) = c.lookup_or_reserve((2, 0), false) else { panic!() };
        c.failed(f);
        assert!(c.slot_of((2, 0)).is_none());
        c.check();
    }

    #[test]
    fn shrinking_never_drops_a_pinned_slot() {
        let mut c = Cache::new(4 * 10, 10, Policy::Lru).unwrap();
        let mut pinned = Vec::new();
        for e in 0..4 {
            let Lookup::Reserved(s) = c.lookup_or_reserve((0, e), false) else { panic!() };
            c.loaded(s);
            pinned.push(s);
        }
        // Everything pinned: nothing can go.
        assert!(c.set_quota(20).is_empty());
        assert_eq!(c.capacity_slots(), 4);
        for s in pinned {
            c.unpin(s);
        }
        assert_eq!(c.set_quota(20).len(), 2);
        assert_eq!(c.capacity_slots(), 2);
        c.check();
        c.set_quota(30);
        assert_eq!(c.capacity_slots(), 3);
        c.check();
    }
}
