//! One in-memory inode, and directory contents with stable READDIR offsets.

use std::{
    collections::BTreeMap,
    fs::File,
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use fusedev::abi::Attr;

/// Preferred I/O size reported in `st_blksize`.
const BLKSIZE: u32 = 4096;
/// `st_size` reported for directories.
pub(super) const DIR_SIZE: u64 = 4096;

/// A timestamp: seconds since the epoch (negative before it) and nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Time {
    pub(super) secs: i64,
    pub(super) nsecs: u32,
}

impl Time {
    pub(super) fn now() -> Time {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => Time {
                secs: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                nsecs: d.subsec_nanos(),
            },
            Err(_) => Time { secs: 0, nsecs: 0 },
        }
    }

    /// From the wire, where seconds are an i64 carried in a u64.
    pub(super) fn from_wire(secs: u64, nsecs: u32) -> Time {
        Time {
            secs: secs as i64,
            nsecs: nsecs.min(999_999_999),
        }
    }
}

pub(super) enum Kind {
    Dir(Dir),
    /// Contents live in a memfd, created on the first write or extension: empty files
    /// (most of what metadata benchmarks create) cost no file descriptor.
    File(Option<Arc<File>>),
    Symlink(Vec<u8>),
    /// Device nodes, FIFOs and sockets: attributes only.
    Special,
}

pub(super) struct Inode {
    pub(super) generation: u64,
    pub(super) kind: Kind,
    /// File type and permission bits.
    pub(super) mode: u32,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) rdev: u32,
    pub(super) nlink: u32,
    pub(super) size: u64,
    pub(super) atime: Time,
    pub(super) mtime: Time,
    pub(super) ctime: Time,
    /// References the kernel holds (LOOKUP and friends add one, FORGET subtracts). The
    /// inode is dropped when this and `nlink` are both 0.
    pub(super) lookups: u64,
    pub(super) xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl Inode {
    pub(super) fn new(kind: Kind, mode: u32, uid: u32, gid: u32, generation: u64) -> Inode {
        let now = Time::now();
        let (nlink, size) = match &kind {
            Kind::Dir(_) => (2, DIR_SIZE),
            Kind::Symlink(target) => (1, target.len() as u64),
            Kind::File(_) | Kind::Special => (1, 0),
        };
        Inode {
            generation,
            kind,
            mode,
            uid,
            gid,
            rdev: 0,
            nlink,
            size,
            atime: now,
            mtime: now,
            ctime: now,
            lookups: 0,
            xattrs: BTreeMap::new(),
        }
    }

    pub(super) fn is_dir(&self) -> bool {
        matches!(self.kind, Kind::Dir(_))
    }

    pub(super) fn dir(&self) -> Option<&Dir> {
        match &self.kind {
            Kind::Dir(d) => Some(d),
            _ => None,
        }
    }

    pub(super) fn dir_mut(&mut self) -> Option<&mut Dir> {
        match &mut self.kind {
            Kind::Dir(d) => Some(d),
            _ => None,
        }
    }

    /// Unreferenced by names and by the kernel: may be dropped.
    pub(super) fn is_dead(&self) -> bool {
        self.nlink == 0 && self.lookups == 0
    }

    pub(super) fn attr(&self, ino: u64) -> Attr {
        Attr {
            ino,
            size: self.size,
            blocks: self.size.div_ceil(512),
            atime: self.atime.secs as u64,
            mtime: self.mtime.secs as u64,
            ctime: self.ctime.secs as u64,
            atimensec: self.atime.nsecs,
            mtimensec: self.mtime.nsecs,
            ctimensec: self.ctime.nsecs,
            mode: self.mode,
            nlink: self.nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: self.rdev,
            blksize: BLKSIZE,
            flags: 0,
        }
    }

    /// Mark a data change.
    pub(super) fn touch_data(&mut self) {
        let now = Time::now();
        self.mtime = now;
        self.ctime = now;
    }

    /// Clear set-user-id, and set-group-id when group-execute is set (without it the bit
    /// means mandatory locking, which a write does not clear).
    pub(super) fn kill_suid(&mut self) {
        let mut mode = self.mode & !libc::S_ISUID;
        if mode & libc::S_IXGRP != 0 {
            mode &= !libc::S_ISGID;
        }
        self.mode = mode;
    }
}

/// A directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) ino: u64,
    /// READDIR offset of this entry; never reused within the directory.
    pub(super) cookie: u64,
    /// `DT_*`, so READDIR need not look at the child.
    pub(super) typ: u32,
}

/// Directory contents. Names map to entries; cookies (handed out in increasing order)
/// map back to names, so a READDIR resumed at any offset neither repeats nor skips an
/// entry that stayed in place, whatever was added or removed meanwhile.
pub(super) struct Dir {
    pub(super) parent: u64,
    entries: BTreeMap<Vec<u8>, Entry>,
    order: BTreeMap<u64, Vec<u8>>,
    next_cookie: u64,
}

/// READDIR offsets 1 and 2 are "." and ".."; entries start after them.
pub(super) const FIRST_COOKIE: u64 = 3;

impl Dir {
    pub(super) fn new(parent: u64) -> Dir {
        Dir {
            parent,
            entries: BTreeMap::new(),
            order: BTreeMap::new(),
            next_cookie: FIRST_COOKIE,
        }
    }

    pub(super) fn get(&self, name: &[u8]) -> Option<Entry> {
        self.entries.get(name).copied()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub(super) fn insert(&mut self, name: &[u8], ino: u64, typ: u32) {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        if let Some(old) = self
            .entries
            .insert(name.to_vec(), Entry { ino, cookie, typ })
        {
            self.order.remove(&old.cookie);
        }
        self.order.insert(cookie, name.to_vec());
    }

    pub(super) fn remove(&mut self, name: &[u8]) -> Option<Entry> {
        let entry = self.entries.remove(name)?;
        self.order.remove(&entry.cookie);
        Some(entry)
    }

    /// Points `name` at another inode in place (RENAME_EXCHANGE), keeping its offset.
    pub(super) fn replace(&mut self, name: &[u8], ino: u64, typ: u32) {
        if let Some(e) = self.entries.get_mut(name) {
            e.ino = ino;
            e.typ = typ;
        }
    }

    /// Up to `max` entries with offsets greater than `offset`, in offset order.
    pub(super) fn after(&self, offset: u64, max: usize) -> Vec<(u64, Vec<u8>, Entry)> {
        self.order
            .range(offset.saturating_add(1)..)
            .take(max)
            .filter_map(|(&cookie, name)| Some((cookie, name.clone(), *self.entries.get(name)?)))
            .collect()
    }
}
