//! `fs`: the etcd-backed filesystem, a [`fusedev::server::Handler`].
//!
//! Metadata lives in etcd and changes only through `meta`'s pipeline; file data lives on
//! the shared device (`crate::data`). This module glues the two behind FUSE.
//!
//! How a request is served:
//! * Requests that need nothing from etcd are answered on the core: READ of an open file
//!   whose extent map is cached (a [`ReadPlan`] the transport executes on the core's
//!   io_uring), GETATTR of an open file, FORGET, and the ENOSYS ones.
//! * Everything else is handed to a small pool of "waiter" threads ([`pool`]): the core
//!   takes a [`DeferredReply`](fusedev::server::DeferredReply), the waiter runs the
//!   operation synchronously (submitting mutations and waiting for their tickets, reading
//!   metadata), and completes the reply from its thread. A core therefore never blocks on
//!   etcd, and the pipeline sees every concurrent operation at once to group them. When the
//!   context cannot defer (tests, the sideband reader), the operation runs inline.
//!
//! State kept per node (all bounded, see the limits below):
//! * open regular files ([`files`]): the inode's attributes as this node last committed
//!   them, its extent map, the open count, whether it was unlinked while open (orphan),
//!   and the allocating writes not yet committed (write-behind, below);
//! * open directory handles: readdir cookie → name, to resume listings;
//! * the block allocator of the groups this node owns.
//!
//! Nothing another node needs lives only here for long: attributes and extents are
//! committed before a reply claims them, except
//! * the mtime of in-place overwrites, written at FLUSH/FSYNC/RELEASE (as a page-cache
//!   filesystem writes it at writeback);
//! * the extents and size of allocating writes (appends, holes, unwritten extents):
//!   write-behind, as ext4's delayed commit with data=ordered. The WRITE is answered once
//!   its data is written (not flushed); the open file's cached map and attributes show it
//!   here at once, and the change ([`files::Pending`]) commits after one device flush at
//!   fsync, FLUSH, RELEASE, syncfs and unmount, before anything that changes or reads the
//!   file's extents or size through etcd (truncate, setattr, fallocate, punch), past
//!   [`PENDING_BYTES_MAX`] or [`PENDING_EXTENTS_MAX`], and at most [`PENDING_AGE_MAX`]
//!   after the first write (the housekeeping thread). Another node sees such a write at
//!   close, fsync or within about a second; a crash loses at most what was pending, and
//!   no space: the allocator keeps such blocks *reserved*, used in its own maps but free
//!   in every map it writes to etcd, until the commit of the extent that points at them
//!   ([`Allocator::publish`]).
//!
//! Kernel references (LOOKUP counts) need no table: inode numbers are never reused and
//! every inode is read from etcd when asked, so FORGET has nothing to drop. What keeps an
//! unlinked file alive is the open records of the nodes that have it open (`held.rs`),
//! through an orphan record in etcd.

#[cfg(test)]
mod alloc_tests;
mod atime;
mod cache;
mod clock;
mod dir;
mod dispatch;
mod errno;
mod fence;
mod files;
mod held;
mod locks;
mod lookup;
#[cfg(test)]
mod lossy_tests;
mod namespace;
mod open;
mod plocks;
mod pool;
mod resize;
mod rw;
mod space;
#[cfg(test)]
mod space_tests;
#[cfg(test)]
mod tests;
mod watch;
mod xattr;

use std::{
    collections::{BTreeSet, HashMap},
    os::fd::{AsRawFd, RawFd},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, SystemTime},
};

use anyhow::{anyhow, bail, Context as _};
use fusedev::{
    abi::{
        self, Attr, AttrOut, EntryOut, Immutable, IntoBytes, Kstatfs, OpenOut, SetattrIn,
        FUSE_ROOT_ID, NAME_MAX,
    },
    errno::Errno,
    reply::{self, dirent_type, DirentWriter},
    request::{Operation, Request},
    server::{Handler, Hold, ReadPlan, Reply, RequestCtx, Segment, WritePlan, WriteSegment},
    transport::Notifier,
};
use meta::{
    clock::{Clock, SystemClock},
    codec::InodeAttr,
    error::MetaError,
    keys::Keyspace,
    kv::{KvBackend, RangeRequest},
    pipeline::{
        AclInherit, Config as PipelineConfig, Connect, GroupLayout, MetaClient, Mutation, NewInode,
        Outcome, Pipeline, RenameMode, SetAttr, TimeSet, UnlinkExpect, XattrMode,
    },
    session::{Session, SessionConfig},
    types::{FileType, GroupId, Ino, Timespec, XATTR_NAME_LEN_MAX, XATTR_VALUE_LEN_MAX},
};
use uring::AlignedBuf;

use self::{
    cache::{CacheConfig, Caches, Lookup},
    files::{FileState, Files, OpenAttr, Pending},
    pool::Pool,
    rw::MapAtOpen,
    space::{dev_range_within, encode_maps},
};
use crate::data::{
    alloc::{AgFreeMap, AllocError, Allocator},
    device::{mem::MemDev, open_device, psync::PsyncDev, BlockDev, DevFile, OpenOpts},
    mkfs as dmkfs,
    plan::{self as dplan, FileExtent, ReadSpan, WriteSeg},
    superblock::{fmt_uuid, random_uuid, Geometry},
    AgId, BlockNo, Extent, BLOCK_SIZE,
};

/// Waiter threads per core that run operations needing etcd (each blocks on one ticket at
/// a time; together they bound how many operations this node has in the pipeline at once).
const WAITERS_PER_CORE: usize = 8;
/// Fewest waiter threads (enough for the pipeline to group concurrent operations).
const WAITERS_MIN: usize = 16;
/// Operations queued for the waiters (EAGAIN past it, see pool.rs): above what the
/// transports hold in flight on up to 128 CPUs (32 ring entries or slots each).
const WAITER_QUEUE_MAX: usize = 4096;
/// Open directory handles at once (EMFILE past it).
const DIR_HANDLES_MAX: usize = 65536;
/// Cookie → name entries one directory handle remembers; past it the oldest half is
/// dropped (an unknown cookie is then found by scanning the directory).
const DIR_COOKIES_MAX: usize = 4096;
/// Entries of the first page a listing reads from etcd: a small directory, or the first
/// screen of a large one, costs one short read.
const DIR_PAGE_ENTRIES: usize = 256;
/// Entries of the later pages of a listing (pages grow 4x from the first). etcd walks
/// every key left in the range to count it on each page, so the number of pages, not only
/// their size, makes a listing's cost: 100,000 entries took 25 pages of 4,096 (a cold
/// `ls -f` 7x ext4), now 7 of up to 16,384.
const DIR_PAGE_ENTRIES_MAX: usize = 16384;
/// LOOKUP misses in ascending name order in one directory after which the names that
/// follow are read and their files' shared locks taken at once.
const LOOKUP_STREAK: u32 = 4;
/// Pages of [`DIR_SHARE_AHEAD`] names past the one a LOOKUP streak waits for whose files'
/// locks are taken on the share thread while the walk goes on.
const LOOKUP_PAGES_AHEAD: usize = 2;
/// Directories whose LOOKUP streaks are tracked.
const LOOKUP_STREAKS_MAX: usize = 256;
/// Entries after a streak of LOOKUPs whose files' shared locks are taken at once.
/// Names follow one another in name order, inodes in order of creation: 1,024 names of a
/// directory filled by 16 parallel creators spanned about 5 inode numbers a file, too far
/// apart to read their inodes and extents as ranges; 4,096 span about 1.5 (a cold `ls -l`
/// of 20,000: 57,700 etcd range operations -> 41,800, benches/listing_cost.sh).
const DIR_SHARE_AHEAD: usize = 4096;
/// Entries past a listing's first READDIRPLUS reply whose locks it takes with the reply's
/// (the first may be `ls -f`'s only one: nothing in the background).
const DIR_SHARE_FIRST: usize = 256;
/// Entries past a READDIRPLUS reply whose locks are being taken in the background, two
/// grants of [`DIR_SHARE_CHUNK_MAX`]: while the kernel works through one, etcd grants
/// the next.
const DIR_GRANTED_AHEAD: usize = 8192;
/// Entries of a listing's first background grant, doubling up to [`DIR_SHARE_CHUNK_MAX`]:
/// the next READDIRPLUS waits only for the grant it reaches, and the first is soon done.
const DIR_SHARE_CHUNK: usize = 512;
/// The most entries of one background grant: as for [`DIR_SHARE_AHEAD`], 4,096 names
/// are close enough in inode numbers to read as ranges (in chunks of at most 1,024, a
/// cold `ls -l` of 20,000 took 32,000 etcd range operations instead of 7,200).
const DIR_SHARE_CHUNK_MAX: usize = 4096;
/// Inodes `Inner::plus_given` remembers (about 10 MiB); past it, it starts again
/// (inodes then given whole once more).
const PLUS_GIVEN_MAX: usize = 1 << 18;
/// Bytes of names all open directories may hold read ahead of the kernel; past it a
/// listing reads a page per READDIR (correct, slower).
const DIR_AHEAD_BYTES_MAX: usize = 64 << 20;
/// Entries scanned to find the name of an unknown readdir cookie.
const DIR_SCAN_MAX: usize = 1 << 20;
/// xattr names listed at most (E2BIG past it).
const XATTR_LIST_NAMES_MAX: usize = 4096;
/// Orphans of dead sessions reclaimed per pass.
const ORPHAN_RECLAIM_BATCH: usize = 256;
/// Groups claimed at mount; more are claimed when these run out.
const GROUPS_CLAIM_INITIAL: usize = 2;
/// Released records (`R`) of this node's groups one look of the fold reads per group (it
/// looks every second; a group being loaded reads all of its records, in pages).
const RELEASED_LOAD_MAX: i64 = 4096;
/// Released records deleted by one free-map write (well inside a transaction's ops).
const RELEASED_PER_FOLD: usize = 96;
/// How often the housekeeping thread reclaims dead nodes' orphans and claims groups.
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(5);
/// How often the housekeeping thread looks for pending writes older than
/// [`PENDING_AGE_MAX`].
const HOUSEKEEPING_STEP: Duration = Duration::from_millis(200);
/// Oldest a file's pending (write-behind) change gets before it commits: how late
/// another node may see an allocating write of a file still open here.
const PENDING_AGE_MAX: Duration = Duration::from_secs(1);
/// Bytes allocated by one file's pending change before it commits: bounds what a crash
/// loses and what one commit's flush waits for.
const PENDING_BYTES_MAX: u64 = 64 << 20;
/// Extents one unmapping commit takes: one SetExtents reads at most
/// `EXTENTS_PER_MUTATION_MAX` starting inside its range, and one may reach in from before.
const UNMAP_PER_COMMIT: usize = meta::pipeline::plan::EXTENTS_PER_MUTATION_MAX - 1;
/// Extents one pending change may replace or write (merged) before it commits, under the
/// pipeline's per-mutation cap with room for one more write's pieces.
const PENDING_EXTENTS_MAX: usize = meta::pipeline::plan::EXTENTS_PER_MUTATION_MAX * 2 / 3;
/// Commit attempts of one pending change before it is dropped (its writes then fail).
const PENDING_RETRIES_MAX: u32 = 3;
/// How long an allocation waits for other nodes to hand over space before ENOSPC: longer
/// than a lease TTL, so a dead owner's groups come free within it.
const SPACE_WAIT_MAX: Duration = Duration::from_secs(15);
/// How often a waiting allocation tries to claim a group again.
const SPACE_POLL: Duration = Duration::from_millis(100);
/// How often a waiting allocation checks the device's free space and renews its request.
const SPACE_ASK_EVERY: Duration = Duration::from_secs(1);
/// A group not allocated from for this long goes back when its node has enough space
/// without it: much longer than write-behind (1 s) and a pause between a writer's
/// bursts, so a writer keeps its groups (and its files stay contiguous) and does not pay
/// a claim per burst; short enough that a node done writing returns its space within a
/// minute, for other nodes to claim without asking it (an ask costs them a second).
const GROUP_IDLE_GIVE_BACK: Duration = Duration::from_secs(30);
/// Largest file size (as ext4 with 4 KiB blocks: 16 TiB).
const FILE_SIZE_MAX: u64 = 16 << 40;
/// The statfs inode count: inode numbers are 64-bit and never reused; report 2^32.
const STATFS_FILES: u64 = 1 << 32;
/// How long a node reuses its count of used inodes for statfs (`df -i`): the count is a
/// read linear in the number of inodes inside etcd, so at most one per node per this.
const INODE_COUNT_TTL: Duration = Duration::from_secs(2);
/// FALLOC_FL_KEEP_SIZE and FALLOC_FL_PUNCH_HOLE.
const FALLOC_KEEP_SIZE: u32 = 0x01;
const FALLOC_PUNCH_HOLE: u32 = 0x02;
/// lseek whence values the kernel forwards.
const SEEK_DATA: u32 = 3;
const SEEK_HOLE: u32 = 4;

/// What the CLI passes to [`EtcFs::open`].
#[derive(Debug, Clone)]
pub(crate) struct FsConfig {
    pub etcd: meta::etcd::EtcdConfig,
    pub device: PathBuf,
    pub prefix: String,
    pub attr_timeout: Duration,
    pub entry_timeout: Duration,
    /// How long the kernel may cache an absent name (a negative entry).
    pub negative_timeout: Duration,
    /// Names a directory may have for its name set to be read in one range.
    pub dir_names_max: usize,
    pub cores: usize,
    /// How long a node keeps a cluster lock it was granted before giving way.
    pub lock_min_hold: Duration,
    /// The session lease TTL in seconds.
    pub lease_ttl_s: i64,
    /// Never update atime (else relatime).
    pub noatime: bool,
    /// A read-only mount (`--read-only`): see [`Inner::read_only`].
    pub read_only: bool,
    /// Store `security.selinux` (`--selinux-xattr`): see [`Inner::selinux_xattr`].
    pub selinux_xattr: bool,
}

/// Kernel cache timeouts and the daemon's cache sizing.
#[derive(Debug, Clone)]
pub(crate) struct CacheOpts {
    pub attr_timeout: Duration,
    pub entry_timeout: Duration,
    pub negative_timeout: Duration,
    pub dir_names_max: usize,
    pub cores: usize,
    pub lock_min_hold: Duration,
    pub lease_ttl_s: i64,
    pub noatime: bool,
    pub read_only: bool,
    pub selinux_xattr: bool,
}

impl CacheOpts {
    /// Tests: the same timeout for everything, default cache sizes.
    #[cfg(test)]
    pub(crate) fn uniform(t: Duration) -> Self {
        CacheOpts {
            attr_timeout: t,
            entry_timeout: t,
            negative_timeout: t,
            dir_names_max: cache::DIR_NAMES_MAX,
            cores: 1,
            lock_min_hold: Duration::ZERO,
            lease_ttl_s: 10,
            noatime: false,
            read_only: false,
            selinux_xattr: false,
        }
    }
}

/// What `etcfs mkfs` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MkfsReport {
    pub uuid: String,
    pub device_bytes: u64,
    pub groups: u32,
    pub block_size: u32,
}

/// The device as the filesystem uses it: a real file (driven with psync for writes here,
/// read by the transport through its fd) or, in tests, an in-memory device.
#[derive(Clone, Debug)]
pub(crate) enum Dev {
    File(DevFile),
    #[cfg_attr(not(test), allow(dead_code))]
    Mem(MemDev),
}

impl Dev {
    /// A block-I/O engine on the device for this call.
    fn io(&self) -> Box<dyn BlockDev> {
        match self {
            Dev::File(f) => Box::new(PsyncDev::new(f)),
            Dev::Mem(m) => Box::new(m.clone()),
        }
    }

    /// The fd a transport reads [`Segment::Device`] ranges from (None for memory).
    fn fd(&self) -> Option<RawFd> {
        match self {
            Dev::File(f) => Some(f.file.as_raw_fd()),
            Dev::Mem(_) => None,
        }
    }

    fn name(&self) -> String {
        match self {
            Dev::File(f) => f.path.display().to_string(),
            Dev::Mem(_) => "memory".into(),
        }
    }
}

fn connect_etcd(cfg: meta::etcd::EtcdConfig) -> Connect {
    Box::new(move || {
        Box::pin(async move {
            let b = meta::etcd::EtcdBackend::connect(&cfg).await?;
            Ok(Arc::new(b) as Arc<dyn KvBackend>)
        })
    })
}

#[cfg(test)]
fn connect_backend(kv: Arc<dyn KvBackend>) -> Connect {
    Box::new(move || Box::pin(async move { Ok(kv) }))
}

fn pipeline_config() -> PipelineConfig {
    PipelineConfig {
        block_size: BLOCK_SIZE,
        ..PipelineConfig::default()
    }
}

/// Runs an async function of the backend on the pipeline's runtime and waits for it.
fn run_read<T, F>(meta: &MetaClient, f: F) -> Result<T, MetaError>
where
    T: Send + 'static,
    F: FnOnce(Arc<dyn KvBackend>, Keyspace) -> meta::kv::BoxFut<'static, Result<T, MetaError>>
        + Send
        + 'static,
{
    meta.read(f)?.wait()
}

/// Reads the etcd superblock record and checks that the device is the filesystem it
/// describes; the device's geometry.
fn check_filesystem(meta: &MetaClient, dev: &Dev) -> anyhow::Result<Geometry> {
    let rec = run_read(meta, |kv, keys| {
        Box::pin(async move { meta::reader::superblock(&*kv, &keys).await })
    })
    .context("reading the etcd superblock record")?
    .ok_or_else(|| {
        anyhow!(
            "etcd prefix {:?} holds no filesystem (run `etcfs mkfs`)",
            String::from_utf8_lossy(meta.keys().root())
        )
    })?;
    let dev_name = PathBuf::from(dev.name());
    let sb = dmkfs::check(&mut *dev.io(), &dev_name, rec.uuid).map_err(|e| anyhow!("{e}"))?;
    dmkfs::agrees_with_meta(&sb, &rec, &dev_name).map_err(|e| anyhow!("{e}"))?;
    Ok(sb.geometry)
}

/// Where the allocation groups lie, for the pipeline to log released ranges per group.
fn group_layout(g: &Geometry) -> GroupLayout {
    GroupLayout {
        start: g.data_start_block * BLOCK_SIZE,
        size: g.ag_blocks * BLOCK_SIZE,
    }
}

/// Formats `device` and the etcd `prefix` as one new filesystem.
pub(crate) fn mkfs(
    etcd: &meta::etcd::EtcdConfig,
    device: &Path,
    prefix: &str,
    ag_blocks: u64,
    force: bool,
) -> anyhow::Result<MkfsReport> {
    let keys = Keyspace::new(prefix).map_err(|e| anyhow!("bad --prefix: {e:?}"))?;
    let dev = open_device(device, OpenOpts::default()).map_err(|e| anyhow!("{e}"))?;
    let pipeline = Pipeline::start(
        connect_etcd(etcd.clone()),
        keys.clone(),
        meta::types::SessionId(u64::MAX),
        Arc::new(SystemClock::new()),
        pipeline_config(),
    )
    .map_err(|e| match e {
        MetaError::Denied(_) => anyhow!("{e}"),
        e => anyhow!("cannot reach etcd at {}: {e}", etcd.endpoints.join(",")),
    })?;
    mkfs_on(
        &pipeline.client(),
        &mut PsyncDev::new(&dev),
        device,
        prefix,
        ag_blocks,
        force,
    )
}

/// mkfs on an open pipeline and device (tests use the model and a memory device).
pub(crate) fn mkfs_on(
    meta: &MetaClient,
    dev: &mut dyn BlockDev,
    device: &Path,
    prefix: &str,
    ag_blocks: u64,
    force: bool,
) -> anyhow::Result<MkfsReport> {
    // Refuse before touching either side: an etcd prefix in use, then the device.
    if !force {
        let existing = run_read(meta, |kv, keys| {
            Box::pin(async move { meta::reader::superblock(&*kv, &keys).await })
        })
        .context("reading the etcd superblock record")?;
        if let Some(rec) = existing {
            bail!(
                "etcd prefix {prefix:?} already holds etcfs filesystem {}; use --force to \
                 overwrite",
                fmt_uuid(&rec.uuid)
            );
        }
    }
    let uuid = random_uuid().context("generating a filesystem uuid")?;
    let sb = dmkfs::format(dev, device, uuid, ag_blocks, force, SystemTime::now())
        .map_err(|e| anyhow!("{e}"))?;
    let rec = dmkfs::meta_record(&sb);
    let root = meta::format::RootOwner {
        // SAFETY-free: getuid/getgid cannot fail.
        uid: unsafe_free_uid(),
        gid: unsafe_free_gid(),
        perm: 0o755,
    };
    let now = meta::clock::SystemClock::new().wall();
    run_read(meta, move |kv, keys| {
        Box::pin(async move { meta::format::format(&*kv, &keys, &rec, root, now, force).await })
    })
    .map_err(|e| match e {
        MetaError::Exists => anyhow!(
            "etcd prefix {prefix:?} already holds an etcfs filesystem; use --force to overwrite"
        ),
        e => anyhow!("writing the etcd superblock record: {e}"),
    })?;
    Ok(MkfsReport {
        uuid: fmt_uuid(&sb.uuid),
        device_bytes: sb.geometry.device_size,
        groups: sb.geometry.ag_count,
        block_size: BLOCK_SIZE as u32,
    })
}

/// The owner of a new root directory: whoever runs mkfs (read from /proc to stay free of
/// `unsafe`; root when unknown).
fn unsafe_free_uid() -> u32 {
    proc_status_id("Uid:")
}

fn unsafe_free_gid() -> u32 {
    proc_status_id("Gid:")
}

fn proc_status_id(field: &str) -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|rest| rest.split_whitespace().nth(1).map(str::to_owned))
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The kernel notifier of the process's mount, for the daemon, which holds the handler as
/// a `dyn Handler` (one filesystem per daemon process). [`EtcFs::set_notifier`] sets it for
/// one instance instead.
static PROCESS_NOTIFIER: std::sync::OnceLock<Notifier> = std::sync::OnceLock::new();

/// Gives every filesystem of this process the mount's notifier (call once the FUSE session
/// runs, from the daemon).
pub(crate) fn set_notifier(n: Notifier) {
    let _ = PROCESS_NOTIFIER.set(n);
}

/// The filesystem. Cheap to share: the state is in an `Arc` that the waiter threads hold.
pub(crate) struct EtcFs {
    inner: Arc<Inner>,
    pool: Pool,
    housekeeping: Mutex<Option<std::thread::JoinHandle<()>>>,
    invalidation: Mutex<Option<std::thread::JoinHandle<()>>>,
    lock_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Everything an operation needs, shared by the cores and the waiters.
pub(crate) struct Inner {
    attr_timeout: Duration,
    entry_timeout: Duration,
    negative_timeout: Duration,
    caches: Caches,
    /// Set once the FUSE session runs ([`EtcFs::set_notifier`]).
    notifier: Mutex<Option<Notifier>>,
    meta: MetaClient,
    pipeline: Mutex<Option<Pipeline>>,
    session: Mutex<Option<Arc<Session>>>,
    /// Open while this node's lease is certainly alive (`fence.rs`).
    fence: Arc<meta::fence::Fence>,
    /// File handles are valid only in the generation they were opened in (bumped when a
    /// session is fenced).
    generation: AtomicU64,
    /// The fence closed and what the session held was dropped; not serving again yet.
    fenced: AtomicBool,
    /// When a fenced node next tries to register.
    rejoin_at: Mutex<Option<std::time::Instant>>,
    /// When the last fence closed (the old lease is revoked only a margin later).
    fenced_at: Mutex<Option<std::time::Instant>>,
    /// Failed registrations since the fence (for the log's rate).
    rejoin_failures: AtomicU64,
    /// The lease TTL a new session asks for.
    lease_ttl_s: i64,
    dev: Dev,
    geometry: Geometry,
    alloc: Mutex<Allocator>,
    /// Held through a group claim (etcd round trips, then the load of its map).
    claiming: Mutex<()>,
    /// Another node asked for space (its `W` record): housekeeping hands groups back.
    space_wanted: AtomicBool,
    /// How long each owned group has gone unused (idle groups go back: `space.rs`).
    idle_groups: Mutex<space::IdleGroups>,
    files: Files,
    /// Cluster cache locks of regular files (`locks.rs`).
    locks: locks::LockTable,
    /// This node's open records (files open anywhere stay whole: `held.rs`).
    held: held::Held,
    dirs: Mutex<HashMap<u64, DirHandle>>,
    /// Bytes of names held in every handle's [`dir::Lookahead`] (bounded by
    /// `DIR_AHEAD_BYTES_MAX`).
    dir_ahead_bytes: AtomicUsize,
    /// Per directory, the LOOKUPs that missed in ascending name order (bounded by
    /// `LOOKUP_STREAKS_MAX` directories): see `Inner::share_following`.
    lookup_streaks: Mutex<HashMap<u64, LookupStreak>>,
    /// When a READDIRPLUS last gave the kernel each inode whole (name, attributes that it
    /// may cache): see `Inner::plus_record`. Dropped at the inode's FORGET.
    plus_given: Mutex<HashMap<u64, std::time::Instant>>,
    next_fh: AtomicU64,
    stopping: AtomicBool,
    data_counters: DataCounters,
    dev_counters: Arc<DevCounters>,
    plocks: plocks::Plocks,
    /// Used inodes as last counted, and when (statfs; [`INODE_COUNT_TTL`]).
    inode_count: Mutex<Option<(std::time::Instant, u64)>>,
    /// Held by the one waiter counting inodes; the others answer the last count.
    counting: Mutex<()>,
    /// No atime updates (`--noatime`, or a read-only mount); otherwise relatime
    /// (`atime.rs`).
    noatime: bool,
    /// A read-only mount: every request that would change the filesystem answers EROFS
    /// (`dispatch.rs`), the pipeline refuses every mutation but open records
    /// (`meta::pipeline::Config::read_only`), and the node makes none of the writes it makes
    /// on its own: no group claims (so no free-map writes), no reclaim of orphans or of
    /// dead local sessions, no atime. It still has a session, cluster cache locks, fcntl
    /// locks and open records: what reading coherently next to writers needs.
    read_only: bool,
    /// `security.selinux` is stored like any attribute (`--selinux-xattr`). Otherwise it
    /// is refused with EOPNOTSUPP, and left out of listings: SELinux labels a FUSE mount
    /// by policy (genfs), answers a get of the label itself and refuses a set, so a
    /// stored label could only matter on a host without SELinux, where nothing reads it.
    /// The refusal is what `ls -l` remembers per filesystem (ENODATA it asks again for
    /// every file, a FUSE round trip each that the kernel does not cache).
    selinux_xattr: bool,
}

/// Where READs and WRITEs were served, for `etcfs stats`: on the core (no etcd, no waiter)
/// or on a waiter.
#[derive(Default)]
struct DataCounters {
    reads_on_core: AtomicU64,
    reads_on_waiter: AtomicU64,
    writes_on_core: AtomicU64,
    writes_on_waiter: AtomicU64,
    /// Freed device ranges the freeing commit could not log as released records (a file
    /// too large for its map to be cached): a crash before their free-map write leaks them.
    frees_unlogged: AtomicU64,
    /// Overwrite mtimes written again holding the file's lock: their commit without it
    /// found the inode changed (`Inner::persist_mtime`).
    mtime_commits_relocked: AtomicU64,
    /// Read-modify-writes that found the block's old contents in the file's
    /// [`files::RecentBlocks`] instead of reading the device.
    rmw_blocks_kept: AtomicU64,
    /// WRITEs answered with their blocks held ([`files::HeldBlocks`]).
    writes_held: AtomicU64,
    /// Held blocks written out, and how many device writes that took.
    held_blocks_written: AtomicU64,
    held_block_runs_written: AtomicU64,
    /// Held blocks that never reached the device (a failed write-out, or a fence).
    held_blocks_lost: AtomicU64,
}

/// The device I/O of the waiters and the daemon's own threads (what goes through
/// [`Inner::io`]; the workers count theirs in the transport), for `etcfs stats`.
#[derive(Default)]
pub(crate) struct DevCounters {
    pub(crate) reads: AtomicU64,
    pub(crate) read_bytes: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) write_bytes: AtomicU64,
    pub(crate) flushes: AtomicU64,
}

/// LOOKUP misses of one directory in ascending name order.
#[derive(Default)]
struct LookupStreak {
    last: Option<Vec<u8>>,
    last_ino: u64,
    count: u32,
    /// The names whose files' locks prefetches took: from after the first (`None`: the
    /// directory's start) through the second.
    covered: Option<(Option<Vec<u8>>, Vec<u8>)>,
}

/// One open directory: the names behind the cookies it handed out, and what it read
/// from etcd ahead of the kernel.
#[derive(Default)]
struct DirHandle {
    names: HashMap<u64, Vec<u8>>,
    ahead: Option<dir::Lookahead>,
}

/// The permission bits after a write, truncate or chown by someone without CAP_FSETID
/// (the kernel says so with its kill flag), as ext4 clears them: set-user-id always,
/// set-group-id only with group execute (without it the bit marks mandatory locking).
fn killed_perm(perm: u16) -> u16 {
    meta::types::kill_suidgid(perm)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl EtcFs {
    /// Mounts: connects etcd (a clear error within 5 s when unreachable), checks that the
    /// device is the filesystem etcd describes, registers this node's session, claims
    /// allocation groups and reclaims dead nodes' orphans.
    pub(crate) fn open(cfg: FsConfig) -> anyhow::Result<EtcFs> {
        let keys = Keyspace::new(&cfg.prefix).map_err(|e| anyhow!("bad --prefix: {e:?}"))?;
        let dev = open_device(&cfg.device, OpenOpts::default()).map_err(|e| anyhow!("{e}"))?;
        let t0 = std::time::Instant::now();
        let unreachable = |e: MetaError| match e {
            MetaError::Denied(_) => anyhow!("{e}"),
            e => anyhow!(
                "cannot reach etcd at {} (after {:.1} s): {e}",
                cfg.etcd.endpoints.join(","),
                t0.elapsed().as_secs_f64()
            ),
        };
        // The session is registered only once etcd and the device are known to hold this
        // filesystem: a refused mount leaves nothing in etcd.
        let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
        let pipeline = Pipeline::start_deferred(
            connect_etcd(cfg.etcd.clone()),
            keys,
            clock.clone(),
            PipelineConfig {
                read_only: cfg.read_only,
                ..pipeline_config()
            },
        )
        .map_err(unreachable)?;
        let dev = Dev::File(dev);
        let geometry = check_filesystem(&pipeline.client(), &dev)?;
        let session = pipeline
            .register_session_with(
                &session_config(cfg.lease_ttl_s, Arc::new(meta::fence::Fence::new(clock))),
                Some(group_layout(&geometry)),
            )
            .map_err(unreachable)?;
        let opts = CacheOpts {
            attr_timeout: cfg.attr_timeout,
            entry_timeout: cfg.entry_timeout,
            negative_timeout: cfg.negative_timeout,
            dir_names_max: cfg.dir_names_max,
            cores: cfg.cores,
            lock_min_hold: cfg.lock_min_hold,
            lease_ttl_s: cfg.lease_ttl_s,
            noatime: cfg.noatime,
            read_only: cfg.read_only,
            selinux_xattr: cfg.selinux_xattr,
        };
        Self::open_checked(
            pipeline,
            session,
            dev,
            geometry,
            &opts,
            (cfg.cores * WAITERS_PER_CORE).max(WAITERS_MIN),
        )
    }

    /// Mounts on a running pipeline and session (tests: the model and a memory device).
    #[cfg(test)]
    pub(crate) fn open_with(
        pipeline: Pipeline,
        session: Session,
        dev: Dev,
        opts: &CacheOpts,
        waiters: usize,
    ) -> anyhow::Result<EtcFs> {
        let geometry = check_filesystem(&pipeline.client(), &dev)?;
        Self::open_checked(pipeline, session, dev, geometry, opts, waiters)
    }

    /// Mounts once [`check_filesystem`] has accepted etcd and the device.
    fn open_checked(
        pipeline: Pipeline,
        session: Session,
        dev: Dev,
        geometry: Geometry,
        opts: &CacheOpts,
        waiters: usize,
    ) -> anyhow::Result<EtcFs> {
        let meta = pipeline.client();
        let fence = session.fence().clone();
        let session = Arc::new(session);
        let cache_locks = session.cache_locks();
        let inner = Arc::new(Inner {
            attr_timeout: opts.attr_timeout,
            entry_timeout: opts.entry_timeout,
            negative_timeout: opts.negative_timeout,
            caches: Caches::new(CacheConfig::for_cores(opts.cores, opts.dir_names_max)),
            notifier: Mutex::new(None),
            meta,
            pipeline: Mutex::new(Some(pipeline)),
            session: Mutex::new(Some(session)),
            fence: fence.clone(),
            generation: AtomicU64::new(1),
            fenced: AtomicBool::new(false),
            rejoin_at: Mutex::new(None),
            fenced_at: Mutex::new(None),
            rejoin_failures: AtomicU64::new(0),
            lease_ttl_s: opts.lease_ttl_s,
            dev,
            geometry,
            alloc: Mutex::new(Allocator::new(geometry)),
            claiming: Mutex::new(()),
            space_wanted: AtomicBool::new(false),
            idle_groups: Mutex::default(),
            files: Files::default(),
            locks: locks::LockTable::new(cache_locks, fence, opts.lock_min_hold),
            held: held::Held::default(),
            dirs: Mutex::new(HashMap::new()),
            dir_ahead_bytes: AtomicUsize::new(0),
            lookup_streaks: Mutex::new(HashMap::new()),
            plus_given: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            data_counters: DataCounters::default(),
            dev_counters: Arc::default(),
            plocks: plocks::Plocks::default(),
            inode_count: Mutex::new(None),
            counting: Mutex::new(()),
            noatime: opts.noatime || opts.read_only,
            read_only: opts.read_only,
            selinux_xattr: opts.selinux_xattr,
        });
        if opts.read_only {
            log::info!("read-only: no group claims, no reclaims, no atime writes");
        } else {
            inner.revoke_dead_local_sessions();
            inner
                .claim_groups(GROUPS_CLAIM_INITIAL)
                .context("claiming allocation groups")?;
            if let Err(e) = inner.reclaim_dead_orphans() {
                log::warn!("reclaiming orphans of dead nodes: {e}");
            }
        }
        let hk = {
            let weak = Arc::downgrade(&inner);
            std::thread::Builder::new()
                .name("etcfs-housekeeping".into())
                .spawn(move || housekeeping(weak))
                .context("spawning the housekeeping thread")?
        };
        let inval = watch::start(&inner).context("spawning the invalidation thread")?;
        let lock_thread = inner
            .start_lock_thread()
            .context("spawning the lock thread")?;
        Ok(EtcFs {
            pool: Pool::new(waiters, WAITER_QUEUE_MAX, inner.clone()),
            inner,
            housekeeping: Mutex::new(Some(hk)),
            invalidation: Mutex::new(Some(inval)),
            lock_thread: Mutex::new(Some(lock_thread)),
        })
    }

    /// Hands the filesystem the means to invalidate the kernel's caches; call once the
    /// FUSE session runs. Until then, invalidations the watch produces are only applied
    /// to the daemon's caches (the kernel cannot have cached anything yet).
    #[allow(
        dead_code,
        reason = "the daemon holds a dyn Handler and uses the process-wide fs::set_notifier"
    )]
    pub(crate) fn set_notifier(&self, n: Notifier) {
        *lock(&self.inner.notifier) = Some(n);
    }

    #[cfg(test)]
    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }
}

/// This node's session: its name, lease TTL, and the fence it keeps (one for the
/// filesystem's life: every session after a rejoin keeps the same one).
fn session_config(ttl_s: i64, fence: Arc<meta::fence::Fence>) -> SessionConfig {
    SessionConfig {
        ttl_s,
        fence: Some(fence),
        ..SessionConfig::new(&node_name())
    }
}

fn node_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "etcfs-node".into())
}

/// Periodically claims groups when none are owned, reclaims orphans nobody holds open and
/// folds other nodes' frees in our groups
/// (after a crash the old session's lease needs its TTL to expire first).
fn housekeeping(inner: std::sync::Weak<Inner>) {
    loop {
        let step = HOUSEKEEPING_STEP;
        let mut waited = Duration::ZERO;
        while waited < HOUSEKEEPING_INTERVAL {
            std::thread::sleep(step);
            waited += step;
            match inner.upgrade() {
                Some(i) if !i.stopping.load(Ordering::Acquire) => {
                    i.watch_fence();
                    if i.fenced.load(Ordering::Acquire) {
                        continue;
                    }
                    i.commit_aged();
                    i.unhold_idle(false);
                    let second = waited.as_millis() % 1000 < step.as_millis();
                    if second {
                        i.retry_releases();
                        i.return_delegations();
                        i.drop_strays();
                    }
                    if i.read_only {
                        continue;
                    }
                    if second {
                        i.fold_released();
                    }
                    if i.space_wanted.swap(false, Ordering::AcqRel) {
                        i.hand_back_groups();
                    }
                }
                _ => return,
            }
        }
        let Some(i) = inner.upgrade() else { return };
        if i.fenced.load(Ordering::Acquire) {
            continue;
        }
        if i.read_only {
            i.trim_locks();
            continue;
        }
        if lock(&i.alloc).owned().is_empty() {
            if let Err(e) = i.claim_groups(GROUPS_CLAIM_INITIAL) {
                log::warn!("claiming allocation groups: {e}");
            }
        }
        if let Err(e) = i.reclaim_dead_orphans() {
            log::warn!("reclaiming orphans of dead nodes: {e}");
        }
        i.give_back_idle_groups(GROUP_IDLE_GIVE_BACK);
        i.trim_locks();
    }
}

/// What a waiter answers with.
pub(crate) enum Done {
    Bytes(Vec<u8>),
    Read(ReadPlan),
    Empty,
}

impl Done {
    /// A READ plan that the transport runs after the file's lock is let go keeps `io`
    /// counted until its reads are over (see [`FileState::begin_io`]); other answers
    /// touch the device no more and let it go at once.
    fn held_by(self, io: files::IoInFlight) -> Done {
        match self {
            Done::Read(mut plan) => {
                plan.hold = Some(Hold::new(io));
                Done::Read(plan)
            }
            other => other,
        }
    }
}

fn done_bytes<T: IntoBytes + Immutable>(v: &T) -> Done {
    Done::Bytes(v.as_bytes().to_vec())
}

impl Inner {
    fn entry_out(&self, a: &InodeAttr, blocks: Option<u64>) -> EntryOut {
        EntryOut::new(
            a.generation,
            self.entry_timeout,
            self.attr_ttl(a),
            fuse_attr(&self.with_times(a), blocks),
        )
    }

    fn attr_out(&self, a: &InodeAttr, blocks: Option<u64>) -> AttrOut {
        AttrOut::new(self.attr_ttl(a), fuse_attr(&self.with_times(a), blocks))
    }

    /// How long the kernel may keep `a`: a regular file's attributes only while this
    /// node holds its cluster lock (giving the lock up drops them), so not at all when
    /// it does not (a READDIRPLUS entry of a file another node writes).
    fn attr_ttl(&self, a: &InodeAttr) -> Duration {
        if a.kind == FileType::Regular && self.locks.held(a.ino.0).is_none() {
            Duration::ZERO
        } else {
            self.attr_timeout
        }
    }

    /// The attributes with the times this node moved and etcd shows only after the
    /// pipeline's coalesced write.
    fn with_times(&self, a: &InodeAttr) -> InodeAttr {
        let mut a = a.clone();
        self.caches.apply_times(&mut a);
        a
    }

    fn new_fh(&self) -> u64 {
        fence::handle(
            self.op_generation(),
            self.next_fh.fetch_add(1, Ordering::Relaxed),
        )
    }

    /// Commits a mutation and waits (on a waiter thread).
    fn commit(&self, m: Mutation) -> Result<Outcome, Errno> {
        let ns = NsChange::of(&m, &self.caches);
        // A file this commit creates has no blocks: cache that, so a stat of it needs no
        // extent read (unless some extent changed meanwhile, which the generation catches).
        let new_file_blocks =
            matches!(m, Mutation::Create { .. }).then(|| self.caches.blocks_gen());
        if let Mutation::SetAttr { ino, .. } = &m {
            // Its times are what it says (an explicit utimes may go back).
            self.caches.forget_times(ino.0);
        }
        match self.commit_op(m) {
            Ok(out) => {
                for &(ino, mtime, t) in &out.touched {
                    self.caches.own_times(ino.0, mtime.then_some(t), t);
                }
                self.after_commit(&out);
                if let (Some(ino), None) = (out.ino, &out.attr) {
                    // Changed, but the outcome does not say to what.
                    self.caches.forget_attr(ino.0);
                }
                self.own_namespace(&ns, &out);
                if let (Some(gen), Some(ino), Some(a)) = (new_file_blocks, out.ino, &out.attr) {
                    if a.kind == FileType::Regular {
                        self.caches.fill_blocks(ino.0, 0, gen);
                    }
                }
                Ok(out)
            }
            Err(e) => {
                match e {
                    // It may have been applied: what it touched is unknown now.
                    MetaError::Unavailable(_) => ns.forget(&self.caches),
                    // etcd contradicted what this node's caches said of the name (another
                    // node created or removed it, and the watch has not told us yet).
                    // The kernel's side is the dispatcher's (`Inner::names_refused`).
                    MetaError::Exists | MetaError::NotFound => ns.forget(&self.caches),
                    _ => {}
                }
                Err(errno::meta(&e))
            }
        }
    }

    /// A namespace change failed with `refused` (EEXIST for a create, ENOENT for a
    /// removal, either for a rename): the kernel sent it only because its cached entry said
    /// otherwise, so that entry is stale, and the caller's next lookup must see what etcd
    /// just said (`mkdir -p` racing another node stats the name right after EEXIST). The
    /// daemon's own entries went with the refused commit (`Inner::commit`). The kernel's
    /// cannot go by INVAL_ENTRY, which waits for the directory's lock that this very request
    /// holds, so every dentry of the mount is made stale with one epoch bump instead
    /// (looked up again on next use, answered from the daemon's caches). It happens only
    /// when two nodes race on one name.
    fn names_refused<T>(&self, r: Result<T, Errno>, refused: &[Errno]) -> Result<T, Errno> {
        if let Err(e) = &r {
            if refused.contains(e) {
                self.kernel_names_stale();
            }
        }
        r
    }

    fn kernel_names_stale(&self) {
        self.caches.n.kernel_epochs.fetch_add(1, Ordering::Relaxed);
        let n = lock(&self.notifier)
            .clone()
            .or_else(|| PROCESS_NOTIFIER.get().cloned());
        if let Some(n) = n {
            if let Err(e) = n.inc_epoch() {
                log::warn!("making the kernel's cached names stale: {e}");
            }
        }
    }

    /// Installs a committed namespace change in the caches (read-your-writes); the watch
    /// later sees it marked as ours and leaves the kernel alone.
    fn own_namespace(&self, ns: &NsChange, out: &Outcome) {
        let c = &self.caches;
        let rev = out.revision.0;
        let new_entry = || {
            out.ino
                .zip(out.attr.as_ref())
                .map(|(ino, a)| meta::codec::Dentry { ino, kind: a.kind })
        };
        match ns {
            NsChange::None => {}
            NsChange::Create { parent, name } => {
                let d = new_entry();
                if let Some(d) = d {
                    if d.kind == FileType::Directory {
                        // A new directory is empty at its creation revision, and the
                        // parent's link count changed.
                        c.fill_dir(d.ino.0, [], rev);
                        c.forget_attr(*parent);
                    }
                    c.own_dentry(*parent, name, Some(d), rev);
                } else {
                    c.forget_name(*parent, name);
                }
            }
            NsChange::Unlink { parent, name, dir } => {
                c.own_dentry(*parent, name, None, rev);
                if *dir {
                    c.forget_attr(*parent);
                    if let Some(child) = out.ino {
                        c.forget_dir(child.0);
                    }
                }
            }
            NsChange::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
                exchange,
                replaced,
            } => {
                if let Some(r) = replaced {
                    c.forget_attr(*r);
                    c.forget_dir(*r);
                }
                let moved = new_entry();
                if *exchange || moved.is_none() {
                    c.forget_name(*src_parent, src_name);
                    c.forget_name(*dst_parent, dst_name);
                } else {
                    c.own_dentry(*src_parent, src_name, None, rev);
                    c.own_dentry(*dst_parent, dst_name, moved, rev);
                }
                if *exchange || moved.is_some_and(|d| d.kind == FileType::Directory) {
                    c.forget_attr(*src_parent);
                    c.forget_attr(*dst_parent);
                }
            }
        }
    }

    /// Bookkeeping every committed mutation needs: cached attributes, orphans, frees.
    fn after_commit(&self, out: &Outcome) {
        if let (Some(ino), Some(attr)) = (out.ino, &out.attr) {
            self.files
                .update_attr(ino.0, attr, out.revision.0, out.attr_before.as_ref());
            self.caches.own_attr(attr, out.revision.0);
        }
        if let Some(ino) = out.orphaned {
            // Orphaned because *some* file was open here; if this one is not, reclaim now.
            if !self.files.mark_orphaned(ino.0) {
                self.orphaned_while_closed(ino.0);
                self.reclaim_orphan(ino);
            }
        }
        if let Some(ino) = out.removed {
            self.files.forget_extents(ino.0);
            self.caches.forget_attr(ino.0);
        }
        if !out.freed.is_empty() {
            let logged = |r: &meta::pipeline::DevRange| {
                out.released
                    .iter()
                    .filter(|p| dev_range_within(p, r))
                    .map(|p| p.len)
                    .sum::<u64>()
                    == r.len
            };
            let unlogged = out.freed.iter().filter(|r| !logged(r)).count() as u64;
            self.data_counters
                .frees_unlogged
                .fetch_add(unlogged, Ordering::Relaxed);
            self.release_blocks(&out.freed, &out.released, out.revision.0);
        }
    }

    /// Commits while holding the file's lock: updates the cached attributes inline (the
    /// generic `after_commit` would take the same lock) and leaves the rest to
    /// [`Inner::after_commit_unlocked`].
    fn commit_locked(&self, f: &mut files::FileInner, m: Mutation) -> Result<Outcome, Errno> {
        if let Mutation::SetAttr { ino, .. } = &m {
            self.caches.forget_times(ino.0);
        }
        // Times, mode and owner leave the extents alone: the map kept at a close stays
        // (an open+close loop committed each close's atime, which dropped it).
        let extents = match &m {
            Mutation::SetAttr { set, .. } => set.size.is_some(),
            _ => true,
        };
        let r = self.commit_op(m);
        self.settle_locked(f, r, extents)
    }

    /// What every commit under a file's lock does after etcd answers; `extents`: the
    /// mutation may have changed the file's extents.
    fn settle_locked(
        &self,
        f: &mut files::FileInner,
        r: Result<Outcome, MetaError>,
        extents: bool,
    ) -> Result<Outcome, Errno> {
        // Whatever this mutation was, the record of the last extents commit is only
        // current if this one was such a commit, or changed only what the record's
        // attributes say (see `Outcome::attr_before`).
        let prior = f.committed.take();
        let out = match r {
            Ok(o) => o,
            Err(e) => {
                // It may have been applied (etcd did not answer): its extents with it.
                self.caches.forget_attr(f.attr.ino.0);
                self.caches.forget_blocks(f.attr.ino.0);
                return Err(errno::meta(&e));
            }
        };
        if let Some(a) = &out.attr {
            f.set_attr(a, out.revision.0);
            self.caches.own_attr(a, out.revision.0);
            f.committed = match out.extents_known.clone() {
                Some(known) => Some(files::CommittedRecord {
                    attr: a.clone(),
                    known,
                }),
                None => prior
                    .filter(|c| out.attr_before.as_ref() == Some(&c.attr))
                    .map(|c| files::CommittedRecord {
                        attr: a.clone(),
                        known: c.known,
                    }),
            };
        }
        // Writes, truncates, fallocate and punch change the extents: st_blocks with them.
        if extents {
            self.caches.forget_blocks(f.attr.ino.0);
        }
        f.windows.clear();
        Ok(out)
    }

    fn after_commit_unlocked(&self, out: &Outcome) {
        let trimmed = Outcome {
            attr: None,
            ..out.clone()
        };
        self.after_commit(&trimmed);
    }

    fn kill_suid(&self, ino: u64) -> Result<(), Errno> {
        self.commit(Mutation::SetAttr {
            ino: Ino(ino),
            set: SetAttr {
                kill_suidgid: true,
                expect: self.caches.attr(ino).map(Box::new),
                ..SetAttr::default()
            },
        })?;
        // The kernel marks only times and size stale after a WRITE, so a statx asking
        // for the mode alone (`stat -c %a`) kept showing the set-id bits (found by
        // tests/permissions.rs's ext4 comparison). An attribute drop takes no lock the
        // WRITE in progress holds.
        self.drop_kernel_attrs(ino);
        Ok(())
    }

    /// Makes the kernel ask for `ino`'s attributes again (not its pages): for changes it
    /// cannot know of, made outside a request about them.
    pub(super) fn drop_kernel_attrs(&self, ino: u64) {
        self.forget_plus_given(std::iter::once(ino));
        let n = lock(&self.notifier)
            .clone()
            .or_else(|| PROCESS_NOTIFIER.get().cloned());
        if let Some(n) = n {
            self.caches
                .n
                .kernel_inval_inode
                .fetch_add(1, Ordering::Relaxed);
            if let Err(e) = n.inval_inode(ino, -1, 0) {
                log::debug!("kernel attribute drop of inode {ino}: {e}");
            }
        }
    }

    fn statfs(&self) -> Result<Done, Errno> {
        let free = self.device_free_blocks()?;
        let used = self.used_inodes()?.min(STATFS_FILES);
        let st = Kstatfs {
            blocks: self.geometry.data_blocks(),
            bfree: free,
            bavail: free,
            files: STATFS_FILES,
            ffree: STATFS_FILES - used,
            bsize: BLOCK_SIZE as u32,
            namelen: NAME_MAX as u32,
            frsize: BLOCK_SIZE as u32,
            ..Kstatfs::default()
        };
        Ok(done_bytes(&st))
    }

    /// Used inodes for statfs, at most [`INODE_COUNT_TTL`] old (plus the etcd read).
    /// One waiter counts at a time; the others answer the previous count meanwhile, and
    /// wait for the count only when there is none.
    fn used_inodes(&self) -> Result<u64, Errno> {
        let fresh = |c: &Option<(std::time::Instant, u64)>| {
            c.filter(|(at, _)| at.elapsed() < INODE_COUNT_TTL)
                .map(|(_, n)| n)
        };
        if let Some(n) = fresh(&lock(&self.inode_count)) {
            return Ok(n);
        }
        let _counting = match self.counting.try_lock() {
            Ok(g) => g,
            Err(_) => {
                if let Some((_, n)) = *lock(&self.inode_count) {
                    return Ok(n);
                }
                lock(&self.counting)
            }
        };
        if let Some(n) = fresh(&lock(&self.inode_count)) {
            return Ok(n);
        }
        let n = run_read(&self.meta, |kv, keys| {
            Box::pin(async move { meta::reader::inode_count(&*kv, &keys).await })
        })
        .map_err(|e| errno::meta(&e))?;
        *lock(&self.inode_count) = Some((std::time::Instant::now(), n));
        Ok(n)
    }

    /// DESTROY: write pending timestamps, close open files, end the session.
    fn shutdown(&self) {
        if self.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        self.release_all_locks();
        self.unhold_idle(true);
        for ino in self.files.all() {
            if let Err(e) = self.sync_pending(ino) {
                log::error!("committing pending writes of inode {ino} at unmount: {e}");
            }
            self.flush_mtime(ino);
        }
        if let Err(e) = self.dev.io().flush() {
            log::error!("device flush at unmount: {e}");
        }
        if let Ok(t) = self.meta.flush(None) {
            if let Err(e) = t.wait() {
                log::error!("metadata flush at unmount: {e}");
            }
        }
        self.fold_before_leaving();
        // Orphans still open here stay in etcd with our session; once the session is
        // closed they are dead and the next mount (of any node) reclaims them.
        let session = lock(&self.session).take();
        if let Some(s) = session {
            match Arc::try_unwrap(s) {
                Ok(s) => {
                    if let Err(e) = run_read(&self.meta, move |_, _| {
                        Box::pin(async move { s.close().await })
                    }) {
                        log::warn!("closing the session: {e}");
                    }
                }
                Err(_) => log::warn!("session still referenced at unmount; leaving it to expire"),
            }
        }
        if let Some(p) = lock(&self.pipeline).take() {
            p.shutdown();
        }
    }
}

/// The names a mutation changes, noted before it is committed.
enum NsChange {
    None,
    Create {
        parent: u64,
        name: Vec<u8>,
    },
    Unlink {
        parent: u64,
        name: Vec<u8>,
        dir: bool,
    },
    Rename {
        src_parent: u64,
        src_name: Vec<u8>,
        dst_parent: u64,
        dst_name: Vec<u8>,
        exchange: bool,
        /// The destination's inode as the caches knew it (its link count changes).
        replaced: Option<u64>,
    },
}

impl NsChange {
    fn of(m: &Mutation, caches: &Caches) -> NsChange {
        match m {
            Mutation::Create { parent, name, .. } | Mutation::Link { parent, name, .. } => {
                NsChange::Create {
                    parent: parent.0,
                    name: name.clone(),
                }
            }
            Mutation::Unlink {
                parent, name, dir, ..
            } => NsChange::Unlink {
                parent: parent.0,
                name: name.clone(),
                dir: *dir,
            },
            Mutation::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
                mode,
                ..
            } => NsChange::Rename {
                src_parent: src_parent.0,
                src_name: src_name.clone(),
                dst_parent: dst_parent.0,
                dst_name: dst_name.clone(),
                exchange: *mode == RenameMode::Exchange,
                replaced: match caches.lookup(dst_parent.0, dst_name) {
                    Lookup::Found(d) => Some(d.ino.0),
                    _ => None,
                },
            },
            _ => NsChange::None,
        }
    }

    /// The mutation's fate is unknown: drop what it may have changed.
    fn forget(&self, c: &Caches) {
        match self {
            NsChange::None => {}
            NsChange::Create { parent, name } | NsChange::Unlink { parent, name, .. } => {
                c.forget_name(*parent, name);
                c.forget_attr(*parent);
            }
            NsChange::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
                replaced,
                ..
            } => {
                c.forget_name(*src_parent, src_name);
                c.forget_name(*dst_parent, dst_name);
                c.forget_attr(*src_parent);
                c.forget_attr(*dst_parent);
                if let Some(r) = replaced {
                    c.forget_attr(*r);
                }
            }
        }
    }
}

fn reply_write(n: u64) -> Result<Done, Errno> {
    let mut b = vec![0u8; 8];
    let k = reply::write(&mut b, u32::try_from(n).unwrap_or(u32::MAX)).ok_or(Errno::EIO)?;
    b.truncate(k);
    Ok(Done::Bytes(b))
}

fn sized(data: Vec<u8>, size: u32) -> Result<Done, Errno> {
    let len = u32::try_from(data.len()).map_err(|_| Errno::E2BIG)?;
    if size == 0 {
        let mut b = vec![0u8; 8];
        let n = reply::xattr_size(&mut b, len).ok_or(Errno::EIO)?;
        b.truncate(n);
        return Ok(Done::Bytes(b));
    }
    if size < len {
        return Err(Errno::ERANGE);
    }
    Ok(Done::Bytes(data))
}

/// Encoded free maps of `groups` for etcd.
/// The device blocks a file extent maps to.
fn device_blocks(e: &FileExtent) -> Extent {
    Extent::new(e.dev_off / BLOCK_SIZE, e.len / BLOCK_SIZE)
}

fn to_meta_extent(e: &FileExtent) -> meta::codec::Extent {
    meta::codec::Extent {
        file_off: e.file_off,
        len: e.len,
        dev_off: e.dev_off,
        unwritten: e.unwritten,
    }
}

/// Merges neighbours that are contiguous in the file and on the device with the same
/// state (fewer extent keys).
fn merge_extents(v: &[FileExtent]) -> Vec<FileExtent> {
    let mut out: Vec<FileExtent> = Vec::with_capacity(v.len());
    for e in v {
        match out.last_mut() {
            Some(l)
                if l.file_off + l.len == e.file_off
                    && l.dev_off + l.len == e.dev_off
                    && l.unwritten == e.unwritten =>
            {
                l.len += e.len;
            }
            _ => out.push(*e),
        }
    }
    out
}

/// Merges the extents of a sorted map around `[off, end)` (a write just replaced it) with
/// their neighbours, so a stream of appends keeps one extent in the cached map.
fn merge_around(map: &mut Vec<FileExtent>, off: u64, end: u64) {
    let a = map.partition_point(|e| e.file_off + e.len < off);
    let b = map.partition_point(|e| e.file_off <= end);
    if b > a + 1 {
        let merged = merge_extents(&map[a..b]);
        map.splice(a..b, merged);
    }
}

/// `e` cut to `[off, end)` (it overlaps it).
fn clip(e: &FileExtent, off: u64, end: u64) -> FileExtent {
    let s = e.file_off.max(off);
    let t = (e.file_off + e.len).min(end);
    FileExtent {
        file_off: s,
        len: t - s,
        dev_off: e.dev_off + (s - e.file_off),
        unwritten: e.unwritten,
    }
}

/// Extents of `map` in the parts of `union` outside `range` (what a pending range newly
/// covers when it grows to `union`).
fn newly_covered(map: &[FileExtent], range: (u64, u64), union: (u64, u64)) -> usize {
    // `overlapping` of an empty range still finds the extent around its offset.
    let count = |off: u64, len: u64| match len {
        0 => 0,
        _ => files::overlapping(map, off, len).len(),
    };
    count(union.0, range.0 - union.0) + count(range.1, union.1 - range.1)
}

/// The device offset of written data of the block at `file_off`, if any.
fn written_block(extents: &[FileExtent], file_off: u64) -> Option<u64> {
    extents
        .iter()
        .find(|e| e.file_off <= file_off && file_off < e.file_off + e.len)
        .filter(|e| !e.unwritten)
        .map(|e| e.dev_off + (file_off - e.file_off))
}

/// The block-aligned file range a read of `len` at `off` covers, clipped to EOF.
fn aligned_range(off: u64, len: u64, size: u64) -> (u64, u64) {
    let end = off.saturating_add(len).min(size);
    let a_off = off - off % BLOCK_SIZE;
    (a_off, end.next_multiple_of(BLOCK_SIZE) - a_off)
}

/// Builds the READ reply plan: block-aligned device segments and zeros covering
/// `[off, off + len)` clipped at EOF; `skip` drops the head of an unaligned request.
/// Bytes past EOF in the last block are zeros on the device (an fs invariant), so the
/// aligned tail is harmless.
pub(crate) fn build_read(
    extents: &[FileExtent],
    size: u64,
    off: u64,
    len: u64,
    fd: RawFd,
) -> Result<ReadPlan, dplan::PlanError> {
    let end = off.saturating_add(len).min(size);
    if off >= end {
        return Ok(ReadPlan::default());
    }
    let (a_off, a_len) = aligned_range(off, len, size);
    let spans = dplan::plan_read(extents, size.next_multiple_of(BLOCK_SIZE), a_off, a_len)?;
    let mut segments = Vec::with_capacity(spans.len());
    for s in &spans {
        match *s {
            ReadSpan::Device { dev_off, len } => {
                for (at, n) in device_pieces(len) {
                    segments.push(Segment::Device {
                        fd,
                        offset: dev_off + at,
                        len: n as usize,
                    });
                }
            }
            ReadSpan::Zero { len } => segments.push(Segment::Zero { len: len as usize }),
        }
    }
    Ok(ReadPlan {
        segments,
        skip: (off - a_off) as usize,
        len: (end - off) as usize,
        hold: None,
    })
}

/// Largest single device I/O of a READ or WRITE plan. A larger contiguous range goes as
/// several I/Os issued together, which the device serves in parallel: a 1 MiB request
/// then completes sooner than as one I/O (measured with benches/fs.sh).
const DEVICE_IO_MAX: u64 = 256 << 10;

/// `(offset, len)` pieces of a contiguous device range of `len` bytes, each at most
/// [`DEVICE_IO_MAX`] (block multiples stay block multiples: the maximum is one).
fn device_pieces(len: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..len)
        .step_by(DEVICE_IO_MAX as usize)
        .map(move |at| (at, (len - at).min(DEVICE_IO_MAX)))
}

/// A whole-block overwrite of written blocks inside EOF, which changes no metadata but
/// mtime (written at FLUSH/FSYNC/RELEASE): its device pieces, with the file's I/O count
/// raised for them. `None` for any other write, or one that must clear set-id bits.
fn plan_overwrite(
    st: &Arc<files::FileState>,
    f: &mut files::FileInner,
    off: u64,
    len: usize,
    kill_suid: bool,
    fd: RawFd,
) -> Option<(Vec<WriteSegment>, files::IoInFlight)> {
    if kill_suid && killed_perm(f.attr.perm) != f.attr.perm {
        return None;
    }
    let segments = overwrite_segments(f.extents.as_ref()?, f.attr.size, off, len, fd)?;
    f.recent.forget(off, len as u64);
    f.touch_overwrite();
    Some((segments, st.begin_io(f)))
}

/// The whole blocks `[block_off, block_end)` a write of `len` bytes at `off` covers in
/// part or whole, with their device writes, when the write may be planned from copies of
/// them: no set-id bits to clear, every block written and inside EOF (not the block
/// holding EOF, whose bytes past EOF must stay zeros; the waiter sees to it), and no
/// device I/O of the file in flight (two writes of one block in flight may land in either
/// order, and an older one could land after this one).
fn partial_overwrite_span(
    st: &Arc<files::FileState>,
    f: &files::FileInner,
    off: u64,
    len: usize,
    kill_suid: bool,
    fd: RawFd,
) -> Option<(u64, u64, Vec<WriteSegment>)> {
    if kill_suid && killed_perm(f.attr.perm) != f.attr.perm {
        return None;
    }
    let end = off.checked_add(len as u64)?;
    let block_off = off - off % BLOCK_SIZE;
    let block_end = end.next_multiple_of(BLOCK_SIZE);
    if len == 0 || block_end > f.attr.size || st.io_busy(f) {
        return None;
    }
    let segments = overwrite_segments(
        f.extents.as_ref()?,
        f.attr.size,
        block_off,
        usize::try_from(block_end - block_off).ok()?,
        fd,
    )?;
    Some((block_off, block_end, segments))
}

/// The device offset of the block at file offset `block` in `segments`, the device writes
/// of the blocks from `block_off` on.
fn dev_of(segments: &[WriteSegment], block_off: u64, block: u64) -> Option<u64> {
    let at = block - block_off;
    segments
        .iter()
        .find(|s| (s.src as u64) <= at && at < (s.src + s.len) as u64)
        .map(|s| s.offset + (at - s.src as u64))
}

/// An overwrite that covers its first or last block in part, on a core: the blocks it
/// touches built from this node's copies of its partial edge blocks and `data`, and their
/// device writes from that image. `None` unless [`partial_overwrite_span`] allows it and
/// each partial edge block is kept ([`files::RecentBlocks`]). The copies become the blocks
/// as this write leaves them. Should the write fail, they keep its bytes, as a page cache keeps a write its
/// write-back failed, and the next write into the block carries them.
fn plan_merged_overwrite(
    st: &Arc<files::FileState>,
    f: &mut files::FileInner,
    off: u64,
    data: &[u8],
    kill_suid: bool,
    fd: RawFd,
) -> Option<MergedOverwrite> {
    let (block_off, block_end, segments) =
        partial_overwrite_span(st, f, off, data.len(), kill_suid, fd)?;
    let block_len = block_end - block_off;
    let end = off + data.len() as u64;
    let dev_of = |block: u64| dev_of(&segments, block_off, block);
    let last = block_end - BLOCK_SIZE;
    let mut edges = Vec::with_capacity(2);
    if off != block_off {
        edges.push(block_off);
    }
    if end != block_end && !edges.contains(&last) {
        edges.push(last);
    }
    let mut image = AlignedBuf::new(usize::try_from(block_len).ok()?);
    for &block in &edges {
        let kept = f.recent.get(block, dev_of(block)?)?;
        let at = (block - block_off) as usize;
        image[at..at + BLOCK_SIZE as usize].copy_from_slice(kept);
    }
    let d = (off - block_off) as usize;
    image[d..d + data.len()].copy_from_slice(data);
    f.recent.forget(block_off, block_len);
    f.recent.put_edges(block_off, &image, dev_of);
    f.touch_overwrite();
    Some(MergedOverwrite {
        segments,
        io: st.begin_io(f),
        image,
        kept: edges.len() as u64,
    })
}

/// A buffered overwrite answered without the device: the blocks of `[off, off + len)`
/// as the write leaves them, held in the file's [`files::HeldBlocks`] until written out.
/// Each partial block is built on the held or kept copy of it (no device read). `None`,
/// changing nothing, unless [`partial_overwrite_span`] allows it, the write spans at most
/// [`HOLD_WRITE_MAX`], its partial blocks are held or kept, and the bounds of
/// [`files::HeldBlocks::reserve`] have room. Returns the blocks held.
fn plan_held_overwrite(
    st: &Arc<files::FileState>,
    f: &mut files::FileInner,
    off: u64,
    data: &[u8],
    kill_suid: bool,
) -> Option<u64> {
    let (block_off, block_end, segments) =
        partial_overwrite_span(st, f, off, data.len(), kill_suid, -1)?;
    let block_len = block_end - block_off;
    if block_len > HOLD_WRITE_MAX {
        return None;
    }
    let end = off + data.len() as u64;
    let mut blocks = Vec::with_capacity((block_len / BLOCK_SIZE) as usize);
    for block in (block_off..block_end).step_by(BLOCK_SIZE as usize) {
        let dev_off = dev_of(&segments, block_off, block)?;
        // The write's bytes within this block.
        let from = off.max(block);
        let to = end.min(block + BLOCK_SIZE);
        let mut buf = uring::AlignedBuf::new(BLOCK_SIZE as usize);
        if to - from < BLOCK_SIZE {
            let base = f
                .held
                .get(block, dev_off)
                .or_else(|| f.recent.get(block, dev_off))?;
            buf.copy_from_slice(base);
        }
        let at = (from - block) as usize;
        let src = (from - off) as usize;
        buf[at..at + (to - from) as usize].copy_from_slice(&data[src..src + (to - from) as usize]);
        blocks.push((block, dev_off, buf));
    }
    let new = blocks
        .iter()
        .filter(|(block, dev_off, _)| f.held.get(*block, *dev_off).is_none())
        .count();
    if !f.held.reserve(new) {
        return None;
    }
    // The held blocks are newer than any copy of what the device has.
    f.recent.forget(block_off, block_len);
    let n = blocks.len() as u64;
    for (block, dev_off, buf) in blocks {
        f.held.put(block, dev_off, buf);
    }
    f.touch_overwrite();
    Some(n)
}

/// Largest overwrite held ([`plan_held_overwrite`]): larger ones gain nothing from it, the
/// device takes them at its bandwidth.
pub(crate) const HOLD_WRITE_MAX: u64 = 4 * BLOCK_SIZE;

/// What [`plan_merged_overwrite`] plans.
struct MergedOverwrite {
    /// Device writes from `image`.
    segments: Vec<WriteSegment>,
    io: files::IoInFlight,
    image: AlignedBuf,
    /// Edge blocks taken from this node's copies.
    kept: u64,
}

/// The device writes of a whole-block overwrite of `[off, off + len)`, when every block of
/// it is inside `size` and mapped to written (not unwritten) space; `None` otherwise (the
/// write then needs allocation, read-modify-write or a commit).
pub(crate) fn overwrite_segments(
    extents: &[FileExtent],
    size: u64,
    off: u64,
    len: usize,
    fd: RawFd,
) -> Option<Vec<WriteSegment>> {
    let len64 = len as u64;
    let end = off.checked_add(len64)?;
    if len == 0 || off % BLOCK_SIZE != 0 || len64 % BLOCK_SIZE != 0 || end > size {
        return None;
    }
    let mut segments = Vec::new();
    let mut at = off;
    for e in files::overlapping(extents, off, len64) {
        if e.unwritten || e.file_off > at {
            return None;
        }
        let piece_end = (e.file_off + e.len).min(end);
        for (rel, n) in device_pieces(piece_end - at) {
            segments.push(WriteSegment {
                fd,
                offset: e.dev_off + (at - e.file_off) + rel,
                src: (at - off + rel) as usize,
                len: n as usize,
            });
        }
        at = piece_end;
    }
    (at == end).then_some(segments)
}

/// Executes a read plan here (memory device, or a plan larger than the reply buffer).
fn exec_read(io: &mut dyn BlockDev, plan: &ReadPlan) -> Result<Vec<u8>, Errno> {
    let mut data = Vec::with_capacity(plan.total());
    for s in &plan.segments {
        match *s {
            Segment::Zero { len } => data.resize(data.len() + len, 0),
            Segment::Device { offset, len, .. } => {
                let mut buf = AlignedBuf::new(len);
                io.read_at(&mut buf, offset).map_err(|e| errno::dev(&e))?;
                data.extend_from_slice(&buf[..len]);
            }
        }
    }
    let end = (plan.skip + plan.len).min(data.len());
    Ok(data.get(plan.skip..end).unwrap_or_default().to_vec())
}

/// SEEK_DATA: the first offset at or after `off` inside written data (unwritten extents
/// read as zeros and count as holes, as on ext4 without dirty pages).
fn seek_data(extents: &[FileExtent], off: u64, size: u64) -> Option<u64> {
    extents
        .iter()
        .filter(|e| !e.unwritten && e.file_off + e.len > off)
        .map(|e| e.file_off.max(off))
        .find(|&p| p < size)
}

/// SEEK_HOLE: the first offset at or after `off` not in written data (EOF at the latest).
fn seek_hole(extents: &[FileExtent], off: u64, size: u64) -> u64 {
    let mut pos = off;
    for e in extents.iter().filter(|e| !e.unwritten) {
        if e.file_off > pos {
            break;
        }
        if e.file_off + e.len > pos {
            pos = e.file_off + e.len;
        }
    }
    pos.min(size)
}

fn wire_time(sec: u64, nsec: u32) -> Result<Timespec, Errno> {
    let t = Timespec::new(sec as i64, nsec);
    if t.is_valid() {
        Ok(t)
    } else {
        Err(Errno::EINVAL)
    }
}

/// The sum of extents' lengths in 512-byte blocks (st_blocks): allocated space, unwritten
/// (fallocated) extents included, as ext4 counts them.
fn extent_blocks(list: &[meta::codec::Extent]) -> u64 {
    list.iter().map(|e| e.len / 512).sum()
}

/// The FUSE attributes of an inode. `blocks` (512-byte units) as summed from a regular
/// file's extent map; for other types None, and the size rounded up to blocks.
fn fuse_attr(a: &InodeAttr, blocks: Option<u64>) -> Attr {
    let blocks = match (blocks, a.kind) {
        (Some(b), _) => b,
        // Every reply path sums a regular file's extents; should one ever not, 0 can
        // only under-report, while the size counts the holes of a sparse file as
        // allocated (issue 12: 2^31 blocks for 1 byte at 1 TiB, and `du` 4.1T on a
        // 2 GiB filesystem).
        (None, FileType::Regular) => 0,
        (None, _) => a.size.next_multiple_of(BLOCK_SIZE) / 512,
    };
    Attr {
        ino: a.ino.0,
        size: a.size,
        blocks,
        atime: a.atime.sec as u64,
        mtime: a.mtime.sec as u64,
        ctime: a.ctime.sec as u64,
        atimensec: a.atime.nsec,
        mtimensec: a.mtime.nsec,
        ctimensec: a.ctime.nsec,
        mode: a.mode(),
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev as u32,
        blksize: BLOCK_SIZE as u32,
        flags: 0,
    }
}

// Every xattr name the FUSE layer accepts must fit the metadata codec.
const _: () = assert!(fusedev::names::XATTR_NAME_MAX <= XATTR_NAME_LEN_MAX);

fn file_type_of(mode: u32) -> Result<FileType, Errno> {
    Ok(match mode & libc::S_IFMT {
        libc::S_IFREG | 0 => FileType::Regular,
        libc::S_IFCHR => FileType::CharDev,
        libc::S_IFBLK => FileType::BlockDev,
        libc::S_IFIFO => FileType::Fifo,
        libc::S_IFSOCK => FileType::Socket,
        _ => return Err(Errno::EINVAL),
    })
}

/// Copies an answer into the reply buffer (synchronous path).
fn to_reply(r: Result<Done, Errno>, out: &mut [u8]) -> Reply {
    match r {
        Ok(Done::Bytes(b)) => match reply::put_bytes(out, &b) {
            Some(n) => Reply::Bytes(n),
            None => Reply::Error(Errno::EIO),
        },
        Ok(Done::Empty) => Reply::Bytes(0),
        Ok(Done::Read(p)) => Reply::Read(p),
        Err(e) => Reply::Error(e),
    }
}

impl Drop for EtcFs {
    fn drop(&mut self) {
        self.destroy();
    }
}

trait ReadFrom {
    fn read_from(b: &[u8]) -> Self;
}

impl ReadFrom for OpenOut {
    fn read_from(b: &[u8]) -> Self {
        use fusedev::abi::FromBytes;
        OpenOut::read_from_prefix(b)
            .map(|(o, _)| o)
            .unwrap_or(OpenOut {
                fh: 0,
                open_flags: 0,
                backing_id: 0,
            })
    }
}

#[cfg(test)]
mod helper_tests {
    use super::*;

    const B: u64 = BLOCK_SIZE;

    fn ext(f: u64, n: u64, d: u64, unwritten: bool) -> FileExtent {
        FileExtent {
            file_off: f * B,
            len: n * B,
            dev_off: d * B,
            unwritten,
        }
    }

    #[test]
    fn overwrite_segments_only_for_written_whole_blocks_inside_eof() {
        let map = [
            ext(0, 2, 300, false),
            ext(2, 2, 500, false),
            ext(4, 1, 600, true),
            ext(6, 1, 700, false),
        ];
        let size = 8 * B;
        let seg = |offset: u64, src: u64, len: u64| WriteSegment {
            fd: 3,
            offset: offset * B,
            src: (src * B) as usize,
            len: (len * B) as usize,
        };
        // Across two extents: one write each, from the right place in the data.
        assert_eq!(
            overwrite_segments(&map, size, B, 3 * B as usize, 3),
            Some(vec![seg(301, 0, 1), seg(500, 1, 2)])
        );
        assert_eq!(
            overwrite_segments(&map, size, 6 * B, B as usize, 3),
            Some(vec![seg(700, 0, 1)])
        );
        // Unwritten space, a hole, unaligned, past EOF, empty: not an overwrite.
        assert_eq!(overwrite_segments(&map, size, 4 * B, B as usize, 3), None);
        assert_eq!(
            overwrite_segments(&map, size, 5 * B, 2 * B as usize, 3),
            None
        );
        assert_eq!(overwrite_segments(&map, size, 7 * B, B as usize, 3), None);
        assert_eq!(overwrite_segments(&map, size, 10, B as usize, 3), None);
        assert_eq!(overwrite_segments(&map, size, 0, 100, 3), None);
        assert_eq!(
            overwrite_segments(&map, 6 * B + 1, 6 * B, B as usize, 3),
            None
        );
        assert_eq!(overwrite_segments(&map, size, 0, 0, 3), None);
    }

    #[test]
    fn read_plan_is_block_aligned_with_skip() {
        let map = [ext(0, 2, 300, false), ext(3, 1, 400, false)];
        let size = 3 * B + 100;
        let p = build_read(&map, size, 10, 4 * B, 7).unwrap();
        assert_eq!(p.skip, 10);
        assert_eq!(p.len, (size - 10) as usize);
        assert_eq!(
            p.segments,
            vec![
                Segment::Device {
                    fd: 7,
                    offset: 300 * B,
                    len: 2 * B as usize
                },
                Segment::Zero { len: B as usize },
                Segment::Device {
                    fd: 7,
                    offset: 400 * B,
                    len: B as usize
                },
            ]
        );
        for s in &p.segments {
            if let Segment::Device { offset, len, .. } = *s {
                assert_eq!(offset % B, 0);
                assert_eq!(len as u64 % B, 0);
            }
        }
        assert!(build_read(&map, size, size, 10, 7)
            .unwrap()
            .segments
            .is_empty());
    }

    #[test]
    fn seek_data_and_hole() {
        let map = [
            ext(2, 2, 300, false),
            ext(4, 1, 50, true),
            ext(6, 1, 9, false),
        ];
        let size = 8 * B;
        assert_eq!(seek_data(&map, 0, size), Some(2 * B));
        assert_eq!(seek_data(&map, 3 * B, size), Some(3 * B));
        assert_eq!(seek_data(&map, 4 * B, size), Some(6 * B));
        assert_eq!(seek_data(&map, 7 * B, size), None);
        assert_eq!(seek_hole(&map, 0, size), 0);
        assert_eq!(seek_hole(&map, 2 * B, size), 4 * B);
        assert_eq!(seek_hole(&map, 6 * B + 1, size), 7 * B);
        assert_eq!(seek_hole(&[ext(0, 8, 1, false)], 0, 8 * B - 5), 8 * B - 5);
    }

    #[test]
    fn merge_and_names() {
        let m = merge_extents(&[
            ext(0, 1, 10, false),
            ext(1, 2, 11, false),
            ext(3, 1, 20, false),
        ]);
        assert_eq!(m, vec![ext(0, 3, 10, false), ext(3, 1, 20, false)]);
        assert_eq!(
            fusedev::names::check_entry_name(&[b'a'; 256]),
            Err(Errno::ENAMETOOLONG)
        );
        assert_eq!(fusedev::names::check_entry_name(b"a/b"), Err(Errno::EINVAL));
        assert!(fusedev::names::check_entry_name(&[b'a'; 255]).is_ok());
        assert_eq!(
            fusedev::names::check_xattr_name(&[b'a'; 256]),
            Err(Errno::ERANGE)
        );
        assert_eq!(file_type_of(libc::S_IFDIR), Err(Errno::EINVAL));
        assert_eq!(file_type_of(0), Ok(FileType::Regular));
    }
}
