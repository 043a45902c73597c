//! `FS_IOC_FIEMAP`: the map from a file's logical offsets to physical
//! addresses on the device, with per-extent flags (shared, inline,
//! unwritten, ...).
//!
//! The decoder [`decode`] is pure and total: it accepts arbitrary bytes and
//! returns an error for anything malformed.

use std::io;
use std::os::fd::BorrowedFd;

use crate::bytes::{u32_at, u64_at};
use crate::AlignedBuf;

const HEADER: usize = 32; // struct fiemap
const EXTENT: usize = 56; // struct fiemap_extent
/// `_IOWR('f', 11, struct fiemap)`.
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
/// Flush dirty data first so that freshly written files have real addresses.
const FIEMAP_FLAG_SYNC: u32 = 0x1;
/// Extents asked for per call.
const BATCH: usize = 512;

/// Extent flags (`FIEMAP_EXTENT_*`).
pub mod flags {
    pub const LAST: u32 = 0x1;
    pub const UNKNOWN: u32 = 0x2;
    pub const DELALLOC: u32 = 0x4;
    pub const ENCODED: u32 = 0x8;
    pub const DATA_ENCRYPTED: u32 = 0x80;
    pub const NOT_ALIGNED: u32 = 0x100;
    pub const DATA_INLINE: u32 = 0x200;
    pub const DATA_TAIL: u32 = 0x400;
    pub const UNWRITTEN: u32 = 0x800;
    pub const MERGED: u32 = 0x1000;
    pub const SHARED: u32 = 0x2000;
}

/// One mapped extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    pub logical: u64,
    pub physical: u64,
    pub length: u64,
    pub flags: u32,
}

impl Extent {
    pub fn is_shared(&self) -> bool {
        self.flags & flags::SHARED != 0
    }
    /// Data stored in metadata or at an unknown/unaligned place: the
    /// filesystem can not share it.
    pub fn is_undedupable(&self) -> bool {
        self.flags
            & (flags::DATA_INLINE
                | flags::NOT_ALIGNED
                | flags::DATA_TAIL
                | flags::UNKNOWN
                | flags::DELALLOC
                | flags::DATA_ENCRYPTED)
            != 0
    }
    pub fn is_unwritten(&self) -> bool {
        self.flags & flags::UNWRITTEN != 0
    }
    pub fn logical_end(&self) -> u64 {
        self.logical.saturating_add(self.length)
    }
}

/// A malformed FIEMAP answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("fiemap buffer too short for its header ({0} bytes)")]
    ShortHeader(usize),
    #[error("fiemap reports {mapped} extents but the buffer holds only {room}")]
    TooManyExtents { mapped: u32, room: usize },
    #[error("fiemap extent {index} overflows: logical {logical} + length {length}")]
    Overflow {
        index: usize,
        logical: u64,
        length: u64,
    },
}

/// Decodes a `struct fiemap` buffer as filled by the kernel.
///
/// `capacity` is the number of extent slots the caller offered; the kernel
/// never reports more than that, so a larger count is malformed.
pub fn decode(buf: &[u8], capacity: usize) -> Result<Vec<Extent>, DecodeError> {
    if buf.len() < HEADER {
        return Err(DecodeError::ShortHeader(buf.len()));
    }
    let mapped = u32_at(buf, 20).ok_or(DecodeError::ShortHeader(buf.len()))?;
    let room = (buf.len().saturating_sub(HEADER) / EXTENT).min(capacity);
    if mapped as usize > room {
        return Err(DecodeError::TooManyExtents { mapped, room });
    }
    let mut out = Vec::with_capacity(mapped as usize);
    for index in 0..mapped as usize {
        let base = HEADER + EXTENT * index;
        // In bounds: index < room, and room was derived from buf.len().
        let logical = u64_at(buf, base).ok_or(DecodeError::ShortHeader(buf.len()))?;
        let physical = u64_at(buf, base + 8).ok_or(DecodeError::ShortHeader(buf.len()))?;
        let length = u64_at(buf, base + 16).ok_or(DecodeError::ShortHeader(buf.len()))?;
        let flags = u32_at(buf, base + 40).ok_or(DecodeError::ShortHeader(buf.len()))?;
        if logical.checked_add(length).is_none() {
            return Err(DecodeError::Overflow {
                index,
                logical,
                length,
            });
        }
        out.push(Extent {
            logical,
            physical,
            length,
            flags,
        });
    }
    Ok(out)
}

/// Returns every extent of the file overlapping `[start, start + len)`,
/// in logical order. Holes are simply absent.
pub fn fiemap_range(fd: BorrowedFd<'_>, start: u64, len: u64) -> io::Result<Vec<Extent>> {
    let end = start.saturating_add(len);
    let mut out: Vec<Extent> = Vec::new();
    let mut pos = start;
    let mut buf = AlignedBuf::new(HEADER + EXTENT * BATCH);
    while pos < end {
        buf.as_mut_bytes().fill(0);
        buf.put_u64(0, pos);
        buf.put_u64(8, end - pos);
        buf.put_u32(16, FIEMAP_FLAG_SYNC);
        buf.put_u32(24, BATCH as u32);
        crate::ioctl_buf(fd, FS_IOC_FIEMAP, &mut buf)?;
        let batch = decode(buf.as_bytes(), BATCH)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let Some(last) = batch.last().copied() else {
            break;
        };
        let done = batch.iter().any(|e| e.flags & flags::LAST != 0);
        let next = last.logical_end();
        out.extend(batch);
        if done || next <= pos {
            break;
        }
        pos = next;
    }
    Ok(out)
}

/// Returns every extent of the file.
pub fn fiemap(fd: BorrowedFd<'_>) -> io::Result<Vec<Extent>> {
    fiemap_range(fd, 0, u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode(exts: &[Extent]) -> Vec<u8> {
        let mut b = vec![0u8; HEADER + EXTENT * exts.len()];
        b[20..24].copy_from_slice(&(exts.len() as u32).to_ne_bytes());
        for (i, e) in exts.iter().enumerate() {
            let o = HEADER + EXTENT * i;
            b[o..o + 8].copy_from_slice(&e.logical.to_ne_bytes());
            b[o + 8..o + 16].copy_from_slice(&e.physical.to_ne_bytes());
            b[o + 16..o + 24].copy_from_slice(&e.length.to_ne_bytes());
            b[o + 40..o + 44].copy_from_slice(&e.flags.to_ne_bytes());
        }
        b
    }

    #[test]
    fn roundtrip() {
        let e = vec![
            Extent {
                logical: 0,
                physical: 4096,
                length: 8192,
                flags: flags::SHARED,
            },
            Extent {
                logical: 8192,
                physical: 1 << 30,
                length: 4096,
                flags: flags::LAST,
            },
        ];
        assert_eq!(decode(&encode(&e), 8).unwrap(), e);
    }

    #[test]
    fn rejects_overcount() {
        let mut b = encode(&[]);
        b[20..24].copy_from_slice(&5u32.to_ne_bytes());
        assert!(matches!(
            decode(&b, 8),
            Err(DecodeError::TooManyExtents { .. })
        ));
        assert!(matches!(
            decode(&b[..3], 8),
            Err(DecodeError::ShortHeader(3))
        ));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2048), cap in 0usize..64) {
            let _ = decode(&bytes, cap);
        }

        #[test]
        fn decode_roundtrips(v in proptest::collection::vec((0u64..1<<50, any::<u64>(), 0u64..1<<40, any::<u32>()), 0..40)) {
            let exts: Vec<Extent> = v.into_iter().map(|(l,p,n,f)| Extent{logical:l,physical:p,length:n,flags:f}).collect();
            prop_assert_eq!(decode(&encode(&exts), exts.len()).unwrap(), exts);
        }
    }

    proptest! {
        /// The realistic malformed answer: a header with a small count over
        /// arbitrary extent bytes (random bytes alone almost never get past
        /// the count check). Never a panic; an `Ok` holds exactly the
        /// counted extents, each inside the buffer and without overflow.
        #[test]
        fn decode_structured_never_panics(
            body in proptest::collection::vec(any::<u8>(), 0..EXTENT * 24),
            mapped in 0u32..32,
            cap in 0usize..32,
            cut in 0usize..EXTENT,
        ) {
            let mut b = vec![0u8; HEADER];
            b[20..24].copy_from_slice(&mapped.to_ne_bytes());
            b.extend_from_slice(&body);
            b.truncate(b.len().saturating_sub(cut).max(24));
            match decode(&b, cap) {
                Ok(v) => {
                    prop_assert_eq!(v.len(), mapped as usize);
                    prop_assert!(v.len() <= cap);
                    prop_assert!(HEADER + EXTENT * v.len() <= b.len());
                    for e in &v {
                        prop_assert!(e.logical.checked_add(e.length).is_some());
                    }
                }
                Err(DecodeError::TooManyExtents { mapped: m, room }) => {
                    prop_assert_eq!(m, mapped);
                    prop_assert!(m as usize > room);
                }
                Err(DecodeError::Overflow { index, .. }) => prop_assert!(index < mapped as usize),
                // A header cut short is refused as such, and only then.
                Err(DecodeError::ShortHeader(n)) => {
                    prop_assert_eq!(n, b.len());
                    prop_assert!(n < HEADER);
                }
            }
        }

        /// Extents anywhere in the u64 space: the first one whose end
        /// overflows is refused by index, otherwise everything decodes to
        /// what was encoded; the helpers never overflow either.
        #[test]
        fn decode_full_range(
            v in proptest::collection::vec((any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>()), 0..16)
        ) {
            let exts: Vec<Extent> = v
                .into_iter()
                .map(|(l, p, n, f)| Extent { logical: l, physical: p, length: n, flags: f })
                .collect();
            let first_bad = exts.iter().position(|e| e.logical.checked_add(e.length).is_none());
            match (decode(&encode(&exts), exts.len()), first_bad) {
                (Ok(got), None) => prop_assert_eq!(got, exts.clone()),
                (Err(DecodeError::Overflow { index, .. }), Some(i)) => prop_assert_eq!(index, i),
                (other, _) => prop_assert!(false, "unexpected {:?}", other),
            }
            for e in &exts {
                prop_assert!(e.logical_end() >= e.logical);
                let _ = (e.is_shared(), e.is_undedupable(), e.is_unwritten());
            }
        }
    }

    #[test]
    fn maps_a_real_file() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![7u8; 1 << 16]).unwrap();
        f.sync_all().unwrap();
        match fiemap(f.as_fd()) {
            Ok(exts) => {
                let total: u64 = exts.iter().map(|e| e.length).sum();
                assert!(total >= 1 << 16 || exts.iter().any(|e| e.flags & flags::DATA_INLINE != 0));
            }
            // tmpfs has no FIEMAP.
            Err(e) => assert!(matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY)
            )),
        }
    }
}
