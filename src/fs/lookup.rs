//! Lookup and attributes: answers from the open file's state, the daemon's caches (kept
//! current by the watch), else etcd; absent names as negative entries the kernel may cache
//! (their invalidation is the watch's, and `Inner::names_refused`'s).

use super::*;

/// Extent-map reads one READDIRPLUS puts on etcd at once. Normally the listing's lock
/// grants have read them already; when they had not (caches evicted, the bug fixed in
/// 08f2ddf), a page needed ~190 at once, which on a loaded etcd timed out, were resent,
/// and made h2 reset the connection (`too_many_internal_resets`), breaking the watch.
const BLOCK_READS_IN_FLIGHT: usize = 32;

impl Inner {
    /// Reads an inode's attributes from etcd (blocking a waiter thread) and caches them.
    pub(super) fn get_attr(&self, ino: u64) -> Result<InodeAttr, Errno> {
        self.get_attr_at(ino).map(|(a, _)| a)
    }

    /// [`Inner::get_attr`] with the revision the attributes were read at.
    pub(super) fn get_attr_at(&self, ino: u64) -> Result<(InodeAttr, i64), Errno> {
        match self.meta.get_inode_at(Ino(ino)).and_then(|t| t.wait()) {
            Ok((Some(a), rev)) => {
                self.caches.fill_attr(&a, rev.0);
                Ok((a, rev.0))
            }
            Ok((None, _)) => Err(Errno::ENOENT),
            Err(e) => Err(errno::meta(&e)),
        }
    }

    /// An inode's attributes from the daemon's cache, else etcd. For answers the kernel
    /// caches anyway and for checks of things that never change (the type).
    pub(super) fn cached_attr(&self, ino: u64) -> Result<InodeAttr, Errno> {
        if let Some(a) = self.caches.attr(ino) {
            return Ok(a);
        }
        self.caches.n.attr_misses.fetch_add(1, Ordering::Relaxed);
        self.get_attr(ino)
    }

    /// Attributes for GETATTR: the open file's state, the inode cache, else etcd; with a
    /// regular file's allocated blocks (its cached map, the block cache, else etcd).
    pub(super) fn attr_of(&self, ino: u64) -> Result<(InodeAttr, Option<u64>), Errno> {
        let (a, b) = match self.files.cached_attr(ino) {
            Some(v) => v,
            None => (self.cached_attr(ino)?, None),
        };
        let b = match b {
            Some(b) => Some(b),
            None => self.file_blocks(&a)?,
        };
        Ok((a, b))
    }

    /// Allocated 512-byte blocks known without etcd: `Some(None)` for what is not a
    /// regular file (st_blocks from the size), `None` when etcd must be read.
    pub(super) fn blocks_local(&self, a: &InodeAttr, from_map: Option<u64>) -> Option<Option<u64>> {
        if a.kind != FileType::Regular {
            return Some(None);
        }
        from_map.or_else(|| self.caches.blocks(a.ino.0)).map(Some)
    }

    /// A regular file's allocated 512-byte blocks summed from its extents in etcd (cached
    /// until an extent changes); None for other types.
    pub(super) fn file_blocks(&self, a: &InodeAttr) -> Result<Option<u64>, Errno> {
        self.files_blocks(&[a]).pop().unwrap_or(Ok(None))
    }

    /// `attr` as the kernel must see it, with its blocks: the open state's when the file is
    /// open here (writes pending, times held; its size is never smaller).
    pub(super) fn shown_attr(&self, attr: InodeAttr) -> Result<(InodeAttr, Option<u64>), Errno> {
        let (attr, blocks) = self.files.cached_attr(attr.ino.0).unwrap_or((attr, None));
        let blocks = match blocks {
            Some(b) => Some(b),
            None => self.file_blocks(&attr)?,
        };
        Ok((attr, blocks))
    }

    /// [`Inner::file_blocks`] of several inodes (a READDIRPLUS page), their extents read
    /// from etcd concurrently, at most [`BLOCK_READS_IN_FLIGHT`] at once.
    pub(super) fn files_blocks(&self, attrs: &[&InodeAttr]) -> Vec<Result<Option<u64>, Errno>> {
        attrs
            .chunks(BLOCK_READS_IN_FLIGHT)
            .flat_map(|chunk| self.files_blocks_at_once(chunk))
            .collect()
    }

    fn files_blocks_at_once(&self, attrs: &[&InodeAttr]) -> Vec<Result<Option<u64>, Errno>> {
        type Read =
            Result<meta::pipeline::ticket::Ticket<(Vec<meta::codec::Extent>, bool)>, MetaError>;
        let gen = self.caches.blocks_gen();
        let reads: Vec<Result<Option<u64>, Read>> = attrs
            .iter()
            .map(|a| {
                if a.kind != FileType::Regular {
                    return Ok(None);
                }
                match self.caches.blocks(a.ino.0) {
                    Some(b) => Ok(Some(b)),
                    None => Err(self.meta.extents(a.ino, 0, files::EXTENTS_CACHED_MAX)),
                }
            })
            .collect();
        attrs
            .iter()
            .zip(reads)
            .map(|(a, r)| {
                let t = match r {
                    Ok(known) => return Ok(known),
                    Err(t) => t,
                };
                let (mut list, mut more) = t.and_then(|t| t.wait()).map_err(|e| errno::meta(&e))?;
                let mut b = extent_blocks(&list);
                // A map too large for one read is summed page by page rather than guessed:
                // any guess from the size over-reports a sparse file (issue 12: a 1-byte
                // file at 1 TiB showed 2^31 blocks). Pages read at different revisions
                // may disagree, but a change between them bumps the generation, so such
                // a sum answers this one request and is not cached.
                while more {
                    let Some(from) = list.last().map(meta::codec::Extent::file_end) else {
                        break;
                    };
                    (list, more) = self
                        .meta
                        .extents(a.ino, from, files::EXTENTS_CACHED_MAX)
                        .and_then(|t| t.wait())
                        .map_err(|e| errno::meta(&e))?;
                    b += extent_blocks(&list);
                }
                self.caches.fill_blocks(a.ino.0, b, gen);
                Ok(Some(b))
            })
            .collect()
    }

    /// The answer to a LOOKUP when the caches hold it (no etcd): the name set or entry
    /// of the name, and the child's attributes.
    pub(super) fn lookup_local(&self, parent: u64, name: &[u8]) -> Option<Result<Done, Errno>> {
        if let Err(e) = fusedev::names::check_entry_name(name) {
            return Some(Err(e));
        }
        match self.caches.lookup(parent, name) {
            Lookup::Absent => Some(Ok(self.negative_entry())),
            Lookup::Found(d) => {
                // A regular file's attributes only under its cluster lock.
                let _held = match d.kind {
                    FileType::Regular => Some(
                        self.locks
                            .try_hold(d.ino.0, meta::cachelock::LockMode::Shared)?,
                    ),
                    _ => None,
                };
                // An open file's own state, never the caches' (they lack pending writes);
                // a waiter answers when its lock is held.
                let (attr, blocks) = match self.files.try_open_attr(d.ino.0) {
                    OpenAttr::Attr(a, b) => (a, b),
                    OpenAttr::Busy => return None,
                    OpenAttr::NotOpen => (self.caches.attr(d.ino.0)?, None),
                };
                let blocks = self.blocks_local(&attr, blocks)?;
                Some(Ok(done_bytes(&self.entry_out(&attr, blocks))))
            }
            Lookup::Unknown { .. } => None,
        }
    }

    /// A negative entry: the kernel caches the absence for `negative_timeout`; a create
    /// here or on another node (through the watch) invalidates it.
    pub(super) fn negative_entry(&self) -> Done {
        done_bytes(&EntryOut::negative(self.negative_timeout))
    }

    /// Resolves a name: the caches, else the directory's whole name set in one range
    /// (then later names in it need no etcd), else (a directory over `dir_names_max`)
    /// the one name.
    pub(super) fn resolve(
        &self,
        parent: u64,
        name: &[u8],
    ) -> Result<Option<meta::codec::Dentry>, Errno> {
        let too_big = match self.caches.lookup(parent, name) {
            Lookup::Found(d) => return Ok(Some(d)),
            Lookup::Absent => return Ok(None),
            Lookup::Unknown { too_big } => too_big,
        };
        let n = &self.caches.n;
        n.lookups_etcd.fetch_add(1, Ordering::Relaxed);
        let found = if too_big {
            self.resolve_one(parent, name)?
        } else {
            n.dir_names_misses.fetch_add(1, Ordering::Relaxed);
            let max = self.caches.dir_names_max();
            match self.meta.dir_names(Ino(parent), max).and_then(|t| t.wait()) {
                Ok(set) => {
                    n.dir_names_loads.fetch_add(1, Ordering::Relaxed);
                    let found = set.entries.iter().find(|e| e.name == name).map(|e| e.entry);
                    self.caches.fill_dir(
                        parent,
                        set.entries.into_iter().map(|e| (e.name, e.entry)),
                        set.revision.0,
                    );
                    found
                }
                Err(MetaError::OverLimit { .. }) => {
                    n.dir_names_over_limit.fetch_add(1, Ordering::Relaxed);
                    self.caches.fill_too_big(parent);
                    self.resolve_one(parent, name)?
                }
                Err(e) => return Err(errno::meta(&e)),
            }
        };
        let c = if found.is_some() {
            &n.dentry_misses
        } else {
            &n.negative_misses
        };
        c.fetch_add(1, Ordering::Relaxed);
        Ok(found)
    }

    pub(super) fn resolve_one(
        &self,
        parent: u64,
        name: &[u8],
    ) -> Result<Option<meta::codec::Dentry>, Errno> {
        let (d, rev) = self
            .meta
            .lookup_at(Ino(parent), name.to_vec())
            .and_then(|t| t.wait())
            .map_err(|e| errno::meta(&e))?;
        self.caches.fill_dentry(parent, name, d, rev.0);
        Ok(d)
    }

    pub(super) fn lookup(&self, parent: u64, name: &[u8]) -> Result<Done, Errno> {
        fusedev::names::check_entry_name(name)?;
        let Some(d) = self.resolve(parent, name)? else {
            return Ok(self.negative_entry());
        };
        if d.kind == FileType::Regular && self.locks.held(d.ino.0).is_none() {
            self.share_following(parent, name, d.ino.0);
        }
        let _held = match d.kind {
            FileType::Regular => {
                match self.hold(d.ino.0, meta::cachelock::LockMode::Shared, None) {
                    Ok(h) => Some(h),
                    Err(Errno::ENOENT) => return Ok(self.negative_entry()),
                    Err(e) => return Err(e),
                }
            }
            _ => None,
        };
        let (attr, blocks) = match self.attr_of(d.ino.0) {
            Ok(v) => v,
            // Removed between the two reads: absent now.
            Err(Errno::ENOENT) => return Ok(self.negative_entry()),
            Err(e) => return Err(e),
        };
        Ok(done_bytes(&self.entry_out(&attr, blocks)))
    }

    /// A walk that stats a directory's files after reading it whole (`find`, fts, `du`)
    /// looks each up alone, after the kernel's first READDIRPLUS: each LOOKUP took its
    /// file's lock in its own etcd round trip (39 s for `find -ls` of 5,000 files). After
    /// [`LOOKUP_STREAK`] misses in one directory in ascending order, the directory's names
    /// are read a page at a time, cached, and their files' shared locks taken in bulk
    /// ([`Inner::share_listed`]), so the lookups that follow are answered on the core.
    /// Ascending by name: the page after this name. Ascending by inode number (fts sorts
    /// a directory of over 10,000 entries by inode before it stats them): the pages from
    /// the directory's start, one more per miss past them, until the walk is covered.
    /// Lookups in no order start the count again, so random opens in a big directory
    /// take no locks they do not need.
    fn share_following(&self, parent: u64, name: &[u8], ino: u64) {
        let after = {
            let mut streaks = lock(&self.lookup_streaks);
            if streaks.len() >= LOOKUP_STREAKS_MAX && !streaks.contains_key(&parent) {
                streaks.clear();
            }
            let s = streaks.entry(parent).or_default();
            let by_name = s.last.as_deref().is_some_and(|l| l < name);
            let by_ino = s.last_ino < ino;
            s.count = if by_name || by_ino { s.count + 1 } else { 0 };
            s.last = Some(name.to_vec());
            s.last_ino = ino;
            let covered = s.covered.as_ref().is_some_and(|(from, through)| {
                from.as_deref().is_none_or(|f| f <= name) && name <= through.as_slice()
            });
            if s.count < LOOKUP_STREAK || covered {
                return;
            }
            if by_name {
                s.covered = None;
                Some(name.to_vec())
            } else {
                s.covered.as_ref().map(|(_, through)| through.clone())
            }
        };
        // This page now, the next ones on the share thread while the walk goes on: each
        // page waited for here was a stall of the walk (`find -ls` of 100,000).
        let Some((last, more)) = self.share_page(parent, after) else {
            return;
        };
        if more {
            let _ = self.share_later(Box::new(move |i: &Inner| {
                let mut after = last;
                for _ in 0..LOOKUP_PAGES_AHEAD {
                    match i.share_page(parent, Some(after)) {
                        Some((last, true)) => after = last,
                        _ => break,
                    }
                }
            }));
        }
    }

    /// Reads the page of `parent`'s names after `after`, caches them, takes their
    /// files' shared locks and extends the streak's covered names through the page's
    /// last. Its last name and whether more follow (`None`: nothing read).
    fn share_page(&self, parent: u64, after: Option<Vec<u8>>) -> Option<(Vec<u8>, bool)> {
        let page = self
            .meta
            .list_dir(Ino(parent), after.clone(), DIR_SHARE_AHEAD)
            .and_then(|t| t.wait())
            .ok()?;
        let last = page.entries.last()?.name.clone();
        if let Some(s) = lock(&self.lookup_streaks).get_mut(&parent) {
            let from = match s.covered.take() {
                Some((from, _)) => from,
                None => after,
            };
            s.covered = Some((from, last.clone()));
        }
        let mut regular = Vec::new();
        for e in &page.entries {
            self.caches
                .fill_dentry(parent, &e.name, Some(e.entry), page.revision.0);
            if e.entry.kind == FileType::Regular && self.locks.held(e.entry.ino.0).is_none() {
                regular.push(e.entry.ino.0);
            }
        }
        self.share_listed(&regular);
        Some((last, page.more))
    }

    pub(super) fn getattr(&self, ino: u64) -> Result<Done, Errno> {
        let _held = self.hold_regular(ino, meta::cachelock::LockMode::Shared)?;
        let (attr, blocks) = self.attr_of(ino)?;
        Ok(done_bytes(&self.attr_out(&attr, blocks)))
    }
}
