//! The checks of `etcfs fsck`, pure: a [`Checker`] is fed the filesystem's records in the
//! order [`super::scan`] reads them (one etcd revision, in pages) and keeps only what later
//! checks need: one small entry per inode, two bits per device block, the released
//! ranges, and the findings. Nothing here talks to etcd or the device, so every finding
//! class is tested by feeding hand-made records (`tests.rs`).
//!
//! Order of feeding (each step may rely on the ones before):
//! members → counter → inodes → directory parents → dentries → symlinks → xattrs →
//! orphans → open records → [`Checker::resolve_namespace`] → extents → released ranges →
//! free maps (every group, [`Checker::free_maps_done`]) → the other leased records →
//! [`Checker::finish`]. With double allocations, [`Checker::wants_names`] asks for a second
//! pass over the extents ([`Checker::name_extent`]) and then over the dentries
//! ([`Checker::name_dentry`], twice) to name the files involved.

use std::collections::{BTreeMap, BTreeSet};

use meta::{
    acl,
    codec::{
        Dentry, DirParent, Extent as MetaExtent, InoCounter, InodeAttr, Owner, Record as _,
        Released, FLAG_NO_XATTRS,
    },
    keys::{KeyKind, Keyspace},
    kv::KeyValue,
    types::{name_is_valid, FileType, Ino, SessionId},
};
use serde::Serialize;

use crate::data::{alloc::AgFreeMap, superblock::Geometry, AgId, BLOCK_SIZE};

/// Findings kept one by one (with their repairs); more are counted, and a repair run
/// leaves those for the next run (the exit code says errors are left).
pub(crate) const FINDINGS_KEPT_MAX: usize = 10_000;
/// Device ranges used by more than one file that the naming pass looks up.
const COLLISIONS_KEPT_MAX: usize = 1_000;
/// Released records kept for the free-map comparison (each is one freed range; a group
/// holds at most one per block, and they are folded within seconds while nodes run).
pub(crate) const RELEASED_KEPT_MAX: usize = 4_000_000;
/// Directory depth beyond which a parent chain is taken for a cycle.
const DEPTH_MAX: usize = 4096;

/// What kind of inconsistency a finding is. The summary counts findings by class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Class {
    /// A device superblock copy is damaged or disagrees with the other.
    SuperblockCopy,
    /// A record that does not decode, or a key that does not parse.
    CorruptRecord,
    /// The root directory is missing or is not a directory.
    RootMissing,
    /// A directory entry names an inode that does not exist, or sits in a directory that
    /// does not exist or is not a directory.
    DanglingDentry,
    /// A directory entry's type differs from its inode's.
    DentryType,
    /// A directory entry's name is not a legal name.
    BadName,
    /// A directory with no name, more than one name, or a parent record that disagrees
    /// with its name.
    DirectoryName,
    /// Directories whose parents form a cycle, unreachable from the root.
    DirectoryCycle,
    /// An inode no directory entry names and no orphan record keeps.
    Unreachable,
    /// An inode's link count differs from the entries naming it.
    LinkCount,
    /// A record that belongs to an inode that does not exist or has the wrong type
    /// (parent record, symlink target, xattr, extent, orphan record, open record).
    StrayRecord,
    /// An extent outside the device's data area, or not block-aligned.
    ExtentOutside,
    /// Two extents of one file cover the same file bytes.
    ExtentOverlap,
    /// A device block used by more than one extent: two files (or two places of one)
    /// share data. Never repaired.
    DoubleAllocation,
    /// Blocks used by a file that its group's free map calls free: the next allocation
    /// would hand them out again.
    ExtentInFreeSpace,
    /// Blocks the free map calls used that no file uses and no released record frees.
    LeakedBlocks,
    /// A released record covers blocks a file uses: loading the group (which applies every
    /// record) would free them.
    ReleasedInUse,
    /// A released record outside the data area or across a group boundary.
    ReleasedBad,
    /// An unlinked file that no node has open any more, not yet reclaimed.
    Orphan,
    /// An orphan record of a file that still has names.
    OrphanLinked,
    /// A record of a session whose node record (`M`) is gone: open records, cache locks,
    /// fcntl/flock locks, group ownership, requests for space, eviction requests.
    DeadSession,
    /// Inode numbers at or above the inode counter (would be handed out again).
    InodeCounter,
    /// A free map that does not decode or belongs to no group.
    BadFreeMap,
    /// An xattr its inode's flags deny (the no-xattrs bit, or a missing ACL bit): nodes
    /// answer from the flags that it is not there, and the kernel skips the ACL.
    XattrFlags,
}

impl Class {
    /// Whether a finding of this class may be a moment of normal work while nodes are
    /// mounted: their housekeeping resolves it within seconds.
    pub(crate) fn may_be_in_flux(self) -> bool {
        matches!(
            self,
            Class::LeakedBlocks | Class::Orphan | Class::DeadSession | Class::StrayRecord
        )
    }
}

/// One inconsistency.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Finding {
    pub(crate) class: Class,
    pub(crate) message: String,
    /// Nodes are mounted and this may be their work in progress.
    pub(crate) in_flux: bool,
    /// What `--repair` does about it (`None`: nothing, it is left).
    pub(crate) repair: Option<String>,
    /// The repair was applied.
    pub(crate) fixed: bool,
    /// Index of the repair in [`Checker::plan`].
    #[serde(skip)]
    pub(crate) fix: Option<usize>,
}

/// Counts of one class.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct ClassCount {
    pub(crate) found: u64,
    pub(crate) repairable: u64,
    pub(crate) fixed: u64,
}

/// A repair, applied by `repair.rs` in transactions that compare what was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fix {
    /// Delete one key (unchanged since the scan).
    Delete(Vec<u8>),
    /// Rewrite a dentry with the right type.
    DentryKind { key: Vec<u8>, dentry: Dentry },
    /// Rewrite a directory's parent record.
    SetParent { dir: Ino, parent: Ino },
    /// Delete an inode and everything of it (extents, xattrs, target, parent record,
    /// orphan record, cache locks); its blocks are free in the rebuilt maps.
    RemoveInode { ino: Ino, kind: Option<FileType> },
    /// Give an inode a name in `/lost+found` (`#<ino>`), taking a directory away from the
    /// cycle it was in (`old_parent`: its entry there is deleted).
    Reconnect {
        ino: Ino,
        kind: FileType,
        old_parent: Option<Ino>,
    },
    /// Set an inode's link count.
    SetNlink { ino: Ino, nlink: u32 },
    /// Raise the inode counter to `next`.
    RaiseCounter { next: u64 },
    /// Rewrite a group's free map from the extents (and delete its released records).
    RebuildMap { group: u32 },
    /// Rewrite a damaged device superblock copy from the good one.
    RewriteSuperblock { backup: bool },
    /// Set and clear inode flag bits (so they admit the xattrs the inode has).
    InodeFlags { ino: Ino, set: u32, clear: u32 },
}

/// Flags of an [`Ent`].
mod flag {
    /// A `P` record exists.
    pub(super) const HAS_PARENT: u16 = 1;
    /// A directory with an entry that agrees with its `P` record.
    pub(super) const NAMED: u16 = 1 << 1;
    /// A symlink target record exists.
    pub(super) const HAS_TARGET: u16 = 1 << 2;
    /// An orphan record exists.
    pub(super) const ORPHAN: u16 = 1 << 3;
    /// A live session has it open.
    pub(super) const HELD: u16 = 1 << 4;
    /// The repair removes it (its extents do not count as kept).
    pub(super) const REMOVE: u16 = 1 << 5;
    /// Reachability walk: on the current path.
    pub(super) const WALKING: u16 = 1 << 6;
    /// Reachability walk: reachable from the root (or reconnected).
    pub(super) const REACHABLE: u16 = 1 << 7;
    /// The inode record did not decode.
    pub(super) const CORRUPT: u16 = 1 << 8;
    /// The repair gives it a name in lost+found.
    pub(super) const RECONNECT: u16 = 1 << 9;
    /// The inode claims to have no xattrs but its ACLs (`codec::FLAG_NO_XATTRS`).
    pub(super) const NO_XATTRS: u16 = 1 << 10;
    /// The inode's access ACL bit (`acl::FLAG_ACCESS`).
    pub(super) const ACL_ACCESS: u16 = 1 << 11;
    /// The inode's default ACL bit (`acl::FLAG_DEFAULT`).
    pub(super) const ACL_DEFAULT: u16 = 1 << 12;
}

/// What is kept per inode: 32 bytes (the memory per million files is 32 MB of these).
#[derive(Clone, Copy, Debug)]
struct Ent {
    ino: u64,
    /// The `P` record's parent (directories), or after resolution the parent that names it.
    parent: u64,
    nlink: u32,
    /// Entries naming it that stay.
    links: u32,
    /// Subdirectories (named entries of directories in it).
    subdirs: u32,
    /// `FileType::code`, 0 when the record did not decode.
    kind: u8,
    flags: u16,
}

impl Ent {
    fn kind(&self) -> Option<FileType> {
        FileType::from_code(self.kind)
    }
    fn is_dir(&self) -> bool {
        self.kind == FileType::Directory.code()
    }
    fn has(&self, f: u16) -> bool {
        self.flags & f != 0
    }
}

/// One bit per device block.
#[derive(Clone, Debug)]
pub(crate) struct Bitmap {
    words: Vec<u64>,
}

impl Bitmap {
    pub(crate) fn new(bits: u64) -> Bitmap {
        Bitmap {
            words: vec![0; usize::try_from(bits.div_ceil(64)).unwrap_or(usize::MAX)],
        }
    }
    pub(crate) fn get(&self, b: u64) -> bool {
        let w = (b / 64) as usize;
        self.words.get(w).is_some_and(|x| x & (1 << (b % 64)) != 0)
    }
    /// Sets bit `b`; returns whether it was set already.
    pub(crate) fn set(&mut self, b: u64) -> bool {
        let w = (b / 64) as usize;
        match self.words.get_mut(w) {
            Some(x) => {
                let was = *x & (1 << (b % 64)) != 0;
                *x |= 1 << (b % 64);
                was
            }
            None => false,
        }
    }
    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.words.len() * 8
    }
}

/// A released record.
#[derive(Clone, Debug)]
struct Rel {
    key: Vec<u8>,
    start: u64,
    end: u64,
}

/// Blocks of one finding range, for messages.
fn blocks(start: u64, end: u64) -> String {
    if end == start + 1 {
        format!("block {start}")
    } else {
        format!("blocks {start}..{end} ({} blocks)", end - start)
    }
}

/// A run of blocks being gathered while walking a group.
#[derive(Default)]
struct Runs {
    open: Option<(u64, u64)>,
    done: Vec<(u64, u64)>,
    blocks: u64,
}

impl Runs {
    fn add(&mut self, b: u64) {
        self.blocks += 1;
        match &mut self.open {
            Some((_, e)) if *e == b => *e = b + 1,
            _ => {
                if let Some(r) = self.open.take() {
                    self.push(r);
                }
                self.open = Some((b, b + 1));
            }
        }
    }
    fn push(&mut self, r: (u64, u64)) {
        if self.done.len() < 64 {
            self.done.push(r);
        }
    }
    fn close(mut self) -> (Vec<(u64, u64)>, u64) {
        if let Some(r) = self.open.take() {
            self.push(r);
        }
        (self.done, self.blocks)
    }
}

/// Numbers for the summary.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Counts {
    pub(crate) inodes: u64,
    pub(crate) directories: u64,
    pub(crate) regular_files: u64,
    pub(crate) symlinks: u64,
    pub(crate) dentries: u64,
    pub(crate) xattrs: u64,
    pub(crate) extents: u64,
    pub(crate) blocks_in_files: u64,
    pub(crate) orphans: u64,
    pub(crate) released_records: u64,
    pub(crate) free_maps: u64,
    pub(crate) live_sessions: u64,
    pub(crate) leased_records: u64,
    /// Bytes of the per-inode table and the block bitmaps (the memory fsck needs beyond
    /// one page of records).
    pub(crate) table_bytes: u64,
}

/// The state of one check.
pub(crate) struct Checker {
    keys: Keyspace,
    geo: Geometry,
    /// The revision every record was read at.
    pub(crate) revision: i64,
    live: BTreeSet<SessionId>,
    counter: u64,
    inodes: Vec<Ent>,
    /// Directory entries of directories that do not match the directory's parent record:
    /// (directory, parent, name).
    dir_names: Vec<(u64, u64, Vec<u8>)>,
    /// `/lost+found`, if the root has a directory of that name.
    pub(crate) lost_found: Option<Ino>,
    /// The repair creates `/lost+found`.
    pub(crate) create_lost_found: bool,
    /// Subdirectory changes the repair makes (reconnections), per directory.
    subdir_delta: BTreeMap<u64, i64>,
    /// Every block some extent uses.
    used: Bitmap,
    /// Blocks that extents the repair keeps use.
    pub(crate) kept: Bitmap,
    /// Block ranges used twice, for the naming pass.
    collisions: Vec<(u64, u64)>,
    /// Block ranges in free space, for the naming pass.
    in_free: Vec<(u64, u64)>,
    /// (ino, file offset, device block range) of the extents the naming pass found.
    named_extents: Vec<(u64, u64, u64, u64)>,
    /// Names found by the naming passes: ino → (parent, name).
    names: BTreeMap<u64, (u64, Vec<u8>)>,
    released: Vec<Rel>,
    released_dropped: u64,
    next_group: u32,
    /// Released records per group to delete when its map is rebuilt.
    pub(crate) rebuild: BTreeSet<u32>,
    /// Previous extent of the inode being scanned: (ino, file end).
    prev_extent: Option<(u64, u64)>,
    pub(crate) findings: Vec<Finding>,
    pub(crate) by_class: BTreeMap<Class, ClassCount>,
    pub(crate) plan: Vec<Fix>,
    pub(crate) counts: Counts,
}

fn ft_name(k: Option<FileType>) -> &'static str {
    match k {
        Some(FileType::Regular) => "regular file",
        Some(FileType::Directory) => "directory",
        Some(FileType::Symlink) => "symlink",
        Some(FileType::CharDev) => "character device",
        Some(FileType::BlockDev) => "block device",
        Some(FileType::Fifo) => "fifo",
        Some(FileType::Socket) => "socket",
        None => "undecodable inode",
    }
}

impl Checker {
    pub(crate) fn new(keys: Keyspace, geo: Geometry, revision: i64) -> Checker {
        let bits = geo.total_blocks;
        Checker {
            keys,
            geo,
            revision,
            live: BTreeSet::new(),
            counter: Ino::FIRST_DYNAMIC,
            inodes: Vec::new(),
            dir_names: Vec::new(),
            lost_found: None,
            create_lost_found: false,
            subdir_delta: BTreeMap::new(),
            used: Bitmap::new(bits),
            kept: Bitmap::new(bits),
            collisions: Vec::new(),
            in_free: Vec::new(),
            named_extents: Vec::new(),
            names: BTreeMap::new(),
            released: Vec::new(),
            released_dropped: 0,
            next_group: 0,
            rebuild: BTreeSet::new(),
            prev_extent: None,
            findings: Vec::new(),
            by_class: BTreeMap::new(),
            plan: Vec::new(),
            counts: Counts::default(),
        }
    }

    /// The inode counter read (inode numbers at or above it are findings).
    pub(crate) fn ino_hi(&self) -> u64 {
        self.counter
    }

    /// Sizes the inode table for `n` inodes.
    pub(crate) fn expect_inodes(&mut self, n: usize) {
        self.inodes.reserve_exact(n);
    }

    pub(crate) fn geometry(&self) -> &Geometry {
        &self.geo
    }

    pub(crate) fn keys(&self) -> &Keyspace {
        &self.keys
    }

    /// Subdirectories a lost+found the repair creates gets.
    pub(crate) fn new_lost_found_subdirs(&self) -> u32 {
        u32::try_from(self.subdir_delta.get(&0).copied().unwrap_or(0)).unwrap_or(0)
    }

    /// Records a finding, and its repair (kept only while findings are kept one by one).
    pub(crate) fn report(&mut self, class: Class, message: String, fix: Option<Fix>) {
        let c = self.by_class.entry(class).or_default();
        c.found += 1;
        if self.findings.len() >= FINDINGS_KEPT_MAX {
            return;
        }
        let fix = fix.map(|f| {
            c.repairable += 1;
            self.plan.push(f);
            self.plan.len() - 1
        });
        let in_flux = !self.live.is_empty() && class.may_be_in_flux();
        self.findings.push(Finding {
            class,
            message,
            in_flux,
            repair: fix.map(|i| describe_fix(&self.plan[i])),
            fixed: false,
            fix,
        });
    }

    fn corrupt(&mut self, kv: &KeyValue, why: impl std::fmt::Display) {
        let msg = format!("{}: {why}", self.keys.describe(&kv.key));
        self.report(Class::CorruptRecord, msg, None);
    }

    fn idx(&self, ino: u64) -> Option<usize> {
        self.inodes.binary_search_by_key(&ino, |e| e.ino).ok()
    }

    fn ent(&self, ino: u64) -> Option<&Ent> {
        self.idx(ino).map(|i| &self.inodes[i])
    }

    fn ent_mut(&mut self, ino: u64) -> Option<&mut Ent> {
        self.idx(ino).map(|i| &mut self.inodes[i])
    }

    /// Unchanged-since-scan deletion of a record that should not be there.
    fn stray(&mut self, kv: &KeyValue, why: &str) {
        let msg = format!("{}: {why}", self.keys.describe(&kv.key));
        self.report(Class::StrayRecord, msg, Some(Fix::Delete(kv.key.clone())));
    }

    // ---------------------------------------------------------------------------------
    // Sessions and the counter
    // ---------------------------------------------------------------------------------

    pub(crate) fn member(&mut self, kv: &KeyValue) {
        match self.keys.parse(&kv.key) {
            Some(KeyKind::Member(s)) => {
                self.live.insert(s);
                self.counts.live_sessions += 1;
            }
            _ => self.corrupt(kv, "not a node record key"),
        }
    }

    pub(crate) fn counter(&mut self, kv: &KeyValue) {
        match InoCounter::decode(&kv.value) {
            Ok(c) => self.counter = c.next,
            Err(e) => self.corrupt(kv, e),
        }
    }

    // ---------------------------------------------------------------------------------
    // The namespace
    // ---------------------------------------------------------------------------------

    pub(crate) fn inode(&mut self, kv: &KeyValue) {
        let Some(KeyKind::Inode(ino)) = self.keys.parse(&kv.key) else {
            return self.corrupt(kv, "not an inode key");
        };
        self.counts.inodes += 1;
        let mut ent = Ent {
            ino: ino.0,
            parent: 0,
            nlink: 0,
            links: 0,
            subdirs: 0,
            kind: 0,
            flags: 0,
        };
        match InodeAttr::decode(&kv.value) {
            Ok(a) if a.ino == ino => {
                ent.kind = a.kind.code();
                ent.nlink = a.nlink;
                for (bit, f) in [
                    (FLAG_NO_XATTRS, flag::NO_XATTRS),
                    (acl::FLAG_ACCESS, flag::ACL_ACCESS),
                    (acl::FLAG_DEFAULT, flag::ACL_DEFAULT),
                ] {
                    if a.flags & bit != 0 {
                        ent.flags |= f;
                    }
                }
                match a.kind {
                    FileType::Directory => self.counts.directories += 1,
                    FileType::Regular => self.counts.regular_files += 1,
                    FileType::Symlink => self.counts.symlinks += 1,
                    _ => {}
                }
            }
            Ok(a) => {
                ent.flags |= flag::CORRUPT;
                self.corrupt(kv, format!("the record says inode {}", a.ino));
            }
            Err(e) => {
                ent.flags |= flag::CORRUPT;
                self.corrupt(kv, e);
            }
        }
        if ino.0 >= self.counter {
            let next = ino.0 + 1;
            // One finding for the highest: the fix raises the counter past every one.
            if let Some(i) = self
                .plan
                .iter()
                .position(|f| matches!(f, Fix::RaiseCounter { .. }))
            {
                self.plan[i] = Fix::RaiseCounter { next };
            } else {
                let msg = format!(
                    "inode {ino} is at or above the inode counter ({}): its number would be \
                     handed out again",
                    self.counter
                );
                self.report(Class::InodeCounter, msg, Some(Fix::RaiseCounter { next }));
            }
        }
        match self.inodes.last() {
            Some(last) if last.ino >= ino.0 => {}
            _ => self.inodes.push(ent),
        }
    }

    pub(crate) fn dir_parent(&mut self, kv: &KeyValue) {
        let Some(KeyKind::DirParent(dir)) = self.keys.parse(&kv.key) else {
            return self.corrupt(kv, "not a parent key");
        };
        let parent = match DirParent::decode(&kv.value) {
            Ok(p) => p.parent,
            Err(e) => return self.corrupt(kv, e),
        };
        match self.ent_mut(dir.0) {
            Some(e) if e.is_dir() => {
                e.parent = parent.0;
                e.flags |= flag::HAS_PARENT;
            }
            Some(e) if e.has(flag::CORRUPT) => {}
            Some(e) => {
                let k = e.kind();
                self.stray(kv, &format!("parent record of a {}", ft_name(k)));
            }
            None => self.stray(kv, "parent record of a missing inode"),
        }
    }

    pub(crate) fn dentry(&mut self, kv: &KeyValue) {
        let Some(KeyKind::Dentry(parent, name)) = self.keys.parse(&kv.key) else {
            return self.corrupt(kv, "not a dentry key");
        };
        self.counts.dentries += 1;
        let d = match Dentry::decode(&kv.value) {
            Ok(d) => d,
            Err(e) => return self.corrupt(kv, e),
        };
        let what = self.keys.describe(&kv.key);
        let del = Some(Fix::Delete(kv.key.clone()));
        match self.ent(parent.0) {
            None => {
                let msg = format!("{what}: entry in directory {parent}, which does not exist");
                return self.report(Class::DanglingDentry, msg, del);
            }
            Some(p) if p.has(flag::CORRUPT) => return,
            Some(p) if !p.is_dir() => {
                let msg = format!("{what}: entry in inode {parent}, a {}", ft_name(p.kind()));
                return self.report(Class::DanglingDentry, msg, del);
            }
            Some(_) => {}
        }
        if !name_is_valid(&name) {
            let msg = format!(
                "{what}: {:?} is not a legal name",
                String::from_utf8_lossy(&name)
            );
            return self.report(Class::BadName, msg, del);
        }
        let child = match self.ent(d.ino.0) {
            None => {
                let msg = format!("{what}: names inode {}, which does not exist", d.ino);
                return self.report(Class::DanglingDentry, msg, del);
            }
            Some(c) => *c,
        };
        if child.has(flag::CORRUPT) {
            return;
        }
        let kind = child.kind().expect("decoded inodes have a type");
        if kind != d.kind {
            let msg = format!(
                "{what}: the entry says {}, inode {} is a {}",
                ft_name(Some(d.kind)),
                d.ino,
                ft_name(Some(kind))
            );
            let fix = Fix::DentryKind {
                key: kv.key.clone(),
                dentry: Dentry { ino: d.ino, kind },
            };
            self.report(Class::DentryType, msg, Some(fix));
        }
        if parent == Ino::ROOT && name == b"lost+found" && kind == FileType::Directory {
            self.lost_found = Some(d.ino);
        }
        if kind == FileType::Directory {
            if d.ino == Ino::ROOT {
                let msg = format!("{what}: an entry names the root directory");
                return self.report(Class::DirectoryName, msg, del);
            }
            let matches = child.has(flag::HAS_PARENT) && child.parent == parent.0;
            if matches && !child.has(flag::NAMED) {
                let c = self.ent_mut(d.ino.0).expect("looked up above");
                c.flags |= flag::NAMED;
                c.links += 1;
                self.ent_mut(parent.0).expect("looked up above").subdirs += 1;
            } else {
                self.dir_names.push((d.ino.0, parent.0, name));
            }
        } else {
            self.ent_mut(d.ino.0).expect("looked up above").links += 1;
        }
    }

    pub(crate) fn symlink(&mut self, kv: &KeyValue) {
        let Some(KeyKind::Symlink(ino)) = self.keys.parse(&kv.key) else {
            return self.corrupt(kv, "not a symlink key");
        };
        match self.ent_mut(ino.0) {
            Some(e) if e.kind == FileType::Symlink.code() => e.flags |= flag::HAS_TARGET,
            Some(e) if e.has(flag::CORRUPT) => {}
            Some(e) => {
                let k = e.kind();
                self.stray(kv, &format!("symlink target of a {}", ft_name(k)));
            }
            None => self.stray(kv, "symlink target of a missing inode"),
        }
    }

    pub(crate) fn xattr(&mut self, kv: &KeyValue) {
        let Some(KeyKind::Xattr(ino, name)) = self.keys.parse(&kv.key) else {
            return self.corrupt(kv, "not an xattr key");
        };
        self.counts.xattrs += 1;
        let Some(e) = self.ent(ino.0) else {
            return self.stray(kv, "xattr of a missing inode");
        };
        let (set, clear, why) = match name.as_slice() {
            acl::ACCESS_NAME if !e.has(flag::ACL_ACCESS) => (
                acl::FLAG_ACCESS,
                0,
                "an access ACL its inode's flags do not name",
            ),
            acl::DEFAULT_NAME if !e.has(flag::ACL_DEFAULT) => (
                acl::FLAG_DEFAULT,
                0,
                "a default ACL its inode's flags do not name",
            ),
            acl::ACCESS_NAME | acl::DEFAULT_NAME => return,
            _ if e.has(flag::NO_XATTRS) => (
                0,
                FLAG_NO_XATTRS,
                "an xattr of an inode whose flags say it has none",
            ),
            _ => return,
        };
        // An inode's xattrs are contiguous keys: one finding and fix per inode, its fix
        // grown as they come.
        if let Some(Fix::InodeFlags {
            ino: i,
            set: s,
            clear: c,
        }) = self.plan.last_mut()
        {
            if *i == ino {
                *s |= set;
                *c |= clear;
                return;
            }
        }
        let msg = format!("{}: {why}", self.keys.describe(&kv.key));
        self.report(
            Class::XattrFlags,
            msg,
            Some(Fix::InodeFlags { ino, set, clear }),
        );
    }

    pub(crate) fn orphan(&mut self, kv: &KeyValue) {
        let Some(KeyKind::Orphan(ino)) = self.keys.parse(&kv.key) else {
            return self.corrupt(kv, "not an orphan key");
        };
        self.counts.orphans += 1;
        if let Err(e) = Owner::decode(&kv.value) {
            // The value is informational; the key is what keeps the inode.
            self.corrupt(kv, e);
        }
        match self.ent_mut(ino.0) {
            Some(e) => e.flags |= flag::ORPHAN,
            None => self.stray(kv, "orphan record of a missing inode"),
        }
    }

    /// An open record (`H`): the file is kept while a live session has it open.
    pub(crate) fn held(&mut self, kv: &KeyValue) {
        let Some(KeyKind::Held(ino, s)) = self.keys.parse(&kv.key) else {
            return self.corrupt(kv, "not an open-record key");
        };
        self.counts.leased_records += 1;
        if !self.live.contains(&s) {
            return self.dead_session(kv, s);
        }
        match self.ent_mut(ino.0) {
            Some(e) => e.flags |= flag::HELD,
            None => self.stray(kv, "open record of a missing inode"),
        }
    }

    fn dead_session(&mut self, kv: &KeyValue, s: SessionId) {
        let msg = format!(
            "{}: session {s} has no node record (its node is gone)",
            self.keys.describe(&kv.key)
        );
        self.report(Class::DeadSession, msg, Some(Fix::Delete(kv.key.clone())));
    }

    /// Leased records other than open records (`K`, `Q`, `B`, `W`, `G`, `T`) and eviction
    /// requests (`V`): each must belong to a live session.
    pub(crate) fn session_record(&mut self, kv: &KeyValue) {
        let session = match self.keys.parse(&kv.key) {
            Some(KeyKind::CacheLock(_, s) | KeyKind::CacheWant(_, s)) => s,
            Some(KeyKind::Lock(l)) => l.session,
            Some(KeyKind::SpaceWanted(s) | KeyKind::Evict(s) | KeyKind::TxnMarker(s, _)) => s,
            Some(KeyKind::Group(g)) => {
                if g.0 >= self.geo.ag_count {
                    return self.stray(kv, "owner of a group past the last");
                }
                match Owner::decode(&kv.value) {
                    Ok(o) => o.session,
                    Err(e) => return self.corrupt(kv, e),
                }
            }
            _ => return self.corrupt(kv, "not a session record key"),
        };
        self.counts.leased_records += 1;
        if !self.live.contains(&session) {
            self.dead_session(kv, session);
        }
    }

    /// After the namespace records: names of directories, reachability, link counts,
    /// orphans; decides which inodes the repair removes (their extents are then not kept).
    pub(crate) fn resolve_namespace(&mut self) {
        match self.ent(Ino::ROOT.0) {
            Some(r) if r.is_dir() => {
                let r = *r;
                if !r.has(flag::HAS_PARENT) || r.parent != Ino::ROOT.0 {
                    let fix = Fix::SetParent {
                        dir: Ino::ROOT,
                        parent: Ino::ROOT,
                    };
                    self.report(
                        Class::DirectoryName,
                        "the root directory's parent record is not the root".into(),
                        Some(fix),
                    );
                }
                let root = self.ent_mut(Ino::ROOT.0).expect("present");
                root.flags |= flag::NAMED | flag::HAS_PARENT | flag::REACHABLE;
                root.parent = Ino::ROOT.0;
            }
            _ => {
                self.report(
                    Class::RootMissing,
                    "the root directory (inode 1) is missing or is not a directory".into(),
                    None,
                );
                return;
            }
        }
        self.resolve_directory_names();
        self.walk_directories();
        self.resolve_links();
    }

    /// Directories whose entry disagrees with their parent record, or with several entries.
    fn resolve_directory_names(&mut self) {
        let names = std::mem::take(&mut self.dir_names);
        for (dir, parent, name) in names {
            let key = self.keys.dentry(Ino(parent), &name);
            let what = self.keys.describe(&key);
            let e = *self.ent(dir).expect("checked when the entry was read");
            if e.has(flag::NAMED) {
                let msg = format!("{what}: a second name of directory {dir}");
                self.report(Class::DirectoryName, msg, Some(Fix::Delete(key)));
                continue;
            }
            let msg = if e.has(flag::HAS_PARENT) {
                format!(
                    "{what}: directory {dir} is named here but its parent record says {}",
                    e.parent
                )
            } else {
                format!("{what}: directory {dir} has no parent record")
            };
            let fix = Fix::SetParent {
                dir: Ino(dir),
                parent: Ino(parent),
            };
            self.report(Class::DirectoryName, msg, Some(fix));
            let c = self.ent_mut(dir).expect("present");
            c.flags |= flag::NAMED | flag::HAS_PARENT;
            c.parent = parent;
            c.links += 1;
            self.ent_mut(parent).expect("checked when read").subdirs += 1;
        }
    }

    /// The parent of a named directory, or `None` when it has no name.
    fn dir_up(&self, i: usize) -> Option<usize> {
        let e = &self.inodes[i];
        if !e.has(flag::NAMED) {
            return None;
        }
        self.idx(e.parent)
    }

    /// Follows every directory's parents to the root; a directory without a name, or a
    /// cycle, is reconnected (one directory per cycle: the rest hang below it).
    fn walk_directories(&mut self) {
        let mut path: Vec<usize> = Vec::new();
        for start in 0..self.inodes.len() {
            let s = &self.inodes[start];
            if !s.is_dir() || s.has(flag::REACHABLE) || s.has(flag::CORRUPT) {
                continue;
            }
            path.clear();
            let mut cur = start;
            loop {
                let e = self.inodes[cur];
                if e.has(flag::REACHABLE) {
                    break;
                }
                if e.has(flag::WALKING) || path.len() > DEPTH_MAX {
                    // A cycle: the members are the path from `cur` on.
                    let from = path.iter().position(|&p| p == cur).unwrap_or(0);
                    let members: Vec<u64> =
                        path[from..].iter().map(|&p| self.inodes[p].ino).collect();
                    let victim = *members.iter().min().expect("a cycle has members");
                    let shown: Vec<String> =
                        members.iter().take(8).map(|m| m.to_string()).collect();
                    let msg = format!(
                        "directories {} form a cycle, unreachable from the root",
                        shown.join(" → ")
                    );
                    let old = self.ent(victim).map(|v| v.parent);
                    self.report(
                        Class::DirectoryCycle,
                        msg,
                        Some(Fix::Reconnect {
                            ino: Ino(victim),
                            kind: FileType::Directory,
                            old_parent: old.map(Ino),
                        }),
                    );
                    if let Some(old) = old {
                        *self.subdir_delta.entry(old).or_default() -= 1;
                    }
                    self.mark_reconnected(victim);
                    break;
                }
                match self.dir_up(cur) {
                    Some(up) => {
                        self.inodes[cur].flags |= flag::WALKING;
                        path.push(cur);
                        cur = up;
                    }
                    None => {
                        let ino = e.ino;
                        let msg = format!("directory {ino} has no name: unreachable");
                        self.report(
                            Class::Unreachable,
                            msg,
                            Some(Fix::Reconnect {
                                ino: Ino(ino),
                                kind: FileType::Directory,
                                old_parent: None,
                            }),
                        );
                        self.mark_reconnected(ino);
                        break;
                    }
                }
            }
            for &p in &path {
                let f = &mut self.inodes[p].flags;
                *f = (*f & !flag::WALKING) | flag::REACHABLE;
            }
        }
    }

    fn mark_reconnected(&mut self, ino: u64) {
        let lf = self.lost_found.map_or(0, |l| l.0);
        if let Some(e) = self.ent_mut(ino) {
            e.flags |= flag::REACHABLE | flag::RECONNECT;
        }
        if self.lost_found.is_none() && !self.create_lost_found {
            self.create_lost_found = true;
            // The new directory is one more subdirectory of the root.
            *self.subdir_delta.entry(Ino::ROOT.0).or_default() += 1;
        }
        if self.ent(ino).is_some_and(Ent::is_dir) {
            // Key 0 stands for a lost+found the repair creates.
            *self.subdir_delta.entry(lf).or_default() += 1;
        }
    }

    /// Link counts, unreachable inodes and orphans.
    fn resolve_links(&mut self) {
        let offline = self.live.is_empty();
        for i in 0..self.inodes.len() {
            let e = self.inodes[i];
            if e.has(flag::CORRUPT) {
                continue;
            }
            let ino = Ino(e.ino);
            let kind = e.kind().expect("decoded");
            if kind == FileType::Symlink && !e.has(flag::HAS_TARGET) {
                let msg = format!("symlink {ino} has no target record");
                self.report(Class::StrayRecord, msg, None);
            }
            if e.is_dir() {
                continue;
            }
            if e.links == 0 {
                if e.has(flag::ORPHAN) && e.nlink == 0 {
                    if e.has(flag::HELD) {
                        continue;
                    }
                    let msg = format!(
                        "{} {ino} was unlinked while open, and no node has it open any more: \
                         not yet reclaimed",
                        ft_name(Some(kind))
                    );
                    let fix = offline.then_some(Fix::RemoveInode {
                        ino,
                        kind: Some(kind),
                    });
                    self.remove_if(offline, e.ino);
                    self.report(Class::Orphan, msg, fix);
                } else if e.nlink == 0 {
                    let msg = format!(
                        "{} {ino} has no names, link count 0 and no orphan record",
                        ft_name(Some(kind))
                    );
                    self.remove_if(true, e.ino);
                    let fix = Fix::RemoveInode {
                        ino,
                        kind: Some(kind),
                    };
                    self.report(Class::Unreachable, msg, Some(fix));
                } else {
                    let msg = format!(
                        "{} {ino} (link count {}) has no names: unreachable",
                        ft_name(Some(kind)),
                        e.nlink
                    );
                    let fix = Fix::Reconnect {
                        ino,
                        kind,
                        old_parent: None,
                    };
                    self.report(Class::Unreachable, msg, Some(fix));
                    self.mark_reconnected(e.ino);
                    if e.nlink != 1 {
                        self.fix_link_count(ino, 1);
                    }
                    if e.has(flag::ORPHAN) {
                        self.fix_orphan_record(ino);
                    }
                }
                continue;
            }
            if e.has(flag::ORPHAN) {
                self.fix_orphan_record(ino);
            }
            if e.nlink != e.links {
                let msg = format!(
                    "{} {ino} has link count {}, {} entries name it",
                    ft_name(Some(kind)),
                    e.nlink,
                    e.links
                );
                self.report(
                    Class::LinkCount,
                    msg,
                    Some(Fix::SetNlink {
                        ino,
                        nlink: e.links,
                    }),
                );
            }
        }
        // Directories last: a file reconnected above may create lost+found, one more
        // subdirectory of the root.
        for i in 0..self.inodes.len() {
            let e = self.inodes[i];
            if e.has(flag::CORRUPT) || !e.is_dir() {
                continue;
            }
            let ino = Ino(e.ino);
            let want = 2 + i64::from(e.subdirs);
            let after = want + self.subdir_delta.get(&e.ino).copied().unwrap_or(0);
            let fix = (i64::from(e.nlink) != after).then(|| Fix::SetNlink {
                ino,
                nlink: u32::try_from(after).unwrap_or(u32::MAX),
            });
            if i64::from(e.nlink) != want {
                let msg = format!(
                    "directory {ino} has link count {}, it has {} subdirectories (so {want})",
                    e.nlink, e.subdirs
                );
                self.report(Class::LinkCount, msg, fix);
            } else if let Some(fix) = fix {
                // Only the repair's own reconnections change it: no finding of its own.
                self.plan.push(fix);
            }
        }
    }

    fn remove_if(&mut self, yes: bool, ino: u64) {
        if yes {
            if let Some(e) = self.ent_mut(ino) {
                e.flags |= flag::REMOVE;
            }
        }
    }

    fn fix_orphan_record(&mut self, ino: Ino) {
        let msg = format!("inode {ino} has an orphan record but also names");
        let fix = Fix::Delete(self.keys.orphan(ino));
        self.report(Class::OrphanLinked, msg, Some(fix));
    }

    /// A link count the repair's reconnection sets (the finding is the reconnection).
    fn fix_link_count(&mut self, ino: Ino, nlink: u32) {
        self.plan.push(Fix::SetNlink { ino, nlink });
    }

    // ---------------------------------------------------------------------------------
    // Space
    // ---------------------------------------------------------------------------------

    /// One extent (`E`). Marks its blocks used, and kept unless the repair drops it.
    pub(crate) fn extent(&mut self, kv: &KeyValue) {
        let Some(KeyKind::Extent(ino, off)) = self.keys.parse(&kv.key) else {
            return self.corrupt(kv, "not an extent key");
        };
        let ext = match MetaExtent::decode_value(off, &kv.value) {
            Ok(e) => e,
            Err(e) => return self.corrupt(kv, e),
        };
        self.counts.extents += 1;
        let what = self.keys.describe(&kv.key);
        let (mut keep, mut mark) = (true, true);
        match self.ent(ino.0) {
            None => {
                self.stray(kv, "extent of a missing inode");
                keep = false;
            }
            Some(e) if e.has(flag::CORRUPT) => {}
            Some(e) if e.kind != FileType::Regular.code() => {
                let k = e.kind();
                self.stray(kv, &format!("extent of a {}", ft_name(k)));
                keep = false;
            }
            Some(e) => keep = !e.has(flag::REMOVE),
        }
        if let Some((p, end)) = self.prev_extent {
            if p == ino.0 && ext.file_off < end {
                let msg = format!(
                    "{what}: starts at file byte {}, inside the previous extent (to {end})",
                    ext.file_off
                );
                self.report(Class::ExtentOverlap, msg, None);
            }
        }
        self.prev_extent = Some((ino.0, ext.file_end()));
        let aligned = [ext.file_off, ext.len, ext.dev_off]
            .iter()
            .all(|v| v % BLOCK_SIZE == 0);
        let start = ext.dev_off / BLOCK_SIZE;
        let end = (ext.dev_off + ext.len).div_ceil(BLOCK_SIZE);
        let inside = start >= self.geo.data_start_block && end <= self.geo.data_end_block();
        if !inside {
            let msg = format!(
                "{what}: device {} lie outside the data area (blocks {}..{})",
                blocks(start, end),
                self.geo.data_start_block,
                self.geo.data_end_block()
            );
            let fix = keep.then(|| Fix::Delete(kv.key.clone()));
            self.report(Class::ExtentOutside, msg, fix);
            mark = false;
        } else if !aligned {
            let msg = format!(
                "{what}: not block-aligned (file byte {}, {} bytes at device byte {})",
                ext.file_off, ext.len, ext.dev_off
            );
            self.report(Class::ExtentOutside, msg, None);
        }
        if !mark {
            return;
        }
        self.counts.blocks_in_files += end - start;
        let mut run: Option<(u64, u64)> = None;
        for b in start..end {
            if self.used.set(b) {
                match &mut run {
                    Some((_, e)) if *e == b => *e = b + 1,
                    _ => {
                        if let Some(r) = run.take() {
                            self.collision(r);
                        }
                        run = Some((b, b + 1));
                    }
                }
            }
            if keep {
                self.kept.set(b);
            }
        }
        if let Some(r) = run {
            self.collision(r);
        }
    }

    fn collision(&mut self, r: (u64, u64)) {
        if self.collisions.len() < COLLISIONS_KEPT_MAX {
            self.collisions.push(r);
        }
    }

    /// One released record (`R`).
    pub(crate) fn released(&mut self, kv: &KeyValue) {
        let Some(KeyKind::Released(dev_off)) = self.keys.parse(&kv.key) else {
            return self.corrupt(kv, "not a released-range key");
        };
        let r = match Released::decode(&kv.value) {
            Ok(r) => r,
            Err(e) => return self.corrupt(kv, e),
        };
        self.counts.released_records += 1;
        let start = dev_off / BLOCK_SIZE;
        let end = dev_off.saturating_add(r.len).div_ceil(BLOCK_SIZE);
        let g0 = self.geo.ag_of(crate::data::BlockNo(start));
        let g1 = self.geo.ag_of(crate::data::BlockNo(end.saturating_sub(1)));
        if g0.is_none() || g0 != g1 || dev_off % BLOCK_SIZE != 0 {
            let msg = format!(
                "{}: {} are not inside one allocation group",
                self.keys.describe(&kv.key),
                blocks(start, end)
            );
            return self.report(Class::ReleasedBad, msg, Some(Fix::Delete(kv.key.clone())));
        }
        if self.released.len() >= RELEASED_KEPT_MAX {
            self.released_dropped += 1;
            return;
        }
        self.released.push(Rel {
            key: kv.key.clone(),
            start,
            end,
        });
    }

    /// One free map (`F`), in group order; groups without a map are checked as all free.
    pub(crate) fn free_map(&mut self, kv: &KeyValue) {
        let Some(KeyKind::FreeMap(g)) = self.keys.parse(&kv.key) else {
            return self.corrupt(kv, "not a free-map key");
        };
        if g.0 >= self.geo.ag_count {
            let msg = format!(
                "{}: free map of a group past the last",
                self.keys.describe(&kv.key)
            );
            return self.report(Class::BadFreeMap, msg, Some(Fix::Delete(kv.key.clone())));
        }
        while self.next_group < g.0 {
            self.group(self.next_group, None);
            self.next_group += 1;
        }
        if self.next_group == g.0 {
            self.counts.free_maps += 1;
            self.group(g.0, Some(kv));
            self.next_group += 1;
        }
    }

    /// Checks the groups after the last free map.
    pub(crate) fn free_maps_done(&mut self) {
        while self.next_group < self.geo.ag_count {
            self.group(self.next_group, None);
            self.next_group += 1;
        }
    }

    /// Compares one group's map (absent: all free) with the extents and released records.
    fn group(&mut self, g: u32, kv: Option<&KeyValue>) {
        let ag = AgId(g);
        let span = self.geo.ag_extent(ag).expect("g < ag_count");
        let map = match kv {
            None => AgFreeMap::all_free(ag, span),
            Some(kv) => match AgFreeMap::decode(&kv.value, ag, span) {
                Ok(m) => m,
                Err(e) => {
                    let msg = format!("{}: {e}", self.keys.describe(&kv.key));
                    self.report(Class::BadFreeMap, msg, Some(Fix::RebuildMap { group: g }));
                    self.rebuild.insert(g);
                    return;
                }
            },
        };
        let lo = self.released.partition_point(|r| r.end <= span.start.0);
        let hi = self.released.partition_point(|r| r.start < span.end());
        let rels: Vec<Rel> = self.released[lo..hi].to_vec();
        let mut free = map.free_extents().peekable();
        let mut ri = 0;
        let (mut in_free, mut leaked, mut rel_used) =
            (Runs::default(), Runs::default(), Runs::default());
        let mut differs = false;
        for b in span.start.0..span.end() {
            while free.peek().is_some_and(|f| f.end() <= b) {
                free.next();
            }
            let is_free = free.peek().is_some_and(|f| f.start.0 <= b);
            while ri < rels.len() && rels[ri].end <= b {
                ri += 1;
            }
            // A group's loader applies every released record (a map never includes one
            // that still exists: the write that folds it deletes it), so any record
            // covering the block frees it.
            let released = rels[ri..]
                .iter()
                .take_while(|r| r.start <= b)
                .any(|r| r.end > b);
            let used = self.used.get(b);
            if used != self.kept.get(b) {
                differs = true;
            }
            if used && is_free {
                in_free.add(b);
            } else if !used && !is_free && !released {
                leaked.add(b);
            }
            if used && released {
                rel_used.add(b);
            }
        }
        let (in_free, n_free) = in_free.close();
        let (leaked, n_leaked) = leaked.close();
        let (rel_used, n_rel) = rel_used.close();
        let rebuild = n_free + n_leaked + n_rel > 0 || differs;
        if rebuild {
            self.rebuild.insert(g);
        }
        let fix = || Some(Fix::RebuildMap { group: g });
        for (s, e) in in_free {
            self.in_free.push((s, e));
            let msg = format!(
                "group {g}: {} are used by files but free in the group's map",
                blocks(s, e)
            );
            self.report(Class::ExtentInFreeSpace, msg, fix());
        }
        for (s, e) in leaked {
            let msg = format!(
                "group {g}: {} are used in the group's map but by no file (leaked)",
                blocks(s, e)
            );
            self.report(Class::LeakedBlocks, msg, fix());
        }
        for (s, e) in rel_used {
            let msg = format!(
                "group {g}: a released record covers {} that a file uses",
                blocks(s, e)
            );
            self.report(Class::ReleasedInUse, msg, fix());
        }
        if differs && n_free + n_leaked + n_rel == 0 {
            // Only the repair's removals change the group: rebuilt without a finding.
            self.plan.push(Fix::RebuildMap { group: g });
        }
    }

    /// Released records of group `g` (their keys), for the rebuild that folds them.
    pub(crate) fn released_in(&self, g: u32) -> Vec<Vec<u8>> {
        let Some(span) = self.geo.ag_extent(AgId(g)) else {
            return Vec::new();
        };
        self.released
            .iter()
            .filter(|r| r.start >= span.start.0 && r.start < span.end())
            .map(|r| r.key.clone())
            .collect()
    }

    /// The map a rebuild writes for group `g`: free wherever no kept extent is.
    pub(crate) fn rebuilt_map(&self, g: u32) -> Option<AgFreeMap> {
        let ag = AgId(g);
        let span = self.geo.ag_extent(ag)?;
        let mut m = AgFreeMap::all_free(ag, span);
        let mut run: Option<(u64, u64)> = None;
        for b in span.start.0..span.end() {
            if self.kept.get(b) {
                match &mut run {
                    Some((_, e)) if *e == b => *e = b + 1,
                    _ => {
                        if let Some((s, e)) = run.take() {
                            m.mark_used(crate::data::Extent::new(s, e - s)).ok()?;
                        }
                        run = Some((b, b + 1));
                    }
                }
            }
        }
        if let Some((s, e)) = run {
            m.mark_used(crate::data::Extent::new(s, e - s)).ok()?;
        }
        Some(m)
    }

    // ---------------------------------------------------------------------------------
    // Naming the files of double allocations
    // ---------------------------------------------------------------------------------

    /// Whether double allocations (or files in free space) need their files named: then
    /// the extents are read again ([`Self::name_extent`]), then the dentries twice
    /// ([`Self::name_dentry`]).
    pub(crate) fn wants_names(&self) -> bool {
        !self.collisions.is_empty() || !self.in_free.is_empty()
    }

    fn interesting(&self, s: u64, e: u64) -> bool {
        self.collisions
            .iter()
            .chain(self.in_free.iter())
            .any(|&(cs, ce)| cs < e && s < ce)
    }

    /// Second pass over the extents: remembers those that use a collided block.
    pub(crate) fn name_extent(&mut self, kv: &KeyValue) {
        let Some(KeyKind::Extent(ino, off)) = self.keys.parse(&kv.key) else {
            return;
        };
        let Ok(ext) = MetaExtent::decode_value(off, &kv.value) else {
            return;
        };
        let s = ext.dev_off / BLOCK_SIZE;
        let e = (ext.dev_off + ext.len).div_ceil(BLOCK_SIZE);
        if self.interesting(s, e) && self.named_extents.len() < 4 * COLLISIONS_KEPT_MAX {
            self.named_extents.push((ino.0, ext.file_off, s, e));
        }
    }

    /// The inodes whose names the naming passes look for: the files found by
    /// [`Self::name_extent`], then their ancestors.
    fn wanted(&self) -> BTreeSet<u64> {
        let mut w: BTreeSet<u64> = self.named_extents.iter().map(|x| x.0).collect();
        let found: Vec<u64> = self.names.values().map(|(p, _)| *p).collect();
        for mut p in found {
            for _ in 0..DEPTH_MAX {
                if p == Ino::ROOT.0 || !w.insert(p) {
                    break;
                }
                match self.ent(p) {
                    Some(e) if e.has(flag::NAMED) => p = e.parent,
                    _ => break,
                }
            }
        }
        w
    }

    /// A pass over the dentries for names (run twice: files, then their directories).
    pub(crate) fn name_dentry(&mut self, kv: &KeyValue, wanted: &BTreeSet<u64>) {
        let Some(KeyKind::Dentry(parent, name)) = self.keys.parse(&kv.key) else {
            return;
        };
        let Ok(d) = Dentry::decode(&kv.value) else {
            return;
        };
        if wanted.contains(&d.ino.0) && !self.names.contains_key(&d.ino.0) {
            self.names.insert(d.ino.0, (parent.0, name));
        }
    }

    pub(crate) fn names_wanted(&self) -> BTreeSet<u64> {
        self.wanted()
    }

    /// Reports the double allocations (and names the files in free space), once the
    /// naming passes (if any) are done.
    pub(crate) fn report_collisions(&mut self) {
        let collisions = std::mem::take(&mut self.collisions);
        for (s, e) in collisions {
            let users: Vec<String> = self
                .named_extents
                .iter()
                .filter(|x| x.2 < e && s < x.3)
                .map(|&(ino, off, ..)| {
                    format!(
                        "inode {ino} {} at file byte {off}",
                        path_of_in(&self.names, ino)
                    )
                })
                .collect();
            let msg = format!(
                "{} are used by more than one extent: {}",
                blocks(s, e),
                if users.is_empty() {
                    "(files not named)".to_string()
                } else {
                    users.join(" and ")
                }
            );
            self.report(Class::DoubleAllocation, msg, None);
        }
        let in_free = std::mem::take(&mut self.in_free);
        for f in self.findings.iter_mut() {
            if f.class != Class::ExtentInFreeSpace {
                continue;
            }
            for &(s, e) in &in_free {
                if !f.message.contains(&blocks(s, e)) {
                    continue;
                }
                let users: BTreeSet<u64> = self
                    .named_extents
                    .iter()
                    .filter(|x| x.2 < e && s < x.3)
                    .map(|x| x.0)
                    .collect();
                let named: Vec<String> = users
                    .iter()
                    .take(4)
                    .map(|&i| format!("inode {i} {}", path_of_in(&self.names, i)))
                    .collect();
                if !named.is_empty() {
                    f.message.push_str(&format!(" ({})", named.join(", ")));
                }
            }
        }
    }

    /// After every pass: the table's size for the summary.
    pub(crate) fn finish(&mut self) {
        if self.released_dropped > 0 {
            let msg = format!(
                "{} released records past the first {RELEASED_KEPT_MAX} were not compared",
                self.released_dropped
            );
            self.report(Class::CorruptRecord, msg, None);
        }
        self.counts.table_bytes = (self.inodes.capacity() * std::mem::size_of::<Ent>()
            + self.used.bytes()
            + self.kept.bytes()) as u64;
    }

    /// Whether anything would be or was left unrepaired.
    pub(crate) fn unrepaired(&self) -> u64 {
        self.by_class.values().map(|c| c.found - c.fixed).sum()
    }

    /// Findings in total.
    pub(crate) fn found(&self) -> u64 {
        self.by_class.values().map(|c| c.found).sum()
    }

    /// Marks the findings whose repairs were all applied (`applied[i]`: fix `i` ran).
    pub(crate) fn mark_fixed(&mut self, applied: &[bool]) {
        for f in &mut self.findings {
            if let Some(i) = f.fix {
                if applied.get(i).copied().unwrap_or(false) {
                    f.fixed = true;
                    self.by_class.entry(f.class).or_default().fixed += 1;
                }
            }
        }
    }
}

fn path_of_in(names: &BTreeMap<u64, (u64, Vec<u8>)>, ino: u64) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur = ino;
    for _ in 0..DEPTH_MAX {
        if cur == Ino::ROOT.0 {
            parts.reverse();
            return format!("/{}", parts.join("/"));
        }
        match names.get(&cur) {
            Some((p, n)) => {
                parts.push(String::from_utf8_lossy(n).into_owned());
                cur = *p;
            }
            None => break,
        }
    }
    "(no path)".into()
}

/// What a repair does, in words.
pub(crate) fn describe_fix(f: &Fix) -> String {
    match f {
        Fix::Delete(_) => "delete the record".into(),
        Fix::DentryKind { dentry, .. } => {
            format!("rewrite the entry with type {}", ft_name(Some(dentry.kind)))
        }
        Fix::SetParent { dir, parent } => format!("set the parent record of {dir} to {parent}"),
        Fix::RemoveInode { ino, .. } => {
            format!("remove inode {ino} and its records; its blocks become free")
        }
        Fix::Reconnect { ino, .. } => format!("link it into /lost+found as #{ino}"),
        Fix::SetNlink { nlink, .. } => format!("set the link count to {nlink}"),
        Fix::InodeFlags { ino, .. } => {
            format!("make inode {ino}'s flags admit the xattrs it has")
        }
        Fix::RaiseCounter { next } => format!("raise the inode counter to {next}"),
        Fix::RebuildMap { group } => {
            format!(
                "rewrite group {group}'s free map from the extents (folding its released records)"
            )
        }
        Fix::RewriteSuperblock { backup } => format!(
            "rewrite the {} copy from the other",
            if *backup { "backup" } else { "primary" }
        ),
    }
}
