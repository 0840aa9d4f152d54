//! Properties the request decoder must have on any input, as a library function so that
//! both the cargo-fuzz target (`fuzz/fuzz_targets/decode.rs`) and a seeded smoke test in
//! `cargo test` (`tests/fuzz_smoke.rs`) run the same checks.

#![forbid(unsafe_code)]
#![deny(clippy::indexing_slicing, clippy::unwrap_used)]

use crate::{
    abi::{FileLock, ForgetOne, InHeader, SetattrIn},
    request::{
        arg0_len, decode, decode_parts, DecodeError, Forgets, KernelInit, Operation, Request,
    },
};

/// Panics if the decoder misbehaves on `bytes`: decoding must not panic, must be
/// deterministic, must agree with the two-part (io_uring) form split by `arg0_len`, and a
/// decoded request must survive encode → decode unchanged.
pub fn check_decode(bytes: &[u8]) {
    let first = decode(bytes);
    assert_eq!(first, decode(bytes), "decoding is not deterministic");
    check_parts(bytes, &first);
    if let Ok(req) = &first {
        check_reencode(req);
    }
}

/// The ring delivers header, arg0 and the rest separately; any split must be safe, and the
/// `arg0_len` split must give what `decode` gave.
fn check_parts(bytes: &[u8], whole: &Result<Request<'_>, DecodeError>) {
    let header_len = size_of::<InHeader>();
    let Some((header, body)) = bytes.split_at_checked(header_len) else {
        assert!(matches!(whole, Err(DecodeError::ShortHeader { .. })));
        // A short header must be refused by the parts form too, at any split.
        assert!(decode_parts(bytes, &[], &[]).is_err());
        return;
    };
    let opcode = crate::request::peek_opcode(bytes).unwrap_or(0);
    let split = arg0_len(opcode).min(body.len());
    if let Some((arg0, rest)) = body.split_at_checked(split) {
        let parts = decode_parts(header, arg0, rest);
        if let Ok(req) = whole {
            assert_eq!(
                parts.as_ref(),
                Ok(req),
                "parts form disagrees with whole form"
            );
        }
    }
    for k in [
        0,
        1,
        7,
        8,
        16,
        body.len() / 2,
        body.len().saturating_sub(1),
        body.len(),
    ] {
        if let Some((arg0, rest)) = body.split_at_checked(k) {
            let _ = decode_parts(header, arg0, rest);
        }
    }
}

fn check_reencode(req: &Request<'_>) {
    let mut again = Vec::new();
    req.encode(&mut again);
    let back = match decode(&again) {
        Ok(back) => back,
        Err(e) => panic!("re-encoded {req:?} does not decode: {e}"),
    };
    assert_eq!(back.op, req.op, "operation changed through encode/decode");
    let mut header = req.header;
    header.len = u32::try_from(again.len()).unwrap_or(u32::MAX);
    header.total_extlen = 0;
    assert_eq!(back.header, header, "header changed through encode/decode");
}

/// Valid requests of every shape, encoded: starting points for mutation-based fuzzing.
pub fn seed_corpus() -> Vec<Vec<u8>> {
    const FORGETS: [ForgetOne; 2] = [
        ForgetOne {
            nodeid: 2,
            nlookup: 1,
        },
        ForgetOne {
            nodeid: 3,
            nlookup: 7,
        },
    ];
    let forgets = Forgets::from_bytes(zerocopy::IntoBytes::as_bytes(&FORGETS[..]));
    let lock = FileLock {
        start: 0,
        end: u64::MAX,
        typ: 1,
        pid: 4,
    };
    let mut ops = vec![
        Operation::Lookup { name: b"hello" },
        Operation::Forget { nlookup: 2 },
        Operation::Getattr { fh: Some(1) },
        Operation::Setattr(SetattrIn {
            valid: 8,
            size: 4096,
            ..SetattrIn::default()
        }),
        Operation::Readlink,
        Operation::Symlink {
            name: b"ln",
            target: b"../target",
        },
        Operation::Mknod {
            name: b"fifo",
            mode: 0o10644,
            rdev: 0,
            umask: 0o022,
        },
        Operation::Mkdir {
            name: b"dir",
            mode: 0o755,
            umask: 0o022,
        },
        Operation::Unlink { name: b"f" },
        Operation::Rmdir { name: b"d" },
        Operation::Rename {
            newdir: 1,
            name: b"a",
            newname: b"b",
            flags: 0,
        },
        Operation::Rename {
            newdir: 5,
            name: b"a",
            newname: b"b",
            flags: 2,
        },
        Operation::Link {
            oldnodeid: 9,
            name: b"hard",
        },
        Operation::Open {
            flags: 0o2,
            open_flags: 0,
        },
        Operation::Read {
            fh: 1,
            offset: 0,
            size: 131_072,
            flags: 0,
        },
        Operation::Write {
            fh: 1,
            offset: 8,
            data: b"0123456789",
            write_flags: 0,
            flags: 1,
        },
        Operation::Statfs,
        Operation::Release {
            fh: 1,
            flags: 0,
            release_flags: 1,
            lock_owner: 3,
        },
        Operation::Fsync {
            fh: 1,
            datasync: true,
        },
        Operation::Setxattr {
            name: b"user.a",
            value: b"value",
            flags: 0,
        },
        Operation::Getxattr {
            name: b"user.a",
            size: 64,
        },
        Operation::Listxattr { size: 0 },
        Operation::Removexattr { name: b"user.a" },
        Operation::Flush {
            fh: 1,
            lock_owner: 3,
        },
        Operation::Init(KernelInit {
            major: 7,
            minor: 45,
            max_readahead: 131_072,
            flags: 0x3_ffff_ffff,
        }),
        Operation::Opendir { flags: 0 },
        Operation::Readdir {
            fh: 1,
            offset: 0,
            size: 4096,
        },
        Operation::Readdirplus {
            fh: 1,
            offset: 2,
            size: 4096,
        },
        Operation::Releasedir { fh: 1 },
        Operation::Fsyncdir {
            fh: 1,
            datasync: false,
        },
        Operation::Getlk {
            fh: 1,
            owner: 2,
            lock,
            lk_flags: 0,
        },
        Operation::Setlkw {
            fh: 1,
            owner: 2,
            lock,
            lk_flags: 1,
        },
        Operation::Access { mask: 4 },
        Operation::Create {
            name: b"new",
            flags: 0o1101,
            mode: 0o100644,
            umask: 0o22,
            open_flags: 0,
        },
        Operation::Interrupt { unique: 99 },
        Operation::Destroy,
        Operation::Ioctl {
            fh: 1,
            flags: 0,
            cmd: 0x5401,
            arg: 0,
            out_size: 8,
            data: b"abc",
        },
        Operation::Poll {
            fh: 1,
            kh: 2,
            flags: 1,
            events: 1,
        },
        Operation::NotifyReply {
            offset: 0,
            data: b"retrieved",
        },
        Operation::Fallocate {
            fh: 1,
            offset: 0,
            length: 1 << 20,
            mode: 0,
        },
        Operation::Lseek {
            fh: 1,
            offset: 0,
            whence: 3,
        },
        Operation::Syncfs,
        Operation::Tmpfile {
            flags: 2,
            mode: 0o100600,
            umask: 0o22,
            open_flags: 0,
        },
        Operation::Statx {
            fh: None,
            sx_flags: 0,
            sx_mask: 0x7ff,
        },
        Operation::Unknown { opcode: 4096 },
    ];
    if let Some(forgets) = forgets {
        ops.push(Operation::BatchForget { forgets });
    }
    ops.into_iter()
        .enumerate()
        .map(|(i, op)| {
            let mut req = Request::new(i as u64 + 1, 1 + i as u64 % 3, op);
            req.header.uid = 1000;
            req.header.gid = 1000;
            req.header.pid = 4242;
            let mut bytes = Vec::new();
            req.encode(&mut bytes);
            bytes
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_pass_the_checks() {
        let seeds = seed_corpus();
        assert!(seeds.len() > 40);
        for seed in &seeds {
            assert!(decode(seed).is_ok());
            check_decode(seed);
        }
        check_decode(&[]);
        check_decode(&[0; 39]);
        check_decode(&[0; 40]);
    }
}
