//! Fencing: what a node does when its lease may have ended, and how it serves again.
//!
//! The session's keepalive keeps a [`Fence`] open until a margin before the lease's
//! earliest expiry (`meta::fence` has the arithmetic). Everything that could touch
//! another node's data checks it:
//!
//! * device I/O: the transport asks before queueing a plan's I/O
//!   ([`fusedev::server::Handler::device_io_allowed`]), and the waiters' own reads and
//!   writes go through [`FencedDev`], which asks before each batch;
//! * etcd: every commit compares the membership key of the session the operation began
//!   under ([`OpSession`], carried from the core that received the request to the thread
//!   that runs it), which etcd deletes with the lease; work of an old session never
//!   commits under a new one (`MetaError::SessionLost`);
//! * file handles: a handle carries the generation it was opened in, and every request on
//!   a handle of an earlier generation answers EIO, as NFS does for a lost lock.
//!
//! Once the fence has closed, the housekeeping thread drops everything that was held under
//! the session ([`Inner::fence_all`]): cluster locks, fcntl locks, open records, writes
//! behind (their handles' fsync and close report EIO), the groups and their allocator
//! state, and the kernel's pages and attributes of every file involved. Then it registers
//! a new session as soon as etcd answers ([`Inner::rejoin`]) and serves again, with a new
//! generation of handles, without a remount.

use super::*;
use crate::data::device::{DevError, IoBuf, IoReq};
use meta::{fence::Fence, types::SessionId};
use std::cell::Cell;

/// File handles carry their generation above this bit (the counter below it would take
/// 2^40 opens to reach it).
const FH_GEN_SHIFT: u32 = 40;
/// How often a fenced node tries to register again.
pub(super) const REJOIN_EVERY: Duration = Duration::from_secs(1);

thread_local! {
    /// The session and handle generation the operation running on this thread began
    /// under ((0, 0): none, outside an operation).
    static OP_SESSION: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// The session (and handle generation) an operation began under, taken on the core that
/// received the request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OpSession {
    session: SessionId,
    generation: u64,
}

/// While it lives, this thread runs an operation of its [`OpSession`].
pub(crate) struct OpScope {
    prev: (u64, u64),
}

impl OpSession {
    pub(crate) fn enter(self) -> OpScope {
        OpScope {
            prev: OP_SESSION.with(|c| c.replace((self.session.0, self.generation))),
        }
    }
}

impl Drop for OpScope {
    fn drop(&mut self) {
        OP_SESSION.with(|c| c.set(self.prev));
    }
}

/// A device that refuses I/O once the fence of the operation's session has closed.
pub(crate) struct FencedDev {
    inner: Box<dyn BlockDev>,
    fence: Arc<Fence>,
    session: SessionId,
    counters: Arc<DevCounters>,
}

impl BlockDev for FencedDev {
    fn engine(&self) -> &'static str {
        self.inner.engine()
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn submit_batch(&mut self, reqs: &mut [IoReq<'_>]) -> Vec<Result<(), DevError>> {
        if !self.fence.open_for(self.session) {
            return reqs.iter().map(|_| Err(DevError::Fenced)).collect();
        }
        let c = &self.counters;
        for r in reqs.iter() {
            let (n, bytes) = match r.buf {
                IoBuf::Read(_) => (&c.reads, &c.read_bytes),
                IoBuf::Write(_) => (&c.writes, &c.write_bytes),
            };
            n.fetch_add(1, Ordering::Relaxed);
            bytes.fetch_add(r.len as u64, Ordering::Relaxed);
        }
        self.inner.submit_batch(reqs)
    }

    fn flush(&mut self) -> Result<(), DevError> {
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        // A flush writes nothing of its own: what it makes durable was allowed.
        self.inner.flush()
    }
}

/// A file handle of generation `gen`.
pub(super) fn handle(gen: u64, counter: u64) -> u64 {
    (gen << FH_GEN_SHIFT) | (counter & ((1 << FH_GEN_SHIFT) - 1))
}

fn generation_of(fh: u64) -> u64 {
    fh >> FH_GEN_SHIFT
}

impl Inner {
    /// The session the operation on this thread began under (outside one: the current).
    pub(super) fn op_session(&self) -> SessionId {
        match OP_SESSION.with(Cell::get) {
            (0, _) => self.meta.session(),
            (s, _) => SessionId(s),
        }
    }

    /// The handle generation of the operation on this thread (outside one: the current).
    pub(super) fn op_generation(&self) -> u64 {
        match OP_SESSION.with(Cell::get) {
            (0, _) => self.generation.load(Ordering::Acquire),
            (_, g) => g,
        }
    }

    /// The session a request received now begins under. The generation is read first: a
    /// fence between the two reads leaves an old generation with the session, never a
    /// new generation with the old session.
    pub(super) fn begin_op(&self) -> OpSession {
        let generation = self.generation.load(Ordering::Acquire);
        OpSession {
            session: self.meta.session(),
            generation,
        }
    }

    /// Whether the operation on this thread may still start device I/O and lock work.
    pub(super) fn op_serving(&self) -> bool {
        self.fence.open_for(self.op_session())
    }

    /// A block device for this operation's reads and writes, fenced.
    pub(super) fn io(&self) -> Box<dyn BlockDev> {
        Box::new(FencedDev {
            inner: self.dev.io(),
            fence: self.fence.clone(),
            session: self.op_session(),
            counters: self.dev_counters.clone(),
        })
    }

    /// Whether a file handle was opened under the session that serves now.
    pub(super) fn fh_current(&self, fh: u64) -> bool {
        generation_of(fh) == self.generation.load(Ordering::Acquire)
    }

    /// Commits under the operation's session.
    pub(super) fn commit_op(&self, m: Mutation) -> Result<Outcome, MetaError> {
        self.meta.commit_as(m, self.op_session())
    }

    /// Submits under the operation's session.
    pub(super) fn submit_op(
        &self,
        m: Mutation,
    ) -> Result<meta::pipeline::Ticket<Outcome>, MetaError> {
        self.meta.submit_as(m, self.op_session())
    }

    /// The housekeeping thread's look at the fence: drops what the old session held the
    /// first time it finds the fence closed, then tries to register again.
    pub(super) fn watch_fence(&self) {
        if let Some(s) = self.meta.unsafe_maps_session() {
            if self.fence.close(Some(s)) {
                log::error!(
                    "fencing session {:x}: a write of its free maps failed, so its allocator \
                     may hand out blocks etcd still records as released; it registers anew \
                     and loads its groups from etcd",
                    s.0
                );
            }
        }
        if self.fence.open() || self.stopping.load(Ordering::Acquire) {
            return;
        }
        if !self.fenced.swap(true, Ordering::AcqRel) {
            self.fence_all();
        }
        let mut next = lock(&self.rejoin_at);
        if next.is_some_and(|t| std::time::Instant::now() < t) {
            return;
        }
        *next = Some(std::time::Instant::now() + REJOIN_EVERY);
        drop(next);
        match self.rejoin() {
            Ok(()) => {
                *lock(&self.rejoin_at) = None;
                self.rejoin_failures.store(0, Ordering::Relaxed);
                self.fenced.store(false, Ordering::Release);
            }
            Err(e) => {
                // Once a second while etcd is away: the first failure and one in thirty.
                let n = self.rejoin_failures.fetch_add(1, Ordering::Relaxed);
                if n % 30 == 0 {
                    log::warn!(
                        "fenced node: registering a new session failed ({} tries so far): {e}",
                        n + 1
                    );
                }
            }
        }
    }

    /// An operator asked `session` to give itself up (`etcfs evict`): if it is ours, the
    /// fence closes now and the housekeeping thread does the rest, revoking the lease
    /// once device I/O already under way has had [`meta::fence::MARGIN_MIN`] to finish.
    pub(super) fn evicted(&self, session: SessionId) {
        let ours = lock(&self.session)
            .as_ref()
            .is_some_and(|s| s.id() == session);
        if ours && self.fence.close(Some(session)) {
            log::error!("evicted: an operator ended session {:x}", session.0);
        }
    }

    /// Drops everything held under the session whose fence closed. Nothing of it is
    /// written anywhere: the lease may be gone, and with it the locks and groups that
    /// made those writes safe.
    pub(super) fn fence_all(&self) {
        let old = lock(&self.session).clone();
        let id = old.as_ref().map_or(0, |s| s.id().0);
        log::error!(
            "fenced: session {id:x} may have lost its lease; no more device I/O or etcd \
             commits under it. Dropping its cluster locks, fcntl locks, open files, writes \
             not yet committed and allocation groups; requests on files opened before now \
             answer EIO"
        );
        if let Some(s) = &old {
            s.stop_keepalive();
        }
        *lock(&self.fenced_at) = Some(std::time::Instant::now());
        self.generation.fetch_add(1, Ordering::AcqRel);
        let mut inos: BTreeSet<u64> = self.locks.fence().into_iter().collect();
        let (files, dropped) = self.files.drop_all();
        inos.extend(files);
        self.plocks.fence();
        self.held.fence();
        *lock(&self.alloc) = Allocator::new(self.geometry);
        self.space_wanted.store(false, Ordering::Release);
        for &ino in &inos {
            self.caches.forget_attr(ino);
            self.caches.forget_blocks(ino);
        }
        log::warn!(
            "fenced: dropped {} files' cached state ({dropped} with writes not yet committed: \
             lost, their next fsync or close answers EIO)",
            inos.len()
        );
        // The kernel's pages and attributes of those files were cached under the locks.
        let n = lock(&self.notifier)
            .clone()
            .or_else(|| PROCESS_NOTIFIER.get().cloned());
        if let Some(n) = n {
            for &ino in &inos {
                if let Err(e) = n.inval_inode(ino, 0, 0) {
                    log::debug!("fenced: invalidating inode {ino} in the kernel: {e}");
                }
            }
        }
        self.kernel_names_stale();
        log::warn!("fenced: caches dropped; waiting for etcd to register a new session");
    }

    /// Registers a new session (and gives the old lease up, if etcd still has it), claims
    /// groups and serves again.
    pub(super) fn rejoin(&self) -> Result<(), MetaError> {
        let cfg = session_config(self.lease_ttl_s, self.fence.clone());
        let old = lock(&self.session).take();
        let s = match self.meta.register_session(&cfg, self.fence.clock().clone()) {
            Ok(s) => s,
            Err(e) => {
                *lock(&self.session) = old;
                return Err(e);
            }
        };
        log::warn!(
            "rejoin: registered session {:x} (lease TTL {} s)",
            s.id().0,
            s.ttl().as_secs()
        );
        self.locks.rejoin(s.cache_locks());
        let new = Arc::new(s);
        *lock(&self.session) = Some(new.clone());
        if let Some(old) = old {
            // Its locks and groups go now rather than when the lease runs out (it is
            // usually gone already, unless the fence closed early or on an eviction),
            // once device I/O submitted before the fence has had its margin to finish.
            let since = lock(&self.fenced_at).map_or(Duration::MAX, |t| t.elapsed());
            if let Some(wait) = meta::fence::MARGIN_MIN.checked_sub(since) {
                std::thread::sleep(wait);
            }
            let dead = old.id();
            let evict_key = self.meta.keys().evict(dead);
            if let Err(e) = run_read(&self.meta, move |kv, _| {
                Box::pin(async move {
                    new.revoke_dead(dead).await?;
                    let t = meta::kv::Txn {
                        success: vec![meta::kv::TxnOp::delete(evict_key)],
                        ..Default::default()
                    };
                    // A delete: idempotent.
                    kv.txn_idempotent(t).await?;
                    Ok(())
                })
            }) {
                log::warn!("rejoin: revoking the old session {:x}: {e}", dead.0);
            } else {
                log::warn!("rejoin: the old session {:x} is revoked", dead.0);
            }
        }
        if !self.read_only {
            match self.claim_groups(GROUPS_CLAIM_INITIAL) {
                Ok(n) => log::warn!("rejoin: claimed {n} allocation groups"),
                Err(e) => log::warn!("rejoin: claiming allocation groups: {e} (retried on demand)"),
            }
        }
        log::warn!(
            "rejoin: serving again (handle generation {}); files opened before the fence \
             keep answering EIO",
            self.generation.load(Ordering::Acquire)
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_carry_their_generation() {
        let fh = handle(3, 17);
        assert_eq!(generation_of(fh), 3);
        assert_eq!(fh & 0xffff, 17);
        assert_ne!(handle(3, 1 << 40), handle(4, 0), "the counter never spills");
        assert_eq!(generation_of(handle(3, u64::MAX)), 3);
    }
}
