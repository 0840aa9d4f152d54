//! Formatting a device, and the mount-time check that a device is the filesystem etcd says
//! it is.
//!
//! `format` writes the primary superblock, flushes, then the backup, and flushes again, so a
//! crash leaves at least one valid copy; it then reads both back and compares (a pair
//! check of what it wrote). `check` reads the primary, falls back to the backup if the
//! primary is damaged, compares the UUID with the one etcd holds, and rewrites a damaged
//! copy from the good one.

use std::{fmt, path::Path, time::SystemTime};

use ::uring::AlignedBuf;

use super::{
    device::{BlockDev, DevError},
    superblock::{fmt_uuid, Geometry, SbError, Superblock, SUPERBLOCK_BYTES},
    BLOCK_SIZE,
};

/// Why formatting or checking a device failed; each message names the device.
#[derive(Debug)]
pub(crate) enum MkfsError {
    /// Reading or writing the device failed.
    Dev(String, DevError),
    /// The device cannot hold the requested layout (too small, bad AG size).
    Layout(String, SbError),
    /// `format` without `force` on a device that already holds a filesystem.
    AlreadyFormatted(String, [u8; 16]),
    /// `check` found no valid superblock copy.
    NotFormatted(String, SbError),
    /// `check` found another filesystem than the expected one.
    WrongFilesystem {
        device: String,
        found: [u8; 16],
        expected: [u8; 16],
    },
    /// The device is smaller than when it was formatted.
    Shrunk {
        device: String,
        size: u64,
        formatted: u64,
    },
    /// What `format` read back differs from what it wrote.
    Readback(String),
}

impl fmt::Display for MkfsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MkfsError::Dev(d, e) => write!(f, "device {d}: {e}"),
            MkfsError::Layout(d, e) => write!(f, "device {d}: {e}"),
            MkfsError::AlreadyFormatted(d, u) => write!(
                f,
                "device {d} already holds etcfs filesystem {}; use --force to overwrite",
                fmt_uuid(u)
            ),
            MkfsError::NotFormatted(d, SbError::NotEtcfs) => {
                write!(f, "device {d} is not formatted (run `etcfs mkfs`)")
            }
            MkfsError::NotFormatted(d, e) => write!(
                f,
                "device {d} has no valid etcfs superblock (primary: {e}; the backup copy is \
                 damaged too)"
            ),
            MkfsError::WrongFilesystem {
                device,
                found,
                expected,
            } => write!(
                f,
                "device {device} holds filesystem {}, etcd prefix holds {}: wrong device or \
                 wrong --prefix",
                fmt_uuid(found),
                fmt_uuid(expected)
            ),
            MkfsError::Shrunk {
                device,
                size,
                formatted,
            } => write!(
                f,
                "device {device} is {size} bytes, smaller than the {formatted} bytes it was \
                 formatted with"
            ),
            MkfsError::Readback(d) => {
                write!(
                    f,
                    "device {d}: the superblock read back differs from what was written"
                )
            }
        }
    }
}

impl std::error::Error for MkfsError {}

/// Which superblock copies were readable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SbCopies {
    pub(crate) primary_ok: bool,
    pub(crate) backup_ok: bool,
}

fn name(path: &Path) -> String {
    path.display().to_string()
}

fn read_block(dev: &mut dyn BlockDev, block: u64) -> Result<AlignedBuf, DevError> {
    let mut b = AlignedBuf::new(SUPERBLOCK_BYTES);
    dev.read_at(&mut b, block * BLOCK_SIZE)?;
    Ok(b)
}

/// Reads the superblock: the primary copy, else the backup in the last block of the
/// device. Returns which copies were valid; the backup counts only if it equals the primary.
pub(crate) fn read_superblock(
    dev: &mut dyn BlockDev,
    path: &Path,
) -> Result<(Superblock, SbCopies), MkfsError> {
    let dev_err = |e| MkfsError::Dev(name(path), e);
    let size = dev.size_bytes();
    if size < 2 * BLOCK_SIZE {
        return Err(MkfsError::NotFormatted(name(path), SbError::NotEtcfs));
    }
    let primary = Superblock::decode(&read_block(dev, 0).map_err(dev_err)?, 0);
    let backup_at = |sb: &Superblock| sb.geometry.backup_block();
    match primary {
        Ok(sb) => {
            let backup_ok = backup_at(&sb) < size / BLOCK_SIZE
                && read_block(dev, backup_at(&sb))
                    .ok()
                    .and_then(|b| Superblock::decode(&b, backup_at(&sb)).ok())
                    == Some(sb);
            Ok((
                sb,
                SbCopies {
                    primary_ok: true,
                    backup_ok,
                },
            ))
        }
        Err(primary_err) => {
            let last = size / BLOCK_SIZE - 1;
            let backup = read_block(dev, last).map_err(dev_err)?;
            match Superblock::decode(&backup, last) {
                Ok(sb) => Ok((
                    sb,
                    SbCopies {
                        primary_ok: false,
                        backup_ok: true,
                    },
                )),
                Err(_) => Err(MkfsError::NotFormatted(name(path), primary_err)),
            }
        }
    }
}

fn write_copy(
    dev: &mut dyn BlockDev,
    path: &Path,
    sb: &Superblock,
    at: u64,
) -> Result<(), MkfsError> {
    let bytes = sb
        .encode(at)
        .map_err(|e| MkfsError::Layout(name(path), e))?;
    let mut buf = AlignedBuf::new(SUPERBLOCK_BYTES);
    buf[..bytes.len()].copy_from_slice(&bytes);
    let dev_err = |e| MkfsError::Dev(name(path), e);
    dev.write_at(&buf, at * BLOCK_SIZE).map_err(dev_err)?;
    dev.flush().map_err(dev_err)
}

/// Formats `dev` (named `path` in messages) as filesystem `uuid` with allocation groups of
/// `ag_blocks` blocks, created at `now`. Refuses a device that already holds an etcfs
/// filesystem unless `force`. Returns the superblock, whose geometry the meta layer records
/// in etcd.
pub(crate) fn format(
    dev: &mut dyn BlockDev,
    path: &Path,
    uuid: [u8; 16],
    ag_blocks: u64,
    force: bool,
    now: SystemTime,
) -> Result<Superblock, MkfsError> {
    let geometry =
        Geometry::new(dev.size_bytes(), ag_blocks).map_err(|e| MkfsError::Layout(name(path), e))?;
    if !force {
        match read_superblock(dev, path) {
            Ok((old, _)) => return Err(MkfsError::AlreadyFormatted(name(path), old.uuid)),
            Err(MkfsError::NotFormatted(..)) => {}
            Err(e) => return Err(e),
        }
    }
    let since = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let sb = Superblock {
        uuid,
        geometry,
        created_sec: i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
        created_nsec: since.subsec_nanos(),
    };
    write_copy(dev, path, &sb, 0)?;
    write_copy(dev, path, &sb, geometry.backup_block())?;
    // Pair check: both copies read back as what was written.
    match read_superblock(dev, path)? {
        (
            got,
            SbCopies {
                primary_ok: true,
                backup_ok: true,
            },
        ) if got == sb => Ok(sb),
        _ => Err(MkfsError::Readback(name(path))),
    }
}

/// Checks at mount that `dev` holds filesystem `expected_uuid` (from etcd), and rewrites a
/// damaged superblock copy from the valid one. Returns the superblock.
pub(crate) fn check(
    dev: &mut dyn BlockDev,
    path: &Path,
    expected_uuid: [u8; 16],
) -> Result<Superblock, MkfsError> {
    let (sb, copies) = read_superblock(dev, path)?;
    if sb.uuid != expected_uuid {
        return Err(MkfsError::WrongFilesystem {
            device: name(path),
            found: sb.uuid,
            expected: expected_uuid,
        });
    }
    let size = dev.size_bytes();
    if size < sb.geometry.device_size {
        return Err(MkfsError::Shrunk {
            device: name(path),
            size,
            formatted: sb.geometry.device_size,
        });
    }
    if !copies.primary_ok {
        log::warn!(
            "device {}: primary superblock damaged; rewriting it from the backup",
            name(path)
        );
        write_copy(dev, path, &sb, 0)?;
    }
    if !copies.backup_ok {
        log::warn!(
            "device {}: backup superblock damaged; rewriting it",
            name(path)
        );
        write_copy(dev, path, &sb, sb.geometry.backup_block())?;
    }
    Ok(sb)
}

/// The etcd superblock record that matches `sb` (written by mkfs next to the device's).
pub(crate) fn meta_record(sb: &Superblock) -> meta::codec::SuperRecord {
    let g = &sb.geometry;
    meta::codec::SuperRecord {
        uuid: sb.uuid,
        format_version: super::superblock::FORMAT_VERSION,
        block_size: BLOCK_SIZE as u32,
        group_size: g.ag_blocks * BLOCK_SIZE,
        group_count: g.ag_count,
        device_size: g.device_size,
        created: meta::types::Timespec::new(sb.created_sec, sb.created_nsec),
    }
}

/// Checks at mount that the device's superblock and etcd's record describe the same
/// filesystem with the same layout; the error names the first field that differs.
pub(crate) fn agrees_with_meta(
    sb: &Superblock,
    rec: &meta::codec::SuperRecord,
    path: &Path,
) -> Result<(), MkfsError> {
    if rec.uuid != sb.uuid {
        return Err(MkfsError::WrongFilesystem {
            device: name(path),
            found: sb.uuid,
            expected: rec.uuid,
        });
    }
    let want = meta_record(sb);
    let field = if rec.format_version != want.format_version {
        "format version"
    } else if rec.block_size != want.block_size {
        "block size"
    } else if rec.group_size != want.group_size {
        "allocation-group size"
    } else if rec.group_count != want.group_count {
        "allocation-group count"
    } else if rec.device_size != want.device_size {
        "device size"
    } else {
        return Ok(());
    };
    Err(MkfsError::Layout(
        name(path),
        SbError::Inconsistent(format!("{field} differs between the device and etcd")),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::device::{mem::MemDev, psync::PsyncDev, testutil};

    const U1: [u8; 16] = [1; 16];
    const U2: [u8; 16] = [2; 16];

    fn p() -> &'static Path {
        Path::new("/dev/test0")
    }

    #[test]
    fn meta_record_round_trip_and_disagreement() {
        let mut d = MemDev::new(64 << 20);
        let sb = format(&mut d, p(), U1, 1024, false, SystemTime::now()).unwrap();
        let rec = meta_record(&sb);
        assert_eq!(rec.group_size, 1024 * BLOCK_SIZE);
        agrees_with_meta(&sb, &rec, p()).unwrap();
        let mut other = rec.clone();
        other.group_count += 1;
        let e = agrees_with_meta(&sb, &other, p()).unwrap_err();
        assert!(
            e.to_string().contains("allocation-group count differs"),
            "{e}"
        );
        other = rec.clone();
        other.uuid = U2;
        let e = agrees_with_meta(&sb, &other, p()).unwrap_err();
        assert!(matches!(e, MkfsError::WrongFilesystem { .. }), "{e}");
    }

    #[test]
    fn format_then_check() {
        let mut d = MemDev::new(64 << 20);
        let sb = format(&mut d, p(), U1, 1024, false, SystemTime::now()).unwrap();
        assert_eq!(
            sb.geometry.ag_count, 16,
            "15 whole groups and a partial one"
        );
        assert_eq!(check(&mut d, p(), U1).unwrap(), sb);
        d.crash();
        assert_eq!(check(&mut d, p(), U1).unwrap(), sb, "format flushed");
    }

    #[test]
    fn refuses_a_formatted_device_without_force() {
        let mut d = MemDev::new(64 << 20);
        format(&mut d, p(), U1, 1024, false, SystemTime::now()).unwrap();
        let e = format(&mut d, p(), U2, 1024, false, SystemTime::now()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "device /dev/test0 already holds etcfs filesystem \
             01010101-0101-0101-0101-010101010101; use --force to overwrite"
        );
        let sb = format(&mut d, p(), U2, 2048, true, SystemTime::now()).unwrap();
        assert_eq!(check(&mut d, p(), U2).unwrap(), sb);
    }

    #[test]
    fn check_names_wrong_and_missing_filesystems() {
        let mut d = MemDev::new(64 << 20);
        let e = check(&mut d, p(), U1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "device /dev/test0 is not formatted (run `etcfs mkfs`)"
        );
        format(&mut d, p(), U1, 1024, false, SystemTime::now()).unwrap();
        let e = check(&mut d, p(), U2).unwrap_err().to_string();
        assert!(
            e.starts_with(
                "device /dev/test0 holds filesystem 01010101-0101-0101-0101-010101010101, etcd \
                 prefix holds 02020202-0202-0202-0202-020202020202"
            ),
            "{e}"
        );
    }

    #[test]
    fn a_torn_primary_is_recovered_from_the_backup_and_repaired() {
        let mut d = MemDev::new(64 << 20);
        let sb = format(&mut d, p(), U1, 1024, false, SystemTime::now()).unwrap();
        let mut junk = AlignedBuf::new(4096);
        junk[..4096].copy_from_slice(&sb.encode(0).unwrap());
        junk[30] ^= 0xff;
        d.write_at(&junk, 0).unwrap();
        let (_, copies) = read_superblock(&mut d, p()).unwrap();
        assert!(!copies.primary_ok && copies.backup_ok);
        assert_eq!(check(&mut d, p(), U1).unwrap(), sb);
        let (_, copies) = read_superblock(&mut d, p()).unwrap();
        assert!(copies.primary_ok && copies.backup_ok, "primary rewritten");
        // Damage both: a clear error, not a mount.
        d.write_at(&junk, 0).unwrap();
        d.write_at(
            &AlignedBuf::new(4096),
            sb.geometry.backup_block() * BLOCK_SIZE,
        )
        .unwrap();
        let e = check(&mut d, p(), U1).unwrap_err();
        assert!(e.to_string().contains("checksum mismatch"), "{e}");
        // A damaged backup alone is repaired too.
        format(&mut d, p(), U1, 1024, true, SystemTime::now()).unwrap();
        d.write_at(
            &AlignedBuf::new(4096),
            sb.geometry.backup_block() * BLOCK_SIZE,
        )
        .unwrap();
        check(&mut d, p(), U1).unwrap();
        assert!(read_superblock(&mut d, p()).unwrap().1.backup_ok);
    }

    #[test]
    fn a_failed_superblock_write_is_an_error() {
        let mut d = MemDev::new(64 << 20);
        d.set_faults(crate::data::device::mem::MemFaults {
            fail_writes: 1,
            ..Default::default()
        });
        let e = format(&mut d, p(), U1, 1024, false, SystemTime::now()).unwrap_err();
        assert!(e.to_string().contains("injected write fault"), "{e}");
    }

    #[test]
    fn too_small_and_shrunk_devices() {
        let mut d = MemDev::new(1 << 20);
        let e = format(&mut d, p(), U1, 1024, false, SystemTime::now()).unwrap_err();
        assert!(e.to_string().contains("too small"), "{e}");
        // Format a large device, then present only its first part: the backup is out of
        // reach but the primary reads, and the size check fails.
        let mut big = MemDev::new(64 << 20);
        format(&mut big, p(), U1, 1024, false, SystemTime::now()).unwrap();
        let mut head = AlignedBuf::new(4096);
        big.read_at(&mut head, 0).unwrap();
        let mut small = MemDev::new(32 << 20);
        small.write_at(&head, 0).unwrap();
        let e = check(&mut small, p(), U1).unwrap_err();
        assert!(matches!(e, MkfsError::Shrunk { .. }), "{e}");
    }

    #[test]
    fn format_and_check_a_real_image_with_both_engines() {
        let Some((img, dev)) = testutil::direct_image("mkfs", 64 << 20) else {
            return;
        };
        let mut ps = PsyncDev::new(&dev);
        let sb = format(&mut ps, &img.path, U1, 1024, false, SystemTime::now()).unwrap();
        assert_eq!(check(&mut ps, &img.path, U1).unwrap(), sb);
    }
}
