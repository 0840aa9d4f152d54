//! Sessions: membership, keepalive, group ownership and orphan reclaim, on the model
//! (lease expiry on an injected clock) and on a real etcd when `ETCD_ENDPOINTS` is set.
#![allow(clippy::unwrap_used)]

use std::{
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use meta::{
    clock::{Clock, ManualClock},
    etcd::{EtcdBackend, EtcdConfig},
    keys::Keyspace,
    kv::KvBackend,
    model::MemEtcd,
    pipeline::{plan, Mutation, NewInode, PlanCtx, Planned, Snapshot},
    session::{dead_orphans, group_owners, live_sessions, Session, SessionConfig},
    types::{FileType, GroupId, Ino, Timespec},
};

fn cfg(name: &str) -> SessionConfig {
    SessionConfig {
        keepalive_tick: Duration::from_millis(20),
        ..SessionConfig::new(name)
    }
}

/// Applies one mutation directly (plan + txn), for setting up state.
async fn apply(kv: &dyn KvBackend, keys: &Keyspace, m: Mutation, s: &Session, ino: Option<Ino>) {
    let mut snap = Snapshot::default();
    loop {
        let ctx = PlanCtx {
            keys,
            now: Timespec::new(1, 0),
            session: s.id(),
            new_ino: ino,
            block_size: 4096,
            groups: None,
            lock_at_create: true,
        };
        match plan(&m, &snap, &ctx) {
            Planned::Ready(p) => {
                let t = meta::kv::Txn {
                    compares: p.compares,
                    success: p.ops,
                    failure: vec![],
                };
                assert!(kv.txn(t).await.unwrap().succeeded);
                return;
            }
            Planned::Need(reqs) => {
                for r in reqs {
                    let resp = kv.range(r.clone()).await.unwrap();
                    snap.insert(&r, resp);
                }
            }
            Planned::Fail(e) => panic!("{e}"),
        }
    }
}

#[tokio::test]
async fn crash_frees_groups_and_orphans_on_model() {
    let clock = Arc::new(ManualClock::new(Timespec::new(1_700_000_000, 0)));
    let kv: Arc<dyn KvBackend> = Arc::new(MemEtcd::new(clock.clone()));
    let model = kv.clone();
    let keys = Keyspace::new("fs").unwrap();
    let root = meta::format::RootOwner {
        uid: 0,
        gid: 0,
        perm: 0o755,
    };
    let sb = meta::codec::SuperRecord {
        uuid: [2; 16],
        format_version: 1,
        block_size: 4096,
        group_size: 1 << 26,
        group_count: 4,
        device_size: 1 << 28,
        created: Timespec::new(1, 0),
    };
    meta::format::format(&*kv, &keys, &sb, root, Timespec::new(1, 0), false)
        .await
        .unwrap();
    let a = Session::register(kv.clone(), keys.clone(), &cfg("a"), clock.clone())
        .await
        .unwrap();
    let b = Session::register(kv.clone(), keys.clone(), &cfg("b"), clock.clone())
        .await
        .unwrap();
    assert_ne!(a.id(), b.id());
    assert_eq!(live_sessions(&*kv, &keys).await.unwrap().len(), 2);
    assert!(a.claim_group(GroupId(0)).await.unwrap());
    assert!(
        a.claim_group(GroupId(0)).await.unwrap(),
        "re-claiming your own group is fine"
    );
    assert!(!b.claim_group(GroupId(0)).await.unwrap());
    assert!(b.claim_group(GroupId(1)).await.unwrap());
    assert_eq!(a.owned_groups().await.unwrap(), vec![GroupId(0)]);
    // a has an unlinked-but-open file.
    let f = Ino(5000);
    let new = NewInode {
        kind: FileType::Regular,
        perm: 0o644,
        uid: 0,
        gid: 0,
        rdev: 0,
        flags: 0,
    };
    let create = Mutation::Create {
        parent: Ino::ROOT,
        name: b"f".to_vec(),
        inode: new,
        symlink: None,
        hold: false,
    };
    apply(&*kv, &keys, create, &a, Some(f)).await;
    let unlink = Mutation::Unlink {
        parent: Ino::ROOT,
        name: b"f".to_vec(),
        dir: false,
        keep_open: true,
        expect: None,
    };
    apply(&*kv, &keys, unlink, &a, None).await;
    assert!(
        dead_orphans(&*kv, &keys, 10).await.unwrap().is_empty(),
        "a is alive"
    );
    // Keepalives keep both alive across more than a TTL of (model) time.
    for _ in 0..3 {
        clock.advance(Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert_eq!(live_sessions(&*kv, &keys).await.unwrap().len(), 2);
    // a crashes: no more keepalives; after the TTL its keys are gone.
    let a_id = a.id();
    a.abandon();
    // Time moves in steps shorter than the TTL so b's keepalives keep up.
    for _ in 0..3 {
        clock.advance(Duration::from_secs(4));
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let live = live_sessions(&*kv, &keys).await.unwrap();
    assert_eq!(
        live.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![b.id()]
    );
    assert!(b.is_alive());
    assert_eq!(
        group_owners(&*kv, &keys).await.unwrap(),
        vec![(GroupId(1), b.id())]
    );
    assert!(
        b.claim_group(GroupId(0)).await.unwrap(),
        "the dead node's group is free"
    );
    let dead = dead_orphans(&*kv, &keys, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].ino, dead[0].session), (f, a_id));
    apply(&*kv, &keys, Mutation::ReclaimOrphan { ino: f }, &b, None).await;
    assert!(dead_orphans(&*kv, &keys, 10).await.unwrap().is_empty());
    let fence = b.group_fence(GroupId(0));
    let t = meta::kv::Txn {
        compares: vec![fence],
        ..Default::default()
    };
    assert!(model.txn(t).await.unwrap().succeeded);
    b.close().await.unwrap();
    assert!(live_sessions(&*kv, &keys).await.unwrap().is_empty());
    assert!(group_owners(&*kv, &keys).await.unwrap().is_empty());
}

#[tokio::test]
async fn session_on_real_etcd() {
    let Ok(eps) = std::env::var("ETCD_ENDPOINTS") else {
        eprintln!("SKIP: session_on_real_etcd needs a real etcd (set ETCD_ENDPOINTS)");
        return;
    };
    let eps: Vec<String> = eps.split(',').map(|s| s.trim().to_owned()).collect();
    let kv: Arc<dyn KvBackend> =
        Arc::new(EtcdBackend::connect(&EtcdConfig::new(eps)).await.unwrap());
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let keys = Keyspace::new(&format!("etcfs-test-{nanos:x}")).unwrap();
    let clock: Arc<dyn Clock> = Arc::new(meta::clock::SystemClock::new());
    let a = Session::register(kv.clone(), keys.clone(), &cfg("a"), clock.clone())
        .await
        .unwrap();
    let b = Session::register(kv.clone(), keys.clone(), &cfg("b"), clock.clone())
        .await
        .unwrap();
    assert!(a.claim_group(GroupId(3)).await.unwrap());
    assert!(!b.claim_group(GroupId(3)).await.unwrap());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(a.is_alive() && b.is_alive());
    assert_eq!(live_sessions(&*kv, &keys).await.unwrap().len(), 2);
    a.close().await.unwrap();
    assert!(
        b.claim_group(GroupId(3)).await.unwrap(),
        "revoking a's lease freed its group"
    );
    b.close().await.unwrap();
    let all = keys.all();
    let left = kv
        .range(meta::kv::RangeRequest::range(all.start, all.end))
        .await
        .unwrap();
    assert!(
        left.kvs.is_empty(),
        "leased keys are gone with their leases"
    );
}
