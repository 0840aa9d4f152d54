//! A node whose etcd answers are lost after etcd applied them (a leader killed between
//! applying and answering): its cache locks, fcntl and flock locks and group claims, the
//! writes it makes outside the pipeline's commits, are resent and each takes effect once.
//! Node A talks to the model through [`Lossy`], which loses the answers of the lock and
//! group writes it is told to; node B talks to the model directly and checks what A holds.

use std::sync::Arc;

use fusedev::{
    abi::{FileLock, FUSE_LK_FLOCK},
    errno::Errno,
    request::Operation,
    server::{Handler as _, Reply},
};
use meta::{
    keys::{KeyKind, Keyspace},
    kv::{KvBackend, Txn, TxnOp},
    lossy::{Losses, Lossy},
};

use super::tests::{eventually, keys_of, parse, pattern, second_mount_on, Fx, Requests, ROOT};

/// Whether `txn` writes a key of a cache lock, an fcntl or flock lock or a group owner.
fn lock_or_group(keys: &Keyspace, txn: &Txn) -> bool {
    txn.success.iter().chain(&txn.failure).any(|op| {
        let key = match op {
            TxnOp::Put(p) => &p.key,
            TxnOp::Delete(d) => &d.key,
            TxnOp::Range(_) => return false,
        };
        matches!(
            keys.parse(key),
            Some(
                KeyKind::CacheLock(..)
                    | KeyKind::CacheWant(..)
                    | KeyKind::Lock(_)
                    | KeyKind::Group(_)
            )
        )
    })
}

/// B (the plain fixture) and A behind a lossy etcd.
fn nodes() -> (Fx, Fx, Arc<Lossy>) {
    let b = Fx::new();
    let lossy = Arc::new(Lossy::new(b.kv.clone()));
    let keys = Keyspace::new("t").expect("prefix");
    lossy.set_filter(Some(Arc::new(move |t: &Txn| lock_or_group(&keys, t))));
    let a = second_mount_on(&b, lossy.clone() as Arc<dyn KvBackend>);
    (a, b, lossy)
}

fn lose(lossy: &Lossy, n: u32) {
    lossy.set_losses(Losses {
        txns: n,
        ..Default::default()
    });
}

fn counter(fx: &Fx, name: &str) -> u64 {
    fx.fs
        .counters()
        .into_iter()
        .find(|(n, _)| n == name)
        .map_or(0, |(_, v)| v)
}

/// SETLK (`flock`: a flock lock) of `typ` over the whole file, as `owner`.
fn setlk(fx: &mut Fx, ino: u64, fh: u64, owner: u64, typ: i32, flock: bool) -> Result<(), Errno> {
    let op = Operation::Setlk {
        fh,
        owner,
        lock: FileLock {
            start: 0,
            end: u64::MAX >> 1,
            typ: typ as u32,
            pid: 1,
        },
        lk_flags: if flock { FUSE_LK_FLOCK } else { 0 },
    };
    match fx.call(ino, op) {
        Reply::Error(e) => Err(e),
        _ => Ok(()),
    }
}

/// fcntl and flock locks taken and given up with every answer lost twice: each is held
/// once (the other node is refused while it is, and granted after), and the resends are
/// counted.
#[test]
fn fcntl_and_flock_locks_survive_lost_answers() {
    let (mut a, mut b, lossy) = nodes();
    let (ino, bfh) = b.create(ROOT, b"f");
    assert_eq!(a.lookup(ROOT, b"f").nodeid, ino);
    let afh = a.open(ino);
    for flock in [false, true] {
        let what = if flock { "flock" } else { "fcntl" };
        lose(&lossy, 2);
        setlk(&mut a, ino, afh, 1, libc::F_WRLCK, flock)
            .unwrap_or_else(|e| panic!("{what}: A's lock with its answers lost: {e:?}"));
        assert_eq!(lossy.losses_left(), Losses::default(), "{what}: both lost");
        assert_eq!(
            setlk(&mut b, ino, bfh, 2, libc::F_RDLCK, flock),
            Err(Errno::EAGAIN),
            "{what}: A holds it"
        );
        lose(&lossy, 2);
        setlk(&mut a, ino, afh, 1, libc::F_UNLCK, flock)
            .unwrap_or_else(|e| panic!("{what}: A's unlock with its answers lost: {e:?}"));
        setlk(&mut b, ino, bfh, 2, libc::F_RDLCK, flock)
            .unwrap_or_else(|e| panic!("{what}: B after A's unlock: {e:?}"));
        // A read lock beside B's, its answer lost, then both unlocked.
        lose(&lossy, 1);
        setlk(&mut a, ino, afh, 1, libc::F_RDLCK, flock).expect("shared beside B");
        assert_eq!(
            setlk(&mut b, ino, bfh, 2, libc::F_WRLCK, flock),
            Err(Errno::EAGAIN),
            "{what}: A's read lock is there"
        );
        setlk(&mut b, ino, bfh, 2, libc::F_UNLCK, flock).expect("B unlocks");
        lose(&lossy, 1);
        setlk(&mut a, ino, afh, 1, libc::F_UNLCK, flock).expect("A unlocks");
    }
    // Every lock key is gone: nothing was put twice under another start or left behind.
    assert_eq!(keys_of(&b, b"t/B", b"t/C"), 0);
    assert!(lossy.lost() >= 12, "{}", lossy.lost());
    // Every lost answer was resent, by whichever node sent it: a give-way on a lock
    // thread may still be resending when the last operation returns (8 retries counted
    // for 9 losses, once in a loaded unit-test run).
    let retries = || counter(&a, "etcd_write_retries") + counter(&b, "etcd_write_retries");
    eventually("every lost answer resent", || retries() == lossy.lost());
    assert_eq!(retries(), lossy.lost());
    a.release(ino, afh);
    b.release(ino, bfh);
}

/// A writes a file B has open and cached, and B reads it back, with the answers of A's
/// cache-lock writes lost: A's grant, its giving way to B, and its next grant each take
/// effect once, and B reads what A wrote.
#[test]
fn cache_locks_survive_lost_answers() {
    let (mut a, mut b, lossy) = nodes();
    let (ino, bfh) = b.create(ROOT, b"f");
    b.write(ino, bfh, 0, &pattern(1, 8192));
    b.fsync(ino, bfh);
    assert_eq!(b.read(ino, bfh, 0, 8192), pattern(1, 8192));
    assert_eq!(a.lookup(ROOT, b"f").nodeid, ino);
    for round in 0..3u8 {
        lose(&lossy, 2);
        let afh = a.open(ino);
        a.write(ino, afh, 0, &pattern(10 + round, 8192));
        a.fsync(ino, afh);
        a.release(ino, afh);
        lose(&lossy, 2);
        assert_eq!(
            b.read(ino, bfh, 0, 8192),
            pattern(10 + round, 8192),
            "round {round}: B reads what A wrote"
        );
    }
    assert!(lossy.lost() >= 6, "{}", lossy.lost());
    // Every lost answer was resent, by whichever node sent it: a give-way on a lock
    // thread may still be resending when the last operation returns (8 retries counted
    // for 9 losses, once in a loaded unit-test run).
    let retries = || counter(&a, "etcd_write_retries") + counter(&b, "etcd_write_retries");
    eventually("every lost answer resent", || retries() == lossy.lost());
    assert_eq!(retries(), lossy.lost());
    b.release(ino, bfh);
}

/// Groups claimed with the answers lost: each claimed once, loaded once, and used.
#[test]
fn group_claims_survive_lost_answers() {
    let (mut a, b, lossy) = nodes();
    let session = super::lock(&a.fs.inner().session)
        .as_ref()
        .expect("mounted")
        .id();
    let before = super::lock(&a.fs.inner().alloc).owned().len();
    lose(&lossy, 3);
    let n = a.fs.inner().claim_groups(2).expect("claimed");
    assert_eq!(n, 2);
    assert_eq!(lossy.losses_left(), Losses::default());
    let owned = super::lock(&a.fs.inner().alloc).owned().clone();
    assert_eq!(owned.len(), before + 2);
    // etcd agrees: A's session owns exactly the groups its allocator has.
    let mut in_etcd: Vec<u32> =
        b.kv.dump(b"t/G", b"t/H")
            .into_iter()
            .filter_map(|(k, v)| {
                let keys = Keyspace::new("t").ok()?;
                let Some(KeyKind::Group(g)) = keys.parse(&k) else {
                    return None;
                };
                let o = <meta::codec::Owner as meta::codec::Record>::decode(&v).ok()?;
                (o.session == session).then_some(g.0)
            })
            .collect();
    in_etcd.sort_unstable();
    assert_eq!(in_etcd, owned.iter().map(|g| g.0).collect::<Vec<_>>());
    // And A writes into them.
    let (x, fh) = a.create(ROOT, b"x");
    a.write(x, fh, 0, &pattern(3, 64 * 1024));
    a.fsync(x, fh);
    a.release(x, fh);
    // Every lost answer was resent, by whichever node sent it: a give-way on a lock
    // thread may still be resending when the last operation returns (8 retries counted
    // for 9 losses, once in a loaded unit-test run).
    let retries = || counter(&a, "etcd_write_retries") + counter(&b, "etcd_write_retries");
    eventually("every lost answer resent", || retries() == lossy.lost());
    assert_eq!(retries(), lossy.lost());
    // Given back with the answer lost: the resend finds it no longer ours, which is what
    // was asked.
    let g = *owned.iter().next_back().expect("a group");
    let _one = super::lock(&a.fs.inner().claiming);
    lose(&lossy, 1);
    assert!(a.fs.inner().give_group_back(g), "handed back");
    assert_eq!(lossy.losses_left(), Losses::default());
    let mut key = b"t/G".to_vec();
    key.extend_from_slice(&g.0.to_be_bytes());
    assert!(b.kv.dump(&key, &[key.as_slice(), &[0]].concat()).is_empty());
    assert!(!super::lock(&a.fs.inner().alloc).owned().contains(&g));
}

/// etcd refuses A's release of its locks at close for longer than the resends last (an
/// outage past the budget): the locks stay in etcd, and B, waiting for them, would wait
/// until A unmounts. A retries the release until etcd takes it; a lock the same owner
/// takes again meanwhile is not dropped by the retry. Found by the leader-kill test of
/// tests/etcd_cluster.rs run without resends: a lock loop on the other node hung.
#[test]
fn a_release_etcd_refused_is_retried_until_it_is_taken() {
    let (mut a, mut b, lossy) = nodes();
    let (ino, bfh) = b.create(ROOT, b"f");
    assert_eq!(a.lookup(ROOT, b"f").nodeid, ino);
    let afh = a.open(ino);
    for flock in [false, true] {
        // B's lock of the other class (no conflict) keeps the file from being delegated
        // to A, whose locks then live in etcd.
        setlk(&mut b, ino, bfh, 3, libc::F_RDLCK, !flock).expect("B's other lock");
        setlk(&mut a, ino, afh, 1, libc::F_WRLCK, flock).expect("A locks");
        lossy.set_losses(Losses {
            refused_txns: u32::MAX,
            ..Default::default()
        });
        // The close: FLUSH drops the process's fcntl locks, RELEASE the flock ones.
        if flock {
            a.fs.inner().release_locks(ino, 1, true);
        } else {
            a.call(
                ino,
                Operation::Flush {
                    fh: afh,
                    lock_owner: 1,
                },
            );
        }
        lossy.set_losses(Losses::default());
        assert_eq!(
            setlk(&mut b, ino, bfh, 2, libc::F_WRLCK, flock),
            Err(Errno::EAGAIN),
            "the refused release left A's lock"
        );
        a.fs.inner().retry_releases();
        setlk(&mut b, ino, bfh, 2, libc::F_WRLCK, flock)
            .expect("B locks once A's release is taken");
        setlk(&mut b, ino, bfh, 2, libc::F_UNLCK, flock).expect("B unlocks");
        setlk(&mut b, ino, bfh, 3, libc::F_UNLCK, !flock).expect("B's other unlock");
    }
    // A release refused, then the owner locks again: the retry leaves that lock alone.
    setlk(&mut b, ino, bfh, 3, libc::F_RDLCK, true).expect("B's flock");
    setlk(&mut a, ino, afh, 1, libc::F_WRLCK, false).expect("A locks");
    lossy.set_losses(Losses {
        refused_txns: u32::MAX,
        ..Default::default()
    });
    a.call(
        ino,
        Operation::Flush {
            fh: afh,
            lock_owner: 1,
        },
    );
    lossy.set_losses(Losses::default());
    setlk(&mut a, ino, afh, 1, libc::F_WRLCK, false).expect("A locks again");
    a.fs.inner().retry_releases();
    assert_eq!(
        setlk(&mut b, ino, bfh, 2, libc::F_WRLCK, false),
        Err(Errno::EAGAIN),
        "A's new lock stands"
    );
    setlk(&mut a, ino, afh, 1, libc::F_UNLCK, false).expect("A unlocks");
    setlk(&mut b, ino, bfh, 2, libc::F_WRLCK, false).expect("B locks");
    a.release(ino, afh);
    b.release(ino, bfh);
}

/// A cache-lock grant of A's that applies after A stopped waiting for it (a resent
/// request's first attempt arriving late, after the resend's lock was used and given up)
/// leaves a key A does not know it holds: B, wanting the file, would ask A to give way
/// for ever. A's watch notices its own unknown key and housekeeping deletes it (compared
/// on its revision); B then writes the file. A create's own key, put before the create
/// returns, is not taken for one.
#[test]
fn a_late_grant_of_a_lock_this_node_does_not_hold_is_deleted() {
    let (mut a, mut b, _lossy) = nodes();
    let (mine, afh) = a.create(ROOT, b"mine");
    let (ino, bfh) = b.create(ROOT, b"f");
    b.write(ino, bfh, 0, &pattern(1, 4096));
    b.fsync(ino, bfh);
    let keys = Keyspace::new("t").expect("prefix");
    let me = a.fs.inner().locks.me();
    let key = |ino: u64| keys.cache_lock(meta::types::Ino(ino), me);
    let present = |fx: &Fx, k: Vec<u8>| {
        let end = [k.as_slice(), &[0]].concat();
        keys_of(fx, &k, &end) == 1
    };
    let late = meta::cachelock::CacheLock {
        mode: meta::cachelock::LockMode::Shared,
    };
    // A's watch starts from the revision it reads when it starts: a key put before that
    // (a loaded machine can start the thread late) is never seen, and never deleted.
    // Failed so with two runs of every unit test at once, before any change of the
    // lock code; a watch that is live sees it.
    let t0 = std::time::Instant::now();
    while counter(&a, "watch_live") != 1 {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "A's watch not live in 30 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    a.kv.put_raw(&key(ino), &meta::codec::Record::encode(&late));
    let t0 = std::time::Instant::now();
    // Housekeeping's pace, with room for a machine running every unit test at once (5 s
    // failed once there).
    while present(&a, key(ino)) {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "A's unknown key still there after 30 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(counter(&a, "cache_locks_strays"), 1);
    b.write(ino, bfh, 0, &pattern(2, 4096));
    assert_eq!(b.read(ino, bfh, 0, 4096), pattern(2, 4096));
    // A's own file kept its lock (put by the create's transaction).
    assert!(present(&a, key(mine)));
    a.release(mine, afh);
    b.release(ino, bfh);
}

/// GETLK of the whole file as `owner`: the conflicting lock's (type, pid), if any.
fn getlk(fx: &mut Fx, ino: u64, fh: u64, owner: u64) -> Result<Option<(i32, u32)>, Errno> {
    let op = Operation::Getlk {
        fh,
        owner,
        lock: FileLock {
            start: 0,
            end: u64::MAX >> 1,
            typ: libc::F_WRLCK as u32,
            pid: 9,
        },
        lk_flags: 0,
    };
    match fx.call(ino, op) {
        Reply::Error(e) => Err(e),
        Reply::Bytes(n) => {
            let out: fusedev::abi::LkOut = parse(&fx.parts().1[..n]);
            let typ = out.lk.typ as i32;
            Ok((typ != libc::F_UNLCK).then_some((typ, out.lk.pid)))
        }
        other => panic!("GETLK answered {other:?}"),
    }
}

/// The fcntl locks of a file only A locks are delegated to A: after the first, its locks
/// and unlocks send etcd nothing. B's lock finds the delegation, asks for it back and is
/// refused for A's lock, which is in etcd by then (B's GETLK reports it); once A unlocks,
/// B locks. A, recalled a moment ago, takes its next lock through etcd, where B's lock
/// refuses it. Every lock write's answer of A's is lost once on the way.
#[test]
fn the_locks_of_a_file_one_node_uses_are_delegated_to_it_until_another_asks() {
    let (mut a, mut b, lossy) = nodes();
    let (ino, bfh) = b.create(ROOT, b"f");
    assert_eq!(a.lookup(ROOT, b"f").nodeid, ino);
    let afh = a.open(ino);
    lose(&lossy, 1);
    setlk(&mut a, ino, afh, 1, libc::F_WRLCK, false).expect("A locks");
    assert_eq!(counter(&a, "plocks_delegations_taken"), 1);
    assert_eq!(keys_of(&b, b"t/B", b"t/C"), 1, "the delegation alone");
    assert_eq!(lossy.lost(), 1);
    let sent = lossy.writes_sent();
    for _ in 0..20 {
        setlk(&mut a, ino, afh, 1, libc::F_UNLCK, false).expect("A unlocks");
        setlk(&mut a, ino, afh, 2, libc::F_RDLCK, false).expect("another owner of A's");
        setlk(&mut a, ino, afh, 2, libc::F_UNLCK, false).expect("and its unlock");
        setlk(&mut a, ino, afh, 1, libc::F_WRLCK, false).expect("A locks again");
    }
    assert_eq!(
        setlk(&mut a, ino, afh, 2, libc::F_RDLCK, false),
        Err(Errno::EAGAIN),
        "A's own owners exclude each other"
    );
    assert_eq!(lossy.writes_sent(), sent, "no etcd write while delegated");
    lose(&lossy, 1);
    assert_eq!(
        setlk(&mut b, ino, bfh, 7, libc::F_RDLCK, false),
        Err(Errno::EAGAIN),
        "A's lock, given back"
    );
    // (The give-back's answer was lost: it is found applied, and not counted.)
    assert_eq!(
        keys_of(&b, b"t/B", b"t/C"),
        1,
        "A's lock, no delegation or recall"
    );
    assert_eq!(getlk(&mut b, ino, bfh, 7), Ok(Some((libc::F_WRLCK, 1))));
    setlk(&mut a, ino, afh, 1, libc::F_UNLCK, false).expect("A unlocks");
    assert_eq!(getlk(&mut b, ino, bfh, 7), Ok(None));
    setlk(&mut b, ino, bfh, 7, libc::F_WRLCK, false).expect("B locks");
    assert_eq!(
        setlk(&mut a, ino, afh, 1, libc::F_RDLCK, false),
        Err(Errno::EAGAIN),
        "B's lock, in etcd"
    );
    setlk(&mut b, ino, bfh, 7, libc::F_UNLCK, false).expect("B unlocks");
    setlk(&mut a, ino, afh, 1, libc::F_RDLCK, false).expect("A locks through etcd");
    assert_eq!(
        counter(&a, "plocks_delegations_taken"),
        1,
        "not again so soon"
    );
    setlk(&mut a, ino, afh, 1, libc::F_UNLCK, false).expect("A unlocks");
    assert_eq!(keys_of(&b, b"t/B", b"t/C"), 0);
    a.release(ino, afh);
    b.release(ino, bfh);
}

/// A delegation of a file no longer open on its node is given back by housekeeping, and
/// B's GETLK of a file delegated to A sees A's locks (they are given back for it).
#[test]
fn delegations_of_closed_files_go_and_getlk_sees_delegated_locks() {
    let (mut a, mut b, _lossy) = nodes();
    let (ino, bfh) = b.create(ROOT, b"f");
    assert_eq!(a.lookup(ROOT, b"f").nodeid, ino);
    let afh = a.open(ino);
    setlk(&mut a, ino, afh, 1, libc::F_RDLCK, true).expect("A's flock");
    assert_eq!(counter(&a, "plocks_delegations_taken"), 1);
    // A flock lock of A's, a GETLK of fcntl locks from B: the delegation covers both
    // classes, so it comes back, and B sees no fcntl lock.
    assert_eq!(getlk(&mut b, ino, bfh, 7), Ok(None));
    // Counted once A has its answer, which may be after B saw the lock come back
    // (failed 1 run in 8 here: B's GETLK answered first).
    eventually("A counts the delegation returned", || {
        counter(&a, "plocks_delegations_returned") == 1
    });
    assert_eq!(
        setlk(&mut b, ino, bfh, 7, libc::F_WRLCK, true),
        Err(Errno::EAGAIN),
        "A's flock lock, in etcd now"
    );
    a.fs.inner().release_locks(ino, 1, true);
    setlk(&mut b, ino, bfh, 7, libc::F_WRLCK, true).expect("B's flock after A's unlock");
    setlk(&mut b, ino, bfh, 7, libc::F_UNLCK, true).expect("B unlocks");
    a.release(ino, afh);
    // A file of its own, locked and closed on A: housekeeping deletes its delegation.
    let (x, xfh) = a.create(ROOT, b"x");
    setlk(&mut a, x, xfh, 1, libc::F_WRLCK, false).expect("A locks x");
    assert_eq!(counter(&a, "plocks_delegations_taken"), 2);
    a.fs.inner().return_delegations();
    assert_eq!(counter(&a, "plocks_delegations_returned"), 1, "x is open");
    a.release(x, xfh);
    a.fs.inner().return_delegations();
    assert_eq!(counter(&a, "plocks_delegations_returned"), 2, "x closed");
    assert_eq!(keys_of(&b, b"t/B", b"t/C"), 0, "x's delegation went");
    b.release(ino, bfh);
}
