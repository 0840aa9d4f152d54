//! Cluster cache locks: what lets a node cache a regular file's pages, attributes and
//! extent map, and keep writes behind, while other nodes use the same file.
//!
//! # The protocol
//!
//! Every regular file has one lock in etcd (`meta::cachelock`), held per node in one of two
//! modes: **shared** (the node may cache the file: kernel pages and attributes, the daemon's
//! attributes and extent map) or **exclusive** (it may also write, and keep allocating
//! writes behind). Several nodes may share; an exclusive holder is alone. Keys live under
//! the holder's lease, so a dead node's locks die with it.
//!
//! * **Taking.** An operation on a file first holds its lock in the mode it needs
//!   ([`Inner::hold`]): READ, GETATTR, LOOKUP, OPEN and SEEK shared; WRITE, SETATTR,
//!   FALLOCATE and truncation exclusive. Held already: no etcd (this is what an uncontended
//!   file costs, and the cores' fast paths check it without blocking). Not held: one
//!   transaction takes it when no other node conflicts; a create takes its new file's lock
//!   exclusive in its own transaction. On a conflict the node records that it waits (`Q`)
//!   and sleeps until the watch shows a change of the file's holders (a re-check each
//!   [`RECHECK`] covers a missed event), at most [`ACQUIRE_WAIT_MAX`], then EIO.
//! * **Giving way.** The holder's watch sees the `Q` record and queues the file for the
//!   lock thread ([`Inner::give_way`]). After a minimum hold (`--lock-min-hold-ms`), it stops new
//!   operations on the file, waits for the ones in progress and for the file's device I/O,
//!   commits what it has written behind (an exclusive holder's data and mtime reach etcd
//!   and the device), and then:
//!   - for a **shared** request to an exclusive holder: downgrades in etcd, keeping its
//!     caches (they hold exactly what it wrote);
//!   - otherwise: makes the kernel drop the file's pages and attributes (INVAL_INODE),
//!     drops its own cached attributes and extent map, and only then deletes its key.
//!     **Invalidate before giving up the lock, never after.**
//! * The asker's watch sees the delete (or the downgrade) and takes the lock. Whatever it
//!   reads now is what the last holder wrote: a `write(2)` that returned on one node is
//!   seen by a `read(2)` or `stat(2)` that starts later on any other.
//!
//! # The kernel's page locks
//!
//! A kernel invalidation locks each cached page of the range in turn; a READ or buffered
//! WRITE sent to us holds its pages locked until we answer. So an operation that waits for
//! the lock while a release is invalidating could hold a page the invalidation waits for,
//! and a killed daemon with a thread stuck there never exits. Two rules prevent it:
//! the release invalidates around the ranges of the READs and WRITEs already waiting
//! (their pages are being filled, not cached), and lets through any that arrives inside
//! the range being invalidated when the mode still held covers it (the lock is still
//! ours; the invalidation waits for its pages, then drops them), invalidating their
//! ranges again after. Pages left out because an operation was waiting on them are
//! invalidated once it has run ([`Job::InvalStale`]). A WRITE that arrives inside the
//! range while this node gives up a *shared* lock may hold pages the invalidation waits
//! for, and may not run under a shared lock: it upgrades the lock (still this node's) to
//! exclusive and runs, and the release goes on as an exclusive one, writing back before
//! the key goes.

use std::{
    collections::HashMap,
    sync::atomic::{
        AtomicUsize,
        Ordering::{Relaxed, SeqCst},
    },
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use meta::{
    cachelock::{Acquired, CacheLocks, Known, LockMode},
    error::MetaError,
    kv::{RangeRequest, RangeResponse},
    types::Ino,
};

use super::{errno, Inner};
use fusedev::errno::Errno;
use meta::types::FileType;

/// Locks this node keeps in its table; over it, the least recently used of those of
/// files not open and not in use are given back (housekeeping). As large as the kernel
/// inodes a listing may leave cached (`PLUS_GIVEN_MAX`): at 65,536, `ls -l` of 100,000
/// files gave back the locks of the files it was about to stat, and took them again one
/// round trip each (267 s, benches/listing.sh). About 300 bytes each here, and one key
/// under the node's lease in etcd.
pub(crate) const LOCKS_MAX: usize = 1 << 18;
/// A holder unused this long gives way at once, whatever `--lock-min-hold-ms` says: the
/// minimum hold is for a node in the middle of using the file.
const IDLE_GIVES_WAY: Duration = Duration::from_millis(1);
/// How long a write that arrived inside the pages this node invalidates to give up a
/// shared lock tries to upgrade that lock (the invalidation may be waiting for its pages).
const INVAL_WAIT_MAX: Duration = Duration::from_secs(2);
/// How long an operation waits for another node to give a lock up before EIO. Longer
/// than a lease, so a dead holder's lock has expired by then.
pub(crate) const ACQUIRE_WAIT_MAX: Duration = Duration::from_secs(30);
/// How often a waiting operation asks again without a watch event.
pub(crate) const RECHECK: Duration = Duration::from_secs(1);
/// Files queued for the lock thread.
const JOBS_MAX: usize = 4096;
/// Page size the kernel invalidates in.
const PAGE: u64 = 4096;
/// Listing grants queued for the share thread ([`ShareAhead`]); past it, the listing
/// takes them itself when it reaches them.
const SHARE_AHEAD_QUEUE: usize = 16;

/// A byte range `[start, end)` of a file.
pub(crate) type Range = (u64, u64);

/// What the lock thread does for a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Job {
    /// Another node waits for the lock: give way.
    GiveWay(u64),
    /// Pages a release left out (an operation was waiting on them) or an O_APPEND write
    /// placed elsewhere than the kernel thought: invalidate them now.
    InvalStale(u64),
}

#[derive(Debug, Default)]
struct State {
    held: Option<LockMode>,
    /// The store revision the lock was granted at (0: not held).
    granted_rev: i64,
    granted_at: Option<Instant>,
    /// Operations holding it now ([`Hold`]s).
    users: u32,
    /// A release is under way: operations wait, except those let through.
    releasing: bool,
    /// Ranges the release is invalidating right now.
    inval: Vec<Range>,
    /// Operations let through inside `inval` (their ranges are invalidated again).
    let_through: Vec<Range>,
    /// Ranges of the READs and WRITEs waiting for the lock (their pages are locked).
    blocked: Vec<Range>,
    /// One operation is taking the lock from etcd; the others wait for its result.
    acquiring: bool,
    /// Just granted: what was cached before is being dropped and re-read; nobody uses
    /// the lock until that is done.
    refreshing: bool,
    /// Granted, but that refresh has not succeeded yet (etcd failed it): the next
    /// operation tries it again before using the lock.
    needs_refresh: bool,
    /// The strongest mode another node waits for.
    wanted: Option<LockMode>,
    /// Bumped when the watch sees the file's holders change.
    changed: u64,
    /// The holders as last known (from a refused acquire, kept current by the watch):
    /// what lets the next acquire commit in one round trip.
    known: Option<Known>,
    /// Pages to invalidate once the operations that were waiting on them have run.
    stale: Vec<Range>,
    /// When an operation last let the lock go.
    last_used: Option<Instant>,
    /// Threads in [`Entry::wait`] or [`Entry::wait_timeout`]: a hold let go wakes them only
    /// when there are some, because a wake is a system call even with nobody to wake, and
    /// every READ and WRITE lets a hold go (one futex call per 4 KiB read at QD 32, perf
    /// trace of the ring workers).
    waiters: u32,
}

#[derive(Debug)]
pub(crate) struct Entry {
    st: Mutex<State>,
    cv: Condvar,
    /// The lock thread's queue, cloned once per entry (not per operation: a core's fast
    /// path takes a hold on every READ and WRITE).
    jobs: Sender<Job>,
}

impl Entry {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait_timeout<'a>(&self, mut g: MutexGuard<'a, State>, d: Duration) -> MutexGuard<'a, State> {
        g.waiters += 1;
        let mut g = self
            .cv
            .wait_timeout(g, d)
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
        g.waiters -= 1;
        g
    }

    fn wait<'a>(&self, mut g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        g.waiters += 1;
        let mut g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        g.waiters -= 1;
        g
    }
}

/// An operation's use of a file's lock: the lock is not given up while it lives.
#[must_use]
pub(crate) struct Hold {
    entry: Arc<Entry>,
    ino: u64,
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut s = self.entry.lock();
        s.users -= 1;
        s.last_used = Some(Instant::now());
        let stale = s.users == 0 && !s.stale.is_empty() && !s.releasing;
        // A waiter counts itself under the mutex before it sleeps, so one that is not
        // counted here cannot have missed this change.
        let waiters = s.waiters > 0;
        drop(s);
        if waiters {
            self.entry.cv.notify_all();
        }
        if stale {
            let _ = self.entry.jobs.try_send(Job::InvalStale(self.ino));
        }
    }
}

/// The shared locks of a listing's next files, taken on the share thread while the
/// kernel consumes the files before them, or by the READDIRPLUS that reaches them first,
/// whichever comes first. A cold `ls -l` of 20,000 files waited 850 ms of its 1.5 s for
/// grants taken only when the listing reached them (strace of its getdents calls, then
/// benches/listing.sh).
pub(crate) struct ShareAhead {
    /// The grant, until someone starts it.
    work: Mutex<Option<ShareWork>>,
    granted: Mutex<bool>,
    cv: Condvar,
}

/// What a [`ShareAhead`] runs.
type ShareWork = Box<dyn FnOnce(&Inner) + Send>;

/// Marks a [`ShareAhead`] done even if its grant panics: a listing waits for it.
struct Granted<'a>(&'a ShareAhead);

impl Drop for Granted<'_> {
    fn drop(&mut self) {
        *self
            .0
            .granted
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = true;
        self.0.cv.notify_all();
    }
}

impl ShareAhead {
    /// Runs the grant unless someone else has started it; true if it did.
    fn run(&self, inner: &Inner) -> bool {
        let work = self
            .work
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(work) = work else { return false };
        let _done = Granted(self);
        work(inner);
        true
    }

    /// Returns once the files were granted (or refused): runs the grant here if the
    /// share thread has not started it.
    pub(super) fn finish(&self, inner: &Inner) {
        if self.run(inner) {
            return;
        }
        let mut g = self.granted.lock().unwrap_or_else(PoisonError::into_inner);
        if !*g {
            inner.caches.n.listing_grant_waits.fetch_add(1, Relaxed);
        }
        while !*g {
            g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// This node's cache locks.
pub(crate) struct LockTable {
    map: Mutex<HashMap<u64, Arc<Entry>>>,
    /// The current session's side in etcd (replaced when a fenced node registers again).
    etcd: Mutex<CacheLocks>,
    /// A grant counts only if its session's fence is still open when it is recorded.
    fence: Arc<meta::fence::Fence>,
    jobs: Sender<Job>,
    jobs_rx: Mutex<Option<Receiver<Job>>>,
    share: Sender<Arc<ShareAhead>>,
    share_rx: Mutex<Option<Receiver<Arc<ShareAhead>>>>,
    /// Creates of regular files in flight: each puts its file's lock in its own
    /// transaction, which this node records only once the create returns.
    creates: AtomicUsize,
    /// Keys of ours the watch saw put for files not held here (see [`LockTable::put_seen`]),
    /// with the revision of the put and when it was seen.
    strays: Mutex<HashMap<u64, (i64, Instant)>>,
    /// Puts of keys of ours left out of a full `strays` since housekeeping last said so.
    strays_left_out: AtomicUsize,
    /// How long a lock just granted is kept before giving way (`--lock-min-hold-ms`): a
    /// node taking turns with another on one file gets more done per turn instead of
    /// bouncing the lock on every operation (GFS2 holds a glock 200 ms by default), and
    /// a node gives way sooner only when it has not used the lock for `IDLE_GIVES_WAY`.
    min_hold: Duration,
}

/// Runs `job` for each job of `rx` until the filesystem stops (or `rx` is closed).
fn serve_jobs<T>(weak: &Weak<Inner>, rx: &Receiver<T>, mut job: impl FnMut(&Inner, T)) {
    loop {
        let j = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(j) => j,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => match weak.upgrade() {
                Some(i) if !i.stopping.load(std::sync::atomic::Ordering::Acquire) => continue,
                _ => return,
            },
            Err(_) => return,
        };
        let Some(i) = weak.upgrade() else { return };
        job(&i, j);
    }
}

fn covers(ranges: &[Range], r: Range) -> bool {
    ranges.iter().any(|&(s, e)| s < r.1 && r.0 < e)
}

/// A create of a regular file in flight (see [`LockTable::creating`]).
pub(crate) struct Creating<'a>(&'a AtomicUsize);

impl Drop for Creating<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

/// Unknown keys of ours remembered at once; more are left (and counted in the log).
const STRAYS_MAX: usize = 1024;
/// How long an unknown key waits for a moment with no create in flight before it is
/// left alone (logged): its node's lease ends it at the latest.
const STRAY_PATIENCE: Duration = Duration::from_secs(60);

/// The page-aligned cover of a byte range.
fn pages(r: Range) -> Range {
    (r.0 - r.0 % PAGE, r.1.saturating_add(PAGE - 1) / PAGE * PAGE)
}

/// `[0, ∞)` without the pages of `holes`, as ranges to invalidate.
pub(crate) fn around(holes: &[Range]) -> Vec<Range> {
    let mut h: Vec<Range> = holes.iter().map(|&r| pages(r)).collect();
    h.sort_unstable();
    let mut out = Vec::new();
    let mut at = 0u64;
    for (s, e) in h {
        if s > at {
            out.push((at, s));
        }
        at = at.max(e);
    }
    if at < u64::MAX {
        out.push((at, u64::MAX));
    }
    out
}

/// The `n` files of `idle` (last used, file) used longest ago, never used first. The
/// table's own order gave back locks a listing had just taken for the stats about to
/// follow it.
fn least_recent(mut idle: Vec<(Option<Instant>, u64)>, n: usize) -> Vec<u64> {
    if idle.len() > n {
        idle.select_nth_unstable(n);
        idle.truncate(n);
    }
    idle.into_iter().map(|(_, ino)| ino).collect()
}

/// Files granted in one transaction ([`CacheLocks::share_many`]): those with inodes
/// close together have their inodes and their extents read in two ranges, and a compare
/// per run of inode numbers without a lock of this node stands for two per file (a put
/// each: 126 fit in etcd's 128 operations); others two reads each and two compares (42
/// fit).
#[derive(Clone, Debug, PartialEq, Eq)]
struct GrantGroup {
    /// Indexes into the sorted inodes.
    files: std::ops::Range<usize>,
    /// The inodes and the extents are read as two ranges from the first file's to the
    /// last's.
    close: bool,
    /// Close: the inclusive runs of inode numbers, from file to file, in which this node
    /// holds no lock; together they cover the files.
    free: Vec<(u64, u64)>,
}

const GROUP_CLOSE_MAX: usize = 126;
const GROUP_APART_MAX: usize = 42;
/// Close: the inodes span at most this many numbers per file (so the range read holds
/// few other files' extents: a directory whose files were created together).
const CLOSE_SPAN_PER_FILE: u64 = 4;

/// Groups the sorted inodes of a listing for [`Inner::share_listed`]. `held(ino)`: this
/// node holds the lock of `ino`.
fn grant_groups(sorted: &[u64], held: impl Fn(u64) -> bool) -> Vec<GrantGroup> {
    let close = |files: &[u64]| {
        let span = files[files.len() - 1] - files[0];
        span < CLOSE_SPAN_PER_FILE * files.len() as u64
    };
    let mut groups = Vec::new();
    let mut at = 0;
    while at < sorted.len() {
        let left = sorted.len() - at;
        let dense = [GROUP_CLOSE_MAX, GROUP_CLOSE_MAX / 2]
            .into_iter()
            .map(|n| &sorted[at..at + left.min(n)])
            .find(|files| close(files));
        let group = match dense {
            Some(files) => GrantGroup {
                files: at..at + files.len(),
                close: true,
                free: free_runs(files, &held),
            },
            None => GrantGroup {
                files: at..at + left.min(GROUP_APART_MAX),
                close: false,
                free: Vec::new(),
            },
        };
        at = group.files.end;
        groups.push(group);
    }
    groups
}

/// The runs of `files` (sorted) with no inode `held` between neighbours, each as its first
/// and last file.
fn free_runs(files: &[u64], held: impl Fn(u64) -> bool) -> Vec<(u64, u64)> {
    let mut runs = Vec::new();
    let mut start = files[0];
    for pair in files.windows(2) {
        if (pair[0] + 1..pair[1]).any(&held) {
            runs.push((start, pair[0]));
            start = pair[1];
        }
    }
    runs.push((start, files[files.len() - 1]));
    runs
}

/// A range read of the inodes or the extents of `inos` (and of any file between them), as
/// one answer per file of `inos`. Files at or past the last key of an answer cut by its
/// limit are marked `more` (what is missing is read when used).
fn split_span(
    keys: &meta::keys::Keyspace,
    span: &RangeResponse,
    inos: &[Ino],
) -> HashMap<u64, RangeResponse> {
    let mut out: HashMap<u64, RangeResponse> = inos
        .iter()
        .map(|ino| {
            let r = RangeResponse {
                revision: span.revision,
                ..RangeResponse::default()
            };
            (ino.0, r)
        })
        .collect();
    let mut last = 0;
    for kv in &span.kvs {
        if let Some(meta::keys::KeyKind::Extent(ino, _) | meta::keys::KeyKind::Inode(ino)) =
            keys.parse(&kv.key)
        {
            if let Some(r) = out.get_mut(&ino.0) {
                r.kvs.push(kv.clone());
                r.count += 1;
            }
            last = last.max(ino.0);
        }
    }
    if span.more {
        for (_, r) in out.iter_mut().filter(|(&ino, _)| ino >= last) {
            r.more = true;
        }
    }
    out
}

/// Removes one instance of `r` from `v`.
fn remove_one(v: &mut Vec<Range>, r: Range) {
    if let Some(i) = v.iter().position(|&x| x == r) {
        v.swap_remove(i);
    }
}

impl LockTable {
    pub(crate) fn new(
        etcd: CacheLocks,
        fence: Arc<meta::fence::Fence>,
        min_hold: Duration,
    ) -> LockTable {
        let (tx, rx) = bounded(JOBS_MAX);
        let (share, share_rx) = bounded(SHARE_AHEAD_QUEUE);
        LockTable {
            map: Mutex::new(HashMap::new()),
            etcd: Mutex::new(etcd),
            fence,
            jobs: tx,
            jobs_rx: Mutex::new(Some(rx)),
            share,
            share_rx: Mutex::new(Some(share_rx)),
            creates: AtomicUsize::new(0),
            strays: Mutex::new(HashMap::new()),
            strays_left_out: AtomicUsize::new(0),
            min_hold,
        }
    }

    /// Counts a create of a regular file in flight until the guard drops (after
    /// [`LockTable::created`]).
    pub(crate) fn creating(&self) -> Creating<'_> {
        self.creates.fetch_add(1, SeqCst);
        Creating(&self.creates)
    }

    /// The watch saw our key of `ino` put at `rev`. A key this node does not know it
    /// holds is a grant that applied after the node stopped waiting for it: a resent
    /// request's abandoned first attempt arriving late (see `meta::patient`), after the
    /// resend's lock was used and released. Other nodes would wait for a release that
    /// never comes; [`Inner::drop_strays`] deletes it. The put of a create in flight is
    /// not recorded yet and looks the same: it is told apart there.
    pub(crate) fn put_seen(&self, ino: u64, rev: i64) {
        let unknown = self.get(ino).is_none_or(|e| {
            let s = e.lock();
            s.held.is_none() && !s.acquiring && !s.releasing && !s.refreshing
        });
        if !unknown {
            return;
        }
        let mut strays = self.strays.lock().unwrap_or_else(PoisonError::into_inner);
        if strays.len() < STRAYS_MAX {
            strays.insert(ino, (rev, Instant::now()));
        } else {
            self.strays_left_out.fetch_add(1, SeqCst);
        }
    }

    fn table(&self) -> MutexGuard<'_, HashMap<u64, Arc<Entry>>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn entry(&self, ino: u64) -> Arc<Entry> {
        self.table()
            .entry(ino)
            .or_insert_with(|| {
                Arc::new(Entry {
                    st: Mutex::default(),
                    cv: Condvar::new(),
                    jobs: self.jobs.clone(),
                })
            })
            .clone()
    }

    fn get(&self, ino: u64) -> Option<Arc<Entry>> {
        self.table().get(&ino).cloned()
    }

    /// The current session's handle on the locks in etcd.
    fn etcd(&self) -> CacheLocks {
        self.etcd
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// This node's session.
    pub(crate) fn me(&self) -> meta::types::SessionId {
        self.etcd().session()
    }

    /// The session's fence closed: nothing is held any more (the keys die with the
    /// lease). Waiters wake to find out. Returns the files whose locks were held.
    pub(crate) fn fence(&self) -> Vec<u64> {
        let entries: Vec<(u64, Arc<Entry>)> =
            self.table().iter().map(|(&i, e)| (i, e.clone())).collect();
        let mut held = Vec::new();
        for (ino, e) in entries {
            let mut s = e.lock();
            if s.held.take().is_some() {
                held.push(ino);
            }
            s.granted_rev = 0;
            s.granted_at = None;
            s.wanted = None;
            s.known = None;
            s.needs_refresh = false;
            s.stale.clear();
            drop(s);
            e.cv.notify_all();
        }
        held
    }

    /// A new session serves: locks are taken under it from now on.
    pub(crate) fn rejoin(&self, etcd: CacheLocks) {
        *self.etcd.lock().unwrap_or_else(PoisonError::into_inner) = etcd;
    }

    /// The mode held on `ino`, if any (not during a release).
    pub(crate) fn held(&self, ino: u64) -> Option<LockMode> {
        let e = self.get(ino)?;
        let s = e.st.try_lock().ok()?;
        if s.releasing {
            return None;
        }
        s.held
    }

    /// The revision `ino`'s lock was granted at, while it is held and not being given up
    /// (`None` too when its state is busy: callers fall back to etcd). A lock given up
    /// and taken again has a later one.
    pub(crate) fn granted_rev(&self, ino: u64) -> Option<i64> {
        let e = self.get(ino)?;
        let s = e.st.try_lock().ok()?;
        (!s.releasing && s.held.is_some() && s.granted_rev > 0).then_some(s.granted_rev)
    }

    /// Since when this node holds `ino`'s lock (`None`: not held, or being given up).
    pub(crate) fn held_since(&self, ino: u64) -> Option<Instant> {
        let e = self.get(ino)?;
        let s = e.st.try_lock().ok()?;
        if s.releasing || s.held.is_none() {
            return None;
        }
        s.granted_at
    }

    /// A hold for a core's fast path: only when `mode` is held and nothing is in the way;
    /// never blocks.
    pub(crate) fn try_hold(&self, ino: u64, mode: LockMode) -> Option<Hold> {
        let e = self.get(ino)?;
        let mut s = e.st.try_lock().ok()?;
        if s.releasing || s.held? < mode {
            return None;
        }
        s.users += 1;
        drop(s);
        Some(Hold { entry: e, ino })
    }

    /// Records a lock taken by a create's own transaction at `rev`, under `session`.
    pub(crate) fn created(&self, ino: u64, rev: i64, session: meta::types::SessionId) {
        let e = self.entry(ino);
        let mut s = e.lock();
        // Checked under the entry's lock, which `fence` takes too: a grant of a session
        // fenced meanwhile is never recorded after the fence cleared the table.
        if s.held.is_none() && self.fence.open_for(session) {
            s.held = Some(LockMode::Exclusive);
            s.granted_rev = rev;
            s.granted_at = Some(Instant::now());
        }
    }

    /// The watch saw another node ask for `ino` in `mode`: queue a release when we hold
    /// it in a conflicting mode.
    pub(crate) fn asked(&self, ino: u64, mode: LockMode) {
        let Some(e) = self.get(ino) else { return };
        let mut s = e.lock();
        match s.held {
            Some(h) if h.conflicts(mode) => {
                s.wanted = s.wanted.max(Some(mode));
                drop(s);
                if let Err(TrySendError::Full(_)) = self.jobs.try_send(Job::GiveWay(ino)) {
                    // The asker asks again each RECHECK; the queue will have room then.
                    log::warn!("lock queue full: inode {ino} given way later");
                }
            }
            _ => {}
        }
    }

    /// The watch saw `session`'s key of `ino` put with `mode` (`None`: deleted) at
    /// `rev`: what is known of the holders follows, and waiters try again.
    pub(crate) fn holders_changed(
        &self,
        ino: u64,
        rev: i64,
        session: meta::types::SessionId,
        mode: Option<Option<LockMode>>,
    ) {
        if let Some(e) = self.get(ino) {
            let mut s = e.lock();
            s.changed += 1;
            if let Some(k) = &mut s.known {
                k.apply(rev, session, mode);
            }
            drop(s);
            e.cv.notify_all();
        }
    }

    /// Forgets what is known of every file's holders (the watch missed events): the next
    /// acquires read them again.
    pub(crate) fn forget_known(&self) {
        for e in self.table().values() {
            e.lock().known = None;
        }
    }

    /// The watch saw our own key of `ino` deleted at `rev` by someone else (the file was
    /// deleted): nothing is held any more. True when it was.
    pub(crate) fn lost(&self, ino: u64, rev: i64) -> bool {
        let Some(e) = self.get(ino) else {
            return false;
        };
        let mut s = e.lock();
        if s.held.is_none() || s.releasing || rev <= s.granted_rev {
            return false;
        }
        s.held = None;
        s.granted_rev = 0;
        true
    }

    /// Files whose locks can go: held, unused, and not open here (`open`), beyond
    /// [`LOCKS_MAX`].
    pub(crate) fn over_bound(&self, open: impl Fn(u64) -> bool) -> Vec<u64> {
        let t = self.table();
        if t.len() <= LOCKS_MAX {
            return Vec::new();
        }
        let excess = t.len() - LOCKS_MAX;
        let idle: Vec<(Option<Instant>, u64)> = t
            .iter()
            .filter(|(&ino, _)| !open(ino))
            .filter_map(|(&ino, e)| {
                let s = e.st.try_lock().ok()?;
                (s.users == 0 && !s.releasing && !s.acquiring)
                    .then(|| (s.last_used.or(s.granted_at), ino))
            })
            .collect();
        least_recent(idle, excess)
    }

    /// Drops table entries that hold nothing and nobody uses.
    fn prune(&self, ino: u64) {
        let mut t = self.table();
        if let Some(e) = t.get(&ino) {
            if Arc::strong_count(e) == 1
                && e.st.try_lock().is_ok_and(|s| {
                    s.held.is_none() && s.users == 0 && !s.acquiring && s.blocked.is_empty()
                })
            {
                t.remove(&ino);
            }
        }
    }

    /// `ino`'s entry, marked as being taken, when nothing is held, taken or given up:
    /// for a grant of many files at once ([`Inner::share_listed`]).
    fn claim_unheld(&self, ino: u64) -> Option<Arc<Entry>> {
        let e = self.entry(ino);
        let mut s = e.lock();
        if s.held.is_some() || s.acquiring || s.releasing || s.refreshing {
            return None;
        }
        s.acquiring = true;
        drop(s);
        Some(e)
    }

    /// Counters for `etcfs stats`.
    pub(crate) fn len(&self) -> usize {
        self.table().len()
    }
}

impl Inner {
    /// Holds `ino`'s lock in at least `mode` for one operation, taking it from etcd (and
    /// waiting for other nodes to give way) when this node does not hold it. `range`: the
    /// bytes a buffered READ or WRITE covers (its pages are locked in the kernel while it
    /// waits), `None` for other operations. Never call it on a core.
    pub(super) fn hold(
        &self,
        ino: u64,
        mode: LockMode,
        range: Option<Range>,
    ) -> Result<Hold, Errno> {
        let t = &self.locks;
        let e = t.entry(ino);
        let deadline = Instant::now() + ACQUIRE_WAIT_MAX;
        let mut upgrading: Option<Instant> = None;
        let mut s = e.lock();
        let hold = |s: &mut State| {
            s.users += 1;
            Hold {
                entry: e.clone(),
                ino,
            }
        };
        let session = self.op_session();
        loop {
            if !self.locks.fence.open_for(session) {
                // Begun under a session that is gone (or going): nothing it does may
                // count on a lock.
                return Err(Errno::EIO);
            }
            if s.releasing {
                let in_inval = range.is_some_and(|r| covers(&s.inval, r));
                if in_inval && s.held.is_some_and(|h| h >= mode) {
                    s.let_through.extend(range);
                    return Ok(hold(&mut s));
                }
                // A WRITE while this node gives up a shared lock: it may not run under it
                // (found by benches/handoff.sh, whose appenders lost records when one
                // did), and the invalidation may be waiting for its pages, so the release
                // cannot finish before it does. It upgrades the lock, still ours, to
                // exclusive instead, and runs; the release then goes on with an exclusive
                // lock: writes back, then deletes the key. Waiting here for the release
                // had to end in EIO (tests/cluster.rs: an O_APPEND writer got EIO in CI).
                if !(in_inval && mode == LockMode::Exclusive) {
                    s = self.wait_blocked(&e, s, range, RECHECK);
                    continue;
                }
                // Bounded: two nodes giving up their shared locks of a file, each with
                // such a write of its own, wait for each other for good (seen 1 run in 90
                // of tests/cluster.rs's three appending nodes under load: both writes got
                // EIO). Only answering the write frees its pages, so the release can
                // finish: EINTR, as for a write interrupted before it wrote anything,
                // which it is (the kernel drops the pages it filled and leaves the size),
                // and a caller that retries, as write loops do on EINTR, then waits for the
                // lock like any other write.
                let since = *upgrading.get_or_insert_with(Instant::now);
                if since.elapsed() >= INVAL_WAIT_MAX {
                    drop(s);
                    let _ = self
                        .with_locks(move |l| Box::pin(async move { l.withdraw(Ino(ino)).await }));
                    self.caches
                        .n
                        .cache_lock_writes_interrupted
                        .fetch_add(1, Relaxed);
                    log::warn!(
                        "inode {ino}: a write arrived while this node gave up its shared lock \
                         and could not take it exclusive in {} ms (another node waits for \
                         this one the same way); answering EINTR, nothing written",
                        INVAL_WAIT_MAX.as_millis()
                    );
                    return Err(Errno::EINTR);
                }
            }
            if s.refreshing {
                s = self.wait_blocked(&e, s, range, RECHECK);
                continue;
            }
            if s.held.is_some_and(|h| h >= mode) {
                if s.needs_refresh {
                    s = self.refresh_under(&e, s, ino, None)?;
                }
                return Ok(hold(&mut s));
            }
            if s.acquiring {
                s = self.wait_blocked(&e, s, range, RECHECK);
                continue;
            }
            if Instant::now() >= deadline {
                drop(s);
                let _ =
                    self.with_locks(move |l| Box::pin(async move { l.withdraw(Ino(ino)).await }));
                log::warn!(
                    "inode {ino}: another node did not give its lock up in {} s",
                    ACQUIRE_WAIT_MAX.as_secs()
                );
                return Err(Errno::EIO);
            }
            s.acquiring = true;
            let seen = s.changed;
            let was_held = s.held.is_some();
            let known = s.known.clone();
            drop(s);
            // The attributes come with the grant: a fresh lock needs them anyway.
            let attr_key = (!was_held).then(|| self.meta.keys().inode(Ino(ino)));
            let l = self.locks.etcd();
            let granted_to = l.session();
            let r = super::run_read(&self.meta, move |_, _| {
                Box::pin(async move { l.acquire(Ino(ino), mode, known, attr_key).await })
            });
            s = e.lock();
            s.acquiring = false;
            e.cv.notify_all();
            match r {
                // A grant under a session fenced meanwhile is worth nothing (and its key
                // goes with the lease); checked under the entry's lock, as `fence` clears.
                Ok(Acquired::Granted { .. }) if !self.locks.fence.open_for(granted_to) => {
                    return Err(Errno::EIO);
                }
                Ok(Acquired::Granted { revision, extra }) => {
                    log::debug!("inode {ino}: granted {mode:?} at {revision}");
                    s.held = Some(mode.max(s.held.unwrap_or(mode)));
                    s.granted_rev = revision;
                    s.granted_at = Some(Instant::now());
                    s.known = None;
                    self.caches.n.cache_locks_taken.fetch_add(1, Relaxed);
                    if !was_held {
                        // Before anyone uses the lock (found by tests/cluster.rs: a
                        // GETATTR let in beside the READ that took the lock answered the
                        // size cached before it).
                        s.needs_refresh = true;
                        s = self.refresh_under(&e, s, ino, extra.map(|kv| (kv, revision)))?;
                    }
                    if s.releasing {
                        self.caches
                            .n
                            .cache_locks_upgraded_in_release
                            .fetch_add(1, Relaxed);
                        log::debug!("inode {ino}: upgraded to exclusive while giving it up");
                        // An upgrade during a release: let through only inside what is
                        // being invalidated, like any other operation.
                        continue;
                    }
                    return Ok(hold(&mut s));
                }
                Ok(Acquired::Busy { holders, known }) => {
                    s.known = Some(known);
                    log::debug!("inode {ino}: waiting for {holders:?} to give way ({mode:?})");
                    self.caches.n.cache_lock_waits.fetch_add(1, Relaxed);
                    if s.changed == seen {
                        s = self.wait_blocked(&e, s, range, RECHECK);
                    }
                }
                Err(err) => return Err(errno::meta(&err)),
            }
        }
    }

    /// Takes the shared locks of listed regular files this node does not hold, with
    /// their attributes and extent maps read in the same etcd transactions
    /// ([`CacheLocks::share_many`]), so that the attributes a READDIRPLUS returns may
    /// stay in the kernel: `ls -l` then stats each file without a request. Each GETATTR
    /// taking its file's lock alone was most of a cold `ls -l` (a round trip per file).
    /// Files another node writes, and any a grant misses, are left to their own
    /// operations. Never call it on a core.
    pub(super) fn share_listed(&self, inos: &[u64]) {
        // Not bounded by `LOCKS_MAX`: the stats that follow a listing take these locks
        // anyway, one round trip each, and housekeeping gives back what is over the bound
        // either way (stopping at half the bound made `ls -l` of 100,000 files send 46,000
        // GETATTRs past it: benches/listing.sh).
        let mut claimed: Vec<(u64, Arc<Entry>)> = inos
            .iter()
            .filter(|&&ino| self.files.get(ino).is_none())
            .filter_map(|&ino| self.locks.claim_unheld(ino).map(|e| (ino, e)))
            .collect();
        claimed.sort_unstable_by_key(|(ino, _)| *ino);
        let l = self.locks.etcd();
        let session = l.session();
        let keys = self.meta.keys().clone();
        let limit = i64::try_from(super::files::EXTENTS_CACHED_MAX).unwrap_or(i64::MAX);
        let sorted: Vec<u64> = claimed.iter().map(|(ino, _)| *ino).collect();
        // Each group's inodes, and whether their inodes and extents are read as ranges.
        let held = |ino: u64| self.locks.held(ino).is_some();
        let chunks: Vec<(GrantGroup, Vec<Ino>)> = grant_groups(&sorted, held)
            .into_iter()
            .map(|g| {
                let inos = sorted[g.files.clone()].iter().map(|&i| Ino(i)).collect();
                (g, inos)
            })
            .collect();
        let tickets: Vec<_> = chunks
            .iter()
            .map(|(group, chunk)| {
                let close = group.close;
                let free: Vec<(Ino, Ino)> =
                    group.free.iter().map(|&(a, b)| (Ino(a), Ino(b))).collect();
                let ask: Vec<(Ino, Vec<RangeRequest>)> = chunk
                    .iter()
                    .map(|&ino| {
                        let mut reads = Vec::new();
                        if !close {
                            let e = keys.extents(ino);
                            reads.push(RangeRequest::key(keys.inode(ino)));
                            reads.push(RangeRequest::range(e.start, e.end).limit(limit));
                        }
                        (ino, reads)
                    })
                    .collect();
                // One range for the inodes of files created together, not a read each:
                // 17% fewer etcd operations in a cold `ls -l` (benches/listing_cost.sh).
                let shared: Vec<RangeRequest> = match (close, chunk.first(), chunk.last()) {
                    (true, Some(&first), Some(&last)) => {
                        let past = Ino(last.0.saturating_add(1));
                        let span = i64::try_from(past.0 - first.0).unwrap_or(i64::MAX);
                        vec![
                            RangeRequest::range(keys.inode(first), keys.inode(past)).limit(span),
                            RangeRequest::range(keys.extents(first).start, keys.extents(last).end)
                                .limit(limit),
                        ]
                    }
                    _ => Vec::new(),
                };
                let l = l.clone();
                self.meta.read(move |_, _| {
                    Box::pin(async move { l.share_many(&ask, &shared, &free).await })
                })
            })
            .collect();
        let mut granted: HashMap<u64, (i64, Vec<RangeResponse>)> = HashMap::new();
        for (t, (_, chunk)) in tickets.into_iter().zip(chunks) {
            match t.and_then(|t| t.wait()) {
                Ok(Some(g)) => {
                    let rev = g.revision;
                    // In the order `fill_granted` reads them: the inode, the extents.
                    let mut spans: Vec<_> = g
                        .shared
                        .iter()
                        .map(|span| split_span(&keys, span, &chunk))
                        .collect();
                    granted.extend(g.granted.into_iter().map(|(i, mut r)| {
                        r.extend(spans.iter_mut().filter_map(|split| split.remove(&i.0)));
                        (i.0, (rev, r))
                    }));
                }
                Ok(None) => {}
                Err(e) => {
                    // The grant may have applied with its answer lost: a key of ours the
                    // table does not know would make another node wait for a release
                    // that never comes. Deleted before the entries are let go.
                    log::debug!("shared locks of a listing not taken: {e}");
                    let l = l.clone();
                    let undo = self
                        .meta
                        .read(move |_, _| Box::pin(async move { l.unshare_many(&chunk).await }));
                    if let Err(e) = undo.and_then(|t| t.wait()) {
                        log::warn!("shared locks of a listing may be left in etcd: {e}");
                    }
                }
            }
        }
        for (ino, e) in claimed {
            let mut s = e.lock();
            s.acquiring = false;
            let grant = granted.remove(&ino);
            // Recorded only under a session still open, checked under the entry's lock
            // as `fence` clears (as for any grant).
            if let Some((rev, answers)) = grant.filter(|_| self.locks.fence.open_for(session)) {
                s.held = Some(LockMode::Shared);
                s.granted_rev = rev;
                s.granted_at = Some(Instant::now());
                s.known = None;
                // What was cached before the lock may predate another node's writes.
                self.caches.forget_attr(ino);
                self.caches.forget_blocks(ino);
                // The map read at the grant is current while the lock is held: nobody
                // changes a file's extents without taking it from us first. So it is
                // cached under the generation as it is now, after the forget.
                let gen = self.caches.blocks_gen();
                self.fill_granted(ino, rev, gen, &answers);
                self.caches.n.cache_locks_taken.fetch_add(1, Relaxed);
                drop(s);
                e.cv.notify_all();
            } else {
                drop(s);
                e.cv.notify_all();
                drop(e);
                self.locks.prune(ino);
            }
        }
    }

    /// [`Inner::share_listed`] of `inos` on the share thread; `None` when its queue is
    /// full (the caller grants them itself when it needs them).
    pub(super) fn share_listed_later(&self, inos: Vec<u64>) -> Option<Arc<ShareAhead>> {
        self.share_later(Box::new(move |i: &Inner| i.share_listed(&inos)))
    }

    /// `work` (taking locks ahead of a walk) on the share thread; `None` when its queue
    /// is full.
    pub(super) fn share_later(&self, work: ShareWork) -> Option<Arc<ShareAhead>> {
        let job = Arc::new(ShareAhead {
            work: Mutex::new(Some(work)),
            granted: Mutex::new(false),
            cv: Condvar::new(),
        });
        self.locks.share.try_send(job.clone()).ok()?;
        Some(job)
    }

    /// Caches a file's attributes and block count as read by its grant.
    fn fill_granted(&self, ino: u64, rev: i64, gen: u64, answers: &[RangeResponse]) {
        let keys = self.meta.keys();
        let [inode, extents] = answers else { return };
        let attr = inode.kvs.first().and_then(|kv| {
            meta::codec::decode_at::<meta::codec::InodeAttr>(keys, &kv.key, &kv.value).ok()
        });
        let Some(a) = attr else { return };
        self.caches.fill_attr(&a, rev);
        if extents.more {
            return;
        }
        let list: Result<Vec<_>, _> = extents
            .kvs
            .iter()
            .map(|kv| meta::reader::decode_extent(keys, kv))
            .collect();
        if let Ok(list) = list {
            self.caches
                .fill_blocks(ino, super::extent_blocks(&list), gen);
        }
    }

    /// [`Inner::refresh_file`] with the entry marked refreshing (nobody uses the lock
    /// meanwhile); `needs_refresh` stays set if it fails, for the next operation.
    fn refresh_under<'a>(
        &self,
        e: &'a Entry,
        mut s: MutexGuard<'a, State>,
        ino: u64,
        granted: Option<(meta::kv::KeyValue, i64)>,
    ) -> Result<MutexGuard<'a, State>, Errno> {
        s.refreshing = true;
        drop(s);
        let r = self.refresh_file(ino, granted);
        let mut s = e.lock();
        s.refreshing = false;
        if r.is_ok() {
            s.needs_refresh = false;
        }
        e.cv.notify_all();
        r.map(|()| s)
    }

    /// Waits on `e` (at most `d`), with `range` listed as blocked meanwhile.
    fn wait_blocked<'a>(
        &self,
        e: &'a Entry,
        mut s: MutexGuard<'a, State>,
        range: Option<Range>,
        d: Duration,
    ) -> MutexGuard<'a, State> {
        if let Some(r) = range {
            s.blocked.push(r);
        }
        let mut s = e.wait_timeout(s, d);
        if let Some(r) = range {
            remove_one(&mut s.blocked, r);
        }
        s
    }

    /// Runs a cache-lock call of the current session on the pipeline's runtime.
    fn with_locks<T: Send + 'static>(
        &self,
        f: impl FnOnce(
                CacheLocks,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<T, MetaError>> + Send>,
            > + Send
            + 'static,
    ) -> Result<T, MetaError> {
        let l = self.locks.etcd();
        super::run_read(&self.meta, move |_, _| f(l))
    }

    /// After taking a lock: the attributes, block count and extent map cached before it
    /// may predate another node's writes. `granted`: the inode as read by the grant, at
    /// the grant's revision.
    fn refresh_file(
        &self,
        ino: u64,
        granted: Option<(meta::kv::KeyValue, i64)>,
    ) -> Result<(), Errno> {
        self.caches.forget_attr(ino);
        self.caches.forget_blocks(ino);
        if let Some(st) = self.files.get(ino) {
            let (attr, rev) = match granted {
                Some((kv, rev)) => {
                    let a = meta::codec::decode_at::<meta::codec::InodeAttr>(
                        self.meta.keys(),
                        &kv.key,
                        &kv.value,
                    )
                    .map_err(|e| errno::meta(&e))?;
                    (a, rev)
                }
                None => self.get_attr_at(ino)?,
            };
            let mut f = st.lock();
            f.set_attr(&attr, rev);
            f.forget_extents();
        }
        Ok(())
    }

    /// Starts the lock thread, which gives locks up for other nodes, the thread it passes
    /// stale pages to, and the share thread, which takes listings' locks ahead of them.
    pub(super) fn start_lock_thread(self: &Arc<Self>) -> std::io::Result<JoinHandle<()>> {
        let rx = super::lock(&self.locks.jobs_rx)
            .take()
            .expect("one lock thread per filesystem");
        let share_rx = super::lock(&self.locks.share_rx)
            .take()
            .expect("one share thread per filesystem");
        let weak = Arc::downgrade(self);
        let share = std::thread::Builder::new()
            .name("etcfs-share".into())
            .spawn({
                let weak = weak.clone();
                move || {
                    serve_jobs(&weak, &share_rx, |i, job| {
                        if job.run(i) {
                            i.caches.n.listing_grants_ahead.fetch_add(1, Relaxed);
                        }
                    })
                }
            })?;
        // Stale pages are invalidated on a thread of their own: the page an O_APPEND write
        // left stale is where the node's next append locks its pages before it asks for
        // the lock, so that invalidation can wait for a write that waits for another node
        // to give way, while that node waits for this one to give way (found by
        // tests/cluster.rs, two nodes each reading before appending: both lock threads
        // stuck in the kernel's page invalidation, both writes waiting 30 s).
        let (stale_tx, stale_rx) = bounded::<u64>(JOBS_MAX);
        let stale = std::thread::Builder::new()
            .name("etcfs-stale".into())
            .spawn({
                let weak = weak.clone();
                move || serve_jobs(&weak, &stale_rx, |i, ino| i.inval_stale(ino))
            })?;
        // Recalls of fcntl-lock delegations: etcd round trips the watch must not wait for.
        let recall = match self.plocks.take_recalls() {
            Some(rx) => Some(
                std::thread::Builder::new()
                    .name("etcfs-recall".into())
                    .spawn({
                        let weak = weak.clone();
                        move || serve_jobs(&weak, &rx, |i, ino| i.return_delegation(ino, true))
                    })?,
            ),
            None => None,
        };
        std::thread::Builder::new()
            .name("etcfs-locks".into())
            .spawn(move || {
                serve_jobs(&weak, &rx, move |i, job| match job {
                    Job::GiveWay(ino) => i.give_way(ino),
                    Job::InvalStale(ino) => {
                        let _ = stale_tx.try_send(ino);
                    }
                });
                let _ = stale.join();
                let _ = share.join();
                if let Some(r) = recall {
                    let _ = r.join();
                }
            })
    }

    /// Queues `job` for the lock thread.
    pub(super) fn lock_job(&self, job: Job) {
        let _ = self.locks.jobs.try_send(job);
    }

    /// Gives `ino`'s lock up (or downgrades it) for the node that asked: see the module
    /// docs for the order of things.
    pub(super) fn give_way(&self, ino: u64) {
        let Some(e) = self.locks.get(ino) else { return };
        // The session whose lock this is: a release that outlives it (fenced, and a new
        // session registered meanwhile) must not touch the new session's key.
        let etcd = self.locks.etcd();
        let mut s = e.lock();
        let (Some(held), Some(want)) = (s.held, s.wanted.take()) else {
            return;
        };
        if !held.conflicts(want) || s.releasing {
            return;
        }
        // Kept while this node is using it, up to the minimum hold after the grant: a
        // node working on the file gets a turn's worth done; an idle one gives way at once.
        if let Some(t) = s.granted_at {
            let until = t + self.locks.min_hold;
            loop {
                let now = Instant::now();
                let idle = s.users == 0 && s.last_used.is_none_or(|u| now >= u + IDLE_GIVES_WAY);
                if now >= until || idle {
                    break;
                }
                drop(s);
                std::thread::sleep((until - now).min(IDLE_GIVES_WAY / 4));
                s = e.lock();
                if s.held != Some(held) {
                    return;
                }
            }
        }
        // Never beside an acquire in flight: one that started while the lock was held
        // would skip dropping what was cached, although another node may write between
        // this release and its grant (found by tests/cluster.rs: three nodes appending
        // lost a few records, written at an EOF read before another node's append).
        while s.acquiring || s.refreshing {
            s = e.wait(s);
        }
        if s.held != Some(held) {
            return;
        }
        let downgrade = held == LockMode::Exclusive && want == LockMode::Shared;
        log::debug!("inode {ino}: giving way to {want:?} (held {held:?})");
        s.releasing = true;
        while s.users > 0 {
            s = e.wait(s);
        }
        drop(s);
        let give_back = |e: &Entry, wanted: LockMode| {
            let mut s = e.lock();
            s.releasing = false;
            s.wanted = s.wanted.max(Some(wanted));
            drop(s);
            e.cv.notify_all();
        };
        // Not giving it up when this fails: what is written behind would be lost to the
        // asker. The release is tried again later.
        let written_back = || match self.write_back(ino) {
            Ok(()) => true,
            Err(err) => {
                log::warn!("inode {ino}: keeping the lock, writing back failed: {err}");
                give_back(&e, want);
                std::thread::sleep(RECHECK);
                self.lock_job(Job::GiveWay(ino));
                false
            }
        };
        if held == LockMode::Exclusive {
            if !written_back() {
                return;
            }
        } else {
            self.wait_file_io(ino);
        }
        if downgrade {
            let l = etcd.clone();
            match super::run_read(&self.meta, move |_, _| {
                Box::pin(async move { l.downgrade(Ino(ino)).await })
            }) {
                Ok(()) => {
                    let mut s = e.lock();
                    s.held = Some(LockMode::Shared);
                    s.releasing = false;
                    drop(s);
                    e.cv.notify_all();
                    self.caches.n.cache_locks_downgraded.fetch_add(1, Relaxed);
                }
                Err(err) => {
                    log::warn!("inode {ino}: downgrading its lock: {err}");
                    give_back(&e, want);
                }
            }
            return;
        }
        let left_out = self.invalidate_for_release(&e, ino);
        // A WRITE let in to upgrade may still be taking the lock exclusive. Deleting our
        // key beside its put could land after it in etcd: the write would then run as an
        // exclusive holder whose key is gone, beside the asker's exclusive grant, and two
        // nodes appended at one offset (tests/cluster.rs lost one O_APPEND record in CI).
        // Its grant, once in, finds the release under way and waits for it to end.
        let mut s = e.lock();
        while s.acquiring {
            s = e.wait(s);
        }
        // Upgraded meanwhile by a WRITE the invalidation waited for: what it wrote goes to
        // etcd and the device before the lock goes.
        let upgraded = held == LockMode::Shared && s.held == Some(LockMode::Exclusive);
        drop(s);
        if upgraded && !written_back() {
            return;
        }

        self.caches.forget_attr(ino);
        self.caches.forget_blocks(ino);
        self.files.forget_extents(ino);
        let l = etcd;
        match super::run_read(&self.meta, move |_, _| {
            Box::pin(async move { l.release(Ino(ino)).await })
        }) {
            Ok(()) => {
                let mut s = e.lock();
                s.held = None;
                s.granted_rev = 0;
                s.granted_at = None;
                s.releasing = false;
                s.stale.extend(left_out);
                drop(s);
                e.cv.notify_all();
                self.caches.n.cache_locks_released.fetch_add(1, Relaxed);
                self.locks.prune(ino);
            }
            Err(err) => {
                // Still ours in etcd; the caches are dropped, which is always allowed.
                log::warn!("inode {ino}: releasing its lock: {err}");
                give_back(&e, want);
            }
        }
    }

    /// The kernel drops the file's pages and attributes, around the pages of operations
    /// waiting for the lock; returns those left out. Holds `releasing` throughout.
    fn invalidate_for_release(&self, e: &Entry, ino: u64) -> Vec<Range> {
        let blocked: Vec<Range> = e.lock().blocked.clone();
        let mut ranges = around(&blocked);
        loop {
            {
                let mut s = e.lock();
                s.inval.clone_from(&ranges);
                s.let_through.clear();
            }
            // A waiting READ or WRITE inside these ranges must be let through now: the
            // invalidation may need its pages.
            e.cv.notify_all();
            self.kernel_inval(ino, &ranges);
            let mut s = e.lock();
            s.inval.clear();
            ranges = std::mem::take(&mut s.let_through);
            while s.users > 0 {
                s = e.wait(s);
            }
            drop(s);
            if ranges.is_empty() {
                break;
            }
            ranges = ranges.into_iter().map(pages).collect();
            // Exclusive also when a WRITE let through upgraded a shared lock.
            if e.lock().held == Some(LockMode::Exclusive) {
                if let Err(err) = self.write_back(ino) {
                    log::warn!("inode {ino}: writing back before giving its lock up: {err}");
                }
            }
        }
        // Pages of operations waiting now were left out too (those that came after the
        // first invalidation and were not inside a later one).
        let now: Vec<Range> = e.lock().blocked.clone();
        blocked.into_iter().chain(now).map(pages).collect()
    }

    /// INVAL_INODE of `ranges` (an end of `u64::MAX`: to the end of the file).
    fn kernel_inval(&self, ino: u64, ranges: &[Range]) {
        let Some(n) = super::lock(&self.notifier)
            .clone()
            .or_else(|| super::PROCESS_NOTIFIER.get().cloned())
        else {
            return;
        };
        for &(s, e) in ranges {
            let off = i64::try_from(s).unwrap_or(i64::MAX);
            let len = if e == u64::MAX {
                0
            } else {
                i64::try_from(e - s).unwrap_or(0)
            };
            self.caches.n.kernel_inval_data.fetch_add(1, Relaxed);
            if let Err(err) = n.inval_inode(ino, off, len) {
                log::debug!("kernel invalidation of inode {ino} [{s}, {e}): {err}");
            }
        }
    }

    /// Invalidates pages a release left out, once nobody waits on them.
    fn inval_stale(&self, ino: u64) {
        let Some(e) = self.locks.get(ino) else { return };
        let mut s = e.lock();
        if s.releasing || s.held.is_none() {
            return;
        }
        let stale = std::mem::take(&mut s.stale);
        drop(s);
        self.kernel_inval(ino, &stale);
    }

    /// An exclusive holder's writes reach etcd and the device: pending extents and size,
    /// the mtime of overwrites, and no device I/O of the file still in flight.
    fn write_back(&self, ino: u64) -> Result<(), Errno> {
        // Under the file's lock, whatever the dirty set says: the set is a hint for the
        // age trigger, and a lock must never go with a pending change.
        if let Some(st) = self.files.get(ino) {
            let mut f = st.lock();
            let outs = self.commit_pending_locked(&st, &mut f)?;
            drop(f);
            outs.iter().for_each(|o| self.after_commit_unlocked(o));
        }
        self.flush_mtime(ino);
        self.wait_file_io(ino);
        Ok(())
    }

    fn wait_file_io(&self, ino: u64) {
        if let Some(st) = self.files.get(ino) {
            let f = st.lock();
            st.wait_io(&f);
        }
    }

    /// Pages of `ino` the kernel holds wrongly (an O_APPEND write it placed elsewhere):
    /// invalidated once the operation in progress is over.
    pub(super) fn lock_stale(&self, ino: u64, range: Range) {
        self.locks.entry(ino).lock().stale.push(pages(range));
    }

    /// A hold of `ino`'s lock when it is a regular file (other types have none).
    pub(super) fn hold_regular(&self, ino: u64, mode: LockMode) -> Result<Option<Hold>, Errno> {
        let kind = if self.files.get(ino).is_some() {
            FileType::Regular
        } else {
            self.cached_attr(ino)?.kind
        };
        if kind != FileType::Regular {
            return Ok(None);
        }
        self.hold(ino, mode, None).map(Some)
    }

    /// Deletes the unknown keys of ours the watch saw put (see [`LockTable::put_seen`]),
    /// each compared on the revision of that put, so a grant made since stays. Only
    /// with no create in flight: a create's key is put by its transaction before it is
    /// recorded here, and a create that started after the put cannot be the one that made
    /// it (the watch saw it first). Ones a create could still own wait for the next call.
    pub(super) fn drop_strays(&self) {
        let left_out = self.locks.strays_left_out.swap(0, SeqCst);
        if left_out > 0 {
            log::warn!(
                "{left_out} unknown locks of ours in etcd not looked at: more than {STRAYS_MAX} \
                 at once; other nodes wait for any that are strays until this node's lease ends"
            );
        }
        let due: Vec<(u64, i64, Instant)> = {
            let strays = super::lock(&self.locks.strays);
            if strays.is_empty() {
                return;
            }
            strays.iter().map(|(&i, &(r, t))| (i, r, t)).collect()
        };
        // The watch sees a create's key before the create records it; once it is recorded
        // (held here) it is no stray, creates in flight or not. Without this, a steady
        // create load (100,000 files from one loop) kept the table full of its own keys,
        // waiting for a moment with no create in flight, and left real strays out.
        let (recorded, due): (Vec<_>, Vec<_>) = due
            .into_iter()
            .partition(|&(ino, _, _)| self.locks.held(ino).is_some());
        if !recorded.is_empty() {
            let mut strays = super::lock(&self.locks.strays);
            for (ino, rev, _) in recorded {
                // Only the put looked at: a later one is looked at next time.
                if strays.get(&ino).is_some_and(|&(r, _)| r == rev) {
                    strays.remove(&ino);
                }
            }
        }
        for (ino, rev, seen) in due {
            if self.locks.creates.load(SeqCst) > 0 {
                if seen.elapsed() > STRAY_PATIENCE {
                    log::warn!(
                        "inode {ino}: a lock of ours in etcd this node does not hold stays \
                         (creates kept running); other nodes wait for it until the lease ends"
                    );
                    super::lock(&self.locks.strays).remove(&ino);
                }
                continue;
            }
            super::lock(&self.locks.strays).remove(&ino);
            // Looked at again next time unless this node holds it by now or the delete is
            // decided: forgotten on a passing error or a busy entry, the key stayed, and
            // other nodes waited for it until the lease ended (the unit test of late
            // grants failed twice that way with every unit test running at once).
            let retry = || {
                let mut strays = super::lock(&self.locks.strays);
                if self.locks.held(ino).is_none() && strays.len() < STRAYS_MAX {
                    strays.entry(ino).or_insert((rev, seen));
                }
            };
            // Marked as being taken while the key goes, so no acquire overlaps it.
            let Some(e) = self.locks.claim_unheld(ino) else {
                retry();
                continue;
            };
            let l = self.locks.etcd();
            let r = super::run_read(&self.meta, move |_, _| {
                Box::pin(async move { l.drop_stray(Ino(ino), rev).await })
            });
            match r {
                Ok(true) => {
                    log::info!("inode {ino}: deleted a lock of ours granted after its wait ended");
                    self.caches.n.cache_locks_strays.fetch_add(1, Relaxed);
                }
                Ok(false) => {}
                Err(err) => {
                    log::warn!("inode {ino}: deleting an unknown lock of ours: {err}");
                    retry();
                }
            }
            e.lock().acquiring = false;
            e.cv.notify_all();
            drop(e);
            self.locks.prune(ino);
        }
    }

    /// Remembers `ino` as the watch does an unknown key of ours put at `rev`, and
    /// returns how many are remembered.
    #[cfg(test)]
    pub(super) fn remember_stray(&self, ino: u64, rev: i64) -> usize {
        let mut strays = super::lock(&self.locks.strays);
        strays.insert(ino, (rev, Instant::now()));
        strays.len()
    }

    /// Unknown keys of ours remembered.
    #[cfg(test)]
    pub(super) fn strays_remembered(&self) -> usize {
        super::lock(&self.locks.strays).len()
    }

    /// Gives `ino`'s lock up as if another node asked for it exclusively.
    #[cfg(test)]
    pub(super) fn give_up(&self, ino: u64) {
        if let Some(e) = self.locks.get(ino) {
            e.lock().wanted = Some(LockMode::Exclusive);
        }
        self.give_way(ino);
    }

    /// Marks `ino`'s lock as being given up, with `inval` being invalidated, as the lock
    /// thread does while the kernel drops the file's pages (`false`: that is over).
    #[cfg(test)]
    pub(super) fn pretend_releasing(&self, ino: u64, inval: Option<Range>) {
        let e = self.locks.entry(ino);
        let mut s = e.lock();
        s.releasing = inval.is_some();
        s.inval = inval.into_iter().collect();
        drop(s);
        e.cv.notify_all();
    }

    /// Marks `ino`'s lock as being taken (`true`) by an operation, as [`Inner::hold`] does
    /// while its etcd request is in flight, or that request as over (`false`).
    #[cfg(test)]
    pub(super) fn pretend_acquiring(&self, ino: u64, acquiring: bool) {
        let e = self.locks.entry(ino);
        e.lock().acquiring = acquiring;
        e.cv.notify_all();
    }

    /// Whether `ino`'s lock is being given up now.
    #[cfg(test)]
    pub(super) fn lock_releasing(&self, ino: u64) -> bool {
        self.locks.get(ino).is_some_and(|e| e.lock().releasing)
    }

    /// Gives back the locks over [`LOCKS_MAX`] (housekeeping).
    pub(super) fn trim_locks(&self) {
        for ino in self.locks.over_bound(|ino| self.files.get(ino).is_some()) {
            if let Some(e) = self.locks.get(ino) {
                e.lock().wanted = Some(LockMode::Exclusive);
            }
            self.give_way(ino);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalidation_goes_around_waiting_pages() {
        assert_eq!(around(&[]), vec![(0, u64::MAX)]);
        assert_eq!(around(&[(5000, 9000), (100, 200)]), vec![(12288, u64::MAX)]);
        assert_eq!(around(&[(8192, 8193)]), vec![(0, 8192), (12288, u64::MAX)]);
        assert!(covers(&[(0, 4096)], (4095, 4097)));
        assert!(!covers(&[(0, 4096)], (4096, 8192)));
    }

    #[test]
    fn a_listings_files_are_granted_in_groups_that_fit_a_transaction() {
        let none = |_: u64| false;
        // Created together, nothing held between them: 126 a transaction, one compare,
        // extents read as one range.
        let dense: Vec<u64> = (1000..1200).collect();
        let g = grant_groups(&dense, none);
        assert_eq!(g.iter().map(|g| g.files.len()).sum::<usize>(), 200);
        assert!(g.iter().all(|g| g.close && g.free.len() == 1));
        assert_eq!(g[0].files, 0..GROUP_CLOSE_MAX);
        assert_eq!(g[0].free, [(1000, 1125)]);
        // Every other inode, with this node holding some of those between: a compare per
        // run between them.
        let every_other: Vec<u64> = (0..200).map(|i| 1000 + 2 * i).collect();
        let held = |ino: u64| ino == 1011 || ino == 1051;
        let g = grant_groups(&every_other, held);
        assert_eq!(g[0].free, [(1000, 1010), (1012, 1050), (1052, 1250)]);
        // Denser than 4 a file only in a smaller group: 63.
        let mut thinning: Vec<u64> = (0..63).collect();
        thinning.extend((0..100).map(|i| 1000 + 10 * i));
        let g = grant_groups(&thinning, none);
        assert_eq!((g[0].files.clone(), g[0].close), (0..63, true));
        // Far apart: 42 a transaction, a read each.
        let sparse: Vec<u64> = (0..100).map(|i| i * 1000).collect();
        let g = grant_groups(&sparse, none);
        assert_eq!(
            g[0],
            GrantGroup {
                files: 0..42,
                close: false,
                free: Vec::new(),
            }
        );
        assert_eq!(g.iter().map(|g| g.files.len()).sum::<usize>(), 100);
        assert!(grant_groups(&[], none).is_empty());
        // Every group fits etcd's limits, as share_many checks.
        for (g, sorted) in [
            (grant_groups(&dense, none), &dense),
            (grant_groups(&every_other, held), &every_other),
            (grant_groups(&thinning, none), &thinning),
            (grant_groups(&sparse, none), &sparse),
        ] {
            for g in g {
                let reads = if g.close { 0 } else { 2 };
                let files: Vec<(Ino, Vec<RangeRequest>)> = sorted[g.files.clone()]
                    .iter()
                    .map(|&i| (Ino(i), vec![RangeRequest::key(vec![]); reads]))
                    .collect();
                let shared = vec![RangeRequest::key(vec![]); 2 * usize::from(g.close)];
                let free: Vec<(Ino, Ino)> = g.free.iter().map(|&(a, b)| (Ino(a), Ino(b))).collect();
                assert!(meta::cachelock::share_many_fits(&files, &shared, &free));
            }
        }
    }

    #[test]
    fn one_range_of_inodes_or_extents_is_split_per_file_and_a_cut_marks_the_rest_unknown() {
        let keys = meta::keys::Keyspace::new("t").expect("prefix");
        let kv = |ino, off| meta::kv::KeyValue {
            key: keys.extent(Ino(ino), off),
            ..Default::default()
        };
        let span = RangeResponse {
            kvs: vec![kv(10, 0), kv(10, 4096), kv(11, 0), kv(13, 0)],
            more: false,
            count: 4,
            revision: 7,
        };
        let inos = [Ino(10), Ino(12), Ino(13)];
        let split = split_span(&keys, &span, &inos);
        assert_eq!(
            split.len(),
            3,
            "every file answered, 11 (not asked) left out"
        );
        assert_eq!(split[&10].kvs.len(), 2);
        assert!(split[&12].kvs.is_empty() && !split[&12].more, "no blocks");
        assert_eq!(split[&13].revision, 7);
        let cut = RangeResponse { more: true, ..span };
        let split = split_span(&keys, &cut, &inos);
        assert!(!split[&10].more && !split[&12].more);
        assert!(split[&13].more, "may have more past the cut");
        // Inodes read as one range split the same way.
        let inode = |ino| meta::kv::KeyValue {
            key: keys.inode(Ino(ino)),
            ..Default::default()
        };
        let span = RangeResponse {
            kvs: vec![inode(10), inode(11), inode(13)],
            more: false,
            count: 3,
            revision: 7,
        };
        let split = split_span(&keys, &span, &inos);
        assert_eq!(split[&10].kvs, vec![inode(10)]);
        assert!(split[&12].kvs.is_empty(), "12 is gone");
        assert_eq!(split[&13].kvs, vec![inode(13)]);
    }

    #[test]
    fn trimming_gives_back_the_least_recently_used() {
        let t0 = Instant::now();
        let at = |ms| Some(t0 + Duration::from_millis(ms));
        let idle = vec![
            (at(30), 3),
            (at(10), 1),
            (None, 7),
            (at(40), 4),
            (at(20), 2),
        ];
        let mut out = least_recent(idle.clone(), 3);
        out.sort_unstable();
        assert_eq!(out, vec![1, 2, 7]);
        assert_eq!(least_recent(idle.clone(), 0), Vec::<u64>::new());
        assert_eq!(least_recent(idle, 9).len(), 5);
    }
}
