//! `etcfs fsck`: checks every invariant of a filesystem's etcd records and device
//! superblocks at one etcd revision, and with `--repair` (only when no node is mounted)
//! fixes what it safely can, in transactions that compare what was read.
//!
//! Three parts: this module reads (the superblock copies from the device, then every key
//! of the filesystem in pages at the revision of the first read) and prints the report;
//! [`check`] holds the checks, pure, fed one record at a time; [`repair`] applies the
//! repairs the checks planned. [`populate`] writes a synthetic population straight into
//! etcd for the benchmark (benches/fsck.sh).
//!
//! Memory: one 32-byte entry per inode (32 MB per million files), two bits per device
//! block (1 MiB for 16 GiB), the released records, one page of keys (4096), and the
//! findings (at most [`check::FINDINGS_KEPT_MAX`] kept one by one). Directory entries,
//! extents and xattrs are never held, only counted.
//!
//! Exit codes as e2fsck: 0 clean, 1 errors corrected, 4 errors left uncorrected, 8 an
//! operational error (etcd unreachable, wrong or unformatted device, unknown prefix,
//! `--repair` refused while nodes are mounted).

pub(crate) mod check;
pub(crate) mod populate;
mod repair;
#[cfg(test)]
mod tests;

use std::{
    collections::BTreeMap,
    io::{IsTerminal as _, Write as _},
    path::{Path, PathBuf},
    process::ExitCode,
    time::Instant,
};

use anyhow::{anyhow, bail, Result};
use meta::{
    codec::{decode_at, NodeInfo, Record as _, SuperRecord},
    error::KvError,
    keys::{prefix_end, KeyRange, Keyspace},
    kv::{KeyValue, KvBackend, RangeRequest},
};
use serde::Serialize;

use self::check::{Checker, Class, ClassCount, Counts, Finding, Fix};
use crate::{
    data::{
        alloc::AgFreeMap,
        device::{open_device, psync::PsyncDev, OpenOpts},
        mkfs as dmkfs,
        superblock::fmt_uuid,
    },
    ClusterArgs,
};

/// Exit codes (e2fsck's).
pub(crate) const EXIT_CLEAN: u8 = 0;
pub(crate) const EXIT_CORRECTED: u8 = 1;
pub(crate) const EXIT_UNCORRECTED: u8 = 4;
pub(crate) const EXIT_OPERATIONAL: u8 = 8;

/// Keys per page of records.
const PAGE_KEYS: i64 = 4096;
/// Bytes of free maps per page.
const PAGE_MAP_BYTES: u64 = 2 << 20;
/// Inode numbers per window of a per-inode scan (see [`Scanner::scan_ino`]).
const INO_WINDOW: u64 = 8192;
/// Records between two progress lines.
const PROGRESS_EVERY: u64 = 65_536;

/// `etcfs fsck` arguments.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct FsckArgs {
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
    /// The shared block device (or device image) of the filesystem.
    #[arg(long)]
    pub(crate) device: PathBuf,
    /// Repair what can be repaired safely (only when no node is mounted).
    #[arg(long)]
    pub(crate) repair: bool,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Runs `etcfs fsck` and turns its outcome into the exit code.
pub(crate) fn main(args: &FsckArgs) -> ExitCode {
    match run(args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            if args.json {
                let v =
                    serde_json::json!({ "error": format!("{e:#}"), "exit_code": EXIT_OPERATIONAL });
                println!("{v}");
            }
            eprintln!("etcfs fsck: {e:#}");
            ExitCode::from(EXIT_OPERATIONAL)
        }
    }
}

fn run(args: &FsckArgs) -> Result<u8> {
    let keys = Keyspace::new(&args.cluster.prefix).map_err(|e| anyhow!("bad --prefix: {e}"))?;
    let dev = open_device(&args.device, OpenOpts::default()).map_err(|e| anyhow!("{e}"))?;
    let rt = crate::status::runtime()?;
    let kv = crate::status::connect(&rt, &args.cluster.etcd_config()?)?;
    let mut progress = Progress::new(!args.json && std::io::stderr().is_terminal());
    let started = Instant::now();
    let mut sbdev = PsyncDev::new(&dev);
    let out = rt.block_on(fsck(
        &*kv,
        &keys,
        &mut sbdev,
        &args.device,
        args.repair,
        &mut progress,
    ))?;
    progress.clear();
    let report = Report::new(
        &args.cluster.prefix,
        &args.device,
        &out,
        started.elapsed().as_secs_f64(),
    );
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(report.exit_code)
}

/// What one run found and did.
pub(crate) struct Outcome {
    pub(crate) checker: Checker,
    pub(crate) fs: SuperRecord,
    /// Mounted nodes: (name, session).
    pub(crate) nodes: Vec<(String, u64)>,
    pub(crate) repair: bool,
    /// Why the repair stopped early.
    pub(crate) repair_stopped: Option<String>,
}

/// Checks (and with `repair`, repairs) the filesystem under `keys` whose device is `dev`.
pub(crate) async fn fsck(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    dev: &mut PsyncDev,
    dev_path: &Path,
    repair: bool,
    progress: &mut Progress,
) -> Result<Outcome> {
    let sb_key = keys.superblock();
    let r = kv
        .range(RangeRequest::key(sb_key.clone()))
        .await
        .map_err(|e| anyhow!("reading the superblock record from etcd: {e}"))?;
    let prefix = String::from_utf8_lossy(keys.root())
        .trim_end_matches('/')
        .to_string();
    let Some(sbkv) = r.kvs.first() else {
        bail!(
            "etcd prefix {prefix:?} holds no etcfs filesystem (unknown prefix, or not formatted: \
             run `etcfs mkfs`)"
        );
    };
    let fs: SuperRecord = decode_at(keys, &sb_key, &sbkv.value)?;
    let geo = crate::status::geometry(&fs)?;
    let rev = r.revision;

    // The device first: a wrong or unformatted device ends the check before anything else.
    let (sb, copies) = dmkfs::read_superblock(dev, dev_path).map_err(|e| anyhow!("{e}"))?;
    dmkfs::agrees_with_meta(&sb, &fs, dev_path).map_err(|e| anyhow!("{e}"))?;
    use crate::data::device::BlockDev as _;
    if dev.size_bytes() < sb.geometry.device_size {
        bail!(
            "device {} is {} bytes, smaller than the {} it was formatted with",
            dev_path.display(),
            dev.size_bytes(),
            sb.geometry.device_size
        );
    }
    let mut ck = Checker::new(keys.clone(), geo, rev);
    if !copies.primary_ok {
        ck.report(
            Class::SuperblockCopy,
            format!(
                "device {}: the primary superblock (block 0) is damaged",
                dev_path.display()
            ),
            Some(Fix::RewriteSuperblock { backup: false }),
        );
    }
    if !copies.backup_ok {
        ck.report(
            Class::SuperblockCopy,
            format!(
                "device {}: the backup superblock (block {}) is damaged or differs",
                dev_path.display(),
                sb.geometry.backup_block()
            ),
            Some(Fix::RewriteSuperblock { backup: true }),
        );
    }

    let nodes = scan_all(kv, keys, &mut ck, repair, progress).await?;
    let mut repair_stopped = None;
    if repair && !ck.plan.is_empty() {
        let (applied, stopped) = repair::apply(kv, &ck, Some((dev, dev_path, sb.uuid))).await;
        ck.mark_fixed(&applied);
        repair_stopped = stopped;
    }
    Ok(Outcome {
        checker: ck,
        fs,
        nodes,
        repair,
        repair_stopped,
    })
}

/// Reads every record of the filesystem at the checker's revision, in the order the
/// checks need (see [`check`]); with `repair`, refuses once it finds a mounted node.
/// Returns the mounted nodes: (name, session).
pub(crate) async fn scan_all(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    ck: &mut Checker,
    repair: bool,
    progress: &mut Progress,
) -> Result<Vec<(String, u64)>> {
    let geo = *ck.geometry();
    let mut nodes = Vec::new();
    let mut s = Scanner {
        kv,
        rev: ck.revision,
        progress,
    };
    s.scan("node records", keys.members(), PAGE_KEYS, |kv| {
        ck.member(kv);
        let name = NodeInfo::decode(&kv.value)
            .map(|n| String::from_utf8_lossy(&n.record.name).into_owned())
            .unwrap_or_else(|_| "?".into());
        let session = kv.key.len().checked_sub(8).map_or(0, |at| {
            u64::from_be_bytes(kv.key[at..].try_into().unwrap_or_default())
        });
        nodes.push((name, session));
    })
    .await?;
    if repair && !nodes.is_empty() {
        let names: Vec<String> = nodes
            .iter()
            .map(|(n, s)| format!("{n} (session {s:x})"))
            .collect();
        bail!(
            "refusing --repair: {} node(s) are mounted or their lease has not expired yet: {}. \
             Unmount every node (a killed node's record goes when its lease expires, or with \
             `etcfs evict --force`) and run again; without --repair, fsck checks read-only \
             while nodes are mounted",
            names.len(),
            names.join(", ")
        );
    }
    s.scan(
        "the inode counter",
        key_range(keys.ino_counter()),
        1,
        |kv| ck.counter(kv),
    )
    .await?;
    // One entry per inode: sized once from etcd's count, not grown by doubling.
    let r = keys.inodes();
    let count = kv
        .range(
            RangeRequest::range(r.start, r.end)
                .keys_only()
                .limit(1)
                .at(ck.revision),
        )
        .await
        .map_err(|e| anyhow!("counting the inodes: {e}"))?
        .count;
    ck.expect_inodes(usize::try_from(count).unwrap_or(0));
    let hi = ck.ino_hi();
    s.scan_ino("inodes", keys.inodes(), hi, PAGE_KEYS, |kv| ck.inode(kv))
        .await?;
    s.scan_ino(
        "directory parents",
        tag_range(keys, &keys.dir_parent(meta::types::Ino(0))),
        hi,
        PAGE_KEYS,
        |kv| ck.dir_parent(kv),
    )
    .await?;
    let dentries = tag_range(keys, &keys.dentry(meta::types::Ino(0), b""));
    s.scan_ino("directory entries", dentries.clone(), hi, PAGE_KEYS, |kv| {
        ck.dentry(kv)
    })
    .await?;
    s.scan_ino(
        "symlinks",
        tag_range(keys, &keys.symlink(meta::types::Ino(0))),
        hi,
        PAGE_KEYS,
        |kv| ck.symlink(kv),
    )
    .await?;
    s.scan_ino(
        "xattrs",
        tag_range(keys, &keys.xattr(meta::types::Ino(0), b"")),
        hi,
        PAGE_KEYS,
        |kv| ck.xattr(kv),
    )
    .await?;
    s.scan_ino("orphans", keys.orphans(), hi, PAGE_KEYS, |kv| ck.orphan(kv))
        .await?;
    s.scan_ino(
        "open records",
        tag_range(
            keys,
            &keys.held(meta::types::Ino(0), meta::types::SessionId(0)),
        ),
        hi,
        PAGE_KEYS,
        |kv| ck.held(kv),
    )
    .await?;
    ck.resolve_namespace();
    let extents = tag_range(keys, &keys.extent(meta::types::Ino(0), 0));
    s.scan_ino("extents", extents.clone(), hi, PAGE_KEYS, |kv| {
        ck.extent(kv)
    })
    .await?;
    s.scan(
        "released ranges",
        tag_range(keys, &keys.released(0)),
        PAGE_KEYS,
        |kv| ck.released(kv),
    )
    .await?;
    let map_max = AgFreeMap::encoded_len_max(geo.ag_blocks).max(1);
    let maps_per_page = i64::try_from((PAGE_MAP_BYTES / map_max).max(1)).unwrap_or(1);
    s.scan("free maps", keys.free_maps(), maps_per_page, |kv| {
        ck.free_map(kv)
    })
    .await?;
    ck.free_maps_done();
    let sample_lock = meta::keys::LockKey {
        ino: meta::types::Ino(0),
        session: meta::types::SessionId(0),
        owner: 0,
        flock: false,
        start: 0,
    };
    let (i0, s0) = (meta::types::Ino(0), meta::types::SessionId(0));
    for (what, sample, per_ino) in [
        ("cache locks", keys.cache_lock(i0, s0), true),
        ("cache lock waits", keys.cache_want(i0, s0), true),
        ("fcntl and flock locks", keys.lock(&sample_lock), true),
        ("requests for space", keys.space_wanted(s0), false),
        ("eviction requests", keys.evict(s0), false),
        ("commit markers", keys.txn_marker(s0, 0), false),
        ("group owners", keys.group(meta::types::GroupId(0)), false),
    ] {
        let range = tag_range(keys, &sample);
        let f = |kv: &KeyValue| ck.session_record(kv);
        if per_ino {
            s.scan_ino(what, range, hi, PAGE_KEYS, f).await?;
        } else {
            s.scan(what, range, PAGE_KEYS, f).await?;
        }
    }
    if ck.wants_names() {
        s.scan_ino(
            "extents again (naming shared blocks)",
            extents,
            hi,
            PAGE_KEYS,
            |kv| ck.name_extent(kv),
        )
        .await?;
        for _ in 0..2 {
            let wanted = ck.names_wanted();
            s.scan_ino(
                "directory entries again (names)",
                dentries.clone(),
                hi,
                PAGE_KEYS,
                |kv| ck.name_dentry(kv, &wanted),
            )
            .await?;
        }
    }
    ck.report_collisions();
    ck.finish();
    s.progress.clear();

    Ok(nodes)
}

/// Every key of one tag, from any key of that tag.
fn tag_range(keys: &Keyspace, sample: &[u8]) -> KeyRange {
    let start = sample[..keys.root().len() + 1].to_vec();
    KeyRange {
        end: prefix_end(&start),
        start,
    }
}

/// One key as a range.
fn key_range(key: Vec<u8>) -> KeyRange {
    let mut end = key.clone();
    end.push(0);
    KeyRange { start: key, end }
}

/// Reads ranges at one revision, in pages.
struct Scanner<'a> {
    kv: &'a dyn KvBackend,
    rev: i64,
    progress: &'a mut Progress,
}

impl Scanner<'_> {
    async fn scan(
        &mut self,
        what: &str,
        range: KeyRange,
        page: i64,
        mut f: impl FnMut(&KeyValue),
    ) -> Result<()> {
        let mut n = self.progress.start(what);
        // Ranges still to read, the next in key order last. A range holding many more keys
        // than a page is split in two after its first page: etcd 3.4 gathers every key of
        // a request's range to count them, so paging through a large range costs the
        // square of its size, and halving keeps the total near n log n.
        let mut todo = vec![range];
        while let Some(r) = todo.pop() {
            let req = RangeRequest::range(r.start.clone(), r.end.clone())
                .limit(page)
                .at(self.rev);
            let resp = self.kv.range(req).await.map_err(|e| match e {
                KvError::Compacted { .. } => anyhow!(
                    "etcd compacted revision {} while fsck was reading it ({what}); run again \
                     (etcd's auto-compaction retention must outlast one fsck run)",
                    self.rev
                ),
                e => anyhow!("reading the {what} from etcd: {e}"),
            })?;
            for kv in &resp.kvs {
                f(kv);
                n += 1;
                if n % PROGRESS_EVERY == 0 {
                    self.progress.show(what, n);
                }
            }
            self.progress.count = n;
            let Some(last) = resp.kvs.last().filter(|_| resp.more) else {
                continue;
            };
            let mut start = last.key.clone();
            start.push(0);
            let rest = KeyRange { start, end: r.end };
            match midpoint(&rest.start, &rest.end).filter(|_| resp.count > 4 * page) {
                Some(mid) => {
                    todo.push(KeyRange {
                        start: mid.clone(),
                        end: rest.end,
                    });
                    todo.push(KeyRange {
                        start: rest.start,
                        end: mid,
                    });
                }
                None => todo.push(rest),
            }
        }
        Ok(())
    }
}

/// A key strictly between `a` and `b` (`a < b`), about halfway in byte order, or `None`
/// when there is none worth splitting at.
pub(crate) fn midpoint(a: &[u8], b: &[u8]) -> Option<Vec<u8>> {
    let len = a.len().max(b.len()) + 1;
    let pad = |k: &[u8]| {
        let mut v = k.to_vec();
        v.resize(len, 0);
        v
    };
    let (pa, pb) = (pad(a), pad(b));
    // (a + b) / 2 over big-endian numbers of `len` bytes, with the carry as a top bit.
    let mut sum = vec![0u16; len];
    let mut carry = 0u16;
    for i in (0..len).rev() {
        let t = u16::from(pa[i]) + u16::from(pb[i]) + carry;
        sum[i] = t & 0xff;
        carry = t >> 8;
    }
    let mut mid = vec![0u8; len];
    let mut high = carry;
    for i in 0..len {
        let t = (high << 8) | sum[i];
        mid[i] = (t >> 1) as u8;
        high = t & 1;
    }
    while mid.last() == Some(&0) && mid.len() > 1 {
        mid.pop();
    }
    (a < mid.as_slice() && mid.as_slice() < b).then_some(mid)
}

impl Scanner<'_> {
    /// [`Scanner::scan`] of a tag whose keys start with an inode number, in windows of
    /// [`INO_WINDOW`] inode numbers up to `ino_hi`, then the rest of the tag: etcd 3.4
    /// gathers every key from a page's start to the range's end for each page (to count
    /// them), so pages over the whole tag cost the square of its size (a million files
    /// took 106 s; the windows make it linear).
    async fn scan_ino(
        &mut self,
        what: &str,
        tag: KeyRange,
        ino_hi: u64,
        page: i64,
        mut f: impl FnMut(&KeyValue),
    ) -> Result<()> {
        let at = |ino: u64| {
            let mut k = tag.start.clone();
            k.extend_from_slice(&ino.to_be_bytes());
            k
        };
        let mut lo = 0u64;
        while lo < ino_hi {
            let hi = lo.saturating_add(INO_WINDOW);
            self.scan(
                what,
                KeyRange {
                    start: at(lo),
                    end: at(hi),
                },
                page,
                &mut f,
            )
            .await?;
            lo = hi;
        }
        let rest = KeyRange {
            start: at(lo),
            end: tag.end.clone(),
        };
        self.scan(what, rest, page, &mut f).await
    }
}

/// Progress on a terminal: one line on stderr, rewritten.
pub(crate) struct Progress {
    on: bool,
    shown: bool,
    /// What is being read, and how many records of it so far (a scan in windows
    /// goes on counting).
    what: String,
    count: u64,
}

impl Progress {
    pub(crate) fn new(on: bool) -> Progress {
        Progress {
            on,
            shown: false,
            what: String::new(),
            count: 0,
        }
    }
    /// The count so far of `what` (0 when it is new), shown.
    fn start(&mut self, what: &str) -> u64 {
        if self.what != what {
            self.what = what.to_owned();
            self.count = 0;
            self.show(what, 0);
        }
        self.count
    }
    fn show(&mut self, what: &str, n: u64) {
        if self.on {
            let _ = write!(std::io::stderr(), "\r\x1b[Kfsck: reading {what}: {n}");
            self.shown = true;
        }
    }
    fn clear(&mut self) {
        if self.shown {
            let _ = write!(std::io::stderr(), "\r\x1b[K");
            self.shown = false;
        }
    }
}

/// The report, printed as text or JSON.
#[derive(Serialize)]
pub(crate) struct Report {
    pub(crate) prefix: String,
    pub(crate) device: String,
    pub(crate) uuid: String,
    pub(crate) revision: i64,
    /// Nodes mounted while the check ran (read-only check).
    pub(crate) mounted_nodes: Vec<String>,
    pub(crate) repair: bool,
    pub(crate) repair_stopped: Option<String>,
    pub(crate) counts: Counts,
    pub(crate) classes: BTreeMap<Class, ClassCount>,
    pub(crate) findings: Vec<Finding>,
    /// Findings past those kept one by one.
    pub(crate) findings_not_listed: u64,
    pub(crate) seconds: f64,
    pub(crate) exit_code: u8,
}

impl Report {
    pub(crate) fn new(prefix: &str, device: &Path, out: &Outcome, seconds: f64) -> Report {
        let ck = &out.checker;
        let found = ck.found();
        let left = ck.unrepaired();
        let exit_code = if found == 0 {
            EXIT_CLEAN
        } else if left == 0 {
            EXIT_CORRECTED
        } else {
            EXIT_UNCORRECTED
        };
        Report {
            prefix: prefix.to_owned(),
            device: device.display().to_string(),
            uuid: fmt_uuid(&out.fs.uuid),
            revision: ck.revision,
            mounted_nodes: out
                .nodes
                .iter()
                .map(|(n, s)| format!("{n} (session {s:x})"))
                .collect(),
            repair: out.repair,
            repair_stopped: out.repair_stopped.clone(),
            counts: ck.counts.clone(),
            classes: ck.by_class.clone(),
            findings: ck.findings.clone(),
            findings_not_listed: found.saturating_sub(ck.findings.len() as u64),
            seconds,
            exit_code,
        }
    }

    pub(crate) fn render(&self) -> String {
        use std::fmt::Write as _;
        let mut o = String::new();
        let c = &self.counts;
        let _ = writeln!(
            o,
            "etcfs fsck: filesystem {} (etcd prefix {:?}, device {}) at etcd revision {}",
            self.uuid, self.prefix, self.device, self.revision
        );
        let _ = writeln!(
            o,
            "  {} inodes ({} directories, {} regular files, {} symlinks), {} directory entries, \
             {} xattrs, {} extents ({} blocks), {} orphans, {} released ranges, {} free maps",
            c.inodes,
            c.directories,
            c.regular_files,
            c.symlinks,
            c.dentries,
            c.xattrs,
            c.extents,
            c.blocks_in_files,
            c.orphans,
            c.released_records,
            c.free_maps
        );
        if !self.mounted_nodes.is_empty() {
            let _ = writeln!(
                o,
                "  mounted: {} — checked read-only; findings marked ~ may be work in progress \
                 of the mounted nodes (their housekeeping settles them within seconds)",
                self.mounted_nodes.join(", ")
            );
        }
        if !self.findings.is_empty() {
            let _ = writeln!(o, "\nFindings:");
        }
        for f in &self.findings {
            let mark = if f.in_flux { "~" } else { " " };
            let what = match (&f.repair, f.fixed, self.repair) {
                (_, true, _) => " [repaired]".to_string(),
                (Some(r), false, false) => format!(" [--repair would {r}]"),
                (Some(_), false, true) => " [not repaired]".to_string(),
                (None, _, _) => " [left as it is]".to_string(),
            };
            let _ = writeln!(o, "{mark} {:?}: {}{what}", f.class, f.message);
        }
        if self.findings_not_listed > 0 {
            let _ = writeln!(
                o,
                "  ... and {} more findings, not listed (nor repaired by this run)",
                self.findings_not_listed
            );
        }
        if let Some(why) = &self.repair_stopped {
            let _ = writeln!(o, "\nThe repair stopped: {why}");
        }
        if !self.classes.is_empty() {
            let _ = writeln!(
                o,
                "\n{:<22} {:>8} {:>9} {:>8}",
                "class", "found", "repaired", "left"
            );
            for (class, n) in &self.classes {
                let name = serde_json::to_value(class)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default();
                let _ = writeln!(
                    o,
                    "{name:<22} {:>8} {:>9} {:>8}",
                    n.found,
                    n.fixed,
                    n.found - n.fixed
                );
            }
        }
        let verdict = match self.exit_code {
            EXIT_CLEAN => "clean".to_string(),
            EXIT_CORRECTED => "errors corrected".to_string(),
            _ if self.repair => "errors left uncorrected".to_string(),
            _ if self.mounted_nodes.is_empty() => {
                "errors found; run with --repair to correct what can be".to_string()
            }
            _ => {
                "errors found (nodes are mounted: --repair needs every node unmounted)".to_string()
            }
        };
        let _ = writeln!(
            o,
            "\n{verdict} (exit {}); {:.1} s, {} MiB of tables",
            self.exit_code,
            self.seconds,
            self.counts.table_bytes >> 20
        );
        o
    }
}
