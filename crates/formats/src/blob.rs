//! `Blob`: a cheaply clonable byte range of a shared buffer (a mapped file or owned memory).

use std::ops::Deref;
use std::sync::Arc;

/// Anything that can back a blob: a memory map, an owned vector, an aligned slot.
pub trait Backing: Send + Sync {
    fn bytes(&self) -> &[u8];
    /// Drops the pages of `start..start + len` from this process's resident set, if the
    /// backing can get them back (a file mapping re-reads them on access).
    fn release(&self, _start: usize, _len: usize) {}
}

impl Backing for memmap2::Mmap {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn release(&self, start: usize, len: usize) {
        let page = 4096;
        let a = start.div_ceil(page) * page;
        let b = (start + len) / page * page;
        if b > a {
            // SAFETY: a page-aligned range inside this read-only file mapping; dropping its
            // pages only means they are read from the file again if touched.
            unsafe {
                libc::madvise(self.as_ptr().add(a) as *mut libc::c_void, b - a, libc::MADV_DONTNEED);
            }
        }
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

    /// Copies the bytes into memory of their own, releasing the source's pages as it goes,
    /// so copying a mapped tensor does not hold both copies resident.
    pub fn to_owned_releasing(&self) -> Blob {
        let mut v = Vec::with_capacity(self.len);
        let chunk = 4 << 20;
        let mut at = 0;
        while at < self.len {
            let n = chunk.min(self.len - at);
            v.extend_from_slice(&self[at..at + n]);
            self.backing.release(self.start + at, n);
            at += n;
        }
        Blob::from_vec(v)
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
