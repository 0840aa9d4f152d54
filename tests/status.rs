//! `etcfs status` and `etcfs evict` on real mounts with a real etcd: two daemons mount one
//! filesystem (two nodes); a file open, written and flock'ed on one of them shows in the
//! status of that node; evicting it removes its node record, and the other node can then
//! take the lock and write the file the evicted node held the cache lock of.
//!
//! What the evicted daemon itself does afterwards is not checked here (its fencing is
//! another part of the work); the test only makes sure it is stopped and unmounted.
//!
//! The mount test needs root, `/dev/fuse` and `ETCD_ENDPOINTS` (see `common`); the
//! unreachable-etcd test needs nothing.

mod common;

use std::{
    fs::OpenOptions,
    os::unix::fs::FileExt as _,
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use common::{eventually, run_bounded, wait_bounded, TestFs, ETCFS};
use serde_json::Value;

/// How long one `etcfs status` or `evict` may take.
const COMMAND_DEADLINE: Duration = Duration::from_secs(30);

fn etcfs(fs: &TestFs, args: &[&str]) -> Output {
    let (out, in_time) = run_bounded(
        Command::new(ETCFS)
            .arg(args[0])
            .args(["--etcd", &fs.endpoints, "--prefix", &fs.prefix])
            .args(&args[1..]),
        COMMAND_DEADLINE,
    );
    assert!(
        in_time,
        "etcfs {args:?} took longer than {COMMAND_DEADLINE:?}"
    );
    out
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn status(fs: &TestFs) -> Value {
    let out = etcfs(fs, &["status", "--json"]);
    assert!(out.status.success(), "etcfs status failed: {}", text(&out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {}", text(&out)))
}

/// The node of `status` whose daemon has process id `pid`.
fn node(status: &Value, pid: u32) -> Option<&Value> {
    status["nodes"]
        .as_array()?
        .iter()
        .find(|n| n["pid"].as_u64() == Some(u64::from(pid)))
}

fn count(node: &Value, field: &str) -> u64 {
    node[field]
        .as_u64()
        .unwrap_or_else(|| panic!("no {field} in {node}"))
}

/// A process holding an exclusive flock on `path` until killed.
struct Locker(Child);

impl Locker {
    fn take(path: &std::path::Path) -> Locker {
        Locker(
            Command::new("flock")
                .arg("-x")
                .arg(path)
                .args(["sleep", "600"])
                .stdin(Stdio::null())
                .spawn()
                .expect("spawn flock"),
        )
    }
}

impl Drop for Locker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = wait_bounded(&mut self.0, Duration::from_secs(10));
    }
}

#[test]
fn status_shows_what_nodes_hold_and_evict_releases_it() {
    let Some(fs) = TestFs::new_or_skip("status_and_evict", None) else {
        return;
    };
    let a = fs.mount_node("a", "auto", &[]);
    let b = fs.mount_node("b", "auto", &[]);

    // On A: a file written, synced and kept open (an open record, the exclusive cache
    // lock, a group to allocate from), and a flock a process on A holds.
    let held = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(a.path("held"))
        .expect("create on A");
    held.write_all_at(&[7u8; 256 << 10], 0).expect("write on A");
    held.sync_all().expect("fsync on A");
    let locker = Locker::take(&a.path("held"));

    // Only A locks the file: its locks are delegated to A, held in A's memory.
    let mut seen = Value::Null;
    let shown = eventually(Duration::from_secs(10), || {
        seen = status(&fs);
        node(&seen, a.pid()).is_some_and(|n| count(n, "lock_delegations") == 1)
    });
    assert!(shown, "A's delegation never showed in status: {seen:#}");
    // B's try of the flock takes the delegation back from A and is refused: A's flock
    // is then a record of its own.
    let (out, in_time) = run_bounded(
        Command::new("flock")
            .args(["-n", "-x"])
            .arg(b.path("held"))
            .arg("true"),
        COMMAND_DEADLINE,
    );
    assert!(
        in_time && !out.status.success(),
        "B took the flock A holds: {}",
        text(&out)
    );
    let shown = eventually(Duration::from_secs(10), || {
        seen = status(&fs);
        // B's close of the file its flock opened goes to etcd a little later.
        node(&seen, a.pid())
            .is_some_and(|n| count(n, "flock_locks") == 1 && count(n, "lock_delegations") == 0)
            && node(&seen, b.pid()).is_some_and(|n| count(n, "files_open") == 0)
    });
    assert!(shown, "A's flock never showed in status: {seen:#}");
    let s = seen;
    assert_eq!(s["nodes"].as_array().map(Vec::len), Some(2), "{s:#}");
    let na = node(&s, a.pid()).expect("node A");
    let nb = node(&s, b.pid()).unwrap_or_else(|| panic!("node B: {s:#}"));
    assert!(count(na, "files_open") >= 1, "{na:#}");
    // B's open for the flock needed the file's cache lock too: A's exclusive one may
    // have been demoted to shared by then.
    assert_eq!(
        count(na, "cache_exclusive") + count(na, "cache_shared"),
        1,
        "{na:#}"
    );
    assert!(
        na["groups"].as_array().is_some_and(|g| !g.is_empty()),
        "A wrote, so it owns a group: {na:#}"
    );
    assert_eq!(na["version"], env!("CARGO_PKG_VERSION"), "{na:#}");
    let ttl = na["lease_ttl_left_s"].as_i64().expect("lease ttl");
    assert!(ttl > 0 && ttl <= na["lease_ttl_s"].as_i64().expect("granted"));
    assert_eq!(count(nb, "files_open"), 0, "{nb:#}");
    assert_eq!(count(nb, "flock_locks"), 0, "{nb:#}");
    assert_eq!(na["name"], nb["name"], "both nodes run on this host");
    let f = &s["filesystem"];
    assert_eq!(f["uuid"], fs.uuid.as_str());
    assert!(count(f, "used_blocks") >= 64, "A's 256 KiB are used: {f:#}");
    assert_eq!(
        count(f, "used_blocks") + count(f, "free_blocks"),
        count(f, "data_blocks")
    );
    assert!(s["etcd"]["leader"].is_string(), "{:#}", s["etcd"]);
    assert!(s["etcd"]["members"]
        .as_array()
        .is_some_and(|m| !m.is_empty()));
    assert!(s["warnings"].is_array());

    // The table names both nodes.
    let out = etcfs(&fs, &["status"]);
    assert!(out.status.success(), "{}", text(&out));
    let table = text(&out);
    assert!(table.contains("nodes (2)"), "{table}");
    assert!(table.contains(&a.pid().to_string()), "{table}");

    // Both nodes have this host's name: evicting by name is refused, so is a stranger.
    let name = na["name"].as_str().expect("name").to_owned();
    let out = etcfs(&fs, &["evict", &name]);
    assert!(
        !out.status.success(),
        "evict by a shared name: {}",
        text(&out)
    );
    assert!(text(&out).contains("session id"), "{}", text(&out));
    let out = etcfs(&fs, &["evict", "no-such-node"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("no live node"), "{}", text(&out));

    // Evict A by its session.
    let session = na["session"].as_str().expect("session").to_owned();
    let out = etcfs(&fs, &["evict", &session]);
    assert!(out.status.success(), "evict {session}: {}", text(&out));
    assert!(text(&out).contains("evicted"), "{}", text(&out));
    let after = status(&fs);
    assert!(
        after["nodes"]
            .as_array()
            .is_some_and(|n| n.iter().all(|n| n["session"] != session.as_str())),
        "A's node record is gone: {after:#}"
    );
    assert!(
        node(&after, b.pid()).is_some(),
        "B is still there: {after:#}"
    );

    // B can now take the flock A's process held, and write the file A held the cache
    // lock of (bounded: a hang fails the test instead of stalling it).
    let (out, in_time) = run_bounded(
        Command::new("flock")
            .args(["-n", "-x"])
            .arg(b.path("held"))
            .arg("true"),
        COMMAND_DEADLINE,
    );
    assert!(
        in_time && out.status.success(),
        "B cannot take the lock A held: {}",
        text(&out)
    );
    let path_b = b.path("held");
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let r = (|| {
            let f = OpenOptions::new().read(true).write(true).open(&path_b)?;
            f.write_all_at(&[9u8; 64 << 10], 0)?;
            f.sync_all()?;
            let mut back = vec![0u8; 64 << 10];
            f.read_exact_at(&mut back, 0)?;
            Ok::<_, std::io::Error>(back)
        })();
        let _ = tx.send(r);
    });
    let back = rx
        .recv_timeout(COMMAND_DEADLINE)
        .expect("B's write of the file A held did not finish in time")
        .expect("B writes the file A held");
    assert!(back.iter().all(|&x| x == 9), "B reads back what it wrote");

    // Stop A's lock holder and close A's file, then let the guards stop and unmount A
    // (whatever state the evicted daemon is in) and B.
    drop(locker);
    drop(held);
    drop(a);
    b.stop();
}

#[test]
fn status_against_an_unreachable_etcd_fails_fast_and_says_so() {
    // Nothing listens on port 1; the second endpoint accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_url = format!("http://{}", silent.local_addr().expect("addr"));
    for endpoint in ["http://127.0.0.1:1", silent_url.as_str()] {
        for cmd in [&["status"][..], &["status", "--json"], &["evict", "x"]] {
            let start = Instant::now();
            let (out, in_time) = run_bounded(
                Command::new(ETCFS)
                    .arg(cmd[0])
                    .args(["--etcd", endpoint])
                    .args(&cmd[1..]),
                Duration::from_secs(20),
            );
            let took = start.elapsed();
            let msg = text(&out);
            assert!(in_time, "etcfs {cmd:?} against {endpoint} hung: {msg}");
            assert!(!out.status.success(), "{cmd:?} against {endpoint}: {msg}");
            assert!(
                took < Duration::from_secs(10),
                "{cmd:?} against {endpoint} took {took:?}"
            );
            assert!(
                msg.contains("cannot reach etcd") && msg.contains(endpoint),
                "{cmd:?} against {endpoint}: {msg}"
            );
            assert!(out.stdout.is_empty(), "nothing printed as a result: {msg}");
        }
    }
    drop(silent);
}
