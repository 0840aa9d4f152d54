//! The control socket of a mounted filesystem: `etcfs stats` asks the daemon serving a
//! mountpoint for its live report (or to reset its counters) over a Unix socket named
//! after the mountpoint.
//!
//! Only root and the user the daemon runs as may use it, checked twice: the socket is
//! mode 0600 from the moment it has its name (bound in a private directory, then renamed
//! into place), and each connection's peer credentials (SO_PEERCRED) are checked, so a
//! socket whose mode was loosened still answers no one else.

use std::{
    io::{BufRead, BufReader, Read, Write},
    os::unix::{
        fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _},
        net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{bail, Context, Result};

/// Directory of control sockets.
const RUN_DIR: &str = "/run/etcfs";

/// How a refusal starts, so the client can tell it from a report.
const REFUSED: &str = "refused: ";

/// The socket of the daemon serving `mountpoint` (canonical path).
pub(crate) fn socket_path(mountpoint: &Path) -> PathBuf {
    let mut name = String::new();
    for b in mountpoint.as_os_str().as_encoded_bytes() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'.' | b'_' | b'-' => name.push(*b as char),
            b'/' => name.push('+'),
            _ => name.push_str(&format!("%{b:02x}")),
        }
    }
    Path::new(RUN_DIR).join(format!("{name}.sock"))
}

/// What a client asks for: one line on the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ask {
    /// `text`: the report as a table (also anything unknown, as before there were others).
    Text,
    /// `json`: the report as one JSON object.
    Json,
    /// `prometheus`: the Prometheus text exposition.
    Prometheus,
    /// `reset`: later reports count from now.
    Reset,
}

impl Ask {
    fn line(self) -> &'static [u8] {
        match self {
            Ask::Text => b"text\n",
            Ask::Json => b"json\n",
            Ask::Prometheus => b"prometheus\n",
            Ask::Reset => b"reset\n",
        }
    }

    fn parse(line: &str) -> Ask {
        match line.trim() {
            "json" => Ask::Json,
            "prometheus" => Ask::Prometheus,
            "reset" => Ask::Reset,
            _ => Ask::Text,
        }
    }
}

/// The daemon's answer to a reset.
pub(crate) const RESET_DONE: &str = "reset\n";

/// Produces the answer to what a client asked for.
pub(crate) type ReportFn = dyn Fn(Ask) -> String + Send + Sync;

/// Serves stats requests until the process exits. Each request is one line (see [`Ask`]);
/// the answer follows, then the connection closes.
pub(crate) fn serve(mountpoint: &Path, report: Arc<ReportFn>) -> Result<Socket> {
    std::fs::create_dir_all(RUN_DIR).with_context(|| format!("create {RUN_DIR}"))?;
    let (listener, socket) = publish(&socket_path(mountpoint))?;
    let owner = own_uid();
    std::thread::Builder::new()
        .name("etcfs-control".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = answer(conn, owner, report.as_ref());
            }
        })
        .context("spawn control thread")?;
    Ok(socket)
}

/// Binds the socket at `path`, replacing whatever was there.
fn publish(path: &Path) -> Result<(UnixListener, Socket)> {
    let _names = NamesLock::take(path)?;
    // A socket left by a daemon that died is stale, and one whose daemon is still on its way
    // out after an external umount serves a mount that is gone: nobody else can be serving
    // this mountpoint, because mounting checked it was not a mount point.
    let _ = std::fs::remove_file(path);
    let (listener, id) = bind_owner_only(path)?;
    Ok((
        listener,
        Socket {
            path: path.to_owned(),
            id,
        },
    ))
}

/// The control socket a daemon serves, known by its inode: a daemon that stops removes
/// the socket only while the name is still its own. A new daemon mounted at the same
/// mountpoint as soon as the old one was unmounted has replaced it by then, and removing
/// that one by name left `etcfs stats` unable to reach the new daemon (found restarting a
/// mount in a benchmark loop).
pub(crate) struct Socket {
    path: PathBuf,
    id: (u64, u64),
}

impl Socket {
    /// Removes the socket if nobody replaced it. The check and the removal happen under
    /// [`NamesLock`]: between the two, a new daemon's socket renamed into place used to be
    /// removed in its stead, and the new daemon, finding no socket by its name, exited
    /// (found by the remount test on CI).
    pub(crate) fn remove(self) {
        let Ok(_names) = NamesLock::take(&self.path) else {
            // Without the lock, leaving a stale socket is safe (the next daemon at this
            // mountpoint removes it) and removing a live one is not.
            return;
        };
        if socket_id(&self.path).ok() == Some(self.id) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// An exclusive lock on the names in the directory of sockets (a flock of the directory),
/// held by a daemon while it replaces or removes its socket, so another daemon at the same
/// mountpoint never acts between one daemon's check of a name and its use of it. Both
/// holders are brief, and the lock goes with the process.
struct NamesLock(#[allow(dead_code)] std::fs::File);

impl NamesLock {
    /// Locks the directory holding the socket `path`.
    fn take(path: &Path) -> Result<NamesLock> {
        let dir = socket_dir(path);
        let file = std::fs::File::open(dir).with_context(|| format!("open {}", dir.display()))?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
            .with_context(|| format!("lock {}", dir.display()))?;
        Ok(NamesLock(file))
    }
}

/// The directory holding the socket `path` ([`RUN_DIR`], but for tests).
fn socket_dir(path: &Path) -> &Path {
    path.parent().unwrap_or(Path::new(RUN_DIR))
}

fn socket_id(path: &Path) -> std::io::Result<(u64, u64)> {
    std::fs::symlink_metadata(path).map(|m| (m.dev(), m.ino()))
}

/// A listening socket at `path` that is mode 0600 before anyone can reach it by that name:
/// bound inside a fresh mode-0700 directory (bind would give it 0777 less the umask),
/// chmodded, then renamed to `path`. Also its identity, taken before the rename, where no
/// one else can replace it.
fn bind_owner_only(path: &Path) -> Result<(UnixListener, (u64, u64))> {
    let dir = socket_dir(path).join(format!(".bind-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .with_context(|| format!("create {}", dir.display()))?;
    let tmp = dir.join("s");
    let result = (|| {
        let listener =
            UnixListener::bind(&tmp).with_context(|| format!("bind {}", tmp.display()))?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("chmod {}", tmp.display()))?;
        let id = socket_id(&tmp).with_context(|| format!("stat {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("rename {} to {}", tmp.display(), path.display()))?;
        Ok((listener, id))
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The uid this process runs as (the owner of /proc/self).
fn own_uid() -> u32 {
    std::fs::metadata("/proc/self").map_or(0, |m| m.uid())
}

/// Whether a peer of uid `peer` may use the socket of a daemon running as `owner`.
fn allowed(peer: u32, owner: u32) -> bool {
    peer == 0 || peer == owner
}

fn answer(conn: UnixStream, owner: u32, report: &ReportFn) -> std::io::Result<()> {
    let peer = rustix::net::sockopt::socket_peercred(&conn)?.uid.as_raw();
    // The request is read even from a refused peer: closing with it unread would reset the
    // connection, and the peer would see that instead of the refusal.
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    BufReader::new(conn.try_clone()?)
        .take(64)
        .read_line(&mut line)?;
    if !allowed(peer, owner) {
        let who = if owner == 0 {
            "root".to_owned()
        } else {
            format!("root and uid {owner}, who mounted it")
        };
        return (&conn).write_all(
            format!("{REFUSED}uid {peer} may not use this control socket (only {who})\n")
                .as_bytes(),
        );
    }
    (&conn).write_all(report(Ask::parse(&line)).as_bytes())
}

/// Asks the daemon serving `mountpoint` for `ask`: its canonical path and the answer.
pub(crate) fn ask(mountpoint: &Path, ask: Ask) -> Result<(PathBuf, String)> {
    let canonical = std::fs::canonicalize(mountpoint)
        .with_context(|| format!("mountpoint {}", mountpoint.display()))?;
    let path = socket_path(&canonical);
    let mut conn = match UnixStream::connect(&path) {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => bail!(
            "permission denied: only root and the user who mounted {} may ask its daemon for \
             statistics (control socket {})",
            canonical.display(),
            path.display()
        ),
        Err(e) => bail!(
            "{} is not an etcfs mount: no etcfs daemon serves it (control socket {}: {e})",
            canonical.display(),
            path.display()
        ),
    };
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    conn.write_all(ask.line())?;
    let mut out = String::new();
    conn.read_to_string(&mut out)
        .context("read the daemon's report")?;
    if let Some(why) = out.strip_prefix(REFUSED) {
        bail!(
            "the etcfs daemon serving {} refused: {}",
            canonical.display(),
            why.trim_end()
        );
    }
    if ask == Ask::Reset && out != RESET_DONE {
        bail!(
            "the etcfs daemon serving {} does not know resets (an older version?): it \
             answered {:?}",
            canonical.display(),
            out.lines().next().unwrap_or("")
        );
    }
    Ok((canonical, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopping_daemon_leaves_its_successors_socket() {
        if own_uid() != 0 {
            eprintln!("skipped: /run/etcfs needs root");
            return;
        }
        let mnt = PathBuf::from(format!(
            "/nonexistent/etcfs-control-test-{}",
            std::process::id()
        ));
        let report: Arc<ReportFn> = Arc::new(|_| String::new());
        let old = serve(&mnt, report.clone()).unwrap();
        // A new daemon at the same mountpoint binds before the old one has stopped.
        let new = serve(&mnt, report).unwrap();
        old.remove();
        let path = socket_path(&mnt);
        assert!(path.exists(), "the old daemon removed the new one's socket");
        new.remove();
        assert!(!path.exists());
    }

    /// A daemon leaving after an external umount removes its socket while its successor
    /// at the same mountpoint publishes one: the successor's socket is there afterwards,
    /// every time. Between the leaving daemon's check of the name and its removal, the
    /// successor's rename used to land now and then (a remount test failed on CI). The race
    /// needs the leaving daemon preempted in that window, so without the lock this test
    /// catches it in about one run of three here, not every run.
    #[test]
    fn a_leaving_daemon_racing_its_successor_never_removes_its_socket() {
        const ROUNDS: usize = 2000;
        let dir = std::env::temp_dir().join(format!("etcfs-control-race-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join("m.sock");
        let mut lost = 0;
        let start = Arc::new(std::sync::Barrier::new(2));
        for _ in 0..ROUNDS {
            let (_old_listener, old) = publish(&path).unwrap();
            let start_old = start.clone();
            let leaving = std::thread::spawn(move || {
                start_old.wait();
                old.remove()
            });
            start.wait();
            let (_new_listener, new) = publish(&path).unwrap();
            leaving.join().unwrap();
            if socket_id(&path).ok() != Some(new.id) {
                lost += 1;
            }
            new.remove();
        }
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            lost, 0,
            "the successor's socket was removed {lost} times of {ROUNDS}"
        );
    }

    #[test]
    fn only_root_and_the_owner_are_allowed() {
        assert!(allowed(0, 1000));
        assert!(allowed(1000, 1000));
        assert!(!allowed(65534, 1000));
        assert!(allowed(0, 0));
        assert!(!allowed(1000, 0));
    }

    #[test]
    fn asks_travel_as_their_line() {
        for ask in [Ask::Text, Ask::Json, Ask::Prometheus, Ask::Reset] {
            let line = std::str::from_utf8(ask.line()).unwrap();
            assert_eq!(Ask::parse(line), ask);
        }
        assert_eq!(Ask::parse("what\n"), Ask::Text, "as old daemons answered");
    }

    #[test]
    fn socket_names_are_unambiguous_and_flat() {
        let a = socket_path(Path::new("/mnt/a b"));
        let b = socket_path(Path::new("/mnt/a+b"));
        assert_ne!(a, b);
        assert_eq!(a.parent(), Some(Path::new(RUN_DIR)));
        assert_eq!(
            socket_path(Path::new("/mnt/x")),
            Path::new("/run/etcfs/+mnt+x.sock")
        );
    }
}
