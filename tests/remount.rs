//! Remount tests (issue 12): `umount M && etcfs mount … M` must keep the new mount. The old
//! daemon, leaving after the external umount, used to unmount whatever was at M by then: the
//! new mount, 5 times of 5 on the etcd-backed filesystem, whose daemon takes long enough to
//! leave. And `etcfs mount` over the dead mount of a killed daemon must say how to clear it.
//!
//! Needs root, `/dev/fuse` and, for the etcd-backed tests, `ETCD_ENDPOINTS` (see `common`);
//! skips loudly otherwise, and fails instead when `ETCFS_REQUIRE_MOUNT_TESTS=1`. Every daemon
//! is owned by a `common::Daemon` guard, and every mount at the mount point is taken down by
//! the guards (`umount -l` until none is left), so a failing test leaves nothing behind.

mod common;

use std::{
    fs::{self, File},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use common::{
    abort_connection, can_run, errno_of, loud, mount_count, run_bounded, temp_base, umount_all,
    unescape_mountinfo, wait_bounded, Daemon, TestFs, DAEMON_DEADLINE, ETCFS,
};

/// Remount cycles on the etcd-backed filesystem.
const ETCFS_CYCLES: usize = 20;
/// Remount cycles on memfs, on each transport.
const MEMFS_CYCLES: usize = 20;
/// How long after the remount the new mount must still be there, at least (issue 12 lost it
/// within 1.5 s), when the old daemon has already exited sooner.
const SETTLE: Duration = Duration::from_millis(1500);

/// The filesystem type of the mount on top at `path` (the last one listed there).
fn top_fstype(path: &Path) -> Option<String> {
    let want = path.to_string_lossy();
    let info = fs::read_to_string("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    info.lines()
        .rev()
        .filter(|l| l.split(' ').nth(4).map(unescape_mountinfo).as_deref() == Some(&*want))
        .filter_map(|l| l.split(" - ").nth(1))
        .find_map(|rest| rest.split(' ').next().map(str::to_string))
}

/// `umount M` (not lazy), as an administrator restarting the filesystem would run it.
fn external_umount(mnt: &Path) {
    let (out, in_time) = run_bounded(Command::new("umount").arg(mnt), Duration::from_secs(10));
    assert!(
        in_time && out.status.success(),
        "umount {}: {}",
        mnt.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The directory under the mount point: a descriptor opened before anything is mounted
/// there still names it, so files written through a mount must never show up in it.
struct Underneath(File);

impl Underneath {
    fn open(mnt: &Path) -> Underneath {
        assert_eq!(mount_count(mnt), 0, "{} is mounted already", mnt.display());
        Underneath(File::open(mnt).expect("open the bare mount point"))
    }

    fn path(&self, name: &str) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}/{name}", self.0.as_raw_fd()))
    }
}

/// `cycles` times: `umount M`, at once a new daemon on M, then check that M still holds an
/// etcfs mount once the old daemon is gone, that a file written there reads back through
/// it, and that the file is not in the directory underneath. `spawn(i)` mounts M.
fn remount_cycles(
    test: &str,
    mnt: &Path,
    cycles: usize,
    persistent: bool,
    mut spawn: impl FnMut(usize) -> Daemon,
) {
    let under = Underneath::open(mnt);
    let mut current = spawn(0);
    for i in 1..=cycles {
        let old = current;
        external_umount(mnt);
        let remounted = Instant::now();
        current = spawn(i);
        // Whatever the old daemon does on its way out, it has done once it has exited.
        let old_log = old.log.clone();
        let status = old.exited_leaving_mountpoint("an external umount");
        assert!(
            status.success(),
            "cycle {i}: the old daemon exited with {status}:\n{}",
            fs::read_to_string(&old_log).unwrap_or_default()
        );
        if i == 1 || i == cycles {
            // As issue 12 saw it, in case anything else were to act later.
            std::thread::sleep(SETTLE.saturating_sub(remounted.elapsed()));
        }
        assert_eq!(
            mount_count(mnt),
            1,
            "cycle {i}: {} should hold exactly the new mount",
            mnt.display()
        );
        assert_eq!(
            top_fstype(mnt).as_deref(),
            Some("fuse.etcfs"),
            "cycle {i}: the new mount is gone"
        );
        let name = format!("probe-{i}");
        let body = format!("written through mount {i}");
        fs::write(current.path(&name), &body).expect("write through the new mount");
        assert_eq!(
            fs::read_to_string(current.path(&name)).expect("read back"),
            body,
            "cycle {i}"
        );
        assert_eq!(
            errno_of(fs::metadata(under.path(&name))),
            Some(libc::ENOENT),
            "cycle {i}: {name} landed in the directory under the mount point"
        );
        if persistent {
            // The same filesystem after every remount: what earlier mounts wrote is there.
            for j in 1..i {
                assert!(
                    current.path(&format!("probe-{j}")).exists(),
                    "cycle {i}: probe-{j} from an earlier mount is missing"
                );
            }
        }
    }
    current.stop();
    let left: Vec<_> = fs::read_dir(under.path(""))
        .expect("list the directory under the mount point")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "files under the mount point: {left:?}");
    loud(&format!("{test}: {cycles} remounts kept"));
}

#[test]
fn immediate_remount_keeps_new_mount_etcfs() {
    let test = "immediate_remount_keeps_new_mount_etcfs";
    let Some(fs) = TestFs::new_or_skip(test, None) else {
        return;
    };
    remount_cycles(test, &fs.mountpoint(), ETCFS_CYCLES, true, |_| {
        fs.mount("auto", &[])
    });
}

fn immediate_remount_keeps_new_mount_memfs(transport: &str) {
    let test = format!("{transport}::immediate_remount_keeps_new_mount_memfs");
    if !can_run(&test, Some(transport)) {
        return;
    }
    let base = Scratch(temp_base(&format!("{transport}-remount")));
    let mnt = base.0.join("mnt");
    fs::create_dir(&mnt).expect("create mountpoint");
    let args: Vec<String> = ["--memfs", "--transport", transport]
        .iter()
        .map(|s| s.to_string())
        .collect();
    remount_cycles(&test, &mnt, MEMFS_CYCLES, false, |i| {
        Daemon::spawn(
            &args,
            &mnt,
            &base.0.join(format!("daemon-{i}.log")),
            transport,
        )
    });
}

/// A scratch directory holding a mount point `mnt`, removed on drop (even when the test
/// fails) once nothing is mounted in it; declared before the daemons, so they drop first.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let mnt = self.0.join("mnt");
        umount_all(&mnt);
        if mount_count(&mnt) == 0 {
            let _ = fs::remove_dir_all(&self.0);
        } else {
            loud(&format!(
                "leaving {} behind: still mounted",
                self.0.display()
            ));
        }
    }
}

#[test]
fn immediate_remount_keeps_new_mount_memfs_devfuse() {
    immediate_remount_keeps_new_mount_memfs("devfuse");
}

#[test]
fn immediate_remount_keeps_new_mount_memfs_uring() {
    immediate_remount_keeps_new_mount_memfs("uring");
}

/// Kills the daemon with SIGKILL and reaps it, leaving its mount behind, dead.
fn kill_leaving_dead_mount(d: &mut Daemon) {
    let mnt = d.mnt.clone();
    d.child().kill().expect("SIGKILL the daemon");
    if wait_bounded(d.child(), Duration::from_secs(3)).is_none() {
        // See `common::Daemon::crash`: a killed daemon can be stuck in the kernel.
        abort_connection(&mnt);
    }
    assert!(
        wait_bounded(d.child(), DAEMON_DEADLINE).is_some(),
        "the daemon did not exit after SIGKILL"
    );
    // ENOTCONN once settled; right after the kill, ECONNABORTED or (io_uring) ECANCELED.
    let e = errno_of(fs::metadata(&mnt));
    assert!(
        matches!(
            e,
            Some(libc::ENOTCONN) | Some(libc::ECONNABORTED) | Some(libc::ECANCELED)
        ),
        "a killed daemon's mount point should answer ENOTCONN, got errno {e:?}"
    );
}

/// `etcfs mount ARGS M` over the dead mount at M: must fail in time, mount nothing, and say
/// how to clear the dead mount.
fn expect_dead_mount_error(what: &str, cmd: &mut Command, mnt: &Path) {
    let (out, in_time) = run_bounded(cmd, DAEMON_DEADLINE);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(in_time, "{what}: etcfs mount over a dead mount hung");
    assert!(
        !out.status.success(),
        "{what}: etcfs mount over a dead mount succeeded: {text}"
    );
    let fix = format!("umount -l {}", mnt.display());
    assert!(
        text.contains("dead FUSE mount") && text.contains(&fix),
        "{what}: the error should name the dead mount and `{fix}`: {text}"
    );
    assert_eq!(
        mount_count(mnt),
        1,
        "{what}: only the dead mount may be there"
    );
}

#[test]
fn mount_over_dead_mount_names_the_fix() {
    let test = "mount_over_dead_mount_names_the_fix";
    if !can_run(test, None) {
        return;
    }
    let mut dead = Daemon::memfs("dead", "devfuse", &[]);
    let mnt = dead.mnt.clone();
    fs::write(dead.path("f"), b"x").expect("write before the kill");
    kill_leaving_dead_mount(&mut dead);
    let log = mnt.with_file_name("detached.log");
    for foreground in [true, false] {
        let mut cmd = common::memfs_mount_command(foreground, &log);
        expect_dead_mount_error(&format!("foreground={foreground}"), cmd.arg(&mnt), &mnt);
    }
    // The command the error names clears it, and the mount point takes a new mount.
    let (out, _) = run_bounded(
        Command::new("umount").arg("-l").arg(&mnt),
        Duration::from_secs(10),
    );
    assert!(out.status.success(), "umount -l of the dead mount failed");
    let args: Vec<String> = ["--memfs", "--transport", "devfuse"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let again = Daemon::spawn(&args, &mnt, &mnt.with_file_name("again.log"), "devfuse");
    fs::write(again.path("g"), b"y").expect("write through the new mount");
    again.stop();
    drop(dead);
}

#[test]
fn mount_over_dead_mount_names_the_fix_etcfs() {
    let test = "mount_over_dead_mount_names_the_fix_etcfs";
    let Some(fs) = TestFs::new_or_skip(test, None) else {
        return;
    };
    let mut dead = fs.mount("auto", &[]);
    kill_leaving_dead_mount(&mut dead);
    let mnt = fs.mountpoint();
    expect_dead_mount_error(
        "etcfs",
        Command::new(ETCFS)
            .args(["mount", "--foreground"])
            .args(fs.mount_args("auto", &[]))
            .arg(&mnt),
        &mnt,
    );
    drop(dead);
}
