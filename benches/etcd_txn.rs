//! etcd_txn: the etcd floor under etcfs's metadata rates (run by `benches/fs.sh`).
//!
//! Times raw etcd requests shaped like the transactions one metadata operation costs, sent
//! through the same client stack the filesystem uses (`meta::etcd::EtcdBackend`, i.e.
//! `etcd-client` over gRPC), on the pipeline's own runtime thread:
//!
//! * `create`: one transaction with a compare (the name is absent) and two puts (an
//!   inode-sized value and a dentry-sized value), like a file create;
//! * `get`: one single-key linearizable range read, like a lookup that reaches etcd;
//! * `unlink`: one transaction with a compare (the name exists) and two deletes.
//!
//! Each kind runs over `--ops` keys, by `--concurrency` tasks that each wait for one request
//! before sending the next (1 = the serial rate). Prints one line of key=value pairs per kind:
//!
//!   kind=create concurrency=1 ops=2000 secs=1.61 ops_per_s=1242 p50_us=760 p99_us=1900
//!
//! The keys live under `<prefix>/bench-txn/<nonce>/` and are deleted by the `unlink` pass.
//! The pipeline that hosts the runtime reserves a block of inode numbers when it starts (one
//! commit of `<prefix>/C`); the bench waits for it before timing anything. Use a prefix of
//! its own, not a filesystem's.
//!
//! usage: cargo bench --bench etcd_txn -- --etcd URL[,URL...] [--prefix P] [--ops N]
//!        [--concurrency C] [--etcd-cacert PEM [--etcd-cert PEM --etcd-key PEM]]

use std::{
    sync::{mpsc, Arc},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use meta::{
    clock::SystemClock,
    error::KvError,
    etcd::{EtcdBackend, EtcdConfig},
    keys::Keyspace,
    kv::{Compare, KvBackend, RangeRequest, Txn, TxnOp},
    pipeline::{Config, Pipeline},
    types::SessionId,
};

/// Value sizes close to what a create writes (an encoded inode and a dentry).
const INODE_VALUE_BYTES: usize = 96;
const DENTRY_VALUE_BYTES: usize = 16;

struct Args {
    etcd: Vec<String>,
    prefix: String,
    ops: usize,
    concurrency: usize,
    /// `--etcd-cacert`, `--etcd-cert`, `--etcd-key` as etcfs takes them (PEM files).
    cacert: Option<String>,
    cert: Option<String>,
    key: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        etcd: Vec::new(),
        prefix: "etcfs-bench".to_owned(),
        ops: 2000,
        concurrency: 1,
        cacert: None,
        cert: None,
        key: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--etcd" => args.etcd = value()?.split(',').map(str::to_owned).collect(),
            "--prefix" => args.prefix = value()?,
            "--etcd-cacert" => args.cacert = Some(value()?),
            "--etcd-cert" => args.cert = Some(value()?),
            "--etcd-key" => args.key = Some(value()?),
            "--ops" => args.ops = value()?.parse().map_err(|e| format!("--ops: {e}"))?,
            "--concurrency" => {
                args.concurrency = value()?
                    .parse()
                    .map_err(|e| format!("--concurrency: {e}"))?;
            }
            // `cargo bench` passes --bench to every bench target.
            "--bench" => {}
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.etcd.is_empty() {
        return Err("--etcd URL is required".into());
    }
    if args.ops == 0 || args.concurrency == 0 || args.concurrency > args.ops {
        return Err("need 1 <= --concurrency <= --ops".into());
    }
    Ok(args)
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Create,
    Get,
    Unlink,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Create => "create",
            Kind::Get => "get",
            Kind::Unlink => "unlink",
        }
    }
}

struct Keys {
    base: Vec<u8>,
}

impl Keys {
    fn inode(&self, i: usize) -> Vec<u8> {
        let mut k = self.base.clone();
        k.extend_from_slice(format!("i/{i:08}").as_bytes());
        k
    }
    fn dentry(&self, i: usize) -> Vec<u8> {
        let mut k = self.base.clone();
        k.extend_from_slice(format!("d/f{i}").as_bytes());
        k
    }
}

/// One request of `kind` on key `i`; an error if etcd refused it or a compare failed.
async fn one(backend: &dyn KvBackend, keys: &Keys, kind: Kind, i: usize) -> Result<(), KvError> {
    match kind {
        Kind::Create => {
            let r = backend
                .txn(Txn {
                    compares: vec![Compare::absent(keys.dentry(i))],
                    success: vec![
                        TxnOp::put(keys.inode(i), vec![0x5a; INODE_VALUE_BYTES]),
                        TxnOp::put(keys.dentry(i), vec![0xa5; DENTRY_VALUE_BYTES]),
                    ],
                    failure: vec![],
                })
                .await?;
            r.succeeded
                .then_some(())
                .ok_or_else(|| KvError::Other("create compare failed".into()))
        }
        Kind::Get => {
            let r = backend.range(RangeRequest::key(keys.inode(i))).await?;
            (r.kvs.len() == 1)
                .then_some(())
                .ok_or_else(|| KvError::Other("get found no key".into()))
        }
        Kind::Unlink => {
            let r = backend
                .txn(Txn {
                    compares: vec![Compare::exists(keys.dentry(i))],
                    success: vec![TxnOp::delete(keys.dentry(i)), TxnOp::delete(keys.inode(i))],
                    failure: vec![],
                })
                .await?;
            r.succeeded
                .then_some(())
                .ok_or_else(|| KvError::Other("unlink compare failed".into()))
        }
    }
}

/// Per-task result: latencies in microseconds, or the first error.
type TaskResult = Result<Vec<u64>, String>;

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    // Nearest rank below, like the other helpers of benches/fs.sh.
    let idx = ((sorted.len() - 1) as f64 * p) as usize;
    sorted[idx]
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let keyspace = Keyspace::new(&args.prefix).map_err(|e| e.to_string())?;
    let mut cfg = EtcdConfig::new(args.etcd.clone());
    if let Some(ca) = &args.cacert {
        let read = |p: &str| std::fs::read(p).map_err(|e| format!("{p}: {e}"));
        let identity = match (&args.cert, &args.key) {
            (Some(c), Some(k)) => Some((read(c)?, read(k)?)),
            _ => None,
        };
        cfg.tls = Some(meta::etcd::EtcdTls {
            ca_pem: read(ca)?,
            identity,
        });
    }
    // The pipeline is used only for its runtime and its connected backend: nothing is
    // submitted to it. It does reserve inode numbers on its own at start; let that commit
    // land first so it does not overlap the timed requests.
    let pipeline = Pipeline::start(
        Box::new(move || {
            Box::pin(async move {
                let b = EtcdBackend::connect(&cfg).await?;
                Ok(Arc::new(b) as Arc<dyn KvBackend>)
            })
        }),
        keyspace.clone(),
        SessionId(1),
        Arc::new(SystemClock::new()),
        Config::default(),
    )
    .map_err(|e| format!("connect to etcd {:?}: {e}", args.etcd))?;
    let runtime = pipeline.runtime();
    let backend = pipeline.backend();
    let client = pipeline.client();
    let settle = Instant::now();
    while client.stats().ino_blocks_reserved == 0 && settle.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(client);

    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos();
    let mut base = keyspace.root().to_vec();
    base.extend_from_slice(format!("bench-txn/{nonce}/").as_bytes());
    let keys = Arc::new(Keys { base });

    for kind in [Kind::Create, Kind::Get, Kind::Unlink] {
        let (tx, rx) = mpsc::channel::<TaskResult>();
        let start = Instant::now();
        for task in 0..args.concurrency {
            let (tx, backend, keys) = (tx.clone(), backend.clone(), keys.clone());
            let (ops, conc) = (args.ops, args.concurrency);
            runtime.spawn(async move {
                let mut lat = Vec::with_capacity(ops / conc + 1);
                let mut res = Ok(());
                for i in (task..ops).step_by(conc) {
                    let t0 = Instant::now();
                    if let Err(e) = one(&*backend, &keys, kind, i).await {
                        res = Err(format!("{} #{i}: {e}", kind.name()));
                        break;
                    }
                    lat.push(t0.elapsed().as_micros() as u64);
                }
                let _ = tx.send(res.map(|()| lat));
            });
        }
        drop(tx);
        let mut all = Vec::with_capacity(args.ops);
        for r in rx.iter() {
            all.extend(r?);
        }
        let secs = start.elapsed().as_secs_f64();
        if all.len() != args.ops {
            return Err(format!("{}: a task vanished", kind.name()));
        }
        all.sort_unstable();
        println!(
            "kind={} concurrency={} ops={} secs={:.3} ops_per_s={:.0} p50_us={} p99_us={}",
            kind.name(),
            args.concurrency,
            args.ops,
            secs,
            args.ops as f64 / secs,
            percentile(&all, 0.5),
            percentile(&all, 0.99),
        );
    }
    pipeline.shutdown();
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("etcd_txn: {e}");
        std::process::exit(1);
    }
}
