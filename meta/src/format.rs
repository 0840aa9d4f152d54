//! mkfs's metadata half: the superblock record and the root directory, written in one
//! transaction that refuses an already formatted prefix unless forced.

use crate::{
    codec::{DirParent, InodeAttr, Record, SuperRecord},
    error::MetaError,
    keys::Keyspace,
    kv::{Compare, KvBackend, Txn, TxnOp},
    types::{FileType, Ino, Timespec},
};

/// Owner and mode of the root directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootOwner {
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
    /// Permission bits.
    pub perm: u16,
}

/// Writes the superblock record and the root directory (inode 1, its own parent).
/// Fails with `Exists` if the prefix already holds a superblock and `force` is false;
/// with `force` every key under the prefix is deleted in the same transaction.
pub async fn format(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    sb: &SuperRecord,
    root: RootOwner,
    now: Timespec,
    force: bool,
) -> Result<(), MetaError> {
    if sb.validate().is_err() || root.perm > 0o7777 || !now.is_valid() {
        return Err(MetaError::Invalid("bad superblock or root attributes"));
    }
    let attr = InodeAttr {
        ino: Ino::ROOT,
        kind: FileType::Directory,
        perm: root.perm,
        uid: root.uid,
        gid: root.gid,
        size: 0,
        nlink: 2,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
        rdev: 0,
        generation: 1,
        flags: 0,
    };
    let mut success = Vec::new();
    let mut compares = Vec::new();
    if force {
        let all = keys.all();
        success.push(TxnOp::delete_range(all.start, all.end, false));
    } else {
        compares.push(Compare::absent(keys.superblock()));
    }
    // With force, the range delete and these puts overlap; etcd forbids that in one
    // branch, so the forced format deletes first in a separate transaction.
    if force {
        let t = Txn {
            compares: vec![],
            success: std::mem::take(&mut success),
            failure: vec![],
        };
        kv.txn(t).await?;
    }
    success.push(TxnOp::put(keys.superblock(), sb.encode()));
    success.push(TxnOp::put(keys.inode(Ino::ROOT), attr.encode()));
    success.push(TxnOp::put(
        keys.dir_parent(Ino::ROOT),
        DirParent { parent: Ino::ROOT }.encode(),
    ));
    let r = kv
        .txn(Txn {
            compares,
            success,
            failure: vec![],
        })
        .await?;
    if !r.succeeded {
        return Err(MetaError::Exists);
    }
    Ok(())
}
