//! Mount tests: the `etcfs` binary serving its in-memory filesystem on a real FUSE mount,
//! on both transports.
//!
//! They need root and `/dev/fuse`, and the `uring` ones need
//! `/sys/module/fuse/parameters/enable_uring` = `Y`. Without them each test prints a `SKIP:`
//! line on stderr (not captured by the harness) and passes, unless
//! `ETCFS_REQUIRE_MOUNT_TESTS=1` is set, as CI does, which turns a skip into a failure.
//!
//! Every mount is owned by a [`Mounted`] guard whose `Drop` stops the daemon it started (by
//! its pid), unmounts what is left and removes the temporary directory, so a failing test
//! leaves nothing behind.

mod common;

use std::{
    fs::{self, File, OpenOptions},
    io::{self, Read as _, Write as _},
    os::unix::fs::FileExt as _,
    path::Path,
    process::Command,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use common::{
    can_run, errno_of, helper, is_mounted, lazy_umount, loud, mount_count, op_count, pattern,
    run_bounded, sorted_names, temp_base, unescape_mountinfo, Daemon, DAEMON_DEADLINE, ETCFS,
};

/// A memfs mount (see `common::Daemon`).
type Mounted = Daemon;

/// How long load threads may take to return once the mount is gone and they are told to stop.
const LOAD_DEADLINE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// Load generator for the shutdown tests
// ---------------------------------------------------------------------------------------

const LOAD_THREADS: usize = 4;
const LOAD_FILE_SIZE: u64 = 256 * 1024;

/// Threads that stat, read and write files of a mount in a loop until told to stop. Errors
/// (the mount going away) are counted, never fatal.
struct Load {
    stop: Arc<AtomicBool>,
    ops: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    fn start(m: &Mounted) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(AtomicU64::new(0));
        let mut threads = Vec::new();
        for i in 0..LOAD_THREADS {
            let path = m.path(&format!("load{i}"));
            let f = File::create(&path).expect("create load file");
            f.set_len(LOAD_FILE_SIZE).expect("size load file");
            drop(f);
            let (stop, ops, errors) = (stop.clone(), ops.clone(), errors.clone());
            threads.push(thread::spawn(move || {
                load_loop(&path, i as u64, &stop, &ops, &errors)
            }));
        }
        Load {
            stop,
            ops,
            errors,
            threads,
        }
    }

    /// Waits until the threads have done `n` operations (so requests are surely flowing).
    fn wait_ops(&self, n: u64) {
        let start = Instant::now();
        while self.ops.load(Ordering::Relaxed) < n {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "load made only {} ops in 10 s ({} errors)",
                self.ops.load(Ordering::Relaxed),
                self.errors.load(Ordering::Relaxed)
            );
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Tells the threads to stop and joins them; panics if any is still running (stuck in a
    /// syscall on the mount) after [`LOAD_DEADLINE`].
    fn stop_and_join(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::SeqCst);
        let start = Instant::now();
        while !self.threads.iter().all(|t| t.is_finished()) {
            let stuck = self.threads.iter().filter(|t| !t.is_finished()).count();
            assert!(
                start.elapsed() < LOAD_DEADLINE,
                "{stuck} load thread(s) still blocked {LOAD_DEADLINE:?} after the mount went away"
            );
            thread::sleep(Duration::from_millis(10));
        }
        for t in self.threads.drain(..) {
            t.join().expect("load thread panicked");
        }
        (
            self.ops.load(Ordering::SeqCst),
            self.errors.load(Ordering::SeqCst),
        )
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn load_loop(path: &Path, seed: u64, stop: &AtomicBool, ops: &AtomicU64, errors: &AtomicU64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut buf = vec![0u8; 4096];
    let blocks = LOAD_FILE_SIZE / 4096;
    while !stop.load(Ordering::Relaxed) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let off = (x % blocks) * 4096;
        let r: io::Result<()> = match x % 3 {
            0 => fs::metadata(path).map(drop),
            1 => File::open(path)
                .and_then(|f| f.read_at(&mut buf, off))
                .map(drop),
            // No O_CREAT: once the mount is gone this must not create files underneath.
            _ => OpenOptions::new()
                .write(true)
                .open(path)
                .and_then(|f| f.write_all_at(&buf, off)),
        };
        ops.fetch_add(1, Ordering::Relaxed);
        if r.is_err() {
            errors.fetch_add(1, Ordering::Relaxed);
            thread::sleep(Duration::from_millis(1));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Helpers for file checks
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// Behaviours, each run on both transports
// ---------------------------------------------------------------------------------------

macro_rules! on_both_transports {
    ($($name:ident),* $(,)?) => {
        mod uring {
            $( #[test] fn $name() { super::$name("uring") } )*
        }
        mod devfuse {
            $( #[test] fn $name() { super::$name("devfuse") } )*
        }
    };
}

on_both_transports!(
    small_files_round_trip,
    large_file_with_pattern,
    readdir_unlink_rename,
    directories,
    append_and_truncate,
    stats_report_ops,
    unmount_with_requests_in_flight,
    lazy_unmount_with_open_file,
    sigterm_under_load,
);

fn small_files_round_trip(transport: &str) {
    let Some(m) = Daemon::memfs_or_skip("small_files_round_trip", transport, &[]) else {
        return;
    };
    let root = fs::metadata(&m.mnt).expect("stat the root");
    assert!(root.is_dir());

    let a = m.path("a.txt");
    fs::write(&a, b"hello etcfs\n").expect("create and write");
    assert_eq!(fs::read(&a).expect("read back"), b"hello etcfs\n");
    assert_eq!(fs::metadata(&a).expect("stat").len(), 12);
    assert!(fs::metadata(&a).expect("stat").is_file());

    // A second open sees what the first one wrote, while the first is still open.
    let b = m.path("b.txt");
    let mut first = File::create(&b).expect("create b");
    first
        .write_all(b"written by the first open")
        .expect("write b");
    let mut second = File::open(&b).expect("second open");
    let mut seen = String::new();
    second
        .read_to_string(&mut seen)
        .expect("read via the second open");
    assert_eq!(seen, "written by the first open");
    // And an overwrite in place through the first is visible through the second.
    first.write_all_at(b"WRITTEN", 0).expect("pwrite");
    let mut head = [0u8; 7];
    second.read_exact_at(&mut head, 0).expect("pread");
    assert_eq!(&head, b"WRITTEN");
    drop(first);
    drop(second);
    assert_eq!(fs::metadata(&b).expect("stat b").len(), 25);

    // Empty files exist and have size 0; a missing name is ENOENT.
    File::create(m.path("empty")).expect("create empty");
    assert_eq!(fs::metadata(m.path("empty")).expect("stat empty").len(), 0);
    assert_eq!(
        errno_of(fs::metadata(m.path("missing"))),
        Some(libc::ENOENT)
    );
    assert_eq!(errno_of(File::open(m.path("missing"))), Some(libc::ENOENT));
    // O_EXCL on an existing name is EEXIST.
    let excl = OpenOptions::new().write(true).create_new(true).open(&a);
    assert_eq!(errno_of(excl), Some(libc::EEXIST));
}

fn large_file_with_pattern(transport: &str) {
    let Some(m) = Daemon::memfs_or_skip("large_file_with_pattern", transport, &[]) else {
        return;
    };
    const LEN: usize = 3 * 1024 * 1024;
    let data = pattern(LEN, 0x5a);
    let p = m.path("big.bin");
    {
        let mut f = File::create(&p).expect("create big");
        // Uneven chunks, so writes straddle pages and the kernel's request size.
        for chunk in data.chunks(300_001) {
            f.write_all(chunk).expect("write big");
        }
        f.sync_all().expect("fsync big");
    }
    assert_eq!(fs::metadata(&p).expect("stat big").len(), LEN as u64);
    let back = fs::read(&p).expect("read big");
    assert_eq!(back.len(), LEN);
    if let Some(i) = (0..LEN).find(|&i| back[i] != data[i]) {
        panic!("3 MiB file differs first at byte {i}");
    }
    // Reads at odd offsets across block boundaries.
    let f = File::open(&p).expect("open big");
    for off in [0usize, 4095, 131_071, 1_048_577, LEN - 10] {
        let mut buf = vec![0u8; 10.min(LEN - off)];
        f.read_exact_at(&mut buf, off as u64).expect("pread big");
        assert_eq!(buf, data[off..off + buf.len()], "at offset {off}");
    }
    // Reading past the end returns nothing.
    let mut buf = [0u8; 16];
    assert_eq!(
        f.read_at(&mut buf, LEN as u64 + 100)
            .expect("pread past EOF"),
        0
    );
}

fn readdir_unlink_rename(transport: &str) {
    let Some(m) = Daemon::memfs_or_skip("readdir_unlink_rename", transport, &[]) else {
        return;
    };
    let names: Vec<String> = (0..40).map(|i| format!("file-{i:02}")).collect();
    for (i, n) in names.iter().enumerate() {
        fs::write(m.path(n), format!("content {i}")).expect("create");
    }
    assert_eq!(sorted_names(&m.mnt), names);

    // unlink
    fs::remove_file(m.path("file-07")).expect("unlink");
    assert_eq!(
        errno_of(fs::metadata(m.path("file-07"))),
        Some(libc::ENOENT)
    );
    assert_eq!(
        errno_of(fs::remove_file(m.path("file-07"))),
        Some(libc::ENOENT)
    );
    let listed = sorted_names(&m.mnt);
    assert_eq!(listed.len(), 39);
    assert!(!listed.iter().any(|n| n == "file-07"));

    // rename to a new name
    fs::rename(m.path("file-01"), m.path("renamed")).expect("rename");
    assert_eq!(
        errno_of(fs::metadata(m.path("file-01"))),
        Some(libc::ENOENT)
    );
    assert_eq!(
        fs::read_to_string(m.path("renamed")).expect("read renamed"),
        "content 1"
    );

    // rename over an existing file replaces it
    fs::rename(m.path("file-02"), m.path("file-03")).expect("rename over existing");
    assert_eq!(
        fs::read_to_string(m.path("file-03")).expect("read target"),
        "content 2"
    );
    assert_eq!(
        errno_of(fs::metadata(m.path("file-02"))),
        Some(libc::ENOENT)
    );
    let listed = sorted_names(&m.mnt);
    assert_eq!(listed.len(), 38, "{listed:?}");
    assert!(listed.contains(&"renamed".to_string()));
    assert!(!listed.iter().any(|n| n == "file-01" || n == "file-02"));

    // rename into a directory
    fs::create_dir(m.path("sub")).expect("mkdir");
    fs::rename(m.path("file-04"), m.path("sub/moved")).expect("rename into dir");
    assert_eq!(
        fs::read_to_string(m.path("sub/moved")).expect("read moved"),
        "content 4"
    );
    assert_eq!(sorted_names(&m.path("sub")), vec!["moved".to_string()]);

    // an open file survives its unlink
    let p = m.path("file-05");
    let f = File::open(&p).expect("open");
    fs::remove_file(&p).expect("unlink open file");
    let mut s = String::new();
    (&f).read_to_string(&mut s)
        .expect("read unlinked open file");
    assert_eq!(s, "content 5");
}

fn directories(transport: &str) {
    let Some(m) = Daemon::memfs_or_skip("directories", transport, &[]) else {
        return;
    };
    let d = m.path("dir");
    fs::create_dir(&d).expect("mkdir");
    assert!(fs::metadata(&d).expect("stat dir").is_dir());
    assert_eq!(errno_of(fs::create_dir(&d)), Some(libc::EEXIST));
    assert!(sorted_names(&d).is_empty());

    fs::write(d.join("f"), b"x").expect("create in dir");
    assert_eq!(errno_of(fs::remove_dir(&d)), Some(libc::ENOTEMPTY));
    assert!(d.join("f").exists(), "a failed rmdir must change nothing");
    fs::remove_file(d.join("f")).expect("unlink in dir");
    fs::remove_dir(&d).expect("rmdir empty dir");
    assert_eq!(errno_of(fs::metadata(&d)), Some(libc::ENOENT));

    // Nested directories, and rmdir of a file / unlink of a directory are refused.
    fs::create_dir_all(m.path("a/b/c")).expect("mkdir -p");
    fs::write(m.path("a/b/c/leaf"), b"leaf").expect("create nested");
    assert_eq!(
        fs::read(m.path("a/b/c/leaf")).expect("read nested"),
        b"leaf"
    );
    assert_eq!(
        errno_of(fs::remove_dir(m.path("a/b/c/leaf"))),
        Some(libc::ENOTDIR)
    );
    let unlink_dir = errno_of(fs::remove_file(m.path("a/b")));
    assert!(
        matches!(unlink_dir, Some(libc::EISDIR) | Some(libc::EPERM)),
        "{unlink_dir:?}"
    );
    assert_eq!(errno_of(fs::remove_dir(m.path("a"))), Some(libc::ENOTEMPTY));
    fs::rename(m.path("a/b"), m.path("b2")).expect("rename a directory");
    assert_eq!(
        fs::read(m.path("b2/c/leaf")).expect("read after dir rename"),
        b"leaf"
    );
    assert_eq!(
        sorted_names(&m.mnt),
        vec!["a".to_string(), "b2".to_string()]
    );
    fs::remove_dir(m.path("a")).expect("rmdir emptied dir");
}

fn append_and_truncate(transport: &str) {
    let Some(m) = Daemon::memfs_or_skip("append_and_truncate", transport, &[]) else {
        return;
    };
    let p = m.path("log");
    fs::write(&p, b"first").expect("create");
    for part in [&b"+second"[..], b"+third"] {
        let mut f = OpenOptions::new()
            .append(true)
            .open(&p)
            .expect("open O_APPEND");
        f.write_all(part).expect("append");
    }
    assert_eq!(fs::read(&p).expect("read"), b"first+second+third");
    // O_APPEND writes go to the end even after a seek to 0.
    {
        let mut f = OpenOptions::new()
            .append(true)
            .open(&p)
            .expect("open O_APPEND");
        use std::io::Seek as _;
        f.seek(io::SeekFrom::Start(0)).expect("seek");
        f.write_all(b"!").expect("append after seek");
    }
    assert_eq!(fs::read(&p).expect("read"), b"first+second+third!");

    // truncate shorter, longer (zero-filled), and O_TRUNC
    let f = OpenOptions::new().write(true).open(&p).expect("open");
    f.set_len(5).expect("truncate down");
    assert_eq!(fs::metadata(&p).expect("stat").len(), 5);
    assert_eq!(fs::read(&p).expect("read"), b"first");
    f.set_len(8192 + 3).expect("truncate up");
    drop(f);
    assert_eq!(fs::metadata(&p).expect("stat").len(), 8195);
    let back = fs::read(&p).expect("read");
    assert_eq!(&back[..5], b"first");
    assert!(
        back[5..].iter().all(|&b| b == 0),
        "bytes past the old end must read as zeros"
    );

    // truncate(2) by path, down into the middle of a page with data after it
    let q = m.path("q");
    fs::write(&q, pattern(10_000, 1)).expect("create q");
    assert_eq!(
        helper(&["truncate", &q.to_string_lossy(), "4100"]),
        Ok(String::new()),
        "truncate(2) by path"
    );
    assert_eq!(fs::read(&q).expect("read q"), pattern(10_000, 1)[..4100]);

    File::create(&p).expect("O_TRUNC open");
    assert_eq!(fs::metadata(&p).expect("stat").len(), 0);
    assert!(fs::read(&p).expect("read").is_empty());
}

fn stats_report_ops(transport: &str) {
    let timeouts = ["--perf", "--attr-timeout", "0", "--entry-timeout", "0"];
    let Some(m) = Daemon::memfs_or_skip("stats_report_ops", transport, &timeouts) else {
        return;
    };
    for i in 0..5 {
        let p = m.path(&format!("s{i}"));
        fs::write(&p, vec![b'z'; 5000]).expect("write");
        for _ in 0..3 {
            fs::metadata(&p).expect("stat");
        }
        assert_eq!(fs::read(&p).expect("read").len(), 5000);
    }
    let stats = m.stats_json();
    let lookups = op_count(&stats, "LOOKUP");
    let getattrs = op_count(&stats, "GETATTR") + op_count(&stats, "STATX");
    let writes = op_count(&stats, "WRITE");
    assert!(
        lookups > 0 && getattrs > 0 && writes > 0,
        "LOOKUP {lookups} GETATTR/STATX {getattrs} WRITE {writes}: {stats}"
    );
    for op in stats["ops"].as_array().expect("ops") {
        if op["count"].as_u64().unwrap_or(0) > 0 {
            for key in ["p50_us", "p99_us", "max_us"] {
                assert!(
                    op[key].is_number(),
                    "with --perf, {key} of {} must be a number: {op}",
                    op["op"]
                );
            }
        }
    }
    let per_core = stats["requests_per_core"]
        .as_array()
        .expect("requests_per_core");
    let total: u64 = per_core.iter().filter_map(|v| v.as_u64()).sum();
    assert!(
        total >= lookups + writes,
        "requests_per_core sums to {total}: {stats}"
    );

    // The text form works too.
    let (out, _) = run_bounded(
        Command::new(ETCFS).arg("stats").arg(&m.mnt),
        Duration::from_secs(10),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("LOOKUP"),
        "etcfs stats (text): {text}"
    );
}

fn unmount_with_requests_in_flight(transport: &str) {
    let Some(mut m) = Daemon::memfs_or_skip("unmount_with_requests_in_flight", transport, &[])
    else {
        return;
    };
    let load = Load::start(&m);
    load.wait_ops(2000);
    let out = lazy_umount(&m.mnt);
    assert!(
        out.status.success(),
        "umount -l: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The daemon must notice while the load keeps knocking on the (now bare) path.
    let status = m.expect_exit("umount -l");
    assert!(
        status.success(),
        "the daemon exited with {status} after umount:\n{}",
        m.log_text()
    );
    assert!(
        !is_mounted(&m.mnt),
        "still in mountinfo after the daemon exited"
    );
    let (ops, errors) = load.stop_and_join();
    assert!(ops > 0);
    loud(&format!(
        "{transport}::unmount_with_requests_in_flight: {ops} ops, {errors} failed"
    ));
}

fn sigterm_under_load(transport: &str) {
    let Some(mut m) = Daemon::memfs_or_skip("sigterm_under_load", transport, &[]) else {
        return;
    };
    let load = Load::start(&m);
    // One more thread keeps a file open across the shutdown, so the daemon cannot unmount
    // cleanly and must still leave no caller hanging.
    let held = File::open(m.path("load0")).expect("open a file to hold");
    let stop_held = load.stop.clone();
    let held_ops = Arc::new(AtomicU64::new(0));
    let held_count = held_ops.clone();
    let holder = thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while !stop_held.load(Ordering::Relaxed) {
            if held.read_at(&mut buf, 0).is_err() {
                thread::sleep(Duration::from_millis(1));
            }
            held_count.fetch_add(1, Ordering::Relaxed);
        }
    });
    load.wait_ops(2000);
    m.signal("TERM");
    let status = m.expect_exit("SIGTERM");
    assert!(
        status.success(),
        "the daemon exited with {status} after SIGTERM:\n{}",
        m.log_text()
    );
    assert!(
        !is_mounted(&m.mnt),
        "still in mountinfo after the daemon exited on SIGTERM"
    );
    let (ops, errors) = load.stop_and_join();
    let start = Instant::now();
    while !holder.is_finished() {
        assert!(
            start.elapsed() < LOAD_DEADLINE,
            "a reader of a held-open file hangs after SIGTERM"
        );
        thread::sleep(Duration::from_millis(10));
    }
    holder.join().expect("holder thread");
    assert!(held_ops.load(Ordering::SeqCst) > 0);
    assert!(ops > 0);
    loud(&format!(
        "{transport}::sigterm_under_load: {ops} ops, {errors} failed"
    ));
}

fn lazy_unmount_with_open_file(transport: &str) {
    let Some(mut m) = Daemon::memfs_or_skip("lazy_unmount_with_open_file", transport, &[]) else {
        return;
    };
    fs::write(m.path("kept"), b"still readable").expect("create");
    let f = File::open(m.path("kept")).expect("open");
    let out = lazy_umount(&m.mnt);
    assert!(
        out.status.success(),
        "umount -l: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!is_mounted(&m.mnt));
    // Detached but alive: the open file is still served until it is closed.
    let mut buf = [0u8; 14];
    f.read_exact_at(&mut buf, 0)
        .expect("read a file held open across umount -l");
    assert_eq!(&buf, b"still readable");
    assert!(
        matches!(m.child().try_wait(), Ok(None)),
        "the daemon quit while a file was still open"
    );
    drop(f);
    let status = m.expect_exit("umount -l and closing the last open file");
    assert!(
        status.success(),
        "the daemon exited with {status}:\n{}",
        m.log_text()
    );
}

// ---------------------------------------------------------------------------------------
// Mount errors
// ---------------------------------------------------------------------------------------

#[test]
fn mount_on_missing_directory_fails() {
    if !can_run("mount_on_missing_directory_fails", None) {
        return;
    }
    let base = temp_base("missing");
    let missing = base.join("does-not-exist-here");
    for foreground in [true, false] {
        let mut cmd = common::memfs_mount_command(foreground, &base.join("daemon.log"));
        let (out, in_time) = run_bounded(cmd.arg(&missing), DAEMON_DEADLINE);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            in_time,
            "etcfs mount on a missing dir hung (foreground={foreground})"
        );
        assert!(
            !out.status.success(),
            "mount on a missing dir succeeded (foreground={foreground})"
        );
        assert!(
            stderr.contains("does not exist"),
            "foreground={foreground}: stderr: {stderr}"
        );
        assert!(!missing.exists());
    }
    let _ = fs::remove_dir_all(&base);
}

#[test]
fn mount_on_mounted_directory_fails() {
    if !can_run("mount_on_mounted_directory_fails", None) {
        return;
    }
    let m = Daemon::memfs("busy", "devfuse", &[]);
    let (out, in_time) = run_bounded(
        Command::new(ETCFS)
            .args(["mount", "--memfs", "--foreground", "--transport", "devfuse"])
            .arg(&m.mnt),
        DAEMON_DEADLINE,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(in_time, "a second etcfs mount on a mount point hung");
    assert!(
        !out.status.success(),
        "a second mount on a mount point succeeded"
    );
    assert!(stderr.contains("already a mount point"), "stderr: {stderr}");
    assert_eq!(
        mount_count(&m.mnt),
        1,
        "the failed mount must leave exactly the first mount"
    );
    // The first mount still works.
    fs::write(m.path("still-here"), b"ok").expect("write to the first mount");
    assert_eq!(fs::read(m.path("still-here")).expect("read"), b"ok");
}

#[test]
fn mountinfo_unescape() {
    assert_eq!(unescape_mountinfo(r"/tmp/a\040b"), "/tmp/a b");
    assert_eq!(unescape_mountinfo(r"/tmp/plain"), "/tmp/plain");
    assert_eq!(unescape_mountinfo(r"/x\\"), r"/x\\");
}
