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

/// Namespaces an attribute name may start with, each followed by a non-empty name.
const XATTR_NAMESPACES: [&[u8]; 3] = [b"user.", b"trusted.", b"security."];
/// The `system.` names a filesystem stores (POSIX ACLs); ext4 refuses every other one.
const XATTR_SYSTEM_NAMES: [&[u8]; 2] = [b"system.posix_acl_access", b"system.posix_acl_default"];

/// An extended-attribute name as ext4 accepts it: at most [`XATTR_NAME_MAX`] bytes
/// (ERANGE, as Linux answers for an over-long name), in a namespace it knows (`user.`,
/// `trusted.`, `security.`, or one of the POSIX ACL names; EOPNOTSUPP otherwise: FUSE
/// hands the filesystem every name, `foo.bar` included), and not a bare namespace prefix
/// such as `user.` (EINVAL).
pub fn check_xattr_name(name: &[u8]) -> Result<(), Errno> {
    if name.is_empty() {
        return Err(Errno::EINVAL);
    }
    if name.len() > XATTR_NAME_MAX {
        return Err(Errno::ERANGE);
    }
    if XATTR_SYSTEM_NAMES.contains(&name) {
        return Ok(());
    }
    match XATTR_NAMESPACES.iter().find(|ns| name.starts_with(ns)) {
        Some(ns) if name.len() == ns.len() => Err(Errno::EINVAL),
        Some(_) => Ok(()),
        None => Err(Errno::EOPNOTSUPP),
    }
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
        assert_eq!(check_xattr_name(b"trusted.a"), Ok(()));
        assert_eq!(check_xattr_name(b"security.selinux"), Ok(()));
        assert_eq!(check_xattr_name(b"system.posix_acl_access"), Ok(()));
        assert_eq!(check_xattr_name(b"system.posix_acl_default"), Ok(()));
        assert_eq!(check_xattr_name(b""), Err(Errno::EINVAL));
        assert_eq!(check_xattr_name(&[b'x'; 256]), Err(Errno::ERANGE));
        // As ext4 answers (found by a tester: both were stored).
        assert_eq!(check_xattr_name(b"foo.bar"), Err(Errno::EOPNOTSUPP));
        assert_eq!(check_xattr_name(b"system.other"), Err(Errno::EOPNOTSUPP));
        assert_eq!(check_xattr_name(b"user"), Err(Errno::EOPNOTSUPP));
        assert_eq!(check_xattr_name(b"user."), Err(Errno::EINVAL));
        assert_eq!(check_xattr_name(b"security."), Err(Errno::EINVAL));
    }
}
