//! Drives `MemFs::handle` with requests encoded to bytes and decoded back, as a transport
//! would, and checks the replies.

use std::{fs::File, os::unix::fs::FileExt, sync::Arc, thread};

use fusedev::{
    abi::{
        Attr, AttrOut, Dirent, Direntplus, EntryOut, FromBytes, GetxattrOut, Kstatfs, OpenOut,
        SetattrIn, WriteOut, FATTR_ATIME, FATTR_MODE, FATTR_MTIME, FATTR_MTIME_NOW, FATTR_SIZE,
        FUSE_ROOT_ID, FUSE_WRITE_KILL_SUIDGID, RENAME_EXCHANGE, RENAME_NOREPLACE, XATTR_CREATE,
        XATTR_REPLACE,
    },
    errno::Errno,
    request::{self, Forgets, Operation, Request},
    server::{Handler, Reply, RequestCtx},
};

use super::{MemFs, MemFsConfig};

const ROOT: u64 = FUSE_ROOT_ID;

struct Fx {
    fs: MemFs,
    out: Vec<u8>,
    unique: u64,
}

fn parse<T: FromBytes>(bytes: &[u8]) -> T {
    T::read_from_prefix(bytes).expect("reply too short").0
}

impl Fx {
    fn new() -> Fx {
        let cfg = MemFsConfig {
            uid: 1000,
            gid: 100,
            ..MemFsConfig::default()
        };
        Fx {
            fs: MemFs::new(cfg),
            out: vec![0; 128 << 10],
            unique: 1,
        }
    }

    /// Encodes, decodes (as a transport would) and serves one request.
    fn call(&mut self, nodeid: u64, op: Operation<'_>) -> Reply {
        let mut req = Request::new(self.unique, nodeid, op);
        req.header.uid = 1000;
        req.header.gid = 100;
        self.unique += 1;
        let mut bytes = Vec::new();
        req.encode(&mut bytes);
        let decoded = request::decode(&bytes).expect("test request decodes");
        self.fs.handle(&RequestCtx::new(0), &decoded, &mut self.out)
    }

    fn ok(&mut self, nodeid: u64, op: Operation<'_>) -> Vec<u8> {
        match self.call(nodeid, op) {
            Reply::Bytes(n) => self.out[..n].to_vec(),
            other => panic!("{op:?}: expected bytes, got {other:?}"),
        }
    }

    fn err(&mut self, nodeid: u64, op: Operation<'_>) -> Errno {
        match self.call(nodeid, op) {
            Reply::Error(e) => e,
            other => panic!("{op:?}: expected an error, got {other:?}"),
        }
    }

    fn entry(&mut self, nodeid: u64, op: Operation<'_>) -> EntryOut {
        let bytes = self.ok(nodeid, op);
        assert_eq!(bytes.len(), size_of::<EntryOut>());
        parse(&bytes)
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
                umask: 0,
            },
        )
        .nodeid
    }

    fn create(&mut self, parent: u64, name: &[u8]) -> u64 {
        let op = Operation::Create {
            name,
            flags: 2,
            mode: 0o100644,
            umask: 0,
            open_flags: 0,
        };
        let bytes = self.ok(parent, op);
        assert_eq!(bytes.len(), size_of::<EntryOut>() + size_of::<OpenOut>());
        parse::<EntryOut>(&bytes).nodeid
    }

    fn getattr(&mut self, ino: u64) -> Attr {
        parse::<AttrOut>(&self.ok(ino, Operation::Getattr { fh: None })).attr
    }

    fn write(&mut self, ino: u64, offset: u64, data: &[u8]) {
        let op = Operation::Write {
            fh: 0,
            offset,
            data,
            write_flags: 0,
            flags: 0,
        };
        let written: WriteOut = parse(&self.ok(ino, op));
        assert_eq!(written.size as usize, data.len());
    }

    /// READ, following an fd reply the way a copying transport does.
    fn read(&mut self, ino: u64, offset: u64, size: u32) -> Vec<u8> {
        match self.call(
            ino,
            Operation::Read {
                fh: 0,
                offset,
                size,
                flags: 0,
            },
        ) {
            Reply::Bytes(n) => self.out[..n].to_vec(),
            Reply::Fd { fd, offset, len } => {
                assert!(len <= size as usize);
                let file = File::open(format!("/proc/self/fd/{fd}")).expect("reopen memfd");
                let mut buf = vec![0; len];
                let n = file.read_at(&mut buf, offset).expect("read memfd");
                buf.truncate(n);
                buf
            }
            other => panic!("read: {other:?}"),
        }
    }

    fn readdir(&mut self, ino: u64, offset: u64, size: u32) -> Vec<(u64, u64, Vec<u8>)> {
        let bytes = self.ok(
            ino,
            Operation::Readdir {
                fh: 0,
                offset,
                size,
            },
        );
        assert!(bytes.len() <= size as usize);
        let mut rest = &bytes[..];
        let mut entries = Vec::new();
        while !rest.is_empty() {
            let d: Dirent = parse(rest);
            let name = rest[24..24 + d.namelen as usize].to_vec();
            let record = (24 + d.namelen as usize).next_multiple_of(8);
            entries.push((d.ino, d.off, name));
            rest = &rest[record..];
        }
        entries
    }

    fn readdirplus(
        &mut self,
        ino: u64,
        offset: u64,
        size: u32,
    ) -> Vec<(EntryOut, Dirent, Vec<u8>)> {
        let bytes = self.ok(
            ino,
            Operation::Readdirplus {
                fh: 0,
                offset,
                size,
            },
        );
        assert!(bytes.len() <= size as usize);
        let mut rest = &bytes[..];
        let mut entries = Vec::new();
        while !rest.is_empty() {
            let d: Direntplus = parse(rest);
            let name = rest[152..152 + d.dirent.namelen as usize].to_vec();
            let record = (152 + d.dirent.namelen as usize).next_multiple_of(8);
            entries.push((d.entry_out, d.dirent, name));
            rest = &rest[record..];
        }
        entries
    }

    fn names(&mut self, dir: u64) -> Vec<Vec<u8>> {
        self.readdir(dir, 0, 1 << 16)
            .into_iter()
            .map(|(_, _, n)| n)
            .collect()
    }
}

#[test]
fn root_directory() {
    let mut fx = Fx::new();
    let a = fx.getattr(ROOT);
    assert_eq!(a.ino, ROOT);
    assert_eq!(a.mode, libc::S_IFDIR | 0o755);
    assert_eq!((a.uid, a.gid, a.nlink, a.blksize), (1000, 100, 2, 4096));
    assert_eq!(fx.names(ROOT), [b".".to_vec(), b"..".to_vec()]);
    let st: Kstatfs = parse(&fx.ok(ROOT, Operation::Statfs));
    assert_eq!((st.bsize, st.namelen), (4096, 255));
}

#[test]
fn create_write_read_through_fd() {
    let mut fx = Fx::new();
    let ino = fx.create(ROOT, b"f");
    assert_eq!(fx.read(ino, 0, 4096), b"", "empty file");
    fx.write(ino, 0, b"hello world");
    fx.write(ino, 6, b"there");
    assert_eq!(fx.read(ino, 0, 4096), b"hello there");
    assert_eq!(fx.read(ino, 6, 3), b"the", "clamped to the requested size");
    assert_eq!(fx.read(ino, 100, 10), b"", "past EOF");
    fx.write(ino, 20, b"x");
    assert_eq!(fx.read(ino, 0, 4096), b"hello there\0\0\0\0\0\0\0\0\0x");
    let a = fx.getattr(ino);
    assert_eq!(
        (a.size, a.blocks, a.mode, a.uid),
        (21, 1, libc::S_IFREG | 0o644, 1000)
    );
    assert!(matches!(
        fx.call(
            ino,
            Operation::Read {
                fh: 0,
                offset: 0,
                size: 4,
                flags: 0
            }
        ),
        Reply::Fd { .. }
    ));
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Read {
                fh: 0,
                offset: 0,
                size: 1,
                flags: 0
            }
        ),
        Errno::EISDIR
    );
}

#[test]
fn lookup_errors() {
    let mut fx = Fx::new();
    assert_eq!(
        fx.err(ROOT, Operation::Lookup { name: b"missing" }),
        Errno::ENOENT
    );
    assert_eq!(
        fx.err(ROOT, Operation::Lookup { name: &[b'a'; 256] }),
        Errno::ENAMETOOLONG
    );
    let long = [b'b'; 255];
    fx.create(ROOT, &long);
    assert_eq!(fx.lookup(ROOT, &long).attr.size, 0);
    let f = fx.create(ROOT, b"file");
    assert_eq!(fx.err(f, Operation::Lookup { name: b"x" }), Errno::ENOTDIR);
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Mkdir {
                name: &[b'c'; 256],
                mode: 0o755,
                umask: 0
            }
        ),
        Errno::ENAMETOOLONG
    );
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Mkdir {
                name: b"file",
                mode: 0o755,
                umask: 0
            }
        ),
        Errno::EEXIST
    );
}

#[test]
fn directories_and_link_counts() {
    let mut fx = Fx::new();
    let d = fx.mkdir(ROOT, b"d");
    assert_eq!(fx.getattr(ROOT).nlink, 3);
    assert_eq!(fx.getattr(d).mode, libc::S_IFDIR | 0o755);
    let sub = fx.mkdir(d, b"sub");
    let f = fx.create(d, b"f");
    assert_eq!(fx.getattr(d).nlink, 3);
    assert_eq!(
        fx.err(ROOT, Operation::Rmdir { name: b"d" }),
        Errno::ENOTEMPTY
    );
    assert_eq!(fx.err(d, Operation::Rmdir { name: b"f" }), Errno::ENOTDIR);
    assert_eq!(fx.err(d, Operation::Unlink { name: b"sub" }), Errno::EISDIR);
    fx.ok(d, Operation::Rmdir { name: b"sub" });
    fx.ok(d, Operation::Unlink { name: b"f" });
    assert_eq!(fx.getattr(d).nlink, 2);
    // Still referenced by the kernel: attributes remain readable with nlink 0.
    assert_eq!(fx.getattr(f).nlink, 0);
    assert_eq!(fx.getattr(sub).nlink, 0);
    fx.ok(ROOT, Operation::Rmdir { name: b"d" });
    assert_eq!(fx.getattr(ROOT).nlink, 2);
    // A removed directory cannot get new entries.
    assert_eq!(
        fx.err(
            d,
            Operation::Mkdir {
                name: b"x",
                mode: 0o755,
                umask: 0
            }
        ),
        Errno::ENOENT
    );
}

#[test]
fn forget_drops_unlinked_inodes_only() {
    let mut fx = Fx::new();
    let f = fx.create(ROOT, b"f"); // one reference
    fx.lookup(ROOT, b"f"); // two
    assert!(matches!(
        fx.call(f, Operation::Forget { nlookup: 2 }),
        Reply::None
    ));
    assert_eq!(fx.getattr(f).nlink, 1, "still linked: kept");
    fx.lookup(ROOT, b"f");
    fx.ok(ROOT, Operation::Unlink { name: b"f" });
    fx.getattr(f);
    fx.call(f, Operation::Forget { nlookup: 1 });
    assert_eq!(fx.err(f, Operation::Getattr { fh: None }), Errno::ENOENT);
}

#[test]
fn batch_forget() {
    let mut fx = Fx::new();
    let a = fx.create(ROOT, b"a");
    let b = fx.create(ROOT, b"b");
    fx.ok(ROOT, Operation::Unlink { name: b"a" });
    fx.ok(ROOT, Operation::Unlink { name: b"b" });
    let records = [
        fusedev::abi::ForgetOne {
            nodeid: a,
            nlookup: 1,
        },
        fusedev::abi::ForgetOne {
            nodeid: b,
            nlookup: 1,
        },
    ];
    let forgets = Forgets::from_bytes(fusedev::abi::IntoBytes::as_bytes(&records[..])).unwrap();
    assert!(matches!(
        fx.call(0, Operation::BatchForget { forgets }),
        Reply::None
    ));
    assert_eq!(fx.err(a, Operation::Getattr { fh: None }), Errno::ENOENT);
    assert_eq!(fx.err(b, Operation::Getattr { fh: None }), Errno::ENOENT);
}

#[test]
fn readdir_offsets_are_stable_across_changes() {
    let mut fx = Fx::new();
    for i in 0..10 {
        fx.create(ROOT, format!("f{i}").as_bytes());
    }
    // ".", "..", then 3 entries of 32 bytes each: a 160-byte reply.
    let first = fx.readdir(ROOT, 0, 160);
    assert_eq!(first.len(), 5);
    let last_off = first.last().unwrap().1;
    let seen: Vec<_> = first.iter().map(|e| e.2.clone()).collect();
    assert_eq!(&seen[..2], [b".".to_vec(), b"..".to_vec()]);
    // Remove one entry already returned and one not yet returned; add a new one.
    fx.ok(ROOT, Operation::Unlink { name: &seen[2] });
    fx.ok(ROOT, Operation::Unlink { name: b"f9" });
    fx.create(ROOT, b"new");
    let mut rest = Vec::new();
    let mut off = last_off;
    loop {
        let batch = fx.readdir(ROOT, off, 100);
        let Some(last) = batch.last() else { break };
        off = last.1;
        rest.extend(batch.into_iter().map(|e| e.2));
    }
    let mut all: Vec<_> = seen[2..].to_vec();
    all.extend(rest.iter().cloned());
    let mut dedup = all.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(dedup.len(), all.len(), "no entry twice: {all:?}");
    assert!(!rest.contains(&b"f9".to_vec()), "removed before being read");
    assert!(
        rest.contains(&b"new".to_vec()),
        "added after the first batch"
    );
    assert_eq!(all.len(), 10, "3 seen + 6 unread survivors + new");
}

#[test]
fn readdir_never_exceeds_size() {
    let mut fx = Fx::new();
    for i in 0..50 {
        fx.create(ROOT, format!("name-{i:03}").as_bytes());
    }
    for size in [24, 31, 32, 100, 333, 4096] {
        let entries = fx.readdir(ROOT, 0, size); // asserts the size bound
        assert!(!entries.is_empty() || size < 32);
    }
    assert!(fx.readdir(ROOT, 0, 31).is_empty());
    let plus = fx.readdirplus(ROOT, 0, 500);
    assert_eq!(plus.len(), 3, "160 bytes per record");
}

#[test]
fn readdirplus_takes_references_except_dots() {
    let mut fx = Fx::new();
    let d = fx.mkdir(ROOT, b"d");
    let f = fx.create(d, b"f");
    fx.call(f, Operation::Forget { nlookup: 1 }); // the create's reference
    let entries = fx.readdirplus(d, 0, 4096);
    let names: Vec<_> = entries.iter().map(|e| e.2.clone()).collect();
    assert_eq!(names, [b".".to_vec(), b"..".to_vec(), b"f".to_vec()]);
    assert_eq!((entries[0].0.nodeid, entries[0].1.ino), (0, d));
    assert_eq!((entries[1].0.nodeid, entries[1].1.ino), (0, ROOT));
    assert_eq!(entries[2].0.nodeid, f);
    assert_eq!(entries[2].0.attr.mode, libc::S_IFREG | 0o644);
    assert_eq!(entries[2].1.typ, libc::DT_REG as u32);
    // The listing's reference keeps the unlinked file alive until forgotten.
    fx.ok(d, Operation::Unlink { name: b"f" });
    fx.getattr(f);
    fx.call(f, Operation::Forget { nlookup: 1 });
    assert_eq!(fx.err(f, Operation::Getattr { fh: None }), Errno::ENOENT);
}

#[test]
fn rename_moves_and_replaces() {
    let mut fx = Fx::new();
    let a = fx.create(ROOT, b"a");
    fx.write(a, 0, b"A");
    let b = fx.create(ROOT, b"b");
    fx.ok(
        ROOT,
        Operation::Rename {
            newdir: ROOT,
            name: b"a",
            newname: b"c",
            flags: 0,
        },
    );
    assert_eq!(fx.lookup(ROOT, b"c").nodeid, a);
    assert_eq!(
        fx.err(ROOT, Operation::Lookup { name: b"a" }),
        Errno::ENOENT
    );
    // Replacing unlinks the target.
    fx.ok(
        ROOT,
        Operation::Rename {
            newdir: ROOT,
            name: b"c",
            newname: b"b",
            flags: 0,
        },
    );
    assert_eq!(fx.lookup(ROOT, b"b").nodeid, a);
    assert_eq!(fx.getattr(b).nlink, 0);
    assert_eq!(fx.read(a, 0, 10), b"A");
    // Two names of one inode: nothing happens.
    fx.ok(
        ROOT,
        Operation::Link {
            oldnodeid: a,
            name: b"b2",
        },
    );
    fx.ok(
        ROOT,
        Operation::Rename {
            newdir: ROOT,
            name: b"b",
            newname: b"b2",
            flags: 0,
        },
    );
    assert_eq!(fx.getattr(a).nlink, 2);
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Rename {
                newdir: ROOT,
                name: b"zz",
                newname: b"y",
                flags: 0
            }
        ),
        Errno::ENOENT
    );
}

#[test]
fn rename_flags() {
    let mut fx = Fx::new();
    let x = fx.create(ROOT, b"x");
    let d = fx.mkdir(ROOT, b"d");
    let y = fx.create(d, b"y");
    let noreplace = Operation::Rename {
        newdir: d,
        name: b"x",
        newname: b"y",
        flags: RENAME_NOREPLACE,
    };
    assert_eq!(fx.err(ROOT, noreplace), Errno::EEXIST);
    fx.ok(
        ROOT,
        Operation::Rename {
            newdir: d,
            name: b"x",
            newname: b"y",
            flags: RENAME_EXCHANGE,
        },
    );
    assert_eq!(fx.lookup(ROOT, b"x").nodeid, y);
    assert_eq!(fx.lookup(d, b"y").nodeid, x);
    let missing = Operation::Rename {
        newdir: d,
        name: b"x",
        newname: b"nope",
        flags: RENAME_EXCHANGE,
    };
    assert_eq!(fx.err(ROOT, missing), Errno::ENOENT);
    let both = Operation::Rename {
        newdir: d,
        name: b"x",
        newname: b"y",
        flags: 3,
    };
    assert_eq!(fx.err(ROOT, both), Errno::EINVAL);
    let whiteout = Operation::Rename {
        newdir: d,
        name: b"x",
        newname: b"w",
        flags: 4,
    };
    assert_eq!(fx.err(ROOT, whiteout), Errno::EINVAL);
    // Exchanging a directory with a file across directories moves the directory's "..".
    let sub = fx.mkdir(d, b"sub");
    fx.ok(
        d,
        Operation::Rename {
            newdir: ROOT,
            name: b"sub",
            newname: b"x",
            flags: RENAME_EXCHANGE,
        },
    );
    assert_eq!(fx.lookup(ROOT, b"x").nodeid, sub);
    assert_eq!(
        fx.readdir(sub, 1, 100)[0].0,
        ROOT,
        "\"..\" of the moved directory"
    );
    assert_eq!((fx.getattr(ROOT).nlink, fx.getattr(d).nlink), (4, 2));
}

#[test]
fn rename_directory_rules() {
    let mut fx = Fx::new();
    let a = fx.mkdir(ROOT, b"a");
    let b = fx.mkdir(a, b"b");
    let c = fx.mkdir(b, b"c");
    let into_self = Operation::Rename {
        newdir: c,
        name: b"a",
        newname: b"x",
        flags: 0,
    };
    assert_eq!(fx.err(ROOT, into_self), Errno::EINVAL);
    let onto_self = Operation::Rename {
        newdir: a,
        name: b"a",
        newname: b"x",
        flags: 0,
    };
    assert_eq!(fx.err(ROOT, onto_self), Errno::EINVAL);
    let exchange_in = Operation::Rename {
        newdir: b,
        name: b"a",
        newname: b"c",
        flags: RENAME_EXCHANGE,
    };
    assert_eq!(fx.err(ROOT, exchange_in), Errno::EINVAL);
    fx.create(ROOT, b"file");
    let e = fx.mkdir(ROOT, b"e");
    fx.mkdir(e, b"inner");
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Rename {
                newdir: ROOT,
                name: b"a",
                newname: b"file",
                flags: 0
            }
        ),
        Errno::ENOTDIR
    );
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Rename {
                newdir: ROOT,
                name: b"file",
                newname: b"a",
                flags: 0
            }
        ),
        Errno::EISDIR
    );
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Rename {
                newdir: ROOT,
                name: b"a",
                newname: b"e",
                flags: 0
            }
        ),
        Errno::ENOTEMPTY
    );
    // Moving c up to the root: root's subdirectories are now a, e and c2.
    fx.ok(
        b,
        Operation::Rename {
            newdir: ROOT,
            name: b"c",
            newname: b"c2",
            flags: 0,
        },
    );
    assert_eq!(fx.readdir(c, 1, 100)[0].0, ROOT);
    assert_eq!((fx.getattr(b).nlink, fx.getattr(ROOT).nlink), (2, 5));
    // Replacing an empty directory.
    fx.ok(e, Operation::Rmdir { name: b"inner" });
    fx.ok(
        ROOT,
        Operation::Rename {
            newdir: ROOT,
            name: b"c2",
            newname: b"e",
            flags: 0,
        },
    );
    assert_eq!(fx.lookup(ROOT, b"e").nodeid, c);
    assert_eq!(fx.getattr(e).nlink, 0);
    assert_eq!(fx.getattr(ROOT).nlink, 4);
}

#[test]
fn xattrs() {
    let mut fx = Fx::new();
    let f = fx.create(ROOT, b"f");
    assert_eq!(
        fx.err(
            f,
            Operation::Getxattr {
                name: b"user.a",
                size: 0
            }
        ),
        Errno::ENODATA
    );
    fx.ok(
        f,
        Operation::Setxattr {
            name: b"user.a",
            value: b"12345",
            flags: 0,
        },
    );
    let size: GetxattrOut = parse(&fx.ok(
        f,
        Operation::Getxattr {
            name: b"user.a",
            size: 0,
        },
    ));
    assert_eq!(size.size, 5);
    assert_eq!(
        fx.err(
            f,
            Operation::Getxattr {
                name: b"user.a",
                size: 4
            }
        ),
        Errno::ERANGE
    );
    assert_eq!(
        fx.ok(
            f,
            Operation::Getxattr {
                name: b"user.a",
                size: 5
            }
        ),
        b"12345"
    );
    assert_eq!(
        fx.err(
            f,
            Operation::Setxattr {
                name: b"user.a",
                value: b"",
                flags: XATTR_CREATE
            }
        ),
        Errno::EEXIST
    );
    assert_eq!(
        fx.err(
            f,
            Operation::Setxattr {
                name: b"user.b",
                value: b"",
                flags: XATTR_REPLACE
            }
        ),
        Errno::ENODATA
    );
    fx.ok(
        f,
        Operation::Setxattr {
            name: b"user.a",
            value: b"x",
            flags: XATTR_REPLACE,
        },
    );
    fx.ok(
        f,
        Operation::Setxattr {
            name: b"user.b",
            value: b"",
            flags: XATTR_CREATE,
        },
    );
    let list_size: GetxattrOut = parse(&fx.ok(f, Operation::Listxattr { size: 0 }));
    assert_eq!(list_size.size, 14);
    assert_eq!(fx.err(f, Operation::Listxattr { size: 13 }), Errno::ERANGE);
    assert_eq!(
        fx.ok(f, Operation::Listxattr { size: 100 }),
        b"user.a\0user.b\0"
    );
    fx.ok(f, Operation::Removexattr { name: b"user.a" });
    assert_eq!(
        fx.err(f, Operation::Removexattr { name: b"user.a" }),
        Errno::ENODATA
    );
    assert_eq!(fx.ok(f, Operation::Listxattr { size: 100 }), b"user.b\0");
    assert_eq!(
        fx.err(
            f,
            Operation::Getxattr {
                name: &[b'n'; 256],
                size: 0
            }
        ),
        Errno::ERANGE
    );
}

#[test]
fn setattr_truncate_mode_times() {
    let mut fx = Fx::new();
    let f = fx.create(ROOT, b"f");
    fx.write(f, 0, b"abcdef");
    let truncate = SetattrIn {
        valid: FATTR_SIZE,
        size: 3,
        ..SetattrIn::default()
    };
    let a: AttrOut = parse(&fx.ok(f, Operation::Setattr(truncate)));
    assert_eq!(a.attr.size, 3);
    let extend = SetattrIn {
        valid: FATTR_SIZE,
        size: 5,
        ..SetattrIn::default()
    };
    fx.ok(f, Operation::Setattr(extend));
    assert_eq!(fx.read(f, 0, 100), b"abc\0\0");
    let chmod = SetattrIn {
        valid: FATTR_MODE,
        mode: 0o104_755,
        ..SetattrIn::default()
    };
    assert_eq!(
        parse::<AttrOut>(&fx.ok(f, Operation::Setattr(chmod)))
            .attr
            .mode,
        libc::S_IFREG | 0o4755
    );
    let times = SetattrIn {
        valid: FATTR_ATIME | FATTR_MTIME,
        atime: 1_000,
        atimensec: 5,
        mtime: 2_000,
        mtimensec: 6,
        ..SetattrIn::default()
    };
    let a = parse::<AttrOut>(&fx.ok(f, Operation::Setattr(times))).attr;
    assert_eq!(
        (a.atime, a.atimensec, a.mtime, a.mtimensec),
        (1_000, 5, 2_000, 6)
    );
    assert!(a.ctime > 2_000);
    let now = SetattrIn {
        valid: FATTR_MTIME | FATTR_MTIME_NOW,
        ..SetattrIn::default()
    };
    assert!(
        parse::<AttrOut>(&fx.ok(f, Operation::Setattr(now)))
            .attr
            .mtime
            > 2_000
    );
    // Writes flagged by the kernel clear set-user-id (HANDLE_KILLPRIV_V2).
    let op = Operation::Write {
        fh: 0,
        offset: 0,
        data: b"z",
        write_flags: FUSE_WRITE_KILL_SUIDGID,
        flags: 0,
    };
    fx.ok(f, op);
    assert_eq!(fx.getattr(f).mode, libc::S_IFREG | 0o755);
    let d = fx.mkdir(ROOT, b"d");
    let bad = SetattrIn {
        valid: FATTR_SIZE,
        size: 0,
        ..SetattrIn::default()
    };
    assert_eq!(fx.err(d, Operation::Setattr(bad)), Errno::EISDIR);
}

#[test]
fn open_with_o_trunc_truncates() {
    let mut fx = Fx::new();
    let f = fx.create(ROOT, b"f");
    fx.write(f, 0, b"data");
    let rd: OpenOut = parse(&fx.ok(
        f,
        Operation::Open {
            flags: libc::O_RDONLY as u32,
            open_flags: 0,
        },
    ));
    assert_eq!(fx.getattr(f).size, 4);
    let wr: OpenOut = parse(&fx.ok(
        f,
        Operation::Open {
            flags: (libc::O_WRONLY | libc::O_TRUNC) as u32,
            open_flags: 0,
        },
    ));
    assert_ne!(rd.fh, wr.fh);
    assert_eq!(fx.getattr(f).size, 0);
    assert_eq!(fx.read(f, 0, 10), b"");
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Open {
                flags: 0,
                open_flags: 0
            }
        ),
        Errno::EISDIR
    );
    fx.ok(ROOT, Operation::Opendir { flags: 0 });
    assert_eq!(fx.err(f, Operation::Opendir { flags: 0 }), Errno::ENOTDIR);
}

#[test]
fn symlinks_links_and_special_files() {
    let mut fx = Fx::new();
    let l = fx.entry(
        ROOT,
        Operation::Symlink {
            name: b"l",
            target: b"../t/x",
        },
    );
    assert_eq!((l.attr.mode, l.attr.size), (libc::S_IFLNK | 0o777, 6));
    assert_eq!(fx.ok(l.nodeid, Operation::Readlink), b"../t/x");
    let f = fx.create(ROOT, b"f");
    assert_eq!(fx.err(f, Operation::Readlink), Errno::EINVAL);
    let h = fx.entry(
        ROOT,
        Operation::Link {
            oldnodeid: f,
            name: b"h",
        },
    );
    assert_eq!((h.nodeid, h.attr.nlink), (f, 2));
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Link {
                oldnodeid: f,
                name: b"h"
            }
        ),
        Errno::EEXIST
    );
    assert_eq!(
        fx.err(
            ROOT,
            Operation::Link {
                oldnodeid: ROOT,
                name: b"r"
            }
        ),
        Errno::EPERM
    );
    fx.ok(ROOT, Operation::Unlink { name: b"f" });
    assert_eq!(fx.getattr(f).nlink, 1);
    let fifo = fx.entry(
        ROOT,
        Operation::Mknod {
            name: b"p",
            mode: libc::S_IFIFO | 0o600,
            rdev: 0,
            umask: 0,
        },
    );
    assert_eq!(fifo.attr.mode, libc::S_IFIFO | 0o600);
    let dev = fx.entry(
        ROOT,
        Operation::Mknod {
            name: b"c",
            mode: libc::S_IFCHR | 0o600,
            rdev: 0x0103,
            umask: 0,
        },
    );
    assert_eq!(dev.attr.rdev, 0x0103);
    let types: Vec<u32> = fx
        .readdirplus(ROOT, 2, 4096)
        .iter()
        .map(|e| e.1.typ)
        .collect();
    assert_eq!(
        types,
        [
            libc::DT_LNK as u32,
            libc::DT_REG as u32,
            libc::DT_FIFO as u32,
            libc::DT_CHR as u32
        ]
    );
}

#[test]
fn tmpfile_then_link() {
    let mut fx = Fx::new();
    let bytes = fx.ok(
        ROOT,
        Operation::Tmpfile {
            flags: 2,
            mode: 0o600,
            umask: 0,
            open_flags: 0,
        },
    );
    let e: EntryOut = parse(&bytes);
    assert_eq!((e.attr.nlink, e.attr.mode), (0, libc::S_IFREG | 0o600));
    assert_eq!(fx.names(ROOT).len(), 2, "unnamed");
    fx.write(e.nodeid, 0, b"tmp");
    fx.ok(
        ROOT,
        Operation::Link {
            oldnodeid: e.nodeid,
            name: b"named",
        },
    );
    assert_eq!(fx.lookup(ROOT, b"named").attr.nlink, 1);
}

#[test]
fn fallocate_and_unsupported_ops() {
    let mut fx = Fx::new();
    let f = fx.create(ROOT, b"f");
    fx.ok(
        f,
        Operation::Fallocate {
            fh: 0,
            offset: 4096,
            length: 4096,
            mode: 0,
        },
    );
    assert_eq!(fx.getattr(f).size, 8192);
    fx.ok(
        f,
        Operation::Fallocate {
            fh: 0,
            offset: 0,
            length: 10,
            mode: 0,
        },
    );
    assert_eq!(fx.getattr(f).size, 8192, "inside the file: no change");
    assert_eq!(
        fx.err(
            f,
            Operation::Fallocate {
                fh: 0,
                offset: 0,
                length: 1,
                mode: 1
            }
        ),
        Errno::EOPNOTSUPP
    );
    assert_eq!(
        fx.err(
            f,
            Operation::Statx {
                fh: None,
                sx_flags: 0,
                sx_mask: 0x7ff
            }
        ),
        Errno::ENOSYS
    );
    assert_eq!(fx.err(f, Operation::Access { mask: 4 }), Errno::ENOSYS);
    assert_eq!(
        fx.err(
            f,
            Operation::Lseek {
                fh: 0,
                offset: 0,
                whence: 3
            }
        ),
        Errno::ENOSYS
    );
    assert_eq!(fx.err(f, Operation::Unknown { opcode: 999 }), Errno::ENOSYS);
    assert!(matches!(
        fx.call(0, Operation::Interrupt { unique: 5 }),
        Reply::None
    ));
    fx.ok(
        f,
        Operation::Flush {
            fh: 0,
            lock_owner: 0,
        },
    );
    fx.ok(
        f,
        Operation::Fsync {
            fh: 0,
            datasync: true,
        },
    );
    fx.ok(
        f,
        Operation::Release {
            fh: 0,
            flags: 0,
            release_flags: 0,
            lock_owner: 0,
        },
    );
}

#[test]
fn create_races_and_setgid_directories() {
    let mut fx = Fx::new();
    fx.create(ROOT, b"f");
    let excl = Operation::Create {
        name: b"f",
        flags: (libc::O_CREAT | libc::O_EXCL) as u32,
        mode: 0o100644,
        umask: 0,
        open_flags: 0,
    };
    assert_eq!(fx.err(ROOT, excl), Errno::EEXIST);
    fx.ok(
        ROOT,
        Operation::Create {
            name: b"f",
            flags: 2,
            mode: 0o100644,
            umask: 0,
            open_flags: 0,
        },
    );
    let d = fx.entry(
        ROOT,
        Operation::Mkdir {
            name: b"g",
            mode: 0o2775,
            umask: 0,
        },
    );
    let chgrp = SetattrIn {
        valid: fusedev::abi::FATTR_GID,
        gid: 55,
        ..SetattrIn::default()
    };
    fx.ok(d.nodeid, Operation::Setattr(chgrp));
    let sub = fx.entry(
        d.nodeid,
        Operation::Mkdir {
            name: b"s",
            mode: 0o755,
            umask: 0,
        },
    );
    assert_eq!(
        (sub.attr.gid, sub.attr.mode & libc::S_ISGID),
        (55, libc::S_ISGID)
    );
    let file = fx.create(d.nodeid, b"x");
    assert_eq!(fx.getattr(file).gid, 55);
}

/// Several threads creating, renaming and removing in shared directories: no deadlock,
/// and the directory ends up consistent with its link count.
#[test]
fn concurrent_namespace_changes() {
    let fs = Arc::new(MemFs::new(MemFsConfig::default()));
    let mut threads = Vec::new();
    for t in 0..4u64 {
        let fs = Arc::clone(&fs);
        threads.push(thread::spawn(move || {
            let mut out = vec![0u8; 8192];
            let mut call = |nodeid: u64, op: Operation<'_>| {
                let req = Request::new(t, nodeid, op);
                let mut bytes = Vec::new();
                req.encode(&mut bytes);
                let req = request::decode(&bytes).unwrap();
                fs.handle(&RequestCtx::new(t as usize), &req, &mut out)
            };
            for i in 0..300u64 {
                let a = format!("a{}", i % 7);
                let b = format!("b{}", (i + t) % 5);
                let _ = call(
                    ROOT,
                    Operation::Mkdir {
                        name: a.as_bytes(),
                        mode: 0o755,
                        umask: 0,
                    },
                );
                let _ = call(
                    ROOT,
                    Operation::Create {
                        name: b.as_bytes(),
                        flags: 2,
                        mode: 0o100644,
                        umask: 0,
                        open_flags: 0,
                    },
                );
                let _ = call(
                    ROOT,
                    Operation::Rename {
                        newdir: ROOT,
                        name: b.as_bytes(),
                        newname: a.as_bytes(),
                        flags: 0,
                    },
                );
                let _ = call(
                    ROOT,
                    Operation::Rename {
                        newdir: ROOT,
                        name: a.as_bytes(),
                        newname: b.as_bytes(),
                        flags: RENAME_EXCHANGE,
                    },
                );
                let _ = call(ROOT, Operation::Unlink { name: b.as_bytes() });
                let _ = call(ROOT, Operation::Rmdir { name: a.as_bytes() });
                let _ = call(
                    ROOT,
                    Operation::Readdirplus {
                        fh: 0,
                        offset: 0,
                        size: 4096,
                    },
                );
            }
        }));
    }
    for t in threads {
        t.join().expect("worker panicked");
    }
    let mut fx = Fx {
        fs: Arc::try_unwrap(fs).ok().expect("sole owner"),
        out: vec![0; 1 << 16],
        unique: 1,
    };
    let names = fx.names(ROOT);
    let subdirs = names[2..]
        .iter()
        .filter(|n| fx.lookup(ROOT, n).attr.mode & libc::S_IFMT == libc::S_IFDIR)
        .count();
    assert_eq!(fx.getattr(ROOT).nlink as usize, 2 + subdirs);
}
