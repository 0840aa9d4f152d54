//! The typed mutations handlers submit, and what each reports back.

use crate::{
    codec::{Dentry, InodeAttr},
    types::{FileType, GroupId, Ino, Revision, Timespec},
};

/// Attributes of an inode being created (times are set to the commit-planning time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewInode {
    /// File type (Directory makes this a mkdir, Symlink needs a target).
    pub kind: FileType,
    /// Permission bits (`mode & 0o7777`, after umask).
    pub perm: u16,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Device number for device nodes.
    pub rdev: u64,
    /// Inode flags.
    pub flags: u32,
    /// POSIX ACL inheritance (`None`: `perm` is final and no ACL is inherited).
    pub inherit: Option<AclInherit>,
}

impl NewInode {
    /// An inode of `kind` owned by root with permission bits `perm`, no device number,
    /// flags or ACL inheritance.
    pub fn root_owned(kind: FileType, perm: u16) -> Self {
        NewInode {
            kind,
            perm,
            uid: 0,
            gid: 0,
            rdev: 0,
            flags: 0,
            inherit: None,
        }
    }
}

/// How a new inode's mode and ACLs come from its parent, decided by the plan against the
/// parent's default ACL as etcd holds it (compared), as ext4 decides them: with a default
/// ACL the new inode gets it as its access ACL (a directory also as its default ACL) and
/// the mode is masked by it, without the umask; without one the umask applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AclInherit {
    /// The creator's umask.
    pub umask: u16,
    /// The submitter believes the parent has a default ACL (`acl::FLAG_DEFAULT` in its
    /// cached attributes): the plan reads it. Otherwise it assumes none, guarded by a
    /// compare on its absence (a failed compare re-plans with what etcd holds).
    pub parent_default: bool,
}

/// How `rename` treats an existing destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenameMode {
    /// Replace an existing destination (plain rename(2)).
    Replace,
    /// Fail with `Exists` if the destination exists (RENAME_NOREPLACE).
    NoReplace,
    /// Swap source and destination, both must exist (RENAME_EXCHANGE).
    Exchange,
}

/// A timestamp to set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeSet {
    /// The commit-planning time (UTIME_NOW).
    Now,
    /// An explicit time.
    At(Timespec),
}

/// Attribute changes for [`Mutation::SetAttr`]; `None` leaves a field alone (UTIME_OMIT).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SetAttr {
    /// New permission bits.
    pub perm: Option<u16>,
    /// New owner.
    pub uid: Option<u32>,
    /// New group.
    pub gid: Option<u32>,
    /// New size (truncate/extend); shrinking drops extents past the new end.
    pub size: Option<u64>,
    /// New atime.
    pub atime: Option<TimeSet>,
    /// New mtime.
    pub mtime: Option<TimeSet>,
    /// New inode flags.
    pub flags: Option<u32>,
    /// Clear set-user-id (and set-group-id with group-execute) from the stored mode, as a
    /// chown or a truncate by another user does: decided on the value the plan changes,
    /// not on a cached one. `perm` wins when both are given.
    pub kill_suidgid: bool,
    /// `atime` is a read's access time (relatime): it only moves forward, and on its own
    /// it leaves ctime alone, as a read does on ext4.
    pub access: bool,
    /// Marks the status change (ctime) whatever else changes: for a change held by the
    /// node before its commit that moved nothing else (a chown to the owner the file has).
    pub ctime: bool,
    /// Commit only if the inode is unchanged since this revision, else fail with
    /// [`MetaError::Changed`](crate::error::MetaError::Changed): for a change computed
    /// from attributes read at that revision without the file's lock held across the
    /// commit (the mtime of in-place overwrites), which must not undo a later one.
    pub unchanged_since: Option<i64>,
    /// The inode's attributes exactly as the submitter's caches hold them. When given
    /// (and `unchanged_since` is not), the plan changes these instead of reading the
    /// inode and compares their encoding, so a chmod, chown or utimes commits in one
    /// round trip; a stale guess fails the compare and the mutation is re-planned from
    /// what etcd holds (the guess dropped).
    pub expect: Option<Box<InodeAttr>>,
}

/// xattr set semantics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XattrMode {
    /// Create or replace.
    Any,
    /// Fail with `Exists` if present (XATTR_CREATE).
    Create,
    /// Fail with `NotFound` if absent (XATTR_REPLACE).
    Replace,
}

/// Ranges one [`Mutation::LogReleased`] may carry (one put each).
pub const LOG_RELEASED_MAX: usize = 64;

/// A device byte range released by a mutation (to be returned to its group's allocator).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevRange {
    /// Device offset in bytes.
    pub dev_off: u64,
    /// Length in bytes.
    pub len: u64,
}

/// What an unlink/rmdir expects to find (see [`Mutation::Unlink::expect`]). Every part
/// is only a guess: nothing fails on its strength alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnlinkExpect {
    /// The entry the name holds.
    pub entry: Dentry,
    /// The child's attributes exactly as stored (their encoding is compared).
    pub child: Option<InodeAttr>,
    /// rmdir: the parent's attributes exactly as stored (its link count changes).
    pub parent: Option<InodeAttr>,
    /// unlink of a regular file (with `child`): every extent key of it, sorted, as the
    /// submitter's record of its last commit has them. The plan then releases these
    /// instead of reading the extents, and guesses that no node has the file open;
    /// both are compared.
    pub extents: Option<Vec<crate::codec::Extent>>,
}

/// What a SetExtents expects etcd to hold (see [`Mutation::SetExtents::expect`]): the
/// submitter's record of the file as its last commit left it. Only a guess: each part is
/// compared, and a stale guess costs a re-plan from what etcd holds, never a wrong write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtentsExpect {
    /// The inode's attributes exactly as stored.
    pub attr: InodeAttr,
    /// Every extent key of the inode from the last one before the range (if any) to the
    /// range's end, sorted: the keys the plan would otherwise read.
    pub extents: Vec<crate::codec::Extent>,
}

/// Extent keys a SetExtents commit left, for the submitter's next expectation: the
/// inode's keys at file offsets in `[start, end)` are exactly `extents` (sorted).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtentsKnown {
    /// First file offset the record covers.
    pub start: u64,
    /// First file offset after it.
    pub end: u64,
    /// The keys, as extents.
    pub extents: Vec<crate::codec::Extent>,
}

impl ExtentsKnown {
    /// What a commit of `[off, end)` may expect after the commit that left this record
    /// and the inode `attr`: the last key before `off` and the keys inside, from the
    /// record where it covers them and guessed absent past its end (an append's range).
    /// None when the record cannot say which key comes last before `off`.
    pub fn expectation(&self, attr: &InodeAttr, off: u64, end: u64) -> Option<ExtentsExpect> {
        if off < self.start {
            return None;
        }
        let before = self.extents.iter().rfind(|e| e.file_off < off);
        if before.is_none() && self.start > 0 {
            return None;
        }
        let inside = self
            .extents
            .iter()
            .filter(|e| e.file_off >= off && e.file_off < end);
        Some(ExtentsExpect {
            attr: attr.clone(),
            extents: before.into_iter().chain(inside).copied().collect(),
        })
    }
}

/// Where the allocation groups lie on the device, in bytes: group `i` is
/// `[start + i * size, start + (i + 1) * size)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupLayout {
    /// Device offset of group 0.
    pub start: u64,
    /// Bytes per group.
    pub size: u64,
}

/// One filesystem metadata change. Each is atomic on its own: it commits entirely in one
/// etcd transaction or not at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// create/mknod/mkdir/symlink: a new inode (number assigned by the pipeline) and its
    /// entry `name` in `parent`. The caller has checked that `parent` is a directory
    /// (inode types never change and numbers are never reused, so the pipeline only
    /// checks that `parent` still exists).
    Create {
        /// Directory to create in.
        parent: Ino,
        /// Entry name.
        name: Vec<u8>,
        /// The new inode.
        inode: NewInode,
        /// Symlink target (required iff `inode.kind` is Symlink).
        symlink: Option<Vec<u8>>,
        /// create-and-open of a regular file: this session's open record (`H`, see
        /// [`Mutation::Hold`]) goes in the same transaction, so the open costs nothing more.
        hold: bool,
    },
    /// link: a new name for an existing non-directory.
    Link {
        /// The inode.
        ino: Ino,
        /// Directory of the new name.
        parent: Ino,
        /// The new name.
        name: Vec<u8>,
    },
    /// unlink (`dir == false`) or rmdir (`dir == true`).
    Unlink {
        /// Directory holding the name.
        parent: Ino,
        /// The name.
        name: Vec<u8>,
        /// rmdir semantics (must be an empty directory).
        dir: bool,
        /// This node still has the file open (its open record exists): on the last link,
        /// keep the inode with an orphan record instead of deleting it, without reading the
        /// open records. Otherwise the inode's open records decide, every node's: read
        /// (and compared), or, when planning from `expect`, compared empty (a file open
        /// elsewhere fails that compare and the retry reads them).
        keep_open: bool,
        /// This node keeps an open record of the file only for an open that might follow
        /// (its opens here are all closed): the record is deleted in this transaction and
        /// does not count as an open, instead of a commit of its own first. The submitter
        /// keeps the file's first opens here waiting until this commits.
        drop_own_hold: bool,
        /// What the submitter's caches say the name and inodes hold. When given, the plan
        /// uses it instead of reading etcd and guards it with value compares, so an
        /// unlink commits in one round trip; a stale expectation fails its compares and
        /// the mutation is re-planned from what etcd holds (the expectation dropped).
        expect: Option<Box<UnlinkExpect>>,
    },
    /// rename/renameat2.
    Rename {
        /// Source directory.
        src_parent: Ino,
        /// Source name.
        src_name: Vec<u8>,
        /// Destination directory.
        dst_parent: Ino,
        /// Destination name.
        dst_name: Vec<u8>,
        /// Replace / NoReplace / Exchange.
        mode: RenameMode,
        /// A replaced destination is open on this node (see `Unlink::keep_open`). A
        /// rename reads the destination's open records anyway, so either way an inode
        /// open anywhere is kept.
        dst_keep_open: bool,
    },
    /// setattr.
    SetAttr {
        /// The inode.
        ino: Ino,
        /// Changes.
        set: SetAttr,
    },
    /// setxattr.
    SetXattr {
        /// The inode.
        ino: Ino,
        /// Attribute name.
        name: Vec<u8>,
        /// Value.
        value: Vec<u8>,
        /// Create/replace semantics.
        mode: XattrMode,
    },
    /// Set or remove a POSIX ACL (`system.posix_acl_access` / `_default`): the value is
    /// validated, an access ACL sets the mode's rwx bits and is stored only when the mode
    /// cannot say it (ext4's rules, `crate::acl`), and the inode's ACL flag bits follow,
    /// all in one transaction with the inode.
    SetAcl {
        /// The inode.
        ino: Ino,
        /// The default ACL (else the access ACL).
        default: bool,
        /// The xattr value; `None` removes it.
        value: Option<Vec<u8>>,
        /// Clear the set-group-id bit too (the setter is neither in the file's group nor
        /// privileged, as the kernel reports it).
        kill_sgid: bool,
    },
    /// removexattr.
    RemoveXattr {
        /// The inode.
        ino: Ino,
        /// Attribute name.
        name: Vec<u8>,
    },
    /// Replace the mapping of file bytes `[off, off + len)` with `extents` (empty for a
    /// hole punch; `unwritten` extents for fallocate; a written extent after the data is
    /// durable on the device). Optionally raise the size and set mtime/ctime.
    SetExtents {
        /// The inode.
        ino: Ino,
        /// Start of the replaced range.
        off: u64,
        /// Length of the replaced range.
        len: u64,
        /// New extents, sorted, inside the range, non-overlapping.
        extents: Vec<crate::codec::Extent>,
        /// Raise the file size to at least this.
        size_at_least: Option<u64>,
        /// Set mtime and ctime to now (a data write).
        touch_mtime: bool,
        /// Free maps (`F<group>`, opaque encoded bytes) of the groups the new extents were
        /// allocated from, written in the same transaction so an allocation is never
        /// committed without its free-map change (and vice versa). Each is fenced on this
        /// session owning the group.
        free_maps: Vec<(GroupId, Vec<u8>)>,
        /// What the submitter's record of its last commit says etcd holds. When given
        /// (and nothing was read yet), the plan uses it instead of reading the inode and
        /// its extents and guards it with value and emptiness compares, so an append's
        /// commit (fsync) costs one round trip instead of two; a stale expectation fails
        /// its compares and the mutation is re-planned from etcd (the expectation dropped).
        expect: Option<Box<ExtentsExpect>>,
    },
    /// Persist free maps of groups this session owns (after a commit freed blocks in
    /// them). Fenced on ownership like `SetExtents::free_maps`.
    FreeMaps {
        /// `(group, encoded map)`.
        maps: Vec<(GroupId, Vec<u8>)>,
        /// Device offsets of released records (`R`) these maps now include: deleted in the
        /// same transaction.
        released: Vec<u64>,
    },
    /// Log device ranges a commit freed without logging them (a truncate of a file with
    /// more extents than one transaction reads) as released records (`R`): the submitter
    /// does not own their groups, and their owners (or the groups' next loaders) fold them.
    /// At most [`LOG_RELEASED_MAX`] ranges.
    LogReleased {
        /// The ranges, each inside one allocation group.
        ranges: Vec<DevRange>,
    },
    /// Delete an orphan inode (its last open record went, or the unlink could not free it
    /// in one transaction). Does nothing while any node has it open (an `H` record).
    ReclaimOrphan {
        /// The inode.
        ino: Ino,
    },
    /// The first open of a regular file on this node: its open record `H<ino><session>`
    /// under the session's lease, while the inode exists (compared).
    Hold {
        /// The inode.
        ino: Ino,
    },
    /// The last close of a file on this node: deletes its open record; when the inode is
    /// an orphan that nobody else has open, reclaims it in the same transaction (a file
    /// with more extents than one transaction frees says `reclaim_more`, and the rest goes
    /// by `ReclaimOrphan`).
    Unhold {
        /// The inode.
        ino: Ino,
    },
    /// Write coalesced timestamps (never moves a time backwards).
    Touch {
        /// The inode.
        ino: Ino,
        /// New mtime, if it changed.
        mtime: Option<Timespec>,
        /// New ctime.
        ctime: Timespec,
        /// The inode as the submitter's caches hold it: planned from it, compared by
        /// value, instead of read (a stale guess is re-planned from etcd).
        expect: Option<Box<InodeAttr>>,
    },
    /// Reserve `count` inode numbers (the pipeline does this itself, 1024 at a time).
    ReserveInos {
        /// How many.
        count: u64,
    },
}

impl Mutation {
    /// Whether a read-only mount may commit it: open records only, which keep a file this
    /// node reads whole while another node unlinks it (a read-only node's last close of an
    /// orphan leaves its reclaim to a writable node: `plan_unhold`).
    pub fn allowed_read_only(&self) -> bool {
        matches!(self, Mutation::Hold { .. } | Mutation::Unhold { .. })
    }

    /// Whether the pipeline must assign a fresh inode number before planning.
    pub fn needs_ino(&self) -> bool {
        matches!(self, Mutation::Create { .. })
    }

    /// Drops what the submitter expected (after it proved stale, or made the plan too
    /// big for one transaction): the next plan reads. Whether there was an expectation.
    pub fn forget_expectation(&mut self) -> bool {
        match self {
            Mutation::Unlink { expect, .. } => expect.take().is_some(),
            Mutation::SetExtents { expect, .. } => expect.take().is_some(),
            Mutation::SetAttr { set, .. } => set.expect.take().is_some(),
            Mutation::Touch { expect, .. } => expect.take().is_some(),
            _ => false,
        }
    }

    /// Groups whose free map this mutation writes. Known before planning, so the
    /// pipeline can keep those writes in submission order even while an earlier one is
    /// still reading (an older map committed last would show blocks in use as free).
    pub fn free_map_groups(&self) -> impl Iterator<Item = GroupId> + '_ {
        let maps: &[(GroupId, Vec<u8>)] = match self {
            Mutation::SetExtents { free_maps, .. } => free_maps,
            Mutation::FreeMaps { maps, .. } => maps,
            _ => &[],
        };
        maps.iter().map(|(g, _)| *g)
    }

    /// Whether failing this mutation fences the node: a free-map write that also deletes
    /// released records (see `Committer::unsafe_maps`). Nobody but housekeeping waits on
    /// one, so a lost answer is decided for longer than an application's budget.
    pub fn fails_unsafe(&self) -> bool {
        matches!(self, Mutation::FreeMaps { released, .. } if !released.is_empty())
    }

    /// Short name for logs and stats.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Mutation::Create { .. } => "create",
            Mutation::Link { .. } => "link",
            Mutation::Unlink { dir: false, .. } => "unlink",
            Mutation::Unlink { dir: true, .. } => "rmdir",
            Mutation::Rename { .. } => "rename",
            Mutation::SetAttr { .. } => "setattr",
            Mutation::SetXattr { .. } => "setxattr",
            Mutation::RemoveXattr { .. } => "removexattr",
            Mutation::SetAcl { .. } => "set_acl",
            Mutation::SetExtents { .. } => "set_extents",
            Mutation::FreeMaps { .. } => "free_maps",
            Mutation::LogReleased { .. } => "log_released",
            Mutation::ReclaimOrphan { .. } => "reclaim_orphan",
            Mutation::Hold { .. } => "hold",
            Mutation::Unhold { .. } => "unhold",
            Mutation::Touch { .. } => "touch",
            Mutation::ReserveInos { .. } => "reserve_inos",
        }
    }
}

/// What a committed mutation did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// The etcd revision of the commit (0 for a mutation that changed nothing).
    pub revision: Revision,
    /// The inode the mutation was about (the new inode for Create).
    pub ino: Option<Ino>,
    /// The inode's attributes after the commit, if it still exists.
    pub attr: Option<InodeAttr>,
    /// An inode whose last link went away and that was deleted.
    pub removed: Option<Ino>,
    /// An inode whose last link went away and that was kept as an orphan.
    pub orphaned: Option<Ino>,
    /// Device ranges no longer referenced (return them to the allocator).
    pub freed: Vec<DevRange>,
    /// The part of `freed` logged as released records (`R<dev_off>`, one per range, each
    /// inside one group) in the same commit; the rest (a file with too many extents to
    /// read in one transaction) is only reported.
    pub released: Vec<DevRange>,
    /// ReclaimOrphan released one chunk of a large file's extents and kept the orphan:
    /// submit it again.
    pub reclaim_more: bool,
    /// Reserved inode numbers `[start, end)` (ReserveInos).
    pub inos: Option<(u64, u64)>,
    /// Timestamps this commit handed to the coalescer (written to etcd later): the inode,
    /// whether its mtime moves too (else only ctime), and the time that will be written
    /// (Touch never moves a time backwards). Lets the filesystem show them at once.
    pub touched: Vec<(Ino, bool, Timespec)>,
    /// SetExtents: the extent keys around the range as the commit left them.
    pub extents_known: Option<ExtentsKnown>,
    /// SetAttr that left the extents alone (no size): the inode's attributes it replaced,
    /// exactly as they were stored. A record of the file's extents kept with those
    /// attributes (`ExtentsKnown`) stays exact with the new ones.
    pub attr_before: Option<InodeAttr>,
}
