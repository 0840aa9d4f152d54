//! Every finding class made by a constructed inconsistency on the in-memory etcd, and
//! the repairs: after `--repair` a second check is clean (or left with only what is
//! never repaired).

#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use std::{collections::BTreeMap, sync::Arc};

use meta::{
    clock::SystemClock,
    codec::{
        Dentry, DirParent, Extent, InoCounter, InodeAttr, Owner, Record as _, Released, SuperRecord,
    },
    keys::{Keyspace, LockKey},
    kv::{KvBackend, TxnOp},
    model::MemEtcd,
    types::{FileType, GroupId, Ino, SessionId, Timespec},
};

use super::{
    check::{Checker, Class},
    repair, scan_all, Progress,
};
use crate::data::{alloc::AgFreeMap, superblock::Geometry, AgId, BLOCK_SIZE};

const T: Timespec = Timespec::new(1_700_000_000, 0);
/// 4 groups of 64 blocks.
const GROUPS: u64 = 4;

struct World {
    kv: Arc<MemEtcd>,
    keys: Keyspace,
    geo: Geometry,
    rt: tokio::runtime::Runtime,
    maps: BTreeMap<u32, AgFreeMap>,
    next_ino: u64,
}

fn attr(ino: Ino, kind: FileType, nlink: u32, size: u64) -> InodeAttr {
    InodeAttr {
        ino,
        kind,
        perm: 0o644,
        uid: 0,
        gid: 0,
        size,
        nlink,
        atime: T,
        mtime: T,
        ctime: T,
        crtime: T,
        rdev: 0,
        generation: 1,
        flags: 0,
    }
}

impl World {
    /// A formatted, empty filesystem.
    fn new() -> World {
        let geo = Geometry::new((256 + GROUPS * 64 + 1) * BLOCK_SIZE, 64).unwrap();
        let keys = Keyspace::new("t").unwrap();
        let kv = Arc::new(MemEtcd::new(Arc::new(SystemClock::new())));
        let w = World {
            kv,
            keys,
            geo,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            maps: BTreeMap::new(),
            next_ino: Ino::FIRST_DYNAMIC,
        };
        let sb = SuperRecord {
            uuid: [7; 16],
            format_version: 1,
            block_size: 4096,
            group_size: 64 * BLOCK_SIZE,
            group_count: geo.ag_count,
            device_size: geo.device_size,
            created: T,
        };
        w.put(&w.keys.superblock(), &sb.encode());
        w.put(
            &w.keys.inode(Ino::ROOT),
            &attr(Ino::ROOT, FileType::Directory, 2, 0).encode(),
        );
        w.put(
            &w.keys.dir_parent(Ino::ROOT),
            &DirParent { parent: Ino::ROOT }.encode(),
        );
        w
    }

    fn put(&self, key: &[u8], value: &[u8]) {
        self.kv.put_raw(key, value);
    }

    fn del(&self, key: &[u8]) {
        self.rt
            .block_on(self.kv.txn(meta::kv::Txn {
                compares: vec![],
                success: vec![TxnOp::delete(key.to_vec())],
                failure: vec![],
            }))
            .unwrap();
    }

    fn get_attr(&self, ino: Ino) -> InodeAttr {
        let r = self
            .rt
            .block_on(
                self.kv
                    .range(meta::kv::RangeRequest::key(self.keys.inode(ino))),
            )
            .unwrap();
        InodeAttr::decode(&r.kvs[0].value).unwrap()
    }

    fn set_nlink(&self, ino: Ino, nlink: u32) {
        let mut a = self.get_attr(ino);
        a.nlink = nlink;
        self.put(&self.keys.inode(ino), &a.encode());
    }

    fn ino(&mut self) -> Ino {
        self.next_ino += 1;
        self.put(
            &self.keys.ino_counter(),
            &InoCounter {
                next: self.next_ino + 1,
            }
            .encode(),
        );
        Ino(self.next_ino)
    }

    fn entry(&self, parent: Ino, name: &str, ino: Ino, kind: FileType) {
        self.put(
            &self.keys.dentry(parent, name.as_bytes()),
            &Dentry { ino, kind }.encode(),
        );
    }

    fn mkdir(&mut self, parent: Ino, name: &str) -> Ino {
        let ino = self.ino();
        self.put(
            &self.keys.inode(ino),
            &attr(ino, FileType::Directory, 2, 0).encode(),
        );
        self.put(&self.keys.dir_parent(ino), &DirParent { parent }.encode());
        self.entry(parent, name, ino, FileType::Directory);
        let n = self.get_attr(parent).nlink;
        self.set_nlink(parent, n + 1);
        ino
    }

    /// A regular file whose extents are (first block, blocks), marked used in the maps.
    fn file(&mut self, parent: Ino, name: &str, extents: &[(u64, u64)]) -> Ino {
        let ino = self.ino();
        let size = extents.iter().map(|e| e.1).sum::<u64>() * BLOCK_SIZE;
        self.put(
            &self.keys.inode(ino),
            &attr(ino, FileType::Regular, 1, size).encode(),
        );
        self.entry(parent, name, ino, FileType::Regular);
        let mut off = 0;
        for &(b, n) in extents {
            self.extent(ino, off, b, n);
            self.mark_used(b, n);
            off += n * BLOCK_SIZE;
        }
        ino
    }

    fn extent(&self, ino: Ino, off: u64, block: u64, n: u64) {
        let e = Extent {
            file_off: off,
            len: n * BLOCK_SIZE,
            dev_off: block * BLOCK_SIZE,
            unwritten: false,
        };
        self.put(&self.keys.extent(ino, off), &e.encode_value());
    }

    fn mark_used(&mut self, block: u64, n: u64) {
        let g = self.geo.ag_of(crate::data::BlockNo(block)).unwrap();
        let span = self.geo.ag_extent(g).unwrap();
        let m = self
            .maps
            .entry(g.0)
            .or_insert_with(|| AgFreeMap::all_free(g, span));
        let _ = m.mark_used(crate::data::Extent::new(block, n));
        let bytes = m.encode();
        self.put(&self.keys.free_map(GroupId(g.0)), &bytes);
    }

    /// Block `i` of group `g`.
    fn block(&self, g: u32, i: u64) -> u64 {
        self.geo.ag_extent(AgId(g)).unwrap().start.0 + i
    }

    fn check_mode(&self, repair: bool) -> anyhow::Result<Checker> {
        let mut ck = Checker::new(self.keys.clone(), self.geo, self.kv.revision());
        let kv: &dyn KvBackend = &*self.kv;
        self.rt.block_on(scan_all(
            kv,
            &self.keys,
            &mut ck,
            repair,
            &mut Progress::new(false),
        ))?;
        ck.report_collisions();
        ck.finish();
        Ok(ck)
    }

    fn check(&self) -> Checker {
        self.check_mode(false).unwrap()
    }

    /// `--repair`: the check, then the repairs. Returns the checker (findings marked).
    fn repair(&self) -> Checker {
        let mut ck = self.check_mode(true).unwrap();
        let (applied, stopped) = self.rt.block_on(repair::apply(&*self.kv, &ck, None));
        assert_eq!(stopped, None, "the repair stopped");
        ck.mark_fixed(&applied);
        ck
    }

    /// A small consistent population: /d/e, /d/f (2 blocks), /g (hard link to /d/f), /s.
    fn populated() -> (World, Pop) {
        let mut w = World::new();
        let d = w.mkdir(Ino::ROOT, "d");
        let e = w.mkdir(d, "e");
        let b0 = w.block(0, 0);
        let f = w.file(d, "f", &[(b0, 2)]);
        w.entry(Ino::ROOT, "g", f, FileType::Regular);
        w.set_nlink(f, 2);
        let b1 = w.block(1, 10);
        let h = w.file(e, "h", &[(b1, 1), (b1 + 5, 3)]);
        let s = w.ino();
        w.put(&w.keys.inode(s), &attr(s, FileType::Symlink, 1, 3).encode());
        w.put(
            &w.keys.symlink(s),
            &meta::codec::SymlinkTarget(b"d/f".to_vec()).encode(),
        );
        w.entry(Ino::ROOT, "s", s, FileType::Symlink);
        w.put(
            &w.keys.xattr(f, b"user.a"),
            &meta::codec::XattrValue(b"1".to_vec()).encode(),
        );
        (w, Pop { d, e, f, h, s })
    }
}

#[allow(dead_code)]
struct Pop {
    d: Ino,
    e: Ino,
    f: Ino,
    h: Ino,
    s: Ino,
}

fn classes(ck: &Checker) -> BTreeMap<Class, u64> {
    ck.by_class.iter().map(|(c, n)| (*c, n.found)).collect()
}

fn assert_clean(ck: &Checker) {
    let msgs: Vec<&str> = ck.findings.iter().map(|f| f.message.as_str()).collect();
    assert_eq!(ck.found(), 0, "{msgs:#?}");
}

/// Repairs, then checks again: clean.
fn repair_then_clean(w: &World) -> Checker {
    let ck = w.repair();
    assert_eq!(ck.unrepaired(), 0, "{:#?}", ck.findings);
    assert_clean(&w.check());
    ck
}

#[test]
fn a_consistent_population_is_clean() {
    let (w, _) = World::populated();
    let ck = w.check();
    assert_clean(&ck);
    assert_eq!(ck.counts.inodes, 6);
    assert_eq!(ck.counts.extents, 3);
    assert_eq!(ck.counts.blocks_in_files, 6);
}

#[test]
fn a_dentry_naming_a_missing_inode_is_dangling() {
    let (w, p) = World::populated();
    w.del(&w.keys.inode(p.h));
    let ck = w.check();
    let c = classes(&ck);
    assert_eq!(c.get(&Class::DanglingDentry), Some(&1), "{c:?}");
    // Its extents are left without an inode: stray, and their blocks freed by the repair.
    assert_eq!(c.get(&Class::StrayRecord), Some(&2), "{c:?}");
    repair_then_clean(&w);
}

#[test]
fn a_wrong_link_count_is_found_and_set() {
    let (w, p) = World::populated();
    w.set_nlink(p.f, 5);
    w.set_nlink(p.d, 7);
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::LinkCount), Some(&2), "{c:?}");
    repair_then_clean(&w);
    assert_eq!(w.get_attr(p.f).nlink, 2);
    assert_eq!(w.get_attr(p.d).nlink, 3);
}

#[test]
fn two_files_sharing_blocks_are_a_double_allocation_named_and_left() {
    let (mut w, p) = World::populated();
    let shared = w.block(0, 1);
    let x = w.file(p.e, "x", &[(shared, 1)]);
    let ck = w.check();
    let found: Vec<_> = ck
        .findings
        .iter()
        .filter(|f| f.class == Class::DoubleAllocation)
        .collect();
    assert_eq!(found.len(), 1, "{:#?}", ck.findings);
    let m = &found[0].message;
    assert!(
        m.contains(&format!("inode {} /d/f", p.f.0)) || m.contains(&format!("inode {} /g", p.f.0)),
        "{m}"
    );
    assert!(m.contains(&format!("inode {} /d/e/x", x.0)), "{m}");
    assert!(found[0].repair.is_none());
    let ck = w.repair();
    assert_eq!(ck.unrepaired(), 1, "only the double allocation is left");
}

#[test]
fn an_extent_key_removed_leaks_its_blocks_until_the_map_is_rebuilt() {
    let (w, p) = World::populated();
    w.del(&w.keys.extent(p.h, BLOCK_SIZE));
    let ck = w.check();
    let leaks: Vec<_> = ck
        .findings
        .iter()
        .filter(|f| f.class == Class::LeakedBlocks)
        .collect();
    assert_eq!(leaks.len(), 1, "{:#?}", ck.findings);
    assert!(
        leaks[0].message.contains("(3 blocks)"),
        "{}",
        leaks[0].message
    );
    repair_then_clean(&w);
}

#[test]
fn several_leaks_in_one_group_are_one_rebuild() {
    let (mut w, p) = World::populated();
    let (a, b) = (w.block(1, 40), w.block(1, 50));
    w.mark_used(a, 2);
    w.mark_used(b, 3);
    w.del(&w.keys.extent(p.h, 0));
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::LeakedBlocks), Some(&3), "{c:?}");
    let ck = repair_then_clean(&w);
    assert_eq!(ck.by_class[&Class::LeakedBlocks].fixed, 3);
}

#[test]
fn blocks_in_use_that_the_map_calls_free_are_found() {
    let (w, p) = World::populated();
    // An extent whose blocks no map marks used.
    let b = w.block(2, 3);
    w.extent(p.h, 16 * BLOCK_SIZE, b, 2);
    let ck = w.check();
    let c = classes(&ck);
    assert_eq!(c.get(&Class::ExtentInFreeSpace), Some(&1), "{c:?}");
    let f = ck
        .findings
        .iter()
        .find(|f| f.class == Class::ExtentInFreeSpace)
        .unwrap();
    assert!(f.message.contains("/d/e/h"), "{}", f.message);
    repair_then_clean(&w);
}

#[test]
fn a_released_record_pending_is_no_leak_but_one_covering_used_blocks_is_found() {
    let (mut w, p) = World::populated();
    // A freed range not yet folded: used in the map, in no extent, record newer.
    let b = w.block(3, 0);
    w.mark_used(b, 4);
    w.put(
        &w.keys.released(b * BLOCK_SIZE),
        &Released {
            len: 4 * BLOCK_SIZE,
        }
        .encode(),
    );
    assert_clean(&w.check());
    // Now a record over blocks a file uses: the next load would free them.
    let used = w.block(1, 10);
    w.put(
        &w.keys.released(used * BLOCK_SIZE),
        &Released { len: BLOCK_SIZE }.encode(),
    );
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::ReleasedInUse), Some(&1), "{c:?}");
    repair_then_clean(&w);
    let _ = p;
}

#[test]
fn a_file_without_names_goes_to_lost_and_found() {
    let (w, p) = World::populated();
    w.del(&w.keys.dentry(p.e, b"h"));
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::Unreachable), Some(&1), "{c:?}");
    repair_then_clean(&w);
    let root = w.get_attr(Ino::ROOT);
    assert_eq!(root.nlink, 4, "root has d and lost+found");
    let r =
        w.rt.block_on(w.kv.range(meta::kv::RangeRequest::key(
            w.keys.dentry(Ino::ROOT, b"lost+found"),
        )))
        .unwrap();
    let lf = Dentry::decode(&r.kvs[0].value).unwrap().ino;
    let r =
        w.rt.block_on(w.kv.range(meta::kv::RangeRequest::key(
            w.keys.dentry(lf, format!("#{}", p.h.0).as_bytes()),
        )))
        .unwrap();
    assert_eq!(Dentry::decode(&r.kvs[0].value).unwrap().ino, p.h);
}

#[test]
fn a_directory_cycle_is_broken_into_lost_and_found() {
    let (mut w, p) = World::populated();
    let a = w.mkdir(Ino::ROOT, "a");
    let b = w.mkdir(a, "b");
    // a moves under b: its entry in the root goes, b names it, its parent record says b.
    w.del(&w.keys.dentry(Ino::ROOT, b"a"));
    w.entry(b, "a", a, FileType::Directory);
    w.put(&w.keys.dir_parent(a), &DirParent { parent: b }.encode());
    w.set_nlink(Ino::ROOT, 3);
    w.set_nlink(b, 3);
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::DirectoryCycle), Some(&1), "{c:?}");
    repair_then_clean(&w);
    let _ = p;
}

#[test]
fn a_directory_named_twice_or_against_its_parent_record() {
    let (w, p) = World::populated();
    // A second name of /d/e in the root.
    w.entry(Ino::ROOT, "e2", p.e, FileType::Directory);
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::DirectoryName), Some(&1), "{c:?}");
    repair_then_clean(&w);
    // A parent record that disagrees with the only name.
    w.put(
        &w.keys.dir_parent(p.e),
        &DirParent { parent: Ino::ROOT }.encode(),
    );
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::DirectoryName), Some(&1), "{c:?}");
    repair_then_clean(&w);
}

#[test]
fn an_orphan_nobody_holds_is_reclaimed_with_its_blocks() {
    let (mut w, p) = World::populated();
    let b = w.block(2, 0);
    let o = w.file(p.d, "o", &[(b, 8)]);
    w.del(&w.keys.dentry(p.d, b"o"));
    w.set_nlink(o, 0);
    w.put(
        &w.keys.orphan(o),
        &Owner {
            session: SessionId(77),
        }
        .encode(),
    );
    // Held by a live node: fine.
    w.put(&w.keys.member(SessionId(5)), b"x");
    w.put(
        &w.keys.held(o, SessionId(5)),
        &Owner {
            session: SessionId(5),
        }
        .encode(),
    );
    assert_clean(&w.check());
    // The node is gone (its records went with its lease): an orphan nobody holds.
    w.del(&w.keys.member(SessionId(5)));
    w.del(&w.keys.held(o, SessionId(5)));
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::Orphan), Some(&1), "{c:?}");
    repair_then_clean(&w);
    let m = w.check();
    assert_eq!(m.counts.inodes, 6);
}

#[test]
fn records_of_dead_sessions_are_found_and_deleted() {
    let (w, p) = World::populated();
    let s = SessionId(99);
    w.put(&w.keys.held(p.f, s), &Owner { session: s }.encode());
    let lock = LockKey {
        ino: p.f,
        session: s,
        owner: 1,
        flock: true,
        start: 0,
    };
    w.put(
        &w.keys.lock(&lock),
        &meta::codec::LockRecord {
            write: true,
            end: u64::MAX,
            pid: 1,
        }
        .encode(),
    );
    w.put(&w.keys.group(GroupId(1)), &Owner { session: s }.encode());
    w.put(&w.keys.evict(s), &Owner { session: s }.encode());
    w.put(&w.keys.txn_marker(s, 7), b"");
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::DeadSession), Some(&5), "{c:?}");
    repair_then_clean(&w);
}

#[test]
fn with_a_node_mounted_findings_may_be_in_flux_and_repair_is_refused() {
    let (w, p) = World::populated();
    w.put(&w.keys.member(SessionId(5)), b"x");
    w.del(&w.keys.extent(p.h, 0));
    let ck = w.check();
    let leak = ck
        .findings
        .iter()
        .find(|f| f.class == Class::LeakedBlocks)
        .unwrap();
    assert!(leak.in_flux);
    let err = w.check_mode(true).err().unwrap().to_string();
    assert!(err.contains("refusing --repair"), "{err}");
}

#[test]
fn a_node_mounting_during_the_repair_stops_it() {
    let (w, p) = World::populated();
    w.set_nlink(p.f, 9);
    let ck = w.check_mode(true).unwrap();
    w.put(&w.keys.member(SessionId(5)), b"x");
    let (applied, stopped) = w.rt.block_on(repair::apply(&*w.kv, &ck, None));
    assert!(applied.iter().all(|a| !a));
    assert!(stopped.unwrap().contains("a node mounted"));
    assert_eq!(w.get_attr(p.f).nlink, 9);
}

#[test]
fn inode_numbers_above_the_counter_are_found_and_the_counter_raised() {
    let (w, _) = World::populated();
    w.put(&w.keys.ino_counter(), &InoCounter { next: 1025 }.encode());
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::InodeCounter), Some(&1), "{c:?}");
    repair_then_clean(&w);
}

#[test]
fn a_dentry_of_the_wrong_type_is_rewritten() {
    let (w, p) = World::populated();
    w.entry(Ino::ROOT, "s", p.s, FileType::Regular);
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::DentryType), Some(&1), "{c:?}");
    repair_then_clean(&w);
}

#[test]
fn an_extent_outside_the_data_area_is_found() {
    let (w, p) = World::populated();
    w.extent(p.h, 64 * BLOCK_SIZE, 3, 1);
    let c = classes(&w.check());
    assert_eq!(c.get(&Class::ExtentOutside), Some(&1), "{c:?}");
    repair_then_clean(&w);
}

#[test]
fn overlapping_extents_of_one_file_and_corrupt_records_are_left() {
    let (w, p) = World::populated();
    let b = w.block(1, 30);
    // Starts inside the first extent (file bytes 0..4096).
    w.extent(p.h, 2048, b, 1);
    w.put(&w.keys.xattr(p.h, b"user.z"), b"\x09garbage");
    w.put(&w.keys.inode(Ino(5000)), b"\x01short");
    let c = classes(&w.check());
    // It overlaps the extent before it and the one after.
    assert_eq!(c.get(&Class::ExtentOverlap), Some(&2), "{c:?}");
    assert_eq!(c.get(&Class::CorruptRecord), Some(&1), "{c:?}");
    let ck = w.repair();
    assert!(ck.unrepaired() >= 2);
}

#[test]
fn midpoints_split_key_ranges_strictly_inside() {
    use super::midpoint;
    assert_eq!(midpoint(b"a", b"c"), Some(b"b".to_vec()));
    let m = midpoint(b"t/D\x00\x00", b"t/E").unwrap();
    assert!(m.as_slice() > b"t/D\x00\x00".as_slice() && m.as_slice() < b"t/E".as_slice());
    let m = midpoint(b"t/Dabc", b"t/Dabd").unwrap();
    assert!(m.as_slice() > b"t/Dabc".as_slice() && m.as_slice() < b"t/Dabd".as_slice());
    assert_eq!(midpoint(b"a", b"a\x00"), None);
}

#[test]
fn a_large_range_is_read_whole_when_split() {
    // Many more keys than a page: the scan splits the range and still sees each once.
    let mut w = World::new();
    let d = w.mkdir(Ino::ROOT, "big");
    for i in 0..3000 {
        let ino = w.ino();
        w.put(
            &w.keys.inode(ino),
            &attr(ino, FileType::Regular, 1, 0).encode(),
        );
        w.entry(d, &format!("n{i:05}"), ino, FileType::Regular);
    }
    let mut ck = Checker::new(w.keys.clone(), w.geo, w.kv.revision());
    let kv: &dyn KvBackend = &*w.kv;
    let mut s = super::Scanner {
        kv,
        rev: w.kv.revision(),
        progress: &mut Progress::new(false),
    };
    let mut seen = Vec::new();
    let r = w.keys.dentries(d);
    w.rt.block_on(s.scan("entries", r, 100, |kv| seen.push(kv.key.clone())))
        .unwrap();
    let n = seen.len();
    seen.dedup();
    assert_eq!((n, seen.len()), (3000, 3000));
    assert!(seen.windows(2).all(|p| p[0] < p[1]), "in key order");
    ck.finish();
}

#[test]
fn xattrs_their_inode_flags_deny_are_found_and_the_flags_fixed() {
    let (w, p) = World::populated();
    // f has user.a: a no-xattrs claim on it hides it; h gets an access ACL with no bit,
    // and a link count off too (two rewrites of one inode in one repair).
    let mut f = w.get_attr(p.f);
    f.flags |= meta::codec::FLAG_NO_XATTRS;
    w.put(&w.keys.inode(p.f), &f.encode());
    w.put(
        &w.keys.xattr(p.h, meta::acl::ACCESS_NAME),
        &meta::codec::XattrValue(b"acl".to_vec()).encode(),
    );
    w.put(
        &w.keys.xattr(p.h, b"user.b"),
        &meta::codec::XattrValue(b"2".to_vec()).encode(),
    );
    let mut h = w.get_attr(p.h);
    h.flags |= meta::codec::FLAG_NO_XATTRS;
    w.put(&w.keys.inode(p.h), &h.encode());
    w.set_nlink(p.h, 5);
    let c = classes(&w.check());
    // One finding per inode.
    assert_eq!(c.get(&Class::XattrFlags), Some(&2), "{c:?}");
    repair_then_clean(&w);
    assert_eq!(w.get_attr(p.f).flags & meta::codec::FLAG_NO_XATTRS, 0);
    let h = w.get_attr(p.h);
    assert_eq!(h.flags & meta::codec::FLAG_NO_XATTRS, 0);
    assert_ne!(h.flags & meta::acl::FLAG_ACCESS, 0);
    assert_eq!(h.nlink, 1);
}
