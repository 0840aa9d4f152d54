//! One io_uring per worker thread.

use std::{io, os::fd::RawFd, time::Duration};

use crate::spin::{WaitPlan, Waited};

use io_uring::{
    cqueue, opcode,
    squeue::{self, EntryMarker},
    types, IoUring,
};

/// Sizes of a ring.
#[derive(Debug, Clone, Copy)]
pub struct RingConfig {
    /// Submission queue entries (`sq_entries_max`); the completion queue gets twice that.
    pub sq_entries_max: u32,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            sq_entries_max: 256,
        }
    }
}

/// One reaped completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The `user_data` of the SQE this completes.
    pub user_data: u64,
    /// The result: a count or value on success, `-errno` on failure.
    pub result: i32,
    /// CQE flags (`IORING_CQE_F_*`).
    pub flags: u32,
}

/// A ring owned by one thread. `S` is [`squeue::Entry`] for ordinary rings and
/// [`squeue::Entry128`] for rings that carry 80-byte `URING_CMD`s (FUSE-over-io_uring).
pub struct Ring<S: EntryMarker = squeue::Entry> {
    pub(crate) ring: IoUring<S, cqueue::Entry>,
}

impl<S: EntryMarker> Ring<S> {
    /// Creates a ring for the calling thread. It must only be used from this thread:
    /// `SINGLE_ISSUER` lets the kernel skip submission locking, and `COOP_TASKRUN` runs
    /// completion work when this thread enters the kernel instead of interrupting it.
    pub fn new(cfg: RingConfig) -> io::Result<Self> {
        let ring = IoUring::<S, cqueue::Entry>::builder()
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .setup_cqsize(cfg.sq_entries_max.saturating_mul(2))
            .build(cfg.sq_entries_max)?;
        Ok(Ring { ring })
    }

    /// Queues one SQE, submitting what is queued first if the submission queue is full.
    ///
    /// # Safety
    ///
    /// Every pointer inside `sqe` (buffers, iovecs, timespecs) must stay valid, and not be
    /// otherwise accessed in a conflicting way, until the completion with this SQE's
    /// `user_data` has been reaped.
    pub unsafe fn push(&mut self, sqe: &S) -> io::Result<()> {
        loop {
            // SAFETY: the caller guarantees the SQE's memory outlives its completion.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            self.submit()?;
        }
    }

    /// Hands queued SQEs to the kernel without waiting.
    pub fn submit(&mut self) -> io::Result<usize> {
        loop {
            match self.ring.submit() {
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => return Ok(0),
                other => return other,
            }
        }
    }

    /// Submits and waits until at least `want` completions are ready, a signal arrives, or
    /// `timeout` passes (then it returns normally with fewer completions).
    pub fn submit_and_wait(&mut self, want: usize, timeout: Option<Duration>) -> io::Result<()> {
        let result = match timeout {
            None => self.ring.submit_and_wait(want).map(drop),
            Some(t) => {
                let ts = types::Timespec::new()
                    .sec(t.as_secs())
                    .nsec(t.subsec_nanos());
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring
                    .submitter()
                    .submit_with_args(want, &args)
                    .map(drop)
            }
        };
        match result {
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                ) =>
            {
                Ok(())
            }
            other => other,
        }
    }

    /// Submits, then spins for up to `budget` until a completion is ready, without
    /// sleeping. Returns whether one is. With `COOP_TASKRUN` a completion raised on another
    /// CPU waits as task work until this thread enters the kernel; the `TASKRUN` flag says
    /// when there is some, and a zero-wait enter runs it.
    fn spin_for_completion(&mut self, budget: Duration) -> io::Result<bool> {
        if self.pending() > 0 {
            self.submit()?;
        }
        let start = std::time::Instant::now();
        loop {
            if !self.ring.completion().is_empty() {
                return Ok(true);
            }
            if self.ring.submission().taskrun() {
                self.submit_and_wait(0, None)?;
                continue;
            }
            if start.elapsed() >= budget {
                return Ok(false);
            }
            std::hint::spin_loop();
        }
    }

    /// Carries out `plan` up to the point where the caller sleeps in
    /// [`Ring::submit_and_wait`]: spins, or naps and then spins.
    pub fn before_sleep(&mut self, plan: WaitPlan) -> io::Result<Waited> {
        let spin = match plan {
            WaitPlan::Sleep => return Ok(Waited::Slept),
            WaitPlan::Spin(budget) => budget,
            WaitPlan::NapThenSpin { nap, spin } => {
                self.submit_and_wait(1, Some(nap))?;
                // Whether it woke the nap or came just before the timer: the completion
                // belonged in the spin after the nap.
                if !self.ring.completion().is_empty() {
                    return Ok(Waited::WokenEarly);
                }
                spin
            }
        };
        Ok(match self.spin_for_completion(spin)? {
            true => Waited::SpinHit,
            false => Waited::SpinMiss,
        })
    }

    /// Moves every ready completion into `out` (appending).
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        let cq = self.ring.completion();
        out.extend(cq.map(|c| Completion {
            user_data: c.user_data(),
            result: c.result(),
            flags: c.flags(),
        }));
    }

    /// SQEs queued but not yet submitted.
    pub fn pending(&mut self) -> usize {
        self.ring.submission().len()
    }
}

/// Builds an `IORING_OP_URING_CMD` SQE with an 80-byte command area and an explicit `len`.
/// The `io-uring` crate's builder leaves `len` at zero, but FUSE's REGISTER command requires
/// `len == 2` (the number of iovecs at `addr`), so the field is set on the raw entry.
pub fn uring_cmd80(fd: RawFd, cmd_op: u32, addr: u64, len: u32, cmd: [u8; 80]) -> squeue::Entry128 {
    let sqe = opcode::UringCmd80::new(types::Fd(fd), cmd_op)
        .addr(Some(addr))
        .cmd(cmd)
        .build();
    /// Offset of `len` in `struct io_uring_sqe` (stable kernel ABI).
    const SQE_LEN_OFFSET: usize = 24;
    // SAFETY: Entry128 is #[repr(C)] around a 64-byte `io_uring_sqe` and a 64-byte tail, all
    // plain integers, so it has the same size as [u8; 128] and every bit pattern is valid.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
    raw[SQE_LEN_OFFSET..SQE_LEN_OFFSET + 4].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: as above; only the `len` field changed.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nop_round_trip_and_timeout() {
        let mut ring: Ring = Ring::new(RingConfig { sq_entries_max: 4 }).unwrap();
        for i in 0..10u64 {
            // SAFETY: a NOP references no memory.
            unsafe { ring.push(&opcode::Nop::new().build().user_data(i)).unwrap() };
        }
        let mut done = Vec::new();
        while done.len() < 10 {
            ring.submit_and_wait(1, Some(Duration::from_secs(5)))
                .unwrap();
            ring.reap(&mut done);
        }
        let mut ids: Vec<u64> = done.iter().map(|c| c.user_data).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..10).collect::<Vec<_>>());
        let t = std::time::Instant::now();
        ring.submit_and_wait(1, Some(Duration::from_millis(50)))
            .unwrap();
        assert!(t.elapsed() >= Duration::from_millis(40));
    }

    #[test]
    fn sqe128_ring_takes_uring_cmd_and_len_is_set() {
        let sqe = uring_cmd80(7, 1, 0x1000, 2, [0u8; 80]);
        // SAFETY: see uring_cmd80: Entry128 is 128 bytes of plain integers.
        let raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
        assert_eq!(u32::from_ne_bytes(raw[24..28].try_into().unwrap()), 2);
        assert_eq!(i32::from_ne_bytes(raw[4..8].try_into().unwrap()), 7);
        let _ring: Ring<squeue::Entry128> = Ring::new(RingConfig::default()).unwrap();
    }
}
