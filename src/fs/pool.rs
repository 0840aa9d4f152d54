//! The waiter threads: they run operations that wait for etcd, so cores never do.
//!
//! A core takes the request's deferred reply, queues the operation here and goes on
//! serving. The queue is bounded (`queue_max` operations); when it is full the core runs
//! the operation itself, which is the back-pressure an overloaded pipeline should exert.

use std::{
    sync::{Arc, Mutex, PoisonError},
    thread::JoinHandle,
};

use crossbeam_channel::{bounded, Sender, TrySendError};
use fusedev::{errno::Errno, server::DeferredReply};

use super::{Done, Inner};

type Job = Box<dyn FnOnce(&Inner) + Send>;

pub(crate) struct Pool {
    tx: Mutex<Option<Sender<Job>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    inner: Arc<Inner>,
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
                            job(&inner);
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
        }
    }

    /// Runs `f` on a waiter (or here when the queue is full or the pool stopped) and
    /// answers `d` with its result.
    pub(crate) fn run<F>(&self, d: DeferredReply, f: F)
    where
        F: FnOnce(&Inner) -> Result<Done, Errno> + Send + 'static,
    {
        let job: Job = Box::new(move |i: &Inner| complete(d, f(i)));
        let tx = self
            .tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let job = match tx {
            Some(tx) => match tx.try_send(job) {
                Ok(()) => return,
                Err(TrySendError::Full(j) | TrySendError::Disconnected(j)) => j,
            },
            None => job,
        };
        job(&self.inner);
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
