//! READ and WRITE on a waiter (what the cores' fast paths leave), and write-behind:
//! allocating writes kept as the open file's pending change ([`files::Pending`]) until
//! one device flush and one `SetExtents` commit them (the module docs of `fs` say when).
//!
//! Invariant: data is durable on the device before the extent that points at it
//! commits, and the commit carries the free maps that publish the blocks it points at
//! (`Inner::commit_allocation_locked`).

use super::*;
use crate::data::device::IoReq;

/// An open's read of its file's map (see [`Inner::load_map_at_open`]).
pub(super) struct MapAtOpen {
    pub(super) extents: Vec<FileExtent>,
    pub(super) more: bool,
    /// The blocks generation before the read was sent.
    pub(super) gen: u64,
}

/// Most extents a file's map may have for its record at open ([`files::CommittedRecord`]):
/// a record is a copy, and a commit expects at most a handful of keys from it.
const RECORD_AT_OPEN_EXTENTS_MAX: usize = 64;

/// Caches the first `EXTENTS_CACHED_MAX` extents of a file's map: the whole map, or
/// (`more`) its first window of a map too large to cache.
fn install_map(f: &mut files::FileInner, list: Vec<FileExtent>, more: bool) {
    if more {
        f.map_too_big = true;
        f.windows.insert(files::ExtentWindow::of(0, list, true));
    } else {
        f.extents = Some(list);
    }
}

impl Inner {
    /// [`Inner::commit_locked`] for a `SetExtents` that points at `allocated` blocks
    /// (reserved by this node). The blocks are published as used in the maps of their
    /// groups that go with it, and the commit is fenced on owning those groups (only
    /// those: a group whose blocks were all published may have been handed to another
    /// node since); the maps are encoded and submitted under the allocator lock,
    /// so the pipeline (which keeps one map's writes in submission order) commits them in
    /// the order of the allocator changes they describe. A commit that fails leaves the
    /// blocks published: a crash before a retry leaks them, but nothing hands them out
    /// twice.
    pub(super) fn commit_allocation_locked(
        &self,
        f: &mut files::FileInner,
        mut m: Mutation,
        allocated: &[FileExtent],
    ) -> Result<Outcome, Errno> {
        let ticket = {
            let mut a = lock(&self.alloc);
            let blocks: Vec<Extent> = allocated.iter().map(device_blocks).collect();
            a.publish(&blocks);
            if let Mutation::SetExtents { free_maps, .. } = &mut m {
                *free_maps = encode_maps(&a, &a.groups_of(&blocks));
            }
            self.submit_op(m)
        };
        let r = ticket.and_then(|t| t.wait());
        self.settle_locked(f, r, true)
    }

    /// The extents overlapping `[off, off + len)`: from the cache, loading the whole map
    /// on first use when it is small enough, else read for this range only.
    pub(super) fn extents_for(
        &self,
        f: &mut files::FileInner,
        ino: u64,
        off: u64,
        len: u64,
    ) -> Result<Vec<FileExtent>, Errno> {
        if f.extents.is_none() && !f.map_too_big {
            let (list, more) = self
                .meta
                .extents(Ino(ino), 0, files::EXTENTS_CACHED_MAX)
                .and_then(|t| t.wait())
                .map_err(|e| errno::meta(&e))?;
            install_map(f, list.iter().map(FileExtent::from).collect(), more);
        }
        if let Some(map) = &f.extents {
            return Ok(files::overlapping(map, off, len).to_vec());
        }
        if let Some(hit) = f.windows.covering(off, len) {
            return Ok(hit.to_vec());
        }
        // A map too large to cache: read a window from here on, at least the extents this
        // range can touch (one per block at most, plus the one reaching in from before).
        let need = (len.div_ceil(BLOCK_SIZE) as usize).saturating_add(2);
        let limit = need.max(files::WINDOW_EXTENTS);
        let (list, more) = self
            .meta
            .extents(Ino(ino), off, limit)
            .and_then(|t| t.wait())
            .map_err(|e| errno::meta(&e))?;
        let v: Vec<FileExtent> = list.iter().map(FileExtent::from).collect();
        let hit = files::overlapping(&v, off, len).to_vec();
        f.windows.insert(files::ExtentWindow::of(off, v, more));
        Ok(hit)
    }

    /// Gives a file opened here its extent map read with its attributes at open
    /// (`map`, read after the blocks generation was `gen`), so that its reads need no
    /// etcd later: a file held open and read only from the page cache while etcd was up
    /// answered EIO at its first READ to the daemon once etcd became unreachable, its map
    /// read lazily. The map is stale if any extent changed since `gen` (a write-behind
    /// commit or truncate of this file by another open, here, between the read and this
    /// call): then it is read again, under the file's lock. An error leaves the map to be
    /// read by the first READ, as before.
    pub(super) fn load_map_at_open(&self, st: &FileState, map: MapAtOpen) {
        let mut f = st.lock();
        if f.extents.is_some() || f.map_too_big || f.pending.is_some() {
            return;
        }
        if self.caches.blocks_gen() == map.gen {
            // Read with the attributes, in one view: what etcd holds as the file is
            // opened, so its first commit may plan from it as from a commit's record.
            if !map.more && map.extents.len() <= RECORD_AT_OPEN_EXTENTS_MAX {
                f.committed = Some(files::CommittedRecord {
                    attr: f.attr.clone(),
                    known: meta::pipeline::ExtentsKnown {
                        start: 0,
                        end: u64::MAX,
                        extents: map.extents.iter().map(to_meta_extent).collect(),
                    },
                });
            }
            install_map(&mut f, map.extents, map.more);
        } else if let Err(e) = self.extents_for(&mut f, st.ino, 0, 0) {
            log::debug!("reading the extents of inode {} at open: {e:?}", st.ino);
        }
    }

    /// READ: a plan of device reads and zeros.
    pub(super) fn read(
        &self,
        ino: u64,
        off: u64,
        size: u32,
        out_len: usize,
    ) -> Result<Done, Errno> {
        let st = self.files.get(ino).ok_or(Errno::EBADF)?;
        let mut f = st.lock();
        // The read goes to the device: what is held goes there first.
        self.write_held_locked(&st, &mut f)?;
        atime::note_read(&mut f, self.noatime);
        let fsize = f.attr.size;
        if off >= fsize || size == 0 {
            return Ok(Done::Bytes(Vec::new()));
        }
        let (a_off, a_len) = aligned_range(off, u64::from(size), fsize);
        let extents = self.extents_for(&mut f, ino, a_off, a_len)?;
        let io = st.begin_io(&f);
        drop(f);
        self.read_done(&extents, fsize, off, size, out_len)
            .map(|d| d.held_by(io))
    }

    pub(super) fn read_done(
        &self,
        extents: &[FileExtent],
        fsize: u64,
        off: u64,
        size: u32,
        out_len: usize,
    ) -> Result<Done, Errno> {
        let plan = build_read(
            extents,
            fsize,
            off,
            u64::from(size),
            self.dev.fd().unwrap_or(-1),
        )
        .map_err(|e| errno::plan(&e))?;
        if self.dev.fd().is_some() && plan.total() <= out_len {
            return Ok(Done::Read(plan));
        }
        // No fd to hand the transport (memory device), or an unaligned read whose
        // aligned cover exceeds the reply buffer: read it here.
        Ok(Done::Bytes(exec_read(&mut *self.io(), &plan)?))
    }

    /// WRITE: data to the device (durable first when new blocks get mapped), then the
    /// extents, then the reply.
    pub(super) fn write(
        &self,
        ino: u64,
        off: u64,
        data: &[u8],
        mode: WriteMode,
    ) -> Result<Done, Errno> {
        let WriteMode {
            kill: kill_suid,
            append,
            may_hold,
        } = mode;
        let len = data.len() as u64;
        if !self.op_serving() {
            // Our lease is gone: another node may own our groups now.
            return Err(Errno::EIO);
        }
        let st = self.files.get(ino).ok_or(Errno::EBADF)?;
        let mut f = st.lock();
        // O_APPEND: the kernel chose the offset from its own idea of the size, which is
        // another node's old size when that node appended last. The exclusive lock makes
        // ours the file's real size; the kernel's copy of the data at its offset (and
        // its size) are dropped once this write is answered.
        let off = if append && off != f.attr.size {
            self.lock_stale(ino, (off, off.saturating_add(len)));
            f.attr.size
        } else {
            off
        };
        let end = off.checked_add(len).ok_or(Errno::EFBIG)?;
        if end > FILE_SIZE_MAX {
            return Err(Errno::EFBIG);
        }
        if len == 0 {
            return reply_write(0);
        }
        // A small write (a journal's appends, mostly) is held, its blocks built on the held
        // ones; any other is read and written against the device as it is, what is held
        // written out first.
        let mut hold = may_hold
            && end.next_multiple_of(BLOCK_SIZE) - (off - off % BLOCK_SIZE) <= HOLD_WRITE_MAX
            && f.extents.is_some()
            && self.fence.open();
        if !hold {
            self.write_held_locked(&st, &mut f)?;
        }
        let fast = (!hold).then(|| plan_overwrite(&st, &mut f, off, data.len(), kill_suid, -1));
        if let Some((segments, _io)) = fast.flatten() {
            // What a core's fast path serves, here because that path found the lock busy:
            // planned under the lock and written outside it with the file's I/O count
            // raised, as on a core. Holding the lock through the device write (and waiting
            // for every other write in flight first) would send the cores' next writes of
            // this file here too.
            drop(f);
            let mut io = self.io();
            for seg in &segments {
                let mut piece = AlignedBuf::new(seg.len);
                piece[..seg.len].copy_from_slice(&data[seg.src..seg.src + seg.len]);
                io.write_at(&piece, seg.offset)
                    .map_err(|e| errno::dev(&e))?;
            }
            return reply_write(len);
        }
        // A partial block is read, merged and rewritten: no fast-path write of it may be in
        // flight meanwhile.
        st.wait_io(&f);
        let size = f.attr.size;
        let block_off = off - off % BLOCK_SIZE;
        let block_end = end.next_multiple_of(BLOCK_SIZE);
        // The map around the write, and the old EOF block (plan_write may rmw it).
        let eof_block = size - size % BLOCK_SIZE;
        let from = block_off.min(eof_block);
        let extents = self.extents_for(&mut f, ino, from, block_end - from)?;
        let plan = dplan::plan_write(&extents, size, off, len).map_err(|e| errno::plan(&e))?;
        // Short of space in our groups with writes of this file pending: commit them and
        // start again. Their reserved blocks would keep the group they lie in (where our
        // last free space is) from being handed over while we wait for other nodes to
        // hand us one, and with every node waiting so, nobody could (`space.rs`).
        let holes: u64 = plan.holes().map(|(_, l)| l).sum();
        if holes > 0 && f.pending.is_some() && !self.owns_free_blocks(holes / BLOCK_SIZE) {
            match self.commit_pending_locked(&st, &mut f) {
                Ok(outs) => {
                    drop(f);
                    outs.iter().for_each(|o| self.after_commit_unlocked(o));
                    return self.write(ino, off, data, mode);
                }
                // Kept for its next trigger; this write goes on as it would have.
                Err(e) => log::warn!("committing writes behind of inode {ino} early: {e}"),
            }
        }

        // Allocate the holes (in the groups this node owns; claim more when they run out).
        // Next to the extent before the write: an append continues its file's extent (the
        // range read above does not reach back to it; the cached map does).
        let before = |m: &[FileExtent]| {
            let i = m.partition_point(|e| e.file_off < block_off);
            i.checked_sub(1).and_then(|i| m.get(i)).copied()
        };
        let goal = f
            .extents
            .as_deref()
            .map_or_else(|| before(&extents), before)
            .map(|e| BlockNo((e.dev_off + e.len) / BLOCK_SIZE));
        let mut allocated: Vec<FileExtent> = Vec::new();
        for (hoff, hlen) in plan.holes() {
            let pieces = match self.alloc_blocks(hlen / BLOCK_SIZE, goal) {
                Ok(p) => p,
                Err(e) => {
                    self.unalloc(&allocated);
                    return Err(e);
                }
            };
            let mut at = hoff;
            for p in pieces {
                allocated.push(FileExtent {
                    file_off: at,
                    len: p.byte_len(),
                    dev_off: p.dev_off(),
                    unwritten: false,
                });
                at += p.byte_len();
            }
        }

        // Build the block-aligned image of the write.
        let mut buf = AlignedBuf::new(plan.block_len as usize);
        let mut io = self.io();
        for b in &plan.rmw {
            if b.file_off < plan.block_off {
                // The old EOF block before the write: zero its tail in place, on the
                // device (so what is held goes there first).
                if let Some(dev_off) = b.old_dev_off {
                    if std::mem::take(&mut hold) {
                        if let Err(e) = self.write_held_locked(&st, &mut f) {
                            self.unalloc(&allocated);
                            return Err(e);
                        }
                    }
                    f.recent.forget(b.file_off, BLOCK_SIZE);
                    let mut blk = AlignedBuf::new(BLOCK_SIZE as usize);
                    let r = io.read_at(&mut blk, dev_off).and_then(|()| {
                        blk[b.keep_bytes as usize..].fill(0);
                        io.write_at(&blk, dev_off)
                    });
                    if let Err(e) = r {
                        self.unalloc(&allocated);
                        return Err(errno::dev(&e));
                    }
                }
                continue;
            }
            let at = (b.file_off - plan.block_off) as usize;
            let slot = &mut buf[at..at + BLOCK_SIZE as usize];
            if let Some(dev_off) = b.old_dev_off {
                if let Some(h) = f.held.get(b.file_off, dev_off) {
                    slot.copy_from_slice(h);
                    self.data_counters
                        .rmw_blocks_kept
                        .fetch_add(1, Ordering::Relaxed);
                } else if let Some(kept) = f.recent.get(b.file_off, dev_off) {
                    slot.copy_from_slice(kept);
                    self.data_counters
                        .rmw_blocks_kept
                        .fetch_add(1, Ordering::Relaxed);
                } else {
                    // The write's last block: the blocks after it come along in the same
                    // read when they follow it on the device, for the writes after this one.
                    let ahead = match f.extents.as_deref() {
                        Some(map) if b.file_off + BLOCK_SIZE == plan.block_off + plan.block_len => {
                            dplan::written_run_after(
                                map,
                                f.attr.size,
                                b.file_off,
                                dev_off,
                                files::RECENT_READ_AHEAD,
                            )
                        }
                        _ => 0,
                    };
                    let mut blk = AlignedBuf::new(((1 + ahead) * BLOCK_SIZE) as usize);
                    if let Err(e) = io.read_at(&mut blk, dev_off) {
                        self.unalloc(&allocated);
                        return Err(errno::dev(&e));
                    }
                    slot.copy_from_slice(&blk[..BLOCK_SIZE as usize]);
                    for k in 1..=ahead {
                        let at = (k * BLOCK_SIZE) as usize;
                        f.recent.put(
                            b.file_off + k * BLOCK_SIZE,
                            dev_off + k * BLOCK_SIZE,
                            &blk[at..at + BLOCK_SIZE as usize],
                        );
                    }
                }
            }
            slot[b.keep_bytes as usize..].fill(0);
        }
        let d = (off - plan.block_off) as usize;
        buf[d..d + data.len()].copy_from_slice(data);

        // Where each piece of the block range goes, and what the map becomes.
        let mut new_map: Vec<FileExtent> = Vec::new();
        let mut needs_commit = end > size;
        for seg in &plan.segments {
            match *seg {
                WriteSeg::Mapped {
                    file_off,
                    len,
                    dev_off,
                    unwritten,
                } => {
                    needs_commit |= unwritten;
                    new_map.push(FileExtent {
                        file_off,
                        len,
                        dev_off,
                        unwritten: false,
                    });
                }
                WriteSeg::Hole { file_off, len } => {
                    needs_commit = true;
                    new_map.extend(
                        allocated
                            .iter()
                            .filter(|e| e.file_off >= file_off && e.file_off < file_off + len),
                    );
                }
            }
        }
        // What the device holds in this range is unknown until every write below succeeded.
        f.recent.forget(plan.block_off, plan.block_len);
        let held = hold && hold_blocks(&mut f, plan.block_off, &buf, &new_map);
        if hold && !held {
            // No room to hold: the device must have what is held before this is written.
            if let Err(e) = self.write_held_locked(&st, &mut f) {
                self.unalloc(&allocated);
                return Err(e);
            }
        }
        if held {
            self.data_counters
                .writes_held
                .fetch_add(1, Ordering::Relaxed);
            self.files.mark_dirty(ino);
        }
        let to_device: &[FileExtent] = if held { &[] } else { &new_map };
        let mut reqs_res = Ok(());
        for e in to_device {
            let at = (e.file_off - plan.block_off) as usize;
            // Whole blocks at block-aligned offsets, from an aligned buffer slice: write
            // through a bounce only when the piece does not start the buffer.
            let r = if at == 0 && e.len == plan.block_len {
                io.write_at(&buf, e.dev_off)
            } else {
                let mut piece = AlignedBuf::new(e.len as usize);
                piece[..e.len as usize].copy_from_slice(&buf[at..at + e.len as usize]);
                io.write_at(&piece, e.dev_off)
            };
            if let Err(e) = r {
                reqs_res = Err(e);
                break;
            }
        }
        if let Err(e) = reqs_res {
            self.unalloc(&allocated);
            return Err(errno::dev(&e));
        }
        if !plan.rmw.is_empty() && !held {
            // Dropped again below if the map does not take the new blocks.
            f.recent
                .put_edges(plan.block_off, &buf, |block| written_block(&new_map, block));
        }
        if !needs_commit {
            // An overwrite of written blocks inside EOF: no metadata changes but mtime,
            // written at FLUSH/FSYNC/RELEASE. No etcd round trip.
            f.touch_overwrite();
            if kill_suid && killed_perm(f.attr.perm) != f.attr.perm {
                drop(f);
                self.kill_suid(ino)?;
            }
            return reply_write(len);
        }
        let now = SystemClock::new().wall();
        let merged = merge_extents(&new_map);
        if f.extents.is_some() {
            // Write-behind: the map and attributes here show the write now; etcd gets it
            // with the file's next commit (see the module docs).
            let range = (plan.block_off, plan.block_len);
            let outs = self
                .add_pending(&st, &mut f, range, &merged, allocated, end, now)
                .inspect_err(|_| f.recent.clear())?;
            let suid = kill_suid && killed_perm(f.attr.perm) != f.attr.perm;
            drop(f);
            outs.iter().for_each(|o| self.after_commit_unlocked(o));
            if suid {
                self.kill_suid(ino)?;
            }
            return reply_write(len);
        }
        // A map too large to cache has no room for pending extents: commit now.
        // Invariant 1: the data is durable before an extent points at it.
        if let Err(e) = io.flush() {
            f.recent.clear();
            self.unalloc(&allocated);
            return Err(errno::dev(&e));
        }
        let m = Mutation::SetExtents {
            ino: Ino(ino),
            off: plan.block_off,
            len: plan.block_len,
            extents: merged.iter().map(to_meta_extent).collect(),
            size_at_least: Some(end),
            touch_mtime: true,
            free_maps: Vec::new(),
            expect: f.expect_extents(plan.block_off, plan.block_off + plan.block_len),
        };
        let out = match self.commit_allocation_locked(&mut f, m, &allocated) {
            Ok(o) => o,
            Err(e) => {
                f.recent.clear();
                self.unalloc_unless_maybe_applied(&allocated, e);
                return Err(e);
            }
        };
        f.mtime_dirty = None;
        if let Some(map) = f.extents.as_mut() {
            files::replace_range(map, plan.block_off, plan.block_len, &merged);
        }
        let suid = kill_suid && killed_perm(f.attr.perm) != f.attr.perm;
        drop(f);
        self.after_commit_unlocked(&out);
        if suid {
            self.kill_suid(ino)?;
        }
        reply_write(len)
    }

    /// Adds a written range to the file's pending change: `merged` (the range's new
    /// mapping, sorted) into the cached map, the size and mtime into the attributes.
    /// Commits what was pending first when this write would take one commit past the
    /// extent bound, and everything when the allocated bytes pass theirs. The outcomes
    /// of those commits are for [`Inner::after_commit_unlocked`].
    #[allow(
        clippy::too_many_arguments,
        reason = "the pieces of one planned write, passed once"
    )]
    pub(super) fn add_pending(
        &self,
        st: &FileState,
        f: &mut files::FileInner,
        (off, len): (u64, u64),
        merged: &[FileExtent],
        allocated: Vec<FileExtent>,
        size: u64,
        now: Timespec,
    ) -> Result<Vec<Outcome>, Errno> {
        let end = off + len;
        let mut outs = Vec::new();
        if let (Some(p), Some(map)) = (&f.pending, &f.extents) {
            let (u_off, u_end) = (p.off.min(off), p.end.max(end));
            let old = p.old_extents + newly_covered(map, (p.off, p.end), (u_off, u_end));
            // Extents now in the union, plus this write's, plus the two it may split.
            let new = files::overlapping(map, u_off, u_end - u_off).len() + merged.len() + 2;
            let pieces = p.allocated.len() + allocated.len();
            if [old, new, pieces].iter().any(|&n| n > PENDING_EXTENTS_MAX) {
                match self.commit_pending_locked(st, f) {
                    Ok(o) => outs = o,
                    Err(e) => log::warn!("committing pending writes of inode {}: {e}", st.ino),
                }
            }
        }
        let Some(map) = f.extents.as_mut() else {
            // A failed commit dropped the pending change, and the map with it.
            self.unalloc(&allocated);
            return Err(Errno::EIO);
        };
        let grown = match &f.pending {
            Some(p) => newly_covered(map, (p.off, p.end), (p.off.min(off), p.end.max(end))),
            None => files::overlapping(map, off, len).len(),
        };
        files::replace_range(map, off, len, merged);
        merge_around(map, off, end);
        if f.pending.is_none() {
            self.files.mark_dirty(st.ino);
        }
        let committed_size = f.attr.size;
        let p = f.pending.get_or_insert_with(|| Pending {
            off,
            end,
            allocated: Vec::new(),
            allocated_bytes: 0,
            size,
            committed_size,
            old_extents: 0,
            since: std::time::Instant::now(),
            mtime: now,
            failures: 0,
            maybe_applied: false,
        });
        p.off = p.off.min(off);
        p.end = p.end.max(end);
        p.old_extents += grown;
        p.size = p.size.max(size);
        p.mtime = p.mtime.max(now);
        for e in allocated {
            p.allocated_bytes += e.len;
            match p.allocated.last_mut() {
                Some(l) if l.file_off + l.len == e.file_off && l.dev_off + l.len == e.dev_off => {
                    l.len += e.len;
                }
                _ => p.allocated.push(e),
            }
        }
        let full = p.allocated_bytes >= PENDING_BYTES_MAX;
        // The commit's mtime (its own time) is later than any overwrite's.
        f.mtime_dirty = None;
        f.overlay_pending();
        if full {
            match self.commit_pending_locked(st, f) {
                Ok(o) => outs.extend(o),
                // The data is written and stays pending for the next trigger.
                Err(e) => log::warn!("committing pending writes of inode {}: {e}", st.ino),
            }
        }
        Ok(outs)
    }

    /// Commits the file's pending change, if any: waits for its fast-path I/O, flushes the
    /// device (invariant: data durable before an extent points at it), then one
    /// `SetExtents` over the pending range (more when its merged map exceeds a mutation)
    /// with the size reached and the free maps of the groups allocated in. A failure
    /// keeps it for the next trigger, up to [`PENDING_RETRIES_MAX`] attempts; a lost
    /// session drops it at once (its groups may be another node's now). The outcomes are
    /// for [`Inner::after_commit_unlocked`].
    pub(super) fn commit_pending_locked(
        &self,
        st: &FileState,
        f: &mut files::FileInner,
    ) -> Result<Vec<Outcome>, Errno> {
        let held = !f.held.is_empty();
        self.write_held_locked(st, f)?;
        let Some(mut p) = f.pending.take() else {
            if held {
                self.files.clear_dirty(st.ino);
            }
            return Ok(Vec::new());
        };
        if !self.op_serving() {
            log::error!(
                "dropping pending writes of inode {} (bytes {}..{}): this node's session is \
                 gone",
                st.ino,
                p.off,
                p.end
            );
            self.drop_pending(st.ino, f, p);
            return Err(Errno::EIO);
        }
        st.wait_io(f);
        let r = match self.io().flush() {
            Ok(()) => self.commit_range(st.ino, f, &p).inspect_err(|&e| {
                // Unknown outcome (etcd unreachable): it may have been applied.
                p.maybe_applied |= e == Errno::EIO;
            }),
            Err(e) => Err(errno::dev(&e)),
        };
        match r {
            Ok(outs) => {
                // The commit wrote its own (later) mtime.
                f.mtime_dirty = None;
                self.files.clear_dirty(st.ino);
                Ok(outs)
            }
            Err(e) => {
                p.failures += 1;
                if p.failures >= PENDING_RETRIES_MAX {
                    log::error!(
                        "dropping pending writes of inode {} (bytes {}..{}) after {} failed \
                         commits: {e}",
                        st.ino,
                        p.off,
                        p.end,
                        p.failures
                    );
                    self.drop_pending(st.ino, f, p);
                } else {
                    log::warn!(
                        "commit of pending writes of inode {} failed ({e}); kept for a retry",
                        st.ino
                    );
                    f.pending = Some(p);
                    f.overlay_pending();
                }
                Err(e)
            }
        }
    }

    /// Writes the file's held blocks ([`files::HeldBlocks`]) to the device, each run of
    /// blocks adjacent there as one write, all in one batch, after any device I/O of the
    /// file in flight (which they are newer than). Written, they stay as copies of what
    /// the device has ([`files::RecentBlocks`]). Those of a session that is gone, or whose
    /// write failed, are dropped: EIO, as a page cache reports a failed write-back.
    pub(super) fn write_held_locked(
        &self,
        st: &FileState,
        f: &mut files::FileInner,
    ) -> Result<(), Errno> {
        if f.held.is_empty() {
            return Ok(());
        }
        let mut blocks = f.held.take();
        let n = blocks.len() as u64;
        let lost = |f: &mut files::FileInner, what: &str| {
            log::error!(
                "{n} written blocks of inode {} never reached the device: {what}",
                st.ino
            );
            self.data_counters
                .held_blocks_lost
                .fetch_add(n, Ordering::Relaxed);
            // Some may be blocks that pending writes allocated: their extents must never
            // reach etcd, or the file would show whatever the device had there before.
            if let Some(p) = f.pending.take() {
                self.drop_pending(st.ino, f, p);
            }
            Errno::EIO
        };
        if !self.op_serving() {
            return Err(lost(f, "this node's session is gone"));
        }
        st.wait_io(f);
        blocks.sort_unstable_by_key(|&(_, dev_off, _)| dev_off);
        // Runs of blocks adjacent on the device, `[i, j)` in `blocks`; one write each, from
        // the block itself or, for a longer run, from the blocks put together.
        let mut runs = Vec::new();
        let mut i = 0;
        while i < blocks.len() {
            let j = (i + 1..blocks.len())
                .find(|&j| blocks[j].1 != blocks[i].1 + (j - i) as u64 * BLOCK_SIZE)
                .unwrap_or(blocks.len());
            runs.push((i, j));
            i = j;
        }
        let joined: Vec<Option<AlignedBuf>> = runs
            .iter()
            .map(|&(i, j)| {
                (j > i + 1).then(|| {
                    let mut buf = AlignedBuf::new((j - i) * BLOCK_SIZE as usize);
                    for (k, b) in blocks[i..j].iter().enumerate() {
                        let at = k * BLOCK_SIZE as usize;
                        buf[at..at + BLOCK_SIZE as usize].copy_from_slice(&b.2);
                    }
                    buf
                })
            })
            .collect();
        let mut reqs: Vec<IoReq<'_>> = runs
            .iter()
            .zip(&joined)
            .map(|(&(i, _), buf)| IoReq::write(buf.as_ref().unwrap_or(&blocks[i].2), blocks[i].1))
            .collect();
        let failed = self
            .io()
            .submit_batch(&mut reqs)
            .into_iter()
            .find_map(Result::err);
        drop(reqs);
        if let Some(e) = failed {
            return Err(lost(f, &e.to_string()));
        }
        let c = &self.data_counters;
        c.held_blocks_written.fetch_add(n, Ordering::Relaxed);
        c.held_block_runs_written
            .fetch_add(runs.len() as u64, Ordering::Relaxed);
        // What the device has now: the next small write into one of them merges into it.
        for (file_off, dev_off, data) in &blocks {
            f.recent.put(*file_off, *dev_off, data);
        }
        Ok(())
    }

    /// The `SetExtents` of a pending change: the cached map of its range, merged, in
    /// chunks of at most a mutation's extents. The free maps of the groups allocated in go
    /// with every chunk, so no committed extent points at blocks etcd calls free and every
    /// chunk is fenced on the groups' ownership; each chunk raises the size only to its
    /// own end, so a crash between chunks leaves a prefix.
    pub(super) fn commit_range(
        &self,
        ino: u64,
        f: &mut files::FileInner,
        p: &Pending,
    ) -> Result<Vec<Outcome>, Errno> {
        let map = f.extents.as_ref().ok_or(Errno::EIO)?;
        let clipped: Vec<FileExtent> = files::overlapping(map, p.off, p.end - p.off)
            .iter()
            .map(|e| clip(e, p.off, p.end))
            .collect();
        let merged = merge_extents(&clipped);
        let chunks: Vec<&[FileExtent]> = if merged.is_empty() {
            vec![&[]]
        } else {
            merged
                .chunks(meta::pipeline::plan::EXTENTS_PER_MUTATION_MAX)
                .collect()
        };
        let mut outs = Vec::with_capacity(chunks.len());
        for (i, chunk) in chunks.iter().enumerate() {
            let c_off = match (i, chunk.first()) {
                (0, _) | (_, None) => p.off,
                (_, Some(e)) => e.file_off,
            };
            let c_end = chunks
                .get(i + 1)
                .and_then(|c| c.first())
                .map_or(p.end, |e| e.file_off);
            let m = Mutation::SetExtents {
                ino: Ino(ino),
                off: c_off,
                len: c_end - c_off,
                extents: chunk.iter().map(to_meta_extent).collect(),
                size_at_least: Some(p.size.min(c_end)),
                touch_mtime: true,
                // Every chunk is fenced on this node still owning the groups; each
                // carries the maps as they are now (a fresher copy than the last chunk's).
                free_maps: Vec::new(),
                // Each chunk's settle records what it left for the next one.
                expect: f.expect_extents(c_off, c_end),
            };
            // The blocks this chunk points at become used in etcd's maps with it; the
            // rest of the pending change stays reserved (free there) until its chunk.
            let mine: Vec<FileExtent> = p
                .allocated
                .iter()
                .filter(|e| e.file_off >= c_off && e.file_off < c_end)
                .copied()
                .collect();
            outs.push(self.commit_allocation_locked(f, m, &mine)?);
        }
        if let Some(map) = f.extents.as_mut() {
            files::replace_range(map, p.off, p.end - p.off, &merged);
        }
        Ok(outs)
    }

    /// Forgets a pending change that will never commit: its blocks go back to the
    /// allocator (unless a failed attempt may have published them), the map is re-read
    /// from etcd, and the size goes back to the committed one.
    pub(super) fn drop_pending(&self, ino: u64, f: &mut files::FileInner, p: Pending) {
        if !p.maybe_applied {
            self.unalloc(&p.allocated);
        }
        f.extents = None;
        f.map_too_big = false;
        f.windows.clear();
        f.recent.clear();
        f.committed = None;
        f.attr.size = p.committed_size;
        // The next etcd read of the attributes replaces them.
        f.attr_rev = 0;
        self.files.clear_dirty(ino);
        self.caches.forget_blocks(ino);
    }

    /// Commits a file's pending change (fsync, FLUSH, RELEASE, setattr, syncfs, unmount).
    pub(super) fn sync_pending(&self, ino: u64) -> Result<(), Errno> {
        // Not even a moment of the file's lock when nothing is pending: a fast-path WRITE
        // or READ that finds it taken goes to a waiter.
        if !self.files.is_dirty(ino) {
            return Ok(());
        }
        let Some(st) = self.files.get(ino) else {
            return Ok(());
        };
        let mut f = st.lock();
        let outs = self.commit_pending_locked(&st, &mut f)?;
        drop(f);
        outs.iter().for_each(|o| self.after_commit_unlocked(o));
        Ok(())
    }

    /// The age trigger (housekeeping): commits pending changes, and writes out held
    /// blocks, older than [`PENDING_AGE_MAX`].
    pub(super) fn commit_aged(&self) {
        for ino in self.files.dirty() {
            let Some(st) = self.files.get(ino) else {
                // Closed: the last close committed or dropped it.
                self.files.clear_dirty(ino);
                continue;
            };
            let mut f = st.lock();
            let since = match (&f.pending, f.held.since()) {
                (Some(p), Some(h)) => p.since.min(h),
                (Some(p), None) => p.since,
                (None, Some(h)) => h,
                (None, None) => {
                    self.files.clear_dirty(ino);
                    continue;
                }
            };
            if since.elapsed() < PENDING_AGE_MAX {
                continue;
            }
            match self.commit_pending_locked(&st, &mut f) {
                Ok(outs) => {
                    drop(f);
                    outs.iter().for_each(|o| self.after_commit_unlocked(o));
                }
                Err(e) => log::warn!("committing aged pending writes of inode {ino}: {e}"),
            }
        }
    }
}

/// How a WRITE is to be done.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WriteMode {
    /// Clear set-user-id (and set-group-id) as a write by another user does.
    pub(crate) kill: bool,
    /// O_APPEND: at the file's real size, whatever offset the kernel chose.
    pub(crate) append: bool,
    /// The application did not ask for the device (O_DIRECT, O_SYNC, O_DSYNC): a small
    /// write may be held ([`files::HeldBlocks`]).
    pub(crate) may_hold: bool,
}

/// Holds the blocks of a write's image `buf` (starting at file offset `block_off`, placed
/// by `map`, all written space) instead of writing them: true when every block is held,
/// false (holding nothing) when the bounds of [`files::HeldBlocks::reserve`] leave no room.
fn hold_blocks(f: &mut files::FileInner, block_off: u64, buf: &[u8], map: &[FileExtent]) -> bool {
    let blocks: Option<Vec<(u64, u64)>> = (block_off..block_off + buf.len() as u64)
        .step_by(BLOCK_SIZE as usize)
        .map(|block| written_block(map, block).map(|d| (block, d)))
        .collect();
    let Some(blocks) = blocks else {
        return false;
    };
    let new = blocks
        .iter()
        .filter(|&&(block, dev_off)| f.held.get(block, dev_off).is_none())
        .count();
    if !f.held.reserve(new) {
        return false;
    }
    for (block, dev_off) in blocks {
        let at = (block - block_off) as usize;
        let mut data = AlignedBuf::new(BLOCK_SIZE as usize);
        data.copy_from_slice(&buf[at..at + BLOCK_SIZE as usize]);
        f.held.put(block, dev_off, data);
    }
    true
}
