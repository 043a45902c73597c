//! Deciding, from the catalog, which walked files must be read again.
//!
//! A file is known (its digests are reused, it is not read) when the
//! catalog holds a record for its `(filesystem, subvolume, inode)` with the
//! same size and mtime and:
//! * the same ctime, or
//! * another path or link count (a rename, move, `link` or `unlink`
//!   updates ctime) and the same inode generation, which rules out a
//!   reused inode number.
//!
//! So a rename costs no read, while a content change whose mtime was put
//! back (`touch -r`) is caught by its ctime. Records of files under the
//! roots that the walk did not see are deleted. Records outside the roots
//! are kept, and used as dedupe sources (never destinations) while their
//! file still exists unchanged.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use onecopy_scan::{FileEntry, FsId, HashedFile};

use crate::FileRecord;

/// A file whose digests come from the catalog.
#[derive(Debug, Clone)]
pub struct Known {
    pub file: HashedFile,
    /// Every range planned for it was shared by an earlier run.
    pub settled: bool,
    /// Outside this run's roots: a source only.
    pub outside_roots: bool,
    /// The record must be rewritten (new path or ctime).
    pub dirty: bool,
}

/// What [`classify`] decided.
#[derive(Debug, Default)]
pub struct Classified {
    pub known: Vec<Known>,
    pub to_read: Vec<FileEntry>,
    /// Catalog keys to delete: files gone, changed outside the roots, or
    /// no longer found under the roots.
    pub deleted: Vec<(String, u64, u64)>,
    /// Known files found under another path than recorded.
    pub renamed: u64,
}

fn under_roots(p: &std::path::Path, roots: &[PathBuf]) -> bool {
    roots.iter().any(|r| p.starts_with(r))
}

fn to_hashed(rec: FileRecord, entry: FileEntry) -> HashedFile {
    HashedFile {
        entry,
        blocks: rec.blocks.into_boxed_slice(),
        subs: Box::default(),
        whole: rec.whole,
        inode_flags: rec.flags,
        generation: rec.generation,
        racy: false,
    }
}

fn generation_of(path: &std::path::Path) -> Option<u64> {
    let f = onecopy_scan::longpath::open(path, rustix::fs::OFlags::empty()).ok()?;
    onecopy_ioctl::fs::inode_generation(f.as_fd()).ok()
}

/// Splits the walked files of one filesystem (`fs_key`, `fs`, `fs_block`)
/// into known and to-read, against that filesystem's `records`. `roots`
/// must be absolute, as the walked paths are.
pub fn classify(
    fs_key: &str,
    fs: FsId,
    fs_block: u64,
    records: Vec<FileRecord>,
    walked: Vec<FileEntry>,
    roots: &[PathBuf],
) -> Classified {
    // The map holds positions, not records (24 B per entry instead of a
    // second copy of every record); each record is taken out of its slot
    // once, so its path and digests move on or are freed at that point.
    let mut records: Vec<Option<FileRecord>> = records.into_iter().map(Some).collect();
    let mut by_key: HashMap<(u64, u64), u32> = records
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.as_ref().map(|r| (i, r)))
        .filter(|(_, r)| r.fs == fs_key)
        .map(|(i, r)| ((r.subvol, r.ino), i as u32))
        .collect();
    let mut out = Classified {
        // Reserved, not touched: pages are used as records are known.
        known: Vec::with_capacity(walked.len().min(by_key.len())),
        ..Classified::default()
    };
    let mut take = |key: &(u64, u64)| {
        let i = by_key.remove(key)?;
        records[i as usize].take()
    };
    // The files to read stay in the walked list (filtered in place, then
    // shrunk): no second list of every entry.
    let mut to_read = walked;
    to_read.retain_mut(|e| {
        let Some(rec) = take(&(e.subvol, e.ino)) else {
            return true;
        };
        let same_data = rec.size == e.size && rec.mtime_ns == e.mtime_ns;
        // A rename or a new or removed hard link changes ctime but not the
        // data: trusted when the inode generation proves it is the same file.
        let relinked = rec.path != e.path || rec.nlink != e.nlink;
        let known = if !same_data {
            false
        } else if rec.ctime_ns == e.ctime_ns {
            true
        } else if relinked {
            generation_of(&e.path) == Some(rec.generation)
        } else {
            false
        };
        if !known {
            return true;
        }
        if rec.path != e.path {
            out.renamed += 1;
        }
        let dirty = relinked || rec.ctime_ns != e.ctime_ns;
        // The entry leaves the list: its path moves, nothing is copied.
        let entry = FileEntry {
            path: std::mem::take(&mut e.path),
            ..e.clone()
        };
        out.known.push(Known {
            settled: rec.settled,
            file: to_hashed(rec, entry),
            outside_roots: false,
            dirty,
        });
        false
    });
    to_read.shrink_to_fit();
    out.to_read = to_read;
    out.known.shrink_to_fit();
    // Records the walk did not meet.
    for (_, i) in by_key {
        let Some(rec) = records[i as usize].take() else {
            continue;
        };
        let key = (rec.fs.clone(), rec.subvol, rec.ino);
        if under_roots(&rec.path, roots) {
            out.deleted.push(key);
            continue;
        }
        match std::fs::symlink_metadata(&rec.path) {
            Ok(m)
                if m.is_file()
                    && m.ino() == rec.ino
                    && m.size() == rec.size
                    && m.mtime() * 1_000_000_000 + m.mtime_nsec() == rec.mtime_ns
                    && m.ctime() * 1_000_000_000 + m.ctime_nsec() == rec.ctime_ns =>
            {
                let entry = FileEntry::from_meta(rec.path.clone(), &m, fs, rec.subvol, fs_block);
                out.known.push(Known {
                    settled: rec.settled,
                    file: to_hashed(rec, entry),
                    outside_roots: true,
                    dirty: false,
                });
            }
            _ => out.deleted.push(key),
        }
    }
    out
}
