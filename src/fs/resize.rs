//! What changes a file's size or map other than WRITE: setattr (truncate among it),
//! fallocate (unwritten extents), punch, and SEEK_DATA/SEEK_HOLE. Each commits the file's
//! pending writes first and waits for its fast-path I/O: a block is freed or rewritten only
//! with no device I/O of the file in flight.

use super::*;

impl Inner {
    pub(super) fn setattr(&self, ino: u64, a: &SetattrIn) -> Result<Done, Errno> {
        if let Some(attr) = self.hold_chown_to_same_owner(ino, a) {
            let (attr, blocks) = self.shown_attr(attr)?;
            return Ok(done_bytes(&self.attr_out(&attr, blocks)));
        }
        // Pending writes commit first: their commit sets the size and mtime, which must
        // come before this change (an explicit mtime after a copy's writes, a truncate).
        self.sync_pending(ino)?;
        let v = a.valid;
        let mut set = SetAttr::default();
        if v & abi::FATTR_MODE != 0 {
            set.perm = Some((a.mode & 0o7777) as u16);
        }
        if v & abi::FATTR_UID != 0 {
            set.uid = Some(a.uid);
        }
        if v & abi::FATTR_GID != 0 {
            set.gid = Some(a.gid);
        }
        if v & abi::FATTR_ATIME_NOW != 0 {
            set.atime = Some(TimeSet::Now);
        } else if v & abi::FATTR_ATIME != 0 {
            set.atime = Some(TimeSet::At(wire_time(a.atime, a.atimensec)?));
        }
        if v & abi::FATTR_MTIME_NOW != 0 {
            set.mtime = Some(TimeSet::Now);
        } else if v & abi::FATTR_MTIME != 0 {
            set.mtime = Some(TimeSet::At(wire_time(a.mtime, a.mtimensec)?));
        }
        // Decided by the plan on the mode it changes (a read here cost a round trip).
        set.kill_suidgid = v & abi::FATTR_KILL_SUIDGID != 0;
        if v & abi::FATTR_SIZE != 0 {
            if a.size > FILE_SIZE_MAX {
                return Err(Errno::EFBIG);
            }
            let (attr, rev) = self.get_attr_at(ino)?;
            match attr.kind {
                FileType::Regular => {}
                FileType::Directory => return Err(Errno::EISDIR),
                _ => return Err(Errno::EINVAL),
            }
            // Truncation goes through the file's state (open or not) so the cached map
            // and the EOF block stay right.
            let st = self.files.open(ino, attr, rev)?;
            let r = self.truncate(&st, a.size, set);
            let _ = self.release_state(ino);
            let attr = r?;
            let blocks = self.file_blocks(&attr)?;
            return Ok(done_bytes(&self.attr_out(&attr, blocks)));
        }
        // A pending overwrite mtime must not land after (and undo) an explicit one.
        if set.mtime.is_some() {
            if let Some(st) = self.files.get(ino) {
                st.lock().mtime_dirty = None;
            }
        }
        // Planned from the cached inode (compared by value): one round trip, not two.
        set.expect = self.caches.attr(ino).map(Box::new);
        let out = self.commit(Mutation::SetAttr { ino: Ino(ino), set })?;
        let attr = out.attr.ok_or(Errno::EIO)?;
        let (attr, blocks) = self.shown_attr(attr)?;
        Ok(done_bytes(&self.attr_out(&attr, blocks)))
    }

    /// A chown of a file open here to the owner and group it has changes only its ctime
    /// (no set-id bit to clear): that is held like an overwrite's mtime, under the file's
    /// lock (the caller's), and written with the file's next commit or at the moments an
    /// mtime is (FLUSH, fsync, the lock's hand-over). SQLite gives each journal it creates
    /// as root its database's owner, and that chown cost an etcd round trip per
    /// transaction. The file's attributes then; `None`: the setattr commits as usual.
    fn hold_chown_to_same_owner(&self, ino: u64, a: &SetattrIn) -> Option<InodeAttr> {
        let owner = abi::FATTR_UID | abi::FATTR_GID;
        let harmless = owner | abi::FATTR_FH | abi::FATTR_LOCKOWNER | abi::FATTR_KILL_SUIDGID;
        if a.valid & owner == 0 || a.valid & !harmless != 0 {
            return None;
        }
        let st = self.files.get(ino)?;
        let mut f = st.lock();
        let same = (a.valid & abi::FATTR_UID == 0 || a.uid == f.attr.uid)
            && (a.valid & abi::FATTR_GID == 0 || a.gid == f.attr.gid);
        // attr_rev 0: the attributes are to be read again, so not known to be the owner's.
        if !same || f.attr_rev == 0 || killed_perm(f.attr.perm) != f.attr.perm {
            return None;
        }
        f.touch_ctime();
        Some(f.attr.clone())
    }

    /// Sets a regular file's size. Shrinking zeroes the rest of the new EOF block on the
    /// device first (bytes past EOF in that block must read as zeros when it grows again).
    pub(super) fn truncate(
        &self,
        st: &FileState,
        size: u64,
        mut set: SetAttr,
    ) -> Result<InodeAttr, Errno> {
        let mut f = st.lock();
        st.wait_io(&f);
        // Its tail block is zeroed on the device and those past it freed.
        f.recent.clear();
        let mut pending = self.commit_pending_locked(st, &mut f)?;
        let old = f.attr.size;
        let keep_to = size.next_multiple_of(BLOCK_SIZE);
        if keep_to < old {
            // The size change itself logs what one commit can; more goes in chunks first.
            let ranges = self.unmap_ranges(&mut f, st.ino, keep_to, u64::MAX)?;
            if ranges.len() > 1 {
                pending.extend(self.unmap_in_chunks(&mut f, st.ino, &ranges, false)?);
            }
        }
        // The block holding the lower of the two sizes keeps only what lies below it: when
        // shrinking, the cut-off bytes; when growing, whatever lies past the old size on the
        // device (an append lost in a crash before its size was committed) must read as
        // zeros too.
        if size != old {
            self.zero_block_tail(&mut f, st.ino, size.min(old))?;
        }
        set.size = Some(size);
        if set.mtime.is_none() {
            set.mtime = Some(TimeSet::Now);
        }
        f.mtime_dirty = None;
        let out = self.commit_locked(
            &mut f,
            Mutation::SetAttr {
                ino: Ino(st.ino),
                set,
            },
        )?;
        let attr = out.attr.clone().ok_or(Errno::EIO)?;
        if let Some(map) = f.extents.as_mut() {
            files::trim_extents(map, size.next_multiple_of(BLOCK_SIZE));
        }
        drop(f);
        pending.iter().for_each(|o| self.after_commit_unlocked(o));
        self.after_commit_unlocked(&out);
        Ok(attr)
    }

    /// Zeroes the device bytes of the block holding file offset `at` from `at` on, when
    /// that block is written (a hole or unwritten block reads as zeros already).
    pub(super) fn zero_block_tail(
        &self,
        f: &mut files::FileInner,
        ino: u64,
        at: u64,
    ) -> Result<(), Errno> {
        if at % BLOCK_SIZE == 0 {
            return Ok(());
        }
        let block = at - at % BLOCK_SIZE;
        let extents = self.extents_for(f, ino, block, BLOCK_SIZE)?;
        if let Some(dev_off) = written_block(&extents, block) {
            let mut io = self.io();
            let mut buf = AlignedBuf::new(BLOCK_SIZE as usize);
            io.read_at(&mut buf, dev_off).map_err(|e| errno::dev(&e))?;
            buf[(at - block) as usize..].fill(0);
            io.write_at(&buf, dev_off).map_err(|e| errno::dev(&e))?;
            io.flush().map_err(|e| errno::dev(&e))?;
        }
        Ok(())
    }

    /// File ranges covering the extents of `ino` in `[from, to)`, at most one commit's
    /// worth each (see [`Inner::unmap_in_chunks`]), in file order. A map too large to cache
    /// is read page by page; only the ranges are kept.
    pub(super) fn unmap_ranges(
        &self,
        f: &mut files::FileInner,
        ino: u64,
        from: u64,
        to: u64,
    ) -> Result<Vec<(u64, u64)>, Errno> {
        const PAGE: usize = 1024;
        let mut chunks = files::UnmapChunks::new(from, to, UNMAP_PER_COMMIT);
        // Loads the map when it is small enough to cache.
        self.extents_for(f, ino, from, BLOCK_SIZE)?;
        if let Some(map) = &f.extents {
            for e in files::overlapping(map, from, to.saturating_sub(from)) {
                chunks.push(e);
            }
            return Ok(chunks.finish());
        }
        let mut at = from;
        loop {
            let (list, more) = self
                .meta
                .extents(Ino(ino), at, PAGE)
                .and_then(|t| t.wait())
                .map_err(|e| errno::meta(&e))?;
            let mut next = None;
            for e in list.iter().map(FileExtent::from) {
                if !chunks.push(&e) {
                    return Ok(chunks.finish());
                }
                next = Some(e.file_off + e.len);
            }
            match next {
                Some(n) if more => at = n,
                _ => return Ok(chunks.finish()),
            }
        }
    }

    /// Unmaps `ranges` (from [`Inner::unmap_ranges`]) one commit each, from the end, so
    /// that every freed extent is logged as released: one SetExtents over more extents than
    /// a transaction holds fails, and a size change deletes those past what it can log
    /// blind, leaking them if the node dies before its free-map write. From the end, a
    /// crash in between leaves the file's data below the cut as it was. `touch_mtime` goes
    /// on the last commit. The outcomes are for [`Inner::after_commit_unlocked`].
    pub(super) fn unmap_in_chunks(
        &self,
        f: &mut files::FileInner,
        ino: u64,
        ranges: &[(u64, u64)],
        touch_mtime: bool,
    ) -> Result<Vec<Outcome>, Errno> {
        let mut outs = Vec::with_capacity(ranges.len());
        for (i, &(from, to)) in ranges.iter().enumerate().rev() {
            let m = Mutation::SetExtents {
                ino: Ino(ino),
                off: from,
                len: to - from,
                extents: Vec::new(),
                size_at_least: None,
                touch_mtime: touch_mtime && i == 0,
                free_maps: Vec::new(),
                expect: None,
            };
            outs.push(self.commit_locked(f, m)?);
            if let Some(map) = f.extents.as_mut() {
                files::replace_range(map, from, to - from, &[]);
            }
        }
        Ok(outs)
    }

    pub(super) fn fallocate(&self, ino: u64, off: u64, len: u64, mode: u32) -> Result<Done, Errno> {
        let end = off.checked_add(len).ok_or(Errno::EFBIG)?;
        if len == 0 {
            return Err(Errno::EINVAL);
        }
        if end > FILE_SIZE_MAX {
            return Err(Errno::EFBIG);
        }
        let st = self.files.get(ino).ok_or(Errno::EBADF)?;
        match mode {
            0 | FALLOC_KEEP_SIZE => self.allocate(&st, off, end, mode == 0),
            m if m == FALLOC_PUNCH_HOLE | FALLOC_KEEP_SIZE => self.punch(&st, off, end),
            _ => Err(Errno::EOPNOTSUPP),
        }
    }

    /// fallocate mode 0: unwritten extents for the holes of the range, size raised.
    pub(super) fn allocate(
        &self,
        st: &FileState,
        off: u64,
        end: u64,
        grow: bool,
    ) -> Result<Done, Errno> {
        let mut f = st.lock();
        st.wait_io(&f);
        f.recent.clear();
        // Its extents are read back from etcd's view below: pending writes first.
        for o in self.commit_pending_locked(st, &mut f)? {
            self.after_commit_unlocked(&o);
        }
        if grow && end > f.attr.size {
            // As for a truncate up: what lies past the old size in its block reads as zeros.
            let old = f.attr.size;
            self.zero_block_tail(&mut f, st.ino, old)?;
        }
        let b_off = off - off % BLOCK_SIZE;
        let b_end = end.next_multiple_of(BLOCK_SIZE);
        let extents = self.extents_for(&mut f, st.ino, b_off, b_end - b_off)?;
        let mut holes = Vec::new();
        let mut cursor = b_off;
        for e in &extents {
            if e.file_off > cursor {
                holes.push((cursor, e.file_off.min(b_end) - cursor));
            }
            cursor = cursor.max(e.file_off + e.len);
        }
        if cursor < b_end {
            holes.push((cursor, b_end - cursor));
        }
        let mut new: Vec<FileExtent> = Vec::new();
        for (hoff, hlen) in holes {
            let pieces = match self.alloc_blocks(hlen / BLOCK_SIZE, None) {
                Ok(p) => p,
                Err(e) => {
                    self.unalloc(&new);
                    return Err(e);
                }
            };
            let mut at = hoff;
            for p in pieces {
                new.push(FileExtent {
                    file_off: at,
                    len: p.byte_len(),
                    dev_off: p.dev_off(),
                    unwritten: true,
                });
                at += p.byte_len();
            }
        }
        let size_at_least = grow.then_some(end).filter(|&e| e > f.attr.size);
        if new.is_empty() && size_at_least.is_none() {
            return Ok(Done::Empty);
        }
        // Each hole becomes its own mutation-sized piece when there are many.
        for chunk in new
            .chunks(meta::pipeline::plan::EXTENTS_PER_MUTATION_MAX)
            .map(<[_]>::to_vec)
            .chain(new.is_empty().then(Vec::new))
        {
            let (c_off, c_len) = match (chunk.first(), chunk.last()) {
                (Some(a), Some(b)) => (a.file_off, b.file_off + b.len - a.file_off),
                _ => (b_off, BLOCK_SIZE),
            };
            // The replaced range holds only holes and the new extents (existing extents
            // between chunk pieces are passed back unchanged).
            // Cut to the range: with no hole to fill, the range is one block whose extent
            // may reach past it (a mutation's extents must lie inside its range).
            let mut within: Vec<FileExtent> = files::overlapping(&extents, c_off, c_len)
                .iter()
                .map(|e| clip(e, c_off, c_off + c_len))
                .collect();
            within.extend(chunk.iter().copied());
            within.sort_by_key(|e| e.file_off);
            let m = Mutation::SetExtents {
                ino: Ino(st.ino),
                off: c_off,
                len: c_len,
                extents: within.iter().map(to_meta_extent).collect(),
                size_at_least,
                touch_mtime: false,
                free_maps: Vec::new(),
                expect: None,
            };
            let out = match self.commit_allocation_locked(&mut f, m, &chunk) {
                Ok(o) => o,
                Err(e) => {
                    self.unalloc_unless_maybe_applied(&chunk, e);
                    return Err(e);
                }
            };
            if let Some(map) = f.extents.as_mut() {
                files::replace_range(map, c_off, c_len, &within);
            }
            self.after_commit_unlocked(&out);
        }
        Ok(Done::Empty)
    }

    /// PUNCH_HOLE|KEEP_SIZE: whole blocks unmapped (space returned), partial edge blocks
    /// zeroed in place.
    pub(super) fn punch(&self, st: &FileState, off: u64, end: u64) -> Result<Done, Errno> {
        let mut f = st.lock();
        st.wait_io(&f);
        f.recent.clear();
        for o in self.commit_pending_locked(st, &mut f)? {
            self.after_commit_unlocked(&o);
        }
        let end = end.min(f.attr.size.max(off));
        if end <= off {
            return Ok(Done::Empty);
        }
        let inner_off = off.next_multiple_of(BLOCK_SIZE);
        let inner_end = end - end % BLOCK_SIZE;
        let mut edges = Vec::new();
        if off % BLOCK_SIZE != 0 {
            edges.push((
                off - off % BLOCK_SIZE,
                off % BLOCK_SIZE,
                (end - (off - off % BLOCK_SIZE)).min(BLOCK_SIZE),
            ));
        }
        if end % BLOCK_SIZE != 0 && inner_end >= inner_off.max(off - off % BLOCK_SIZE + BLOCK_SIZE)
        {
            edges.push((inner_end, 0, end - inner_end));
        }
        let mut io = self.io();
        for (block, from, to) in edges {
            let extents = self.extents_for(&mut f, st.ino, block, BLOCK_SIZE)?;
            if let Some(dev_off) = written_block(&extents, block) {
                let mut buf = AlignedBuf::new(BLOCK_SIZE as usize);
                io.read_at(&mut buf, dev_off).map_err(|e| errno::dev(&e))?;
                buf[from as usize..to as usize].fill(0);
                io.write_at(&buf, dev_off).map_err(|e| errno::dev(&e))?;
            }
        }
        io.flush().map_err(|e| errno::dev(&e))?;
        if inner_end > inner_off {
            let mut ranges = self.unmap_ranges(&mut f, st.ino, inner_off, inner_end)?;
            if ranges.len() <= 1 {
                // One commit, which also sets mtime when there is nothing to unmap.
                ranges = vec![(inner_off, inner_end)];
            }
            let outs = self.unmap_in_chunks(&mut f, st.ino, &ranges, true)?;
            drop(f);
            outs.iter().for_each(|o| self.after_commit_unlocked(o));
        }
        Ok(Done::Empty)
    }

    pub(super) fn lseek(&self, ino: u64, off: u64, whence: u32) -> Result<Done, Errno> {
        let st = self.files.get(ino).ok_or(Errno::EBADF)?;
        let mut f = st.lock();
        let size = f.attr.size;
        if off >= size {
            return Err(Errno::ENXIO);
        }
        let extents = self.extents_for(&mut f, ino, off, size - off)?;
        let pos = match whence {
            SEEK_DATA => seek_data(&extents, off, size).ok_or(Errno::ENXIO)?,
            SEEK_HOLE => seek_hole(&extents, off, size),
            _ => return Err(Errno::EINVAL),
        };
        let mut b = vec![0u8; 8];
        let n = reply::lseek(&mut b, pos).ok_or(Errno::EIO)?;
        b.truncate(n);
        Ok(Done::Bytes(b))
    }
}
