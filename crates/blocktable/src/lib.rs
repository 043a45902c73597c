//! The block table of one planning pass: "where did I first see this
//! block?". Named for [`BlockTable`], not "index": the persistent
//! fingerprint index is `onecopy-fpindex` (which a table too large for
//! RAM spills to), and the digest scheme is `onecopy-digest`.
//!
//! [`FingerprintTable`] maps a block digest to the first location it was
//! inserted at. Digests are already uniformly distributed, so the table
//! hashes them with the identity function and keys on the low 64 bits,
//! storing the high 64 bits to tell apart the (astronomically rare) keys
//! that share their low half.
//!
//! Memory: each entry holds the 64-bit key, the 64-bit high half and an
//! 8-byte [`BlockRef`] (24 bytes) plus one control byte, at a load factor of
//! at most 7/8: about [`FingerprintTable::BYTES_PER_ENTRY`] bytes per
//! distinct block.

use std::collections::HashMap;

pub mod table;

pub use table::{BlockTable, TableBudget, TableStats};

use std::hash::{BuildHasherDefault, Hasher};

/// Where a block lives: file number and block number within the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockRef {
    pub file: u32,
    pub block: u32,
}

/// Passes a u64 key through unchanged: the keys are digests already.
#[derive(Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Map = HashMap<u64, (u64, BlockRef), BuildHasherDefault<IdentityHasher>>;

/// First-occurrence table of block digests.
#[derive(Default)]
pub struct FingerprintTable {
    map: Map,
}

impl FingerprintTable {
    /// Approximate bytes of RAM per distinct block indexed (entry, control
    /// byte and the spare capacity of a 7/8 load factor).
    pub const BYTES_PER_ENTRY: usize = (8 + 8 + 8 + 1) * 8 / 7;

    pub fn with_capacity(n: usize) -> Self {
        FingerprintTable {
            map: Map::with_capacity_and_hasher(n, Default::default()),
        }
    }

    /// Inserts `at` for `digest` unless the digest is already known; returns
    /// the earlier location if there was one.
    pub fn insert_first(&mut self, digest: u128, at: BlockRef) -> Option<BlockRef> {
        let lo = digest as u64;
        let hi = (digest >> 64) as u64;
        match self.map.entry(lo) {
            std::collections::hash_map::Entry::Occupied(e) => {
                let (h, r) = *e.get();
                // A low-half collision with a different digest: keep the first
                // owner and treat the newcomer as unseen (it just is not indexed).
                (h == hi).then_some(r)
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert((hi, at));
                None
            }
        }
    }

    /// The first location of `digest`, if indexed.
    pub fn get(&self, digest: u128) -> Option<BlockRef> {
        let (h, r) = *self.map.get(&(digest as u64))?;
        (h == (digest >> 64) as u64).then_some(r)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes of RAM a table made `with_capacity(n)` takes: its buckets
    /// are a power of two at most 7/8 full.
    pub fn bytes_for(n: usize) -> usize {
        let buckets = (n.min(1 << 26) * 8).div_ceil(7).next_power_of_two().max(4);
        buckets * (8 + 8 + 8 + 1)
    }

    /// Bytes of RAM the table holds now (capacity, not just entries).
    pub fn memory_bytes(&self) -> usize {
        self.map.capacity() * (8 + 8 + 8 + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_for_counts_the_power_of_two_buckets() {
        assert_eq!(FingerprintTable::bytes_for(1000), 2048 * 25);
        let t = FingerprintTable::with_capacity(1000);
        assert!(t.memory_bytes() <= FingerprintTable::bytes_for(1000));
        assert!(t.memory_bytes() * 8 / 7 >= FingerprintTable::bytes_for(1000) - 25);
    }

    #[test]
    fn first_wins() {
        let mut t = FingerprintTable::default();
        let a = BlockRef { file: 1, block: 2 };
        let b = BlockRef { file: 3, block: 4 };
        assert_eq!(t.insert_first(42, a), None);
        assert_eq!(t.insert_first(42, b), Some(a));
        assert_eq!(t.get(42), Some(a));
        // Same low half, different high half: not confused.
        let other = 42u128 | (7u128 << 64);
        assert_eq!(t.insert_first(other, b), None);
        assert_eq!(t.get(other), None);
        assert_eq!(t.len(), 1);
    }
}
