//! The `psync` engine: positional `pread`/`pwrite` on the shared file, one request at a time.
//! It needs nothing from the kernel beyond the basics, so it is the fallback where io_uring
//! is blocked, and the reference the uring engine is checked against.

use std::{os::unix::fs::FileExt, sync::Arc};

use super::{check_req, BlockDev, DevError, DevFile, IoBuf, IoReq};

/// Synchronous engine over a shared [`DevFile`]. Cheap to create per thread.
#[derive(Debug, Clone)]
pub(crate) struct PsyncDev {
    file: Arc<std::fs::File>,
    size: u64,
}

impl PsyncDev {
    /// An engine on `dev`.
    pub(crate) fn new(dev: &DevFile) -> PsyncDev {
        PsyncDev {
            file: Arc::clone(&dev.file),
            size: dev.size,
        }
    }

    fn run_one(&self, req: &mut IoReq<'_>) -> Result<(), DevError> {
        check_req(req, self.size)?;
        let (off, len) = (req.off, req.len);
        let op = req.op();
        let mut done = 0usize;
        while done < len {
            let at = off + done as u64;
            let r = match &mut req.buf {
                IoBuf::Read(b) => self.file.read_at(&mut b[done..len], at),
                IoBuf::Write(b) => self.file.write_at(&b[done..len], at),
            };
            match r {
                Ok(0) => return Err(DevError::Short { op, off, len, done }),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(DevError::from_io(op, at, len - done, e)),
            }
        }
        assert_eq!(done, len);
        Ok(())
    }
}

impl BlockDev for PsyncDev {
    fn engine(&self) -> &'static str {
        "psync"
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }

    fn submit_batch(&mut self, reqs: &mut [IoReq<'_>]) -> Vec<Result<(), DevError>> {
        reqs.iter_mut().map(|r| self.run_one(r)).collect()
    }

    fn flush(&mut self) -> Result<(), DevError> {
        self.file
            .sync_data()
            .map_err(|e| DevError::from_io("fdatasync", 0, 0, e))
    }
}
