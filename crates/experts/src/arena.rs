//! The memory the expert cache owns: one anonymous mapping cut into equal slots. A slot's
//! pages become resident when a read lands in them and are handed back to the system
//! (`MADV_DONTNEED`) when the quota shrinks, so the process's footprint follows the quota.

use std::io;

pub struct Arena {
    base: *mut u8,
    len: usize,
    pub slot_bytes: usize,
    pub n_slots: usize,
}

// SAFETY: the arena is plain memory; the cache hands each slot to one writer (a read in
// flight) or to readers (pinned views), never both at once.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Arena {
    pub fn new(n_slots: usize, slot_bytes: usize) -> io::Result<Arena> {
        assert!(slot_bytes.is_multiple_of(4096) && n_slots > 0);
        let len = n_slots * slot_bytes;
        // SAFETY: a fresh private anonymous mapping; checked for failure below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Arena { base: base as *mut u8, len, slot_bytes, n_slots })
    }

    pub fn slot_ptr(&self, s: usize) -> *mut u8 {
        assert!(s < self.n_slots, "slot {s} out of range");
        // SAFETY: in bounds of the mapping.
        unsafe { self.base.add(s * self.slot_bytes) }
    }

    /// Gives slot `s`'s pages back to the system (the slot reads as zeros afterwards).
    pub fn release(&self, s: usize) {
        // SAFETY: the range is inside our mapping; no one holds the slot (the cache removed it).
        unsafe {
            libc::madvise(self.slot_ptr(s) as *mut libc::c_void, self.slot_bytes, libc::MADV_DONTNEED);
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `new`; nothing refers to it any more.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
        }
    }
}
