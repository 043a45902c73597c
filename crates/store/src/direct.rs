//! Whole files written around the page cache (`O_DIRECT`).
//!
//! A remote store's cache copy of a fetched container is written once and
//! read, if ever, much later: through the page cache it costs a fresh
//! page per 4 KiB, which on this kind of machine (a VM whose freed pages
//! go back to the host) is the dominant CPU cost of a cold read
//! (bench/notes/remote.md, "Cache copies written around the page cache").
//!
//! Invariants:
//! - the file holds exactly `bytes` and is synced (`fdatasync`) when
//!   [`write_synced`] returns `Ok`;
//! - where the filesystem refuses `O_DIRECT` (`EINVAL`), the same file is
//!   written through the page cache instead: never an error for that
//!   alone.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// Alignment of `O_DIRECT` buffers, offsets and lengths: a multiple of
/// any logical block size up to 4 KiB.
const ALIGN: usize = 4096;
/// Bytes per `O_DIRECT` write, through one reused aligned buffer.
const PIECE: usize = 4 << 20;

thread_local! {
    /// The aligned staging buffer of this thread (allocated once, so its
    /// pages stay in place from file to file).
    static STAGE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Creates (or truncates) `path` holding `bytes`, synced.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    or_buffered(path, bytes, write_direct)
}

/// `direct`'s write, or a buffered one from the start where `direct` met
/// `EINVAL` (the filesystem refuses `O_DIRECT`); other errors stand.
fn or_buffered(
    path: &Path,
    bytes: &[u8],
    direct: fn(&Path, &[u8]) -> io::Result<()>,
) -> io::Result<()> {
    match direct(path, bytes) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => write_buffered(path, bytes),
        r => r,
    }
}

fn write_buffered(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = File::create(path)?;
    f.write_all(bytes)?;
    f.sync_data()
}

/// `bytes` in aligned pieces (the last padded with zeros), then the
/// file cut to its length. Where `bytes` start on a boundary (a fetched
/// container does), their whole blocks are written from where they are;
/// the rest goes through this thread's staging buffer.
fn write_direct(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    let whole = match bytes.as_ptr() as usize % ALIGN {
        0 => bytes.len() / ALIGN * ALIGN,
        _ => 0,
    };
    for (i, piece) in bytes[..whole].chunks(PIECE).enumerate() {
        f.write_all_at(piece, (i * PIECE) as u64)?;
    }
    staged(&f, &bytes[whole..], whole as u64)?;
    f.set_len(bytes.len() as u64)?;
    f.sync_data()
}

/// Writes `bytes` at `at` (a multiple of [`ALIGN`]) through the staging
/// buffer, the last piece padded with zeros.
fn staged(f: &File, bytes: &[u8], at: u64) -> io::Result<()> {
    STAGE.with(|stage| -> io::Result<()> {
        let mut stage = stage.borrow_mut();
        if stage.len() < PIECE + ALIGN {
            *stage = vec![0u8; PIECE + ALIGN];
        }
        let start = stage.as_ptr().align_offset(ALIGN);
        let buf = &mut stage[start..start + PIECE];
        for (i, piece) in bytes.chunks(PIECE).enumerate() {
            let n = piece.len().next_multiple_of(ALIGN);
            buf[..piece.len()].copy_from_slice(piece);
            buf[piece.len()..n].fill(0);
            f.write_all_at(&buf[..n], at + (i * PIECE) as u64)?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_holds_exactly_its_bytes_whatever_its_length() {
        let dir = tempfile::tempdir().unwrap();
        for len in [0, 1, ALIGN - 1, ALIGN, PIECE, PIECE + 4097, 2 * PIECE + 3] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let p = dir.path().join(format!("f{len}"));
            std::fs::write(&p, b"an older, longer file at the same name").unwrap();
            write_synced(&p, &bytes).unwrap();
            assert_eq!(std::fs::read(&p).unwrap(), bytes, "length {len}");
        }
    }

    /// Bytes starting on a boundary are written from where they are, up
    /// to their last whole block; the file still holds exactly them.
    #[test]
    fn aligned_bytes_are_written_whole_and_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let mut room = vec![0u8; 2 * PIECE + 3 * ALIGN];
        let at = room.as_ptr().align_offset(ALIGN);
        for (i, b) in room.iter_mut().enumerate() {
            *b = (i * 13 % 251) as u8;
        }
        for len in [
            0,
            1,
            ALIGN - 1,
            ALIGN,
            ALIGN + 1,
            PIECE,
            PIECE + 4097,
            2 * PIECE + 3,
        ] {
            let bytes = &room[at..at + len];
            assert_eq!(bytes.as_ptr() as usize % ALIGN, 0);
            let p = dir.path().join(format!("a{len}"));
            std::fs::write(&p, vec![9u8; 3 * PIECE]).unwrap();
            write_synced(&p, bytes).unwrap();
            assert_eq!(std::fs::read(&p).unwrap(), bytes, "length {len}");
        }
    }

    /// A refusal of `O_DIRECT`, even after part of the file was written,
    /// gives a buffered write of the whole; any other error stands.
    #[test]
    fn a_refused_o_direct_falls_back_to_a_buffered_write_and_nothing_else_does() {
        fn refused(path: &Path, _: &[u8]) -> io::Result<()> {
            std::fs::write(path, b"a partial, longer direct attempt")?;
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        }
        fn failed(_: &Path, _: &[u8]) -> io::Result<()> {
            Err(io::Error::from_raw_os_error(libc::EIO))
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        or_buffered(&p, b"abc", refused).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"abc");
        let e = or_buffered(&dir.path().join("g"), b"abc", failed).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        assert!(!dir.path().join("g").exists());
    }
}
