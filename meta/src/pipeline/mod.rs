//! The batching pipeline: handlers submit [`Mutation`]s and get [`Ticket`]s; one thread
//! with a small tokio runtime plans, groups and commits them to etcd. See the crate docs
//! for the model and `docs/pipeline.md` for the stages.

pub mod commit;
mod marker;
pub mod mutation;
pub mod own;
pub mod plan;
pub mod ticket;

#[cfg(test)]
mod plan_tests;

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    thread::JoinHandle,
};

use crossbeam_channel::{bounded, Sender, TrySendError};
use tokio::sync::Notify;

use self::{
    commit::{Request, Stamps},
    ticket::ticket,
};
pub use self::{
    mutation::{
        AclInherit, DevRange, ExtentsExpect, ExtentsKnown, GroupLayout, Mutation, NewInode,
        Outcome, RenameMode, SetAttr, TimeSet, UnlinkExpect, XattrMode, LOG_RELEASED_MAX,
    },
    own::{Origin, OwnCommits},
    plan::{plan, Plan, PlanCtx, Planned, Snapshot, EXTENTS_PER_MUTATION_MAX},
    ticket::Ticket,
};
use crate::{
    clock::Clock,
    codec::{Dentry, Extent, InodeAttr},
    error::{KvError, MetaError},
    keys::Keyspace,
    kv::{BoxFut, KvBackend, ETCD_REQUEST_BYTES_MAX, ETCD_TXN_OPS_MAX},
    reader::{self, DirNames, DirPage},
    session::{Session, SessionConfig},
    types::{Ino, Revision, SessionId},
};

/// Pipeline limits. Every queue and batch is bounded; the unit is in the name.
#[derive(Clone, Debug)]
pub struct Config {
    /// Ops per transaction branch (and compares), ≤ etcd's `--max-txn-ops`.
    pub batch_ops_max: usize,
    /// Estimated request bytes per transaction, ≤ etcd's `--max-request-bytes`.
    pub txn_bytes_max: usize,
    /// Commit transactions in flight at once. Few, so that mutations arriving while they
    /// are out gather into the next transaction (one etcd write and one raft entry for
    /// all of them) instead of each going alone the moment a slot is free.
    pub txns_in_flight_max: usize,
    /// Batched read transactions in flight at once.
    pub reads_in_flight_max: usize,
    /// Mutations waiting in the submission queue (submitters feel back-pressure here).
    pub submit_queue_max: usize,
    /// Mutations being planned, read, retried or committed at once.
    pub pending_max: usize,
    /// A directory's coalesced mtime/ctime is written at most once per this interval.
    pub flush_interval_ms: u64,
    /// Directories with a pending coalesced timestamp (past it, timestamps are written
    /// without coalescing).
    pub dir_touch_pending_max: usize,
    /// Times one mutation is re-planned/resent after compare failures.
    pub retries_max: u32,
    /// Inode numbers reserved per counter commit.
    pub ino_batch: u64,
    /// Filesystem block size in bytes (truncate frees whole blocks).
    pub block_size: u64,
    /// Reads (get/lookup/list) queued or running at once.
    pub reads_queued_max: usize,
    /// Where the allocation groups lie (released ranges are logged per group).
    pub groups: Option<GroupLayout>,
    /// The session is registered (its id is a lease, with a membership key): a create of
    /// a regular file takes its cache lock under that lease, and every transaction compares
    /// the membership key, so that nothing commits once the lease is gone.
    pub registered: bool,
    /// How long a read that etcd did not answer, or a commit whose answer was lost, is
    /// retried (and the lost answer decided, see `marker.rs`) before the mutation fails
    /// with `Unavailable`: long enough to ride out an etcd leader election.
    pub unanswered_budget: std::time::Duration,
    /// [`Config::unanswered_budget`] for a transaction holding a mutation whose failure
    /// fences the node ([`Mutation::fails_unsafe`]): etcd must stay unreachable for
    /// longer than the session's lease before such a fold is given up.
    pub unanswered_fold_budget: std::time::Duration,
    /// How long a registered session waits for a commit's answer before deciding it by
    /// its marker (a proposal lost with a dead leader is otherwise waited out for the
    /// whole request timeout).
    pub commit_answer_wait: std::time::Duration,
    /// A read-only mount: every mutation that would change the filesystem fails with
    /// [`MetaError::ReadOnly`] before it is queued (and, for the ones the pipeline makes
    /// itself, when planned); only open records come and go ([`Mutation::allowed_read_only`]).
    pub read_only: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            batch_ops_max: ETCD_TXN_OPS_MAX,
            txn_bytes_max: ETCD_REQUEST_BYTES_MAX,
            txns_in_flight_max: 2,
            reads_in_flight_max: 4,
            submit_queue_max: 4096,
            pending_max: 1024,
            flush_interval_ms: 1000,
            dir_touch_pending_max: 4096,
            retries_max: 32,
            ino_batch: 1024,
            block_size: 4096,
            reads_queued_max: 4096,
            groups: None,
            registered: false,
            // etcd_failover.sh saw applications stall up to 3.8 s through an election on
            // a quiet machine; 5 s let one under CI load end in EIO
            // (tests/etcd_cluster.rs, killing the leader under load).
            unanswered_budget: std::time::Duration::from_secs(8),
            unanswered_fold_budget: std::time::Duration::from_secs(60),
            commit_answer_wait: std::time::Duration::from_secs(2),
            read_only: false,
        }
    }
}

/// Counters for `etcfs stats`. Updated with relaxed atomics; read with [`Stats::snapshot`].
#[derive(Debug, Default)]
pub struct Stats {
    /// Commit transactions that succeeded.
    pub txns_committed: AtomicU64,
    /// Mutations completed successfully.
    pub mutations_committed: AtomicU64,
    /// Mutations completed with an error.
    pub mutations_failed: AtomicU64,
    /// Commit transactions whose compares failed.
    pub compare_failures: AtomicU64,
    /// Mutations resent or re-planned after a compare failure.
    pub retries: AtomicU64,
    /// Of those, mutations whose own compares had failed (re-planned).
    pub conflicted_mutations: AtomicU64,
    /// Batched read transactions.
    pub read_txns: AtomicU64,
    /// Transactions that failed with a backend error.
    pub txn_errors: AtomicU64,
    /// Directory timestamp updates absorbed by coalescing.
    pub touches_coalesced: AtomicU64,
    /// Coalesced timestamp writes issued.
    pub touches_written: AtomicU64,
    /// Inode-number blocks reserved.
    pub ino_blocks_reserved: AtomicU64,
    /// Mutations in committed transactions (sum, for the mean per txn).
    pub mutations_in_txns: AtomicU64,
    /// Largest number of mutations in one committed transaction.
    pub mutations_per_txn_max: AtomicU64,
    /// Histogram of mutations per committed txn: buckets 1, 2-3, 4-7, ..., 64-127, 128+.
    pub mutations_per_txn_hist: [AtomicU64; 8],
    /// Mutations currently inside the pipeline (gauge).
    pub pending: AtomicU64,
    /// Transactions in flight (gauge).
    pub txns_in_flight: AtomicU64,
    /// Commit transactions whose answer was lost (decided through their marker).
    pub txns_unanswered: AtomicU64,
    /// Of those, found committed.
    pub unanswered_applied: AtomicU64,
    /// Of those, given up and resent.
    pub unanswered_resent: AtomicU64,
    /// Reads retried after etcd did not answer.
    pub read_retries: AtomicU64,
    /// Idempotent writes outside the pipeline's commits (cache and fcntl locks, group
    /// claims, session and lease calls) sent again after etcd did not answer.
    pub write_retries: AtomicU64,
    /// Free-map writes that deleted released records and failed (each makes its groups'
    /// maps unsafe to write under the session).
    pub free_maps_failed: AtomicU64,
    /// The session (id) whose free maps are unsafe to write since such a failure; 0: none.
    /// Not in the snapshot: the filesystem reads it to fence that session.
    pub unsafe_maps_session: AtomicU64,
}

/// A plain copy of [`Stats`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// See [`Stats::txns_committed`].
    pub txns_committed: u64,
    /// See [`Stats::mutations_committed`].
    pub mutations_committed: u64,
    /// See [`Stats::mutations_failed`].
    pub mutations_failed: u64,
    /// See [`Stats::compare_failures`].
    pub compare_failures: u64,
    /// See [`Stats::retries`].
    pub retries: u64,
    /// See [`Stats::conflicted_mutations`].
    pub conflicted_mutations: u64,
    /// See [`Stats::read_txns`].
    pub read_txns: u64,
    /// See [`Stats::txn_errors`].
    pub txn_errors: u64,
    /// See [`Stats::touches_coalesced`].
    pub touches_coalesced: u64,
    /// See [`Stats::touches_written`].
    pub touches_written: u64,
    /// See [`Stats::ino_blocks_reserved`].
    pub ino_blocks_reserved: u64,
    /// See [`Stats::mutations_in_txns`].
    pub mutations_in_txns: u64,
    /// See [`Stats::mutations_per_txn_max`].
    pub mutations_per_txn_max: u64,
    /// See [`Stats::mutations_per_txn_hist`].
    pub mutations_per_txn_hist: [u64; 8],
    /// See [`Stats::pending`].
    pub pending: u64,
    /// See [`Stats::txns_in_flight`].
    pub txns_in_flight: u64,
    /// See [`Stats::txns_unanswered`].
    pub txns_unanswered: u64,
    /// See [`Stats::unanswered_applied`].
    pub unanswered_applied: u64,
    /// See [`Stats::unanswered_resent`].
    pub unanswered_resent: u64,
    /// See [`Stats::read_retries`].
    pub read_retries: u64,
    /// See [`Stats::write_retries`].
    pub write_retries: u64,
    /// See [`Stats::free_maps_failed`].
    pub free_maps_failed: u64,
}

impl StatsSnapshot {
    /// Mean mutations per committed transaction.
    pub fn mutations_per_txn(&self) -> f64 {
        if self.txns_committed == 0 {
            0.0
        } else {
            self.mutations_in_txns as f64 / self.txns_committed as f64
        }
    }
}

impl Stats {
    pub(crate) fn record_txn(&self, mutations: u64) {
        self.txns_committed.fetch_add(1, Ordering::Relaxed);
        self.mutations_in_txns
            .fetch_add(mutations, Ordering::Relaxed);
        self.mutations_per_txn_max
            .fetch_max(mutations, Ordering::Relaxed);
        let bucket = (63 - mutations.max(1).leading_zeros()).min(7) as usize;
        if let Some(b) = self.mutations_per_txn_hist.get(bucket) {
            b.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Copies the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            txns_committed: l(&self.txns_committed),
            mutations_committed: l(&self.mutations_committed),
            mutations_failed: l(&self.mutations_failed),
            compare_failures: l(&self.compare_failures),
            retries: l(&self.retries),
            conflicted_mutations: l(&self.conflicted_mutations),
            read_txns: l(&self.read_txns),
            txn_errors: l(&self.txn_errors),
            touches_coalesced: l(&self.touches_coalesced),
            touches_written: l(&self.touches_written),
            ino_blocks_reserved: l(&self.ino_blocks_reserved),
            mutations_in_txns: l(&self.mutations_in_txns),
            mutations_per_txn_max: l(&self.mutations_per_txn_max),
            mutations_per_txn_hist: std::array::from_fn(|i| {
                self.mutations_per_txn_hist.get(i).map_or(0, l)
            }),
            pending: l(&self.pending),
            txns_in_flight: l(&self.txns_in_flight),
            txns_unanswered: l(&self.txns_unanswered),
            unanswered_applied: l(&self.unanswered_applied),
            unanswered_resent: l(&self.unanswered_resent),
            read_retries: l(&self.read_retries),
            write_retries: l(&self.write_retries),
            free_maps_failed: l(&self.free_maps_failed),
        }
    }
}

pub use self::commit_types::Connect;

/// Starts a deferred pipeline's committer: its session id and group layout.
type StartCommitter = tokio::sync::oneshot::Sender<(SessionId, Option<GroupLayout>)>;

/// Where the pipeline's session id comes from.
enum SessionSource {
    Fixed(SessionId),
    /// Registered later ([`Pipeline::register_session`]); the committer starts then.
    Deferred(tokio::sync::oneshot::Receiver<(SessionId, Option<GroupLayout>)>),
}

mod commit_types {
    use super::*;
    /// A factory for the backend, run on the pipeline's runtime (etcd-client's channels
    /// must live on the runtime that drives them).
    pub type Connect =
        Box<dyn FnOnce() -> BoxFut<'static, Result<Arc<dyn KvBackend>, KvError>> + Send>;
}

/// A running watch over a filesystem's prefix (see [`MetaClient::watch_prefix`]).
pub struct PrefixWatch {
    rx: crossbeam_channel::Receiver<Result<Vec<crate::kv::WatchEvent>, KvError>>,
    closed: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for PrefixWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixWatch").finish_non_exhaustive()
    }
}

impl PrefixWatch {
    /// The next batch, waiting at most `timeout` (`Ok(None)` on timeout). After an error
    /// or once the pipeline is gone, the watch is over (`Err`).
    pub fn next(
        &self,
        timeout: std::time::Duration,
    ) -> Result<Option<Vec<crate::kv::WatchEvent>>, KvError> {
        match self.rx.recv_timeout(timeout) {
            Ok(Ok(b)) => Ok(Some(b)),
            Ok(Err(e)) => Err(e),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Ok(None),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                Err(KvError::Unavailable("watch closed".into()))
            }
        }
    }
}

impl Drop for PrefixWatch {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Release);
    }
}

/// The running pipeline: owns the thread. Drop or [`Pipeline::shutdown`] to stop it
/// (pending timestamps are written first).
pub struct Pipeline {
    client: Option<MetaClient>,
    thread: Option<JoinHandle<()>>,
    runtime: tokio::runtime::Handle,
    backend: Arc<dyn KvBackend>,
    clock: Arc<dyn Clock>,
    /// Starts the committer of a deferred pipeline once its session is registered.
    start_committer: std::sync::Mutex<Option<StartCommitter>>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline").finish_non_exhaustive()
    }
}

/// The submitters' handle. Cheap to clone; one per core.
#[derive(Clone)]
pub struct MetaClient {
    tx: Sender<Request>,
    notify: Arc<Notify>,
    stats: Arc<Stats>,
    own: Arc<OwnCommits>,
    keys: Keyspace,
    backend: Arc<dyn KvBackend>,
    runtime: tokio::runtime::Handle,
    reads_queued: Arc<AtomicU64>,
    reads_queued_max: u64,
    /// The session mutations are stamped with unless the caller names one.
    session: Arc<AtomicU64>,
    /// [`Config::read_only`].
    read_only: bool,
}

impl std::fmt::Debug for MetaClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaClient").finish_non_exhaustive()
    }
}

impl Pipeline {
    /// Starts the pipeline thread, connects the backend on it (bounded by the backend's
    /// own timeouts), and returns once it is ready.
    pub fn start(
        connect: Connect,
        keys: Keyspace,
        session: SessionId,
        clock: Arc<dyn Clock>,
        cfg: Config,
    ) -> Result<Pipeline, MetaError> {
        Self::start_inner(connect, keys, SessionSource::Fixed(session), clock, cfg)
    }

    /// Like [`Pipeline::start`], but first registers a node [`Session`] on the pipeline's
    /// runtime (so its keepalive runs there) and plans with that session's id. The
    /// filesystem uses this: orphan records and group fences need the session id before
    /// the first mutation.
    pub fn start_with_session(
        connect: Connect,
        keys: Keyspace,
        session_cfg: SessionConfig,
        clock: Arc<dyn Clock>,
        cfg: Config,
    ) -> Result<(Pipeline, Session), MetaError> {
        let p = Self::start_deferred(connect, keys, clock, cfg)?;
        let s = p.register_session(&session_cfg)?;
        Ok((p, s))
    }

    /// Connects the backend and serves reads, but commits nothing until
    /// [`Pipeline::register_session`]: a caller can check what etcd holds (is the prefix a
    /// filesystem?) before this node leaves any trace there. Mutations submitted before
    /// wait; dropping the pipeline unregistered discards them (`Closed`).
    pub fn start_deferred(
        connect: Connect,
        keys: Keyspace,
        clock: Arc<dyn Clock>,
        cfg: Config,
    ) -> Result<Pipeline, MetaError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let p = Self::start_inner(connect, keys, SessionSource::Deferred(rx), clock, cfg)?;
        *p.start_committer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(tx);
        Ok(p)
    }

    /// Registers this node's [`Session`] (a lease and its member key) and starts committing
    /// with its id. Only for a pipeline made by [`Pipeline::start_deferred`].
    pub fn register_session(&self, session_cfg: &SessionConfig) -> Result<Session, MetaError> {
        self.register_session_with(session_cfg, None)
    }

    /// [`Pipeline::register_session`], also setting [`Config::groups`] (known only once
    /// the caller has read the filesystem's geometry).
    pub fn register_session_with(
        &self,
        session_cfg: &SessionConfig,
        groups: Option<GroupLayout>,
    ) -> Result<Session, MetaError> {
        let mut slot = self
            .start_committer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tx = slot
            .take()
            .ok_or(MetaError::Invalid("the pipeline already has a session"))?;
        // Registered on the pipeline's runtime, so the keepalive task runs there; stamped
        // from now on, though the committer may not have started yet.
        match self
            .client()
            .register_session(session_cfg, self.clock.clone())
        {
            Ok(s) => {
                tx.send((s.id(), groups))
                    .map_err(|_| MetaError::Unavailable("pipeline thread died".into()))?;
                Ok(s)
            }
            Err(e) => {
                // Still unregistered: a later attempt may succeed.
                *slot = Some(tx);
                Err(e)
            }
        }
    }

    fn start_inner(
        connect: Connect,
        keys: Keyspace,
        session: SessionSource,
        clock: Arc<dyn Clock>,
        cfg: Config,
    ) -> Result<Pipeline, MetaError> {
        assert!(cfg.batch_ops_max >= 1 && cfg.batch_ops_max <= ETCD_TXN_OPS_MAX);
        assert!(cfg.txn_bytes_max <= ETCD_REQUEST_BYTES_MAX);
        assert!(cfg.txns_in_flight_max >= 1 && cfg.pending_max >= 1 && cfg.ino_batch >= 1);
        let (tx, rx) = bounded(cfg.submit_queue_max);
        let notify = Arc::new(Notify::new());
        let current = Arc::new(AtomicU64::new(match &session {
            SessionSource::Fixed(id) => id.0,
            SessionSource::Deferred(_) => 0,
        }));
        let current2 = current.clone();
        let stats = Arc::new(Stats::default());
        let own = Arc::new(OwnCommits::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let (n2, s2, k2, c2) = (notify.clone(), stats.clone(), keys.clone(), cfg.clone());
        let o2 = own.clone();
        let clock2 = clock.clone();
        let thread = std::thread::Builder::new()
            .name("etcfs-meta".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(MetaError::Unavailable(e.to_string())));
                        return;
                    }
                };
                let backend = match rt.block_on(connect()) {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.into()));
                        return;
                    }
                };
                // Everyone else's reads and idempotent writes ride out a short outage;
                // the committer decides its own (see commit.rs, marker.rs).
                let patient: Arc<dyn KvBackend> = Arc::new(crate::patient::Patient::new(
                    backend.clone(),
                    c2.unanswered_budget,
                    s2.clone(),
                ));
                let _ = ready_tx.send(Ok((rt.handle().clone(), patient)));
                let mut c2 = c2;
                let id = match session {
                    SessionSource::Fixed(id) => id,
                    // Reads spawned meanwhile run while this waits.
                    SessionSource::Deferred(start) => match rt.block_on(start) {
                        Ok((id, groups)) => {
                            if groups.is_some() {
                                c2.groups = groups;
                            }
                            c2.registered = true;
                            id
                        }
                        Err(_) => {
                            // Dropped unregistered: commit nothing, and answer `Closed` to
                            // whatever was or will be submitted (a dropped request answers
                            // so) until every client is gone. Without the runtime, later
                            // reads are dropped, which answers them too.
                            drop(rt);
                            for req in rx.iter() {
                                drop(req);
                            }
                            return;
                        }
                    },
                };
                current2.store(id.0, Ordering::Release);
                let committer =
                    commit::Committer::new(backend, k2, clock2, current2, c2, s2, rx, n2, o2);
                rt.block_on(committer.run());
            })
            .map_err(|e| MetaError::Unavailable(format!("spawn pipeline thread: {e}")))?;
        let (runtime, backend) = ready_rx
            .recv()
            .map_err(|_| MetaError::Unavailable("pipeline thread died".into()))??;
        let client = MetaClient {
            tx,
            notify,
            stats,
            own,
            keys: keys.clone(),
            backend: backend.clone(),
            runtime: runtime.clone(),
            reads_queued: Arc::new(AtomicU64::new(0)),
            reads_queued_max: cfg.reads_queued_max as u64,
            session: current,
            read_only: cfg.read_only,
        };
        Ok(Pipeline {
            client: Some(client),
            thread: Some(thread),
            runtime,
            backend,
            clock,
            start_committer: std::sync::Mutex::new(None),
        })
    }

    /// A submitter handle.
    pub fn client(&self) -> MetaClient {
        self.client
            .clone()
            .expect("client is only taken by shutdown, which consumes self")
    }

    /// The runtime the pipeline runs on (for the session's keepalive and watches).
    pub fn runtime(&self) -> tokio::runtime::Handle {
        self.runtime.clone()
    }

    /// The backend.
    pub fn backend(&self) -> Arc<dyn KvBackend> {
        self.backend.clone()
    }

    /// Writes pending timestamps, waits for everything submitted, stops the thread.
    /// Clients still held elsewhere see `Closed` from then on.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let unregistered = self
            .start_committer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .is_some();
        if unregistered {
            // Dropping the sender ends the thread; nothing was or will be committed, and a
            // flush would wait for a committer that never runs.
            self.client = None;
            return;
        }
        if let Some(c) = self.client.take() {
            if let Ok(t) = c.flush(None) {
                let _ = t.wait();
            }
            drop(c);
        }
        // The thread exits when every sender is gone; other clones may still exist, so
        // we only wait when we were the last one (join would otherwise block).
        if let Some(t) = self.thread.take() {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.stop();
    }
}

impl MetaClient {
    fn send(&self, r: Request, block: bool) -> Result<(), MetaError> {
        if let Request::Mutate { m, .. } = &r {
            if self.read_only && !m.allowed_read_only() {
                return Err(MetaError::ReadOnly);
            }
        }
        let res = if block {
            self.tx.send(r).map_err(|_| MetaError::Closed)
        } else {
            self.tx.try_send(r).map_err(|e| match e {
                TrySendError::Full(_) => MetaError::QueueFull,
                TrySendError::Disconnected(_) => MetaError::Closed,
            })
        };
        if res.is_ok() {
            self.notify.notify_one();
        }
        res
    }

    /// The session mutations commit under unless their submitter names another.
    pub fn session(&self) -> SessionId {
        SessionId(self.session.load(Ordering::Acquire))
    }

    /// Makes `s` the session of mutations submitted from now on (a node that lost its
    /// lease registered a new one). Work submitted under the old one still commits under
    /// it or fails (`MetaError::SessionLost`).
    pub fn set_session(&self, s: SessionId) {
        self.session.store(s.0, Ordering::Release);
    }

    /// Registers a new [`Session`] on the pipeline's runtime (its keepalive runs there)
    /// and makes it current.
    pub fn register_session(
        &self,
        cfg: &SessionConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Session, MetaError> {
        let (kv, keys, scfg) = (self.backend.clone(), self.keys.clone(), cfg.clone());
        let (done_tx, done_rx) = std::sync::mpsc::sync_channel(1);
        self.runtime.spawn(async move {
            let _ = done_tx.send(Session::register(kv, keys, &scfg, clock).await);
        });
        let s = done_rx
            .recv()
            .map_err(|_| MetaError::Unavailable("pipeline thread died".into()))??;
        self.set_session(s.id());
        Ok(s)
    }

    /// Submits a mutation without blocking; `QueueFull` when the submission queue is at
    /// `submit_queue_max` (the caller parks the request and retries).
    pub fn submit(&self, m: Mutation) -> Result<Ticket<Outcome>, MetaError> {
        let (t, done) = ticket();
        let session = self.session();
        self.send(Request::Mutate { m, session, done }, false)?;
        Ok(t)
    }

    /// Submits a mutation, blocking while the queue is full (back-pressure).
    pub fn submit_blocking(&self, m: Mutation) -> Result<Ticket<Outcome>, MetaError> {
        self.submit_as(m, self.session())
    }

    /// [`MetaClient::submit_blocking`] for work begun under `session`: it commits under
    /// that session or fails with `SessionLost`.
    pub fn submit_as(&self, m: Mutation, session: SessionId) -> Result<Ticket<Outcome>, MetaError> {
        let (t, done) = ticket();
        self.send(Request::Mutate { m, session, done }, true)?;
        Ok(t)
    }

    /// Submits and waits for the commit.
    pub fn commit(&self, m: Mutation) -> Result<Outcome, MetaError> {
        self.submit_blocking(m)?.wait()
    }

    /// [`MetaClient::commit`] under `session` (see [`MetaClient::submit_as`]).
    pub fn commit_as(&self, m: Mutation, session: SessionId) -> Result<Outcome, MetaError> {
        self.submit_as(m, session)?.wait()
    }

    /// A flush barrier: completes when every mutation submitted before it has completed
    /// and the coalesced timestamps they caused (of `dir`, or all) are written.
    /// For fsync on a directory, syncfs and unmount.
    pub fn flush(&self, dir: Option<Ino>) -> Result<Ticket<()>, MetaError> {
        self.flush_expecting(dir, None)
    }

    /// [`MetaClient::flush`] of one directory, whose coalesced timestamps are written
    /// from `expect` (its inode exactly as the caller's caches hold it, compared by value)
    /// instead of being read first: an fsync of a directory in one round trip.
    pub fn flush_expecting(
        &self,
        dir: Option<Ino>,
        expect: Option<InodeAttr>,
    ) -> Result<Ticket<()>, MetaError> {
        let (t, done) = ticket();
        let request = Request::Flush {
            stamps: dir.map_or(Stamps::All, Stamps::Of),
            expect: expect.map(Box::new),
            done,
        };
        self.send(request, true)?;
        Ok(t)
    }

    /// A flush barrier that writes no coalesced timestamps: completes when every mutation
    /// submitted before it has completed. For fdatasync of a directory, whose data are its
    /// entries (which those mutations write) and whose timestamps a data sync need not
    /// make durable.
    pub fn flush_mutations(&self) -> Result<Ticket<()>, MetaError> {
        let (t, done) = ticket();
        let request = Request::Flush {
            stamps: Stamps::None,
            expect: None,
            done,
        };
        self.send(request, true)?;
        Ok(t)
    }

    /// The session whose free maps may not be written any more: a write of them that
    /// deleted released records failed ([`MetaError::UnsafeFreeMap`]). The filesystem
    /// fences that session.
    pub fn unsafe_maps_session(&self) -> Option<SessionId> {
        match self.stats.unsafe_maps_session.load(Ordering::Acquire) {
            0 => None,
            s => Some(SessionId(s)),
        }
    }

    /// The pipeline's counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// The revisions of this node's own commits, for a watch on the prefix.
    pub fn own_commits(&self) -> &Arc<OwnCommits> {
        &self.own
    }

    /// The key space.
    pub fn keys(&self) -> &Keyspace {
        &self.keys
    }

    /// Runs a read on the pipeline's runtime; the ticket completes with its result.
    /// Reads are bounded by `reads_queued_max` (`QueueFull` beyond it).
    pub fn read<T, F>(&self, f: F) -> Result<Ticket<T>, MetaError>
    where
        T: Send + 'static,
        F: FnOnce(Arc<dyn KvBackend>, Keyspace) -> BoxFut<'static, Result<T, MetaError>>
            + Send
            + 'static,
    {
        if self.reads_queued.fetch_add(1, Ordering::AcqRel) >= self.reads_queued_max {
            self.reads_queued.fetch_sub(1, Ordering::AcqRel);
            return Err(MetaError::QueueFull);
        }
        let (t, done) = ticket();
        let (kv, keys, queued) = (
            self.backend.clone(),
            self.keys.clone(),
            self.reads_queued.clone(),
        );
        self.runtime.spawn(async move {
            let r = f(kv, keys).await;
            queued.fetch_sub(1, Ordering::AcqRel);
            done.complete(r);
        });
        Ok(t)
    }

    /// Reads an inode's attributes (None if absent) and their revision.
    pub fn get_inode(&self, ino: Ino) -> Result<Ticket<Option<(InodeAttr, Revision)>>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(async move { reader::get_inode(&*kv, &keys, ino).await })
        })
    }

    /// Reads an inode's attributes with the store revision of the read.
    pub fn get_inode_at(
        &self,
        ino: Ino,
    ) -> Result<Ticket<(Option<InodeAttr>, Revision)>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(async move { reader::get_inode_at(&*kv, &keys, ino).await })
        })
    }

    /// Reads an inode's attributes and the first `limit` extents of its map at one
    /// revision.
    pub fn get_inode_with_extents_at(
        &self,
        ino: Ino,
        limit: usize,
    ) -> Result<Ticket<reader::InodeWithExtents>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(async move { reader::inode_with_extents_at(&*kv, &keys, ino, limit).await })
        })
    }

    /// Looks up a name, with the store revision of the read.
    pub fn lookup_at(
        &self,
        parent: Ino,
        name: Vec<u8>,
    ) -> Result<Ticket<(Option<Dentry>, Revision)>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(async move { reader::lookup_at(&*kv, &keys, parent, &name).await })
        })
    }

    /// The store's current revision.
    pub fn revision(&self) -> Result<Ticket<Revision>, MetaError> {
        self.read(|kv, keys| Box::pin(async move { reader::revision(&*kv, &keys).await }))
    }

    /// Watches every key of this filesystem from revision `from` (0 = from now on). The
    /// batches (one per revision, in order) arrive on a bounded channel that a plain thread
    /// can block on; an error (`Compacted` when `from` is no longer in etcd's history,
    /// `Unavailable` when the stream broke) is the last item. Dropping the [`PrefixWatch`]
    /// cancels the watch.
    pub fn watch_prefix(&self, from: Revision) -> PrefixWatch {
        let (tx, rx) = bounded(crate::kv::WATCH_BATCHES_MAX);
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (kv, range, stop) = (self.backend.clone(), self.keys.all(), closed.clone());
        self.runtime.spawn(async move {
            let send = |item: Result<Vec<crate::kv::WatchEvent>, KvError>| {
                let tx = tx.clone();
                let stop = stop.clone();
                async move {
                    let mut item = item;
                    loop {
                        match tx.try_send(item) {
                            Ok(()) => return true,
                            Err(TrySendError::Disconnected(_)) => return false,
                            Err(TrySendError::Full(back)) => {
                                if stop.load(Ordering::Acquire) {
                                    return false;
                                }
                                item = back;
                                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                            }
                        }
                    }
                }
            };
            let mut stream = match kv.watch(range.start, range.end, from.0).await {
                Ok(s) => s,
                Err(e) => {
                    send(Err(e)).await;
                    return;
                }
            };
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
            loop {
                tokio::select! {
                    msg = stream.recv() => {
                        let item = msg.unwrap_or_else(|| {
                            Err(KvError::Unavailable("watch stream ended".into()))
                        });
                        let end = item.is_err();
                        if !send(item).await || end {
                            return;
                        }
                    }
                    _ = tick.tick() => {
                        if stop.load(Ordering::Acquire) {
                            return;
                        }
                    }
                }
            }
        });
        PrefixWatch { rx, closed }
    }

    /// Looks up a name.
    pub fn lookup(&self, parent: Ino, name: Vec<u8>) -> Result<Ticket<Option<Dentry>>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(async move { reader::lookup(&*kv, &keys, parent, &name).await })
        })
    }

    /// Lists a page of a directory after `after`.
    pub fn list_dir(
        &self,
        parent: Ino,
        after: Option<Vec<u8>>,
        limit: usize,
    ) -> Result<Ticket<DirPage>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(
                async move { reader::list_dir(&*kv, &keys, parent, after.as_deref(), limit).await },
            )
        })
    }

    /// Reads a directory's whole name set in one range, or `OverLimit` past `limit`.
    pub fn dir_names(&self, parent: Ino, limit: usize) -> Result<Ticket<DirNames>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(async move { reader::dir_names(&*kv, &keys, parent, limit).await })
        })
    }

    /// Reads up to `limit` extents from file offset `from`.
    pub fn extents(
        &self,
        ino: Ino,
        from: u64,
        limit: usize,
    ) -> Result<Ticket<(Vec<Extent>, bool)>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(async move { reader::extents(&*kv, &keys, ino, from, limit).await })
        })
    }

    /// Reads a directory's parent (`P<dir>`; the root is its own parent).
    pub fn dir_parent(&self, dir: Ino) -> Result<Ticket<Option<Ino>>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(async move { reader::dir_parent(&*kv, &keys, dir).await })
        })
    }

    /// Reads a symlink target.
    pub fn readlink(&self, ino: Ino) -> Result<Ticket<Option<Vec<u8>>>, MetaError> {
        self.read(move |kv, keys| Box::pin(async move { reader::readlink(&*kv, &keys, ino).await }))
    }

    /// Reads one xattr.
    pub fn get_xattr(&self, ino: Ino, name: Vec<u8>) -> Result<Ticket<Option<Vec<u8>>>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(async move { reader::get_xattr(&*kv, &keys, ino, &name).await })
        })
    }

    /// Lists xattr names.
    pub fn list_xattrs(&self, ino: Ino, limit: usize) -> Result<Ticket<Vec<Vec<u8>>>, MetaError> {
        self.read(move |kv, keys| {
            Box::pin(async move { reader::list_xattrs(&*kv, &keys, ino, limit).await })
        })
    }
}
