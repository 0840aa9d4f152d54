//! Blocking batches of reads and writes on borrowed buffers: submit them all (a bounded
//! number at a time), return when every one has completed. The borrow is sound because the
//! call does not return, or unwind, while the kernel may still touch a buffer.

use std::{io, os::fd::RawFd, time::Duration};

use io_uring::{opcode, types};

use crate::{Completion, Ring};

/// The buffer of one operation of a batch.
#[derive(Debug)]
pub enum BatchBuf<'a> {
    /// Fill this buffer.
    Read(&'a mut [u8]),
    /// Write this buffer.
    Write(&'a [u8]),
}

/// One read or write of a batch: the whole buffer, at `offset` of `fd`.
#[derive(Debug)]
pub struct BatchOp<'a> {
    /// Descriptor to read or write.
    pub fd: RawFd,
    /// Byte offset in the file or device.
    pub offset: u64,
    /// Memory read into or written from.
    pub buf: BatchBuf<'a>,
}

/// Consecutive failed waits tolerated while operations are in flight.
const WAIT_RETRIES_MAX: u32 = 1000;

/// Runs `ops` on `ring`, at most `inflight_max` in the kernel at once, and returns each
/// operation's result (bytes transferred, which may be short) in order.
pub fn run_batch(
    ring: &mut Ring,
    ops: &mut [BatchOp<'_>],
    inflight_max: usize,
) -> Vec<io::Result<usize>> {
    let inflight_max = inflight_max.max(1);
    let mut results: Vec<Option<io::Result<usize>>> = (0..ops.len()).map(|_| None).collect();
    let mut next = 0;
    let mut inflight = 0;
    let mut reaped: Vec<Completion> = Vec::with_capacity(inflight_max);
    while next < ops.len() || inflight > 0 {
        while inflight < inflight_max && next < ops.len() {
            let i = next;
            next += 1;
            let op = &mut ops[i];
            let Ok(len) = u32::try_from(match &op.buf {
                BatchBuf::Read(b) => b.len(),
                BatchBuf::Write(b) => b.len(),
            }) else {
                results[i] = Some(Err(io::Error::from_raw_os_error(libc::EINVAL)));
                continue;
            };
            let fd = types::Fd(op.fd);
            let sqe = match &mut op.buf {
                BatchBuf::Read(b) => opcode::Read::new(fd, b.as_mut_ptr(), len)
                    .offset(op.offset)
                    .build(),
                BatchBuf::Write(b) => opcode::Write::new(fd, b.as_ptr(), len)
                    .offset(op.offset)
                    .build(),
            }
            .user_data(i as u64);
            // SAFETY: `ops` borrows the buffer for this whole call, and the call returns only
            // once every pushed SQE's completion has been reaped (`inflight` back at zero); a
            // wait that keeps failing aborts instead.
            match unsafe { ring.push(&sqe) } {
                Ok(()) => inflight += 1,
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        if inflight == 0 {
            continue;
        }
        wait_one(ring);
        reaped.clear();
        ring.reap(&mut reaped);
        for c in &reaped {
            let Some(slot) = usize::try_from(c.user_data)
                .ok()
                .and_then(|i| results.get_mut(i))
            else {
                continue;
            };
            inflight -= 1;
            *slot = Some(if c.result < 0 {
                Err(io::Error::from_raw_os_error(-c.result))
            } else {
                Ok(c.result as usize)
            });
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(io::Error::other("not run"))))
        .collect()
}

/// Waits for a completion. With operations in flight there is nothing safe to return to on
/// failure (the caller would free memory the kernel may write), so a ring that keeps failing
/// aborts the process; short of a kernel bug it does not happen.
fn wait_one(ring: &mut Ring) {
    let mut failures = 0;
    while let Err(e) = ring.submit_and_wait(1, Some(Duration::from_secs(1))) {
        failures += 1;
        log::warn!("io_uring wait failed with I/O in flight ({failures}): {e}");
        if failures >= WAIT_RETRIES_MAX {
            log::error!("io_uring wait keeps failing with I/O in flight; aborting");
            std::process::abort();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use std::{io::Write as _, os::fd::AsRawFd};

    use super::*;
    use crate::RingConfig;

    #[test]
    fn reads_and_writes_in_order_with_results() {
        let mut f = crate::scratch_file("batch");
        f.write_all(&[7u8; 8192]).unwrap();
        let mut ring: Ring = Ring::new(RingConfig { sq_entries_max: 4 }).unwrap();
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 100]);
        let data = vec![9u8; 4096];
        let fd = f.as_raw_fd();
        let mut ops = vec![
            BatchOp {
                fd,
                offset: 0,
                buf: BatchBuf::Read(&mut a),
            },
            BatchOp {
                fd,
                offset: 4096,
                buf: BatchBuf::Write(&data),
            },
            BatchOp {
                fd,
                offset: 8150,
                buf: BatchBuf::Read(&mut b),
            },
            BatchOp {
                fd: -1,
                offset: 0,
                buf: BatchBuf::Write(&data),
            },
        ];
        let r = run_batch(&mut ring, &mut ops, 2);
        assert_eq!(r[0].as_ref().unwrap(), &4096);
        assert_eq!(r[1].as_ref().unwrap(), &4096);
        assert_eq!(r[2].as_ref().unwrap(), &42, "short read at EOF");
        assert_eq!(r[3].as_ref().unwrap_err().raw_os_error(), Some(libc::EBADF));
        drop(ops);
        assert!(a.iter().all(|&x| x == 7));
        let mut back = vec![0u8; 4096];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut back, 4096).unwrap();
        assert!(back.iter().all(|&x| x == 9));
    }
}
