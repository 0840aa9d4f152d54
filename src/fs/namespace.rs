//! Namespace changes: create, mknod/mkdir/symlink, link, unlink, rename, readlink. Each is
//! one etcd mutation whose compares make it atomic against every other node's; its outcome
//! is installed in this node's caches (read-your-writes) by `Inner::commit`.

use super::*;

impl Inner {
    /// Creates a node of any kind; `hold`: a create-and-open, whose open record goes in
    /// the create's transaction (`held.rs`).
    #[allow(
        clippy::too_many_arguments,
        reason = "one call per node kind; a struct would only rename the arguments"
    )]
    pub(super) fn make_node(
        &self,
        h: &abi::InHeader,
        parent: u64,
        name: &[u8],
        kind: FileType,
        mode: u32,
        umask: u32,
        rdev: u64,
        symlink: Option<Vec<u8>>,
        hold: bool,
    ) -> Result<(InodeAttr, i64), Errno> {
        fusedev::names::check_entry_name(name)?;
        if name == b"." || name == b".." {
            return Err(Errno::EEXIST);
        }
        let mut perm = (mode & 0o7777) as u16;
        let mut gid = h.gid;
        // A set-group-id directory passes its group (and, to subdirectories, the bit) on.
        // The cached attributes do: the type never changes, a removed parent fails the
        // create's own compare, and a mode change by another node arrives by the watch.
        let pattr = self.cached_attr(parent)?;
        if pattr.kind != FileType::Directory {
            return Err(Errno::ENOTDIR);
        }
        if pattr.nlink == 0 {
            return Err(Errno::ENOENT);
        }
        if pattr.perm & 0o2000 != 0 {
            gid = pattr.gid;
            if kind == FileType::Directory {
                perm |= 0o2000;
            }
        }
        let creating = (kind == FileType::Regular).then(|| self.locks.creating());
        let out = self.commit(Mutation::Create {
            parent: Ino(parent),
            name: name.to_vec(),
            inode: NewInode {
                kind,
                perm,
                uid: h.uid,
                gid,
                rdev,
                flags: 0,
                // The kernel sends the mode unmasked (FUSE_DONT_MASK): the umask applies
                // only without a default ACL, which the plan decides against etcd.
                inherit: Some(AclInherit {
                    umask: (umask & 0o777) as u16,
                    parent_default: pattr.flags & meta::acl::FLAG_DEFAULT != 0,
                }),
            },
            symlink,
            hold,
        })?;
        if kind == FileType::Regular {
            // Its lock was taken in the create's own transaction.
            self.locks.created(
                out.ino.map_or(0, |i| i.0),
                out.revision.0,
                self.op_session(),
            );
        }
        drop(creating);
        Ok((out.attr.ok_or(Errno::EIO)?, out.revision.0))
    }

    pub(super) fn unlink(&self, parent: u64, name: &[u8], dir: bool) -> Result<Done, Errno> {
        fusedev::names::check_entry_name(name)?;
        if dir && name == b"." {
            return Err(Errno::EINVAL);
        }
        if dir && name == b".." {
            return Err(Errno::ENOTEMPTY);
        }
        // What the caches know lets the pipeline commit without reading first; its
        // compares catch a stale cache and the retry reads etcd.
        let expect = match self.caches.lookup(parent, name) {
            Lookup::Found(entry) => Some(Box::new(UnlinkExpect {
                entry,
                child: self.caches.attr(entry.ino.0),
                parent: if dir { self.caches.attr(parent) } else { None },
                extents: None,
            })),
            Lookup::Absent | Lookup::Unknown { .. } => None,
        };
        let child = expect.as_ref().filter(|_| !dir).map(|e| e.entry.ino.0);
        let unlink = |keep_open: bool, drop_own_hold: bool, map: Option<Vec<_>>| {
            let mut expect = expect;
            if let Some(e) = expect.as_mut().filter(|e| e.child.is_some()) {
                // The keys kept from the file's last close here, with its open record or
                // (closed longer ago, the node still holding its lock) with its map:
                // released as known.
                let ino = e.entry.ino.0;
                e.extents = map.or_else(|| self.closed_map_keys(ino));
            }
            self.commit(Mutation::Unlink {
                parent: Ino(parent),
                name: name.to_vec(),
                dir,
                // Held open here: kept as an orphan without reading the open records
                // (which decide otherwise, every node's).
                keep_open,
                // A record kept only for an open that might follow would make the file an
                // orphan whose space comes back a second later: rm then write got ENOSPC.
                drop_own_hold,
                expect,
            })
        };
        match child {
            Some(ino) => self.unlink_with_own_record(ino, unlink)?,
            None => unlink(false, false, None)?,
        };
        Ok(Done::Empty)
    }

    pub(super) fn rename(
        &self,
        olddir: u64,
        name: &[u8],
        newdir: u64,
        newname: &[u8],
        flags: u32,
    ) -> Result<Done, Errno> {
        fusedev::names::check_entry_name(name)?;
        fusedev::names::check_entry_name(newname)?;
        let mode = match flags {
            0 => RenameMode::Replace,
            abi::RENAME_NOREPLACE => RenameMode::NoReplace,
            abi::RENAME_EXCHANGE => RenameMode::Exchange,
            _ => return Err(Errno::EINVAL),
        };
        if [name, newname].iter().any(|n| *n == b"." || *n == b"..") {
            return Err(Errno::EBUSY);
        }
        if let Lookup::Found(victim) = self.caches.lookup(newdir, newname) {
            self.drop_idle_hold(victim.ino.0);
        }
        self.commit(Mutation::Rename {
            src_parent: Ino(olddir),
            src_name: name.to_vec(),
            dst_parent: Ino(newdir),
            dst_name: newname.to_vec(),
            mode,
            // The plan reads the destination's open records, every node's.
            dst_keep_open: false,
        })?;
        Ok(Done::Empty)
    }

    pub(super) fn link(&self, ino: u64, newparent: u64, name: &[u8]) -> Result<Done, Errno> {
        fusedev::names::check_entry_name(name)?;
        let out = self.commit(Mutation::Link {
            ino: Ino(ino),
            parent: Ino(newparent),
            name: name.to_vec(),
        })?;
        let attr = out.attr.ok_or(Errno::EIO)?;
        let (attr, blocks) = self.shown_attr(attr)?;
        Ok(done_bytes(&self.entry_out(&attr, blocks)))
    }

    pub(super) fn readlink(&self, ino: u64) -> Result<Done, Errno> {
        let t = self
            .meta
            .readlink(Ino(ino))
            .and_then(|t| t.wait())
            .map_err(|e| errno::meta(&e))?;
        t.map(Done::Bytes).ok_or(Errno::EINVAL)
    }

    pub(super) fn create(
        &self,
        h: &abi::InHeader,
        name: &[u8],
        flags: u32,
        mode: u32,
        umask: u32,
    ) -> Result<Done, Errno> {
        let mut held = None;
        let mark = self.held.mark();
        // A file this call creates has no extents: its map is known without a read.
        let gen = self.caches.blocks_gen();
        let made = self.make_node(
            h,
            h.nodeid,
            name,
            FileType::Regular,
            mode,
            umask,
            0,
            None,
            true,
        );
        let created = made.as_ref().ok().map(|(a, _)| a.ino.0);
        if let Some(ino) = created {
            self.held.adopt(ino, &mark);
        }
        let (attr, rev, map) = match made {
            Err(Errno::EEXIST) if flags & libc::O_EXCL as u32 == 0 => {
                // Another creator won; behave as open(2) does.
                let d = self.resolve_one(h.nodeid, name)?.ok_or(Errno::ENOENT)?;
                let mode = if flags & libc::O_TRUNC as u32 != 0 {
                    meta::cachelock::LockMode::Exclusive
                } else {
                    meta::cachelock::LockMode::Shared
                };
                held = self.hold_regular(d.ino.0, mode)?;
                if mode == meta::cachelock::LockMode::Exclusive {
                    let (attr, rev) = self.get_attr_at(d.ino.0)?;
                    (attr, rev, None)
                } else {
                    let (attr, rev, map) = self.get_attr_and_map(d.ino.0)?;
                    (attr, rev, Some(map))
                }
            }
            r => {
                let (attr, rev) = r?;
                let map = MapAtOpen {
                    extents: Vec::new(),
                    more: false,
                    gen,
                };
                (attr, rev, Some(map))
            }
        };
        if attr.kind == FileType::Directory {
            return Err(Errno::EISDIR);
        }
        let open = match self.open_with_attr(attr.ino.0, flags, false, attr.clone(), rev, map) {
            Ok(Done::Bytes(b)) => b,
            r => {
                if let Some(ino) = created {
                    self.unhold_created(ino);
                }
                return Err(r.err().unwrap_or(Errno::EIO));
            }
        };
        // The file may exist already (another creator won, or O_CREAT without O_EXCL),
        // with blocks of its own.
        let (attr, blocks) = self.shown_attr(attr)?;
        let mut b = vec![0u8; size_of::<EntryOut>() + size_of::<OpenOut>()];
        let entry = self.entry_out(&attr, blocks);
        drop(held);
        let o = OpenOut::read_from(&open);
        let n = reply::create(&mut b, &entry, &o).ok_or(Errno::EIO)?;
        b.truncate(n);
        Ok(Done::Bytes(b))
    }
}
