//! Harness shared by the integration tests that run the real `etcfs` binary on real FUSE
//! mounts: prerequisite checks (with loud skips), bounded child processes, mountinfo, a
//! [`Daemon`] guard that always tears its mount down, a [`TestFs`] guard that owns one
//! filesystem (a sparse device image plus an etcd prefix) and removes both, and a small C
//! helper (compiled once per test binary with the system C compiler) for the syscalls std
//! does not expose: renameat2, utimensat with UTIME_NOW/UTIME_OMIT, xattrs with flags and
//! buffer sizes, fallocate modes, lseek SEEK_DATA/SEEK_HOLE, mknod, truncate(2).
//!
//! No `unsafe` here (tests/tidy.rs checks): signals go through the `kill` command, the uid
//! check reads the owner of /proc/self.
//!
//! Each test binary uses part of this module, so unused items are allowed.
#![allow(dead_code)]

use std::{
    collections::BTreeMap,
    fs::{self, File},
    io::{self, Read as _, Write as _},
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        OnceLock,
    },
    thread,
    time::{Duration, Instant},
};

pub(crate) const ETCFS: &str = env!("CARGO_BIN_EXE_etcfs");
/// How long a daemon may take to mount, or to exit once asked to.
pub(crate) const DAEMON_DEADLINE: Duration = Duration::from_secs(10);
pub(crate) const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";
/// Size of the sparse device image a [`TestFs`] gets unless told otherwise.
pub(crate) const DEFAULT_IMAGE_BYTES: u64 = 1 << 30;

// ---------------------------------------------------------------------------------------
// Environment checks
// ---------------------------------------------------------------------------------------

/// Writes straight to stderr, past the test harness's output capture, so skips are seen.
pub(crate) fn loud(msg: &str) {
    let _ = io::stderr().write_all(format!("{msg}\n").as_bytes());
}

pub(crate) fn mount_tests_required() -> bool {
    std::env::var("ETCFS_REQUIRE_MOUNT_TESTS").as_deref() == Ok("1")
}

/// True when this process runs as root (the owner of /proc/self is the effective uid).
pub(crate) fn is_root() -> bool {
    fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

pub(crate) fn uring_enabled() -> bool {
    fs::read_to_string(ENABLE_URING)
        .map(|s| s.trim() == "Y")
        .unwrap_or(false)
}

/// Why mount tests cannot run here, if they cannot.
pub(crate) fn missing_prerequisite(transport: Option<&str>) -> Option<String> {
    if !is_root() || !Path::new("/dev/fuse").exists() {
        return Some("needs root and /dev/fuse".into());
    }
    if transport == Some("uring") && !uring_enabled() {
        return Some(format!("needs FUSE-over-io_uring: {ENABLE_URING} is not Y"));
    }
    None
}

/// Says loudly why `name` is skipped, or panics when `ETCFS_REQUIRE_MOUNT_TESTS=1`.
/// Always returns false, so callers can `return skip(..)`-style bail out.
pub(crate) fn skip(name: &str, why: &str) -> bool {
    if mount_tests_required() {
        panic!("{name}: {why} (ETCFS_REQUIRE_MOUNT_TESTS=1, so this is a failure)");
    }
    loud(&format!("SKIP: {name}: {why}"));
    false
}

/// True when a memfs mount test may go on; otherwise skips loudly (or fails when required).
pub(crate) fn can_run(test: &str, transport: Option<&str>) -> bool {
    let Some(why) = missing_prerequisite(transport) else {
        return true;
    };
    let name = match transport {
        Some(t) => format!("{t}::{test}"),
        None => test.to_string(),
    };
    skip(&name, &why)
}

/// The etcd endpoints of the test etcd, when an etcfs mount test may go on (root,
/// /dev/fuse, `ETCD_ENDPOINTS`, FUSE-over-io_uring when `transport` is `uring`); otherwise
/// skips loudly (or fails when `ETCFS_REQUIRE_MOUNT_TESTS=1`).
pub(crate) fn etcd_or_skip(test: &str, transport: Option<&str>) -> Option<String> {
    if !can_run(test, transport) {
        return None;
    }
    match std::env::var("ETCD_ENDPOINTS") {
        Ok(e) if !e.trim().is_empty() => Some(e.trim().to_string()),
        _ => {
            skip(
                test,
                "set ETCD_ENDPOINTS (scripts/test.sh starts a private etcd)",
            );
            None
        }
    }
}

// ---------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------

/// Waits at most `timeout` for `child` to exit.
pub(crate) fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if start.elapsed() < timeout => thread::sleep(Duration::from_millis(10)),
            _ => return None,
        }
    }
}

/// Sends `sig` (a name like `TERM`) to a child we started and have not reaped, so its pid
/// cannot belong to anyone else. Uses the `kill` command: tests hold no `unsafe`.
pub(crate) fn signal(child: &mut Child, sig: &str) {
    if !matches!(child.try_wait(), Ok(None)) {
        return;
    }
    let status = Command::new("kill")
        .args(["-s", sig, &child.id().to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        loud(&format!("kill -s {sig} {} failed: {status:?}", child.id()));
    }
}

/// Runs a command to completion, or stops it (SIGTERM, then SIGKILL) after `timeout`.
/// Returns its output, and whether it finished in time.
pub(crate) fn run_bounded(cmd: &mut Command, timeout: Duration) -> (Output, bool) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    // Drain the pipes on threads so a chatty child never blocks on a full pipe.
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let out_t = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err_t = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let mut in_time = true;
    let status = match wait_bounded(&mut child, timeout) {
        Some(s) => s,
        None => {
            in_time = false;
            signal(&mut child, "TERM");
            match wait_bounded(&mut child, Duration::from_secs(3)) {
                Some(s) => s,
                None => {
                    let _ = child.kill();
                    wait_bounded(&mut child, Duration::from_secs(10))
                        .unwrap_or_else(|| panic!("{cmd:?} (pid {}) survives SIGKILL", child.id()))
                }
            }
        }
    };
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    (
        Output {
            status,
            stdout,
            stderr,
        },
        in_time,
    )
}

/// `etcfs mount --memfs --transport devfuse`, in the foreground or detached with its log
/// at `log`; the caller adds the mount point.
pub(crate) fn memfs_mount_command(foreground: bool, log: &Path) -> Command {
    let mut cmd = Command::new(ETCFS);
    cmd.args(["mount", "--memfs", "--transport", "devfuse"]);
    if foreground {
        cmd.arg("--foreground");
    } else {
        cmd.arg("--log-file").arg(log);
    }
    cmd
}

/// Runs a command that must succeed within 60 s; returns its stdout.
pub(crate) fn run_ok(cmd: &mut Command) -> String {
    let (out, in_time) = run_bounded(cmd, Duration::from_secs(60));
    assert!(
        in_time && out.status.success(),
        "{cmd:?} failed ({}, in time: {in_time}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

// ---------------------------------------------------------------------------------------
// Mounts
// ---------------------------------------------------------------------------------------

/// Undoes the octal escapes (`\040` for a space) of a /proc/self/mountinfo path.
pub(crate) fn unescape_mountinfo(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How many mounts sit on `path` according to /proc/self/mountinfo.
pub(crate) fn mount_count(path: &Path) -> usize {
    let want = path.to_string_lossy();
    let info = fs::read_to_string("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| unescape_mountinfo(p) == want)
        .count()
}

pub(crate) fn is_mounted(path: &Path) -> bool {
    mount_count(path) > 0
}

pub(crate) fn lazy_umount(path: &Path) -> Output {
    run_bounded(
        Command::new("umount").arg("-l").arg(path),
        Duration::from_secs(10),
    )
    .0
}

/// Aborts the FUSE connection mounted at `path` through fusectl
/// (`/sys/fs/fuse/connections/<minor>/abort`): every request waiting on it fails at once.
pub(crate) fn abort_connection(path: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let want = path.to_string_lossy();
    let conns = Path::new("/sys/fs/fuse/connections");
    let have_fusectl = std::fs::read_dir(conns).is_ok_and(|mut d| d.next().is_some());
    if !have_fusectl {
        let _ = Command::new("mount")
            .args(["-t", "fusectl", "fusectl"])
            .arg(conns)
            .status();
    }
    for line in info.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        if f.get(4) == Some(&&*want) {
            if let Some(minor) = f.get(2).and_then(|d| d.split(':').nth(1)) {
                let _ = std::fs::write(conns.join(minor).join("abort"), b"1");
            }
        }
    }
}

/// The name, state and kernel stack of every thread of `pid` that still exists (for the
/// report of a process that will not die).
pub(crate) fn thread_stacks(pid: u32) -> String {
    let mut out = String::new();
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return "(gone)".into();
    };
    for t in tasks.flatten() {
        let p = t.path();
        let read = |f: &str| fs::read_to_string(p.join(f)).unwrap_or_default();
        let state = read("stat")
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next().map(str::to_string))
            .unwrap_or_default();
        out += &format!(
            "  {} {} {state} {}\n",
            t.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan")
        );
        for line in read("stack").lines().take(6) {
            out += &format!("      {line}\n");
        }
    }
    out
}

/// Lazily unmounts `path` until nothing is mounted there (at most a few tries).
pub(crate) fn umount_all(path: &Path) {
    for _ in 0..5 {
        if !is_mounted(path) {
            return;
        }
        lazy_umount(path);
    }
}

static NEXT_ID: AtomicUsize = AtomicUsize::new(0);

/// A number unique within this test process.
pub(crate) fn next_id() -> usize {
    NEXT_ID.fetch_add(1, Ordering::SeqCst)
}

/// A fresh directory under /tmp, unique to this process and call.
pub(crate) fn temp_base(label: &str) -> PathBuf {
    let base = PathBuf::from(format!(
        "/tmp/etcfs-test-{}-{}-{label}",
        std::process::id(),
        next_id()
    ));
    let _ = fs::remove_dir_all(&base);
    fs::create_dir_all(&base).unwrap_or_else(|e| panic!("create {}: {e}", base.display()));
    // Other users (the permission tests) must be able to reach the mount point inside.
    let _ = fs::set_permissions(&base, fs::Permissions::from_mode(0o755));
    base
}

/// A foreground `etcfs mount` daemon we started, and its mount; torn down on drop (SIGTERM
/// to its pid, lazy unmount of what is left, SIGKILL if it ignored SIGTERM).
pub(crate) struct Daemon {
    pub(crate) mnt: PathBuf,
    pub(crate) log: PathBuf,
    pub(crate) transport: String,
    child: Option<Child>,
    /// A directory this guard created and removes once unmounted.
    owned_base: Option<PathBuf>,
    /// The daemon has exited and the mount point is no longer this guard's to clean up
    /// (see [`Daemon::exited_leaving_mountpoint`]).
    mountpoint_released: bool,
}

impl Daemon {
    /// Spawns `etcfs mount --foreground ... MNT` (`args` are everything between `mount` and
    /// the mountpoint) with its output in `log`, and waits until the mount appears. Panics
    /// with the daemon's log if it exits first or takes longer than [`DAEMON_DEADLINE`].
    pub(crate) fn spawn(args: &[String], mnt: &Path, log: &Path, transport: &str) -> Daemon {
        let log_file = File::create(log).expect("create daemon log");
        let child = Command::new(ETCFS)
            .arg("mount")
            .arg("--foreground")
            .args(args)
            .arg(mnt)
            // ETCFS_TEST_LOG (e.g. "debug") when a failure needs the daemons' detail.
            .env(
                "RUST_LOG",
                std::env::var("ETCFS_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("dup log fd"))
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {ETCFS}: {e}"));
        // The guard exists before anything can fail, so a failure below still cleans up.
        let mut d = Daemon {
            mnt: mnt.to_path_buf(),
            log: log.to_path_buf(),
            transport: transport.to_string(),
            child: Some(child),
            owned_base: None,
            mountpoint_released: false,
        };
        let start = Instant::now();
        while !is_mounted(&d.mnt) {
            if let Ok(Some(status)) = d.child().try_wait() {
                panic!(
                    "etcfs mount exited ({status}) before mounting:\n{}",
                    d.log_text()
                );
            }
            if start.elapsed() > DAEMON_DEADLINE {
                panic!(
                    "etcfs did not mount within {DAEMON_DEADLINE:?}:\n{}",
                    d.log_text()
                );
            }
            thread::sleep(Duration::from_millis(10));
        }
        d
    }

    /// `etcfs mount --memfs --transport T EXTRA` on a fresh mount point.
    pub(crate) fn memfs(test: &str, transport: &str, extra: &[&str]) -> Daemon {
        let base = temp_base(&format!("{transport}-{test}"));
        let mnt = base.join("mnt");
        fs::create_dir(&mnt).expect("create mountpoint");
        let mut args: Vec<String> = vec!["--memfs".into(), "--transport".into(), transport.into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut d = Daemon::spawn(&args, &mnt, &base.join("daemon.log"), transport);
        d.owned_base = Some(base);
        d
    }

    /// [`Daemon::memfs`] after the prerequisite checks; `None` when the test is skipped.
    /// Asserts that the transport serving is the one asked for.
    pub(crate) fn memfs_or_skip(test: &str, transport: &str, extra: &[&str]) -> Option<Daemon> {
        if !can_run(test, Some(transport)) {
            return None;
        }
        let d = Daemon::memfs(test, transport, extra);
        d.assert_transport(transport);
        Some(d)
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.mnt.join(name)
    }

    pub(crate) fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_else(|e| format!("(no log: {e})"))
    }

    pub(crate) fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("daemon child")
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon child").id()
    }

    /// Sends `sig` (e.g. `TERM`) to the daemon.
    pub(crate) fn signal(&mut self, sig: &str) {
        signal(self.child(), sig);
    }

    /// `etcfs stats MNT --json`, parsed. Retries for a few seconds: the control socket may
    /// appear a moment after the mount does.
    pub(crate) fn stats_json(&self) -> serde_json::Value {
        let start = Instant::now();
        loop {
            let (out, _) = run_bounded(
                Command::new(ETCFS)
                    .arg("stats")
                    .arg(&self.mnt)
                    .arg("--json"),
                Duration::from_secs(10),
            );
            if out.status.success() {
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                assert!(
                    text.contains("\"transport\"") && text.contains("\"ops\""),
                    "{text}"
                );
                return serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("stats --json is not JSON ({e}): {text}"));
            }
            if start.elapsed() > Duration::from_secs(5) {
                panic!(
                    "etcfs stats {} --json failed ({}): {}\ndaemon log:\n{}",
                    self.mnt.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr),
                    self.log_text()
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Asserts that `etcfs stats` reports `transport` serving the mount.
    pub(crate) fn assert_transport(&self, transport: &str) {
        let served = self.stats_json()["transport"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert_eq!(
            served.split_whitespace().next(),
            Some(transport),
            "asked for --transport {transport}, `etcfs stats` reports {served:?}"
        );
    }

    /// Waits for the daemon to exit by itself; panics with its log if it does not in time.
    pub(crate) fn expect_exit(&mut self, why: &str) -> ExitStatus {
        match wait_bounded(self.child(), DAEMON_DEADLINE) {
            Some(s) => s,
            None => panic!(
                "the daemon (transport {}) did not exit within {DAEMON_DEADLINE:?} after {why}:\n{}",
                self.transport,
                self.log_text()
            ),
        }
    }

    /// Waits for the daemon to exit by itself (panics with its log if it does not in time)
    /// and gives up the guard without touching the mount point: after a remount another
    /// daemon serves it, and unmounting everything there is that daemon's guard's job.
    pub(crate) fn exited_leaving_mountpoint(mut self, why: &str) -> ExitStatus {
        let status = self.expect_exit(why);
        self.mountpoint_released = true;
        status
    }

    /// SIGTERM: the daemon must unmount and exit 0 in time.
    pub(crate) fn stop(mut self) {
        self.signal("TERM");
        let status = self.expect_exit("SIGTERM");
        assert!(
            status.success(),
            "the daemon exited with {status} after SIGTERM:\n{}",
            self.log_text()
        );
        assert!(
            !is_mounted(&self.mnt),
            "{} still mounted after the daemon exited",
            self.mnt.display()
        );
    }

    /// SIGKILL (a crash): reaps the daemon and lazily unmounts the dead mount. Returns
    /// whether the daemon died by itself; false when its FUSE connection had to be aborted
    /// first (see below).
    pub(crate) fn crash(mut self) -> bool {
        let mnt = self.mnt.clone();
        let child = self.child();
        child.kill().expect("SIGKILL the daemon");
        // A daemon thread caught in a cache invalidation waits in the kernel for a directory
        // lock that a request to the dead daemon holds; such a process never finishes dying.
        // Aborting the connection (what an administrator does) ends those requests.
        let by_itself = wait_bounded(child, Duration::from_secs(3)).is_some();
        if !by_itself {
            loud(&format!(
                "killed daemon of {} did not exit; aborting its connection. Its threads:\n{}",
                mnt.display(),
                thread_stacks(child.id())
            ));
            abort_connection(&mnt);
        }
        // Never wait unbounded: a daemon that cannot die must fail the test, not hang it.
        assert!(
            wait_bounded(child, DAEMON_DEADLINE).is_some(),
            "the daemon of {} did not exit after SIGKILL and a connection abort",
            mnt.display()
        );
        umount_all(&self.mnt);
        assert!(!is_mounted(&self.mnt), "the dead mount is still there");
        by_itself
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if thread::panicking() {
            loud(&format!(
                "--- etcfs daemon log ({}) ---\n{}",
                self.log.display(),
                self.log_text()
            ));
        }
        if self.mountpoint_released {
            return;
        }
        if let Some(child) = self.child.as_mut() {
            if matches!(child.try_wait(), Ok(None)) {
                signal(child, "TERM");
                let _ = wait_bounded(child, DAEMON_DEADLINE);
            }
        }
        umount_all(&self.mnt);
        if let Some(mut child) = self.child.take() {
            if matches!(child.try_wait(), Ok(None)) {
                loud(&format!(
                    "etcfs daemon pid {} ignored SIGTERM; killing it",
                    child.id()
                ));
                let _ = child.kill();
                if wait_bounded(&mut child, Duration::from_secs(3)).is_none() {
                    abort_connection(&self.mnt);
                }
                if wait_bounded(&mut child, DAEMON_DEADLINE).is_none() {
                    loud(&format!(
                        "etcfs daemon pid {} survives SIGKILL and a connection abort; \
                         leaving it",
                        child.id()
                    ));
                }
            }
        }
        umount_all(&self.mnt);
        if let Some(base) = &self.owned_base {
            if is_mounted(&self.mnt) {
                loud(&format!("leaving {} behind: still mounted", base.display()));
            } else {
                let _ = fs::remove_dir_all(base);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// One etcfs filesystem: a device image and an etcd prefix
// ---------------------------------------------------------------------------------------

/// A filesystem of its own for one test: a sparse device image in /var/tmp (where O_DIRECT
/// works), a unique etcd prefix, and a directory for mount points and logs. `Drop` removes
/// the image, the etcd keys and the directory. Declare mounts after it, so they drop first.
pub(crate) struct TestFs {
    pub(crate) test: String,
    pub(crate) endpoints: String,
    pub(crate) prefix: String,
    pub(crate) image: PathBuf,
    pub(crate) base: PathBuf,
    /// The uuid `mkfs` printed (empty when not formatted).
    pub(crate) uuid: String,
    mounts: AtomicUsize,
}

impl TestFs {
    /// A formatted 1 GiB filesystem, after the prerequisite checks (`None`: skipped).
    pub(crate) fn new_or_skip(test: &str, transport: Option<&str>) -> Option<TestFs> {
        TestFs::sized_or_skip(test, transport, DEFAULT_IMAGE_BYTES)
    }

    pub(crate) fn sized_or_skip(test: &str, transport: Option<&str>, bytes: u64) -> Option<TestFs> {
        let endpoints = etcd_or_skip(test, transport)?;
        let fs = TestFs::blank(test, &endpoints, bytes);
        let mut fs = fs;
        fs.mkfs();
        Some(fs)
    }

    /// An image of `bytes` and a prefix, neither formatted.
    pub(crate) fn blank(test: &str, endpoints: &str, bytes: u64) -> TestFs {
        let n = next_id();
        let pid = std::process::id();
        let mut prefix = format!("t-{pid}-{n}-{}", test.replace('_', "-"));
        prefix.truncate(64);
        let base = temp_base(test);
        let image = PathBuf::from(format!("/var/tmp/etcfs-test-{pid}-{n}.img"));
        let fs = TestFs {
            test: test.to_string(),
            endpoints: endpoints.to_string(),
            prefix,
            image,
            base,
            uuid: String::new(),
            mounts: AtomicUsize::new(0),
        };
        let f = File::create(&fs.image)
            .unwrap_or_else(|e| panic!("create {}: {e}", fs.image.display()));
        f.set_len(bytes).expect("size the sparse device image");
        fs::create_dir(fs.mountpoint()).expect("create mountpoint");
        fs
    }

    /// `etcfs mkfs` on the image and prefix; remembers the uuid it printed.
    pub(crate) fn mkfs(&mut self) {
        self.mkfs_with(&[]);
    }

    /// [`TestFs::mkfs`] with more `etcfs mkfs` options (`--group-size`).
    pub(crate) fn mkfs_with(&mut self, extra: &[&str]) {
        let out = run_ok(
            Command::new(ETCFS)
                .args(["mkfs", "--etcd", &self.endpoints, "--device"])
                .arg(&self.image)
                .args(["--prefix", &self.prefix])
                .args(extra),
        );
        self.uuid = out
            .split_whitespace()
            .skip_while(|w| *w != "filesystem")
            .nth(1)
            .unwrap_or_else(|| panic!("no uuid in mkfs output: {out}"))
            .to_string();
    }

    pub(crate) fn mountpoint(&self) -> PathBuf {
        self.base.join("mnt")
    }

    /// The arguments of `etcfs mount` for this filesystem (without the mount point).
    pub(crate) fn mount_args(&self, transport: &str, extra: &[&str]) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--etcd".into(),
            self.endpoints.clone(),
            "--device".into(),
            self.image.to_string_lossy().into_owned(),
            "--prefix".into(),
            self.prefix.clone(),
            "--transport".into(),
            transport.into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    /// Another node: a daemon of its own (its own session) mounting this filesystem on
    /// `<base>/<name>`, logging to `<base>/<name>.log`.
    pub(crate) fn mount_node(&self, name: &str, transport: &str, extra: &[&str]) -> Daemon {
        let mnt = self.base.join(name);
        fs::create_dir_all(&mnt).expect("create the node's mountpoint");
        Daemon::spawn(
            &self.mount_args(transport, extra),
            &mnt,
            &self.base.join(format!("{name}.log")),
            transport,
        )
    }

    /// Mounts this filesystem in the foreground on its mount point (the same one every
    /// time, so a remount shows the same paths) and checks the transport serving it.
    pub(crate) fn mount(&self, transport: &str, extra: &[&str]) -> Daemon {
        let n = self.mounts.fetch_add(1, Ordering::SeqCst);
        let log = self.base.join(format!("daemon-{n}.log"));
        let d = Daemon::spawn(
            &self.mount_args(transport, extra),
            &self.mountpoint(),
            &log,
            transport,
        );
        if transport != "auto" {
            d.assert_transport(transport);
        }
        d
    }

    /// Runs `etcfs mount --foreground` for this filesystem, expecting it to fail; returns
    /// (exit status success, stderr+stdout text, elapsed). Never leaves a mount behind.
    pub(crate) fn mount_expecting_failure(&self, args: &[String]) -> (bool, String, Duration) {
        let start = Instant::now();
        let (out, in_time) = run_bounded(
            Command::new(ETCFS)
                .args(["mount", "--foreground"])
                .args(args)
                .arg(self.mountpoint()),
            Duration::from_secs(20),
        );
        let elapsed = start.elapsed();
        let mounted = is_mounted(&self.mountpoint());
        umount_all(&self.mountpoint());
        assert!(in_time, "etcfs mount {args:?} hung for 20 s");
        assert!(
            !mounted,
            "etcfs mount {args:?} mounted although it should fail"
        );
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        (out.status.success(), text, elapsed)
    }

    /// The keys under `<prefix>/<tag>` in etcd (tag e.g. `O` for orphans), by count.
    pub(crate) fn etcd_key_count(&self, tag: &str) -> u64 {
        let out = run_ok(
            Command::new("etcdctl")
                .args(["--endpoints", &self.endpoints, "get", "--prefix"])
                .arg(format!("{}/{tag}", self.prefix))
                .args(["--keys-only", "-w", "json"]),
        );
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("etcdctl json ({e}): {out}"));
        v["count"].as_u64().unwrap_or(0)
    }
}

impl Drop for TestFs {
    fn drop(&mut self) {
        let mnt = self.mountpoint();
        umount_all(&mnt);
        let _ = fs::remove_file(&self.image);
        let (out, _) = run_bounded(
            Command::new("etcdctl")
                .args(["--endpoints", &self.endpoints, "del", "--prefix"])
                .arg(format!("{}/", self.prefix)),
            Duration::from_secs(10),
        );
        if !out.status.success() {
            loud(&format!(
                "{}: could not delete etcd prefix {}/: {}",
                self.test,
                self.prefix,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        if is_mounted(&mnt) {
            loud(&format!(
                "leaving {} behind: still mounted",
                self.base.display()
            ));
        } else {
            let _ = fs::remove_dir_all(&self.base);
        }
    }
}

// ---------------------------------------------------------------------------------------
// File helpers
// ---------------------------------------------------------------------------------------

pub(crate) fn errno_of<T>(r: io::Result<T>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

pub(crate) fn sorted_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("readdir {}: {e}", dir.display()))
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    v.sort();
    v
}

/// Bytes that differ from block to block and within a block, so misplaced or stale pages show.
pub(crate) fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i % 251) as u8) ^ ((i / 4096) as u8).wrapping_mul(7) ^ salt)
        .collect()
}

/// Panics naming the first differing byte (never dumps megabytes).
pub(crate) fn assert_same_bytes(what: &str, got: &[u8], want: &[u8]) {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: got {:#04x}, want {:#04x}",
            got[i], want[i]
        );
    }
    assert_eq!(got.len(), want.len(), "{what}: length");
}

/// Bytes available to unprivileged users on the filesystem at `mnt`, by `df`.
pub(crate) fn df_avail(mnt: &Path) -> u64 {
    let out = run_ok(Command::new("df").args(["--output=avail", "-B1"]).arg(mnt));
    out.lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("df output: {out}"))
}

/// Polls `f` until it returns true or `timeout` passes; returns the final verdict.
pub(crate) fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if f() {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// What a tree looks like, path by path, for before/after comparisons (remount, crash):
/// type, permissions, owner, size, link count, inode number, mtime/ctime, rdev, symlink
/// target, a content digest of regular files and the xattrs.
pub(crate) fn snapshot(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    snapshot_into(root, root, &mut out);
    out
}

fn snapshot_into(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("readdir {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for p in entries {
        let md = fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()));
        let rel = p
            .strip_prefix(root)
            .expect("under root")
            .to_string_lossy()
            .into_owned();
        let ft = md.file_type();
        let mut desc = format!(
            "mode={:o} uid={} gid={} nlink={} ino={} mtime={}.{:09} ctime={}.{:09} rdev={:x}",
            md.mode(),
            md.uid(),
            md.gid(),
            md.nlink(),
            md.ino(),
            md.mtime(),
            md.mtime_nsec(),
            md.ctime(),
            md.ctime_nsec(),
            md.rdev()
        );
        if ft.is_file() {
            let data = fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
            desc += &format!(
                " size={} blocks={} digest={:016x}",
                md.len(),
                md.blocks(),
                digest(&data)
            );
        } else if ft.is_symlink() {
            let t = fs::read_link(&p).unwrap_or_else(|e| panic!("readlink {}: {e}", p.display()));
            desc += &format!(" size={} target={}", md.len(), t.display());
        }
        if ft.is_file() || ft.is_dir() {
            match helper(&["listxattr", &p.to_string_lossy(), "65536"]) {
                Ok(list) => desc += &format!(" xattrs=[{}]", xattr_dump(&p, &list)),
                Err(e) => desc += &format!(" listxattr-errno={e}"),
            }
        }
        out.insert(rel, desc);
        if ft.is_dir() {
            snapshot_into(root, &p, out);
        }
    }
}

fn xattr_dump(p: &Path, list: &str) -> String {
    // listxattr prints "<len> name1,name2,..."
    let names = list.split_once(' ').map(|x| x.1).unwrap_or("");
    let mut v: Vec<String> = names
        .split(',')
        .filter(|n| !n.is_empty())
        .map(|n| {
            let val = helper(&["getxattr", &p.to_string_lossy(), n, "65536"])
                .unwrap_or_else(|e| format!("errno {e}"));
            format!("{n}={val}")
        })
        .collect();
    v.sort();
    v.join(";")
}

/// FNV-1a, enough to tell contents apart in a snapshot.
pub(crate) fn digest(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Compares two snapshots and panics listing every path that differs.
pub(crate) fn assert_same_tree(
    what: &str,
    before: &BTreeMap<String, String>,
    after: &BTreeMap<String, String>,
) {
    let mut diffs = Vec::new();
    for (k, v) in before {
        match after.get(k) {
            None => diffs.push(format!("  missing after: {k} ({v})")),
            Some(w) if w != v => diffs.push(format!("  {k}:\n    before {v}\n    after  {w}")),
            _ => {}
        }
    }
    for k in after.keys() {
        if !before.contains_key(k) {
            diffs.push(format!("  new after: {k} ({})", after[k]));
        }
    }
    assert!(
        diffs.is_empty(),
        "{what}: trees differ:\n{}",
        diffs.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// The syscall helper
// ---------------------------------------------------------------------------------------

/// Source of the helper. Each command prints `0` or `0 RESULT` on success and `E ERRNO` on
/// failure, and exits 0 (2 for a usage error).
const HELPER_C: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

static int failed(void) { printf("E %d\n", errno); return 0; }
static int ok(void) { puts("0"); return 0; }
static int usage(const char *op) { fprintf(stderr, "helper: bad use of %s\n", op); return 2; }
static long long num(const char *s) { return strtoll(s, NULL, 0); }

static int open_flags(const char *s) {
    int f = 0, acc = O_RDONLY;
    if (strstr(s, "rw")) acc = O_RDWR;
    else if (strchr(s, 'w')) acc = O_WRONLY;
    if (strstr(s, "creat")) f |= O_CREAT;
    if (strstr(s, "excl")) f |= O_EXCL;
    if (strstr(s, "trunc")) f |= O_TRUNC;
    if (strstr(s, "append")) f |= O_APPEND;
    if (strstr(s, "dir")) f |= O_DIRECTORY;
    return f | acc;
}

static void parse_time(const char *s, struct timespec *t) {
    char *end;
    t->tv_sec = 0;
    if (!strcmp(s, "now")) { t->tv_nsec = UTIME_NOW; return; }
    if (!strcmp(s, "omit")) { t->tv_nsec = UTIME_OMIT; return; }
    t->tv_sec = strtoll(s, &end, 10);
    t->tv_nsec = *end == '.' ? strtol(end + 1, NULL, 10) : 0;
}

static int xattr_flags(const char *s) {
    if (!strcmp(s, "create")) return XATTR_CREATE;
    if (!strcmp(s, "replace")) return XATTR_REPLACE;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) return usage("?");
    const char *op = argv[1], *p = argv[2];
    if (!strcmp(op, "renameat2")) {
        if (argc != 5) return usage(op);
        unsigned fl = 0;
        if (strstr(argv[4], "noreplace")) fl |= RENAME_NOREPLACE;
        if (strstr(argv[4], "exchange")) fl |= RENAME_EXCHANGE;
        if (syscall(SYS_renameat2, AT_FDCWD, p, AT_FDCWD, argv[3], fl) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "utimens")) {
        if (argc != 5) return usage(op);
        struct timespec ts[2];
        parse_time(argv[3], &ts[0]);
        parse_time(argv[4], &ts[1]);
        if (utimensat(AT_FDCWD, p, ts, 0) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "setxattr")) {
        if (argc != 6) return usage(op);
        if (setxattr(p, argv[3], argv[4], strlen(argv[4]), xattr_flags(argv[5])) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "setxattr_len")) {
        if (argc != 6) return usage(op);
        size_t n = (size_t)num(argv[4]);
        char *v = malloc(n + 1);
        memset(v, 'v', n);
        int r = setxattr(p, argv[3], v, n, xattr_flags(argv[5]));
        free(v);
        if (r != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "getxattr")) {
        if (argc != 5) return usage(op);
        size_t size = (size_t)num(argv[4]);
        char *buf = malloc(size + 1);
        ssize_t n = getxattr(p, argv[3], size ? buf : NULL, size);
        if (n < 0) return failed();
        printf("0 %zd", n);
        if (size) { putchar(' '); fwrite(buf, 1, (size_t)n, stdout); }
        putchar('\n');
        free(buf);
        return 0;
    }
    if (!strcmp(op, "listxattr")) {
        if (argc != 4) return usage(op);
        size_t size = (size_t)num(argv[3]);
        char *buf = malloc(size + 1);
        ssize_t n = listxattr(p, size ? buf : NULL, size);
        if (n < 0) return failed();
        printf("0 %zd", n);
        if (size) {
            putchar(' ');
            /* NUL-separated names become comma-separated; the final NUL is dropped. */
            for (ssize_t i = 0; i < n; i++) {
                if (buf[i]) putchar(buf[i]);
                else if (i + 1 < n) putchar(',');
            }
        }
        putchar('\n');
        free(buf);
        return 0;
    }
    if (!strcmp(op, "removexattr")) {
        if (argc != 4) return usage(op);
        if (removexattr(p, argv[3]) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "lseek")) {
        if (argc != 5) return usage(op);
        int fd = open(p, O_RDONLY);
        if (fd < 0) return failed();
        off_t r = lseek(fd, (off_t)num(argv[3]), strcmp(argv[4], "data") ? SEEK_HOLE : SEEK_DATA);
        if (r < 0) return failed();
        printf("0 %lld\n", (long long)r);
        return 0;
    }
    if (!strcmp(op, "fallocate")) {
        if (argc != 6) return usage(op);
        int fd = open(p, O_RDWR);
        if (fd < 0) return failed();
        if (fallocate(fd, (int)num(argv[3]), (off_t)num(argv[4]), (off_t)num(argv[5])) != 0) return failed();
        if (close(fd) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "truncate")) {
        if (argc != 4) return usage(op);
        if (truncate(p, (off_t)num(argv[3])) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "mknod")) {
        if (argc != 6) return usage(op);
        mode_t m = 0644;
        if (!strcmp(argv[3], "fifo")) m |= S_IFIFO;
        else if (!strcmp(argv[3], "sock")) m |= S_IFSOCK;
        else if (!strcmp(argv[3], "chr")) m |= S_IFCHR;
        else if (!strcmp(argv[3], "blk")) m |= S_IFBLK;
        else m |= S_IFREG;
        if (mknod(p, m, makedev((unsigned)num(argv[4]), (unsigned)num(argv[5]))) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "open")) {
        if (argc != 4) return usage(op);
        int fd = open(p, open_flags(argv[3]), 0644);
        if (fd < 0) return failed();
        if (close(fd) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "write")) {
        if (argc != 4) return usage(op);
        int fd = open(p, O_WRONLY);
        if (fd < 0) return failed();
        if (write(fd, argv[3], strlen(argv[3])) < 0) return failed();
        if (close(fd) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "stat")) {
        struct stat st;
        if (lstat(p, &st) != 0) return failed();
        printf("0 %o %u %u %lld\n", st.st_mode, st.st_uid, st.st_gid, (long long)st.st_size);
        return 0;
    }
    if (!strcmp(op, "unlink")) { if (unlink(p) != 0) return failed(); return ok(); }
    if (!strcmp(op, "rmdir")) { if (rmdir(p) != 0) return failed(); return ok(); }
    if (!strcmp(op, "mkdir")) { if (mkdir(p, 0755) != 0) return failed(); return ok(); }
    if (!strcmp(op, "chmod")) {
        if (argc != 4) return usage(op);
        if (chmod(p, (mode_t)strtol(argv[3], NULL, 8)) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "chown")) {
        if (argc != 5) return usage(op);
        if (chown(p, (uid_t)num(argv[3]), (gid_t)num(argv[4])) != 0) return failed();
        return ok();
    }
    if (!strcmp(op, "rename")) {
        if (argc != 4) return usage(op);
        if (rename(p, argv[3]) != 0) return failed();
        return ok();
    }
    return usage(op);
}
"#;

/// The helper binary, compiled once per test process into cargo's per-target temp dir.
pub(crate) fn helper_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        fs::create_dir_all(&dir).expect("create CARGO_TARGET_TMPDIR");
        let bin = dir.join(format!(
            "etcfs-syscall-helper-{:016x}",
            digest(HELPER_C.as_bytes())
        ));
        if bin.exists() {
            return bin;
        }
        let tmp = dir.join(format!("helper-{}-{}", std::process::id(), next_id()));
        let src = tmp.with_extension("c");
        fs::write(&src, HELPER_C).expect("write helper source");
        let compiler = ["cc", "gcc"]
            .into_iter()
            .find(|c| Command::new(c).arg("--version").output().is_ok())
            .expect("a C compiler (cc or gcc) is needed to build the syscall helper");
        run_ok(
            Command::new(compiler)
                .args(["-O1", "-Wall", "-o"])
                .arg(&tmp)
                .arg(&src),
        );
        let _ = fs::remove_file(&src);
        // Atomic, so concurrent test processes never run a half-written binary.
        fs::rename(&tmp, &bin).expect("install helper");
        bin
    })
}

fn parse_helper(out: &Output, args: &[&str]) -> Result<String, i32> {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.trim_end_matches('\n');
    if let Some(rest) = line.strip_prefix("E ") {
        return Err(rest.trim().parse().expect("errno number"));
    }
    if line == "0" {
        return Ok(String::new());
    }
    match line.strip_prefix("0 ") {
        Some(rest) => Ok(rest.to_string()),
        None => panic!(
            "syscall helper {args:?}: unexpected output {text:?} (status {}, stderr {})",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// Runs the helper as root: `Ok(result text)` or `Err(errno)`.
pub(crate) fn helper(args: &[&str]) -> Result<String, i32> {
    let (out, in_time) = run_bounded(
        Command::new(helper_path()).args(args),
        Duration::from_secs(30),
    );
    assert!(in_time, "syscall helper {args:?} hung");
    parse_helper(&out, args)
}

/// Runs the helper as user and group 65534 (nobody), no supplementary groups. `bin` is a
/// copy of the helper that user can execute.
pub(crate) fn helper_as_nobody(bin: &Path, args: &[&str]) -> Result<String, i32> {
    let (out, in_time) = run_bounded(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(bin)
            .args(args),
        Duration::from_secs(30),
    );
    assert!(in_time, "syscall helper (nobody) {args:?} hung");
    parse_helper(&out, args)
}

// ---------------------------------------------------------------------------------------
// Space and data helpers shared by the integrity and shared-open tests
// ---------------------------------------------------------------------------------------

/// A formatted filesystem of `bytes` with allocation groups of `group_mib` MiB, after the
/// prerequisite checks (`None`: skipped).
pub(crate) fn small_groups(test: &str, bytes: u64, group_mib: u64) -> Option<TestFs> {
    let endpoints = etcd_or_skip(test, None)?;
    let mut fs = TestFs::blank(test, &endpoints, bytes);
    fs.mkfs_with(&["--group-size", &group_mib.to_string()]);
    Some(fs)
}

/// Deterministic bytes that differ per seed and per position (a read of the wrong file's
/// blocks shows up as a mismatch at once).
pub(crate) fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// (total, free) 4 KiB blocks by statfs.
pub(crate) fn statfs_blocks(mnt: &Path) -> (u64, u64) {
    let out = run_ok(Command::new("stat").args(["-f", "-c", "%b %f %S"]).arg(mnt));
    let v: Vec<u64> = out.split_whitespace().map(|w| w.parse().unwrap()).collect();
    assert_eq!(v[2], 4096, "statfs block size");
    (v[0], v[1])
}

// ---------------------------------------------------------------------------------------
// A private etcd cluster the test can kill and restart
// ---------------------------------------------------------------------------------------

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// One member of an [`EtcdCluster`].
struct EtcdMember {
    name: String,
    client: String,
    peer: String,
    child: Option<Child>,
}

/// A private etcd of one or more members on loopback, each its own process on its own
/// data directory, so that a test can kill a leader or a majority and start them again.
pub(crate) struct EtcdCluster {
    dir: PathBuf,
    members: Vec<EtcdMember>,
    /// More etcd flags, for every member.
    extra: Vec<String>,
}

impl EtcdCluster {
    /// Whether the etcd binary is here.
    pub(crate) fn available() -> bool {
        Command::new("etcd").arg("--version").output().is_ok()
    }

    /// Starts `n` members and waits until the cluster answers.
    pub(crate) fn start(label: &str, n: usize) -> EtcdCluster {
        EtcdCluster::start_with(label, n, &[])
    }

    /// [`EtcdCluster::start`] with more etcd flags.
    pub(crate) fn start_with(label: &str, n: usize, extra: &[&str]) -> EtcdCluster {
        let dir = temp_base(label);
        let members: Vec<EtcdMember> = (0..n)
            .map(|i| EtcdMember {
                name: format!("m{i}"),
                client: format!("http://127.0.0.1:{}", free_port()),
                peer: format!("http://127.0.0.1:{}", free_port()),
                child: None,
            })
            .collect();
        let mut c = EtcdCluster {
            dir,
            members,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        for i in 0..n {
            c.run(i);
        }
        c.wait_healthy(Duration::from_secs(30));
        c
    }

    /// Every member's client URL, comma-separated (as `--etcd` takes them).
    pub(crate) fn endpoints(&self) -> String {
        let urls: Vec<&str> = self.members.iter().map(|m| m.client.as_str()).collect();
        urls.join(",")
    }

    /// Starts member `i` (again, on its data, after [`EtcdCluster::stop`]).
    pub(crate) fn run(&mut self, i: usize) {
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer))
            .collect();
        let m = &self.members[i];
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{}.log", m.name)))
            .expect("etcd log");
        let child = Command::new("etcd")
            .args(["--name", &m.name, "--data-dir"])
            .arg(self.dir.join(&m.name))
            .args(["--listen-client-urls", &m.client])
            .args(["--advertise-client-urls", &m.client])
            .args(["--listen-peer-urls", &m.peer])
            .args(["--initial-advertise-peer-urls", &m.peer])
            .args(["--initial-cluster", &initial.join(",")])
            .args(["--initial-cluster-token", "etcfs-test"])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup"))
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        self.members[i].child = Some(child);
        let addr = self.members[i]
            .client
            .trim_start_matches("http://")
            .to_string();
        let start = Instant::now();
        while std::net::TcpStream::connect(&addr).is_err() {
            // A member restarted on a loaded CI machine once took longer than 20 s; what
            // it was doing went unrecorded, so its log now comes with the failure.
            let exited = self.members[i]
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || start.elapsed() > Duration::from_secs(60) {
                let log =
                    std::fs::read_to_string(self.dir.join(format!("{}.log", self.members[i].name)))
                        .unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                panic!(
                    "etcd member {i} did not listen on {addr} within {:?} (exit: {exited:?}); \
                     the end of its log:\n{}",
                    start.elapsed(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills member `i` (SIGKILL: as a crash).
    pub(crate) fn stop(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            signal(&mut c, "KILL");
            if wait_bounded(&mut c, Duration::from_secs(10)).is_none() {
                loud(&format!("etcd pid {} survives SIGKILL", c.id()));
            }
        }
    }

    /// Waits until every running member reports healthy (a leader exists).
    pub(crate) fn wait_healthy(&self, within: Duration) {
        let start = Instant::now();
        loop {
            let (out, _) = run_bounded(
                Command::new("etcdctl")
                    .args(["--endpoints", &self.endpoints(), "--command-timeout", "2s"])
                    .args(["endpoint", "health", "--cluster=false"]),
                Duration::from_secs(10),
            );
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            let running = self.members.iter().filter(|m| m.child.is_some()).count();
            if text.matches("is healthy").count() >= running {
                return;
            }
            assert!(start.elapsed() < within, "etcd not healthy: {text}");
            thread::sleep(Duration::from_millis(200));
        }
    }

    /// The index of the current leader.
    pub(crate) fn leader(&self) -> usize {
        let (out, _) = run_bounded(
            Command::new("etcdctl")
                .args(["--endpoints", &self.endpoints(), "--command-timeout", "2s"])
                .args(["endpoint", "status", "-w", "json"]),
            Duration::from_secs(10),
        );
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("etcdctl endpoint status json");
        let rows = v.as_array().expect("one row per endpoint");
        for row in rows {
            let id = &row["Status"]["header"]["member_id"];
            if *id == row["Status"]["leader"] {
                let ep = row["Endpoint"].as_str().unwrap_or_default();
                if let Some(i) = self.members.iter().position(|m| m.client == ep) {
                    return i;
                }
            }
        }
        panic!("no leader in {v}");
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.stop(i);
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Requests of `op` counted in an `etcfs stats --json` report.
pub(crate) fn op_count(stats: &serde_json::Value, op: &str) -> u64 {
    stats["ops"]
        .as_array()
        .expect("ops is a list")
        .iter()
        .filter(|o| o["op"] == op)
        .map(|o| o["count"].as_u64().expect("count is a number"))
        .sum()
}

/// One HTTP request to a daemon's `--metrics` endpoint: (status code, body).
pub(crate) fn http_get(port: u16, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to --metrics");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read the answer");
    let raw = String::from_utf8(raw).expect("a text answer");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a head and a body");
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    (code, body.to_owned())
}
