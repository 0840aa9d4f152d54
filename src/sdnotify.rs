//! systemd's service notification (sd_notify(3)): newline-separated `KEY=VALUE` lines in
//! one datagram to the unix socket NOTIFY_SOCKET names (a path, or `@name` for the
//! abstract namespace). `Type=notify` units start their dependants once `READY=1` comes.
//! A few lines of std instead of a crate: the protocol is one `sendto`.

use std::{
    ffi::{OsStr, OsString},
    io,
    os::unix::{
        ffi::OsStrExt as _,
        net::{SocketAddr, UnixDatagram},
    },
};

/// Where to send notifications: the socket of the service manager that started us.
#[derive(Debug, Clone)]
pub(crate) struct Notifier {
    socket: OsString,
}

impl Notifier {
    /// From NOTIFY_SOCKET's value (main.rs reads the environment).
    pub(crate) fn new(socket: OsString) -> Notifier {
        Notifier { socket }
    }

    /// Sends `msg` (`READY=1`, `STOPPING=1`, `MAINPID=N`, `STATUS=...`, one per line).
    pub(crate) fn send(&self, msg: &str) -> io::Result<()> {
        let addr = address(&self.socket)?;
        let sock = UnixDatagram::unbound()?;
        let n = sock.send_to_addr(msg.as_bytes(), &addr)?;
        if n != msg.len() {
            return Err(io::Error::other("short write to NOTIFY_SOCKET"));
        }
        Ok(())
    }

    /// [`Notifier::send`], with a failure logged: a lost notification must not stop the
    /// mount (systemd then times the start out and says so).
    pub(crate) fn send_logged(&self, msg: &str) {
        if let Err(e) = self.send(msg) {
            log::warn!(
                "notifying the service manager ({}) failed: {e}",
                self.socket.to_string_lossy()
            );
        }
    }
}

fn address(socket: &OsStr) -> io::Result<SocketAddr> {
    let b = socket.as_bytes();
    match b.first() {
        Some(b'@') => {
            use std::os::linux::net::SocketAddrExt as _;
            SocketAddr::from_abstract_name(&b[1..])
        }
        Some(b'/') => SocketAddr::from_pathname(socket),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "NOTIFY_SOCKET is neither an absolute path nor @abstract",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_one_datagram_to_a_path_or_an_abstract_name() {
        let dir = std::env::temp_dir().join(format!("etcfs-sdnotify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify");
        let _ = std::fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).unwrap();
        Notifier::new(path.clone().into_os_string())
            .send("READY=1\nMAINPID=7")
            .unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nMAINPID=7");
        std::fs::remove_dir_all(&dir).unwrap();

        use std::os::linux::net::SocketAddrExt as _;
        let name = format!("etcfs-sdnotify-test-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        Notifier::new(format!("@{name}").into())
            .send("STOPPING=1")
            .unwrap();
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");

        assert!(Notifier::new("relative".into()).send("READY=1").is_err());
    }
}
