//! The metadata reserve: room kept on the store's filesystem so that a
//! commit never meets a full disk.
//!
//! A COMMIT that fails with `SQLITE_FULL` rolls the whole transaction
//! back: files that programs created, wrote and closed in the last second
//! would vanish from a live mount. So the store holds `DIR/reserve`, a
//! file of allocated blocks, and checks the free space before every
//! commit. Below the reserve's size the reserve is given back to the
//! filesystem (so the commit has that much room) and the store is *low*:
//! new data and new files that would leave less than the reserve's size
//! free are refused with ENOSPC, before anything is acknowledged, while
//! commits, reads, unlinks and truncates go on. Once twice the reserve is
//! free again the reserve is taken back. Another program that fills the disk in the moment between the
//! release and the commit can still make a commit fail: the store then
//! shuts down (see `Store::shut_down`) rather than serve a namespace that
//! lost acknowledged work.

use std::fs::File;
use std::path::{Path, PathBuf};

/// Smallest and largest reserve: 1/32 of the filesystem, within these.
const MIN: u64 = 4 << 20;
const MAX: u64 = 64 << 20;

/// The reserve file and whether it holds its blocks.
#[derive(Debug)]
pub(crate) struct Reserve {
    path: PathBuf,
    size: u64,
    held: bool,
}

/// Bytes available to the store's process on the filesystem of `dir`
/// (`None` when it cannot be asked: then the store is never low).
fn available(dir: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(dir).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

fn total(dir: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(dir).ok()?;
    Some(st.f_blocks.saturating_mul(st.f_frsize))
}

impl Reserve {
    /// The reserve of the store in `dir`, taken if there is room, given
    /// back if the file holds its blocks and there is not (a store opened
    /// on a full disk: its commits, and gc's, need that room).
    pub fn open(dir: &Path) -> Reserve {
        use std::os::unix::fs::MetadataExt;
        let size = total(dir).map_or(MIN, |t| (t / 32).clamp(MIN, MAX));
        let path = dir.join("reserve");
        let held = std::fs::metadata(&path).is_ok_and(|m| m.blocks() * 512 >= size);
        let mut r = Reserve { path, size, held };
        r.adjust();
        r
    }

    /// Whether the store is low on space (the reserve is not held).
    pub fn is_low(&self) -> bool {
        !self.held
    }

    /// Releases the reserve when less than its size is free, takes it
    /// back when twice its size is; returns whether the store is low.
    pub fn adjust(&mut self) -> bool {
        let Some(free) = available(self.dir()) else {
            return false;
        };
        if self.held && free < self.size {
            self.release();
        } else if !self.held && free >= 2 * self.size {
            self.held = self.take().is_ok();
        }
        !self.held
    }

    /// Whether `more` bytes can be written while keeping `held` bytes
    /// free (promised to preallocations) and, while the reserve is
    /// released, the reserve's size too.
    pub fn has_room(&self, more: u64, held: u64) -> bool {
        self.fits(more, self.keep(held))
    }

    /// [`Reserve::has_room`] for bytes whose room was promised when they
    /// were buffered: they may use half of a released reserve, what the
    /// metadata written since may have taken of the room they were
    /// promised (the other half stays for commits).
    pub fn has_room_for_promised(&self, more: u64, held: u64) -> bool {
        let slack = if self.held { 0 } else { self.size / 2 };
        self.fits(more, self.keep(held).saturating_sub(slack))
    }

    /// Bytes that can be written while keeping `held` bytes free and,
    /// while the reserve is released, its size too (`u64::MAX` when the
    /// filesystem cannot be asked).
    pub fn room(&self, held: u64) -> u64 {
        let keep = self.keep(held);
        available(self.dir()).map_or(u64::MAX, |free| free.saturating_sub(keep))
    }

    /// Whether `more` bytes fit with `keep` bytes left free.
    fn fits(&self, more: u64, keep: u64) -> bool {
        available(self.dir()).is_none_or(|free| free >= keep.saturating_add(more))
    }

    /// `held` and, while the reserve is released, its size.
    fn keep(&self, held: u64) -> u64 {
        match self.held {
            true => held,
            false => held.saturating_add(self.size),
        }
    }

    fn dir(&self) -> &Path {
        self.path.parent().expect("the reserve is in the store")
    }

    fn take(&self) -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&self.path)?;
        let r = rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, self.size);
        if r.is_err() {
            let _ = f.set_len(0);
        }
        r?;
        f.sync_all()
    }

    fn release(&mut self) {
        let released = File::options()
            .write(true)
            .open(&self.path)
            .and_then(|f| f.set_len(0));
        if let Err(e) = released {
            crate::warn!(
                "onecopy: cannot release the space reserve {}: {e}",
                self.path.display()
            );
        }
        self.held = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserve_is_held_where_there_is_room_and_sized_within_bounds() {
        let d = tempfile::tempdir().unwrap();
        let mut r = Reserve::open(d.path());
        assert!((MIN..=MAX).contains(&r.size));
        assert!(!r.is_low(), "a temporary directory has room");
        let len = std::fs::metadata(d.path().join("reserve")).unwrap().len();
        assert_eq!(len, r.size);
        assert!(!r.adjust());
    }
}
