//! EtcFs driven through `Handler::handle` with encoded requests, on meta's in-memory etcd
//! model and an in-memory device (contexts that cannot defer: every operation runs inline).

use std::{path::Path, sync::Arc, time::Duration};

use fusedev::{
    abi::{
        AttrOut, Dirent, EntryOut, FromBytes, GetxattrOut, Kstatfs, LseekOut, OpenOut, SetattrIn,
        WriteOut, FATTR_GID, FATTR_MODE, FATTR_MTIME, FATTR_SIZE, FATTR_UID, FUSE_ROOT_ID,
        RENAME_EXCHANGE, RENAME_NOREPLACE, XATTR_CREATE, XATTR_REPLACE,
    },
    errno::Errno,
    request::{self, Operation, Request},
    server::{Handler, Reply, RequestCtx},
};
use meta::{
    clock::SystemClock, keys::Keyspace, kv::KvBackend, model::MemEtcd, pipeline::Pipeline,
    session::SessionConfig, types::SessionId,
};

use super::{connect_backend, mkfs_on, pipeline_config, CacheOpts, Dev, EtcFs};
use crate::data::{
    device::mem::{MemDev, MemFaults},
    BLOCK_SIZE,
};

pub(super) const ROOT: u64 = FUSE_ROOT_ID;
/// 16 MiB device with 64-block (256 KiB) groups: 59 groups, 2 claimed at mount, more on
/// demand.
const DEV_BYTES: u64 = 16 << 20;
pub(super) const AG_BLOCKS: u64 = 64;

pub(super) fn parse<T: FromBytes>(b: &[u8]) -> T {
    T::read_from_prefix(b).expect("reply too short").0
}

pub(super) struct Fx {
    pub(super) fs: EtcFs,
    pub(super) kv: Arc<MemEtcd>,
    dev: MemDev,
    out: Vec<u8>,
    unique: u64,
}

pub(super) fn format(
    kv: &Arc<MemEtcd>,
    dev: &MemDev,
    force: bool,
) -> anyhow::Result<super::MkfsReport> {
    let clock = Arc::new(SystemClock::new());
    let p = Pipeline::start(
        connect_backend(kv.clone() as Arc<dyn KvBackend>),
        Keyspace::new("t").unwrap(),
        SessionId(u64::MAX),
        clock,
        pipeline_config(),
    )
    .unwrap();
    mkfs_on(
        &p.client(),
        &mut dev.clone(),
        Path::new("/dev/mem0"),
        "t",
        AG_BLOCKS,
        force,
    )
}

pub(super) fn mount(kv: &Arc<MemEtcd>, dev: &MemDev) -> EtcFs {
    mount_with(kv, dev, &CacheOpts::uniform(Duration::from_secs(1)))
}

fn mount_with(kv: &Arc<MemEtcd>, dev: &MemDev, opts: &CacheOpts) -> EtcFs {
    mount_on(kv.clone(), dev, opts)
}

/// A mount whose etcd is `kv` (the model, or something in front of it).
pub(super) fn mount_on(kv: Arc<dyn KvBackend>, dev: &MemDev, opts: &CacheOpts) -> EtcFs {
    let clock = Arc::new(SystemClock::new());
    let p = Pipeline::start_deferred(
        connect_backend(kv),
        Keyspace::new("t").unwrap(),
        clock,
        meta::pipeline::Config {
            read_only: opts.read_only,
            ..pipeline_config()
        },
    )
    .unwrap();
    let geometry = super::check_filesystem(&p.client(), &Dev::Mem(dev.clone())).unwrap();
    let s = p
        .register_session_with(
            &SessionConfig::new("test"),
            Some(super::group_layout(&geometry)),
        )
        .unwrap();
    EtcFs::open_with(p, s, Dev::Mem(dev.clone()), opts, 4).unwrap()
}

impl Fx {
    pub(super) fn new() -> Fx {
        Fx::with_opts(&CacheOpts::uniform(Duration::from_secs(1)))
    }

    /// A filesystem formatted for the test, mounted with `opts`.
    fn with_opts(opts: &CacheOpts) -> Fx {
        let kv = Arc::new(MemEtcd::new(Arc::new(SystemClock::new())));
        let dev = MemDev::new(DEV_BYTES);
        format(&kv, &dev, false).unwrap();
        Fx {
            fs: mount_with(&kv, &dev, opts),
            kv,
            dev,
            out: vec![0; 2 << 20],
            unique: 1,
        }
    }

    /// Another mount (its own session) of the filesystem this one serves, with `opts`.
    fn another_mount(&self, opts: &CacheOpts) -> Fx {
        Fx {
            fs: mount_with(&self.kv, &self.dev, opts),
            kv: self.kv.clone(),
            dev: self.dev.clone(),
            out: vec![0; 2 << 20],
            unique: 1,
        }
    }
}

/// FUSE requests encoded, decoded and handled as the kernel would send them, on one
/// connection (its own reply buffer and request ids): every test's way into the filesystem.
pub(super) trait Requests {
    /// The filesystem, the reply buffer and the next request id.
    fn parts(&mut self) -> (&EtcFs, &mut Vec<u8>, &mut u64);

    fn call(&mut self, nodeid: u64, op: Operation<'_>) -> Reply {
        let (fs, out, unique) = self.parts();
        let mut req = Request::new(*unique, nodeid, op);
        req.header.uid = 1000;
        req.header.gid = 100;
        *unique += 1;
        let mut bytes = Vec::new();
        req.encode(&mut bytes);
        let decoded = request::decode(&bytes).expect("test request decodes");
        fs.handle(&RequestCtx::new(0), &decoded, out)
    }

    fn ok(&mut self, nodeid: u64, op: Operation<'_>) -> Vec<u8> {
        let d = format!("{op:?}");
        match self.call(nodeid, op) {
            Reply::Bytes(n) => self.parts().1[..n].to_vec(),
            other => panic!("{d}: expected bytes, got {other:?}"),
        }
    }

    fn err(&mut self, nodeid: u64, op: Operation<'_>) -> Errno {
        let d = format!("{op:?}");
        match self.call(nodeid, op) {
            Reply::Error(e) => e,
            other => panic!("{d}: expected an error, got {other:?}"),
        }
    }

    fn entry(&mut self, nodeid: u64, op: Operation<'_>) -> EntryOut {
        parse(&self.ok(nodeid, op))
    }

    fn lookup(&mut self, parent: u64, name: &[u8]) -> EntryOut {
        self.entry(parent, Operation::Lookup { name })
    }

    fn mkdir(&mut self, parent: u64, name: &[u8]) -> u64 {
        self.entry(
            parent,
            Operation::Mkdir {
                name,
                mode: 0o755,
                umask: 0o022,
            },
        )
        .nodeid
    }

    /// Creates and opens a file: (ino, fh).
    fn create(&mut self, parent: u64, name: &[u8]) -> (u64, u64) {
        let b = self.ok(
            parent,
            Operation::Create {
                name,
                flags: libc::O_RDWR as u32,
                mode: 0o644,
                umask: 0o022,
                open_flags: 0,
            },
        );
        let e: EntryOut = parse(&b);
        let o: OpenOut = parse(&b[size_of::<EntryOut>()..]);
        (e.nodeid, o.fh)
    }

    fn open(&mut self, ino: u64) -> u64 {
        let o: OpenOut = parse(&self.ok(
            ino,
            Operation::Open {
                flags: libc::O_RDWR as u32,
                open_flags: 0,
            },
        ));
        o.fh
    }

    fn release(&mut self, ino: u64, fh: u64) {
        self.ok(
            ino,
            Operation::Release {
                fh,
                flags: 0,
                release_flags: 0,
                lock_owner: 0,
            },
        );
    }

    fn write(&mut self, ino: u64, fh: u64, offset: u64, data: &[u8]) {
        let w: WriteOut = parse(&self.ok(
            ino,
            Operation::Write {
                fh,
                offset,
                data,
                write_flags: 0,
                flags: 0,
            },
        ));
        assert_eq!(w.size as usize, data.len());
    }

    fn read(&mut self, ino: u64, fh: u64, offset: u64, size: u32) -> Vec<u8> {
        self.ok(
            ino,
            Operation::Read {
                fh,
                offset,
                size,
                flags: 0,
            },
        )
    }

    fn getattr(&mut self, ino: u64) -> AttrOut {
        parse(&self.ok(ino, Operation::Getattr { fh: None }))
    }

    fn names(&mut self, dir: u64) -> Vec<(Vec<u8>, u64)> {
        let o: OpenOut = parse(&self.ok(dir, Operation::Opendir { flags: 0 }));
        let mut out = Vec::new();
        let mut offset = 0;
        loop {
            // A small buffer so the listing takes several calls.
            let b = self.ok(
                dir,
                Operation::Readdir {
                    fh: o.fh,
                    offset,
                    size: 200,
                },
            );
            if b.is_empty() {
                break;
            }
            let mut at = 0;
            while at < b.len() {
                let d: Dirent = parse(&b[at..]);
                let name = b[at + 24..at + 24 + d.namelen as usize].to_vec();
                out.push((name, d.off));
                offset = d.off;
                at += (24 + d.namelen as usize).next_multiple_of(8);
            }
        }
        self.ok(dir, Operation::Releasedir { fh: o.fh });
        out
    }

    fn statfs(&mut self) -> Kstatfs {
        parse(&self.ok(ROOT, Operation::Statfs))
    }

    fn truncate(&mut self, ino: u64, size: u64) -> AttrOut {
        let a = SetattrIn {
            valid: FATTR_SIZE,
            size,
            ..SetattrIn::default()
        };
        parse(&self.ok(ino, Operation::Setattr(a)))
    }

    fn fsync(&mut self, ino: u64, fh: u64) {
        let op = Operation::Fsync {
            fh,
            datasync: false,
        };
        self.ok(ino, op);
    }

    fn fdatasync(&mut self, ino: u64, fh: u64) {
        let op = Operation::Fsync { fh, datasync: true };
        self.ok(ino, op);
    }

    fn fallocate(&mut self, ino: u64, fh: u64, offset: u64, length: u64) {
        let op = Operation::Fallocate {
            fh,
            offset,
            length,
            mode: 0,
        };
        self.ok(ino, op);
    }
}

impl Requests for Fx {
    fn parts(&mut self) -> (&EtcFs, &mut Vec<u8>, &mut u64) {
        (&self.fs, &mut self.out, &mut self.unique)
    }
}

/// Compares byte strings, reporting the first difference instead of both strings.
#[track_caller]
fn same(got: &[u8], want: &[u8]) {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("bytes differ first at {i}: got {} want {}", got[i], want[i]);
    }
    assert_eq!(got.len(), want.len(), "lengths differ");
}

pub(super) fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

#[test]
fn mkfs_refuses_a_formatted_prefix_and_device() {
    let kv = Arc::new(MemEtcd::new(Arc::new(SystemClock::new())));
    let dev = MemDev::new(DEV_BYTES);
    let r = format(&kv, &dev, false).unwrap();
    assert_eq!(r.block_size, 4096);
    assert!(r.groups > 2);
    let e = format(&kv, &dev, false).unwrap_err().to_string();
    assert!(e.contains("already holds"), "{e}");
    // Another etcd, same device: the device refuses.
    let kv2 = Arc::new(MemEtcd::new(Arc::new(SystemClock::new())));
    let e = format(&kv2, &dev, false).unwrap_err().to_string();
    assert!(e.contains("already holds"), "{e}");
    format(&kv, &dev, true).unwrap();
}

#[test]
fn wrong_device_names_both_uuids() {
    let kv = Arc::new(MemEtcd::new(Arc::new(SystemClock::new())));
    let dev = MemDev::new(DEV_BYTES);
    format(&kv, &dev, false).unwrap();
    let kv2 = Arc::new(MemEtcd::new(Arc::new(SystemClock::new())));
    let other = MemDev::new(DEV_BYTES);
    format(&kv2, &other, false).unwrap();
    let (p, s) = Pipeline::start_with_session(
        connect_backend(kv.clone() as Arc<dyn KvBackend>),
        Keyspace::new("t").unwrap(),
        SessionConfig::new("test"),
        Arc::new(SystemClock::new()),
        pipeline_config(),
    )
    .unwrap();
    let e = EtcFs::open_with(
        p,
        s,
        Dev::Mem(other),
        &CacheOpts::uniform(Duration::ZERO),
        1,
    )
    .err()
    .expect("wrong device refused")
    .to_string();
    assert!(
        e.contains("holds filesystem") && e.contains("etcd prefix holds"),
        "{e}"
    );
}

#[test]
fn namespace_ops() {
    let mut fx = Fx::new();
    let d = fx.mkdir(ROOT, b"d");
    assert_eq!(fx.lookup(ROOT, b"d").nodeid, d);
    assert_eq!(fx.getattr(d).attr.mode & libc::S_IFMT, libc::S_IFDIR);
    assert_eq!(fx.getattr(ROOT).attr.nlink, 3);
    // Missing names are negative entries (ino 0) the kernel may cache.
    assert_eq!(fx.lookup(ROOT, b"nope").nodeid, 0);
    assert_eq!(
        fx.err(ROOT, Operation::Lookup { name: &[b'x'; 256] }),
        Errno::ENAMETOOLONG
    );
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Mkdir {
                name: b"d",
                mode: 0o755,
                umask: 0
            }
        ),
        Errno::EEXIST
    );
    let mut want = Vec::new();
    for i in 0..30 {
        let name = format!("f{i:02}");
        let (ino, fh) = fx.create(d, name.as_bytes());
        fx.release(ino, fh);
        want.push(name.into_bytes());
    }
    let got = fx.names(d);
    assert_eq!(got[0].0, b".");
    assert_eq!(got[1].0, b"..");
    let names: Vec<Vec<u8>> = got[2..].iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(names, want);
    assert_eq!(
        fx.err(ROOT, Operation::Rmdir { name: b"d" }),
        Errno::ENOTEMPTY
    );
    assert_eq!(
        fx.err(ROOT, Operation::Unlink { name: b"d" }),
        Errno::EISDIR
    );
    for n in &want {
        fx.ok(d, Operation::Unlink { name: n });
    }
    assert_eq!(fx.err(d, Operation::Unlink { name: b"f00" }), Errno::ENOENT);
    fx.ok(ROOT, Operation::Rmdir { name: b"d" });
    assert_eq!(fx.lookup(ROOT, b"d").nodeid, 0);
}

#[test]
fn readdir_offsets_survive_changes() {
    let mut fx = Fx::new();
    for n in [&b"a"[..], b"b", b"c", b"d"] {
        let (i, fh) = fx.create(ROOT, n);
        fx.release(i, fh);
    }
    let o: OpenOut = parse(&fx.ok(ROOT, Operation::Opendir { flags: 0 }));
    // A buffer that holds ".", "..", "a" and "b" (32 bytes each).
    let b = fx.ok(
        ROOT,
        Operation::Readdir {
            fh: o.fh,
            offset: 0,
            size: 4 * 32,
        },
    );
    assert_eq!(b.len(), 4 * 32);
    let a: Dirent = parse(&b[2 * 32..]);
    let last: Dirent = parse(&b[3 * 32..]);
    assert_eq!(&b[3 * 32 + 24..3 * 32 + 25], b"b");
    fx.ok(ROOT, Operation::Unlink { name: b"b" });
    let (i, fh) = fx.create(ROOT, b"bb");
    fx.release(i, fh);
    let names = |fx: &mut Fx, offset: u64| -> Vec<Vec<u8>> {
        let b = fx.ok(
            ROOT,
            Operation::Readdir {
                fh: o.fh,
                offset,
                size: 4096,
            },
        );
        let mut names = Vec::new();
        let mut at = 0;
        while at < b.len() {
            let d: Dirent = parse(&b[at..]);
            names.push(b[at + 24..at + 24 + d.namelen as usize].to_vec());
            at += (24 + d.namelen as usize).next_multiple_of(8);
        }
        names
    };
    // Continuing where the listing stopped gives the names after "b" (whether a name
    // added meanwhile shows is unspecified by POSIX: this one was read ahead).
    let rest = names(&mut fx, last.off);
    assert!(rest.ends_with(&[b"c".to_vec(), b"d".to_vec()]), "{rest:?}");
    assert!(!rest.contains(&b"a".to_vec()) && !rest.contains(&b"b".to_vec()));
    // A seek back to a's cookie resumes by name after "a", as the directory is now.
    let after_a = names(&mut fx, a.off);
    assert_eq!(after_a, [&b"bb"[..], b"c", b"d"]);
}

/// Every name of a listing, READDIR calls of 4 KiB from offset 0 on one handle; also
/// the number of calls and of etcd ranges they made.
fn list_all(fx: &mut Fx, fh: u64, plus: bool) -> (Vec<Vec<u8>>, usize, u64) {
    let (mut names, mut calls, mut offset, mut ranges) = (Vec::new(), 0, 0, 0);
    loop {
        let op = match plus {
            true => Operation::Readdirplus {
                fh,
                offset,
                size: 4096,
            },
            false => Operation::Readdir {
                fh,
                offset,
                size: 4096,
            },
        };
        let before = fx.kv.range_count();
        let b = fx.ok(ROOT, op);
        ranges += fx.kv.range_count() - before;
        calls += 1;
        if b.is_empty() {
            return (names, calls, ranges);
        }
        let mut at = 0;
        while at < b.len() {
            let head = if plus { size_of::<EntryOut>() } else { 0 };
            let d: Dirent = parse(&b[at + head..]);
            names.push(b[at + head + 24..at + head + 24 + d.namelen as usize].to_vec());
            offset = d.off;
            at += head + (24 + d.namelen as usize).next_multiple_of(8);
        }
    }
}

/// The watch may see a create's lock key before the create records it, and remembers it
/// as a possible stray. Once the create has recorded it, it is no stray, even while other
/// creates run: a steady create loop (100,000 files) kept the table full of its own keys,
/// waiting for a moment with no create in flight, logged a warning for every further
/// create, and would have left a real stray out. A key nobody here holds still waits for
/// the creates to pass.
#[test]
fn a_creates_own_key_is_no_stray_once_recorded_whatever_creates_run() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    let i = fx.fs.inner();
    assert!(i.locks.held(ino).is_some(), "the create holds its lock");
    let unheld = ino + 1_000_000;
    assert_eq!(i.remember_stray(ino, 1), 1);
    assert_eq!(i.remember_stray(unheld, 1), 2);
    let busy = i.locks.creating();
    i.drop_strays();
    assert_eq!(
        i.strays_remembered(),
        1,
        "only the unheld key is left to look at"
    );
    assert!(i.locks.held(ino).is_some(), "the create's lock stays held");
    drop(busy);
    fx.release(ino, fh);
}

#[test]
fn absent_xattrs_of_a_new_file_are_answered_without_etcd() {
    let mut fx = Fx::new();
    let (f, fh) = fx.create(ROOT, b"f");
    fx.release(f, fh);
    fx.getattr(f);
    let get = |name: &'static [u8]| Operation::Getxattr { name, size: 0 };
    for name in [
        &b"security.ima"[..],
        b"security.capability",
        b"system.posix_acl_access",
        b"user.x",
    ] {
        // Answered on the core, from the cached attributes (no etcd, no waiter), once
        // they are cached (a loaded machine's watch may drop them: a GETATTR refills).
        eventually("an answer from the cached attributes", || {
            fx.getattr(f);
            fx.fs.inner().xattr_absent(f, name)
        });
        assert_eq!(fx.err(f, get(name)), Errno::ENODATA);
    }
    eventually("an empty list from the cached attributes", || {
        fx.getattr(f);
        fx.fs.inner().xattrs_none(f)
    });
    let empty: GetxattrOut = parse(&fx.ok(f, Operation::Listxattr { size: 0 }));
    assert_eq!(empty.size, 0);
    assert!(fx.ok(f, Operation::Listxattr { size: 100 }).is_empty());
    // A name outside the namespaces is still refused as ext4 refuses it.
    assert_eq!(fx.err(f, get(b"foo.bar")), Errno::EOPNOTSUPP);
    // The first xattr ends the claim on this node at once.
    fx.ok(
        f,
        Operation::Setxattr {
            name: b"security.ima",
            value: b"l",
            flags: 0,
        },
    );
    assert!(!fx.fs.inner().xattr_absent(f, b"security.ima"));
    assert!(!fx.fs.inner().xattrs_none(f));
    let sz: GetxattrOut = parse(&fx.ok(f, get(b"security.ima")));
    assert_eq!(sz.size, 1);
    assert_eq!(
        fx.ok(f, Operation::Listxattr { size: 100 }),
        b"security.ima\0"
    );
    assert_eq!(fx.err(f, get(b"user.x")), Errno::ENODATA);
}

/// `security.selinux` is refused unless the mount stores it: `ls -l` then asks once per
/// filesystem, not once per file. A label stored by a mount that keeps them is neither
/// answered nor listed by one that does not.
#[test]
fn the_selinux_label_is_refused_unless_the_mount_stores_it() {
    let label = b"security.selinux";
    let set = |value: &'static [u8]| Operation::Setxattr {
        name: label,
        value,
        flags: 0,
    };
    let get = Operation::Getxattr {
        name: label,
        size: 100,
    };
    let keeps = CacheOpts {
        selinux_xattr: true,
        ..CacheOpts::uniform(Duration::from_secs(1))
    };
    let mut fx = Fx::with_opts(&keeps);
    let (f, fh) = fx.create(ROOT, b"f");
    fx.release(f, fh);
    fx.ok(f, set(b"system_u:object_r:etc_t:s0"));
    assert_eq!(fx.ok(f, get), b"system_u:object_r:etc_t:s0");
    fx.ok(
        f,
        Operation::Setxattr {
            name: b"user.kept",
            value: b"1",
            flags: 0,
        },
    );
    fx.fs.destroy();

    let mut fx = fx.another_mount(&CacheOpts::uniform(Duration::from_secs(1)));
    let records = fs_records(&fx.kv);
    fx.lookup(ROOT, b"f");
    assert_eq!(fx.err(f, get), Errno::EOPNOTSUPP);
    assert_eq!(fx.err(f, set(b"x")), Errno::EOPNOTSUPP);
    assert_eq!(
        fx.err(f, Operation::Removexattr { name: label }),
        Errno::EOPNOTSUPP
    );
    assert_eq!(fx.ok(f, Operation::Listxattr { size: 100 }), b"user.kept\0");
    // The stored label is untouched: the first mount's view comes back with the flag.
    assert_eq!(fs_records(&fx.kv), records);
    // Other security names are attributes like any.
    fx.ok(
        f,
        Operation::Setxattr {
            name: b"security.ima",
            value: b"h",
            flags: 0,
        },
    );
    assert_eq!(
        fx.ok(
            f,
            Operation::Getxattr {
                name: b"security.ima",
                size: 100
            }
        ),
        b"h"
    );
    fx.fs.destroy();

    let mut fx = fx.another_mount(&keeps);
    fx.lookup(ROOT, b"f");
    assert_eq!(fx.ok(f, get), b"system_u:object_r:etc_t:s0");
}

/// A node listing files nobody holds takes their shared locks with the listing, so its
/// READDIRPLUS attributes may stay in the kernel (`ls -l` sends no GETATTR); files
/// another node writes are left alone, that node not even asked.
#[test]
fn readdirplus_takes_the_listed_files_locks_in_bulk() {
    let mut a = Fx::new();
    let mut b = second_mount(&a);
    for i in 0..100 {
        let (ino, fh) = a.create(ROOT, format!("f{i:03}").as_bytes());
        if i == 10 {
            a.write(ino, fh, 0, &pattern(3, 5000));
        }
        a.release(ino, fh);
    }
    // While A holds them all (its creates took them): none granted, none asked.
    let o: OpenOut = parse(&b.ok(ROOT, Operation::Opendir { flags: 0 }));
    let (names, ..) = list_all(&mut b, o.fh, true);
    assert_eq!(names.len(), 102);
    b.ok(ROOT, Operation::Releasedir { fh: o.fh });
    assert_eq!(keys_of(&b, b"t/K", b"t/L"), 100, "only A's locks");
    assert_eq!(
        keys_of(&b, b"t/Q", b"t/R"),
        0,
        "A was not asked to give way"
    );
    // A leaves: its locks go with it. Now B's listing takes them all.
    let Fx { fs, .. } = a;
    fs.destroy();
    drop(fs);
    assert_eq!(keys_of(&b, b"t/K", b"t/L"), 0);
    let o: OpenOut = parse(&b.ok(ROOT, Operation::Opendir { flags: 0 }));
    let reply = b.ok(
        ROOT,
        Operation::Readdirplus {
            fh: o.fh,
            offset: 0,
            size: 1 << 16,
        },
    );
    b.ok(ROOT, Operation::Releasedir { fh: o.fh });
    assert_eq!(
        keys_of(&b, b"t/K", b"t/L"),
        100,
        "B holds every listed file"
    );
    let mut at = 0;
    let mut seen = 0;
    while at < reply.len() {
        let e: EntryOut = parse(&reply[at..]);
        let d: Dirent = parse(&reply[at + size_of::<EntryOut>()..]);
        let name = &reply[at + size_of::<EntryOut>() + 24..][..d.namelen as usize];
        if name.starts_with(b"f") {
            seen += 1;
            assert!(
                e.attr_valid > 0 || e.attr_valid_nsec > 0,
                "{name:?}: not cacheable"
            );
            if name == b"f010" {
                assert_eq!(e.attr.size, 5000);
                assert!(e.attr.blocks >= 8, "blocks {}", e.attr.blocks);
            }
        }
        at += size_of::<EntryOut>() + (24 + d.namelen as usize).next_multiple_of(8);
    }
    assert_eq!(seen, 100);
}

/// From its second READDIRPLUS on, a listing takes the locks of the files ahead of it on
/// the share thread, while the caller works through the entries before them: locks of
/// files not yet listed are granted without another request. Each record comes with
/// cacheable attributes; a file whose grant is queued or under way is still served to
/// anyone who asks first.
#[test]
fn readdirplus_takes_the_locks_ahead_of_the_listing_in_the_background() {
    let mut a = Fx::new();
    let mut b = second_mount(&a);
    let n = 1500;
    let mut inos = Vec::new();
    for i in 0..n {
        let (ino, fh) = a.create(ROOT, format!("f{i:05}").as_bytes());
        a.release(ino, fh);
        inos.push(ino);
    }
    let Fx { fs, .. } = a;
    fs.destroy();
    drop(fs);
    let o: OpenOut = parse(&b.ok(ROOT, Operation::Opendir { flags: 0 }));
    let (mut offset, mut served, mut cacheable) = (0, 0, 0);
    let mut read = |b: &mut Fx, offset: &mut u64| {
        let reply = b.ok(
            ROOT,
            Operation::Readdirplus {
                fh: o.fh,
                offset: *offset,
                size: 4096,
            },
        );
        let records = plus_records(&reply);
        let mut got = 0;
        for (name, e) in &records {
            if name.starts_with(b"f") {
                got += 1;
                cacheable += usize::from(e.attr_valid > 0 || e.attr_valid_nsec > 0);
            }
        }
        // The cookie of the last record, where the next call resumes.
        if let Some(last) = records.len().checked_sub(1) {
            let mut at = 0;
            for _ in 0..last {
                let d: Dirent = parse(&reply[at + size_of::<EntryOut>()..]);
                at += size_of::<EntryOut>() + (24 + d.namelen as usize).next_multiple_of(8);
            }
            let d: Dirent = parse(&reply[at + size_of::<EntryOut>()..]);
            *offset = d.off;
        }
        got
    };
    for _ in 0..3 {
        served += read(&mut b, &mut offset);
    }
    assert!(served < 100, "{served} entries in three calls of 4 KiB");
    // Nothing more asked: the locks of every file ahead are taken meanwhile.
    granted_ahead(&b, n, &format!("{served} entries served"));
    // A file ahead of the listing is served to whoever asks first.
    let far = inos[n - 1];
    let attr: AttrOut = parse(&b.ok(far, Operation::Getattr { fh: None }));
    assert_eq!(attr.attr.ino, far);
    loop {
        let got = read(&mut b, &mut offset);
        if got == 0 {
            break;
        }
        served += got;
    }
    b.ok(ROOT, Operation::Releasedir { fh: o.fh });
    assert_eq!(served, n);
    assert_eq!(
        cacheable, n,
        "every record's attributes may stay in the kernel"
    );
    assert_eq!(keys_of(&b, b"t/K", b"t/L"), n, "B holds every listed file");
}

/// The READDIRPLUS records of one reply: name and entry.
fn plus_records(reply: &[u8]) -> Vec<(Vec<u8>, EntryOut)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < reply.len() {
        let e: EntryOut = parse(&reply[at..]);
        let d: Dirent = parse(&reply[at + size_of::<EntryOut>()..]);
        let name = &reply[at + size_of::<EntryOut>() + 24..][..d.namelen as usize];
        out.push((name.to_vec(), e));
        at += size_of::<EntryOut>() + (24 + d.namelen as usize).next_multiple_of(8);
    }
    out
}

/// A second READDIRPLUS of what the kernel was just given whole sends empty records
/// (node id 0): a whole one makes the kernel drop the inode's cached ACLs, so each warm
/// `ls -l` sent a GETXATTR per file. An inode the kernel forgot, and a file whose lock
/// was given up and taken again since, are given whole again.
#[test]
fn readdirplus_leaves_out_what_the_kernel_was_just_given() {
    let mut fx = Fx::with_opts(&CacheOpts::uniform(Duration::from_secs(600)));
    let mut inos = std::collections::HashMap::new();
    for i in 0..20 {
        let name = format!("f{i:02}");
        let (ino, fh) = fx.create(ROOT, name.as_bytes());
        fx.release(ino, fh);
        inos.insert(name.into_bytes(), ino);
    }
    fx.mkdir(ROOT, b"sub");
    let list = |fx: &mut Fx| {
        let o: OpenOut = parse(&fx.ok(ROOT, Operation::Opendir { flags: 0 }));
        let reply = fx.ok(
            ROOT,
            Operation::Readdirplus {
                fh: o.fh,
                offset: 0,
                size: 1 << 16,
            },
        );
        fx.ok(ROOT, Operation::Releasedir { fh: o.fh });
        let records = plus_records(&reply);
        assert_eq!(records.len(), 23, "., .., 20 files and sub");
        records
            .into_iter()
            .filter(|(n, _)| n != b"." && n != b"..")
            .map(|(n, e)| (n, e.nodeid))
            .collect::<std::collections::HashMap<_, _>>()
    };
    let first = list(&mut fx);
    for (name, nodeid) in &first {
        assert_ne!(*nodeid, 0, "{name:?}: given whole the first time");
    }
    let second = list(&mut fx);
    assert!(second.values().all(|&n| n == 0), "{second:?}");
    // The kernel forgot f03; f05's lock was given up and taken again; f07's attributes
    // were dropped from the kernel.
    let f03 = inos[&b"f03"[..]];
    let f05 = inos[&b"f05"[..]];
    let f07 = inos[&b"f07"[..]];
    fx.fs.inner().drop_kernel_attrs(f07);
    assert!(matches!(
        fx.call(f03, Operation::Forget { nlookup: 1 }),
        Reply::None
    ));
    fx.fs.inner().give_up(f05);
    assert_eq!(fx.fs.inner().locks.held(f05), None);
    let third = list(&mut fx);
    assert_eq!(third[&b"f03"[..]], f03);
    assert_eq!(third[&b"f05"[..]], f05);
    assert_eq!(third[&b"f07"[..]], f07);
    let whole: Vec<_> = third.iter().filter(|(_, &n)| n != 0).collect();
    assert_eq!(whole.len(), 3, "{whole:?}");
}

/// A walk's LOOKUP streak takes the locks of the page of names it reached at once, and
/// those of the pages after it on the share thread while the walk goes on: every file
/// of a directory of three pages is held after a handful of lookups.
#[test]
fn a_lookup_streak_takes_the_next_pages_locks_in_the_background() {
    let mut a = Fx::new();
    let mut b = second_mount(&a);
    let n = 2 * super::DIR_SHARE_AHEAD + 500;
    for i in 0..n {
        let (ino, fh) = a.create(ROOT, format!("f{i:05}").as_bytes());
        a.release(ino, fh);
    }
    let Fx { fs, .. } = a;
    fs.destroy();
    drop(fs);
    for i in 0..8 {
        b.lookup(ROOT, format!("f{i:05}").as_bytes());
    }
    granted_ahead(&b, n, "after 8 lookups");
}

/// Waits (at most 20 s) until `fx` holds `n` locks, some of them taken on the share
/// thread; `when` says what came before, for the failure message.
///
/// The share thread counts a job once it has run whole, a moment after its last lock is in
/// etcd: checked at once, the count was still 0 in a loaded CI run, so it is waited for.
fn granted_ahead(fx: &Fx, n: usize, when: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while keys_of(fx, b"t/K", b"t/L") < n || counter(fx, "listing_grants_ahead") == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {n} files held {when}, {} grants run on the share thread",
            keys_of(fx, b"t/K", b"t/L"),
            counter(fx, "listing_grants_ahead")
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `find` reads a directory whole, then looks its files up in name order: after a few
/// such misses the files that follow are looked up and locked in bulk, and their
/// lookups reach neither etcd nor a waiter; a lookup out of order does not count.
#[test]
fn lookups_in_name_order_take_the_following_files_locks_in_bulk() {
    let mut a = Fx::new();
    let mut b = second_mount(&a);
    for i in 0..300 {
        let (ino, fh) = a.create(ROOT, format!("f{i:03}").as_bytes());
        a.release(ino, fh);
    }
    let Fx { fs, .. } = a;
    fs.destroy();
    drop(fs);
    // Out of order: no bulk grant.
    for i in [7, 3, 250, 100, 2, 90] {
        b.lookup(ROOT, format!("f{i:03}").as_bytes());
    }
    assert_eq!(keys_of(&b, b"t/K", b"t/L"), 6, "one lock per lookup");
    for i in 10..20 {
        b.lookup(ROOT, format!("f{i:03}").as_bytes());
    }
    let held = keys_of(&b, b"t/K", b"t/L");
    assert!(held > 250, "the files after the streak are held: {held}");
    for i in 30..290 {
        let name = format!("f{i:03}");
        // Answered on the core: the lock held, name and attributes at hand (a LOOKUP
        // refills what a loaded machine's watch may have dropped; only the lock cannot
        // come back by itself).
        eventually("a lookup answered on the core", || {
            b.lookup(ROOT, name.as_bytes());
            matches!(
                b.fs.inner().lookup_local(ROOT, name.as_bytes()),
                Some(Ok(_))
            )
        });
        let e = b.lookup(ROOT, name.as_bytes());
        assert!(
            e.attr_valid > 0 || e.attr_valid_nsec > 0,
            "{name}: not cacheable"
        );
    }
}

/// fts stats a directory of over 10,000 entries in inode order: a walk ascending by
/// inode number gets the directory's locks page by page from its start.
#[test]
fn lookups_in_inode_order_take_the_directorys_locks_in_bulk() {
    let mut a = Fx::new();
    let mut b = second_mount(&a);
    // Created in descending name order: inode order is the reverse of name order.
    let mut made = Vec::new();
    for i in (0..300).rev() {
        let name = format!("f{i:03}");
        let (ino, fh) = a.create(ROOT, name.as_bytes());
        a.release(ino, fh);
        made.push(name);
    }
    let Fx { fs, .. } = a;
    fs.destroy();
    drop(fs);
    for name in &made[..10] {
        b.lookup(ROOT, name.as_bytes());
    }
    let held = keys_of(&b, b"t/K", b"t/L");
    assert!(held > 250, "the directory's files are held: {held}");
    let held_before = keys_of(&b, b"t/K", b"t/L");
    for name in &made[20..] {
        eventually("a lookup answered on the core", || {
            b.lookup(ROOT, name.as_bytes());
            matches!(
                b.fs.inner().lookup_local(ROOT, name.as_bytes()),
                Some(Ok(_))
            )
        });
    }
    assert_eq!(
        keys_of(&b, b"t/K", b"t/L"),
        held_before,
        "no lock taken one by one"
    );
}

/// Creates `n` empty files `f00000`... in the root; their names, sorted.
fn create_files(fx: &mut Fx, n: usize) -> Vec<Vec<u8>> {
    let mut names: Vec<Vec<u8>> = (0..n).map(|i| format!("f{i:05}").into_bytes()).collect();
    for name in &names {
        let (i, fh) = fx.create(ROOT, name);
        fx.release(i, fh);
    }
    names.sort();
    names
}

#[test]
fn a_listing_reads_each_entry_from_etcd_once() {
    let mut fx = Fx::new();
    let want = create_files(&mut fx, 1500);
    for plus in [false, true] {
        let o: OpenOut = parse(&fx.ok(ROOT, Operation::Opendir { flags: 0 }));
        let (names, calls, used) = list_all(&mut fx, o.fh, plus);
        assert_eq!(names[..2], [b".".to_vec(), b"..".to_vec()]);
        assert_eq!(
            names[2..],
            want[..],
            "plus {plus}: every name once, in order"
        );
        // Pages of 256, 1024 and then 4096 entries: three ranges (and ".."'s parent
        // record), however many READDIR calls the 4 KiB replies take (a page per call
        // before); the housekeeping thread's reads may fall inside a call too (a loaded
        // machine: CI saw 6 more in another test).
        // READDIRPLUS also reads the extents of files whose block counts a late watch
        // event dropped, so only the plain listing's ranges are counted.
        assert!(calls > 10, "{calls}");
        assert!(
            plus || used <= 4 + calls as u64 / 4,
            "{used} ranges for {calls} READDIR calls"
        );
        fx.ok(ROOT, Operation::Releasedir { fh: o.fh });
    }
}

/// Found with `benches/listing.sh` at 100,000 entries: a warm `ls -l` now and then took
/// 6–12 s instead of 0.7. Part of the kernel's cached listing had been reclaimed, so it
/// asked again from the last cookie it had, on a new handle that knew no cookie; finding
/// the name behind it scanned the directory in pages of 256 entries (390 etcd reads,
/// one READDIR of 10.7 s). The scan's pages now grow as a listing's do.
#[test]
fn a_new_handle_resumes_deep_in_a_big_directory_in_a_few_reads() {
    let mut fx = Fx::new();
    let want = create_files(&mut fx, 6000);
    let first: OpenOut = parse(&fx.ok(ROOT, Operation::Opendir { flags: 0 }));
    let (names, _, _) = list_all(&mut fx, first.fh, false);
    assert_eq!(names[2..], want[..]);
    fx.ok(ROOT, Operation::Releasedir { fh: first.fh });

    // The cookie of the entry 5,900 names in, as the kernel keeps it.
    let deep = meta::keys::dir_cookie(&want[5899]);
    let second: OpenOut = parse(&fx.ok(ROOT, Operation::Opendir { flags: 0 }));
    let before = fx.kv.range_count();
    let b = fx.ok(
        ROOT,
        Operation::Readdir {
            fh: second.fh,
            offset: deep,
            size: 4096,
        },
    );
    let used = fx.kv.range_count() - before;
    let d: Dirent = parse(&b);
    assert_eq!(
        &b[24..24 + d.namelen as usize],
        &want[5900][..],
        "resumes right after the cookie's name"
    );
    // 256 + 1,024 + 4,096 + 16,384 entries reach it, then the lookahead's first page
    // (and maybe a housekeeping read); 24 pages of 256 before.
    assert!(
        used <= 7,
        "{used} etcd ranges to resume at a cookie 5,900 names in"
    );
    fx.ok(ROOT, Operation::Releasedir { fh: second.fh });
}

#[test]
fn write_read_truncate_and_space() {
    let mut fx = Fx::new();
    let free0 = fx.statfs().bfree;
    let (ino, fh) = fx.create(ROOT, b"f");
    let mut data = pattern(7, 300_000);
    fx.write(ino, fh, 100, &data);
    assert_eq!(fx.getattr(ino).attr.size, 300_100);
    // Unaligned reads, the hole before the data, and EOF.
    assert_eq!(fx.read(ino, fh, 0, 100), vec![0u8; 100]);
    same(&fx.read(ino, fh, 100, 300_000), &data);
    assert_eq!(fx.read(ino, fh, 5000, 10), data[4900..4910].to_vec());
    assert_eq!(fx.read(ino, fh, 300_090, 100).len(), 10);
    assert!(fx.read(ino, fh, 400_000, 100).is_empty());
    // Overwrite in place (no allocation), and a sparse write far away.
    fx.write(ino, fh, 4096, b"hello");
    assert_eq!(
        fx.read(ino, fh, 4094, 9),
        [&data[3994..3996], b"hello", &data[4001..4003]].concat()
    );
    data[3996..4001].copy_from_slice(b"hello");
    fx.write(ino, fh, 1 << 20, b"tail");
    assert_eq!(fx.read(ino, fh, 600_000, 8), vec![0; 8]);
    assert_eq!(fx.read(ino, fh, 1 << 20, 10), b"tail");
    let used = free0 - fx.statfs().bfree;
    assert_eq!(used, 300_100u64.div_ceil(BLOCK_SIZE) + 1);
    fx.ok(
        ino,
        Operation::Fsync {
            fh,
            datasync: false,
        },
    );

    // A fresh mount reads the same bytes from etcd's map and the device.
    fx.release(ino, fh);
    let fh = fx.open(ino);
    same(&fx.read(ino, fh, 100, 300_000), &data);

    // Truncate down to an unaligned size: the tail of the EOF block reads zeros after
    // growing again; space comes back.
    assert_eq!(fx.truncate(ino, 5000).attr.size, 5000);
    assert_eq!(fx.statfs().bfree, free0 - 2);
    fx.truncate(ino, 9000);
    assert_eq!(
        fx.read(ino, fh, 4990, 20),
        [&data[4890..4900], &[0u8; 10][..]].concat()
    );
    fx.truncate(ino, 0);
    assert_eq!(fx.statfs().bfree, free0);
    // Write past EOF leaves zeros between.
    fx.write(ino, fh, 0, b"abc");
    fx.write(ino, fh, 10, b"xyz");
    assert_eq!(fx.read(ino, fh, 0, 100), b"abc\0\0\0\0\0\0\0xyz");
    fx.release(ino, fh);
    fx.ok(ROOT, Operation::Unlink { name: b"f" });
    assert_eq!(fx.statfs().bfree, free0);
}

/// The bug behind posix `extending_writes_keep_the_size`: a FLUSH wrote the pending
/// mtime of an open file (another fd's close) while a WRITE extended the file; the FLUSH's
/// commit came first, but its bookkeeping ran after the WRITE's and put the older size
/// back into the open file's state. GETATTR and READ then answered the old size (and the
/// kernel shrank the file to it), and the next write zeroed the "old EOF block" tail.
/// Here the late bookkeeping is replayed deterministically: a size this node has
/// acknowledged must never go backwards.
#[test]
fn late_bookkeeping_of_an_older_commit_never_shrinks_an_open_file() {
    use meta::pipeline::{Mutation, SetAttr, TimeSet};
    use meta::types::{Ino, Timespec};

    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    let head = pattern(3, 5000);
    fx.write(ino, fh, 0, &head);
    // The FLUSH's commit: the inode as it is now (5000 bytes, committed by the sync
    // here), committed first.
    let inner = fx.fs.inner().clone();
    inner.sync_pending(ino).unwrap();
    let flush = inner
        .meta
        .commit(Mutation::SetAttr {
            ino: Ino(ino),
            set: SetAttr {
                mtime: Some(TimeSet::At(Timespec::new(1_700_000_000, 0))),
                ..SetAttr::default()
            },
        })
        .unwrap();
    assert_eq!(flush.attr.as_ref().unwrap().size, 5000);
    // The extending WRITE commits and is acknowledged.
    let tail = pattern(4, 7000);
    fx.write(ino, fh, 5000, &tail);
    assert_eq!(fx.getattr(ino).attr.size, 12_000);
    // Then the FLUSH's bookkeeping runs.
    inner.after_commit(&flush);
    assert_eq!(
        fx.getattr(ino).attr.size,
        12_000,
        "an older commit's attributes replaced the acknowledged size"
    );
    same(
        &fx.read(ino, fh, 0, 20_000),
        &[&head[..], &tail[..]].concat(),
    );
    // A write after it must not treat the old size as EOF (it zeroed the tail of the
    // "old EOF block" on the device).
    fx.write(ino, fh, 12_000, b"more");
    same(
        &fx.read(ino, fh, 0, 20_000),
        &[&head[..], &tail[..], b"more"].concat(),
    );
    fx.release(ino, fh);
}

/// Directory mtime/ctime (and an inode's ctime after an xattr change) reach etcd
/// coalesced, up to a second later; this node's answers show them at once.
#[test]
fn coalesced_times_are_shown_at_once() {
    let mut fx = Fx::new();
    let d = fx.mkdir(ROOT, b"d");
    let times = |a: &AttrOut| {
        (
            (a.attr.mtime, a.attr.mtimensec),
            (a.attr.ctime, a.attr.ctimensec),
        )
    };
    let tick = || std::thread::sleep(Duration::from_millis(5));
    let (m0, c0) = times(&fx.getattr(d));
    tick();
    let (f, fh) = fx.create(d, b"f");
    fx.release(f, fh);
    let (m1, c1) = times(&fx.getattr(d));
    assert!(m1 > m0 && c1 > c0, "create: {m0:?}/{c0:?} -> {m1:?}/{c1:?}");
    tick();
    fx.ok(d, Operation::Unlink { name: b"f" });
    let (m2, c2) = times(&fx.getattr(d));
    assert!(m2 > m1 && c2 > c1, "unlink: {m1:?}/{c1:?} -> {m2:?}/{c2:?}");
    // An xattr change moves ctime only.
    let (g, gh) = fx.create(ROOT, b"g");
    let (gm0, gc0) = times(&fx.getattr(g));
    tick();
    fx.ok(
        g,
        Operation::Setxattr {
            name: b"user.a",
            value: b"1",
            flags: 0,
        },
    );
    let (gm1, gc1) = times(&fx.getattr(g));
    assert_eq!(gm1, gm0);
    assert!(gc1 > gc0, "setxattr: ctime {gc0:?} -> {gc1:?}");
    fx.release(g, gh);
    // Once written, etcd holds the same (or later) times: nothing goes backwards.
    fx.ok(
        d,
        Operation::Fsyncdir {
            fh: 0,
            datasync: false,
        },
    );
    std::thread::sleep(Duration::from_millis(1500));
    let (m3, c3) = times(&fx.getattr(d));
    assert!(
        m3 >= m2 && c3 >= c2,
        "after the write: {m2:?}/{c2:?} -> {m3:?}/{c3:?}"
    );
}

/// st_blocks comes from the extent map, for files open here or not: sparse after a
/// truncate up, down after a punch, up after a KEEP_SIZE preallocation.
#[test]
fn st_blocks_follow_the_extent_map() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, b"data");
    fx.release(ino, fh);
    let a = fx.truncate(ino, 64 << 20);
    assert_eq!((a.attr.size, a.attr.blocks), (64 << 20, 8));
    assert_eq!(fx.getattr(ino).attr.blocks, 8);
    let fh = fx.open(ino);
    let falloc = |fh, offset, length, mode| Operation::Fallocate {
        fh,
        offset,
        length,
        mode,
    };
    // KEEP_SIZE past EOF counts (ext4 does).
    fx.ok(ino, falloc(fh, 64 << 20, 1 << 20, 1));
    assert_eq!(fx.getattr(ino).attr.size, 64 << 20);
    assert_eq!(fx.getattr(ino).attr.blocks, 8 + 2048);
    fx.release(ino, fh);
    assert_eq!(fx.getattr(ino).attr.blocks, 8 + 2048);
    // Punch the written block (inside EOF), from an open file, then closed.
    let fh = fx.open(ino);
    fx.ok(ino, falloc(fh, 0, 256 << 10, 3));
    assert_eq!(fx.getattr(ino).attr.blocks, 2048);
    fx.release(ino, fh);
    assert_eq!(fx.getattr(ino).attr.blocks, 2048);
}

/// READDIRPLUS of a directory: (name, st_blocks) of each entry but `.` and `..`.
fn blocks_listed(fx: &mut Fx, dir: u64) -> Vec<(Vec<u8>, u64)> {
    let o: OpenOut = parse(&fx.ok(dir, Operation::Opendir { flags: 0 }));
    let mut out = Vec::new();
    let mut offset = 0;
    loop {
        let b = fx.ok(
            dir,
            Operation::Readdirplus {
                fh: o.fh,
                offset,
                size: 4096,
            },
        );
        if b.is_empty() {
            break;
        }
        let mut at = 0;
        while at < b.len() {
            let e: EntryOut = parse(&b[at..]);
            let d: Dirent = parse(&b[at + size_of::<EntryOut>()..]);
            let name_at = at + size_of::<EntryOut>() + size_of::<Dirent>();
            let name = b[name_at..name_at + d.namelen as usize].to_vec();
            if name != b"." && name != b".." {
                out.push((name, e.attr.blocks));
            }
            offset = d.off;
            at += (size_of::<EntryOut>() + size_of::<Dirent>() + d.namelen as usize)
                .next_multiple_of(8);
        }
    }
    fx.ok(dir, Operation::Releasedir { fh: o.fh });
    out
}

/// Issue 12: st_blocks of a sparse file counted its holes (1 byte at 1 TiB showed 2^31
/// blocks) wherever the blocks were not at hand: READDIRPLUS with cold caches (after a
/// remount, or of a file open without its map loaded), and a map too large to sum in one
/// read. Every reply path must say what is allocated.
#[test]
fn st_blocks_are_allocated_blocks_in_every_reply() {
    const _: () = assert!(super::files::EXTENTS_CACHED_MAX < 70);
    let mut fx = Fx::new();
    let (sparse, fh) = fx.create(ROOT, b"sparse");
    fx.write(sparse, fh, 1 << 40, b"x");
    fx.release(sparse, fh);
    // More extents than one read returns (every other block, so none merge).
    let (many, fh) = fx.create(ROOT, b"many");
    for i in 0..70u64 {
        fx.write(many, fh, 2 * i * BLOCK_SIZE, &pattern(i as u8, 1));
    }
    fx.release(many, fh);
    let want = [(&b"sparse"[..], 8u64), (b"many", 70 * 8)];
    let sorted = |mut v: Vec<(Vec<u8>, u64)>| {
        v.sort();
        v
    };
    let expect = sorted(want.iter().map(|(n, b)| (n.to_vec(), *b)).collect());
    assert_eq!(sorted(blocks_listed(&mut fx, ROOT)), expect, "READDIRPLUS");
    // Cold caches: READDIRPLUS first (what `ls -l` and `du` send), then the rest.
    let mut fx = second_mount(&fx);
    assert_eq!(
        sorted(blocks_listed(&mut fx, ROOT)),
        expect,
        "READDIRPLUS after a remount"
    );
    let mut fx = second_mount(&fx);
    for (name, blocks) in want {
        let e = fx.lookup(ROOT, name);
        assert_eq!(e.attr.blocks, blocks, "LOOKUP {name:?}");
        assert_eq!(fx.getattr(e.nodeid).attr.blocks, blocks, "GETATTR {name:?}");
    }
    // Open, its map not loaded yet.
    let mut fx = second_mount(&fx);
    let ino = fx.lookup(ROOT, b"many").nodeid;
    let fh = fx.open(ino);
    let mut fx2 = second_mount(&fx);
    let fh2 = fx2.open(ino);
    assert_eq!(
        sorted(blocks_listed(&mut fx2, ROOT)),
        expect,
        "READDIRPLUS of an open file"
    );
    fx2.release(ino, fh2);
    // CREATE of a name that exists (no O_EXCL) answers with the file's blocks.
    let b = fx.ok(
        ROOT,
        Operation::Create {
            name: b"sparse",
            flags: libc::O_RDWR as u32,
            mode: 0o644,
            umask: 0o022,
            open_flags: 0,
        },
    );
    let e: EntryOut = parse(&b);
    assert_eq!((e.attr.size, e.attr.blocks), ((1 << 40) + 1, 8), "CREATE");
    let o: OpenOut = parse(&b[size_of::<EntryOut>()..]);
    fx.release(e.nodeid, o.fh);
    fx.release(ino, fh);
}

#[test]
fn fuse_attr_never_counts_a_regular_files_holes() {
    use meta::types::FileType;
    let t = meta::types::Timespec::new(0, 0);
    let mut a = meta::codec::InodeAttr {
        ino: meta::types::Ino(2),
        kind: FileType::Regular,
        perm: 0o644,
        uid: 0,
        gid: 0,
        size: (1 << 40) + 1,
        nlink: 1,
        atime: t,
        mtime: t,
        ctime: t,
        crtime: t,
        rdev: 0,
        generation: 1,
        flags: 0,
    };
    assert_eq!(super::fuse_attr(&a, Some(8)).blocks, 8);
    assert_eq!(super::fuse_attr(&a, None).blocks, 0);
    a.kind = FileType::Directory;
    a.size = 5000;
    assert_eq!(super::fuse_attr(&a, None).blocks, 16);
    let e = |file_off, len| meta::codec::Extent {
        file_off,
        len,
        dev_off: 0,
        unwritten: false,
    };
    assert_eq!(
        super::extent_blocks(&[e(0, BLOCK_SIZE), e(1 << 40, 3 * BLOCK_SIZE)]),
        32
    );
}

#[test]
fn reads_use_the_cached_map_and_device_not_etcd() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(1, 8192));
    let txns = fx.kv.txn_count();
    let before = fx.dev.stats().reads;
    for _ in 0..10 {
        assert_eq!(fx.read(ino, fh, 0, 8192), pattern(1, 8192));
    }
    // Overwrites of written blocks: no etcd round trip either.
    fx.write(ino, fh, 0, &pattern(2, 4096));
    assert_eq!(fx.kv.txn_count(), txns);
    assert!(fx.dev.stats().reads > before);
}

/// fdatasync of in-place overwrites is the device's flush alone; their mtime, shown here at
/// once, reaches etcd with the next fsync (or FLUSH, or the lock's handoff).
#[test]
fn fdatasync_of_overwrites_flushes_the_device_and_leaves_their_mtime_pending() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(1, 8192));
    fx.fsync(ino, fh);
    let before = committed_attr(&fx, ino).mtime;
    std::thread::sleep(Duration::from_millis(10));
    fx.write(ino, fh, 0, &pattern(2, 4096));
    let (txns, flushes) = (fx.kv.txn_count(), fx.dev.stats().flushes);
    fx.fdatasync(ino, fh);
    assert_eq!(
        fx.kv.txn_count(),
        txns,
        "fdatasync of overwrites reached etcd"
    );
    assert!(
        fx.dev.stats().flushes > flushes,
        "fdatasync flushed no device"
    );
    let shown = shown_mtime(&mut fx, ino);
    assert!(shown > before, "the overwrite's mtime is not shown");
    assert_eq!(committed_attr(&fx, ino).mtime, before);
    fx.fsync(ino, fh);
    assert_eq!(
        committed_attr(&fx, ino).mtime,
        shown,
        "fsync wrote another mtime"
    );
    assert_eq!(fx.read(ino, fh, 0, 8192)[..4096], pattern(2, 4096)[..]);
    fx.release(ino, fh);
}

/// Overwrites take their mtime from the kernel's coarse clock: a loop of overwrite +
/// fsync commits it to etcd once per clock tick (a tick is 4 ms here), not once per fsync
/// (790 fsyncs/s, each an etcd commit); the mtime shown never goes back, and one a tick
/// later is shown and committed.
#[test]
fn overwrite_and_fsync_loops_commit_the_mtime_once_per_clock_tick() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(1, 8192));
    fx.fsync(ino, fh);
    let txns = fx.kv.txn_count();
    let mut last = shown_mtime(&mut fx, ino);
    for i in 0..200u8 {
        fx.write(ino, fh, 4096, &pattern(i, 4096));
        fx.fsync(ino, fh);
        let now = shown_mtime(&mut fx, ino);
        assert!(now >= last, "the mtime went back");
        last = now;
    }
    let commits = fx.kv.txn_count() - txns;
    // 200 overwrites and fsyncs take well under a second here, at 250 ticks a second.
    assert!(commits < 100, "{commits} commits for 200 fsyncs");
    std::thread::sleep(Duration::from_millis(10));
    fx.write(ino, fh, 4096, &pattern(9, 4096));
    assert!(
        shown_mtime(&mut fx, ino) > last,
        "an overwrite a tick later left the mtime"
    );
    let txns = fx.kv.txn_count();
    fx.fsync(ino, fh);
    assert!(fx.kv.txn_count() > txns, "its fsync committed no mtime");
    fx.release(ino, fh);
}

/// The mtime of overwrites commits without the file's lock on the condition that the
/// inode is unchanged since the attributes it goes with; a change that landed meanwhile
/// (here one made behind the file state's back, as one landing during that commit would
/// be) sends it through the file's lock again, after that change.
#[test]
fn an_overwrite_mtime_commits_without_the_lock_unless_the_inode_changed() {
    use meta::{
        pipeline::{Mutation, SetAttr},
        types::Ino,
    };
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(1, 8192));
    fx.fsync(ino, fh);
    std::thread::sleep(Duration::from_millis(10));
    fx.write(ino, fh, 0, &pattern(2, 4096));
    let shown = shown_mtime(&mut fx, ino);
    fx.fsync(ino, fh);
    assert_eq!(committed_attr(&fx, ino).mtime, shown);
    assert_eq!(counter(&fx, "mtime_commits_relocked"), 0);

    std::thread::sleep(Duration::from_millis(10));
    fx.write(ino, fh, 0, &pattern(3, 4096));
    let shown = shown_mtime(&mut fx, ino);
    let chmod = Mutation::SetAttr {
        ino: Ino(ino),
        set: SetAttr {
            perm: Some(0o600),
            ..SetAttr::default()
        },
    };
    fx.fs.inner().commit_op(chmod).unwrap();
    fx.fsync(ino, fh);
    assert_eq!(counter(&fx, "mtime_commits_relocked"), 1);
    let a = committed_attr(&fx, ino);
    assert_eq!((a.mtime, a.perm), (shown, 0o600));
    fx.release(ino, fh);
}

/// An open reads its file's map with the attributes (one etcd read): a file opened while
/// etcd was up and read only from the page cache until it went away answered EIO at its
/// first READ to the daemon, its map read lazily there.
#[test]
fn an_open_brings_its_files_map_so_reads_need_no_etcd() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(1, 3 * BLOCK_SIZE as usize));
    fx.fsync(ino, fh);
    fx.release(ino, fh);
    let (ranges, txns) = (fx.kv.range_count(), fx.kv.txn_count());
    let fh = fx.open(ino);
    let open_reads = fx.kv.range_count() - ranges;
    assert_eq!(
        open_reads, 0,
        "the open's read is one read-only transaction"
    );
    let (ranges, txns_after_open) = (fx.kv.range_count(), fx.kv.txn_count());
    assert!(txns_after_open > txns, "the open read etcd");
    for i in 0..3 {
        assert_eq!(
            fx.read(ino, fh, i * BLOCK_SIZE, BLOCK_SIZE as u32),
            pattern(1, 3 * BLOCK_SIZE as usize)[(i * BLOCK_SIZE) as usize..][..BLOCK_SIZE as usize]
        );
    }
    assert_eq!(
        (fx.kv.range_count(), fx.kv.txn_count()),
        (ranges, txns_after_open),
        "READs after the open reached etcd"
    );
    fx.release(ino, fh);

    // A new file's map is known empty: its first write reads no map.
    let (ino, fh) = fx.create(ROOT, b"g");
    let ranges = fx.kv.range_count();
    fx.write(ino, fh, 0, &pattern(2, 100));
    assert_eq!(fx.read(ino, fh, 0, 100), pattern(2, 100));
    assert_eq!(fx.kv.range_count(), ranges, "a new file's map was read");
    fx.release(ino, fh);
}

/// A new file `name` holding `data`, written, closed, then opened, read and closed once
/// more: its map is kept at that close, and its first read's atime (relatime) is written.
fn written_read_and_closed(fx: &mut Fx, name: &[u8], data: &[u8]) -> u64 {
    let (ino, fh) = fx.create(ROOT, name);
    fx.write(ino, fh, 0, data);
    fx.release(ino, fh);
    let fh = fx.open(ino);
    same(&fx.read(ino, fh, 0, data.len() as u32), data);
    fx.release(ino, fh);
    ino
}

/// A file closed and opened again on the node that holds its lock takes the map kept at
/// the close (an open+close loop on one file read the map from etcd at every open: 0.86x
/// of the rate before opens read maps); a change of its extents drops it, and a truncate
/// while it is closed keeps the map it leaves.
#[test]
fn a_file_opened_again_under_its_lock_reads_its_map_kept_at_close() {
    let mut fx = Fx::new();
    eventually("watch live", || counter(&fx, "watch_live") == 1);
    let data = pattern(4, 3 * BLOCK_SIZE as usize);
    let ino = written_read_and_closed(&mut fx, b"f", &data);
    let kept = counter(&fx, "cache_maps_kept_at_close");
    let open_read_close = |fx: &mut Fx| {
        let txns = fx.kv.txn_count();
        let fh = fx.open(ino);
        same(&fx.read(ino, fh, 0, 3 * BLOCK_SIZE as u32), &data);
        fx.release(ino, fh);
        fx.kv.txn_count() - txns
    };
    let with_kept_map = open_read_close(&mut fx);
    assert_eq!(counter(&fx, "cache_maps_kept_at_close"), kept + 1);
    // As a change of the extents would: the next open reads etcd (one read-only
    // transaction more; the open record's commits are the same for both).
    fx.fs.inner().caches.forget_blocks(ino);
    let with_map_read = open_read_close(&mut fx);
    assert_eq!(counter(&fx, "cache_maps_kept_at_close"), kept + 1);
    assert_eq!(
        with_kept_map + 1,
        with_map_read,
        "transactions of an open+read+close"
    );

    // Truncates while it is closed (each keeps the map it leaves): the blocks cut off
    // read as zeros after the file grows again.
    fx.truncate(ino, BLOCK_SIZE);
    fx.truncate(ino, 3 * BLOCK_SIZE);
    let fh = fx.open(ino);
    let got = fx.read(ino, fh, 0, 3 * BLOCK_SIZE as u32);
    same(&got[..BLOCK_SIZE as usize], &data[..BLOCK_SIZE as usize]);
    assert!(
        got[BLOCK_SIZE as usize..].iter().all(|&x| x == 0),
        "cut blocks read back"
    );
    assert_eq!(got.len(), 3 * BLOCK_SIZE as usize);
    fx.release(ino, fh);
}

/// A map kept at a close goes when another node takes the lock to change the file: the
/// next open here reads what that node wrote, not the blocks the old map pointed at.
#[test]
fn another_nodes_change_drops_a_map_kept_at_close() {
    let mut a = Fx::new();
    let mut b = second_mount(&a);
    eventually("watch live", || {
        counter(&a, "watch_live") == 1 && counter(&b, "watch_live") == 1
    });
    let ino = written_read_and_closed(&mut a, b"f", &pattern(1, 2 * BLOCK_SIZE as usize));

    // b empties the file and writes past a hole, in blocks the old map does not name.
    let fh = b.open(ino);
    b.truncate(ino, 0);
    let new = pattern(2, BLOCK_SIZE as usize);
    b.write(ino, fh, 4 * BLOCK_SIZE, &new);
    b.release(ino, fh);

    // a takes its lock again (and caches the attributes) before it opens.
    assert_eq!(a.getattr(ino).attr.size, 5 * BLOCK_SIZE);
    let fh = a.open(ino);
    let got = a.read(ino, fh, 0, 5 * BLOCK_SIZE as u32);
    assert_eq!(got.len(), 5 * BLOCK_SIZE as usize);
    assert!(
        got[..4 * BLOCK_SIZE as usize].iter().all(|&x| x == 0),
        "the hole read old data"
    );
    same(&got[4 * BLOCK_SIZE as usize..], &new);
    a.release(ino, fh);
}

/// A map too large to cache (issue 12: 30,000 extents, 12–63 ms per 4 KiB READ, each going
/// to etcd) is read a window at a time: a pass of small READs over it costs one etcd read
/// per window, not one per READ, and a write drops the window.
#[test]
fn reads_of_a_fragmented_file_come_from_a_window_of_its_map() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    let n = 2 * super::files::EXTENTS_CACHED_MAX as u64;
    for i in 0..n {
        fx.write(ino, fh, i * 2 * BLOCK_SIZE, &pattern(i as u8, 100));
    }
    fx.release(ino, fh);
    let fh = fx.open(ino);
    let check = |fx: &mut Fx, from: u64| {
        for i in from..n {
            let got = fx.read(ino, fh, i * 2 * BLOCK_SIZE, 100);
            assert_eq!(got, pattern(i as u8, 100), "extent {i}");
        }
    };
    // The first READ learns that the map is too big.
    fx.read(ino, fh, 0, 100);
    let ranges = fx.kv.range_count();
    check(&mut fx, 0);
    let windows = n.div_ceil(super::files::WINDOW_EXTENTS as u64 / 2);
    let used = fx.kv.range_count() - ranges;
    assert!(
        used <= windows + 1,
        "{used} etcd reads for {n} READs over {n} extents ({windows} windows)"
    );
    // Every window is kept (the map fits the windows' bound): READs anywhere, in any
    // order, no longer reach etcd.
    let ranges = fx.kv.range_count();
    for k in 0..n {
        let i = (k * 37) % n;
        assert_eq!(
            fx.read(ino, fh, i * 2 * BLOCK_SIZE, 100),
            pattern(i as u8, 100)
        );
    }
    assert_eq!(
        fx.kv.range_count(),
        ranges,
        "random READs over cached windows"
    );
    // A write in the middle (an overwrite of a hole: a new extent) is seen at once.
    let mid = n / 2 * 2 * BLOCK_SIZE + BLOCK_SIZE;
    fx.write(ino, fh, mid, &pattern(99, 10));
    assert_eq!(fx.read(ino, fh, mid, 10), pattern(99, 10));
    check(&mut fx, n / 2);
    fx.release(ino, fh);
}

#[test]
fn enospc_when_full_and_space_returns() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"big");
    let chunk = vec![5u8; 1 << 20];
    let mut off = 0;
    let err = loop {
        match fx.call(
            ino,
            Operation::Write {
                fh,
                offset: off,
                data: &chunk,
                write_flags: 0,
                flags: 0,
            },
        ) {
            Reply::Bytes(_) => off += chunk.len() as u64,
            Reply::Error(e) => break e,
            other => panic!("{other:?}"),
        }
        assert!(off < DEV_BYTES, "never ran out of space");
    };
    assert_eq!(err, Errno::ENOSPC);
    assert!(off >= 12 << 20, "only {off} bytes fit");
    fx.truncate(ino, 0);
    assert_eq!(fx.statfs().bfree, fx.statfs().blocks);
    fx.write(ino, fh, 0, &chunk);
    fx.release(ino, fh);
}

#[test]
fn rename_modes() {
    let mut fx = Fx::new();
    let a = fx.mkdir(ROOT, b"a");
    let b = fx.mkdir(a, b"b");
    let (f, fh) = fx.create(ROOT, b"f");
    fx.release(f, fh);
    let (g, fh) = fx.create(ROOT, b"g");
    fx.release(g, fh);
    let rn = |newdir, name: &'static [u8], newname: &'static [u8], flags| Operation::Rename {
        newdir,
        name,
        newname,
        flags,
    };
    assert_eq!(
        fx.err(ROOT, rn(ROOT, b"f", b"g", RENAME_NOREPLACE)),
        Errno::EEXIST
    );
    fx.ok(ROOT, rn(ROOT, b"f", b"g", RENAME_EXCHANGE));
    assert_eq!(fx.lookup(ROOT, b"g").nodeid, f);
    assert_eq!(fx.lookup(ROOT, b"f").nodeid, g);
    fx.ok(ROOT, rn(ROOT, b"f", b"g", 0));
    assert_eq!(fx.lookup(ROOT, b"g").nodeid, g);
    assert_eq!(fx.lookup(ROOT, b"f").nodeid, 0);
    // A directory into its own subtree.
    assert_eq!(fx.err(ROOT, rn(b, b"a", b"x", 0)), Errno::EINVAL);
    fx.ok(a, rn(ROOT, b"b", b"b2", 0));
    assert_eq!(fx.lookup(ROOT, b"b2").nodeid, b);
    assert_eq!(fx.getattr(a).attr.nlink, 2);
}

#[test]
fn links_symlinks_nodes_and_xattrs() {
    let mut fx = Fx::new();
    let (f, fh) = fx.create(ROOT, b"f");
    fx.release(f, fh);
    let e = fx.entry(
        f,
        Operation::Link {
            oldnodeid: f,
            name: b"h",
        },
    );
    assert_eq!(e.nodeid, f);
    assert_eq!(e.attr.nlink, 2);
    let s = fx.entry(
        ROOT,
        Operation::Symlink {
            name: b"s",
            target: b"/x/y",
        },
    );
    assert_eq!(fx.ok(s.nodeid, Operation::Readlink), b"/x/y");
    let n = fx.entry(
        ROOT,
        Operation::Mknod {
            name: b"fifo",
            mode: libc::S_IFIFO | 0o600,
            rdev: 0,
            umask: 0,
        },
    );
    assert_eq!(n.attr.mode & libc::S_IFMT, libc::S_IFIFO);
    let c = fx.entry(
        ROOT,
        Operation::Mknod {
            name: b"chr",
            mode: libc::S_IFCHR | 0o600,
            rdev: 0x0103,
            umask: 0,
        },
    );
    assert_eq!(c.attr.rdev, 0x0103);

    let set = |name: &'static [u8], value: &'static [u8], flags| Operation::Setxattr {
        name,
        value,
        flags,
    };
    fx.ok(f, set(b"user.a", b"1", 0));
    assert_eq!(fx.err(f, set(b"user.a", b"2", XATTR_CREATE)), Errno::EEXIST);
    assert_eq!(
        fx.err(f, set(b"user.b", b"2", XATTR_REPLACE)),
        Errno::ENODATA
    );
    fx.ok(f, set(b"user.a", b"22", XATTR_REPLACE));
    let sz: GetxattrOut = parse(&fx.ok(
        f,
        Operation::Getxattr {
            name: b"user.a",
            size: 0,
        },
    ));
    assert_eq!(sz.size, 2);
    assert_eq!(
        fx.err(
            f,
            Operation::Getxattr {
                name: b"user.a",
                size: 1
            }
        ),
        Errno::ERANGE
    );
    assert_eq!(
        fx.ok(
            f,
            Operation::Getxattr {
                name: b"user.a",
                size: 10
            }
        ),
        b"22"
    );
    fx.ok(f, set(b"user.b", b"", 0));
    assert_eq!(
        fx.ok(f, Operation::Listxattr { size: 100 }),
        b"user.a\0user.b\0"
    );
    fx.ok(f, Operation::Removexattr { name: b"user.a" });
    assert_eq!(
        fx.err(f, Operation::Removexattr { name: b"user.a" }),
        Errno::ENODATA
    );
    let big = vec![0u8; 65537];
    assert_eq!(
        fx.err(
            f,
            Operation::Setxattr {
                name: b"user.c",
                value: &big,
                flags: 0
            }
        ),
        Errno::E2BIG
    );

    // setattr: mode and an explicit mtime.
    let a = SetattrIn {
        valid: FATTR_MODE | FATTR_MTIME,
        mode: 0o600,
        mtime: 1_000_000,
        mtimensec: 5,
        ..SetattrIn::default()
    };
    let out: AttrOut = parse(&fx.ok(f, Operation::Setattr(a)));
    assert_eq!(out.attr.mode & 0o7777, 0o600);
    assert_eq!((out.attr.mtime, out.attr.mtimensec), (1_000_000, 5));
}

#[test]
fn fallocate_punch_and_seek() {
    let mut fx = Fx::new();
    let free0 = fx.statfs().bfree;
    let (ino, fh) = fx.create(ROOT, b"f");
    let fa = |offset, length, mode| Operation::Fallocate {
        fh,
        offset,
        length,
        mode,
    };
    fx.ok(ino, fa(0, 64 << 10, 0));
    assert_eq!(fx.getattr(ino).attr.size, 64 << 10);
    assert_eq!(fx.statfs().bfree, free0 - 16);
    assert_eq!(fx.read(ino, fh, 0, 100), vec![0u8; 100]);
    fx.write(ino, fh, 8192, &pattern(3, 8192));
    assert_eq!(fx.read(ino, fh, 8192, 8192), pattern(3, 8192));
    // Punch the middle of the written range (unaligned edges are zeroed in place).
    fx.ok(ino, fa(8192 + 100, 4096 + 200, 3));
    let got = fx.read(ino, fh, 8192, 8192);
    assert_eq!(&got[..100], &pattern(3, 8192)[..100]);
    assert!(got[100..4096 + 300].iter().all(|&b| b == 0));
    assert_eq!(&got[4096 + 300..], &pattern(3, 8192)[4096 + 300..]);
    // Only partial blocks were punched: zeroed in place, nothing freed.
    assert_eq!(fx.statfs().bfree, free0 - 16);
    fx.ok(ino, fa(16384, 8192, 3));
    assert_eq!(fx.statfs().bfree, free0 - 14);
    assert_eq!(fx.getattr(ino).attr.size, 64 << 10);
    assert_eq!(fx.err(ino, fa(0, 10, 0x10)), Errno::EOPNOTSUPP);

    let seek = |offset, whence| Operation::Lseek { fh, offset, whence };
    let l: LseekOut = parse(&fx.ok(ino, seek(0, 3)));
    assert_eq!(l.offset, 8192);
    let l: LseekOut = parse(&fx.ok(ino, seek(8192, 4)));
    assert_eq!(l.offset, 16384);
    assert_eq!(fx.err(ino, seek(64 << 10, 3)), Errno::ENXIO);
    fx.release(ino, fh);
}

#[test]
fn unlinked_open_file_lives_until_last_close() {
    let mut fx = Fx::new();
    let free0 = fx.statfs().bfree;
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(9, 20_000));
    fx.ok(ROOT, Operation::Unlink { name: b"f" });
    assert_eq!(fx.lookup(ROOT, b"f").nodeid, 0);
    assert_eq!(fx.read(ino, fh, 0, 20_000), pattern(9, 20_000));
    assert_eq!(fx.getattr(ino).attr.nlink, 0);
    fx.release(ino, fh);
    assert_eq!(fx.err(ino, Operation::Getattr { fh: None }), Errno::ENOENT);
    assert_eq!(fx.statfs().bfree, free0);
}

#[test]
fn orphans_of_a_dead_session_are_reclaimed_at_mount() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(9, 20_000));
    fx.ok(ROOT, Operation::Unlink { name: b"f" });
    // "Crash": close the session without releasing the file (the orphan record stays).
    fx.fs.inner().files.close(ino);
    let (kv, dev) = (fx.kv.clone(), fx.dev.clone());
    fx.fs.destroy();
    let fs = mount(&kv, &dev);
    let dump = kv.dump(b"t/O", b"t/P");
    assert!(dump.is_empty(), "orphan left: {dump:?}");
    drop(fs);
}

/// A freed extent that runs across a group boundary, one group owned and the other not
/// (handed to nobody since): both parts go back. Freed whole, the part in the owned group
/// was taken for one the claim of the other group had applied, and leaked (found by
/// tests/integrity.rs's kill -9 loop: 5 blocks short after removing every file).
#[test]
fn a_free_across_two_groups_returns_both_parts() {
    let mut fx = Fx::new();
    let inner = fx.fs.inner().clone();
    let owned: Vec<super::AgId> = super::lock(&inner.alloc).owned().iter().copied().collect();
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(5, 100 * BLOCK_SIZE as usize));
    fx.release(ino, fh);
    let (_, ext) = committed(&fx, ino);
    let g = inner.geometry;
    let spans = |e: &meta::codec::Extent| {
        let first = g.ag_of(crate::data::BlockNo(e.dev_off / BLOCK_SIZE));
        let last = g.ag_of(crate::data::BlockNo((e.dev_off + e.len) / BLOCK_SIZE - 1));
        (first, last)
    };
    let across = ext.iter().find(|e| spans(e).0 != spans(e).1);
    let Some(across) = across else {
        panic!("no extent across a group boundary in {ext:?} (groups {owned:?})");
    };
    // The second group goes to nobody: out of the allocator, its ownership record deleted.
    let second = spans(across).1.unwrap();
    super::lock(&inner.alloc).disown(second).unwrap();
    let gid = meta::types::GroupId(second.0);
    assert!(inner
        .with_session(move |s| Box::pin(async move { s.release_group(gid).await }))
        .unwrap());
    fx.ok(ROOT, Operation::Unlink { name: b"f" });
    let a = super::lock(&inner.alloc);
    for ag in [spans(across).0.unwrap(), second] {
        let span = g.ag_extent(ag).unwrap();
        assert!(a.owned().contains(&ag), "{ag} owned again after the free");
        assert_eq!(
            a.group(ag).unwrap().free_blocks(),
            span.len,
            "{ag} whole again after the unlink"
        );
    }
}

/// A second mount of the filesystem `fx` serves, talking to its etcd through `kv`.
pub(super) fn second_mount_on(fx: &Fx, kv: Arc<dyn KvBackend>) -> Fx {
    Fx {
        fs: mount_on(kv, &fx.dev, &CacheOpts::uniform(Duration::from_secs(1))),
        kv: fx.kv.clone(),
        dev: fx.dev.clone(),
        out: vec![0; 2 << 20],
        unique: 1,
    }
}

/// A second mount (its own session) of the filesystem `fx` serves.
pub(super) fn second_mount(fx: &Fx) -> Fx {
    fx.another_mount(&CacheOpts::uniform(Duration::from_secs(1)))
}

/// Waits for the mount's watch: until it is live, the caches keep nothing (a test that
/// counts what cached values save failed in CI, where mounts start slower).
fn caches_live(fx: &Fx) {
    eventually("watch live", || counter(fx, "watch_live") == 1);
}

fn counter(fx: &Fx, name: &str) -> u64 {
    fx.fs
        .counters()
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no counter {name}"))
        .1
}

/// Polls `f` for up to 2 s (the watch runs on its own thread).
pub(super) fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("{what}: not within 2 s");
}

#[test]
fn negative_lookups_come_from_the_name_set() {
    let mut fx = Fx::new();
    // The caches answer only while the watch runs.
    eventually("watch live", || counter(&fx, "watch_live") == 1);
    let d = fx.mkdir(ROOT, b"d");
    for i in 0..50 {
        fx.create(d, format!("f{i}").as_bytes());
    }
    let before = counter(&fx, "lookups_etcd");
    for i in 0..200 {
        assert_eq!(fx.lookup(d, format!("missing{i}").as_bytes()).nodeid, 0);
    }
    for i in 0..50 {
        assert_ne!(fx.lookup(d, format!("f{i}").as_bytes()).nodeid, 0);
    }
    // The directory was created here: its (empty) name set was known from the start and
    // kept by our own creates, so nothing reached etcd.
    assert_eq!(
        counter(&fx, "lookups_etcd"),
        before,
        "{:?}",
        fx.fs.counters()
    );
    assert!(counter(&fx, "cache_negative_hits") >= 200);
    // A directory made elsewhere costs one range read, then nothing.
    let mut b = second_mount(&fx);
    eventually("watch live on b", || counter(&b, "watch_live") == 1);
    let loads = counter(&b, "cache_dir_names_loads");
    for i in 0..200 {
        assert_eq!(b.lookup(d, format!("missing{i}").as_bytes()).nodeid, 0);
    }
    assert_eq!(counter(&b, "cache_dir_names_loads"), loads + 1);
}

#[test]
fn changes_on_one_mount_reach_the_others_caches() {
    let mut a = Fx::new();
    let mut b = second_mount(&a);
    eventually("watch live", || counter(&b, "watch_live") == 1);
    assert_eq!(b.lookup(ROOT, b"x").nodeid, 0);
    assert_eq!(b.lookup(ROOT, b"x").nodeid, 0);
    assert!(counter(&b, "cache_negative_hits") > 0);
    // Create on a: b's cached absence dies.
    let (x, fh) = a.create(ROOT, b"x");
    a.release(x, fh);
    eventually("create seen", || b.lookup(ROOT, b"x").nodeid == x);
    // chmod and size on a: b's cached attributes follow.
    assert_eq!(b.getattr(x).attr.mode & 0o777, 0o644);
    a.ok(
        x,
        Operation::Setattr(SetattrIn {
            valid: FATTR_MODE,
            mode: 0o600,
            ..SetattrIn::default()
        }),
    );
    eventually("chmod seen", || b.getattr(x).attr.mode & 0o777 == 0o600);
    a.truncate(x, 12345);
    eventually("size seen", || b.getattr(x).attr.size == 12345);
    // Rename and unlink on a.
    a.ok(
        ROOT,
        Operation::Rename {
            newdir: ROOT,
            name: b"x",
            newname: b"y",
            flags: 0,
        },
    );
    eventually("rename seen", || {
        b.lookup(ROOT, b"x").nodeid == 0 && b.lookup(ROOT, b"y").nodeid == x
    });
    a.ok(ROOT, Operation::Unlink { name: b"y" });
    eventually("unlink seen", || b.lookup(ROOT, b"y").nodeid == 0);
    assert!(counter(&b, "watch_events_applied") > 0);
}

#[test]
fn a_directory_over_the_name_set_limit_is_looked_up_name_by_name() {
    let opts = CacheOpts {
        dir_names_max: 16,
        ..CacheOpts::uniform(Duration::from_secs(1))
    };
    let mut fx = Fx::with_opts(&opts);
    eventually("watch live", || counter(&fx, "watch_live") == 1);
    let d = fx.mkdir(ROOT, b"big");
    let mut inos = Vec::new();
    for i in 0..40 {
        inos.push(fx.create(d, format!("f{i}").as_bytes()).0);
    }
    // A second mount has no name set for it: its first lookup finds it over the limit.
    let mut b = fx.another_mount(&opts);
    eventually("watch live", || counter(&b, "watch_live") == 1);
    let _ = b.lookup(d, b"f0");
    assert_eq!(counter(&b, "cache_dir_names_over_limit"), 1);
    for (i, ino) in inos.iter().enumerate() {
        assert_eq!(b.lookup(d, format!("f{i}").as_bytes()).nodeid, *ino);
        assert_eq!(b.lookup(d, format!("g{i}").as_bytes()).nodeid, 0);
    }
    // And on the mount that made it, the set outgrew the limit.
    for (i, ino) in inos.iter().enumerate() {
        assert_eq!(fx.lookup(d, format!("f{i}").as_bytes()).nodeid, *ino);
        assert_eq!(fx.lookup(d, format!("g{i}").as_bytes()).nodeid, 0);
    }
}

/// Waits until `fx`'s watch has applied everything the store holds.
fn caught_up(fx: &Fx) {
    let rev = fx.kv.revision();
    eventually("watch caught up", || {
        counter(fx, "watch_revision") >= u64::try_from(rev).unwrap_or(0)
    });
}

#[test]
fn own_commits_tell_the_kernel_nothing_other_nodes_commits_do() {
    let mut a = Fx::new();
    let mut b = second_mount(&a);
    eventually("watch live", || {
        counter(&a, "watch_live") == 1 && counter(&b, "watch_live") == 1
    });
    let d = a.mkdir(ROOT, b"d");
    let mut files = Vec::new();
    for i in 0..100 {
        let (ino, fh) = a.create(d, format!("f{i}").as_bytes());
        a.release(ino, fh);
        files.push(ino);
    }
    a.ok(
        d,
        Operation::Rename {
            newdir: d,
            name: b"f0",
            newname: b"g0",
            flags: 0,
        },
    );
    a.ok(d, Operation::Unlink { name: b"f1" });
    a.ok(
        files[2],
        Operation::Setattr(SetattrIn {
            valid: FATTR_MODE,
            mode: 0o600,
            ..SetattrIn::default()
        }),
    );
    caught_up(&a);
    caught_up(&b);
    let names = |fx: &Fx| counter(fx, "kernel_inval_entry") + counter(fx, "kernel_delete");
    assert_eq!(names(&a), 0, "own name changes: {:?}", a.fs.counters());
    assert_eq!(counter(&a, "kernel_inval_data"), 0);
    assert!(counter(&a, "watch_revisions_own") >= 103);
    assert!(names(&b) >= 103, "{:?}", b.fs.counters());
    // The coalesced mtime of d answered nobody: its attributes are dropped (not its data)
    // once it is written.
    eventually("timestamp write reported", || {
        counter(&a, "kernel_inval_inode") >= 1
    });
    assert_eq!(counter(&a, "kernel_inval_data"), 0);
    // And the other way round.
    let before = names(&a);
    b.ok(d, Operation::Unlink { name: b"f3" });
    caught_up(&a);
    assert_eq!(names(&a), before + 1);
}

/// Polls `f` for up to `limit`.
pub(super) fn within(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < limit {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("{what}: not within {limit:?}");
}

#[test]
fn a_compacted_watch_history_drops_the_kernels_entries_of_what_was_cached() {
    let mut a = Fx::new();
    let mut b = second_mount(&a);
    eventually("watch live", || {
        counter(&a, "watch_live") == 1 && counter(&b, "watch_live") == 1
    });
    // Made on b, looked up on a: a caches d's name set, attributes, and an absence.
    let d = b.mkdir(ROOT, b"d");
    let mut files = Vec::new();
    for i in 0..10 {
        let (ino, fh) = b.create(d, format!("f{i}").as_bytes());
        b.release(ino, fh);
        files.push(ino);
    }
    caught_up(&a);
    for (i, ino) in files.iter().enumerate() {
        assert_eq!(a.lookup(d, format!("f{i}").as_bytes()).nodeid, *ino);
        a.getattr(*ino);
    }
    assert_eq!(a.lookup(ROOT, b"late").nodeid, 0);
    let entries = counter(&a, "kernel_inval_entry") + counter(&a, "kernel_delete");
    let inodes = counter(&a, "kernel_inval_inode");
    // a's watch is cut off; b changes things and etcd forgets the history.
    a.kv.set_watches_refused(true);
    b.ok(d, Operation::Unlink { name: b"f0" });
    let (late, fh) = b.create(ROOT, b"late");
    b.release(late, fh);
    a.kv.compact(a.kv.revision());
    a.kv.set_watches_refused(false);
    within("resync", Duration::from_secs(15), || {
        counter(&a, "watch_resyncs") >= 1 && counter(&a, "watch_live") == 1
    });
    // Every name and inode a had cached was named to the kernel (f0..f9 and "late" at
    // least; the absence of "late" came from the root's name set).
    let named = counter(&a, "kernel_inval_entry") + counter(&a, "kernel_delete") - entries;
    assert!(named >= 11, "{named}: {:?}", a.fs.counters());
    assert!(counter(&a, "kernel_inval_inode") - inodes >= 10);
    // And the daemon answers from etcd again.
    assert_eq!(a.lookup(d, b"f0").nodeid, 0);
    assert_eq!(a.lookup(ROOT, b"late").nodeid, late);
}

/// Blocks freed by a commit whose free-map write never happened (the node died right
/// after the unlink committed) are not lost: the unlink logged them as released records,
/// and the next node to load the group applies them and folds them into the map.
#[test]
fn freed_blocks_survive_a_crash_before_the_free_map_write() {
    let mut fx = Fx::new();
    let free_in = |fs: &EtcFs| -> Vec<(super::AgId, u64)> {
        let a = super::lock(&fs.inner().alloc);
        a.owned()
            .iter()
            .map(|g| (*g, a.group(*g).map_or(0, |m| m.free_blocks())))
            .collect()
    };
    let before = free_in(&fx.fs);
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(3, 20 * BLOCK_SIZE as usize));
    fx.release(ino, fh);
    let after = free_in(&fx.fs);
    let used: Vec<_> = before
        .iter()
        .zip(&after)
        .filter(|(b, a)| b.1 != a.1)
        .map(|(b, _)| b.0)
        .collect();
    assert!(
        !used.is_empty(),
        "the write allocated: {before:?} {after:?}"
    );
    // Another node unlinks the file: this node never frees the blocks nor writes the map,
    // exactly as if it had crashed after the freeing commit.
    let other = Pipeline::start(
        connect_backend(fx.kv.clone() as Arc<dyn KvBackend>),
        Keyspace::new("t").unwrap(),
        SessionId(77),
        Arc::new(SystemClock::new()),
        pipeline_config(),
    )
    .unwrap();
    let out = other
        .client()
        .commit(meta::pipeline::Mutation::Unlink {
            parent: meta::types::Ino(ROOT),
            name: b"f".to_vec(),
            dir: false,
            keep_open: false,
            drop_own_hold: false,
            expect: None,
        })
        .unwrap();
    assert_eq!(out.removed, Some(meta::types::Ino(ino)));
    assert!(!out.released.is_empty());
    other.shutdown();
    // The node "restarts": a new mount loads the groups (claiming them explicitly, as the
    // new session may start claiming elsewhere).
    let Fx { fs, kv, dev, .. } = fx;
    fs.destroy();
    drop(fs);
    let fs = mount(&kv, &dev);
    for g in &used {
        fs.inner().try_claim(g.0).unwrap();
    }
    let a = super::lock(&fs.inner().alloc);
    for (g, free) in &before {
        if used.contains(g) {
            assert_eq!(
                a.group(*g).map(|m| m.free_blocks()),
                Some(*free),
                "group {g:?}"
            );
        }
    }
    drop(a);
    // The records were folded into the map.
    let left = super::run_read(&fs.inner().meta, |kv, keys| {
        Box::pin(async move {
            let r = keys.released_between(0, u64::MAX);
            let req = meta::kv::RangeRequest::range(r.start, r.end);
            Ok(kv.range(req).await?.kvs.len())
        })
    })
    .unwrap();
    assert_eq!(left, 0, "released records left");
}

/// On the normal path the free-map write that returns freed blocks also deletes their
/// released records: truncate, punch and unlink leave none behind.
#[test]
fn frees_leave_no_released_records() {
    let mut fx = Fx::new();
    let free0 = fx.statfs().bfree;
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(5, 40 * BLOCK_SIZE as usize));
    fx.truncate(ino, 30 * BLOCK_SIZE);
    fx.ok(
        ino,
        Operation::Fallocate {
            fh,
            offset: 4 * BLOCK_SIZE,
            length: 8 * BLOCK_SIZE,
            mode: (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE) as u32,
        },
    );
    fx.release(ino, fh);
    fx.ok(ROOT, Operation::Unlink { name: b"f" });
    assert_eq!(fx.statfs().bfree, free0);
    let meta = &fx.fs.inner().meta;
    meta.flush(None).unwrap().wait().unwrap();
    let left = super::run_read(meta, |kv, keys| {
        Box::pin(async move {
            let r = keys.released_between(0, u64::MAX);
            let req = meta::kv::RangeRequest::range(r.start, r.end);
            Ok(kv.range(req).await?.kvs.len())
        })
    })
    .unwrap();
    assert_eq!(left, 0, "released records left");
}

/// The attributes etcd holds for `ino`.
pub(super) fn committed_attr(fx: &Fx, ino: u64) -> meta::codec::InodeAttr {
    let t = fx.fs.inner().meta.get_inode_at(meta::types::Ino(ino));
    t.unwrap().wait().unwrap().0.expect("inode in etcd")
}

/// The mtime a GETATTR of `ino` answers.
fn shown_mtime(fx: &mut Fx, ino: u64) -> meta::types::Timespec {
    let a = fx.getattr(ino).attr;
    meta::types::Timespec::new(a.mtime as i64, a.mtimensec)
}

/// The size and extents etcd holds for `ino` (what another node would see).
pub(super) fn committed(fx: &Fx, ino: u64) -> (u64, Vec<meta::codec::Extent>) {
    let size = committed_attr(fx, ino).size;
    let t = fx.fs.inner().meta.extents(meta::types::Ino(ino), 0, 1000);
    let (list, more) = t.unwrap().wait().unwrap();
    assert!(!more);
    (size, list)
}

/// Write-behind: allocating writes show at once in the open file's reads and attributes
/// (GETATTR, LOOKUP) and reach etcd, merged into one commit, at RELEASE.
#[test]
fn allocating_writes_commit_behind_at_close() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    let data = pattern(9, 100_000);
    for (i, c) in data.chunks(7_000).enumerate() {
        fx.write(ino, fh, (i * 7_000) as u64, c);
    }
    assert_eq!(fx.getattr(ino).attr.size, 100_000);
    assert_eq!(fx.getattr(ino).attr.blocks, 25 * 8);
    assert_eq!(fx.lookup(ROOT, b"f").attr.size, 100_000);
    same(&fx.read(ino, fh, 0, 200_000), &data);
    assert_eq!(committed(&fx, ino), (0, Vec::new()));
    // A watch dropping the map must not lose the pending extents.
    fx.fs.inner().files.forget_extents(ino);
    same(&fx.read(ino, fh, 0, 200_000), &data);
    fx.release(ino, fh);
    let (size, ext) = committed(&fx, ino);
    assert_eq!(size, 100_000);
    assert_eq!(ext.iter().map(|e| e.len).sum::<u64>(), 25 * BLOCK_SIZE);
    assert_eq!(
        ext.len(),
        1,
        "contiguous appends commit as one extent: {ext:?}"
    );
    let fh = fx.open(ino);
    same(&fx.read(ino, fh, 0, 200_000), &data);
    fx.release(ino, fh);
}

/// Truncate and punch right after appends commit the appends first; fsync commits too.
#[test]
fn truncate_punch_and_fsync_commit_pending_writes() {
    let mut fx = Fx::new();
    let free0 = fx.statfs().bfree;
    let (ino, fh) = fx.create(ROOT, b"f");
    let data = pattern(3, 64 * 1024);
    fx.write(ino, fh, 0, &data);
    assert_eq!(fx.truncate(ino, 10_000).attr.size, 10_000);
    assert_eq!(committed(&fx, ino).0, 10_000);
    same(&fx.read(ino, fh, 0, 100_000), &data[..10_000]);
    fx.write(ino, fh, 10_000, &data);
    let end = 10_000 + data.len() as u64;
    let punch = Operation::Fallocate {
        fh,
        offset: 4096,
        length: 8192,
        mode: 3,
    };
    fx.ok(ino, punch);
    let mut want = [&data[..10_000], &data[..]].concat();
    want[4096..12_288].fill(0);
    same(&fx.read(ino, fh, 0, 200_000), &want);
    assert_eq!(committed(&fx, ino).0, end);
    fx.write(ino, fh, end, b"more");
    fx.ok(ino, Operation::Fsync { fh, datasync: true });
    assert_eq!(committed(&fx, ino).0, end + 4);
    fx.release(ino, fh);
    fx.ok(ROOT, Operation::Unlink { name: b"f" });
    assert_eq!(fx.statfs().bfree, free0);
}

/// Unlinked while appends are pending: the space comes back at the last close.
#[test]
fn unlink_with_pending_writes_returns_the_space() {
    let mut fx = Fx::new();
    let free0 = fx.statfs().bfree;
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(1, 300_000));
    assert!(fx.statfs().bfree < free0);
    fx.ok(ROOT, Operation::Unlink { name: b"f" });
    fx.write(ino, fh, 300_000, &pattern(2, 100_000));
    fx.release(ino, fh);
    assert_eq!(fx.statfs().bfree, free0);
}

/// Many scattered writes: the pending change commits before it passes a mutation's
/// extent cap, and all of it commits at close.
#[test]
fn scattered_writes_commit_within_the_extent_cap() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    let n = 3 * super::PENDING_EXTENTS_MAX as u64;
    for i in 0..n {
        fx.write(ino, fh, i * 2 * BLOCK_SIZE, &pattern(i as u8, 100));
    }
    let (_, ext) = committed(&fx, ino);
    assert!(!ext.is_empty(), "the extent cap committed nothing");
    fx.release(ino, fh);
    let (size, ext) = committed(&fx, ino);
    assert_eq!(size, (n - 1) * 2 * BLOCK_SIZE + 100);
    assert_eq!(ext.len() as u64, n);
    let fh = fx.open(ino);
    for i in 0..n {
        assert_eq!(
            fx.read(ino, fh, i * 2 * BLOCK_SIZE, 100),
            pattern(i as u8, 100)
        );
    }
    fx.release(ino, fh);
}

/// A node whose session is gone never commits pending extents (their groups may be
/// another node's): fsync fails, the blocks go back, etcd is unchanged.
#[test]
fn pending_writes_are_dropped_when_the_session_is_gone() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(1, 50_000));
    let before = fx.fs.inner().alloc_free_blocks();
    let session = super::lock(&fx.fs.inner().session).take();
    drop(session);
    let e = fx.err(
        ino,
        Operation::Fsync {
            fh,
            datasync: false,
        },
    );
    assert_eq!(e, Errno::EIO);
    assert_eq!(fx.fs.inner().alloc_free_blocks(), before + 13);
    assert_eq!(committed(&fx, ino), (0, Vec::new()));
}

/// Appends after a commit stay pending: the committed extent before them does not count
/// as one more the pending range covers (it did, and every append past the cap committed).
#[test]
fn appends_after_a_commit_stay_pending() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    fx.write(ino, fh, 0, &pattern(1, BLOCK_SIZE as usize));
    fx.ok(ino, Operation::Fsync { fh, datasync: true });
    let n = 2 * super::PENDING_EXTENTS_MAX as u64;
    for i in 1..=n {
        fx.write(
            ino,
            fh,
            i * BLOCK_SIZE,
            &pattern(i as u8, BLOCK_SIZE as usize),
        );
    }
    let (size, ext) = committed(&fx, ino);
    assert_eq!(
        (size, ext.len()),
        (BLOCK_SIZE, 1),
        "appends committed early"
    );
    fx.release(ino, fh);
    let (size, ext) = committed(&fx, ino);
    assert_eq!(size, (n + 1) * BLOCK_SIZE);
    assert_eq!(ext.iter().map(|e| e.len).sum::<u64>(), size);
}

/// fallocate mode 0 that only raises the size inside the EOF block of a written extent:
/// its mutation got the whole extent, which reaches outside its one-block range (EINVAL;
/// fsx seed 7 stopped with "does not support posix_fallocate").
#[test]
fn fallocate_raising_the_size_inside_a_written_extent() {
    let mut fx = Fx::new();
    let (ino, fh) = fx.create(ROOT, b"f");
    let data = pattern(4, 8 * BLOCK_SIZE as usize);
    fx.write(ino, fh, 0, &data);
    fx.truncate(ino, 0x5c00);
    fx.ok(
        ino,
        Operation::Fallocate {
            fh,
            offset: 0x5100,
            length: 0xd00,
            mode: 0,
        },
    );
    assert_eq!(fx.getattr(ino).attr.size, 0x5e00);
    let mut want = data[..0x5e00].to_vec();
    want[0x5c00..].fill(0);
    same(&fx.read(ino, fh, 0, 0x10000), &want);
    fx.release(ino, fh);
}

/// A file with more extents than one commit can log as released loses them in logged
/// chunks, on truncate, punch and unlink alike, whether its extent map is cached (60
/// extents) or too large to cache (70, past the test build's cap of 64): every freed range
/// can survive a crash, and every block comes back.
#[test]
fn large_files_free_every_range_logged() {
    assert!((61..70).contains(&super::files::EXTENTS_CACHED_MAX));
    let mut fx = Fx::new();
    let free = |fs: &EtcFs| -> u64 {
        let a = super::lock(&fs.inner().alloc);
        a.owned()
            .iter()
            .map(|g| a.group(*g).map_or(0, |m| m.free_blocks()))
            .sum()
    };
    let before = free(&fx.fs);
    for (extents, name) in [
        (60u64, &b"truncate-60"[..]),
        (70, b"truncate-70"),
        (60, b"punch-60"),
        (70, b"punch-70"),
        (70, b"unlink-70"),
    ] {
        let (ino, fh) = fx.create(ROOT, name);
        // Every other block: extents that cannot merge.
        for i in 0..extents {
            fx.write(
                ino,
                fh,
                2 * i * BLOCK_SIZE,
                &pattern(i as u8, BLOCK_SIZE as usize),
            );
        }
        assert_eq!(before - free(&fx.fs), extents, "{name:?}");
        let size = (2 * extents - 1) * BLOCK_SIZE;
        if name.starts_with(b"punch") {
            fx.ok(
                ino,
                Operation::Fallocate {
                    fh,
                    offset: BLOCK_SIZE,
                    length: size,
                    mode: 0x03,
                },
            );
            assert_eq!(before - free(&fx.fs), 1, "{name:?}: the first block stays");
            assert_eq!(fx.getattr(ino).attr.size, size, "KEEP_SIZE");
            let mut want = vec![0u8; 3 * BLOCK_SIZE as usize];
            want[..BLOCK_SIZE as usize].copy_from_slice(&pattern(0, BLOCK_SIZE as usize));
            same(&fx.read(ino, fh, 0, 3 * BLOCK_SIZE as u32), &want);
        }
        fx.release(ino, fh);
        if name.starts_with(b"truncate") {
            let a = fx.truncate(ino, BLOCK_SIZE / 2);
            assert_eq!(a.attr.size, BLOCK_SIZE / 2);
            assert_eq!(before - free(&fx.fs), 1, "{name:?}: the first block stays");
            fx.truncate(ino, 0);
        }
        fx.ok(ROOT, Operation::Unlink { name });
        assert_eq!(free(&fx.fs), before, "{name:?}");
    }
    assert_eq!(counter(&fx, "frees_unlogged"), 0);
}

/// Growing a file (truncate up, fallocate past EOF) zeroes what lies past the old size in
/// its last block: bytes an append put on the device before a crash lost its size commit
/// must not show through the grown file.
#[test]
fn growing_a_file_hides_device_bytes_past_the_old_size() {
    use crate::data::device::BlockDev as _;
    let mut fx = Fx::new();
    for name in [&b"t"[..], b"f"] {
        let (ino, fh) = fx.create(ROOT, name);
        fx.write(ino, fh, 0, &pattern(1, 100));
        fx.release(ino, fh);
        // The append that reached the device and no further.
        let (list, _) = fx
            .fs
            .inner()
            .meta
            .extents(meta::types::Ino(ino), 0, 4)
            .unwrap()
            .wait()
            .unwrap();
        let dev_off = list[0].dev_off;
        let mut dev = fx.dev.clone();
        let mut b = uring::AlignedBuf::new(BLOCK_SIZE as usize);
        dev.read_at(&mut b, dev_off).unwrap();
        b[100..].fill(0xab);
        dev.write_at(&b, dev_off).unwrap();
        let fh = fx.open(ino);
        if name == b"t" {
            fx.truncate(ino, 2 * BLOCK_SIZE);
        } else {
            fx.ok(
                ino,
                Operation::Fallocate {
                    fh,
                    offset: 0,
                    length: 2 * BLOCK_SIZE,
                    mode: 0,
                },
            );
        }
        let got = fx.read(ino, fh, 0, 2 * BLOCK_SIZE as u32);
        let mut want = pattern(1, 100);
        want.resize(2 * BLOCK_SIZE as usize, 0);
        assert!(got == want, "{:?}: bytes past the old size show", name);
        fx.release(ino, fh);
    }
}

/// A session of this host is taken for dead only when its daemon is gone: no such pid, a
/// process that is not etcfs, or one that started after the session did (a reused pid).
#[test]
fn a_local_session_is_dead_only_when_its_daemon_is_gone() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let rec = |pid: u32, sec: i64| meta::codec::NodeRecord {
        name: b"h".to_vec(),
        pid,
        started: meta::types::Timespec { sec, nsec: 0 },
    };
    // This test binary is named etcfs-<hash>, started before now.
    assert!(super::space::daemon_alive(&rec(std::process::id(), now)));
    assert!(!super::space::daemon_alive(&rec(std::process::id(), 1_000)));
    assert!(
        !super::space::daemon_alive(&rec(1, now)),
        "init is not etcfs"
    );
    assert!(
        !super::space::daemon_alive(&rec(u32::MAX - 1, now)),
        "no such pid"
    );
}

/// etcd refusing a namespace change against this node's view (EEXIST for a name the caches
/// called absent, ENOENT for one they had) drops the daemon's entry and makes the kernel's
/// dentries stale (one epoch bump), so the next lookup shows what etcd said. Changes that
/// meet no other node bump nothing.
#[test]
fn a_refused_namespace_change_makes_cached_names_stale() {
    let mut a = Fx::new();
    let mut b = second_mount(&a);
    a.mkdir(ROOT, b"mine");
    assert_eq!(counter(&a, "kernel_epochs"), 0);
    // Absent: a negative entry (node id 0) the kernel may cache.
    assert_eq!(a.lookup(ROOT, b"x").nodeid, 0);
    b.mkdir(ROOT, b"x");
    let mkdir = Operation::Mkdir {
        name: b"x",
        mode: 0o755,
        umask: 0o022,
    };
    assert_eq!(a.err(ROOT, mkdir), Errno::EEXIST);
    assert_eq!(counter(&a, "kernel_epochs"), 1);
    assert_ne!(a.lookup(ROOT, b"x").nodeid, 0);
    b.ok(ROOT, Operation::Rmdir { name: b"x" });
    assert_eq!(a.err(ROOT, Operation::Rmdir { name: b"x" }), Errno::ENOENT);
    assert_eq!(a.lookup(ROOT, b"x").nodeid, 0);
    assert!(counter(&a, "kernel_epochs") >= 1);
}

/// Keys of the model between two tag bytes (`t/<from>` up to `t/<to>`).
pub(super) fn keys_of(fx: &Fx, from: &[u8], to: &[u8]) -> usize {
    fx.kv.dump(from, to).len()
}

/// A release deletes this node's lock key only once no operation is taking the lock: a
/// WRITE let in to upgrade a shared lock being given up puts the key as exclusive, and a
/// delete landing after that put in etcd left the write running as an exclusive holder
/// with no key, beside the asker's exclusive grant (tests/cluster.rs: two nodes appended
/// at one offset and one O_APPEND record was lost, in CI). Here the upgrade's request is
/// held in flight while the release reaches the delete.
#[test]
fn a_release_never_deletes_its_key_beside_an_acquire_in_flight() {
    let mut a = Fx::new();
    let (ino, fh) = a.create(ROOT, b"f");
    a.write(ino, fh, 0, b"data");
    a.fsync(ino, fh);
    let keys = meta::keys::Keyspace::new("t").expect("prefix");
    let key = keys.cache_lock(meta::types::Ino(ino), a.fs.inner().locks.me());
    let end = [key.as_slice(), &[0]].concat();
    assert_eq!(keys_of(&a, &key, &end), 1, "the create's lock is held");
    let inner = a.fs.inner();
    let user = shared_hold(inner, ino);
    std::thread::scope(|s| {
        let release = s.spawn(|| inner.give_up(ino));
        // The release waits for our hold; the "upgrade" starts meanwhile.
        wait_until_releasing(inner, ino);
        inner.pretend_acquiring(ino, true);
        drop(user);
        std::thread::sleep(Duration::from_millis(300));
        assert!(!release.is_finished(), "the release waits for the acquire");
        assert_eq!(
            keys_of(&a, &key, &end),
            1,
            "the key stays while it is taken"
        );
        inner.pretend_acquiring(ino, false);
        release.join().expect("the release");
    });
    assert_eq!(
        keys_of(&a, &key, &end),
        0,
        "given up once the acquire is over"
    );
    assert!(!inner.lock_releasing(ino));
}

/// A shared hold of `ino`'s cache lock, which this node holds.
fn shared_hold(inner: &super::Inner, ino: u64) -> crate::fs::locks::Hold {
    inner
        .locks
        .try_hold(ino, meta::cachelock::LockMode::Shared)
        .expect("a hold of the lock")
}

/// Returns once a release of `ino`'s lock has started (it then waits for the holds).
fn wait_until_releasing(inner: &super::Inner, ino: u64) {
    let t0 = std::time::Instant::now();
    while !inner.lock_releasing(ino) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the release started"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A hold let go wakes the release waiting for it: the drop skips
/// the wake-up system call when nobody waits (it cost a futex call per READ), so the
/// release's waiting must be counted for the drop to see it.
#[test]
fn a_release_waiting_for_a_hold_wakes_when_the_hold_is_let_go() {
    let mut a = Fx::new();
    let (ino, fh) = a.create(ROOT, b"f");
    a.write(ino, fh, 0, b"data");
    a.fsync(ino, fh);
    let inner = a.fs.inner();
    let user = shared_hold(inner, ino);
    std::thread::scope(|s| {
        let release = s.spawn(|| inner.give_up(ino));
        wait_until_releasing(inner, ino);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!release.is_finished(), "the release waits for the hold");
        drop(user);
        let t0 = std::time::Instant::now();
        while !release.is_finished() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let woken = release.is_finished();
        // A missed wake-up would leave the release asleep for good: wake it another way,
        // so that the scope can end and the test fail rather than hang.
        inner.pretend_acquiring(ino, false);
        release.join().expect("the release");
        assert!(woken, "the hold's drop woke the release");
    });
    assert!(!inner.lock_releasing(ino));
}

/// A write that arrives inside the pages this node invalidates while it gives up a
/// shared lock upgrades the lock; when another node keeps its own shared lock (it waits
/// for this one the same way), the write is answered EINTR after 2 s with nothing
/// written, which frees the pages the release waits for. It was EIO, which the writer
/// does not retry: tests/cluster.rs's three appending nodes, once in 90 runs on a
/// loaded machine, both nodes' appends at once.
#[test]
fn a_write_two_releasing_nodes_wait_on_for_each_other_is_interrupted_not_failed() {
    let mut a = Fx::new();
    let (ino, fh) = a.create(ROOT, b"f");
    a.write(ino, fh, 0, b"before");
    a.release(ino, fh);
    let mut b = second_mount(&a);
    let Fx { fs, .. } = a;
    fs.destroy();
    drop(fs);
    let fh = b.open(ino);
    assert_eq!(b.read(ino, fh, 0, 100), b"before");
    // Another node's shared lock, which it never gives up (it waits for ours).
    let keys = meta::keys::Keyspace::new("t").expect("prefix");
    let other = meta::types::SessionId(0x5eed);
    let shared = meta::cachelock::CacheLock {
        mode: meta::cachelock::LockMode::Shared,
    };
    b.kv.put_raw(
        &keys.cache_lock(meta::types::Ino(ino), other),
        &meta::codec::Record::encode(&shared),
    );
    b.fs.inner().pretend_releasing(ino, Some((0, 1 << 20)));
    let started = std::time::Instant::now();
    let e = b.err(
        ino,
        Operation::Write {
            fh,
            offset: 6,
            data: b" after",
            write_flags: 0,
            flags: 0,
        },
    );
    assert_eq!(e, Errno::EINTR);
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert_eq!(counter(&b, "cache_lock_writes_interrupted"), 1);
    b.fs.inner().pretend_releasing(ino, None);
    assert_eq!(b.read(ino, fh, 0, 100), b"before", "nothing written");
}

/// Node B has a file open that node A unlinks: B reads it whole, A does not free it; B's
/// close reclaims it, and A (which owns the blocks' groups) gets the space back. Before
/// open records, A deleted the inode and its extents at once.
#[test]
fn a_file_open_on_another_node_lives_until_its_last_close_there() {
    let mut a = Fx::new();
    let free0 = a.statfs().bfree;
    let (ino, fh) = a.create(ROOT, b"f");
    let data = pattern(11, 300_000);
    a.write(ino, fh, 0, &data);
    a.release(ino, fh);
    assert_eq!(keys_of(&a, b"t/H", b"t/I"), 0, "closed: no open record");
    let mut b = second_mount(&a);
    let bino = b.lookup(ROOT, b"f").nodeid;
    assert_eq!(bino, ino);
    let bfh = b.open(ino);
    assert_eq!(keys_of(&a, b"t/H", b"t/I"), 1, "B's open record");
    a.ok(ROOT, Operation::Unlink { name: b"f" });
    assert_eq!(keys_of(&a, b"t/O", b"t/P"), 1, "kept as an orphan");
    // A writes more than the file held: were its blocks free, some would be reused.
    let (g, gfh) = a.create(ROOT, b"g");
    a.write(g, gfh, 0, &pattern(12, 600_000));
    a.release(g, gfh);
    assert_eq!(b.read(ino, bfh, 0, 300_000), data, "B reads the file whole");
    b.release(ino, bfh);
    assert_eq!(keys_of(&a, b"t/O", b"t/P"), 0, "reclaimed at B's close");
    assert_eq!(keys_of(&a, b"t/H", b"t/I"), 0, "no open record left");
    // The blocks lie in A's groups: A folds B's released records into its maps.
    a.ok(ROOT, Operation::Unlink { name: b"g" });
    within("the space back on A", Duration::from_secs(10), || {
        a.statfs().bfree == free0
    });
    within("no released record left", Duration::from_secs(5), || {
        keys_of(&a, b"t/R", b"t/S") == 0
    });
    assert_eq!(b.statfs().bfree, free0, "B sees it too");
}

/// Rename over a file another node has open: the same as an unlink.
#[test]
fn a_file_renamed_over_while_open_on_another_node_lives_until_closed_there() {
    let mut a = Fx::new();
    let (ino, fh) = a.create(ROOT, b"f");
    let data = pattern(13, 100_000);
    a.write(ino, fh, 0, &data);
    a.release(ino, fh);
    let (g, gfh) = a.create(ROOT, b"g");
    a.release(g, gfh);
    let mut b = second_mount(&a);
    assert_eq!(b.lookup(ROOT, b"f").nodeid, ino);
    let bfh = b.open(ino);
    a.ok(
        ROOT,
        Operation::Rename {
            newdir: ROOT,
            flags: 0,
            name: b"g",
            newname: b"f",
        },
    );
    assert_eq!(keys_of(&a, b"t/O", b"t/P"), 1, "kept as an orphan");
    assert_eq!(b.read(ino, bfh, 0, 100_000), data);
    b.release(ino, bfh);
    assert_eq!(keys_of(&a, b"t/O", b"t/P"), 0, "reclaimed at B's close");
}

/// Open on both nodes when unlinked: the first close leaves it, the last reclaims it,
/// whichever node that is.
#[test]
fn the_last_close_anywhere_reclaims() {
    let mut a = Fx::new();
    let free0 = a.statfs().bfree;
    let (ino, fh) = a.create(ROOT, b"f");
    a.write(ino, fh, 0, &pattern(14, 50_000));
    a.fsync(ino, fh);
    let mut b = second_mount(&a);
    assert_eq!(b.lookup(ROOT, b"f").nodeid, ino);
    let bfh = b.open(ino);
    b.ok(ROOT, Operation::Unlink { name: b"f" });
    a.release(ino, fh);
    assert_eq!(keys_of(&a, b"t/O", b"t/P"), 1, "B still has it open");
    assert_eq!(b.read(ino, bfh, 0, 50_000), pattern(14, 50_000));
    b.release(ino, bfh);
    assert_eq!(
        keys_of(&a, b"t/O", b"t/P"),
        0,
        "reclaimed at the last close"
    );
    within("the space back on A", Duration::from_secs(10), || {
        a.statfs().bfree == free0
    });
}

/// A node that dies holding an unlinked file: its open record goes with its session, and
/// a live node's orphan scan reclaims the file although the unlinker is alive.
#[test]
fn an_orphan_held_by_a_dead_node_is_reclaimed_by_a_live_one() {
    let mut a = Fx::new();
    let (ino, fh) = a.create(ROOT, b"f");
    a.write(ino, fh, 0, &pattern(15, 50_000));
    a.release(ino, fh);
    let mut b = second_mount(&a);
    assert_eq!(b.lookup(ROOT, b"f").nodeid, ino);
    let _bfh = b.open(ino);
    a.ok(ROOT, Operation::Unlink { name: b"f" });
    assert_eq!(keys_of(&a, b"t/O", b"t/P"), 1);
    a.fs.inner().reclaim_dead_orphans().unwrap();
    assert_eq!(keys_of(&a, b"t/O", b"t/P"), 1, "held by B: not reclaimed");
    // B "dies": its session ends without its files being closed.
    b.fs.inner().files.close(ino);
    b.fs.destroy();
    assert_eq!(
        keys_of(&a, b"t/H", b"t/I"),
        0,
        "B's record went with its lease"
    );
    a.fs.inner().reclaim_dead_orphans().unwrap();
    assert_eq!(keys_of(&a, b"t/O", b"t/P"), 0, "reclaimed by A");
}

/// The filesystem's own records (not sessions, locks, open records or commit markers).
fn fs_records(kv: &MemEtcd) -> Vec<(Vec<u8>, Vec<u8>)> {
    use meta::keys::KeyKind as K;
    let keys = Keyspace::new("t").unwrap();
    let all = keys.all();
    kv.dump(&all.start, &all.end)
        .into_iter()
        .filter(|(k, _)| {
            !matches!(
                keys.parse(k),
                Some(
                    K::Member(_)
                        | K::Evict(_)
                        | K::CacheLock(..)
                        | K::CacheWant(..)
                        | K::Held(..)
                        | K::Lock(_)
                        | K::TxnMarker(..)
                )
            )
        })
        .collect()
}

#[test]
fn a_read_only_mount_refuses_changes_and_writes_nothing_of_its_own() {
    let mut fx = Fx::new();
    let (f, fh) = fx.create(ROOT, b"f");
    fx.write(f, fh, 0, &pattern(3, 3 * BLOCK_SIZE as usize));
    fx.release(f, fh);
    let d = fx.mkdir(ROOT, b"d");
    fx.fs.destroy();
    let before = fs_records(&fx.kv);
    assert!(before.len() > 5, "inodes, names, extents, maps: {before:?}");

    let opts = CacheOpts {
        read_only: true,
        ..CacheOpts::uniform(Duration::from_secs(1))
    };
    let mut ro = fx.another_mount(&opts);
    // Reads work (a first read after a write would move atime under relatime).
    let e = ro.lookup(ROOT, b"f");
    assert_eq!(e.nodeid, f);
    let fh = parse::<OpenOut>(&ro.ok(
        f,
        Operation::Open {
            flags: libc::O_RDONLY as u32,
            open_flags: 0,
        },
    ))
    .fh;
    same(
        &ro.read(f, fh, 0, 3 * BLOCK_SIZE as u32),
        &pattern(3, 3 * BLOCK_SIZE as usize),
    );
    assert_eq!(ro.names(ROOT).len(), 4, "., .., f, d");
    ro.statfs();
    ro.getattr(d);
    // Every change answers EROFS.
    let setattr = SetattrIn {
        valid: FATTR_MODE,
        mode: 0o600,
        ..SetattrIn::default()
    };
    for (ino, op) in [
        (
            f,
            Operation::Open {
                flags: libc::O_RDWR as u32,
                open_flags: 0,
            },
        ),
        (
            f,
            Operation::Open {
                flags: (libc::O_RDONLY | libc::O_TRUNC) as u32,
                open_flags: 0,
            },
        ),
        (
            ROOT,
            Operation::Create {
                name: b"g",
                flags: libc::O_RDWR as u32,
                mode: 0o644,
                umask: 0o022,
                open_flags: 0,
            },
        ),
        (
            ROOT,
            Operation::Mkdir {
                name: b"e",
                mode: 0o755,
                umask: 0,
            },
        ),
        (ROOT, Operation::Unlink { name: b"f" }),
        (ROOT, Operation::Rmdir { name: b"d" }),
        (
            ROOT,
            Operation::Rename {
                newdir: d,
                name: b"f",
                newname: b"f2",
                flags: 0,
            },
        ),
        (
            d,
            Operation::Link {
                oldnodeid: f,
                name: b"l",
            },
        ),
        (
            ROOT,
            Operation::Symlink {
                name: b"s",
                target: b"f",
            },
        ),
        (f, Operation::Setattr(setattr)),
        (
            f,
            Operation::Setxattr {
                name: b"user.a",
                value: b"1",
                flags: 0,
            },
        ),
        (f, Operation::Removexattr { name: b"user.a" }),
        (
            f,
            Operation::Write {
                fh,
                offset: 0,
                data: b"x",
                write_flags: 0,
                flags: 0,
            },
        ),
        (
            f,
            Operation::Fallocate {
                fh,
                offset: 0,
                length: 4096,
                mode: 0,
            },
        ),
    ] {
        let what = format!("{op:?}");
        assert_eq!(ro.err(ino, op), Errno::EROFS, "{what}");
    }
    ro.release(f, fh);
    ro.fs.destroy();
    assert!(
        before == fs_records(&fx.kv),
        "a read-only mount changed the filesystem's records"
    );
}

/// A READDIRPLUS page's block counts are read in waves of `BLOCK_READS_IN_FLIGHT` (one
/// page all at once overran a loaded etcd): every file still gets its own count, in order.
#[test]
fn block_counts_of_a_page_read_in_waves_match_each_file() {
    let mut fx = Fx::new();
    let mut files = Vec::new();
    for i in 0..80u8 {
        let (ino, fh) = fx.create(ROOT, format!("f{i:02}").as_bytes());
        // Sizes from empty to 20 blocks, so a shifted answer shows.
        fx.write(ino, fh, 0, &pattern(i, usize::from(i % 21) * 4096));
        fx.release(ino, fh);
        files.push((ino, u64::from(i % 21) * 8));
    }
    let inner = fx.fs.inner();
    let attrs: Vec<meta::codec::InodeAttr> = files
        .iter()
        .map(|&(ino, _)| {
            inner.caches.forget_blocks(ino);
            inner.get_attr(ino).expect("attr")
        })
        .collect();
    let refs: Vec<&meta::codec::InodeAttr> = attrs.iter().collect();
    let got = inner.files_blocks(&refs);
    assert_eq!(got.len(), files.len());
    for ((ino, want), b) in files.iter().zip(got) {
        assert_eq!(b, Ok(Some(*want)), "inode {ino}");
    }
}

/// Small unaligned writes (a WAL's frames: a 24-byte header, then a page) merge into the
/// copy of the block the write before them left instead of reading it back, and a copy
/// never outlives a change of its block by anything else: an aligned overwrite on the
/// fast path, a truncate, or another node's write once this node's lock went.
#[test]
fn small_writes_merge_into_the_block_just_written_and_nothing_stale() {
    /// The file as written through `fh`, and what it should read.
    struct Wal {
        ino: u64,
        fh: u64,
        bytes: Vec<u8>,
    }
    impl Wal {
        fn put(&mut self, fx: &mut Fx, off: u64, data: &[u8]) {
            fx.write(self.ino, self.fh, off, data);
            let end = off as usize + data.len();
            if self.bytes.len() < end {
                self.bytes.resize(end, 0);
            }
            self.bytes[off as usize..end].copy_from_slice(data);
        }
        fn frames(&mut self, fx: &mut Fx, seed: u8) {
            for i in 0..8u8 {
                let at = frame(u64::from(i));
                self.put(fx, at, &pattern(seed.wrapping_add(i), 24));
                self.put(fx, at + 24, &pattern(seed.wrapping_add(100 + i), 4096));
            }
        }
        fn check(&self, fx: &mut Fx) {
            same(
                &fx.read(self.ino, self.fh, 0, self.bytes.len() as u32),
                &self.bytes,
            );
        }
    }
    fn frame(i: u64) -> u64 {
        32 + i * (24 + BLOCK_SIZE)
    }
    let mut a = Fx::new();
    let (ino, fh) = a.create(ROOT, b"wal");
    let mut wal = Wal {
        ino,
        fh,
        bytes: Vec::new(),
    };
    wal.put(&mut a, 0, &pattern(7, 32));
    wal.frames(&mut a, 1);
    a.fsync(ino, fh);
    let appended = counter(&a, "rmw_blocks_kept");
    assert!(appended >= 8, "appending frames kept {appended} blocks");
    wal.check(&mut a);
    // The WAL reused in place: each header lands in the block the page before it ended in,
    // merged into the copy kept of it, or held with it.
    let held = counter(&a, "writes_held");
    wal.frames(&mut a, 50);
    let reused = counter(&a, "rmw_blocks_kept") - appended + counter(&a, "writes_held") - held;
    assert!(
        reused >= 16,
        "rewriting frames kept or held {reused} blocks"
    );
    wal.check(&mut a);

    // An aligned overwrite of a kept block (the fast path), then a small write into it.
    let block = frame(7) / BLOCK_SIZE * BLOCK_SIZE;
    wal.put(&mut a, block, &pattern(200, BLOCK_SIZE as usize));
    wal.put(&mut a, block + 100, &pattern(201, 10));
    wal.check(&mut a);

    // Cut inside a kept block and grown again: the bytes past the cut read as zeros.
    let cut = frame(7) + 24 + 1000;
    a.truncate(ino, cut);
    wal.bytes.truncate(cut as usize);
    wal.put(&mut a, cut + 50, &pattern(202, 20));
    wal.check(&mut a);

    // Another node writes the file once A's lock is gone: A's next small write into
    // that block merges into what B wrote, not into A's copy of it.
    let at = frame(6) + 24 + 10;
    wal.put(&mut a, at - 20, &pattern(205, 5));
    a.fsync(ino, fh);
    let mut b = second_mount(&a);
    let bfh = b.open(ino);
    b.write(ino, bfh, at, &pattern(203, 30));
    wal.bytes[at as usize..at as usize + 30].copy_from_slice(&pattern(203, 30));
    b.fsync(ino, bfh);
    b.release(ino, bfh);
    wal.put(&mut a, at + 40, &pattern(204, 5));
    wal.check(&mut a);
    a.release(ino, fh);
    let mut c = second_mount(&a);
    let cfh = c.open(ino);
    same(&c.read(ino, cfh, 0, wal.bytes.len() as u32), &wal.bytes);
    c.release(ino, cfh);
}

/// Small buffered overwrites are held ([`files::HeldBlocks`]) and answered without the
/// device, and every reader and writer of the blocks sees them: this node's reads and
/// writes of other kinds, truncate, fsync, the age bound, another node taking the lock,
/// and a session that ends before they are written (then EIO and the old data).
#[test]
fn small_overwrites_are_held_and_every_reader_and_writer_sees_them() {
    fn held(fx: &Fx) -> u64 {
        counter(fx, "writes_held")
    }
    fn written(fx: &Fx) -> u64 {
        counter(fx, "held_blocks_written")
    }
    let mut a = Fx::new();
    let (ino, fh) = a.create(ROOT, b"db");
    let mut model = pattern(1, 16 * BLOCK_SIZE as usize);
    a.write(ino, fh, 0, &model);
    a.fsync(ino, fh);
    let put = |fx: &mut Fx, model: &mut Vec<u8>, off: u64, data: &[u8]| {
        fx.write(ino, fh, off, data);
        model[off as usize..off as usize + data.len()].copy_from_slice(data);
    };

    // A whole block, then bytes inside it.
    let h0 = held(&a);
    put(
        &mut a,
        &mut model,
        2 * BLOCK_SIZE,
        &pattern(2, BLOCK_SIZE as usize),
    );
    put(&mut a, &mut model, 2 * BLOCK_SIZE + 100, &pattern(3, 50));
    assert_eq!(
        held(&a) - h0,
        2,
        "a whole block and a write into it are held"
    );
    assert_eq!(written(&a), 0);
    // Across into a block neither held nor kept: a waiter reads that one from the device,
    // builds the other on its held copy and holds both; the next write into it is held
    // on a core.
    put(&mut a, &mut model, 3 * BLOCK_SIZE - 10, &pattern(4, 20));
    assert_eq!((held(&a) - h0, written(&a)), (3, 0));
    put(&mut a, &mut model, 3 * BLOCK_SIZE + 500, &pattern(5, 20));
    assert_eq!(held(&a) - h0, 4);
    // This node's read writes them out first and sees them.
    same(&a.read(ino, fh, 0, model.len() as u32), &model);
    assert_eq!(written(&a), 2);

    // A write the application wants on the device (O_DIRECT) is not held, and goes after
    // what is.
    put(
        &mut a,
        &mut model,
        5 * BLOCK_SIZE,
        &pattern(6, BLOCK_SIZE as usize),
    );
    let h1 = held(&a);
    let direct = pattern(7, BLOCK_SIZE as usize);
    a.ok(
        ino,
        Operation::Write {
            fh,
            offset: 5 * BLOCK_SIZE,
            data: &direct,
            write_flags: 0,
            flags: libc::O_DIRECT as u32,
        },
    );
    model[5 * BLOCK_SIZE as usize..6 * BLOCK_SIZE as usize].copy_from_slice(&direct);
    assert_eq!(held(&a), h1);
    same(&a.read(ino, fh, 0, model.len() as u32), &model);

    // Truncate inside a held block, then grow: zeros past the cut.
    put(
        &mut a,
        &mut model,
        7 * BLOCK_SIZE,
        &pattern(8, BLOCK_SIZE as usize),
    );
    let cut = 7 * BLOCK_SIZE + 300;
    a.truncate(ino, cut);
    model.truncate(cut as usize);
    model.resize(16 * BLOCK_SIZE as usize, 0);
    a.truncate(ino, model.len() as u64);
    same(&a.read(ino, fh, 0, model.len() as u32), &model);

    // fsync writes them (and keeps a copy of what it wrote); so does the age bound.
    put(
        &mut a,
        &mut model,
        2 * BLOCK_SIZE,
        &pattern(9, BLOCK_SIZE as usize),
    );
    let w = written(&a);
    a.fsync(ino, fh);
    assert_eq!(written(&a), w + 1);
    put(&mut a, &mut model, 2 * BLOCK_SIZE + 70, &pattern(10, 9));
    std::thread::sleep(super::PENDING_AGE_MAX + Duration::from_millis(100));
    a.fs.inner().commit_aged();
    assert_eq!(written(&a), w + 2);

    // Another node reads and then writes the file: A writes back when it gives way, and
    // its next small write merges into what B wrote.
    put(&mut a, &mut model, 9 * BLOCK_SIZE + 1, &pattern(11, 4000));
    put(
        &mut a,
        &mut model,
        11 * BLOCK_SIZE,
        &pattern(12, BLOCK_SIZE as usize),
    );
    let mut b = second_mount(&a);
    let bfh = b.open(ino);
    same(&b.read(ino, bfh, 0, model.len() as u32), &model);
    let theirs = pattern(13, 30);
    b.write(ino, bfh, 11 * BLOCK_SIZE + 30, &theirs);
    model[11 * BLOCK_SIZE as usize + 30..11 * BLOCK_SIZE as usize + 60].copy_from_slice(&theirs);
    b.fsync(ino, bfh);
    b.release(ino, bfh);
    put(&mut a, &mut model, 11 * BLOCK_SIZE + 100, &pattern(14, 10));
    same(&a.read(ino, fh, 0, model.len() as u32), &model);
    assert_eq!(counter(&a, "held_blocks_lost"), 0);

    // Held when the session ends: never written, fsync says EIO, the data is the old.
    a.fsync(ino, fh);
    let on_device = model.clone();
    put(&mut a, &mut model, 11 * BLOCK_SIZE, &pattern(15, 64));
    drop(super::lock(&a.fs.inner().session).take());
    let e = a.err(
        ino,
        Operation::Fsync {
            fh,
            datasync: false,
        },
    );
    assert_eq!(e, Errno::EIO);
    assert_eq!(counter(&a, "held_blocks_lost"), 1);
    let mut c = second_mount(&a);
    let cfh = c.open(ino);
    same(&c.read(ino, cfh, 0, on_device.len() as u32), &on_device);
}

/// A journal's small appends are held as small overwrites are (each waited for the device
/// before), their blocks allocated as pending writes: nothing reaches the device or etcd
/// until the fsync, which writes the blocks before the extents that point at them, and
/// another node then reads them. Held appends that never reach the device (the session
/// ends) take their pending extents with them: etcd never points at blocks the file did
/// not write, whatever the device had there.
#[test]
fn a_journals_small_appends_are_held_until_the_fsync() {
    let mut a = Fx::new();
    let (ino, fh) = a.create(ROOT, b"journal");
    let mut model: Vec<u8> = Vec::new();
    let append = |fx: &mut Fx, model: &mut Vec<u8>, len: usize, seed: u8| {
        let data = pattern(seed, len);
        fx.write(ino, fh, model.len() as u64, &data);
        model.extend_from_slice(&data);
    };
    let lens = [512, 4, 4096, 4, 4, 4096, 4];
    let (h0, w0) = (
        counter(&a, "writes_held"),
        counter(&a, "device_writes_waiter"),
    );
    for (i, len) in lens.into_iter().enumerate() {
        append(&mut a, &mut model, len, i as u8);
    }
    assert_eq!(counter(&a, "writes_held") - h0, lens.len() as u64);
    assert_eq!(
        counter(&a, "device_writes_waiter"),
        w0,
        "an append reached the device"
    );
    assert!(fx_extents(&a, ino).is_empty(), "an extent reached etcd");
    a.fsync(ino, fh);
    assert!(counter(&a, "held_blocks_written") > 0);
    let committed = fx_extents(&a, ino);
    assert!(!committed.is_empty());
    same(&a.read(ino, fh, 0, model.len() as u32 + 10), &model);
    let mut b = second_mount(&a);
    let bfh = b.open(ino);
    same(&b.read(ino, bfh, 0, model.len() as u32 + 10), &model);
    b.release(ino, bfh);

    // Appends into new blocks that never reach the device, here for a failed write: their
    // extents never reach etcd, at this fsync or any commit after it.
    let synced = model.len() as u64;
    append(&mut a, &mut model, 4096, 30);
    append(&mut a, &mut model, 4, 31);
    a.dev.set_faults(MemFaults {
        fail_writes: 1,
        ..MemFaults::default()
    });
    let e = a.err(
        ino,
        Operation::Fsync {
            fh,
            datasync: false,
        },
    );
    assert_eq!(e, Errno::EIO);
    a.fsync(ino, fh);
    assert_eq!(
        fx_extents(&a, ino),
        committed,
        "extents of lost blocks reached etcd"
    );
    assert_eq!(a.fs.inner().get_attr(ino).unwrap().size, synced);
    model.truncate(synced as usize);
    same(&a.read(ino, fh, 0, model.len() as u32 + 10), &model);

    // And when the session ends first.
    append(&mut a, &mut model, 4096, 20);
    append(&mut a, &mut model, 4, 21);
    drop(super::lock(&a.fs.inner().session).take());
    let e = a.err(
        ino,
        Operation::Fsync {
            fh,
            datasync: false,
        },
    );
    assert_eq!(e, Errno::EIO);
    assert!(counter(&a, "held_blocks_lost") > 0);
    assert_eq!(
        fx_extents(&a, ino),
        committed,
        "extents of lost blocks reached etcd"
    );
    let c = second_mount(&a);
    assert_eq!(c.fs.inner().get_attr(ino).unwrap().size, synced);
}

/// A write past EOF whose old EOF block is held writes it out first (that block's tail is
/// zeroed on the device). When the write-out fails, the blocks allocated for the write go
/// back to the allocator, as the pending ones do: nothing leaks.
#[test]
fn a_failed_write_out_before_a_write_past_eof_leaks_no_blocks() {
    let mut a = Fx::new();
    let (ino, fh) = a.create(ROOT, b"sparse");
    let free0 = a.statfs().bfree;
    a.write(ino, fh, 0, &pattern(1, 100));
    a.dev.set_faults(MemFaults {
        fail_writes: 1,
        ..MemFaults::default()
    });
    let e = a.err(
        ino,
        Operation::Write {
            fh,
            offset: 3 * BLOCK_SIZE + 100,
            data: &pattern(2, 10),
            write_flags: 0,
            flags: 0,
        },
    );
    assert_eq!(e, Errno::EIO);
    assert_eq!(a.statfs().bfree, free0, "blocks leaked");
    a.release(ino, fh);
}

/// A file's commits plan from what the last one (or the open) left: a created file's
/// first fsync and each append's fdatasync read nothing from etcd. A truncate or another
/// node's turn makes the record stale: the next commit reads, never fails a compare on it,
/// and every byte ends where it was written.
#[test]
fn commits_plan_from_the_last_ones_record() {
    let mut a = Fx::new();
    let reads = |fx: &Fx| counter(fx, "etcd_read_txns");
    let conflicts = |fx: &Fx| counter(fx, "etcd_compare_failures");
    // The create's coalesced timestamp of the directory reads the directory when it is
    // written: out of the way first (CI's run counted that read among the appends').
    let settle = |fx: &Fx| fx.fs.inner().meta.flush(None).unwrap().wait().unwrap();
    // Background work may still read etcd now and then (a test run in four under load
    // counted one read among the appends'): of three created files, one's first write and
    // fdatasync must read nothing, and the appends after it at most a stray read or two
    // (each would read once without the record).
    let mut clean = None;
    for k in 0..3 {
        let (ino, fh) = a.create(ROOT, format!("log{k}").as_bytes());
        settle(&a);
        let r0 = reads(&a);
        let model = pattern(1, 6000);
        a.write(ino, fh, 0, &model);
        a.fdatasync(ino, fh);
        if reads(&a) == r0 {
            clean = Some((ino, fh, model));
            break;
        }
        a.release(ino, fh);
    }
    let (ino, fh, mut model) =
        clean.expect("a created file's write and fdatasync read nothing (three files tried)");
    let r0 = reads(&a);
    for i in 0..6u8 {
        let line = pattern(10 + i, 100 + usize::from(i) * 700);
        a.write(ino, fh, model.len() as u64, &line);
        a.fdatasync(ino, fh);
        model.extend_from_slice(&line);
    }
    let read = reads(&a) - r0;
    assert!(
        read <= 2,
        "6 appends planned from the record read etcd {read} times"
    );
    // A truncate is another kind of commit: it leaves no record, the next append reads.
    model.truncate(5000);
    a.truncate(ino, 5000);
    let r1 = reads(&a);
    let line = pattern(30, 3000);
    a.write(ino, fh, 5000, &line);
    a.fdatasync(ino, fh);
    model.extend_from_slice(&line);
    assert!(reads(&a) > r1, "after a truncate the commit reads");
    same(&a.read(ino, fh, 0, model.len() as u32 + 10), &model);
    // Another node appends in between: this node's record is stale.
    let mut b = a.another_mount(&CacheOpts::uniform(Duration::from_secs(1)));
    let fb = b.open(ino);
    let theirs = pattern(40, 2500);
    b.write(ino, fb, model.len() as u64, &theirs);
    b.fdatasync(ino, fb);
    model.extend_from_slice(&theirs);
    let mine = pattern(50, 1500);
    a.write(ino, fh, model.len() as u64, &mine);
    a.fdatasync(ino, fh);
    model.extend_from_slice(&mine);
    assert_eq!(conflicts(&a), 0, "no commit planned from a stale record");
    same(&a.read(ino, fh, 0, model.len() as u32 + 10), &model);
    same(&b.read(ino, fb, 0, model.len() as u32 + 10), &model);
    b.release(ino, fb);
    a.release(ino, fh);
}

/// fsync of a file writes what it must (the file's data, extents, size, times) and not
/// the directory timestamps its create left to the coalescer: a create + write + fsync loop
/// wrote its directory at every fsync (two etcd round trips more per file). The directory's
/// own fsync still writes them.
#[test]
fn fsync_of_a_file_leaves_the_directory_timestamps_to_the_coalescer() {
    let mut a = Fx::new();
    let written = |fx: &Fx| counter(fx, "dir_times_written");
    let w0 = written(&a);
    for i in 0..5u8 {
        let (ino, fh) = a.create(ROOT, format!("f{i}").as_bytes());
        a.write(ino, fh, 0, &pattern(i, 5000));
        a.fsync(ino, fh);
        a.release(ino, fh);
    }
    // The coalescer may have written once on its own interval meanwhile, not per fsync.
    assert!(
        written(&a) - w0 <= 1,
        "{} directory writes",
        written(&a) - w0
    );
    a.ok(
        ROOT,
        Operation::Fsyncdir {
            fh: 0,
            datasync: false,
        },
    );
    assert!(
        written(&a) > w0,
        "the directory's fsync writes its timestamps"
    );
}

/// fdatasync of a directory makes its entries durable and leaves its timestamps to the
/// coalescer (a data sync owes what reading the data back needs): SQLite fdatasyncs its
/// directory after creating each rollback journal, and each paid an etcd round trip for
/// the directory's mtime. fsync of the directory still writes them.
#[test]
fn fdatasync_of_a_directory_leaves_its_timestamps_to_the_coalescer() {
    let mut a = Fx::new();
    let written = |fx: &Fx| counter(fx, "dir_times_written");
    let d = a.mkdir(ROOT, b"d");
    a.fs.inner().meta.flush(None).unwrap().wait().unwrap();
    let sync = |datasync| Operation::Fsyncdir { fh: 0, datasync };
    let w0 = written(&a);
    for i in 0..5u8 {
        let name = format!("f{i}");
        let (ino, fh) = a.create(d, name.as_bytes());
        a.ok(d, sync(true));
        let key = meta::keys::Keyspace::new("t")
            .unwrap()
            .dentry(meta::types::Ino(d), name.as_bytes());
        let end = [key.as_slice(), &[0]].concat();
        assert_eq!(a.kv.dump(&key, &end).len(), 1, "{name} not in etcd");
        a.release(ino, fh);
    }
    // The coalescer may have written once on its own interval meanwhile, not per sync.
    let w1 = written(&a);
    assert!(w1 - w0 <= 1, "{} directory writes", w1 - w0);
    let (ino, fh) = a.create(d, b"last");
    a.release(ino, fh);
    a.ok(d, sync(false));
    assert!(
        written(&a) > w1,
        "the directory's fsync writes its timestamps"
    );
    let shown = a.getattr(d).attr;
    let stored = a.fs.inner().get_attr(d).unwrap();
    assert_eq!(
        (shown.mtime, shown.mtimensec),
        (stored.mtime.sec as u64, stored.mtime.nsec)
    );
}

/// ctime as an attribute reply shows it.
fn ctime_of(a: &AttrOut) -> (u64, u32) {
    (a.attr.ctime, a.attr.ctimensec)
}

/// ctime as etcd holds it.
fn stored_ctime(fx: &Fx, ino: u64) -> (u64, u32) {
    let c = fx.fs.inner().get_attr(ino).unwrap().ctime;
    (c.sec as u64, c.nsec)
}

/// A file created and open, its create committed, and a tick of the coarse clock (which
/// a held ctime is taken from) gone since.
fn created_a_tick_ago(fx: &mut Fx, name: &[u8]) -> (u64, u64) {
    let (ino, fh) = fx.create(ROOT, name);
    fx.fs.inner().meta.flush(None).unwrap().wait().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    (ino, fh)
}

/// chown of `ino` to `uid` and the tests' group; the attributes it answered.
fn chown(fx: &mut Fx, ino: u64, uid: u32) -> AttrOut {
    let op = Operation::Setattr(SetattrIn {
        valid: FATTR_UID | FATTR_GID,
        uid,
        gid: 100,
        ..SetattrIn::default()
    });
    parse(&fx.ok(ino, op))
}

/// A chown of a file open here to the owner it has commits nothing on its own (SQLite
/// gives each rollback journal it creates as root its database's owner, an etcd round
/// trip per transaction): the new ctime shows at once and the file's next commit, here an
/// append's fdatasync, writes it. A chown that changes the owner, or one of a file with a
/// set-id bit, commits at once.
#[test]
fn a_chown_to_the_same_owner_is_written_with_the_files_next_commit() {
    let mut a = Fx::new();
    caches_live(&a);
    let txns = |fx: &Fx| counter(fx, "etcd_txns_committed");
    let (ino, fh) = created_a_tick_ago(&mut a, b"journal");
    let before = a.getattr(ino);
    let t0 = txns(&a);
    let shown = chown(&mut a, ino, 1000);
    assert_eq!(txns(&a), t0, "the chown committed on its own");
    assert!(ctime_of(&shown) > ctime_of(&before), "ctime did not move");
    assert_eq!(ctime_of(&a.getattr(ino)), ctime_of(&shown));
    assert!(stored_ctime(&a, ino) < ctime_of(&shown));
    a.write(ino, fh, 0, &pattern(3, 5000));
    a.fdatasync(ino, fh);
    assert!(
        stored_ctime(&a, ino) >= ctime_of(&shown),
        "the commit left it out"
    );
    assert!(
        !a.fs.inner().files.has_dirty_state(ino),
        "the close would write it again"
    );
    // Another owner, or a set-id bit to clear: committed at once.
    let t1 = txns(&a);
    chown(&mut a, ino, 1001);
    assert!(txns(&a) > t1, "a change of owner was held");
    let (ino2, fh2) = a.create(ROOT, b"setgid");
    a.ok(
        ino2,
        Operation::Setattr(SetattrIn {
            valid: FATTR_MODE,
            mode: 0o2755,
            ..SetattrIn::default()
        }),
    );
    let t2 = txns(&a);
    chown(&mut a, ino2, 1000);
    assert!(txns(&a) > t2, "a chown that may clear set-id bits was held");
    a.release(ino2, fh2);
    a.release(ino, fh);
}

/// A held ctime is written before another node sees the file: at the hand-over of its
/// lock, as an overwrite's mtime is.
#[test]
fn another_node_sees_a_held_ctime() {
    let mut a = Fx::new();
    caches_live(&a);
    let (ino, fh) = created_a_tick_ago(&mut a, b"f");
    let mut b = second_mount(&a);
    caches_live(&b);
    let _ = b.getattr(ino);
    let shown = chown(&mut a, ino, 1000);
    let fb = b.open(ino);
    // Written as the commit's time, as a held mtime's ctime is.
    assert!(
        ctime_of(&b.getattr(ino)) >= ctime_of(&shown),
        "the hand-over left it out"
    );
    b.release(ino, fb);
    a.release(ino, fh);
}

/// A held ctime with nothing else to commit is written at the close.
#[test]
fn a_held_ctime_is_written_at_the_close() {
    let mut a = Fx::new();
    caches_live(&a);
    let (ino, fh) = created_a_tick_ago(&mut a, b"f");
    let shown = chown(&mut a, ino, 1000);
    a.ok(ino, Operation::Flush { fh, lock_owner: 0 });
    a.release(ino, fh);
    assert!(
        stored_ctime(&a, ino) >= ctime_of(&shown),
        "the close left it out"
    );
}

/// A chmod or utimes of a file whose attributes this node has cached commits in one round
/// trip: planned from the cache, compared by value, nothing read first.
#[test]
fn setattr_of_a_cached_inode_reads_nothing() {
    let mut a = Fx::new();
    caches_live(&a);
    let reads = |fx: &Fx| counter(fx, "etcd_read_txns");
    let (ino, fh) = a.create(ROOT, b"f");
    a.release(ino, fh);
    a.fs.inner().meta.flush(None).unwrap().wait().unwrap();
    let _ = a.getattr(ino);
    let r0 = reads(&a);
    for (i, mode) in [0o600u32, 0o640, 0o604].into_iter().enumerate() {
        a.ok(
            ino,
            Operation::Setattr(SetattrIn {
                valid: FATTR_MODE | FATTR_MTIME,
                mode,
                mtime: 1_000 + i as u64,
                ..SetattrIn::default()
            }),
        );
    }
    // Background work may read etcd now and then; each setattr read once before.
    let read = reads(&a) - r0;
    assert!(read <= 1, "3 setattrs read etcd {read} times");
    let attr = a.getattr(ino).attr;
    assert_eq!((attr.mode & 0o777, attr.mtime), (0o604, 1_002));
}

/// A file closed here keeps its open record a moment, for a reopen. Its unlink deletes the
/// record in the unlink's own commit: no more commits than for a file whose record went at
/// its close (a create, write, close, rm cycle paid one more), and the file is deleted at
/// once, not left an orphan (its space came back a second later: rm then write got ENOSPC).
#[test]
fn an_unlink_after_close_takes_the_kept_open_record_with_it() {
    let mut fx = Fx::new();
    let inner = fx.fs.inner().clone();
    let free0 = fx.statfs().bfree;
    let mut commits = Vec::new();
    for (name, keep) in [
        (&b"closed"[..], Duration::ZERO),
        (b"kept", Duration::from_secs(60)),
    ] {
        inner.held.set_idle_hold(keep);
        let (ino, fh) = fx.create(ROOT, name);
        fx.write(ino, fh, 0, &pattern(4, 30_000));
        fx.fsync(ino, fh);
        fx.release(ino, fh);
        let records = fx.kv.dump(b"t/H", b"t/I").len();
        assert_eq!(records, usize::from(!keep.is_zero()), "{name:?}");
        inner.meta.flush(None).unwrap().wait().unwrap();
        let r0 = fx.kv.revision();
        fx.ok(ROOT, Operation::Unlink { name });
        // Its free-map write too (the directory's times stay coalesced).
        let f = meta::types::Ino(ino);
        inner.meta.flush(Some(f)).unwrap().wait().unwrap();
        commits.push(fx.kv.revision() - r0);
        assert!(fx.kv.dump(b"t/H", b"t/I").is_empty(), "{name:?}");
        assert!(
            fx.kv.dump(b"t/O", b"t/P").is_empty(),
            "{name:?} left an orphan"
        );
        assert_eq!(fx.statfs().bfree, free0, "{name:?}: space back at once");
    }
    assert_eq!(commits[0], commits[1], "commits per unlink (closed, kept)");
}

/// A file closed here keeps, with its open record, the extent keys its last commit left;
/// its unlink releases those without reading them or the open records (a rollback
/// journal's create, appends, fdatasync, close, unlink: the unlink read both).
#[test]
fn an_unlink_after_close_releases_the_map_the_last_commit_left() {
    unlinks_after_close_read_nothing(Duration::from_secs(60), |a, ino, fh| {
        a.write(ino, fh, 0, &pattern(4, 30_000));
        a.fsync(ino, fh);
        a.write(ino, fh, 30_000, &pattern(5, 9_000));
        a.fsync(ino, fh);
    });
}

/// A file closed here longer ago (its open record gone) keeps the keys of its last commit
/// with its closed map while this node holds its lock: `rm -rf` of files written here
/// releases them without reading (each unlink read the extents and open records).
#[test]
fn an_unlink_of_a_file_closed_long_ago_releases_the_keys_kept_with_its_map() {
    unlinks_after_close_read_nothing(Duration::ZERO, |a, ino, fh| {
        a.write(ino, fh, 0, &pattern(8, 20_000));
        // Committed and seen by the watch before the close: the map is kept only if no
        // extent change of the file reaches the watch after it (under load, the event of
        // a commit made at the close itself can come later and drop it; CI found that).
        a.fsync(ino, fh);
        a.fs.inner().meta.flush(None).unwrap().wait().unwrap();
        caught_up(a);
    });
}

/// Creates files, writes each with `write`, closes them with the open record kept for
/// `idle_hold`, and unlinks them: one of three unlinks (background work may read etcd
/// now and then) must read nothing, none may fail a compare, and each must leave no
/// extent and give its space back at once.
fn unlinks_after_close_read_nothing(idle_hold: Duration, write: impl Fn(&mut Fx, u64, u64)) {
    let mut a = Fx::new();
    caches_live(&a);
    let inner = a.fs.inner().clone();
    inner.held.set_idle_hold(idle_hold);
    let free0 = a.statfs().bfree;
    let reads = |fx: &Fx| counter(fx, "etcd_read_txns");
    let mut clean = false;
    for k in 0..3 {
        let name = format!("f{k}");
        let (ino, fh) = a.create(ROOT, name.as_bytes());
        write(&mut a, ino, fh);
        a.release(ino, fh);
        let records = a.kv.dump(b"t/H", b"t/I").len();
        assert_eq!(
            records,
            usize::from(!idle_hold.is_zero()),
            "{name}: open records"
        );
        inner.meta.flush(None).unwrap().wait().unwrap();
        let r0 = reads(&a);
        let failed = counter(&a, "etcd_compare_failures");
        a.ok(
            ROOT,
            Operation::Unlink {
                name: name.as_bytes(),
            },
        );
        clean |= reads(&a) == r0;
        assert_eq!(counter(&a, "etcd_compare_failures"), failed, "{name}");
        inner
            .meta
            .flush(Some(meta::types::Ino(ino)))
            .unwrap()
            .wait()
            .unwrap();
        assert!(fx_extents(&a, ino).is_empty(), "{name}: extents left");
        assert_eq!(a.statfs().bfree, free0, "{name}: space back at once");
    }
    assert!(clean, "each unlink read etcd");
}

/// The extent keys of `ino` in etcd.
fn fx_extents(fx: &Fx, ino: u64) -> Vec<(Vec<u8>, Vec<u8>)> {
    let r = meta::keys::Keyspace::new("t")
        .unwrap()
        .extents(meta::types::Ino(ino));
    fx.kv.dump(&r.start, &r.end)
}

/// An unlink planned from the map this node's last commit left, when another node has
/// appended to the file since: the compares fail, and the re-plan releases what etcd
/// holds, the other node's extent too (planned from the stale map, it would leak).
#[test]
fn an_unlink_from_a_stale_map_releases_what_etcd_holds() {
    let mut a = Fx::new();
    caches_live(&a);
    let inner = a.fs.inner().clone();
    inner.held.set_idle_hold(Duration::from_secs(60));
    let (ino, fh) = a.create(ROOT, b"shared");
    a.write(ino, fh, 0, &pattern(6, 8192));
    a.fsync(ino, fh);
    a.release(ino, fh);
    let mut b = second_mount(&a);
    let bfh = b.open(ino);
    b.write(ino, bfh, 1 << 20, &pattern(7, 4096));
    b.fsync(ino, bfh);
    b.release(ino, bfh);
    assert_eq!(fx_extents(&a, ino).len(), 2, "both nodes' extents");
    // The append seen here, so that the unlink expects the current attributes: only
    // the kept map is stale.
    eventually("the append seen", || {
        a.getattr(ino).attr.size == (1 << 20) + 4096
    });
    let failed = counter(&a, "etcd_compare_failures");
    a.ok(ROOT, Operation::Unlink { name: b"shared" });
    assert!(
        counter(&a, "etcd_compare_failures") > failed,
        "planned from the kept map"
    );
    inner.meta.flush(None).unwrap().wait().unwrap();
    assert!(fx_extents(&a, ino).is_empty(), "extents left behind");
}

/// An fsync of a directory writes its coalesced timestamps planned from the cached inode:
/// nothing is read (a journaling database fsyncs its directory after each journal create).
#[test]
fn fsync_of_a_directory_reads_nothing() {
    let mut a = Fx::new();
    caches_live(&a);
    let reads = |fx: &Fx| counter(fx, "etcd_read_txns");
    let d = a.mkdir(ROOT, b"d");
    a.fs.inner().meta.flush(None).unwrap().wait().unwrap();
    let fsyncdir = Operation::Fsyncdir {
        fh: 0,
        datasync: false,
    };
    // Background work may read etcd now and then: of three rounds, one must read nothing.
    let mut clean = false;
    for k in 0..3 {
        let (ino, fh) = a.create(d, format!("f{k}").as_bytes());
        a.release(ino, fh);
        let _ = a.getattr(d);
        let r0 = reads(&a);
        a.ok(d, fsyncdir);
        if reads(&a) == r0 {
            clean = true;
            break;
        }
    }
    assert!(clean, "each directory fsync read etcd");
    let shown = a.getattr(d).attr;
    let stored = a.fs.inner().get_attr(d).unwrap();
    assert_eq!(
        (shown.mtime, shown.mtimensec),
        (stored.mtime.sec as u64, stored.mtime.nsec)
    );
}

/// A setattr planned from a stale cache (another node's chmod not seen here yet) never
/// writes the old values back: its compare fails and the re-plan changes what etcd holds.
#[test]
fn setattr_from_a_stale_cache_keeps_another_nodes_change() {
    let mut a = Fx::new();
    caches_live(&a);
    let (f, fh) = a.create(ROOT, b"f");
    a.release(f, fh);
    let mut b = second_mount(&a);
    let inner = a.fs.inner().clone();
    let _ = a.getattr(f);
    let before = inner.caches.attr(f).expect("cached by a getattr");
    b.ok(
        f,
        Operation::Setattr(SetattrIn {
            valid: FATTR_MODE,
            mode: 0o600,
            ..SetattrIn::default()
        }),
    );
    eventually("the chmod seen", || a.getattr(f).attr.mode & 0o777 == 0o600);
    // As if the watch were behind: the attributes from before the chmod, kept over it.
    inner.caches.own_attr(&before, i64::MAX / 2);
    let failed = counter(&a, "etcd_compare_failures");
    a.ok(
        f,
        Operation::Setattr(SetattrIn {
            valid: FATTR_MTIME,
            mtime: 4242,
            ..SetattrIn::default()
        }),
    );
    assert!(
        counter(&a, "etcd_compare_failures") > failed,
        "planned from the cache"
    );
    let stored = inner.get_attr(f).unwrap();
    assert_eq!((stored.perm, stored.mtime.sec), (0o600, 4242));
}

/// A chmod between a file's create and its first fdatasync keeps the record the create
/// left (the chmod changes only what the record's attributes say): the fdatasync still
/// reads nothing. SQLite chowns each new rollback journal as root, and that made every
/// journal's first fdatasync read the inode and its extents.
#[test]
fn a_setattr_keeps_the_record_of_the_last_commit() {
    let mut a = Fx::new();
    caches_live(&a);
    let reads = |fx: &Fx| counter(fx, "etcd_read_txns");
    let settle = |fx: &Fx| fx.fs.inner().meta.flush(None).unwrap().wait().unwrap();
    // Background work may read etcd now and then: of three files, one must read nothing.
    let mut clean = false;
    for k in 0..3 {
        let (ino, fh) = a.create(ROOT, format!("j{k}").as_bytes());
        settle(&a);
        let _ = a.getattr(ino);
        let r0 = reads(&a);
        a.ok(
            ino,
            Operation::Setattr(SetattrIn {
                valid: FATTR_MODE,
                mode: 0o600,
                ..SetattrIn::default()
            }),
        );
        a.write(ino, fh, 0, &pattern(2, 9000));
        a.fdatasync(ino, fh);
        clean = reads(&a) == r0;
        assert_eq!(a.read(ino, fh, 0, 9000), pattern(2, 9000));
        a.release(ino, fh);
        if clean {
            break;
        }
    }
    assert!(
        clean,
        "a chmod'ed file's first fdatasync read etcd (three files tried)"
    );
}
