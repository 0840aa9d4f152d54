//! Access times under relatime, the Linux default: a read moves atime only when atime is
//! not after mtime or ctime (so "read since last modified?" stays answerable) or is a day
//! old. FUSE leaves atime to the filesystem (the kernel never updates it itself), so the
//! daemon does it on the READs and READDIRs it serves. What the kernel serves from its
//! page cache never reaches the daemon: a file this node read or wrote and reads again
//! from cached pages keeps its atime, as on NFS. `--noatime` turns it all off.
//!
//! Cost: a read that relatime lets move atime marks the open file (`atime_dirty`, shown
//! at once in its attributes); the time is written with the file's next mtime write, at
//! its last close on this node, its lock's hand-over, fsync or unmount (one `SetAttr` for
//! many reads, none for reads relatime skips). A directory's listing writes its atime
//! when due, once per listing from its start.

use super::*;

/// Seconds after which relatime moves atime even when it is after mtime and ctime.
const RELATIME_MAX_AGE_S: i64 = 24 * 60 * 60;

/// Whether a read at `now` moves `a`'s atime (`atime`: its current one, pending included).
pub(crate) fn relatime_due(a: &InodeAttr, atime: Timespec, now: Timespec) -> bool {
    atime <= a.mtime || atime <= a.ctime || now.sec.saturating_sub(atime.sec) >= RELATIME_MAX_AGE_S
}

/// A READ of an open file: marks its atime when relatime says so. No etcd.
pub(crate) fn note_read(f: &mut files::FileInner, noatime: bool) {
    if noatime {
        return;
    }
    let cur = f.atime_dirty.map_or(f.attr.atime, |t| t.max(f.attr.atime));
    // The pending mtime of overwrites counts as the file's mtime and ctime.
    let mut a = f.attr.clone();
    if let Some(m) = f.mtime_dirty {
        a.mtime = a.mtime.max(m);
        a.ctime = a.ctime.max(m);
    }
    if let Some(c) = f.ctime_dirty {
        a.ctime = a.ctime.max(c);
    }
    let now = SystemClock::new().wall();
    if relatime_due(&a, cur, now) {
        f.atime_dirty = Some(now);
    }
}

impl Inner {
    /// A listing of directory `ino` from its start: writes its atime when due.
    pub(super) fn note_readdir(&self, ino: u64) {
        if self.noatime {
            return;
        }
        let Some(a) = self.caches.attr(ino) else {
            return;
        };
        let now = SystemClock::new().wall();
        if !relatime_due(&a, a.atime, now) {
            return;
        }
        let m = Mutation::SetAttr {
            ino: Ino(ino),
            set: SetAttr {
                atime: Some(TimeSet::At(now)),
                access: true,
                ..SetAttr::default()
            },
        };
        if let Err(e) = self.commit(m) {
            log::debug!("writing the atime of directory {ino}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relatime_rules() {
        let t = |s| Timespec::new(s, 0);
        let mut a = InodeAttr {
            ino: Ino(5),
            kind: FileType::Regular,
            perm: 0o644,
            uid: 0,
            gid: 0,
            size: 0,
            nlink: 1,
            atime: t(100),
            mtime: t(100),
            ctime: t(100),
            crtime: t(100),
            rdev: 0,
            generation: 1,
            flags: 0,
        };
        // Not after mtime: due (the first read after a write).
        assert!(relatime_due(&a, a.atime, t(101)));
        a.atime = t(150);
        assert!(
            !relatime_due(&a, a.atime, t(200)),
            "read since the last change"
        );
        a.ctime = t(160);
        assert!(
            relatime_due(&a, a.atime, t(200)),
            "a chmod since the last read"
        );
        a.ctime = t(100);
        assert!(
            relatime_due(&a, a.atime, t(150 + RELATIME_MAX_AGE_S)),
            "a day old"
        );
        assert!(!relatime_due(&a, a.atime, t(149 + RELATIME_MAX_AGE_S)));
    }
}
