//! The `uring` engine: the requests of a batch go to the kernel through this thread's own
//! io_uring, up to `inflight_max` at once, and the call returns when every one of them has
//! completed.
//!
//! Buffers are borrowed from the caller for the duration of `submit_batch`, which hands
//! them to `uring::batch::run_batch`: it returns only when the kernel is done with all of
//! them, so this engine needs no `unsafe` of its own.

use std::{io, os::fd::AsRawFd, os::unix::fs::FileExt, sync::Arc};

use ::uring::{
    batch::{run_batch, BatchBuf, BatchOp},
    Ring, RingConfig,
};

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

/// An io_uring engine for the calling thread. Create one per thread from a shared
/// [`DevFile`]; it must stay on the thread that created it.
pub(crate) struct UringDev {
    file: Arc<std::fs::File>,
    size: u64,
    ring: Ring,
    inflight_max: usize,
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
        })
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
}

impl BlockDev for UringDev {
    fn engine(&self) -> &'static str {
        "uring"
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }

    fn submit_batch(&mut self, reqs: &mut [IoReq<'_>]) -> Vec<Result<(), DevError>> {
        let checked: Vec<Option<DevError>> =
            reqs.iter().map(|r| check_req(r, self.size).err()).collect();
        let fd = self.file.as_raw_fd();
        let mut ops = Vec::with_capacity(reqs.len());
        let mut index = Vec::with_capacity(reqs.len());
        for (i, r) in reqs.iter_mut().enumerate() {
            if checked[i].is_some() {
                continue;
            }
            let len = r.len;
            let buf = match &mut r.buf {
                IoBuf::Read(b) => BatchBuf::Read(&mut b[..len]),
                IoBuf::Write(b) => BatchBuf::Write(&b[..len]),
            };
            ops.push(BatchOp {
                fd,
                offset: r.off,
                buf,
            });
            index.push(i);
        }
        let done = run_batch(&mut self.ring, &mut ops, self.inflight_max);
        drop(ops);
        let mut results: Vec<Option<Result<(), DevError>>> =
            checked.into_iter().map(|e| e.map(Err)).collect();
        for (i, r) in index.into_iter().zip(done) {
            let result = match r {
                Ok(n) => i32::try_from(n).unwrap_or(i32::MAX),
                Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
            };
            results[i] = Some(self.finish(&mut reqs[i], result));
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
