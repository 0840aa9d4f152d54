//! `MemEtcd`: an in-memory model of etcd's v3 KV, lease and watch semantics.
//!
//! It exists for deterministic tests and simulation, never as the thing a benchmark or
//! integration test claims to measure. It keeps full MVCC history (so reads at a
//! revision and watches from a revision work until [`MemEtcd::compact`]), applies the
//! same transaction checks as etcd (op count, duplicate keys), expires leases on an
//! injected [`Clock`], and has fault knobs: transaction latency, unavailability, and
//! forced compare failures (the failure branch still runs, as if another writer won).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::sync::mpsc;

use crate::{
    clock::Clock,
    error::KvError,
    kv::{
        check_txn, in_range, Alarm, BoxFut, ClusterMember, ClusterStatus, EventKind, KeyValue,
        KvBackend, LeaseGrant, LeaseTtl, RangeRequest, RangeResponse, Txn, TxnOp, TxnOpResponse,
        TxnResponse, WatchEvent, WatchStream, ETCD_TXN_OPS_MAX, WATCH_BATCHES_MAX,
    },
};

/// A trigger key and the puts applied when a transaction compares it.
pub type Interference = (Vec<u8>, Vec<(Vec<u8>, Vec<u8>)>);

/// Fault-injection knobs (all off by default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Every transaction with compares or writes waits this long (tokio time) before
    /// applying; read-only transactions answer at once (commit latency dominates).
    pub txn_latency: Duration,
    /// The next N transactions fail with `Unavailable` without applying.
    pub unavailable_txns: u32,
    /// Probability (per mille) that a transaction with compares is forced down its
    /// failure branch although its compares hold.
    pub compare_failure_per_mille: u32,
    /// Seed for the forced-failure coin.
    pub seed: u64,
    /// One-shot interference: when a transaction arrives whose compares cover the
    /// trigger key, first apply these puts (as another node winning the race would).
    pub interfere: Option<Interference>,
}

#[derive(Clone, Debug)]
struct Entry {
    mod_rev: i64,
    /// `None` is a tombstone.
    kv: Option<KeyValue>,
}

#[derive(Debug)]
struct Lease {
    ttl_s: i64,
    expires: Duration,
    keys: BTreeSet<Vec<u8>>,
}

#[derive(Debug)]
struct Watcher {
    start: Vec<u8>,
    end: Vec<u8>,
    tx: mpsc::Sender<Result<Vec<WatchEvent>, KvError>>,
}

#[derive(Debug)]
struct State {
    rev: i64,
    compact_rev: i64,
    keys: BTreeMap<Vec<u8>, Vec<Entry>>,
    leases: HashMap<i64, Lease>,
    next_lease: i64,
    log: Vec<WatchEvent>,
    watchers: Vec<Watcher>,
    /// Watches end and new ones fail with `Unavailable` (a client cut off from etcd).
    watches_refused: bool,
    faults: Faults,
    rng: u64,
    txns: u64,
    ranges: u64,
    /// Alarms [`KvBackend::alarms`] reports (set by tests).
    alarms: Vec<Alarm>,
}

/// The in-memory etcd model.
pub struct MemEtcd {
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    ops_max: usize,
}

impl std::fmt::Debug for MemEtcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemEtcd").finish_non_exhaustive()
    }
}

impl MemEtcd {
    /// An empty store at revision 1 (etcd starts at 1 too).
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        MemEtcd {
            state: Mutex::new(State {
                rev: 1,
                compact_rev: 0,
                keys: BTreeMap::new(),
                leases: HashMap::new(),
                next_lease: 0x7e57_0000,
                log: Vec::new(),
                watchers: Vec::new(),
                watches_refused: false,
                faults: Faults::default(),
                rng: 0x9e37_79b9_7f4a_7c15,
                txns: 0,
                ranges: 0,
                alarms: Vec::new(),
            }),
            clock,
            ops_max: ETCD_TXN_OPS_MAX,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("model lock is never poisoned: no panics while held")
    }

    /// Replaces the fault knobs.
    pub fn set_faults(&self, faults: Faults) {
        let mut s = self.lock();
        s.rng = faults.seed | 1;
        s.faults = faults;
    }

    /// Ends every watch and refuses new ones (`true`) until called with `false`, as a
    /// watcher cut off from etcd sees it while others keep committing.
    pub fn set_watches_refused(&self, refused: bool) {
        let mut s = self.lock();
        s.watches_refused = refused;
        if refused {
            s.watchers.clear();
        }
    }

    /// The current store revision.
    pub fn revision(&self) -> i64 {
        self.lock().rev
    }

    /// Number of transactions applied (successful or not).
    pub fn txn_count(&self) -> u64 {
        self.lock().txns
    }

    /// Number of range requests served (outside transactions).
    pub fn range_count(&self) -> u64 {
        self.lock().ranges
    }

    /// Drops history before `rev` (reads and watches below it fail with `Compacted`).
    pub fn compact(&self, rev: i64) {
        let mut s = self.lock();
        s.compact_rev = rev.min(s.rev);
        let cr = s.compact_rev;
        for hist in s.keys.values_mut() {
            // Keep the newest entry at or below the compaction point, and all newer ones.
            let keep_from = hist.iter().rposition(|e| e.mod_rev <= cr).unwrap_or(0);
            hist.drain(..keep_from);
        }
        s.keys
            .retain(|_, h| !(h.len() == 1 && h.first().is_some_and(|e| e.kv.is_none())));
        s.log.retain(|e| e.kv.mod_revision > cr);
    }

    /// Test helper: writes a raw value outside any transaction checks (to plant
    /// corrupt values).
    pub fn put_raw(&self, key: &[u8], value: &[u8]) {
        let mut s = self.lock();
        let rev = s.rev + 1;
        let mut events = Vec::new();
        s.apply_put(key, value, 0, rev, &mut events);
        s.commit(rev, events);
    }

    /// When lease `id` expires (on the model's clock), if it is alive now.
    pub fn lease_deadline(&self, id: i64) -> Option<Duration> {
        let now = self.clock.mono();
        let mut s = self.lock();
        s.expire(now);
        s.leases.get(&id).map(|l| l.expires)
    }

    /// Test helper: every live key under `prefix`, with its value.
    pub fn dump(&self, start: &[u8], end: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let s = self.lock();
        s.keys
            .range(start.to_vec()..end.to_vec())
            .filter_map(|(k, h)| {
                h.last()?
                    .kv
                    .as_ref()
                    .map(|kv| (k.clone(), kv.value.clone()))
            })
            .collect()
    }

    /// Replaces the alarms the model reports as active.
    pub fn set_alarms(&self, alarms: Vec<Alarm>) {
        self.lock().alarms = alarms;
    }

    /// Expires leases whose deadline passed (also done lazily by every call).
    pub fn tick(&self) {
        let now = self.clock.mono();
        self.lock().expire(now);
    }

    fn range_now(&self, req: &RangeRequest) -> Result<RangeResponse, KvError> {
        let now = self.clock.mono();
        let mut s = self.lock();
        s.expire(now);
        s.ranges += 1;
        s.range(req)
    }

    fn txn_now(&self, txn: &Txn) -> Result<TxnResponse, KvError> {
        check_txn(txn, self.ops_max)?;
        let now = self.clock.mono();
        let mut s = self.lock();
        s.expire(now);
        s.txns += 1;
        if s.faults.unavailable_txns > 0 {
            s.faults.unavailable_txns -= 1;
            return Err(KvError::Unavailable("injected fault".into()));
        }
        let full = s
            .alarms
            .iter()
            .any(|a| a.kind == crate::kv::AlarmKind::NoSpace);
        if full && txn.success.iter().any(|op| matches!(op, TxnOp::Put(_))) {
            // As etcd under its NOSPACE alarm: reads and deletes only.
            return Err(KvError::NoSpace(
                "etcdserver: mvcc: database space exceeded".into(),
            ));
        }
        for op in &txn.success {
            if let TxnOp::Put(p) = op {
                if p.lease != 0 && !s.leases.contains_key(&p.lease) {
                    return Err(KvError::LeaseNotFound);
                }
            }
        }
        let triggered = s
            .faults
            .interfere
            .as_ref()
            .is_some_and(|(k, _)| txn.compares.iter().any(|c| c.covers(k)));
        if triggered {
            if let Some((_, writes)) = s.faults.interfere.take() {
                let rev = s.rev + 1;
                let mut events = Vec::new();
                for (k, v) in writes {
                    s.apply_put(&k, &v, 0, rev, &mut events);
                }
                s.commit(rev, events);
            }
        }
        let mut ok = txn.compares.iter().all(|c| {
            let kvs = s.current_in(&c.key, c.range_end.as_deref());
            c.eval(&kvs)
        });
        if ok && !txn.compares.is_empty() && s.faults.compare_failure_per_mille > 0 {
            let roll = s.next_random() % 1000;
            if roll < u64::from(s.faults.compare_failure_per_mille) {
                ok = false;
            }
        }
        let branch = if ok { &txn.success } else { &txn.failure };
        let rev = s.rev + 1;
        let mut events = Vec::new();
        let mut responses = Vec::with_capacity(branch.len());
        for op in branch {
            responses.push(match op {
                TxnOp::Put(p) => {
                    s.apply_put(&p.key, &p.value, p.lease, rev, &mut events);
                    TxnOpResponse::Put
                }
                TxnOp::Delete(d) => {
                    let gone = s.apply_delete(&d.key, d.range_end.as_deref(), rev, &mut events);
                    TxnOpResponse::Delete {
                        deleted: i64::try_from(gone.len()).unwrap_or(i64::MAX),
                        prev_kvs: if d.prev_kv { gone } else { Vec::new() },
                    }
                }
                TxnOp::Range(r) => {
                    // A read inside a writing txn sees the txn's own writes, at the txn's
                    // revision if it wrote anything before this op.
                    let mut resp = s.range_current(r)?;
                    resp.revision = if events.is_empty() { s.rev } else { rev };
                    TxnOpResponse::Range(resp)
                }
            });
        }
        let changed = !events.is_empty();
        s.commit(rev, events);
        Ok(TxnResponse {
            succeeded: ok,
            revision: if changed { rev } else { s.rev },
            responses,
        })
    }
}

impl State {
    fn next_random(&mut self) -> u64 {
        // xorshift64*: deterministic per seed, good enough for a fault coin.
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn current(&self, key: &[u8]) -> Option<&KeyValue> {
        self.keys.get(key)?.last()?.kv.as_ref()
    }

    fn current_in(&self, start: &[u8], end: Option<&[u8]>) -> Vec<KeyValue> {
        match end {
            None => self.current(start).cloned().into_iter().collect(),
            Some(end) if end <= start => Vec::new(),
            Some(end) => self
                .keys
                .range(start.to_vec()..end.to_vec())
                .filter_map(|(_, h)| h.last()?.kv.clone())
                .collect(),
        }
    }

    fn at_revision(&self, start: &[u8], end: Option<&[u8]>, rev: i64) -> Vec<KeyValue> {
        let pick = |h: &Vec<Entry>| -> Option<KeyValue> {
            h.iter()
                .rev()
                .find(|e| e.mod_rev <= rev)
                .and_then(|e| e.kv.clone())
        };
        match end {
            None => self.keys.get(start).and_then(pick).into_iter().collect(),
            Some(end) if end <= start => Vec::new(),
            Some(end) => self
                .keys
                .range(start.to_vec()..end.to_vec())
                .filter_map(|(_, h)| pick(h))
                .collect(),
        }
    }

    fn range(&self, req: &RangeRequest) -> Result<RangeResponse, KvError> {
        if req.revision > self.rev {
            return Err(KvError::Other(
                "mvcc: required revision is a future revision".into(),
            ));
        }
        if req.revision > 0 && req.revision < self.compact_rev {
            return Err(KvError::Compacted {
                compact_revision: self.compact_rev,
            });
        }
        let kvs = if req.revision > 0 {
            self.at_revision(&req.key, req.range_end.as_deref(), req.revision)
        } else {
            self.current_in(&req.key, req.range_end.as_deref())
        };
        Ok(shape(kvs, req, self.rev))
    }

    fn range_current(&self, req: &RangeRequest) -> Result<RangeResponse, KvError> {
        Ok(shape(
            self.current_in(&req.key, req.range_end.as_deref()),
            req,
            self.rev,
        ))
    }

    fn apply_put(
        &mut self,
        key: &[u8],
        value: &[u8],
        lease: i64,
        rev: i64,
        events: &mut Vec<WatchEvent>,
    ) {
        let prev = self.current(key).cloned();
        if let Some(p) = &prev {
            if p.lease != 0 && p.lease != lease {
                if let Some(l) = self.leases.get_mut(&p.lease) {
                    l.keys.remove(key);
                }
            }
        }
        if lease != 0 {
            if let Some(l) = self.leases.get_mut(&lease) {
                l.keys.insert(key.to_vec());
            }
        }
        let kv = KeyValue {
            key: key.to_vec(),
            value: value.to_vec(),
            create_revision: prev.as_ref().map_or(rev, |p| p.create_revision),
            mod_revision: rev,
            version: prev.as_ref().map_or(1, |p| p.version + 1),
            lease,
        };
        events.push(WatchEvent {
            kind: EventKind::Put,
            kv: kv.clone(),
        });
        self.keys.entry(key.to_vec()).or_default().push(Entry {
            mod_rev: rev,
            kv: Some(kv),
        });
    }

    fn apply_delete(
        &mut self,
        start: &[u8],
        end: Option<&[u8]>,
        rev: i64,
        events: &mut Vec<WatchEvent>,
    ) -> Vec<KeyValue> {
        let gone = self.current_in(start, end);
        for kv in &gone {
            if kv.lease != 0 {
                if let Some(l) = self.leases.get_mut(&kv.lease) {
                    l.keys.remove(&kv.key);
                }
            }
            events.push(WatchEvent {
                kind: EventKind::Delete,
                kv: KeyValue {
                    key: kv.key.clone(),
                    mod_revision: rev,
                    ..Default::default()
                },
            });
            self.keys.entry(kv.key.clone()).or_default().push(Entry {
                mod_rev: rev,
                kv: None,
            });
        }
        gone
    }

    /// Publishes the changes of one revision (a no-op revision is not a revision).
    fn commit(&mut self, rev: i64, events: Vec<WatchEvent>) {
        if events.is_empty() {
            return;
        }
        self.rev = rev;
        self.watchers.retain(|w| {
            let batch: Vec<WatchEvent> = events
                .iter()
                .filter(|e| in_range(&w.start, Some(&w.end), &e.kv.key))
                .cloned()
                .collect();
            // A full or dropped receiver ends the watch (the stream just closes).
            batch.is_empty() || w.tx.try_send(Ok(batch)).is_ok()
        });
        self.log.extend(events);
    }

    fn expire(&mut self, now: Duration) {
        let mut dead: Vec<i64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(&id, _)| id)
            .collect();
        dead.sort_unstable();
        for id in dead {
            self.revoke(id);
        }
    }

    fn revoke(&mut self, id: i64) -> bool {
        let Some(lease) = self.leases.remove(&id) else {
            return false;
        };
        let rev = self.rev + 1;
        let mut events = Vec::new();
        for key in &lease.keys {
            self.apply_delete(key, None, rev, &mut events);
        }
        self.commit(rev, events);
        true
    }
}

fn shape(mut kvs: Vec<KeyValue>, req: &RangeRequest, rev: i64) -> RangeResponse {
    let count = i64::try_from(kvs.len()).unwrap_or(i64::MAX);
    if req.descending {
        kvs.reverse();
    }
    let limit = usize::try_from(req.limit).unwrap_or(0);
    let more = limit > 0 && kvs.len() > limit;
    if more {
        kvs.truncate(limit);
    }
    if req.keys_only {
        for kv in &mut kvs {
            kv.value.clear();
        }
    }
    RangeResponse {
        kvs,
        more,
        count,
        revision: rev,
    }
}

impl KvBackend for MemEtcd {
    fn range(&self, req: RangeRequest) -> BoxFut<'_, Result<RangeResponse, KvError>> {
        Box::pin(async move { self.range_now(&req) })
    }

    fn txn(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
        Box::pin(async move {
            let latency = self.lock().faults.txn_latency;
            let read_only = txn.compares.is_empty()
                && txn.success.iter().all(|op| matches!(op, TxnOp::Range(_)));
            if !latency.is_zero() && !read_only {
                tokio::time::sleep(latency).await;
            }
            self.txn_now(&txn)
        })
    }

    fn lease_grant(&self, ttl_s: i64) -> BoxFut<'_, Result<LeaseGrant, KvError>> {
        Box::pin(async move {
            let now = self.clock.mono();
            let mut s = self.lock();
            s.expire(now);
            s.next_lease += 1;
            let id = s.next_lease;
            let ttl_s = ttl_s.max(1);
            let expires = now + Duration::from_secs(u64::try_from(ttl_s).unwrap_or(1));
            s.leases.insert(
                id,
                Lease {
                    ttl_s,
                    expires,
                    keys: BTreeSet::new(),
                },
            );
            Ok(LeaseGrant { id, ttl_s })
        })
    }

    fn lease_keepalive(&self, id: i64) -> BoxFut<'_, Result<i64, KvError>> {
        Box::pin(async move {
            let now = self.clock.mono();
            let mut s = self.lock();
            s.expire(now);
            let lease = s.leases.get_mut(&id).ok_or(KvError::LeaseNotFound)?;
            lease.expires = now + Duration::from_secs(u64::try_from(lease.ttl_s).unwrap_or(1));
            Ok(lease.ttl_s)
        })
    }

    fn lease_revoke(&self, id: i64) -> BoxFut<'_, Result<(), KvError>> {
        Box::pin(async move {
            let now = self.clock.mono();
            let mut s = self.lock();
            s.expire(now);
            if s.revoke(id) {
                Ok(())
            } else {
                Err(KvError::LeaseNotFound)
            }
        })
    }

    fn watch(
        &self,
        key: Vec<u8>,
        range_end: Vec<u8>,
        start_revision: i64,
    ) -> BoxFut<'_, Result<WatchStream, KvError>> {
        Box::pin(async move {
            let now = self.clock.mono();
            let mut s = self.lock();
            s.expire(now);
            let start = if start_revision <= 0 {
                s.rev + 1
            } else {
                start_revision
            };
            if s.watches_refused {
                return Err(KvError::Unavailable("watches refused (model)".into()));
            }
            if start <= s.compact_rev {
                return Err(KvError::Compacted {
                    compact_revision: s.compact_rev,
                });
            }
            let (tx, rx) = mpsc::channel(WATCH_BATCHES_MAX);
            // Replay history one batch per revision, as etcd groups events.
            let mut batch: Vec<WatchEvent> = Vec::new();
            for e in s.log.iter().filter(|e| {
                e.kv.mod_revision >= start && in_range(&key, Some(&range_end), &e.kv.key)
            }) {
                let new_rev = batch
                    .first()
                    .is_some_and(|b| b.kv.mod_revision != e.kv.mod_revision);
                if new_rev && tx.try_send(Ok(std::mem::take(&mut batch))).is_err() {
                    return Ok(rx);
                }
                batch.push(e.clone());
            }
            if !batch.is_empty() && tx.try_send(Ok(batch)).is_err() {
                return Ok(rx);
            }
            s.watchers.push(Watcher {
                start: key,
                end: range_end,
                tx,
            });
            Ok(rx)
        })
    }

    fn lease_time_to_live(&self, id: i64) -> BoxFut<'_, Result<LeaseTtl, KvError>> {
        Box::pin(async move {
            let now = self.clock.mono();
            let mut s = self.lock();
            s.expire(now);
            let lease = s.leases.get(&id).ok_or(KvError::LeaseNotFound)?;
            let left = lease.expires.saturating_sub(now).as_secs();
            Ok(LeaseTtl {
                remaining_s: i64::try_from(left).unwrap_or(i64::MAX),
                granted_s: lease.ttl_s,
            })
        })
    }

    fn member_list(&self) -> BoxFut<'_, Result<Vec<ClusterMember>, KvError>> {
        Box::pin(async move {
            Ok(vec![ClusterMember {
                id: MODEL_MEMBER_ID,
                name: "model".into(),
                client_urls: vec!["model://memory".into()],
                peer_urls: Vec::new(),
                is_learner: false,
            }])
        })
    }

    fn status(&self) -> BoxFut<'_, Result<ClusterStatus, KvError>> {
        Box::pin(async move {
            let now = self.clock.mono();
            let mut s = self.lock();
            s.expire(now);
            // Sizes as a rough count of stored bytes: every kept version for the file,
            // the live ones for what is in use.
            const ENTRY_BYTES: usize = 64;
            let (mut all, mut live) = (0usize, 0usize);
            for (k, hist) in &s.keys {
                for e in hist {
                    let n = ENTRY_BYTES + k.len() + e.kv.as_ref().map_or(0, |kv| kv.value.len());
                    all += n;
                    if std::ptr::eq(e, hist.last().unwrap_or(e)) && e.kv.is_some() {
                        live += n;
                    }
                }
            }
            Ok(ClusterStatus {
                member_id: MODEL_MEMBER_ID,
                leader: MODEL_MEMBER_ID,
                version: "model".into(),
                db_size: i64::try_from(all).unwrap_or(i64::MAX),
                db_size_in_use: i64::try_from(live).unwrap_or(i64::MAX),
                revision: s.rev,
                raft_term: 1,
                errors: Vec::new(),
            })
        })
    }

    fn alarms(&self) -> BoxFut<'_, Result<Vec<Alarm>, KvError>> {
        Box::pin(async move { Ok(self.lock().alarms.clone()) })
    }
}

/// The one member the model's cluster has.
const MODEL_MEMBER_ID: u64 = 1;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{clock::ManualClock, kv::PutOp, types::Timespec};

    #[tokio::test]
    async fn lease_expiry_on_injected_clock_deletes_keys_and_notifies_watchers() {
        let clock = Arc::new(ManualClock::new(Timespec::new(0, 0)));
        let kv = MemEtcd::new(clock.clone());
        let lease = kv.lease_grant(10).await.expect("grant");
        let put = TxnOp::Put(PutOp {
            key: b"m/1".to_vec(),
            value: vec![],
            lease: lease.id,
        });
        kv.txn(Txn {
            success: vec![put],
            ..Default::default()
        })
        .await
        .expect("put");
        let mut w = kv
            .watch(b"m/".to_vec(), b"m0".to_vec(), 0)
            .await
            .expect("watch");
        clock.advance(Duration::from_secs(9));
        assert_eq!(kv.lease_keepalive(lease.id).await, Ok(10));
        clock.advance(Duration::from_secs(9));
        kv.tick();
        assert_eq!(
            kv.dump(b"m/", b"m0").len(),
            1,
            "keepalive pushed expiry out"
        );
        clock.advance(Duration::from_secs(2));
        kv.tick();
        assert!(kv.dump(b"m/", b"m0").is_empty());
        let ev = w.recv().await.expect("open").expect("ok");
        assert_eq!(ev.first().map(|e| e.kind), Some(EventKind::Delete));
        assert_eq!(
            kv.lease_keepalive(lease.id).await,
            Err(KvError::LeaseNotFound)
        );
    }

    #[tokio::test]
    async fn lease_time_to_live_counts_down_on_the_injected_clock() {
        let clock = Arc::new(ManualClock::new(Timespec::new(0, 0)));
        let kv = MemEtcd::new(clock.clone());
        let lease = kv.lease_grant(12).await.expect("grant");
        let ttl = |remaining_s| LeaseTtl {
            remaining_s,
            granted_s: 12,
        };
        assert_eq!(kv.lease_time_to_live(lease.id).await, Ok(ttl(12)));
        clock.advance(Duration::from_millis(8500));
        assert_eq!(kv.lease_time_to_live(lease.id).await, Ok(ttl(3)));
        kv.lease_keepalive(lease.id).await.expect("keepalive");
        assert_eq!(kv.lease_time_to_live(lease.id).await, Ok(ttl(12)));
        clock.advance(Duration::from_secs(12));
        assert_eq!(
            kv.lease_time_to_live(lease.id).await,
            Err(KvError::LeaseNotFound)
        );
        let alarm = Alarm {
            member_id: MODEL_MEMBER_ID,
            kind: crate::kv::AlarmKind::NoSpace,
        };
        kv.set_alarms(vec![alarm]);
        assert_eq!(kv.alarms().await, Ok(vec![alarm]));
    }

    #[tokio::test]
    async fn compaction_limits_history() {
        let kv = MemEtcd::new(Arc::new(ManualClock::new(Timespec::new(0, 0))));
        for i in 0..3u8 {
            kv.txn(Txn {
                success: vec![TxnOp::put(b"k".to_vec(), vec![i])],
                ..Default::default()
            })
            .await
            .expect("put");
        }
        let rev = kv.revision();
        kv.compact(rev - 1);
        assert!(matches!(
            kv.range(RangeRequest::key(b"k".to_vec()).at(rev - 2)).await,
            Err(KvError::Compacted { .. })
        ));
        let r = kv
            .range(RangeRequest::key(b"k".to_vec()).at(rev - 1))
            .await
            .expect("kept");
        assert_eq!(r.kvs.first().map(|kv| kv.value.clone()), Some(vec![1]));
        assert!(kv
            .watch(b"k".to_vec(), b"l".to_vec(), rev - 1)
            .await
            .is_err());
    }

    #[tokio::test]
    async fn faults_inject_unavailability_and_compare_failures() {
        let kv = MemEtcd::new(Arc::new(ManualClock::new(Timespec::new(0, 0))));
        kv.set_faults(Faults {
            unavailable_txns: 1,
            ..Default::default()
        });
        let t = Txn {
            compares: vec![crate::kv::Compare::absent(b"x".to_vec())],
            ..Default::default()
        };
        assert!(matches!(
            kv.txn(t.clone()).await,
            Err(KvError::Unavailable(_))
        ));
        assert!(kv.txn(t.clone()).await.expect("ok").succeeded);
        kv.set_faults(Faults {
            compare_failure_per_mille: 1000,
            seed: 1,
            ..Default::default()
        });
        assert!(!kv.txn(t).await.expect("ok").succeeded);
    }
}
