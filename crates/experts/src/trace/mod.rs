//! Routing traces and cache simulation.
//!
//! A trace records, in the order the model ran them, each layer's routing decision for each
//! token. Replayed through the cache's own eviction policies and through Belady's optimum
//! (evict the expert whose next use is furthest away), it tells how much of the best possible
//! hit rate a policy reaches at a given quota.
//!
//! File: `SLTRACE1`, then a JSON header line (`n_layer`, `n_expert`, `n_expert_used`,
//! `slot_bytes`, `expert_bytes`, model), then records: u16 layer, u32 position, u16 count,
//! `count` × u16 expert ids (little endian).

pub mod stats;

use crate::cache::{Cache, Lookup, Policy};
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::io::{Read, Write};
use std::path::Path;

const MAGIC: &[u8; 8] = b"SLTRACE1";

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct TraceHeader {
    pub model: String,
    pub n_layer: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Bytes of one cache slot (alignment included) and of one expert's weights.
    pub slot_bytes: u64,
    pub expert_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub layer: u16,
    pub pos: u32,
    pub experts: Vec<u16>,
}

/// Appends records to a trace file.
pub struct TraceWriter {
    out: std::io::BufWriter<std::fs::File>,
    pub records: u64,
}

impl TraceWriter {
    pub fn create(path: &Path, header: &TraceHeader) -> std::io::Result<TraceWriter> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        out.write_all(MAGIC)?;
        let mut h = serde_json::to_vec(header).map_err(std::io::Error::other)?;
        h.push(b'\n');
        out.write_all(&h)?;
        Ok(TraceWriter { out, records: 0 })
    }

    pub fn push(&mut self, layer: usize, pos: usize, experts: &[u32]) -> std::io::Result<()> {
        self.out.write_all(&(layer as u16).to_le_bytes())?;
        self.out.write_all(&(pos as u32).to_le_bytes())?;
        self.out.write_all(&(experts.len() as u16).to_le_bytes())?;
        for e in experts {
            self.out.write_all(&(*e as u16).to_le_bytes())?;
        }
        self.records += 1;
        Ok(())
    }

    pub fn finish(mut self) -> std::io::Result<u64> {
        self.out.flush()?;
        Ok(self.records)
    }
}

/// Reads a whole trace, checking it record by record.
pub fn read(path: &Path) -> Result<(TraceHeader, Vec<Record>), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let bad = |m: &str| format!("{}: {m}", path.display());
    if bytes.len() < 8 || &bytes[..8] != MAGIC {
        return Err(bad("not a sluice routing trace (bad magic)"));
    }
    let nl = bytes[8..].iter().position(|b| *b == b'\n').ok_or_else(|| bad("header line not terminated"))?;
    let header: TraceHeader =
        serde_json::from_slice(&bytes[8..8 + nl]).map_err(|e| bad(&format!("bad header: {e}")))?;
    let mut r = &bytes[8 + nl + 1..];
    let mut records = Vec::new();
    let u16_at = |r: &mut &[u8]| -> Result<u16, String> {
        let mut b = [0u8; 2];
        r.read_exact(&mut b).map_err(|_| bad("truncated record"))?;
        Ok(u16::from_le_bytes(b))
    };
    while !r.is_empty() {
        let layer = u16_at(&mut r)?;
        let mut p = [0u8; 4];
        r.read_exact(&mut p).map_err(|_| bad("truncated record"))?;
        let n = u16_at(&mut r)? as usize;
        let mut experts = Vec::with_capacity(n);
        for _ in 0..n {
            let e = u16_at(&mut r)?;
            if e as usize >= header.n_expert {
                return Err(bad(&format!("expert {e} out of range ({} experts)", header.n_expert)));
            }
            experts.push(e);
        }
        if layer as usize >= header.n_layer {
            return Err(bad(&format!("layer {layer} out of range ({} layers)", header.n_layer)));
        }
        records.push(Record { layer, pos: u32::from_le_bytes(p), experts });
    }
    Ok((header, records))
}

/// The cache requests a trace implies: consecutive records of one layer form one request
/// (one layer call over a chunk of tokens), holding the union of their experts in ascending
/// order, as the MoE block asks for them.
pub fn requests(records: &[Record]) -> Vec<(u16, Vec<u16>)> {
    let mut out: Vec<(u16, Vec<u16>)> = Vec::new();
    let mut last_pos: Option<u32> = None;
    for r in records {
        let same_call = matches!(out.last(), Some((l, _)) if *l == r.layer) && last_pos.is_some_and(|p| r.pos > p);
        if !same_call {
            out.push((r.layer, Vec::new()));
        }
        let set = &mut out.last_mut().expect("pushed").1;
        for e in &r.experts {
            if !set.contains(e) {
                set.push(*e);
            }
        }
        last_pos = Some(r.pos);
    }
    for (_, s) in &mut out {
        s.sort_unstable();
    }
    out
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct SimResult {
    pub policy: String,
    pub slots: usize,
    pub accesses: u64,
    pub hits: u64,
    pub hit_rate: f64,
}

/// Replays `reqs` through the cache with `policy` and `slots` slots.
pub fn simulate_policy(reqs: &[(u16, Vec<u16>)], policy: Policy, slots: usize) -> SimResult {
    let mut c = Cache::new(slots, 1, policy).expect("at least one slot");
    let (mut acc, mut hits) = (0u64, 0u64);
    for (layer, experts) in reqs {
        let mut pinned = Vec::new();
        for e in experts {
            acc += 1;
            let key = (*layer as u32, *e as u32);
            let s = loop {
                match c.acquire(key) {
                    Lookup::Ready(s) => {
                        hits += 1;
                        break s;
                    }
                    Lookup::Reserved(s) => {
                        c.loaded(s.slot());
                        break s;
                    }
                    Lookup::Loading(s) => break s,
                    // The request is larger than the cache: release what it holds (a wave).
                    Lookup::Full => {
                        for p in pinned.drain(..) {
                            c.unpin(p);
                        }
                    }
                }
            };
            pinned.push(s);
        }
        for p in pinned {
            c.unpin(p);
        }
    }
    SimResult { policy: policy.name().into(), slots, accesses: acc, hits, hit_rate: ratio(hits, acc) }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Belady's optimum: on a miss with the cache full, evict the resident expert (not needed by
/// the current request) whose next use is furthest in the future.
pub fn simulate_belady(reqs: &[(u16, Vec<u16>)], slots: usize) -> SimResult {
    let seq: Vec<(usize, (u16, u16))> =
        reqs.iter().enumerate().flat_map(|(i, (l, es))| es.iter().map(move |e| (i, (*l, *e)))).collect();
    let mut next_use = vec![usize::MAX; seq.len()];
    let mut last: HashMap<(u16, u16), usize> = HashMap::new();
    for i in (0..seq.len()).rev() {
        next_use[i] = last.get(&seq[i].1).copied().unwrap_or(usize::MAX);
        last.insert(seq[i].1, i);
    }
    let mut resident: HashMap<(u16, u16), usize> = HashMap::new(); // key → its next use
    let mut heap: BinaryHeap<(usize, (u16, u16))> = BinaryHeap::new();
    let (mut hits, mut cur_req, mut in_req): (u64, usize, HashSet<(u16, u16)>) = (0, usize::MAX, HashSet::new());
    for (i, (req, key)) in seq.iter().enumerate() {
        if *req != cur_req {
            cur_req = *req;
            in_req.clear();
        }
        if resident.contains_key(key) {
            hits += 1;
        } else if resident.len() >= slots {
            // Pop the furthest-next-use expert that is current and not part of this request.
            let mut held = Vec::new();
            while let Some((nu, k)) = heap.pop() {
                if resident.get(&k) != Some(&nu) {
                    continue; // stale entry
                }
                if in_req.contains(&k) && in_req.len() < slots {
                    held.push((nu, k));
                    continue;
                }
                resident.remove(&k);
                break;
            }
            heap.extend(held);
        }
        resident.insert(*key, next_use[i]);
        heap.push((next_use[i], *key));
        in_req.insert(*key);
    }
    let acc = seq.len() as u64;
    SimResult { policy: "belady".into(), slots, accesses: acc, hits, hit_rate: ratio(hits, acc) }
}

/// One quota's replay: each policy's result and Belady's, with the bytes each would read.
#[derive(Clone, Debug, serde::Serialize)]
pub struct QuotaRow {
    pub slots: usize,
    pub bytes: u64,
    /// The policies in `Policy::ALL` order, then Belady's optimum.
    pub results: Vec<SimResult>,
    /// Bytes read per token (misses × expert bytes ÷ tokens), in the same order.
    pub bytes_per_token: Vec<f64>,
}

/// Replays `reqs` at each slot count; `tokens` is the number of tokens the trace covers.
pub fn sweep(reqs: &[(u16, Vec<u16>)], h: &TraceHeader, slots: &[usize], tokens: usize) -> Vec<QuotaRow> {
    slots
        .iter()
        .map(|&s| {
            let mut results: Vec<SimResult> = Policy::ALL.iter().map(|p| simulate_policy(reqs, *p, s)).collect();
            results.push(simulate_belady(reqs, s));
            let bytes_per_token = results
                .iter()
                .map(|r| (r.accesses - r.hits) as f64 * h.expert_bytes as f64 / tokens.max(1) as f64)
                .collect();
            QuotaRow { slots: s, bytes: s as u64 * h.slot_bytes, results, bytes_per_token }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reqs(seq: &[&[u16]]) -> Vec<(u16, Vec<u16>)> {
        seq.iter().map(|s| (0u16, s.to_vec())).collect()
    }

    #[test]
    fn belady_beats_or_ties_every_policy_and_matches_hand_counts() {
        // Classic sequence, 3 slots: A B C D A B E A B C D E (one expert per request).
        let s: Vec<&[u16]> = vec![&[0], &[1], &[2], &[3], &[0], &[1], &[4], &[0], &[1], &[2], &[3], &[4]];
        let r = reqs(&s);
        let opt = simulate_belady(&r, 3);
        // Belady on this sequence with 3 frames: 7 misses, 5 hits.
        assert_eq!(opt.hits, 5);
        let lru = simulate_policy(&r, Policy::Lru, 3);
        // LRU: 10 misses, 2 hits.
        assert_eq!(lru.hits, 2);
        for p in Policy::ALL {
            assert!(simulate_policy(&r, p, 3).hits <= opt.hits);
        }
    }

    #[test]
    fn everything_fits_means_only_cold_misses() {
        let r = reqs(&[&[1, 2, 3], &[2, 3, 4], &[1, 4]]);
        for res in [simulate_policy(&r, Policy::Lru, 8), simulate_belady(&r, 8)] {
            assert_eq!(res.accesses, 8);
            assert_eq!(res.hits, 4);
        }
    }

    #[test]
    fn round_trips_and_groups_layer_calls() {
        let dir = sluice_formats::scratch_root().join(format!("sluice-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.trace");
        let h = TraceHeader {
            model: "m".into(),
            n_layer: 2,
            n_expert: 8,
            n_expert_used: 2,
            slot_bytes: 4096,
            expert_bytes: 4000,
        };
        let mut w = TraceWriter::create(&p, &h).unwrap();
        // A prefill of 2 tokens over 2 layers, then one decode step.
        w.push(0, 0, &[1, 2]).unwrap();
        w.push(0, 1, &[2, 3]).unwrap();
        w.push(1, 0, &[4, 5]).unwrap();
        w.push(1, 1, &[5, 6]).unwrap();
        w.push(0, 2, &[1, 7]).unwrap();
        w.push(1, 2, &[4, 4]).unwrap();
        assert_eq!(w.finish().unwrap(), 6);
        let (hh, recs) = read(&p).unwrap();
        assert_eq!(hh.n_expert, 8);
        assert_eq!(recs.len(), 6);
        let q = requests(&recs);
        assert_eq!(q, vec![(0, vec![1, 2, 3]), (1, vec![4, 5, 6]), (0, vec![1, 7]), (1, vec![4])]);
        std::fs::write(&p, b"nonsense").unwrap();
        assert!(read(&p).unwrap_err().contains("bad magic"));
    }
}
