//! `onecopy-store`: the inline dedupe store. Files are cut into chunks
//! (fixed or FastCDC), each chunk is identified by its BLAKE3-256 and kept
//! once in append-only containers; metadata (namespace, file maps,
//! reference counts) lives in SQLite. The file-system adapter
//! (`onecopy-fuse`) calls [`Store`]; formats and the crash model are in
//! ARCHITECTURE.md.

mod acl;
mod cache;
pub mod config;
pub mod container;
mod data;
pub mod error;
mod import;
mod index;
mod maint;
pub mod meta;
mod migrate;
mod ns;
mod space;
mod store;

pub use config::{Chunking, Compress, StoreConfig};
pub use error::{Result, StoreError};
pub use import::{
    measure as import_measure, ImportError, ImportOptions, ImportProgress, ImportReport,
};
pub use maint::{FsckReport, GcReport, ScrubReport, StatFs, Stats};
pub use meta::{ChunkIndex, ChunkLoc};
pub use ns::{Attr, DirEntry, Kind, NewNode, RenameFlags, SetAttr, SetidKill};
pub use store::{Atime, Store, WriteCounters};

#[cfg(test)]
mod tests;
