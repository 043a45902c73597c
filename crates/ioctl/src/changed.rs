//! What changed on a btrfs subvolume since a transaction, without a walk:
//! a tree search of the subvolume's fs tree with a minimum transid (the
//! kernel skips every tree block older than it), keeping inode items whose
//! own `transid` is at least that, then the paths of those inodes
//! (`BTRFS_IOC_INO_PATHS`). Both need CAP_SYS_ADMIN.
//!
//! An inode item is rewritten with the running transaction's id whenever
//! the inode's data or metadata change: a write, a truncate, a rename
//! (ctime), a new link. So "inode items with transid >= T" is every file
//! created, written, renamed or moved within the subvolume in or after
//! transaction T.

use std::io;
use std::os::fd::BorrowedFd;

use crate::btrfs::{tree_search, tree_search_in, Cursor, Item, SearchKey};
use crate::bytes::{le_u32_at, le_u64_at, u32_at, u64_at};
use crate::AlignedBuf;

/// `_IOWR(0x94, 35, struct btrfs_ioctl_ino_path_args)`.
const BTRFS_IOC_INO_PATHS: libc::c_ulong = 0xC038_9423;
const INODE_ITEM_KEY: u32 = 1;
const FIRST_FREE_OBJECTID: u64 = 256;
/// `struct btrfs_inode_item`: transid, size and mode.
const INODE_TRANSID: usize = 8;
const INODE_SIZE: usize = 16;
const INODE_MODE: usize = 52;
const INODE_SEQUENCE: usize = 72;
const INODE_ATIME: usize = 112;
const INODE_CTIME: usize = 124;
const INODE_ITEM_SIZE: usize = 160;

/// An inode whose item was written in or after the searched transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChangedInode {
    pub ino: u64,
    /// The transaction that last wrote the inode item.
    pub transid: u64,
    /// `st_mode` (file type and permissions).
    pub mode: u32,
    /// `st_size`.
    pub size: u64,
    /// ctime, seconds: moves with every change but an atime update (which
    /// also rewrites the inode item).
    pub ctime_sec: u64,
    /// A hash of the inode item but its transid, `sequence` and atime:
    /// equal for two items that differ at most by reads or dedupes since
    /// (which move neither ctime nor mtime; generation, size, links, mode,
    /// flags, ctime and mtime to the nanosecond all equal): the same
    /// bytes, not always the same extents. Compared within one run only.
    pub stable: u64,
}

/// [`ChangedInode::stable`] of an inode item.
fn stable_hash(item: &[u8]) -> u64 {
    use std::hash::{DefaultHasher, Hasher};
    let mut h = DefaultHasher::new();
    h.write(&item[..INODE_TRANSID]);
    h.write(&item[INODE_TRANSID + 8..INODE_SEQUENCE]);
    h.write(&item[INODE_SEQUENCE + 8..INODE_ATIME]);
    h.write(&item[INODE_ATIME + 12..INODE_ITEM_SIZE]);
    h.finish()
}

impl ChangedInode {
    pub fn is_regular(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }

    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }
}

/// A malformed answer.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ChangedDecodeError {
    #[error("tree search item {index} runs past the buffer")]
    Truncated { index: usize },
    #[error("inode item {index} too short ({len} bytes)")]
    ShortInode { index: usize, len: u32 },
    #[error("directory entry {index} too short ({len} bytes)")]
    ShortDirItem { index: usize, len: u32 },
    #[error("inode path {index} lies outside the answer")]
    BadPath { index: usize },
}

/// [`crate::btrfs::each_item`] with this module's error.
fn each_item<'a>(
    buf: &'a [u8],
    nr_items: u32,
    each: impl FnMut(usize, Item<'a>) -> Result<(), ChangedDecodeError>,
) -> Result<(), ChangedDecodeError> {
    let truncated = |index| ChangedDecodeError::Truncated { index };
    crate::btrfs::each_item(buf, nr_items, truncated, each).map(|_| ())
}

/// Decodes `nr_items` items of a `TREE_SEARCH_V2` answer, keeping inode
/// items with `transid >= min_transid`. Also returns the objectid of the
/// last item seen (the search goes on after it).
pub fn decode_changed_inodes(
    buf: &[u8],
    nr_items: u32,
    min_transid: u64,
) -> Result<(Vec<ChangedInode>, Option<u64>), ChangedDecodeError> {
    let mut out = Vec::new();
    let mut last = None;
    each_item(buf, nr_items, |index, it| {
        last = Some(it.objectid);
        if it.typ != INODE_ITEM_KEY {
            return Ok(());
        }
        let item = it.body;
        let short = ChangedDecodeError::ShortInode {
            index,
            len: item.len() as u32,
        };
        if item.len() < INODE_ITEM_SIZE {
            return Err(short);
        }
        let transid = le_u64_at(item, INODE_TRANSID).ok_or(short.clone())?;
        let mode = le_u32_at(item, INODE_MODE).ok_or(short.clone())?;
        let size = le_u64_at(item, INODE_SIZE).ok_or(short.clone())?;
        let ctime_sec = le_u64_at(item, INODE_CTIME).ok_or(short)?;
        if transid >= min_transid {
            out.push(ChangedInode {
                ino: it.objectid,
                transid,
                mode,
                size,
                ctime_sec,
                stable: stable_hash(item),
            });
        }
        Ok(())
    })?;
    Ok((out, last))
}

/// Every inode of the subvolume holding `fd` whose inode item was written
/// in transaction `min_transid` or later, in inode order. The cost follows
/// the amount changed, not the size of the subvolume: unchanged tree
/// blocks are not visited.
pub fn changed_inodes(fd: BorrowedFd<'_>, min_transid: u64) -> io::Result<Vec<ChangedInode>> {
    let key = SearchKey {
        tree: 0,
        objectid: (FIRST_FREE_OBJECTID, u64::MAX),
        offset: (0, u64::MAX),
        min_transid,
        types: (INODE_ITEM_KEY, u32::from(u8::MAX)),
    };
    // An inode has one inode item, its first item: once any item of
    // objectid N was seen, go on at N + 1.
    tree_search(fd, key, Cursor::Objectid, |items, nr| {
        decode_changed_inodes(items, nr, min_transid)
    })
}

/// The inode item of `ino` in the subvolume holding `fd`, if it has one.
pub fn inode_item(fd: BorrowedFd<'_>, ino: u64) -> io::Result<Option<ChangedInode>> {
    let key = SearchKey {
        tree: 0,
        objectid: (ino, ino),
        offset: (0, 0),
        min_transid: 0,
        types: (INODE_ITEM_KEY, INODE_ITEM_KEY),
    };
    // One inode item (160 bytes and its header) fits a small answer.
    let decode = |items: &[u8], nr| decode_changed_inodes(items, nr, 0);
    let found = tree_search_in(fd, key, Cursor::Objectid, decode, 1024)?;
    Ok(found.into_iter().find(|i| i.ino == ino))
}

/// `BTRFS_DIR_INDEX_KEY`: one item per directory entry, keyed by index.
const DIR_INDEX_KEY: u32 = 96;
/// `struct btrfs_dir_item`: the location key (objectid, type, offset),
/// transid, data_len, name_len, then the file type.
const DIR_ITEM_TYPE: usize = 29;
const DIR_ITEM_SIZE: usize = 30;
/// The location key type of an entry that is an inode of this tree (not
/// a subvolume's root, `BTRFS_ROOT_ITEM_KEY`).
const LOCATION_INODE: u8 = INODE_ITEM_KEY as u8;
/// `BTRFS_FT_REG_FILE` and `BTRFS_FT_DIR`.
pub const FT_REG_FILE: u8 = 1;
pub const FT_DIR: u8 = 2;

/// One entry of a directory: the inode it names and its file type
/// (`BTRFS_FT_*`: 1 regular, 2 directory, 7 symlink ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    pub file_type: u8,
}

/// Decodes `DIR_INDEX` items of a `TREE_SEARCH_V2` answer, leaving out
/// entries that are other subvolumes; also returns the last item's offset
/// (the entry index, where the search goes on).
pub fn decode_dir_entries(
    buf: &[u8],
    nr_items: u32,
) -> Result<(Vec<DirEntry>, Option<u64>), ChangedDecodeError> {
    let mut out = Vec::new();
    let mut last = None;
    each_item(buf, nr_items, |index, it| {
        last = Some(it.offset);
        if it.typ != DIR_INDEX_KEY {
            return Ok(());
        }
        let item = it.body;
        if item.len() < DIR_ITEM_SIZE {
            let len = item.len() as u32;
            return Err(ChangedDecodeError::ShortDirItem { index, len });
        }
        if item[8] == LOCATION_INODE {
            out.push(DirEntry {
                ino: le_u64_at(item, 0).unwrap_or(0),
                file_type: item[DIR_ITEM_TYPE],
            });
        }
        Ok(())
    })?;
    Ok((out, last))
}

/// The entries of directory `dir` in the subvolume holding `fd` (none if
/// it has no such directory), in index order.
pub fn dir_entries(fd: BorrowedFd<'_>, dir: u64) -> io::Result<Vec<DirEntry>> {
    let key = SearchKey {
        tree: 0,
        objectid: (dir, dir),
        offset: (0, u64::MAX),
        min_transid: 0,
        types: (DIR_INDEX_KEY, DIR_INDEX_KEY),
    };
    tree_search(fd, key, Cursor::Offset, decode_dir_entries)
}

/// The paths of inode `ino` (one per hard link) relative to the root of
/// the subvolume holding `fd`, without a leading slash. Paths that did not
/// fit the answer are left out.
pub fn inode_paths(fd: BorrowedFd<'_>, ino: u64) -> io::Result<Vec<Vec<u8>>> {
    const SIZE: usize = 16 << 10;
    let mut data = AlignedBuf::new(SIZE);
    let mut args = AlignedBuf::new(56);
    args.put_u64(0, ino);
    args.put_u64(8, SIZE as u64);
    // The kernel writes the answer through this pointer; `data` lives
    // until after the call.
    args.put_u64(48, data.as_mut_ptr() as u64);
    crate::ioctl_buf(fd, BTRFS_IOC_INO_PATHS, &mut args)?;
    decode_inode_paths(data.as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// `_IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)` (4096 bytes).
const BTRFS_IOC_INO_LOOKUP: libc::c_ulong = 0xD000_9412;

/// The path of directory inode `dir_ino` relative to the root of the
/// subvolume holding `fd`: empty for the subvolume root itself, else
/// components each followed by '/' (`BTRFS_IOC_INO_LOOKUP`).
pub fn dir_path_in_subvol(fd: BorrowedFd<'_>, dir_ino: u64) -> io::Result<Vec<u8>> {
    let mut buf = AlignedBuf::new(4096);
    buf.put_u64(0, 0);
    buf.put_u64(8, dir_ino);
    crate::ioctl_buf(fd, BTRFS_IOC_INO_LOOKUP, &mut buf)?;
    let name = &buf.as_bytes()[16..];
    let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(name[..len].to_vec())
}

/// Decodes a `struct btrfs_data_container` holding path offsets (relative
/// to the start of `val`) to NUL-terminated paths.
pub fn decode_inode_paths(buf: &[u8]) -> Result<Vec<Vec<u8>>, ChangedDecodeError> {
    const VAL: usize = 16;
    let count = u32_at(buf, 8).ok_or(ChangedDecodeError::Truncated { index: 0 })? as usize;
    let mut out = Vec::new();
    for index in 0..count {
        let bad = ChangedDecodeError::BadPath { index };
        let rel = u64_at(buf, VAL + index * 8).ok_or(bad.clone())?;
        let start = usize::try_from(rel)
            .ok()
            .and_then(|r| r.checked_add(VAL))
            .filter(|&s| s < buf.len())
            .ok_or(bad.clone())?;
        let len = buf[start..].iter().position(|&b| b == 0).ok_or(bad)?;
        out.push(buf[start..start + len].to_vec());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::btrfs::SEARCH_HEADER;
    use proptest::prelude::*;

    fn item(objectid: u64, typ: u32, body: &[u8]) -> Vec<u8> {
        let mut h = vec![0u8; SEARCH_HEADER];
        h[8..16].copy_from_slice(&objectid.to_ne_bytes());
        h[24..28].copy_from_slice(&typ.to_ne_bytes());
        h[28..32].copy_from_slice(&(body.len() as u32).to_ne_bytes());
        h.extend_from_slice(body);
        h
    }

    fn inode(transid: u64, mode: u32) -> Vec<u8> {
        let mut b = vec![0u8; INODE_ITEM_SIZE];
        b[INODE_TRANSID..INODE_TRANSID + 8].copy_from_slice(&transid.to_le_bytes());
        b[INODE_MODE..INODE_MODE + 4].copy_from_slice(&mode.to_le_bytes());
        // A size of its own, told apart from the transid.
        b[INODE_SIZE..INODE_SIZE + 8].copy_from_slice(&(transid ^ 0xff).to_le_bytes());
        b
    }

    #[test]
    fn keeps_new_inode_items_only() {
        let mut b = item(257, INODE_ITEM_KEY, &inode(10, 0o100644));
        b.extend(item(257, 108, &[0u8; 53]));
        b.extend(item(258, INODE_ITEM_KEY, &inode(3, 0o100644)));
        b.extend(item(259, INODE_ITEM_KEY, &inode(12, 0o040755)));
        let (v, last) = decode_changed_inodes(&b, 4, 10).unwrap();
        assert_eq!(last, Some(259));
        assert_eq!(v.len(), 2);
        assert_eq!((v[0].ino, v[0].transid, v[0].is_regular()), (257, 10, true));
        assert_eq!(v[0].size, 10 ^ 0xff);
        assert_eq!((v[1].ino, v[1].is_regular()), (259, false));
        assert_eq!(
            decode_changed_inodes(&b[..b.len() - 1], 4, 0),
            Err(ChangedDecodeError::Truncated { index: 3 })
        );
    }

    /// Items differing only in transid, sequence and atime hash alike; any
    /// other field tells them apart.
    #[test]
    fn the_stable_hash_ignores_transid_and_atime_only() {
        let decode = |body: &[u8]| {
            let b = item(257, INODE_ITEM_KEY, body);
            decode_changed_inodes(&b, 1, 0).unwrap().0[0].stable
        };
        let base = inode(10, 0o100644);
        let mut read = inode(11, 0o100644);
        read[INODE_SIZE..INODE_SIZE + 8].copy_from_slice(&base[INODE_SIZE..INODE_SIZE + 8]);
        read[INODE_ATIME] = 9;
        read[INODE_SEQUENCE] = 3;
        assert_eq!(decode(&base), decode(&read));
        for at in [0, 16, 24, 40, 52, 64, 124, 131, 136, 148] {
            let mut other = base.clone();
            other[at] ^= 1;
            assert_ne!(decode(&base), decode(&other), "byte {at}");
        }
    }

    #[test]
    fn decodes_dir_entries_but_subvolumes() {
        let entry = |ino: u64, location: u8, ft: u8| {
            let mut b = vec![0u8; DIR_ITEM_SIZE + 3];
            b[..8].copy_from_slice(&ino.to_le_bytes());
            b[8] = location;
            b[DIR_ITEM_TYPE] = ft;
            b
        };
        let at = |idx: u64, body: Vec<u8>| {
            let mut h = item(300, DIR_INDEX_KEY, &body);
            h[16..24].copy_from_slice(&idx.to_ne_bytes());
            h
        };
        let mut b = at(2, entry(301, 1, 1));
        b.extend(at(3, entry(302, 1, FT_DIR)));
        b.extend(at(4, entry(257, 132, FT_DIR))); // a subvolume
        let (v, last) = decode_dir_entries(&b, 3).unwrap();
        assert_eq!(last, Some(4));
        assert_eq!(
            v,
            vec![
                DirEntry {
                    ino: 301,
                    file_type: 1
                },
                DirEntry {
                    ino: 302,
                    file_type: FT_DIR
                }
            ]
        );
        assert!(decode_dir_entries(&b[..b.len() - 1], 3).is_err());
        let short = at(5, vec![0u8; 10]);
        assert!(decode_dir_entries(&short, 1).is_err());
    }

    #[test]
    fn decodes_paths() {
        let mut b = vec![0u8; 16];
        b[8..12].copy_from_slice(&2u32.to_ne_bytes());
        b.extend(16u64.to_ne_bytes());
        b.extend(20u64.to_ne_bytes());
        b.extend(b"a/b\0c\0");
        assert_eq!(
            decode_inode_paths(&b).unwrap(),
            vec![b"a/b".to_vec(), b"c".to_vec()]
        );
        b.pop();
        assert_eq!(
            decode_inode_paths(&b),
            Err(ChangedDecodeError::BadPath { index: 1 })
        );
    }

    proptest! {
        #[test]
        fn changed_inodes_decode_never_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..2048),
            nr in 0u32..64,
            min in any::<u64>(),
        ) {
            let _ = decode_changed_inodes(&bytes, nr, min);
        }

        #[test]
        fn changed_inodes_roundtrip(
            items in proptest::collection::vec((256u64..1 << 40, prop_oneof![Just(1u32), Just(12), Just(108)], any::<u64>(), any::<u32>()), 0..20),
            min in any::<u64>(),
        ) {
            let mut b = Vec::new();
            for &(o, t, tr, m) in &items {
                let body = if t == INODE_ITEM_KEY { inode(tr, m) } else { vec![1u8; 20] };
                b.extend(item(o, t, &body));
            }
            let (v, last) = decode_changed_inodes(&b, items.len() as u32, min).unwrap();
            let want: Vec<_> = items.iter().filter(|i| i.1 == INODE_ITEM_KEY && i.2 >= min).collect();
            prop_assert_eq!(v.len(), want.len());
            for (c, w) in v.iter().zip(want) {
                prop_assert_eq!((c.ino, c.transid, c.mode), (w.0, w.2, w.3));
            }
            prop_assert_eq!(last, items.last().map(|i| i.0));
        }

        #[test]
        fn dir_entries_decode_never_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..2048),
            nr in 0u32..64,
        ) {
            let _ = decode_dir_entries(&bytes, nr);
        }

        #[test]
        fn inode_paths_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
            let _ = decode_inode_paths(&bytes);
        }
    }
}
