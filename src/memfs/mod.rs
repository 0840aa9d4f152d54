//! `memfs`: a filesystem that lives in this process's memory and implements
//! [`fusedev::server::Handler`].
//!
//! It is a test fixture and the "transport only" baseline for benchmarks (what the FUSE
//! transports cost with a filesystem that does nearly nothing), not the product: nothing
//! survives the process, nothing is shared between nodes.
//!
//! Model:
//! * Inodes live in a sharded table (see `table.rs` for the lock order). Inode numbers are
//!   never reused, so the generation only has to be unique per number.
//! * Regular file data lives in one memfd per file, so READ replies are
//!   [`Reply::Fd`] and the `/dev/fuse` transport can splice them. The memfd stays open
//!   until the inode is dropped, which happens only after the kernel's FORGET, and the
//!   kernel never forgets an inode while a READ on it is in flight: the fd in a reply
//!   stays valid until the transport has sent it.
//! * An inode is dropped when no name links it (`nlink == 0`) and the kernel holds no
//!   reference to it (`lookups == 0`). LOOKUP, MKNOD, MKDIR, SYMLINK, LINK, CREATE,
//!   TMPFILE and every READDIRPLUS entry except "." and ".." take a reference.
//! * Permission checks are the kernel's (mount with `default_permissions`): ACCESS answers
//!   ENOSYS, after which the kernel stops sending it.

mod inode;
mod table;
#[cfg(test)]
mod tests;

use std::{
    fs::File,
    io,
    os::{fd::AsRawFd, unix::fs::FileExt},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};

use fusedev::{
    abi::{
        self, AttrOut, EntryOut, Immutable, InHeader, IntoBytes, Kstatfs, OpenOut, SetattrIn,
        FUSE_ROOT_ID, NAME_MAX,
    },
    errno::Errno,
    reply::{self, dirent_type, DirentWriter},
    request::{Operation, Request},
    server::{Handler, Reply, RequestCtx},
};

use self::{
    inode::{Dir, Inode, Kind, Time},
    table::{Locked, Table},
};

/// Settings of a [`MemFs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemFsConfig {
    /// How long the kernel may cache attributes.
    pub(crate) attr_timeout: Duration,
    /// How long the kernel may cache names.
    pub(crate) entry_timeout: Duration,
    /// Owner of the root directory.
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

impl Default for MemFsConfig {
    fn default() -> Self {
        MemFsConfig {
            attr_timeout: Duration::from_secs(1),
            entry_timeout: Duration::from_secs(1),
            uid: 0,
            gid: 0,
        }
    }
}

/// Largest xattr value (Linux's `XATTR_SIZE_MAX`).
const XATTR_VALUE_MAX: usize = 64 << 10;
/// Attempts at a two-inode operation whose directory entry changed between reading it and
/// locking both inodes, before giving up with EAGAIN. The kernel serializes operations on
/// one directory entry, so a second attempt is already rare.
const RELOCK_ATTEMPTS_MAX: usize = 8;
/// Parent hops followed when checking that a directory is not moved into itself; deeper
/// trees are refused with ELOOP rather than walked forever.
const ANCESTOR_WALK_MAX: usize = 1 << 16;
/// Size reported by STATFS: 4 TiB of 4 KiB blocks, 2^32 inodes.
const STATFS_BLOCKS: u64 = 1 << 30;
const STATFS_FILES: u64 = 1 << 32;

/// The filesystem. One instance serves every worker.
pub(crate) struct MemFs {
    cfg: MemFsConfig,
    table: Table,
    /// Serializes renames, so the parent chain walked to refuse moving a directory into
    /// its own subtree cannot change during the walk (only renames change parents).
    rename_lock: Mutex<()>,
    next_ino: AtomicU64,
    next_generation: AtomicU64,
    next_fh: AtomicU64,
}

impl MemFs {
    pub(crate) fn new(cfg: MemFsConfig) -> MemFs {
        let fs = MemFs {
            cfg,
            table: Table::new(),
            rename_lock: Mutex::new(()),
            next_ino: AtomicU64::new(FUSE_ROOT_ID + 1),
            next_generation: AtomicU64::new(1),
            next_fh: AtomicU64::new(1),
        };
        let mut root = Inode::new(
            Kind::Dir(Dir::new(FUSE_ROOT_ID)),
            libc::S_IFDIR | 0o755,
            cfg.uid,
            cfg.gid,
            0,
        );
        // The kernel's reference to the root is implicit and never forgotten.
        root.lookups = 1;
        fs.table
            .lock_many(&[FUSE_ROOT_ID])
            .insert(FUSE_ROOT_ID, root);
        fs
    }

    fn entry_out(&self, ino: u64, inode: &Inode) -> EntryOut {
        EntryOut::new(
            inode.generation,
            self.cfg.entry_timeout,
            self.cfg.attr_timeout,
            inode.attr(ino),
        )
    }

    fn attr_out(&self, ino: u64, inode: &Inode) -> AttrOut {
        AttrOut::new(self.cfg.attr_timeout, inode.attr(ino))
    }

    fn new_fh(&self) -> OpenOut {
        OpenOut {
            fh: self.next_fh.fetch_add(1, Ordering::Relaxed),
            open_flags: 0,
            backing_id: 0,
        }
    }

    /// The inode `name` in directory `parent` names.
    fn child_of(&self, parent: u64, name: &[u8]) -> Result<u64, Errno> {
        let shard = self.table.lock(parent);
        let dir = shard
            .get(&parent)
            .ok_or(Errno::ENOENT)?
            .dir()
            .ok_or(Errno::ENOTDIR)?;
        match name {
            b"." => Ok(parent),
            b".." => Ok(dir.parent),
            _ => dir.get(name).map(|e| e.ino).ok_or(Errno::ENOENT),
        }
    }

    /// Like [`MemFs::child_of`], `None` when the name is absent.
    fn child_of_opt(&self, parent: u64, name: &[u8]) -> Result<Option<u64>, Errno> {
        match self.child_of(parent, name) {
            Err(e) if e == Errno::ENOENT => {
                // Tell "no such name" from "no such directory".
                let shard = self.table.lock(parent);
                shard.get(&parent).ok_or(Errno::ENOENT)?;
                Ok(None)
            }
            other => other.map(Some),
        }
    }

    /// Locks `parent`, the inode `name` names in it, and `extra`; retries if the entry
    /// changes between reading it and holding the locks.
    fn lock_child(
        &self,
        parent: u64,
        name: &[u8],
        extra: &[u64],
    ) -> Result<(Locked<'_>, u64), Errno> {
        for _ in 0..RELOCK_ATTEMPTS_MAX {
            let child = self.child_of(parent, name)?;
            let mut inos = vec![parent, child];
            inos.extend_from_slice(extra);
            let locked = self.table.lock_many(&inos);
            if entry_ino(&locked, parent, name) == Some(child) {
                return Ok((locked, child));
            }
        }
        Err(Errno::EAGAIN)
    }

    /// Takes a kernel reference on `ino` and describes it.
    fn take_ref(&self, ino: u64) -> Result<EntryOut, Errno> {
        let mut shard = self.table.lock(ino);
        let inode = shard.get_mut(&ino).ok_or(Errno::ENOENT)?;
        inode.lookups += 1;
        Ok(self.entry_out(ino, inode))
    }

    fn lookup(&self, parent: u64, name: &[u8], out: &mut [u8]) -> Result<Reply, Errno> {
        fusedev::names::check_entry_name(name)?;
        let ino = self.child_of(parent, name)?;
        bytes(out, &self.take_ref(ino)?)
    }

    fn forget(&self, ino: u64, nlookup: u64) {
        if ino == FUSE_ROOT_ID {
            return;
        }
        let mut shard = self.table.lock(ino);
        if let Some(inode) = shard.get_mut(&ino) {
            inode.lookups = inode.lookups.saturating_sub(nlookup);
            if inode.is_dead() {
                shard.remove(&ino);
            }
        }
    }

    fn getattr(&self, ino: u64, out: &mut [u8]) -> Result<Reply, Errno> {
        let shard = self.table.lock(ino);
        let inode = shard.get(&ino).ok_or(Errno::ENOENT)?;
        let attr = self.attr_out(ino, inode);
        drop(shard);
        bytes(out, &attr)
    }

    fn setattr(&self, ino: u64, a: &SetattrIn, out: &mut [u8]) -> Result<Reply, Errno> {
        let mut shard = self.table.lock(ino);
        let inode = shard.get_mut(&ino).ok_or(Errno::ENOENT)?;
        let now = Time::now();
        if a.valid & abi::FATTR_SIZE != 0 {
            set_size(inode, a.size)?;
            inode.mtime = now;
        }
        if a.valid & abi::FATTR_MODE != 0 {
            inode.mode = (inode.mode & libc::S_IFMT) | (a.mode & 0o7777);
        }
        if a.valid & abi::FATTR_UID != 0 {
            inode.uid = a.uid;
        }
        if a.valid & abi::FATTR_GID != 0 {
            inode.gid = a.gid;
        }
        if a.valid & abi::FATTR_KILL_SUIDGID != 0 {
            inode.kill_suid();
        }
        if a.valid & abi::FATTR_ATIME_NOW != 0 {
            inode.atime = now;
        } else if a.valid & abi::FATTR_ATIME != 0 {
            inode.atime = Time::from_wire(a.atime, a.atimensec);
        }
        if a.valid & abi::FATTR_MTIME_NOW != 0 {
            inode.mtime = now;
        } else if a.valid & abi::FATTR_MTIME != 0 {
            inode.mtime = Time::from_wire(a.mtime, a.mtimensec);
        }
        inode.ctime = if a.valid & abi::FATTR_CTIME != 0 {
            Time::from_wire(a.ctime, a.ctimensec)
        } else {
            now
        };
        let attr = self.attr_out(ino, inode);
        drop(shard);
        bytes(out, &attr)
    }

    /// Creates an inode of `kind` named `name` in `parent` (unnamed if `None`, for
    /// TMPFILE) and takes a kernel reference on it.
    fn make_node(
        &self,
        h: &InHeader,
        parent: u64,
        name: Option<&[u8]>,
        mode: u32,
        kind: Kind,
    ) -> Result<EntryOut, Errno> {
        if let Some(name) = name {
            fusedev::names::check_entry_name(name)?;
            if name == b"." || name == b".." {
                return Err(Errno::EEXIST);
            }
        }
        let ino = self.next_ino.fetch_add(1, Ordering::Relaxed);
        let mut locked = self.table.lock_many(&[parent, ino]);
        let dir_inode = locked.get(parent).ok_or(Errno::ENOENT)?;
        let dir = dir_inode.dir().ok_or(Errno::ENOTDIR)?;
        if dir_inode.nlink == 0 {
            return Err(Errno::ENOENT);
        }
        if name.is_some_and(|n| dir.get(n).is_some()) {
            return Err(Errno::EEXIST);
        }
        // Group ownership and, for directories, the set-group-id bit follow a set-group-id
        // parent (BSD semantics, as Linux filesystems do).
        let setgid_parent = dir_inode.mode & libc::S_ISGID != 0;
        let gid = if setgid_parent { dir_inode.gid } else { h.gid };
        let mut mode = mode;
        if setgid_parent && mode & libc::S_IFMT == libc::S_IFDIR {
            mode |= libc::S_ISGID;
        }
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let mut inode = Inode::new(kind, mode, h.uid, gid, generation);
        inode.lookups = 1;
        let is_dir = inode.is_dir();
        if name.is_none() {
            inode.nlink = 0;
        }
        let entry = self.entry_out(ino, &inode);
        if let Some(name) = name {
            let dir_inode = locked.get_mut(parent).ok_or(Errno::ENOENT)?;
            if let Some(dir) = dir_inode.dir_mut() {
                dir.insert(name, ino, dirent_type(mode));
            }
            if is_dir {
                dir_inode.nlink += 1;
            }
            dir_inode.touch_data();
        }
        locked.insert(ino, inode);
        Ok(entry)
    }

    fn mknod(
        &self,
        h: &InHeader,
        name: &[u8],
        mode: u32,
        rdev: u32,
        out: &mut [u8],
    ) -> Result<Reply, Errno> {
        let kind = match mode & libc::S_IFMT {
            libc::S_IFREG | 0 => Kind::File(None),
            libc::S_IFCHR | libc::S_IFBLK | libc::S_IFIFO | libc::S_IFSOCK => Kind::Special,
            _ => return Err(Errno::EINVAL),
        };
        let mode = if mode & libc::S_IFMT == 0 {
            mode | libc::S_IFREG
        } else {
            mode
        };
        let mut entry = self.make_node(h, h.nodeid, Some(name), mode, kind)?;
        if rdev != 0 {
            let ino = entry.nodeid;
            let mut shard = self.table.lock(ino);
            if let Some(inode) = shard.get_mut(&ino) {
                inode.rdev = rdev;
                entry = self.entry_out(ino, inode);
            }
        }
        bytes(out, &entry)
    }

    fn create(
        &self,
        h: &InHeader,
        name: &[u8],
        flags: u32,
        mode: u32,
        open_flags: u32,
        out: &mut [u8],
    ) -> Result<Reply, Errno> {
        let mode = libc::S_IFREG | (mode & 0o7777);
        let entry = match self.make_node(h, h.nodeid, Some(name), mode, Kind::File(None)) {
            // The kernel sends CREATE for a name it believed absent; if another creator
            // won the race, behave as open(2) does.
            Err(e) if e == Errno::EEXIST && flags & libc::O_EXCL as u32 == 0 => {
                let ino = self.child_of(h.nodeid, name)?;
                self.open_existing(ino, flags, open_flags)?;
                self.take_ref(ino)?
            }
            other => other?,
        };
        let n = reply::create(out, &entry, &self.new_fh()).ok_or(Errno::EIO)?;
        Ok(Reply::Bytes(n))
    }

    /// OPEN's work on the inode: refuse directories, apply O_TRUNC (ATOMIC_O_TRUNC).
    fn open_existing(&self, ino: u64, flags: u32, open_flags: u32) -> Result<(), Errno> {
        let mut shard = self.table.lock(ino);
        let inode = shard.get_mut(&ino).ok_or(Errno::ENOENT)?;
        if inode.is_dir() {
            return Err(Errno::EISDIR);
        }
        let writable = flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32;
        if flags & libc::O_TRUNC as u32 != 0 && writable && matches!(inode.kind, Kind::File(_)) {
            if inode.size != 0 {
                set_size(inode, 0)?;
            }
            inode.touch_data();
            if open_flags & abi::FUSE_OPEN_KILL_SUIDGID != 0 {
                inode.kill_suid();
            }
        }
        Ok(())
    }

    fn unlink(&self, parent: u64, name: &[u8]) -> Result<Reply, Errno> {
        fusedev::names::check_entry_name(name)?;
        let (mut locked, child) = self.lock_child(parent, name, &[])?;
        if locked.get(child).ok_or(Errno::ENOENT)?.is_dir() {
            return Err(Errno::EISDIR);
        }
        unlink_entry(&mut locked, parent, name, child);
        Ok(Reply::Bytes(0))
    }

    fn rmdir(&self, parent: u64, name: &[u8]) -> Result<Reply, Errno> {
        fusedev::names::check_entry_name(name)?;
        match name {
            b"." => return Err(Errno::EINVAL),
            b".." => return Err(Errno::ENOTEMPTY),
            _ => {}
        }
        let (mut locked, child) = self.lock_child(parent, name, &[])?;
        let dir = locked
            .get(child)
            .ok_or(Errno::ENOENT)?
            .dir()
            .ok_or(Errno::ENOTDIR)?;
        if !dir.is_empty() {
            return Err(Errno::ENOTEMPTY);
        }
        unlink_entry(&mut locked, parent, name, child);
        Ok(Reply::Bytes(0))
    }

    fn link(
        &self,
        newparent: u64,
        oldnodeid: u64,
        name: &[u8],
        out: &mut [u8],
    ) -> Result<Reply, Errno> {
        fusedev::names::check_entry_name(name)?;
        let mut locked = self.table.lock_many(&[newparent, oldnodeid]);
        let target = locked.get(oldnodeid).ok_or(Errno::ENOENT)?;
        if target.is_dir() {
            return Err(Errno::EPERM);
        }
        let typ = dirent_type(target.mode);
        let dir_inode = locked.get_mut(newparent).ok_or(Errno::ENOENT)?;
        let live = dir_inode.nlink != 0;
        let dir = dir_inode.dir_mut().ok_or(Errno::ENOTDIR)?;
        if !live {
            return Err(Errno::ENOENT);
        }
        if dir.get(name).is_some() || name == b"." || name == b".." {
            return Err(Errno::EEXIST);
        }
        dir.insert(name, oldnodeid, typ);
        dir_inode.touch_data();
        let target = locked.get_mut(oldnodeid).ok_or(Errno::ENOENT)?;
        target.nlink += 1;
        target.lookups += 1;
        target.ctime = Time::now();
        let entry = self.entry_out(oldnodeid, target);
        drop(locked);
        bytes(out, &entry)
    }

    fn rename(
        &self,
        olddir: u64,
        name: &[u8],
        newdir: u64,
        newname: &[u8],
        flags: u32,
    ) -> Result<Reply, Errno> {
        fusedev::names::check_entry_name(name)?;
        fusedev::names::check_entry_name(newname)?;
        let known = abi::RENAME_NOREPLACE | abi::RENAME_EXCHANGE;
        if flags & !known != 0 || flags == known {
            // RENAME_WHITEOUT is for overlayfs upper layers; not supported.
            return Err(Errno::EINVAL);
        }
        if [name, newname].iter().any(|n| *n == b"." || *n == b"..") {
            return Err(Errno::EBUSY);
        }
        let exchange = flags & abi::RENAME_EXCHANGE != 0;
        let _serial = self
            .rename_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for _ in 0..RELOCK_ATTEMPTS_MAX {
            let src = self.child_of(olddir, name)?;
            let dst = self.child_of_opt(newdir, newname)?;
            if src == dst.unwrap_or(0) {
                // Two names of one inode: rename(2) does nothing.
                return Ok(Reply::Bytes(0));
            }
            // Parents only change under rename_lock, which we hold: these walks are stable.
            if self.is_dir(src) && self.is_ancestor(src, newdir)? {
                return Err(Errno::EINVAL);
            }
            if exchange {
                let dst = dst.ok_or(Errno::ENOENT)?;
                if self.is_dir(dst) && self.is_ancestor(dst, olddir)? {
                    return Err(Errno::EINVAL);
                }
            }
            let mut inos = vec![olddir, newdir, src];
            inos.extend(dst);
            let mut locked = self.table.lock_many(&inos);
            if entry_ino(&locked, olddir, name) != Some(src)
                || entry_ino(&locked, newdir, newname) != dst
            {
                continue;
            }
            let mv = Move {
                olddir,
                name,
                newdir,
                newname,
                src,
            };
            return match dst {
                Some(dst) if exchange => exchange_entries(&mut locked, &mv, dst),
                Some(_) if flags & abi::RENAME_NOREPLACE != 0 => Err(Errno::EEXIST),
                _ => move_entry(&mut locked, &mv, dst),
            }
            .map(|()| Reply::Bytes(0));
        }
        Err(Errno::EAGAIN)
    }

    fn is_dir(&self, ino: u64) -> bool {
        self.table.lock(ino).get(&ino).is_some_and(Inode::is_dir)
    }

    /// Whether directory `ancestor` is `dir` or one of its ancestors.
    fn is_ancestor(&self, ancestor: u64, dir: u64) -> Result<bool, Errno> {
        let mut cur = dir;
        for _ in 0..ANCESTOR_WALK_MAX {
            if cur == ancestor {
                return Ok(true);
            }
            if cur == FUSE_ROOT_ID {
                return Ok(false);
            }
            let shard = self.table.lock(cur);
            match shard.get(&cur).and_then(Inode::dir) {
                Some(d) => cur = d.parent,
                None => return Ok(false),
            }
        }
        Err(Errno::ELOOP)
    }

    fn open(&self, ino: u64, flags: u32, open_flags: u32, out: &mut [u8]) -> Result<Reply, Errno> {
        self.open_existing(ino, flags, open_flags)?;
        bytes(out, &self.new_fh())
    }

    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Reply, Errno> {
        let shard = self.table.lock(ino);
        let inode = shard.get(&ino).ok_or(Errno::ENOENT)?;
        let file = match &inode.kind {
            Kind::File(file) => file,
            Kind::Dir(_) => return Err(Errno::EISDIR),
            Kind::Symlink(_) | Kind::Special => return Err(Errno::EINVAL),
        };
        let available = inode.size.saturating_sub(offset);
        let len = usize::try_from(available.min(u64::from(size))).unwrap_or(0);
        match file {
            Some(file) if len > 0 => Ok(Reply::Fd {
                fd: file.as_raw_fd(),
                offset,
                len,
            }),
            // Empty files have no memfd; past EOF there is nothing to read.
            _ => Ok(Reply::Bytes(0)),
        }
    }

    fn write(
        &self,
        ino: u64,
        offset: u64,
        data: &[u8],
        write_flags: u32,
        out: &mut [u8],
    ) -> Result<Reply, Errno> {
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or(Errno::EFBIG)?;
        // Copy outside the shard lock: other inodes of the shard stay available meanwhile.
        // The kernel holds the inode lock across WRITE and truncate, so the size update
        // below cannot race a truncate of the same file.
        let file = {
            let mut shard = self.table.lock(ino);
            let inode = shard.get_mut(&ino).ok_or(Errno::ENOENT)?;
            file_of(inode)?
        };
        file.write_all_at(data, offset).map_err(io_errno)?;
        let mut shard = self.table.lock(ino);
        if let Some(inode) = shard.get_mut(&ino) {
            inode.size = inode.size.max(end);
            inode.touch_data();
            if write_flags & abi::FUSE_WRITE_KILL_SUIDGID != 0 {
                inode.kill_suid();
            }
        }
        drop(shard);
        let n =
            reply::write(out, u32::try_from(data.len()).unwrap_or(u32::MAX)).ok_or(Errno::EIO)?;
        Ok(Reply::Bytes(n))
    }

    fn fallocate(&self, ino: u64, offset: u64, length: u64, mode: u32) -> Result<Reply, Errno> {
        if mode != 0 {
            return Err(Errno::EOPNOTSUPP);
        }
        let end = offset
            .checked_add(length)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or(Errno::EFBIG)?;
        let mut shard = self.table.lock(ino);
        let inode = shard.get_mut(&ino).ok_or(Errno::ENOENT)?;
        match inode.kind {
            Kind::File(_) => {}
            Kind::Dir(_) => return Err(Errno::EISDIR),
            _ => return Err(Errno::ENODEV),
        }
        if end > inode.size {
            set_size(inode, end)?;
            inode.touch_data();
        }
        Ok(Reply::Bytes(0))
    }

    fn opendir(&self, ino: u64, out: &mut [u8]) -> Result<Reply, Errno> {
        {
            let shard = self.table.lock(ino);
            shard
                .get(&ino)
                .ok_or(Errno::ENOENT)?
                .dir()
                .ok_or(Errno::ENOTDIR)?;
        }
        bytes(out, &self.new_fh())
    }

    /// READDIR (`plus == false`) and READDIRPLUS. Offsets: 1 is ".", 2 is "..", then each
    /// entry's cookie. Never returns more than `size` bytes.
    fn readdir(
        &self,
        ino: u64,
        offset: u64,
        size: u32,
        plus: bool,
        out: &mut [u8],
    ) -> Result<Reply, Errno> {
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        let record_min = if plus {
            reply::direntplus_len(1)
        } else {
            reply::dirent_len(1)
        };
        let (parent, batch) = {
            let shard = self.table.lock(ino);
            let dir = shard
                .get(&ino)
                .ok_or(Errno::ENOENT)?
                .dir()
                .ok_or(Errno::ENOTDIR)?;
            (dir.parent, dir.after(offset, size / record_min + 1))
        };
        let mut w = DirentWriter::new(out, size);
        let dir_type = dirent_type(libc::S_IFDIR);
        let dots: [(u64, &[u8], u64); 2] = [(1, b".", ino), (2, b"..", parent)];
        for (off, name, dot_ino) in dots {
            if offset >= off {
                continue;
            }
            // The kernel ignores the entry part of "." and ".." (nodeid 0: no reference).
            let fitted = if plus {
                w.push_plus(&EntryOut::default(), dot_ino, off, dir_type, name)
            } else {
                w.push(dot_ino, off, dir_type, name)
            };
            if !fitted {
                return Ok(Reply::Bytes(w.finish()));
            }
        }
        for (cookie, name, entry) in batch {
            if !plus {
                if !w.push(entry.ino, cookie, entry.typ, &name) {
                    break;
                }
                continue;
            }
            // Check the fit first: the reference taken below is the kernel's once sent.
            if !w.fits_plus(name.len()) {
                break;
            }
            let Ok(e) = self.take_ref(entry.ino) else {
                continue; // Dropped since the listing was read.
            };
            w.push_plus(&e, entry.ino, cookie, entry.typ, &name);
        }
        Ok(Reply::Bytes(w.finish()))
    }

    fn readlink(&self, ino: u64, out: &mut [u8]) -> Result<Reply, Errno> {
        let shard = self.table.lock(ino);
        match &shard.get(&ino).ok_or(Errno::ENOENT)?.kind {
            Kind::Symlink(target) => reply::put_bytes(out, target)
                .map(Reply::Bytes)
                .ok_or(Errno::EIO),
            _ => Err(Errno::EINVAL),
        }
    }

    fn statfs(&self, out: &mut [u8]) -> Result<Reply, Errno> {
        let used = self.table.len() as u64;
        let st = Kstatfs {
            blocks: STATFS_BLOCKS,
            bfree: STATFS_BLOCKS,
            bavail: STATFS_BLOCKS,
            files: STATFS_FILES,
            ffree: STATFS_FILES.saturating_sub(used),
            bsize: 4096,
            namelen: NAME_MAX as u32,
            frsize: 4096,
            ..Kstatfs::default()
        };
        let n = reply::statfs(out, &st).ok_or(Errno::EIO)?;
        Ok(Reply::Bytes(n))
    }

    fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: u32) -> Result<Reply, Errno> {
        fusedev::names::check_xattr_name(name)?;
        if value.len() > XATTR_VALUE_MAX {
            return Err(Errno::E2BIG);
        }
        let mut shard = self.table.lock(ino);
        let inode = shard.get_mut(&ino).ok_or(Errno::ENOENT)?;
        let exists = inode.xattrs.contains_key(name);
        if flags & abi::XATTR_CREATE != 0 && exists {
            return Err(Errno::EEXIST);
        }
        if flags & abi::XATTR_REPLACE != 0 && !exists {
            return Err(Errno::ENODATA);
        }
        inode.xattrs.insert(name.to_vec(), value.to_vec());
        inode.ctime = Time::now();
        Ok(Reply::Bytes(0))
    }

    fn getxattr(&self, ino: u64, name: &[u8], size: u32, out: &mut [u8]) -> Result<Reply, Errno> {
        fusedev::names::check_xattr_name(name)?;
        let shard = self.table.lock(ino);
        let inode = shard.get(&ino).ok_or(Errno::ENOENT)?;
        let value = inode.xattrs.get(name).ok_or(Errno::ENODATA)?;
        sized_reply(value, size, out)
    }

    fn listxattr(&self, ino: u64, size: u32, out: &mut [u8]) -> Result<Reply, Errno> {
        let shard = self.table.lock(ino);
        let inode = shard.get(&ino).ok_or(Errno::ENOENT)?;
        let mut list = Vec::new();
        for name in inode.xattrs.keys() {
            list.extend_from_slice(name);
            list.push(0);
        }
        drop(shard);
        sized_reply(&list, size, out)
    }

    fn removexattr(&self, ino: u64, name: &[u8]) -> Result<Reply, Errno> {
        fusedev::names::check_xattr_name(name)?;
        let mut shard = self.table.lock(ino);
        let inode = shard.get_mut(&ino).ok_or(Errno::ENOENT)?;
        inode.xattrs.remove(name).ok_or(Errno::ENODATA)?;
        inode.ctime = Time::now();
        Ok(Reply::Bytes(0))
    }

    fn dispatch(&self, req: &Request<'_>, out: &mut [u8]) -> Result<Reply, Errno> {
        let h = &req.header;
        let ino = h.nodeid;
        match req.op {
            Operation::Lookup { name } => self.lookup(ino, name, out),
            Operation::Forget { nlookup } => {
                self.forget(ino, nlookup);
                Ok(Reply::None)
            }
            Operation::BatchForget { forgets } => {
                for f in forgets.iter() {
                    self.forget(f.nodeid, f.nlookup);
                }
                Ok(Reply::None)
            }
            Operation::Getattr { .. } => self.getattr(ino, out),
            Operation::Setattr(ref a) => self.setattr(ino, a, out),
            Operation::Readlink => self.readlink(ino, out),
            Operation::Symlink { name, target } => {
                let kind = Kind::Symlink(target.to_vec());
                bytes(
                    out,
                    &self.make_node(h, ino, Some(name), libc::S_IFLNK | 0o777, kind)?,
                )
            }
            Operation::Mknod {
                name, mode, rdev, ..
            } => self.mknod(h, name, mode, rdev, out),
            Operation::Mkdir { name, mode, .. } => {
                let mode = libc::S_IFDIR | (mode & 0o7777);
                bytes(
                    out,
                    &self.make_node(h, ino, Some(name), mode, Kind::Dir(Dir::new(ino)))?,
                )
            }
            Operation::Unlink { name } => self.unlink(ino, name),
            Operation::Rmdir { name } => self.rmdir(ino, name),
            Operation::Rename {
                newdir,
                name,
                newname,
                flags,
            } => self.rename(ino, name, newdir, newname, flags),
            Operation::Link { oldnodeid, name } => self.link(ino, oldnodeid, name, out),
            Operation::Open { flags, open_flags } => self.open(ino, flags, open_flags, out),
            Operation::Read { offset, size, .. } => self.read(ino, offset, size),
            Operation::Write {
                offset,
                data,
                write_flags,
                ..
            } => self.write(ino, offset, data, write_flags, out),
            Operation::Statfs => self.statfs(out),
            Operation::Release { .. }
            | Operation::Releasedir { .. }
            | Operation::Flush { .. }
            | Operation::Fsync { .. }
            | Operation::Fsyncdir { .. }
            | Operation::Syncfs => Ok(Reply::Bytes(0)),
            Operation::Setxattr { name, value, flags } => self.setxattr(ino, name, value, flags),
            Operation::Getxattr { name, size } => self.getxattr(ino, name, size, out),
            Operation::Listxattr { size } => self.listxattr(ino, size, out),
            Operation::Removexattr { name } => self.removexattr(ino, name),
            Operation::Opendir { .. } => self.opendir(ino, out),
            Operation::Readdir { offset, size, .. } => self.readdir(ino, offset, size, false, out),
            Operation::Readdirplus { offset, size, .. } => {
                self.readdir(ino, offset, size, true, out)
            }
            Operation::Create {
                name,
                flags,
                mode,
                open_flags,
                ..
            } => self.create(h, name, flags, mode, open_flags, out),
            Operation::Tmpfile { mode, .. } => {
                let mode = libc::S_IFREG | (mode & 0o7777);
                let entry = self.make_node(h, ino, None, mode, Kind::File(None))?;
                let n = reply::create(out, &entry, &self.new_fh()).ok_or(Errno::EIO)?;
                Ok(Reply::Bytes(n))
            }
            Operation::Fallocate {
                offset,
                length,
                mode,
                ..
            } => self.fallocate(ino, offset, length, mode),
            // Handled locally: nothing here blocks long enough to be worth interrupting.
            Operation::Interrupt { .. } | Operation::NotifyReply { .. } => Ok(Reply::None),
            // The transport answers DESTROY; if it gets here, an empty success is what the
            // kernel waits for.
            Operation::Destroy => Ok(Reply::Bytes(0)),
            // ENOSYS, remembered by the kernel: permission checks are the kernel's
            // (default_permissions), STATX falls back to GETATTR, LSEEK to generic
            // SEEK_SET/CUR/END, COPY_FILE_RANGE to read+write; locks stay node-local
            // (never requested at INIT). INIT belongs to the transport.
            Operation::Access { .. }
            | Operation::Statx { .. }
            | Operation::Lseek { .. }
            | Operation::CopyFileRange { .. }
            | Operation::Getlk { .. }
            | Operation::Setlk { .. }
            | Operation::Setlkw { .. }
            | Operation::Poll { .. }
            | Operation::Ioctl { .. }
            | Operation::Bmap { .. }
            | Operation::SetupMapping
            | Operation::RemoveMapping
            | Operation::Init(_)
            | Operation::Unknown { .. } => Err(Errno::ENOSYS),
        }
    }
}

impl Handler for MemFs {
    fn handle(&self, _ctx: &RequestCtx<'_>, req: &Request<'_>, out: &mut [u8]) -> Reply {
        self.dispatch(req, out).unwrap_or_else(Reply::Error)
    }
}

/// A fixed-size reply struct.
fn bytes<T: IntoBytes + Immutable>(out: &mut [u8], v: &T) -> Result<Reply, Errno> {
    reply::put(out, v).map(Reply::Bytes).ok_or(Errno::EIO)
}

/// GETXATTR/LISTXATTR: `size == 0` asks for the size; a smaller buffer is ERANGE.
fn sized_reply(data: &[u8], size: u32, out: &mut [u8]) -> Result<Reply, Errno> {
    let len = u32::try_from(data.len()).map_err(|_| Errno::E2BIG)?;
    if size == 0 {
        let n = reply::xattr_size(out, len).ok_or(Errno::EIO)?;
        return Ok(Reply::Bytes(n));
    }
    if size < len {
        return Err(Errno::ERANGE);
    }
    reply::put_bytes(out, data)
        .map(Reply::Bytes)
        .ok_or(Errno::EIO)
}

fn entry_ino(locked: &Locked<'_>, dir: u64, name: &[u8]) -> Option<u64> {
    locked.get(dir)?.dir()?.get(name).map(|e| e.ino)
}

/// Removes `name` (naming `child`) from `parent`, dropping `child` if nothing else
/// references it. All three must be locked; `child` must be an empty directory or not one.
fn unlink_entry(locked: &mut Locked<'_>, parent: u64, name: &[u8], child: u64) {
    let mut child_is_dir = false;
    if let Some(c) = locked.get_mut(child) {
        child_is_dir = c.is_dir();
        c.nlink = if child_is_dir {
            0
        } else {
            c.nlink.saturating_sub(1)
        };
        c.ctime = Time::now();
        if c.is_dead() {
            locked.remove(child);
        }
    }
    if let Some(p) = locked.get_mut(parent) {
        if let Some(dir) = p.dir_mut() {
            dir.remove(name);
        }
        if child_is_dir {
            p.nlink = p.nlink.saturating_sub(1);
        }
        p.touch_data();
    }
}

/// The names and inode of a rename, all locked.
struct Move<'n> {
    olddir: u64,
    name: &'n [u8],
    newdir: u64,
    newname: &'n [u8],
    src: u64,
}

/// Plain rename: `src` leaves `olddir/name` for `newdir/newname`, replacing `dst` if any.
fn move_entry(locked: &mut Locked<'_>, mv: &Move<'_>, dst: Option<u64>) -> Result<(), Errno> {
    let src_inode = locked.get(mv.src).ok_or(Errno::ENOENT)?;
    let src_is_dir = src_inode.is_dir();
    let typ = dirent_type(src_inode.mode);
    if locked.get(mv.newdir).ok_or(Errno::ENOENT)?.nlink == 0 {
        return Err(Errno::ENOENT);
    }
    if let Some(dst) = dst {
        let target = locked.get(dst).ok_or(Errno::ENOENT)?;
        match (src_is_dir, target.dir()) {
            (true, None) => return Err(Errno::ENOTDIR),
            (false, Some(_)) => return Err(Errno::EISDIR),
            (true, Some(d)) if !d.is_empty() => return Err(Errno::ENOTEMPTY),
            _ => {}
        }
        unlink_entry(locked, mv.newdir, mv.newname, dst);
    }
    if let Some(dir) = locked.get_mut(mv.olddir).and_then(Inode::dir_mut) {
        dir.remove(mv.name);
    }
    if let Some(dir) = locked.get_mut(mv.newdir).and_then(Inode::dir_mut) {
        dir.insert(mv.newname, mv.src, typ);
    }
    if src_is_dir && mv.olddir != mv.newdir {
        reparent(locked, mv.src, mv.olddir, mv.newdir);
    }
    finish_move(locked, mv, &[mv.src]);
    Ok(())
}

/// RENAME_EXCHANGE: the two names swap inodes.
fn exchange_entries(locked: &mut Locked<'_>, mv: &Move<'_>, dst: u64) -> Result<(), Errno> {
    let src_inode = locked.get(mv.src).ok_or(Errno::ENOENT)?;
    let (src_is_dir, src_typ) = (src_inode.is_dir(), dirent_type(src_inode.mode));
    let dst_inode = locked.get(dst).ok_or(Errno::ENOENT)?;
    let (dst_is_dir, dst_typ) = (dst_inode.is_dir(), dirent_type(dst_inode.mode));
    if let Some(dir) = locked.get_mut(mv.olddir).and_then(Inode::dir_mut) {
        dir.replace(mv.name, dst, dst_typ);
    }
    if let Some(dir) = locked.get_mut(mv.newdir).and_then(Inode::dir_mut) {
        dir.replace(mv.newname, mv.src, src_typ);
    }
    if mv.olddir != mv.newdir {
        if src_is_dir {
            reparent(locked, mv.src, mv.olddir, mv.newdir);
        }
        if dst_is_dir {
            reparent(locked, dst, mv.newdir, mv.olddir);
        }
    }
    finish_move(locked, mv, &[mv.src, dst]);
    Ok(())
}

/// Directory `dir` moved from `from` to `to`: its ".." and both parents' link counts.
fn reparent(locked: &mut Locked<'_>, dir: u64, from: u64, to: u64) {
    if let Some(d) = locked.get_mut(dir).and_then(Inode::dir_mut) {
        d.parent = to;
    }
    if let Some(p) = locked.get_mut(from) {
        p.nlink = p.nlink.saturating_sub(1);
    }
    if let Some(p) = locked.get_mut(to) {
        p.nlink += 1;
    }
}

fn finish_move(locked: &mut Locked<'_>, mv: &Move<'_>, moved: &[u64]) {
    let now = Time::now();
    for &ino in moved {
        if let Some(i) = locked.get_mut(ino) {
            i.ctime = now;
        }
    }
    for dir in [mv.olddir, mv.newdir] {
        if let Some(d) = locked.get_mut(dir) {
            d.mtime = now;
            d.ctime = now;
        }
    }
}

/// The memfd of a regular file, created on first need.
fn file_of(inode: &mut Inode) -> Result<Arc<File>, Errno> {
    match &mut inode.kind {
        Kind::File(Some(file)) => Ok(Arc::clone(file)),
        Kind::File(slot @ None) => {
            let file = Arc::new(memfd()?);
            *slot = Some(Arc::clone(&file));
            Ok(file)
        }
        Kind::Dir(_) => Err(Errno::EISDIR),
        Kind::Symlink(_) | Kind::Special => Err(Errno::EINVAL),
    }
}

/// Truncates or extends a regular file (new bytes read as zeros).
fn set_size(inode: &mut Inode, size: u64) -> Result<(), Errno> {
    if size > i64::MAX as u64 {
        return Err(Errno::EFBIG);
    }
    let needs_file = match &inode.kind {
        Kind::File(None) => size != 0,
        Kind::File(Some(_)) => true,
        Kind::Dir(_) => return Err(Errno::EISDIR),
        Kind::Symlink(_) | Kind::Special => return Err(Errno::EINVAL),
    };
    if needs_file {
        file_of(inode)?.set_len(size).map_err(io_errno)?;
    }
    inode.size = size;
    Ok(())
}

/// A file-descriptor shortage is, to the application, a full filesystem.
fn io_errno(e: io::Error) -> Errno {
    match Errno::from(e) {
        e if e == Errno::EMFILE || e == Errno::ENFILE => {
            log::warn!("memfs: out of file descriptors for file data ({e}); raise RLIMIT_NOFILE");
            Errno::ENOSPC
        }
        e => e,
    }
}

/// Where file data lives: an unnamed file in this tmpfs, so it is memory, and READ replies can
/// be spliced from it.
const DATA_DIR: &str = "/dev/shm";

/// An anonymous memory-backed file (`O_TMPFILE` on tmpfs: it has no name and vanishes with
/// its last descriptor).
fn memfd() -> Result<File, Errno> {
    use std::os::unix::fs::OpenOptionsExt as _;
    File::options()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
        .mode(0o600)
        .open(DATA_DIR)
        .map_err(io_errno)
}
