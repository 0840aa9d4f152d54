//! Directory listings: pages in name order resumed after a name (so a position survives
//! changes), READDIRPLUS filling the caches, and the cookie → name table of each open
//! directory handle (bounded).

use super::*;
use meta::reader::{DirEntry, DirPage};
use std::{collections::VecDeque, time::Instant};

impl Inner {
    pub(super) fn readdir(
        &self,
        ino: u64,
        fh: u64,
        offset: u64,
        size: u32,
        plus: bool,
    ) -> Result<Done, Errno> {
        if offset == 0 {
            self.note_readdir(ino);
        }
        let size = size as usize;
        let mut buf = vec![0u8; size];
        let mut w = DirentWriter::new(&mut buf, size);
        let dir_type = dirent_type(libc::S_IFDIR);
        if offset < 1 {
            let ok = if plus {
                w.push_plus(&EntryOut::default(), ino, 1, dir_type, b".")
            } else {
                w.push(ino, 1, dir_type, b".")
            };
            if !ok {
                let n = w.finish();
                buf.truncate(n);
                return Ok(Done::Bytes(buf));
            }
        }
        if offset < 2 {
            let parent = self
                .meta
                .dir_parent(Ino(ino))
                .and_then(|t| t.wait())
                .map_err(|e| errno::meta(&e))?
                .map_or(ino, |p| p.0);
            let ok = if plus {
                w.push_plus(&EntryOut::default(), parent, 2, dir_type, b"..")
            } else {
                w.push(parent, 2, dir_type, b"..")
            };
            if !ok {
                let n = w.finish();
                buf.truncate(n);
                return Ok(Done::Bytes(buf));
            }
        }
        let mut ahead = match self.take_lookahead(fh, offset) {
            Some(a) => a,
            None => Lookahead::start(
                offset.max(2),
                match offset {
                    0..=2 => None,
                    _ => Some(self.cookie_name(ino, fh, offset)?),
                },
            ),
        };
        if plus {
            ahead.plus_calls = ahead.plus_calls.saturating_add(1);
        }
        let mut remembered = Vec::new();
        loop {
            if ahead.entries.is_empty() {
                if !ahead.more {
                    break;
                }
                self.read_ahead(ino, &mut ahead)?;
                continue;
            }
            // Only the entries that fit get their attributes read.
            let record_len = |n: usize| match plus {
                true => reply::direntplus_len(n),
                false => reply::dirent_len(n),
            };
            let mut room = w.room();
            let fit = ahead
                .entries
                .iter()
                .take_while(|e| {
                    let fits = record_len(e.name.len()) <= room;
                    room = room.saturating_sub(record_len(e.name.len()));
                    fits
                })
                .count();
            if fit == 0 {
                break;
            }
            if plus {
                self.share_ahead(ino, &mut ahead, fit)?;
            }
            let batch: Vec<DirEntry> = ahead.entries.drain(..fit).collect();
            ahead.drained(fit);
            ahead.bytes -= batch.iter().map(|e| e.name.len()).sum::<usize>();
            let out = if plus {
                self.entries_plus(&batch)?
            } else {
                batch.iter().map(|_| None).collect()
            };
            for (e, a) in batch.iter().zip(out) {
                let typ = dirent_type(e.entry.kind.s_ifmt());
                let pushed = match (plus, a) {
                    (false, _) => w.push(e.entry.ino.0, e.cookie, typ, &e.name),
                    (true, Some(entry)) => {
                        let entry = self.plus_record(entry, e.entry.kind);
                        w.push_plus(&entry, e.entry.ino.0, e.cookie, typ, &e.name)
                    }
                    // Removed since the page was read: skipped.
                    (true, None) => continue,
                };
                if !pushed {
                    // Cannot happen (the batch was sized to fit). The kernel asks again at
                    // the last cookie served, which is then looked up by name.
                    self.remember_cookies(fh, remembered);
                    let n = w.finish();
                    buf.truncate(n);
                    return Ok(Done::Bytes(buf));
                }
                ahead.resume = e.cookie;
                remembered.push((e.cookie, e.name.clone()));
            }
        }
        self.remember_cookies(fh, remembered);
        self.keep_lookahead(fh, ahead);
        let n = w.finish();
        buf.truncate(n);
        Ok(Done::Bytes(buf))
    }

    /// READDIRPLUS records of `batch` (None: removed since its page was read), every
    /// missing attribute and block count read from etcd concurrently.
    fn entries_plus(&self, batch: &[DirEntry]) -> Result<Vec<Option<EntryOut>>, Errno> {
        let tickets: Vec<_> = batch
            .iter()
            .map(|e| match self.caches.attr(e.entry.ino.0) {
                Some(a) => Err(a),
                None => Ok(self.meta.get_inode_at(e.entry.ino)),
            })
            .collect();
        let attrs: Vec<Option<InodeAttr>> = tickets
            .into_iter()
            .map(|t| match t {
                Err(a) => Some(a),
                Ok(t) => {
                    let (a, rev) = t.ok().and_then(|t| t.wait().ok())?;
                    let a = a?;
                    self.caches.fill_attr(&a, rev.0);
                    Some(a)
                }
            })
            .collect();
        // An open file's own state, with its blocks when its map is loaded; the rest
        // summed from etcd, every file of the batch at once.
        let attrs: Vec<Option<(InodeAttr, Option<u64>)>> = attrs
            .into_iter()
            .map(|a| a.map(|a| self.files.cached_attr(a.ino.0).unwrap_or((a, None))))
            .collect();
        let local: Vec<Option<Option<u64>>> = attrs
            .iter()
            .map(|a| {
                a.as_ref()
                    .map_or(Some(None), |(a, b)| self.blocks_local(a, *b))
            })
            .collect();
        let unknown: Vec<&InodeAttr> = attrs
            .iter()
            .zip(&local)
            .filter_map(|(a, l)| a.as_ref().filter(|_| l.is_none()).map(|(a, _)| a))
            .collect();
        let mut summed = self.files_blocks(&unknown).into_iter();
        let mut out = Vec::with_capacity(attrs.len());
        for (a, l) in attrs.into_iter().zip(local) {
            let blocks = match l {
                Some(b) => b,
                None => summed.next().unwrap_or(Ok(None))?,
            };
            out.push(a.map(|(a, _)| self.entry_out(&a, blocks)));
        }
        Ok(out)
    }

    /// The READDIRPLUS record of `entry`: empty (node id 0, which the kernel skips) when
    /// a READDIRPLUS gave the kernel this inode whole within half the entry and attribute
    /// timeouts, since when it did not FORGET it and, a regular file, its lock stayed
    /// held (giving a lock up drops the kernel's attributes). A whole record of an inode
    /// the kernel has makes it drop the inode's cached ACLs and list on with READDIRPLUS:
    /// each warm `ls -l` asked every file's ACL again (20,000 GETXATTRs for 20,000 files,
    /// found counting requests of benches/listing.sh). An empty record is never wrong:
    /// where the kernel lacks the name after all it asks with a LOOKUP.
    fn plus_record(&self, entry: EntryOut, kind: FileType) -> EntryOut {
        let ino = entry.nodeid;
        let keep = self.entry_timeout.min(self.attr_timeout) / 2;
        let cacheable = entry.attr_valid > 0 || entry.attr_valid_nsec > 0;
        if keep.is_zero() || ino == 0 || !cacheable {
            return entry;
        }
        let now = Instant::now();
        let mut given = lock(&self.plus_given);
        if let Some(&at) = given.get(&ino) {
            let lock_kept = kind != FileType::Regular
                || self.locks.held_since(ino).is_some_and(|since| since <= at);
            if lock_kept && now.saturating_duration_since(at) < keep {
                return EntryOut::default();
            }
        }
        if given.len() >= PLUS_GIVEN_MAX {
            given.clear();
        }
        given.insert(ino, now);
        entry
    }

    /// The kernel dropped these inodes: a READDIRPLUS gives them whole again.
    pub(super) fn forget_plus_given(&self, inos: impl Iterator<Item = u64>) {
        let mut given = lock(&self.plus_given);
        if given.is_empty() {
            return;
        }
        for ino in inos {
            given.remove(&ino);
        }
    }

    /// Takes the shared locks of the regular files among the next `fit` entries, those of
    /// the reply being built, unless done already, and from the listing's second
    /// READDIRPLUS on (the first may be `ls -f`'s only one) those of the
    /// [`DIR_GRANTED_AHEAD`] entries after them, in the background in chunks growing from
    /// [`DIR_SHARE_CHUNK`]: etcd grants them in transactions that each wait for its disk,
    /// so many at once cost about what one does, and meanwhile the kernel and the caller
    /// work through the entries before them. Reaching entries whose grant is under way
    /// waits for it.
    fn share_ahead(&self, ino: u64, ahead: &mut Lookahead, fit: usize) -> Result<(), Errno> {
        while let Some((from, job)) = ahead.pending.front() {
            if *from >= fit {
                break;
            }
            job.finish(self);
            ahead.pending.pop_front();
        }
        if ahead.shared < fit {
            let end = ahead.entries.len().min(fit.max(DIR_SHARE_FIRST));
            self.share_listed(&self.unheld(ahead, ahead.shared..end));
            ahead.shared = end;
        }
        if ahead.plus_calls < 2 {
            return Ok(());
        }
        // One page of names at most per call: each read waits for etcd, which is granting.
        let mut read = false;
        while ahead.shared < fit + DIR_GRANTED_AHEAD {
            // The names first: the grant needs their inodes.
            if ahead.more && !read && ahead.entries.len() < ahead.shared + DIR_SHARE_CHUNK_MAX {
                read = true;
                self.read_ahead(ino, ahead)?;
                continue;
            }
            let chunk = DIR_SHARE_CHUNK_MAX.min(DIR_SHARE_CHUNK << ahead.chunks.min(8));
            let end = ahead.entries.len().min(ahead.shared + chunk);
            // A chunk cut short by names not read yet waits for them (a small grant of
            // inodes far apart reads each one alone).
            if end == ahead.shared || (ahead.more && end < ahead.shared + chunk) {
                break;
            }
            let unheld = self.unheld(ahead, ahead.shared..end);
            if !unheld.is_empty() {
                let Some(job) = self.share_listed_later(unheld) else {
                    // The share thread is busy: granted when reached.
                    break;
                };
                ahead.pending.push_back((ahead.shared, job));
                ahead.chunks += 1;
            }
            ahead.shared = end;
        }
        Ok(())
    }

    /// Reads the page of directory `ino`'s names after `ahead`'s last into it.
    fn read_ahead(&self, ino: u64, ahead: &mut Lookahead) -> Result<(), Errno> {
        let page = self
            .meta
            .list_dir(Ino(ino), ahead.last.clone(), ahead.page)
            .and_then(|t| t.wait())
            .map_err(|e| errno::meta(&e))?;
        ahead.refill(page);
        Ok(())
    }

    /// The regular files among `ahead`'s entries `range` whose locks this node lacks.
    fn unheld(&self, ahead: &Lookahead, range: std::ops::Range<usize>) -> Vec<u64> {
        ahead
            .entries
            .range(range)
            .filter(|e| e.entry.kind == FileType::Regular)
            .map(|e| e.entry.ino.0)
            .filter(|&ino| self.locks.held(ino).is_none())
            .collect()
    }

    /// The handle's lookahead if the kernel resumes where it left off (`offset` is the
    /// last cookie served); a rewind or a seek drops it.
    fn take_lookahead(&self, fh: u64, offset: u64) -> Option<Lookahead> {
        let mut dirs = lock(&self.dirs);
        let h = dirs.get_mut(&fh)?;
        let a = h.ahead.take()?;
        self.dir_ahead_bytes.fetch_sub(a.bytes, Ordering::Relaxed);
        (a.resume == offset).then_some(a)
    }

    /// Keeps what was read ahead for the handle's next READDIR, within the budget.
    fn keep_lookahead(&self, fh: u64, ahead: Lookahead) {
        // Kept even when finished: the kernel's last READDIR, which finds the end, is
        // then answered without etcd.
        let total = self
            .dir_ahead_bytes
            .fetch_add(ahead.bytes, Ordering::Relaxed);
        if total + ahead.bytes > DIR_AHEAD_BYTES_MAX {
            self.dir_ahead_bytes
                .fetch_sub(ahead.bytes, Ordering::Relaxed);
            return;
        }
        match lock(&self.dirs).get_mut(&fh) {
            Some(h) => h.ahead = Some(ahead),
            None => {
                self.dir_ahead_bytes
                    .fetch_sub(ahead.bytes, Ordering::Relaxed);
            }
        }
    }

    pub(super) fn remember_cookies(&self, fh: u64, names: Vec<(u64, Vec<u8>)>) {
        let mut dirs = lock(&self.dirs);
        if let Some(h) = dirs.get_mut(&fh) {
            if h.names.len() + names.len() > DIR_COOKIES_MAX {
                h.names.clear();
            }
            h.names.extend(names);
        }
    }

    /// The name a readdir cookie stands for: from the handle, else by scanning the
    /// directory for the name with that hash (an old telldir position).
    pub(super) fn cookie_name(&self, ino: u64, fh: u64, cookie: u64) -> Result<Vec<u8>, Errno> {
        if let Some(n) = lock(&self.dirs).get(&fh).and_then(|h| h.names.get(&cookie)) {
            return Ok(n.clone());
        }
        let mut after = None;
        let mut scanned = 0;
        // Pages grow as a listing's lookahead does: a cookie near the start costs one
        // small read, one deep in a big directory a few large ones. The kernel asks for an
        // arbitrary cookie on a new handle whenever part of its cached listing was
        // reclaimed, and with 256 entries a page the scan of 100,000 entries took 10 s.
        let mut page_entries = DIR_PAGE_ENTRIES;
        while scanned < DIR_SCAN_MAX {
            let page = self
                .meta
                .list_dir(Ino(ino), after.take(), page_entries)
                .and_then(|t| t.wait())
                .map_err(|e| errno::meta(&e))?;
            if let Some(e) = page.entries.iter().find(|e| e.cookie == cookie) {
                return Ok(e.name.clone());
            }
            scanned += page.entries.len();
            if !page.more {
                break;
            }
            after = page.entries.last().map(|e| e.name.clone());
            page_entries = next_page_entries(page_entries);
        }
        // The entry is gone; its cookie still orders nothing, so resume from the start
        // would repeat names. Report the end of the directory instead.
        Err(Errno::ENOENT)
    }

    pub(super) fn release_dir(&self, fh: u64) {
        if let Some(a) = lock(&self.dirs).remove(&fh).and_then(|h| h.ahead) {
            self.dir_ahead_bytes.fetch_sub(a.bytes, Ordering::Relaxed);
        }
    }
}

/// The size of the page read after one of `entries`: listings and cookie scans start
/// small and grow, so a short directory costs one small read and a big one a few large.
fn next_page_entries(entries: usize) -> usize {
    (entries * 4).min(DIR_PAGE_ENTRIES_MAX)
}

/// A listing's position and the entries of its last etcd page not yet served: the next
/// READDIR that resumes at `resume` is answered from them, or from the page after `last`,
/// so a listing reads each entry from etcd once.
pub(super) struct Lookahead {
    /// The cookie the kernel passes to continue after what was served.
    resume: u64,
    entries: VecDeque<DirEntry>,
    /// etcd may hold entries after `last`.
    more: bool,
    /// The name the next page starts after (`None`: the directory's first).
    last: Option<Vec<u8>>,
    /// Entries of the next page read.
    page: usize,
    /// Bytes of the names in `entries`.
    bytes: usize,
    /// Entries at the front of `entries` whose locks READDIRPLUS has taken (or tried, or
    /// is taking in the background).
    shared: usize,
    /// The background grants under way, each of the entries from its index to the next
    /// one's (the last one's to `shared`), in order.
    pending: VecDeque<(usize, Arc<super::locks::ShareAhead>)>,
    /// READDIRPLUS calls served from this lookahead.
    plus_calls: u32,
    /// Background grants started.
    chunks: u32,
}

impl Lookahead {
    fn start(resume: u64, after: Option<Vec<u8>>) -> Self {
        Lookahead {
            resume,
            entries: VecDeque::new(),
            more: true,
            last: after,
            page: DIR_PAGE_ENTRIES,
            bytes: 0,
            shared: 0,
            pending: VecDeque::new(),
            plus_calls: 0,
            chunks: 0,
        }
    }

    /// The first `n` entries were served.
    fn drained(&mut self, n: usize) {
        self.shared = self.shared.saturating_sub(n);
        for (from, _) in &mut self.pending {
            *from = from.saturating_sub(n);
        }
    }

    fn refill(&mut self, page: DirPage) {
        // An empty page ends the listing even if etcd claims more (never loop on it).
        self.more = page.more && !page.entries.is_empty();
        if let Some(e) = page.entries.last() {
            self.last = Some(e.name.clone());
        }
        self.bytes += page.entries.iter().map(|e| e.name.len()).sum::<usize>();
        self.entries.extend(page.entries);
        self.page = next_page_entries(self.page);
    }
}
