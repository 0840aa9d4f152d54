//! Error types. Small enums, one variant per thing a caller branches on.
//!
//! [`KvError`] is the backend's (transport/etcd) error; [`MetaError`] is what a
//! mutation or read reports to the filesystem, which maps each variant to one errno.

use thiserror::Error;

/// An error from a [`crate::kv::KvBackend`] call.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum KvError {
    /// etcd could not be reached or did not answer within the request timeout.
    #[error("etcd unavailable: {0}")]
    Unavailable(String),
    /// The requested revision has been compacted away.
    #[error("revision compacted (oldest kept: {compact_revision})")]
    Compacted {
        /// The oldest revision still available.
        compact_revision: i64,
    },
    /// The transaction has more operations than etcd's `--max-txn-ops`.
    #[error("too many operations in txn request")]
    TooManyOps,
    /// The request exceeds etcd's `--max-request-bytes`.
    #[error("request too large")]
    RequestTooLarge,
    /// A malformed request (e.g. a key put twice in one transaction).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The lease does not exist (expired or revoked).
    #[error("lease not found")]
    LeaseNotFound,
    /// etcd's database reached its space quota (`--quota-backend-bytes`): it raised the
    /// NOSPACE alarm and refuses every write until compaction, defragmentation and
    /// `etcdctl alarm disarm`. Refused before applying.
    #[error("etcd database space exceeded (quota alarm): {0}")]
    NoSpace(String),
    /// etcd refused the credentials or the request: a wrong user or password, no user
    /// given to an etcd with authentication on, or a role without permission. Retrying
    /// does not help, so it is not [`KvError::Unavailable`].
    #[error("etcd refused access: {0}")]
    Auth(String),
    /// Anything else etcd reported.
    #[error("etcd error: {0}")]
    Other(String),
}

impl KvError {
    /// Whether a write transaction that failed with this error certainly did not apply
    /// (etcd refused it before proposing it). For any other error the outcome is unknown.
    pub fn write_refused(&self) -> bool {
        matches!(
            self,
            KvError::TooManyOps
                | KvError::RequestTooLarge
                | KvError::Invalid(_)
                | KvError::LeaseNotFound
                | KvError::NoSpace(_)
                | KvError::Auth(_)
        )
    }
}

/// The result of a metadata operation as the filesystem sees it.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum MetaError {
    /// A name, inode or xattr the operation needs does not exist.
    #[error("not found")]
    NotFound,
    /// The name (or xattr with CREATE) already exists.
    #[error("already exists")]
    Exists,
    /// A directory that must be empty is not.
    #[error("directory not empty")]
    NotEmpty,
    /// A directory was required.
    #[error("not a directory")]
    NotDir,
    /// A non-directory was required.
    #[error("is a directory")]
    IsDir,
    /// The request is malformed or not allowed (moving a directory into its own
    /// subtree, linking a directory, an invalid name, ...).
    #[error("invalid request: {0}")]
    Invalid(&'static str),
    /// The mutation does not fit in one etcd transaction and cannot be split without
    /// losing atomicity.
    #[error("mutation too large for one transaction")]
    TooBig,
    /// A read limit was exceeded (e.g. a directory's name set above the cap).
    #[error("result larger than the limit of {limit}")]
    OverLimit {
        /// The limit that was exceeded.
        limit: usize,
    },
    /// Still conflicting after the retry budget was spent.
    #[error("conflict after {attempts} attempts")]
    Conflict {
        /// How many times the mutation was planned and sent.
        attempts: u32,
    },
    /// A stored value failed to decode or validate. The key is rendered for logging.
    #[error("corrupt value at key {key}: {reason}")]
    Corrupt {
        /// Human-readable key (see [`crate::keys::Keyspace::describe`]).
        key: String,
        /// What was wrong.
        reason: String,
    },
    /// etcd is unreachable or timed out; nothing is known about whether it applied.
    #[error("metadata store unavailable: {0}")]
    Unavailable(String),
    /// etcd's space quota is reached: no metadata can be written until an operator
    /// compacts and defragments etcd and disarms the alarm (ENOSPC, logged as such).
    #[error("etcd quota reached: {0}")]
    EtcdFull(String),
    /// etcd refused this client's credentials or the request ([`KvError::Auth`]).
    #[error("etcd refused access: {0}")]
    Denied(String),
    /// The session the work was begun under has lost its lease (or the node gave it up
    /// at its fence): nothing of it may commit. The node serves again under a new one.
    #[error("this node's session has ended")]
    SessionLost,
    /// A write of this group's free map failed after deleting released records was
    /// part of it: the node's map of the group may hold blocks etcd still records as
    /// released, so no later write of the map may commit under this session (the node
    /// fences itself and loads the group again under a new one).
    #[error("free map of group {group} is out of step with etcd after a failed write")]
    UnsafeFreeMap {
        /// The group.
        group: u32,
    },
    /// The inode changed after the revision a conditional change was computed at
    /// ([`crate::pipeline::mutation::SetAttr::unchanged_since`]): nothing was written.
    #[error("changed since the revision the change was computed at")]
    Changed,
    /// The pipeline has shut down.
    #[error("pipeline closed")]
    Closed,
    /// The submission queue is full (only from non-blocking submission).
    #[error("pipeline queue full")]
    QueueFull,
    /// The pipeline is read-only ([`crate::pipeline::Config::read_only`]) and the mutation
    /// would change the filesystem.
    #[error("read-only mount")]
    ReadOnly,
}

impl From<KvError> for MetaError {
    fn from(e: KvError) -> Self {
        match e {
            KvError::Unavailable(s) => MetaError::Unavailable(s),
            KvError::TooManyOps | KvError::RequestTooLarge => MetaError::TooBig,
            KvError::NoSpace(s) => MetaError::EtcdFull(s),
            KvError::Auth(s) => MetaError::Denied(s),
            other => MetaError::Unavailable(other.to_string()),
        }
    }
}
