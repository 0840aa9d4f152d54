//! Deferred replies on the ring transport while entries move between workers. A worker
//! serves the entries of its own CPU's queue and those other workers pass it (`ring::Peers`),
//! so it can hold more requests than its own queue has entries; every one of them may be
//! answered from another thread at the same moment. Needs root, /dev/fuse, enable_uring and
//! two CPUs (skips loudly without, fails instead when ETCFS_REQUIRE_MOUNT_TESTS=1).

mod common;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        mpsc, Arc, Barrier, Mutex,
    },
    time::Duration,
};

use fusedev::{
    abi::{Attr, AttrOut, EntryOut},
    errno::Errno,
    reply,
    request::{Operation, Request},
    server::{DeferredReply, Handler, Reply, RequestCtx},
    transport::TransportChoice,
};

const FILE_INO: u64 = 2;
const LONG: Duration = Duration::from_secs(3600);

/// Root holds one file `f` whose attributes are never cached, so every stat of it is a
/// GETATTR. Those are deferred and held until `together` of them are, then all answered at
/// once from the thread of the last one: a burst of completions to whichever workers hold
/// the entries. With `together` `None` they are held for ever: a handler that lost its
/// replies.
struct HoldsGetattrs {
    together: Option<usize>,
    held: Mutex<Vec<DeferredReply>>,
    answered: AtomicUsize,
}

impl HoldsGetattrs {
    fn new(together: Option<usize>) -> HoldsGetattrs {
        HoldsGetattrs {
            together,
            held: Mutex::new(Vec::new()),
            answered: AtomicUsize::new(0),
        }
    }
}

fn attr(ino: u64) -> Attr {
    let mode = if ino == 1 {
        libc::S_IFDIR | 0o755
    } else {
        libc::S_IFREG | 0o644
    };
    Attr {
        ino,
        mode,
        nlink: 1,
        blksize: 4096,
        ..Attr::default()
    }
}

impl Handler for HoldsGetattrs {
    fn handle(&self, ctx: &RequestCtx<'_>, req: &Request<'_>, out: &mut [u8]) -> Reply {
        match &req.op {
            Operation::Lookup { name } if req.header.nodeid == 1 && *name == b"f" => {
                let e = EntryOut::new(1, LONG, Duration::ZERO, attr(FILE_INO));
                Reply::Bytes(reply::entry(out, &e).expect("fits"))
            }
            Operation::Lookup { .. } => {
                Reply::Bytes(reply::entry(out, &EntryOut::negative(LONG)).expect("fits"))
            }
            Operation::Getattr { .. } if req.header.nodeid == FILE_INO => {
                let a = AttrOut::new(Duration::ZERO, attr(FILE_INO));
                let Some(d) = ctx.defer() else {
                    return Reply::Bytes(reply::attr(out, &a).expect("fits"));
                };
                let mut held = self.held.lock().expect("held replies");
                held.push(d);
                if Some(held.len()) == self.together {
                    let all = std::mem::take(&mut *held);
                    drop(held);
                    let mut args = vec![0u8; 256];
                    let n = reply::attr(&mut args, &a).expect("fits");
                    args.truncate(n);
                    for d in all {
                        d.bytes(args.clone());
                        self.answered.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Reply::Deferred
            }
            Operation::Getattr { .. } => {
                let a = AttrOut::new(LONG, attr(req.header.nodeid));
                Reply::Bytes(reply::attr(out, &a).expect("fits"))
            }
            Operation::Forget { .. } | Operation::BatchForget { .. } => Reply::None,
            _ => Reply::Error(Errno::ENOSYS),
        }
    }
}

/// Found with two fio jobs at queue depth 32, one per CPU, reading O_DIRECT: after about a
/// hundred runs the jobs waited forever with a few requests owed by the daemon. A worker's
/// channel of deferred completions had room for its own queue's entries only, and a
/// completion that found it full was dropped, its request never answered.
#[test]
fn a_burst_of_deferred_replies_reaches_workers_holding_passed_entries() {
    const T: &str = "a_burst_of_deferred_replies_reaches_workers_holding_passed_entries";
    const PER_QUEUE: usize = 4;
    const ROUNDS: usize = 300;
    if !common::uring_tests_possible(T) {
        return;
    }
    let cpus = uring::cpu::allowed_cpus().expect("allowed CPUs");
    let possible = uring::cpu::possible_cpus().expect("possible CPUs");
    if cpus.len() < 2 || possible.len() != cpus.len() {
        // Every possible CPU has a queue; with CPUs that are not allowed here the entries
        // a round can reach are not the ones the test counts on.
        eprintln!("SKIP: {T}: needs exactly the possible CPUs allowed, and two of them");
        return;
    }
    let cpus = &cpus[..2];
    // One thread per entry, half on each CPU: every round has every entry in service.
    let threads = 2 * PER_QUEUE;
    let fs = Arc::new(HoldsGetattrs::new(Some(threads)));
    let mut cfg = common::small_config(TransportChoice::Uring);
    cfg.cpus = cpus.to_vec();
    cfg.ring_entries_per_queue = PER_QUEUE;
    // Move queues and pass entries at the least load.
    cfg.ring_share_above = 1;
    let m = common::mount(fs.clone(), "deferred", &cfg);
    let file = m.dir.join("f");
    let barrier = Arc::new(Barrier::new(threads));
    let (done_tx, done_rx) = mpsc::channel();
    for t in 0..threads {
        let (file, barrier, done_tx) = (file.clone(), barrier.clone(), done_tx.clone());
        let cpu = cpus[t % 2];
        // Not scoped: a thread whose stat is never answered must not hold up the report.
        std::thread::spawn(move || {
            uring::cpu::pin_current_thread(cpu).expect("pin");
            for round in 0..ROUNDS {
                barrier.wait();
                if let Err(e) = std::fs::metadata(&file) {
                    let _ = done_tx.send(Err(format!("round {round}: stat: {e}")));
                    return;
                }
            }
            let _ = done_tx.send(Ok(()));
        });
    }
    drop(done_tx);
    for _ in 0..threads {
        match done_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("{e}"),
            Err(_) => panic!(
                "stats unanswered after 30 s: {} of {} deferred replies delivered",
                fs.answered.load(Ordering::SeqCst),
                threads * ROUNDS
            ),
        }
    }
    assert_eq!(fs.answered.load(Ordering::SeqCst), threads * ROUNDS);
    let counters = m.perf.export(&[]).counters;
    let passed = counters
        .iter()
        .find(|(name, _)| *name == "ring_entries_passed")
        .map_or(0, |c| c.1);
    assert!(
        passed > 0,
        "no entry moved between workers: the rounds did not test what they are for"
    );
}

/// Found with the hang above: a daemon whose connection was aborted through
/// /sys/fs/fuse/connections/N/abort kept running, its workers waiting for entries held as
/// deferred replies that never came, and with them its cluster locks and lease.
#[test]
fn a_session_ends_when_its_connection_is_aborted_with_replies_owed() {
    const T: &str = "a_session_ends_when_its_connection_is_aborted_with_replies_owed";
    if !common::uring_tests_possible(T) {
        return;
    }
    let fs = Arc::new(HoldsGetattrs::new(None));
    let mut m = common::mount(
        fs.clone(),
        "aborted",
        &common::small_config(TransportChoice::Uring),
    );
    let file = m.dir.join("f");
    let (stat_tx, stat_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = stat_tx.send(std::fs::metadata(&file).map(drop));
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while fs.held.lock().expect("held replies").is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the GETATTR never reached the handler"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    m.abort();
    let stat = stat_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the stat returns once the connection is aborted");
    assert!(
        stat.is_err(),
        "the stat was never answered, so it must fail"
    );
    let session = m.session.take().expect("session");
    let (ended_tx, ended_rx) = mpsc::channel();
    std::thread::spawn(move || {
        session.wait();
        let _ = ended_tx.send(());
    });
    ended_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the session ends within 10 s of the abort");
}
