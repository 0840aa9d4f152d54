//! Open regular files: per inode, the attributes this node last committed, the cached
//! extent map, the open count, the orphan flag and the allocating writes not yet committed
//! to etcd ([`Pending`], write-behind).
//!
//! The extent map is cached for as long as the file is open here, which is what lets READ
//! and WRITE skip etcd. Today only this node changes a file it has open (the cluster
//! issue adds the locks); [`Files::forget_extents`] is the hook a watch or a lock
//! revocation calls to drop a map that another node changed.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        atomic::{AtomicU32, AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::Instant,
};

use fusedev::errno::Errno;
use meta::{
    codec::InodeAttr,
    pipeline::{ExtentsExpect, ExtentsKnown},
    types::Timespec,
};

use crate::data::plan::FileExtent;

/// Regular files open on this node at once (ENFILE past it).
pub(crate) const OPEN_FILES_MAX: usize = 1 << 20;
/// Extents cached per open file; a file with more is read range by range. Small in unit
/// tests, so that they reach the uncached paths with a few dozen writes.
#[cfg(not(test))]
pub(crate) const EXTENTS_CACHED_MAX: usize = 16384;
#[cfg(test)]
pub(crate) const EXTENTS_CACHED_MAX: usize = 64;

/// The mutable state of one open file. Held across a write's device I/O and commit, so
/// writes and truncates of one file are serialized (the kernel serializes them too).
#[derive(Debug)]
pub(crate) struct FileInner {
    pub(crate) attr: InodeAttr,
    /// The etcd revision `attr` is valid at. Attributes are replaced only by a newer
    /// revision: the outcome of a commit that raced a later one (a FLUSH's mtime racing
    /// an extending WRITE) must not bring back an older size.
    pub(crate) attr_rev: i64,
    /// The whole map, sorted; `None` until loaded (or when dropped by invalidation).
    pub(crate) extents: Option<Vec<FileExtent>>,
    /// The map has more than [`EXTENTS_CACHED_MAX`] extents: do not try to cache it.
    pub(crate) map_too_big: bool,
    /// For a map too big to cache whole: windows of it (the extents of one file range
    /// each, read in one request), up to [`WINDOWS_EXTENTS_MAX`], so that READs do not go
    /// to etcd each time (a file of 30,000 extents took 12–63 ms per 4 KiB READ). Dropped
    /// with every change of the file's extents.
    pub(crate) windows: Windows,
    /// Unlinked while open: the last close deletes it.
    pub(crate) orphaned: bool,
    /// mtime of in-place overwrites not yet written to etcd.
    pub(crate) mtime_dirty: Option<Timespec>,
    /// atime of reads (relatime) not yet written to etcd: written with the mtime, or at
    /// the last close, the lock's hand-over, fsync or unmount (`atime.rs`).
    pub(crate) atime_dirty: Option<Timespec>,
    /// ctime of a change held before its commit (a chown to the owner the file has):
    /// written with the mtime or atime at the same moments, and dropped once a commit of
    /// the file has written a ctime as late (every commit of a write or setattr does).
    pub(crate) ctime_dirty: Option<Timespec>,
    /// Allocating writes whose data is on the device (not yet flushed) and whose extents
    /// and size are in `extents`/`attr` here but not yet in etcd. `extents` is never
    /// dropped while this is set: it is the only record of where the data went.
    pub(crate) pending: Option<Pending>,
    /// The edge blocks of the last partial-block writes, as written to the device.
    pub(crate) recent: RecentBlocks,
    /// Small overwrites answered but not yet written to the device.
    pub(crate) held: HeldBlocks,
    /// What this node's last commit of the file's extents left in etcd, for the next
    /// commit to plan from instead of reading etcd.
    pub(crate) committed: Option<CommittedRecord>,
}

/// What a commit of a file's extents (SetExtents) left in etcd: the inode exactly as
/// stored and the extent keys around the range it replaced. The next commit of the file
/// plans from it ([`ExtentsExpect`]) and so costs one etcd round trip instead of two (an
/// append's fsync). Only a guess: a record gone stale (another mutation of the inode since,
/// another node's) fails the commit's compares and the pipeline re-plans from etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CommittedRecord {
    pub(crate) attr: InodeAttr,
    pub(crate) known: ExtentsKnown,
}

/// Blocks kept by [`RecentBlocks`] per open file: the two edges of the last write and the
/// blocks its device read brought along ([`RECENT_READ_AHEAD`]).
pub(crate) const RECENT_BLOCKS_MAX: usize = 12;
/// Blocks past a read-modify-written block read with it, when they follow it on the device
/// as written data: a log's next records land in them, each merging into its copy on the
/// core instead of reading a block on a waiter.
pub(crate) const RECENT_READ_AHEAD: u64 = 8;
/// Blocks kept by every open file together (64 MiB); past it nothing more is kept until
/// some are let go.
const RECENT_BLOCKS_TOTAL_MAX: usize = 16384;
static RECENT_BLOCKS_TOTAL: AtomicUsize = AtomicUsize::new(0);

/// The first and last blocks of the latest writes that read-modify-wrote, exactly as they
/// now are on the device, and the blocks their device reads brought along, so that the
/// next small write into one of them merges into this copy instead of reading the block
/// back. SQLite's WAL writes each frame as a 24-byte header and then a page, both
/// unaligned, each into the block the one before it ended in: a device read per write (191
/// µs for the header against 65 µs for an aligned 4 KiB overwrite, docs/benchmarks.md).
///
/// A copy is right only while nothing else writes its block. This node writes a file's
/// blocks only under the file's mutex, where every other writer of a block forgets it
/// (the fast path's overwrites, truncate, fallocate, punch, a dropped pending change);
/// another node writes the file only after this one gave up its lock, which drops the
/// map and these copies with it ([`FileInner::forget_extents`]). A copy is used only for
/// the device block it was written to: a block the map now puts elsewhere reads it.
#[derive(Debug, Default)]
pub(crate) struct RecentBlocks(std::collections::VecDeque<RecentBlock>);

#[derive(Debug)]
struct RecentBlock {
    file_off: u64,
    dev_off: u64,
    data: Box<[u8]>,
}

impl RecentBlocks {
    /// The block at file offset `file_off` if it was kept as written to `dev_off`.
    pub(crate) fn get(&self, file_off: u64, dev_off: u64) -> Option<&[u8]> {
        self.0
            .iter()
            .find(|b| b.file_off == file_off && b.dev_off == dev_off)
            .map(|b| &*b.data)
    }

    /// Keeps `data`, the whole block at `file_off` as it is at `dev_off`, in place of any
    /// older copy of it; the oldest goes past [`RECENT_BLOCKS_MAX`], and nothing new is
    /// kept past [`RECENT_BLOCKS_TOTAL_MAX`].
    pub(crate) fn put(&mut self, file_off: u64, dev_off: u64, data: &[u8]) {
        debug_assert_eq!(data.len() as u64, crate::data::BLOCK_SIZE);
        self.forget(file_off, 1);
        if self.0.len() >= RECENT_BLOCKS_MAX {
            self.0.pop_front();
            RECENT_BLOCKS_TOTAL.fetch_sub(1, Ordering::Relaxed);
        }
        if RECENT_BLOCKS_TOTAL.fetch_add(1, Ordering::Relaxed) >= RECENT_BLOCKS_TOTAL_MAX {
            RECENT_BLOCKS_TOTAL.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        self.0.push_back(RecentBlock {
            file_off,
            dev_off,
            data: data.into(),
        });
    }

    /// Keeps the first and last blocks of `image`, the blocks from file offset `block_off`
    /// on as a write just left them, each at the device offset `dev_of` gives it.
    pub(crate) fn put_edges(
        &mut self,
        block_off: u64,
        image: &[u8],
        dev_of: impl Fn(u64) -> Option<u64>,
    ) {
        let block = crate::data::BLOCK_SIZE as usize;
        for at in [0, image.len() - block] {
            let file_off = block_off + at as u64;
            if let Some(dev_off) = dev_of(file_off) {
                self.put(file_off, dev_off, &image[at..at + block]);
            }
        }
    }

    /// Drops the copies of blocks overlapping file bytes `[off, off + len)`.
    pub(crate) fn forget(&mut self, off: u64, len: u64) {
        let end = off.saturating_add(len);
        let before = self.0.len();
        self.0.retain(|b| {
            b.file_off.saturating_add(crate::data::BLOCK_SIZE) <= off || b.file_off >= end
        });
        RECENT_BLOCKS_TOTAL.fetch_sub(before - self.0.len(), Ordering::Relaxed);
    }

    pub(crate) fn clear(&mut self) {
        RECENT_BLOCKS_TOTAL.fetch_sub(self.0.len(), Ordering::Relaxed);
        self.0.clear();
    }
}

impl Drop for RecentBlocks {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Blocks one open file may hold unwritten ([`HeldBlocks`]): 256 KiB.
pub(crate) const HELD_BLOCKS_MAX: usize = 64;
/// Blocks every open file together may hold unwritten (32 MiB); past it writes go to the
/// device as they come.
const HELD_BLOCKS_TOTAL_MAX: usize = 8192;
static HELD_BLOCKS_TOTAL: AtomicUsize = AtomicUsize::new(0);

/// Small buffered writes answered before they reach the device: the whole blocks as the
/// writes left them, each with the device offset it belongs at. A local filesystem's page cache takes such a write in microseconds; here
/// each was a device write (80 µs) until it was held. They are written out, in one batch,
/// before anything else of this node reads or writes the file's blocks, commits its
/// pending writes (fsync, close, the age bound, the lock's hand-over to another node), or
/// forgets its open state; a fenced node drops them (its handles then answer EIO).
///
/// Overwrites are held, and small writes into blocks whose allocation is pending (a
/// journal's appends): a crash loses at most writes never fsync'd, as a page cache does.
/// No extent in etcd ever points at blocks whose data is still here: a commit of pending
/// writes writes the held blocks out and flushes the device first, and held blocks that
/// never reach the device take the pending writes with them.
#[derive(Debug, Default)]
pub(crate) struct HeldBlocks {
    blocks: std::collections::BTreeMap<u64, HeldBlock>,
    /// When the oldest of them was answered (the age trigger).
    since: Option<Instant>,
}

#[derive(Debug)]
struct HeldBlock {
    dev_off: u64,
    data: uring::AlignedBuf,
}

impl HeldBlocks {
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub(crate) fn since(&self) -> Option<Instant> {
        self.since
    }

    /// The held block at file offset `file_off` if it belongs at `dev_off`.
    pub(crate) fn get(&self, file_off: u64, dev_off: u64) -> Option<&[u8]> {
        self.blocks
            .get(&file_off)
            .filter(|b| b.dev_off == dev_off)
            .map(|b| &*b.data)
    }

    /// Takes room for `new` more blocks (the per-file and global bounds); false, taking
    /// nothing, when there is none.
    pub(crate) fn reserve(&self, new: usize) -> bool {
        if self.blocks.len() + new > HELD_BLOCKS_MAX {
            return false;
        }
        let before = HELD_BLOCKS_TOTAL.fetch_add(new, Ordering::Relaxed);
        if before + new > HELD_BLOCKS_TOTAL_MAX {
            HELD_BLOCKS_TOTAL.fetch_sub(new, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Holds `data`, the whole block at `file_off` as the write left it, for `dev_off`. A
    /// block not held yet must have been [`HeldBlocks::reserve`]d.
    pub(crate) fn put(&mut self, file_off: u64, dev_off: u64, data: uring::AlignedBuf) {
        debug_assert_eq!(data.len() as u64, crate::data::BLOCK_SIZE);
        self.since.get_or_insert_with(Instant::now);
        self.blocks.insert(file_off, HeldBlock { dev_off, data });
    }

    /// Lets go of them all, for writing out: `(file_off, dev_off, data)` by file offset.
    pub(crate) fn take(&mut self) -> Vec<(u64, u64, uring::AlignedBuf)> {
        self.since = None;
        let all = std::mem::take(&mut self.blocks);
        HELD_BLOCKS_TOTAL.fetch_sub(all.len(), Ordering::Relaxed);
        all.into_iter()
            .map(|(file_off, b)| (file_off, b.dev_off, b.data))
            .collect()
    }
}

impl Drop for HeldBlocks {
    fn drop(&mut self) {
        if !self.blocks.is_empty() {
            log::error!(
                "{} written blocks dropped with a file's open state before reaching the device",
                self.blocks.len()
            );
        }
        HELD_BLOCKS_TOTAL.fetch_sub(self.blocks.len(), Ordering::Relaxed);
    }
}

/// Extents of a window of a file too fragmented to cache whole.
#[derive(Debug, Clone)]
pub(crate) struct ExtentWindow {
    /// File bytes `[from, to)` whose mapping `extents` holds completely (a byte of the
    /// range in no extent is a hole).
    pub(crate) from: u64,
    pub(crate) to: u64,
    pub(crate) extents: Vec<FileExtent>,
}

impl ExtentWindow {
    /// The window of `list`, the answer to a read of the extents from `from` on (the one
    /// reaching in from before included) limited to `limit`: when the limit was reached
    /// the window ends where the last extent does (what follows it is unknown).
    pub(crate) fn of(from: u64, list: Vec<FileExtent>, more: bool) -> ExtentWindow {
        let to = match (more, list.last()) {
            (true, Some(e)) => e.file_off + e.len,
            (true, None) => from,
            (false, _) => u64::MAX,
        };
        ExtentWindow {
            from,
            to,
            extents: list,
        }
    }

    /// The extents overlapping `[off, off + len)` when the window covers that range.
    pub(crate) fn covering(&self, off: u64, len: u64) -> Option<&[FileExtent]> {
        (off >= self.from && off.saturating_add(len) <= self.to)
            .then(|| overlapping(&self.extents, off, len))
    }
}

/// Extents read for one window of a file too fragmented to cache whole.
#[cfg(not(test))]
pub(crate) const WINDOW_EXTENTS: usize = 4096;
#[cfg(test)]
pub(crate) const WINDOW_EXTENTS: usize = 16;
/// Extents kept in the windows of one open file (32 bytes each: 8 MiB).
#[cfg(not(test))]
pub(crate) const WINDOWS_EXTENTS_MAX: usize = 1 << 18;
#[cfg(test)]
pub(crate) const WINDOWS_EXTENTS_MAX: usize = 256;

/// The windows of one file's map, by start offset, within [`WINDOWS_EXTENTS_MAX`].
#[derive(Debug, Default)]
pub(crate) struct Windows {
    by_start: std::collections::BTreeMap<u64, ExtentWindow>,
    extents: usize,
}

impl Windows {
    /// The extents overlapping `[off, off + len)` from a window that covers the range
    /// (the nearest few starting at or before `off`: windows may overlap).
    pub(crate) fn covering(&self, off: u64, len: u64) -> Option<&[FileExtent]> {
        self.by_start
            .range(..=off)
            .rev()
            .take(4)
            .find_map(|(_, w)| w.covering(off, len))
    }

    /// Keeps `w`, dropping the windows furthest from it while over the bound.
    pub(crate) fn insert(&mut self, w: ExtentWindow) {
        let at = w.from;
        self.extents += w.extents.len();
        if let Some(old) = self.by_start.insert(at, w) {
            self.extents -= old.extents.len();
        }
        while self.extents > WINDOWS_EXTENTS_MAX && self.by_start.len() > 1 {
            let (&first, _) = self.by_start.first_key_value().expect("non-empty");
            let (&last, _) = self.by_start.last_key_value().expect("non-empty");
            let victim = if at - first >= last - at { first } else { last };
            if let Some(old) = self.by_start.remove(&victim) {
                self.extents -= old.extents.len();
            }
        }
    }

    pub(crate) fn clear(&mut self) {
        self.by_start.clear();
        self.extents = 0;
    }
}

/// The extent and size change of allocating writes not yet committed (write-behind): one
/// block range, committed as one `SetExtents` after one device flush.
#[derive(Debug)]
pub(crate) struct Pending {
    /// Block-aligned file range the writes touched (the union of their block ranges).
    pub(crate) off: u64,
    pub(crate) end: u64,
    /// Device blocks allocated for it (merged): the groups whose free maps commit with
    /// it, and what is given back when it is dropped.
    pub(crate) allocated: Vec<FileExtent>,
    /// Bytes allocated (the 64 MiB bound of one commit).
    pub(crate) allocated_bytes: u64,
    /// The size the writes reached (`size_at_least` of the commit).
    pub(crate) size: u64,
    /// The size etcd held before the first of these writes (restored when dropped).
    pub(crate) committed_size: u64,
    /// Extents of the map that the range covered when it grew over them: an upper
    /// bound on the extent keys the commit replaces (the pipeline caps a mutation's).
    pub(crate) old_extents: usize,
    /// When the first of these writes was acknowledged (the age trigger).
    pub(crate) since: Instant,
    /// The mtime of the last of these writes.
    pub(crate) mtime: Timespec,
    /// Failed commit attempts so far (bounded).
    pub(crate) failures: u32,
    /// A failed attempt may have been applied (etcd unavailable): its blocks must not be
    /// given back when the change is dropped.
    pub(crate) maybe_applied: bool,
}

impl FileInner {
    /// Replaces the attributes with `attr`, valid at `rev`, unless the held ones are newer.
    /// True when replaced.
    pub(crate) fn set_attr(&mut self, attr: &InodeAttr, rev: i64) -> bool {
        if rev < self.attr_rev {
            return false;
        }
        // Anything else changed the inode since this node's last extents commit (another
        // node's write after the lock went to it): the next commit reads rather than
        // fail a compare on the old record first (three round trips instead of two).
        if self.committed.as_ref().is_some_and(|c| c.attr != *attr) {
            self.committed = None;
        }
        if self.ctime_dirty.is_some_and(|t| attr.ctime >= t) {
            self.ctime_dirty = None;
        }
        self.attr = attr.clone();
        self.attr_rev = rev;
        self.overlay_pending();
        true
    }

    /// Holds the ctime of a change that moved nothing else (see `ctime_dirty`), from the
    /// kernel's coarse clock as an overwrite's mtime, never before the ctime shown.
    pub(crate) fn touch_ctime(&mut self) {
        let shown = self.ctime_dirty.unwrap_or(self.attr.ctime);
        self.ctime_dirty = Some(coarse_wall().max(shown));
    }

    /// [`FileInner::set_attr`] with the attributes an own SetAttr replaced (`before`): the
    /// record of the last extents commit, kept with exactly those, stays current (a chown
    /// right after a create, as SQLite does to each journal as root, made the journal's
    /// first fsync read the inode and its extents).
    pub(crate) fn set_attr_replacing(
        &mut self,
        attr: &InodeAttr,
        rev: i64,
        before: Option<&InodeAttr>,
    ) -> bool {
        if rev < self.attr_rev {
            return false;
        }
        if let (Some(c), Some(b)) = (self.committed.as_mut(), before) {
            if c.attr == *b {
                c.attr = attr.clone();
            }
        }
        self.set_attr(attr, rev)
    }

    /// Records an in-place overwrite's mtime from the kernel's coarse clock, the one ext4's
    /// own timestamps come from: overwrites within one clock tick (4 ms here) of each other
    /// or of the mtime the attributes show change nothing, so a loop of overwrite + fsync
    /// commits the mtime to etcd once a tick, not at every fsync. Never earlier than the
    /// mtime shown (a commit's fine-grained one may be ahead of the coarse clock).
    pub(crate) fn touch_overwrite(&mut self) {
        let now = coarse_wall();
        let shown = self.mtime_dirty.unwrap_or(self.attr.mtime);
        if now > shown {
            self.mtime_dirty = Some(now);
        }
    }

    /// What a commit of `[off, end)` may expect from the record of the last one
    /// ([`ExtentsKnown::expectation`]).
    pub(crate) fn expect_extents(&self, off: u64, end: u64) -> Option<Box<ExtentsExpect>> {
        let c = self.committed.as_ref()?;
        c.known.expectation(&c.attr, off, end).map(Box::new)
    }

    /// Every extent key of the file as this node's last commit of it left them, when the
    /// record of that commit starts at the file's first key and is short enough for one
    /// transaction to release; keys past the record's end are guessed none. Only a guess
    /// (see [`meta::pipeline::UnlinkExpect::extents`]).
    pub(crate) fn full_map_record(&self) -> Option<Vec<meta::codec::Extent>> {
        let c = self.committed.as_ref()?;
        (c.known.start == 0
            && c.known.extents.len() <= meta::pipeline::EXTENTS_PER_MUTATION_MAX
            && self.pending.is_none())
        .then(|| c.known.extents.clone())
    }

    /// Drops the cached map unless pending writes live in it (see [`Files::forget_extents`]).
    pub(crate) fn forget_extents(&mut self) {
        self.windows.clear();
        self.recent.clear();
        self.committed = None;
        if self.pending.is_none() {
            self.extents = None;
            self.map_too_big = false;
        }
    }

    /// Raises the attributes to what the pending writes reached: etcd does not know them
    /// yet, and the kernel must never be told a smaller size than it acknowledged.
    pub(crate) fn overlay_pending(&mut self) {
        if let Some(p) = &self.pending {
            self.attr.size = self.attr.size.max(p.size);
            if self.attr.mtime < p.mtime {
                self.attr.mtime = p.mtime;
                self.attr.ctime = self.attr.ctime.max(p.mtime);
            }
        }
    }
}

#[derive(Debug)]
pub(crate) struct FileState {
    pub(crate) ino: u64,
    inner: Mutex<FileInner>,
    /// Device reads and writes the transport runs for this file after its lock was let go
    /// (the READ and WRITE fast paths). Whoever frees or rewrites blocks of the file waits,
    /// holding the lock, until it is zero: a block freed under an I/O in flight could be
    /// handed to another file before that I/O lands.
    io_in_flight: AtomicU32,
}

/// One fast-path device I/O of a file, counted until dropped (see [`FileState::begin_io`]).
#[derive(Debug)]
pub(crate) struct IoInFlight(Arc<FileState>);

impl Drop for IoInFlight {
    fn drop(&mut self) {
        self.0.io_in_flight.fetch_sub(1, Ordering::Release);
    }
}

impl FileState {
    /// Counts a device I/O that will run without the lock. Call it holding the lock, which
    /// is what makes [`FileState::wait_io`] (also under the lock) see every one.
    pub(crate) fn begin_io(self: &Arc<Self>, _held: &FileInner) -> IoInFlight {
        self.io_in_flight.fetch_add(1, Ordering::Acquire);
        IoInFlight(self.clone())
    }

    /// Whether a fast-path I/O of the file is in flight. Call it holding the lock (none can
    /// start meanwhile).
    pub(crate) fn io_busy(&self, _held: &FileInner) -> bool {
        self.io_in_flight.load(Ordering::Acquire) > 0
    }

    /// Waits, holding the lock, until no fast-path I/O of the file is in flight. They run
    /// on the cores' rings and take microseconds to milliseconds; no lock is needed to
    /// finish them, so this cannot deadlock. Never call it on a core thread.
    pub(crate) fn wait_io(&self, _held: &FileInner) {
        let mut spins = 0u32;
        while self.io_in_flight.load(Ordering::Acquire) > 0 {
            spins += 1;
            if spins < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, FileInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, FileInner>> {
        self.inner.try_lock().ok()
    }

    /// The lock, for a core's fast path, which must not block: retries for a few
    /// microseconds first. Fast paths hold it for well under that, so two cores serving one
    /// file get it; a waiter holding it for a commit or device I/O is waited out only
    /// briefly (the request then goes to a waiter too).
    pub(crate) fn try_lock_briefly(&self) -> Option<MutexGuard<'_, FileInner>> {
        const TRIES: u32 = 256;
        for _ in 0..TRIES {
            if let Some(f) = self.try_lock() {
                return Some(f);
            }
            std::hint::spin_loop();
        }
        None
    }
}

/// The table of open files.
#[derive(Debug, Default)]
pub(crate) struct Files {
    map: Mutex<HashMap<u64, (u32, Arc<FileState>)>>,
    /// Open files that may hold a [`Pending`] change (bounded by the open files): what the
    /// age trigger looks at instead of every open file. Lock order: a file's lock, then
    /// this.
    dirty: Mutex<HashSet<u64>>,
}

/// What [`Files::open_attr`] knows of an inode.
pub(crate) enum OpenAttr {
    /// Not open here: the caches or etcd answer.
    NotOpen,
    /// Open, but its lock is held (only from [`Files::try_open_attr`]): ask a waiter.
    Busy,
    /// The open file's attributes (with pending writes) and allocated 512-byte blocks.
    Attr(InodeAttr, Option<u64>),
}

impl Files {
    fn table(&self) -> MutexGuard<'_, HashMap<u64, (u32, Arc<FileState>)>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one more open of `ino` (adding it with `attr`, valid at revision `rev`, when
    /// it was not open; when it was, newer attributes replace the held ones).
    pub(crate) fn open(
        &self,
        ino: u64,
        attr: InodeAttr,
        rev: i64,
    ) -> Result<Arc<FileState>, Errno> {
        let mut t = self.table();
        if let Some((n, st)) = t.get_mut(&ino) {
            *n += 1;
            let st = st.clone();
            drop(t);
            st.lock().set_attr(&attr, rev);
            return Ok(st);
        }
        if t.len() >= OPEN_FILES_MAX {
            return Err(Errno::ENFILE);
        }
        let st = Arc::new(FileState {
            ino,
            inner: Mutex::new(FileInner {
                attr,
                attr_rev: rev,
                extents: None,
                map_too_big: false,
                windows: Windows::default(),
                orphaned: false,
                mtime_dirty: None,
                atime_dirty: None,
                ctime_dirty: None,
                pending: None,
                recent: RecentBlocks::default(),
                held: HeldBlocks::default(),
                committed: None,
            }),
            io_in_flight: AtomicU32::new(0),
        });
        t.insert(ino, (1, st.clone()));
        Ok(st)
    }

    /// Counts one close; returns the state when it was the last.
    pub(crate) fn close(&self, ino: u64) -> Option<Arc<FileState>> {
        let mut t = self.table();
        let (n, _) = t.get_mut(&ino)?;
        *n -= 1;
        if *n == 0 {
            return t.remove(&ino).map(|(_, st)| st);
        }
        None
    }

    /// Empties the table (the session it was opened under was fenced): every open
    /// file's cached map and writes not yet committed are dropped, never committed.
    /// Returns the files and how many had such writes.
    pub(crate) fn drop_all(&self) -> (Vec<u64>, usize) {
        let all: Vec<(u64, Arc<FileState>)> = self
            .table()
            .drain()
            .map(|(ino, (_, st))| (ino, st))
            .collect();
        self.dirty
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let mut lost = 0;
        for (_, st) in &all {
            let mut f = st.lock();
            lost += usize::from(f.pending.take().is_some());
            lost += usize::from(!f.held.take().is_empty());
            f.mtime_dirty = None;
            f.atime_dirty = None;
            f.ctime_dirty = None;
            f.forget_extents();
            f.attr_rev = 0;
        }
        (all.into_iter().map(|(ino, _)| ino).collect(), lost)
    }

    pub(crate) fn get(&self, ino: u64) -> Option<Arc<FileState>> {
        self.table().get(&ino).map(|(_, st)| st.clone())
    }

    pub(crate) fn all(&self) -> Vec<u64> {
        self.table().keys().copied().collect()
    }

    /// Notes that `ino` has a pending change (call holding its lock).
    pub(crate) fn mark_dirty(&self, ino: u64) {
        self.dirty
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(ino);
    }

    /// Forgets `ino` as dirty (call holding its lock, with its pending change gone).
    pub(crate) fn clear_dirty(&self, ino: u64) {
        self.dirty
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&ino);
    }

    /// Whether `ino` may have a pending change, without its lock (which a fast-path I/O
    /// would then find taken). A WRITE that was answered is in the set.
    pub(crate) fn is_dirty(&self, ino: u64) -> bool {
        self.dirty
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&ino)
    }

    /// The files that may have a pending change.
    pub(crate) fn dirty(&self) -> Vec<u64> {
        self.dirty
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .copied()
            .collect()
    }

    /// An open file's attributes, waiting for its lock (waiter threads only: a core must
    /// not wait). An open file's attributes are the only right ones: the caches and etcd
    /// lack its pending writes.
    pub(crate) fn open_attr(&self, ino: u64) -> OpenAttr {
        match self.get(ino) {
            Some(st) => {
                let f = st.lock();
                let (a, b) = attr_of(&f);
                OpenAttr::Attr(a, b)
            }
            None => OpenAttr::NotOpen,
        }
    }

    /// [`Files::open_attr`] without waiting (cores): `Busy` when the lock is held.
    pub(crate) fn try_open_attr(&self, ino: u64) -> OpenAttr {
        let Some(st) = self.get(ino) else {
            return OpenAttr::NotOpen;
        };
        let Some(f) = st.try_lock() else {
            return OpenAttr::Busy;
        };
        let (a, b) = attr_of(&f);
        OpenAttr::Attr(a, b)
    }

    /// The cached attributes and allocated 512-byte blocks of an open file, waiting for
    /// its lock (waiter threads); None when it is not open here.
    pub(crate) fn cached_attr(&self, ino: u64) -> Option<(InodeAttr, Option<u64>)> {
        match self.open_attr(ino) {
            OpenAttr::Attr(a, b) => Some((a, b)),
            _ => None,
        }
    }
    /// Attributes committed at `rev` (ignored when the held ones are newer), replacing
    /// `before` when the commit says what it replaced.
    pub(crate) fn update_attr(
        &self,
        ino: u64,
        attr: &InodeAttr,
        rev: i64,
        before: Option<&InodeAttr>,
    ) {
        if let Some(st) = self.get(ino) {
            st.lock().set_attr_replacing(attr, rev, before);
        }
    }

    /// Marks an open file orphaned; false when it is not open here.
    pub(crate) fn mark_orphaned(&self, ino: u64) -> bool {
        match self.get(ino) {
            Some(st) => {
                st.lock().orphaned = true;
                true
            }
            None => false,
        }
    }

    /// Drops a cached map (the inode was deleted, or another node changed it). A map
    /// holding pending writes stays: it is the only record of where their data is, and
    /// their commit (which replaces the range in etcd) comes within the age bound.
    pub(crate) fn forget_extents(&self, ino: u64) {
        if let Some(st) = self.get(ino) {
            st.lock().forget_extents();
        }
    }

    /// Whether FLUSH has something to write: an mtime, pending or held writes (true when busy,
    /// to be safe).
    pub(crate) fn has_dirty_state(&self, ino: u64) -> bool {
        match self.get(ino) {
            Some(st) => st.try_lock().is_none_or(|f| {
                f.mtime_dirty.is_some()
                    || f.ctime_dirty.is_some()
                    || f.pending.is_some()
                    || !f.held.is_empty()
            }),
            None => false,
        }
    }
}

/// An open file's attributes as the kernel must see them (the mtime of in-place
/// overwrites not yet written included) and its allocated 512-byte blocks.
fn attr_of(f: &FileInner) -> (InodeAttr, Option<u64>) {
    let mut attr = f.attr.clone();
    if let Some(t) = f.mtime_dirty {
        attr.mtime = t;
        attr.ctime = t;
    }
    if let Some(t) = f.atime_dirty {
        attr.atime = attr.atime.max(t);
    }
    if let Some(t) = f.ctime_dirty {
        attr.ctime = attr.ctime.max(t);
    }
    let blocks = f
        .extents
        .as_ref()
        .map(|m| m.iter().map(|e| e.len / 512).sum());
    (attr, blocks)
}

/// The extents of a sorted map that overlap `[off, off + len)`.
pub(crate) fn overlapping(map: &[FileExtent], off: u64, len: u64) -> &[FileExtent] {
    let end = off.saturating_add(len);
    let a = map.partition_point(|e| e.file_off + e.len <= off);
    let b = map.partition_point(|e| e.file_off < end);
    map.get(a..b.max(a)).unwrap_or_default()
}

/// Splits the unmapping of `[from, to)` into file ranges that each hold at most `per` of the
/// extents pushed (in file order), so that each range can be one commit that logs every
/// range it frees.
#[derive(Debug)]
pub(crate) struct UnmapChunks {
    from: u64,
    to: u64,
    per: usize,
    in_chunk: usize,
    start: u64,
    end: u64,
    ranges: Vec<(u64, u64)>,
}

impl UnmapChunks {
    pub(crate) fn new(from: u64, to: u64, per: usize) -> Self {
        UnmapChunks {
            from,
            to,
            per: per.max(1),
            in_chunk: 0,
            start: from,
            end: from,
            ranges: Vec::new(),
        }
    }

    /// Takes the next extent in file order; false once extents lie past `to`.
    pub(crate) fn push(&mut self, e: &FileExtent) -> bool {
        let e_end = e.file_off + e.len;
        if e.file_off >= self.to {
            return false;
        }
        if e_end <= self.from {
            return true;
        }
        if self.in_chunk == self.per {
            self.ranges.push((self.start, self.end));
            self.in_chunk = 0;
        }
        if self.in_chunk == 0 {
            self.start = e.file_off.max(self.from);
        }
        self.end = e_end.min(self.to);
        self.in_chunk += 1;
        true
    }

    /// The ranges, in file order.
    pub(crate) fn finish(mut self) -> Vec<(u64, u64)> {
        if self.in_chunk > 0 {
            self.ranges.push((self.start, self.end));
        }
        self.ranges
    }
}

/// Drops the mapping at and past `end` (block-aligned).
pub(crate) fn trim_extents(map: &mut Vec<FileExtent>, end: u64) {
    map.retain(|e| e.file_off < end);
    if let Some(l) = map.last_mut() {
        if l.file_off + l.len > end {
            l.len = end - l.file_off;
        }
    }
}

/// Replaces the mapping of `[off, off + len)` with `new` (sorted, inside the range),
/// cutting extents that straddle its edges.
pub(crate) fn replace_range(map: &mut Vec<FileExtent>, off: u64, len: u64, new: &[FileExtent]) {
    let end = off + len;
    let mut out = Vec::with_capacity(map.len() + new.len() + 1);
    for e in map.iter() {
        let e_end = e.file_off + e.len;
        if e_end <= off || e.file_off >= end {
            out.push(*e);
            continue;
        }
        if e.file_off < off {
            out.push(FileExtent {
                len: off - e.file_off,
                ..*e
            });
        }
        if e_end > end {
            let cut = end - e.file_off;
            out.push(FileExtent {
                file_off: end,
                len: e.len - cut,
                dev_off: e.dev_off + cut,
                unwritten: e.unwritten,
            });
        }
    }
    out.extend_from_slice(new);
    out.sort_by_key(|e| e.file_off);
    *map = out;
}

/// The wall clock at the kernel's tick (`CLOCK_REALTIME_COARSE`).
fn coarse_wall() -> Timespec {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::RealtimeCoarse);
    Timespec::new(t.tv_sec, t.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: u64 = 4096;

    fn ext(f: u64, n: u64, d: u64) -> FileExtent {
        FileExtent {
            file_off: f * B,
            len: n * B,
            dev_off: d * B,
            unwritten: false,
        }
    }

    #[test]
    fn unmap_chunks_hold_at_most_per_extents_each_clamped_to_the_range() {
        let map: Vec<FileExtent> = (0..7).map(|i| ext(2 * i, 1, 100 + i)).collect();
        let chunks = |from: u64, to: u64, per: usize| {
            let mut c = UnmapChunks::new(from * B, to * B, per);
            for e in &map {
                if !c.push(e) {
                    break;
                }
            }
            c.finish()
        };
        // Extents at blocks 0, 2, 4, ... 12; three per chunk.
        assert_eq!(
            chunks(0, 100, 3),
            vec![(0, 5 * B), (6 * B, 11 * B), (12 * B, 13 * B)]
        );
        // Clamped at both ends; an extent reaching in counts.
        let big = [ext(0, 10, 0), ext(10, 1, 50)];
        let mut c = UnmapChunks::new(4 * B, 11 * B, 1);
        assert!(big.iter().all(|e| c.push(e)));
        assert_eq!(c.finish(), vec![(4 * B, 10 * B), (10 * B, 11 * B)]);
        assert_eq!(chunks(3, 9, 10), vec![(4 * B, 9 * B)]);
        assert_eq!(chunks(1, 2, 10), Vec::<(u64, u64)>::new(), "a hole");
        assert_eq!(chunks(0, 100, 0).len(), 7, "at least one per chunk");
    }

    #[test]
    fn overlapping_trim_replace() {
        let map = vec![ext(0, 2, 10), ext(4, 4, 20), ext(10, 1, 30)];
        assert_eq!(overlapping(&map, 2 * B, 2 * B), &[] as &[FileExtent]);
        assert_eq!(overlapping(&map, B, 4 * B), &map[..2]);
        assert_eq!(overlapping(&map, 11 * B, B), &[] as &[FileExtent]);

        let mut m = map.clone();
        trim_extents(&mut m, 6 * B);
        assert_eq!(m, vec![ext(0, 2, 10), ext(4, 2, 20)]);

        let mut m = map.clone();
        replace_range(&mut m, 5 * B, 2 * B, &[ext(5, 1, 99)]);
        assert_eq!(
            m,
            vec![
                ext(0, 2, 10),
                ext(4, 1, 20),
                ext(5, 1, 99),
                ext(7, 1, 23),
                ext(10, 1, 30)
            ]
        );
    }

    fn window(from: u64, n: u64) -> ExtentWindow {
        let list = (0..n)
            .map(|i| FileExtent {
                file_off: from + i * 2 * B,
                len: B,
                dev_off: (from + i * 2 * B) * 2,
                unwritten: false,
            })
            .collect();
        ExtentWindow::of(from, list, true)
    }

    #[test]
    fn windows_stay_within_their_bound_and_keep_the_newest() {
        let mut w = Windows::default();
        let per = 40u64;
        for k in 0..20u64 {
            w.insert(window(k * per * 2 * B, per));
            assert!(
                w.extents <= WINDOWS_EXTENTS_MAX,
                "{} extents kept",
                w.extents
            );
        }
        let last = 19 * per * 2 * B;
        assert_eq!(w.covering(last + 2 * B, 100).map(<[_]>::len), Some(1));
        // A hole between two extents inside a window is a hole, not a miss.
        assert_eq!(w.covering(last + B, 100).map(<[_]>::len), Some(0));
        // Past the last extent of a window that stopped at its limit: unknown.
        assert!(w.covering(last + per * 2 * B, 100).is_none());
        w.clear();
        assert!(w.covering(last, 1).is_none());
    }
}
