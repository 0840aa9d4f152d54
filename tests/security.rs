//! Security of the control plane, on real etcd processes this test starts: an etcd that
//! requires TLS client certificates, an etcd with user/password authentication (and short
//! token lifetimes, restarted under a mount), the embedded etcd's client-certificate wall,
//! and the owner-only control socket.
//!
//! Needs root, /dev/fuse, and `etcd`/`etcdctl` on PATH (scripts/deps.sh installs them);
//! skipped loudly otherwise (a failure with ETCFS_REQUIRE_MOUNT_TESTS=1).

mod common;

use std::{
    fs,
    net::{IpAddr, Ipv4Addr, TcpListener},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use common::*;

/// How long a refused or unreachable etcd may take to be reported.
const ERROR_DEADLINE: Duration = Duration::from_secs(10);

/// Two distinct free loopback ports (both held while chosen, so they differ).
fn free_ports() -> (u16, u16) {
    let a = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free port");
    let b = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free port");
    let port = |l: &TcpListener| l.local_addr().expect("local addr").port();
    (port(&a), port(&b))
}

/// Whether the tests here can run; skips loudly otherwise.
fn can_run_here(test: &str) -> bool {
    if !can_run(test, None) {
        return false;
    }
    for tool in ["etcd", "etcdctl"] {
        if Command::new(tool).arg("--version").output().is_err() {
            return skip(test, &format!("needs {tool} on PATH (scripts/deps.sh)"));
        }
    }
    true
}

// ---------------------------------------------------------------------------------------
// Certificates
// ---------------------------------------------------------------------------------------

/// A CA and what it signed, written as PEM files into a directory.
struct Certs {
    dir: PathBuf,
}

impl Certs {
    /// A CA `name`, a server certificate for 127.0.0.1 and a client certificate.
    fn make(dir: &Path, name: &str) -> Certs {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose as Eku, IsCa,
            KeyPair, KeyUsagePurpose as Ku, SanType,
        };
        let dir = dir.join(name);
        fs::create_dir_all(&dir).expect("create cert dir");
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.distinguished_name
            .push(DnType::CommonName, format!("{name} CA"));
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![Ku::KeyCertSign, Ku::CrlSign, Ku::DigitalSignature];
        let ca = ca.self_signed(&ca_key).unwrap();
        let leaf = |cn: &str, server: bool| {
            let key = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(if server {
                vec!["localhost".to_owned()]
            } else {
                Vec::new()
            })
            .unwrap();
            if server {
                p.subject_alt_names
                    .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
            }
            p.distinguished_name.push(DnType::CommonName, cn);
            p.extended_key_usages = vec![Eku::ServerAuth, Eku::ClientAuth];
            let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (server, server_key) = leaf("etcd-test-server", true);
        let (client, client_key) = leaf("etcfs-test-client", false);
        for (f, pem) in [
            ("ca.crt", ca.pem()),
            ("server.crt", server),
            ("server.key", server_key),
            ("client.crt", client),
            ("client.key", client_key),
        ] {
            fs::write(dir.join(f), pem).expect("write pem");
        }
        Certs { dir }
    }

    fn path(&self, f: &str) -> String {
        self.dir.join(f).to_string_lossy().into_owned()
    }

    /// etcfs's options for TLS with this CA, with or without the client certificate.
    fn etcfs_args(&self, client_cert: bool) -> Vec<String> {
        let mut a = vec!["--etcd-cacert".to_owned(), self.path("ca.crt")];
        if client_cert {
            a.extend([
                "--etcd-cert".to_owned(),
                self.path("client.crt"),
                "--etcd-key".to_owned(),
                self.path("client.key"),
            ]);
        }
        a
    }
}

// ---------------------------------------------------------------------------------------
// A test etcd
// ---------------------------------------------------------------------------------------

/// An etcd this test started, stopped (by its pid) and its data removed on drop.
struct TestEtcd {
    child: Option<Child>,
    dir: PathBuf,
    port: u16,
    peer: u16,
    scheme: &'static str,
    extra: Vec<String>,
}

impl TestEtcd {
    fn start(dir: &Path, scheme: &'static str, extra: &[String]) -> TestEtcd {
        let (port, peer) = free_ports();
        let mut e = TestEtcd {
            child: None,
            dir: dir.join("etcd"),
            port,
            peer,
            scheme,
            extra: extra.to_vec(),
        };
        e.spawn();
        e
    }

    fn endpoint(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.port)
    }

    fn spawn(&mut self) {
        fs::create_dir_all(&self.dir).expect("create etcd dir");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("log"))
            .expect("etcd log");
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let child = Command::new("etcd")
            .args(["--name", "sec", "--data-dir"])
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &self.endpoint()])
            .args(["--advertise-client-urls", &self.endpoint()])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("sec={peer}")])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        let start = Instant::now();
        // The client port accepts connections once etcd serves; readiness is checked by
        // the callers with etcdctl (they know the credentials).
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "etcd did not listen within 20 s:\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(&mut c, "TERM");
            if wait_bounded(&mut c, Duration::from_secs(10)).is_none() {
                let _ = c.kill();
                let _ = wait_bounded(&mut c, Duration::from_secs(5));
            }
        }
    }

    /// Stops and starts it on the same data (every simple auth token is forgotten).
    fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for TestEtcd {
    fn drop(&mut self) {
        if thread::panicking() {
            loud(&format!("--- test etcd log ---\n{}", self.log()));
        }
        self.stop();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// `etcdctl ARGS` against `endpoint` with `auth` (extra etcdctl options), bounded.
fn etcdctl(endpoint: &str, auth: &[String], args: &[&str]) -> (bool, String) {
    let (out, in_time) = run_bounded(
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", endpoint, "--dial-timeout", "3s"])
            .args(auth)
            .args(args),
        Duration::from_secs(20),
    );
    assert!(in_time, "etcdctl {args:?} hung");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Runs until etcdctl `args` succeeds (etcd may still be electing itself).
fn until_etcdctl_ok(endpoint: &str, auth: &[String], args: &[&str]) {
    let start = Instant::now();
    loop {
        let (ok, text) = etcdctl(endpoint, auth, args);
        if ok {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "etcdctl {args:?} kept failing: {text}"
        );
        thread::sleep(Duration::from_millis(200));
    }
}

/// An etcd with `extra` options and auth enabled: users root and `etcfs` (read-write on
/// `sec/` only), both with `password`.
fn auth_enabled_etcd(s: &Scratch, extra: &[String], password: &str) -> TestEtcd {
    let etcd = TestEtcd::start(&s.base, "http", extra);
    let ep = etcd.endpoint();
    until_etcdctl_ok(&ep, &[], &["endpoint", "health"]);
    // root, and a user `etcfs` whose role covers only the prefix `sec/`.
    for args in [
        vec!["user", "add", "root", "--new-user-password", password],
        vec!["role", "add", "etcfs-sec"],
        vec![
            "role",
            "grant-permission",
            "etcfs-sec",
            "readwrite",
            "sec/",
            "--prefix=true",
        ],
        vec!["user", "add", "etcfs", "--new-user-password", password],
        vec!["user", "grant-role", "etcfs", "etcfs-sec"],
        vec!["auth", "enable"],
    ] {
        let (ok, text) = etcdctl(&ep, &[], &args);
        assert!(ok, "etcdctl {args:?}: {text}");
    }
    etcd
}

/// `etcfs ARGS` with `env`, bounded by [`ERROR_DEADLINE`]: (success, output, elapsed).
fn etcfs(args: &[String], env: &[(&str, &str)]) -> (bool, String, Duration) {
    let start = Instant::now();
    let mut cmd = Command::new(ETCFS);
    cmd.args(args).env_remove("ETCFS_ETCD_PASSWORD");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let (out, in_time) = run_bounded(&mut cmd, ERROR_DEADLINE + Duration::from_secs(10));
    let elapsed = start.elapsed();
    assert!(in_time, "etcfs {args:?} hung");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text, elapsed)
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// A device image for one test (removed on drop with its directory).
struct Scratch {
    base: PathBuf,
    image: PathBuf,
}

impl Scratch {
    fn new(test: &str) -> Scratch {
        let base = temp_base(test);
        let image = PathBuf::from(format!(
            "/var/tmp/etcfs-test-{}-{}.img",
            std::process::id(),
            next_id()
        ));
        fs::File::create(&image)
            .and_then(|f| f.set_len(DEFAULT_IMAGE_BYTES))
            .expect("create device image");
        fs::create_dir(base.join("mnt")).expect("create mountpoint");
        Scratch { base, image }
    }

    fn mnt(&self) -> PathBuf {
        self.base.join("mnt")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        umount_all(&self.mnt());
        let _ = fs::remove_file(&self.image);
        if !is_mounted(&self.mnt()) {
            let _ = fs::remove_dir_all(&self.base);
        }
    }
}

/// mkfs, mount, write and read back a file, `etcfs status`, `etcfs stats`, unmount: the
/// whole path through etcd with `access` (the --etcd-* options) and `env`.
fn round_trip(s: &Scratch, endpoint: &str, access: &[String], env: &[(&str, &str)]) {
    let store = |cmd: &str| {
        let mut a = strings(&[cmd, "--etcd", endpoint, "--prefix", "sec"]);
        a.extend(access.iter().cloned());
        a
    };
    let mut mkfs = store("mkfs");
    mkfs.extend(["--device".into(), s.image.to_string_lossy().into_owned()]);
    let (ok, text, _) = etcfs(&mkfs, env);
    assert!(ok, "mkfs: {text}");

    let mut mount = strings(&[
        "--etcd",
        endpoint,
        "--prefix",
        "sec",
        "--device",
        &s.image.to_string_lossy(),
    ]);
    mount.extend(access.iter().cloned());
    let d = Daemon::spawn(&mount, &s.mnt(), &s.base.join("daemon.log"), "auto");
    fs::write(d.path("hello"), b"through etcd with credentials\n").expect("write");
    assert_eq!(
        fs::read(d.path("hello")).expect("read"),
        b"through etcd with credentials\n"
    );
    let (ok, text, _) = etcfs(&store("status"), env);
    assert!(ok && text.contains("nodes (1)"), "status: {text}");
    let stats = d.stats_json();
    assert!(stats.is_object(), "stats: {stats}");
    d.stop();
}

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

/// An etcd that requires client certificates: everything works with --etcd-cacert,
/// --etcd-cert and --etcd-key; without the client certificate, or trusting another CA, the
/// commands fail within seconds and say why.
#[test]
fn tls_client_certificates() {
    if !can_run_here("tls_client_certificates") {
        return;
    }
    let s = Scratch::new("tls");
    let certs = Certs::make(&s.base, "good");
    let rogue = Certs::make(&s.base, "rogue");
    let etcd = TestEtcd::start(
        &s.base,
        "https",
        &strings(&[
            "--client-cert-auth",
            "--trusted-ca-file",
            &certs.path("ca.crt"),
            "--cert-file",
            &certs.path("server.crt"),
            "--key-file",
            &certs.path("server.key"),
        ]),
    );
    let ctl_tls = strings(&[
        "--cacert",
        &certs.path("ca.crt"),
        "--cert",
        &certs.path("client.crt"),
        "--key",
        &certs.path("client.key"),
    ]);
    until_etcdctl_ok(&etcd.endpoint(), &ctl_tls, &["endpoint", "health"]);
    round_trip(&s, &etcd.endpoint(), &certs.etcfs_args(true), &[]);

    let status = |access: Vec<String>| {
        let mut a = strings(&["status", "--etcd", &etcd.endpoint(), "--prefix", "sec"]);
        a.extend(access);
        etcfs(&a, &[])
    };
    let (ok, text, t) = status(certs.etcfs_args(false));
    assert!(!ok && t < ERROR_DEADLINE, "no client cert ({t:?}): {text}");
    assert!(
        text.contains("--etcd-cert") || text.contains("certificate"),
        "the refusal names the client certificate: {text}"
    );
    let mut wrong_ca = rogue.etcfs_args(false);
    wrong_ca.extend(certs.etcfs_args(true).into_iter().skip(2));
    let (ok, text, t) = status(wrong_ca);
    assert!(!ok && t < ERROR_DEADLINE, "rogue CA ({t:?}): {text}");
    assert!(text.contains("TLS handshake failed"), "{text}");
    let (ok, text, t) = status(rogue.etcfs_args(true));
    assert!(
        !ok && t < ERROR_DEADLINE,
        "rogue client cert ({t:?}): {text}"
    );
    let (ok, text, _) = status(Vec::new());
    assert!(!ok && text.contains("need --etcd-cacert"), "{text}");
    let mut no_key = certs.etcfs_args(false);
    no_key.extend(["--etcd-cert".into(), certs.path("client.crt")]);
    let (ok, text, _) = status(no_key);
    assert!(
        !ok && text.contains("--etcd-key"),
        "cert without key: {text}"
    );
    let (ok, text, _) = status(strings(&["--etcd-cacert", "/nonexistent/ca.crt"]));
    assert!(
        !ok && text.contains("cannot read --etcd-cacert /nonexistent/ca.crt"),
        "{text}"
    );
    // The etcd really asks for the certificate (so the successes above used it).
    let (ok, text) = etcdctl(
        &etcd.endpoint(),
        &strings(&["--cacert", &certs.path("ca.crt")]),
        &["get", "x"],
    );
    assert!(!ok, "etcdctl without a client certificate got in: {text}");
}

/// An etcd with `auth enable`: the user's password from a file or ETCFS_ETCD_PASSWORD works
/// and never shows in the process list, a log or an error; a wrong one is refused within
/// seconds with etcd's reason; and a mount keeps working after its token expired (2 s
/// token TTL, idle) and after an etcd restart (which forgets every token).
#[test]
fn password_authentication() {
    if !can_run_here("password_authentication") {
        return;
    }
    const PASSWORD: &str = "pw-7f3e9a-never-shown";
    let s = Scratch::new("auth");
    let mut etcd = auth_enabled_etcd(
        &s,
        &strings(&["--auth-token", "simple", "--auth-token-ttl", "2"]),
        PASSWORD,
    );
    let ep = etcd.endpoint();
    let pw_file = s.base.join("password");
    fs::write(&pw_file, format!("{PASSWORD}\n")).unwrap();
    fs::set_permissions(&pw_file, fs::Permissions::from_mode(0o600)).unwrap();
    let pw_arg = pw_file.to_string_lossy().into_owned();
    let by_file = strings(&["--etcd-user", "etcfs", "--etcd-password-file", &pw_arg]);

    // mkfs and status read the password from the environment, the mount from the file.
    let store = |cmd: &str, access: &[String]| {
        let mut a = strings(&[cmd, "--etcd", &ep, "--prefix", "sec"]);
        a.extend(access.iter().cloned());
        a
    };
    let mut mkfs = store("mkfs", &strings(&["--etcd-user", "etcfs"]));
    mkfs.extend(["--device".into(), s.image.to_string_lossy().into_owned()]);
    let (ok, text, _) = etcfs(&mkfs, &[("ETCFS_ETCD_PASSWORD", PASSWORD)]);
    assert!(ok, "mkfs: {text}");
    let mut mount = strings(&["--etcd", &ep, "--prefix", "sec", "--device"]);
    mount.push(s.image.to_string_lossy().into_owned());
    mount.extend(by_file.iter().cloned());
    let mut d = Daemon::spawn(&mount, &s.mnt(), &s.base.join("daemon.log"), "auto");
    fs::write(d.path("a"), b"one").expect("write");
    let cmdline = fs::read(format!("/proc/{}/cmdline", d.pid())).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(PASSWORD),
        "the password is in the daemon's command line"
    );
    let (ok, text, _) = etcfs(
        &store("status", &strings(&["--etcd-user", "etcfs"])),
        &[("ETCFS_ETCD_PASSWORD", PASSWORD)],
    );
    assert!(ok && text.contains("nodes (1)"), "status: {text}");

    // Idle past the token's TTL (the daemon's own background reads may keep it alive; the
    // JWT test below has tokens that expire regardless).
    thread::sleep(Duration::from_secs(5));
    fs::write(d.path("b"), b"two").expect("write after the token expired");
    assert_eq!(fs::read(d.path("a")).unwrap(), b"one");
    // A restarted etcd knows no token at all.
    etcd.restart();
    until_etcdctl_ok(
        &ep,
        &strings(&["--user", &format!("root:{PASSWORD}")]),
        &["endpoint", "health"],
    );
    let start = Instant::now();
    let wrote = loop {
        match fs::write(d.path("c"), b"three") {
            Ok(()) => break true,
            Err(_) if start.elapsed() < Duration::from_secs(20) => {
                thread::sleep(Duration::from_millis(200))
            }
            Err(_) => break false,
        }
    };
    assert!(wrote, "no write succeeded within 20 s of the etcd restart");
    assert_eq!(fs::read(d.path("c")).unwrap(), b"three");
    assert!(
        d.log_text().contains("logged in again"),
        "the daemon never logged in again:\n{}",
        d.log_text()
    );
    d.signal("TERM");
    d.expect_exit("SIGTERM");

    // Refusals: clear, quick, and without the password.
    // (--etcd-* options, environment, what the error must say)
    type Case<'a> = (Vec<String>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            strings(&["--etcd-user", "etcfs"]),
            vec![("ETCFS_ETCD_PASSWORD", "wrong-password-5d1c")],
            "invalid user ID or password",
        ),
        (Vec::new(), vec![], "needs a user"),
        (
            strings(&["--etcd-user", "etcfs"]),
            vec![],
            "--etcd-password-file",
        ),
    ];
    for (access, env, want) in cases {
        let (ok, text, t) = etcfs(&store("status", &access), &env);
        assert!(!ok && t < ERROR_DEADLINE, "{access:?} ({t:?}): {text}");
        assert!(text.contains(want), "{access:?}: want {want:?} in: {text}");
        assert!(!text.contains("wrong-password-5d1c") && !text.contains(PASSWORD));
        assert!(!text.contains("unavailable"), "{access:?}: {text}");
    }
    // The user's role covers `sec/` only.
    let (ok, text, t) = etcfs(
        &strings(&[
            "status",
            "--etcd",
            &ep,
            "--prefix",
            "other",
            "--etcd-user",
            "etcfs",
        ]),
        &[("ETCFS_ETCD_PASSWORD", PASSWORD)],
    );
    assert!(!ok && t < ERROR_DEADLINE, "other prefix ({t:?}): {text}");
    assert!(
        text.contains("permission denied") && !text.contains("unavailable"),
        "other prefix: {text}"
    );
    // A mount with the wrong password fails at once, saying why.
    let bad_pw = s.base.join("bad");
    fs::write(&bad_pw, "wrong-password-5d1c\n").unwrap();
    let mut bad = mount.clone();
    let at = bad.len() - 1;
    bad[at] = bad_pw.to_string_lossy().into_owned();
    let (ok, text, t) = etcfs(
        &[
            strings(&["mount", "--foreground"]),
            bad,
            vec![s.mnt().to_string_lossy().into_owned()],
        ]
        .concat(),
        &[],
    );
    umount_all(&s.mnt());
    assert!(
        !ok && t < ERROR_DEADLINE,
        "mount, wrong password ({t:?}): {text}"
    );
    assert!(text.contains("invalid user ID or password"), "{text}");
    assert!(!text.contains("wrong-password-5d1c"), "{text}");
    assert!(
        !d.log_text().contains(PASSWORD),
        "the password is in the log"
    );
}

/// JWT tokens expire after their TTL however busy the client is: a mount keeps working
/// across several expiries, logging in again each time.
#[test]
fn jwt_token_expiry() {
    if !can_run_here("jwt_token_expiry") {
        return;
    }
    const PASSWORD: &str = "jwt-pw-41b2";
    let s = Scratch::new("jwt");
    let key = rcgen::KeyPair::generate().unwrap();
    let (private, public) = (s.base.join("jwt.key"), s.base.join("jwt.pub"));
    fs::write(&private, key.serialize_pem()).unwrap();
    fs::write(&public, key.public_key_pem()).unwrap();
    let jwt = format!(
        "jwt,pub-key={},priv-key={},sign-method=ES256,ttl=2s",
        public.display(),
        private.display()
    );
    let etcd = auth_enabled_etcd(&s, &strings(&["--auth-token", &jwt]), PASSWORD);
    let access = strings(&["--etcd-user", "root"]);
    let env = [("ETCFS_ETCD_PASSWORD", PASSWORD)];
    let mut mkfs = strings(&["mkfs", "--etcd", &etcd.endpoint(), "--prefix", "sec"]);
    mkfs.extend(access.iter().cloned());
    mkfs.extend(["--device".into(), s.image.to_string_lossy().into_owned()]);
    let (ok, text, _) = etcfs(&mkfs, &env);
    assert!(ok, "mkfs: {text}");
    let pw_file = s.base.join("password");
    fs::write(&pw_file, PASSWORD).unwrap();
    let mut mount = strings(&["--etcd", &etcd.endpoint(), "--prefix", "sec", "--device"]);
    mount.push(s.image.to_string_lossy().into_owned());
    mount.extend(access);
    mount.extend([
        "--etcd-password-file".into(),
        pw_file.to_string_lossy().into_owned(),
    ]);
    let d = Daemon::spawn(&mount, &s.mnt(), &s.base.join("daemon.log"), "auto");
    for i in 0..3 {
        fs::write(d.path(&format!("f{i}")), format!("{i}")).expect("write");
        thread::sleep(Duration::from_millis(2500));
    }
    for i in 0..3 {
        assert_eq!(
            fs::read_to_string(d.path(&format!("f{i}"))).unwrap(),
            format!("{i}")
        );
    }
    let logins = d.log_text().matches("logged in again").count();
    assert!(
        logins >= 2,
        "{logins} logins in 7.5 s of 2 s tokens:\n{}",
        d.log_text()
    );
    assert!(!d.log_text().contains(PASSWORD));
    d.stop();
}

/// `etcfs mount MNT` alone: the private etcd takes only the client certificate it made
/// (etcdctl without it is refused), its keys, data and the device image are owner-only, and
/// the control socket is 0600 and refuses other users even when its mode is loosened.
#[test]
fn embedded_etcd_and_control_socket_are_private() {
    if !can_run_here("embedded_etcd_and_control_socket_are_private") {
        return;
    }
    let s = Scratch::new("embedded");
    let state = s.base.join("state");
    let args = strings(&["--state-dir", &state.to_string_lossy(), "--image-gib", "1"]);
    let pid_file = state.join("etcd/pid");
    // Stops the private etcd if the daemon could not (a panic below, a crashed daemon).
    struct StopPrivateEtcd(PathBuf);
    impl Drop for StopPrivateEtcd {
        fn drop(&mut self) {
            let Ok(pid) = fs::read_to_string(&self.0) else {
                return;
            };
            let pid = pid.trim();
            if fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "etcd") {
                let _ = Command::new("kill").arg(pid).status();
            }
        }
    }
    let _guard = StopPrivateEtcd(pid_file.clone());
    // Formatting the new image and starting etcd take longer than a plain mount.
    let d = Daemon::spawn(&args, &s.mnt(), &s.base.join("daemon.log"), "auto");
    fs::write(d.path("f"), b"private").expect("write");
    assert_eq!(fs::read(d.path("f")).unwrap(), b"private");

    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let pki = state.join("etcd/pki");
    assert_eq!(mode(&pki), 0o700);
    for f in [
        "ca.crt",
        "server.crt",
        "server.key",
        "client.crt",
        "client.key",
    ] {
        assert_eq!(mode(&pki.join(f)), 0o600, "{f}");
    }
    assert_eq!(mode(&state.join("etcd")), 0o700);
    assert_eq!(mode(&state.join("device.img")), 0o600);

    let port = fs::read_to_string(state.join("etcd/ports")).unwrap();
    let ep = format!(
        "https://127.0.0.1:{}",
        port.split_whitespace().next().unwrap()
    );
    let ca = pki.join("ca.crt").to_string_lossy().into_owned();
    let (ok, text) = etcdctl(&ep, &strings(&["--cacert", &ca]), &["get", "--prefix", "e"]);
    assert!(!ok, "etcdctl without the client certificate got in: {text}");
    let (ok, text) = etcdctl(&ep, &[], &["get", "--prefix", "e"]);
    assert!(!ok, "etcdctl over plain http got in: {text}");
    let with_cert = strings(&[
        "--cacert",
        &ca,
        "--cert",
        &pki.join("client.crt").to_string_lossy(),
        "--key",
        &pki.join("client.key").to_string_lossy(),
    ]);
    let (ok, text) = etcdctl(
        &ep,
        &with_cert,
        &["get", "--prefix", "etcfs", "--keys-only"],
    );
    assert!(
        ok && text.contains("etcfs"),
        "etcdctl with the certificate: {text}"
    );

    // The control socket: owner-only, and other users are turned away.
    let sock = PathBuf::from("/run/etcfs").join(format!(
        "{}.sock",
        s.mnt().to_string_lossy().replace('/', "+")
    ));
    assert!(
        eventually(Duration::from_secs(5), || sock.exists()),
        "no control socket at {}",
        sock.display()
    );
    assert_eq!(mode(&sock), 0o600, "control socket mode");
    let bin = s.base.join("etcfs");
    fs::copy(ETCFS, &bin).unwrap();
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
    let as_nobody = || {
        let (out, in_time) = run_bounded(
            Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
                .arg(&bin)
                .arg("stats")
                .arg(s.mnt()),
            Duration::from_secs(10),
        );
        assert!(in_time, "etcfs stats as nobody hung");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, text) = as_nobody();
    assert!(!ok && text.contains("permission denied"), "nobody: {text}");
    // Even with the mode loosened, the daemon checks who is asking.
    fs::set_permissions(&sock, fs::Permissions::from_mode(0o666)).unwrap();
    let (ok, text) = as_nobody();
    assert!(
        !ok && text.contains("refused") && text.contains("uid 65534"),
        "nobody through a loosened socket: {text}"
    );
    assert!(d.stats_json().is_object(), "root is still answered");
    let etcd_pid = fs::read_to_string(&pid_file).unwrap().trim().to_owned();
    d.stop();
    assert!(
        eventually(Duration::from_secs(10), || !Path::new(&format!(
            "/proc/{etcd_pid}"
        ))
        .exists()),
        "the private etcd (pid {etcd_pid}) outlived the daemon"
    );
}
