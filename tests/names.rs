//! Names across nodes (issue 13, "names"): a node never contradicts what etcd just told it.
//! After EEXIST its next lookup finds the name, after ENOENT it does not, even while its
//! kernel still caches the opposite for the 60 s entry timeout and the etcd watch has not
//! delivered the other node's change yet; `mkdir -p` from two nodes at once never fails.
//!
//! Two daemons on one device image and one etcd prefix are the two nodes. Needs root,
//! `/dev/fuse` and `ETCD_ENDPOINTS` (see `common`); skips loudly otherwise, and fails
//! instead when `ETCFS_REQUIRE_MOUNT_TESTS=1`.

mod common;

use std::{fs, io::ErrorKind, process::Command, thread};

use common::{Daemon, TestFs};

fn two_nodes(test: &str) -> Option<(TestFs, Daemon, Daemon)> {
    let fs = TestFs::new_or_skip(test, None)?;
    let a = fs.mount("auto", &[]);
    let b = fs.mount_node("b", "auto", &[]);
    Some((fs, a, b))
}

#[test]
fn after_eexist_the_name_is_there_and_after_enoent_it_is_not() {
    let Some((_fs, a, b)) = two_nodes("after_eexist_and_enoent") else {
        return;
    };
    let mut contradicted = Vec::new();
    for i in 0..150 {
        let name = format!("d{i}");
        // A's kernel caches the absence (60 s); B creates the name; A's mkdir races the
        // watch that would tell A.
        assert!(!a.path(&name).exists());
        fs::create_dir(b.path(&name)).unwrap();
        match fs::create_dir(a.path(&name)) {
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            other => panic!("mkdir {name} on A after B made it: {other:?}"),
        }
        if !a.path(&name).is_dir() {
            contradicted.push(format!("{name}: ENOENT after EEXIST"));
        }
        // And back: A's kernel caches the directory, B removes it, A's rmdir gets ENOENT.
        assert!(a.path(&name).is_dir());
        fs::remove_dir(b.path(&name)).unwrap();
        match fs::remove_dir(a.path(&name)) {
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            other => panic!("rmdir {name} on A after B removed it: {other:?}"),
        }
        if a.path(&name).exists() {
            contradicted.push(format!("{name}: found after ENOENT"));
        }
    }
    assert!(
        contradicted.is_empty(),
        "A contradicted etcd's answer: {contradicted:?}"
    );
    b.stop();
    a.stop();
}

#[test]
fn mkdir_p_from_two_nodes_at_once_never_fails() {
    let Some((_fs, a, b)) = two_nodes("mkdir_p_two_nodes") else {
        return;
    };
    let failures: Vec<String> = thread::scope(|s| {
        let runs: Vec<_> = [&a, &b]
            .into_iter()
            .map(|m| {
                s.spawn(move || {
                    let mut failed = Vec::new();
                    for i in 0..60 {
                        let p = m.path(&format!("t{}/u{}/v{i}", i % 3, i % 7));
                        let out = Command::new("mkdir").arg("-p").arg(&p).output().unwrap();
                        if !out.status.success() {
                            failed.push(format!(
                                "{}: {}",
                                p.display(),
                                String::from_utf8_lossy(&out.stderr).trim()
                            ));
                        }
                    }
                    failed
                })
            })
            .collect();
        runs.into_iter().flat_map(|r| r.join().unwrap()).collect()
    });
    assert!(failures.is_empty(), "mkdir -p failed: {failures:?}");
    b.stop();
    a.stop();
}
