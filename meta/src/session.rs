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
//! it expired: use [`Session::group_fence`] as a compare on commits that depend on
//! owning a group, and stop device I/O when [`Session::is_alive`] turns false.

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use crate::{
    clock::Clock,
    codec::{decode_at, NodeRecord, Owner, Record},
    error::{KvError, MetaError},
    keys::{KeyKind, Keyspace},
    kv::{Compare, CompareOp, CompareTarget, KvBackend, PutOp, RangeRequest, Txn, TxnOp},
    reader::{orphans_page, OrphanPage},
    types::{GroupId, LeaseId, SessionId},
};

/// Session settings.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// Lease TTL in seconds: how long after a crash the node's groups and orphans stay
    /// locked.
    pub ttl_s: i64,
    /// Keepalive period (a third of the TTL leaves two retries before expiry).
    pub keepalive_interval: Duration,
    /// Operator-facing node name.
    pub node_name: Vec<u8>,
    /// Daemon pid.
    pub pid: u32,
}

impl SessionConfig {
    /// Defaults: 10 s TTL, keepalive every 3 s.
    pub fn new(node_name: &str) -> Self {
        SessionConfig {
            ttl_s: 10,
            keepalive_interval: Duration::from_secs(3),
            node_name: node_name.as_bytes().to_vec(),
            pid: std::process::id(),
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
    alive: Arc<AtomicBool>,
    keepalive: Option<tokio::task::JoinHandle<()>>,
}

impl Session {
    /// Grants a lease, registers the node, and starts the keepalive task on the current
    /// tokio runtime (the pipeline's, in the daemon).
    pub async fn register(
        kv: Arc<dyn KvBackend>,
        keys: Keyspace,
        cfg: &SessionConfig,
        clock: &dyn Clock,
    ) -> Result<Session, MetaError> {
        let rec = NodeRecord {
            name: cfg.node_name.clone(),
            pid: cfg.pid,
            started: clock.wall(),
        };
        if rec.validate().is_err() || cfg.ttl_s < 2 {
            return Err(MetaError::Invalid("bad node name or TTL"));
        }
        let grant = kv.lease_grant(cfg.ttl_s).await?;
        let id = SessionId(u64::try_from(grant.id).map_err(|_| MetaError::Invalid("lease id"))?);
        let key = keys.member(id);
        let t = Txn {
            compares: vec![Compare::absent(key.clone())],
            success: vec![TxnOp::Put(PutOp {
                key,
                value: rec.encode(),
                lease: grant.id,
            })],
            failure: vec![],
        };
        if !kv.txn(t).await?.succeeded {
            // Lease ids are unique while alive, so a leftover key means a bug elsewhere.
            let _ = kv.lease_revoke(grant.id).await;
            return Err(MetaError::Exists);
        }
        let alive = Arc::new(AtomicBool::new(true));
        let keepalive = tokio::spawn(keepalive_loop(
            kv.clone(),
            grant.id,
            cfg.keepalive_interval,
            Duration::from_secs(u64::try_from(grant.ttl_s).unwrap_or(1)),
            alive.clone(),
        ));
        Ok(Session {
            kv,
            keys,
            id,
            lease: LeaseId(grant.id),
            alive,
            keepalive: Some(keepalive),
        })
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

    /// False once the lease is known lost (expired or unrenewable past its TTL): stop
    /// allocating and writing to the device.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Claims an allocation group. `Ok(true)` if this session owns it now (newly or
    /// already), `Ok(false)` if another live session does.
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
        let r = self.kv.txn(t).await?;
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
        self.kv.txn(t).await?;
        Ok(())
    }

    /// Withdraws [`Session::want_space`].
    pub async fn space_found(&self) -> Result<(), MetaError> {
        let t = Txn {
            compares: vec![],
            success: vec![TxnOp::delete(self.keys.space_wanted(self.id))],
            failure: vec![],
        };
        self.kv.txn(t).await?;
        Ok(())
    }

    /// Revokes the lease of a session that is known dead although its lease has not run
    /// out (a daemon of this host killed before it could close it): its groups and
    /// membership go at once instead of a TTL later.
    pub async fn revoke_dead(&self, dead: SessionId) -> Result<(), MetaError> {
        let lease = i64::try_from(dead.0).map_err(|_| MetaError::Invalid("lease id"))?;
        match self.kv.lease_revoke(lease).await {
            Ok(()) | Err(KvError::LeaseNotFound) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Gives a group back (only if this session owns it).
    pub async fn release_group(&self, group: GroupId) -> Result<bool, MetaError> {
        let key = self.keys.group(group);
        let t = Txn {
            compares: vec![self.group_fence(group)],
            success: vec![TxnOp::delete(key)],
            failure: vec![],
        };
        Ok(self.kv.txn(t).await?.succeeded)
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
    pub fn abandon(mut self) {
        if let Some(h) = self.keepalive.take() {
            h.abort();
        }
        self.alive.store(false, Ordering::Release);
    }

    /// Ends the session: revokes the lease, which deletes its membership and group keys.
    pub async fn close(mut self) -> Result<(), MetaError> {
        if let Some(h) = self.keepalive.take() {
            h.abort();
        }
        self.alive.store(false, Ordering::Release);
        match self.kv.lease_revoke(self.lease.0).await {
            Ok(()) | Err(KvError::LeaseNotFound) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(h) = self.keepalive.take() {
            h.abort();
        }
    }
}

async fn keepalive_loop(
    kv: Arc<dyn KvBackend>,
    lease: i64,
    interval: Duration,
    ttl: Duration,
    alive: Arc<AtomicBool>,
) {
    let mut since_ok = Duration::ZERO;
    loop {
        tokio::time::sleep(interval).await;
        match kv.lease_keepalive(lease).await {
            Ok(_) => since_ok = Duration::ZERO,
            Err(KvError::LeaseNotFound) => {
                log::error!("session lease {lease:x} expired: node must stop writing");
                alive.store(false, Ordering::Release);
                return;
            }
            Err(e) => {
                since_ok += interval;
                log::warn!("lease {lease:x} keepalive failed: {e}");
                if since_ok >= ttl {
                    log::error!("lease {lease:x} not renewed for a full TTL: assuming lost");
                    alive.store(false, Ordering::Release);
                    return;
                }
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
