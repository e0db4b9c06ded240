//! The persistent decode thread pool.
//!
//! Decode runs hundreds of small parallel ops per token; creating threads or going through a
//! general fork-join scheduler for each would cost more than the op. The pool keeps its workers
//! alive, wakes them by bumping an epoch they spin on (then sleep on a condvar when idle for a
//! while), and the calling thread takes part as worker 0.
//!
//! Invariant: `run` returns only after every worker has finished the job, so the job may borrow
//! from the caller's stack. Jobs must split work by *output* (rows), never by reduction, so
//! results do not depend on the number of threads.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = dyn Fn(usize) + Sync;

struct Shared {
    n_threads: usize,
    /// Bumped once per job; workers run the job when they see a new value.
    epoch: AtomicUsize,
    /// Workers (excluding the caller) still running the current job.
    pending: AtomicUsize,
    /// Type-erased pointer to the current job; valid while `pending > 0`.
    job: UnsafeCell<Option<*const Job>>,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread inside `run` while no worker reads it (all workers
// are idle: `pending == 0`), and read by workers only between the epoch bump and their decrement
// of `pending`, during which `run` keeps the pointee alive and does not write.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes callers: one job at a time.
    busy: Mutex<()>,
}

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

impl ThreadPool {
    /// A pool of `n_threads` threads, the calling thread included (so `n_threads - 1` workers).
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            n_threads,
            epoch: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..n_threads)
            .map(|idx| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("sluice-worker-{idx}"))
                    .spawn(move || worker_loop(&shared, idx))
                    .expect("spawning a worker thread")
            })
            .collect();
        ThreadPool { shared, workers, busy: Mutex::new(()) }
    }

    /// The one-thread pool (no workers: a job runs on the caller), shared by the places that
    /// call kernels from inside another pool's job, instead of each setting up its own.
    pub fn serial() -> &'static ThreadPool {
        static SERIAL: std::sync::OnceLock<ThreadPool> = std::sync::OnceLock::new();
        SERIAL.get_or_init(|| ThreadPool::new(1))
    }

    /// Threads that run a job, the caller included.
    pub fn n_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Runs `f(thread_index)` once on every thread of the pool and waits for all of them.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        if s.n_threads == 1 {
            f(0);
            return;
        }
        let _guard = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: erase the borrow's lifetime; we wait below until no worker uses the pointer.
        let ptr: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f) };
        // SAFETY: no worker reads `job` now: the previous job finished (`pending == 0`).
        unsafe { *s.job.get() = Some(ptr) };
        s.pending.store(s.n_threads - 1, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 1 << 16 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a thread-pool worker panicked");
        }
    }

    /// Splits `0..n` into one contiguous range per thread (in multiples of `align`) and runs
    /// `f(range)` for each non-empty range.
    pub fn for_ranges(&self, n: usize, align: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let t = self.n_threads();
        if t == 1 || n <= align {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        let align = align.max(1);
        let units = n.div_ceil(align);
        let per = units.div_ceil(t);
        self.run(&|i| {
            let start = (i * per * align).min(n);
            let end = ((i + 1) * per * align).min(n);
            if start < end {
                f(start..end);
            }
        });
    }
}

fn worker_loop(s: &Shared, idx: usize) {
    let mut seen = 0usize;
    loop {
        // Wait for a new epoch: spin a little (reading the clock only now and then), then sleep.
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(256) || started.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            let mut l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                l = s.wake.wait(l).unwrap_or_else(|e| e.into_inner());
            }
            drop(l);
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        // SAFETY: see `Shared`: the pointer is valid until we decrement `pending`.
        let job = unsafe { (*s.job.get()).expect("job set before epoch bump") };
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(idx) }));
        if r.is_err() {
            s.panicked.store(true, Ordering::SeqCst);
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Cores this process may use (falls back to 1).
pub fn available_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_thread_runs_each_job_once() {
        let pool = ThreadPool::new(3);
        for round in 0..200u64 {
            let sum = AtomicU64::new(0);
            pool.run(&|i| {
                sum.fetch_add(i as u64 + 1 + round, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 6 + 3 * round);
        }
        // After a sleep the workers must wake again.
        std::thread::sleep(Duration::from_millis(5));
        let sum = AtomicU64::new(0);
        pool.run(&|i| {
            sum.fetch_add(i as u64, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn ranges_cover_everything_once() {
        let pool = ThreadPool::new(2);
        for n in [0usize, 1, 7, 16, 17, 100, 1000] {
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.for_ranges(n, 8, &|r| {
                for i in r {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
        }
    }

    #[test]
    fn worker_panic_reaches_caller() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|i| {
                if i == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        let sum = AtomicU64::new(0);
        pool.run(&|i| {
            sum.fetch_add(i as u64 + 1, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 3);
    }
}
