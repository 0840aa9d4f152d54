//! etcd failing under a mounted filesystem: a three-member etcd on loopback, every member
//! given to the mount, the real binary on a real image.
//!
//! What must hold (README, "Running etcd"): killing the leader under load reaches no
//! application (commits whose answers were lost are decided, reads retried); with a
//! majority down, operations that need etcd fail with EIO within seconds, never hang,
//! while what the node holds cached keeps working; once the majority is back, operations
//! succeed again without a remount.

mod common;

use std::{
    fs::{self, File},
    io::{Read as _, Write as _},
    os::unix::fs::{FileExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc, OnceLock,
    },
    thread,
    time::{Duration, Instant},
};

use common::{can_run, digest, errno_of, next_id, run_bounded, run_ok, EtcdCluster, TestFs, ETCFS};

fn content(i: usize) -> Vec<u8> {
    (0..16 * 1024).map(|j| ((i * 31 + j) % 251) as u8).collect()
}

/// Creates, writes, fsyncs and renames files until told to stop; returns the files that
/// must exist, the errors seen and the longest single step.
fn workload(dir: PathBuf, stop: Arc<AtomicBool>) -> (Vec<usize>, Vec<String>, Duration) {
    let (mut kept, mut errors, mut longest) = (Vec::new(), Vec::new(), Duration::ZERO);
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let tmp = dir.join(format!("w{i}.tmp"));
        let step = (|| -> std::io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(&content(i))?;
            f.sync_all()?;
            fs::rename(&tmp, dir.join(format!("w{i}")))?;
            if i % 7 == 6 {
                fs::remove_file(dir.join(format!("w{}", i - 3)))?;
            }
            fs::metadata(dir.join(format!("w{i}")))?;
            Ok(())
        })();
        longest = longest.max(t.elapsed());
        match step {
            Ok(()) => {
                kept.push(i);
                if i % 7 == 6 {
                    kept.retain(|&k| k != i - 3);
                }
            }
            Err(e) => errors.push(format!("step {i}: {e}")),
        }
        i += 1;
    }
    (kept, errors, longest)
}

fn check_files(dir: &Path, kept: &[usize]) {
    for &i in kept {
        let mut got = Vec::new();
        File::open(dir.join(format!("w{i}")))
            .and_then(|mut f| f.read_to_end(&mut got))
            .unwrap_or_else(|e| panic!("w{i}: {e}"));
        assert!(got == content(i), "w{i} has the wrong content");
    }
}

/// A private etcd of `members` (with `extra` flags) and a formatted filesystem on it, after
/// the prerequisite checks (`None`: skipped).
fn cluster_fs(test: &str, members: usize, extra: &[&str]) -> Option<(EtcdCluster, TestFs)> {
    if !can_run(test, None) || !EtcdCluster::available() {
        common::skip(test, "needs root, FUSE and the etcd binary");
        return None;
    }
    let etcd = EtcdCluster::start_with(test, members, extra);
    let mut fs = TestFs::blank(test, &etcd.endpoints(), 256 << 20);
    fs.mkfs();
    Some((etcd, fs))
}

#[test]
fn killing_the_etcd_leader_under_load_reaches_no_application() {
    let Some((mut etcd, fs)) = cluster_fs("etcd_leader_kill", 3, &[]) else {
        return;
    };
    let a = fs.mount_node("a", "auto", &[]);
    let dir = a.path("");
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    let (d, s) = (dir.clone(), stop.clone());
    thread::spawn(move || {
        let _ = tx.send(workload(d, s));
    });
    for round in 0..2 {
        thread::sleep(Duration::from_secs(2));
        let leader = etcd.leader();
        eprintln!("round {round}: killing the leader, member {leader}");
        etcd.stop(leader);
        thread::sleep(Duration::from_secs(4));
        etcd.run(leader);
        etcd.wait_healthy(Duration::from_secs(30));
    }
    thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    let (kept, errors, longest) = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("the workload hangs:\n{}", a.log_text()));
    let stats = a.stats_json();
    eprintln!(
        "{} files kept, longest step {longest:?}; unanswered commits {} (applied {}, resent {}), \
         reads retried {}",
        kept.len(),
        stats["counters"]["etcd_txns_unanswered"],
        stats["counters"]["etcd_unanswered_applied"],
        stats["counters"]["etcd_unanswered_resent"],
        stats["counters"]["etcd_read_retries"],
    );
    assert!(
        errors.is_empty(),
        "errors reached the application: {errors:?}\n{}",
        a.log_text()
    );
    assert!(kept.len() > 20, "the workload hardly ran: {}", kept.len());
    check_files(&dir, &kept);
    drop(a);
    drop(fs);
}

/// Takes and drops a flock lock and an fcntl lock (F_SETLKW) on one file, opened for
/// each round, until a stop file appears; prints one line per failed call (`E errno
/// call`) and at the end `ok ROUNDS LONGEST_MS`. Tests may not use `unsafe`
/// (tests/tidy.rs), so the locking is done in C.
const LOCK_LOOP_C: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static long long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    long rounds = 0;
    long long longest = 0;
    struct stat st;
    while (stat(argv[2], &st) != 0) {
        long long t = now_ms();
        int fd = open(argv[1], O_RDWR | O_CREAT, 0644);
        if (fd < 0) { printf("E %d open\n", errno); usleep(10000); continue; }
        if (flock(fd, LOCK_EX) != 0) printf("E %d flock-ex\n", errno);
        else if (flock(fd, LOCK_UN) != 0) printf("E %d flock-un\n", errno);
        struct flock fl;
        memset(&fl, 0, sizeof fl);
        fl.l_type = F_WRLCK;
        fl.l_whence = SEEK_SET;
        if (fcntl(fd, F_SETLKW, &fl) != 0) printf("E %d setlkw\n", errno);
        else {
            fl.l_type = F_UNLCK;
            if (fcntl(fd, F_SETLK, &fl) != 0) printf("E %d unlck\n", errno);
        }
        if (close(fd) != 0) printf("E %d close\n", errno);
        rounds++;
        if (now_ms() - t > longest) longest = now_ms() - t;
    }
    printf("ok %ld %lld\n", rounds, longest);
    return 0;
}
"#;

/// The lock loop binary, compiled once per test process.
fn lock_loop_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        fs::create_dir_all(&dir).expect("create CARGO_TARGET_TMPDIR");
        let bin = dir.join(format!(
            "etcfs-lock-loop-{:016x}",
            digest(LOCK_LOOP_C.as_bytes())
        ));
        if bin.exists() {
            return bin;
        }
        let tmp = dir.join(format!("lock-loop-{}-{}", std::process::id(), next_id()));
        let src = tmp.with_extension("c");
        fs::write(&src, LOCK_LOOP_C).expect("write the lock loop's source");
        run_ok(
            Command::new("cc")
                .args(["-O1", "-Wall", "-o"])
                .arg(&tmp)
                .arg(&src),
        );
        let _ = fs::remove_file(&src);
        fs::rename(&tmp, &bin).expect("install the lock loop");
        bin
    })
}

const SHARED_FILES: usize = 4;

fn shared(i: usize, round: u64) -> Vec<u8> {
    (0..8192)
        .map(|j| ((i * 7 + j) as u64 ^ round) as u8)
        .collect()
}

/// Opens the shared files for writing on one node, writes them and closes them, until
/// told to stop: every open of a file the other node has open and reads needs the cache
/// lock from it. Returns the rounds, the errors and the longest step.
fn shared_writer(dir: PathBuf, stop: Arc<AtomicBool>) -> (u64, Vec<String>, Duration) {
    let (mut round, mut errors, mut longest) = (0u64, Vec::new(), Duration::ZERO);
    while !stop.load(Ordering::Relaxed) {
        for i in 0..SHARED_FILES {
            let t = Instant::now();
            let r = File::options()
                .write(true)
                .open(dir.join(format!("s{i}")))
                .and_then(|f| f.write_all_at(&shared(i, round), 0));
            longest = longest.max(t.elapsed());
            if let Err(e) = r {
                errors.push(format!("writer round {round}, s{i}: {e}"));
            }
        }
        round += 1;
    }
    (round, errors, longest)
}

/// Reads the shared files through descriptors held open all along, until told to stop:
/// each read takes the cache lock back from the writer's node.
fn shared_reader(files: Vec<File>, stop: Arc<AtomicBool>) -> (u64, Vec<String>, Duration) {
    let (mut round, mut errors, mut longest) = (0u64, Vec::new(), Duration::ZERO);
    let mut buf = vec![0u8; 8192];
    while !stop.load(Ordering::Relaxed) {
        for (i, f) in files.iter().enumerate() {
            let t = Instant::now();
            if let Err(e) = f.read_exact_at(&mut buf, 0) {
                errors.push(format!("reader round {round}, s{i}: {e}"));
            }
            longest = longest.max(t.elapsed());
        }
        round += 1;
        thread::sleep(Duration::from_millis(20));
    }
    (round, errors, longest)
}

/// A lock loop on `file` until `stop_file` exists; killed when dropped.
struct LockLoop {
    child: std::process::Child,
    /// Its error lines and its last line, once it has ended.
    out: mpsc::Receiver<(Vec<String>, String)>,
}

impl LockLoop {
    fn start(file: &Path, stop_file: &Path) -> LockLoop {
        let mut child = Command::new(lock_loop_path())
            .arg(file)
            .arg(stop_file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run the lock loop");
        let mut stdout = child.stdout.take().expect("stdout");
        let (tx, out) = mpsc::channel();
        thread::spawn(move || {
            let mut text = String::new();
            let _ = stdout.read_to_string(&mut text);
            let errors = text
                .lines()
                .filter(|l| !l.starts_with("ok"))
                .map(str::to_owned)
                .collect();
            let last = text.lines().last().unwrap_or_default().to_owned();
            let _ = tx.send((errors, last));
        });
        LockLoop { child, out }
    }

    /// Its errors and last line, or None if it did not end within `within`.
    fn end(&mut self, within: Duration) -> Option<(Vec<String>, String)> {
        let r = self.out.recv_timeout(within).ok();
        if r.is_some() {
            let _ = self.child.wait();
        }
        r
    }
}

impl Drop for LockLoop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two nodes share files and locks while the etcd leader is killed twice: node A opens
/// for writing files node B holds open and reads (so every open and every read moves a
/// cache lock between the nodes), processes on both take flock and fcntl locks on one
/// file in a loop, and a third node mounts right after the first kill, during the
/// election. No error may reach any of them, and the mount must succeed: each of those
/// writes to etcd (cache locks, fcntl and flock locks, the session's lease and member
/// record, group claims) is idempotent and sent again until the new leader answers.
#[test]
fn killing_the_etcd_leader_reaches_no_lock_shared_open_or_mount() {
    let Some((mut etcd, fs)) = cluster_fs("etcd_leader_kill_locks", 3, &[]) else {
        return;
    };
    let a = fs.mount_node("a", "auto", &[]);
    let b = fs.mount_node("b", "auto", &[]);
    for i in 0..SHARED_FILES {
        fs::write(a.path(&format!("s{i}")), shared(i, u64::MAX)).expect("write a shared file");
    }
    fs::write(a.path("lockfile"), b"").expect("create the lock file");
    let held: Vec<File> = (0..SHARED_FILES)
        .map(|i| File::open(b.path(&format!("s{i}"))).expect("open on b"))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let stop_file = fs.base.join(format!("stop-{}", next_id()));
    let (d, s) = (a.path(""), stop.clone());
    let (writer_tx, writer) = mpsc::channel();
    thread::spawn(move || {
        let _ = writer_tx.send(shared_writer(d, s));
    });
    let s = stop.clone();
    let (reader_tx, reader) = mpsc::channel();
    thread::spawn(move || {
        let _ = reader_tx.send(shared_reader(held, s));
    });
    let mut lockers = [
        LockLoop::start(&a.path("lockfile"), &stop_file),
        LockLoop::start(&b.path("lockfile"), &stop_file),
    ];
    let (d, s) = (a.path(""), stop.clone());
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(workload(d, s));
    });
    let (mut c, mut c_errors) = (None, Vec::new());
    for round in 0..2 {
        thread::sleep(Duration::from_secs(2));
        let leader = etcd.leader();
        eprintln!("round {round}: killing the leader, member {leader}");
        etcd.stop(leader);
        if round == 0 {
            // Before the others have even noticed the leader is gone (etcd's election
            // timeout is a second): the probe, the lease grant and the member record all
            // meet the election.
            let t = Instant::now();
            let node = fs.mount_node("c", "auto", &[]);
            eprintln!("node c mounted during the election in {:?}", t.elapsed());
            let mut got = Vec::new();
            match File::open(node.path("s0")).and_then(|mut f| f.read_to_end(&mut got)) {
                Ok(8192) => {}
                Ok(n) => c_errors.push(format!("c read {n} bytes of s0")),
                Err(e) => c_errors.push(format!("c reading s0: {e}")),
            }
            c = Some(node);
        } else {
            // An operator's command during the election: its reads are resent too.
            let t = Instant::now();
            let (out, in_time) = run_bounded(
                Command::new(ETCFS).args([
                    "status",
                    "--etcd",
                    &fs.endpoints,
                    "--prefix",
                    &fs.prefix,
                ]),
                Duration::from_secs(20),
            );
            eprintln!("etcfs status during the election took {:?}", t.elapsed());
            if !in_time || !out.status.success() {
                c_errors.push(format!(
                    "etcfs status during the election: {}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
        thread::sleep(Duration::from_secs(4));
        etcd.run(leader);
        etcd.wait_healthy(Duration::from_secs(30));
    }
    thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    File::create(&stop_file).expect("create the stop file");
    let hangs = |what: &str| -> ! {
        panic!(
            "{what} hangs\n--- a ---\n{}\n--- b ---\n{}",
            a.log_text(),
            b.log_text()
        )
    };
    let within = Duration::from_secs(60);
    let (kept, mut errors, longest) = rx
        .recv_timeout(within)
        .unwrap_or_else(|_| hangs("the workload"));
    errors.append(&mut c_errors);
    let (writes, e, w_longest) = writer
        .recv_timeout(within)
        .unwrap_or_else(|_| hangs("the shared writer on a"));
    errors.extend(e);
    let (reads, e, r_longest) = reader
        .recv_timeout(within)
        .unwrap_or_else(|_| hangs("the shared reader on b"));
    errors.extend(e);
    let mut lock_rounds = Vec::new();
    for (node, l) in ["a", "b"].into_iter().zip(lockers.iter_mut()) {
        let (e, last) = l
            .end(within)
            .unwrap_or_else(|| hangs(&format!("the lock loop on {node}")));
        errors.extend(e.into_iter().map(|e| format!("lock loop on {node}: {e}")));
        lock_rounds.push(last);
    }
    for (name, node) in [("a", &a), ("b", &b)] {
        let stats = node.stats_json();
        eprintln!(
            "node {name}: write retries {}, read retries {}, unanswered commits {}",
            stats["counters"]["etcd_write_retries"],
            stats["counters"]["etcd_read_retries"],
            stats["counters"]["etcd_txns_unanswered"],
        );
    }
    eprintln!(
        "{} files kept (longest step {longest:?}); {writes} rounds of shared writes \
         (longest open and write {w_longest:?}), {reads} of reads on b (longest \
         {r_longest:?}); lock loops: {lock_rounds:?} (rounds, longest ms)",
        kept.len()
    );
    assert!(
        errors.is_empty(),
        "errors reached applications: {errors:#?}\n--- a ---\n{}\n--- b ---\n{}",
        a.log_text(),
        b.log_text()
    );
    assert!(writes > 5 && reads > 5, "the shared workload hardly ran");
    assert!(
        lock_rounds.iter().all(|l| l
            .strip_prefix("ok ")
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n > 5)),
        "the lock loops hardly ran: {lock_rounds:?}"
    );
    check_files(&a.path(""), &kept);
    drop(c);
    drop(b);
    drop(a);
    drop(fs);
}

#[test]
fn a_lost_etcd_majority_fails_operations_in_seconds_and_they_work_again_after() {
    let Some((mut etcd, fs)) = cluster_fs("etcd_majority", 3, &[]) else {
        return;
    };
    // A lease long enough that the node is not fenced during the outage: what is tested
    // here is the behaviour before that (see tests/fencing.rs for after).
    let a = fs.mount_node("a", "auto", &["--lease-ttl", "60"]);
    let cached = a.path("cached");
    fs::write(&cached, content(1)).expect("write");
    File::open(&cached)
        .and_then(|f| f.sync_all())
        .expect("fsync");
    assert_eq!(fs::read(&cached).expect("read"), content(1));
    // Open across the outage: an open registers the node as a holder in etcd, so what
    // the node holds is an open file (and the attributes it caches).
    let held = File::open(&cached).expect("open");
    // A READ that reaches the daemon needs the file's extent map: an open reads it with
    // the attributes, so a file only opened (never read through the daemon) before the
    // outage serves such READs during it. Before that was so, the O_DIRECT read below
    // answered EIO (as did a buffered one after the kernel dropped a page, which this
    // VM does now and then: the held file's read got EIO in CI).
    let direct = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&cached)
        .expect("open O_DIRECT");
    let mut buf = vec![0u8; 16 * 1024 + 4096];
    let at = buf.as_ptr().align_offset(4096);

    let leader = etcd.leader();
    let down: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    for &i in &down {
        etcd.stop(i);
    }
    // An operation that needs etcd: fails with EIO, within the request timeout and the
    // budget for deciding its lost answer, never hangs.
    let (tx, rx) = mpsc::channel();
    let p = a.path("new");
    thread::spawn(move || {
        let t = Instant::now();
        let r = File::create(&p).map(|_| ());
        let _ = tx.send((errno_of(r), t.elapsed()));
    });
    let (errno, took) = rx
        .recv_timeout(Duration::from_secs(40))
        .unwrap_or_else(|_| panic!("a create hangs with the etcd majority down"));
    eprintln!("create with the majority down: errno {errno:?} after {took:?}");
    assert_eq!(errno, Some(libc::EIO));
    assert!(took < Duration::from_secs(20), "took {took:?}");
    // What the node holds keeps working: the open file, by its descriptor. Not by its
    // path: a name needs etcd while the watch is down (another node may have renamed
    // it), so a path whose dentry the kernel dropped answers EIO, as CI's stat did once.
    let t = Instant::now();
    let len = held
        .metadata()
        .unwrap_or_else(|e| panic!("fstat of an open file: {e}\n{}", a.log_text()))
        .len();
    assert_eq!(len, 16 * 1024);
    let mut got = vec![0u8; 16 * 1024];
    held.read_exact_at(&mut got, 0)
        .unwrap_or_else(|e| panic!("read an open file: {e}\n{}", a.log_text()));
    assert!(got == content(1), "what the open file reads");
    // And a READ that reaches the daemon: the extent map read at open serves it.
    direct
        .read_exact_at(&mut buf[at..at + 16 * 1024], 0)
        .unwrap_or_else(|e| panic!("O_DIRECT read of an open file: {e}\n{}", a.log_text()));
    assert!(
        buf[at..at + 16 * 1024] == content(1)[..],
        "O_DIRECT read, outage"
    );
    drop(direct);
    eprintln!(
        "cached stat and read with the majority down: {:?}",
        t.elapsed()
    );

    for &i in &down {
        etcd.run(i);
    }
    etcd.wait_healthy(Duration::from_secs(30));
    let t = Instant::now();
    loop {
        match File::create(a.path("after")).and_then(|mut f| f.write_all(b"back")) {
            Ok(()) => break,
            Err(e) => {
                assert!(
                    t.elapsed() < Duration::from_secs(30),
                    "still failing 30 s after etcd came back: {e}\n{}",
                    a.log_text()
                );
                thread::sleep(Duration::from_millis(200));
            }
        }
    }
    eprintln!(
        "served again {:?} after the majority came back",
        t.elapsed()
    );
    assert_eq!(fs::read(a.path("after")).expect("read"), b"back");
    assert_eq!(fs::read(&cached).expect("read"), content(1));
    drop(held);
    drop(a);
    drop(fs);
}

/// etcd's space quota reached: the filesystem answers ENOSPC (not EIO), the log names
/// etcd's quota as the cause and what to do, and reads keep working.
#[test]
fn etcd_quota_alarm_is_enospc_with_a_log_line_that_says_so() {
    let Some((_etcd, fs)) = cluster_fs("etcd_quota", 1, &["--quota-backend-bytes", "16777216"])
    else {
        return;
    };
    let a = fs.mount_node("a", "auto", &[]);
    let value = "v".repeat(60 * 1024);
    let mut errno = None;
    let mut made = 0;
    for i in 0..2000 {
        let p = a.path(&format!("x{i}"));
        let r = File::create(&p).and_then(|_| {
            common::helper(&["setxattr", &p.to_string_lossy(), "user.fill", &value, "0"])
                .map(|_| ())
                .map_err(std::io::Error::from_raw_os_error)
        });
        if let Err(e) = r {
            errno = e.raw_os_error();
            break;
        }
        made += 1;
    }
    eprintln!("{made} files with a 60 KiB xattr before etcd was full");
    assert_eq!(errno, Some(libc::ENOSPC), "{}", a.log_text());
    let log = a.log_text();
    assert!(
        log.contains("metadata store full") && log.contains("etcdctl alarm disarm"),
        "the log says etcd's quota is the cause:\n{log}"
    );
    assert!(fs::metadata(a.path("x0")).is_ok(), "reads keep working");
    drop(a);
    drop(fs);
}
