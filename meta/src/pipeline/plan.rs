//! `plan`: a PURE function from one mutation and a snapshot of what it read to the
//! compares and ops of its share of an etcd transaction.
//!
//! The snapshot is a map of keys and ranges read at some revision. When the snapshot
//! lacks something the mutation needs, `plan` says which reads it needs
//! ([`Planned::Need`]); the committer reads them (batched with other mutations' reads)
//! and calls `plan` again. Every value the plan depends on is guarded by a compare
//! (usually `mod_revision == seen`), so a plan made from a stale snapshot can only fail
//! its compares, never commit a wrong result. Blind mutations (a plain create) need no
//! reads at all: they compare "name absent" and "parent exists" and write.

use std::collections::{BTreeMap, HashMap};

use crate::{
    acl,
    codec::{
        decode_at, Dentry, DirParent, Extent, InoCounter, InodeAttr, Owner, Record, Released,
        SymlinkTarget, XattrValue, FLAGS_META, FLAG_NO_XATTRS,
    },
    error::MetaError,
    keys::Keyspace,
    kv::{Compare, KeyValue, PutOp, RangeRequest, RangeResponse, TxnOp},
    pipeline::mutation::{
        AclInherit, DevRange, ExtentsExpect, ExtentsKnown, GroupLayout, Mutation, Outcome,
        RenameMode, TimeSet, UnlinkExpect, XattrMode,
    },
    types::{name_is_valid, FileType, Ino, SessionId, Timespec, XATTR_NAME_LEN_MAX},
};

/// Most extents one SetExtents may touch (keeps one mutation well inside a txn).
pub const EXTENTS_PER_MUTATION_MAX: usize = 48;
/// Ops a plan may have after logging released ranges (the rest of a mutation adds a few;
/// a transaction holds at most `ETCD_TXN_OPS_MAX`).
const RELEASE_OPS_BUDGET: usize = 112;
/// Deepest directory nesting the rename subtree check walks.
pub const DIR_DEPTH_MAX: usize = 96;

/// Key of a range read in the snapshot.
type RangeKey = (Vec<u8>, Option<Vec<u8>>, i64, bool);

fn range_key(r: &RangeRequest) -> RangeKey {
    (r.key.clone(), r.range_end.clone(), r.limit, r.descending)
}

/// What a mutation has read: single keys (present or known absent) and ranges.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    keys: HashMap<Vec<u8>, Option<KeyValue>>,
    ranges: HashMap<RangeKey, RangeResponse>,
}

impl Snapshot {
    /// Records the answer to `req`.
    pub fn insert(&mut self, req: &RangeRequest, resp: RangeResponse) {
        if req.range_end.is_none() {
            self.keys
                .insert(req.key.clone(), resp.kvs.into_iter().next());
        } else {
            self.ranges.insert(range_key(req), resp);
        }
    }

    /// Records a single key's value (None = absent).
    pub fn insert_key(&mut self, key: Vec<u8>, kv: Option<KeyValue>) {
        self.keys.insert(key, kv);
    }

    /// Forgets everything overlapping `[start, end)` (or the single key), so the next
    /// plan re-reads it.
    pub fn invalidate(&mut self, start: &[u8], end: Option<&[u8]>) {
        self.keys.retain(|k, _| !crate::kv::in_range(start, end, k));
        self.ranges
            .retain(|(s, e, _, _), _| !crate::kv::ranges_overlap(s, e.as_deref(), start, end));
    }

    /// Whether anything read overlaps `[start, end)` (or the single key).
    pub fn overlaps(&self, start: &[u8], end: Option<&[u8]>) -> bool {
        self.keys.keys().any(|k| crate::kv::in_range(start, end, k))
            || self
                .ranges
                .keys()
                .any(|(s, e, _, _)| crate::kv::ranges_overlap(s, e.as_deref(), start, end))
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.keys.clear();
        self.ranges.clear();
    }

    fn key(&self, k: &[u8]) -> Option<Option<&KeyValue>> {
        self.keys.get(k).map(Option::as_ref)
    }

    fn range(&self, r: &RangeRequest) -> Option<&RangeResponse> {
        self.ranges.get(&range_key(r))
    }
}

/// Inputs to `plan` besides the mutation and the snapshot.
#[derive(Clone, Debug)]
pub struct PlanCtx<'a> {
    /// The key space.
    pub keys: &'a Keyspace,
    /// Time to stamp on changed inodes.
    pub now: Timespec,
    /// This node's session (orphan ownership).
    pub session: SessionId,
    /// The inode number reserved for a Create.
    pub new_ino: Option<Ino>,
    /// Filesystem block size: truncation frees whole blocks only.
    pub block_size: u64,
    /// Where allocation groups lie (released ranges are logged per group); `None`: one.
    pub groups: Option<GroupLayout>,
    /// A created regular file's cache lock is taken in its create (`Config::lock_at_create`).
    pub lock_at_create: bool,
    /// A read-only mount ([`crate::pipeline::Config::read_only`]).
    pub read_only: bool,
}

/// A mutation's share of a transaction.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// Conditions that make the plan valid.
    pub compares: Vec<Compare>,
    /// Writes.
    pub ops: Vec<TxnOp>,
    /// Indices into `ops` of range deletes whose `prev_kvs` are freed extents.
    pub freed_from_ops: Vec<usize>,
    /// Directories (or inodes) whose mtime/ctime should be coalesced-touched after the
    /// commit, with whether mtime changes too.
    pub touch: Vec<(Ino, bool)>,
    /// The outcome (revision filled in at commit).
    pub outcome: Outcome,
}

/// The result of planning.
#[allow(
    clippy::large_enum_variant,
    reason = "built once per plan call, moved not copied"
)]
#[derive(Clone, Debug, PartialEq)]
pub enum Planned {
    /// Ready to commit.
    Ready(Plan),
    /// These reads are needed first.
    Need(Vec<RangeRequest>),
    /// The mutation fails with this error (nothing to commit).
    Fail(MetaError),
}

enum Stop {
    Need(Vec<RangeRequest>),
    Fail(MetaError),
}

impl From<MetaError> for Stop {
    fn from(e: MetaError) -> Self {
        Stop::Fail(e)
    }
}

type R<T> = Result<T, Stop>;

struct P<'a> {
    snap: &'a Snapshot,
    ctx: &'a PlanCtx<'a>,
    plan: Plan,
    /// An inode whose every extent key the submitter expects to be exactly these (an
    /// unlink planned from a file's record, [`UnlinkExpect::extents`]): its extents are
    /// released from them, guarded by compares, instead of read.
    full_map: Option<(Ino, &'a [Extent])>,
}

impl<'a> P<'a> {
    fn keys(&self) -> &'a Keyspace {
        self.ctx.keys
    }

    /// Makes sure every request is in the snapshot, asking for all missing ones at once.
    fn need(&self, reqs: &[RangeRequest]) -> R<()> {
        let missing: Vec<RangeRequest> = reqs
            .iter()
            .filter(|r| {
                if r.range_end.is_none() {
                    self.snap.key(&r.key).is_none()
                } else {
                    self.snap.range(r).is_none()
                }
            })
            .cloned()
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(Stop::Need(missing))
        }
    }

    fn kv(&self, key: &[u8]) -> R<Option<&'a KeyValue>> {
        match self.snap.key(key) {
            Some(v) => Ok(v),
            None => Err(Stop::Need(vec![RangeRequest::key(key.to_vec())])),
        }
    }

    /// For blind compares: if a failed commit told us the key's state, fail the way the
    /// compare would (so a retry reports Exists/NotFound instead of looping).
    fn expect_absent(&self, key: &[u8]) -> R<()> {
        match self.snap.key(key) {
            Some(Some(_)) => Err(Stop::Fail(MetaError::Exists)),
            _ => Ok(()),
        }
    }

    fn expect_present(&self, key: &[u8]) -> R<()> {
        match self.snap.key(key) {
            Some(None) => Err(Stop::Fail(MetaError::NotFound)),
            _ => Ok(()),
        }
    }

    fn range(&self, req: RangeRequest) -> R<&'a RangeResponse> {
        match self.snap.range(&req) {
            Some(r) => Ok(r),
            None => Err(Stop::Need(vec![req])),
        }
    }

    fn decode<T: Record>(&self, kv: &KeyValue) -> R<T> {
        Ok(decode_at::<T>(self.keys(), &kv.key, &kv.value)?)
    }

    /// The inode and its mod revision, or None if absent.
    fn inode(&self, ino: Ino) -> R<Option<(InodeAttr, i64)>> {
        let key = self.keys().inode(ino);
        let Some(kv) = self.kv(&key)? else {
            return Ok(None);
        };
        let attr: InodeAttr = self.decode(kv)?;
        if attr.ino != ino {
            return Err(Stop::Fail(MetaError::Corrupt {
                key: self.keys().describe(&key),
                reason: format!("inode record says ino {}", attr.ino),
            }));
        }
        Ok(Some((attr, kv.mod_revision)))
    }

    fn dentry(&self, parent: Ino, name: &[u8]) -> R<Option<(Dentry, i64)>> {
        let key = self.keys().dentry(parent, name);
        let Some(kv) = self.kv(&key)? else {
            return Ok(None);
        };
        Ok(Some((self.decode(kv)?, kv.mod_revision)))
    }

    fn compare(&mut self, c: Compare) {
        if !self.plan.compares.contains(&c) {
            self.plan.compares.push(c);
        }
    }

    fn put<T: Record>(&mut self, key: Vec<u8>, rec: &T) {
        self.plan.ops.push(TxnOp::put(key, rec.encode()));
    }

    fn delete(&mut self, key: Vec<u8>) {
        self.plan.ops.push(TxnOp::delete(key));
    }

    fn delete_range(&mut self, r: crate::keys::KeyRange, freed: bool) {
        if freed {
            self.plan.freed_from_ops.push(self.plan.ops.len());
        }
        self.plan
            .ops
            .push(TxnOp::delete_range(r.start, r.end, freed));
    }

    /// Deletes an inode and everything hanging off it; its extents are released (see
    /// [`P::drop_extents`]). `no_extents`: the caller expects none (a file of size 0 from
    /// a cache): proven by a range compare instead of a read.
    fn delete_inode_tree(&mut self, ino: Ino, kind: FileType, no_extents: bool) -> R<()> {
        let k = self.keys();
        if kind == FileType::Regular {
            if no_extents {
                let r = k.extents(ino);
                self.compare(Compare::range_empty(r.start, r.end));
            } else {
                self.drop_extents(ino, 0)?;
            }
            // Every node's cache lock of it goes too (theirs are only caches of a file
            // that no longer exists).
            self.delete_range(k.cache_locks(ino), false);
        }
        self.delete(k.inode(ino));
        self.delete_range(k.xattrs(ino), false);
        match kind {
            FileType::Symlink => self.delete(k.symlink(ino)),
            FileType::Directory => self.delete(k.dir_parent(ino)),
            _ => {}
        }
        self.plan.outcome.removed = Some(ino);
        Ok(())
    }

    /// Deletes the extents of `ino` from file offset `from` on. Up to
    /// [`EXTENTS_PER_MUTATION_MAX`] of them are read first and their device ranges logged
    /// as released in this transaction (compared, so nothing read can change unseen);
    /// beyond that the range is deleted blind and its ranges only reported freed.
    fn drop_extents(&mut self, ino: Ino, from: u64) -> R<()> {
        let k = self.keys();
        if let Some(list) = self.expected_full_map(ino).filter(|_| from == 0) {
            self.release_expected_extents(ino, list);
            return Ok(());
        }
        if self.range(extents_req(k, ino, from))?.more {
            self.delete_range(k.extents_between(ino, from, u64::MAX), true);
            return Ok(());
        }
        self.release_read_extents(ino, from)
    }

    /// Whether `ino` has more extents than one transaction releases.
    fn extents_exceed_one_txn(&mut self, ino: Ino) -> R<bool> {
        if self.expected_full_map(ino).is_some() {
            // Accepted only within one transaction's worth (`usable_full_map`).
            return Ok(false);
        }
        Ok(self.range(extents_req(self.keys(), ino, 0))?.more)
    }

    /// Releases the extents of `ino` from `from` on that one read returns (up to
    /// [`EXTENTS_PER_MUTATION_MAX`]), each compared so nothing read changes unseen, and
    /// deletes their keys: through the last one read when more follow (a large file taken
    /// apart in chunks), else all of them from `from` on.
    fn release_read_extents(&mut self, ino: Ino, from: u64) -> R<()> {
        let k = self.keys();
        let resp = self.range(extents_req(k, ino, from))?;
        let mut last = from;
        for kv in &resp.kvs {
            let Some(crate::keys::KeyKind::Extent(_, off)) = k.parse(&kv.key) else {
                return Err(Stop::Fail(MetaError::Invalid("bad extent key")));
            };
            let e = Extent::decode_value(off, &kv.value)
                .map_err(|e| Stop::Fail(e.at(k.describe(&kv.key))))?;
            self.compare(Compare::mod_rev(kv.key.clone(), kv.mod_revision));
            self.release(DevRange {
                dev_off: e.dev_off,
                len: e.len,
            });
            last = off;
        }
        let to = if resp.more {
            last.saturating_add(1)
        } else {
            u64::MAX
        };
        let range = k.extents_between(ino, from, to);
        // Nothing may have appeared in the range since it was read.
        self.compare(Compare {
            key: range.start.clone(),
            range_end: Some(range.end.clone()),
            op: crate::kv::CompareOp::Less,
            target: crate::kv::CompareTarget::ModRevision(resp.revision + 1),
        });
        self.delete_range(range, false);
        Ok(())
    }

    fn expected_full_map(&self, ino: Ino) -> Option<&'a [Extent]> {
        self.full_map
            .filter(|(i, _)| *i == ino)
            .map(|(_, list)| list)
    }

    /// Releases the extents of `ino` as the submitter expects them, and deletes every
    /// extent key of it. Each expected key is compared by its exact value and every gap
    /// between and after them is compared empty, so the commit happens only if etcd holds
    /// precisely these keys: what is released is what was there.
    fn release_expected_extents(&mut self, ino: Ino, list: &[Extent]) {
        let k = self.keys();
        let all = k.extents(ino);
        let mut gap_start = all.start.clone();
        for e in list {
            let key = k.extent(ino, e.file_off);
            if gap_start < key {
                self.compare(Compare::range_empty(gap_start, key.clone()));
            }
            self.compare(Compare::value(key, e.encode_value()));
            self.release(DevRange {
                dev_off: e.dev_off,
                len: e.len,
            });
            gap_start = k.extent(ino, e.file_off.saturating_add(1));
        }
        self.compare(Compare::range_empty(gap_start, all.end.clone()));
        self.delete_range(all, false);
    }

    /// Logs a freed device range as `R` records (one per allocation group) in this
    /// transaction, and reports it freed.
    fn release(&mut self, r: DevRange) {
        if r.len == 0 {
            return;
        }
        let pieces = split_by_group(r, self.ctx.groups);
        if self.plan.ops.len() + pieces.len() > RELEASE_OPS_BUDGET {
            // Past the budget the mutation would not fit one transaction: only report it
            // (the filesystem frees it after the commit, unlogged).
            self.plan.outcome.freed.push(r);
            return;
        }
        for piece in pieces {
            self.put(
                self.keys().released(piece.dev_off),
                &Released { len: piece.len },
            );
            self.plan.outcome.released.push(piece);
        }
        self.plan.outcome.freed.push(r);
    }

    /// Drops one link of a non-directory: decrement, orphan, or delete. The last link of
    /// a regular file open on any node (an `H` record, see [`P::open_anywhere`]) leaves an
    /// orphan, which the last close anywhere reclaims (`Unhold`).
    fn drop_link(
        &mut self,
        mut attr: InodeAttr,
        keep_open: bool,
        blind: bool,
        no_extents: bool,
        own_dropped: bool,
    ) -> R<()> {
        let k = self.keys();
        attr.ctime = self.ctx.now;
        if attr.nlink > 1 {
            attr.nlink -= 1;
            self.put(k.inode(attr.ino), &attr);
            self.plan.outcome.attr = Some(attr);
            return Ok(());
        }
        let regular = attr.kind == FileType::Regular;
        // A submitter that holds the file keeps it without looking: its own `Unhold`
        // reclaims it, or, if that raced ahead of this commit, the orphan scan does.
        let open = keep_open || (regular && self.open_anywhere(attr.ino, blind, own_dropped)?);
        if open || (regular && !no_extents && self.extents_exceed_one_txn(attr.ino)?) {
            // Kept as an orphan while open somewhere; also when its extents cannot all be
            // logged as released in one transaction: the orphan is then reclaimed in
            // chunks (`plan_reclaim`), and a crash part-way leaves it to the orphan scan
            // instead of leaking the rest.
            attr.nlink = 0;
            self.put(k.inode(attr.ino), &attr);
            self.put(
                k.orphan(attr.ino),
                &Owner {
                    session: self.ctx.session,
                },
            );
            self.plan.outcome.orphaned = Some(attr.ino);
            self.plan.outcome.attr = Some(attr);
        } else {
            self.delete_inode_tree(attr.ino, attr.kind, no_extents)?;
        }
        Ok(())
    }

    /// Whether any node has `ino` open, as this plan will commit it: from the open records
    /// read (one that exists is compared unchanged, so its holder's close cannot slip in
    /// between; none is compared still none, so no open can), or, `blind`, guessed "none"
    /// and compared so (a wrong guess fails the commit, whose retry reads them).
    /// `own_dropped`: this session's own record goes in this transaction and does not count.
    fn open_anywhere(&mut self, ino: Ino, blind: bool, own_dropped: bool) -> R<bool> {
        let k = self.keys();
        let own = own_dropped.then(|| k.held(ino, self.ctx.session));
        let req = holders_req(k, ino);
        let r = match self.snap.range(&req) {
            Some(r) => r,
            None if blind => {
                self.compare_no_holder_but(ino, own);
                return Ok(false);
            }
            None => return Err(Stop::Need(vec![req])),
        };
        // Two keys are read: besides this session's own, another holder shows.
        if let Some(kv) = r.kvs.iter().find(|kv| Some(&kv.key) != own.as_ref()) {
            self.compare(Compare::mod_rev(kv.key.clone(), kv.mod_revision));
            return Ok(true);
        }
        self.compare_no_holder_but(ino, own);
        Ok(false)
    }

    /// Compares that `ino` has no open record, but for `own` (this session's, deleted in
    /// the same transaction).
    fn compare_no_holder_but(&mut self, ino: Ino, own: Option<Vec<u8>>) {
        let h = self.keys().holders(ino);
        match own {
            None => self.compare(Compare::range_empty(h.start, h.end)),
            Some(own) => {
                let mut after = own.clone();
                after.push(0);
                self.compare(Compare::range_empty(h.start, own));
                self.compare(Compare::range_empty(after, h.end));
            }
        }
    }

    /// This session's open record of `ino`, under its lease (the session id is the lease
    /// id): it goes with the session.
    fn put_held(&mut self, ino: Ino) -> R<()> {
        let session = self.ctx.session;
        let lease = i64::try_from(session.0).map_err(|_| MetaError::Invalid("lease id"))?;
        self.plan.ops.push(TxnOp::Put(crate::kv::PutOp {
            key: self.keys().held(ino, session),
            value: Owner { session }.encode(),
            lease,
        }));
        Ok(())
    }
}

/// The read [`P::open_anywhere`] and `Unhold` plan from (one shape, so a prefetch is found
/// again): two keys, so that besides this session's own one, another holder shows.
fn holders_req(k: &Keyspace, ino: Ino) -> RangeRequest {
    let r = k.holders(ino);
    RangeRequest::range(r.start, r.end).limit(2).keys_only()
}

/// The read [`P::drop_extents`] plans from (one shape, so a prefetch is found again).
fn extents_req(k: &Keyspace, ino: Ino, from: u64) -> RangeRequest {
    let r = k.extents_between(ino, from, u64::MAX);
    RangeRequest::range(r.start, r.end).limit(EXTENTS_PER_MUTATION_MAX as i64)
}

/// Cuts a device range at allocation-group boundaries (so each released record lies in
/// one group and a group's records are one key range).
fn split_by_group(r: DevRange, groups: Option<GroupLayout>) -> Vec<DevRange> {
    let Some(g) = groups.filter(|g| g.size > 0) else {
        return vec![r];
    };
    let mut out = Vec::new();
    let (mut off, end) = (r.dev_off, r.dev_off.saturating_add(r.len));
    while off < end {
        let next = if off < g.start {
            g.start
        } else {
            let i = (off - g.start) / g.size;
            g.start
                .saturating_add(i.saturating_add(1).saturating_mul(g.size))
        };
        let stop = next.min(end).max(off + 1);
        out.push(DevRange {
            dev_off: off,
            len: stop - off,
        });
        off = stop;
    }
    out
}

fn check_name(name: &[u8]) -> R<()> {
    if name_is_valid(name) {
        Ok(())
    } else {
        Err(Stop::Fail(MetaError::Invalid("invalid name")))
    }
}

fn time(t: TimeSet, now: Timespec) -> R<Timespec> {
    let t = match t {
        TimeSet::Now => now,
        TimeSet::At(t) => t,
    };
    if t.is_valid() {
        Ok(t)
    } else {
        Err(Stop::Fail(MetaError::Invalid("nanoseconds out of range")))
    }
}

fn round_up(n: u64, to: u64) -> u64 {
    if to <= 1 {
        return n;
    }
    n.div_ceil(to).saturating_mul(to)
}

/// Plans one mutation against a snapshot. Pure: same inputs, same output.
pub fn plan(m: &Mutation, snap: &Snapshot, ctx: &PlanCtx<'_>) -> Planned {
    // The client refuses these before queueing; this catches what the pipeline makes
    // itself (coalesced times, inode reservations).
    if ctx.read_only && !m.allowed_read_only() {
        return Planned::Fail(MetaError::ReadOnly);
    }
    let mut p = P {
        snap,
        ctx,
        plan: Plan::default(),
        full_map: None,
    };
    let r = match m {
        Mutation::Create {
            parent,
            name,
            inode,
            symlink,
            hold,
        } => plan_create(&mut p, *parent, name, inode, symlink.as_deref(), *hold),
        Mutation::Link { ino, parent, name } => plan_link(&mut p, *ino, *parent, name),
        Mutation::Unlink {
            parent,
            name,
            dir,
            keep_open,
            drop_own_hold,
            expect,
        } => plan_unlink(
            &mut p,
            *parent,
            name,
            *dir,
            *keep_open,
            *drop_own_hold,
            expect.as_deref(),
        ),
        Mutation::Rename {
            src_parent,
            src_name,
            dst_parent,
            dst_name,
            mode,
            dst_keep_open,
        } => plan_rename(
            &mut p,
            *src_parent,
            src_name,
            *dst_parent,
            dst_name,
            *mode,
            *dst_keep_open,
        ),
        Mutation::SetAttr { ino, set } => plan_setattr(&mut p, *ino, set),
        Mutation::SetXattr {
            ino,
            name,
            value,
            mode,
        } => plan_setxattr(&mut p, *ino, name, Some(value), *mode),
        Mutation::RemoveXattr { ino, name } => {
            plan_setxattr(&mut p, *ino, name, None, XattrMode::Replace)
        }
        Mutation::SetAcl {
            ino,
            default,
            value,
            kill_sgid,
        } => plan_set_acl(&mut p, *ino, *default, value.as_deref(), *kill_sgid),
        Mutation::SetExtents {
            ino,
            off,
            len,
            extents,
            size_at_least,
            touch_mtime,
            free_maps,
            expect,
        } => plan_extents(
            &mut p,
            *ino,
            ExtentsChange {
                off: *off,
                len: *len,
                new: extents,
                size_at_least: *size_at_least,
                touch_mtime: *touch_mtime,
            },
            expect.as_deref(),
        )
        .map(|()| plan_free_maps(&mut p, free_maps, &[])),
        Mutation::FreeMaps { maps, released } => {
            plan_free_maps(&mut p, maps, released);
            Ok(())
        }
        Mutation::LogReleased { ranges } => {
            if ranges.len() > super::mutation::LOG_RELEASED_MAX {
                return Planned::Fail(MetaError::TooBig);
            }
            for r in ranges {
                p.release(*r);
            }
            Ok(())
        }
        Mutation::ReclaimOrphan { ino } => plan_reclaim(&mut p, *ino),
        Mutation::Hold { ino } => plan_hold(&mut p, *ino),
        Mutation::Unhold { ino } => plan_unhold(&mut p, *ino),
        Mutation::Touch {
            ino,
            mtime,
            ctime,
            expect,
        } => plan_touch(&mut p, *ino, *mtime, *ctime, expect.as_deref()),
        Mutation::ReserveInos { count } => plan_reserve(&mut p, *count),
    };
    match r {
        Ok(()) => Planned::Ready(p.plan),
        Err(Stop::Need(n)) => Planned::Need(n),
        Err(Stop::Fail(e)) => Planned::Fail(e),
    }
}

fn plan_create(
    p: &mut P<'_>,
    parent: Ino,
    name: &[u8],
    new: &crate::pipeline::mutation::NewInode,
    symlink: Option<&[u8]>,
    hold: bool,
) -> R<()> {
    check_name(name)?;
    let k = p.keys();
    let ino = p
        .ctx
        .new_ino
        .ok_or(Stop::Fail(MetaError::Invalid("no inode number reserved")))?;
    if new.perm > 0o7777 {
        return Err(Stop::Fail(MetaError::Invalid(
            "permission bits out of range",
        )));
    }
    let now = p.ctx.now;
    let is_dir = new.kind == FileType::Directory;
    let (perm, acls) = match new.inherit {
        Some(inherit) => inherit_acls(p, parent, new, inherit)?,
        None => (new.perm, Inherited::default()),
    };
    let mut flags = (new.flags & !FLAGS_META) | FLAG_NO_XATTRS;
    if acls.access.is_some() {
        flags |= acl::FLAG_ACCESS;
    }
    if acls.default.is_some() {
        flags |= acl::FLAG_DEFAULT;
    }
    let attr = InodeAttr {
        ino,
        kind: new.kind,
        perm,
        uid: new.uid,
        gid: new.gid,
        size: symlink.map_or(0, |s| s.len() as u64),
        nlink: if is_dir { 2 } else { 1 },
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
        rdev: new.rdev,
        generation: 1,
        flags,
    };
    if is_dir {
        // mkdir bumps the parent's link count, so it reads and compares the parent.
        let (mut pattr, prev) = p.inode(parent)?.ok_or(Stop::Fail(MetaError::NotFound))?;
        if pattr.kind != FileType::Directory {
            return Err(Stop::Fail(MetaError::NotDir));
        }
        p.compare(Compare::mod_rev(k.inode(parent), prev));
        pattr.nlink = pattr.nlink.saturating_add(1);
        pattr.mtime = now;
        pattr.ctime = now;
        p.put(k.inode(parent), &pattr);
        p.put(k.dir_parent(ino), &DirParent { parent });
    } else {
        // Existence is enough: types never change and numbers are never reused.
        p.expect_present(&k.inode(parent))?;
        p.compare(Compare::exists(k.inode(parent)));
        p.plan.touch.push((parent, true));
    }
    p.expect_absent(&k.dentry(parent, name))?;
    p.compare(Compare::absent(k.dentry(parent, name)));
    match (new.kind, symlink) {
        (FileType::Symlink, Some(t)) => {
            let target = SymlinkTarget(t.to_vec());
            if target.validate().is_err() {
                return Err(Stop::Fail(MetaError::Invalid("symlink target length")));
            }
            p.put(k.symlink(ino), &target);
        }
        (FileType::Symlink, None) | (_, Some(_)) => {
            return Err(Stop::Fail(MetaError::Invalid("symlink target iff symlink")));
        }
        _ => {}
    }
    if let Some(v) = acls.access {
        p.put(k.xattr(ino, acl::ACCESS_NAME), &XattrValue(v));
    }
    if let Some(v) = acls.default {
        p.put(k.xattr(ino, acl::DEFAULT_NAME), &XattrValue(v));
    }
    p.put(k.inode(ino), &attr);
    p.put(
        k.dentry(parent, name),
        &Dentry {
            ino,
            kind: new.kind,
        },
    );
    if new.kind == FileType::Regular && p.ctx.lock_at_create {
        // The creator holds the new file's cache lock from the start (under its lease,
        // which is the session id): writing it costs no round trip of its own.
        p.plan.ops.push(TxnOp::Put(PutOp {
            key: k.cache_lock(ino, p.ctx.session),
            value: crate::cachelock::CacheLock {
                mode: crate::cachelock::LockMode::Exclusive,
            }
            .encode(),
            lease: i64::try_from(p.ctx.session.0).unwrap_or(0),
        }));
    }
    if hold && new.kind == FileType::Regular {
        p.put_held(ino)?;
    }
    p.plan.outcome.ino = Some(ino);
    p.plan.outcome.attr = Some(attr);
    Ok(())
}

fn plan_link(p: &mut P<'_>, ino: Ino, parent: Ino, name: &[u8]) -> R<()> {
    check_name(name)?;
    let k = p.keys();
    let (mut attr, rev) = p.inode(ino)?.ok_or(Stop::Fail(MetaError::NotFound))?;
    if attr.kind == FileType::Directory {
        return Err(Stop::Fail(MetaError::IsDir));
    }
    if attr.nlink == 0 {
        // An orphan cannot be linked back (Linux: ENOENT on linkat of an unlinked file
        // without O_TMPFILE).
        return Err(Stop::Fail(MetaError::NotFound));
    }
    p.expect_present(&k.inode(parent))?;
    p.expect_absent(&k.dentry(parent, name))?;
    p.compare(Compare::mod_rev(k.inode(ino), rev));
    p.compare(Compare::exists(k.inode(parent)));
    p.compare(Compare::absent(k.dentry(parent, name)));
    attr.nlink = attr.nlink.saturating_add(1);
    attr.ctime = p.ctx.now;
    p.put(k.inode(ino), &attr);
    p.put(
        k.dentry(parent, name),
        &Dentry {
            ino,
            kind: attr.kind,
        },
    );
    p.plan.touch.push((parent, true));
    p.plan.outcome.ino = Some(ino);
    p.plan.outcome.attr = Some(attr);
    Ok(())
}

/// A value the plan relies on and the compare that guards it: read from etcd (guarded by
/// its mod revision) or taken from the submitter's expectation (guarded by its exact
/// encoding, and never a reason to fail on its own).
struct Known<T> {
    val: T,
    guard: Compare,
    expected: bool,
}

/// Fails with `e` when every input of the decision was read; else asks to read the
/// expected ones first (a failure must rest on what etcd holds, not on a cache's guess).
fn fail_verified(e: MetaError, inputs: &[(bool, Vec<u8>)]) -> Stop {
    let unverified: Vec<RangeRequest> = inputs
        .iter()
        .filter(|(expected, _)| *expected)
        .map(|(_, key)| RangeRequest::key(key.clone()))
        .collect();
    if unverified.is_empty() {
        Stop::Fail(e)
    } else {
        Stop::Need(unverified)
    }
}

impl<'a> P<'a> {
    /// The entry `name` in `parent`: as read, else as expected, else `Need`.
    fn known_dentry(
        &self,
        parent: Ino,
        name: &[u8],
        expect: Option<&Dentry>,
    ) -> R<Option<Known<Dentry>>> {
        let key = self.keys().dentry(parent, name);
        if let (None, Some(d)) = (self.snap.key(&key), expect) {
            return Ok(Some(Known {
                val: *d,
                guard: Compare::value(key, d.encode()),
                expected: true,
            }));
        }
        Ok(self.dentry(parent, name)?.map(|(d, rev)| Known {
            val: d,
            guard: Compare::mod_rev(key, rev),
            expected: false,
        }))
    }

    /// An inode's attributes: as read, else as expected (if about `ino`), else `Need`.
    fn known_inode(&self, ino: Ino, expect: Option<&InodeAttr>) -> R<Option<Known<InodeAttr>>> {
        let key = self.keys().inode(ino);
        if let (None, Some(a)) = (self.snap.key(&key), expect.filter(|a| a.ino == ino)) {
            return Ok(Some(Known {
                val: a.clone(),
                guard: Compare::value(key, a.encode()),
                expected: true,
            }));
        }
        Ok(self.inode(ino)?.map(|(a, rev)| Known {
            val: a,
            guard: Compare::mod_rev(key, rev),
            expected: false,
        }))
    }

    /// Whether the snapshot or the expectation answers for this inode.
    fn inode_known(&self, ino: Ino, expect: Option<&InodeAttr>) -> bool {
        self.snap.key(&self.keys().inode(ino)).is_some() || expect.is_some_and(|a| a.ino == ino)
    }
}

/// unlink/rmdir. With a full expectation from the submitter's caches this reads nothing
/// (one round trip: the commit); without one, it reads the entry, then the child (and
/// for rmdir the parent and one entry of the child) in a second round.
fn plan_unlink<'a>(
    p: &mut P<'a>,
    parent: Ino,
    name: &[u8],
    dir: bool,
    keep_open: bool,
    drop_own_hold: bool,
    expect: Option<&'a UnlinkExpect>,
) -> R<()> {
    check_name(name)?;
    let k = p.keys();
    let dkey = k.dentry(parent, name);
    let entry = p
        .known_dentry(parent, name, expect.map(|e| &e.entry))?
        .ok_or(Stop::Fail(MetaError::NotFound))?;
    let child = entry.val.ino;
    let (child_exp, parent_exp) = (
        expect.and_then(|e| e.child.as_ref()),
        expect.and_then(|e| e.parent.as_ref()),
    );
    // Planned from the submitter's record of the file's extents: neither they nor the
    // open records are read (both are compared as guessed).
    let full_map = expect
        .filter(|_| !dir && child_exp.is_some())
        .and_then(|e| e.extents.as_deref())
        .filter(|list| usable_full_map(list) && p.snap.range(&extents_req(k, child, 0)).is_none());
    if let Some(list) = full_map {
        p.full_map = Some((child, list));
    }
    let entries = k.dentries(child);
    let probe = RangeRequest::range(entries.start.clone(), entries.end.clone()).limit(1);
    // Emptiness is proven by the range compare alone when the caller expected the
    // entry; a failed compare drops the expectation and the retry reads the probe, so a
    // non-empty directory still ends in NotEmpty.
    let blind_empty = expect.is_some() && p.snap.range(&probe).is_none();
    let mut need = Vec::new();
    if !p.inode_known(child, child_exp) {
        need.push(RangeRequest::key(k.inode(child)));
        if !dir && entry.val.kind == FileType::Regular {
            // Likely the last link: its extents are read (and released) in this round,
            // and whether any node has it open.
            need.push(extents_req(k, child, 0));
            if !keep_open {
                need.push(holders_req(k, child));
            }
        }
    }
    if dir && entry.val.kind == FileType::Directory {
        if !p.inode_known(parent, parent_exp) {
            need.push(RangeRequest::key(k.inode(parent)));
        }
        if !blind_empty {
            need.push(probe.clone());
        }
    }
    p.need(&need)?;
    let cattr = p.known_inode(child, child_exp)?.ok_or_else(|| {
        fail_verified(
            MetaError::Corrupt {
                key: k.describe(&dkey),
                reason: format!("entry points at missing inode {child}"),
            },
            &[(entry.expected, dkey.clone())],
        )
    })?;
    let inputs = [
        (entry.expected, dkey.clone()),
        (cattr.expected, k.inode(child)),
    ];
    let is_dir = cattr.val.kind == FileType::Directory;
    match (dir, is_dir) {
        (true, false) => return Err(fail_verified(MetaError::NotDir, &inputs)),
        (false, true) => return Err(fail_verified(MetaError::IsDir, &inputs)),
        _ => {}
    }
    p.compare(entry.guard.clone());
    p.compare(cattr.guard.clone());
    p.delete(dkey);
    p.plan.outcome.ino = Some(child);
    if is_dir {
        if !blind_empty {
            // The probe may be missing when the entry's kind disagreed with the inode's.
            p.need(std::slice::from_ref(&probe))?;
            if !p.range(probe)?.kvs.is_empty() {
                return Err(fail_verified(MetaError::NotEmpty, &inputs));
            }
        }
        let pattr = p
            .known_inode(parent, parent_exp)?
            .ok_or_else(|| fail_verified(MetaError::NotFound, &inputs))?;
        p.compare(Compare::range_empty(entries.start, entries.end));
        p.compare(pattr.guard);
        let mut pattr = pattr.val;
        pattr.nlink = pattr.nlink.saturating_sub(1).max(2);
        pattr.mtime = p.ctx.now;
        pattr.ctime = p.ctx.now;
        p.put(k.inode(parent), &pattr);
        p.delete_inode_tree(child, FileType::Directory, true)?;
    } else {
        // A cached size of 0 means no extents (checked by a compare, not a read).
        let no_extents = cattr.expected && cattr.val.size == 0;
        // Planned from the caches alone (an expectation): the open records of an empty
        // file are guessed none and compared so, rather than read. A file with extents
        // reads them anyway, and its open records in the same round.
        let blind = expect.is_some();
        if cattr.val.nlink <= 1 && !keep_open && !no_extents && full_map.is_none() {
            let mut need = vec![extents_req(k, child, 0)];
            if cattr.val.kind == FileType::Regular {
                need.push(holders_req(k, child));
            }
            p.need(&need)?;
        }
        let own_dropped = drop_own_hold && cattr.val.kind == FileType::Regular;
        if own_dropped {
            p.delete(k.held(child, p.ctx.session));
        }
        p.drop_link(cattr.val, keep_open, blind, no_extents, own_dropped)?;
        p.plan.touch.push((parent, true));
    }
    Ok(())
}

/// Walks `P` keys from `from` to the root; fails if `moving` is on the path (moving a
/// directory into its own subtree). Every step is compared, so a concurrent directory
/// move that would change the answer makes this plan fail its compares.
fn check_not_ancestor(p: &mut P<'_>, moving: Ino, from: Ino) -> R<()> {
    let k = p.keys();
    let mut cur = from;
    for _ in 0..DIR_DEPTH_MAX {
        if cur == moving {
            return Err(Stop::Fail(MetaError::Invalid(
                "directory moved into its own subtree",
            )));
        }
        if cur == Ino::ROOT {
            return Ok(());
        }
        let key = k.dir_parent(cur);
        let kv = p.kv(&key)?.ok_or_else(|| {
            Stop::Fail(MetaError::Corrupt {
                key: k.describe(&key),
                reason: "directory without parent record".into(),
            })
        })?;
        let parent: DirParent = p.decode(kv)?;
        p.compare(Compare::mod_rev(key, kv.mod_revision));
        cur = parent.parent;
    }
    Err(Stop::Fail(MetaError::TooBig))
}

#[allow(clippy::too_many_arguments)]
fn plan_rename(
    p: &mut P<'_>,
    sp: Ino,
    sn: &[u8],
    dp: Ino,
    dn: &[u8],
    mode: RenameMode,
    dst_keep_open: bool,
) -> R<()> {
    check_name(sn)?;
    check_name(dn)?;
    let k = p.keys();
    let now = p.ctx.now;
    p.need(&[
        RangeRequest::key(k.dentry(sp, sn)),
        RangeRequest::key(k.dentry(dp, dn)),
    ])?;
    let (src, srev) = p.dentry(sp, sn)?.ok_or(Stop::Fail(MetaError::NotFound))?;
    let dst = p.dentry(dp, dn)?;
    if sp == dp && sn == dn {
        return Ok(());
    }
    let mut need = vec![RangeRequest::key(k.inode(src.ino))];
    if let Some((d, _)) = dst {
        need.push(RangeRequest::key(k.inode(d.ino)));
        if mode == RenameMode::Replace && d.kind == FileType::Regular {
            // Replaced: whether any node has it open decides orphan or delete.
            need.push(holders_req(k, d.ino));
        }
    }
    p.need(&need)?;
    let (mut sattr, sirev) = p.inode(src.ino)?.ok_or(Stop::Fail(MetaError::NotFound))?;
    let src_dir = sattr.kind == FileType::Directory;
    match (mode, dst) {
        (RenameMode::NoReplace, Some(_)) => return Err(Stop::Fail(MetaError::Exists)),
        (RenameMode::Exchange, None) => return Err(Stop::Fail(MetaError::NotFound)),
        _ => {}
    }
    if let Some((d, _)) = dst {
        if d.ino == src.ino {
            // Two links to the same inode: POSIX says rename does nothing.
            return Ok(());
        }
    }
    p.compare(Compare::mod_rev(k.dentry(sp, sn), srev));
    p.compare(Compare::mod_rev(
        k.dentry(dp, dn),
        dst.map_or(0, |(_, r)| r),
    ));
    p.compare(Compare::mod_rev(k.inode(src.ino), sirev));
    // Link-count deltas per parent directory, applied once per parent at the end.
    let mut nlink: BTreeMap<Ino, i64> = BTreeMap::new();
    let cross = sp != dp;
    sattr.ctime = now;
    let dst_attr = match dst {
        Some((d, _)) => {
            let (a, r) = p.inode(d.ino)?.ok_or(Stop::Fail(MetaError::NotFound))?;
            p.compare(Compare::mod_rev(k.inode(d.ino), r));
            Some(a)
        }
        None => None,
    };
    if src_dir && cross {
        check_not_ancestor(p, src.ino, dp)?;
    }
    match (mode, dst_attr) {
        (RenameMode::Exchange, Some(mut dattr)) => {
            let dst_dir = dattr.kind == FileType::Directory;
            if dst_dir && cross {
                check_not_ancestor(p, dattr.ino, sp)?;
            }
            dattr.ctime = now;
            p.put(
                k.dentry(sp, sn),
                &Dentry {
                    ino: dattr.ino,
                    kind: dattr.kind,
                },
            );
            p.put(
                k.dentry(dp, dn),
                &Dentry {
                    ino: sattr.ino,
                    kind: sattr.kind,
                },
            );
            if cross {
                if src_dir {
                    p.put(k.dir_parent(sattr.ino), &DirParent { parent: dp });
                    *nlink.entry(sp).or_default() -= 1;
                    *nlink.entry(dp).or_default() += 1;
                }
                if dst_dir {
                    p.put(k.dir_parent(dattr.ino), &DirParent { parent: sp });
                    *nlink.entry(dp).or_default() -= 1;
                    *nlink.entry(sp).or_default() += 1;
                }
            }
            p.put(k.inode(dattr.ino), &dattr);
        }
        (_, dst_attr) => {
            if let Some(dattr) = dst_attr {
                let dst_dir = dattr.kind == FileType::Directory;
                match (src_dir, dst_dir) {
                    (true, false) => return Err(Stop::Fail(MetaError::NotDir)),
                    (false, true) => return Err(Stop::Fail(MetaError::IsDir)),
                    _ => {}
                }
                if dst_dir {
                    let entries = k.dentries(dattr.ino);
                    let probe =
                        RangeRequest::range(entries.start.clone(), entries.end.clone()).limit(1);
                    if !p.range(probe)?.kvs.is_empty() {
                        return Err(Stop::Fail(MetaError::NotEmpty));
                    }
                    p.compare(Compare::range_empty(entries.start, entries.end));
                    *nlink.entry(dp).or_default() -= 1;
                    p.delete_inode_tree(dattr.ino, FileType::Directory, true)?;
                } else {
                    p.drop_link(dattr, dst_keep_open, false, false, false)?;
                }
            }
            p.delete(k.dentry(sp, sn));
            p.put(k.dentry(dp, dn), &src);
            if src_dir && cross {
                p.put(k.dir_parent(src.ino), &DirParent { parent: dp });
                *nlink.entry(sp).or_default() -= 1;
                *nlink.entry(dp).or_default() += 1;
            }
        }
    }
    p.put(k.inode(sattr.ino), &sattr);
    // Parents whose link count changes are rewritten here (with their times); the
    // others get their times through the coalescer.
    let changed: Vec<Ino> = nlink
        .iter()
        .filter(|(_, &d)| d != 0)
        .map(|(&i, _)| i)
        .collect();
    p.need(
        &changed
            .iter()
            .map(|&i| RangeRequest::key(k.inode(i)))
            .collect::<Vec<_>>(),
    )?;
    for &dir in &changed {
        let (mut a, r) = p.inode(dir)?.ok_or(Stop::Fail(MetaError::NotFound))?;
        p.compare(Compare::mod_rev(k.inode(dir), r));
        let delta = nlink.get(&dir).copied().unwrap_or(0);
        let n = i64::from(a.nlink)
            .saturating_add(delta)
            .clamp(2, i64::from(u32::MAX));
        a.nlink = u32::try_from(n).unwrap_or(u32::MAX);
        a.mtime = now;
        a.ctime = now;
        p.put(k.inode(dir), &a);
    }
    for dir in [sp, dp] {
        if !changed.contains(&dir) && !p.plan.touch.iter().any(|(i, _)| *i == dir) {
            // Existence of both parents is implied by their entries' compares.
            p.plan.touch.push((dir, true));
        }
    }
    p.plan.outcome.ino = Some(src.ino);
    p.plan.outcome.attr = Some(sattr);
    Ok(())
}

fn plan_setattr(p: &mut P<'_>, ino: Ino, set: &crate::pipeline::mutation::SetAttr) -> R<()> {
    let k = p.keys();
    let now = p.ctx.now;
    let a = match (set.unchanged_since, set.expect.as_deref()) {
        (None, Some(expect)) => {
            let known = p
                .known_inode(ino, Some(expect))?
                .ok_or(Stop::Fail(MetaError::NotFound))?;
            p.compare(known.guard);
            known.val
        }
        (since, _) => {
            let (a, rev) = p.inode(ino)?.ok_or(Stop::Fail(MetaError::NotFound))?;
            if since.is_some_and(|since| rev > since) {
                return Err(Stop::Fail(MetaError::Changed));
            }
            p.compare(Compare::mod_rev(k.inode(ino), rev));
            a
        }
    };
    if set.size.is_none() {
        p.plan.outcome.attr_before = Some(a.clone());
    }
    let mut a = a;
    if let Some(perm) = set.perm {
        if perm > 0o7777 {
            return Err(Stop::Fail(MetaError::Invalid(
                "permission bits out of range",
            )));
        }
        a.perm = perm;
        if a.flags & acl::FLAG_ACCESS != 0 {
            // chmod rewrites the access ACL's owner, mask (or group) and other entries.
            let key = k.xattr(ino, acl::ACCESS_NAME);
            let kv = p.kv(&key)?;
            p.compare(Compare::mod_rev(
                key.clone(),
                kv.map_or(0, |kv| kv.mod_revision),
            ));
            if let Some(kv) = kv {
                let v: XattrValue = p.decode(kv)?;
                let corrupt = |reason: &str| {
                    Stop::Fail(MetaError::Corrupt {
                        key: k.describe(&key),
                        reason: reason.to_string(),
                    })
                };
                if let Some(mut acl) = acl::Acl::decode(&v.0).map_err(corrupt)? {
                    acl.chmod(perm);
                    p.put(key, &XattrValue(acl.encode()));
                }
            }
        }
    }
    if set.kill_suidgid && set.perm.is_none() {
        // The rwx bits stay, so an access ACL (which holds only those) needs no rewrite.
        a.perm = crate::types::kill_suidgid(a.perm);
    }
    if let Some(uid) = set.uid {
        a.uid = uid;
    }
    if let Some(gid) = set.gid {
        a.gid = gid;
    }
    if let Some(flags) = set.flags {
        // The ACL bits belong to the ACLs (SetAcl); flags never move them.
        a.flags = (flags & !FLAGS_META) | (a.flags & FLAGS_META);
    }
    if let Some(t) = set.atime {
        let t = time(t, now)?;
        a.atime = if set.access { a.atime.max(t) } else { t };
    }
    if let Some(size) = set.size {
        if a.kind != FileType::Regular {
            return Err(Stop::Fail(if a.kind == FileType::Directory {
                MetaError::IsDir
            } else {
                MetaError::Invalid("size of a non-regular file")
            }));
        }
        if size < a.size {
            // Drop whole blocks past the new end; trim an extent straddling it.
            let keep_to = round_up(size, p.ctx.block_size);
            let before = RangeRequest::range(k.extent(ino, 0), k.extent(ino, keep_to))
                .descending()
                .limit(1);
            p.need(&[before.clone(), extents_req(k, ino, keep_to)])?;
            if let Some(kv) = p.range(before)?.kvs.first() {
                let off = match k.parse(&kv.key) {
                    Some(crate::keys::KeyKind::Extent(_, off)) => off,
                    _ => return Err(Stop::Fail(MetaError::Invalid("bad extent key"))),
                };
                let e = Extent::decode_value(off, &kv.value)
                    .map_err(|e| Stop::Fail(e.at(k.describe(&kv.key))))?;
                p.compare(Compare::mod_rev(kv.key.clone(), kv.mod_revision));
                if e.file_end() > keep_to {
                    let keep = keep_to - e.file_off;
                    let trimmed = Extent { len: keep, ..e };
                    p.plan
                        .ops
                        .push(TxnOp::put(kv.key.clone(), trimmed.encode_value()));
                    p.release(DevRange {
                        dev_off: e.dev_off.saturating_add(keep),
                        len: e.len - keep,
                    });
                }
            }
            p.drop_extents(ino, keep_to)?;
        }
        a.size = size;
        a.mtime = now;
    }
    if let Some(t) = set.mtime {
        a.mtime = time(t, now)?;
    }
    let access_only = set.access
        && !set.ctime
        && set.perm.is_none()
        && !set.kill_suidgid
        && set.uid.is_none()
        && set.gid.is_none()
        && set.size.is_none()
        && set.mtime.is_none()
        && set.flags.is_none();
    if !access_only {
        a.ctime = now;
    }
    p.put(k.inode(ino), &a);
    p.plan.outcome.ino = Some(ino);
    p.plan.outcome.attr = Some(a);
    Ok(())
}

fn plan_setxattr(
    p: &mut P<'_>,
    ino: Ino,
    name: &[u8],
    value: Option<&Vec<u8>>,
    mode: XattrMode,
) -> R<()> {
    if name.is_empty() || name.len() > XATTR_NAME_LEN_MAX {
        return Err(Stop::Fail(MetaError::Invalid("xattr name length")));
    }
    let k = p.keys();
    let key = k.xattr(ino, name);
    p.need(&[RangeRequest::key(key.clone())])?;
    let cur = p.kv(&key)?;
    match (mode, cur) {
        (XattrMode::Create, Some(_)) => return Err(Stop::Fail(MetaError::Exists)),
        (XattrMode::Replace, None) => return Err(Stop::Fail(MetaError::NotFound)),
        _ => {}
    }
    p.expect_present(&k.inode(ino))?;
    p.compare(Compare::mod_rev(
        key.clone(),
        cur.map_or(0, |kv| kv.mod_revision),
    ));
    p.compare(Compare::exists(k.inode(ino)));
    match value {
        Some(v) => {
            let v = XattrValue(v.clone());
            if v.validate().is_err() {
                return Err(Stop::Fail(MetaError::Invalid("xattr value too long")));
            }
            p.put(key, &v);
        }
        None => p.delete(key),
    }
    p.plan.outcome.ino = Some(ino);
    if value.is_some() {
        // The inode stops claiming it has none: its record changes with the xattr, under
        // a compare, since nodes answer from the flag without etcd.
        let (mut a, rev) = p.inode(ino)?.ok_or(Stop::Fail(MetaError::NotFound))?;
        if a.flags & FLAG_NO_XATTRS != 0 {
            p.compare(Compare::mod_rev(k.inode(ino), rev));
            a.flags &= !FLAG_NO_XATTRS;
            a.ctime = p.ctx.now;
            p.put(k.inode(ino), &a);
            p.plan.outcome.attr = Some(a);
            return Ok(());
        }
    }
    p.plan.touch.push((ino, false));
    Ok(())
}

/// The ACL xattrs a new inode gets.
#[derive(Default)]
struct Inherited {
    access: Option<Vec<u8>>,
    default: Option<Vec<u8>>,
}

/// A new inode's permission bits and ACLs from its parent's default ACL (`crate::acl`).
/// The parent's default ACL is read when the submitter says there is one, else assumed
/// absent under a compare; either way the value used is the one compared.
fn inherit_acls(
    p: &mut P<'_>,
    parent: Ino,
    new: &crate::pipeline::mutation::NewInode,
    inherit: AclInherit,
) -> R<(u16, Inherited)> {
    let k = p.keys();
    let key = k.xattr(parent, acl::DEFAULT_NAME);
    let kv = match p.snap.key(&key) {
        Some(kv) => kv,
        None if inherit.parent_default => p.kv(&key)?,
        None => None,
    };
    p.compare(Compare::mod_rev(
        key.clone(),
        kv.map_or(0, |kv| kv.mod_revision),
    ));
    let umask = inherit.umask & 0o777;
    // Symlinks have no ACLs and ignore both (their mode is always 0777).
    if new.kind == FileType::Symlink {
        return Ok((new.perm, Inherited::default()));
    }
    let Some(kv) = kv else {
        return Ok((new.perm & !umask, Inherited::default()));
    };
    let value: XattrValue = p.decode(kv)?;
    let bad = |reason: &str| {
        Stop::Fail(MetaError::Corrupt {
            key: k.describe(&key),
            reason: reason.to_string(),
        })
    };
    let Some(default) = acl::Acl::decode(&value.0).map_err(bad)? else {
        return Ok((new.perm & !umask, Inherited::default()));
    };
    let (perm, access) = default.inherit(new.perm);
    Ok((
        perm,
        Inherited {
            access: access.map(|a| a.encode()),
            default: (new.kind == FileType::Directory).then(|| default.encode()),
        },
    ))
}

/// Sets or removes an ACL with the inode, in one transaction: the mode follows an access
/// ACL, and the inode's flag bits say which ACLs exist.
fn plan_set_acl(
    p: &mut P<'_>,
    ino: Ino,
    default: bool,
    value: Option<&[u8]>,
    kill_sgid: bool,
) -> R<()> {
    let k = p.keys();
    let name = if default {
        acl::DEFAULT_NAME
    } else {
        acl::ACCESS_NAME
    };
    let key = k.xattr(ino, name);
    let (mut a, rev) = p.inode(ino)?.ok_or(Stop::Fail(MetaError::NotFound))?;
    p.compare(Compare::mod_rev(k.inode(ino), rev));
    let invalid = |reason: &'static str| Stop::Fail(MetaError::Invalid(reason));
    let (flag, store) = if default {
        if a.kind != FileType::Directory && value.is_some() {
            return Err(invalid("default acl on a non-directory"));
        }
        (acl::FLAG_DEFAULT, acl::set_default(value).map_err(invalid)?)
    } else {
        let (perm, store) = acl::set_access(a.perm, value).map_err(invalid)?;
        a.perm = if kill_sgid { perm & !0o2000 } else { perm };
        (acl::FLAG_ACCESS, store)
    };
    match store {
        Some(v) => {
            let v = XattrValue(v);
            if v.validate().is_err() {
                return Err(invalid("xattr value too long"));
            }
            p.put(key, &v);
            a.flags |= flag;
        }
        None => {
            // Blind: deleting a key that is not there is a no-op.
            p.delete(key);
            a.flags &= !flag;
        }
    }
    a.ctime = p.ctx.now;
    p.put(k.inode(ino), &a);
    p.plan.outcome.ino = Some(ino);
    p.plan.outcome.attr = Some(a);
    Ok(())
}

/// Subtracts device ranges `minus` from `from` (both small lists).
fn subtract(from: Vec<DevRange>, minus: &[DevRange]) -> Vec<DevRange> {
    let mut cur = from;
    for m in minus {
        let (ms, me) = (m.dev_off, m.dev_off.saturating_add(m.len));
        let mut next = Vec::with_capacity(cur.len() + 1);
        for r in cur {
            let (rs, re) = (r.dev_off, r.dev_off.saturating_add(r.len));
            if me <= rs || re <= ms {
                next.push(r);
                continue;
            }
            if rs < ms {
                next.push(DevRange {
                    dev_off: rs,
                    len: ms - rs,
                });
            }
            if me < re {
                next.push(DevRange {
                    dev_off: me,
                    len: re - me,
                });
            }
        }
        cur = next;
    }
    cur
}

/// A SetExtents' change, as submitted.
struct ExtentsChange<'m> {
    off: u64,
    len: u64,
    new: &'m [Extent],
    size_at_least: Option<u64>,
    touch_mtime: bool,
}

/// Whether `list` may stand for every extent key of a file an unlink releases without
/// reading: valid, sorted, and few enough for one transaction (a longer map is read, and
/// may be taken apart in chunks).
fn usable_full_map(list: &[Extent]) -> bool {
    list.len() <= EXTENTS_PER_MUTATION_MAX
        && list.iter().all(|e| e.check().is_ok())
        && list.windows(2).all(|w| w[0].file_end() <= w[1].file_off)
}

/// Most extent keys an expectation may name: an append's commit names one or two.
const EXPECTED_EXTENTS_MAX: usize = 16;

/// The keys of `expect` a plan of `[off, end)` on `ino` may rest on: sorted, at most one
/// before `off` and first, none at or after `end`, and the inode a regular file. Anything
/// else is a guess not worth guarding: the plan reads instead.
fn usable_expectation(ino: Ino, off: u64, end: u64, expect: &ExtentsExpect) -> bool {
    let keys = &expect.extents;
    expect.attr.ino == ino
        && expect.attr.kind == FileType::Regular
        && keys.len() <= EXPECTED_EXTENTS_MAX
        && keys.iter().all(|e| e.check().is_ok() && e.file_off < end)
        && keys.windows(2).all(|w| w[0].file_end() <= w[1].file_off)
        && keys.iter().skip(1).all(|e| e.file_off >= off)
}

/// The inode and the extent keys around `[off, end)` (the last key before `off`, if any,
/// then every key inside), from the expectation when one is usable and nothing was read
/// yet, else read. The guards go into the plan: mod revisions and "nothing appeared" for
/// what was read; for what was expected, each value exactly and every gap between the
/// keys empty, so the plan commits only if etcd holds precisely what it was planned from.
fn extents_window(
    p: &mut P<'_>,
    ino: Ino,
    off: u64,
    end: u64,
    expect: Option<&ExtentsExpect>,
) -> R<(InodeAttr, Vec<Extent>)> {
    let k = p.keys();
    let inside = RangeRequest::range(k.extent(ino, off), k.extent(ino, end))
        .limit(EXTENTS_PER_MUTATION_MAX as i64);
    let before = RangeRequest::range(k.extent(ino, 0), k.extent(ino, off))
        .descending()
        .limit(1);
    let nothing_read = p.snap.key(&k.inode(ino)).is_none()
        && p.snap.range(&inside).is_none()
        && p.snap.range(&before).is_none();
    if let Some(x) = expect.filter(|x| nothing_read && usable_expectation(ino, off, end, x)) {
        p.compare(Compare::value(k.inode(ino), x.attr.encode()));
        let mut gap_start = 0;
        for (i, e) in x.extents.iter().enumerate() {
            // Keys before the last one before `off` do not matter to the plan.
            let guarded = i > 0 || e.file_off >= off;
            if guarded && gap_start < e.file_off {
                p.compare(Compare::range_empty(
                    k.extent(ino, gap_start),
                    k.extent(ino, e.file_off),
                ));
            }
            p.compare(Compare::value(k.extent(ino, e.file_off), e.encode_value()));
            gap_start = e.file_off + 1;
        }
        if gap_start < end {
            p.compare(Compare::range_empty(
                k.extent(ino, gap_start),
                k.extent(ino, end),
            ));
        }
        return Ok((x.attr.clone(), x.extents.clone()));
    }
    p.need(&[
        inside.clone(),
        before.clone(),
        RangeRequest::key(k.inode(ino)),
    ])?;
    let (attr, irev) = p.inode(ino)?.ok_or(Stop::Fail(MetaError::NotFound))?;
    if attr.kind != FileType::Regular {
        return Err(Stop::Fail(MetaError::Invalid(
            "extents on a non-regular file",
        )));
    }
    let inside_r = p.range(inside)?;
    if inside_r.more {
        return Err(Stop::Fail(MetaError::TooBig));
    }
    let mut window = Vec::new();
    for kv in p.range(before)?.kvs.iter().chain(&inside_r.kvs) {
        let Some(crate::keys::KeyKind::Extent(_, eoff)) = k.parse(&kv.key) else {
            return Err(Stop::Fail(MetaError::Invalid("bad extent key")));
        };
        let e = Extent::decode_value(eoff, &kv.value)
            .map_err(|e| Stop::Fail(e.at(k.describe(&kv.key))))?;
        if e.file_end() > off {
            // The plan rewrites it: it must be the version read.
            p.compare(Compare::mod_rev(kv.key.clone(), kv.mod_revision));
        }
        window.push(e);
    }
    // Nothing may have appeared in the range since we read it.
    p.compare(Compare {
        key: k.extent(ino, off),
        range_end: Some(k.extent(ino, end)),
        op: crate::kv::CompareOp::Less,
        target: crate::kv::CompareTarget::ModRevision(inside_r.revision + 1),
    });
    p.compare(Compare::mod_rev(k.inode(ino), irev));
    Ok((attr, window))
}

fn plan_extents(
    p: &mut P<'_>,
    ino: Ino,
    change: ExtentsChange<'_>,
    expect: Option<&ExtentsExpect>,
) -> R<()> {
    let ExtentsChange {
        off,
        len,
        new,
        size_at_least,
        touch_mtime,
    } = change;
    let k = p.keys();
    let end = off
        .checked_add(len)
        .ok_or(Stop::Fail(MetaError::Invalid("range overflows")))?;
    if len == 0 || new.len() > EXTENTS_PER_MUTATION_MAX {
        return Err(Stop::Fail(MetaError::Invalid(
            "empty range or too many extents",
        )));
    }
    let mut last_end = off;
    for e in new {
        if e.check().is_err() || e.file_off < last_end || e.file_end() > end {
            return Err(Stop::Fail(MetaError::Invalid(
                "extents unsorted or outside range",
            )));
        }
        last_end = e.file_end();
    }
    let (mut attr, window) = extents_window(p, ino, off, end, expect)?;
    // Final action per extent key: Some(put) or None (delete).
    let mut actions: BTreeMap<u64, Option<Extent>> = BTreeMap::new();
    let mut released = Vec::new();
    for e in window.iter().filter(|e| e.file_end() > off) {
        actions.insert(e.file_off, None);
        let (s, t) = (e.file_off.max(off), e.file_end().min(end));
        released.push(DevRange {
            dev_off: e.dev_off + (s - e.file_off),
            len: t - s,
        });
        if e.file_off < off {
            actions.insert(
                e.file_off,
                Some(Extent {
                    len: off - e.file_off,
                    ..*e
                }),
            );
        }
        if e.file_end() > end {
            let cut = end - e.file_off;
            let tail = Extent {
                file_off: end,
                len: e.len - cut,
                dev_off: e.dev_off + cut,
                unwritten: e.unwritten,
            };
            actions.insert(end, Some(tail));
        }
    }
    for e in new {
        actions.insert(e.file_off, Some(*e));
    }
    // What the keys from the last one before `off` up to `end` are now (a tail cut off
    // at `end` is left out: whether a key sat at `end` before was never read).
    let before = window.first().filter(|e| e.file_off < off);
    let mut known = ExtentsKnown {
        start: before.map_or(0, |e| e.file_off),
        end,
        extents: before
            .filter(|e| e.file_end() <= off)
            .into_iter()
            .copied()
            .collect(),
    };
    for (eoff, a) in actions {
        match a {
            Some(e) => {
                if e.file_off < end {
                    known.extents.push(e);
                }
                p.plan
                    .ops
                    .push(TxnOp::put(k.extent(ino, eoff), e.encode_value()));
            }
            None => p.delete(k.extent(ino, eoff)),
        }
    }
    let reused: Vec<DevRange> = new
        .iter()
        .map(|e| DevRange {
            dev_off: e.dev_off,
            len: e.len,
        })
        .collect();
    for r in subtract(released, &reused) {
        p.release(r);
    }
    if let Some(s) = size_at_least {
        attr.size = attr.size.max(s);
    }
    if touch_mtime {
        attr.mtime = p.ctx.now;
        attr.ctime = p.ctx.now;
    }
    p.put(k.inode(ino), &attr);
    p.plan.outcome.ino = Some(ino);
    p.plan.outcome.attr = Some(attr);
    p.plan.outcome.extents_known = Some(known);
    Ok(())
}

/// Writes free maps, each fenced on this session owning the group (a node whose lease
/// expired must not publish allocations from a group someone else may now own).
fn plan_free_maps(p: &mut P<'_>, maps: &[(crate::types::GroupId, Vec<u8>)], released: &[u64]) {
    for &off in released {
        p.delete(p.keys().released(off));
    }
    let k = p.keys();
    for (g, bytes) in maps {
        p.compare(Compare {
            key: k.group(*g),
            range_end: None,
            op: crate::kv::CompareOp::Equal,
            target: crate::kv::CompareTarget::Value(
                Owner {
                    session: p.ctx.session,
                }
                .encode(),
            ),
        });
        p.plan.ops.push(TxnOp::put(k.free_map(*g), bytes.clone()));
    }
}

fn plan_reclaim(p: &mut P<'_>, ino: Ino) -> R<()> {
    let k = p.keys();
    p.need(&[
        RangeRequest::key(k.orphan(ino)),
        RangeRequest::key(k.inode(ino)),
        extents_req(k, ino, 0),
        holders_req(k, ino),
    ])?;
    let okv = p
        .kv(&k.orphan(ino))?
        .ok_or(Stop::Fail(MetaError::NotFound))?;
    if !p.range(holders_req(k, ino))?.kvs.is_empty() {
        // Open somewhere: its holders' last close reclaims it (or, once their leases
        // end, the orphan scan).
        return Ok(());
    }
    let h = k.holders(ino);
    p.compare(Compare::range_empty(h.start, h.end));
    reclaim_orphan(p, ino, okv)
}

/// Reclaims orphan `ino` (its orphan record `okv` read) once nothing holds it open: the
/// caller has compared that.
fn reclaim_orphan(p: &mut P<'_>, ino: Ino, okv: &KeyValue) -> R<()> {
    let k = p.keys();
    let _owner: Owner = p.decode(okv)?;
    p.compare(Compare::mod_rev(k.orphan(ino), okv.mod_revision));
    p.plan.outcome.ino = Some(ino);
    if let Some((attr, rev)) = p.inode(ino)? {
        p.compare(Compare::mod_rev(k.inode(ino), rev));
        if attr.nlink > 0 {
            // Relinked cannot happen (link refuses orphans), but never delete a linked
            // inode on the strength of an orphan record: just drop the record.
            p.delete(k.orphan(ino));
            return Ok(());
        }
        if attr.kind == FileType::Regular && p.extents_exceed_one_txn(ino)? {
            // One chunk per transaction; the orphan record stays until the last, so a
            // crash part-way leaves the rest to be reclaimed.
            p.release_read_extents(ino, 0)?;
            p.plan.outcome.reclaim_more = true;
            return Ok(());
        }
        p.delete_inode_tree(ino, attr.kind, false)?;
    }
    p.delete(k.orphan(ino));
    Ok(())
}

/// The first open on this node: the open record, while the inode exists. Blind (no read):
/// opening costs one write, grouped with others.
fn plan_hold(p: &mut P<'_>, ino: Ino) -> R<()> {
    let k = p.keys();
    p.expect_present(&k.inode(ino))?;
    p.compare(Compare::exists(k.inode(ino)));
    p.put_held(ino)
}

/// The last close on this node. Usually blind: the record goes, compared "not an orphan".
/// An orphan (that compare failed, or it was read) is reclaimed here when no other node
/// holds it, in the same transaction as the record's delete, so that of two last closers
/// racing on two nodes exactly one sees the other gone.
fn plan_unhold(p: &mut P<'_>, ino: Ino) -> R<()> {
    let k = p.keys();
    let own = k.held(ino, p.ctx.session);
    let okey = k.orphan(ino);
    let okv = match p.snap.key(&okey) {
        None | Some(None) => {
            p.compare(Compare::absent(okey));
            p.delete(own);
            return Ok(());
        }
        Some(Some(okv)) => okv,
    };
    if p.ctx.read_only {
        // Only the record: the reclaim is a writable node's (its orphan scan finds the
        // orphan unheld), so a read-only node writes no inode, extent or free map.
        p.delete(own);
        return Ok(());
    }
    p.need(&[
        RangeRequest::key(k.inode(ino)),
        extents_req(k, ino, 0),
        holders_req(k, ino),
    ])?;
    p.delete(own.clone());
    let held = p.range(holders_req(k, ino))?;
    if let Some(other) = held.kvs.iter().find(|kv| kv.key != own) {
        // Another node still has it open: its close is the last. Compared, so that its
        // close (which finds this record) cannot commit unseen in between.
        p.compare(Compare::mod_rev(other.key.clone(), other.mod_revision));
        p.compare(Compare::mod_rev(okey, okv.mod_revision));
        return Ok(());
    }
    // Nobody else held it when read, and no open record has appeared since (ours is older).
    let h = k.holders(ino);
    p.compare(Compare {
        key: h.start,
        range_end: Some(h.end),
        op: crate::kv::CompareOp::Less,
        target: crate::kv::CompareTarget::ModRevision(held.revision + 1),
    });
    reclaim_orphan(p, ino, okv)
}

fn plan_touch(
    p: &mut P<'_>,
    ino: Ino,
    mtime: Option<Timespec>,
    ctime: Timespec,
    expect: Option<&InodeAttr>,
) -> R<()> {
    let k = p.keys();
    let Some(known) = p.known_inode(ino, expect)? else {
        // The inode went away meanwhile: nothing to stamp.
        return Ok(());
    };
    let mut a = known.val;
    let old = (a.mtime, a.ctime);
    if let Some(m) = mtime {
        a.mtime = a.mtime.max(m);
    }
    a.ctime = a.ctime.max(ctime);
    if (a.mtime, a.ctime) == old {
        if known.expected {
            // Nothing to write only by the guess: etcd decides (the re-plan finds the
            // read in its snapshot, which wins over the guess).
            return Err(Stop::Need(vec![RangeRequest::key(k.inode(ino))]));
        }
        return Ok(());
    }
    p.compare(known.guard);
    p.put(k.inode(ino), &a);
    p.plan.outcome.ino = Some(ino);
    p.plan.outcome.attr = Some(a);
    Ok(())
}

fn plan_reserve(p: &mut P<'_>, count: u64) -> R<()> {
    let k = p.keys();
    let key = k.ino_counter();
    let kv = p.kv(&key)?;
    let next = match kv {
        Some(kv) => p.decode::<InoCounter>(kv)?.next,
        None => Ino::FIRST_DYNAMIC,
    };
    let end = next
        .checked_add(count)
        .ok_or(Stop::Fail(MetaError::Invalid("inodes exhausted")))?;
    p.compare(Compare::mod_rev(
        key.clone(),
        kv.map_or(0, |kv| kv.mod_revision),
    ));
    p.put(key, &InoCounter { next: end });
    p.plan.outcome.inos = Some((next, end));
    Ok(())
}

/// Decodes extents returned as `prev_kvs` of a freeing range delete.
pub fn freed_from_kvs(keys: &Keyspace, kvs: &[KeyValue]) -> Vec<DevRange> {
    kvs.iter()
        .filter_map(|kv| {
            let Some(crate::keys::KeyKind::Extent(_, off)) = keys.parse(&kv.key) else {
                return None;
            };
            match Extent::decode_value(off, &kv.value) {
                Ok(e) => Some(DevRange {
                    dev_off: e.dev_off,
                    len: e.len,
                }),
                Err(e) => {
                    // The inode is gone either way; fsck can find the leaked blocks.
                    log::error!("freed extent {} is corrupt: {e}", keys.describe(&kv.key));
                    None
                }
            }
        })
        .collect()
}
