//! `Blob`: a cheaply clonable byte range of a shared buffer (a mapped file or owned memory).

use std::ops::Deref;
use std::sync::Arc;

/// Anything that can back a blob: a memory map, an owned vector, an aligned slot.
pub trait Backing: Send + Sync {
    fn bytes(&self) -> &[u8];
}

impl Backing for memmap2::Mmap {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl Backing for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

#[derive(Clone)]
pub struct Blob {
    backing: Arc<dyn Backing>,
    start: usize,
    len: usize,
}

impl Blob {
    /// The range `start..start + len` of `backing`; panics if it is out of range (callers check
    /// ranges against file sizes first and report errors there).
    pub fn new(backing: Arc<dyn Backing>, start: usize, len: usize) -> Blob {
        assert!(start + len <= backing.bytes().len(), "blob range past its backing");
        Blob { backing, start, len }
    }

    pub fn from_vec(v: Vec<u8>) -> Blob {
        let len = v.len();
        Blob { backing: Arc::new(v), start: 0, len }
    }

    /// A sub-range of this blob.
    pub fn slice(&self, start: usize, len: usize) -> Blob {
        assert!(start + len <= self.len, "blob slice past its end");
        Blob { backing: self.backing.clone(), start: self.start + start, len }
    }
}

impl Deref for Blob {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.backing.bytes()[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Blob({} bytes)", self.len)
    }
}
