//! INIT negotiation: which capabilities etcfs asks the kernel for, which it refuses and
//! why, and the INIT reply.
//!
//! Every capability bit protocol 7.45 defines is in exactly one of [`WANTED`],
//! [`CONFIGURED`] (wanted when [`InitConfig`] says so) or [`REFUSED`]; a test enforces
//! that, so a new kernel flag cannot slip in without a decision. Only bits the kernel
//! offered are ever requested.

#![forbid(unsafe_code)]
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

use crate::{
    abi::{self, InitOut, FUSE_KERNEL_MINOR_VERSION, FUSE_MIN_MINOR_VERSION, PAGE_SIZE},
    request::{KernelInit, Operation},
};

/// One capability bit with the reason for our decision about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capability {
    pub flag: u64,
    pub name: &'static str,
    pub reason: &'static str,
}

const fn cap(flag: u64, name: &'static str, reason: &'static str) -> Capability {
    Capability { flag, name, reason }
}

/// Requested whenever the kernel offers them.
pub const WANTED: &[Capability] = &[
    cap(
        abi::FUSE_EXPLICIT_INVAL_DATA,
        "EXPLICIT_INVAL_DATA",
        "the kernel keeps a file's pages when a GETATTR shows a new size: this node's own \
         writes keep them right, and another node changes a file only after this one gave \
         up its cluster lock, dropping them first (etcfs's cache locks; without it a file \
         read right after it was written lost its page cache at the next GETATTR)",
    ),
    cap(
        abi::FUSE_ASYNC_READ,
        "ASYNC_READ",
        "several READs of one file in flight, so readahead and parallel readers overlap",
    ),
    cap(
        abi::FUSE_ATOMIC_O_TRUNC,
        "ATOMIC_O_TRUNC",
        "O_TRUNC is applied by OPEN itself, saving the SETATTR round trip",
    ),
    cap(
        abi::FUSE_BIG_WRITES,
        "BIG_WRITES",
        "writes larger than one page (implied by MAX_PAGES on new kernels; harmless)",
    ),
    cap(
        abi::FUSE_DO_READDIRPLUS,
        "DO_READDIRPLUS",
        "READDIRPLUS returns attributes with names: one request instead of N LOOKUPs",
    ),
    cap(
        abi::FUSE_READDIRPLUS_AUTO,
        "READDIRPLUS_AUTO",
        "the kernel uses READDIRPLUS only when the listing is followed by stats",
    ),
    cap(
        abi::FUSE_ASYNC_DIO,
        "ASYNC_DIO",
        "direct I/O is split into concurrent requests instead of one at a time",
    ),
    cap(
        abi::FUSE_PARALLEL_DIROPS,
        "PARALLEL_DIROPS",
        "LOOKUPs and READDIRs of one directory run concurrently; handlers are thread-safe",
    ),
    cap(
        abi::FUSE_ABORT_ERROR,
        "ABORT_ERROR",
        "after an abort the device reports ECONNABORTED, telling it apart from an unmount",
    ),
    cap(
        abi::FUSE_MAX_PAGES,
        "MAX_PAGES",
        "requests of up to InitConfig::max_pages pages (1 MiB) instead of 32",
    ),
    cap(
        abi::FUSE_CACHE_SYMLINKS,
        "CACHE_SYMLINKS",
        "symlink targets never change after creation, so caching READLINK is always safe",
    ),
    cap(
        abi::FUSE_HANDLE_KILLPRIV_V2,
        "HANDLE_KILLPRIV_V2",
        "the filesystem clears suid/sgid on write/truncate/chown (flagged in the request), \
         sparing the kernel a SETATTR round trip per write to such files",
    ),
    cap(
        abi::FUSE_INIT_EXT,
        "INIT_EXT",
        "carries capability bits 32.. in flags2; needed for everything below",
    ),
    cap(
        abi::FUSE_HAS_EXPIRE_ONLY,
        "HAS_EXPIRE_ONLY",
        "cluster invalidation can expire a dentry without dropping it (keeps mountpoints)",
    ),
    cap(
        abi::FUSE_DIRECT_IO_ALLOW_MMAP,
        "DIRECT_IO_ALLOW_MMAP",
        "files opened FOPEN_DIRECT_IO (shared across nodes) can still be mmapped shared",
    ),
];

/// Requested when [`InitConfig`] asks for them (and the kernel offers them).
pub const CONFIGURED: &[Capability] = &[
    cap(
        abi::FUSE_OVER_IO_URING,
        "OVER_IO_URING",
        "InitConfig::over_io_uring: requests come through per-CPU io_uring queues",
    ),
    cap(
        abi::FUSE_SPLICE_WRITE,
        "SPLICE_WRITE",
        "InitConfig::splice_write: the /dev/fuse transport splices READ replies into the \
         device from the file holding the data",
    ),
    cap(
        abi::FUSE_SPLICE_MOVE,
        "SPLICE_MOVE",
        "InitConfig::splice_write: lets the kernel move (not copy) spliced reply pages",
    ),
    cap(
        abi::FUSE_POSIX_LOCKS,
        "POSIX_LOCKS",
        "InitConfig::locks: fcntl record locks are the filesystem's (GETLK/SETLK/SETLKW, \
         released at FLUSH), so a cluster filesystem can make them exclude across nodes; \
         without it the kernel keeps them node-local (it has no fallback after ENOSYS)",
    ),
    cap(
        abi::FUSE_FLOCK_LOCKS,
        "FLOCK_LOCKS",
        "InitConfig::locks: flock(2) goes to the filesystem too (SETLK with FUSE_LK_FLOCK, \
         released at RELEASE with FLOCK_UNLOCK)",
    ),
    cap(
        abi::FUSE_POSIX_ACL,
        "POSIX_ACL",
        "InitConfig::acls: POSIX ACLs enforced as on ext4: the kernel checks access ACLs itself from the \
         system.posix_acl_access xattr it reads once per inode and caches (dropped by \
         SETATTR, SETXATTR and INVAL_INODE, which this node sends when another changes \
         the inode); the filesystem keeps mode and ACL in step and inherits default ACLs \
         at create. Implies default_permissions",
    ),
    cap(
        abi::FUSE_DONT_MASK,
        "DONT_MASK",
        "InitConfig::acls: with POSIX_ACL the umask must not apply under a directory with a default ACL: \
         creates arrive unmasked with the umask beside them and the filesystem applies it \
         only when the parent has no default ACL",
    ),
];

/// Never requested.
pub const REFUSED: &[Capability] = &[
    cap(
        abi::FUSE_FILE_OPS,
        "FILE_OPS",
        "never implemented by the kernel",
    ),
    cap(
        abi::FUSE_EXPORT_SUPPORT,
        "EXPORT_SUPPORT",
        "means handling LOOKUP of \".\" and \"..\" for NFS export and open_by_handle_at; \
         etcfs is not meant to be re-exported",
    ),
    cap(
        abi::FUSE_SPLICE_READ,
        "SPLICE_READ",
        "requests are read into io_uring buffers; WRITE data must land in aligned memory \
         for O_DIRECT to the shared device, not in a pipe",
    ),
    cap(
        abi::FUSE_HAS_IOCTL_DIR,
        "HAS_IOCTL_DIR",
        "no ioctls are implemented",
    ),
    cap(
        abi::FUSE_WRITEBACK_CACHE,
        "WRITEBACK_CACHE",
        "the kernel would own size and mtime and flush late; another node's writes must be \
         visible and the cluster lock model needs write-through (reply = data on device)",
    ),
    cap(
        abi::FUSE_NO_OPEN_SUPPORT,
        "NO_OPEN_SUPPORT",
        "OPEN is where a node decides cache flags and takes cluster locks; it must be sent",
    ),
    cap(
        abi::FUSE_HANDLE_KILLPRIV,
        "HANDLE_KILLPRIV",
        "superseded by HANDLE_KILLPRIV_V2",
    ),
    cap(
        abi::FUSE_NO_OPENDIR_SUPPORT,
        "NO_OPENDIR_SUPPORT",
        "as NO_OPEN_SUPPORT, for OPENDIR",
    ),
    cap(
        abi::FUSE_AUTO_INVAL_DATA,
        "AUTO_INVAL_DATA",
        "it drops the whole page cache whenever a GETATTR shows an mtime the kernel did not \
         have, which is after every write of this node (write-through: the kernel never \
         moves a file's mtime itself), and it drops it after checking that no write is in \
         progress: an O_APPEND write that starts meanwhile puts its data in a cached page \
         that is then dropped, a reader at EOF re-reads that page before the WRITE is \
         served, and the zeros past the old EOF become data when the WRITE grows the size \
         (issue 12: NUL records read by tail -f, on memfs too). Other nodes' writes reach \
         the page cache through the watch's INVAL_INODE, and a changed size still drops it",
    ),
    cap(
        abi::FUSE_MAP_ALIGNMENT,
        "MAP_ALIGNMENT",
        "DAX only (virtiofs)",
    ),
    cap(abi::FUSE_SUBMOUNTS, "SUBMOUNTS", "virtiofs only"),
    cap(
        abi::FUSE_SETXATTR_EXT,
        "SETXATTR_EXT",
        "its only use is the ACL kill-sgid flag; without it SETXATTR keeps the 8-byte \
         argument that request::arg0_len assumes",
    ),
    cap(
        abi::FUSE_INIT_RESERVED,
        "INIT_RESERVED",
        "reserved by the kernel",
    ),
    cap(
        abi::FUSE_SECURITY_CTX,
        "SECURITY_CTX",
        "no LSM labels are stored; it would append security-context extensions to creates",
    ),
    cap(
        abi::FUSE_HAS_INODE_DAX,
        "HAS_INODE_DAX",
        "DAX only (virtiofs)",
    ),
    cap(
        abi::FUSE_CREATE_SUPP_GROUP,
        "CREATE_SUPP_GROUP",
        "supplementary groups matter only to filesystems that check permissions themselves",
    ),
    cap(
        abi::FUSE_PASSTHROUGH,
        "PASSTHROUGH",
        "file data lives on a shared device under our own extent maps, not in a local \
         backing file the kernel could pass through to (and it needs CAP_SYS_ADMIN)",
    ),
    cap(
        abi::FUSE_NO_EXPORT_SUPPORT,
        "NO_EXPORT_SUPPORT",
        "leaves name_to_handle_at working (fanotify FID reporting needs it); handles are \
         nodeid+generation, stable for the mount's life",
    ),
    cap(
        abi::FUSE_HAS_RESEND,
        "HAS_RESEND",
        "we never send NOTIFY_RESEND: a restarted daemon means a new mount",
    ),
    cap(
        abi::FUSE_ALLOW_IDMAP,
        "ALLOW_IDMAP",
        "idmapped mounts would send FUSE_INVALID_UIDGID, which nothing here handles",
    ),
    cap(
        abi::FUSE_REQUEST_TIMEOUT,
        "REQUEST_TIMEOUT",
        "an expired request aborts the whole connection; an etcd leader election can take \
         seconds, so we bound our own waits instead",
    ),
];

/// What the daemon wants from INIT besides the capability sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitConfig {
    /// Largest WRITE payload. The ring needs payload buffers of at least
    /// `max(max_write, max_pages * 4096)`; the splice path needs `max_write <= 512 KiB`
    /// (pipes are capped at 1 MiB).
    pub max_write: u32,
    /// Largest request in pages (needs `FUSE_MAX_PAGES`; the kernel caps it at
    /// `fs.fuse.max_pages_limit`, 256 here).
    pub max_pages: u16,
    /// Ask for FUSE-over-io_uring (only if the kernel offers it).
    pub over_io_uring: bool,
    /// Ask for SPLICE_WRITE|SPLICE_MOVE so `/dev/fuse` READ replies can be spliced.
    pub splice_write: bool,
    /// Ask for POSIX_LOCKS|FLOCK_LOCKS: the handler serves GETLK/SETLK/SETLKW
    /// (`Handler::serves_locks`).
    pub locks: bool,
    /// Ask for POSIX_ACL|DONT_MASK: the handler keeps ACLs and applies the umask itself
    /// (`Handler::serves_acls`).
    pub acls: bool,
    /// Background requests (readahead, async direct I/O) the kernel keeps in flight.
    pub max_background: u16,
    /// Background requests beyond which the kernel reports the bdi congested.
    pub congestion_threshold: u16,
    /// Timestamp granularity in nanoseconds.
    pub time_gran: u32,
}

impl Default for InitConfig {
    fn default() -> Self {
        InitConfig {
            max_write: 1 << 20,
            max_pages: 256,
            over_io_uring: false,
            splice_write: false,
            locks: false,
            acls: false,
            max_background: 64,
            congestion_threshold: 48,
            time_gran: 1,
        }
    }
}

/// The outcome of INIT, kept by the transport and handed to `Handler::init`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    pub major: u32,
    /// `min(kernel, 45)`: the protocol both sides speak.
    pub minor: u32,
    /// Capability bits we enabled (a subset of `kernel_flags`).
    pub flags: u64,
    /// Capability bits the kernel offered.
    pub kernel_flags: u64,
    /// What the kernel will use: at least 4096.
    pub max_write: u32,
    /// Pages per request: as requested with MAX_PAGES, else the kernel's default of 32.
    pub max_pages: u16,
    /// The kernel offered FUSE-over-io_uring and we asked for it.
    pub over_io_uring: bool,
    pub max_readahead: u32,
}

impl Negotiated {
    /// Whether capability `flag` is on.
    pub fn has(&self, flag: u64) -> bool {
        self.flags & flag == flag
    }

    /// The largest request payload the kernel may send or accept: the size the ring's
    /// payload buffers must have, `max(8192, max_write, max_pages * 4096)`.
    pub fn payload_max(&self) -> usize {
        let pages = usize::from(self.max_pages).saturating_mul(PAGE_SIZE);
        let write = usize::try_from(self.max_write).unwrap_or(usize::MAX);
        abi::FUSE_MIN_READ_BUFFER.max(write).max(pages)
    }
}

/// Why INIT cannot be answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InitError {
    #[error("kernel speaks FUSE protocol {major}.x; this daemon speaks 7.x only")]
    Major { major: u32 },
    #[error(
        "kernel speaks FUSE protocol 7.{minor}; this daemon needs 7.{} or newer",
        FUSE_MIN_MINOR_VERSION
    )]
    MinorTooOld { minor: u32 },
    #[error("invalid INIT configuration: {0}")]
    Config(&'static str),
    #[error("expected an INIT request")]
    NotInit,
}

/// Whether the kernel offers FUSE-over-io_uring (it does only with `enable_uring=Y`).
pub fn kernel_offers_uring(kernel: &KernelInit) -> bool {
    kernel.flags & abi::FUSE_OVER_IO_URING != 0
}

/// The capability bits we would ask for under `cfg`, before intersecting with the kernel.
pub fn requested_flags(cfg: &InitConfig) -> u64 {
    let mut want = WANTED.iter().fold(0, |acc, c| acc | c.flag);
    if cfg.over_io_uring {
        want |= abi::FUSE_OVER_IO_URING;
    }
    if cfg.splice_write {
        want |= abi::FUSE_SPLICE_WRITE | abi::FUSE_SPLICE_MOVE;
    }
    if cfg.locks {
        want |= abi::FUSE_POSIX_LOCKS | abi::FUSE_FLOCK_LOCKS;
    }
    if cfg.acls {
        want |= abi::FUSE_POSIX_ACL | abi::FUSE_DONT_MASK;
    }
    want
}

/// Answers INIT: the reply to send and what was agreed.
pub fn negotiate(
    kernel: &KernelInit,
    cfg: &InitConfig,
) -> Result<(InitOut, Negotiated), InitError> {
    if kernel.major != abi::FUSE_KERNEL_VERSION {
        return Err(InitError::Major {
            major: kernel.major,
        });
    }
    if kernel.minor < FUSE_MIN_MINOR_VERSION {
        return Err(InitError::MinorTooOld {
            minor: kernel.minor,
        });
    }
    if cfg.max_pages == 0 {
        return Err(InitError::Config("max_pages must be at least 1"));
    }
    let minor = kernel.minor.min(FUSE_KERNEL_MINOR_VERSION);
    let mut flags = requested_flags(cfg) & kernel.flags;
    if flags >> 32 == 0 {
        // INIT_EXT announces flags2; with nothing in flags2 it is still harmless, but keep
        // the reply minimal and obviously consistent.
        flags &= !abi::FUSE_INIT_EXT;
    } else if kernel.flags & abi::FUSE_INIT_EXT == 0 {
        // Can't happen (the decoder only reads flags2 under INIT_EXT); never send flags2
        // bits the kernel would not read.
        flags &= u64::from(u32::MAX);
    }
    let max_pages = if flags & abi::FUSE_MAX_PAGES != 0 {
        cfg.max_pages
    } else {
        0
    };
    let out = InitOut {
        major: abi::FUSE_KERNEL_VERSION,
        minor,
        max_readahead: kernel.max_readahead,
        flags: flags as u32,
        max_background: cfg.max_background,
        congestion_threshold: cfg.congestion_threshold,
        max_write: cfg.max_write,
        time_gran: cfg.time_gran,
        max_pages,
        map_alignment: 0,
        flags2: (flags >> 32) as u32,
        max_stack_depth: 0,
        request_timeout: 0,
        unused: [0; 11],
    };
    let negotiated = Negotiated {
        major: abi::FUSE_KERNEL_VERSION,
        minor,
        flags,
        kernel_flags: kernel.flags,
        max_write: cfg.max_write.max(4096),
        max_pages: if max_pages == 0 {
            KERNEL_DEFAULT_MAX_PAGES
        } else {
            max_pages
        },
        over_io_uring: flags & abi::FUSE_OVER_IO_URING != 0,
        max_readahead: kernel.max_readahead,
    };
    Ok((out, negotiated))
}

/// [`negotiate`] for a decoded request, which must be INIT.
pub fn negotiate_op(
    op: &Operation<'_>,
    cfg: &InitConfig,
) -> Result<(InitOut, Negotiated), InitError> {
    match op {
        Operation::Init(kernel) => negotiate(kernel, cfg),
        _ => Err(InitError::NotInit),
    }
}

/// Pages per request when FUSE_MAX_PAGES is not negotiated.
const KERNEL_DEFAULT_MAX_PAGES: u16 = 32;

/// Capability names for logs, e.g. `"ASYNC_READ|MAX_PAGES"`; unknown bits in hex.
pub fn flag_names(flags: u64) -> String {
    let mut names: Vec<String> = WANTED
        .iter()
        .chain(CONFIGURED)
        .chain(REFUSED)
        .filter(|c| flags & c.flag != 0)
        .map(|c| c.name.to_string())
        .collect();
    let unknown = flags & !abi::FUSE_INIT_KNOWN_MASK;
    if unknown != 0 {
        names.push(format!("{unknown:#x}"));
    }
    names.join("|")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

    use super::*;

    fn all_sets() -> impl Iterator<Item = &'static Capability> {
        WANTED.iter().chain(CONFIGURED).chain(REFUSED)
    }

    #[test]
    fn every_known_flag_has_exactly_one_decision() {
        for bit in 0..64 {
            let flag = 1u64 << bit;
            let n = all_sets().filter(|c| c.flag == flag).count();
            let expected = usize::from(flag & abi::FUSE_INIT_KNOWN_MASK != 0);
            assert_eq!(n, expected, "bit {bit} ({})", flag_names(flag));
        }
        assert!(all_sets().all(|c| !c.reason.is_empty() && c.flag.count_ones() == 1));
    }

    fn kernel(flags: u64) -> KernelInit {
        KernelInit {
            major: 7,
            minor: 45,
            max_readahead: 128 << 10,
            flags,
        }
    }

    #[test]
    fn only_offered_flags_are_requested() {
        let offered = abi::FUSE_ASYNC_READ | abi::FUSE_WRITEBACK_CACHE | abi::FUSE_MAX_PAGES;
        let (out, n) = negotiate(&kernel(offered), &InitConfig::default()).unwrap();
        assert_eq!(n.flags, abi::FUSE_ASYNC_READ | abi::FUSE_MAX_PAGES);
        assert_eq!(u64::from(out.flags), n.flags);
        assert_eq!((out.flags2, out.max_pages, n.max_pages), (0, 256, 256));
        assert_eq!(n.kernel_flags, offered);
    }

    #[test]
    fn uring_needs_config_and_offer() {
        let offered = abi::FUSE_INIT_EXT | abi::FUSE_OVER_IO_URING | abi::FUSE_SPLICE_WRITE;
        let cfg = InitConfig {
            over_io_uring: true,
            ..InitConfig::default()
        };
        let (out, n) = negotiate(&kernel(offered), &cfg).unwrap();
        assert!(n.over_io_uring);
        assert_eq!(out.flags2, 1 << 9);
        assert_ne!(out.flags & (abi::FUSE_INIT_EXT as u32), 0);
        assert_eq!(out.flags & (abi::FUSE_SPLICE_WRITE as u32), 0);

        let (_, n) = negotiate(&kernel(offered), &InitConfig::default()).unwrap();
        assert!(!n.over_io_uring);
        assert_eq!(n.flags, 0, "INIT_EXT alone is not sent");
        let (_, n) = negotiate(&kernel(abi::FUSE_INIT_EXT), &cfg).unwrap();
        assert!(!n.over_io_uring);
        assert!(kernel_offers_uring(&kernel(offered)));
    }

    /// Issue 12: AUTO_INVAL_DATA let a reader at EOF see NUL bytes past the old size while
    /// another process appended; it must not come back with a reshuffle of the lists.
    #[test]
    fn auto_inval_data_is_never_requested() {
        let all = abi::FUSE_INIT_KNOWN_MASK;
        let cfg = InitConfig {
            over_io_uring: true,
            splice_write: true,
            ..InitConfig::default()
        };
        assert_eq!(requested_flags(&cfg) & abi::FUSE_AUTO_INVAL_DATA, 0);
        let (out, n) = negotiate(&kernel(all), &cfg).unwrap();
        assert!(!n.has(abi::FUSE_AUTO_INVAL_DATA));
        assert_eq!(u64::from(out.flags) & abi::FUSE_AUTO_INVAL_DATA, 0);
        assert!(REFUSED.iter().any(|c| c.flag == abi::FUSE_AUTO_INVAL_DATA));
    }

    /// Issue 13: locks are cluster-wide only if the kernel sends them to us, and a
    /// handler that does not serve them must not get them (ENOSYS would reach the caller).
    #[test]
    fn locks_go_to_the_filesystem_only_when_it_serves_them() {
        let offered = abi::FUSE_POSIX_LOCKS | abi::FUSE_FLOCK_LOCKS;
        let (out, n) = negotiate(&kernel(offered), &InitConfig::default()).unwrap();
        assert_eq!((n.flags, out.flags), (0, 0));
        let cfg = InitConfig {
            locks: true,
            ..InitConfig::default()
        };
        let (out, n) = negotiate(&kernel(offered), &cfg).unwrap();
        assert!(n.has(abi::FUSE_POSIX_LOCKS) && n.has(abi::FUSE_FLOCK_LOCKS));
        assert_eq!(u64::from(out.flags), offered);
    }

    /// Issue 15: ACLs only for a handler that keeps them (it must apply the umask too).
    #[test]
    fn acls_only_when_the_filesystem_keeps_them() {
        let offered = abi::FUSE_POSIX_ACL | abi::FUSE_DONT_MASK;
        let (out, _) = negotiate(&kernel(offered), &InitConfig::default()).unwrap();
        assert_eq!(out.flags, 0);
        let cfg = InitConfig {
            acls: true,
            ..InitConfig::default()
        };
        let (out, n) = negotiate(&kernel(offered), &cfg).unwrap();
        assert!(n.has(abi::FUSE_POSIX_ACL) && n.has(abi::FUSE_DONT_MASK));
        assert_eq!(u64::from(out.flags), offered);
    }

    #[test]
    fn no_max_pages_means_kernel_default() {
        let (out, n) = negotiate(&kernel(abi::FUSE_ASYNC_READ), &InitConfig::default()).unwrap();
        assert_eq!((out.max_pages, n.max_pages), (0, 32));
        assert_eq!(n.payload_max(), 1 << 20);
    }

    #[test]
    fn version_checks() {
        let mut k = kernel(0);
        k.major = 8;
        assert_eq!(
            negotiate(&k, &InitConfig::default()),
            Err(InitError::Major { major: 8 })
        );
        let mut k = kernel(0);
        k.minor = 30;
        let e = negotiate(&k, &InitConfig::default()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "kernel speaks FUSE protocol 7.30; this daemon needs 7.31 or newer"
        );
        let mut k = kernel(0);
        k.minor = 50;
        assert_eq!(negotiate(&k, &InitConfig::default()).unwrap().0.minor, 45);
        assert_eq!(
            negotiate_op(&Operation::Statfs, &InitConfig::default()),
            Err(InitError::NotInit)
        );
    }

    #[test]
    fn flag_names_for_logs() {
        assert_eq!(
            flag_names(abi::FUSE_ASYNC_READ | abi::FUSE_MAX_PAGES),
            "ASYNC_READ|MAX_PAGES"
        );
        assert_eq!(flag_names(1 << 50), "0x4000000000000");
    }
}
