//! The committer: the pipeline thread's single task.
//!
//! Stages (all in this one task, joined by bounded queues): intake (the submission
//! channel) → plan (pure, [`super::plan::plan`]) → read (batched range reads for plans
//! that need them) → group (pack independent plans into one txn) → commit (several txns
//! in flight) → settle (complete tickets, refresh or re-plan conflicted mutations,
//! register coalesced directory timestamps).

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use crossbeam_channel::{Receiver, TryRecvError};
use tokio::{sync::Notify, task::JoinSet};

use super::{
    marker::{self, Markers, Resolution},
    mutation::{Mutation, Outcome},
    own::{changed_something, OwnCommits},
    plan::{freed_from_kvs, plan, Plan, PlanCtx, Planned, Snapshot, EXTENTS_PER_MUTATION_MAX},
    ticket::Completer,
    Config, Stats,
};
use crate::{
    clock::Clock,
    codec::InodeAttr,
    error::{KvError, MetaError},
    keys::Keyspace,
    kv::{
        ranges_overlap, Compare, CompareOp, CompareTarget, KvBackend, RangeRequest, Txn, TxnOp,
        TxnOpResponse, TxnResponse,
    },
    types::{GroupId, Ino, Revision, SessionId, Timespec},
};

/// A request from a submitter.
pub(crate) enum Request {
    Mutate {
        m: Mutation,
        /// The session the submitter worked under: the mutation commits under it or not
        /// at all (`MetaError::SessionLost`).
        session: SessionId,
        done: Completer<Outcome>,
    },
    Flush {
        stamps: Stamps,
        /// The directory's attributes exactly as the submitter's caches hold them: its
        /// timestamp write plans from them instead of reading (see `Mutation::Touch`).
        expect: Option<Box<InodeAttr>>,
        done: Completer<()>,
    },
}

/// The coalesced timestamps a flush barrier writes besides waiting for the mutations
/// before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stamps {
    All,
    /// Those of one directory (its fsync).
    Of(Ino),
    /// None (fdatasync of a directory).
    None,
}

impl Stamps {
    fn cover(self, ino: Ino) -> bool {
        match self {
            Stamps::All => true,
            Stamps::Of(d) => d == ino,
            Stamps::None => false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AKind {
    /// Depends only on whether the key exists.
    ReadExist,
    /// Depends on the key's value/revision.
    ReadValue,
    /// Rewrites an existing key (existence unchanged).
    WriteValue,
    /// Creates or deletes keys.
    WriteExist,
}

#[derive(Clone, Debug)]
struct Access {
    start: Vec<u8>,
    end: Option<Vec<u8>>,
    kind: AKind,
}

fn accesses(p: &Plan) -> Vec<Access> {
    let mut out = Vec::with_capacity(p.compares.len() + p.ops.len());
    for c in &p.compares {
        let exist_only = c.range_end.is_none() && matches!(c.target, CompareTarget::Version(0));
        out.push(Access {
            start: c.key.clone(),
            end: c.range_end.clone(),
            kind: if exist_only {
                AKind::ReadExist
            } else {
                AKind::ReadValue
            },
        });
    }
    for op in &p.ops {
        match op {
            TxnOp::Put(put) => {
                let known_existing = p.compares.iter().any(|c| {
                    c.key == put.key
                        && c.range_end.is_none()
                        && c.op == CompareOp::Equal
                        && match &c.target {
                            CompareTarget::ModRevision(r) => *r > 0,
                            // A value compare fails on an absent key.
                            CompareTarget::Value(_) => true,
                            _ => false,
                        }
                });
                out.push(Access {
                    start: put.key.clone(),
                    end: None,
                    kind: if known_existing {
                        AKind::WriteValue
                    } else {
                        AKind::WriteExist
                    },
                });
            }
            TxnOp::Delete(d) => out.push(Access {
                start: d.key.clone(),
                end: d.range_end.clone(),
                kind: AKind::WriteExist,
            }),
            TxnOp::Range(_) => {}
        }
    }
    out
}

fn kinds_conflict(a: AKind, b: AKind) -> bool {
    use AKind::*;
    // Reads never conflict with reads; an existence check does not conflict with a
    // rewrite of an existing key. Everything else does.
    !matches!(
        (a, b),
        (ReadExist | ReadValue, ReadExist | ReadValue)
            | (ReadExist, WriteValue)
            | (WriteValue, ReadExist)
    )
}

fn conflict(a: &[Access], b: &[Access]) -> bool {
    a.iter().any(|x| {
        b.iter().any(|y| {
            kinds_conflict(x.kind, y.kind)
                && ranges_overlap(&x.start, x.end.as_deref(), &y.start, y.end.as_deref())
        })
    })
}

enum St {
    /// Needs (re-)planning.
    Plan,
    /// Waiting for a batched read.
    Reading,
    /// Planned, waiting for a transaction slot.
    Ready(Box<Plan>, Vec<Access>),
    /// In a transaction in flight.
    InFlight,
}

struct Work {
    m: Mutation,
    session: SessionId,
    done: Option<Completer<Outcome>>,
    snap: Snapshot,
    /// Revision every snapshot entry was read at (0: nothing read yet). Later reads of
    /// the same plan are made at this revision so the snapshot is one consistent view.
    snap_rev: i64,
    ino: Option<Ino>,
    attempts: u32,
    /// Must be alone in its transaction (a grouped send was rejected as too large).
    solo: bool,
    /// Until when (monotonic) reads that etcd did not answer are retried; set at the
    /// first such failure.
    retry_until: Option<Duration>,
    /// Not planned again before this (monotonic): a pause between retried reads.
    not_before: Duration,
    st: St,
    needs: Vec<RangeRequest>,
}

struct Member {
    id: u64,
    op_start: usize,
    plan: Plan,
    accesses: Vec<Access>,
}

enum TaskDone {
    Read {
        reqs: Vec<(u64, RangeRequest)>,
        result: Result<ReadBatch, KvError>,
    },
    Txn {
        members: Vec<Member>,
        failure_reqs: Vec<RangeRequest>,
        sent: Sent,
        result: Result<TxnResponse, KvError>,
    },
    /// A lost answer decided (see `marker.rs`).
    Resolved {
        members: Vec<Member>,
        sent: Sent,
        result: Result<Resolution, KvError>,
    },
}

/// What a commit transaction carried besides its members' operations.
#[derive(Clone, Copy)]
struct Sent {
    session: SessionId,
    /// Its marker's number (registered sessions only).
    marker: Option<u64>,
    /// It deleted the session's markers below this.
    cleaned_below: Option<u64>,
}

struct TouchEntry {
    mtime: Option<Timespec>,
    ctime: Timespec,
    due: Duration,
    /// Smallest work id whose commit contributed (flush barriers wait for those).
    min_id: u64,
}

struct Barrier {
    limit: u64,
    extra: Vec<u64>,
    stamps: Stamps,
    /// What the submitter expects the directory of `Stamps::Of` to hold.
    expect: Option<Box<InodeAttr>>,
    done: Option<Completer<()>>,
}

enum Ev {
    Wake,
    Task(Option<Result<TaskDone, tokio::task::JoinError>>),
    Tick,
}

/// Pause before a read that etcd did not answer is tried again.
const READ_RETRY_PAUSE: Duration = Duration::from_millis(100);

pub(crate) struct Committer {
    pub(crate) kv: Arc<dyn KvBackend>,
    pub(crate) keys: Keyspace,
    pub(crate) clock: Arc<dyn Clock>,
    /// The session current mutations commit under (the node registers a new one after
    /// losing its lease; `MetaClient::set_session`).
    pub(crate) session: Arc<AtomicU64>,
    pub(crate) cfg: Config,
    pub(crate) stats: Arc<Stats>,
    pub(crate) rx: Receiver<Request>,
    pub(crate) notify: Arc<Notify>,
    pub(crate) own: Arc<OwnCommits>,
    next_id: u64,
    works: BTreeMap<u64, Work>,
    pool: VecDeque<(u64, u64)>,
    reserving: bool,
    /// Whether any mutation has needed an inode number yet (reservation is lazy).
    inos_wanted: bool,
    touches: HashMap<Ino, TouchEntry>,
    barriers: Vec<Barrier>,
    tasks: JoinSet<TaskDone>,
    txns_in_flight: usize,
    reads_in_flight: usize,
    inflight: Vec<(u64, Vec<Access>)>,
    markers: Markers,
    /// Groups whose free map must not be written again under the session: a write of it
    /// that also deleted released records (`R`) failed. The node's map already treats
    /// those records' blocks as free and may hand them out, while etcd still has the
    /// records, which the group's next loader applies: a later map write committing such
    /// an allocation would let that load free blocks in use. At most one entry a group.
    unsafe_maps: BTreeMap<GroupId, SessionId>,
    /// Origin of the committer's own timers (retry pauses, marker holds): tokio's time,
    /// which runs in simulations with a manual filesystem clock too.
    epoch: tokio::time::Instant,
    closed: bool,
}

impl Committer {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        kv: Arc<dyn KvBackend>,
        keys: Keyspace,
        clock: Arc<dyn Clock>,
        session: Arc<AtomicU64>,
        cfg: Config,
        stats: Arc<Stats>,
        rx: Receiver<Request>,
        notify: Arc<Notify>,
        own: Arc<OwnCommits>,
    ) -> Self {
        Committer {
            kv,
            keys,
            clock,
            session,
            cfg,
            stats,
            rx,
            notify,
            own,
            next_id: 1,
            works: BTreeMap::new(),
            pool: VecDeque::new(),
            reserving: false,
            inos_wanted: false,
            touches: HashMap::new(),
            barriers: Vec::new(),
            tasks: JoinSet::new(),
            txns_in_flight: 0,
            reads_in_flight: 0,
            inflight: Vec::new(),
            unsafe_maps: BTreeMap::new(),
            markers: Markers::default(),
            epoch: tokio::time::Instant::now(),
            closed: false,
        }
    }

    pub(crate) async fn run(mut self) {
        let period = Duration::from_millis((self.cfg.flush_interval_ms / 4).clamp(1, 250));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let notify = self.notify.clone();
        loop {
            self.intake();
            self.step();
            self.check_barriers();
            if self.closed
                && self.works.is_empty()
                && self.tasks.is_empty()
                && self.touches.is_empty()
            {
                break;
            }
            let ev = tokio::select! {
                () = notify.notified() => Ev::Wake,
                r = self.tasks.join_next(), if !self.tasks.is_empty() => Ev::Task(r),
                _ = tick.tick() => Ev::Tick,
            };
            match ev {
                Ev::Wake => {}
                Ev::Task(Some(Ok(done))) => self.on_task(done),
                Ev::Task(Some(Err(e))) => log::error!("pipeline task failed: {e}"),
                Ev::Task(None) => {}
                Ev::Tick => self.on_tick(),
            }
        }
        // Anything left (only possible if tasks panicked) is answered by Completer drops.
    }

    /// Operations (and compares) a transaction's members may use: a registered session's
    /// transactions also compare its member key and carry its commit marker (a compare,
    /// a put and sometimes a range delete).
    fn ops_room(&self) -> usize {
        let own = if self.cfg.registered { 2 } else { 0 };
        self.cfg.batch_ops_max.saturating_sub(own).max(1)
    }

    /// Time since the committer started, for its own timers.
    fn elapsed(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn current_session(&self) -> SessionId {
        SessionId(self.session.load(Ordering::Acquire))
    }

    fn add_work(
        &mut self,
        m: Mutation,
        session: Option<SessionId>,
        done: Option<Completer<Outcome>>,
    ) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let session = session.unwrap_or_else(|| self.current_session());
        self.works.insert(
            id,
            Work {
                m,
                session,
                done,
                snap: Snapshot::default(),
                snap_rev: 0,
                ino: None,
                attempts: 0,
                solo: false,
                retry_until: None,
                not_before: Duration::ZERO,
                st: St::Plan,
                needs: Vec::new(),
            },
        );
        id
    }

    /// A mutation of the pipeline's own (timestamps, inode numbers), under the current
    /// session.
    fn add_work_now(&mut self, m: Mutation) -> u64 {
        self.add_work(m, None, None)
    }

    fn intake(&mut self) {
        while self.works.len() < self.cfg.pending_max {
            match self.rx.try_recv() {
                Ok(Request::Mutate { m, session, done }) => {
                    self.add_work(m, Some(session), Some(done));
                }
                Ok(Request::Flush {
                    stamps,
                    expect,
                    done,
                }) => {
                    let limit = self.next_id;
                    let mut b = Barrier {
                        limit,
                        extra: Vec::new(),
                        stamps,
                        expect,
                        done: Some(done),
                    };
                    // Timestamps already pending are written now, not at their interval.
                    let due: Vec<Ino> = self
                        .touches
                        .keys()
                        .copied()
                        .filter(|&i| stamps.cover(i))
                        .collect();
                    for ino in due {
                        if let Some(id) = self.emit_touch(ino, b.expect.clone()) {
                            b.extra.push(id);
                        }
                    }
                    self.barriers.push(b);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    if !self.closed {
                        self.closed = true;
                        // Unmount: write every pending timestamp before exiting.
                        let all: Vec<Ino> = self.touches.keys().copied().collect();
                        for ino in all {
                            self.emit_touch(ino, None);
                        }
                    }
                    break;
                }
            }
        }
        self.stats
            .pending
            .store(self.works.len() as u64, Ordering::Relaxed);
    }

    /// Writes the coalesced timestamps of `ino`, planned from `expect` (its inode as a
    /// submitter's caches hold it) when that is about `ino`.
    fn emit_touch(&mut self, ino: Ino, expect: Option<Box<InodeAttr>>) -> Option<u64> {
        let e = self.touches.remove(&ino)?;
        self.stats.touches_written.fetch_add(1, Ordering::Relaxed);
        // Coalesced timestamps answer nobody: they go under whichever session is current.
        Some(self.add_work_now(Mutation::Touch {
            ino,
            mtime: e.mtime,
            ctime: e.ctime,
            expect: expect.filter(|a| a.ino == ino),
        }))
    }

    /// Coalesces a timestamp; returns the time that will be written for it.
    fn touch(&mut self, ino: Ino, mtime: bool, id: u64) -> Timespec {
        let now = self.clock.wall();
        if let Some(e) = self.touches.get_mut(&ino) {
            if mtime {
                e.mtime = Some(e.mtime.map_or(now, |m| m.max(now)));
            }
            e.ctime = e.ctime.max(now);
            e.min_id = e.min_id.min(id);
            self.stats.touches_coalesced.fetch_add(1, Ordering::Relaxed);
            return now;
        }
        let entry = TouchEntry {
            mtime: mtime.then_some(now),
            ctime: now,
            due: self.clock.mono() + Duration::from_millis(self.cfg.flush_interval_ms),
            min_id: id,
        };
        self.touches.insert(ino, entry);
        if self.touches.len() > self.cfg.dir_touch_pending_max {
            // Bounded: past the limit, write this one now instead of coalescing.
            self.emit_touch(ino, None);
        }
        now
    }

    fn on_tick(&mut self) {
        let now = self.clock.mono();
        let due: Vec<Ino> = self
            .touches
            .iter()
            .filter(|(_, e)| e.due <= now)
            .map(|(&i, _)| i)
            .collect();
        for ino in due {
            self.emit_touch(ino, None);
        }
    }

    fn check_barriers(&mut self) {
        let mut i = 0;
        while i < self.barriers.len() {
            let Some(b) = self.barriers.get(i) else { break };
            let (limit, stamps, expect) = (b.limit, b.stamps, b.expect.clone());
            let earlier_pending = self.works.range(..limit).next().is_some();
            if earlier_pending {
                i += 1;
                continue;
            }
            // Timestamps registered by mutations the barrier covers are written too.
            let owed: Vec<Ino> = self
                .touches
                .iter()
                .filter(|(&ino, e)| e.min_id < limit && stamps.cover(ino))
                .map(|(&ino, _)| ino)
                .collect();
            let mut new_ids = Vec::new();
            for ino in owed {
                if let Some(id) = self.emit_touch(ino, expect.clone()) {
                    new_ids.push(id);
                }
            }
            let works = &self.works;
            let Some(b) = self.barriers.get_mut(i) else {
                break;
            };
            b.extra.extend(new_ids);
            b.extra.retain(|id| works.contains_key(id));
            if b.extra.is_empty() {
                if let Some(done) = b.done.take() {
                    done.complete(Ok(()));
                }
                self.barriers.remove(i);
            } else {
                i += 1;
            }
        }
    }

    fn pool_take(&mut self) -> Option<Ino> {
        let (start, end) = self.pool.front_mut()?;
        let ino = *start;
        *start += 1;
        if start == end {
            self.pool.pop_front();
        }
        Some(Ino(ino))
    }

    fn pool_left(&self) -> u64 {
        self.pool.iter().map(|(s, e)| e - s).sum()
    }

    fn step(&mut self) {
        self.refuse_unsafe_maps();
        self.plan_all();
        self.launch_reads();
        self.launch_txns();
    }

    /// Fails every work not sent yet that would write a free map made unsafe under its
    /// session (see `unsafe_maps`).
    fn refuse_unsafe_maps(&mut self) {
        if self.unsafe_maps.is_empty() {
            return;
        }
        let refused: Vec<(u64, GroupId)> = self
            .works
            .iter()
            .filter(|(_, w)| matches!(w.st, St::Plan | St::Reading | St::Ready(..)))
            .filter_map(|(&id, w)| {
                w.m.free_map_groups()
                    .find(|g| self.unsafe_maps.get(g) == Some(&w.session))
                    .map(|g| (id, g))
            })
            .collect();
        for (id, g) in refused {
            self.finish(id, Err(MetaError::UnsafeFreeMap { group: g.0 }));
        }
    }

    /// Marks the groups of a failed free-map write that deleted released records as
    /// unsafe to write under its session.
    fn note_failed_free_maps(&mut self, w: &Work, e: &MetaError) {
        let Mutation::FreeMaps { maps, released } = &w.m else {
            return;
        };
        if !w.m.fails_unsafe() || matches!(e, MetaError::UnsafeFreeMap { .. }) {
            return;
        }
        // Entries of an older session are moot: it commits nothing any more.
        self.unsafe_maps.retain(|_, s| *s == w.session);
        for (g, _) in maps {
            self.unsafe_maps.insert(*g, w.session);
        }
        self.stats.free_maps_failed.fetch_add(1, Ordering::Relaxed);
        self.stats
            .unsafe_maps_session
            .store(w.session.0, Ordering::Release);
        log::error!(
            "writing the free maps of groups {:?} with {} released records' deletes failed: \
             {e}; no more writes of those maps under session {:x} (the node fences itself)",
            maps.iter().map(|(g, _)| g.0).collect::<Vec<_>>(),
            released.len(),
            w.session.0
        );
    }

    fn finish(&mut self, id: u64, r: Result<Outcome, MetaError>) {
        if let Some(w) = self.works.remove(&id) {
            if let Err(e) = &r {
                self.note_failed_free_maps(&w, e);
            }
            match &r {
                Ok(_) => self
                    .stats
                    .mutations_committed
                    .fetch_add(1, Ordering::Relaxed),
                Err(_) => self.stats.mutations_failed.fetch_add(1, Ordering::Relaxed),
            };
            if let Mutation::ReserveInos { .. } = w.m {
                self.reserving = false;
                match &r {
                    Ok(o) => {
                        if let Some(range) = o.inos {
                            self.pool.push_back(range);
                            self.stats
                                .ino_blocks_reserved
                                .fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(e) => log::warn!("inode number reservation failed: {e}"),
                }
            }
            if let Some(done) = w.done {
                done.complete(r);
            }
        }
    }

    fn plan_all(&mut self) {
        // Keep a reservation ahead of demand so creates rarely wait for one, but only
        // once something has asked for an inode number: a pipeline that never creates
        // (a refused mount, mkfs, a read-only user) writes nothing to etcd.
        let waiting_inos = self
            .works
            .values()
            .filter(|w| w.m.needs_ino() && w.ino.is_none())
            .count() as u64;
        self.inos_wanted |= waiting_inos > 0;
        if self.inos_wanted
            && !self.reserving
            && self.pool_left() < self.cfg.ino_batch / 4 + waiting_inos
        {
            self.reserving = true;
            self.add_work_now(Mutation::ReserveInos {
                count: self.cfg.ino_batch,
            });
        }
        let mono = self.elapsed();
        let ids: Vec<u64> = self
            .works
            .iter()
            .filter(|(_, w)| matches!(w.st, St::Plan) && w.not_before <= mono)
            .map(|(&id, _)| id)
            .collect();
        let now = self.clock.wall();
        let room = self.ops_room();
        let bytes_max = self.cfg.txn_bytes_max;
        for id in ids {
            let needs_ino = self
                .works
                .get(&id)
                .is_some_and(|w| w.m.needs_ino() && w.ino.is_none());
            if needs_ino {
                match self.pool_take() {
                    Some(ino) => {
                        if let Some(w) = self.works.get_mut(&id) {
                            w.ino = Some(ino);
                        }
                    }
                    None => continue,
                }
            }
            let Some(w) = self.works.get_mut(&id) else {
                continue;
            };
            let ctx = PlanCtx {
                keys: &self.keys,
                now,
                session: w.session,
                new_ino: w.ino,
                block_size: self.cfg.block_size,
                groups: self.cfg.groups,
                lock_at_create: self.cfg.registered,
                read_only: self.cfg.read_only,
            };
            let too_big = |p: &Plan| {
                p.compares.len() > room || p.ops.len() > room || plan_bytes(p) > bytes_max
            };
            let planned = loop {
                let planned = plan(&w.m, &w.snap, &ctx);
                // An expectation's value and gap compares may outgrow a small transaction
                // where the read plan's revision compares fit: plan again without it.
                if matches!(&planned, Planned::Ready(p) if too_big(p)) && w.m.forget_expectation() {
                    continue;
                }
                break planned;
            };
            match planned {
                Planned::Ready(p) => {
                    if p.ops.is_empty() {
                        let mut o = p.outcome;
                        o.revision = Revision(0);
                        self.finish(id, Ok(o));
                        continue;
                    }
                    if too_big(&p) {
                        self.finish(id, Err(MetaError::TooBig));
                        continue;
                    }
                    let acc = accesses(&p);
                    w.st = St::Ready(Box::new(p), acc);
                }
                Planned::Need(reqs) => {
                    w.needs = reqs;
                    w.st = St::Reading;
                }
                Planned::Fail(e) => self.finish(id, Err(e)),
            }
        }
    }

    fn launch_reads(&mut self) {
        while self.reads_in_flight < self.cfg.reads_in_flight_max {
            let mut reqs: Vec<(u64, RangeRequest)> = Vec::new();
            for (&id, w) in self.works.iter_mut() {
                if !matches!(w.st, St::Reading) || w.needs.is_empty() {
                    continue;
                }
                if reqs.len() + w.needs.len() > self.cfg.batch_ops_max && !reqs.is_empty() {
                    break;
                }
                for mut r in w.needs.drain(..) {
                    r.revision = w.snap_rev;
                    reqs.push((id, r));
                }
            }
            if reqs.is_empty() {
                return;
            }
            self.reads_in_flight += 1;
            self.stats.read_txns.fetch_add(1, Ordering::Relaxed);
            let kv = self.kv.clone();
            self.tasks.spawn(async move {
                let result = read_batch(&*kv, &reqs).await;
                TaskDone::Read { reqs, result }
            });
        }
    }

    fn launch_txns(&mut self) {
        let mut blocked: Vec<Access> = Vec::new();
        // Free-map writes of works not planned yet: later works writing the same map wait
        // for them (see `Mutation::free_map_groups`).
        let unplanned: Vec<(u64, Vec<Access>)> = self
            .works
            .iter()
            .filter(|(_, w)| matches!(w.st, St::Plan | St::Reading))
            .map(|(&id, w)| {
                let acc: Vec<Access> =
                    w.m.free_map_groups()
                        .map(|g| Access {
                            start: self.keys.free_map(g),
                            end: None,
                            kind: AKind::WriteExist,
                        })
                        .collect();
                (id, acc)
            })
            .filter(|(_, acc)| !acc.is_empty())
            .collect();
        let ready: Vec<u64> = self
            .works
            .iter()
            .filter(|(_, w)| matches!(w.st, St::Ready(..)))
            .map(|(&id, _)| id)
            .collect();
        let mut ready = ready.into_iter().peekable();
        let room = self.ops_room();
        while self.txns_in_flight < self.cfg.txns_in_flight_max && ready.peek().is_some() {
            let mut members: Vec<Member> = Vec::new();
            let (mut n_cmp, mut n_ops, mut bytes) = (0usize, 0usize, 0usize);
            let mut batch_acc: Vec<Access> = Vec::new();
            let mut skipped: Vec<u64> = Vec::new();
            // Accesses of works skipped for this batch: later works touching the same
            // keys are skipped too, so they cannot commit ahead of them.
            let mut deferred: Vec<Access> = Vec::new();
            // One transaction commits under one session (it compares that session's
            // membership): works of another wait for the next batch.
            let mut batch_session: Option<SessionId> = None;
            for id in ready.by_ref() {
                let Some(w) = self.works.get(&id) else {
                    continue;
                };
                let St::Ready(p, acc) = &w.st else { continue };
                if batch_session.is_some_and(|s| s != w.session) {
                    skipped.push(id);
                    deferred.extend(acc.iter().cloned());
                    continue;
                }
                let busy = self.inflight.iter().any(|(_, a)| conflict(a, acc))
                    || conflict(&blocked, acc)
                    || unplanned
                        .iter()
                        .any(|(earlier, a)| *earlier < id && conflict(a, acc));
                if busy {
                    // Keep submission order among conflicting mutations: later ones that
                    // touch the same keys wait behind this one.
                    blocked.extend(acc.iter().cloned());
                    continue;
                }
                let fits = n_cmp + p.compares.len() <= room
                    && n_ops + p.ops.len() <= room
                    && bytes + plan_bytes(p) <= self.cfg.txn_bytes_max;
                if conflict(&batch_acc, acc)
                    || conflict(&deferred, acc)
                    || !fits
                    || (w.solo && !members.is_empty())
                {
                    skipped.push(id);
                    deferred.extend(acc.iter().cloned());
                    if !fits {
                        break;
                    }
                    continue;
                }
                let solo = w.solo;
                batch_session = Some(w.session);
                let Some(w) = self.works.get_mut(&id) else {
                    continue;
                };
                let St::Ready(p, acc) = std::mem::replace(&mut w.st, St::InFlight) else {
                    continue;
                };
                n_cmp += p.compares.len();
                n_ops += p.ops.len();
                bytes += plan_bytes(&p);
                batch_acc.extend(acc.iter().cloned());
                members.push(Member {
                    id,
                    op_start: 0,
                    plan: *p,
                    accesses: acc,
                });
                if solo {
                    break;
                }
            }
            // Skipped works go to the next batch of this round.
            let rest: Vec<u64> = skipped.into_iter().chain(ready).collect();
            ready = rest.into_iter().peekable();
            let Some(session) = batch_session.filter(|_| !members.is_empty()) else {
                break;
            };
            self.send_batch(members, batch_acc, session);
        }
    }

    fn send_batch(&mut self, mut members: Vec<Member>, acc: Vec<Access>, session: SessionId) {
        let mut txn = Txn::default();
        let mut failure_reqs: Vec<RangeRequest> = Vec::new();
        if self.cfg.registered {
            // Nothing commits once the session's lease is gone: etcd deleted the key
            // with it. The failure branch reads it first (`on_compare_failed`).
            let member = self.keys.member(session);
            txn.compares.push(Compare::exists(member.clone()));
            failure_reqs.push(RangeRequest::key(member));
        }
        for m in &mut members {
            m.op_start = txn.success.len();
            txn.compares.extend(m.plan.compares.iter().cloned());
            txn.success.extend(m.plan.ops.iter().cloned());
            for c in &m.plan.compares {
                // The failure branch reads every compared key so that a conflict can be
                // pinned on the mutations that caused it, without another round trip.
                let req = RangeRequest {
                    key: c.key.clone(),
                    range_end: c.range_end.clone(),
                    limit: if c.range_end.is_some() {
                        EXTENTS_PER_MUTATION_MAX as i64 + 1
                    } else {
                        0
                    },
                    ..Default::default()
                };
                if !failure_reqs.contains(&req) {
                    failure_reqs.push(req);
                }
            }
        }
        txn.failure = failure_reqs.iter().cloned().map(TxnOp::Range).collect();
        // Last, so that member op indices stay as planned.
        let mut sent = Sent {
            session,
            marker: None,
            cleaned_below: None,
        };
        if self.cfg.registered {
            let seq = self.markers.begin(session);
            let (cmp, put) = marker::marker_ops(&self.keys, session, seq);
            txn.compares.push(cmp);
            txn.success.push(put);
            sent.marker = Some(seq);
            if let Some(clean) = self.markers.cleanable(session, self.elapsed()) {
                let r = self
                    .keys
                    .txn_markers_between(session, clean.start, clean.end);
                txn.success.push(TxnOp::delete_range(r.start, r.end, false));
                sent.cleaned_below = Some(clean.end);
            }
        }
        // In-flight batches are identified by their first member's id (unique: a work is
        // in at most one batch at a time).
        let first_id = members.first().map_or(0, |m| m.id);
        self.inflight.push((first_id, acc));
        self.txns_in_flight += 1;
        self.stats
            .txns_in_flight
            .store(self.txns_in_flight as u64, Ordering::Relaxed);
        // Timestamp writes answer nobody: the watch must still tell the kernel of them.
        let unreplied: Vec<u64> = members
            .iter()
            .filter_map(|m| match self.works.get(&m.id).map(|w| &w.m) {
                Some(Mutation::Touch { ino, .. }) => Some(ino.0),
                _ => None,
            })
            .collect();
        let (kv, own) = (self.kv.clone(), self.own.clone());
        let seq = own.sent();
        let wait = if self.cfg.registered {
            // Past this the marker decides: cheaper than waiting out a dead leader.
            self.cfg.commit_answer_wait
        } else {
            // No marker to decide by: the backend's own request timeout bounds it.
            Duration::from_secs(24 * 3600)
        };
        self.tasks.spawn(async move {
            let result = match tokio::time::timeout(wait, kv.txn(txn)).await {
                Ok(r) => r,
                Err(_) => Err(KvError::Unavailable(format!("no answer within {wait:?}"))),
            };
            // Recorded here, not when the committer gets to it: the watch may be waiting.
            match &result {
                Ok(r) if changed_something(r) => {
                    own.resolved(seq, Some((r.revision, unreplied)), None);
                }
                Ok(r) => own.resolved(seq, None, Some(r.revision)),
                Err(_) => own.resolved(seq, None, None),
            }
            TaskDone::Txn {
                members,
                failure_reqs,
                sent,
                result,
            }
        });
    }

    fn on_task(&mut self, done: TaskDone) {
        match done {
            TaskDone::Read { reqs, result } => {
                self.reads_in_flight -= 1;
                match result {
                    Ok((resps, latest_rev)) => {
                        for ((id, req), mut rr) in reqs.into_iter().zip(resps) {
                            let Some(w) = self.works.get_mut(&id) else {
                                continue;
                            };
                            if w.snap_rev == 0 {
                                w.snap_rev = latest_rev;
                            }
                            // Ranges inside a txn carry no header: stamp the view's revision.
                            rr.revision = w.snap_rev;
                            w.snap.insert(&req, rr);
                            w.st = St::Plan;
                        }
                    }
                    Err(KvError::Compacted { .. }) => {
                        // The consistent view is gone: start the plan over from now.
                        for (id, _) in reqs {
                            if let Some(w) = self.works.get_mut(&id) {
                                w.snap.clear();
                                w.snap_rev = 0;
                                w.st = St::Plan;
                            }
                        }
                    }
                    Err(e) => {
                        let mut ids: Vec<u64> = reqs.iter().map(|(id, _)| *id).collect();
                        ids.dedup();
                        for id in ids {
                            self.read_failed(id, e.clone());
                        }
                    }
                }
            }
            TaskDone::Txn {
                members,
                failure_reqs,
                sent,
                result,
            } => {
                if let (Err(e), Some(seq)) = (&result, sent.marker) {
                    if !e.write_refused() {
                        // Still in flight as far as conflicts go, until decided.
                        log::warn!("etcd did not answer a commit ({e}); deciding it by its marker");
                        self.stats.txns_unanswered.fetch_add(1, Ordering::Relaxed);
                        let (kv, keys) = (self.kv.clone(), self.keys.clone());
                        // An election can outlast an application's budget; a fold given
                        // up too early would fence the node for nothing.
                        let fold = members
                            .iter()
                            .any(|m| self.works.get(&m.id).is_some_and(|w| w.m.fails_unsafe()));
                        let budget = if fold {
                            self.cfg.unanswered_fold_budget
                        } else {
                            self.cfg.unanswered_budget
                        };
                        self.tasks.spawn(async move {
                            let result =
                                marker::resolve(&*kv, &keys, sent.session, seq, budget).await;
                            TaskDone::Resolved {
                                members,
                                sent,
                                result,
                            }
                        });
                        return;
                    }
                }
                self.txn_settled(&members);
                if let Some(seq) = sent.marker {
                    self.markers.answered(seq);
                }
                match result {
                    Ok(resp) if resp.succeeded => {
                        if let Some(end) = sent.cleaned_below {
                            self.markers.cleaned(sent.session, end);
                        }
                        self.on_committed(members, resp);
                    }
                    Ok(resp) => self.on_compare_failed(members, &failure_reqs, resp),
                    Err(KvError::TooManyOps | KvError::RequestTooLarge) if members.len() > 1 => {
                        // Our size estimate was off: resend each mutation on its own.
                        for m in members {
                            if let Some(w) = self.works.get_mut(&m.id) {
                                w.solo = true;
                                w.st = St::Ready(Box::new(m.plan), m.accesses);
                            }
                        }
                    }
                    Err(KvError::LeaseNotFound) if sent.marker.is_some() => {
                        // The marker is leased to the session: its lease is gone.
                        for m in members {
                            self.finish(m.id, Err(MetaError::SessionLost));
                        }
                    }
                    Err(e) => {
                        // Refused, or sent without a marker (an unregistered pipeline):
                        // report, never blindly resend.
                        self.stats.txn_errors.fetch_add(1, Ordering::Relaxed);
                        for m in members {
                            self.finish(m.id, Err(e.clone().into()));
                        }
                    }
                }
            }
            TaskDone::Resolved {
                members,
                sent,
                result,
            } => {
                self.txn_settled(&members);
                let Some(seq) = sent.marker else { return };
                match result {
                    Ok(Resolution::Applied(revision)) => {
                        self.markers.answered(seq);
                        self.stats
                            .unanswered_applied
                            .fetch_add(1, Ordering::Relaxed);
                        log::info!(
                            "a commit whose answer was lost had applied (revision {revision})"
                        );
                        if let Some(end) = sent.cleaned_below {
                            self.markers.cleaned(sent.session, end);
                        }
                        let resp = TxnResponse {
                            succeeded: true,
                            revision,
                            responses: Vec::new(),
                        };
                        self.on_committed(members, resp);
                    }
                    Ok(Resolution::NotApplied) => {
                        self.markers
                            .hold(seq, self.elapsed() + marker::GIVEN_UP_HOLD);
                        self.stats.unanswered_resent.fetch_add(1, Ordering::Relaxed);
                        log::debug!("a commit whose answer was lost had not applied: resending");
                        for m in members {
                            if let Some(w) = self.works.get_mut(&m.id) {
                                w.st = St::Ready(Box::new(m.plan), m.accesses);
                            }
                        }
                    }
                    Ok(Resolution::SessionLost) => {
                        self.markers.answered(seq);
                        for m in members {
                            self.finish(m.id, Err(MetaError::SessionLost));
                        }
                    }
                    Err(e) => {
                        // Still unknown: the application gets EIO, as for any I/O error
                        // whose effect is unknown. Its marker stays, blocking a late copy.
                        self.markers
                            .hold(seq, self.elapsed() + marker::GIVEN_UP_HOLD);
                        self.stats.txn_errors.fetch_add(1, Ordering::Relaxed);
                        log::error!("the outcome of a commit stays unknown: {e}");
                        for m in members {
                            self.finish(m.id, Err(e.clone().into()));
                        }
                    }
                }
            }
        }
    }

    /// A commit transaction is answered or decided: its slot and its members' keys are
    /// free for the next.
    fn txn_settled(&mut self, members: &[Member]) {
        self.txns_in_flight -= 1;
        self.stats
            .txns_in_flight
            .store(self.txns_in_flight as u64, Ordering::Relaxed);
        let first_id = members.first().map_or(0, |m| m.id);
        self.inflight.retain(|(id, _)| *id != first_id);
    }

    /// A batched read failed: etcd's errors of reachability are retried (plans are
    /// redone from a fresh view after a pause) until the work's budget is spent.
    fn read_failed(&mut self, id: u64, e: KvError) {
        let now = self.elapsed();
        let budget = self.cfg.unanswered_budget;
        let Some(w) = self.works.get_mut(&id) else {
            return;
        };
        let until = *w.retry_until.get_or_insert(now + budget);
        if matches!(e, KvError::Unavailable(_)) && now < until {
            self.stats.read_retries.fetch_add(1, Ordering::Relaxed);
            w.snap.clear();
            w.snap_rev = 0;
            w.needs.clear();
            w.st = St::Plan;
            w.not_before = now + READ_RETRY_PAUSE;
            return;
        }
        self.finish(id, Err(e.into()));
    }

    fn on_committed(&mut self, members: Vec<Member>, resp: TxnResponse) {
        let n = members.len() as u64;
        self.stats.record_txn(n);
        let mut written: Vec<Access> = Vec::new();
        for m in members {
            written.extend(
                m.accesses
                    .iter()
                    .filter(|a| matches!(a.kind, AKind::WriteExist | AKind::WriteValue))
                    .cloned(),
            );
            let mut o = m.plan.outcome;
            o.revision = Revision(resp.revision);
            for idx in &m.plan.freed_from_ops {
                if let Some(TxnOpResponse::Delete { prev_kvs, .. }) =
                    resp.responses.get(m.op_start + idx)
                {
                    o.freed.extend(freed_from_kvs(&self.keys, prev_kvs));
                }
            }
            for (ino, mtime) in &m.plan.touch {
                let at = self.touch(*ino, *mtime, m.id);
                o.touched.push((*ino, *mtime, at));
            }
            self.finish(m.id, Ok(o));
        }
        // Plans made from what these writes replaced are stale: re-read those keys.
        for w in self.works.values_mut() {
            let stale = match &w.st {
                St::Ready(_, acc) => conflict(acc, &written),
                St::Plan | St::Reading => false,
                St::InFlight => continue,
            };
            if written
                .iter()
                .any(|a| w.snap.overlaps(&a.start, a.end.as_deref()))
            {
                // Re-read everything at a newer revision, keeping the view consistent.
                w.snap.clear();
                w.snap_rev = 0;
            }
            if stale {
                w.st = St::Plan;
            }
        }
    }

    fn on_compare_failed(
        &mut self,
        members: Vec<Member>,
        failure_reqs: &[RangeRequest],
        resp: TxnResponse,
    ) {
        self.stats.compare_failures.fetch_add(1, Ordering::Relaxed);
        let fresh: Vec<(&RangeRequest, &crate::kv::RangeResponse)> = failure_reqs
            .iter()
            .zip(resp.responses.iter())
            .filter_map(|(req, r)| match r {
                TxnOpResponse::Range(rr) => Some((req, rr)),
                _ => None,
            })
            .collect();
        let lookup = |c: &crate::kv::Compare| {
            fresh
                .iter()
                .find(|(req, _)| req.key == c.key && req.range_end == c.range_end)
                .map(|(_, r)| *r)
        };
        // The member key is the first thing the failure branch reads.
        let session_lost =
            self.cfg.registered && fresh.first().is_some_and(|(_, r)| r.kvs.is_empty());
        if session_lost {
            for m in members {
                self.finish(m.id, Err(MetaError::SessionLost));
            }
            return;
        }
        for m in members {
            let Some(w) = self.works.get_mut(&m.id) else {
                continue;
            };
            w.attempts += 1;
            self.stats.retries.fetch_add(1, Ordering::Relaxed);
            let conflicted = m.plan.compares.iter().any(|c| match lookup(c) {
                // A truncated range cannot prove the compare holds: assume conflict.
                Some(r) => r.more || !c.eval(&r.kvs),
                None => true,
            });
            if w.attempts > self.cfg.retries_max {
                let attempts = w.attempts;
                self.finish(m.id, Err(MetaError::Conflict { attempts }));
                continue;
            }
            if conflicted {
                self.stats
                    .conflicted_mutations
                    .fetch_add(1, Ordering::Relaxed);
                // The failure branch read every compared key at one revision: that is the
                // new consistent view (ranges are re-read at that revision).
                w.snap.clear();
                w.snap_rev = resp.revision;
                // What the submitter expected proved stale (or was not enough): plan from
                // etcd from now on.
                w.m.forget_expectation();
                for c in &m.plan.compares {
                    if c.range_end.is_none() {
                        if let Some(r) = lookup(c) {
                            w.snap.insert_key(c.key.clone(), r.kvs.first().cloned());
                        }
                    }
                }
                w.st = St::Plan;
            } else {
                // Its compares still hold: resend the same plan with the next batch.
                w.st = St::Ready(Box::new(m.plan), m.accesses);
            }
        }
    }
}

fn plan_bytes(p: &Plan) -> usize {
    let c: usize = p
        .compares
        .iter()
        .map(|c| 32 + c.key.len() + c.range_end.as_ref().map_or(0, Vec::len))
        .sum();
    // Each compare also costs a failure-branch range of about the same size.
    2 * c + p.ops.iter().map(TxnOp::size_bytes).sum::<usize>()
}

/// Answers of a read batch, aligned with its requests, and the revision of the
/// latest-revision part.
type ReadBatch = (Vec<crate::kv::RangeResponse>, i64);

/// Reads at a pinned revision go out as plain ranges (a revision inside a txn is not
/// portable); the rest share one read-only txn.
async fn read_batch(
    kv: &dyn KvBackend,
    reqs: &[(u64, RangeRequest)],
) -> Result<ReadBatch, KvError> {
    let latest: Vec<RangeRequest> = reqs
        .iter()
        .filter(|(_, r)| r.revision == 0)
        .map(|(_, r)| r.clone())
        .collect();
    let mut latest_resps = Vec::new();
    let mut latest_rev = 0;
    if !latest.is_empty() {
        let txn = Txn {
            success: latest.into_iter().map(TxnOp::Range).collect(),
            ..Default::default()
        };
        let resp = kv.txn(txn).await?;
        latest_rev = resp.revision;
        for r in resp.responses {
            match r {
                TxnOpResponse::Range(rr) => latest_resps.push(rr),
                _ => return Err(KvError::Other("read txn answered with a write".into())),
            }
        }
    }
    let mut latest_resps = latest_resps.into_iter();
    let mut out = Vec::with_capacity(reqs.len());
    for (_, r) in reqs {
        if r.revision == 0 {
            out.push(
                latest_resps
                    .next()
                    .ok_or_else(|| KvError::Other("short read txn".into()))?,
            );
        } else {
            out.push(kv.range(r.clone()).await?);
        }
    }
    Ok((out, latest_rev))
}
