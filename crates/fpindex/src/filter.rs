//! The summary filter of a sealed run: binary fuse filters (xorf
//! `BinaryFuse16`, 18 bits per key, false-positive rate 2^-16) partitioned
//! by the key's top bits, so a run can be built streaming from sorted
//! output with at most one partition's keys in RAM.

use memmap2::{Advice, MmapMut};
use xorf::{BinaryFuse16, BinaryFuse16Ref, Filter, FilterRef};

use crate::format::{open_blob, seal_blob, u32_at, u64_at};

const MAGIC: &[u8; 8] = b"OCFPFLT\0";

// Fingerprints are stored little-endian and probed in place as native u16.
#[cfg(target_endian = "big")]
compile_error!("onecopy-fpindex stores filters little-endian and probes them in place");

/// Keys per partition aimed at (the build holds one partition in RAM).
pub const PARTITION_KEYS: u64 = 1 << 20;

pub struct RunFilter {
    shift: u32,
    parts: Vec<Option<Part>>,
    /// All partitions' fingerprints (little-endian u16) in one anonymous
    /// mapping advised for transparent huge pages: a probe touches three
    /// random places, and without huge pages each costs a TLB miss too.
    mem: MmapMut,
}

/// One partition: its xorf descriptor bytes and where its fingerprints are.
struct Part {
    desc: [u8; DESC],
    off: usize,
    len: usize,
}

/// Bytes of a serialized binary fuse descriptor (seed, segment length,
/// mask, segment count length), the layout xorf's `from_dma` parses.
const DESC: usize = 20;

/// The u64 the filter sees for a key: both halves folded (keys are
/// digests, but a caller's keys sharing a low half must not all collide).
fn probe(key: u128) -> u64 {
    (key as u64) ^ ((key >> 64) as u64).rotate_left(29)
}

/// Number of partitions (a power of two) for up to `n` keys.
pub fn partitions_for(n: u64) -> usize {
    (n.div_ceil(PARTITION_KEYS)).next_power_of_two().max(1) as usize
}

fn shift_for(n: usize) -> u32 {
    if n <= 1 {
        64
    } else {
        64 - n.trailing_zeros()
    }
}

fn anon(len: usize) -> Option<MmapMut> {
    let mem = MmapMut::map_anon(len.max(1)).ok()?;
    // Best effort: without it lookups are slower, not wrong.
    let _ = mem.advise(Advice::HugePage);
    Some(mem)
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
            Some(p) => BinaryFuse16Ref::from_dma(&p.desc, &self.mem[p.off..p.off + p.len])
                .contains(&probe(key)),
            None => false,
        }
    }

    /// Bytes of RAM held.
    pub fn bytes(&self) -> usize {
        self.parts.iter().flatten().map(|p| p.len).sum::<usize>()
            + self.parts.len() * std::mem::size_of::<Option<Part>>()
    }

    /// Encodes the filter as a header blob (shift, partitions) followed by
    /// one checksummed blob per partition (descriptor, fingerprints), so
    /// that opening a run reads it a partition at a time.
    pub fn encode(&self) -> Vec<u8> {
        let mut head = Vec::new();
        head.extend_from_slice(&(self.shift as u64).to_le_bytes());
        head.extend_from_slice(&(self.parts.len() as u64).to_le_bytes());
        let mut out = seal_blob(MAGIC, 1, &head);
        for p in &self.parts {
            let mut b = Vec::new();
            if let Some(p) = p {
                b.extend_from_slice(&p.desc);
                b.extend_from_slice(&self.mem[p.off..p.off + p.len]);
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
    /// (which must refuse ranges beyond the filter's region). A first pass
    /// over the blob headers sizes the mapping; the second copies each
    /// partition in after checking it.
    pub fn decode_with(mut read: impl FnMut(usize, usize) -> Option<Vec<u8>>) -> Option<RunFilter> {
        let blob_len =
            |read: &mut dyn FnMut(usize, usize) -> Option<Vec<u8>>, off: usize| -> Option<usize> {
                usize::try_from(u64_at(&read(off, 24)?, 12)?)
                    .ok()?
                    .checked_add(24)
            };
        let head_len = blob_len(&mut read, 0)?;
        let head = read(0, head_len)?;
        let (_, head) = open_blob(MAGIC, &head)?;
        let shift = u32::try_from(u64_at(head, 0)?).ok()?;
        let n = usize::try_from(u64_at(head, 8)?).ok()?;
        if !n.is_power_of_two() || n > 1 << 24 || shift != shift_for(n) {
            return None;
        }
        let mut offs = Vec::with_capacity(n);
        let (mut off, mut total) = (head_len, 0usize);
        for _ in 0..n {
            let len = blob_len(&mut read, off)?;
            offs.push((off, len));
            total = total.checked_add(len.saturating_sub(24 + DESC))?;
            off = off.checked_add(len)?;
        }
        let mut mem = anon(total)?;
        let mut parts = Vec::with_capacity(n);
        let mut at = 0;
        for (off, len) in offs {
            let blob = read(off, len)?;
            let (_, body) = open_blob(MAGIC, &blob)?;
            if body.is_empty() {
                parts.push(None);
                continue;
            }
            let part = check_part(body, at)?;
            mem.get_mut(at..at + part.len)?
                .copy_from_slice(&body[DESC..]);
            at += part.len;
            parts.push(Some(part));
        }
        Some(RunFilter { shift, parts, mem })
    }
}

/// Checks one partition's descriptor against its fingerprints so that a
/// lookup can not index out of bounds (a lookup indexes below
/// `segment_count_length + 2 * segment_length`, segments being aligned).
fn check_part(b: &[u8], off: usize) -> Option<Part> {
    let desc: [u8; DESC] = b.get(..DESC)?.try_into().ok()?;
    let (sl, mask, count) = (u32_at(b, 8)?, u32_at(b, 12)?, u32_at(b, 16)?);
    let len = b.len() - DESC;
    let need = (count as u64) + 2 * sl as u64;
    if !len.is_multiple_of(2)
        || !sl.is_power_of_two()
        || mask != sl - 1
        || !count.is_multiple_of(sl)
        || need > (len / 2) as u64
    {
        return None;
    }
    Some(Part { desc, off, len })
}

/// Builds a [`RunFilter`] from keys given in ascending order, writing
/// each partition into the final mapping as soon as it is built (peak RAM:
/// the filter plus one partition's keys). The mapping reserves address
/// space for 4 bytes per key plus 2 MiB per partition, more than a
/// BinaryFuse16 ever takes (~2.25 bytes per key); only what is written
/// becomes resident.
pub struct FilterBuilder {
    shift: u32,
    parts: Vec<Option<Part>>,
    mem: MmapMut,
    at: usize,
    current: Vec<u64>,
    current_part: usize,
}

fn filter_err(what: &str) -> std::io::Error {
    std::io::Error::other(format!("building the run filter: {what}"))
}

impl FilterBuilder {
    /// For at most `max_keys` keys.
    pub fn new(max_keys: u64) -> std::io::Result<Self> {
        let n = partitions_for(max_keys);
        let reserve = (max_keys as usize)
            .saturating_mul(4)
            .saturating_add((n + 1) << 21);
        let mem = anon(reserve).ok_or_else(|| filter_err("cannot map memory"))?;
        Ok(FilterBuilder {
            shift: shift_for(n),
            parts: (0..n).map(|_| None).collect(),
            mem,
            at: 0,
            current: Vec::new(),
            current_part: 0,
        })
    }

    /// Adds the next key (ascending order).
    pub fn push(&mut self, key: u128) -> std::io::Result<()> {
        let p = RunFilter::part_of(self.shift, key);
        if p != self.current_part {
            self.seal()?;
            self.current_part = p;
        }
        self.current.push(probe(key));
        Ok(())
    }

    fn seal(&mut self) -> std::io::Result<()> {
        if self.current.is_empty() {
            return Ok(());
        }
        self.current.sort_unstable();
        self.current.dedup();
        // Construction fails only on duplicate keys, removed above.
        let f = BinaryFuse16::try_from(&self.current).map_err(filter_err)?;
        let d = &f.descriptor;
        let mut desc = [0u8; DESC];
        desc[..8].copy_from_slice(&d.seed.to_le_bytes());
        desc[8..12].copy_from_slice(&d.segment_length.to_le_bytes());
        desc[12..16].copy_from_slice(&d.segment_length_mask.to_le_bytes());
        desc[16..20].copy_from_slice(&d.segment_count_length.to_le_bytes());
        let len = f.fingerprints.len() * 2;
        let dst = self
            .mem
            .get_mut(self.at..self.at + len)
            .ok_or_else(|| filter_err("reservation exceeded"))?;
        for (dst, x) in dst.chunks_exact_mut(2).zip(f.fingerprints.iter()) {
            dst.copy_from_slice(&x.to_le_bytes());
        }
        self.parts[self.current_part] = Some(Part {
            desc,
            off: self.at,
            len,
        });
        self.at += len;
        self.current.clear();
        Ok(())
    }

    pub fn finish(mut self) -> std::io::Result<RunFilter> {
        self.seal()?;
        Ok(RunFilter {
            shift: self.shift,
            parts: self.parts,
            mem: self.mem,
        })
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
        let mut b = FilterBuilder::new(3 * PARTITION_KEYS).unwrap();
        for &k in &keys {
            b.push(k).unwrap();
        }
        let f = b.finish().unwrap();
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
