//! Commit markers: how a transaction whose answer was lost is decided, never guessed.
//!
//! A commit transaction can fail after etcd applied it (the leader died between applying
//! and answering, the connection broke, the answer timed out). Resending it blindly could
//! apply it twice; reporting an error would fail an application although etcd may be
//! fine a second later. So every commit transaction of a registered session also creates
//! its own marker key `T<session><seq>` (compared absent, leased to the session). When an
//! answer is lost, [`resolve`] creates the same key with the value [`GIVEN_UP`] if it is
//! still absent. etcd applies one of the two first and the other's compare fails, so
//! exactly one of these holds afterwards:
//!
//! * the marker is empty: the transaction committed (at the marker's revision);
//! * the marker says [`GIVEN_UP`]: it never will, and the mutation is resent;
//! * the session's member key is gone: the session ended, and neither can apply.
//!
//! Markers are deleted in ranges by later transactions once nothing can still need
//! them. A given-up marker is kept for [`GIVEN_UP_HOLD`] first, since the transaction it
//! blocks may still be on its way to etcd (queued in a dying leader's log, say); deleting
//! the marker early would let it apply after its mutation was resent.

use std::{
    collections::{BTreeSet, VecDeque},
    time::Duration,
};

use crate::{
    error::KvError,
    keys::Keyspace,
    kv::{Compare, KvBackend, PutOp, Txn, TxnOp, TxnOpResponse},
    types::SessionId,
};

/// The value of a marker written by [`resolve`].
pub(crate) const GIVEN_UP: &[u8] = b"x";
/// How long a given-up marker outlives its resolution.
pub(crate) const GIVEN_UP_HOLD: Duration = Duration::from_secs(60);
/// How long the first attempt to decide waits for etcd (later ones wait twice as long).
pub(crate) const ATTEMPT_FIRST: Duration = Duration::from_secs(1);
/// Answered markers are deleted once this many have gathered (one range delete each time).
pub(crate) const CLEAN_EVERY: u64 = 32;

/// What happened to a transaction whose answer was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resolution {
    /// It committed, at this revision.
    Applied(i64),
    /// It did not and never will: resend.
    NotApplied,
    /// The session's lease is gone; nothing of it can commit.
    SessionLost,
}

/// The markers of the session transactions currently commit under.
#[derive(Debug, Default)]
pub(crate) struct Markers {
    /// `None` before the first transaction.
    session: Option<SessionId>,
    next: u64,
    /// Sent and not yet known committed or given up.
    open: BTreeSet<u64>,
    /// Given up (or left unknown), with the monotonic time they may be deleted after.
    held: VecDeque<(u64, Duration)>,
    /// Every marker below this is deleted (or was never written).
    clean_below: u64,
}

impl Markers {
    /// The number for a new transaction of `session`. A new session starts a new range:
    /// the old one's markers went with its lease.
    pub(crate) fn begin(&mut self, session: SessionId) -> u64 {
        if self.session != Some(session) {
            self.session = Some(session);
            self.open.clear();
            self.held.clear();
            self.clean_below = self.next;
        }
        let seq = self.next;
        self.next += 1;
        self.open.insert(seq);
        seq
    }

    /// The transaction's outcome is known and nothing can apply it later.
    pub(crate) fn answered(&mut self, seq: u64) {
        self.open.remove(&seq);
    }

    /// The transaction was given up, or its outcome stays unknown: keep its marker (and
    /// every later one) until `until`.
    pub(crate) fn hold(&mut self, seq: u64, until: Duration) {
        self.open.remove(&seq);
        self.held.push_back((seq, until));
    }

    /// Markers of `session` that a transaction sent now may delete, when enough have
    /// gathered: those from the last range known deleted on. Not from 0: etcd keeps a
    /// deleted key in its index until a compaction, and a delete walks every key of its
    /// range, so each cleaning from 0 walked every marker the session had ever written
    /// (without compaction, creates slowed from 2 ms to 6.5 ms of etcd CPU each).
    pub(crate) fn cleanable(
        &mut self,
        session: SessionId,
        now: Duration,
    ) -> Option<std::ops::Range<u64>> {
        if self.session != Some(session) {
            return None;
        }
        while self.held.front().is_some_and(|&(_, until)| until <= now) {
            self.held.pop_front();
        }
        let low = [
            self.open.first().copied(),
            self.held.iter().map(|&(s, _)| s).min(),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(self.next);
        (low >= self.clean_below + CLEAN_EVERY).then_some(self.clean_below..low)
    }

    /// A transaction that deleted the markers below `end` committed.
    pub(crate) fn cleaned(&mut self, session: SessionId, end: u64) {
        if self.session == Some(session) {
            self.clean_below = self.clean_below.max(end);
        }
    }
}

/// Decides a lost answer of transaction `seq` of `session` (see the module notes),
/// retrying while etcd does not answer, for at most `budget`.
pub(crate) async fn resolve(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    session: SessionId,
    seq: u64,
    budget: Duration,
) -> Result<Resolution, KvError> {
    let member = keys.member(session);
    let marker = keys.txn_marker(session, seq);
    let txn = Txn {
        compares: vec![
            Compare::exists(member.clone()),
            Compare::absent(marker.clone()),
        ],
        success: vec![TxnOp::Put(PutOp {
            key: marker.clone(),
            value: GIVEN_UP.to_vec(),
            lease: lease_of(session),
        })],
        failure: vec![
            TxnOp::Range(crate::kv::RangeRequest::key(marker)),
            TxnOp::Range(crate::kv::RangeRequest::key(member)),
        ],
    };
    let start = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(50);
    let mut wait = ATTEMPT_FIRST;
    loop {
        // Short attempts: a request stuck behind a dead leader is abandoned and sent
        // again (to a live member) rather than waited out. Safe, since it is idempotent.
        let left = budget.saturating_sub(start.elapsed());
        let attempt = wait.min(left);
        wait = (wait * 2).min(budget);
        let answer = match tokio::time::timeout(attempt, kv.txn(txn.clone())).await {
            Ok(a) => a,
            Err(_) => Err(KvError::Unavailable(format!(
                "no answer within {attempt:?} while deciding a commit whose answer was lost"
            ))),
        };
        match answer {
            Ok(r) if r.succeeded => return Ok(Resolution::NotApplied),
            Ok(r) => {
                let found = |i: usize| match r.responses.get(i) {
                    Some(TxnOpResponse::Range(rr)) => rr.kvs.first().cloned(),
                    _ => None,
                };
                if let Some(kv) = found(0) {
                    return Ok(if kv.value == GIVEN_UP {
                        // An earlier attempt of ours gave it up, and its answer was lost.
                        Resolution::NotApplied
                    } else {
                        Resolution::Applied(kv.mod_revision)
                    });
                }
                if found(1).is_none() {
                    return Ok(Resolution::SessionLost);
                }
                // Both compares held yet the failure branch ran: not an etcd we know.
                return Err(KvError::Other(
                    "marker transaction failed with its compares true".into(),
                ));
            }
            Err(e) if e.write_refused() => return Err(e),
            Err(e) => {
                if start.elapsed() + pause >= budget {
                    return Err(e);
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(400));
            }
        }
    }
}

/// A session id is its lease id (see `Session`).
pub(crate) fn lease_of(session: SessionId) -> i64 {
    i64::try_from(session.0).unwrap_or(0)
}

/// The marker a commit transaction of `session` creates.
pub(crate) fn marker_ops(keys: &Keyspace, session: SessionId, seq: u64) -> (Compare, TxnOp) {
    let key = keys.txn_marker(session, seq);
    (
        Compare::absent(key.clone()),
        TxnOp::Put(PutOp {
            key,
            value: Vec::new(),
            lease: lease_of(session),
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: SessionId = SessionId(7);

    #[test]
    fn answered_markers_are_cleaned_in_ranges_below_the_oldest_open_one() {
        let mut m = Markers::default();
        let seqs: Vec<u64> = (0..CLEAN_EVERY + 5).map(|_| m.begin(S)).collect();
        assert_eq!(m.cleanable(S, Duration::ZERO), None, "all still open");
        for &s in &seqs[1..] {
            m.answered(s);
        }
        assert_eq!(
            m.cleanable(S, Duration::ZERO),
            None,
            "the first is still open"
        );
        m.answered(seqs[0]);
        let range = m.cleanable(S, Duration::ZERO).unwrap();
        assert_eq!(range, 0..seqs[0] + CLEAN_EVERY + 5);
        assert_eq!(m.cleanable(SessionId(8), Duration::ZERO), None);
        m.cleaned(S, range.end);
        assert_eq!(m.cleanable(S, Duration::ZERO), None, "nothing new gathered");
        // The next range starts where the last one deleted ended.
        for _ in 0..CLEAN_EVERY {
            let s = m.begin(S);
            m.answered(s);
        }
        let next = m.cleanable(S, Duration::ZERO).unwrap();
        assert_eq!(next.start, range.end);
        assert_eq!(next.end, range.end + CLEAN_EVERY);
        // Not known deleted (the transaction failed): the same range again, and more.
        let s = m.begin(S);
        m.answered(s);
        assert_eq!(m.cleanable(S, Duration::ZERO).unwrap().start, range.end);
    }

    #[test]
    fn a_given_up_marker_stays_until_its_hold_ends() {
        let mut m = Markers::default();
        let first = m.begin(S);
        for _ in 0..2 * CLEAN_EVERY {
            let s = m.begin(S);
            m.answered(s);
        }
        m.hold(first, Duration::from_secs(60));
        assert_eq!(m.cleanable(S, Duration::from_secs(59)), None);
        assert_eq!(
            m.cleanable(S, Duration::from_secs(60)).map(|r| r.end),
            Some(first + 1 + 2 * CLEAN_EVERY)
        );
    }

    #[test]
    fn a_new_session_forgets_the_old_ones_markers() {
        let mut m = Markers::default();
        let old = m.begin(S);
        let s2 = SessionId(9);
        let first = m.begin(s2);
        assert!(first > old);
        m.answered(first);
        for _ in 0..CLEAN_EVERY {
            let s = m.begin(s2);
            m.answered(s);
        }
        // The old session's open marker does not pin the new session's cleaning.
        assert_eq!(
            m.cleanable(s2, Duration::ZERO).map(|r| r.end),
            Some(first + 1 + CLEAN_EVERY)
        );
    }
}
