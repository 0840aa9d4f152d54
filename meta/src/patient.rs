//! A backend that rides out short etcd outages: a request that etcd did not answer is sent
//! again for a bounded time when sending it twice is safe. That is
//!
//! * a range, or a transaction that only reads: reads change nothing;
//! * a transaction its caller declares idempotent ([`KvBackend::txn_idempotent`]: a second
//!   application gives the outcome of one, which the caller arranged);
//! * a lease grant (a lease granted by an attempt whose answer was lost holds no key and
//!   just expires), a renewal (renewing twice is renewing), and a revoke (a revoke that
//!   finds the lease gone after an earlier attempt went unanswered has done its work).
//!
//! Every other write passes through once: the pipeline's commits, whose lost answers its
//! commit markers decide, and whatever a caller could not make idempotent, whose error it
//! reports. So every etcd write is either decided by a marker, idempotent and resent, or
//! reported.
//!
//! An etcd leader election takes a second or two; without this, every lookup or getattr
//! that missed the caches in that window, and every cache lock, fcntl lock or group claim,
//! would answer EIO.
//!
//! An attempt that waits too long is abandoned and sent again, to whichever member answers:
//! the abandoned one may still apply later. For reads that is nothing; for the writes
//! resent here it is one more application, which their idempotence covers as long as the
//! caller has not moved on to a later write of the same keys (etcd applies a member's
//! proposals in order, so only a request still travelling between members could arrive
//! that late).

use std::{
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use crate::{
    error::KvError,
    kv::{
        Alarm, BoxFut, ClusterMember, ClusterStatus, KvBackend, LeaseGrant, LeaseTtl, RangeRequest,
        RangeResponse, Txn, TxnOp, TxnResponse, WatchStream,
    },
    pipeline::Stats,
};

/// Pause before the first retry; it doubles up to [`PAUSE_MAX`].
const PAUSE_FIRST: Duration = Duration::from_millis(50);
const PAUSE_MAX: Duration = Duration::from_millis(400);
/// How long the first attempt waits for an answer.
const ATTEMPT_FIRST: Duration = Duration::from_secs(1);

/// What is being resent, for the counters and the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

/// Wraps a backend, resending unanswered reads and idempotent writes for up to `budget`.
pub struct Patient {
    inner: Arc<dyn KvBackend>,
    budget: Duration,
    /// `read_retries` and `write_retries` count the resends.
    stats: Arc<Stats>,
}

impl Patient {
    /// Requests through `inner` are retried for up to `budget`, counted in `stats`.
    pub fn new(inner: Arc<dyn KvBackend>, budget: Duration, stats: Arc<Stats>) -> Self {
        Patient {
            inner,
            budget,
            stats,
        }
    }

    /// Sends `attempt` until it is answered with anything but `Unavailable` or the budget
    /// is spent; the second value says whether it was resent.
    async fn retry<T, F>(
        &self,
        kind: Kind,
        what: &str,
        mut attempt: F,
    ) -> (Result<T, KvError>, bool)
    where
        F: FnMut() -> BoxFut<'static, Result<T, KvError>>,
    {
        let start = tokio::time::Instant::now();
        let mut pause = PAUSE_FIRST;
        let mut wait = ATTEMPT_FIRST;
        let mut resent = false;
        loop {
            // A request stuck behind a dead leader is abandoned and sent again (to a live
            // member) rather than waited out; after an attempt that got no answer the
            // next may wait twice as long, so a slow but working etcd still answers a
            // large read. Only then: after quick refusals (the dead member's connection,
            // "proposal dropped") the next attempt may still be forwarded to the dead
            // leader by a member that has not noticed yet, and must not wait out the
            // whole budget for it (found by tests/etcd_cluster.rs: a flock after a few
            // refusals waited 3.8 s on one attempt and answered EIO).
            let left = self.budget.saturating_sub(start.elapsed());
            let limit = wait.min(left);
            let answer = match tokio::time::timeout(limit, attempt()).await {
                Ok(a) => a,
                Err(_) => {
                    wait = (wait * 2).min(self.budget);
                    Err(KvError::Unavailable(format!("no answer within {limit:?}")))
                }
            };
            match answer {
                Err(KvError::Unavailable(why)) if start.elapsed() + pause < self.budget => {
                    log::debug!("etcd did not answer a {what} ({why}); sending it again");
                    let counter = match kind {
                        Kind::Read => &self.stats.read_retries,
                        Kind::Write => &self.stats.write_retries,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    resent = true;
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(PAUSE_MAX);
                }
                other => return (other, resent),
            }
        }
    }

    /// One call on the inner backend, sent again as [`Patient::retry`] says.
    fn resend<T, C>(
        &self,
        kind: Kind,
        what: &'static str,
        call: C,
    ) -> BoxFut<'_, Result<T, KvError>>
    where
        T: Send + 'static,
        C: Fn(Arc<dyn KvBackend>) -> BoxFut<'static, Result<T, KvError>> + Send + Sync + 'static,
    {
        Box::pin(async move {
            let inner = self.inner.clone();
            self.retry(kind, what, || call(inner.clone())).await.0
        })
    }

    fn resend_txn(&self, kind: Kind, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
        let what = match kind {
            Kind::Read => "read",
            Kind::Write => "write",
        };
        self.resend(kind, what, move |kv| {
            let txn = txn.clone();
            Box::pin(async move { kv.txn(txn).await })
        })
    }
}

fn read_only(txn: &Txn) -> bool {
    txn.compares.is_empty()
        && txn.failure.is_empty()
        && txn.success.iter().all(|op| matches!(op, TxnOp::Range(_)))
}

impl KvBackend for Patient {
    fn range(&self, req: RangeRequest) -> BoxFut<'_, Result<RangeResponse, KvError>> {
        self.resend(Kind::Read, "read", move |kv| {
            let req = req.clone();
            Box::pin(async move { kv.range(req).await })
        })
    }

    fn txn(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
        if !read_only(&txn) {
            return self.inner.txn(txn);
        }
        self.resend_txn(Kind::Read, txn)
    }

    fn txn_idempotent(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
        let kind = if read_only(&txn) {
            Kind::Read
        } else {
            Kind::Write
        };
        self.resend_txn(kind, txn)
    }

    fn lease_grant(&self, ttl_s: i64) -> BoxFut<'_, Result<LeaseGrant, KvError>> {
        self.resend(Kind::Write, "lease grant", move |kv| {
            Box::pin(async move { kv.lease_grant(ttl_s).await })
        })
    }

    fn lease_keepalive(&self, id: i64) -> BoxFut<'_, Result<i64, KvError>> {
        // The session's keeper bounds this by its fence: a renewal acknowledged after the
        // fence closed is of no use.
        self.resend(Kind::Write, "lease renewal", move |kv| {
            Box::pin(async move { kv.lease_keepalive(id).await })
        })
    }

    fn lease_revoke(&self, id: i64) -> BoxFut<'_, Result<(), KvError>> {
        Box::pin(async move {
            let inner = self.inner.clone();
            let (r, resent) = self
                .retry(Kind::Write, "lease revoke", || {
                    let inner = inner.clone();
                    Box::pin(async move { inner.lease_revoke(id).await })
                })
                .await;
            match r {
                // An unanswered attempt revoked it.
                Err(KvError::LeaseNotFound) if resent => Ok(()),
                other => other,
            }
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
        self.resend(Kind::Read, "lease read", move |kv| {
            Box::pin(async move { kv.lease_time_to_live(id).await })
        })
    }

    // Answered by whichever member the request reaches: `etcfs status` during an
    // election met the dead leader's refused connection (tests/etcd_cluster.rs).
    fn member_list(&self) -> BoxFut<'_, Result<Vec<ClusterMember>, KvError>> {
        self.resend(Kind::Read, "member list", |kv| {
            Box::pin(async move { kv.member_list().await })
        })
    }

    fn status(&self) -> BoxFut<'_, Result<ClusterStatus, KvError>> {
        self.resend(Kind::Read, "status", |kv| {
            Box::pin(async move { kv.status().await })
        })
    }

    fn alarms(&self) -> BoxFut<'_, Result<Vec<Alarm>, KvError>> {
        self.resend(Kind::Read, "alarm list", |kv| {
            Box::pin(async move { kv.alarms().await })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        clock::ManualClock,
        kv::Compare,
        lossy::{Losses, Lossy},
        model::MemEtcd,
        types::Timespec,
    };

    fn setup() -> (Arc<MemEtcd>, Arc<Lossy>, Patient, Arc<Stats>) {
        let clock = Arc::new(ManualClock::new(Timespec::new(1, 0)));
        let model = Arc::new(MemEtcd::new(clock));
        let lossy = Arc::new(Lossy::new(model.clone()));
        let stats = Arc::new(Stats::default());
        let patient = Patient::new(lossy.clone(), Duration::from_secs(2), stats.clone());
        (model, lossy, patient, stats)
    }

    #[tokio::test]
    async fn a_read_waits_out_a_short_outage_but_a_write_is_tried_once() {
        let clock = Arc::new(ManualClock::new(Timespec::new(1, 0)));
        let model = Arc::new(MemEtcd::new(clock));
        model.put_raw(b"k", b"v");
        let stats = Arc::new(Stats::default());
        let patient = Patient::new(model.clone(), Duration::from_secs(2), stats.clone());
        model.set_faults(crate::model::Faults {
            unavailable_txns: 2,
            ..Default::default()
        });
        let read = Txn {
            success: vec![TxnOp::Range(RangeRequest::key(b"k".to_vec()))],
            ..Default::default()
        };
        let r = patient.txn(read).await.unwrap();
        assert!(r.succeeded);
        assert_eq!(stats.read_retries.load(Ordering::Relaxed), 2);
        model.set_faults(crate::model::Faults {
            unavailable_txns: 1,
            ..Default::default()
        });
        let write = Txn {
            success: vec![TxnOp::put(b"k".to_vec(), b"w".to_vec())],
            ..Default::default()
        };
        assert!(matches!(
            patient.txn(write).await,
            Err(KvError::Unavailable(_))
        ));
        assert_eq!(stats.write_retries.load(Ordering::Relaxed), 0);
    }

    /// A write whose answer is lost after it applied: `txn` reports it (its caller
    /// decides), `txn_idempotent` sends it again and hands back the second application's
    /// answer, which the caller's compares make say "done already".
    #[tokio::test]
    async fn an_idempotent_write_is_resent_after_a_lost_answer_and_others_are_not() {
        let (model, lossy, patient, stats) = setup();
        let claim = Txn {
            compares: vec![Compare::absent(b"g".to_vec())],
            success: vec![TxnOp::put(b"g".to_vec(), b"me".to_vec())],
            failure: vec![TxnOp::Range(RangeRequest::key(b"g".to_vec()))],
        };
        lossy.set_losses(Losses {
            txns: 1,
            ..Default::default()
        });
        assert!(matches!(
            patient.txn(claim.clone()).await,
            Err(KvError::Unavailable(_))
        ));
        assert_eq!(lossy.writes_sent(), 1, "a plain write is sent once");
        assert_eq!(model.dump(b"g", b"h").len(), 1, "and it did apply");

        let claim2 = Txn {
            compares: vec![Compare::absent(b"g3".to_vec())],
            success: vec![TxnOp::put(b"g3".to_vec(), b"me".to_vec())],
            failure: vec![TxnOp::Range(RangeRequest::key(b"g3".to_vec()))],
        };
        lossy.set_losses(Losses {
            txns: 2,
            ..Default::default()
        });
        let r = patient.txn_idempotent(claim2).await.expect("answered");
        assert_eq!(lossy.writes_sent(), 1 + 3);
        assert_eq!(stats.write_retries.load(Ordering::Relaxed), 2);
        // The third copy found the first one's put: refused, with the key read back.
        assert!(!r.succeeded);
        match r.responses.first() {
            Some(crate::kv::TxnOpResponse::Range(rr)) => {
                assert_eq!(
                    rr.kvs.first().map(|kv| kv.value.clone()),
                    Some(b"me".to_vec())
                );
                assert_eq!(rr.kvs.first().map(|kv| kv.version), Some(1), "put once");
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn lease_calls_ride_out_lost_answers() {
        let (model, lossy, patient, stats) = setup();
        lossy.set_losses(Losses {
            grants: 1,
            keepalives: 2,
            revokes: 1,
            ..Default::default()
        });
        let g = patient.lease_grant(10).await.expect("granted");
        assert_eq!(patient.lease_keepalive(g.id).await, Ok(10));
        // The first revoke applied and lost its answer: the second finds no lease, which
        // is what was asked for.
        assert_eq!(patient.lease_revoke(g.id).await, Ok(()));
        assert!(model.lease_deadline(g.id).is_none());
        // Not resent, a revoke of a lease that is gone still says so.
        assert_eq!(
            patient.lease_revoke(g.id).await,
            Err(KvError::LeaseNotFound)
        );
        assert_eq!(stats.write_retries.load(Ordering::Relaxed), 4);
    }

    /// etcd refuses at once a few times (the dead member's connection), then a member
    /// that has not noticed the leader is gone swallows one attempt, then a new leader
    /// answers.
    struct Election {
        model: Arc<MemEtcd>,
        attempts: std::sync::atomic::AtomicU32,
    }

    impl KvBackend for Election {
        fn range(&self, req: RangeRequest) -> BoxFut<'_, Result<RangeResponse, KvError>> {
            Box::pin(async move {
                match self.attempts.fetch_add(1, Ordering::Relaxed) {
                    0..=2 => Err(KvError::Unavailable("connection refused".into())),
                    3 => std::future::pending().await,
                    _ => self.model.range(req).await,
                }
            })
        }
        fn txn(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
            self.model.txn(txn)
        }
        fn lease_grant(&self, ttl_s: i64) -> BoxFut<'_, Result<LeaseGrant, KvError>> {
            self.model.lease_grant(ttl_s)
        }
        fn lease_keepalive(&self, id: i64) -> BoxFut<'_, Result<i64, KvError>> {
            self.model.lease_keepalive(id)
        }
        fn lease_revoke(&self, id: i64) -> BoxFut<'_, Result<(), KvError>> {
            self.model.lease_revoke(id)
        }
        fn watch(
            &self,
            key: Vec<u8>,
            range_end: Vec<u8>,
            start_revision: i64,
        ) -> BoxFut<'_, Result<WatchStream, KvError>> {
            self.model.watch(key, range_end, start_revision)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn quick_refusals_do_not_lengthen_the_wait_for_a_swallowed_attempt() {
        let clock = Arc::new(ManualClock::new(Timespec::new(1, 0)));
        let model = Arc::new(MemEtcd::new(clock));
        let election = Arc::new(Election {
            model,
            attempts: std::sync::atomic::AtomicU32::new(0),
        });
        let patient = Patient::new(
            election.clone(),
            Duration::from_secs(5),
            Arc::new(Stats::default()),
        );
        let start = tokio::time::Instant::now();
        patient
            .range(RangeRequest::key(b"k".to_vec()))
            .await
            .expect("answered by the new leader");
        assert_eq!(election.attempts.load(Ordering::Relaxed), 5);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_budget_ends_the_resending() {
        let (_model, lossy, patient, _stats) = setup();
        lossy.set_losses(Losses {
            txns: u32::MAX,
            ..Default::default()
        });
        let t = Txn {
            success: vec![TxnOp::delete(b"k".to_vec())],
            ..Default::default()
        };
        let start = tokio::time::Instant::now();
        assert!(matches!(
            patient.txn_idempotent(t).await,
            Err(KvError::Unavailable(_))
        ));
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
    }
}
