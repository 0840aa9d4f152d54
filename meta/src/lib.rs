//! etcfs-meta: the etcd layer of etcfs. It holds all metadata (superblock record,
//! inodes, directory entries, symlinks, xattrs, extent maps, the inode-number counter,
//! node membership, allocation-group ownership, orphans) and knows nothing about FUSE,
//! errno or io_uring.
//!
//! # Layers
//!
//! * [`keys`]: the key schema (one table) and [`codec`]: versioned binary values whose
//!   decoder never panics; a bad value is [`error::MetaError::Corrupt`] naming the key.
//! * [`kv::KvBackend`]: the etcd subset we use (range, txn, lease, watch), implemented
//!   by [`etcd::EtcdBackend`] and by the in-memory model [`model::MemEtcd`]; both pass
//!   [`conformance::run`].
//! * [`pipeline`]: the only way to change metadata. [`reader`]: reads.
//! * [`session`]: the node's lease, membership, group ownership, dead nodes' orphans.
//!
//! # What a mutation is
//!
//! A [`pipeline::Mutation`] is one filesystem-level change (create, link, unlink,
//! rename, setattr, xattr, extent-map update, orphan reclaim, ...). It is **atomic on
//! its own**: all of its keys change in one etcd transaction or none do. A rename is
//! never split, whatever else is in flight.
//!
//! Handlers never call etcd. They [`pipeline::MetaClient::submit`] a mutation and get a
//! [`pipeline::Ticket`], which they can block on, poll, `.await`, or give a wake callback
//! (the daemon writes a core's eventfd from it). Submission is non-blocking and bounded
//! (`QueueFull` is back-pressure); `submit_blocking` waits for room instead.
//!
//! # How grouping and retry keep each mutation atomic
//!
//! The pipeline thread turns a mutation into compares and writes with the pure function
//! [`pipeline::plan()`], from a snapshot of what the mutation read (reads are batched
//! across mutations; a plain create needs none). Every value a plan depends on is
//! guarded by a compare, so a stale plan cannot commit: it fails its compares.
//!
//! Plans whose keys are independent (no key written by one and read or written by
//! another, except that an existence check tolerates a rewrite of an existing key) are
//! packed into one etcd transaction, up to `batch_ops_max` (128) ops and
//! `txn_bytes_max` (1.5 MiB), with several transactions in flight. Mutations that touch
//! keys of a transaction in flight wait for it, in submission order.
//!
//! A transaction's failure branch reads every compared key. When a grouped transaction
//! fails, the pipeline evaluates each mutation's compares against those fresh values:
//! the mutations whose compares failed are re-planned from the fresh values (no extra
//! read), and the others are resent unchanged in the next transaction. A mutation is
//! retried at most `retries_max` times, then fails with `Conflict`. A transaction that
//! fails with a transport error is reported as `Unavailable`, never resent, because it
//! may have been applied.
//!
//! Inode numbers come from a counter key reserved 1024 at a time by compare-and-swap;
//! numbers are never reused. Directory mtime/ctime changes caused by create/unlink/link/
//! rename (and inode ctime from xattr changes) are coalesced: written at most once per
//! `flush_interval_ms` per directory, or at once by a [`pipeline::MetaClient::flush`]
//! barrier (fsync on a directory, syncfs, unmount). Changes to a parent's link count
//! (mkdir, rmdir, directory renames) are written in the mutation's own transaction.
//!
//! # The consistency the filesystem can rely on
//!
//! * A completed ticket's mutation is durable in etcd (etcd commits are replicated and
//!   fsync'd) and carries the etcd revision it committed at; mutations are linearizable
//!   in revision order, cluster-wide.
//! * Any read started after a ticket completed observes that mutation (etcd reads are
//!   linearizable). Reads do not wait for mutations still in the pipeline.
//! * Mutations that conflict are applied in submission order within one node.
//! * Directory timestamps may lag by up to `flush_interval_ms` unless flushed; they never
//!   move backwards. Everything else is exact.
//! * An error other than `Unavailable` means nothing was changed.
//! * A corrupt stored value fails only the operation that read it, naming the key.
#![forbid(unsafe_code)]

pub mod acl;
pub mod cachelock;
pub mod clock;
pub mod codec;
pub mod conformance;
pub mod error;
pub mod etcd;
pub mod fence;
pub mod format;
pub mod keys;
pub mod kv;
pub mod lossy;
pub mod model;
pub mod patient;
pub mod pipeline;
pub mod reader;
pub mod session;
pub mod types;
