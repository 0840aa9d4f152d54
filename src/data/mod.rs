//! The data half of etcfs: everything that lives on the shared block device.
//!
//! The device holds a superblock (two copies: the first and the last 4 KiB block), a
//! reserved head area, and then allocation groups (AGs) of file data blocks. Nothing else is
//! on the device: inodes, directories, extent maps and the record of free space live in
//! etcd (see `meta`). The on-disk format is specified in `docs/on-disk-format.md`.
//!
//! The pieces, from the bottom up:
//! * [`crc`]: CRC32C, the checksum of the superblock and of encoded free maps.
//! * [`superblock`]: the superblock record and the [`superblock::Geometry`] derived from
//!   it (where each AG starts and ends).
//! * [`device`]: the [`device::BlockDev`] trait (aligned reads and writes at byte offsets,
//!   `fdatasync`), with three engines: `psync` (pread/pwrite), `uring` (one io_uring per
//!   thread, O_DIRECT, bounded in-flight) and `mem` (in-memory, with fault knobs, for
//!   simulation).
//! * [`alloc`]: the block allocator, a pure data structure: free-extent maps per AG, the
//!   groups this node owns, and the compact encoding of one AG's free map for etcd.
//! * [`plan`]: pure functions that map a file range through an extent list to device reads
//!   and zero fills, and that say what a write must allocate and read-modify-write.
//! * [`mkfs`]: formatting a device and checking, at mount, that it is the expected one.
//!
//! Architecture invariants:
//! * This module knows nothing of FUSE or etcd. It hands the meta layer plain values
//!   (geometry, extents, encoded free maps) and takes the set of owned AGs as input.
//! * `alloc` and `plan` make no syscalls and never panic on input from disk or etcd; bad
//!   input is a typed error.
//! * Data is written and flushed through a [`device::BlockDev`] before the extent that points
//!   at it is committed (the caller's duty; `plan_write` says which blocks are new).

pub(crate) mod alloc;
pub(crate) mod crc;
pub(crate) mod device;
pub(crate) mod mkfs;
pub(crate) mod plan;
pub(crate) mod superblock;

use std::fmt;

/// The one block size of format version 1, in bytes. Every device I/O is a whole number of
/// blocks at a block-aligned offset, which satisfies O_DIRECT on any logical block size up
/// to 4 KiB.
pub(crate) const BLOCK_SIZE: u64 = 4096;

/// A block number on the device: byte offset `n * BLOCK_SIZE`. Block 0 holds the primary
/// superblock, so 0 is never a data block. Allocated by [`alloc::Allocator`], returned to it
/// on truncate, unlink and punch-hole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct BlockNo(pub(crate) u64);

impl BlockNo {
    /// Byte offset of the block on the device (saturating: callers check ranges first).
    pub(crate) fn byte_offset(self) -> u64 {
        self.0.saturating_mul(BLOCK_SIZE)
    }
}

impl fmt::Display for BlockNo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block {}", self.0)
    }
}

/// An allocation group number, 0-based, fixed at mkfs (the same number as `meta`'s
/// `GroupId`). A node allocates only inside the groups it owns; ownership is recorded in
/// etcd and passed to [`alloc::Allocator`] as a set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct AgId(pub(crate) u32);

impl fmt::Display for AgId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AG {}", self.0)
    }
}

/// A run of contiguous device blocks: `[start, start + len)`, `len > 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Extent {
    /// First block.
    pub(crate) start: BlockNo,
    /// Number of blocks, at least 1.
    pub(crate) len: u64,
}

impl Extent {
    /// The extent `[start, start + len)`.
    pub(crate) fn new(start: u64, len: u64) -> Self {
        Extent {
            start: BlockNo(start),
            len,
        }
    }

    /// One past the last block (saturating).
    pub(crate) fn end(&self) -> u64 {
        self.start.0.saturating_add(self.len)
    }

    /// Byte offset of the first block on the device.
    pub(crate) fn dev_off(&self) -> u64 {
        self.start.byte_offset()
    }

    /// Length in bytes.
    pub(crate) fn byte_len(&self) -> u64 {
        self.len.saturating_mul(BLOCK_SIZE)
    }
}

impl fmt::Display for Extent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "blocks [{}, {})", self.start.0, self.end())
    }
}
