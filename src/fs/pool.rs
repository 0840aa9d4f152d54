//! The waiter threads: they run operations that wait for etcd, so cores never do.
//!
//! A core takes the request's deferred reply, queues the operation here and goes on
//! serving. The queue is bounded (`queue_max` operations). It is sized above what the
//! transports can have in flight (every queued operation holds a ring entry or a
//! `/dev/fuse` slot until answered), so it fills only on a machine with more CPUs than it
//! was sized for; then the operation is answered EAGAIN at once: a core never runs an
//! operation that waits for etcd, which would stall every request of its queue behind one
//! that waits for a slow etcd.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    thread::JoinHandle,
};

use crossbeam_channel::{bounded, Sender, TrySendError};
use fusedev::{errno::Errno, server::DeferredReply};

use super::{Done, Inner};

/// An operation run on a waiter.
type Op = Box<dyn FnOnce(&Inner) -> Result<Done, Errno> + Send>;

/// An operation and the reply it answers.
struct Job {
    reply: DeferredReply,
    op: Op,
}

pub(crate) struct Pool {
    tx: Mutex<Option<Sender<Job>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    inner: Arc<Inner>,
    /// Operations answered EAGAIN because the queue was full.
    refused: AtomicU64,
}

fn complete(d: DeferredReply, r: Result<Done, Errno>) {
    match r {
        Ok(Done::Bytes(b)) => d.bytes(b),
        Ok(Done::Empty) => d.bytes(Vec::new()),
        Ok(Done::Read(p)) => d.read(p),
        Err(e) => d.error(e),
    }
}

impl Pool {
    pub(crate) fn new(threads: usize, queue_max: usize, inner: Arc<Inner>) -> Pool {
        let (tx, rx) = bounded::<Job>(queue_max);
        let handles = (0..threads)
            .filter_map(|n| {
                let (rx, inner) = (rx.clone(), inner.clone());
                std::thread::Builder::new()
                    .name(format!("etcfs-wait-{n}"))
                    .spawn(move || {
                        while let Ok(job) = rx.recv() {
                            complete(job.reply, (job.op)(&inner));
                        }
                    })
                    .map_err(|e| log::error!("spawning waiter thread {n}: {e}"))
                    .ok()
            })
            .collect();
        Pool {
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(handles),
            inner,
            refused: AtomicU64::new(0),
        }
    }

    /// Operations refused so far because the queue was full.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Runs `f` on a waiter and answers `d` with its result; EAGAIN when the queue is
    /// full. After the pool stopped (unmount), `f` runs here: nothing else would.
    pub(crate) fn run<F>(&self, d: DeferredReply, f: F)
    where
        F: FnOnce(&Inner) -> Result<Done, Errno> + Send + 'static,
    {
        let tx = self
            .tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(tx) = tx else {
            complete(d, f(&self.inner));
            return;
        };
        let job = Job {
            reply: d,
            op: Box::new(f),
        };
        match tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) => {
                let n = self.refused.fetch_add(1, Ordering::Relaxed);
                if n.is_power_of_two() || n == 0 {
                    log::warn!(
                        "waiter queue full ({} operations wait for etcd): answering EAGAIN \
                         ({} so far)",
                        tx.capacity().unwrap_or(0),
                        n + 1
                    );
                }
                job.reply.error(Errno::EAGAIN);
            }
        }
    }

    /// Lets queued operations finish and stops the threads.
    pub(crate) fn drain(&self) {
        self.tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let threads =
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(PoisonError::into_inner));
        let me = std::thread::current().id();
        for t in threads {
            // DESTROY may be answered by a waiter itself; never join oneself.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}
