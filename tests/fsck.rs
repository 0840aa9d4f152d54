//! `etcfs fsck` on real filesystems (issue 15): a populated filesystem is clean, mounted
//! or not; while mounted the check is read-only and `--repair` is refused; records
//! corrupted straight in etcd (through the meta crate's codec) are found by class, the
//! repair fixes what it can and a second run is clean; a double allocation is named and
//! left; an unformatted device or an unknown prefix is an operational error.
//!
//! Needs root, `/dev/fuse` and `ETCD_ENDPOINTS` (see `common`); skips loudly otherwise,
//! and fails instead when `ETCFS_REQUIRE_MOUNT_TESTS=1`.

mod common;

use std::{
    fs::{self, File, OpenOptions},
    io::{Seek as _, SeekFrom, Write as _},
    os::unix::fs::{symlink, MetadataExt as _},
    process::Command,
    time::Duration,
};

use common::{assert_same_bytes, helper, noise, run_bounded, TestFs, ETCFS};
use meta::{
    codec::{Extent, InodeAttr, Record as _},
    etcd::{EtcdBackend, EtcdConfig},
    keys::Keyspace,
    kv::{KvBackend, RangeRequest, Txn, TxnOp},
    types::Ino,
};
use serde_json::Value;

/// `etcfs fsck --json` (plus `extra`): the exit code and the report.
fn fsck(fs: &TestFs, extra: &[&str]) -> (i32, Value, String) {
    let (out, in_time) = run_bounded(
        Command::new(ETCFS)
            .args(["fsck", "--etcd", &fs.endpoints, "--device"])
            .arg(&fs.image)
            .args(["--prefix", &fs.prefix, "--json"])
            .args(extra),
        Duration::from_secs(60),
    );
    assert!(in_time, "etcfs fsck {extra:?} hung");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let v: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("fsck --json is not JSON ({e}): {text}\nstderr: {err}"));
    (out.status.code().unwrap_or(-1), v, err)
}

/// Classes found, by name.
fn classes(v: &Value) -> Vec<String> {
    v["classes"]
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}

/// The etcd records, through the meta crate.
struct Etcd {
    rt: tokio::runtime::Runtime,
    kv: EtcdBackend,
    keys: Keyspace,
}

impl Etcd {
    fn new(fs: &TestFs) -> Etcd {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let kv = rt
            .block_on(EtcdBackend::connect(&EtcdConfig::new(vec![fs
                .endpoints
                .clone()])))
            .expect("connect to etcd");
        Etcd {
            rt,
            kv,
            keys: Keyspace::new(&fs.prefix).unwrap(),
        }
    }

    fn get(&self, key: Vec<u8>) -> Option<Vec<u8>> {
        let r = self
            .rt
            .block_on(self.kv.range(RangeRequest::key(key)))
            .unwrap();
        r.kvs.into_iter().next().map(|kv| kv.value)
    }

    fn write(&self, ops: Vec<TxnOp>) {
        let r = self
            .rt
            .block_on(self.kv.txn(Txn {
                compares: vec![],
                success: ops,
                failure: vec![],
            }))
            .unwrap();
        assert!(r.succeeded);
    }

    /// The first extent of `ino`: its key and value.
    fn first_extent(&self, ino: u64) -> (Vec<u8>, Extent) {
        let r = self.keys.extents(Ino(ino));
        let resp = self
            .rt
            .block_on(self.kv.range(RangeRequest::range(r.start, r.end).limit(1)))
            .unwrap();
        let kv = resp.kvs.into_iter().next().expect("an extent");
        let Some(meta::keys::KeyKind::Extent(_, off)) = self.keys.parse(&kv.key) else {
            panic!("not an extent key");
        };
        (kv.key, Extent::decode_value(off, &kv.value).unwrap())
    }

    fn set_nlink(&self, ino: u64, nlink: u32) {
        let key = self.keys.inode(Ino(ino));
        let mut a = InodeAttr::decode(&self.get(key.clone()).expect("inode")).unwrap();
        a.nlink = nlink;
        self.write(vec![TxnOp::put(key, a.encode())]);
    }
}

fn ino_of(p: &std::path::Path) -> u64 {
    fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("stat {}: {e}", p.display()))
        .ino()
}

#[test]
fn fsck_finds_what_was_corrupted_and_repairs_it() {
    // Small groups: the files spread over several of them.
    let Some(fs) = common::small_groups("fsck_corrupted", 256 << 20, 4) else {
        return;
    };
    let m = fs.mount("auto", &[]);
    fs::create_dir_all(m.path("a/b/c")).unwrap();
    let files = [
        "a/f",
        "a/b/gone",
        "a/b/counted",
        "a/leak",
        "share1",
        "share2",
    ];
    let mut data = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let d = noise(100_000 + i * 5000, i as u64 + 1);
        fs::write(m.path(f), &d).unwrap();
        data.push(d);
    }
    fs::hard_link(m.path("a/f"), m.path("a/b/c/f2")).unwrap();
    symlink("../f", m.path("a/b/s")).unwrap();
    helper(&[
        "setxattr",
        m.path("a/f").to_str().unwrap(),
        "user.k",
        "v",
        "none",
    ])
    .expect("setxattr");
    // A fragmented file: every other block, each write fsync'd.
    let frag_path = m.path("a/b/c/frag");
    let mut frag = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&frag_path)
        .unwrap();
    // The last block written is 62: the file ends there.
    let mut frag_want = vec![0u8; 63 * 4096];
    for i in (0..64).step_by(2) {
        let blk = noise(4096, 100 + i as u64);
        frag.seek(SeekFrom::Start(i as u64 * 4096)).unwrap();
        frag.write_all(&blk).unwrap();
        frag.sync_all().unwrap();
        frag_want[i * 4096..(i + 1) * 4096].copy_from_slice(&blk);
    }
    drop(frag);
    let inos: Vec<u64> = files.iter().map(|f| ino_of(&m.path(f))).collect();
    File::open(m.path("a")).unwrap().sync_all().unwrap();

    // Mounted: read-only, clean, the node named; --repair refused.
    let (code, v, _) = fsck(&fs, &[]);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(
        v["mounted_nodes"].as_array().map(Vec::len),
        Some(1),
        "{v:#}"
    );
    assert!(v["counts"]["extents"].as_u64().unwrap() >= 32 + 6, "{v:#}");
    let (code, v, err) = fsck(&fs, &["--repair"]);
    assert_eq!(code, 8, "{v:#}");
    assert!(err.contains("refusing --repair"), "{err}");
    m.stop();

    let (code, v, _) = fsck(&fs, &[]);
    assert_eq!(code, 0, "unmounted, clean: {v:#}");
    assert!(v["mounted_nodes"].as_array().unwrap().is_empty());

    // Corrupt: the inode a dentry names goes; a link count changes; an extent key goes.
    let etcd = Etcd::new(&fs);
    etcd.write(vec![TxnOp::delete(etcd.keys.inode(Ino(inos[1])))]);
    etcd.set_nlink(inos[2], 5);
    let (leak_key, _) = etcd.first_extent(inos[3]);
    etcd.write(vec![TxnOp::delete(leak_key)]);
    let (code, v, _) = fsck(&fs, &[]);
    assert_eq!(code, 4, "{v:#}");
    let c = classes(&v);
    for want in ["dangling_dentry", "link_count", "leaked_blocks"] {
        assert!(c.iter().any(|x| x == want), "{want} not found: {v:#}");
    }
    let (code, v, _) = fsck(&fs, &["--repair"]);
    assert_eq!(code, 1, "the repair corrects everything: {v:#}");
    let (code, v, _) = fsck(&fs, &[]);
    assert_eq!(code, 0, "clean after the repair: {v:#}");

    // Two files share an extent: found, both named, never repaired.
    let (k2, mut e2) = etcd.first_extent(inos[5]);
    let (_, e1) = etcd.first_extent(inos[4]);
    e2.dev_off = e1.dev_off;
    e2.len = e2.len.min(e1.len);
    etcd.write(vec![TxnOp::put(k2, e2.encode_value())]);
    let (code, v, _) = fsck(&fs, &[]);
    assert_eq!(code, 4, "{v:#}");
    let double: Vec<&Value> = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["class"] == "double_allocation")
        .collect();
    assert_eq!(double.len(), 1, "{v:#}");
    let msg = double[0]["message"].as_str().unwrap();
    assert!(msg.contains("/share1") && msg.contains("/share2"), "{msg}");
    let (code, v, _) = fsck(&fs, &["--repair"]);
    assert_eq!(code, 4, "{v:#}");
    let (code, v, _) = fsck(&fs, &[]);
    assert_eq!(code, 4, "{v:#}");
    assert_eq!(classes(&v), vec!["double_allocation".to_string()], "{v:#}");

    // The files the repair kept are whole.
    let m = fs.mount("auto", &[]);
    assert_same_bytes("a/f", &fs::read(m.path("a/f")).unwrap(), &data[0]);
    assert_same_bytes("a/b/c/f2", &fs::read(m.path("a/b/c/f2")).unwrap(), &data[0]);
    assert_same_bytes("frag", &fs::read(m.path("a/b/c/frag")).unwrap(), &frag_want);
    assert!(!m.path("a/b/gone").exists());
    assert_eq!(fs::metadata(m.path("a/b/counted")).unwrap().nlink(), 1);
    m.stop();
}

#[test]
fn fsck_of_an_unformatted_device_or_unknown_prefix_is_an_operational_error() {
    let Some(endpoints) = common::etcd_or_skip("fsck_unformatted", None) else {
        return;
    };
    let blank = TestFs::blank("fsck_unformatted", &endpoints, 64 << 20);
    let (code, v, err) = fsck(&blank, &[]);
    assert_eq!(code, 8, "{v:#}");
    assert!(err.contains("holds no etcfs filesystem"), "{err}");
    let mut other = TestFs::blank("fsck_unformatted2", &endpoints, 64 << 20);
    other.mkfs();
    // The formatted prefix with the blank device: not formatted.
    let (out, _) = run_bounded(
        Command::new(ETCFS)
            .args(["fsck", "--etcd", &endpoints, "--device"])
            .arg(&blank.image)
            .args(["--prefix", &other.prefix]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(8));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not formatted"), "{err}");
    // The right device, clean.
    let (code, v, _) = fsck(&other, &[]);
    assert_eq!(code, 0, "{v:#}");
    // A damaged backup superblock (the device's last block) is found and rewritten.
    let len = fs::metadata(&other.image).unwrap().len();
    let mut img = OpenOptions::new().write(true).open(&other.image).unwrap();
    img.seek(SeekFrom::Start(len / 4096 * 4096 - 4096)).unwrap();
    img.write_all(&[0xa5; 512]).unwrap();
    img.sync_all().unwrap();
    drop(img);
    let (code, v, _) = fsck(&other, &[]);
    assert_eq!(code, 4, "{v:#}");
    assert_eq!(classes(&v), vec!["superblock_copy".to_string()], "{v:#}");
    let (code, v, _) = fsck(&other, &["--repair"]);
    assert_eq!(code, 1, "{v:#}");
    let (code, v, _) = fsck(&other, &[]);
    assert_eq!(code, 0, "{v:#}");
}
