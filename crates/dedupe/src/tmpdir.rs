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
use std::path::Path;

use rustix::fs::{flock, FlockOperation, Mode, OFlags};

pub use onecopy_scan::TMP_DIR_PREFIX as PREFIX;

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
    use std::os::unix::fs::FileExt;

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
