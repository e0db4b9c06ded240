//! Where a MoE layer's chosen experts are computed: those the VRAM tier holds on the GPU;
//! each missed one either copied over the bus and computed there, or computed by the CPU's
//! threads where it already sits, whichever finishes the layer sooner. The two sides run at
//! the same time, so misses are placed one by one, largest first, on the side whose finish
//! time they raise least. Costs come from rates measured as the run goes: the copy rate,
//! the CPU's rate on expert weights when memory-bound (few tokens an expert) and its
//! multiply-add rate when compute-bound (many).

/// Measured rates (starting from guesses until the first measurements come in).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    pub copy_bytes_per_s: f64,
    pub cpu_bytes_per_s: f64,
    pub cpu_macs_per_s: f64,
    /// The GPU on experts it holds (memory-bound decode on the device).
    pub gpu_bytes_per_s: f64,
}

impl Default for Rates {
    fn default() -> Self {
        Rates { copy_bytes_per_s: 10e9, cpu_bytes_per_s: 20e9, cpu_macs_per_s: 50e9, gpu_bytes_per_s: 1e12 }
    }
}

/// Weight of a new measurement in the running rates.
const EWMA: f64 = 0.25;

fn blend(old: f64, sample: f64) -> f64 {
    if sample.is_finite() && sample > 0.0 {
        old + EWMA * (sample - old)
    } else {
        old
    }
}

impl Rates {
    /// CPU time for an expert of `bytes` serving tokens that make `macs` multiply-adds.
    pub fn cpu_seconds(&self, bytes: usize, macs: usize) -> f64 {
        (bytes as f64 / self.cpu_bytes_per_s).max(macs as f64 / self.cpu_macs_per_s)
    }

    /// GPU time for a missed expert: its copy (its compute on the device is far shorter).
    pub fn copy_seconds(&self, bytes: usize) -> f64 {
        bytes as f64 / self.copy_bytes_per_s
    }

    pub fn gpu_seconds(&self, bytes: usize) -> f64 {
        bytes as f64 / self.gpu_bytes_per_s
    }

    /// A copy of `bytes` that took `ns`.
    pub fn observe_copy(&mut self, bytes: u64, ns: u64) {
        if bytes > 0 && ns > 0 {
            self.copy_bytes_per_s = blend(self.copy_bytes_per_s, bytes as f64 / (ns as f64 * 1e-9));
        }
    }

    /// CPU work of `bytes` and `macs` that took `ns`, the most tokens an expert served being
    /// `max_tokens`: few tokens measure the memory-bound rate, many the multiply-add rate.
    pub fn observe_cpu(&mut self, bytes: usize, macs: usize, max_tokens: usize, ns: u64) {
        if ns == 0 {
            return;
        }
        let s = ns as f64 * 1e-9;
        if max_tokens <= 2 {
            self.cpu_bytes_per_s = blend(self.cpu_bytes_per_s, bytes as f64 / s);
        } else {
            self.cpu_macs_per_s = blend(self.cpu_macs_per_s, macs as f64 / s);
        }
    }
}

/// One chosen expert: its bytes, the multiply-adds of its tokens, and whether the GPU holds it.
#[derive(Clone, Copy, Debug)]
pub struct Chosen {
    pub bytes: usize,
    pub macs: usize,
    pub held: bool,
}

/// For each expert, true: the GPU computes it (copying it first unless held); false: the CPU.
pub fn assign(r: &Rates, experts: &[Chosen]) -> Vec<bool> {
    let mut on_gpu = vec![true; experts.len()];
    let mut gpu: f64 = experts.iter().filter(|e| e.held).map(|e| r.gpu_seconds(e.bytes)).sum();
    let mut cpu = 0f64;
    let mut misses: Vec<usize> = (0..experts.len()).filter(|&i| !experts[i].held).collect();
    misses.sort_by_key(|&i| (std::cmp::Reverse(experts[i].bytes), i));
    for i in misses {
        let e = experts[i];
        let g = gpu + r.copy_seconds(e.bytes) + r.gpu_seconds(e.bytes);
        let c = cpu + r.cpu_seconds(e.bytes, e.macs);
        if g.max(cpu) <= c.max(gpu) {
            gpu = g;
        } else {
            cpu = c;
            on_gpu[i] = false;
        }
    }
    on_gpu
}

/// Layers in a row whose misses all went to the GPU after which one is given to the CPU
/// anyway, to measure the CPU's rate again: a rate measured once too low (a cold first
/// sample, say) would otherwise keep every miss off the CPU for good, never to be corrected.
pub const EXPLORE_AFTER: u32 = 64;

/// The longest wait between two explorations, in layers with misses: at 48 MoE layers, one
/// every ~1400 tokens once the CPU has been found slower again and again.
pub const EXPLORE_AT_MOST_EVERY: u32 = EXPLORE_AFTER << 10;

/// When to give the CPU a miss that `assign` would not: after `EXPLORE_AFTER` layers in a
/// row whose misses all went to the GPU, then, each time that happens again without any layer
/// choosing the CPU by itself in between, after twice as many (up to
/// `EXPLORE_AT_MOST_EVERY`). A CPU that really is slower is thus measured again ever more
/// rarely, so exploring costs little over a run (about log2 of its layers, not one miss in
/// every 64 layers); a layer that chooses the CPU by itself (the rates say it is worth it)
/// starts the waits from `EXPLORE_AFTER` again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Explorer {
    /// Layers with misses since the last one that gave the CPU a miss.
    since: u32,
    /// How many such layers the next exploration waits for.
    wait: u32,
}

impl Default for Explorer {
    fn default() -> Self {
        Explorer { since: 0, wait: EXPLORE_AFTER }
    }
}

impl Explorer {
    /// `assign`, giving one miss to the CPU when the wait is over: the miss the CPU would
    /// finish soonest. Where an expert is computed never changes its bits, only the time.
    pub fn assign(&mut self, r: &Rates, experts: &[Chosen]) -> Vec<bool> {
        let mut on_gpu = assign(r, experts);
        let misses = || (0..experts.len()).filter(|&i| !experts[i].held);
        if misses().next().is_none() {
            return on_gpu;
        }
        if misses().any(|i| !on_gpu[i]) {
            *self = Explorer::default();
            return on_gpu;
        }
        self.since += 1;
        if self.since >= self.wait {
            let cheapest = misses().min_by(|&a, &b| {
                let (ea, eb) = (experts[a], experts[b]);
                r.cpu_seconds(ea.bytes, ea.macs).total_cmp(&r.cpu_seconds(eb.bytes, eb.macs))
            });
            if let Some(i) = cheapest {
                on_gpu[i] = false;
            }
            self.since = 0;
            self.wait = self.wait.saturating_mul(2).min(EXPLORE_AT_MOST_EVERY);
        }
        on_gpu
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB4: usize = 4 << 20;

    /// Layers the next exploration still waits for.
    fn layers_to_next(x: &Explorer) -> u32 {
        x.wait - x.since
    }

    fn rates(copy: f64, cpu: f64) -> Rates {
        Rates { copy_bytes_per_s: copy, cpu_bytes_per_s: cpu, cpu_macs_per_s: 50e9, gpu_bytes_per_s: 1e12 }
    }

    #[test]
    fn held_experts_stay_on_the_gpu() {
        let e = [Chosen { bytes: MB4, macs: MB4, held: true }; 8];
        assert_eq!(assign(&rates(1e9, 100e9), &e), vec![true; 8]);
    }

    #[test]
    fn decode_misses_are_shared_so_both_sides_finish_together() {
        // One token: copying 4 MB at 48 GB/s (87 µs) against the CPU's 20 GB/s (210 µs): of
        // seven misses the GPU takes five and the CPU two, where either alone takes longer.
        let r = rates(48e9, 20e9);
        let e = [Chosen { bytes: MB4, macs: MB4 * 2, held: false }; 7];
        let a = assign(&r, &e);
        let on_gpu = a.iter().filter(|&&g| g).count();
        assert!((4..=6).contains(&on_gpu), "{a:?}");
        let finish = |k: usize| {
            let gpu = k as f64 * (r.copy_seconds(MB4) + r.gpu_seconds(MB4));
            let cpu = (7 - k) as f64 * r.cpu_seconds(MB4, MB4 * 2);
            gpu.max(cpu)
        };
        assert!(finish(on_gpu) < finish(7) && finish(on_gpu) < finish(0));
    }

    #[test]
    fn a_slow_bus_leaves_decode_misses_to_the_cpu_and_prefill_to_the_gpu() {
        let r = rates(5e9, 40e9);
        let decode = [Chosen { bytes: MB4, macs: MB4 * 2, held: false }; 4];
        assert!(assign(&r, &decode).iter().filter(|&&g| g).count() <= 1);
        // 512 tokens an expert: the CPU's multiply-adds dominate.
        let prefill = [Chosen { bytes: MB4, macs: MB4 * 2 * 512, held: false }; 4];
        assert_eq!(assign(&r, &prefill), vec![true; 4]);
    }

    #[test]
    fn a_cpu_rate_measured_too_low_is_measured_again_ever_more_rarely() {
        // The CPU looks 100 times slower than the bus: every miss goes to the GPU, until
        // EXPLORE_AFTER such layers have passed; then the cheapest one goes to the CPU once.
        let r = rates(50e9, 0.5e9);
        let mut e = [Chosen { bytes: MB4, macs: MB4, held: false }; 4];
        e[2].bytes = MB4 / 2;
        e[0].held = true;
        let mut x = Explorer::default();
        for _ in 1..EXPLORE_AFTER {
            assert_eq!(x.assign(&r, &e), vec![true; 4]);
        }
        assert_eq!(x.assign(&r, &e), vec![true, true, false, true]);
        // The CPU was slow again (the rates did not change): the next wait is twice as long.
        assert_eq!(layers_to_next(&x), 2 * EXPLORE_AFTER);
        for _ in 1..2 * EXPLORE_AFTER {
            assert_eq!(x.assign(&r, &e), vec![true; 4]);
        }
        assert_eq!(x.assign(&r, &e), vec![true, true, false, true]);
        assert_eq!(layers_to_next(&x), 4 * EXPLORE_AFTER);
        // Layers without misses neither count nor explore.
        let held = [Chosen { bytes: MB4, macs: MB4, held: true }; 4];
        for _ in 0..8 * EXPLORE_AFTER {
            assert_eq!(x.assign(&r, &held), vec![true; 4]);
        }
        assert_eq!(layers_to_next(&x), 4 * EXPLORE_AFTER);
        // 2000 tokens of 48 such layers explore 10 times (waits of 64, 128, ... 32768 layers),
        // where a fixed wait of 64 explored 1500 times; later the wait stops at its bound.
        let mut x = Explorer::default();
        let explored = (0..48 * 2000).filter(|_| x.assign(&r, &e).contains(&false)).count();
        assert_eq!(explored, 10);
        for _ in 0..4 * EXPLORE_AT_MOST_EVERY {
            x.assign(&r, &e);
        }
        assert_eq!(x.wait, EXPLORE_AT_MOST_EVERY);
        // A layer that gives the CPU a miss by itself starts the waits from the beginning.
        let fair = rates(5e9, 40e9);
        assert!(x.assign(&fair, &e).contains(&false));
        assert_eq!(x, Explorer::default());
    }

    #[test]
    fn measurements_move_the_rates_and_bad_ones_are_ignored() {
        let mut r = Rates::default();
        r.observe_copy(48_000_000, 1_000_000); // 48 GB/s
        assert!(r.copy_bytes_per_s > Rates::default().copy_bytes_per_s);
        let before = r;
        r.observe_copy(0, 10);
        r.observe_cpu(1, 1, 1, 0);
        assert_eq!(r, before);
        r.observe_cpu(MB4, MB4 * 512, 512, 1_000_000);
        assert!(r.cpu_macs_per_s != before.cpu_macs_per_s && r.cpu_bytes_per_s == before.cpu_bytes_per_s);
    }
}
