//! Extended attributes: names checked against the namespaces the kernel passes, values
//! bounded by the metadata codec, each change one etcd commit.

use super::*;

impl Inner {
    pub(super) fn setxattr(
        &self,
        ino: u64,
        name: &[u8],
        value: &[u8],
        flags: u32,
    ) -> Result<Done, Errno> {
        fusedev::names::check_xattr_name(name)?;
        if value.len() > XATTR_VALUE_LEN_MAX {
            return Err(Errno::E2BIG);
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

    pub(super) fn listxattr(&self, ino: u64, size: u32) -> Result<Done, Errno> {
        let names = self
            .meta
            .list_xattrs(Ino(ino), XATTR_LIST_NAMES_MAX)
            .and_then(|t| t.wait())
            .map_err(|e| errno::meta(&e))?;
        let mut list = Vec::new();
        for n in names {
            list.extend_from_slice(&n);
            list.push(0);
        }
        sized(list, size)
    }

    pub(super) fn removexattr(&self, ino: u64, name: &[u8]) -> Result<Done, Errno> {
        fusedev::names::check_xattr_name(name)?;
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
