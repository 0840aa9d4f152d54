//! Cross-core wake-ups: an eventfd that a core keeps a poll armed on in its own ring.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
};

use io_uring::{opcode, squeue, types};

/// Wakes one core's ring from any thread. Cloning shares the same eventfd.
#[derive(Debug, Clone)]
pub struct Waker {
    fd: std::sync::Arc<OwnedFd>,
}

impl Waker {
    /// Creates a non-blocking eventfd.
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Waker {
            fd: std::sync::Arc::new(fd),
        })
    }

    /// Makes the owning core's armed poll complete. Never blocks.
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Clears pending wake-ups; the owning core calls it when its poll completes.
    pub fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64; the fd is non-blocking.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    /// A one-shot poll SQE for the owning core's ring; it references no memory, so pushing it
    /// needs only the fd to stay open, which `self` guarantees while the waker lives.
    pub fn poll_entry(&self, user_data: u64) -> squeue::Entry {
        opcode::PollAdd::new(types::Fd(self.fd.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(user_data)
    }

    /// The eventfd.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Ring, RingConfig};

    #[test]
    fn wake_from_another_thread_completes_the_poll() {
        let waker = Waker::new().unwrap();
        let mut ring: Ring = Ring::new(RingConfig::default()).unwrap();
        // SAFETY: the poll references only the eventfd, which `waker` keeps open.
        unsafe { ring.push(&waker.poll_entry(42)).unwrap() };
        ring.submit().unwrap();
        let w = waker.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            w.wake();
        });
        let mut done = Vec::new();
        while done.is_empty() {
            ring.submit_and_wait(1, Some(Duration::from_secs(5)))
                .unwrap();
            ring.reap(&mut done);
        }
        assert_eq!(done[0].user_data, 42);
        waker.drain();
        t.join().unwrap();
    }
}
