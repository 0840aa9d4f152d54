//! Space that moves between nodes and recovery of a dead node's state (issue 14, items 3
//! and 4), on real mounts of the real `etcfs` binary with a real etcd:
//!
//! * a node killed with kill -9 while it holds a file's cache lock, allocation groups, an
//!   fcntl lock and an unlinked file it still has open: a node already mounted gets all of
//!   them within the lease TTL plus a margin, every byte the dead node fsync'd is there,
//!   and nothing of the dead session is left in etcd;
//! * three nodes writing at once until the device is full: ENOSPC only once it is (the
//!   bound is at [`FULL_WITHIN`]), statfs on every node agrees with what is free, and
//!   deleting everything gives all the space back.
//!
//! Needs root, `/dev/fuse` and `ETCD_ENDPOINTS` (see `common`); skips loudly otherwise,
//! and fails instead when `ETCFS_REQUIRE_MOUNT_TESTS=1`.

mod common;

use std::{
    collections::BTreeMap,
    fs::{self, File, OpenOptions},
    io::{ErrorKind, Read as _},
    os::unix::fs::FileExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Barrier, OnceLock},
    thread,
    time::{Duration, Instant},
};

use common::{
    assert_same_bytes, digest, eventually, loud, next_id, noise, run_ok, small_groups,
    statfs_blocks, TestFs,
};

const MIB: u64 = 1 << 20;
/// The default session lease TTL (`--lease-ttl` does not exist yet).
const LEASE_TTL: Duration = Duration::from_secs(10);
/// What recovery may take beyond the TTL: the orphan scan runs every 5 s, a lock waiter
/// asks again every second, and the VM is shared.
const MARGIN: Duration = Duration::from_secs(10);
/// Device of the space tests, and its allocation groups.
const DEVICE: u64 = 64 * MIB;
const GROUP_MIB: u64 = 4;
/// How full the device must be when the last writer gets ENOSPC: less than one write
/// (the writers retry smaller writes down to [`WRITE_MIN`]) plus one block per node (the
/// last write's size rounded up to whole blocks), with a group's worth of slack for the
/// space a node may be holding reserved for its write in flight when another asks. Each
/// node keeps asking for space while the device has it, and owners hand over a group
/// with free space at each ask, even their last, so no free space stays out of reach.
const FULL_WITHIN: u64 = GROUP_MIB * MIB;
const WRITE_MIN: usize = 64 << 10;
/// statfs of two nodes agree within this once writes have stopped and frees are folded
/// (blocks of 4 KiB): the same maps, read at slightly different times.
const STATFS_SLACK_BLOCKS: u64 = 16;

/// A fcntl write lock on a whole file, taken by a process of its own: `lk PATH` answers
/// `ok` or `E <errno>` (F_SETLK, not waiting) and exits; `lk PATH hold` keeps the lock
/// until killed. Tests may not use `unsafe` (tests/tidy.rs), so the lock is taken in C.
const LK_C: &str = r#"
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    struct flock fl;
    int fd = open(argv[1], O_RDWR);
    if (fd < 0) { printf("E %d\n", errno); return 1; }
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (fcntl(fd, F_SETLK, &fl) != 0) { printf("E %d\n", errno); return 1; }
    printf("ok\n");
    fflush(stdout);
    if (argc > 2) pause();
    return 0;
}
"#;

fn lk_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        fs::create_dir_all(&dir).expect("create CARGO_TARGET_TMPDIR");
        let bin = dir.join(format!("etcfs-lk-{:016x}", digest(LK_C.as_bytes())));
        if bin.exists() {
            return bin;
        }
        let tmp = dir.join(format!("lk-{}-{}", std::process::id(), next_id()));
        let src = tmp.with_extension("c");
        fs::write(&src, LK_C).expect("write the lock program");
        run_ok(Command::new("cc").args(["-O1", "-o"]).arg(&tmp).arg(&src));
        let _ = fs::remove_file(&src);
        fs::rename(&tmp, &bin).expect("install the lock program");
        bin
    })
}

/// Tries the lock once: `ok` or `E <errno>`.
fn try_lock(p: &Path) -> String {
    let out = Command::new(lk_path())
        .arg(p)
        .output()
        .expect("run the lock program");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A process holding the lock on `p`; killed when dropped.
struct Holder(Child);

impl Holder {
    fn on(p: &Path) -> Holder {
        let mut child = Command::new(lk_path())
            .arg(p)
            .arg("hold")
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the lock holder");
        let mut first = [0u8; 3];
        child
            .stdout
            .as_mut()
            .expect("stdout")
            .read_exact(&mut first)
            .expect("the holder answers");
        assert_eq!(&first, b"ok\n", "the holder took the lock");
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every key under the filesystem's prefix: (key after `<prefix>/`, value, lease).
fn etcd_keys(fs: &TestFs) -> Vec<(Vec<u8>, Vec<u8>, i64)> {
    let out = run_ok(
        Command::new("etcdctl")
            .args(["--endpoints", &fs.endpoints, "get", "--prefix"])
            .arg(format!("{}/", fs.prefix))
            .args(["-w", "json"]),
    );
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("etcdctl json ({e}): {out}"));
    let skip = fs.prefix.len() + 1;
    v["kvs"]
        .as_array()
        .map(|a| a.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|kv| {
            let key = base64(kv["key"].as_str().unwrap_or_default());
            let value = base64(kv["value"].as_str().unwrap_or_default());
            let lease = kv["lease"].as_i64().unwrap_or(0);
            (key[skip..].to_vec(), value, lease)
        })
        .collect()
}

fn base64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {s}"),
    };
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for c in s.bytes().filter(|c| *c != b'=') {
        acc = (acc << 6) | u32::from(val(c));
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

fn be64(b: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(..8)?.try_into().ok()?))
}

/// The session a key belongs to, for the keys that carry one (docs/key-schema.md).
fn session_of(key: &[u8], value: &[u8]) -> Option<u64> {
    let (&tag, body) = key.split_first()?;
    match tag {
        b'M' | b'W' => be64(body),
        b'K' | b'Q' | b'H' | b'B' => be64(body.get(8..)?),
        b'G' => Some(u64::from_le_bytes(value.get(1..9)?.try_into().ok()?)),
        _ => None,
    }
}

/// The sessions registered now (`M` keys).
fn sessions(fs: &TestFs) -> Vec<u64> {
    etcd_keys(fs)
        .iter()
        .filter(|(k, _, _)| k.first() == Some(&b'M'))
        .filter_map(|(k, v, _)| session_of(k, v))
        .collect()
}

/// Keys of session `s`, by tag, and keys under its lease.
fn keys_of_session(fs: &TestFs, s: u64) -> BTreeMap<char, usize> {
    let mut out = BTreeMap::new();
    for (k, v, lease) in etcd_keys(fs) {
        if session_of(&k, &v) == Some(s) || lease as u64 == s {
            *out.entry(k[0] as char).or_default() += 1;
        }
    }
    out
}

fn write_synced(p: &Path, data: &[u8]) -> File {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(p)
        .unwrap_or_else(|e| panic!("create {}: {e}", p.display()));
    f.write_all_at(data, 0)
        .unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
    f.sync_all()
        .unwrap_or_else(|e| panic!("fsync {}: {e}", p.display()));
    f
}

/// Writes files of `file` bytes in `dir` until ENOSPC, retrying a refused write in halves
/// down to [`WRITE_MIN`]; returns the bytes written (fsync'd) and the files.
fn fill(dir: &Path, tag: &str, file: usize, seed: u64) -> (u64, Vec<PathBuf>) {
    let mut written = 0u64;
    let mut files = Vec::new();
    let data = noise(file, seed);
    for n in 0.. {
        let p = dir.join(format!("{tag}-{n}"));
        let f = match File::create(&p) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("create {}: {e}", p.display()),
        };
        files.push(p.clone());
        let mut at = 0usize;
        let mut chunk = 1 << 20;
        let mut full = false;
        while at < file {
            let len = chunk.min(file - at);
            match f.write_all_at(&data[at..at + len], at as u64) {
                Ok(()) => at += len,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                    if chunk <= WRITE_MIN {
                        full = true;
                        break;
                    }
                    chunk /= 2;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => panic!("write {}: {e}", p.display()),
            }
        }
        match f.sync_all() {
            Ok(()) => written += at as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => full = true,
            Err(e) => panic!("fsync {}: {e}", p.display()),
        }
        if full {
            break;
        }
    }
    (written, files)
}

fn free_bytes(mnt: &Path) -> u64 {
    statfs_blocks(mnt).1 * 4096
}

/// A node killed while it holds a file's cache lock (with writes behind), allocation
/// groups with free space in them, an fcntl lock and an unlinked file it has open. The
/// survivor, mounted before the kill (a mount would revoke a dead local session at once,
/// and the TTL path would go untested), gets the lock, the fcntl lock, the orphan's
/// space and the groups (it fills the device, which needs the dead node's groups), each
/// within the TTL plus a margin; every fsync'd byte is there, before and after the fill.
#[test]
fn a_killed_node_leaves_locks_groups_and_orphans_to_a_survivor() {
    let Some(fs) = small_groups("a_killed_node_leaves_everything", DEVICE, GROUP_MIB) else {
        return;
    };
    let a = fs.mount_node("a", "auto", &[]);
    let a_session = sessions(&fs);
    assert_eq!(a_session.len(), 1, "only A is mounted");
    let a_session = a_session[0];
    let b = fs.mount_node("b", "auto", &[]);

    // A: 24 MiB fsync'd, the file kept open.
    let keep = noise((24 * MIB) as usize, 1);
    let fk = write_synced(&a.path("keep"), &keep);
    // An unlinked file A still has open.
    let orphan = write_synced(&a.path("orphan"), &noise((8 * MIB) as usize, 3));
    fs::remove_file(a.path("orphan")).expect("unlink on A");
    // Free space inside A's groups: a file written and deleted.
    drop(write_synced(&a.path("hole"), &noise((8 * MIB) as usize, 4)));
    fs::remove_file(a.path("hole")).expect("unlink on A");
    // An fcntl lock through A.
    let holder = Holder::on(&a.path("keep"));
    assert_eq!(try_lock(&b.path("keep")), "E 11", "B sees A's lock");
    // A write behind, last: A holds the file's cache lock exclusively when it dies (B's
    // open above had it share it).
    fk.write_all_at(&noise(MIB as usize, 2), 24 * MIB)
        .expect("write behind on A");
    assert_eq!(
        fs.etcd_key_count("O"),
        1,
        "the open unlinked file is an orphan"
    );
    let before = keys_of_session(&fs, a_session);
    for tag in ['M', 'G', 'H', 'K', 'B'] {
        assert!(before.contains_key(&tag), "A has {tag} keys: {before:?}");
    }
    let free_before = free_bytes(&b.mnt);

    let killed = Instant::now();
    assert!(a.crash(), "A's daemon exits by itself after SIGKILL");
    drop(holder);
    drop(orphan);
    drop(fk);
    let deadline = LEASE_TTL + MARGIN;

    // The cache lock: B reads what A fsync'd.
    let got = fs::read(b.path("keep")).expect("read on B");
    let waited = killed.elapsed();
    assert!(got.len() >= keep.len(), "the fsync'd bytes are all there");
    assert_same_bytes("keep on B", &got[..keep.len()], &keep);
    assert!(
        waited < deadline,
        "B waited {waited:?} for the dead node's lock"
    );
    loud(&format!("recovery: cache lock after {waited:?}"));

    // The fcntl lock.
    assert!(
        eventually(deadline.saturating_sub(killed.elapsed()), || try_lock(
            &b.path("keep")
        ) == "ok"),
        "B still cannot take the dead node's fcntl lock {:?} after the kill",
        killed.elapsed()
    );
    loud(&format!(
        "recovery: fcntl lock after {:?}",
        killed.elapsed()
    ));

    // The orphan: reclaimed, its 8 MiB back.
    let mut free = 0;
    let reclaimed = eventually(deadline.saturating_sub(killed.elapsed()), || {
        free = free_bytes(&b.mnt);
        fs.etcd_key_count("O") == 0 && free >= free_before + 7 * MIB
    });
    assert!(
        reclaimed,
        "{:?} after the kill: {} orphan record(s), free {} MiB (was {} MiB with the orphan)",
        killed.elapsed(),
        fs.etcd_key_count("O"),
        free / MIB,
        free_before / MIB
    );
    loud(&format!(
        "recovery: orphan reclaimed after {:?}",
        killed.elapsed()
    ));

    // Nothing of A is left in etcd: every key it had (M, G, H, K, Q, B, W) was leased.
    let mut left = BTreeMap::new();
    assert!(
        eventually(deadline.saturating_sub(killed.elapsed()), || {
            left = keys_of_session(&fs, a_session);
            left.is_empty()
        }),
        "keys of the dead session left: {left:?}"
    );

    // The groups: B fills the device, which needs A's (the hole is in them).
    let free_now = free_bytes(&b.mnt);
    let (written, files) = fill(&b.mnt, "fill", (4 * MIB) as usize, 5);
    let took = killed.elapsed();
    loud(&format!(
        "recovery: B wrote {} MiB of {} MiB free ({took:?} after the kill)",
        written / MIB,
        free_now / MIB
    ));
    assert!(
        written + FULL_WITHIN >= free_now,
        "B wrote {} KiB of {} KiB free: the dead node's groups were not taken",
        written >> 10,
        free_now >> 10
    );
    let got = fs::read(b.path("keep")).expect("read on B after the fill");
    assert_same_bytes("keep after the fill", &got[..keep.len()], &keep);
    for p in files {
        fs::remove_file(&p).expect("unlink the fill");
    }
    assert!(
        eventually(Duration::from_secs(20), || free_bytes(&b.mnt) + MIB
            >= free_now),
        "the fill's space did not come back: {} MiB free, {} MiB before",
        free_bytes(&b.mnt) / MIB,
        free_now / MIB
    );
}

/// Three nodes write at once until the device is full. No node may get ENOSPC while the
/// device has more than [`FULL_WITHIN`] free; then statfs agrees on every node, and once
/// everything is deleted the whole device is free again.
#[test]
fn three_nodes_fill_the_device_and_get_enospc_only_when_it_is_full() {
    let Some(fs) = small_groups("three_nodes_fill_the_device", DEVICE, GROUP_MIB) else {
        return;
    };
    let nodes: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|n| fs.mount_node(n, "auto", &[]))
        .collect();
    let (total, empty) = statfs_blocks(&nodes[0].mnt);
    loud(&format!(
        "three writers: {} blocks, {} free when empty",
        total, empty
    ));
    for n in &nodes {
        fs::create_dir(n.path(&format!("d-{}", n.pid()))).expect("mkdir");
    }
    let go = Arc::new(Barrier::new(nodes.len()));
    let started = Instant::now();
    let writers: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let dir = n.path(&format!("d-{}", n.pid()));
            let mnt = n.mnt.clone();
            let go = go.clone();
            thread::spawn(move || {
                go.wait();
                let (written, files) = fill(&dir, "w", (3 * MIB) as usize, 10 + i as u64);
                let at = started.elapsed();
                let free = free_bytes(&mnt);
                (written, files, at, free)
            })
        })
        .collect();
    let results: Vec<_> = writers
        .into_iter()
        .map(|w| w.join().expect("writer"))
        .collect();
    // An ENOSPC because nobody handed space over in time is one with the device not full
    // (every node waited with its last group held by its own writes behind, and none
    // could hand anything over: all three waited SPACE_WAIT_MAX, 15 s).
    for n in &nodes {
        let log = n.log_text();
        assert!(
            !log.contains("no node handed over space"),
            "a node gave up waiting for space:\n{log}"
        );
    }
    let mut written = 0;
    for (i, (w, files, at, free)) in results.iter().enumerate() {
        loud(&format!(
            "writer {i}: {} KiB in {} files, ENOSPC after {at:?} with {} KiB free on its node",
            w >> 10,
            files.len(),
            free >> 10
        ));
        written += w;
    }
    // Frees of failed writes and folds settle within a few seconds.
    thread::sleep(Duration::from_secs(3));
    let frees: Vec<u64> = nodes.iter().map(|n| statfs_blocks(&n.mnt).1).collect();
    loud(&format!(
        "three writers: {} KiB written; free blocks by node {frees:?}",
        written >> 10
    ));
    let (lo, hi) = (
        *frees.iter().min().expect("nodes"),
        *frees.iter().max().expect("nodes"),
    );
    assert!(
        hi - lo <= STATFS_SLACK_BLOCKS,
        "statfs differs between nodes: {frees:?}"
    );
    assert!(
        hi * 4096 <= FULL_WITHIN,
        "every writer got ENOSPC with {} KiB still free (bound {} KiB)",
        hi * 4,
        FULL_WITHIN >> 10
    );
    assert!(
        written + hi * 4096 + FULL_WITHIN >= empty * 4096,
        "written {} KiB + free {} KiB fall short of the device's {} KiB",
        written >> 10,
        hi * 4,
        empty * 4
    );
    // Every file reads back whole on another node.
    for (i, (_, files, _, _)) in results.iter().enumerate() {
        let other = &nodes[(i + 1) % nodes.len()];
        let data = noise((3 * MIB) as usize, 10 + i as u64);
        for p in files {
            let rel = p.strip_prefix(&nodes[i].mnt).expect("under the mount");
            let got = fs::read(other.mnt.join(rel)).expect("read on another node");
            assert_same_bytes(&rel.display().to_string(), &got, &data[..got.len()]);
        }
    }
    for (_, files, _, _) in &results {
        for p in files {
            fs::remove_file(p).expect("unlink");
        }
    }
    let mut now = Vec::new();
    let back = eventually(Duration::from_secs(30), || {
        now = nodes.iter().map(|n| statfs_blocks(&n.mnt).1).collect();
        now.iter().all(|f| f + STATFS_SLACK_BLOCKS >= empty)
    });
    assert!(
        back,
        "after deleting everything: free blocks by node {now:?}, {empty} when empty"
    );
}
