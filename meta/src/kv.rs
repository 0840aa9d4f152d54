//! The key-value backend interface: the subset of etcd's v3 API etcfs uses.
//!
//! Two implementations: [`crate::etcd::EtcdBackend`] (the real thing) and
//! [`crate::model::MemEtcd`] (an in-memory model for deterministic tests). Both must
//! pass [`crate::conformance::run`]. Semantics are etcd's: a store-wide revision that
//! grows by one per transaction that changes something; per-key create/mod revisions
//! and versions; transactions of compares plus success/failure op lists, where the
//! compares are all evaluated against the state before any op, and ops apply in order.

use std::{future::Future, pin::Pin};

use crate::error::KvError;

/// A boxed future, so the trait stays object-safe (`&dyn KvBackend`).
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// etcd's default `--max-txn-ops`: ops per branch (and compares) of one transaction.
pub const ETCD_TXN_OPS_MAX: usize = 128;
/// etcd's default `--max-request-bytes` (1.5 MiB).
pub const ETCD_REQUEST_BYTES_MAX: usize = 1536 * 1024;

/// A stored key with its MVCC metadata.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct KeyValue {
    /// The key.
    pub key: Vec<u8>,
    /// The value (empty with `keys_only`).
    pub value: Vec<u8>,
    /// Revision of the put that created the key (since its last deletion).
    pub create_revision: i64,
    /// Revision of the last put (or, in delete events, of the deletion).
    pub mod_revision: i64,
    /// Number of puts since creation (1 for a new key).
    pub version: i64,
    /// Attached lease, 0 if none.
    pub lease: i64,
}

/// A range read.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RangeRequest {
    /// First key.
    pub key: Vec<u8>,
    /// End of the range (exclusive); `None` reads the single key `key`.
    pub range_end: Option<Vec<u8>>,
    /// At most this many keys (0 = unlimited).
    pub limit: i64,
    /// Return keys and metadata without values.
    pub keys_only: bool,
    /// Read at this revision (0 = latest).
    pub revision: i64,
    /// Return keys in descending key order (the limit applies after sorting).
    pub descending: bool,
}

impl RangeRequest {
    /// Reads one key.
    pub fn key(key: Vec<u8>) -> Self {
        RangeRequest {
            key,
            ..Default::default()
        }
    }
    /// Reads `[start, end)`.
    pub fn range(start: Vec<u8>, end: Vec<u8>) -> Self {
        RangeRequest {
            key: start,
            range_end: Some(end),
            ..Default::default()
        }
    }
    /// Sets the limit.
    pub fn limit(mut self, limit: i64) -> Self {
        self.limit = limit;
        self
    }
    /// Keys only.
    pub fn keys_only(mut self) -> Self {
        self.keys_only = true;
        self
    }
    /// Descending order.
    pub fn descending(mut self) -> Self {
        self.descending = true;
        self
    }
    /// At a revision.
    pub fn at(mut self, revision: i64) -> Self {
        self.revision = revision;
        self
    }
    /// Whether `key` is inside the requested range.
    pub fn contains(&self, key: &[u8]) -> bool {
        in_range(&self.key, self.range_end.as_deref(), key)
    }
}

/// The answer to a [`RangeRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RangeResponse {
    /// Matching keys, in key order (or reverse with `descending`).
    pub kvs: Vec<KeyValue>,
    /// More keys matched than `limit` allowed.
    pub more: bool,
    /// Total number of matching keys.
    pub count: i64,
    /// The store revision the read saw.
    pub revision: i64,
}

/// What a compare looks at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompareTarget {
    /// The key's version (0 = absent).
    Version(i64),
    /// The key's create revision (0 = absent).
    CreateRevision(i64),
    /// The key's mod revision (0 = absent).
    ModRevision(i64),
    /// The key's value (an absent key never matches).
    Value(Vec<u8>),
}

/// Compare operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompareOp {
    /// `==`
    Equal,
    /// `>`
    Greater,
    /// `<`
    Less,
    /// `!=`
    NotEqual,
}

/// One compare of a transaction. With `range_end`, every key in the range must satisfy
/// it, and an empty range compares as an absent key (so `Version == 0` over a range
/// means "the range is empty").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compare {
    /// The key (or range start).
    pub key: Vec<u8>,
    /// Optional range end (exclusive).
    pub range_end: Option<Vec<u8>>,
    /// The operator.
    pub op: CompareOp,
    /// The target and its operand.
    pub target: CompareTarget,
}

impl Compare {
    /// `mod_revision(key) == rev` (rev 0 = "key absent").
    pub fn mod_rev(key: Vec<u8>, rev: i64) -> Self {
        Compare {
            key,
            range_end: None,
            op: CompareOp::Equal,
            target: CompareTarget::ModRevision(rev),
        }
    }
    /// The key does not exist.
    pub fn absent(key: Vec<u8>) -> Self {
        Compare {
            key,
            range_end: None,
            op: CompareOp::Equal,
            target: CompareTarget::Version(0),
        }
    }
    /// The key exists.
    pub fn exists(key: Vec<u8>) -> Self {
        Compare {
            key,
            range_end: None,
            op: CompareOp::Greater,
            target: CompareTarget::Version(0),
        }
    }
    /// The key exists and holds exactly `value`.
    pub fn value(key: Vec<u8>, value: Vec<u8>) -> Self {
        Compare {
            key,
            range_end: None,
            op: CompareOp::Equal,
            target: CompareTarget::Value(value),
        }
    }
    /// No key exists in `[start, end)`.
    pub fn range_empty(start: Vec<u8>, end: Vec<u8>) -> Self {
        Compare {
            key: start,
            range_end: Some(end),
            op: CompareOp::Equal,
            target: CompareTarget::Version(0),
        }
    }

    /// Evaluates the compare against the keys of its range (etcd's rules). `kvs` must be
    /// all keys the compare covers (one or none for a single-key compare).
    pub fn eval(&self, kvs: &[KeyValue]) -> bool {
        if kvs.is_empty() {
            if matches!(self.target, CompareTarget::Value(_)) {
                return false;
            }
            return self.eval_one(&KeyValue::default());
        }
        kvs.iter().all(|kv| self.eval_one(kv))
    }

    fn eval_one(&self, kv: &KeyValue) -> bool {
        use std::cmp::Ordering;
        let ord = match &self.target {
            CompareTarget::Version(v) => kv.version.cmp(v),
            CompareTarget::CreateRevision(v) => kv.create_revision.cmp(v),
            CompareTarget::ModRevision(v) => kv.mod_revision.cmp(v),
            CompareTarget::Value(v) => kv.value.as_slice().cmp(v.as_slice()),
        };
        match self.op {
            CompareOp::Equal => ord == Ordering::Equal,
            CompareOp::Greater => ord == Ordering::Greater,
            CompareOp::Less => ord == Ordering::Less,
            CompareOp::NotEqual => ord != Ordering::Equal,
        }
    }

    /// Whether `key` is covered by this compare.
    pub fn covers(&self, key: &[u8]) -> bool {
        in_range(&self.key, self.range_end.as_deref(), key)
    }
}

/// A put.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutOp {
    /// Key.
    pub key: Vec<u8>,
    /// Value.
    pub value: Vec<u8>,
    /// Lease to attach (0 = none).
    pub lease: i64,
}

/// A delete of one key or a range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeleteOp {
    /// Key (or range start).
    pub key: Vec<u8>,
    /// Range end (exclusive), `None` for one key.
    pub range_end: Option<Vec<u8>>,
    /// Return the deleted key-values.
    pub prev_kv: bool,
}

/// One operation in a transaction branch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOp {
    /// Write a key.
    Put(PutOp),
    /// Delete keys.
    Delete(DeleteOp),
    /// Read keys (sees earlier writes of the same branch).
    Range(RangeRequest),
}

impl TxnOp {
    /// A put without lease.
    pub fn put(key: Vec<u8>, value: Vec<u8>) -> Self {
        TxnOp::Put(PutOp {
            key,
            value,
            lease: 0,
        })
    }
    /// A single-key delete.
    pub fn delete(key: Vec<u8>) -> Self {
        TxnOp::Delete(DeleteOp {
            key,
            range_end: None,
            prev_kv: false,
        })
    }
    /// A range delete returning the deleted pairs.
    pub fn delete_range(start: Vec<u8>, end: Vec<u8>, prev_kv: bool) -> Self {
        TxnOp::Delete(DeleteOp {
            key: start,
            range_end: Some(end),
            prev_kv,
        })
    }
    /// Approximate encoded size in bytes, for the request-size budget.
    pub fn size_bytes(&self) -> usize {
        const OVERHEAD: usize = 16;
        OVERHEAD
            + match self {
                TxnOp::Put(p) => p.key.len() + p.value.len(),
                TxnOp::Delete(d) => d.key.len() + d.range_end.as_ref().map_or(0, Vec::len),
                TxnOp::Range(r) => r.key.len() + r.range_end.as_ref().map_or(0, Vec::len),
            }
    }
}

/// A transaction: if all compares hold, run `success`, else `failure`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Txn {
    /// Conditions.
    pub compares: Vec<Compare>,
    /// Ops when every compare holds.
    pub success: Vec<TxnOp>,
    /// Ops otherwise.
    pub failure: Vec<TxnOp>,
}

impl Txn {
    /// Approximate encoded size in bytes.
    pub fn size_bytes(&self) -> usize {
        let c: usize = self
            .compares
            .iter()
            .map(|c| 24 + c.key.len() + c.range_end.as_ref().map_or(0, Vec::len))
            .sum();
        c + self
            .success
            .iter()
            .chain(&self.failure)
            .map(TxnOp::size_bytes)
            .sum::<usize>()
    }
}

/// The response to one op of the branch that ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOpResponse {
    /// A put was applied.
    Put,
    /// A delete was applied.
    Delete {
        /// Number of keys deleted.
        deleted: i64,
        /// The deleted pairs, if requested.
        prev_kvs: Vec<KeyValue>,
    },
    /// A range result.
    Range(RangeResponse),
}

/// The result of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnResponse {
    /// Whether the compares held (the success branch ran).
    pub succeeded: bool,
    /// The store revision after the transaction.
    pub revision: i64,
    /// One response per op of the branch that ran.
    pub responses: Vec<TxnOpResponse>,
}

/// Kind of a watch event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A put.
    Put,
    /// A deletion (including by lease expiry).
    Delete,
}

/// A change to a watched key. `kv.mod_revision` is the revision of the change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    /// Put or delete.
    pub kind: EventKind,
    /// The key after the change (value empty for deletes).
    pub kv: KeyValue,
}

/// Bound on buffered watch batches per watch (batches, not events).
pub const WATCH_BATCHES_MAX: usize = 1024;

/// A stream of watch batches. Dropping it cancels the watch.
pub type WatchStream = tokio::sync::mpsc::Receiver<Result<Vec<WatchEvent>, KvError>>;

/// A granted lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseGrant {
    /// The lease id.
    pub id: i64,
    /// The TTL etcd granted (seconds).
    pub ttl_s: i64,
}

/// The subset of etcd the metadata layer uses.
pub trait KvBackend: Send + Sync {
    /// Reads a key or range.
    fn range(&self, req: RangeRequest) -> BoxFut<'_, Result<RangeResponse, KvError>>;
    /// Runs a transaction.
    fn txn(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>>;
    /// Runs a transaction its caller made idempotent: sent again after etcd did not
    /// answer, it gives the outcome of one application. Typically its compares fail on a
    /// second application (or accept what the first one did) and its branches read back
    /// what the caller needs to tell "done now" from "done already". A backend that rides
    /// out etcd's outages ([`crate::patient::Patient`]) resends it within its budget;
    /// the default sends it once, like [`KvBackend::txn`]. Never for a transaction that a
    /// second application would change further: those go through [`KvBackend::txn`], and
    /// a lost answer is decided by the caller (the pipeline's commit markers) or reported.
    fn txn_idempotent(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
        self.txn(txn)
    }
    /// Grants a lease with the requested TTL.
    fn lease_grant(&self, ttl_s: i64) -> BoxFut<'_, Result<LeaseGrant, KvError>>;
    /// Refreshes a lease; returns the remaining TTL, or `LeaseNotFound` if it expired.
    fn lease_keepalive(&self, id: i64) -> BoxFut<'_, Result<i64, KvError>>;
    /// Revokes a lease, deleting its keys.
    fn lease_revoke(&self, id: i64) -> BoxFut<'_, Result<(), KvError>>;
    /// Watches `[key, range_end)` from `start_revision` (0 = from now on).
    fn watch(
        &self,
        key: Vec<u8>,
        range_end: Vec<u8>,
        start_revision: i64,
    ) -> BoxFut<'_, Result<WatchStream, KvError>>;

    // Operational queries (`etcfs status`, `etcfs evict`), never on the request path. A
    // backend that cannot answer one says so with an error.

    /// The remaining and granted TTL of a lease; `LeaseNotFound` if it ended.
    fn lease_time_to_live(&self, id: i64) -> BoxFut<'_, Result<LeaseTtl, KvError>> {
        let _ = id;
        unsupported("lease time-to-live")
    }
    /// The members of the etcd cluster.
    fn member_list(&self) -> BoxFut<'_, Result<Vec<ClusterMember>, KvError>> {
        unsupported("member list")
    }
    /// The status of the member that answers: leader, database sizes, revision.
    fn status(&self) -> BoxFut<'_, Result<ClusterStatus, KvError>> {
        unsupported("status")
    }
    /// The alarms active in the cluster (out of space, corruption).
    fn alarms(&self) -> BoxFut<'_, Result<Vec<Alarm>, KvError>> {
        unsupported("alarm list")
    }
}

fn unsupported<T: Send + 'static>(what: &'static str) -> BoxFut<'static, Result<T, KvError>> {
    Box::pin(async move { Err(KvError::Other(format!("{what} is not supported here"))) })
}

impl std::fmt::Debug for dyn KvBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvBackend")
    }
}

/// Whether `key` lies in `[start, end)` (or equals `start` when `end` is `None`).
pub fn in_range(start: &[u8], end: Option<&[u8]>, key: &[u8]) -> bool {
    match end {
        None => key == start,
        Some(end) => key >= start && key < end,
    }
}

/// Whether two key ranges (with `None` meaning a single key) intersect.
pub fn ranges_overlap(a: &[u8], a_end: Option<&[u8]>, b: &[u8], b_end: Option<&[u8]>) -> bool {
    match (a_end, b_end) {
        (None, None) => a == b,
        (None, Some(be)) => a >= b && a < be,
        (Some(ae), None) => b >= a && b < ae,
        (Some(ae), Some(be)) => a < be && b < ae,
    }
}

/// Checks a transaction the way etcd does before running it: op-count limits and no key
/// written twice in one branch (puts overlapping puts or deletes).
pub fn check_txn(txn: &Txn, ops_max: usize) -> Result<(), KvError> {
    let n = txn
        .compares
        .len()
        .max(txn.success.len())
        .max(txn.failure.len());
    if n > ops_max {
        return Err(KvError::TooManyOps);
    }
    for branch in [&txn.success, &txn.failure] {
        type Write<'a> = (&'a [u8], Option<&'a [u8]>, bool);
        let writes: Vec<Write<'_>> = branch
            .iter()
            .filter_map(|op| match op {
                TxnOp::Put(p) => Some((p.key.as_slice(), None, true)),
                TxnOp::Delete(d) => Some((d.key.as_slice(), d.range_end.as_deref(), false)),
                TxnOp::Range(_) => None,
            })
            .collect();
        for (i, a) in writes.iter().enumerate() {
            for b in writes.iter().skip(i + 1) {
                // etcd allows overlapping deletes; a put may not overlap anything.
                if (a.2 || b.2) && ranges_overlap(a.0, a.1, b.0, b.1) {
                    return Err(KvError::Invalid(
                        "duplicate key given in txn request".into(),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// What [`KvBackend::lease_time_to_live`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTtl {
    /// Seconds left before the lease ends unless kept alive (etcd: it ends in under
    /// `remaining_s + 1` seconds).
    pub remaining_s: i64,
    /// The TTL it was granted (and is renewed to by each keepalive).
    pub granted_s: i64,
}

/// One member of the etcd cluster.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ClusterMember {
    /// Member id.
    pub id: u64,
    /// Its name (empty while it has not started).
    pub name: String,
    /// URLs it serves clients on.
    pub client_urls: Vec<String>,
    /// URLs it talks to its peers on.
    pub peer_urls: Vec<String>,
    /// A learner (non-voting) member.
    pub is_learner: bool,
}

/// The status of the etcd member that answered.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ClusterStatus {
    /// The id of the member that answered.
    pub member_id: u64,
    /// The member it believes is leader (0: none).
    pub leader: u64,
    /// Its etcd version.
    pub version: String,
    /// Size of its database file, in bytes (what the space quota is checked against).
    pub db_size: i64,
    /// Bytes of that file in use (the rest is free pages a defragmentation gives back).
    pub db_size_in_use: i64,
    /// The store revision.
    pub revision: i64,
    /// The raft term.
    pub raft_term: u64,
    /// Errors the member reports (alarms, health).
    pub errors: Vec<String>,
}

/// Kind of an etcd alarm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlarmKind {
    /// The database reached its space quota: etcd refuses writes until it is compacted,
    /// defragmented and the alarm disarmed.
    NoSpace,
    /// A member found its data corrupt.
    Corrupt,
    /// An alarm this code does not know (its number).
    Other(i32),
}

/// An active alarm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alarm {
    /// The member that raised it.
    pub member_id: u64,
    /// What it is.
    pub kind: AlarmKind,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(version: i64) -> KeyValue {
        KeyValue {
            key: b"k".to_vec(),
            version,
            mod_revision: 5,
            create_revision: 3,
            ..Default::default()
        }
    }

    #[test]
    fn compare_semantics() {
        assert!(Compare::absent(b"k".to_vec()).eval(&[]));
        assert!(!Compare::absent(b"k".to_vec()).eval(&[kv(1)]));
        assert!(Compare::exists(b"k".to_vec()).eval(&[kv(2)]));
        assert!(Compare::mod_rev(b"k".to_vec(), 0).eval(&[]));
        assert!(Compare::mod_rev(b"k".to_vec(), 5).eval(&[kv(1)]));
        let value = Compare {
            key: b"k".to_vec(),
            range_end: None,
            op: CompareOp::NotEqual,
            target: CompareTarget::Value(vec![]),
        };
        assert!(!value.eval(&[]), "value compares on absent keys are false");
        let empty = Compare::range_empty(b"a".to_vec(), b"b".to_vec());
        assert!(empty.eval(&[]));
        assert!(!empty.eval(&[kv(1)]));
    }

    #[test]
    fn duplicate_writes_rejected() {
        let t = Txn {
            success: vec![
                TxnOp::put(b"a".to_vec(), vec![]),
                TxnOp::put(b"a".to_vec(), vec![]),
            ],
            ..Default::default()
        };
        assert!(check_txn(&t, 128).is_err());
        let t = Txn {
            success: vec![
                TxnOp::put(b"ab".to_vec(), vec![]),
                TxnOp::delete_range(b"a".to_vec(), b"b".to_vec(), false),
            ],
            ..Default::default()
        };
        assert!(check_txn(&t, 128).is_err());
        let t = Txn {
            success: vec![
                TxnOp::Range(RangeRequest::key(b"a".to_vec())),
                TxnOp::put(b"a".to_vec(), vec![]),
            ],
            ..Default::default()
        };
        assert!(check_txn(&t, 128).is_ok());
        let many = Txn {
            compares: vec![Compare::absent(vec![]); 129],
            ..Default::default()
        };
        assert_eq!(check_txn(&many, 128), Err(KvError::TooManyOps));
    }
}
