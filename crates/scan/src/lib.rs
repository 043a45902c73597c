//! Walking the given roots and fingerprinting file contents.
//!
//! Pipeline stage one and two of onecopy: [`walk`] lists the regular files
//! under the roots (in parallel, never following symlinks, staying on each
//! root's filesystem), [`hash_files`] reads each file once, sequentially,
//! into a buffer that is reused across files, and computes one digest per
//! block plus a whole-file digest.

mod hash;
pub mod longpath;
mod walk;

pub use hash::{
    hash_files, window_digest, zero_block_digest, BlockDigest, HashOptions, HashOutput, HashedFile,
    SubDigest, RACY_MARGIN_NS,
};
pub use walk::{validate_excludes, walk, FileEntry, FsId, WalkOptions, WalkOutput};

use std::path::PathBuf;

/// Name prefix of the temporary directories onecopy creates for itself;
/// the walk never enters them.
pub const TMP_DIR_PREFIX: &str = ".onecopy-tmp.";
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
