//! Pure planning of file I/O through an extent map: which device bytes a read comes from
//! and where it reads zeros, and what a write must allocate and read-modify-write.
//!
//! The extent map is a file's list of [`FileExtent`]s (as stored in etcd, one key each),
//! sorted by file offset, non-overlapping, block-aligned. A range with no extent is a hole;
//! an extent marked unwritten is allocated but reads as zeros (fallocate, or a write whose
//! data is not yet durable). Both read as zeros: what was never written is never read.
//!
//! The fs keeps one more invariant these functions rely on and help keep: bytes past
//! end-of-file inside the block holding EOF read as zeros. Reads are clipped to EOF, and a
//! write that starts past EOF zeroes the rest of the old EOF block ([`RmwBlock`]), so an
//! extending write never exposes stale bytes there.

use std::fmt;

use super::BLOCK_SIZE;

/// One extent of a file's map, all in bytes and block-aligned: file bytes
/// `[file_off, file_off + len)` live at device bytes `[dev_off, dev_off + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FileExtent {
    pub(crate) file_off: u64,
    pub(crate) len: u64,
    pub(crate) dev_off: u64,
    /// Allocated but never written: reads as zeros.
    pub(crate) unwritten: bool,
}

impl FileExtent {
    fn file_end(&self) -> u64 {
        self.file_off + self.len
    }
}

impl From<&meta::codec::Extent> for FileExtent {
    fn from(e: &meta::codec::Extent) -> Self {
        FileExtent {
            file_off: e.file_off,
            len: e.len,
            dev_off: e.dev_off,
            unwritten: e.unwritten,
        }
    }
}

/// A malformed extent map (from a corrupt etcd value): the operation fails with EIO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PlanError {
    /// An extent that is empty, not block-aligned, or overflows.
    BadExtent(FileExtent),
    /// Two extents out of order or overlapping.
    Overlap(FileExtent, FileExtent),
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::BadExtent(e) => write!(f, "bad extent {e:?}"),
            PlanError::Overlap(a, b) => {
                write!(f, "extents out of order or overlapping: {a:?}, {b:?}")
            }
        }
    }
}

impl std::error::Error for PlanError {}

/// Checks that `extents` is a valid map: each non-empty, block-aligned, without overflow,
/// and sorted without overlap.
pub(crate) fn check_extents(extents: &[FileExtent]) -> Result<(), PlanError> {
    for e in extents {
        let aligned = e.file_off % BLOCK_SIZE == 0 && e.len % BLOCK_SIZE == 0;
        let fits =
            e.file_off.checked_add(e.len).is_some() && e.dev_off.checked_add(e.len).is_some();
        if e.len == 0 || !aligned || e.dev_off % BLOCK_SIZE != 0 || !fits {
            return Err(PlanError::BadExtent(*e));
        }
    }
    for w in extents.windows(2) {
        if w[0].file_end() > w[1].file_off {
            return Err(PlanError::Overlap(w[0], w[1]));
        }
    }
    Ok(())
}

/// Where a piece of a read comes from, in file order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadSpan {
    /// `len` bytes at device offset `dev_off` (not necessarily block-aligned: the caller
    /// reads the covering blocks, see [`aligned_cover`]).
    Device { dev_off: u64, len: u64 },
    /// `len` bytes of zeros (a hole or an unwritten extent).
    Zero { len: u64 },
}

impl ReadSpan {
    /// Bytes this span contributes.
    pub(crate) fn len(&self) -> u64 {
        match *self {
            ReadSpan::Device { len, .. } | ReadSpan::Zero { len } => len,
        }
    }
}

fn push_span(out: &mut Vec<ReadSpan>, span: ReadSpan) {
    if span.len() == 0 {
        return;
    }
    match (out.last_mut(), span) {
        (Some(ReadSpan::Zero { len }), ReadSpan::Zero { len: more }) => *len += more,
        (
            Some(ReadSpan::Device { dev_off, len }),
            ReadSpan::Device {
                dev_off: next,
                len: more,
            },
        ) if *dev_off + *len == next => *len += more,
        _ => out.push(span),
    }
}

/// Index of the first extent that ends after `off`.
fn first_after(extents: &[FileExtent], off: u64) -> usize {
    extents.partition_point(|e| e.file_end() <= off)
}

/// Maps the read of `len` bytes at file offset `off` of a file of `file_size` bytes to
/// device reads and zero fills, in order. The read is clipped at end-of-file; the spans add
/// up to exactly the bytes returned. Adjacent zero spans and physically contiguous device
/// spans are merged.
pub(crate) fn plan_read(
    extents: &[FileExtent],
    file_size: u64,
    off: u64,
    len: u64,
) -> Result<Vec<ReadSpan>, PlanError> {
    check_extents(extents)?;
    let end = off.saturating_add(len).min(file_size);
    let mut out = Vec::new();
    if off >= end {
        return Ok(out);
    }
    let mut cursor = off;
    for e in &extents[first_after(extents, off)..] {
        if e.file_off >= end {
            break;
        }
        if e.file_off > cursor {
            push_span(
                &mut out,
                ReadSpan::Zero {
                    len: e.file_off - cursor,
                },
            );
            cursor = e.file_off;
        }
        let stop = end.min(e.file_end());
        let span = if e.unwritten {
            ReadSpan::Zero { len: stop - cursor }
        } else {
            ReadSpan::Device {
                dev_off: e.dev_off + (cursor - e.file_off),
                len: stop - cursor,
            }
        };
        push_span(&mut out, span);
        cursor = stop;
    }
    push_span(&mut out, ReadSpan::Zero { len: end - cursor });
    // Postcondition: the spans cover the clipped read exactly.
    assert_eq!(out.iter().map(ReadSpan::len).sum::<u64>(), end - off);
    Ok(out)
}

/// The block-aligned device range covering `len` bytes at `dev_off`: `(start, len, skip)`
/// where `skip` is where the wanted bytes begin inside it.
pub(crate) fn aligned_cover(dev_off: u64, len: u64) -> (u64, u64, u64) {
    let start = dev_off - dev_off % BLOCK_SIZE;
    let end = dev_off.saturating_add(len).next_multiple_of(BLOCK_SIZE);
    (start, end - start, dev_off - start)
}

/// What backs one piece of the block-aligned range a write covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WriteSeg {
    /// Already allocated: write in place. If `unwritten`, the extent must be marked written
    /// once the data is durable.
    Mapped {
        file_off: u64,
        len: u64,
        dev_off: u64,
        unwritten: bool,
    },
    /// No extent: allocate `len / BLOCK_SIZE` blocks, write, flush, then commit the extent.
    Hole { file_off: u64, len: u64 },
}

/// A block the write covers only in part (or the old end-of-file block): build it in a
/// block buffer by starting from the old contents (read from `old_dev_off` if `Some`, else
/// zeros), zeroing everything from `keep_bytes` on, then copying in the new data that falls
/// in this block, and write it whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RmwBlock {
    /// File offset of the block.
    pub(crate) file_off: u64,
    /// Where the old contents are, if they must be read (mapped, written, and not entirely
    /// past end-of-file).
    pub(crate) old_dev_off: Option<u64>,
    /// Bytes at the start of the block that hold file data before the write (the rest were
    /// past end-of-file and must be zeros).
    pub(crate) keep_bytes: u64,
}

/// What a write of `len` bytes at `off` needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WritePlan {
    /// The block-aligned file range the write touches: `[block_off, block_off + block_len)`.
    pub(crate) block_off: u64,
    pub(crate) block_len: u64,
    /// That range split by what backs it, in order, covering it exactly.
    pub(crate) segments: Vec<WriteSeg>,
    /// Blocks to read-modify-write (at most three: head, tail, old EOF block).
    pub(crate) rmw: Vec<RmwBlock>,
    /// File size after the write.
    pub(crate) new_size: u64,
}

impl WritePlan {
    /// Blocks that must be allocated.
    pub(crate) fn alloc_blocks(&self) -> u64 {
        self.holes().map(|(_, len)| len / BLOCK_SIZE).sum()
    }

    /// The holes to allocate, as `(file_off, len)` in bytes.
    pub(crate) fn holes(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.segments.iter().filter_map(|s| match *s {
            WriteSeg::Hole { file_off, len } => Some((file_off, len)),
            WriteSeg::Mapped { .. } => None,
        })
    }
}

/// The device offset of the written data of the block at `file_off`, if it has any.
fn written_block(extents: &[FileExtent], file_off: u64) -> Option<u64> {
    let e = extents.get(first_after(extents, file_off))?;
    (e.file_off <= file_off && !e.unwritten).then(|| e.dev_off + (file_off - e.file_off))
}

/// How many of the `max` blocks after the one at `block` (written, at `dev_off`) follow it
/// on the device as written data inside `file_size`: what one device read of the block can
/// bring along, for the writes that continue past it (a log's next records).
pub(crate) fn written_run_after(
    extents: &[FileExtent],
    file_size: u64,
    block: u64,
    dev_off: u64,
    max: u64,
) -> u64 {
    (1..=max)
        .take_while(|k| {
            let at = block + k * BLOCK_SIZE;
            at + BLOCK_SIZE <= file_size
                && written_block(extents, at) == Some(dev_off + k * BLOCK_SIZE)
        })
        .count() as u64
}

fn rmw_block(extents: &[FileExtent], file_size: u64, block: u64) -> RmwBlock {
    let keep_bytes = file_size.saturating_sub(block).min(BLOCK_SIZE);
    let old_dev_off = if keep_bytes == 0 {
        None
    } else {
        written_block(extents, block)
    };
    RmwBlock {
        file_off: block,
        old_dev_off,
        keep_bytes,
    }
}

/// Plans a write of `len > 0` bytes at file offset `off` into a file of `file_size` bytes.
pub(crate) fn plan_write(
    extents: &[FileExtent],
    file_size: u64,
    off: u64,
    len: u64,
) -> Result<WritePlan, PlanError> {
    check_extents(extents)?;
    assert!(len > 0, "plan a non-empty write");
    let end = off
        .checked_add(len)
        .expect("the caller bounds offsets below u64::MAX");
    let block_off = off - off % BLOCK_SIZE;
    let block_end = end.next_multiple_of(BLOCK_SIZE);

    let mut segments = Vec::new();
    let mut cursor = block_off;
    for e in &extents[first_after(extents, block_off)..] {
        if e.file_off >= block_end {
            break;
        }
        if e.file_off > cursor {
            segments.push(WriteSeg::Hole {
                file_off: cursor,
                len: e.file_off - cursor,
            });
            cursor = e.file_off;
        }
        let stop = block_end.min(e.file_end());
        segments.push(WriteSeg::Mapped {
            file_off: cursor,
            len: stop - cursor,
            dev_off: e.dev_off + (cursor - e.file_off),
            unwritten: e.unwritten,
        });
        cursor = stop;
    }
    if cursor < block_end {
        segments.push(WriteSeg::Hole {
            file_off: cursor,
            len: block_end - cursor,
        });
    }

    let mut rmw = Vec::new();
    let head_partial = off % BLOCK_SIZE != 0;
    let tail_partial = end % BLOCK_SIZE != 0;
    let tail_block = block_end - BLOCK_SIZE;
    if head_partial || (tail_partial && tail_block == block_off) {
        rmw.push(rmw_block(extents, file_size, block_off));
    }
    if tail_partial && tail_block != block_off {
        rmw.push(rmw_block(extents, file_size, tail_block));
    }
    // A write past end-of-file leaves the old EOF block's tail inside the file: zero it.
    if file_size % BLOCK_SIZE != 0 {
        let eof_block = file_size - file_size % BLOCK_SIZE;
        if eof_block < block_off {
            let b = rmw_block(extents, file_size, eof_block);
            if b.old_dev_off.is_some() {
                rmw.push(b);
            }
        }
    }
    rmw.sort_unstable_by_key(|b| b.file_off);

    let plan = WritePlan {
        block_off,
        block_len: block_end - block_off,
        segments,
        rmw,
        new_size: file_size.max(end),
    };
    // Postconditions: the segments tile the block range; every rmw block is block-aligned.
    let covered: u64 = plan
        .segments
        .iter()
        .map(|s| match *s {
            WriteSeg::Mapped { len, .. } | WriteSeg::Hole { len, .. } => len,
        })
        .sum();
    assert_eq!(covered, plan.block_len);
    assert!(plan.rmw.iter().all(|b| b.file_off % BLOCK_SIZE == 0));
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::SmallRng, Rng, SeedableRng};

    const B: u64 = BLOCK_SIZE;

    fn ext(file_blk: u64, blks: u64, dev_blk: u64, unwritten: bool) -> FileExtent {
        FileExtent {
            file_off: file_blk * B,
            len: blks * B,
            dev_off: dev_blk * B,
            unwritten,
        }
    }

    #[test]
    fn read_of_an_empty_map_is_zeros_clipped_at_eof() {
        assert_eq!(
            plan_read(&[], 10_000, 0, 1 << 20).unwrap(),
            vec![ReadSpan::Zero { len: 10_000 }]
        );
        assert_eq!(plan_read(&[], 10_000, 10_000, 5).unwrap(), vec![]);
        assert_eq!(plan_read(&[], 10_000, 20_000, 5).unwrap(), vec![]);
        assert_eq!(plan_read(&[], 10_000, 0, 0).unwrap(), vec![]);
        assert_eq!(
            plan_read(&[], 10_000, 9_999, u64::MAX).unwrap(),
            vec![ReadSpan::Zero { len: 1 }]
        );
    }

    #[test]
    fn read_through_holes_unwritten_and_unaligned_edges() {
        // blocks 0-1 at dev 100, hole at 2, block 3 unwritten, blocks 4-5 at dev 200.
        let map = [
            ext(0, 2, 100, false),
            ext(3, 1, 50, true),
            ext(4, 2, 200, false),
        ];
        let size = 5 * B + 10;
        let got = plan_read(&map, size, 100, 6 * B).unwrap();
        assert_eq!(
            got,
            vec![
                ReadSpan::Device {
                    dev_off: 100 * B + 100,
                    len: 2 * B - 100
                },
                ReadSpan::Zero { len: 2 * B },
                ReadSpan::Device {
                    dev_off: 200 * B,
                    len: B + 10
                },
            ]
        );
        // Inside one block.
        let got = plan_read(&map, size, B + 5, 10).unwrap();
        assert_eq!(
            got,
            vec![ReadSpan::Device {
                dev_off: 101 * B + 5,
                len: 10
            }]
        );
        // Entirely in the hole.
        assert_eq!(
            plan_read(&map, size, 2 * B + 1, 3).unwrap(),
            vec![ReadSpan::Zero { len: 3 }]
        );
    }

    #[test]
    fn physically_contiguous_extents_merge() {
        let map = [
            ext(0, 1, 10, false),
            ext(1, 1, 11, false),
            ext(2, 1, 40, false),
        ];
        let got = plan_read(&map, 3 * B, 0, 3 * B).unwrap();
        assert_eq!(
            got,
            vec![
                ReadSpan::Device {
                    dev_off: 10 * B,
                    len: 2 * B
                },
                ReadSpan::Device {
                    dev_off: 40 * B,
                    len: B
                },
            ]
        );
    }

    #[test]
    fn bad_maps_are_errors_not_panics() {
        let overlap = [ext(0, 2, 10, false), ext(1, 1, 20, false)];
        assert!(matches!(
            plan_read(&overlap, B * 4, 0, 1),
            Err(PlanError::Overlap(..))
        ));
        let unaligned = [FileExtent {
            file_off: 1,
            len: B,
            dev_off: 0,
            unwritten: false,
        }];
        assert!(matches!(
            plan_read(&unaligned, B * 4, 0, 1),
            Err(PlanError::BadExtent(_))
        ));
        let huge = [FileExtent {
            file_off: 0,
            len: u64::MAX - 4095,
            dev_off: B,
            unwritten: false,
        }];
        assert!(plan_write(&huge, 0, 0, 1).is_err());
        let empty = [FileExtent {
            file_off: 0,
            len: 0,
            dev_off: 0,
            unwritten: false,
        }];
        assert!(check_extents(&empty).is_err());
    }

    #[test]
    fn aligned_write_into_a_hole_allocates_it_all() {
        let p = plan_write(&[], 0, 0, 3 * B).unwrap();
        assert_eq!(
            p.segments,
            vec![WriteSeg::Hole {
                file_off: 0,
                len: 3 * B
            }]
        );
        assert_eq!(p.alloc_blocks(), 3);
        assert!(p.rmw.is_empty());
        assert_eq!(p.new_size, 3 * B);
    }

    #[test]
    fn unaligned_write_over_written_data_reads_the_edges() {
        let map = [ext(0, 4, 100, false)];
        let p = plan_write(&map, 4 * B, B + 10, 2 * B).unwrap();
        assert_eq!((p.block_off, p.block_len), (B, 3 * B));
        assert_eq!(
            p.segments,
            vec![WriteSeg::Mapped {
                file_off: B,
                len: 3 * B,
                dev_off: 101 * B,
                unwritten: false
            }]
        );
        assert_eq!(
            p.rmw,
            vec![
                RmwBlock {
                    file_off: B,
                    old_dev_off: Some(101 * B),
                    keep_bytes: B
                },
                RmwBlock {
                    file_off: 3 * B,
                    old_dev_off: Some(103 * B),
                    keep_bytes: B
                },
            ]
        );
        assert_eq!(p.alloc_blocks(), 0);
        assert_eq!(p.new_size, 4 * B);
    }

    #[test]
    fn small_write_inside_one_block() {
        let map = [ext(0, 1, 7, false)];
        let p = plan_write(&map, 100, 10, 5).unwrap();
        assert_eq!(
            p.rmw,
            vec![RmwBlock {
                file_off: 0,
                old_dev_off: Some(7 * B),
                keep_bytes: 100
            }]
        );
        assert_eq!(p.new_size, 100);
        // Same, into a hole: no read, start from zeros.
        let p = plan_write(&[], 100, 10, 5).unwrap();
        assert_eq!(
            p.rmw,
            vec![RmwBlock {
                file_off: 0,
                old_dev_off: None,
                keep_bytes: 100
            }]
        );
        assert_eq!(p.alloc_blocks(), 1);
        // Into an unwritten extent: no read, the segment says to convert it.
        let map = [ext(0, 1, 7, true)];
        let p = plan_write(&map, 100, 10, 5).unwrap();
        assert_eq!(p.rmw[0].old_dev_off, None);
        assert!(matches!(
            p.segments[0],
            WriteSeg::Mapped {
                unwritten: true,
                ..
            }
        ));
    }

    #[test]
    fn write_past_eof_zeroes_the_old_eof_block_tail() {
        // File of 100 bytes in block 0; write at block 2.
        let map = [ext(0, 1, 9, false)];
        let p = plan_write(&map, 100, 2 * B + 5, 10).unwrap();
        assert_eq!(
            p.rmw,
            vec![
                RmwBlock {
                    file_off: 0,
                    old_dev_off: Some(9 * B),
                    keep_bytes: 100
                },
                RmwBlock {
                    file_off: 2 * B,
                    old_dev_off: None,
                    keep_bytes: 0
                },
            ]
        );
        assert_eq!(
            p.segments,
            vec![WriteSeg::Hole {
                file_off: 2 * B,
                len: B
            }]
        );
        assert_eq!(p.new_size, 2 * B + 15);
        // A head block partly past EOF keeps only the bytes before EOF.
        let map = [ext(0, 2, 9, false)];
        let p = plan_write(&map, B + 100, B + 200, 10).unwrap();
        assert_eq!(
            p.rmw,
            vec![RmwBlock {
                file_off: B,
                old_dev_off: Some(10 * B),
                keep_bytes: 100
            }]
        );
    }

    #[test]
    fn write_spanning_mapped_and_holes() {
        let map = [ext(1, 1, 50, false), ext(3, 2, 60, true)];
        let p = plan_write(&map, 5 * B, 0, 6 * B).unwrap();
        assert_eq!(
            p.segments,
            vec![
                WriteSeg::Hole {
                    file_off: 0,
                    len: B
                },
                WriteSeg::Mapped {
                    file_off: B,
                    len: B,
                    dev_off: 50 * B,
                    unwritten: false
                },
                WriteSeg::Hole {
                    file_off: 2 * B,
                    len: B
                },
                WriteSeg::Mapped {
                    file_off: 3 * B,
                    len: 2 * B,
                    dev_off: 60 * B,
                    unwritten: true
                },
                WriteSeg::Hole {
                    file_off: 5 * B,
                    len: B
                },
            ]
        );
        assert_eq!(p.alloc_blocks(), 3);
        assert_eq!(p.holes().count(), 3);
    }

    #[test]
    fn aligned_cover_edges() {
        assert_eq!(aligned_cover(0, B), (0, B, 0));
        assert_eq!(aligned_cover(10, 5), (0, B, 10));
        assert_eq!(aligned_cover(B - 1, 2), (0, 2 * B, B - 1));
        assert_eq!(aligned_cover(3 * B, 0), (3 * B, 0, 0));
    }

    /// Random maps and reads checked against a byte model of the file and the device.
    #[test]
    fn read_plans_match_a_byte_model() {
        let mut rng = SmallRng::seed_from_u64(3);
        let dev_blocks = 64u64;
        // Device block d holds byte value (d + 1).
        let dev_byte = |off: u64| (off / B + 1) as u8;
        for _ in 0..2000 {
            let mut map = Vec::new();
            let mut fb = 0;
            while fb < 12 {
                fb += rng.gen_range(0..3);
                let n = rng.gen_range(1..4);
                map.push(ext(
                    fb,
                    n,
                    rng.gen_range(0..dev_blocks - n),
                    rng.gen_bool(0.2),
                ));
                fb += n;
            }
            let size = rng.gen_range(0..16 * B);
            let off = rng.gen_range(0..17 * B);
            let len = rng.gen_range(0..5 * B);
            let spans = plan_read(&map, size, off, len).unwrap();
            let mut got = Vec::new();
            for s in spans {
                match s {
                    ReadSpan::Zero { len } => got.extend(std::iter::repeat_n(0u8, len as usize)),
                    ReadSpan::Device { dev_off, len } => {
                        got.extend((dev_off..dev_off + len).map(dev_byte));
                    }
                }
            }
            let end = (off + len).min(size);
            let want: Vec<u8> = (off..end.max(off))
                .map(
                    |o| match map.iter().find(|e| e.file_off <= o && o < e.file_end()) {
                        Some(e) if !e.unwritten => dev_byte(e.dev_off + (o - e.file_off)),
                        _ => 0,
                    },
                )
                .collect();
            assert_eq!(got, want, "map {map:?} size {size} off {off} len {len}");
        }
    }

    #[test]
    fn written_run_after_stops_at_a_gap_unwritten_space_or_eof() {
        let b = BLOCK_SIZE;
        let ext = |file_off: u64, len: u64, dev_off: u64, unwritten: bool| FileExtent {
            file_off: file_off * b,
            len: len * b,
            dev_off: dev_off * b,
            unwritten,
        };
        // Blocks 0-3 at 100-103, 4-5 at 200-201 (elsewhere), 6 unwritten at 202.
        let map = [
            ext(0, 4, 100, false),
            ext(4, 2, 200, false),
            ext(6, 1, 202, true),
        ];
        assert_eq!(written_run_after(&map, 7 * b, 0, 100 * b, 8), 3);
        assert_eq!(written_run_after(&map, 7 * b, 0, 100 * b, 2), 2);
        assert_eq!(written_run_after(&map, 7 * b, 4 * b, 200 * b, 8), 1);
        // EOF inside block 2: only whole blocks before it come along.
        assert_eq!(written_run_after(&map, 2 * b + 10, 0, 100 * b, 8), 1);
        assert_eq!(written_run_after(&map, 7 * b, 3 * b, 103 * b, 8), 0);
    }
}
