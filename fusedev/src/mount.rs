//! mount(2) and umount(2) of a FUSE filesystem as root, without fusermount.

use std::{
    ffi::CString,
    fs, io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
        unix::{ffi::OsStrExt, fs::OpenOptionsExt},
    },
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
};

/// Filesystem type suffix; the kernel reports the mount as `fuse.etcfs`.
pub const SUBTYPE: &str = "etcfs";

/// `FUSE_DEV_IOC_CLONE` = `_IOR(229, 0, uint32_t)`.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

const ENABLE_URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// How to mount.
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// Shown as the mount's source in /proc/mounts.
    pub fsname: String,
    /// Let users other than the mounting one access the filesystem.
    pub allow_other: bool,
    /// Mount `noatime` (shown in /proc/mounts; FUSE leaves atime to the filesystem,
    /// which must then not update it either).
    pub noatime: bool,
    /// Mount read-only (`MS_RDONLY`): the kernel answers EROFS to every write.
    pub read_only: bool,
    /// Mount `noexec` (`MS_NOEXEC`).
    pub noexec: bool,
    /// Owner the kernel reports for the connection (`user_id=`, `group_id=`).
    pub uid: u32,
    /// See `uid`.
    pub gid: u32,
}

/// Why a mount failed. Each message says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("mountpoint {0} does not exist; create it with `mkdir -p {0}`")]
    NoMountpoint(PathBuf),
    #[error("mountpoint {0} is not a directory")]
    NotADirectory(PathBuf),
    #[error("mountpoint {0} is already a mount point; unmount it first (`umount {0}`)")]
    Busy(PathBuf),
    #[error(
        "mountpoint {path} is a dead FUSE mount: its daemon is gone ({why}); clear it with \
         `umount -l {path}` (or `fusermount3 -uz {path}`), then mount again"
    )]
    DeadMount { path: PathBuf, why: String },
    #[error("cannot open /dev/fuse: {0} (is the fuse module loaded and /dev/fuse present?)")]
    NoDevFuse(io::Error),
    #[error("mount(2) of {path} failed: {source}{hint}")]
    Mount {
        path: PathBuf,
        source: io::Error,
        hint: &'static str,
    },
    #[error("cannot inspect mountpoint {path}: {source}")]
    Inspect { path: PathBuf, source: io::Error },
    #[error("cannot identify the new mount at {path} (so it could not be unmounted safely later): {source}")]
    Identify { path: PathBuf, source: io::Error },
}

/// Which mount is this connection's, taken right after mount(2). A path alone cannot say:
/// once someone else unmounts ours, the path may hold a newer mount, and the kernel hands
/// that one the device number and mountinfo id ours just freed (both come from allocators
/// that reuse the lowest free number; seen in the tests of issue 12).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MountIdentity {
    /// `st_dev` of the mount's root: for FUSE, the connection (`/sys/fs/fuse/connections/N`,
    /// the third field of mountinfo). Unique only while the connection's superblock lives.
    dev: (u32, u32),
    /// `STATX_MNT_ID_UNIQUE` (Linux 6.8+), never reused while the system runs.
    unique: Option<u64>,
}

/// A mounted FUSE connection: the `/dev/fuse` descriptor the kernel talks on and the place
/// it is mounted. Dropping it unmounts, if the mount there is still this one.
#[derive(Debug)]
pub struct Mount {
    dev: OwnedFd,
    mountpoint: PathBuf,
    mounted: AtomicBool,
    identity: MountIdentity,
}

/// Checks that `mountpoint` can take a new mount (an existing directory, not a mount point,
/// not the dead mount of a killed FUSE daemon) and returns its canonical path.
pub fn check_mountpoint(mountpoint: &Path) -> Result<PathBuf, MountError> {
    let meta = fs::metadata(mountpoint).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) => MountError::NoMountpoint(mountpoint.to_path_buf()),
        // A FUSE mount whose daemon died answers ENOTCONN; for a moment after the death,
        // requests in flight answer ECONNABORTED, or ECANCELED over io_uring (seen right
        // after a kill -9). Nothing can be mounted there until it is cleared.
        Some(libc::ENOTCONN) | Some(libc::ECONNABORTED) | Some(libc::ECANCELED)
            if is_mount_point(&canonical_name(mountpoint)).unwrap_or(false) =>
        {
            MountError::DeadMount {
                path: canonical_name(mountpoint),
                why: e.to_string(),
            }
        }
        _ => MountError::Inspect {
            path: mountpoint.to_path_buf(),
            source: e,
        },
    })?;
    if !meta.is_dir() {
        return Err(MountError::NotADirectory(mountpoint.to_path_buf()));
    }
    let path = fs::canonicalize(mountpoint).map_err(|e| MountError::Inspect {
        path: mountpoint.to_path_buf(),
        source: e,
    })?;
    if is_mount_point(&path).map_err(|e| MountError::Inspect {
        path: path.clone(),
        source: e,
    })? {
        return Err(MountError::Busy(path));
    }
    Ok(path)
}

/// The absolute path of `p` for messages, when `p` itself cannot be resolved (a dead mount
/// answers nothing): its parent resolved, joined with its name.
fn canonical_name(p: &Path) -> PathBuf {
    match (p.parent(), p.file_name()) {
        (Some(parent), Some(name)) => {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            fs::canonicalize(parent).map_or_else(|_| p.to_path_buf(), |d| d.join(name))
        }
        _ => p.to_path_buf(),
    }
}

/// An `O_PATH` descriptor of the mount on top at `path`. It sends the filesystem nothing,
/// so it neither waits for a daemon that has not answered INIT yet nor fails on a dead one.
fn pin_top_mount(path: &Path) -> io::Result<OwnedFd> {
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_CLOEXEC)
        .open(path)?;
    Ok(OwnedFd::from(f))
}

/// The identity of the mount `fd` is on (see [`pin_top_mount`]).
fn identify(fd: BorrowedFd<'_>) -> io::Result<MountIdentity> {
    // SAFETY: statx is plain old data; all zeroes is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // DONT_SYNC: the cached attributes are enough for the device and mount id, and a FUSE
    // daemon that has not answered INIT yet (ours, right after mount(2)) must not be asked.
    // SAFETY: the path is a NUL-terminated literal, stx a live, writable statx.
    let rc = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC,
            libc::STATX_MNT_ID_UNIQUE,
            &mut stx,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(MountIdentity {
        dev: (stx.stx_dev_major, stx.stx_dev_minor),
        unique: (stx.stx_mask & libc::STATX_MNT_ID_UNIQUE != 0).then_some(stx.stx_mnt_id),
    })
}

impl Mount {
    /// Mounts a new FUSE connection on `mountpoint` (which must be an existing directory that
    /// is not already a mount point). Requires root (CAP_SYS_ADMIN).
    pub fn new(mountpoint: &Path, opts: &MountOptions) -> Result<Mount, MountError> {
        let path = check_mountpoint(mountpoint)?;

        let dev = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .map_err(MountError::NoDevFuse)?;
        let dev = OwnedFd::from(dev);
        let data = format!(
            "fd={},rootmode={:o},user_id={},group_id={},default_permissions{}",
            dev.as_raw_fd(),
            libc::S_IFDIR,
            opts.uid,
            opts.gid,
            if opts.allow_other { ",allow_other" } else { "" },
        );
        let source = cstring(opts.fsname.as_bytes());
        let target = cstring(path.as_os_str().as_bytes());
        let fstype = cstring(format!("fuse.{SUBTYPE}").as_bytes());
        let data_c = cstring(data.as_bytes());
        // SAFETY: every pointer is a NUL-terminated string that outlives the call.
        let rc = unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                mount_flags(opts),
                data_c.as_ptr().cast(),
            )
        };
        if rc != 0 {
            let source = io::Error::last_os_error();
            let hint = match source.raw_os_error() {
                Some(libc::EPERM) => " (mounting FUSE this way needs root)",
                Some(libc::EBUSY) => " (the mountpoint is busy)",
                _ => "",
            };
            return Err(MountError::Mount { path, source, hint });
        }
        let identity = match pin_top_mount(&path).and_then(|fd| identify(fd.as_fd())) {
            Ok(id) => id,
            Err(source) => {
                // Undone now, while the mount at the path can only be the one just made.
                // SAFETY: target is a NUL-terminated path that outlives the call.
                unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
                return Err(MountError::Identify { path, source });
            }
        };
        log::info!(
            "mounted {} as FUSE connection {}:{}{}",
            path.display(),
            identity.dev.0,
            identity.dev.1,
            identity
                .unique
                .map_or_else(String::new, |u| format!(" (mount {u})"))
        );
        Ok(Mount {
            dev,
            mountpoint: path,
            mounted: AtomicBool::new(true),
            identity,
        })
    }

    /// The `/dev/fuse` descriptor of this connection.
    pub fn fd(&self) -> RawFd {
        self.dev.as_raw_fd()
    }

    /// Where the filesystem is mounted (canonical path).
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// A new `/dev/fuse` descriptor bound to this connection with its own processing queue
    /// (`FUSE_DEV_IOC_CLONE`): a reply must be written to the descriptor its request was
    /// read from, so every worker reads and replies on its own clone.
    pub fn clone_fd(&self) -> io::Result<OwnedFd> {
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")?;
        let fd = OwnedFd::from(file);
        let master: u32 = u32::try_from(self.dev.as_raw_fd()).expect("fds are non-negative");
        // SAFETY: the ioctl reads one u32 from a live local.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), FUSE_DEV_IOC_CLONE, &master) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(fd)
    }

    /// Unmounts this connection's mount, and only it: when the mount on top at the mount
    /// point is another one (ours was unmounted from outside and the path mounted again, or
    /// something was mounted over ours), nothing is unmounted. The unmount is lazy (detached
    /// now, released when the last user closes), so a shutdown never waits on an
    /// application. Idempotent. Returns whether it unmounted.
    pub fn unmount(&self) -> io::Result<bool> {
        if !self.mounted.swap(false, Ordering::SeqCst) {
            return Ok(false);
        }
        // The pin keeps the mount we check the one we unmount: it cannot be freed and its
        // number handed to a new mount meanwhile.
        let top = match pin_top_mount(&self.mountpoint) {
            Ok(fd) => fd,
            Err(e) => {
                log::info!(
                    "not unmounting {}: cannot open it ({e})",
                    self.mountpoint.display()
                );
                return Ok(false);
            }
        };
        let top_id = identify(top.as_fd())?;
        if !self.is_ours(top_id) {
            self.log_not_ours(top_id);
            return Ok(false);
        }
        // Through the pin, not the path: a path names whatever is mounted there by the time
        // umount2 looks. The pin holds a reference of its own, so a plain umount would only
        // say EBUSY; detaching releases the mount when the pin closes, below, unless
        // applications still have files open in it.
        let target = cstring(format!("/proc/self/fd/{}", top.as_raw_fd()).as_bytes());
        // SAFETY: target is a NUL-terminated path that outlives the call.
        let rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            // Detached from outside since the check (`umount -l`): nothing left to do.
            if matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOENT)) {
                return Ok(false);
            }
            return Err(err);
        }
        Ok(true)
    }

    /// Whether the mount `top` was found on is this connection's.
    fn is_ours(&self, top: MountIdentity) -> bool {
        match (self.identity.unique, top.unique) {
            (Some(ours), Some(theirs)) => ours == theirs,
            // Before Linux 6.8 only the device number is left, and it names our connection
            // only while the connection lives (its superblock holds the number). Checked
            // after `top` was read: a connection never comes back to life.
            _ => top.dev == self.identity.dev && self.connection_alive(),
        }
    }

    /// False once the kernel has ended the connection (unmount or abort): the device then
    /// polls as an error.
    fn connection_alive(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.dev.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one live pollfd without waiting.
        let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
        rc >= 0 && pfd.revents & libc::POLLERR == 0
    }

    /// Says why the mount point was left alone, and what is left to clear by hand if ours
    /// may still be under another mount.
    fn log_not_ours(&self, top: MountIdentity) {
        let path = self.mountpoint.display();
        let (major, minor) = self.identity.dev;
        let ours = format!("{major}:{minor}");
        let buried = fs::read_to_string("/proc/self/mountinfo").is_ok_and(|info| {
            info.lines().any(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                f.get(2) == Some(&ours.as_str())
                    && f.get(4).map(|m| unescape_mountinfo(m))
                        == Some(self.mountpoint.as_os_str().as_bytes().to_vec())
            })
        });
        if buried && top.dev != self.identity.dev {
            log::warn!(
                "not unmounting {path}: another mount covers ours (connection {ours}); ours ends \
                 with this daemon and stays as a dead mount under it: once the upper one is gone, \
                 clear it with `umount -l {path}`"
            );
        } else {
            log::info!(
                "not unmounting {path}: it no longer holds this daemon's mount (connection \
                 {ours}; unmounted from outside)"
            );
        }
    }

    /// Write a whole message (a notification) to the connection's device. Notifications
    /// must not be sent from inside a request handler: the kernel may hold a directory lock
    /// that the handler's request is waiting under.
    pub fn write_message(&self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: writes msg.len() bytes from a live slice to an fd we own.
        let n = unsafe { libc::write(self.dev.as_raw_fd(), msg.as_ptr().cast(), msg.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            log::warn!("unmount {} failed: {e}", self.mountpoint.display());
        }
    }
}

/// The mount(2) flags of `opts`. Always nosuid and nodev: another node's root decides
/// what the files are, not this node's.
fn mount_flags(opts: &MountOptions) -> libc::c_ulong {
    let mut f = libc::MS_NOSUID | libc::MS_NODEV;
    for (on, flag) in [
        (opts.noatime, libc::MS_NOATIME),
        (opts.read_only, libc::MS_RDONLY),
        (opts.noexec, libc::MS_NOEXEC),
    ] {
        if on {
            f |= flag;
        }
    }
    f
}

fn cstring(bytes: &[u8]) -> CString {
    CString::new(bytes).unwrap_or_else(|_| CString::from(c"?"))
}

/// True when `path` (canonical) is itself a mount point in this mount namespace.
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    let info = fs::read_to_string("/proc/self/mountinfo")?;
    let wanted = path.as_os_str().as_bytes();
    Ok(info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| unescape_mountinfo(m) == wanted))
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> Vec<u8> {
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
    out
}

/// Whether the running kernel will carry FUSE over io_uring, turning the `enable_uring`
/// module parameter on when it is off and we may (root). Returns `(available, changed)`.
pub fn ensure_uring_enabled() -> (bool, bool) {
    match fs::read_to_string(ENABLE_URING_PARAM) {
        Ok(v) if v.trim() == "Y" || v.trim() == "1" => (true, false),
        Ok(_) => match fs::write(ENABLE_URING_PARAM, "Y") {
            Ok(()) => (true, true),
            Err(e) => {
                log::info!("cannot turn on {ENABLE_URING_PARAM}: {e}");
                (false, false)
            }
        },
        Err(_) => (false, false),
    }
}

/// Raises this process's open-file soft limit to its hard limit: a filesystem daemon holds
/// descriptors on behalf of every application using it. Returns the new limit.
pub fn raise_nofile_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into a live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit reads one rlimit from a live local.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(lim.rlim_cur)
}

/// Wraps a raw fd returned by a syscall we just made.
pub(crate) fn owned(fd: RawFd) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by a successful syscall and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_unescape() {
        assert_eq!(unescape_mountinfo("/a\\040b"), b"/a b".to_vec());
        assert_eq!(unescape_mountinfo("/plain"), b"/plain".to_vec());
        assert_eq!(unescape_mountinfo("/end\\04"), b"/end\\04".to_vec());
    }

    #[test]
    fn root_is_a_mount_point() {
        assert!(is_mount_point(Path::new("/")).unwrap());
        assert!(!is_mount_point(Path::new("/proc/self")).unwrap());
    }

    #[test]
    fn flags_always_nosuid_nodev() {
        let mut opts = MountOptions {
            fsname: "t".into(),
            allow_other: false,
            noatime: false,
            read_only: false,
            noexec: false,
            uid: 0,
            gid: 0,
        };
        assert_eq!(mount_flags(&opts), libc::MS_NOSUID | libc::MS_NODEV);
        opts.read_only = true;
        opts.noexec = true;
        opts.noatime = true;
        assert_eq!(
            mount_flags(&opts),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_RDONLY | libc::MS_NOEXEC | libc::MS_NOATIME
        );
    }

    #[test]
    fn missing_mountpoint_is_a_clear_error() {
        let opts = MountOptions {
            fsname: "t".into(),
            allow_other: false,
            noatime: false,
            read_only: false,
            noexec: false,
            uid: 0,
            gid: 0,
        };
        let err = Mount::new(Path::new("/nonexistent/etcfs-mnt"), &opts).unwrap_err();
        assert!(matches!(err, MountError::NoMountpoint(_)));
        assert!(err.to_string().contains("does not exist"), "{err}");
    }
}
