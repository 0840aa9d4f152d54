//! One conformance suite for every [`KvBackend`]: run against [`crate::model::MemEtcd`]
//! in every `cargo test`, and against a real etcd when `ETCD_ENDPOINTS` is set
//! (`meta/tests/conformance.rs`). When the model and etcd disagree, this suite is where
//! the disagreement is written down.
//!
//! It panics (asserts) on the first mismatch, like a test. It only touches keys under
//! `prefix` and deletes them at the end.

use std::time::Duration;

use crate::{
    error::KvError,
    keys::prefix_end,
    kv::{
        Compare, CompareOp, CompareTarget, EventKind, KvBackend, PutOp, RangeRequest, Txn, TxnOp,
        TxnOpResponse,
    },
};

fn k(prefix: &[u8], s: &str) -> Vec<u8> {
    let mut v = prefix.to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

async fn put(kv: &dyn KvBackend, key: Vec<u8>, value: &[u8]) -> i64 {
    let r = kv
        .txn(Txn {
            success: vec![TxnOp::put(key, value.to_vec())],
            ..Default::default()
        })
        .await
        .expect("put");
    assert!(r.succeeded);
    r.revision
}

async fn get(kv: &dyn KvBackend, key: Vec<u8>) -> Option<crate::kv::KeyValue> {
    let mut r = kv.range(RangeRequest::key(key)).await.expect("get");
    assert!(r.kvs.len() <= 1);
    r.kvs.pop()
}

fn range_of(r: &TxnOpResponse) -> &crate::kv::RangeResponse {
    match r {
        TxnOpResponse::Range(r) => r,
        other => panic!("expected a range response, got {other:?}"),
    }
}

/// Runs every check. `prefix` must be unique to this run (e.g. `/etcfs-test/<random>/`).
pub async fn run(kv: &dyn KvBackend, prefix: &[u8]) {
    revisions_and_versions(kv, prefix).await;
    compares(kv, prefix).await;
    ranges(kv, prefix).await;
    deletes(kv, prefix).await;
    txn_checks(kv, prefix).await;
    leases(kv, prefix).await;
    watches(kv, prefix).await;
    operations(kv, prefix).await;
    // Clean up.
    kv.txn(Txn {
        success: vec![TxnOp::delete_range(
            prefix.to_vec(),
            prefix_end(prefix),
            false,
        )],
        ..Default::default()
    })
    .await
    .expect("cleanup");
    let left = kv
        .range(RangeRequest::range(prefix.to_vec(), prefix_end(prefix)))
        .await
        .expect("range after cleanup");
    assert!(left.kvs.is_empty());
}

async fn revisions_and_versions(kv: &dyn KvBackend, p: &[u8]) {
    let r1 = put(kv, k(p, "a"), b"1").await;
    let a = get(kv, k(p, "a")).await.expect("a exists");
    assert_eq!((a.value.as_slice(), a.version), (b"1".as_slice(), 1));
    assert_eq!(a.create_revision, r1);
    assert_eq!(a.mod_revision, r1);
    let r2 = put(kv, k(p, "a"), b"2").await;
    assert_eq!(r2, r1 + 1, "one revision per writing txn");
    let a = get(kv, k(p, "a")).await.expect("a exists");
    assert_eq!((a.version, a.create_revision, a.mod_revision), (2, r1, r2));
    // Several writes in one txn share one revision.
    let r = kv
        .txn(Txn {
            success: vec![TxnOp::put(k(p, "b"), vec![]), TxnOp::put(k(p, "c"), vec![])],
            ..Default::default()
        })
        .await
        .expect("txn");
    assert_eq!(r.revision, r2 + 1);
    let b = get(kv, k(p, "b")).await.expect("b");
    let c = get(kv, k(p, "c")).await.expect("c");
    assert_eq!(b.mod_revision, c.mod_revision);
    // Read at an older revision.
    let old = kv
        .range(RangeRequest::key(k(p, "a")).at(r1))
        .await
        .expect("old read");
    assert_eq!(
        old.kvs.first().map(|kv| kv.value.clone()),
        Some(b"1".to_vec())
    );
    let before = kv
        .range(RangeRequest::key(k(p, "b")).at(r2))
        .await
        .expect("old read");
    assert!(before.kvs.is_empty());
}

async fn compares(kv: &dyn KvBackend, p: &[u8]) {
    let a = get(kv, k(p, "a")).await.expect("a");
    // Matching mod revision: success branch.
    let r = kv
        .txn(Txn {
            compares: vec![Compare::mod_rev(k(p, "a"), a.mod_revision)],
            success: vec![TxnOp::put(k(p, "a"), b"3".to_vec())],
            failure: vec![TxnOp::Range(RangeRequest::key(k(p, "a")))],
        })
        .await
        .expect("cas");
    assert!(r.succeeded);
    assert_eq!(r.responses, vec![TxnOpResponse::Put]);
    // Stale mod revision: failure branch, which reads the current value.
    let before = r.revision;
    let r = kv
        .txn(Txn {
            compares: vec![Compare::mod_rev(k(p, "a"), a.mod_revision)],
            success: vec![TxnOp::put(k(p, "a"), b"4".to_vec())],
            failure: vec![TxnOp::Range(RangeRequest::key(k(p, "a")))],
        })
        .await
        .expect("cas");
    assert!(!r.succeeded);
    assert_eq!(
        r.revision, before,
        "a read-only branch does not bump the revision"
    );
    let seen = range_of(r.responses.first().expect("one response"));
    assert_eq!(
        seen.kvs.first().map(|kv| kv.value.clone()),
        Some(b"3".to_vec())
    );
    // Absent / exists / value compares.
    let absent = Compare::absent(k(p, "nope"));
    let exists = Compare::exists(k(p, "a"));
    let r = kv
        .txn(Txn {
            compares: vec![absent, exists],
            ..Default::default()
        })
        .await
        .expect("t");
    assert!(r.succeeded);
    let value_on_missing = Compare {
        key: k(p, "nope"),
        range_end: None,
        op: CompareOp::NotEqual,
        target: CompareTarget::Value(b"x".to_vec()),
    };
    let r = kv
        .txn(Txn {
            compares: vec![value_on_missing],
            ..Default::default()
        })
        .await
        .expect("t");
    assert!(!r.succeeded, "a value compare on a missing key is false");
    let value_eq = Compare {
        key: k(p, "a"),
        range_end: None,
        op: CompareOp::Equal,
        target: CompareTarget::Value(b"3".to_vec()),
    };
    let r = kv
        .txn(Txn {
            compares: vec![value_eq],
            ..Default::default()
        })
        .await
        .expect("t");
    assert!(r.succeeded);
    // mod_rev == 0 means absent.
    let r = kv
        .txn(Txn {
            compares: vec![Compare::mod_rev(k(p, "nope"), 0)],
            ..Default::default()
        })
        .await
        .expect("t");
    assert!(r.succeeded);
    // Range compares: "empty range" holds on an empty range and fails otherwise.
    let empty = Compare::range_empty(k(p, "dir/"), k(p, "dir0"));
    let r = kv
        .txn(Txn {
            compares: vec![empty.clone()],
            ..Default::default()
        })
        .await
        .expect("t");
    assert!(r.succeeded);
    put(kv, k(p, "dir/x"), b"").await;
    let r = kv
        .txn(Txn {
            compares: vec![empty],
            ..Default::default()
        })
        .await
        .expect("t");
    assert!(!r.succeeded);
    let older = Compare {
        key: k(p, "a"),
        range_end: Some(k(p, "c\0")),
        op: CompareOp::Less,
        target: CompareTarget::ModRevision(i64::MAX),
    };
    let r = kv
        .txn(Txn {
            compares: vec![older],
            ..Default::default()
        })
        .await
        .expect("t");
    assert!(r.succeeded);
    // The lock acquisition's guard (src/fs/plocks.rs): "every key of the range is older than
    // R+1" holds over an empty range and after a delete, and fails once a key is created
    // (or changed) in the range after R.
    let range = |p: &[u8]| (k(p, "lk/"), prefix_end(&k(p, "lk/")));
    let (start, end) = range(p);
    let read = kv
        .range(RangeRequest::range(start.clone(), end.clone()))
        .await
        .expect("range");
    let older_than = |rev: i64| Compare {
        key: start.clone(),
        range_end: Some(end.clone()),
        op: CompareOp::Less,
        target: CompareTarget::ModRevision(rev + 1),
    };
    let guarded = |rev: i64| Txn {
        compares: vec![older_than(rev)],
        ..Default::default()
    };
    assert!(kv.txn(guarded(read.revision)).await.expect("t").succeeded);
    let made = put(kv, k(p, "lk/a"), b"").await;
    assert!(!kv.txn(guarded(read.revision)).await.expect("t").succeeded);
    assert!(kv.txn(guarded(made)).await.expect("t").succeeded);
    put(kv, k(p, "lk/b"), b"").await;
    let r = kv
        .txn(Txn {
            success: vec![TxnOp::delete(k(p, "lk/b"))],
            ..Default::default()
        })
        .await
        .expect("t");
    assert!(kv.txn(guarded(r.revision)).await.expect("t").succeeded);
    // Compares see the state before the txn; ops apply in order and ranges see them.
    let r = kv
        .txn(Txn {
            compares: vec![Compare::absent(k(p, "seq"))],
            success: vec![
                TxnOp::put(k(p, "seq"), b"v".to_vec()),
                TxnOp::Range(RangeRequest::key(k(p, "seq"))),
            ],
            failure: vec![],
        })
        .await
        .expect("t");
    assert!(r.succeeded);
    let seen = range_of(r.responses.get(1).expect("two responses"));
    assert_eq!(seen.kvs.len(), 1);
    assert_eq!(seen.kvs.first().map(|kv| kv.mod_revision), Some(r.revision));
    // Failure branch writes apply.
    let r = kv
        .txn(Txn {
            compares: vec![Compare::absent(k(p, "seq"))],
            success: vec![],
            failure: vec![TxnOp::put(k(p, "fail-wrote"), b"y".to_vec())],
        })
        .await
        .expect("t");
    assert!(!r.succeeded);
    assert!(get(kv, k(p, "fail-wrote")).await.is_some());
}

async fn ranges(kv: &dyn KvBackend, p: &[u8]) {
    for i in 0..5 {
        put(kv, k(p, &format!("r/{i}")), format!("v{i}").as_bytes()).await;
    }
    let all = RangeRequest::range(k(p, "r/"), k(p, "r0"));
    let r = kv.range(all.clone()).await.expect("range");
    assert_eq!(r.kvs.len(), 5);
    assert_eq!((r.count, r.more), (5, false));
    let names: Vec<Vec<u8>> = r.kvs.iter().map(|kv| kv.key.clone()).collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted, "ascending key order");
    let r = kv.range(all.clone().limit(2)).await.expect("range");
    assert_eq!((r.kvs.len(), r.more, r.count), (2, true, 5));
    let r = kv.range(all.clone().keys_only()).await.expect("range");
    assert!(r
        .kvs
        .iter()
        .all(|kv| kv.value.is_empty() && kv.version == 1));
    let r = kv
        .range(all.clone().descending().limit(1))
        .await
        .expect("range");
    assert_eq!(r.kvs.first().map(|kv| kv.key.clone()), Some(k(p, "r/4")));
    let r = kv
        .range(RangeRequest::range(k(p, "r/1\0"), k(p, "r0")).limit(1))
        .await
        .expect("r");
    assert_eq!(
        r.kvs.first().map(|kv| kv.key.clone()),
        Some(k(p, "r/2")),
        "resume after a key"
    );
    let r = kv
        .range(RangeRequest::key(k(p, "missing")))
        .await
        .expect("range");
    assert!(r.kvs.is_empty() && r.count == 0);
    assert!(r.revision > 0);
}

async fn deletes(kv: &dyn KvBackend, p: &[u8]) {
    let before = kv
        .range(RangeRequest::key(k(p, "x")))
        .await
        .expect("r")
        .revision;
    let r = kv
        .txn(Txn {
            success: vec![TxnOp::delete_range(
                k(p, "nothing/"),
                k(p, "nothing0"),
                true,
            )],
            ..Default::default()
        })
        .await
        .expect("t");
    assert_eq!(r.revision, before, "deleting nothing is not a change");
    assert_eq!(
        r.responses,
        vec![TxnOpResponse::Delete {
            deleted: 0,
            prev_kvs: vec![]
        }]
    );
    let r = kv
        .txn(Txn {
            success: vec![TxnOp::delete_range(k(p, "r/"), k(p, "r/3"), true)],
            ..Default::default()
        })
        .await
        .expect("t");
    assert_eq!(r.revision, before + 1);
    match r.responses.first() {
        Some(TxnOpResponse::Delete { deleted, prev_kvs }) => {
            assert_eq!(*deleted, 3);
            let vals: Vec<&[u8]> = prev_kvs.iter().map(|kv| kv.value.as_slice()).collect();
            assert_eq!(vals, vec![b"v0".as_slice(), b"v1", b"v2"]);
        }
        other => panic!("unexpected {other:?}"),
    }
    // A re-created key starts at version 1 with a new create revision.
    let r = put(kv, k(p, "r/0"), b"again").await;
    let kv0 = get(kv, k(p, "r/0")).await.expect("r/0");
    assert_eq!((kv0.version, kv0.create_revision), (1, r));
}

async fn txn_checks(kv: &dyn KvBackend, p: &[u8]) {
    let dup = Txn {
        success: vec![TxnOp::put(k(p, "d"), vec![]), TxnOp::put(k(p, "d"), vec![])],
        ..Default::default()
    };
    assert!(matches!(kv.txn(dup).await, Err(KvError::Invalid(_))));
    let put_in_delete = Txn {
        success: vec![
            TxnOp::delete_range(k(p, "d/"), k(p, "d0"), false),
            TxnOp::put(k(p, "d/1"), vec![]),
        ],
        ..Default::default()
    };
    assert!(matches!(
        kv.txn(put_in_delete).await,
        Err(KvError::Invalid(_))
    ));
    let overlapping_deletes = Txn {
        success: vec![
            TxnOp::delete_range(k(p, "d/"), k(p, "d0"), false),
            TxnOp::delete(k(p, "d/1")),
        ],
        ..Default::default()
    };
    assert!(kv.txn(overlapping_deletes).await.is_ok());
    let many: Vec<TxnOp> = (0..129)
        .map(|i| TxnOp::put(k(p, &format!("m/{i}")), vec![]))
        .collect();
    let r = kv
        .txn(Txn {
            success: many,
            ..Default::default()
        })
        .await;
    assert_eq!(r, Err(KvError::TooManyOps));
    let ok: Vec<TxnOp> = (0..128)
        .map(|i| TxnOp::put(k(p, &format!("m/{i}")), vec![]))
        .collect();
    assert!(kv
        .txn(Txn {
            success: ok,
            ..Default::default()
        })
        .await
        .is_ok());
}

async fn leases(kv: &dyn KvBackend, p: &[u8]) {
    let lease = kv.lease_grant(30).await.expect("grant");
    assert!(lease.id != 0 && lease.ttl_s >= 30);
    let r = kv
        .txn(Txn {
            success: vec![TxnOp::Put(PutOp {
                key: k(p, "leased"),
                value: vec![],
                lease: lease.id,
            })],
            ..Default::default()
        })
        .await
        .expect("put with lease");
    assert!(r.succeeded);
    assert_eq!(
        get(kv, k(p, "leased")).await.map(|kv| kv.lease),
        Some(lease.id)
    );
    assert!(kv.lease_keepalive(lease.id).await.expect("keepalive") > 0);
    kv.lease_revoke(lease.id).await.expect("revoke");
    assert!(
        get(kv, k(p, "leased")).await.is_none(),
        "revoking deletes attached keys"
    );
    assert_eq!(
        kv.lease_keepalive(lease.id).await,
        Err(KvError::LeaseNotFound)
    );
    let bogus = Txn {
        success: vec![TxnOp::Put(PutOp {
            key: k(p, "x"),
            value: vec![],
            lease: lease.id,
        })],
        ..Default::default()
    };
    assert_eq!(kv.txn(bogus).await, Err(KvError::LeaseNotFound));
}

/// The queries behind `etcfs status`: a lease's time to live, the members, the status of
/// the member that answers, the alarms.
async fn operations(kv: &dyn KvBackend, p: &[u8]) {
    let lease = kv.lease_grant(30).await.expect("grant");
    let ttl = kv.lease_time_to_live(lease.id).await.expect("time to live");
    assert!(ttl.granted_s >= 30, "{ttl:?}");
    assert!(
        ttl.remaining_s > 0 && ttl.remaining_s <= ttl.granted_s,
        "{ttl:?}"
    );
    kv.lease_revoke(lease.id).await.expect("revoke");
    assert_eq!(
        kv.lease_time_to_live(lease.id).await,
        Err(KvError::LeaseNotFound),
        "a revoked lease has no time to live"
    );
    let members = kv.member_list().await.expect("member list");
    assert!(!members.is_empty());
    assert!(members.iter().all(|m| m.id != 0), "{members:?}");
    let written = put(kv, k(p, "status"), b"x").await;
    let status = kv.status().await.expect("status");
    assert!(status.revision >= written, "{status:?} after {written}");
    assert!(
        members.iter().any(|m| m.id == status.member_id),
        "the member that answered is listed: {status:?} {members:?}"
    );
    assert!(status.leader != 0, "a cluster that answers has a leader");
    assert!(
        status.db_size > 0 && status.db_size_in_use > 0 && status.db_size_in_use <= status.db_size,
        "{status:?}"
    );
    kv.alarms().await.expect("alarm list");
}

async fn watches(kv: &dyn KvBackend, p: &[u8]) {
    let r1 = put(kv, k(p, "w/a"), b"1").await;
    put(kv, k(p, "w/b"), b"2").await;
    put(kv, k(p, "outside"), b"3").await;
    let mut stream = kv.watch(k(p, "w/"), k(p, "w0"), r1).await.expect("watch");
    let mut seen = Vec::new();
    while seen.len() < 2 {
        seen.extend(next_batch(&mut stream).await);
    }
    assert_eq!(
        seen.first().map(|e| (e.kind, e.kv.key.clone())),
        Some((EventKind::Put, k(p, "w/a")))
    );
    assert_eq!(seen.get(1).map(|e| e.kv.value.clone()), Some(b"2".to_vec()));
    let r = kv
        .txn(Txn {
            success: vec![TxnOp::delete(k(p, "w/a"))],
            ..Default::default()
        })
        .await
        .expect("delete");
    let ev = next_batch(&mut stream).await;
    assert_eq!(ev.len(), 1);
    let e = ev.first().expect("one event");
    assert_eq!((e.kind, e.kv.mod_revision), (EventKind::Delete, r.revision));
}

async fn next_batch(s: &mut crate::kv::WatchStream) -> Vec<crate::kv::WatchEvent> {
    tokio::time::timeout(Duration::from_secs(5), s.recv())
        .await
        .expect("watch event within 5 s")
        .expect("stream open")
        .expect("no watch error")
}
