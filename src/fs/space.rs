//! Space: the groups this node owns and their free maps (claims, hand-backs to other
//! nodes when they ask or when a group has been idle, dead local sessions), blocks handed
//! out and given back, frees returned to their groups, and what dead nodes leave: orphans
//! and released records in groups nobody owns. The allocator itself is pure
//! (`crate::data::alloc`); this is where it meets etcd. ARCHITECTURE.md ("Space between
//! nodes") says what ENOSPC means and its bound.
//!
//! Invariants (ARCHITECTURE.md has the reasons): a group's map is loaded only when the
//! group is not owned, and claims and hand-backs run one at a time (`Inner::claiming`); a
//! block is reserved from its allocation until the commit of the extent that points at it,
//! and only that commit publishes it as used in etcd's map.

use super::*;

/// Released records (`R`) read per page when a group is loaded.
#[cfg(not(test))]
const RELEASED_LOAD_PAGE: i64 = 4096;
/// Small in unit tests, so that their groups' records take several pages.
#[cfg(test)]
const RELEASED_LOAD_PAGE: i64 = 8;

/// Every released record (`R`) starting in device bytes `[from, to)`, read in pages of
/// [`RELEASED_LOAD_PAGE`]. Ranges in one group never overlap, so a group has at most as
/// many records as blocks.
async fn released_records(
    kv: &dyn meta::kv::KvBackend,
    keys: &meta::keys::Keyspace,
    from: u64,
    to: u64,
) -> Result<Vec<meta::kv::KeyValue>, MetaError> {
    let rr = keys.released_between(from, to);
    let mut start = rr.start;
    let mut records = Vec::new();
    loop {
        let req = RangeRequest::range(start, rr.end.clone()).limit(RELEASED_LOAD_PAGE);
        let page = kv.range(req).await?;
        let next = page.kvs.last().map(|kv| {
            let mut k = kv.key.clone();
            k.push(0);
            k
        });
        records.extend(page.kvs);
        match next {
            Some(k) if page.more => start = k,
            _ => return Ok(records),
        }
    }
}

/// Groups with released records and no owner claimed per housekeeping pass.
const ADOPT_PER_PASS: usize = 4;

/// When this node last saw each of its groups' allocation stamps change
/// (`Allocator::last_use`): how long a group has been idle.
#[derive(Default)]
pub(crate) struct IdleGroups {
    seen: HashMap<AgId, (u64, std::time::Instant)>,
}

impl IdleGroups {
    /// The owned groups whose stamp has not changed for `idle_for` and that have nothing
    /// reserved; a group seen for the first time counts as used now.
    fn idle(
        &mut self,
        a: &Allocator,
        now: std::time::Instant,
        idle_for: std::time::Duration,
    ) -> BTreeSet<AgId> {
        self.seen.retain(|g, _| a.owned().contains(g));
        let mut out = BTreeSet::new();
        for &g in a.owned() {
            let stamp = a.last_use(g);
            let since = match self.seen.get(&g) {
                Some(&(s, t)) if s == stamp && a.reserved_in(g) == 0 => t,
                _ => {
                    self.seen.insert(g, (stamp, now));
                    now
                }
            };
            if now.duration_since(since) >= idle_for && a.reserved_in(g) == 0 {
                out.insert(g);
            }
        }
        out
    }

    fn forget(&mut self, g: AgId) {
        self.seen.remove(&g);
    }
}

impl Inner {
    /// Returns freed device ranges to the allocator and persists the free maps of the
    /// groups this node owns, deleting the released records (`R`) the freeing commit logged
    /// for them in the same transaction. A crash before that leaves the records, which the
    /// next node to load the group applies (see [`Inner::try_claim`]); blocks in groups
    /// other nodes own are left to them the same way. `revision` is the freeing commit's
    /// (its records have it), 0 for none.
    pub(super) fn release_blocks(
        &self,
        freed: &[meta::pipeline::DevRange],
        released: &[meta::pipeline::DevRange],
        revision: i64,
    ) {
        // Blocks in a group nobody owns (its node died) are ours to return: claim the
        // group first, which loads its authoritative free map (and applies our records).
        let exts: Vec<Extent> = freed
            .iter()
            .map(|r| Extent::new(r.dev_off / BLOCK_SIZE, r.len / BLOCK_SIZE))
            .filter(|e| e.len > 0)
            .collect();
        let unowned: Vec<AgId> = {
            let a = lock(&self.alloc);
            a.groups_of(&exts)
                .into_iter()
                .filter(|g| !a.owned().contains(g))
                .collect()
        };
        for g in unowned {
            if let Err(e) = self.try_claim(g.0) {
                log::warn!("claiming group {} to return freed blocks: {e}", g.0);
            }
        }
        let mut a = lock(&self.alloc);
        let mut changed = BTreeSet::new();
        let mut done: Vec<meta::pipeline::DevRange> = Vec::new();
        // Group by group: an extent can run across a group boundary (contiguous pieces of
        // two groups merge), and a claim applies the released records of its group only.
        // Freeing such a range whole once treated the part in the group already owned as
        // freed by the claim, and leaked it (found by the kill -9 loop's final count).
        let parts = freed.iter().flat_map(|r| {
            let ext = Extent::new(r.dev_off / BLOCK_SIZE, r.len / BLOCK_SIZE);
            if ext.len == 0 {
                return Vec::new();
            }
            a.split_by_group(ext).unwrap_or_else(|e| {
                log::error!("freed range {ext}: {e}");
                Vec::new()
            })
        });
        let parts: Vec<(AgId, Extent)> = parts.collect();
        // Parts in other nodes' groups that the commit freed without logging: logged now,
        // for their owners (unlogged, nobody would ever return them).
        let mut unlogged = Vec::new();
        for (g, part) in parts {
            let range = meta::pipeline::DevRange {
                dev_off: part.dev_off(),
                len: part.byte_len(),
            };
            if !a.owned().contains(&g) {
                if released.iter().any(|p| dev_range_within(&range, p)) {
                    log::debug!(
                        "freed {part} lies in group {} of another node: left to it",
                        g.0
                    );
                } else {
                    unlogged.push(range);
                }
                continue;
            }
            if self.held.take_folded(part, revision) {
                // Folded from this commit's released record before we got here
                // (`fold_released`, a hand-back or a claim): freeing it again could free
                // blocks handed out since.
                done.push(range);
                continue;
            }
            match a.free(part) {
                Ok(g) => {
                    changed.extend(g);
                    done.push(range);
                }
                // Already free: a claim applied this range's released record (this call's,
                // or another thread's that ran between the commit and now).
                Err(AllocError::DoubleFree { .. }) => done.push(range),
                Err(e) => log::error!("freeing {part}: {e}"),
            }
        }
        // Records whose range is in the maps now (each lies inside one group's part).
        let records: Vec<u64> = released
            .iter()
            .filter(|p| done.iter().any(|r| dev_range_within(p, r)))
            .map(|p| p.dev_off)
            .collect();
        if !unlogged.is_empty() {
            log::info!(
                "logging {} freed ranges in groups of other nodes as released records",
                unlogged.len()
            );
        }
        for c in unlogged.chunks(meta::pipeline::LOG_RELEASED_MAX) {
            let m = Mutation::LogReleased { ranges: c.to_vec() };
            if let Err(e) = self.meta.submit_blocking(m) {
                log::error!("logging freed ranges of other nodes' groups: {e} (leaked)");
            }
        }
        if changed.is_empty() && records.is_empty() {
            return;
        }
        // Each record goes with its group's map; batches stay well inside a transaction.
        let mut by_group: std::collections::BTreeMap<AgId, Vec<u64>> = Default::default();
        for off in records {
            if let Some(g) = self.geometry.ag_of(BlockNo(off / BLOCK_SIZE)) {
                changed.insert(g);
                by_group.entry(g).or_default().push(off);
            }
        }
        let mut batches: Vec<Mutation> = Vec::new();
        let (mut maps, mut recs) = (Vec::new(), Vec::new());
        for (g, map) in encode_maps(&a, &changed) {
            let mine = by_group.remove(&AgId(g.0)).unwrap_or_default();
            let mut chunks: Vec<&[u64]> = mine.chunks(RELEASED_PER_FOLD - 1).collect();
            if chunks.is_empty() {
                chunks.push(&[]);
            }
            for c in chunks {
                if maps.len() + recs.len() + 1 + c.len() > RELEASED_PER_FOLD {
                    batches.push(Mutation::FreeMaps {
                        maps: std::mem::take(&mut maps),
                        released: std::mem::take(&mut recs),
                    });
                }
                maps.push((g, map.clone()));
                recs.extend_from_slice(c);
            }
        }
        if !maps.is_empty() {
            batches.push(Mutation::FreeMaps {
                maps,
                released: recs,
            });
        }
        // Submitted under the allocator lock, so free-map writes commit in the order of
        // the allocator changes they describe.
        for m in batches {
            if let Err(e) = self.meta.submit_blocking(m) {
                log::error!("persisting free maps: {e}");
            }
        }
    }

    pub(super) fn reclaim_orphan(&self, ino: Ino) {
        if self.read_only {
            return;
        }
        // A large file goes in chunks, one commit each; every chunk removes extents, so
        // this ends.
        loop {
            match self.meta.commit(Mutation::ReclaimOrphan { ino }) {
                Ok(out) => {
                    self.after_commit(&out);
                    if !out.reclaim_more {
                        return;
                    }
                }
                Err(MetaError::NotFound) => return,
                Err(e) => {
                    log::warn!("reclaiming orphan inode {ino}: {e}");
                    return;
                }
            }
        }
    }

    /// Claims up to `n` more allocation groups and loads their free maps. One range read
    /// finds the groups nobody owns; only those are tried.
    pub(super) fn claim_groups(&self, n: usize) -> Result<usize, MetaError> {
        let session = lock(&self.session).clone().ok_or(MetaError::Closed)?;
        let owned: BTreeSet<u32> = run_read(&self.meta, |kv, keys| {
            Box::pin(async move { meta::session::group_owners(&*kv, &keys).await })
        })?
        .into_iter()
        .map(|(g, _)| g.0)
        .collect();
        let count = self.geometry.ag_count;
        let start = (session.id().0 % u64::from(count.max(1))) as u32;
        let mut claimed = 0;
        for i in 0..count {
            if claimed >= n {
                break;
            }
            let g = (start + i) % count;
            if !owned.contains(&g) && self.try_claim(g)? {
                claimed += 1;
            }
        }
        Ok(claimed)
    }

    /// Ends the sessions of daemons of this host that died without closing them (kill -9,
    /// a crash): their recorded pid is gone, or is some other process. Their groups and
    /// orphans are free at once rather than a lease TTL later, so a remount right after a
    /// crash has all the space. Only this host can tell, by its process table: node names
    /// must be unique in the cluster (the hostname by default).
    pub(super) fn revoke_dead_local_sessions(&self) {
        if self.read_only {
            return;
        }
        let Some(session) = lock(&self.session).clone() else {
            return;
        };
        let live = match run_read(&self.meta, |kv, keys| {
            Box::pin(async move { meta::session::live_sessions(&*kv, &keys).await })
        }) {
            Ok(l) => l,
            Err(e) => {
                log::warn!("listing sessions: {e}");
                return;
            }
        };
        let here = node_name();
        for (id, rec) in live {
            if id == session.id() || rec.name != here.as_bytes() || daemon_alive(&rec) {
                continue;
            }
            log::info!(
                "session {id} of this host (pid {}) is dead: ending it now",
                rec.pid
            );
            let s = session.clone();
            if let Err(e) = run_read(&self.meta, move |_, _| {
                Box::pin(async move { s.revoke_dead(id).await })
            }) {
                log::warn!("ending dead session {id}: {e}");
            }
        }
    }

    /// Claims group `g` (if no live session owns it) and loads its free map from etcd.
    /// True when this node newly owns it.
    pub(super) fn try_claim(&self, g: u32) -> Result<bool, MetaError> {
        if self.read_only {
            // A claim writes the group's owner key; a read-only node allocates nothing.
            return Err(MetaError::ReadOnly);
        }
        let session = lock(&self.session).clone().ok_or(MetaError::Closed)?;
        // One claim at a time: etcd answers "yours" to a second claim of a group this
        // session already holds, and two writers that ran out of space at once used to load
        // the group twice, the second load dropping the blocks the first had handed out.
        let _one = lock(&self.claiming);
        if lock(&self.alloc).owned().contains(&AgId(g)) {
            return Ok(false);
        }
        let s = session.clone();
        let got = run_read(&self.meta, move |_, _| {
            Box::pin(async move { s.claim_group(GroupId(g)).await })
        })?;
        if !got {
            return Ok(false);
        }
        let Some(span) = self.geometry.ag_extent(AgId(g)) else {
            return Ok(false);
        };
        let (from, to) = (span.start.0 * BLOCK_SIZE, span.end() * BLOCK_SIZE);
        // Every released record of the group, in pages (one left out would only be applied
        // by a later load: its blocks used meanwhile). Ranges in one group never overlap,
        // so there are at most as many as the group has blocks.
        let (raw, records) = run_read(&self.meta, move |kv, keys| {
            Box::pin(async move {
                let key = keys.free_map(GroupId(g));
                let r = kv.range(RangeRequest::key(key)).await?;
                let map = r.kvs.into_iter().next();
                let records = released_records(&*kv, &keys, from, to).await?;
                Ok((map, records))
            })
        })?;
        // Every released record is a free the map does not hold yet: whatever makes a map
        // include a record deletes the record in the same transaction, and nothing reuses
        // its blocks before that transaction (later writes of the map wait for it, and a
        // failed one stops them: the committer's unsafe maps). Records the map holds anyway
        // (a fold left half done by a crash) are freed twice, which `free_lenient` allows.
        // Taking a record older than the map as included leaked it whenever the owner
        // rewrote the map for an allocation before folding the record, then died.
        let raw = raw.map(|kv| kv.value);
        let keys = self.meta.keys();
        let mut apply = Vec::new();
        let mut fold = Vec::new();
        for kv in &records {
            let Some(meta::keys::KeyKind::Released(off)) = keys.parse(&kv.key) else {
                continue;
            };
            match meta::codec::decode_at::<meta::codec::Released>(keys, &kv.key, &kv.value) {
                Ok(r) => {
                    apply.push((
                        Extent::new(off / BLOCK_SIZE, r.len / BLOCK_SIZE),
                        kv.mod_revision,
                    ));
                    fold.push(off);
                }
                // Its length is unknown: the range stays used (leaked), the record stays
                // for an operator, and the load goes on.
                Err(e) => log::error!("{e}; released record skipped, left as it is"),
            }
        }
        let map = match raw {
            // Never written: nothing was ever allocated from the group.
            None => AgFreeMap::all_free(AgId(g), span),
            Some(b) => match AgFreeMap::decode(&b, AgId(g), span) {
                Ok(m) => m,
                Err(e) => {
                    log::error!(
                        "corrupt free map at key {}: {e}; not using group {g}",
                        self.meta
                            .keys()
                            .describe(&self.meta.keys().free_map(GroupId(g)))
                    );
                    return Ok(false);
                }
            },
        };
        let mut map = map;
        for (e, rev) in apply {
            map.free_lenient(e);
            // A record of one of our own commits whose bookkeeping has not run yet: it
            // must not free the range again once the blocks may be handed out.
            if e.len > 0 {
                self.held.note_folded(e, rev);
            }
        }
        let mut a = lock(&self.alloc);
        if let Err(e) = a.load_group(map).and_then(|()| a.own(AgId(g))) {
            log::error!("loading group {g}: {e}");
            return Ok(false);
        }
        // The map with the records applied replaces them, in fenced commits of a bounded
        // number of deletes each (every one writes the whole map).
        let maps = encode_maps(&a, &BTreeSet::from([AgId(g)]));
        let tickets: Vec<_> = fold
            .chunks(RELEASED_PER_FOLD)
            .map(|c| {
                self.meta.submit_blocking(Mutation::FreeMaps {
                    maps: maps.clone(),
                    released: c.to_vec(),
                })
            })
            .collect();
        drop(a);
        for t in tickets {
            if let Err(e) = t.and_then(|t| t.wait()) {
                log::warn!("folding released records into group {g}'s free map: {e}");
            }
        }
        Ok(true)
    }

    /// Orphans are kept by open records, which vanish with their node's lease: those no
    /// node holds any more are reclaimed (`held.rs`), a bounded number of pages per call
    /// (the next call resumes where this one stopped).
    pub(super) fn reclaim_dead_orphans(&self) -> Result<(), MetaError> {
        if self.read_only {
            return Ok(());
        }
        self.adopt_released_groups()?;
        self.reclaim_unheld_orphans().map(|_| ())
    }

    /// Claims groups nobody owns that have released records (`R`): their owner died (or
    /// gave them back) before folding frees other nodes made in them. Loading a group
    /// applies its records, so the space is free in its map and statfs counts it, instead
    /// of staying used until some node happens to claim the group for space. At most
    /// [`ADOPT_PER_PASS`] groups a pass; the claimed groups go back when idle.
    fn adopt_released_groups(&self) -> Result<(), MetaError> {
        let (records, owners) = run_read(&self.meta, |kv, keys| {
            Box::pin(async move {
                let r = keys.released_between(0, u64::MAX);
                let req = RangeRequest::range(r.start, r.end)
                    .limit(RELEASED_LOAD_MAX)
                    .keys_only();
                let records = kv.range(req).await?.kvs;
                let owners = meta::session::group_owners(&*kv, &keys).await?;
                Ok((records, owners))
            })
        })?;
        if records.is_empty() {
            return Ok(());
        }
        let owned: BTreeSet<u32> = owners.into_iter().map(|(g, _)| g.0).collect();
        let keys = self.meta.keys();
        let orphaned: BTreeSet<u32> = records
            .iter()
            .filter_map(|kv| match keys.parse(&kv.key) {
                Some(meta::keys::KeyKind::Released(off)) => {
                    self.geometry.ag_of(BlockNo(off / BLOCK_SIZE))
                }
                _ => None,
            })
            .map(|g| g.0)
            .filter(|g| !owned.contains(g))
            .collect();
        for g in orphaned.into_iter().take(ADOPT_PER_PASS) {
            if self.try_claim(g)? {
                log::info!("claimed group {g}: nobody owned it, and it had frees to apply");
            }
        }
        Ok(())
    }

    /// Free blocks of the groups this node owns (tests).
    #[cfg(test)]
    pub(crate) fn alloc_free_blocks(&self) -> u64 {
        let a = lock(&self.alloc);
        a.owned()
            .iter()
            .map(|g| a.group(*g).map_or(0, AgFreeMap::free_blocks))
            .sum()
    }

    /// Blocks in this node's groups, claiming free groups for a shortfall, then asking the
    /// owners of groups with free space to hand some over (and waiting for dead owners'
    /// leases to run out). ENOSPC only when the device as a whole lacks the space, or when
    /// nobody hands any over within [`SPACE_WAIT_MAX`].
    pub(super) fn alloc_blocks(
        &self,
        blocks: u64,
        goal: Option<BlockNo>,
    ) -> Result<Vec<Extent>, Errno> {
        // When this allocation first asked other nodes for space, and last asked.
        let mut asked: Option<std::time::Instant> = None;
        let mut asked_last: Option<std::time::Instant> = None;
        let r = loop {
            let r = lock(&self.alloc).alloc(blocks, goal);
            let (wanted, free) = match r {
                Err(AllocError::NoSpace { wanted, free }) => (wanted, free),
                Ok(p) => break Ok(p),
                Err(e) => break Err(errno::alloc(&e)),
            };
            // Another node asked for space while this one waits: hand groups over from
            // here. Housekeeping, which does it otherwise, may be stuck behind this very
            // write (its age trigger waits for the file's lock), and with every node waiting
            // so, none handed anything over and all got ENOSPC after SPACE_WAIT_MAX with
            // the device not full (found by tests/recovery.rs, three nodes filling it).
            if asked.is_some() && self.space_wanted.swap(false, Ordering::AcqRel) {
                self.hand_back_groups();
            }
            let need = (wanted - free.min(wanted)).div_ceil(self.geometry.ag_blocks);
            match self.claim_groups(need.max(1) as usize) {
                Ok(n) if n > 0 => continue,
                Ok(_) => {}
                Err(e) => {
                    log::warn!("claiming groups for {wanted} blocks: {e}");
                    break Err(Errno::ENOSPC);
                }
            }
            // Every group has an owner. Once a second: is the space there at all, and the
            // request renewed (an owner that handed back too little hears it again); in
            // between, only the claim above, which sees a group handed back.
            if asked_last.is_none_or(|t| t.elapsed() >= SPACE_ASK_EVERY) {
                match self.device_free_blocks() {
                    Ok(total) if total >= wanted => {}
                    Ok(_) => break Err(Errno::ENOSPC),
                    Err(e) => break Err(e),
                }
                if asked_last.is_none() {
                    log::info!(
                        "out of space in this node's groups ({wanted} blocks wanted): asking \
                         their owners for some"
                    );
                }
                asked_last = Some(std::time::Instant::now());
                if let Err(e) = self.with_session(|s| Box::pin(async move { s.want_space().await }))
                {
                    log::warn!("asking other nodes for space: {e}");
                }
            }
            let since = *asked.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > SPACE_WAIT_MAX || !self.op_serving() {
                log::warn!(
                    "no node handed over space within {} s: ENOSPC",
                    SPACE_WAIT_MAX.as_secs()
                );
                break Err(Errno::ENOSPC);
            }
            std::thread::sleep(SPACE_POLL);
        };
        if asked.is_some() {
            if let Err(e) = self.with_session(|s| Box::pin(async move { s.space_found().await })) {
                log::warn!("withdrawing the request for space: {e}");
            }
        }
        r
    }

    /// Whether this node's groups hold `blocks` free blocks now (no claim, no wait).
    pub(super) fn owns_free_blocks(&self, blocks: u64) -> bool {
        lock(&self.alloc).free_blocks_owned() >= blocks
    }

    /// Runs a session call on the pipeline's runtime.
    pub(super) fn with_session<T: Send + 'static>(
        &self,
        f: impl FnOnce(
                Arc<Session>,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<T, MetaError>> + Send>,
            > + Send
            + 'static,
    ) -> Result<T, MetaError> {
        let session = lock(&self.session).clone().ok_or(MetaError::Closed)?;
        run_read(&self.meta, move |_, _| f(session))
    }

    /// Free blocks on the whole device: this node's groups from its allocator, the
    /// others' from the maps in etcd (what statfs shows).
    pub(super) fn device_free_blocks(&self) -> Result<u64, Errno> {
        let raw = run_read(&self.meta, |kv, keys| {
            Box::pin(async move {
                let r = keys.free_maps();
                Ok(kv.range(RangeRequest::range(r.start, r.end)).await?.kvs)
            })
        })
        .map_err(|e| errno::meta(&e))?;
        let stored: HashMap<Vec<u8>, Vec<u8>> =
            raw.into_iter().map(|kv| (kv.key, kv.value)).collect();
        let a = lock(&self.alloc);
        let mut free = 0u64;
        for g in 0..self.geometry.ag_count {
            let ag = AgId(g);
            let Some(span) = self.geometry.ag_extent(ag) else {
                continue;
            };
            if a.owned().contains(&ag) {
                free += a.group(ag).map_or(0, AgFreeMap::free_blocks);
                continue;
            }
            let key = self.meta.keys().free_map(GroupId(g));
            free += match stored.get(&key) {
                None => span.len,
                Some(b) => match AgFreeMap::decode(b, ag, span) {
                    Ok(m) => m.free_blocks(),
                    Err(e) => {
                        log::error!(
                            "corrupt free map at key {}: {e}",
                            self.meta.keys().describe(&key)
                        );
                        0
                    }
                },
            };
        }
        Ok(free)
    }

    /// The watch saw a request for space.
    pub(super) fn space_wanted_by(&self, asker: meta::types::SessionId) {
        let mine = lock(&self.session).as_ref().map(|s| s.id());
        if mine != Some(asker) {
            self.space_wanted.store(true, Ordering::Release);
        }
    }

    /// Another node is out of space: hand back up to half the groups this node owns (the
    /// emptiest first), and at least one when there is one to give, even the last: the
    /// asker asks again every second while it waits, so every group with free space
    /// reaches it in turn, and ENOSPC means the device is full, not that the free space is
    /// scattered over the last groups of several nodes. Never a group holding blocks of
    /// writes not yet committed (those are about to be used anyway). Each goes with its
    /// final map (fenced on our ownership, so the next owner loads exactly what we last
    /// allocated), then its ownership record is deleted.
    pub(super) fn hand_back_groups(&self) {
        // No claim runs meanwhile: one of a group being handed back (a free landing in it
        // claims it again) would be answered "yours" and could load its map from etcd
        // before the final map write landed, then hand out blocks that write allocated.
        let _one = lock(&self.claiming);
        let candidates: Vec<AgId> = {
            let a = lock(&self.alloc);
            let mut owned: Vec<(u64, AgId)> = a
                .owned()
                .iter()
                .filter(|g| a.reserved_in(**g) == 0)
                .map(|g| (a.group(*g).map_or(0, AgFreeMap::free_blocks), *g))
                .filter(|(free, _)| *free > 0)
                .collect();
            owned.sort_unstable_by(|x, y| y.cmp(x));
            let keep = a.owned().len().div_ceil(2).max(1);
            let give = a.owned().len().saturating_sub(keep).max(1);
            owned.into_iter().take(give).map(|(_, g)| g).collect()
        };
        for g in candidates {
            if self.give_group_back(g) {
                log::info!("handed group {} back for another node", g.0);
            }
        }
    }

    /// Gives back the groups this node has not allocated from for `idle_for` (see
    /// [`GROUP_IDLE_GIVE_BACK`]) when it has more than it needs: it keeps at least one, and
    /// a group's worth of free space when it has that much (`Allocator::surplus_groups`).
    /// A group with reserved blocks is never idle (its write has not committed).
    pub(super) fn give_back_idle_groups(&self, idle_for: std::time::Duration) {
        let _one = lock(&self.claiming);
        let surplus = {
            let a = lock(&self.alloc);
            let idle = lock(&self.idle_groups).idle(&a, std::time::Instant::now(), idle_for);
            a.surplus_groups(&idle, self.geometry.ag_blocks)
        };
        for g in surplus {
            if self.give_group_back(g) {
                log::info!(
                    "gave back group {}: unused for {} s, and this node has enough space without it",
                    g.0,
                    idle_for.as_secs()
                );
            }
        }
    }

    /// At unmount: hands back, with their final maps, the groups that have released
    /// records other nodes wrote and this node has not folded yet. The session's end
    /// frees every group anyway and the next owner would apply the records, but until some
    /// node claims the group its free space would not show.
    pub(super) fn fold_before_leaving(&self) {
        if self.read_only {
            return;
        }
        // One paged read of every record (they are few: each lives for seconds).
        let records = run_read(&self.meta, |kv, keys| {
            Box::pin(async move { released_records(&*kv, &keys, 0, u64::MAX).await })
        });
        let records = match records {
            Ok(r) => r,
            Err(e) => {
                log::warn!("reading released records at unmount: {e}");
                return;
            }
        };
        let keys = self.meta.keys();
        let with_records: BTreeSet<AgId> = records
            .iter()
            .filter_map(|kv| match keys.parse(&kv.key) {
                Some(meta::keys::KeyKind::Released(off)) => {
                    self.geometry.ag_of(BlockNo(off / BLOCK_SIZE))
                }
                _ => None,
            })
            .collect();
        let _one = lock(&self.claiming);
        let mine: Vec<AgId> = {
            let a = lock(&self.alloc);
            with_records
                .into_iter()
                .filter(|g| a.owned().contains(g))
                .collect()
        };
        for g in mine {
            if self.give_group_back(g) {
                log::info!(
                    "gave back group {} with the frees other nodes made in it",
                    g.0
                );
            }
        }
    }

    /// Hands one owned group back (the caller holds `claiming`): stops allocating in it
    /// (refused if it has reserved blocks), folds the released records other nodes wrote
    /// in it, commits its final map with their deletes, fenced on our ownership, after
    /// everything already submitted (a flush: an earlier commit that published blocks of
    /// it lands first), then deletes its ownership record. A record left behind would be
    /// applied by the next owner: harmless, but its space would not show until then.
    pub(super) fn give_group_back(&self, g: AgId) -> bool {
        let Some(span) = self.geometry.ag_extent(g) else {
            return false;
        };
        let tickets = {
            let mut a = lock(&self.alloc);
            if a.disown(g).is_err() {
                return false;
            }
            // As in `fold_released`: under the allocator lock no free of ours starts; the
            // flush lands the ones submitted (each with its record) before the read.
            let (from, to) = (span.start.0 * BLOCK_SIZE, span.end() * BLOCK_SIZE);
            let records = self.meta.flush(None).and_then(|t| t.wait()).and_then(|_| {
                run_read(&self.meta, move |kv, keys| {
                    Box::pin(async move { released_records(&*kv, &keys, from, to).await })
                })
            });
            let records = match records {
                Ok(r) => r,
                Err(e) => {
                    log::warn!(
                        "handing back group {}: reading its released records: {e}",
                        g.0
                    );
                    let _ = a.own(g);
                    return false;
                }
            };
            let keys = self.meta.keys();
            let mut folded = Vec::new();
            for kv in &records {
                let Some(meta::keys::KeyKind::Released(off)) = keys.parse(&kv.key) else {
                    continue;
                };
                let len =
                    match meta::codec::decode_at::<meta::codec::Released>(keys, &kv.key, &kv.value)
                    {
                        Ok(r) => r.len,
                        Err(e) => {
                            log::error!("{e}; released record skipped, left as it is");
                            continue;
                        }
                    };
                let ext = Extent::new(off / BLOCK_SIZE, len / BLOCK_SIZE);
                if ext.len == 0 || ext.end() > span.end() {
                    log::error!("released record at {off} is not inside group {}", g.0);
                    continue;
                }
                match a.free(ext) {
                    Ok(_) => {
                        self.held.note_folded(ext, kv.mod_revision);
                        folded.push(off);
                    }
                    Err(AllocError::DoubleFree { .. }) => folded.push(off),
                    Err(e) => log::error!("folding released {ext}: {e}"),
                }
            }
            let maps = encode_maps(&a, &BTreeSet::from([g]));
            let mut chunks: Vec<&[u64]> = folded.chunks(RELEASED_PER_FOLD - 1).collect();
            if chunks.is_empty() {
                chunks.push(&[]);
            }
            chunks
                .into_iter()
                .map(|c| {
                    self.meta.submit_blocking(Mutation::FreeMaps {
                        maps: maps.clone(),
                        released: c.to_vec(),
                    })
                })
                .collect::<Vec<_>>()
        };
        let mut written = Ok(());
        for t in tickets {
            if let Err(e) = t.and_then(|t| t.wait()) {
                written = Err(e);
            }
        }
        let written = written
            .and_then(|()| self.meta.flush(None))
            .and_then(|t| t.wait());
        if let Err(e) = written {
            log::warn!("handing back group {}: writing its map: {e}", g.0);
            let _ = lock(&self.alloc).own(g);
            return false;
        }
        let gid = GroupId(g.0);
        match self.with_session(move |s| Box::pin(async move { s.release_group(gid).await })) {
            Ok(true) => {
                lock(&self.idle_groups).forget(g);
                true
            }
            Ok(false) => {
                log::warn!("group {} was no longer ours to hand back", g.0);
                false
            }
            Err(e) => {
                log::warn!("handing back group {}: {e}", g.0);
                false
            }
        }
    }

    /// Gives back the blocks of a commit that failed, unless it may have applied (etcd
    /// unreachable: an extent may point at them now); those are leaked rather than risk
    /// handing them out twice.
    pub(super) fn unalloc_unless_maybe_applied(&self, allocated: &[FileExtent], e: Errno) {
        if e == Errno::EIO {
            log::warn!(
                "keeping {} blocks of a commit whose outcome is unknown",
                allocated.iter().map(|e| e.len / BLOCK_SIZE).sum::<u64>()
            );
        } else {
            self.unalloc(allocated);
        }
    }

    /// Gives back blocks allocated for a write that failed before its commit.
    pub(super) fn unalloc(&self, allocated: &[FileExtent]) {
        let mut a = lock(&self.alloc);
        for e in allocated {
            if let Err(err) = a.free(device_blocks(e)) {
                log::error!("returning blocks of a failed write: {err}");
            }
        }
    }
}

/// Whether the daemon of a session of this host still runs: its pid is an etcfs process,
/// not a zombie, started no later than the session (a reused pid is a newer process).
pub(super) fn daemon_alive(rec: &meta::codec::NodeRecord) -> bool {
    let proc_dir = PathBuf::from(format!("/proc/{}", rec.pid));
    // The program, by its executable's name or its argv[0] (comm is cut at 15 bytes and
    // a helper such as mount.etcfs may have exec'd it): anything else is not the daemon.
    let exe = std::fs::read_link(proc_dir.join("exe")).unwrap_or_default();
    let argv0 = std::fs::read(proc_dir.join("cmdline")).unwrap_or_default();
    let argv0 = argv0.split(|&b| b == 0).next().unwrap_or_default();
    let named_etcfs = |b: &[u8]| b.windows(5).any(|w| w == b"etcfs");
    if !named_etcfs(exe.as_os_str().as_encoded_bytes()) && !named_etcfs(argv0) {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(proc_dir.join("stat")) else {
        return false;
    };
    // Fields after the parenthesised name: state is the first, start time the 20th.
    let Some(after) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return true;
    };
    let fields: Vec<&str> = after.split_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return false;
    }
    let started_ticks: Option<f64> = fields.get(19).and_then(|t| t.parse().ok());
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    });
    // /proc counts start times in USER_HZ, 100 on every Linux ABI.
    let hz = 100.0;
    match (started_ticks, boot) {
        (Some(t), Some(b)) => b + t / hz <= rec.started.sec as f64 + 2.0,
        _ => true,
    }
}

/// Whether device range `inner` lies inside `outer`.
pub(super) fn dev_range_within(
    inner: &meta::pipeline::DevRange,
    outer: &meta::pipeline::DevRange,
) -> bool {
    inner.dev_off >= outer.dev_off && inner.dev_off + inner.len <= outer.dev_off + outer.len
}

pub(super) fn encode_maps(a: &Allocator, groups: &BTreeSet<AgId>) -> Vec<(GroupId, Vec<u8>)> {
    groups
        .iter()
        .filter_map(|g| a.encode_published(*g).map(|m| (GroupId(g.0), m)))
        .collect()
}
