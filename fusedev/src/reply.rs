//! Reply encoding into a caller-provided buffer.
//!
//! A handler writes only the reply *arguments*; the transport adds the [`OutHeader`] (in
//! front of the arguments for `/dev/fuse`, in the ring's header buffer for
//! FUSE-over-io_uring). Every writer returns the number of bytes written, or `None` when
//! the buffer is too small, and never writes past what it reports.

#![forbid(unsafe_code)]
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

use std::time::Duration;

use zerocopy::{Immutable, IntoBytes};

use crate::{
    abi::{
        dirent_record_len, Attr, AttrOut, CopyFileRangeOut, Dirent, Direntplus, EntryOut,
        GetxattrOut, InitOut, Kstatfs, LseekOut, OpenOut, OutHeader, StatfsOut, WriteOut,
    },
    errno::Errno,
};

/// Copies `v`'s bytes to the start of `out`.
pub fn put<T: IntoBytes + Immutable>(out: &mut [u8], v: &T) -> Option<usize> {
    put_bytes(out, v.as_bytes())
}

/// Copies `data` to the start of `out` (READ data, READLINK target, xattr values).
pub fn put_bytes(out: &mut [u8], data: &[u8]) -> Option<usize> {
    out.get_mut(..data.len())?.copy_from_slice(data);
    Some(data.len())
}

/// Reply to LOOKUP, MKNOD, MKDIR, SYMLINK, LINK.
pub fn entry(out: &mut [u8], e: &EntryOut) -> Option<usize> {
    put(out, e)
}

/// Reply to GETATTR and SETATTR.
pub fn attr(out: &mut [u8], a: &AttrOut) -> Option<usize> {
    put(out, a)
}

/// Reply to OPEN and OPENDIR.
pub fn open(out: &mut [u8], o: &OpenOut) -> Option<usize> {
    put(out, o)
}

/// Reply to CREATE and TMPFILE: the entry, then the open file.
pub fn create(out: &mut [u8], e: &EntryOut, o: &OpenOut) -> Option<usize> {
    let n = put(out, e)?;
    let m = put(out.get_mut(n..)?, o)?;
    Some(n + m)
}

/// Reply to WRITE: how many bytes were written.
pub fn write(out: &mut [u8], size: u32) -> Option<usize> {
    put(out, &WriteOut { size, padding: 0 })
}

/// Reply to STATFS.
pub fn statfs(out: &mut [u8], st: &Kstatfs) -> Option<usize> {
    put(out, &StatfsOut { st: *st })
}

/// Reply to a GETXATTR or LISTXATTR with `size == 0`: the size a full reply needs.
pub fn xattr_size(out: &mut [u8], size: u32) -> Option<usize> {
    put(out, &GetxattrOut { size, padding: 0 })
}

/// Reply to LSEEK.
pub fn lseek(out: &mut [u8], offset: u64) -> Option<usize> {
    put(out, &LseekOut { offset })
}

/// Reply to INIT.
pub fn init(out: &mut [u8], i: &InitOut) -> Option<usize> {
    put(out, i)
}

/// Reply to COPY_FILE_RANGE (`reply64 == false`: a u32 count, saturated) or
/// COPY_FILE_RANGE_64.
pub fn copy_file_range(out: &mut [u8], copied: u64, reply64: bool) -> Option<usize> {
    if reply64 {
        put(
            out,
            &CopyFileRangeOut {
                bytes_copied: copied,
            },
        )
    } else {
        write(out, u32::try_from(copied).unwrap_or(u32::MAX))
    }
}

/// A cache timeout as the (seconds, nanoseconds) pair the wire wants.
pub fn timeout(d: Duration) -> (u64, u32) {
    (d.as_secs(), d.subsec_nanos())
}

impl EntryOut {
    /// An entry for `attr.ino` with the given cache timeouts.
    pub fn new(generation: u64, entry_valid: Duration, attr_valid: Duration, attr: Attr) -> Self {
        let (entry_s, entry_ns) = timeout(entry_valid);
        let (attr_s, attr_ns) = timeout(attr_valid);
        EntryOut {
            nodeid: attr.ino,
            generation,
            entry_valid: entry_s,
            attr_valid: attr_s,
            entry_valid_nsec: entry_ns,
            attr_valid_nsec: attr_ns,
            attr,
        }
    }

    /// A LOOKUP reply saying "no such name" that the kernel may cache for `entry_valid`.
    pub fn negative(entry_valid: Duration) -> Self {
        let (s, ns) = timeout(entry_valid);
        EntryOut {
            entry_valid: s,
            entry_valid_nsec: ns,
            ..EntryOut::default()
        }
    }
}

impl AttrOut {
    pub fn new(attr_valid: Duration, attr: Attr) -> Self {
        let (s, ns) = timeout(attr_valid);
        AttrOut {
            attr_valid: s,
            attr_valid_nsec: ns,
            dummy: 0,
            attr,
        }
    }
}

/// The `DT_*` value for a dirent from an `st_mode`.
pub const fn dirent_type(mode: u32) -> u32 {
    (mode & libc::S_IFMT) >> 12
}

/// Bytes a READDIR record with a name of `namelen` bytes takes.
pub const fn dirent_len(namelen: usize) -> usize {
    dirent_record_len(size_of::<Dirent>(), namelen)
}

/// Bytes a READDIRPLUS record with a name of `namelen` bytes takes.
pub const fn direntplus_len(namelen: usize) -> usize {
    dirent_record_len(size_of::<Direntplus>(), namelen)
}

/// Appends READDIR or READDIRPLUS records to a reply buffer, 8-byte aligned, never past
/// the size the kernel asked for. Don't mix the two kinds in one reply.
pub struct DirentWriter<'a> {
    buf: &'a mut [u8],
    /// `min(buf.len(), requested size)`.
    limit: usize,
    len: usize,
}

impl<'a> DirentWriter<'a> {
    /// `size` is the READDIR request's `size`; the reply may not exceed it.
    pub fn new(buf: &'a mut [u8], size: usize) -> Self {
        let limit = buf.len().min(size);
        DirentWriter { buf, limit, len: 0 }
    }

    /// Whether a READDIR record with a `namelen`-byte name still fits.
    pub fn fits(&self, namelen: usize) -> bool {
        self.len + dirent_len(namelen) <= self.limit
    }

    /// Whether a READDIRPLUS record with a `namelen`-byte name still fits. Check this
    /// before taking the lookup reference the record hands to the kernel.
    pub fn fits_plus(&self, namelen: usize) -> bool {
        self.len + direntplus_len(namelen) <= self.limit
    }

    /// Appends a READDIR record; `false` (and nothing written) if it does not fit.
    /// `off` is the offset that continues the listing after this entry.
    pub fn push(&mut self, ino: u64, off: u64, typ: u32, name: &[u8]) -> bool {
        let Ok(namelen) = u32::try_from(name.len()) else {
            return false;
        };
        let head = Dirent {
            ino,
            off,
            namelen,
            typ,
        };
        self.append(head.as_bytes(), name, dirent_len(name.len()))
    }

    /// Appends a READDIRPLUS record; `false` (and nothing written) if it does not fit.
    /// `ino` is the dirent's inode number, which for "." and ".." differs from
    /// `entry.nodeid` (0 there: the kernel ignores their entry part).
    pub fn push_plus(
        &mut self,
        entry: &EntryOut,
        ino: u64,
        off: u64,
        typ: u32,
        name: &[u8],
    ) -> bool {
        let Ok(namelen) = u32::try_from(name.len()) else {
            return false;
        };
        let head = Direntplus {
            entry_out: *entry,
            dirent: Dirent {
                ino,
                off,
                namelen,
                typ,
            },
        };
        self.append(head.as_bytes(), name, direntplus_len(name.len()))
    }

    fn append(&mut self, head: &[u8], name: &[u8], record_len: usize) -> bool {
        let end = self.len + record_len;
        if end > self.limit {
            return false;
        }
        let Some(record) = self.buf.get_mut(self.len..end) else {
            return false;
        };
        let (fixed, tail) = record.split_at_mut(head.len().min(record_len));
        fixed.copy_from_slice(head);
        let (name_dst, padding) = tail.split_at_mut(name.len().min(tail.len()));
        name_dst.copy_from_slice(name);
        padding.fill(0);
        self.len = end;
        true
    }

    /// Bytes still free in the reply.
    pub fn room(&self) -> usize {
        self.limit - self.len
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The reply length.
    pub fn finish(self) -> usize {
        self.len
    }
}

/// The out header for a reply with `args_len` bytes of arguments. `error` is 0, a negated
/// errno (`Errno::wire`), or for a notification (`unique == 0`) its code.
pub fn out_header(unique: u64, error: i32, args_len: usize) -> OutHeader {
    let len = size_of::<OutHeader>().saturating_add(args_len);
    OutHeader {
        len: u32::try_from(len).unwrap_or(u32::MAX),
        error,
        unique,
    }
}

/// A whole `/dev/fuse` reply in `dst` (its previous contents are replaced): the out
/// header, then the arguments on success or nothing on error. For tests and in-memory
/// transports.
pub fn encode_reply(unique: u64, result: Result<&[u8], Errno>, dst: &mut Vec<u8>) {
    dst.clear();
    match result {
        Ok(args) => {
            dst.extend_from_slice(out_header(unique, 0, args.len()).as_bytes());
            dst.extend_from_slice(args);
        }
        Err(e) => dst.extend_from_slice(out_header(unique, e.wire(), 0).as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

    use super::*;

    #[test]
    fn put_refuses_short_buffers() {
        let mut out = [0xffu8; 7];
        assert_eq!(write(&mut out, 5), None);
        assert_eq!(out, [0xff; 7]);
        let mut out = [0u8; 8];
        assert_eq!(write(&mut out, 5), Some(8));
        assert_eq!(out, [5, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn create_reply_is_entry_then_open() {
        let mut out = [0u8; 200];
        let e = EntryOut::new(
            1,
            Duration::from_secs(1),
            Duration::from_secs(1),
            Attr {
                ino: 9,
                ..Attr::default()
            },
        );
        let o = OpenOut {
            fh: 3,
            open_flags: 0,
            backing_id: 0,
        };
        assert_eq!(create(&mut out, &e, &o), Some(144));
        assert_eq!(&out[128..136], &3u64.to_ne_bytes());
        assert_eq!(create(&mut [0u8; 143], &e, &o), None);
    }

    #[test]
    fn dirent_writer_respects_size_and_pads() {
        let mut buf = [0xaau8; 100];
        let mut w = DirentWriter::new(&mut buf, 100);
        assert!(w.push(5, 1, 4, b"."));
        assert!(w.push(6, 2, 8, b"abcdefghi"));
        assert_eq!(w.len(), 32 + 40);
        assert!(w.fits(0) && !w.fits(1));
        // Two 32-byte records fill 64; a third would pass the requested size.
        let mut w = DirentWriter::new(&mut buf, 64);
        assert!(w.push(5, 1, 4, b"."));
        assert!(w.push(6, 2, 8, b".."));
        assert!(!w.push(7, 3, 8, b"x"));
        assert_eq!(w.finish(), 64);
        assert_eq!(&buf[24..32], &[b'.', 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&buf[56..64], &[b'.', b'.', 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn direntplus_records() {
        let mut buf = vec![0u8; 4096];
        let mut w = DirentWriter::new(&mut buf, 4096);
        assert!(w.fits_plus(3));
        assert!(w.push_plus(&EntryOut::default(), 1, 1, 4, b"abc"));
        assert_eq!(w.len(), 160);
        assert_eq!(&buf[152..155], b"abc");
    }

    #[test]
    fn out_header_and_encode_reply() {
        let h = out_header(9, 0, 104);
        assert_eq!((h.len, h.error, h.unique), (120, 0, 9));
        let mut v = vec![1, 2, 3];
        encode_reply(9, Err(Errno::ENOENT), &mut v);
        assert_eq!(v.len(), 16);
        assert_eq!(&v[4..8], &(-libc::ENOENT).to_ne_bytes());
        encode_reply(9, Ok(&[7; 8]), &mut v);
        assert_eq!(v.len(), 24);
        assert_eq!(&v[0..4], &24u32.to_ne_bytes());
    }
}
