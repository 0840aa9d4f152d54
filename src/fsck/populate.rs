//! `etcfs bench-populate` (hidden): writes a synthetic, consistent population of files
//! straight into a freshly formatted filesystem's etcd prefix with the meta crate's codec,
//! for benches/fsck.sh (creating a million files through FUSE takes hours on the test
//! machine). It writes what the filesystem would: inodes, directory entries and parent
//! records, one one-block extent per file laid out one after another from the first group,
//! the free maps that mark those blocks used, and the inode counter. Nothing is written to
//! the device (fsck reads no file data). `etcfs fsck` must find it clean.

use std::{collections::BTreeMap, sync::Arc};

use anyhow::{anyhow, bail, Context as _, Result};
use meta::{
    codec::{
        decode_at, Dentry, DirParent, Extent, InoCounter, InodeAttr, Record as _, SuperRecord,
    },
    keys::Keyspace,
    kv::{KvBackend, RangeRequest, Txn, TxnOp},
    types::{FileType, GroupId, Ino, Timespec},
};

use crate::{
    data::{alloc::AgFreeMap, AgId, BlockNo, BLOCK_SIZE},
    ClusterArgs,
};

/// Operations per transaction (etcd allows 128).
const OPS_PER_TXN: usize = 120;
/// Transactions in flight.
const IN_FLIGHT: usize = 16;
/// Files per directory.
const FILES_PER_DIR: u64 = 1000;

/// `etcfs bench-populate` arguments.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct PopulateArgs {
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
    /// Regular files to create (each with one 4 KiB extent), 1000 per directory.
    #[arg(long)]
    pub(crate) files: u64,
}

fn attr(ino: u64, kind: FileType, nlink: u32, size: u64, now: Timespec) -> InodeAttr {
    InodeAttr {
        ino: Ino(ino),
        kind,
        perm: if kind == FileType::Directory {
            0o755
        } else {
            0o644
        },
        uid: 0,
        gid: 0,
        size,
        nlink,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
        rdev: 0,
        generation: 1,
        flags: 0,
    }
}

/// Writes the population; the prefix must hold a freshly formatted, empty filesystem.
pub(crate) fn run(args: &PopulateArgs) -> Result<()> {
    let keys = Keyspace::new(&args.cluster.prefix).map_err(|e| anyhow!("bad --prefix: {e}"))?;
    let rt = crate::status::runtime()?;
    let kv = crate::status::connect(&rt, &args.cluster.etcd_config()?)?;
    rt.block_on(populate(kv, keys, args.files))
}

async fn populate(kv: Arc<dyn KvBackend>, keys: Keyspace, files: u64) -> Result<()> {
    let sb_key = keys.superblock();
    let r = kv.range(RangeRequest::key(sb_key.clone())).await?;
    let Some(sb) = r.kvs.first() else {
        bail!("the prefix holds no filesystem: run `etcfs mkfs` first");
    };
    let fs: SuperRecord = decode_at(&keys, &sb_key, &sb.value)?;
    let geo = crate::status::geometry(&fs)?;
    if geo.data_blocks() < files {
        bail!(
            "the device holds {} data blocks, fewer than {files} files need",
            geo.data_blocks()
        );
    }
    let root = kv.range(RangeRequest::key(keys.inode(Ino::ROOT))).await?;
    let root_kv = root.kvs.first().context("no root inode")?;
    let mut root_attr: InodeAttr = decode_at(&keys, &keys.inode(Ino::ROOT), &root_kv.value)?;
    let now = root_attr.mtime;
    let dirs = files.div_ceil(FILES_PER_DIR).max(1);
    let first_dir = Ino::FIRST_DYNAMIC;
    let first_file = first_dir + dirs;
    let mut ops: Vec<TxnOp> = Vec::new();
    let mut set = tokio::task::JoinSet::new();
    let mut sent = 0u64;
    let flush = |ops: &mut Vec<TxnOp>, set: &mut tokio::task::JoinSet<Result<(), String>>| {
        let batch = std::mem::take(ops);
        let kv = Arc::clone(&kv);
        set.spawn(async move {
            let r = kv
                .txn(Txn {
                    compares: vec![],
                    success: batch,
                    failure: vec![],
                })
                .await
                .map_err(|e| e.to_string())?;
            if r.succeeded {
                Ok(())
            } else {
                Err("a transaction failed".into())
            }
        });
    };
    for d in 0..dirs {
        let ino = first_dir + d;
        ops.push(TxnOp::put(
            keys.inode(Ino(ino)),
            attr(ino, FileType::Directory, 2, 0, now).encode(),
        ));
        ops.push(TxnOp::put(
            keys.dir_parent(Ino(ino)),
            DirParent { parent: Ino::ROOT }.encode(),
        ));
        ops.push(TxnOp::put(
            keys.dentry(Ino::ROOT, format!("d{d}").as_bytes()),
            Dentry {
                ino: Ino(ino),
                kind: FileType::Directory,
            }
            .encode(),
        ));
        if ops.len() >= OPS_PER_TXN {
            flush(&mut ops, &mut set);
        }
    }
    let mut used: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for f in 0..files {
        let ino = first_file + f;
        let dir = first_dir + f / FILES_PER_DIR;
        let block = geo.data_start_block + f;
        let g = geo
            .ag_of(BlockNo(block))
            .context("block past the data area")?;
        let e = used.entry(g.0).or_insert((block, block));
        e.1 = block + 1;
        ops.push(TxnOp::put(
            keys.inode(Ino(ino)),
            attr(ino, FileType::Regular, 1, BLOCK_SIZE, now).encode(),
        ));
        ops.push(TxnOp::put(
            keys.dentry(Ino(dir), format!("f{f}").as_bytes()),
            Dentry {
                ino: Ino(ino),
                kind: FileType::Regular,
            }
            .encode(),
        ));
        let ext = Extent {
            file_off: 0,
            len: BLOCK_SIZE,
            dev_off: block * BLOCK_SIZE,
            unwritten: false,
        };
        ops.push(TxnOp::put(keys.extent(Ino(ino), 0), ext.encode_value()));
        if ops.len() >= OPS_PER_TXN {
            flush(&mut ops, &mut set);
            sent += 1;
            while set.len() >= IN_FLIGHT {
                if let Some(r) = set.join_next().await {
                    r.map_err(|e| anyhow!("{e}"))?.map_err(|e| anyhow!("{e}"))?;
                }
            }
            if sent % 1000 == 0 {
                eprint!("\rbench-populate: {f} of {files} files");
            }
        }
    }
    for (g, (s, e)) in used {
        let span = geo.ag_extent(AgId(g)).context("group")?;
        let mut m = AgFreeMap::all_free(AgId(g), span);
        m.mark_used(crate::data::Extent::new(s, e - s))
            .map_err(|e| anyhow!("{e}"))?;
        ops.push(TxnOp::put(keys.free_map(GroupId(g)), m.encode()));
    }
    root_attr.nlink = 2 + u32::try_from(dirs).unwrap_or(u32::MAX);
    ops.push(TxnOp::put(keys.inode(Ino::ROOT), root_attr.encode()));
    ops.push(TxnOp::put(
        keys.ino_counter(),
        InoCounter {
            next: first_file + files,
        }
        .encode(),
    ));
    for chunk in std::mem::take(&mut ops).chunks(OPS_PER_TXN) {
        let mut c = chunk.to_vec();
        flush(&mut c, &mut set);
    }
    while let Some(r) = set.join_next().await {
        r.map_err(|e| anyhow!("{e}"))?.map_err(|e| anyhow!("{e}"))?;
    }
    eprintln!("\rbench-populate: {files} files in {dirs} directories written");
    Ok(())
}
