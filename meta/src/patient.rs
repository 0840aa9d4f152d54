//! A backend that rides out short etcd outages for reads: a range, or a transaction that
//! only reads, that etcd did not answer is tried again for a bounded time. Reads change
//! nothing, so repeating one is always safe; writes pass through once (their lost answers
//! are decided by the pipeline's commit markers, or reported by their callers).
//!
//! An etcd leader election takes a second or two; without this, every lookup or getattr
//! that missed the caches in that window would answer EIO.

use std::{sync::Arc, time::Duration};

use crate::{
    error::KvError,
    kv::{
        Alarm, BoxFut, ClusterMember, ClusterStatus, KvBackend, LeaseGrant, LeaseTtl, RangeRequest,
        RangeResponse, Txn, TxnOp, TxnResponse, WatchStream,
    },
};

/// Pause before the first retry; it doubles up to [`PAUSE_MAX`].
const PAUSE_FIRST: Duration = Duration::from_millis(50);
const PAUSE_MAX: Duration = Duration::from_millis(400);
/// How long the first attempt waits for an answer.
const ATTEMPT_FIRST: Duration = Duration::from_secs(1);

/// Wraps a backend, retrying unanswered reads for up to `budget` in all.
pub struct PatientReads {
    inner: Arc<dyn KvBackend>,
    budget: Duration,
}

impl PatientReads {
    /// Reads through `inner` are retried for up to `budget`.
    pub fn new(inner: Arc<dyn KvBackend>, budget: Duration) -> Self {
        PatientReads { inner, budget }
    }

    async fn retry<T, F>(&self, mut attempt: F) -> Result<T, KvError>
    where
        F: FnMut() -> BoxFut<'static, Result<T, KvError>>,
    {
        let start = tokio::time::Instant::now();
        let mut pause = PAUSE_FIRST;
        let mut wait = ATTEMPT_FIRST;
        loop {
            // A request stuck behind a dead leader is abandoned and sent again (to a live
            // member) rather than waited out; each attempt may wait twice as long as the
            // last, so a slow but working etcd still answers a large read.
            let left = self.budget.saturating_sub(start.elapsed());
            let limit = wait.min(left);
            wait = (wait * 2).min(self.budget);
            let answer = match tokio::time::timeout(limit, attempt()).await {
                Ok(a) => a,
                Err(_) => Err(KvError::Unavailable(format!("no answer within {limit:?}"))),
            };
            match answer {
                Err(KvError::Unavailable(why)) if start.elapsed() + pause < self.budget => {
                    log::debug!("etcd did not answer a read ({why}); trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(PAUSE_MAX);
                }
                other => return other,
            }
        }
    }
}

fn read_only(txn: &Txn) -> bool {
    txn.compares.is_empty()
        && txn.failure.is_empty()
        && txn.success.iter().all(|op| matches!(op, TxnOp::Range(_)))
}

impl KvBackend for PatientReads {
    fn range(&self, req: RangeRequest) -> BoxFut<'_, Result<RangeResponse, KvError>> {
        Box::pin(async move {
            let inner = self.inner.clone();
            self.retry(|| {
                let (inner, req) = (inner.clone(), req.clone());
                Box::pin(async move { inner.range(req).await })
            })
            .await
        })
    }

    fn txn(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
        if !read_only(&txn) {
            return self.inner.txn(txn);
        }
        Box::pin(async move {
            let inner = self.inner.clone();
            self.retry(|| {
                let (inner, txn) = (inner.clone(), txn.clone());
                Box::pin(async move { inner.txn(txn).await })
            })
            .await
        })
    }

    fn lease_grant(&self, ttl_s: i64) -> BoxFut<'_, Result<LeaseGrant, KvError>> {
        self.inner.lease_grant(ttl_s)
    }

    fn lease_keepalive(&self, id: i64) -> BoxFut<'_, Result<i64, KvError>> {
        self.inner.lease_keepalive(id)
    }

    fn lease_revoke(&self, id: i64) -> BoxFut<'_, Result<(), KvError>> {
        self.inner.lease_revoke(id)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{clock::ManualClock, model::MemEtcd, types::Timespec};

    #[tokio::test]
    async fn a_read_waits_out_a_short_outage_but_a_write_is_tried_once() {
        let clock = Arc::new(ManualClock::new(Timespec::new(1, 0)));
        let model = Arc::new(MemEtcd::new(clock));
        model.put_raw(b"k", b"v");
        let patient = PatientReads::new(model.clone(), Duration::from_secs(2));
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
    }
}
