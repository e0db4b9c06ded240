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

    /// Copies `parts` into one allocation of their own, each part starting `align` bytes
    /// apart at least (a multiple of `align` from the allocation's start), releasing the
    /// sources' pages as it goes. Returns the whole allocation and the copies, in order. Many
    /// tensors in one block of memory: a device page-locks one range instead of thousands.
    pub fn pack_releasing(parts: &[&Blob], align: usize) -> (Blob, Vec<Blob>) {
        let align = align.max(1);
        let mut offsets = Vec::with_capacity(parts.len());
        let mut end = 0usize;
        for p in parts {
            let at = end.next_multiple_of(align);
            offsets.push(at);
            end = at + p.len;
        }
        let mut v = vec![0u8; end];
        let chunk = 4 << 20;
        for (p, &at) in parts.iter().zip(&offsets) {
            let mut done = 0;
            while done < p.len {
                let n = chunk.min(p.len - done);
                v[at + done..at + done + n].copy_from_slice(&p[done..done + n]);
                p.backing.release(p.start + done, n);
                done += n;
            }
        }
        let whole = Blob::from_vec(v);
        let copies = parts.iter().zip(offsets).map(|(p, at)| whole.slice(at, p.len)).collect();
        (whole, copies)
    }

    /// Whether `self` and `other` are ranges of the same buffer.
    pub fn shares_backing(&self, other: &Blob) -> bool {
        Arc::ptr_eq(&self.backing, &other.backing)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_copies_hold_the_parts_aligned_in_one_buffer() {
        let a = Blob::from_vec((0..100u8).collect());
        let b = Blob::from_vec(vec![7u8; 3]).slice(1, 2);
        let c = Blob::from_vec((0..=255u8).cycle().take(5000).collect()).slice(17, 4000);
        let (whole, copies) = Blob::pack_releasing(&[&a, &b, &c], 64);
        assert_eq!(copies.len(), 3);
        for (orig, copy) in [&a, &b, &c].into_iter().zip(&copies) {
            assert_eq!(&orig[..], &copy[..]);
            assert!(copy.shares_backing(&whole) && !copy.shares_backing(orig));
            assert_eq!((copy.as_ptr() as usize - whole.as_ptr() as usize) % 64, 0);
        }
        // Parts follow one another without overlapping, and nothing is past the last one.
        assert_eq!(copies[1].as_ptr() as usize - whole.as_ptr() as usize, 128);
        assert_eq!(copies[2].as_ptr() as usize - whole.as_ptr() as usize, 192);
        assert_eq!(whole.len(), 192 + 4000);
        let (empty, none) = Blob::pack_releasing(&[], 64);
        assert!(empty.is_empty() && none.is_empty());
    }
}
