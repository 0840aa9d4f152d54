//! The shared block device: opening it, and the [`BlockDev`] interface every engine offers.
//!
//! All I/O is in whole blocks at block-aligned byte offsets, from and into [`AlignedBuf`]s,
//! so the same calls work with O_DIRECT. Engines:
//! * [`psync::PsyncDev`]: `pread`/`pwrite` on the shared file; the fallback where io_uring
//!   is unavailable (containers whose seccomp profile blocks it), and the reference the
//!   uring engine is tested against.
//! * `uring::UringDev` (compiled in once the root crate depends on `io-uring`; see below):
//!   one io_uring per thread, several requests of a batch in flight at
//!   once (at most `inflight_max`).
//! * [`mem::MemDev`]: an in-memory device with a volatile write cache and fault knobs, for
//!   deterministic simulation.

pub(crate) mod mem;
pub(crate) mod psync;
// The io_uring engine builds its SQEs with the `io-uring` crate (a direct dependency of the
// root crate).
pub(crate) mod uring;

use std::{
    fmt, fs,
    io::{self, Seek, SeekFrom},
    os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
    sync::Arc,
};

use ::uring::AlignedBuf;

use super::BLOCK_SIZE;

/// Largest single request, in bytes (the kernel's `rw` length is 32-bit, and a bounded
/// request keeps one slow I/O from holding a core for long).
pub(crate) const REQ_BYTES_MAX: usize = 64 << 20;

/// A failed device operation. Every variant names the operation and where it was aimed.
#[derive(Debug)]
pub(crate) enum DevError {
    /// The path could not be opened or inspected.
    Open { path: PathBuf, err: io::Error },
    /// The filesystem holding the image (tmpfs, for one) refuses O_DIRECT.
    DirectUnsupported { path: PathBuf, err: io::Error },
    /// Not a regular file or a block device, or a logical block size above 4 KiB.
    Unsuitable { path: PathBuf, why: String },
    /// Offset, length or buffer not a whole number of blocks, or a request too large.
    Misaligned { off: u64, len: usize },
    /// The request reaches past the end of the device.
    OutOfRange { off: u64, len: usize, size: u64 },
    /// The device (or the filesystem under an image file) is full: ENOSPC.
    NoSpace { off: u64, len: usize },
    /// The kernel returned an error.
    Io {
        op: &'static str,
        off: u64,
        len: usize,
        err: io::Error,
    },
    /// A transfer moved fewer bytes than asked and could not be completed.
    Short {
        op: &'static str,
        off: u64,
        len: usize,
        done: usize,
    },
    /// A fault injected by [`mem::MemDev`].
    Injected { op: &'static str, off: u64 },
    /// Refused: this node's lease may have ended, so another node may own these blocks
    /// now (`fs::fence`).
    Fenced,
}

impl DevError {
    /// The errno a filesystem operation that hit this error should return.
    pub(crate) fn errno(&self) -> i32 {
        match self {
            DevError::NoSpace { .. } => libc::ENOSPC,
            DevError::Misaligned { .. } => libc::EINVAL,
            DevError::Open { err, .. } | DevError::DirectUnsupported { err, .. } => {
                err.raw_os_error().unwrap_or(libc::EIO)
            }
            _ => libc::EIO,
        }
    }

    fn from_io(op: &'static str, off: u64, len: usize, err: io::Error) -> DevError {
        if err.raw_os_error() == Some(libc::ENOSPC) {
            DevError::NoSpace { off, len }
        } else {
            DevError::Io { op, off, len, err }
        }
    }
}

impl fmt::Display for DevError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DevError::Open { path, err } => {
                write!(f, "cannot open device {}: {err}", path.display())
            }
            DevError::DirectUnsupported { path, err } => write!(
                f,
                "device {} does not support O_DIRECT ({err}); put the image on a filesystem \
                 that does (ext4, xfs; not tmpfs) or use a block device",
                path.display()
            ),
            DevError::Unsuitable { path, why } => write!(f, "device {}: {why}", path.display()),
            DevError::Misaligned { off, len } => write!(
                f,
                "device I/O of {len} bytes at offset {off} is not {BLOCK_SIZE}-byte aligned \
                 (or exceeds {REQ_BYTES_MAX} bytes)"
            ),
            DevError::OutOfRange { off, len, size } => write!(
                f,
                "device I/O of {len} bytes at offset {off} reaches past the end of the \
                 {size}-byte device"
            ),
            DevError::NoSpace { off, len } => {
                write!(
                    f,
                    "no space left on device writing {len} bytes at offset {off}"
                )
            }
            DevError::Io { op, off, len, err } => {
                write!(
                    f,
                    "device {op} of {len} bytes at offset {off} failed: {err}"
                )
            }
            DevError::Short { op, off, len, done } => write!(
                f,
                "device {op} of {len} bytes at offset {off} stopped after {done} bytes"
            ),
            DevError::Injected { op, off } => write!(f, "injected {op} fault at offset {off}"),
            DevError::Fenced => {
                f.write_str("device I/O refused: this node's session lease may have ended (fenced)")
            }
        }
    }
}

impl std::error::Error for DevError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DevError::Open { err, .. }
            | DevError::DirectUnsupported { err, .. }
            | DevError::Io { err, .. } => Some(err),
            _ => None,
        }
    }
}

/// The buffer side of one request: what is read into, or written from.
#[derive(Debug)]
pub(crate) enum IoBuf<'a> {
    /// Fill this buffer from the device.
    Read(&'a mut AlignedBuf),
    /// Write this buffer to the device.
    Write(&'a AlignedBuf),
}

/// One request of a batch: `len` bytes at device offset `off`, from or into the start of
/// the buffer.
#[derive(Debug)]
pub(crate) struct IoReq<'a> {
    /// Device byte offset, block-aligned.
    pub(crate) off: u64,
    /// Bytes, a whole number of blocks, at most the buffer's length.
    pub(crate) len: usize,
    /// The buffer.
    pub(crate) buf: IoBuf<'a>,
}

impl<'a> IoReq<'a> {
    /// Read the whole of `buf` from `off`.
    pub(crate) fn read(buf: &'a mut AlignedBuf, off: u64) -> Self {
        let len = buf.len();
        IoReq {
            off,
            len,
            buf: IoBuf::Read(buf),
        }
    }

    /// Write the whole of `buf` at `off`.
    pub(crate) fn write(buf: &'a AlignedBuf, off: u64) -> Self {
        let len = buf.len();
        IoReq {
            off,
            len,
            buf: IoBuf::Write(buf),
        }
    }

    fn op(&self) -> &'static str {
        match self.buf {
            IoBuf::Read(_) => "read",
            IoBuf::Write(_) => "write",
        }
    }

    fn buf_len(&self) -> usize {
        match &self.buf {
            IoBuf::Read(b) => b.len(),
            IoBuf::Write(b) => b.len(),
        }
    }
}

/// Checks that a request is whole blocks, fits its buffer and lies inside the device.
pub(crate) fn check_req(req: &IoReq<'_>, size: u64) -> Result<(), DevError> {
    let (off, len) = (req.off, req.len);
    let misaligned = DevError::Misaligned { off, len };
    if len == 0 || len > REQ_BYTES_MAX || len > req.buf_len() {
        return Err(misaligned);
    }
    if off % BLOCK_SIZE != 0 || len as u64 % BLOCK_SIZE != 0 {
        return Err(misaligned);
    }
    match off.checked_add(len as u64) {
        Some(end) if end <= size => Ok(()),
        _ => Err(DevError::OutOfRange { off, len, size }),
    }
}

/// Block I/O on the shared device. One value per thread; engines that share a device file
/// are created from the same [`DevFile`].
pub(crate) trait BlockDev {
    /// Which engine this is ("psync", "uring", "mem"), for logs and reports.
    fn engine(&self) -> &'static str;

    /// Usable size of the device in bytes.
    fn size_bytes(&self) -> u64;

    /// Runs every request of `reqs`, overlapping them where the engine can, and returns one
    /// result per request, in order. On return the device no longer touches any buffer.
    fn submit_batch(&mut self, reqs: &mut [IoReq<'_>]) -> Vec<Result<(), DevError>>;

    /// Makes every completed write durable (`fdatasync`).
    fn flush(&mut self) -> Result<(), DevError>;

    /// Fills the whole of `buf` from device offset `off`.
    fn read_at(&mut self, buf: &mut AlignedBuf, off: u64) -> Result<(), DevError> {
        let mut reqs = [IoReq::read(buf, off)];
        one(self.submit_batch(&mut reqs))
    }

    /// Writes the whole of `buf` at device offset `off` (not yet durable: see `flush`).
    fn write_at(&mut self, buf: &AlignedBuf, off: u64) -> Result<(), DevError> {
        let mut reqs = [IoReq::write(buf, off)];
        one(self.submit_batch(&mut reqs))
    }
}

fn one(mut results: Vec<Result<(), DevError>>) -> Result<(), DevError> {
    assert_eq!(results.len(), 1, "one result per request");
    results.pop().expect("one result")
}

/// How to open a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpenOpts {
    /// Open with O_DIRECT (the default for real use). Without it, I/O goes through the page
    /// cache, which is only acceptable for single-node tests on filesystems without O_DIRECT.
    pub(crate) direct: bool,
}

impl Default for OpenOpts {
    fn default() -> Self {
        OpenOpts { direct: true }
    }
}

/// An opened device: the file (shared by every engine and thread), its path and size.
#[derive(Clone, Debug)]
pub(crate) struct DevFile {
    pub(crate) file: Arc<fs::File>,
    pub(crate) path: PathBuf,
    /// Size in bytes, rounded down to whole blocks.
    pub(crate) size: u64,
    /// Whether it was opened with O_DIRECT.
    pub(crate) direct: bool,
    /// Whether it is a block device (else a regular image file).
    pub(crate) is_block_device: bool,
}

fn dev_major(rdev: u64) -> u64 {
    ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff)
}

fn dev_minor(rdev: u64) -> u64 {
    (rdev & 0xff) | ((rdev >> 12) & !0xff)
}

/// The logical block size of a block device from sysfs, if it can be found (a partition
/// reads it from its parent's `queue`).
fn logical_block_size(rdev: u64) -> Option<u64> {
    let base = format!("/sys/dev/block/{}:{}", dev_major(rdev), dev_minor(rdev));
    ["queue/logical_block_size", "../queue/logical_block_size"]
        .iter()
        .find_map(|p| fs::read_to_string(format!("{base}/{p}")).ok())
        .and_then(|s| s.trim().parse().ok())
}

/// Opens `path` (a regular image file or a block device) read-write, with O_DIRECT unless
/// `opts` says otherwise, and checks that block-aligned direct I/O works on it.
pub(crate) fn open_device(path: &Path, opts: OpenOpts) -> Result<DevFile, DevError> {
    let open_err = |err| DevError::Open {
        path: path.to_path_buf(),
        err,
    };
    let meta = fs::metadata(path).map_err(open_err)?;
    let ft = meta.file_type();
    let is_block_device = ft.is_block_device();
    if !is_block_device && !ft.is_file() {
        return Err(DevError::Unsuitable {
            path: path.to_path_buf(),
            why: "not a regular file or a block device".into(),
        });
    }
    if is_block_device {
        if let Some(lbs) = logical_block_size(meta.rdev()) {
            if lbs > BLOCK_SIZE || BLOCK_SIZE % lbs != 0 {
                return Err(DevError::Unsuitable {
                    path: path.to_path_buf(),
                    why: format!("logical block size {lbs} is not a divisor of {BLOCK_SIZE}"),
                });
            }
        }
    }
    let mut oo = fs::OpenOptions::new();
    oo.read(true).write(true);
    if opts.direct {
        oo.custom_flags(libc::O_DIRECT);
    }
    let file = match oo.open(path) {
        Ok(f) => f,
        Err(err) if opts.direct && err.raw_os_error() == Some(libc::EINVAL) => {
            return Err(DevError::DirectUnsupported {
                path: path.to_path_buf(),
                err,
            })
        }
        Err(err) => return Err(open_err(err)),
    };
    // Seeking to the end gives the size of block devices and regular files alike.
    let raw_size = (&file).seek(SeekFrom::End(0)).map_err(open_err)?;
    let size = raw_size - raw_size % BLOCK_SIZE;
    let dev = DevFile {
        file: Arc::new(file),
        path: path.to_path_buf(),
        size,
        direct: opts.direct,
        is_block_device,
    };
    // Some filesystems accept O_DIRECT at open and refuse it at the first I/O: find out now.
    if opts.direct && size >= BLOCK_SIZE {
        let mut probe = AlignedBuf::new(BLOCK_SIZE as usize);
        if let Err(e) = psync::PsyncDev::new(&dev).read_at(&mut probe, 0) {
            return Err(match e {
                DevError::Io { err, .. } if err.raw_os_error() == Some(libc::EINVAL) => {
                    DevError::DirectUnsupported {
                        path: path.to_path_buf(),
                        err,
                    }
                }
                other => other,
            });
        }
    }
    Ok(dev)
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Sparse image files for device tests, on a filesystem that supports O_DIRECT, and the
    //! checks every engine must pass.

    use std::path::PathBuf;

    use super::{BlockDev, DevError, IoBuf, IoReq, BLOCK_SIZE};
    use ::uring::AlignedBuf;

    /// A sparse image file removed on drop.
    pub(crate) struct TempImage {
        pub(crate) path: PathBuf,
    }

    impl TempImage {
        /// Creates a sparse file of `size` bytes under /var/tmp (not tmpfs, so O_DIRECT
        /// works), named after the test.
        pub(crate) fn new(name: &str, size: u64) -> TempImage {
            let dir = std::env::var_os("ETCFS_TEST_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/var/tmp"));
            let path = dir.join(format!("etcfs-data-{name}-{}.img", std::process::id()));
            let f = std::fs::File::create(&path).expect("create test image");
            f.set_len(size).expect("size test image");
            TempImage { path }
        }
    }

    impl Drop for TempImage {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// Opens a fresh sparse image with O_DIRECT, or prints a loud SKIP and returns `None`
    /// when the filesystem under it refuses O_DIRECT.
    pub(crate) fn direct_image(name: &str, size: u64) -> Option<(TempImage, super::DevFile)> {
        let img = TempImage::new(name, size);
        match super::open_device(&img.path, super::OpenOpts::default()) {
            Ok(dev) => Some((img, dev)),
            Err(e @ super::DevError::DirectUnsupported { .. }) => {
                eprintln!("SKIP {name}: {e} (set ETCFS_TEST_DIR to an ext4/xfs directory)");
                None
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }

    fn pattern(seed: u64, len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::new(len);
        for (i, x) in b.iter_mut().enumerate() {
            *x = (seed.wrapping_mul(31).wrapping_add(i as u64 / 7) % 251) as u8;
        }
        b
    }

    /// The behaviour every engine must show, on a device of at least 8 MiB.
    pub(crate) fn exercise(dev: &mut dyn BlockDev) {
        let size = dev.size_bytes();
        assert!(size >= 8 << 20);
        let bs = BLOCK_SIZE as usize;

        // Never-written blocks read as zeros.
        let mut r = AlignedBuf::new(2 * bs);
        dev.read_at(&mut r, 4 << 20).expect("read a hole");
        assert!(r.iter().all(|&b| b == 0));

        // A batch of writes of different sizes, then a batch of reads of the same ranges.
        let ranges: Vec<(u64, usize)> = (0..100u64)
            .map(|i| (i * 16 * BLOCK_SIZE, bs * (1 + (i as usize % 5))))
            .collect();
        let bufs: Vec<AlignedBuf> = ranges
            .iter()
            .enumerate()
            .map(|(i, &(_, len))| pattern(i as u64, len))
            .collect();
        let mut reqs: Vec<IoReq<'_>> = bufs
            .iter()
            .zip(&ranges)
            .map(|(b, &(off, _))| IoReq::write(b, off))
            .collect();
        for (i, res) in dev.submit_batch(&mut reqs).into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("write {i}: {e}"));
        }
        dev.flush().expect("flush");
        let mut back: Vec<AlignedBuf> = ranges
            .iter()
            .map(|&(_, len)| AlignedBuf::new(len))
            .collect();
        let mut reqs: Vec<IoReq<'_>> = back
            .iter_mut()
            .zip(&ranges)
            .map(|(b, &(off, _))| IoReq::read(b, off))
            .collect();
        for (i, res) in dev.submit_batch(&mut reqs).into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("read {i}: {e}"));
        }
        for (i, (a, b)) in bufs.iter().zip(&back).enumerate() {
            assert!(a[..] == b[..], "request {i} read back different bytes");
        }

        // A request for a prefix of a larger buffer touches only that prefix.
        let mut big = pattern(999, 4 * bs);
        let mut reqs = [IoReq {
            off: 0,
            len: bs,
            buf: IoBuf::Read(&mut big),
        }];
        dev.submit_batch(&mut reqs)
            .pop()
            .expect("one")
            .expect("prefix read");
        assert!(big[..bs] == bufs[0][..bs]);
        assert!(big[bs..] == pattern(999, 4 * bs)[bs..]);

        // Bad requests fail alone; the good ones in the same batch still run.
        let w = pattern(5, bs);
        let mut r2 = AlignedBuf::new(bs);
        let mut reqs = [
            IoReq::write(&w, size),
            IoReq {
                off: 512,
                len: bs,
                buf: IoBuf::Write(&w),
            },
            IoReq::read(&mut r2, 16 * BLOCK_SIZE),
        ];
        let res = dev.submit_batch(&mut reqs);
        assert!(
            matches!(res[0], Err(DevError::OutOfRange { .. })),
            "{:?}",
            res[0]
        );
        assert!(
            matches!(res[1], Err(DevError::Misaligned { .. })),
            "{:?}",
            res[1]
        );
        assert!(res[2].is_ok());
        assert!(r2[..] == bufs[1][..bs]);

        // The last block is reachable.
        dev.write_at(&w, size - BLOCK_SIZE)
            .expect("write last block");
        dev.read_at(&mut r2, size - BLOCK_SIZE)
            .expect("read last block");
        assert!(r2[..] == w[..]);
    }
}

#[cfg(test)]
mod tests {
    use super::{testutil::TempImage, *};

    #[test]
    fn check_req_rules() {
        let mut b = AlignedBuf::new(8192);
        let size = 1 << 20;
        assert!(check_req(&IoReq::read(&mut b, 4096), size).is_ok());
        let r = IoReq {
            off: 100,
            len: 4096,
            buf: IoBuf::Read(&mut b),
        };
        assert!(matches!(
            check_req(&r, size),
            Err(DevError::Misaligned { .. })
        ));
        let r = IoReq {
            off: 0,
            len: 12288,
            buf: IoBuf::Read(&mut b),
        };
        assert!(matches!(
            check_req(&r, size),
            Err(DevError::Misaligned { .. })
        ));
        let r = IoReq {
            off: 0,
            len: 0,
            buf: IoBuf::Read(&mut b),
        };
        assert!(matches!(
            check_req(&r, size),
            Err(DevError::Misaligned { .. })
        ));
        let r = IoReq::read(&mut b, size - 4096);
        assert!(matches!(
            check_req(&r, size),
            Err(DevError::OutOfRange { .. })
        ));
        let r = IoReq::read(&mut b, u64::MAX - 4095);
        assert!(matches!(
            check_req(&r, size),
            Err(DevError::OutOfRange { .. })
        ));
    }

    #[test]
    fn errno_mapping() {
        assert_eq!(DevError::NoSpace { off: 0, len: 1 }.errno(), libc::ENOSPC);
        assert_eq!(
            DevError::Misaligned { off: 0, len: 1 }.errno(),
            libc::EINVAL
        );
        let e = DevError::Injected {
            op: "write",
            off: 0,
        };
        assert_eq!(e.errno(), libc::EIO);
        let e = DevError::from_io("write", 0, 1, io::Error::from_raw_os_error(libc::ENOSPC));
        assert!(matches!(e, DevError::NoSpace { .. }));
    }

    #[test]
    fn open_refuses_missing_and_directories_clearly() {
        let e = open_device(Path::new("/nonexistent/etcfs.img"), OpenOpts::default());
        let msg = e.unwrap_err().to_string();
        assert!(
            msg.contains("cannot open device /nonexistent/etcfs.img"),
            "{msg}"
        );
        let e = open_device(Path::new("/"), OpenOpts::default()).unwrap_err();
        assert!(
            e.to_string()
                .contains("not a regular file or a block device"),
            "{e}"
        );
    }

    #[test]
    fn tmpfs_refuses_o_direct_with_a_clear_error() {
        let dir = Path::new("/dev/shm");
        if !dir.is_dir() {
            eprintln!("SKIP tmpfs_refuses_o_direct: no /dev/shm");
            return;
        }
        let path = dir.join(format!("etcfs-data-tmpfs-{}.img", std::process::id()));
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let r = open_device(&path, OpenOpts::default());
        let buffered = open_device(&path, OpenOpts { direct: false });
        let _ = std::fs::remove_file(&path);
        match r {
            Err(e @ DevError::DirectUnsupported { .. }) => {
                assert!(e.to_string().contains("does not support O_DIRECT"), "{e}");
            }
            Ok(_) => eprintln!("NOTE: /dev/shm accepted O_DIRECT on this kernel"),
            Err(e) => panic!("unexpected error: {e}"),
        }
        assert_eq!(buffered.expect("buffered open works").size, 1 << 20);
    }

    #[test]
    fn open_image_reports_size_rounded_to_blocks() {
        let img = TempImage::new("open", (1 << 20) + 100);
        match open_device(&img.path, OpenOpts::default()) {
            Ok(d) => {
                assert_eq!(d.size, 1 << 20);
                assert!(d.direct);
                assert!(!d.is_block_device);
            }
            Err(e @ DevError::DirectUnsupported { .. }) => {
                eprintln!("SKIP open_image_reports_size: {e}");
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn psync_engine_on_a_direct_image() {
        let Some((_img, dev)) = testutil::direct_image("psync", 16 << 20) else {
            return;
        };
        let mut e = psync::PsyncDev::new(&dev);
        assert_eq!(e.engine(), "psync");
        testutil::exercise(&mut e);
    }

    #[test]
    fn mem_engine() {
        testutil::exercise(&mut mem::MemDev::new(16 << 20));
    }

    #[test]
    fn major_minor_split() {
        // 259:3 (an nvme partition) and 8:17 in the glibc encoding.
        let enc = |ma: u64, mi: u64| (mi & 0xff) | ((ma & 0xfff) << 8) | ((mi & !0xff) << 12);
        assert_eq!((dev_major(enc(259, 3)), dev_minor(enc(259, 3))), (259, 3));
        assert_eq!((dev_major(enc(8, 17)), dev_minor(enc(8, 17))), (8, 17));
        assert_eq!(dev_minor(enc(8, 300)), 300);
    }
}
