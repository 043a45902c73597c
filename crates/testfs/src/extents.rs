//! Extent-sharing checks from FIEMAP: which physical bytes files reference
//! and how much of one file lives where another's data is.
//!
//! Physical addresses are what FIEMAP reports: device offsets on XFS, btrfs
//! logical addresses on btrfs. Both are comparable between files of the same
//! filesystem. Extents the filesystem can not place (inline data, delayed
//! allocation, unknown location) are ignored: they occupy no shareable
//! space. For compressed btrfs extents FIEMAP reports the logical length,
//! so byte counts are approximate there.

use std::fs::File;
use std::os::fd::AsFd;
use std::path::Path;

use std::os::unix::fs::MetadataExt;

use onecopy_ioctl::btrfs::{self, FileExtent, FileExtentKind};
use onecopy_ioctl::fiemap::{self, Extent};

/// A half-open byte range `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Range {
    pub start: u64,
    pub end: u64,
}

impl Range {
    pub fn len(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
}

/// Every FIEMAP extent of `path` that holds file data, in logical order
/// (dirty data is flushed first so fresh files have real addresses).
/// Extents that start at or past the end of the file are left out: XFS
/// keeps speculative preallocation there (an unwritten extent) after a
/// file is appended to by repeated opens, and it is not the file's data.
///
/// # Panics
/// If the file can not be opened or the filesystem has no FIEMAP.
pub fn extents(path: &Path) -> Vec<Extent> {
    let f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let size = f
        .metadata()
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .len();
    let mut all =
        fiemap::fiemap(f.as_fd()).unwrap_or_else(|e| panic!("FIEMAP {}: {e}", path.display()));
    all.retain(|e| e.logical < size);
    all
}

/// The extents of `path` that have a real physical location (not inline,
/// delayed, unknown or encrypted).
///
/// # Panics
/// As [`extents`].
pub fn data_extents(path: &Path) -> Vec<Extent> {
    extents(path)
        .into_iter()
        .filter(|e| !e.is_undedupable() && e.length > 0)
        .collect()
}

/// Sorted, merged physical ranges referenced by `path`.
///
/// # Panics
/// As [`extents`].
pub fn physical_ranges(path: &Path) -> Vec<Range> {
    merge(
        data_extents(path)
            .iter()
            .map(|e| Range {
                start: e.physical,
                end: e.physical.saturating_add(e.length),
            })
            .collect(),
    )
}

/// Sorts and merges overlapping or touching ranges.
fn merge(mut v: Vec<Range>) -> Vec<Range> {
    v.retain(|r| !r.is_empty());
    v.sort_unstable();
    let mut out: Vec<Range> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Bytes of `r` that fall inside the sorted, merged set `set`.
fn overlap(set: &[Range], r: Range) -> u64 {
    // First range that ends after r.start.
    let i = set.partition_point(|s| s.end <= r.start);
    set[i..]
        .iter()
        .take_while(|s| s.start < r.end)
        .map(|s| s.end.min(r.end).saturating_sub(s.start.max(r.start)))
        .sum()
}

/// Bytes of file `b` whose physical location is also referenced by file `a`
/// (counted per logical byte of `b`).
///
/// # Panics
/// As [`extents`].
pub fn shared_bytes_between(a: &Path, b: &Path) -> u64 {
    let set = physical_ranges(a);
    data_extents(b)
        .iter()
        .map(|e| {
            overlap(
                &set,
                Range {
                    start: e.physical,
                    end: e.physical.saturating_add(e.length),
                },
            )
        })
        .sum()
}

/// Size of the union of the physical ranges referenced by `paths`: the
/// space their data occupies (each shared byte counted once).
///
/// # Panics
/// As [`extents`].
pub fn physical_bytes<I, P>(paths: I) -> u64
where
    I: IntoIterator<Item = P>,
    P: AsRef<Path>,
{
    let mut all = Vec::new();
    for p in paths {
        all.extend(physical_ranges(p.as_ref()));
    }
    merge(all).iter().map(Range::len).sum()
}

/// Whether all of `b`'s data lives at physical addresses `a` also
/// references: every byte of `b` up to its size is mapped (holes aside) and
/// lies inside `a`'s physical ranges. An empty `b` counts as shared; a `b`
/// with inline or unplaced data does not.
///
/// # Panics
/// As [`extents`].
pub fn is_fully_shared(a: &Path, b: &Path) -> bool {
    let all = extents(b);
    if all.iter().any(|e| e.is_undedupable()) {
        return false;
    }
    let set = physical_ranges(a);
    all.iter().all(|e| {
        overlap(
            &set,
            Range {
                start: e.physical,
                end: e.physical.saturating_add(e.length),
            },
        ) == e.length
    })
}

/// Bytes of `path` in extents the filesystem flags as shared
/// (`FIEMAP_EXTENT_SHARED`: referenced by another file or snapshot).
///
/// # Panics
/// As [`extents`].
pub fn shared_flag_bytes(path: &Path) -> u64 {
    extents(path)
        .iter()
        .filter(|e| e.is_shared())
        .map(|e| e.length)
        .sum()
}

/// The btrfs file extent items of `path` (needs root): unlike FIEMAP,
/// these show every item, even physically adjacent ones, and the full size
/// of the on-disk extent each item pins.
///
/// # Panics
/// On I/O errors or when `path` is not on btrfs.
pub fn btrfs_extent_items(path: &Path) -> Vec<FileExtent> {
    let f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let ino = f
        .metadata()
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .ino();
    btrfs::file_extents(f.as_fd(), ino)
        .unwrap_or_else(|e| panic!("btrfs tree search {}: {e}", path.display()))
}

/// Bytes of disk the files pin on btrfs: the union of the *whole* on-disk
/// extents their items reference (`disk_bytenr .. + disk_num_bytes`). Unlike
/// [`physical_bytes`] this counts the unreferenced rest of a partly
/// referenced ("bookended") extent, which btrfs can not free.
///
/// # Panics
/// As [`btrfs_extent_items`].
pub fn btrfs_pinned_bytes<I, P>(paths: I) -> u64
where
    I: IntoIterator<Item = P>,
    P: AsRef<Path>,
{
    let mut all = Vec::new();
    for p in paths {
        all.extend(
            btrfs_extent_items(p.as_ref())
                .iter()
                .filter(|e| {
                    e.disk_bytenr != 0
                        && matches!(e.kind, FileExtentKind::Regular | FileExtentKind::Prealloc)
                })
                .map(|e| Range {
                    start: e.disk_bytenr,
                    end: e.disk_bytenr.saturating_add(e.disk_num_bytes),
                }),
        );
    }
    merge(all).iter().map(Range::len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(start: u64, end: u64) -> Range {
        Range { start, end }
    }

    #[test]
    fn merges() {
        assert_eq!(
            merge(vec![r(10, 20), r(0, 5), r(5, 8), r(15, 30), r(40, 40)]),
            vec![r(0, 8), r(10, 30)]
        );
    }

    #[test]
    fn overlaps() {
        let set = merge(vec![r(0, 10), r(20, 30), r(40, 50)]);
        assert_eq!(overlap(&set, r(5, 45)), 5 + 10 + 5);
        assert_eq!(overlap(&set, r(10, 20)), 0);
        assert_eq!(overlap(&set, r(0, 100)), 30);
        assert_eq!(overlap(&[], r(0, 100)), 0);
    }
}
