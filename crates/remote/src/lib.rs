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
