//! Extended attributes: names checked against the namespaces the kernel passes, values
//! bounded by the metadata codec, each change one etcd commit.
//!
//! POSIX ACLs (`system.posix_acl_access` / `_default`) are enforced by the kernel
//! (FUSE_POSIX_ACL) from the value it reads here once and caches. Setting one is a
//! `SetAcl`: validated, the mode follows an access ACL, and the inode's ACL flag bits
//! record which exist, so a GETXATTR of an ACL an inode lacks (the kernel's first
//! permission check of every inode a non-owner touches) is answered without etcd.

use super::*;
use meta::{acl, codec::FLAG_NO_XATTRS};

/// The SELinux label's attribute, refused unless the mount stores it
/// (`Inner::selinux_xattr`).
const SELINUX_NAME: &[u8] = b"security.selinux";

/// Which ACL an xattr name is: `Some(true)` the default ACL, `Some(false)` the access ACL.
pub(super) fn acl_name(name: &[u8]) -> Option<bool> {
    match name {
        acl::ACCESS_NAME => Some(false),
        acl::DEFAULT_NAME => Some(true),
        _ => None,
    }
}

impl Inner {
    /// A name this mount refuses with EOPNOTSUPP whatever the inode: checked before
    /// anything else, on the core.
    pub(super) fn xattr_refused(&self, name: &[u8]) -> bool {
        name == SELINUX_NAME && !self.selinux_xattr
    }

    /// The inode's cached attributes, if this node holds them without waiting.
    fn attr_at_hand(&self, ino: u64) -> Option<InodeAttr> {
        match self.files.try_open_attr(ino) {
            files::OpenAttr::Attr(a, _) => Some(a),
            files::OpenAttr::Busy => None,
            files::OpenAttr::NotOpen => self.caches.attr(ino),
        }
    }

    /// GETXATTR of an attribute the cached attributes say the inode lacks (an ACL its ACL
    /// bits do not name, or any other name of an inode that never had one): ENODATA, on
    /// the core. `ls -l` asks every file for its ACL and its security label.
    pub(super) fn xattr_absent(&self, ino: u64, name: &[u8]) -> bool {
        let Some(attr) = self.attr_at_hand(ino) else {
            return false;
        };
        match acl_name(name) {
            Some(default) => {
                let flag = if default {
                    acl::FLAG_DEFAULT
                } else {
                    acl::FLAG_ACCESS
                };
                attr.flags & flag == 0
            }
            // A malformed name gets its own error from `getxattr`.
            None => {
                attr.flags & FLAG_NO_XATTRS != 0 && fusedev::names::check_xattr_name(name).is_ok()
            }
        }
    }

    /// LISTXATTR of an inode the cached attributes say has no attribute at all.
    pub(super) fn xattrs_none(&self, ino: u64) -> bool {
        self.attr_at_hand(ino)
            .is_some_and(|a| a.flags & FLAG_NO_XATTRS != 0 && a.flags & acl::FLAGS == 0)
    }

    /// setxattr/removexattr of an ACL (the caller holds a regular file's lock exclusively:
    /// the mode changes with an access ACL).
    fn set_acl(
        &self,
        h: &abi::InHeader,
        ino: u64,
        default: bool,
        value: Option<&[u8]>,
    ) -> Result<Done, Errno> {
        // ext4 clears set-group-id when the setter is neither privileged nor in the
        // file's group. The kernel says so only with FUSE_SETXATTR_EXT (refused: it
        // changes the request layout); the caller's primary group stands in for its
        // groups (a supplementary member loses the bit too).
        let kill_sgid = !default && h.uid != 0 && {
            let a = self.cached_attr(ino)?;
            a.perm & 0o2000 != 0 && a.gid != h.gid
        };
        self.commit(Mutation::SetAcl {
            ino: Ino(ino),
            default,
            value: value.map(<[u8]>::to_vec),
            kill_sgid,
        })?;
        Ok(Done::Empty)
    }

    pub(super) fn setxattr(
        &self,
        h: &abi::InHeader,
        name: &[u8],
        value: &[u8],
        flags: u32,
    ) -> Result<Done, Errno> {
        let ino = h.nodeid;
        fusedev::names::check_xattr_name(name)?;
        if self.xattr_refused(name) {
            return Err(Errno::EOPNOTSUPP);
        }
        if value.len() > XATTR_VALUE_LEN_MAX {
            return Err(Errno::E2BIG);
        }
        if let Some(default) = acl_name(name) {
            return self.set_acl(h, ino, default, Some(value));
        }
        let mode = match flags & (abi::XATTR_CREATE | abi::XATTR_REPLACE) {
            0 => XattrMode::Any,
            abi::XATTR_CREATE => XattrMode::Create,
            abi::XATTR_REPLACE => XattrMode::Replace,
            _ => return Err(Errno::EINVAL),
        };
        let m = Mutation::SetXattr {
            ino: Ino(ino),
            name: name.to_vec(),
            value: value.to_vec(),
            mode,
        };
        match self.commit(m) {
            Ok(_) => Ok(Done::Empty),
            // XATTR_REPLACE of a missing attribute (the inode exists: the kernel holds it).
            Err(Errno::ENOENT) => Err(Errno::ENODATA),
            Err(Errno::E2BIG) => Err(Errno::ENOSPC),
            Err(e) => Err(e),
        }
    }

    /// A name [`Inner::xattr_refused`] refuses is answered before this, on the core.
    pub(super) fn getxattr(&self, ino: u64, name: &[u8], size: u32) -> Result<Done, Errno> {
        fusedev::names::check_xattr_name(name)?;
        let v = self
            .meta
            .get_xattr(Ino(ino), name.to_vec())
            .and_then(|t| t.wait())
            .map_err(|e| errno::meta(&e))?
            .ok_or(Errno::ENODATA)?;
        sized(v, size)
    }

    /// `privileged`: the caller may see `trusted.` names (ext4 lists them only to
    /// CAP_SYS_ADMIN; FUSE passes no capabilities, so root stands in for it).
    pub(super) fn listxattr(&self, ino: u64, size: u32, privileged: bool) -> Result<Done, Errno> {
        let names = self
            .meta
            .list_xattrs(Ino(ino), XATTR_LIST_NAMES_MAX)
            .and_then(|t| t.wait())
            .map_err(|e| errno::meta(&e))?;
        let mut list = Vec::new();
        for n in names {
            // A label stored by a mount with `--selinux-xattr` is not listed by one
            // that refuses it: a copy would fail on it.
            if (!privileged && n.starts_with(b"trusted.")) || self.xattr_refused(&n) {
                continue;
            }
            list.extend_from_slice(&n);
            list.push(0);
        }
        sized(list, size)
    }

    pub(super) fn removexattr(&self, h: &abi::InHeader, name: &[u8]) -> Result<Done, Errno> {
        let ino = h.nodeid;
        fusedev::names::check_xattr_name(name)?;
        if self.xattr_refused(name) {
            return Err(Errno::EOPNOTSUPP);
        }
        if let Some(default) = acl_name(name) {
            // ext4 answers 0 to removing an ACL that is not there (the ACL is the mode).
            if self.xattr_absent(ino, name) {
                return Ok(Done::Empty);
            }
            return self.set_acl(h, ino, default, None);
        }
        match self.commit(Mutation::RemoveXattr {
            ino: Ino(ino),
            name: name.to_vec(),
        }) {
            Ok(_) => Ok(Done::Empty),
            Err(Errno::ENOENT) => Err(Errno::ENODATA),
            Err(e) => Err(e),
        }
    }
}
