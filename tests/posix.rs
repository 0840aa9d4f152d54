//! POSIX behaviour of etcfs on a real mount: a real etcd (`ETCD_ENDPOINTS`), a real FUSE
//! mount of the `etcfs` binary (root), a real sparse device image in /var/tmp. Every
//! operation of issue 3 ("The operations"), with the errno of each error case.
//!
//! Each test formats its own filesystem (its own etcd prefix and image, see
//! `common::TestFs`) and mounts it with `--foreground` as a child process; guards stop the
//! daemon by pid, unmount, and delete the image and the etcd keys even when a test fails.
//! Without root, `/dev/fuse` or `ETCD_ENDPOINTS` a test prints `SKIP:` and passes, unless
//! `ETCFS_REQUIRE_MOUNT_TESTS=1` (scripts/test.sh as root), which makes that a failure.
//!
//! Syscalls std does not offer (renameat2, utimensat with UTIME_NOW/UTIME_OMIT, xattrs with
//! flags and sizes, fallocate, SEEK_DATA/SEEK_HOLE, mknod) go through the C helper of
//! `common`, which reports the errno.

mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::{self, File, FileTimes, OpenOptions},
    io::{Read as _, Seek as _, SeekFrom, Write as _},
    net::TcpListener,
    os::unix::{
        fs::{DirBuilderExt as _, FileExt as _, FileTypeExt as _, MetadataExt as _},
        fs::{OpenOptionsExt as _, PermissionsExt as _},
        net::{UnixListener, UnixStream},
    },
    path::Path,
    process::Command,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use common::{
    assert_same_bytes, assert_same_tree, df_avail, errno_of, eventually, helper, helper_as_nobody,
    helper_path, pattern, run_bounded, run_ok, snapshot, sorted_names, Daemon, TestFs, ETCFS,
};
use rand::{rngs::SmallRng, Rng as _, SeedableRng as _};

const MIB: u64 = 1 << 20;
/// Space that may stay in use after a file's blocks are returned (allocation granularity
/// and bookkeeping); everything above this must come back.
const SPACE_SLACK: u64 = MIB;
/// How long freed space may take to show in statfs.
const SPACE_DEADLINE: Duration = Duration::from_secs(10);

/// Formats a filesystem for `test` and mounts it (transport `auto`), or skips.
macro_rules! setup {
    ($fs:ident, $m:ident, $test:expr) => {
        setup!($fs, $m, $test, &[]);
    };
    ($fs:ident, $m:ident, $test:expr, $extra:expr) => {
        let Some($fs) = TestFs::new_or_skip($test, None) else {
            return;
        };
        #[allow(unused_mut)]
        let mut $m = $fs.mount("auto", $extra);
    };
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64
}

fn ctime_ns(p: &Path) -> (i64, i64) {
    let md = fs::symlink_metadata(p).unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()));
    (md.ctime(), md.ctime_nsec())
}

fn mtime_ns(p: &Path) -> (i64, i64) {
    let md = fs::symlink_metadata(p).unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()));
    (md.mtime(), md.mtime_nsec())
}

fn atime_ns(p: &Path) -> (i64, i64) {
    let md = fs::symlink_metadata(p).unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()));
    (md.atime(), md.atime_nsec())
}

fn mode_of(p: &Path) -> u32 {
    fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()))
        .mode()
        & 0o7777
}

fn nlink_of(p: &Path) -> u64 {
    fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()))
        .nlink()
}

fn ino_of(p: &Path) -> u64 {
    fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()))
        .ino()
}

/// A little pause so a timestamp taken after it is strictly later than one before.
fn tick() {
    std::thread::sleep(Duration::from_millis(20));
}

/// The Linux `new_encode_dev` of (major, minor), as stat's st_rdev shows it.
fn makedev(major: u64, minor: u64) -> u64 {
    (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & !0xff) << 12) | ((major & !0xfff) << 32)
}

/// The errno the helper reported, or a panic naming the unexpected success.
fn expect_errno(r: Result<String, i32>, what: &str) -> i32 {
    match r {
        Ok(v) => panic!("{what}: succeeded ({v:?}), expected an error"),
        Err(e) => e,
    }
}

fn ok(r: Result<String, i32>, what: &str) -> String {
    r.unwrap_or_else(|e| {
        panic!(
            "{what}: errno {e} ({})",
            std::io::Error::from_raw_os_error(e)
        )
    })
}

// ---------------------------------------------------------------------------------------
// lookup, getattr, setattr
// ---------------------------------------------------------------------------------------

#[test]
fn lookup_and_getattr() {
    setup!(fs, m, "lookup_and_getattr");
    let root = fs::metadata(&m.mnt).expect("stat the root");
    assert!(root.is_dir());
    assert_eq!(root.mode() & 0o7777, 0o755, "root mode");
    assert_eq!(root.nlink(), 2, "an empty root has nlink 2");

    let before = now_secs();
    let f = m.path("f");
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o640)
        .open(&f)
        .expect("create f")
        .write_all(b"12345")
        .expect("write f");
    let md = fs::metadata(&f).expect("stat f");
    assert!(md.is_file());
    assert_eq!(md.len(), 5);
    assert_eq!(md.nlink(), 1);
    assert_eq!((md.uid(), md.gid()), (0, 0), "created by root");
    assert_eq!(md.mode() & 0o7777, 0o640, "mode given to open(O_CREAT)");
    assert_eq!(md.dev(), root.dev(), "one st_dev per filesystem");
    assert_ne!(md.ino(), root.ino());
    for (what, t) in [
        ("atime", md.atime()),
        ("mtime", md.mtime()),
        ("ctime", md.ctime()),
    ] {
        assert!(
            t >= before - 2 && t <= now_secs() + 2,
            "{what} {t} is not the creation time (now {})",
            now_secs()
        );
    }
    assert_eq!(md.blksize(), 4096, "st_blksize is the block size");
    // The inode number is stable from lookup to lookup.
    assert_eq!(fs::metadata(&f).expect("stat again").ino(), md.ino());
    // Through a directory, too.
    fs::create_dir(m.path("d")).expect("mkdir");
    fs::write(m.path("d/g"), b"g").expect("create d/g");
    assert_eq!(fs::read(m.path("d/g")).expect("read d/g"), b"g");
    assert_eq!(
        fs::metadata(m.path("d/./g")).expect("d/./g").ino(),
        ino_of(&m.path("d/g"))
    );
    assert_eq!(
        fs::metadata(m.path("d/..")).expect("d/..").ino(),
        root.ino()
    );

    assert_eq!(
        errno_of(fs::metadata(m.path("missing"))),
        Some(libc::ENOENT)
    );
    assert_eq!(
        errno_of(fs::metadata(m.path("d/missing"))),
        Some(libc::ENOENT)
    );
    assert_eq!(errno_of(fs::metadata(m.path("f/x"))), Some(libc::ENOTDIR));
    assert_eq!(
        errno_of(fs::metadata(m.path("missing/x"))),
        Some(libc::ENOENT)
    );
}

#[test]
fn chmod_and_chown() {
    setup!(fs, m, "chmod_and_chown");
    let f = m.path("f");
    fs::write(&f, b"data").expect("create");
    let c0 = ctime_ns(&f);
    let m0 = mtime_ns(&f);
    tick();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).expect("chmod 600");
    assert_eq!(mode_of(&f), 0o600);
    assert!(ctime_ns(&f) > c0, "chmod must advance ctime");
    assert_eq!(mtime_ns(&f), m0, "chmod must not touch mtime");
    fs::set_permissions(&f, fs::Permissions::from_mode(0o4755)).expect("chmod 4755");
    assert_eq!(mode_of(&f), 0o4755, "root may set setuid");
    fs::set_permissions(&f, fs::Permissions::from_mode(0o1777)).expect("chmod 1777");
    assert_eq!(mode_of(&f), 0o1777);
    assert!(
        fs::metadata(&f).expect("stat").is_file(),
        "chmod keeps the file type"
    );

    let c1 = ctime_ns(&f);
    tick();
    std::os::unix::fs::chown(&f, Some(1234), Some(5678)).expect("chown");
    let md = fs::metadata(&f).expect("stat");
    assert_eq!((md.uid(), md.gid()), (1234, 5678));
    assert!(ctime_ns(&f) > c1, "chown must advance ctime");
    std::os::unix::fs::chown(&f, None, Some(42)).expect("chgrp");
    let md = fs::metadata(&f).expect("stat");
    assert_eq!((md.uid(), md.gid()), (1234, 42), "chown -1 keeps the uid");
    std::os::unix::fs::chown(&f, Some(7), None).expect("chown uid only");
    let md = fs::metadata(&f).expect("stat");
    assert_eq!((md.uid(), md.gid()), (7, 42), "chown uid, -1 keeps the gid");

    // lchown changes the link, not its target.
    std::os::unix::fs::symlink("f", m.path("l")).expect("symlink");
    std::os::unix::fs::lchown(m.path("l"), Some(99), Some(98)).expect("lchown");
    let lmd = fs::symlink_metadata(m.path("l")).expect("lstat");
    assert_eq!((lmd.uid(), lmd.gid()), (99, 98));
    let md = fs::metadata(&f).expect("stat");
    assert_eq!(
        (md.uid(), md.gid()),
        (7, 42),
        "lchown must not change the target"
    );

    fs::create_dir(m.path("d")).expect("mkdir");
    fs::set_permissions(m.path("d"), fs::Permissions::from_mode(0o700)).expect("chmod dir");
    assert_eq!(mode_of(&m.path("d")), 0o700);
    assert!(fs::metadata(m.path("d")).expect("stat d").is_dir());

    assert_eq!(
        errno_of(fs::set_permissions(
            m.path("missing"),
            fs::Permissions::from_mode(0o600)
        )),
        Some(libc::ENOENT)
    );
    assert_eq!(
        errno_of(std::os::unix::fs::chown(
            m.path("missing"),
            Some(1),
            Some(1)
        )),
        Some(libc::ENOENT)
    );
}

#[test]
fn truncate_down_and_up() {
    setup!(fs, m, "truncate_down_and_up");
    let p = m.path("t");
    let data = pattern(3 * 4096 + 100, 3);
    fs::write(&p, &data).expect("create");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .expect("open");
    let m0 = mtime_ns(&p);
    tick();
    f.set_len(5000).expect("truncate down");
    assert_eq!(fs::metadata(&p).expect("stat").len(), 5000);
    assert!(mtime_ns(&p) > m0, "truncate must advance mtime");
    assert_same_bytes(
        "after truncate down",
        &fs::read(&p).expect("read"),
        &data[..5000],
    );
    let md = fs::metadata(&p).expect("stat");
    assert!(
        md.blocks() * 512 <= 8192,
        "blocks past the new EOF must be freed: {} sectors for 5000 bytes",
        md.blocks()
    );

    // Re-extending must not bring back the old bytes past the cut.
    f.set_len(20_000).expect("truncate up");
    let back = fs::read(&p).expect("read");
    assert_eq!(back.len(), 20_000);
    assert_same_bytes("kept part", &back[..5000], &data[..5000]);
    if let Some(i) = back[5000..].iter().position(|&b| b != 0) {
        panic!(
            "byte {} past the truncation point is {:#x}, not 0",
            5000 + i,
            back[5000 + i]
        );
    }
    // Also through the still-open handle, whose page cache saw the old data.
    let mut buf = vec![0u8; 4096];
    f.read_exact_at(&mut buf, 8192).expect("pread");
    assert!(
        buf.iter().all(|&b| b == 0),
        "stale bytes through the open handle"
    );

    f.set_len(0).expect("truncate to 0");
    f.set_len(2 * 4096).expect("grow from 0");
    assert_eq!(fs::read(&p).expect("read"), vec![0u8; 8192]);
    drop(f);

    // truncate(2) by path, down to one byte and up into a hole.
    fs::write(&p, b"xyz").expect("rewrite");
    ok(helper(&["truncate", &s(&p), "1"]), "truncate(2)");
    assert_eq!(fs::read(&p).expect("read"), b"x");
    ok(helper(&["truncate", &s(&p), "4097"]), "truncate(2) up");
    let back = fs::read(&p).expect("read");
    assert_eq!(back.len(), 4097);
    assert!(back[1..].iter().all(|&b| b == 0));

    fs::create_dir(m.path("d")).expect("mkdir");
    assert_eq!(
        expect_errno(
            helper(&["truncate", &s(&m.path("d")), "0"]),
            "truncate a dir"
        ),
        libc::EISDIR
    );
    assert_eq!(
        expect_errno(
            helper(&["truncate", &s(&m.path("nope")), "0"]),
            "truncate missing"
        ),
        libc::ENOENT
    );
    // O_TRUNC
    File::create(&p).expect("O_TRUNC");
    assert_eq!(fs::metadata(&p).expect("stat").len(), 0);
}

#[test]
fn utimens_now_and_omit() {
    setup!(fs, m, "utimens_now_and_omit");
    let p = m.path("f");
    fs::write(&p, b"times").expect("create");
    let ps = s(&p);

    ok(
        helper(&["utimens", &ps, "1000000000.5", "1200000000.7"]),
        "utimensat",
    );
    assert_eq!(atime_ns(&p), (1_000_000_000, 5));
    assert_eq!(mtime_ns(&p), (1_200_000_000, 7));

    // UTIME_OMIT leaves that time alone.
    ok(
        helper(&["utimens", &ps, "omit", "1300000000.0"]),
        "utimensat omit atime",
    );
    assert_eq!(
        atime_ns(&p),
        (1_000_000_000, 5),
        "UTIME_OMIT atime changed it"
    );
    assert_eq!(mtime_ns(&p), (1_300_000_000, 0));
    ok(
        helper(&["utimens", &ps, "1100000000.0", "omit"]),
        "utimensat omit mtime",
    );
    assert_eq!(atime_ns(&p), (1_100_000_000, 0));
    assert_eq!(
        mtime_ns(&p),
        (1_300_000_000, 0),
        "UTIME_OMIT mtime changed it"
    );

    // UTIME_NOW sets the current time; ctime moves with every change.
    let c0 = ctime_ns(&p);
    tick();
    let before = now_secs();
    ok(
        helper(&["utimens", &ps, "now", "omit"]),
        "utimensat now/omit",
    );
    let a = atime_ns(&p).0;
    assert!(
        a >= before - 1 && a <= now_secs() + 1,
        "UTIME_NOW atime = {a}"
    );
    assert_eq!(
        mtime_ns(&p),
        (1_300_000_000, 0),
        "mtime must stay with UTIME_OMIT"
    );
    assert!(ctime_ns(&p) > c0, "utimensat must advance ctime");
    ok(
        helper(&["utimens", &ps, "omit", "now"]),
        "utimensat omit/now",
    );
    let mt = mtime_ns(&p).0;
    assert!(
        mt >= before - 1 && mt <= now_secs() + 1,
        "UTIME_NOW mtime = {mt}"
    );
    assert_eq!(atime_ns(&p).0, a, "atime must stay with UTIME_OMIT");
    ok(
        helper(&["utimens", &ps, "omit", "omit"]),
        "utimensat omit/omit",
    );
    assert_eq!(atime_ns(&p).0, a);
    assert_eq!(mtime_ns(&p).0, mt);

    // std's File::set_times sets only what it is given (the other is UTIME_OMIT).
    let f = OpenOptions::new().write(true).open(&p).expect("open");
    let t = UNIX_EPOCH + Duration::new(1_400_000_000, 123);
    f.set_times(FileTimes::new().set_modified(t))
        .expect("futimens mtime");
    assert_eq!(mtime_ns(&p), (1_400_000_000, 123));
    assert_eq!(atime_ns(&p).0, a, "futimens with only mtime changed atime");
    let t = UNIX_EPOCH + Duration::new(900_000_000, 9);
    f.set_times(FileTimes::new().set_accessed(t))
        .expect("futimens atime");
    assert_eq!(atime_ns(&p), (900_000_000, 9));
    assert_eq!(mtime_ns(&p), (1_400_000_000, 123));

    // On a directory, and on a missing name.
    fs::create_dir(m.path("d")).expect("mkdir");
    ok(
        helper(&["utimens", &s(&m.path("d")), "5.0", "6.0"]),
        "utimensat dir",
    );
    assert_eq!(mtime_ns(&m.path("d")), (6, 0));
    assert_eq!(
        expect_errno(
            helper(&["utimens", &s(&m.path("nope")), "now", "now"]),
            "missing"
        ),
        libc::ENOENT
    );
}

// ---------------------------------------------------------------------------------------
// mknod, mkdir, unlink, rmdir, symlink, link
// ---------------------------------------------------------------------------------------

#[test]
fn mknod_fifo_socket_and_devices() {
    setup!(fs, m, "mknod_fifo_socket_and_devices");
    let fifo = m.path("fifo");
    ok(
        helper(&["mknod", &s(&fifo), "fifo", "0", "0"]),
        "mknod fifo",
    );
    let md = fs::symlink_metadata(&fifo).expect("stat fifo");
    assert!(md.file_type().is_fifo(), "{:o}", md.mode());
    assert_eq!(
        expect_errno(
            helper(&["mknod", &s(&fifo), "fifo", "0", "0"]),
            "mknod twice"
        ),
        libc::EEXIST
    );
    // A fifo on etcfs works as a fifo (O_RDWR does not block).
    {
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&fifo)
            .expect("open fifo");
        f.write_all(b"ping").expect("write fifo");
        let mut buf = [0u8; 4];
        f.read_exact(&mut buf).expect("read fifo");
        assert_eq!(&buf, b"ping");
    }
    // mkfifo(1) as well.
    run_ok(Command::new("mkfifo").arg(m.path("fifo2")));
    assert!(fs::symlink_metadata(m.path("fifo2"))
        .expect("stat")
        .file_type()
        .is_fifo());

    // A socket made by bind(2), and one made by mknod(2).
    let sock = m.path("sock");
    let listener = UnixListener::bind(&sock).expect("bind a socket on etcfs");
    assert!(fs::symlink_metadata(&sock)
        .expect("stat sock")
        .file_type()
        .is_socket());
    let mut client = UnixStream::connect(&sock).expect("connect through the etcfs path");
    let (mut server, _) = listener.accept().expect("accept");
    client.write_all(b"hi").expect("send");
    let mut buf = [0u8; 2];
    server.read_exact(&mut buf).expect("receive");
    assert_eq!(&buf, b"hi");
    ok(
        helper(&["mknod", &s(&m.path("sock2")), "sock", "0", "0"]),
        "mknod sock",
    );
    assert!(fs::symlink_metadata(m.path("sock2"))
        .expect("stat")
        .file_type()
        .is_socket());

    // Device nodes keep their numbers (the mount is nodev, so they are not opened).
    for (name, kind, major, minor) in [
        ("null", "chr", 1u64, 3u64),
        ("misc", "chr", 10, 200),
        ("big", "chr", 300, 70_000),
        ("disk", "blk", 8, 1),
    ] {
        let p = m.path(name);
        ok(
            helper(&[
                "mknod",
                &s(&p),
                kind,
                &major.to_string(),
                &minor.to_string(),
            ]),
            "mknod device",
        );
        let md = fs::symlink_metadata(&p).expect("stat device");
        if kind == "chr" {
            assert!(md.file_type().is_char_device(), "{name}: {:o}", md.mode());
        } else {
            assert!(md.file_type().is_block_device(), "{name}: {:o}", md.mode());
        }
        assert_eq!(md.rdev(), makedev(major, minor), "{name}: rdev");
        assert_eq!(md.mode() & 0o777, 0o644, "{name}: permissions");
    }
    // mknod of a regular file.
    ok(
        helper(&["mknod", &s(&m.path("reg")), "reg", "0", "0"]),
        "mknod regular",
    );
    let md = fs::metadata(m.path("reg")).expect("stat reg");
    assert!(md.is_file());
    assert_eq!(md.len(), 0);
    assert_eq!(
        expect_errno(
            helper(&["mknod", &s(&m.path("nodir/x")), "fifo", "0", "0"]),
            "mknod in missing dir"
        ),
        libc::ENOENT
    );
    let mut names = sorted_names(&m.mnt);
    names.sort();
    assert_eq!(
        names,
        ["big", "disk", "fifo", "fifo2", "misc", "null", "reg", "sock", "sock2"]
    );
}

#[test]
fn mkdir_and_rmdir() {
    setup!(fs, m, "mkdir_and_rmdir");
    let d = m.path("d");
    fs::create_dir(&d).expect("mkdir");
    let md = fs::metadata(&d).expect("stat");
    assert!(md.is_dir());
    assert_eq!(md.nlink(), 2, "a new directory has nlink 2");
    assert_eq!(nlink_of(&m.mnt), 3, "the parent gains a link from ..");
    assert_eq!(errno_of(fs::create_dir(&d)), Some(libc::EEXIST));
    fs::write(m.path("file"), b"f").expect("create file");
    assert_eq!(errno_of(fs::create_dir(m.path("file"))), Some(libc::EEXIST));
    assert_eq!(
        errno_of(fs::create_dir(m.path("nope/x"))),
        Some(libc::ENOENT)
    );
    assert_eq!(
        errno_of(fs::create_dir(m.path("file/x"))),
        Some(libc::ENOTDIR)
    );

    fs::DirBuilder::new()
        .mode(0o750)
        .create(m.path("d/sub"))
        .expect("mkdir with mode");
    assert_eq!(mode_of(&m.path("d/sub")), 0o750);
    assert_eq!(nlink_of(&d), 3);
    assert_eq!(errno_of(fs::remove_dir(&d)), Some(libc::ENOTEMPTY));
    assert_eq!(
        errno_of(fs::remove_dir(m.path("file"))),
        Some(libc::ENOTDIR)
    );
    assert_eq!(errno_of(fs::remove_dir(m.path("nope"))), Some(libc::ENOENT));
    assert_eq!(
        errno_of(fs::remove_dir(m.path("file/x"))),
        Some(libc::ENOTDIR)
    );
    assert_eq!(
        expect_errno(helper(&["rmdir", &s(&m.path("d/."))]), "rmdir d/."),
        libc::EINVAL
    );
    fs::remove_dir(m.path("d/sub")).expect("rmdir sub");
    assert_eq!(nlink_of(&d), 2);
    // A directory whose only entry is a file is not empty either.
    fs::write(d.join("x"), b"x").expect("create in d");
    assert_eq!(errno_of(fs::remove_dir(&d)), Some(libc::ENOTEMPTY));
    assert!(d.join("x").exists(), "a refused rmdir must change nothing");
    fs::remove_file(d.join("x")).expect("unlink");
    fs::remove_dir(&d).expect("rmdir empty");
    assert_eq!(errno_of(fs::metadata(&d)), Some(libc::ENOENT));
    assert_eq!(nlink_of(&m.mnt), 2);
    // The name is free again.
    fs::create_dir(&d).expect("mkdir again");
    assert!(sorted_names(&d).is_empty());

    // Deep trees.
    fs::create_dir_all(m.path("a/b/c/d/e")).expect("mkdir -p");
    fs::write(m.path("a/b/c/d/e/leaf"), b"leaf").expect("create deep");
    assert_eq!(
        fs::read(m.path("a/b/c/d/e/leaf")).expect("read deep"),
        b"leaf"
    );
    fs::remove_dir_all(m.path("a")).expect("rm -r");
    assert_eq!(errno_of(fs::metadata(m.path("a"))), Some(libc::ENOENT));
}

#[test]
fn unlink_files() {
    setup!(fs, m, "unlink_files");
    let f = m.path("f");
    fs::write(&f, b"bye").expect("create");
    fs::remove_file(&f).expect("unlink");
    assert_eq!(errno_of(fs::metadata(&f)), Some(libc::ENOENT));
    assert_eq!(errno_of(fs::remove_file(&f)), Some(libc::ENOENT));
    assert!(sorted_names(&m.mnt).is_empty());
    fs::create_dir(m.path("d")).expect("mkdir");
    assert_eq!(errno_of(fs::remove_file(m.path("d"))), Some(libc::EISDIR));
    fs::write(m.path("g"), b"g").expect("create g");
    assert_eq!(
        errno_of(fs::remove_file(m.path("g/x"))),
        Some(libc::ENOTDIR)
    );
    // Unlinking a symlink removes the link, not the target; special files unlink too.
    std::os::unix::fs::symlink("g", m.path("l")).expect("symlink");
    fs::remove_file(m.path("l")).expect("unlink symlink");
    assert_eq!(fs::read(m.path("g")).expect("target survives"), b"g");
    ok(
        helper(&["mknod", &s(&m.path("p")), "fifo", "0", "0"]),
        "mkfifo",
    );
    fs::remove_file(m.path("p")).expect("unlink fifo");
    // A name unlinked and created again is a new, empty file.
    let old = ino_of(&m.path("g"));
    fs::remove_file(m.path("g")).expect("unlink g");
    File::create(m.path("g")).expect("recreate g");
    assert_ne!(ino_of(&m.path("g")), old, "inode numbers are not reused");
    assert_eq!(fs::metadata(m.path("g")).expect("stat").len(), 0);
    assert_eq!(sorted_names(&m.mnt), ["d", "g"]);
}

/// Each kind of entry change, in a directory of its own, and the directories whose mtime
/// and ctime it must advance.
fn directory_times(test: &str, at_once: bool) {
    setup!(fs, m, test);
    let dirs = [
        "create", "mkdir", "symlink", "link", "mknod", "from", "to", "unlink", "rmdir",
    ];
    for d in dirs {
        fs::create_dir(m.path(d)).expect("mkdir");
    }
    fs::write(m.path("link/f"), b"f").expect("create");
    fs::write(m.path("from/f"), b"f").expect("create");
    fs::write(m.path("unlink/f"), b"f").expect("create");
    fs::create_dir(m.path("rmdir/sub")).expect("mkdir");
    fs::write(m.path("file"), b"f").expect("create");
    if !at_once {
        // Let the set-up's own time updates settle first.
        std::thread::sleep(Duration::from_millis(1500));
    }
    let times = |d: &str| (mtime_ns(&m.path(d)), ctime_ns(&m.path(d)));
    let before: BTreeMap<&str, _> = dirs.iter().map(|d| (*d, times(d))).collect();
    let root_before = times(".");
    let file_before = mtime_ns(&m.path("file"));
    tick();
    let p = |x: &str| m.path(x);
    type Op<'a> = (&'a str, &'a [&'a str], Box<dyn Fn() + 'a>);
    let ops: Vec<Op> = vec![
        (
            "create",
            &["create"],
            Box::new(|| fs::write(p("create/f"), b"f").expect("create")),
        ),
        (
            "mkdir",
            &["mkdir"],
            Box::new(|| fs::create_dir(p("mkdir/d")).expect("mkdir")),
        ),
        (
            "symlink",
            &["symlink"],
            Box::new(|| std::os::unix::fs::symlink("t", p("symlink/l")).expect("symlink")),
        ),
        (
            "link",
            &["link"],
            Box::new(|| fs::hard_link(p("link/f"), p("link/h")).expect("link")),
        ),
        (
            "mknod",
            &["mknod"],
            Box::new(|| {
                ok(
                    helper(&["mknod", &s(&p("mknod/p")), "fifo", "0", "0"]),
                    "mknod",
                );
            }),
        ),
        (
            "rename",
            &["from", "to"],
            Box::new(|| fs::rename(p("from/f"), p("to/f")).expect("rename")),
        ),
        (
            "unlink",
            &["unlink"],
            Box::new(|| fs::remove_file(p("unlink/f")).expect("unlink")),
        ),
        (
            "rmdir",
            &["rmdir"],
            Box::new(|| fs::remove_dir(p("rmdir/sub")).expect("rmdir")),
        ),
    ];
    let stale = |names: &[&str]| -> Vec<String> {
        names
            .iter()
            .filter(|d| {
                let (m0, c0) = before[*d];
                let (m1, c1) = times(d);
                m1 <= m0 || c1 <= c0
            })
            .map(|d| d.to_string())
            .collect()
    };
    for (what, changed, op) in &ops {
        op();
        if at_once {
            let st = stale(changed);
            assert!(
                st.is_empty(),
                "{what}: mtime/ctime of {st:?} did not advance at once"
            );
        }
    }
    let mut st = Vec::new();
    let advanced = eventually(Duration::from_secs(5), || {
        st = stale(&dirs);
        st.is_empty()
    });
    assert!(advanced, "mtime/ctime of {st:?} did not advance within 5 s");
    // The root's entries did not change; a write changes its file, not the directory.
    fs::write(m.path("file"), b"more").expect("rewrite");
    assert!(
        mtime_ns(&m.path("file")) > file_before,
        "write must advance the file's mtime"
    );
    if !at_once {
        std::thread::sleep(Duration::from_millis(1500));
    }
    assert_eq!(
        times("."),
        root_before,
        "the root's times changed without an entry change"
    );
}

#[test]
fn directory_times_follow_changes() {
    directory_times("directory_times_follow_changes", false);
}

/// The directory times change at the moment of the entry change, not when the pipeline
/// writes them to etcd (they used to show up to a second late).
#[test]
fn directory_times_advance_at_once() {
    directory_times("directory_times_advance_at_once", true);
}

/// setxattr and removexattr advance ctime, visibly at once (it used to lag a second).
#[test]
fn ctime_advances_at_setxattr() {
    setup!(fs, m, "ctime_advances_at_setxattr");
    let f = m.path("f");
    fs::write(&f, b"x").expect("create");
    let c0 = ctime_ns(&f);
    tick();
    ok(
        helper(&["setxattr", &s(&f), "user.a", "1", "0"]),
        "setxattr",
    );
    let c1 = ctime_ns(&f);
    assert!(c1 > c0, "setxattr did not advance ctime: {c0:?} -> {c1:?}");
    tick();
    ok(helper(&["removexattr", &s(&f), "user.a"]), "removexattr");
    let c2 = ctime_ns(&f);
    assert!(
        c2 > c1,
        "removexattr did not advance ctime: {c1:?} -> {c2:?}"
    );
}

#[test]
fn symlink_and_readlink() {
    setup!(fs, m, "symlink_and_readlink");
    fs::write(m.path("target-file"), b"pointed at").expect("create target");
    let l = m.path("l");
    std::os::unix::fs::symlink("target-file", &l).expect("symlink");
    assert_eq!(
        fs::read_link(&l).expect("readlink"),
        Path::new("target-file")
    );
    let lmd = fs::symlink_metadata(&l).expect("lstat");
    assert!(lmd.file_type().is_symlink());
    assert_eq!(
        lmd.len(),
        "target-file".len() as u64,
        "a symlink's size is its target's length"
    );
    assert_eq!(lmd.mode() & 0o777, 0o777);
    assert_eq!(fs::read(&l).expect("read through the link"), b"pointed at");
    assert!(fs::metadata(&l).expect("stat follows").is_file());

    // Dangling, absolute, into a directory, long.
    std::os::unix::fs::symlink("nowhere", m.path("dangling")).expect("dangling symlink");
    assert_eq!(
        errno_of(fs::metadata(m.path("dangling"))),
        Some(libc::ENOENT)
    );
    assert!(fs::symlink_metadata(m.path("dangling")).is_ok());
    fs::create_dir(m.path("dir")).expect("mkdir");
    fs::write(m.path("dir/inner"), b"inner").expect("create inner");
    std::os::unix::fs::symlink("dir", m.path("to-dir")).expect("symlink to dir");
    assert_eq!(
        fs::read(m.path("to-dir/inner")).expect("through dir link"),
        b"inner"
    );
    std::os::unix::fs::symlink(m.path("dir/inner"), m.path("abs")).expect("absolute symlink");
    assert_eq!(
        fs::read(m.path("abs")).expect("through absolute link"),
        b"inner"
    );
    let long: String = (0..4000)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    std::os::unix::fs::symlink(&long, m.path("long")).expect("4000-byte symlink");
    assert_eq!(
        fs::read_link(m.path("long"))
            .expect("readlink long")
            .to_string_lossy(),
        long
    );

    assert_eq!(
        errno_of(std::os::unix::fs::symlink("x", &l)),
        Some(libc::EEXIST),
        "symlink over an existing name"
    );
    assert_eq!(
        errno_of(fs::read_link(m.path("target-file"))),
        Some(libc::EINVAL)
    );
    assert_eq!(
        errno_of(fs::read_link(m.path("missing"))),
        Some(libc::ENOENT)
    );
    // A loop is ELOOP when followed.
    std::os::unix::fs::symlink("loop2", m.path("loop1")).expect("symlink");
    std::os::unix::fs::symlink("loop1", m.path("loop2")).expect("symlink");
    assert_eq!(errno_of(fs::metadata(m.path("loop1"))), Some(libc::ELOOP));
}

#[test]
fn hard_links() {
    setup!(fs, m, "hard_links");
    let a = m.path("a");
    let b = m.path("b");
    fs::write(&a, b"shared").expect("create a");
    let c0 = ctime_ns(&a);
    tick();
    fs::hard_link(&a, &b).expect("link");
    assert_eq!(ino_of(&a), ino_of(&b));
    assert_eq!(nlink_of(&a), 2);
    assert_eq!(nlink_of(&b), 2);
    assert!(ctime_ns(&a) > c0, "link must advance the inode's ctime");
    fs::create_dir(m.path("d")).expect("mkdir");
    fs::hard_link(&a, m.path("d/c")).expect("link into a subdirectory");
    assert_eq!(nlink_of(&a), 3);
    // One inode: a write through one name shows through the others.
    OpenOptions::new()
        .write(true)
        .open(&b)
        .expect("open b")
        .write_all_at(b"SH", 0)
        .expect("write b");
    assert_eq!(fs::read(&a).expect("read a"), b"SHared");
    assert_eq!(fs::read(m.path("d/c")).expect("read d/c"), b"SHared");

    assert_eq!(errno_of(fs::hard_link(&a, &b)), Some(libc::EEXIST));
    assert_eq!(
        errno_of(fs::hard_link(m.path("d"), m.path("dlink"))),
        Some(libc::EPERM)
    );
    assert_eq!(
        errno_of(fs::hard_link(m.path("missing"), m.path("x"))),
        Some(libc::ENOENT)
    );
    assert_eq!(
        errno_of(fs::hard_link(&a, m.path("nodir/x"))),
        Some(libc::ENOENT)
    );

    fs::remove_file(&a).expect("unlink a");
    assert_eq!(nlink_of(&b), 2);
    assert_eq!(fs::read(&b).expect("read b"), b"SHared");
    fs::remove_file(m.path("d/c")).expect("unlink d/c");
    assert_eq!(nlink_of(&b), 1);
    assert_eq!(errno_of(fs::hard_link(&a, m.path("y"))), Some(libc::ENOENT));
    // Links of a symlink link the symlink itself.
    std::os::unix::fs::symlink("b", m.path("sl")).expect("symlink");
    run_ok(
        Command::new("ln")
            .arg("-P")
            .arg(m.path("sl"))
            .arg(m.path("sl2")),
    );
    assert!(fs::symlink_metadata(m.path("sl2"))
        .expect("lstat")
        .file_type()
        .is_symlink());
    assert_eq!(nlink_of(&m.path("sl")), 2);
}

// ---------------------------------------------------------------------------------------
// rename
// ---------------------------------------------------------------------------------------

#[test]
fn rename_files_and_directories() {
    setup!(fs, m, "rename_files_and_directories");
    // To a new name.
    fs::write(m.path("a"), b"A").expect("create a");
    let ino = ino_of(&m.path("a"));
    fs::rename(m.path("a"), m.path("a2")).expect("rename");
    assert_eq!(errno_of(fs::metadata(m.path("a"))), Some(libc::ENOENT));
    assert_eq!(ino_of(&m.path("a2")), ino, "rename keeps the inode");
    assert_eq!(fs::read(m.path("a2")).expect("read"), b"A");

    // Over an existing file: the target's inode loses that link.
    fs::write(m.path("b"), b"B").expect("create b");
    fs::hard_link(m.path("b"), m.path("b-link")).expect("link b");
    fs::rename(m.path("a2"), m.path("b")).expect("rename over a file");
    assert_eq!(fs::read(m.path("b")).expect("read b"), b"A");
    assert_eq!(
        nlink_of(&m.path("b-link")),
        1,
        "the replaced inode lost a link"
    );
    assert_eq!(fs::read(m.path("b-link")).expect("read b-link"), b"B");

    // Two links of one inode: rename is a no-op and both stay.
    fs::hard_link(m.path("b"), m.path("b2")).expect("link");
    fs::rename(m.path("b"), m.path("b2")).expect("rename onto own link");
    assert!(
        m.path("b").exists() && m.path("b2").exists(),
        "POSIX: nothing happens"
    );
    fs::rename(m.path("b"), m.path("b")).expect("rename onto itself");
    assert_eq!(fs::read(m.path("b")).expect("read"), b"A");

    // Directories: to a new name, over an empty one, not over a non-empty one.
    fs::create_dir_all(m.path("d1/inner")).expect("mkdir");
    fs::write(m.path("d1/inner/f"), b"deep").expect("create");
    fs::rename(m.path("d1"), m.path("d2")).expect("rename a directory");
    assert_eq!(fs::read(m.path("d2/inner/f")).expect("read moved"), b"deep");
    fs::create_dir(m.path("empty")).expect("mkdir empty");
    fs::rename(m.path("d2"), m.path("empty")).expect("rename over an empty dir");
    assert_eq!(fs::read(m.path("empty/inner/f")).expect("read"), b"deep");
    assert_eq!(errno_of(fs::metadata(m.path("d2"))), Some(libc::ENOENT));
    fs::create_dir_all(m.path("full/x")).expect("mkdir full");
    fs::create_dir(m.path("src")).expect("mkdir src");
    let r = fs::rename(m.path("src"), m.path("full"));
    assert!(
        matches!(errno_of(r), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)),
        "rename over a non-empty dir"
    );
    assert!(
        m.path("full/x").is_dir() && m.path("src").is_dir(),
        "refused rename changed things"
    );
    // Kind mismatches.
    assert_eq!(
        errno_of(fs::rename(m.path("b"), m.path("src"))),
        Some(libc::EISDIR)
    );
    assert_eq!(
        errno_of(fs::rename(m.path("src"), m.path("b"))),
        Some(libc::ENOTDIR)
    );
    assert_eq!(
        errno_of(fs::rename(m.path("missing"), m.path("z"))),
        Some(libc::ENOENT)
    );
    assert_eq!(
        errno_of(fs::rename(m.path("b"), m.path("nodir/z"))),
        Some(libc::ENOENT)
    );

    // Never into its own subtree.
    fs::create_dir_all(m.path("top/mid/low")).expect("mkdir -p");
    for dst in ["top/x", "top/mid/x", "top/mid/low/x"] {
        assert_eq!(
            errno_of(fs::rename(m.path("top"), m.path(dst))),
            Some(libc::EINVAL),
            "rename top -> {dst}"
        );
    }
    assert_eq!(
        errno_of(fs::rename(m.path("top/mid"), m.path("top/mid/low/x"))),
        Some(libc::EINVAL)
    );
    assert!(m.path("top/mid/low").is_dir());

    // Across directories: `..` follows, link counts of both parents change.
    fs::create_dir(m.path("p1")).expect("mkdir p1");
    fs::create_dir(m.path("p2")).expect("mkdir p2");
    fs::create_dir(m.path("p1/child")).expect("mkdir child");
    assert_eq!(nlink_of(&m.path("p1")), 3);
    fs::rename(m.path("p1/child"), m.path("p2/child")).expect("move a dir across");
    assert_eq!(nlink_of(&m.path("p1")), 2);
    assert_eq!(nlink_of(&m.path("p2")), 3);
    assert_eq!(ino_of(&m.path("p2/child/..")), ino_of(&m.path("p2")));
    // Moving the lower dir up and out of `top` is fine.
    fs::rename(m.path("top/mid/low"), m.path("low")).expect("move up");
    assert!(m.path("low").is_dir());

    // An open file stays readable through its handle across a rename.
    fs::write(m.path("open"), b"held").expect("create");
    let mut f = File::open(m.path("open")).expect("open");
    fs::rename(m.path("open"), m.path("p2/open-moved")).expect("rename open file");
    let mut s = String::new();
    f.read_to_string(&mut s).expect("read after rename");
    assert_eq!(s, "held");
}

#[test]
fn rename_noreplace_and_exchange() {
    setup!(fs, m, "rename_noreplace_and_exchange");
    let p = |n: &str| s(&m.path(n));
    fs::write(m.path("a"), b"A").expect("create a");
    fs::write(m.path("b"), b"B").expect("create b");
    assert_eq!(
        expect_errno(
            helper(&["renameat2", &p("a"), &p("b"), "noreplace"]),
            "NOREPLACE"
        ),
        libc::EEXIST
    );
    assert_eq!(fs::read(m.path("a")).expect("a"), b"A");
    assert_eq!(fs::read(m.path("b")).expect("b"), b"B");
    ok(
        helper(&["renameat2", &p("a"), &p("c"), "noreplace"]),
        "NOREPLACE to a new name",
    );
    assert_eq!(fs::read(m.path("c")).expect("c"), b"A");
    assert!(!m.path("a").exists());

    // EXCHANGE swaps the two names' inodes.
    let (ib, ic) = (ino_of(&m.path("b")), ino_of(&m.path("c")));
    ok(
        helper(&["renameat2", &p("b"), &p("c"), "exchange"]),
        "EXCHANGE files",
    );
    assert_eq!(fs::read(m.path("b")).expect("b"), b"A");
    assert_eq!(fs::read(m.path("c")).expect("c"), b"B");
    assert_eq!((ino_of(&m.path("b")), ino_of(&m.path("c"))), (ic, ib));
    assert_eq!(
        expect_errno(
            helper(&["renameat2", &p("b"), &p("nope"), "exchange"]),
            "EXCHANGE missing"
        ),
        libc::ENOENT
    );
    assert_eq!(
        expect_errno(
            helper(&["renameat2", &p("b"), &p("c"), "exchange,noreplace"]),
            "both flags"
        ),
        libc::EINVAL
    );

    // A file with a directory, across parents: `..` and link counts follow.
    fs::create_dir(m.path("d1")).expect("mkdir d1");
    fs::create_dir(m.path("d2")).expect("mkdir d2");
    fs::create_dir(m.path("d1/sub")).expect("mkdir sub");
    fs::write(m.path("d1/sub/in"), b"in").expect("create");
    fs::write(m.path("d2/file"), b"F").expect("create");
    ok(
        helper(&["renameat2", &p("d1/sub"), &p("d2/file"), "exchange"]),
        "EXCHANGE dir and file",
    );
    assert!(m.path("d1/sub").is_file());
    assert_eq!(fs::read(m.path("d1/sub")).expect("read"), b"F");
    assert!(m.path("d2/file").is_dir());
    assert_eq!(fs::read(m.path("d2/file/in")).expect("read"), b"in");
    assert_eq!(ino_of(&m.path("d2/file/..")), ino_of(&m.path("d2")));
    assert_eq!(nlink_of(&m.path("d1")), 2);
    assert_eq!(nlink_of(&m.path("d2")), 3);

    // Two non-empty directories.
    fs::create_dir(m.path("x")).expect("mkdir");
    fs::write(m.path("x/fx"), b"x").expect("create");
    fs::create_dir(m.path("y")).expect("mkdir");
    fs::write(m.path("y/fy"), b"y").expect("create");
    ok(
        helper(&["renameat2", &p("x"), &p("y"), "exchange"]),
        "EXCHANGE dirs",
    );
    assert_eq!(sorted_names(&m.path("x")), ["fy"]);
    assert_eq!(sorted_names(&m.path("y")), ["fx"]);
    // Not into its own subtree, even as an exchange.
    assert_eq!(
        expect_errno(
            helper(&["renameat2", &p("d2"), &p("d2/file/in"), "exchange"]),
            "EXCHANGE into own subtree"
        ),
        libc::EINVAL
    );
}

// ---------------------------------------------------------------------------------------
// open, read, write
// ---------------------------------------------------------------------------------------

#[test]
fn open_and_create() {
    setup!(fs, m, "open_and_create");
    let f = m.path("f");
    fs::write(&f, b"keep").expect("create");
    let excl = OpenOptions::new().write(true).create_new(true).open(&f);
    assert_eq!(
        errno_of(excl),
        Some(libc::EEXIST),
        "O_CREAT|O_EXCL on an existing file"
    );
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&f)
        .expect("O_CREAT on existing");
    assert_eq!(
        fs::read(&f).expect("read"),
        b"keep",
        "O_CREAT without O_TRUNC keeps data"
    );
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(m.path("new"))
        .expect("O_EXCL on a new name");
    assert_eq!(mode_of(&m.path("new")), 0o600);
    assert_eq!(errno_of(File::open(m.path("missing"))), Some(libc::ENOENT));
    assert_eq!(
        errno_of(File::create(m.path("nodir/x"))),
        Some(libc::ENOENT)
    );
    assert_eq!(errno_of(File::create(m.path("f/x"))), Some(libc::ENOTDIR));
    fs::create_dir(m.path("d")).expect("mkdir");
    assert_eq!(
        errno_of(OpenOptions::new().write(true).open(m.path("d"))),
        Some(libc::EISDIR)
    );
    assert_eq!(
        expect_errno(helper(&["open", &s(&f), "r,dir"]), "O_DIRECTORY on a file"),
        libc::ENOTDIR
    );
    ok(
        helper(&["open", &s(&m.path("d")), "r,dir"]),
        "O_DIRECTORY on a dir",
    );
    // O_EXCL on a dangling symlink is EEXIST too (the link exists).
    std::os::unix::fs::symlink("nowhere", m.path("dl")).expect("symlink");
    assert_eq!(
        expect_errno(
            helper(&["open", &s(&m.path("dl")), "w,creat,excl"]),
            "O_EXCL symlink"
        ),
        libc::EEXIST
    );
    // O_CREAT through a dangling symlink creates its target.
    ok(
        helper(&["open", &s(&m.path("dl")), "w,creat"]),
        "O_CREAT through a dangling symlink",
    );
    assert!(m.path("nowhere").is_file());
    // O_TRUNC
    ok(helper(&["open", &s(&f), "w,trunc"]), "O_TRUNC");
    assert_eq!(fs::metadata(&f).expect("stat").len(), 0);
    // Many opens of one file at once, all closed.
    let handles: Vec<File> = (0..64).map(|_| File::open(&f).expect("open")).collect();
    drop(handles);
    assert_eq!(fs::metadata(&f).expect("stat").nlink(), 1);
}

#[test]
fn append_from_two_handles() {
    setup!(fs, m, "append_from_two_handles");
    let p = m.path("log");
    fs::write(&p, b"head\n").expect("create");
    let mut h1 = OpenOptions::new().append(true).open(&p).expect("open 1");
    let mut h2 = OpenOptions::new().append(true).open(&p).expect("open 2");
    let mut want = b"head\n".to_vec();
    for i in 0..50 {
        let a = format!("A{i:03}\n");
        let b = format!("B{i:03}-longer\n");
        h1.write_all(a.as_bytes()).expect("append 1");
        h2.write_all(b.as_bytes()).expect("append 2");
        want.extend_from_slice(a.as_bytes());
        want.extend_from_slice(b.as_bytes());
    }
    // A seek does not move O_APPEND writes away from the end.
    h1.seek(SeekFrom::Start(0)).expect("seek");
    h1.write_all(b"tail\n").expect("append after seek");
    want.extend_from_slice(b"tail\n");
    drop((h1, h2));
    assert_eq!(fs::metadata(&p).expect("stat").len(), want.len() as u64);
    assert_same_bytes("appended log", &fs::read(&p).expect("read"), &want);
}

#[test]
fn large_and_unaligned_io() {
    setup!(fs, m, "large_and_unaligned_io");
    const LEN: usize = 8 << 20;
    let data = pattern(LEN, 0x5a);
    let p = m.path("big");
    {
        let mut f = File::create(&p).expect("create");
        for chunk in data.chunks(1_000_003) {
            f.write_all(chunk).expect("write");
        }
        f.sync_all().expect("fsync");
    }
    assert_eq!(fs::metadata(&p).expect("stat").len(), LEN as u64);
    assert_same_bytes("8 MiB file", &fs::read(&p).expect("read"), &data);
    let f = File::open(&p).expect("open");
    for (off, len) in [
        (0, 1),
        (4095, 2),
        (4095, 8194),
        (131_071, 65_537),
        (LEN - 3, 3),
    ] {
        let mut buf = vec![0u8; len];
        f.read_exact_at(&mut buf, off as u64).expect("pread");
        assert_same_bytes(
            &format!("pread {len} at {off}"),
            &buf,
            &data[off..off + len],
        );
    }
    let mut buf = [0u8; 16];
    assert_eq!(
        f.read_at(&mut buf, LEN as u64 + 5).expect("pread past EOF"),
        0
    );
    drop(f);

    // Unaligned overwrites and extensions, checked against a model.
    let q = m.path("model");
    let mut model = pattern(64 * 1024, 9);
    fs::write(&q, &model).expect("create model file");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&q)
        .expect("open");
    let put = |model: &mut Vec<u8>, off: usize, bytes: &[u8]| {
        f.write_all_at(bytes, off as u64).expect("pwrite");
        if model.len() < off + bytes.len() {
            model.resize(off + bytes.len(), 0);
        }
        model[off..off + bytes.len()].copy_from_slice(bytes);
    };
    for (off, len, salt) in [
        (1usize, 3usize, 1u8),
        (4095, 2, 2),
        (4096 + 17, 5000, 3),
        (8191, 3, 4),
        (65_535 - 3, 3, 5),
        (65_536 + 100, 4096, 6), // past EOF: a gap of zeros
        (200_000, 1, 7),
    ] {
        put(&mut model, off, &pattern(len, salt));
    }
    drop(f);
    assert_same_bytes("model file", &fs::read(&q).expect("read"), &model);
}

/// Whole-block overwrites inside EOF (O_DIRECT and buffered) are served on the core, from
/// the request's buffer straight to the device, on both transports; what is read back, the
/// mtime and a remount agree with a model, and writes that allocate or extend still take
/// the waiter path.
#[test]
fn block_aligned_overwrites_are_served_on_the_core() {
    const T: &str = "block_aligned_overwrites_are_served_on_the_core";
    let Some(fs) = TestFs::new_or_skip(T, None) else {
        return;
    };
    for transport in ["uring", "devfuse"] {
        if !common::can_run(T, Some(transport)) {
            continue;
        }
        let m = fs.mount(transport, &[]);
        let p = m.path(&format!("blocks-{transport}"));
        let mut model = pattern(2 * MIB as usize, 3);
        fs::write(&p, &model).expect("write the file");
        let counter = |name: &str| m.stats_json()["counters"][name].as_u64().unwrap_or(0);
        let (on_core, on_waiter) = (
            counter("data_writes_on_core"),
            counter("data_writes_on_waiter"),
        );
        let before = mtime_ns(&p);
        tick();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&p)
            .expect("open O_DIRECT");
        // O_DIRECT wants a page-aligned buffer: take the aligned part of a larger one.
        let mut backing = vec![0u8; (256 << 10) + 4096];
        let at = backing.as_ptr().align_offset(4096);
        let buf = &mut backing[at..at + (256 << 10)];
        // The first WRITE of an open file loads its extent map on a waiter; the others of
        // the same open are served on the core.
        let mut on_core_expected = 0;
        for (i, (off, len)) in [
            (0usize, 4096usize),
            (8192, 65536),
            (MIB as usize - 4096, 256 << 10),
        ]
        .into_iter()
        .enumerate()
        {
            let data = pattern(len, 40 + i as u8);
            buf[..len].copy_from_slice(&data);
            f.write_all_at(&buf[..len], off as u64)
                .expect("O_DIRECT pwrite");
            model[off..off + len].copy_from_slice(&data);
            on_core_expected += u64::from(i > 0);
        }
        drop(f);
        // Buffered whole-block writes reach the daemon as they are (no writeback cache).
        let f = OpenOptions::new().write(true).open(&p).expect("open");
        let data = pattern(8192, 77);
        for off in [3 * 4096, 6 * 4096] {
            f.write_all_at(&data, off as u64).expect("pwrite");
            model[off..off + 8192].copy_from_slice(&data);
        }
        on_core_expected += 1;
        // Extending: allocates and commits, so it is not an overwrite.
        f.write_all_at(&data, 2 * MIB).expect("pwrite past EOF");
        model.extend_from_slice(&data);
        drop(f);
        assert!(
            counter("data_writes_on_core") >= on_core + on_core_expected,
            "{transport}: whole-block overwrites were not served on the core (on the core: \
             {on_core} before, {} after; on a waiter: {on_waiter} before, {} after)",
            counter("data_writes_on_core"),
            counter("data_writes_on_waiter")
        );
        assert!(
            counter("data_writes_on_waiter") > on_waiter,
            "{transport}: extending write"
        );
        assert!(mtime_ns(&p) > before, "{transport}: mtime did not advance");
        assert_same_bytes(transport, &fs::read(&p).expect("read back"), &model);
        m.stop();
        let m = fs.mount(transport, &[]);
        assert_same_bytes(
            &format!("{transport} after remount"),
            &fs::read(m.path(&format!("blocks-{transport}"))).expect("read after remount"),
            &model,
        );
        m.stop();
    }
}

/// Seeded random unaligned reads and writes on a growing file, each read checked against
/// a model. This once caught a READ answered short just after a size-extending WRITE, as if
/// the file ended at an older size (the late bookkeeping of an older commit replaced the
/// open file's attributes); the kernel then shrinks the file to where the read stopped, so
/// the failure message gives the fstat size next to the model's.
#[test]
fn random_unaligned_io_matches_a_model() {
    setup!(fs, m, "random_unaligned_io_matches_a_model");
    let q = m.path("model");
    let mut model = pattern(64 * 1024, 9);
    fs::write(&q, &model).expect("create model file");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&q)
        .expect("open");
    let put = |model: &mut Vec<u8>, off: usize, bytes: &[u8]| {
        f.write_all_at(bytes, off as u64).expect("pwrite");
        if model.len() < off + bytes.len() {
            model.resize(off + bytes.len(), 0);
        }
        model[off..off + bytes.len()].copy_from_slice(bytes);
    };
    // Seeded random small reads and writes.
    let seed = 0xe7cf_5eed_u64;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut history: Vec<String> = Vec::new();
    for step in 0..1000 {
        let off = rng.gen_range(0..(model.len() + 8192).min(1_000_000));
        let len = rng.gen_range(1..9000usize);
        if rng.gen_bool(0.5) {
            put(&mut model, off, &pattern(len, rng.gen()));
            history.push(format!(
                "{step}: write {len} at {off} (model size {})",
                model.len()
            ));
        } else {
            let mut buf = vec![0u8; len];
            let n = f.read_at(&mut buf, off as u64).expect("pread");
            let want_n = model.len().saturating_sub(off).min(len);
            let why = || {
                format!(
                    "pread {len} at {off} (seed {seed:#x}, step {step}): file size {} by fstat, \
                     {} by the model; last operations:\n  {}",
                    f.metadata().map(|m| m.len()).unwrap_or(0),
                    model.len(),
                    history[history.len().saturating_sub(8)..].join("\n  ")
                )
            };
            assert_eq!(n, want_n, "short read: {}", why());
            assert_same_bytes(&why(), &buf[..n], &model[off.min(model.len())..][..n]);
            history.push(format!("{step}: read {len} at {off}"));
        }
    }
    drop(f);
    assert_same_bytes("model file", &fs::read(&q).expect("read"), &model);
}

/// A thread that runs `df` on the mount until dropped (statfs, and df's stat of every
/// mount point).
struct Poller {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Poller {
    fn start(mnt: std::path::PathBuf) -> Poller {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                df_avail(&mnt);
            }
        });
        Poller {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Writes that extend a file, at and past its end, interleaved with stats and reads, while
/// `df` runs on the mount in a loop: the size never goes back and every byte written reads
/// back. (Under such load a stat right after a size-extending pwrite used to return the
/// size from before the write, which the kernel then applied, or a read returned zeros for
/// bytes just written.)
#[test]
fn extending_writes_keep_the_size() {
    setup!(fs, m, "extending_writes_keep_the_size");
    let p = m.path("grow");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .expect("create");
    let _poller = Poller::start(m.mnt.clone());
    let seed = 0x5126_u64;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut model: Vec<u8> = Vec::new();
    for step in 0..800 {
        let len = rng.gen_range(1..6000usize);
        let off = match rng.gen_range(0..3) {
            0 => model.len(),
            1 => model.len() + rng.gen_range(1..5000),
            _ => rng.gen_range(0..model.len() + 1),
        };
        let bytes = pattern(len, rng.gen());
        f.write_all_at(&bytes, off as u64).expect("pwrite");
        if model.len() < off + len {
            model.resize(off + len, 0);
        }
        model[off..off + len].copy_from_slice(&bytes);
        let size = if step % 2 == 0 {
            f.metadata().expect("fstat").len()
        } else {
            fs::metadata(&p).expect("stat").len()
        };
        assert_eq!(
            size,
            model.len() as u64,
            "size after step {step} (pwrite {len} at {off}, seed {seed:#x})"
        );
        if step % 5 == 0 {
            let roff = rng.gen_range(0..model.len());
            let mut buf = vec![0u8; 10_000.min(model.len() - roff)];
            f.read_exact_at(&mut buf, roff as u64).unwrap_or_else(|e| {
                panic!(
                    "pread {} at {roff} after step {step} (seed {seed:#x}): {e}",
                    buf.len()
                )
            });
            assert_same_bytes(
                &format!("pread at {roff} after step {step}"),
                &buf,
                &model[roff..roff + buf.len()],
            );
        }
    }
    drop(f);
    assert_same_bytes("whole file", &fs::read(&p).expect("read"), &model);
}

#[test]
fn sparse_files() {
    setup!(fs, m, "sparse_files");
    let p = m.path("sparse");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .expect("create");
    let at = 10 * MIB;
    f.write_all_at(b"tail", at).expect("write at 10 MiB");
    f.sync_all().expect("fsync");
    let md = fs::metadata(&p).expect("stat");
    assert_eq!(md.len(), at + 4);
    assert!(
        md.blocks() * 512 < MIB,
        "a 10 MiB sparse file with 4 bytes of data uses {} sectors",
        md.blocks()
    );
    let back = fs::read(&p).expect("read");
    if let Some(i) = back[..at as usize].iter().position(|&b| b != 0) {
        panic!("the hole reads {:#x} at byte {i}", back[i]);
    }
    assert_eq!(&back[at as usize..], b"tail");
    // Filling part of the hole allocates only that part.
    f.write_all_at(&pattern(8192, 1), 5 * MIB + 100)
        .expect("write into the hole");
    let md = fs::metadata(&p).expect("stat");
    assert!(
        md.blocks() * 512 < MIB,
        "{} sectors after filling 8 KiB",
        md.blocks()
    );
    let mut buf = vec![0u8; 8192 + 200];
    f.read_exact_at(&mut buf, 5 * MIB)
        .expect("pread around the filled part");
    assert!(buf[..100].iter().all(|&b| b == 0));
    assert_same_bytes("filled part", &buf[100..8292], &pattern(8192, 1));
    assert!(buf[8292..].iter().all(|&b| b == 0));
    // Extending by truncate makes a hole too.
    f.set_len(64 * MIB).expect("extend");
    // (At once: blocks_fresh_after_truncate_up.)
    let mut blocks = 0;
    let sparse = eventually(Duration::from_secs(3), || {
        blocks = fs::metadata(&p).expect("stat").blocks();
        blocks * 512 < MIB
    });
    assert!(
        sparse,
        "{blocks} sectors after extending to 64 MiB by truncate"
    );
    let mut buf = vec![1u8; 4096];
    f.read_exact_at(&mut buf, 40 * MIB)
        .expect("read the new hole");
    assert!(buf.iter().all(|&b| b == 0));
}

#[test]
fn lseek_data_and_hole() {
    setup!(fs, m, "lseek_data_and_hole");
    let p = m.path("f");
    let ps = s(&p);
    {
        let f = File::create(&p).expect("create");
        f.write_all_at(&pattern(4096, 1), 0).expect("write block 0");
        f.write_all_at(&pattern(4096, 2), MIB)
            .expect("write at 1 MiB");
        f.set_len(2 * MIB).expect("size 2 MiB");
        f.sync_all().expect("fsync");
    }
    let seek = |off: u64, whence: &str| -> Result<u64, i32> {
        helper(&["lseek", &ps, &off.to_string(), whence]).map(|v| v.trim().parse().expect("offset"))
    };
    assert_eq!(seek(0, "data"), Ok(0));
    assert_eq!(
        seek(100, "data"),
        Ok(100),
        "inside data SEEK_DATA stays put"
    );
    assert_eq!(seek(0, "hole"), Ok(4096));
    assert_eq!(seek(4096, "data"), Ok(MIB));
    assert_eq!(seek(5000, "data"), Ok(MIB));
    assert_eq!(
        seek(5000, "hole"),
        Ok(5000),
        "inside a hole SEEK_HOLE stays put"
    );
    assert_eq!(seek(MIB, "hole"), Ok(MIB + 4096));
    assert_eq!(
        seek(MIB + 4096, "data"),
        Err(libc::ENXIO),
        "no data after the last extent"
    );
    assert_eq!(seek(2 * MIB - 1, "hole"), Ok(2 * MIB - 1));
    assert_eq!(seek(2 * MIB, "data"), Err(libc::ENXIO), "SEEK_DATA at EOF");
    assert_eq!(seek(2 * MIB, "hole"), Err(libc::ENXIO), "SEEK_HOLE at EOF");
    assert_eq!(
        seek(3 * MIB, "hole"),
        Err(libc::ENXIO),
        "SEEK_HOLE past EOF"
    );
    // A file that ends in data: the only hole is the implicit one at EOF.
    let q = m.path("dense");
    fs::write(&q, pattern(3 * 4096 + 5, 3)).expect("create dense");
    let qs = s(&q);
    assert_eq!(
        helper(&["lseek", &qs, "0", "hole"]).map(|v| v.trim().parse::<u64>().expect("offset")),
        Ok(3 * 4096 + 5)
    );
    // An empty file has neither.
    File::create(m.path("empty")).expect("create empty");
    assert_eq!(
        expect_errno(
            helper(&["lseek", &s(&m.path("empty")), "0", "data"]),
            "empty"
        ),
        libc::ENXIO
    );
}

/// An in-place overwrite's mtime: shown at once, left pending by fdatasync and written by
/// the close (a remount sees it); a time set on the open file after an overwrite stays
/// after its close (`cp -p` sets the times before it closes), which the close's commit
/// of the overwrite's mtime must not undo.
#[test]
fn overwrite_mtime_through_fdatasync_close_and_futimens() {
    let Some(fs) = TestFs::new_or_skip("overwrite_mtime", None) else {
        return;
    };
    let m = fs.mount("auto", &[]);
    let (f, g) = (m.path("f"), m.path("g"));
    fs::write(&f, pattern(3 * 4096, 1)).expect("create f");
    fs::write(&g, pattern(2 * 4096, 2)).expect("create g");
    let m0 = mtime_ns(&f);
    std::thread::sleep(Duration::from_millis(20));
    let h = OpenOptions::new().write(true).open(&f).expect("open f");
    h.write_all_at(b"over", 4096).expect("overwrite f");
    h.sync_data().expect("fdatasync");
    let m1 = mtime_ns(&f);
    assert!(
        m1 > m0,
        "the overwrite's mtime is not shown: {m1:?} after {m0:?}"
    );
    drop(h);
    assert_eq!(mtime_ns(&f), m1, "the close moved the overwrite's mtime");
    let h = OpenOptions::new().write(true).open(&g).expect("open g");
    h.write_all_at(b"again", 0).expect("overwrite g");
    let t = UNIX_EPOCH + Duration::new(1_500_000_000, 5);
    h.set_times(FileTimes::new().set_modified(t))
        .expect("futimens");
    drop(h);
    assert_eq!(mtime_ns(&g), (1_500_000_000, 5), "the close undid futimens");
    m.stop();
    let m = fs.mount("auto", &[]);
    assert_eq!(mtime_ns(&m.path("f")), m1, "f's mtime after a remount");
    assert_eq!(
        mtime_ns(&m.path("g")),
        (1_500_000_000, 5),
        "g's mtime after a remount"
    );
}

#[test]
fn fsync_and_fdatasync() {
    setup!(fs, m, "fsync_and_fdatasync");
    let p = m.path("f");
    let mut f = File::create(&p).expect("create");
    f.write_all(&pattern(100_000, 4)).expect("write");
    f.sync_data().expect("fdatasync");
    f.write_all(b"more").expect("write");
    f.sync_all().expect("fsync");
    f.set_len(50_000).expect("truncate");
    f.sync_all().expect("fsync after truncate");
    drop(f);
    File::open(&p)
        .expect("open ro")
        .sync_all()
        .expect("fsync a read-only handle");
    fs::create_dir(m.path("d")).expect("mkdir");
    fs::write(m.path("d/x"), b"x").expect("create in d");
    File::open(m.path("d"))
        .expect("open dir")
        .sync_all()
        .expect("fsync a directory");
    File::open(&m.mnt)
        .expect("open root")
        .sync_all()
        .expect("fsync the root");
    run_ok(Command::new("sync").arg("-f").arg(&p)); // syncfs(2)
    assert_same_bytes(
        "after syncs",
        &fs::read(&p).expect("read"),
        &pattern(100_000, 4)[..50_000],
    );
}

// ---------------------------------------------------------------------------------------
// readdir
// ---------------------------------------------------------------------------------------

#[test]
fn readdir_300_entries() {
    setup!(fs, m, "readdir_300_entries");
    let d = m.path("d");
    fs::create_dir(&d).expect("mkdir");
    assert!(sorted_names(&d).is_empty(), "a new directory lists nothing");
    let mut want = BTreeMap::new();
    for i in 0..300 {
        let name = format!("entry-{i:03}");
        match i % 10 {
            0 => {
                fs::create_dir(d.join(&name)).expect("mkdir");
                want.insert(name, "dir");
            }
            1 => {
                std::os::unix::fs::symlink("target", d.join(&name)).expect("symlink");
                want.insert(name, "symlink");
            }
            _ => {
                fs::write(d.join(&name), vec![b'x'; i]).expect("create");
                want.insert(name, "file");
            }
        }
    }
    let mut got = BTreeMap::new();
    for e in fs::read_dir(&d).expect("opendir") {
        let e = e.expect("entry");
        let name = e.file_name().to_string_lossy().into_owned();
        let ft = e.file_type().expect("d_type");
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_symlink() {
            "symlink"
        } else if ft.is_file() {
            "file"
        } else {
            "other"
        };
        if kind == "file" {
            let i: usize = name[6..].parse().expect("number");
            assert_eq!(
                e.metadata().expect("entry metadata").len(),
                i as u64,
                "{name} size"
            );
        }
        assert!(
            got.insert(name.clone(), kind).is_none(),
            "{name} listed twice"
        );
    }
    assert_eq!(got, want);
    // `.` and `..` are there for tools that read them.
    let ls = run_ok(Command::new("ls").arg("-a1").arg(&d));
    let names: Vec<&str> = ls.lines().collect();
    assert_eq!(names.len(), 302, "ls -a: {} lines", names.len());
    assert!(names.contains(&".") && names.contains(&".."));
    // After removing a third, the rest.
    for i in (0..300).step_by(3) {
        let name = format!("entry-{i:03}");
        if want[&name] == "dir" {
            fs::remove_dir(d.join(&name)).expect("rmdir");
        } else {
            fs::remove_file(d.join(&name)).expect("unlink");
        }
        want.remove(&name);
    }
    let expected: Vec<String> = want.keys().cloned().collect();
    assert_eq!(sorted_names(&d), expected);
}

#[test]
fn readdir_while_the_directory_changes() {
    setup!(fs, m, "readdir_while_the_directory_changes");
    let d = m.path("d");
    fs::create_dir(&d).expect("mkdir");
    // Long names, so one listing takes many READDIR(PLUS) requests.
    let pad = "p".repeat(60);
    let stable: BTreeSet<String> = (0..300).map(|i| format!("stable-{pad}-{i:03}")).collect();
    let victims: Vec<String> = (0..90).map(|i| format!("victim-{pad}-{i:03}")).collect();
    for n in stable.iter().chain(&victims) {
        File::create(d.join(n)).expect("create");
    }
    let mut seen: Vec<String> = Vec::new();
    let mut created: Vec<String> = Vec::new();
    let mut removed = 0;
    for (i, e) in fs::read_dir(&d).expect("opendir").enumerate() {
        seen.push(e.expect("entry").file_name().to_string_lossy().into_owned());
        if i % 10 == 9 {
            // Remove three victims and add three new names while the listing is open.
            for _ in 0..3 {
                if removed < victims.len() {
                    fs::remove_file(d.join(&victims[removed])).expect("unlink during readdir");
                    removed += 1;
                }
                let n = format!("new-{pad}-{:03}", created.len());
                File::create(d.join(&n)).expect("create during readdir");
                created.push(n);
            }
        }
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &seen {
        *counts.entry(n).or_default() += 1;
    }
    let dups: Vec<_> = counts.iter().filter(|(_, &c)| c > 1).collect();
    assert!(dups.is_empty(), "listed more than once: {dups:?}");
    let missing: Vec<_> = stable
        .iter()
        .filter(|n| !counts.contains_key(n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "unchanged entries missing from the listing: {missing:?}"
    );
    let known: BTreeSet<&String> = stable.iter().chain(&victims).chain(&created).collect();
    let unknown: Vec<_> = seen.iter().filter(|n| !known.contains(n)).collect();
    assert!(unknown.is_empty(), "names that never existed: {unknown:?}");
    assert!(
        removed > 0 && !created.is_empty(),
        "the directory did not change"
    );
    // Afterwards the listing is exact.
    let mut want: Vec<String> = stable.iter().cloned().collect();
    want.extend(victims[removed..].iter().cloned());
    want.extend(created.iter().cloned());
    want.sort();
    assert_eq!(sorted_names(&d), want);
}

// ---------------------------------------------------------------------------------------
// statfs, xattrs, fallocate
// ---------------------------------------------------------------------------------------

fn write_file(p: &Path, len: u64, salt: u8) {
    let mut f = File::create(p).expect("create");
    let chunk = pattern(MIB as usize, salt);
    for _ in 0..len / MIB {
        f.write_all(&chunk).expect("write");
    }
    f.sync_all().expect("fsync");
}

/// Waits until statfs shows at least `want` bytes available again.
fn assert_space_back(mnt: &Path, want: u64, what: &str) {
    let mut last = 0;
    let back = eventually(SPACE_DEADLINE, || {
        last = df_avail(mnt);
        last >= want
    });
    assert!(
        back,
        "{what}: available space stayed at {last}, want at least {want} ({} MiB short) after {SPACE_DEADLINE:?}",
        (want - last) >> 20
    );
}

#[test]
fn statfs_space_comes_back() {
    setup!(fs, m, "statfs_space_comes_back");
    let st = run_ok(
        Command::new("stat")
            .args(["-f", "-c", "%S %b %a %l %T"])
            .arg(&m.mnt),
    );
    let v: Vec<&str> = st.split_whitespace().collect();
    assert_eq!(v[0], "4096", "fragment size: {st}");
    let total: u64 = v[1].parse().expect("blocks");
    assert!(
        total * 4096 <= 1 << 30 && total * 4096 > 900 * MIB,
        "total blocks: {st}"
    );
    assert_eq!(v[3], "255", "name length limit: {st}");

    let avail0 = df_avail(&m.mnt);
    let p = m.path("big");
    write_file(&p, 64 * MIB, 1);
    let avail1 = df_avail(&m.mnt);
    assert!(
        avail0 - avail1 >= 63 * MIB,
        "writing 64 MiB took only {} KiB of the free space",
        (avail0 - avail1) >> 10
    );
    fs::remove_file(&p).expect("unlink");
    assert_space_back(&m.mnt, avail0 - SPACE_SLACK, "after unlink");

    write_file(&p, 32 * MIB, 2);
    assert!(df_avail(&m.mnt) <= avail0 - 31 * MIB);
    OpenOptions::new()
        .write(true)
        .open(&p)
        .expect("open")
        .set_len(0)
        .expect("truncate to 0");
    assert_space_back(&m.mnt, avail0 - SPACE_SLACK, "after truncate to 0");

    write_file(&p, 32 * MIB, 3);
    let before = df_avail(&m.mnt);
    ok(
        helper(&[
            "fallocate",
            &s(&p),
            "3",
            &(8 * MIB).to_string(),
            &(16 * MIB).to_string(),
        ]),
        "punch 16 MiB",
    );
    assert_space_back(
        &m.mnt,
        before + 16 * MIB - SPACE_SLACK,
        "after punching 16 MiB",
    );
    fs::remove_file(&p).expect("unlink");
    assert_space_back(&m.mnt, avail0 - SPACE_SLACK, "after the last unlink");
}

/// `security.selinux` is refused (EOPNOTSUPP) unless the mount has `--selinux-xattr`, so
/// `ls -l` asks for it once per filesystem: a warm `ls -l` of many files sends the daemon
/// about one GETXATTR, not one per file. With the flag the label is stored.
#[test]
fn the_selinux_label_is_refused_and_ls_asks_once() {
    setup!(fs, m, "the_selinux_label_is_refused_and_ls_asks_once");
    let d = m.path("d");
    fs::create_dir(&d).expect("mkdir");
    for i in 0..200 {
        fs::write(d.join(format!("f{i:03}")), b"").expect("create");
    }
    let f = s(&d.join("f000"));
    for (what, r) in [
        ("get", helper(&["getxattr", &f, "security.selinux", "100"])),
        (
            "set",
            helper(&["setxattr", &f, "security.selinux", "l", "0"]),
        ),
        ("remove", helper(&["removexattr", &f, "security.selinux"])),
    ] {
        assert_eq!(expect_errno(r, what), libc::EOPNOTSUPP, "{what}");
    }
    ok(
        helper(&["setxattr", &f, "security.ima", "h", "0"]),
        "other security names are stored",
    );
    let ls = || {
        let out = Command::new("ls")
            .arg("-l")
            .arg(&d)
            .output()
            .expect("run ls");
        assert!(out.status.success(), "ls -l: {out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 201);
    };
    ls();
    let before = common::op_count(&m.stats_json(), "GETXATTR");
    ls();
    let sent = common::op_count(&m.stats_json(), "GETXATTR") - before;
    // One for the label, and none for the ACLs while the kernel keeps them; asked again
    // per file, the label alone would be 200.
    assert!(
        sent < 200,
        "a warm ls -l of 200 files sent {sent} GETXATTRs: the label asked of every file"
    );
    drop(m);

    let m = fs.mount("auto", &["--selinux-xattr"]);
    let f = s(&m.path("d/f000"));
    ok(
        helper(&[
            "setxattr",
            &f,
            "security.selinux",
            "system_u:object_r:etc_t:s0",
            "0",
        ]),
        "set the label with --selinux-xattr",
    );
    assert_eq!(
        helper(&["getxattr", &f, "security.selinux", "100"]),
        Ok("26 system_u:object_r:etc_t:s0".into())
    );
}

#[test]
fn xattrs() {
    setup!(fs, m, "xattrs");
    let f = m.path("f");
    fs::write(&f, b"x").expect("create");
    let fs_ = s(&f);
    let p = fs_.as_str();
    ok(
        helper(&["setxattr", p, "user.a", "alpha", "0"]),
        "set user.a",
    );
    assert_eq!(
        helper(&["getxattr", p, "user.a", "100"]),
        Ok("5 alpha".into())
    );
    assert_eq!(
        helper(&["getxattr", p, "user.a", "0"]),
        Ok("5".into()),
        "size query"
    );
    ok(
        helper(&["setxattr", p, "user.b", "", "create"]),
        "set user.b (empty value)",
    );
    assert_eq!(helper(&["getxattr", p, "user.b", "10"]), Ok("0 ".into()));
    let list = ok(helper(&["listxattr", p, "1000"]), "listxattr");
    let names: BTreeSet<&str> = list
        .split_once(' ')
        .map(|x| x.1)
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .collect();
    assert_eq!(
        names,
        BTreeSet::from(["user.a", "user.b"]),
        "listxattr: {list}"
    );
    assert_eq!(
        helper(&["listxattr", p, "0"]),
        Ok("14".into()),
        "list size query"
    );

    // Flags.
    assert_eq!(
        expect_errno(
            helper(&["setxattr", p, "user.a", "x", "create"]),
            "XATTR_CREATE"
        ),
        libc::EEXIST
    );
    assert_eq!(
        helper(&["getxattr", p, "user.a", "100"]),
        Ok("5 alpha".into())
    );
    assert_eq!(
        expect_errno(
            helper(&["setxattr", p, "user.zz", "x", "replace"]),
            "XATTR_REPLACE"
        ),
        libc::ENODATA
    );
    assert_eq!(
        expect_errno(helper(&["getxattr", p, "user.zz", "100"]), "get missing"),
        libc::ENODATA
    );
    ok(
        helper(&["setxattr", p, "user.a", "beta", "replace"]),
        "XATTR_REPLACE existing",
    );
    assert_eq!(
        helper(&["getxattr", p, "user.a", "100"]),
        Ok("4 beta".into())
    );
    ok(
        helper(&["setxattr", p, "user.a", "gamma!", "0"]),
        "overwrite",
    );
    assert_eq!(
        helper(&["getxattr", p, "user.a", "100"]),
        Ok("6 gamma!".into())
    );

    // Buffers too small.
    assert_eq!(
        expect_errno(helper(&["getxattr", p, "user.a", "2"]), "small get buffer"),
        libc::ERANGE
    );
    assert_eq!(
        expect_errno(helper(&["listxattr", p, "3"]), "small list buffer"),
        libc::ERANGE
    );

    // Size limits: 64 KiB values are fine, more is E2BIG; names over 255 bytes are ERANGE.
    ok(
        helper(&["setxattr_len", p, "user.big", "65536", "0"]),
        "64 KiB value",
    );
    assert_eq!(
        helper(&["getxattr", p, "user.big", "0"]),
        Ok("65536".into())
    );
    let got = ok(helper(&["getxattr", p, "user.big", "65536"]), "get 64 KiB");
    assert!(got.starts_with("65536 ") && got[6..].bytes().all(|b| b == b'v'));
    assert_eq!(
        expect_errno(
            helper(&["setxattr_len", p, "user.huge", "65537", "0"]),
            "64 KiB + 1"
        ),
        libc::E2BIG
    );
    let long_name = format!("user.{}", "n".repeat(251));
    assert_eq!(
        expect_errno(
            helper(&["setxattr", p, &long_name, "v", "0"]),
            "256-byte name"
        ),
        libc::ERANGE
    );
    let max_name = format!("user.{}", "n".repeat(250));
    ok(
        helper(&["setxattr", p, &max_name, "v", "0"]),
        "255-byte name",
    );
    assert_eq!(helper(&["getxattr", p, &max_name, "10"]), Ok("1 v".into()));
    // Names outside the namespaces ext4 knows, and a bare prefix, are refused as ext4
    // refuses them (they used to be stored).
    assert_eq!(
        expect_errno(helper(&["setxattr", p, "foo.bar", "v", "0"]), "foo.bar"),
        libc::EOPNOTSUPP
    );
    assert_eq!(
        expect_errno(helper(&["setxattr", p, "user.", "v", "0"]), "user."),
        libc::EINVAL
    );

    // Remove.
    ok(helper(&["removexattr", p, "user.a"]), "removexattr");
    assert_eq!(
        expect_errno(helper(&["getxattr", p, "user.a", "100"]), "get removed"),
        libc::ENODATA
    );
    assert_eq!(
        expect_errno(helper(&["removexattr", p, "user.a"]), "remove twice"),
        libc::ENODATA
    );
    let list = ok(helper(&["listxattr", p, "1000"]), "listxattr");
    assert!(
        !list.contains("user.a,") && list.contains("user.b"),
        "{list}"
    );

    // On directories, with the trusted namespace (root), and gone with the file.
    let d = s(&m.path("d"));
    fs::create_dir(&d).expect("mkdir");
    ok(
        helper(&["setxattr", &d, "user.dir", "yes", "0"]),
        "xattr on a dir",
    );
    ok(
        helper(&["setxattr", &d, "trusted.t", "root", "0"]),
        "trusted xattr as root",
    );
    assert_eq!(
        helper(&["getxattr", &d, "trusted.t", "10"]),
        Ok("4 root".into())
    );
    assert_eq!(
        expect_errno(
            helper(&["getxattr", &s(&m.path("nope")), "user.a", "10"]),
            "missing file"
        ),
        libc::ENOENT
    );
    fs::remove_file(&f).expect("unlink");
    File::create(&f).expect("recreate");
    assert_eq!(
        helper(&["listxattr", p, "1000"]),
        Ok("0 ".into()),
        "a new file under an old name has no xattrs"
    );
}

#[test]
fn fallocate_and_punch_hole() {
    setup!(fs, m, "fallocate_and_punch_hole");
    let p = m.path("f");
    let ps = s(&p);
    File::create(&p).expect("create");
    let avail0 = df_avail(&m.mnt);
    // Mode 0: allocates and extends.
    ok(
        helper(&["fallocate", &ps, "0", "0", &(8 * MIB).to_string()]),
        "fallocate 8 MiB",
    );
    let md = fs::metadata(&p).expect("stat");
    assert_eq!(md.len(), 8 * MIB, "mode 0 extends the size");
    assert!(
        md.blocks() * 512 >= 8 * MIB,
        "{} sectors after fallocate",
        md.blocks()
    );
    assert!(
        df_avail(&m.mnt) <= avail0 - 8 * MIB + SPACE_SLACK,
        "fallocate took no space"
    );
    let back = fs::read(&p).expect("read");
    assert!(
        back.iter().all(|&b| b == 0),
        "fallocated space reads as zeros"
    );

    // Writing into fallocated space, then punching: unaligned and aligned ranges.
    let data = pattern(MIB as usize, 7);
    OpenOptions::new()
        .write(true)
        .open(&p)
        .expect("open")
        .write_all_at(&data, 0)
        .expect("write 1 MiB");
    let mut model = vec![0u8; (8 * MIB) as usize];
    model[..MIB as usize].copy_from_slice(&data);
    ok(
        helper(&["fallocate", &ps, "3", "1000", "8000"]),
        "punch 1000..9000",
    );
    model[1000..9000].fill(0);
    let avail_before_punch = df_avail(&m.mnt);
    ok(
        helper(&["fallocate", &ps, "3", "262144", "262144"]),
        "punch 256K..512K",
    );
    model[262_144..524_288].fill(0);
    assert_eq!(
        fs::metadata(&p).expect("stat").len(),
        8 * MIB,
        "PUNCH_HOLE|KEEP_SIZE keeps the size"
    );
    // The blocks go back to the free space (st_blocks: punch_hole_reduces_st_blocks).
    assert_space_back(
        &m.mnt,
        avail_before_punch + 256 * 1024 - 4096,
        "after punching 256 KiB",
    );
    assert_same_bytes("after punching", &fs::read(&p).expect("read"), &model);
    let hole =
        helper(&["lseek", &ps, "262144", "hole"]).map(|v| v.trim().parse::<u64>().expect("off"));
    assert_eq!(hole, Ok(262_144), "the punched range is a hole");
    // Punching past EOF keeps the size.
    ok(
        helper(&[
            "fallocate",
            &ps,
            "3",
            &(7 * MIB).to_string(),
            &(4 * MIB).to_string(),
        ]),
        "punch over EOF",
    );
    assert_eq!(fs::metadata(&p).expect("stat").len(), 8 * MIB);

    // KEEP_SIZE preallocates beyond EOF without changing the size.
    let q = m.path("keep");
    let qs = s(&q);
    fs::write(&q, b"abc").expect("create");
    ok(
        helper(&["fallocate", &qs, "1", "0", &(4 * MIB).to_string()]),
        "fallocate KEEP_SIZE",
    );
    assert_eq!(fs::metadata(&q).expect("stat").len(), 3);
    assert_eq!(fs::read(&q).expect("read"), b"abc");
    // The space is taken (st_blocks: fallocate_keep_size_counts_blocks):
    // 8 MiB less the punched 4 KiB, 256 KiB and 1 MiB, plus 4 MiB preallocated.
    let used = 8 * MIB - 4096 - 256 * 1024 - MIB + 4 * MIB;
    let mut avail = 0;
    let taken = eventually(Duration::from_secs(3), || {
        avail = df_avail(&m.mnt);
        avail + used <= avail0 + SPACE_SLACK
    });
    assert!(
        taken,
        "{} KiB in use, want {} KiB",
        (avail0 - avail) >> 10,
        used >> 10
    );
    // Extending into the preallocated range reads zeros.
    OpenOptions::new()
        .write(true)
        .open(&q)
        .expect("open")
        .set_len(2 * MIB)
        .expect("extend into the preallocation");
    let back = fs::read(&q).expect("read");
    assert_eq!(&back[..3], b"abc");
    assert!(
        back[3..].iter().all(|&b| b == 0),
        "preallocated space reads as zeros"
    );
    // Modes etcfs does not do are EOPNOTSUPP (COLLAPSE_RANGE, ZERO_RANGE; PUNCH_HOLE
    // without KEEP_SIZE is refused by the kernel the same way).
    for mode in ["8", "16", "2"] {
        assert_eq!(
            expect_errno(
                helper(&["fallocate", &qs, mode, "0", "4096"]),
                "unsupported mode"
            ),
            libc::EOPNOTSUPP,
            "fallocate mode {mode}"
        );
    }
    fs::remove_file(&p).expect("unlink");
    fs::remove_file(&q).expect("unlink");
    assert_space_back(
        &m.mnt,
        avail0 - SPACE_SLACK,
        "after removing fallocated files",
    );
}

/// Extending a file by truncate allocates nothing, and stat says so at once (the SETATTR
/// reply used to claim the whole new size as allocated).
#[test]
fn blocks_fresh_after_truncate_up() {
    setup!(fs, m, "blocks_fresh_after_truncate_up");
    let p = m.path("f");
    let f = File::create(&p).expect("create");
    f.write_all_at(b"data", 0).expect("write");
    f.sync_all().expect("fsync");
    f.set_len(64 * MIB).expect("extend by truncate");
    let blocks = fs::metadata(&p).expect("stat").blocks();
    assert!(
        blocks * 512 < MIB,
        "stat right after extending a 4-byte file to 64 MiB: {blocks} sectors"
    );
}

/// Punching a hole into a range that was fallocated and then written (closed, not
/// fsync'd) lowers st_blocks at once (it used to stay put for good, while df showed the
/// space back).
#[test]
fn punch_hole_reduces_st_blocks() {
    setup!(fs, m, "punch_hole_reduces_st_blocks");
    let p = m.path("f");
    let ps = s(&p);
    File::create(&p).expect("create");
    ok(
        helper(&["fallocate", &ps, "0", "0", &(8 * MIB).to_string()]),
        "fallocate",
    );
    OpenOptions::new()
        .write(true)
        .open(&p)
        .expect("open")
        .write_all_at(&pattern(MIB as usize, 1), 0)
        .expect("write");
    let before = fs::metadata(&p).expect("stat").blocks();
    ok(
        helper(&["fallocate", &ps, "3", "262144", "262144"]),
        "punch",
    );
    let after = fs::metadata(&p).expect("stat").blocks();
    assert_eq!(
        before - after,
        512,
        "st_blocks right after punching 256 KiB: {before} -> {after}"
    );
}

/// Record size of the EOF-reader tests: a counter and a pattern, never a NUL byte.
const RECORD: usize = 64;

/// One writer appends `RECORD`-byte records to `path` with buffered O_APPEND writes
/// (pausing a little between them, as a logger does) while a reader follows it from its
/// position to EOF, tail -f style (read until 0, sleep, read again), for `run`. Returns
/// the records read and the NUL-filled ones among them (with the first offsets).
fn tail_while_appending(path: &Path, run: Duration) -> (u64, u64, Vec<u64>) {
    File::create(path).expect("create");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (path, stop) = (path.to_path_buf(), stop.clone());
        std::thread::spawn(move || {
            let mut f = OpenOptions::new()
                .append(true)
                .open(&path)
                .expect("open O_APPEND");
            let mut i: u64 = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut rec = format!("{i:010}").into_bytes();
                rec.resize(RECORD - 1, b'A' + (i % 26) as u8);
                rec.push(b'\n');
                f.write_all(&rec).expect("append a record");
                i += 1;
                // A pause lets the reader's GETATTRs in between the writes.
                let t = Instant::now();
                while t.elapsed() < Duration::from_micros(100) {
                    std::hint::spin_loop();
                }
            }
        })
    };
    let mut f = File::open(path).expect("open for reading");
    let mut buf = vec![0u8; 1 << 16];
    let (mut pos, mut bad, mut first) = (0u64, 0u64, Vec::new());
    let end = Instant::now() + run;
    while Instant::now() < end {
        let n = f.read(&mut buf).expect("read");
        if n == 0 {
            std::thread::sleep(Duration::from_micros(20));
            continue;
        }
        for (k, rec) in buf[..n].chunks(RECORD).enumerate() {
            if rec.contains(&0) {
                bad += 1;
                if first.len() < 5 {
                    first.push(pos + (k * RECORD) as u64);
                }
            }
        }
        pos += n as u64;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().expect("writer");
    (pos / RECORD as u64, bad, first)
}

fn assert_tail_reads_only_written_bytes(what: &str, path: &Path) {
    let (records, bad, first) = tail_while_appending(path, Duration::from_secs(6));
    assert!(records > 1000, "{what}: only {records} records read");
    assert_eq!(
        bad, 0,
        "{what}: {bad} of {records} records read at EOF held NUL bytes (first at {first:?})"
    );
}

/// Issue 12 (a tester's report): a reader at EOF saw whole records of NUL bytes while
/// another process appended with buffered O_APPEND writes (1–46 per 30 s; ext4 none), on
/// memfs too. With AUTO_INVAL_DATA the kernel dropped the file's page cache at every
/// GETATTR after a write (its own mtime never moves on a write-through mount), racing with
/// an append that had already put its data in a cached page: the reader re-read that page
/// from the daemon before the WRITE reached it, and the kernel kept the zero-filled tail as
/// data once the WRITE grew the size. memfs reproduced it within seconds (12 to 37 records
/// in 6 s).
#[test]
fn eof_reader_never_sees_unwritten_bytes_memfs() {
    let transport = if common::uring_enabled() {
        "uring"
    } else {
        "devfuse"
    };
    let Some(m) = Daemon::memfs_or_skip("eof_reader_never_sees_unwritten_bytes", transport, &[])
    else {
        return;
    };
    assert_tail_reads_only_written_bytes("memfs", &m.path("log"));
    m.stop();
}

/// [`eof_reader_never_sees_unwritten_bytes_memfs`] on etcfs (real etcd and device).
#[test]
fn eof_reader_never_sees_unwritten_bytes() {
    setup!(fs, m, "eof_reader_never_sees_unwritten_bytes");
    assert_tail_reads_only_written_bytes("etcfs", &m.path("log"));
    m.stop();
}

/// st_blocks of every file in `dir` as `ls -ls` and `du` see it: the listing (which the
/// kernel answers with READDIRPLUS, caching the attributes it returns), then a stat of
/// each entry.
fn listed_blocks(dir: &Path) -> BTreeMap<String, u64> {
    fs::read_dir(dir)
        .expect("readdir")
        .map(|e| {
            let e = e.expect("dirent");
            let md = e.metadata().expect("stat of a listed entry");
            (e.file_name().to_string_lossy().into_owned(), md.blocks())
        })
        .collect()
}

/// Issue 12 (a tester's report): four files of 1 byte at 1 TiB showed 2,147,483,656
/// blocks each (`du` 4.1T on a 2 GiB filesystem; ext4 says 8), and again after a remount.
/// READDIRPLUS answered with st_blocks from the size whenever the blocks were not cached,
/// and the kernel kept that answer for the attribute timeout. Every reply path, open or
/// closed, before and after a remount, and after fallocate, truncate and punch, must count
/// allocated blocks.
#[test]
fn st_blocks_of_sparse_files_in_every_reply() {
    let Some(fs) = TestFs::new_or_skip("st_blocks_of_sparse_files_in_every_reply", None) else {
        return;
    };
    const TIB: u64 = 1 << 40;
    let names = ["f0", "f1", "f2", "f3"];
    let all =
        |b: u64| -> BTreeMap<String, u64> { names.iter().map(|n| (n.to_string(), b)).collect() };
    let stat_each = |m: &Daemon| -> BTreeMap<String, u64> {
        names
            .iter()
            .map(|n| {
                let md = fs::metadata(m.path(n)).expect("stat");
                (n.to_string(), md.blocks())
            })
            .collect()
    };
    let m = fs.mount("auto", &[]);
    // As `dd if=/dev/zero of=f bs=1 count=1 seek=1T`; f0 stays open.
    let mut open = Vec::new();
    for n in names {
        let f = File::create(m.path(n)).expect("create");
        f.write_all_at(&[0], TIB).expect("write 1 byte at 1 TiB");
        if n == "f0" {
            open.push(f);
        }
    }
    assert_eq!(listed_blocks(&m.mnt), all(8), "listed, just written");
    assert_eq!(stat_each(&m), all(8), "stat, just written");
    drop(open);
    m.stop();

    let m = fs.mount("auto", &[]);
    assert_eq!(listed_blocks(&m.mnt), all(8), "listed after a remount");
    assert_eq!(stat_each(&m), all(8), "stat after a remount");
    m.stop();

    // Open (its extent map not loaded: nothing read or written yet) while listed.
    let m = fs.mount("auto", &[]);
    let f0 = File::open(m.path("f0")).expect("open");
    assert_eq!(listed_blocks(&m.mnt), all(8), "listed with f0 open");
    let out = run_ok(
        Command::new("du")
            .arg("-s")
            .arg("--block-size=512")
            .arg(&m.mnt),
    );
    let du: u64 = out
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("du said {out:?}"));
    assert!(du < 4 * 8 + 64, "du -s: {du} sectors for 4 files of 8");
    drop(f0);

    let (p1, p2, p3) = (s(&m.path("f1")), m.path("f2"), s(&m.path("f3")));
    ok(
        helper(&["fallocate", &p1, "1", "0", &MIB.to_string()]),
        "fallocate 1 MiB KEEP_SIZE",
    );
    OpenOptions::new()
        .write(true)
        .open(&p2)
        .expect("open")
        .set_len(MIB)
        .expect("truncate to 1 MiB");
    // The written block made whole inside EOF first: a punch keeps (zeroes) a block
    // that EOF cuts, as it keeps any partly punched block.
    OpenOptions::new()
        .write(true)
        .open(&p3)
        .expect("open")
        .set_len(TIB + 8192)
        .expect("extend");
    ok(
        helper(&["fallocate", &p3, "3", &TIB.to_string(), "4096"]),
        "punch the written block",
    );
    let want: BTreeMap<String, u64> = [("f0", 8), ("f1", 8 + 2048), ("f2", 0), ("f3", 0)]
        .iter()
        .map(|(n, b)| (n.to_string(), *b))
        .collect();
    assert_eq!(stat_each(&m), want, "stat after fallocate, truncate, punch");
    assert_eq!(
        listed_blocks(&m.mnt),
        want,
        "listed after fallocate, truncate, punch"
    );
    m.stop();
    let m = fs.mount("auto", &[]);
    assert_eq!(listed_blocks(&m.mnt), want, "listed after another remount");
    m.stop();
}

/// Blocks preallocated past EOF with FALLOC_FL_KEEP_SIZE count in st_blocks, as on ext4
/// and XFS.
#[test]
fn fallocate_keep_size_counts_blocks() {
    setup!(fs, m, "fallocate_keep_size_counts_blocks");
    let q = m.path("keep");
    fs::write(&q, b"abc").expect("create");
    ok(
        helper(&["fallocate", &s(&q), "1", "0", &(4 * MIB).to_string()]),
        "fallocate KEEP_SIZE",
    );
    let md = fs::metadata(&q).expect("stat");
    assert_eq!(md.len(), 3);
    assert!(
        md.blocks() * 512 >= 4 * MIB,
        "{} sectors after preallocating 4 MiB with KEEP_SIZE",
        md.blocks()
    );
}

#[test]
fn names_longer_than_255_bytes() {
    setup!(fs, m, "names_longer_than_255_bytes");
    let ok_name = "n".repeat(255);
    let long = "n".repeat(256);
    fs::write(m.path(&ok_name), b"x").expect("255-byte name");
    assert_eq!(sorted_names(&m.mnt), std::slice::from_ref(&ok_name));
    let l = m.path(&long);
    assert_eq!(
        errno_of(File::create(&l)),
        Some(libc::ENAMETOOLONG),
        "create"
    );
    assert_eq!(
        errno_of(fs::create_dir(&l)),
        Some(libc::ENAMETOOLONG),
        "mkdir"
    );
    assert_eq!(
        errno_of(fs::metadata(&l)),
        Some(libc::ENAMETOOLONG),
        "lookup"
    );
    assert_eq!(
        errno_of(std::os::unix::fs::symlink("t", &l)),
        Some(libc::ENAMETOOLONG),
        "symlink"
    );
    assert_eq!(
        errno_of(fs::hard_link(m.path(&ok_name), &l)),
        Some(libc::ENAMETOOLONG),
        "link"
    );
    assert_eq!(
        errno_of(fs::rename(m.path(&ok_name), &l)),
        Some(libc::ENAMETOOLONG),
        "rename"
    );
    assert_eq!(
        expect_errno(helper(&["mknod", &s(&l), "fifo", "0", "0"]), "mknod"),
        libc::ENAMETOOLONG
    );
    assert_eq!(sorted_names(&m.mnt), [ok_name], "nothing was created");
}

// ---------------------------------------------------------------------------------------
// Permissions (default_permissions), as user nobody
// ---------------------------------------------------------------------------------------

#[test]
fn permissions_as_another_user() {
    setup!(fs, m, "permissions_as_another_user", &["--allow-other"]);
    // A copy of the helper that user 65534 can run.
    let bin = fs.base.join("helper");
    fs::copy(helper_path(), &bin).expect("copy helper");
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).expect("chmod helper");
    let nobody = |args: &[&str]| helper_as_nobody(&bin, args);
    let p = |n: &str| s(&m.path(n));
    let mk = |name: &str, mode: u32| {
        fs::write(m.path(name), b"root's").expect("create");
        fs::set_permissions(m.path(name), fs::Permissions::from_mode(mode)).expect("chmod");
    };
    let mkdir = |name: &str, mode: u32| {
        fs::create_dir(m.path(name)).expect("mkdir");
        fs::set_permissions(m.path(name), fs::Permissions::from_mode(mode)).expect("chmod");
    };
    mk("ro", 0o644);
    mk("secret", 0o600);
    mk("shared", 0o666);
    mk("suid", 0o4777);
    mkdir("rootdir", 0o755);
    mk("rootdir/f", 0o644);
    mkdir("private", 0o700);
    mk("private/f", 0o644);
    mkdir("pub", 0o777);
    mkdir("sticky", 0o1777);
    mk("sticky/rootfile", 0o666);
    fs::set_permissions(&m.mnt, fs::Permissions::from_mode(0o755)).expect("chmod root");

    let refused = |args: &[&str], errno: i32| {
        assert_eq!(nobody(args), Err(errno), "as nobody: {args:?}");
    };
    // Reading is allowed by 0644, writing is not.
    assert_eq!(nobody(&["open", &p("ro"), "r"]), Ok(String::new()));
    refused(&["open", &p("ro"), "w"], libc::EACCES);
    refused(&["open", &p("ro"), "w,trunc"], libc::EACCES);
    refused(&["truncate", &p("ro"), "0"], libc::EACCES);
    refused(&["open", &p("secret"), "r"], libc::EACCES);
    // Directories: no entry changes without write permission, no lookup without search.
    refused(&["open", &p("rootdir/new"), "w,creat"], libc::EACCES);
    refused(&["unlink", &p("rootdir/f")], libc::EACCES);
    refused(&["mkdir", &p("rootdir/x")], libc::EACCES);
    refused(&["rename", &p("rootdir/f"), &p("pub/stolen")], libc::EACCES);
    refused(&["stat", &p("private/f")], libc::EACCES);
    refused(&["open", &p("private"), "r,dir"], libc::EACCES);
    // Only the owner changes modes, owners and explicit times.
    refused(&["chmod", &p("ro"), "777"], libc::EPERM);
    refused(&["chown", &p("ro"), "65534", "65534"], libc::EPERM);
    refused(&["utimens", &p("shared"), "5.0", "5.0"], libc::EPERM);
    refused(&["utimens", &p("ro"), "now", "now"], libc::EACCES);
    assert_eq!(
        nobody(&["utimens", &p("shared"), "now", "now"]),
        Ok(String::new()),
        "touch with write access"
    );
    refused(&["setxattr", &p("ro"), "user.x", "y", "0"], libc::EACCES);
    assert_eq!(
        mode_of(&m.path("ro")),
        0o644,
        "refused chmod changed the mode"
    );
    assert_eq!(fs::read(m.path("ro")).expect("read"), b"root's");

    // In a world-writable directory the new file belongs to the creator.
    assert_eq!(
        nobody(&["open", &p("pub/mine"), "w,creat"]),
        Ok(String::new())
    );
    let md = fs::metadata(m.path("pub/mine")).expect("stat");
    assert_eq!(
        (md.uid(), md.gid()),
        (65534, 65534),
        "owner of a file created by nobody"
    );
    assert_eq!(
        nobody(&["write", &p("pub/mine"), "hello"]),
        Ok(String::new())
    );
    assert_eq!(nobody(&["chmod", &p("pub/mine"), "600"]), Ok(String::new()));
    assert_eq!(mode_of(&m.path("pub/mine")), 0o600);
    assert_eq!(nobody(&["mkdir", &p("pub/mydir")]), Ok(String::new()));
    assert_eq!(
        nobody(&["chown", &p("pub/mine"), "0", "0"]),
        Err(libc::EPERM)
    );
    // Sticky directory: others' files cannot be removed or renamed away.
    refused(&["unlink", &p("sticky/rootfile")], libc::EPERM);
    refused(
        &["rename", &p("sticky/rootfile"), &p("sticky/x")],
        libc::EPERM,
    );
    assert_eq!(
        nobody(&["open", &p("sticky/own"), "w,creat"]),
        Ok(String::new())
    );
    assert_eq!(nobody(&["unlink", &p("sticky/own")]), Ok(String::new()));
    assert!(m.path("sticky/rootfile").exists());

    // A write by someone else clears setuid.
    assert_eq!(nobody(&["write", &p("suid"), "x"]), Ok(String::new()));
    assert_eq!(
        mode_of(&m.path("suid")) & 0o6000,
        0,
        "setuid survived a write by another user"
    );

    // Root is not bound by permission bits.
    mk("readonly", 0o444);
    OpenOptions::new()
        .write(true)
        .open(m.path("readonly"))
        .expect("root writes a 0444 file");
    drop(m);
}

// ---------------------------------------------------------------------------------------
// Unlinked but open files
// ---------------------------------------------------------------------------------------

#[test]
fn unlinked_open_file_lives_until_close() {
    setup!(fs, m, "unlinked_open_file_lives_until_close");
    let avail0 = df_avail(&m.mnt);
    let p = m.path("victim");
    let data = pattern((16 * MIB) as usize, 5);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .expect("create");
    f.write_all_at(&data, 0).expect("write");
    f.sync_all().expect("fsync");
    let second = File::open(&p).expect("second handle");
    fs::remove_file(&p).expect("unlink while open");
    assert_eq!(errno_of(fs::metadata(&p)), Some(libc::ENOENT));
    assert!(sorted_names(&m.mnt).is_empty());
    assert_eq!(
        f.metadata().expect("fstat").nlink(),
        0,
        "fstat of an unlinked file"
    );
    // Still readable and writable through the handles.
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 0).expect("read unlinked");
    assert_same_bytes("unlinked file", &back, &data);
    f.write_all_at(b"still writable", 16 * MIB)
        .expect("write unlinked");
    f.sync_all().expect("fsync unlinked");
    let mut buf = [0u8; 14];
    second
        .read_exact_at(&mut buf, 16 * MIB)
        .expect("read via the second handle");
    assert_eq!(&buf, b"still writable");
    assert_eq!(
        fs.etcd_key_count("O"),
        1,
        "an open unlinked inode has its orphan record"
    );
    assert!(
        df_avail(&m.mnt) <= avail0 - 15 * MIB,
        "the space of an open unlinked file must stay allocated"
    );
    // The name is free for a new file meanwhile.
    fs::write(&p, b"new").expect("reuse the name");
    fs::remove_file(&p).expect("unlink the new one");
    drop(f);
    // One handle is still open.
    std::thread::sleep(Duration::from_millis(300));
    let mut buf = [0u8; 4];
    second
        .read_exact_at(&mut buf, 0)
        .expect("read after the first close");
    assert_eq!(&buf[..], &data[..4]);
    assert!(
        df_avail(&m.mnt) <= avail0 - 15 * MIB,
        "space freed while a handle is open"
    );
    drop(second);
    assert_space_back(&m.mnt, avail0 - SPACE_SLACK, "after the last close");
    assert!(
        eventually(SPACE_DEADLINE, || fs.etcd_key_count("O") == 0),
        "the orphan record outlived the last close"
    );
}

// ---------------------------------------------------------------------------------------
// ENOSPC
// ---------------------------------------------------------------------------------------

#[test]
fn enospc_when_full() {
    let Some(fs) = TestFs::sized_or_skip("enospc_when_full", None, 64 * MIB) else {
        return;
    };
    let m = fs.mount("auto", &[]);
    let p = m.path("fill");
    let chunk = pattern(MIB as usize, 1);
    let mut f = File::create(&p).expect("create");
    let mut written = 0u64;
    let err = loop {
        match f.write_all(&chunk).and_then(|_| f.sync_data()) {
            Ok(()) => written += MIB,
            Err(e) => break e,
        }
        assert!(
            written <= 64 * MIB,
            "wrote {written} bytes to a 64 MiB device"
        );
    };
    assert_eq!(
        err.raw_os_error(),
        Some(libc::ENOSPC),
        "filling the device: {err}"
    );
    assert!(
        written >= 32 * MIB,
        "ENOSPC after only {written} bytes of 64 MiB"
    );
    drop(f);
    // Everything written before ENOSPC is intact.
    let back = fs::read(&p).expect("read back");
    for (i, c) in back
        .chunks(MIB as usize)
        .take((written / MIB) as usize)
        .enumerate()
    {
        assert_same_bytes(&format!("MiB {i}"), c, &chunk);
    }
    fs::remove_file(&p).expect("unlink");
    // The space is usable again.
    let avail = eventually(SPACE_DEADLINE, || df_avail(&m.mnt) >= written);
    assert!(
        avail,
        "space did not come back after unlinking the full file"
    );
    write_file(&m.path("again"), 16 * MIB, 2);
    assert_same_bytes(
        "after refilling",
        &fs::read(m.path("again")).expect("read")[..MIB as usize],
        &pattern(MIB as usize, 2),
    );
}

// ---------------------------------------------------------------------------------------
// Persistence, mount errors
// ---------------------------------------------------------------------------------------

/// Makes one of everything the tests above check, for the remount and crash tests.
fn populate(m: &Daemon) {
    fs::write(m.path("plain"), pattern(1_000_003, 1)).expect("plain");
    let f = File::create(m.path("sparse")).expect("sparse");
    f.write_all_at(b"end", 10 * MIB).expect("sparse write");
    f.write_all_at(&pattern(5000, 2), 4095).expect("unaligned");
    drop(f);
    fs::write(m.path("owned"), b"owned").expect("owned");
    std::os::unix::fs::chown(m.path("owned"), Some(1234), Some(5678)).expect("chown");
    fs::set_permissions(m.path("owned"), fs::Permissions::from_mode(0o4710)).expect("chmod");
    ok(
        helper(&[
            "utimens",
            &s(&m.path("owned")),
            "1000000000.5",
            "1200000000.7",
        ]),
        "utimens",
    );
    ok(
        helper(&["mknod", &s(&m.path("fifo")), "fifo", "0", "0"]),
        "fifo",
    );
    ok(
        helper(&["mknod", &s(&m.path("sock")), "sock", "0", "0"]),
        "sock",
    );
    ok(
        helper(&["mknod", &s(&m.path("chr")), "chr", "300", "70000"]),
        "chr",
    );
    fs::create_dir_all(m.path("d/e/f")).expect("mkdir -p");
    std::os::unix::fs::symlink("../plain", m.path("d/link")).expect("symlink");
    fs::write(m.path("d/e/f/deep"), b"deep").expect("deep");
    fs::hard_link(m.path("d/e/f/deep"), m.path("hard")).expect("link");
    fs::write(m.path("to-rename"), b"renamed").expect("create");
    fs::rename(m.path("to-rename"), m.path("d/renamed")).expect("rename");
    fs::write(m.path("x1"), b"one").expect("x1");
    fs::write(m.path("x2"), b"two").expect("x2");
    ok(
        helper(&[
            "renameat2",
            &s(&m.path("x1")),
            &s(&m.path("x2")),
            "exchange",
        ]),
        "exchange",
    );
    ok(
        helper(&["setxattr", &s(&m.path("plain")), "user.k", "v1", "0"]),
        "xattr",
    );
    ok(
        helper(&["setxattr", &s(&m.path("d")), "user.dir", "v2", "0"]),
        "dir xattr",
    );
    let pre = m.path("prealloc");
    fs::write(&pre, pattern(3 * MIB as usize, 3)).expect("prealloc");
    ok(
        helper(&["fallocate", &s(&pre), "3", "4096", "1048576"]),
        "punch",
    );
    ok(
        helper(&["fallocate", &s(&pre), "0", "0", &(5 * MIB).to_string()]),
        "fallocate",
    );
    let t = m.path("truncated");
    fs::write(&t, pattern(20_000, 4)).expect("truncated");
    OpenOptions::new()
        .write(true)
        .open(&t)
        .expect("open")
        .set_len(7000)
        .expect("truncate");
    fs::create_dir(m.path("many")).expect("mkdir many");
    for i in 0..40 {
        fs::write(m.path(&format!("many/{i:02}")), format!("{i}")).expect("many");
    }
    fs::remove_file(m.path("many/07")).expect("unlink");
    fs::remove_dir(m.path("d/e/f")).expect_err("rmdir of a non-empty dir");
}

#[test]
fn everything_persists_across_remount() {
    let Some(fs) = TestFs::new_or_skip("everything_persists_across_remount", None) else {
        return;
    };
    let m = fs.mount("auto", &[]);
    populate(&m);
    // What the live mount shows, attributes and times included, is what must come back.
    let before = snapshot(&m.mnt);
    m.stop();
    assert_eq!(
        fs.etcd_key_count("O"),
        0,
        "no orphans after a clean unmount"
    );

    // Remount on the classic transport: same tree, same bytes, same attributes.
    let m = fs.mount("devfuse", &[]);
    let after = snapshot(&m.mnt);
    assert_same_tree("after remount", &before, &after);
    // New data after the remount must not land on blocks that hold old data.
    write_file(&m.path("new-after-remount"), 24 * MIB, 9);
    let mut again = snapshot(&m.mnt);
    again.remove("new-after-remount");
    assert_same_tree("after writing new data", &before, &again);
    m.stop();
    let m = fs.mount("auto", &[]);
    let mut third = snapshot(&m.mnt);
    let new = third
        .remove("new-after-remount")
        .expect("new file persisted");
    assert!(new.contains(&format!("size={}", 24 * MIB)), "{new}");
    assert_same_tree("after a second remount", &before, &third);
    assert_same_bytes(
        "new file",
        &fs::read(m.path("new-after-remount")).expect("read")[..MIB as usize],
        &pattern(MIB as usize, 9),
    );
}

#[test]
fn wrong_device_is_refused() {
    let Some(a) = TestFs::new_or_skip("wrong_device_is_refused", None) else {
        return;
    };
    let Some(b) = TestFs::new_or_skip("wrong_device_is_refused_b", None) else {
        return;
    };
    let mut args = a.mount_args("auto", &[]);
    let dev = args.iter().position(|x| x == "--device").expect("--device") + 1;
    args[dev] = s(&b.image);
    let (success, text, elapsed) = a.mount_expecting_failure(&args);
    assert!(!success, "mounting A's prefix with B's device succeeded");
    assert!(
        text.contains(&a.uuid) && text.contains(&b.uuid),
        "the message must name both filesystems ({} in etcd, {} on the device): {text}",
        a.uuid,
        b.uuid
    );
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    // mkfs refuses a formatted device or prefix without --force.
    let (out, _) = run_bounded(
        Command::new(ETCFS)
            .args(["mkfs", "--etcd", &a.endpoints, "--device"])
            .arg(&a.image)
            .args(["--prefix", &a.prefix]),
        Duration::from_secs(20),
    );
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "mkfs over a filesystem succeeded");
    assert!(text.contains(&a.uuid) && text.contains("--force"), "{text}");
    // And both still mount as themselves.
    drop(a.mount("auto", &[]));
    drop(b.mount("auto", &[]));
}

/// Keys under a prefix that are not leased (every tag of docs/key-schema.md but the
/// session's `M` and `G`, which vanish with its lease).
fn durable_keys(fs: &TestFs) -> u64 {
    ["S", "C", "I", "D", "P", "L", "X", "E", "F", "O", "R"]
        .iter()
        .map(|t| fs.etcd_key_count(t))
        .sum()
}

/// A refused `mount` (prefix not formatted) or a refused `mkfs` (device already
/// formatted) leaves the etcd prefix as it found it: no inode counter `<prefix>/C` (inode
/// numbers are reserved on the first create) and no session (registered only once the
/// filesystem checks pass).
#[test]
fn refused_commands_write_nothing_to_etcd() {
    let Some(endpoints) = common::etcd_or_skip("refused_commands_write_nothing_to_etcd", None)
    else {
        return;
    };
    let blank = TestFs::blank("refused_commands_a", &endpoints, 256 * MIB);
    let (success, _, _) = blank.mount_expecting_failure(&blank.mount_args("auto", &[]));
    assert!(!success);
    let after_mount = durable_keys(&blank);
    // Nor a session (its member key would linger until the lease expires).
    assert_eq!(
        (blank.etcd_key_count("M"), blank.etcd_key_count("G")),
        (0, 0),
        "a refused mount registered a session"
    );
    // mkfs of another new prefix onto a device that already holds a filesystem.
    let Some(formatted) = TestFs::new_or_skip("refused_commands_b", None) else {
        return;
    };
    let fresh = TestFs::blank("refused_commands_c", &endpoints, MIB);
    let (out, _) = run_bounded(
        Command::new(ETCFS)
            .args(["mkfs", "--etcd", &endpoints, "--device"])
            .arg(&formatted.image)
            .args(["--prefix", &fresh.prefix]),
        Duration::from_secs(20),
    );
    assert!(
        !out.status.success(),
        "mkfs onto a formatted device succeeded"
    );
    let after_mkfs = durable_keys(&fresh);
    assert_eq!(
        (after_mount, after_mkfs),
        (0, 0),
        "durable keys left under an unformatted prefix by (a refused mount, a refused mkfs)"
    );
}

#[test]
fn unformatted_device_is_refused() {
    let Some(endpoints) = common::etcd_or_skip("unformatted_device_is_refused", None) else {
        return;
    };
    let blank = TestFs::blank("unformatted_device_is_refused", &endpoints, 256 * MIB);
    let (success, text, elapsed) = blank.mount_expecting_failure(&blank.mount_args("auto", &[]));
    assert!(!success);
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    assert!(
        text.contains("mkfs") && (text.contains(&blank.prefix) || text.contains(&s(&blank.image))),
        "the message must say what is not formatted and how to format it: {text}"
    );
    // A formatted prefix with a blank device.
    let Some(formatted) = TestFs::new_or_skip("unformatted_device_is_refused_b", None) else {
        return;
    };
    let mut args = formatted.mount_args("auto", &[]);
    let dev = args.iter().position(|x| x == "--device").expect("--device") + 1;
    args[dev] = s(&blank.image);
    let (success, text, _) = formatted.mount_expecting_failure(&args);
    assert!(!success);
    assert!(
        text.contains(&s(&blank.image)) && text.contains("not formatted"),
        "the message must name the unformatted device: {text}"
    );
}

#[test]
fn unreachable_etcd_fails_within_5s() {
    let Some(fs) = TestFs::new_or_skip("unreachable_etcd_fails_within_5s", None) else {
        return;
    };
    // Nothing listens on port 1; the listener below accepts connections and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind a silent listener");
    let silent_url = format!("http://{}", silent.local_addr().expect("addr"));
    for url in ["http://127.0.0.1:1".to_string(), silent_url] {
        let mut args = fs.mount_args("auto", &[]);
        args[1] = url.clone();
        let (success, text, elapsed) = fs.mount_expecting_failure(&args);
        assert!(!success, "mount with etcd at {url} succeeded");
        assert!(
            elapsed < Duration::from_millis(5500),
            "mount with etcd at {url} took {elapsed:?} to fail"
        );
        assert!(
            text.contains("etcd") && text.contains(&url),
            "message for {url}: {text}"
        );
        let start = Instant::now();
        let (out, _) = run_bounded(
            Command::new(ETCFS)
                .args(["mkfs", "--etcd", &url, "--device"])
                .arg(&fs.image)
                .args(["--prefix", &fs.prefix, "--force"]),
            Duration::from_secs(20),
        );
        assert!(!out.status.success(), "mkfs with etcd at {url} succeeded");
        assert!(
            start.elapsed() < Duration::from_millis(5500),
            "mkfs with etcd at {url} took {:?}",
            start.elapsed()
        );
    }
    // The failed mkfs --force attempts must not have touched the real filesystem.
    drop(fs.mount("auto", &[]));
}

// ---------------------------------------------------------------------------------------
// The core operations on both transports
// ---------------------------------------------------------------------------------------

fn core_operations(transport: &str) {
    let test = format!("core_operations_{transport}");
    let Some(fs) = TestFs::new_or_skip(&test, Some(transport)) else {
        return;
    };
    let m = fs.mount(transport, &[]);
    let data = pattern(3 * MIB as usize + 17, 8);
    fs::write(m.path("a"), &data).expect("create and write");
    assert_same_bytes("read back", &fs::read(m.path("a")).expect("read"), &data);
    let f = File::open(m.path("a")).expect("open");
    let mut buf = vec![0u8; 10_000];
    f.read_exact_at(&mut buf, 1_048_570).expect("pread");
    assert_same_bytes("pread", &buf, &data[1_048_570..1_058_570]);
    drop(f);
    fs::create_dir(m.path("d")).expect("mkdir");
    fs::rename(m.path("a"), m.path("d/b")).expect("rename");
    fs::write(m.path("c"), b"c").expect("create c");
    fs::rename(m.path("c"), m.path("d/b")).expect("rename over");
    assert_eq!(fs::read(m.path("d/b")).expect("read"), b"c");
    std::os::unix::fs::symlink("b", m.path("d/l")).expect("symlink");
    assert_eq!(fs::read(m.path("d/l")).expect("read via link"), b"c");
    assert_eq!(sorted_names(&m.path("d")), ["b", "l"]);
    fs::remove_file(m.path("d/b")).expect("unlink");
    fs::remove_file(m.path("d/l")).expect("unlink");
    fs::remove_dir(m.path("d")).expect("rmdir");
    assert!(sorted_names(&m.mnt).is_empty());
    assert_eq!(errno_of(fs::metadata(m.path("a"))), Some(libc::ENOENT));
}

#[test]
fn core_operations_uring() {
    core_operations("uring");
}

#[test]
fn core_operations_devfuse() {
    core_operations("devfuse");
}

/// Write-behind (an allocating write's extents commit at close, fsync or within about a
/// second): appends read back before close through another fd; a truncate and a punch by
/// another process right after appends, while the writer keeps the file open; an unlink
/// while appends are pending gives the space back at close.
#[test]
fn appends_then_truncate_punch_and_unlink_while_open() {
    setup!(fs, m, "appends_then_truncate_punch_unlink");
    let p = m.path("f");
    let ps = s(&p);
    let avail0 = df_avail(&m.mnt);
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .expect("create");
    let data = pattern(3 * MIB as usize + 100, 3);
    for c in data.chunks(64 * 1024 + 7) {
        f.write_all(c).expect("append");
    }
    assert_eq!(fs::metadata(&p).expect("stat").len(), data.len() as u64);
    assert_same_bytes("appends before close", &fs::read(&p).expect("read"), &data);
    let mut model = data.clone();
    run_ok(Command::new("truncate").args(["-s", "2000000", &ps]));
    model.truncate(2_000_000);
    assert_same_bytes(
        "truncated right after appends",
        &fs::read(&p).expect("read"),
        &model,
    );
    let more = pattern(MIB as usize, 9);
    f.write_all_at(&more, 2_000_000)
        .expect("append after truncate");
    model.extend_from_slice(&more);
    ok(
        helper(&["fallocate", &ps, "3", "1000000", "1500000"]),
        "punch right after appends",
    );
    model[1_000_000..2_500_000].fill(0);
    assert_eq!(fs::metadata(&p).expect("stat").len(), model.len() as u64);
    assert_same_bytes("after the punch", &fs::read(&p).expect("read"), &model);
    f.write_all_at(&pattern(4 * MIB as usize, 5), model.len() as u64)
        .expect("append before unlink");
    fs::remove_file(&p).expect("unlink while appends are pending");
    drop(f);
    assert_space_back(&m.mnt, avail0 - SPACE_SLACK, "unlink with appends pending");
}

/// Deep I/O from one CPU is served by more than one worker: with `--ring-share-above 1`,
/// the busy queue moves to the other worker (the kernel then hands it requests made on the
/// first CPU). Sixteen threads pinned to one CPU overwrite and read back their own blocks
/// with O_DIRECT while that happens; every read, and the file after a remount, match a
/// model. Once the threads stop, the queue comes home: one thread's synchronous reads from
/// that CPU are served there again.
#[test]
fn deep_io_from_one_cpu_is_shared_between_workers() {
    const T: &str = "deep_io_from_one_cpu_is_shared_between_workers";
    const THREADS: usize = 16;
    const BLOCKS: usize = 512;
    const ROUNDS: usize = 6;
    let Some((fs, cpus)) = uring_fs_on_two_cpus(T) else {
        return;
    };
    let m = fs.mount("uring", &["--ring-share-above", "1"]);
    let p = m.path("deep");
    fs::write(&p, pattern(BLOCKS * 4096, 5)).expect("write the file");
    let block = |t: usize, round: usize, b: usize| pattern(4096, (t * 31 + round * 7 + b) as u8);
    let cpu = cpus[0];
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let p = &p;
            s.spawn(move || {
                uring::cpu::pin_current_thread(cpu).expect("pin to one CPU");
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(p)
                    .expect("open O_DIRECT");
                let mut backing = vec![0u8; 2 * 4096];
                let buf = block_aligned(&mut backing, 4096);
                for round in 0..ROUNDS {
                    for b in (t..BLOCKS).step_by(THREADS) {
                        buf.copy_from_slice(&block(t, round, b));
                        f.write_all_at(buf, (b * 4096) as u64).expect("pwrite");
                    }
                    for b in (t..BLOCKS).step_by(THREADS) {
                        f.read_exact_at(buf, (b * 4096) as u64).expect("pread");
                        assert!(
                            buf[..] == block(t, round, b)[..],
                            "thread {t} round {round}: block {b} reads back wrong"
                        );
                    }
                }
            });
        }
    });
    let mut model = Vec::with_capacity(BLOCKS * 4096);
    for b in 0..BLOCKS {
        model.extend_from_slice(&block(b % THREADS, ROUNDS - 1, b));
    }
    assert_same_bytes("after the threads", &fs::read(&p).expect("read"), &model);
    // Quiet again: the queue comes home after its quiet spell, so one thread's synchronous
    // reads on the same CPU are served by that CPU's worker (the daemon runs one worker
    // per allowed CPU, in order, so `cpu`'s is the first).
    std::thread::sleep(Duration::from_millis(50));
    let served = |m: &common::Daemon| -> Vec<u64> {
        m.stats_json()["requests_per_core"]
            .as_array()
            .expect("requests_per_core")
            .iter()
            .map(|n| n.as_u64().unwrap_or(0))
            .collect()
    };
    let before = served(&m);
    std::thread::scope(|s| {
        s.spawn(|| {
            uring::cpu::pin_current_thread(cpu).expect("pin to one CPU");
            let f = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&p)
                .expect("open O_DIRECT");
            let mut backing = vec![0u8; 2 * 4096];
            let buf = block_aligned(&mut backing, 4096);
            for b in 0..BLOCKS {
                f.read_exact_at(buf, (b * 4096) as u64).expect("pread");
                assert!(buf[..] == model[b * 4096..(b + 1) * 4096], "block {b}");
            }
        });
    });
    let after = served(&m);
    let total: u64 = after.iter().sum::<u64>() - before.iter().sum::<u64>();
    let at_home = after[0] - before[0];
    assert!(
        at_home * 10 >= total * 9,
        "{at_home} of {total} quiet requests served on their own CPU's worker \
         (per worker before {before:?}, after {after:?})"
    );
    assert_counter_moved_then_remount(&fs, m, "ring_entries_passed", "deep", &model);
}

/// The filesystem of test `t` and the CPUs it may use, when the ring transport is there
/// and there are two CPUs for its workers; `None` (the test skips, saying why) otherwise.
fn uring_fs_on_two_cpus(t: &str) -> Option<(TestFs, Vec<usize>)> {
    let fs = TestFs::new_or_skip(t, None)?;
    if !common::can_run(t, Some("uring")) {
        return None;
    }
    let cpus = uring::cpu::allowed_cpus().expect("allowed CPUs");
    if cpus.len() < 2 {
        println!("SKIP: {t}: needs two CPUs");
        return None;
    }
    Some((fs, cpus))
}

/// The first `len` bytes of `backing` that start on a 4 KiB boundary, for O_DIRECT
/// (`backing` needs 4 KiB of room beyond `len`).
fn block_aligned(backing: &mut [u8], len: usize) -> &mut [u8] {
    let at = backing.as_ptr().align_offset(4096);
    &mut backing[at..at + len]
}

/// Asserts that the transport counter `counter` of mount `m` moved, then remounts and
/// checks that `file` still reads back as `model`.
fn assert_counter_moved_then_remount(
    fs: &TestFs,
    m: common::Daemon,
    counter: &str,
    file: &str,
    model: &[u8],
) {
    let moved = m.stats_json()["counters"][counter].as_u64().unwrap_or(0);
    assert!(
        moved > 0,
        "{counter} stayed 0: {}",
        m.stats_json()["counters"]
    );
    m.stop();
    let m = fs.mount("uring", &[]);
    assert_same_bytes(
        "after remount",
        &fs::read(m.path(file)).expect("read after remount"),
        model,
    );
    m.stop();
}

/// The pieces of large O_DIRECT writes are spread over the workers: the kernel sends a
/// 1 MiB write as two 512 KiB WRITEs at once, and a worker that took both passes one entry
/// on, so that later pieces are copied by two workers in parallel. Two threads, each pinned
/// to its own CPU, write alternate 1 MiB slots of one file at the same time: overwrites of
/// laid-out space, then appends that extend the file past each other's holes. Every piece
/// lands where it belongs, before and after a remount.
#[test]
fn large_write_pieces_are_spread_between_workers() {
    const T: &str = "large_write_pieces_are_spread_between_workers";
    const MIB: usize = 1 << 20;
    const WRITES: usize = 32;
    let Some((fs, cpus)) = uring_fs_on_two_cpus(T) else {
        return;
    };
    let m = fs.mount("uring", &[]);
    let p = m.path("pieces");
    fs::write(&p, pattern(WRITES / 2 * MIB, 1)).expect("lay out the first half");
    let chunk = |i: usize| pattern(MIB, (i * 13 + 2) as u8);
    std::thread::scope(|s| {
        for (t, &cpu) in cpus.iter().take(2).enumerate() {
            let p = &p;
            s.spawn(move || {
                uring::cpu::pin_current_thread(cpu).expect("pin to one CPU");
                let f = OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(p)
                    .expect("open O_DIRECT");
                let mut backing = vec![0u8; MIB + 4096];
                let buf = block_aligned(&mut backing, MIB);
                for i in (t..WRITES).step_by(2) {
                    buf.copy_from_slice(&chunk(i));
                    f.write_all_at(buf, (i * MIB) as u64)
                        .expect("1 MiB O_DIRECT pwrite");
                }
            });
        }
    });
    let model: Vec<u8> = (0..WRITES).flat_map(chunk).collect();
    assert_same_bytes("after the writes", &fs::read(&p).expect("read"), &model);
    // A worker that served the other CPU's pieces spins for the next ones before sleeping.
    let counters = m.stats_json()["counters"].clone();
    let lingers: u64 = ["ring_linger_hits", "ring_linger_misses"]
        .iter()
        .map(|k| counters[k].as_u64().unwrap_or(0))
        .sum();
    assert!(lingers > 0, "no worker lingered: {counters}");
    assert_counter_moved_then_remount(&fs, m, "ring_write_pieces_spread", "pieces", &model);
}
