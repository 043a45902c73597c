//! The summary filter of a sealed run: binary fuse filters (xorf
//! `BinaryFuse16`, 18 bits per key, false-positive rate 2^-16) partitioned
//! by the key's top bits, so a run can be built streaming from sorted
//! output with at most one partition's keys in RAM. Since filter version
//! 2 each partition also has a cache-line-blocked Bloom filter
//! ([`crate::bloom`], 8 bits per key) asked first: most absent keys are
//! answered by one cache line instead of the fuse filter's three.

use memmap2::{Advice, MmapMut};
use xorf::{BinaryFuse16, BinaryFuse16Ref, Filter, FilterRef};

use crate::bloom;
use crate::format::{open_blob, seal_blob, u32_at, u64_at};

const MAGIC: &[u8; 8] = b"OCFPFLT\0";
/// Filter format written: 2 = blocked Bloom + binary fuse per partition
/// (version 1, fuse only, is still read).
const VERSION: u32 = 2;

// Fingerprints are stored little-endian and probed in place as native u16.
#[cfg(target_endian = "big")]
compile_error!("onecopy-fpindex stores filters little-endian and probes them in place");

/// Keys per partition aimed at (the build holds one partition in RAM).
pub const PARTITION_KEYS: u64 = 1 << 20;

pub struct RunFilter {
    shift: u32,
    parts: Vec<Option<Part>>,
    /// Each partition's Bloom filter as [`Slot`], derived from `parts`:
    /// the one-at-a-time negative path reads 16 bytes here instead of
    /// matching a whole `Part`, so that more lookups fit in the CPU's
    /// out-of-order window and their cache misses overlap.
    slots: Box<[Slot]>,
    /// All partitions' fingerprints (little-endian u16) in one anonymous
    /// mapping advised for transparent huge pages: a probe touches three
    /// random places, and without huge pages each costs a TLB miss too.
    mem: MmapMut,
    /// All partitions' blocked Bloom filters, each a whole number of
    /// 64-byte blocks (so every block is one aligned cache line), also
    /// on huge pages.
    bloom: MmapMut,
}

/// One partition: its xorf descriptor bytes and where its fingerprints
/// and its Bloom filter are (`bloom_len` 0: none, a version-1 filter).
struct Part {
    desc: [u8; DESC],
    off: usize,
    len: usize,
    bloom_off: usize,
    bloom_len: usize,
}

/// Where a partition's Bloom filter is in `RunFilter::bloom`: its first
/// byte and its number of blocks, [`EMPTY`] for an empty partition (every
/// key absent) or [`NO_FILTER`] for a version-1 partition (no Bloom
/// filter: ask the fuse filter).
#[derive(Clone, Copy)]
struct Slot {
    off: usize,
    blocks: usize,
}

const EMPTY: usize = 0;
const NO_FILTER: usize = usize::MAX;

/// The slots of `parts` (see [`Slot`]).
fn slots_of(parts: &[Option<Part>]) -> Box<[Slot]> {
    parts
        .iter()
        .map(|p| match p {
            None => Slot {
                off: 0,
                blocks: EMPTY,
            },
            Some(p) if p.bloom_len == 0 => Slot {
                off: 0,
                blocks: NO_FILTER,
            },
            Some(p) => Slot {
                off: p.bloom_off,
                blocks: p.bloom_len / bloom::BLOCK,
            },
        })
        .collect()
}

/// [`RunFilter::block_at`] of a key whose partition is empty.
const NO_PART: usize = usize::MAX;
/// [`RunFilter::block_at`] of a key whose partition has no Bloom filter.
const NO_BLOOM: usize = usize::MAX - 1;

/// Bytes of a serialized binary fuse descriptor (seed, segment length,
/// mask, segment count length), the layout xorf's `from_dma` parses.
const DESC: usize = 20;

/// The u64 the filter sees for a key: both halves folded (keys are
/// digests, but a caller's keys sharing a low half must not all collide).
pub(crate) fn probe(key: u128) -> u64 {
    (key as u64) ^ ((key >> 64) as u64).rotate_left(29)
}

/// Number of partitions (a power of two) for up to `n` keys, about
/// `per_part` keys each (the build holds one partition in RAM: ~40 B a key).
pub fn partitions_for(n: u64, per_part: u64) -> usize {
    let n = n.div_ceil(per_part.max(1)).next_power_of_two().max(1);
    n.min(1 << 24) as usize
}

fn shift_for(n: usize) -> u32 {
    if n <= 1 {
        64
    } else {
        64 - n.trailing_zeros()
    }
}

/// Content below which a filter is not put on huge pages: a huge page is
/// 2 MiB of RAM as soon as one byte of it is touched, so small filters
/// (a dedupe run's spilled table flushes runs of a few thousand keys)
/// would cost 2 MiB each; above it the rounding costs at most a quarter.
const HUGE_MIN: usize = 8 << 20;

/// An anonymous mapping of `len` bytes, advised for transparent huge pages
/// when `content` (the bytes that will be written) is at least [`HUGE_MIN`].
fn anon(len: usize, content: usize) -> Option<MmapMut> {
    let mem = MmapMut::map_anon(len.max(1)).ok()?;
    if content >= HUGE_MIN {
        // Best effort: without it lookups are slower, not wrong.
        let _ = mem.advise(Advice::HugePage);
    }
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

    /// Whether `key` may be in the run (never false for a key that is):
    /// the partition's Bloom block first, the fuse filter for what it
    /// admits.
    #[inline]
    pub fn contains(&self, key: u128) -> bool {
        let part = Self::part_of(self.shift, key);
        let Some(&Slot { off, blocks }) = self.slots.get(part) else {
            return false;
        };
        if blocks == EMPTY {
            return false;
        }
        if blocks != NO_FILTER {
            let h = probe(key);
            let at = off + bloom::block_of(h, blocks) * bloom::BLOCK;
            if let Some(b) = self.bloom.get(at..at + bloom::BLOCK) {
                if !bloom::block_has(b, h) {
                    return false;
                }
            }
        }
        self.fuse_contains_cold(part, key)
    }

    /// The fuse filter's answer for `key` in partition `part`, kept out of
    /// line: [`RunFilter::contains`] reaches it for about 1 absent key in
    /// 50, and its code would otherwise crowd the path of the other 49.
    #[inline(never)]
    fn fuse_contains_cold(&self, part: usize, key: u128) -> bool {
        match &self.parts[part] {
            Some(p) => self.fuse_contains(p, key),
            None => false,
        }
    }

    /// The Bloom filter of `p` (empty in a version-1 partition).
    #[inline]
    fn bloom_of(&self, p: &Part) -> &[u8] {
        self.bloom
            .get(p.bloom_off..p.bloom_off + p.bloom_len)
            .unwrap_or(&[])
    }

    /// Hints the CPU to load the Bloom block `key` will be tested in.
    #[inline]
    pub fn prefetch(&self, key: u128) {
        if let Some(p) = &self.parts[Self::part_of(self.shift, key)] {
            bloom::prefetch(self.bloom_of(p), probe(key));
        }
    }

    /// Where `key`'s Bloom block starts in `self.bloom`, or [`NO_PART`]
    /// (its partition is empty: certainly absent) or [`NO_BLOOM`] (a
    /// version-1 partition: ask the fuse filter).
    #[inline]
    fn block_at(&self, key: u128) -> usize {
        match &self.parts[Self::part_of(self.shift, key)] {
            None => NO_PART,
            Some(p) if p.bloom_len == 0 => NO_BLOOM,
            Some(p) => {
                p.bloom_off + bloom::block_of(probe(key), p.bloom_len / bloom::BLOCK) * bloom::BLOCK
            }
        }
    }

    /// Sets `maybe[i]` for each `keys[i]` the run may hold (leaves the
    /// others as they are; answers exactly as [`RunFilter::contains`]).
    /// Memory-level parallelism: the Bloom block of every key is located
    /// first, each is prefetched [`bloom::PREFETCH_AHEAD`] keys before it
    /// is tested, and the fuse filter is probed afterwards, in a tight loop
    /// over the few keys the Bloom filters admitted.
    pub fn contains_many(&self, keys: &[u128], maybe: &mut [bool]) {
        let at: Vec<usize> = keys.iter().map(|&k| self.block_at(k)).collect();
        let mut admitted = Vec::new();
        for (i, (&key, m)) in keys.iter().zip(maybe.iter_mut()).enumerate() {
            if let Some(line) = at
                .get(i + bloom::PREFETCH_AHEAD)
                .and_then(|&b| self.bloom.get(b))
            {
                onecopy_ioctl::prefetch::prefetch_read(line);
            }
            if *m {
                continue;
            }
            let admit = match at[i] {
                NO_PART => false,
                NO_BLOOM => true,
                b => self
                    .bloom
                    .get(b..b + bloom::BLOCK)
                    .is_none_or(|block| bloom::contains(block, probe(key))),
            };
            if admit {
                admitted.push(i);
            }
        }
        for i in admitted {
            let key = keys[i];
            if let Some(p) = &self.parts[Self::part_of(self.shift, key)] {
                maybe[i] = self.fuse_contains(p, key);
            }
        }
    }

    #[inline]
    fn fuse_contains(&self, p: &Part, key: u128) -> bool {
        BinaryFuse16Ref::from_dma(&p.desc, &self.mem[p.off..p.off + p.len]).contains(&probe(key))
    }

    /// Bytes of RAM held.
    pub fn bytes(&self) -> usize {
        self.parts
            .iter()
            .flatten()
            .map(|p| p.len + p.bloom_len)
            .sum::<usize>()
            + self.parts.len() * std::mem::size_of::<Option<Part>>()
    }

    /// Encodes the filter as a header blob (shift, partitions) followed by
    /// one checksummed blob per partition (descriptor, fingerprints), so
    /// that opening a run reads it a partition at a time.
    pub fn encode(&self) -> Vec<u8> {
        let mut head = Vec::new();
        head.extend_from_slice(&(self.shift as u64).to_le_bytes());
        head.extend_from_slice(&(self.parts.len() as u64).to_le_bytes());
        let mut out = seal_blob(MAGIC, VERSION, &head);
        for p in &self.parts {
            let mut b = Vec::new();
            if let Some(p) = p {
                b.extend_from_slice(&(p.bloom_len as u32).to_le_bytes());
                b.extend_from_slice(&self.bloom[p.bloom_off..p.bloom_off + p.bloom_len]);
                b.extend_from_slice(&p.desc);
                b.extend_from_slice(&self.mem[p.off..p.off + p.len]);
            }
            out.extend_from_slice(&seal_blob(MAGIC, VERSION, &b));
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
        let (version, head) = open_blob(MAGIC, &head)?;
        if version != 1 && version != VERSION {
            return None;
        }
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
        // Both mappings are sized by the blobs' total (an upper bound for
        // each); only what is written becomes resident.
        let mut mem = anon(total, total)?;
        let mut bloom = anon(if version == 1 { 0 } else { total }, total / 2)?;
        let mut parts = Vec::with_capacity(n);
        let (mut at, mut bat) = (0, 0);
        for (off, len) in offs {
            let blob = read(off, len)?;
            let (v, body) = open_blob(MAGIC, &blob)?;
            if v != version {
                return None;
            }
            if body.is_empty() {
                parts.push(None);
                continue;
            }
            // Version 2 body: [bloom_len u32][bloom][desc][fingerprints];
            // the Bloom filter a whole number of blocks (kept aligned).
            let (bl, rest) = if version == 1 {
                (&[][..], body)
            } else {
                let n = u32_at(body, 0)? as usize;
                if !n.is_multiple_of(bloom::BLOCK) {
                    return None;
                }
                let bl = body.get(4..4usize.checked_add(n)?)?;
                (bl, &body[4 + n..])
            };
            let desc = rest.get(..DESC)?;
            let fps = &rest[DESC..];
            let mut part = check_part(desc, fps.len(), at)?;
            mem.get_mut(at..at + part.len)?.copy_from_slice(fps);
            bloom.get_mut(bat..bat + bl.len())?.copy_from_slice(bl);
            part.bloom_off = bat;
            part.bloom_len = bl.len();
            at += part.len;
            bat += bl.len();
            parts.push(Some(part));
        }
        Some(RunFilter {
            shift,
            slots: slots_of(&parts),
            parts,
            mem,
            bloom,
        })
    }
}

/// Checks one partition's descriptor against its fingerprints' length so
/// that a lookup can not index out of bounds (a lookup indexes below
/// `segment_count_length + 2 * segment_length`, segments being aligned).
fn check_part(d: &[u8], len: usize, off: usize) -> Option<Part> {
    let desc: [u8; DESC] = d.get(..DESC)?.try_into().ok()?;
    let (sl, mask, count) = (u32_at(d, 8)?, u32_at(d, 12)?, u32_at(d, 16)?);
    let need = (count as u64) + 2 * sl as u64;
    if !len.is_multiple_of(2)
        || !sl.is_power_of_two()
        || mask != sl - 1
        || !count.is_multiple_of(sl)
        || need > (len / 2) as u64
    {
        return None;
    }
    Some(Part {
        desc,
        off,
        len,
        bloom_off: 0,
        bloom_len: 0,
    })
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
    bloom: MmapMut,
    bloom_at: usize,
    current: Vec<u64>,
    current_part: usize,
}

fn filter_err(what: &str) -> std::io::Error {
    std::io::Error::other(format!("building the run filter: {what}"))
}

impl FilterBuilder {
    /// For at most `max_keys` keys, in partitions of about `per_part`.
    pub fn new(max_keys: u64, per_part: u64) -> std::io::Result<Self> {
        let n = partitions_for(max_keys, per_part);
        let reserve = (max_keys as usize)
            .saturating_mul(4)
            .saturating_add((n + 1) << 21);
        let keys = max_keys.min(usize::MAX as u64 / 4) as usize;
        let mem = anon(reserve, keys * 2).ok_or_else(|| filter_err("cannot map memory"))?;
        let bloom_reserve = (max_keys as usize)
            .saturating_mul(bloom::BITS_PER_KEY as usize / 8 + 1)
            .saturating_add(n * bloom::BLOCK);
        let bloom = anon(bloom_reserve, keys * bloom::BITS_PER_KEY as usize / 8)
            .ok_or_else(|| filter_err("cannot map memory"))?;
        Ok(FilterBuilder {
            shift: shift_for(n),
            parts: (0..n).map(|_| None).collect(),
            mem,
            at: 0,
            bloom,
            bloom_at: 0,
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
        let bloom_len = bloom::blocks_for(self.current.len()) * bloom::BLOCK;
        let bl = self
            .bloom
            .get_mut(self.bloom_at..self.bloom_at + bloom_len)
            .ok_or_else(|| filter_err("reservation exceeded"))?;
        for &h in &self.current {
            bloom::insert(bl, h);
        }
        self.parts[self.current_part] = Some(Part {
            desc,
            off: self.at,
            len,
            bloom_off: self.bloom_at,
            bloom_len,
        });
        self.at += len;
        self.bloom_at += bloom_len;
        self.current.clear();
        Ok(())
    }

    pub fn finish(mut self) -> std::io::Result<RunFilter> {
        self.seal()?;
        Ok(RunFilter {
            shift: self.shift,
            slots: slots_of(&self.parts),
            parts: self.parts,
            mem: self.mem,
            bloom: self.bloom,
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
        let mut b = FilterBuilder::new(3 * PARTITION_KEYS, PARTITION_KEYS).unwrap();
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

    /// The same filter in format version 1 (no Bloom filters): what runs
    /// written before version 2 hold.
    fn as_version_1(v2: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < v2.len() {
            let len = u64_at(v2, at + 12).unwrap() as usize + 24;
            let (_, body) = open_blob(MAGIC, &v2[at..at + len]).unwrap();
            let body = if at == 0 || body.is_empty() {
                body
            } else {
                &body[4 + u32_at(body, 0).unwrap() as usize..]
            };
            out.extend_from_slice(&seal_blob(MAGIC, 1, body));
            at += len;
        }
        out
    }

    #[test]
    fn reads_version_1_and_bloom_cuts_fuse_probes() {
        let mut keys: Vec<u128> = (1..20_000u128)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
            .collect();
        keys.sort_unstable();
        let mut b = FilterBuilder::new(keys.len() as u64, PARTITION_KEYS).unwrap();
        for &k in &keys {
            b.push(k).unwrap();
        }
        let f = b.finish().unwrap();
        let enc = f.encode();
        let v1 = RunFilter::decode(&as_version_1(&enc)).unwrap();
        assert!(v1.parts.iter().flatten().all(|p| p.bloom_len == 0));
        assert!(keys.iter().all(|&k| v1.contains(k)));
        // Mixed versions between header and partitions are refused.
        let mut mixed = as_version_1(&enc)[..24 + 16].to_vec();
        mixed.extend_from_slice(&enc[24 + 16..]);
        assert!(RunFilter::decode(&mixed).is_none());
        // The Bloom filters admit a few percent of absent keys.
        let p = f.parts.iter().flatten().next().unwrap();
        let bl = &f.bloom[p.bloom_off..p.bloom_off + p.bloom_len];
        let admitted = (0..100_000u128)
            .map(|i| i.wrapping_mul(0xD6E8_FEB8_6659_FD93_A5A5_5A5A_1234_5678) | 1 << 127)
            .filter(|&k| bloom::contains(bl, probe(k)))
            .count();
        assert!(admitted < 5_000, "Bloom admitted {admitted} of 100000");
        assert!(f.bytes() as f64 / keys.len() as f64 > 2.25 + 0.9);
    }

    /// Keys only in the lowest of four partitions: the other three are
    /// empty slots, and every key that falls in them is absent, before and
    /// after a round trip.
    #[test]
    fn empty_partitions_answer_absent() {
        let keys: Vec<u128> = (1..3000u128).map(|i| i << 40).collect();
        let mut b = FilterBuilder::new(4 * PARTITION_KEYS, PARTITION_KEYS).unwrap();
        for &k in &keys {
            b.push(k).unwrap();
        }
        let f = b.finish().unwrap();
        let g = RunFilter::decode(&f.encode()).unwrap();
        for f in [&f, &g] {
            assert_eq!(f.slots.len(), 4);
            assert!(f.slots[1..].iter().all(|s| s.blocks == EMPTY));
            assert!(keys.iter().all(|&k| f.contains(k)));
            assert!((0..3000u128).all(|i| !f.contains(1 << 127 | i << 40)));
        }
    }

    proptest! {
        #[test]
        fn decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Some(f) = RunFilter::decode(&b) {
                let _ = f.contains(1);
                let _ = f.contains(u128::MAX);
            }
        }

        /// A sealed (checksum-valid) version-2 partition whose body is
        /// arbitrary, or a valid one with its Bloom length changed, is
        /// refused or probed without panicking.
        #[test]
        fn damaged_version_2_part_never_panics(
            body in proptest::collection::vec(any::<u8>(), 0..400),
            bloom_len in any::<u32>(),
            keys in proptest::collection::vec(any::<u128>(), 1..200),
        ) {
            let mut keys = keys;
            keys.sort_unstable();
            keys.dedup();
            let mut b = FilterBuilder::new(keys.len() as u64, PARTITION_KEYS).unwrap();
            for &k in &keys {
                b.push(k).unwrap();
            }
            let enc = b.finish().unwrap().encode();
            let head = u64_at(&enc, 12).unwrap() as usize + 24;
            let (_, part) = open_blob(MAGIC, &enc[head..]).unwrap();
            let mut edited = part.to_vec();
            edited[..4].copy_from_slice(&bloom_len.to_le_bytes());
            for body in [body, edited] {
                let mut e = enc[..head].to_vec();
                e.extend_from_slice(&seal_blob(MAGIC, VERSION, &body));
                if let Some(f) = RunFilter::decode(&e) {
                    for &k in &keys {
                        let _ = f.contains(k);
                    }
                    let _ = f.contains(u128::MAX);
                }
            }
        }
    }
}
