//! The control socket of a mounted filesystem: `etcfs stats` asks the daemon serving a
//! mountpoint for its live report over a Unix socket named after the mountpoint.

use std::{
    io::{BufRead, BufReader, Read, Write},
    os::unix::net::{UnixListener, UnixStream},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{bail, Context, Result};

/// Directory of control sockets.
const RUN_DIR: &str = "/run/etcfs";

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

/// Produces the report a client asked for.
pub(crate) type ReportFn = dyn Fn(bool) -> String + Send + Sync;

/// Serves stats requests until the process exits. Each request is one line, `text` or
/// `json`; the answer is the report, then the connection closes.
pub(crate) fn serve(mountpoint: &Path, report: Arc<ReportFn>) -> Result<PathBuf> {
    std::fs::create_dir_all(RUN_DIR).with_context(|| format!("create {RUN_DIR}"))?;
    let path = socket_path(mountpoint);
    // A socket left by a daemon that died is stale: nobody can be serving this mountpoint,
    // because mounting checked that it was not a mount point.
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).with_context(|| format!("bind {}", path.display()))?;
    std::thread::Builder::new()
        .name("etcfs-control".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = answer(conn, report.as_ref());
            }
        })
        .context("spawn control thread")?;
    Ok(path)
}

fn answer(conn: UnixStream, report: &ReportFn) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    BufReader::new(conn.try_clone()?)
        .take(64)
        .read_line(&mut line)?;
    let json = line.trim() == "json";
    (&conn).write_all(report(json).as_bytes())
}

/// `etcfs stats MOUNTPOINT [--json]`.
pub(crate) fn print_stats(mountpoint: &Path, json: bool) -> Result<()> {
    let canonical = std::fs::canonicalize(mountpoint)
        .with_context(|| format!("mountpoint {}", mountpoint.display()))?;
    let path = socket_path(&canonical);
    let mut conn = match UnixStream::connect(&path) {
        Ok(c) => c,
        Err(e) => bail!(
            "no etcfs daemon is serving {} (control socket {}: {e})",
            canonical.display(),
            path.display()
        ),
    };
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    conn.write_all(if json { b"json\n" } else { b"text\n" })?;
    let mut out = String::new();
    conn.read_to_string(&mut out)
        .context("read the daemon's report")?;
    print!("{out}");
    if !out.ends_with('\n') {
        println!();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
