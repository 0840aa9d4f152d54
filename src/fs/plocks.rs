//! Cluster-wide fcntl record locks and flock locks (GETLK, SETLK, SETLKW).
//!
//! # Protocol
//!
//! * A held range is one `B<ino><session><owner><class><start>` key whose value is a
//!   [`LockRecord`] (shared or exclusive, last byte, pid), put under the holder's session
//!   lease: a dead node's locks vanish with its lease, and unmount deletes this node's.
//!   The holder is (session, kernel lock owner, class): for fcntl locks the kernel's owner
//!   is the process's file table, for flock (class 1, always the whole file) the open file
//!   description. fcntl and flock locks never conflict with each other, as on Linux.
//! * Set (lock or unlock a range): read `B<ino>` at revision R; a lock conflicting with the
//!   request (another holder, same class, overlapping, one of them exclusive) answers
//!   EAGAIN or makes SETLKW wait. Otherwise the holder's ranges are merged and split as
//!   POSIX says ([`apply`]) and the difference ([`diff`]) commits with the compare "every
//!   key of `B<ino>` has mod_revision < R+1" (for an unlock, of the holder's own keys):
//!   a lock anyone took or changed after the read fails it and the request re-reads. A
//!   key deleted after R needs no compare: a delete only removes conflicts.
//! * Wait: SETLKW waits on a thread of its own (never a core, never a pool waiter, which
//!   the holder's unlock may need), at most [`WAITERS_MAX`] at once. The filesystem's one
//!   etcd watch calls [`Plocks::changed`] for every event of a `B` key, which wakes the
//!   waiters of that file to re-read; a re-check every [`RECHECK`] covers a broken watch.
//!   The kernel's INTERRUPT of the waiting request ([`Plocks::interrupt`]) ends the wait
//!   with EINTR (it may arrive before the waiter registered: it is remembered).
//! * Release: FLUSH (every close) drops the closing process's fcntl locks on the file,
//!   RELEASE (last close of the description) its flock locks (`FUSE_RELEASE_FLOCK_UNLOCK`)
//!   and its OFD locks (whose owner is the description: those of every owner that locked
//!   through the file handle, the process-owned ones being gone by then). Process exit
//!   closes its files, so the kernel sends those too.
//!
//! * Delegation: a lock on a file with no lock at all, by anyone, puts a delegation record
//!   instead (`B<ino><session><DELEGATION_OWNER>`, under the lease), compared like any
//!   lock on every key of `B<ino>`. While it stands the file's locks live on this node
//!   only, taken and dropped without etcd (a database takes and drops about six per
//!   transaction: benches/sqlite.sh). Another node's lock or GETLK that finds it puts a
//!   recall record (`<RECALL_OWNER>`, only while the delegation exists: compared on it)
//!   and waits; the watch hands the recall to this node's recall thread, which writes
//!   the locks held here as ordinary keys and deletes the delegation and the recalls in
//!   one transaction compared on `B<ino>`, so the asker then finds every lock in etcd.
//!   A node takes a recalled file again only [`REDELEGATE_AFTER`] later, so two nodes
//!   taking turns keep its locks in etcd. A dead node's delegation goes with its lease
//!   (its locks with it, as they would); files closed here are given back by
//!   housekeeping; a delegation with more than [`DELEGATED_LOCKS_MAX`] locks is given back
//!   before the next one.
//!
//! Holder pids are the holder node's: F_GETLK on another machine reports a pid that
//! means nothing there (the kernel turns a pid it does not know into 0).

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Condvar, Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant},
};

use fusedev::{
    abi::{FileLock, LkOut, FUSE_LK_FLOCK},
    errno::Errno,
    server::{Reply, RequestCtx},
};
use meta::{
    codec::{LockRecord, Record},
    keys::{KeyKind, Keyspace, LockKey},
    kv::{Compare, CompareOp, CompareTarget, PutOp, RangeRequest, Txn, TxnOp},
    types::{Ino, SessionId},
};

use super::{done_bytes, errno, lock, run_read, to_reply, Done, EtcFs, Inner};

/// A waiter re-reads this often even when the watch says nothing (a broken watch).
const RECHECK: Duration = Duration::from_secs(1);
/// SETLKW requests waiting at once on this node; ENOLCK past it.
pub(super) const WAITERS_MAX: usize = 256;
/// (file, owner, class) holders this node remembers for FLUSH and RELEASE; ENOLCK past it.
const HOLDERS_MAX: usize = 65536;
/// INTERRUPTs remembered for requests not (yet) waiting: one can overtake its SETLKW.
const EARLY_INTERRUPTS_MAX: usize = 64;
/// Locks of one file read at once; ENOLCK for a file with more.
const LOCKS_PER_FILE_MAX: i64 = 16384;
/// Read-check-commit rounds of one SETLK that lost its compare to concurrent changes
/// before it answers EAGAIN (SETLKW just goes on).
const ATTEMPTS_MAX: usize = 32;
/// `fcntl` offsets are signed: the kernel refuses a GETLK answer beyond this.
const OFFSET_MAX: u64 = i64::MAX as u64;
/// Shards of the per-file serialisation of this node's own lock operations.
const SHARDS: usize = 64;
/// Files whose last read (or commit) of their locks this node remembers.
const KNOWN_FILES_MAX: usize = 4096;
/// The owner in the key of the record that delegates a file's locks to its session, and
/// of the record by which another session asks for them back. Neither is a lock; kernel
/// lock owners with these values are refused (ENOLCK).
use meta::keys::{LOCK_DELEGATION_OWNER as DELEGATION_OWNER, LOCK_RECALL_OWNER as RECALL_OWNER};
/// Files whose locks this node may hold delegated at once.
const DELEGATIONS_MAX: usize = 1024;
/// Locks a delegated file may hold here: all of them go back to etcd in one transaction
/// when another node asks (etcd's default limit is 128 operations per transaction).
const DELEGATED_LOCKS_MAX: usize = 64;
/// How long a non-blocking lock or GETLK waits for another node to give a delegation
/// back: longer than a lease, so a dead holder's delegation has gone by then.
const RECALL_WAIT_MAX: Duration = Duration::from_secs(30);
/// After a file's delegation was recalled (from this node or by it), this node takes it
/// again only this much later: two nodes taking turns on a file keep its locks in etcd
/// instead of passing the delegation back and forth on every lock.
const REDELEGATE_AFTER: Duration = Duration::from_secs(5);
/// Recalls queued for the recall thread; past it, housekeeping finds them.
const RECALLS_QUEUED: usize = 1024;

// ---------------------------------------------------------------------------------------
// Pure lock logic
// ---------------------------------------------------------------------------------------

/// One held range, bytes `start..=end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Span {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) write: bool,
    pub(super) pid: u32,
}

/// Who holds a lock, cluster-wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Holder {
    pub(super) session: u64,
    pub(super) owner: u64,
    pub(super) flock: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Held {
    pub(super) holder: Holder,
    pub(super) span: Span,
}

/// A delegation or recall record: in the lock keys, but not a lock.
fn is_record(h: &Held) -> bool {
    h.holder.owner >= RECALL_OWNER
}

/// The session other than `me` that holds the file's locks delegated, if any.
fn delegated_elsewhere(held: &[Held], me: u64) -> Option<u64> {
    held.iter()
        .find(|h| h.holder.owner == DELEGATION_OWNER && h.holder.session != me)
        .map(|h| h.holder.session)
}

/// The key of `session`'s delegation (`DELEGATION_OWNER`) or recall record of `ino`.
fn record_key(keys: &Keyspace, ino: u64, session: u64, owner: u64) -> Vec<u8> {
    keys.lock(&LockKey {
        ino: Ino(ino),
        session: SessionId(session),
        owner,
        flock: false,
        start: 0,
    })
}

/// The keys of `session`'s own records among `held`: a recall it no longer needs, or a
/// delegation this node does not hold (one whose answer was lost), both to delete.
fn own_records<'a>(
    keys: &'a Keyspace,
    ino: u64,
    session: SessionId,
    held: &'a [Held],
) -> impl Iterator<Item = Vec<u8>> + 'a {
    held.iter()
        .filter(move |h| h.holder.session == session.0 && is_record(h))
        .map(move |h| record_key(keys, ino, session.0, h.holder.owner))
}

fn overlaps(s: &Span, start: u64, end: u64) -> bool {
    s.start <= end && start <= s.end
}

/// The first lock that keeps `me` from locking `start..=end` (exclusively when `write`):
/// another holder's of the same class, overlapping, one of the two exclusive.
pub(super) fn conflict(
    held: &[Held],
    me: Holder,
    start: u64,
    end: u64,
    write: bool,
) -> Option<&Held> {
    held.iter().find(|h| {
        h.holder != me
            && !is_record(h)
            && h.holder.flock == me.flock
            && overlaps(&h.span, start, end)
            && (write || h.span.write)
    })
}

/// A holder's ranges after it sets `start..=end` to `set` (`None`: unlocks it), POSIX
/// style: the new range replaces whatever it covers, splitting ranges it cuts, and
/// touching or overlapping ranges of the same kind merge. `own` must not overlap itself
/// (what this returns never does). Sorted by start.
pub(super) fn apply(own: &[Span], start: u64, end: u64, set: Option<(bool, u32)>) -> Vec<Span> {
    let mut out = Vec::with_capacity(own.len() + 2);
    for s in own {
        if !overlaps(s, start, end) {
            out.push(*s);
            continue;
        }
        if s.start < start {
            out.push(Span {
                end: start - 1,
                ..*s
            });
        }
        if s.end > end {
            out.push(Span {
                start: end + 1,
                ..*s
            });
        }
    }
    if let Some((write, pid)) = set {
        out.push(Span {
            start,
            end,
            write,
            pid,
        });
    }
    out.sort_by_key(|s| s.start);
    let mut merged: Vec<Span> = Vec::with_capacity(out.len());
    for s in out {
        match merged.last_mut() {
            Some(m) if m.write == s.write && s.start <= m.end.saturating_add(1) => {
                // The new range's pid wins: it is the latest lock of this holder.
                if s.start == start && set.is_some() {
                    m.pid = s.pid;
                }
                m.end = m.end.max(s.end);
            }
            _ => merged.push(s),
        }
    }
    merged
}

/// What turns `old` into `new` (both as [`apply`] returns them): the starts whose keys
/// go, and the ranges to put (a put of an existing start replaces it).
pub(super) fn diff(old: &[Span], new: &[Span]) -> (Vec<u64>, Vec<Span>) {
    let deletes = old
        .iter()
        .filter(|o| !new.iter().any(|n| n.start == o.start))
        .map(|o| o.start)
        .collect();
    let puts = new.iter().filter(|n| !old.contains(n)).copied().collect();
    (deletes, puts)
}

/// A decoded GETLK/SETLK argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Want {
    pub(super) flock: bool,
    pub(super) start: u64,
    pub(super) end: u64,
    /// `Some(exclusive)` to lock, `None` to unlock.
    pub(super) lock: Option<bool>,
    pub(super) pid: u32,
}

impl Want {
    pub(super) fn new(lk: &FileLock, lk_flags: u32) -> Result<Want, Errno> {
        let lock = match i32::try_from(lk.typ).map_err(|_| Errno::EINVAL)? {
            libc::F_RDLCK => Some(false),
            libc::F_WRLCK => Some(true),
            libc::F_UNLCK => None,
            _ => return Err(Errno::EINVAL),
        };
        let flock = lk_flags & FUSE_LK_FLOCK != 0;
        // flock locks are whole-file whatever the kernel says the range is.
        let (start, end) = if flock {
            (0, OFFSET_MAX)
        } else {
            (lk.start, lk.end)
        };
        if start > end {
            return Err(Errno::EINVAL);
        }
        Ok(Want {
            flock,
            start,
            end,
            lock,
            pid: lk.pid,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Waiters, interrupts and this node's holders
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct State {
    /// Files somebody waits on: (changes seen by the watch, waiters).
    files: HashMap<u64, (u64, usize)>,
    /// Waiting requests by FUSE unique id: interrupted yet?
    waiting: HashMap<u64, bool>,
    /// INTERRUPTs of requests that were not waiting when they came, oldest first.
    early: VecDeque<u64>,
    /// (file, owner, flock) that may hold locks here: FLUSH and RELEASE of anything else
    /// need no etcd.
    holders: HashSet<(u64, u64, bool)>,
    /// fcntl-class owners that locked through each open file (FUSE file handle): the
    /// description's RELEASE drops their locks, which are its OFD locks (F_OFD_SETLK: the
    /// owner is the description, and no FLUSH names it); the process-owned ones among them
    /// went at the FLUSH of every close before it.
    by_fh: HashMap<u64, (u64, HashSet<u64>)>,
    /// Holders whose release (at a close) etcd did not take: their locks stay in etcd,
    /// where they would keep every other node waiting until this one unmounts. Retried
    /// from housekeeping ([`Inner::retry_releases`]) until etcd takes them; forgotten when
    /// the holder locks the file again (its next close releases it).
    unreleased: HashSet<(u64, u64, bool)>,
    stopping: bool,
}

/// This node's side of the locks: waiters, early interrupts and its holders.
pub(crate) struct Plocks {
    state: Mutex<State>,
    changed: Condvar,
    /// This node's own operations on one file run one at a time, so they never fail each
    /// other's compares (sharded by inode).
    shards: Vec<Mutex<()>>,
    /// SETLKW threads running.
    threads: AtomicUsize,
    /// Per file, its locks as of a revision (the last read, or a commit of ours on top
    /// of it): a lock or unlock is tried against this first, in one round trip, and its
    /// compare fails (answering the fresh set) only if the locks changed since.
    known: Mutex<HashMap<u64, (Vec<Held>, i64)>>,
    /// Files whose locks are delegated to this node (see the module docs), and the locks
    /// held on each: taken, dropped and checked here, without etcd.
    delegated: Mutex<HashMap<u64, Vec<Held>>>,
    /// When each file's delegation was last recalled, from this node or by it (bounded:
    /// forgotten when full).
    recalled: Mutex<HashMap<u64, Instant>>,
    /// Files delegated here that another node asked back: for the recall thread, and for
    /// housekeeping when giving them back failed.
    recalls: crossbeam_channel::Sender<u64>,
    recalls_rx: Mutex<Option<crossbeam_channel::Receiver<u64>>>,
    recall_retry: Mutex<HashSet<u64>>,
    /// Delegations taken and given back, for `etcfs stats`.
    pub(super) delegations_taken: AtomicU64,
    pub(super) delegations_returned: AtomicU64,
    /// Locks taken (not unlocks), SETLKW requests that had to wait for another holder,
    /// and SETLK requests refused for one (EAGAIN), for `etcfs stats`.
    pub(super) granted: AtomicU64,
    pub(super) waited: AtomicU64,
    pub(super) refused: AtomicU64,
}

impl Default for Plocks {
    fn default() -> Self {
        let (recalls, recalls_rx) = crossbeam_channel::bounded(RECALLS_QUEUED);
        Plocks {
            state: Mutex::default(),
            changed: Condvar::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(())).collect(),
            threads: AtomicUsize::new(0),
            known: Mutex::default(),
            delegated: Mutex::default(),
            recalled: Mutex::default(),
            recalls,
            recalls_rx: Mutex::new(Some(recalls_rx)),
            recall_retry: Mutex::default(),
            delegations_taken: AtomicU64::new(0),
            delegations_returned: AtomicU64::new(0),
            granted: AtomicU64::new(0),
            waited: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }
}

/// A registered waiting request; unregisters when dropped.
struct Waiter<'a> {
    p: &'a Plocks,
    /// The waiting request, when an INTERRUPT can end its wait (SETLKW).
    unique: Option<u64>,
    ino: u64,
}

impl Plocks {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn shard(&self, ino: u64) -> MutexGuard<'_, ()> {
        let n = (ino % SHARDS as u64) as usize;
        lock(&self.shards[n])
    }

    /// The watch saw a lock key of `ino` change: its waiters re-read.
    pub(super) fn changed(&self, ino: u64) {
        let mut s = self.state();
        if let Some(f) = s.files.get_mut(&ino) {
            f.0 += 1;
            drop(s);
            self.changed.notify_all();
        }
    }

    /// The kernel interrupts request `unique` (a signal reached its caller).
    pub(super) fn interrupt(&self, unique: u64) {
        let mut s = self.state();
        if let Some(i) = s.waiting.get_mut(&unique) {
            *i = true;
            drop(s);
            self.changed.notify_all();
            return;
        }
        if s.early.len() >= EARLY_INTERRUPTS_MAX {
            s.early.pop_front();
        }
        s.early.push_back(unique);
    }

    /// The watch saw a lock key of `ino` change (`put`: written): its waiters re-read,
    /// and a recall of a delegation held here goes to the recall thread.
    pub(super) fn key_changed(&self, l: &LockKey, put: bool) {
        self.changed(l.ino.0);
        if put && l.owner == RECALL_OWNER {
            let ino = l.ino.0;
            let ours =
                lock(&self.delegated).contains_key(&ino) || lock(&self.recall_retry).contains(&ino);
            if ours && self.recalls.try_send(ino).is_err() {
                lock(&self.recall_retry).insert(ino);
            }
        }
    }

    /// The recall thread's queue (once).
    pub(super) fn take_recalls(&self) -> Option<crossbeam_channel::Receiver<u64>> {
        lock(&self.recalls_rx).take()
    }

    /// Whether this node may take `ino`'s delegation now.
    fn may_delegate(&self, ino: u64) -> bool {
        lock(&self.delegated).len() < DELEGATIONS_MAX
            && lock(&self.recalled)
                .get(&ino)
                .is_none_or(|t| t.elapsed() >= REDELEGATE_AFTER)
    }

    fn note_recalled(&self, ino: u64) {
        let mut r = lock(&self.recalled);
        if r.len() >= KNOWN_FILES_MAX {
            r.retain(|_, t| t.elapsed() < REDELEGATE_AFTER);
            if r.len() >= KNOWN_FILES_MAX {
                r.clear();
            }
        }
        r.insert(ino, Instant::now());
    }

    /// Whether `owner` may hold locks of its class on `ino` here.
    pub(super) fn holds(&self, ino: u64, owner: u64, flock: bool) -> bool {
        self.state().holders.contains(&(ino, owner, flock))
    }

    /// The session was fenced: its locks went with its lease. Forgets them, and wakes
    /// every waiter to find that out (their next try answers ENOLCK).
    pub(super) fn fence(&self) {
        let mut s = self.state();
        s.holders.clear();
        s.by_fh.clear();
        s.unreleased.clear();
        drop(s);
        lock(&self.known).clear();
        // Their record went with the lease, and the locks held under it.
        lock(&self.delegated).clear();
        lock(&self.recall_retry).clear();
        self.changed.notify_all();
    }

    /// Wakes every waiter for good (unmount).
    pub(super) fn stop(&self) {
        self.state().stopping = true;
        self.changed.notify_all();
    }

    fn note_holder(&self, ino: u64, owner: u64, flock: bool) -> Result<(), Errno> {
        let mut s = self.state();
        if s.holders.len() >= HOLDERS_MAX && !s.holders.contains(&(ino, owner, flock)) {
            return Err(Errno::ENOLCK);
        }
        s.holders.insert((ino, owner, flock));
        Ok(())
    }

    /// `owner` locked `ino` through `fh`. Past [`HOLDERS_MAX`] files an OFD lock is then
    /// kept until its process's FLUSH, unmount or the lease's end.
    fn note_fh(&self, fh: u64, ino: u64, owner: u64) {
        let mut s = self.state();
        if s.by_fh.len() < HOLDERS_MAX || s.by_fh.contains_key(&fh) {
            s.by_fh
                .entry(fh)
                .or_insert((ino, HashSet::new()))
                .1
                .insert(owner);
        }
    }

    /// The fcntl-class owners that locked through `fh` and may still hold locks, which its
    /// RELEASE must drop; forgets `fh`.
    pub(super) fn take_fh(&self, fh: u64) -> Vec<u64> {
        let mut s = self.state();
        let Some((ino, owners)) = s.by_fh.remove(&fh) else {
            return Vec::new();
        };
        owners
            .into_iter()
            .filter(|o| s.holders.contains(&(ino, *o, false)))
            .collect()
    }

    fn forget_holder(&self, ino: u64, owner: u64, flock: bool) {
        let mut s = self.state();
        s.holders.remove(&(ino, owner, flock));
        s.unreleased.remove(&(ino, owner, flock));
    }

    fn register(&self, unique: Option<u64>, ino: u64) -> Result<Waiter<'_>, Errno> {
        let mut s = self.state();
        if let Some(at) = s.early.iter().position(|u| Some(*u) == unique) {
            s.early.remove(at);
            return Err(Errno::EINTR);
        }
        if s.waiting.len() >= WAITERS_MAX {
            return Err(Errno::ENOLCK);
        }
        if let Some(unique) = unique {
            s.waiting.insert(unique, false);
        }
        s.files.entry(ino).or_insert((0, 0)).1 += 1;
        Ok(Waiter {
            p: self,
            unique,
            ino,
        })
    }
}

impl Waiter<'_> {
    /// The file's change count, taken before a read: a change after the read moves it.
    fn changes(&self) -> u64 {
        self.p.state().files.get(&self.ino).map_or(0, |f| f.0)
    }

    /// EINTR when the request is interrupted or the filesystem stops.
    fn interrupted(&self) -> Result<(), Errno> {
        let s = self.p.state();
        if s.stopping || self.interrupted_in(&s) {
            return Err(Errno::EINTR);
        }
        Ok(())
    }

    fn interrupted_in(&self, s: &State) -> bool {
        self.unique
            .is_some_and(|u| s.waiting.get(&u).copied().unwrap_or(true))
    }

    /// Waits until the file's locks change after `seen`, or [`RECHECK`]; EINTR when the
    /// request is interrupted or the filesystem stops.
    fn wait(&self, seen: u64) -> Result<(), Errno> {
        let until = Instant::now() + RECHECK;
        let mut s = self.p.state();
        loop {
            if s.stopping || self.interrupted_in(&s) {
                return Err(Errno::EINTR);
            }
            if s.files.get(&self.ino).map_or(0, |f| f.0) != seen {
                return Ok(());
            }
            let now = Instant::now();
            if now >= until {
                return Ok(());
            }
            s = self
                .p
                .changed
                .wait_timeout(s, until - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        let mut s = self.p.state();
        if let Some(u) = self.unique {
            s.waiting.remove(&u);
        }
        if let Some(f) = s.files.get_mut(&self.ino) {
            f.1 -= 1;
            if f.1 == 0 {
                s.files.remove(&self.ino);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// etcd
// ---------------------------------------------------------------------------------------

/// What one read-check-commit round of a SETLK did.
enum Round {
    Done,
    Conflict,
    /// Concurrent changes kept failing the compare.
    Busy,
    /// Another node holds the file's locks delegated and was asked for them back.
    Recalling,
}

impl Inner {
    fn lock_session(&self) -> Result<(SessionId, i64), Errno> {
        let s = lock(&self.session).clone().ok_or(Errno::EIO)?;
        if !s.is_alive() || s.id() != self.op_session() {
            // Our keys may be gone with the lease: a lock granted now would not hold.
            return Err(Errno::ENOLCK);
        }
        Ok((s.id(), s.lease().0))
    }

    /// Every lock of `ino` and the revision of the read.
    fn read_locks(&self, ino: u64) -> Result<(Vec<Held>, i64), Errno> {
        let range = self.meta.keys().locks(Ino(ino));
        let resp = run_read(&self.meta, move |kv, _| {
            Box::pin(async move {
                let req = RangeRequest::range(range.start, range.end).limit(LOCKS_PER_FILE_MAX);
                Ok(kv.range(req).await?)
            })
        })
        .map_err(|e| errno::meta(&e))?;
        self.held_of(ino, &resp)
    }

    /// The locks in a range answer of `ino`'s lock keys, and its revision.
    fn held_of(&self, ino: u64, resp: &meta::kv::RangeResponse) -> Result<(Vec<Held>, i64), Errno> {
        if resp.more {
            log::warn!("inode {ino} has more than {LOCKS_PER_FILE_MAX} locks");
            return Err(Errno::ENOLCK);
        }
        let keys = self.meta.keys();
        let held = resp
            .kvs
            .iter()
            .filter_map(|kv| {
                let Some(KeyKind::Lock(k)) = keys.parse(&kv.key) else {
                    return None;
                };
                let holder = Holder {
                    session: k.session.0,
                    owner: k.owner,
                    flock: k.flock,
                };
                let span = match LockRecord::decode(&kv.value) {
                    Ok(r) if r.end >= k.start => Span {
                        start: k.start,
                        end: r.end,
                        write: r.write,
                        pid: r.pid,
                    },
                    // Fail closed: an unreadable lock still excludes, until its holder
                    // unlocks or its lease ends.
                    other => {
                        log::error!(
                            "corrupt lock at key {}: {:?}",
                            keys.describe(&kv.key),
                            other.err()
                        );
                        Span {
                            start: k.start,
                            end: u64::MAX,
                            write: true,
                            pid: 0,
                        }
                    }
                };
                Some(Held { holder, span })
            })
            .collect();
        Ok((held, resp.revision))
    }

    /// One SETLK (or one attempt of a SETLKW) of `owner` on `ino`.
    fn set_once(&self, ino: u64, owner: u64, want: &Want) -> Result<Round, Errno> {
        self.set_once_if(ino, owner, want, false)
    }

    /// [`Inner::set_once`]; with `only_unreleased`, only if `owner`'s release is still to
    /// be retried (checked under the file's shard, which its own lock requests take too:
    /// a retry never drops a lock the owner took again after its failed release).
    fn set_once_if(
        &self,
        ino: u64,
        owner: u64,
        want: &Want,
        only_unreleased: bool,
    ) -> Result<Round, Errno> {
        if owner >= RECALL_OWNER {
            return Err(Errno::ENOLCK);
        }
        let (session, lease) = self.lock_session()?;
        let me = Holder {
            session: session.0,
            owner,
            flock: want.flock,
        };
        let keys = self.meta.keys().clone();
        let _one = self.plocks.shard(ino);
        {
            let mut s = self.plocks.state();
            if only_unreleased && !s.unreleased.contains(&(ino, owner, want.flock)) {
                return Ok(Round::Done);
            }
            if want.lock.is_some() {
                // It locks again: what its failed release left is its own again, and its
                // next close releases it all.
                s.unreleased.remove(&(ino, owner, want.flock));
            }
        }
        match self.set_delegated(ino, me, want) {
            Some(r) => return r,
            // Delegated, but with more locks than one transaction gives back.
            None if lock(&self.plocks.delegated).contains_key(&ino) => {
                self.give_back_locked(ino, false)?;
            }
            None => {}
        }
        // What this node last knew of the file's locks, if anything; a conflict found in
        // it is checked against a fresh read before it is believed.
        let mut known = super::lock(&self.plocks.known).remove(&ino);
        for _ in 0..ATTEMPTS_MAX {
            let fresh = known.is_none();
            let (held, rev) = match known.take() {
                Some(k) => k,
                None => self.read_locks(ino)?,
            };
            if want.lock.is_some() {
                if let Some(d) = delegated_elsewhere(&held, session.0) {
                    if !fresh {
                        continue;
                    }
                    self.ask_recall(ino, (session, lease), &held, d)?;
                    return Ok(Round::Recalling);
                }
            }
            if let Some(write) = want.lock {
                if conflict(&held, me, want.start, want.end, write).is_some() {
                    let (held2, rev2) = self.read_locks(ino)?;
                    if conflict(&held2, me, want.start, want.end, write).is_some() {
                        self.drop_own_records(ino, session, &held2);
                        self.remember_locks(ino, held2, rev2);
                        return Ok(Round::Conflict);
                    }
                    known = Some((held2, rev2));
                    continue;
                }
            }
            let own: Vec<Span> = held
                .iter()
                .filter(|h| h.holder == me)
                .map(|h| h.span)
                .collect();
            let new = apply(&own, want.start, want.end, want.lock.map(|w| (w, want.pid)));
            let (deletes, puts) = diff(&own, &new);
            if deletes.is_empty() && puts.is_empty() {
                self.drop_own_records(ino, session, &held);
                if new.is_empty() {
                    self.plocks.forget_holder(ino, owner, want.flock);
                }
                return Ok(Round::Done);
            }
            // Noted before the commit: a commit whose answer is lost may have locked, and
            // the holder's FLUSH or RELEASE must then still look.
            self.plocks.note_holder(ino, owner, want.flock)?;
            if want.lock.is_some() && held.is_empty() && self.plocks.may_delegate(ino) {
                match self.delegate(ino, (session, lease), rev)? {
                    Some(()) => {
                        let mine = new.iter().map(|&span| Held { holder: me, span });
                        lock(&self.plocks.delegated).insert(ino, mine.collect());
                        super::lock(&self.plocks.known).remove(&ino);
                        return Ok(Round::Done);
                    }
                    // The locks changed since the read: read again.
                    None => continue,
                }
            }
            let key_at = |start: u64| {
                keys.lock(&LockKey {
                    ino: Ino(ino),
                    session,
                    owner,
                    flock: want.flock,
                    start,
                })
            };
            let mut ops: Vec<TxnOp> = deletes.iter().map(|s| TxnOp::delete(key_at(*s))).collect();
            ops.extend(own_records(&keys, ino, session, &held).map(TxnOp::delete));
            ops.extend(puts.iter().map(|s| {
                TxnOp::Put(PutOp {
                    key: key_at(s.start),
                    value: LockRecord {
                        write: s.write,
                        end: s.end,
                        pid: s.pid,
                    }
                    .encode(),
                    lease,
                })
            }));
            // An unlock conflicts with nothing: only this holder's own keys must be as read.
            let guarded = match want.lock {
                Some(_) => keys.locks(Ino(ino)),
                None => keys.locks_of(Ino(ino), session, owner, want.flock),
            };
            let all = keys.locks(Ino(ino));
            let read_all = || {
                TxnOp::Range(
                    RangeRequest::range(all.start.clone(), all.end.clone())
                        .limit(LOCKS_PER_FILE_MAX),
                )
            };
            if want.lock.is_none() {
                // The others' locks were not compared: the set as it stands after the
                // unlock comes with the answer, so the lock that usually follows (a
                // database's next transaction) needs no read first (benches/plocks.sh).
                ops.push(read_all());
            }
            let t = Txn {
                compares: vec![Compare {
                    key: guarded.start,
                    range_end: Some(guarded.end),
                    op: CompareOp::Less,
                    target: CompareTarget::ModRevision(rev + 1),
                }],
                success: ops,
                // Refused: the fresh set comes with the answer, for the next attempt.
                failure: vec![read_all()],
            };
            // Idempotent, so resent through an etcd election: a second copy of one that
            // applied finds our own keys newer than the read and is refused, with the
            // fresh set, in which the next round finds nothing left to change (`Done`);
            // an unlock of keys already deleted compares only our remaining keys and
            // deletes nothing more.
            let resp = run_read(&self.meta, move |kv, _| {
                Box::pin(async move { Ok(kv.txn_idempotent(t).await?) })
            })
            .map_err(|e| errno::meta(&e))?;
            if resp.succeeded {
                if new.is_empty() {
                    self.plocks.forget_holder(ino, owner, want.flock);
                }
                if want.lock.is_some() {
                    let mut after: Vec<Held> = held
                        .into_iter()
                        .filter(|h| {
                            h.holder != me && !(h.holder.session == session.0 && is_record(h))
                        })
                        .collect();
                    after.extend(new.iter().map(|&span| Held { holder: me, span }));
                    self.remember_locks(ino, after, resp.revision);
                } else if let Some(Ok((after, rev))) = self.range_answer(ino, &resp) {
                    self.remember_locks(ino, after, rev);
                }
                return Ok(Round::Done);
            }
            known = self.range_answer(ino, &resp).transpose()?;
        }
        Ok(Round::Busy)
    }

    /// The locks in the last answer of a transaction that read `ino`'s lock keys (last),
    /// as of the transaction's revision.
    fn range_answer(
        &self,
        ino: u64,
        resp: &meta::kv::TxnResponse,
    ) -> Option<Result<(Vec<Held>, i64), Errno>> {
        match resp.responses.last() {
            Some(meta::kv::TxnOpResponse::Range(r)) => {
                let mut r = r.clone();
                r.revision = resp.revision;
                Some(self.held_of(ino, &r))
            }
            _ => None,
        }
    }

    /// Remembers `ino`'s locks as of `rev` (bounded: forgets everything when full).
    fn remember_locks(&self, ino: u64, held: Vec<Held>, rev: i64) {
        let mut k = super::lock(&self.plocks.known);
        if k.len() >= KNOWN_FILES_MAX {
            k.clear();
        }
        k.insert(ino, (held, rev));
    }

    /// GETLK: the first lock that would keep `owner` from taking `lk`, or F_UNLCK.
    pub(super) fn getlk(
        &self,
        ino: u64,
        owner: u64,
        lk: FileLock,
        lk_flags: u32,
    ) -> Result<Done, Errno> {
        let want = Want::new(&lk, lk_flags)?;
        let (session, lease) = self.lock_session()?;
        let me = Holder {
            session: session.0,
            owner,
            flock: want.flock,
        };
        let held = self.locks_to_show(ino, (session, lease))?;
        let found = want
            .lock
            .and_then(|write| conflict(&held, me, want.start, want.end, write));
        let lk = match found {
            Some(c) => FileLock {
                start: c.span.start.min(OFFSET_MAX),
                end: c.span.end.min(OFFSET_MAX),
                typ: if c.span.write {
                    libc::F_WRLCK as u32
                } else {
                    libc::F_RDLCK as u32
                },
                pid: c.span.pid,
            },
            None => FileLock {
                typ: libc::F_UNLCK as u32,
                ..lk
            },
        };
        Ok(done_bytes(&LkOut { lk }))
    }

    /// Every lock of `ino`, for GETLK: this node's own when the file is delegated here,
    /// else etcd's, once the node holding them delegated has given them back (waiting
    /// up to [`RECALL_WAIT_MAX`] for it, ENOLCK past that).
    fn locks_to_show(&self, ino: u64, session: (SessionId, i64)) -> Result<Vec<Held>, Errno> {
        let until = Instant::now() + RECALL_WAIT_MAX;
        let mut w: Option<Waiter<'_>> = None;
        loop {
            let seen = w.as_ref().map(Waiter::changes);
            {
                let _one = self.plocks.shard(ino);
                if let Some(local) = lock(&self.plocks.delegated).get(&ino) {
                    return Ok(local.clone());
                }
            }
            let (held, _) = self.read_locks(ino)?;
            let Some(holder) = delegated_elsewhere(&held, session.0 .0) else {
                self.drop_own_records(ino, session.0, &held);
                return Ok(held);
            };
            if Instant::now() >= until {
                return Err(Errno::ENOLCK);
            }
            self.ask_recall(ino, session, &held, holder)?;
            match (&w, seen) {
                (Some(w), Some(seen)) => w.wait(seen)?,
                _ => w = Some(self.plocks.register(None, ino)?),
            }
        }
    }

    /// SETLK through open file `fh`, and SETLKW when `wait` names the request (its FUSE
    /// unique id).
    pub(super) fn setlk(
        &self,
        (ino, fh): (u64, u64),
        owner: u64,
        lk: FileLock,
        lk_flags: u32,
        wait: Option<u64>,
    ) -> Result<Done, Errno> {
        let want = Want::new(&lk, lk_flags)?;
        let r = self.set(ino, owner, &want, wait);
        if r.is_ok() && want.lock.is_some() && !want.flock {
            self.plocks.note_fh(fh, ino, owner);
        }
        r
    }

    fn set(&self, ino: u64, owner: u64, want: &Want, wait: Option<u64>) -> Result<Done, Errno> {
        let p = &self.plocks;
        let granted = || {
            if want.lock.is_some() {
                p.granted.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Done::Empty)
        };
        let refused = || {
            p.refused.fetch_add(1, Ordering::Relaxed);
            Err(Errno::EAGAIN)
        };
        let Some(unique) = wait.filter(|_| want.lock.is_some()) else {
            // A non-blocking lock waits only for another node to give the file's
            // delegation back.
            let until = Instant::now() + RECALL_WAIT_MAX;
            let mut w: Option<Waiter<'_>> = None;
            loop {
                let seen = w.as_ref().map(Waiter::changes);
                match self.set_once(ino, owner, want)? {
                    Round::Done => return granted(),
                    Round::Conflict | Round::Busy => return refused(),
                    Round::Recalling if Instant::now() >= until => return refused(),
                    Round::Recalling => match (&w, seen) {
                        (Some(w), Some(seen)) => w.wait(seen)?,
                        _ => w = Some(self.plocks.register(None, ino)?),
                    },
                }
            }
        };
        let w = self.plocks.register(Some(unique), ino)?;
        let mut waited = false;
        loop {
            let seen = w.changes();
            match self.set_once(ino, owner, want)? {
                Round::Done => return granted(),
                // Others' changes won every compare: read again at once.
                Round::Busy => w.interrupted()?,
                Round::Conflict => {
                    if !std::mem::replace(&mut waited, true) {
                        p.waited.fetch_add(1, Ordering::Relaxed);
                    }
                    w.wait(seen)?
                }
                Round::Recalling => w.wait(seen)?,
            }
        }
    }

    /// Drops every lock of one class `owner` holds on `ino` (its close); errors are logged.
    pub(super) fn release_locks(&self, ino: u64, owner: u64, flock: bool) {
        let all = Want {
            flock,
            start: 0,
            end: u64::MAX,
            lock: None,
            pid: 0,
        };
        let e = match self.set_once(ino, owner, &all) {
            Ok(Round::Done) => return,
            Ok(_) => Errno::EAGAIN,
            Err(e) => e,
        };
        let mut s = self.plocks.state();
        // Within the holders' bound: every unreleased holder is still a holder.
        if s.holders.contains(&(ino, owner, flock)) {
            s.unreleased.insert((ino, owner, flock));
        }
        drop(s);
        log::warn!(
            "releasing the locks of owner {owner:#x} on inode {ino}: {e:?} (retried until \
             etcd takes it)"
        );
    }

    /// Retries the releases etcd did not take (see `State::unreleased`); a failure is
    /// left for the next call.
    pub(super) fn retry_releases(&self) {
        let todo: Vec<(u64, u64, bool)> = self.plocks.state().unreleased.iter().copied().collect();
        for (ino, owner, flock) in todo {
            let all = Want {
                flock,
                start: 0,
                end: u64::MAX,
                lock: None,
                pid: 0,
            };
            match self.set_once_if(ino, owner, &all, true) {
                Ok(Round::Done) => log::info!(
                    "released the locks of owner {owner:#x} on inode {ino} (left by a \
                     failed release)"
                ),
                Ok(_) => {}
                Err(e) => {
                    log::debug!("retrying the release of owner {owner:#x} on {ino}: {e:?}");
                    return;
                }
            }
        }
    }

    /// Unmount: deletes every lock this node holds (the lease's end would, later).
    pub(super) fn release_all_locks(&self) {
        self.plocks.stop();
        let holders: Vec<(u64, u64, bool)> = self.plocks.state().holders.drain().collect();
        let delegated: Vec<u64> = lock(&self.plocks.delegated)
            .drain()
            .map(|(i, _)| i)
            .collect();
        let Some(session) = lock(&self.session).clone() else {
            return;
        };
        let keys = self.meta.keys();
        for chunk in delegated.chunks(64) {
            let ops = chunk
                .iter()
                .map(|&ino| TxnOp::delete(record_key(keys, ino, session.id().0, DELEGATION_OWNER)))
                .collect();
            let t = Txn {
                compares: vec![],
                success: ops,
                failure: vec![],
            };
            if let Err(e) = run_read(&self.meta, move |kv, _| {
                Box::pin(async move { Ok(kv.txn_idempotent(t).await?.succeeded) })
            }) {
                log::warn!("deleting this node's lock delegations at unmount: {e}");
            }
        }
        for chunk in holders.chunks(64) {
            let ops = chunk
                .iter()
                .map(|&(ino, owner, flock)| {
                    let r = keys.locks_of(Ino(ino), session.id(), owner, flock);
                    TxnOp::delete_range(r.start, r.end, false)
                })
                .collect();
            let t = Txn {
                compares: vec![],
                success: ops,
                failure: vec![],
            };
            // Deletes only: idempotent.
            if let Err(e) = run_read(&self.meta, move |kv, _| {
                Box::pin(async move { Ok(kv.txn_idempotent(t).await?.succeeded) })
            }) {
                log::warn!("deleting this node's locks at unmount: {e}");
            }
        }
    }
}

/// Delegation: a file's locks kept on the one node that uses them (see the module docs).
impl Inner {
    /// A lock or unlock of a file delegated here, checked and applied here; `None` when
    /// the file is not delegated here, or would hold more locks than
    /// [`DELEGATED_LOCKS_MAX`]. Under the file's shard.
    fn set_delegated(&self, ino: u64, me: Holder, want: &Want) -> Option<Result<Round, Errno>> {
        let mut d = lock(&self.plocks.delegated);
        let held = d.get_mut(&ino)?;
        if let Some(write) = want.lock {
            if conflict(held, me, want.start, want.end, write).is_some() {
                return Some(Ok(Round::Conflict));
            }
        }
        let own: Vec<Span> = held
            .iter()
            .filter(|h| h.holder == me)
            .map(|h| h.span)
            .collect();
        let new = apply(&own, want.start, want.end, want.lock.map(|w| (w, want.pid)));
        if new != own {
            if held.len() - own.len() + new.len() > DELEGATED_LOCKS_MAX {
                return None;
            }
            if let Err(e) = self.plocks.note_holder(ino, me.owner, me.flock) {
                return Some(Err(e));
            }
            held.retain(|h| h.holder != me);
            held.extend(new.iter().map(|&span| Held { holder: me, span }));
        }
        drop(d);
        if new.is_empty() {
            self.plocks.forget_holder(ino, me.owner, me.flock);
        }
        // Waiters on this node's own conflicting locks try again.
        self.plocks.changed(ino);
        Some(Ok(Round::Done))
    }

    /// Takes `ino`'s delegation, the file having no lock or record at `rev`: `Some` once
    /// this session's record is in etcd, `None` when the locks changed since `rev`.
    fn delegate(
        &self,
        ino: u64,
        (session, lease): (SessionId, i64),
        rev: i64,
    ) -> Result<Option<()>, Errno> {
        let keys = self.meta.keys().clone();
        let all = keys.locks(Ino(ino));
        let t = Txn {
            compares: vec![Compare {
                key: all.start,
                range_end: Some(all.end),
                op: CompareOp::Less,
                target: CompareTarget::ModRevision(rev + 1),
            }],
            success: vec![TxnOp::Put(PutOp {
                key: record_key(&keys, ino, session.0, DELEGATION_OWNER),
                value: LockRecord {
                    write: true,
                    end: u64::MAX,
                    pid: 0,
                }
                .encode(),
                lease,
            })],
            failure: vec![],
        };
        let r = run_read(&self.meta, move |kv, _| {
            Box::pin(async move { Ok(kv.txn_idempotent(t).await?.succeeded) })
        });
        if let Ok(true) = r {
            self.plocks
                .delegations_taken
                .fetch_add(1, Ordering::Relaxed);
            return Ok(Some(()));
        }
        // Refused, or no answer: a resent copy of one that applied is refused too, so
        // whether the record is there decides. Unreadable: housekeeping deletes it if it is.
        let ours = |held: &[Held]| {
            held.iter()
                .any(|h| h.holder.session == session.0 && h.holder.owner == DELEGATION_OWNER)
        };
        match self.read_locks(ino) {
            Ok((held, _)) if ours(&held) => {
                self.plocks
                    .delegations_taken
                    .fetch_add(1, Ordering::Relaxed);
                Ok(Some(()))
            }
            Ok(_) => match r {
                Ok(_) => Ok(None),
                Err(e) => Err(errno::meta(&e)),
            },
            Err(e) => {
                lock(&self.plocks.recall_retry).insert(ino);
                Err(e)
            }
        }
    }

    /// Another node's lock found `ino` delegated to `holder`: asks for it back, with a
    /// record that exists only while the delegation does (none is left behind when the
    /// delegation went meanwhile).
    fn ask_recall(
        &self,
        ino: u64,
        (session, lease): (SessionId, i64),
        held: &[Held],
        holder: u64,
    ) -> Result<(), Errno> {
        self.plocks.note_recalled(ino);
        if held
            .iter()
            .any(|h| h.holder.session == session.0 && h.holder.owner == RECALL_OWNER)
        {
            return Ok(());
        }
        let keys = self.meta.keys().clone();
        let t = Txn {
            compares: vec![Compare {
                key: record_key(&keys, ino, holder, DELEGATION_OWNER),
                range_end: None,
                op: CompareOp::Greater,
                target: CompareTarget::Version(0),
            }],
            success: vec![TxnOp::Put(PutOp {
                key: record_key(&keys, ino, session.0, RECALL_OWNER),
                value: LockRecord {
                    write: false,
                    end: 0,
                    pid: 0,
                }
                .encode(),
                lease,
            })],
            failure: vec![],
        };
        run_read(&self.meta, move |kv, _| {
            Box::pin(async move { Ok(kv.txn_idempotent(t).await?.succeeded) })
        })
        .map_err(|e| errno::meta(&e))?;
        Ok(())
    }

    /// Deletes this session's own records among `held` (a recall no longer needed, a
    /// delegation not held here), best effort: a recall left only keeps the file from
    /// being delegated until this session's next lock of it or its lease's end.
    fn drop_own_records(&self, ino: u64, session: SessionId, held: &[Held]) {
        let keys = self.meta.keys().clone();
        let ops: Vec<TxnOp> = own_records(&keys, ino, session, held)
            .map(TxnOp::delete)
            .collect();
        if ops.is_empty() {
            return;
        }
        let t = Txn {
            compares: vec![],
            success: ops,
            failure: vec![],
        };
        if let Err(e) = run_read(&self.meta, move |kv, _| {
            Box::pin(async move { Ok(kv.txn_idempotent(t).await?.succeeded) })
        }) {
            log::debug!("deleting this node's lock records of inode {ino}: {e}");
        }
    }

    /// Gives `ino`'s delegation back: its locks become lock records, and the delegation
    /// and the recalls of it go, in one transaction compared on the file's lock keys.
    /// `recalled`: another node asked (this node then takes it again only after
    /// [`REDELEGATE_AFTER`]). Also deletes a delegation record of this session that this
    /// node does not know it holds. Under the file's shard.
    fn give_back_locked(&self, ino: u64, recalled: bool) -> Result<(), Errno> {
        let local = lock(&self.plocks.delegated).get(&ino).cloned();
        let (session, lease) = self.lock_session()?;
        let keys = self.meta.keys().clone();
        let mine = record_key(&keys, ino, session.0, DELEGATION_OWNER);
        let finish = |given: Vec<Held>, rev: Option<i64>| {
            lock(&self.plocks.delegated).remove(&ino);
            lock(&self.plocks.recall_retry).remove(&ino);
            if recalled {
                self.plocks.note_recalled(ino);
            }
            if let Some(rev) = rev {
                self.remember_locks(ino, given, rev);
            }
            self.plocks.changed(ino);
        };
        for _ in 0..ATTEMPTS_MAX {
            let (held, rev) = self.read_locks(ino)?;
            let ours = held
                .iter()
                .any(|h| h.holder.session == session.0 && h.holder.owner == DELEGATION_OWNER);
            let Some(local) = &local else {
                self.drop_own_records(ino, session, &held);
                finish(Vec::new(), None);
                return Ok(());
            };
            if !ours {
                // An earlier attempt applied though its answer was lost (the locks are
                // records now), or the lease is gone (and the fence drops them).
                finish(Vec::new(), None);
                return Ok(());
            }
            let recalls = held
                .iter()
                .filter(|h| h.holder.owner == RECALL_OWNER)
                .map(|h| TxnOp::delete(record_key(&keys, ino, h.holder.session, RECALL_OWNER)));
            let puts = local.iter().map(|h| {
                TxnOp::Put(PutOp {
                    key: keys.lock(&LockKey {
                        ino: Ino(ino),
                        session,
                        owner: h.holder.owner,
                        flock: h.holder.flock,
                        start: h.span.start,
                    }),
                    value: LockRecord {
                        write: h.span.write,
                        end: h.span.end,
                        pid: h.span.pid,
                    }
                    .encode(),
                    lease,
                })
            });
            let all = keys.locks(Ino(ino));
            let t = Txn {
                compares: vec![Compare {
                    key: all.start,
                    range_end: Some(all.end),
                    op: CompareOp::Less,
                    target: CompareTarget::ModRevision(rev + 1),
                }],
                success: std::iter::once(TxnOp::delete(mine.clone()))
                    .chain(recalls)
                    .chain(puts)
                    .collect(),
                failure: vec![],
            };
            let resp = run_read(&self.meta, move |kv, _| {
                Box::pin(async move { Ok(kv.txn_idempotent(t).await?) })
            })
            .map_err(|e| errno::meta(&e))?;
            if resp.succeeded {
                self.plocks
                    .delegations_returned
                    .fetch_add(1, Ordering::Relaxed);
                finish(local.clone(), Some(resp.revision));
                return Ok(());
            }
        }
        Err(Errno::EAGAIN)
    }

    /// The recall thread's job, and housekeeping's: gives `ino`'s delegation back (kept
    /// for housekeeping's next try if that fails).
    pub(super) fn return_delegation(&self, ino: u64, recalled: bool) {
        let _one = self.plocks.shard(ino);
        if let Err(e) = self.give_back_locked(ino, recalled) {
            log::warn!("giving the locks of inode {ino} back to etcd: {e:?} (retried)");
            lock(&self.plocks.recall_retry).insert(ino);
        }
    }

    /// Housekeeping: gives back the delegations whose return failed, and those of files no
    /// longer open here (their records would otherwise stay until unmount).
    pub(super) fn return_delegations(&self) {
        let retry: Vec<u64> = lock(&self.plocks.recall_retry).iter().copied().collect();
        for ino in retry {
            self.return_delegation(ino, true);
        }
        let idle: Vec<u64> = lock(&self.plocks.delegated)
            .iter()
            .filter(|(ino, held)| held.is_empty() && self.files.get(**ino).is_none())
            .map(|(ino, _)| *ino)
            .collect();
        for ino in idle {
            self.return_delegation(ino, false);
        }
    }
}

impl EtcFs {
    /// SETLKW on a thread of its own: it may wait for as long as another holder keeps its
    /// lock, which must neither stall a core nor take a pool waiter that the holder's
    /// unlock needs.
    pub(super) fn setlkw(
        &self,
        ctx: &RequestCtx<'_>,
        out: &mut [u8],
        (unique, ino, fh): (u64, u64, u64),
        owner: u64,
        lk: FileLock,
        lk_flags: u32,
    ) -> Reply {
        let Some(d) = ctx.defer() else {
            let r = self
                .inner
                .setlk((ino, fh), owner, lk, lk_flags, Some(unique));
            return to_reply(r, out);
        };
        let threads = &self.inner.plocks.threads;
        if threads.fetch_add(1, Ordering::AcqRel) >= WAITERS_MAX {
            threads.fetch_sub(1, Ordering::AcqRel);
            d.error(Errno::ENOLCK);
            return Reply::Deferred;
        }
        let inner = self.inner.clone();
        let op = inner.begin_op();
        let spawned = std::thread::Builder::new()
            .name("etcfs-lockwait".into())
            .spawn(move || {
                let _op = op.enter();
                match inner.setlk((ino, fh), owner, lk, lk_flags, Some(unique)) {
                    Ok(_) => d.bytes(Vec::new()),
                    Err(e) => d.error(e),
                }
                inner.plocks.threads.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            // The reply went with the closure: dropped unanswered, it answers EIO.
            log::error!("spawning a lock waiter: {e}");
            threads.fetch_sub(1, Ordering::AcqRel);
        }
        Reply::Deferred
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(start: u64, end: u64, write: bool) -> Span {
        Span {
            start,
            end,
            write,
            pid: 7,
        }
    }

    const ME: Holder = Holder {
        session: 1,
        owner: 10,
        flock: false,
    };
    const OTHER: Holder = Holder {
        session: 2,
        owner: 10,
        flock: false,
    };

    #[test]
    fn conflicts_need_overlap_another_holder_and_a_writer() {
        let held = [
            Held {
                holder: OTHER,
                span: sp(10, 19, false),
            },
            Held {
                holder: OTHER,
                span: sp(30, 39, true),
            },
            Held {
                holder: ME,
                span: sp(50, 59, true),
            },
        ];
        assert!(conflict(&held, ME, 0, 9, true).is_none());
        assert!(
            conflict(&held, ME, 15, 25, false).is_none(),
            "readers share"
        );
        assert_eq!(
            conflict(&held, ME, 15, 25, true).map(|h| h.span),
            Some(sp(10, 19, false))
        );
        assert_eq!(
            conflict(&held, ME, 39, 39, false).map(|h| h.span),
            Some(sp(30, 39, true))
        );
        assert!(conflict(&held, ME, 50, 59, true).is_none(), "own locks");
        let flock = Holder { flock: true, ..ME };
        assert!(
            conflict(&held, flock, 0, u64::MAX, true).is_none(),
            "flock and fcntl locks are independent"
        );
        let same_owner_other_node = Holder { session: 2, ..ME };
        assert!(conflict(&held, same_owner_other_node, 50, 50, false).is_some());
    }

    #[test]
    fn apply_splits_merges_and_replaces() {
        // Unlocking the middle splits.
        let own = [sp(0, 99, true)];
        assert_eq!(
            apply(&own, 10, 19, None),
            vec![sp(0, 9, true), sp(20, 99, true)]
        );
        // Adjacent and overlapping ranges of one kind merge.
        let own = [sp(0, 9, false), sp(20, 29, false)];
        assert_eq!(
            apply(&own, 10, 19, Some((false, 7))),
            vec![sp(0, 29, false)]
        );
        assert_eq!(apply(&own, 5, 25, Some((false, 7))), vec![sp(0, 29, false)]);
        // A different kind replaces the part it covers.
        assert_eq!(
            apply(&[sp(0, 99, false)], 40, 59, Some((true, 7))),
            vec![sp(0, 39, false), sp(40, 59, true), sp(60, 99, false)]
        );
        // Whole-file unlock and edges at the ends of the offset space.
        assert_eq!(apply(&[sp(0, u64::MAX, true)], 0, u64::MAX, None), vec![]);
        assert_eq!(
            apply(&[sp(0, u64::MAX, true)], 0, 0, None),
            vec![sp(1, u64::MAX, true)]
        );
        assert_eq!(
            apply(
                &[sp(5, u64::MAX, true)],
                u64::MAX,
                u64::MAX,
                Some((true, 7))
            ),
            vec![sp(5, u64::MAX, true)]
        );
        // Re-locking the same range changes nothing.
        assert_eq!(
            apply(&[sp(1, 2, true)], 1, 2, Some((true, 7))),
            vec![sp(1, 2, true)]
        );
    }

    #[test]
    fn diff_names_the_keys_to_change() {
        let old = [sp(0, 99, true)];
        let new = apply(&old, 10, 19, None);
        let (del, put) = diff(&old, &new);
        assert!(del.is_empty(), "start 0 is rewritten, not deleted");
        assert_eq!(put, vec![sp(0, 9, true), sp(20, 99, true)]);
        let (del, put) = diff(&new, &[]);
        assert_eq!((del, put), (vec![0, 20], vec![]));
        assert_eq!(diff(&old, &old), (vec![], vec![]));
    }

    #[test]
    fn want_decodes_the_kernels_lock() {
        let lk = |typ: i32, start, end| FileLock {
            start,
            end,
            typ: typ as u32,
            pid: 42,
        };
        let w = Want::new(&lk(libc::F_WRLCK, 5, 9), 0).unwrap();
        assert_eq!(
            (w.flock, w.start, w.end, w.lock, w.pid),
            (false, 5, 9, Some(true), 42)
        );
        assert_eq!(Want::new(&lk(libc::F_UNLCK, 0, 0), 0).unwrap().lock, None);
        let f = Want::new(&lk(libc::F_RDLCK, 3, 4), FUSE_LK_FLOCK).unwrap();
        assert_eq!(
            (f.flock, f.start, f.end, f.lock),
            (true, 0, OFFSET_MAX, Some(false))
        );
        assert_eq!(Want::new(&lk(7, 0, 0), 0), Err(Errno::EINVAL));
        assert_eq!(Want::new(&lk(libc::F_RDLCK, 9, 5), 0), Err(Errno::EINVAL));
    }

    #[test]
    fn interrupts_reach_waiters_even_early() {
        let p = Plocks::default();
        p.interrupt(5);
        assert_eq!(p.register(Some(5), 1).err(), Some(Errno::EINTR));
        let w = p.register(Some(6), 1).unwrap();
        let seen = w.changes();
        p.changed(1);
        assert_eq!(w.wait(seen), Ok(()), "a change wakes");
        p.interrupt(6);
        assert_eq!(w.wait(w.changes()), Err(Errno::EINTR));
        drop(w);
        assert!(p.state().files.is_empty() && p.state().waiting.is_empty());
        let many: Vec<_> = (0..WAITERS_MAX as u64)
            .map(|u| p.register(Some(100 + u), 2).unwrap())
            .collect();
        assert_eq!(p.register(Some(1), 2).err(), Some(Errno::ENOLCK));
        drop(many);
        for u in 0..2 * EARLY_INTERRUPTS_MAX as u64 {
            p.interrupt(1000 + u);
        }
        assert_eq!(p.state().early.len(), EARLY_INTERRUPTS_MAX);
    }
}
