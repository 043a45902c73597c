//! The summary filter of a sealed run: binary fuse filters (xorf
//! `BinaryFuse16`, 18 bits per key, false-positive rate 2^-16) partitioned
//! by the key's top bits, so a run can be built streaming from sorted
//! output with at most one partition's keys in RAM.

use xorf::Descriptor;
use xorf::{BinaryFuse16, Filter};

use crate::format::{open_blob, seal_blob, u32_at, u64_at};

const MAGIC: &[u8; 8] = b"OCFPFLT\0";

/// Keys per partition aimed at (the build holds one partition in RAM).
pub const PARTITION_KEYS: u64 = 1 << 20;

pub struct RunFilter {
    shift: u32,
    parts: Vec<Option<BinaryFuse16>>,
}

/// The u64 the filter sees for a key: both halves folded (keys are
/// digests, but a caller's keys sharing a low half must not all collide).
fn probe(key: u128) -> u64 {
    (key as u64) ^ ((key >> 64) as u64).rotate_left(29)
}

/// Number of partitions (a power of two) for up to `n` keys.
pub fn partitions_for(n: u64) -> usize {
    (n.div_ceil(PARTITION_KEYS)).next_power_of_two().max(1) as usize
}

impl RunFilter {
    fn part_of(shift: u32, key: u128) -> usize {
        if shift >= 64 {
            0
        } else {
            ((key >> 64) as u64 >> shift) as usize
        }
    }

    pub fn contains(&self, key: u128) -> bool {
        match &self.parts[Self::part_of(self.shift, key)] {
            Some(f) => f.contains(&probe(key)),
            None => false,
        }
    }

    /// Bytes of RAM held.
    pub fn bytes(&self) -> usize {
        self.parts
            .iter()
            .flatten()
            .map(|f| f.fingerprints.len() * 2 + 32)
            .sum::<usize>()
            + self.parts.len() * 8
    }

    /// Encodes the filter as a header blob (shift, partitions) followed by
    /// one checksummed blob per partition, so that opening a run reads it
    /// a partition at a time (peak RAM: the filter plus one partition).
    pub fn encode(&self) -> Vec<u8> {
        let mut head = Vec::new();
        head.extend_from_slice(&(self.shift as u64).to_le_bytes());
        head.extend_from_slice(&(self.parts.len() as u64).to_le_bytes());
        let mut out = seal_blob(MAGIC, 1, &head);
        for p in &self.parts {
            let mut b = Vec::new();
            if let Some(f) = p {
                let d = &f.descriptor;
                b.extend_from_slice(&d.seed.to_le_bytes());
                for v in [
                    d.segment_length,
                    d.segment_length_mask,
                    d.segment_count_length,
                ] {
                    b.extend_from_slice(&v.to_le_bytes());
                }
                for x in f.fingerprints.iter() {
                    b.extend_from_slice(&x.to_le_bytes());
                }
            }
            out.extend_from_slice(&seal_blob(MAGIC, 1, &b));
        }
        out
    }

    /// Decodes from bytes in memory (see [`RunFilter::decode_with`]).
    pub fn decode(b: &[u8]) -> Option<RunFilter> {
        Self::decode_with(|off, len| b.get(off..off.checked_add(len)?).map(<[u8]>::to_vec))
    }

    /// Decodes a filter, fetching `len` bytes at `off` through `read`
    /// (which must refuse ranges beyond the filter's region).
    pub fn decode_with(mut read: impl FnMut(usize, usize) -> Option<Vec<u8>>) -> Option<RunFilter> {
        let mut off = 0usize;
        let mut next = |read: &mut dyn FnMut(usize, usize) -> Option<Vec<u8>>| -> Option<Vec<u8>> {
            let head = read(off, 24)?;
            let len = usize::try_from(u64_at(&head, 12)?).ok()?.checked_add(24)?;
            let blob = read(off, len)?;
            off += len;
            open_blob(MAGIC, &blob).map(|(_, body)| body.to_vec())
        };
        let head = next(&mut read)?;
        let shift = u32::try_from(u64_at(&head, 0)?).ok()?;
        let n = usize::try_from(u64_at(&head, 8)?).ok()?;
        let expect = if n <= 1 { 64 } else { 64 - n.trailing_zeros() };
        if !n.is_power_of_two() || n > 1 << 24 || shift != expect {
            return None;
        }
        let mut parts = Vec::with_capacity(n);
        for _ in 0..n {
            let body = next(&mut read)?;
            parts.push(if body.is_empty() {
                None
            } else {
                Some(decode_part(&body)?)
            });
        }
        Some(RunFilter { shift, parts })
    }
}

/// One partition: descriptor and fingerprints, checked so that a lookup
/// can not index out of bounds.
fn decode_part(b: &[u8]) -> Option<BinaryFuse16> {
    let seed = u64_at(b, 0)?;
    let (sl, mask, count) = (u32_at(b, 8)?, u32_at(b, 12)?, u32_at(b, 16)?);
    let raw = b.get(20..)?;
    let len = raw.len() / 2;
    // A lookup indexes below `segment_count_length + 2 * segment_length`
    // (segments are aligned): refuse descriptors that would overrun.
    let need = (count as u64) + 2 * sl as u64;
    if raw.len() % 2 != 0
        || !sl.is_power_of_two()
        || mask != sl - 1
        || count % sl != 0
        || need > len as u64
    {
        return None;
    }
    let fingerprints = raw
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    let descriptor = Descriptor {
        seed,
        segment_length: sl,
        segment_length_mask: mask,
        segment_count_length: count,
    };
    Some(BinaryFuse16 {
        descriptor,
        fingerprints,
    })
}

/// Builds a [`RunFilter`] from keys given in ascending order.
pub struct FilterBuilder {
    shift: u32,
    parts: Vec<Option<BinaryFuse16>>,
    current: Vec<u64>,
    current_part: usize,
}

impl FilterBuilder {
    /// For at most `max_keys` keys.
    pub fn new(max_keys: u64) -> Self {
        let n = partitions_for(max_keys);
        let shift = if n <= 1 { 64 } else { 64 - n.trailing_zeros() };
        FilterBuilder {
            shift,
            parts: (0..n).map(|_| None).collect(),
            current: Vec::new(),
            current_part: 0,
        }
    }

    /// Adds the next key (ascending order).
    pub fn push(&mut self, key: u128) {
        let p = RunFilter::part_of(self.shift, key);
        if p != self.current_part {
            self.seal();
            self.current_part = p;
        }
        self.current.push(probe(key));
    }

    fn seal(&mut self) {
        if self.current.is_empty() {
            return;
        }
        self.current.sort_unstable();
        self.current.dedup();
        // Construction fails only on duplicates (removed above).
        self.parts[self.current_part] = BinaryFuse16::try_from(&self.current).ok();
        if self.parts[self.current_part].is_none() {
            // Never expected; an absent filter would lose keys, so fail loud.
            panic!(
                "binary fuse construction failed on {} distinct keys",
                self.current.len()
            );
        }
        self.current.clear();
    }

    pub fn finish(mut self) -> RunFilter {
        self.seal();
        RunFilter {
            shift: self.shift,
            parts: self.parts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn no_false_negatives_and_round_trip() {
        let mut keys: Vec<u128> = (1..5000u128)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
            .collect();
        keys.sort_unstable();
        let mut b = FilterBuilder::new(3 * PARTITION_KEYS);
        for &k in &keys {
            b.push(k);
        }
        let f = b.finish();
        let g = RunFilter::decode(&f.encode()).unwrap();
        assert!(keys.iter().all(|&k| f.contains(k) && g.contains(k)));
        let fp = (0..100_000u128)
            .filter(|&i| g.contains(i << 64 | 12345))
            .count();
        assert!(fp < 50, "false positives {fp}");
    }

    proptest! {
        #[test]
        fn decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Some(f) = RunFilter::decode(&b) {
                let _ = f.contains(1);
                let _ = f.contains(u128::MAX);
            }
        }
    }
}
