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
//! Versions before 0.2 made a `.onecopy-tmp.<pid>` directory in the root
//! with a `lock` file; [`remove_stale`] removes such leftovers of killed
//! runs.

use std::fs::File;
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation, Mode, OFlags};

pub use onecopy_scan::TMP_DIR_PREFIX as PREFIX;

/// Where re-homing opens its unnamed temporary files on filesystem `fs`
/// (an `FsInfo::fsid`): the first root on it that is a directory, else the
/// directory of the first root file on it, else the current directory.
pub fn parent_for(roots: &[PathBuf], fs: u64) -> PathBuf {
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
            return r.clone();
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
    fallback.unwrap_or_else(|| PathBuf::from("."))
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

/// Removes `<parent>/.onecopy-tmp.*` directories left by killed runs of
/// older versions (their `lock` is no longer held). Returns how many.
pub fn remove_stale(parent: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(parent) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        if !name.to_string_lossy().starts_with(PREFIX) || !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = e.path();
        let stale = match File::open(dir.join("lock")) {
            Ok(f) => flock(&f, FlockOperation::NonBlockingLockExclusive).is_ok(),
            Err(_) => true,
        };
        if stale && std::fs::remove_dir_all(&dir).is_ok() {
            n += 1;
        }
    }
    n
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
        assert_eq!(parent_for(&[file.clone(), dir.clone()], fs), dir);
        assert_eq!(parent_for(std::slice::from_ref(&file), fs), dir);
        let other = fs.wrapping_add(1);
        assert_eq!(parent_for(&[file, dir], other), PathBuf::from("."));
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

    #[test]
    fn stale_directories_of_old_versions_are_removed() {
        let base = tempfile::tempdir().unwrap();
        let dead = base.path().join(format!("{PREFIX}999999"));
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("lock"), b"").unwrap();
        let live = base.path().join(format!("{PREFIX}1"));
        std::fs::create_dir(&live).unwrap();
        let l = File::create(live.join("lock")).unwrap();
        flock(&l, FlockOperation::NonBlockingLockExclusive).unwrap();
        assert_eq!(remove_stale(base.path()), 1);
        assert!(!dead.exists() && live.exists());
    }
}
