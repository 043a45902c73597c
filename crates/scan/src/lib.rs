//! Walking the given roots and fingerprinting file contents.
//!
//! Pipeline stage one and two of onecopy: [`walk`] lists the regular files
//! under the roots (in parallel, never following symlinks, staying on each
//! root's filesystem), [`hash_files`] reads each file once, sequentially,
//! into a buffer that is reused across files, and computes one digest per
//! block plus a whole-file digest.

mod hash;
pub mod layout;
pub mod longpath;
pub mod snapdiff;
pub mod tree;
mod walk;

pub use hash::{
    hash_files, hash_files_with, window_digest, zero_block_digest, BlockDigest, Blocks,
    DigestStore, Digests, HashOptions, HashOutput, HashedFile, KnownCopies, ListWriter,
    NoKnownCopies, SpillHandle, SubDigest, LONG_LIST, RACY_MARGIN_NS,
};
pub use snapdiff::SnapshotDiff;
pub use tree::{DevId, Device, NameId, Tree};
pub use walk::{validate_excludes, walk, FileEntry, FsId, Marks, WalkOptions, WalkOutput};

use std::path::PathBuf;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Why a file was not considered. Counted in the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// Smaller than `--min-size`, empty, or on btrfs small enough to be
    /// stored inline in metadata (at most 2048 bytes), where nothing can be
    /// shared.
    TooSmall,
    /// A symlink, device, socket or fifo.
    NotRegular,
    /// On another filesystem than its root (a nested mount).
    OtherFilesystem,
    /// Matched an `--exclude` pattern.
    Excluded,
    /// In a btrfs snapshot (read-only or not), with `--exclude-snapshots`:
    /// counted once per snapshot (or root) not entered, not per file.
    Snapshot,
    /// A further name of an inode already listed (a hardlink).
    Hardlink,
    /// The file changed while it was being read.
    ChangedWhileReading,
    /// The file was deleted or renamed away between listing and reading.
    Vanished,
    /// An active swap file: the kernel refuses to share its extents.
    SwapFile,
    /// The filesystem cannot dedupe (not btrfs or XFS, or read-only).
    UnsupportedFilesystem,
    /// Being read when the run was interrupted (SIGINT/SIGTERM): a large
    /// file is left part way instead of holding the run until its end.
    Interrupted,
    /// More blocks than a digest list holds (2^32: 16 TiB at 4 KiB); a
    /// larger `--block-size` takes it.
    TooManyBlocks,
}

/// A per-file problem: recorded, reported at the end, never fatal.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error("{path}: cannot read directory entry: {source}")]
    Walk {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot open: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot stat: {source}")]
    Stat {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl ScanError {
    pub fn path(&self) -> &std::path::Path {
        match self {
            ScanError::Walk { path, .. }
            | ScanError::Open { path, .. }
            | ScanError::Read { path, .. }
            | ScanError::Stat { path, .. } => path,
        }
    }
}

/// Counters the caller may poll from another thread to draw progress.
#[derive(Debug, Default)]
pub struct Progress {
    pub files_found: AtomicU64,
    pub bytes_found: AtomicU64,
    pub files_done: AtomicU64,
    pub bytes_done: AtomicU64,
    /// Set by the caller to stop early (Ctrl-C); work in flight finishes.
    pub cancel: AtomicBool,
}

impl Progress {
    pub fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// Splits `items` into one list per key (`key` must be cheap), keeping
/// their order. Memory: a single key (one filesystem, the usual case) moves
/// the list as it is; otherwise each list is allocated at its exact size
/// and the input shrinks as it is consumed, so the records are never held
/// twice in full.
pub fn split_by<T, K: Ord + Copy>(
    mut items: Vec<T>,
    key: impl Fn(&T) -> K,
) -> std::collections::BTreeMap<K, Vec<T>> {
    let mut counts = std::collections::BTreeMap::<K, usize>::new();
    for it in &items {
        *counts.entry(key(it)).or_default() += 1;
    }
    if counts.len() <= 1 {
        let mut out = std::collections::BTreeMap::new();
        if let Some(k) = counts.into_keys().next() {
            out.insert(k, items);
        }
        return out;
    }
    let mut out: std::collections::BTreeMap<K, Vec<T>> = counts
        .into_iter()
        .map(|(k, n)| (k, Vec::with_capacity(n)))
        .collect();
    // Back to front, shrinking behind, then each list is put back in order.
    let mut moved = 0usize;
    while let Some(it) = items.pop() {
        out.get_mut(&key(&it)).expect("counted").push(it);
        moved += 1;
        if moved.is_multiple_of(1 << 14) {
            items.shrink_to_fit();
        }
    }
    for v in out.values_mut() {
        v.reverse();
    }
    out
}

/// Appends `more` to `to`, keeping the order. Memory: the list moves when
/// `to` is empty; otherwise `to` grows once to its final size and `more`
/// shrinks as its records move, so the records of `more` are never held
/// twice in full.
pub fn append_shrinking<T>(to: &mut Vec<T>, mut more: Vec<T>) {
    if to.is_empty() {
        *to = more;
        return;
    }
    to.reserve_exact(more.len());
    more.reverse();
    let mut moved = 0usize;
    while let Some(it) = more.pop() {
        to.push(it);
        moved += 1;
        if moved.is_multiple_of(1 << 14) {
            more.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod split_tests {
    use super::split_by;

    #[test]
    fn split_keeps_order_per_key() {
        let items: Vec<(u8, u32)> = (0..40_000u32).map(|i| ((i % 3) as u8, i)).collect();
        let out = split_by(items, |it| it.0);
        assert_eq!(out.len(), 3);
        for (k, v) in &out {
            assert!(v.iter().all(|it| it.0 == *k));
            assert!(v.windows(2).all(|w| w[0].1 < w[1].1), "order kept");
            assert_eq!(v.len(), v.capacity(), "exact size");
        }
        assert_eq!(out.values().map(Vec::len).sum::<usize>(), 40_000);
    }

    #[test]
    fn append_shrinking_keeps_order() {
        let mut a: Vec<u32> = (0..5).collect();
        super::append_shrinking(&mut a, (5..40_000).collect());
        assert!(a.iter().copied().eq(0..40_000));
        let mut e = Vec::new();
        let b: Vec<u32> = (0..10).collect();
        let ptr = b.as_ptr();
        super::append_shrinking(&mut e, b);
        assert_eq!(e.as_ptr(), ptr, "moved, not copied");
    }

    #[test]
    fn split_single_key_moves_the_list() {
        let items: Vec<u32> = (0..1000).collect();
        let ptr = items.as_ptr();
        let out = split_by(items, |_| 7u8);
        assert_eq!(out[&7].as_ptr(), ptr, "not copied");
        assert!(split_by(Vec::<u32>::new(), |_| 0u8).is_empty());
    }
}
