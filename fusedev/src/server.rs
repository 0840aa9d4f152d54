//! The contract between a transport and the filesystem behind it.
//!
//! A transport decodes one request, hands it to [`Handler::handle`] together with the
//! buffer the reply's arguments must be written into, and sends whatever [`Reply`] says.
//! The out buffer is, for the ring transport, the kernel-registered payload buffer itself,
//! so a READ written there reaches the kernel without a further copy.
//!
//! A handler that must wait (for an etcd commit, say) does not block its core: it takes a
//! [`DeferredReply`] from [`RequestCtx::defer`], returns [`Reply::Deferred`], and completes
//! the reply later from any thread. The core goes on serving other requests meanwhile.

use std::{cell::Cell, os::fd::RawFd};

use crossbeam_channel::{Sender, TrySendError};
use uring::Waker;

use crate::{errno::Errno, request::Request};

/// Where a request is being served, and the means to answer it later.
pub struct RequestCtx<'a> {
    /// Index of the worker (core) serving the request, `0..workers`.
    pub core: usize,
    defer: Option<DeferTarget<'a>>,
    deferred: Cell<bool>,
}

struct DeferTarget<'a> {
    completions: &'a Sender<DeferredCompletion>,
    waker: &'a Waker,
    token: u64,
}

impl<'a> RequestCtx<'a> {
    /// A context whose requests must be answered before `handle` returns (tests, and the
    /// sideband reader of FORGET/INTERRUPT, which has no ring to complete on).
    pub fn new(core: usize) -> Self {
        RequestCtx {
            core,
            defer: None,
            deferred: Cell::new(false),
        }
    }

    /// A context that can defer: completions go to `completions`, then `waker` wakes the
    /// core, which answers the request identified by `token`.
    pub(crate) fn deferrable(
        core: usize,
        completions: &'a Sender<DeferredCompletion>,
        waker: &'a Waker,
        token: u64,
    ) -> Self {
        RequestCtx {
            core,
            defer: Some(DeferTarget {
                completions,
                waker,
                token,
            }),
            deferred: Cell::new(false),
        }
    }

    /// Takes over the reply: the handler then returns [`Reply::Deferred`] and answers
    /// through the returned handle. `None` when this transport path cannot defer (answer
    /// synchronously then). At most one deferral per request.
    pub fn defer(&self) -> Option<DeferredReply> {
        let t = self.defer.as_ref()?;
        if self.deferred.replace(true) {
            return None;
        }
        Some(DeferredReply {
            completions: t.completions.clone(),
            waker: t.waker.clone(),
            token: t.token,
            sent: false,
        })
    }

    /// Whether the transport executes [`Reply::Write`] plans for this request: it serves it
    /// on a core's ring, and a WRITE's data starts page-aligned in its buffer, so block-
    /// aligned pieces of it can go to an O_DIRECT device as they are.
    pub fn io_plans(&self) -> bool {
        self.defer.is_some()
    }

    /// Whether [`RequestCtx::defer`] handed out the reply.
    pub(crate) fn was_deferred(&self) -> bool {
        self.deferred.get()
    }
}

/// The answer to a deferred request, delivered to the core that owns it.
#[derive(Debug)]
pub(crate) struct DeferredCompletion {
    pub(crate) token: u64,
    pub(crate) outcome: DeferredOutcome,
}

/// What a deferred request is answered with.
#[derive(Debug)]
pub enum DeferredOutcome {
    /// Success with these reply arguments (at most the request's out-buffer size).
    Bytes(Vec<u8>),
    /// Success of a READ: the data comes from these segments, read on the owning core.
    Read(ReadPlan),
    /// Failure.
    Error(Errno),
}

/// A reply owed to the kernel. Completing it (from any thread) wakes the core that serves
/// the request. Dropping it without completing answers EIO, so no request is left hanging.
#[derive(Debug)]
pub struct DeferredReply {
    completions: Sender<DeferredCompletion>,
    waker: Waker,
    token: u64,
    sent: bool,
}

impl DeferredReply {
    /// Answers with reply arguments.
    pub fn bytes(self, args: Vec<u8>) {
        self.complete(DeferredOutcome::Bytes(args));
    }

    /// Answers with an error.
    pub fn error(self, errno: Errno) {
        self.complete(DeferredOutcome::Error(errno));
    }

    /// Answers a READ with data to be read from the device.
    pub fn read(self, plan: ReadPlan) {
        self.complete(DeferredOutcome::Read(plan));
    }

    /// Answers with `outcome`.
    pub fn complete(mut self, outcome: DeferredOutcome) {
        self.send(outcome);
    }

    fn send(&mut self, outcome: DeferredOutcome) {
        self.sent = true;
        // The channel holds one slot per request the core can come to hold, and each request
        // defers at most once, so it is never full: a full one is a bug that leaves the
        // request unanswered, said loudly. A closed channel means the connection is gone and
        // there is nobody left to answer.
        let completion = DeferredCompletion {
            token: self.token,
            outcome,
        };
        match self.completions.try_send(completion) {
            Ok(()) => self.waker.wake(),
            Err(TrySendError::Full(c)) => log::error!(
                "deferred reply for entry {} dropped: the core's completion channel is full; \
                 its request stays unanswered",
                c.token
            ),
            Err(TrySendError::Disconnected(_)) => {
                log::debug!("deferred reply dropped: the session has ended")
            }
        }
    }
}

impl Drop for DeferredReply {
    fn drop(&mut self) {
        if !self.sent {
            log::error!("a deferred reply was dropped unanswered; replying EIO");
            self.send(DeferredOutcome::Error(Errno::EIO));
        }
    }
}

/// Data of a READ reply assembled from device reads and zeros, in order. The transport reads
/// every `Device` segment into the next position of the out buffer (for O_DIRECT, keep each
/// segment's offset and length block-aligned: positions start at 0, which is page-aligned),
/// fills `Zero` segments, and replies with `len` bytes starting at `skip` (so an unaligned
/// request can be served from an aligned read).
#[derive(Debug, Default)]
pub struct ReadPlan {
    /// Segments in out-buffer order.
    pub segments: Vec<Segment>,
    /// Bytes at the start of the assembled data that are not part of the reply.
    pub skip: usize,
    /// Bytes of reply data after `skip`.
    pub len: usize,
    /// Dropped when the reads are over.
    pub hold: Option<Hold>,
}

impl ReadPlan {
    /// Bytes the segments fill.
    pub fn total(&self) -> usize {
        self.segments.iter().map(Segment::len).sum()
    }
}

/// One piece of a [`ReadPlan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment {
    /// `len` bytes of `fd` at `offset`; a short read is an I/O error.
    Device { fd: RawFd, offset: u64, len: usize },
    /// `len` zero bytes (a hole, or unwritten space).
    Zero { len: usize },
}

impl Segment {
    /// Bytes this segment fills.
    pub fn len(&self) -> usize {
        match *self {
            Segment::Device { len, .. } | Segment::Zero { len } => len,
        }
    }

    /// True for an empty segment.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Something a handler keeps alive until the device I/O of a plan has finished (its file's
/// count of I/O in flight, which truncate waits on before it frees blocks). The transport
/// drops it on the core once the last segment completed, whatever the outcome.
pub struct Hold {
    // Never read: what matters is when it is dropped.
    _held: Box<dyn Send>,
}

impl Hold {
    /// Holds `t` until the I/O is over.
    pub fn new<T: Send + 'static>(t: T) -> Self {
        Hold { _held: Box::new(t) }
    }
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hold")
    }
}

/// A WRITE served from the request's own buffer (or from `image`): each segment goes from
/// the WRITE's data to the device with no copy, and once all completed the reply says
/// `written` bytes (any failure or short write answers EIO). Returned only when
/// [`RequestCtx::io_plans`] is true; for O_DIRECT, keep `src`, `offset` and `len`
/// block-aligned.
#[derive(Debug)]
pub struct WritePlan {
    /// Device writes, issued together.
    pub segments: Vec<WriteSegment>,
    /// What the reply reports written.
    pub written: u32,
    /// Dropped when the writes are over.
    pub hold: Option<Hold>,
    /// Where the segments' bytes are when not in the WRITE's data: blocks the handler
    /// built around a write that covers them in part. The transport keeps it until the
    /// writes are over.
    pub image: Option<uring::AlignedBuf>,
}

/// One device write of a [`WritePlan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteSegment {
    /// The device.
    pub fd: RawFd,
    /// Where on the device.
    pub offset: u64,
    /// Where in the WRITE's data the bytes start.
    pub src: usize,
    /// How many bytes.
    pub len: usize,
}

impl WritePlan {
    /// Whether every segment lies inside `data_len` bytes of WRITE data (inside the image
    /// when there is one).
    pub fn fits(&self, data_len: usize) -> bool {
        let data_len = self.image.as_ref().map_or(data_len, |img| img.len());
        self.segments.iter().all(|s| {
            s.src
                .checked_add(s.len)
                .is_some_and(|end| end <= data_len && s.len > 0)
        }) && self.segments.iter().map(|s| s.len).sum::<usize>() <= u32::MAX as usize
    }
}

/// What the handler wants sent back to the kernel.
#[derive(Debug)]
pub enum Reply {
    /// Success; the reply arguments are the first `n` bytes of the out buffer.
    Bytes(usize),
    /// Success of a READ whose data is `len` bytes of `fd` at `offset`. Transports that can
    /// splice do so; the others read the range into the out buffer. A short read means EOF.
    Fd { fd: RawFd, offset: u64, len: usize },
    /// Success of a READ assembled from device reads and zeros.
    Read(ReadPlan),
    /// A WRITE whose data the transport writes to the device from the request's buffer.
    Write(WritePlan),
    /// Failure with this errno.
    Error(Errno),
    /// The request takes no reply (FORGET, BATCH_FORGET, and INTERRUPT handled locally).
    None,
    /// The handler took a [`DeferredReply`] and will answer through it.
    Deferred,
}

/// The filesystem behind a mount. One instance is shared by every worker; implementations
/// shard their own state per core where they care about contention.
pub trait Handler: Send + Sync + 'static {
    /// Serves one request. `out` is at least `max_write` bytes (or 4 KiB plus the largest
    /// fixed reply, whichever is larger) and is the only place reply arguments may go.
    fn handle(&self, ctx: &RequestCtx<'_>, req: &Request<'_>, out: &mut [u8]) -> Reply;

    /// Whether fcntl and flock locks are the filesystem's (GETLK, SETLK, SETLKW; asked for
    /// at INIT with POSIX_LOCKS and FLOCK_LOCKS). False leaves them to the kernel, node-local:
    /// it does not fall back when the filesystem answers ENOSYS to them.
    fn serves_locks(&self) -> bool {
        false
    }

    /// Whether the filesystem keeps POSIX ACLs (asked for at INIT with POSIX_ACL and
    /// DONT_MASK): it then gets creates' modes unmasked, with the umask beside them, and
    /// must apply the umask itself unless a default ACL replaces it.
    fn serves_acls(&self) -> bool {
        false
    }

    /// Whether the transport may start the device I/O of a plan now. Asked right before
    /// a READ or WRITE plan's (or an `Fd` reply's) I/O is queued, after the handler
    /// returned it: a filesystem on a shared device closes this when its node may have
    /// lost the right to touch the device (its lease ran out while it was frozen), and
    /// the request fails with EIO instead. Called on every data request: keep it cheap.
    fn device_io_allowed(&self) -> bool {
        true
    }

    /// Descriptors that [`Segment::Device`] ranges name and that stay open, on the same
    /// files, for as long as the handler lives: a ring transport registers them with its
    /// rings (fixed files), so its device transfers skip the descriptor lookup. A range on
    /// any other descriptor still works.
    fn stable_fds(&self) -> Vec<std::os::fd::RawFd> {
        Vec::new()
    }

    /// Called once after INIT negotiation, before any other request.
    fn init(&self, _negotiated: &crate::init::Negotiated) {}

    /// Called once before the first request other than INIT is served, with the means to
    /// invalidate the kernel's caches on this connection: a filesystem that must drop
    /// the kernel's pages while serving its first requests has it by then.
    fn notifier_ready(&self, _notifier: crate::transport::Notifier) {}

    /// Called once when the connection ends (DESTROY, unmount or abort).
    fn destroy(&self) {}

    /// Counters of the filesystem behind the mount (etcd transactions, cache hits...), named
    /// and summed, for `etcfs stats`. Called off the request path, when a report is asked for.
    fn counters(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
}
