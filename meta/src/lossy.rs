//! A backend for tests that applies writes and loses their answers, as a client sees an
//! etcd leader killed between applying a request and answering it.
//!
//! [`Lossy`] sits in front of another backend (the model). Told to lose the answers of
//! the next N write transactions (those a filter picks), lease grants, renewals or
//! revokes, it passes each such request on, lets it apply, and answers `Unavailable`.
//! It can also refuse write transactions unapplied, as an etcd down for longer.
//! It counts the write transactions it passed on, so a test can tell a write that was
//! sent once from one that was sent again.

use std::sync::{Arc, Mutex, PoisonError};

use crate::{
    error::KvError,
    kv::{
        Alarm, BoxFut, ClusterMember, ClusterStatus, KvBackend, LeaseGrant, LeaseTtl, RangeRequest,
        RangeResponse, Txn, TxnOp, TxnResponse, WatchStream,
    },
};

/// Picks the write transactions whose answers may be lost.
pub type TxnFilter = Arc<dyn Fn(&Txn) -> bool + Send + Sync>;

/// How many answers to lose from now on (each applied first).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Losses {
    /// Write transactions the filter picks.
    pub txns: u32,
    /// Write transactions the filter picks refused (`Unavailable`) without applying, as
    /// by an etcd that stays unreachable (after [`Losses::txns`] are spent).
    pub refused_txns: u32,
    /// Lease grants.
    pub grants: u32,
    /// Lease renewals.
    pub keepalives: u32,
    /// Lease revokes.
    pub revokes: u32,
}

#[derive(Default)]
struct State {
    losses: Losses,
    filter: Option<TxnFilter>,
    /// Write transactions the filter picks, passed on (answered or not).
    sent: u64,
    /// Answers lost so far.
    lost: u64,
}

/// A backend that loses answers of applied requests on demand.
pub struct Lossy {
    inner: Arc<dyn KvBackend>,
    state: Mutex<State>,
}

impl std::fmt::Debug for Lossy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lossy").finish_non_exhaustive()
    }
}

/// Whether a transaction writes (anything but a plain read).
pub fn writes(txn: &Txn) -> bool {
    !(txn.compares.is_empty()
        && txn.failure.is_empty()
        && txn.success.iter().all(|op| matches!(op, TxnOp::Range(_))))
}

enum LeaseOp {
    Grant,
    Keepalive,
    Revoke,
}

impl Lossy {
    /// In front of `inner`, losing nothing until told to.
    pub fn new(inner: Arc<dyn KvBackend>) -> Self {
        Lossy {
            inner,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Loses these answers from now on (replacing what was left to lose).
    pub fn set_losses(&self, losses: Losses) {
        self.state().losses = losses;
    }

    /// Only write transactions `filter` picks lose answers and are counted (`None`: all).
    pub fn set_filter(&self, filter: Option<TxnFilter>) {
        self.state().filter = filter;
    }

    /// The write transactions the filter picks that were passed on so far.
    pub fn writes_sent(&self) -> u64 {
        self.state().sent
    }

    /// The answers lost so far.
    pub fn lost(&self) -> u64 {
        self.state().lost
    }

    /// What is left to lose.
    pub fn losses_left(&self) -> Losses {
        self.state().losses
    }

    /// Whether the next `op` loses its answer (and counts it lost).
    fn take_lease_loss(&self, op: LeaseOp) -> bool {
        let mut s = self.state();
        let left = match op {
            LeaseOp::Grant => &mut s.losses.grants,
            LeaseOp::Keepalive => &mut s.losses.keepalives,
            LeaseOp::Revoke => &mut s.losses.revokes,
        };
        let lose = *left > 0;
        if lose {
            *left -= 1;
            s.lost += 1;
        }
        lose
    }
}

fn lost<T>() -> Result<T, KvError> {
    Err(KvError::Unavailable("answer lost (injected)".into()))
}

impl KvBackend for Lossy {
    fn range(&self, req: RangeRequest) -> BoxFut<'_, Result<RangeResponse, KvError>> {
        self.inner.range(req)
    }

    fn txn(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
        Box::pin(async move {
            let lose = {
                let mut s = self.state();
                let picked = writes(&txn) && s.filter.as_ref().is_none_or(|f| f(&txn));
                if picked {
                    s.sent += 1;
                }
                let lose = picked && s.losses.txns > 0;
                if lose {
                    s.losses.txns -= 1;
                    s.lost += 1;
                } else if picked && s.losses.refused_txns > 0 {
                    s.losses.refused_txns -= 1;
                    return Err(KvError::Unavailable("refused (injected)".into()));
                }
                lose
            };
            let answer = self.inner.txn(txn).await;
            if lose && answer.is_ok() {
                return lost();
            }
            answer
        })
    }

    fn lease_grant(&self, ttl_s: i64) -> BoxFut<'_, Result<LeaseGrant, KvError>> {
        Box::pin(async move {
            let lose = self.take_lease_loss(LeaseOp::Grant);
            let answer = self.inner.lease_grant(ttl_s).await;
            if lose && answer.is_ok() {
                return lost();
            }
            answer
        })
    }

    fn lease_keepalive(&self, id: i64) -> BoxFut<'_, Result<i64, KvError>> {
        Box::pin(async move {
            let lose = self.take_lease_loss(LeaseOp::Keepalive);
            let answer = self.inner.lease_keepalive(id).await;
            if lose && answer.is_ok() {
                return lost();
            }
            answer
        })
    }

    fn lease_revoke(&self, id: i64) -> BoxFut<'_, Result<(), KvError>> {
        Box::pin(async move {
            let lose = self.take_lease_loss(LeaseOp::Revoke);
            let answer = self.inner.lease_revoke(id).await;
            if lose && answer.is_ok() {
                return lost();
            }
            answer
        })
    }

    fn watch(
        &self,
        key: Vec<u8>,
        range_end: Vec<u8>,
        start_revision: i64,
    ) -> BoxFut<'_, Result<WatchStream, KvError>> {
        self.inner.watch(key, range_end, start_revision)
    }

    fn lease_time_to_live(&self, id: i64) -> BoxFut<'_, Result<LeaseTtl, KvError>> {
        self.inner.lease_time_to_live(id)
    }

    fn member_list(&self) -> BoxFut<'_, Result<Vec<ClusterMember>, KvError>> {
        self.inner.member_list()
    }

    fn status(&self) -> BoxFut<'_, Result<ClusterStatus, KvError>> {
        self.inner.status()
    }

    fn alarms(&self) -> BoxFut<'_, Result<Vec<Alarm>, KvError>> {
        self.inner.alarms()
    }
}
