//! A FUSE server with no filesystem in it: one file, `/big`, whose bytes are those of a
//! backing file at the same offsets, read through fusedev's transport exactly as etcfs
//! reads its device (a READ answers with a device read plan). `benches/fuse_ceiling.sh`
//! runs it beside etcfs, so that what the transport and the device path cost and what
//! etcfs's filesystem adds on top can be told apart (issue 17).
//!
//! usage: devprobe BACKING MOUNTPOINT [--transport uring|devfuse] [--device-spin-us N]
//!            [--ring-linger-us N] [--ring-share-above N] [--ring-entries N]
//! Prints READY once it serves, and serves until the mountpoint is unmounted
//! (`umount MOUNTPOINT`). Needs root.

use std::{
    fs::File,
    os::{fd::AsRawFd, unix::fs::OpenOptionsExt},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use fusedev::{
    abi::{Attr, AttrOut, EntryOut, Kstatfs, OpenOut},
    errno::Errno,
    mount::{Mount, MountOptions},
    opcode::Opcode,
    reply,
    request::{Operation, Request},
    server::{Handler, ReadPlan, Reply, RequestCtx, Segment},
    transport::{Session, SessionConfig, TransportChoice},
};

const BIG_INO: u64 = 2;
const BLOCK: u64 = 4096;
const LONG: Duration = Duration::from_secs(3600);

struct Backed {
    file: File,
    size: u64,
}

impl Backed {
    fn attr(&self, ino: u64) -> Attr {
        let (mode, size) = if ino == BIG_INO {
            (libc::S_IFREG | 0o644, self.size)
        } else {
            (libc::S_IFDIR | 0o755, 0)
        };
        Attr {
            ino,
            size,
            blocks: size.div_ceil(512),
            mode,
            nlink: 1,
            blksize: BLOCK as u32,
            ..Attr::default()
        }
    }

    /// The block-aligned device range around the request, as etcfs plans a read of one
    /// extent.
    fn read(&self, offset: u64, size: u32) -> Reply {
        let end = offset.saturating_add(u64::from(size)).min(self.size);
        if offset >= end {
            return Reply::Read(ReadPlan::default());
        }
        let start = offset / BLOCK * BLOCK;
        let aligned_end = end.div_ceil(BLOCK) * BLOCK;
        let len = usize::try_from(aligned_end - start).expect("a READ is at most 1 MiB");
        Reply::Read(ReadPlan {
            segments: vec![Segment::Device {
                fd: self.file.as_raw_fd(),
                offset: start,
                len,
            }],
            skip: usize::try_from(offset - start).expect("below one block"),
            len: usize::try_from(end - offset).expect("a READ is at most 1 MiB"),
            hold: None,
        })
    }
}

impl Handler for Backed {
    fn handle(&self, _ctx: &RequestCtx<'_>, req: &Request<'_>, out: &mut [u8]) -> Reply {
        let fits = |n: Option<usize>| Reply::Bytes(n.expect("fixed replies fit the out buffer"));
        match &req.op {
            Operation::Lookup { name } if req.header.nodeid == 1 && *name == b"big" => fits(
                reply::entry(out, &EntryOut::new(1, LONG, LONG, self.attr(BIG_INO))),
            ),
            Operation::Lookup { .. } => fits(reply::entry(out, &EntryOut::negative(LONG))),
            Operation::Getattr { .. } => fits(reply::attr(
                out,
                &AttrOut::new(LONG, self.attr(req.header.nodeid)),
            )),
            Operation::Open { .. } | Operation::Opendir { .. } => {
                fits(reply::open(out, &OpenOut::default()))
            }
            Operation::Read { offset, size, .. } if req.header.nodeid == BIG_INO => {
                self.read(*offset, *size)
            }
            Operation::Statfs => fits(reply::statfs(out, &Kstatfs::default())),
            Operation::Release { .. } | Operation::Releasedir { .. } | Operation::Flush { .. } => {
                Reply::Bytes(0)
            }
            Operation::Forget { .. } | Operation::BatchForget { .. } => Reply::None,
            _ => Reply::Error(Errno::ENOSYS),
        }
    }

    fn stable_fds(&self) -> Vec<std::os::fd::RawFd> {
        vec![self.file.as_raw_fd()]
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: devprobe BACKING MOUNTPOINT [--transport uring|devfuse] [--device-spin-us N] \
         [--ring-linger-us N] [--ring-share-above N] [--ring-entries N]"
    );
    std::process::exit(2)
}

fn main() {
    let mut positional: Vec<PathBuf> = Vec::new();
    // etcfs mount's defaults.
    let mut cfg = SessionConfig {
        transport: TransportChoice::Uring,
        cpus: uring::cpu::allowed_cpus().expect("allowed CPUs"),
        ring_entries_per_queue: 0,
        ring_share_above: 16,
        devfuse_reads_per_core: 8,
        device_spin: Duration::from_micros(100),
        ring_linger: Duration::from_micros(80),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut number = || -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| usage())
        };
        match a.as_str() {
            "--transport" => {
                cfg.transport = match args.next().as_deref() {
                    Some("uring") => TransportChoice::Uring,
                    Some("devfuse") => TransportChoice::Devfuse,
                    _ => usage(),
                }
            }
            "--device-spin-us" => cfg.device_spin = Duration::from_micros(number()),
            "--ring-linger-us" => cfg.ring_linger = Duration::from_micros(number()),
            "--ring-share-above" => cfg.ring_share_above = number() as usize,
            "--ring-entries" => cfg.ring_entries_per_queue = number() as usize,
            s if s.starts_with('-') => usage(),
            _ => positional.push(a.into()),
        }
    }
    let [backing, mountpoint] = positional.as_slice() else {
        usage()
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(backing)
        .unwrap_or_else(|e| panic!("open {}: {e}", backing.display()));
    let size = file.metadata().expect("stat the backing file").len();
    let opts = MountOptions {
        fsname: "devprobe".into(),
        allow_other: false,
        noatime: true,
        read_only: true,
        noexec: false,
        uid: 0,
        gid: 0,
    };
    let mnt = Arc::new(Mount::new(mountpoint, &opts).expect("mount"));
    let registry = perf::Registry::new(
        Opcode::NAMES.to_vec(),
        fusedev::transport::COUNTERS.to_vec(),
        cfg.cpus.len() + 1,
        false,
    );
    let session = Session::start(mnt, Arc::new(Backed { file, size }), registry, &cfg, true)
        .expect("start serving");
    // What benches/lib.sh's start_probe_server waits for.
    println!("READY");
    session.wait();
}
