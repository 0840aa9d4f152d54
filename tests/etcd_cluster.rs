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
    os::unix::fs::FileExt as _,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    thread,
    time::{Duration, Instant},
};

use common::{can_run, errno_of, EtcdCluster, TestFs};

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
    // What the node holds cached keeps working.
    let t = Instant::now();
    assert_eq!(fs::metadata(&cached).expect("stat").len(), 16 * 1024);
    let mut got = vec![0u8; 16 * 1024];
    held.read_exact_at(&mut got, 0).expect("read an open file");
    assert!(got == content(1), "what the open file reads");
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
