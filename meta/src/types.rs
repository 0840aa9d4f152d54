//! Identifier newtypes and small value types shared by every module.
//!
//! Each id says who allocates it, when it is recycled and what 0 means, because the
//! filesystem layer hands these numbers to the kernel and to other nodes.

use std::fmt;

/// An inode number.
///
/// Allocated by the pipeline from blocks reserved in etcd (`ino_next` counter, 1024 at a
/// time); never recycled, so a stale number can never alias a newer file. 0 is invalid;
/// 1 is the root directory (written by mkfs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ino(pub u64);

impl Ino {
    /// The root directory.
    pub const ROOT: Ino = Ino(1);
    /// The first number the allocator hands out; numbers below it are reserved for
    /// mkfs-created inodes (root, future lost+found, journal-like special files).
    pub const FIRST_DYNAMIC: u64 = 1024;
}

impl fmt::Display for Ino {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// An etcd revision (a key's mod/create revision or the store's header revision).
///
/// Assigned by etcd, strictly increasing across the cluster; 0 means "the key does not
/// exist" (for a key's revisions) or "latest" (for a read's revision argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Revision(pub i64);

/// An etcd lease id. Granted by etcd, never reused while alive; 0 means "no lease".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct LeaseId(pub i64);

/// A node session: one mounted daemon's lifetime, identified by its etcd lease id.
///
/// A restarted daemon gets a new lease and therefore a new session, which is exactly
/// what lets other nodes (and itself) reclaim the previous incarnation's orphans and
/// allocation groups once the old lease has expired. 0 is invalid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId(pub u64);

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// An allocation group number on the shared device (0-based, fixed at mkfs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupId(pub u32);

/// A wall-clock timestamp with nanoseconds, as stored in inode times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timespec {
    /// Seconds since the Unix epoch (may be negative).
    pub sec: i64,
    /// Nanoseconds, always `< 1_000_000_000`.
    pub nsec: u32,
}

impl Timespec {
    /// Builds a timestamp; `nsec` must be below one second.
    pub const fn new(sec: i64, nsec: u32) -> Self {
        Timespec { sec, nsec }
    }

    /// Whether the nanosecond field is in range.
    pub const fn is_valid(&self) -> bool {
        self.nsec < 1_000_000_000
    }
}

/// The type of an inode, matching the POSIX `S_IFMT` classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileType {
    /// Regular file.
    Regular,
    /// Directory.
    Directory,
    /// Symbolic link.
    Symlink,
    /// Character device.
    CharDev,
    /// Block device.
    BlockDev,
    /// Named pipe.
    Fifo,
    /// Unix domain socket.
    Socket,
}

impl FileType {
    /// The on-disk code (also the dentry type byte). Stable: part of the format.
    pub const fn code(self) -> u8 {
        match self {
            FileType::Regular => 1,
            FileType::Directory => 2,
            FileType::Symlink => 3,
            FileType::CharDev => 4,
            FileType::BlockDev => 5,
            FileType::Fifo => 6,
            FileType::Socket => 7,
        }
    }

    /// Decodes [`FileType::code`]; `None` for unknown codes.
    pub const fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => FileType::Regular,
            2 => FileType::Directory,
            3 => FileType::Symlink,
            4 => FileType::CharDev,
            5 => FileType::BlockDev,
            6 => FileType::Fifo,
            7 => FileType::Socket,
            _ => return None,
        })
    }

    /// The POSIX `S_IFMT` bits for this type.
    pub const fn s_ifmt(self) -> u32 {
        match self {
            FileType::Regular => 0o100000,
            FileType::Directory => 0o040000,
            FileType::Symlink => 0o120000,
            FileType::CharDev => 0o020000,
            FileType::BlockDev => 0o060000,
            FileType::Fifo => 0o010000,
            FileType::Socket => 0o140000,
        }
    }
}

/// Longest name a directory entry may have (bytes), as POSIX `NAME_MAX`.
pub const NAME_LEN_MAX: usize = 255;
/// Longest symlink target (bytes), as Linux `PATH_MAX`.
pub const SYMLINK_LEN_MAX: usize = 4096;
/// Longest xattr name (bytes), as Linux `XATTR_NAME_MAX`.
pub const XATTR_NAME_LEN_MAX: usize = 255;
/// Largest xattr value (bytes), as Linux `XATTR_SIZE_MAX`.
pub const XATTR_VALUE_LEN_MAX: usize = 65536;

/// `perm` with set-user-id cleared, and set-group-id when group-execute is set: what a
/// chown, or a write or truncate by someone else than the owner, leaves (the kernel's rule;
/// set-group-id without group-execute marks mandatory locking and stays).
pub fn kill_suidgid(perm: u16) -> u16 {
    let sgid = if perm & 0o010 != 0 { 0o2000 } else { 0 };
    perm & !(0o4000 | sgid)
}

/// Whether `name` is a legal single path component for a directory entry.
pub fn name_is_valid(name: &[u8]) -> bool {
    !name.is_empty()
        && name.len() <= NAME_LEN_MAX
        && name != b"."
        && name != b".."
        && !name.iter().any(|&b| b == b'/' || b == 0)
}
