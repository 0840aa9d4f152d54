//! The embedded default: `etcfs mount MOUNTPOINT` with neither `--etcd` nor `--device` runs a
//! private single-member etcd and keeps a device image, both under a state directory, so a
//! first-time user has a working filesystem with one command.
//!
//! The private etcd is a child of the daemon, listening on loopback ports chosen at first
//! start and remembered in the state directory. Its pid is recorded, so a daemon that died
//! without stopping it finds and reuses it instead of starting a second one on the same data.
//!
//! It is private to root: loopback is open to every local user, and an etcd that answers
//! anyone lets any of them rewrite any inode's owner and mode or any extent. So at first start
//! a CA, a server certificate and a client certificate are made (in `etcd/pki`, mode 0700,
//! keys 0600), the CA's key is thrown away (nobody can make another certificate it trusts),
//! and etcd requires the client certificate on its client and peer ports. The state
//! directory's etcd data and device image are kept owner-only as well.

use std::{
    fs,
    io::Write as _,
    net::{IpAddr, Ipv4Addr, TcpListener},
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use meta::etcd::{EtcdBackend, EtcdConfig, EtcdTls};

/// How long a private etcd may take to become healthy.
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How much history the private etcd keeps before compacting it away. A cache watch that
/// resumes from a revision older than this finds it compacted and drops its caches (see
/// `fs::watch`); watches resume within seconds of a reconnect, so five minutes is ample, and
/// it bounds the database to the live keys plus five minutes of changes.
const AUTO_COMPACTION_RETENTION: &str = "5m";

/// Files of the embedded default.
#[derive(Debug, Clone)]
pub(crate) struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub(crate) fn new(root: &Path) -> Result<Self> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)
            .with_context(|| format!("create state dir {}", root.display()))?;
        Ok(StateDir {
            root: root.to_path_buf(),
        })
    }

    /// The device image, created sparse at `size` bytes if missing.
    pub(crate) fn device_image(&self, size: u64) -> Result<PathBuf> {
        let path = self.root.join("device.img");
        if path.exists() {
            // An image made before it was created owner-only: every file's data is in it.
            owner_only(&path, 0o600)?;
        } else {
            let f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
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

/// Sets `path`'s mode to `mode` if it allows more, saying so.
fn owner_only(path: &Path, mode: u32) -> Result<()> {
    let meta = fs::metadata(path).with_context(|| format!("stat {}", path.display()))?;
    let old = meta.permissions().mode() & 0o7777;
    if old & !mode != 0 {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .with_context(|| format!("chmod {:o} {}", mode, path.display()))?;
        log::info!("{}: mode {old:o} -> {mode:o} (owner only)", path.display());
    }
    Ok(())
}

/// The private etcd's certificates, as file paths (all in one owner-only directory).
#[derive(Debug, Clone)]
pub(crate) struct Pki {
    dir: PathBuf,
}

impl Pki {
    const FILES: [&'static str; 5] = [
        "ca.crt",
        "server.crt",
        "server.key",
        "client.crt",
        "client.key",
    ];

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The certificates under `etcd_dir`, made at first use. They are written to a fresh
    /// directory that is renamed into place, so a crash leaves either none or all of them.
    fn load_or_create(etcd_dir: &Path) -> Result<Pki> {
        let pki = Pki {
            dir: etcd_dir.join("pki"),
        };
        if pki.dir.exists() {
            owner_only(&pki.dir, 0o700)?;
            for f in Self::FILES {
                let p = pki.file(f);
                if !p.exists() {
                    bail!(
                        "{} is incomplete ({f} is missing); remove the directory to make new                          certificates",
                        pki.dir.display()
                    );
                }
                owner_only(&p, 0o600)?;
            }
            return Ok(pki);
        }
        let tmp = etcd_dir.join(format!("pki.tmp-{}", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&tmp)
            .with_context(|| format!("create {}", tmp.display()))?;
        let files = make_certificates().context("make the private etcd's certificates")?;
        for (name, pem) in Self::FILES.iter().zip(files) {
            let path = tmp.join(name);
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .with_context(|| format!("create {}", path.display()))?;
            f.write_all(pem.as_bytes())
                .and_then(|()| f.sync_all())
                .with_context(|| format!("write {}", path.display()))?;
        }
        fs::rename(&tmp, &pki.dir)
            .with_context(|| format!("rename {} to {}", tmp.display(), pki.dir.display()))?;
        log::info!(
            "made a CA and certificates for the private etcd in {}",
            pki.dir.display()
        );
        Ok(pki)
    }

    /// How the daemon reaches the private etcd at `endpoint`.
    fn client_config(&self, endpoint: &str) -> Result<EtcdConfig> {
        let read = |name: &str| {
            let p = self.file(name);
            fs::read(&p).with_context(|| format!("read {}", p.display()))
        };
        let mut cfg = EtcdConfig::new(vec![endpoint.to_owned()]);
        cfg.tls = Some(EtcdTls {
            ca_pem: read("ca.crt")?,
            identity: Some((read("client.crt")?, read("client.key")?)),
        });
        Ok(cfg)
    }
}

/// A CA, a server certificate for 127.0.0.1 (also used between peers, so it serves and
/// authenticates as a client) and a client certificate, as PEM in [`Pki::FILES`] order.
fn make_certificates() -> Result<[String; 5], rcgen::Error> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose as Eku, IsCa, KeyPair,
        KeyUsagePurpose as Ku, SanType,
    };
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "etcfs private etcd CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![Ku::KeyCertSign, Ku::CrlSign, Ku::DigitalSignature];
    let ca = ca.self_signed(&ca_key)?;

    let server_key = KeyPair::generate()?;
    let mut server = CertificateParams::new(vec!["localhost".to_owned()])?;
    server
        .subject_alt_names
        .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    server
        .distinguished_name
        .push(DnType::CommonName, "etcfs-embedded");
    server.key_usages = vec![Ku::DigitalSignature, Ku::KeyEncipherment];
    server.extended_key_usages = vec![Eku::ServerAuth, Eku::ClientAuth];
    let server = server.signed_by(&server_key, &ca, &ca_key)?;

    let client_key = KeyPair::generate()?;
    let mut client = CertificateParams::new(Vec::<String>::new())?;
    client
        .distinguished_name
        .push(DnType::CommonName, "etcfs-daemon");
    client.key_usages = vec![Ku::DigitalSignature];
    client.extended_key_usages = vec![Eku::ClientAuth];
    let client = client.signed_by(&client_key, &ca, &ca_key)?;
    Ok([
        ca.pem(),
        server.pem(),
        server_key.serialize_pem(),
        client.pem(),
        client_key.serialize_pem(),
    ])
}

/// A private etcd: stopped on drop if this process started it.
#[derive(Debug)]
pub(crate) struct PrivateEtcd {
    /// How to reach it (with the client certificate).
    pub(crate) config: EtcdConfig,
    child: Option<Child>,
}

impl PrivateEtcd {
    /// Starts (or finds still running) the state directory's etcd and waits until it answers.
    pub(crate) fn start(state: &StateDir) -> Result<PrivateEtcd> {
        let dir = state.etcd_dir();
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("create {}", dir.display()))?;
        owner_only(&dir, 0o700)?;
        let pki = Pki::load_or_create(&dir)?;
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
        let endpoint = format!("https://127.0.0.1:{client}");
        let config = pki.client_config(&endpoint)?;
        let rt = crate::status::runtime()?;
        let pid_file = dir.join("pid");
        if let Some(pid) = running_etcd(&pid_file, &dir) {
            match answers(&rt, &config) {
                Ok(()) => {
                    log::info!("reusing the private etcd (pid {pid}) at {endpoint}");
                    return Ok(PrivateEtcd {
                        config,
                        child: None,
                    });
                }
                // Another etcd on this data would wait for its lock for ever.
                Err(e) => bail!(
                    "the private etcd (pid {pid}, data in {}) is running but does not answer                      with its client certificate ({e}); stop it (kill {pid}) and mount again",
                    dir.display()
                ),
            }
        }
        let log_path = dir.join("etcd.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("open {}", log_path.display()))?;
        let peer_url = format!("https://127.0.0.1:{peer}");
        let (ca, cert, key) = (
            pki.file("ca.crt"),
            pki.file("server.crt"),
            pki.file("server.key"),
        );
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
            // Only a client with a certificate from this directory's CA gets in, on the
            // client port and on the peer port (raft messages could rewrite the data too).
            .arg("--client-cert-auth")
            .arg("--trusted-ca-file")
            .arg(&ca)
            .arg("--cert-file")
            .arg(&cert)
            .arg("--key-file")
            .arg(&key)
            .arg("--peer-client-cert-auth")
            .arg("--peer-trusted-ca-file")
            .arg(&ca)
            .arg("--peer-cert-file")
            .arg(&cert)
            .arg("--peer-key-file")
            .arg(&key)
            .arg("--auto-compaction-mode")
            .arg("periodic")
            .arg("--auto-compaction-retention")
            .arg(AUTO_COMPACTION_RETENTION)
            // etcd speaks sd_notify itself: its READY=1 is not the mount's.
            .env_remove("NOTIFY_SOCKET")
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
            config,
            child: Some(child),
        };
        let start = Instant::now();
        while let Err(why) = answers(&rt, &etcd.config) {
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
                    "the private etcd did not answer within {ETCD_READY_TIMEOUT:?} ({why}); \
                     see {}",
                    log_path.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        log::info!(
            "started a private etcd at {endpoint} (data in {}, client certificate required)",
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

/// Whether the etcd of `cfg` answers a read made with the client certificate.
fn answers(rt: &tokio::runtime::Runtime, cfg: &EtcdConfig) -> Result<()> {
    let mut cfg = cfg.clone();
    cfg.connect_timeout = Duration::from_secs(1);
    // The caller polls every 50 ms while etcd starts: each poll answers at once.
    cfg.probe_retry = false;
    rt.block_on(EtcdBackend::connect(&cfg))
        .map(drop)
        .map_err(|e| anyhow!("{e}"))
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
