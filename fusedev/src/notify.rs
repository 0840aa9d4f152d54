//! Notification messages: whole `/dev/fuse` writes (out header with `unique == 0` and the
//! notification code in `error`, then the body) by which the daemon tells the kernel to
//! drop cached state.
//!
//! Notifications go to `/dev/fuse` even when requests come through io_uring. Never send
//! one from inside the handler of a related request, nor while holding a lock such a
//! request may need: the kernel may hold the directory's lock while it waits for us.

#![forbid(unsafe_code)]
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

use zerocopy::{Immutable, IntoBytes};

use crate::{
    abi::{
        NotifyDeleteOut, NotifyInvalEntryOut, NotifyInvalInodeOut, FUSE_EXPIRE_ONLY,
        FUSE_NOTIFY_DELETE, FUSE_NOTIFY_INC_EPOCH, FUSE_NOTIFY_INVAL_ENTRY,
        FUSE_NOTIFY_INVAL_INODE, NAME_MAX,
    },
    reply::out_header,
};

/// A name a notification cannot carry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotifyError {
    #[error("name of {len} bytes is longer than {NAME_MAX}")]
    NameTooLong { len: usize },
    #[error("name is empty or contains '/' or NUL")]
    InvalidName,
}

fn check_name(name: &[u8]) -> Result<u32, NotifyError> {
    if name.len() > NAME_MAX {
        return Err(NotifyError::NameTooLong { len: name.len() });
    }
    if name.is_empty() || name.iter().any(|&b| b == 0 || b == b'/') {
        return Err(NotifyError::InvalidName);
    }
    u32::try_from(name.len()).map_err(|_| NotifyError::NameTooLong { len: name.len() })
}

fn message<T: IntoBytes + Immutable>(code: i32, body: &T, name: Option<&[u8]>) -> Vec<u8> {
    let body = body.as_bytes();
    // The name travels with its NUL; the body's namelen excludes it.
    let name_len = name.map_or(0, |n| n.len() + 1);
    let header = out_header(0, code, body.len() + name_len);
    let mut msg = Vec::with_capacity(header.len as usize);
    msg.extend_from_slice(header.as_bytes());
    msg.extend_from_slice(body);
    if let Some(name) = name {
        msg.extend_from_slice(name);
        msg.push(0);
    }
    msg
}

/// Drop cached data of inode `ino` in `off..off+len` (`len == 0`: to the end of the file)
/// and its attributes; `off < 0` drops the attributes only.
pub fn inval_inode(ino: u64, off: i64, len: i64) -> Vec<u8> {
    message(
        FUSE_NOTIFY_INVAL_INODE,
        &NotifyInvalInodeOut { ino, off, len },
        None,
    )
}

/// Drop the dentry `name` in directory `parent` (and, for a negative dentry, the cached
/// absence).
pub fn inval_entry(parent: u64, name: &[u8]) -> Result<Vec<u8>, NotifyError> {
    inval_entry_flags(parent, name, 0)
}

/// Like [`inval_entry`] but only expire the dentry, so the next access revalidates it
/// with a LOOKUP instead of dropping it (keeps mounts on it). Needs `FUSE_HAS_EXPIRE_ONLY`.
pub fn expire_entry(parent: u64, name: &[u8]) -> Result<Vec<u8>, NotifyError> {
    inval_entry_flags(parent, name, FUSE_EXPIRE_ONLY)
}

fn inval_entry_flags(parent: u64, name: &[u8], flags: u32) -> Result<Vec<u8>, NotifyError> {
    let namelen = check_name(name)?;
    let body = NotifyInvalEntryOut {
        parent,
        namelen,
        flags,
    };
    Ok(message(FUSE_NOTIFY_INVAL_ENTRY, &body, Some(name)))
}

/// `name` in `parent`, which named inode `child`, is gone: drop the dentry and, if it
/// still points at `child`, report the deletion to inotify watchers.
pub fn delete(parent: u64, child: u64, name: &[u8]) -> Result<Vec<u8>, NotifyError> {
    let namelen = check_name(name)?;
    let body = NotifyDeleteOut {
        parent,
        child,
        namelen,
        padding: 0,
    };
    Ok(message(FUSE_NOTIFY_DELETE, &body, Some(name)))
}

/// Invalidate every dentry and cached directory listing at once (7.44).
pub fn inc_epoch() -> Vec<u8> {
    out_header(0, FUSE_NOTIFY_INC_EPOCH, 0).as_bytes().to_vec()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

    use super::*;

    #[test]
    fn names_are_checked() {
        assert_eq!(
            inval_entry(1, &[b'a'; 256]),
            Err(NotifyError::NameTooLong { len: 256 })
        );
        assert!(inval_entry(1, &[b'a'; 255]).is_ok());
        assert_eq!(delete(1, 2, b""), Err(NotifyError::InvalidName));
        assert_eq!(delete(1, 2, b"a/b"), Err(NotifyError::InvalidName));
        assert_eq!(delete(1, 2, b"a\0b"), Err(NotifyError::InvalidName));
    }

    #[test]
    fn lengths_and_codes() {
        let m = inval_inode(5, -1, 0);
        assert_eq!(m.len(), 40);
        assert_eq!(&m[0..4], &40u32.to_ne_bytes());
        assert_eq!(&m[4..8], &2i32.to_ne_bytes());
        assert_eq!(&m[8..16], &[0; 8]);
        let m = expire_entry(1, b"ab").unwrap();
        assert_eq!(m.len(), 16 + 16 + 3);
        assert_eq!(&m[28..32], &1u32.to_ne_bytes());
        assert_eq!(inc_epoch().len(), 16);
    }
}
