//! A file's physical layout as its identity: files whose every byte comes
//! from the same place on disk (snapshots of one file, reflink copies,
//! files an earlier run shared) hold the same bytes, so one read serves
//! them all.
//!
//! Invariants:
//! - A key is made only from shared extents (FIEMAP's `SHARED` on every
//!   extent): a file whose extents nobody else references can meet no
//!   other file with its key, so it costs no memory in the run's map.
//!   Shared extents are never overwritten in place (btrfs and XFS copy a
//!   shared extent on write), so while two files reference them they read
//!   the same bytes.
//! - A key covers every extent with its logical offset, physical address,
//!   length and whether it is unwritten (reads as zeros), and the file's
//!   size; holes are the gaps between extents.
//! - FIEMAP does not say where in a compressed (btrfs `ENCODED`) extent a
//!   file's range starts, so a file with one is keyed by its btrfs file
//!   extent items instead (`TREE_SEARCH_V2`, root only), which do; where
//!   those can not be read the file has no key and is read.
//! - Data in metadata (inline), delayed allocation and unknown places have
//!   no address: no key.
//! - Only the bytes before the file's size count: space kept past the end
//!   (XFS's speculative preallocation, `fallocate --keep-size`) is never
//!   read, so it neither makes nor spoils a key, and an extent crossing
//!   the end counts up to it.
//!
//! A key match is not trusted alone: [`crate::hash_files`] reuses an
//! earlier file's digests only when the later file has not changed since
//! before the earlier one was read (see `hash::reusable`), and the kernel
//! compares bytes again before any dedupe.

use std::fs::File;
use std::os::fd::AsFd;

use onecopy_ioctl::btrfs::{self, FileExtent, FileExtentKind};
use onecopy_ioctl::fiemap::{self, flags, Extent};

/// The layout key of `f` (inode `ino`, `size` bytes), if it has one.
pub fn key(f: &File, ino: u64, size: u64) -> Option<u128> {
    let extents = before_end(&fiemap::fiemap(f.as_fd()).ok()?, size);
    if !keyable(&extents) {
        return None;
    }
    if extents.iter().any(|e| e.flags & flags::ENCODED != 0) {
        let items = btrfs::file_extents(f.as_fd(), ino).ok()?;
        return btrfs_key(&items, size);
    }
    Some(fiemap_key(&extents, size))
}

/// The parts of `extents` that hold a file's `size` bytes: those that
/// start before the end, cut at it.
fn before_end(extents: &[Extent], size: u64) -> Vec<Extent> {
    extents
        .iter()
        .filter(|e| e.logical < size)
        .map(|e| Extent {
            length: e.length.min(size - e.logical),
            ..*e
        })
        .collect()
}

/// Whether a FIEMAP answer can make a key: not empty, every extent shared
/// and at a real address.
fn keyable(extents: &[Extent]) -> bool {
    !extents.is_empty()
        && extents
            .iter()
            .all(|e| e.is_shared() && !e.is_undedupable() && e.physical != 0)
}

/// The key of a FIEMAP answer. Pieces contiguous in the file and on disk
/// (and alike written or not) count as one: the filesystem may keep one
/// mapping as several records (a shared copy as its remaps, the original
/// as its allocations), and the bytes are the same either way.
fn fiemap_key(extents: &[Extent], size: u64) -> u128 {
    let mut merged: Vec<(u64, u64, u64, bool)> = Vec::with_capacity(extents.len());
    for e in extents {
        let piece = (e.logical, e.physical, e.length, e.is_unwritten());
        match merged.last_mut() {
            Some(l) if l.0 + l.2 == piece.0 && l.1 + l.2 == piece.1 && l.3 == piece.3 => {
                l.2 += piece.2
            }
            _ => merged.push(piece),
        }
    }
    let mut b = Vec::with_capacity(8 + merged.len() * 25);
    b.push(b'F');
    b.extend_from_slice(&size.to_le_bytes());
    for (logical, physical, length, unwritten) in merged {
        b.extend_from_slice(&logical.to_le_bytes());
        b.extend_from_slice(&physical.to_le_bytes());
        b.extend_from_slice(&length.to_le_bytes());
        b.push(unwritten as u8);
    }
    xxhash_rust::xxh3::xxh3_128(&b)
}

/// The key from btrfs file extent items (those before the end, cut at
/// it); `None` when one is inline or of an unknown kind.
fn btrfs_key(items: &[FileExtent], size: u64) -> Option<u128> {
    let mut b = Vec::with_capacity(8 + items.len() * 43);
    b.push(b'B');
    b.extend_from_slice(&size.to_le_bytes());
    for i in items.iter().filter(|i| i.file_offset < size) {
        let kind = match i.kind {
            FileExtentKind::Regular => 1u8,
            FileExtentKind::Prealloc => 2,
            FileExtentKind::Inline | FileExtentKind::Unknown(_) => return None,
        };
        b.push(kind);
        b.push(i.compression);
        for v in [
            i.file_offset,
            i.disk_bytenr,
            i.disk_num_bytes,
            i.offset,
            i.num_bytes.min(size - i.file_offset),
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
    }
    Some(xxhash_rust::xxh3::xxh3_128(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(logical: u64, physical: u64, length: u64, flags: u32) -> Extent {
        Extent {
            logical,
            physical,
            length,
            flags,
        }
    }

    #[test]
    fn only_wholly_shared_extents_at_real_addresses_make_a_key() {
        let s = flags::SHARED;
        assert!(keyable(&[
            ext(0, 4096, 8192, s),
            ext(8192, 1 << 20, 4096, s | flags::LAST)
        ]));
        assert!(!keyable(&[]), "no extent (a hole or inline)");
        assert!(
            !keyable(&[ext(0, 4096, 8192, s), ext(8192, 65536, 4096, 0)]),
            "one unshared"
        );
        assert!(
            !keyable(&[ext(0, 0, 4096, s | flags::DATA_INLINE)]),
            "inline"
        );
        assert!(
            !keyable(&[ext(0, 0, 4096, s | flags::DELALLOC)]),
            "no address yet"
        );
    }

    #[test]
    fn pieces_contiguous_in_the_file_and_on_disk_key_as_one() {
        let s = flags::SHARED;
        let one = [ext(0, 4096, 12288, s)];
        let split = [
            ext(0, 4096, 8192, s),
            ext(8192, 12288, 4096, s | flags::LAST),
        ];
        assert_eq!(fiemap_key(&one, 12288), fiemap_key(&split, 12288));
        let apart = [ext(0, 4096, 8192, s), ext(8192, 16384, 4096, s)];
        assert_ne!(fiemap_key(&one, 12288), fiemap_key(&apart, 12288));
        let unwritten = [
            ext(0, 4096, 8192, s),
            ext(8192, 12288, 4096, s | flags::UNWRITTEN),
        ];
        assert_ne!(fiemap_key(&one, 12288), fiemap_key(&unwritten, 12288));
    }

    #[test]
    fn a_key_changes_with_any_address_offset_length_size_or_unwritten() {
        let s = flags::SHARED;
        let base = [ext(0, 4096, 8192, s), ext(8192, 1 << 20, 8192, s)];
        let k = fiemap_key(&base, 16384);
        let flagged = [
            ext(0, 4096, 8192, s | flags::MERGED),
            ext(8192, 1 << 20, 8192, s | flags::LAST),
        ];
        assert_eq!(
            fiemap_key(&flagged, 16384),
            k,
            "sharing and bookkeeping flags do not count"
        );
        let mut variants = vec![fiemap_key(&base, 16385)];
        for i in 0..2 {
            for f in 0..4 {
                let mut v = base;
                match f {
                    0 => v[i].logical += 4096,
                    1 => v[i].physical += 4096,
                    2 => v[i].length -= 4096,
                    _ => v[i].flags |= flags::UNWRITTEN,
                }
                variants.push(fiemap_key(&before_end(&v, 16384), 16384));
            }
        }
        assert!(variants.iter().all(|&v| v != k));
    }

    #[test]
    fn space_past_the_end_does_not_count() {
        let s = flags::SHARED;
        let bare = [ext(0, 4096, 8192, s)];
        let kept = [
            ext(0, 4096, 8192, s),
            ext(8192, 1 << 20, 8192, flags::UNWRITTEN | flags::LAST),
        ];
        let crossing = [ext(0, 4096, 12288, s)];
        for extents in [&bare[..], &kept, &crossing] {
            let e = before_end(extents, 8192);
            assert!(keyable(&e), "{extents:?}");
            assert_eq!(fiemap_key(&e, 8192), fiemap_key(&bare, 8192));
        }
        assert!(!keyable(&before_end(&bare, 0)), "nothing to key");
    }

    #[test]
    fn compressed_extents_are_told_apart_by_their_offset_in_the_extent() {
        let item = |offset| FileExtent {
            file_offset: 0,
            kind: FileExtentKind::Regular,
            compression: 3,
            disk_bytenr: 1 << 20,
            disk_num_bytes: 16384,
            offset,
            num_bytes: 65536,
            ram_bytes: 131072,
        };
        let a = btrfs_key(&[item(0)], 65536).unwrap();
        assert_eq!(btrfs_key(&[item(0)], 65536), Some(a));
        assert_ne!(btrfs_key(&[item(65536)], 65536), Some(a));
        let kept = FileExtent {
            file_offset: 65536,
            kind: FileExtentKind::Prealloc,
            ..item(0)
        };
        assert_eq!(btrfs_key(&[item(0), kept], 65536), Some(a), "past the end");
        let inline = FileExtent {
            kind: FileExtentKind::Inline,
            ..item(0)
        };
        assert_eq!(btrfs_key(&[inline], 65536), None);
    }
}
