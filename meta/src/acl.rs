//! POSIX ACLs as Linux stores them in `system.posix_acl_access` / `_default` xattrs, and
//! the mode arithmetic ext4 does with them: what a new inode inherits from its parent's
//! default ACL, the mode an access ACL implies, and what chmod does to an access ACL.
//!
//! Pure: no I/O. The kernel enforces access ACLs itself (FUSE_POSIX_ACL, from the xattr it
//! reads once and caches); the filesystem keeps the ACL and the mode consistent, in the
//! same etcd transaction (`pipeline::plan`).
//!
//! Value format (Linux `posix_acl_xattr`): a little-endian u32 version (2), then entries
//! of 8 bytes: u16 tag, u16 permission bits (rwx = 4|2|1), u32 id (uid or gid for named
//! entries; ignored, and written as `u32::MAX`, for the others).

/// `system.posix_acl_access`: checked by the kernel on every access.
pub const ACCESS_NAME: &[u8] = b"system.posix_acl_access";
/// `system.posix_acl_default`: a directory's ACL for what is created in it.
pub const DEFAULT_NAME: &[u8] = b"system.posix_acl_default";

/// `InodeAttr::flags` bit: the inode has an access ACL (so a GETXATTR of it needs etcd;
/// without the bit the answer is "none" without a read).
pub const FLAG_ACCESS: u32 = 1 << 0;
/// `InodeAttr::flags` bit: the directory has a default ACL (a create in it must inherit).
pub const FLAG_DEFAULT: u32 = 1 << 1;
/// The flag bits ACLs own; no other writer may change them.
pub const FLAGS: u32 = FLAG_ACCESS | FLAG_DEFAULT;

const VERSION: u32 = 2;
const HEADER_LEN: usize = 4;
const ENTRY_LEN: usize = 8;
const UNDEFINED_ID: u32 = u32::MAX;

/// Entry tags, in the order a valid ACL lists them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tag {
    /// The owner.
    UserObj,
    /// A named user.
    User(u32),
    /// The owning group.
    GroupObj,
    /// A named group.
    Group(u32),
    /// The most a named entry or the owning group may be granted.
    Mask,
    /// Everybody else.
    Other,
}

/// One entry: a tag and rwx bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Whom it is about.
    pub tag: Tag,
    /// rwx bits (0..=7).
    pub perm: u16,
}

/// A valid ACL (the kernel's `posix_acl_valid` rules, plus named entries sorted by id
/// without duplicates, which is how the kernel and libacl write them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acl {
    entries: Vec<Entry>,
}

impl Acl {
    /// Decodes and validates an xattr value. `Ok(None)`: a header without entries, which
    /// Linux treats as removing the ACL.
    pub fn decode(value: &[u8]) -> Result<Option<Acl>, &'static str> {
        let (head, body) = value.split_at_checked(HEADER_LEN).ok_or("acl too short")?;
        let version = u32::from_le_bytes(head.try_into().map_err(|_| "acl header")?);
        if version != VERSION {
            return Err("acl version");
        }
        if body.len() % ENTRY_LEN != 0 {
            return Err("acl length");
        }
        if body.is_empty() {
            return Ok(None);
        }
        let mut entries = Vec::with_capacity(body.len() / ENTRY_LEN);
        for e in body.chunks_exact(ENTRY_LEN) {
            let tag = u16::from_le_bytes([e[0], e[1]]);
            let perm = u16::from_le_bytes([e[2], e[3]]);
            let id = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
            let tag = match tag {
                0x01 => Tag::UserObj,
                0x02 => Tag::User(id),
                0x04 => Tag::GroupObj,
                0x08 => Tag::Group(id),
                0x10 => Tag::Mask,
                0x20 => Tag::Other,
                _ => return Err("acl tag"),
            };
            if perm & !7 != 0 {
                return Err("acl permission bits");
            }
            entries.push(Entry { tag, perm });
        }
        let acl = Acl { entries };
        acl.validate()?;
        Ok(Some(acl))
    }

    /// Builds an ACL from entries (tests, tools); validated like a decoded one.
    pub fn new(entries: Vec<Entry>) -> Result<Acl, &'static str> {
        let acl = Acl { entries };
        acl.validate()?;
        Ok(acl)
    }

    fn validate(&self) -> Result<(), &'static str> {
        // Strictly increasing tags (named entries by id) give the order and uniqueness
        // rules in one pass; then the required entries.
        if self.entries.windows(2).any(|w| w[0].tag >= w[1].tag) {
            return Err("acl entries out of order or repeated");
        }
        let has = |t: Tag| self.entries.iter().any(|e| e.tag == t);
        if !has(Tag::UserObj) || !has(Tag::GroupObj) || !has(Tag::Other) {
            return Err("acl lacks an owner, group or other entry");
        }
        if self.has_named() && !has(Tag::Mask) {
            return Err("acl with named entries lacks a mask");
        }
        if self.entries.iter().any(|e| e.perm & !7 != 0) {
            return Err("acl permission bits");
        }
        Ok(())
    }

    fn has_named(&self) -> bool {
        self.entries
            .iter()
            .any(|e| matches!(e.tag, Tag::User(_) | Tag::Group(_)))
    }

    /// The entries, in order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The xattr value.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HEADER_LEN + ENTRY_LEN * self.entries.len());
        v.extend_from_slice(&VERSION.to_le_bytes());
        for e in &self.entries {
            let (tag, id) = match e.tag {
                Tag::UserObj => (0x01u16, UNDEFINED_ID),
                Tag::User(id) => (0x02, id),
                Tag::GroupObj => (0x04, UNDEFINED_ID),
                Tag::Group(id) => (0x08, id),
                Tag::Mask => (0x10, UNDEFINED_ID),
                Tag::Other => (0x20, UNDEFINED_ID),
            };
            v.extend_from_slice(&tag.to_le_bytes());
            v.extend_from_slice(&e.perm.to_le_bytes());
            v.extend_from_slice(&id.to_le_bytes());
        }
        v
    }

    fn perm_of(&self, tag: Tag) -> Option<u16> {
        self.entries.iter().find(|e| e.tag == tag).map(|e| e.perm)
    }

    fn set_perm(&mut self, tag: Tag, f: impl Fn(u16) -> u16) {
        for e in &mut self.entries {
            if e.tag == tag {
                e.perm = f(e.perm) & 7;
            }
        }
    }

    /// The rwxrwxrwx bits `ls -l` shows for this access ACL: owner, mask (or owning
    /// group without one), other.
    pub fn mode_bits(&self) -> u16 {
        let u = self.perm_of(Tag::UserObj).unwrap_or(0);
        let g = self
            .perm_of(Tag::Mask)
            .or_else(|| self.perm_of(Tag::GroupObj))
            .unwrap_or(0);
        let o = self.perm_of(Tag::Other).unwrap_or(0);
        (u << 6) | (g << 3) | o
    }

    /// Whether the mode bits say everything this ACL says (no named entries), so storing
    /// the mode alone is the same (Linux stores no xattr then).
    pub fn is_minimal(&self) -> bool {
        !self.has_named()
    }

    /// chmod of an inode with this access ACL: owner, mask (or owning group) and other
    /// take the new bits; named entries stay (the mask limits them).
    pub fn chmod(&mut self, perm: u16) {
        let has_mask = self.perm_of(Tag::Mask).is_some();
        self.set_perm(Tag::UserObj, |_| perm >> 6);
        self.set_perm(if has_mask { Tag::Mask } else { Tag::GroupObj }, |_| {
            perm >> 3
        });
        self.set_perm(Tag::Other, |_| perm);
    }

    /// A new inode's access ACL from its parent's default ACL (this one) and the mode the
    /// creator asked for: the ACL's owner, mask (or group) and other entries are limited
    /// to the mode, the mode to them. Returns the new mode (type and special bits kept)
    /// and the access ACL to store, `None` when the mode alone says it all (no named
    /// entries and no mask, as Linux decides it at create).
    pub fn inherit(&self, perm: u16) -> (u16, Option<Acl>) {
        let mut acl = self.clone();
        let has_mask = acl.perm_of(Tag::Mask).is_some();
        acl.set_perm(Tag::UserObj, |p| p & (perm >> 6));
        acl.set_perm(Tag::Other, |p| p & perm);
        acl.set_perm(if has_mask { Tag::Mask } else { Tag::GroupObj }, |p| {
            p & (perm >> 3)
        });
        let bits = acl.mode_bits();
        let new = (perm & !0o777) | bits;
        if has_mask || acl.has_named() {
            (new, Some(acl))
        } else {
            (new, None)
        }
    }
}

/// What storing `value` as an inode's access ACL does, as ext4 does it: the mode takes
/// the ACL's bits, and an ACL the mode says in full is not stored. Returns the new
/// permission bits and the value to store (`None`: delete the xattr).
pub fn set_access(perm: u16, value: Option<&[u8]>) -> Result<(u16, Option<Vec<u8>>), &'static str> {
    let Some(acl) = value.map(Acl::decode).transpose()?.flatten() else {
        return Ok((perm, None));
    };
    let new = (perm & !0o777) | acl.mode_bits();
    Ok((new, (!acl.is_minimal()).then(|| acl.encode())))
}

/// What storing `value` as a directory's default ACL stores (`None`: delete).
pub fn set_default(value: Option<&[u8]>) -> Result<Option<Vec<u8>>, &'static str> {
    Ok(value
        .map(Acl::decode)
        .transpose()?
        .flatten()
        .map(|a| a.encode()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(tag: Tag, perm: u16) -> Entry {
        Entry { tag, perm }
    }

    fn sample() -> Acl {
        Acl::new(vec![
            e(Tag::UserObj, 7),
            e(Tag::User(1000), 0),
            e(Tag::User(1001), 6),
            e(Tag::GroupObj, 5),
            e(Tag::Mask, 7),
            e(Tag::Other, 4),
        ])
        .unwrap()
    }

    #[test]
    fn round_trip_and_kernel_bytes() {
        let a = sample();
        let v = a.encode();
        assert_eq!(v.len(), 4 + 6 * 8);
        assert_eq!(&v[..4], &[2, 0, 0, 0]);
        // u:1000:--- as the kernel writes it.
        assert_eq!(&v[12..20], &[2, 0, 0, 0, 0xe8, 3, 0, 0]);
        assert_eq!(Acl::decode(&v).unwrap(), Some(a));
        // The ids of unnamed entries are ignored on the way in.
        let mut w = v.clone();
        w[8..12].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(Acl::decode(&w).unwrap().unwrap().encode(), v);
        assert_eq!(Acl::decode(&[2, 0, 0, 0]), Ok(None));
    }

    #[test]
    fn malformed_values_are_refused() {
        let good = sample().encode();
        assert!(Acl::decode(&[]).is_err());
        assert!(Acl::decode(&[1, 0, 0, 0]).is_err(), "version");
        assert!(Acl::decode(&good[..good.len() - 1]).is_err(), "length");
        let mut bad_perm = good.clone();
        bad_perm[6] = 8;
        assert!(Acl::decode(&bad_perm).is_err());
        let mut bad_tag = good.clone();
        bad_tag[4] = 0x40;
        assert!(Acl::decode(&bad_tag).is_err());
        // Named entries without a mask; duplicates; wrong order; missing other.
        assert!(Acl::new(vec![
            e(Tag::UserObj, 7),
            e(Tag::User(5), 7),
            e(Tag::GroupObj, 7),
            e(Tag::Other, 7)
        ])
        .is_err());
        assert!(Acl::new(vec![
            e(Tag::UserObj, 7),
            e(Tag::User(5), 7),
            e(Tag::User(5), 7),
            e(Tag::GroupObj, 7),
            e(Tag::Mask, 7),
            e(Tag::Other, 7)
        ])
        .is_err());
        assert!(Acl::new(vec![
            e(Tag::GroupObj, 7),
            e(Tag::UserObj, 7),
            e(Tag::Other, 7)
        ])
        .is_err());
        assert!(Acl::new(vec![e(Tag::UserObj, 7), e(Tag::GroupObj, 7)]).is_err());
    }

    #[test]
    fn access_acl_sets_the_mode() {
        // setfacl -m u:1000:--- on a 0644 file: the mode's group bits become the mask's.
        let (perm, stored) = set_access(0o100644 & 0o7777, Some(&sample().encode())).unwrap();
        assert_eq!(perm, 0o774);
        assert!(stored.is_some());
        // A minimal ACL is only a mode.
        let min = Acl::new(vec![
            e(Tag::UserObj, 6),
            e(Tag::GroupObj, 0),
            e(Tag::Other, 0),
        ])
        .unwrap();
        assert_eq!(
            set_access(0o4755, Some(&min.encode())).unwrap(),
            (0o4600, None)
        );
        assert_eq!(set_access(0o644, None).unwrap(), (0o644, None));
        assert!(set_access(0o644, Some(&[9])).is_err());
    }

    #[test]
    fn chmod_moves_the_mask_not_the_group() {
        let mut a = sample();
        a.chmod(0o640);
        assert_eq!(a.perm_of(Tag::UserObj), Some(6));
        assert_eq!(a.perm_of(Tag::Mask), Some(4));
        assert_eq!(a.perm_of(Tag::GroupObj), Some(5));
        assert_eq!(a.perm_of(Tag::User(1001)), Some(6));
        assert_eq!(a.perm_of(Tag::Other), Some(0));
        assert_eq!(a.mode_bits(), 0o640);
    }

    #[test]
    fn inheritance_masks_both_ways() {
        // open(O_CREAT, 0666) under a default ACL: the umask is not applied; x stays off.
        let (perm, acl) = sample().inherit(0o666);
        assert_eq!(perm, 0o664);
        let acl = acl.unwrap();
        assert_eq!(acl.perm_of(Tag::UserObj), Some(6));
        assert_eq!(acl.perm_of(Tag::Mask), Some(6));
        assert_eq!(acl.perm_of(Tag::User(1001)), Some(6));
        assert_eq!(acl.perm_of(Tag::Other), Some(4));
        // A minimal default ACL gives a mode only.
        let min = Acl::new(vec![
            e(Tag::UserObj, 7),
            e(Tag::GroupObj, 5),
            e(Tag::Other, 0),
        ])
        .unwrap();
        assert_eq!(min.inherit(0o2777), (0o2750, None));
    }
}
