//! What each counter of `etcfs stats` is, as a Prometheus metric: its family (name),
//! labels, type and help. `etcfs stats` keeps the flat names it always printed; this table
//! maps them, so that a counter added to the daemon without a line here shows up as
//! undescribed (and `tests/metrics.rs` fails) instead of silently missing.

/// Counters only grow (a reset of `etcfs stats` takes a baseline off them); gauges are
/// read as they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Counter,
    Gauge,
}

/// One `etcfs stats` counter as a member of a Prometheus family.
#[derive(Debug)]
pub(crate) struct Desc {
    /// The name `etcfs stats` prints.
    pub(crate) stat: &'static str,
    /// The family, without the `_total` a counter's samples get.
    pub(crate) family: &'static str,
    pub(crate) labels: &'static [(&'static str, &'static str)],
    pub(crate) kind: Kind,
    /// Divides the value into the family's base unit (1000: milliseconds to seconds).
    pub(crate) per_unit: u32,
    /// The family's help, on its first member only (members of a family are adjacent).
    pub(crate) help: &'static str,
}

const fn counter(
    stat: &'static str,
    family: &'static str,
    labels: &'static [(&'static str, &'static str)],
    help: &'static str,
) -> Desc {
    Desc {
        stat,
        family,
        labels,
        kind: Kind::Counter,
        per_unit: 1,
        help,
    }
}

const fn gauge(
    stat: &'static str,
    family: &'static str,
    labels: &'static [(&'static str, &'static str)],
    help: &'static str,
) -> Desc {
    Desc {
        stat,
        family,
        labels,
        kind: Kind::Gauge,
        per_unit: 1,
        help,
    }
}

const fn ms_gauge(stat: &'static str, family: &'static str, help: &'static str) -> Desc {
    Desc {
        stat,
        family,
        labels: &[],
        kind: Kind::Gauge,
        per_unit: 1000,
        help,
    }
}

/// The counters of the mutations-per-transaction histogram (`etcd_txns_with_mutations_*`,
/// one per bucket, not cumulative) with each bucket's upper bound; exported as the
/// histogram [`TXN_MUTATIONS`], whose sum is [`TXN_MUTATIONS_SUM`].
pub(crate) const TXN_MUTATION_BUCKETS: [(&str, f64); 8] = [
    ("etcd_txns_with_mutations_1", 1.0),
    ("etcd_txns_with_mutations_2-3", 3.0),
    ("etcd_txns_with_mutations_4-7", 7.0),
    ("etcd_txns_with_mutations_8-15", 15.0),
    ("etcd_txns_with_mutations_16-31", 31.0),
    ("etcd_txns_with_mutations_32-63", 63.0),
    ("etcd_txns_with_mutations_64-127", 127.0),
    ("etcd_txns_with_mutations_128+", f64::INFINITY),
];
pub(crate) const TXN_MUTATIONS: &str = "etcfs_etcd_txn_mutations";
pub(crate) const TXN_MUTATIONS_SUM: &str = "etcd_mutations_in_txns";

/// Every other counter. Families keep the order of `etcfs stats` where it groups them.
pub(crate) const DESCS: &[Desc] = &[
    // The FUSE traffic and the transport (per-op request counts are a family of their own).
    counter(
        "fuse_read_bytes",
        "etcfs_fuse_read_bytes",
        &[],
        "Data bytes in successful READ replies.",
    ),
    counter(
        "fuse_write_bytes",
        "etcfs_fuse_write_bytes",
        &[],
        "Data bytes in WRITE requests received.",
    ),
    counter(
        "ring_entries_passed",
        "etcfs_ring_entries_passed",
        &[],
        "Ring entries a busy worker passed to a less busy one (--ring-share-above).",
    ),
    counter(
        "ring_entries_returned",
        "etcfs_ring_entries_returned",
        &[],
        "Ring entries given back to their own CPU's worker once the load dropped.",
    ),
    counter(
        "ring_write_pieces_spread",
        "etcfs_ring_write_pieces_spread",
        &[],
        "Ring entries passed on so that the pieces of large writes reach different workers.",
    ),
    counter(
        "ring_linger_hits",
        "etcfs_ring_lingers",
        &[("outcome", "hit")],
        "Spins of a worker for the next request after serving another CPU's queue \
         (--ring-linger-us): hit when it came, miss when the worker slept.",
    ),
    counter(
        "ring_linger_misses",
        "etcfs_ring_lingers",
        &[("outcome", "miss")],
        "",
    ),
    counter(
        "device_wait_sleeps",
        "etcfs_worker_device_waits",
        &[("outcome", "slept")],
        "Waits of a FUSE worker with device I/O in flight (--device-spin-us): slept through \
         (backing off after spins that ran out), napped and woken early by a completion, or \
         spun for and the completion came (hit) or did not (miss).",
    ),
    counter(
        "device_wait_naps_woken",
        "etcfs_worker_device_waits",
        &[("outcome", "nap_woken")],
        "",
    ),
    counter(
        "device_wait_spin_hits",
        "etcfs_worker_device_waits",
        &[("outcome", "spin_hit")],
        "",
    ),
    counter(
        "device_wait_spin_misses",
        "etcfs_worker_device_waits",
        &[("outcome", "spin_miss")],
        "",
    ),
    counter(
        "worker_idle_sleeps",
        "etcfs_worker_idle_sleeps",
        &[],
        "Times a FUSE worker with no device I/O in flight slept until its next request.",
    ),
    // The shared device.
    counter(
        "device_read_bytes_worker",
        "etcfs_device_read_bytes",
        &[("by", "worker")],
        "Bytes read from the shared device: by the FUSE workers for READ replies, or by the \
         waiter threads.",
    ),
    counter(
        "device_read_bytes_waiter",
        "etcfs_device_read_bytes",
        &[("by", "waiter")],
        "",
    ),
    counter(
        "device_reads_worker",
        "etcfs_device_reads",
        &[("by", "worker")],
        "Reads submitted to the shared device, by the FUSE workers or the waiter threads.",
    ),
    counter(
        "device_reads_waiter",
        "etcfs_device_reads",
        &[("by", "waiter")],
        "",
    ),
    counter(
        "device_write_bytes_worker",
        "etcfs_device_write_bytes",
        &[("by", "worker")],
        "Bytes written to the shared device, by the FUSE workers (overwrites straight from \
         WRITE requests) or the waiter threads.",
    ),
    counter(
        "device_write_bytes_waiter",
        "etcfs_device_write_bytes",
        &[("by", "waiter")],
        "",
    ),
    counter(
        "device_writes_worker",
        "etcfs_device_writes",
        &[("by", "worker")],
        "Writes submitted to the shared device, by the FUSE workers or the waiter threads.",
    ),
    counter(
        "device_writes_waiter",
        "etcfs_device_writes",
        &[("by", "waiter")],
        "",
    ),
    counter(
        "device_flushes",
        "etcfs_device_flushes",
        &[],
        "Cache flushes of the shared device (fsync, commits of writes behind).",
    ),
    counter(
        "data_reads_on_core",
        "etcfs_data_requests",
        &[("op", "read"), ("on", "core")],
        "READs and WRITEs by where they were served: on the worker's core (no etcd) or on a \
         waiter thread.",
    ),
    counter(
        "data_reads_on_waiter",
        "etcfs_data_requests",
        &[("op", "read"), ("on", "waiter")],
        "",
    ),
    counter(
        "data_writes_on_core",
        "etcfs_data_requests",
        &[("op", "write"), ("on", "core")],
        "",
    ),
    counter(
        "data_writes_on_waiter",
        "etcfs_data_requests",
        &[("op", "write"), ("on", "waiter")],
        "",
    ),
    counter(
        "frees_unlogged",
        "etcfs_frees_unlogged",
        &[],
        "Freed device ranges the freeing commit could not log (a crash before their free-map \
         write leaks them until fsck).",
    ),
    counter(
        "rmw_blocks_kept",
        "etcfs_rmw_blocks_kept",
        &[],
        "Partial-block writes that merged into this node's copy of the block they last \
         wrote instead of reading it back from the device.",
    ),
    counter(
        "writes_held",
        "etcfs_writes_held",
        &[],
        "Small buffered writes (overwrites, and appends whose allocation is pending) answered \
         before reaching the device, their blocks held \
         until written out (fsync, close, about a second, a READ, the lock's hand-over).",
    ),
    counter(
        "held_blocks_written",
        "etcfs_held_blocks_written",
        &[],
        "Held blocks written out to the device.",
    ),
    counter(
        "held_block_runs_written",
        "etcfs_held_block_runs_written",
        &[],
        "Device writes the held blocks took (adjacent blocks go as one).",
    ),
    counter(
        "held_blocks_lost",
        "etcfs_held_blocks_lost",
        &[],
        "Held blocks that never reached the device: a failed write-out, or this node's \
         session ended first.",
    ),
    counter(
        "mtime_commits_relocked",
        "etcfs_mtime_commits_relocked",
        &[],
        "Overwrite mtimes committed again under the file's lock because the inode changed \
         during their commit without it.",
    ),
    // etcd.
    counter(
        "etcd_txns_committed",
        "etcfs_etcd_commit_txns",
        &[],
        "Commit transactions etcd applied.",
    ),
    counter(
        "etcd_read_txns",
        "etcfs_etcd_read_txns",
        &[],
        "Batched read transactions sent to etcd.",
    ),
    counter(
        "etcd_mutations_committed",
        "etcfs_etcd_mutations_committed",
        &[],
        "Metadata mutations committed.",
    ),
    counter(
        "etcd_mutations_failed",
        "etcfs_etcd_mutations_failed",
        &[],
        "Metadata mutations that completed with an error.",
    ),
    gauge(
        "etcd_mutations_per_txn_max",
        "etcfs_etcd_txn_mutations_max",
        &[],
        "Most mutations in one committed transaction since mount.",
    ),
    counter(
        "etcd_compare_failures",
        "etcfs_etcd_compare_failures",
        &[],
        "Commit transactions whose compares failed (another writer got there first).",
    ),
    counter(
        "etcd_retries",
        "etcfs_etcd_retries",
        &[],
        "Mutations resent or planned again after a compare failure.",
    ),
    counter(
        "etcd_txn_errors",
        "etcfs_etcd_txn_errors",
        &[],
        "Transactions that failed with an etcd or network error.",
    ),
    counter(
        "etcd_txns_unanswered",
        "etcfs_etcd_unanswered_txns",
        &[],
        "Commit transactions whose answer was lost, decided through their commit marker.",
    ),
    counter(
        "etcd_unanswered_applied",
        "etcfs_etcd_unanswered_decided",
        &[("outcome", "applied")],
        "Unanswered commits by what their marker said: applied, or given up and resent.",
    ),
    counter(
        "etcd_unanswered_resent",
        "etcfs_etcd_unanswered_decided",
        &[("outcome", "resent")],
        "",
    ),
    counter(
        "etcd_read_retries",
        "etcfs_etcd_read_retries",
        &[],
        "Reads retried after etcd did not answer.",
    ),
    counter(
        "etcd_write_retries",
        "etcfs_etcd_write_retries",
        &[],
        "Idempotent writes outside commits (cache and fcntl locks, group claims, session \
         and lease calls) sent again after etcd did not answer.",
    ),
    counter(
        "free_map_writes_failed",
        "etcfs_free_map_writes_failed",
        &[],
        "Free-map writes that deleted released records and failed (the node fences itself).",
    ),
    gauge(
        "pipeline_pending",
        "etcfs_etcd_pipeline_mutations",
        &[],
        "Mutations inside the metadata pipeline now.",
    ),
    gauge(
        "etcd_txns_in_flight",
        "etcfs_etcd_txns_in_flight",
        &[],
        "Commit transactions sent to etcd and not answered yet.",
    ),
    counter(
        "waiter_queue_refused",
        "etcfs_waiter_queue_refused",
        &[],
        "Requests answered EAGAIN because the waiter threads' queue was full.",
    ),
    counter(
        "dir_times_coalesced",
        "etcfs_dir_time_updates",
        &[("outcome", "coalesced")],
        "Directory timestamp updates: absorbed by coalescing, or written.",
    ),
    counter(
        "dir_times_written",
        "etcfs_dir_time_updates",
        &[("outcome", "written")],
        "",
    ),
    counter(
        "inode_blocks_reserved",
        "etcfs_inode_number_blocks_reserved",
        &[],
        "Blocks of inode numbers reserved in etcd.",
    ),
    // The daemon's caches.
    counter(
        "cache_attr_hits",
        "etcfs_cache_hits",
        &[("cache", "attr")],
        "Lookups answered from a cache, by cache: attributes, names, absent names, whole \
         directory name sets.",
    ),
    counter(
        "cache_dentry_hits",
        "etcfs_cache_hits",
        &[("cache", "dentry")],
        "",
    ),
    counter(
        "cache_negative_hits",
        "etcfs_cache_hits",
        &[("cache", "negative")],
        "",
    ),
    counter(
        "cache_dir_names_hits",
        "etcfs_cache_hits",
        &[("cache", "dir_names")],
        "",
    ),
    counter(
        "cache_maps_kept_at_close",
        "etcfs_cache_maps_kept_at_close",
        &[],
        "Opens that took the extent map kept at the file's last close on this node (same lock grant) instead of reading etcd.",
    ),
    counter(
        "cache_attr_misses",
        "etcfs_cache_misses",
        &[("cache", "attr")],
        "Lookups a cache could not answer, by cache (see etcfs_cache_hits_total).",
    ),
    counter(
        "cache_dentry_misses",
        "etcfs_cache_misses",
        &[("cache", "dentry")],
        "",
    ),
    counter(
        "cache_negative_misses",
        "etcfs_cache_misses",
        &[("cache", "negative")],
        "",
    ),
    counter(
        "cache_dir_names_misses",
        "etcfs_cache_misses",
        &[("cache", "dir_names")],
        "",
    ),
    counter(
        "cache_dir_names_loads",
        "etcfs_cache_dir_names_loads",
        &[],
        "Whole directory name sets read from etcd.",
    ),
    counter(
        "cache_dir_names_over_limit",
        "etcfs_cache_dir_names_over_limit",
        &[],
        "Directories found larger than --dir-names-max (looked up name by name).",
    ),
    gauge(
        "cache_inodes",
        "etcfs_cache_entries",
        &[("cache", "inode")],
        "Entries in each cache now (dir_names: names held).",
    ),
    gauge(
        "cache_dentries",
        "etcfs_cache_entries",
        &[("cache", "dentry")],
        "",
    ),
    gauge(
        "cache_dir_names",
        "etcfs_cache_entries",
        &[("cache", "dir_names")],
        "",
    ),
    counter(
        "cache_inode_evictions",
        "etcfs_cache_evictions",
        &[("cache", "inode")],
        "Entries evicted from each cache to stay within its bound.",
    ),
    counter(
        "cache_dentry_evictions",
        "etcfs_cache_evictions",
        &[("cache", "dentry")],
        "",
    ),
    counter(
        "cache_dir_names_evictions",
        "etcfs_cache_evictions",
        &[("cache", "dir_names")],
        "",
    ),
    counter(
        "lookups_etcd",
        "etcfs_lookups_etcd",
        &[],
        "Lookups that read etcd.",
    ),
    // The watch and what it tells the kernel.
    counter(
        "watch_events_applied",
        "etcfs_watch_events_applied",
        &[],
        "Watch events applied to the caches.",
    ),
    counter(
        "watch_events_own",
        "etcfs_watch_events_own",
        &[],
        "Watch events of this node's own commits.",
    ),
    counter(
        "watch_revisions_own",
        "etcfs_watch_revisions_own",
        &[],
        "Watch revisions recognised as this node's own commits.",
    ),
    counter(
        "kernel_skipped_own",
        "etcfs_kernel_notifications_skipped_own",
        &[],
        "Kernel notifications not sent because the change was this node's own.",
    ),
    counter(
        "watch_restarts",
        "etcfs_watch_restarts",
        &[],
        "Times the etcd watch was started again.",
    ),
    counter(
        "watch_resyncs",
        "etcfs_watch_resyncs",
        &[],
        "Times the caches were dropped because the watch lost events (compaction).",
    ),
    gauge(
        "watch_revision",
        "etcfs_watch_revision",
        &[],
        "The etcd revision the caches have applied.",
    ),
    gauge(
        "watch_live",
        "etcfs_watch_live",
        &[],
        "1 while the etcd watch is running and caught up, else 0.",
    ),
    counter(
        "kernel_inval_entry",
        "etcfs_kernel_notifications",
        &[("kind", "inval_entry")],
        "Notifications sent to the kernel for other nodes' changes, by kind.",
    ),
    counter(
        "kernel_delete",
        "etcfs_kernel_notifications",
        &[("kind", "delete")],
        "",
    ),
    counter(
        "kernel_inval_inode",
        "etcfs_kernel_notifications",
        &[("kind", "inval_inode")],
        "",
    ),
    counter(
        "kernel_inval_data",
        "etcfs_kernel_notifications",
        &[("kind", "inval_data")],
        "",
    ),
    counter(
        "kernel_epochs",
        "etcfs_kernel_notifications",
        &[("kind", "inc_epoch")],
        "",
    ),
    // Locks.
    counter(
        "cache_locks_taken",
        "etcfs_cache_lock_acquisitions",
        &[],
        "Cluster cache locks of regular files granted to this node.",
    ),
    counter(
        "cache_lock_waits",
        "etcfs_cache_lock_waits",
        &[],
        "Cluster cache lock requests that found another node holding the lock and waited.",
    ),
    counter(
        "cache_locks_released",
        "etcfs_cache_lock_releases",
        &[],
        "Cluster cache locks this node gave up.",
    ),
    counter(
        "cache_locks_strays",
        "etcfs_cache_lock_strays",
        &[],
        "Cluster cache locks of this node found in etcd although it did not hold them (a \
         grant applied after its request was given up) and deleted.",
    ),
    counter(
        "cache_locks_downgraded",
        "etcfs_cache_lock_downgrades",
        &[],
        "Cluster cache locks this node downgraded from exclusive to shared.",
    ),
    counter(
        "cache_locks_upgraded_in_release",
        "etcfs_cache_lock_release_upgrades",
        &[],
        "Shared cluster cache locks upgraded to exclusive by a write that arrived while this \
         node was giving them up (the release's page invalidation waited for its pages).",
    ),
    counter(
        "cache_lock_writes_interrupted",
        "etcfs_cache_lock_writes_interrupted",
        &[],
        "Writes answered EINTR (nothing written) because this node and another each gave up \
         a shared lock with a write of their own waiting on the other.",
    ),
    counter(
        "listing_grants_ahead",
        "etcfs_listing_grants_ahead",
        &[],
        "Grants of a listing's next files' shared locks run in the background, while the \
         kernel consumed the entries before them.",
    ),
    counter(
        "listing_grant_waits",
        "etcfs_listing_grant_waits",
        &[],
        "READDIRPLUS calls that waited for a background grant of their entries' locks.",
    ),
    gauge(
        "cache_locks_known",
        "etcfs_cache_locks",
        &[],
        "Files whose cluster cache lock this node tracks now.",
    ),
    counter(
        "plocks_granted",
        "etcfs_file_locks_granted",
        &[],
        "fcntl and flock locks granted.",
    ),
    counter(
        "plocks_waited",
        "etcfs_file_lock_waits",
        &[],
        "Blocking fcntl and flock lock requests that waited for another holder.",
    ),
    counter(
        "plocks_refused",
        "etcfs_file_locks_refused",
        &[],
        "Non-blocking fcntl and flock lock requests refused (EAGAIN) for another holder.",
    ),
    counter(
        "plocks_delegations_taken",
        "etcfs_file_lock_delegations_taken",
        &[],
        "Files whose fcntl and flock locks this node took delegated: no other node had \
         any, so this node's locks of them are taken and dropped without etcd.",
    ),
    counter(
        "plocks_delegations_returned",
        "etcfs_file_lock_delegations_returned",
        &[],
        "Delegations given back, their locks written to etcd: another node asked, the \
         file was closed here, or it held too many locks.",
    ),
    // The session.
    counter(
        "session_fences",
        "etcfs_session_fences",
        &[],
        "Times this node's session was fenced (its lease could have ended) since mount.",
    ),
    gauge(
        "session_fenced_now",
        "etcfs_session_fenced",
        &[],
        "1 while this node is fenced (no device I/O until it has a new session), else 0.",
    ),
    ms_gauge(
        "session_fence_left_ms",
        "etcfs_session_fence_left_seconds",
        "Time before this node stops its device I/O unless the lease is renewed.",
    ),
    ms_gauge(
        "session_lease_left_ms",
        "etcfs_session_lease_left_seconds",
        "Time before this node's etcd lease can expire unless renewed, as this node \
         reckons it (0 once fenced).",
    ),
    counter(
        "own_revisions_forgotten",
        "etcfs_own_revisions_forgotten",
        &[],
        "Own commit revisions dropped from their bounded table before the watch saw them \
         (their events are then taken as another node's).",
    ),
    counter(
        "own_revisions_waited_out",
        "etcfs_own_revisions_waited_out",
        &[],
        "Watch events whose origin (this node or another) was not known in time and taken \
         as another node's.",
    ),
];

/// Whether `etcfs stats` counter `stat` only grows. Unknown names are taken as gauges, so
/// a reset never makes nonsense of them.
pub(crate) fn is_counter(stat: &str) -> bool {
    stat == TXN_MUTATIONS_SUM
        || TXN_MUTATION_BUCKETS.iter().any(|(s, _)| *s == stat)
        || DESCS
            .iter()
            .any(|d| d.stat == stat && d.kind == Kind::Counter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_adjacent_and_agree() {
        let mut seen = std::collections::HashSet::new();
        let mut stats = std::collections::HashSet::new();
        for (i, d) in DESCS.iter().enumerate() {
            assert!(stats.insert(d.stat), "{} described twice", d.stat);
            assert!(d.family.starts_with("etcfs_"), "{}", d.family);
            assert!(
                !d.family.ends_with("_total"),
                "{}: the encoder adds _total",
                d.family
            );
            let first = i == 0 || DESCS[i - 1].family != d.family;
            if first {
                assert!(seen.insert(d.family), "{} is split", d.family);
                assert!(!d.help.is_empty(), "{} has no help", d.family);
            } else {
                let prev = &DESCS[i - 1];
                assert_eq!(prev.kind, d.kind, "{}", d.family);
                assert!(d.help.is_empty(), "{}: help on the first member", d.family);
                let keys = |l: &'static [(&'static str, &'static str)]| {
                    l.iter().map(|(k, _)| *k).collect::<Vec<_>>()
                };
                assert_eq!(keys(prev.labels), keys(d.labels), "{}", d.family);
                assert_ne!(prev.labels, d.labels, "{}", d.family);
            }
        }
    }

    #[test]
    fn counters_and_gauges_are_told_apart() {
        assert!(is_counter("etcd_txns_committed"));
        assert!(is_counter("etcd_txns_with_mutations_128+"));
        assert!(is_counter("etcd_mutations_in_txns"));
        assert!(!is_counter("pipeline_pending"));
        assert!(!is_counter("session_lease_left_ms"));
        assert!(!is_counter("something_new"));
    }
}
