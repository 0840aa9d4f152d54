//! Registered (fixed) buffers and files for a ring's data reads and writes.
//!
//! A plain READ or WRITE makes the kernel look up the file in the descriptor table and pin
//! the buffer's pages for every operation; a registered buffer is pinned once, and a
//! registered file is referenced once, when the ring registers them. For 4 KiB device reads
//! at queue depth 32 the pinning alone was about 2% of the machine's CPU
//! (`gup_fast_fallback` in a `perf record -a`, docs/benchmarks.md).
//!
//! [`Registered`] remembers what a ring registered and builds each operation's SQE from
//! it: a fixed buffer when the transfer lies wholly inside a registered region, a fixed
//! file when its descriptor was registered, the plain operation otherwise. So an operation
//! on memory or a file the ring does not know still works, at the plain operation's cost.

use std::{io, os::fd::RawFd};

use io_uring::{opcode, squeue, types};

use crate::Ring;

/// What one ring registered.
#[derive(Debug, Default, Clone)]
pub struct Registered {
    /// Registered regions as (start, length); the buffer index is the position.
    regions: Vec<(usize, usize)>,
    /// Registered descriptors; the fixed file index is the position.
    files: Vec<RawFd>,
}

/// Evaluates `$build` with `$file` the registered file for `$fd` when there is one, the
/// plain descriptor otherwise: the opcode builders take either, but as different types.
macro_rules! on_file {
    ($reg:expr, $fd:expr, |$file:ident| $build:expr) => {
        match $reg.file($fd) {
            Some($file) => $build,
            None => {
                let $file = types::Fd($fd);
                $build
            }
        }
    };
}

impl Registered {
    /// A READ of `len` bytes at `offset` of `fd` into `buf`.
    pub fn read(&self, fd: RawFd, buf: *mut u8, len: u32, offset: u64) -> squeue::Entry {
        let region = self.region_of(buf, len);
        on_file!(self, fd, |file| if let Some(index) = region {
            opcode::ReadFixed::new(file, buf, len, index)
                .offset(offset)
                .build()
        } else {
            opcode::Read::new(file, buf, len).offset(offset).build()
        })
    }

    /// A WRITE of `len` bytes from `buf` at `offset` of `fd`.
    pub fn write(&self, fd: RawFd, buf: *const u8, len: u32, offset: u64) -> squeue::Entry {
        let region = self.region_of(buf, len);
        on_file!(self, fd, |file| if let Some(index) = region {
            opcode::WriteFixed::new(file, buf, len, index)
                .offset(offset)
                .build()
        } else {
            opcode::Write::new(file, buf, len).offset(offset).build()
        })
    }

    /// The buffer index of the registered region holding all of `[buf, buf + len)`.
    fn region_of(&self, buf: *const u8, len: u32) -> Option<u16> {
        let (at, len) = (buf as usize, len as usize);
        let i = self.regions.iter().position(|&(start, region_len)| {
            at >= start && at.saturating_add(len) <= start + region_len
        })?;
        u16::try_from(i).ok()
    }

    fn file(&self, fd: RawFd) -> Option<types::Fixed> {
        let i = self.files.iter().position(|&f| f == fd)?;
        Some(types::Fixed(u32::try_from(i).ok()?))
    }
}

impl<S: squeue::EntryMarker> Ring<S> {
    /// Registers `regions` as this ring's fixed buffers and `files` as its fixed files, each
    /// set independently: what the kernel refuses (regions over the locked-memory limit,
    /// say) is left out of the result and reported in the error list, and operations on it
    /// take the plain path.
    ///
    /// # Safety
    ///
    /// Every region must be memory of this process that stays mapped until the ring is
    /// dropped (a region unmapped and mapped again for something else would still reach the
    /// old pages through [`Registered`]), and `files` must stay open until then or be the same open files (the
    /// ring holds its own references, so a descriptor closed and reused for another file
    /// would still reach the old one through [`Registered`]).
    pub unsafe fn register_fixed(
        &mut self,
        regions: &[(*mut u8, usize)],
        files: &[RawFd],
    ) -> (Registered, Vec<io::Error>) {
        let mut registered = Registered::default();
        let mut errors = Vec::new();
        // Buffer indexes are 16 bits in an SQE.
        let regions = &regions[..regions.len().min(usize::from(u16::MAX))];
        if !regions.is_empty() {
            let iovs: Vec<libc::iovec> = regions
                .iter()
                .map(|&(base, len)| libc::iovec {
                    iov_base: base.cast(),
                    iov_len: len,
                })
                .collect();
            // SAFETY: the caller guarantees the regions stay mapped for the ring's life.
            match unsafe { self.ring.submitter().register_buffers(&iovs) } {
                Ok(()) => {
                    registered.regions = regions
                        .iter()
                        .map(|&(base, len)| (base as usize, len))
                        .collect();
                }
                Err(e) => errors.push(e),
            }
        }
        if !files.is_empty() {
            match self.ring.submitter().register_files(files) {
                Ok(()) => registered.files = files.to_vec(),
                Err(e) => errors.push(e),
            }
        }
        (registered, errors)
    }
}

#[cfg(test)]
mod tests {
    use std::{io::Write, os::fd::AsRawFd};

    use super::*;
    use crate::{AlignedBuf, HugeArena, RingConfig};

    fn run(ring: &mut Ring, sqe: squeue::Entry) -> i32 {
        // SAFETY: the test keeps every buffer alive until the completion is reaped below.
        unsafe { ring.push(&sqe.user_data(7)) }.unwrap();
        ring.submit_and_wait(1, None).unwrap();
        let mut done = Vec::new();
        ring.reap(&mut done);
        assert_eq!(done.len(), 1);
        done[0].result
    }

    #[test]
    fn fixed_and_plain_transfers_move_the_same_bytes() {
        let mut file = crate::scratch_file("fixed");
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
        file.write_all(&data).unwrap();
        let fd = file.as_raw_fd();
        let mut arena = HugeArena::new(1 << 20).unwrap();
        let mut second = HugeArena::new(1 << 20).unwrap();
        let mut inside = arena.carve(8192).unwrap();
        let mut in_second = second.carve(8192).unwrap();
        let mut outside = AlignedBuf::new(8192);
        let mut ring: Ring = Ring::new(RingConfig::default()).unwrap();
        let regions = [arena.region(), second.hold().region()];
        // SAFETY: the arenas and the file outlive the ring (dropped first, below).
        let (reg, errors) = unsafe { ring.register_fixed(&regions, &[fd]) };
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(reg.regions.len(), 2);
        assert_eq!(reg.region_of(in_second.as_ptr(), 4096), Some(1));
        assert_eq!(reg.files.len(), 1);
        // Fixed buffers of either region and fixed file; plain buffer and fixed file; both
        // plain (an unregistered descriptor of the same file).
        let dup = file.try_clone().unwrap();
        let cases = [
            (inside.as_mut_ptr(), fd),
            (in_second.as_mut_ptr(), fd),
            (outside.as_mut_ptr(), fd),
            (outside.as_mut_ptr(), dup.as_raw_fd()),
        ];
        for (buf, fd) in cases {
            // SAFETY: `buf` is one of the two live 8 KiB buffers above.
            unsafe { std::ptr::write_bytes(buf, 0, 4096) };
            assert_eq!(run(&mut ring, reg.read(fd, buf, 4096, 4096)), 4096);
            // SAFETY: as above; the read completed.
            let got = unsafe { std::slice::from_raw_parts(buf, 4096) };
            assert_eq!(got, &data[4096..]);
        }
        // A fixed-buffer write lands where a plain read finds it.
        inside[..4096].fill(0xA5);
        assert_eq!(
            run(&mut ring, reg.write(fd, inside.as_ptr(), 4096, 0)),
            4096
        );
        assert_eq!(
            run(
                &mut ring,
                reg.read(dup.as_raw_fd(), outside.as_mut_ptr(), 4096, 0)
            ),
            4096
        );
        assert!(outside[..4096].iter().all(|&b| b == 0xA5));
        drop(ring);
    }

    #[test]
    fn a_transfer_reaching_past_the_region_takes_the_plain_path() {
        let reg = Registered {
            regions: vec![(0x10000, 0x2000), (0x20000, 0x1000)],
            files: vec![5],
        };
        assert_eq!(reg.region_of(0x10000 as *const u8, 0x2000), Some(0));
        assert_eq!(reg.region_of(0x20800 as *const u8, 0x800), Some(1));
        assert_eq!(reg.region_of(0x11000 as *const u8, 0x1001), None);
        assert_eq!(reg.region_of(0xF000 as *const u8, 16), None);
        assert_eq!(
            reg.region_of(0x1F000 as *const u8, 0x2000),
            None,
            "straddles"
        );
        assert!(reg.file(5).is_some());
        assert!(reg.file(6).is_none());
    }
}
