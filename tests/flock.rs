//! Cluster-wide locks (issue 13 item 3) on real mounts: two daemons mount one filesystem
//! (two nodes), and processes on each take fcntl record locks and flock locks through a
//! small C program driven line by line over a pipe (tests may not use `unsafe`, see
//! tests/tidy.rs). Covered: exclusion across nodes (EAGAIN / EWOULDBLOCK), F_GETLK naming
//! the holder, shared locks, splits of a held range, F_SETLKW and blocking flock woken by
//! another node's unlock (by the watch: sooner than the 1 s re-check), EINTR for a waiting
//! F_SETLKW hit by a signal, release on close, on process exit and when a node dies.
//!
//! Needs root, `/dev/fuse` and `ETCD_ENDPOINTS` (see `common`); skips loudly otherwise,
//! and fails instead when `ETCFS_REQUIRE_MOUNT_TESTS=1`.

mod common;

use std::{
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::unix::fs::OpenOptionsExt as _,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::{
        mpsc::{self, Receiver, RecvTimeoutError},
        OnceLock,
    },
    thread,
    time::{Duration, Instant},
};

use common::{digest, next_id, run_ok, Daemon, TestFs};

const EAGAIN: &str = "E 11";
const EINTR: &str = "E 4";
/// How long any one step may take before the test calls it hung.
const STEP: Duration = Duration::from_secs(30);
/// Well under the waiters' 1 s re-check: a wake-up this fast came from the watch.
const WOKEN_WITHIN: Duration = Duration::from_millis(600);

/// Commands, one per line; every command answers one line: `ok [...]` or `E <errno>`.
///   open PATH | close | alarm SECS | exit
///   lk [ofd]setlk|[ofd]setlkw|[ofd]getlk r|w|u START LEN
///      (getlk answers `ok u` or `ok r|w START LEN PID`; ofd: the F_OFD_* commands)
///   flock sh|ex|un|shnb|exnb
///   count N (N times: F_SETLKW the whole file, add one to the 8-byte counter at its
///      start, unlock)
const LOCKER_C: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

static void on_alarm(int s) { (void)s; }

static void fail(void) { printf("E %d\n", errno); }

int main(void) {
    char line[4096], a[4096], b[64], c[64];
    long long x, y;
    int fd = -1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm; /* no SA_RESTART: a waiting F_SETLKW must see EINTR */
    sigaction(SIGALRM, &sa, NULL);
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ok %d\n", getpid());
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (sscanf(line, "open %4095s", a) == 1) {
            fd = open(a, O_RDWR | O_CREAT, 0644);
            if (fd < 0) fail(); else printf("ok\n");
        } else if (!strcmp(line, "close")) {
            if (close(fd) != 0) fail(); else printf("ok\n");
            fd = -1;
        } else if (sscanf(line, "alarm %lld", &x) == 1) {
            alarm((unsigned)x);
            printf("ok\n");
        } else if (!strcmp(line, "exit")) {
            return 0;
        } else if (sscanf(line, "lk %63s %63s %lld %lld", b, c, &x, &y) == 4) {
            struct flock fl;
            memset(&fl, 0, sizeof fl);
            fl.l_type = c[0] == 'r' ? F_RDLCK : c[0] == 'w' ? F_WRLCK : F_UNLCK;
            fl.l_whence = SEEK_SET;
            fl.l_start = x;
            fl.l_len = y;
            int ofd = !strncmp(b, "ofd", 3);
            const char *k = ofd ? b + 3 : b;
            int cmd = !strcmp(k, "setlkw") ? (ofd ? F_OFD_SETLKW : F_SETLKW)
                    : !strcmp(k, "getlk") ? (ofd ? F_OFD_GETLK : F_GETLK)
                    : (ofd ? F_OFD_SETLK : F_SETLK);
            if (fcntl(fd, cmd, &fl) != 0) { fail(); continue; }
            if (cmd != F_GETLK && cmd != F_OFD_GETLK) { printf("ok\n"); continue; }
            if (fl.l_type == F_UNLCK) printf("ok u\n");
            else printf("ok %c %lld %lld %d\n", fl.l_type == F_RDLCK ? 'r' : 'w',
                        (long long)fl.l_start, (long long)fl.l_len, (int)fl.l_pid);
        } else if (sscanf(line, "count %lld", &x) == 1) {
            long long i, v;
            int bad = 0;
            for (i = 0; i < x && !bad; i++) {
                struct flock fl;
                memset(&fl, 0, sizeof fl);
                fl.l_type = F_WRLCK;
                fl.l_whence = SEEK_SET;
                if (fcntl(fd, F_SETLKW, &fl) != 0) { bad = 1; break; }
                v = 0;
                ssize_t n = pread(fd, &v, sizeof v, 0);
                if (n != 0 && n != (ssize_t)sizeof v) { bad = 1; break; }
                v++;
                if (pwrite(fd, &v, sizeof v, 0) != (ssize_t)sizeof v) { bad = 1; break; }
                fl.l_type = F_UNLCK;
                if (fcntl(fd, F_SETLK, &fl) != 0) bad = 1;
            }
            if (bad) fail(); else printf("ok\n");
        } else if (sscanf(line, "flock %63s", b) == 1) {
            int op = !strncmp(b, "sh", 2) ? LOCK_SH : !strncmp(b, "ex", 2) ? LOCK_EX : LOCK_UN;
            if (strstr(b, "nb")) op |= LOCK_NB;
            if (flock(fd, op) != 0) fail(); else printf("ok\n");
        } else {
            printf("E 22\n");
        }
    }
    return 0;
}
"#;

/// The locker binary, compiled once per test process.
fn locker_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        fs::create_dir_all(&dir).expect("create CARGO_TARGET_TMPDIR");
        let bin = dir.join(format!("etcfs-locker-{:016x}", digest(LOCKER_C.as_bytes())));
        if bin.exists() {
            return bin;
        }
        let tmp = dir.join(format!("locker-{}-{}", std::process::id(), next_id()));
        let src = tmp.with_extension("c");
        fs::write(&src, LOCKER_C).expect("write locker source");
        run_ok(
            Command::new("cc")
                .args(["-O1", "-Wall", "-o"])
                .arg(&tmp)
                .arg(&src),
        );
        let _ = fs::remove_file(&src);
        fs::rename(&tmp, &bin).expect("install locker");
        bin
    })
}

/// One process taking locks, driven over its stdin; killed when dropped.
struct Locker {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    pid: u32,
}

impl Locker {
    /// A new process with `path` open read-write.
    fn on(path: &Path) -> Locker {
        let mut child = Command::new(locker_path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the locker");
        let stdin = child.stdin.take().expect("stdin");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut l = Locker {
            pid: child.id(),
            child,
            stdin,
            lines,
        };
        assert_eq!(l.answer(STEP), Some(format!("ok {}", l.pid)));
        let open = format!("open {}", path.display());
        assert_eq!(l.cmd(&open), "ok", "{open}");
        l
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to the locker");
        self.stdin.flush().expect("flush to the locker");
    }

    /// The next answer, or None after `within`.
    fn answer(&mut self, within: Duration) -> Option<String> {
        match self.lines.recv_timeout(within) {
            Ok(l) => Some(l),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => panic!("the locker {} died", self.pid),
        }
    }

    fn cmd(&mut self, line: &str) -> String {
        self.send(line);
        self.answer(STEP)
            .unwrap_or_else(|| panic!("locker {}: `{line}` hung", self.pid))
    }

    /// SIGKILL and reap: the kernel closes its files as for any exit.
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Locker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn two_nodes(test: &str) -> Option<(TestFs, Daemon, Daemon)> {
    let fs = TestFs::new_or_skip(test, None)?;
    let a = fs.mount("auto", &[]);
    let b = fs.mount_node("b", "auto", &[]);
    Some((fs, a, b))
}

/// Creates `name` on `a` and waits until `b` sees it.
fn shared_file(a: &Daemon, b: &Daemon, name: &str) -> (PathBuf, PathBuf) {
    fs::write(a.path(name), b"0123456789").expect("create the locked file");
    let deadline = Instant::now() + STEP;
    while !b.path(name).exists() {
        assert!(Instant::now() < deadline, "{name} never showed on node b");
        thread::sleep(Duration::from_millis(20));
    }
    (a.path(name), b.path(name))
}

/// `cmd` until it answers `ok` (a release another node has not seen yet), or panics.
fn eventually_ok(l: &mut Locker, cmd: &str, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let r = l.cmd(cmd);
        if r == "ok" {
            return start.elapsed();
        }
        assert_eq!(r, EAGAIN, "{cmd}");
        assert!(
            start.elapsed() < within,
            "{cmd}: still EAGAIN after {within:?}"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn fcntl_locks_exclude_across_nodes() {
    let Some((_fs, a, b)) = two_nodes("fcntl_exclusion") else {
        return;
    };
    let (pa, pb) = shared_file(&a, &b, "f");
    let mut la = Locker::on(&pa);
    let mut lb = Locker::on(&pb);

    // Exclusive on A: B can neither write- nor read-lock inside it, and F_GETLK names A.
    assert_eq!(la.cmd("lk setlk w 0 100"), "ok");
    assert_eq!(lb.cmd("lk setlk w 50 1"), EAGAIN);
    assert_eq!(lb.cmd("lk setlk r 99 10"), EAGAIN);
    assert_eq!(lb.cmd("lk getlk w 0 0"), format!("ok w 0 100 {}", la.pid));
    assert_eq!(lb.cmd("lk setlk w 100 10"), "ok", "past A's range");
    assert_eq!(
        la.cmd("lk getlk r 105 1"),
        format!("ok w 100 10 {}", lb.pid)
    );

    // Unlocking the middle of A's range splits it: the hole is free, both ends are not.
    assert_eq!(la.cmd("lk setlk u 40 20"), "ok");
    assert_eq!(lb.cmd("lk setlk w 45 10"), "ok");
    assert_eq!(lb.cmd("lk setlk w 39 1"), EAGAIN);
    assert_eq!(lb.cmd("lk setlk w 60 1"), EAGAIN);
    assert_eq!(lb.cmd("lk getlk w 60 1"), format!("ok w 60 40 {}", la.pid));

    // Shared locks coexist across nodes and on one node; a writer is kept out of them.
    assert_eq!(la.cmd("lk setlk r 1000 10"), "ok");
    assert_eq!(lb.cmd("lk setlk r 1005 10"), "ok");
    let mut la2 = Locker::on(&pa);
    assert_eq!(la2.cmd("lk setlk r 1000 1"), "ok");
    assert_eq!(la2.cmd("lk setlk w 1009 1"), EAGAIN, "B reads byte 1009");
    assert_eq!(
        la2.cmd("lk getlk w 1000 1"),
        format!("ok r 1000 10 {}", la.pid)
    );
    // A upgrades its shared lock where nobody else reads.
    assert_eq!(la.cmd("lk setlk u 1000 1"), "ok");
    assert_eq!(la2.cmd("lk setlk u 1000 1"), "ok");
    assert_eq!(la.cmd("lk setlk w 1000 5"), "ok");
    assert_eq!(
        lb.cmd("lk getlk r 1000 2"),
        format!("ok w 1000 5 {}", la.pid)
    );

    // fcntl and flock locks are independent, as on Linux.
    assert_eq!(lb.cmd("flock exnb"), "ok");
    assert_eq!(la.cmd("lk setlk w 5000 1"), "ok");
    assert_eq!(lb.cmd("flock un"), "ok");

    // Everything of A's released: B takes the whole file.
    assert_eq!(la.cmd("lk setlk u 0 0"), "ok");
    assert_eq!(lb.cmd("lk setlk w 0 0"), "ok");
    assert_eq!(la.cmd("lk getlk r 0 0"), format!("ok w 0 0 {}", lb.pid));
}

#[test]
fn setlkw_is_woken_by_the_unlock_on_another_node() {
    let Some((_fs, a, b)) = two_nodes("setlkw_wakeup") else {
        return;
    };
    let (pa, pb) = shared_file(&a, &b, "f");
    let mut la = Locker::on(&pa);
    let mut lb = Locker::on(&pb);
    for round in 0..3 {
        assert_eq!(la.cmd("lk setlk w 0 1"), "ok");
        lb.send("lk setlkw w 0 1");
        assert_eq!(
            lb.answer(Duration::from_millis(300)),
            None,
            "B did not wait"
        );
        let t = Instant::now();
        assert_eq!(la.cmd("lk setlk u 0 1"), "ok");
        assert_eq!(lb.answer(STEP).as_deref(), Some("ok"));
        let took = t.elapsed();
        assert!(
            took < WOKEN_WITHIN,
            "round {round}: B got the lock {took:?} after A's unlock"
        );
        assert_eq!(la.cmd("lk setlk w 0 1"), EAGAIN);
        assert_eq!(lb.cmd("lk setlk u 0 1"), "ok");
    }
    // The same for a blocking flock.
    assert_eq!(la.cmd("flock ex"), "ok");
    lb.send("flock ex");
    assert_eq!(
        lb.answer(Duration::from_millis(300)),
        None,
        "B did not wait"
    );
    let t = Instant::now();
    assert_eq!(la.cmd("flock un"), "ok");
    assert_eq!(lb.answer(STEP).as_deref(), Some("ok"));
    assert!(t.elapsed() < WOKEN_WITHIN, "flock: {:?}", t.elapsed());
    assert_eq!(la.cmd("flock shnb"), EAGAIN);
}

#[test]
fn a_signal_interrupts_a_waiting_setlkw() {
    let Some((_fs, a, b)) = two_nodes("setlkw_eintr") else {
        return;
    };
    let (pa, pb) = shared_file(&a, &b, "f");
    let mut la = Locker::on(&pa);
    let mut lb = Locker::on(&pb);
    assert_eq!(la.cmd("lk setlk w 0 10"), "ok");
    assert_eq!(lb.cmd("alarm 1"), "ok");
    let t = Instant::now();
    assert_eq!(lb.cmd("lk setlkw w 5 1"), EINTR);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "EINTR after {:?}",
        t.elapsed()
    );
    // The interrupted request took nothing: B still waits for A, and gets it after.
    assert_eq!(lb.cmd("lk getlk w 5 1"), format!("ok w 0 10 {}", la.pid));
    assert_eq!(la.cmd("lk setlk u 0 10"), "ok");
    assert_eq!(lb.cmd("lk setlkw w 5 1"), "ok");
    assert_eq!(la.cmd("lk setlk w 0 10"), EAGAIN);
}

#[test]
fn locks_go_when_their_process_closes_or_exits() {
    let Some((_fs, a, b)) = two_nodes("release_on_close_exit") else {
        return;
    };
    let (pa, pb) = shared_file(&a, &b, "f");
    let mut lb = Locker::on(&pb);

    // close(2) of any descriptor of the file drops the process's fcntl locks (FLUSH).
    let mut la = Locker::on(&pa);
    assert_eq!(la.cmd("lk setlk w 0 0"), "ok");
    assert_eq!(lb.cmd("lk setlk r 0 1"), EAGAIN);
    assert_eq!(la.cmd("close"), "ok");
    assert_eq!(
        lb.cmd("lk setlk r 0 1"),
        "ok",
        "close answered after the unlock"
    );
    assert_eq!(lb.cmd("lk setlk u 0 0"), "ok");

    // A process that dies holding locks: the kernel closes its files.
    let mut la = Locker::on(&pa);
    assert_eq!(la.cmd("lk setlk w 0 0"), "ok");
    assert_eq!(la.cmd("flock ex"), "ok");
    assert_eq!(lb.cmd("lk setlk w 3 1"), EAGAIN);
    assert_eq!(lb.cmd("flock exnb"), EAGAIN);
    lb.send("lk setlkw w 3 1");
    la.kill();
    assert_eq!(lb.answer(STEP).as_deref(), Some("ok"));
    // RELEASE (which carries the flock unlock) comes after the exit, asynchronously.
    eventually_ok(&mut lb, "flock exnb", Duration::from_secs(5));

    // flock locks belong to the open file description: its last close drops them.
    let mut la = Locker::on(&pa);
    assert_eq!(lb.cmd("flock un"), "ok");
    assert_eq!(la.cmd("flock sh"), "ok");
    assert_eq!(lb.cmd("flock exnb"), EAGAIN);
    assert_eq!(lb.cmd("flock shnb"), "ok", "shared flock locks coexist");
    assert_eq!(lb.cmd("flock un"), "ok");
    assert_eq!(la.cmd("close"), "ok");
    eventually_ok(&mut lb, "flock exnb", Duration::from_secs(5));
}

/// OFD locks (F_OFD_SETLK) belong to the open file description, not the process: they
/// go at nothing but the description's last close (RELEASE, which names no owner).
#[test]
fn ofd_locks_go_with_their_open_file_description() {
    let Some((_fs, a, b)) = two_nodes("ofd_locks") else {
        return;
    };
    let (pa, pb) = shared_file(&a, &b, "f");
    let mut la = Locker::on(&pa);
    let mut lb = Locker::on(&pb);
    assert_eq!(la.cmd("lk ofdsetlk w 0 10"), "ok");
    assert_eq!(lb.cmd("lk setlk w 5 1"), EAGAIN);
    assert_eq!(lb.cmd("lk ofdsetlk r 5 1"), EAGAIN);
    // Another description in the same process is another owner.
    let mut la2 = Locker::on(&pa);
    assert_eq!(la2.cmd("lk ofdsetlk w 9 1"), EAGAIN);
    drop(la2);
    lb.send("lk ofdsetlkw w 5 1");
    assert_eq!(
        lb.answer(Duration::from_millis(300)),
        None,
        "B did not wait"
    );
    assert_eq!(la.cmd("close"), "ok");
    assert_eq!(lb.answer(STEP).as_deref(), Some("ok"));
    assert_eq!(lb.cmd("lk ofdsetlk u 5 1"), "ok");
    assert_eq!(lb.cmd("lk setlk w 0 0"), "ok", "nothing of A's is left");
}

#[test]
fn a_dead_nodes_locks_go_with_its_lease() {
    let Some((fs, a, b)) = two_nodes("dead_node_locks") else {
        return;
    };
    let (pa, pb) = shared_file(&a, &b, "f");
    let la = Locker::on(&pa);
    let mut la = la;
    assert_eq!(la.cmd("lk setlk w 0 0"), "ok");
    assert_eq!(la.cmd("flock ex"), "ok");
    let mut lb = Locker::on(&pb);
    assert_eq!(lb.cmd("lk setlk w 0 1"), EAGAIN);
    assert_eq!(fs.etcd_key_count("B"), 2);
    lb.send("lk setlkw w 0 1");
    let t = Instant::now();
    a.crash();
    // The session lease's TTL is 10 s; its expiry deletes the keys, the watch wakes B.
    let got = lb.answer(Duration::from_secs(25));
    assert_eq!(got.as_deref(), Some("ok"), "after {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(16), "{:?}", t.elapsed());
    assert_eq!(lb.cmd("flock exnb"), "ok");
    drop(la);
    drop(lb);
    // B's unmount deletes its own locks at once.
    b.stop();
    assert_eq!(fs.etcd_key_count("B"), 0);
}

#[test]
fn two_nodes_counting_under_one_lock_lose_no_increment() {
    let Some((_fs, a, b)) = two_nodes("lock_counter") else {
        return;
    };
    let (pa, pb) = shared_file(&a, &b, "counter");
    let mut la = Locker::on(&pa);
    let mut lb = Locker::on(&pb);
    // A alone first: the file's locks are delegated to A. Then both at once: B's first
    // lock recalls the delegation, and every increment after it takes the lock (and the
    // file's data) from the other node or from etcd.
    const EACH: u64 = 150;
    assert_eq!(la.cmd("count 20"), "ok");
    la.send(&format!("count {EACH}"));
    lb.send(&format!("count {EACH}"));
    let deadline = Duration::from_secs(120);
    assert_eq!(la.answer(deadline).as_deref(), Some("ok"), "A's increments");
    assert_eq!(lb.answer(deadline).as_deref(), Some("ok"), "B's increments");
    // The counter starts as the first 8 bytes shared_file wrote. Read three ways: through
    // each node's page cache, and from the device under A's page cache (O_DIRECT), so a
    // failure says whether increments were lost or a node's cache was left stale.
    let base = u64::from_le_bytes(*b"01234567");
    let cached = |p: &Path| {
        let v = fs::read(p).expect("read the counter");
        u64::from_le_bytes(v[..8].try_into().expect("8 bytes")).wrapping_sub(base)
    };
    let direct = {
        let mut f = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&pa)
            .expect("open the counter O_DIRECT");
        let mut buf = vec![0u8; 8192];
        let n = f.read(&mut buf).expect("read the counter O_DIRECT");
        assert_eq!(n, 10, "the counter file's size");
        u64::from_le_bytes(buf[..8].try_into().expect("8 bytes")).wrapping_sub(base)
    };
    let seen = (cached(&pa), cached(&pb), direct);
    let want = 20 + 2 * EACH;
    assert_eq!(seen, (want, want, want), "(A cached, B cached, A direct)");
    let counter = |d: &Daemon, name: &str| d.stats_json()["counters"][name].as_u64().unwrap_or(0);
    assert!(
        counter(&a, "plocks_delegations_taken") >= 1
            && counter(&a, "plocks_delegations_returned") >= 1,
        "A's delegation was taken and recalled: {}",
        a.stats_json()["counters"]
    );
}

#[test]
fn a_dead_delegation_holders_locks_go_with_its_lease() {
    let Some((fs, a, b)) = two_nodes("dead_delegate") else {
        return;
    };
    let (pa, pb) = shared_file(&a, &b, "f");
    let mut la = Locker::on(&pa);
    assert_eq!(la.cmd("lk setlk w 0 0"), "ok");
    // Delegated: etcd holds the delegation record alone, A's lock is in its memory.
    assert_eq!(fs.etcd_key_count("B"), 1);
    let t = Instant::now();
    assert!(a.crash(), "A was running");
    // B's lock recalls a delegation nobody answers for: it waits until the lease of the
    // dead node ends (10 s) and its records go, then takes the lock, never sooner.
    let mut lb = Locker::on(&pb);
    assert_eq!(lb.cmd("lk setlk w 0 1"), "ok", "after {:?}", t.elapsed());
    assert!(
        t.elapsed() >= Duration::from_secs(5) && t.elapsed() < Duration::from_secs(25),
        "{:?}",
        t.elapsed()
    );
    // A process's own locks never conflict with it: ask from another process on B.
    let mut other = Locker::on(&pb);
    assert_eq!(other.cmd("lk getlk w 0 0"), format!("ok w 0 1 {}", lb.pid));
    drop(la);
}
