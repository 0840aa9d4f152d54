//! Runs `fusedev::fuzz::check_decode` over a seeded random corpus inside `cargo test`, so
//! the decoder's no-panic and round-trip properties are checked on every run, not only
//! when someone runs cargo-fuzz (which needs nightly).
//!
//! The seed is printed first; reproduce a failure with `ETCFS_FUZZ_SEED=<seed>`.

use std::time::{Duration, Instant};

use fusedev::{fuzz, request};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const SEED_DEFAULT: u64 = 0x6574_6366_735f_667a;
/// Inputs per run; at a few microseconds each this is well under a second.
const INPUTS: usize = 50_000;
/// A smoke run slower than this means the decoder got pathologically slow.
const BUDGET: Duration = Duration::from_secs(30);

fn seed() -> u64 {
    std::env::var("ETCFS_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SEED_DEFAULT)
}

/// One mutated input: a valid message changed the way real corruption (or a new kernel)
/// would change it.
fn mutate(rng: &mut SmallRng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut msg = seeds[rng.gen_range(0..seeds.len())].clone();
    for _ in 0..rng.gen_range(1..=3) {
        match rng.gen_range(0..8) {
            // Truncate, keeping or fixing the header's length.
            0 => {
                let keep = rng.gen_range(0..=msg.len());
                msg.truncate(keep);
                if rng.gen_bool(0.5) {
                    fix_len(&mut msg);
                }
            }
            // Flip a bit anywhere.
            1 | 2 if !msg.is_empty() => {
                let i = rng.gen_range(0..msg.len());
                msg[i] ^= 1 << rng.gen_range(0..8);
            }
            // A random opcode, often a known one.
            3 if msg.len() >= 8 => {
                let op: u32 = if rng.gen_bool(0.8) {
                    rng.gen_range(0..60)
                } else {
                    rng.gen()
                };
                msg[4..8].copy_from_slice(&op.to_ne_bytes());
            }
            // A random length field.
            4 if msg.len() >= 4 => {
                let len: u32 = rng.gen_range(0..(msg.len() as u32 + 64));
                msg[0..4].copy_from_slice(&len.to_ne_bytes());
            }
            // Random extension length.
            5 if msg.len() >= 38 => {
                let ext: u16 = rng.gen_range(0..8);
                msg[36..38].copy_from_slice(&ext.to_ne_bytes());
            }
            // Random bytes appended (and the length fixed).
            6 => {
                let extra = rng.gen_range(0..64);
                msg.extend((0..extra).map(|_| rng.gen::<u8>()));
                fix_len(&mut msg);
            }
            // Overwrite a size-like field inside the arguments with a big value.
            _ if msg.len() >= 48 => {
                let at = rng.gen_range(40..msg.len() - 3);
                let v: u32 = if rng.gen_bool(0.5) {
                    u32::MAX
                } else {
                    rng.gen_range(0..256)
                };
                msg[at..at + 4].copy_from_slice(&v.to_ne_bytes());
            }
            _ => {}
        }
    }
    msg
}

fn fix_len(msg: &mut [u8]) {
    if msg.len() >= 4 {
        let len = msg.len() as u32;
        msg[0..4].copy_from_slice(&len.to_ne_bytes());
    }
}

fn random_bytes(rng: &mut SmallRng) -> Vec<u8> {
    let len = rng.gen_range(0..200);
    let mut msg: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
    // Give the header a consistent length half the time, or decode rejects it at once.
    if rng.gen_bool(0.5) {
        fix_len(&mut msg);
    }
    msg
}

#[test]
fn decode_survives_a_seeded_random_corpus() {
    let seed = seed();
    println!("fuzz smoke seed: {seed} (set ETCFS_FUZZ_SEED to reproduce)");
    let mut rng = SmallRng::seed_from_u64(seed);
    let seeds = fuzz::seed_corpus();
    let started = Instant::now();
    let mut decoded = 0usize;
    for i in 0..INPUTS {
        let input = if i % 4 == 0 {
            random_bytes(&mut rng)
        } else {
            mutate(&mut rng, &seeds)
        };
        fuzz::check_decode(&input);
        decoded += usize::from(request::decode(&input).is_ok());
    }
    let elapsed = started.elapsed();
    println!("{INPUTS} inputs, {decoded} decoded, in {elapsed:?}");
    assert!(elapsed < BUDGET, "decoder too slow: {elapsed:?}");
    // Canary: if (almost) nothing decodes, the mutations stopped exercising the decoder
    // past the header checks and this test would pass vacuously.
    assert!(
        decoded > INPUTS / 10,
        "only {decoded} of {INPUTS} inputs decoded"
    );
    assert!(
        decoded < INPUTS,
        "every input decoded: the mutations are not mutating"
    );
}

#[test]
fn every_seed_message_and_prefix() {
    for msg in fuzz::seed_corpus() {
        for cut in 0..=msg.len() {
            fuzz::check_decode(&msg[..cut]);
            let mut fixed = msg[..cut].to_vec();
            fix_len(&mut fixed);
            fuzz::check_decode(&fixed);
        }
    }
}
