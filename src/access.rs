//! How every command reaches etcd: the TLS and user options shared by all commands that
//! talk to etcd, and the one function that turns them into the meta crate's
//! [`EtcdConfig`].
//!
//! The password is read from a file or the environment, never from the command line,
//! where any local user could read it in `ps`; it never appears in an error or a log line.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use meta::etcd::{EtcdAuth, EtcdConfig, EtcdTls};

/// The environment variable that may hold the etcd password.
pub(crate) const PASSWORD_ENV: &str = "ETCFS_ETCD_PASSWORD";

/// Certificates and credentials for etcd (named as etcdctl names them, with `etcd-`).
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct EtcdAccess {
    /// CA certificate (PEM) that signed the etcd servers' certificates; needed for
    /// https:// endpoints.
    #[arg(long, value_name = "PATH")]
    pub(crate) etcd_cacert: Option<PathBuf>,
    /// Client certificate (PEM) for an etcd with --client-cert-auth.
    #[arg(long, value_name = "PATH", requires = "etcd_key")]
    pub(crate) etcd_cert: Option<PathBuf>,
    /// Private key (PEM) of --etcd-cert.
    #[arg(long, value_name = "PATH", requires = "etcd_cert")]
    pub(crate) etcd_key: Option<PathBuf>,
    /// etcd user (for an etcd with authentication enabled); the password comes from
    /// --etcd-password-file or the environment variable ETCFS_ETCD_PASSWORD.
    #[arg(long, value_name = "NAME")]
    pub(crate) etcd_user: Option<String>,
    /// File holding the password of --etcd-user (one trailing newline is ignored).
    #[arg(long, value_name = "PATH", requires = "etcd_user")]
    pub(crate) etcd_password_file: Option<PathBuf>,
}

impl EtcdAccess {
    /// Whether any option is given (the embedded etcd takes none).
    pub(crate) fn any(&self) -> bool {
        self.etcd_cacert.is_some()
            || self.etcd_cert.is_some()
            || self.etcd_key.is_some()
            || self.etcd_user.is_some()
            || self.etcd_password_file.is_some()
    }

    /// The connection settings for `endpoints` with these options, for the filesystem
    /// under `prefix`: files read and checked here, so that a missing file or a missing
    /// password is named before any connection.
    pub(crate) fn config(&self, endpoints: &[String], prefix: &str) -> Result<EtcdConfig> {
        let env_password = std::env::var(PASSWORD_ENV).ok();
        let mut cfg = self.config_with(endpoints, env_password)?;
        cfg.probe_key = probe_key(prefix);
        Ok(cfg)
    }

    fn config_with(
        &self,
        endpoints: &[String],
        env_password: Option<String>,
    ) -> Result<EtcdConfig> {
        if endpoints.is_empty() {
            bail!("give the etcd endpoints with --etcd URL[,URL...]");
        }
        let https = endpoints
            .iter()
            .filter(|e| e.starts_with("https://"))
            .count();
        if let Some(e) = endpoints
            .iter()
            .find(|e| !e.starts_with("http://") && !e.starts_with("https://"))
        {
            bail!("etcd endpoint {e:?} needs a scheme: http://HOST:PORT or https://HOST:PORT");
        }
        let tls_options = self.etcd_cacert.is_some() || self.etcd_cert.is_some();
        if https > 0 && https < endpoints.len() {
            bail!("the etcd endpoints mix http:// and https://; give one scheme for all");
        }
        if https == 0 && tls_options {
            bail!(
                "--etcd-cacert and --etcd-cert are for TLS: give the endpoints as https://, \
                 not http://"
            );
        }
        let mut cfg = EtcdConfig::new(endpoints.to_vec());
        if https > 0 {
            let Some(ca) = &self.etcd_cacert else {
                bail!(
                    "https:// endpoints need --etcd-cacert PATH: the CA certificate that signed \
                     the etcd servers' certificates"
                );
            };
            let ca_pem = read_pem(ca, "--etcd-cacert", "CERTIFICATE")?;
            let identity = match (&self.etcd_cert, &self.etcd_key) {
                (Some(cert), Some(key)) => Some((
                    read_pem(cert, "--etcd-cert", "CERTIFICATE")?,
                    read_pem(key, "--etcd-key", "PRIVATE KEY")?,
                )),
                (None, None) => None,
                // clap's `requires` rules these out; kept for callers building EtcdAccess.
                (Some(_), None) => bail!("--etcd-cert needs --etcd-key (its private key)"),
                (None, Some(_)) => bail!("--etcd-key needs --etcd-cert (its certificate)"),
            };
            cfg.tls = Some(EtcdTls { ca_pem, identity });
        }
        if let Some(user) = &self.etcd_user {
            if user.is_empty() {
                bail!("--etcd-user is empty");
            }
            if user.contains(':') {
                // etcdctl's --user takes NAME:PASSWORD; here that would put the password
                // in the process list, so it is refused (without echoing it).
                bail!(
                    "--etcd-user takes only the user name; give the password with \
                     --etcd-password-file PATH or in {PASSWORD_ENV}, not on the command line"
                );
            }
            let password = match (&self.etcd_password_file, env_password) {
                (Some(path), _) => read_password(path)?,
                (None, Some(p)) => p,
                (None, None) => bail!(
                    "--etcd-user {user} needs its password: put it in a file given with \
                     --etcd-password-file PATH, or in the environment variable {PASSWORD_ENV}"
                ),
            };
            if password.is_empty() {
                bail!("the password of etcd user {user} is empty");
            }
            cfg.auth = Some(EtcdAuth::new(user.clone(), password));
        }
        Ok(cfg)
    }
}

/// The key a connection reads first: `<prefix>/` itself, which no record uses and which
/// a role granted the filesystem's prefix (`<prefix>/`) covers.
pub(crate) fn probe_key(prefix: &str) -> Vec<u8> {
    format!("{prefix}/").into_bytes()
}

/// A PEM file's contents, checked to hold a block of `kind`.
fn read_pem(path: &Path, flag: &str, kind: &str) -> Result<Vec<u8>> {
    let pem =
        std::fs::read(path).with_context(|| format!("cannot read {flag} {}", path.display()))?;
    let text = String::from_utf8_lossy(&pem);
    if !text
        .lines()
        .any(|l| l.starts_with("-----BEGIN ") && l.trim_end().ends_with(&format!("{kind}-----")))
    {
        bail!(
            "{flag} {}: not a PEM file with a {kind} (expected a line \
             \"-----BEGIN ...{kind}-----\")",
            path.display()
        );
    }
    Ok(pem)
}

fn read_password(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read --etcd-password-file {}", path.display()))?;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o077 != 0 {
            log::warn!(
                "--etcd-password-file {} can be read by other users (mode {:o}); chmod 600 it",
                path.display(),
                meta.permissions().mode() & 0o777
            );
        }
    }
    let Ok(mut s) = String::from_utf8(bytes) else {
        bail!("--etcd-password-file {}: not UTF-8 text", path.display());
    };
    if s.ends_with('\n') {
        s.pop();
        if s.ends_with('\r') {
            s.pop();
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test's own directory of credential files, removed when the test ends (pass or
    /// fail), so repeated runs leave nothing behind in /tmp.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(test: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("etcfs-access-{test}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn file(&self, name: &str, contents: &str) -> PathBuf {
            let p = self.0.join(name);
            std::fs::write(&p, contents).unwrap();
            p
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn eps(e: &[&str]) -> Vec<String> {
        e.iter().map(|s| s.to_string()).collect()
    }

    fn err(a: &EtcdAccess, e: &[&str], env: Option<&str>) -> String {
        format!(
            "{:#}",
            a.config_with(&eps(e), env.map(str::to_owned)).unwrap_err()
        )
    }

    #[test]
    fn plain_http_needs_nothing() {
        let cfg = EtcdAccess::default()
            .config_with(&eps(&["http://127.0.0.1:2379"]), Some("ignored".into()))
            .unwrap();
        assert!(cfg.tls.is_none() && cfg.auth.is_none());
    }

    #[test]
    fn tls_rules() {
        let scratch = Scratch::new("tls");
        let ca = scratch.file(
            "ca.pem",
            "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
        );
        let key = scratch.file(
            "k.pem",
            "-----BEGIN PRIVATE KEY-----\nx\n-----END PRIVATE KEY-----\n",
        );
        let junk = scratch.file("junk.pem", "hello\n");
        let none = EtcdAccess::default();
        assert!(err(&none, &["https://h:1"], None).contains("need --etcd-cacert"));
        let with_ca = EtcdAccess {
            etcd_cacert: Some(ca.clone()),
            ..Default::default()
        };
        assert!(err(&with_ca, &["http://h:1"], None).contains("https://"));
        assert!(err(&with_ca, &["https://h:1", "http://h:2"], None).contains("mix"));
        assert!(err(&with_ca, &["h:1"], None).contains("needs a scheme"));
        let cfg = with_ca.config_with(&eps(&["https://h:1"]), None).unwrap();
        assert!(cfg.tls.unwrap().identity.is_none());
        let missing = EtcdAccess {
            etcd_cacert: Some("/nonexistent/ca.pem".into()),
            ..Default::default()
        };
        let e = err(&missing, &["https://h:1"], None);
        assert!(
            e.contains("cannot read --etcd-cacert /nonexistent/ca.pem"),
            "{e}"
        );
        let bad = EtcdAccess {
            etcd_cacert: Some(junk),
            ..Default::default()
        };
        assert!(err(&bad, &["https://h:1"], None).contains("not a PEM file"));
        let half = EtcdAccess {
            etcd_cacert: Some(ca.clone()),
            etcd_cert: Some(ca.clone()),
            ..Default::default()
        };
        assert!(err(&half, &["https://h:1"], None).contains("needs --etcd-key"));
        let full = EtcdAccess {
            etcd_key: Some(key),
            ..half
        };
        let cfg = full.config_with(&eps(&["https://h:1"]), None).unwrap();
        assert!(cfg.tls.unwrap().identity.is_some());
    }

    #[test]
    fn password_comes_from_file_or_env_and_is_never_shown() {
        let scratch = Scratch::new("pw");
        let file = scratch.file("pw", "s3cret-file\n");
        let user = EtcdAccess {
            etcd_user: Some("alice".into()),
            ..Default::default()
        };
        let e = err(&user, &["http://h:1"], None);
        assert!(
            e.contains("--etcd-password-file") && e.contains(PASSWORD_ENV),
            "{e}"
        );
        let cfg = user
            .config_with(&eps(&["http://h:1"]), Some("s3cret-env".into()))
            .unwrap();
        let shown = format!("{cfg:?}");
        assert!(
            shown.contains("alice") && !shown.contains("s3cret"),
            "{shown}"
        );
        let from_file = EtcdAccess {
            etcd_password_file: Some(file),
            ..user.clone()
        };
        // The file wins over the environment, and its newline is not part of it.
        assert_eq!(
            read_password(from_file.etcd_password_file.as_ref().unwrap()).unwrap(),
            "s3cret-file"
        );
        let cfg = from_file
            .config_with(&eps(&["http://h:1"]), Some("s3cret-env".into()))
            .unwrap();
        assert!(!format!("{cfg:?}").contains("s3cret"));
        let colon = EtcdAccess {
            etcd_user: Some("alice:hunter2".into()),
            ..Default::default()
        };
        let e = err(&colon, &["http://h:1"], Some("x"));
        assert!(
            e.contains("only the user name") && !e.contains("hunter2"),
            "{e}"
        );
        assert!(err(&user, &["http://h:1"], Some("")).contains("empty"));
    }
}
