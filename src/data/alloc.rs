//! The block allocator: a pure data structure (no I/O, no clock, no etcd), so it can be
//! tested exhaustively and driven by the simulator.
//!
//! Free space is kept per allocation group as a set of free extents (start → length,
//! absolute block numbers), always coalesced: no two free extents touch. The meta layer
//! stores each group's map in etcd with [`AgFreeMap::encode`] and loads it with
//! [`AgFreeMap::decode`]; this module never decides ownership, it is given the set of groups
//! the node owns and allocates only inside them. Freeing is allowed in any loaded group
//! (a file written by another node may be truncated here), and every free checks for double
//! frees, so a corrupted extent map cannot silently hand the same block to two files.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
};

use super::{crc::crc32c, superblock::Geometry, AgId, Extent};

/// Version byte of the encoded free map.
const FREE_MAP_VERSION: u8 = 1;
/// Bytes of the fixed header: version, AG id, span start, span length.
const FREE_MAP_HEADER_BYTES: usize = 1 + 4 + 8 + 8;

/// Why an allocator operation failed. Nothing changes when an operation fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AllocError {
    /// The owned groups hold fewer free blocks than asked for (ENOSPC).
    NoSpace { wanted: u64, free: u64 },
    /// A block range that is not inside the data groups of the device.
    OutsideGroups(Extent),
    /// The group's free map is not loaded.
    NotLoaded(AgId),
    /// Owning a group whose free map is not loaded, or one that does not exist.
    BadOwnership(AgId),
    /// Freeing blocks that are already free.
    DoubleFree { extent: Extent, overlaps: Extent },
    /// Marking blocks used that are not all free.
    NotFree(Extent),
    /// An encoded free map is malformed.
    Decode(String),
    /// Replacing the map of a group this node allocates in: its blocks handed out but not
    /// yet committed are only in the loaded map, and a reload would hand them out again.
    ReloadOwned(AgId),
    /// Giving up a group that still holds blocks handed out and not yet committed.
    GroupBusy(AgId),
}

impl AllocError {
    /// The errno for a filesystem operation that hit this error.
    pub(crate) fn errno(&self) -> i32 {
        match self {
            AllocError::NoSpace { .. } => libc::ENOSPC,
            _ => libc::EIO,
        }
    }
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::NoSpace { wanted, free } => write!(
                f,
                "no space: {wanted} blocks wanted, {free} free in the groups this node owns"
            ),
            AllocError::OutsideGroups(e) => write!(f, "{e} is outside the allocation groups"),
            AllocError::NotLoaded(ag) => write!(f, "free map of {ag} is not loaded"),
            AllocError::BadOwnership(ag) => {
                write!(
                    f,
                    "cannot own {ag}: no such group or its free map is not loaded"
                )
            }
            AllocError::DoubleFree { extent, overlaps } => {
                write!(f, "double free: {extent} overlaps free {overlaps}")
            }
            AllocError::NotFree(e) => write!(f, "{e} is not entirely free"),
            AllocError::Decode(why) => write!(f, "corrupt free map: {why}"),
            AllocError::ReloadOwned(ag) => {
                write!(f, "refusing to reload the free map of owned group {ag}")
            }
            AllocError::GroupBusy(ag) => {
                write!(f, "{ag} holds blocks of writes not yet committed")
            }
        }
    }
}

impl std::error::Error for AllocError {}

/// The free extents of one allocation group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AgFreeMap {
    ag: AgId,
    /// All blocks of the group.
    span: Extent,
    /// Free extents, start → length; non-empty, inside `span`, sorted, never touching.
    free: BTreeMap<u64, u64>,
    /// Sum of the lengths in `free`.
    free_blocks: u64,
}

impl AgFreeMap {
    /// A group with every block free (a freshly formatted device).
    pub(crate) fn all_free(ag: AgId, span: Extent) -> AgFreeMap {
        assert!(span.len > 0);
        AgFreeMap {
            ag,
            span,
            free: BTreeMap::from([(span.start.0, span.len)]),
            free_blocks: span.len,
        }
    }

    /// The group.
    pub(crate) fn ag(&self) -> AgId {
        self.ag
    }

    /// The blocks of the group.
    pub(crate) fn span(&self) -> Extent {
        self.span
    }

    /// Free blocks in the group.
    pub(crate) fn free_blocks(&self) -> u64 {
        self.free_blocks
    }

    /// Number of free extents (a measure of fragmentation, and of the encoded size).
    pub(crate) fn free_extent_count(&self) -> usize {
        self.free.len()
    }

    /// The free extents in block order.
    pub(crate) fn free_extents(&self) -> impl Iterator<Item = Extent> + '_ {
        self.free.iter().map(|(&s, &l)| Extent::new(s, l))
    }

    /// Checks every invariant; used after decode and by tests and the simulator.
    fn check(&self) -> Result<(), String> {
        let mut prev_end: Option<u64> = None;
        let mut sum = 0u64;
        for (&s, &l) in &self.free {
            if l == 0 {
                return Err(format!("empty free extent at block {s}"));
            }
            let e = s.checked_add(l).ok_or("free extent overflows")?;
            if s < self.span.start.0 || e > self.span.end() {
                return Err(format!(
                    "free extent [{s}, {e}) outside the group's {}",
                    self.span
                ));
            }
            if let Some(p) = prev_end {
                if s <= p {
                    return Err(format!(
                        "free extent at {s} touches or overlaps the previous"
                    ));
                }
            }
            prev_end = Some(e);
            sum += l;
        }
        if sum != self.free_blocks {
            return Err(format!(
                "free count {} != sum of extents {sum}",
                self.free_blocks
            ));
        }
        Ok(())
    }

    /// Full invariant check in debug builds, for maps small enough that it stays cheap (the
    /// tests call `check` directly on large ones).
    fn assert_ok(&self) {
        if cfg!(debug_assertions) && self.free.len() <= 256 {
            if let Err(e) = self.check() {
                panic!("{} free map broken: {e}", self.ag);
            }
        }
    }

    /// The free extent containing block `b`, if any.
    fn free_containing(&self, b: u64) -> Option<(u64, u64)> {
        let (&s, &l) = self.free.range(..=b).next_back()?;
        (b < s + l).then_some((s, l))
    }

    /// Removes `[s, s + len)` from the free set; it must lie inside one free extent.
    fn take(&mut self, s: u64, len: u64) {
        let (fs, fl) = self.free_containing(s).expect("take from a free extent");
        let fe = fs + fl;
        assert!(s + len <= fe, "take within one free extent");
        self.free.remove(&fs);
        if fs < s {
            self.free.insert(fs, s - fs);
        }
        if s + len < fe {
            self.free.insert(s + len, fe - (s + len));
        }
        self.free_blocks -= len;
    }

    /// Returns `ext` (inside this group) to the free set, merging with its neighbours.
    /// Refuses, changing nothing, if any of it is already free.
    pub(crate) fn free(&mut self, ext: Extent) -> Result<(), AllocError> {
        let (s, e) = (ext.start.0, ext.end());
        if ext.len == 0 || s < self.span.start.0 || e > self.span.end() {
            return Err(AllocError::OutsideGroups(ext));
        }
        // The only free extent that can overlap [s, e) is the last one starting before e.
        if let Some((&ps, &pl)) = self.free.range(..e).next_back() {
            if ps + pl > s {
                return Err(AllocError::DoubleFree {
                    extent: ext,
                    overlaps: Extent::new(ps, pl),
                });
            }
        }
        let mut start = s;
        let mut len = ext.len;
        if let Some((&ls, &ll)) = self.free.range(..s).next_back() {
            if ls + ll == s {
                self.free.remove(&ls);
                start = ls;
                len += ll;
            }
        }
        if let Some(rl) = self.free.remove(&e) {
            len += rl;
        }
        self.free.insert(start, len);
        self.free_blocks += ext.len;
        self.assert_ok();
        Ok(())
    }

    /// Returns whatever of `ext` (clamped to this group) is not free yet; the blocks freed.
    /// For replaying released records, which the map may already include.
    pub(crate) fn free_lenient(&mut self, ext: Extent) -> u64 {
        let s = ext.start.0.max(self.span.start.0);
        let e = ext.end().min(self.span.end());
        if s >= e {
            return 0;
        }
        let mut gaps = Vec::new();
        let mut at = s;
        let overlapping: Vec<(u64, u64)> = self
            .free
            .range(..e)
            .filter(|(&fs, &fl)| fs + fl > s)
            .map(|(&fs, &fl)| (fs, fs + fl))
            .collect();
        for (fs, fe) in overlapping {
            if fs > at {
                gaps.push(Extent::new(at, fs - at));
            }
            at = at.max(fe);
        }
        if at < e {
            gaps.push(Extent::new(at, e - at));
        }
        let mut n = 0;
        for g in gaps {
            if self.free(g).is_ok() {
                n += g.len;
            }
        }
        n
    }

    /// Marks `ext` used (rebuilding a map from the extents that exist, or replaying).
    /// Refuses, changing nothing, unless all of it is free.
    pub(crate) fn mark_used(&mut self, ext: Extent) -> Result<(), AllocError> {
        match self.free_containing(ext.start.0) {
            Some((fs, fl)) if ext.len > 0 && ext.end() <= fs + fl => {
                self.take(ext.start.0, ext.len);
                self.assert_ok();
                Ok(())
            }
            _ => Err(AllocError::NotFree(ext)),
        }
    }

    /// A free extent of exactly `len` blocks near `goal`: from `goal` itself if the free
    /// extent holding it is long enough, else the first long-enough extent after `goal`,
    /// else the first one in the group.
    fn find_fit(&self, len: u64, goal: Option<u64>) -> Option<u64> {
        let goal = goal.unwrap_or(self.span.start.0);
        if let Some((fs, fl)) = self.free_containing(goal) {
            if fs + fl - goal >= len {
                return Some(goal);
            }
        }
        let after = self.free.range(goal..).find(|(_, &l)| l >= len);
        let any = || self.free.range(..goal).find(|(_, &l)| l >= len);
        after.or_else(any).map(|(&s, _)| s)
    }
}

/// The allocator of one node: the loaded free maps and the groups it may allocate in.
///
/// Blocks live in one of three states here: free, *reserved* (handed out by
/// [`Allocator::alloc`] for a write whose extents have not committed: write-behind keeps
/// them for up to a second), and used (committed, or about to be). The loaded maps count
/// reserved blocks as used, so they are never handed out twice; what etcd is told
/// ([`Allocator::encode_published`]) counts them as free, so a crash before their commit
/// leaks nothing: a block is published as used only in the commit of the extent that
/// points at it ([`Allocator::publish`]).
#[derive(Debug, Clone)]
pub(crate) struct Allocator {
    geometry: Geometry,
    groups: BTreeMap<AgId, AgFreeMap>,
    owned: BTreeSet<AgId>,
    /// Reserved extents (see above), start → length, coalesced; always inside owned groups
    /// and never free in their maps.
    reserved: BTreeMap<u64, u64>,
    /// A logical clock: one tick per allocation and per group taken on.
    tick: u64,
    /// The tick at which each group was last allocated from or taken on (the caller
    /// turns changes of it into idle times: see [`Allocator::last_use`]).
    used_at: BTreeMap<AgId, u64>,
}

impl Allocator {
    /// An allocator with no free map loaded and no group owned.
    pub(crate) fn new(geometry: Geometry) -> Allocator {
        Allocator {
            geometry,
            groups: BTreeMap::new(),
            owned: BTreeSet::new(),
            reserved: BTreeMap::new(),
            tick: 0,
            used_at: BTreeMap::new(),
        }
    }

    /// An allocator for a freshly formatted device: every group loaded and all free, none
    /// owned.
    pub(crate) fn fresh(geometry: Geometry) -> Allocator {
        let mut a = Allocator::new(geometry);
        for i in 0..geometry.ag_count {
            let ag = AgId(i);
            let span = geometry.ag_extent(ag).expect("ag < ag_count");
            a.groups.insert(ag, AgFreeMap::all_free(ag, span));
        }
        a
    }

    /// The layout this allocator works on.
    pub(crate) fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Loads (or replaces) a group's free map, e.g. one just decoded from etcd. Refused for
    /// an owned group: the loaded map is the only record of the blocks handed out from it
    /// since its last commit, and etcd's copy lags it by up to a write-behind interval (two
    /// writers that both claimed the group at once used to reload it, and were given the
    /// same blocks).
    pub(crate) fn load_group(&mut self, map: AgFreeMap) -> Result<(), AllocError> {
        if self.geometry.ag_extent(map.ag) != Some(map.span) {
            return Err(AllocError::BadOwnership(map.ag));
        }
        if self.owned.contains(&map.ag) {
            return Err(AllocError::ReloadOwned(map.ag));
        }
        self.groups.insert(map.ag, map);
        Ok(())
    }

    /// Takes a group on: it must be loaded. Owning it twice changes nothing.
    pub(crate) fn own(&mut self, ag: AgId) -> Result<(), AllocError> {
        if !self.groups.contains_key(&ag) {
            return Err(AllocError::BadOwnership(ag));
        }
        if self.owned.insert(ag) {
            self.tick += 1;
            self.used_at.insert(ag, self.tick);
        }
        Ok(())
    }

    /// A stamp that changes whenever `ag` is allocated from or taken on: a group whose
    /// stamp stays the same for a while is idle.
    pub(crate) fn last_use(&self, ag: AgId) -> u64 {
        self.used_at.get(&ag).copied().unwrap_or(0)
    }

    /// Of the owned groups, those to give back to other nodes: idle (in `idle`, which the
    /// caller decides by time), nothing reserved in them (their commit must carry the map
    /// under our ownership), and some free space (a full group is of no use to anyone).
    /// The node keeps at least one group, and groups with at least `keep_free` free blocks
    /// in all when it has them (the idle ones with the most free space first), so that its
    /// next write needs no claim.
    pub(crate) fn surplus_groups(&self, idle: &BTreeSet<AgId>, keep_free: u64) -> Vec<AgId> {
        let mut spare: Vec<(u64, AgId)> = self
            .owned
            .iter()
            .filter(|g| idle.contains(g) && self.reserved_in(**g) == 0)
            .map(|g| (self.groups[g].free_blocks, *g))
            .filter(|(free, _)| *free > 0)
            .collect();
        let mut kept = self.owned.len() - spare.len();
        let mut kept_free: u64 = self
            .owned
            .iter()
            .filter(|g| !spare.iter().any(|(_, s)| s == *g))
            .map(|g| self.groups[g].free_blocks)
            .sum();
        // Most free space first: those are kept, the rest given back.
        spare.sort_unstable_by(|x, y| y.cmp(x));
        let mut spare = spare.into_iter().peekable();
        while kept == 0 || kept_free < keep_free {
            let Some((free, _)) = spare.next() else { break };
            kept += 1;
            kept_free += free;
        }
        spare.map(|(_, g)| g).collect()
    }

    /// Gives a group up (to hand it to another node): refused while any of its blocks are
    /// reserved, since their commit must carry the group's map under this node's ownership.
    /// The map stays loaded, for frees that still land in it.
    pub(crate) fn disown(&mut self, ag: AgId) -> Result<(), AllocError> {
        let span = self
            .geometry
            .ag_extent(ag)
            .ok_or(AllocError::BadOwnership(ag))?;
        if overlaps(&self.reserved, span) {
            return Err(AllocError::GroupBusy(ag));
        }
        self.owned.remove(&ag);
        Ok(())
    }

    /// Blocks reserved (handed out, not yet committed) in `ag`.
    pub(crate) fn reserved_in(&self, ag: AgId) -> u64 {
        let Some(span) = self.geometry.ag_extent(ag) else {
            return 0;
        };
        within(&self.reserved, span).map(|e| e.len).sum()
    }

    /// The extents about to commit become used in what etcd is told: call under the same
    /// lock as the [`Allocator::encode_published`] whose maps go with their commit. Parts
    /// not reserved (published before) are left as they are.
    pub(crate) fn publish(&mut self, exts: &[Extent]) {
        for e in exts {
            remove_range(&mut self.reserved, *e);
        }
    }

    /// A group's map as etcd must store it: reserved blocks count as free there.
    pub(crate) fn encode_published(&self, ag: AgId) -> Option<Vec<u8>> {
        let map = self.groups.get(&ag)?;
        let span = map.span;
        if within(&self.reserved, span).next().is_none() {
            // The common case at a commit: nothing else pending in the group, no copy.
            return Some(map.encode());
        }
        let mut published = map.clone();
        for e in within(&self.reserved, span) {
            // Reserved blocks are used in the loaded map (checked when reserved).
            published
                .free(e)
                .expect("reserved blocks are never free in the loaded map");
        }
        Some(published.encode())
    }

    /// Sets the groups this node may allocate in; each must exist and be loaded.
    #[cfg(test)]
    pub(crate) fn set_owned(&mut self, owned: BTreeSet<AgId>) -> Result<(), AllocError> {
        if let Some(&bad) = owned.iter().find(|ag| !self.groups.contains_key(ag)) {
            return Err(AllocError::BadOwnership(bad));
        }
        self.owned = owned;
        Ok(())
    }

    /// The groups this node may allocate in.
    pub(crate) fn owned(&self) -> &BTreeSet<AgId> {
        &self.owned
    }

    /// A loaded group's free map (to encode for etcd after a change).
    pub(crate) fn group(&self, ag: AgId) -> Option<&AgFreeMap> {
        self.groups.get(&ag)
    }

    /// Free blocks in the owned groups (what `alloc` can hand out).
    pub(crate) fn free_blocks_owned(&self) -> u64 {
        self.owned
            .iter()
            .map(|ag| self.groups[ag].free_blocks)
            .sum()
    }

    /// Free blocks in every loaded group (statfs when all groups are loaded).
    pub(crate) fn free_blocks_loaded(&self) -> u64 {
        self.groups.values().map(|g| g.free_blocks).sum()
    }

    /// The groups `extents` lie in (whose free maps an operation changed).
    pub(crate) fn groups_of(&self, extents: &[Extent]) -> BTreeSet<AgId> {
        extents
            .iter()
            .flat_map(|e| self.split_by_group(*e).unwrap_or_default())
            .map(|(ag, _)| ag)
            .collect()
    }

    /// Allocates `len` blocks in the owned groups, preferring one contiguous extent at or
    /// after `goal` (typically the block after the file's previous extent), then one in any
    /// owned group, and only then several pieces, largest first. The result covers exactly
    /// `len` blocks. Fails, changing nothing, with `NoSpace` when the owned groups hold fewer.
    pub(crate) fn alloc(
        &mut self,
        len: u64,
        goal: Option<super::BlockNo>,
    ) -> Result<Vec<Extent>, AllocError> {
        assert!(len > 0, "allocate at least one block");
        let free = self.free_blocks_owned();
        if free < len {
            return Err(AllocError::NoSpace { wanted: len, free });
        }
        let goal_ag = goal
            .and_then(|g| self.geometry.ag_of(g))
            .filter(|ag| self.owned.contains(ag));
        // Owned groups in search order: the goal's group first, then the ones after it,
        // wrapping around.
        let order: Vec<AgId> = match goal_ag {
            Some(g) => self
                .owned
                .range(g..)
                .chain(self.owned.range(..g))
                .copied()
                .collect(),
            None => self.owned.iter().copied().collect(),
        };
        for (i, ag) in order.iter().enumerate() {
            let map = self.groups.get_mut(ag).expect("owned groups are loaded");
            let g = if i == 0 && goal_ag.is_some() {
                goal.map(|b| b.0)
            } else {
                None
            };
            if let Some(start) = map.find_fit(len, g) {
                map.take(start, len);
                map.assert_ok();
                let out = vec![Extent::new(start, len)];
                self.reserve(&out);
                self.tick += 1;
                self.used_at.insert(*ag, self.tick);
                return Ok(out);
            }
        }
        // Fragmented: take the largest free extents until `len` is covered.
        let mut pieces: Vec<(u64, AgId, u64)> = order
            .iter()
            .flat_map(|ag| self.groups[ag].free.iter().map(move |(&s, &l)| (l, *ag, s)))
            .collect();
        pieces.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.2.cmp(&b.2)));
        let mut out = Vec::new();
        let mut left = len;
        self.tick += 1;
        for (l, ag, s) in pieces {
            let take = l.min(left);
            let map = self.groups.get_mut(&ag).expect("owned groups are loaded");
            map.take(s, take);
            self.used_at.insert(ag, self.tick);
            out.push(Extent::new(s, take));
            left -= take;
            if left == 0 {
                break;
            }
        }
        assert_eq!(left, 0, "free_blocks_owned said there was room");
        out.sort_unstable();
        for ag in &order {
            self.groups[ag].assert_ok();
        }
        self.reserve(&out);
        Ok(out)
    }

    /// Records blocks just handed out. The check is the last line of defence against two
    /// files sharing blocks, so it runs in every build: a block handed out while it is
    /// still reserved for another write means a map was replaced or corrupted under us,
    /// and a panic (the request fails with EIO) is better than silent corruption.
    fn reserve(&mut self, exts: &[Extent]) {
        for e in exts {
            assert!(
                !overlaps(&self.reserved, *e),
                "allocator handed out {e} while part of it is reserved for another write"
            );
            insert_range(&mut self.reserved, *e);
        }
    }

    /// Splits an extent at group boundaries, or fails if any part is outside every group.
    pub(crate) fn split_by_group(&self, ext: Extent) -> Result<Vec<(AgId, Extent)>, AllocError> {
        let mut out = Vec::new();
        let mut s = ext.start.0;
        let e = ext
            .start
            .0
            .checked_add(ext.len)
            .ok_or(AllocError::OutsideGroups(ext))?;
        if ext.len == 0 {
            return Err(AllocError::OutsideGroups(ext));
        }
        while s < e {
            let ag = self
                .geometry
                .ag_of(super::BlockNo(s))
                .ok_or(AllocError::OutsideGroups(ext))?;
            let span = self
                .geometry
                .ag_extent(ag)
                .expect("ag_of gives a real group");
            let piece_end = e.min(span.end());
            out.push((ag, Extent::new(s, piece_end - s)));
            s = piece_end;
        }
        Ok(out)
    }

    /// Returns `ext` to the free maps (it may span groups; each must be loaded). Checks the
    /// whole extent first, so a double free changes nothing. Returns the groups changed.
    pub(crate) fn free(&mut self, ext: Extent) -> Result<BTreeSet<AgId>, AllocError> {
        let parts = self.split_by_group(ext)?;
        for (ag, part) in &parts {
            let map = self.groups.get(ag).ok_or(AllocError::NotLoaded(*ag))?;
            if let Some((&ps, &pl)) = map.free.range(..part.end()).next_back() {
                if ps + pl > part.start.0 {
                    return Err(AllocError::DoubleFree {
                        extent: ext,
                        overlaps: Extent::new(ps, pl),
                    });
                }
            }
        }
        for (ag, part) in &parts {
            let map = self.groups.get_mut(ag).expect("checked above");
            map.free(*part).expect("checked above: no overlap");
        }
        // A write that failed before its commit gives its reserved blocks back.
        remove_range(&mut self.reserved, ext);
        Ok(parts.into_iter().map(|(ag, _)| ag).collect())
    }
}

/// The parts of a coalesced start → length set inside `span` (an extent of the set may
/// run on across a group boundary).
fn within(set: &BTreeMap<u64, u64>, span: Extent) -> impl Iterator<Item = Extent> + '_ {
    let first = set
        .range(..span.start.0)
        .next_back()
        .map_or(span.start.0, |(&s, _)| s);
    set.range(first..span.end()).filter_map(move |(&s, &l)| {
        let (a, b) = (s.max(span.start.0), (s + l).min(span.end()));
        (a < b).then(|| Extent::new(a, b - a))
    })
}

/// Whether any extent of a coalesced start → length set overlaps `e`.
fn overlaps(set: &BTreeMap<u64, u64>, e: Extent) -> bool {
    set.range(..e.end())
        .next_back()
        .is_some_and(|(&s, &l)| s + l > e.start.0)
}

/// Adds `e` (disjoint from the set) to a coalesced start → length set.
fn insert_range(set: &mut BTreeMap<u64, u64>, e: Extent) {
    let (mut start, mut len) = (e.start.0, e.len);
    if let Some((&ps, &pl)) = set.range(..start).next_back() {
        if ps + pl == start {
            set.remove(&ps);
            start = ps;
            len += pl;
        }
    }
    if let Some(nl) = set.remove(&e.end()) {
        len += nl;
    }
    set.insert(start, len);
}

/// Removes whatever of `e` a coalesced start → length set holds.
fn remove_range(set: &mut BTreeMap<u64, u64>, e: Extent) {
    let (s, end) = (e.start.0, e.end());
    let hit: Vec<(u64, u64)> = set
        .range(..end)
        .rev()
        .take_while(|(&fs, &fl)| fs + fl > s)
        .map(|(&fs, &fl)| (fs, fl))
        .collect();
    for (fs, fl) in hit {
        set.remove(&fs);
        if fs < s {
            set.insert(fs, s - fs);
        }
        if fs + fl > end {
            set.insert(end, fs + fl - end);
        }
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(b: &[u8], pos: &mut usize) -> Result<u64, AllocError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b
            .get(*pos)
            .ok_or_else(|| AllocError::Decode("truncated varint".into()))?;
        *pos += 1;
        let bits = u64::from(byte & 0x7f);
        if shift == 63 && bits > 1 {
            return Err(AllocError::Decode("varint overflows u64".into()));
        }
        v |= bits << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(AllocError::Decode("varint longer than 10 bytes".into()))
}

impl AgFreeMap {
    /// Largest encoded size of a group of `ag_blocks` blocks: every other block free, each
    /// free extent a 1-byte gap and a 1-byte length, plus header, count and CRC. With the
    /// default 65536-block groups that is 64 KiB, well under etcd's 1.5 MiB value limit.
    pub(crate) fn encoded_len_max(ag_blocks: u64) -> u64 {
        let extents = ag_blocks.div_ceil(2);
        FREE_MAP_HEADER_BYTES as u64 + 10 + extents * 2 + 4
    }

    /// The compact, versioned encoding stored in etcd: header (version, AG, span), the
    /// count, then per free extent the gap from the previous extent's end (from the span
    /// start for the first) and the length, as LEB128 varints, then a CRC32C of all of it.
    pub(crate) fn encode(&self) -> Vec<u8> {
        self.assert_ok();
        let mut b = Vec::with_capacity(FREE_MAP_HEADER_BYTES + 14 + self.free.len() * 4);
        b.push(FREE_MAP_VERSION);
        b.extend_from_slice(&self.ag.0.to_le_bytes());
        b.extend_from_slice(&self.span.start.0.to_le_bytes());
        b.extend_from_slice(&self.span.len.to_le_bytes());
        put_varint(&mut b, self.free.len() as u64);
        let mut prev = self.span.start.0;
        for (&s, &l) in &self.free {
            put_varint(&mut b, s - prev);
            put_varint(&mut b, l);
            prev = s + l;
        }
        let crc = crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        // Pair assertion: the encoding decodes to the same map.
        debug_assert_eq!(AgFreeMap::decode(&b, self.ag, self.span).as_ref(), Ok(self));
        b
    }

    /// Decodes a map encoded by [`AgFreeMap::encode`] for group `ag` spanning `span` (both
    /// from the geometry, so a map stored under the wrong key is caught). Never panics.
    pub(crate) fn decode(b: &[u8], ag: AgId, span: Extent) -> Result<AgFreeMap, AllocError> {
        let bad = |why: String| Err(AllocError::Decode(format!("{ag}: {why}")));
        if b.len() < FREE_MAP_HEADER_BYTES + 1 + 4 {
            return bad(format!("{} bytes is too short", b.len()));
        }
        let (body, crc_bytes) = b.split_at(b.len() - 4);
        let stored = u32::from_le_bytes(crc_bytes.try_into().expect("4 bytes"));
        if crc32c(body) != stored {
            return bad("checksum mismatch".into());
        }
        if body[0] != FREE_MAP_VERSION {
            return bad(format!("unknown version {}", body[0]));
        }
        let got_ag = u32::from_le_bytes(body[1..5].try_into().expect("4 bytes"));
        let got_start = u64::from_le_bytes(body[5..13].try_into().expect("8 bytes"));
        let got_len = u64::from_le_bytes(body[13..21].try_into().expect("8 bytes"));
        if got_ag != ag.0 || got_start != span.start.0 || got_len != span.len {
            return bad(format!(
                "stored for AG {got_ag} blocks [{got_start}, +{got_len}), expected {span}"
            ));
        }
        let mut pos = FREE_MAP_HEADER_BYTES;
        let count = get_varint(body, &mut pos)?;
        // Each extent needs at least two bytes: refuse counts the input cannot hold before
        // looping on them.
        if count > (body.len() - pos) as u64 / 2 {
            return bad(format!(
                "count {count} exceeds what {} bytes can hold",
                body.len()
            ));
        }
        let mut map = AgFreeMap {
            ag,
            span,
            free: BTreeMap::new(),
            free_blocks: 0,
        };
        let mut prev = span.start.0;
        for i in 0..count {
            let gap = get_varint(body, &mut pos)?;
            let len = get_varint(body, &mut pos)?;
            if i > 0 && gap == 0 {
                return bad(format!(
                    "extent {i} touches the previous one (not coalesced)"
                ));
            }
            let s = prev.checked_add(gap).filter(|&s| s < span.end());
            let e = s
                .and_then(|s| s.checked_add(len))
                .filter(|&e| e <= span.end());
            let (Some(s), Some(e)) = (s, e) else {
                return bad(format!("extent {i} reaches outside the group"));
            };
            if len == 0 {
                return bad(format!("extent {i} is empty"));
            }
            map.free.insert(s, len);
            map.free_blocks += len;
            prev = e;
        }
        if pos != body.len() {
            return bad(format!("{} trailing bytes", body.len() - pos));
        }
        // Pair assertion, the decode side: the invariants the encoder relies on hold.
        if let Err(why) = map.check() {
            return bad(why);
        }
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::BlockNo;
    use rand::{rngs::SmallRng, Rng, SeedableRng};

    /// 4 groups of 64 blocks (the minimum), the last one partial.
    fn geo() -> Geometry {
        let blocks = crate::data::superblock::HEAD_BLOCKS + 3 * 64 + 40 + 64 + 1;
        let g = Geometry::new(blocks * crate::data::BLOCK_SIZE, 64).unwrap();
        assert_eq!(g.ag_count, 5);
        g
    }

    fn owning(ags: &[u32]) -> Allocator {
        let mut a = Allocator::fresh(geo());
        a.set_owned(ags.iter().map(|&i| AgId(i)).collect()).unwrap();
        a
    }

    /// Idle give-back: only idle groups with free space and nothing reserved go, and the
    /// node keeps one group and `keep_free` blocks (the idle groups with most space first).
    #[test]
    fn surplus_groups_keep_one_and_never_a_reserved_one() {
        let mut a = owning(&[0, 1, 2, 3]);
        let all: BTreeSet<AgId> = [0, 1, 2, 3].into_iter().map(AgId).collect();
        let free = |a: &Allocator, g: u32| a.group(AgId(g)).unwrap().free_blocks();
        // All idle and empty: one kept (64 blocks is enough), three go.
        let give = a.surplus_groups(&all, 64);
        assert_eq!(give.len(), 3, "{give:?}");
        let kept = all.iter().find(|g| !give.contains(g)).unwrap();
        assert_eq!(free(&a, kept.0), 64, "the kept one has the most free space");
        // Nothing to keep by space: still one group kept.
        assert_eq!(a.surplus_groups(&all, 0).len(), 3);
        // More space wanted than one group holds: two kept.
        assert_eq!(a.surplus_groups(&all, 100).len(), 2);
        // Not idle: never given back.
        let some: BTreeSet<AgId> = [AgId(1), AgId(2)].into();
        let mut give = a.surplus_groups(&some, 0);
        give.sort_unstable();
        assert_eq!(give, vec![AgId(1), AgId(2)], "0 and 3 are busy and kept");
        // A reserved block (a write not yet committed) keeps its group.
        let before = a.last_use(AgId(2));
        let got = a.alloc(3, Some(BlockNo(geo().ag_extent(AgId(2)).unwrap().start.0)));
        let got = got.unwrap();
        assert!(
            a.last_use(AgId(2)) > before,
            "an allocation stamps its group"
        );
        assert!(!a.surplus_groups(&all, 0).contains(&AgId(2)));
        // Committed: it may go again; a full group never does.
        a.publish(&got);
        assert!(a.surplus_groups(&all, 0).contains(&AgId(2)));
        let span0 = geo().ag_extent(AgId(0)).unwrap();
        a.alloc(span0.len, Some(span0.start)).unwrap();
        a.publish(&[span0]);
        assert_eq!(free(&a, 0), 0);
        assert!(!a.surplus_groups(&all, 0).contains(&AgId(0)));
    }

    #[test]
    fn alloc_prefers_goal_and_coalesces_on_free() {
        let mut a = owning(&[0, 1]);
        let ag0 = geo().ag_extent(AgId(0)).unwrap();
        let s = ag0.start.0;
        assert_eq!(a.alloc(10, None).unwrap(), vec![Extent::new(s, 10)]);
        // Goal right after the previous extent: contiguous.
        assert_eq!(
            a.alloc(5, Some(BlockNo(s + 10))).unwrap(),
            vec![Extent::new(s + 10, 5)]
        );
        // Goal inside used space: the next fit after it.
        assert_eq!(
            a.alloc(3, Some(BlockNo(s + 2))).unwrap(),
            vec![Extent::new(s + 15, 3)]
        );
        assert_eq!(a.free_blocks_owned(), 128 - 18);
        a.free(Extent::new(s + 10, 5)).unwrap();
        a.free(Extent::new(s, 10)).unwrap();
        let g = a.group(AgId(0)).unwrap();
        assert_eq!(g.free_extents().next(), Some(Extent::new(s, 15)));
        a.free(Extent::new(s + 15, 3)).unwrap();
        assert_eq!(a.group(AgId(0)).unwrap().free_extent_count(), 1);
        assert_eq!(a.free_blocks_owned(), 128);
    }

    #[test]
    fn alloc_moves_to_other_owned_groups_then_fragments() {
        let mut a = owning(&[1, 3]);
        let g = geo();
        let ag1 = g.ag_extent(AgId(1)).unwrap();
        let ag3 = g.ag_extent(AgId(3)).unwrap();
        // Never in group 0 or 2, even with a goal there.
        let e = a
            .alloc(60, Some(g.ag_extent(AgId(0)).unwrap().start))
            .unwrap();
        assert_eq!(e, vec![Extent::new(ag1.start.0, 60)]);
        let e = a.alloc(10, Some(BlockNo(ag1.start.0 + 60))).unwrap();
        assert_eq!(
            e,
            vec![Extent::new(ag3.start.0, 10)],
            "group 1 has only 4 left"
        );
        // 4 left in group 1, 54 in group 3: 58 needs both pieces.
        let e = a.alloc(58, None).unwrap();
        assert_eq!(
            e,
            vec![
                Extent::new(ag1.start.0 + 60, 4),
                Extent::new(ag3.start.0 + 10, 54)
            ]
        );
        assert_eq!(a.free_blocks_owned(), 0);
        let err = a.alloc(1, None).unwrap_err();
        assert_eq!(err, AllocError::NoSpace { wanted: 1, free: 0 });
        assert_eq!(err.errno(), libc::ENOSPC);
        assert_eq!(a.groups_of(&e), BTreeSet::from([AgId(1), AgId(3)]));
    }

    #[test]
    fn nospace_changes_nothing_and_partial_last_group_counts() {
        let mut a = owning(&[4]);
        assert_eq!(a.free_blocks_owned(), 40);
        let before = a.group(AgId(4)).unwrap().clone();
        assert!(matches!(
            a.alloc(41, None),
            Err(AllocError::NoSpace {
                wanted: 41,
                free: 40
            })
        ));
        assert_eq!(a.group(AgId(4)).unwrap(), &before);
        assert_eq!(a.alloc(40, None).unwrap().len(), 1);
    }

    #[test]
    fn double_free_and_bad_ranges_are_refused_whole() {
        let mut a = owning(&[0, 1]);
        let g = geo();
        let s0 = g.ag_extent(AgId(0)).unwrap().start.0;
        let ext = a.alloc(128, None).unwrap();
        assert_eq!(ext.len(), 2);
        a.free(Extent::new(s0 + 10, 5)).unwrap();
        let before = a.clone();
        let e = a.free(Extent::new(s0 + 12, 2)).unwrap_err();
        assert!(matches!(e, AllocError::DoubleFree { .. }), "{e}");
        // Overlapping only at the end of a larger range.
        assert!(matches!(
            a.free(Extent::new(s0, 11)),
            Err(AllocError::DoubleFree { .. })
        ));
        // A range spanning groups 0 and 1 with a double-freed part in group 1.
        a.free(Extent::new(s0 + 64 + 1, 1)).unwrap();
        let snapshot = a.clone();
        assert!(matches!(
            a.free(Extent::new(s0 + 60, 8)),
            Err(AllocError::DoubleFree { .. })
        ));
        assert_eq!(a.group(AgId(0)), snapshot.group(AgId(0)), "nothing changed");
        assert!(before.group(AgId(0)).is_some());
        // Spanning groups, all used: split and freed in both.
        let changed = a.free(Extent::new(s0 + 60, 5)).unwrap();
        assert_eq!(changed, BTreeSet::from([AgId(0), AgId(1)]));
        assert!(matches!(
            a.free(Extent::new(0, 1)),
            Err(AllocError::OutsideGroups(_))
        ));
        assert!(matches!(
            a.free(Extent::new(u64::MAX, 2)),
            Err(AllocError::OutsideGroups(_))
        ));
        assert!(matches!(
            a.free(Extent::new(s0, 0)),
            Err(AllocError::OutsideGroups(_))
        ));
    }

    #[test]
    fn ownership_needs_loaded_groups() {
        let mut a = Allocator::new(geo());
        assert_eq!(
            a.set_owned([AgId(0)].into()),
            Err(AllocError::BadOwnership(AgId(0)))
        );
        let span = geo().ag_extent(AgId(0)).unwrap();
        a.load_group(AgFreeMap::all_free(AgId(0), span)).unwrap();
        a.set_owned([AgId(0)].into()).unwrap();
        assert!(a.load_group(AgFreeMap::all_free(AgId(1), span)).is_err());
        assert_eq!(
            a.free(Extent::new(span.end(), 1)),
            Err(AllocError::NotLoaded(AgId(1)))
        );
    }

    #[test]
    fn mark_used_only_free_blocks() {
        let span = Extent::new(100, 50);
        let mut m = AgFreeMap::all_free(AgId(0), span);
        m.mark_used(Extent::new(110, 5)).unwrap();
        assert_eq!(
            m.mark_used(Extent::new(112, 5)),
            Err(AllocError::NotFree(Extent::new(112, 5)))
        );
        assert!(m.mark_used(Extent::new(145, 10)).is_err());
        assert_eq!(m.free_blocks(), 45);
        assert_eq!(m.free_extent_count(), 2);
    }

    #[test]
    fn encoding_round_trip_and_size() {
        let span = Extent::new(1000, 65536);
        let mut m = AgFreeMap::all_free(AgId(3), span);
        let enc = m.encode();
        assert_eq!(enc.len(), FREE_MAP_HEADER_BYTES + 1 + 1 + 3 + 4);
        // Worst case: every other block used.
        for b in (span.start.0..span.end()).step_by(2) {
            m.mark_used(Extent::new(b, 1)).unwrap();
        }
        let enc = m.encode();
        assert!(
            enc.len() as u64 <= AgFreeMap::encoded_len_max(span.len),
            "{}",
            enc.len()
        );
        assert_eq!(AgFreeMap::decode(&enc, AgId(3), span), Ok(m.clone()));
        // Stored under the wrong group.
        assert!(AgFreeMap::decode(&enc, AgId(4), span).is_err());
        assert!(AgFreeMap::decode(&enc, AgId(3), Extent::new(1000, 65535)).is_err());
    }

    #[test]
    fn decode_rejects_malformed_and_never_panics() {
        let span = Extent::new(1000, 64);
        let mut m = AgFreeMap::all_free(AgId(1), span);
        m.mark_used(Extent::new(1010, 4)).unwrap();
        let good = m.encode();
        let reseal = |mut b: Vec<u8>| {
            let n = b.len() - 4;
            let crc = crc32c(&b[..n]);
            b[n..].copy_from_slice(&crc.to_le_bytes());
            b
        };
        let body_len = good.len() - 4;
        // Not coalesced: gap 0 on the second extent.
        let mut b = good[..body_len].to_vec();
        b.truncate(FREE_MAP_HEADER_BYTES);
        put_varint(&mut b, 2);
        for v in [0, 10, 0, 5] {
            put_varint(&mut b, v);
        }
        b.extend_from_slice(&[0; 4]);
        let e = AgFreeMap::decode(&reseal(b), AgId(1), span).unwrap_err();
        assert!(e.to_string().contains("not coalesced"), "{e}");
        // Beyond the group.
        let mut b = good[..FREE_MAP_HEADER_BYTES].to_vec();
        put_varint(&mut b, 1);
        put_varint(&mut b, 60);
        put_varint(&mut b, 5);
        b.extend_from_slice(&[0; 4]);
        assert!(AgFreeMap::decode(&reseal(b), AgId(1), span).is_err());
        // Bit flips are caught by the CRC; resealed noise by the checks.
        let mut rng = SmallRng::seed_from_u64(11);
        for _ in 0..20_000 {
            let mut b = good.clone();
            let i = rng.gen_range(0..b.len());
            b[i] = rng.gen();
            if rng.gen_bool(0.7) {
                b = reseal(b);
            }
            if let Ok(d) = AgFreeMap::decode(&b, AgId(1), span) {
                assert!(d.check().is_ok());
            }
            let n = rng.gen_range(0..b.len());
            let _ = AgFreeMap::decode(&b[..n], AgId(1), span);
        }
        assert!(AgFreeMap::decode(&[], AgId(1), span).is_err());
    }

    #[test]
    fn varint_edges() {
        for v in [0, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX] {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            let mut pos = 0;
            assert_eq!(get_varint(&b, &mut pos), Ok(v));
            assert_eq!(pos, b.len());
        }
        let mut pos = 0;
        assert!(get_varint(&[0xff; 11], &mut pos).is_err());
        let mut pos = 0;
        assert!(get_varint(
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02],
            &mut pos
        )
        .is_err());
    }

    /// One seeded run of random alloc/free against a reference bitmap.
    fn sim_one(seed: u64, steps: usize) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let ag_blocks = rng.gen_range(64..300u64);
        let ags = rng.gen_range(1..6u64);
        let tail = rng.gen_range(0..ag_blocks);
        let blocks = crate::data::superblock::HEAD_BLOCKS + ags * ag_blocks + tail + 1;
        let g = Geometry::new(blocks * crate::data::BLOCK_SIZE, ag_blocks).unwrap();
        let mut a = Allocator::fresh(g);
        let owned: BTreeSet<AgId> = (0..g.ag_count)
            .filter(|_| rng.gen_bool(0.6))
            .map(AgId)
            .collect();
        a.set_owned(owned.clone()).unwrap();
        // true = used; reserved: handed out and not yet published.
        let mut used = vec![false; g.total_blocks as usize];
        let mut reserved = vec![false; g.total_blocks as usize];
        let owned_free = |used: &Vec<bool>| -> u64 {
            owned
                .iter()
                .map(|ag| {
                    let e = g.ag_extent(*ag).unwrap();
                    (e.start.0..e.end()).filter(|&b| !used[b as usize]).count() as u64
                })
                .sum()
        };
        let mut live: Vec<Extent> = Vec::new();
        for step in 0..steps {
            let ctx = || format!("seed {seed} step {step}");
            match rng.gen_range(0..10) {
                0..=4 => {
                    let len = rng.gen_range(1..=ag_blocks / 2 + 1);
                    let goal = rng
                        .gen_bool(0.7)
                        .then(|| BlockNo(rng.gen_range(0..g.total_blocks)));
                    let want_free = owned_free(&used);
                    match a.alloc(len, goal) {
                        Ok(exts) => {
                            assert_eq!(exts.iter().map(|e| e.len).sum::<u64>(), len, "{}", ctx());
                            for e in &exts {
                                let ag = g.ag_of(e.start).expect("inside a group");
                                assert!(owned.contains(&ag), "{}: allocated in {ag}", ctx());
                                assert_eq!(g.ag_of(BlockNo(e.end() - 1)), Some(ag), "{}", ctx());
                                for b in e.start.0..e.end() {
                                    assert!(!used[b as usize], "{}: block {b} given twice", ctx());
                                    used[b as usize] = true;
                                }
                                live.push(*e);
                            }
                            // Half the writes commit at once, the rest stay reserved (write-behind)
                            // until freed or published by a later step.
                            if rng.gen_bool(0.5) {
                                a.publish(&exts);
                            } else {
                                for e in &exts {
                                    for b in e.start.0..e.end() {
                                        reserved[b as usize] = true;
                                    }
                                }
                            }
                        }
                        Err(AllocError::NoSpace { wanted, free }) => {
                            assert_eq!((wanted, free), (len, want_free), "{}", ctx());
                            assert!(want_free < len, "{}", ctx());
                        }
                        Err(e) => panic!("{}: {e}", ctx()),
                    }
                }
                5..=8 if !live.is_empty() => {
                    let i = rng.gen_range(0..live.len());
                    let e = live.swap_remove(i);
                    // Free a random piece; keep the rest live.
                    let off = rng.gen_range(0..e.len);
                    let len = rng.gen_range(1..=e.len - off);
                    let piece = Extent::new(e.start.0 + off, len);
                    a.free(piece)
                        .unwrap_or_else(|err| panic!("{}: {err}", ctx()));
                    for b in piece.start.0..piece.end() {
                        used[b as usize] = false;
                        reserved[b as usize] = false;
                    }
                    if off > 0 {
                        live.push(Extent::new(e.start.0, off));
                    }
                    if off + len < e.len {
                        live.push(Extent::new(piece.end(), e.len - off - len));
                    }
                    // Freeing it again must fail and change nothing.
                    if rng.gen_bool(0.2) {
                        let before = a.clone();
                        let e2 = a.free(piece).unwrap_err();
                        assert!(matches!(e2, AllocError::DoubleFree { .. }), "{}", ctx());
                        for ag in before.owned() {
                            assert_eq!(a.group(*ag), before.group(*ag), "{}", ctx());
                        }
                    }
                }
                9 if !live.is_empty() && rng.gen_bool(0.5) => {
                    // A write-behind commit: everything reserved is published.
                    a.publish(&live);
                    reserved.iter_mut().for_each(|r| *r = false);
                }
                _ => {
                    // Round-trip every group through its encoding, as a reload from etcd;
                    // what etcd gets has the reserved blocks free, and an owned group is
                    // never replaced.
                    for i in 0..g.ag_count {
                        let m = a.group(AgId(i)).unwrap().clone();
                        let published = a.encode_published(AgId(i)).unwrap();
                        let d = AgFreeMap::decode(&published, m.ag(), m.span()).unwrap();
                        let span = m.span();
                        let expect_free = (span.start.0..span.end())
                            .filter(|&b| !used[b as usize] || reserved[b as usize])
                            .count() as u64;
                        assert_eq!(d.free_blocks(), expect_free, "{}", ctx());
                        if owned.contains(&AgId(i)) {
                            assert_eq!(
                                a.load_group(d),
                                Err(AllocError::ReloadOwned(AgId(i))),
                                "{}",
                                ctx()
                            );
                        } else {
                            assert_eq!(d, m, "{}", ctx());
                            a.load_group(d).unwrap();
                        }
                    }
                }
            }
            // The maps equal the bitmap exactly.
            if step % 16 == 0 || step + 1 == steps {
                for i in 0..g.ag_count {
                    let m = a.group(AgId(i)).unwrap();
                    m.check().unwrap_or_else(|e| panic!("{}: {e}", ctx()));
                    let span = m.span();
                    let mut runs = Vec::new();
                    let mut b = span.start.0;
                    while b < span.end() {
                        if used[b as usize] {
                            b += 1;
                            continue;
                        }
                        let s = b;
                        while b < span.end() && !used[b as usize] {
                            b += 1;
                        }
                        runs.push(Extent::new(s, b - s));
                    }
                    assert_eq!(m.free_extents().collect::<Vec<_>>(), runs, "{}", ctx());
                }
                assert_eq!(a.free_blocks_owned(), owned_free(&used), "{}", ctx());
            }
        }
    }

    #[test]
    fn sim_alloc_free_against_bitmap() {
        let seed = match std::env::var("DATA_SIM_SEED") {
            Ok(s) => s.parse().expect("DATA_SIM_SEED is a u64"),
            Err(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1),
        };
        eprintln!("alloc sim: seed {seed} (replay with DATA_SIM_SEED={seed})");
        sim_one(seed, 3000);
    }

    #[test]
    fn sim_alloc_free_fixed_seeds() {
        for seed in 0..24 {
            sim_one(seed, 600);
        }
    }
}
