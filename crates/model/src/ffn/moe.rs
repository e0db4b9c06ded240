//! The routed mixture of experts: the router picks each token's experts (ffn/router.rs), the
//! expert source delivers them (resident or streamed), outputs are combined in rank order;
//! plus optional shared experts, behind a sigmoid gate (Qwen) or added as they are (DeepSeek,
//! GLM); and, for gpt-oss, a router bias and per-expert biases.

use crate::config::{Gating, ModelConfig};
use crate::error::{ModelError, Result};
use crate::expert::ExpertSource;
use crate::ffn::router::route;
use crate::ffn::{gated_ffn, DenseFfnWeights, FfnWeights};
use crate::model::{observe, Model};
use crate::trace::Observer;
use crate::weights::{vector, Key, TensorSource, Weight};
use sluice_kernels::{matmul, ops};

pub struct SharedExpert {
    pub ffn: DenseFfnWeights,
    /// (1, hidden): sigmoid gate on the shared expert's output, where it has one.
    pub gate_inp: Option<Weight>,
}

/// Every expert's biases (gpt-oss): gate and up (n_expert, ff), down (n_expert, hidden).
pub struct ExpertBiases {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

pub struct MoeWeights {
    /// (n_expert, hidden)
    pub router: Weight,
    /// (n_expert): added to the router logits (gpt-oss).
    pub router_bias: Option<Vec<f32>>,
    /// (n_expert): added to the scores for choosing experts only (DeepSeek-V3 and kin).
    pub correction: Option<Vec<f32>>,
    pub shared: Option<SharedExpert>,
    pub biases: Option<ExpertBiases>,
}

impl MoeWeights {
    pub fn load(src: &dyn TensorSource, cfg: &ModelConfig, l: usize) -> Result<MoeWeights> {
        let h = cfg.hidden;
        let mat = |key, rows, cols| Weight::from_tensor(src.require(key, Some(l))?, rows, cols);
        let moe = cfg.moe.as_ref().ok_or_else(|| ModelError::Invalid("sparse layer without MoE config".into()))?;
        let ne = moe.n_expert;
        let shared = match moe.shared_expert_ff {
            None => None,
            Some(sf) => Some(SharedExpert {
                ffn: DenseFfnWeights {
                    gate: mat(Key::ShexpGate, sf, h)?,
                    up: mat(Key::ShexpUp, sf, h)?,
                    down: mat(Key::ShexpDown, h, sf)?,
                },
                gate_inp: if moe.shared_gated { Some(mat(Key::ShexpGateInp, 1, h)?) } else { None },
            }),
        };
        let correction = match moe.gating {
            Gating::Grouped { selection_bias: true, .. } => Some(vector(src.require(Key::FfnExpProbsB, Some(l))?, ne)?),
            _ => None,
        };
        let router_bias =
            if moe.router_bias { Some(vector(src.require(Key::FfnGateInpBias, Some(l))?, ne)?) } else { None };
        let biases = if moe.expert_bias { Some(expert_biases(src, cfg, l)?) } else { None };
        Ok(MoeWeights { router: mat(Key::FfnGateInp, ne, h)?, router_bias, correction, shared, biases })
    }

    /// Bytes of the resident part: router and shared expert.
    pub fn dense_bytes(&self) -> usize {
        self.router.bytes()
            + self.shared.as_ref().map_or(0, |s| s.ffn.bytes() + s.gate_inp.as_ref().map_or(0, |g| g.bytes()))
            + self.biases.as_ref().map_or(0, |b| 4 * (b.gate.len() + b.up.len() + b.down.len()))
    }
}

/// The experts' biases, from either dialect: GGUF keeps gate, up and down apart; HF gpt-oss
/// keeps gate and up interleaved (gate in even columns, up in odd) in one tensor.
fn expert_biases(src: &dyn TensorSource, cfg: &ModelConfig, l: usize) -> Result<ExpertBiases> {
    let moe = cfg.moe.as_ref().expect("an MoE layer");
    let (ne, ff, h) = (moe.n_expert, moe.expert_ff, cfg.hidden);
    let gate_t = src.require(Key::FfnGateExpsBias, Some(l))?;
    let up_t = src.require(Key::FfnUpExpsBias, Some(l))?;
    let (gate, up) = if gate_t.name == up_t.name {
        let gu = vector(gate_t, ne * 2 * ff)?;
        let mut gate = vec![0f32; ne * ff];
        let mut up = vec![0f32; ne * ff];
        for i in 0..ne * ff {
            gate[i] = gu[2 * i];
            up[i] = gu[2 * i + 1];
        }
        (gate, up)
    } else {
        (vector(gate_t, ne * ff)?, vector(up_t, ne * ff)?)
    };
    let down = vector(src.require(Key::FfnDownExpsBias, Some(l))?, ne * h)?;
    Ok(ExpertBiases { gate, up, down })
}

/// Expert `e`'s biases (gate, up, down) where the layer has them, for `ff` intermediate and `hd`
/// hidden values.
fn expert_bias(w: &MoeWeights, e: usize, ff: usize, hd: usize) -> Option<ExpertBias<'_>> {
    w.biases
        .as_ref()
        .map(|b| (&b.gate[e * ff..(e + 1) * ff], &b.up[e * ff..(e + 1) * ff], &b.down[e * hd..(e + 1) * hd]))
}

/// One expert's biases: gate, up, down.
type ExpertBias<'a> = (&'a [f32], &'a [f32], &'a [f32]);

/// One expert (or the shared one) on `n` rows of `x`: down(act(gate·x + b_g) ⊙ (up·x + b_u)) + b_d.
#[allow(clippy::too_many_arguments)]
fn expert_ffn(
    pool: &sluice_kernels::ThreadPool,
    act: crate::config::Activation,
    ew: &crate::expert::ExpertWeights<'_>,
    bias: Option<ExpertBias<'_>>,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let Some((bg, bu, bd)) = bias else {
        return gated_ffn(pool, act, ew.gate, ew.up, ew.down, x, n, out);
    };
    let ff = ew.gate.rows;
    let mut g = vec![0f32; n * ff];
    let mut u = vec![0f32; n * ff];
    matmul(pool, ew.gate, x, n, &mut g);
    matmul(pool, ew.up, x, n, &mut u);
    for (gr, ur) in g.chunks_exact_mut(ff).zip(u.chunks_exact_mut(ff)) {
        ops::add_inplace(gr, bg);
        ops::add_inplace(ur, bu);
    }
    crate::ffn::combine(act, &mut g, &u);
    matmul(pool, ew.down, &g, n, out);
    for r in out.chunks_exact_mut(bd.len()) {
        ops::add_inplace(r, bd);
    }
}

/// The routed mixture of experts for `n` tokens of layer `l`.
///
/// 1. the router scores every expert for every token and keeps the top k;
/// 2. the expert source delivers each chosen expert as it becomes resident, and each expert
///    runs on the tokens that chose it (its output per (token, rank) is kept apart);
/// 3. each token's outputs are summed in rank order, so the result never depends on which
///    expert arrived first or which tokens shared a batch.
#[allow(clippy::too_many_arguments)]
pub fn moe_ffn(
    m: &Model,
    experts: &dyn ExpertSource,
    l: usize,
    w: &MoeWeights,
    x: &[f32],
    positions: &[usize],
    out: &mut [f32],
    obs: &mut Option<&mut dyn Observer>,
) -> Result<()> {
    let n = positions.len();
    let cfg = &m.cfg;
    let moe = cfg.moe.as_ref().expect("sparse layer of an MoE model");
    let (hd, ne, k) = (cfg.hidden, moe.n_expert, moe.n_expert_used);
    let pool = &*m.pool;

    let logits = router_logits(m, w, x, n);
    observe(obs, "ffn_moe_logits", Some(l), &logits, n);
    let mut chosen = vec![0u32; n * k]; // (n, k) expert ids in rank order
    let mut weights = vec![0f32; n * k]; // (n, k)
    let (mut ex, mut wt) = (Vec::with_capacity(k), Vec::with_capacity(k));
    let allowed = experts.route_mask(l);
    for t in 0..n {
        route(moe.gating, &logits[t * ne..(t + 1) * ne], w.correction.as_deref(), k, allowed, &mut ex, &mut wt);
        chosen[t * k..(t + 1) * k].copy_from_slice(&ex);
        weights[t * k..(t + 1) * k].copy_from_slice(&wt);
        if let Some(o) = obs.as_deref_mut() {
            o.routing(l, positions[t], &ex, &wt);
        }
    }

    // Which (token, rank) slots each expert serves; experts in ascending id order.
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); ne];
    for (slot, e) in chosen.iter().enumerate() {
        users[*e as usize].push(slot);
    }
    let wanted: Vec<u32> = (0..ne as u32).filter(|e| !users[*e as usize].is_empty()).collect();

    let mut y = vec![0f32; n * k * hd]; // (n·k, hidden) one output row per (token, rank)
    let mut fetch = experts.fetch(l, &wanted)?;
    if !fetch.missing().is_empty() {
        // A source that serves only what it holds (drafting): the chosen experts it left
        // out are hinted to it, and each token's weights go to the experts it has.
        let missing: Vec<u32> = fetch.missing().iter().map(|&i| wanted[i]).collect();
        experts.prefetch(l, &missing);
        reweigh_without(&chosen, &mut weights, k, &missing);
    }
    // This layer's misses are on their way; now ask for the next sparse layer's likely
    // experts, so their reads queue behind them and overlap this layer's compute: the next
    // router applied to this layer's input predicts them.
    prefetch_next(m, experts, l, x, n);
    let offload = m.expert_compute.as_ref().filter(|_| w.biases.is_none());
    if let Some(c) = offload {
        // Resident experts go to the device all at once; streamed ones one by one as they
        // arrive (holding every view until the last arrives could wait forever on a cache
        // smaller than the layer's experts).
        let at_once = fetch.all_resident();
        let mut views = Vec::with_capacity(wanted.len());
        let mut done = false;
        while !done {
            match fetch.next().transpose()? {
                Some(v) => views.push(v),
                None => done = true,
            }
            if views.is_empty() || (at_once && !done) {
                continue;
            }
            let ews: Vec<_> = views.iter().map(|(_, v)| v.weights()).collect();
            let ids: Vec<u32> = views.iter().map(|(i, _)| wanted[*i]).collect();
            let slots: Vec<&[usize]> = ids.iter().map(|&e| users[e as usize].as_slice()).collect();
            offload_experts(m, &**c, l, &ews, &ids, &slots, k, x, &mut y)?;
            drop(ews);
            views.clear();
        }
    } else if fetch.all_resident() {
        let mut views = Vec::with_capacity(wanted.len());
        while let Some(r) = fetch.next() {
            views.push(r?);
        }
        let ews: Vec<_> = views.iter().map(|(_, v)| v.weights()).collect();
        let biases: Vec<_> =
            views.iter().zip(&ews).map(|((i, _), ew)| expert_bias(w, wanted[*i] as usize, ew.gate.rows, hd)).collect();
        if n == 1 {
            let slots: Vec<usize> = views.iter().map(|(i, _)| users[wanted[*i] as usize][0]).collect();
            decode_by_matrices(pool, cfg.activation, &ews, &biases, &slots, x, &mut y);
        } else {
            let slots: Vec<&[usize]> = views.iter().map(|(i, _)| users[wanted[*i] as usize].as_slice()).collect();
            batch_by_experts(pool, cfg.activation, &ews, &biases, &slots, k, x, &mut y);
        }
    } else {
        let mut xe = Vec::new();
        let mut ye = Vec::new();
        while let Some(r) = fetch.next() {
            let (i, view) = r?;
            let slots = &users[wanted[i] as usize];
            let ew = view.weights();
            gather_rows(x, hd, slots, k, &mut xe);
            ye.resize(slots.len() * hd, 0.0);
            let bias = expert_bias(w, wanted[i] as usize, ew.gate.rows, hd);
            expert_ffn(pool, cfg.activation, &ew, bias, &xe, slots.len(), &mut ye);
            for (j, s) in slots.iter().enumerate() {
                y[s * hd..(s + 1) * hd].copy_from_slice(&ye[j * hd..(j + 1) * hd]);
            }
        }
    }
    drop(fetch);

    out.fill(0.0);
    for t in 0..n {
        let o = &mut out[t * hd..(t + 1) * hd];
        for r in 0..k {
            let s = t * k + r;
            ops::axpy(o, weights[s], &y[s * hd..(s + 1) * hd]);
        }
    }
    if let Some(sh) = &w.shared {
        let mut ys = vec![0f32; n * hd];
        m.gated_ffn(&sh.ffn.gate, &sh.ffn.up, &sh.ffn.down, x, n, &mut ys);
        match &sh.gate_inp {
            Some(gate) => {
                let mut g = vec![0f32; n];
                matmul(pool, gate.mat(), x, n, &mut g);
                for t in 0..n {
                    ops::axpy(&mut out[t * hd..(t + 1) * hd], ops::sigmoid(g[t]), &ys[t * hd..(t + 1) * hd]);
                }
            }
            None => ops::add_inplace(out, &ys),
        }
    }
    Ok(())
}

/// Experts `ids` (weights `ews`, serving `slots`) of layer `l`, split as `c` assigns them:
/// its share on its own thread, the rest on the pool's threads meanwhile. Each share writes
/// only its slots' rows, with the bits the CPU gives, so the split never changes `y`.
#[allow(clippy::too_many_arguments)]
fn offload_experts(
    m: &Model,
    c: &dyn crate::ffn::offload::ExpertCompute,
    l: usize,
    ews: &[crate::expert::ExpertWeights<'_>],
    ids: &[u32],
    slots: &[&[usize]],
    k: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<()> {
    use crate::ffn::offload::{CpuWork, ExpertBatch};
    let act = m.cfg.activation;
    let all = ExpertBatch { layer: l, activation: act, ids, weights: ews, slots, k, x };
    let to_device = c.assign(&all);
    let pick =
        |dev: bool| -> Vec<usize> { (0..ids.len()).filter(|&i| (to_device.get(i) == Some(&true)) == dev).collect() };
    let (dev, cpu) = (pick(true), pick(false));
    let sub = |idx: &[usize]| {
        (
            idx.iter().map(|&i| ews[i]).collect::<Vec<_>>(),
            idx.iter().map(|&i| ids[i]).collect::<Vec<_>>(),
            idx.iter().map(|&i| slots[i]).collect::<Vec<_>>(),
        )
    };
    let (dev_w, dev_ids, dev_slots) = sub(&dev);
    let (cpu_w, _, cpu_slots) = sub(&cpu);
    let device_batch =
        ExpertBatch { layer: l, activation: act, ids: &dev_ids, weights: &dev_w, slots: &dev_slots, k, x };
    let on_cpu = |y: &mut [f32]| {
        let t0 = std::time::Instant::now();
        batch_by_experts(&m.pool, act, &cpu_w, &vec![None; cpu_w.len()], &cpu_slots, k, x, y);
        t0.elapsed().as_nanos() as u64
    };
    // The device's rows land in a buffer of their own when the CPU writes `y` meanwhile.
    let mut y_dev = Vec::new();
    let (taken, cpu_ns) = if cpu.is_empty() {
        (c.compute(&device_batch, y), 0)
    } else if dev.is_empty() {
        (Ok(true), on_cpu(y))
    } else {
        y_dev.resize(y.len(), 0.0);
        std::thread::scope(|s| {
            let out = &mut y_dev;
            let device = s.spawn(|| c.compute(&device_batch, out));
            let ns = on_cpu(y);
            (device.join().unwrap_or_else(|p| std::panic::resume_unwind(p)), ns)
        })
    };
    if !cpu.is_empty() {
        let bytes = cpu_w.iter().map(|w| w.bytes()).sum();
        let macs = cpu_w.iter().zip(&cpu_slots).map(|(w, s)| w.elements() * s.len()).sum();
        let max_tokens = cpu_slots.iter().map(|s| s.len()).max().unwrap_or(0);
        c.observe_cpu(CpuWork { bytes, macs, experts: cpu.len(), max_tokens, ns: cpu_ns });
    }
    if !dev.is_empty() {
        if !taken? {
            batch_by_experts(&m.pool, act, &dev_w, &vec![None; dev_w.len()], &dev_slots, k, x, y);
        } else if !y_dev.is_empty() {
            let h = ews[0].down.rows;
            for s in dev_slots.iter().flat_map(|s| s.iter()) {
                y[s * h..(s + 1) * h].copy_from_slice(&y_dev[s * h..(s + 1) * h]);
            }
        }
    }
    Ok(())
}

/// Drops the experts `missing` (sorted) from each token's choice (`chosen`, `weights`: n × k):
/// their weights become zero and the others are scaled so that the token's weights keep their
/// sum (a token left with none contributes nothing).
fn reweigh_without(chosen: &[u32], weights: &mut [f32], k: usize, missing: &[u32]) {
    for (c, w) in chosen.chunks_exact(k).zip(weights.chunks_exact_mut(k)) {
        let all: f32 = w.iter().sum();
        let mut kept = 0f32;
        for (e, wi) in c.iter().zip(w.iter_mut()) {
            if missing.binary_search(e).is_ok() {
                *wi = 0.0;
            } else {
                kept += *wi;
            }
        }
        let scale = if kept != 0.0 { all / kept } else { 0.0 };
        w.iter_mut().for_each(|wi| *wi *= scale);
    }
}

/// Into `xe`, in order, the rows of `x` (`hd` wide) of the tokens behind (token, rank) slots
/// `slots` (slot s is token s / k).
fn gather_rows(x: &[f32], hd: usize, slots: &[usize], k: usize, xe: &mut Vec<f32>) {
    xe.clear();
    for s in slots {
        let t = s / k;
        xe.extend_from_slice(&x[t * hd..(t + 1) * hd]);
    }
}

/// One token through experts that are all resident, scheduled by whole matrices: the pool's
/// threads share out every expert's gate and up in one dispatch, then every expert's combine
/// and down in a second, each thread running its matrices one after another on its own. An
/// expert matrix of a decode step is small (an OLMoE gate is 1.2 MB); split by rows between
/// threads, each of the three products per expert was its own dispatch, and each thread read
/// short pieces of many matrices. Every output row still comes from the same one-token kernel
/// over the same weights and activations, and the biases (gpt-oss's) are added where
/// `expert_ffn` adds them, so `y` gets the bits `expert_ffn` gives.
///
/// `ews[i]` (with biases `biases[i]`) serves the (token, rank) slot `slots[i]`; its output goes
/// to row `slots[i]` of `y`.
fn decode_by_matrices(
    pool: &sluice_kernels::ThreadPool,
    act: crate::config::Activation,
    ews: &[crate::expert::ExpertWeights<'_>],
    biases: &[Option<ExpertBias<'_>>],
    slots: &[usize],
    x: &[f32],
    y: &mut [f32],
) {
    use sluice_kernels::matmul::SendPtr;
    let hd = x.len();
    let ne = ews.len();
    let one = sluice_kernels::ThreadPool::serial();
    // gate and up outputs, expert i's at offsets[i]: gate then up, ff values each.
    let mut offsets = Vec::with_capacity(ne + 1);
    offsets.push(0);
    for ew in ews {
        offsets.push(offsets.last().copied().unwrap_or(0) + 2 * ew.gate.rows);
    }
    let mut gu = vec![0f32; offsets[ne]];
    let gp = SendPtr(gu.as_mut_ptr());
    let threads = pool.n_threads();
    // Phase 1: 2·ne products, job j = expert j/2's gate (even j) or up (odd j).
    pool.run(&|t| {
        for j in (t * 2 * ne / threads)..((t + 1) * 2 * ne / threads) {
            let (ew, up) = (&ews[j / 2], j % 2 == 1);
            let ff = ew.gate.rows;
            let start = offsets[j / 2] + if up { ff } else { 0 };
            // SAFETY: job j alone writes gu[start..start + ff]; the jobs' ranges are disjoint
            // and `gu` outlives the dispatch.
            let out = unsafe { std::slice::from_raw_parts_mut(gp.get().add(start), ff) };
            matmul(one, if up { ew.up } else { ew.gate }, x, 1, out);
            if let Some((bg, bu, _)) = biases[j / 2] {
                ops::add_inplace(out, if up { bu } else { bg });
            }
        }
    });
    // Phase 2: ne jobs, expert i's combine (its own gate and up) and down into slot i's row.
    let yp = SendPtr(y.as_mut_ptr());
    pool.run(&|t| {
        for i in (t * ne / threads)..((t + 1) * ne / threads) {
            let ff = ews[i].gate.rows;
            // SAFETY: only job i touches expert i's gate and up outputs, and row slots[i] of
            // `y` (a slot serves one expert); both buffers outlive the dispatch.
            let (g, u, out) = unsafe {
                (
                    std::slice::from_raw_parts_mut(gp.get().add(offsets[i]), ff),
                    std::slice::from_raw_parts(gp.get().add(offsets[i] + ff) as *const f32, ff),
                    std::slice::from_raw_parts_mut(yp.get().add(slots[i] * hd), hd),
                )
            };
            crate::ffn::combine(act, g, u);
            matmul(one, ews[i].down, g, 1, out);
            if let Some((_, _, bd)) = biases[i] {
                ops::add_inplace(out, bd);
            }
        }
    });
}

/// Several tokens through experts that are all resident, one expert a job in one dispatch:
/// each thread takes whole experts and does all of an expert's work itself — gathers the rows
/// of the tokens that chose it, runs gate and up (quantizing those rows for the kernels),
/// combines and runs down, with the expert's biases where it has them (`expert_ffn` on one
/// thread), and writes the rows of its (token,
/// rank) slots — so nothing runs on one thread while the others wait between an expert's
/// products. Experts are dealt out by token
/// count, largest first, each to the thread with the fewest tokens so far (deterministic, and
/// which thread runs an expert never changes a bit: every row comes from the same kernels over
/// the same rows as in `expert_ffn`).
///
/// `ews[i]` (with biases `biases[i]`) serves the (token, rank) slots `slots[i]` (slot s is
/// token s / k); its output row for slot s goes to row s of `y`.
#[allow(clippy::too_many_arguments)]
fn batch_by_experts(
    pool: &sluice_kernels::ThreadPool,
    act: crate::config::Activation,
    ews: &[crate::expert::ExpertWeights<'_>],
    biases: &[Option<ExpertBias<'_>>],
    slots: &[&[usize]],
    k: usize,
    x: &[f32],
    y: &mut [f32],
) {
    use sluice_kernels::matmul::SendPtr;
    let hd = ews.first().map_or(0, |e| e.down.rows);
    let threads = pool.n_threads();
    let mut order: Vec<usize> = (0..ews.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(slots[i].len()), i));
    let mut load = vec![0usize; threads];
    let mut owner = vec![0usize; ews.len()];
    for i in order {
        let t = (0..threads).min_by_key(|&t| (load[t], t)).unwrap_or(0);
        owner[i] = t;
        load[t] += slots[i].len();
    }
    let yp = SendPtr(y.as_mut_ptr());
    let one = sluice_kernels::ThreadPool::serial();
    pool.run(&|t| {
        let (mut xe, mut ye) = (Vec::new(), Vec::new());
        for (i, ew) in ews.iter().enumerate().filter(|(i, _)| owner[*i] == t) {
            let m = slots[i].len();
            gather_rows(x, hd, slots[i], k, &mut xe);
            ye.resize(m * hd, 0.0);
            expert_ffn(one, act, ew, biases[i], &xe, m, &mut ye);
            for (j, s) in slots[i].iter().enumerate() {
                // SAFETY: slot s belongs to expert i alone, and expert i to this thread alone;
                // `y` outlives the dispatch.
                let row = unsafe { std::slice::from_raw_parts_mut(yp.get().add(s * hd), hd) };
                row.copy_from_slice(&ye[j * hd..(j + 1) * hd]);
            }
        }
    });
}

/// The router's logits for `n` rows of `x` (with its bias, where it has one).
fn router_logits(m: &Model, w: &MoeWeights, x: &[f32], n: usize) -> Vec<f32> {
    let ne = w.router.rows;
    let mut logits = vec![0f32; n * ne]; // (n, n_expert)
    matmul(&m.pool, w.router.mat(), x, n, &mut logits);
    if let Some(b) = &w.router_bias {
        for r in logits.chunks_exact_mut(ne) {
            ops::add_inplace(r, b);
        }
    }
    logits
}

/// Predicts the experts of the next sparse layer after `l` from `x` (this layer's normed
/// FFN input) and hands them to the expert source as a prefetch hint.
fn prefetch_next(m: &Model, experts: &dyn ExpertSource, l: usize, x: &[f32], n: usize) {
    if l >= m.cfg.n_layer {
        return; // the multi-token-prediction layer: nothing follows it
    }
    let Some(next) = (l + 1..m.cfg.n_layer).find(|&j| m.cfg.is_sparse(j)) else { return };
    if !experts.wants_prefetch(next) {
        return;
    }
    let FfnWeights::Moe(w) = &m.layers[next].ffn else { return };
    let moe = m.cfg.moe.as_ref().expect("sparse layer of an MoE model");
    let ne = moe.n_expert;
    let logits = router_logits(m, w, x, n);
    let mut want = vec![false; ne];
    let (mut ex, mut wt) = (Vec::new(), Vec::new());
    let allowed = experts.route_mask(next);
    for t in 0..n {
        route(
            moe.gating,
            &logits[t * ne..(t + 1) * ne],
            w.correction.as_deref(),
            moe.n_expert_used,
            allowed,
            &mut ex,
            &mut wt,
        );
        for e in &ex {
            want[*e as usize] = true;
        }
    }
    let want_ids: Vec<u32> = (0..ne as u32).filter(|e| want[*e as usize]).collect();
    experts.prefetch(next, &want_ids);
}
