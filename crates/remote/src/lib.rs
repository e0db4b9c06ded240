//! The remote tier: run a model straight from an HTTP(S) or S3 URL.
//!
//! * `http`: range reads with connection reuse, retries and checks against a file that
//!   changed underneath or a server that misbehaves.
//! * `s3`: `s3://bucket/key` on an S3-compatible endpoint, signed (SigV4).
//! * `mirror`: the header and dense weights fetched once into local stand-ins of the remote
//!   files, which the model opens as it would local files.
//! * `disk`: the local disk tier of verified expert records under a byte quota.
//! * `tiered`: the reader the expert cache's IO pool calls: disk tier, then remote.
//! * `fetch`: experts into the disk tier ahead of use, or a whole local copy.

pub mod disk;
pub mod fetch;
pub mod http;
pub mod mirror;
pub mod s3;
pub mod tiered;

pub use mirror::{is_remote, open, Mirror, RemoteOptions};
pub use tiered::{TierStats, TieredReader};

/// Runs `work` on every item on `threads` threads, each with a scratch buffer of its own;
/// the first error stops the rest and is returned.
pub(crate) fn each_parallel<T: Sync>(
    items: &[T],
    threads: usize,
    work: impl Fn(&T, &mut Vec<u8>) -> std::io::Result<()> + Sync,
) -> std::io::Result<()> {
    use std::sync::Mutex;
    let queue = Mutex::new(items.iter());
    let failed: Mutex<Option<std::io::Error>> = Mutex::new(None);
    std::thread::scope(|sc| {
        for _ in 0..threads.max(1) {
            sc.spawn(|| {
                let mut buf = Vec::new();
                loop {
                    if failed.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                        return;
                    }
                    let Some(item) = queue.lock().unwrap_or_else(|e| e.into_inner()).next() else { return };
                    if let Err(e) = work(item, &mut buf) {
                        failed.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                        return;
                    }
                }
            });
        }
    });
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
