//! FUSE-over-io_uring: the kernel writes each request into a buffer pair we registered on a
//! per-CPU queue, and one `URING_CMD` (COMMIT_AND_FETCH) both sends the reply and re-arms
//! the entry for the next request.
//!
//! Layout of the 288-byte header buffer (kernel ABI): `in_out` (the in header on delivery,
//! the out header on reply) at 0..128, the opcode's first argument at 128..256, and the
//! entry's `{flags, commit_id, payload_sz}` at 256..288. Everything else of the request
//! (names, WRITE data) is in the payload buffer, and the reply's arguments go there too.

use std::{
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc, Arc, Condvar, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use io_uring::squeue::Entry128;
use uring::{
    cpu, AlignedBuf, ArenaHold, HugeArena, Ring, RingConfig, SpinPolicy, WaitPlan, Waited, Waker,
};

use crossbeam_channel::{Receiver, Sender};

use super::{
    collect_starts, count_reply, device_wait_plan, dispatch, op_index, out_header, plan_fits,
    settle_worker_thread, spawn, submit_early, wait_counter, IoProgress, SessionConfig, Shared,
    REQUEST_HEADER_ROOM, RING_ENTRIES_PASSED, RING_ENTRIES_RETURNED, RING_LINGER_HITS,
    RING_LINGER_MISSES, RING_WRITE_PIECES_SPREAD,
};
use crate::{
    errno::Errno,
    request,
    server::{
        DeferredCompletion, DeferredOutcome, Hold, ReadPlan, Reply, RequestCtx, Segment, WritePlan,
    },
};

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
const HEADER_LEN: usize = 288;
const OP_IN_OFFSET: usize = 128;
const ENT_OFFSET: usize = 256;
const IN_HEADER_LEN: usize = 40;

/// `user_data` tags: the low 32 bits are the entry index.
const TAG_CMD: u64 = 0;
const TAG_DATA_IO: u64 = 1 << 32;
const TAG_WAKE: u64 = 2 << 32;
const TAG_MASK: u64 = 0xffff_ffff << 32;

/// What an entry is doing.
#[derive(Debug, Clone, Copy)]
enum EntryState {
    /// Registered or committed: parked in the kernel, waiting for a request.
    InKernel,
    /// The handler deferred the reply; it arrives on the worker's completion channel.
    Deferred(Pending),
    /// A READ reply's data is being read into the payload, or a WRITE's data written from it.
    DeviceIo(Pending, IoProgress),
    /// The kernel ended the entry (unmount): it will not be used again.
    Dead,
    /// An empty slot: its entry went to another worker (see `Peers`).
    Away,
}

/// A request whose reply is not sent yet.
#[derive(Debug, Clone, Copy)]
struct Pending {
    unique: u64,
    op: usize,
    started: perf::Timer,
    piece: Piece,
}

/// A WRITE of at least this many bytes counts as a piece of a large write. Small WRITEs,
/// however many arrive together (4 KiB ones at queue depth 32), are left to the load rules:
/// their copies are short, and spreading them would move entries at every batch.
const SPREAD_PIECE_MIN: usize = 256 << 10;

/// Where a large WRITE's entry goes at its commit. The kernel sends a direct-I/O write
/// larger than `max_write` as pieces, all at once, to its CPU's queue, where each takes the
/// most recently committed entry; it copies each piece's data into its entry in the thread
/// of the worker the entry is committed through. Pieces that reach one worker are copied
/// one after the other; pieces on entries of different workers, in parallel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Piece {
    /// Not a large WRITE: the load rules of [`Peers::handoff_target`] decide.
    No,
    /// Stays with this worker, whichever CPU's queue the entry belongs to, so that the
    /// pieces of later writes keep arriving at different workers.
    Keep,
    /// A further large WRITE this worker took in the same batch as another: its entry goes
    /// to another worker, which then copies one of the next write's pieces beside this one.
    Spread,
}

impl Piece {
    /// The role of a request that is the `large_nth` large WRITE (from 1) of its worker's
    /// batch, or 0 if it is not one: every second one spreads.
    fn of(large_nth: usize) -> Piece {
        match large_nth {
            0 => Piece::No,
            n if n % 2 == 1 => Piece::Keep,
            _ => Piece::Spread,
        }
    }
}

/// One registered entry: the kernel keeps the addresses of `header` and `payload` from
/// REGISTER until the connection ends, so they live (and never move) as long as the entry.
struct Entry {
    qid: u16,
    header: AlignedBuf,
    payload: AlignedBuf,
    iov: Box<[libc::iovec; 2]>,
    state: EntryState,
}

// SAFETY: the iovecs point into the entry's own header and payload, which move with it (and
// whose addresses never change); an entry is used by one worker at a time, the one it was
// handed to (see `Peers`).
unsafe impl Send for Entry {}

impl Entry {
    /// A slot whose entry went to another worker.
    fn vacant() -> Entry {
        Entry {
            qid: 0,
            header: AlignedBuf::empty(),
            payload: AlignedBuf::empty(),
            iov: Box::new(
                [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; 2],
            ),
            state: EntryState::Away,
        }
    }
}

/// One worker's load on a cache line of its own, so that its updates on every request do
/// not invalidate the line the other workers' counters sit on.
#[repr(align(128))]
#[derive(Default)]
struct LoadSlot {
    /// Requests in service.
    in_service: AtomicUsize,
    /// When (see [`Peers::now`], in ns; 0 never) one of its commits for a queue it serves
    /// (not overflow) last found more than [`Peers::quiet_load`] in service, or a queue
    /// moved to it.
    busy_at: AtomicU64,
}

impl std::ops::Deref for LoadSlot {
    type Target = AtomicUsize;
    fn deref(&self) -> &AtomicUsize {
        &self.in_service
    }
}

/// What the workers of a session share to pass entries between them.
///
/// The kernel queues a request on the queue of the CPU it was made on, and hands it to an
/// entry registered on that queue; the ring that last committed the entry gets it. So a
/// process doing all its I/O from one CPU shares that CPU with the worker of its queue: at
/// queue depth 32 the two take turns, the worker's replies wait while the process sends,
/// its device reads wait while it replies, and the device runs half empty while the other
/// CPU idles. A worker with more than `share_above` requests in service therefore moves
/// its queue to a quiet worker: one with at most half the mark in service now, and no more
/// than [`Peers::quiet_load`] at any commit for a queue it serves for
/// [`QUEUE_RETURN_QUIET`]. Every entry of the queue is then committed through that worker,
/// which serves the requests those entries get until it has been quiet in the same sense
/// again, or its own queue goes above the mark. The queue moves whole and comes back only
/// after a quiet spell because a process at depth 32 has between a handful and all of its
/// requests in service within one burst of device completions: entries moved one by one
/// at such a mark bounced at every burst. Beside that, a worker serving a queue with more than the
/// mark in service passes single entries to a less busy worker, which gives them back once
/// the first is down to half the mark; with a moved queue that brings the process's own
/// CPU in to help. At low load every entry is at home, so a request is served on the CPU
/// that made it and its reply wakes the process without an interprocessor interrupt. This
/// relies on the kernel handing an entry's next request to the ring that committed it,
/// whichever ring registered it.
///
/// Large writes are the exception (see [`Piece`]): their pieces are spread over the
/// workers whatever the load, because the kernel's copy of their data, not the device,
/// is what one worker cannot overlap.
struct Peers {
    /// Per worker: where to send it entries, and how to wake it.
    handoff: Vec<(Sender<Entry>, Waker)>,
    /// Per worker: requests it holds in service (taken from the kernel, not yet committed).
    /// Only that worker writes its slot; the others read it at commits.
    load: Vec<LoadSlot>,
    /// Entries registered by all workers: as many as any one worker may come to hold.
    entries: usize,
    /// Entries not ended by the kernel, wherever they are; the session ends at zero.
    live: AtomicUsize,
    /// The worker that registered each queue (indexed by queue id).
    home: Vec<usize>,
    /// Per queue id: the worker it moved to, or [`AT_HOME`].
    moved_to: Vec<AtomicUsize>,
    /// What [`LoadSlot::busy_at`] counts from.
    epoch: Instant,
    /// 0 never moves a queue.
    share_above: usize,
    /// The workers' payload arenas, for every ring to register.
    arenas: ArenaExchange,
}

/// Where the workers leave a hold on their payload arenas as they start, and collect the
/// others' before registering buffers with their rings.
struct ArenaExchange {
    /// Workers that have published, and the holds published so far.
    published: Mutex<(usize, Vec<ArenaHold>)>,
    all_in: Condvar,
    workers: usize,
}

/// How long a starting worker waits for the others' arenas: they are mapped as the threads
/// start, so only a worker that failed to start is ever waited for this long (the session
/// then fails anyway).
const ARENA_EXCHANGE_WAIT: Duration = Duration::from_secs(5);

impl ArenaExchange {
    fn new(workers: usize) -> ArenaExchange {
        ArenaExchange {
            published: Mutex::new((0, Vec::with_capacity(workers))),
            all_in: Condvar::new(),
            workers,
        }
    }

    /// Publishes this worker's arena (none if it has none) and returns every arena
    /// published once all workers have, or [`ARENA_EXCHANGE_WAIT`] has passed.
    fn exchange(&self, mine: Option<ArenaHold>) -> Vec<ArenaHold> {
        let mut p = self.published.lock().unwrap_or_else(|e| e.into_inner());
        p.0 += 1;
        p.1.extend(mine);
        self.all_in.notify_all();
        let (p, _) = self
            .all_in
            .wait_timeout_while(p, ARENA_EXCHANGE_WAIT, |p| p.0 < self.workers)
            .unwrap_or_else(|e| e.into_inner());
        p.1.clone()
    }
}

/// `Peers::moved_to` of a queue served by its own worker.
const AT_HOME: usize = usize::MAX;
/// How long a moved queue must stay quiet at the worker serving it before it goes home: a
/// few bursts of a process at depth 32 (each under a millisecond), so that the pauses
/// between bursts do not bring it back.
const QUEUE_RETURN_QUIET: Duration = Duration::from_millis(5);

impl Peers {
    fn new(
        handoff: Vec<(Sender<Entry>, Waker)>,
        home: Vec<usize>,
        entries: usize,
        share_above: usize,
    ) -> Peers {
        let handoff_len = handoff.len();
        Peers {
            load: (0..handoff_len).map(|_| LoadSlot::default()).collect(),
            handoff,
            entries,
            live: AtomicUsize::new(entries),
            moved_to: (0..home.len()).map(|_| AtomicUsize::new(AT_HOME)).collect(),
            arenas: ArenaExchange::new(handoff_len),
            home,
            epoch: Instant::now(),
            share_above,
        }
    }

    /// Time since the session's start, for [`Peers::handoff_target`].
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Requests in service at or below which a moved queue's worker counts as quiet. At
    /// least one: the count includes the request being answered.
    fn quiet_load(&self) -> usize {
        (self.share_above / 4).max(1)
    }

    /// Whether worker `w` has been quiet (see [`Peers::quiet_load`]) for
    /// [`QUEUE_RETURN_QUIET`] at `now`.
    fn quiet_for_a_while(&self, w: usize, now: Duration) -> bool {
        let busy_at = self.load[w].busy_at.load(Ordering::Relaxed);
        busy_at == 0 || now.saturating_sub(Duration::from_nanos(busy_at)) >= QUEUE_RETURN_QUIET
    }

    /// Where the entry of queue `qid` that worker `me` is committing at `now` should go, if
    /// not to `me`.
    fn handoff_target(&self, me: usize, qid: u16, now: Duration) -> Option<usize> {
        if self.share_above == 0 || self.load.len() < 2 {
            return None;
        }
        let q = usize::from(qid);
        let (Some(&home), Some(moved_to)) = (self.home.get(q), self.moved_to.get(q)) else {
            return None;
        };
        let load = |w: usize| self.load[w].load(Ordering::Relaxed);
        let now_ns = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX).max(1);
        let serving = match moved_to.load(Ordering::Relaxed) {
            AT_HOME => home,
            w => w,
        };
        if me != serving {
            // Overflow, or left behind by a move: back once the serving worker is well below
            // the mark, or entries would bounce at every commit.
            return (load(serving) <= self.share_above / 2).then_some(serving);
        }
        // Busy with a queue it serves; overflow it takes in does not count, or a worker
        // helping a busy queue could never take it over.
        let mine = load(me);
        if mine > self.quiet_load() {
            self.load[me].busy_at.store(now_ns, Ordering::Relaxed);
        } else if serving != home && self.quiet_for_a_while(me, now) {
            moved_to.store(AT_HOME, Ordering::Relaxed);
            return Some(home);
        }
        if mine <= self.share_above {
            return None;
        }
        if serving == home {
            // Its own queue is busy: queues that moved here go back home, so that two busy
            // queues are each served on their own CPU.
            for (guest, to) in self.moved_to.iter().enumerate() {
                if guest != q && to.load(Ordering::Relaxed) == me {
                    to.store(AT_HOME, Ordering::Relaxed);
                }
            }
        }
        let (other, theirs) = (0..self.load.len())
            .filter(|&w| w != me)
            .map(|w| (w, load(w)))
            .min_by_key(|&(_, l)| l)?;
        // Only to a worker that has been quiet for a while, not one whose own queue is busy
        // in bursts: two busy queues would otherwise swap CPUs and stay swapped.
        if serving == home && theirs <= self.share_above / 2 && self.quiet_for_a_while(other, now) {
            // Its quiet spell starts again now, or the queue could come straight back.
            self.load[other].busy_at.store(now_ns, Ordering::Relaxed);
            moved_to.store(other, Ordering::Relaxed);
            return Some(other);
        }
        // Overflow: this entry alone goes to a less busy worker, and comes back.
        (theirs + 1 < mine).then_some(other)
    }

    /// The worker a spread write piece's entry goes to: the least busy other one.
    fn spread_target(&self, me: usize) -> Option<usize> {
        if self.share_above == 0 {
            return None;
        }
        (0..self.load.len())
            .filter(|&w| w != me)
            .min_by_key(|&w| self.load[w].load(Ordering::Relaxed))
    }
}

/// Memory the payload buffers of all queues may take when the entry count is chosen
/// automatically.
const AUTO_PAYLOAD_BUDGET: usize = 256 << 20;
/// Entries per queue chosen automatically: enough for one process at queue depth 32 ...
const AUTO_ENTRIES_MAX: usize = 32;
/// ... and never fewer than this, whatever the memory.
const AUTO_ENTRIES_MIN: usize = 8;

/// Entries per queue for `queues` queues of `payload`-byte buffers: as many as
/// [`AUTO_PAYLOAD_BUDGET`] allows, within [`AUTO_ENTRIES_MIN`]..=[`AUTO_ENTRIES_MAX`].
pub(crate) fn auto_entries_per_queue(queues: usize, payload: usize) -> usize {
    (AUTO_PAYLOAD_BUDGET / queues.max(1).saturating_mul(payload.max(1)))
        .clamp(AUTO_ENTRIES_MIN, AUTO_ENTRIES_MAX)
}

/// Starts one worker per configured CPU. Returns the threads, or the threads plus the reason
/// when registration failed (the caller stops them and falls back to `/dev/fuse`).
#[allow(clippy::type_complexity)]
pub(crate) fn start(
    shared: &Arc<Shared>,
    cfg: &SessionConfig,
    wakers: &Arc<Mutex<Vec<Waker>>>,
) -> Result<Vec<JoinHandle<()>>, (Vec<JoinHandle<()>>, String)> {
    let possible = match cpu::possible_cpus() {
        Ok(p) => p,
        Err(e) => return Err((Vec::new(), format!("cannot read possible CPUs: {e}"))),
    };
    // Every possible CPU needs a queue, or no request is ever served: CPUs without a worker
    // have their queue registered by a worker chosen round-robin.
    let mut queues_of: Vec<Vec<u16>> = vec![Vec::new(); cfg.cpus.len()];
    for (i, &q) in possible.iter().enumerate() {
        let w = cfg
            .cpus
            .iter()
            .position(|&c| c == q)
            .unwrap_or(i % cfg.cpus.len());
        queues_of[w].push(u16::try_from(q).expect("CPU numbers fit in u16"));
    }
    let (tx, rx) = mpsc::channel();
    let mut threads = Vec::new();
    let entries = match cfg.ring_entries_per_queue {
        0 => auto_entries_per_queue(possible.len(), shared.negotiated.payload_max()),
        n => n,
    };
    let entries_total = possible.len() * entries;
    let mut handoff = Vec::with_capacity(cfg.cpus.len());
    let mut handoff_rxs = Vec::with_capacity(cfg.cpus.len());
    for _ in &cfg.cpus {
        let waker = match Waker::new() {
            Ok(w) => w,
            Err(e) => return Err((threads, format!("eventfd: {e}"))),
        };
        wakers.lock().expect("waker list").push(waker.clone());
        // Room for every entry: a handoff never finds the channel full.
        let (etx, erx) = crossbeam_channel::bounded(entries_total.max(1));
        handoff.push((etx, waker));
        handoff_rxs.push(erx);
    }
    let mut home = vec![0; possible.iter().max().map_or(0, |&m| m + 1)];
    for (w, qs) in queues_of.iter().enumerate() {
        for &q in qs {
            home[usize::from(q)] = w;
        }
    }
    let peers = Arc::new(Peers::new(
        handoff,
        home,
        entries_total,
        cfg.ring_share_above,
    ));
    for (core, ((&cpu, queues), handoff_rx)) in
        cfg.cpus.iter().zip(queues_of).zip(handoff_rxs).enumerate()
    {
        let (s, tx, peers) = (shared.clone(), tx.clone(), peers.clone());
        match spawn(&format!("etcfs-ring-{cpu}"), move || {
            Worker::run(&s, core, cpu, &queues, entries, &peers, handoff_rx, &tx)
        }) {
            Ok(t) => threads.push(t),
            Err(e) => return Err((threads, e.to_string())),
        }
    }
    match collect_starts(rx, cfg.cpus.len()) {
        Ok(()) => Ok(threads),
        Err(e) => Err((threads, e)),
    }
}

/// How long a worker spins for its next request before sleeping: `linger` when it has just
/// answered a request made on another CPU and its device wait plan is to sleep, else none.
///
/// A process doing synchronous I/O sends its next request some tens of µs after the reply,
/// and waking a worker whose CPU has halted costs 30–50 µs on a VM. For a large WRITE that
/// wake-up is on the critical path: the process keeps its own CPU for about 35 µs after the
/// first piece while it sends the others, so the piece that lands on the other CPU's worker
/// is copied first only if that worker is awake. Spinning on the requester's own CPU would
/// take the CPU it is about to run on, hence only after serving another CPU's queue.
fn linger_budget(device_plan: WaitPlan, served_remote: bool, linger: Duration) -> Option<Duration> {
    (device_plan == WaitPlan::Sleep && served_remote && !linger.is_zero()).then_some(linger)
}

/// One pinned worker: its ring, its entries and its deferred-reply channel.
struct Worker<'a> {
    shared: &'a Shared,
    core: usize,
    /// The CPU this worker is pinned to; a queue's id is the CPU its requests come from.
    cpu: usize,
    /// Whether a reply since the last wait answered a request from another CPU's queue.
    served_remote: bool,
    ring: Ring<Entry128>,
    entries: Vec<Entry>,
    devfd: i32,
    recorder: perf::CoreRecorder,
    completions_tx: Sender<DeferredCompletion>,
    waker: &'a Waker,
    scratch_in: Vec<u8>,
    scratch_out: Vec<u8>,
    /// Per entry, what the handler keeps alive until the entry's device I/O is over.
    holds: Vec<Option<Hold>>,
    /// Device reads and writes submitted and not yet completed.
    device_ios: usize,
    /// The entries in `EntryState::DeviceIo`, each once: what the wait plan looks at after
    /// every batch, instead of every entry (a cold walk of them all sat between a READ's
    /// device read being queued and its submission).
    in_device: Vec<usize>,
    /// Whether the batch being handled queued device I/O, which is then submitted at the
    /// batch's end, before the worker's housekeeping and its wait plan.
    device_queued: bool,
    /// The payload arena and the handler's stable descriptors, as registered with `ring`.
    fixed: uring::Registered,
    /// Large WRITEs taken from the kernel in the batch of completions being handled.
    large_writes_in_batch: usize,
    /// How to wait while they are, and what they took so far.
    spin: SpinPolicy,
    peers: &'a Peers,
    /// Slots of `entries` whose entry went to another worker, for entries coming in.
    vacant: Vec<usize>,
}

impl<'a> Worker<'a> {
    #[allow(
        clippy::too_many_arguments,
        reason = "the worker's placement, queues and links to its peers, given once"
    )]
    fn run(
        shared: &'a Shared,
        core: usize,
        cpu: usize,
        queues: &[u16],
        entries_per_queue: usize,
        peers: &'a Peers,
        handoff_rx: Receiver<Entry>,
        started: &mpsc::Sender<Result<(), String>>,
    ) {
        let waker = &peers.handoff[core].1;
        settle_worker_thread(shared, &format!("ring worker {core}"), cpu);
        let entries_max = queues.len() * entries_per_queue;
        let payload_len = shared.negotiated.payload_max();
        // Payloads in huge pages: a READ or WRITE's device transfer is then one contiguous
        // segment (see `uring::buf`).
        let mut arena = match HugeArena::new(HugeArena::size_for(entries_max, payload_len)) {
            Ok(a) => Some(a),
            Err(e) => {
                log::warn!("ring worker {core}: no arena for payloads ({e}); using the heap");
                None
            }
        };
        // Every ring registers every worker's arena: entries move between workers (see
        // `Peers`), and their transfers stay on the registered path wherever they are served.
        // The holds keep the other workers' arenas mapped for as long as this ring lives.
        let arena_holds = peers.arenas.exchange(arena.as_ref().map(HugeArena::hold));
        // Each entry has at most one command plus its READ segments in flight; segments are
        // bounded by the ring's size through back-pressure in `Ring::push`.
        let sq_entries_max = (entries_max * 4 + 8).next_power_of_two() as u32;
        let mut ring: Ring<Entry128> = match Ring::new(RingConfig { sq_entries_max }) {
            Ok(r) => r,
            Err(e) => {
                let _ = started.send(Err(format!("io_uring with SQE128: {e}")));
                return;
            }
        };
        let stable_fds = shared.handler.stable_fds();
        let regions: Vec<(*mut u8, usize)> = arena_holds.iter().map(ArenaHold::region).collect();
        // SAFETY: every region is an arena that `arena_holds` keeps mapped until the end of
        // `run`, after the ring is dropped; the handler keeps `stable_fds` open on the same
        // files while it lives, and it outlives the session.
        let (fixed, refused) = unsafe { ring.register_fixed(&regions, &stable_fds) };
        for e in refused {
            log::info!("ring worker {core}: device transfers without registration: {e}");
        }
        let mut entries: Vec<Entry> = Vec::with_capacity(entries_max);
        for &qid in queues {
            for _ in 0..entries_per_queue {
                let mut header = AlignedBuf::new(HEADER_LEN);
                let mut payload = arena
                    .as_mut()
                    .and_then(|a| a.carve(payload_len))
                    .unwrap_or_else(|| AlignedBuf::new(payload_len));
                let iov = Box::new([
                    libc::iovec {
                        iov_base: header.as_mut_ptr().cast(),
                        iov_len: HEADER_LEN,
                    },
                    libc::iovec {
                        iov_base: payload.as_mut_ptr().cast(),
                        iov_len: payload_len,
                    },
                ]);
                entries.push(Entry {
                    qid,
                    header,
                    payload,
                    iov,
                    state: EntryState::InKernel,
                });
            }
        }
        // Room for every entry of the session, not only this worker's own: entries other
        // workers pass it are served here too, and each holds at most one deferred reply.
        // A completion that found the channel full would be dropped and its request never
        // answered (the two-process hang of 2026-12-07).
        let (completions_tx, completions_rx) = crossbeam_channel::bounded(peers.entries.max(1));
        let mut w = Worker {
            shared,
            core,
            cpu,
            served_remote: false,
            ring,
            devfd: shared.mount.fd(),
            device_ios: 0,
            in_device: Vec::with_capacity(entries_max),
            device_queued: false,
            fixed,
            large_writes_in_batch: 0,
            spin: SpinPolicy::new(shared.device_spin),
            peers,
            vacant: Vec::new(),
            holds: (0..entries.len()).map(|_| None).collect(),
            entries,
            recorder: shared.perf.core(core),
            completions_tx,
            waker,
            scratch_in: vec![0u8; REQUEST_HEADER_ROOM + 64 * 1024],
            scratch_out: vec![0u8; REQUEST_HEADER_ROOM],
        };
        for idx in 0..w.entries.len() {
            let sqe = register_sqe(w.devfd, &w.entries[idx], idx);
            // SAFETY: the iovecs and both buffers belong to `entries`, which is neither
            // resized nor dropped while the kernel holds them (see the end of `run`).
            if let Err(err) = unsafe { w.ring.push(&sqe) } {
                let _ = started.send(Err(format!("queue REGISTER: {err}")));
                return;
            }
        }
        w.arm_waker();
        let mut done: Vec<uring::Completion> = Vec::with_capacity(entries_max * 2 + 1);
        // A REGISTER that the kernel accepts completes only when a request arrives; one it
        // rejects completes at once with an error. Give rejections a moment to show.
        let _ = w.ring.submit_and_wait(1, Some(Duration::from_millis(100)));
        w.ring.reap(&mut done);
        if let Some(c) = done
            .iter()
            .find(|c| c.user_data & TAG_MASK == TAG_CMD && c.result < 0)
        {
            let err = Errno::from_raw(-c.result)
                .map(|e| e.to_string())
                .unwrap_or_default();
            let _ = started.send(Err(format!("REGISTER on queue {queues:?} failed: {err}")));
            // Entries the kernel accepted still hold our buffers until the ring is gone.
            let Worker { ring, entries, .. } = w;
            drop(ring);
            std::mem::forget(entries);
            return;
        }
        let _ = started.send(Ok(()));

        let mut t_batch = w.recorder.timer();
        loop {
            let batch = done.len();
            w.large_writes_in_batch = 0;
            for (i, c) in done.drain(..).enumerate() {
                w.complete(c, &t_batch);
                if submit_early(i + 1, batch) {
                    // A failure shows again, and is reported, at the wait below.
                    let _ = w.ring.submit();
                }
            }
            if std::mem::take(&mut w.device_queued) && w.ring.pending() > 0 {
                // The wait below would submit them too, but only after the channels, the
                // peers and the wait plan; with device I/O in flight it spins or naps, which
                // submits on its own, so this costs no extra system call.
                let _ = w.ring.submit();
            }
            while let Ok(c) = completions_rx.try_recv() {
                w.deferred(c);
            }
            while let Ok(e) = handoff_rx.try_recv() {
                w.adopt(e);
            }
            if peers.live.load(Ordering::Acquire) == 0 || shared.stop.load(Ordering::Relaxed) {
                break;
            }
            let plan = device_wait_plan(
                &mut w.spin,
                w.in_device
                    .iter()
                    .filter_map(|&idx| match w.entries[idx].state {
                        EntryState::DeviceIo(_, ref io) => Some(io),
                        _ => None,
                    }),
            );
            let served_remote = std::mem::take(&mut w.served_remote);
            let waited = match linger_budget(plan, served_remote, shared.ring_linger) {
                // Not a device wait: kept out of the device spin's estimates and backoff.
                Some(budget) => w.ring.before_sleep(WaitPlan::Spin(budget)).map(|waited| {
                    let counter = if waited == Waited::SpinHit {
                        RING_LINGER_HITS
                    } else {
                        RING_LINGER_MISSES
                    };
                    w.recorder.add_counter(counter, 1);
                }),
                None => w.ring.before_sleep(plan).map(|waited| {
                    let counter = wait_counter(w.device_ios > 0, waited);
                    w.recorder.add_counter(counter, 1);
                    w.spin.after_wait(waited);
                }),
            };
            if let Err(e) = waited {
                log::warn!("ring worker {core}: io_uring_enter: {e}");
                break;
            }
            if let Err(e) = w.ring.submit_and_wait(1, None) {
                log::warn!("ring worker {core}: io_uring_enter: {e}");
                break;
            }
            w.ring.reap(&mut done);
            t_batch = w.recorder.timer();
        }
        let Worker { ring, entries, .. } = w;
        drop(ring);
        // Entries handed to this worker too late to be served are still the kernel's.
        let arriving: Vec<Entry> = handoff_rx.try_iter().collect();
        let live = |e: &Entry| !matches!(e.state, EntryState::Dead | EntryState::Away);
        if entries.iter().any(live) || !arriving.is_empty() {
            // Stopped while entries were still registered: the kernel drops them when the
            // ring closes, but it may finish doing so after we return, so the buffers stay
            // allocated until the process exits rather than risk a write into freed memory.
            std::mem::forget(entries);
            std::mem::forget(arriving);
        }
    }

    /// Takes in an entry another worker passed over, and commits its reply from this
    /// worker's ring: the entry's next request comes here.
    fn adopt(&mut self, e: Entry) {
        let idx = match self.vacant.pop() {
            Some(i) => {
                self.entries[i] = e;
                i
            }
            None => {
                self.entries.push(e);
                self.holds.push(None);
                self.entries.len() - 1
            }
        };
        self.commit(idx);
    }

    /// Queues COMMIT_AND_FETCH for entry `idx`, whose reply is in its buffers.
    fn commit(&mut self, idx: usize) {
        let e = &mut self.entries[idx];
        e.state = EntryState::InKernel;
        let ent = &e.header[ENT_OFFSET..ENT_OFFSET + 32];
        let commit_id = u64::from_ne_bytes(ent[8..16].try_into().expect("8 bytes"));
        let sqe = uring::ring::uring_cmd80(
            self.devfd,
            CMD_COMMIT_AND_FETCH,
            0,
            0,
            cmd_req(commit_id, e.qid),
        )
        .user_data(TAG_CMD | idx as u64);
        // SAFETY: COMMIT_AND_FETCH reuses the buffers registered for this entry, which live
        // as long as the entry (never freed while registered, see the end of `run`).
        if let Err(err) = unsafe { self.ring.push(&sqe) } {
            log::error!("cannot queue COMMIT_AND_FETCH: {err}");
        }
    }

    fn arm_waker(&mut self) {
        // SAFETY: the poll references only the eventfd, which the waker keeps open.
        let _ = unsafe {
            self.ring
                .push(&Entry128::from(self.waker.poll_entry(TAG_WAKE)))
        };
    }

    fn complete(&mut self, c: uring::Completion, t_batch: &perf::Timer) {
        let idx = (c.user_data & !TAG_MASK) as usize;
        match c.user_data & TAG_MASK {
            TAG_WAKE => {
                self.waker.drain();
                self.arm_waker();
            }
            TAG_CMD if c.result < 0 => self.command_failed(idx, -c.result),
            TAG_CMD => {
                if let Some(wait) = t_batch.elapsed_ns() {
                    let op = op_index(peek_opcode(&self.entries[idx]));
                    self.recorder.record(op, perf::Stage::QueueWait, wait);
                }
                self.peers.load[self.core].fetch_add(1, Ordering::Relaxed);
                self.serve(idx);
            }
            TAG_DATA_IO => self.segment_read(idx, c.result),
            _ => {}
        }
    }

    fn command_failed(&mut self, idx: usize, err: i32) {
        let Some(e) = self.entries.get_mut(idx) else {
            return;
        };
        if err == libc::EAGAIN || err == libc::EINTR {
            let sqe = register_sqe(self.devfd, e, idx);
            // SAFETY: as for the first REGISTER.
            let _ = unsafe { self.ring.push(&sqe) };
            return;
        }
        if err != libc::ENOTCONN {
            log::warn!(
                "ring entry {idx}: {}",
                std::io::Error::from_raw_os_error(err)
            );
        }
        e.state = EntryState::Dead;
        if self.peers.live.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last entry: wake every worker (some may hold none) to end the session.
            for (_, waker) in &self.peers.handoff {
                waker.wake();
            }
        }
    }

    /// Decodes the request in entry `idx`, runs the handler and acts on its reply.
    fn serve(&mut self, idx: usize) {
        let started = self.recorder.timer();
        let e = &mut self.entries[idx];
        let ent = &e.header[ENT_OFFSET..ENT_OFFSET + 32];
        let payload_sz = (u32::from_ne_bytes(ent[16..20].try_into().expect("4 bytes")) as usize)
            .min(e.payload.len());
        let in_len = u32::from_ne_bytes(e.header[0..4].try_into().expect("4 bytes")) as usize;
        let opcode = peek_opcode(e);
        let unique = u64::from_ne_bytes(e.header[8..16].try_into().expect("8 bytes"));
        let op = op_index(opcode);
        self.recorder.count(op);
        let arg0_len = in_len.saturating_sub(IN_HEADER_LEN + payload_sz).min(128);
        let is_write = opcode == crate::opcode::Opcode::Write as u32;
        if is_write {
            self.recorder
                .add_counter(super::FUSE_WRITE_BYTES, payload_sz as u64);
        }
        let piece = if is_write && payload_sz >= SPREAD_PIECE_MIN {
            self.large_writes_in_batch += 1;
            Piece::of(self.large_writes_in_batch)
        } else {
            Piece::No
        };
        let ctx = RequestCtx::deferrable(self.core, &self.completions_tx, self.waker, idx as u64);
        let handler = self.shared.handler.as_ref();
        let t_handler = self.recorder.timer();
        let reply = {
            let hdr = &e.header[..IN_HEADER_LEN];
            let arg0 = &e.header[OP_IN_OFFSET..OP_IN_OFFSET + arg0_len];
            if is_write {
                // WRITE data stays where the kernel put it; the small reply is built aside.
                match request::decode_parts(hdr, arg0, &e.payload[..payload_sz]) {
                    Ok(req) => dispatch(handler, &ctx, &req, &mut self.scratch_out),
                    Err(err) => decode_failed(opcode, unique, &err),
                }
            } else {
                // Names and values are copied aside so the handler can write its reply (a
                // READ's data, say) straight into the payload the kernel will copy out.
                if self.scratch_in.len() < payload_sz {
                    self.scratch_in.resize(payload_sz, 0);
                }
                self.scratch_in[..payload_sz].copy_from_slice(&e.payload[..payload_sz]);
                match request::decode_parts(hdr, arg0, &self.scratch_in[..payload_sz]) {
                    Ok(req) => dispatch(handler, &ctx, &req, &mut e.payload),
                    Err(err) => decode_failed(opcode, unique, &err),
                }
            }
        };
        self.recorder
            .record_since(op, perf::Stage::Handler, &t_handler);
        let p = Pending {
            unique,
            op,
            started,
            piece,
        };
        match reply {
            Reply::Bytes(n) => {
                if is_write {
                    e.payload[..n].copy_from_slice(&self.scratch_out[..n]);
                }
                self.reply(idx, p, 0, n);
            }
            Reply::Error(err) => self.reply(idx, p, -err.raw(), 0),
            // Requests that take no reply never arrive on the ring; answer defensively so
            // the entry is not lost.
            Reply::None => self.reply(idx, p, -libc::ENOSYS, 0),
            Reply::Deferred => e.state = EntryState::Deferred(p),
            Reply::Fd { fd, offset, len } => {
                let plan = ReadPlan {
                    segments: vec![Segment::Device {
                        fd,
                        offset,
                        len: len.min(e.payload.len()),
                    }],
                    skip: 0,
                    len: len.min(e.payload.len()),
                    hold: None,
                };
                self.start_read(idx, p, plan, true);
            }
            Reply::Read(plan) => self.start_read(idx, p, plan, false),
            Reply::Write(plan) => self.start_write(idx, p, plan),
        }
    }

    /// A deferred reply arrived from another thread.
    fn deferred(&mut self, c: DeferredCompletion) {
        let idx = c.token as usize;
        let Some(e) = self.entries.get_mut(idx) else {
            return;
        };
        let EntryState::Deferred(p) = e.state else {
            log::error!("deferred reply for ring entry {idx} in state {:?}", e.state);
            return;
        };
        match c.outcome {
            DeferredOutcome::Bytes(args) if args.len() <= e.payload.len() => {
                e.payload[..args.len()].copy_from_slice(&args);
                self.reply(idx, p, 0, args.len());
            }
            DeferredOutcome::Bytes(args) => {
                log::error!("deferred reply of {} bytes exceeds the payload", args.len());
                self.reply(idx, p, -libc::EIO, 0);
            }
            DeferredOutcome::Error(err) => self.reply(idx, p, -err.raw(), 0),
            DeferredOutcome::Read(plan) if plan_fits(&plan, e.payload.len()) => {
                self.start_read(idx, p, plan, false)
            }
            DeferredOutcome::Read(plan) => {
                log::error!("deferred read plan {plan:?} does not fit the payload");
                self.reply(idx, p, -libc::EIO, 0);
            }
        }
    }

    /// Reads a READ reply's device segments into the payload with io_uring READs.
    fn start_read(&mut self, idx: usize, p: Pending, mut plan: ReadPlan, short_is_eof: bool) {
        self.holds[idx] = plan.hold.take();
        let allowed = self.shared.handler.device_io_allowed();
        let e = &mut self.entries[idx];
        let mut progress = IoProgress::read(&plan, short_is_eof);
        let mut pos = 0;
        for seg in &plan.segments {
            match *seg {
                Segment::Zero { len } => e.payload[pos..pos + len].fill(0),
                Segment::Device { len, .. } if !allowed => progress.segment_queued(len, false),
                Segment::Device { fd, offset, len } => {
                    let buf = e.payload[pos..].as_mut_ptr();
                    let sqe = self
                        .fixed
                        .read(fd, buf, len as u32, offset)
                        .user_data(TAG_DATA_IO | idx as u64);
                    // SAFETY: the range lies inside the payload (the plan was checked to fit)
                    // and the entry stays in `Reading` until every read completes.
                    let queued = unsafe { self.ring.push(&Entry128::from(sqe)) }.is_ok();
                    self.device_ios += usize::from(queued);
                    self.device_queued |= queued;
                    progress.segment_queued(len, queued);
                }
            }
            pos += seg.len();
        }
        self.await_io(idx, p, progress);
    }

    /// Writes a WRITE's data from the payload to the device with io_uring WRITEs.
    fn start_write(&mut self, idx: usize, p: Pending, plan: WritePlan) {
        let allowed = self.shared.handler.device_io_allowed();
        let e = &mut self.entries[idx];
        let mut progress = IoProgress::write(plan.written);
        for seg in &plan.segments {
            if !allowed {
                progress.segment_queued(seg.len, false);
                continue;
            }
            let from = plan.image.as_deref().unwrap_or(&e.payload);
            let buf = from[seg.src..seg.src + seg.len].as_ptr();
            let sqe = self
                .fixed
                .write(seg.fd, buf, seg.len as u32, seg.offset)
                .user_data(TAG_DATA_IO | idx as u64);
            // SAFETY: the range lies inside the payload (`dispatch` checked the plan against
            // the WRITE's data, which is the payload's start) or inside the plan's image,
            // whose heap block does not move when the image is moved into `holds` below;
            // the entry stays in `DeviceIo`, its payload untouched and the image held,
            // until every write completes.
            let queued = unsafe { self.ring.push(&Entry128::from(sqe)) }.is_ok();
            self.device_ios += usize::from(queued);
            self.device_queued |= queued;
            progress.segment_queued(seg.len, queued);
        }
        self.holds[idx] = super::keep_until_written(plan.hold, plan.image);
        self.await_io(idx, p, progress);
    }

    fn segment_read(&mut self, idx: usize, result: i32) {
        self.device_ios = self.device_ios.saturating_sub(1);
        let Some(e) = self.entries.get_mut(idx) else {
            return;
        };
        let EntryState::DeviceIo(p, mut progress) = e.state else {
            return;
        };
        progress.segment_done(result);
        if progress.in_flight() {
            e.state = EntryState::DeviceIo(p, progress);
            return;
        }
        self.recorder
            .record_since(p.op, perf::Stage::DeviceIo, &p.started);
        if let Some(at) = self.in_device.iter().position(|&i| i == idx) {
            self.in_device.swap_remove(at);
        }
        self.finish_io(idx, p, progress);
    }

    /// Parks the entry until its device I/O completes, or answers at once if none was
    /// queued.
    fn await_io(&mut self, idx: usize, p: Pending, progress: IoProgress) {
        progress.count(&self.recorder);
        if progress.in_flight() {
            self.entries[idx].state = EntryState::DeviceIo(p, progress);
            self.in_device.push(idx);
        } else {
            self.finish_io(idx, p, progress);
        }
    }

    fn finish_io(&mut self, idx: usize, p: Pending, progress: IoProgress) {
        self.holds[idx] = None;
        let (err, len) = progress.finish(&mut self.entries[idx].payload);
        self.reply(idx, p, err, len);
    }

    /// Writes the out header and payload size, and commits (which fetches the next request).
    fn reply(&mut self, idx: usize, p: Pending, error: i32, len: usize) {
        let e = &mut self.entries[idx];
        let len = if error == 0 { len } else { 0 };
        count_reply(&self.recorder, p.op, error, len);
        e.header[..16].copy_from_slice(&out_header(p.unique, error, len));
        let sz = u32::try_from(len).expect("payload below 4 GiB");
        e.header[ENT_OFFSET + 16..ENT_OFFSET + 20].copy_from_slice(&sz.to_ne_bytes());
        let qid = e.qid;
        self.served_remote |= usize::from(qid) != self.cpu;
        self.recorder
            .record_since(p.op, perf::Stage::Total, &p.started);
        let target = match p.piece {
            Piece::No => self.peers.handoff_target(self.core, qid, self.peers.now()),
            Piece::Keep => None,
            Piece::Spread => self.peers.spread_target(self.core),
        };
        self.peers.load[self.core].fetch_sub(1, Ordering::Relaxed);
        if let Some(t) = target {
            let e = std::mem::replace(&mut self.entries[idx], Entry::vacant());
            let (tx, waker) = &self.peers.handoff[t];
            match tx.try_send(e) {
                Ok(()) => {
                    self.vacant.push(idx);
                    waker.wake();
                    let home = self.peers.home.get(usize::from(qid)) == Some(&t);
                    let counter = if p.piece == Piece::Spread {
                        RING_WRITE_PIECES_SPREAD
                    } else if home {
                        RING_ENTRIES_RETURNED
                    } else {
                        RING_ENTRIES_PASSED
                    };
                    self.recorder.add_counter(counter, 1);
                    return;
                }
                // Never full (room for every entry); the peer has stopped: commit here.
                Err(err) => self.entries[idx] = err.into_inner(),
            }
        }
        self.commit(idx);
    }
}

fn peek_opcode(e: &Entry) -> u32 {
    u32::from_ne_bytes(e.header[4..8].try_into().expect("4 bytes"))
}

fn decode_failed(opcode: u32, unique: u64, err: &request::DecodeError) -> Reply {
    log::warn!("malformed request (opcode {opcode}, unique {unique}) on the ring: {err}");
    Reply::Error(Errno::EIO)
}

fn register_sqe(devfd: i32, e: &Entry, idx: usize) -> Entry128 {
    uring::ring::uring_cmd80(
        devfd,
        CMD_REGISTER,
        e.iov.as_ptr() as u64,
        2,
        cmd_req(0, e.qid),
    )
    .user_data(TAG_CMD | idx as u64)
}

/// `struct fuse_uring_cmd_req` in the SQE's command area.
fn cmd_req(commit_id: u64, qid: u16) -> [u8; 80] {
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
    cmd
}

#[cfg(test)]
mod tests {
    use super::{auto_entries_per_queue, linger_budget, Peers, Piece, AT_HOME};
    use std::{sync::atomic::Ordering, time::Duration};
    use uring::{WaitPlan, Waker};

    /// Peers with these loads, one queue per worker (queue `w` at home on worker `w`).
    fn peers(loads: &[usize], share_above: usize) -> Peers {
        let handoff = loads
            .iter()
            .map(|_| {
                (
                    crossbeam_channel::bounded(1).0,
                    Waker::new().expect("eventfd"),
                )
            })
            .collect();
        let p = Peers::new(handoff, (0..loads.len()).collect(), 0, share_above);
        set_loads(&p, loads);
        p
    }

    fn set_loads(p: &Peers, loads: &[usize]) {
        for (slot, &l) in p.load.iter().zip(loads) {
            slot.store(l, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_worker_lingers_only_after_another_cpus_request_and_with_no_device_wait() {
        let linger = Duration::from_micros(80);
        assert_eq!(linger_budget(WaitPlan::Sleep, true, linger), Some(linger));
        assert_eq!(linger_budget(WaitPlan::Sleep, false, linger), None);
        assert_eq!(linger_budget(WaitPlan::Sleep, true, Duration::ZERO), None);
        // A device transfer in flight keeps its own plan (spin near its expected end).
        let device = WaitPlan::Spin(Duration::from_micros(100));
        assert_eq!(linger_budget(device, true, linger), None);
        let nap = WaitPlan::NapThenSpin {
            nap: Duration::from_micros(200),
            spin: Duration::from_micros(100),
        };
        assert_eq!(linger_budget(nap, true, linger), None);
    }

    #[test]
    fn every_second_large_write_of_a_batch_spreads() {
        let roles: Vec<Piece> = (0..6).map(Piece::of).collect();
        use Piece::{Keep, No, Spread};
        assert_eq!(roles, [No, Keep, Spread, Keep, Spread, Keep]);
    }

    #[test]
    fn spread_pieces_go_to_the_least_busy_other_worker() {
        assert_eq!(peers(&[5, 3, 1, 2], 16).spread_target(0), Some(2));
        assert_eq!(peers(&[0, 9, 9], 16).spread_target(0), Some(1));
        assert_eq!(
            peers(&[0, 0], 0).spread_target(0),
            None,
            "0 keeps requests home"
        );
        assert_eq!(peers(&[0], 16).spread_target(0), None, "no other worker");
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_queue_moves_above_the_mark_to_a_quiet_worker_and_overflows_between_busy_ones() {
        let p = peers(&[16, 0], 16);
        assert_eq!(p.handoff_target(0, 0, ms(1)), None, "at the mark: home");
        // Both busy: single entries overflow to the less busy worker and come back below
        // half the mark; the queue stays.
        set_loads(&p, &[20, 16]);
        assert_eq!(p.handoff_target(0, 0, ms(1)), Some(1));
        assert_eq!(p.handoff_target(1, 0, ms(1)), None);
        set_loads(&p, &[17, 16]);
        assert_eq!(p.handoff_target(0, 0, ms(1)), None, "not less busy");
        set_loads(&p, &[8, 16]);
        assert_eq!(p.handoff_target(1, 0, ms(1)), Some(0));
        // The other worker quiet (the overflow it took does not count): the queue moves.
        set_loads(&p, &[17, 8]);
        assert_eq!(p.handoff_target(0, 0, ms(2)), Some(1));
        // Its entries still at home follow once the worker serving it is below half the mark.
        set_loads(&p, &[1, 9]);
        assert_eq!(p.handoff_target(0, 0, ms(7)), None);
        set_loads(&p, &[1, 8]);
        assert_eq!(p.handoff_target(0, 0, ms(7)), Some(1));
        // The worker serving it keeps them, and overflows home above the mark.
        set_loads(&p, &[0, 9]);
        assert_eq!(p.handoff_target(1, 0, ms(7)), None);
        set_loads(&p, &[0, 17]);
        assert_eq!(p.handoff_target(1, 0, ms(7)), Some(0));
        // The other queue is untouched.
        set_loads(&p, &[0, 9]);
        assert_eq!(p.handoff_target(1, 1, ms(7)), None);
        assert_eq!(
            peers(&[40, 0], 0).handoff_target(0, 0, ms(1)),
            None,
            "0 never moves"
        );
        assert_eq!(
            peers(&[40], 16).handoff_target(0, 0, ms(1)),
            None,
            "no other worker"
        );
    }

    #[test]
    fn a_queue_does_not_move_to_a_worker_busy_with_its_own() {
        let p = peers(&[0, 5], 16);
        // Worker 1 commits one of its own queue's requests with more than 4 in service.
        // (Worker 0, at its mark, passes nothing.)
        assert_eq!(p.handoff_target(1, 1, ms(10)), None);
        set_loads(&p, &[20, 8]);
        assert_eq!(p.handoff_target(0, 0, ms(14)), Some(1), "overflow only");
        assert_eq!(p.moved_to[0].load(Ordering::Relaxed), AT_HOME);
        assert_eq!(p.handoff_target(0, 0, ms(15)), Some(1), "5 ms quiet: moves");
        assert_eq!(p.moved_to[0].load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_moved_queue_goes_home_when_its_hosts_own_queue_gets_busy() {
        let p = peers(&[17, 0], 16);
        assert_eq!(p.handoff_target(0, 0, ms(1)), Some(1));
        // Worker 1's own queue gets busy: queue 0 goes home, and its entries follow once
        // worker 0 is below half the mark.
        set_loads(&p, &[4, 20]);
        assert_eq!(
            p.handoff_target(1, 1, ms(2)),
            Some(0),
            "overflow of queue 1"
        );
        assert_eq!(p.moved_to[0].load(Ordering::Relaxed), AT_HOME);
        assert_eq!(p.handoff_target(1, 0, ms(2)), Some(0));
    }

    #[test]
    fn a_moved_queue_goes_home_only_after_a_quiet_spell() {
        let p = peers(&[17, 0], 16);
        assert_eq!(p.handoff_target(0, 0, ms(10)), Some(1));
        // Quiet commits right after the move, and a busy one that restarts the spell.
        set_loads(&p, &[0, 4]);
        assert_eq!(p.handoff_target(1, 0, ms(14)), None);
        set_loads(&p, &[0, 5]);
        assert_eq!(p.handoff_target(1, 0, ms(16)), None);
        set_loads(&p, &[0, 1]);
        assert_eq!(p.handoff_target(1, 0, ms(20)), None, "quiet for 4 ms only");
        assert_eq!(p.handoff_target(1, 0, ms(21)), Some(0));
        // Home again: entries still at the other worker follow at their next commit, and
        // the queue moves again only above the mark.
        assert_eq!(p.handoff_target(1, 0, ms(22)), Some(0));
        set_loads(&p, &[16, 0]);
        assert_eq!(p.handoff_target(0, 0, ms(22)), None);
        set_loads(&p, &[17, 0]);
        assert_eq!(p.handoff_target(0, 0, ms(22)), Some(1));
    }

    #[test]
    fn automatic_entries_stay_within_the_memory_budget_and_bounds() {
        const MIB: usize = 1 << 20;
        assert_eq!(auto_entries_per_queue(2, MIB), 32);
        assert_eq!(auto_entries_per_queue(16, MIB), 16);
        assert_eq!(auto_entries_per_queue(128, MIB), 8);
        assert_eq!(auto_entries_per_queue(0, 0), 32);
    }
}
