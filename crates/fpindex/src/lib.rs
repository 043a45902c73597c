//! The fingerprint index: an exact, persistent map from a block
//! fingerprint (`u128` digest) to a location (`u64`, the caller's), with a
//! reference count and an insertion time per entry.
//!
//! Layout (ARCHITECTURE.md, "Fingerprint index"): an append-only log of
//! checksummed records in front of sealed runs (sorted, checksummed
//! pages); per run a binary fuse filter and a directory of each page's
//! first key in RAM, so a lookup that misses the RAM costs at most one
//! device read; entries also stored in insertion order (segment pages),
//! which a disk hit loads into a bounded cache; eager, lazy (batched, with
//! a locality ring) and auto lookup.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

mod bitmap;
pub mod bloom;
mod cache;
pub mod error;
pub mod filter;
pub mod format;
mod index;
pub mod io;
pub mod lazy;
pub mod run;

pub use error::{Error, Result};
pub use format::Entry;
pub use index::{Config, Index, Inserted, Mode, Stats};
pub use io::{FsIo, Io, MemIo, SlowIo};

/// Hashes a digest key by folding it (digests are uniform already).
#[derive(Default, Clone, Copy)]
pub struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ (v >> 64) as u64;
    }
}

pub(crate) type KeyMap<V> = HashMap<u128, V, BuildHasherDefault<FoldHasher>>;

#[cfg(test)]
mod tests;
