//! mount(8), fstab and systemd (issue 16): an fstab line mounted with `mount -a -T FILE -O`
//! and with `mount -T FILE DIR`, through the mount helper; `-o ro` answering EROFS to every
//! write while reads work and the node writes nothing of the filesystem's; unknown options
//! refused by name with nothing mounted; `umount` ending the daemon; and the readiness
//! (`READY=1`) and stop (`STOPPING=1`) notifications a `Type=notify` unit waits for, on a
//! fake NOTIFY_SOCKET.
//!
//! mount(8) runs helpers from /sbin, /sbin/fs.d and /sbin/fs only (libmount's fixed search
//! path; PATH is not searched), so these tests put `/sbin/mount.etcfs`, a symlink to the
//! binary under test, in place while they run ([`HelperInstalled`]) and put back what was
//! there after, one test process at a time (a lock held by a `flock` child: tests hold no
//! `unsafe`). They use a temporary fstab file (`mount -T`), never /etc/fstab.
//!
//! Needs root, `/dev/fuse` and `ETCD_ENDPOINTS` (see `common`); skips loudly otherwise, and
//! fails instead when `ETCFS_REQUIRE_MOUNT_TESTS=1`. Every mount is owned by a guard that
//! unmounts it and ends its daemon (by pid) even when the test fails.

mod common;

use std::{
    fs::{self, OpenOptions},
    io::{BufRead as _, BufReader},
    os::unix::{fs::PermissionsExt as _, net::UnixDatagram},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

use common::{
    errno_of, helper, is_mounted, loud, mount_count, run_bounded, signal, umount_all,
    unescape_mountinfo, wait_bounded, TestFs, DAEMON_DEADLINE, ETCFS,
};

const HELPER_PATH: &str = "/sbin/mount.etcfs";
/// Where an existing helper (an installed etcfs) waits while the tests run.
const HELPER_SAVED: &str = "/sbin/mount.etcfs.etcfs-test-saved";
/// Serialises the test processes that replace the helper.
const HELPER_LOCK: &str = "/run/lock/etcfs-test-mount-helper.lock";
const EROFS: i32 = 30;

// ---------------------------------------------------------------------------------------
// The helper in /sbin
// ---------------------------------------------------------------------------------------

/// `/sbin/mount.etcfs` pointing at the binary under test while any test of this process
/// holds one; the last one out puts back what was there.
struct HelperInstalled;

/// Users of the installed helper in this process, and the `flock` child holding the lock
/// across processes.
static HELPER_USERS: Mutex<(usize, Option<Child>)> = Mutex::new((0, None));

impl HelperInstalled {
    fn acquire() -> HelperInstalled {
        let mut st = HELPER_USERS.lock().unwrap_or_else(|e| e.into_inner());
        if st.0 == 0 {
            st.1 = Some(take_lock());
            install_helper();
        }
        st.0 += 1;
        HelperInstalled
    }
}

impl Drop for HelperInstalled {
    fn drop(&mut self) {
        let mut st = HELPER_USERS.lock().unwrap_or_else(|e| e.into_inner());
        st.0 -= 1;
        if st.0 == 0 {
            restore_helper();
            if let Some(mut lock) = st.1.take() {
                // cat sees EOF and exits; flock then releases the lock.
                drop(lock.stdin.take());
                if wait_bounded(&mut lock, Duration::from_secs(10)).is_none() {
                    let _ = lock.kill();
                    let _ = lock.wait();
                }
            }
        }
    }
}

/// Waits (up to 10 minutes) for the lock, held by a `flock` child for as long as its stdin
/// stays open: it goes with this process however the process ends.
fn take_lock() -> Child {
    let dir = Path::new(HELPER_LOCK).parent().expect("lock dir");
    let _ = fs::create_dir_all(dir);
    let mut child = Command::new("flock")
        .args([
            "-w",
            "600",
            HELPER_LOCK,
            "sh",
            "-c",
            "echo locked; exec cat >/dev/null",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn flock (util-linux)");
    let mut line = String::new();
    let out = child.stdout.take().expect("piped stdout");
    let _ = BufReader::new(out).read_line(&mut line);
    assert_eq!(line.trim(), "locked", "flock {HELPER_LOCK} failed");
    child
}

/// Whether `p` exists itself (a symlink to a missing file counts: an installed helper's
/// target may be gone).
fn present(p: &str) -> bool {
    fs::symlink_metadata(p).is_ok()
}

fn install_helper() {
    let p = Path::new(HELPER_PATH);
    if fs::symlink_metadata(p).is_ok() {
        // An installed helper (or a test run's, killed before it put the original back,
        // which then waits in HELPER_SAVED already).
        if present(HELPER_SAVED) {
            fs::remove_file(p).expect("remove stale test helper");
        } else {
            fs::rename(p, HELPER_SAVED).expect("set the installed helper aside");
        }
    }
    std::os::unix::fs::symlink(ETCFS, p)
        .unwrap_or_else(|e| panic!("symlink {HELPER_PATH} -> {ETCFS}: {e}"));
}

fn restore_helper() {
    let _ = fs::remove_file(HELPER_PATH);
    if present(HELPER_SAVED) {
        if let Err(e) = fs::rename(HELPER_SAVED, HELPER_PATH) {
            loud(&format!(
                "could not put {HELPER_SAVED} back as {HELPER_PATH}: {e}"
            ));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Mounts through mount(8)
// ---------------------------------------------------------------------------------------

/// A mount made through mount(8) and the helper; dropping it unmounts and ends the daemon.
struct HelperMount {
    mnt: PathBuf,
    /// The detached daemon (from the helper's "daemon pid N" line).
    pid: Option<u32>,
}

impl HelperMount {
    fn new(mnt: &Path, out: &Output) -> HelperMount {
        let text = String::from_utf8_lossy(&out.stdout);
        let pid = text
            .split("daemon pid ")
            .nth(1)
            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok());
        HelperMount {
            mnt: mnt.to_path_buf(),
            pid,
        }
    }

    /// `umount MNT` (not lazy), then the daemon must exit by itself.
    fn umount_and_expect_exit(mut self) {
        let (out, in_time) = run_bounded(
            Command::new("umount").arg(&self.mnt),
            Duration::from_secs(20),
        );
        assert!(
            in_time && out.status.success(),
            "umount {}: {}",
            self.mnt.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let pid = self
            .pid
            .take()
            .expect("the helper printed the daemon's pid");
        assert!(
            wait_gone(pid, DAEMON_DEADLINE),
            "daemon {pid} still running {DAEMON_DEADLINE:?} after umount"
        );
    }
}

impl Drop for HelperMount {
    fn drop(&mut self) {
        if is_mounted(&self.mnt) {
            let _ = run_bounded(
                Command::new("umount").arg(&self.mnt),
                Duration::from_secs(20),
            );
        }
        if let Some(pid) = self.pid {
            if !wait_gone(pid, DAEMON_DEADLINE) {
                // Ours: the helper we ran started it.
                let _ = Command::new("kill")
                    .args(["-s", "KILL", &pid.to_string()])
                    .status();
            }
        }
        umount_all(&self.mnt);
    }
}

/// Whether process `pid` has exited (gone, or a zombie nobody reaped yet) within `limit`.
/// Reads only /proc/PID/stat, never anything the FUSE mount could block.
fn wait_gone(pid: u32, limit: Duration) -> bool {
    let start = Instant::now();
    loop {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or("");
        if stat.is_empty() || state == "Z" || state == "X" {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn mount_cmd(args: &[&str]) -> Output {
    let (out, in_time) = run_bounded(Command::new("mount").args(args), Duration::from_secs(60));
    assert!(in_time, "mount {args:?} hung");
    out
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The spec of `fs` as fstab's first column has it.
fn spec(fs: &TestFs) -> String {
    format!("{}:/{}", fs.endpoints, fs.prefix)
}

/// A temporary fstab holding one line for `fs` at its mount point with `options`.
fn write_fstab(fs: &TestFs, options: &str) -> PathBuf {
    let path = fs.base.join("fstab");
    let line = format!(
        "# etcfs test\n{} {} etcfs {options} 0 0\n",
        spec(fs),
        fs.mountpoint().display()
    );
    fs::write(&path, line).expect("write the test fstab");
    path
}

/// The mountinfo line of the mount on top at `path`: (source, fstype, mount options).
fn mount_entry(path: &Path) -> (String, String, String) {
    let want = path.to_string_lossy();
    let info = fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    let line = info
        .lines()
        .rev()
        .find(|l| l.split(' ').nth(4).map(unescape_mountinfo).as_deref() == Some(&*want))
        .unwrap_or_else(|| panic!("{want} is not mounted"));
    let opts = line.split(' ').nth(5).unwrap_or_default().to_string();
    let tail: Vec<&str> = line
        .split(" - ")
        .nth(1)
        .unwrap_or_default()
        .split(' ')
        .collect();
    (
        unescape_mountinfo(tail.get(1).unwrap_or(&"")),
        tail.first().unwrap_or(&"").to_string(),
        opts,
    )
}

fn has_opt(opts: &str, o: &str) -> bool {
    opts.split(',').any(|x| x == o)
}

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[test]
fn fstab_line_mounts_with_mount_a_and_by_mountpoint() {
    let Some(fs) = TestFs::new_or_skip("fstab_mount_a", None) else {
        return;
    };
    let _helper = HelperInstalled::acquire();
    let mnt = fs.mountpoint();
    let log = fs.base.join("helper.log");
    let fstab = write_fstab(
        &fs,
        &format!(
            "device={},_netdev,nofail,noatime,x-systemd.requires=etcd.service,\
             x-systemd.mount-timeout=90,lock_min_hold_ms=5,log_file={}",
            fs.image.display(),
            log.display()
        ),
    );
    let fstab_s = fstab.to_string_lossy().into_owned();

    // At boot: every _netdev line.
    let out = mount_cmd(&["-a", "-T", &fstab_s, "-O", "_netdev"]);
    assert!(out.status.success(), "mount -a: {}", text(&out));
    let m = HelperMount::new(&mnt, &out);
    assert!(m.pid.is_some(), "no daemon pid in: {}", text(&out));
    let (source, fstype, opts) = mount_entry(&mnt);
    assert_eq!(source, spec(&fs), "the spec is the mount's source");
    assert_eq!(fstype, "fuse.etcfs");
    for o in ["rw", "noatime", "nosuid", "nodev"] {
        assert!(has_opt(&opts, o), "{o} missing from {opts}");
    }
    fs::write(mnt.join("hello"), b"from fstab").expect("write through the mount");
    assert_eq!(fs::read(mnt.join("hello")).unwrap(), b"from fstab");

    // mount -a again finds the line mounted and leaves it alone; a filter that excludes
    // it mounts nothing.
    let out = mount_cmd(&["-a", "-T", &fstab_s, "-O", "_netdev"]);
    assert!(out.status.success(), "second mount -a: {}", text(&out));
    let out = mount_cmd(&["-a", "-T", &fstab_s, "-O", "no_netdev"]);
    assert!(
        out.status.success(),
        "mount -a -O no_netdev: {}",
        text(&out)
    );
    assert_eq!(mount_count(&mnt), 1, "mount -a mounted the line twice");

    m.umount_and_expect_exit();
    assert!(!is_mounted(&mnt));

    // By mount point, with -o added to the line's options (and -N: this namespace).
    let pid = std::process::id().to_string();
    let out = mount_cmd(&[
        "-T",
        &fstab_s,
        "-N",
        &pid,
        "-o",
        "noexec,transport=devfuse",
        &mnt.to_string_lossy(),
    ]);
    assert!(out.status.success(), "mount -T FILE DIR: {}", text(&out));
    let m = HelperMount::new(&mnt, &out);
    let (_, _, opts) = mount_entry(&mnt);
    assert!(has_opt(&opts, "noexec"), "noexec missing from {opts}");
    assert_eq!(fs::read(mnt.join("hello")).unwrap(), b"from fstab");
    let stats = run_bounded(
        Command::new(ETCFS).arg("stats").arg(&mnt).arg("--json"),
        Duration::from_secs(10),
    )
    .0;
    let stats: serde_json::Value =
        serde_json::from_slice(&stats.stdout).expect("etcfs stats --json");
    assert!(
        stats["transport"]
            .as_str()
            .is_some_and(|t| t.starts_with("devfuse")),
        "transport=devfuse not applied: {stats}"
    );
    // A program on a noexec mount does not run.
    let prog = mnt.join("prog");
    fs::write(&prog, b"#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&prog, fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(
        errno_of(Command::new(&prog).status()),
        Some(13),
        "EACCES: executing from a noexec mount"
    );
    m.umount_and_expect_exit();
    assert!(!is_mounted(&mnt));
}

#[test]
fn read_only_mount_refuses_writes_with_erofs_and_reads() {
    let Some(fs) = TestFs::new_or_skip("fstab_ro", None) else {
        return;
    };
    let _helper = HelperInstalled::acquire();
    let mnt = fs.mountpoint();
    let fstab = write_fstab(
        &fs,
        &format!(
            "device={},log_file={}",
            fs.image.display(),
            fs.base.join("helper.log").display()
        ),
    );
    let fstab_s = fstab.to_string_lossy().into_owned();
    let mnt_s = mnt.to_string_lossy().into_owned();

    // Something to read, written through a writable mount.
    let out = mount_cmd(&["-T", &fstab_s, &mnt_s]);
    assert!(out.status.success(), "mount: {}", text(&out));
    let m = HelperMount::new(&mnt, &out);
    fs::create_dir(mnt.join("dir")).unwrap();
    fs::write(mnt.join("dir/file"), b"read me").unwrap();
    m.umount_and_expect_exit();
    let records = fs_records(&fs);

    let out = mount_cmd(&["-T", &fstab_s, "-o", "ro", &mnt_s]);
    assert!(out.status.success(), "mount -o ro: {}", text(&out));
    let m = HelperMount::new(&mnt, &out);
    let (_, _, opts) = mount_entry(&mnt);
    assert!(has_opt(&opts, "ro"), "not read-only: {opts}");

    // Reads work (a first read after the write would move atime under relatime).
    let file = mnt.join("dir/file");
    assert_eq!(fs::read(&file).unwrap(), b"read me");
    assert_eq!(common::sorted_names(&mnt.join("dir")), ["file"]);
    assert!(fs::metadata(&file).unwrap().len() == 7);

    // Every kind of write answers EROFS.
    let erofs = |what: &str, e: Option<i32>| assert_eq!(e, Some(EROFS), "{what}");
    erofs("create", errno_of(fs::File::create(mnt.join("new"))));
    erofs(
        "open for appending",
        errno_of(OpenOptions::new().append(true).open(&file)),
    );
    erofs("mkdir", errno_of(fs::create_dir(mnt.join("d2"))));
    erofs("unlink", errno_of(fs::remove_file(&file)));
    erofs("rename", errno_of(fs::rename(&file, mnt.join("moved"))));
    erofs(
        "chmod",
        errno_of(fs::set_permissions(
            &file,
            fs::Permissions::from_mode(0o600),
        )),
    );
    erofs(
        "open with O_TRUNC",
        errno_of(OpenOptions::new().write(true).truncate(true).open(&file)),
    );
    let file_s = file.to_string_lossy().into_owned();
    erofs(
        "setxattr",
        helper(&["setxattr", &file_s, "user.k", "v", "none"]).err(),
    );
    erofs("utimes", helper(&["utimens", &file_s, "now", "now"]).err());
    // Reading still works after all that, and the data is unchanged.
    let mut f = fs::File::open(&file).unwrap();
    let mut buf = Vec::new();
    std::io::Read::read_to_end(&mut f, &mut buf).unwrap();
    assert_eq!(buf, b"read me");
    drop(f);
    m.umount_and_expect_exit();

    // The read-only node wrote none of the filesystem's records: no atime, no group
    // claims, no free maps, no reclaims (its session, locks and open records aside).
    assert_eq!(
        fs_records(&fs),
        records,
        "a read-only mount changed the filesystem's records in etcd"
    );
}

/// The filesystem's records in etcd with their mod revisions, without what belongs to a
/// node's session (`M` members, `H` open records, `K`/`Q` cache locks, `B` fcntl locks, `T`
/// commit markers, `V` evictions; keys.rs).
fn fs_records(fs: &TestFs) -> Vec<(String, i64)> {
    let out = run_bounded(
        Command::new("etcdctl")
            .args(["--endpoints", &fs.endpoints, "get", "--prefix"])
            .arg(format!("{}/", fs.prefix))
            .args(["--keys-only", "-w", "json"]),
        Duration::from_secs(30),
    )
    .0;
    assert!(out.status.success(), "etcdctl: {}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("etcdctl json");
    let root = format!("{}/", fs.prefix);
    let mut records: Vec<(String, i64)> = v["kvs"]
        .as_array()
        .map(|kvs| {
            kvs.iter()
                .filter_map(|kv| {
                    let key = base64_decode(kv["key"].as_str()?);
                    let rest = key.strip_prefix(root.as_bytes())?;
                    let tag = *rest.first()?;
                    if b"MHKQBTV".contains(&tag) {
                        return None;
                    }
                    let rev = kv["mod_revision"].as_i64()?;
                    Some((String::from_utf8_lossy(&key).into_owned(), rev))
                })
                .collect()
        })
        .unwrap_or_default();
    records.sort();
    assert!(
        records
            .iter()
            .any(|(k, _)| k.as_bytes()[root.len()] == b'I'),
        "no inode records read: {records:?}"
    );
    records
}

/// etcdctl's JSON gives keys in base64.
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for v in s.bytes().filter_map(val) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

#[test]
fn unknown_and_refused_options_mount_nothing() {
    let Some(fs) = TestFs::new_or_skip("fstab_refused", None) else {
        return;
    };
    let _helper = HelperInstalled::acquire();
    let mnt = fs.mountpoint();
    let mnt_s = mnt.to_string_lossy().into_owned();
    let device = format!("device={}", fs.image.display());
    let spec = spec(&fs);
    for (opts, says) in [
        (
            format!("{device},bogus_option=1"),
            "unknown mount option \"bogus_option\"",
        ),
        (format!("{device},sync"), "\"sync\" is not supported"),
        (format!("{device},user"), "\"user\" is not supported"),
        (format!("{device},perf=yes"), "\"perf\" takes no value"),
        (format!("{device},lease_ttl=1"), "lease-ttl"),
    ] {
        let out = mount_cmd(&["-t", "etcfs", "-o", &opts, &spec, &mnt_s]);
        let t = text(&out);
        assert!(!out.status.success(), "-o {opts} mounted: {t}");
        assert!(t.contains(says), "-o {opts}: {says:?} not in: {t}");
        assert!(!is_mounted(&mnt), "-o {opts} left a mount");
    }
    // From an fstab line too, and with a spec that is no spec.
    let fstab = write_fstab(&fs, &format!("{device},_netdev,frobnicate"));
    let out = mount_cmd(&["-a", "-T", &fstab.to_string_lossy(), "-O", "_netdev"]);
    let t = text(&out);
    assert!(
        !out.status.success(),
        "mount -a with a bad line succeeded: {t}"
    );
    assert!(t.contains("\"frobnicate\""), "{t}");
    let out = mount_cmd(&["-t", "etcfs", "-o", &device, "/dev/sdz9", &mnt_s]);
    assert!(
        text(&out).contains("not an etcd endpoint"),
        "{}",
        text(&out)
    );
    // -f checks and mounts nothing; -s lets an unknown option by with a warning.
    let out = mount_cmd(&["-f", "-t", "etcfs", "-o", &device, &spec, &mnt_s]);
    assert!(out.status.success(), "mount -f: {}", text(&out));
    assert!(!is_mounted(&mnt), "mount -f mounted");
    let out = mount_cmd(&[
        "-f",
        "-s",
        "-t",
        "etcfs",
        "-o",
        &format!("{device},bogus"),
        &spec,
        &mnt_s,
    ]);
    assert!(out.status.success(), "mount -f -s: {}", text(&out));
    assert!(
        text(&out).contains("ignoring unknown option \"bogus\""),
        "{}",
        text(&out)
    );
    assert!(!is_mounted(&mnt));
}

/// A datagram socket standing in for systemd's NOTIFY_SOCKET.
struct FakeNotifySocket {
    path: PathBuf,
    sock: UnixDatagram,
}

impl FakeNotifySocket {
    fn new(dir: &Path) -> FakeNotifySocket {
        let path = dir.join("notify.sock");
        let _ = fs::remove_file(&path);
        let sock = UnixDatagram::bind(&path).expect("bind the fake NOTIFY_SOCKET");
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        FakeNotifySocket { path, sock }
    }

    /// The next message within `limit`, if any.
    fn recv(&self, limit: Duration) -> Option<String> {
        let start = Instant::now();
        let mut buf = [0u8; 4096];
        while start.elapsed() < limit {
            if let Ok(n) = self.sock.recv(&mut buf) {
                return Some(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
        None
    }
}

fn field<'a>(msg: &'a str, key: &str) -> Option<&'a str> {
    msg.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

#[test]
fn readiness_and_stop_are_notified_for_systemd() {
    let Some(fs) = TestFs::new_or_skip("fstab_notify", None) else {
        return;
    };
    let mnt = fs.mountpoint();
    let notify = FakeNotifySocket::new(&fs.base);

    // Type=notify with --foreground: READY=1 from the daemon once the mount is up and
    // answering; STOPPING=1 on SIGTERM, then a clean unmount and exit 0.
    let log = fs::File::create(fs.base.join("fg.log")).unwrap();
    let mut child = Command::new(ETCFS)
        .arg("mount")
        .arg("--foreground")
        .args(fs.mount_args("auto", &[]))
        .arg(&mnt)
        .env("NOTIFY_SOCKET", &notify.path)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn etcfs mount");
    let guard = KillOnDrop(Some(&mut child), mnt.clone());
    let msg = notify
        .recv(DAEMON_DEADLINE)
        .expect("no READY=1 from the daemon");
    assert_eq!(field(&msg, "READY"), Some("1"), "{msg}");
    let pid = guard.0.as_ref().unwrap().id().to_string();
    assert_eq!(field(&msg, "MAINPID"), Some(pid.as_str()), "{msg}");
    assert!(is_mounted(&mnt), "READY=1 before the mount");
    fs::write(mnt.join("ready"), b"1").expect("the mount answers once READY=1 came");
    let child = guard.disarm();
    signal(child, "TERM");
    let msg = notify.recv(DAEMON_DEADLINE).expect("no STOPPING=1");
    assert_eq!(field(&msg, "STOPPING"), Some("1"), "{msg}");
    let status = wait_bounded(child, DAEMON_DEADLINE).expect("daemon exits after SIGTERM");
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(!is_mounted(&mnt), "still mounted after SIGTERM");

    // Without --foreground: the detaching command says who the daemon is and that it is
    // ready; the daemon itself was not given the socket (one READY=1, not two).
    let out = run_bounded(
        Command::new(ETCFS)
            .arg("mount")
            .args(fs.mount_args("auto", &[]))
            .arg("--log-file")
            .arg(fs.base.join("bg.log"))
            .arg(&mnt)
            .env("NOTIFY_SOCKET", &notify.path),
        Duration::from_secs(60),
    )
    .0;
    assert!(out.status.success(), "etcfs mount: {}", text(&out));
    let m = HelperMount::new(&mnt, &out);
    let daemon = m.pid.expect("daemon pid").to_string();
    let msg = notify
        .recv(DAEMON_DEADLINE)
        .expect("no READY=1 when detaching");
    assert_eq!(field(&msg, "READY"), Some("1"), "{msg}");
    assert_eq!(field(&msg, "MAINPID"), Some(daemon.as_str()), "{msg}");
    assert_eq!(
        notify.recv(Duration::from_millis(500)),
        None,
        "a second message"
    );
    m.umount_and_expect_exit();
}

/// Stops a foreground daemon and clears its mount if the test fails before it does.
struct KillOnDrop<'a>(Option<&'a mut Child>, PathBuf);

impl<'a> KillOnDrop<'a> {
    fn disarm(mut self) -> &'a mut Child {
        self.0.take().expect("armed")
    }
}

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(child) = self.0.take() {
            signal(child, "TERM");
            if wait_bounded(child, DAEMON_DEADLINE).is_none() {
                let _ = child.kill();
                let _ = wait_bounded(child, DAEMON_DEADLINE);
            }
            umount_all(&self.1);
        }
    }
}

#[test]
fn helper_without_mount_8_says_how_to_call_it() {
    // The helper answers --help by its own name; nothing to mount, no root needed.
    let dir = std::env::temp_dir().join(format!("etcfs-helper-name-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let link = dir.join("mount.etcfs");
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(ETCFS, &link).unwrap();
    let out = run_bounded(Command::new(&link).arg("--help"), Duration::from_secs(10)).0;
    let _ = fs::remove_dir_all(&dir);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("ETCD_URLS:/PREFIX") && t.contains("-N <NS>"),
        "{t}"
    );
}
