//! Which roots a run may dedupe, checked before anything is scanned.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use onecopy_ioctl::fs::{fs_info, FsInfo, FsKind};

/// Why a root can not be deduped.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    /// The path can not be opened: a usage error.
    #[error("{path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot identify filesystem: {source}")]
    Identify {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is on {kind}, which can not share extents; onecopy dedupes on btrfs and XFS (reflink=1)")]
    NoDedupe { path: PathBuf, kind: String },
    #[error("{path} is on XFS without reflink support (made with -m reflink=0); it can not share extents")]
    XfsNoReflink { path: PathBuf },
    #[error("{path} is on a read-only mount; nothing can be deduped there")]
    ReadOnly { path: PathBuf },
}

impl RootError {
    /// The path was wrong (not the filesystem).
    pub fn is_usage(&self) -> bool {
        matches!(self, RootError::Open { .. })
    }
}

/// What is wrong with a filesystem for deduping, from its facts: its kind,
/// whether XFS has reflink (`None`: unknown, allowed) and a read-only
/// mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    NoDedupe,
    XfsNoReflink,
    ReadOnly,
}

/// The rule behind [`check_root`].
pub fn judge(kind: FsKind, xfs_reflink: Option<bool>, read_only: bool) -> Option<Refusal> {
    if !kind.supports_dedupe() {
        return Some(Refusal::NoDedupe);
    }
    if kind == FsKind::Xfs && xfs_reflink == Some(false) {
        return Some(Refusal::XfsNoReflink);
    }
    read_only.then_some(Refusal::ReadOnly)
}

/// The filesystem of root `path`, if it can be deduped.
pub fn check_root(path: &Path) -> Result<FsInfo, RootError> {
    let p = || path.to_path_buf();
    let f = onecopy_scan::longpath::open_nonblocking(path)
        .map_err(|source| RootError::Open { path: p(), source })?;
    let info = fs_info(f.as_fd()).map_err(|source| RootError::Identify { path: p(), source })?;
    let reflink = (info.kind == FsKind::Xfs)
        .then(|| onecopy_ioctl::fs::xfs_has_reflink(f.as_fd()).ok())
        .flatten();
    match judge(info.kind, reflink, info.read_only) {
        None => Ok(info),
        Some(Refusal::NoDedupe) => Err(RootError::NoDedupe {
            path: p(),
            kind: info.kind.name(),
        }),
        Some(Refusal::XfsNoReflink) => Err(RootError::XfsNoReflink { path: p() }),
        Some(Refusal::ReadOnly) => Err(RootError::ReadOnly { path: p() }),
    }
}

/// Why a path named to a run confined to some directories (`watch`'s
/// passes: the files its events named) is left out of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LeftOut {
    #[error("gone")]
    Gone,
    #[error("a symbolic link (not followed)")]
    Symlink,
    #[error("not a regular file or directory")]
    Special,
    #[error("outside the watched paths")]
    Outside,
}

/// `path` as the root of a run confined to the directories `within`
/// (canonical paths): it exists, is a regular file or a directory, not a
/// symbolic link, and its canonical path lies under one of them; that
/// path is returned. A symbolic link put in a watched tree would have a
/// pass read and dedupe whatever it points at, as root.
pub fn confined(path: &Path, within: &[PathBuf]) -> Result<PathBuf, LeftOut> {
    let m = std::fs::symlink_metadata(path).map_err(|_| LeftOut::Gone)?;
    let t = m.file_type();
    if t.is_symlink() {
        return Err(LeftOut::Symlink);
    }
    if !t.is_file() && !t.is_dir() {
        return Err(LeftOut::Special);
    }
    let real = std::fs::canonicalize(path).map_err(|_| LeftOut::Gone)?;
    match within.iter().any(|w| real.starts_with(w)) {
        true => Ok(real),
        false => Err(LeftOut::Outside),
    }
}

/// Whether `block_size` (`--block-size`) suits a filesystem of blocks of
/// `fs_block` bytes: a non-zero multiple of it, at most `u32::MAX`.
pub fn check_block_size(block_size: u64, fs_block: u64) -> Result<(), String> {
    if block_size == 0 || !block_size.is_multiple_of(fs_block) {
        return Err(format!(
            "--block-size {block_size} is not a multiple of the filesystem block size {fs_block}"
        ));
    }
    if block_size > u32::MAX as u64 {
        return Err(format!("--block-size {block_size} is too large"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confined_roots_are_files_or_directories_under_the_watched_paths() {
        let d = tempfile::tempdir().unwrap();
        let (w, out) = (d.path().join("w"), d.path().join("out"));
        std::fs::create_dir_all(w.join("sub")).unwrap();
        std::fs::create_dir(&out).unwrap();
        std::fs::write(w.join("f"), b"x").unwrap();
        std::fs::write(out.join("secret"), b"y").unwrap();
        std::os::unix::fs::symlink(&out, w.join("link")).unwrap();
        std::os::unix::fs::symlink(w.join("f"), w.join("flink")).unwrap();
        let fifo = w.join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let within = [std::fs::canonicalize(&w).unwrap()];
        let real = |p: &Path| std::fs::canonicalize(p).unwrap();
        assert_eq!(confined(&w.join("f"), &within), Ok(real(&w.join("f"))));
        assert_eq!(confined(&w.join("sub"), &within), Ok(real(&w.join("sub"))));
        assert_eq!(confined(&w.join("link"), &within), Err(LeftOut::Symlink));
        assert_eq!(confined(&w.join("flink"), &within), Err(LeftOut::Symlink));
        assert_eq!(confined(&fifo, &within), Err(LeftOut::Special));
        assert_eq!(confined(&w.join("none"), &within), Err(LeftOut::Gone));
        assert_eq!(
            confined(&out.join("secret"), &within),
            Err(LeftOut::Outside)
        );
        // A path through a symlinked parent resolves outside.
        let through = w.join("link").join("secret");
        assert_eq!(confined(&through, &within), Err(LeftOut::Outside));
    }

    #[test]
    fn only_writable_btrfs_and_reflink_xfs() {
        assert_eq!(judge(FsKind::Btrfs, None, false), None);
        assert_eq!(judge(FsKind::Xfs, Some(true), false), None);
        assert_eq!(judge(FsKind::Xfs, None, false), None);
        assert_eq!(
            judge(FsKind::Xfs, Some(false), false),
            Some(Refusal::XfsNoReflink)
        );
        assert_eq!(judge(FsKind::Ext4, None, false), Some(Refusal::NoDedupe));
        assert_eq!(judge(FsKind::Btrfs, None, true), Some(Refusal::ReadOnly));
    }

    #[test]
    fn block_size_is_a_multiple_of_the_fs_block() {
        assert!(check_block_size(65536, 4096).is_ok());
        assert!(check_block_size(4096, 4096).is_ok());
        assert!(check_block_size(0, 4096).is_err());
        assert!(check_block_size(6144, 4096).is_err());
        assert!(check_block_size(1 << 33, 4096)
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn a_missing_root_is_a_usage_error() {
        let e = check_root(Path::new("/nonexistent/onecopy-root")).unwrap_err();
        assert!(e.is_usage(), "{e}");
    }
}
