//! `onecopy-store`: the inline dedupe store. Files are cut into chunks
//! (fixed or FastCDC), each chunk is identified by its BLAKE3-256 and kept
//! once in append-only containers; metadata (namespace, file maps,
//! reference counts) lives in SQLite. The file-system adapter
//! (`onecopy-fuse`) calls [`Store`]; formats and the crash model are in
//! ARCHITECTURE.md.

/// `eprintln!` that never panics: a mount's stderr is its log in the
/// store's directory (`mount.log`), so a full disk (or a log whose reader
/// is gone) fails the write, and `eprintln!` would then take down the
/// thread that reports, a mount's main thread at unmount among them.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod acl;
mod ahead;
mod attrs;
pub mod bucket;
mod cache;
mod cdc;
mod chunks;
pub mod config;
pub mod container;
mod copy;
mod data;
mod diff;
mod direct;
pub mod error;
mod fetch;
mod follow;
mod forget;
mod import;
mod index;
mod lease;
mod maint;
pub mod meta;
mod migrate;
pub mod mirror;
mod ns;
mod pack;
pub mod pages;
pub mod remote;
mod restore;
pub mod seal;
mod seen;
mod snap;
mod space;
mod store;
mod view;

pub use cache::unpin_thread;
pub use config::{Chunking, Compress, RemoteSpec, StoreConfig};
pub use diff::Change;
pub use error::{Result, StoreError};
pub use forget::{plan as forget_plan, ForgetReport, Keep};
pub use import::{
    measure as import_measure, ImportError, ImportOptions, ImportProgress, ImportReport,
};
pub use maint::{FsckReport, GcReport, ScrubReport, StatFs, Stats};
pub use meta::ChunkLoc;
pub use ns::{Attr, DirEntry, Kind, NewNode, RenameFlags, SetAttr, SetidKill};
pub use restore::RestoreReport;
pub use snap::{split_view, view_ino, Snapshot, SnapshotInfo, VIEW_SHIFT};
pub use store::{Atime, Store, WriteCounters};
pub use view::{is_read_only, META_DIR_INO, META_DIR_NAME, SNAPSHOTS_DIR_INO};

#[cfg(test)]
mod tests;
