//! Versioned binary value codec.
//!
//! Every value starts with a format version byte (1 for every record but the node record,
//! whose format 2 added the daemon's version; format 1 node records still decode), then
//! fixed-width little-endian fields; variable-length tails (names, targets) come last
//! with an explicit length. Decoding never panics: any short, long or out-of-range value
//! is a [`CodecError`], which the callers turn into [`MetaError::Corrupt`] naming the key.
//!
//! Pair assertions: [`Record::encode`] asserts [`Record::validate`] (we must never make a
//! bad record durable in etcd), and [`Record::decode`] runs the same validation on what
//! it read (a value that decodes but breaks an invariant is corruption too).
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

use crate::{
    error::MetaError,
    types::{
        FileType, Ino, SessionId, Timespec, NAME_LEN_MAX, SYMLINK_LEN_MAX, XATTR_VALUE_LEN_MAX,
    },
};

/// The value format version written today (by every record but [`NodeRecord`]).
pub const VERSION: u8 = 1;

/// The format [`NodeRecord`] writes: format 1 plus the daemon's version.
pub const NODE_FORMAT: u8 = 2;

/// The etcfs release that writes node records: the workspace shares one version, so this
/// is the daemon's version too.
pub const DAEMON_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Longest daemon version string a node record holds.
pub const DAEMON_VERSION_LEN_MAX: usize = 64;

/// Why a value failed to decode or validate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {reason}")]
pub struct CodecError {
    /// Record type.
    pub what: &'static str,
    /// What was wrong.
    pub reason: &'static str,
}

impl CodecError {
    /// Attaches the key (already rendered for humans) to make a [`MetaError::Corrupt`].
    pub fn at(self, key: String) -> MetaError {
        MetaError::Corrupt {
            key,
            reason: self.to_string(),
        }
    }
}

/// A value stored in etcd.
pub trait Record: Sized {
    /// Record name for errors.
    const WHAT: &'static str;
    /// Checks the record's invariants.
    fn validate(&self) -> Result<(), &'static str>;
    /// Writes the fields (after the version byte).
    fn write(&self, w: &mut Vec<u8>);
    /// Reads the fields (after the version byte).
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str>;

    /// The format version [`Record::encode`] writes.
    const FORMAT: u8 = VERSION;

    /// Reads the fields of a value of format `format` (after the version byte). By
    /// default only [`Record::FORMAT`] is known; a record whose format changed reads its
    /// older formats here.
    fn read_format(r: &mut Reader<'_>, format: u8) -> Result<Self, &'static str> {
        if format == Self::FORMAT {
            Self::read(r)
        } else {
            Err("unsupported format version")
        }
    }

    /// Encodes the record. Panics if it violates its invariants: callers validate user
    /// input first, so a failure here is a bug, and committing it would be permanent.
    fn encode(&self) -> Vec<u8> {
        let valid = self.validate();
        assert!(
            valid.is_ok(),
            "encoding invalid {}: {:?}",
            Self::WHAT,
            valid
        );
        let mut w = Vec::with_capacity(64);
        w.push(Self::FORMAT);
        self.write(&mut w);
        w
    }

    /// Decodes and validates a value.
    fn decode(bytes: &[u8]) -> Result<Self, CodecError> {
        let err = |reason| CodecError {
            what: Self::WHAT,
            reason,
        };
        let mut r = Reader { buf: bytes };
        let format = r.u8().map_err(err)?;
        let rec = Self::read_format(&mut r, format).map_err(err)?;
        if !r.buf.is_empty() {
            return Err(err("trailing bytes"));
        }
        rec.validate().map_err(err)?;
        Ok(rec)
    }
}

/// A bounds-checked little-endian cursor.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], &'static str> {
        let (head, tail) = self.buf.split_first_chunk::<N>().ok_or("value too short")?;
        self.buf = tail;
        Ok(*head)
    }
    /// Reads one byte.
    pub fn u8(&mut self) -> Result<u8, &'static str> {
        Ok(self.take::<1>()?[0])
    }
    /// Reads a u16.
    pub fn u16(&mut self) -> Result<u16, &'static str> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    /// Reads a u32.
    pub fn u32(&mut self) -> Result<u32, &'static str> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    /// Reads a u64.
    pub fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    /// Reads an i64.
    pub fn i64(&mut self) -> Result<i64, &'static str> {
        Ok(i64::from_le_bytes(self.take()?))
    }
    /// Reads a timestamp.
    pub fn time(&mut self) -> Result<Timespec, &'static str> {
        Ok(Timespec {
            sec: self.i64()?,
            nsec: self.u32()?,
        })
    }
    /// Reads a u32-length-prefixed byte string of at most `max` bytes.
    pub fn bytes(&mut self, max: usize) -> Result<Vec<u8>, &'static str> {
        let n = usize::try_from(self.u32()?).map_err(|_| "length overflow")?;
        if n > max {
            return Err("length over limit");
        }
        let (head, tail) = self.buf.split_at_checked(n).ok_or("value too short")?;
        self.buf = tail;
        Ok(head.to_vec())
    }
}

fn put_time(w: &mut Vec<u8>, t: Timespec) {
    w.extend_from_slice(&t.sec.to_le_bytes());
    w.extend_from_slice(&t.nsec.to_le_bytes());
}

fn put_bytes(w: &mut Vec<u8>, b: &[u8]) {
    let n = u32::try_from(b.len()).expect("lengths are validated far below u32::MAX");
    w.extend_from_slice(&n.to_le_bytes());
    w.extend_from_slice(b);
}

/// The filesystem's identity and geometry (`S`), matching the device superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuperRecord {
    /// Filesystem UUID (also in the device superblock; mount checks they agree).
    pub uuid: [u8; 16],
    /// On-device format version.
    pub format_version: u32,
    /// Block size in bytes (a power of two, 512..=65536).
    pub block_size: u32,
    /// Allocation-group size in bytes (a multiple of the block size).
    pub group_size: u64,
    /// Number of allocation groups.
    pub group_count: u32,
    /// Device size in bytes at mkfs.
    pub device_size: u64,
    /// When mkfs ran.
    pub created: Timespec,
}

impl Record for SuperRecord {
    const WHAT: &'static str = "superblock";
    fn validate(&self) -> Result<(), &'static str> {
        if !self.block_size.is_power_of_two() || !(512..=65536).contains(&self.block_size) {
            return Err("bad block size");
        }
        if self.group_size == 0 || !self.group_size.is_multiple_of(u64::from(self.block_size)) {
            return Err("bad group size");
        }
        if self.group_count == 0 {
            return Err("no groups");
        }
        if !self.created.is_valid() {
            return Err("bad timestamp");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.uuid);
        w.extend_from_slice(&self.format_version.to_le_bytes());
        w.extend_from_slice(&self.block_size.to_le_bytes());
        w.extend_from_slice(&self.group_size.to_le_bytes());
        w.extend_from_slice(&self.group_count.to_le_bytes());
        w.extend_from_slice(&self.device_size.to_le_bytes());
        put_time(w, self.created);
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Ok(SuperRecord {
            uuid: r.take()?,
            format_version: r.u32()?,
            block_size: r.u32()?,
            group_size: r.u64()?,
            group_count: r.u32()?,
            device_size: r.u64()?,
            created: r.time()?,
        })
    }
}

/// The inode-number counter (`C`): the next number no session has reserved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InoCounter {
    /// First unreserved inode number.
    pub next: u64,
}

impl Record for InoCounter {
    const WHAT: &'static str = "ino counter";
    fn validate(&self) -> Result<(), &'static str> {
        if self.next < Ino::FIRST_DYNAMIC {
            return Err("counter below the dynamic range");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.next.to_le_bytes());
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Ok(InoCounter { next: r.u64()? })
    }
}

/// A freed device range not yet in its group's free map (`R<dev_off>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    /// Length in bytes.
    pub len: u64,
}

impl Record for Released {
    const WHAT: &'static str = "released range";
    fn validate(&self) -> Result<(), &'static str> {
        if self.len == 0 {
            return Err("empty released range");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.len.to_le_bytes());
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Ok(Released { len: r.u64()? })
    }
}

/// An inode's attributes (`I<ino>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InodeAttr {
    /// The inode's own number (redundant with the key; checked on read).
    pub ino: Ino,
    /// File type.
    pub kind: FileType,
    /// Permission bits (`mode & 0o7777`).
    pub perm: u16,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Size in bytes.
    pub size: u64,
    /// Hard link count (0 only while an orphan record keeps the inode).
    pub nlink: u32,
    /// Last access.
    pub atime: Timespec,
    /// Last data change.
    pub mtime: Timespec,
    /// Last status change.
    pub ctime: Timespec,
    /// Creation.
    pub crtime: Timespec,
    /// Device number for char/block devices, else 0.
    pub rdev: u64,
    /// Generation (paired with the ino in NFS-style handles).
    pub generation: u64,
    /// Inode flags (chattr-style; opaque to meta).
    pub flags: u32,
}

/// `InodeAttr::flags` bit: the inode has no extended attribute besides the ACLs its
/// [`crate::acl::FLAGS`] bits name, so a GETXATTR or LISTXATTR is answered without etcd.
/// New inodes get it; their first setxattr clears it for good. Inodes made before the bit
/// existed lack it and are asked of etcd.
pub const FLAG_NO_XATTRS: u32 = 1 << 2;
/// The flag bits meta keeps itself: a SetAttr's flags never change them.
pub const FLAGS_META: u32 = crate::acl::FLAGS | FLAG_NO_XATTRS;

impl InodeAttr {
    /// The full POSIX mode (type bits | permission bits).
    pub fn mode(&self) -> u32 {
        self.kind.s_ifmt() | u32::from(self.perm)
    }
}

impl Record for InodeAttr {
    const WHAT: &'static str = "inode";
    fn validate(&self) -> Result<(), &'static str> {
        if self.ino.0 == 0 {
            return Err("inode number 0");
        }
        if self.perm > 0o7777 {
            return Err("permission bits out of range");
        }
        for t in [self.atime, self.mtime, self.ctime, self.crtime] {
            if !t.is_valid() {
                return Err("nanoseconds out of range");
            }
        }
        if self.kind == FileType::Directory && self.nlink == 1 {
            return Err("directory with nlink 1");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.ino.0.to_le_bytes());
        w.push(self.kind.code());
        w.extend_from_slice(&self.perm.to_le_bytes());
        w.extend_from_slice(&self.uid.to_le_bytes());
        w.extend_from_slice(&self.gid.to_le_bytes());
        w.extend_from_slice(&self.size.to_le_bytes());
        w.extend_from_slice(&self.nlink.to_le_bytes());
        for t in [self.atime, self.mtime, self.ctime, self.crtime] {
            put_time(w, t);
        }
        w.extend_from_slice(&self.rdev.to_le_bytes());
        w.extend_from_slice(&self.generation.to_le_bytes());
        w.extend_from_slice(&self.flags.to_le_bytes());
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Ok(InodeAttr {
            ino: Ino(r.u64()?),
            kind: FileType::from_code(r.u8()?).ok_or("unknown file type")?,
            perm: r.u16()?,
            uid: r.u32()?,
            gid: r.u32()?,
            size: r.u64()?,
            nlink: r.u32()?,
            atime: r.time()?,
            mtime: r.time()?,
            ctime: r.time()?,
            crtime: r.time()?,
            rdev: r.u64()?,
            generation: r.u64()?,
            flags: r.u32()?,
        })
    }
}

/// A directory entry's value (`D<parent><name>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dentry {
    /// The child inode.
    pub ino: Ino,
    /// The child's type (so readdir needs no inode reads).
    pub kind: FileType,
}

impl Record for Dentry {
    const WHAT: &'static str = "dentry";
    fn validate(&self) -> Result<(), &'static str> {
        if self.ino.0 == 0 {
            return Err("inode number 0");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.ino.0.to_le_bytes());
        w.push(self.kind.code());
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Ok(Dentry {
            ino: Ino(r.u64()?),
            kind: FileType::from_code(r.u8()?).ok_or("unknown file type")?,
        })
    }
}

/// A directory's parent (`P<dir>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirParent {
    /// The parent directory (the root is its own parent).
    pub parent: Ino,
}

impl Record for DirParent {
    const WHAT: &'static str = "dir parent";
    fn validate(&self) -> Result<(), &'static str> {
        if self.parent.0 == 0 {
            return Err("inode number 0");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.parent.0.to_le_bytes());
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Ok(DirParent {
            parent: Ino(r.u64()?),
        })
    }
}

/// A symlink target (`L<ino>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymlinkTarget(pub Vec<u8>);

impl Record for SymlinkTarget {
    const WHAT: &'static str = "symlink";
    fn validate(&self) -> Result<(), &'static str> {
        if self.0.is_empty() || self.0.len() > SYMLINK_LEN_MAX {
            return Err("target length out of range");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        put_bytes(w, &self.0);
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Ok(SymlinkTarget(r.bytes(SYMLINK_LEN_MAX)?))
    }
}

/// An extended attribute's value (`X<ino><name>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XattrValue(pub Vec<u8>);

impl Record for XattrValue {
    const WHAT: &'static str = "xattr";
    fn validate(&self) -> Result<(), &'static str> {
        if self.0.len() > XATTR_VALUE_LEN_MAX {
            return Err("value too long");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        put_bytes(w, &self.0);
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Ok(XattrValue(r.bytes(XATTR_VALUE_LEN_MAX)?))
    }
}

/// One extent: file bytes `[file_off, file_off + len)` live at device bytes
/// `[dev_off, dev_off + len)`. Stored at `E<ino><file_off>`; the value holds the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Extent {
    /// File offset in bytes (from the key).
    pub file_off: u64,
    /// Length in bytes, > 0.
    pub len: u64,
    /// Device offset in bytes.
    pub dev_off: u64,
    /// Allocated but never written: reads return zeros (fallocate, or a write whose
    /// data is not yet durable).
    pub unwritten: bool,
}

impl Extent {
    /// First file offset after the extent.
    pub fn file_end(&self) -> u64 {
        self.file_off.saturating_add(self.len)
    }

    /// Checks the invariants of an extent, including its file offset.
    pub fn check(&self) -> Result<(), &'static str> {
        if self.len == 0 {
            return Err("empty extent");
        }
        if self.file_off.checked_add(self.len).is_none() {
            return Err("file range overflows");
        }
        if self.dev_off.checked_add(self.len).is_none() {
            return Err("device range overflows");
        }
        Ok(())
    }

    /// Encodes the value part (everything but `file_off`).
    pub fn encode_value(&self) -> Vec<u8> {
        ExtentValue {
            len: self.len,
            dev_off: self.dev_off,
            unwritten: self.unwritten,
        }
        .encode()
    }

    /// Decodes the value stored at the extent key for `file_off`.
    pub fn decode_value(file_off: u64, bytes: &[u8]) -> Result<Extent, CodecError> {
        let v = ExtentValue::decode(bytes)?;
        let e = Extent {
            file_off,
            len: v.len,
            dev_off: v.dev_off,
            unwritten: v.unwritten,
        };
        e.check().map_err(|reason| CodecError {
            what: ExtentValue::WHAT,
            reason,
        })?;
        Ok(e)
    }
}

/// The stored part of an [`Extent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtentValue {
    /// Length in bytes.
    pub len: u64,
    /// Device offset in bytes.
    pub dev_off: u64,
    /// See [`Extent::unwritten`].
    pub unwritten: bool,
}

const EXTENT_FLAG_UNWRITTEN: u8 = 1;

impl Record for ExtentValue {
    const WHAT: &'static str = "extent";
    fn validate(&self) -> Result<(), &'static str> {
        if self.len == 0 {
            return Err("empty extent");
        }
        if self.dev_off.checked_add(self.len).is_none() {
            return Err("device range overflows");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.len.to_le_bytes());
        w.extend_from_slice(&self.dev_off.to_le_bytes());
        w.push(if self.unwritten {
            EXTENT_FLAG_UNWRITTEN
        } else {
            0
        });
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        let len = r.u64()?;
        let dev_off = r.u64()?;
        let flags = r.u8()?;
        if flags & !EXTENT_FLAG_UNWRITTEN != 0 {
            return Err("unknown extent flags");
        }
        Ok(ExtentValue {
            len,
            dev_off,
            unwritten: flags & EXTENT_FLAG_UNWRITTEN != 0,
        })
    }
}

/// A live node's membership record (`M<session>`, attached to the session's lease).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRecord {
    /// Operator-facing node name (hostname or `--node-name`).
    pub name: Vec<u8>,
    /// Process id of the daemon.
    pub pid: u32,
    /// When the session started.
    pub started: Timespec,
}

/// Writes [`NODE_FORMAT`] with [`DAEMON_VERSION`]; reads formats 1 and 2 ([`NodeInfo`]
/// has the version it read).
impl Record for NodeRecord {
    const WHAT: &'static str = "node";
    const FORMAT: u8 = NODE_FORMAT;
    fn validate(&self) -> Result<(), &'static str> {
        if self.name.is_empty() || self.name.len() > NAME_LEN_MAX {
            return Err("node name length out of range");
        }
        if !self.started.is_valid() {
            return Err("bad timestamp");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.pid.to_le_bytes());
        put_time(w, self.started);
        put_bytes(w, &self.name);
        put_bytes(w, DAEMON_VERSION.as_bytes());
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Self::read_format(r, NODE_FORMAT)
    }
    fn read_format(r: &mut Reader<'_>, format: u8) -> Result<Self, &'static str> {
        Ok(NodeInfo::read_format(r, format)?.record)
    }
}

/// A node record with the version of the daemon that wrote it, for `etcfs status`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// The record.
    pub record: NodeRecord,
    /// The daemon's version (`None` in a format 1 record, which predates it).
    pub version: Option<String>,
}

impl Record for NodeInfo {
    const WHAT: &'static str = "node";
    const FORMAT: u8 = NODE_FORMAT;
    fn validate(&self) -> Result<(), &'static str> {
        self.record.validate()?;
        match &self.version {
            Some(v) if v.is_empty() || v.len() > DAEMON_VERSION_LEN_MAX => {
                Err("daemon version length out of range")
            }
            _ => Ok(()),
        }
    }
    /// Always format 2: a record without a version is given this build's.
    fn write(&self, w: &mut Vec<u8>) {
        let rec = &self.record;
        w.extend_from_slice(&rec.pid.to_le_bytes());
        put_time(w, rec.started);
        put_bytes(w, &rec.name);
        put_bytes(
            w,
            self.version.as_deref().unwrap_or(DAEMON_VERSION).as_bytes(),
        );
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Self::read_format(r, NODE_FORMAT)
    }
    fn read_format(r: &mut Reader<'_>, format: u8) -> Result<Self, &'static str> {
        if format != VERSION && format != NODE_FORMAT {
            return Err("unsupported format version");
        }
        let pid = r.u32()?;
        let started = r.time()?;
        let record = NodeRecord {
            pid,
            started,
            name: r.bytes(NAME_LEN_MAX)?,
        };
        let version = if format == NODE_FORMAT {
            let v = r.bytes(DAEMON_VERSION_LEN_MAX)?;
            Some(String::from_utf8(v).map_err(|_| "daemon version is not UTF-8")?)
        } else {
            None
        };
        Ok(NodeInfo { record, version })
    }
}

/// Which session owns something (`G<group>` and `O<ino>` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    /// The owning session.
    pub session: SessionId,
}

impl Record for Owner {
    const WHAT: &'static str = "owner";
    fn validate(&self) -> Result<(), &'static str> {
        if self.session.0 == 0 {
            return Err("session 0");
        }
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.session.0.to_le_bytes());
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        Ok(Owner {
            session: SessionId(r.u64()?),
        })
    }
}

/// One held lock (`B` keys; the holder and the first byte are in the key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockRecord {
    /// Exclusive (F_WRLCK, LOCK_EX) rather than shared (F_RDLCK, LOCK_SH).
    pub write: bool,
    /// Last locked byte, inclusive (`u64::MAX`: to the end of any file).
    pub end: u64,
    /// The holding process on its node, for F_GETLK.
    pub pid: u32,
}

impl Record for LockRecord {
    const WHAT: &'static str = "lock";
    fn validate(&self) -> Result<(), &'static str> {
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.push(u8::from(self.write));
        w.extend_from_slice(&self.end.to_le_bytes());
        w.extend_from_slice(&self.pid.to_le_bytes());
    }
    fn read(r: &mut Reader<'_>) -> Result<Self, &'static str> {
        let write = match r.u8()? {
            0 => false,
            1 => true,
            _ => return Err("unknown lock kind"),
        };
        Ok(LockRecord {
            write,
            end: r.u64()?,
            pid: r.u32()?,
        })
    }
}

/// Decodes `bytes` stored at `key`, naming the key on failure.
pub fn decode_at<R: Record>(
    keys: &crate::keys::Keyspace,
    key: &[u8],
    bytes: &[u8],
) -> Result<R, MetaError> {
    R::decode(bytes).map_err(|e| e.at(keys.describe(key)))
}

#[cfg(test)]
#[allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]
mod tests {
    use rand::{rngs::SmallRng, Rng, SeedableRng};

    use super::*;

    pub(crate) fn sample_inode() -> InodeAttr {
        InodeAttr {
            ino: Ino(1025),
            kind: FileType::Regular,
            perm: 0o644,
            uid: 1000,
            gid: 100,
            size: 12345,
            nlink: 1,
            atime: Timespec::new(1, 2),
            mtime: Timespec::new(3, 4),
            ctime: Timespec::new(-5, 999_999_999),
            crtime: Timespec::new(7, 8),
            rdev: 0,
            generation: 1,
            flags: 0,
        }
    }

    fn round_trip<R: Record + PartialEq + std::fmt::Debug>(r: R) {
        let bytes = r.encode();
        assert_eq!(bytes[0], R::FORMAT);
        assert_eq!(R::decode(&bytes).unwrap(), r);
        // Every truncation and every extension must be an error, never a panic.
        for n in 0..bytes.len() {
            assert!(
                R::decode(&bytes[..n]).is_err(),
                "{} truncated at {n}",
                R::WHAT
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(R::decode(&long).is_err());
        // A format this build never wrote is refused.
        let mut future = bytes;
        future[0] = NODE_FORMAT + 1;
        assert!(R::decode(&future).is_err());
    }

    #[test]
    fn round_trips() {
        round_trip(sample_inode());
        round_trip(Dentry {
            ino: Ino(9),
            kind: FileType::Directory,
        });
        round_trip(DirParent { parent: Ino(1) });
        round_trip(SymlinkTarget(b"../x".to_vec()));
        round_trip(XattrValue(vec![]));
        round_trip(InoCounter { next: 2048 });
        round_trip(Released { len: 4096 });
        round_trip(ExtentValue {
            len: 4096,
            dev_off: 8192,
            unwritten: true,
        });
        round_trip(NodeRecord {
            name: b"node-a".to_vec(),
            pid: 7,
            started: Timespec::new(1, 0),
        });
        round_trip(Owner {
            session: SessionId(77),
        });
        round_trip(LockRecord {
            write: true,
            end: u64::MAX,
            pid: 4242,
        });
        let mut bad_kind = LockRecord {
            write: false,
            end: 9,
            pid: 1,
        }
        .encode();
        bad_kind[1] = 2;
        assert!(LockRecord::decode(&bad_kind).is_err());
        round_trip(SuperRecord {
            uuid: [7; 16],
            format_version: 1,
            block_size: 4096,
            group_size: 1 << 30,
            group_count: 4,
            device_size: 4 << 30,
            created: Timespec::new(1, 0),
        });
    }

    #[test]
    fn node_records_of_both_formats() {
        // Format 1 (written before the daemon version): pid 7, started 1 s, name "ab".
        let v1: Vec<u8> = [
            &[1u8][..],
            &7u32.to_le_bytes(),
            &1i64.to_le_bytes(),
            &0u32.to_le_bytes(),
            &2u32.to_le_bytes(),
            b"ab",
        ]
        .concat();
        let rec = NodeRecord {
            name: b"ab".to_vec(),
            pid: 7,
            started: Timespec::new(1, 0),
        };
        assert_eq!(NodeRecord::decode(&v1), Ok(rec.clone()));
        let info = NodeInfo::decode(&v1).expect("format 1 decodes");
        assert_eq!(info.record, rec);
        assert_eq!(info.version, None);
        // Format 2 adds the version after the name.
        let v2: Vec<u8> = [&[2u8][..], &v1[1..], &5u32.to_le_bytes(), b"0.9.1"].concat();
        assert_eq!(NodeRecord::decode(&v2), Ok(rec.clone()));
        let info = NodeInfo::decode(&v2).expect("format 2 decodes");
        assert_eq!(info.version.as_deref(), Some("0.9.1"));
        // What the daemon writes today is format 2 with this build's version.
        let written = rec.encode();
        assert_eq!(written[0], NODE_FORMAT);
        assert_eq!(
            NodeInfo::decode(&written).map(|i| i.version),
            Ok(Some(DAEMON_VERSION.to_owned()))
        );
        // A format 2 body under format 1 has trailing bytes; format 1 under 2 is short;
        // an unknown format is refused.
        assert!(NodeRecord::decode(&[&[1u8][..], &v2[1..]].concat()).is_err());
        assert!(NodeRecord::decode(&[&[2u8][..], &v1[1..]].concat()).is_err());
        assert!(NodeRecord::decode(&[&[3u8][..], &v2[1..]].concat()).is_err());
        let mut bad_utf8 = v2.clone();
        let last = bad_utf8.len() - 1;
        bad_utf8[last] = 0xff;
        assert!(NodeInfo::decode(&bad_utf8).is_err());
        round_trip(NodeInfo {
            record: rec,
            version: Some("1.2.3".into()),
        });
    }

    #[test]
    fn inode_is_compact() {
        assert_eq!(sample_inode().encode().len(), 100);
    }

    #[test]
    fn decode_validates() {
        let mut bytes = sample_inode().encode();
        // perm field sits after version(1) + ino(8) + kind(1).
        bytes[10] = 0xff;
        bytes[11] = 0xff;
        let err = InodeAttr::decode(&bytes).unwrap_err();
        assert_eq!(err.reason, "permission bits out of range");
        let mut bytes = sample_inode().encode();
        bytes[9] = 99;
        assert_eq!(
            InodeAttr::decode(&bytes).unwrap_err().reason,
            "unknown file type"
        );
        let bad_len = [VERSION, 0xff, 0xff, 0xff, 0xff];
        assert!(SymlinkTarget::decode(&bad_len).is_err());
        assert!(Extent::decode_value(
            u64::MAX,
            &ExtentValue {
                len: 2,
                dev_off: 0,
                unwritten: false
            }
            .encode()
        )
        .is_err());
    }

    #[test]
    fn corrupt_names_the_key() {
        let keys = crate::keys::Keyspace::new("fs").unwrap();
        let key = keys.inode(Ino(42));
        let err = decode_at::<InodeAttr>(&keys, &key, b"\x01garbage").unwrap_err();
        match err {
            MetaError::Corrupt { key, .. } => assert_eq!(key, "fs/I 42"),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Seeded fuzz smoke: random bytes never panic any decoder.
    #[test]
    fn random_bytes_never_panic() {
        let mut rng = SmallRng::seed_from_u64(0x5eed);
        for _ in 0..20_000 {
            let n = rng.gen_range(0..128);
            let mut b: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            if rng.gen_bool(0.7) && !b.is_empty() {
                b[0] = if rng.gen_bool(0.5) {
                    VERSION
                } else {
                    NODE_FORMAT
                };
            }
            let _ = InodeAttr::decode(&b);
            let _ = Dentry::decode(&b);
            let _ = SymlinkTarget::decode(&b);
            let _ = XattrValue::decode(&b);
            let _ = NodeRecord::decode(&b);
            let _ = NodeInfo::decode(&b);
            let _ = SuperRecord::decode(&b);
            let _ = Extent::decode_value(rng.gen(), &b);
            let _ = Owner::decode(&b);
            let _ = LockRecord::decode(&b);
            let _ = InoCounter::decode(&b);
            let _ = DirParent::decode(&b);
        }
    }
}
