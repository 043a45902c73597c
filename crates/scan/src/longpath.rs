//! Paths longer than the kernel's PATH_MAX (4096 bytes).
//!
//! The kernel takes at most PATH_MAX bytes per path argument, but a tree
//! may be deeper than that. Such paths are opened one component at a time
//! relative to the previous directory (`openat`, never following symlinks),
//! and walked with descriptors instead of paths.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{openat, statat, AtFlags, Dir, FileType, Mode, OFlags, Stat, CWD};

/// [`open`] read-only with O_NOATIME where the caller may ask it (it is
/// refused for files the caller does not own): reading leaves a user's
/// file as it was, atime included.
pub fn open_noatime(path: &Path) -> std::io::Result<File> {
    match open(path, OFlags::NOATIME) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => open(path, OFlags::empty()),
        r => r,
    }
}

/// Paths at least this long are opened component by component.
pub const LONG: usize = 3072;

/// Opens `path` with `flags` (read-only plus e.g. O_NOATIME), whatever its
/// length; the last component is never followed if it is a symlink, and
/// never waited on (O_NONBLOCK: a regular file replaced by a FIFO after
/// the walk opens at once, and is then not a regular file).
pub fn open(path: &Path, flags: OFlags) -> std::io::Result<File> {
    if path.as_os_str().len() < LONG {
        let fd = openat(
            CWD,
            path,
            flags | OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::empty(),
        )?;
        return Ok(File::from(fd));
    }
    let mut comps = path.components().peekable();
    let mut dir: OwnedFd = match comps.peek() {
        Some(Component::RootDir) => {
            comps.next();
            openat(
                CWD,
                "/",
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )?
        }
        _ => openat(
            CWD,
            ".",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?,
    };
    let parts: Vec<Component<'_>> = comps.collect();
    let Some((last, dirs)) = parts.split_last() else {
        return Err(std::io::Error::from_raw_os_error(libc::EISDIR));
    };
    for c in dirs {
        dir = openat(
            &dir,
            c.as_os_str(),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
    }
    let fd = openat(
        &dir,
        last.as_os_str(),
        flags | OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    )?;
    Ok(File::from(fd))
}

/// Opens a root or path named by the user, read-only, without blocking:
/// a FIFO (or a device) there opens at once instead of waiting for a
/// writer for ever; on regular files and directories O_NONBLOCK changes
/// nothing.
pub fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

/// One entry found by [`walk`].
pub struct Found {
    pub path: PathBuf,
    pub stat: Stat,
}

/// Walks the directory `root` (any length) with descriptors, depth first,
/// holding open only the directories whose children are still pending.
/// Calls `keep_dir(path, name)` to decide whether to enter a directory,
/// and returns regular files and errors (path, error).
pub fn walk(
    root: &Path,
    keep_dir: &dyn Fn(&Path, &Stat) -> bool,
    keep_name: &dyn Fn(&Path) -> bool,
) -> (Vec<Found>, Vec<(PathBuf, std::io::Error)>) {
    let mut files = Vec::new();
    let mut errors = Vec::new();
    let top = match open(root, OFlags::DIRECTORY) {
        Ok(f) => Arc::new(OwnedFd::from(f)),
        Err(e) => {
            errors.push((root.to_path_buf(), e));
            return (files, errors);
        }
    };
    // (parent, name, path): the parent stays open while children wait.
    let mut stack: Vec<(Arc<OwnedFd>, Option<std::ffi::OsString>, PathBuf)> =
        vec![(top, None, root.to_path_buf())];
    while let Some((parent, name, path)) = stack.pop() {
        let fd = match &name {
            None => parent.clone(),
            Some(n) => match openat(
                &*parent,
                n.as_os_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => Arc::new(fd),
                Err(e) => {
                    errors.push((path, e.into()));
                    continue;
                }
            },
        };
        drop(parent);
        let mut dir = match Dir::read_from(fd.as_fd()) {
            Ok(d) => d,
            Err(e) => {
                errors.push((path, e.into()));
                continue;
            }
        };
        while let Some(ent) = dir.read() {
            let ent = match ent {
                Ok(e) => e,
                Err(e) => {
                    errors.push((path.clone(), e.into()));
                    break;
                }
            };
            let n = ent.file_name().to_bytes();
            if n == b"." || n == b".." {
                continue;
            }
            let nos = std::ffi::OsStr::from_bytes(n).to_os_string();
            let child = path.join(&nos);
            if !keep_name(&child) {
                continue;
            }
            let st = match statat(&*fd, nos.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(s) => s,
                Err(e) => {
                    errors.push((child, e.into()));
                    continue;
                }
            };
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory if keep_dir(&child, &st) => {
                    stack.push((fd.clone(), Some(nos), child));
                }
                FileType::RegularFile => files.push(Found {
                    path: child,
                    stat: st,
                }),
                _ => {}
            }
        }
    }
    (files, errors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn opens_and_walks_beyond_path_max() {
        let base = tempfile::tempdir().unwrap();
        let mut dir = OwnedFd::from(File::open(base.path()).unwrap());
        let mut path = base.path().to_path_buf();
        for _ in 0..1800 {
            rustix::fs::mkdirat(&dir, "dd", Mode::from_raw_mode(0o755)).unwrap();
            dir = openat(
                &dir,
                "dd",
                OFlags::RDONLY | OFlags::DIRECTORY,
                Mode::empty(),
            )
            .unwrap();
            path.push("dd");
        }
        let fd = openat(
            &dir,
            "f",
            OFlags::WRONLY | OFlags::CREATE,
            Mode::from_raw_mode(0o644),
        )
        .unwrap();
        File::from(fd).write_all(b"deep").unwrap();
        let file = path.join("f");
        assert!(file.as_os_str().len() > 4096);
        let mut s = String::new();
        open(&file, OFlags::empty())
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        assert_eq!(s, "deep");
        let (found, errors) = walk(base.path(), &|_, _| true, &|_| true);
        assert!(
            errors.is_empty(),
            "{:?}",
            errors.iter().map(|e| e.1.to_string()).collect::<Vec<_>>()
        );
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].path, file);
        assert_eq!(found[0].stat.st_size, 4);
        // Deleting the chain needs descriptors too: remove_dir_all copes.
    }
}
