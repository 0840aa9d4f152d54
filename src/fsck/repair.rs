//! Applies the repairs a [`Checker`] planned, only while no node is mounted: every
//! transaction compares that no node record exists (a node mounting meanwhile fails it,
//! and the repair stops) and that every key it changes is unchanged since the check's
//! revision (or, for keys it creates, absent).

use std::path::Path;

use meta::{
    codec::{Dentry, DirParent, InoCounter, InodeAttr, Record as _},
    keys::KeyRange,
    kv::{Compare, CompareOp, CompareTarget, KvBackend, RangeRequest, Txn, TxnOp},
    types::{FileType, GroupId, Ino, Timespec},
};

use super::check::{Checker, Fix};
use crate::data::{device::psync::PsyncDev, mkfs as dmkfs};

/// Released records deleted per transaction (with the map, in the first).
const RELEASED_PER_TXN: usize = 100;
/// The name of the directory unreachable inodes are linked into.
const LOST_FOUND: &[u8] = b"lost+found";

/// The order repairs run in: later ones rely on earlier ones (the counter before the new
/// lost+found takes a number; names before link counts; maps last, after every removal).
fn stage(f: &Fix) -> u8 {
    match f {
        Fix::RewriteSuperblock { .. } => 0,
        Fix::Delete(_) => 1,
        Fix::RaiseCounter { .. } => 2,
        Fix::DentryKind { .. } | Fix::SetParent { .. } => 3,
        Fix::RemoveInode { .. } => 4,
        Fix::Reconnect { .. } => 5,
        Fix::SetNlink { .. } => 6,
        // After the link counts, which also rewrite inodes: this one compares only what it
        // read, not the scan's revision.
        Fix::InodeFlags { .. } => 7,
        Fix::RebuildMap { .. } => 8,
    }
}

struct Ctx<'a> {
    kv: &'a dyn KvBackend,
    ck: &'a Checker,
    lost_found: Option<Ino>,
}

/// Why a transaction did not commit.
enum Stop {
    /// A compare failed: say whether a node mounted.
    Changed(String),
    Error(String),
}

impl Ctx<'_> {
    /// Unchanged since the check's revision (absent keys compare as revision 0).
    fn unchanged(&self, key: Vec<u8>) -> Compare {
        Compare {
            key,
            range_end: None,
            op: CompareOp::Less,
            target: CompareTarget::ModRevision(self.ck.revision + 1),
        }
    }

    fn unchanged_range(&self, r: KeyRange) -> Compare {
        Compare {
            key: r.start,
            range_end: Some(r.end),
            op: CompareOp::Less,
            target: CompareTarget::ModRevision(self.ck.revision + 1),
        }
    }

    async fn commit(
        &self,
        what: &str,
        mut compares: Vec<Compare>,
        ops: Vec<TxnOp>,
    ) -> Result<(), Stop> {
        let m = self.ck.keys().members();
        compares.push(Compare::range_empty(m.start.clone(), m.end.clone()));
        let r = self
            .kv
            .txn(Txn {
                compares,
                success: ops,
                failure: vec![],
            })
            .await
            .map_err(|e| Stop::Error(format!("{what}: {e}")))?;
        if r.succeeded {
            return Ok(());
        }
        let mounted = self
            .kv
            .range(RangeRequest::range(m.start, m.end).keys_only().limit(1))
            .await
            .map(|r| !r.kvs.is_empty())
            .unwrap_or(false);
        Err(Stop::Changed(if mounted {
            format!("{what}: a node mounted the filesystem during the repair")
        } else {
            format!("{what}: the records changed since the check")
        }))
    }

    async fn get(&self, key: &[u8]) -> Result<Option<meta::kv::KeyValue>, Stop> {
        let r = self
            .kv
            .range(RangeRequest::key(key.to_vec()))
            .await
            .map_err(|e| Stop::Error(e.to_string()))?;
        Ok(r.kvs.into_iter().next())
    }

    async fn apply(
        &mut self,
        fix: &Fix,
        dev: Option<(&mut PsyncDev, &Path, [u8; 16])>,
    ) -> Result<(), Stop> {
        let keys = self.ck.keys().clone();
        match fix {
            Fix::RewriteSuperblock { .. } => {
                let Some((dev, dev_path, uuid)) = dev else {
                    return Err(Stop::Error("no device to rewrite the superblock on".into()));
                };
                // `check` rewrites whichever copy is damaged from the valid one.
                dmkfs::check(dev, dev_path, uuid)
                    .map(|_| ())
                    .map_err(|e| Stop::Error(e.to_string()))
            }
            Fix::Delete(key) => {
                let what = format!("deleting {}", keys.describe(key));
                self.commit(
                    &what,
                    vec![self.unchanged(key.clone())],
                    vec![TxnOp::delete(key.clone())],
                )
                .await
            }
            Fix::RaiseCounter { next } => {
                let key = keys.ino_counter();
                let cur = self.get(&key).await?;
                let (now, rev) = match &cur {
                    Some(kv) => (
                        InoCounter::decode(&kv.value).map(|c| c.next).unwrap_or(0),
                        kv.mod_revision,
                    ),
                    None => (Ino::FIRST_DYNAMIC, 0),
                };
                if now >= *next {
                    return Ok(());
                }
                self.commit(
                    "raising the inode counter",
                    vec![Compare::mod_rev(key.clone(), rev)],
                    vec![TxnOp::put(key, InoCounter { next: *next }.encode())],
                )
                .await
            }
            Fix::DentryKind { key, dentry } => {
                let what = format!("rewriting {}", keys.describe(key));
                self.commit(
                    &what,
                    vec![self.unchanged(key.clone())],
                    vec![TxnOp::put(key.clone(), dentry.encode())],
                )
                .await
            }
            Fix::SetParent { dir, parent } => {
                let key = keys.dir_parent(*dir);
                self.commit(
                    &format!("setting the parent of directory {dir}"),
                    vec![self.unchanged(key.clone())],
                    vec![TxnOp::put(key, DirParent { parent: *parent }.encode())],
                )
                .await
            }
            Fix::RemoveInode { ino, kind } => {
                let (e, x, k, h) = (
                    keys.extents(*ino),
                    keys.xattrs(*ino),
                    keys.cache_locks(*ino),
                    keys.holders(*ino),
                );
                let mut ops = vec![
                    TxnOp::delete(keys.inode(*ino)),
                    TxnOp::delete_range(e.start.clone(), e.end.clone(), false),
                    TxnOp::delete_range(x.start.clone(), x.end.clone(), false),
                    TxnOp::delete_range(k.start, k.end, false),
                    TxnOp::delete_range(h.start, h.end, false),
                    TxnOp::delete(keys.orphan(*ino)),
                ];
                match kind {
                    Some(FileType::Symlink) => ops.push(TxnOp::delete(keys.symlink(*ino))),
                    Some(FileType::Directory) => ops.push(TxnOp::delete(keys.dir_parent(*ino))),
                    _ => {}
                }
                let compares = vec![
                    self.unchanged(keys.inode(*ino)),
                    self.unchanged_range(e),
                    self.unchanged_range(x),
                ];
                self.commit(&format!("removing inode {ino}"), compares, ops)
                    .await
            }
            Fix::Reconnect {
                ino,
                kind,
                old_parent,
            } => {
                let lf = match self.lost_found {
                    Some(lf) => lf,
                    None => {
                        let lf = self.create_lost_found().await?;
                        self.lost_found = Some(lf);
                        lf
                    }
                };
                let name = format!("#{ino}").into_bytes();
                let dkey = keys.dentry(lf, &name);
                let mut compares = vec![
                    Compare::absent(dkey.clone()),
                    Compare::exists(keys.inode(*ino)),
                ];
                let mut ops = vec![TxnOp::put(
                    dkey,
                    Dentry {
                        ino: *ino,
                        kind: *kind,
                    }
                    .encode(),
                )];
                if *kind == FileType::Directory {
                    let pkey = keys.dir_parent(*ino);
                    compares.push(self.unchanged(pkey.clone()));
                    ops.push(TxnOp::put(pkey, DirParent { parent: lf }.encode()));
                }
                if let Some(old) = old_parent {
                    // The entry that named it in the cycle: found in its old directory.
                    let r = keys.dentries(*old);
                    let resp = self
                        .kv
                        .range(RangeRequest::range(r.start, r.end).at(self.ck.revision))
                        .await
                        .map_err(|e| Stop::Error(e.to_string()))?;
                    for kv in resp.kvs {
                        if Dentry::decode(&kv.value).is_ok_and(|d| d.ino == *ino) {
                            compares.push(self.unchanged(kv.key.clone()));
                            ops.push(TxnOp::delete(kv.key));
                        }
                    }
                }
                self.commit(
                    &format!("linking inode {ino} into /lost+found"),
                    compares,
                    ops,
                )
                .await
            }
            Fix::SetNlink { ino, nlink } => {
                let key = keys.inode(*ino);
                let Some(kv) = self.get(&key).await? else {
                    return Err(Stop::Changed(format!("inode {ino} is gone")));
                };
                let mut a = InodeAttr::decode(&kv.value).map_err(|e| Stop::Error(e.to_string()))?;
                a.nlink = *nlink;
                let compares = vec![
                    self.unchanged(key.clone()),
                    Compare::mod_rev(key.clone(), kv.mod_revision),
                ];
                self.commit(
                    &format!("setting the link count of inode {ino}"),
                    compares,
                    vec![TxnOp::put(key, a.encode())],
                )
                .await
            }
            Fix::InodeFlags { ino, set, clear } => {
                let key = keys.inode(*ino);
                let Some(kv) = self.get(&key).await? else {
                    return Err(Stop::Changed(format!("inode {ino} is gone")));
                };
                let mut a = InodeAttr::decode(&kv.value).map_err(|e| Stop::Error(e.to_string()))?;
                a.flags = (a.flags | set) & !clear;
                let compares = vec![Compare::mod_rev(key.clone(), kv.mod_revision)];
                self.commit(
                    &format!("setting the xattr flags of inode {ino}"),
                    compares,
                    vec![TxnOp::put(key, a.encode())],
                )
                .await
            }
            Fix::RebuildMap { group } => {
                let Some(map) = self.ck.rebuilt_map(*group) else {
                    return Err(Stop::Error(format!("group {group}: no rebuilt map")));
                };
                let fkey = keys.free_map(GroupId(*group));
                let released = self.ck.released_in(*group);
                // A load applies every released record, so none may outlive the map that
                // no longer needs it: all but the last page go first (a crash between leaves
                // blocks used in the old map, a leak a second run finds, never a record that
                // would free blocks a file uses), the last with the map.
                let mut chunks: Vec<&[Vec<u8>]> = released.chunks(RELEASED_PER_TXN).collect();
                let last = chunks.pop().unwrap_or(&[]);
                let what = format!("rewriting group {group}'s free map");
                for c in chunks {
                    let compares = c.iter().map(|k| self.unchanged(k.clone())).collect();
                    let ops = c.iter().map(|k| TxnOp::delete(k.clone())).collect();
                    self.commit(&what, compares, ops).await?;
                }
                let mut compares = vec![
                    self.unchanged(fkey.clone()),
                    Compare::absent(keys.group(GroupId(*group))),
                ];
                let mut ops = vec![TxnOp::put(fkey, map.encode())];
                for k in last {
                    compares.push(self.unchanged(k.clone()));
                    ops.push(TxnOp::delete(k.clone()));
                }
                self.commit(&what, compares, ops).await?;
                Ok(())
            }
        }
    }

    /// Creates `/lost+found` (mode 0700, root's), numbered from the inode counter.
    async fn create_lost_found(&self) -> Result<Ino, Stop> {
        let keys = self.ck.keys().clone();
        let ckey = keys.ino_counter();
        let cur = self.get(&ckey).await?;
        let (next, rev) = match &cur {
            Some(kv) => (
                InoCounter::decode(&kv.value)
                    .map(|c| c.next)
                    .map_err(|e| Stop::Error(e.to_string()))?,
                kv.mod_revision,
            ),
            None => (Ino::FIRST_DYNAMIC, 0),
        };
        let ino = Ino(next);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let now = Timespec::new(
            i64::try_from(now.as_secs()).unwrap_or(0),
            now.subsec_nanos(),
        );
        let subdirs = self.ck.new_lost_found_subdirs();
        let attr = InodeAttr {
            ino,
            kind: FileType::Directory,
            perm: 0o700,
            uid: 0,
            gid: 0,
            size: 0,
            nlink: 2 + subdirs,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            rdev: 0,
            generation: 1,
            flags: 0,
        };
        let dkey = keys.dentry(Ino::ROOT, LOST_FOUND);
        let compares = vec![
            Compare::mod_rev(ckey.clone(), rev),
            Compare::absent(dkey.clone()),
            Compare::absent(keys.inode(ino)),
        ];
        let ops = vec![
            TxnOp::put(ckey, InoCounter { next: next + 1 }.encode()),
            TxnOp::put(keys.inode(ino), attr.encode()),
            TxnOp::put(
                keys.dir_parent(ino),
                DirParent { parent: Ino::ROOT }.encode(),
            ),
            TxnOp::put(
                dkey,
                Dentry {
                    ino,
                    kind: FileType::Directory,
                }
                .encode(),
            ),
        ];
        self.commit("creating /lost+found", compares, ops).await?;
        Ok(ino)
    }
}

/// Applies the plan in stages; stops at the first repair that cannot commit. Returns
/// which fixes ran, and why the repair stopped (if it did).
pub(super) async fn apply(
    kv: &dyn KvBackend,
    ck: &Checker,
    mut dev: Option<(&mut PsyncDev, &Path, [u8; 16])>,
) -> (Vec<bool>, Option<String>) {
    let mut order: Vec<usize> = (0..ck.plan.len()).collect();
    order.sort_by_key(|&i| stage(&ck.plan[i]));
    let mut applied = vec![false; ck.plan.len()];
    let mut ctx = Ctx {
        kv,
        ck,
        lost_found: ck.lost_found,
    };
    // Several findings can share one repair (every leaked range of a group asks for that
    // group's map to be rebuilt; either damaged superblock copy is rewritten by one
    // check): each runs once, and counts for all of them.
    let mut done: Vec<Fix> = Vec::new();
    let key = |f: &Fix| match f {
        Fix::RewriteSuperblock { .. } => Some(Fix::RewriteSuperblock { backup: false }),
        Fix::RebuildMap { .. } => Some(f.clone()),
        _ => None,
    };
    for i in order {
        let fix = &ck.plan[i];
        let once = key(fix);
        if once.as_ref().is_some_and(|k| done.contains(k)) {
            applied[i] = true;
            continue;
        }
        match ctx
            .apply(fix, dev.as_mut().map(|(d, p, u)| (&mut **d, *p, *u)))
            .await
        {
            Ok(()) => {
                applied[i] = true;
                done.extend(once);
            }
            Err(Stop::Changed(why)) => {
                return (applied, Some(format!("{why}; run fsck again")));
            }
            Err(Stop::Error(why)) => return (applied, Some(why)),
        }
    }
    (applied, None)
}
