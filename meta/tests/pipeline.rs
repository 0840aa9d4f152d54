//! Pipeline tests on the in-memory model: grouping, conflict-only retry, inode
//! reservation across sessions, directory timestamp coalescing and flush, back-pressure,
//! corrupt values, an unreachable etcd.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::{
    collections::HashSet,
    sync::Arc,
    time::{Duration, Instant},
};

use meta::{
    clock::{Clock, ManualClock},
    codec::Dentry,
    codec::{InodeAttr, Record},
    error::MetaError,
    etcd::{EtcdBackend, EtcdConfig},
    format::{format, RootOwner},
    keys::Keyspace,
    kv::KvBackend,
    model::{Faults, MemEtcd},
    pipeline::{
        Config, ExtentsExpect, MetaClient, Mutation, NewInode, Outcome, Pipeline, SetAttr,
        UnlinkExpect,
    },
    types::{FileType, Ino, SessionId, Timespec},
};

use common::{start, T0};

async fn formatted(clock: Arc<ManualClock>) -> (Arc<MemEtcd>, Keyspace) {
    let kv = Arc::new(MemEtcd::new(clock));
    let keys = Keyspace::new("fs").unwrap();
    common::format_model(&kv, &keys).await;
    assert_eq!(
        format(&*kv, &keys, &common::superblock(), common::ROOT, T0, false).await,
        Err(MetaError::Exists)
    );
    (kv, keys)
}

fn create(parent: Ino, name: &str, kind: FileType) -> Mutation {
    Mutation::Create {
        parent,
        name: name.as_bytes().to_vec(),
        inode: NewInode::root_owned(kind, 0o644),
        symlink: None,
        hold: false,
    }
}

fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(T0))
}

/// A formatted model etcd, session 1's pipeline on it, and a new regular file `name` in the
/// root.
async fn with_file(name: &str) -> (Arc<MemEtcd>, Keyspace, Pipeline, MetaClient, Ino) {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    let p = start(kv.clone(), &keys, 1, c, Config::default());
    let client = p.client();
    let f = client
        .commit(create(Ino::ROOT, name, FileType::Regular))
        .unwrap()
        .ino
        .unwrap();
    (kv, keys, p, client, f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_are_grouped() {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    kv.set_faults(Faults {
        txn_latency: Duration::from_millis(5),
        ..Default::default()
    });
    let p = start(
        kv.clone(),
        &keys,
        1,
        c,
        Config {
            txns_in_flight_max: 2,
            ..Config::default()
        },
    );
    let client = p.client();
    let n = 200;
    let tickets: Vec<_> = (0..n)
        .map(|i| {
            client
                .submit(create(Ino::ROOT, &format!("f{i}"), FileType::Regular))
                .unwrap()
        })
        .collect();
    let mut inos = HashSet::new();
    for t in tickets {
        let o = t.await.unwrap();
        assert!(o.revision.0 > 0);
        inos.insert(o.ino.unwrap());
    }
    assert_eq!(inos.len(), n);
    let s = client.stats();
    eprintln!(
        "grouping: {s:?} mean {:.1} mutations/txn",
        s.mutations_per_txn()
    );
    assert!(
        s.txns_committed < n as u64 / 4,
        "expected grouping, got {} txns",
        s.txns_committed
    );
    assert!(s.mutations_per_txn() > 4.0);
    assert!(
        s.mutations_per_txn_max <= 64,
        "each create is 2 ops; 128 ops per txn max"
    );
    let names = client.dir_names(Ino::ROOT, 4096).unwrap().await.unwrap();
    assert_eq!(names.entries.len(), n);
    let capped = client.dir_names(Ino::ROOT, 100).unwrap().await;
    assert_eq!(capped, Err(MetaError::OverLimit { limit: 100 }));
    let page = client
        .list_dir(Ino::ROOT, Some(b"f10".to_vec()), 3)
        .unwrap()
        .await
        .unwrap();
    let got: Vec<_> = page.entries.iter().map(|e| e.name.clone()).collect();
    assert_eq!(
        got,
        vec![b"f100".to_vec(), b"f101".to_vec(), b"f102".to_vec()]
    );
    assert!(page.more);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_conflicting_mutation_is_replanned() {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    let cfg = Config {
        txns_in_flight_max: 1,
        ..Config::default()
    };
    let p = start(kv.clone(), &keys, 1, c, cfg);
    let client = p.client();
    let f = client
        .commit(create(Ino::ROOT, "f", FileType::Regular))
        .unwrap()
        .ino
        .unwrap();
    // Another node rewrites f's inode (uid 77) right before our batch commits.
    let mut theirs = client.get_inode(f).unwrap().await.unwrap().unwrap().0;
    theirs.uid = 77;
    kv.set_faults(Faults {
        txn_latency: Duration::from_millis(30),
        interfere: Some((keys.inode(f), vec![(keys.inode(f), theirs.encode())])),
        ..Default::default()
    });
    let before = client.stats();
    // The blocker holds the only txn slot while setattr reads f; then setattr and the
    // independent create go in one txn, which the interference fails.
    let blocker = client
        .submit(create(Ino::ROOT, "blocker", FileType::Regular))
        .unwrap();
    let set = SetAttr {
        perm: Some(0o600),
        ..Default::default()
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    let t1 = client.submit(Mutation::SetAttr { ino: f, set }).unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let t2 = client
        .submit(create(Ino::ROOT, "g", FileType::Regular))
        .unwrap();
    blocker.await.unwrap();
    let a = t1.await.unwrap().attr.unwrap();
    t2.await.unwrap();
    assert_eq!(
        (a.uid, a.perm),
        (77, 0o600),
        "re-planned on the winner's value"
    );
    let s = client.stats();
    eprintln!("conflict: {s:?}");
    assert_eq!(s.compare_failures - before.compare_failures, 1);
    assert_eq!(
        s.conflicted_mutations - before.conflicted_mutations,
        1,
        "only setattr re-planned"
    );
    assert_eq!(
        s.retries - before.retries,
        2,
        "the create was resent as planned"
    );
    assert!(s.mutations_per_txn_max >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inode_numbers_reserved_in_blocks_across_sessions() {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    let p1 = start(kv.clone(), &keys, 1, c.clone(), Config::default());
    let p2 = start(kv.clone(), &keys, 2, c, Config::default());
    let (a, b) = (p1.client(), p2.client());
    let d1 = a
        .commit(create(Ino::ROOT, "d1", FileType::Directory))
        .unwrap()
        .ino
        .unwrap();
    let d2 = b
        .commit(create(Ino::ROOT, "d2", FileType::Directory))
        .unwrap()
        .ino
        .unwrap();
    let n = 1500;
    let run = |cl: meta::pipeline::MetaClient, d: Ino| {
        std::thread::spawn(move || {
            let ts: Vec<_> = (0..n)
                .map(|i| {
                    cl.submit_blocking(create(d, &format!("x{i}"), FileType::Regular))
                        .unwrap()
                })
                .collect();
            ts.into_iter()
                .map(|t| t.wait().unwrap().ino.unwrap().0)
                .collect::<Vec<u64>>()
        })
    };
    let (ha, hb) = (run(a.clone(), d1), run(b.clone(), d2));
    let (ia, ib) = (ha.join().unwrap(), hb.join().unwrap());
    let all: HashSet<u64> = ia.iter().chain(&ib).copied().collect();
    assert_eq!(all.len(), 2 * n, "no inode number handed out twice");
    assert!(all.iter().all(|&i| i >= Ino::FIRST_DYNAMIC));
    let blocks_a: HashSet<u64> = ia.iter().map(|i| i / 1024).collect();
    let blocks_b: HashSet<u64> = ib.iter().map(|i| i / 1024).collect();
    assert!(
        blocks_a.is_disjoint(&blocks_b),
        "each block belongs to one session"
    );
    let (sa, sb) = (a.stats(), b.stats());
    assert!(
        sa.ino_blocks_reserved >= 2 && sa.ino_blocks_reserved <= 4,
        "{sa:?}"
    );
    assert!(
        sb.ino_blocks_reserved >= 2 && sb.ino_blocks_reserved <= 4,
        "{sb:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dir_timestamps_are_coalesced_and_flushed() {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    let p = start(
        kv.clone(),
        &keys,
        1,
        c.clone(),
        Config {
            flush_interval_ms: 1000,
            ..Config::default()
        },
    );
    let client = p.client();
    let d = client
        .commit(create(Ino::ROOT, "d", FileType::Directory))
        .unwrap()
        .ino
        .unwrap();
    let mtime0 = client.get_inode(d).unwrap().await.unwrap().unwrap().0.mtime;
    c.advance(Duration::from_millis(10));
    let ts: Vec<_> = (0..50)
        .map(|i| {
            client
                .submit(create(d, &format!("f{i}"), FileType::Regular))
                .unwrap()
        })
        .collect();
    for t in ts {
        t.await.unwrap();
    }
    let s = client.stats();
    assert_eq!(s.touches_written, 0, "nothing written before the interval");
    assert_eq!(s.touches_coalesced, 49);
    assert_eq!(
        client.get_inode(d).unwrap().await.unwrap().unwrap().0.mtime,
        mtime0
    );
    // The interval passes: exactly one write.
    c.advance(Duration::from_millis(1000));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let a: InodeAttr = client.get_inode(d).unwrap().await.unwrap().unwrap().0;
        if a.mtime > mtime0 {
            assert_eq!(a.mtime, Timespec::new(T0.sec, 10_000_000));
            break;
        }
        assert!(Instant::now() < deadline, "timestamp never written");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(client.stats().touches_written, 1);
    // More creates, then a flush barrier writes the timestamp now, without waiting.
    c.advance(Duration::from_millis(10));
    // The creates are committed before the barrier, so the count below does not depend on
    // whether a create's commit races the flush (it did, about one run in fifteen).
    let ts: Vec<_> = (0..5)
        .map(|i| {
            client
                .submit(create(d, &format!("g{i}"), FileType::Regular))
                .unwrap()
        })
        .collect();
    for t in ts {
        t.await.unwrap();
    }
    assert_eq!(
        client.stats().touches_written,
        1,
        "still within the interval"
    );
    client.flush(Some(d)).unwrap().await.unwrap();
    assert_eq!(client.stats().touches_written, 2);
    let a = client.get_inode(d).unwrap().await.unwrap().unwrap().0;
    assert_eq!(a.mtime, Timespec::new(T0.sec + 1, 20_000_000));
    assert_eq!(
        client
            .list_dir(d, None, 100)
            .unwrap()
            .await
            .unwrap()
            .entries
            .len(),
        55
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_queue_pushes_back() {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    kv.set_faults(Faults {
        txn_latency: Duration::from_millis(200),
        ..Default::default()
    });
    let cfg = Config {
        submit_queue_max: 4,
        pending_max: 2,
        txns_in_flight_max: 1,
        ..Config::default()
    };
    let p = start(kv.clone(), &keys, 1, c, cfg);
    let client = p.client();
    let mut accepted = Vec::new();
    let mut full = 0;
    for i in 0..50 {
        match client.submit(create(Ino::ROOT, &format!("f{i}"), FileType::Regular)) {
            Ok(t) => accepted.push(t),
            Err(MetaError::QueueFull) => full += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(full > 0, "the queue must refuse past its bound");
    assert!(accepted.len() <= 4 + 2 + 1, "accepted {}", accepted.len());
    for t in accepted {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_value_reports_the_key() {
    let (kv, keys, _p, client, f) = with_file("f").await;
    kv.put_raw(&keys.inode(f), b"\x01short");
    let err = client
        .commit(Mutation::SetAttr {
            ino: f,
            set: SetAttr::default(),
        })
        .unwrap_err();
    assert!(
        matches!(&err, MetaError::Corrupt { key, .. } if *key == format!("fs/I {f}")),
        "{err}"
    );
    let err = client.get_inode(f).unwrap().await.unwrap_err();
    assert!(matches!(err, MetaError::Corrupt { .. }));
}

#[test]
fn unreachable_etcd_fails_pipeline_start_within_5s() {
    let t = Instant::now();
    let connect: meta::pipeline::Connect = Box::new(|| {
        Box::pin(async {
            let cfg = EtcdConfig::new(vec!["http://127.0.0.1:1".into()]);
            Ok(Arc::new(EtcdBackend::connect(&cfg).await?) as Arc<dyn KvBackend>)
        })
    });
    let keys = Keyspace::new("fs").unwrap();
    let r = Pipeline::start(connect, keys, SessionId(1), clock(), Config::default());
    assert!(matches!(r, Err(MetaError::Unavailable(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// Unlink and rmdir with what a cache expects: exact expectations commit without a read,
/// stale ones are caught by their compares and end like a plain unlink would.
fn unlink_expectations(client: &MetaClient) {
    let attr = |ino: Ino| client.get_inode(ino).unwrap().wait().unwrap().unwrap().0;
    let made = |parent: Ino, name: &str, kind: FileType| {
        let o = client.commit(create(parent, name, kind)).unwrap();
        let a = o.attr.unwrap();
        (Dentry { ino: a.ino, kind }, a)
    };
    let unlink = |parent: Ino, name: &str, dir: bool, expect: Option<UnlinkExpect>| {
        client.commit(Mutation::Unlink {
            parent,
            name: name.as_bytes().to_vec(),
            dir,
            keep_open: false,
            drop_own_hold: false,
            expect: expect.map(Box::new),
        })
    };
    let exp = |entry: Dentry, child: Option<InodeAttr>, parent: Option<InodeAttr>| UnlinkExpect {
        entry,
        child,
        parent,
        extents: None,
    };
    let (dd, _) = made(Ino::ROOT, "xd", FileType::Directory);
    let d = dd.ino;
    let (fd, fa) = made(d, "f", FileType::Regular);
    let (gd, ga) = made(d, "g", FileType::Regular);
    let (ed, _) = made(d, "e", FileType::Directory);
    made(ed.ino, "x", FileType::Regular);
    let (hd, _) = made(d, "h", FileType::Regular);
    client.flush(None).unwrap().wait().unwrap();

    // Exact: no read at all.
    let reads = client.stats().read_txns;
    let o = unlink(d, "f", false, Some(exp(fd, Some(fa), None))).unwrap();
    assert_eq!(o.removed, Some(fd.ino));
    assert_eq!(
        client.stats().read_txns,
        reads,
        "an exact expectation reads nothing"
    );
    // Stale attributes (a chmod since): the compare fails, the retry uses fresh values.
    client
        .commit(Mutation::SetAttr {
            ino: gd.ino,
            set: SetAttr {
                perm: Some(0o600),
                ..SetAttr::default()
            },
        })
        .unwrap();
    let o = unlink(d, "g", false, Some(exp(gd, Some(ga.clone()), None))).unwrap();
    assert_eq!(o.removed, Some(gd.ino));
    // A name that is gone: NotFound, not a conflict.
    assert_eq!(
        unlink(d, "g", false, Some(exp(gd, Some(ga), None))).unwrap_err(),
        MetaError::NotFound
    );
    // The cache thinks "h" is the directory "e": the unlink still removes the file.
    let o = unlink(d, "h", false, Some(exp(ed, Some(attr(ed.ino)), None))).unwrap();
    assert_eq!(o.removed, Some(hd.ino));
    // rmdir of a non-empty directory with a full expectation: NotEmpty.
    let full = || exp(ed, Some(attr(ed.ino)), Some(attr(d)));
    assert_eq!(
        unlink(d, "e", true, Some(full())).unwrap_err(),
        MetaError::NotEmpty
    );
    assert_eq!(
        unlink(d, "e", false, Some(full())).unwrap_err(),
        MetaError::IsDir
    );
    unlink(ed.ino, "x", false, None).unwrap();
    client.flush(None).unwrap().wait().unwrap();
    let expect = full();
    let reads = client.stats().read_txns;
    let o = unlink(d, "e", true, Some(expect)).unwrap();
    assert_eq!(o.removed, Some(ed.ino));
    assert_eq!(
        client.stats().read_txns,
        reads,
        "an exact rmdir reads nothing"
    );
    assert_eq!(attr(d).nlink, 2);
    client.flush(None).unwrap().wait().unwrap();
    unlink(Ino::ROOT, "xd", true, None).unwrap();
}

/// Appends planned from the last commit's record: exact ones read nothing, stale ones
/// (the inode changed since, a key appeared) are re-planned from etcd and end as a plain
/// commit would.
fn extents_expectations(client: &MetaClient) {
    let f = client
        .commit(create(Ino::ROOT, "appended", FileType::Regular))
        .unwrap()
        .ino
        .unwrap();
    let extent = |i: u64, dev: u64| meta::codec::Extent {
        file_off: i * 4096,
        len: 4096,
        dev_off: dev,
        unwritten: false,
    };
    let append = |e: meta::codec::Extent, expect: Option<ExtentsExpect>| {
        client.commit(Mutation::SetExtents {
            ino: f,
            off: e.file_off,
            len: e.len,
            extents: vec![e],
            size_at_least: Some(e.file_end()),
            touch_mtime: true,
            free_maps: Vec::new(),
            expect: expect.map(Box::new),
        })
    };
    let next = |o: &Outcome, e: meta::codec::Extent| {
        o.extents_known.as_ref().unwrap().expectation(
            o.attr.as_ref().unwrap(),
            e.file_off,
            e.file_end(),
        )
    };
    let mut o = append(extent(0, 1 << 20), None).unwrap();
    client.flush(None).unwrap().wait().unwrap();
    let reads = client.stats().read_txns;
    for i in 1..8 {
        let e = extent(i, (1 << 20) + i * 4096);
        o = append(e, next(&o, e)).unwrap();
    }
    assert_eq!(
        client.stats().read_txns,
        reads,
        "appends from the last commit's record read nothing"
    );
    // Stale: a chmod since (the inode's value changed).
    client
        .commit(Mutation::SetAttr {
            ino: f,
            set: SetAttr {
                perm: Some(0o600),
                ..SetAttr::default()
            },
        })
        .unwrap();
    let e = extent(8, 1 << 24);
    let stale = next(&o, e);
    o = append(e, stale).unwrap();
    assert_eq!(
        o.attr.as_ref().unwrap().perm,
        0o600,
        "planned from etcd again"
    );
    assert!(client.stats().retries > 0);
    // Stale: another writer put a key where the record guesses none.
    let e = extent(9, 1 << 25);
    let stale = next(&o, e);
    client
        .commit(Mutation::SetExtents {
            ino: f,
            off: 9 * 4096,
            len: 8192,
            extents: vec![extent(9, 1 << 26), extent(10, (1 << 26) + 4096)],
            size_at_least: None,
            touch_mtime: false,
            free_maps: Vec::new(),
            expect: None,
        })
        .unwrap();
    let o = append(e, stale).unwrap();
    assert_eq!(
        o.freed.len(),
        1,
        "the other writer's block at 9 is replaced"
    );
    let (map, more) = client.extents(f, 0, 100).unwrap().wait().unwrap();
    assert!(!more);
    let mut want: Vec<_> = (0..8).map(|i| extent(i, (1 << 20) + i * 4096)).collect();
    want[0] = extent(0, 1 << 20);
    want.extend([
        extent(8, 1 << 24),
        extent(9, 1 << 25),
        extent(10, (1 << 26) + 4096),
    ]);
    assert_eq!(map, want);
    assert_eq!(
        o.attr.unwrap().size,
        10 * 4096,
        "the other writer raised no size"
    );
    client.flush(None).unwrap().wait().unwrap();
    client
        .commit(Mutation::Unlink {
            parent: Ino::ROOT,
            name: b"appended".to_vec(),
            dir: false,
            keep_open: false,
            drop_own_hold: false,
            expect: None,
        })
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extents_with_expectations_on_the_model() {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    let p = start(kv, &keys, 1, c, Config::default());
    let client = p.client();
    tokio::task::spawn_blocking(move || extents_expectations(&client))
        .await
        .unwrap();
}

/// An expectation whose value and gap compares do not fit a small transaction is dropped
/// and the mutation planned from reads (fewer compares), not failed as too big.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expectation_too_big_for_the_transaction_plans_from_reads() {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    let cfg = Config {
        batch_ops_max: 8,
        ..Config::default()
    };
    let p = start(kv, &keys, 1, c, cfg);
    let client = p.client();
    tokio::task::spawn_blocking(move || {
        let f = client
            .commit(create(Ino::ROOT, "five", FileType::Regular))
            .unwrap()
            .ino
            .unwrap();
        // Five keys, each its own extent (not contiguous on the device).
        let five: Vec<meta::codec::Extent> = (0..5u64)
            .map(|i| meta::codec::Extent {
                file_off: i * 4096,
                len: 4096,
                dev_off: (1 << 20) + i * 8192,
                unwritten: false,
            })
            .collect();
        let rewrite = |expect: Option<ExtentsExpect>| {
            client.commit(Mutation::SetExtents {
                ino: f,
                off: 0,
                len: 5 * 4096,
                extents: five.clone(),
                size_at_least: Some(5 * 4096),
                touch_mtime: true,
                free_maps: Vec::new(),
                expect: expect.map(Box::new),
            })
        };
        let o = rewrite(None).unwrap();
        let exact = o
            .extents_known
            .as_ref()
            .unwrap()
            .expectation(o.attr.as_ref().unwrap(), 0, 5 * 4096)
            .unwrap();
        assert_eq!(exact.extents, five);
        // 11 compares with the expectation, 7 from reads; 6 operations either way.
        let reads = client.stats().read_txns;
        rewrite(Some(exact)).expect("planned from reads instead");
        assert!(client.stats().read_txns > reads);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlink_with_expectations_on_the_model() {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    let p = start(kv, &keys, 1, c, Config::default());
    let client = p.client();
    tokio::task::spawn_blocking(move || unlink_expectations(&client))
        .await
        .unwrap();
}

#[test]
fn pipeline_on_real_etcd() {
    let Ok(eps) = std::env::var("ETCD_ENDPOINTS") else {
        eprintln!("SKIP: pipeline_on_real_etcd needs a real etcd (set ETCD_ENDPOINTS)");
        return;
    };
    let eps: Vec<String> = eps.split(',').map(|s| s.trim().to_owned()).collect();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let keys = Keyspace::new(&format!("etcfs-test-{nanos:x}")).unwrap();
    let (k2, sb2) = (keys.clone(), common::superblock());
    let connect: meta::pipeline::Connect = Box::new(move || {
        Box::pin(async move {
            let kv = EtcdBackend::connect(&EtcdConfig::new(eps)).await?;
            let root = RootOwner {
                uid: 0,
                gid: 0,
                perm: 0o755,
            };
            format(&kv, &k2, &sb2, root, T0, false)
                .await
                .map_err(|e| meta::error::KvError::Other(e.to_string()))?;
            Ok(Arc::new(kv) as Arc<dyn KvBackend>)
        })
    });
    let clock = Arc::new(meta::clock::SystemClock::new());
    let p = Pipeline::start(
        connect,
        keys.clone(),
        SessionId(1),
        clock,
        Config::default(),
    )
    .unwrap();
    let client = p.client();
    let d = client
        .commit(create(Ino::ROOT, "d", FileType::Directory))
        .unwrap()
        .ino
        .unwrap();
    let n = 300;
    let ts: Vec<_> = (0..n)
        .map(|i| {
            client
                .submit_blocking(create(d, &format!("f{i}"), FileType::Regular))
                .unwrap()
        })
        .collect();
    for t in ts {
        t.wait().unwrap();
    }
    let s = client.stats();
    eprintln!(
        "real etcd: {n} creates, {:.1} mutations/txn, {s:?}",
        s.mutations_per_txn()
    );
    assert!(s.txns_committed < n as u64, "creates were grouped");
    let names = client.dir_names(d, 4096).unwrap().wait().unwrap();
    assert_eq!(names.entries.len(), n);
    let rm = |name: String| Mutation::Unlink {
        parent: d,
        name: name.into_bytes(),
        dir: false,
        keep_open: false,
        drop_own_hold: false,
        expect: None,
    };
    let ts: Vec<_> = (0..n)
        .map(|i| client.submit_blocking(rm(format!("f{i}"))).unwrap())
        .collect();
    for t in ts {
        assert!(t.wait().unwrap().removed.is_some());
    }
    let rmdir = Mutation::Unlink {
        parent: Ino::ROOT,
        name: b"d".to_vec(),
        dir: true,
        keep_open: false,
        drop_own_hold: false,
        expect: None,
    };
    client.flush(None).unwrap().wait().unwrap();
    client.commit(rmdir).unwrap();
    unlink_expectations(&client);
    extents_expectations(&client);
    // Clean up the prefix.
    let kv = p.backend();
    let all = keys.all();
    let cleanup = meta::kv::Txn {
        success: vec![meta::kv::TxnOp::delete_range(all.start, all.end, false)],
        ..Default::default()
    };
    p.runtime()
        .block_on(async move { kv.txn(cleanup).await })
        .unwrap();
}

/// Inode numbers are reserved on the first create, not at start: a pipeline that never
/// creates leaves no `C` key. A deferred pipeline reads before its session exists, and one
/// dropped unregistered writes nothing (and does not hang).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inode_reservation_and_session_are_lazy() {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    let count = |kv: Arc<MemEtcd>, key: Vec<u8>| async move {
        kv.range(meta::kv::RangeRequest::key(key))
            .await
            .unwrap()
            .kvs
            .len()
    };
    let members = |kv: Arc<MemEtcd>, keys: Keyspace| async move {
        let r = keys.members();
        kv.range(meta::kv::RangeRequest::range(r.start, r.end))
            .await
            .unwrap()
            .kvs
            .len()
    };
    let kv2 = kv.clone();
    let connect: meta::pipeline::Connect =
        Box::new(move || Box::pin(async move { Ok(kv2 as Arc<dyn KvBackend>) }));
    let (k2, c2) = (keys.clone(), c.clone());
    let unregistered = tokio::task::spawn_blocking(move || {
        let p =
            Pipeline::start_deferred(connect, k2, c2 as Arc<dyn Clock>, Config::default()).unwrap();
        let client = p.client();
        let root = client.get_inode(Ino::ROOT).unwrap().wait().unwrap();
        assert!(root.is_some(), "reads work before a session exists");
        // Queued, never committed: the pipeline goes away unregistered.
        let t = client
            .submit(create(Ino::ROOT, "never", FileType::Regular))
            .unwrap();
        drop(p);
        t.wait()
    })
    .await
    .unwrap();
    assert!(unregistered.is_err());
    assert_eq!(count(kv.clone(), keys.ino_counter()).await, 0);
    assert_eq!(members(kv.clone(), keys.clone()).await, 0);

    let kv2 = kv.clone();
    let connect: meta::pipeline::Connect =
        Box::new(move || Box::pin(async move { Ok(kv2 as Arc<dyn KvBackend>) }));
    let (k2, c2) = (keys.clone(), c.clone());
    let (p, client) = tokio::task::spawn_blocking(move || {
        let p =
            Pipeline::start_deferred(connect, k2, c2 as Arc<dyn Clock>, Config::default()).unwrap();
        let s = p
            .register_session(&meta::session::SessionConfig::new("lazy"))
            .unwrap();
        std::mem::forget(s);
        let client = p.client();
        let chmod = Mutation::SetAttr {
            ino: Ino::ROOT,
            set: SetAttr {
                perm: Some(0o700),
                ..SetAttr::default()
            },
        };
        client.commit(chmod).unwrap();
        client.flush(None).unwrap().wait().unwrap();
        (p, client)
    })
    .await
    .unwrap();
    assert_eq!(members(kv.clone(), keys.clone()).await, 1);
    assert_eq!(
        count(kv.clone(), keys.ino_counter()).await,
        0,
        "no create, no reservation"
    );
    let o = tokio::task::spawn_blocking(move || {
        let o = client.commit(create(Ino::ROOT, "f", FileType::Regular));
        drop(p);
        o
    })
    .await
    .unwrap()
    .unwrap();
    assert!(o.ino.is_some());
    assert_eq!(count(kv.clone(), keys.ino_counter()).await, 1);
}

/// Writes of one group's free map commit in submission order, even when the earlier one
/// must read first and the later one need not: an older map committed last would show
/// blocks that extents point at as free after the next load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_map_writes_commit_in_submission_order() {
    use meta::{
        codec::{Extent, Owner},
        types::GroupId,
    };
    let (kv, keys, _p, client, f) = with_file("f").await;
    let g = GroupId(3);
    let owner = Owner {
        session: SessionId(1),
    };
    kv.put_raw(&keys.group(g), &owner.encode());
    // Reads (inode, extents) take no time in the model, commits do: without ordering the
    // second, read-free write would commit while the first is still reading.
    kv.set_faults(Faults {
        txn_latency: Duration::from_millis(20),
        ..Default::default()
    });
    let older = client
        .submit(Mutation::SetExtents {
            ino: f,
            off: 0,
            len: 4096,
            extents: vec![Extent {
                file_off: 0,
                len: 4096,
                dev_off: 3 << 26,
                unwritten: false,
            }],
            size_at_least: Some(4096),
            touch_mtime: true,
            free_maps: vec![(g, b"older".to_vec())],
            expect: None,
        })
        .unwrap();
    let newer = client
        .submit(Mutation::FreeMaps {
            maps: vec![(g, b"newer".to_vec())],
            released: Vec::new(),
        })
        .unwrap();
    let r_old = older.await.unwrap().revision;
    let r_new = newer.await.unwrap().revision;
    assert!(r_old < r_new, "committed at {r_old:?} then {r_new:?}");
    let now = kv
        .range(meta::kv::RangeRequest::key(keys.free_map(g)))
        .await
        .unwrap();
    assert_eq!(now.kvs[0].value, b"newer");
}

/// A free-map write that also deleted released records fails (here the group is not the
/// session's): the node's map may now hand out blocks etcd still records as released, so
/// every later write of that group's map under the session is refused without reaching
/// etcd (even once the group is the session's again), other groups' maps are written, and
/// the pipeline names the session for the filesystem to fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fold_stops_later_writes_of_its_map() {
    use meta::{
        codec::{Extent, Owner},
        types::GroupId,
    };
    let (kv, keys, _p, client, f) = with_file("f").await;
    let (g, other) = (GroupId(3), GroupId(4));
    let owner = Owner {
        session: SessionId(1),
    };
    kv.put_raw(&keys.group(other), &owner.encode());
    assert_eq!(client.unsafe_maps_session(), None);
    let failed = client
        .submit(Mutation::FreeMaps {
            maps: vec![(g, b"folded".to_vec())],
            released: vec![3 << 26],
        })
        .unwrap()
        .await;
    assert!(failed.is_err(), "{failed:?}");
    assert_eq!(client.unsafe_maps_session(), Some(SessionId(1)));
    kv.put_raw(&keys.group(g), &owner.encode());
    let later = client
        .submit(Mutation::SetExtents {
            ino: f,
            off: 0,
            len: 4096,
            extents: vec![Extent {
                file_off: 0,
                len: 4096,
                dev_off: 3 << 26,
                unwritten: false,
            }],
            size_at_least: Some(4096),
            touch_mtime: true,
            free_maps: vec![(g, b"later".to_vec())],
            expect: None,
        })
        .unwrap()
        .await;
    assert!(
        matches!(later, Err(MetaError::UnsafeFreeMap { group: 3 })),
        "{later:?}"
    );
    let map = |g| {
        let (kv, keys) = (kv.clone(), keys.clone());
        async move {
            kv.range(meta::kv::RangeRequest::key(keys.free_map(g)))
                .await
                .unwrap()
                .kvs
        }
    };
    assert!(map(g).await.is_empty(), "nothing written to the unsafe map");
    client
        .submit(Mutation::FreeMaps {
            maps: vec![(other, b"fine".to_vec())],
            released: Vec::new(),
        })
        .unwrap()
        .await
        .unwrap();
    assert_eq!(map(other).await[0].value, b"fine");
    assert_eq!(client.stats().free_maps_failed, 1);
}

/// A file with more extents than one transaction can log as released is unlinked through
/// the orphan path and reclaimed in chunks: every freed range is logged (so a crash cannot
/// leak it), and the orphan record stays until the last chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_file_is_reclaimed_in_logged_chunks() {
    use meta::{codec::Extent, kv::RangeRequest};
    let (kv, keys, _p, client, f) = with_file("big").await;
    // 70 one-block extents, every other block on the device (none merge).
    let n = 70u64;
    let ext = |i: u64| Extent {
        file_off: i * 4096,
        len: 4096,
        dev_off: (1 << 20) + i * 8192,
        unwritten: false,
    };
    for (lo, hi) in [(0, 40), (40, n)] {
        client
            .commit(Mutation::SetExtents {
                ino: f,
                off: lo * 4096,
                len: (hi - lo) * 4096,
                extents: (lo..hi).map(ext).collect(),
                size_at_least: Some(hi * 4096),
                touch_mtime: true,
                free_maps: Vec::new(),
                expect: None,
            })
            .unwrap();
    }
    let count = |r: meta::keys::KeyRange| {
        let kv = kv.clone();
        async move {
            kv.range(RangeRequest::range(r.start, r.end))
                .await
                .unwrap()
                .kvs
                .len()
        }
    };
    let unlinked = client
        .commit(Mutation::Unlink {
            parent: Ino::ROOT,
            name: b"big".to_vec(),
            dir: false,
            keep_open: false,
            drop_own_hold: false,
            expect: None,
        })
        .unwrap();
    assert_eq!(
        unlinked.orphaned,
        Some(f),
        "too many extents: orphaned first"
    );
    assert!(unlinked.freed.is_empty());
    let mut logged = 0;
    let mut rounds = 0;
    loop {
        rounds += 1;
        let out = client.commit(Mutation::ReclaimOrphan { ino: f }).unwrap();
        assert_eq!(
            out.freed.len(),
            out.released.len(),
            "every freed range is logged"
        );
        logged += out.released.len();
        let orphan_left = count(meta::keys::KeyRange {
            start: keys.orphan(f),
            end: [keys.orphan(f), vec![0]].concat(),
        })
        .await;
        if !out.reclaim_more {
            assert_eq!(out.removed, Some(f));
            assert_eq!(orphan_left, 0);
            break;
        }
        assert_eq!(
            orphan_left, 1,
            "the orphan record stays until the last chunk"
        );
        assert!(rounds < 5);
    }
    assert_eq!(rounds, 2);
    assert_eq!(logged, n as usize);
    assert_eq!(count(keys.extents(f)).await, 0);
    assert_eq!(count(keys.released_between(0, u64::MAX)).await, n as usize);
}

/// Nothing commits under a session whose lease is gone, and work begun under it never
/// commits under the session that replaces it: every transaction compares the membership
/// key of the session its mutations were submitted under.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_of_a_lost_session_never_commits() {
    let c = clock();
    let (kv, keys) = formatted(c.clone()).await;
    let kv2 = kv.clone();
    let connect: meta::pipeline::Connect =
        Box::new(move || Box::pin(async move { Ok(kv2 as Arc<dyn KvBackend>) }));
    let chmod = |perm: u16| Mutation::SetAttr {
        ino: Ino::ROOT,
        set: SetAttr {
            perm: Some(perm),
            ..SetAttr::default()
        },
    };
    let (k2, c2, model) = (keys.clone(), c.clone(), kv.clone());
    let root_perm = tokio::task::spawn_blocking(move || {
        let p =
            Pipeline::start_deferred(connect, k2, c2.clone() as Arc<dyn Clock>, Config::default())
                .unwrap();
        let client = p.client();
        let one = p
            .register_session(&meta::session::SessionConfig::new("one"))
            .unwrap();
        client.commit(chmod(0o700)).unwrap();
        let old = one.id();
        // Its lease ends (expired, or revoked by an operator).
        let lease = one.lease().0;
        p.runtime()
            .block_on(async move { model.lease_revoke(lease).await })
            .unwrap();
        assert_eq!(client.commit(chmod(0o711)), Err(MetaError::SessionLost));
        let two = client
            .register_session(&meta::session::SessionConfig::new("two"), c2)
            .unwrap();
        assert_eq!(client.session(), two.id());
        assert_eq!(
            client.commit_as(chmod(0o722), old).map(|_| ()),
            Err(MetaError::SessionLost),
            "work of the old session, submitted after the new one registered"
        );
        client.commit(chmod(0o733)).unwrap();
        let root = client.get_inode(Ino::ROOT).unwrap().wait().unwrap();
        drop(one);
        drop(two);
        drop(p);
        root.map(|(a, _)| a.perm)
    })
    .await
    .unwrap();
    assert_eq!(root_perm, Some(0o733));
}
