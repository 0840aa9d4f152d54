//! Wire structs and constants of the FUSE kernel protocol, version 7.45 (Linux 6.18).
//!
//! Every struct is `#[repr(C)]`, made only of fixed-width integers with explicit padding,
//! and derives the zerocopy traits, so reading one from untrusted bytes is a checked copy
//! and writing one is `as_bytes()`. Each size is asserted at compile time against the
//! kernel's layout. All integers are native-endian: the kernel and the daemon share a host.
//!
//! Names follow the kernel's (`fuse_in_header` is [`InHeader`], `FUSE_ASYNC_READ` keeps its
//! name) so that a grep for a kernel identifier finds its counterpart here.

#![forbid(unsafe_code)]
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

/// The zerocopy traits the wire structs implement, re-exported so users of these structs
/// (`as_bytes()`, `read_from_bytes()`) need no zerocopy dependency of their own.
pub use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout};

/// Protocol major version; the kernel and every daemon have spoken 7 since 2006.
pub const FUSE_KERNEL_VERSION: u32 = 7;
/// The newest minor version this crate knows the layouts of.
pub const FUSE_KERNEL_MINOR_VERSION: u32 = 45;
/// The oldest minor version the daemon accepts at INIT (see `init::negotiate`).
pub const FUSE_MIN_MINOR_VERSION: u32 = 31;
/// Node id of the mount's root directory.
pub const FUSE_ROOT_ID: u64 = 1;
/// The kernel refuses `/dev/fuse` reads into buffers smaller than this.
pub const FUSE_MIN_READ_BUFFER: usize = 8192;
/// Set in `InHeader::unique` of a request the kernel resent after `FUSE_NOTIFY_RESEND`.
pub const FUSE_UNIQUE_RESEND: u64 = 1 << 63;
/// Longest name (bytes, without NUL) the filesystems here accept; longer names get
/// ENAMETOOLONG. The kernel itself lets FUSE names reach 1024 bytes.
pub const NAME_MAX: usize = 255;
/// Page size the kernel uses to size requests (`max_pages * PAGE_SIZE`) on x86-64/arm64.
pub const PAGE_SIZE: usize = 4096;

/// Declares wire structs: `#[repr(C)]`, the zerocopy derives, and a size assertion.
macro_rules! wire {
    ($(
        $(#[$meta:meta])*
        pub struct $name:ident ($size:literal) {
            $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty ),* $(,)?
        }
    )*) => {$(
        $(#[$meta])*
        #[repr(C)]
        #[derive(
            Debug, Clone, Copy, Default, PartialEq, Eq,
            FromBytes, IntoBytes, Immutable, KnownLayout,
        )]
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )*
        }
        const _: () = assert!(size_of::<$name>() == $size);
    )*};
}

wire! {
    /// Precedes every request (`fuse_in_header`).
    pub struct InHeader (40) {
        /// Bytes in the whole request, this header included.
        pub len: u32,
        pub opcode: u32,
        /// Request id; the reply echoes it. Notifications use 0.
        pub unique: u64,
        /// The inode the request is about (the parent directory for name operations).
        pub nodeid: u64,
        pub uid: u32,
        pub gid: u32,
        pub pid: u32,
        /// Bytes of request extensions at the end of the request, in units of 8.
        pub total_extlen: u16,
        pub padding: u16,
    }

    /// Precedes every reply and notification (`fuse_out_header`).
    pub struct OutHeader (16) {
        /// Bytes in the whole reply, this header included.
        pub len: u32,
        /// 0, a negative errno, or (with `unique == 0`) a notification code.
        pub error: i32,
        pub unique: u64,
    }

    /// Inode attributes (`fuse_attr`).
    pub struct Attr (88) {
        pub ino: u64,
        pub size: u64,
        /// In 512-byte units.
        pub blocks: u64,
        pub atime: u64,
        pub mtime: u64,
        pub ctime: u64,
        pub atimensec: u32,
        pub mtimensec: u32,
        pub ctimensec: u32,
        /// File type and permission bits, as in `st_mode`.
        pub mode: u32,
        pub nlink: u32,
        pub uid: u32,
        pub gid: u32,
        pub rdev: u32,
        pub blksize: u32,
        /// `FUSE_ATTR_*`.
        pub flags: u32,
    }

    /// Filesystem statistics (`fuse_kstatfs`).
    pub struct Kstatfs (80) {
        pub blocks: u64,
        pub bfree: u64,
        pub bavail: u64,
        pub files: u64,
        pub ffree: u64,
        pub bsize: u32,
        pub namelen: u32,
        pub frsize: u32,
        pub padding: u32,
        pub spare: [u32; 6],
    }

    /// A POSIX lock range (`fuse_file_lock`).
    pub struct FileLock (24) {
        pub start: u64,
        pub end: u64,
        /// `F_RDLCK`, `F_WRLCK` or `F_UNLCK`.
        pub typ: u32,
        pub pid: u32,
    }

    /// Reply to LOOKUP, MKNOD, MKDIR, SYMLINK, LINK (and the first half of CREATE).
    pub struct EntryOut (128) {
        /// 0 in a LOOKUP reply means "absent, cache that for `entry_valid`".
        pub nodeid: u64,
        /// `(nodeid, generation)` must be unique over the filesystem's lifetime.
        pub generation: u64,
        pub entry_valid: u64,
        pub attr_valid: u64,
        pub entry_valid_nsec: u32,
        pub attr_valid_nsec: u32,
        pub attr: Attr,
    }

    /// FORGET argument.
    pub struct ForgetIn (8) {
        pub nlookup: u64,
    }

    /// One element of a BATCH_FORGET.
    pub struct ForgetOne (16) {
        pub nodeid: u64,
        pub nlookup: u64,
    }

    /// BATCH_FORGET argument; `count` [`ForgetOne`]s follow.
    pub struct BatchForgetIn (8) {
        pub count: u32,
        pub dummy: u32,
    }

    /// GETATTR argument.
    pub struct GetattrIn (16) {
        /// `FUSE_GETATTR_FH` when `fh` is valid.
        pub getattr_flags: u32,
        pub dummy: u32,
        pub fh: u64,
    }

    /// Reply to GETATTR and SETATTR.
    pub struct AttrOut (104) {
        pub attr_valid: u64,
        pub attr_valid_nsec: u32,
        pub dummy: u32,
        pub attr: Attr,
    }

    /// STATX argument (7.39).
    pub struct StatxIn (24) {
        pub getattr_flags: u32,
        pub reserved: u32,
        pub fh: u64,
        /// `AT_STATX_*` sync flags.
        pub sx_flags: u32,
        /// `STATX_*` fields wanted.
        pub sx_mask: u32,
    }

    /// A statx timestamp (`fuse_sx_time`).
    pub struct SxTime (16) {
        pub tv_sec: i64,
        pub tv_nsec: u32,
        pub reserved: i32,
    }

    /// Attributes in statx form (`fuse_statx`).
    pub struct Statx (256) {
        pub mask: u32,
        pub blksize: u32,
        pub attributes: u64,
        pub nlink: u32,
        pub uid: u32,
        pub gid: u32,
        pub mode: u16,
        pub spare0: u16,
        pub ino: u64,
        pub size: u64,
        pub blocks: u64,
        pub attributes_mask: u64,
        pub atime: SxTime,
        pub btime: SxTime,
        pub ctime: SxTime,
        pub mtime: SxTime,
        pub rdev_major: u32,
        pub rdev_minor: u32,
        pub dev_major: u32,
        pub dev_minor: u32,
        pub spare2: [u64; 14],
    }

    /// Reply to STATX.
    pub struct StatxOut (288) {
        pub attr_valid: u64,
        pub attr_valid_nsec: u32,
        pub flags: u32,
        pub spare: [u64; 2],
        pub stat: Statx,
    }

    /// MKNOD argument; the name follows.
    pub struct MknodIn (16) {
        /// Includes the file type bits.
        pub mode: u32,
        pub rdev: u32,
        pub umask: u32,
        pub padding: u32,
    }

    /// MKDIR argument; the name follows.
    pub struct MkdirIn (8) {
        /// Permission bits only: the kernel does not set `S_IFDIR`.
        pub mode: u32,
        pub umask: u32,
    }

    /// RENAME argument; old and new names follow.
    pub struct RenameIn (8) {
        pub newdir: u64,
    }

    /// RENAME2 argument; old and new names follow.
    pub struct Rename2In (16) {
        pub newdir: u64,
        /// `RENAME_NOREPLACE`, `RENAME_EXCHANGE`, `RENAME_WHITEOUT`.
        pub flags: u32,
        pub padding: u32,
    }

    /// LINK argument; the new name follows, `nodeid` in the header is the new parent.
    pub struct LinkIn (8) {
        pub oldnodeid: u64,
    }

    /// SETATTR argument; `valid` says which fields mean something (`FATTR_*`).
    pub struct SetattrIn (88) {
        pub valid: u32,
        pub padding: u32,
        pub fh: u64,
        pub size: u64,
        pub lock_owner: u64,
        pub atime: u64,
        pub mtime: u64,
        pub ctime: u64,
        pub atimensec: u32,
        pub mtimensec: u32,
        pub ctimensec: u32,
        pub mode: u32,
        pub unused4: u32,
        pub uid: u32,
        pub gid: u32,
        pub unused5: u32,
    }

    /// OPEN and OPENDIR argument.
    pub struct OpenIn (8) {
        /// `open(2)` flags, minus `O_CREAT`/`O_EXCL`/`O_NOCTTY`.
        pub flags: u32,
        /// `FUSE_OPEN_*`.
        pub open_flags: u32,
    }

    /// CREATE (and TMPFILE) argument; the name follows.
    pub struct CreateIn (16) {
        pub flags: u32,
        /// Includes `S_IFREG`.
        pub mode: u32,
        pub umask: u32,
        pub open_flags: u32,
    }

    /// Reply to OPEN, OPENDIR (and the second half of CREATE).
    pub struct OpenOut (16) {
        pub fh: u64,
        /// `FOPEN_*`.
        pub open_flags: u32,
        /// For `FOPEN_PASSTHROUGH`; 0 otherwise.
        pub backing_id: i32,
    }

    /// RELEASE and RELEASEDIR argument.
    pub struct ReleaseIn (24) {
        pub fh: u64,
        pub flags: u32,
        /// `FUSE_RELEASE_*`.
        pub release_flags: u32,
        pub lock_owner: u64,
    }

    /// FLUSH argument.
    pub struct FlushIn (24) {
        pub fh: u64,
        pub unused: u32,
        pub padding: u32,
        pub lock_owner: u64,
    }

    /// READ, READDIR and READDIRPLUS argument.
    pub struct ReadIn (40) {
        pub fh: u64,
        pub offset: u64,
        pub size: u32,
        /// `FUSE_READ_LOCKOWNER`.
        pub read_flags: u32,
        pub lock_owner: u64,
        /// The file's `open(2)` flags.
        pub flags: u32,
        pub padding: u32,
    }

    /// WRITE argument; `size` bytes of data follow.
    pub struct WriteIn (40) {
        pub fh: u64,
        pub offset: u64,
        pub size: u32,
        /// `FUSE_WRITE_*`.
        pub write_flags: u32,
        pub lock_owner: u64,
        pub flags: u32,
        pub padding: u32,
    }

    /// Reply to WRITE (and to COPY_FILE_RANGE).
    pub struct WriteOut (8) {
        pub size: u32,
        pub padding: u32,
    }

    /// Reply to STATFS.
    pub struct StatfsOut (80) {
        pub st: Kstatfs,
    }

    /// FSYNC and FSYNCDIR argument.
    pub struct FsyncIn (16) {
        pub fh: u64,
        /// `FUSE_FSYNC_FDATASYNC`.
        pub fsync_flags: u32,
        pub padding: u32,
    }

    /// SETXATTR argument in the form sent when `FUSE_SETXATTR_EXT` is *not* negotiated,
    /// which is always here (see `init::REFUSED`); the name and value follow.
    pub struct SetxattrInCompat (8) {
        pub size: u32,
        /// `XATTR_CREATE` / `XATTR_REPLACE`.
        pub flags: u32,
    }

    /// SETXATTR argument when `FUSE_SETXATTR_EXT` is negotiated (never, here).
    pub struct SetxattrIn (16) {
        pub size: u32,
        pub flags: u32,
        /// `FUSE_SETXATTR_ACL_KILL_SGID`.
        pub setxattr_flags: u32,
        pub padding: u32,
    }

    /// GETXATTR and LISTXATTR argument.
    pub struct GetxattrIn (8) {
        /// Size of the caller's buffer; 0 asks for the size only.
        pub size: u32,
        pub padding: u32,
    }

    /// Reply to a GETXATTR/LISTXATTR that asked for the size only.
    pub struct GetxattrOut (8) {
        pub size: u32,
        pub padding: u32,
    }

    /// GETLK, SETLK and SETLKW argument.
    pub struct LkIn (48) {
        pub fh: u64,
        pub owner: u64,
        pub lk: FileLock,
        /// `FUSE_LK_FLOCK` for BSD locks.
        pub lk_flags: u32,
        pub padding: u32,
    }

    /// Reply to GETLK.
    pub struct LkOut (24) {
        pub lk: FileLock,
    }

    /// ACCESS argument.
    pub struct AccessIn (8) {
        /// `R_OK | W_OK | X_OK`, or `F_OK`.
        pub mask: u32,
        pub padding: u32,
    }

    /// INIT argument (the 64-byte form of 7.36+; older kernels send the first 16 bytes).
    pub struct InitIn (64) {
        pub major: u32,
        pub minor: u32,
        pub max_readahead: u32,
        /// Capability bits 0..32.
        pub flags: u32,
        /// Capability bits 32..64, valid only with `FUSE_INIT_EXT` in `flags`.
        pub flags2: u32,
        pub unused: [u32; 11],
    }

    /// Reply to INIT.
    pub struct InitOut (64) {
        pub major: u32,
        pub minor: u32,
        pub max_readahead: u32,
        pub flags: u32,
        pub max_background: u16,
        pub congestion_threshold: u16,
        pub max_write: u32,
        /// Timestamp granularity in nanoseconds.
        pub time_gran: u32,
        /// Honoured only with `FUSE_MAX_PAGES`.
        pub max_pages: u16,
        pub map_alignment: u16,
        pub flags2: u32,
        /// For `FUSE_PASSTHROUGH`.
        pub max_stack_depth: u32,
        /// Seconds, for `FUSE_REQUEST_TIMEOUT`.
        pub request_timeout: u16,
        pub unused: [u16; 11],
    }

    /// INTERRUPT argument.
    pub struct InterruptIn (8) {
        /// The request to interrupt.
        pub unique: u64,
    }

    /// BMAP argument.
    pub struct BmapIn (16) {
        pub block: u64,
        pub blocksize: u32,
        pub padding: u32,
    }

    /// Reply to BMAP.
    pub struct BmapOut (8) {
        pub block: u64,
    }

    /// IOCTL argument; `in_size` bytes of input follow.
    pub struct IoctlIn (32) {
        pub fh: u64,
        pub flags: u32,
        pub cmd: u32,
        pub arg: u64,
        pub in_size: u32,
        pub out_size: u32,
    }

    /// Reply to IOCTL.
    pub struct IoctlOut (16) {
        pub result: i32,
        pub flags: u32,
        pub in_iovs: u32,
        pub out_iovs: u32,
    }

    /// POLL argument.
    pub struct PollIn (24) {
        pub fh: u64,
        /// Kernel handle to name in a later `FUSE_NOTIFY_POLL`.
        pub kh: u64,
        pub flags: u32,
        pub events: u32,
    }

    /// Reply to POLL.
    pub struct PollOut (8) {
        pub revents: u32,
        pub padding: u32,
    }

    /// FALLOCATE argument.
    pub struct FallocateIn (32) {
        pub fh: u64,
        pub offset: u64,
        pub length: u64,
        /// `FALLOC_FL_*`.
        pub mode: u32,
        pub padding: u32,
    }

    /// LSEEK argument.
    pub struct LseekIn (24) {
        pub fh: u64,
        pub offset: u64,
        /// `SEEK_SET` .. `SEEK_HOLE`.
        pub whence: u32,
        pub padding: u32,
    }

    /// Reply to LSEEK.
    pub struct LseekOut (8) {
        pub offset: u64,
    }

    /// COPY_FILE_RANGE and COPY_FILE_RANGE_64 argument; `nodeid` in the header is the source.
    pub struct CopyFileRangeIn (56) {
        pub fh_in: u64,
        pub off_in: u64,
        pub nodeid_out: u64,
        pub fh_out: u64,
        pub off_out: u64,
        pub len: u64,
        pub flags: u64,
    }

    /// Reply to COPY_FILE_RANGE_64 (7.45); plain COPY_FILE_RANGE replies with [`WriteOut`].
    pub struct CopyFileRangeOut (8) {
        pub bytes_copied: u64,
    }

    /// SYNCFS argument.
    pub struct SyncfsIn (8) {
        pub padding: u64,
    }

    /// Answer to a RETRIEVE notification, arriving as a NOTIFY_REPLY request; data follows.
    pub struct NotifyRetrieveIn (40) {
        pub dummy1: u64,
        pub offset: u64,
        pub size: u32,
        pub dummy2: u32,
        pub dummy3: u64,
        pub dummy4: u64,
    }

    /// Fixed part of a READDIR record; the name follows, then zero padding to 8 bytes.
    pub struct Dirent (24) {
        pub ino: u64,
        /// Offset to pass back in READDIR to continue after this entry.
        pub off: u64,
        pub namelen: u32,
        /// `DT_*` (the file type bits of the mode shifted right by 12).
        pub typ: u32,
    }

    /// Fixed part of a READDIRPLUS record; the name follows, then padding to 8 bytes.
    pub struct Direntplus (152) {
        pub entry_out: EntryOut,
        pub dirent: Dirent,
    }

    /// Body of `FUSE_NOTIFY_POLL`.
    pub struct NotifyPollWakeupOut (8) {
        pub kh: u64,
    }

    /// Body of `FUSE_NOTIFY_INVAL_INODE`.
    pub struct NotifyInvalInodeOut (24) {
        pub ino: u64,
        /// Negative: invalidate attributes only.
        pub off: i64,
        /// 0: to the end of the file.
        pub len: i64,
    }

    /// Body of `FUSE_NOTIFY_INVAL_ENTRY`; name and NUL follow.
    pub struct NotifyInvalEntryOut (16) {
        pub parent: u64,
        /// Excludes the NUL.
        pub namelen: u32,
        /// `FUSE_EXPIRE_ONLY`.
        pub flags: u32,
    }

    /// Body of `FUSE_NOTIFY_DELETE`; name and NUL follow.
    pub struct NotifyDeleteOut (24) {
        pub parent: u64,
        pub child: u64,
        /// Excludes the NUL.
        pub namelen: u32,
        pub padding: u32,
    }

    /// Body of `FUSE_NOTIFY_STORE`; data follows.
    pub struct NotifyStoreOut (24) {
        pub nodeid: u64,
        pub offset: u64,
        pub size: u32,
        pub padding: u32,
    }

    /// Body of `FUSE_NOTIFY_RETRIEVE`.
    pub struct NotifyRetrieveOut (32) {
        pub notify_unique: u64,
        pub nodeid: u64,
        pub offset: u64,
        pub size: u32,
        pub padding: u32,
    }

    /// Body of `FUSE_NOTIFY_PRUNE` (7.45); `count` node ids (u64) follow.
    pub struct NotifyPruneOut (16) {
        pub count: u32,
        pub padding: u32,
        pub spare: u64,
    }

    /// Argument of `FUSE_DEV_IOC_BACKING_OPEN`.
    pub struct BackingMap (16) {
        pub fd: i32,
        pub flags: u32,
        pub padding: u64,
    }

    /// Header of one request extension (at the end of a request, `total_extlen * 8` bytes).
    pub struct ExtHeader (8) {
        /// Bytes in this extension, header included.
        pub size: u32,
        /// `FUSE_EXT_GROUPS`, or 0..=31 for a security-context block.
        pub typ: u32,
    }

    /// The per-entry part of the FUSE-over-io_uring header buffer (`fuse_uring_ent_in_out`).
    pub struct UringEntInOut (32) {
        pub flags: u64,
        /// Kernel to daemon: the request's `unique`; echoed in COMMIT_AND_FETCH.
        pub commit_id: u64,
        /// In: bytes the kernel put in the payload buffer. Out: bytes of reply arguments.
        pub payload_sz: u32,
        pub padding: u32,
        pub reserved: u64,
    }

    /// The command area of a FUSE io_uring SQE (`fuse_uring_cmd_req`, at SQE offset 48).
    pub struct UringCmdReq (24) {
        pub flags: u64,
        /// 0 for REGISTER; the entry's `commit_id` for COMMIT_AND_FETCH.
        pub commit_id: u64,
        /// Queue index, which is the CPU number.
        pub qid: u16,
        pub padding: [u8; 6],
    }
}

/// The header buffer of one FUSE-over-io_uring entry (`fuse_uring_req_header`, 288 bytes).
/// `in_out` holds the in header on delivery and the out header on commit; `op_in` holds the
/// request's first argument (`arg0`); the rest of the request is in the payload buffer.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct UringReqHeader {
    pub in_out: [u8; URING_IN_OUT_HEADER_SZ],
    pub op_in: [u8; URING_OP_IN_OUT_SZ],
    pub ent_in_out: UringEntInOut,
}

pub const URING_IN_OUT_HEADER_SZ: usize = 128;
pub const URING_OP_IN_OUT_SZ: usize = 128;
/// Byte offsets inside [`UringReqHeader`].
pub const URING_HEADER_IN_OUT_OFFSET: usize = 0;
pub const URING_HEADER_OP_IN_OFFSET: usize = 128;
pub const URING_HEADER_ENT_IN_OUT_OFFSET: usize = 256;
/// The kernel refuses REGISTER when the header iovec is shorter than this.
pub const URING_HEADER_SIZE: usize = 288;
const _: () = assert!(size_of::<UringReqHeader>() == URING_HEADER_SIZE);
const _: () = assert!(URING_HEADER_OP_IN_OFFSET == URING_IN_OUT_HEADER_SZ);
const _: () =
    assert!(URING_HEADER_ENT_IN_OUT_OFFSET == URING_IN_OUT_HEADER_SZ + URING_OP_IN_OUT_SZ);
const _: () = assert!(size_of::<InHeader>() <= URING_IN_OUT_HEADER_SZ);
// Every fixed first argument must fit the ring's op_in area.
const _: () = assert!(size_of::<SetattrIn>() <= URING_OP_IN_OUT_SZ);
const _: () = assert!(size_of::<InitIn>() <= URING_OP_IN_OUT_SZ);

/// `enum fuse_uring_cmd`: the `cmd_op` of a FUSE `IORING_OP_URING_CMD` SQE.
pub const FUSE_IO_URING_CMD_INVALID: u32 = 0;
pub const FUSE_IO_URING_CMD_REGISTER: u32 = 1;
pub const FUSE_IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;

/// `/dev/fuse` ioctls (`_IOR/_IOW/_IO` of magic 229).
pub const FUSE_DEV_IOC_CLONE: u32 = 0x8004_e500;
pub const FUSE_DEV_IOC_BACKING_OPEN: u32 = 0x4010_e501;
pub const FUSE_DEV_IOC_BACKING_CLOSE: u32 = 0x4004_e502;
pub const FUSE_DEV_IOC_SYNC_INIT: u32 = 0x0000_e503;

// INIT capability flags, as one u64: bits 32.. travel in `flags2` (needs FUSE_INIT_EXT).
// Which ones etcfs asks for, and why the rest are refused, is in `init.rs`.
pub const FUSE_ASYNC_READ: u64 = 1 << 0;
pub const FUSE_POSIX_LOCKS: u64 = 1 << 1;
pub const FUSE_FILE_OPS: u64 = 1 << 2;
pub const FUSE_ATOMIC_O_TRUNC: u64 = 1 << 3;
pub const FUSE_EXPORT_SUPPORT: u64 = 1 << 4;
pub const FUSE_BIG_WRITES: u64 = 1 << 5;
pub const FUSE_DONT_MASK: u64 = 1 << 6;
pub const FUSE_SPLICE_WRITE: u64 = 1 << 7;
pub const FUSE_SPLICE_MOVE: u64 = 1 << 8;
pub const FUSE_SPLICE_READ: u64 = 1 << 9;
pub const FUSE_FLOCK_LOCKS: u64 = 1 << 10;
pub const FUSE_HAS_IOCTL_DIR: u64 = 1 << 11;
pub const FUSE_AUTO_INVAL_DATA: u64 = 1 << 12;
pub const FUSE_DO_READDIRPLUS: u64 = 1 << 13;
pub const FUSE_READDIRPLUS_AUTO: u64 = 1 << 14;
pub const FUSE_ASYNC_DIO: u64 = 1 << 15;
pub const FUSE_WRITEBACK_CACHE: u64 = 1 << 16;
pub const FUSE_NO_OPEN_SUPPORT: u64 = 1 << 17;
pub const FUSE_PARALLEL_DIROPS: u64 = 1 << 18;
pub const FUSE_HANDLE_KILLPRIV: u64 = 1 << 19;
pub const FUSE_POSIX_ACL: u64 = 1 << 20;
pub const FUSE_ABORT_ERROR: u64 = 1 << 21;
pub const FUSE_MAX_PAGES: u64 = 1 << 22;
pub const FUSE_CACHE_SYMLINKS: u64 = 1 << 23;
pub const FUSE_NO_OPENDIR_SUPPORT: u64 = 1 << 24;
pub const FUSE_EXPLICIT_INVAL_DATA: u64 = 1 << 25;
pub const FUSE_MAP_ALIGNMENT: u64 = 1 << 26;
pub const FUSE_SUBMOUNTS: u64 = 1 << 27;
pub const FUSE_HANDLE_KILLPRIV_V2: u64 = 1 << 28;
pub const FUSE_SETXATTR_EXT: u64 = 1 << 29;
pub const FUSE_INIT_EXT: u64 = 1 << 30;
pub const FUSE_INIT_RESERVED: u64 = 1 << 31;
pub const FUSE_SECURITY_CTX: u64 = 1 << 32;
pub const FUSE_HAS_INODE_DAX: u64 = 1 << 33;
pub const FUSE_CREATE_SUPP_GROUP: u64 = 1 << 34;
pub const FUSE_HAS_EXPIRE_ONLY: u64 = 1 << 35;
pub const FUSE_DIRECT_IO_ALLOW_MMAP: u64 = 1 << 36;
pub const FUSE_PASSTHROUGH: u64 = 1 << 37;
pub const FUSE_NO_EXPORT_SUPPORT: u64 = 1 << 38;
pub const FUSE_HAS_RESEND: u64 = 1 << 39;
pub const FUSE_ALLOW_IDMAP: u64 = 1 << 40;
pub const FUSE_OVER_IO_URING: u64 = 1 << 41;
pub const FUSE_REQUEST_TIMEOUT: u64 = 1 << 42;
/// Every capability bit protocol 7.45 defines.
pub const FUSE_INIT_KNOWN_MASK: u64 = (1 << 43) - 1;

// OpenOut::open_flags.
pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
pub const FOPEN_KEEP_CACHE: u32 = 1 << 1;
pub const FOPEN_NONSEEKABLE: u32 = 1 << 2;
pub const FOPEN_CACHE_DIR: u32 = 1 << 3;
pub const FOPEN_STREAM: u32 = 1 << 4;
pub const FOPEN_NOFLUSH: u32 = 1 << 5;
pub const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
pub const FOPEN_PASSTHROUGH: u32 = 1 << 7;

// SetattrIn::valid.
pub const FATTR_MODE: u32 = 1 << 0;
pub const FATTR_UID: u32 = 1 << 1;
pub const FATTR_GID: u32 = 1 << 2;
pub const FATTR_SIZE: u32 = 1 << 3;
pub const FATTR_ATIME: u32 = 1 << 4;
pub const FATTR_MTIME: u32 = 1 << 5;
pub const FATTR_FH: u32 = 1 << 6;
pub const FATTR_ATIME_NOW: u32 = 1 << 7;
pub const FATTR_MTIME_NOW: u32 = 1 << 8;
pub const FATTR_LOCKOWNER: u32 = 1 << 9;
pub const FATTR_CTIME: u32 = 1 << 10;
pub const FATTR_KILL_SUIDGID: u32 = 1 << 11;

// Attr::flags.
pub const FUSE_ATTR_SUBMOUNT: u32 = 1 << 0;
pub const FUSE_ATTR_DAX: u32 = 1 << 1;

// OpenIn::open_flags / CreateIn::open_flags.
pub const FUSE_OPEN_KILL_SUIDGID: u32 = 1 << 0;

// ReleaseIn::release_flags.
pub const FUSE_RELEASE_FLUSH: u32 = 1 << 0;
pub const FUSE_RELEASE_FLOCK_UNLOCK: u32 = 1 << 1;

// GetattrIn::getattr_flags.
pub const FUSE_GETATTR_FH: u32 = 1 << 0;

// LkIn::lk_flags.
pub const FUSE_LK_FLOCK: u32 = 1 << 0;

// WriteIn::write_flags.
pub const FUSE_WRITE_CACHE: u32 = 1 << 0;
pub const FUSE_WRITE_LOCKOWNER: u32 = 1 << 1;
pub const FUSE_WRITE_KILL_SUIDGID: u32 = 1 << 2;

// ReadIn::read_flags.
pub const FUSE_READ_LOCKOWNER: u32 = 1 << 1;

// FsyncIn::fsync_flags.
pub const FUSE_FSYNC_FDATASYNC: u32 = 1 << 0;

// SetxattrIn::setxattr_flags.
pub const FUSE_SETXATTR_ACL_KILL_SGID: u32 = 1 << 0;

// NotifyInvalEntryOut::flags.
pub const FUSE_EXPIRE_ONLY: u32 = 1 << 0;

// PollIn::flags.
pub const FUSE_POLL_SCHEDULE_NOTIFY: u32 = 1 << 0;

// Rename2In::flags (the renameat2(2) flags).
pub const RENAME_NOREPLACE: u32 = 1 << 0;
pub const RENAME_EXCHANGE: u32 = 1 << 1;
pub const RENAME_WHITEOUT: u32 = 1 << 2;

// setxattr(2) flags.
pub const XATTR_CREATE: u32 = 1;
pub const XATTR_REPLACE: u32 = 2;

// ExtHeader::typ.
/// Types 0..=31 are a security-context block (`fuse_secctx_header`).
pub const FUSE_MAX_NR_SECCTX: u32 = 31;
/// Supplementary groups (`fuse_supp_groups`).
pub const FUSE_EXT_GROUPS: u32 = 32;

// Notification codes, sent as `OutHeader::error` with `unique == 0`.
pub const FUSE_NOTIFY_POLL: i32 = 1;
pub const FUSE_NOTIFY_INVAL_INODE: i32 = 2;
pub const FUSE_NOTIFY_INVAL_ENTRY: i32 = 3;
pub const FUSE_NOTIFY_STORE: i32 = 4;
pub const FUSE_NOTIFY_RETRIEVE: i32 = 5;
pub const FUSE_NOTIFY_DELETE: i32 = 6;
pub const FUSE_NOTIFY_RESEND: i32 = 7;
pub const FUSE_NOTIFY_INC_EPOCH: i32 = 8;
pub const FUSE_NOTIFY_PRUNE: i32 = 9;

/// Length of a record whose fixed part is `fixed` bytes and name `namelen` bytes, rounded
/// up to the 8-byte alignment the kernel requires between dirent records.
pub const fn dirent_record_len(fixed: usize, namelen: usize) -> usize {
    (fixed + namelen + 7) & !7
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

    use std::mem::offset_of;

    use super::*;

    // Offsets the kernel and the ring transport depend on, beyond the size asserts.
    #[test]
    fn field_offsets_match_kernel_layout() {
        assert_eq!(offset_of!(InHeader, total_extlen), 36);
        assert_eq!(offset_of!(EntryOut, attr), 40);
        assert_eq!(offset_of!(AttrOut, attr), 16);
        assert_eq!(offset_of!(Attr, mode), 60);
        assert_eq!(offset_of!(InitOut, max_pages), 28);
        assert_eq!(offset_of!(InitOut, flags2), 32);
        assert_eq!(offset_of!(InitOut, request_timeout), 40);
        assert_eq!(offset_of!(InitIn, flags2), 16);
        assert_eq!(offset_of!(Direntplus, dirent), 128);
        assert_eq!(offset_of!(UringReqHeader, op_in), URING_HEADER_OP_IN_OFFSET);
        assert_eq!(
            offset_of!(UringReqHeader, ent_in_out),
            URING_HEADER_ENT_IN_OUT_OFFSET
        );
        assert_eq!(offset_of!(UringCmdReq, qid), 16);
        assert_eq!(offset_of!(SetattrIn, mode), 68);
        assert_eq!(offset_of!(Statx, atime), 64);
    }

    #[test]
    fn dirent_records_are_8_byte_aligned() {
        assert_eq!(dirent_record_len(24, 0), 24);
        assert_eq!(dirent_record_len(24, 1), 32);
        assert_eq!(dirent_record_len(24, 8), 32);
        assert_eq!(dirent_record_len(24, 9), 40);
        assert_eq!(dirent_record_len(152, 3), 160);
    }

    #[test]
    fn init_flag_mask_covers_every_flag() {
        assert_eq!(FUSE_INIT_KNOWN_MASK.count_ones(), 43);
        assert_eq!(FUSE_REQUEST_TIMEOUT << 1, FUSE_INIT_KNOWN_MASK + 1);
    }
}
