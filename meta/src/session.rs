//! Node membership, liveness and allocation-group ownership, all tied to one etcd lease.
//!
//! A [`Session`] is one daemon's lifetime: it grants a lease, registers `M<session>`
//! under it, keeps it alive, and claims allocation groups (`G<group>`, also under the
//! lease) by compare-and-swap. When the daemon dies its lease expires and etcd deletes
//! the membership, group and open-record (`H`) keys: the groups become claimable, and
//! the orphans only it held open (orphan records are deliberately not leased) become
//! reclaimable by anyone.
//!
//! A lease alone does not stop a stalled node from writing to the shared device after
//! it expired: the keepalive keeps a [`Fence`] a margin before the lease's earliest
//! expiry (see `crate::fence` for the arithmetic), device I/O starts only while it is
//! open, and the pipeline's commits compare the membership key (`pipeline::commit`)
//! and, where they hand out blocks, the group's ownership ([`Session::group_fence`]).

use std::{collections::HashSet, sync::Arc, time::Duration};

use crate::{
    clock::Clock,
    codec::{decode_at, NodeRecord, Owner, Record},
    error::{KvError, MetaError},
    fence::{fence_after, renew_every, Fence, RETRY_EVERY},
    keys::{KeyKind, Keyspace},
    kv::{Compare, CompareOp, CompareTarget, KvBackend, PutOp, RangeRequest, Txn, TxnOp},
    reader::{orphans_page, OrphanPage},
    types::{GroupId, LeaseId, SessionId},
};

/// Session settings.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// Lease TTL in seconds: how long after a crash the node's groups and orphans stay
    /// locked. Renewals go out every quarter of it (`crate::fence::renew_every`).
    pub ttl_s: i64,
    /// How often the keepalive task looks at the clock (real time): renewals are due by
    /// the session's clock, which tests drive by hand.
    pub keepalive_tick: Duration,
    /// Operator-facing node name.
    pub node_name: Vec<u8>,
    /// Daemon pid.
    pub pid: u32,
    /// The fence the session keeps open while its lease is renewed (shared with the
    /// filesystem, which checks it before device I/O); a private one on the session's
    /// clock when `None`.
    pub fence: Option<Arc<Fence>>,
}

impl SessionConfig {
    /// Defaults: 10 s TTL, the clock looked at every 100 ms.
    pub fn new(node_name: &str) -> Self {
        SessionConfig {
            ttl_s: 10,
            keepalive_tick: Duration::from_millis(100),
            node_name: node_name.as_bytes().to_vec(),
            pid: std::process::id(),
            fence: None,
        }
    }
}

/// A registered node.
#[derive(Debug)]
pub struct Session {
    kv: Arc<dyn KvBackend>,
    keys: Keyspace,
    id: SessionId,
    lease: LeaseId,
    ttl: Duration,
    fence: Arc<Fence>,
    keepalive: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Session {
    /// Grants a lease, registers the node, opens the fence and starts the keepalive task
    /// on the current tokio runtime (the pipeline's, in the daemon).
    pub async fn register(
        kv: Arc<dyn KvBackend>,
        keys: Keyspace,
        cfg: &SessionConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Session, MetaError> {
        let rec = NodeRecord {
            name: cfg.node_name.clone(),
            pid: cfg.pid,
            started: clock.wall(),
        };
        if rec.validate().is_err() || cfg.ttl_s < 2 {
            return Err(MetaError::Invalid("bad node name or TTL"));
        }
        let fence = cfg
            .fence
            .clone()
            .unwrap_or_else(|| Arc::new(Fence::new(clock.clone())));
        // The lease may start as soon as the grant is sent.
        let sent = fence.clock().mono();
        let grant = kv.lease_grant(cfg.ttl_s).await?;
        let id = SessionId(u64::try_from(grant.id).map_err(|_| MetaError::Invalid("lease id"))?);
        let key = keys.member(id);
        // Idempotent: sent again after a lost answer, the compare fails on the record the
        // first copy put, and the failure branch reads it back: under our lease, it is ours.
        let t = Txn {
            compares: vec![Compare::absent(key.clone())],
            success: vec![TxnOp::Put(PutOp {
                key: key.clone(),
                value: rec.encode(),
                lease: grant.id,
            })],
            failure: vec![TxnOp::Range(RangeRequest::key(key))],
        };
        let r = kv.txn_idempotent(t).await?;
        let ours = r.succeeded
            || matches!(
                r.responses.first(),
                Some(crate::kv::TxnOpResponse::Range(rr))
                    if rr.kvs.first().is_some_and(|kv| kv.lease == grant.id)
            );
        if !ours {
            // Lease ids are unique while alive, so a leftover key means a bug elsewhere.
            let _ = kv.lease_revoke(grant.id).await;
            return Err(MetaError::Exists);
        }
        let ttl = Duration::from_secs(u64::try_from(grant.ttl_s).unwrap_or(1));
        fence.arm(id, fence_after(sent, ttl));
        let keeper = Keeper {
            kv: kv.clone(),
            lease: grant.id,
            session: id,
            ttl,
            tick: cfg.keepalive_tick,
            fence: fence.clone(),
        };
        let keepalive = tokio::spawn(keeper.run(sent));
        Ok(Session {
            kv,
            keys,
            id,
            lease: LeaseId(grant.id),
            ttl,
            fence,
            keepalive: std::sync::Mutex::new(Some(keepalive)),
        })
    }

    /// The lease TTL etcd granted.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The fence this session keeps open.
    pub fn fence(&self) -> &Arc<Fence> {
        &self.fence
    }

    /// This session's id (its lease id).
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// The lease.
    pub fn lease(&self) -> LeaseId {
        self.lease
    }

    /// This session's handle on the cluster cache locks (`crate::cachelock`).
    pub fn cache_locks(&self) -> crate::cachelock::CacheLocks {
        crate::cachelock::CacheLocks::new(self.kv.clone(), self.keys.clone(), self.id, self.lease.0)
    }

    /// False once the fence has closed (the lease expired, was revoked, or was not
    /// renewed in time): stop allocating and writing to the device.
    pub fn is_alive(&self) -> bool {
        self.fence.open_for(self.id)
    }

    /// Claims an allocation group. `Ok(true)` if this session owns it now (newly or
    /// already), `Ok(false)` if another live session does. Idempotent (resent after a lost
    /// answer): a claim that finds the group already ours reads that back as success.
    pub async fn claim_group(&self, group: GroupId) -> Result<bool, MetaError> {
        let key = self.keys.group(group);
        let owner = Owner { session: self.id }.encode();
        let t = Txn {
            compares: vec![Compare::absent(key.clone())],
            success: vec![TxnOp::Put(PutOp {
                key: key.clone(),
                value: owner.clone(),
                lease: self.lease.0,
            })],
            failure: vec![TxnOp::Range(RangeRequest::key(key))],
        };
        let r = self.kv.txn_idempotent(t).await?;
        if r.succeeded {
            return Ok(true);
        }
        let current = match r.responses.first() {
            Some(crate::kv::TxnOpResponse::Range(rr)) => rr.kvs.first().map(|kv| kv.value.clone()),
            _ => None,
        };
        Ok(current.as_deref() == Some(owner.as_slice()))
    }

    /// Asks the owners of groups for space: a record under this session's lease that
    /// their watch sees (and that dies with the session). Idempotent.
    pub async fn want_space(&self) -> Result<(), MetaError> {
        let put = PutOp {
            key: self.keys.space_wanted(self.id),
            value: Owner { session: self.id }.encode(),
            lease: self.lease.0,
        };
        let t = Txn {
            compares: vec![],
            success: vec![TxnOp::Put(put)],
            failure: vec![],
        };
        // Putting the same record twice asks once: the owners' watch sees a second put,
        // which asks again for nothing more.
        self.kv.txn_idempotent(t).await?;
        Ok(())
    }

    /// Withdraws [`Session::want_space`]. Idempotent: a delete of nothing is nothing.
    pub async fn space_found(&self) -> Result<(), MetaError> {
        let t = Txn {
            compares: vec![],
            success: vec![TxnOp::delete(self.keys.space_wanted(self.id))],
            failure: vec![],
        };
        self.kv.txn_idempotent(t).await?;
        Ok(())
    }

    /// Revokes the lease of a session that is known dead although its lease has not run
    /// out (a daemon of this host killed before it could close it): its groups and
    /// membership go at once instead of a TTL later. Idempotent: a lease already gone
    /// (revoked by an attempt whose answer was lost, or expired) is what was asked for.
    pub async fn revoke_dead(&self, dead: SessionId) -> Result<(), MetaError> {
        let lease = i64::try_from(dead.0).map_err(|_| MetaError::Invalid("lease id"))?;
        match self.kv.lease_revoke(lease).await {
            Ok(()) | Err(KvError::LeaseNotFound) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Gives a group back (only if this session owns it): `Ok(true)` once this session no
    /// longer owns it. Idempotent: sent again after a lost answer, it finds the group no
    /// longer ours (released by the first copy) and that is success; the delete is fenced
    /// on our ownership, so it never releases a group someone else claimed meanwhile.
    pub async fn release_group(&self, group: GroupId) -> Result<bool, MetaError> {
        let key = self.keys.group(group);
        let t = Txn {
            compares: vec![self.group_fence(group)],
            success: vec![TxnOp::delete(key.clone())],
            failure: vec![TxnOp::Range(RangeRequest::key(key))],
        };
        let r = self.kv.txn_idempotent(t).await?;
        if !r.succeeded {
            let owner = match r.responses.first() {
                Some(crate::kv::TxnOpResponse::Range(rr)) => {
                    rr.kvs.first().map(|kv| kv.value.clone())
                }
                _ => None,
            };
            log::debug!(
                "group {}: not ours any more when given back (owner record {owner:?})",
                group.0
            );
        }
        Ok(true)
    }

    /// A compare that holds only while this session owns `group`: add it to commits
    /// that hand out blocks from the group, so a node whose lease expired cannot.
    pub fn group_fence(&self, group: GroupId) -> Compare {
        Compare {
            key: self.keys.group(group),
            range_end: None,
            op: CompareOp::Equal,
            target: CompareTarget::Value(Owner { session: self.id }.encode()),
        }
    }

    /// Groups this session owns.
    pub async fn owned_groups(&self) -> Result<Vec<GroupId>, MetaError> {
        Ok(group_owners(&*self.kv, &self.keys)
            .await?
            .into_iter()
            .filter(|(_, s)| *s == self.id)
            .map(|(g, _)| g)
            .collect())
    }

    /// Stops the keepalive without revoking (what a crash looks like to the cluster).
    pub fn abandon(self) {
        self.stop_keepalive();
    }

    /// Stops renewing and closes the fence, leaving the lease to run out (a node that
    /// fenced itself: it may still be alive in etcd, but this node no longer counts on
    /// it). Idempotent.
    pub fn stop_keepalive(&self) {
        let h = self
            .keepalive
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(h) = h {
            h.abort();
        }
        self.fence.close(Some(self.id));
    }

    /// Ends the session: revokes the lease, which deletes its membership and group keys.
    pub async fn close(self) -> Result<(), MetaError> {
        self.stop_keepalive();
        match self.kv.lease_revoke(self.lease.0).await {
            Ok(()) | Err(KvError::LeaseNotFound) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop_keepalive();
    }
}

/// The keepalive task: renews the lease every quarter TTL (retrying failures every
/// [`RETRY_EVERY`]) and moves the fence to a margin before the earliest expiry the
/// acknowledged renewal allows, measured from when it was *sent*. It never waits past
/// the fence for an answer: a renewal acknowledged after the fence closed is no use.
struct Keeper {
    kv: Arc<dyn KvBackend>,
    lease: i64,
    session: SessionId,
    ttl: Duration,
    tick: Duration,
    fence: Arc<Fence>,
}

impl Keeper {
    async fn run(self, mut last_sent: Duration) {
        let clock = self.fence.clock().clone();
        let lease = self.lease;
        let mut retry_at: Option<Duration> = None;
        loop {
            tokio::time::sleep(self.tick).await;
            if !self.fence.open_for(self.session) {
                log::error!(
                    "session {lease:x}: fence closed {:.1} s after the last acknowledged \
                     renewal was sent; the node stops device I/O and registers again",
                    clock.mono().saturating_sub(last_sent).as_secs_f64()
                );
                self.fence.close(Some(self.session));
                return;
            }
            let now = clock.mono();
            if now < retry_at.unwrap_or(last_sent + renew_every(self.ttl)) {
                continue;
            }
            let budget = self.fence.left().max(Duration::from_millis(1));
            match tokio::time::timeout(budget, self.kv.lease_keepalive(lease)).await {
                Ok(Ok(_)) if !self.fence.open_for(self.session) => {
                    // Acknowledged after the fence ran out: whatever this node did
                    // meanwhile assumed the lease lost, so it stays lost.
                    continue;
                }
                Ok(Ok(left)) if left > 0 => {
                    let left = Duration::from_secs(u64::try_from(left).unwrap_or(0));
                    self.fence.renew(self.session, fence_after(now, left));
                    last_sent = now;
                    retry_at = None;
                }
                Ok(Ok(_)) | Ok(Err(KvError::LeaseNotFound)) => {
                    log::error!(
                        "session {lease:x}: the lease is gone in etcd (expired or evicted); \
                         the node stops device I/O and registers again"
                    );
                    self.fence.close(Some(self.session));
                    return;
                }
                Ok(Err(e)) => {
                    log::warn!(
                        "session {lease:x}: renewing the lease failed ({e}); {:.1} s left \
                         before the node stops device I/O",
                        self.fence.left().as_secs_f64()
                    );
                    retry_at = Some(clock.mono() + RETRY_EVERY);
                }
                // Out of time: the fence check above ends it.
                Err(_) => retry_at = Some(clock.mono()),
            }
        }
    }
}

/// Every live node: session and record.
pub async fn live_sessions(
    kv: &dyn KvBackend,
    keys: &Keyspace,
) -> Result<Vec<(SessionId, NodeRecord)>, MetaError> {
    let r = keys.members();
    let resp = kv.range(RangeRequest::range(r.start, r.end)).await?;
    resp.kvs
        .iter()
        .filter_map(|item| match keys.parse(&item.key) {
            Some(KeyKind::Member(s)) => Some((s, item)),
            _ => None,
        })
        .map(|(s, item)| Ok((s, decode_at::<NodeRecord>(keys, &item.key, &item.value)?)))
        .collect()
}

/// Every claimed group and its owner.
pub async fn group_owners(
    kv: &dyn KvBackend,
    keys: &Keyspace,
) -> Result<Vec<(GroupId, SessionId)>, MetaError> {
    let r = keys.groups();
    let resp = kv.range(RangeRequest::range(r.start, r.end)).await?;
    resp.kvs
        .iter()
        .filter_map(|item| match keys.parse(&item.key) {
            Some(KeyKind::Group(g)) => Some((g, item)),
            _ => None,
        })
        .map(|(g, item)| Ok((g, decode_at::<Owner>(keys, &item.key, &item.value)?.session)))
        .collect()
}

/// One page of the orphans whose unlinking session is gone (its membership key expired),
/// from the orphan records after key `after` (None: from the first), at most `limit` of
/// them read: resume with the page's `next` until it is None, so every orphan is seen
/// whatever their number. Corrupt records are in the page's `corrupt`, skipped. Another
/// node may still have one open (its `H` record): `Mutation::ReclaimOrphan` checks that and
/// does nothing then. The filesystem scans for orphans without open records instead.
pub async fn dead_orphans(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    after: Option<&[u8]>,
    limit: usize,
) -> Result<OrphanPage, MetaError> {
    let live: HashSet<SessionId> = live_sessions(kv, keys)
        .await?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let mut page = orphans_page(kv, keys, after, limit).await?;
    page.orphans.retain(|o| !live.contains(&o.session));
    Ok(page)
}
