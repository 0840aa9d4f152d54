//! This node's own commits, by etcd revision, for a watch on the same prefix.
//!
//! A watcher that sees its own node's change at revision `R` usually has nothing to do
//! beyond its own caches: whoever asked for the change already has the answer. The
//! committer records the revision of every transaction it commits ([`OwnCommits::sent`],
//! [`OwnCommits::resolved`]), and the watcher asks, revision by revision, whether one was
//! ours ([`OwnCommits::classify`]).
//!
//! A watch event can arrive before the commit's response has been processed (both come
//! from etcd at about the same time, on different streams). So `classify(R)` first waits
//! for every transaction still in flight that could have committed at `R` (those sent
//! before any revision `>= R` was known here), each for at most the given time after it
//! was sent. Whatever cannot be decided counts as not ours: a transaction that failed
//! with an unknown result, one slower than the wait, and a revision forgotten because
//! the watcher fell more than [`OWN_REVISIONS_MAX`] own commits behind.
//!
//! Only a transaction that changed something has a revision of its own: etcd does not
//! bump the revision for one whose writes were all deletes of absent keys, and its
//! response carries the current revision (possibly another node's change).

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicU64, Ordering},
        Condvar, Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant},
};

use crate::kv::{TxnOpResponse, TxnResponse};

/// Own committed revisions remembered for the watcher (24 bytes each, plus the inodes of
/// unanswered timestamp writes). Past it the oldest are forgotten (and then reported as
/// not ours).
pub const OWN_REVISIONS_MAX: usize = 16384;

struct InFlight {
    seq: u64,
    /// The highest revision known when the transaction was sent: it commits after it.
    floor: i64,
    sent: Instant,
}

#[derive(Default)]
struct State {
    /// Own committed revisions the watcher has not passed, ascending, each with the
    /// inodes whose new attributes no reply carried.
    revs: VecDeque<(i64, Vec<u64>)>,
    /// Transactions sent and not resolved (at most `txns_in_flight_max`).
    in_flight: Vec<InFlight>,
    next_seq: u64,
    /// The highest revision known to exist (responses, and revisions the watcher saw).
    known: i64,
    /// The watcher's last classified revision: later records below it are useless.
    passed: i64,
}

/// Whether a revision was this node's own commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Committed by this node. `unreplied`: inodes whose attributes the transaction
    /// changed without any submitter being answered (coalesced timestamp writes).
    Own {
        /// Inode numbers.
        unreplied: Vec<u64>,
    },
    /// Another node's commit, or not known to be ours.
    Other,
}

/// The shared record (see the module docs). The committer and one watcher use it; no
/// request path does.
#[derive(Default)]
pub struct OwnCommits {
    state: Mutex<State>,
    changed: Condvar,
    forgotten: AtomicU64,
    waited_out: AtomicU64,
}

impl std::fmt::Debug for OwnCommits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnCommits").finish_non_exhaustive()
    }
}

/// Whether a successful transaction changed anything (so its revision is its own).
pub fn changed_something(resp: &TxnResponse) -> bool {
    resp.succeeded
        && resp.responses.iter().any(|r| match r {
            TxnOpResponse::Put => true,
            TxnOpResponse::Delete { deleted, .. } => *deleted > 0,
            TxnOpResponse::Range(_) => false,
        })
}

impl OwnCommits {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A write transaction is about to be sent; pass the returned number to
    /// [`OwnCommits::resolved`] once it is answered, whatever the answer.
    pub fn sent(&self) -> u64 {
        let mut s = self.lock();
        let seq = s.next_seq;
        s.next_seq += 1;
        let floor = s.known;
        s.in_flight.push(InFlight {
            seq,
            floor,
            sent: Instant::now(),
        });
        seq
    }

    /// The transaction `seq` was answered: `committed` is its revision and the inodes of
    /// its unanswered timestamp writes when it committed a change; `seen` any revision
    /// the answer showed (a failed compare's read).
    pub fn resolved(&self, seq: u64, committed: Option<(i64, Vec<u64>)>, seen: Option<i64>) {
        let mut s = self.lock();
        s.in_flight.retain(|f| f.seq != seq);
        if let Some(r) = seen {
            s.known = s.known.max(r);
        }
        if let Some((rev, unreplied)) = committed {
            s.known = s.known.max(rev);
            if rev > s.passed {
                let at = s.revs.partition_point(|(r, _)| *r < rev);
                if s.revs.get(at).is_none_or(|(r, _)| *r != rev) {
                    s.revs.insert(at, (rev, unreplied));
                }
                while s.revs.len() > OWN_REVISIONS_MAX {
                    s.revs.pop_front();
                    self.forgotten.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        drop(s);
        self.changed.notify_all();
    }

    /// Whether revision `rev` was committed here, waiting up to `wait` after each
    /// possibly responsible transaction was sent for it to be answered. Revisions must
    /// be asked in ascending order (a watch); older records are dropped.
    pub fn classify(&self, rev: i64, wait: Duration) -> Origin {
        let mut s = self.lock();
        loop {
            let now = Instant::now();
            let until = s
                .in_flight
                .iter()
                .filter(|f| f.floor < rev)
                .map(|f| f.sent + wait)
                .filter(|d| *d > now)
                .max();
            let Some(until) = until else { break };
            s = self
                .changed
                .wait_timeout(s, until - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        if s.in_flight.iter().any(|f| f.floor < rev) {
            self.waited_out.fetch_add(1, Ordering::Relaxed);
        }
        s.known = s.known.max(rev);
        s.passed = s.passed.max(rev);
        while s.revs.front().is_some_and(|(r, _)| *r < rev) {
            s.revs.pop_front();
        }
        match s.revs.front() {
            Some((r, _)) if *r == rev => {
                let unreplied = s.revs.pop_front().map(|(_, u)| u).unwrap_or_default();
                Origin::Own { unreplied }
            }
            _ => Origin::Other,
        }
    }

    /// `(own revisions forgotten unseen, classifications that gave up waiting)`.
    pub fn counters(&self) -> (u64, u64) {
        (
            self.forgotten.load(Ordering::Relaxed),
            self.waited_out.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::TxnOpResponse;

    const WAIT: Duration = Duration::from_secs(5);

    #[test]
    fn own_revisions_are_recognised_once_in_order() {
        let o = OwnCommits::default();
        for rev in [12, 10] {
            let seq = o.sent();
            o.resolved(seq, Some((rev, vec![])), None);
        }
        assert_eq!(o.classify(9, WAIT), Origin::Other);
        assert_eq!(o.classify(10, WAIT), Origin::Own { unreplied: vec![] });
        assert_eq!(o.classify(11, WAIT), Origin::Other);
        let seq = o.sent();
        o.resolved(seq, Some((13, vec![7])), None);
        assert_eq!(o.classify(12, WAIT), Origin::Own { unreplied: vec![] });
        assert_eq!(o.classify(13, WAIT), Origin::Own { unreplied: vec![7] });
        // Asked once: a replayed revision is not ours any more (when unsure, notify).
        assert_eq!(o.classify(13, WAIT), Origin::Other);
        // A record arriving after the watcher passed it is dropped.
        let seq = o.sent();
        o.resolved(seq, Some((5, vec![])), None);
        assert_eq!(o.counters(), (0, 0));
    }

    #[test]
    fn a_watch_event_waits_for_the_response_of_a_txn_in_flight() {
        let o = std::sync::Arc::new(OwnCommits::default());
        let seq = o.sent();
        let o2 = o.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            o2.resolved(seq, Some((20, vec![])), None);
        });
        assert_eq!(o.classify(19, WAIT), Origin::Other, "after the response");
        t.join().unwrap();
        // A txn sent once revision 20 was known commits after it: 20 does not wait for
        // it, 21 does.
        let _late = o.sent();
        let t0 = Instant::now();
        assert_eq!(o.classify(20, WAIT), Origin::Own { unreplied: vec![] });
        assert!(t0.elapsed() < WAIT);
        let short = Duration::from_millis(30);
        assert_eq!(o.classify(21, short), Origin::Other);
        assert!(t0.elapsed() >= short, "waited for the txn that may be 21");
    }

    #[test]
    fn a_txn_in_flight_is_waited_for_at_most_the_wait() {
        let o = OwnCommits::default();
        let _stuck = o.sent();
        let t0 = Instant::now();
        assert_eq!(o.classify(3, Duration::from_millis(30)), Origin::Other);
        assert!(t0.elapsed() >= Duration::from_millis(30));
        // Its time is up: later revisions do not wait for it again.
        let t0 = Instant::now();
        assert_eq!(o.classify(4, Duration::from_millis(30)), Origin::Other);
        assert!(t0.elapsed() < Duration::from_millis(30));
        assert_eq!(o.counters().1, 2);
    }

    #[test]
    fn the_record_is_bounded_and_forgets_the_oldest() {
        let o = OwnCommits::default();
        for rev in 1..=(OWN_REVISIONS_MAX as i64 + 10) {
            let seq = o.sent();
            o.resolved(seq, Some((rev, vec![])), None);
        }
        assert_eq!(o.counters().0, 10);
        assert_eq!(o.classify(5, WAIT), Origin::Other, "forgotten: not ours");
        assert_eq!(o.classify(11, WAIT), Origin::Own { unreplied: vec![] });
    }

    #[test]
    fn only_a_txn_that_changed_something_owns_its_revision() {
        let resp = |responses: Vec<TxnOpResponse>| TxnResponse {
            succeeded: true,
            revision: 9,
            responses,
        };
        assert!(changed_something(&resp(vec![TxnOpResponse::Put])));
        assert!(!changed_something(&resp(vec![TxnOpResponse::Delete {
            deleted: 0,
            prev_kvs: vec![]
        }])));
        assert!(changed_something(&resp(vec![TxnOpResponse::Delete {
            deleted: 1,
            prev_kvs: vec![]
        }])));
        assert!(!changed_something(&resp(vec![])));
    }
}
