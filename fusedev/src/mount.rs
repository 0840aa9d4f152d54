//! mount(2) and umount(2) of a FUSE filesystem as root, without fusermount.

use std::{
    ffi::CString,
    fs, io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
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
}

/// A mounted FUSE connection: the `/dev/fuse` descriptor the kernel talks on and the place
/// it is mounted. Dropping it unmounts.
#[derive(Debug)]
pub struct Mount {
    dev: OwnedFd,
    mountpoint: PathBuf,
    mounted: AtomicBool,
}

impl Mount {
    /// Mounts a new FUSE connection on `mountpoint` (which must be an existing directory that
    /// is not already a mount point). Requires root (CAP_SYS_ADMIN).
    pub fn new(mountpoint: &Path, opts: &MountOptions) -> Result<Mount, MountError> {
        let meta = fs::metadata(mountpoint).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => MountError::NoMountpoint(mountpoint.to_path_buf()),
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
                libc::MS_NOSUID | libc::MS_NODEV,
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
        Ok(Mount {
            dev,
            mountpoint: path,
            mounted: AtomicBool::new(true),
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

    /// Unmounts. When files are still open the unmount is lazy (detached now, released when
    /// the last user closes), so a shutdown never waits on an application. Idempotent.
    pub fn unmount(&self) -> io::Result<()> {
        if !self.mounted.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        let target = cstring(self.mountpoint.as_os_str().as_bytes());
        // SAFETY: target is a NUL-terminated path that outlives the call.
        let mut rc = unsafe { libc::umount2(target.as_ptr(), 0) };
        if rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EBUSY) {
            // SAFETY: as above.
            rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        }
        if rc != 0 {
            let err = io::Error::last_os_error();
            // Already gone (someone ran umount): nothing left to do.
            if matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOENT)) {
                return Ok(());
            }
            return Err(err);
        }
        Ok(())
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
    fn missing_mountpoint_is_a_clear_error() {
        let opts = MountOptions {
            fsname: "t".into(),
            allow_other: false,
            uid: 0,
            gid: 0,
        };
        let err = Mount::new(Path::new("/nonexistent/etcfs-mnt"), &opts).unwrap_err();
        assert!(matches!(err, MountError::NoMountpoint(_)));
        assert!(err.to_string().contains("does not exist"), "{err}");
    }
}
