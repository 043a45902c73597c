//! On btrfs, the files under a root changed since a transaction, without a
//! walk: a tree search of the root's subvolume by minimum transid, then
//! the paths of the regular files found. Costs follow what changed, not
//! the size of the tree. Changes in other subvolumes (nested below the
//! root) are not seen here: the caller's periodic full look finds them.

use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Regular files under `root` (canonical) whose inode was written in
/// transaction `since` or later with a ctime at or after `min_ctime`
/// (seconds; leaves out inodes rewritten only for an atime update), in
/// inode order; at most `limit` (None when more changed: a walk is then
/// cheaper than naming them).
pub fn changed_files(
    root: &Path,
    since: u64,
    min_ctime: u64,
    limit: usize,
) -> std::io::Result<Option<Vec<PathBuf>>> {
    let dir = onecopy_scan::longpath::open_nonblocking(root)?;
    let fd = dir.as_fd();
    let rel = onecopy_ioctl::changed::dir_path_in_subvol(fd, dir.metadata()?.ino())?;
    let depth = Path::new(std::ffi::OsStr::from_bytes(&rel))
        .components()
        .count();
    let Some(subvol_root) = root.ancestors().nth(depth) else {
        return Ok(None);
    };
    let inodes = onecopy_ioctl::changed::changed_inodes(fd, since)?;
    let files: Vec<_> = inodes
        .iter()
        .filter(|i| i.is_regular() && i.ctime_sec >= min_ctime)
        .collect();
    if files.len() > limit {
        return Ok(None);
    }
    let mut out = Vec::new();
    for i in files {
        // Gone since (deleted): nothing to dedupe.
        let Ok(paths) = onecopy_ioctl::changed::inode_paths(fd, i.ino) else {
            continue;
        };
        for p in paths {
            let p = subvol_root.join(std::ffi::OsStr::from_bytes(&p));
            if p.starts_with(root) {
                out.push(p);
            }
        }
    }
    Ok(Some(out))
}
