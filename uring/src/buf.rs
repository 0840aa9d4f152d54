//! Owned, page-aligned buffers whose address never changes: the kernel may keep pointers into
//! them while an operation is in flight (a registered FUSE ring payload, an O_DIRECT read).
//!
//! Large long-lived buffers (FUSE payloads) come from a [`HugeArena`]: memory backed by
//! transparent huge pages where the kernel has them. A buffer inside one huge page is
//! physically contiguous, so an O_DIRECT transfer of 1 MiB to or from it is one segment for
//! the block layer instead of 256. On a virtio disk with a 256-descriptor queue, a 1 MiB
//! transfer from scattered pages does not fit in the queue at once and is split into two
//! requests that run one after the other.

use std::{
    alloc::{self, Layout},
    io,
    ops::{Deref, DerefMut},
    ptr::NonNull,
    sync::Arc,
};

/// Alignment of every buffer: a page, which satisfies O_DIRECT on any logical block size up
/// to 4 KiB and lets the kernel pin whole pages.
pub const BUF_ALIGN: usize = 4096;

/// Size of a transparent huge page on the platforms etcfs runs on (x86-64, arm64 with 4 KiB
/// pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// A zero-initialised buffer aligned to [`BUF_ALIGN`]: on the heap, or a slice of a
/// [`HugeArena`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// The arena mapping this buffer lies in (kept mapped while any slice lives); `None`
    /// for a heap buffer.
    arena: Option<Arc<Mapping>>,
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
        AlignedBuf {
            ptr,
            len,
            arena: None,
        }
    }

    /// A buffer of no bytes that owns no memory (a placeholder).
    pub fn empty() -> Self {
        AlignedBuf {
            ptr: NonNull::dangling(),
            len: 0,
            arena: None,
        }
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
        // SAFETY: ptr is a live allocation of len initialised (zeroed) bytes owned by self,
        // or (`empty`) a dangling, well-aligned pointer with len 0, valid for no bytes.
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
        if self.arena.is_some() || self.len == 0 {
            // The mapping goes when its last slice does (Arc); `empty` owns nothing.
            return;
        }
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

/// An anonymous private mapping, unmapped on drop.
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; which thread unmaps it does not
// matter, and the slices handed out never overlap (see `HugeArena::carve`).
unsafe impl Send for Mapping {}
// SAFETY: Mapping exposes no access to the memory itself; slices do, each exclusively.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly what mmap returned in `HugeArena::new`, and every
        // AlignedBuf pointing into the mapping holds an Arc to it, so none is alive now.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// Keeps a [`HugeArena`]'s memory mapped, and says where its carving region lies.
#[derive(Clone)]
pub struct ArenaHold {
    _map: Arc<Mapping>,
    start: usize,
    len: usize,
}

impl ArenaHold {
    /// Start and length of the arena's carving region (see [`HugeArena::region`]).
    pub fn region(&self) -> (*mut u8, usize) {
        (self.start as *mut u8, self.len)
    }
}

impl std::fmt::Debug for ArenaHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaHold").field("len", &self.len).finish()
    }
}

/// A region of memory, backed by transparent huge pages when the kernel grants them, from
/// which page-aligned [`AlignedBuf`]s are carved once and never returned individually.
pub struct HugeArena {
    map: Arc<Mapping>,
    /// Offset of the first uncarved byte, from the huge-page-aligned start.
    next: usize,
    /// Huge-page-aligned start of the usable region inside the mapping.
    start: usize,
    /// Usable bytes from `start`.
    cap: usize,
}

impl HugeArena {
    /// Maps `len` bytes (rounded up to whole huge pages), asks for huge pages with
    /// `MADV_HUGEPAGE`, and faults everything in now so no request path takes a page fault.
    /// Without huge pages (THP off) the memory is ordinary pages and still works.
    pub fn new(len: usize) -> io::Result<HugeArena> {
        let cap = len.max(1).next_multiple_of(HUGE_PAGE);
        // One extra huge page of slack lets the usable region start on a huge-page boundary.
        let map_len = cap + HUGE_PAGE;
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let Some(base) = NonNull::new(raw.cast::<u8>()) else {
            return Err(io::Error::other("mmap returned null"));
        };
        let map = Arc::new(Mapping { base, len: map_len });
        let start = (base.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - base.as_ptr() as usize;
        // SAFETY: [start, start + cap) lies inside the mapping (start < HUGE_PAGE).
        let usable = unsafe { base.as_ptr().add(start) };
        // SAFETY: advice on a range of our own mapping; failure (THP disabled) is harmless.
        unsafe { libc::madvise(usable.cast(), cap, libc::MADV_HUGEPAGE) };
        for off in (0..cap).step_by(BUF_ALIGN) {
            // SAFETY: in bounds of the usable region, which nothing else references yet.
            unsafe { usable.add(off).write_volatile(0) };
        }
        Ok(HugeArena {
            map,
            next: 0,
            start,
            cap,
        })
    }

    /// A zeroed buffer of `len` bytes (rounded up to a page). It starts on a boundary of
    /// `len` rounded up to a power of two (at most a huge page), so a buffer of up to a huge
    /// page never straddles two. `None` when the arena has no room left.
    pub fn carve(&mut self, len: usize) -> Option<AlignedBuf> {
        let len = len.max(1).next_multiple_of(BUF_ALIGN);
        let align = len.next_power_of_two().clamp(BUF_ALIGN, HUGE_PAGE);
        let at = self.next.next_multiple_of(align);
        if at.checked_add(len)? > self.cap {
            return None;
        }
        self.next = at + len;
        // SAFETY: [start + at, start + at + len) is inside the usable region, and no other
        // slice covers it (`next` only grows).
        let ptr = unsafe { self.map.base.as_ptr().add(self.start + at) };
        Some(AlignedBuf {
            ptr: NonNull::new(ptr)?,
            len,
            arena: Some(self.map.clone()),
        })
    }

    /// Start and length of the region buffers are carved from (for registering it with a
    /// ring: see [`crate::fixed`]).
    pub fn region(&self) -> (*mut u8, usize) {
        // SAFETY: `start` lies inside the mapping (see `new`).
        (unsafe { self.map.base.as_ptr().add(self.start) }, self.cap)
    }

    /// A hold that keeps the arena mapped as long as it lives, for a ring that registers
    /// the region without owning the arena (see [`crate::fixed`]).
    pub fn hold(&self) -> ArenaHold {
        let (start, len) = self.region();
        ArenaHold {
            _map: self.map.clone(),
            start: start as usize,
            len,
        }
    }

    /// Bytes an arena needs to carve `count` buffers of `len` bytes each.
    pub fn size_for(count: usize, len: usize) -> usize {
        let len = len.max(1).next_multiple_of(BUF_ALIGN);
        let align = len.next_power_of_two().clamp(BUF_ALIGN, HUGE_PAGE);
        count * len.next_multiple_of(align)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_slices_are_aligned_disjoint_and_zeroed() {
        let (n, len) = (5, 1 << 20);
        let mut a = HugeArena::new(HugeArena::size_for(n, len)).unwrap();
        let mut bufs: Vec<AlignedBuf> = std::iter::from_fn(|| a.carve(len)).collect();
        // Whole huge pages: room for one more than asked.
        assert_eq!(bufs.len(), n + 1);
        drop(a);
        for (i, b) in bufs.iter_mut().enumerate() {
            assert_eq!(b.len(), len);
            assert_eq!(
                b.as_ptr() as usize % len,
                0,
                "a 1 MiB slice is 1 MiB aligned"
            );
            assert!(b.iter().all(|&x| x == 0));
            b.fill(i as u8);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.iter().all(|&x| x == i as u8), "slices do not overlap");
        }
        let mut odd = HugeArena::new(HugeArena::size_for(2, len + 4016)).unwrap();
        let x = odd.carve(len + 4016).unwrap();
        let y = odd.carve(len + 4016).unwrap();
        assert_eq!(x.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(y.as_ptr() as usize % HUGE_PAGE, 0);
    }

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
