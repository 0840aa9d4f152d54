//! Open, close and fsync of files: the open-file table entry, the mtime of in-place
//! overwrites written at FLUSH/RELEASE, pending writes committed at close and fsync, and
//! the last close of an unlinked file reclaiming it (with its open record: `held.rs`).

use super::*;
use meta::cachelock::LockMode;

fn truncates(flags: u32) -> bool {
    flags & libc::O_TRUNC as u32 != 0 && flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32
}

impl Inner {
    pub(super) fn open_file(&self, ino: u64, flags: u32, dir: bool) -> Result<Done, Errno> {
        // A directory needs only its type; a file is read fresh (close-to-open: the size
        // another node wrote before our open is seen).
        if dir {
            let attr = self.cached_attr(ino)?;
            return self.open_with_attr(ino, flags, dir, attr, 0, None);
        }
        // A truncating open writes: it needs the lock exclusive.
        let mode = if truncates(flags) {
            LockMode::Exclusive
        } else {
            LockMode::Shared
        };
        let _held = self.hold_regular(ino, mode)?;
        if mode == LockMode::Exclusive {
            // Its map is about to go.
            let (attr, rev) = self.get_attr_at(ino)?;
            return self.open_with_attr(ino, flags, dir, attr, rev, None);
        }
        let (attr, rev, map) = self.attr_and_map_for_open(ino)?;
        self.open_with_attr(ino, flags, dir, attr, rev, Some(map))
    }

    /// What a non-truncating open of a regular file needs, its lock held: the map kept at
    /// its last close here and its cached attributes when the lock has been held since
    /// (nobody changed either without taking the lock from us first, and this node's own
    /// changes drop the kept map), else both read from etcd.
    pub(super) fn attr_and_map_for_open(
        &self,
        ino: u64,
    ) -> Result<(InodeAttr, i64, MapAtOpen), Errno> {
        let gen = self.caches.blocks_gen();
        if let Some(granted) = self.locks.granted_rev(ino) {
            let kept = self
                .caches
                .take_closed_map(ino)
                .filter(|m| m.granted_rev == granted);
            let attr = self
                .caches
                .attr_at(ino)
                .filter(|(a, _)| a.kind == FileType::Regular);
            if let (Some(kept), Some((attr, rev))) = (kept, attr) {
                self.caches
                    .n
                    .maps_kept_at_close
                    .fetch_add(1, Ordering::Relaxed);
                let map = MapAtOpen {
                    extents: kept.extents,
                    more: false,
                    gen,
                };
                return Ok((attr, rev, map));
            }
        }
        self.get_attr_and_map(ino)
    }

    /// Keeps the map of a file closed here for its next open ([`Caches::stash_closed_map`]):
    /// only when nothing changed any file's extents since `gen` was taken, before the file
    /// left the open-file table (where every change reaches its map), under the grant it
    /// was taken under.
    fn keep_closed_map(&self, st: &FileState, gen: u64, granted: Option<i64>) {
        let Some(granted_rev) = granted else { return };
        let (extents, keys) = {
            let f = st.lock();
            if f.pending.is_some() || f.orphaned {
                return;
            }
            match &f.extents {
                Some(e) => (e.clone(), f.full_map_record()),
                None => return,
            }
        };
        let map = cache::ClosedMap {
            extents,
            granted_rev,
            keys,
        };
        self.caches.stash_closed_map(st.ino, map, gen);
    }

    /// The extent keys kept with the map of `ino` at its last close here, taken (an
    /// unlink of it follows), when this node still holds the lock it was kept under.
    pub(super) fn closed_map_keys(&self, ino: u64) -> Option<Vec<meta::codec::Extent>> {
        let granted = self.locks.granted_rev(ino)?;
        self.caches
            .take_closed_map(ino)
            .filter(|m| m.granted_rev == granted)
            .and_then(|m| m.keys)
    }

    /// A file's attributes and extent map, read at one revision for its open (the
    /// attributes go to the caches as [`Inner::get_attr_at`]'s do).
    pub(super) fn get_attr_and_map(&self, ino: u64) -> Result<(InodeAttr, i64, MapAtOpen), Errno> {
        let gen = self.caches.blocks_gen();
        let r = self
            .meta
            .get_inode_with_extents_at(Ino(ino), files::EXTENTS_CACHED_MAX)
            .and_then(|t| t.wait())
            .map_err(|e| errno::meta(&e))?;
        let attr = r.attr.ok_or(Errno::ENOENT)?;
        self.caches.fill_attr(&attr, r.revision.0);
        let map = MapAtOpen {
            extents: r.extents.iter().map(FileExtent::from).collect(),
            more: r.more,
            gen,
        };
        Ok((attr, r.revision.0, map))
    }

    pub(super) fn open_with_attr(
        &self,
        ino: u64,
        flags: u32,
        dir: bool,
        attr: InodeAttr,
        rev: i64,
        map: Option<MapAtOpen>,
    ) -> Result<Done, Errno> {
        if dir {
            if attr.kind != FileType::Directory {
                return Err(Errno::ENOTDIR);
            }
            let mut dirs = lock(&self.dirs);
            if dirs.len() >= DIR_HANDLES_MAX {
                return Err(Errno::EMFILE);
            }
            let fh = self.new_fh();
            dirs.insert(fh, DirHandle::default());
            // The kernel keeps what a listing read and serves the next from it (a warm
            // `ls -f` of 100,000 names read them all from etcd again: 30x ext4). It
            // drops that copy on its own changes of the directory, when an opendir
            // finds the mtime moved, and when the watch tells it of another node's name
            // change there (`watch::apply_event`): the names keep the watch's bound.
            return Ok(done_bytes(&OpenOut {
                fh,
                open_flags: abi::FOPEN_CACHE_DIR | abi::FOPEN_KEEP_CACHE,
                backing_id: 0,
            }));
        }
        if attr.kind == FileType::Directory {
            return Err(Errno::EISDIR);
        }
        let fh = self.new_fh();
        let mut open_flags = 0;
        if attr.kind == FileType::Regular {
            // The open record first: from its commit on, no node frees the file's blocks.
            self.hold_open(ino)?;
            let st = match self.files.open(ino, attr.clone(), rev) {
                Ok(st) => st,
                Err(e) => {
                    self.unhold_open(ino, true);
                    return Err(e);
                }
            };
            if truncates(flags) && attr.size != 0 {
                if let Err(e) = self.truncate(&st, 0, SetAttr::default()) {
                    self.release_file(ino);
                    return Err(e);
                }
            } else if let Some(map) = map {
                self.load_map_at_open(&st, map);
            }
            // The page cache is the cluster lock's: a node that gives the lock up drops
            // it first, so what is cached when a file is opened is current. (Opening
            // O_APPEND files FOPEN_DIRECT_IO, so that their writes hold no page locked
            // while they wait for the lock, was tried: a buffered reader on the same node
            // then read NULs at EOF, tests/posix.rs.)
            open_flags |= abi::FOPEN_KEEP_CACHE;
        }
        Ok(done_bytes(&OpenOut {
            fh,
            open_flags,
            backing_id: 0,
        }))
    }

    /// Drops one open of a regular file; the last close anywhere of an orphan deletes it.
    pub(super) fn release_file(&self, ino: u64) {
        let (orphan, map) = self.release_state_keeping(ino);
        self.unhold_open_keeping(ino, orphan, map);
    }

    /// Drops one use of a file's open state (an open, or a truncate of a file not open,
    /// which holds no open record).
    /// True when this was the last close here of a file known to be unlinked.
    pub(super) fn release_state(&self, ino: u64) -> bool {
        self.release_state_keeping(ino).0
    }

    /// [`Inner::release_state`], and at the last close of a file not unlinked the extent
    /// keys its last commit here left, when they are known from its first on
    /// ([`files::FileInner::full_map_record`]).
    fn release_state_keeping(&self, ino: u64) -> (bool, Option<Vec<meta::codec::Extent>>) {
        // Pending writes commit while the file is still in the table (a failed attempt
        // stays pending for the next trigger); an orphan's are dropped at its last close.
        let dirty = self.files.is_dirty(ino);
        if dirty && !self.files.get(ino).is_some_and(|st| st.lock().orphaned) {
            if let Err(e) = self.sync_pending(ino) {
                log::warn!("committing pending writes of inode {ino} at release: {e}");
            }
        }
        // Taken while the file is still in the table: see `keep_closed_map`.
        let gen = self.caches.blocks_gen();
        let granted = self.locks.granted_rev(ino);
        if let Some(st) = self.files.close(ino) {
            // The last close: nothing retries a change still pending after this.
            let mut f = st.lock();
            if f.orphaned {
                // Its blocks go with it.
                drop(f.held.take());
            } else if let Err(e) = self.write_held_locked(&st, &mut f) {
                log::warn!("writing held blocks of inode {ino} at its last close: {e}");
            }
            for _ in 0..PENDING_RETRIES_MAX {
                if f.pending.is_none() || f.orphaned {
                    break;
                }
                match self.commit_pending_locked(&st, &mut f) {
                    Ok(outs) => {
                        drop(f);
                        outs.iter().for_each(|o| self.after_commit_unlocked(o));
                        f = st.lock();
                    }
                    Err(e) => log::warn!("committing pending writes of inode {ino}: {e}"),
                }
            }
            if let Some(p) = f.pending.take() {
                self.drop_pending(ino, &mut f, p);
            }
            let orphan = f.orphaned;
            drop(f);
            // An orphan is reclaimed by the last close anywhere (`unhold`).
            if orphan {
                let mut f = st.lock();
                f.mtime_dirty = None;
                f.atime_dirty = None;
                f.ctime_dirty = None;
            } else {
                // Before the mtime's commit, which changes no extent (and so leaves the
                // generation and the kept map alone).
                self.keep_closed_map(&st, gen, granted);
                self.persist_mtime(&st);
                return (false, st.lock().full_map_record());
            }
            return (orphan, None);
        }
        (false, None)
    }

    /// Writes a pending in-place-overwrite mtime (and a read's atime). First without the
    /// file's lock, on the condition that the inode is unchanged since the attributes the
    /// times go with: READs and WRITEs of the file go on meanwhile (held across the commit,
    /// the lock stopped them for an etcd round trip at every fsync and close of a file being
    /// overwritten). The times stay pending, shown over the attributes, until the commit is
    /// in, and are cleared then only if no newer ones came meanwhile. Anything that changed
    /// the inode since (a truncate, an explicit utimes, an extending write's commit) fails
    /// the condition, and the times are written again holding the lock, so that they are
    /// ordered with those changes (a utimes clears them; a later write's commit wrote a
    /// later mtime of its own).
    pub(super) fn persist_mtime(&self, st: &FileState) {
        let (mtime, atime, ctime, rev) = {
            let f = st.lock();
            (f.mtime_dirty, f.atime_dirty, f.ctime_dirty, f.attr_rev)
        };
        if mtime.is_none() && atime.is_none() && ctime.is_none() {
            return;
        }
        // 0: the attributes are to be read again (a dropped pending change).
        if rev > 0 {
            self.caches.forget_times(st.ino);
            let m = times_mutation(st.ino, mtime, atime, ctime.is_some(), Some(rev));
            match self.commit_op(m) {
                Err(MetaError::Changed) => {
                    self.data_counters
                        .mtime_commits_relocked
                        .fetch_add(1, Ordering::Relaxed);
                }
                r => {
                    let mut f = st.lock();
                    let r = self.settle_locked(&mut f, r, false);
                    if r.is_ok() {
                        if f.mtime_dirty == mtime {
                            f.mtime_dirty = None;
                        }
                        if f.atime_dirty == atime {
                            f.atime_dirty = None;
                        }
                        if f.ctime_dirty == ctime {
                            f.ctime_dirty = None;
                        }
                    }
                    drop(f);
                    self.times_committed(st.ino, r, atime.is_some());
                    return;
                }
            }
        }
        let mut f = st.lock();
        let (mtime, atime) = (f.mtime_dirty.take(), f.atime_dirty.take());
        let ctime = f.ctime_dirty.take().is_some();
        if mtime.is_none() && atime.is_none() && !ctime {
            return;
        }
        let r = self.commit_locked(&mut f, times_mutation(st.ino, mtime, atime, ctime, None));
        drop(f);
        self.times_committed(st.ino, r, atime.is_some());
    }

    fn times_committed(&self, ino: u64, r: Result<Outcome, Errno>, atime: bool) {
        match r {
            Ok(out) => {
                self.after_commit_unlocked(&out);
                if atime {
                    // Written at close, after the READ that moved it was answered: the
                    // kernel's cached attributes still show the old atime (a stat right
                    // after the close saw it, found by tests/permissions.rs in CI).
                    self.drop_kernel_attrs(ino);
                }
            }
            Err(Errno::ENOENT) => {}
            Err(e) => log::warn!("writing mtime of inode {ino}: {e}"),
        }
    }

    /// Writes a pending in-place-overwrite mtime now (FLUSH, FSYNC).
    pub(super) fn flush_mtime(&self, ino: u64) {
        if let Some(st) = self.files.get(ino) {
            self.persist_mtime(&st);
        }
    }

    /// `datasync` (fdatasync): what reading the data back needs, its blocks on the device
    /// and its extents and size in etcd, but not the mtime of in-place overwrites, which
    /// stays pending for the next FLUSH, fsync or handoff of the file's lock (ext4 leaves
    /// it to its journal likewise). A database that overwrites a preallocated file and
    /// fdatasyncs each commit paid an etcd round trip under the file's lock as well as the
    /// device's flush, and its readers of the file waited through both.
    pub(super) fn fsync(&self, ino: u64, dir: bool, datasync: bool) -> Result<Done, Errno> {
        if dir {
            // A directory's data are its entries, written by the mutations before this
            // barrier; its coalesced timestamps only for fsync, planned from the cached
            // inode (one round trip). SQLite fdatasyncs the directory after creating each
            // rollback journal, and that wrote the directory's mtime: an etcd round trip
            // in every transaction.
            let t = match datasync {
                true => self.meta.flush_mutations(),
                false => self
                    .meta
                    .flush_expecting(Some(Ino(ino)), self.caches.attr(ino)),
            }
            .map_err(|e| errno::meta(&e))?;
            t.wait().map_err(|e| errno::meta(&e))?;
            return Ok(Done::Empty);
        }
        // Pending writes first (their own flush, then their commit); the flush after is
        // for the in-place overwrites since, which commit nothing.
        self.sync_pending(ino)?;
        self.dev.io().flush().map_err(|e| errno::dev(&e))?;
        if datasync {
            return Ok(Done::Empty);
        }
        self.flush_mtime(ino);
        // Every mutation before this one and the file's own coalesced ctime (xattrs), not
        // every directory's coalesced timestamps: with those, a create + write + fsync
        // loop wrote its directory's mtime at each fsync, a read and a transaction more
        // per file (300 files: 301 directory writes, 302 reads).
        let t = self
            .meta
            .flush(Some(Ino(ino)))
            .map_err(|e| errno::meta(&e))?;
        t.wait().map_err(|e| errno::meta(&e))?;
        Ok(Done::Empty)
    }
}

/// The commit of a file's pending overwrite mtime, access time and held ctime (`ctime`);
/// `unchanged_since`: see [`SetAttr::unchanged_since`].
fn times_mutation(
    ino: u64,
    mtime: Option<Timespec>,
    atime: Option<Timespec>,
    ctime: bool,
    unchanged_since: Option<i64>,
) -> Mutation {
    Mutation::SetAttr {
        ino: Ino(ino),
        set: SetAttr {
            mtime: mtime.map(TimeSet::At),
            atime: atime.map(TimeSet::At),
            access: true,
            ctime,
            unchanged_since,
            ..SetAttr::default()
        },
    }
}
