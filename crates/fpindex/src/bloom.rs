//! The cache-line-blocked Bloom filter in front of each binary fuse
//! partition: a negative lookup touches one 64-byte block (one cache line)
//! instead of the fuse filter's three random lines, and only the keys it
//! admits (about 2% of absent ones) go on to the fuse filter.
//!
//! Invariants: a block is 8 little-endian u64 words, 64-byte aligned in
//! the mapping that holds it; a key sets (and a probe tests) one bit in
//! each of the 8 words of one block. The block is chosen from the top bits
//! of the key's 64-bit probe value (multiply-shift range reduction), the 8
//! bit positions from its low 48 bits, 6 bits each: fingerprints are
//! digests, so their bits are used as they are, with no rehash (keys that
//! are not uniform only make the filter admit more, never miss a key).

/// Bits of filter per key (8: 1 byte per entry).
pub const BITS_PER_KEY: u64 = 8;

/// Bytes of a block: one cache line.
pub const BLOCK: usize = 64;

/// Blocks for `keys` keys (at least one).
pub fn blocks_for(keys: usize) -> usize {
    ((keys as u64 * BITS_PER_KEY).div_ceil(BLOCK as u64 * 8)).max(1) as usize
}

/// The block of `h` among `blocks`.
#[inline]
pub fn block_of(h: u64, blocks: usize) -> usize {
    ((h as u128 * blocks as u128) >> 64) as usize
}

/// Sets `h` in `bloom` (a whole number of blocks).
pub fn insert(bloom: &mut [u8], h: u64) {
    let blocks = bloom.len() / BLOCK;
    let at = block_of(h, blocks) * BLOCK;
    for (j, w) in bloom[at..at + BLOCK].chunks_exact_mut(8).enumerate() {
        let bit = (h >> (6 * j)) & 63;
        let v = u64::from_le_bytes(w.try_into().unwrap_or_default()) | 1 << bit;
        w.copy_from_slice(&v.to_le_bytes());
    }
}

/// Whether `h` may have been inserted in `bloom` (a whole number of
/// blocks, at least one). Branch-free over the 8 words of the block, so
/// that independent probes overlap in the CPU (with AVX2 where the CPU has
/// it: [`onecopy_ioctl::bloom_block`]).
#[inline]
pub fn contains(bloom: &[u8], h: u64) -> bool {
    let blocks = bloom.len() / BLOCK;
    let at = block_of(h, blocks) * BLOCK;
    bloom.get(at..at + BLOCK).is_none_or(|b| block_has(b, h))
}

/// Whether every bit of `h` is set in `block` ([`BLOCK`] bytes; any other
/// length answers true, which costs a false positive, never a wrong answer).
#[inline]
pub fn block_has(block: &[u8], h: u64) -> bool {
    match block.try_into() {
        Ok(b) => onecopy_ioctl::bloom_block::block_has(b, h),
        Err(_) => true,
    }
}

/// Distance, in keys, at which batched probes prefetch a key's block:
/// about one memory latency (~250 ns here) of work on the keys between.
pub const PREFETCH_AHEAD: usize = 32;

/// Hints the CPU to load the block of `h` in `bloom` (a whole number of
/// blocks); only timing changes.
#[inline]
pub fn prefetch(bloom: &[u8], h: u64) {
    let blocks = bloom.len() / BLOCK;
    if let Some(b) = bloom.get(block_of(h, blocks) * BLOCK) {
        onecopy_ioctl::prefetch::prefetch_read(b);
    }
}

/// A blocked Bloom filter that accepts inserts and is cleared as a whole,
/// in front of the memtable (an exact hash map): an absent key usually
/// costs one cache line, which a batch can prefetch, instead of a probe
/// of the map. Sized for `keys` at [`BITS_PER_KEY`]; more keys only raise
/// its false-positive rate (it never says "absent" for an inserted key).
pub struct Mutable {
    buf: Vec<u8>,
    /// Offset of the first 64-byte-aligned byte of `buf`.
    off: usize,
    len: usize,
}

impl Mutable {
    pub fn new(keys: usize) -> Self {
        let len = blocks_for(keys) * BLOCK;
        let buf = vec![0u8; len + BLOCK];
        let off = buf.as_ptr().align_offset(BLOCK).min(BLOCK);
        Mutable { buf, off, len }
    }

    fn bits(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }

    pub fn insert(&mut self, h: u64) {
        insert(&mut self.buf[self.off..self.off + self.len], h);
    }

    #[inline]
    pub fn contains(&self, h: u64) -> bool {
        contains(self.bits(), h)
    }

    #[inline]
    pub fn prefetch(&self, h: u64) {
        prefetch(self.bits(), h);
    }

    /// Forgets every key (when the memtable is sealed into a run).
    pub fn clear(&mut self) {
        self.buf.fill(0);
    }

    pub fn bytes(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn false_positive_rate_at_8_bits() {
        let n = 200_000usize;
        let mut f = vec![0u8; blocks_for(n) * BLOCK];
        for i in 0..n as u64 {
            insert(&mut f, mix(i));
        }
        assert!((0..n as u64).all(|i| contains(&f, mix(i))));
        let fp = (0..1_000_000u64)
            .filter(|&i| contains(&f, mix(i + (1 << 40))))
            .count();
        // About 2.5% at 8 bits per key; far above would be a broken hash.
        assert!(fp < 40_000, "false positives {fp} per million");
    }

    #[test]
    fn mutable_filter_admits_its_keys_and_forgets_on_clear() {
        let mut m = Mutable::new(1000);
        for i in 0..1000 {
            m.insert(mix(i));
        }
        assert!((0..1000).all(|i| m.contains(mix(i))));
        let fp = (0..100_000u64)
            .filter(|&i| m.contains(mix(i + (1 << 40))))
            .count();
        assert!(fp < 4_000, "false positives {fp} per 100000");
        m.clear();
        assert!((0..1000).all(|i| !m.contains(mix(i))));
    }

    proptest! {
        #[test]
        fn no_false_negatives(keys in proptest::collection::vec(any::<u64>(), 1..500),
                              other in any::<u64>()) {
            let mut f = vec![0u8; blocks_for(keys.len()) * BLOCK];
            for &k in &keys {
                insert(&mut f, k);
            }
            for &k in &keys {
                prop_assert!(contains(&f, k));
            }
            let _ = contains(&f, other);
        }

        #[test]
        fn probe_of_arbitrary_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), 0..300),
                                                  h in any::<u64>()) {
            let _ = contains(&b, h);
        }
    }
}
