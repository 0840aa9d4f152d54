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

/// Nodes `a` and `b`, registered.
async fn two_sessions(
    kv: &Arc<dyn KvBackend>,
    keys: &Keyspace,
    clock: Arc<dyn Clock>,
) -> (Session, Session) {
    let (ca, cb) = (cfg("a"), cfg("b"));
    let a = Session::register(kv.clone(), keys.clone(), &ca, clock.clone());
    let a = a.await.unwrap();
    let b = Session::register(kv.clone(), keys.clone(), &cb, clock);
    (a, b.await.unwrap())
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
            read_only: false,
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
    let (clock, kv, keys) = formatted_model().await;
    let model = kv.clone();
    let (a, b) = two_sessions(&kv, &keys, clock.clone()).await;
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
    let new = NewInode::root_owned(FileType::Regular, 0o644);
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
        drop_own_hold: false,
        expect: None,
    };
    apply(&*kv, &keys, unlink, &a, None).await;
    assert!(
        dead_orphans(&*kv, &keys, None, 10)
            .await
            .unwrap()
            .orphans
            .is_empty(),
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
    let dead = dead_orphans(&*kv, &keys, None, 10).await.unwrap().orphans;
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].ino, dead[0].session), (f, a_id));
    apply(&*kv, &keys, Mutation::ReclaimOrphan { ino: f }, &b, None).await;
    assert!(dead_orphans(&*kv, &keys, None, 10)
        .await
        .unwrap()
        .orphans
        .is_empty());
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
    let (a, b) = two_sessions(&kv, &keys, clock.clone()).await;
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

/// A model with a filesystem formatted under prefix `fs`, on a manual clock.
async fn formatted_model() -> (Arc<ManualClock>, Arc<dyn KvBackend>, Keyspace) {
    let clock = Arc::new(ManualClock::new(Timespec::new(1_700_000_000, 0)));
    let kv: Arc<dyn KvBackend> = Arc::new(MemEtcd::new(clock.clone()));
    let keys = Keyspace::new("fs").unwrap();
    let root = meta::format::RootOwner {
        uid: 0,
        gid: 0,
        perm: 0o755,
    };
    let sb = meta::codec::SuperRecord {
        uuid: [3; 16],
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
    (clock, kv, keys)
}

async fn put(kv: &dyn KvBackend, key: Vec<u8>, value: Vec<u8>) {
    let t = meta::kv::Txn {
        success: vec![meta::kv::TxnOp::Put(meta::kv::PutOp {
            key,
            value,
            lease: 0,
        })],
        ..Default::default()
    };
    assert!(kv.txn(t).await.unwrap().succeeded);
}

/// More orphans than one page, two corrupt records among them: paging resumes after each
/// page's last key until every record has been seen once, and the corrupt ones are
/// reported by key and skipped, not an error that ends the scan (the first version read
/// only the first 256 records, and one bad value failed the whole read).
#[tokio::test]
async fn orphan_pages_cover_every_record_and_skip_corrupt_ones() {
    use meta::codec::Record as _;
    let (_clock, kv, keys) = formatted_model().await;
    let dead = meta::codec::Owner {
        session: meta::types::SessionId(77),
    };
    for i in 0..600u64 {
        put(&*kv, keys.orphan(Ino(2000 + i)), dead.encode()).await;
    }
    // A value that does not decode, and a key that is not an orphan's, inside the range.
    put(&*kv, keys.orphan(Ino(2300)), b"\x63garbage".to_vec()).await;
    let mut odd = keys.orphan(Ino(2400));
    odd.push(b'x');
    put(&*kv, odd, dead.encode()).await;
    let mut seen = Vec::new();
    let mut corrupt = Vec::new();
    let mut after: Option<Vec<u8>> = None;
    let mut pages = 0;
    loop {
        let page = dead_orphans(&*kv, &keys, after.as_deref(), 256)
            .await
            .unwrap();
        pages += 1;
        assert!(page.orphans.len() <= 256);
        seen.extend(page.orphans.iter().map(|o| o.ino.0));
        corrupt.extend(page.corrupt.iter().map(|e| e.to_string()));
        match page.next {
            Some(k) => after = Some(k),
            None => break,
        }
        assert!(pages < 10, "paging does not end");
    }
    assert_eq!(pages, 3, "601 records and one odd key in pages of 256");
    let want: Vec<u64> = (2000..2600).filter(|i| *i != 2300).collect();
    assert_eq!(seen, want, "every decodable orphan once, in order");
    assert_eq!(corrupt.len(), 2, "{corrupt:?}");
    assert!(
        corrupt[0].contains("O 2300"),
        "the corrupt record is named by its key: {}",
        corrupt[0]
    );
    // The first page alone, as before: corrupt records skipped, not an error.
    let first = meta::reader::orphans(&*kv, &keys, 400).await.unwrap();
    assert_eq!(first.len(), 399);
}

/// Everything a session holds in etcd apart from orphans lives under its lease: group
/// claims, its request for space, open records, cache locks held and waited for. A node
/// that stops renewing (kill -9) leaves none of them once its TTL has passed.
#[tokio::test]
async fn a_dead_sessions_keys_all_go_with_its_lease() {
    let (clock, kv, keys) = formatted_model().await;
    let (a, b) = two_sessions(&kv, &keys, clock.clone()).await;
    assert!(a.claim_group(GroupId(2)).await.unwrap());
    a.want_space().await.unwrap();
    let f = Ino(5000);
    let create = Mutation::Create {
        parent: Ino::ROOT,
        name: b"f".to_vec(),
        inode: NewInode::root_owned(FileType::Regular, 0o644),
        symlink: None,
        hold: true,
    };
    apply(&*kv, &keys, create, &a, Some(f)).await;
    apply(&*kv, &keys, Mutation::Hold { ino: f }, &b, None).await;
    let (la, lb) = (a.cache_locks(), b.cache_locks());
    let excl = meta::cachelock::LockMode::Exclusive;
    assert!(matches!(
        la.acquire(f, excl, None, None).await.unwrap(),
        meta::cachelock::Acquired::Granted { .. }
    ));
    let g = Ino(5001);
    assert!(matches!(
        lb.acquire(g, excl, None, None).await.unwrap(),
        meta::cachelock::Acquired::Granted { .. }
    ));
    // a waits for b's lock (Q), b for a's.
    assert!(matches!(
        la.acquire(g, excl, None, None).await.unwrap(),
        meta::cachelock::Acquired::Busy { .. }
    ));
    assert!(matches!(
        lb.acquire(f, excl, None, None).await.unwrap(),
        meta::cachelock::Acquired::Busy { .. }
    ));
    let a_id = a.id();
    let of_a = |kvs: &[meta::kv::KeyValue]| {
        kvs.iter()
            .filter(|kv| {
                use meta::keys::KeyKind::*;
                match keys.parse(&kv.key) {
                    Some(Member(s)) | Some(SpaceWanted(s)) => s == a_id,
                    Some(Held(_, s)) | Some(CacheLock(_, s)) | Some(CacheWant(_, s)) => s == a_id,
                    Some(Group(_)) => kv.value[1..9] == a_id.0.to_le_bytes(),
                    _ => false,
                }
            })
            .count()
    };
    let all = keys.all();
    let everything = || meta::kv::RangeRequest::range(all.start.clone(), all.end.clone());
    let before = kv.range(everything()).await.unwrap().kvs;
    assert_eq!(of_a(&before), 6, "M, G, W, H, K and Q of a");
    a.abandon();
    for _ in 0..4 {
        clock.advance(Duration::from_secs(4));
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let after = kv.range(everything()).await.unwrap().kvs;
    assert_eq!(of_a(&after), 0, "nothing of the dead session is left");
    assert!(b.is_alive());
    assert!(
        matches!(
            lb.acquire(f, excl, None, None).await.unwrap(),
            meta::cachelock::Acquired::Granted { .. }
        ),
        "b gets the dead node's lock"
    );
    b.close().await.unwrap();
}
