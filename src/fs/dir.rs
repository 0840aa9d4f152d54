//! Directory listings: pages in name order resumed after a name (so a position survives
//! changes), READDIRPLUS filling the caches, and the cookie → name table of each open
//! directory handle (bounded).

use super::*;

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
        let mut after: Option<Vec<u8>> = if offset <= 2 {
            None
        } else {
            Some(self.cookie_name(ino, fh, offset)?)
        };
        let mut remembered = Vec::new();
        'pages: loop {
            let page = self
                .meta
                .list_dir(Ino(ino), after.clone(), DIR_PAGE_ENTRIES)
                .and_then(|t| t.wait())
                .map_err(|e| errno::meta(&e))?;
            // READDIRPLUS: fetch every entry's attributes concurrently.
            let attrs: Vec<Option<InodeAttr>> = if plus {
                let tickets: Vec<_> = page
                    .entries
                    .iter()
                    .map(|e| match self.caches.attr(e.entry.ino.0) {
                        Some(a) => Err(a),
                        None => Ok(self.meta.get_inode_at(e.entry.ino)),
                    })
                    .collect();
                tickets
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
                    .collect()
            } else {
                Vec::new()
            };
            // An open file's own state, with its blocks when its map is loaded; the rest
            // summed from etcd, every file of the page at once.
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
            let mut blocks = Vec::with_capacity(attrs.len());
            for l in local {
                blocks.push(match l {
                    Some(b) => b,
                    None => summed.next().unwrap_or(Ok(None))?,
                });
            }
            for (i, e) in page.entries.iter().enumerate() {
                let typ = dirent_type(e.entry.kind.s_ifmt());
                let fitted = if plus {
                    if !w.fits_plus(e.name.len()) {
                        break 'pages;
                    }
                    match attrs.get(i).and_then(Option::as_ref) {
                        Some((a, _)) => {
                            let b = blocks.get(i).copied().flatten();
                            w.push_plus(
                                &self.entry_out(a, b),
                                e.entry.ino.0,
                                e.cookie,
                                typ,
                                &e.name,
                            )
                        }
                        // Removed since the page was read: skip it.
                        None => true,
                    }
                } else {
                    w.push(e.entry.ino.0, e.cookie, typ, &e.name)
                };
                if !fitted {
                    break 'pages;
                }
                remembered.push((e.cookie, e.name.clone()));
            }
            if !page.more {
                break;
            }
            after = page.entries.last().map(|e| e.name.clone());
        }
        self.remember_cookies(fh, remembered);
        let n = w.finish();
        buf.truncate(n);
        Ok(Done::Bytes(buf))
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
        while scanned < DIR_SCAN_MAX {
            let page = self
                .meta
                .list_dir(Ino(ino), after.take(), DIR_PAGE_ENTRIES)
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
        }
        // The entry is gone; its cookie still orders nothing, so resume from the start
        // would repeat names. Report the end of the directory instead.
        Err(Errno::ENOENT)
    }

    pub(super) fn release_dir(&self, fh: u64) {
        lock(&self.dirs).remove(&fh);
    }
}
