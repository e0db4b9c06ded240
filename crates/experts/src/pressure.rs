//! Memory-pressure feedback: watches Linux PSI (`/proc/pressure/memory`) and shrinks the
//! expert cache when the system starts stalling on memory, then grows it back slowly once
//! the pressure has cleared. Every change is logged and counted in the source's stats.

use crate::source::StreamingExperts;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct PressureConfig {
    pub interval: Duration,
    /// `some avg10` (percent of time stalled) above which the cache shrinks.
    pub high: f64,
    /// Below which it may grow again, after `calm` of quiet.
    pub low: f64,
    pub calm: Duration,
    /// Fraction of the quota given up per step, and regained per step.
    pub shrink: f64,
    pub grow: f64,
    /// The quota never goes below this.
    pub floor: usize,
}

impl Default for PressureConfig {
    fn default() -> Self {
        PressureConfig {
            interval: Duration::from_secs(1),
            high: 10.0,
            low: 1.0,
            calm: Duration::from_secs(30),
            shrink: 0.125,
            grow: 0.0625,
            floor: 0,
        }
    }
}

/// `some avg10` of a PSI file's text.
pub fn some_avg10(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    let field = line.split_whitespace().find_map(|f| f.strip_prefix("avg10="))?;
    field.parse().ok()
}

pub struct PressureMonitor {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl PressureMonitor {
    /// Starts watching, or returns None where PSI is not available.
    pub fn spawn(src: Weak<StreamingExperts>, cfg: PressureConfig) -> Option<PressureMonitor> {
        let path = "/proc/pressure/memory";
        std::fs::read_to_string(path).ok().and_then(|t| some_avg10(&t))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name("sluice-psi".into())
            .spawn(move || {
                let mut calm_since = Instant::now();
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(cfg.interval);
                    let Some(src) = src.upgrade() else { return };
                    let Some(p) = std::fs::read_to_string(path).ok().and_then(|t| some_avg10(&t)) else { continue };
                    let q = src.quota();
                    let floor = cfg.floor.max(src.slot_bytes());
                    if p > cfg.high && q > floor {
                        let target = ((q as f64 * (1.0 - cfg.shrink)) as usize).max(floor);
                        let new = src.set_quota(target, &format!("memory pressure {p:.1}%"));
                        if new != q {
                            eprintln!(
                                "sluice: memory pressure (PSI some avg10 {p:.1}%): expert cache {} -> {}",
                                fmt(q),
                                fmt(new)
                            );
                        }
                        calm_since = Instant::now();
                    } else if p < cfg.low && calm_since.elapsed() >= cfg.calm && q < src.max_quota() {
                        let target = ((q as f64 * (1.0 + cfg.grow)) as usize).min(src.max_quota());
                        let new = src.set_quota(target, "pressure cleared");
                        if new != q {
                            eprintln!("sluice: memory pressure cleared: expert cache {} -> {}", fmt(q), fmt(new));
                        }
                        calm_since = Instant::now();
                    } else if p >= cfg.low {
                        calm_since = Instant::now();
                    }
                }
            })
            .ok()?;
        Some(PressureMonitor { stop, handle: Some(handle) })
    }
}

fn fmt(b: usize) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

impl Drop for PressureMonitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_psi() {
        let t = "some avg10=12.50 avg60=3.00 avg300=1.00 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(some_avg10(t), Some(12.5));
        assert_eq!(some_avg10("garbage"), None);
    }
}
