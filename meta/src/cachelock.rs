//! The etcd side of the cluster cache locks: one lock per regular file, shared (a node may
//! cache the file's pages, attributes and extent map) or exclusive (it may also write and
//! keep writes behind). The filesystem side, which decides when to take and give them up,
//! is `src/fs/locks.rs`; its module docs describe the whole protocol.
//!
//! ```text
//! K<ino><session> = mode   under the holder's lease: dies with the holder
//! Q<ino><session> = mode   under the asker's lease: "I wait for this mode"
//! ```
//!
//! * **Acquire**: read `K<ino>*` at revision R; when no other session holds a conflicting
//!   mode, one transaction puts `K<ino><me>` and deletes `Q<ino><me>`, on the compare that
//!   no key of `K<ino>*` but our own was written after R (a new holder, or a holder that
//!   changed its mode, makes it fail, and the read is redone). Otherwise `Q<ino><me>` is
//!   put (again, so that each attempt is an event the holders' watches see) and the
//!   caller waits for a change of `K<ino>*`.
//! * **Release** deletes `K<ino><me>`; **downgrade** (exclusive to shared) overwrites it.
//!   Neither needs a compare: only the holder writes its own key.
//! * A session that dies loses its keys with its lease; whoever waited sees the deletes.
//!
//! Every one of these writes is idempotent, so each is resent when etcd did not answer
//! (an election: [`crate::kv::KvBackend::txn_idempotent`]): an acquire sent again after
//! its first copy granted finds the other holders as they were (our own key is left out
//! of the compare, only we write it) and grants again, the same key with the same mode;
//! a release or withdrawal deletes a key already gone; a downgrade or a wait puts the
//! value already there.

use std::sync::Arc;

use crate::{
    codec::{decode_at, Record},
    error::MetaError,
    keys::{KeyKind, Keyspace},
    kv::{
        Compare, CompareOp, CompareTarget, KvBackend, PutOp, RangeRequest, Txn, TxnOp,
        TxnOpResponse,
    },
    types::{Ino, SessionId},
};

/// How a node holds a file's cache lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LockMode {
    /// Cache reads: pages, attributes, extent map.
    Shared,
    /// Also write, and keep writes behind.
    Exclusive,
}

impl LockMode {
    /// Whether a holder in `self` must give way to another node asking for `other`.
    pub fn conflicts(self, other: LockMode) -> bool {
        self == LockMode::Exclusive || other == LockMode::Exclusive
    }
}

/// The value of `K` and `Q` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLock {
    /// The mode held (K) or wanted (Q).
    pub mode: LockMode,
}

impl Record for CacheLock {
    const WHAT: &'static str = "cache lock";
    fn validate(&self) -> Result<(), &'static str> {
        Ok(())
    }
    fn write(&self, w: &mut Vec<u8>) {
        w.push(match self.mode {
            LockMode::Shared => 1,
            LockMode::Exclusive => 2,
        });
    }
    fn read(r: &mut crate::codec::Reader<'_>) -> Result<Self, &'static str> {
        let mode = match r.u8()? {
            1 => LockMode::Shared,
            2 => LockMode::Exclusive,
            _ => return Err("unknown lock mode"),
        };
        Ok(CacheLock { mode })
    }
}

/// Sessions among `holders` that `me` must wait for to hold `want`. A record that does not
/// decode counts as an exclusive hold: a lock nobody can read is not a lock to ignore.
pub fn conflicting(
    holders: &[(SessionId, Option<LockMode>)],
    me: SessionId,
    want: LockMode,
) -> Vec<SessionId> {
    holders
        .iter()
        .filter(|(s, m)| *s != me && m.unwrap_or(LockMode::Exclusive).conflicts(want))
        .map(|(s, _)| *s)
        .collect()
}

/// What a node knows of a file's holders: the whole set as of a store revision. Kept
/// current from the watch (an event newer than `revision` is applied, an older one is
/// already in it), it lets an acquire commit in one round trip, its compare failing only
/// when the set changed since.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Known {
    /// The store revision the set is as of.
    pub revision: i64,
    /// Holders and their modes (`None`: a record that does not decode).
    pub holders: Vec<(SessionId, Option<LockMode>)>,
}

impl Known {
    /// Applies a watch event of `session`'s key at `revision` (`mode: None`: deleted), if
    /// newer than what is known.
    pub fn apply(&mut self, revision: i64, session: SessionId, mode: Option<Option<LockMode>>) {
        if revision <= self.revision {
            return;
        }
        self.revision = revision;
        self.holders.retain(|(s, _)| *s != session);
        if let Some(m) = mode {
            self.holders.push((session, m));
        }
    }
}

/// What an acquire attempt found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Acquired {
    /// Held now, from this store revision on; with the key asked to be read in the same
    /// transaction (the file's attributes, as of the grant).
    Granted {
        revision: i64,
        extra: Option<crate::kv::KeyValue>,
    },
    /// These sessions hold conflicting modes; our wait (`Q`) is recorded.
    Busy {
        holders: Vec<SessionId>,
        known: Known,
    },
}

/// Whether [`CacheLocks::share_many`] can grant `files` (with the group's `shared` reads)
/// in one transaction: a put and the reads of each, the shared reads, a read of each
/// one's holders should it fail, and a compare per span of `free` (two per file without
/// them), within etcd's `--max-txn-ops`.
pub fn share_many_fits(
    files: &[(Ino, Vec<RangeRequest>)],
    shared: &[RangeRequest],
    free: &[(Ino, Ino)],
) -> bool {
    let max = crate::kv::ETCD_TXN_OPS_MAX;
    let ops: usize = files.iter().map(|(_, r)| 1 + r.len()).sum::<usize>() + shared.len();
    let compares = if covers_all(free, files) {
        free.len()
    } else {
        2 * files.len()
    };
    ops <= max && files.len() <= max && compares <= max
}

/// Whether every file lies in one of the inclusive spans of `free` (none: false).
fn covers_all(free: &[(Ino, Ino)], files: &[(Ino, Vec<RangeRequest>)]) -> bool {
    !free.is_empty()
        && files
            .iter()
            .all(|(i, _)| free.iter().any(|(a, b)| a.0 <= i.0 && i.0 <= b.0))
}

/// What [`CacheLocks::share_many`] granted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedMany {
    /// The store revision the locks are held from.
    pub revision: i64,
    /// The files now held shared, each with the answers to its reads, as of the grant.
    pub granted: Vec<(Ino, Vec<crate::kv::RangeResponse>)>,
    /// The answers to the group's shared reads, as of the grant.
    pub shared: Vec<crate::kv::RangeResponse>,
}

/// The first key after `key` (its successor in etcd's byte order).
fn after(key: &[u8]) -> Vec<u8> {
    let mut k = key.to_vec();
    k.push(0);
    k
}

/// One session's handle on the cache locks.
#[derive(Clone)]
pub struct CacheLocks {
    kv: Arc<dyn KvBackend>,
    keys: Keyspace,
    me: SessionId,
    lease: i64,
}

/// Attempts before reporting `Busy` with nobody named (a hot lock changing hands under
/// us: the caller waits for the next change).
const ACQUIRE_TRIES: usize = 4;

impl CacheLocks {
    /// The cache locks of session `me`, whose lease is `lease`.
    pub fn new(kv: Arc<dyn KvBackend>, keys: Keyspace, me: SessionId, lease: i64) -> Self {
        CacheLocks {
            kv,
            keys,
            me,
            lease,
        }
    }

    /// This session.
    pub fn session(&self) -> SessionId {
        self.me
    }

    /// The holders in a range answer.
    fn holders(&self, r: &crate::kv::RangeResponse) -> Vec<(SessionId, Option<LockMode>)> {
        r.kvs
            .iter()
            .filter_map(|kv| match self.keys.parse(&kv.key) {
                Some(KeyKind::CacheLock(_, s)) => {
                    let m = decode_at::<CacheLock>(&self.keys, &kv.key, &kv.value);
                    if let Err(e) = &m {
                        log::warn!("{e}: counted as an exclusive lock");
                    }
                    Some((s, m.ok().map(|c| c.mode)))
                }
                _ => None,
            })
            .collect()
    }

    /// Takes (or upgrades to) `want` on `ino` when no other session holds a conflicting
    /// mode, reading `extra` in the same transaction; otherwise records that we wait.
    /// `known`: the holders as the caller last knew them (`None`: assume nobody). One
    /// round trip when that is right.
    pub async fn acquire(
        &self,
        ino: Ino,
        want: LockMode,
        known: Option<Known>,
        extra: Option<Vec<u8>>,
    ) -> Result<Acquired, MetaError> {
        let range = self.keys.cache_locks(ino);
        let mine = self.keys.cache_lock(ino, self.me);
        let wait_key = self.keys.cache_want(ino, self.me);
        let value = CacheLock { mode: want }.encode();
        let read_range =
            || TxnOp::Range(RangeRequest::range(range.start.clone(), range.end.clone()));
        let range_of = |resp: &crate::kv::TxnResponse, at: usize| match resp.responses.get(at) {
            Some(TxnOpResponse::Range(r)) => Some(Known {
                revision: resp.revision,
                holders: self.holders(r),
            }),
            _ => None,
        };
        let mut known = known;
        for _ in 0..ACQUIRE_TRIES {
            let busy = known
                .as_ref()
                .map(|k| conflicting(&k.holders, self.me, want))
                .unwrap_or_default();
            if busy.is_empty() {
                // Nobody is in the way as far as we know: take it, on the compare that the
                // other holders did not change since (or that there are none). Our own key
                // is left out: only we write it, and a grant resent after its answer was
                // lost must find the others as they were, not our key just put.
                let others = [
                    (range.start.clone(), mine.clone()),
                    (after(&mine), range.end.clone()),
                ];
                let compares = others
                    .into_iter()
                    .map(|(from, to)| match &known {
                        Some(k) => Compare {
                            key: from,
                            range_end: Some(to),
                            op: CompareOp::Less,
                            target: CompareTarget::ModRevision(k.revision + 1),
                        },
                        None => Compare::range_empty(from, to),
                    })
                    .collect();
                let mut success = vec![
                    TxnOp::Put(PutOp {
                        key: mine.clone(),
                        value: value.clone(),
                        lease: self.lease,
                    }),
                    TxnOp::delete(wait_key.clone()),
                ];
                if let Some(k) = &extra {
                    success.push(TxnOp::Range(RangeRequest::key(k.clone())));
                }
                // Refused: the holders come with the answer, and our wait is recorded in
                // the same round trip (needless when they turn out not to conflict, and
                // then harmless: holders give way only to a conflicting wait).
                let t = Txn {
                    compares,
                    success,
                    failure: vec![
                        read_range(),
                        TxnOp::Put(PutOp {
                            key: wait_key.clone(),
                            value: value.clone(),
                            lease: self.lease,
                        }),
                    ],
                };
                let resp = self.kv.txn_idempotent(t).await?;
                if resp.succeeded {
                    let extra = match resp.responses.get(2) {
                        Some(TxnOpResponse::Range(r)) => r.kvs.first().cloned(),
                        _ => None,
                    };
                    return Ok(Acquired::Granted {
                        revision: resp.revision,
                        extra,
                    });
                }
                let now = range_of(&resp, 0).unwrap_or_default();
                let holders = conflicting(&now.holders, self.me, want);
                if !holders.is_empty() {
                    return Ok(Acquired::Busy {
                        holders,
                        known: now,
                    });
                }
                known = Some(now);
                continue;
            }
            // Someone is in the way: say that we wait, and see who holds it now.
            let t = Txn {
                compares: vec![],
                success: vec![
                    TxnOp::Put(PutOp {
                        key: wait_key.clone(),
                        value: value.clone(),
                        lease: self.lease,
                    }),
                    read_range(),
                ],
                failure: vec![],
            };
            let resp = self.kv.txn_idempotent(t).await?;
            let now = range_of(&resp, 1).unwrap_or_default();
            let holders = conflicting(&now.holders, self.me, want);
            if holders.is_empty() {
                known = Some(now);
                continue;
            }
            return Ok(Acquired::Busy {
                holders,
                known: now,
            });
        }
        Ok(Acquired::Busy {
            holders: Vec::new(),
            known: known.unwrap_or_default(),
        })
    }

    /// Takes the shared lock of each of `files` that no other session holds exclusively
    /// and this one holds not at all, each file's `reads` (its inode, its extents) done
    /// at the grant: the files of a directory listing at once, so that `ls -l` does not
    /// take one lock per stat. One round trip when no other session holds any of them
    /// (a node listing files nobody else uses): a transaction granting all on the compare
    /// that their other holders' ranges are empty, which reads the holders when it fails.
    /// Then a second one grants the free files on the compare that their holders did not
    /// change since. Files with a conflicting holder are left out, and a failed compare
    /// grants nothing: their own operations take them one at a time. `None` too when the
    /// files' ops pass [`share_many_fits`]. `shared`: reads for the whole group (the
    /// extents of a run of neighbouring inodes in one range: a read per file was a third
    /// of the etcd operations of a cold `ls -l`), done with the grant. `free`: inclusive
    /// spans of inode numbers in which the caller holds no lock, together covering the
    /// files: the first transaction then compares that each span has no lock key at all,
    /// a compare per span instead of two per file (stronger; a key of ours there, say from
    /// a grant applied with its answer lost, sends it to the second transaction). Files
    /// outside them: two compares each, as without.
    pub async fn share_many(
        &self,
        files: &[(Ino, Vec<RangeRequest>)],
        shared: &[RangeRequest],
        free: &[(Ino, Ino)],
    ) -> Result<Option<SharedMany>, MetaError> {
        if files.is_empty() || !share_many_fits(files, shared, free) {
            return Ok(None);
        }
        let holders_of = |ino: Ino| {
            let r = self.keys.cache_locks(ino);
            TxnOp::Range(RangeRequest::range(r.start, r.end))
        };
        // Nobody else holds any (our own key left out, as in `acquire` with nothing
        // known: a grant resent after its answer was lost grants again). Reading the
        // holders takes a round trip that etcd spent most of a cold `ls -l` on
        // (benches/listing.sh); this node's own listings find them free.
        let compares = if covers_all(free, files) {
            free.iter()
                .map(|(first, last)| {
                    Compare::range_empty(
                        self.keys.cache_locks(*first).start,
                        self.keys.cache_locks(*last).end,
                    )
                })
                .collect()
        } else {
            files
                .iter()
                .flat_map(|(ino, _)| {
                    let range = self.keys.cache_locks(*ino);
                    let mine = self.keys.cache_lock(*ino, self.me);
                    [
                        Compare::range_empty(range.start, mine.clone()),
                        Compare::range_empty(after(&mine), range.end),
                    ]
                })
                .collect()
        };
        let all: Vec<(Ino, &[RangeRequest])> =
            files.iter().map(|(i, r)| (*i, r.as_slice())).collect();
        let first = self
            .kv
            .txn_idempotent(Txn {
                compares,
                // No delete of a wait of ours: there is none to end when nobody else
                // holds the files (a wait left by an operation that gave up is
                // harmless: holders give way on a wait's put, long seen).
                success: self.grant_ops(&all, false, shared),
                failure: files.iter().map(|(ino, _)| holders_of(*ino)).collect(),
            })
            .await?;
        if first.succeeded {
            return Ok(Some(Self::granted(&all, false, shared, first)));
        }
        // Someone holds some of them: grant the free ones as the holders were read.
        let seen = first;
        let (mut compares, mut free) = (Vec::new(), Vec::new());
        let mut ops = shared.len();
        for ((ino, reads), r) in files.iter().zip(&seen.responses) {
            let TxnOpResponse::Range(r) = r else {
                continue;
            };
            // A shared key of ours here is one the caller does not know it holds (it
            // asks for files it does not hold): most likely the first transaction,
            // applied with its answer lost. Granted again, it becomes one it knows. An
            // exclusive one is never turned shared here.
            let holders = self.holders(r);
            let mine_exclusive = holders
                .iter()
                .any(|(s, m)| *s == self.me && *m != Some(LockMode::Shared));
            if mine_exclusive || !conflicting(&holders, self.me, LockMode::Shared).is_empty() {
                continue;
            }
            // Its put, its wait's delete and its reads must fit beside the others'.
            ops += 2 + reads.len();
            if ops > crate::kv::ETCD_TXN_OPS_MAX {
                break;
            }
            // The other holders as read, our own key left out (as in `acquire`): a grant
            // resent after its answer was lost grants again.
            let range = self.keys.cache_locks(*ino);
            let mine = self.keys.cache_lock(*ino, self.me);
            for (from, to) in [(range.start, mine.clone()), (after(&mine), range.end)] {
                compares.push(Compare {
                    key: from,
                    range_end: Some(to),
                    op: CompareOp::Less,
                    target: CompareTarget::ModRevision(seen.revision + 1),
                });
            }
            free.push((*ino, reads.as_slice()));
        }
        if free.is_empty() {
            return Ok(None);
        }
        let resp = self
            .kv
            .txn_idempotent(Txn {
                compares,
                success: self.grant_ops(&free, true, shared),
                failure: vec![],
            })
            .await?;
        if !resp.succeeded {
            return Ok(None);
        }
        Ok(Some(Self::granted(&free, true, shared, resp)))
    }

    /// The writes granting `files` shared, each followed by its reads (and, with
    /// `end_waits`, by the delete of a wait of ours), then the shared reads.
    fn grant_ops(
        &self,
        files: &[(Ino, &[RangeRequest])],
        end_waits: bool,
        shared: &[RangeRequest],
    ) -> Vec<TxnOp> {
        let value = CacheLock {
            mode: LockMode::Shared,
        }
        .encode();
        let mut ops = Vec::new();
        for (ino, reads) in files {
            ops.push(TxnOp::Put(PutOp {
                key: self.keys.cache_lock(*ino, self.me),
                value: value.clone(),
                lease: self.lease,
            }));
            if end_waits {
                // A wait of ours left by an operation that gave up on the lock is over.
                ops.push(TxnOp::delete(self.keys.cache_want(*ino, self.me)));
            }
            ops.extend(reads.iter().cloned().map(TxnOp::Range));
        }
        ops.extend(shared.iter().cloned().map(TxnOp::Range));
        ops
    }

    /// What a transaction of [`CacheLocks::grant_ops`] of `files` granted.
    fn granted(
        files: &[(Ino, &[RangeRequest])],
        end_waits: bool,
        shared: &[RangeRequest],
        resp: crate::kv::TxnResponse,
    ) -> SharedMany {
        let mut answers = resp.responses.into_iter().map(|r| match r {
            TxnOpResponse::Range(r) => r,
            _ => crate::kv::RangeResponse::default(),
        });
        let mut out = Vec::with_capacity(files.len());
        for (ino, reads) in files {
            // The put and the delete answer nothing of use.
            answers.next();
            if end_waits {
                answers.next();
            }
            out.push((*ino, answers.by_ref().take(reads.len()).collect()));
        }
        SharedMany {
            revision: resp.revision,
            granted: out,
            shared: answers.take(shared.len()).collect(),
        }
    }

    /// Deletes this session's keys of `inos` (at most `ETCD_TXN_OPS_MAX`): after a
    /// [`CacheLocks::share_many`] whose answer was lost, which may have put them.
    /// Deleting is safe to repeat and leaves no lock the node does not know it holds.
    pub async fn unshare_many(&self, inos: &[Ino]) -> Result<(), MetaError> {
        let t = Txn {
            compares: vec![],
            success: inos
                .iter()
                .map(|ino| TxnOp::delete(self.keys.cache_lock(*ino, self.me)))
                .collect(),
            failure: vec![],
        };
        self.kv.txn_idempotent(t).await?;
        Ok(())
    }

    /// Deletes this session's key of `ino` if it is still the one put at `rev` (a grant
    /// the node does not know it holds); true when it was. A grant since stays.
    pub async fn drop_stray(&self, ino: Ino, rev: i64) -> Result<bool, MetaError> {
        let key = self.keys.cache_lock(ino, self.me);
        let t = Txn {
            compares: vec![Compare::mod_rev(key.clone(), rev)],
            success: vec![TxnOp::delete(key)],
            failure: vec![],
        };
        // Twice is once: the second finds the key gone (and says false).
        Ok(self.kv.txn_idempotent(t).await?.succeeded)
    }

    /// Gives the lock up (nothing if not held).
    pub async fn release(&self, ino: Ino) -> Result<(), MetaError> {
        let t = Txn {
            compares: vec![],
            success: vec![TxnOp::delete(self.keys.cache_lock(ino, self.me))],
            failure: vec![],
        };
        self.kv.txn_idempotent(t).await?;
        Ok(())
    }

    /// Exclusive to shared, keeping the caches: the holder's writes are all in etcd and
    /// on the device by now.
    pub async fn downgrade(&self, ino: Ino) -> Result<(), MetaError> {
        let value = CacheLock {
            mode: LockMode::Shared,
        }
        .encode();
        self.put(self.keys.cache_lock(ino, self.me), value).await
    }

    /// Stops waiting (an acquire that gave up).
    pub async fn withdraw(&self, ino: Ino) -> Result<(), MetaError> {
        let t = Txn {
            compares: vec![],
            success: vec![TxnOp::delete(self.keys.cache_want(ino, self.me))],
            failure: vec![],
        };
        self.kv.txn_idempotent(t).await?;
        Ok(())
    }

    async fn put(&self, key: Vec<u8>, value: Vec<u8>) -> Result<(), MetaError> {
        let t = Txn {
            compares: vec![],
            success: vec![TxnOp::Put(PutOp {
                key,
                value,
                lease: self.lease,
            })],
            failure: vec![],
        };
        self.kv.txn_idempotent(t).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{clock::ManualClock, model::MemEtcd};

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn modes_conflict_as_readers_and_writers() {
        use LockMode::*;
        assert!(!Shared.conflicts(Shared));
        assert!(Shared.conflicts(Exclusive));
        assert!(Exclusive.conflicts(Shared));
        let me = SessionId(1);
        let holders = [
            (SessionId(1), Some(Exclusive)),
            (SessionId(2), Some(Shared)),
            (SessionId(3), None),
        ];
        assert_eq!(conflicting(&holders, me, Shared), vec![SessionId(3)]);
        assert_eq!(
            conflicting(&holders, me, Exclusive),
            vec![SessionId(2), SessionId(3)]
        );
    }

    #[test]
    fn known_holders_follow_only_newer_events() {
        use LockMode::*;
        let mut k = Known {
            revision: 10,
            holders: vec![(SessionId(1), Some(Shared))],
        };
        k.apply(9, SessionId(2), Some(Some(Exclusive)));
        assert_eq!(k.holders.len(), 1, "an event the read already saw");
        k.apply(11, SessionId(1), Some(Some(Exclusive)));
        k.apply(12, SessionId(3), Some(Some(Shared)));
        k.apply(13, SessionId(1), None);
        assert_eq!(k.revision, 13);
        assert_eq!(k.holders, vec![(SessionId(3), Some(Shared))]);
    }

    /// A model etcd and two sessions' cache locks on it.
    fn two_sessions() -> (
        Arc<MemEtcd>,
        Arc<dyn KvBackend>,
        Keyspace,
        CacheLocks,
        CacheLocks,
    ) {
        let clock = Arc::new(ManualClock::new(crate::types::Timespec {
            sec: 1_000_000,
            nsec: 0,
        }));
        let etcd = Arc::new(MemEtcd::new(clock));
        let kv: Arc<dyn KvBackend> = etcd.clone();
        let keys = Keyspace::new("t").expect("prefix");
        let (a, b) = block_on(async {
            let la = kv.lease_grant(10).await.expect("lease").id;
            let lb = kv.lease_grant(10).await.expect("lease").id;
            (
                CacheLocks::new(kv.clone(), keys.clone(), SessionId(la as u64), la),
                CacheLocks::new(kv.clone(), keys.clone(), SessionId(lb as u64), lb),
            )
        });
        (etcd, kv, keys, a, b)
    }

    #[test]
    fn two_sessions_share_then_one_waits_for_exclusive() {
        let (_, kv, keys, a, b) = two_sessions();
        let ino = Ino(42);
        block_on(async {
            use LockMode::*;
            assert!(matches!(
                a.acquire(ino, Shared, None, None).await,
                Ok(Acquired::Granted { .. })
            ));
            assert!(matches!(
                b.acquire(ino, Shared, None, None).await,
                Ok(Acquired::Granted { .. })
            ));
            // An upgrade waits for the other reader and says so with a Q record.
            assert!(matches!(
                a.acquire(ino, Exclusive, None, None).await.expect("acquire"),
                Acquired::Busy { holders, .. } if holders == vec![b.session()]
            ));
            let q = kv
                .range(RangeRequest::key(keys.cache_want(ino, a.session())))
                .await
                .expect("range");
            assert_eq!(q.kvs.len(), 1);
            b.release(ino).await.expect("release");
            assert!(matches!(
                a.acquire(ino, Exclusive, None, None).await,
                Ok(Acquired::Granted { .. })
            ));
            // Granting cleared the wait record; the other reader now waits.
            let q = kv
                .range(RangeRequest::key(keys.cache_want(ino, a.session())))
                .await
                .expect("range");
            assert!(q.kvs.is_empty());
            assert!(matches!(
                b.acquire(ino, Shared, None, None).await,
                Ok(Acquired::Busy { .. })
            ));
            a.downgrade(ino).await.expect("downgrade");
            assert!(matches!(
                b.acquire(ino, Shared, None, None).await,
                Ok(Acquired::Granted { .. })
            ));
        });
    }

    #[test]
    fn share_many_grants_the_free_files_and_skips_a_writers() {
        let (etcd, _, keys, a, b) = two_sessions();
        block_on(async {
            use LockMode::*;
            // 1: b writes it; 2: b reads it; 3: free; 4: a shares it already (a grant
            // a does not know of); 5: a writes it.
            for (ino, who, mode) in [
                (1, &b, Exclusive),
                (2, &b, Shared),
                (4, &a, Shared),
                (5, &a, Exclusive),
            ] {
                assert!(matches!(
                    who.acquire(Ino(ino), mode, None, None).await,
                    Ok(Acquired::Granted { .. })
                ));
            }
            etcd.put_raw(&keys.inode(Ino(3)), b"attrs of 3");
            let ask: Vec<(Ino, Vec<RangeRequest>)> = (1..=5)
                .map(|i| (Ino(i), vec![RangeRequest::key(keys.inode(Ino(i)))]))
                .collect();
            let got = a
                .share_many(&ask, &[], &[])
                .await
                .expect("share")
                .expect("granted");
            let inos: Vec<u64> = got.granted.iter().map(|(i, _)| i.0).collect();
            assert_eq!(inos, [2, 3, 4]);
            let value = |n: usize| got.granted[n].1[0].kvs.first().map(|kv| kv.value.clone());
            assert_eq!(value(1), Some(b"attrs of 3".to_vec()));
            assert_eq!(value(0), None, "no inode record put for 2");
            // a's exclusive lock of 5 was left as it was: b may not even read.
            assert!(matches!(
                b.acquire(Ino(5), Shared, None, None).await,
                Ok(Acquired::Busy { .. })
            ));
            // Held shared by a now: b's exclusive request must wait for a.
            assert!(matches!(
                b.acquire(Ino(3), Exclusive, None, None).await,
                Ok(Acquired::Busy { .. })
            ));
            // Too many at once: nothing.
            let many: Vec<(Ino, Vec<RangeRequest>)> = (10..80)
                .map(|i| (Ino(i), vec![RangeRequest::key(keys.inode(Ino(i)))]))
                .collect();
            assert!(!share_many_fits(&many, &[], &[]));
            assert_eq!(a.share_many(&many, &[], &[]).await.expect("share"), None);
        });
    }

    #[test]
    fn share_many_of_files_nobody_holds_takes_one_transaction_and_may_be_resent() {
        let (etcd, _, keys, a, b) = two_sessions();
        block_on(async {
            use LockMode::*;
            for i in 1..=3 {
                etcd.put_raw(&keys.inode(Ino(i)), format!("attrs of {i}").as_bytes());
            }
            let ask: Vec<(Ino, Vec<RangeRequest>)> = (1..=3)
                .map(|i| (Ino(i), vec![RangeRequest::key(keys.inode(Ino(i)))]))
                .collect();
            let before = etcd.txn_count();
            let got = a
                .share_many(&ask, &[], &[])
                .await
                .expect("share")
                .expect("granted");
            assert_eq!(
                etcd.txn_count() - before,
                1,
                "no separate read of the holders"
            );
            let inos: Vec<u64> = got.granted.iter().map(|(i, _)| i.0).collect();
            assert_eq!(inos, [1, 2, 3]);
            assert_eq!(
                got.granted[2].1[0].kvs.first().map(|kv| kv.value.clone()),
                Some(b"attrs of 3".to_vec())
            );
            // The same grant sent again (its first answer lost) grants again, leaving one
            // key per file.
            let again = a
                .share_many(&ask, &[], &[])
                .await
                .expect("share")
                .expect("granted");
            assert_eq!(again.granted.len(), 3);
            let held = keys.cache_locks(Ino(2));
            assert_eq!(etcd.dump(&held.start, &held.end).len(), 1);
            // Held: a writer elsewhere must wait for a.
            assert!(matches!(
                b.acquire(Ino(2), Exclusive, None, None).await,
                Ok(Acquired::Busy { .. })
            ));
            // One of them held by another reader: two transactions, all still granted.
            let ask: Vec<(Ino, Vec<RangeRequest>)> = (5..=7)
                .map(|i| (Ino(i), vec![RangeRequest::key(keys.inode(Ino(i)))]))
                .collect();
            assert!(matches!(
                b.acquire(Ino(6), Shared, None, None).await,
                Ok(Acquired::Granted { .. })
            ));
            let before = etcd.txn_count();
            let got = a
                .share_many(&ask, &[], &[])
                .await
                .expect("share")
                .expect("granted");
            assert_eq!(etcd.txn_count() - before, 2);
            assert_eq!(got.granted.len(), 3);
        });
    }

    #[test]
    fn share_many_of_a_whole_free_span_takes_one_compare_and_falls_back_on_any_key_in_it() {
        let (etcd, _, keys, a, b) = two_sessions();
        block_on(async {
            use LockMode::*;
            let ask = |inos: &[u64]| -> Vec<(Ino, Vec<RangeRequest>)> {
                inos.iter()
                    .map(|&i| (Ino(i), vec![RangeRequest::key(keys.inode(Ino(i)))]))
                    .collect()
            };
            // Nobody holds 1..=3: one transaction, one compare.
            let before = etcd.txn_count();
            let got = a
                .share_many(&ask(&[1, 2, 3]), &[], &[(Ino(1), Ino(3))])
                .await
                .expect("share")
                .expect("granted");
            assert_eq!(etcd.txn_count() - before, 1);
            assert_eq!(got.granted.len(), 3);
            // Sent again (its first answer lost): our keys fail the span's compare, and
            // the second transaction grants them again, one key per file.
            let again = a
                .share_many(&ask(&[1, 2, 3]), &[], &[(Ino(1), Ino(3))])
                .await
                .expect("share")
                .expect("granted");
            let inos: Vec<u64> = again.granted.iter().map(|(i, _)| i.0).collect();
            assert_eq!(inos, [1, 2, 3]);
            for i in 1..=3 {
                let held = keys.cache_locks(Ino(i));
                assert_eq!(etcd.dump(&held.start, &held.end).len(), 1, "inode {i}");
            }
            // b writes 6, which lies between the files asked for (5 and 7) but is not one
            // of them: the span is not free, and the second transaction still grants both.
            assert!(matches!(
                b.acquire(Ino(6), Exclusive, None, None).await,
                Ok(Acquired::Granted { .. })
            ));
            let before = etcd.txn_count();
            let got = a
                .share_many(&ask(&[5, 7]), &[], &[(Ino(5), Ino(7))])
                .await
                .expect("share")
                .expect("granted");
            assert_eq!(etcd.txn_count() - before, 2);
            let inos: Vec<u64> = got.granted.iter().map(|(i, _)| i.0).collect();
            assert_eq!(inos, [5, 7]);
            // And b's writer of 7 now waits for a.
            assert!(matches!(
                b.acquire(Ino(7), Exclusive, None, None).await,
                Ok(Acquired::Busy { .. })
            ));
            // a holds 11 itself: spans around it still take one transaction.
            assert!(matches!(
                a.acquire(Ino(11), Exclusive, None, None).await,
                Ok(Acquired::Granted { .. })
            ));
            let before = etcd.txn_count();
            let got = a
                .share_many(
                    &ask(&[10, 12]),
                    &[],
                    &[(Ino(10), Ino(10)), (Ino(12), Ino(12))],
                )
                .await
                .expect("share")
                .expect("granted");
            assert_eq!(etcd.txn_count() - before, 1);
            assert_eq!(got.granted.len(), 2);
            // A file outside the spans: two compares each, as without spans.
            let before = etcd.txn_count();
            let got = a
                .share_many(&ask(&[20, 30]), &[], &[(Ino(20), Ino(25))])
                .await
                .expect("share")
                .expect("granted");
            assert_eq!(etcd.txn_count() - before, 1);
            assert_eq!(got.granted.len(), 2);
            // 126 files fit one transaction with one compare, not with two each.
            let many: Vec<(Ino, Vec<RangeRequest>)> =
                (100..226).map(|i| (Ino(i), Vec::new())).collect();
            let span = [(Ino(100), Ino(225))];
            assert!(share_many_fits(&many, &[], &span));
            assert!(!share_many_fits(&many, &[], &[]));
            let got = a
                .share_many(&many, &[], &span)
                .await
                .expect("share")
                .expect("granted");
            assert_eq!(got.granted.len(), 126);
        });
    }

    #[test]
    fn share_many_answers_the_groups_shared_reads_on_either_path() {
        let (etcd, _, keys, a, b) = two_sessions();
        block_on(async {
            for i in 1..=4 {
                etcd.put_raw(&keys.extent(Ino(i), 0), format!("extent of {i}").as_bytes());
            }
            let span = RangeRequest::range(keys.extents(Ino(1)).start, keys.extents(Ino(4)).end);
            let ask = |from, to| -> Vec<(Ino, Vec<RangeRequest>)> {
                (from..=to)
                    .map(|i| (Ino(i), vec![RangeRequest::key(keys.inode(Ino(i)))]))
                    .collect()
            };
            let shared = [span.clone()];
            let got = a
                .share_many(&ask(1, 2), &shared, &[])
                .await
                .expect("share")
                .expect("granted");
            assert_eq!(got.granted.len(), 2);
            assert_eq!(got.shared.len(), 1);
            assert_eq!(
                got.shared[0].kvs.len(),
                4,
                "the whole span, read with the grant"
            );
            // Someone else holds 4: the second transaction answers them too.
            assert!(matches!(
                b.acquire(Ino(4), LockMode::Exclusive, None, None).await,
                Ok(Acquired::Granted { .. })
            ));
            let got = a
                .share_many(&ask(3, 4), &shared, &[])
                .await
                .expect("share")
                .expect("granted");
            let inos: Vec<u64> = got.granted.iter().map(|(i, _)| i.0).collect();
            assert_eq!(inos, [3]);
            assert_eq!(got.shared[0].kvs.len(), 4);
        });
    }
}
