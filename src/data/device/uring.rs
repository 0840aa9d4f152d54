//! The `uring` engine: the requests of a batch go to the kernel through this thread's own
//! io_uring, up to `inflight_max` at once, and the call returns when every one of them has
//! completed.
//!
//! Buffers are borrowed from the caller for the duration of `submit_batch`. That is sound
//! because the function does not return (or unwind) while any SQE it pushed is still
//! without a reaped completion: the kernel stops touching a buffer exactly when the
//! completion of its SQE is posted. If the ring itself breaks while requests are in flight
//! (the wait syscall keeps failing), returning would hand the caller memory the kernel may
//! still write, so the process aborts instead; this cannot happen short of a kernel bug.

use std::{io, os::fd::AsRawFd, os::unix::fs::FileExt, sync::Arc, time::Duration};

use ::uring::{Completion, Ring, RingConfig};
use io_uring::{opcode, types};

use super::{check_req, BlockDev, DevError, DevFile, IoBuf, IoReq};

/// Sizes of a [`UringDev`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct UringDevConfig {
    /// Requests in the kernel at once (`inflight_max`); at most `sq_entries_max`.
    pub(crate) inflight_max: usize,
    /// Submission queue entries of the ring.
    pub(crate) sq_entries_max: u32,
}

impl Default for UringDevConfig {
    fn default() -> Self {
        UringDevConfig {
            inflight_max: 64,
            sq_entries_max: 64,
        }
    }
}

/// Consecutive failures of the wait syscall tolerated while requests are in flight.
const WAIT_RETRIES_MAX: u32 = 1000;

/// An io_uring engine for the calling thread. Create one per thread from a shared
/// [`DevFile`]; it must stay on the thread that created it.
pub(crate) struct UringDev {
    file: Arc<std::fs::File>,
    size: u64,
    ring: Ring,
    inflight_max: usize,
    reaped: Vec<Completion>,
}

impl UringDev {
    /// A ring-backed engine on `dev` for this thread.
    pub(crate) fn new(dev: &DevFile, cfg: UringDevConfig) -> Result<UringDev, DevError> {
        assert!(cfg.inflight_max >= 1);
        let ring = Ring::new(RingConfig {
            sq_entries_max: cfg.sq_entries_max,
        })
        .map_err(|err| DevError::Io {
            op: "io_uring setup",
            off: 0,
            len: 0,
            err,
        })?;
        Ok(UringDev {
            file: Arc::clone(&dev.file),
            size: dev.size,
            ring,
            inflight_max: cfg.inflight_max.min(cfg.sq_entries_max as usize),
            reaped: Vec::with_capacity(cfg.sq_entries_max as usize * 2),
        })
    }

    fn sqe(&self, req: &mut IoReq<'_>, user_data: u64) -> io_uring::squeue::Entry {
        let fd = types::Fd(self.file.as_raw_fd());
        let len = u32::try_from(req.len).expect("check_req bounds len by REQ_BYTES_MAX");
        match &mut req.buf {
            IoBuf::Read(b) => opcode::Read::new(fd, b.as_mut_ptr(), len)
                .offset(req.off)
                .build()
                .user_data(user_data),
            IoBuf::Write(b) => opcode::Write::new(fd, b.as_ptr(), len)
                .offset(req.off)
                .build()
                .user_data(user_data),
        }
    }

    /// Turns a completion into the request's result, finishing a short transfer
    /// synchronously (it happens at the edges of some devices and is rare).
    fn finish(&self, req: &mut IoReq<'_>, result: i32) -> Result<(), DevError> {
        let (off, len, op) = (req.off, req.len, req.op());
        if result < 0 {
            return Err(DevError::from_io(
                op,
                off,
                len,
                io::Error::from_raw_os_error(-result),
            ));
        }
        let mut done = usize::try_from(result).expect("non-negative i32 fits usize");
        while done < len {
            let at = off + done as u64;
            let r = match &mut req.buf {
                IoBuf::Read(b) => self.file.read_at(&mut b[done..len], at),
                IoBuf::Write(b) => self.file.write_at(&b[done..len], at),
            };
            match r {
                Ok(0) => return Err(DevError::Short { op, off, len, done }),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(DevError::from_io(op, at, len - done, e)),
            }
        }
        Ok(())
    }

    /// Waits for at least one completion. Never returns an error: with requests in flight
    /// there is nothing safe to return to (see the module comment).
    fn wait_one(&mut self) {
        let mut failures = 0u32;
        loop {
            match self.ring.submit_and_wait(1, Some(Duration::from_secs(1))) {
                Ok(()) => return,
                Err(e) => {
                    failures += 1;
                    log::warn!("io_uring wait failed with I/O in flight ({failures}): {e}");
                    if failures >= WAIT_RETRIES_MAX {
                        log::error!(
                            "io_uring wait keeps failing with device I/O in flight; aborting \
                             rather than freeing memory the kernel may still write"
                        );
                        std::process::abort();
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

impl BlockDev for UringDev {
    fn engine(&self) -> &'static str {
        "uring"
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }

    fn submit_batch(&mut self, reqs: &mut [IoReq<'_>]) -> Vec<Result<(), DevError>> {
        let n = reqs.len();
        let mut results: Vec<Option<Result<(), DevError>>> = Vec::with_capacity(n);
        for r in reqs.iter() {
            results.push(check_req(r, self.size).err().map(Err));
        }
        let mut next = 0usize;
        let mut inflight = 0usize;
        loop {
            while inflight < self.inflight_max && next < n {
                let i = next;
                next += 1;
                if results[i].is_some() {
                    continue;
                }
                let sqe = self.sqe(&mut reqs[i], i as u64);
                // SAFETY: the SQE points into the buffer of `reqs[i]`, which `reqs` borrows
                // for this whole call, and this function returns only when `inflight` is
                // back to zero, i.e. when the completion of every pushed SQE (user_data =
                // its index) has been reaped below; `wait_one` aborts rather than return
                // with I/O in flight.
                match unsafe { self.ring.push(&sqe) } {
                    Ok(()) => inflight += 1,
                    Err(err) => {
                        let (off, len) = (reqs[i].off, reqs[i].len);
                        results[i] = Some(Err(DevError::Io {
                            op: "io_uring submit",
                            off,
                            len,
                            err,
                        }));
                    }
                }
            }
            if inflight == 0 {
                break;
            }
            self.wait_one();
            let mut reaped = std::mem::take(&mut self.reaped);
            reaped.clear();
            self.ring.reap(&mut reaped);
            for c in &reaped {
                let i = usize::try_from(c.user_data).expect("user_data is a batch index");
                assert!(i < n, "completion for an index outside the batch");
                assert!(results[i].is_none(), "second completion for one request");
                inflight -= 1;
                results[i] = Some(self.finish(&mut reqs[i], c.result));
            }
            self.reaped = reaped;
        }
        results
            .into_iter()
            .map(|r| r.expect("every request has a result once nothing is in flight"))
            .collect()
    }

    fn flush(&mut self) -> Result<(), DevError> {
        self.file
            .sync_data()
            .map_err(|e| DevError::from_io("fdatasync", 0, 0, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::device::{psync::PsyncDev, testutil};
    use ::uring::AlignedBuf;

    #[test]
    fn uring_engine_on_a_direct_image() {
        let Some((_img, dev)) = testutil::direct_image("uring", 16 << 20) else {
            return;
        };
        let mut e = match UringDev::new(&dev, UringDevConfig::default()) {
            Ok(e) => e,
            Err(e) => {
                eprintln!("SKIP uring_engine_on_a_direct_image: {e}");
                return;
            }
        };
        assert_eq!(e.engine(), "uring");
        testutil::exercise(&mut e);
    }

    #[test]
    fn uring_with_one_in_flight_agrees_with_psync() {
        let Some((_img, dev)) = testutil::direct_image("uring1", 8 << 20) else {
            return;
        };
        let cfg = UringDevConfig {
            inflight_max: 1,
            sq_entries_max: 4,
        };
        let Ok(mut u) = UringDev::new(&dev, cfg) else {
            eprintln!("SKIP uring_with_one_in_flight: no io_uring");
            return;
        };
        let mut p = PsyncDev::new(&dev);
        let mut w = AlignedBuf::new(64 << 10);
        w.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (i % 253) as u8);
        u.write_at(&w, 1 << 20).unwrap();
        u.flush().unwrap();
        let mut r = AlignedBuf::new(64 << 10);
        p.read_at(&mut r, 1 << 20).unwrap();
        assert!(r[..] == w[..]);
        testutil::exercise(&mut u);
    }

    #[test]
    fn mkfs_and_check_through_the_ring() {
        use crate::data::mkfs;
        use std::time::SystemTime;
        let Some((img, dev)) = testutil::direct_image("uring-mkfs", 64 << 20) else {
            return;
        };
        let Ok(mut u) = UringDev::new(&dev, UringDevConfig::default()) else {
            eprintln!("SKIP mkfs_and_check_through_the_ring: no io_uring");
            return;
        };
        let sb = mkfs::format(&mut u, &img.path, [7; 16], 1024, false, SystemTime::now()).unwrap();
        let mut p = PsyncDev::new(&dev);
        assert_eq!(mkfs::check(&mut p, &img.path, [7; 16]).unwrap(), sb);
        let e = mkfs::format(&mut u, &img.path, [8; 16], 1024, false, SystemTime::now());
        assert!(matches!(e, Err(mkfs::MkfsError::AlreadyFormatted(..))));
    }
}
