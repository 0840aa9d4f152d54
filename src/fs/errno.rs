//! The one table from lower-layer errors to the errno a FUSE request is answered with.
//!
//! Every row is here, with a test per row, so an error's errno is decided in exactly one
//! place. Context-specific meanings (a missing xattr is ENODATA, not ENOENT) are applied
//! by the caller on top of this table, and say so where they do.

use std::sync::atomic::{AtomicU64, Ordering};

use fusedev::errno::Errno;
use meta::error::MetaError;

use crate::data::{alloc::AllocError, device::DevError, plan::PlanError};

/// The errno for a metadata error. Corrupt values are logged here, naming the key, so no
/// caller can forget to.
pub(crate) fn meta(e: &MetaError) -> Errno {
    match e {
        MetaError::NotFound => Errno::ENOENT,
        MetaError::Exists => Errno::EEXIST,
        MetaError::NotEmpty => Errno::ENOTEMPTY,
        MetaError::NotDir => Errno::ENOTDIR,
        MetaError::IsDir => Errno::EISDIR,
        // Moving a directory into its own subtree, linking a directory, a bad name.
        MetaError::Invalid(_) => Errno::EINVAL,
        // One mutation that cannot fit an etcd transaction: "argument list too long" is
        // what Linux reports for oversized xattrs, the common case.
        MetaError::TooBig => Errno::E2BIG,
        MetaError::OverLimit { .. } => Errno::E2BIG,
        // Still conflicting after the retry budget: the caller may try again.
        MetaError::Conflict { attempts } => {
            log::warn!("mutation still conflicting after {attempts} attempts");
            Errno::EAGAIN
        }
        MetaError::Corrupt { key, reason } => {
            log::error!("corrupt metadata at key {key}: {reason}");
            Errno::EIO
        }
        MetaError::Unavailable(why) => {
            log::warn!("etcd unavailable: {why}");
            Errno::EIO
        }
        // A full etcd is a full filesystem to the application, but the operator must know
        // which of the two stores is full: the device's ENOSPC is not logged.
        MetaError::EtcdFull(why) => {
            if log_now(&ETCD_FULL_LOGGED) {
                log::error!(
                    "metadata store full: etcd raised its space-quota alarm ({why}); every \
                     change answers ENOSPC until an operator compacts and defragments etcd \
                     and runs `etcdctl alarm disarm` (README, \"Running etcd\")"
                );
            }
            Errno::ENOSPC
        }
        // The daemon's etcd user lost its password or role under it: an operator's
        // error, not the caller's, so not EACCES.
        MetaError::Denied(why) => {
            log::error!("etcd refused access: {why}");
            Errno::EIO
        }
        MetaError::Closed => Errno::EIO,
        // Its callers retry under the file's lock; one that did not would have lost a race.
        MetaError::Changed => Errno::EAGAIN,
        // Begun under a session whose lease may have ended: it must not count.
        MetaError::SessionLost => Errno::EIO,
        // The node fences itself over it (`Inner::watch_fence`).
        MetaError::UnsafeFreeMap { .. } => Errno::EIO,
        // Only non-blocking submission reports it; handlers use blocking submission.
        MetaError::QueueFull => Errno::EAGAIN,
        MetaError::ReadOnly => Errno::EROFS,
    }
}

static ETCD_FULL_LOGGED: AtomicU64 = AtomicU64::new(0);

/// True at most once per minute per `last` (a condition that fails every request would
/// otherwise log once per request).
fn log_now(last: &AtomicU64) -> bool {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let prev = last.load(Ordering::Relaxed);
    now >= prev + 60
        && last
            .compare_exchange(prev, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// The errno for a device error (the device layer's own table), logged.
pub(crate) fn dev(e: &DevError) -> Errno {
    let raw = e.errno();
    if raw != libc::ENOSPC {
        log::error!("{e}");
    }
    Errno::from_raw(raw).unwrap_or(Errno::EIO)
}

/// The errno for an allocator error: ENOSPC when full; anything else is a broken free
/// map or extent map, logged.
pub(crate) fn alloc(e: &AllocError) -> Errno {
    let raw = e.errno();
    if raw != libc::ENOSPC {
        log::error!("allocator: {e}");
    }
    Errno::from_raw(raw).unwrap_or(Errno::EIO)
}

/// A malformed extent map read from etcd.
pub(crate) fn plan(e: &PlanError) -> Errno {
    log::error!("corrupt extent map: {e}");
    Errno::EIO
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{AgId, Extent};

    #[test]
    fn meta_rows() {
        let rows: &[(MetaError, Errno)] = &[
            (MetaError::NotFound, Errno::ENOENT),
            (MetaError::Exists, Errno::EEXIST),
            (MetaError::NotEmpty, Errno::ENOTEMPTY),
            (MetaError::NotDir, Errno::ENOTDIR),
            (MetaError::IsDir, Errno::EISDIR),
            (MetaError::Invalid("x"), Errno::EINVAL),
            (MetaError::TooBig, Errno::E2BIG),
            (MetaError::OverLimit { limit: 1 }, Errno::E2BIG),
            (MetaError::Conflict { attempts: 3 }, Errno::EAGAIN),
            (
                MetaError::Corrupt {
                    key: "etcfs/I 5".into(),
                    reason: "short".into(),
                },
                Errno::EIO,
            ),
            (MetaError::Unavailable("down".into()), Errno::EIO),
            (MetaError::Denied("no role".into()), Errno::EIO),
            (MetaError::Closed, Errno::EIO),
            (MetaError::Changed, Errno::EAGAIN),
            (MetaError::EtcdFull("quota".into()), Errno::ENOSPC),
            (MetaError::QueueFull, Errno::EAGAIN),
            (MetaError::ReadOnly, Errno::EROFS),
        ];
        for (e, want) in rows {
            assert_eq!(meta(e), *want, "{e:?}");
        }
    }

    #[test]
    fn dev_rows() {
        assert_eq!(dev(&DevError::NoSpace { off: 0, len: 1 }), Errno::ENOSPC);
        assert_eq!(dev(&DevError::Misaligned { off: 1, len: 1 }), Errno::EINVAL);
        assert_eq!(
            dev(&DevError::Injected {
                op: "write",
                off: 0
            }),
            Errno::EIO
        );
        assert_eq!(
            dev(&DevError::Short {
                op: "read",
                off: 0,
                len: 2,
                done: 1
            }),
            Errno::EIO
        );
    }

    #[test]
    fn alloc_rows() {
        assert_eq!(
            alloc(&AllocError::NoSpace { wanted: 2, free: 1 }),
            Errno::ENOSPC
        );
        assert_eq!(alloc(&AllocError::NotLoaded(AgId(1))), Errno::EIO);
        assert_eq!(
            alloc(&AllocError::DoubleFree {
                extent: Extent::new(300, 1),
                overlaps: Extent::new(300, 2)
            }),
            Errno::EIO
        );
        assert_eq!(alloc(&AllocError::Decode("bad".into())), Errno::EIO);
    }

    #[test]
    fn plan_row() {
        let e = crate::data::plan::FileExtent {
            file_off: 1,
            len: 0,
            dev_off: 0,
            unwritten: false,
        };
        assert_eq!(plan(&PlanError::BadExtent(e)), Errno::EIO);
    }
}
