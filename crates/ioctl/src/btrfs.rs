//! btrfs file extent items, read with `BTRFS_IOC_TREE_SEARCH_V2`
//! (needs CAP_SYS_ADMIN).
//!
//! FIEMAP shows only the part of an extent a file references. btrfs frees an
//! extent only when no byte of it is referenced any more, so finding space
//! pinned by partly referenced ("bookended") extents needs the full extent:
//! `disk_bytenr` and `disk_num_bytes` from the file extent item.

use std::io;
use std::os::fd::BorrowedFd;

use crate::bytes::{le_u64_at, u32_at, u64_at, u8_at};
use crate::AlignedBuf;

/// `_IOWR(0x94, 17, struct btrfs_ioctl_search_args_v2)`.
const BTRFS_IOC_TREE_SEARCH_V2: libc::c_ulong = 0xC070_9411;
const KEY: usize = 104; // struct btrfs_ioctl_search_key
const ARGS: usize = KEY + 8; // + buf_size
pub(crate) const SEARCH_HEADER: usize = 32;
const EXTENT_DATA_KEY: u32 = 108;
const BUF: usize = 64 * 1024;

/// `BTRFS_FILE_EXTENT_*` types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileExtentKind {
    Inline,
    Regular,
    Prealloc,
    Unknown(u8),
}

/// One file extent item: the file range `[file_offset, file_offset +
/// num_bytes)` reads from bytes `[offset, offset + num_bytes)` of the
/// on-disk extent `[disk_bytenr, disk_bytenr + disk_num_bytes)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileExtent {
    pub file_offset: u64,
    pub kind: FileExtentKind,
    pub compression: u8,
    /// Zero for a hole (no extent).
    pub disk_bytenr: u64,
    pub disk_num_bytes: u64,
    pub offset: u64,
    pub num_bytes: u64,
    pub ram_bytes: u64,
}

/// A malformed search answer.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("tree search item {index} runs past the buffer")]
    Truncated { index: usize },
    #[error("file extent item {index} too short ({len} bytes)")]
    ShortItem { index: usize, len: u32 },
}

/// One item of a search answer: its key and its body.
pub(crate) struct Item<'a> {
    pub objectid: u64,
    pub typ: u32,
    pub offset: u64,
    pub body: &'a [u8],
}

/// Calls `each(index, item)` for the `nr_items` items of a
/// `TREE_SEARCH_V2` answer, in order; an item running past the buffer is
/// `truncated(index)`. Returns the bytes the items took.
pub(crate) fn each_item<'a, E>(
    buf: &'a [u8],
    nr_items: u32,
    truncated: impl Fn(usize) -> E,
    mut each: impl FnMut(usize, Item<'a>) -> Result<(), E>,
) -> Result<usize, E> {
    let mut pos = 0usize;
    for index in 0..nr_items as usize {
        let header = (|| {
            let key = (
                u64_at(buf, pos + 8)?,
                u32_at(buf, pos + 24)?,
                u64_at(buf, pos + 16)?,
            );
            let start = pos + SEARCH_HEADER;
            let end = start
                .checked_add(u32_at(buf, pos + 28)? as usize)
                .filter(|&e| e <= buf.len())?;
            Some((key, start, end))
        })();
        let Some(((objectid, typ, offset), start, end)) = header else {
            return Err(truncated(index));
        };
        let body = &buf[start..end];
        each(
            index,
            Item {
                objectid,
                typ,
                offset,
                body,
            },
        )?;
        pos = end;
    }
    Ok(pos)
}

/// Decodes the items area of a `TREE_SEARCH_V2` answer holding `nr_items`
/// items, keeping EXTENT_DATA items. Returns the items and the key offset of
/// the last item seen (to continue the search from).
pub fn decode_items(
    buf: &[u8],
    nr_items: u32,
) -> Result<(Vec<FileExtent>, Option<u64>), DecodeError> {
    let mut out = Vec::new();
    let mut last = None;
    let truncated = |index| DecodeError::Truncated { index };
    each_item(buf, nr_items, truncated, |index, it| {
        last = Some(it.offset);
        if it.typ == EXTENT_DATA_KEY {
            let len = it.body.len() as u32;
            let x = decode_file_extent(it.body, it.offset);
            out.push(x.ok_or(DecodeError::ShortItem { index, len })?);
        }
        Ok(())
    })?;
    Ok((out, last))
}

fn decode_file_extent(item: &[u8], file_offset: u64) -> Option<FileExtent> {
    let ram_bytes = le_u64_at(item, 8)?;
    let compression = u8_at(item, 16)?;
    let kind = match u8_at(item, 20)? {
        0 => FileExtentKind::Inline,
        1 => FileExtentKind::Regular,
        2 => FileExtentKind::Prealloc,
        k => FileExtentKind::Unknown(k),
    };
    if kind == FileExtentKind::Inline {
        return Some(FileExtent {
            file_offset,
            kind,
            compression,
            disk_bytenr: 0,
            disk_num_bytes: 0,
            offset: 0,
            num_bytes: ram_bytes,
            ram_bytes,
        });
    }
    Some(FileExtent {
        file_offset,
        kind,
        compression,
        disk_bytenr: le_u64_at(item, 21)?,
        disk_num_bytes: le_u64_at(item, 29)?,
        offset: le_u64_at(item, 37)?,
        num_bytes: le_u64_at(item, 45)?,
        ram_bytes,
    })
}

/// All file extent items of the inode `ino` in the subvolume holding `fd`
/// (`fd` may be the file itself), in file-offset order.
pub fn file_extents(fd: BorrowedFd<'_>, ino: u64) -> io::Result<Vec<FileExtent>> {
    let key = SearchKey {
        tree: 0,
        objectid: (ino, ino),
        offset: (0, u64::MAX),
        min_transid: 0,
        types: (EXTENT_DATA_KEY, EXTENT_DATA_KEY),
    };
    tree_search(fd, key, Cursor::Offset, decode_items)
}

/// How far before a file offset the item covering it may start: the
/// largest file extent item btrfs writes (a preallocated extent, 256 MiB;
/// written data is cut at 128 MiB).
const ITEM_REACH: u64 = 256 << 20;

/// The file extent items of inode `ino` (in the subvolume holding `fd`)
/// that overlap file offsets `from..to`, in file-offset order. Asks only
/// for the items starting up to [`ITEM_REACH`] before `from`, and for all
/// from the file's start when none of those covers `from` (a hole there,
/// or an item longer than btrfs writes).
pub fn file_extents_in(
    fd: BorrowedFd<'_>,
    ino: u64,
    from: u64,
    to: u64,
) -> io::Result<Vec<FileExtent>> {
    let search = |lo: u64| {
        let key = SearchKey {
            tree: 0,
            objectid: (ino, ino),
            offset: (lo, to.saturating_sub(1)),
            min_transid: 0,
            types: (EXTENT_DATA_KEY, EXTENT_DATA_KEY),
        };
        tree_search(fd, key, Cursor::Offset, decode_items)
    };
    let overlaps = |x: &FileExtent| x.file_offset < to && x.file_offset + x.num_bytes > from;
    let lo = from.saturating_sub(ITEM_REACH);
    let mut items = search(lo)?;
    if lo > 0 && !items.iter().any(|x| x.file_offset <= from && overlaps(x)) {
        items = search(0)?;
    }
    items.retain(overlaps);
    Ok(items)
}

/// The key range of a `BTRFS_IOC_TREE_SEARCH_V2` search, each pair
/// inclusive. `max_transid` is always `u64::MAX`.
pub(crate) struct SearchKey {
    /// The tree searched: 0 for the subvolume of the searched fd.
    pub tree: u64,
    pub objectid: (u64, u64),
    pub offset: (u64, u64),
    /// Tree blocks (and so items) older than this transaction are skipped.
    pub min_transid: u64,
    pub types: (u32, u32),
}

/// The key field a paginated search moves forward through.
pub(crate) enum Cursor {
    /// Continue at the last item's objectid + 1 (one item per objectid).
    Objectid,
    /// Continue at the last item's offset + 1 (one objectid searched).
    Offset,
}

/// Runs `BTRFS_IOC_TREE_SEARCH_V2` over `key` page by page and returns
/// the items `decode` kept, in key order. `decode(items_area, nr_items)`
/// decodes one answer and returns its kept items and the `cursor` field of
/// the last item seen; the next page starts just past it. The search ends
/// when the kernel returns no items or the cursor would not move forward
/// (no item seen, `decode` returned no cursor, or overflow). A decode
/// error is `InvalidData`.
pub(crate) fn tree_search<T, E>(
    fd: BorrowedFd<'_>,
    key: SearchKey,
    cursor: Cursor,
    decode: impl FnMut(&[u8], u32) -> Result<(Vec<T>, Option<u64>), E>,
) -> io::Result<Vec<T>>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    tree_search_in(fd, key, cursor, decode, BUF)
}

/// The first answer of a search: most searches (one file's extents, one
/// inode) fit in it, and a larger buffer costs its zeroing on every call.
const FIRST_ANSWER: usize = 4096;

/// [`tree_search`] with answers of at most `size` bytes: a small one for
/// a search of one item, whose cost is then mostly the buffer's. The
/// first answer is at most [`FIRST_ANSWER`] bytes; a search that goes on
/// past it (or whose first item does not fit) continues with `size`.
pub(crate) fn tree_search_in<T, E>(
    fd: BorrowedFd<'_>,
    mut key: SearchKey,
    cursor: Cursor,
    mut decode: impl FnMut(&[u8], u32) -> Result<(Vec<T>, Option<u64>), E>,
    size: usize,
) -> io::Result<Vec<T>>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut out = Vec::new();
    let mut answer = size.min(FIRST_ANSWER);
    let mut buf = AlignedBuf::new(ARGS + answer);
    loop {
        // The kernel writes the answer area; only the arguments are ours.
        buf.as_mut_bytes()[..ARGS].fill(0);
        buf.put_u64(0, key.tree);
        buf.put_u64(8, key.objectid.0);
        buf.put_u64(16, key.objectid.1);
        buf.put_u64(24, key.offset.0);
        buf.put_u64(32, key.offset.1);
        buf.put_u64(40, key.min_transid);
        buf.put_u64(48, u64::MAX);
        buf.put_u32(56, key.types.0);
        buf.put_u32(60, key.types.1);
        buf.put_u32(64, 4096); // nr_items
        buf.put_u64(KEY, answer as u64);
        match crate::ioctl_buf(fd, BTRFS_IOC_TREE_SEARCH_V2, &mut buf) {
            Err(e) if e.raw_os_error() == Some(libc::EOVERFLOW) && answer < size => {
                (answer, buf) = (size, AlignedBuf::new(ARGS + size));
                continue;
            }
            r => r?,
        };
        let nr = u32_at(buf.as_bytes(), 64).unwrap_or(0);
        if nr == 0 {
            break;
        }
        let (items, last) = decode(&buf.as_bytes()[ARGS..ARGS + answer], nr)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        out.extend(items);
        let (at, end) = match cursor {
            Cursor::Objectid => (&mut key.objectid.0, key.objectid.1),
            Cursor::Offset => (&mut key.offset.0, key.offset.1),
        };
        // Past the range's end the kernel would answer nothing.
        match last.and_then(|l| l.checked_add(1)) {
            Some(next) if next > *at && next <= end => *at = next,
            _ => break,
        }
        if answer < size {
            (answer, buf) = (size, AlignedBuf::new(ARGS + size));
        }
    }
    Ok(out)
}

/// `_IOR(0x94, 31, struct btrfs_ioctl_fs_info_args)` (1024 bytes).
const BTRFS_IOC_FS_INFO: libc::c_ulong = 0x8400_941F;

/// The UUID of the btrfs filesystem holding `fd` (the same for all its
/// subvolumes, unlike `f_fsid`, into which btrfs mixes the subvolume).
pub fn fs_uuid(fd: BorrowedFd<'_>) -> io::Result<[u8; 16]> {
    let mut buf = AlignedBuf::new(1024);
    crate::ioctl_buf(fd, BTRFS_IOC_FS_INFO, &mut buf)?;
    let mut out = [0u8; 16];
    out.copy_from_slice(&buf.as_bytes()[16..32]);
    Ok(out)
}

/// `BTRFS_FS_INFO_FLAG_GENERATION`, in `btrfs_ioctl_fs_info_args.flags`.
const FS_INFO_FLAG_GENERATION: u64 = 1 << 1;
const FS_INFO_FLAGS: usize = 48;
const FS_INFO_GENERATION: usize = 56;

/// The generation (last committed transaction id) of the btrfs filesystem
/// holding `fd`. It moves with every commit that changed anything, so an
/// unchanged value means nothing on the filesystem changed; a change is
/// seen once committed (30 s by default, or at `sync`). Linux 5.10+;
/// `Unsupported` on older kernels.
pub fn fs_generation(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut buf = AlignedBuf::new(1024);
    buf.put_u64(FS_INFO_FLAGS, FS_INFO_FLAG_GENERATION);
    crate::ioctl_buf(fd, BTRFS_IOC_FS_INFO, &mut buf)?;
    let b = buf.as_bytes();
    if u64_at(b, FS_INFO_FLAGS).unwrap_or(0) & FS_INFO_FLAG_GENERATION == 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this kernel's BTRFS_IOC_FS_INFO reports no generation",
        ));
    }
    u64_at(b, FS_INFO_GENERATION)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "short answer"))
}

/// `_IOR(0x94, 60, struct btrfs_ioctl_get_subvol_info_args)` (504 bytes).
const BTRFS_IOC_GET_SUBVOL_INFO: libc::c_ulong = 0x81F8_943C;
const SUBVOL_INFO_SIZE: usize = 504;
/// Offsets in `struct btrfs_ioctl_get_subvol_info_args`: treeid u64 @0,
/// name[256] @8, parent_id @264, dirid @272, generation @280, flags @288,
/// uuid[16] @296, parent_uuid[16] @312, ctransid @344, otransid @352
/// (checked against the kernel's `include/uapi/linux/btrfs.h` with
/// `offsetof`).
const SUBVOL_INFO_FLAGS: usize = 288;
const SUBVOL_INFO_UUID: usize = 296;
const SUBVOL_INFO_PARENT_UUID: usize = 312;
const SUBVOL_INFO_CTRANSID: usize = 344;
const SUBVOL_INFO_OTRANSID: usize = 352;
/// `BTRFS_ROOT_SUBVOL_RDONLY` of the root item flags.
const BTRFS_SUBVOL_RDONLY: u64 = 1 << 0;

/// What `BTRFS_IOC_GET_SUBVOL_INFO` says about the subvolume holding a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SubvolInfo {
    /// Read-only (a read-only snapshot, or one made so with `btrfs
    /// property set ro`): its files must never be dedupe destinations.
    pub read_only: bool,
    /// A snapshot (made by `btrfs subvolume snapshot`, read-only or not):
    /// it records the UUID of the subvolume it was taken of
    /// (`parent_uuid`), which stays set after that subvolume is deleted.
    pub snapshot: bool,
    pub uuid: [u8; 16],
    /// The UUID of the subvolume this one is a snapshot of (zero if none).
    pub parent_uuid: [u8; 16],
    /// The transaction that created it: a snapshot holds its parent's
    /// state as of that transaction's commit.
    pub otransid: u64,
    /// The last transaction that changed it (its files or directories);
    /// `otransid` for a snapshot never changed since it was made.
    pub ctransid: u64,
}

impl SubvolInfo {
    /// Decodes the ioctl's answer; a short buffer says nothing (all false).
    pub fn decode(b: &[u8]) -> SubvolInfo {
        let flags = u64_at(b, SUBVOL_INFO_FLAGS).unwrap_or(0);
        let uuid_at = |at: usize| -> [u8; 16] {
            b.get(at..at + 16)
                .and_then(|u| u.try_into().ok())
                .unwrap_or_default()
        };
        let parent_uuid = uuid_at(SUBVOL_INFO_PARENT_UUID);
        SubvolInfo {
            read_only: flags & BTRFS_SUBVOL_RDONLY != 0,
            snapshot: parent_uuid != [0; 16],
            uuid: uuid_at(SUBVOL_INFO_UUID),
            parent_uuid,
            otransid: u64_at(b, SUBVOL_INFO_OTRANSID).unwrap_or(0),
            ctransid: u64_at(b, SUBVOL_INFO_CTRANSID).unwrap_or(0),
        }
    }
}

/// The facts of the btrfs subvolume holding `fd`, in one ioctl (Linux
/// 4.18+, unprivileged); an error on other filesystems.
pub fn subvol_info(fd: BorrowedFd<'_>) -> io::Result<SubvolInfo> {
    let mut buf = AlignedBuf::new(SUBVOL_INFO_SIZE);
    crate::ioctl_buf(fd, BTRFS_IOC_GET_SUBVOL_INFO, &mut buf)?;
    Ok(SubvolInfo::decode(buf.as_bytes()))
}

/// Whether the btrfs subvolume holding `fd` is read-only (a read-only
/// snapshot): its files must never be dedupe destinations.
pub fn subvol_read_only(fd: BorrowedFd<'_>) -> io::Result<bool> {
    subvol_info(fd).map(|i| i.read_only)
}

/// `_IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)` (4096 bytes).
const BTRFS_IOC_INO_LOOKUP: libc::c_ulong = 0xD000_9412;
const BTRFS_FIRST_FREE_OBJECTID: u64 = 256;

/// The id of the btrfs subvolume holding `fd` (stable across mounts, unlike
/// the anonymous device number a subvolume gets).
pub fn subvol_id(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut buf = AlignedBuf::new(4096);
    buf.put_u64(0, 0);
    buf.put_u64(8, BTRFS_FIRST_FREE_OBJECTID);
    crate::ioctl_buf(fd, BTRFS_IOC_INO_LOOKUP, &mut buf)?;
    u64_at(buf.as_bytes(), 0)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "short answer"))
}

/// `_IOWR(0x94, 59, struct btrfs_ioctl_logical_ino_args)` (56 bytes).
const BTRFS_IOC_LOGICAL_INO_V2: libc::c_ulong = 0xC038_943B;
const LOGICAL_INO_ARGS: usize = 56;
/// `BTRFS_LOGICAL_INO_ARGS_IGNORE_OFFSET`: every reference to the extent,
/// not only those covering the given byte.
const LOGICAL_INO_IGNORE_OFFSET: u64 = 1;
/// The first answer buffer, and the kernel's cap on it (retried with when
/// the first is too small).
const LOGICAL_INO_BUFS: [usize; 2] = [64 << 10, 16 << 20];

/// One reference to an extent: inode `ino` of subvolume `root` maps it at
/// file offset `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExtentOwner {
    pub ino: u64,
    pub offset: u64,
    pub root: u64,
}

/// Every (inode, subvolume) reference to the data extent starting at
/// `disk_bytenr`, in any subvolume or snapshot of the filesystem holding
/// `fd` (`BTRFS_IOC_LOGICAL_INO_V2`, needs CAP_SYS_ADMIN). Returns `None`
/// when the answer did not fit (too many references to list).
pub fn extent_owners(fd: BorrowedFd<'_>, disk_bytenr: u64) -> io::Result<Option<Vec<ExtentOwner>>> {
    for size in LOGICAL_INO_BUFS {
        let data = logical_ino(fd, disk_bytenr, size)?
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
        let owners = decode_owners(data.as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if owners.is_some() {
            return Ok(owners);
        }
    }
    Ok(None)
}

/// `BTRFS_IOC_LOGICAL_INO_V2` for every reference to the data extent that
/// starts at `bytenr`, answered in a `btrfs_data_container` of `size`
/// bytes; `None` when no extent is allocated there (ENOENT). The one place
/// both [`extent_owners`] and [`extent_refs`] ask the kernel.
fn logical_ino(fd: BorrowedFd<'_>, bytenr: u64, size: usize) -> io::Result<Option<AlignedBuf>> {
    let mut data = AlignedBuf::new(size);
    let mut args = AlignedBuf::new(LOGICAL_INO_ARGS);
    args.put_u64(0, bytenr);
    args.put_u64(8, size as u64);
    args.put_u64(40, LOGICAL_INO_IGNORE_OFFSET);
    // The kernel writes the answer through this pointer; `data` lives
    // until after the call.
    args.put_u64(48, data.as_mut_ptr() as u64);
    match crate::ioctl_buf(fd, BTRFS_IOC_LOGICAL_INO_V2, &mut args) {
        Ok(_) => Ok(Some(data)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Decodes a `struct btrfs_data_container` holding (inum, offset, root)
/// triples; `Ok(None)` when the kernel reports missed entries.
pub fn decode_owners(buf: &[u8]) -> Result<Option<Vec<ExtentOwner>>, DecodeError> {
    let short = DecodeError::Truncated { index: 0 };
    let missing = u32_at(buf, 4).ok_or(short.clone())?;
    let count = u32_at(buf, 8).ok_or(short.clone())? as usize;
    let missed = u32_at(buf, 12).ok_or(short.clone())?;
    if missing != 0 || missed != 0 {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(count / 3);
    for (index, i) in (0..count / 3).enumerate() {
        let at = 16 + i * 24;
        let t = DecodeError::Truncated { index };
        out.push(ExtentOwner {
            ino: u64_at(buf, at).ok_or(t.clone())?,
            offset: u64_at(buf, at + 8).ok_or(t.clone())?,
            root: u64_at(buf, at + 16).ok_or(t)?,
        });
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decodes_regular_item() {
        let mut b = vec![0u8; SEARCH_HEADER + 53];
        b[16..24].copy_from_slice(&8192u64.to_ne_bytes());
        b[24..28].copy_from_slice(&EXTENT_DATA_KEY.to_ne_bytes());
        b[28..32].copy_from_slice(&53u32.to_ne_bytes());
        let it = &mut b[SEARCH_HEADER..];
        it[8..16].copy_from_slice(&65536u64.to_le_bytes());
        it[20] = 1;
        it[21..29].copy_from_slice(&(1u64 << 30).to_le_bytes());
        it[29..37].copy_from_slice(&65536u64.to_le_bytes());
        it[37..45].copy_from_slice(&4096u64.to_le_bytes());
        it[45..53].copy_from_slice(&8192u64.to_le_bytes());
        let (v, last) = decode_items(&b, 1).unwrap();
        assert_eq!(last, Some(8192));
        assert_eq!(
            v,
            vec![FileExtent {
                file_offset: 8192,
                kind: FileExtentKind::Regular,
                compression: 0,
                disk_bytenr: 1 << 30,
                disk_num_bytes: 65536,
                offset: 4096,
                num_bytes: 8192,
                ram_bytes: 65536
            }]
        );
        assert!(decode_items(&b[..40], 1).is_err());
    }

    #[test]
    fn decodes_subvol_info() {
        let mut b = vec![0u8; SUBVOL_INFO_SIZE];
        assert_eq!(SubvolInfo::decode(&b), SubvolInfo::default());
        // A subvolume's own UUID does not make it a snapshot.
        b[296..312].fill(0xab);
        let own = SubvolInfo {
            uuid: [0xab; 16],
            ..SubvolInfo::default()
        };
        assert_eq!(SubvolInfo::decode(&b), own);
        // Any non-zero byte of parent_uuid does, read-only or not.
        b[327] = 1;
        b[352..360].copy_from_slice(&77u64.to_ne_bytes());
        b[344..352].copy_from_slice(&78u64.to_ne_bytes());
        let mut parent = [0; 16];
        parent[15] = 1;
        let want = SubvolInfo {
            snapshot: true,
            parent_uuid: parent,
            otransid: 77,
            ctransid: 78,
            ..own
        };
        assert_eq!(SubvolInfo::decode(&b), want);
        b[288..296].copy_from_slice(&BTRFS_SUBVOL_RDONLY.to_ne_bytes());
        let want = SubvolInfo {
            read_only: true,
            ..want
        };
        assert_eq!(SubvolInfo::decode(&b), want);
        // Other flag bits and received_uuid (@328) are not these facts.
        let mut c = vec![0u8; SUBVOL_INFO_SIZE];
        c[288..296].copy_from_slice(&(!BTRFS_SUBVOL_RDONLY).to_ne_bytes());
        c[328..344].fill(7);
        assert_eq!(SubvolInfo::decode(&c), SubvolInfo::default());
        // Short answers say nothing.
        assert!(!SubvolInfo::decode(&b[..300]).snapshot);
        assert!(!SubvolInfo::decode(&b[..320]).snapshot);
        assert_eq!(SubvolInfo::decode(&[]), SubvolInfo::default());
    }

    #[test]
    fn decodes_owners() {
        let mut b = vec![0u8; 16 + 48];
        b[8..12].copy_from_slice(&6u32.to_ne_bytes());
        for (i, v) in [257u64, 0, 5, 300, 4096, 256].iter().enumerate() {
            b[16 + i * 8..24 + i * 8].copy_from_slice(&v.to_ne_bytes());
        }
        let v = decode_owners(&b).unwrap().unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!((v[1].ino, v[1].offset, v[1].root), (300, 4096, 256));
        b[12..16].copy_from_slice(&1u32.to_ne_bytes());
        assert_eq!(decode_owners(&b).unwrap(), None);
        b[12..16].copy_from_slice(&0u32.to_ne_bytes());
        assert!(decode_owners(&b[..40]).is_err());
    }

    proptest! {
        #[test]
        fn decode_owners_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_owners(&bytes);
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..4096), n in 0u32..100) {
            let _ = decode_items(&bytes, n);
        }

        /// Well-formed search headers over arbitrary item bodies and keys
        /// (random bytes alone almost never form a valid first header),
        /// with the count overstated or the buffer cut short: never a
        /// panic; an `Ok` decodes exactly the EXTENT_DATA items, in order,
        /// and errors name an item that exists or was promised.
        #[test]
        fn decode_structured_never_panics(
            items in proptest::collection::vec(
                (
                    any::<u64>(),
                    prop_oneof![Just(EXTENT_DATA_KEY), any::<u32>()],
                    proptest::collection::vec(any::<u8>(), 0..80),
                ),
                0..12,
            ),
            extra in 0u32..3,
            cut in 0usize..40,
        ) {
            let mut b = Vec::new();
            for (offset, typ, body) in &items {
                let mut h = [0u8; SEARCH_HEADER];
                h[16..24].copy_from_slice(&offset.to_ne_bytes());
                h[24..28].copy_from_slice(&typ.to_ne_bytes());
                h[28..32].copy_from_slice(&(body.len() as u32).to_ne_bytes());
                b.extend_from_slice(&h);
                b.extend_from_slice(body);
            }
            let full = b.len();
            b.truncate(full.saturating_sub(cut));
            let nr = items.len() as u32 + extra;
            match decode_items(&b, nr) {
                Ok((v, last)) => {
                    prop_assert!(extra == 0 && (cut == 0 || items.is_empty()));
                    let data: Vec<_> = items.iter().filter(|i| i.1 == EXTENT_DATA_KEY).collect();
                    prop_assert_eq!(v.len(), data.len());
                    for (fe, (offset, _, body)) in v.iter().zip(&data) {
                        prop_assert_eq!(fe.file_offset, *offset);
                        if fe.kind != FileExtentKind::Inline {
                            prop_assert!(body.len() >= 53);
                        }
                    }
                    prop_assert_eq!(last, items.last().map(|i| i.0));
                }
                Err(DecodeError::Truncated { index }) => {
                    prop_assert!(index < nr as usize && index <= items.len());
                }
                Err(DecodeError::ShortItem { index, len }) => {
                    prop_assert!(index < items.len());
                    prop_assert_eq!(items[index].1, EXTENT_DATA_KEY);
                    prop_assert_eq!(len as usize, items[index].2.len());
                    prop_assert!(len < 53);
                }
            }
        }
    }
}

/// The extent tree's id (`BTRFS_EXTENT_TREE_OBJECTID`).
const EXTENT_TREE: u64 = 2;
/// `BTRFS_EXTENT_ITEM_KEY`: (start, this, length) for every data extent.
const EXTENT_ITEM_KEY: u32 = 168;
/// `BTRFS_EXTENT_OWNER_REF_KEY` (simple quotas): the subvolume that made it.
const EXTENT_OWNER_REF_KEY: u8 = 172;
/// `BTRFS_EXTENT_DATA_REF_KEY`: a reference by (subvolume, inode, offset).
const EXTENT_DATA_REF_KEY: u32 = 178;
/// `BTRFS_SHARED_DATA_REF_KEY`: a reference by a tree leaf (its address).
const SHARED_DATA_REF_KEY: u32 = 184;
/// `struct btrfs_extent_item`: refs, generation, flags.
const EXTENT_ITEM_HEADER: usize = 24;
/// `BTRFS_EXTENT_FLAG_DATA`.
const EXTENT_FLAG_DATA: u64 = 1;
/// Room left at the end of an answer below which it may have been cut.
const ANSWER_SLACK: usize = 256;

/// A data extent's back references, as the extent tree lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataBackrefs {
    /// The extent's length (its item's key offset).
    pub len: u64,
    /// The tree leaves that reference it (`SHARED_DATA_REF`), sorted: a
    /// leaf a subvolume copied on write while snapshots shared it, held
    /// since by those snapshots' trees. Extents referenced by the same
    /// leaves only are held by the same subvolumes.
    pub leaves: Vec<u64>,
    /// Also referenced by (subvolume, inode) (`EXTENT_DATA_REF`), by a kind
    /// not decoded here, or more references than one answer held: who
    /// holds it is known only by resolving it (`LOGICAL_INO`).
    pub by_owner: bool,
}

/// The back references of the data extent that starts exactly at
/// `bytenr` (a file extent item's `disk_bytenr`), `None` when no extent
/// starts there: btrfs deletes an extent item in the commit that drops
/// its last reference, so one that exists is still referenced (by a
/// snapshot, a file outside any scanned tree). Needs CAP_SYS_ADMIN; `fd`
/// is any file or directory of the filesystem. Sees committed state:
/// sync first.
///
/// Callers compare the length too: once an extent was freed, a later
/// allocation (a re-homed copy, another writer) may start at its address,
/// and that is another extent.
pub fn extent_backrefs(fd: BorrowedFd<'_>, bytenr: u64) -> io::Result<Option<DataBackrefs>> {
    let key = SearchKey {
        tree: EXTENT_TREE,
        objectid: (bytenr, bytenr),
        offset: (0, u64::MAX),
        min_transid: 0,
        types: (EXTENT_ITEM_KEY, SHARED_DATA_REF_KEY),
    };
    // One answer: an answer that may have been cut marks the rest unknown.
    let found = tree_search(fd, key, Cursor::Offset, |items, nr| {
        let refs = decode_backrefs(items, nr, bytenr)?;
        Ok::<_, DecodeError>((Vec::from_iter(refs), None))
    })?;
    Ok(found.into_iter().next())
}

/// The back references in a search answer's items area (`nr` items) for
/// the extent at `bytenr`; `None` without its extent item.
fn decode_backrefs(
    items: &[u8],
    nr: u32,
    bytenr: u64,
) -> Result<Option<DataBackrefs>, DecodeError> {
    let mut refs = DataBackrefs {
        len: 0,
        leaves: Vec::new(),
        by_owner: false,
    };
    let mut found = false;
    let truncated = |index| DecodeError::Truncated { index };
    let used = each_item(items, nr, truncated, |_, it| {
        match (it.objectid == bytenr, it.typ) {
            (false, _) => {}
            (true, EXTENT_ITEM_KEY) => {
                found = true;
                refs.len = it.offset;
                decode_inline_refs(it.body, &mut refs);
            }
            (true, SHARED_DATA_REF_KEY) => refs.leaves.push(it.offset),
            (true, _) => refs.by_owner = true,
        }
        Ok(())
    })?;
    if used + ANSWER_SLACK > items.len() {
        refs.by_owner = true;
    }
    refs.leaves.sort_unstable();
    refs.leaves.dedup();
    Ok(found.then_some(refs))
}

/// The references kept inside an extent item, after its header.
fn decode_inline_refs(item: &[u8], refs: &mut DataBackrefs) {
    if le_u64_at(item, 16).is_none_or(|flags| flags & EXTENT_FLAG_DATA == 0) {
        refs.by_owner = true;
        return;
    }
    let mut p = EXTENT_ITEM_HEADER;
    while p < item.len() {
        let step = match item[p] {
            t if t as u32 == SHARED_DATA_REF_KEY => match le_u64_at(item, p + 1) {
                Some(leaf) => {
                    refs.leaves.push(leaf);
                    1 + 8 + 4
                }
                None => 0,
            },
            t if t as u32 == EXTENT_DATA_REF_KEY => {
                refs.by_owner = true;
                1 + 8 + 8 + 8 + 4
            }
            EXTENT_OWNER_REF_KEY => 1 + 8,
            _ => 0,
        };
        if step == 0 {
            refs.by_owner = true;
            return;
        }
        p += step;
    }
}

#[cfg(test)]
mod logical_ino_tests {
    use super::*;

    /// A search answer item: header (native-endian) and payload.
    fn search_item(objectid: u64, typ: u32, offset: u64, payload: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; SEARCH_HEADER];
        b[8..16].copy_from_slice(&objectid.to_ne_bytes());
        b[16..24].copy_from_slice(&offset.to_ne_bytes());
        b[24..28].copy_from_slice(&typ.to_ne_bytes());
        b[28..32].copy_from_slice(&(payload.len() as u32).to_ne_bytes());
        b.extend_from_slice(payload);
        b
    }

    fn extent_item(flags: u64, inline: &[&[u8]]) -> Vec<u8> {
        let mut p = vec![0u8; EXTENT_ITEM_HEADER];
        p[16..24].copy_from_slice(&flags.to_le_bytes());
        inline.iter().for_each(|r| p.extend_from_slice(r));
        p
    }

    fn shared_inline(leaf: u64) -> Vec<u8> {
        let mut r = vec![SHARED_DATA_REF_KEY as u8];
        r.extend_from_slice(&leaf.to_le_bytes());
        r.extend_from_slice(&1u32.to_le_bytes());
        r
    }

    fn answer(items: &[Vec<u8>]) -> Vec<u8> {
        let mut b = items.concat();
        b.resize(4096, 0);
        b
    }

    #[test]
    fn back_references_decode_leaves_and_owners() {
        let x = 1 << 20;
        let (l1, l2) = (shared_inline(77 << 12), shared_inline(55 << 12));
        let item = extent_item(EXTENT_FLAG_DATA, &[&l1, &l2]);
        let keyed = search_item(x, SHARED_DATA_REF_KEY, 66 << 12, &1u32.to_le_bytes());
        let b = answer(&[search_item(x, EXTENT_ITEM_KEY, 8192, &item), keyed]);
        let r = decode_backrefs(&b, 2, x).unwrap().unwrap();
        assert_eq!(r.len, 8192);
        assert_eq!(r.leaves, vec![55 << 12, 66 << 12, 77 << 12]);
        assert!(!r.by_owner);

        let mut owner = vec![EXTENT_DATA_REF_KEY as u8];
        owner.extend_from_slice(&[0u8; 28]);
        let item = extent_item(EXTENT_FLAG_DATA, &[&owner, &l1]);
        let b = answer(&[search_item(x, EXTENT_ITEM_KEY, 8192, &item)]);
        let r = decode_backrefs(&b, 1, x).unwrap().unwrap();
        assert_eq!((r.leaves.clone(), r.by_owner), (vec![77 << 12], true));

        let keyed_owner = search_item(x, EXTENT_DATA_REF_KEY, 12345, &[0u8; 28]);
        let item = extent_item(EXTENT_FLAG_DATA, &[]);
        let b = answer(&[search_item(x, EXTENT_ITEM_KEY, 4096, &item), keyed_owner]);
        assert!(decode_backrefs(&b, 2, x).unwrap().unwrap().by_owner);

        let unknown = extent_item(EXTENT_FLAG_DATA, &[&[250u8, 1, 2]]);
        let b = answer(&[search_item(x, EXTENT_ITEM_KEY, 4096, &unknown)]);
        assert!(decode_backrefs(&b, 1, x).unwrap().unwrap().by_owner);
    }

    #[test]
    fn no_extent_item_no_back_references_and_a_full_answer_is_unknown() {
        let x = 1 << 20;
        let keyed = search_item(x, SHARED_DATA_REF_KEY, 66 << 12, &1u32.to_le_bytes());
        assert_eq!(decode_backrefs(&answer(&[keyed]), 1, x).unwrap(), None);
        let other = search_item(x + 4096, EXTENT_ITEM_KEY, 4096, &extent_item(1, &[]));
        assert_eq!(decode_backrefs(&answer(&[other]), 1, x).unwrap(), None);
        let item = search_item(x, EXTENT_ITEM_KEY, 4096, &extent_item(1, &[]));
        let mut full = item.clone();
        full.resize(item.len() + ANSWER_SLACK - 1, 0);
        assert!(decode_backrefs(&full, 1, x).unwrap().unwrap().by_owner);
        assert!(decode_backrefs(&item[..20], 1, x).is_err(), "cut header");
    }
}
