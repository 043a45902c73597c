//! Restoring a snapshot without a mount: its tree is written under a new
//! directory, keeping what `cp -a` keeps (data with holes as holes, mode,
//! owner when run as root, times, symlinks, hard links, xattrs, FIFOs
//! and devices, raw names). The inverse of `import.rs`.
//!
//! Rules: the destination must not exist (nothing is merged or
//! overwritten); an entry that cannot be written is reported and left
//! out, the rest restored; directory times are set after their contents;
//! a restore whose caller went away stops (`snapshot_restore_until`).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{Mode, Timespec, Timestamps};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};
use crate::ns::{Attr, Kind};
use crate::store::Store;

/// Bytes read from the store at a time.
const PIECE: usize = 1 << 20;

/// What a restore wrote.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RestoreReport {
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    pub hardlinks: u64,
    pub specials: u64,
    pub bytes: u64,
    /// Entries left out, with why.
    pub errors: Vec<String>,
}

/// The restore's state: where each inode with more than one name went.
struct Restorer<'a> {
    store: &'a Store,
    linked: HashMap<u64, PathBuf>,
    rep: RestoreReport,
    /// Directories to give their times once filled (deepest last).
    dirs: Vec<(PathBuf, Attr)>,
    /// Set when whoever asked for the restore went away: it stops.
    stop: &'a AtomicBool,
}

impl Store {
    /// Writes snapshot `name`'s tree as the new directory `dest`.
    pub fn snapshot_restore(&self, name: &str, dest: &Path) -> Result<RestoreReport> {
        self.snapshot_restore_until(name, dest, &AtomicBool::new(false))
    }

    /// [`Store::snapshot_restore`], stopped (an `Interrupted` error,
    /// what was written left in place) once `stop` is set.
    pub fn snapshot_restore_until(
        &self,
        name: &str,
        dest: &Path,
        stop: &AtomicBool,
    ) -> Result<RestoreReport> {
        let root = self.snapshot_root(name)?;
        if dest.symlink_metadata().is_ok() {
            return Err(StoreError::DestExists { path: dest.into() });
        }
        let attr = self.getattr(root)?;
        let parent = dest.parent().filter(|p| !p.as_os_str().is_empty());
        if let Some(p) = parent.filter(|p| !p.is_dir()) {
            let why = format!("{}: no such directory to restore into", p.display());
            return Err(StoreError::BadOption(why));
        }
        private_dir(dest)?;
        let mut r = Restorer {
            store: self,
            linked: HashMap::new(),
            rep: RestoreReport::default(),
            dirs: vec![(dest.to_path_buf(), attr)],
            stop,
        };
        r.rep.directories += 1;
        r.fill_dir(root, dest)?;
        if r.stopped() {
            return Err(interrupted(dest));
        }
        for (path, a) in r.dirs.iter().rev() {
            if let Err(e) = finish(path, a) {
                r.rep.errors.push(format!("{}: {e}", path.display()));
            }
        }
        Ok(r.rep)
    }
}

/// The error of a restore stopped at `path`.
fn interrupted(path: &Path) -> StoreError {
    let why = "the restore was stopped: its caller went away";
    StoreError::io(path)(std::io::Error::new(ErrorKind::Interrupted, why))
}

impl Restorer<'_> {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Restores the entries of store directory `dir` into `path` (made);
    /// once stopped, returns without a word (the restore says why).
    fn fill_dir(&mut self, dir: u64, path: &Path) -> Result<()> {
        let mut offset = 0;
        loop {
            let entries = self.store.readdir_plus(dir, offset, 256)?;
            let Some(last) = entries.last() else {
                return Ok(());
            };
            offset = last.0.next;
            for (e, a) in entries {
                if self.stopped() {
                    return Ok(());
                }
                if e.name == b"." || e.name == b".." {
                    continue;
                }
                let to = path.join(OsStr::from_bytes(&e.name));
                if let Err(err) = self.entry(&a, &to) {
                    self.rep.errors.push(format!("{}: {err}", to.display()));
                }
            }
        }
    }

    /// Restores one entry as `to`.
    fn entry(&mut self, a: &Attr, to: &Path) -> Result<()> {
        if a.kind != Kind::Dir && a.nlink > 1 {
            if let Some(first) = self.linked.get(&a.ino) {
                std::fs::hard_link(first, to).map_err(StoreError::io(to))?;
                self.rep.hardlinks += 1;
                return Ok(());
            }
            self.linked.insert(a.ino, to.to_path_buf());
        }
        let io = StoreError::io(to);
        match a.kind {
            Kind::Dir => {
                private_dir(to)?;
                self.rep.directories += 1;
                self.dirs.push((to.to_path_buf(), *a));
                self.xattrs(a.ino, to);
                return self.fill_dir(a.ino, to);
            }
            Kind::File => self.file(a, to)?,
            Kind::Symlink => {
                let target = self.store.readlink(a.ino)?;
                std::os::unix::fs::symlink(OsStr::from_bytes(&target), to).map_err(io)?;
                self.rep.symlinks += 1;
            }
            kind => {
                let ft = match kind {
                    Kind::Fifo => rustix::fs::FileType::Fifo,
                    Kind::Char => rustix::fs::FileType::CharacterDevice,
                    Kind::Block => rustix::fs::FileType::BlockDevice,
                    _ => rustix::fs::FileType::Socket,
                };
                rustix::fs::mknodat(
                    rustix::fs::CWD,
                    to,
                    ft,
                    Mode::from_raw_mode(a.perm),
                    a.rdev as u64,
                )
                .map_err(|e| StoreError::io(to)(e.into()))?;
                self.rep.specials += 1;
            }
        }
        self.xattrs(a.ino, to);
        finish(to, a).map_err(StoreError::io(to))
    }

    /// A regular file's bytes; all-zero pieces stay holes.
    fn file(&mut self, a: &Attr, to: &Path) -> Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = (File::options().write(true).create_new(true).mode(0o600))
            .open(to)
            .map_err(StoreError::io(to))?;
        let mut off = 0u64;
        while off < a.size {
            if self.stopped() {
                return Err(interrupted(to));
            }
            let data = self.store.read(a.ino, off, PIECE)?;
            if data.is_empty() {
                break;
            }
            if data.iter().any(|&b| b != 0) {
                f.write_all_at(&data, off).map_err(StoreError::io(to))?;
            }
            off += data.len() as u64;
        }
        f.set_len(a.size).map_err(StoreError::io(to))?;
        self.rep.files += 1;
        self.rep.bytes += a.size;
        Ok(())
    }

    /// Copies the inode's xattrs; one that cannot be set is reported.
    fn xattrs(&mut self, ino: u64, to: &Path) {
        let names = self.store.listxattr(ino).unwrap_or_default();
        for n in names {
            let set = self.store.getxattr(ino, &n).and_then(|v| {
                rustix::fs::lsetxattr(
                    to,
                    OsStr::from_bytes(&n),
                    &v,
                    rustix::fs::XattrFlags::empty(),
                )
                .map_err(|e| StoreError::io(to)(e.into()))
            });
            if let Err(e) = set {
                let name = String::from_utf8_lossy(&n);
                self.rep
                    .errors
                    .push(format!("{}: xattr {name}: {e}", to.display()));
            }
        }
    }
}

/// Makes directory `path` 0700: a restored tree is private until each
/// entry has its owner and mode (a file is 0600 until then; it stays so
/// when it could not be restored whole), or a 0600 file's bytes would be
/// open to every user meanwhile.
fn private_dir(path: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    (std::fs::DirBuilder::new().mode(0o700))
        .create(path)
        .map_err(StoreError::io(path))
}

/// Owner (as root), mode (not of symlinks) and times of `path`.
fn finish(path: &Path, a: &Attr) -> std::io::Result<()> {
    let at = rustix::fs::CWD;
    let nofollow = rustix::fs::AtFlags::SYMLINK_NOFOLLOW;
    if rustix::process::geteuid().is_root() {
        let (u, g) = (
            rustix::fs::Uid::from_raw(a.uid),
            rustix::fs::Gid::from_raw(a.gid),
        );
        rustix::fs::chownat(at, path, Some(u), Some(g), nofollow)?;
    }
    if a.kind != Kind::Symlink {
        rustix::fs::chmod(path, Mode::from_raw_mode(a.perm))?;
    }
    let ts = |ns: i64| Timespec {
        tv_sec: ns.div_euclid(1_000_000_000),
        tv_nsec: ns.rem_euclid(1_000_000_000),
    };
    let times = Timestamps {
        last_access: ts(a.atime_ns),
        last_modification: ts(a.mtime_ns),
    };
    rustix::fs::utimensat(at, path, &times, nofollow)?;
    Ok(())
}
