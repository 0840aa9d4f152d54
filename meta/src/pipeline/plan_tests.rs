//! Unit tests of `plan`, per mutation kind, against the in-memory model as the world:
//! plan (answering its reads from the model), apply the plan as one transaction, look
//! at the result. Conflict tests plan from a snapshot, change the world, and check
//! that the compares catch it.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use std::sync::Arc;

use super::{
    mutation::*,
    plan::{freed_from_kvs, plan, Plan, PlanCtx, Planned, Snapshot},
};
use crate::{
    clock::ManualClock,
    codec::{Dentry, DirParent, Extent, InodeAttr, Owner, Record},
    error::MetaError,
    keys::Keyspace,
    kv::{KvBackend, RangeRequest, Txn, TxnOp, TxnOpResponse},
    model::MemEtcd,
    types::{FileType, Ino, SessionId, Timespec},
};

struct World {
    kv: MemEtcd,
    keys: Keyspace,
    next_ino: u64,
    session: SessionId,
    /// Plans as a read-only mount's pipeline does.
    read_only: bool,
}

const NOW: Timespec = Timespec::new(1_700_000_000, 5);

fn file(kind: FileType) -> NewInode {
    NewInode {
        kind,
        perm: 0o644,
        uid: 1,
        gid: 2,
        rdev: 0,
        flags: 0,
        inherit: None,
    }
}

impl World {
    async fn new() -> World {
        let kv = MemEtcd::new(Arc::new(ManualClock::new(NOW)));
        let keys = Keyspace::new("t").unwrap();
        let root = InodeAttr {
            ino: Ino::ROOT,
            kind: FileType::Directory,
            perm: 0o755,
            uid: 0,
            gid: 0,
            size: 0,
            nlink: 2,
            atime: NOW,
            mtime: NOW,
            ctime: NOW,
            crtime: NOW,
            rdev: 0,
            generation: 1,
            flags: 0,
        };
        let t = Txn {
            success: vec![
                TxnOp::put(keys.inode(Ino::ROOT), root.encode()),
                TxnOp::put(
                    keys.dir_parent(Ino::ROOT),
                    DirParent { parent: Ino::ROOT }.encode(),
                ),
            ],
            ..Default::default()
        };
        kv.txn(t).await.unwrap();
        // A real lease: a create puts the new file's cache lock under it.
        let lease = kv.lease_grant(60).await.unwrap().id;
        World {
            kv,
            keys,
            next_ino: 2000,
            session: SessionId(u64::try_from(lease).unwrap()),
            read_only: false,
        }
    }

    fn ctx(&self, ino: Option<Ino>) -> PlanCtx<'_> {
        PlanCtx {
            keys: &self.keys,
            now: NOW,
            session: self.session,
            lock_at_create: true,
            read_only: self.read_only,
            new_ino: ino,
            block_size: 4096,
            groups: Some(GroupLayout {
                start: 0,
                size: 1 << 20,
            }),
        }
    }

    /// Plans until ready, answering reads from the world. Returns the plan and the
    /// number of read rounds it took.
    async fn plan(
        &mut self,
        m: &Mutation,
        snap: &mut Snapshot,
    ) -> (Result<Plan, MetaError>, usize) {
        let ino = m.needs_ino().then(|| {
            self.next_ino += 1;
            Ino(self.next_ino)
        });
        for rounds in 0..64 {
            match plan(m, snap, &self.ctx(ino)) {
                Planned::Ready(p) => return (Ok(p), rounds),
                Planned::Fail(e) => return (Err(e), rounds),
                Planned::Need(reqs) => {
                    assert!(!reqs.is_empty());
                    for r in reqs {
                        let resp = self.kv.range(r.clone()).await.unwrap();
                        snap.insert(&r, resp);
                    }
                }
            }
        }
        panic!("plan never became ready");
    }

    async fn apply(&self, p: &Plan) -> Result<Outcome, MetaError> {
        let t = Txn {
            compares: p.compares.clone(),
            success: p.ops.clone(),
            failure: vec![],
        };
        let r = self.kv.txn(t).await?;
        if !r.succeeded {
            return Err(MetaError::Conflict { attempts: 1 });
        }
        let mut o = p.outcome.clone();
        for &i in &p.freed_from_ops {
            if let TxnOpResponse::Delete { prev_kvs, .. } = &r.responses[i] {
                o.freed.extend(freed_from_kvs(&self.keys, prev_kvs));
            }
        }
        Ok(o)
    }

    async fn run(&mut self, m: Mutation) -> Result<Outcome, MetaError> {
        let (p, _) = self.plan(&m, &mut Snapshot::default()).await;
        self.apply(&p?).await
    }

    async fn inode(&self, ino: Ino) -> Option<InodeAttr> {
        let r = self
            .kv
            .range(RangeRequest::key(self.keys.inode(ino)))
            .await
            .unwrap();
        r.kvs
            .first()
            .map(|kv| InodeAttr::decode(&kv.value).unwrap())
    }

    async fn exists(&self, key: Vec<u8>) -> bool {
        !self
            .kv
            .range(RangeRequest::key(key))
            .await
            .unwrap()
            .kvs
            .is_empty()
    }

    async fn create(&mut self, parent: Ino, name: &str, kind: FileType) -> Ino {
        let symlink = (kind == FileType::Symlink).then(|| b"target".to_vec());
        let m = Mutation::Create {
            parent,
            name: name.into(),
            inode: file(kind),
            symlink,
            hold: false,
        };
        self.run(m).await.unwrap().ino.unwrap()
    }

    async fn add_extent(&mut self, ino: Ino, off: u64, len: u64, dev: u64) {
        let e = Extent {
            file_off: off,
            len,
            dev_off: dev,
            unwritten: false,
        };
        let m = Mutation::SetExtents {
            free_maps: Vec::new(),
            expect: None,
            ino,
            off,
            len,
            extents: vec![e],
            size_at_least: Some(off + len),
            touch_mtime: true,
        };
        self.run(m).await.unwrap();
    }

    async fn extents(&self, ino: Ino) -> Vec<Extent> {
        crate::reader::extents(&self.kv, &self.keys, ino, 0, 100)
            .await
            .unwrap()
            .0
    }
}

fn unlink(parent: Ino, name: &str) -> Mutation {
    Mutation::Unlink {
        parent,
        name: name.into(),
        dir: false,
        keep_open: false,
        drop_own_hold: false,
        expect: None,
    }
}

fn rename(sp: Ino, sn: &str, dp: Ino, dn: &str, mode: RenameMode) -> Mutation {
    Mutation::Rename {
        src_parent: sp,
        src_name: sn.into(),
        dst_parent: dp,
        dst_name: dn.into(),
        mode,
        dst_keep_open: false,
    }
}

#[tokio::test]
async fn create_is_blind_one_txn() {
    let mut w = World::new().await;
    let m = Mutation::Create {
        parent: Ino::ROOT,
        name: b"f".to_vec(),
        inode: file(FileType::Regular),
        symlink: None,
        hold: false,
    };
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    let p = p.unwrap();
    assert_eq!(rounds, 0, "a create needs no reads");
    assert_eq!(p.compares.len(), 2);
    assert_eq!(p.ops.len(), 3, "inode, dentry and the creator's cache lock");
    assert_eq!(
        p.touch,
        vec![(Ino::ROOT, true)],
        "parent times are coalesced, not written"
    );
    let o = w.apply(&p).await.unwrap();
    let ino = o.ino.unwrap();
    let a = w.inode(ino).await.unwrap();
    assert_eq!((a.nlink, a.perm, a.mtime), (1, 0o644, NOW));
    // Same name again: the blind compare fails; with the failure-branch answer in the
    // snapshot the plan reports Exists.
    let (p2, _) = w.plan(&m, &mut Snapshot::default()).await;
    assert!(w.apply(&p2.unwrap()).await.is_err());
    let mut snap = Snapshot::default();
    let key = w.keys.dentry(Ino::ROOT, b"f");
    let cur =
        w.kv.range(RangeRequest::key(key.clone()))
            .await
            .unwrap()
            .kvs
            .pop();
    snap.insert_key(key, cur);
    assert_eq!(
        w.plan(&m, &mut snap).await.0.unwrap_err(),
        MetaError::Exists
    );
    // Missing parent.
    let mut snap = Snapshot::default();
    snap.insert_key(w.keys.inode(Ino(77)), None);
    let orphan_parent = Mutation::Create {
        parent: Ino(77),
        name: b"x".to_vec(),
        inode: file(FileType::Regular),
        symlink: None,
        hold: false,
    };
    assert_eq!(
        w.plan(&orphan_parent, &mut snap).await.0.unwrap_err(),
        MetaError::NotFound
    );
    let bad = Mutation::Create {
        parent: Ino::ROOT,
        name: b"a/b".to_vec(),
        inode: file(FileType::Regular),
        symlink: None,
        hold: false,
    };
    assert!(matches!(w.run(bad).await, Err(MetaError::Invalid(_))));
}

#[tokio::test]
async fn mkdir_and_symlink() {
    let mut w = World::new().await;
    let d = w.create(Ino::ROOT, "d", FileType::Directory).await;
    assert_eq!(w.inode(d).await.unwrap().nlink, 2);
    assert_eq!(
        w.inode(Ino::ROOT).await.unwrap().nlink,
        3,
        "mkdir bumps the parent"
    );
    assert!(w.exists(w.keys.dir_parent(d)).await);
    let s = w.create(d, "s", FileType::Symlink).await;
    assert_eq!(w.inode(s).await.unwrap().size, 6);
    let t = crate::reader::readlink(&w.kv, &w.keys, s).await.unwrap();
    assert_eq!(t, Some(b"target".to_vec()));
    let no_target = Mutation::Create {
        parent: d,
        name: b"s2".to_vec(),
        inode: file(FileType::Symlink),
        symlink: None,
        hold: false,
    };
    assert!(matches!(w.run(no_target).await, Err(MetaError::Invalid(_))));
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    let in_file = Mutation::Create {
        parent: f,
        name: b"x".to_vec(),
        inode: file(FileType::Directory),
        symlink: None,
        hold: false,
    };
    assert_eq!(w.run(in_file).await.unwrap_err(), MetaError::NotDir);
}

#[tokio::test]
async fn link_and_unlink() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    w.add_extent(f, 0, 8192, 1 << 20).await;
    let o = w
        .run(Mutation::Link {
            ino: f,
            parent: Ino::ROOT,
            name: b"g".to_vec(),
        })
        .await;
    assert_eq!(o.unwrap().attr.unwrap().nlink, 2);
    let d = w.create(Ino::ROOT, "d", FileType::Directory).await;
    let link_dir = Mutation::Link {
        ino: d,
        parent: Ino::ROOT,
        name: b"dd".to_vec(),
    };
    assert_eq!(w.run(link_dir).await.unwrap_err(), MetaError::IsDir);
    let dup = Mutation::Link {
        ino: f,
        parent: Ino::ROOT,
        name: b"g".to_vec(),
    };
    assert!(w.run(dup).await.is_err());
    // First unlink only decrements.
    let o = w.run(unlink(Ino::ROOT, "f")).await.unwrap();
    assert_eq!(o.attr.unwrap().nlink, 1);
    assert!(o.freed.is_empty() && o.removed.is_none());
    // Last unlink deletes the inode and reports its extents freed.
    let o = w.run(unlink(Ino::ROOT, "g")).await.unwrap();
    assert_eq!(o.removed, Some(f));
    assert_eq!(
        o.freed,
        vec![DevRange {
            dev_off: 1 << 20,
            len: 8192
        }]
    );
    assert!(w.inode(f).await.is_none());
    assert!(w.extents(f).await.is_empty());
    assert_eq!(
        w.run(unlink(Ino::ROOT, "g")).await.unwrap_err(),
        MetaError::NotFound
    );
    assert_eq!(
        w.run(unlink(Ino::ROOT, "d")).await.unwrap_err(),
        MetaError::IsDir
    );
}

#[tokio::test]
async fn unlink_open_file_leaves_orphan_then_reclaim() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    w.add_extent(f, 0, 4096, 8192).await;
    let m = Mutation::Unlink {
        parent: Ino::ROOT,
        name: b"f".to_vec(),
        dir: false,
        keep_open: true,
        drop_own_hold: false,
        expect: None,
    };
    let o = w.run(m).await.unwrap();
    assert_eq!(o.orphaned, Some(f));
    assert_eq!(w.inode(f).await.unwrap().nlink, 0);
    let orphans = crate::reader::orphans(&w.kv, &w.keys, 10).await.unwrap();
    assert_eq!(orphans.len(), 1);
    assert_eq!((orphans[0].ino, orphans[0].session), (f, w.session));
    let relink = Mutation::Link {
        ino: f,
        parent: Ino::ROOT,
        name: b"back".to_vec(),
    };
    assert_eq!(w.run(relink).await.unwrap_err(), MetaError::NotFound);
    let o = w.run(Mutation::ReclaimOrphan { ino: f }).await.unwrap();
    assert_eq!(o.removed, Some(f));
    assert_eq!(
        o.freed,
        vec![DevRange {
            dev_off: 8192,
            len: 4096
        }]
    );
    assert!(w.inode(f).await.is_none());
    assert!(!w.exists(w.keys.orphan(f)).await);
    assert_eq!(
        w.run(Mutation::ReclaimOrphan { ino: f }).await.unwrap_err(),
        MetaError::NotFound
    );
    let _ = Owner {
        session: SessionId(1),
    };
}

#[tokio::test]
async fn read_only_plans_only_open_records_and_leaves_orphans_to_writers() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    let g = w.create(Ino::ROOT, "g", FileType::Regular).await;
    w.add_extent(f, 0, 4096, 8192).await;
    w.run(Mutation::Hold { ino: f }).await.unwrap();
    let m = Mutation::Unlink {
        parent: Ino::ROOT,
        name: b"f".to_vec(),
        dir: false,
        keep_open: true,
        drop_own_hold: false,
        expect: None,
    };
    assert_eq!(w.run(m).await.unwrap().orphaned, Some(f));

    w.read_only = true;
    for m in [
        Mutation::Create {
            parent: Ino::ROOT,
            name: b"new".to_vec(),
            inode: file(FileType::Regular),
            symlink: None,
            hold: false,
        },
        Mutation::SetAttr {
            ino: g,
            set: SetAttr::default(),
        },
        Mutation::Touch {
            ino: g,
            mtime: None,
            ctime: NOW,
            expect: None,
        },
        Mutation::ReserveInos { count: 8 },
        Mutation::ReclaimOrphan { ino: f },
        Mutation::FreeMaps {
            maps: vec![],
            released: vec![],
        },
    ] {
        assert_eq!(w.run(m).await.unwrap_err(), MetaError::ReadOnly);
    }
    // Open records come and go: a reader keeps what it reads whole.
    w.run(Mutation::Hold { ino: g }).await.unwrap();
    assert!(w.exists(w.keys.held(g, w.session)).await);
    w.run(Mutation::Unhold { ino: g }).await.unwrap();
    assert!(!w.exists(w.keys.held(g, w.session)).await);
    // The last close of an orphan drops only the record: the inode, its blocks and the
    // orphan record stay for a writable node's orphan scan. (The blind first plan's
    // compare fails on the orphan record; the pipeline plans again having read it.)
    let unhold = Mutation::Unhold { ino: f };
    assert!(w.run(unhold.clone()).await.is_err());
    let mut snap = Snapshot::default();
    let r = RangeRequest::key(w.keys.orphan(f));
    snap.insert(&r, w.kv.range(r.clone()).await.unwrap());
    let (p, _) = w.plan(&unhold, &mut snap).await;
    let o = w.apply(&p.unwrap()).await.unwrap();
    assert_eq!((o.removed, o.freed.len()), (None, 0));
    assert!(!w.exists(w.keys.held(f, w.session)).await);
    assert!(w.inode(f).await.is_some());
    assert!(w.exists(w.keys.orphan(f)).await);

    w.read_only = false;
    let o = w.run(Mutation::ReclaimOrphan { ino: f }).await.unwrap();
    assert_eq!(o.removed, Some(f));
    assert!(!w.exists(w.keys.orphan(f)).await);
}

#[tokio::test]
async fn rmdir_rules() {
    let mut w = World::new().await;
    let d = w.create(Ino::ROOT, "d", FileType::Directory).await;
    w.create(d, "x", FileType::Regular).await;
    let rmdir = |name: &str| Mutation::Unlink {
        parent: Ino::ROOT,
        name: name.into(),
        dir: true,
        keep_open: false,
        drop_own_hold: false,
        expect: None,
    };
    assert_eq!(w.run(rmdir("d")).await.unwrap_err(), MetaError::NotEmpty);
    w.create(Ino::ROOT, "f", FileType::Regular).await;
    assert_eq!(w.run(rmdir("f")).await.unwrap_err(), MetaError::NotDir);
    w.run(unlink(d, "x")).await.unwrap();
    // Plan the rmdir, then let a create sneak in: the range compare catches it.
    let (p, _) = w.plan(&rmdir("d"), &mut Snapshot::default()).await;
    let p = p.unwrap();
    w.create(d, "late", FileType::Regular).await;
    assert!(
        w.apply(&p).await.is_err(),
        "rmdir must not orphan a concurrent create"
    );
    w.run(unlink(d, "late")).await.unwrap();
    let o = w.run(rmdir("d")).await.unwrap();
    assert_eq!(o.removed, Some(d));
    assert_eq!(w.inode(Ino::ROOT).await.unwrap().nlink, 2);
    assert!(!w.exists(w.keys.dir_parent(d)).await);
}

#[tokio::test]
async fn rename_kinds() {
    let mut w = World::new().await;
    let a = w.create(Ino::ROOT, "a", FileType::Regular).await;
    let b = w.create(Ino::ROOT, "b", FileType::Regular).await;
    // NOREPLACE over an existing name.
    let nr = rename(Ino::ROOT, "a", Ino::ROOT, "b", RenameMode::NoReplace);
    assert_eq!(w.run(nr).await.unwrap_err(), MetaError::Exists);
    // EXCHANGE swaps.
    w.run(rename(Ino::ROOT, "a", Ino::ROOT, "b", RenameMode::Exchange))
        .await
        .unwrap();
    assert_eq!(lookup(&w, "a").await.unwrap().ino, b);
    assert_eq!(lookup(&w, "b").await.unwrap().ino, a);
    // Replace: "a" (inode b) over "b" (inode a): inode a loses its last link.
    let o = w
        .run(rename(Ino::ROOT, "a", Ino::ROOT, "b", RenameMode::Replace))
        .await
        .unwrap();
    assert_eq!(o.removed, Some(a));
    assert!(lookup(&w, "a").await.is_none());
    assert_eq!(lookup(&w, "b").await.unwrap().ino, b);
    let ex = rename(Ino::ROOT, "b", Ino::ROOT, "zz", RenameMode::Exchange);
    assert_eq!(w.run(ex).await.unwrap_err(), MetaError::NotFound);
    // Directories: across parents, link counts follow; into own subtree refused.
    let d1 = w.create(Ino::ROOT, "d1", FileType::Directory).await;
    let d2 = w.create(Ino::ROOT, "d2", FileType::Directory).await;
    let sub = w.create(d1, "sub", FileType::Directory).await;
    w.run(rename(d1, "sub", d2, "moved", RenameMode::Replace))
        .await
        .unwrap();
    assert_eq!(w.inode(d1).await.unwrap().nlink, 2);
    assert_eq!(w.inode(d2).await.unwrap().nlink, 3);
    let p = crate::reader::get_inode(&w.kv, &w.keys, sub)
        .await
        .unwrap()
        .unwrap()
        .0;
    assert_eq!(p.kind, FileType::Directory);
    let into_self = rename(Ino::ROOT, "d2", sub, "loop", RenameMode::Replace);
    assert!(matches!(w.run(into_self).await, Err(MetaError::Invalid(_))));
    // Directory over a non-empty directory.
    w.create(d1, "x", FileType::Regular).await;
    let over = rename(Ino::ROOT, "d2", Ino::ROOT, "d1", RenameMode::Replace);
    assert_eq!(w.run(over).await.unwrap_err(), MetaError::NotEmpty);
    w.run(unlink(d1, "x")).await.unwrap();
    let root_links = w.inode(Ino::ROOT).await.unwrap().nlink;
    let o = w
        .run(rename(
            Ino::ROOT,
            "d2",
            Ino::ROOT,
            "d1",
            RenameMode::Replace,
        ))
        .await
        .unwrap();
    assert_eq!(o.removed, Some(d1));
    assert_eq!(w.inode(Ino::ROOT).await.unwrap().nlink, root_links - 1);
    // File over directory and directory over file.
    w.create(Ino::ROOT, "f", FileType::Regular).await;
    let f_over_d = rename(Ino::ROOT, "f", Ino::ROOT, "d1", RenameMode::Replace);
    assert_eq!(w.run(f_over_d).await.unwrap_err(), MetaError::IsDir);
    let d_over_f = rename(Ino::ROOT, "d1", Ino::ROOT, "f", RenameMode::Replace);
    assert_eq!(w.run(d_over_f).await.unwrap_err(), MetaError::NotDir);
    // Same entry: no-op.
    let o = w
        .run(rename(Ino::ROOT, "f", Ino::ROOT, "f", RenameMode::Replace))
        .await;
    assert!(o.is_ok());
}

#[tokio::test]
async fn rename_conflict_is_caught_by_compares() {
    let mut w = World::new().await;
    w.create(Ino::ROOT, "a", FileType::Regular).await;
    let m = rename(Ino::ROOT, "a", Ino::ROOT, "b", RenameMode::NoReplace);
    let (p, _) = w.plan(&m, &mut Snapshot::default()).await;
    // Another node creates "b" between our read and our commit.
    w.create(Ino::ROOT, "b", FileType::Regular).await;
    assert!(w.apply(&p.unwrap()).await.is_err());
}

/// A change computed at a revision (the mtime of overwrites, committed without the file's
/// lock) is refused once anything changed the inode after it, so that it cannot undo a
/// later explicit one; against the revision of the latest change it commits.
#[tokio::test]
async fn a_setattr_unchanged_since_a_revision_is_refused_after_a_later_change() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    let mtime = |sec: i64, since: Option<i64>| Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            mtime: Some(TimeSet::At(Timespec::new(sec, 0))),
            unchanged_since: since,
            ..Default::default()
        },
    };
    async fn inode_rev(w: &World, f: Ino) -> i64 {
        let r = w.kv.range(RangeRequest::key(w.keys.inode(f))).await;
        r.unwrap().kvs[0].mod_revision
    }
    w.run(mtime(20, None)).await.unwrap();
    let first = inode_rev(&w, f).await;
    w.run(mtime(5, None)).await.unwrap();
    let explicit = inode_rev(&w, f).await;
    assert!(explicit > first);
    let stale = w.run(mtime(30, Some(first))).await;
    assert_eq!(stale.unwrap_err(), MetaError::Changed);
    assert_eq!(w.inode(f).await.unwrap().mtime, Timespec::new(5, 0));
    let o = w.run(mtime(40, Some(explicit))).await.unwrap();
    assert_eq!(o.attr.unwrap().mtime, Timespec::new(40, 0));
}

/// A read's access time leaves ctime alone, as on ext4; the same commit marked `ctime`
/// (a change the node held, such as a chown to the owner the file has) moves it.
#[tokio::test]
async fn an_access_time_commit_moves_ctime_only_when_marked() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    let mut a = w.inode(f).await.unwrap();
    let old = Timespec::new(1_000, 0);
    a.ctime = old;
    w.kv.put_raw(&w.keys.inode(f), &a.encode());
    let access = |ctime: bool| Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            atime: Some(TimeSet::At(Timespec::new(1_800_000_000, 0))),
            access: true,
            ctime,
            ..Default::default()
        },
    };
    let o = w.run(access(false)).await.unwrap().attr.unwrap();
    assert_eq!((o.atime, o.ctime), (Timespec::new(1_800_000_000, 0), old));
    let o = w.run(access(true)).await.unwrap().attr.unwrap();
    assert_eq!(o.ctime, NOW);
}

#[tokio::test]
async fn setattr_and_truncate() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    w.add_extent(f, 0, 8192, 1 << 20).await;
    w.add_extent(f, 8192, 8192, 2 << 20).await;
    let set = SetAttr {
        perm: Some(0o600),
        uid: Some(5),
        mtime: Some(TimeSet::At(Timespec::new(3, 4))),
        ..Default::default()
    };
    let a = w
        .run(Mutation::SetAttr { ino: f, set })
        .await
        .unwrap()
        .attr
        .unwrap();
    assert_eq!(
        (a.perm, a.uid, a.mtime, a.ctime),
        (0o600, 5, Timespec::new(3, 4), NOW)
    );
    let bad = SetAttr {
        mtime: Some(TimeSet::At(Timespec::new(1, 2_000_000_000))),
        ..Default::default()
    };
    assert!(matches!(
        w.run(Mutation::SetAttr { ino: f, set: bad }).await,
        Err(MetaError::Invalid(_))
    ));
    // Truncate to 5000: block-rounded to 8192, so the first extent stays whole and the
    // second is freed.
    let set = SetAttr {
        size: Some(5000),
        ..Default::default()
    };
    let o = w.run(Mutation::SetAttr { ino: f, set }).await.unwrap();
    assert_eq!(o.attr.unwrap().size, 5000);
    assert_eq!(
        o.freed,
        vec![DevRange {
            dev_off: 2 << 20,
            len: 8192
        }]
    );
    // Truncate to 100: the straddling extent is trimmed to one block.
    let set = SetAttr {
        size: Some(100),
        ..Default::default()
    };
    let o = w.run(Mutation::SetAttr { ino: f, set }).await.unwrap();
    assert_eq!(
        o.freed,
        vec![DevRange {
            dev_off: (1 << 20) + 4096,
            len: 4096
        }]
    );
    assert_eq!(
        w.extents(f).await,
        vec![Extent {
            file_off: 0,
            len: 4096,
            dev_off: 1 << 20,
            unwritten: false
        }]
    );
    let missing = Mutation::SetAttr {
        ino: Ino(999_999),
        set: SetAttr::default(),
    };
    assert_eq!(w.run(missing).await.unwrap_err(), MetaError::NotFound);
}

#[tokio::test]
async fn a_new_inode_claims_no_xattrs_until_its_first_is_set() {
    use crate::codec::FLAG_NO_XATTRS;
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    let before = w.inode(f).await.unwrap();
    assert_ne!(
        before.flags & FLAG_NO_XATTRS,
        0,
        "a new inode has no xattrs"
    );
    // A SetAttr's flags can neither clear nor forge the bit.
    w.run(Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            flags: Some(0),
            ..Default::default()
        },
    })
    .await
    .unwrap();
    assert_ne!(w.inode(f).await.unwrap().flags & FLAG_NO_XATTRS, 0);
    let set = Mutation::SetXattr {
        ino: f,
        name: b"security.label".to_vec(),
        value: b"x".to_vec(),
        mode: XattrMode::Any,
    };
    // Planned against the inode as it was, then the inode changes: the compare catches it.
    let (stale, _) = w.plan(&set, &mut Snapshot::default()).await;
    w.run(Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            perm: Some(0o600),
            ..Default::default()
        },
    })
    .await
    .unwrap();
    assert!(w.apply(&stale.unwrap()).await.is_err());
    let o = w.run(set).await.unwrap();
    let after = w.inode(f).await.unwrap();
    assert_eq!(
        after.flags & FLAG_NO_XATTRS,
        0,
        "the bit goes with the first xattr"
    );
    assert_eq!(o.attr.map(|a| a.flags), Some(after.flags));
    // Removing it does not bring the claim back (it is never re-derived).
    w.run(Mutation::RemoveXattr {
        ino: f,
        name: b"security.label".to_vec(),
    })
    .await
    .unwrap();
    assert_eq!(w.inode(f).await.unwrap().flags & FLAG_NO_XATTRS, 0);
}

#[tokio::test]
async fn xattr_create_replace_remove() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    let set = |mode, v: &str| Mutation::SetXattr {
        ino: f,
        name: b"user.k".to_vec(),
        value: v.into(),
        mode,
    };
    assert_eq!(
        w.run(set(XattrMode::Replace, "1")).await.unwrap_err(),
        MetaError::NotFound
    );
    w.run(set(XattrMode::Create, "1")).await.unwrap();
    assert_eq!(
        w.run(set(XattrMode::Create, "2")).await.unwrap_err(),
        MetaError::Exists
    );
    let o = w.run(set(XattrMode::Replace, "3")).await.unwrap();
    assert!(o.attr.is_none());
    let v = crate::reader::get_xattr(&w.kv, &w.keys, f, b"user.k")
        .await
        .unwrap();
    assert_eq!(v, Some(b"3".to_vec()));
    w.run(Mutation::RemoveXattr {
        ino: f,
        name: b"user.k".to_vec(),
    })
    .await
    .unwrap();
    let rm = Mutation::RemoveXattr {
        ino: f,
        name: b"user.k".to_vec(),
    };
    assert_eq!(w.run(rm).await.unwrap_err(), MetaError::NotFound);
    let too_big = Mutation::SetXattr {
        ino: f,
        name: b"user.big".to_vec(),
        value: vec![0; 70_000],
        mode: XattrMode::Any,
    };
    assert!(matches!(w.run(too_big).await, Err(MetaError::Invalid(_))));
}

#[tokio::test]
async fn extents_split_punch_and_convert() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    // fallocate 0..16K unwritten, then write 4K..8K (converting in place).
    let un = Extent {
        file_off: 0,
        len: 16384,
        dev_off: 65536,
        unwritten: true,
    };
    let m = Mutation::SetExtents {
        free_maps: Vec::new(),
        expect: None,
        ino: f,
        off: 0,
        len: 16384,
        extents: vec![un],
        size_at_least: None,
        touch_mtime: false,
    };
    w.run(m).await.unwrap();
    let written = Extent {
        file_off: 4096,
        len: 4096,
        dev_off: 65536 + 4096,
        unwritten: false,
    };
    let m = Mutation::SetExtents {
        free_maps: Vec::new(),
        expect: None,
        ino: f,
        off: 4096,
        len: 4096,
        extents: vec![written],
        size_at_least: Some(8192),
        touch_mtime: true,
    };
    let o = w.run(m).await.unwrap();
    assert!(
        o.freed.is_empty(),
        "converting in place frees nothing: {:?}",
        o.freed
    );
    assert_eq!(o.attr.unwrap().size, 8192);
    let ex = w.extents(f).await;
    assert_eq!(ex.len(), 3);
    assert_eq!(
        ex[0],
        Extent {
            file_off: 0,
            len: 4096,
            dev_off: 65536,
            unwritten: true
        }
    );
    assert_eq!(ex[1], written);
    assert_eq!(
        ex[2],
        Extent {
            file_off: 8192,
            len: 8192,
            dev_off: 65536 + 8192,
            unwritten: true
        }
    );
    // Punch 2K..10K: trims the head, drops the middle, trims the tail.
    let m = Mutation::SetExtents {
        free_maps: Vec::new(),
        expect: None,
        ino: f,
        off: 2048,
        len: 8192,
        extents: vec![],
        size_at_least: None,
        touch_mtime: false,
    };
    let o = w.run(m).await.unwrap();
    let mut freed = o.freed.clone();
    freed.sort();
    assert_eq!(
        freed,
        vec![
            DevRange {
                dev_off: 65536 + 2048,
                len: 2048
            },
            DevRange {
                dev_off: 65536 + 4096,
                len: 4096
            },
            DevRange {
                dev_off: 65536 + 8192,
                len: 2048
            },
        ]
    );
    let ex = w.extents(f).await;
    assert_eq!(
        ex.iter().map(|e| (e.file_off, e.len)).collect::<Vec<_>>(),
        vec![(0, 2048), (10240, 6144)]
    );
    // A concurrent extent write between plan and commit is caught.
    let m = Mutation::SetExtents {
        free_maps: Vec::new(),
        expect: None,
        ino: f,
        off: 2048,
        len: 8192,
        extents: vec![Extent {
            file_off: 2048,
            len: 4096,
            dev_off: 1 << 30,
            unwritten: false,
        }],
        size_at_least: None,
        touch_mtime: false,
    };
    let (p, _) = w.plan(&m, &mut Snapshot::default()).await;
    w.add_extent(f, 6144, 2048, 1 << 31).await;
    assert!(w.apply(&p.unwrap()).await.is_err());
}

#[tokio::test]
async fn reserve_inos_is_a_cas() {
    let mut w = World::new().await;
    let o = w.run(Mutation::ReserveInos { count: 1024 }).await.unwrap();
    assert_eq!(o.inos, Some((1024, 2048)));
    let m = Mutation::ReserveInos { count: 1024 };
    let (stale, _) = w.plan(&m, &mut Snapshot::default()).await;
    let o = w.run(Mutation::ReserveInos { count: 1024 }).await.unwrap();
    assert_eq!(o.inos, Some((2048, 3072)));
    assert!(
        w.apply(&stale.unwrap()).await.is_err(),
        "a stale reservation must not commit"
    );
}

#[tokio::test]
async fn touch_never_goes_backwards() {
    let mut w = World::new().await;
    let d = w.create(Ino::ROOT, "d", FileType::Directory).await;
    let early = Mutation::Touch {
        ino: d,
        mtime: Some(Timespec::new(1, 0)),
        ctime: Timespec::new(1, 0),
        expect: None,
    };
    let o = w.run(early).await.unwrap();
    assert_eq!(o.revision.0, 0);
    assert!(o.attr.is_none(), "nothing written");
    let late = Timespec::new(NOW.sec + 10, 0);
    let o = w
        .run(Mutation::Touch {
            ino: d,
            mtime: Some(late),
            ctime: late,
            expect: None,
        })
        .await
        .unwrap();
    assert_eq!(o.attr.unwrap().mtime, late);
    let gone = Mutation::Touch {
        ino: Ino(424_242),
        mtime: None,
        ctime: late,
        expect: None,
    };
    assert!(w.run(gone).await.is_ok());
}

#[tokio::test]
async fn corrupt_inode_names_the_key() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    w.kv.put_raw(&w.keys.inode(f), b"\x01\x02garbage");
    let err = w
        .run(Mutation::SetAttr {
            ino: f,
            set: SetAttr::default(),
        })
        .await
        .unwrap_err();
    match err {
        MetaError::Corrupt { key, .. } => assert_eq!(key, format!("t/I {f}")),
        other => panic!("unexpected {other:?}"),
    }
    let d = Dentry {
        ino: f,
        kind: FileType::Regular,
    };
    w.kv.put_raw(&w.keys.dentry(Ino::ROOT, b"bad"), &d.encode()[..3]);
    let err = crate::reader::lookup(&w.kv, &w.keys, Ino::ROOT, b"bad")
        .await
        .unwrap_err();
    assert!(matches!(err, MetaError::Corrupt { key, .. } if key == "t/D 1 \"bad\""));
}

async fn lookup(w: &World, n: &str) -> Option<Dentry> {
    crate::reader::lookup(&w.kv, &w.keys, Ino::ROOT, n.as_bytes())
        .await
        .unwrap()
}

fn unlink_expecting(parent: Ino, name: &str, dir: bool, e: UnlinkExpect) -> Mutation {
    Mutation::Unlink {
        parent,
        name: name.into(),
        dir,
        keep_open: false,
        drop_own_hold: false,
        expect: Some(Box::new(e)),
    }
}

#[tokio::test]
async fn unlink_without_expectation_reads_twice_with_one_reads_less() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    w.add_extent(f, 0, 4096, 1 << 20).await;
    let g = w.create(Ino::ROOT, "g", FileType::Regular).await;
    let (_, rounds) = w
        .plan(&unlink(Ino::ROOT, "g"), &mut Snapshot::default())
        .await;
    assert_eq!(rounds, 2, "entry, then inode");
    let e = UnlinkExpect {
        entry: Dentry {
            ino: f,
            kind: FileType::Regular,
        },
        child: w.inode(f).await,
        parent: None,
        extents: None,
    };
    let m = unlink_expecting(Ino::ROOT, "f", false, e.clone());
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    assert_eq!(rounds, 1, "a file with data: its extents are read");
    let o = w.apply(&p.unwrap()).await.unwrap();
    assert_eq!(o.removed, Some(f));
    assert_eq!(o.freed.len(), 1);
    assert_eq!(o.released, o.freed, "logged in the same txn");
    assert!(w.exists(w.keys.released(1 << 20)).await);
    // An empty file fully expected: nothing read.
    let h = w.create(Ino::ROOT, "h", FileType::Regular).await;
    let e = UnlinkExpect {
        entry: Dentry {
            ino: h,
            kind: FileType::Regular,
        },
        child: w.inode(h).await,
        parent: None,
        extents: None,
    };
    let (p, rounds) = w
        .plan(
            &unlink_expecting(Ino::ROOT, "h", false, e),
            &mut Snapshot::default(),
        )
        .await;
    assert_eq!(rounds, 0);
    assert_eq!(w.apply(&p.unwrap()).await.unwrap().removed, Some(h));
    // Only the entry expected: one read (the inode).
    let e = UnlinkExpect {
        entry: Dentry {
            ino: g,
            kind: FileType::Regular,
        },
        child: None,
        parent: None,
        extents: None,
    };
    let (p, rounds) = w
        .plan(
            &unlink_expecting(Ino::ROOT, "g", false, e),
            &mut Snapshot::default(),
        )
        .await;
    assert_eq!(rounds, 1);
    w.apply(&p.unwrap()).await.unwrap();
}

#[tokio::test]
async fn stale_unlink_expectations_fail_compares_never_the_mutation() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    let old = w.inode(f).await.unwrap();
    // A link since: the expected attributes (nlink 1) would delete a linked inode.
    w.run(Mutation::Link {
        ino: f,
        parent: Ino::ROOT,
        name: b"g".to_vec(),
    })
    .await
    .unwrap();
    let e = UnlinkExpect {
        entry: Dentry {
            ino: f,
            kind: FileType::Regular,
        },
        child: Some(old.clone()),
        parent: None,
        extents: None,
    };
    let m = unlink_expecting(Ino::ROOT, "f", false, e.clone());
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    assert_eq!(rounds, 0);
    assert!(w.apply(&p.unwrap()).await.is_err(), "stale nlink caught");
    assert_eq!(w.inode(f).await.unwrap().nlink, 2);
    // Wrong kind expected: the IsDir decision waits for what etcd holds.
    let d = w.create(Ino::ROOT, "d", FileType::Directory).await;
    let wrong = UnlinkExpect {
        entry: Dentry {
            ino: d,
            kind: FileType::Directory,
        },
        child: w.inode(d).await,
        parent: None,
        extents: None,
    };
    let m = unlink_expecting(Ino::ROOT, "f", false, wrong);
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    assert!(rounds >= 1);
    let o = w.apply(&p.unwrap()).await.unwrap();
    assert_eq!(o.attr.unwrap().nlink, 1);
    // An expected entry that is gone: NotFound only after reading it.
    let m = unlink_expecting(Ino::ROOT, "f", false, e);
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    assert_eq!(rounds, 0);
    assert!(w.apply(&p.unwrap()).await.is_err());
    let mut m = m;
    m.forget_expectation();
    assert_eq!(w.run(m).await.unwrap_err(), MetaError::NotFound);
}

fn ext(off: u64, len: u64, dev: u64) -> Extent {
    Extent {
        file_off: off,
        len,
        dev_off: dev,
        unwritten: false,
    }
}

fn unlink_with_map(child: Option<InodeAttr>, ino: Ino, map: Vec<Extent>) -> UnlinkExpect {
    UnlinkExpect {
        entry: Dentry {
            ino,
            kind: FileType::Regular,
        },
        child,
        parent: None,
        extents: Some(map),
    }
}

#[tokio::test]
async fn an_unlink_planned_from_the_known_map_reads_nothing_and_releases_exactly_it() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    w.add_extent(f, 0, 4096, 1 << 20).await;
    w.add_extent(f, 8192, 4096, 3 << 20).await;
    let map = vec![ext(0, 4096, 1 << 20), ext(8192, 4096, 3 << 20)];
    let e = unlink_with_map(w.inode(f).await, f, map);
    let (p, rounds) = w
        .plan(
            &unlink_expecting(Ino::ROOT, "f", false, e),
            &mut Snapshot::default(),
        )
        .await;
    assert_eq!(
        rounds, 0,
        "neither the extents nor the open records are read"
    );
    let o = w.apply(&p.unwrap()).await.unwrap();
    assert_eq!(o.removed, Some(f));
    let freed: Vec<u64> = o.freed.iter().map(|r| r.dev_off).collect();
    assert_eq!(freed, vec![1 << 20, 3 << 20]);
    assert_eq!(o.released, o.freed, "logged in the same txn");
    assert!(w.exists(w.keys.released(3 << 20)).await);
    assert!(!w.exists(w.keys.extent(f, 0)).await);
    assert!(!w.exists(w.keys.extent(f, 8192)).await);
}

#[tokio::test]
async fn a_stale_known_map_fails_the_unlink_compares_and_releases_nothing() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    w.add_extent(f, 0, 4096, 1 << 20).await;
    w.add_extent(f, 8192, 4096, 3 << 20).await;
    let attr = w.inode(f).await;
    let real = vec![ext(0, 4096, 1 << 20), ext(8192, 4096, 3 << 20)];
    let stale_maps = [
        ("a key missing", vec![ext(0, 4096, 1 << 20)]),
        ("the first key missing", vec![ext(8192, 4096, 3 << 20)]),
        (
            "a key elsewhere on the device",
            vec![ext(0, 4096, 1 << 20), ext(8192, 4096, 5 << 20)],
        ),
        (
            "a key etcd does not hold",
            vec![
                ext(0, 4096, 1 << 20),
                ext(4096, 4096, 2 << 20),
                ext(8192, 4096, 3 << 20),
            ],
        ),
        ("no keys at all", Vec::new()),
    ];
    for (what, map) in stale_maps {
        let e = unlink_with_map(attr.clone(), f, map);
        let (p, rounds) = w
            .plan(
                &unlink_expecting(Ino::ROOT, "f", false, e),
                &mut Snapshot::default(),
            )
            .await;
        assert_eq!(rounds, 0, "{what}");
        assert!(w.apply(&p.unwrap()).await.is_err(), "{what}: committed");
        assert!(w.exists(w.keys.extent(f, 8192)).await, "{what}");
        assert!(!w.exists(w.keys.released(1 << 20)).await, "{what}");
    }
    // A key past the map's end (another node's append since), then another node's open.
    w.add_extent(f, 1 << 30, 4096, 7 << 20).await;
    let attr = w.inode(f).await;
    let e = unlink_with_map(attr.clone(), f, real.clone());
    let (p, _) = w
        .plan(
            &unlink_expecting(Ino::ROOT, "f", false, e),
            &mut Snapshot::default(),
        )
        .await;
    assert!(w.apply(&p.unwrap()).await.is_err(), "a key past the end");
    let mut with_tail = real.clone();
    with_tail.push(ext(1 << 30, 4096, 7 << 20));
    hold_as(&w, f, SessionId(4242)).await;
    let e = unlink_with_map(attr.clone(), f, with_tail.clone());
    let (p, _) = w
        .plan(
            &unlink_expecting(Ino::ROOT, "f", false, e),
            &mut Snapshot::default(),
        )
        .await;
    assert!(w.apply(&p.unwrap()).await.is_err(), "open on another node");
    // Forgotten, the expectation reads: the open file becomes an orphan, nothing freed.
    let e = unlink_with_map(attr, f, with_tail);
    let mut m = unlink_expecting(Ino::ROOT, "f", false, e);
    m.forget_expectation();
    let o = w.run(m).await.unwrap();
    assert_eq!(o.orphaned, Some(f));
    assert!(o.freed.is_empty());
    assert!(w.exists(w.keys.extent(f, 1 << 30)).await);
}

async fn rmdir_expect(w: &World, d: Ino) -> UnlinkExpect {
    UnlinkExpect {
        entry: Dentry {
            ino: d,
            kind: FileType::Directory,
        },
        child: w.inode(d).await,
        parent: w.inode(Ino::ROOT).await,
        extents: None,
    }
}

#[tokio::test]
async fn rmdir_with_expectation_proves_emptiness_by_compare() {
    let mut w = World::new().await;
    let d = w.create(Ino::ROOT, "d", FileType::Directory).await;
    w.create(d, "x", FileType::Regular).await;
    let m = unlink_expecting(Ino::ROOT, "d", true, rmdir_expect(&w, d).await);
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    assert_eq!(rounds, 0);
    assert!(w.apply(&p.unwrap()).await.is_err(), "non-empty caught");
    let mut retry = m.clone();
    retry.forget_expectation();
    assert_eq!(w.run(retry).await.unwrap_err(), MetaError::NotEmpty);
    w.run(unlink(d, "x")).await.unwrap();
    let m = unlink_expecting(Ino::ROOT, "d", true, rmdir_expect(&w, d).await);
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    assert_eq!(rounds, 0);
    let o = w.apply(&p.unwrap()).await.unwrap();
    assert_eq!(o.removed, Some(d));
    assert_eq!(w.inode(Ino::ROOT).await.unwrap().nlink, 2);
}

/// Every mutation that drops extents logs their device ranges as released records in its
/// own transaction (split at group boundaries), and FreeMaps deletes them.
#[tokio::test]
async fn freed_ranges_are_logged_in_the_freeing_txn() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    // Straddles the 1 MiB group boundary.
    w.add_extent(f, 0, 16384, (1 << 20) - 8192).await;
    w.add_extent(f, 16384, 8192, 4 << 20).await;
    w.add_extent(f, 24576, 8192, 5 << 20).await;
    // Punch the middle extent.
    let punch = Mutation::SetExtents {
        free_maps: Vec::new(),
        expect: None,
        ino: f,
        off: 16384,
        len: 8192,
        extents: vec![],
        size_at_least: None,
        touch_mtime: true,
    };
    let o = w.run(punch).await.unwrap();
    let r = |dev_off: u64, len: u64| DevRange { dev_off, len };
    assert_eq!(o.released, vec![r(4 << 20, 8192)]);
    // Truncate into the first extent: the trimmed tail and the last extent.
    let t = Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            size: Some(4096),
            ..SetAttr::default()
        },
    };
    let o = w.run(t).await.unwrap();
    assert_eq!(
        o.released,
        vec![
            r((1 << 20) - 4096, 4096),
            r(1 << 20, 8192),
            r(5 << 20, 8192)
        ]
    );
    // Re-extend (the test reuses device space freely) and unlink.
    w.add_extent(f, 4096, 8192, 1 << 20).await;
    let o = w.run(unlink(Ino::ROOT, "f")).await.unwrap();
    assert_eq!(
        o.released,
        vec![r((1 << 20) - 8192, 4096), r(1 << 20, 8192)]
    );
    let logged = [
        (1 << 20) - 8192,
        (1 << 20) - 4096,
        1 << 20,
        4 << 20,
        5 << 20,
    ];
    for off in logged {
        assert!(w.exists(w.keys.released(off)).await, "R @{off}");
    }
    let fm = Mutation::FreeMaps {
        maps: vec![],
        released: logged.to_vec(),
    };
    w.run(fm).await.unwrap();
    for off in logged {
        assert!(!w.exists(w.keys.released(off)).await);
    }
}

mod acls {
    use super::*;
    use crate::{
        acl::{self, Acl, Entry, Tag},
        codec::XattrValue,
    };

    fn default_acl() -> Vec<u8> {
        Acl::new(vec![
            Entry {
                tag: Tag::UserObj,
                perm: 7,
            },
            Entry {
                tag: Tag::User(1000),
                perm: 0,
            },
            Entry {
                tag: Tag::GroupObj,
                perm: 5,
            },
            Entry {
                tag: Tag::Mask,
                perm: 7,
            },
            Entry {
                tag: Tag::Other,
                perm: 5,
            },
        ])
        .unwrap()
        .encode()
    }

    fn created(kind: FileType, perm: u16, umask: u16, parent_default: bool) -> Mutation {
        Mutation::Create {
            parent: Ino::ROOT,
            name: format!("{kind:?}{perm:o}").into_bytes(),
            inode: NewInode {
                perm,
                inherit: Some(AclInherit {
                    umask,
                    parent_default,
                }),
                ..file(kind)
            },
            symlink: (kind == FileType::Symlink).then(|| b"t".to_vec()),
            hold: false,
        }
    }

    async fn xattr(w: &World, ino: Ino, name: &[u8]) -> Option<Vec<u8>> {
        let r =
            w.kv.range(RangeRequest::key(w.keys.xattr(ino, name)))
                .await
                .unwrap();
        r.kvs
            .first()
            .map(|kv| XattrValue::decode(&kv.value).unwrap().0)
    }

    async fn set(w: &mut World, ino: Ino, default: bool, value: Option<Vec<u8>>) -> Outcome {
        w.run(Mutation::SetAcl {
            ino,
            default,
            value,
            kill_sgid: false,
        })
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn without_a_default_acl_the_umask_applies() {
        let mut w = World::new().await;
        let (p, rounds) = w
            .plan(
                &created(FileType::Regular, 0o666, 0o022, false),
                &mut Snapshot::default(),
            )
            .await;
        assert_eq!(
            rounds, 0,
            "still blind: the default ACL's absence is compared"
        );
        let o = w.apply(&p.unwrap()).await.unwrap();
        let a = o.attr.unwrap();
        assert_eq!((a.perm, a.flags & acl::FLAGS), (0o644, 0));
        assert_eq!(xattr(&w, a.ino, acl::ACCESS_NAME).await, None);
    }

    #[tokio::test]
    async fn a_default_acl_is_inherited_without_the_umask() {
        let mut w = World::new().await;
        let o = set(&mut w, Ino::ROOT, true, Some(default_acl())).await;
        assert_eq!(o.attr.unwrap().flags & acl::FLAGS, acl::FLAG_DEFAULT);
        // A file: access ACL only, masked by the mode asked for; the umask ignored.
        let f = w
            .run(created(FileType::Regular, 0o666, 0o077, true))
            .await
            .unwrap()
            .attr
            .unwrap();
        assert_eq!(f.perm, 0o664);
        assert_eq!(f.flags & acl::FLAGS, acl::FLAG_ACCESS);
        let access = Acl::decode(&xattr(&w, f.ino, acl::ACCESS_NAME).await.unwrap())
            .unwrap()
            .unwrap();
        assert_eq!(access.mode_bits(), 0o664);
        assert_eq!(xattr(&w, f.ino, acl::DEFAULT_NAME).await, None);
        // A directory: both, the default verbatim.
        let d = w
            .run(created(FileType::Directory, 0o777, 0o077, true))
            .await
            .unwrap()
            .attr
            .unwrap();
        assert_eq!(d.perm, 0o775);
        assert_eq!(d.flags & acl::FLAGS, acl::FLAGS);
        assert_eq!(
            xattr(&w, d.ino, acl::DEFAULT_NAME).await,
            Some(default_acl())
        );
        // A symlink: nothing.
        let s = w
            .run(created(FileType::Symlink, 0o777, 0o077, true))
            .await
            .unwrap()
            .attr
            .unwrap();
        assert_eq!((s.perm, s.flags & acl::FLAGS), (0o777, 0));
    }

    #[tokio::test]
    async fn a_stale_belief_in_no_default_acl_is_caught() {
        let mut w = World::new().await;
        let m = created(FileType::Regular, 0o666, 0o022, false);
        let mut snap = Snapshot::default();
        let (p, _) = w.plan(&m, &mut snap).await;
        // Another node sets the parent's default ACL between plan and commit.
        set(&mut w, Ino::ROOT, true, Some(default_acl())).await;
        assert!(
            w.apply(&p.unwrap()).await.is_err(),
            "the absence was compared"
        );
        // The retry plans from what etcd holds.
        let key = w.keys.xattr(Ino::ROOT, acl::DEFAULT_NAME);
        let r = w.kv.range(RangeRequest::key(key.clone())).await.unwrap();
        snap.insert(&RangeRequest::key(key), r);
        let (p, _) = w.plan(&m, &mut snap).await;
        let a = w.apply(&p.unwrap()).await.unwrap().attr.unwrap();
        assert_eq!((a.perm, a.flags & acl::FLAGS), (0o664, acl::FLAG_ACCESS));
    }

    #[tokio::test]
    async fn access_acls_set_the_mode_and_chmod_sets_the_mask() {
        let mut w = World::new().await;
        let ino = w.create(Ino::ROOT, "f", FileType::Regular).await;
        let o = set(&mut w, ino, false, Some(default_acl())).await;
        let a = o.attr.unwrap();
        assert_eq!((a.perm, a.flags & acl::FLAGS), (0o775, acl::FLAG_ACCESS));
        // chmod 640 rewrites owner, mask and other in the same transaction.
        w.run(Mutation::SetAttr {
            ino,
            set: SetAttr {
                perm: Some(0o640),
                ..Default::default()
            },
        })
        .await
        .unwrap();
        let acl = Acl::decode(&xattr(&w, ino, acl::ACCESS_NAME).await.unwrap())
            .unwrap()
            .unwrap();
        assert_eq!(acl.mode_bits(), 0o640);
        assert!(acl.entries().contains(&Entry {
            tag: Tag::GroupObj,
            perm: 5
        }));
        // An ACL the mode says in full: only the mode is kept.
        let minimal = Acl::new(vec![
            Entry {
                tag: Tag::UserObj,
                perm: 6,
            },
            Entry {
                tag: Tag::GroupObj,
                perm: 0,
            },
            Entry {
                tag: Tag::Other,
                perm: 0,
            },
        ])
        .unwrap();
        let a = set(&mut w, ino, false, Some(minimal.encode()))
            .await
            .attr
            .unwrap();
        assert_eq!((a.perm, a.flags & acl::FLAGS), (0o600, 0));
        assert_eq!(xattr(&w, ino, acl::ACCESS_NAME).await, None);
        // Malformed values and default ACLs on files change nothing.
        let bad = w
            .run(Mutation::SetAcl {
                ino,
                default: false,
                value: Some(vec![2, 0, 0, 0, 1]),
                kill_sgid: false,
            })
            .await;
        assert!(matches!(bad, Err(MetaError::Invalid(_))));
        let bad = w
            .run(Mutation::SetAcl {
                ino,
                default: true,
                value: Some(default_acl()),
                kill_sgid: false,
            })
            .await;
        assert!(matches!(bad, Err(MetaError::Invalid(_))));
        assert_eq!(w.inode(ino).await.unwrap().perm, 0o600);
    }
}

#[tokio::test]
async fn an_inode_and_its_extents_read_at_one_revision() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    for i in 0..3u64 {
        w.add_extent(f, i * 8192, 4096, (1 << 20) + i * 4096).await;
    }
    let all = crate::reader::inode_with_extents_at(&w.kv, &w.keys, f, 10)
        .await
        .unwrap();
    assert_eq!(all.attr.as_ref().map(|a| a.size), Some(2 * 8192 + 4096));
    assert_eq!(all.extents, w.extents(f).await);
    assert!(!all.more);
    let (_, at) = crate::reader::get_inode_at(&w.kv, &w.keys, f)
        .await
        .unwrap();
    assert_eq!(all.revision, at, "nothing changed between the two reads");

    let first = crate::reader::inode_with_extents_at(&w.kv, &w.keys, f, 2)
        .await
        .unwrap();
    assert_eq!(first.extents, all.extents[..2]);
    assert!(first.more, "a third extent follows the window");

    let absent = crate::reader::inode_with_extents_at(&w.kv, &w.keys, Ino(9_999), 10)
        .await
        .unwrap();
    assert_eq!(absent.attr, None);
    assert!(absent.extents.is_empty() && !absent.more);
}

fn written(file_off: u64, len: u64, dev_off: u64) -> Extent {
    Extent {
        file_off,
        len,
        dev_off,
        unwritten: false,
    }
}

fn append(ino: Ino, e: Extent, expect: Option<ExtentsExpect>) -> Mutation {
    Mutation::SetExtents {
        ino,
        off: e.file_off,
        len: e.len,
        extents: vec![e],
        size_at_least: Some(e.file_end()),
        touch_mtime: true,
        free_maps: Vec::new(),
        expect: expect.map(Box::new),
    }
}

/// What the submitter expects for `[off, end)` after outcome `o`.
fn expectation_after(o: &Outcome, off: u64, end: u64) -> ExtentsExpect {
    let known = o.extents_known.as_ref().unwrap();
    known
        .expectation(o.attr.as_ref().unwrap(), off, end)
        .unwrap()
}

#[tokio::test]
async fn appends_planned_from_the_last_commit_read_nothing_and_end_the_same() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    let (p, rounds) = w
        .plan(
            &append(f, written(0, 4096, 1 << 20), None),
            &mut Snapshot::default(),
        )
        .await;
    assert_eq!(rounds, 1, "without an expectation the window is read");
    let o = w.apply(&p.unwrap()).await.unwrap();
    assert_eq!(
        o.extents_known,
        Some(ExtentsKnown {
            start: 0,
            end: 4096,
            extents: vec![written(0, 4096, 1 << 20)],
        })
    );
    // The next appends, each planned from the last one's record: no read at all.
    let mut o = o;
    for i in 1..4u64 {
        let e = written(i * 4096, 4096, (1 << 20) + i * 8192);
        let m = append(f, e, Some(expectation_after(&o, e.file_off, e.file_end())));
        let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
        assert_eq!(rounds, 0, "append {i} planned from the record");
        o = w.apply(&p.unwrap()).await.unwrap();
        assert_eq!(o.attr.as_ref().unwrap().size, (i + 1) * 4096);
        assert_eq!(w.inode(f).await, o.attr, "the outcome is what etcd holds");
        // Only the key before the range is carried along, not the whole file.
        assert_eq!(o.extents_known.as_ref().unwrap().extents.len(), 2);
    }
    assert_eq!(
        w.extents(f)
            .await
            .iter()
            .map(|e| e.file_off)
            .collect::<Vec<_>>(),
        vec![0, 4096, 8192, 12288]
    );
    // A partial block rewritten in place with the size raised: the key inside the range
    // is expected too, and replaced.
    let e = written(12288, 4096, 1 << 24);
    let m = append(f, e, Some(expectation_after(&o, e.file_off, e.file_end())));
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    assert_eq!(rounds, 0);
    let o2 = w.apply(&p.unwrap()).await.unwrap();
    assert_eq!(
        o2.freed,
        vec![DevRange {
            dev_off: (1 << 20) + 3 * 8192,
            len: 4096
        }]
    );
    assert_eq!(w.extents(f).await.last(), Some(&e));
}

#[tokio::test]
async fn a_stale_extents_expectation_never_commits() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    let o = w
        .run(append(f, written(0, 8192, 1 << 20), None))
        .await
        .unwrap();
    let exact = expectation_after(&o, 8192, 20480);
    let next = written(8192, 4096, 1 << 22);
    // Each way the guess can be wrong, planned and then committed against etcd as it is.
    let mut stale_attr = exact.clone();
    stale_attr.attr.size += 1;
    let mut missing_before = exact.clone();
    missing_before.extents.clear();
    let mut wrong_before = exact.clone();
    wrong_before.extents[0].len = 4096;
    let mut phantom_inside = exact.clone();
    phantom_inside.extents.push(written(8192, 4096, 1 << 23));
    for (what, x) in [
        ("attributes", stale_attr),
        ("no key before", missing_before),
        ("the key before", wrong_before),
        ("a key inside", phantom_inside),
    ] {
        let (p, rounds) = w
            .plan(&append(f, next, Some(x)), &mut Snapshot::default())
            .await;
        assert_eq!(rounds, 0, "{what}: planned from the guess");
        assert!(
            w.apply(&p.unwrap()).await.is_err(),
            "{what}: must not commit"
        );
    }
    // Etcd changed under an exact guess, the inode's value staying the same (no size or
    // time set): a key appears inside the record, or in the range past it.
    for (at, what) in [(8192, "inside"), (16384, "in the range past the record")] {
        let g = w
            .create(Ino::ROOT, &format!("g{at}"), FileType::Regular)
            .await;
        let o = w
            .run(append(g, written(0, 8192, 1 << 20), None))
            .await
            .unwrap();
        let m = Mutation::SetExtents {
            ino: g,
            off: 8192,
            len: 12288,
            extents: vec![written(8192, 4096, 1 << 22)],
            size_at_least: Some(12288),
            touch_mtime: true,
            free_maps: Vec::new(),
            expect: Some(Box::new(expectation_after(&o, 8192, 20480))),
        };
        let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
        assert_eq!(rounds, 0);
        let before = w.inode(g).await;
        w.run(Mutation::SetExtents {
            ino: g,
            off: at,
            len: 4096,
            extents: vec![written(at, 4096, 1 << 25)],
            size_at_least: None,
            touch_mtime: false,
            free_maps: Vec::new(),
            expect: None,
        })
        .await
        .unwrap();
        assert_eq!(w.inode(g).await, before, "the inode's value is unchanged");
        assert!(w.apply(&p.unwrap()).await.is_err(), "a key {what}");
    }
    // A guess that is not about this file, or not sorted: read instead.
    let mut other = exact.clone();
    other.attr.ino = Ino(f.0 + 1);
    let mut unsorted = exact.clone();
    unsorted.extents.push(written(0, 4096, 1 << 26));
    for x in [other, unsorted] {
        let (p, rounds) = w
            .plan(&append(f, next, Some(x)), &mut Snapshot::default())
            .await;
        assert_eq!(rounds, 1, "an unusable guess is not planned from");
        w.apply(&p.unwrap()).await.unwrap();
    }
}

/// Puts `session`'s open record of `ino`, as another node's `Hold` would.
async fn hold_as(w: &World, ino: Ino, session: SessionId) {
    let t = Txn {
        success: vec![TxnOp::put(
            w.keys.held(ino, session),
            Owner { session }.encode(),
        )],
        ..Default::default()
    };
    w.kv.txn(t).await.unwrap();
}

fn unlink_dropping_own_hold(name: &str, expect: Option<UnlinkExpect>) -> Mutation {
    Mutation::Unlink {
        parent: Ino::ROOT,
        name: name.into(),
        dir: false,
        keep_open: false,
        drop_own_hold: true,
        expect: expect.map(Box::new),
    }
}

/// A node that closed a file keeps its open record a moment for a reopen; its unlink
/// deletes that record in the same transaction, and the record does not make the file an
/// orphan. Another node's record still does, and one appearing after the plan fails it.
#[tokio::test]
async fn an_unlink_drops_its_own_idle_open_record_in_its_transaction() {
    let mut w = World::new().await;
    let (a, b) = (
        w.create(Ino::ROOT, "a", FileType::Regular).await,
        w.create(Ino::ROOT, "b", FileType::Regular).await,
    );
    for (f, dev) in [(a, 1 << 20), (b, 2 << 20)] {
        w.add_extent(f, 0, 4096, dev).await;
        w.run(Mutation::Hold { ino: f }).await.unwrap();
    }
    // Counted as an open, the record made the file an orphan (reclaimed a second later).
    assert_eq!(
        w.run(unlink(Ino::ROOT, "a")).await.unwrap().orphaned,
        Some(a)
    );
    let o = w.run(unlink_dropping_own_hold("b", None)).await.unwrap();
    assert_eq!((o.removed, o.orphaned), (Some(b), None));
    assert_eq!(o.released.len(), 1, "its blocks logged as released at once");
    assert!(!w.exists(w.keys.held(b, w.session)).await);

    // Planned from the caches (an empty file): nothing read, the same outcome.
    let c = w.create(Ino::ROOT, "c", FileType::Regular).await;
    w.run(Mutation::Hold { ino: c }).await.unwrap();
    let e = UnlinkExpect {
        entry: Dentry {
            ino: c,
            kind: FileType::Regular,
        },
        child: w.inode(c).await,
        parent: None,
        extents: None,
    };
    let m = unlink_dropping_own_hold("c", Some(e));
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    assert_eq!(rounds, 0);
    assert_eq!(w.apply(&p.unwrap()).await.unwrap().removed, Some(c));
    assert!(!w.exists(w.keys.held(c, w.session)).await);

    // Open on another node: an orphan, theirs kept, ours gone.
    let other = SessionId(w.session.0 + 1);
    let d = w.create(Ino::ROOT, "d", FileType::Regular).await;
    w.add_extent(d, 0, 4096, 3 << 20).await;
    w.run(Mutation::Hold { ino: d }).await.unwrap();
    hold_as(&w, d, other).await;
    let o = w.run(unlink_dropping_own_hold("d", None)).await.unwrap();
    assert_eq!(o.orphaned, Some(d));
    assert!(!w.exists(w.keys.held(d, w.session)).await);
    assert!(w.exists(w.keys.held(d, other)).await);

    // Another node opens the file between the plan and the commit: read or guessed, the
    // plan's compares catch it, so the file open there is never deleted. (Its record
    // sorts before or after this session's.)
    let below = SessionId(w.session.0 - 1);
    for (name, blind, other) in [
        ("e", false, other),
        ("f", true, other),
        ("g", false, below),
        ("h", true, below),
    ] {
        let f = w.create(Ino::ROOT, name, FileType::Regular).await;
        if !blind {
            w.add_extent(f, 0, 4096, 4 << 20).await;
        }
        w.run(Mutation::Hold { ino: f }).await.unwrap();
        // Planned from the caches (an empty file, nothing read) or from etcd.
        let expect = if blind {
            Some(UnlinkExpect {
                entry: Dentry {
                    ino: f,
                    kind: FileType::Regular,
                },
                child: w.inode(f).await,
                parent: None,
                extents: None,
            })
        } else {
            None
        };
        let m = unlink_dropping_own_hold(name, expect);
        let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
        assert_eq!(rounds == 0, blind, "{name}");
        hold_as(&w, f, other).await;
        assert!(w.apply(&p.unwrap()).await.is_err(), "{name}");
        assert!(w.inode(f).await.is_some(), "{name}");
        let o = w.run(unlink_dropping_own_hold(name, None)).await.unwrap();
        assert_eq!(o.orphaned, Some(f), "{name}: planned again");
    }
}

/// A chmod, chown or utimes planned from the cached inode reads nothing; a stale cache
/// never commits its old values: the compare fails and the re-plan changes what etcd holds.
#[tokio::test]
async fn setattr_from_the_cached_inode_reads_nothing_and_never_reverts() {
    let mut w = World::new().await;
    let f = w.create(Ino::ROOT, "f", FileType::Regular).await;
    let cached = w.inode(f).await.unwrap();
    let chown = |uid: u32, expect: Option<InodeAttr>| Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            uid: Some(uid),
            expect: expect.map(Box::new),
            ..Default::default()
        },
    };
    let (p, rounds) = w
        .plan(&chown(7, Some(cached.clone())), &mut Snapshot::default())
        .await;
    assert_eq!(rounds, 0);
    let a = w.apply(&p.unwrap()).await.unwrap().attr.unwrap();
    assert_eq!((a.uid, a.ctime), (7, NOW));
    assert_eq!(w.inode(f).await.unwrap(), a);

    // Another node's chmod since: the cached attributes would put the old mode back.
    let chmod = Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            perm: Some(0o600),
            ..Default::default()
        },
    };
    w.run(chmod).await.unwrap();
    let mut m = chown(8, Some(a));
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    assert_eq!(rounds, 0);
    assert!(w.apply(&p.unwrap()).await.is_err(), "stale cache caught");
    assert!(m.forget_expectation());
    let a = w.run(m).await.unwrap().attr.unwrap();
    assert_eq!((a.uid, a.perm), (8, 0o600));

    // A chown's clearing of the set-id bits is decided on the mode it changes: a cache
    // that missed another node's chmod u+s fails the compare, the re-plan clears the bit.
    let setid = Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            perm: Some(0o6755),
            ..Default::default()
        },
    };
    w.run(setid).await.unwrap();
    let chown_killing = |expect: InodeAttr| Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            uid: Some(9),
            kill_suidgid: true,
            expect: Some(Box::new(expect)),
            ..Default::default()
        },
    };
    let mut m = chown_killing(a.clone());
    assert!(w.run(m.clone()).await.is_err(), "stale cache caught");
    assert!(m.forget_expectation());
    let a = w.run(m).await.unwrap().attr.unwrap();
    assert_eq!((a.uid, a.perm), (9, 0o755));
    // Without group-execute the set-group-id bit stays (it marks mandatory locking).
    let sgid_only = Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            perm: Some(0o6745),
            ..Default::default()
        },
    };
    let cur = w.run(sgid_only).await.unwrap().attr.unwrap();
    let a = w.run(chown_killing(cur)).await.unwrap().attr.unwrap();
    assert_eq!(a.perm, 0o2745);

    // A change conditioned on a revision reads it, whatever the cache says.
    let m = Mutation::SetAttr {
        ino: f,
        set: SetAttr {
            mtime: Some(TimeSet::At(Timespec::new(9, 0))),
            unchanged_since: Some(i64::MAX),
            expect: Some(Box::new(a)),
            ..Default::default()
        },
    };
    let (p, rounds) = w.plan(&m, &mut Snapshot::default()).await;
    assert_eq!(rounds, 1);
    w.apply(&p.unwrap()).await.unwrap();
}

/// A directory's fsync writes its coalesced timestamps from the cached inode: nothing read.
/// A stale cache never moves a time backwards, and a cache that says "nothing to write"
/// is checked against etcd before nothing is written.
#[tokio::test]
async fn touch_from_the_cached_inode_reads_nothing_and_never_goes_backwards() {
    let mut w = World::new().await;
    let d = w.create(Ino::ROOT, "d", FileType::Directory).await;
    let cached = w.inode(d).await.unwrap();
    let at = |sec: i64| Timespec::new(NOW.sec + sec, 0);
    let touch = |t: Timespec, expect: &InodeAttr| Mutation::Touch {
        ino: d,
        mtime: Some(t),
        ctime: t,
        expect: Some(Box::new(expect.clone())),
    };
    let (p, rounds) = w
        .plan(&touch(at(10), &cached), &mut Snapshot::default())
        .await;
    assert_eq!(rounds, 0);
    let a = w.apply(&p.unwrap()).await.unwrap().attr.unwrap();
    assert_eq!((a.mtime, a.ctime), (at(10), at(10)));
    // Another node wrote a later time since: the stale cache fails the compare, the
    // re-plan keeps the later time.
    let later = Mutation::Touch {
        ino: d,
        mtime: Some(at(30)),
        ctime: at(30),
        expect: None,
    };
    w.run(later).await.unwrap();
    let mut m = touch(at(20), &a);
    assert!(w.run(m.clone()).await.is_err(), "stale cache caught");
    assert!(m.forget_expectation());
    let o = w.run(m).await.unwrap();
    assert!(o.attr.is_none(), "nothing written");
    assert_eq!(w.inode(d).await.unwrap().mtime, at(30));
    // A cache showing a time later than etcd's: "nothing to write" is read, not guessed.
    let mut ahead = w.inode(d).await.unwrap();
    ahead.mtime = at(50);
    ahead.ctime = at(50);
    let (p, rounds) = w
        .plan(&touch(at(40), &ahead), &mut Snapshot::default())
        .await;
    assert_eq!(rounds, 1);
    w.apply(&p.unwrap()).await.unwrap();
    assert_eq!(w.inode(d).await.unwrap().mtime, at(40));
}
