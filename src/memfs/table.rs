//! The inode table: 16 shards of `ino -> Inode`, each behind its own mutex, and the rule
//! for holding several at once.
//!
//! Lock order: a thread that holds more than one shard took them in ascending shard index
//! ([`Table::lock_many`]); a thread that holds one shard never waits for another. Renames
//! additionally serialize on `MemFs::rename_lock`, taken before any shard.

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard, PoisonError},
};

use super::inode::Inode;

/// Number of shards; inode `ino` lives in shard `ino % SHARDS`.
const SHARDS: usize = 16;

type Shard = HashMap<u64, Inode>;

pub(super) struct Table {
    shards: [Mutex<Shard>; SHARDS],
}

fn shard_of(ino: u64) -> usize {
    (ino % SHARDS as u64) as usize
}

impl Table {
    pub(super) fn new() -> Table {
        Table {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
        }
    }

    fn lock_shard(&self, index: usize) -> MutexGuard<'_, Shard> {
        // A panic while holding a shard leaves plain data behind, never a broken invariant
        // that later code relies on for memory safety; keep serving.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The shard holding `ino`, locked.
    pub(super) fn lock(&self, ino: u64) -> MutexGuard<'_, Shard> {
        self.lock_shard(shard_of(ino))
    }

    /// The shards holding all of `inos`, locked in ascending order.
    pub(super) fn lock_many(&self, inos: &[u64]) -> Locked<'_> {
        let mut indexes: Vec<usize> = inos.iter().map(|&ino| shard_of(ino)).collect();
        indexes.sort_unstable();
        indexes.dedup();
        Locked {
            guards: indexes
                .into_iter()
                .map(|i| (i, self.lock_shard(i)))
                .collect(),
        }
    }

    /// Number of inodes (locks each shard in turn).
    pub(super) fn len(&self) -> usize {
        (0..SHARDS).map(|i| self.lock_shard(i).len()).sum()
    }
}

/// Several shards held at once. Looking up an inode whose shard is not held is a bug and
/// reads as "no such inode".
pub(super) struct Locked<'a> {
    guards: Vec<(usize, MutexGuard<'a, Shard>)>,
}

impl Locked<'_> {
    fn shard(&self, ino: u64) -> Option<&Shard> {
        let index = shard_of(ino);
        self.guards
            .iter()
            .find(|(i, _)| *i == index)
            .map(|(_, g)| &**g)
    }

    fn shard_mut(&mut self, ino: u64) -> Option<&mut Shard> {
        let index = shard_of(ino);
        self.guards
            .iter_mut()
            .find(|(i, _)| *i == index)
            .map(|(_, g)| &mut **g)
    }

    pub(super) fn get(&self, ino: u64) -> Option<&Inode> {
        self.shard(ino)?.get(&ino)
    }

    pub(super) fn get_mut(&mut self, ino: u64) -> Option<&mut Inode> {
        self.shard_mut(ino)?.get_mut(&ino)
    }

    /// Inserts `inode` (its shard must be held).
    pub(super) fn insert(&mut self, ino: u64, inode: Inode) -> bool {
        match self.shard_mut(ino) {
            Some(shard) => {
                shard.insert(ino, inode);
                true
            }
            None => false,
        }
    }

    pub(super) fn remove(&mut self, ino: u64) -> Option<Inode> {
        self.shard_mut(ino)?.remove(&ino)
    }
}
