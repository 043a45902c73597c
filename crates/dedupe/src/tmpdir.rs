//! Unnamed temporary files for re-homing copies.
//!
//! A re-homing copy is only ever a `FIDEDUPERANGE` source, so it never
//! needs a name: it is opened with `O_TMPFILE` in a directory of the
//! filesystem being deduped and is never linked. No name appears in the
//! user's tree at any moment, and the kernel frees the copy when its last
//! descriptor closes — also when the process is killed (after a machine
//! crash, btrfs and XFS drop such orphan inodes at the next mount). No lock
//! or directory is needed.
//!
//! Where a filesystem refuses `O_TMPFILE`, re-homing is skipped with a
//! message rather than falling back to a named file in the tree.
//!
//! Nothing in a user's tree is ever removed: early development builds
//! made `.onecopy-tmp.<pid>` directories, but a directory of that name
//! cannot be told from a user's own (one was, with its files), so none is
//! touched, skipped or treated apart.

use std::fs::File;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

/// Where re-homing prefers to open its unnamed temporary files on
/// filesystem `fs` (an `FsInfo::fsid`): the first root on it that is a
/// directory, else the directory of the first root file on it; `None`
/// when no root is on it (never the current directory, which may be on
/// another filesystem: re-homing then uses a changed file's directory).
pub fn parent_for(roots: &[PathBuf], fs: u64) -> Option<PathBuf> {
    use std::os::fd::AsFd;
    let on_fs = |p: &Path| {
        onecopy_scan::longpath::open_nonblocking(p)
            .ok()
            .and_then(|f| onecopy_ioctl::fs::fs_info(f.as_fd()).ok())
            .is_some_and(|i| i.fsid == fs)
    };
    let mut fallback = None;
    for r in roots {
        if r.is_dir() && on_fs(r) {
            return Some(r.clone());
        }
        if fallback.is_none() && on_fs(r) {
            fallback = r
                .parent()
                .map(|p| {
                    if p.as_os_str().is_empty() {
                        Path::new(".")
                    } else {
                        p
                    }
                })
                .map(Path::to_path_buf);
        }
    }
    fallback
}

/// Opens an unnamed, unlinked read-write file on the filesystem of `dir`.
pub fn anonymous_file(dir: &Path) -> std::io::Result<File> {
    let fd = rustix::fs::open(
        dir,
        OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    Ok(File::from(fd))
}

/// Whether `e` says the filesystem does not support `O_TMPFILE` (as
/// opposed to a passing problem such as no space).
pub fn is_unsupported(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    fn fsid(p: &Path) -> u64 {
        let f = File::open(p).unwrap();
        onecopy_ioctl::fs::fs_info(f.as_fd()).unwrap().fsid
    }

    /// A directory root is the parent; a file root gives its directory; a
    /// root on another filesystem is never chosen.
    #[test]
    fn parent_is_a_root_directory_on_the_filesystem() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("d");
        std::fs::create_dir(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, b"x").unwrap();
        let fs = fsid(&dir);
        assert_eq!(
            parent_for(&[file.clone(), dir.clone()], fs),
            Some(dir.clone())
        );
        assert_eq!(
            parent_for(std::slice::from_ref(&file), fs),
            Some(dir.clone())
        );
        let other = fs.wrapping_add(1);
        assert_eq!(parent_for(&[file, dir], other), None);
    }

    #[test]
    fn anonymous_file_leaves_no_name() {
        let base = tempfile::tempdir().unwrap();
        match anonymous_file(base.path()) {
            Ok(f) => {
                f.write_all_at(b"data", 0).unwrap();
                let mut b = [0u8; 4];
                f.read_exact_at(&mut b, 0).unwrap();
                assert_eq!(&b, b"data");
                assert_eq!(std::fs::read_dir(base.path()).unwrap().count(), 0);
            }
            // tmpfs and the usual test filesystems support it; a refusal
            // must at least be recognised as one.
            Err(e) => assert!(is_unsupported(&e), "{e}"),
        }
    }
}
