//! Kernel notifications on a real mount: INVAL_ENTRY, INVAL_INODE and DELETE make the kernel
//! drop what it cached, on both transports. Needs root and /dev/fuse (skips loudly without,
//! fails instead when ETCFS_REQUIRE_MOUNT_TESTS=1).

mod common;

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use fusedev::{
    abi::{Attr, AttrOut, EntryOut},
    errno::Errno,
    reply,
    request::{Operation, Request},
    server::{Handler, Reply, RequestCtx},
    transport::TransportChoice,
};

const LONG: Duration = Duration::from_secs(3600);
const FILE_INO: u64 = 2;

/// Root holds one file `f` (while `present`), whose size is `size`; everything is cached for
/// an hour, so only a notification makes the kernel ask again.
#[derive(Default)]
struct OneFile {
    present: AtomicBool,
    size: AtomicU64,
    lookups: AtomicUsize,
    getattrs: AtomicUsize,
}

impl OneFile {
    fn attr(&self, ino: u64) -> Attr {
        let mut a = Attr {
            ino,
            nlink: 1,
            blksize: 4096,
            ..Attr::default()
        };
        if ino == 1 {
            a.mode = libc::S_IFDIR | 0o755;
            a.nlink = 2;
        } else {
            a.mode = libc::S_IFREG | 0o644;
            a.size = self.size.load(Ordering::SeqCst);
        }
        a
    }
}

impl Handler for OneFile {
    fn handle(&self, _ctx: &RequestCtx<'_>, req: &Request<'_>, out: &mut [u8]) -> Reply {
        match &req.op {
            Operation::Lookup { name } => {
                self.lookups.fetch_add(1, Ordering::SeqCst);
                if req.header.nodeid == 1 && *name == b"f" && self.present.load(Ordering::SeqCst) {
                    let e = EntryOut::new(1, LONG, LONG, self.attr(FILE_INO));
                    Reply::Bytes(reply::entry(out, &e).expect("fits"))
                } else {
                    let e = EntryOut::negative(LONG);
                    Reply::Bytes(reply::entry(out, &e).expect("fits"))
                }
            }
            Operation::Getattr { .. } => {
                self.getattrs.fetch_add(1, Ordering::SeqCst);
                let a = AttrOut::new(LONG, self.attr(req.header.nodeid));
                Reply::Bytes(reply::attr(out, &a).expect("fits"))
            }
            Operation::Forget { .. } | Operation::BatchForget { .. } => Reply::None,
            _ => Reply::Error(Errno::ENOSYS),
        }
    }
}

fn notifications_drop_kernel_caches(transport: TransportChoice) {
    let fs = Arc::new(OneFile::default());
    fs.present.store(true, Ordering::SeqCst);
    fs.size.store(10, Ordering::SeqCst);
    let m = common::mount(fs.clone(), "notify", &common::small_config(transport));
    let session = m.session.as_ref().expect("session");
    let expected = if transport == TransportChoice::Uring {
        "uring"
    } else {
        "devfuse"
    };
    assert_eq!(session.transport().kind, expected);
    let notifier = session.notifier();
    let file = m.dir.join("f");

    assert_eq!(std::fs::metadata(&file).expect("stat").len(), 10);
    let lookups = fs.lookups.load(Ordering::SeqCst);
    assert_eq!(std::fs::metadata(&file).expect("stat").len(), 10);
    assert_eq!(
        fs.lookups.load(Ordering::SeqCst),
        lookups,
        "entry was cached"
    );

    // INVAL_INODE: the new size shows only after the kernel drops the attributes.
    fs.size.store(20, Ordering::SeqCst);
    assert_eq!(
        std::fs::metadata(&file).expect("stat").len(),
        10,
        "attributes cached"
    );
    assert!(notifier.inval_inode(FILE_INO, -1, 0).expect("inval_inode"));
    assert_eq!(std::fs::metadata(&file).expect("stat").len(), 20);

    // INVAL_ENTRY: the next stat looks the name up again.
    assert!(notifier.inval_entry(1, b"f").expect("inval_entry"));
    std::fs::metadata(&file).expect("stat");
    assert_eq!(fs.lookups.load(Ordering::SeqCst), lookups + 1);

    // DELETE: the name is gone for the kernel, and the negative answer is cached.
    fs.present.store(false, Ordering::SeqCst);
    assert!(
        std::fs::metadata(&file).is_ok(),
        "still cached before DELETE"
    );
    assert!(notifier.delete(1, FILE_INO, b"f").expect("delete"));
    assert!(std::fs::metadata(&file).is_err());
    let after = fs.lookups.load(Ordering::SeqCst);
    assert!(std::fs::metadata(&file).is_err());
    assert_eq!(
        fs.lookups.load(Ordering::SeqCst),
        after,
        "absence was cached"
    );

    // A create elsewhere must invalidate a cached absence: INVAL_ENTRY does that.
    fs.present.store(true, Ordering::SeqCst);
    assert!(std::fs::metadata(&file).is_err(), "negative entry cached");
    assert!(notifier.inval_entry(1, b"f").expect("inval_entry"));
    assert!(std::fs::metadata(&file).is_ok());
    // Names a notification cannot carry are refused before reaching the kernel.
    assert!(notifier.inval_entry(1, &[b'x'; 256]).is_err());
}

#[test]
fn notifications_on_devfuse() {
    if common::mount_tests_possible("notifications_on_devfuse") {
        notifications_drop_kernel_caches(TransportChoice::Devfuse);
    }
}

#[test]
fn notifications_on_uring() {
    if !common::uring_tests_possible("notifications_on_uring") {
        return;
    }
    notifications_drop_kernel_caches(TransportChoice::Uring);
}
