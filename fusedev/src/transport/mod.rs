//! The two transports that carry FUSE requests between the kernel and a [`Handler`], and the
//! session that picks one, negotiates INIT and runs the per-core workers.
//!
//! * [`ring`]: FUSE-over-io_uring (kernel 6.14+). One queue per possible CPU; each queue's
//!   entries are registered by the worker pinned to that CPU (or, for CPUs without a worker,
//!   by a worker chosen round-robin). A request and its reply are one `URING_CMD`
//!   (COMMIT_AND_FETCH). FORGET, BATCH_FORGET and INTERRUPT still arrive on `/dev/fuse`, so a
//!   sideband thread reads it.
//! * [`devfuse`]: classic `/dev/fuse`, cloned per worker, read and written with io_uring SQEs
//!   on each worker's ring; READ replies backed by a file descriptor are spliced through a
//!   pipe.
//!
//! Both transports follow one rule: every request that expects a reply gets exactly one,
//! whatever happens in the handler (a panic becomes EIO), because a lost reply leaves the
//! caller in uninterruptible sleep and makes unmount hang.

pub mod devfuse;
pub mod ring;

use std::{
    io,
    os::fd::RawFd,
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use uring::{SpinPolicy, Transfer, WaitPlan, Waited, Waker};
use zerocopy::IntoBytes;

use crate::{
    errno::Errno,
    init::{self, InitConfig, Negotiated},
    mount::Mount,
    notify,
    opcode::Opcode,
    reply,
    request::{self, Operation, Request},
    server::{Handler, ReadPlan, Reply, RequestCtx, Segment, WritePlan},
};

/// Bytes of a request beyond its data: the largest fixed header plus argument.
pub const REQUEST_HEADER_ROOM: usize = 4096;
/// Size of `fuse_out_header`.
pub const OUT_HEADER_LEN: usize = 16;
/// `max_write` when requests travel over the ring. The kernel copies a WRITE's data into
/// the ring entry in the thread of the worker that takes it (about 100 µs per MiB on the
/// benchmark VM, longer than the request's other overheads together), so a larger
/// application write is better sent as pieces that several workers take and copy at once
/// (see `ring::Peers`); reads still come whole (up to [`RING_MAX_PAGES`]).
pub const RING_MAX_WRITE: u32 = 512 << 10;
/// `max_pages` over the ring: the kernel's largest request (1 MiB), which READs use.
pub const RING_MAX_PAGES: u16 = 256;
/// `max_write` on `/dev/fuse`: a spliced reply must fit whole in a pipe, pipes are capped at
/// 1 MiB without CAP_SYS_RESOURCE, and a pipe slot is a page, so 512 KiB leaves room.
pub const DEVFUSE_MAX_WRITE: u32 = 512 << 10;

/// Which transport the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// The ring when the kernel offers it, otherwise `/dev/fuse`.
    Auto,
    /// FUSE-over-io_uring; an error if the kernel does not offer it.
    Uring,
    /// Classic `/dev/fuse`.
    Devfuse,
}

/// Named counters the transport keeps in the session's `perf` registry, in this order.
pub const COUNTERS: [&str; 16] = [
    "ring_entries_passed",
    "ring_entries_returned",
    "ring_write_pieces_spread",
    "ring_linger_hits",
    "ring_linger_misses",
    "fuse_read_bytes",
    "fuse_write_bytes",
    "device_read_bytes_worker",
    "device_reads_worker",
    "device_write_bytes_worker",
    "device_writes_worker",
    "device_wait_sleeps",
    "device_wait_naps_woken",
    "device_wait_spin_hits",
    "device_wait_spin_misses",
    "worker_idle_sleeps",
];
/// Index in [`COUNTERS`]: ring entries a worker passed to a less busy one.
pub(crate) const RING_ENTRIES_PASSED: usize = 0;
/// Index in [`COUNTERS`]: ring entries given back to their queue's own worker.
pub(crate) const RING_ENTRIES_RETURNED: usize = 1;
/// Index in [`COUNTERS`]: ring entries passed on after one worker took several pieces of
/// one large write (so that their next pieces go to different workers).
pub(crate) const RING_WRITE_PIECES_SPREAD: usize = 2;
/// Index in [`COUNTERS`]: lingers (see [`SessionConfig::ring_linger`]) that saw the next
/// request or completion arrive.
pub(crate) const RING_LINGER_HITS: usize = 3;
/// Index in [`COUNTERS`]: lingers that ran out, after which the worker slept.
pub(crate) const RING_LINGER_MISSES: usize = 4;
/// Index in [`COUNTERS`]: data bytes of successful READ replies.
const FUSE_READ_BYTES: usize = 5;
/// Index in [`COUNTERS`]: data bytes of WRITE requests received.
const FUSE_WRITE_BYTES: usize = 6;
/// Index in [`COUNTERS`]: bytes the workers asked the device (or a reply's backing file)
/// to read, and in how many reads; then the same for writes. The handler's own device I/O
/// (on its threads) is its business and its counters.
const DEVICE_READ_BYTES: usize = 7;
const DEVICE_READS: usize = 8;
const DEVICE_WRITE_BYTES: usize = 9;
const DEVICE_WRITES: usize = 10;
/// Index in [`COUNTERS`]: how the waits of a worker with device I/O in flight went (see
/// [`wait_counter`]).
const DEVICE_WAIT_SLEEPS: usize = 11;
const DEVICE_WAIT_NAPS_WOKEN: usize = 12;
const DEVICE_WAIT_SPIN_HITS: usize = 13;
const DEVICE_WAIT_SPIN_MISSES: usize = 14;
/// Index in [`COUNTERS`]: sleeps of a worker with nothing in flight.
const WORKER_IDLE_SLEEPS: usize = 15;

/// Index in [`COUNTERS`] of how a wait of a worker went: with device I/O in flight, its
/// outcome; with none, a sleep until the next request (a ring worker's linger counts
/// apart).
pub(crate) fn wait_counter(device_busy: bool, waited: Waited) -> usize {
    match (device_busy, waited) {
        (false, _) => WORKER_IDLE_SLEEPS,
        (true, Waited::Slept) => DEVICE_WAIT_SLEEPS,
        (true, Waited::WokenEarly) => DEVICE_WAIT_NAPS_WOKEN,
        (true, Waited::SpinHit) => DEVICE_WAIT_SPIN_HITS,
        (true, Waited::SpinMiss) => DEVICE_WAIT_SPIN_MISSES,
    }
}

/// Counts the data of a request as it arrives: a WRITE's bytes.
pub(crate) fn count_request(recorder: &perf::CoreRecorder, req: &Request<'_>) {
    if let Operation::Write { data, .. } = req.op {
        recorder.add_counter(FUSE_WRITE_BYTES, data.len() as u64);
    }
}

/// Counts the data of a reply as it goes out: a successful READ's bytes.
pub(crate) fn count_reply(recorder: &perf::CoreRecorder, op: usize, error: i32, len: usize) {
    if error == 0 && op == Opcode::Read.index() {
        recorder.add_counter(FUSE_READ_BYTES, len as u64);
    }
}

/// Counts device transfers a worker queued: `ios` of `bytes` in all.
pub(crate) fn count_device_io(recorder: &perf::CoreRecorder, write: bool, ios: u64, bytes: u64) {
    if ios == 0 {
        return;
    }
    let (n, b) = if write {
        (DEVICE_WRITES, DEVICE_WRITE_BYTES)
    } else {
        (DEVICE_READS, DEVICE_READ_BYTES)
    };
    recorder.add_counter(n, ios);
    recorder.add_counter(b, bytes);
}

/// Limits and placement of a session.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Transport wanted.
    pub transport: TransportChoice,
    /// One worker per listed CPU, pinned to it.
    pub cpus: Vec<usize>,
    /// Ring entries registered per FUSE queue (each owns a `max_write` payload buffer);
    /// 0 chooses by memory (see [`ring::auto_entries_per_queue`]).
    pub ring_entries_per_queue: usize,
    /// Ring transport: a worker with more requests than this in service moves its queue to
    /// a quiet worker, or passes single entries to a less busy one (see `ring::Peers`); 0
    /// never does either.
    pub ring_share_above: usize,
    /// Reads kept outstanding per `/dev/fuse` worker.
    pub devfuse_reads_per_core: usize,
    /// How long a worker with device I/O in flight spins for its completion before
    /// sleeping, and how early it wakes from a nap through a long transfer (see
    /// [`uring::SpinPolicy`]); zero never spins.
    pub device_spin: std::time::Duration,
    /// Ring transport: how long a worker that has just served requests from another CPU's
    /// queue, and has nothing else to do, spins for the next one before sleeping (see
    /// `ring::linger_budget`); zero never lingers.
    pub ring_linger: std::time::Duration,
}

/// The transport serving a mount, as reported by `etcfs stats`.
#[derive(Debug, Clone)]
pub struct TransportInfo {
    /// `uring` or `devfuse`.
    pub kind: &'static str,
    /// Why this transport was chosen when it was not the one asked for.
    pub note: Option<String>,
}

impl std::fmt::Display for TransportInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.note {
            Some(n) => write!(f, "{} ({n})", self.kind),
            None => f.write_str(self.kind),
        }
    }
}

/// Why a session could not start.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("reading FUSE_INIT from the kernel failed: {0}")]
    InitRead(io::Error),
    #[error("the kernel's first message was not a valid FUSE_INIT: {0}")]
    InitDecode(String),
    #[error("FUSE_INIT negotiation failed: {0}")]
    Negotiate(String),
    #[error("writing the FUSE_INIT reply failed: {0}")]
    InitWrite(io::Error),
    #[error(
        "the kernel does not offer FUSE-over-io_uring (needs Linux 6.14+ with \
         /sys/module/fuse/parameters/enable_uring=Y); use --transport auto or devfuse"
    )]
    UringUnavailable,
    #[error("starting worker threads failed: {0}")]
    Spawn(io::Error),
}

/// Everything a worker needs, shared by all workers of a session.
pub(crate) struct Shared {
    pub(crate) mount: Arc<Mount>,
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) perf: Arc<perf::Registry>,
    pub(crate) negotiated: Negotiated,
    pub(crate) stop: AtomicBool,
    /// See [`SessionConfig::device_spin`].
    pub(crate) device_spin: std::time::Duration,
    /// See [`SessionConfig::ring_linger`].
    pub(crate) ring_linger: std::time::Duration,
    notify_gate: Arc<NotifyGate>,
}

/// A running session: its workers serve until the filesystem is unmounted or [`stop`] is
/// called.
///
/// [`stop`]: Session::stop
pub struct Session {
    shared: Arc<Shared>,
    info: TransportInfo,
    threads: Vec<JoinHandle<()>>,
    sideband: Option<JoinHandle<()>>,
    wakers: Arc<Mutex<Vec<Waker>>>,
}

impl Session {
    /// Reads FUSE_INIT from the freshly mounted connection, negotiates, picks the transport and
    /// starts the workers. `perf` must have one core slot per CPU in `cfg.cpus` plus one for
    /// the sideband reader (the last slot), and [`COUNTERS`] as its first counter names.
    pub fn start(
        mount: Arc<Mount>,
        handler: Arc<dyn Handler>,
        perf: Arc<perf::Registry>,
        cfg: &SessionConfig,
        uring_possible: bool,
    ) -> Result<Session, SessionError> {
        assert!(
            !cfg.cpus.is_empty(),
            "a session needs at least one worker CPU"
        );
        let mut buf = vec![0u8; 64 << 10];
        let n = loop {
            // SAFETY: reads into a live, writable buffer of the length passed.
            let n = unsafe { libc::read(mount.fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(SessionError::InitRead(e));
            }
        };
        let req =
            request::decode(&buf[..n]).map_err(|e| SessionError::InitDecode(e.to_string()))?;
        let Operation::Init(ref kernel_init) = req.op else {
            return Err(SessionError::InitDecode(format!(
                "got opcode {}",
                req.header.opcode
            )));
        };
        let offered = init::kernel_offers_uring(kernel_init);
        let use_ring = match cfg.transport {
            TransportChoice::Devfuse => false,
            TransportChoice::Uring if !offered => return Err(SessionError::UringUnavailable),
            TransportChoice::Uring => true,
            TransportChoice::Auto => offered && uring_possible,
        };
        let (max_write, max_pages) = if use_ring {
            (RING_MAX_WRITE, RING_MAX_PAGES)
        } else {
            let pages = u16::try_from(DEVFUSE_MAX_WRITE / 4096).expect("at most 256 pages");
            (DEVFUSE_MAX_WRITE, pages)
        };
        let init_cfg = InitConfig {
            max_write,
            max_pages,
            over_io_uring: use_ring,
            splice_write: true,
            locks: handler.serves_locks(),
            acls: handler.serves_acls(),
            ..InitConfig::default()
        };
        let (init_out, negotiated) = init::negotiate(kernel_init, &init_cfg)
            .map_err(|e| SessionError::Negotiate(e.to_string()))?;
        let mut reply = Vec::with_capacity(OUT_HEADER_LEN + 64);
        let init_out = init_out.as_bytes();
        reply.extend_from_slice(&out_header(req.header.unique, 0, init_out.len()));
        reply.extend_from_slice(init_out);
        mount
            .write_message(&reply)
            .map_err(SessionError::InitWrite)?;
        handler.init(&negotiated);
        log::info!(
            "FUSE {}.{} negotiated: max_write {} KiB, flags {:#x}",
            negotiated.major,
            negotiated.minor,
            negotiated.max_write >> 10,
            negotiated.flags
        );

        let shared = Arc::new(Shared {
            mount,
            handler,
            perf,
            negotiated,
            stop: AtomicBool::new(false),
            device_spin: cfg.device_spin,
            ring_linger: cfg.ring_linger,
            notify_gate: Arc::default(),
        });
        shared.handler.notifier_ready(Notifier {
            mount: shared.mount.clone(),
            gate: shared.notify_gate.clone(),
        });
        let wakers = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        let mut sideband_thread = None;
        let sideband_core = cfg.cpus.len();
        let mut info = TransportInfo {
            kind: "devfuse",
            note: None,
        };
        if !use_ring && cfg.transport == TransportChoice::Auto {
            info.note = Some(if offered {
                "FUSE-over-io_uring offered but not usable here".to_string()
            } else {
                "kernel does not offer FUSE-over-io_uring".to_string()
            });
        }
        if use_ring {
            // FORGET, INTERRUPT and requests queued before the ring became ready come here.
            let (s, w) = (shared.clone(), wakers.clone());
            sideband_thread = Some(spawn("etcfs-sideband", move || {
                sideband(&s, sideband_core, &w)
            })?);
            match ring::start(&shared, cfg, &wakers) {
                Ok(t) => {
                    threads.extend(t);
                    info.kind = "uring";
                }
                Err((t, why)) => {
                    log::warn!(
                        "FUSE-over-io_uring registration failed, falling back to /dev/fuse: {why}"
                    );
                    stop_and_join(&shared, &wakers, t);
                    shared.stop.store(false, Ordering::SeqCst);
                    info.note = Some(format!("fallback: ring registration failed: {why}"));
                }
            }
        }
        if info.kind == "devfuse" {
            threads.extend(devfuse::start(&shared, cfg, &wakers)?);
        }
        log::info!(
            "serving {} with transport {info}",
            shared.mount.mountpoint().display()
        );
        Ok(Session {
            shared,
            info,
            threads,
            sideband: sideband_thread,
            wakers,
        })
    }

    /// The transport serving the mount.
    pub fn transport(&self) -> &TransportInfo {
        &self.info
    }

    /// Asks every worker to stop after the request it is serving. Unmount first, or requests
    /// issued afterwards find no server (they fail with ENOTCONN once the device closes).
    pub fn stop(&self) {
        self.shared.notify_gate.close_and_drain();
        stop_workers(&self.shared, &self.wakers);
    }

    /// A handle for cache invalidations on this connection.
    pub fn notifier(&self) -> Notifier {
        Notifier {
            mount: self.shared.mount.clone(),
            gate: self.shared.notify_gate.clone(),
        }
    }

    /// A handle to stop the session from another thread (a signal handler thread).
    pub fn stopper(&self) -> Stopper {
        Stopper {
            shared: self.shared.clone(),
            wakers: self.wakers.clone(),
        }
    }

    /// Waits for every worker to finish: after unmount, or after [`Session::stop`]. The
    /// sideband reader blocks in read(2) until the connection ends, so after a stop it is
    /// left to end with the process (closing the device aborts the connection).
    pub fn wait(self) {
        for t in self.threads {
            let _ = t.join();
        }
        if let Some(t) = self.sideband {
            if !self.shared.stop.load(Ordering::SeqCst) {
                let _ = t.join();
            }
        }
        self.shared.handler.destroy();
    }
}

/// Sends cache invalidations to the kernel. Use it from a thread that serves no request and
/// holds no lock a request may wait for (the kernel may hold a directory lock while it waits
/// on our reply to a related request). Each call returns whether the kernel had the thing
/// cached (`false` when it did not: ENOENT from the device).
#[derive(Clone, Debug)]
pub struct Notifier {
    mount: Arc<Mount>,
    gate: Arc<NotifyGate>,
}

/// Closes notifications before the workers stop. A notification about an entry takes the
/// kernel's lock on its directory, which a request waiting for our reply may hold; once no
/// worker is left to answer, such a write would block forever in the kernel, and a process
/// with a thread stuck there never exits nor releases the connection. So shutdown closes
/// the gate and waits for writes already in the kernel while the workers still serve.
#[derive(Debug, Default)]
struct NotifyGate {
    closed: AtomicBool,
    writes_in_flight: std::sync::atomic::AtomicUsize,
}

/// How long shutdown waits for notifications already in the kernel.
const NOTIFY_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

impl NotifyGate {
    /// Refuses new notifications and waits (bounded) for those in the kernel.
    fn close_and_drain(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let start = std::time::Instant::now();
        while self.writes_in_flight.load(Ordering::SeqCst) > 0 {
            if start.elapsed() > NOTIFY_DRAIN_TIMEOUT {
                log::warn!("a cache invalidation is still blocked in the kernel; stopping anyway");
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Notifier {
    /// A notifier for the connection of `mount`.
    pub fn new(mount: Arc<Mount>) -> Self {
        Notifier {
            mount,
            gate: Arc::default(),
        }
    }

    /// Drops the kernel's cached attributes of `ino` and, with `off >= 0`, its cached data
    /// from `off` for `len` bytes (`len == 0`: to the end).
    pub fn inval_inode(&self, ino: u64, off: i64, len: i64) -> io::Result<bool> {
        self.send(&notify::inval_inode(ino, off, len))
    }

    /// Drops the kernel's cached entry (positive or negative) for `name` in `parent`.
    pub fn inval_entry(&self, parent: u64, name: &[u8]) -> io::Result<bool> {
        self.send(&notify::inval_entry(parent, name).map_err(invalid)?)
    }

    /// Makes every dentry the kernel caches for this mount stale at once (protocol 7.44):
    /// each is looked up again on its next use. Takes no inode lock in the kernel, so it
    /// may be sent while a request holds a directory's lock, unlike INVAL_ENTRY.
    pub fn inc_epoch(&self) -> io::Result<bool> {
        self.send(&notify::inc_epoch())
    }

    /// Tells the kernel `name` in `parent`, which was `child`, is gone (drops the entry and
    /// reports the deletion to inotify watchers).
    pub fn delete(&self, parent: u64, child: u64, name: &[u8]) -> io::Result<bool> {
        self.send(&notify::delete(parent, child, name).map_err(invalid)?)
    }

    fn send(&self, msg: &[u8]) -> io::Result<bool> {
        self.gate.writes_in_flight.fetch_add(1, Ordering::SeqCst);
        let result = if self.gate.closed.load(Ordering::SeqCst) {
            Ok(false)
        } else {
            match self.mount.write_message(msg) {
                Ok(()) => Ok(true),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
                Err(e) => Err(e),
            }
        };
        self.gate.writes_in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }
}

fn invalid(e: notify::NotifyError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e)
}

/// Stops a session from another thread.
#[derive(Clone)]
pub struct Stopper {
    shared: Arc<Shared>,
    wakers: Arc<Mutex<Vec<Waker>>>,
}

impl Stopper {
    /// Closes notifications, unmounts (lazily when busy) and stops the workers.
    pub fn shutdown(&self) {
        self.shared.notify_gate.close_and_drain();
        match self.shared.mount.unmount() {
            Ok(true) => log::info!("unmounted {}", self.shared.mount.mountpoint().display()),
            Ok(false) => {}
            Err(e) => log::warn!("unmount failed: {e}"),
        }
        stop_workers(&self.shared, &self.wakers);
    }
}

/// Asks every worker to stop, and wakes them to see it.
fn stop_workers(shared: &Shared, wakers: &Mutex<Vec<Waker>>) {
    shared.stop.store(true, Ordering::SeqCst);
    for w in wakers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        w.wake();
    }
}

/// Stops and joins `threads`, and forgets their wakers (the workers that replace them
/// register their own).
fn stop_and_join(shared: &Shared, wakers: &Mutex<Vec<Waker>>, threads: Vec<JoinHandle<()>>) {
    stop_workers(shared, wakers);
    wakers.lock().unwrap_or_else(|e| e.into_inner()).clear();
    for t in threads {
        let _ = t.join();
    }
}

pub(crate) fn spawn(
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> Result<JoinHandle<()>, SessionError> {
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(f)
        .map_err(SessionError::Spawn)
}

/// Device I/O of a READ or WRITE reply in flight, in either transport.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IoProgress {
    outstanding: u32,
    /// Segments queued in all (for the counters).
    queued: u32,
    /// The first failure, as a negative errno (0: none).
    error: i32,
    got: usize,
    want: usize,
    /// A READ: where the reply's data starts in what was read, and how long it is.
    skip: usize,
    len: usize,
    /// A file-backed reply (`Reply::Fd`): a short read is EOF, not an error.
    short_is_eof: bool,
    /// A WRITE: the size its reply reports once every segment is written.
    written: Option<u32>,
    /// When the first segment went to the device.
    pub(crate) issued: Instant,
}

/// What a finished [`IoProgress`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IoOutcome {
    /// Reply with this negative errno.
    Failed(i32),
    /// A READ: the reply is `len` bytes starting `skip` bytes into what was read.
    Read { skip: usize, len: usize },
    /// A WRITE: reply that this many bytes were written.
    Written(u32),
}

impl IoProgress {
    pub(crate) fn read(plan: &ReadPlan, short_is_eof: bool) -> Self {
        IoProgress {
            skip: plan.skip,
            len: plan.len,
            short_is_eof,
            ..Self::new(None)
        }
    }

    pub(crate) fn write(written: u32) -> Self {
        Self::new(Some(written))
    }

    fn new(written: Option<u32>) -> Self {
        IoProgress {
            outstanding: 0,
            queued: 0,
            error: 0,
            got: 0,
            want: 0,
            skip: 0,
            len: 0,
            short_is_eof: false,
            written,
            issued: Instant::now(),
        }
    }

    /// A segment of `len` bytes went to the device (`queued`) or could not be queued.
    pub(crate) fn segment_queued(&mut self, len: usize, queued: bool) {
        if queued {
            self.outstanding += 1;
            self.queued += 1;
            self.want += len;
        } else {
            self.error = -libc::EIO;
        }
    }

    /// Whether any segment is still at the device.
    pub(crate) fn in_flight(&self) -> bool {
        self.outstanding > 0
    }

    /// Counts what was queued into the worker's counters; once per transfer, when all its
    /// segments are queued.
    pub(crate) fn count(&self, recorder: &perf::CoreRecorder) {
        count_device_io(
            recorder,
            self.written.is_some(),
            u64::from(self.queued),
            self.want as u64,
        );
    }

    /// What is at the device, for the wait policy.
    pub(crate) fn transfer(&self) -> Transfer {
        Transfer {
            bytes: self.want,
            write: self.written.is_some(),
        }
    }

    /// A segment completed with `result` (bytes, or a negative errno).
    pub(crate) fn segment_done(&mut self, result: i32) {
        self.outstanding = self.outstanding.saturating_sub(1);
        if result < 0 {
            self.error = result;
        } else {
            self.got += result as usize;
        }
    }

    /// The reply once nothing is in flight.
    fn outcome(&self) -> IoOutcome {
        if self.error < 0 {
            return IoOutcome::Failed(self.error);
        }
        let direction = if self.written.is_some() {
            "write"
        } else {
            "read"
        };
        if self.got < self.want && !(self.written.is_none() && self.short_is_eof) {
            log::error!(
                "short device {direction}: {} of {} bytes",
                self.got,
                self.want
            );
            return IoOutcome::Failed(-libc::EIO);
        }
        match self.written {
            Some(n) => IoOutcome::Written(n),
            None if self.short_is_eof => IoOutcome::Read {
                skip: self.skip,
                len: self.got.min(self.len),
            },
            None => IoOutcome::Read {
                skip: self.skip,
                len: self.len,
            },
        }
    }

    /// Lays out the reply once nothing is in flight, in `args` (the buffer the device reads
    /// went into, where the reply's arguments go): returns its error (negative errno, or 0)
    /// and its arguments' length.
    pub(crate) fn finish(&self, args: &mut [u8]) -> (i32, usize) {
        match self.outcome() {
            IoOutcome::Failed(err) => (err, 0),
            IoOutcome::Written(written) => match reply::write(args, written) {
                Some(n) => (0, n),
                None => (-libc::EIO, 0),
            },
            IoOutcome::Read { skip, len } => {
                if skip > 0 {
                    args.copy_within(skip..skip + len, 0);
                }
                (0, len)
            }
        }
    }
}

/// Replies a worker queues from one batch of completions before handing them to the kernel
/// mid-batch (after the first, then every this many).
const EARLY_SUBMIT_EVERY: usize = 8;

/// Whether a worker that has handled `handled` of a batch of `batch` completions submits
/// what it queued so far rather than at the end of the batch. A device completes requests
/// in bursts (32 at once at queue depth 32 on this VM), and the client waits for its first
/// reply, which the end of the batch would hold back by the whole batch's work (about
/// 35 µs); meanwhile the device idles. Early submissions cost one system call each, so
/// never for the last completion of a batch, whose replies go with the wait.
pub(crate) fn submit_early(handled: usize, batch: usize) -> bool {
    handled < batch && (handled == 1 || handled.is_multiple_of(EARLY_SUBMIT_EVERY))
}

/// Pins a worker thread to `cpu` and, when it will nap through device transfers, sets its
/// timer slack to 1 ns: the default lets the kernel fire a nap's timer up to 50 µs late
/// (nanosleep overshot by 80 µs on this VM with it, 14–40 µs without).
pub(crate) fn settle_worker_thread(shared: &Shared, who: &str, cpu: usize) {
    if let Err(e) = uring::cpu::pin_current_thread(cpu) {
        log::warn!("{who}: cannot pin to CPU {cpu}: {e}");
    }
    if !shared.device_spin.is_zero() {
        if let Err(e) = uring::cpu::set_timer_slack(Duration::from_nanos(1)) {
            log::warn!("{who}: cannot set timer slack: {e}");
        }
    }
}

/// How a worker waits for its next completion, given the device I/O it has in flight: the
/// first is due when the transfer issued earliest, by its size's expected latency, ends.
pub(crate) fn device_wait_plan<'a>(
    spin: &mut SpinPolicy,
    in_flight: impl Iterator<Item = &'a IoProgress>,
) -> WaitPlan {
    let first = in_flight
        .map(|io| (io.issued + spin.expected(io.transfer()), io.transfer()))
        .min_by_key(|&(due, _)| due)
        .map(|(due, transfer)| (due.saturating_duration_since(Instant::now()), transfer));
    spin.plan(first)
}

/// `fuse_out_header` bytes.
pub(crate) fn out_header(unique: u64, error: i32, args_len: usize) -> [u8; OUT_HEADER_LEN] {
    let mut h = [0u8; OUT_HEADER_LEN];
    let len = u32::try_from(OUT_HEADER_LEN + args_len).expect("replies are far below 4 GiB");
    h[0..4].copy_from_slice(&len.to_ne_bytes());
    h[4..8].copy_from_slice(&error.to_ne_bytes());
    h[8..16].copy_from_slice(&unique.to_ne_bytes());
    h
}

/// Dense index of an opcode for statistics.
pub(crate) fn op_index(opcode: u32) -> usize {
    Opcode::try_from(opcode)
        .map(|o| o.index())
        .unwrap_or(Opcode::UNKNOWN_INDEX)
}

/// Runs the handler, turning a panic into EIO so the request still gets its one reply.
pub(crate) fn dispatch(
    handler: &dyn Handler,
    ctx: &RequestCtx<'_>,
    req: &Request<'_>,
    out: &mut [u8],
) -> Reply {
    match catch_unwind(AssertUnwindSafe(|| handler.handle(ctx, req, out))) {
        Ok(Reply::Bytes(n)) if n > out.len() => {
            log::error!("handler replied {n} bytes into a {}-byte buffer", out.len());
            Reply::Error(Errno::EIO)
        }
        Ok(Reply::Read(plan)) if !plan_fits(&plan, out.len()) => {
            log::error!(
                "handler's read plan {plan:?} does not fit {} bytes",
                out.len()
            );
            Reply::Error(Errno::EIO)
        }
        Ok(Reply::Write(plan)) if !ctx.io_plans() || !write_plan_fits(req, &plan) => {
            log::error!("handler's write plan {plan:?} does not fit the request");
            Reply::Error(Errno::EIO)
        }
        Ok(Reply::Deferred) if !ctx.was_deferred() => {
            log::error!(
                "handler deferred opcode {} without taking the reply",
                req.header.opcode
            );
            Reply::Error(Errno::EIO)
        }
        Ok(r) => r,
        Err(_) => {
            log::error!(
                "handler panicked on opcode {} (unique {})",
                req.header.opcode,
                req.header.unique
            );
            Reply::Error(Errno::EIO)
        }
    }
}

/// What a transport keeps until a write plan's device writes are over: the handler's hold
/// and the image the writes read from.
pub(crate) fn keep_until_written(
    hold: Option<crate::server::Hold>,
    image: Option<uring::AlignedBuf>,
) -> Option<crate::server::Hold> {
    match image {
        Some(img) => Some(crate::server::Hold::new((hold, img))),
        None => hold,
    }
}

fn write_plan_fits(req: &Request<'_>, plan: &WritePlan) -> bool {
    match req.op {
        Operation::Write { data, .. } => plan.fits(data.len()),
        _ => false,
    }
}

/// Whether a read plan stays inside an out buffer of `cap` bytes.
pub(crate) fn plan_fits(plan: &ReadPlan, cap: usize) -> bool {
    let total = plan.total();
    total <= cap
        && plan
            .skip
            .checked_add(plan.len)
            .is_some_and(|end| end <= total)
}

/// Runs a read plan with blocking reads (the sideband path, which has no ring). Returns the
/// reply length, with the data moved to the start of `out`.
pub(crate) fn read_plan_blocking(plan: &ReadPlan, out: &mut [u8]) -> Result<usize, i32> {
    if !plan_fits(plan, out.len()) {
        return Err(libc::EIO);
    }
    let mut pos = 0;
    for seg in &plan.segments {
        match *seg {
            Segment::Zero { len } => out[pos..pos + len].fill(0),
            Segment::Device { fd, offset, len } => {
                match pread_full(fd, &mut out[pos..pos + len], offset) {
                    Ok(n) if n == len => {}
                    Ok(_) => return Err(libc::EIO),
                    Err(e) => return Err(e.raw_os_error().unwrap_or(libc::EIO)),
                }
            }
        }
        pos += seg.len();
    }
    out.copy_within(plan.skip..plan.skip + plan.len, 0);
    Ok(plan.len)
}

/// Reads `len` bytes of `fd` at `offset` into `buf`, retrying short reads until EOF.
pub(crate) fn pread_full(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        let off = libc::off_t::try_from(offset + done as u64)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: reads at most rest.len() bytes into a live, writable slice.
        let n = unsafe { libc::pread(fd, rest.as_mut_ptr().cast(), rest.len(), off) };
        match n {
            0 => break,
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Err(e);
                }
            }
        }
    }
    Ok(done)
}

/// The blocking reader of the connection's original `/dev/fuse` descriptor, used beside the
/// ring: the kernel keeps FORGET, BATCH_FORGET and INTERRUPT on the classic queue, and any
/// request allocated before the ring became ready is read here too.
///
/// When the connection ends (unmounted, or aborted through
/// `/sys/fs/fuse/connections/N/abort`) it stops the ring workers too. They would end
/// anyway once every entry has, but an entry whose reply never comes (a handler that
/// loses a deferred reply) would otherwise keep the daemon, its cluster locks and its
/// lease alive with no mount to serve.
fn sideband(shared: &Shared, core: usize, wakers: &Mutex<Vec<Waker>>) {
    let recorder = shared.perf.core(core);
    let size = shared.negotiated.max_write as usize + REQUEST_HEADER_ROOM;
    let mut inbuf = vec![0u8; size];
    let mut out = vec![0u8; OUT_HEADER_LEN + size];
    let fd = shared.mount.fd();
    loop {
        // SAFETY: reads into a live, writable buffer of the length passed.
        let n = unsafe { libc::read(fd, inbuf.as_mut_ptr().cast(), inbuf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                Some(libc::ENODEV) => {}
                Some(libc::ECONNABORTED) => {
                    log::warn!("the FUSE connection was aborted: stopping the workers")
                }
                _ => {
                    // Not the connection's end: the ring workers serve on.
                    log::warn!("sideband read: {e}");
                    break;
                }
            }
            stop_workers(shared, wakers);
            break;
        }
        let msg = &inbuf[..n as usize];
        let req = match request::decode(msg) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("undecodable request on /dev/fuse: {e}");
                if let Some(unique) = request::peek_unique(msg) {
                    let h = out_header(unique, -libc::EIO, 0);
                    let _ = shared.mount.write_message(&h);
                }
                continue;
            }
        };
        let op = op_index(req.header.opcode);
        recorder.count(op);
        count_request(&recorder, &req);
        let t = recorder.timer();
        let (head, args) = out.split_at_mut(OUT_HEADER_LEN);
        let ctx = RequestCtx::new(core);
        let reply = dispatch(shared.handler.as_ref(), &ctx, &req, args);
        let (error, len) = match reply {
            Reply::None => continue,
            Reply::Deferred => (-libc::EIO, 0),
            Reply::Read(plan) => {
                let device: Vec<usize> = plan
                    .segments
                    .iter()
                    .filter_map(|s| match *s {
                        Segment::Device { len, .. } => Some(len),
                        Segment::Zero { .. } => None,
                    })
                    .collect();
                let bytes = device.iter().sum::<usize>() as u64;
                count_device_io(&recorder, false, device.len() as u64, bytes);
                match read_plan_blocking(&plan, args) {
                    Ok(n) => (0, n),
                    Err(e) => (-e, 0),
                }
            }
            Reply::Bytes(n) => (0, n),
            Reply::Error(e) => (-e.raw(), 0),
            // `dispatch` refuses write plans where the context cannot run them.
            Reply::Write(_) => (-libc::EIO, 0),
            Reply::Fd { fd, offset, len } => {
                let len = len.min(args.len());
                count_device_io(&recorder, false, 1, len as u64);
                match pread_full(fd, &mut args[..len], offset) {
                    Ok(n) => (0, n),
                    Err(e) => (-e.raw_os_error().unwrap_or(libc::EIO), 0),
                }
            }
        };
        count_reply(&recorder, op, error, len);
        head.copy_from_slice(&out_header(req.header.unique, error, len));
        if let Err(e) = shared.mount.write_message(&out[..OUT_HEADER_LEN + len]) {
            if e.raw_os_error() == Some(libc::ENODEV) {
                break;
            }
        }
        recorder.record_since(op, perf::Stage::Total, &t);
    }
}

/// Collects worker start reports: every worker says once whether it is serving.
pub(crate) fn collect_starts(
    rx: mpsc::Receiver<Result<(), String>>,
    workers: usize,
) -> Result<(), String> {
    let mut first_err = None;
    for _ in 0..workers {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert_with(|| "a worker did not report within 10 s".into());
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(skip: usize, len: usize) -> ReadPlan {
        ReadPlan {
            segments: Vec::new(),
            skip,
            len,
            hold: None,
        }
    }

    #[test]
    fn replies_go_early_after_the_first_and_every_eighth_but_never_at_the_end() {
        let early = |batch: usize| -> Vec<usize> {
            (1..=batch).filter(|&h| submit_early(h, batch)).collect()
        };
        assert_eq!(
            early(1),
            Vec::<usize>::new(),
            "queue depth 1: one system call"
        );
        assert_eq!(early(2), vec![1]);
        assert_eq!(early(8), vec![1]);
        assert_eq!(early(32), vec![1, 8, 16, 24]);
        assert_eq!(early(0), Vec::<usize>::new());
    }

    #[test]
    fn io_progress_answers_only_for_complete_transfers() {
        let mut read = IoProgress::read(&plan(512, 4096), false);
        read.segment_queued(4096, true);
        read.segment_queued(4096, true);
        assert!(read.in_flight());
        read.segment_done(4096);
        assert!(read.in_flight());
        read.segment_done(4096);
        assert!(!read.in_flight());
        assert_eq!(
            read.outcome(),
            IoOutcome::Read {
                skip: 512,
                len: 4096
            }
        );
        assert_eq!(
            read.transfer(),
            Transfer {
                bytes: 8192,
                write: false
            }
        );

        let mut short = IoProgress::read(&plan(0, 4096), false);
        short.segment_queued(4096, true);
        short.segment_done(100);
        assert_eq!(short.outcome(), IoOutcome::Failed(-libc::EIO));

        let mut eof = IoProgress::read(&plan(0, 4096), true);
        eof.segment_queued(4096, true);
        eof.segment_done(100);
        assert_eq!(eof.outcome(), IoOutcome::Read { skip: 0, len: 100 });

        let mut write = IoProgress::write(8192);
        write.segment_queued(4096, true);
        write.segment_queued(4096, false);
        write.segment_done(4096);
        assert_eq!(
            write.outcome(),
            IoOutcome::Failed(-libc::EIO),
            "one never queued"
        );
        assert!(write.transfer().write);

        let mut failed = IoProgress::write(4096);
        failed.segment_queued(4096, true);
        failed.segment_done(-libc::ENOSPC);
        assert_eq!(failed.outcome(), IoOutcome::Failed(-libc::ENOSPC));

        let mut torn = IoProgress::write(8192);
        torn.segment_queued(8192, true);
        torn.segment_done(4096);
        assert_eq!(torn.outcome(), IoOutcome::Failed(-libc::EIO));

        let mut whole = IoProgress::write(8192);
        whole.segment_queued(8192, true);
        whole.segment_done(8192);
        assert_eq!(whole.outcome(), IoOutcome::Written(8192));
    }

    #[test]
    fn io_progress_lays_out_the_reply_where_the_data_was_read() {
        let mut read = IoProgress::read(&plan(2, 3), false);
        read.segment_queued(8, true);
        read.segment_done(8);
        let mut args = *b"..abc...";
        assert_eq!(read.finish(&mut args), (0, 3));
        assert_eq!(&args[..3], b"abc");

        let mut write = IoProgress::write(4096);
        write.segment_queued(4096, true);
        write.segment_done(4096);
        let mut args = [0u8; 64];
        let (err, len) = write.finish(&mut args);
        assert_eq!(err, 0);
        assert!(len > 0);
        assert_eq!(&args[..4], &4096u32.to_ne_bytes(), "fuse_write_out.size");

        let mut failed = IoProgress::write(4096);
        failed.segment_queued(4096, false);
        assert_eq!(failed.finish(&mut args), (-libc::EIO, 0));
    }
}
