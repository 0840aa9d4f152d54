//! Seeded simulation of extent commits planned from expectations: three "nodes"
//! (pipelines with their own sessions) rewrite random block ranges of two shared files at
//! once, each usually planning from the record its own last commit of that file left
//! (`ExtentsKnown::expectation`), which the other nodes' commits keep making stale; the
//! model injects compare failures and latency. Every successful commit is then replayed,
//! in revision order, on a reference map of each file's extent keys: etcd's final keys and
//! sizes must equal the reference's, so no commit was ever planned from a guess that did
//! not hold.
//!
//! The seed is printed first; `META_SIM_SEED=<n>` replays that seed's workload and fault
//! coins (thread interleaving is not reproduced: the nodes are real threads).
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use meta::{
    clock::ManualClock,
    codec::Extent,
    keys::Keyspace,
    model::{Faults, MemEtcd},
    pipeline::{Config, Mutation, NewInode, Outcome, Pipeline},
    types::{FileType, Ino},
};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const NODES: u64 = 3;
const OPS_PER_NODE: usize = 120;
const BLOCK: u64 = 4096;
/// Blocks of each file the commits touch.
const SPAN: u64 = 24;

#[derive(Clone, Debug)]
struct Op {
    file: usize,
    off: u64,
    len: u64,
    extents: Vec<Extent>,
    size_at_least: Option<u64>,
}

/// A random rewrite of a block range: new data (one or two extents), or a punch. The size
/// it raises to is mostly far past the range, at random, so that a commit planned from
/// stale attributes would lose another node's larger raise.
fn random_op(rng: &mut SmallRng, files: usize, dev_base: u64) -> Op {
    let first = rng.gen_range(0..SPAN);
    let blocks = rng.gen_range(1..=4u64).min(SPAN - first);
    let (off, len) = (first * BLOCK, blocks * BLOCK);
    let extent = |file_off: u64, len: u64| Extent {
        file_off,
        len,
        dev_off: dev_base + file_off,
        unwritten: false,
    };
    let extents = match rng.gen_range(0..4) {
        0 => Vec::new(),
        1 if blocks > 1 => {
            let cut = off + rng.gen_range(1..blocks) * BLOCK;
            vec![extent(off, cut - off), extent(cut, off + len - cut)]
        }
        _ => vec![extent(off, len)],
    };
    Op {
        file: rng.gen_range(0..files),
        off,
        len,
        extents,
        size_at_least: rng
            .gen_bool(0.7)
            .then(|| off + len + rng.gen_range(0..1u64 << 20) * BLOCK),
    }
}

/// The file's extent keys by offset, as a SetExtents leaves them.
fn apply(map: &mut BTreeMap<u64, Extent>, op: &Op) {
    let end = op.off + op.len;
    let hit: Vec<Extent> = map
        .values()
        .filter(|e| e.file_off < end && e.file_end() > op.off)
        .copied()
        .collect();
    for e in hit {
        map.remove(&e.file_off);
        if e.file_off < op.off {
            let head = Extent {
                len: op.off - e.file_off,
                ..e
            };
            map.insert(head.file_off, head);
        }
        if e.file_end() > end {
            let cut = end - e.file_off;
            let tail = Extent {
                file_off: end,
                len: e.len - cut,
                dev_off: e.dev_off + cut,
                unwritten: e.unwritten,
            };
            map.insert(end, tail);
        }
    }
    for e in &op.extents {
        map.insert(e.file_off, *e);
    }
}

fn run_seed(seed: u64) {
    eprintln!("extents sim seed = {seed} (replay: META_SIM_SEED={seed})");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let clock = Arc::new(ManualClock::new(common::T0));
    let kv = Arc::new(MemEtcd::new(clock.clone()));
    let keys = Keyspace::new("xsim").unwrap();
    rt.block_on(common::format_model(&kv, &keys));
    let mut rng = SmallRng::seed_from_u64(seed);
    let faults = Faults {
        txn_latency: Duration::from_micros(if rng.gen_bool(0.5) { 300 } else { 0 }),
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
        .map(|n| common::start(kv.clone(), &keys, n + 1, clock.clone(), Config::default()))
        .collect();
    let c0 = pipelines[0].client();
    let files: Vec<Ino> = ["a", "b"]
        .iter()
        .map(|name| {
            let m = Mutation::Create {
                parent: Ino::ROOT,
                name: name.as_bytes().to_vec(),
                inode: NewInode::root_owned(FileType::Regular, 0o644),
                symlink: None,
                hold: false,
            };
            c0.commit(m).unwrap().ino.unwrap()
        })
        .collect();
    kv.set_faults(faults);
    let handles: Vec<_> = pipelines
        .iter()
        .enumerate()
        .map(|(n, p)| {
            let client = p.client();
            let files = files.clone();
            let mut rng = SmallRng::seed_from_u64(seed ^ (0x9e37_79b9 * (n as u64 + 1)));
            std::thread::spawn(move || {
                let mut log = Vec::new();
                // This node's last outcome per file: its record.
                let mut last: Vec<Option<Outcome>> = vec![None; files.len()];
                let mut expected = 0;
                for i in 0..OPS_PER_NODE {
                    let dev_base = ((n as u64 + 1) << 32) + (i as u64) * SPAN * BLOCK;
                    let op = random_op(&mut rng, files.len(), dev_base);
                    let expect = last[op.file]
                        .as_ref()
                        .filter(|_| rng.gen_bool(0.8))
                        .and_then(|o| {
                            o.extents_known.as_ref()?.expectation(
                                o.attr.as_ref()?,
                                op.off,
                                op.off + op.len,
                            )
                        });
                    expected += usize::from(expect.is_some());
                    let r = client.commit(Mutation::SetExtents {
                        ino: files[op.file],
                        off: op.off,
                        len: op.len,
                        extents: op.extents.clone(),
                        size_at_least: op.size_at_least,
                        touch_mtime: rng.gen_bool(0.5),
                        free_maps: Vec::new(),
                        expect: expect.map(Box::new),
                    });
                    match r {
                        Ok(o) => {
                            last[op.file] = Some(o.clone());
                            log.push((o.revision.0, n, op, o));
                        }
                        Err(e) => panic!("seed {seed}: node {n} {op:?} failed with {e}"),
                    }
                }
                (log, expected)
            })
        })
        .collect();
    let mut ok = Vec::new();
    let mut expected = 0;
    for h in handles {
        let (log, e) = h.join().unwrap();
        ok.extend(log);
        expected += e;
    }
    kv.set_faults(Faults::default());
    ok.sort_by_key(|(rev, node, _, _)| (*rev, *node));
    let mut reference: Vec<BTreeMap<u64, Extent>> = vec![BTreeMap::new(); files.len()];
    let mut sizes = vec![0u64; files.len()];
    for (_, _, op, o) in &ok {
        apply(&mut reference[op.file], op);
        if let Some(s) = op.size_at_least {
            sizes[op.file] = sizes[op.file].max(s);
        }
        // What the commit reports it left must be what the replay has there.
        let known = o.extents_known.as_ref().unwrap();
        let there: Vec<Extent> = reference[op.file]
            .range(known.start..known.end)
            .map(|(_, e)| *e)
            .collect();
        assert_eq!(known.extents, there, "seed {seed}: record of {op:?}");
    }
    rt.block_on(async {
        for (i, &ino) in files.iter().enumerate() {
            let (got, more) = meta::reader::extents(&*kv, &keys, ino, 0, 1000)
                .await
                .unwrap();
            assert!(!more);
            let want: Vec<Extent> = reference[i].values().copied().collect();
            assert_eq!(got, want, "seed {seed}: extents of file {i} differ");
            let attr = meta::reader::get_inode(&*kv, &keys, ino)
                .await
                .unwrap()
                .unwrap()
                .0;
            assert_eq!(attr.size, sizes[i], "seed {seed}: size of file {i}");
        }
    });
    let stats: Vec<_> = pipelines.iter().map(|p| p.client().stats()).collect();
    let retries: u64 = stats.iter().map(|s| s.retries).sum();
    let reads: u64 = stats.iter().map(|s| s.read_txns).sum();
    eprintln!(
        "seed {seed}: {} commits, {expected} planned from a record, {retries} retries, \
         {reads} read txns",
        ok.len()
    );
    assert!(expected > 0, "seed {seed}: no commit had an expectation");
}

#[test]
fn extents_sim_random_seeds() {
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
