//! The embedded default: `etcfs mount MOUNTPOINT` with neither `--etcd` nor `--device` runs a
//! private single-member etcd and keeps a device image, both under a state directory, so a
//! first-time user has a working filesystem with one command.
//!
//! The private etcd is a child of the daemon, listening on loopback ports chosen at first
//! start and remembered in the state directory. Its pid is recorded, so a daemon that died
//! without stopping it finds and reuses it instead of starting a second one on the same data.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::{Ipv4Addr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

/// How long a private etcd may take to become healthy.
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Files of the embedded default.
#[derive(Debug, Clone)]
pub(crate) struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub(crate) fn new(root: &Path) -> Result<Self> {
        fs::create_dir_all(root).with_context(|| format!("create state dir {}", root.display()))?;
        Ok(StateDir {
            root: root.to_path_buf(),
        })
    }

    /// The device image, created sparse at `size` bytes if missing.
    pub(crate) fn device_image(&self, size: u64) -> Result<PathBuf> {
        let path = self.root.join("device.img");
        if !path.exists() {
            let f = fs::File::create(&path)
                .with_context(|| format!("create device image {}", path.display()))?;
            f.set_len(size)
                .with_context(|| format!("size device image {}", path.display()))?;
            log::info!(
                "created a {} GiB sparse device image at {}",
                size >> 30,
                path.display()
            );
        }
        Ok(path)
    }

    /// Whether `mark_formatted` ran: the image and the private etcd hold a filesystem.
    pub(crate) fn is_formatted(&self) -> bool {
        self.root.join("formatted").exists()
    }

    /// Records that the embedded filesystem has been formatted.
    pub(crate) fn mark_formatted(&self) -> Result<()> {
        let path = self.root.join("formatted");
        fs::write(&path, b"").with_context(|| format!("write {}", path.display()))
    }

    fn etcd_dir(&self) -> PathBuf {
        self.root.join("etcd")
    }
}

/// A private etcd: stopped on drop if this process started it.
#[derive(Debug)]
pub(crate) struct PrivateEtcd {
    pub(crate) endpoint: String,
    child: Option<Child>,
}

impl PrivateEtcd {
    /// Starts (or finds still running) the state directory's etcd and waits until it answers.
    pub(crate) fn start(state: &StateDir) -> Result<PrivateEtcd> {
        let dir = state.etcd_dir();
        fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let ports_file = dir.join("ports");
        let (client, peer) = match fs::read_to_string(&ports_file) {
            Ok(s) => {
                parse_ports(&s).with_context(|| format!("corrupt {}", ports_file.display()))?
            }
            Err(_) => {
                let ports = (free_port()?, free_port()?);
                fs::write(&ports_file, format!("{} {}\n", ports.0, ports.1))
                    .with_context(|| format!("write {}", ports_file.display()))?;
                ports
            }
        };
        let endpoint = format!("http://127.0.0.1:{client}");
        let pid_file = dir.join("pid");
        if let Some(pid) = running_etcd(&pid_file, &dir) {
            if healthy(client) {
                log::info!("reusing the private etcd (pid {pid}) at {endpoint}");
                return Ok(PrivateEtcd {
                    endpoint,
                    child: None,
                });
            }
        }
        let log_path = dir.join("etcd.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("open {}", log_path.display()))?;
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .arg("--name")
            .arg("etcfs-embedded")
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--listen-client-urls")
            .arg(&endpoint)
            .arg("--advertise-client-urls")
            .arg(&endpoint)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(format!("etcfs-embedded={peer_url}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => anyhow::anyhow!(
                    "the embedded default needs etcd on PATH (apt-get install etcd-server), \
                     or give --etcd and --device"
                ),
                _ => anyhow::Error::new(e).context("start the private etcd"),
            })?;
        fs::write(&pid_file, format!("{}\n", child.id()))
            .with_context(|| format!("write {}", pid_file.display()))?;
        let mut etcd = PrivateEtcd {
            endpoint,
            child: Some(child),
        };
        let start = Instant::now();
        while !healthy(client) {
            if let Some(child) = etcd.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!(
                        "the private etcd exited ({status}); see {}",
                        log_path.display()
                    );
                }
            }
            if start.elapsed() > ETCD_READY_TIMEOUT {
                bail!(
                    "the private etcd did not answer within {ETCD_READY_TIMEOUT:?}; see {}",
                    log_path.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        log::info!(
            "started a private etcd at {} (data in {})",
            etcd.endpoint,
            dir.display()
        );
        Ok(etcd)
    }
}

impl Drop for PrivateEtcd {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGTERM lets etcd close its database cleanly; it gets a few seconds.
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn parse_ports(s: &str) -> Result<(u16, u16)> {
    let mut it = s.split_whitespace().map(str::parse::<u16>);
    match (it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b))) => Ok((a, b)),
        _ => bail!("expected two port numbers, got {s:?}"),
    }
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("find a free loopback port")?;
    Ok(l.local_addr()?.port())
}

/// The pid in `pid_file` if that process is an etcd using `dir`.
fn running_etcd(pid_file: &Path, dir: &Path) -> Option<u32> {
    let pid: u32 = fs::read_to_string(pid_file).ok()?.trim().parse().ok()?;
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let cmdline = String::from_utf8_lossy(&cmdline);
    let ours = cmdline.contains("etcd") && cmdline.contains(&*dir.to_string_lossy());
    ours.then_some(pid)
}

/// etcd answers `/health` with `"health":"true"` when it can serve requests.
fn healthy(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(
        &(Ipv4Addr::LOCALHOST, port).into(),
        Duration::from_millis(200),
    ) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_file_round_trip_and_corruption() {
        assert_eq!(parse_ports("2379 2380\n").unwrap(), (2379, 2380));
        assert!(parse_ports("x").is_err());
        assert!(parse_ports("1").is_err());
    }

    #[test]
    fn image_is_sparse_and_kept() {
        let dir = std::env::temp_dir().join(format!("etcfs-state-{}", std::process::id()));
        let state = StateDir::new(&dir).unwrap();
        let img = state.device_image(1 << 30).unwrap();
        assert_eq!(fs::metadata(&img).unwrap().len(), 1 << 30);
        // A second call keeps the existing image (and its data) as it is.
        fs::write(&img, b"x").unwrap();
        assert_eq!(state.device_image(1 << 30).unwrap(), img);
        assert_eq!(fs::metadata(&img).unwrap().len(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
