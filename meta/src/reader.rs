//! Reads of metadata. Each is one etcd range request (linearizable: a read started
//! after a mutation's ticket completed sees that mutation).

use crate::{
    codec::{decode_at, Dentry, Extent, InodeAttr, Owner, SuperRecord, SymlinkTarget, XattrValue},
    error::MetaError,
    keys::{KeyKind, Keyspace},
    kv::{KvBackend, RangeRequest, Txn, TxnOp, TxnOpResponse},
    types::{Ino, Revision, SessionId},
};

/// One directory entry as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    /// The name.
    pub name: Vec<u8>,
    /// The child.
    pub entry: Dentry,
    /// Readdir cookie of this entry ([`crate::keys::dir_cookie`]).
    pub cookie: u64,
}

/// A page of a directory listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirPage {
    /// Entries in name order.
    pub entries: Vec<DirEntry>,
    /// More entries follow the last one.
    pub more: bool,
    /// Revision the page was read at.
    pub revision: Revision,
}

/// A directory's whole name set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirNames {
    /// All entries, in name order.
    pub entries: Vec<DirEntry>,
    /// Revision of the read (a watch from `revision + 1` keeps it current).
    pub revision: Revision,
}

/// An orphan record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrphanRec {
    /// The unlinked-but-open inode.
    pub ino: Ino,
    /// The session that kept it open.
    pub session: SessionId,
}

fn to_entries(keys: &Keyspace, kvs: &[crate::kv::KeyValue]) -> Result<Vec<DirEntry>, MetaError> {
    kvs.iter()
        .map(|kv| {
            let Some(KeyKind::Dentry(_, name)) = keys.parse(&kv.key) else {
                return Err(MetaError::Corrupt {
                    key: keys.describe(&kv.key),
                    reason: "not a dentry key".into(),
                });
            };
            let entry: Dentry = decode_at(keys, &kv.key, &kv.value)?;
            Ok(DirEntry {
                cookie: crate::keys::dir_cookie(&name),
                name,
                entry,
            })
        })
        .collect()
}

/// Reads an inode's attributes and mod revision.
pub async fn get_inode(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    ino: Ino,
) -> Result<Option<(InodeAttr, Revision)>, MetaError> {
    let key = keys.inode(ino);
    let r = kv.range(RangeRequest::key(key.clone())).await?;
    let Some(item) = r.kvs.first() else {
        return Ok(None);
    };
    let attr: InodeAttr = decode_at(keys, &key, &item.value)?;
    if attr.ino != ino {
        return Err(MetaError::Corrupt {
            key: keys.describe(&key),
            reason: format!("inode record says ino {}", attr.ino),
        });
    }
    Ok(Some((attr, Revision(item.mod_revision))))
}

/// Reads an inode's attributes (None if absent) with the store revision of the read (every
/// change up to it is reflected; a watch from `revision + 1` keeps the value current).
pub async fn get_inode_at(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    ino: Ino,
) -> Result<(Option<InodeAttr>, Revision), MetaError> {
    let key = keys.inode(ino);
    let r = kv.range(RangeRequest::key(key.clone())).await?;
    let rev = Revision(r.revision);
    let Some(item) = r.kvs.first() else {
        return Ok((None, rev));
    };
    let attr: InodeAttr = decode_at(keys, &key, &item.value)?;
    if attr.ino != ino {
        return Err(MetaError::Corrupt {
            key: keys.describe(&key),
            reason: format!("inode record says ino {}", attr.ino),
        });
    }
    Ok((Some(attr), rev))
}

/// An inode's attributes and the first `limit` extents of its map, read at one revision
/// (one read-only transaction): what an open needs to serve its file's reads without
/// etcd afterwards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InodeWithExtents {
    /// The attributes (None if the inode is absent).
    pub attr: Option<InodeAttr>,
    /// Extents in offset order, from offset 0.
    pub extents: Vec<Extent>,
    /// More extents follow the last one.
    pub more: bool,
    /// Revision of the read.
    pub revision: Revision,
}

/// Reads an inode's attributes and the first `limit` extents of its map at one revision.
pub async fn inode_with_extents_at(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    ino: Ino,
    limit: usize,
) -> Result<InodeWithExtents, MetaError> {
    let key = keys.inode(ino);
    let range = keys.extents(ino);
    let lim = i64::try_from(limit.max(1)).unwrap_or(i64::MAX);
    let txn = Txn {
        compares: Vec::new(),
        success: vec![
            TxnOp::Range(RangeRequest::key(key.clone())),
            TxnOp::Range(RangeRequest::range(range.start, range.end).limit(lim)),
        ],
        failure: Vec::new(),
    };
    let r = kv.txn(txn).await?;
    let mut ranges = r.responses.into_iter().filter_map(|op| match op {
        TxnOpResponse::Range(rr) => Some(rr),
        _ => None,
    });
    let (Some(inode), Some(map)) = (ranges.next(), ranges.next()) else {
        return Err(MetaError::Corrupt {
            key: keys.describe(&key),
            reason: "a read of the inode and its extents came back without both".into(),
        });
    };
    let revision = Revision(r.revision);
    let Some(item) = inode.kvs.first() else {
        return Ok(InodeWithExtents {
            attr: None,
            extents: Vec::new(),
            more: false,
            revision,
        });
    };
    let attr: InodeAttr = decode_at(keys, &key, &item.value)?;
    if attr.ino != ino {
        return Err(MetaError::Corrupt {
            key: keys.describe(&key),
            reason: format!("inode record says ino {}", attr.ino),
        });
    }
    let extents = map
        .kvs
        .iter()
        .map(|item| decode_extent(keys, item))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(InodeWithExtents {
        attr: Some(attr),
        extents,
        more: map.more,
        revision,
    })
}

/// Looks up one name, with the store revision of the read.
pub async fn lookup_at(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    parent: Ino,
    name: &[u8],
) -> Result<(Option<Dentry>, Revision), MetaError> {
    let key = keys.dentry(parent, name);
    let r = kv.range(RangeRequest::key(key.clone())).await?;
    let d = r
        .kvs
        .first()
        .map(|item| decode_at(keys, &key, &item.value))
        .transpose()?;
    Ok((d, Revision(r.revision)))
}

/// The store's current revision (one read of the superblock key).
pub async fn revision(kv: &dyn KvBackend, keys: &Keyspace) -> Result<Revision, MetaError> {
    let r = kv
        .range(RangeRequest::key(keys.superblock()).keys_only())
        .await?;
    Ok(Revision(r.revision))
}

/// How many inodes exist (orphans included): one count-only read of the `I` range
/// (etcd counts the range in its index and returns one key), linear in the inode count
/// inside etcd, so callers cache it.
pub async fn inode_count(kv: &dyn KvBackend, keys: &Keyspace) -> Result<u64, MetaError> {
    let r = keys.inodes();
    let resp = kv
        .range(RangeRequest::range(r.start, r.end).keys_only().limit(1))
        .await?;
    Ok(u64::try_from(resp.count).unwrap_or(0))
}

/// Looks up one name.
pub async fn lookup(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    parent: Ino,
    name: &[u8],
) -> Result<Option<Dentry>, MetaError> {
    let key = keys.dentry(parent, name);
    let r = kv.range(RangeRequest::key(key.clone())).await?;
    r.kvs
        .first()
        .map(|item| decode_at(keys, &key, &item.value))
        .transpose()
}

/// Lists up to `limit` entries of `parent` after `after` (None = from the start).
pub async fn list_dir(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    parent: Ino,
    after: Option<&[u8]>,
    limit: usize,
) -> Result<DirPage, MetaError> {
    let range = match after {
        Some(name) => keys.dentries_after(parent, name),
        None => keys.dentries(parent),
    };
    let limit = i64::try_from(limit.max(1)).unwrap_or(i64::MAX);
    let r = kv
        .range(RangeRequest::range(range.start, range.end).limit(limit))
        .await?;
    Ok(DirPage {
        entries: to_entries(keys, &r.kvs)?,
        more: r.more,
        revision: Revision(r.revision),
    })
}

/// Reads a directory's entire name set in one range request, or `OverLimit` when it has
/// more than `limit` entries (the caller then falls back to per-name lookups).
pub async fn dir_names(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    parent: Ino,
    limit: usize,
) -> Result<DirNames, MetaError> {
    let range = keys.dentries(parent);
    let lim = i64::try_from(limit).unwrap_or(i64::MAX);
    let r = kv
        .range(RangeRequest::range(range.start, range.end).limit(lim))
        .await?;
    if r.more {
        return Err(MetaError::OverLimit { limit });
    }
    Ok(DirNames {
        entries: to_entries(keys, &r.kvs)?,
        revision: Revision(r.revision),
    })
}

/// Reads up to `limit` extents of `ino` covering offsets from `from` on (including one
/// that starts before `from` and reaches past it). Returns the extents and whether more
/// follow.
pub async fn extents(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    ino: Ino,
    from: u64,
    limit: usize,
) -> Result<(Vec<Extent>, bool), MetaError> {
    let decode = |item: &crate::kv::KeyValue| decode_extent(keys, item);
    let mut out = Vec::new();
    if from > 0 {
        let before = RangeRequest::range(keys.extent(ino, 0), keys.extent(ino, from))
            .descending()
            .limit(1);
        if let Some(item) = kv.range(before).await?.kvs.first() {
            let e = decode(item)?;
            if e.file_end() > from {
                out.push(e);
            }
        }
    }
    let range = keys.extents_between(ino, from, u64::MAX);
    let lim = i64::try_from(limit.max(1)).unwrap_or(i64::MAX);
    let r = kv
        .range(RangeRequest::range(range.start, range.end).limit(lim))
        .await?;
    for item in &r.kvs {
        out.push(decode(item)?);
    }
    Ok((out, r.more))
}

/// An extent record read from etcd.
pub fn decode_extent(keys: &Keyspace, item: &crate::kv::KeyValue) -> Result<Extent, MetaError> {
    let Some(KeyKind::Extent(_, off)) = keys.parse(&item.key) else {
        return Err(MetaError::Corrupt {
            key: keys.describe(&item.key),
            reason: "not an extent key".into(),
        });
    };
    Extent::decode_value(off, &item.value).map_err(|e| e.at(keys.describe(&item.key)))
}

/// Reads a directory's parent (None if `dir` has no parent record).
pub async fn dir_parent(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    dir: Ino,
) -> Result<Option<Ino>, MetaError> {
    let key = keys.dir_parent(dir);
    let r = kv.range(RangeRequest::key(key.clone())).await?;
    r.kvs
        .first()
        .map(|item| decode_at::<crate::codec::DirParent>(keys, &key, &item.value).map(|p| p.parent))
        .transpose()
}

/// Reads a symlink's target.
pub async fn readlink(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    ino: Ino,
) -> Result<Option<Vec<u8>>, MetaError> {
    let key = keys.symlink(ino);
    let r = kv.range(RangeRequest::key(key.clone())).await?;
    r.kvs
        .first()
        .map(|item| decode_at::<SymlinkTarget>(keys, &key, &item.value).map(|t| t.0))
        .transpose()
}

/// Reads one xattr.
pub async fn get_xattr(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    ino: Ino,
    name: &[u8],
) -> Result<Option<Vec<u8>>, MetaError> {
    let key = keys.xattr(ino, name);
    let r = kv.range(RangeRequest::key(key.clone())).await?;
    r.kvs
        .first()
        .map(|item| decode_at::<XattrValue>(keys, &key, &item.value).map(|v| v.0))
        .transpose()
}

/// Lists xattr names of `ino` (at most `limit`, else `OverLimit`).
pub async fn list_xattrs(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    ino: Ino,
    limit: usize,
) -> Result<Vec<Vec<u8>>, MetaError> {
    let range = keys.xattrs(ino);
    let lim = i64::try_from(limit).unwrap_or(i64::MAX);
    let r = kv
        .range(
            RangeRequest::range(range.start, range.end)
                .limit(lim)
                .keys_only(),
        )
        .await?;
    if r.more {
        return Err(MetaError::OverLimit { limit });
    }
    Ok(r.kvs
        .iter()
        .filter_map(|item| match keys.parse(&item.key) {
            Some(KeyKind::Xattr(_, name)) => Some(name),
            _ => None,
        })
        .collect())
}

/// Reads the superblock record.
pub async fn superblock(
    kv: &dyn KvBackend,
    keys: &Keyspace,
) -> Result<Option<SuperRecord>, MetaError> {
    let key = keys.superblock();
    let r = kv.range(RangeRequest::key(key.clone())).await?;
    r.kvs
        .first()
        .map(|item| decode_at(keys, &key, &item.value))
        .transpose()
}

/// One page of the orphan records, in key (inode) order.
#[derive(Debug, Default)]
pub struct OrphanPage {
    /// The records that decoded.
    pub orphans: Vec<OrphanRec>,
    /// Records that did not (a key that is not an orphan's, a value that does not decode),
    /// each naming its key: skipped, for the caller to log.
    pub corrupt: Vec<MetaError>,
    /// The last key of the page when more follow: pass it as `after` for the next page.
    pub next: Option<Vec<u8>>,
}

/// Reads up to `limit` orphan records after key `after` (None: from the first). A record
/// that does not decode is reported in [`OrphanPage::corrupt`] and the page goes on: one
/// bad value must not hide every orphan after it.
pub async fn orphans_page(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    after: Option<&[u8]>,
    limit: usize,
) -> Result<OrphanPage, MetaError> {
    let all = keys.orphans();
    let start = match after {
        // The smallest key after `after`.
        Some(k) => {
            let mut s = k.to_vec();
            s.push(0);
            s.max(all.start)
        }
        None => all.start,
    };
    let lim = i64::try_from(limit.max(1)).unwrap_or(i64::MAX);
    let r = kv
        .range(RangeRequest::range(start, all.end).limit(lim))
        .await?;
    let mut page = OrphanPage::default();
    for item in &r.kvs {
        let Some(KeyKind::Orphan(ino)) = keys.parse(&item.key) else {
            page.corrupt.push(MetaError::Corrupt {
                key: keys.describe(&item.key),
                reason: "not an orphan key".into(),
            });
            continue;
        };
        match decode_at::<Owner>(keys, &item.key, &item.value) {
            Ok(o) => page.orphans.push(OrphanRec {
                ino,
                session: o.session,
            }),
            Err(e) => page.corrupt.push(e),
        }
    }
    if r.more {
        page.next = r.kvs.last().map(|kv| kv.key.clone());
    }
    Ok(page)
}

/// The first `limit` orphan records (corrupt ones logged and skipped; see
/// [`orphans_page`] to read them all).
pub async fn orphans(
    kv: &dyn KvBackend,
    keys: &Keyspace,
    limit: usize,
) -> Result<Vec<OrphanRec>, MetaError> {
    let page = orphans_page(kv, keys, None, limit).await?;
    for e in &page.corrupt {
        log::error!("{e}; skipped");
    }
    Ok(page.orphans)
}
