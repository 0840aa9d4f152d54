//! Crash tests: `kill -9` of the etcfs daemon (the pid this test started), `umount -l` of
//! the dead mount, remount of the same device and etcd prefix. What was fsync'd must be
//! there, byte for byte; an unlinked-but-open file's orphan record and blocks must be
//! reclaimed; data written after the remount must not land on blocks that hold data.
//!
//! Timing: the crashed daemon's etcd session lease (10 s TTL, `meta::session`) must expire
//! before another session may reclaim its orphans; the new daemon looks for dead sessions'
//! orphans when it opens the filesystem and then every 5 s (housekeeping), so reclaiming
//! takes about 10–15 s after the kill. The test waits at most [`RECLAIM_DEADLINE`].
//!
//! A killed daemon that has not died 3 s after SIGKILL gets its FUSE connection aborted
//! through fusectl (`common::Daemon::crash`), so these tests cannot hang; that it happens
//! at all is a bug, checked by `killed_daemon_exits_by_itself`.
//!
//! Needs root, `/dev/fuse` and `ETCD_ENDPOINTS` (see `common`); skips loudly otherwise,
//! and fails instead when `ETCFS_REQUIRE_MOUNT_TESTS=1`.

mod common;

use std::{
    fs::{self, File, OpenOptions},
    io::Write as _,
    os::unix::fs::{FileExt as _, MetadataExt as _, PermissionsExt as _},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use common::{assert_same_bytes, df_avail, eventually, loud, pattern, sorted_names, TestFs};

const MIB: u64 = 1 << 20;
/// Lease TTL (10 s) + housekeeping interval (5 s) + margin.
const RECLAIM_DEADLINE: Duration = Duration::from_secs(40);

fn write_synced(p: &std::path::Path, data: &[u8]) {
    let mut f = File::create(p).unwrap_or_else(|e| panic!("create {}: {e}", p.display()));
    for chunk in data.chunks(777_777) {
        f.write_all(chunk).expect("write");
    }
    f.sync_all().expect("fsync");
}

fn fsync_dir(p: &std::path::Path) {
    File::open(p)
        .and_then(|d| d.sync_all())
        .unwrap_or_else(|e| panic!("fsync dir {}: {e}", p.display()));
}

#[test]
fn fsynced_data_survives_kill9() {
    let Some(fs) = TestFs::new_or_skip("fsynced_data_survives_kill9", None) else {
        return;
    };
    let m = fs.mount("auto", &[]);
    let big = pattern(6 * MIB as usize + 12_345, 0x33);
    write_synced(&m.path("big"), &big);
    // An in-place overwrite of fsync'd data, fsync'd again.
    let mut big2 = big.clone();
    let patch = pattern(100_000, 0x77);
    big2[3_000_001..3_100_001].copy_from_slice(&patch);
    {
        let f = OpenOptions::new()
            .write(true)
            .open(m.path("big"))
            .expect("open");
        f.write_all_at(&patch, 3_000_001).expect("overwrite");
        f.sync_data().expect("fdatasync");
    }
    // Namespace changes, made durable with fsync on their directories.
    fs::create_dir(m.path("d")).expect("mkdir d");
    fs::create_dir(m.path("d/sub")).expect("mkdir d/sub");
    write_synced(&m.path("d/sub/leaf"), b"leaf");
    write_synced(&m.path("d/final"), b"version 1");
    // The atomic-replace idiom: write a temp file, fsync, rename over, fsync the directory.
    write_synced(&m.path("d/final.tmp"), b"version 2");
    fs::rename(m.path("d/final.tmp"), m.path("d/final")).expect("rename over");
    write_synced(&m.path("moved"), &pattern(40_000, 1));
    fs::rename(m.path("moved"), m.path("d/moved")).expect("rename across");
    std::os::unix::fs::symlink("sub/leaf", m.path("d/link")).expect("symlink");
    fs::hard_link(m.path("d/sub/leaf"), m.path("hard")).expect("link");
    fs::set_permissions(m.path("hard"), fs::Permissions::from_mode(0o600)).expect("chmod");
    write_synced(&m.path("gone"), b"removed before the crash");
    fs::remove_file(m.path("gone")).expect("unlink");
    {
        let f = OpenOptions::new()
            .write(true)
            .open(m.path("d/moved"))
            .expect("open");
        f.set_len(12_345).expect("truncate");
        f.sync_all().expect("fsync");
    }
    fsync_dir(&m.path("d/sub"));
    fsync_dir(&m.path("d"));
    fsync_dir(&m.mnt);

    m.crash();

    let m = fs.mount("auto", &[]);
    let check = |m: &common::Daemon, when: &str| {
        assert_same_bytes(
            &format!("big {when}"),
            &fs::read(m.path("big")).expect("read big"),
            &big2,
        );
        assert_eq!(sorted_names(&m.mnt), ["big", "d", "hard"], "{when}");
        assert_eq!(
            sorted_names(&m.path("d")),
            ["final", "link", "moved", "sub"],
            "{when}"
        );
        assert_eq!(
            fs::read(m.path("d/final")).expect("read final"),
            b"version 2"
        );
        assert_eq!(fs::read(m.path("d/sub/leaf")).expect("read leaf"), b"leaf");
        assert_eq!(fs::read(m.path("d/link")).expect("read via link"), b"leaf");
        assert_eq!(
            fs::read_link(m.path("d/link")).expect("readlink"),
            std::path::Path::new("sub/leaf")
        );
        let md = fs::metadata(m.path("hard")).expect("stat hard");
        assert_eq!(md.nlink(), 2, "{when}: link count");
        assert_eq!(md.mode() & 0o7777, 0o600, "{when}: mode");
        assert_eq!(
            md.ino(),
            fs::metadata(m.path("d/sub/leaf")).expect("stat").ino()
        );
        assert_eq!(
            fs::read(m.path("d/moved")).expect("read moved"),
            pattern(40_000, 1)[..12_345]
        );
    };
    check(&m, "after kill -9 and remount");
    // New data after the crash must not be written over blocks the crashed daemon used.
    let fresh = pattern(32 * MIB as usize, 0x99);
    write_synced(&m.path("fresh"), &fresh);
    fs::remove_file(m.path("fresh")).expect("unlink fresh");
    check(&m, "after writing 32 MiB more");
    m.stop();
    let m = fs.mount("auto", &[]);
    check(&m, "after a clean remount");
}

/// Small overwrites a node holds before writing them (`files::HeldBlocks`): what was
/// fdatasync'd survives kill -9 byte for byte; a held write not synced is, after the
/// crash, either all there or not at all, never torn.
#[test]
fn small_overwrites_fsynced_survive_kill9_unsynced_are_old_or_new() {
    let Some(fs) = TestFs::new_or_skip("small_overwrites_kill9", None) else {
        return;
    };
    // The counter is read over --metrics: `etcfs stats` would be a child process, and its
    // exec closes an inherited copy of the file's descriptor (a FLUSH, which writes out).
    let port = common::free_port();
    let m = fs.mount("auto", &["--metrics", &format!("127.0.0.1:{port}")]);
    const SIZE: usize = 256 << 10;
    let mut synced = pattern(SIZE, 0x21);
    write_synced(&m.path("db"), &synced);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("db"))
        .expect("open db");
    let mut now = synced.clone();
    let held = || -> u64 {
        let (code, text) = common::http_get(port, "/metrics");
        assert_eq!(code, 200, "{text}");
        text.lines()
            .find_map(|l| l.strip_prefix("etcfs_writes_held_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no etcfs_writes_held_total in {text}")) as u64
    };
    let put = |now: &mut Vec<u8>, off: usize, data: &[u8]| {
        f.write_all_at(data, off as u64).expect("overwrite");
        now[off..off + data.len()].copy_from_slice(data);
    };
    // WAL-like: 24-byte headers and unaligned pages, synced every few frames.
    for i in 0..60usize {
        let at = 32 + (i % 40) * (4096 + 24);
        put(&mut now, at, &pattern(24, i as u8));
        put(&mut now, at + 24, &pattern(4096, (i + 100) as u8));
        if i % 5 == 4 {
            f.sync_data().expect("fdatasync");
            synced.clone_from(&now);
        }
    }
    // Then whole-block writes never synced: held, not yet on the device.
    let first: Vec<(usize, Vec<u8>)> = (0..20usize)
        .map(|k| (k * 8192 + 4096, pattern(4096, (k + 200) as u8)))
        .collect();
    let held_before = held();
    for (at, data) in &first {
        put(&mut now, *at, data);
    }
    assert!(held() >= held_before + 20, "the writes were not held");
    // Not read back before the crash: a READ writes out what is held first.
    m.crash();
    drop(f);

    let m = fs.mount("auto", &[]);
    let mut got = fs::read(m.path("db")).expect("read db after the crash");
    assert_eq!(got.len(), SIZE);
    let mut lost = 0;
    for (at, data) in &first {
        let region = &mut got[*at..at + data.len()];
        if region != &data[..] {
            lost += 1;
            assert_eq!(region, &synced[*at..at + data.len()], "write at {at} torn");
        }
        synced[*at..at + data.len()].copy_from_slice(region);
    }
    assert_same_bytes("db after kill -9 and remount", &got, &synced);
    eprintln!("{lost} of {} held writes lost with the daemon", first.len());
    m.stop();
}

#[test]
fn unlinked_open_file_reclaimed_after_kill9() {
    let Some(fs) = TestFs::new_or_skip("unlinked_open_file_reclaimed_after_kill9", None) else {
        return;
    };
    let m = fs.mount("auto", &[]);
    let avail0 = df_avail(&m.mnt);
    let p = m.path("victim");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .expect("create");
    let data = pattern(32 * MIB as usize, 0x42);
    f.write_all_at(&data, 0).expect("write");
    f.sync_all().expect("fsync");
    fs::remove_file(&p).expect("unlink while open");
    assert_eq!(
        fs.etcd_key_count("O"),
        1,
        "an open unlinked file has an orphan record"
    );
    let avail_held = df_avail(&m.mnt);
    assert!(
        avail_held <= avail0 - 31 * MIB,
        "the open unlinked file's space must be in use before the crash"
    );
    let killed = Instant::now();
    m.crash();
    drop(f); // its daemon is gone; the close goes nowhere

    let m = fs.mount("auto", &[]);
    assert_eq!(errno(fs::metadata(&p)), Some(libc::ENOENT));
    let mut orphans = u64::MAX;
    let mut avail = 0;
    let reclaimed = eventually(RECLAIM_DEADLINE, || {
        orphans = fs.etcd_key_count("O");
        avail = df_avail(&m.mnt);
        orphans == 0 && avail >= avail0 - MIB
    });
    assert!(
        reclaimed,
        "{RECLAIM_DEADLINE:?} after kill -9: {orphans} orphan record(s), {} MiB of the \
         unlinked file's 32 MiB still in use",
        (avail0.saturating_sub(avail)) >> 20
    );
    loud(&format!(
        "unlinked_open_file_reclaimed_after_kill9: reclaimed {:.1} s after the kill",
        killed.elapsed().as_secs_f64()
    ));
    // The reclaimed blocks are usable.
    write_synced(&m.path("after"), &pattern(8 * MIB as usize, 1));
    assert_same_bytes(
        "after",
        &fs::read(m.path("after")).expect("read"),
        &pattern(8 * MIB as usize, 1),
    );
}

/// Sets the flag when dropped, so background threads stop even when the test panics.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn errno<T>(r: std::io::Result<T>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

#[test]
fn kill9_during_writes_leaves_a_consistent_filesystem() {
    let Some(fs) = TestFs::new_or_skip("kill9_during_writes", None) else {
        return;
    };
    let m = fs.mount("auto", &[]);
    // Durable before the storm.
    let keep = pattern(2 * MIB as usize, 7);
    write_synced(&m.path("keep"), &keep);
    fsync_dir(&m.mnt);
    fs::create_dir(m.path("storm")).expect("mkdir");
    fsync_dir(&m.mnt);
    // Two writers create, write, rename and unlink files until the daemon dies. The guard
    // stops them however this test ends.
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_guard = StopOnDrop(stop.clone());
    let ops = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..2u8)
        .map(|w| {
            let dir = m.path("storm");
            let (stop, ops) = (stop.clone(), ops.clone());
            thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let p = dir.join(format!("w{w}-{i}"));
                    let r = File::create(&p)
                        .and_then(|mut f| f.write_all(&pattern(300_000, w)))
                        .and_then(|_| fs::rename(&p, dir.join(format!("w{w}-{i}.done"))))
                        .and_then(|_| {
                            if i % 3 == 0 {
                                fs::remove_file(dir.join(format!("w{w}-{i}.done")))
                            } else {
                                Ok(())
                            }
                        });
                    if r.is_err() {
                        thread::sleep(Duration::from_millis(5));
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    let start = Instant::now();
    while ops.load(Ordering::Relaxed) < 40 && start.elapsed() < Duration::from_secs(20) {
        thread::sleep(Duration::from_millis(20));
    }
    m.crash();
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().expect("writer");
    }

    let m = fs.mount("auto", &[]);
    assert_same_bytes(
        "fsync'd file",
        &fs::read(m.path("keep")).expect("read keep"),
        &keep,
    );
    // Every name that survived is a whole, readable object: no EIO, no dangling entry.
    let mut files = 0;
    for e in fs::read_dir(m.path("storm")).expect("readdir storm") {
        let e = e.expect("entry");
        let md = fs::metadata(e.path())
            .unwrap_or_else(|err| panic!("stat {:?} after the crash: {err}", e.file_name()));
        assert!(md.is_file());
        let data = fs::read(e.path())
            .unwrap_or_else(|err| panic!("read {:?} after the crash: {err}", e.file_name()));
        assert_eq!(data.len() as u64, md.len());
        files += 1;
    }
    // And the filesystem takes new work.
    fs::create_dir(m.path("storm/after")).expect("mkdir after the crash");
    write_synced(&m.path("storm/after/x"), b"x");
    fs::remove_dir_all(m.path("storm")).expect("rm -r after the crash");
    loud(&format!(
        "kill9_during_writes: {} writer ops before the kill, {files} files survived",
        ops.load(Ordering::SeqCst)
    ));
}

/// A daemon killed with SIGKILL while applications create files in a directory dies by
/// itself. It used to fail to: its cache-invalidation thread sat in the kernel
/// (`fuse_reverse_inval_entry`, uninterruptible) waiting for the lock of that directory,
/// which an application held while it waited for the dead daemon's answer to CREATE, and
/// the half-dead process kept /dev/fuse open, so the connection was never aborted. The
/// daemon no longer notifies the kernel of its own commits (recognised by revision), so
/// with one node nothing waits for a directory lock. Kills under a create load, several
/// times, at times spread over the coalesced-timestamp interval (those writes are still
/// reported, as INVAL_INODE, which takes no directory lock); each time the daemon must be
/// gone within 3 s without help.
///
/// Another node's change to a directory in which requests are in flight here still makes
/// a killed daemon wait in `fuse_reverse_inval_entry` (see README, 'When a daemon dies'):
/// with a second mount creating in the same directory, 5 kills in 6 hung. Not exercised
/// here: there is no fix from userspace (the kernel takes the directory lock
/// uninterruptibly, and creates hold it across the round trip to us).
#[test]
fn killed_daemon_exits_by_itself() {
    let Some(fs) = TestFs::new_or_skip("killed_daemon_exits_by_itself", None) else {
        return;
    };
    const ROUNDS: usize = 8;
    let mut stuck = Vec::new();
    for round in 0..ROUNDS {
        let m = fs.mount("auto", &[]);
        let dir = m.path(&format!("r{round}"));
        fs::create_dir(&dir).expect("mkdir");
        let stop = Arc::new(AtomicBool::new(false));
        let _stop_guard = StopOnDrop(stop.clone());
        let ops = Arc::new(AtomicU64::new(0));
        let creators: Vec<_> = (0..4)
            .map(|t| {
                let (dir, stop, ops) = (dir.clone(), stop.clone(), ops.clone());
                thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        if File::create(dir.join(format!("t{t}-{i}"))).is_err() {
                            thread::sleep(Duration::from_millis(5));
                        }
                        ops.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                })
            })
            .collect();
        let start = Instant::now();
        let at_least = Duration::from_millis(300 * round as u64);
        while (ops.load(Ordering::Relaxed) < 200 || start.elapsed() < at_least)
            && start.elapsed() < Duration::from_secs(10)
        {
            thread::sleep(Duration::from_millis(5));
        }
        if !m.crash() {
            stuck.push(round);
        }
        stop.store(true, Ordering::SeqCst);
        for c in creators {
            c.join().expect("creator thread");
        }
    }
    assert!(
        stuck.is_empty(),
        "in rounds {stuck:?} of {ROUNDS} the SIGKILLed daemon did not exit within 3 s until \
         its FUSE connection was aborted through fusectl"
    );
}

/// Write-behind: appends fsync'd while their file stays open survive kill -9 byte for
/// byte. Appends never fsync'd leave a prefix of what was written (at least what the
/// 1 s age bound committed; past it the file ends or reads zeros, never other bytes), and
/// the space the remount reports as used is the committed data's, give or take the
/// pending bound (64 MiB).
#[test]
fn appends_after_kill9_fsynced_whole_unsynced_a_prefix() {
    let Some(fs) = TestFs::new_or_skip("appends_after_kill9", None) else {
        return;
    };
    let m = fs.mount("auto", &[]);
    let synced = pattern(5 * MIB as usize + 777, 0x21);
    let mut a = File::create(m.path("synced")).expect("create synced");
    for c in synced.chunks(128 * 1024) {
        a.write_all(c).expect("append");
    }
    a.sync_data().expect("fdatasync");
    let avail0 = df_avail(&m.mnt);
    let loose = pattern(20 * MIB as usize + 333, 0x5a);
    let half = 10 * MIB as usize;
    let mut b = File::create(m.path("loose")).expect("create loose");
    for c in loose[..half].chunks(128 * 1024) {
        b.write_all(c).expect("append");
    }
    // Past the age bound: the first half commits without fsync.
    thread::sleep(Duration::from_millis(2500));
    for c in loose[half..].chunks(128 * 1024) {
        b.write_all(c).expect("append");
    }
    m.crash();
    drop((a, b));

    let m = fs.mount("auto", &[]);
    assert_same_bytes(
        "fsync'd appends",
        &fs::read(m.path("synced")).expect("read synced"),
        &synced,
    );
    let got = fs::read(m.path("loose")).expect("read loose");
    assert!(
        got.len() >= half && got.len() <= loose.len(),
        "unsynced appends: {} bytes after the crash, {} written, {half} older than the age \
         bound",
        got.len(),
        loose.len()
    );
    assert_same_bytes("the aged half", &got[..half], &loose[..half]);
    if let Some(i) = (half..got.len()).find(|&i| got[i] != loose[i] && got[i] != 0) {
        panic!("byte {i} after the crash is neither what was written nor zero");
    }
    let used = avail0.saturating_sub(df_avail(&m.mnt));
    let committed = (got.len() as u64).next_multiple_of(4096);
    loud(&format!(
        "appends_after_kill9: {} of {} unsynced bytes survived; {} MiB in use for {} MiB \
         committed",
        got.len(),
        loose.len(),
        used >> 20,
        committed >> 20
    ));
    assert!(
        used <= committed + 64 * MIB,
        "{} MiB in use after the crash for {} MiB of committed appends",
        used >> 20,
        committed >> 20
    );
}
