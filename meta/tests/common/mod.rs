//! Set-up shared by the meta crate's integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use meta::{
    clock::{Clock, ManualClock},
    codec::SuperRecord,
    format::{format, RootOwner},
    keys::Keyspace,
    kv::KvBackend,
    model::MemEtcd,
    pipeline::{Config, Pipeline},
    types::{SessionId, Timespec},
};

/// The model clock's start, and every test filesystem's creation time.
pub(crate) const T0: Timespec = Timespec::new(1_700_000_000, 0);

/// A 1 GiB device in 16 groups of 64 MiB.
pub(crate) fn superblock() -> SuperRecord {
    SuperRecord {
        uuid: [1; 16],
        format_version: 1,
        block_size: 4096,
        group_size: 1 << 26,
        group_count: 16,
        device_size: 1 << 30,
        created: T0,
    }
}

/// The owner of a test filesystem's root directory.
pub(crate) const ROOT: RootOwner = RootOwner {
    uid: 0,
    gid: 0,
    perm: 0o755,
};

/// Formats [`superblock`]'s filesystem in `etcd` under `keys`.
pub(crate) async fn format_model(etcd: &MemEtcd, keys: &Keyspace) {
    format(etcd, keys, &superblock(), ROOT, T0, false)
        .await
        .unwrap();
}

/// A pipeline of session `session` on the model `kv`.
pub(crate) fn start(
    kv: Arc<MemEtcd>,
    keys: &Keyspace,
    session: u64,
    clock: Arc<ManualClock>,
    cfg: Config,
) -> Pipeline {
    let connect: meta::pipeline::Connect =
        Box::new(move || Box::pin(async move { Ok(kv as Arc<dyn KvBackend>) }));
    Pipeline::start(
        connect,
        keys.clone(),
        SessionId(session),
        clock as Arc<dyn Clock>,
        cfg,
    )
    .unwrap()
}
