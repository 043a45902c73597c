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
    match write_direct(path, bytes) {
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
/// file cut to its length.
fn write_direct(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
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
            f.write_all_at(&buf[..n], (i * PIECE) as u64)?;
        }
        Ok(())
    })?;
    f.set_len(bytes.len() as u64)?;
    f.sync_data()
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

    #[test]
    fn a_filesystem_without_o_direct_gets_a_buffered_write() {
        // /dev/shm is tmpfs, which refuses O_DIRECT on older kernels and
        // takes it on newer ones: either way the bytes are there.
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let p = dir.path().join("f");
        write_synced(&p, b"abc").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"abc");
    }
}
