//! Golden-byte tests of the codec: every byte array below is written out by hand from the
//! kernel's struct layouts (x86-64, little-endian), never produced by the encoder, so an
//! encoder and decoder that agree with each other but not with the kernel still fail.

use std::time::Duration;

use fusedev::{
    abi::{self, Attr, AttrOut, IntoBytes},
    errno::Errno,
    init::{self, InitConfig},
    notify,
    reply::{self, DirentWriter},
    request::{self, arg0_len, decode, decode_parts, DecodeError, KernelInit, Operation},
};

/// LOOKUP of "foo" in the root: no fixed argument, just the name.
const LOOKUP: [u8; 44] = [
    0x2c, 0, 0, 0, 0x01, 0, 0, 0, // len 44, opcode 1 (LOOKUP)
    0x10, 0, 0, 0, 0, 0, 0, 0, // unique 0x10
    0x01, 0, 0, 0, 0, 0, 0, 0, // nodeid 1
    0xe8, 0x03, 0, 0, 0x64, 0, 0, 0, // uid 1000, gid 100
    0x34, 0x12, 0, 0, 0, 0, 0, 0, // pid 0x1234, total_extlen 0, padding
    b'f', b'o', b'o', 0, // name
];

/// WRITE of "hello" at offset 4096 of fh 7.
const WRITE: [u8; 85] = [
    0x55, 0, 0, 0, 0x10, 0, 0, 0, // len 85, opcode 16 (WRITE)
    0x22, 0, 0, 0, 0, 0, 0, 0, // unique 0x22
    0x05, 0, 0, 0, 0, 0, 0, 0, // nodeid 5
    0xe8, 0x03, 0, 0, 0x64, 0, 0, 0, // uid 1000, gid 100
    0x34, 0x12, 0, 0, 0, 0, 0, 0, // pid, total_extlen 0, padding
    0x07, 0, 0, 0, 0, 0, 0, 0, // fh 7
    0x00, 0x10, 0, 0, 0, 0, 0, 0, // offset 4096
    0x05, 0, 0, 0, 0x04, 0, 0, 0, // size 5, write_flags 4 (KILL_SUIDGID)
    0, 0, 0, 0, 0, 0, 0, 0, // lock_owner 0
    0x02, 0x04, 0, 0, 0, 0, 0, 0, // flags O_RDWR|O_APPEND (0x402), padding
    b'h', b'e', b'l', b'l', b'o', // data
];

/// INIT from a 7.45 kernel offering ASYNC_READ, BIG_WRITES, WRITEBACK_CACHE, MAX_PAGES,
/// INIT_EXT and, in flags2, HAS_EXPIRE_ONLY and OVER_IO_URING.
const INIT: [u8; 104] = [
    0x68, 0, 0, 0, 0x1a, 0, 0, 0, // len 104, opcode 26 (INIT)
    0x01, 0, 0, 0, 0, 0, 0, 0, // unique 1
    0, 0, 0, 0, 0, 0, 0, 0, // nodeid 0
    0, 0, 0, 0, 0, 0, 0, 0, // uid 0, gid 0
    0, 0, 0, 0, 0, 0, 0, 0, // pid 0, total_extlen 0, padding
    0x07, 0, 0, 0, 0x2d, 0, 0, 0, // major 7, minor 45
    0, 0, 0x02, 0, // max_readahead 128 KiB
    0x21, 0, 0x41, 0x40, // flags 0x4041_0021
    0x08, 0x02, 0, 0, // flags2 0x208: HAS_EXPIRE_ONLY (35), OVER_IO_URING (41)
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // unused[11]
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, //
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, //
    0, 0, 0, 0, 0, 0, 0, 0, //
];

/// The INIT reply body for `init_config()`: what we asked for is what the kernel offered
/// minus WRITEBACK_CACHE (refused).
const INIT_OUT: [u8; 64] = [
    0x07, 0, 0, 0, 0x2d, 0, 0, 0, // major 7, minor 45
    0, 0, 0x02, 0, // max_readahead: the kernel's
    0x21, 0, 0x40, 0x40, // flags 0x4040_0021: ASYNC_READ|BIG_WRITES|MAX_PAGES|INIT_EXT
    0x40, 0, 0x30, 0, // max_background 64, congestion_threshold 48
    0, 0, 0x10, 0, // max_write 1 MiB
    0x01, 0, 0, 0, // time_gran 1 ns
    0, 0x01, 0, 0, // max_pages 256, map_alignment 0
    0x08, 0x02, 0, 0, // flags2 0x208
    0, 0, 0, 0, // max_stack_depth 0
    0, 0, // request_timeout 0
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // unused[11]
];

fn init_config() -> InitConfig {
    InitConfig {
        max_write: 1 << 20,
        max_pages: 256,
        over_io_uring: true,
        splice_write: false,
        locks: false,
        acls: false,
        max_background: 64,
        congestion_threshold: 48,
        time_gran: 1,
    }
}

#[test]
fn lookup_decodes() {
    let req = decode(&LOOKUP).unwrap();
    assert_eq!(req.op, Operation::Lookup { name: b"foo" });
    assert_eq!((req.unique(), req.nodeid()), (0x10, 1));
    assert_eq!(
        (req.header.uid, req.header.gid, req.header.pid),
        (1000, 100, 0x1234)
    );
    assert_eq!(req.opcode_name(), "LOOKUP");
    assert_eq!(arg0_len(1), 0);
    // The ring form: header in one buffer, no op_in, the name in the payload.
    let parts = decode_parts(&LOOKUP[..40], &[], &LOOKUP[40..]).unwrap();
    assert_eq!(parts, req);
    // A ring header buffer longer than the in header is fine.
    let mut ring_header = [0u8; 128];
    ring_header[..40].copy_from_slice(&LOOKUP[..40]);
    assert_eq!(
        decode_parts(&ring_header, &[0; 128], &LOOKUP[40..])
            .unwrap()
            .op,
        req.op
    );
}

#[test]
fn write_decodes_borrowing_data() {
    let req = decode(&WRITE).unwrap();
    let Operation::Write {
        fh,
        offset,
        data,
        write_flags,
        flags,
    } = req.op
    else {
        panic!("not a write: {:?}", req.op);
    };
    assert_eq!(
        (fh, offset, write_flags, flags),
        (7, 4096, abi::FUSE_WRITE_KILL_SUIDGID, 0x402)
    );
    assert_eq!(data, b"hello");
    assert!(
        std::ptr::eq(data.as_ptr(), WRITE[80..].as_ptr()),
        "data is borrowed, not copied"
    );
    assert_eq!(arg0_len(16), 40);
    let parts = decode_parts(&WRITE[..40], &WRITE[40..80], &WRITE[80..]).unwrap();
    assert_eq!(parts.op, req.op);
}

#[test]
fn init_decodes_and_reply_bytes() {
    let req = decode(&INIT).unwrap();
    let expected_flags = 0x4041_0021 | (0x208 << 32);
    let Operation::Init(kernel) = req.op else {
        panic!("not INIT")
    };
    assert_eq!(
        kernel,
        KernelInit {
            major: 7,
            minor: 45,
            max_readahead: 128 << 10,
            flags: expected_flags
        }
    );
    assert!(init::kernel_offers_uring(&kernel));

    let (out, negotiated) = init::negotiate(&kernel, &init_config()).unwrap();
    assert_eq!(out.as_bytes(), &INIT_OUT[..]);
    assert!(negotiated.over_io_uring);
    assert_eq!(negotiated.flags, 0x4040_0021 | (0x208 << 32));
    assert_eq!(negotiated.kernel_flags, expected_flags);
    assert_eq!(negotiated.payload_max(), 1 << 20);

    // The whole /dev/fuse reply: out header (len 80, error 0, unique 1), then the body.
    let mut msg = Vec::new();
    reply::encode_reply(1, Ok(out.as_bytes()), &mut msg);
    assert_eq!(
        &msg[..16],
        &[0x50, 0, 0, 0, 0, 0, 0, 0, 0x01, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(&msg[16..], &INIT_OUT[..]);
}

#[test]
fn init_from_an_older_kernel_has_no_flags2() {
    // 7.31 sends the 16-byte fuse_init_in; flags2 bits can't be offered.
    let msg: [u8; 56] = [
        0x38, 0, 0, 0, 0x1a, 0, 0, 0, // len 56, INIT
        0x01, 0, 0, 0, 0, 0, 0, 0, // unique 1
        0, 0, 0, 0, 0, 0, 0, 0, // nodeid
        0, 0, 0, 0, 0, 0, 0, 0, // uid, gid
        0, 0, 0, 0, 0, 0, 0, 0, // pid, extlen, padding
        0x07, 0, 0, 0, 0x1f, 0, 0, 0, // major 7, minor 31
        0, 0, 0x02, 0, 0x01, 0, 0, 0x40, // max_readahead, flags ASYNC_READ|INIT_EXT
    ];
    let Operation::Init(k) = decode(&msg).unwrap().op else {
        panic!("not INIT")
    };
    assert_eq!((k.minor, k.flags), (31, 0x4000_0001));
    let mut short = msg;
    short[0] = 0x37;
    assert_eq!(
        decode(&short[..55]).unwrap_err(),
        DecodeError::Truncated {
            opcode: 26,
            what: "fixed argument",
            need: 16,
            got: 15
        }
    );
}

#[test]
fn getattr_reply_encodes() {
    #[rustfmt::skip]
    let expected: [u8; 104] = [
        0x01, 0, 0, 0, 0, 0, 0, 0, // attr_valid 1 s
        0x00, 0x65, 0xcd, 0x1d, 0, 0, 0, 0, // attr_valid_nsec 500_000_000, dummy
        0x02, 0, 0, 0, 0, 0, 0, 0, // ino 2
        0x05, 0, 0, 0, 0, 0, 0, 0, // size 5
        0x01, 0, 0, 0, 0, 0, 0, 0, // blocks 1
        0x00, 0, 0, 0x60, 0, 0, 0, 0, // atime 0x6000_0000
        0x01, 0, 0, 0x60, 0, 0, 0, 0, // mtime
        0x02, 0, 0, 0x60, 0, 0, 0, 0, // ctime
        0x01, 0, 0, 0, 0x02, 0, 0, 0, // atimensec 1, mtimensec 2
        0x03, 0, 0, 0, 0xa4, 0x81, 0, 0, // ctimensec 3, mode 0o100644
        0x01, 0, 0, 0, 0xe8, 0x03, 0, 0, // nlink 1, uid 1000
        0x64, 0, 0, 0, 0, 0, 0, 0, // gid 100, rdev 0
        0x00, 0x10, 0, 0, 0, 0, 0, 0, // blksize 4096, flags 0
    ];
    let attr = Attr {
        ino: 2,
        size: 5,
        blocks: 1,
        atime: 0x6000_0000,
        mtime: 0x6000_0001,
        ctime: 0x6000_0002,
        atimensec: 1,
        mtimensec: 2,
        ctimensec: 3,
        mode: 0o100_644,
        nlink: 1,
        uid: 1000,
        gid: 100,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    };
    let mut out = [0xffu8; 200];
    let n = reply::attr(&mut out, &AttrOut::new(Duration::from_millis(1500), attr)).unwrap();
    assert_eq!(&out[..n], &expected[..]);
    assert_eq!(reply::attr(&mut [0u8; 103], &AttrOut::default()), None);
}

#[test]
fn readdir_buffer_with_two_entries() {
    #[rustfmt::skip]
    let expected: [u8; 72] = [
        0x01, 0, 0, 0, 0, 0, 0, 0, // ino 1
        0x01, 0, 0, 0, 0, 0, 0, 0, // off 1
        0x01, 0, 0, 0, 0x04, 0, 0, 0, // namelen 1, type DT_DIR
        b'.', 0, 0, 0, 0, 0, 0, 0, // name, zero padding to 8
        0x0a, 0, 0, 0, 0, 0, 0, 0, // ino 10
        0x03, 0, 0, 0, 0, 0, 0, 0, // off 3
        0x09, 0, 0, 0, 0x08, 0, 0, 0, // namelen 9, type DT_REG
        b'h', b'e', b'l', b'l', b'o', b'.', b't', b'x', // name
        b't', 0, 0, 0, 0, 0, 0, 0, // name end, zero padding
    ];
    let mut buf = [0xaau8; 4096];
    let mut w = DirentWriter::new(&mut buf, 4096);
    assert!(w.push(1, 1, reply::dirent_type(libc::S_IFDIR), b"."));
    assert!(w.push(10, 3, reply::dirent_type(libc::S_IFREG), b"hello.txt"));
    let n = w.finish();
    assert_eq!(&buf[..n], &expected[..]);
    // The same two records do not fit in 71 bytes: only the first is written.
    let mut w = DirentWriter::new(&mut buf, 71);
    assert!(w.push(1, 1, 4, b"."));
    assert!(!w.push(10, 3, 8, b"hello.txt"));
    assert_eq!(w.finish(), 32);
}

#[test]
fn inval_entry_and_delete_notifications() {
    #[rustfmt::skip]
    let inval: [u8; 35] = [
        0x23, 0, 0, 0, 0x03, 0, 0, 0, // len 35, error = FUSE_NOTIFY_INVAL_ENTRY
        0, 0, 0, 0, 0, 0, 0, 0, // unique 0
        0x01, 0, 0, 0, 0, 0, 0, 0, // parent 1
        0x02, 0, 0, 0, 0, 0, 0, 0, // namelen 2, flags 0
        b'a', b'b', 0, // name, NUL
    ];
    assert_eq!(notify::inval_entry(1, b"ab").unwrap(), inval);

    #[rustfmt::skip]
    let delete: [u8; 44] = [
        0x2c, 0, 0, 0, 0x06, 0, 0, 0, // len 44, error = FUSE_NOTIFY_DELETE
        0, 0, 0, 0, 0, 0, 0, 0, // unique 0
        0x01, 0, 0, 0, 0, 0, 0, 0, // parent 1
        0x2a, 0, 0, 0, 0, 0, 0, 0, // child 42
        0x03, 0, 0, 0, 0, 0, 0, 0, // namelen 3, padding
        b'x', b'y', b'z', 0, // name, NUL
    ];
    assert_eq!(notify::delete(1, 42, b"xyz").unwrap(), delete);

    #[rustfmt::skip]
    let inval_inode: [u8; 40] = [
        0x28, 0, 0, 0, 0x02, 0, 0, 0, // len 40, error = FUSE_NOTIFY_INVAL_INODE
        0, 0, 0, 0, 0, 0, 0, 0, // unique 0
        0x07, 0, 0, 0, 0, 0, 0, 0, // ino 7
        0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, // off -1: attributes only
        0, 0, 0, 0, 0, 0, 0, 0, // len 0
    ];
    assert_eq!(notify::inval_inode(7, -1, 0), inval_inode);
    assert!(notify::inval_entry(1, &[b'n'; 256]).is_err());
}

#[test]
fn malformed_messages_are_errors() {
    // The WRITE above with its last two data bytes cut off (header len adjusted).
    let mut cut = WRITE[..83].to_vec();
    cut[0] = 83;
    assert_eq!(
        decode(&cut).unwrap_err(),
        DecodeError::Truncated {
            opcode: 16,
            what: "write data",
            need: 5,
            got: 3
        }
    );
    // Header length disagreeing with the buffer.
    assert_eq!(
        decode(&WRITE[..84]).unwrap_err(),
        DecodeError::LengthMismatch {
            header: 85,
            got: 84
        }
    );
    // Shorter than a header.
    assert_eq!(
        decode(&LOOKUP[..39]).unwrap_err(),
        DecodeError::ShortHeader { got: 39 }
    );
    // A name without its NUL.
    let mut no_nul = LOOKUP;
    no_nul[43] = b'!';
    assert_eq!(
        decode(&no_nul).unwrap_err(),
        DecodeError::MissingNul {
            opcode: 1,
            what: "name"
        }
    );
    // A WRITE whose fixed argument is cut short.
    let mut short = WRITE[..60].to_vec();
    short[0] = 60;
    assert_eq!(
        decode(&short).unwrap_err(),
        DecodeError::Truncated {
            opcode: 16,
            what: "fixed argument",
            need: 40,
            got: 20
        }
    );
    // An unknown opcode is not an error: the filesystem answers ENOSYS.
    let mut unknown = LOOKUP;
    unknown[4] = 0xc8; // opcode 200
    assert_eq!(
        decode(&unknown).unwrap().op,
        Operation::Unknown { opcode: 200 }
    );
}

/// CREATE of "f" carrying a supplementary-groups extension (16 bytes, total_extlen 2).
const CREATE_WITH_EXT: [u8; 74] = [
    0x4a, 0, 0, 0, 0x23, 0, 0, 0, // len 74, opcode 35 (CREATE)
    0x03, 0, 0, 0, 0, 0, 0, 0, // unique 3
    0x01, 0, 0, 0, 0, 0, 0, 0, // nodeid 1
    0xe8, 0x03, 0, 0, 0x64, 0, 0, 0, // uid 1000, gid 100
    0x01, 0, 0, 0, 0x02, 0, 0, 0, // pid 1, total_extlen 2 (16 bytes), padding
    0x41, 0x80, 0, 0, 0xa4, 0x81, 0, 0, // flags O_WRONLY|O_CREAT|O_LARGEFILE, mode 0o100644
    0x12, 0, 0, 0, 0, 0, 0, 0, // umask 0o22, open_flags 0
    b'f', 0, // name
    0x10, 0, 0, 0, 0x20, 0, 0, 0, // ext header: size 16, type 32 (FUSE_EXT_GROUPS)
    0x01, 0, 0, 0, 0x05, 0, 0, 0, // nr_groups 1, group 5
];

#[test]
fn extensions_are_stripped() {
    let req = decode(&CREATE_WITH_EXT).unwrap();
    assert_eq!(
        req.op,
        Operation::Create {
            name: b"f",
            flags: 0x8041,
            mode: 0o100_644,
            umask: 0o22,
            open_flags: 0
        }
    );
    assert_eq!(req.header.total_extlen, 2);
    // Over the ring the extension is at the end of the payload too.
    let parts = decode_parts(
        &CREATE_WITH_EXT[..40],
        &CREATE_WITH_EXT[40..56],
        &CREATE_WITH_EXT[56..],
    );
    assert_eq!(parts.unwrap().op, req.op);
    // Extensions claiming more than what follows arg0 are refused, not read out of bounds.
    let mut lying = CREATE_WITH_EXT;
    lying[36] = 3; // 24 bytes of extensions, only 18 after arg0
    assert_eq!(
        decode(&lying).unwrap_err(),
        DecodeError::BadExtensions {
            opcode: 35,
            ext: 24,
            got: 18
        }
    );
    // An extension that swallows the name's NUL leaves a name without one.
    let mut no_name = CREATE_WITH_EXT.to_vec();
    no_name.truncate(72);
    no_name[0] = 72;
    assert!(matches!(
        decode(&no_name),
        Err(DecodeError::MissingNul { opcode: 35, .. })
    ));
}

#[test]
fn rename2_decodes() {
    #[rustfmt::skip]
    let msg: [u8; 64] = [
        0x40, 0, 0, 0, 0x2d, 0, 0, 0, // len 64, opcode 45 (RENAME2)
        0x04, 0, 0, 0, 0, 0, 0, 0, // unique 4
        0x02, 0, 0, 0, 0, 0, 0, 0, // nodeid 2 (old parent)
        0, 0, 0, 0, 0, 0, 0, 0, // uid, gid
        0, 0, 0, 0, 0, 0, 0, 0, // pid, extlen, padding
        0x09, 0, 0, 0, 0, 0, 0, 0, // newdir 9
        0x01, 0, 0, 0, 0, 0, 0, 0, // flags RENAME_NOREPLACE, padding
        b'o', b'l', b'd', 0, b'n', b'e', b'w', 0, // old name, new name
    ];
    let req = decode(&msg).unwrap();
    assert_eq!(
        req.op,
        Operation::Rename {
            newdir: 9,
            name: b"old",
            newname: b"new",
            flags: abi::RENAME_NOREPLACE
        }
    );
    assert_eq!((req.nodeid(), arg0_len(45)), (2, 16));
    // Plain RENAME: the 8-byte argument, flags reported as 0.
    #[rustfmt::skip]
    let plain: [u8; 56] = [
        0x38, 0, 0, 0, 0x0c, 0, 0, 0, // len 56, opcode 12 (RENAME)
        0x05, 0, 0, 0, 0, 0, 0, 0, // unique 5
        0x02, 0, 0, 0, 0, 0, 0, 0, // nodeid 2
        0, 0, 0, 0, 0, 0, 0, 0, // uid, gid
        0, 0, 0, 0, 0, 0, 0, 0, // pid, extlen, padding
        0x09, 0, 0, 0, 0, 0, 0, 0, // newdir 9
        b'o', b'l', b'd', 0, b'n', b'e', b'w', 0, // names
    ];
    let req = decode(&plain).unwrap();
    assert_eq!(
        req.op,
        Operation::Rename {
            newdir: 9,
            name: b"old",
            newname: b"new",
            flags: 0
        }
    );
}

#[test]
fn error_replies_carry_negative_errno() {
    let mut msg = Vec::new();
    reply::encode_reply(0x77, Err(Errno::ENOENT), &mut msg);
    // len 16, error -2, unique 0x77
    let expected = [
        0x10, 0, 0, 0, 0xfe, 0xff, 0xff, 0xff, 0x77, 0, 0, 0, 0, 0, 0, 0,
    ];
    assert_eq!(msg, expected);
}

#[test]
fn peek_helpers() {
    assert_eq!(request::peek_opcode(&WRITE), Some(16));
    assert_eq!(request::peek_unique(&WRITE), Some(0x22));
    assert_eq!(request::peek_unique(&WRITE[..39]), None);
}
