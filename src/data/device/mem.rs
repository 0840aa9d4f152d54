//! An in-memory device for deterministic simulation. It models what matters for crash
//! safety: completed writes sit in a volatile cache until `flush`, and `crash` loses them.
//! Fault knobs inject failed writes, torn writes (a prefix of the blocks lands), failed
//! flushes and a full device. Clones share one device, as several nodes share a LUN.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use super::{check_req, BlockDev, DevError, IoBuf, IoReq};
use crate::data::BLOCK_SIZE;

type Block = Box<[u8]>;

/// Faults to inject, each consumed when it fires.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct MemFaults {
    /// Fail this many upcoming writes (nothing lands).
    pub(crate) fail_writes: u32,
    /// Tear the next write: only its first `n` blocks land, then it fails.
    pub(crate) tear_next_write_blocks: Option<u64>,
    /// Fail this many upcoming flushes (nothing becomes durable).
    pub(crate) fail_flushes: u32,
    /// While set, every write fails with ENOSPC (a full device under an image file).
    pub(crate) full: bool,
}

/// Operation counts, for tests that check an operation did (or did not) touch the device.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemStats {
    pub(crate) reads: u64,
    pub(crate) writes: u64,
    pub(crate) flushes: u64,
}

#[derive(Debug, Default)]
struct State {
    /// Blocks that survive a crash.
    durable: HashMap<u64, Block>,
    /// Blocks written since the last flush (they shadow `durable`).
    volatile: HashMap<u64, Block>,
    faults: MemFaults,
    stats: MemStats,
}

/// A sparse in-memory device; unwritten blocks read as zeros.
#[derive(Debug, Clone)]
pub(crate) struct MemDev {
    state: Arc<Mutex<State>>,
    size: u64,
}

impl MemDev {
    /// A zeroed device of `size` bytes (rounded down to whole blocks).
    pub(crate) fn new(size: u64) -> MemDev {
        MemDev {
            state: Arc::default(),
            size: size - size % BLOCK_SIZE,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data, still consistent per block.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the fault knobs.
    pub(crate) fn set_faults(&self, faults: MemFaults) {
        self.lock().faults = faults;
    }

    /// The fault knobs left (fired faults are consumed).
    pub(crate) fn faults(&self) -> MemFaults {
        self.lock().faults.clone()
    }

    /// Operation counts so far.
    pub(crate) fn stats(&self) -> MemStats {
        self.lock().stats
    }

    /// Simulates power loss: every write not yet flushed is lost.
    pub(crate) fn crash(&self) {
        self.lock().volatile.clear();
    }

    fn write_blocks(st: &mut State, off: u64, data: &[u8]) {
        for (i, chunk) in data.chunks(BLOCK_SIZE as usize).enumerate() {
            let blk = off / BLOCK_SIZE + i as u64;
            st.volatile.insert(blk, chunk.into());
        }
    }

    fn run_one(&self, req: &mut IoReq<'_>) -> Result<(), DevError> {
        check_req(req, self.size)?;
        let (off, len) = (req.off, req.len);
        let mut st = self.lock();
        match &mut req.buf {
            IoBuf::Read(buf) => {
                st.stats.reads += 1;
                for (i, chunk) in buf[..len].chunks_mut(BLOCK_SIZE as usize).enumerate() {
                    let blk = off / BLOCK_SIZE + i as u64;
                    match st.volatile.get(&blk).or_else(|| st.durable.get(&blk)) {
                        Some(b) => chunk.copy_from_slice(b),
                        None => chunk.fill(0),
                    }
                }
                Ok(())
            }
            IoBuf::Write(buf) => {
                st.stats.writes += 1;
                if st.faults.full {
                    return Err(DevError::NoSpace { off, len });
                }
                if st.faults.fail_writes > 0 {
                    st.faults.fail_writes -= 1;
                    return Err(DevError::Injected { op: "write", off });
                }
                if let Some(keep) = st.faults.tear_next_write_blocks.take() {
                    let keep_bytes = (keep * BLOCK_SIZE).min(len as u64) as usize;
                    Self::write_blocks(&mut st, off, &buf[..keep_bytes]);
                    return Err(DevError::Injected {
                        op: "torn write",
                        off,
                    });
                }
                Self::write_blocks(&mut st, off, &buf[..len]);
                Ok(())
            }
        }
    }
}

impl BlockDev for MemDev {
    fn engine(&self) -> &'static str {
        "mem"
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }

    fn submit_batch(&mut self, reqs: &mut [IoReq<'_>]) -> Vec<Result<(), DevError>> {
        reqs.iter_mut().map(|r| self.run_one(r)).collect()
    }

    fn flush(&mut self) -> Result<(), DevError> {
        let mut st = self.lock();
        st.stats.flushes += 1;
        if st.faults.fail_flushes > 0 {
            st.faults.fail_flushes -= 1;
            return Err(DevError::Injected {
                op: "flush",
                off: 0,
            });
        }
        let pending: Vec<(u64, Block)> = st.volatile.drain().collect();
        st.durable.extend(pending);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::uring::AlignedBuf;

    fn filled(len: usize, byte: u8) -> AlignedBuf {
        let mut b = AlignedBuf::new(len);
        b.fill(byte);
        b
    }

    #[test]
    fn reads_zero_then_data_and_crash_loses_unflushed() {
        let mut d = MemDev::new(1 << 20);
        let mut r = AlignedBuf::new(8192);
        d.read_at(&mut r, 0).unwrap();
        assert!(r.iter().all(|&b| b == 0));

        d.write_at(&filled(8192, 1), 4096).unwrap();
        d.flush().unwrap();
        d.write_at(&filled(4096, 2), 8192).unwrap();
        d.read_at(&mut r, 4096).unwrap();
        assert!(r[..4096].iter().all(|&b| b == 1));
        assert!(r[4096..].iter().all(|&b| b == 2));

        d.crash();
        d.read_at(&mut r, 4096).unwrap();
        assert!(
            r.iter().all(|&b| b == 1),
            "flushed data survives, unflushed is lost"
        );
        assert_eq!(d.stats().flushes, 1);
    }

    #[test]
    fn fault_knobs_fire_once() {
        let mut d = MemDev::new(1 << 20);
        let other = d.clone();
        d.set_faults(MemFaults {
            fail_writes: 1,
            ..Default::default()
        });
        let e = d.write_at(&filled(4096, 9), 0).unwrap_err();
        assert!(matches!(e, DevError::Injected { .. }));
        d.write_at(&filled(4096, 9), 0).unwrap();

        d.set_faults(MemFaults {
            tear_next_write_blocks: Some(1),
            ..Default::default()
        });
        assert!(d.write_at(&filled(12288, 7), 4096).is_err());
        let mut r = AlignedBuf::new(12288);
        d.read_at(&mut r, 4096).unwrap();
        assert!(r[..4096].iter().all(|&b| b == 7), "the first block landed");
        assert!(r[4096..].iter().all(|&b| b == 0), "the rest did not");

        d.set_faults(MemFaults {
            full: true,
            ..Default::default()
        });
        let e = d.write_at(&filled(4096, 1), 0).unwrap_err();
        assert_eq!(e.errno(), libc::ENOSPC);

        d.set_faults(MemFaults {
            fail_flushes: 1,
            ..Default::default()
        });
        assert!(d.flush().is_err());
        assert!(d.flush().is_ok());
        assert_eq!(
            other.faults(),
            MemFaults::default(),
            "clones share the device"
        );
    }

    #[test]
    fn out_of_range_and_misaligned_are_refused() {
        let mut d = MemDev::new(1 << 20);
        let mut r = AlignedBuf::new(4096);
        assert!(matches!(
            d.read_at(&mut r, 1 << 20),
            Err(DevError::OutOfRange { .. })
        ));
        assert!(matches!(
            d.read_at(&mut r, 512),
            Err(DevError::Misaligned { .. })
        ));
    }
}
