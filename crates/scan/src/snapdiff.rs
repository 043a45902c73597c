//! Read-only btrfs snapshots listed by their difference from the subvolume
//! they were taken of, when the walk also covers that subvolume whole.
//!
//! A snapshot's inode `i` whose inode item equals the parent's inode `i`
//! but for transid, atime and `sequence` holds the same bytes as the
//! parent's file, which the walk lists anyway: a snapshot starts as its
//! parent's tree as of the commit of `otransid`, and btrfs rewrites an
//! inode's item, moving its ctime and mtime, whenever its data, size,
//! links or name change (writes, truncates, clones, renames). Reads and
//! dedupes rewrite the item too (atime; `sequence`; a new transid) but
//! change no byte, so the transid alone would list every file read or
//! deduped since the snapshot; the snapshot's copy of a file deduped
//! since sits in other extents, which only snapshots hold, and is no
//! better a source than the live file. Two items written in the same
//! transaction, at or after the snapshot's, are not told apart and are
//! listed. What the rule can miss (a write within one clock tick of an
//! unchanged ctime) is a missed dedupe, never a wrong one: the kernel
//! compares the bytes of every range it shares.
//!
//! Such files cost nothing (no directory read, no stat, no FIEMAP, no entry
//! in memory); the others (changed in the parent since, deleted from it,
//! or changed in the snapshot itself) are listed by path
//! (`BTRFS_IOC_INO_PATHS`). A file kept only in snapshots is still found:
//! its inode is missing from the parent.
//!
//! The parent's inode items come from one tree search per run. A snapshot
//! unchanged since it was made is compared by the parent's changes alone
//! (see [`by_changes`]) while they are few; else its own inode items come
//! from one search of its tree. This needs CAP_SYS_ADMIN; without it the
//! snapshot is walked like any directory.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use onecopy_ioctl::changed::{
    changed_inodes, dir_entries, inode_item, inode_paths, ChangedInode, FT_DIR, FT_REG_FILE,
};

use crate::walk::{count_found, Collected, FileEntry, Filters};
use crate::{Progress, ScanError};

/// What listing by difference left out, summed over the run's snapshots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SnapshotDiff {
    /// Read-only snapshots listed by difference.
    pub snapshots: u64,
    /// Their regular files not listed: the same inode, unchanged, as in
    /// the subvolume they were taken of.
    pub files_as_parent: u64,
    /// The apparent size of those files.
    pub bytes_as_parent: u64,
}

impl std::ops::AddAssign for SnapshotDiff {
    fn add_assign(&mut self, d: SnapshotDiff) {
        self.snapshots += d.snapshots;
        self.files_as_parent += d.files_as_parent;
        self.bytes_as_parent += d.bytes_as_parent;
    }
}

/// The regular inodes of a snapshot that must be listed (see the module
/// doc for the rule), given both trees' inode items in inode order (as
/// [`onecopy_ioctl::changed::changed_inodes`] returns them); counts the
/// others into `diff`.
pub fn differing(
    snapshot: &[ChangedInode],
    parent: &[ChangedInode],
    otransid: u64,
    diff: &mut SnapshotDiff,
) -> Vec<u64> {
    let mut listed = Vec::new();
    let mut p = parent.iter().peekable();
    for s in snapshot.iter().filter(|s| s.is_regular()) {
        while p.next_if(|p| p.ino < s.ino).is_some() {}
        let same = p.peek().is_some_and(|p| {
            p.ino == s.ino
                && p.stable == s.stable
                && !(p.transid == s.transid && p.transid >= otransid)
        });
        if same {
            diff.files_as_parent += 1;
            diff.bytes_as_parent += s.size;
        } else {
            listed.push(s.ino);
        }
    }
    listed
}

/// Looked up one by one (a search each), the parent's inodes changed since
/// a snapshot cost less than the snapshot's whole tree while they are at
/// most this fraction of the parent's: the whole tree costs about 1.4 us
/// per inode here, a lookup about 10 times that (bench/notes/
/// dedupe-snapshots.md).
const FEW_CHANGES: usize = 10;

/// [`differing`]'s answer from the parent's inodes changed since the
/// snapshot only, for a snapshot unchanged since it was made: a parent
/// inode last written before `otransid` is in the snapshot as it is (the
/// same bytes); one written since is looked up in the snapshot; and a
/// file deleted from the parent since rewrote its directory's item, so
/// the entries of the parent's changed directories that the parent no
/// longer has are the snapshot's files kept only there (whole
/// directories of them descended).
fn by_changes(
    dir: &File,
    parent: &[ChangedInode],
    otransid: u64,
    d: &mut SnapshotDiff,
) -> std::io::Result<Vec<u64>> {
    let fd = dir.as_fd();
    let mut listed = Vec::new();
    let mut dirs = Vec::new();
    for p in parent {
        if p.transid < otransid {
            if p.is_regular() {
                d.files_as_parent += 1;
                d.bytes_as_parent += p.size;
            }
        } else if p.is_dir() {
            dirs.push(p.ino);
        } else if p.is_regular() {
            let Some(s) = inode_item(fd, p.ino)? else {
                continue;
            };
            let mut one = differing(&[s], std::slice::from_ref(p), otransid, d);
            listed.append(&mut one);
        }
    }
    let gone = |ino: u64| parent.binary_search_by_key(&ino, |p| p.ino).is_err();
    while let Some(dir_ino) = dirs.pop() {
        for e in dir_entries(fd, dir_ino)? {
            if !gone(e.ino) {
                continue;
            }
            match e.file_type {
                FT_DIR => dirs.push(e.ino),
                FT_REG_FILE => listed.push(e.ino),
                _ => {}
            }
        }
    }
    listed.sort_unstable();
    listed.dedup();
    Ok(listed)
}

/// A read-only snapshot met by the walk, and the root of the walked
/// subvolume it was taken of.
pub(crate) struct Snapshot<'a> {
    pub path: &'a Path,
    pub dev: u64,
    pub otransid: u64,
    /// Past `otransid` if the snapshot itself changed after it was made.
    pub ctransid: u64,
    pub parent: &'a Path,
}

/// Lists the files of `snap` that differ from its parent's into `out`;
/// the parent's inode items are searched once per run (`parents`). An
/// error when either tree cannot be searched: walk the snapshot instead.
pub(crate) fn list(
    snap: &Snapshot<'_>,
    parents: &mut HashMap<PathBuf, Vec<ChangedInode>>,
    filters: &Filters,
    progress: &Progress,
    out: &mut Collected,
    diff: &mut SnapshotDiff,
) -> std::io::Result<()> {
    let dir = File::open(snap.path)?;
    let parent = match parents.entry(snap.parent.to_path_buf()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let p = File::open(snap.parent)?;
            e.insert(changed_inodes(p.as_fd(), 0)?)
        }
    };
    let mut d = SnapshotDiff {
        snapshots: 1,
        ..Default::default()
    };
    let changed = parent.iter().filter(|p| p.transid >= snap.otransid).count();
    let listed = if snap.ctransid <= snap.otransid && changed <= parent.len() / FEW_CHANGES {
        let listed = by_changes(&dir, parent, snap.otransid, &mut d)?;
        if cfg!(debug_assertions) {
            // Test builds check the shortcut against the whole search.
            let mut whole = SnapshotDiff {
                snapshots: 1,
                ..Default::default()
            };
            let mine = changed_inodes(dir.as_fd(), 0)?;
            let all = differing(&mine, parent, snap.otransid, &mut whole);
            assert_eq!((&all, whole), (&listed, d), "{}", snap.path.display());
        }
        listed
    } else {
        let mine = changed_inodes(dir.as_fd(), 0)?;
        differing(&mine, parent, snap.otransid, &mut d)
    };
    for ino in listed {
        if progress.cancelled() {
            break;
        }
        add_inode(snap, &dir, ino, filters, progress, out);
    }
    *diff += d;
    Ok(())
}

/// Adds inode `ino` of the snapshot under its first name that the
/// filters let through, as the walk would have found it.
fn add_inode(
    snap: &Snapshot<'_>,
    dir: &File,
    ino: u64,
    filters: &Filters,
    progress: &Progress,
    out: &mut Collected,
) {
    let names = match inode_paths(dir.as_fd(), ino) {
        Ok(n) => n,
        Err(source) => {
            let path = snap.path.join(format!("<inode {ino}>"));
            return out.errors.push(ScanError::Walk { path, source });
        }
    };
    for rel in names {
        let path = snap.path.join(OsStr::from_bytes(&rel));
        if !names_pass(filters, snap.path, &path, out) {
            continue;
        }
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return out.errors.push(ScanError::Stat { path, source }),
        };
        if !meta.is_file() || meta.ino() != ino || meta.dev() != snap.dev {
            continue;
        }
        match filters.file(snap.dev, ino, meta.size(), &path) {
            Ok(dev) => {
                count_found(progress, meta.size());
                out.add(&path, &filters.tree, |name| {
                    FileEntry::from_meta(name, dev, &meta)
                });
            }
            Err(r) => out.skip(r),
        }
        return;
    }
}

/// Whether the walk would have reached `path` below `snap`: no directory
/// on the way nor the file itself is excluded. A skipped file is counted;
/// a skipped directory was counted by the walk in the parent subvolume
/// (the same directory there) or not at all (one of our own).
fn names_pass(filters: &Filters, snap: &Path, path: &Path, out: &mut Collected) -> bool {
    for p in path.ancestors().take_while(|p| *p != snap) {
        match filters.name(p) {
            Ok(()) => {}
            Err(Some(r)) if p == path => {
                out.skip(r);
                return false;
            }
            Err(_) => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inode `ino` as last written in transaction `transid`, with content
    /// `version` (what the stable hash stands for).
    fn ino(ino: u64, transid: u64, version: u64) -> ChangedInode {
        ChangedInode {
            ino,
            transid,
            mode: libc::S_IFREG | 0o644,
            size: 10_000,
            ctime_sec: 1_700_000_000,
            stable: ino * 1000 + version,
        }
    }

    #[test]
    fn unchanged_inodes_are_left_out_and_counted() {
        // The snapshot was made in transaction 50.
        let mut dir = ino(262, 10, 0);
        dir.mode = libc::S_IFDIR | 0o755;
        let snapshot = [
            ino(257, 10, 0),
            ino(258, 20, 0),
            ino(259, 30, 0),
            ino(261, 40, 0),
            ino(263, 40, 0),
            dir,
        ];
        let parent = [
            ino(257, 10, 0), // unchanged
            ino(258, 60, 1), // written since
            // 259 deleted from the parent since: only in snapshots
            ino(260, 55, 0), // new in the parent
            ino(261, 40, 0),
            ino(262, 10, 0),
            ino(263, 70, 0), // only read since (atime)
        ];
        let mut d = SnapshotDiff::default();
        assert_eq!(differing(&snapshot, &parent, 50, &mut d), vec![258, 259]);
        assert_eq!((d.files_as_parent, d.bytes_as_parent), (3, 30_000));
    }

    #[test]
    fn the_snapshots_own_transaction_and_any_difference_list_the_file() {
        // Written in the transaction the snapshot was made in: before or
        // after it is not told apart, so it is listed.
        let mut d = SnapshotDiff::default();
        let same = [ino(257, 50, 0)];
        assert_eq!(differing(&same, &same, 50, &mut d), vec![257]);
        // Changed in the snapshot after it was made (made writable, then
        // read-only again).
        let (s, p) = ([ino(257, 70, 1)], [ino(257, 10, 0)]);
        assert_eq!(differing(&s, &p, 50, &mut d), vec![257]);
        assert_eq!(d, SnapshotDiff::default());
        // An empty parent lists everything.
        let all = [ino(257, 1, 0), ino(300, 2, 0)];
        assert_eq!(differing(&all, &[], 50, &mut d), vec![257, 300]);
    }
}
