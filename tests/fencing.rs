//! A node that only looks dead: frozen (SIGSTOP) past its lease, or cut off from etcd for
//! longer than its lease. On real mounts of the real binary with a real etcd, nodes with
//! `--lease-ttl 4` (the fence shuts 1 s before the lease can expire).
//!
//! What must hold (README, "When a node fails"): nothing the node had in flight or cached
//! reaches the device or etcd once its lease may have ended; another node's writes after
//! that are intact; the node rejoins by itself with a new session and works; files it had
//! open before keep answering EIO.

mod common;

use std::{
    fs::{self, File, OpenOptions},
    io::Read as _,
    os::unix::fs::{FileExt as _, OpenOptionsExt as _},
    path::Path,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use common::{can_run, errno_of, signal, wait_bounded, Daemon, EtcdCluster, TestFs};

const TTL: &str = "4";
/// Longer than the lease, with room for etcd to notice it expired.
const PAST_THE_LEASE: Duration = Duration::from_secs(7);
const MIB: usize = 1 << 20;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(29).wrapping_add((i % 253) as u8))
        .collect()
}

/// 4 KiB-aligned, for O_DIRECT.
fn aligned(len: usize) -> Vec<u8> {
    // A Vec<u8> has no alignment guarantee; over-allocate and let the caller slice.
    vec![0u8; len + 4096]
}

fn aligned_slice(v: &mut [u8], len: usize) -> &mut [u8] {
    let off = v.as_ptr().align_offset(4096);
    &mut v[off..off + len]
}

/// Reads the whole file with O_DIRECT: what the device holds, not a page cache.
fn read_direct(p: &Path, len: usize) -> Vec<u8> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(p)
        .unwrap_or_else(|e| panic!("open {} O_DIRECT: {e}", p.display()));
    let mut buf = aligned(len);
    let b = aligned_slice(&mut buf, len);
    f.read_exact_at(b, 0).expect("direct read");
    b.to_vec()
}

fn write_file(p: &Path, data: &[u8]) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(p)
        .unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
    f.write_all_at(data, 0).expect("write");
    f.sync_all().expect("fsync");
}

/// Waits until the node serves again: a new file can be created and written.
fn wait_rejoined(d: &Daemon, name: &str, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let r = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(d.path(name))
            .and_then(|f| {
                f.write_all_at(b"back", 0)?;
                f.sync_all()
            });
        match r {
            Ok(()) => return start.elapsed(),
            Err(_) if start.elapsed() < within => thread::sleep(Duration::from_millis(200)),
            Err(e) => panic!(
                "the node did not serve again within {within:?} ({e}):\n{}",
                d.log_text()
            ),
        }
    }
}

/// Stops and continues a daemon through a shell started beforehand: once threads of this
/// process wait on a stopped FUSE daemon, starting a new process from here can hang (a
/// `kill` spawned then never ran until the daemon was continued by hand). Continues the
/// daemon when dropped, so that a failing test never leaves it stopped.
struct Freezer {
    sh: Child,
    stdin: std::process::ChildStdin,
    pid: u32,
}

impl Freezer {
    fn new(pid: u32) -> Freezer {
        let mut sh = Command::new("sh")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn sh");
        let stdin = sh.stdin.take().expect("sh stdin");
        Freezer { sh, stdin, pid }
    }

    fn command(&mut self, line: &str) {
        use std::io::Write as _;
        writeln!(self.stdin, "{line}").expect("command the shell");
        self.stdin.flush().expect("flush");
    }

    fn send(&mut self, sig: &str) {
        self.command(&format!("kill -s {sig} {}", self.pid));
    }

    fn state(&self) -> char {
        fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .ok()
            .and_then(|s| s.rsplit(") ").next().and_then(|r| r.chars().next()))
            .unwrap_or('?')
    }

    /// SIGSTOP, and waits until the daemon is stopped.
    fn freeze(&mut self) {
        self.send("STOP");
        let start = Instant::now();
        while self.state() != 'T' {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "the daemon stopped"
            );
            thread::sleep(Duration::from_millis(5));
        }
    }

    fn thaw(&mut self) {
        self.send("CONT");
        let start = Instant::now();
        while self.state() == 'T' && start.elapsed() < Duration::from_secs(5) {
            thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Freezer {
    fn drop(&mut self) {
        self.thaw();
        self.command("exit 0");
        if wait_bounded(&mut self.sh, Duration::from_secs(5)).is_none() {
            signal(&mut self.sh, "KILL");
            let _ = wait_bounded(&mut self.sh, Duration::from_secs(5));
        }
    }
}

#[test]
fn a_frozen_node_never_writes_after_its_lease_and_rejoins() {
    let Some(fs) = TestFs::new_or_skip("frozen_node", None) else {
        return;
    };
    let a = fs.mount_node("a", "auto", &["--lease-ttl", TTL]);
    let b = fs.mount_node("b", "auto", &["--lease-ttl", TTL]);
    let (pa, pb) = (a.path("f"), b.path("f"));
    let first = pattern(1, MIB);
    write_file(&pa, &first);
    // Everything this thread needs while A is stopped is made before (see `Freezer`).
    let mut freezer = Freezer::new(a.pid());
    let second = pattern(2, MIB);

    // A keeps writing through two open files: O_DIRECT and buffered overwrites.
    let stop = Arc::new(AtomicBool::new(false));
    let (eio, ok) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let writers: Vec<_> = [true, false]
        .into_iter()
        .map(|direct| {
            let (stop, eio, ok, pa) = (stop.clone(), eio.clone(), ok.clone(), pa.clone());
            thread::spawn(move || {
                let mut o = OpenOptions::new();
                o.read(true).write(true);
                if direct {
                    o.custom_flags(libc::O_DIRECT);
                }
                let f = o.open(&pa).expect("open on A");
                let mut buf = aligned(64 << 10);
                let b = aligned_slice(&mut buf, 64 << 10);
                b.fill(if direct { b'X' } else { b'Y' });
                let mut i = 0u64;
                while !stop.load(Ordering::Acquire) {
                    let off = (i << 16) % MIB as u64;
                    i += 1;
                    match f.write_all_at(b, off) {
                        Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                        Err(e) if e.raw_os_error() == Some(libc::EIO) => {
                            eio.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(e) => panic!("write on A: {e}"),
                    };
                }
                // The file was opened under the old session: it stays broken.
                errno_of(f.sync_all())
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(300));
    assert!(ok.load(Ordering::Relaxed) > 0, "A was writing");
    freezer.freeze();
    thread::sleep(PAST_THE_LEASE);

    // B takes the file over: A's lock went with its lease.
    let t = Instant::now();
    write_file(&pb, &second);
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "B waited {took:?} for the lock of a node whose lease had ended"
    );

    freezer.thaw();
    thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Release);
    let fsyncs: Vec<Option<i32>> = writers
        .into_iter()
        .map(|w| w.join().expect("writer thread"))
        .collect();
    assert!(
        eio.load(Ordering::Relaxed) > 0,
        "A's writers got EIO after waking"
    );
    assert!(
        fsyncs.iter().all(|e| *e == Some(libc::EIO)),
        "fsync of a file opened before the fence: {fsyncs:?}"
    );

    // Nothing A had in flight or cached reached the device: the file is B's, byte for byte,
    // now and a moment later.
    assert!(read_direct(&pb, MIB) == second, "B's data is intact");
    thread::sleep(Duration::from_secs(1));
    assert!(read_direct(&pb, MIB) == second, "B's data is still intact");

    // A serves again, with B's data, and its writes reach B.
    let back = wait_rejoined(&a, "after", Duration::from_secs(20));
    eprintln!("A served again {back:?} after waking");
    let mut seen = Vec::new();
    File::open(&pa)
        .expect("open on A after rejoining")
        .read_to_end(&mut seen)
        .expect("read on A");
    assert!(seen == second, "A reads what B wrote while it was frozen");
    let third = pattern(3, 4096);
    let f = OpenOptions::new().write(true).open(&pa).expect("open on A");
    f.write_all_at(&third, 0)
        .expect("write on A after rejoining");
    let mut got = vec![0u8; 4096];
    File::open(&pb)
        .expect("open on B")
        .read_exact_at(&mut got, 0)
        .expect("read on B");
    assert!(got == third, "B reads A's write after A rejoined");
    let counters = &a.stats_json()["counters"];
    assert_eq!(counters["session_fences"].as_u64(), Some(1), "{counters}");
    assert_eq!(
        counters["session_fenced_now"].as_u64(),
        Some(0),
        "{counters}"
    );
    let log = a.log_text();
    for step in [
        "fenced:",
        "rejoin: registered session",
        "rejoin: serving again",
    ] {
        assert!(log.contains(step), "A's log shows {step:?}:\n{log}");
    }
}

#[test]
fn a_node_cut_off_from_etcd_past_its_lease_fences_itself_and_rejoins() {
    let test = "etcd_outage";
    if !can_run(test, None) || !EtcdCluster::available() {
        common::skip(test, "needs root, FUSE and the etcd binary");
        return;
    }
    let mut etcd = EtcdCluster::start(test, 1);
    let mut fs = TestFs::blank(test, &etcd.endpoints(), 256 << 20);
    fs.mkfs();
    let a = fs.mount_node("a", "auto", &["--lease-ttl", TTL]);
    let p = a.path("f");
    let data = pattern(5, MIB);
    write_file(&p, &data);
    let old = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .expect("open before the outage");

    etcd.stop(0);
    thread::sleep(PAST_THE_LEASE);
    // Fenced: a write on the open file fails, and so does its fsync.
    let w = old.write_all_at(b"late", 0);
    assert_eq!(
        errno_of(w),
        Some(libc::EIO),
        "a write after the fence:\n{}",
        a.log_text()
    );
    etcd.run(0);
    let back = wait_rejoined(&a, "g", Duration::from_secs(30));
    eprintln!("served again {back:?} after etcd came back");
    // Files opened before keep failing; a new open sees every fsync'd byte.
    let mut buf = [0u8; 4];
    assert_eq!(errno_of(old.read_exact_at(&mut buf, 0)), Some(libc::EIO));
    assert_eq!(errno_of(old.sync_all()), Some(libc::EIO));
    assert!(read_direct(&p, MIB) == data, "what was fsync'd is there");
    let f = OpenOptions::new().write(true).open(&p).expect("open again");
    f.write_all_at(b"new!", 0).expect("write after rejoining");
    f.sync_all().expect("fsync after rejoining");
    let mut got = [0u8; 4];
    File::open(&p)
        .expect("open")
        .read_exact_at(&mut got, 0)
        .expect("read");
    assert_eq!(&got, b"new!");
    drop(old);
    drop(f);
    let log = a.log_text();
    for step in ["fenced:", "rejoin: serving again"] {
        assert!(log.contains(step), "the log shows {step:?}:\n{log}");
    }
    drop(a);
    drop(fs);
}

/// `etcfs evict` of a live node: the node gives its session up (stops device I/O, drops
/// what it held, revokes its own lease), the other node takes its file over, the node's
/// old handles answer EIO and it serves again under a new session.
#[test]
fn an_evicted_node_gives_up_its_session_and_rejoins() {
    let Some(fs) = TestFs::new_or_skip("evict_live", None) else {
        return;
    };
    let a = fs.mount_node("a", "auto", &["--lease-ttl", TTL]);
    let b = fs.mount_node("b", "auto", &["--lease-ttl", TTL]);
    let data = pattern(7, MIB);
    write_file(&a.path("f"), &data);
    let old = OpenOptions::new()
        .read(true)
        .write(true)
        .open(a.path("f"))
        .expect("open on A");
    old.write_all_at(&data[..4096], 0).expect("A writes");
    let cluster = |args: &[&str]| {
        let (out, in_time) = common::run_bounded(
            Command::new(common::ETCFS).args(args).args([
                "--etcd",
                &fs.endpoints,
                "--prefix",
                &fs.prefix,
            ]),
            Duration::from_secs(30),
        );
        assert!(in_time, "etcfs {args:?} took too long");
        out
    };
    let status: serde_json::Value =
        serde_json::from_slice(&cluster(&["status", "--json"]).stdout).expect("status --json");
    let session = status["nodes"]
        .as_array()
        .and_then(|n| n.iter().find(|n| n["pid"] == a.pid()))
        .and_then(|n| n["session"].as_str())
        .expect("A in status")
        .to_owned();
    let t = Instant::now();
    let out = cluster(&["evict", &session]);
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "evict: {text}\n{}", a.log_text());
    assert!(text.contains("gave its session up"), "{text}");
    eprintln!("evicted in {:?}", t.elapsed());

    // B takes the file over and sees A's writes; A's old handle is broken for good.
    assert!(read_direct(&b.path("f"), MIB) == data);
    write_file(&b.path("f"), &pattern(8, MIB));
    assert_eq!(errno_of(old.write_all_at(b"late", 0)), Some(libc::EIO));
    assert!(read_direct(&b.path("f"), MIB) == pattern(8, MIB));
    wait_rejoined(&a, "again", Duration::from_secs(20));
    let log = a.log_text();
    for step in [
        "evicted:",
        "fenced:",
        "rejoin: the old session",
        "rejoin: serving again",
    ] {
        assert!(log.contains(step), "A's log shows {step:?}:\n{log}");
    }
}
