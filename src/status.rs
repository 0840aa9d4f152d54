//! `etcfs status` (the filesystem, its nodes and etcd, with warnings) and `etcfs evict`
//! (end a node's session at once).
//!
//! Three parts: [`read_snapshot`] reads what etcd holds into a [`Snapshot`] (the only part
//! that talks to etcd, plus [`quota_from_url`] for the one number etcd's API does not
//! give); [`Report::new`] turns a snapshot into the report and its warnings, and
//! [`Report::render`] into a table (both pure, tested on hand-made snapshots); [`resolve`]
//! picks the node `evict` means.
//!
//! Every read is bounded: the keys of a tag are read in pages (a filesystem may hold
//! millions of lock and open records) at one revision, so the report is one consistent
//! picture, and only counts are kept of them, not the keys.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read as _, Write as _},
    net::{TcpStream, ToSocketAddrs as _},
    sync::Arc,
    time::Duration,
};

use anyhow::{anyhow, bail, Context as _, Result};
use meta::{
    cachelock::{CacheLock, LockMode},
    codec::{decode_at, NodeInfo, Owner, Record as _, Released, SuperRecord},
    error::KvError,
    etcd::{EtcdBackend, EtcdConfig},
    keys::{prefix_end, KeyKind, KeyRange, Keyspace, LockKey},
    kv::{
        Alarm, AlarmKind, ClusterMember, ClusterStatus, KeyValue, KvBackend, LeaseTtl, RangeRequest,
    },
    types::{Ino, SessionId},
};
use serde::Serialize;

use crate::data::{
    alloc::AgFreeMap,
    superblock::{fmt_uuid, Geometry},
    AgId, BLOCK_SIZE,
};

/// Keys per page of small records (members, groups, locks, open records, orphans).
const PAGE_KEYS: i64 = 4096;
/// Bytes of free maps per page (a map of the default group size is at most 64 KiB).
const PAGE_MAP_BYTES: u64 = 2 << 20;
/// Largest value etcd stores by default: the most one free map can take.
const ETCD_VALUE_BYTES_MAX: u64 = 1536 * 1024;
/// Undecodable records named in the report; more are counted.
const CORRUPT_SHOWN_MAX: usize = 20;
/// Orphan records remembered one by one (to tell which are still open); more are counted.
const ORPHANS_TRACKED_MAX: usize = 65_536;
/// A node whose lease has less than this part of its TTL left is near its deadline.
const LEASE_LEFT_WARN_DIVISOR: i64 = 3;
/// The etcd database above this percentage of its quota is a warning.
const DB_QUOTA_WARN_PERCENT: u64 = 80;
/// etcd's default `--quota-backend-bytes` (used when the metrics cannot be read).
const ETCD_DEFAULT_QUOTA_BYTES: u64 = 2 << 30;
/// Bounds on reading a member's `/metrics` page.
const METRICS_TIMEOUT: Duration = Duration::from_secs(2);
const METRICS_BYTES_MAX: u64 = 8 << 20;
/// The metric that holds a member's space quota.
const QUOTA_METRIC: &str = "etcd_server_quota_backend_bytes";

// ---------------------------------------------------------------------------------------
// What was read
// ---------------------------------------------------------------------------------------

/// Everything the report is made of, as read from etcd at one revision.
#[derive(Clone, Debug)]
pub(crate) struct Snapshot {
    pub(crate) prefix: String,
    /// The etcd revision every key was read at.
    pub(crate) revision: i64,
    pub(crate) fs: SuperRecord,
    /// Every `M` key: the node's session, its record and what etcd says of its lease.
    pub(crate) nodes: Vec<NodeSnap>,
    /// `G` keys: group → owner.
    pub(crate) owners: BTreeMap<u32, SessionId>,
    /// `F` keys: group → free blocks in its map (or why the map did not decode). A group
    /// without a map was never allocated from: all free.
    pub(crate) free_maps: BTreeMap<u32, Result<u64, String>>,
    /// Records kept per session (`K`, `Q`, `B`, `H`, `W`).
    pub(crate) tallies: BTreeMap<SessionId, Tally>,
    /// `O` keys: orphaned inode → the session that unlinked it (at most
    /// [`ORPHANS_TRACKED_MAX`]; `orphans_total` counts them all).
    pub(crate) orphans: BTreeMap<Ino, SessionId>,
    pub(crate) orphans_total: u64,
    /// Tracked orphans some node still has open (an `H` key).
    pub(crate) orphans_open: BTreeSet<Ino>,
    /// `R` keys: group (`None`: outside every group) → (records, blocks).
    pub(crate) released: BTreeMap<Option<u32>, (u64, u64)>,
    /// Keys whose value did not decode: the first few (the key and why), and how many.
    pub(crate) corrupt: Corrupt,
    pub(crate) etcd: EtcdSnap,
}

/// Records that did not decode.
#[derive(Clone, Debug, Default)]
pub(crate) struct Corrupt {
    /// The first [`CORRUPT_SHOWN_MAX`]: the key and why.
    pub(crate) shown: Vec<String>,
    pub(crate) total: u64,
}

impl Corrupt {
    fn push(&mut self, what: String) {
        self.total += 1;
        if self.shown.len() < CORRUPT_SHOWN_MAX {
            self.shown.push(what);
        }
    }
}

/// One `M` key.
#[derive(Clone, Debug)]
pub(crate) struct NodeSnap {
    pub(crate) session: SessionId,
    pub(crate) info: Result<NodeInfo, String>,
    /// The lease's time to live (`Err`: etcd did not say; `LeaseNotFound`: it ended).
    pub(crate) lease: Result<LeaseTtl, KvError>,
}

/// The records one session holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Tally {
    /// Cache locks held exclusively (`K`).
    pub(crate) cache_exclusive: u64,
    /// Cache locks held shared (`K`).
    pub(crate) cache_shared: u64,
    /// Cache locks waited for (`Q`).
    pub(crate) cache_waiting: u64,
    /// fcntl record locks (`B`, class 0).
    pub(crate) fcntl_locks: u64,
    /// flock locks (`B`, class 1).
    pub(crate) flock_locks: u64,
    /// Files whose fcntl and flock locks the node holds delegated (`B` delegation
    /// records): those locks are in its memory, not counted above.
    pub(crate) lock_delegations: u64,
    /// Files the node has open (`H`).
    pub(crate) files_open: u64,
    /// The node is out of space and asks others for some (`W`).
    pub(crate) wants_space: bool,
}

/// What etcd says of itself.
#[derive(Clone, Debug)]
pub(crate) struct EtcdSnap {
    pub(crate) endpoints: Vec<String>,
    pub(crate) members: Vec<ClusterMember>,
    pub(crate) status: ClusterStatus,
    pub(crate) alarms: Vec<Alarm>,
    /// The oldest revision still readable (0: never compacted; `None`: not found out).
    pub(crate) compact_revision: Option<i64>,
    /// The space quota and where it came from (`None`: etcd's default assumed).
    pub(crate) quota: Option<(u64, String)>,
}

/// Connects to etcd (an unreachable one, or refused credentials, an error within seconds).
pub(crate) fn connect(
    rt: &tokio::runtime::Runtime,
    cfg: &EtcdConfig,
) -> Result<Arc<dyn KvBackend>> {
    if cfg.endpoints.is_empty() {
        bail!("give the etcd endpoints with --etcd URL[,URL...]");
    }
    let b = rt
        .block_on(EtcdBackend::connect(cfg))
        .map_err(|e| match e {
            KvError::Auth(_) => anyhow!("{e}"),
            e => anyhow!("cannot reach etcd: {e}"),
        })?;
    // Reads and idempotent writes are sent again through an etcd election, as the
    // daemon's are; an operator's command should not fail for a second's outage.
    Ok(Arc::new(meta::patient::Patient::new(
        Arc::new(b),
        COMMAND_RETRY_BUDGET,
        Arc::default(),
    )))
}

/// How long a command resends what etcd did not answer (an election takes a second or
/// two).
const COMMAND_RETRY_BUDGET: Duration = Duration::from_secs(5);

/// A runtime for the etcd client (one thread: this is a command, not the daemon).
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the etcd client runtime")
}

/// The range of every key of one tag, from any key of that tag.
fn tag_range(keys: &Keyspace, sample: &[u8]) -> KeyRange {
    let start = sample[..keys.root().len() + 1].to_vec();
    KeyRange {
        end: prefix_end(&start),
        start,
    }
}

/// Reads `range` at `revision` in pages of `page` keys, handing each key to `f`.
async fn scan(
    kv: &dyn KvBackend,
    range: KeyRange,
    revision: i64,
    page: i64,
    keys_only: bool,
    mut f: impl FnMut(&KeyValue),
) -> Result<(), KvError> {
    let mut start = range.start;
    loop {
        let mut req = RangeRequest::range(start, range.end.clone())
            .limit(page)
            .at(revision);
        if keys_only {
            req = req.keys_only();
        }
        let r = kv.range(req).await?;
        r.kvs.iter().for_each(&mut f);
        match r.kvs.last() {
            Some(last) if r.more => {
                start = last.key.clone();
                start.push(0);
            }
            _ => return Ok(()),
        }
    }
}

/// The filesystem's layout from its etcd record.
pub(crate) fn geometry(fs: &SuperRecord) -> Result<Geometry> {
    if u64::from(fs.block_size) != BLOCK_SIZE {
        bail!(
            "the filesystem has {}-byte blocks; this etcfs knows only {BLOCK_SIZE}",
            fs.block_size
        );
    }
    let g = Geometry::new(fs.device_size, fs.group_size / BLOCK_SIZE)
        .map_err(|e| anyhow!("the superblock record describes no valid layout: {e}"))?;
    if g.ag_count != fs.group_count {
        bail!(
            "the superblock record says {} groups, its layout has {}",
            fs.group_count,
            g.ag_count
        );
    }
    Ok(g)
}

/// Reads everything `status` shows.
pub(crate) async fn read_snapshot(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    prefix: &str,
    endpoints: &[String],
) -> Result<Snapshot> {
    let sb_key = keys.superblock();
    let r = kv
        .range(RangeRequest::key(sb_key.clone()))
        .await
        .context("reading the superblock record")?;
    let Some(sb) = r.kvs.first() else {
        bail!("etcd prefix {prefix:?} holds no etcfs filesystem (run `etcfs mkfs`)");
    };
    let fs: SuperRecord = decode_at(keys, &sb_key, &sb.value)?;
    let geo = geometry(&fs)?;
    let rev = r.revision;
    let mut corrupt = Corrupt::default();

    let mut members = Vec::new();
    scan(kv, keys.members(), rev, PAGE_KEYS, false, |item| {
        if let Some(KeyKind::Member(s)) = keys.parse(&item.key) {
            let info = NodeInfo::decode(&item.value).map_err(|e| e.to_string());
            members.push((s, info));
        }
    })
    .await
    .context("reading the node records")?;
    let mut nodes = Vec::with_capacity(members.len());
    for (session, info) in members {
        let lease = match i64::try_from(session.0) {
            Ok(id) => kv.lease_time_to_live(id).await,
            Err(_) => Err(KvError::Invalid("session id is no lease id".into())),
        };
        nodes.push(NodeSnap {
            session,
            info,
            lease,
        });
    }

    let mut owners = BTreeMap::new();
    scan(kv, keys.groups(), rev, PAGE_KEYS, false, |item| {
        if let Some(KeyKind::Group(g)) = keys.parse(&item.key) {
            match Owner::decode(&item.value) {
                Ok(o) => {
                    owners.insert(g.0, o.session);
                }
                Err(e) => corrupt.push(format!("{}: {e}", keys.describe(&item.key))),
            }
        }
    })
    .await
    .context("reading the group owners")?;

    let map_max = AgFreeMap::encoded_len_max(geo.ag_blocks).min(ETCD_VALUE_BYTES_MAX);
    let maps_per_page = i64::try_from((PAGE_MAP_BYTES / map_max.max(1)).max(1)).unwrap_or(1);
    let mut free_maps = BTreeMap::new();
    scan(kv, keys.free_maps(), rev, maps_per_page, false, |item| {
        if let Some(KeyKind::FreeMap(g)) = keys.parse(&item.key) {
            free_maps.insert(g.0, map_free_blocks(&geo, g.0, &item.value));
        }
    })
    .await
    .context("reading the free maps")?;

    let mut orphans = BTreeMap::new();
    let mut orphans_total = 0u64;
    scan(kv, keys.orphans(), rev, PAGE_KEYS, false, |item| {
        if let Some(KeyKind::Orphan(ino)) = keys.parse(&item.key) {
            orphans_total += 1;
            match Owner::decode(&item.value) {
                Ok(o) if orphans.len() < ORPHANS_TRACKED_MAX => {
                    orphans.insert(ino, o.session);
                }
                Ok(_) => {}
                Err(e) => corrupt.push(format!("{}: {e}", keys.describe(&item.key))),
            }
        }
    })
    .await
    .context("reading the orphan records")?;

    let mut tallies: BTreeMap<SessionId, Tally> = BTreeMap::new();
    let mut orphans_open = BTreeSet::new();
    let sample_lock = LockKey {
        ino: Ino(0),
        session: SessionId(0),
        owner: 0,
        flock: false,
        start: 0,
    };
    let tags = [
        ("cache locks", keys.cache_lock(Ino(0), SessionId(0)), false),
        (
            "cache lock waits",
            keys.cache_want(Ino(0), SessionId(0)),
            true,
        ),
        ("fcntl and flock locks", keys.lock(&sample_lock), true),
        ("open records", keys.held(Ino(0), SessionId(0)), true),
        ("requests for space", keys.space_wanted(SessionId(0)), true),
    ];
    for (what, sample, keys_only) in tags {
        scan(
            kv,
            tag_range(keys, &sample),
            rev,
            PAGE_KEYS,
            keys_only,
            |item| match keys.parse(&item.key) {
                Some(KeyKind::CacheLock(_, s)) => {
                    let t = tallies.entry(s).or_default();
                    match CacheLock::decode(&item.value) {
                        Ok(CacheLock {
                            mode: LockMode::Shared,
                        }) => t.cache_shared += 1,
                        Ok(CacheLock {
                            mode: LockMode::Exclusive,
                        }) => t.cache_exclusive += 1,
                        Err(e) => corrupt.push(format!("{}: {e}", keys.describe(&item.key))),
                    }
                }
                Some(KeyKind::CacheWant(_, s)) => tallies.entry(s).or_default().cache_waiting += 1,
                Some(KeyKind::Lock(l)) => {
                    let t = tallies.entry(l.session).or_default();
                    if l.owner == meta::keys::LOCK_DELEGATION_OWNER {
                        t.lock_delegations += 1;
                    } else if l.owner == meta::keys::LOCK_RECALL_OWNER {
                        // A request, not a lock: another node's delegation is on its way back.
                    } else if l.flock {
                        t.flock_locks += 1;
                    } else {
                        t.fcntl_locks += 1;
                    }
                }
                Some(KeyKind::Held(ino, s)) => {
                    tallies.entry(s).or_default().files_open += 1;
                    if orphans.contains_key(&ino) {
                        orphans_open.insert(ino);
                    }
                }
                Some(KeyKind::SpaceWanted(s)) => tallies.entry(s).or_default().wants_space = true,
                _ => {}
            },
        )
        .await
        .with_context(|| format!("reading the {what}"))?;
    }

    let mut released: BTreeMap<Option<u32>, (u64, u64)> = BTreeMap::new();
    scan(
        kv,
        tag_range(keys, &keys.released(0)),
        rev,
        PAGE_KEYS,
        false,
        |item| {
            if let Some(KeyKind::Released(dev_off)) = keys.parse(&item.key) {
                match Released::decode(&item.value) {
                    Ok(r) => {
                        let group = geo.ag_of(crate::data::BlockNo(dev_off / BLOCK_SIZE));
                        let e = released.entry(group.map(|g| g.0)).or_default();
                        e.0 += 1;
                        e.1 += r.len.div_ceil(BLOCK_SIZE);
                    }
                    Err(e) => corrupt.push(format!("{}: {e}", keys.describe(&item.key))),
                }
            }
        },
    )
    .await
    .context("reading the released ranges")?;

    for n in &nodes {
        if let Err(e) = &n.info {
            let key = keys.describe(&keys.member(n.session));
            corrupt.push(format!("{key}: {e}"));
        }
    }

    let members = kv.member_list().await.context("listing the etcd members")?;
    let status = kv.status().await.context("reading etcd's status")?;
    let alarms = kv.alarms().await.context("listing etcd's alarms")?;
    let compact_revision = compact_revision(kv, &sb_key, status.revision.max(rev)).await;
    Ok(Snapshot {
        prefix: prefix.to_owned(),
        revision: rev,
        fs,
        nodes,
        owners,
        free_maps,
        tallies,
        orphans,
        orphans_total,
        orphans_open,
        released,
        corrupt,
        etcd: EtcdSnap {
            endpoints: endpoints.to_vec(),
            members,
            status,
            alarms,
            compact_revision,
            quota: None,
        },
    })
}

/// Free blocks in a group's stored map.
pub(crate) fn map_free_blocks(geo: &Geometry, group: u32, bytes: &[u8]) -> Result<u64, String> {
    let ag = AgId(group);
    let span = geo
        .ag_extent(ag)
        .ok_or_else(|| format!("group {group} is past the last group"))?;
    AgFreeMap::decode(bytes, ag, span)
        .map(|m| m.free_blocks())
        .map_err(|e| e.to_string())
}

/// The oldest revision etcd can still read (the compaction point; 0 if never compacted):
/// a binary search of reads at a revision, since the API says it only in errors. `None`
/// when the reads fail otherwise.
async fn compact_revision(kv: &dyn KvBackend, key: &[u8], current: i64) -> Option<i64> {
    let readable = |rev: i64| async move {
        let r = kv
            .range(RangeRequest::key(key.to_vec()).keys_only().limit(1).at(rev))
            .await;
        match r {
            Ok(_) => Ok(true),
            Err(KvError::Compacted { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    };
    if readable(1).await.ok()? {
        return Some(0);
    }
    // Invariant: `lo` is compacted away, `hi` is readable.
    let (mut lo, mut hi) = (1i64, current.max(1));
    if !readable(hi).await.ok()? {
        return None;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if readable(mid).await.ok()? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}

// ---------------------------------------------------------------------------------------
// etcd's space quota, from a member's metrics
// ---------------------------------------------------------------------------------------

/// The space quota in etcd's Prometheus metrics text.
pub(crate) fn quota_from_metrics(text: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(QUOTA_METRIC)?;
        // The bare metric (no labels), then its value.
        let value = rest.strip_prefix(' ')?.split_whitespace().next()?;
        let v: f64 = value.parse().ok()?;
        (v.is_finite() && v > 0.0).then_some(v as u64)
    })
}

/// `host:port` of an `http://` URL (`None` for anything else: https needs TLS).
fn http_host(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("http://")?;
    let host = rest.split('/').next()?;
    (!host.is_empty()).then_some(host)
}

/// Reads the quota from `url`'s `/metrics` (plain HTTP, bounded in time and size).
pub(crate) fn quota_from_url(url: &str) -> Result<u64> {
    let host = http_host(url).ok_or_else(|| anyhow!("{url} is not an http:// URL"))?;
    let addr = host
        .to_socket_addrs()
        .with_context(|| format!("resolve {host}"))?
        .next()
        .ok_or_else(|| anyhow!("{host} resolves to nothing"))?;
    let mut conn = TcpStream::connect_timeout(&addr, METRICS_TIMEOUT)
        .with_context(|| format!("connect to {host}"))?;
    conn.set_read_timeout(Some(METRICS_TIMEOUT))?;
    conn.set_write_timeout(Some(METRICS_TIMEOUT))?;
    // HTTP/1.0: the answer is the body up to the end of the connection, never chunked.
    write!(
        conn,
        "GET /metrics HTTP/1.0\r\nHost: {host}\r\nAccept: text/plain\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    conn.take(METRICS_BYTES_MAX)
        .read_to_end(&mut raw)
        .with_context(|| format!("read {url}/metrics"))?;
    let text = String::from_utf8_lossy(&raw);
    let status = text.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        bail!("{url}/metrics answered {status:?}");
    }
    quota_from_metrics(&text).ok_or_else(|| anyhow!("{url}/metrics has no {QUOTA_METRIC}"))
}

/// The quota of the first member whose metrics answer: the endpoints given, then the
/// members' client URLs.
pub(crate) fn find_quota(etcd: &EtcdSnap) -> Option<(u64, String)> {
    let mut tried = BTreeSet::new();
    let urls = etcd
        .endpoints
        .iter()
        .chain(etcd.members.iter().flat_map(|m| m.client_urls.iter()));
    for url in urls {
        let url = url.trim_end_matches('/');
        if !tried.insert(url.to_owned()) || http_host(url).is_none() {
            continue;
        }
        if let Ok(q) = quota_from_url(url) {
            return Some((q, format!("{url}/metrics")));
        }
    }
    None
}

// ---------------------------------------------------------------------------------------
// The report (pure)
// ---------------------------------------------------------------------------------------

/// What `etcfs status` prints (as JSON with `--json`).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) prefix: String,
    /// The etcd revision the report was read at.
    pub(crate) revision: i64,
    pub(crate) filesystem: FsReport,
    pub(crate) nodes: Vec<NodeReport>,
    pub(crate) orphans: OrphanReport,
    pub(crate) etcd: EtcdReport,
    pub(crate) warnings: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct FsReport {
    pub(crate) uuid: String,
    pub(crate) device_bytes: u64,
    pub(crate) block_size: u32,
    pub(crate) group_bytes: u64,
    pub(crate) group_count: u32,
    /// Blocks of all groups together (what files can use).
    pub(crate) data_blocks: u64,
    pub(crate) used_blocks: u64,
    /// Free in the free maps in etcd (an owner's blocks reserved for writes not yet
    /// committed count free there).
    pub(crate) free_blocks: u64,
    /// Freed by a commit, not yet back in a free map (`R` records).
    pub(crate) released_blocks: u64,
    pub(crate) released_ranges: u64,
    /// Groups a node owns.
    pub(crate) groups_owned: u64,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct NodeReport {
    pub(crate) name: String,
    /// The session id (hex), which is also its etcd lease id.
    pub(crate) session: String,
    pub(crate) pid: Option<u32>,
    /// The daemon's version (`None`: its record predates versions, or did not decode).
    pub(crate) version: Option<String>,
    /// When the session started (seconds since the epoch).
    pub(crate) started: Option<i64>,
    /// Seconds left on its lease (`None`: it ended or etcd did not say).
    pub(crate) lease_ttl_left_s: Option<i64>,
    pub(crate) lease_ttl_s: Option<i64>,
    pub(crate) groups: Vec<u32>,
    /// Free blocks in its groups' maps.
    pub(crate) free_blocks_in_groups: u64,
    #[serde(flatten)]
    pub(crate) records: Tally,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct OrphanReport {
    /// Inodes unlinked while open somewhere (`O` records).
    pub(crate) count: u64,
    /// Of those (tracked), still open on some node.
    pub(crate) open: u64,
    /// Not open anywhere and left by a session that has ended: waiting for a node to
    /// reclaim them.
    pub(crate) unreclaimed: u64,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct EtcdReport {
    pub(crate) members: Vec<MemberReport>,
    /// The leader's name (or id in hex when it is not listed).
    pub(crate) leader: Option<String>,
    pub(crate) version: String,
    pub(crate) revision: i64,
    pub(crate) compact_revision: Option<i64>,
    pub(crate) db_size: u64,
    pub(crate) db_size_in_use: u64,
    pub(crate) quota_bytes: u64,
    /// Where the quota was read, or that etcd's default was assumed.
    pub(crate) quota_source: String,
    pub(crate) db_percent_of_quota: u64,
    pub(crate) alarms: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct MemberReport {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) client_urls: Vec<String>,
    pub(crate) peer_urls: Vec<String>,
    pub(crate) leader: bool,
    pub(crate) learner: bool,
}

fn node_name(n: &NodeSnap) -> String {
    match &n.info {
        Ok(i) => String::from_utf8_lossy(&i.record.name).into_owned(),
        Err(_) => "?".into(),
    }
}

fn alarm_name(a: &Alarm) -> String {
    match a.kind {
        AlarmKind::NoSpace => "NOSPACE".into(),
        AlarmKind::Corrupt => "CORRUPT".into(),
        AlarmKind::Other(n) => format!("alarm {n}"),
    }
}

impl Report {
    /// The report of a snapshot, with its warnings.
    pub(crate) fn new(s: &Snapshot, geo: &Geometry) -> Report {
        let mut warnings = Vec::new();
        let live: BTreeSet<SessionId> = s.nodes.iter().map(|n| n.session).collect();

        // Space: every group's free blocks from its map, all free without one.
        let mut group_free = Vec::with_capacity(geo.ag_count as usize);
        for g in 0..geo.ag_count {
            let span = geo.ag_extent(AgId(g)).map_or(0, |e| e.len);
            let free = match s.free_maps.get(&g) {
                None => span,
                Some(Ok(f)) => *f,
                Some(Err(e)) => {
                    warnings.push(format!(
                        "the free map of group {g} does not decode ({e}): counted as full"
                    ));
                    0
                }
            };
            group_free.push(free);
        }
        let free_blocks: u64 = group_free.iter().sum();
        let data_blocks = geo.data_blocks();
        let (released_ranges, released_blocks) = s
            .released
            .values()
            .fold((0, 0), |(r, b), (r2, b2)| (r + r2, b + b2));
        let filesystem = FsReport {
            uuid: fmt_uuid(&s.fs.uuid),
            device_bytes: s.fs.device_size,
            block_size: s.fs.block_size,
            group_bytes: s.fs.group_size,
            group_count: s.fs.group_count,
            data_blocks,
            used_blocks: data_blocks.saturating_sub(free_blocks),
            free_blocks,
            released_blocks,
            released_ranges,
            groups_owned: s.owners.len() as u64,
        };

        // Nodes.
        let mut nodes = Vec::with_capacity(s.nodes.len());
        for n in &s.nodes {
            let name = node_name(n);
            let groups: Vec<u32> = s
                .owners
                .iter()
                .filter(|(_, o)| **o == n.session)
                .map(|(g, _)| *g)
                .collect();
            let free_in_groups = groups
                .iter()
                .map(|g| group_free.get(*g as usize).copied().unwrap_or(0))
                .sum();
            let info = n.info.as_ref().ok();
            let (left, ttl) = match &n.lease {
                Ok(t) => {
                    if t.remaining_s * LEASE_LEFT_WARN_DIVISOR < t.granted_s {
                        warnings.push(format!(
                            "node {name} (session {}) has {} s of its {} s lease left: it is \
                             not renewing it in time (overloaded, cut off from etcd, or \
                             stopped) and loses its session, locks and groups when it ends",
                            n.session, t.remaining_s, t.granted_s
                        ));
                    }
                    (Some(t.remaining_s), Some(t.granted_s))
                }
                Err(KvError::LeaseNotFound) => {
                    warnings.push(format!(
                        "node {name} (session {}): its lease has ended; its records are \
                         being removed",
                        n.session
                    ));
                    (None, None)
                }
                Err(e) => {
                    warnings.push(format!(
                        "node {name} (session {}): etcd did not give its lease's time to \
                         live: {e}",
                        n.session
                    ));
                    (None, None)
                }
            };
            nodes.push(NodeReport {
                name,
                session: n.session.to_string(),
                pid: info.map(|i| i.record.pid),
                version: info.and_then(|i| i.version.clone()),
                started: info.map(|i| i.record.started.sec),
                lease_ttl_left_s: left,
                lease_ttl_s: ttl,
                groups,
                free_blocks_in_groups: free_in_groups,
                records: s.tallies.get(&n.session).copied().unwrap_or_default(),
            });
        }
        for (session, _) in s.tallies.iter().filter(|(s, _)| !live.contains(s)) {
            warnings.push(format!(
                "session {session} holds lock or open records but has no node record"
            ));
        }
        for (g, owner) in s.owners.iter().filter(|(_, o)| !live.contains(o)) {
            warnings.push(format!(
                "group {g} is owned by session {owner}, which has no node record"
            ));
        }

        // Leftovers of ended sessions: orphans nobody has open, released ranges in groups
        // nobody owns.
        let unreclaimed: Vec<(&Ino, &SessionId)> = s
            .orphans
            .iter()
            .filter(|(ino, owner)| !live.contains(owner) && !s.orphans_open.contains(ino))
            .collect();
        if !unreclaimed.is_empty() {
            let sessions: BTreeSet<String> =
                unreclaimed.iter().map(|(_, o)| o.to_string()).collect();
            let who = if s.nodes.is_empty() {
                "no node is mounted to reclaim them"
            } else {
                "a mounted node reclaims them within seconds"
            };
            warnings.push(format!(
                "{} inode(s) unlinked while open by ended session(s) {} are not reclaimed yet \
                 ({who})",
                unreclaimed.len(),
                sessions.into_iter().collect::<Vec<_>>().join(", ")
            ));
        }
        let stray: Vec<(u32, u64, u64)> = s
            .released
            .iter()
            .filter_map(|(g, (r, b))| match g {
                Some(g) if !s.owners.contains_key(g) => Some((*g, *r, *b)),
                _ => None,
            })
            .collect();
        if !stray.is_empty() {
            let (ranges, blocks) = stray.iter().fold((0, 0), |(r, b), x| (r + x.1, b + x.2));
            let groups: Vec<u32> = stray.iter().map(|x| x.0).collect();
            warnings.push(format!(
                "{ranges} freed range(s) ({blocks} blocks) in group(s) {} that no node owns \
                 (left by an ended session) are not back in the free maps yet: the next node \
                 to claim those groups returns them",
                group_list(&groups)
            ));
        }
        if let Some((r, b)) = s.released.get(&None) {
            warnings.push(format!(
                "{r} freed range(s) ({b} blocks) lie outside every group"
            ));
        }
        for c in &s.corrupt.shown {
            warnings.push(format!("corrupt record {c}"));
        }
        let unnamed = s.corrupt.total - s.corrupt.shown.len() as u64;
        if unnamed > 0 {
            warnings.push(format!("{unnamed} more corrupt record(s)"));
        }

        // etcd.
        let st = &s.etcd.status;
        let (quota_bytes, quota_source) = match &s.etcd.quota {
            Some((q, from)) => (*q, from.clone()),
            None => (
                ETCD_DEFAULT_QUOTA_BYTES,
                "assumed: etcd's default (its metrics could not be read)".to_owned(),
            ),
        };
        let db_size = u64::try_from(st.db_size).unwrap_or(0);
        let percent = db_size.saturating_mul(100) / quota_bytes.max(1);
        if db_size.saturating_mul(100) > quota_bytes.saturating_mul(DB_QUOTA_WARN_PERCENT) {
            warnings.push(format!(
                "etcd's database is {} of its {} quota ({percent}%): at the quota etcd \
                 refuses every write until it is compacted and defragmented",
                human_bytes(db_size),
                human_bytes(quota_bytes)
            ));
        }
        let member_name = |id: u64| {
            s.etcd
                .members
                .iter()
                .find(|m| m.id == id)
                .map(|m| m.name.clone())
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| format!("{id:x}"))
        };
        let alarms: Vec<String> = s
            .etcd
            .alarms
            .iter()
            .map(|a| format!("{} on {}", alarm_name(a), member_name(a.member_id)))
            .collect();
        for a in &alarms {
            warnings.push(format!("etcd alarm {a}"));
        }
        for e in &st.errors {
            warnings.push(format!("etcd reports: {e}"));
        }
        if st.leader == 0 {
            warnings.push("etcd has no leader".into());
        }
        let etcd = EtcdReport {
            members: s
                .etcd
                .members
                .iter()
                .map(|m| MemberReport {
                    id: format!("{:x}", m.id),
                    name: m.name.clone(),
                    client_urls: m.client_urls.clone(),
                    peer_urls: m.peer_urls.clone(),
                    leader: m.id == st.leader,
                    learner: m.is_learner,
                })
                .collect(),
            leader: (st.leader != 0).then(|| member_name(st.leader)),
            version: st.version.clone(),
            revision: st.revision,
            compact_revision: s.etcd.compact_revision,
            db_size,
            db_size_in_use: u64::try_from(st.db_size_in_use).unwrap_or(0),
            quota_bytes,
            quota_source,
            db_percent_of_quota: percent,
            alarms,
        };
        Report {
            prefix: s.prefix.clone(),
            revision: s.revision,
            filesystem,
            nodes,
            orphans: OrphanReport {
                count: s.orphans_total,
                open: s.orphans_open.len() as u64,
                unreclaimed: unreclaimed.len() as u64,
            },
            etcd,
            warnings,
        }
    }

    /// The report as tables for people.
    pub(crate) fn render(&self) -> String {
        let mut o = String::new();
        let f = &self.filesystem;
        let blocks = |b: u64| human_bytes(b.saturating_mul(u64::from(f.block_size)));
        o.push_str(&format!(
            "filesystem {} (prefix {:?}, read at etcd revision {})\n",
            f.uuid, self.prefix, self.revision
        ));
        o.push_str(&format!(
            "  device {}, {}-byte blocks, {} group(s) of {}, {} owned by nodes\n",
            human_bytes(f.device_bytes),
            f.block_size,
            f.group_count,
            human_bytes(f.group_bytes),
            f.groups_owned
        ));
        o.push_str(&format!(
            "  used {} ({} blocks), free {} ({} blocks) of {}",
            blocks(f.used_blocks),
            f.used_blocks,
            blocks(f.free_blocks),
            f.free_blocks,
            blocks(f.data_blocks)
        ));
        if f.released_ranges > 0 {
            o.push_str(&format!(
                "; freed, not yet in the free maps: {} in {} range(s)",
                blocks(f.released_blocks),
                f.released_ranges
            ));
        }
        o.push('\n');
        if self.orphans.count > 0 {
            o.push_str(&format!(
                "  {} inode(s) unlinked while open ({} still open, {} waiting to be reclaimed)\n",
                self.orphans.count, self.orphans.open, self.orphans.unreclaimed
            ));
        }

        o.push_str(&format!("\nnodes ({})\n", self.nodes.len()));
        if !self.nodes.is_empty() {
            let header = [
                "NAME",
                "SESSION",
                "PID",
                "VERSION",
                "LEASE LEFT",
                "GROUPS",
                "FREE IN GROUPS",
                "CACHE LOCKS",
                "FCNTL/FLOCK",
                "OPEN FILES",
            ];
            let rows: Vec<Vec<String>> = self
                .nodes
                .iter()
                .map(|n| {
                    let r = &n.records;
                    let mut cache = format!(
                        "{} ({} excl)",
                        r.cache_exclusive + r.cache_shared,
                        r.cache_exclusive
                    );
                    if r.cache_waiting > 0 {
                        cache.push_str(&format!(", {} waiting", r.cache_waiting));
                    }
                    let mut groups = if n.groups.is_empty() {
                        "-".to_owned()
                    } else {
                        group_list(&n.groups)
                    };
                    if r.wants_space {
                        groups.push_str(" (wants space)");
                    }
                    vec![
                        n.name.clone(),
                        n.session.clone(),
                        n.pid.map_or("?".into(), |p| p.to_string()),
                        n.version.clone().unwrap_or_else(|| "-".into()),
                        match (n.lease_ttl_left_s, n.lease_ttl_s) {
                            (Some(l), Some(t)) => format!("{l}/{t} s"),
                            _ => "ended".into(),
                        },
                        groups,
                        blocks(n.free_blocks_in_groups),
                        cache,
                        match r.lock_delegations {
                            0 => format!("{}/{}", r.fcntl_locks, r.flock_locks),
                            d => format!("{}/{} +{d} delegated", r.fcntl_locks, r.flock_locks),
                        },
                        r.files_open.to_string(),
                    ]
                })
                .collect();
            o.push_str(&table(&header, &rows));
        }

        let e = &self.etcd;
        o.push_str(&format!("\netcd {} (revision {}", e.version, e.revision));
        match e.compact_revision {
            Some(0) => o.push_str(", never compacted"),
            Some(r) => o.push_str(&format!(", compacted up to {r}")),
            None => {}
        }
        o.push_str(")\n");
        for m in &e.members {
            o.push_str(&format!(
                "  member {} ({}){}{}: clients {}, peers {}\n",
                if m.name.is_empty() {
                    "(unstarted)"
                } else {
                    &m.name
                },
                m.id,
                if m.leader { " leader" } else { "" },
                if m.learner { " learner" } else { "" },
                m.client_urls.join(","),
                m.peer_urls.join(",")
            ));
        }
        if e.leader.is_none() {
            o.push_str("  no leader\n");
        }
        o.push_str(&format!(
            "  database {} ({} in use), {}% of the {} quota ({})\n",
            human_bytes(e.db_size),
            human_bytes(e.db_size_in_use),
            e.db_percent_of_quota,
            human_bytes(e.quota_bytes),
            e.quota_source
        ));
        if !e.alarms.is_empty() {
            o.push_str(&format!("  alarms: {}\n", e.alarms.join(", ")));
        }

        if self.warnings.is_empty() {
            o.push_str("\nno warnings\n");
        } else {
            o.push_str(&format!("\nwarnings ({})\n", self.warnings.len()));
            for w in &self.warnings {
                o.push_str(&format!("  - {w}\n"));
            }
        }
        o
    }
}

/// Left-aligned columns two spaces apart.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut l = String::from("  ");
        for (i, (c, w)) in cells.iter().zip(&width).enumerate() {
            l.push_str(c);
            if i + 1 < cells.len() {
                l.push_str(&" ".repeat(w - c.chars().count() + 2));
            }
        }
        l.push('\n');
        l
    };
    let mut o = line(header.to_vec());
    for r in rows {
        o.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    o
}

/// Group numbers as runs: `0-3,7`.
pub(crate) fn group_list(groups: &[u32]) -> String {
    let mut sorted = groups.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            sorted[i].to_string()
        } else {
            format!("{}-{}", sorted[i], sorted[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// `1.5 GiB`, `20 KiB`, `512 B`.
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    let tenths = (v * 10.0).round() / 10.0;
    if u == 0 {
        format!("{n} B")
    } else if tenths.fract() == 0.0 {
        format!("{tenths:.0} {}", UNITS[u])
    } else {
        format!("{tenths:.1} {}", UNITS[u])
    }
}

// ---------------------------------------------------------------------------------------
// Commands
// ---------------------------------------------------------------------------------------

/// `etcfs status`: the report, as a table or one JSON object.
pub(crate) fn print_status(cfg: &EtcdConfig, prefix: &str, json: bool) -> Result<()> {
    let etcd = &cfg.endpoints[..];
    let keys = Keyspace::new(prefix).map_err(|e| anyhow!("bad --prefix: {e}"))?;
    let rt = runtime()?;
    let kv = connect(&rt, cfg)?;
    let mut snap = rt.block_on(read_snapshot(&*kv, &keys, prefix, etcd))?;
    snap.etcd.quota = find_quota(&snap.etcd);
    let report = Report::new(&snap, &geometry(&snap.fs)?);
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(())
}

/// Why `evict` cannot pick a node.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ResolveError {
    /// No live node has that name or session.
    Unknown { node: String, live: String },
    /// Several live nodes have that name.
    Ambiguous {
        node: String,
        count: usize,
        which: String,
    },
}

impl std::fmt::Display for ResolveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResolveError::Unknown { node, live } => write!(
                f,
                "no live node is called {node:?} or has that session id; live nodes: {live}"
            ),
            ResolveError::Ambiguous { node, count, which } => write!(
                f,
                "{count} live nodes are called {node:?} ({which}): give the session id of \
                 the one to evict"
            ),
        }
    }
}

impl std::error::Error for ResolveError {}

/// A session id as `status` prints it (hex; `0x` allowed).
pub(crate) fn parse_session(s: &str) -> Option<SessionId> {
    let hex = s.strip_prefix("0x").unwrap_or(s);
    if hex.is_empty() || hex.len() > 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok().map(SessionId)
}

fn describe_node(n: &NodeSnap) -> String {
    match &n.info {
        Ok(i) => format!(
            "{} (session {}, pid {})",
            String::from_utf8_lossy(&i.record.name),
            n.session,
            i.record.pid
        ),
        Err(_) => format!("? (session {})", n.session),
    }
}

/// The one node `node` (a name or a session id) means among the live ones.
pub(crate) fn resolve<'a>(node: &str, nodes: &'a [NodeSnap]) -> Result<&'a NodeSnap, ResolveError> {
    let session = parse_session(node);
    let found: Vec<&NodeSnap> = nodes
        .iter()
        .filter(|n| {
            Some(n.session) == session
                || n.info
                    .as_ref()
                    .is_ok_and(|i| i.record.name == node.as_bytes())
        })
        .collect();
    match found.as_slice() {
        [one] => Ok(one),
        [] => Err(ResolveError::Unknown {
            node: node.to_owned(),
            live: if nodes.is_empty() {
                "none".into()
            } else {
                nodes
                    .iter()
                    .map(describe_node)
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        }),
        many => Err(ResolveError::Ambiguous {
            node: node.to_owned(),
            count: many.len(),
            which: many
                .iter()
                .map(|n| describe_node(n))
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// How long `etcfs evict` waits for the node to give its session up (or, for a node that
/// died, for its lease to run out: longer than the default TTL).
const EVICT_WAIT: Duration = Duration::from_secs(15);

/// `etcfs evict NODE`: asks the node to end its session (an eviction record its watch
/// sees: it stops device I/O, drops what it held, waits a margin for I/O in flight, then
/// revokes its own lease and registers anew). Revoking the lease from here instead would
/// let other nodes take its locks and groups while the node, still believing its lease
/// alive until its next renewal, may still be writing to the device: that is `--force`,
/// for a node known to be down.
pub(crate) fn evict(cfg: &EtcdConfig, prefix: &str, node: &str, force: bool) -> Result<()> {
    let etcd = &cfg.endpoints[..];
    let keys = Keyspace::new(prefix).map_err(|e| anyhow!("bad --prefix: {e}"))?;
    let rt = runtime()?;
    let kv = connect(&rt, cfg)?;
    let snap = rt.block_on(read_snapshot(&*kv, &keys, prefix, etcd))?;
    let geo = geometry(&snap.fs)?;
    let target = resolve(node, &snap.nodes)?;
    let report = Report::new(&snap, &geo);
    let what = report
        .nodes
        .iter()
        .find(|n| n.session == target.session.to_string())
        .map(|n| {
            let r = &n.records;
            format!(
                "{} group(s), {} cache lock(s), {} fcntl/flock lock(s), {} open file record(s)",
                n.groups.len(),
                r.cache_exclusive + r.cache_shared,
                r.fcntl_locks + r.flock_locks,
                r.files_open
            )
        })
        .unwrap_or_default();
    let lease =
        i64::try_from(target.session.0).map_err(|_| anyhow!("session id is no lease id"))?;
    let member = keys.member(target.session);
    let ask = keys.evict(target.session);
    let gone = |kv: &Arc<dyn KvBackend>| -> Result<bool> {
        let r = rt
            .block_on(kv.range(RangeRequest::key(member.clone()).keys_only()))
            .context("checking the node record")?;
        Ok(r.kvs.is_empty())
    };
    let put = meta::kv::Txn {
        success: vec![meta::kv::TxnOp::Put(meta::kv::PutOp {
            key: ask.clone(),
            value: Owner {
                session: target.session,
            }
            .encode(),
            lease: 0,
        })],
        ..Default::default()
    };
    // A put of a fixed value and a delete: applying either twice is applying it once.
    rt.block_on(kv.txn_idempotent(put))
        .with_context(|| format!("asking {} to give up its session", describe_node(target)))?;
    let withdraw = |kv: &Arc<dyn KvBackend>| {
        let _ = rt.block_on(kv.txn_idempotent(meta::kv::Txn {
            success: vec![meta::kv::TxnOp::delete(ask.clone())],
            ..Default::default()
        }));
    };
    let start = std::time::Instant::now();
    let mut forced = false;
    while !gone(&kv)? {
        if start.elapsed() >= EVICT_WAIT || force {
            if !force {
                withdraw(&kv);
                bail!(
                    "{} did not give up its session within {} s (a node that is running but \
                     not answering keeps renewing its lease). If the node is known to be down \
                     (powered off, its daemon killed), `etcfs evict --force` revokes the lease \
                     at once; a daemon still running could then write to the device until it \
                     notices, up to a quarter of its lease TTL later",
                    describe_node(target),
                    EVICT_WAIT.as_secs()
                );
            }
            match rt.block_on(kv.lease_revoke(lease)) {
                Ok(()) | Err(KvError::LeaseNotFound) => {}
                Err(e) => bail!("revoking the lease of {}: {e}", describe_node(target)),
            }
            forced = true;
            if !gone(&kv)? {
                bail!(
                    "revoked the lease of {}, but its node record is still there",
                    describe_node(target)
                );
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    withdraw(&kv);
    let how = if forced {
        "its lease is revoked"
    } else {
        "it gave its session up"
    };
    println!(
        "etcfs: evicted {} after {:.1} s: {how}; its node record, {what} are gone",
        describe_node(target),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use meta::{
        codec::NodeRecord,
        types::{GroupId, Timespec},
    };

    fn geo() -> Geometry {
        // 4 groups of 64 blocks after the head.
        Geometry::new((256 + 4 * 64 + 1) * BLOCK_SIZE, 64).expect("geometry")
    }

    fn fs_record(g: &Geometry) -> SuperRecord {
        SuperRecord {
            uuid: [0xab; 16],
            format_version: 1,
            block_size: BLOCK_SIZE as u32,
            group_size: g.ag_blocks * BLOCK_SIZE,
            group_count: g.ag_count,
            device_size: g.device_size,
            created: Timespec::new(1, 0),
        }
    }

    fn node(session: u64, name: &str, lease: Result<LeaseTtl, KvError>) -> NodeSnap {
        NodeSnap {
            session: SessionId(session),
            info: Ok(NodeInfo {
                record: NodeRecord {
                    name: name.as_bytes().to_vec(),
                    pid: 100 + session as u32,
                    started: Timespec::new(5, 0),
                },
                version: Some("0.1.0".into()),
            }),
            lease,
        }
    }

    fn ttl(remaining_s: i64) -> Result<LeaseTtl, KvError> {
        Ok(LeaseTtl {
            remaining_s,
            granted_s: 10,
        })
    }

    fn snapshot() -> Snapshot {
        let g = geo();
        Snapshot {
            prefix: "etcfs".into(),
            revision: 42,
            fs: fs_record(&g),
            nodes: vec![node(0xa1, "a", ttl(9)), node(0xb2, "b", ttl(8))],
            owners: BTreeMap::new(),
            free_maps: BTreeMap::new(),
            tallies: BTreeMap::new(),
            orphans: BTreeMap::new(),
            orphans_total: 0,
            orphans_open: BTreeSet::new(),
            released: BTreeMap::new(),
            corrupt: Corrupt::default(),
            etcd: EtcdSnap {
                endpoints: vec!["http://127.0.0.1:2379".into()],
                members: vec![ClusterMember {
                    id: 0x8e,
                    name: "e1".into(),
                    client_urls: vec!["http://127.0.0.1:2379".into()],
                    peer_urls: vec!["http://127.0.0.1:2380".into()],
                    is_learner: false,
                }],
                status: ClusterStatus {
                    member_id: 0x8e,
                    leader: 0x8e,
                    version: "3.4.23".into(),
                    db_size: 1 << 20,
                    db_size_in_use: 1 << 19,
                    revision: 42,
                    raft_term: 2,
                    errors: Vec::new(),
                },
                alarms: Vec::new(),
                compact_revision: Some(0),
                quota: Some((1 << 30, "http://127.0.0.1:2379/metrics".into())),
            },
        }
    }

    #[test]
    fn a_healthy_cluster_has_no_warnings() {
        let g = geo();
        let mut s = snapshot();
        s.owners.insert(0, SessionId(0xa1));
        s.owners.insert(1, SessionId(0xa1));
        s.owners.insert(3, SessionId(0xb2));
        // Group 0: 40 of 64 free; group 1 never allocated from; group 3 full.
        s.free_maps.insert(0, Ok(40));
        s.free_maps.insert(3, Ok(0));
        s.tallies.insert(
            SessionId(0xa1),
            Tally {
                cache_exclusive: 2,
                cache_shared: 1,
                fcntl_locks: 1,
                flock_locks: 2,
                files_open: 3,
                ..Tally::default()
            },
        );
        // An orphan its (live) owner still has open.
        s.orphans.insert(Ino(77), SessionId(0xa1));
        s.orphans_total = 1;
        s.orphans_open.insert(Ino(77));
        s.released.insert(Some(0), (1, 2));
        let r = Report::new(&s, &g);
        assert_eq!(r.warnings, Vec::<String>::new());
        assert_eq!(r.filesystem.data_blocks, 256);
        assert_eq!(r.filesystem.free_blocks, 40 + 64 + 64);
        assert_eq!(r.filesystem.used_blocks, 256 - 168);
        assert_eq!(r.filesystem.released_blocks, 2);
        assert_eq!(r.filesystem.groups_owned, 3);
        let a = &r.nodes[0];
        assert_eq!(
            (a.name.as_str(), a.session.as_str()),
            ("a", "00000000000000a1")
        );
        assert_eq!(a.groups, vec![0, 1]);
        assert_eq!(a.free_blocks_in_groups, 104);
        assert_eq!(a.records.cache_exclusive, 2);
        assert_eq!(a.records.files_open, 3);
        assert_eq!(a.version.as_deref(), Some("0.1.0"));
        assert_eq!((a.lease_ttl_left_s, a.lease_ttl_s), (Some(9), Some(10)));
        let b = &r.nodes[1];
        assert_eq!(b.groups, vec![3]);
        assert_eq!(b.free_blocks_in_groups, 0);
        assert_eq!(b.records, Tally::default());
        assert_eq!(
            (r.orphans.count, r.orphans.open, r.orphans.unreclaimed),
            (1, 1, 0)
        );
        assert_eq!(r.etcd.leader.as_deref(), Some("e1"));
        assert_eq!(r.etcd.db_percent_of_quota, 0);
        assert!(r.etcd.members[0].leader);

        let text = r.render();
        assert!(text.contains("no warnings"), "{text}");
        assert!(text.contains("0-1"), "{text}");
        assert!(text.contains("3 (2 excl)"), "{text}");
        assert!(text.contains("never compacted"), "{text}");
        let json = serde_json::to_value(&r).expect("json");
        assert_eq!(json["nodes"][0]["files_open"], 3);
        assert_eq!(json["nodes"][0]["fcntl_locks"], 1);
        assert_eq!(json["nodes"][1]["groups"][0], 3);
        assert_eq!(json["etcd"]["quota_bytes"], 1u64 << 30);
    }

    #[test]
    fn a_lease_near_its_deadline_is_a_warning() {
        let g = geo();
        let mut s = snapshot();
        // 3 s of 10 left is under a third; 4 s is not.
        s.nodes = vec![node(1, "a", ttl(3)), node(2, "b", ttl(4))];
        let w = Report::new(&s, &g).warnings;
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("node a") && w[0].contains("3 s of its 10 s"),
            "{w:?}"
        );
        s.nodes = vec![node(1, "a", Err(KvError::LeaseNotFound))];
        let r = Report::new(&s, &g);
        assert!(
            r.warnings[0].contains("lease has ended"),
            "{:?}",
            r.warnings
        );
        assert_eq!(r.nodes[0].lease_ttl_left_s, None);
        assert!(r.render().contains("ended"));
    }

    #[test]
    fn leftovers_of_ended_sessions_are_warnings() {
        let g = geo();
        let mut s = snapshot();
        s.owners.insert(2, SessionId(0xa1));
        // Orphans: one of an ended session nobody has open (unreclaimed), one of an ended
        // session still open somewhere, one of a live session.
        s.orphans.insert(Ino(10), SessionId(0xdead));
        s.orphans.insert(Ino(11), SessionId(0xdead));
        s.orphans.insert(Ino(12), SessionId(0xa1));
        s.orphans_total = 3;
        s.orphans_open.insert(Ino(11));
        // Released ranges in an owned group (being folded: fine) and in unowned ones.
        s.released.insert(Some(2), (5, 5));
        s.released.insert(Some(0), (1, 3));
        s.released.insert(Some(1), (2, 4));
        let r = Report::new(&s, &g);
        assert_eq!(r.orphans.unreclaimed, 1);
        assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
        assert!(
            r.warnings[0].contains("1 inode(s)")
                && r.warnings[0].contains("000000000000dead")
                && r.warnings[0].contains("within seconds"),
            "{:?}",
            r.warnings
        );
        assert!(
            r.warnings[1].contains("3 freed range(s) (7 blocks) in group(s) 0-1"),
            "{:?}",
            r.warnings
        );
        s.nodes.clear();
        let r = Report::new(&s, &g);
        assert!(
            r.warnings.iter().any(|w| w.contains("no node is mounted")),
            "{:?}",
            r.warnings
        );
        // With no live node, the group 2 owner and its released records are strays too.
        assert!(r
            .warnings
            .iter()
            .any(|w| w.contains("group 2 is owned by session")));
    }

    #[test]
    fn a_full_etcd_and_alarms_are_warnings() {
        let g = geo();
        let mut s = snapshot();
        // Exactly 80% of the quota is fine, a byte more is not.
        s.etcd.quota = Some((1_000_000, "metrics".into()));
        s.etcd.status.db_size = 800_000;
        assert_eq!(Report::new(&s, &g).warnings, Vec::<String>::new());
        s.etcd.status.db_size += 1;
        s.etcd.alarms.push(Alarm {
            member_id: 0x8e,
            kind: AlarmKind::NoSpace,
        });
        let r = Report::new(&s, &g);
        assert_eq!(r.etcd.db_percent_of_quota, 80);
        assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
        assert!(r.warnings[0].contains("80%"), "{:?}", r.warnings);
        assert_eq!(r.warnings[1], "etcd alarm NOSPACE on e1");
        assert!(r.render().contains("alarms: NOSPACE on e1"));
        // Without metrics, etcd's default quota is assumed, and said so.
        s.etcd.quota = None;
        s.etcd.alarms.clear();
        let r = Report::new(&s, &g);
        assert_eq!(r.etcd.quota_bytes, 2 << 30);
        assert!(r.etcd.quota_source.contains("assumed"));
        assert_eq!(r.warnings, Vec::<String>::new());
    }

    #[test]
    fn a_corrupt_free_map_counts_as_full_and_is_reported() {
        let g = geo();
        let mut s = snapshot();
        s.free_maps.insert(1, map_free_blocks(&g, 1, b"not a map"));
        for i in 0..25 {
            s.corrupt.push(format!("etcfs/O {i}: bad"));
        }
        let r = Report::new(&s, &g);
        assert_eq!(
            r.warnings.len(),
            1 + CORRUPT_SHOWN_MAX + 1,
            "{:?}",
            r.warnings
        );
        assert_eq!(
            r.warnings.last().map(String::as_str),
            Some("5 more corrupt record(s)")
        );
        assert_eq!(r.filesystem.free_blocks, 3 * 64);
        assert!(
            r.warnings[0].contains("group 1 does not decode"),
            "{:?}",
            r.warnings
        );
    }

    #[test]
    fn free_maps_decode_to_their_free_blocks() {
        let g = geo();
        let span = g.ag_extent(AgId(2)).expect("group 2");
        let mut map = AgFreeMap::all_free(AgId(2), span);
        map.mark_used(crate::data::Extent::new(span.start.0 + 3, 10))
            .expect("mark used");
        let bytes = map.encode();
        assert_eq!(map_free_blocks(&g, 2, &bytes), Ok(54));
        // Stored under the wrong group, or a group past the end: errors, never a panic.
        assert!(map_free_blocks(&g, 1, &bytes).is_err());
        assert!(map_free_blocks(&g, 9, &bytes).is_err());
    }

    #[test]
    fn the_quota_is_read_from_the_metrics_text() {
        let text =
            "# HELP etcd_server_quota_backend_bytes Current backend storage quota size in bytes.\n\
                    # TYPE etcd_server_quota_backend_bytes gauge\n\
                    etcd_server_quota_backend_bytes_other 5\n\
                    etcd_server_quota_backend_bytes 2.147483648e+09\n";
        assert_eq!(quota_from_metrics(text), Some(2 << 30));
        assert_eq!(
            quota_from_metrics("etcd_server_quota_backend_bytes 8589934592\n"),
            Some(8 << 30)
        );
        assert_eq!(quota_from_metrics("nothing here\n"), None);
        assert_eq!(
            quota_from_metrics("etcd_server_quota_backend_bytes NaN\n"),
            None
        );
        assert_eq!(http_host("http://10.0.0.1:2379"), Some("10.0.0.1:2379"));
        assert_eq!(http_host("http://h:1/x"), Some("h:1"));
        assert_eq!(http_host("https://h:1"), None);
    }

    #[test]
    fn evict_resolves_names_and_sessions() {
        let nodes = vec![
            node(0xa1, "a", ttl(9)),
            node(0xb2, "twin", ttl(9)),
            node(0xc3, "twin", ttl(9)),
        ];
        assert_eq!(resolve("a", &nodes).map(|n| n.session), Ok(SessionId(0xa1)));
        assert_eq!(
            resolve("00000000000000c3", &nodes).map(|n| n.session),
            Ok(SessionId(0xc3))
        );
        assert_eq!(
            resolve("0xb2", &nodes).map(|n| n.session),
            Ok(SessionId(0xb2))
        );
        match resolve("twin", &nodes) {
            Err(ResolveError::Ambiguous {
                count: 2, which, ..
            }) => {
                assert!(which.contains("00000000000000b2") && which.contains("00000000000000c3"))
            }
            other => panic!("{other:?}"),
        }
        match resolve("nobody", &nodes) {
            Err(e @ ResolveError::Unknown { .. }) => {
                assert!(
                    e.to_string()
                        .contains("a (session 00000000000000a1, pid 261)"),
                    "{e}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            resolve("a", &[]),
            Err(ResolveError::Unknown { live, .. }) if live == "none"
        ));
        assert_eq!(parse_session("zz"), None);
        assert_eq!(parse_session("0x"), None);
        assert_eq!(parse_session("12345678901234567"), None);
    }

    #[test]
    fn group_lists_and_sizes_read_well() {
        assert_eq!(group_list(&[7, 0, 1, 2, 3, 9, 10]), "0-3,7,9-10");
        assert_eq!(group_list(&[5]), "5");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(2 << 30), "2 GiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes((124 << 20) - 4096), "124 MiB");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_snapshot_reads_what_the_model_holds() {
        use meta::{
            clock::ManualClock,
            kv::{PutOp, Txn, TxnOp},
            model::MemEtcd,
        };
        let g = geo();
        let kv = MemEtcd::new(Arc::new(ManualClock::new(Timespec::new(1, 0))));
        let keys = Keyspace::new("st").expect("prefix");
        let lease = kv.lease_grant(10).await.expect("grant");
        let s = SessionId(lease.id as u64);
        let rec = NodeRecord {
            name: b"n1".to_vec(),
            pid: 9,
            started: Timespec::new(1, 0),
        };
        let leased = |key: Vec<u8>, value: Vec<u8>| {
            TxnOp::Put(PutOp {
                key,
                value,
                lease: lease.id,
            })
        };
        let mut map = AgFreeMap::all_free(AgId(1), g.ag_extent(AgId(1)).expect("group"));
        map.mark_used(crate::data::Extent::new(
            g.ag_extent(AgId(1)).expect("g").start.0,
            4,
        ))
        .expect("used");
        let lock = LockKey {
            ino: Ino(5),
            session: s,
            owner: 1,
            flock: true,
            start: 0,
        };
        let ops = vec![
            TxnOp::put(keys.superblock(), fs_record(&g).encode()),
            leased(keys.member(s), rec.encode()),
            leased(keys.group(GroupId(1)), Owner { session: s }.encode()),
            TxnOp::put(keys.free_map(GroupId(1)), map.encode()),
            leased(
                keys.cache_lock(Ino(5), s),
                CacheLock {
                    mode: LockMode::Exclusive,
                }
                .encode(),
            ),
            leased(keys.held(Ino(5), s), Owner { session: s }.encode()),
            leased(
                keys.lock(&lock),
                meta::codec::LockRecord {
                    write: true,
                    end: u64::MAX,
                    pid: 9,
                }
                .encode(),
            ),
            TxnOp::put(
                keys.orphan(Ino(6)),
                Owner {
                    session: SessionId(3),
                }
                .encode(),
            ),
            TxnOp::put(
                keys.released(g.ag_extent(AgId(2)).expect("g").dev_off()),
                Released { len: 8192 }.encode(),
            ),
        ];
        let r = kv
            .txn(Txn {
                success: ops,
                ..Default::default()
            })
            .await
            .expect("txn");
        assert!(r.succeeded);
        // Compact so the search has something to find.
        kv.compact(r.revision);
        let snap = read_snapshot(&kv, &keys, "st", &[])
            .await
            .expect("snapshot");
        assert_eq!(snap.etcd.compact_revision, Some(r.revision));
        let report = Report::new(&snap, &g);
        let n = &report.nodes[0];
        assert_eq!(n.name, "n1");
        assert_eq!(n.pid, Some(9));
        assert_eq!(n.version.as_deref(), Some(meta::codec::DAEMON_VERSION));
        assert_eq!(n.groups, vec![1]);
        assert_eq!(n.free_blocks_in_groups, 60);
        assert_eq!(n.lease_ttl_s, Some(10));
        assert_eq!(
            n.records,
            Tally {
                cache_exclusive: 1,
                flock_locks: 1,
                files_open: 1,
                ..Tally::default()
            }
        );
        assert_eq!(report.filesystem.free_blocks, 256 - 4);
        assert_eq!(report.orphans.unreclaimed, 1);
        assert_eq!(report.filesystem.released_blocks, 2);
        assert_eq!(report.warnings.len(), 2, "{:?}", report.warnings);
        // Eviction is a lease revoke: everything under the lease goes at once.
        let target = resolve("n1", &snap.nodes).expect("resolve");
        kv.lease_revoke(target.session.0 as i64)
            .await
            .expect("revoke");
        let after = read_snapshot(&kv, &keys, "st", &[])
            .await
            .expect("snapshot");
        assert!(after.nodes.is_empty() && after.owners.is_empty() && after.tallies.is_empty());
    }
}
