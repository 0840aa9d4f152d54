//! The etcd key schema: every key etcfs writes, in one table, with encoders/decoders.
//!
//! ```text
//! All keys live under "<prefix>/" (prefix from --prefix, default "etcfs"; it may not
//! contain '/', so "a/" and "ab/" never overlap). After the prefix comes one tag byte.
//! Integers are fixed-width BIG-endian so byte order equals numeric order: an inode's
//! extents list by offset and a range over a tag lists its keys by number.
//!
//! key                          value (codec.rs)        lease          written by
//! <p>/S                        SuperRecord             -              mkfs
//! <p>/C                        InoCounter (next free)  -              pipeline, CAS +1024
//! <p>/I<ino:8>                 InodeAttr               -              create/setattr/link/...
//! <p>/D<parent:8><name>        Dentry {ino, type}      -              create/link/unlink/rename
//! <p>/P<dir:8>                 DirParent {parent}      -              mkdir/rename (dirs only)
//! <p>/L<ino:8>                 SymlinkTarget           -              symlink
//! <p>/X<ino:8><name>           XattrValue              -              setxattr/removexattr
//! <p>/E<ino:8><file_off:8>     Extent {len, dev_off,   -              write/fallocate/punch/
//!                                      unwritten}                     truncate
//! <p>/M<session:8>             NodeRecord              the session's  Session::register
//! <p>/G<group:4>               GroupOwner {session}    owner's lease  Session::claim_group
//! <p>/O<ino:8>                 Orphan {session}        -              unlink-while-open
//! <p>/H<ino:8><session:8>      Owner {session}         the session's  first open of the file on
//!                                                                     that node (create: same
//!                                                                     txn); deleted at its last
//!                                                                     close there (Hold/Unhold)
//! <p>/F<group:4>               free map (opaque here;  -              mkfs; SetExtents (allocs,
//!                              src/data/alloc.rs)                     same txn); FreeMaps
//! <p>/R<dev_off:8>             Released {len}          -              the mutation freeing the
//!                                                                     extent (same txn); deleted
//!                                                                     by FreeMaps
//! <p>/W<session:8>             Owner {session}         the asker's    a node out of space in its
//!                                                                     groups: owners hand some
//!                                                                     back (Session::want_space)
//! <p>/V<session:8>             Owner {session}         -              `etcfs evict`: that session
//!                                                                     fences itself and revokes
//!                                                                     its lease; deleted by it
//!                                                                     or by the evicting command
//! <p>/K<ino:8><session:8>      CacheLock {mode}        the holder's   cluster cache lock of a
//!                                                                     regular file (cachelock.rs)
//! <p>/Q<ino:8><session:8>      CacheLock {mode}        the asker's    a node waiting for that
//!                                                                     lock: holders give way
//! <p>/B<ino:8><session:8>      LockRecord {kind, end,  the holder's   GETLK/SETLK/SETLKW, FLUSH,
//!      <owner:8><class:1>      pid}                    lease          RELEASE (src/fs/plocks.rs)
//!      <start:8>                                                      owner LOCK_DELEGATION_OWNER:
//!                                                                     the file's locks are held by
//!                                                                     that session alone (in memory);
//!                                                                     LOCK_RECALL_OWNER: asked back
//! <p>/T<session:8><seq:8>      empty: committed;       the session's  every pipeline txn writes
//!                              "x": given up                          its own (created only if
//!                                                                     absent); deleted in ranges
//!                                                                     once answered
//! ```
//!
//! Why this shape:
//! * A directory's entries are exactly the keys with prefix `<p>/D<parent>`: one range
//!   request returns the whole name set (the fs caps it at 4096), listed in byte order of
//!   the name, which is readdir's order. Lookup is one point read.
//! * Readdir offsets: entries are listed in name order and a page resumes *after a name*
//!   (`range [dentry(parent, name) + "\0", end)`), so a position stays valid while other
//!   names are added or removed: nothing is renumbered. The 63-bit FUSE offset for an
//!   entry is [`dir_cookie`] (a stable hash of the name, never 0, 1 or 2 so "." and ".."
//!   can use 1 and 2). The fs keeps, per open directory handle, the cookie → name of the
//!   entries it returned, resumes after that name, and for an unknown cookie (an old
//!   `telldir`) scans the name set for the name with that hash.
//! * Directory parents live in their own `P` key rather than in the inode, so the
//!   ancestor walk that stops `rename` from moving a directory into its own subtree
//!   compares only keys that change when directories move, not the (frequently
//!   re-timestamped) inodes.
//! * Freed device ranges are logged as `R` records in the transaction that drops the
//!   extents (each inside one allocation group), and deleted by the group owner's `FreeMaps`
//!   that writes them into `F<group>`: a crash in between loses nothing, since a node
//!   loading the group applies the records written after the map (see src/fs `try_claim`).
//! * Liveness is etcd leases: `M` and `G` keys carry the owning session's lease and vanish
//!   when it expires. Orphans (`O`) do not: they must outlive a crash so that another node
//!   can see that the owner session is gone and reclaim the inode.
//! * Open records (`H`) say which nodes have a file open, so that an unlink on any node
//!   keeps the inode (as an orphan) while one of them does. They carry the holder's lease:
//!   a node that dies holds nothing once its lease ends. The inode comes first in the key,
//!   so "is it open anywhere" is one range read (or range compare) over `H<ino>`.
//! * Commit markers (`T`) make a transaction whose answer was lost decidable: each commit
//!   transaction creates its own marker, and whoever resolves the lost answer creates the
//!   same marker as "given up" if it is still absent. Exactly one of the two can apply,
//!   so the mutation is either known committed or safely resent, never applied twice.
//! * Byte-range and flock locks (`B`) carry the holder's lease too, so a dead node's locks
//!   vanish with it. Their keys start with the inode: one range read returns every lock of
//!   a file (what a conflict check needs), and one range compare over it makes an
//!   acquisition fail when any lock of the file changed since that read. Inside, the holder
//!   (session, kernel lock owner, class) comes before the start, so one holder's locks are
//!   one sub-range too.

use std::fmt::Write as _;

use crate::types::{GroupId, Ino, SessionId};

/// Tag bytes, one per row of the table above. Part of the on-etcd format.
mod tag {
    pub(super) const SUPER: u8 = b'S';
    pub(super) const COUNTER: u8 = b'C';
    pub(super) const INODE: u8 = b'I';
    pub(super) const DENTRY: u8 = b'D';
    pub(super) const DIR_PARENT: u8 = b'P';
    pub(super) const SYMLINK: u8 = b'L';
    pub(super) const XATTR: u8 = b'X';
    pub(super) const EXTENT: u8 = b'E';
    pub(super) const MEMBER: u8 = b'M';
    pub(super) const GROUP: u8 = b'G';
    pub(super) const ORPHAN: u8 = b'O';
    pub(super) const FREE_MAP: u8 = b'F';
    pub(super) const RELEASED: u8 = b'R';
    pub(super) const SPACE_WANTED: u8 = b'W';
    pub(super) const EVICT: u8 = b'V';
    pub(super) const CACHE_LOCK: u8 = b'K';
    pub(super) const CACHE_WANT: u8 = b'Q';
    pub(super) const HELD: u8 = b'H';
    pub(super) const LOCK: u8 = b'B';
    pub(super) const TXN_MARKER: u8 = b'T';
}

/// The default filesystem prefix.
pub const DEFAULT_PREFIX: &str = "etcfs";
/// Longest allowed prefix (bytes).
pub const PREFIX_LEN_MAX: usize = 64;

/// A half-open key range `[start, end)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyRange {
    /// First key in the range.
    pub start: Vec<u8>,
    /// First key after the range.
    pub end: Vec<u8>,
}

/// A decoded key: which table row it is and its fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyKind {
    /// `S`
    Super,
    /// `C`
    InoCounter,
    /// `I<ino>`
    Inode(Ino),
    /// `D<parent><name>`
    Dentry(Ino, Vec<u8>),
    /// `P<dir>`
    DirParent(Ino),
    /// `L<ino>`
    Symlink(Ino),
    /// `X<ino><name>`
    Xattr(Ino, Vec<u8>),
    /// `E<ino><off>`
    Extent(Ino, u64),
    /// `M<session>`
    Member(SessionId),
    /// `G<group>`
    Group(GroupId),
    /// `F<group>`.
    FreeMap(GroupId),
    /// `O<ino>`
    Orphan(Ino),
    /// `R<dev_off>`
    Released(u64),
    /// `W<session>`
    SpaceWanted(SessionId),
    /// `V<session>`
    Evict(SessionId),
    /// `K<ino><session>`
    CacheLock(Ino, SessionId),
    /// `Q<ino><session>`
    CacheWant(Ino, SessionId),
    /// `H<ino><session>`
    Held(Ino, SessionId),
    /// `B<ino><session><owner><class><start>`
    Lock(LockKey),
    /// `T<session><seq>`
    TxnMarker(SessionId, u64),
}

/// The fields of a `B` key: whose lock on which file, and where it starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LockKey {
    /// The locked file.
    pub ino: Ino,
    /// The holder's node session.
    pub session: SessionId,
    /// The kernel's lock owner on that node (a process's file table for fcntl locks, an
    /// open file description for flock).
    pub owner: u64,
    /// flock (whole-file, `true`) or fcntl record lock (`false`): the two never conflict.
    pub flock: bool,
    /// First locked byte.
    pub start: u64,
}

/// The owner of a `B` record (class fcntl, start 0) that is not a lock: the file's locks
/// are delegated to its session, which holds them in memory (src/fs/plocks.rs).
pub const LOCK_DELEGATION_OWNER: u64 = u64::MAX;
/// The owner of a `B` record by which its session asks for a delegation back.
pub const LOCK_RECALL_OWNER: u64 = u64::MAX - 1;

/// Error for an unusable `--prefix`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid prefix {0:?}: 1..=64 bytes of [A-Za-z0-9._-]")]
pub struct BadPrefix(pub String);

/// The key space of one filesystem: builds and parses keys under `<prefix>/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keyspace {
    /// `<prefix>/`
    root: Vec<u8>,
}

impl Keyspace {
    /// A key space for `prefix` (validated: no '/', printable, bounded).
    pub fn new(prefix: &str) -> Result<Self, BadPrefix> {
        let ok = !prefix.is_empty()
            && prefix.len() <= PREFIX_LEN_MAX
            && prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
        if !ok {
            return Err(BadPrefix(prefix.to_owned()));
        }
        let mut root = prefix.as_bytes().to_vec();
        root.push(b'/');
        Ok(Keyspace { root })
    }

    /// The bytes every key of this filesystem starts with (`<prefix>/`).
    pub fn root(&self) -> &[u8] {
        &self.root
    }

    /// Every key of this filesystem.
    pub fn all(&self) -> KeyRange {
        KeyRange {
            start: self.root.clone(),
            end: prefix_end(&self.root),
        }
    }

    fn key(&self, tag: u8, cap: usize) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.root.len() + 1 + cap);
        k.extend_from_slice(&self.root);
        k.push(tag);
        k
    }

    fn key_u64(&self, tag: u8, n: u64) -> Vec<u8> {
        let mut k = self.key(tag, 8);
        k.extend_from_slice(&n.to_be_bytes());
        k
    }

    fn range_u64(&self, tag: u8, n: u64) -> KeyRange {
        let start = self.key_u64(tag, n);
        KeyRange {
            end: prefix_end(&start),
            start,
        }
    }

    fn range_tag(&self, tag: u8) -> KeyRange {
        let start = self.key(tag, 0);
        KeyRange {
            end: prefix_end(&start),
            start,
        }
    }

    /// `S`: the superblock record.
    pub fn superblock(&self) -> Vec<u8> {
        self.key(tag::SUPER, 0)
    }

    /// `C`: the inode-number counter.
    pub fn ino_counter(&self) -> Vec<u8> {
        self.key(tag::COUNTER, 0)
    }

    /// `I<ino>`: an inode's attributes.
    pub fn inode(&self, ino: Ino) -> Vec<u8> {
        self.key_u64(tag::INODE, ino.0)
    }

    /// All inode keys (fsck, orphan scans).
    pub fn inodes(&self) -> KeyRange {
        self.range_tag(tag::INODE)
    }

    /// `D<parent><name>`: one directory entry.
    pub fn dentry(&self, parent: Ino, name: &[u8]) -> Vec<u8> {
        let mut k = self.key(tag::DENTRY, 8 + name.len());
        k.extend_from_slice(&parent.0.to_be_bytes());
        k.extend_from_slice(name);
        k
    }

    /// Every entry of directory `parent`, in name order.
    pub fn dentries(&self, parent: Ino) -> KeyRange {
        self.range_u64(tag::DENTRY, parent.0)
    }

    /// The entries of `parent` strictly after `name` (a readdir resume point).
    pub fn dentries_after(&self, parent: Ino, name: &[u8]) -> KeyRange {
        let mut start = self.dentry(parent, name);
        start.push(0);
        KeyRange {
            start,
            end: self.dentries(parent).end,
        }
    }

    /// `P<dir>`: a directory's parent.
    pub fn dir_parent(&self, dir: Ino) -> Vec<u8> {
        self.key_u64(tag::DIR_PARENT, dir.0)
    }

    /// `L<ino>`: a symlink's target.
    pub fn symlink(&self, ino: Ino) -> Vec<u8> {
        self.key_u64(tag::SYMLINK, ino.0)
    }

    /// `X<ino><name>`: one extended attribute.
    pub fn xattr(&self, ino: Ino, name: &[u8]) -> Vec<u8> {
        let mut k = self.key(tag::XATTR, 8 + name.len());
        k.extend_from_slice(&ino.0.to_be_bytes());
        k.extend_from_slice(name);
        k
    }

    /// All xattrs of `ino`.
    pub fn xattrs(&self, ino: Ino) -> KeyRange {
        self.range_u64(tag::XATTR, ino.0)
    }

    /// `E<ino><off>`: the extent starting at file offset `off`.
    pub fn extent(&self, ino: Ino, off: u64) -> Vec<u8> {
        let mut k = self.key(tag::EXTENT, 16);
        k.extend_from_slice(&ino.0.to_be_bytes());
        k.extend_from_slice(&off.to_be_bytes());
        k
    }

    /// All extents of `ino`, in offset order.
    pub fn extents(&self, ino: Ino) -> KeyRange {
        self.range_u64(tag::EXTENT, ino.0)
    }

    /// Extents of `ino` starting in `[from, to)` (`to == u64::MAX` means to the end).
    pub fn extents_between(&self, ino: Ino, from: u64, to: u64) -> KeyRange {
        let end = if to == u64::MAX {
            self.extents(ino).end
        } else {
            self.extent(ino, to)
        };
        KeyRange {
            start: self.extent(ino, from),
            end,
        }
    }

    /// `M<session>`: a live node's membership record.
    pub fn member(&self, session: SessionId) -> Vec<u8> {
        self.key_u64(tag::MEMBER, session.0)
    }

    /// All membership records.
    pub fn members(&self) -> KeyRange {
        self.range_tag(tag::MEMBER)
    }

    /// `G<group>`: an allocation group's owner.
    pub fn group(&self, group: GroupId) -> Vec<u8> {
        let mut k = self.key(tag::GROUP, 4);
        k.extend_from_slice(&group.0.to_be_bytes());
        k
    }

    /// All group-owner records.
    pub fn groups(&self) -> KeyRange {
        self.range_tag(tag::GROUP)
    }

    /// `F<group>`: an allocation group's free map. Its encoding belongs to the data layer
    /// (`src/data/alloc.rs`); meta stores it as opaque bytes.
    pub fn free_map(&self, group: GroupId) -> Vec<u8> {
        let mut k = self.key(tag::FREE_MAP, 4);
        k.extend_from_slice(&group.0.to_be_bytes());
        k
    }

    /// All free maps.
    pub fn free_maps(&self) -> KeyRange {
        self.range_tag(tag::FREE_MAP)
    }

    /// `O<ino>`: an unlinked-but-open inode.
    pub fn orphan(&self, ino: Ino) -> Vec<u8> {
        self.key_u64(tag::ORPHAN, ino.0)
    }

    /// All orphan records.
    pub fn orphans(&self) -> KeyRange {
        self.range_tag(tag::ORPHAN)
    }

    /// `R<dev_off>`: a freed device range not yet in its group's free map.
    pub fn released(&self, dev_off: u64) -> Vec<u8> {
        self.key_u64(tag::RELEASED, dev_off)
    }

    /// Released records starting in device bytes `[from, to)`.
    pub fn released_between(&self, from: u64, to: u64) -> KeyRange {
        KeyRange {
            start: self.key_u64(tag::RELEASED, from),
            end: self.key_u64(tag::RELEASED, to),
        }
    }

    /// `W<session>`: that session is out of space in its groups and asks owners for some.
    pub fn space_wanted(&self, session: SessionId) -> Vec<u8> {
        self.key_u64(tag::SPACE_WANTED, session.0)
    }

    /// `V<session>`: an operator asked that session to give itself up (`etcfs evict`).
    pub fn evict(&self, session: SessionId) -> Vec<u8> {
        self.key_u64(tag::EVICT, session.0)
    }

    fn ino_session(&self, tag: u8, ino: Ino, session: SessionId) -> Vec<u8> {
        let mut k = self.key_u64(tag, ino.0);
        k.extend_from_slice(&session.0.to_be_bytes());
        k
    }

    /// `K<ino><session>`: that session holds the cache lock of `ino`.
    pub fn cache_lock(&self, ino: Ino, session: SessionId) -> Vec<u8> {
        self.ino_session(tag::CACHE_LOCK, ino, session)
    }

    /// Every holder of the cache lock of `ino`.
    pub fn cache_locks(&self, ino: Ino) -> KeyRange {
        self.range_u64(tag::CACHE_LOCK, ino.0)
    }

    /// `Q<ino><session>`: that session waits for the cache lock of `ino`.
    pub fn cache_want(&self, ino: Ino, session: SessionId) -> Vec<u8> {
        self.ino_session(tag::CACHE_WANT, ino, session)
    }

    /// `H<ino><session>`: `session` has `ino` open.
    pub fn held(&self, ino: Ino, session: SessionId) -> Vec<u8> {
        self.ino_session(tag::HELD, ino, session)
    }

    /// Every open record of `ino` (the sessions that have it open).
    pub fn holders(&self, ino: Ino) -> KeyRange {
        self.range_u64(tag::HELD, ino.0)
    }

    /// `T<session><seq>`: commit transaction `seq` of `session` (see the schema notes).
    pub fn txn_marker(&self, session: SessionId, seq: u64) -> Vec<u8> {
        let mut k = self.key_u64(tag::TXN_MARKER, session.0);
        k.extend_from_slice(&seq.to_be_bytes());
        k
    }

    /// The commit markers of `session` with sequence numbers in `[from, to)`.
    pub fn txn_markers_between(&self, session: SessionId, from: u64, to: u64) -> KeyRange {
        KeyRange {
            start: self.txn_marker(session, from),
            end: self.txn_marker(session, to),
        }
    }

    /// `B<ino><session><owner><class><start>`: one lock (see [`LockKey`]).
    pub fn lock(&self, l: &LockKey) -> Vec<u8> {
        let mut k = self.lock_holder_prefix(l.ino, l.session, l.owner, l.flock);
        k.extend_from_slice(&l.start.to_be_bytes());
        k
    }

    fn lock_holder_prefix(&self, ino: Ino, session: SessionId, owner: u64, flock: bool) -> Vec<u8> {
        let mut k = self.key(tag::LOCK, 33);
        k.extend_from_slice(&ino.0.to_be_bytes());
        k.extend_from_slice(&session.0.to_be_bytes());
        k.extend_from_slice(&owner.to_be_bytes());
        k.push(u8::from(flock));
        k
    }

    /// Every lock of `ino`, of every holder.
    pub fn locks(&self, ino: Ino) -> KeyRange {
        self.range_u64(tag::LOCK, ino.0)
    }

    /// The locks one holder has on `ino` of one class.
    pub fn locks_of(&self, ino: Ino, session: SessionId, owner: u64, flock: bool) -> KeyRange {
        let start = self.lock_holder_prefix(ino, session, owner, flock);
        KeyRange {
            end: prefix_end(&start),
            start,
        }
    }

    /// Decodes a key of this key space. `None` for foreign or malformed keys.
    pub fn parse(&self, key: &[u8]) -> Option<KeyKind> {
        let rest = key.strip_prefix(self.root.as_slice())?;
        let (&t, body) = rest.split_first()?;
        let u64_at = |b: &[u8]| -> Option<u64> { Some(u64::from_be_bytes(b.try_into().ok()?)) };
        Some(match t {
            tag::SUPER if body.is_empty() => KeyKind::Super,
            tag::COUNTER if body.is_empty() => KeyKind::InoCounter,
            tag::INODE => KeyKind::Inode(Ino(u64_at(body)?)),
            tag::DIR_PARENT => KeyKind::DirParent(Ino(u64_at(body)?)),
            tag::SYMLINK => KeyKind::Symlink(Ino(u64_at(body)?)),
            tag::ORPHAN => KeyKind::Orphan(Ino(u64_at(body)?)),
            tag::MEMBER => KeyKind::Member(SessionId(u64_at(body)?)),
            tag::RELEASED => KeyKind::Released(u64_at(body)?),
            tag::SPACE_WANTED => KeyKind::SpaceWanted(SessionId(u64_at(body)?)),
            tag::EVICT => KeyKind::Evict(SessionId(u64_at(body)?)),
            tag::DENTRY | tag::XATTR => {
                let (n, name) = (body.get(..8)?, body.get(8..)?);
                if name.is_empty() {
                    return None;
                }
                let n = Ino(u64_at(n)?);
                if t == tag::DENTRY {
                    KeyKind::Dentry(n, name.to_vec())
                } else {
                    KeyKind::Xattr(n, name.to_vec())
                }
            }
            tag::EXTENT => {
                let (i, o) = (body.get(..8)?, body.get(8..)?);
                KeyKind::Extent(Ino(u64_at(i)?), u64_at(o)?)
            }
            tag::CACHE_LOCK | tag::CACHE_WANT => {
                let (i, o) = (body.get(..8)?, body.get(8..)?);
                let (i, o) = (Ino(u64_at(i)?), SessionId(u64_at(o)?));
                if t == tag::CACHE_LOCK {
                    KeyKind::CacheLock(i, o)
                } else {
                    KeyKind::CacheWant(i, o)
                }
            }
            tag::HELD => {
                let (i, s) = (body.get(..8)?, body.get(8..)?);
                KeyKind::Held(Ino(u64_at(i)?), SessionId(u64_at(s)?))
            }
            tag::TXN_MARKER => {
                let (s, n) = (body.get(..8)?, body.get(8..)?);
                KeyKind::TxnMarker(SessionId(u64_at(s)?), u64_at(n)?)
            }
            tag::LOCK => {
                let (f, class, start) = (body.get(..24)?, body.get(24)?, body.get(25..)?);
                KeyKind::Lock(LockKey {
                    ino: Ino(u64_at(f.get(..8)?)?),
                    session: SessionId(u64_at(f.get(8..16)?)?),
                    owner: u64_at(f.get(16..)?)?,
                    flock: match *class {
                        0 => false,
                        1 => true,
                        _ => return None,
                    },
                    start: u64_at(start)?,
                })
            }
            tag::GROUP => KeyKind::Group(GroupId(u32::from_be_bytes(body.try_into().ok()?))),
            tag::FREE_MAP => KeyKind::FreeMap(GroupId(u32::from_be_bytes(body.try_into().ok()?))),
            _ => return None,
        })
    }

    /// A human-readable rendering of a key for logs and errors (`etcfs/I 42`,
    /// `etcfs/D 1 "name"`); unknown keys are escaped bytes.
    pub fn describe(&self, key: &[u8]) -> String {
        let p = String::from_utf8_lossy(&self.root);
        match self.parse(key) {
            Some(KeyKind::Super) => format!("{p}S"),
            Some(KeyKind::InoCounter) => format!("{p}C"),
            Some(KeyKind::Inode(i)) => format!("{p}I {i}"),
            Some(KeyKind::Dentry(i, n)) => format!("{p}D {i} {:?}", String::from_utf8_lossy(&n)),
            Some(KeyKind::DirParent(i)) => format!("{p}P {i}"),
            Some(KeyKind::Symlink(i)) => format!("{p}L {i}"),
            Some(KeyKind::Xattr(i, n)) => format!("{p}X {i} {:?}", String::from_utf8_lossy(&n)),
            Some(KeyKind::Extent(i, o)) => format!("{p}E {i} @{o}"),
            Some(KeyKind::Member(s)) => format!("{p}M {s}"),
            Some(KeyKind::Group(g)) => format!("{p}G {}", g.0),
            Some(KeyKind::FreeMap(g)) => format!("{p}F {}", g.0),
            Some(KeyKind::Orphan(i)) => format!("{p}O {i}"),
            Some(KeyKind::Released(o)) => format!("{p}R @{o}"),
            Some(KeyKind::SpaceWanted(s)) => format!("{p}W {s}"),
            Some(KeyKind::Evict(s)) => format!("{p}V {s}"),
            Some(KeyKind::TxnMarker(s, n)) => format!("{p}T {s} {n}"),
            Some(KeyKind::CacheLock(i, s)) => format!("{p}K {i} {s}"),
            Some(KeyKind::CacheWant(i, s)) => format!("{p}Q {i} {s}"),
            Some(KeyKind::Held(i, s)) => format!("{p}H {i} by {s}"),
            Some(KeyKind::Lock(l)) => format!(
                "{p}B {} {} {:#x} {} @{}",
                l.ino,
                l.session,
                l.owner,
                if l.flock { "flock" } else { "posix" },
                l.start
            ),
            None => escape(key),
        }
    }
}

/// The smallest key greater than every key starting with `prefix` (etcd's "prefix end").
/// An all-0xff prefix has no end; etcd spells that "\0" (every key from start on).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The readdir cookie (FUSE offset) of the entry named `name`: a stable 63-bit FNV-1a
/// hash, never 0 (start), 1 (".") or 2 (".."). See the module docs for how resumption
/// works; the hash is part of the format because cookies outlive a daemon restart in
/// NFS-style consumers.
pub fn dir_cookie(name: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in name {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let h = h >> 1;
    if h < 3 {
        h + 3
    } else {
        h
    }
}

fn escape(key: &[u8]) -> String {
    let mut s = String::with_capacity(key.len());
    for &b in key {
        if b.is_ascii_graphic() {
            s.push(char::from(b));
        } else {
            let _ = write!(s, "\\x{b:02x}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ks() -> Keyspace {
        Keyspace::new("etcfs").expect("valid prefix")
    }

    #[test]
    fn prefix_validation() {
        assert!(Keyspace::new("").is_err());
        assert!(Keyspace::new("a/b").is_err());
        assert!(Keyspace::new(&"x".repeat(65)).is_err());
        assert!(Keyspace::new("fs-1.test_x").is_ok());
    }

    #[test]
    fn round_trip_every_kind() {
        let k = ks();
        let cases = vec![
            (k.superblock(), KeyKind::Super),
            (k.ino_counter(), KeyKind::InoCounter),
            (k.inode(Ino(7)), KeyKind::Inode(Ino(7))),
            (
                k.dentry(Ino(1), b"a\xffb"),
                KeyKind::Dentry(Ino(1), b"a\xffb".to_vec()),
            ),
            (k.dir_parent(Ino(9)), KeyKind::DirParent(Ino(9))),
            (k.symlink(Ino(3)), KeyKind::Symlink(Ino(3))),
            (
                k.xattr(Ino(3), b"user.x"),
                KeyKind::Xattr(Ino(3), b"user.x".to_vec()),
            ),
            (k.extent(Ino(3), 4096), KeyKind::Extent(Ino(3), 4096)),
            (k.member(SessionId(5)), KeyKind::Member(SessionId(5))),
            (k.group(GroupId(2)), KeyKind::Group(GroupId(2))),
            (k.free_map(GroupId(3)), KeyKind::FreeMap(GroupId(3))),
            (k.orphan(Ino(4)), KeyKind::Orphan(Ino(4))),
            (
                k.space_wanted(SessionId(6)),
                KeyKind::SpaceWanted(SessionId(6)),
            ),
            (k.evict(SessionId(6)), KeyKind::Evict(SessionId(6))),
            (
                k.txn_marker(SessionId(6), 9),
                KeyKind::TxnMarker(SessionId(6), 9),
            ),
            (
                k.cache_lock(Ino(7), SessionId(8)),
                KeyKind::CacheLock(Ino(7), SessionId(8)),
            ),
            (
                k.cache_want(Ino(7), SessionId(8)),
                KeyKind::CacheWant(Ino(7), SessionId(8)),
            ),
            (
                k.held(Ino(4), SessionId(6)),
                KeyKind::Held(Ino(4), SessionId(6)),
            ),
            (k.lock(&LOCK), KeyKind::Lock(LOCK)),
        ];
        for (key, kind) in cases {
            assert_eq!(k.parse(&key), Some(kind), "{}", k.describe(&key));
        }
        assert_eq!(k.parse(b"other/I12345678"), None);
        assert_eq!(k.parse(b"etcfs/I123"), None);
        assert_eq!(k.parse(b"etcfs/Z"), None);
        assert_eq!(k.describe(&k.dentry(Ino(1), b"x")), "etcfs/D 1 \"x\"");
    }

    #[test]
    fn dentries_range_covers_exactly_one_dir_in_name_order() {
        let k = ks();
        let r = k.dentries(Ino(256));
        let inside = [k.dentry(Ino(256), b"a"), k.dentry(Ino(256), b"\xff\xff")];
        for key in &inside {
            assert!(r.start <= *key && *key < r.end);
        }
        for other in [
            k.dentry(Ino(255), b"z"),
            k.dentry(Ino(257), b"a"),
            k.inode(Ino(256)),
        ] {
            assert!(!(r.start <= other && other < r.end));
        }
        assert!(k.dentry(Ino(256), b"a") < k.dentry(Ino(256), b"ab"));
        assert!(k.dentry(Ino(256), b"ab") < k.dentry(Ino(256), b"b"));
        let after = k.dentries_after(Ino(256), b"a");
        assert!(after.start > k.dentry(Ino(256), b"a"));
        assert!(after.start <= k.dentry(Ino(256), b"a\x01"));
    }

    const LOCK: LockKey = LockKey {
        ino: Ino(9),
        session: SessionId(0x7f00_0000_0000_0001),
        owner: u64::MAX,
        flock: true,
        start: 100,
    };

    #[test]
    fn lock_ranges_nest_file_then_holder() {
        let k = ks();
        let inside = |r: &KeyRange, key: &[u8]| r.start.as_slice() <= key && key < r.end.as_slice();
        let all = k.locks(Ino(9));
        let mine = k.locks_of(Ino(9), LOCK.session, LOCK.owner, true);
        assert!(inside(&all, &k.lock(&LOCK)) && inside(&mine, &k.lock(&LOCK)));
        let posix = LockKey {
            flock: false,
            ..LOCK
        };
        assert!(inside(&all, &k.lock(&posix)) && !inside(&mine, &k.lock(&posix)));
        let other_file = LockKey {
            ino: Ino(10),
            ..LOCK
        };
        assert!(!inside(&all, &k.lock(&other_file)));
        assert!(k.lock(&LockKey { start: 2, ..LOCK }) < k.lock(&LockKey { start: 256, ..LOCK }));
        let mut bad = k.lock(&LOCK);
        bad[k.root().len() + 25] = 2;
        assert_eq!(k.parse(&bad), None);
        bad.pop();
        assert_eq!(k.parse(&bad), None);
    }

    #[test]
    fn extents_sort_numerically() {
        let k = ks();
        assert!(k.extent(Ino(1), 4096) < k.extent(Ino(1), 65536));
        assert!(k.extent(Ino(1), u64::MAX) < k.extent(Ino(2), 0));
        let r = k.extents_between(Ino(1), 10, 20);
        assert!(r.start <= k.extent(Ino(1), 10) && k.extent(Ino(1), 19) < r.end);
        assert!(k.extent(Ino(1), 20) >= r.end);
    }

    #[test]
    fn holders_range_covers_exactly_one_inode() {
        let k = ks();
        let r = k.holders(Ino(7));
        for s in [0, 1, u64::MAX] {
            let key = k.held(Ino(7), SessionId(s));
            assert!(r.start <= key && key < r.end);
        }
        for other in [
            k.held(Ino(6), SessionId(u64::MAX)),
            k.held(Ino(8), SessionId(0)),
        ] {
            assert!(!(r.start <= other && other < r.end));
        }
    }

    #[test]
    fn prefixes_do_not_overlap() {
        let a = Keyspace::new("a").expect("valid");
        let ab = Keyspace::new("ab").expect("valid");
        let r = a.all();
        assert!(!(r.start <= ab.inode(Ino(1)) && ab.inode(Ino(1)) < r.end));
    }

    #[test]
    fn prefix_end_cases() {
        assert_eq!(prefix_end(b"ab"), b"ac".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }

    #[test]
    fn cookie_is_stable_and_avoids_reserved() {
        assert_eq!(dir_cookie(b"hello"), dir_cookie(b"hello"));
        assert_ne!(dir_cookie(b"hello"), dir_cookie(b"hellp"));
        for n in 0..1000u32 {
            let c = dir_cookie(n.to_string().as_bytes());
            assert!((3..(1 << 63)).contains(&c));
        }
    }
}
