//! Shared open files on real mounts (issue 13, item 4): a file unlinked or renamed over on
//! one node stays whole on every node that has it open, until the last close in the cluster
//! (or the end of the lease of the last node holding it); then its space comes back.
//!
//! Two daemons mounting one filesystem on one machine stand in for two nodes (each has its
//! own session). Every test formats a small device with small allocation groups, so that
//! filling it takes seconds and any block freed too early is reused at once.
//!
//! Needs root, `/dev/fuse` and `ETCD_ENDPOINTS` (see `common`); skips loudly otherwise,
//! and fails instead when `ETCFS_REQUIRE_MOUNT_TESTS=1`.

mod common;

use std::{
    fs::{self, File, OpenOptions},
    io::Write as _,
    os::unix::fs::{FileExt as _, OpenOptionsExt as _},
    path::Path,
    time::{Duration, Instant},
};

use common::{assert_same_bytes, errno_of, eventually, loud, noise, small_groups, statfs_blocks};

const MIB: usize = 1 << 20;
const BLOCK: u64 = 4096;
/// The file held open while another node removes it.
const HELD_BYTES: usize = 24 * MIB;
/// How long the space of a closed orphan may take to show in statfs (its reclaim, then
/// the owner of its blocks folding them: about two seconds).
const SPACE_BACK_MAX: Duration = Duration::from_secs(15);
/// After a kill -9 of the holder: its lease (10 s), the orphan scan (5 s), the fold.
const SPACE_BACK_AFTER_CRASH_MAX: Duration = Duration::from_secs(45);

fn write_synced(p: &Path, data: &[u8]) {
    let mut f = File::create(p).unwrap_or_else(|e| panic!("create {}: {e}", p.display()));
    f.write_all(data)
        .unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
    f.sync_all().expect("fsync");
}

/// Opens with O_DIRECT, so that what is read later comes from the device, not from a page
/// cache filled before the other node removed the file.
fn open_direct(p: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(p)
        .unwrap_or_else(|e| panic!("open {} O_DIRECT: {e}", p.display()))
}

/// All `len` bytes of an open O_DIRECT file.
fn read_all_direct(f: &File, len: usize) -> Vec<u8> {
    const CHUNK: usize = MIB;
    let mut raw = vec![0u8; CHUNK + 4096];
    let at = raw.as_ptr().align_offset(4096);
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let n = f
            .read_at(&mut raw[at..at + CHUNK], out.len() as u64)
            .expect("O_DIRECT read of the held file");
        if n == 0 {
            break;
        }
        out.extend_from_slice(&raw[at..at + n]);
    }
    out
}

/// Writes 1 MiB chunks into new files under `dir` until ENOSPC (or `max` bytes): most
/// of the device's free blocks, the freed ones among them, get new data. Returns bytes
/// written.
fn fill(dir: &Path, max: usize) -> usize {
    let chunk = vec![0xa5u8; MIB];
    let mut written = 0;
    for i in 0.. {
        let p = dir.join(format!("fill{i}"));
        let mut f = File::create(&p).unwrap_or_else(|e| panic!("create {}: {e}", p.display()));
        for _ in 0..8 {
            let r = f.write_all(&chunk).and_then(|()| f.sync_data());
            match r {
                Ok(()) => written += MIB,
                Err(e) => {
                    assert_eq!(errno_of::<()>(Err(e)), Some(libc::ENOSPC), "filling");
                    return written;
                }
            }
            if written >= max {
                return written;
            }
        }
    }
    written
}

fn remove_fill(dir: &Path) {
    for e in fs::read_dir(dir).expect("read_dir") {
        let p = e.expect("dirent").path();
        if p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("fill"))
        {
            fs::remove_file(&p).unwrap_or_else(|e| panic!("rm {}: {e}", p.display()));
        }
    }
}

/// Waits until statfs on `mnt` shows at least `want` free blocks.
fn expect_free_at_least(mnt: &Path, want: u64, within: Duration, what: &str) -> Duration {
    let t0 = Instant::now();
    let mut free = 0;
    let ok = eventually(within, || {
        free = statfs_blocks(mnt).1;
        free >= want
    });
    assert!(
        ok,
        "{what}: {free} blocks free after {within:?}, want at least {want} ({} MiB short)",
        ((want - free) * BLOCK) >> 20
    );
    t0.elapsed()
}

/// Node B has a file open; node A unlinks it and fills the device: B reads the whole file
/// back intact. Once B closes it, the space comes back (on both nodes), and no open or
/// orphan record is left.
#[test]
fn unlinked_elsewhere_stays_whole_until_closed() {
    let Some(fs) = small_groups("unlinked_elsewhere_stays_whole", 128 << 20, 4) else {
        return;
    };
    let a = fs.mount("auto", &[]);
    let b = fs.mount_node("b", "auto", &[]);
    let data = noise(HELD_BYTES, 1);
    write_synced(&a.path("held"), &data);
    let (_, free_before) = statfs_blocks(&a.mnt);
    let held = open_direct(&b.path("held"));
    fs::remove_file(a.path("held")).expect("unlink on A");
    assert!(
        eventually(Duration::from_secs(5), || errno_of(fs::metadata(
            b.path("held")
        )) == Some(libc::ENOENT)),
        "the name is gone on B too"
    );
    assert_eq!(fs.etcd_key_count("O"), 1, "the inode is an orphan");
    let filled = fill(&a.mnt, 256 * MIB);
    let (_, free_full) = statfs_blocks(&a.mnt);
    loud(&format!(
        "unlinked_elsewhere: filled {} MiB, {} KiB left",
        filled >> 20,
        (free_full * BLOCK) >> 10
    ));
    let got = read_all_direct(&held, HELD_BYTES);
    assert_same_bytes(
        "the held file read on B after A filled the device",
        &got,
        &data,
    );
    drop(held);
    let want = free_full + (HELD_BYTES as u64 / BLOCK) - 256;
    let took = expect_free_at_least(&a.mnt, want, SPACE_BACK_MAX, "statfs on A after B's close");
    loud(&format!(
        "unlinked_elsewhere: space back on A {:.1} s after B's close",
        took.as_secs_f64()
    ));
    expect_free_at_least(&b.mnt, want, SPACE_BACK_MAX, "statfs on B after its close");
    assert_eq!(fs.etcd_key_count("O"), 0, "no orphan left");
    assert_eq!(fs.etcd_key_count("H"), 0, "no open record left");
    remove_fill(&a.mnt);
    expect_free_at_least(
        &a.mnt,
        free_before + (HELD_BYTES as u64 / BLOCK) - 256,
        SPACE_BACK_MAX,
        "statfs after removing the fill",
    );
    b.stop();
    a.stop();
}

/// Node B has a file open; node A renames another file over it and fills the device: B
/// still reads the old file whole, and its space comes back after B's close.
#[test]
fn renamed_over_elsewhere_stays_whole_until_closed() {
    let Some(fs) = small_groups("renamed_over_elsewhere", 128 << 20, 4) else {
        return;
    };
    let a = fs.mount("auto", &[]);
    let b = fs.mount_node("b", "auto", &[]);
    let old = noise(HELD_BYTES, 2);
    let new = noise(3 * MIB, 3);
    write_synced(&a.path("f"), &old);
    write_synced(&a.path("g"), &new);
    let held = open_direct(&b.path("f"));
    fs::rename(a.path("g"), a.path("f")).expect("rename over on A");
    assert_eq!(fs.etcd_key_count("O"), 1, "the replaced inode is an orphan");
    fill(&a.mnt, 256 * MIB);
    let (_, free_full) = statfs_blocks(&a.mnt);
    let got = read_all_direct(&held, HELD_BYTES);
    assert_same_bytes(
        "the replaced file read on B after A filled the device",
        &got,
        &old,
    );
    // The name is the new file.
    let f = open_direct(&a.path("f"));
    assert_same_bytes("f on A", &read_all_direct(&f, new.len() + MIB), &new);
    drop(f);
    drop(held);
    let want = free_full + (HELD_BYTES as u64 / BLOCK) - 256;
    expect_free_at_least(&a.mnt, want, SPACE_BACK_MAX, "statfs on A after B's close");
    assert_eq!(fs.etcd_key_count("O"), 0, "no orphan left");
    b.stop();
    a.stop();
}

/// Node B has an unlinked file open and is killed with SIGKILL: its open record dies with
/// its lease, and a live node reclaims the file.
#[test]
fn space_comes_back_after_the_holder_is_killed() {
    let Some(fs) = small_groups("holder_killed", 128 << 20, 4) else {
        return;
    };
    let a = fs.mount("auto", &[]);
    let b = fs.mount_node("b", "auto", &[]);
    let data = noise(HELD_BYTES, 4);
    write_synced(&a.path("held"), &data);
    let (_, free_before) = statfs_blocks(&a.mnt);
    let held = open_direct(&b.path("held"));
    fs::remove_file(a.path("held")).expect("unlink on A");
    assert_eq!(fs.etcd_key_count("O"), 1, "the inode is an orphan");
    // Still held: the space stays in use for a while (longer than a scan).
    std::thread::sleep(Duration::from_secs(6));
    let (_, free_held) = statfs_blocks(&a.mnt);
    assert!(
        free_held + (HELD_BYTES as u64 / BLOCK) / 2 < free_before + (HELD_BYTES as u64 / BLOCK),
        "the held orphan's space must stay in use ({free_held} free, {free_before} before)"
    );
    let got = read_all_direct(&held, HELD_BYTES);
    assert_same_bytes("the held file on B", &got, &data);
    let killed = Instant::now();
    b.crash();
    drop(held); // its daemon is gone; the close goes nowhere
    let want = free_before + (HELD_BYTES as u64 / BLOCK) - 256;
    expect_free_at_least(
        &a.mnt,
        want,
        SPACE_BACK_AFTER_CRASH_MAX,
        "statfs on A after B's kill -9",
    );
    loud(&format!(
        "holder_killed: space back {:.1} s after the kill",
        killed.elapsed().as_secs_f64()
    ));
    assert!(
        eventually(Duration::from_secs(5), || fs.etcd_key_count("O") == 0),
        "no orphan left"
    );
    a.stop();
}

/// One node: a file unlinked while open stays readable and writable through its
/// descriptor while the device fills, and its space comes back at its close.
#[test]
fn unlink_while_open_on_one_node() {
    let Some(fs) = small_groups("unlink_while_open_one_node", 128 << 20, 4) else {
        return;
    };
    let a = fs.mount("auto", &[]);
    let data = noise(HELD_BYTES, 5);
    let p = a.path("held");
    write_synced(&p, &data);
    let held = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .expect("open");
    fs::remove_file(&p).expect("unlink");
    let tail = noise(MIB, 6);
    let mut raw = vec![0u8; MIB + 4096];
    let at = raw.as_ptr().align_offset(4096);
    raw[at..at + MIB].copy_from_slice(&tail);
    held.write_all_at(&raw[at..at + MIB], HELD_BYTES as u64)
        .expect("write to the unlinked file");
    fill(&a.mnt, 256 * MIB);
    let (_, free_full) = statfs_blocks(&a.mnt);
    let got = read_all_direct(&held, HELD_BYTES + MIB);
    let mut want = data.clone();
    want.extend_from_slice(&tail);
    assert_same_bytes("the unlinked file after the fill", &got, &want);
    drop(held);
    let want = free_full + (HELD_BYTES as u64 / BLOCK) - 256;
    expect_free_at_least(&a.mnt, want, SPACE_BACK_MAX, "statfs after the close");
    assert_eq!(fs.etcd_key_count("O"), 0, "no orphan left");
    // The records of the files the fill wrote and closed go about a second after their
    // close (a node keeps a closed file's record a moment, for an open that follows).
    let t = std::time::Instant::now();
    while fs.etcd_key_count("H") > 0 && t.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(fs.etcd_key_count("H"), 0, "no open record left");
    a.stop();
}

/// Two nodes with one file open take turns writing small unaligned pieces into the same
/// blocks (a WAL's 24-byte headers and pages): each node merges its writes into its copy of
/// the block it last wrote (or holds them unwritten until it gives the lock up), and never
/// into one the other node has written since. Every
/// byte of both nodes' writes is there, read through each node and from the device.
#[test]
fn small_writes_taking_turns_on_two_nodes_keep_every_byte() {
    let Some(fs) = common::TestFs::new_or_skip("small_writes_two_nodes", None) else {
        return;
    };
    let a = fs.mount("auto", &[]);
    let b = fs.mount_node("b", "auto", &[]);
    const SIZE: usize = 64 << 10;
    let mut want = noise(SIZE, 7);
    write_synced(&a.path("wal"), &want);
    let open_rw = |p: &Path| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(p)
            .unwrap_or_else(|e| panic!("open {}: {e}", p.display()))
    };
    let (fa, fb) = (open_rw(&a.path("wal")), open_rw(&b.path("wal")));
    let mut put = |f: &File, off: usize, data: &[u8]| {
        f.write_all_at(data, off as u64).expect("write");
        want[off..off + data.len()].copy_from_slice(data);
    };
    for turn in 0..12usize {
        // Each turn on the other node: each turn hands the file's lock over.
        let f = if turn % 2 == 0 { &fa } else { &fb };
        for i in 0..2usize {
            let at = 32 + ((turn + i) % 14) * 4120;
            put(f, at, &noise(24, (turn * 8 + i) as u64));
            put(f, at + 24, &noise(4096, (turn * 8 + i + 100) as u64));
        }
        // Then a few bytes into each of the first four blocks, where no turn wrote before:
        // the node ends its turn holding copies of those blocks, which the other node then
        // changes; merging a copy kept over that change would lose the other's bytes.
        for k in 0..4usize {
            let at = k * 4096 + 200 + (turn * 97 + k * 13) % 3800;
            put(f, at, &noise(3, (turn * 8 + k + 200) as u64));
        }
    }
    fa.sync_all().expect("fsync on A");
    fb.sync_all().expect("fsync on B");
    assert_same_bytes(
        "read on A",
        &fs::read(a.path("wal")).expect("read on A"),
        &want,
    );
    assert_same_bytes(
        "read on B",
        &fs::read(b.path("wal")).expect("read on B"),
        &want,
    );
    let direct = open_direct(&a.path("wal"));
    assert_same_bytes("O_DIRECT read on A", &read_all_direct(&direct, SIZE), &want);
    // Merged into a kept copy on the way to the device, or held (answered before it).
    let kept = |d: &common::Daemon| {
        let c = &d.stats_json()["counters"];
        c["rmw_blocks_kept"].as_u64().unwrap_or(0) + c["writes_held"].as_u64().unwrap_or(0)
    };
    assert!(
        kept(&a) > 0 && kept(&b) > 0,
        "both nodes merged into kept or held blocks: A {}, B {}",
        kept(&a),
        kept(&b)
    );
    drop((fa, fb, direct));
    b.stop();
    a.stop();
}

/// A log appended with fdatasync, first on one node, then by two nodes taking turns. Each
/// commit of an append plans from the node's record of its last one (no etcd read: one
/// round trip per fdatasync); after the other node's turn that record is stale and must
/// not be used. Every line is in place, in order, read through each node.
#[test]
fn appends_with_fdatasync_taking_turns_on_two_nodes_keep_every_line() {
    let Some(fs) = common::TestFs::new_or_skip("appends_two_nodes", None) else {
        return;
    };
    let a = fs.mount("auto", &[]);
    let b = fs.mount_node("b", "auto", &[]);
    let append = |p: &Path| {
        OpenOptions::new()
            .append(true)
            .create(true)
            .open(p)
            .unwrap_or_else(|e| panic!("open {}: {e}", p.display()))
    };
    let counter = |d: &common::Daemon, name: &str| {
        d.stats_json()["counters"][name]
            .as_u64()
            .unwrap_or_else(|| panic!("no counter {name}"))
    };
    let line = |i: usize, node: &str| format!("line {i:05} from {node} {}\n", "x".repeat(i % 61));
    let fa = append(&a.path("log"));
    let mut want = String::new();
    let reads = counter(&a, "etcd_read_txns");
    const ALONE: usize = 100;
    for i in 0..ALONE {
        let l = line(i, "A");
        (&fa).write_all(l.as_bytes()).expect("append on A");
        fa.sync_data().expect("fdatasync on A");
        want.push_str(&l);
    }
    let read_alone = counter(&a, "etcd_read_txns") - reads;
    assert!(
        read_alone < 10,
        "{ALONE} appends and fdatasyncs on one node read etcd {read_alone} times"
    );
    let fb = append(&b.path("log"));
    for turn in 0..40usize {
        let (f, node) = if turn % 2 == 0 {
            (&fb, "B")
        } else {
            (&fa, "A")
        };
        for k in 0..3 {
            let l = line(ALONE + turn * 3 + k, node);
            let mut w: &File = f;
            w.write_all(l.as_bytes()).expect("append");
            f.sync_data().expect("fdatasync");
            want.push_str(&l);
        }
    }
    for (d, what) in [(&a, "A"), (&b, "B")] {
        let got = fs::read_to_string(d.path("log")).expect("read the log");
        assert_same_bytes(&format!("read on {what}"), got.as_bytes(), want.as_bytes());
        // 20 turns each: a node planning from its record after the other's turn fails
        // a compare every turn.
        let failed = counter(d, "etcd_compare_failures");
        assert!(
            failed < 5,
            "node {what}: {failed} commits planned from a stale record"
        );
    }
    drop((fa, fb));
    b.stop();
    a.stop();
}
