//! Dispatch: every FUSE request to its handler. What needs nothing from etcd is answered
//! on the core (READ of a file whose map is cached, whole-block overwrites, GETATTR of an
//! open file, FORGET); everything else goes to a waiter thread (`pool`), or runs inline
//! when the context cannot defer (tests, the sideband reader).

use super::rw::WriteMode;
use super::*;
use meta::cachelock::LockMode;

/// The bytes whose kernel pages a READ or WRITE holds locked while it waits for the
/// file's lock: none for direct I/O, which bypasses the page cache.
fn cached_io(flags: u32, off: u64, len: u64) -> Option<locks::Range> {
    (flags & libc::O_DIRECT as u32 == 0).then(|| (off, off.saturating_add(len)))
}

/// Whether a request would change the filesystem: refused with EROFS on a read-only
/// mount. The kernel refuses these itself on an `MS_RDONLY` mount; the daemon does not
/// rely on it (a bind mount made writable, a kernel that forwards one anyway).
fn changes_fs(op: &Operation<'_>) -> bool {
    match op {
        Operation::Setattr(_)
        | Operation::Symlink { .. }
        | Operation::Mknod { .. }
        | Operation::Mkdir { .. }
        | Operation::Unlink { .. }
        | Operation::Rmdir { .. }
        | Operation::Rename { .. }
        | Operation::Link { .. }
        | Operation::Write { .. }
        | Operation::Setxattr { .. }
        | Operation::Removexattr { .. }
        | Operation::Create { .. }
        | Operation::Fallocate { .. }
        | Operation::CopyFileRange { .. }
        | Operation::Tmpfile { .. } => true,
        Operation::Open { flags, .. } => {
            let f = *flags as i32;
            f & libc::O_ACCMODE != libc::O_RDONLY || f & libc::O_TRUNC != 0
        }
        _ => false,
    }
}

impl EtcFs {
    /// Runs `f` on a waiter when the reply can be deferred, else inline.
    /// The operation runs under the session current when the request arrived
    /// (`fence.rs`): it commits under that one or fails.
    fn offload<F>(&self, ctx: &RequestCtx<'_>, out: &mut [u8], f: F) -> Reply
    where
        F: FnOnce(&Inner) -> Result<Done, Errno> + Send + 'static,
    {
        let op = self.inner.begin_op();
        match ctx.defer() {
            Some(d) => {
                self.pool.run(d, move |i| {
                    let _op = op.enter();
                    f(i)
                });
                Reply::Deferred
            }
            None => {
                let _op = op.enter();
                to_reply(f(&self.inner), out)
            }
        }
    }

    /// A request on a file handle opened under a session since fenced: EIO, as for a
    /// lost lock (its locks, open record and writes not yet committed are gone).
    fn stale_handle(&self, fh: u64) -> bool {
        !self.inner.fh_current(fh)
    }

    fn dispatch(&self, ctx: &RequestCtx<'_>, req: &Request<'_>, out: &mut [u8]) -> Reply {
        let h = req.header;
        let ino = h.nodeid;
        if self.inner.read_only && changes_fs(&req.op) {
            return Reply::Error(Errno::EROFS);
        }
        match req.op {
            Operation::Lookup { name } => {
                // Answered on the core when the caches know the name (and its inode).
                if let Some(r) = self.inner.lookup_local(ino, name) {
                    return to_reply(r, out);
                }
                let name = name.to_vec();
                self.offload(ctx, out, move |i| i.lookup(ino, &name))
            }
            // No per-inode table to shrink: see the module docs.
            Operation::Forget { .. } => {
                self.inner.forget_plus_given(std::iter::once(ino));
                Reply::None
            }
            Operation::BatchForget { forgets } => {
                self.inner
                    .forget_plus_given(forgets.iter().map(|f| f.nodeid));
                Reply::None
            }
            Operation::Getattr { .. } => {
                let local = match self.inner.files.try_open_attr(ino) {
                    OpenAttr::Attr(a, b) => Some((a, b)),
                    // Never the caches' attributes for an open file: they lack its
                    // pending writes.
                    OpenAttr::Busy => None,
                    OpenAttr::NotOpen => self.inner.caches.attr(ino).map(|a| (a, None)),
                };
                // A regular file's attributes only under its lock.
                let held = local.as_ref().and_then(|(a, _)| match a.kind {
                    FileType::Regular => self.inner.locks.try_hold(ino, LockMode::Shared).map(Some),
                    _ => Some(None),
                });
                if let (Some((a, b)), Some(_held)) = (local, held) {
                    if let Some(b) = self.inner.blocks_local(&a, b) {
                        return to_reply(Ok(done_bytes(&self.inner.attr_out(&a, b))), out);
                    }
                }
                self.offload(ctx, out, move |i| i.getattr(ino))
            }
            Operation::Setattr(a) if a.valid & abi::FATTR_FH != 0 && self.stale_handle(a.fh) => {
                Reply::Error(Errno::EIO)
            }
            Operation::Setattr(a) => self.offload(ctx, out, move |i| {
                let _held = i.hold_regular(ino, LockMode::Exclusive)?;
                i.setattr(ino, &a)
            }),
            Operation::Readlink => self.offload(ctx, out, move |i| i.readlink(ino)),
            Operation::Symlink { name, target } => {
                let (name, target) = (name.to_vec(), target.to_vec());
                self.offload(ctx, out, move |i| {
                    if target.is_empty() || target.len() > meta::types::SYMLINK_LEN_MAX {
                        return Err(Errno::ENAMETOOLONG);
                    }
                    let made = i.make_node(
                        &h,
                        ino,
                        &name,
                        FileType::Symlink,
                        0o777,
                        0,
                        0,
                        Some(target),
                        false,
                    );
                    let a = i.names_refused(made, &[Errno::EEXIST])?.0;
                    Ok(done_bytes(&i.entry_out(&a, None)))
                })
            }
            Operation::Mknod {
                name,
                mode,
                rdev,
                umask,
            } => {
                let name = name.to_vec();
                self.offload(ctx, out, move |i| {
                    let kind = file_type_of(mode)?;
                    let made = i.make_node(
                        &h,
                        ino,
                        &name,
                        kind,
                        mode,
                        umask,
                        u64::from(rdev),
                        None,
                        false,
                    );
                    let a = i.names_refused(made, &[Errno::EEXIST])?.0;
                    Ok(done_bytes(&i.entry_out(&a, None)))
                })
            }
            Operation::Mkdir { name, mode, umask } => {
                let name = name.to_vec();
                self.offload(ctx, out, move |i| {
                    let made = i.make_node(
                        &h,
                        ino,
                        &name,
                        FileType::Directory,
                        mode,
                        umask,
                        0,
                        None,
                        false,
                    );
                    let a = i.names_refused(made, &[Errno::EEXIST])?.0;
                    Ok(done_bytes(&i.entry_out(&a, None)))
                })
            }
            Operation::Unlink { name } => {
                let name = name.to_vec();
                self.offload(ctx, out, move |i| {
                    i.names_refused(i.unlink(ino, &name, false), &[Errno::ENOENT])
                })
            }
            Operation::Rmdir { name } => {
                let name = name.to_vec();
                self.offload(ctx, out, move |i| {
                    i.names_refused(i.unlink(ino, &name, true), &[Errno::ENOENT])
                })
            }
            Operation::Rename {
                newdir,
                name,
                newname,
                flags,
            } => {
                let (name, newname) = (name.to_vec(), newname.to_vec());
                self.offload(ctx, out, move |i| {
                    let r = i.rename(ino, &name, newdir, &newname, flags);
                    i.names_refused(r, &[Errno::ENOENT, Errno::EEXIST])
                })
            }
            Operation::Link { oldnodeid, name } => {
                let name = name.to_vec();
                self.offload(ctx, out, move |i| {
                    i.names_refused(i.link(oldnodeid, ino, &name), &[Errno::EEXIST])
                })
            }
            Operation::Open { flags, .. } => {
                self.offload(ctx, out, move |i| i.open_file(ino, flags, false))
            }
            Operation::Opendir { .. } => self.offload(ctx, out, move |i| i.open_file(ino, 0, true)),
            Operation::Read { fh, .. }
            | Operation::Write { fh, .. }
            | Operation::Flush { fh, .. }
            | Operation::Fsync { fh, .. }
            | Operation::Fallocate { fh, .. }
            | Operation::Lseek { fh, .. }
            | Operation::Getlk { fh, .. }
            | Operation::Setlk { fh, .. }
            | Operation::Setlkw { fh, .. }
                if self.stale_handle(fh) =>
            {
                Reply::Error(Errno::EIO)
            }
            Operation::Release { fh, .. } if self.stale_handle(fh) => {
                // Nothing to close: the fence dropped the open and its record.
                let _ = self.inner.plocks.take_fh(fh);
                Reply::Bytes(0)
            }
            Operation::Read {
                offset,
                size,
                flags,
                ..
            } => {
                // Fast path: the extent map is cached and nobody holds the file.
                let counters = &self.inner.data_counters;
                if let Some(r) = self.read_fast(ino, offset, size, out) {
                    counters.reads_on_core.fetch_add(1, Ordering::Relaxed);
                    return r;
                }
                counters.reads_on_waiter.fetch_add(1, Ordering::Relaxed);
                let out_len = out.len();
                let pages = cached_io(flags, offset, u64::from(size));
                self.offload(ctx, out, move |i| {
                    let _held = i.hold(ino, LockMode::Shared, pages)?;
                    i.read(ino, offset, size, out_len)
                })
            }
            Operation::Write {
                offset,
                data,
                write_flags,
                flags,
                ..
            } => {
                let kill = write_flags & abi::FUSE_WRITE_KILL_SUIDGID != 0;
                let append = flags & libc::O_APPEND as u32 != 0;
                let counters = &self.inner.data_counters;
                // Writes the application asked to reach the device go there.
                let to_device = (libc::O_DIRECT | libc::O_DSYNC | libc::O_SYNC) as u32;
                let may_hold = flags & to_device == 0;
                if !append && may_hold {
                    if let Some(r) = self.write_held(ino, offset, data, kill, out) {
                        counters.writes_held.fetch_add(1, Ordering::Relaxed);
                        return r;
                    }
                }
                if ctx.io_plans() && !append {
                    if let Some(r) = self.write_fast(ino, offset, data, kill) {
                        counters.writes_on_core.fetch_add(1, Ordering::Relaxed);
                        return r;
                    }
                }
                counters.writes_on_waiter.fetch_add(1, Ordering::Relaxed);
                // The data is copied once, here, out of the transport's buffer; the
                // waiter builds the aligned device image from it.
                let data = data.to_vec();
                let pages = cached_io(flags, offset, data.len() as u64);
                self.offload(ctx, out, move |i| {
                    let _held = i.hold(ino, LockMode::Exclusive, pages)?;
                    i.write(
                        ino,
                        offset,
                        &data,
                        WriteMode {
                            kill,
                            append,
                            may_hold,
                        },
                    )
                })
            }
            Operation::Statfs => self.offload(ctx, out, |i| i.statfs()),
            Operation::Release {
                fh,
                release_flags,
                lock_owner,
                ..
            } => {
                // The description's last close: its flock and OFD locks go.
                let flock = release_flags & abi::FUSE_RELEASE_FLOCK_UNLOCK != 0
                    && self.inner.plocks.holds(ino, lock_owner, true);
                let ofd = self.inner.plocks.take_fh(fh);
                self.offload(ctx, out, move |i| {
                    if flock {
                        i.release_locks(ino, lock_owner, true);
                    }
                    for owner in ofd {
                        i.release_locks(ino, owner, false);
                    }
                    i.release_file(ino);
                    Ok(Done::Empty)
                })
            }
            Operation::Releasedir { fh } => {
                self.inner.release_dir(fh);
                Reply::Bytes(0)
            }
            Operation::Flush { lock_owner, .. } => {
                // Every close drops the closing process's fcntl locks on the file.
                let unlock = self.inner.plocks.holds(ino, lock_owner, false);
                if !unlock && !self.inner.files.has_dirty_state(ino) {
                    return Reply::Bytes(0);
                }
                self.offload(ctx, out, move |i| {
                    if unlock {
                        i.release_locks(ino, lock_owner, false);
                    }
                    // close(2) reports a failed commit of pending writes.
                    let r = i.sync_pending(ino);
                    i.flush_mtime(ino);
                    r.map(|()| Done::Empty)
                })
            }
            Operation::Fsync { datasync, .. } => {
                self.offload(ctx, out, move |i| i.fsync(ino, false, datasync))
            }
            Operation::Fsyncdir { datasync, .. } => {
                self.offload(ctx, out, move |i| i.fsync(ino, true, datasync))
            }
            Operation::Syncfs => self.offload(ctx, out, move |i| {
                let mut r = Ok(());
                for f in i.files.all() {
                    r = r.and(i.sync_pending(f));
                    i.flush_mtime(f);
                }
                r.and(i.fsync(FUSE_ROOT_ID, false, false))
            }),
            Operation::Setxattr { name, value, flags } => {
                let (name, value) = (name.to_vec(), value.to_vec());
                self.offload(ctx, out, move |i| {
                    // An access ACL changes the mode: a regular file's under its lock.
                    let _held = match xattr::acl_name(&name) {
                        Some(_) => i.hold_regular(ino, LockMode::Exclusive)?,
                        None => None,
                    };
                    i.setxattr(&h, &name, &value, flags)
                })
            }
            Operation::Getxattr { name, .. } if self.inner.xattr_refused(name) => {
                Reply::Error(Errno::EOPNOTSUPP)
            }
            Operation::Getxattr { name, .. } if self.inner.xattr_absent(ino, name) => {
                Reply::Error(Errno::ENODATA)
            }
            // An empty list: a zero-size probe is answered with its length, 0.
            Operation::Listxattr { size } if self.inner.xattrs_none(ino) => match size {
                0 => reply::xattr_size(out, 0).map_or(Reply::Error(Errno::EIO), Reply::Bytes),
                _ => Reply::Bytes(0),
            },
            Operation::Getxattr { name, size } => {
                let name = name.to_vec();
                self.offload(ctx, out, move |i| i.getxattr(ino, &name, size))
            }
            Operation::Listxattr { size } => {
                self.offload(ctx, out, move |i| i.listxattr(ino, size, h.uid == 0))
            }
            Operation::Removexattr { name } => {
                let name = name.to_vec();
                self.offload(ctx, out, move |i| {
                    let _held = match xattr::acl_name(&name) {
                        Some(_) => i.hold_regular(ino, LockMode::Exclusive)?,
                        None => None,
                    };
                    i.removexattr(&h, &name)
                })
            }
            Operation::Readdir {
                fh, offset, size, ..
            } => self.offload(ctx, out, move |i| i.readdir(ino, fh, offset, size, false)),
            Operation::Readdirplus {
                fh, offset, size, ..
            } => self.offload(ctx, out, move |i| i.readdir(ino, fh, offset, size, true)),
            Operation::Create {
                name,
                flags,
                mode,
                umask,
                ..
            } => {
                let name = name.to_vec();
                self.offload(ctx, out, move |i| {
                    let r = i.create(&h, &name, flags, mode, umask);
                    i.names_refused(r, &[Errno::EEXIST])
                })
            }
            Operation::Fallocate {
                offset,
                length,
                mode,
                ..
            } => self.offload(ctx, out, move |i| {
                let _held = i.hold_regular(ino, LockMode::Exclusive)?;
                i.fallocate(ino, offset, length, mode)
            }),
            Operation::Lseek { offset, whence, .. } => self.offload(ctx, out, move |i| {
                let _held = i.hold_regular(ino, LockMode::Shared)?;
                i.lseek(ino, offset, whence)
            }),
            // Only a waiting SETLKW can be interrupted; the rest answer soon anyway.
            Operation::Interrupt { unique } => {
                self.inner.plocks.interrupt(unique);
                Reply::None
            }
            Operation::NotifyReply { .. } => Reply::None,
            Operation::Getlk {
                owner,
                lock,
                lk_flags,
                ..
            } => self.offload(ctx, out, move |i| i.getlk(ino, owner, lock, lk_flags)),
            Operation::Setlk {
                fh,
                owner,
                lock,
                lk_flags,
            } => self.offload(ctx, out, move |i| {
                i.setlk((ino, fh), owner, lock, lk_flags, None)
            }),
            Operation::Setlkw {
                fh,
                owner,
                lock,
                lk_flags,
            } => self.setlkw(ctx, out, (h.unique, ino, fh), owner, lock, lk_flags),
            Operation::Destroy => {
                self.destroy();
                Reply::Bytes(0)
            }
            // ENOSYS, remembered by the kernel: permission checks are the kernel's
            // (default_permissions), STATX falls back to GETATTR, COPY_FILE_RANGE to
            // read+write, TMPFILE to create+unlink.
            Operation::Access { .. }
            | Operation::Statx { .. }
            | Operation::CopyFileRange { .. }
            | Operation::Tmpfile { .. }
            | Operation::Poll { .. }
            | Operation::Ioctl { .. }
            | Operation::Bmap { .. }
            | Operation::SetupMapping
            | Operation::RemoveMapping
            | Operation::Init(_)
            | Operation::Unknown { .. } => Reply::Error(Errno::ENOSYS),
        }
    }

    /// READ on the core when the file's map is cached and its lock is free: no etcd.
    fn read_fast(&self, ino: u64, off: u64, size: u32, out: &mut [u8]) -> Option<Reply> {
        let _held = self.inner.locks.try_hold(ino, LockMode::Shared)?;
        let st = self.inner.files.get(ino)?;
        let mut f = st.try_lock_briefly()?;
        // Held blocks are written out first, on a waiter.
        if !f.held.is_empty() {
            return None;
        }
        atime::note_read(&mut f, self.inner.noatime);
        let fsize = f.attr.size;
        if off >= fsize || size == 0 {
            return Some(Reply::Bytes(0));
        }
        let (a_off, a_len) = aligned_range(off, u64::from(size), fsize);
        let extents = files::overlapping(f.extents.as_ref()?, a_off, a_len).to_vec();
        let io = st.begin_io(&f);
        drop(f);
        Some(to_reply(
            self.inner
                .read_done(&extents, fsize, off, size, out.len())
                .map(|d| d.held_by(io)),
            out,
        ))
    }
}

impl EtcFs {
    /// WRITE on the core, straight to the device, when it overwrites written blocks inside
    /// EOF of a file whose map is cached and whose lock is free: nothing but mtime changes
    /// (written at FLUSH/FSYNC/RELEASE), so no etcd and no waiter. Whole blocks go from the
    /// request's buffer with no copy; a write that covers its first or last block in part
    /// goes as the blocks built from this node's copies of them
    /// ([`files::RecentBlocks`]). Everything else takes [`Inner::write`].
    fn write_fast(&self, ino: u64, off: u64, data: &[u8], kill_suid: bool) -> Option<Reply> {
        // No fence check here: the transport asks `device_io_allowed` right before it
        // queues the writes.
        let fd = self.inner.dev.fd()?;
        let written = u32::try_from(data.len()).ok()?;
        let _held = self.inner.locks.try_hold(ino, LockMode::Exclusive)?;
        let st = self.inner.files.get(ino)?;
        let mut f = st.try_lock_briefly()?;
        // Held blocks are written out first, on a waiter (a write of one of them here
        // could land before them, or be overwritten by them).
        if !f.held.is_empty() {
            return None;
        }
        let (segments, io, image) =
            match plan_overwrite(&st, &mut f, off, data.len(), kill_suid, fd) {
                Some((segments, io)) => (segments, io, None),
                None => {
                    let m = plan_merged_overwrite(&st, &mut f, off, data, kill_suid, fd)?;
                    self.inner
                        .data_counters
                        .rmw_blocks_kept
                        .fetch_add(m.kept, Ordering::Relaxed);
                    (m.segments, m.io, Some(m.image))
                }
            };
        let hold = Hold::new(io);
        drop(f);
        Some(Reply::Write(WritePlan {
            segments,
            written,
            hold: Some(hold),
            image,
        }))
    }
}

impl EtcFs {
    /// WRITE answered at once, its blocks held ([`files::HeldBlocks`]): a small buffered
    /// overwrite of written blocks inside EOF under this node's exclusive lock, whose
    /// partial blocks are held or kept. Everything else takes [`EtcFs::write_fast`] or
    /// [`Inner::write`].
    fn write_held(
        &self,
        ino: u64,
        off: u64,
        data: &[u8],
        kill_suid: bool,
        out: &mut [u8],
    ) -> Option<Reply> {
        let written = u32::try_from(data.len()).ok()?;
        let _held = self.inner.locks.try_hold(ino, LockMode::Exclusive)?;
        let st = self.inner.files.get(ino)?;
        let mut f = st.try_lock_briefly()?;
        // What is held is written out under this session only; a node whose fence has
        // closed writes nothing more.
        if !self.inner.fence.open() {
            return None;
        }
        let first = f.held.is_empty();
        plan_held_overwrite(&st, &mut f, off, data, kill_suid)?;
        if first {
            self.inner.files.mark_dirty(ino);
        }
        drop(f);
        Some(match reply::write(out, written) {
            Some(n) => Reply::Bytes(n),
            None => Reply::Error(Errno::EIO),
        })
    }
}

impl Handler for EtcFs {
    fn handle(&self, ctx: &RequestCtx<'_>, req: &Request<'_>, out: &mut [u8]) -> Reply {
        self.dispatch(ctx, req, out)
    }

    fn notifier_ready(&self, notifier: fusedev::transport::Notifier) {
        // Before the first request: a lock given up while the daemon starts must still
        // drop the kernel's pages (found by tests/cluster.rs, whose first writes came
        // before the daemon had set its process-wide notifier).
        *lock(&self.inner.notifier) = Some(notifier);
    }

    fn serves_acls(&self) -> bool {
        true
    }

    fn serves_locks(&self) -> bool {
        true
    }

    fn device_io_allowed(&self) -> bool {
        self.inner.fence.open()
    }

    fn stable_fds(&self) -> Vec<std::os::fd::RawFd> {
        // The device stays open for the filesystem's life (`Inner::dev`).
        self.inner.dev.fd().into_iter().collect()
    }

    fn counters(&self) -> Vec<(String, u64)> {
        let m = self.inner.meta.stats();
        let mut c: Vec<(String, u64)> = vec![
            ("etcd_txns_committed".into(), m.txns_committed),
            ("etcd_mutations_committed".into(), m.mutations_committed),
            ("etcd_mutations_in_txns".into(), m.mutations_in_txns),
            ("etcd_mutations_per_txn_max".into(), m.mutations_per_txn_max),
            ("etcd_mutations_failed".into(), m.mutations_failed),
            ("etcd_compare_failures".into(), m.compare_failures),
            ("etcd_retries".into(), m.retries),
            ("etcd_read_txns".into(), m.read_txns),
            ("etcd_txn_errors".into(), m.txn_errors),
            ("etcd_txns_unanswered".into(), m.txns_unanswered),
            ("etcd_unanswered_applied".into(), m.unanswered_applied),
            ("etcd_unanswered_resent".into(), m.unanswered_resent),
            ("etcd_read_retries".into(), m.read_retries),
            ("etcd_write_retries".into(), m.write_retries),
            ("free_map_writes_failed".into(), m.free_maps_failed),
            ("waiter_queue_refused".into(), self.pool.refused()),
            ("dir_times_coalesced".into(), m.touches_coalesced),
            ("dir_times_written".into(), m.touches_written),
            ("inode_blocks_reserved".into(), m.ino_blocks_reserved),
            ("pipeline_pending".into(), m.pending),
            ("etcd_txns_in_flight".into(), m.txns_in_flight),
        ];
        // Mutations per transaction as a histogram: buckets 1, 2-3, 4-7, ... 128+.
        const BUCKETS: [&str; 8] = [
            "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "128+",
        ];
        for (name, n) in BUCKETS.iter().zip(m.mutations_per_txn_hist) {
            c.push((format!("etcd_txns_with_mutations_{name}"), n));
        }
        c.extend(self.inner.caches.counters());
        let d = &self.inner.data_counters;
        for (name, n) in [
            ("data_reads_on_core", &d.reads_on_core),
            ("data_reads_on_waiter", &d.reads_on_waiter),
            ("data_writes_on_core", &d.writes_on_core),
            ("data_writes_on_waiter", &d.writes_on_waiter),
            ("frees_unlogged", &d.frees_unlogged),
            ("mtime_commits_relocked", &d.mtime_commits_relocked),
            ("rmw_blocks_kept", &d.rmw_blocks_kept),
            ("writes_held", &d.writes_held),
            ("held_blocks_written", &d.held_blocks_written),
            ("held_block_runs_written", &d.held_block_runs_written),
            ("held_blocks_lost", &d.held_blocks_lost),
        ] {
            c.push((name.into(), n.load(Ordering::Relaxed)));
        }
        c.push(("cache_locks_known".into(), self.inner.locks.len() as u64));
        // Sessions fenced since mount (handles start at generation 1), whether the node is
        // fenced now, and the milliseconds left before its fence closes.
        let i = &self.inner;
        c.push((
            "session_fences".into(),
            i.generation.load(Ordering::Acquire).saturating_sub(1),
        ));
        c.push((
            "session_fenced_now".into(),
            u64::from(i.fenced.load(Ordering::Acquire)),
        ));
        let fence_left = i.fence.left();
        c.push((
            "session_fence_left_ms".into(),
            u64::try_from(fence_left.as_millis()).unwrap_or(u64::MAX),
        ));
        // The lease's earliest expiry as this node reckons it: the fence closes a margin
        // before it (`meta::fence`), so while the fence is open the lease has that margin
        // more; once it has closed, the node no longer counts on its lease.
        let lease_left = if fence_left.is_zero() {
            fence_left
        } else {
            let ttl = Duration::from_secs(u64::try_from(i.lease_ttl_s).unwrap_or(0));
            fence_left + meta::fence::margin(ttl)
        };
        c.push((
            "session_lease_left_ms".into(),
            u64::try_from(lease_left.as_millis()).unwrap_or(u64::MAX),
        ));
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let d = &i.dev_counters;
        c.extend([
            ("device_reads_waiter".into(), l(&d.reads)),
            ("device_read_bytes_waiter".into(), l(&d.read_bytes)),
            ("device_writes_waiter".into(), l(&d.writes)),
            ("device_write_bytes_waiter".into(), l(&d.write_bytes)),
            ("device_flushes".into(), l(&d.flushes)),
            ("plocks_granted".into(), l(&i.plocks.granted)),
            ("plocks_waited".into(), l(&i.plocks.waited)),
            ("plocks_refused".into(), l(&i.plocks.refused)),
            (
                "plocks_delegations_taken".into(),
                l(&i.plocks.delegations_taken),
            ),
            (
                "plocks_delegations_returned".into(),
                l(&i.plocks.delegations_returned),
            ),
        ]);
        let (forgotten, waited_out) = self.inner.meta.own_commits().counters();
        c.push(("own_revisions_forgotten".into(), forgotten));
        c.push(("own_revisions_waited_out".into(), waited_out));
        c
    }

    fn destroy(&self) {
        self.pool.drain();
        self.inner.shutdown();
        if let Some(h) = lock(&self.housekeeping).take() {
            let _ = h.join();
        }
        if let Some(h) = lock(&self.invalidation).take() {
            let _ = h.join();
        }
        if let Some(h) = lock(&self.lock_thread).take() {
            let _ = h.join();
        }
    }
}
