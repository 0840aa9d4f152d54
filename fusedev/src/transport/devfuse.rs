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
use uring::{cpu, AlignedBuf, Ring, RingConfig, Waker};

use super::{
    collect_starts, dispatch, op_index, out_header, spawn, SessionConfig, SessionError, Shared,
    OUT_HEADER_LEN, REQUEST_HEADER_ROOM,
};
use crate::{mount::owned, request, server::Reply};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// A READ of the device is outstanding.
    Reading,
    /// The reply in `out` is being written to the device.
    Replying,
    /// A READ reply's data is being read from a file into `out`.
    ReadingFile { unique: u64, op: usize },
    /// The three linked splice SQEs are in flight; `left` of them have not completed.
    Splicing {
        unique: u64,
        left: u8,
        failed: bool,
        delivered: bool,
    },
    /// The connection is gone.
    Dead,
}

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
            worker(&s, core, cpu, &dev, depth, &waker, &tx)
        })?);
    }
    collect_starts(rx, cfg.cpus.len()).map_err(|e| SessionError::Spawn(io::Error::other(e)))?;
    Ok(threads)
}

fn worker(
    shared: &Shared,
    core: usize,
    cpu: usize,
    dev: &OwnedFd,
    depth: usize,
    waker: &Waker,
    started: &mpsc::Sender<Result<(), String>>,
) {
    if let Err(e) = cpu::pin_current_thread(cpu) {
        log::warn!("devfuse worker {core}: cannot pin to CPU {cpu}: {e}");
    }
    let sq_entries_max = ((depth * 4 + 8) as u32).next_power_of_two();
    let mut ring: Ring = match Ring::new(RingConfig { sq_entries_max }) {
        Ok(r) => r,
        Err(e) => {
            let _ = started.send(Err(format!("io_uring: {e}")));
            return;
        }
    };
    let size = shared.negotiated.max_write as usize + REQUEST_HEADER_ROOM;
    let mut slots: Vec<Slot> = (0..depth)
        .map(|_| Slot {
            inbuf: AlignedBuf::new(size),
            out: AlignedBuf::new(OUT_HEADER_LEN + size),
            pipe: make_pipe()
                .map_err(|e| log::warn!("no splice pipe: {e}"))
                .ok(),
            state: SlotState::Reading,
        })
        .collect();
    let devfd = dev.as_raw_fd();
    for (i, slot) in slots.iter_mut().enumerate() {
        push_read(&mut ring, devfd, slot, i);
    }
    // SAFETY: the poll references only the eventfd, which `waker` keeps open.
    let _ = unsafe { ring.push(&waker.poll_entry(TAG_WAKE)) };
    let _ = started.send(Ok(()));

    let recorder = shared.perf.core(core);
    let mut done: Vec<uring::Completion> = Vec::with_capacity(depth * 4 + 1);
    let mut live = slots.len();
    loop {
        let t_batch = recorder.timer();
        for c in done.drain(..) {
            let idx = (c.user_data & IDX_MASK) as usize;
            let tag = c.user_data & TAG_MASK;
            if tag == TAG_WAKE {
                waker.drain();
                // SAFETY: as above.
                let _ = unsafe { ring.push(&waker.poll_entry(TAG_WAKE)) };
                continue;
            }
            let Some(slot) = slots.get_mut(idx) else {
                continue;
            };
            match (tag, slot.state) {
                (TAG_READ_REQ, SlotState::Reading) => {
                    if c.result < 0 {
                        match -c.result {
                            libc::EINTR | libc::EAGAIN | libc::ENOENT => {
                                push_read(&mut ring, devfd, slot, idx)
                            }
                            err => {
                                if err != libc::ENODEV {
                                    log::warn!(
                                        "devfuse read: {}",
                                        io::Error::from_raw_os_error(err)
                                    );
                                }
                                slot.state = SlotState::Dead;
                                live -= 1;
                            }
                        }
                        continue;
                    }
                    let t = recorder.timer();
                    if let Some(wait) = t_batch.elapsed_ns() {
                        let opcode = request::peek_opcode(&slot.inbuf).unwrap_or(0);
                        recorder.record(op_index(opcode), perf::Stage::QueueWait, wait);
                    }
                    handle_one(
                        shared,
                        core,
                        &mut ring,
                        devfd,
                        slot,
                        idx,
                        c.result as usize,
                        &recorder,
                    );
                    if let SlotState::Replying = slot.state {
                        let op = op_index(request::peek_opcode(&slot.inbuf).unwrap_or(0));
                        recorder.record_since(op, perf::Stage::Total, &t);
                    }
                }
                (TAG_WRITE_REPLY, SlotState::Replying) => {
                    if c.result < 0 && -c.result == libc::ENODEV {
                        slot.state = SlotState::Dead;
                        live -= 1;
                        continue;
                    }
                    // ENOENT: the request was interrupted and already answered; fine.
                    push_read(&mut ring, devfd, slot, idx);
                }
                (TAG_FILE_READ, SlotState::ReadingFile { unique, op }) => {
                    let (error, len) = if c.result < 0 {
                        (c.result, 0)
                    } else {
                        (0, c.result as usize)
                    };
                    recorder.record_since(op, perf::Stage::DeviceIo, &t_batch);
                    push_reply(&mut ring, devfd, slot, idx, unique, error, len);
                }
                (
                    TAG_SPLICE,
                    SlotState::Splicing {
                        unique,
                        left,
                        failed,
                        delivered,
                    },
                ) => {
                    let step = (c.user_data >> 30) & 3;
                    let ok = c.result >= 0;
                    let delivered = delivered || (step == 2 && ok);
                    let failed = failed || !ok;
                    if left > 1 {
                        slot.state = SlotState::Splicing {
                            unique,
                            left: left - 1,
                            failed,
                            delivered,
                        };
                        continue;
                    }
                    if delivered {
                        push_read(&mut ring, devfd, slot, idx);
                    } else {
                        if let Some((r, _, _)) = &slot.pipe {
                            drain_pipe(r.as_raw_fd());
                        }
                        if c.result == -libc::ENOENT {
                            push_read(&mut ring, devfd, slot, idx);
                        } else {
                            log::warn!("spliced READ reply failed ({}); replying EIO", c.result);
                            push_reply(&mut ring, devfd, slot, idx, unique, -libc::EIO, 0);
                        }
                    }
                }
                (tag, state) => log::error!("devfuse: completion {tag:#x} in state {state:?}"),
            }
        }
        if live == 0 || shared.stop.load(Ordering::Relaxed) {
            break;
        }
        if let Err(e) = ring.submit_and_wait(1, None) {
            log::warn!("devfuse worker {core}: io_uring_enter: {e}");
            break;
        }
        ring.reap(&mut done);
    }
    let busy = slots.iter().any(|s| s.state != SlotState::Dead);
    drop(ring);
    if busy {
        // Reads may still be outstanding in the kernel until the ring's teardown finishes;
        // keep their buffers rather than risk a write into freed memory.
        std::mem::forget(slots);
    }
}

#[allow(clippy::too_many_arguments)]
fn handle_one(
    shared: &Shared,
    core: usize,
    ring: &mut Ring,
    devfd: RawFd,
    slot: &mut Slot,
    idx: usize,
    n: usize,
    recorder: &perf::CoreRecorder,
) {
    let msg = &slot.inbuf[..n.min(slot.inbuf.len())];
    let req = match request::decode(msg) {
        Ok(r) => r,
        Err(e) => {
            log::warn!("malformed request on /dev/fuse: {e}");
            match request::peek_unique(msg) {
                Some(unique) => push_reply(ring, devfd, slot, idx, unique, -libc::EIO, 0),
                None => push_read(ring, devfd, slot, idx),
            }
            return;
        }
    };
    let unique = req.header.unique;
    let op = op_index(req.header.opcode);
    recorder.count(op);
    let t = recorder.timer();
    let reply = dispatch(
        shared.handler.as_ref(),
        core,
        &req,
        &mut slot.out[OUT_HEADER_LEN..],
    );
    recorder.record_since(op, perf::Stage::Handler, &t);
    match reply {
        Reply::None => push_read(ring, devfd, slot, idx),
        Reply::Bytes(len) => push_reply(ring, devfd, slot, idx, unique, 0, len),
        Reply::Error(e) => push_reply(ring, devfd, slot, idx, unique, -e.raw(), 0),
        Reply::Fd { fd, offset, len } => {
            let len = len.min(slot.out.len() - OUT_HEADER_LEN);
            let fits_pipe = slot
                .pipe
                .as_ref()
                .is_some_and(|p| len.div_ceil(PAGE) + 2 <= p.2 / PAGE);
            if fits_pipe && len > 0 {
                push_splice(ring, devfd, slot, idx, unique, fd, offset, len);
            } else {
                slot.state = SlotState::ReadingFile { unique, op };
                let buf = slot.out[OUT_HEADER_LEN..].as_mut_ptr();
                let sqe = opcode::Read::new(types::Fd(fd), buf, len as u32)
                    .offset(offset)
                    .build()
                    .user_data(TAG_FILE_READ | idx as u64);
                // SAFETY: `out` belongs to the slot, which waits for this completion before
                // its buffer is used again.
                push(ring, &sqe);
            }
        }
    }
}

fn push(ring: &mut Ring, sqe: &squeue::Entry) {
    // SAFETY: callers pass SQEs whose memory is owned by a slot that stays in its current
    // state (and so untouched) until the completion is reaped.
    if let Err(e) = unsafe { ring.push(sqe) } {
        log::error!("cannot queue an SQE: {e}");
    }
}

fn push_read(ring: &mut Ring, devfd: RawFd, slot: &mut Slot, idx: usize) {
    slot.state = SlotState::Reading;
    let len = slot.inbuf.len() as u32;
    let sqe = opcode::Read::new(types::Fd(devfd), slot.inbuf.as_mut_ptr(), len)
        .build()
        .user_data(TAG_READ_REQ | idx as u64);
    push(ring, &sqe);
}

fn push_reply(
    ring: &mut Ring,
    devfd: RawFd,
    slot: &mut Slot,
    idx: usize,
    unique: u64,
    error: i32,
    len: usize,
) {
    let len = if error == 0 { len } else { 0 };
    slot.out[..OUT_HEADER_LEN].copy_from_slice(&out_header(unique, error, len));
    slot.state = SlotState::Replying;
    let sqe = opcode::Write::new(
        types::Fd(devfd),
        slot.out.as_ptr(),
        (OUT_HEADER_LEN + len) as u32,
    )
    .build()
    .user_data(TAG_WRITE_REPLY | idx as u64);
    push(ring, &sqe);
}

#[allow(clippy::too_many_arguments)]
fn push_splice(
    ring: &mut Ring,
    devfd: RawFd,
    slot: &mut Slot,
    idx: usize,
    unique: u64,
    fd: RawFd,
    offset: u64,
    len: usize,
) {
    let (pr, pw) = match &slot.pipe {
        Some((r, w, _)) => (r.as_raw_fd(), w.as_raw_fd()),
        None => return,
    };
    slot.out[..OUT_HEADER_LEN].copy_from_slice(&out_header(unique, 0, len));
    slot.state = SlotState::Splicing {
        unique,
        left: 3,
        failed: false,
        delivered: false,
    };
    let link = squeue::Flags::IO_LINK;
    let header = opcode::Write::new(types::Fd(pw), slot.out.as_ptr(), OUT_HEADER_LEN as u32)
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
    push(ring, &header);
    push(ring, &data);
    push(ring, &to_dev);
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
