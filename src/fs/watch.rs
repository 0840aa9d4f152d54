//! The invalidation thread: one etcd watch over the filesystem's prefix keeps the daemon's
//! caches ([`super::cache`]) coherent with every change, this node's own and other nodes',
//! and tells the kernel about the changes it did not learn from our replies.
//!
//! * `D<parent><name>` put: the name set and entry are updated, and the kernel drops its
//!   entry of the name (INVAL_ENTRY), so a negative entry it cached dies at once.
//!   Delete: the same, with DELETE when the old child is known (INVAL_ENTRY otherwise).
//! * `I<ino>` put/delete: the cached attributes are dropped and the kernel drops its
//!   attributes (INVAL_INODE), and its cached data when size or mtime moved (or when we
//!   cannot tell).
//! * `E<ino><off>` of a file open here: a cached extent map that does not already hold
//!   the change (another node wrote) is dropped and re-read on the next access. The
//!   kernel is not told (other nodes' data reaches it through INVAL_INODE above).
//!
//! # This node's own commits
//!
//! Each revision is first classified with the pipeline's record of this node's commits
//! ([`meta::pipeline::OwnCommits`]; it waits for a commit whose response trails its
//! event, up to [`OWN_WAIT`]). A revision of our own updates the daemon's caches like any
//! other but tells the kernel nothing, because the kernel learnt of it already: every name
//! change (create, mkdir, link, symlink, unlink, rmdir, rename) from our reply; every
//! attribute change from the reply (create, link, setattr, truncate) or by dropping the
//! attributes itself (the parents of a namespace change, a written file, an unlinked one);
//! its page cache holds our own writes. The exception is a coalesced timestamp write (the
//! pipeline's `Touch`, up to a second after the change), which answers nobody: our answers
//! showed those times early (`Caches::apply_times`), but that record is bounded, so the
//! inode's attributes (never its data) are dropped. Orphan reclaims, free maps, inode
//! number reservations and session keys need nothing from the kernel. When the record
//! cannot say (an unknown commit result, a response later than [`OWN_WAIT`], the record
//! overflowed), the caches' marks of our own values still catch most; otherwise the
//! change is reported like another node's: when unsure, we invalidate.
//!
//! Skipping our own changes is what keeps the kernel's directory locks free of
//! notifications under a create load, and what lets a daemon killed with SIGKILL exit: a
//! notification about a name waits, uninterruptibly, for the directory's lock, which a
//! request to this daemon may hold; a killed daemon with a thread stuck there never closes
//! /dev/fuse, so the connection is never aborted and that request never ends. Another
//! node's change to a directory in which requests to this daemon are in flight still does
//! that (see README, "When a daemon dies"): the kernel takes the lock uninterruptibly and
//! a create holds it across its round trip to us, so no check here can close the window.
//!
//! # Restarts
//!
//! When the watch breaks (etcd unreachable, stream ended) the caches stop answering, and
//! the watch is re-established from the revision after the last one applied. The daemon's
//! caches are dropped (refilling is cheap and obviously right), while the replayed events
//! still reach the kernel one by one, so the kernel misses nothing. When that history is
//! compacted away, the missed changes cannot be named: the daemon's caches are dropped and
//! the kernel is told to drop every entry and inode those caches held (the ones it most
//! likely learnt from us, bounded by the cache sizes), sent once the next watch has
//! started; anything else it holds stays until its timeouts (`--entry-timeout`,
//! `--negative-timeout`, `--attr-timeout`) expire, the price of not having a "drop every
//! entry" notification.
//!
//! Notifications are sent from this thread only, with no lock held: the kernel may hold
//! a directory lock while it waits for our reply to a request, and a notification waits
//! for that lock.

use std::{
    sync::{atomic::Ordering, Arc, Weak},
    thread::JoinHandle,
    time::Duration,
};

use meta::{
    cachelock::{CacheLock, LockMode},
    codec::{decode_at, Dentry, InodeAttr},
    error::KvError,
    keys::KeyKind,
    kv::{EventKind, WatchEvent},
    pipeline::Origin,
    types::Revision,
};

use super::{
    cache::{Event, Kernel},
    files, Inner,
};
use crate::data::plan::FileExtent;

/// How often a quiet watch checks whether the filesystem is stopping.
const POLL: Duration = Duration::from_millis(200);
/// Waits between attempts to re-establish a broken watch.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// How long after sending a commit its response may trail its watch event: until then
/// the event waits to learn whether the commit was ours. Normally both arrive within
/// microseconds; past it the change counts as another node's and the kernel is told.
const OWN_WAIT: Duration = Duration::from_secs(2);

pub(super) fn start(inner: &Arc<Inner>) -> std::io::Result<JoinHandle<()>> {
    let weak = Arc::downgrade(inner);
    std::thread::Builder::new()
        .name("etcfs-inval".into())
        .spawn(move || run(&weak))
}

fn stopping(weak: &Weak<Inner>) -> bool {
    weak.upgrade()
        .is_none_or(|i| i.stopping.load(Ordering::Acquire))
}

fn pause(weak: &Weak<Inner>, d: Duration) {
    let step = Duration::from_millis(50);
    let mut waited = Duration::ZERO;
    while waited < d && !stopping(weak) {
        std::thread::sleep(step);
        waited += step;
    }
}

fn run(weak: &Weak<Inner>) {
    // The last revision applied, to resume after; None: start from now.
    let mut resume: Option<i64> = None;
    let mut backoff = RETRY_MIN;
    // What the kernel may hold from before a break (named when the caches were dropped for
    // the resume), until the resumed watch proves its history is there (its first batch).
    let mut unconfirmed: Vec<Kernel> = Vec::new();
    // After a compaction: what to drop in the kernel once the next watch has started.
    let mut owed: Vec<Kernel> = Vec::new();
    loop {
        if stopping(weak) {
            return;
        }
        let Some(i) = weak.upgrade() else { return };
        let now = match i.meta.revision().and_then(|t| t.wait()) {
            Ok(r) => r.0,
            Err(e) => {
                log::warn!("cache watch: reading the etcd revision: {e}");
                drop(i);
                pause(weak, backoff);
                backoff = (backoff * 2).min(RETRY_MAX);
                continue;
            }
        };
        let from = resume.map_or(now + 1, |a| a + 1);
        let w = i.meta.watch_prefix(Revision(from));
        if resume.is_some() {
            let named = i.caches.drop_all_named();
            merge(&mut unconfirmed, named, i.caches.named_max());
        }
        i.caches.go_live(now);
        if !owed.is_empty() {
            // Only now: the watch covers every change after `now`, and any the kernel
            // re-reads after these are at least that new.
            notify(&i, std::mem::take(&mut owed));
        }
        drop(i);
        let end = loop {
            match w.next(POLL) {
                Ok(None) => {
                    if stopping(weak) {
                        return;
                    }
                }
                Ok(Some(batch)) => {
                    let Some(i) = weak.upgrade() else { return };
                    unconfirmed = Vec::new();
                    apply(&i, &batch);
                    backoff = RETRY_MIN;
                }
                Err(e) => break e,
            }
        };
        let Some(i) = weak.upgrade() else { return };
        if i.stopping.load(Ordering::Acquire) {
            return;
        }
        i.caches.suspend();
        match end {
            KvError::Compacted { compact_revision } => {
                log::warn!(
                    "cache watch: history compacted (at {compact_revision}) past revision {}; \
                     dropping every cache and the kernel's entries of what they held",
                    i.caches.applied()
                );
                i.caches.n.watch_resyncs.fetch_add(1, Ordering::Relaxed);
                // Events were missed: what is known of lock holders may lack one, and an
                // acquire trusting it could be granted beside it.
                i.locks.forget_known();
                let max = i.caches.named_max();
                owed = std::mem::take(&mut unconfirmed);
                merge(&mut owed, i.caches.drop_all_named(), max);
                resume = None;
            }
            e => {
                log::warn!(
                    "cache watch broke: {e}; resuming after revision {}",
                    i.caches.applied()
                );
                i.caches.n.watch_restarts.fetch_add(1, Ordering::Relaxed);
                resume = Some(i.caches.applied());
                drop(i);
                pause(weak, backoff);
                backoff = (backoff * 2).min(RETRY_MAX);
            }
        }
    }
}

/// Adds `more` to `into` without duplicates, keeping at most `max` (best effort: the
/// kernel's timeouts bound what is left out).
fn merge(into: &mut Vec<Kernel>, more: Vec<Kernel>, max: usize) {
    let mut seen: std::collections::HashSet<Kernel> = into.drain(..).collect();
    for k in more {
        if seen.len() >= max {
            break;
        }
        seen.insert(k);
    }
    into.extend(seen);
}

/// Applies one batch of events in revision order, then tells the kernel.
fn apply(i: &Inner, batch: &[WatchEvent]) {
    let mut kernel: Vec<Kernel> = Vec::new();
    let mut rest = batch;
    while let Some(first) = rest.first() {
        let rev = first.kv.mod_revision;
        let n = rest
            .iter()
            .position(|e| e.kv.mod_revision != rev)
            .unwrap_or(rest.len());
        let (events, tail) = rest.split_at(n);
        rest = tail;
        let origin = i.meta.own_commits().classify(rev, OWN_WAIT);
        if let Origin::Own { .. } = origin {
            i.caches
                .n
                .watch_revisions_own
                .fetch_add(1, Ordering::Relaxed);
        }
        i.caches.begin(rev);
        let from = kernel.len();
        for ev in events {
            apply_event(i, rev, ev, &mut kernel);
        }
        i.caches.end(rev);
        if let Origin::Own { unreplied } = origin {
            let before = kernel.len() - from;
            let own: Vec<Kernel> = kernel
                .drain(from..)
                .filter_map(|k| own_kernel(k, &unreplied))
                .collect();
            i.caches
                .n
                .kernel_skipped_own
                .fetch_add((before - own.len()) as u64, Ordering::Relaxed);
            kernel.extend(own);
        }
    }
    notify(i, kernel);
}

/// What the kernel still needs of this node's own commit. It learnt every name change
/// from our reply (create, link, unlink, rename), and every attribute change either from
/// the reply (create, link, setattr) or by dropping the attributes itself (the parents of
/// a namespace change, a written or unlinked file); nor do our own writes leave it stale
/// data. What nobody was answered for are the coalesced timestamp writes, whose times our
/// answers showed early but which an evicted pending time may have missed: those
/// attributes are dropped (never data: only times moved).
fn own_kernel(k: Kernel, unreplied: &[u64]) -> Option<Kernel> {
    match k {
        Kernel::InvalInode { ino, .. } if unreplied.contains(&ino) => {
            Some(Kernel::InvalInode { ino, data: false })
        }
        _ => None,
    }
}

/// Applies one event to the daemon's caches; what the kernel must drop goes to `kernel`.
fn apply_event(i: &Inner, rev: i64, ev: &WatchEvent, kernel: &mut Vec<Kernel>) {
    let keys = i.meta.keys();
    let put = ev.kind == EventKind::Put;
    match keys.parse(&ev.kv.key) {
        Some(KeyKind::Inode(ino)) => {
            let attr = if put {
                decode_at::<InodeAttr>(keys, &ev.kv.key, &ev.kv.value).ok()
            } else {
                None
            };
            let e = Event::Inode {
                ino: ino.0,
                attr: attr.clone(),
                deleted: !put,
            };
            let regular = attr
                .as_ref()
                .is_none_or(|a| a.kind == meta::types::FileType::Regular);
            if let Some(k) = i.caches.event(rev, &e) {
                // A regular file's pages and attributes are the cache locks' to drop (by
                // the holder, before it gives the lock up), not this thread's. Dropping
                // its pages here could stall the watch on a page that a READ waiting for
                // the lock has locked, and that READ waits for the watch's events; and
                // dropping its attributes here makes the kernel discard the answer of a
                // GETATTR in flight, which had waited for exactly this commit (found by
                // tests/cluster.rs: a reader's size stayed 0 after the writer's write).
                if !regular {
                    kernel.push(refine_inode(i, k, attr.as_ref()));
                }
            }
        }
        Some(KeyKind::Dentry(parent, name)) => {
            let new = if put {
                match decode_at::<Dentry>(keys, &ev.kv.key, &ev.kv.value) {
                    Ok(d) => Some(d),
                    Err(e) => {
                        log::error!("cache watch: {e}");
                        i.caches.forget_name(parent.0, &name);
                        kernel.push(Kernel::InvalEntry {
                            parent: parent.0,
                            name,
                        });
                        return;
                    }
                }
            } else {
                None
            };
            let e = Event::Dentry {
                parent: parent.0,
                name,
                new,
            };
            if let Some(k) = i.caches.event(rev, &e) {
                kernel.push(k);
                // The kernel's copy of the directory's listing (FOPEN_CACHE_DIR) is in
                // its pages: a name change it did not make itself drops them.
                kernel.push(Kernel::InvalInode {
                    ino: parent.0,
                    data: true,
                });
            }
        }
        Some(KeyKind::Extent(ino, off)) => extent_changed(i, ino.0, off, put, &ev.kv.value),
        // The kernel caches an inode's ACL apart from its attributes, and may have read it
        // without holding a regular file's lock (the permission check before OPEN): an ACL
        // another node set, changed (chmod rewrites the mask) or removed is told to the
        // kernel as an attribute drop, which makes it forget the ACL. Only on ACL events,
        // not on every change of a file with an ACL (the inode arm above says why not).
        Some(KeyKind::Xattr(ino, name))
            if name == meta::acl::ACCESS_NAME || name == meta::acl::DEFAULT_NAME =>
        {
            kernel.push(Kernel::InvalInode {
                ino: ino.0,
                data: false,
            });
        }
        Some(KeyKind::SpaceWanted(asker)) if put => i.space_wanted_by(asker),
        Some(KeyKind::Evict(s)) if put => i.evicted(s),
        Some(KeyKind::CacheWant(ino, asker)) if put && asker != i.locks.me() => {
            match decode_at::<CacheLock>(keys, &ev.kv.key, &ev.kv.value) {
                Ok(c) => i.locks.asked(ino.0, c.mode),
                // Unreadable: give way as to a writer.
                Err(e) => {
                    log::warn!("cache watch: {e}");
                    i.locks.asked(ino.0, LockMode::Exclusive);
                }
            }
        }
        Some(KeyKind::CacheLock(ino, holder)) => {
            let mode = put.then(|| {
                decode_at::<CacheLock>(keys, &ev.kv.key, &ev.kv.value)
                    .ok()
                    .map(|c| c.mode)
            });
            i.locks.holders_changed(ino.0, rev, holder, mode);
            if holder == i.locks.me() && put {
                i.locks.put_seen(ino.0, rev);
            }
            if holder == i.locks.me() && !put && i.locks.lost(ino.0, rev) {
                // Deleted with its file by another node: nothing cached stays.
                i.caches.forget_attr(ino.0);
                i.files.forget_extents(ino.0);
            }
        }
        // Any change may free a range (a delete, a split, a downgrade): waiters re-read.
        Some(KeyKind::Lock(l)) => i.plocks.key_changed(&l, put),
        _ => {}
    }
}

/// An inode event of a file open here whose state already equals the new attributes is
/// our own change (the kernel knows it); otherwise keep the data decision, sharpened by
/// the open file's attributes when the cache had none.
fn refine_inode(i: &Inner, k: Kernel, new: Option<&InodeAttr>) -> Kernel {
    let Kernel::InvalInode { ino, data } = k else {
        return k;
    };
    let (Some(st), Some(new)) = (i.files.get(ino), new) else {
        return k;
    };
    let Some(f) = st.try_lock() else { return k };
    if &f.attr == new {
        return Kernel::InvalInode { ino, data: false };
    }
    let data = data && !(f.attr.size == new.size && f.attr.mtime == new.mtime);
    Kernel::InvalInode { ino, data }
}

/// An extent key of `ino` changed: a cached map of an open file that does not already
/// hold the change is dropped (re-read on the next access).
fn extent_changed(i: &Inner, ino: u64, off: u64, put: bool, value: &[u8]) {
    i.caches.forget_blocks(ino);
    let Some(st) = i.files.get(ino) else { return };
    // Blocking on the file's lock is fine here: its holder (a write) waits for etcd,
    // never for this thread.
    let mut f = st.lock();
    let Some(map) = f.extents.as_ref() else {
        return;
    };
    let consistent = if put {
        match meta::codec::Extent::decode_value(off, value) {
            Ok(e) => {
                // Held when one cached extent maps the same range the same way (the cache
                // merges neighbours that etcd keeps as separate keys).
                let want = FileExtent::from(&e);
                files::overlapping(map, off, 1).iter().any(|c| {
                    c.file_off <= want.file_off
                        && c.file_off + c.len >= want.file_off + want.len
                        && c.dev_off + (want.file_off - c.file_off) == want.dev_off
                        && c.unwritten == want.unwritten
                })
            }
            Err(_) => false,
        }
    } else {
        !map.iter().any(|e| e.file_off == off)
    };
    if !consistent {
        // Kept while writes of this node are pending in it (see `Files::forget_extents`).
        f.forget_extents();
    }
}

/// Sends the notifications (the counters count them even before the session runs, when
/// there is no kernel to tell: unit tests read them).
fn notify(i: &Inner, kernel: Vec<Kernel>) {
    if kernel.is_empty() {
        return;
    }
    // Sent after the whole batch is applied, so once is enough (a batch of another
    // node's creates in one directory drops its listing once).
    let mut seen = std::collections::HashSet::new();
    let kernel: Vec<Kernel> = kernel
        .into_iter()
        .filter(|k| seen.insert(k.clone()))
        .collect();
    // Whatever the kernel drops here a READDIRPLUS gives it whole again.
    i.forget_plus_given(kernel.iter().filter_map(|k| match k {
        Kernel::InvalInode { ino, .. } => Some(*ino),
        Kernel::Delete { child, .. } => Some(*child),
        Kernel::InvalEntry { .. } => None,
    }));
    let c = &i.caches.n;
    for k in &kernel {
        match k {
            Kernel::InvalEntry { .. } => &c.kernel_inval_entry,
            Kernel::Delete { .. } => &c.kernel_delete,
            Kernel::InvalInode { data: false, .. } => &c.kernel_inval_inode,
            Kernel::InvalInode { data: true, .. } => {
                c.kernel_inval_inode.fetch_add(1, Ordering::Relaxed);
                &c.kernel_inval_data
            }
        }
        .fetch_add(1, Ordering::Relaxed);
    }
    let Some(n) = super::lock(&i.notifier)
        .clone()
        .or_else(|| super::PROCESS_NOTIFIER.get().cloned())
    else {
        return;
    };
    for k in kernel {
        let r = match &k {
            Kernel::InvalEntry { parent, name } => n.inval_entry(*parent, name),
            // DELETE fails when the kernel's entry points elsewhere; drop it anyway.
            Kernel::Delete {
                parent,
                child,
                name,
            } => n
                .delete(*parent, *child, name)
                .or_else(|_| n.inval_entry(*parent, name)),
            Kernel::InvalInode { ino, data: true } => n.inval_inode(*ino, 0, 0),
            Kernel::InvalInode { ino, data: false } => n.inval_inode(*ino, -1, 0),
        };
        if let Err(e) = r {
            log::debug!("kernel invalidation {k:?}: {e}");
        }
    }
}
