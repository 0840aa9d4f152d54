//! The names a Linux filesystem accepts, checked the same way by every filesystem behind
//! this FUSE layer (the kernel passes names through unchecked, beyond `/` and NUL).

#![forbid(unsafe_code)]

use crate::{abi::NAME_MAX, errno::Errno};

/// Linux's `XATTR_NAME_MAX`: the longest extended-attribute name, prefix included.
pub const XATTR_NAME_MAX: usize = 255;

/// A directory entry name: 1..=255 bytes without `/` or NUL; a longer one is
/// ENAMETOOLONG, as on ext4.
pub fn check_entry_name(name: &[u8]) -> Result<(), Errno> {
    if name.len() > NAME_MAX {
        return Err(Errno::ENAMETOOLONG);
    }
    if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
        return Err(Errno::EINVAL);
    }
    Ok(())
}

/// An extended-attribute name: non-empty and at most [`XATTR_NAME_MAX`] bytes (ERANGE, as
/// Linux answers for an over-long name).
pub fn check_xattr_name(name: &[u8]) -> Result<(), Errno> {
    if name.is_empty() {
        return Err(Errno::EINVAL);
    }
    if name.len() > XATTR_NAME_MAX {
        return Err(Errno::ERANGE);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_names() {
        assert_eq!(check_entry_name(b"a"), Ok(()));
        assert_eq!(check_entry_name(&[b'x'; 255]), Ok(()));
        assert_eq!(check_entry_name(&[b'x'; 256]), Err(Errno::ENAMETOOLONG));
        assert_eq!(check_entry_name(b""), Err(Errno::EINVAL));
        assert_eq!(check_entry_name(b"a/b"), Err(Errno::EINVAL));
        assert_eq!(check_entry_name(b"a\0"), Err(Errno::EINVAL));
    }

    #[test]
    fn xattr_names() {
        assert_eq!(check_xattr_name(b"user.a"), Ok(()));
        assert_eq!(check_xattr_name(b""), Err(Errno::EINVAL));
        assert_eq!(check_xattr_name(&[b'x'; 256]), Err(Errno::ERANGE));
    }
}
