//! What the mount tests of the transport share: a skip rule, and a session on a temporary
//! mountpoint that is stopped and removed when dropped.

#![allow(dead_code, reason = "each test file uses part of it")]

use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use fusedev::{
    mount::{Mount, MountOptions},
    opcode::Opcode,
    server::Handler,
    transport::{Session, SessionConfig, TransportChoice},
};

/// Whether mount tests can run here (root and /dev/fuse); skips loudly when not, and fails
/// instead when ETCFS_REQUIRE_MOUNT_TESTS is set.
pub(crate) fn mount_tests_possible(test: &str) -> bool {
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    let ok = root && Path::new("/dev/fuse").exists();
    if !ok {
        assert!(
            std::env::var_os("ETCFS_REQUIRE_MOUNT_TESTS").is_none(),
            "{test}: needs root and /dev/fuse, and ETCFS_REQUIRE_MOUNT_TESTS is set"
        );
        eprintln!("SKIP: {test}: needs root and /dev/fuse");
    }
    ok
}

/// Whether FUSE-over-io_uring can run here, as [`mount_tests_possible`] decides for mounts.
pub(crate) fn uring_tests_possible(test: &str) -> bool {
    if !mount_tests_possible(test) {
        return false;
    }
    let on = std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .is_ok_and(|v| v.trim() == "Y");
    if !on {
        assert!(
            std::env::var_os("ETCFS_REQUIRE_MOUNT_TESTS").is_none(),
            "{test}: enable_uring is off and ETCFS_REQUIRE_MOUNT_TESTS is set"
        );
        eprintln!("SKIP: {test}: enable_uring is off");
    }
    on
}

/// A session on its own mountpoint.
pub(crate) struct Mounted {
    pub(crate) dir: PathBuf,
    pub(crate) session: Option<Session>,
    /// The session's counters.
    pub(crate) perf: Arc<perf::Registry>,
    /// The connection's number under /sys/fs/fuse/connections.
    pub(crate) connection: u64,
    mount: Arc<Mount>,
}

impl Mounted {
    /// Aborts the connection: requests still owed fail, so that no thread of the test
    /// process waits on one forever (a process cannot exit while it does, and its /dev/fuse
    /// descriptor, whose closing would end them, closes only when it exits).
    pub(crate) fn abort(&self) {
        let path = format!("{FUSECTL}/{}/abort", self.connection);
        if let Err(e) = std::fs::write(&path, "1") {
            eprintln!("cannot abort the connection through {path}: {e}");
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort();
        }
        if let Some(s) = self.session.take() {
            s.stopper().shutdown();
            s.wait();
        }
        // A test that took the session out (to wait for it) leaves the mount to us; a no-op
        // when the session's shutdown unmounted it.
        if let Err(e) = self.mount.unmount() {
            eprintln!("cannot unmount {}: {e}", self.dir.display());
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A configuration with one worker on the first allowed CPU and two entries per queue.
pub(crate) fn small_config(transport: TransportChoice) -> SessionConfig {
    SessionConfig {
        transport,
        cpus: vec![uring::cpu::allowed_cpus().expect("cpus")[0]],
        ring_entries_per_queue: 2,
        ring_share_above: 0,
        devfuse_reads_per_core: 2,
        device_spin: std::time::Duration::ZERO,
        ring_linger: std::time::Duration::ZERO,
    }
}

/// Where the kernel lists FUSE connections. Not every machine mounts it at boot (a CI
/// machine did not, and the abort test could not find its connection), so the tests mount
/// it when it is missing.
const FUSECTL: &str = "/sys/fs/fuse/connections";

fn ensure_fusectl() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if fusedev::mount::is_mount_point(Path::new(FUSECTL)).unwrap_or(false) {
            return;
        }
        let status = std::process::Command::new("mount")
            .args(["-t", "fusectl", "fusectl", FUSECTL])
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!("cannot mount fusectl at {FUSECTL}: {status:?}");
        }
    });
}

/// Mounts `fs` at a fresh directory named after `name` and serves it with `cfg`.
pub(crate) fn mount(fs: Arc<dyn Handler>, name: &str, cfg: &SessionConfig) -> Mounted {
    let dir = std::env::temp_dir().join(format!(
        "etcfs-{name}-{}-{:?}",
        std::process::id(),
        cfg.transport
    ));
    std::fs::create_dir_all(&dir).expect("create mountpoint");
    let opts = MountOptions {
        fsname: "etcfs-test".into(),
        allow_other: false,
        noatime: false,
        read_only: false,
        noexec: false,
        uid: 0,
        gid: 0,
    };
    ensure_fusectl();
    let mnt = Arc::new(Mount::new(&dir, &opts).expect("mount"));
    let names: Vec<&'static str> = Opcode::NAMES.to_vec();
    let perf = perf::Registry::new(
        names,
        fusedev::transport::COUNTERS.to_vec(),
        // One slot per worker, and one for the sideband reader.
        cfg.cpus.len() + 1,
        false,
    );
    let session = Session::start(mnt.clone(), fs, perf.clone(), cfg, true).expect("start session");
    let dev = std::fs::metadata(&dir).expect("stat the mount").dev();
    Mounted {
        dir,
        session: Some(session),
        perf,
        // The minor number of the connection's anonymous device.
        connection: libc::minor(dev).into(),
        mount: mnt,
    }
}
