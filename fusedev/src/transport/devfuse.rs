//! Classic `/dev/fuse`, driven through io_uring: each worker reads requests from its own
//! clone of the device (`FUSE_DEV_IOC_CLONE`) with READ SQEs and writes replies with WRITE
//! SQEs on its own ring. A READ whose data comes from a file descriptor is spliced: the out
//! header is written into a pipe, the data spliced from the file into the pipe, and the pipe
//! spliced into the device, three linked SQEs with no copy of the data through user memory.

use std::{
    io,
    os::fd::{AsRawFd, OwnedFd, RawFd},
    sync::{atomic::Ordering, mpsc, Arc, Mutex},
    thread::JoinHandle,
};

use io_uring::{opcode, squeue, types};
use uring::{AlignedBuf, HugeArena, Ring, RingConfig, SpinPolicy, Waker};

use crossbeam_channel::Sender;

use super::{
    collect_starts, count_device_io, count_reply, count_request, device_wait_plan, dispatch,
    op_index, out_header, plan_fits, settle_worker_thread, spawn, submit_early, wait_counter,
    IoProgress, SessionConfig, SessionError, Shared, OUT_HEADER_LEN, REQUEST_HEADER_ROOM,
};
use crate::{
    mount::owned,
    opcode::Opcode,
    request::{self, Operation},
    server::{
        DeferredCompletion, DeferredOutcome, Hold, ReadPlan, Reply, RequestCtx, Segment, WritePlan,
    },
};

const TAG_READ_REQ: u64 = 0;
const TAG_WRITE_REPLY: u64 = 1 << 32;
const TAG_FILE_READ: u64 = 2 << 32;
const TAG_SPLICE: u64 = 3 << 32;
const TAG_WAKE: u64 = 4 << 32;
const TAG_MASK: u64 = 0xffff_ffff << 32;
/// The low 30 bits carry the slot; bits 30-31 the step of a splice chain.
const IDX_MASK: u64 = 0x3fff_ffff;

/// The pipe size asked for: the largest a process without CAP_SYS_RESOURCE may have here.
const PIPE_BYTES_WANTED: i32 = 1 << 20;
const PAGE: usize = 4096;

/// A request whose reply is not sent yet.
#[derive(Debug, Clone, Copy)]
struct Pending {
    unique: u64,
    op: usize,
    started: perf::Timer,
}

#[derive(Debug, Clone, Copy)]
enum SlotState {
    /// A READ of the device is outstanding.
    Reading,
    /// The reply in `out` is being written to the device.
    Replying,
    /// The handler deferred the reply; it arrives on the worker's completion channel.
    Deferred(Pending),
    /// A READ reply's data is being read into `out`, or a WRITE's data written from `inbuf`.
    DeviceIo(Pending, IoProgress),
    /// The three linked splice SQEs are in flight; `left` of them have not completed.
    Splicing {
        p: Pending,
        left: u8,
        delivered: bool,
    },
    /// The connection is gone.
    Dead,
}

/// Reply arguments start one page into `out`, so device reads into them are page-aligned
/// (O_DIRECT); the out header sits just before them.
const ARGS_AT: usize = PAGE;
/// Where in a slot's in buffer a request is read to: a WRITE's in header (40 bytes) and
/// `fuse_write_in` (40) end at the page boundary, so its data starts page-aligned and can go
/// to an O_DIRECT device from there.
const REQUEST_AT: usize = PAGE - 80;
const HEADER_AT: usize = ARGS_AT - OUT_HEADER_LEN;

struct Slot {
    inbuf: AlignedBuf,
    out: AlignedBuf,
    pipe: Option<(OwnedFd, OwnedFd, usize)>,
    state: SlotState,
}

pub(crate) fn start(
    shared: &Arc<Shared>,
    cfg: &SessionConfig,
    wakers: &Arc<Mutex<Vec<Waker>>>,
) -> Result<Vec<JoinHandle<()>>, SessionError> {
    let (tx, rx) = mpsc::channel();
    let mut threads = Vec::new();
    for (core, &cpu) in cfg.cpus.iter().enumerate() {
        let dev = shared.mount.clone_fd().map_err(SessionError::Spawn)?;
        set_nonblocking(dev.as_raw_fd()).map_err(SessionError::Spawn)?;
        let waker = Waker::new().map_err(SessionError::Spawn)?;
        wakers.lock().expect("waker list").push(waker.clone());
        let (s, tx) = (shared.clone(), tx.clone());
        let depth = cfg.devfuse_reads_per_core.max(1);
        threads.push(spawn(&format!("etcfs-dev-{cpu}"), move || {
            Worker::run(&s, core, cpu, dev, depth, &waker, &tx)
        })?);
    }
    collect_starts(rx, cfg.cpus.len()).map_err(|e| SessionError::Spawn(io::Error::other(e)))?;
    Ok(threads)
}

struct Worker<'a> {
    shared: &'a Shared,
    core: usize,
    ring: Ring,
    slots: Vec<Slot>,
    dev: OwnedFd,
    recorder: perf::CoreRecorder,
    completions_tx: Sender<DeferredCompletion>,
    waker: &'a Waker,
    /// Per slot, what the handler keeps alive until the slot's device I/O is over.
    holds: Vec<Option<Hold>>,
    live: usize,
    /// How to wait while device I/O is in flight, and what it took so far.
    spin: SpinPolicy,
}

impl<'a> Worker<'a> {
    fn run(
        shared: &'a Shared,
        core: usize,
        cpu: usize,
        dev: OwnedFd,
        depth: usize,
        waker: &'a Waker,
        started: &mpsc::Sender<Result<(), String>>,
    ) {
        settle_worker_thread(shared, &format!("devfuse worker {core}"), cpu);
        let sq_entries_max = ((depth * 8 + 8) as u32).next_power_of_two();
        let ring: Ring = match Ring::new(RingConfig { sq_entries_max }) {
            Ok(r) => r,
            Err(e) => {
                let _ = started.send(Err(format!("io_uring: {e}")));
                return;
            }
        };
        let size = shared.negotiated.payload_max() + REQUEST_HEADER_ROOM;
        // Request and reply buffers in huge pages: device transfers to and from them are
        // then contiguous (see `uring::buf`).
        let (in_len, out_len) = (REQUEST_AT + size, ARGS_AT + size);
        let mut arena = HugeArena::new(HugeArena::size_for(depth, in_len.max(out_len)) * 2)
            .map_err(|e| {
                log::warn!("devfuse worker {core}: no arena for buffers ({e}); using the heap")
            })
            .ok();
        let mut buf = |len: usize| {
            arena
                .as_mut()
                .and_then(|a| a.carve(len))
                .unwrap_or_else(|| AlignedBuf::new(len))
        };
        let slots: Vec<Slot> = (0..depth)
            .map(|_| Slot {
                inbuf: buf(in_len),
                out: buf(out_len),
                pipe: make_pipe()
                    .map_err(|e| log::warn!("no splice pipe: {e}"))
                    .ok(),
                state: SlotState::Reading,
            })
            .collect();
        let (completions_tx, completions_rx) = crossbeam_channel::bounded(depth);
        let mut w = Worker {
            shared,
            core,
            ring,
            live: slots.len(),
            holds: (0..slots.len()).map(|_| None).collect(),
            slots,
            dev,
            recorder: shared.perf.core(core),
            completions_tx,
            waker,
            spin: SpinPolicy::new(shared.device_spin),
        };
        for idx in 0..w.slots.len() {
            w.read_request(idx);
        }
        w.arm_waker();
        let _ = started.send(Ok(()));

        let mut done: Vec<uring::Completion> = Vec::with_capacity(depth * 8 + 1);
        loop {
            let t_batch = w.recorder.timer();
            let batch = done.len();
            for (i, c) in done.drain(..).enumerate() {
                w.complete(c, &t_batch);
                if submit_early(i + 1, batch) {
                    // A failure shows again, and is reported, at the wait below.
                    let _ = w.ring.submit();
                }
            }
            while let Ok(c) = completions_rx.try_recv() {
                w.deferred(c);
            }
            if w.live == 0 || shared.stop.load(Ordering::Relaxed) {
                break;
            }
            let mut in_flight = w.slots.iter().filter_map(|s| match s.state {
                SlotState::DeviceIo(_, ref io) => Some(io),
                _ => None,
            });
            let device_busy = in_flight.clone().next().is_some();
            let plan = device_wait_plan(&mut w.spin, &mut in_flight);
            match w.ring.before_sleep(plan) {
                Ok(waited) => {
                    w.recorder.add_counter(wait_counter(device_busy, waited), 1);
                    w.spin.after_wait(waited);
                }
                Err(e) => {
                    log::warn!("devfuse worker {core}: io_uring_enter: {e}");
                    break;
                }
            }
            if let Err(e) = w.ring.submit_and_wait(1, None) {
                log::warn!("devfuse worker {core}: io_uring_enter: {e}");
                break;
            }
            w.ring.reap(&mut done);
        }
        let Worker { ring, slots, .. } = w;
        let busy = slots.iter().any(|s| !matches!(s.state, SlotState::Dead));
        drop(ring);
        if busy {
            // Reads may still be outstanding in the kernel until the ring's teardown
            // finishes; keep their buffers rather than risk a write into freed memory.
            std::mem::forget(slots);
        }
    }

    fn devfd(&self) -> RawFd {
        self.dev.as_raw_fd()
    }

    fn push(&mut self, sqe: &squeue::Entry) -> bool {
        // SAFETY: callers pass SQEs whose memory is owned by a slot that stays in its
        // current state (and so untouched) until the completion is reaped, or by a write
        // plan's image, which `holds` keeps for the slot until then.
        match unsafe { self.ring.push(sqe) } {
            Ok(()) => true,
            Err(e) => {
                log::error!("cannot queue an SQE: {e}");
                false
            }
        }
    }

    fn arm_waker(&mut self) {
        let sqe = self.waker.poll_entry(TAG_WAKE);
        self.push(&sqe);
    }

    fn read_request(&mut self, idx: usize) {
        let devfd = self.devfd();
        let slot = &mut self.slots[idx];
        slot.state = SlotState::Reading;
        let buf = &mut slot.inbuf[REQUEST_AT..];
        let len = buf.len() as u32;
        let sqe = opcode::Read::new(types::Fd(devfd), buf.as_mut_ptr(), len)
            .build()
            .user_data(TAG_READ_REQ | idx as u64);
        self.push(&sqe);
    }

    fn complete(&mut self, c: uring::Completion, t_batch: &perf::Timer) {
        let idx = (c.user_data & IDX_MASK) as usize;
        let tag = c.user_data & TAG_MASK;
        if tag == TAG_WAKE {
            self.waker.drain();
            self.arm_waker();
            return;
        }
        let Some(slot) = self.slots.get_mut(idx) else {
            return;
        };
        match (tag, slot.state) {
            (TAG_READ_REQ, SlotState::Reading) => {
                if c.result >= 0 {
                    if let Some(wait) = t_batch.elapsed_ns() {
                        let opcode = request::peek_opcode(&slot.inbuf[REQUEST_AT..]).unwrap_or(0);
                        self.recorder
                            .record(op_index(opcode), perf::Stage::QueueWait, wait);
                    }
                    return self.serve(idx, c.result as usize);
                }
                match -c.result {
                    libc::EINTR | libc::EAGAIN | libc::ENOENT => self.read_request(idx),
                    err => {
                        if err != libc::ENODEV {
                            log::warn!("devfuse read: {}", io::Error::from_raw_os_error(err));
                        }
                        slot.state = SlotState::Dead;
                        self.live -= 1;
                    }
                }
            }
            (TAG_WRITE_REPLY, SlotState::Replying) => {
                if c.result == -libc::ENODEV {
                    slot.state = SlotState::Dead;
                    self.live -= 1;
                    return;
                }
                // ENOENT: the request was interrupted and already answered; fine.
                self.read_request(idx);
            }
            (TAG_FILE_READ, SlotState::DeviceIo(p, mut progress)) => {
                progress.segment_done(c.result);
                if progress.in_flight() {
                    slot.state = SlotState::DeviceIo(p, progress);
                    return;
                }
                self.recorder
                    .record_since(p.op, perf::Stage::DeviceIo, &p.started);
                self.finish_io(idx, p, progress);
            }
            (TAG_SPLICE, SlotState::Splicing { p, left, delivered }) => {
                let step = (c.user_data >> 30) & 3;
                let delivered = delivered || (step == 2 && c.result >= 0);
                if left > 1 {
                    slot.state = SlotState::Splicing {
                        p,
                        left: left - 1,
                        delivered,
                    };
                    return;
                }
                if delivered {
                    self.recorder
                        .record_since(p.op, perf::Stage::Total, &p.started);
                    return self.read_request(idx);
                }
                if let Some((r, _, _)) = &slot.pipe {
                    drain_pipe(r.as_raw_fd());
                }
                if c.result == -libc::ENOENT {
                    self.read_request(idx);
                } else {
                    log::warn!("spliced READ reply failed ({}); replying EIO", c.result);
                    self.reply(idx, p, -libc::EIO, 0);
                }
            }
            (tag, state) => log::error!("devfuse: completion {tag:#x} in state {state:?}"),
        }
    }

    fn serve(&mut self, idx: usize, n: usize) {
        let started = self.recorder.timer();
        let ctx = RequestCtx::deferrable(self.core, &self.completions_tx, self.waker, idx as u64);
        let slot = &mut self.slots[idx];
        let msg = &slot.inbuf[REQUEST_AT..(REQUEST_AT + n).min(slot.inbuf.len())];
        let req = match request::decode(msg) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("malformed request on /dev/fuse: {e}");
                return match request::peek_unique(msg) {
                    Some(unique) => {
                        let p = Pending {
                            unique,
                            op: Opcode::UNKNOWN_INDEX,
                            started,
                        };
                        self.reply(idx, p, -libc::EIO, 0)
                    }
                    None => self.read_request(idx),
                };
            }
        };
        let p = Pending {
            unique: req.header.unique,
            op: op_index(req.header.opcode),
            started,
        };
        self.recorder.count(p.op);
        count_request(&self.recorder, &req);
        // Where a WRITE's data starts in the in buffer (address arithmetic, no access).
        let data_at = match req.op {
            Operation::Write { data, .. } => data.as_ptr() as usize - slot.inbuf.as_ptr() as usize,
            _ => 0,
        };
        let t = self.recorder.timer();
        let reply = dispatch(
            self.shared.handler.as_ref(),
            &ctx,
            &req,
            &mut slot.out[ARGS_AT..],
        );
        self.recorder.record_since(p.op, perf::Stage::Handler, &t);
        match reply {
            Reply::None => self.read_request(idx),
            Reply::Bytes(len) => self.reply(idx, p, 0, len),
            Reply::Error(e) => self.reply(idx, p, -e.raw(), 0),
            Reply::Deferred => slot.state = SlotState::Deferred(p),
            Reply::Read(plan) => self.start_read(idx, p, plan, false),
            Reply::Write(plan) => self.start_write(idx, p, plan, data_at),
            Reply::Fd { fd, offset, len } => {
                let len = len.min(slot.out.len() - ARGS_AT);
                let fits_pipe = slot
                    .pipe
                    .as_ref()
                    .is_some_and(|pp| len.div_ceil(PAGE) + 2 <= pp.2 / PAGE);
                if fits_pipe && len > 0 && self.shared.handler.device_io_allowed() {
                    self.splice(idx, p, fd, offset, len);
                } else {
                    let plan = ReadPlan {
                        segments: vec![Segment::Device { fd, offset, len }],
                        skip: 0,
                        len,
                        hold: None,
                    };
                    self.start_read(idx, p, plan, true);
                }
            }
        }
    }

    /// A deferred reply arrived from another thread.
    fn deferred(&mut self, c: DeferredCompletion) {
        let idx = c.token as usize;
        let Some(slot) = self.slots.get_mut(idx) else {
            return;
        };
        let SlotState::Deferred(p) = slot.state else {
            log::error!("deferred reply for slot {idx} in state {:?}", slot.state);
            return;
        };
        let room = slot.out.len() - ARGS_AT;
        match c.outcome {
            DeferredOutcome::Bytes(args) if args.len() <= room => {
                slot.out[ARGS_AT..ARGS_AT + args.len()].copy_from_slice(&args);
                self.reply(idx, p, 0, args.len());
            }
            DeferredOutcome::Bytes(args) => {
                log::error!("deferred reply of {} bytes exceeds the buffer", args.len());
                self.reply(idx, p, -libc::EIO, 0);
            }
            DeferredOutcome::Error(e) => self.reply(idx, p, -e.raw(), 0),
            DeferredOutcome::Read(plan) if plan_fits(&plan, room) => {
                self.start_read(idx, p, plan, false)
            }
            DeferredOutcome::Read(plan) => {
                log::error!("deferred read plan {plan:?} does not fit the buffer");
                self.reply(idx, p, -libc::EIO, 0);
            }
        }
    }

    fn start_read(&mut self, idx: usize, p: Pending, mut plan: ReadPlan, short_is_eof: bool) {
        self.holds[idx] = plan.hold.take();
        let allowed = self.shared.handler.device_io_allowed();
        let mut progress = IoProgress::read(&plan, short_is_eof);
        let mut pos = 0;
        for seg in &plan.segments {
            match *seg {
                Segment::Zero { len } => {
                    self.slots[idx].out[ARGS_AT + pos..ARGS_AT + pos + len].fill(0)
                }
                Segment::Device { len, .. } if !allowed => progress.segment_queued(len, false),
                Segment::Device { fd, offset, len } => {
                    let buf = self.slots[idx].out[ARGS_AT + pos..].as_mut_ptr();
                    let sqe = opcode::Read::new(types::Fd(fd), buf, len as u32)
                        .offset(offset)
                        .build()
                        .user_data(TAG_FILE_READ | idx as u64);
                    progress.segment_queued(len, self.push(&sqe));
                }
            }
            pos += seg.len();
        }
        self.await_io(idx, p, progress);
    }

    /// Writes a WRITE's data from the slot's in buffer (where `data_at` says it starts) to
    /// the device with io_uring WRITEs.
    fn start_write(&mut self, idx: usize, p: Pending, plan: WritePlan, data_at: usize) {
        let allowed = self.shared.handler.device_io_allowed();
        let mut progress = IoProgress::write(plan.written);
        for seg in &plan.segments {
            if !allowed {
                progress.segment_queued(seg.len, false);
                continue;
            }
            // The image's heap block stays where it is while `holds` keeps the image.
            let buf = match &plan.image {
                Some(img) => img[seg.src..seg.src + seg.len].as_ptr(),
                None => {
                    let start = data_at + seg.src;
                    self.slots[idx].inbuf[start..start + seg.len].as_ptr()
                }
            };
            let sqe = opcode::Write::new(types::Fd(seg.fd), buf, seg.len as u32)
                .offset(seg.offset)
                .build()
                .user_data(TAG_FILE_READ | idx as u64);
            progress.segment_queued(seg.len, self.push(&sqe));
        }
        self.holds[idx] = super::keep_until_written(plan.hold, plan.image);
        self.await_io(idx, p, progress);
    }

    /// Parks the slot until its device I/O completes, or answers at once if none was queued.
    fn await_io(&mut self, idx: usize, p: Pending, progress: IoProgress) {
        progress.count(&self.recorder);
        if progress.in_flight() {
            self.slots[idx].state = SlotState::DeviceIo(p, progress);
        } else {
            self.finish_io(idx, p, progress);
        }
    }

    fn finish_io(&mut self, idx: usize, p: Pending, progress: IoProgress) {
        self.holds[idx] = None;
        let (err, len) = progress.finish(&mut self.slots[idx].out[ARGS_AT..]);
        self.reply(idx, p, err, len);
    }

    fn reply(&mut self, idx: usize, p: Pending, error: i32, len: usize) {
        let devfd = self.devfd();
        let slot = &mut self.slots[idx];
        let len = if error == 0 { len } else { 0 };
        count_reply(&self.recorder, p.op, error, len);
        slot.out[HEADER_AT..ARGS_AT].copy_from_slice(&out_header(p.unique, error, len));
        slot.state = SlotState::Replying;
        let sqe = opcode::Write::new(
            types::Fd(devfd),
            slot.out[HEADER_AT..].as_ptr(),
            (OUT_HEADER_LEN + len) as u32,
        )
        .build()
        .user_data(TAG_WRITE_REPLY | idx as u64);
        self.push(&sqe);
        self.recorder
            .record_since(p.op, perf::Stage::Total, &p.started);
    }

    /// Header into the slot's pipe, file range into the pipe, pipe into the device: three
    /// linked SQEs, so the data never passes through user memory.
    fn splice(&mut self, idx: usize, p: Pending, fd: RawFd, offset: u64, len: usize) {
        // Counted as asked for, as the reads of a plan are: a short splice (EOF) or a
        // failed one (answered EIO) is rare enough not to track through the chain.
        count_device_io(&self.recorder, false, 1, len as u64);
        count_reply(&self.recorder, p.op, 0, len);
        let devfd = self.devfd();
        let slot = &mut self.slots[idx];
        let Some((pr, pw)) = slot
            .pipe
            .as_ref()
            .map(|(r, w, _)| (r.as_raw_fd(), w.as_raw_fd()))
        else {
            return;
        };
        slot.out[HEADER_AT..ARGS_AT].copy_from_slice(&out_header(p.unique, 0, len));
        slot.state = SlotState::Splicing {
            p,
            left: 3,
            delivered: false,
        };
        let link = squeue::Flags::IO_LINK;
        let header = opcode::Write::new(
            types::Fd(pw),
            slot.out[HEADER_AT..].as_ptr(),
            OUT_HEADER_LEN as u32,
        )
        .build()
        .flags(link)
        .user_data(TAG_SPLICE | idx as u64);
        let off_in = i64::try_from(offset).unwrap_or(i64::MAX);
        let data = opcode::Splice::new(types::Fd(fd), off_in, types::Fd(pw), -1, len as u32)
            .build()
            .flags(link)
            .user_data(TAG_SPLICE | (1 << 30) | idx as u64);
        let to_dev = opcode::Splice::new(
            types::Fd(pr),
            -1,
            types::Fd(devfd),
            -1,
            (OUT_HEADER_LEN + len) as u32,
        )
        .flags(libc::SPLICE_F_MOVE)
        .build()
        .user_data(TAG_SPLICE | (2 << 30) | idx as u64);
        self.push(&header);
        self.push(&data);
        self.push(&to_dev);
    }
}

fn make_pipe() -> io::Result<(OwnedFd, OwnedFd, usize)> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two fds into a live array of two.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let (r, w) = (owned(fds[0])?, owned(fds[1])?);
    // SAFETY: fcntl on a pipe fd we own; F_SETPIPE_SZ takes an int.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES_WANTED) };
    // SAFETY: F_GETPIPE_SZ takes no argument.
    let size = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_GETPIPE_SZ) };
    if size < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((r, w, size as usize))
}

/// Empties a pipe left half-filled by a failed splice chain.
fn drain_pipe(fd: RawFd) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let mut avail: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int into a live local.
        if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut avail) } != 0 || avail <= 0 {
            return;
        }
        let want = (avail as usize).min(buf.len());
        // SAFETY: reads at most `want` bytes, available in the pipe, into a live buffer.
        if unsafe { libc::read(fd, buf.as_mut_ptr().cast(), want) } <= 0 {
            return;
        }
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on an fd we own.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
