//! Seeded simulation of a session's lease fence (`meta::fence`, kept by the session's
//! keepalive) against the in-memory etcd's lease expiry, on one manual clock.
//!
//! Each trial registers a session with a random TTL and then runs a random schedule of:
//! time passing in small steps (the keepalive runs between them); renewals lost
//! (`Unavailable`), a few or all of them for a while (etcd unreachable); renewals delayed in the "network" both ways (applied by
//! etcd later than they were sent, and answered later than they were applied, possibly
//! after the fence or the lease ran out); and freezes (the
//! clock jumps forward while the node runs nothing, as under SIGSTOP or a long stall).
//!
//! After every step: whenever the fence is open, etcd's lease outlives the present by at
//! least the margin (a device I/O started now completes before anyone else may act on
//! the lease's expiry); once closed, the fence stays closed for that session; and a trial
//! without faults never closes it.
//!
//! `FENCE_SIM_SEED=<n>` replays one seed (everything here is deterministic: the tokio
//! clock is paused and only the schedule moves the manual clock).
#![allow(clippy::unwrap_used, clippy::panic)]

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use meta::{
    clock::{Clock, ManualClock},
    error::KvError,
    fence::{margin, Fence},
    keys::Keyspace,
    kv::{
        BoxFut, KvBackend, LeaseGrant, RangeRequest, RangeResponse, Txn, TxnResponse, WatchStream,
    },
    model::MemEtcd,
    session::{Session, SessionConfig},
    types::Timespec,
};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const TRIALS: u64 = 200;
const STEPS: usize = 300;

/// What the network does to the next renewals.
#[derive(Default)]
struct Net {
    /// Renewals still to fail.
    drop: u32,
    /// Every renewal fails until then (etcd unreachable).
    down_until: Duration,
    /// Delay of the next renewal on its way to etcd (applied this much later).
    delay: Option<Duration>,
    /// Delay of the next renewal's answer on its way back (applied on time, known late).
    delay_back: Option<Duration>,
    /// Renewals etcd applied.
    applied: u64,
}

/// The model behind a network that loses and delays lease renewals.
struct Wire {
    etcd: Arc<MemEtcd>,
    clock: Arc<ManualClock>,
    net: Arc<Mutex<Net>>,
}

impl KvBackend for Wire {
    fn range(&self, req: RangeRequest) -> BoxFut<'_, Result<RangeResponse, KvError>> {
        self.etcd.range(req)
    }
    fn txn(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
        self.etcd.txn(txn)
    }
    fn lease_grant(&self, ttl_s: i64) -> BoxFut<'_, Result<LeaseGrant, KvError>> {
        self.etcd.lease_grant(ttl_s)
    }
    fn lease_keepalive(&self, id: i64) -> BoxFut<'_, Result<i64, KvError>> {
        Box::pin(async move {
            let (lost, delay, back) = {
                let mut n = self.net.lock().unwrap();
                if n.drop > 0 || self.clock.mono() < n.down_until {
                    n.drop = n.drop.saturating_sub(1);
                    (true, None, None)
                } else {
                    (false, n.delay.take(), n.delay_back.take())
                }
            };
            if lost {
                return Err(KvError::Unavailable("renewal lost".into()));
            }
            if let Some(d) = delay {
                let until = self.clock.mono() + d;
                while self.clock.mono() < until {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            let r = self.etcd.lease_keepalive(id).await;
            self.net.lock().unwrap().applied += 1;
            if let Some(d) = back {
                let until = self.clock.mono() + d;
                while self.clock.mono() < until {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            r
        })
    }
    fn lease_revoke(&self, id: i64) -> BoxFut<'_, Result<(), KvError>> {
        self.etcd.lease_revoke(id)
    }
    fn watch(
        &self,
        key: Vec<u8>,
        range_end: Vec<u8>,
        start_revision: i64,
    ) -> BoxFut<'_, Result<WatchStream, KvError>> {
        self.etcd.watch(key, range_end, start_revision)
    }
}

/// A manual clock, the model on it, and the network in front of it.
#[allow(clippy::type_complexity)]
fn world() -> (
    Arc<ManualClock>,
    Arc<MemEtcd>,
    Arc<Mutex<Net>>,
    Arc<dyn KvBackend>,
) {
    let clock = Arc::new(ManualClock::new(Timespec::new(1_700_000_000, 0)));
    let etcd = Arc::new(MemEtcd::new(clock.clone()));
    let net = Arc::new(Mutex::new(Net::default()));
    let kv: Arc<dyn KvBackend> = Arc::new(Wire {
        etcd: etcd.clone(),
        clock: clock.clone(),
        net: net.clone(),
    });
    (clock, etcd, net, kv)
}

/// Lets the keepalive task run (tokio's clock is paused: this costs no real time).
async fn let_run() {
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn trial(seed: u64) -> (usize, bool) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (clock, etcd, net, kv) = world();
    let ttl_s: i64 = rng.gen_range(2..=12);
    let ttl = Duration::from_secs(ttl_s as u64);
    // Which faults this trial sees: lost renewals, late ones, freezes (bit 0, 1, 2).
    let faults: u8 = if rng.gen_bool(0.2) {
        0
    } else {
        rng.gen_range(1..8)
    };
    let faulty = faults != 0;
    let fence = Arc::new(Fence::new(clock.clone()));
    let cfg = SessionConfig {
        ttl_s,
        keepalive_tick: Duration::from_millis(1),
        fence: Some(fence.clone()),
        ..SessionConfig::new("sim")
    };
    let keys = Keyspace::new("sim").unwrap();
    let s = Session::register(kv, keys, &cfg, clock.clone())
        .await
        .unwrap();
    let lease = s.lease().0;
    let mut closed_at: Option<usize> = None;
    let mut open_steps = 0;
    for step in 0..STEPS {
        let what = rng.gen_range(0..10);
        match what {
            // A renewal (or several) lost.
            6 if faults & 1 != 0 => net.lock().unwrap().drop += rng.gen_range(1..12),
            // etcd unreachable for a while, from the next renewal on.
            7 if faults & 1 != 0 => {
                let d = Duration::from_millis(rng.gen_range(0..=ttl.as_millis() as u64 * 2));
                net.lock().unwrap().down_until = clock.mono() + d;
            }
            // The next renewal reaches etcd late, sometimes after a whole TTL.
            8 if faults & 2 != 0 => {
                let mut d =
                    || Duration::from_millis(rng.gen_range(0..=ttl.as_millis() as u64 * 3 / 2));
                let (there, back) = (d(), d());
                let mut n = net.lock().unwrap();
                n.delay = Some(there);
                n.delay_back = Some(back);
            }
            // Frozen: the clock jumps while nothing of the node runs.
            9 if faults & 4 != 0 && rng.gen_bool(0.3) => {
                clock.advance(Duration::from_millis(
                    rng.gen_range(0..=ttl.as_millis() as u64 * 2),
                ));
            }
            _ => {}
        }
        // Time passes in steps short enough for renewals to keep up when they work.
        let dt = Duration::from_millis(rng.gen_range(1..=(ttl.as_millis() as u64 / 8).max(2)));
        clock.advance(dt);
        // The check comes before the keepalive may run again: what a request arriving at
        // this instant would find.
        let now = clock.mono();
        if fence.open_for(s.id()) {
            assert!(
                closed_at.is_none(),
                "seed {seed} step {step}: the fence opened again after closing at step {:?}",
                closed_at
            );
            let deadline = etcd.lease_deadline(lease).unwrap_or_else(|| {
                panic!("seed {seed} step {step}: fence open but the lease is gone at {now:?}")
            });
            assert!(
                deadline >= now + margin(ttl),
                "seed {seed} step {step}: fence open at {now:?} ({:?} left) but the lease \
                 expires at {deadline:?}, inside the {:?} margin",
                fence.left(),
                margin(ttl)
            );
            open_steps += 1;
        } else if closed_at.is_none() {
            closed_at = Some(step);
        }
        let_run().await;
    }
    if !faulty {
        assert_eq!(
            closed_at, None,
            "seed {seed}: without faults the fence never closes"
        );
        assert!(net.lock().unwrap().applied > 0, "seed {seed}: renewals ran");
    }
    s.stop_keepalive();
    assert!(!fence.open(), "stopping the keepalive closes the fence");
    (open_steps, closed_at.is_some())
}

#[tokio::test(start_paused = true)]
async fn the_fence_closes_before_the_lease_can_expire() {
    let seeds: Vec<u64> = match std::env::var("FENCE_SIM_SEED") {
        Ok(s) => vec![s.parse().unwrap()],
        Err(_) => (0..TRIALS).collect(),
    };
    let (mut fenced, mut open) = (0, 0);
    for seed in seeds.iter().copied() {
        let (o, f) = trial(seed).await;
        open += o;
        fenced += usize::from(f);
    }
    eprintln!(
        "{} trials: {fenced} fenced themselves, {open} steps checked with the fence open",
        seeds.len()
    );
    if seeds.len() > 1 {
        assert!(fenced > 0 && open > 0, "the schedule exercises both sides");
    }
}

/// The fence counts from when a renewal was sent, not from when its answer came: an
/// answer that took 3 s to come back does not buy 3 s more.
#[tokio::test(start_paused = true)]
async fn a_late_answer_buys_no_time() {
    let (clock, etcd, net, kv) = world();
    let fence = Arc::new(Fence::new(clock.clone()));
    let cfg = SessionConfig {
        ttl_s: 10,
        keepalive_tick: Duration::from_millis(1),
        fence: Some(fence.clone()),
        ..SessionConfig::new("late")
    };
    let s = Session::register(kv, Keyspace::new("late").unwrap(), &cfg, clock.clone())
        .await
        .unwrap();
    let step = Duration::from_millis(100);
    // The renewal due at 2.5 s reaches etcd at once and its answer comes 3 s later; from
    // then on etcd is unreachable.
    net.lock().unwrap().delay_back = Some(Duration::from_secs(3));
    while net.lock().unwrap().applied == 0 {
        assert!(
            clock.mono() < Duration::from_secs(4),
            "the renewal went out"
        );
        clock.advance(step);
        let_run().await;
    }
    let sent = clock.mono();
    net.lock().unwrap().down_until = Duration::from_secs(3600);
    // etcd expires the lease 10 s after the renewal; the fence shuts 2 s before.
    let expiry = sent + Duration::from_secs(10);
    assert_eq!(etcd.lease_deadline(s.lease().0), Some(expiry));
    let mut answered = false;
    while clock.mono() < expiry {
        clock.advance(step);
        let now = clock.mono();
        answered |= now >= sent + Duration::from_secs(3);
        if fence.open() {
            assert!(
                now + Duration::from_secs(2) < expiry,
                "fence open at {now:?}, less than the margin before the lease expires at \
                 {expiry:?}"
            );
        }
        let_run().await;
    }
    assert!(answered);
    assert!(!fence.open());
    drop(s);
}
