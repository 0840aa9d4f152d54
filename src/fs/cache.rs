//! The daemon's metadata caches and the rules that keep them coherent with etcd.
//!
//! Three caches, each split into shards by key hash (one lock per shard, `shards` of them,
//! sized from the core count so two cores rarely meet on one lock), each bounded and
//! evicting with CLOCK ([`super::clock`]):
//!
//! * inodes: ino → attributes (`inode_cache_max` inodes);
//! * dentries: (parent, name) → entry or "absent" (`dentry_cache_max` entries), for names
//!   looked up one by one (directories too large for a name set) and for this node's own
//!   namespace changes;
//! * name sets: directory → its whole set of names, read in one range
//!   (`dir_names_cache_max` names summed over all directories), or the marker "larger than
//!   `dir_names_max`". A lookup in a directory with a name set never reaches etcd, whether
//!   the name is there or not.
//!
//! # Coherence
//!
//! Every value carries the etcd revision it is valid at. One etcd watch over the
//! filesystem's prefix feeds [`Caches::event`] in revision order (one batch per revision,
//! between [`Caches::begin`] and [`Caches::end`]); an event drops (inodes, dentries) or
//! applies (name sets) the change when it is newer than the cached value.
//!
//! A value read from etcd at revision `R` races with the watch: events after `R` may have
//! been processed before the value is installed. The watch therefore also appends every
//! event to a bounded log, and an install replays the log's events after `R` for its key
//! (a name set applies them; an inode or dentry with a newer event is not installed). When
//! the log no longer reaches back to `R` (`floor`), or the watch is not running, nothing is
//! installed and nothing is answered from the caches.
//!
//! This node's own committed changes are installed at once (read-your-writes) with their
//! commit revision and marked as our own, unless the watch has already started a later
//! revision (then the watch has applied them, or something newer). When the watch later
//! delivers that same revision, the mark tells it the kernel already knows: no
//! invalidation is sent. The watch mostly knows that from the revision itself (the
//! pipeline records its commits' revisions; `super::watch`); the marks cover what that
//! record cannot vouch for. Everything else the watch reports is invalidated in the
//! kernel too ([`Kernel`]).

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering},
        Mutex, MutexGuard, PoisonError,
    },
};

use meta::{
    codec::{Dentry, InodeAttr},
    types::Timespec,
};

use super::clock::ClockCache;
use crate::data::plan::FileExtent;

/// Cache limits. Every one is a bound with its unit in the name's doc.
#[derive(Clone, Debug)]
pub(crate) struct CacheConfig {
    /// Inodes whose attributes are cached.
    pub inode_cache_max: usize,
    /// (parent, name) entries cached, present or absent.
    pub dentry_cache_max: usize,
    /// Names held in directory name sets, summed over every cached directory.
    pub dir_names_cache_max: usize,
    /// Names one directory may have for its name set to be read in one range; a larger
    /// directory is looked up name by name.
    pub dir_names_max: usize,
    /// Lock shards per cache.
    pub shards: usize,
}

/// Defaults (inodes, entries, names). Inodes: as many as the locks a node keeps
/// (`locks::LOCKS_MAX`): a file whose lock is held but whose attributes were pushed out
/// is read from etcd again at its next use, one round trip each (at 65,536, `ls -l` of
/// 100,000 files read most of them twice: benches/listing_cost.sh). About 200 bytes each.
pub(crate) const INODE_CACHE_MAX: usize = super::locks::LOCKS_MAX;
/// Entries: as many again. A directory over `DIR_NAMES_MAX` names is resolved name by
/// name from these, filled a page at a time by listings; when they were fewer than the
/// names a walk stats (`find -ls` of 100,000 files, in inode order), most lookups went
/// to etcd one round trip each (185 s: benches/listing.sh). About 100 bytes each.
pub(crate) const DENTRY_CACHE_MAX: usize = super::locks::LOCKS_MAX;
pub(crate) const DIR_NAMES_CACHE_MAX: usize = 262_144;
#[cfg_attr(
    not(test),
    allow(dead_code, reason = "the CLI's default is the same number")
)]
pub(crate) const DIR_NAMES_MAX: usize = 4096;
/// Extents held in the maps of files closed here ([`Caches::stash_closed_map`]), summed:
/// 16 bytes each, 1 MiB in all.
const CLOSED_MAP_EXTENTS_MAX: usize = 1 << 16;
/// Inodes with times this node moved that etcd does not show yet (coalesced writes).
pub(crate) const PENDING_TIMES_MAX: usize = 16384;
/// Watch events remembered for installs that race with the watch.
const EVENT_LOG_MAX: usize = 16384;

impl CacheConfig {
    /// Defaults with shards for `cores` cores.
    pub(crate) fn for_cores(cores: usize, dir_names_max: usize) -> Self {
        CacheConfig {
            inode_cache_max: INODE_CACHE_MAX,
            dentry_cache_max: DENTRY_CACHE_MAX,
            dir_names_cache_max: DIR_NAMES_CACHE_MAX,
            dir_names_max,
            shards: (cores.max(1) * 4).next_power_of_two(),
        }
    }
}

/// A cached value, the revision it is valid at, and whether this node's own commit put it
/// there.
#[derive(Clone, Debug)]
struct Ver<T> {
    val: T,
    rev: i64,
    own: bool,
}

enum DirSet {
    Names(NameSet),
    /// More than `dir_names_max` names: look names up one by one.
    TooBig,
}

struct NameSet {
    /// The revision the set was read at; events up to it are already in it.
    rev: i64,
    names: HashMap<Vec<u8>, Dentry>,
}

impl NameSet {
    fn apply(&mut self, name: &[u8], new: Option<Dentry>, rev: i64) -> Option<Dentry> {
        if rev <= self.rev {
            return self.names.get(name).copied();
        }
        match new {
            Some(d) => self.names.insert(name.to_vec(), d),
            None => self.names.remove(name),
        }
    }
}

/// What a lookup found in the caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// The name exists.
    Found(Dentry),
    /// The name is known to be absent.
    Absent,
    /// Not cached. `too_big`: the directory is known to exceed `dir_names_max`.
    Unknown { too_big: bool },
}

/// A change reported by the watch, decoded.
#[derive(Clone, Debug)]
pub(crate) enum Event {
    /// `I<ino>` put (attributes, `None` when undecodable) or deleted (`deleted`).
    Inode {
        ino: u64,
        attr: Option<InodeAttr>,
        deleted: bool,
    },
    /// `D<parent><name>` put (`Some`) or deleted (`None`).
    Dentry {
        parent: u64,
        name: Vec<u8>,
        new: Option<Dentry>,
    },
}

/// What the kernel must be told after an event.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kernel {
    /// Drop the entry (positive or negative) of `name` in `parent`.
    InvalEntry { parent: u64, name: Vec<u8> },
    /// `name` in `parent`, which was `child`, is gone.
    Delete {
        parent: u64,
        child: u64,
        name: Vec<u8>,
    },
    /// Drop the inode's attributes, and its cached data with `data`.
    InvalInode { ino: u64, data: bool },
}

#[derive(Clone, Debug)]
enum LogKey {
    Inode(u64),
    Dentry(u64, Vec<u8>, Option<Dentry>),
}

struct Log {
    events: VecDeque<(i64, LogKey)>,
    /// Every event after this revision is in `events`; `None` while the watch is not
    /// running (nothing may be installed).
    floor: Option<i64>,
}

impl Log {
    fn after(&self, rev: i64) -> impl Iterator<Item = &(i64, LogKey)> {
        let from = self.events.partition_point(|(r, _)| *r <= rev);
        self.events.range(from..)
    }

    /// Whether a value read at `rev` may be installed (the log covers everything after it).
    fn covers(&self, rev: i64) -> bool {
        self.floor.is_some_and(|f| rev >= f)
    }
}

/// Hit counters of one shard (kept under its lock: no shared atomics on the hit path).
#[derive(Default, Clone, Copy)]
struct Hits {
    attr: u64,
    dentry: u64,
    negative: u64,
    dir_names: u64,
}

struct Shard<K, V> {
    c: ClockCache<K, V>,
    hits: Hits,
}

struct Sharded<K, V> {
    shards: Vec<Mutex<Shard<K, V>>>,
}

impl<K: std::hash::Hash + Eq + Clone, V> Sharded<K, V> {
    fn new(shards: usize, max: usize) -> Self {
        let n = shards.max(1);
        let per = max.div_ceil(n).max(1);
        Sharded {
            shards: (0..n)
                .map(|_| {
                    Mutex::new(Shard {
                        c: ClockCache::new(per),
                        hits: Hits::default(),
                    })
                })
                .collect(),
        }
    }

    fn at(&self, hash: u64) -> MutexGuard<'_, Shard<K, V>> {
        let i = (hash % self.shards.len() as u64) as usize;
        self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn each(&self, mut f: impl FnMut(&mut Shard<K, V>)) {
        for s in &self.shards {
            f(&mut s.lock().unwrap_or_else(PoisonError::into_inner));
        }
    }
}

fn mix(x: u64) -> u64 {
    let x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^ (x >> 29)
}

fn name_hash(parent: u64, name: &[u8]) -> u64 {
    mix(parent ^ meta::keys::dir_cookie(name))
}

/// Counters (misses and watch activity; hits live in the shards).
#[derive(Default)]
pub(crate) struct MissCounters {
    pub attr_misses: AtomicU64,
    pub dentry_misses: AtomicU64,
    pub negative_misses: AtomicU64,
    pub dir_names_misses: AtomicU64,
    pub dir_names_loads: AtomicU64,
    pub dir_names_over_limit: AtomicU64,
    pub lookups_etcd: AtomicU64,
    pub watch_events: AtomicU64,
    pub watch_events_own: AtomicU64,
    pub watch_revisions_own: AtomicU64,
    pub kernel_skipped_own: AtomicU64,
    pub watch_restarts: AtomicU64,
    pub watch_resyncs: AtomicU64,
    pub kernel_inval_entry: AtomicU64,
    pub kernel_delete: AtomicU64,
    pub kernel_inval_inode: AtomicU64,
    pub kernel_inval_data: AtomicU64,
    /// Epoch bumps: a namespace change that etcd refused against this node's view.
    pub kernel_epochs: AtomicU64,
    /// Cluster cache locks taken from etcd, waits for another node, given up, downgraded.
    pub cache_locks_taken: AtomicU64,
    pub cache_lock_waits: AtomicU64,
    pub cache_locks_released: AtomicU64,
    pub cache_locks_downgraded: AtomicU64,
    /// Shared locks upgraded by a WRITE while this node was giving them up.
    pub cache_locks_upgraded_in_release: AtomicU64,
    /// WRITEs answered EINTR: two nodes each upgrading in a release waited for the other.
    pub cache_lock_writes_interrupted: AtomicU64,
    /// Listings' lock grants taken ahead on the share thread, and READDIRPLUS calls
    /// that waited for one.
    pub listing_grants_ahead: AtomicU64,
    pub listing_grant_waits: AtomicU64,
    /// Opens that took the map kept at the file's last close here instead of etcd's.
    pub maps_kept_at_close: AtomicU64,
    /// Keys of ours deleted that this node did not know it held (late grants).
    pub cache_locks_strays: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The extent map a regular file had when it was last closed here, and the grant of its
/// cluster lock (the revision it was granted at) under which that map was current.
#[derive(Debug, Clone)]
pub(crate) struct ClosedMap {
    pub(crate) extents: Vec<FileExtent>,
    pub(crate) granted_rev: i64,
    /// The extent keys the file's last commit here left, when known from its first
    /// ([`super::files::FileInner::full_map_record`]): what an unlink of it releases
    /// without reading. (`extents` is the map as this node serves it, merged across
    /// commits, so it need not match the keys.)
    pub(crate) keys: Option<Vec<meta::codec::Extent>>,
}

/// The three caches and their coherence state.
pub(crate) struct Caches {
    cfg: CacheConfig,
    inodes: Sharded<u64, Ver<InodeAttr>>,
    dentries: Sharded<(u64, Vec<u8>), Ver<Option<Dentry>>>,
    dirs: Sharded<u64, DirSet>,
    /// Directory mtime/ctime (create, unlink, rename, link) and inode ctime (xattrs) that
    /// this node's commits moved and the pipeline writes to etcd coalesced, up to a
    /// second later: shown in every answer at once (read-your-writes), until the
    /// attributes this node sees reach them.
    times: Sharded<u64, (Option<Timespec>, Timespec)>,
    /// Regular files' allocated 512-byte blocks, summed from their extent maps (st_blocks
    /// of files not open here). Dropped on any extent change (the watch, own commits).
    blocks: Sharded<u64, u64>,
    /// Bumped by every drop of `blocks`: a sum computed from extents read before a drop
    /// is not installed.
    blocks_gen: AtomicU64,
    /// Maps of files closed here, for their next open here under the same lock grant
    /// (an open otherwise reads the map from etcd). Dropped with `blocks`, and the drop of
    /// one inode's bumps `blocks_gen` under its shard's lock, so that a map captured
    /// before a change is never stashed after it.
    closed_maps: Sharded<u64, ClosedMap>,
    log: Mutex<Log>,
    /// The watch is running and caught up: answers and installs are allowed.
    live: AtomicBool,
    /// Revision of the watch batch being applied (or last applied).
    started: AtomicI64,
    /// Revision of the last watch batch fully applied.
    applied: AtomicI64,
    pub(crate) n: MissCounters,
}

impl Caches {
    /// Empty caches, not live until [`Caches::go_live`].
    pub(crate) fn new(cfg: CacheConfig) -> Self {
        Caches {
            inodes: Sharded::new(cfg.shards, cfg.inode_cache_max),
            dentries: Sharded::new(cfg.shards, cfg.dentry_cache_max),
            // Fewer shards for name sets when needed, so that one shard can always hold
            // the largest set (`dir_names_max` names) within the total bound.
            dirs: Sharded::new(
                cfg.shards
                    .min(cfg.dir_names_cache_max / (cfg.dir_names_max + 1))
                    .max(1),
                cfg.dir_names_cache_max,
            ),
            times: Sharded::new(cfg.shards, PENDING_TIMES_MAX),
            blocks: Sharded::new(cfg.shards, cfg.inode_cache_max),
            blocks_gen: AtomicU64::new(0),
            closed_maps: Sharded::new(cfg.shards, CLOSED_MAP_EXTENTS_MAX),
            log: Mutex::new(Log {
                events: VecDeque::new(),
                floor: None,
            }),
            live: AtomicBool::new(false),
            started: AtomicI64::new(0),
            applied: AtomicI64::new(0),
            n: MissCounters::default(),
            cfg,
        }
    }

    pub(crate) fn dir_names_max(&self) -> usize {
        self.cfg.dir_names_max
    }

    fn log(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    // ---- the request path ----

    /// Cached attributes of `ino`.
    pub(crate) fn attr(&self, ino: u64) -> Option<InodeAttr> {
        self.attr_at(ino).map(|(a, _)| a)
    }

    /// What the caches know of `name` in `parent`.
    pub(crate) fn lookup(&self, parent: u64, name: &[u8]) -> Lookup {
        if !self.is_live() {
            return Lookup::Unknown { too_big: false };
        }
        let h = name_hash(parent, name);
        let point = {
            let mut s = self.dentries.at(h);
            s.c.get(&(parent, name.to_vec()) as &(u64, Vec<u8>))
                .map(|v| (v.val, v.rev))
        };
        let mut s = self.dirs.at(mix(parent));
        let (answer, too_big) = match (s.c.get(&parent), point) {
            (Some(DirSet::Names(set)), Some((d, rev))) if rev > set.rev => (Some(d), false),
            (Some(DirSet::Names(set)), _) => (Some(set.names.get(name).copied()), false),
            (Some(DirSet::TooBig), p) => (p.map(|(d, _)| d), true),
            (None, p) => (p.map(|(d, _)| d), false),
        };
        match answer {
            Some(Some(d)) => {
                s.hits.dentry += 1;
                if !too_big {
                    s.hits.dir_names += 1;
                }
                Lookup::Found(d)
            }
            Some(None) => {
                s.hits.negative += 1;
                if !too_big {
                    s.hits.dir_names += 1;
                }
                Lookup::Absent
            }
            None => Lookup::Unknown { too_big },
        }
    }

    // ---- installs of values read from etcd ----

    /// Installs attributes read at store revision `read_rev`.
    pub(crate) fn fill_attr(&self, attr: &InodeAttr, read_rev: i64) {
        let ino = attr.ino.0;
        let mut s = self.inodes.at(mix(ino));
        if s.c.get_mut(&ino).is_some_and(|v| v.rev >= read_rev) {
            return;
        }
        {
            let log = self.log();
            if !self.is_live() || !log.covers(read_rev) {
                return;
            }
            if log
                .after(read_rev)
                .any(|(_, k)| matches!(k, LogKey::Inode(i) if *i == ino))
            {
                return;
            }
        }
        s.c.insert(
            ino,
            Ver {
                val: attr.clone(),
                rev: read_rev,
                own: false,
            },
            1,
        );
    }

    /// Installs one looked-up name (present or absent) read at `read_rev`.
    pub(crate) fn fill_dentry(&self, parent: u64, name: &[u8], d: Option<Dentry>, read_rev: i64) {
        let key = (parent, name.to_vec());
        let mut s = self.dentries.at(name_hash(parent, name));
        if s.c.get_mut(&key).is_some_and(|v| v.rev >= read_rev) {
            return;
        }
        {
            let log = self.log();
            if !self.is_live() || !log.covers(read_rev) {
                return;
            }
            if log
                .after(read_rev)
                .any(|(_, k)| matches!(k, LogKey::Dentry(p, n, _) if *p == parent && n == name))
            {
                return;
            }
        }
        s.c.insert(
            key,
            Ver {
                val: d,
                rev: read_rev,
                own: false,
            },
            1,
        );
    }

    /// Installs a directory's whole name set read at `read_rev`.
    pub(crate) fn fill_dir(
        &self,
        parent: u64,
        entries: impl IntoIterator<Item = (Vec<u8>, Dentry)>,
        read_rev: i64,
    ) {
        let mut set = NameSet {
            rev: read_rev,
            names: entries.into_iter().collect(),
        };
        let mut s = self.dirs.at(mix(parent));
        if let Some(DirSet::Names(old)) = s.c.get_mut(&parent) {
            if old.rev >= read_rev {
                return;
            }
        }
        {
            let log = self.log();
            if !self.is_live() || !log.covers(read_rev) {
                return;
            }
            for (rev, k) in log.after(read_rev) {
                if let LogKey::Dentry(p, n, new) = k {
                    if *p == parent {
                        set.apply(n, *new, *rev);
                    }
                }
            }
        }
        let w = set.names.len() + 1;
        if !s.c.insert(parent, DirSet::Names(set), w) {
            // Heavier than the whole cache can hold: look names up one by one rather
            // than read the set again on every lookup.
            s.c.insert(parent, DirSet::TooBig, 1);
        }
    }

    /// Remembers that `parent` has more names than `dir_names_max`.
    pub(crate) fn fill_too_big(&self, parent: u64) {
        if !self.is_live() {
            return;
        }
        self.dirs
            .at(mix(parent))
            .c
            .insert(parent, DirSet::TooBig, 1);
    }

    // ---- this node's own commits ----

    fn may_install_own(&self, rev: i64) -> bool {
        rev > 0 && self.is_live() && rev >= self.started.load(Ordering::Acquire)
    }

    /// Attributes this node committed at `rev`.
    pub(crate) fn own_attr(&self, attr: &InodeAttr, rev: i64) {
        let ino = attr.ino.0;
        let mut s = self.inodes.at(mix(ino));
        if !self.may_install_own(rev) {
            s.c.remove(&ino);
            return;
        }
        if s.c.get_mut(&ino).is_some_and(|v| v.rev > rev) {
            return;
        }
        s.c.insert(
            ino,
            Ver {
                val: attr.clone(),
                rev,
                own: true,
            },
            1,
        );
    }

    /// A name this node created (`Some`) or removed (`None`) in a commit at `rev`.
    pub(crate) fn own_dentry(&self, parent: u64, name: &[u8], d: Option<Dentry>, rev: i64) {
        let key = (parent, name.to_vec());
        let mut s = self.dentries.at(name_hash(parent, name));
        if !self.may_install_own(rev) {
            s.c.remove(&key);
            drop(s);
            // Live but behind the watch: the watch has put the change into the name set
            // already. Not live: the set is unused until the watch has caught up (and
            // then holds the change), but drop it anyway to be safe.
            if !self.is_live() {
                self.forget_dir(parent);
            }
            return;
        }
        if s.c.get_mut(&key).is_some_and(|v| v.rev > rev) {
            return;
        }
        s.c.insert(
            key,
            Ver {
                val: d,
                rev,
                own: true,
            },
            1,
        );
    }

    /// Times this node's commit moved for `ino` (mtime when `Some`, and ctime) that etcd
    /// will show only after the coalesced write.
    pub(crate) fn own_times(&self, ino: u64, mtime: Option<Timespec>, ctime: Timespec) {
        let mut s = self.times.at(mix(ino));
        if let Some(v) = s.c.get_mut(&ino) {
            v.0 = v.0.max(mtime);
            v.1 = v.1.max(ctime);
            return;
        }
        // Past the bound the oldest go first: those were written to etcd long ago.
        s.c.insert(ino, (mtime, ctime), 1);
    }

    /// Forgets pending times of `ino` (an explicit SETATTR answers for its times).
    pub(crate) fn forget_times(&self, ino: u64) {
        self.times.at(mix(ino)).c.remove(&ino);
    }

    /// Applies pending times to attributes about to be answered; forgets them once the
    /// attributes show them.
    pub(crate) fn apply_times(&self, attr: &mut InodeAttr) {
        let ino = attr.ino.0;
        let mut s = self.times.at(mix(ino));
        let Some(&(m, c)) = s.c.get(&ino) else {
            return;
        };
        if m.is_none_or(|m| attr.mtime >= m) && attr.ctime >= c {
            s.c.remove(&ino);
            return;
        }
        if let Some(m) = m {
            attr.mtime = attr.mtime.max(m);
        }
        attr.ctime = attr.ctime.max(c);
    }

    /// The cached allocated blocks of a regular file.
    pub(crate) fn blocks(&self, ino: u64) -> Option<u64> {
        if !self.is_live() {
            return None;
        }
        self.blocks.at(mix(ino)).c.get(&ino).copied()
    }

    /// The generation to pass to [`Caches::fill_blocks`], taken before reading extents.
    pub(crate) fn blocks_gen(&self) -> u64 {
        self.blocks_gen.load(Ordering::Acquire)
    }

    /// Installs a file's allocated blocks summed from extents read after `gen` was taken
    /// (not when any extent changed since).
    pub(crate) fn fill_blocks(&self, ino: u64, blocks: u64, gen: u64) {
        let mut s = self.blocks.at(mix(ino));
        if self.is_live() && self.blocks_gen.load(Ordering::Acquire) == gen {
            s.c.insert(ino, blocks, 1);
        }
    }

    /// An extent of `ino` changed (or may have): drop its block count and closed map.
    pub(crate) fn forget_blocks(&self, ino: u64) {
        let mut closed = self.closed_maps.at(mix(ino));
        closed.c.remove(&ino);
        self.blocks_gen.fetch_add(1, Ordering::AcqRel);
        drop(closed);
        self.blocks.at(mix(ino)).c.remove(&ino);
    }

    /// Keeps the map of a file just closed here, captured after `gen` was taken (not
    /// when any extent changed since, here or anywhere: the map may predate it).
    pub(crate) fn stash_closed_map(&self, ino: u64, map: ClosedMap, gen: u64) {
        let weight = map.extents.len().max(1);
        let mut s = self.closed_maps.at(mix(ino));
        if self.is_live() && self.blocks_gen.load(Ordering::Acquire) == gen {
            s.c.insert(ino, map, weight);
        }
    }

    /// Takes the map kept at `ino`'s last close here, if any.
    pub(crate) fn take_closed_map(&self, ino: u64) -> Option<ClosedMap> {
        if !self.is_live() {
            return None;
        }
        self.closed_maps.at(mix(ino)).c.remove(&ino)
    }

    /// Cached attributes of `ino` with the revision they were read or committed at.
    pub(crate) fn attr_at(&self, ino: u64) -> Option<(InodeAttr, i64)> {
        if !self.is_live() {
            return None;
        }
        let mut s = self.inodes.at(mix(ino));
        let v = s.c.get(&ino).map(|v| (v.val.clone(), v.rev))?;
        s.hits.attr += 1;
        Some(v)
    }

    /// Drops an inode's cached attributes (a change whose result this node does not know).
    pub(crate) fn forget_attr(&self, ino: u64) {
        self.inodes.at(mix(ino)).c.remove(&ino);
    }

    /// Drops a name (point entry and the directory's name set).
    pub(crate) fn forget_name(&self, parent: u64, name: &[u8]) {
        self.dentries
            .at(name_hash(parent, name))
            .c
            .remove(&(parent, name.to_vec()) as &(u64, Vec<u8>));
        self.forget_dir(parent);
    }

    /// Drops a directory's name set.
    pub(crate) fn forget_dir(&self, dir: u64) {
        self.dirs.at(mix(dir)).c.remove(&dir);
    }

    // ---- the watch ----

    /// The watch starts applying the batch of revision `rev`.
    pub(crate) fn begin(&self, rev: i64) {
        self.started.fetch_max(rev, Ordering::AcqRel);
    }

    /// The batch of revision `rev` is applied.
    pub(crate) fn end(&self, rev: i64) {
        self.applied.fetch_max(rev, Ordering::AcqRel);
    }

    /// Revision of the last batch fully applied.
    pub(crate) fn applied(&self) -> i64 {
        self.applied.load(Ordering::Acquire)
    }

    /// The watch is running and has applied everything up to `floor`: answer from the
    /// caches again and accept values read at `floor` or later.
    pub(crate) fn go_live(&self, floor: i64) {
        let mut log = self.log();
        self.started.fetch_max(floor, Ordering::AcqRel);
        self.applied.fetch_max(floor, Ordering::AcqRel);
        let f = log.floor.map_or(floor, |f| f.min(floor));
        log.floor = Some(f);
        self.live.store(true, Ordering::Release);
    }

    /// The watch stopped: no answers or installs until it is back.
    pub(crate) fn suspend(&self) {
        let _log = self.log();
        self.live.store(false, Ordering::Release);
    }

    /// The watch stopped applying events (history compacted, or restarting): drop
    /// everything, and name what the kernel most likely holds from what was dropped (it
    /// learnt those entries and attributes from answers these caches gave): every name
    /// cached, present or absent, in a name set or on its own, and every inode whose
    /// attributes were cached (with its data, for a regular file: nobody knows what
    /// changed). At most [`Caches::named_max`] items, possibly repeated.
    pub(crate) fn drop_all_named(&self) -> Vec<Kernel> {
        let mut named = Vec::new();
        let mut log = self.log();
        self.live.store(false, Ordering::Release);
        log.events.clear();
        log.floor = None;
        drop(log);
        self.inodes.each(|s| {
            named.extend(s.c.iter().map(|(&ino, v)| Kernel::InvalInode {
                ino,
                // A directory's data is the kernel's copy of its listing.
                data: matches!(
                    v.val.kind,
                    meta::types::FileType::Regular | meta::types::FileType::Directory
                ),
            }));
            s.c.clear();
        });
        self.blocks_gen.fetch_add(1, Ordering::AcqRel);
        self.blocks.each(|s| s.c.clear());
        // After the bump: a stash that checked the generation before it is cleared here.
        self.closed_maps.each(|s| s.c.clear());
        self.dentries.each(|s| {
            named.extend(s.c.iter().map(|((parent, name), _)| Kernel::InvalEntry {
                parent: *parent,
                name: name.clone(),
            }));
            s.c.clear();
        });
        self.dirs.each(|s| {
            for (&parent, set) in s.c.iter() {
                if let DirSet::Names(set) = set {
                    named.extend(set.names.keys().map(|name| Kernel::InvalEntry {
                        parent,
                        name: name.clone(),
                    }));
                }
            }
            s.c.clear();
        });
        named
    }

    /// The most [`Caches::drop_all_named`] returns: every cache full.
    pub(crate) fn named_max(&self) -> usize {
        self.cfg.inode_cache_max + self.cfg.dentry_cache_max + self.cfg.dir_names_cache_max
    }

    /// Applies one watch event of the batch at `rev`; returns what the kernel must drop.
    pub(crate) fn event(&self, rev: i64, ev: &Event) -> Option<Kernel> {
        bump(&self.n.watch_events);
        {
            let mut log = self.log();
            log.events.push_back((
                rev,
                match ev {
                    Event::Inode { ino, .. } => LogKey::Inode(*ino),
                    Event::Dentry { parent, name, new } => {
                        LogKey::Dentry(*parent, name.clone(), *new)
                    }
                },
            ));
            while log.events.len() > EVENT_LOG_MAX {
                if let Some((r, _)) = log.events.pop_front() {
                    // Everything after `r` is still in the log.
                    if let Some(f) = log.floor.as_mut() {
                        *f = (*f).max(r);
                    }
                }
            }
        }
        match ev {
            Event::Inode { ino, attr, deleted } => {
                let mut s = self.inodes.at(mix(*ino));
                let mut old = None;
                if let Some(v) = s.c.get_mut(ino) {
                    if v.rev == rev && v.own {
                        bump(&self.n.watch_events_own);
                        return None;
                    }
                    if v.rev < rev {
                        old = s.c.remove(ino).map(|v| v.val);
                    }
                }
                drop(s);
                let data = !*deleted
                    && match (&old, attr) {
                        (Some(o), Some(n)) => o.size != n.size || o.mtime != n.mtime,
                        _ => true,
                    };
                Some(Kernel::InvalInode { ino: *ino, data })
            }
            Event::Dentry { parent, name, new } => {
                let key = (*parent, name.clone());
                let mut old_child = None;
                {
                    let mut s = self.dentries.at(name_hash(*parent, name));
                    if let Some(v) = s.c.get_mut(&key) {
                        if v.rev == rev && v.own {
                            bump(&self.n.watch_events_own);
                            drop(s);
                            self.apply_to_set(*parent, name, *new, rev);
                            return None;
                        }
                        if v.rev < rev {
                            old_child = s.c.remove(&key).and_then(|v| v.val).map(|d| d.ino.0);
                        }
                    }
                }
                if let Some(prev) = self.apply_to_set(*parent, name, *new, rev) {
                    old_child = Some(prev.ino.0);
                }
                Some(match (new, old_child) {
                    (None, Some(child)) => Kernel::Delete {
                        parent: *parent,
                        child,
                        name: name.clone(),
                    },
                    _ => Kernel::InvalEntry {
                        parent: *parent,
                        name: name.clone(),
                    },
                })
            }
        }
    }

    /// Applies a dentry change to the parent's name set; returns the entry it replaced.
    fn apply_to_set(
        &self,
        parent: u64,
        name: &[u8],
        new: Option<Dentry>,
        rev: i64,
    ) -> Option<Dentry> {
        let mut s = self.dirs.at(mix(parent));
        let (prev, len) = match s.c.get_mut(&parent) {
            Some(DirSet::Names(set)) if rev > set.rev => {
                let prev = set.apply(name, new, rev);
                (prev, set.names.len())
            }
            _ => return None,
        };
        if len > self.cfg.dir_names_max {
            s.c.insert(parent, DirSet::TooBig, 1);
        } else {
            s.c.set_weight(&parent, len + 1);
        }
        prev
    }

    // ---- counters ----

    /// `(name, value)` counters for `etcfs stats`.
    pub(crate) fn counters(&self) -> Vec<(String, u64)> {
        let mut hits = Hits::default();
        let mut sizes = [0u64; 3];
        let mut evictions = [0u64; 3];
        let add = |h: &mut Hits, x: &Hits| {
            h.attr += x.attr;
            h.dentry += x.dentry;
            h.negative += x.negative;
            h.dir_names += x.dir_names;
        };
        self.inodes.each(|s| {
            add(&mut hits, &s.hits);
            sizes[0] += s.c.len() as u64;
            evictions[0] += s.c.evictions();
        });
        self.dentries.each(|s| {
            add(&mut hits, &s.hits);
            sizes[1] += s.c.len() as u64;
            evictions[1] += s.c.evictions();
        });
        self.dirs.each(|s| {
            add(&mut hits, &s.hits);
            sizes[2] += s.c.weight() as u64;
            evictions[2] += s.c.evictions();
        });
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let n = &self.n;
        vec![
            ("cache_attr_hits".into(), hits.attr),
            ("cache_attr_misses".into(), l(&n.attr_misses)),
            ("cache_maps_kept_at_close".into(), l(&n.maps_kept_at_close)),
            ("cache_dentry_hits".into(), hits.dentry),
            ("cache_dentry_misses".into(), l(&n.dentry_misses)),
            ("cache_negative_hits".into(), hits.negative),
            ("cache_negative_misses".into(), l(&n.negative_misses)),
            ("cache_dir_names_hits".into(), hits.dir_names),
            ("cache_dir_names_misses".into(), l(&n.dir_names_misses)),
            ("cache_dir_names_loads".into(), l(&n.dir_names_loads)),
            (
                "cache_dir_names_over_limit".into(),
                l(&n.dir_names_over_limit),
            ),
            ("cache_inodes".into(), sizes[0]),
            ("cache_dentries".into(), sizes[1]),
            ("cache_dir_names".into(), sizes[2]),
            ("cache_inode_evictions".into(), evictions[0]),
            ("cache_dentry_evictions".into(), evictions[1]),
            ("cache_dir_names_evictions".into(), evictions[2]),
            ("lookups_etcd".into(), l(&n.lookups_etcd)),
            ("watch_events_applied".into(), l(&n.watch_events)),
            ("watch_events_own".into(), l(&n.watch_events_own)),
            ("watch_revisions_own".into(), l(&n.watch_revisions_own)),
            ("kernel_skipped_own".into(), l(&n.kernel_skipped_own)),
            ("watch_restarts".into(), l(&n.watch_restarts)),
            ("watch_resyncs".into(), l(&n.watch_resyncs)),
            ("watch_revision".into(), self.applied().max(0) as u64),
            ("watch_live".into(), u64::from(self.is_live())),
            ("kernel_inval_entry".into(), l(&n.kernel_inval_entry)),
            ("kernel_delete".into(), l(&n.kernel_delete)),
            ("kernel_inval_inode".into(), l(&n.kernel_inval_inode)),
            ("kernel_inval_data".into(), l(&n.kernel_inval_data)),
            ("kernel_epochs".into(), l(&n.kernel_epochs)),
            ("cache_locks_taken".into(), l(&n.cache_locks_taken)),
            ("cache_lock_waits".into(), l(&n.cache_lock_waits)),
            ("cache_locks_released".into(), l(&n.cache_locks_released)),
            ("cache_locks_strays".into(), l(&n.cache_locks_strays)),
            (
                "cache_locks_downgraded".into(),
                l(&n.cache_locks_downgraded),
            ),
            (
                "cache_locks_upgraded_in_release".into(),
                l(&n.cache_locks_upgraded_in_release),
            ),
            (
                "cache_lock_writes_interrupted".into(),
                l(&n.cache_lock_writes_interrupted),
            ),
            ("listing_grants_ahead".into(), l(&n.listing_grants_ahead)),
            ("listing_grant_waits".into(), l(&n.listing_grant_waits)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use meta::types::{FileType, Ino, Timespec};

    use super::*;

    fn cfg(max: usize) -> CacheConfig {
        CacheConfig {
            inode_cache_max: max,
            dentry_cache_max: max,
            dir_names_cache_max: max,
            dir_names_max: 8,
            shards: 4,
        }
    }

    fn live(max: usize) -> Caches {
        let c = Caches::new(cfg(max));
        c.go_live(10);
        c
    }

    fn closed(granted_rev: i64) -> ClosedMap {
        ClosedMap {
            keys: None,
            extents: Vec::new(),
            granted_rev,
        }
    }

    #[test]
    fn a_closed_map_captured_before_any_extent_change_is_not_kept() {
        let c = live(100);
        let gen = c.blocks_gen();
        c.forget_blocks(9);
        c.stash_closed_map(7, closed(5), gen);
        assert!(
            c.take_closed_map(7).is_none(),
            "another file's change since"
        );

        let gen = c.blocks_gen();
        c.stash_closed_map(7, closed(5), gen);
        c.forget_blocks(7);
        assert!(c.take_closed_map(7).is_none(), "its own change after");

        let gen = c.blocks_gen();
        c.stash_closed_map(7, closed(5), gen);
        assert_eq!(c.take_closed_map(7).map(|m| m.granted_rev), Some(5));
        assert!(c.take_closed_map(7).is_none(), "taken once");

        let gen = c.blocks_gen();
        c.stash_closed_map(7, closed(5), gen);
        let _ = c.drop_all_named();
        assert!(c.take_closed_map(7).is_none(), "the watch stopped");
    }

    fn attr(ino: u64, size: u64) -> InodeAttr {
        let t = Timespec::new(1, 0);
        InodeAttr {
            ino: Ino(ino),
            kind: FileType::Regular,
            perm: 0o644,
            uid: 0,
            gid: 0,
            size,
            nlink: 1,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            rdev: 0,
            generation: 0,
            flags: 0,
        }
    }

    fn de(ino: u64) -> Dentry {
        Dentry {
            ino: Ino(ino),
            kind: FileType::Regular,
        }
    }

    fn counter(c: &Caches, name: &str) -> u64 {
        c.counters()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .unwrap()
    }

    #[test]
    fn every_cache_is_bounded() {
        let c = live(64);
        for i in 0..1000u64 {
            c.fill_attr(&attr(i, 0), 10);
            c.fill_dentry(1, format!("n{i}").as_bytes(), Some(de(i)), 10);
            c.fill_dir(i, (0..5).map(|k| (vec![b'a' + k], de(u64::from(k)))), 10);
        }
        // Shards round the limit up to a multiple of the shard count.
        assert!(counter(&c, "cache_inodes") <= 64);
        assert!(counter(&c, "cache_dentries") <= 64);
        assert!(counter(&c, "cache_dir_names") <= 64);
        assert!(counter(&c, "cache_inode_evictions") >= 900);
        assert!(counter(&c, "cache_dir_names_evictions") > 0);
    }

    #[test]
    fn name_sets_answer_misses_and_follow_events() {
        let c = live(1024);
        c.fill_dir(1, [(b"a".to_vec(), de(5))], 10);
        assert_eq!(c.lookup(1, b"a"), Lookup::Found(de(5)));
        assert_eq!(c.lookup(1, b"zz"), Lookup::Absent);
        assert_eq!(c.lookup(2, b"zz"), Lookup::Unknown { too_big: false });
        // Another node creates zz: the set learns it and the kernel is told.
        c.begin(11);
        let k = c.event(
            11,
            &Event::Dentry {
                parent: 1,
                name: b"zz".to_vec(),
                new: Some(de(6)),
            },
        );
        c.end(11);
        assert_eq!(
            k,
            Some(Kernel::InvalEntry {
                parent: 1,
                name: b"zz".to_vec()
            })
        );
        assert_eq!(c.lookup(1, b"zz"), Lookup::Found(de(6)));
        // ... and removes a: DELETE with the child we knew.
        c.begin(12);
        let k = c.event(
            12,
            &Event::Dentry {
                parent: 1,
                name: b"a".to_vec(),
                new: None,
            },
        );
        assert_eq!(
            k,
            Some(Kernel::Delete {
                parent: 1,
                child: 5,
                name: b"a".to_vec()
            })
        );
        assert_eq!(c.lookup(1, b"a"), Lookup::Absent);
        assert_eq!(counter(&c, "cache_negative_hits"), 2);
    }

    #[test]
    fn a_fill_racing_the_watch_replays_or_refuses() {
        let c = live(1024);
        // Read at 10, but the watch already applied 11 (create b) and 12 (chmod inode 7).
        c.begin(11);
        c.event(
            11,
            &Event::Dentry {
                parent: 1,
                name: b"b".to_vec(),
                new: Some(de(7)),
            },
        );
        c.begin(12);
        c.event(
            12,
            &Event::Inode {
                ino: 7,
                attr: None,
                deleted: false,
            },
        );
        c.end(12);
        c.fill_dir(1, [(b"a".to_vec(), de(5))], 10);
        assert_eq!(c.lookup(1, b"b"), Lookup::Found(de(7)));
        c.fill_attr(&attr(7, 0), 10);
        assert_eq!(c.attr(7), None, "stale attributes are not installed");
        c.fill_attr(&attr(7, 1), 12);
        assert_eq!(c.attr(7).map(|a| a.size), Some(1));
        // A read older than the log's floor is refused.
        c.fill_attr(&attr(8, 0), 9);
        assert_eq!(c.attr(8), None);
    }

    #[test]
    fn own_changes_are_read_back_and_not_reported_to_the_kernel() {
        let c = live(1024);
        c.fill_dir(1, [], 10);
        c.own_dentry(1, b"x", Some(de(9)), 15);
        c.own_attr(&attr(9, 0), 15);
        assert_eq!(c.lookup(1, b"x"), Lookup::Found(de(9)));
        c.begin(15);
        let ev = Event::Dentry {
            parent: 1,
            name: b"x".to_vec(),
            new: Some(de(9)),
        };
        assert_eq!(c.event(15, &ev), None);
        let ev = Event::Inode {
            ino: 9,
            attr: Some(attr(9, 0)),
            deleted: false,
        };
        assert_eq!(c.event(15, &ev), None);
        c.end(15);
        // Another node's later unlink wins over our entry.
        c.begin(16);
        let k = c.event(
            16,
            &Event::Dentry {
                parent: 1,
                name: b"x".to_vec(),
                new: None,
            },
        );
        assert!(matches!(k, Some(Kernel::Delete { child: 9, .. })));
        assert_eq!(c.lookup(1, b"x"), Lookup::Absent);
        // An own commit older than what the watch has started is not installed (the watch
        // has applied it, or something newer): the entry is dropped instead.
        c.own_attr(&attr(9, 5), 14);
        assert_eq!(c.attr(9), None);
        c.own_attr(&attr(9, 6), 16);
        assert_eq!(c.attr(9).map(|a| a.size), Some(6));
    }

    #[test]
    fn data_is_invalidated_only_when_size_or_mtime_moved() {
        let c = live(1024);
        c.fill_attr(&attr(3, 100), 10);
        c.begin(11);
        let mut chmod = attr(3, 100);
        chmod.perm = 0o600;
        let ev = Event::Inode {
            ino: 3,
            attr: Some(chmod),
            deleted: false,
        };
        assert_eq!(
            c.event(11, &ev),
            Some(Kernel::InvalInode {
                ino: 3,
                data: false
            })
        );
        let ev = Event::Inode {
            ino: 3,
            attr: Some(attr(3, 200)),
            deleted: false,
        };
        // Not cached any more: unknown, so data too.
        assert_eq!(
            c.event(12, &ev),
            Some(Kernel::InvalInode { ino: 3, data: true })
        );
    }

    #[test]
    fn suspended_or_dropped_caches_answer_nothing() {
        let c = live(1024);
        c.fill_dir(1, [], 10);
        c.suspend();
        assert_eq!(c.lookup(1, b"a"), Lookup::Unknown { too_big: false });
        c.go_live(10);
        assert_eq!(c.lookup(1, b"a"), Lookup::Absent);
        let named = c.drop_all_named();
        assert_eq!(named, [], "nothing was cached");
        c.go_live(20);
        assert_eq!(c.lookup(1, b"a"), Lookup::Unknown { too_big: false });
        c.fill_dir(1, [], 15);
        assert_eq!(
            c.lookup(1, b"a"),
            Lookup::Unknown { too_big: false },
            "read before the resync"
        );
    }

    #[test]
    fn dropping_everything_names_what_the_kernel_may_hold() {
        let c = live(1024);
        c.fill_attr(&attr(7, 0), 10);
        let mut dir = attr(8, 0);
        dir.kind = FileType::Directory;
        c.fill_attr(&dir, 10);
        c.fill_dentry(1, b"absent", None, 10);
        c.fill_dentry(1, b"x", Some(de(7)), 10);
        c.fill_dir(8, [(b"a".to_vec(), de(9)), (b"b".to_vec(), de(10))], 10);
        let mut named = c.drop_all_named();
        named.sort_by_key(|k| format!("{k:?}"));
        let entry = |parent, name: &[u8]| Kernel::InvalEntry {
            parent,
            name: name.to_vec(),
        };
        let mut want = vec![
            Kernel::InvalInode { ino: 7, data: true },
            // A directory: its data is the kernel's copy of the listing.
            Kernel::InvalInode { ino: 8, data: true },
            entry(1, b"absent"),
            entry(1, b"x"),
            entry(8, b"a"),
            entry(8, b"b"),
        ];
        want.sort_by_key(|k| format!("{k:?}"));
        assert_eq!(named, want);
        assert!(named.len() <= c.named_max());
        c.go_live(20);
        assert_eq!(c.attr(7), None);
        assert_eq!(c.lookup(8, b"a"), Lookup::Unknown { too_big: false });
        assert_eq!(c.drop_all_named(), []);
    }

    #[test]
    fn the_largest_name_set_always_fits_its_shard() {
        let c = Caches::new(CacheConfig {
            inode_cache_max: 16,
            dentry_cache_max: 16,
            dir_names_cache_max: 100,
            dir_names_max: 40,
            shards: 64,
        });
        c.go_live(10);
        for d in 0..10u64 {
            c.fill_dir(d, (0..40u8).map(|k| (vec![k], de(u64::from(k)))), 10);
            assert_eq!(c.lookup(d, b"none"), Lookup::Absent);
            assert!(counter(&c, "cache_dir_names") <= 100);
        }
        // A cache too small for a set remembers the directory as too big instead.
        let c = Caches::new(CacheConfig {
            dir_names_cache_max: 10,
            ..cfg(16)
        });
        c.go_live(10);
        c.fill_dir(1, (0..20u8).map(|k| (vec![k], de(u64::from(k)))), 10);
        assert_eq!(c.lookup(1, b"none"), Lookup::Unknown { too_big: true });
    }

    #[test]
    fn a_name_set_outgrowing_the_limit_becomes_too_big() {
        let c = live(1024);
        c.fill_dir(1, (0..8u8).map(|k| (vec![b'a' + k], de(u64::from(k)))), 10);
        c.begin(11);
        c.event(
            11,
            &Event::Dentry {
                parent: 1,
                name: b"zzz".to_vec(),
                new: Some(de(99)),
            },
        );
        assert_eq!(c.lookup(1, b"nope"), Lookup::Unknown { too_big: true });
    }
}
