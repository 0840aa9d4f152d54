//! FUSE-over-io_uring: the kernel writes each request into a buffer pair we registered on a
//! per-CPU queue, and one `URING_CMD` (COMMIT_AND_FETCH) both sends the reply and re-arms
//! the entry for the next request.
//!
//! Layout of the 288-byte header buffer (kernel ABI): `in_out` (the in header on delivery,
//! the out header on reply) at 0..128, the opcode's first argument at 128..256, and the
//! entry's `{flags, commit_id, payload_sz}` at 256..288. Everything else of the request
//! (names, WRITE data) is in the payload buffer, and the reply's arguments go there too.

use std::{
    sync::{atomic::Ordering, mpsc, Arc, Mutex},
    thread::JoinHandle,
    time::Duration,
};

use io_uring::{opcode, squeue::Entry128, types};
use uring::{cpu, AlignedBuf, Ring, RingConfig, Waker};

use super::{
    collect_starts, dispatch, op_index, out_header, spawn, SessionConfig, Shared,
    REQUEST_HEADER_ROOM,
};
use crate::{errno::Errno, request, server::Reply};

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
const HEADER_LEN: usize = 288;
const OP_IN_OFFSET: usize = 128;
const ENT_OFFSET: usize = 256;
const IN_HEADER_LEN: usize = 40;

/// `user_data` tags: the low 32 bits are the entry index.
const TAG_CMD: u64 = 0;
const TAG_DATA_READ: u64 = 1 << 32;
const TAG_WAKE: u64 = 2 << 32;
const TAG_MASK: u64 = 0xffff_ffff << 32;

/// What an entry is doing.
#[derive(Debug, Clone, Copy)]
enum EntryState {
    /// Registered or committed: parked in the kernel, waiting for a request.
    InKernel,
    /// A READ reply's data is being read from a file into the payload.
    ReadingData {
        unique: u64,
        commit_id: u64,
        op: usize,
        started: perf::Timer,
    },
    /// The kernel ended the entry (unmount): it will not be used again.
    Dead,
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
    for (core, (&cpu, queues)) in cfg.cpus.iter().zip(queues_of).enumerate() {
        let waker = match Waker::new() {
            Ok(w) => w,
            Err(e) => return Err((threads, format!("eventfd: {e}"))),
        };
        wakers.lock().expect("waker list").push(waker.clone());
        let (s, tx) = (shared.clone(), tx.clone());
        let entries = cfg.ring_entries_per_queue;
        match spawn(&format!("etcfs-ring-{cpu}"), move || {
            worker(&s, core, cpu, &queues, entries, &waker, &tx)
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

fn worker(
    shared: &Shared,
    core: usize,
    cpu: usize,
    queues: &[u16],
    entries_per_queue: usize,
    waker: &Waker,
    started: &mpsc::Sender<Result<(), String>>,
) {
    if let Err(e) = cpu::pin_current_thread(cpu) {
        log::warn!("ring worker {core}: cannot pin to CPU {cpu}: {e}");
    }
    let entries_max = queues.len() * entries_per_queue;
    let sq_entries_max = (entries_max * 2 + 8).next_power_of_two() as u32;
    let mut ring: Ring<Entry128> = match Ring::new(RingConfig { sq_entries_max }) {
        Ok(r) => r,
        Err(e) => {
            let _ = started.send(Err(format!("io_uring with SQE128: {e}")));
            return;
        }
    };
    let payload_len = (shared.negotiated.max_write as usize)
        .max(shared.negotiated.max_pages as usize * 4096)
        .max(8192);
    let mut entries: Vec<Entry> = Vec::with_capacity(entries_max);
    for &qid in queues {
        for _ in 0..entries_per_queue {
            let mut header = AlignedBuf::new(HEADER_LEN);
            let mut payload = AlignedBuf::new(payload_len);
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
    let devfd = shared.mount.fd();
    for (i, e) in entries.iter().enumerate() {
        let sqe = register_sqe(devfd, e, i);
        // SAFETY: the iovecs and both buffers belong to `entries`, which is neither resized
        // nor dropped while the kernel holds them (see the end of this function).
        if let Err(err) = unsafe { ring.push(&sqe) } {
            let _ = started.send(Err(format!("queue REGISTER: {err}")));
            return;
        }
    }
    // SAFETY: the poll references only the eventfd, which `waker` keeps open.
    let _ = unsafe { ring.push(&Entry128::from(waker.poll_entry(TAG_WAKE))) };
    let mut done: Vec<uring::Completion> = Vec::with_capacity(entries_max + 1);
    // A REGISTER that the kernel accepts completes only when a request arrives; one it
    // rejects completes at once with an error. Give rejections a moment to show.
    let _ = ring.submit_and_wait(1, Some(Duration::from_millis(100)));
    ring.reap(&mut done);
    if let Some(c) = done
        .iter()
        .find(|c| c.user_data & TAG_MASK == TAG_CMD && c.result < 0)
    {
        let err = Errno::from_raw(-c.result)
            .map(|e| e.to_string())
            .unwrap_or_default();
        let _ = started.send(Err(format!("REGISTER on queue {queues:?} failed: {err}")));
        // Entries the kernel accepted still hold our buffers; they are released with the ring.
        drop(ring);
        std::mem::forget(entries);
        return;
    }
    let _ = started.send(Ok(()));

    let recorder = shared.perf.core(core);
    let mut scratch_in = vec![0u8; REQUEST_HEADER_ROOM + 64 * 1024];
    let mut scratch_out = vec![0u8; REQUEST_HEADER_ROOM];
    let mut live = entries.len();
    let mut t_batch = recorder.timer();
    loop {
        for c in done.drain(..) {
            let idx = (c.user_data & !TAG_MASK) as usize;
            match c.user_data & TAG_MASK {
                TAG_WAKE => {
                    waker.drain();
                    // SAFETY: as above, the poll references only the eventfd.
                    let _ = unsafe { ring.push(&Entry128::from(waker.poll_entry(TAG_WAKE))) };
                }
                TAG_CMD => {
                    let Some(e) = entries.get_mut(idx) else {
                        continue;
                    };
                    if c.result < 0 {
                        match -c.result {
                            libc::EAGAIN | libc::EINTR => {
                                let sqe = register_sqe(devfd, e, idx);
                                // SAFETY: as for the first REGISTER.
                                let _ = unsafe { ring.push(&sqe) };
                            }
                            err => {
                                if err != libc::ENOTCONN {
                                    log::warn!(
                                        "ring entry {idx}: {}",
                                        std::io::Error::from_raw_os_error(err)
                                    );
                                }
                                e.state = EntryState::Dead;
                                live -= 1;
                            }
                        }
                        continue;
                    }
                    let t_total = recorder.timer();
                    if let Some(wait) = t_batch.elapsed_ns() {
                        recorder.record(op_index(peek_opcode(e)), perf::Stage::QueueWait, wait);
                    }
                    let outcome = serve(
                        shared,
                        core,
                        e,
                        &mut scratch_in,
                        &mut scratch_out,
                        &recorder,
                    );
                    match outcome {
                        Served::Reply { op } => {
                            push_commit(&mut ring, devfd, e, idx);
                            recorder.record_since(op, perf::Stage::Total, &t_total);
                        }
                        Served::ReadData {
                            fd,
                            offset,
                            len,
                            unique,
                            commit_id,
                            op,
                        } => {
                            e.state = EntryState::ReadingData {
                                unique,
                                commit_id,
                                op,
                                started: t_total,
                            };
                            let len = len.min(e.payload.len()) as u32;
                            let sqe = opcode::Read::new(types::Fd(fd), e.payload.as_mut_ptr(), len)
                                .offset(offset)
                                .build()
                                .user_data(TAG_DATA_READ | idx as u64);
                            // SAFETY: the payload belongs to the entry, which is not handed
                            // back to the kernel until this read completes.
                            let _ = unsafe { ring.push(&Entry128::from(sqe)) };
                        }
                    }
                }
                TAG_DATA_READ => {
                    let Some(e) = entries.get_mut(idx) else {
                        continue;
                    };
                    let EntryState::ReadingData {
                        unique,
                        commit_id,
                        op,
                        started,
                    } = e.state
                    else {
                        continue;
                    };
                    let (error, len) = if c.result < 0 {
                        (c.result, 0)
                    } else {
                        (0, c.result as usize)
                    };
                    write_reply(e, unique, commit_id, error, len);
                    push_commit(&mut ring, devfd, e, idx);
                    recorder.record_since(op, perf::Stage::DeviceIo, &t_batch);
                    recorder.record_since(op, perf::Stage::Total, &started);
                }
                _ => {}
            }
        }
        if live == 0 || shared.stop.load(Ordering::Relaxed) {
            break;
        }
        if let Err(e) = ring.submit_and_wait(1, None) {
            log::warn!("ring worker {core}: io_uring_enter: {e}");
            break;
        }
        ring.reap(&mut done);
        t_batch = recorder.timer();
    }
    drop(ring);
    if live > 0 {
        // Stopped while entries were still registered: the kernel drops them when the ring
        // closes, but it may finish doing so after we return, so the buffers stay allocated
        // until the process exits rather than risk the kernel writing into freed memory.
        std::mem::forget(entries);
    }
}

enum Served {
    /// The reply is in the entry's buffers: commit it.
    Reply { op: usize },
    /// The reply's data must first be read from a file into the payload.
    ReadData {
        fd: i32,
        offset: u64,
        len: usize,
        unique: u64,
        commit_id: u64,
        op: usize,
    },
}

/// Decodes the request in `e`, runs the handler and leaves the reply in `e`.
fn serve(
    shared: &Shared,
    core: usize,
    e: &mut Entry,
    scratch_in: &mut Vec<u8>,
    scratch_out: &mut [u8],
    recorder: &perf::CoreRecorder,
) -> Served {
    let ent = &e.header[ENT_OFFSET..ENT_OFFSET + 32];
    let commit_id = u64::from_ne_bytes(ent[8..16].try_into().expect("8 bytes"));
    let payload_sz = (u32::from_ne_bytes(ent[16..20].try_into().expect("4 bytes")) as usize)
        .min(e.payload.len());
    let in_len = u32::from_ne_bytes(e.header[0..4].try_into().expect("4 bytes")) as usize;
    let opcode = u32::from_ne_bytes(e.header[4..8].try_into().expect("4 bytes"));
    let unique = u64::from_ne_bytes(e.header[8..16].try_into().expect("8 bytes"));
    let op = op_index(opcode);
    recorder.count(op);
    let arg0_len = in_len.saturating_sub(IN_HEADER_LEN + payload_sz).min(128);
    let is_write = opcode == crate::opcode::Opcode::Write as u32;
    let t_handler = recorder.timer();
    let reply = {
        let hdr = &e.header[..IN_HEADER_LEN];
        let arg0 = &e.header[OP_IN_OFFSET..OP_IN_OFFSET + arg0_len];
        if is_write {
            // WRITE data stays where the kernel put it; the small reply is built aside.
            match request::decode_parts(hdr, arg0, &e.payload[..payload_sz]) {
                Ok(req) => dispatch(shared.handler.as_ref(), core, &req, scratch_out),
                Err(err) => decode_failed(opcode, unique, &err),
            }
        } else {
            // Names and values are copied aside so the handler can write its reply (a READ's
            // data, say) straight into the payload the kernel will copy out.
            if scratch_in.len() < payload_sz {
                scratch_in.resize(payload_sz, 0);
            }
            scratch_in[..payload_sz].copy_from_slice(&e.payload[..payload_sz]);
            match request::decode_parts(hdr, arg0, &scratch_in[..payload_sz]) {
                Ok(req) => dispatch(shared.handler.as_ref(), core, &req, &mut e.payload),
                Err(err) => decode_failed(opcode, unique, &err),
            }
        }
    };
    recorder.record_since(op, perf::Stage::Handler, &t_handler);
    let (error, len) = match reply {
        Reply::Bytes(n) => {
            if is_write {
                e.payload[..n].copy_from_slice(&scratch_out[..n]);
            }
            (0, n)
        }
        Reply::Error(err) => (-err.raw(), 0),
        // Requests that take no reply never arrive on the ring; answer defensively so the
        // entry is not lost.
        Reply::None => (-libc::ENOSYS, 0),
        Reply::Fd { fd, offset, len } => {
            return Served::ReadData {
                fd,
                offset,
                len,
                unique,
                commit_id,
                op,
            };
        }
    };
    write_reply(e, unique, commit_id, error, len);
    Served::Reply { op }
}

fn peek_opcode(e: &Entry) -> u32 {
    u32::from_ne_bytes(e.header[4..8].try_into().expect("4 bytes"))
}

fn decode_failed(opcode: u32, unique: u64, err: &request::DecodeError) -> Reply {
    log::warn!("malformed request (opcode {opcode}, unique {unique}) on the ring: {err}");
    Reply::Error(Errno::EIO)
}

fn write_reply(e: &mut Entry, unique: u64, _commit_id: u64, error: i32, len: usize) {
    let len = if error == 0 { len } else { 0 };
    e.header[..16].copy_from_slice(&out_header(unique, error, len));
    let sz = u32::try_from(len).expect("payload below 4 GiB");
    e.header[ENT_OFFSET + 16..ENT_OFFSET + 20].copy_from_slice(&sz.to_ne_bytes());
    e.state = EntryState::InKernel;
}

fn push_commit(ring: &mut Ring<Entry128>, devfd: i32, e: &Entry, idx: usize) {
    let ent = &e.header[ENT_OFFSET..ENT_OFFSET + 32];
    let commit_id = u64::from_ne_bytes(ent[8..16].try_into().expect("8 bytes"));
    let sqe =
        uring::ring::uring_cmd80(devfd, CMD_COMMIT_AND_FETCH, 0, 0, cmd_req(commit_id, e.qid))
            .user_data(TAG_CMD | idx as u64);
    // SAFETY: COMMIT_AND_FETCH reuses the buffers registered for this entry, which live as
    // long as `entries` in the worker.
    if let Err(err) = unsafe { ring.push(&sqe) } {
        log::error!("cannot queue COMMIT_AND_FETCH: {err}");
    }
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
