//! The thread-per-core io_uring runtime of etcfs.
//!
//! The model: every worker thread is pinned to one CPU and owns exactly one [`Ring`]. Nothing
//! in a ring is shared with another thread, so the ring is created on the thread that uses it
//! (`SINGLE_ISSUER`) and the kernel runs completion work for it on that same CPU
//! (`COOP_TASKRUN`). Work that must cross cores travels through bounded channels owned by the
//! caller; the receiving core is woken through its [`Waker`], an eventfd the core keeps a poll
//! armed on, so a sleeping core wakes from the same `io_uring_enter` that waits for I/O.
//!
//! Memory the kernel reads or writes while an operation is in flight must outlive the
//! operation. The rule here is ownership: such memory is an [`AlignedBuf`] (or a value) owned
//! by an entry in an [`InFlight`] slab, and the slab key is the SQE's `user_data`; the entry is
//! removed only when its completion has been reaped.
//!
//! This crate knows nothing of FUSE or etcd.

pub mod batch;
pub mod buf;
pub mod cpu;
pub mod fixed;
pub mod ring;
pub mod slab;
pub mod spin;
pub mod wake;

pub use buf::{AlignedBuf, ArenaHold, HugeArena};
pub use fixed::Registered;
pub use ring::{Completion, Ring, RingConfig};
pub use slab::InFlight;
pub use spin::{SpinPolicy, Transfer, WaitPlan, Waited};
pub use wake::Waker;

/// A file of the test's own, open for reading and writing and already unlinked, so nothing
/// is left behind whether the test passes or not.
#[cfg(test)]
pub(crate) fn scratch_file(tag: &str) -> std::fs::File {
    let path = std::env::temp_dir().join(format!("etcfs-uring-{tag}-{}", std::process::id()));
    let file = std::fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    file
}
