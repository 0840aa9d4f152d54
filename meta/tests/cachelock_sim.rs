//! Seeded, single-threaded simulation of the cluster cache-lock protocol
//! (`meta::cachelock`, driven as `src/fs/locks.rs` drives it) on the in-memory etcd.
//!
//! Three nodes share one file. Each node reads (under a shared lock, caching what it
//! read) and writes (under an exclusive lock, keeping the write behind until it gives the
//! lock up). A node learns of other nodes' keys only when the scheduler delivers its
//! "watch" (a diff of the lock keys since its last delivery), at random moments: events
//! arrive late, coalesced, and a node acts meanwhile on what it knew. Nodes crash (their
//! lease is revoked, their writes behind are lost) and come back with a new session.
//!
//! After every step:
//! * etcd never shows an exclusive holder beside any other holder;
//! * a node that believes it holds a mode has its key in etcd with that mode;
//! * every read returns the last write acknowledged anywhere that survived (a crash
//!   loses only the crashed node's writes behind, which no other node read);
//!
//! and at the end, with crashes stopped, every waiting operation completes.
//!
//! `CACHELOCK_SIM_SEED=<n>` replays a seed (everything here is deterministic).
#![allow(clippy::unwrap_used, clippy::panic)]

use std::{collections::BTreeMap, sync::Arc};

use meta::{
    cachelock::{Acquired, CacheLock, CacheLocks, Known, LockMode},
    clock::ManualClock,
    codec::Record,
    keys::{KeyKind, Keyspace},
    kv::{KvBackend, RangeRequest},
    model::MemEtcd,
    types::{Ino, SessionId, Timespec},
};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const NODES: usize = 3;
const STEPS: usize = 4000;
const INO: Ino = Ino(77);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Read,
    Write,
}

struct Node {
    locks: CacheLocks,
    lease: i64,
    held: Option<LockMode>,
    /// The operation waiting for the lock.
    op: Option<Op>,
    /// A conflicting mode another node asked for (from a delivered `Q`).
    asked: Option<LockMode>,
    /// The value this node read, cached while it holds a lock.
    cached: Option<u64>,
    /// Its write behind: on the "device" only once it gives the lock up.
    behind: Option<u64>,
    /// The lock keys (value, mod revision) as of its last watch delivery: a put of an
    /// unchanged value is still an event.
    seen: BTreeMap<Vec<u8>, (Vec<u8>, i64)>,
    /// The holders as of its last delivery or acquire answer (possibly stale: the
    /// acquire's compare must catch that).
    known: Option<Known>,
}

struct World {
    rt: tokio::runtime::Runtime,
    kv: Arc<dyn KvBackend>,
    keys: Keyspace,
    nodes: Vec<Node>,
    /// The shared device's copy of the file.
    device: u64,
    /// The last acknowledged write that is not lost.
    acked: u64,
    next_value: u64,
    ops_done: usize,
}

impl World {
    fn new() -> World {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let clock = Arc::new(ManualClock::new(Timespec::new(1_000_000, 0)));
        let kv: Arc<dyn KvBackend> = Arc::new(MemEtcd::new(clock));
        let keys = Keyspace::new("sim").unwrap();
        let mut w = World {
            rt,
            kv,
            keys,
            nodes: Vec::new(),
            device: 0,
            acked: 0,
            next_value: 1,
            ops_done: 0,
        };
        for _ in 0..NODES {
            let n = w.new_node();
            w.nodes.push(n);
        }
        w
    }

    fn new_node(&self) -> Node {
        let lease = self.rt.block_on(self.kv.lease_grant(10)).unwrap().id;
        Node {
            locks: CacheLocks::new(
                self.kv.clone(),
                self.keys.clone(),
                SessionId(lease as u64),
                lease,
            ),
            lease,
            held: None,
            op: None,
            asked: None,
            cached: None,
            behind: None,
            seen: BTreeMap::new(),
            known: None,
        }
    }

    /// Every `K` and `Q` key of the file.
    fn lock_keys(&self) -> BTreeMap<Vec<u8>, (Vec<u8>, i64)> {
        let mut out = BTreeMap::new();
        for r in [self.keys.cache_locks(INO), {
            let start = self.keys.cache_want(INO, SessionId(0));
            let mut end = self.keys.cache_want(INO, SessionId(u64::MAX));
            end.push(0);
            meta::keys::KeyRange { start, end }
        }] {
            let resp = self
                .rt
                .block_on(self.kv.range(RangeRequest::range(r.start, r.end)))
                .unwrap();
            out.extend(
                resp.kvs
                    .into_iter()
                    .map(|kv| (kv.key, (kv.value, kv.mod_revision))),
            );
        }
        out
    }

    /// Delivers node `i`'s watch: the `Q` records of others that are new or changed since
    /// its last delivery.
    fn deliver(&mut self, i: usize) {
        let now = self.lock_keys();
        let me = self.nodes[i].locks.session();
        let mut asked = self.nodes[i].asked;
        for (k, v) in &now {
            if self.nodes[i].seen.get(k) == Some(v) {
                continue;
            }
            let v = &v.0;
            if let Some(KeyKind::CacheWant(_, s)) = self.keys.parse(k) {
                if s != me {
                    let m = CacheLock::decode(v).unwrap().mode;
                    if self.nodes[i].held.is_some_and(|h| h.conflicts(m)) {
                        asked = asked.max(Some(m));
                    }
                }
            }
        }
        self.nodes[i].asked = asked;
        let r = self.keys.cache_locks(INO);
        let resp = self
            .rt
            .block_on(self.kv.range(RangeRequest::range(r.start, r.end)))
            .unwrap();
        // A watch delivers every change in order: what it knows is the whole set as of
        // the revision it reached.
        let known = Known {
            revision: resp.revision,
            holders: resp
                .kvs
                .iter()
                .filter_map(|kv| match self.keys.parse(&kv.key) {
                    Some(KeyKind::CacheLock(_, s)) => {
                        Some((s, Some(CacheLock::decode(&kv.value).unwrap().mode)))
                    }
                    _ => None,
                })
                .collect(),
        };
        self.nodes[i].known = Some(known);
        self.nodes[i].seen = now;
    }

    /// Node `i` gives way to what it was asked, as `Inner::give_way` does: write back,
    /// then drop its cache, then downgrade or release in etcd.
    fn give_way(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        let (Some(held), Some(want)) = (n.held, n.asked.take()) else {
            return;
        };
        if !held.conflicts(want) {
            return;
        }
        if let Some(v) = n.behind.take() {
            self.device = v;
        }
        let locks = n.locks.clone();
        if held == LockMode::Exclusive && want == LockMode::Shared {
            self.rt.block_on(locks.downgrade(INO)).unwrap();
            self.nodes[i].held = Some(LockMode::Shared);
        } else {
            self.nodes[i].cached = None;
            self.rt.block_on(locks.release(INO)).unwrap();
            self.nodes[i].held = None;
        }
    }

    /// Node `i` tries to run its operation: from what it holds, else by asking etcd.
    fn attempt(&mut self, i: usize) {
        let Some(op) = self.nodes[i].op else { return };
        let need = match op {
            Op::Read => LockMode::Shared,
            Op::Write => LockMode::Exclusive,
        };
        if self.nodes[i].held.is_none_or(|h| h < need) {
            let locks = self.nodes[i].locks.clone();
            let known = self.nodes[i].known.clone();
            match self
                .rt
                .block_on(locks.acquire(INO, need, known, None))
                .unwrap()
            {
                Acquired::Granted { .. } => {
                    let n = &mut self.nodes[i];
                    n.known = None;
                    if n.held.is_none() {
                        n.cached = None;
                    }
                    n.held = Some(need.max(n.held.unwrap_or(need)));
                }
                Acquired::Busy { known, .. } => {
                    self.nodes[i].known = Some(known);
                    return;
                }
            }
        }
        let n = &mut self.nodes[i];
        match op {
            Op::Read => {
                let v = n.behind.or(n.cached).unwrap_or(self.device);
                n.cached = Some(v);
                assert_eq!(v, self.acked, "node {i} read a stale value");
            }
            Op::Write => {
                let v = self.next_value;
                self.next_value += 1;
                n.behind = Some(v);
                n.cached = Some(v);
                self.acked = v;
            }
        }
        n.op = None;
        self.ops_done += 1;
    }

    /// Node `i` dies: its lease goes, its writes behind are lost; it comes back as a new
    /// session.
    fn crash(&mut self, i: usize) {
        let lease = self.nodes[i].lease;
        self.rt.block_on(self.kv.lease_revoke(lease)).unwrap();
        if self.nodes[i].behind.is_some() {
            // Only that node saw them (it held the lock exclusively).
            self.acked = self.device;
        }
        self.nodes[i] = self.new_node();
    }

    fn check(&self) {
        let keys = self.lock_keys();
        let mut holders: Vec<(SessionId, LockMode)> = Vec::new();
        for (k, (v, _)) in &keys {
            if let Some(KeyKind::CacheLock(_, s)) = self.keys.parse(k) {
                holders.push((s, CacheLock::decode(v).unwrap().mode));
            }
        }
        if holders.iter().any(|(_, m)| *m == LockMode::Exclusive) {
            assert_eq!(
                holders.len(),
                1,
                "an exclusive holder beside others: {holders:?}"
            );
        }
        for n in &self.nodes {
            if let Some(m) = n.held {
                assert!(
                    holders.contains(&(n.locks.session(), m)),
                    "node believes it holds {m:?}; etcd has {holders:?}"
                );
            }
        }
    }
}

fn run(seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut w = World::new();
    for step in 0..STEPS {
        let i = rng.gen_range(0..NODES);
        let crashes = step < STEPS / 2;
        match rng.gen_range(0..100) {
            0..=29 => {
                if w.nodes[i].op.is_none() {
                    w.nodes[i].op = Some(if rng.gen_bool(0.5) {
                        Op::Read
                    } else {
                        Op::Write
                    });
                }
                w.attempt(i);
            }
            30..=59 => w.deliver(i),
            60..=89 => w.give_way(i),
            90..=98 => w.attempt(i),
            _ if crashes => w.crash(i),
            _ => w.deliver(i),
        }
        w.check();
    }
    // Liveness: with every node's watch delivered and every request answered, each
    // waiting operation completes.
    for _ in 0..50 {
        for i in 0..NODES {
            w.attempt(i);
            w.check();
        }
        for i in 0..NODES {
            w.deliver(i);
            w.give_way(i);
            w.check();
        }
        if w.nodes.iter().all(|n| n.op.is_none()) {
            break;
        }
    }
    assert!(
        w.nodes.iter().all(|n| n.op.is_none()),
        "seed {seed}: operations still waiting: {:?}",
        w.nodes.iter().map(|n| (n.op, n.held)).collect::<Vec<_>>()
    );
    assert!(
        w.ops_done > STEPS / 10,
        "seed {seed}: only {} operations",
        w.ops_done
    );
}

#[test]
fn cache_lock_protocol_under_delays_and_crashes() {
    let seeds: Vec<u64> = match std::env::var("CACHELOCK_SIM_SEED") {
        Ok(s) => vec![s.parse().expect("CACHELOCK_SIM_SEED is a number")],
        Err(_) => (1..=20).collect(),
    };
    for seed in seeds {
        eprintln!("cache lock simulation, seed {seed}");
        run(seed);
    }
}
