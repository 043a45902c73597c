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
fn block_of(h: u64, blocks: usize) -> usize {
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
/// that independent probes overlap in the CPU.
#[inline]
pub fn contains(bloom: &[u8], h: u64) -> bool {
    let blocks = bloom.len() / BLOCK;
    let at = block_of(h, blocks) * BLOCK;
    let Some(b) = bloom.get(at..at + BLOCK) else {
        return true;
    };
    let b: &[u8; BLOCK] = b.try_into().unwrap_or(&[0xff; BLOCK]);
    let mut ok = 1u64;
    for j in 0..8 {
        let w = u64::from_le_bytes([
            b[8 * j],
            b[8 * j + 1],
            b[8 * j + 2],
            b[8 * j + 3],
            b[8 * j + 4],
            b[8 * j + 5],
            b[8 * j + 6],
            b[8 * j + 7],
        ]);
        ok &= w >> ((h >> (6 * j)) & 63);
    }
    ok & 1 == 1
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
