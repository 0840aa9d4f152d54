//! Request decoding: bytes from the kernel to a typed [`Request`] that borrows names and
//! data from the input.
//!
//! A request is the 40-byte [`InHeader`], then the opcode's fixed first argument (`arg0`,
//! zero bytes for LOOKUP, UNLINK, RMDIR, SYMLINK, REMOVEXATTR, READLINK, STATFS, DESTROY),
//! then the rest (NUL-terminated names, WRITE data, xattr values), then
//! `header.total_extlen * 8` bytes of extensions. `/dev/fuse` delivers all of it in one
//! buffer ([`decode`]); FUSE-over-io_uring delivers the header and `arg0` in the ring
//! header buffer and the rest, extensions included, in the payload buffer
//! ([`decode_parts`]). Both go through the same per-opcode decoder.
//!
//! Decoding checks structure only: every byte a request claims is present, every name has
//! its NUL. Policy (name length, empty names, `/` in names) is the filesystem's job.
//! Trailing bytes after what an opcode needs are ignored, as newer kernels may append
//! arguments. Nothing here panics on any input; `fuzz::check_decode` exercises that.

#![forbid(unsafe_code)]
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

use std::fmt;

use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::{
    abi::{
        AccessIn, BatchForgetIn, BmapIn, CopyFileRangeIn, CreateIn, FallocateIn, FileLock, FlushIn,
        ForgetIn, ForgetOne, FsyncIn, GetattrIn, GetxattrIn, InHeader, InitIn, InterruptIn,
        IoctlIn, LinkIn, LkIn, LseekIn, MkdirIn, MknodIn, NotifyRetrieveIn, OpenIn, PollIn, ReadIn,
        ReleaseIn, Rename2In, RenameIn, SetattrIn, SetxattrInCompat, StatxIn, SyncfsIn, WriteIn,
        FUSE_FSYNC_FDATASYNC, FUSE_GETATTR_FH, FUSE_INIT_EXT,
    },
    opcode::Opcode,
};

/// A decoded request: the header as received and the typed operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request<'a> {
    pub header: InHeader,
    pub op: Operation<'a>,
}

/// One FUSE operation with its decoded arguments. Names are the bytes without their NUL.
/// The node the operation applies to (the parent directory for name operations) is
/// `header.nodeid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation<'a> {
    Lookup {
        name: &'a [u8],
    },
    /// No reply.
    Forget {
        nlookup: u64,
    },
    /// No reply; the header's `nodeid` is meaningless.
    BatchForget {
        forgets: Forgets<'a>,
    },
    Getattr {
        /// Present when the kernel asks about an open file (`fstat`).
        fh: Option<u64>,
    },
    /// The fields that apply are flagged in `SetattrIn::valid` (`FATTR_*`).
    Setattr(SetattrIn),
    Readlink,
    Symlink {
        name: &'a [u8],
        target: &'a [u8],
    },
    Mknod {
        name: &'a [u8],
        /// Includes the file type bits.
        mode: u32,
        rdev: u32,
        umask: u32,
    },
    Mkdir {
        name: &'a [u8],
        /// Permission bits only.
        mode: u32,
        umask: u32,
    },
    Unlink {
        name: &'a [u8],
    },
    Rmdir {
        name: &'a [u8],
    },
    /// RENAME (`flags == 0`) and RENAME2.
    Rename {
        newdir: u64,
        name: &'a [u8],
        newname: &'a [u8],
        /// `RENAME_NOREPLACE`, `RENAME_EXCHANGE`, `RENAME_WHITEOUT`.
        flags: u32,
    },
    /// `header.nodeid` is the directory the new name goes in.
    Link {
        oldnodeid: u64,
        name: &'a [u8],
    },
    Open {
        /// `open(2)` flags.
        flags: u32,
        /// `FUSE_OPEN_KILL_SUIDGID`.
        open_flags: u32,
    },
    Read {
        fh: u64,
        offset: u64,
        size: u32,
        flags: u32,
    },
    Write {
        fh: u64,
        offset: u64,
        data: &'a [u8],
        /// `FUSE_WRITE_*`.
        write_flags: u32,
        flags: u32,
    },
    Statfs,
    Release {
        fh: u64,
        flags: u32,
        release_flags: u32,
        lock_owner: u64,
    },
    Fsync {
        fh: u64,
        datasync: bool,
    },
    Setxattr {
        name: &'a [u8],
        value: &'a [u8],
        /// `XATTR_CREATE` / `XATTR_REPLACE`.
        flags: u32,
    },
    Getxattr {
        name: &'a [u8],
        /// 0 asks for the value's size only.
        size: u32,
    },
    Listxattr {
        /// 0 asks for the list's size only.
        size: u32,
    },
    Removexattr {
        name: &'a [u8],
    },
    Flush {
        fh: u64,
        lock_owner: u64,
    },
    /// What the kernel offers; answered by the transport via `init::negotiate`.
    Init(KernelInit),
    Opendir {
        flags: u32,
    },
    Readdir {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Readdirplus {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Releasedir {
        fh: u64,
    },
    Fsyncdir {
        fh: u64,
        datasync: bool,
    },
    Getlk {
        fh: u64,
        owner: u64,
        lock: FileLock,
        lk_flags: u32,
    },
    Setlk {
        fh: u64,
        owner: u64,
        lock: FileLock,
        lk_flags: u32,
    },
    Setlkw {
        fh: u64,
        owner: u64,
        lock: FileLock,
        lk_flags: u32,
    },
    Access {
        mask: u32,
    },
    Create {
        name: &'a [u8],
        /// `open(2)` flags.
        flags: u32,
        /// Includes `S_IFREG`.
        mode: u32,
        umask: u32,
        open_flags: u32,
    },
    /// Answered locally by transports (or not at all).
    Interrupt {
        unique: u64,
    },
    Bmap {
        block: u64,
        blocksize: u32,
    },
    Destroy,
    Ioctl {
        fh: u64,
        flags: u32,
        cmd: u32,
        arg: u64,
        out_size: u32,
        data: &'a [u8],
    },
    Poll {
        fh: u64,
        kh: u64,
        flags: u32,
        events: u32,
    },
    /// The kernel's answer to a RETRIEVE notification; `header.unique` is its
    /// `notify_unique`.
    NotifyReply {
        offset: u64,
        data: &'a [u8],
    },
    Fallocate {
        fh: u64,
        offset: u64,
        length: u64,
        mode: u32,
    },
    Lseek {
        fh: u64,
        offset: u64,
        whence: u32,
    },
    /// COPY_FILE_RANGE and COPY_FILE_RANGE_64; `header.nodeid` is the source inode.
    CopyFileRange {
        fh_in: u64,
        off_in: u64,
        nodeid_out: u64,
        fh_out: u64,
        off_out: u64,
        len: u64,
        flags: u64,
        /// COPY_FILE_RANGE_64: the reply is `CopyFileRangeOut`, not `WriteOut`.
        reply64: bool,
    },
    /// DAX only (virtiofs); never sent on `/dev/fuse`. Arguments are not decoded.
    SetupMapping,
    /// DAX only (virtiofs); never sent on `/dev/fuse`. Arguments are not decoded.
    RemoveMapping,
    Syncfs,
    /// O_TMPFILE: create an unnamed file in directory `header.nodeid` and open it.
    Tmpfile {
        flags: u32,
        mode: u32,
        umask: u32,
        open_flags: u32,
    },
    Statx {
        fh: Option<u64>,
        sx_flags: u32,
        sx_mask: u32,
    },
    /// An opcode this crate does not know (CUSE_INIT, or newer than 7.45).
    Unknown {
        opcode: u32,
    },
}

/// The INIT request: the kernel's protocol version and the capabilities it offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelInit {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    /// `FUSE_*` capability bits, `flags2` already shifted into bits 32.. (only when the
    /// kernel set `FUSE_INIT_EXT`).
    pub flags: u64,
}

/// The [`ForgetOne`] records of a BATCH_FORGET, borrowed from the request. They are read
/// by copy because the input buffer need not be 8-byte aligned.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Forgets<'a> {
    bytes: &'a [u8],
}

impl<'a> Forgets<'a> {
    /// `None` unless `bytes` is a whole number of [`ForgetOne`] records.
    pub fn from_bytes(bytes: &'a [u8]) -> Option<Forgets<'a>> {
        bytes
            .len()
            .is_multiple_of(size_of::<ForgetOne>())
            .then_some(Forgets { bytes })
    }

    pub fn len(&self) -> usize {
        self.bytes.len() / size_of::<ForgetOne>()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = ForgetOne> + 'a {
        self.bytes
            .chunks_exact(size_of::<ForgetOne>())
            .filter_map(|record| ForgetOne::read_from_bytes(record).ok())
    }

    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

impl fmt::Debug for Forgets<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.iter().map(|r| (r.nodeid, r.nlookup)))
            .finish()
    }
}

/// Why a request could not be decoded. Transports answer such a request with EIO when its
/// header (and so its `unique`) was readable, and drop it otherwise.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("request of {got} bytes is shorter than the 40-byte in header")]
    ShortHeader { got: usize },
    #[error("in header says the request is {header} bytes but {got} bytes arrived")]
    LengthMismatch { header: u32, got: usize },
    #[error("{}: {what} needs {need} bytes, {got} present", Opcode::name_of_raw(*opcode))]
    Truncated {
        opcode: u32,
        what: &'static str,
        need: usize,
        got: usize,
    },
    #[error("{}: {what} has no terminating NUL", Opcode::name_of_raw(*opcode))]
    MissingNul { opcode: u32, what: &'static str },
    #[error(
        "{}: {ext} bytes of extensions but only {got} bytes follow the first argument",
        Opcode::name_of_raw(*opcode)
    )]
    BadExtensions { opcode: u32, ext: usize, got: usize },
}

/// Size of the fixed first argument (`in_args[0]`) the kernel sends for `opcode`, 0 for
/// opcodes that have none or are unknown. This is how a contiguous `/dev/fuse` request is
/// split into the two parts the ring delivers separately.
pub fn arg0_len(opcode: u32) -> usize {
    use Opcode as O;
    let Ok(op) = O::try_from(opcode) else {
        return 0;
    };
    match op {
        O::Lookup | O::Readlink | O::Symlink | O::Unlink | O::Rmdir | O::Statfs => 0,
        O::Removexattr | O::Destroy | O::SetupMapping | O::RemoveMapping => 0,
        O::Forget => size_of::<ForgetIn>(),
        O::BatchForget => size_of::<BatchForgetIn>(),
        O::Getattr => size_of::<GetattrIn>(),
        O::Setattr => size_of::<SetattrIn>(),
        O::Mknod => size_of::<MknodIn>(),
        O::Mkdir => size_of::<MkdirIn>(),
        O::Rename => size_of::<RenameIn>(),
        O::Rename2 => size_of::<Rename2In>(),
        O::Link => size_of::<LinkIn>(),
        O::Open | O::Opendir => size_of::<OpenIn>(),
        O::Read | O::Readdir | O::Readdirplus => size_of::<ReadIn>(),
        O::Write => size_of::<WriteIn>(),
        O::Release | O::Releasedir => size_of::<ReleaseIn>(),
        O::Fsync | O::Fsyncdir => size_of::<FsyncIn>(),
        // The 8-byte form: FUSE_SETXATTR_EXT is never negotiated (init::REFUSED).
        O::Setxattr => size_of::<SetxattrInCompat>(),
        O::Getxattr | O::Listxattr => size_of::<GetxattrIn>(),
        O::Flush => size_of::<FlushIn>(),
        O::Init => size_of::<InitIn>(),
        O::Getlk | O::Setlk | O::Setlkw => size_of::<LkIn>(),
        O::Access => size_of::<AccessIn>(),
        O::Create | O::Tmpfile => size_of::<CreateIn>(),
        O::Interrupt => size_of::<InterruptIn>(),
        O::Bmap => size_of::<BmapIn>(),
        O::Ioctl => size_of::<IoctlIn>(),
        O::Poll => size_of::<PollIn>(),
        O::NotifyReply => size_of::<NotifyRetrieveIn>(),
        O::Fallocate => size_of::<FallocateIn>(),
        O::Lseek => size_of::<LseekIn>(),
        O::CopyFileRange | O::CopyFileRange64 => size_of::<CopyFileRangeIn>(),
        O::Syncfs => size_of::<SyncfsIn>(),
        O::Statx => size_of::<StatxIn>(),
    }
}

/// The header's opcode, if `msg` holds at least a header. For counting and logging
/// requests that may not decode.
pub fn peek_opcode(msg: &[u8]) -> Option<u32> {
    read_header(msg).ok().map(|h| h.opcode)
}

/// The header's `unique`, if `msg` holds at least a header: what a transport needs to
/// answer a request that does not decode with EIO.
pub fn peek_unique(msg: &[u8]) -> Option<u64> {
    read_header(msg).ok().map(|h| h.unique)
}

/// Decodes one whole request as read from `/dev/fuse`: checks `header.len` against the
/// buffer, splits off `arg0` by [`arg0_len`] and decodes the parts.
pub fn decode(msg: &[u8]) -> Result<Request<'_>, DecodeError> {
    let (header, body) = msg
        .split_at_checked(size_of::<InHeader>())
        .ok_or(DecodeError::ShortHeader { got: msg.len() })?;
    let h = read_header(header)?;
    if usize::try_from(h.len).ok() != Some(msg.len()) {
        return Err(DecodeError::LengthMismatch {
            header: h.len,
            got: msg.len(),
        });
    }
    // A short arg0 is reported by the per-opcode decoder, which knows the minimum (INIT
    // accepts the 16-byte form of older kernels).
    let split = arg0_len(h.opcode).min(body.len());
    let (arg0, rest) = body.split_at_checked(split).unwrap_or((body, &[]));
    decode_parts(header, arg0, rest)
}

/// Decodes a request delivered in parts, as FUSE-over-io_uring does: `header` holds the in
/// header (a longer buffer is fine), `arg0` the fixed first argument (longer is fine: the
/// prefix is used), `rest` everything after it, extensions included. `header.len` is not
/// checked here; the ring transport has its own length (`payload_sz`).
pub fn decode_parts<'a>(
    header: &[u8],
    arg0: &'a [u8],
    rest: &'a [u8],
) -> Result<Request<'a>, DecodeError> {
    let h = read_header(header)?;
    let ext = usize::from(h.total_extlen) * 8;
    let body_len = rest
        .len()
        .checked_sub(ext)
        .ok_or(DecodeError::BadExtensions {
            opcode: h.opcode,
            ext,
            got: rest.len(),
        })?;
    let (rest, _extensions) = rest.split_at_checked(body_len).unwrap_or((rest, &[]));
    let op = decode_op(Args {
        opcode: h.opcode,
        arg0,
        rest,
    })?;
    Ok(Request { header: h, op })
}

fn read_header(bytes: &[u8]) -> Result<InHeader, DecodeError> {
    InHeader::read_from_prefix(bytes)
        .map(|(h, _)| h)
        .map_err(|_| DecodeError::ShortHeader { got: bytes.len() })
}

/// The arguments of one request while they are being consumed.
struct Args<'a> {
    opcode: u32,
    arg0: &'a [u8],
    rest: &'a [u8],
}

impl<'a> Args<'a> {
    fn fixed<T: FromBytes>(&self) -> Result<T, DecodeError> {
        T::read_from_prefix(self.arg0)
            .map(|(v, _)| v)
            .map_err(|_| DecodeError::Truncated {
                opcode: self.opcode,
                what: "fixed argument",
                need: size_of::<T>(),
                got: self.arg0.len(),
            })
    }

    /// The next NUL-terminated string, without its NUL.
    fn name(&mut self, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let nul = self
            .rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::MissingNul {
                opcode: self.opcode,
                what,
            })?;
        let (name, tail) = self.rest.split_at_checked(nul).unwrap_or((self.rest, &[]));
        self.rest = tail.get(1..).unwrap_or(&[]);
        Ok(name)
    }

    /// The next `len` bytes.
    fn bytes(&mut self, len: u32, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let need = usize::try_from(len).unwrap_or(usize::MAX);
        let (data, tail) = self
            .rest
            .split_at_checked(need)
            .ok_or(DecodeError::Truncated {
                opcode: self.opcode,
                what,
                need,
                got: self.rest.len(),
            })?;
        self.rest = tail;
        Ok(data)
    }
}

fn decode_op(mut a: Args<'_>) -> Result<Operation<'_>, DecodeError> {
    use Opcode as O;
    use Operation as Op;
    let Ok(opcode) = O::try_from(a.opcode) else {
        return Ok(Op::Unknown { opcode: a.opcode });
    };
    Ok(match opcode {
        O::Lookup => Op::Lookup {
            name: a.name("name")?,
        },
        O::Forget => Op::Forget {
            nlookup: a.fixed::<ForgetIn>()?.nlookup,
        },
        O::BatchForget => {
            let arg = a.fixed::<BatchForgetIn>()?;
            let len = u64::from(arg.count) * size_of::<ForgetOne>() as u64;
            let records = a.bytes(u32::try_from(len).unwrap_or(u32::MAX), "forget records")?;
            Op::BatchForget {
                forgets: Forgets { bytes: records },
            }
        }
        O::Getattr => {
            let arg = a.fixed::<GetattrIn>()?;
            Op::Getattr {
                fh: (arg.getattr_flags & FUSE_GETATTR_FH != 0).then_some(arg.fh),
            }
        }
        O::Setattr => Op::Setattr(a.fixed::<SetattrIn>()?),
        O::Readlink => Op::Readlink,
        O::Symlink => {
            let name = a.name("name")?;
            Op::Symlink {
                name,
                target: a.name("target")?,
            }
        }
        O::Mknod => {
            let arg = a.fixed::<MknodIn>()?;
            Op::Mknod {
                name: a.name("name")?,
                mode: arg.mode,
                rdev: arg.rdev,
                umask: arg.umask,
            }
        }
        O::Mkdir => {
            let arg = a.fixed::<MkdirIn>()?;
            Op::Mkdir {
                name: a.name("name")?,
                mode: arg.mode,
                umask: arg.umask,
            }
        }
        O::Unlink => Op::Unlink {
            name: a.name("name")?,
        },
        O::Rmdir => Op::Rmdir {
            name: a.name("name")?,
        },
        O::Rename => {
            let newdir = a.fixed::<RenameIn>()?.newdir;
            let name = a.name("old name")?;
            Op::Rename {
                newdir,
                name,
                newname: a.name("new name")?,
                flags: 0,
            }
        }
        O::Rename2 => {
            let arg = a.fixed::<Rename2In>()?;
            let name = a.name("old name")?;
            Op::Rename {
                newdir: arg.newdir,
                name,
                newname: a.name("new name")?,
                flags: arg.flags,
            }
        }
        O::Link => {
            let oldnodeid = a.fixed::<LinkIn>()?.oldnodeid;
            Op::Link {
                oldnodeid,
                name: a.name("name")?,
            }
        }
        O::Open => {
            let arg = a.fixed::<OpenIn>()?;
            Op::Open {
                flags: arg.flags,
                open_flags: arg.open_flags,
            }
        }
        O::Read => {
            let arg = a.fixed::<ReadIn>()?;
            Op::Read {
                fh: arg.fh,
                offset: arg.offset,
                size: arg.size,
                flags: arg.flags,
            }
        }
        O::Write => {
            let arg = a.fixed::<WriteIn>()?;
            Op::Write {
                fh: arg.fh,
                offset: arg.offset,
                data: a.bytes(arg.size, "write data")?,
                write_flags: arg.write_flags,
                flags: arg.flags,
            }
        }
        O::Statfs => Op::Statfs,
        O::Release => {
            let arg = a.fixed::<ReleaseIn>()?;
            Op::Release {
                fh: arg.fh,
                flags: arg.flags,
                release_flags: arg.release_flags,
                lock_owner: arg.lock_owner,
            }
        }
        O::Fsync => {
            let arg = a.fixed::<FsyncIn>()?;
            Op::Fsync {
                fh: arg.fh,
                datasync: arg.fsync_flags & FUSE_FSYNC_FDATASYNC != 0,
            }
        }
        O::Setxattr => {
            let arg = a.fixed::<SetxattrInCompat>()?;
            let name = a.name("name")?;
            Op::Setxattr {
                name,
                value: a.bytes(arg.size, "value")?,
                flags: arg.flags,
            }
        }
        O::Getxattr => {
            let size = a.fixed::<GetxattrIn>()?.size;
            Op::Getxattr {
                name: a.name("name")?,
                size,
            }
        }
        O::Listxattr => Op::Listxattr {
            size: a.fixed::<GetxattrIn>()?.size,
        },
        O::Removexattr => Op::Removexattr {
            name: a.name("name")?,
        },
        O::Flush => {
            let arg = a.fixed::<FlushIn>()?;
            Op::Flush {
                fh: arg.fh,
                lock_owner: arg.lock_owner,
            }
        }
        O::Init => decode_init(&a)?,
        O::Opendir => Op::Opendir {
            flags: a.fixed::<OpenIn>()?.flags,
        },
        O::Readdir => {
            let arg = a.fixed::<ReadIn>()?;
            Op::Readdir {
                fh: arg.fh,
                offset: arg.offset,
                size: arg.size,
            }
        }
        O::Readdirplus => {
            let arg = a.fixed::<ReadIn>()?;
            Op::Readdirplus {
                fh: arg.fh,
                offset: arg.offset,
                size: arg.size,
            }
        }
        O::Releasedir => Op::Releasedir {
            fh: a.fixed::<ReleaseIn>()?.fh,
        },
        O::Fsyncdir => {
            let arg = a.fixed::<FsyncIn>()?;
            Op::Fsyncdir {
                fh: arg.fh,
                datasync: arg.fsync_flags & FUSE_FSYNC_FDATASYNC != 0,
            }
        }
        O::Getlk => {
            let l = a.fixed::<LkIn>()?;
            Op::Getlk {
                fh: l.fh,
                owner: l.owner,
                lock: l.lk,
                lk_flags: l.lk_flags,
            }
        }
        O::Setlk => {
            let l = a.fixed::<LkIn>()?;
            Op::Setlk {
                fh: l.fh,
                owner: l.owner,
                lock: l.lk,
                lk_flags: l.lk_flags,
            }
        }
        O::Setlkw => {
            let l = a.fixed::<LkIn>()?;
            Op::Setlkw {
                fh: l.fh,
                owner: l.owner,
                lock: l.lk,
                lk_flags: l.lk_flags,
            }
        }
        O::Access => Op::Access {
            mask: a.fixed::<AccessIn>()?.mask,
        },
        O::Create => {
            let arg = a.fixed::<CreateIn>()?;
            Op::Create {
                name: a.name("name")?,
                flags: arg.flags,
                mode: arg.mode,
                umask: arg.umask,
                open_flags: arg.open_flags,
            }
        }
        O::Interrupt => Op::Interrupt {
            unique: a.fixed::<InterruptIn>()?.unique,
        },
        O::Bmap => {
            let arg = a.fixed::<BmapIn>()?;
            Op::Bmap {
                block: arg.block,
                blocksize: arg.blocksize,
            }
        }
        O::Destroy => Op::Destroy,
        O::Ioctl => {
            let arg = a.fixed::<IoctlIn>()?;
            Op::Ioctl {
                fh: arg.fh,
                flags: arg.flags,
                cmd: arg.cmd,
                arg: arg.arg,
                out_size: arg.out_size,
                data: a.bytes(arg.in_size, "ioctl input")?,
            }
        }
        O::Poll => {
            let arg = a.fixed::<PollIn>()?;
            Op::Poll {
                fh: arg.fh,
                kh: arg.kh,
                flags: arg.flags,
                events: arg.events,
            }
        }
        O::NotifyReply => {
            let arg = a.fixed::<NotifyRetrieveIn>()?;
            Op::NotifyReply {
                offset: arg.offset,
                data: a.bytes(arg.size, "retrieved data")?,
            }
        }
        O::Fallocate => {
            let arg = a.fixed::<FallocateIn>()?;
            Op::Fallocate {
                fh: arg.fh,
                offset: arg.offset,
                length: arg.length,
                mode: arg.mode,
            }
        }
        O::Lseek => {
            let arg = a.fixed::<LseekIn>()?;
            Op::Lseek {
                fh: arg.fh,
                offset: arg.offset,
                whence: arg.whence,
            }
        }
        O::CopyFileRange | O::CopyFileRange64 => {
            let arg = a.fixed::<CopyFileRangeIn>()?;
            Op::CopyFileRange {
                fh_in: arg.fh_in,
                off_in: arg.off_in,
                nodeid_out: arg.nodeid_out,
                fh_out: arg.fh_out,
                off_out: arg.off_out,
                len: arg.len,
                flags: arg.flags,
                reply64: opcode == O::CopyFileRange64,
            }
        }
        O::SetupMapping => Op::SetupMapping,
        O::RemoveMapping => Op::RemoveMapping,
        O::Syncfs => Op::Syncfs,
        O::Tmpfile => {
            // The kernel also sends the name of the unnamed dentry ("/"); it means nothing.
            let arg = a.fixed::<CreateIn>()?;
            Op::Tmpfile {
                flags: arg.flags,
                mode: arg.mode,
                umask: arg.umask,
                open_flags: arg.open_flags,
            }
        }
        O::Statx => {
            let arg = a.fixed::<StatxIn>()?;
            Op::Statx {
                fh: (arg.getattr_flags & FUSE_GETATTR_FH != 0).then_some(arg.fh),
                sx_flags: arg.sx_flags,
                sx_mask: arg.sx_mask,
            }
        }
    })
}

/// Kernels before 7.36 send only the first 16 bytes of [`InitIn`]; `flags2` counts only
/// when the kernel sets `FUSE_INIT_EXT` and actually sent it.
fn decode_init<'a>(a: &Args<'a>) -> Result<Operation<'a>, DecodeError> {
    const COMPAT_LEN: usize = 16;
    const WITH_FLAGS2_LEN: usize = 20;
    if a.arg0.len() < COMPAT_LEN {
        return Err(DecodeError::Truncated {
            opcode: a.opcode,
            what: "fixed argument",
            need: COMPAT_LEN,
            got: a.arg0.len(),
        });
    }
    let mut full = InitIn::default();
    let n = a.arg0.len().min(size_of::<InitIn>());
    if let (Some(dst), Some(src)) = (full.as_mut_bytes().get_mut(..n), a.arg0.get(..n)) {
        dst.copy_from_slice(src);
    }
    let mut flags = u64::from(full.flags);
    if flags & FUSE_INIT_EXT != 0 && a.arg0.len() >= WITH_FLAGS2_LEN {
        flags |= u64::from(full.flags2) << 32;
    }
    Ok(Operation::Init(KernelInit {
        major: full.major,
        minor: full.minor,
        max_readahead: full.max_readahead,
        flags,
    }))
}

impl<'a> Request<'a> {
    /// A request as the kernel would send it, with uid, gid and pid 0; for tests and
    /// in-memory transports. Encode it with [`Request::encode`].
    pub fn new(unique: u64, nodeid: u64, op: Operation<'a>) -> Request<'a> {
        let header = InHeader {
            unique,
            nodeid,
            opcode: op.wire_opcode(),
            ..InHeader::default()
        };
        Request { header, op }
    }

    pub fn unique(&self) -> u64 {
        self.header.unique
    }

    pub fn nodeid(&self) -> u64 {
        self.header.nodeid
    }

    /// `None` for an opcode this crate does not know.
    pub fn opcode(&self) -> Option<Opcode> {
        Opcode::try_from(self.header.opcode).ok()
    }

    /// Dense counter index of the header's opcode (see [`Opcode::index_of_raw`]).
    pub fn opcode_index(&self) -> usize {
        Opcode::index_of_raw(self.header.opcode)
    }

    /// Name of the header's opcode, `"UNKNOWN"` if it is not known.
    pub fn opcode_name(&self) -> &'static str {
        Opcode::name_of_raw(self.header.opcode)
    }

    /// Whether the kernel expects no reply (FORGET, BATCH_FORGET). INTERRUPT does take a
    /// reply in one case (EAGAIN, "not seen yet, ask again"), which a transport may send.
    pub fn is_no_reply(&self) -> bool {
        matches!(
            self.op,
            Operation::Forget { .. } | Operation::BatchForget { .. }
        )
    }

    /// Writes the request in `/dev/fuse` form into `dst` (replacing its contents): the
    /// kernel's side of the codec, for tests, fuzzing and in-memory transports. Header
    /// ids come from `self.header`; `len` and `opcode` are derived from the operation,
    /// extensions are not written. `arg0` is exactly [`arg0_len`] bytes for known opcodes,
    /// so [`decode`] reads back an equal operation.
    pub fn encode(&self, dst: &mut Vec<u8>) {
        dst.clear();
        let mut header = self.header;
        header.opcode = self.op.wire_opcode_for(self.header.opcode);
        header.total_extlen = 0;
        push(dst, &header);
        encode_op(&self.op, header.opcode == Opcode::Rename2.raw(), dst);
        let len = u32::try_from(dst.len()).unwrap_or(u32::MAX);
        if let Some(len_field) = dst.get_mut(..4) {
            len_field.copy_from_slice(&len.to_ne_bytes());
        }
    }
}

impl Operation<'_> {
    /// The opcode this operation travels as (RENAME2 for a rename with flags).
    pub fn wire_opcode(&self) -> u32 {
        self.wire_opcode_for(0)
    }

    /// Like [`Operation::wire_opcode`], keeping RENAME2 if `hint` says so.
    fn wire_opcode_for(&self, hint: u32) -> u32 {
        use Opcode as O;
        use Operation as Op;
        let op = match self {
            Op::Lookup { .. } => O::Lookup,
            Op::Forget { .. } => O::Forget,
            Op::BatchForget { .. } => O::BatchForget,
            Op::Getattr { .. } => O::Getattr,
            Op::Setattr(_) => O::Setattr,
            Op::Readlink => O::Readlink,
            Op::Symlink { .. } => O::Symlink,
            Op::Mknod { .. } => O::Mknod,
            Op::Mkdir { .. } => O::Mkdir,
            Op::Unlink { .. } => O::Unlink,
            Op::Rmdir { .. } => O::Rmdir,
            Op::Rename { flags, .. } => {
                if *flags != 0 || hint == O::Rename2.raw() {
                    O::Rename2
                } else {
                    O::Rename
                }
            }
            Op::Link { .. } => O::Link,
            Op::Open { .. } => O::Open,
            Op::Read { .. } => O::Read,
            Op::Write { .. } => O::Write,
            Op::Statfs => O::Statfs,
            Op::Release { .. } => O::Release,
            Op::Fsync { .. } => O::Fsync,
            Op::Setxattr { .. } => O::Setxattr,
            Op::Getxattr { .. } => O::Getxattr,
            Op::Listxattr { .. } => O::Listxattr,
            Op::Removexattr { .. } => O::Removexattr,
            Op::Flush { .. } => O::Flush,
            Op::Init(_) => O::Init,
            Op::Opendir { .. } => O::Opendir,
            Op::Readdir { .. } => O::Readdir,
            Op::Readdirplus { .. } => O::Readdirplus,
            Op::Releasedir { .. } => O::Releasedir,
            Op::Fsyncdir { .. } => O::Fsyncdir,
            Op::Getlk { .. } => O::Getlk,
            Op::Setlk { .. } => O::Setlk,
            Op::Setlkw { .. } => O::Setlkw,
            Op::Access { .. } => O::Access,
            Op::Create { .. } => O::Create,
            Op::Interrupt { .. } => O::Interrupt,
            Op::Bmap { .. } => O::Bmap,
            Op::Destroy => O::Destroy,
            Op::Ioctl { .. } => O::Ioctl,
            Op::Poll { .. } => O::Poll,
            Op::NotifyReply { .. } => O::NotifyReply,
            Op::Fallocate { .. } => O::Fallocate,
            Op::Lseek { .. } => O::Lseek,
            Op::CopyFileRange { reply64: false, .. } => O::CopyFileRange,
            Op::CopyFileRange { reply64: true, .. } => O::CopyFileRange64,
            Op::SetupMapping => O::SetupMapping,
            Op::RemoveMapping => O::RemoveMapping,
            Op::Syncfs => O::Syncfs,
            Op::Tmpfile { .. } => O::Tmpfile,
            Op::Statx { .. } => O::Statx,
            Op::Unknown { opcode } => return *opcode,
        };
        op.raw()
    }
}

fn push<T: IntoBytes + Immutable>(dst: &mut Vec<u8>, v: &T) {
    dst.extend_from_slice(v.as_bytes());
}

fn push_name(dst: &mut Vec<u8>, name: &[u8]) {
    dst.extend_from_slice(name);
    dst.push(0);
}

fn len_u32(data: &[u8]) -> u32 {
    u32::try_from(data.len()).unwrap_or(u32::MAX)
}

/// Writes `op`'s arguments; `rename2` picks the 16-byte RENAME2 argument for a rename.
fn encode_op(op: &Operation<'_>, rename2: bool, dst: &mut Vec<u8>) {
    use Operation as Op;
    match *op {
        Op::Lookup { name } | Op::Unlink { name } | Op::Rmdir { name } => push_name(dst, name),
        Op::Removexattr { name } => push_name(dst, name),
        Op::Forget { nlookup } => push(dst, &ForgetIn { nlookup }),
        Op::BatchForget { forgets } => {
            let count = u32::try_from(forgets.len()).unwrap_or(u32::MAX);
            push(dst, &BatchForgetIn { count, dummy: 0 });
            dst.extend_from_slice(forgets.as_bytes());
        }
        Op::Getattr { fh } => {
            let getattr_flags = if fh.is_some() { FUSE_GETATTR_FH } else { 0 };
            push(
                dst,
                &GetattrIn {
                    getattr_flags,
                    dummy: 0,
                    fh: fh.unwrap_or(0),
                },
            );
        }
        Op::Setattr(arg) => push(dst, &arg),
        Op::Readlink | Op::Statfs | Op::Destroy | Op::SetupMapping | Op::RemoveMapping => {}
        Op::Unknown { .. } => {}
        Op::Symlink { name, target } => {
            push_name(dst, name);
            push_name(dst, target);
        }
        Op::Mknod {
            name,
            mode,
            rdev,
            umask,
        } => {
            push(
                dst,
                &MknodIn {
                    mode,
                    rdev,
                    umask,
                    padding: 0,
                },
            );
            push_name(dst, name);
        }
        Op::Mkdir { name, mode, umask } => {
            push(dst, &MkdirIn { mode, umask });
            push_name(dst, name);
        }
        Op::Rename {
            newdir,
            name,
            newname,
            flags,
        } => {
            if rename2 {
                push(
                    dst,
                    &Rename2In {
                        newdir,
                        flags,
                        padding: 0,
                    },
                );
            } else {
                push(dst, &RenameIn { newdir });
            }
            push_name(dst, name);
            push_name(dst, newname);
        }
        Op::Link { oldnodeid, name } => {
            push(dst, &LinkIn { oldnodeid });
            push_name(dst, name);
        }
        Op::Open { flags, open_flags } => push(dst, &OpenIn { flags, open_flags }),
        Op::Opendir { flags } => push(
            dst,
            &OpenIn {
                flags,
                open_flags: 0,
            },
        ),
        Op::Read {
            fh,
            offset,
            size,
            flags,
        } => {
            push(
                dst,
                &ReadIn {
                    fh,
                    offset,
                    size,
                    flags,
                    ..ReadIn::default()
                },
            );
        }
        Op::Readdir { fh, offset, size } | Op::Readdirplus { fh, offset, size } => {
            push(
                dst,
                &ReadIn {
                    fh,
                    offset,
                    size,
                    ..ReadIn::default()
                },
            );
        }
        Op::Write {
            fh,
            offset,
            data,
            write_flags,
            flags,
        } => {
            let size = len_u32(data);
            push(
                dst,
                &WriteIn {
                    fh,
                    offset,
                    size,
                    write_flags,
                    flags,
                    ..WriteIn::default()
                },
            );
            dst.extend_from_slice(data);
        }
        Op::Release {
            fh,
            flags,
            release_flags,
            lock_owner,
        } => {
            push(
                dst,
                &ReleaseIn {
                    fh,
                    flags,
                    release_flags,
                    lock_owner,
                },
            );
        }
        Op::Releasedir { fh } => push(
            dst,
            &ReleaseIn {
                fh,
                ..ReleaseIn::default()
            },
        ),
        Op::Fsync { fh, datasync } | Op::Fsyncdir { fh, datasync } => {
            let fsync_flags = if datasync { FUSE_FSYNC_FDATASYNC } else { 0 };
            push(
                dst,
                &FsyncIn {
                    fh,
                    fsync_flags,
                    padding: 0,
                },
            );
        }
        Op::Setxattr { name, value, flags } => {
            push(
                dst,
                &SetxattrInCompat {
                    size: len_u32(value),
                    flags,
                },
            );
            push_name(dst, name);
            dst.extend_from_slice(value);
        }
        Op::Getxattr { name, size } => {
            push(dst, &GetxattrIn { size, padding: 0 });
            push_name(dst, name);
        }
        Op::Listxattr { size } => push(dst, &GetxattrIn { size, padding: 0 }),
        Op::Flush { fh, lock_owner } => push(
            dst,
            &FlushIn {
                fh,
                lock_owner,
                ..FlushIn::default()
            },
        ),
        Op::Init(KernelInit {
            major,
            minor,
            max_readahead,
            flags,
        }) => {
            let init = InitIn {
                major,
                minor,
                max_readahead,
                flags: flags as u32,
                flags2: (flags >> 32) as u32,
                unused: [0; 11],
            };
            push(dst, &init);
        }
        Op::Getlk {
            fh,
            owner,
            lock,
            lk_flags,
        }
        | Op::Setlk {
            fh,
            owner,
            lock,
            lk_flags,
        }
        | Op::Setlkw {
            fh,
            owner,
            lock,
            lk_flags,
        } => {
            push(
                dst,
                &LkIn {
                    fh,
                    owner,
                    lk: lock,
                    lk_flags,
                    padding: 0,
                },
            );
        }
        Op::Access { mask } => push(dst, &AccessIn { mask, padding: 0 }),
        Op::Create {
            name,
            flags,
            mode,
            umask,
            open_flags,
        } => {
            push(
                dst,
                &CreateIn {
                    flags,
                    mode,
                    umask,
                    open_flags,
                },
            );
            push_name(dst, name);
        }
        Op::Tmpfile {
            flags,
            mode,
            umask,
            open_flags,
        } => {
            push(
                dst,
                &CreateIn {
                    flags,
                    mode,
                    umask,
                    open_flags,
                },
            );
            push_name(dst, b"/");
        }
        Op::Interrupt { unique } => push(dst, &InterruptIn { unique }),
        Op::Bmap { block, blocksize } => push(
            dst,
            &BmapIn {
                block,
                blocksize,
                padding: 0,
            },
        ),
        Op::Ioctl {
            fh,
            flags,
            cmd,
            arg,
            out_size,
            data,
        } => {
            let in_size = len_u32(data);
            push(
                dst,
                &IoctlIn {
                    fh,
                    flags,
                    cmd,
                    arg,
                    in_size,
                    out_size,
                },
            );
            dst.extend_from_slice(data);
        }
        Op::Poll {
            fh,
            kh,
            flags,
            events,
        } => push(
            dst,
            &PollIn {
                fh,
                kh,
                flags,
                events,
            },
        ),
        Op::NotifyReply { offset, data } => {
            let size = len_u32(data);
            push(
                dst,
                &NotifyRetrieveIn {
                    offset,
                    size,
                    ..NotifyRetrieveIn::default()
                },
            );
            dst.extend_from_slice(data);
        }
        Op::Fallocate {
            fh,
            offset,
            length,
            mode,
        } => {
            push(
                dst,
                &FallocateIn {
                    fh,
                    offset,
                    length,
                    mode,
                    padding: 0,
                },
            );
        }
        Op::Lseek { fh, offset, whence } => push(
            dst,
            &LseekIn {
                fh,
                offset,
                whence,
                padding: 0,
            },
        ),
        Op::CopyFileRange {
            fh_in,
            off_in,
            nodeid_out,
            fh_out,
            off_out,
            len,
            flags,
            ..
        } => {
            push(
                dst,
                &CopyFileRangeIn {
                    fh_in,
                    off_in,
                    nodeid_out,
                    fh_out,
                    off_out,
                    len,
                    flags,
                },
            );
        }
        Op::Syncfs => push(dst, &SyncfsIn { padding: 0 }),
        Op::Statx {
            fh,
            sx_flags,
            sx_mask,
        } => {
            let getattr_flags = if fh.is_some() { FUSE_GETATTR_FH } else { 0 };
            let fh = fh.unwrap_or(0);
            push(
                dst,
                &StatxIn {
                    getattr_flags,
                    reserved: 0,
                    fh,
                    sx_flags,
                    sx_mask,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

    use super::*;
    use crate::abi::{FUSE_ASYNC_READ, FUSE_OVER_IO_URING};

    const INIT_EXT_URING: u64 = FUSE_INIT_EXT | FUSE_OVER_IO_URING;

    fn roundtrip(op: Operation<'_>) {
        let req = Request::new(7, 42, op);
        let mut bytes = Vec::new();
        req.encode(&mut bytes);
        let back = decode(&bytes).unwrap();
        assert_eq!(back.op, op);
        assert_eq!(back.unique(), 7);
        assert_eq!(back.nodeid(), 42);
        // The ring form: header, arg0 and rest handed over separately.
        let arg0_end = 40 + arg0_len(back.header.opcode);
        let parts = decode_parts(&bytes[..40], &bytes[40..arg0_end], &bytes[arg0_end..]);
        assert_eq!(parts.unwrap().op, op);
    }

    #[test]
    fn encode_decode_round_trips() {
        let forgets = [
            ForgetOne {
                nodeid: 5,
                nlookup: 2,
            },
            ForgetOne {
                nodeid: 9,
                nlookup: 1,
            },
        ];
        let forget_bytes = forgets.as_bytes();
        let ops = [
            Operation::Lookup { name: b"a" },
            Operation::Forget { nlookup: 3 },
            Operation::BatchForget {
                forgets: Forgets::from_bytes(forget_bytes).unwrap(),
            },
            Operation::Getattr { fh: Some(3) },
            Operation::Getattr { fh: None },
            Operation::Setattr(SetattrIn {
                valid: 1,
                mode: 0o644,
                ..SetattrIn::default()
            }),
            Operation::Readlink,
            Operation::Symlink {
                name: b"l",
                target: b"/x/y",
            },
            Operation::Mknod {
                name: b"n",
                mode: 0o10644,
                rdev: 0,
                umask: 0o22,
            },
            Operation::Mkdir {
                name: b"d",
                mode: 0o755,
                umask: 0o22,
            },
            Operation::Rename {
                newdir: 1,
                name: b"a",
                newname: b"b",
                flags: 0,
            },
            Operation::Rename {
                newdir: 1,
                name: b"a",
                newname: b"b",
                flags: 1,
            },
            Operation::Link {
                oldnodeid: 3,
                name: b"h",
            },
            Operation::Open {
                flags: 2,
                open_flags: 1,
            },
            Operation::Read {
                fh: 1,
                offset: 4096,
                size: 4096,
                flags: 0,
            },
            Operation::Write {
                fh: 1,
                offset: 0,
                data: b"hello",
                write_flags: 0,
                flags: 2,
            },
            Operation::Setxattr {
                name: b"user.k",
                value: b"v\0v",
                flags: 1,
            },
            Operation::Getxattr {
                name: b"user.k",
                size: 0,
            },
            Operation::Init(KernelInit {
                major: 7,
                minor: 45,
                max_readahead: 1,
                flags: INIT_EXT_URING,
            }),
            Operation::Init(KernelInit {
                major: 7,
                minor: 45,
                max_readahead: 1,
                flags: FUSE_ASYNC_READ,
            }),
            Operation::Readdirplus {
                fh: 1,
                offset: 3,
                size: 4096,
            },
            Operation::Create {
                name: b"c",
                flags: 0o100,
                mode: 0o100644,
                umask: 0,
                open_flags: 0,
            },
            Operation::CopyFileRange {
                fh_in: 1,
                off_in: 2,
                nodeid_out: 3,
                fh_out: 4,
                off_out: 5,
                len: 6,
                flags: 0,
                reply64: true,
            },
            Operation::Statx {
                fh: None,
                sx_flags: 0,
                sx_mask: 0xfff,
            },
            Operation::Tmpfile {
                flags: 2,
                mode: 0o100600,
                umask: 0,
                open_flags: 0,
            },
            Operation::Unknown { opcode: 4096 },
        ];
        for op in ops {
            roundtrip(op);
        }
    }

    #[test]
    fn init_with_flags2_needs_init_ext() {
        // Without FUSE_INIT_EXT the high word is not offered, whatever the bytes say.
        let init = KernelInit {
            major: 7,
            minor: 45,
            max_readahead: 0,
            flags: FUSE_OVER_IO_URING,
        };
        let mut bytes = Vec::new();
        Request::new(1, 0, Operation::Init(init)).encode(&mut bytes);
        let Operation::Init(k) = decode(&bytes).unwrap().op else {
            panic!()
        };
        assert_eq!(k.flags, 0);
    }

    #[test]
    fn forgets_iterate_unaligned_input() {
        let mut buf = vec![0u8; 1];
        buf.extend_from_slice(
            [ForgetOne {
                nodeid: 77,
                nlookup: 4,
            }]
            .as_bytes(),
        );
        let forgets = Forgets::from_bytes(&buf[1..]).unwrap();
        assert_eq!(forgets.len(), 1);
        assert_eq!(
            forgets.iter().next(),
            Some(ForgetOne {
                nodeid: 77,
                nlookup: 4
            })
        );
        assert!(Forgets::from_bytes(&buf[..9]).is_none());
    }

    #[test]
    fn errors_name_the_problem() {
        let e = DecodeError::MissingNul {
            opcode: 1,
            what: "name",
        };
        assert_eq!(e.to_string(), "LOOKUP: name has no terminating NUL");
        let e = DecodeError::Truncated {
            opcode: 16,
            what: "write data",
            need: 5,
            got: 2,
        };
        assert_eq!(e.to_string(), "WRITE: write data needs 5 bytes, 2 present");
    }
}
