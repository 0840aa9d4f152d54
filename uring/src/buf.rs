//! Owned, page-aligned buffers whose address never changes: the kernel may keep pointers into
//! them while an operation is in flight (a registered FUSE ring payload, an O_DIRECT read).

use std::{
    alloc::{self, Layout},
    ops::{Deref, DerefMut},
    ptr::NonNull,
};

/// Alignment of every buffer: a page, which satisfies O_DIRECT on any logical block size up
/// to 4 KiB and lets the kernel pin whole pages.
pub const BUF_ALIGN: usize = 4096;

/// A zero-initialised heap buffer aligned to [`BUF_ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>; moving it to another thread
// moves that ownership.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out `&[u8]`, which is Sync.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes (`len` is rounded up to a whole page).
    pub fn new(len: usize) -> Self {
        let len = len.max(1).next_multiple_of(BUF_ALIGN);
        let layout = Layout::from_size_align(len, BUF_ALIGN).expect("page-aligned layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf { ptr, len }
    }

    /// Raw address for handing to the kernel; valid for `len()` bytes while `self` lives.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Raw read-only address, for operations where the kernel only reads.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of len initialised (zeroed) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, BUF_ALIGN).expect("layout used to alloc");
        // SAFETY: ptr was allocated in `new` with exactly this layout and is freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_rounded() {
        let mut b = AlignedBuf::new(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_ptr() as usize % BUF_ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
        b[8191] = 7;
        assert_eq!(b[8191], 7);
    }
}
