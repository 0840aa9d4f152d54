//! The contract between a transport and the filesystem behind it.
//!
//! A transport decodes one request, hands it to [`Handler::handle`] together with the
//! buffer the reply's arguments must be written into, and sends whatever [`Reply`] says.
//! The out buffer is, for the ring transport, the kernel-registered payload buffer itself,
//! so a READ written there reaches the kernel without a further copy.

use std::os::fd::RawFd;

use crate::{errno::Errno, request::Request};

/// Where a request is being served, for per-core state and statistics.
#[derive(Debug, Clone, Copy)]
pub struct RequestCtx {
    /// Index of the worker (core) serving the request, `0..workers`.
    pub core: usize,
}

/// What the handler wants sent back to the kernel.
#[derive(Debug)]
pub enum Reply {
    /// Success; the reply arguments are the first `n` bytes of the out buffer.
    Bytes(usize),
    /// Success of a READ whose data is `len` bytes of `fd` at `offset`. Transports that can
    /// splice do so; the others read the range into the out buffer. A short read means EOF.
    Fd { fd: RawFd, offset: u64, len: usize },
    /// Failure with this errno.
    Error(Errno),
    /// The request takes no reply (FORGET, BATCH_FORGET, and INTERRUPT handled locally).
    None,
}

/// The filesystem behind a mount. One instance is shared by every worker; implementations
/// shard their own state per core where they care about contention.
pub trait Handler: Send + Sync + 'static {
    /// Serves one request. `out` is at least `max_write` bytes (or 4 KiB plus the largest
    /// fixed reply, whichever is larger) and is the only place reply arguments may go.
    fn handle(&self, ctx: &RequestCtx, req: &Request<'_>, out: &mut [u8]) -> Reply;

    /// Called once after INIT negotiation, before any other request.
    fn init(&self, _negotiated: &crate::init::Negotiated) {}

    /// Called once when the connection ends (DESTROY, unmount or abort).
    fn destroy(&self) {}
}
