//! Seeded simulation: three "nodes" (pipelines with their own sessions) run random
//! concurrent create/unlink/rename mutations on a few shared directories against the
//! model, which injects compare failures and latency. Every successful mutation is then
//! replayed, in commit-revision order, against a simple reference map; each must be
//! legal there, and the final etcd state must equal the reference.
//!
//! The seed is printed first; `META_SIM_SEED=<n>` replays that seed's workload and
//! fault coins (thread interleaving is not reproduced: the nodes are real threads).
#![allow(clippy::unwrap_used, clippy::panic)]

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::Duration,
};

use meta::{
    clock::{Clock, ManualClock},
    codec::{Dentry, InodeAttr, Record, SuperRecord},
    error::MetaError,
    format::{format, RootOwner},
    keys::{KeyKind, Keyspace},
    kv::{KvBackend, RangeRequest},
    model::{Faults, MemEtcd},
    pipeline::{Config, Mutation, NewInode, Outcome, Pipeline, RenameMode, UnlinkExpect},
    types::{FileType, Ino, SessionId, Timespec},
};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const NODES: u64 = 3;
const OPS_PER_NODE: usize = 150;
const NAMES: usize = 6;

#[derive(Clone, Debug)]
enum Op {
    Create(Ino, String),
    Unlink(Ino, String),
    Rename(Ino, String, Ino, String, RenameMode),
}

/// What a node's own creates told it (its "cache"; other nodes make it stale).
type Seen = HashMap<(Ino, String), InodeAttr>;

fn to_mutation(op: &Op, seen: Option<&Seen>) -> Mutation {
    match op.clone() {
        Op::Create(p, n) => Mutation::Create {
            parent: p,
            name: n.into_bytes(),
            inode: NewInode::root_owned(FileType::Regular, 0o644),
            symlink: None,
            hold: false,
        },
        Op::Unlink(p, n) => {
            let expect = seen.and_then(|s| s.get(&(p, n.clone()))).map(|a| {
                Box::new(UnlinkExpect {
                    entry: Dentry {
                        ino: a.ino,
                        kind: a.kind,
                    },
                    child: Some(a.clone()),
                    parent: None,
                    // The ops write no data: a file's map is known empty.
                    extents: Some(Vec::new()),
                })
            });
            Mutation::Unlink {
                parent: p,
                name: n.into_bytes(),
                dir: false,
                keep_open: false,
                drop_own_hold: false,
                expect,
            }
        }
        Op::Rename(sp, sn, dp, dn, mode) => Mutation::Rename {
            src_parent: sp,
            src_name: sn.into_bytes(),
            dst_parent: dp,
            dst_name: dn.into_bytes(),
            mode,
            dst_keep_open: false,
        },
    }
}

#[derive(Default)]
struct Reference {
    entries: BTreeMap<(Ino, String), Ino>,
    nlink: HashMap<Ino, u32>,
}

impl Reference {
    fn drop_link(&mut self, ino: Ino) -> bool {
        let n = self.nlink.get_mut(&ino).unwrap();
        *n -= 1;
        if *n == 0 {
            self.nlink.remove(&ino);
            return true;
        }
        false
    }

    fn apply(&mut self, op: &Op, o: &Outcome) {
        match op {
            Op::Create(p, n) => {
                assert!(
                    !self.entries.contains_key(&(*p, n.clone())),
                    "create over existing {n}"
                );
                let ino = o.ino.unwrap();
                self.entries.insert((*p, n.clone()), ino);
                self.nlink.insert(ino, 1);
            }
            Op::Unlink(p, n) => {
                let ino = self
                    .entries
                    .remove(&(*p, n.clone()))
                    .expect("unlink of a missing name");
                assert_eq!(Some(ino), o.ino);
                let removed = self.drop_link(ino);
                assert_eq!(removed, o.removed == Some(ino));
            }
            Op::Rename(sp, sn, dp, dn, mode) => {
                let src = *self
                    .entries
                    .get(&(*sp, sn.clone()))
                    .expect("rename of a missing name");
                assert_eq!(Some(src), o.ino);
                let dst = self.entries.get(&(*dp, dn.clone())).copied();
                match (mode, dst) {
                    (RenameMode::Exchange, Some(d)) => {
                        self.entries.insert((*sp, sn.clone()), d);
                        self.entries.insert((*dp, dn.clone()), src);
                    }
                    (RenameMode::Exchange, None) => panic!("exchange with a missing name"),
                    (RenameMode::NoReplace, Some(_)) => panic!("noreplace over an existing name"),
                    (_, d) => {
                        if let Some(d) = d {
                            let removed = self.drop_link(d);
                            assert_eq!(removed, o.removed == Some(d));
                        }
                        self.entries.remove(&(*sp, sn.clone()));
                        self.entries.insert((*dp, dn.clone()), src);
                    }
                }
            }
        }
    }
}

fn random_op(rng: &mut SmallRng, dirs: &[Ino]) -> Op {
    let dir = |rng: &mut SmallRng| dirs[rng.gen_range(0..dirs.len())];
    let name = |rng: &mut SmallRng| format!("n{}", rng.gen_range(0..NAMES));
    match rng.gen_range(0..10) {
        0..=3 => Op::Create(dir(rng), name(rng)),
        4..=6 => Op::Unlink(dir(rng), name(rng)),
        r => {
            let mode = match r {
                7 => RenameMode::Replace,
                8 => RenameMode::NoReplace,
                _ => RenameMode::Exchange,
            };
            Op::Rename(dir(rng), name(rng), dir(rng), name(rng), mode)
        }
    }
}

fn run_seed(seed: u64) {
    eprintln!("sim seed = {seed} (replay: META_SIM_SEED={seed})");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let clock = Arc::new(ManualClock::new(Timespec::new(1_700_000_000, 0)));
    let kv = Arc::new(MemEtcd::new(clock.clone()));
    let keys = Keyspace::new("sim").unwrap();
    let sb = SuperRecord {
        uuid: [3; 16],
        format_version: 1,
        block_size: 4096,
        group_size: 1 << 26,
        group_count: 4,
        device_size: 1 << 28,
        created: Timespec::new(1, 0),
    };
    let root = RootOwner {
        uid: 0,
        gid: 0,
        perm: 0o755,
    };
    rt.block_on(format(&*kv, &keys, &sb, root, Timespec::new(1, 0), false))
        .unwrap();
    let mut rng = SmallRng::seed_from_u64(seed);
    // Swarm testing: each seed turns fault classes on or off.
    let faults = Faults {
        txn_latency: Duration::from_micros(if rng.gen_bool(0.5) { 500 } else { 0 }),
        compare_failure_per_mille: if rng.gen_bool(0.7) {
            rng.gen_range(50..300)
        } else {
            0
        },
        seed,
        ..Default::default()
    };
    eprintln!("faults: {faults:?}");
    let pipelines: Vec<Pipeline> = (0..NODES)
        .map(|n| {
            let kv2 = kv.clone();
            let connect: meta::pipeline::Connect =
                Box::new(move || Box::pin(async move { Ok(kv2 as Arc<dyn KvBackend>) }));
            let cfg = Config {
                txns_in_flight_max: 1 + n as usize,
                ..Config::default()
            };
            Pipeline::start(
                connect,
                keys.clone(),
                SessionId(n + 1),
                clock.clone() as Arc<dyn Clock>,
                cfg,
            )
            .unwrap()
        })
        .collect();
    let c0 = pipelines[0].client();
    let mut dirs = vec![Ino::ROOT];
    for d in ["d1", "d2"] {
        let m = Mutation::Create {
            parent: Ino::ROOT,
            name: d.as_bytes().to_vec(),
            inode: NewInode::root_owned(FileType::Directory, 0o755),
            symlink: None,
            hold: false,
        };
        dirs.push(c0.commit(m).unwrap().ino.unwrap());
    }
    kv.set_faults(faults);
    let handles: Vec<_> = pipelines
        .iter()
        .enumerate()
        .map(|(n, p)| {
            let client = p.client();
            let dirs = dirs.clone();
            let mut rng = SmallRng::seed_from_u64(seed ^ (0x9e37_79b9 * (n as u64 + 1)));
            std::thread::spawn(move || {
                let mut log = Vec::new();
                let mut done = 0;
                let mut seen = Seen::new();
                while done < OPS_PER_NODE {
                    let k = rng.gen_range(1..=4);
                    let ops: Vec<Op> = (0..k).map(|_| random_op(&mut rng, &dirs)).collect();
                    let ts: Vec<_> = ops
                        .iter()
                        .map(|op| {
                            let expect = rng.gen_bool(0.5).then_some(&seen);
                            client.submit_blocking(to_mutation(op, expect)).unwrap()
                        })
                        .collect();
                    for (op, t) in ops.into_iter().zip(ts) {
                        let r = t.wait();
                        if let (Op::Create(p, name), Ok(o)) = (&op, &r) {
                            if let Some(a) = &o.attr {
                                seen.insert((*p, name.clone()), a.clone());
                            }
                        }
                        log.push((n, op, r));
                    }
                    done += k;
                }
                log
            })
        })
        .collect();
    let mut events = Vec::new();
    for h in handles {
        events.extend(h.join().unwrap());
    }
    kv.set_faults(Faults::default());
    let mut ok = Vec::new();
    let (mut n_ok, mut n_err) = (0, 0);
    for (node, op, r) in events {
        match r {
            Ok(o) => {
                n_ok += 1;
                if o.revision.0 > 0 {
                    ok.push((o.revision.0, node, op, o));
                }
            }
            Err(MetaError::NotFound | MetaError::Exists) => n_err += 1,
            Err(e) => panic!("seed {seed}: node {node} {op:?} failed with {e}"),
        }
    }
    ok.sort_by_key(|(rev, node, _, _)| (*rev, *node));
    let mut reference = Reference::default();
    for (_, _, op, o) in &ok {
        reference.apply(op, o);
    }
    // The store must equal the reference: entries of the three directories, and the
    // link counts of every file inode (no leaked or missing inodes).
    let mut entries = BTreeMap::new();
    let mut nlink = HashMap::new();
    rt.block_on(async {
        for &d in &dirs {
            let r = keys.dentries(d);
            let resp = kv.range(RangeRequest::range(r.start, r.end)).await.unwrap();
            for item in resp.kvs {
                let Some(KeyKind::Dentry(p, name)) = keys.parse(&item.key) else {
                    panic!()
                };
                let de = meta::codec::Dentry::decode(&item.value).unwrap();
                if de.kind == FileType::Regular {
                    entries.insert((p, String::from_utf8(name).unwrap()), de.ino);
                }
            }
        }
        let r = keys.inodes();
        let resp = kv.range(RangeRequest::range(r.start, r.end)).await.unwrap();
        for item in resp.kvs {
            let a = InodeAttr::decode(&item.value).unwrap();
            if a.kind == FileType::Regular {
                nlink.insert(a.ino, a.nlink);
            }
        }
    });
    assert_eq!(
        entries, reference.entries,
        "seed {seed}: directory entries differ"
    );
    assert_eq!(
        nlink, reference.nlink,
        "seed {seed}: inode link counts differ"
    );
    let stats: Vec<_> = pipelines.iter().map(|p| p.client().stats()).collect();
    let retries: u64 = stats.iter().map(|s| s.retries).sum();
    let txns: u64 = stats.iter().map(|s| s.txns_committed).sum();
    eprintln!(
        "seed {seed}: {n_ok} ok ({} changed), {n_err} NotFound/Exists, {txns} txns, {retries} retries, {} files",
        ok.len(),
        reference.nlink.len()
    );
}

#[test]
fn sim_random_seeds() {
    let seeds: Vec<u64> = match std::env::var("META_SIM_SEED") {
        Ok(s) => vec![s.trim().parse().expect("META_SIM_SEED is a u64")],
        Err(_) => {
            let base = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64;
            (0..4).map(|i| base.wrapping_add(i * 7919)).collect()
        }
    };
    for seed in seeds {
        run_seed(seed);
    }
}
