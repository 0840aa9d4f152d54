//! The lease deadline a node serves under, and the arithmetic behind it.
//!
//! etcd expires a lease TTL seconds after the leader last renewed it, and the leader
//! renews on *receiving* a keepalive, which is after this node sent it. So a renewal sent
//! at local monotonic time `s` and acknowledged with `ttl` keeps the lease alive until at
//! least `s + ttl` on any clock that runs at the rate of ours (a leader change only
//! extends leases). Once the lease has expired, other nodes may take this node's groups
//! and locks and write the blocks it was writing; nothing on a block device checks a
//! fencing token, so the node itself must have stopped by then.
//!
//! A [`Fence`] holds `s + ttl - margin` for the current session: device I/O is submitted
//! only while the clock is before it, so an I/O submitted at the last moment has `margin`
//! to complete before anyone else may act. A renewal that arrives moves it forward; one
//! that does not leaves it to run out, and a node that was frozen (SIGSTOP, a stall)
//! finds it passed the moment it wakes, before its next I/O. Once closed, a fence stays
//! closed for that session: the node registers a new one (with its own locks and groups)
//! rather than trusting anything cached under the old one.
//!
//! etcd mutations are fenced separately and exactly: every commit compares the session's
//! membership key, which etcd deletes with the lease (`pipeline::commit`).

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};

use crate::{clock::Clock, types::SessionId};

/// Fewest seconds of margin between the fence and the lease's earliest expiry: the
/// longest a device I/O submitted just before the fence may take (and the time between
/// the check and the submission) with time to spare.
pub const MARGIN_MIN: Duration = Duration::from_secs(1);

/// How long before the lease's earliest expiry this node stops device I/O: a fifth of
/// the TTL, at least [`MARGIN_MIN`]. For the default 10 s TTL, 2 s.
pub fn margin(ttl: Duration) -> Duration {
    (ttl / 5).max(MARGIN_MIN)
}

/// How often the lease is renewed: a quarter of the TTL, so that with the margin taken
/// off, about two more attempts fit after a failed one before the fence closes (10 s TTL:
/// every 2.5 s; failures retried every [`RETRY_EVERY`] until the fence).
pub fn renew_every(ttl: Duration) -> Duration {
    (ttl / 4).max(Duration::from_millis(250))
}

/// How soon a failed renewal is tried again.
pub const RETRY_EVERY: Duration = Duration::from_millis(250);

/// Where the fence lies for a renewal sent at `sent` and acknowledged with `ttl` left.
pub fn fence_after(sent: Duration, ttl: Duration) -> Duration {
    (sent + ttl).saturating_sub(margin(ttl))
}

/// The monotonic instant (on the node's [`Clock`]) after which the current session may
/// no longer start device I/O. Cheap to check: one atomic load and one clock read.
pub struct Fence {
    clock: Arc<dyn Clock>,
    /// Nanoseconds of `clock.mono()` at which the fence closes; 0 while closed.
    until_ns: AtomicU64,
    /// The session the fence is open for; 0 while closed.
    session: AtomicU64,
    /// Serialises writers (readers use the atomics: see [`Fence::open_for`]).
    write: Mutex<()>,
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence")
            .field("until_ns", &self.until_ns.load(Ordering::Relaxed))
            .field("session", &self.session.load(Ordering::Relaxed))
            .finish()
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Fence {
    /// A closed fence on `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Fence {
            clock,
            until_ns: AtomicU64::new(0),
            session: AtomicU64::new(0),
            write: Mutex::new(()),
        }
    }

    /// The clock the fence is read against.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Whether device I/O may start now (under whichever session is current).
    pub fn open(&self) -> bool {
        let until = self.until_ns.load(Ordering::Acquire);
        until != 0 && nanos(self.clock.mono()) < until
    }

    /// Whether device I/O may start now for work begun under `session`.
    pub fn open_for(&self, session: SessionId) -> bool {
        // `arm` stores the session before the deadline, so a deadline seen here was
        // stored with (at least) the session read after it.
        let until = self.until_ns.load(Ordering::Acquire);
        until != 0
            && self.session.load(Ordering::Acquire) == session.0
            && nanos(self.clock.mono()) < until
    }

    /// Time left before the fence closes (zero once closed).
    pub fn left(&self) -> Duration {
        let until = self.until_ns.load(Ordering::Acquire);
        Duration::from_nanos(until.saturating_sub(nanos(self.clock.mono())))
    }

    /// Opens the fence for a newly registered `session` until `until` (monotonic).
    pub fn arm(&self, session: SessionId, until: Duration) {
        let _w = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        self.session.store(session.0, Ordering::Release);
        self.until_ns.store(nanos(until).max(1), Ordering::Release);
    }

    /// Moves the fence of `session` forward to `until`; nothing if it is closed or now
    /// belongs to another session (a late renewal of a session already given up).
    pub fn renew(&self, session: SessionId, until: Duration) -> bool {
        let _w = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = self.until_ns.load(Ordering::Acquire);
        if cur == 0 || self.session.load(Ordering::Acquire) != session.0 {
            return false;
        }
        self.until_ns
            .store(cur.max(nanos(until).max(1)), Ordering::Release);
        true
    }

    /// Closes the fence if `session` is the one it is open for (or for any session when
    /// `None`). True when this call closed it.
    pub fn close(&self, session: Option<SessionId>) -> bool {
        let _w = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = self.session.load(Ordering::Acquire);
        if session.is_some_and(|s| s.0 != cur) || self.until_ns.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.until_ns.store(0, Ordering::Release);
        self.session.store(0, Ordering::Release);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn fence() -> (Arc<ManualClock>, Fence) {
        let c = Arc::new(ManualClock::new(crate::types::Timespec::new(0, 0)));
        (c.clone(), Fence::new(c))
    }

    #[test]
    fn arithmetic_of_the_default_ttl() {
        let ttl = Duration::from_secs(10);
        assert_eq!(margin(ttl), Duration::from_secs(2));
        assert_eq!(renew_every(ttl), Duration::from_millis(2500));
        assert_eq!(
            fence_after(Duration::from_secs(100), ttl),
            Duration::from_secs(108)
        );
        // Short TTLs keep a whole second of margin.
        assert_eq!(margin(Duration::from_secs(4)), MARGIN_MIN);
        assert_eq!(
            fence_after(Duration::ZERO, Duration::from_secs(1)),
            Duration::ZERO
        );
    }

    #[test]
    fn opens_closes_and_runs_out() {
        let (c, f) = fence();
        let s = SessionId(7);
        assert!(!f.open(), "a new fence is closed");
        f.arm(s, Duration::from_secs(8));
        assert!(f.open() && f.open_for(s) && !f.open_for(SessionId(8)));
        c.advance(Duration::from_secs(7));
        assert!(f.open());
        assert_eq!(f.left(), Duration::from_secs(1));
        c.advance(Duration::from_secs(1));
        assert!(!f.open() && !f.open_for(s), "the deadline itself is closed");
        // A renewal moves it forward again while it is armed.
        assert!(f.renew(s, Duration::from_secs(20)));
        assert!(f.open());
        assert!(f.close(Some(s)));
        assert!(!f.open());
        assert!(!f.renew(s, Duration::from_secs(30)), "closed stays closed");
        assert!(!f.open());
    }

    #[test]
    fn a_late_renewal_of_an_old_session_changes_nothing() {
        let (_c, f) = fence();
        f.arm(SessionId(1), Duration::from_secs(5));
        assert!(f.close(None));
        f.arm(SessionId(2), Duration::from_secs(3));
        assert!(!f.renew(SessionId(1), Duration::from_secs(60)));
        assert_eq!(f.left(), Duration::from_secs(3));
        assert!(!f.close(Some(SessionId(1))), "nor does its close");
        assert!(f.open_for(SessionId(2)) && !f.open_for(SessionId(1)));
    }

    #[test]
    fn renewals_never_move_it_back() {
        let (_c, f) = fence();
        f.arm(SessionId(1), Duration::from_secs(9));
        assert!(f.renew(SessionId(1), Duration::from_secs(4)));
        assert_eq!(f.left(), Duration::from_secs(9));
    }
}
