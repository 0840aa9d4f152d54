//! Tickets: how a submitter learns a mutation's (or read's) result without being forced
//! to block. A core can block on [`Ticket::wait`], poll [`Ticket::try_take`], register a
//! wake callback with [`Ticket::on_complete`] (the daemon signals the core's eventfd
//! from it), or `.await` it.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    task::{Context, Poll, Waker},
};

use crate::error::MetaError;

type Callback = Box<dyn FnOnce() + Send>;

struct State<T> {
    result: Option<Result<T, MetaError>>,
    taken: bool,
    callback: Option<Callback>,
    waker: Option<Waker>,
}

struct Slot<T> {
    state: Mutex<State<T>>,
    cv: Condvar,
}

impl<T> Slot<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Callbacks run outside the lock, so a panicking callback cannot poison it.
        self.state
            .lock()
            .expect("ticket lock is never held across user code")
    }
}

/// The submitter's side: the eventual result of one request.
pub struct Ticket<T> {
    slot: Arc<Slot<T>>,
}

/// The pipeline's side: completes a ticket exactly once.
pub(crate) struct Completer<T> {
    slot: Option<Arc<Slot<T>>>,
}

impl<T> std::fmt::Debug for Ticket<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("done", &self.is_done())
            .finish()
    }
}

/// Creates a connected ticket/completer pair.
pub(crate) fn ticket<T>() -> (Ticket<T>, Completer<T>) {
    let slot = Arc::new(Slot {
        state: Mutex::new(State {
            result: None,
            taken: false,
            callback: None,
            waker: None,
        }),
        cv: Condvar::new(),
    });
    (
        Ticket { slot: slot.clone() },
        Completer { slot: Some(slot) },
    )
}

impl<T> Ticket<T> {
    /// Whether the result is available (or already taken).
    pub fn is_done(&self) -> bool {
        let s = self.slot.lock();
        s.result.is_some() || s.taken
    }

    /// Takes the result if it is ready. Returns `None` before completion and after the
    /// result was taken once.
    pub fn try_take(&self) -> Option<Result<T, MetaError>> {
        let mut s = self.slot.lock();
        let r = s.result.take();
        if r.is_some() {
            s.taken = true;
        }
        r
    }

    /// Blocks the calling thread until the result is ready.
    pub fn wait(self) -> Result<T, MetaError> {
        let mut s = self.slot.lock();
        loop {
            if let Some(r) = s.result.take() {
                s.taken = true;
                return r;
            }
            if s.taken {
                return Err(MetaError::Closed);
            }
            s = self
                .slot
                .cv
                .wait(s)
                .expect("ticket lock is never held across user code");
        }
    }

    /// Runs `f` once the result is ready (on the pipeline thread, so keep it short: the
    /// daemon writes a core's eventfd). Runs immediately if already complete.
    pub fn on_complete(&self, f: impl FnOnce() + Send + 'static) {
        let mut s = self.slot.lock();
        if s.result.is_some() || s.taken {
            drop(s);
            f();
        } else {
            s.callback = Some(Box::new(f));
        }
    }
}

impl<T> Future for Ticket<T> {
    type Output = Result<T, MetaError>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.slot.lock();
        if let Some(r) = s.result.take() {
            s.taken = true;
            return Poll::Ready(r);
        }
        if s.taken {
            return Poll::Ready(Err(MetaError::Closed));
        }
        s.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl<T> Completer<T> {
    /// Delivers the result and wakes whoever waits.
    pub(crate) fn complete(mut self, r: Result<T, MetaError>) {
        self.finish(r);
    }

    fn finish(&mut self, r: Result<T, MetaError>) {
        let Some(slot) = self.slot.take() else { return };
        let (cb, waker) = {
            let mut s = slot.lock();
            s.result = Some(r);
            (s.callback.take(), s.waker.take())
        };
        slot.cv.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
        if let Some(cb) = cb {
            cb();
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        // A request dropped without an answer (pipeline shut down) must not leave its
        // submitter waiting forever.
        self.finish(Err(MetaError::Closed));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[test]
    fn wait_callback_and_drop() {
        let (t, c) = ticket::<u32>();
        let fired = Arc::new(AtomicBool::new(false));
        let f = fired.clone();
        t.on_complete(move || f.store(true, Ordering::SeqCst));
        assert!(!t.is_done());
        let h = std::thread::spawn(move || c.complete(Ok(7)));
        assert_eq!(t.wait(), Ok(7));
        h.join().unwrap();
        assert!(fired.load(Ordering::SeqCst));
        let (t, c) = ticket::<u32>();
        drop(c);
        assert_eq!(t.wait(), Err(MetaError::Closed));
        let (t, c) = ticket::<u32>();
        c.complete(Ok(1));
        assert_eq!(t.try_take(), Some(Ok(1)));
        assert_eq!(t.try_take(), None);
    }
}
