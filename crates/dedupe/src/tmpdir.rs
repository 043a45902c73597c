//! onecopy's temporary directory for re-homing copies.
//!
//! `<dir>/.onecopy-tmp.<pid>` holds a `lock` file that its owner keeps
//! `flock`ed for its whole life. The directory is removed when the owner
//! drops it (normal end, error, Ctrl-C). After a SIGKILL, the next run finds
//! the directory with an unlocked `lock` and removes it.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};

pub use onecopy_scan::TMP_DIR_PREFIX as PREFIX;

/// A locked temporary directory, removed on drop.
#[derive(Debug)]
pub struct TmpDir {
    path: PathBuf,
    _lock: File,
}

impl TmpDir {
    /// Creates and locks `<parent>/.onecopy-tmp.<pid>`, first removing
    /// stale ones left by killed runs.
    pub fn create(parent: &Path) -> std::io::Result<TmpDir> {
        remove_stale(parent);
        let path = parent.join(format!("{PREFIX}{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path.join("lock"))
            .and_then(|f| {
                flock(&f, FlockOperation::NonBlockingLockExclusive)?;
                Ok(f)
            });
        match lock {
            Ok(l) => Ok(TmpDir { path, _lock: l }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&path);
                Err(e)
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Removes `<parent>/.onecopy-tmp.*` directories whose lock no live run
/// holds. Returns how many were removed.
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

    #[test]
    fn removed_on_drop_and_stale_cleaned() {
        let base = tempfile::tempdir().unwrap();
        let t = TmpDir::create(base.path()).unwrap();
        let p = t.path().to_path_buf();
        std::fs::write(p.join("x"), b"1").unwrap();
        // A live run's directory is not stale.
        assert_eq!(remove_stale(base.path()), 0);
        drop(t);
        assert!(!p.exists());
        // A killed run's directory (no lock held) is.
        let dead = base.path().join(format!("{PREFIX}999999"));
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("lock"), b"").unwrap();
        assert_eq!(remove_stale(base.path()), 1);
        assert!(!dead.exists());
    }
}
