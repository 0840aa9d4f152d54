//! The superblock: the one record on the device that says "this is etcfs filesystem U, laid
//! out like this". Two identical copies (except for the field naming their own location)
//! live in the first and in the last whole 4 KiB block of the device, so a torn write of one
//! leaves the other. The byte layout is the table in `docs/on-disk-format.md`; all integers
//! are little-endian.

use std::fmt;

use super::{crc::crc32c, AgId, BlockNo, Extent, BLOCK_SIZE};

/// "ETCFS" + "SB" + format generation byte, at byte 0 of each copy.
pub(crate) const MAGIC: [u8; 8] = *b"ETCFS\0SB";
/// The format version this code writes and the only one it reads.
pub(crate) const FORMAT_VERSION: u32 = 1;
/// Bytes of one superblock copy on the device (one block; the record uses the first
/// [`RECORD_BYTES`], the rest is zero).
pub(crate) const SUPERBLOCK_BYTES: usize = BLOCK_SIZE as usize;
/// Bytes of the record, CRC included.
pub(crate) const RECORD_BYTES: usize = 88;
/// Byte offset of the CRC32C, which covers bytes `[0, CRC_OFFSET)`.
const CRC_OFFSET: usize = 84;
/// Blocks reserved at the start of the device: the primary superblock and room for future
/// headers. 1 MiB, so allocation groups start 1 MiB-aligned.
pub(crate) const HEAD_BLOCKS: u64 = 256;
/// Smallest allocation group (256 KiB).
pub(crate) const AG_BLOCKS_MIN: u64 = 64;
/// Smallest partial group kept at the end of the device (128 KiB); a shorter remainder is
/// left unused.
pub(crate) const AG_TAIL_BLOCKS_MIN: u64 = 32;
/// Largest allocation group: group-relative block numbers fit in `u32` (16 TiB).
pub(crate) const AG_BLOCKS_MAX: u64 = u32::MAX as u64;
/// Most allocation groups on one device (one etcd key each, for ownership and free space).
pub(crate) const AG_COUNT_MAX: u64 = 1 << 20;
/// Default allocation-group size: 256 MiB, so even a small shared device has groups enough
/// for several nodes to own some each.
pub(crate) const AG_BLOCKS_DEFAULT: u64 = 65536;

/// Why a device size / AG size pair cannot be laid out, or why a decoded superblock is
/// rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SbError {
    /// The magic is wrong: the bytes are not an etcfs superblock.
    NotEtcfs,
    /// A version this code does not read.
    UnknownVersion(u32),
    /// The checksum does not match: a torn or corrupted copy.
    BadCrc { stored: u32, computed: u32 },
    /// The fields contradict each other or the geometry rules.
    Inconsistent(String),
    /// A valid copy found at a block other than the one it names (a misdirected write).
    Misplaced { names: u64, found_at: u64 },
    /// Fewer bytes than a record.
    Short(usize),
}

impl fmt::Display for SbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SbError::NotEtcfs => write!(f, "not an etcfs device (no etcfs superblock magic)"),
            SbError::UnknownVersion(v) => write!(
                f,
                "etcfs on-disk format version {v} is not supported (this build reads version \
                 {FORMAT_VERSION})"
            ),
            SbError::BadCrc { stored, computed } => write!(
                f,
                "superblock checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): \
                 torn or corrupted"
            ),
            SbError::Inconsistent(why) => write!(f, "inconsistent superblock: {why}"),
            SbError::Misplaced { names, found_at } => write!(
                f,
                "superblock copy for block {names} found at block {found_at} (misdirected write)"
            ),
            SbError::Short(n) => write!(f, "superblock needs {RECORD_BYTES} bytes, got {n}"),
        }
    }
}

impl std::error::Error for SbError {}

/// The layout of a formatted device, derived from its size and the AG size. Every field
/// follows from `device_size` and `ag_blocks` by [`Geometry::new`]; the superblock stores
/// the derived ones too so that a decode can cross-check them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// Device size in bytes at mkfs.
    pub(crate) device_size: u64,
    /// Blocks per allocation group (the last group may be shorter).
    pub(crate) ag_blocks: u64,
    /// Number of allocation groups, at least 1.
    pub(crate) ag_count: u32,
    /// First block of group 0 ([`HEAD_BLOCKS`]).
    pub(crate) data_start_block: u64,
    /// Whole blocks on the device; the backup superblock is the last of them.
    pub(crate) total_blocks: u64,
}

impl Geometry {
    /// Lays out a device of `device_size` bytes in groups of `ag_blocks` blocks: head area,
    /// then whole groups, then a partial group if enough blocks remain,
    /// then the backup superblock in the last whole block. A remainder shorter than
    /// [`AG_TAIL_BLOCKS_MIN`] is left unused.
    pub(crate) fn new(device_size: u64, ag_blocks: u64) -> Result<Geometry, SbError> {
        let bad = |why: String| Err(SbError::Inconsistent(why));
        if !(AG_BLOCKS_MIN..=AG_BLOCKS_MAX).contains(&ag_blocks) {
            return bad(format!(
                "allocation-group size {ag_blocks} blocks is outside \
                 [{AG_BLOCKS_MIN}, {AG_BLOCKS_MAX}]"
            ));
        }
        let total_blocks = device_size / BLOCK_SIZE;
        // Head, the smallest group, and the backup block.
        let needed = HEAD_BLOCKS + AG_BLOCKS_MIN + 1;
        if total_blocks < needed {
            return bad(format!(
                "device of {device_size} bytes is too small: at least {} bytes are needed",
                needed * BLOCK_SIZE
            ));
        }
        let usable = total_blocks - HEAD_BLOCKS - 1;
        let whole = usable / ag_blocks;
        let partial = u64::from(usable % ag_blocks >= AG_TAIL_BLOCKS_MIN);
        let count = whole + partial;
        if count > AG_COUNT_MAX {
            return bad(format!(
                "{count} allocation groups exceed the limit of {AG_COUNT_MAX}; use larger groups"
            ));
        }
        let g = Geometry {
            device_size,
            ag_blocks,
            ag_count: u32::try_from(count).expect("count <= AG_COUNT_MAX fits u32"),
            data_start_block: HEAD_BLOCKS,
            total_blocks,
        };
        assert!(g.ag_count >= 1);
        assert!(g.data_end_block() <= g.backup_block());
        Ok(g)
    }

    /// Block of the backup superblock: the last whole block of the device.
    pub(crate) fn backup_block(&self) -> u64 {
        self.total_blocks - 1
    }

    /// One past the last block any group covers.
    pub(crate) fn data_end_block(&self) -> u64 {
        let last = self
            .ag_extent(AgId(self.ag_count - 1))
            .expect("last group exists");
        last.end()
    }

    /// The blocks of group `ag`, or `None` if there is no such group.
    pub(crate) fn ag_extent(&self, ag: AgId) -> Option<Extent> {
        if ag.0 >= self.ag_count {
            return None;
        }
        let start = self.data_start_block + u64::from(ag.0) * self.ag_blocks;
        let limit = self.backup_block();
        let len = self.ag_blocks.min(limit - start);
        Some(Extent::new(start, len))
    }

    /// The group a block belongs to, or `None` for the head, the tail and beyond.
    pub(crate) fn ag_of(&self, block: BlockNo) -> Option<AgId> {
        let rel = block.0.checked_sub(self.data_start_block)?;
        let ag = AgId(u32::try_from(rel / self.ag_blocks).ok()?);
        let ext = self.ag_extent(ag)?;
        (block.0 < ext.end()).then_some(ag)
    }

    /// Blocks available for file data, over all groups.
    pub(crate) fn data_blocks(&self) -> u64 {
        self.data_end_block() - self.data_start_block
    }
}

/// The superblock record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Superblock {
    /// Filesystem UUID; the etcd superblock record carries the same value.
    pub(crate) uuid: [u8; 16],
    /// The layout.
    pub(crate) geometry: Geometry,
    /// When mkfs ran: seconds since the Unix epoch.
    pub(crate) created_sec: i64,
    /// Nanoseconds part of the creation time, `< 1_000_000_000`.
    pub(crate) created_nsec: u32,
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4-byte slice"))
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8-byte slice"))
}

impl Superblock {
    /// Checks the invariants every encoded or decoded record satisfies.
    fn validate(&self) -> Result<(), SbError> {
        let g = &self.geometry;
        let derived = Geometry::new(g.device_size, g.ag_blocks)?;
        if derived != *g {
            return Err(SbError::Inconsistent(format!(
                "device of {} bytes in groups of {} blocks gives {} groups starting at block {}, \
                 the record says {} groups starting at block {}",
                g.device_size,
                g.ag_blocks,
                derived.ag_count,
                derived.data_start_block,
                g.ag_count,
                g.data_start_block
            )));
        }
        if self.created_nsec >= 1_000_000_000 {
            return Err(SbError::Inconsistent(format!(
                "creation time nanoseconds {} out of range",
                self.created_nsec
            )));
        }
        Ok(())
    }

    /// The copy of this record that lives at block `at` (0 or the backup block), as one
    /// block of bytes.
    pub(crate) fn encode(&self, at: u64) -> Result<Vec<u8>, SbError> {
        self.validate()?;
        let g = &self.geometry;
        if at != 0 && at != g.backup_block() {
            return Err(SbError::Inconsistent(format!(
                "a superblock copy belongs at block 0 or {}, not {at}",
                g.backup_block()
            )));
        }
        let mut b = vec![0u8; SUPERBLOCK_BYTES];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        // 12..16: flags, zero in version 1.
        b[16..32].copy_from_slice(&self.uuid);
        b[32..36].copy_from_slice(&(BLOCK_SIZE as u32).to_le_bytes());
        let ag_blocks = u32::try_from(g.ag_blocks).expect("validated: ag_blocks <= u32::MAX");
        b[36..40].copy_from_slice(&ag_blocks.to_le_bytes());
        b[40..44].copy_from_slice(&g.ag_count.to_le_bytes());
        // 44..48: reserved, zero.
        b[48..56].copy_from_slice(&g.device_size.to_le_bytes());
        b[56..64].copy_from_slice(&g.data_start_block.to_le_bytes());
        b[64..72].copy_from_slice(&at.to_le_bytes());
        b[72..80].copy_from_slice(&self.created_sec.to_le_bytes());
        b[80..84].copy_from_slice(&self.created_nsec.to_le_bytes());
        let crc = crc32c(&b[..CRC_OFFSET]);
        b[CRC_OFFSET..RECORD_BYTES].copy_from_slice(&crc.to_le_bytes());
        // Pair assertion: what we write is what a mount will read back.
        debug_assert_eq!(Superblock::decode(&b, at).as_ref(), Ok(self));
        Ok(b)
    }

    /// Decodes the copy read from block `at`. Never panics: every malformed input is an
    /// [`SbError`].
    pub(crate) fn decode(b: &[u8], at: u64) -> Result<Superblock, SbError> {
        if b.len() < RECORD_BYTES {
            return Err(SbError::Short(b.len()));
        }
        if b[0..8] != MAGIC {
            return Err(SbError::NotEtcfs);
        }
        let stored = le_u32(b, CRC_OFFSET);
        let computed = crc32c(&b[..CRC_OFFSET]);
        if stored != computed {
            return Err(SbError::BadCrc { stored, computed });
        }
        let version = le_u32(b, 8);
        if version != FORMAT_VERSION {
            return Err(SbError::UnknownVersion(version));
        }
        let flags = le_u32(b, 12);
        if flags != 0 {
            return Err(SbError::Inconsistent(format!("unknown flags {flags:#x}")));
        }
        let block_size = le_u32(b, 32);
        if u64::from(block_size) != BLOCK_SIZE {
            return Err(SbError::Inconsistent(format!(
                "block size {block_size} (version {FORMAT_VERSION} uses {BLOCK_SIZE})"
            )));
        }
        let names = le_u64(b, 64);
        if names != at {
            return Err(SbError::Misplaced {
                names,
                found_at: at,
            });
        }
        let device_size = le_u64(b, 48);
        let geometry = Geometry {
            device_size,
            ag_blocks: u64::from(le_u32(b, 36)),
            ag_count: le_u32(b, 40),
            data_start_block: le_u64(b, 56),
            total_blocks: device_size / BLOCK_SIZE,
        };
        let sb = Superblock {
            uuid: b[16..32].try_into().expect("16-byte slice"),
            geometry,
            created_sec: i64::from_le_bytes(b[72..80].try_into().expect("8-byte slice")),
            created_nsec: le_u32(b, 80),
        };
        // Pair assertion, the decode side: a record that passed the CRC must still satisfy
        // every invariant the encoder checks.
        sb.validate()?;
        if at != 0 && at != geometry.backup_block() {
            return Err(SbError::Inconsistent(format!(
                "copy read from block {at}, but the backup belongs at block {}",
                geometry.backup_block()
            )));
        }
        Ok(sb)
    }
}

/// Formats a UUID the usual way (`8-4-4-4-12` lowercase hex).
pub(crate) fn fmt_uuid(u: &[u8; 16]) -> String {
    let mut s = String::with_capacity(36);
    for (i, b) in u.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Parses `8-4-4-4-12` hex (dashes optional), or `None`.
pub(crate) fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s.bytes().filter(|&c| c != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let txt = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(txt, 16).ok()?;
    }
    Some(out)
}

/// A random (version 4) UUID from the kernel's random source.
pub(crate) fn random_uuid() -> std::io::Result<[u8; 16]> {
    use std::io::Read;
    let mut u = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut u)?;
    u[6] = (u[6] & 0x0f) | 0x40;
    u[8] = (u[8] & 0x3f) | 0x80;
    Ok(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn sample() -> Superblock {
        Superblock {
            uuid: *b"0123456789abcdef",
            geometry: Geometry::new(GIB, 16384).unwrap(),
            created_sec: 1_700_000_000,
            created_nsec: 123,
        }
    }

    #[test]
    fn geometry_of_one_gib_in_64_mib_groups() {
        let g = Geometry::new(GIB, 16384).unwrap();
        assert_eq!(g.total_blocks, 262_144);
        assert_eq!(g.backup_block(), 262_143);
        // 262144 - 256 - 1 = 261887 usable = 15 whole groups + 16127 blocks (a partial one).
        assert_eq!(g.ag_count, 16);
        assert_eq!(g.ag_extent(AgId(0)), Some(Extent::new(256, 16384)));
        assert_eq!(
            g.ag_extent(AgId(15)),
            Some(Extent::new(256 + 15 * 16384, 16127))
        );
        assert_eq!(g.ag_extent(AgId(16)), None);
        assert_eq!(g.data_end_block(), g.backup_block());
        assert_eq!(g.data_blocks(), 261_887);
        assert_eq!(g.ag_of(BlockNo(0)), None);
        assert_eq!(g.ag_of(BlockNo(255)), None);
        assert_eq!(g.ag_of(BlockNo(256)), Some(AgId(0)));
        assert_eq!(g.ag_of(BlockNo(256 + 16384)), Some(AgId(1)));
        assert_eq!(g.ag_of(BlockNo(262_142)), Some(AgId(15)));
        assert_eq!(g.ag_of(BlockNo(262_143)), None);
        assert_eq!(g.ag_of(BlockNo(u64::MAX)), None);
    }

    #[test]
    fn geometry_drops_a_tiny_tail_and_rejects_bad_sizes() {
        // usable = 256 + 10 blocks: one group of 256, a 10-block remainder left unused.
        let size = (HEAD_BLOCKS + 256 + 10 + 1) * BLOCK_SIZE + 100;
        let g = Geometry::new(size, 256).unwrap();
        assert_eq!(g.ag_count, 1);
        assert_eq!(g.data_end_block(), HEAD_BLOCKS + 256);
        assert!(Geometry::new(size, 63).is_err());
        assert!(Geometry::new(size, AG_BLOCKS_MAX + 1).is_err());
        let msg = Geometry::new(4096 * 100, 64).unwrap_err().to_string();
        assert!(msg.contains("too small"), "{msg}");
        assert!(Geometry::new(1 << 50, 64)
            .unwrap_err()
            .to_string()
            .contains("exceed"));
    }

    #[test]
    fn round_trip_both_copies() {
        let sb = sample();
        for at in [0, sb.geometry.backup_block()] {
            let b = sb.encode(at).unwrap();
            assert_eq!(b.len(), SUPERBLOCK_BYTES);
            assert_eq!(Superblock::decode(&b, at), Ok(sb));
        }
        assert!(sb.encode(5).is_err());
    }

    #[test]
    fn decode_rejects_each_kind_of_damage() {
        let sb = sample();
        let good = sb.encode(0).unwrap();

        assert_eq!(Superblock::decode(&[0u8; 4096], 0), Err(SbError::NotEtcfs));
        assert!(SbError::NotEtcfs
            .to_string()
            .contains("not an etcfs device"));
        assert_eq!(Superblock::decode(&good[..10], 0), Err(SbError::Short(10)));

        let mut b = good.clone();
        b[20] ^= 1;
        assert!(matches!(
            Superblock::decode(&b, 0),
            Err(SbError::BadCrc { .. })
        ));

        let reseal = |mut b: Vec<u8>| {
            let crc = crc32c(&b[..CRC_OFFSET]);
            b[CRC_OFFSET..RECORD_BYTES].copy_from_slice(&crc.to_le_bytes());
            b
        };
        let mut b = good.clone();
        b[8..12].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(
            Superblock::decode(&reseal(b), 0),
            Err(SbError::UnknownVersion(2))
        );

        let mut b = good.clone();
        b[40..44].copy_from_slice(&99u32.to_le_bytes());
        let e = Superblock::decode(&reseal(b), 0).unwrap_err();
        assert!(matches!(e, SbError::Inconsistent(_)), "{e}");

        let mut b = good.clone();
        b[32..36].copy_from_slice(&512u32.to_le_bytes());
        assert!(matches!(
            Superblock::decode(&reseal(b), 0),
            Err(SbError::Inconsistent(_))
        ));

        let mut b = good.clone();
        b[80..84].copy_from_slice(&2_000_000_000u32.to_le_bytes());
        assert!(matches!(
            Superblock::decode(&reseal(b), 0),
            Err(SbError::Inconsistent(_))
        ));

        // The primary copy read from where the backup should be.
        let backup = sb.geometry.backup_block();
        assert_eq!(
            Superblock::decode(&good, backup),
            Err(SbError::Misplaced {
                names: 0,
                found_at: backup
            })
        );
    }

    #[test]
    fn decode_never_panics_on_noise() {
        use rand::{rngs::SmallRng, Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(7);
        let good = sample().encode(0).unwrap();
        for _ in 0..20_000 {
            let mut b = good[..RECORD_BYTES].to_vec();
            for _ in 0..rng.gen_range(1..6) {
                let i = rng.gen_range(0..b.len());
                b[i] = rng.gen();
            }
            // Keep the CRC valid half the time so the field checks are exercised.
            if rng.gen_bool(0.5) {
                let crc = crc32c(&b[..CRC_OFFSET]);
                b[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
            }
            let _ = Superblock::decode(&b, 0);
            let n = rng.gen_range(0..b.len());
            let _ = Superblock::decode(&b[..n], 0);
        }
    }

    #[test]
    fn uuid_text_round_trip() {
        let u = random_uuid().unwrap();
        let s = fmt_uuid(&u);
        assert_eq!(s.len(), 36);
        assert_eq!(&s[14..15], "4");
        assert_eq!(parse_uuid(&s), Some(u));
        assert_eq!(parse_uuid("nope"), None);
        assert_eq!(parse_uuid(&"zz".repeat(16)), None);
    }
}
