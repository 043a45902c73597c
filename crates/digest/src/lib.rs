//! The digest scheme, in one place: how bytes become sub-block, block,
//! window and whole-file digests. The reader (scan), the catalog and the
//! planner all go through these functions, so a block digested while
//! reading and a window re-derived while planning can never disagree.
//!
//! A collision can only make a dedupe request fail (the kernel compares the
//! bytes), never lose data.
//!
//! - Each filesystem block ("sub-block", 4 KiB on most filesystems) gets an
//!   XXH3-64 [`SubDigest`] ([`sub_digest`]).
//! - A block of `block_size` bytes is the [`window_digest`] of its
//!   sub-digests. Because it is a function of sub-digests only, the digest of
//!   the block-sized window at *any* sub-block offset of a file can be
//!   computed without reading it again ([`window_at`]): that is how data
//!   shifted by a multiple of the filesystem block is matched.
//! - A whole file is [`whole_digest`] of its block digests and its size.

use xxhash_rust::xxh3::{xxh3_128, xxh3_64, Xxh3};

/// A block's fingerprint (XXH3-128 of its sub-digests, see [`window_digest`]).
pub type BlockDigest = u128;

/// Fingerprint of one filesystem block: XXH3-64 of its bytes.
pub type SubDigest = u64;

/// The digest of one filesystem block's bytes.
pub fn sub_digest(bytes: &[u8]) -> SubDigest {
    xxh3_64(bytes)
}

/// The digest of a window of sub-block digests holding `len` bytes:
/// XXH3-128 of the sub-digests (little-endian), followed by `len` when the
/// window is not a full block (`full` false, a file's tail). Block digests
/// are windows at aligned offsets; windows at other sub-block offsets are
/// computed the same way to find shifted data.
pub fn window_digest(subs: &[SubDigest], len: u64, full: bool) -> BlockDigest {
    let mut buf = [0u8; 8 * 64 + 8];
    if subs.len() <= 64 {
        let mut n = 0;
        for s in subs {
            buf[n..n + 8].copy_from_slice(&s.to_le_bytes());
            n += 8;
        }
        if !full {
            buf[n..n + 8].copy_from_slice(&len.to_le_bytes());
            n += 8;
        }
        return xxh3_128(&buf[..n]);
    }
    let mut h = Xxh3::new();
    for s in subs {
        h.update(&s.to_le_bytes());
    }
    if !full {
        h.update(&len.to_le_bytes());
    }
    h.digest128()
}

/// The digest of a block that is a single sub-block (the matching block
/// is the filesystem block): the sub-digest in the low half and a
/// bijective mix of it in the high half, so that the 8-byte sub-digest
/// alone gives it back ([`sub_of_block`]) and both halves are uniform (the
/// fingerprint index partitions and sorts by the high half). The
/// sub-digest already covers the byte count, so a file's short tail needs
/// no length.
pub fn block_of_sub(sub: SubDigest) -> BlockDigest {
    ((mix64(sub) as u128) << 64) | sub as u128
}

/// The sub-digest `b` was made from by [`block_of_sub`], or `None` for a
/// digest of a larger block (or of an older scheme).
pub fn sub_of_block(b: BlockDigest) -> Option<SubDigest> {
    let lo = b as u64;
    (block_of_sub(lo) == b).then_some(lo)
}

/// A bijection of u64 (the SplitMix64 finalizer).
fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Digests kept out of RAM (a scratch file), read in batches of 8-byte
/// words through a small cache: [`Blocks::Paged`].
pub trait PagedDigests: Sync + std::fmt::Debug {
    /// Words `i..i + out.len()` (little-endian) of the scratch list into
    /// `out`; how many were read, fewer when one could not be, which ends
    /// the batch (the caller then sees fewer blocks: a match is missed,
    /// never a wrong digest given). One call for many words: an
    /// implementation takes its lock and finds its page once per batch.
    fn words(&self, i: u64, out: &mut [u64]) -> usize;
}

/// Fills `out[n]` with `word(n)` until the first `None`; how many were
/// filled: [`PagedDigests::words`] from a word-at-a-time source.
pub fn fill_words(out: &mut [u64], mut word: impl FnMut(u64) -> Option<u64>) -> usize {
    for (n, w) in out.iter_mut().enumerate() {
        match word(n as u64) {
            Some(x) => *w = x,
            None => return n,
        }
    }
    out.len()
}

/// A file's block digests as they are stored: in full (16 B each), or as
/// the sub-digests of single-sub-block blocks (8 B each, see
/// [`block_of_sub`]), in RAM or out of it ([`PagedDigests`]).
#[derive(Debug, Clone, Copy)]
pub enum Blocks<'a> {
    Full(&'a [BlockDigest]),
    OneSub(&'a [SubDigest]),
    /// `len` blocks from word `at` of `src`: one word per block when
    /// `one_sub` (a sub-digest, as [`Blocks::OneSub`]), else two (the
    /// low then the high half, as [`Blocks::Full`]).
    Paged {
        src: &'a dyn PagedDigests,
        at: u64,
        len: u32,
        one_sub: bool,
    },
}

impl<'a> Blocks<'a> {
    pub fn len(&self) -> usize {
        match self {
            Blocks::Full(b) => b.len(),
            Blocks::OneSub(s) => s.len(),
            Blocks::Paged { len, .. } => *len as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Block `i`'s digest, `None` past the end (or, paged, unreadable).
    #[inline]
    pub fn get(&self, i: usize) -> Option<BlockDigest> {
        match self {
            Blocks::Full(b) => b.get(i).copied(),
            Blocks::OneSub(s) => s.get(i).map(|&x| block_of_sub(x)),
            Blocks::Paged { .. } => {
                let mut one = Vec::with_capacity(1);
                (self.read(i, &mut one, 1) == 1).then(|| one[0])
            }
        }
    }

    /// Every block's digest in order; a paged list stops at the first
    /// unreadable one (compare with [`Blocks::len`], or use
    /// [`Blocks::to_vec_checked`]).
    pub fn iter(&self) -> impl Iterator<Item = BlockDigest> + 'a {
        let mut c = BlockCursor::new(*self);
        (0..self.len()).map_while(move |i| c.get(i))
    }

    pub fn to_vec(&self) -> Vec<BlockDigest> {
        let mut v = Vec::with_capacity(self.len());
        self.read(0, &mut v, usize::MAX);
        v
    }

    /// Appends the digests of blocks `from..` to `out`, at most `max` of
    /// them; returns how many (fewer than asked at the end of the list or
    /// at an unreadable paged word, 0 past either). A paged list is read
    /// in batches ([`PagedDigests::words`]).
    pub fn read(&self, from: usize, out: &mut Vec<BlockDigest>, max: usize) -> usize {
        let n = self.len().saturating_sub(from).min(max);
        match *self {
            Blocks::Full(b) => out.extend_from_slice(&b[from..from + n]),
            Blocks::OneSub(s) => out.extend(s[from..from + n].iter().map(|&x| block_of_sub(x))),
            Blocks::Paged {
                src, at, one_sub, ..
            } => return read_paged(src, at, one_sub, from, n, out),
        }
        n
    }

    /// Every digest, or `None` if a paged one could not be read.
    pub fn to_vec_checked(&self) -> Option<Vec<BlockDigest>> {
        let v = self.to_vec();
        (v.len() == self.len()).then_some(v)
    }
}

/// [`Blocks::read`] of `n` paged blocks from block `from`, in batches of
/// at most 512 words.
fn read_paged(
    src: &dyn PagedDigests,
    at: u64,
    one_sub: bool,
    from: usize,
    n: usize,
    out: &mut Vec<BlockDigest>,
) -> usize {
    let per = if one_sub { 1 } else { 2 };
    // Sized to the request: most lists are a file's one or two blocks.
    let mut buf = vec![0u64; (n * per).min(512)];
    let mut done = 0;
    while done < n {
        let want = ((n - done) * per).min(buf.len());
        let got = src.words(at + ((from + done) * per) as u64, &mut buf[..want]) / per;
        if one_sub {
            out.extend(buf[..got].iter().map(|&x| block_of_sub(x)));
        } else {
            out.extend(
                buf[..got * 2]
                    .chunks_exact(2)
                    .map(|w| w[0] as u128 | (w[1] as u128) << 64),
            );
        }
        done += got;
        if got * per < want {
            break;
        }
    }
    done
}

/// Reads a [`Blocks`] list mostly in order: a paged list is fetched a
/// batch at a time (growing from 16 to 1,024 blocks while reads keep
/// moving forward), so walking it costs a lock and a page lookup per
/// batch instead of per block. Answers exactly as [`Blocks::get`].
#[derive(Debug)]
pub struct BlockCursor<'a> {
    blocks: Blocks<'a>,
    /// Block number of `buf[0]`.
    start: usize,
    buf: Vec<BlockDigest>,
    batch: usize,
}

impl<'a> BlockCursor<'a> {
    pub fn new(blocks: Blocks<'a>) -> BlockCursor<'a> {
        BlockCursor {
            blocks,
            start: 0,
            buf: Vec::new(),
            batch: 16,
        }
    }

    /// The digest of block `i`, or `None` past the end (or where a paged
    /// word could not be read).
    pub fn get(&mut self, i: usize) -> Option<BlockDigest> {
        if !matches!(self.blocks, Blocks::Paged { .. }) {
            return self.blocks.get(i);
        }
        if let Some(d) = i.checked_sub(self.start).and_then(|j| self.buf.get(j)) {
            return Some(*d);
        }
        // Moving on just past the batch: the next batch is larger.
        if i == self.start + self.buf.len() && !self.buf.is_empty() {
            self.batch = (self.batch * 2).min(1024);
        }
        self.buf.clear();
        self.start = i;
        self.blocks.read(i, &mut self.buf, self.batch);
        self.buf.first().copied()
    }
}

/// Digests `chunk` (at most one block of `block_size` bytes, read at a
/// block boundary) in `sub`-byte sub-blocks: appends its sub-digests to
/// `subs` and returns its block digest.
pub fn digest_block(
    chunk: &[u8],
    block_size: usize,
    sub: usize,
    subs: &mut Vec<SubDigest>,
) -> BlockDigest {
    let first = subs.len();
    subs.extend(chunk.chunks(sub).map(sub_digest));
    if block_size == sub {
        return block_of_sub(subs[first]);
    }
    window_digest(
        &subs[first..],
        chunk.len() as u64,
        chunk.len() == block_size,
    )
}

/// The digest of the `block_size` window starting at sub-block `s` of a
/// file of `size` bytes whose sub-digests (of `sub` bytes each) are `subs`;
/// `None` past the end. Equal to the block digest when `s` is aligned.
pub fn window_at(
    subs: &[SubDigest],
    s: usize,
    block_size: u64,
    sub: u64,
    size: u64,
) -> Option<BlockDigest> {
    if s >= subs.len() {
        return None;
    }
    let k = (block_size / sub) as usize;
    if k == 1 {
        return Some(block_of_sub(subs[s]));
    }
    let len = block_size.min(size - s as u64 * sub);
    let end = (s + k).min(subs.len());
    Some(window_digest(&subs[s..end], len, len == block_size))
}

/// The digest of a full block of `block_size` zero bytes, on a filesystem
/// of `sub_size`-byte blocks.
pub fn zero_block_digest(block_size: u64, sub_size: u64) -> BlockDigest {
    let z = sub_digest(&vec![0u8; sub_size as usize]);
    if block_size == sub_size {
        return block_of_sub(z);
    }
    window_digest(&vec![z; (block_size / sub_size) as usize], block_size, true)
}

/// The digest of a whole file: of its block digests and its size.
pub fn whole_digest(blocks: &[BlockDigest], size: u64) -> u128 {
    let mut w = WholeDigest::default();
    blocks.iter().for_each(|&b| w.add(b));
    w.finish(size)
}

/// [`whole_digest`] taken a block at a time, for a list never held
/// whole: equal to it over the same blocks and size.
#[derive(Default)]
pub struct WholeDigest(Xxh3);

impl WholeDigest {
    pub fn add(&mut self, b: BlockDigest) {
        self.0.update(&b.to_le_bytes());
    }

    pub fn finish(mut self, size: u64) -> u128 {
        self.0.update(&size.to_le_bytes());
        self.0.digest128()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[seed as usize % 4] ^ seed)
            .collect()
    }

    fn digest_file(data: &[u8], bs: usize, sub: usize) -> (Vec<BlockDigest>, Vec<SubDigest>) {
        let mut subs = Vec::new();
        let blocks = data
            .chunks(bs)
            .map(|c| digest_block(c, bs, sub, &mut subs))
            .collect();
        (blocks, subs)
    }

    #[test]
    fn aligned_windows_are_the_block_digests() {
        let data = bytes(10 * 4096 + 100, 3);
        let (blocks, subs) = digest_file(&data, 16384, 4096);
        assert_eq!(blocks.len(), 3);
        for (i, b) in blocks.iter().enumerate() {
            let w = window_at(&subs, i * 4, 16384, 4096, data.len() as u64);
            assert_eq!(w, Some(*b), "block {i}");
        }
        assert_eq!(window_at(&subs, subs.len(), 16384, 4096, 1), None);
    }

    #[test]
    fn shifted_data_gives_the_same_window_digest() {
        let data = bytes(8 * 4096, 7);
        let mut shifted = vec![9u8; 4096];
        shifted.extend_from_slice(&data);
        let (blocks, _) = digest_file(&data, 16384, 4096);
        let (_, subs) = digest_file(&shifted, 16384, 4096);
        let w = window_at(&subs, 1, 16384, 4096, shifted.len() as u64);
        assert_eq!(w, Some(blocks[0]));
    }

    #[test]
    fn a_tail_differs_from_a_full_block_of_the_same_sub_digests() {
        let s = [1u64, 2];
        assert_ne!(
            window_digest(&s, 8192, true),
            window_digest(&s, 8000, false)
        );
        assert_ne!(
            window_digest(&s, 8000, false),
            window_digest(&s, 8001, false)
        );
    }

    #[test]
    fn long_windows_hash_the_same_bytes_as_short_ones() {
        // More than 64 sub-digests take the streaming path.
        let subs: Vec<u64> = (0..65).collect();
        let mut buf = Vec::new();
        for s in &subs {
            buf.extend_from_slice(&s.to_le_bytes());
        }
        assert_eq!(window_digest(&subs, 0, true), xxh3_128(&buf));
        buf.extend_from_slice(&7u64.to_le_bytes());
        assert_eq!(window_digest(&subs, 7, false), xxh3_128(&buf));
    }

    #[test]
    fn zero_block_digest_is_the_digest_of_zeros() {
        let (blocks, _) = digest_file(&vec![0u8; 65536], 65536, 4096);
        assert_eq!(zero_block_digest(65536, 4096), blocks[0]);
    }

    #[test]
    fn whole_digest_depends_on_blocks_and_size() {
        let b = [1u128, 2];
        assert_ne!(whole_digest(&b, 10), whole_digest(&b, 11));
        assert_ne!(whole_digest(&b, 10), whole_digest(&[2, 1], 10));
    }

    /// At a block of one sub-block, digests keep in 8 bytes: the block
    /// digest gives its sub-digest back, windows and the zero block agree,
    /// a tail differs from a full block with the same first bytes, and a
    /// digest of a larger block is not taken for one.
    #[test]
    fn one_sub_blocks_keep_in_their_sub_digest() {
        let mut data = bytes(5 * 4096 + 300, 5);
        data[4096..8192].fill(0);
        let (blocks, subs) = digest_file(&data, 4096, 4096);
        assert_eq!(blocks.len(), 6);
        for (i, b) in blocks.iter().enumerate() {
            assert_eq!(sub_of_block(*b), Some(subs[i]), "block {i}");
            let w = window_at(&subs, i, 4096, 4096, data.len() as u64);
            assert_eq!(w, Some(*b));
        }
        assert_eq!(blocks[1], zero_block_digest(4096, 4096));
        let tail = digest_file(&data[5 * 4096..], 4096, 4096).0[0];
        let mut full = data[5 * 4096..].to_vec();
        full.resize(4096, 0);
        assert_ne!(tail, digest_file(&full, 4096, 4096).0[0]);
        let (big, _) = digest_file(&data, 16384, 4096);
        assert!(big.iter().all(|b| sub_of_block(*b).is_none()));
        let v = Blocks::OneSub(&subs);
        assert_eq!(v.to_vec(), blocks);
        assert_eq!((v.len(), v.get(6)), (6, None));
        assert_eq!(Blocks::Full(&blocks).get(2), Some(blocks[2]));
        // Paged, one word per block or two, as stored in RAM.
        #[derive(Debug)]
        struct Words(Vec<u64>);
        impl PagedDigests for Words {
            fn words(&self, i: u64, out: &mut [u64]) -> usize {
                fill_words(out, |n| self.0.get((i + n) as usize).copied())
            }
        }
        let mut words = Words(vec![99]);
        words.0.extend(&subs);
        for b in &big {
            words.0.extend([*b as u64, (*b >> 64) as u64]);
        }
        let one = Blocks::Paged {
            src: &words,
            at: 1,
            len: 6,
            one_sub: true,
        };
        assert_eq!(one.to_vec_checked(), Some(blocks.clone()));
        let two = Blocks::Paged {
            src: &words,
            at: 7,
            len: big.len() as u32,
            one_sub: false,
        };
        assert_eq!(two.to_vec_checked(), Some(big.clone()));
        assert_eq!(two.get(big.len()), None);
        // Unreadable words end the list early, and are reported as such.
        let short = Blocks::Paged {
            src: &words,
            at: 7,
            len: big.len() as u32 + 1,
            one_sub: false,
        };
        assert_eq!(short.to_vec_checked(), None);
    }

    /// The cursor and bulk reads answer as `get` does, in any order of
    /// access, and stop at an unreadable word.
    #[test]
    fn cursor_and_read_agree_with_get() {
        #[derive(Debug)]
        struct Words(Vec<u64>, u64);
        impl PagedDigests for Words {
            fn words(&self, i: u64, out: &mut [u64]) -> usize {
                fill_words(out, |n| {
                    (i + n != self.1).then(|| self.0.get((i + n) as usize).copied())?
                })
            }
        }
        let words = Words((0..5000u64).map(|i| i * 0x9e37_79b9).collect(), u64::MAX);
        let lists = [
            Blocks::Paged {
                src: &words,
                at: 3,
                len: 2000,
                one_sub: true,
            },
            Blocks::Paged {
                src: &words,
                at: 1,
                len: 1500,
                one_sub: false,
            },
        ];
        let order: Vec<usize> = (0..1200)
            .chain((0..2100).rev().step_by(7))
            .chain([5, 1999, 0, 1500, 1499, 64, 63])
            .collect();
        for b in lists {
            let mut c = BlockCursor::new(b);
            for &i in &order {
                assert_eq!(c.get(i), b.get(i), "block {i}");
            }
            let mut v = Vec::new();
            assert_eq!(b.read(100, &mut v, 700), 700);
            assert_eq!(v, (100..800).map(|i| b.get(i).unwrap()).collect::<Vec<_>>());
            assert_eq!(b.to_vec().len(), b.len());
        }
        // Word 1000 unreadable: one-sub block 997 is the first missing.
        let broken = Words(words.0.clone(), 1000);
        let b = Blocks::Paged {
            src: &broken,
            at: 3,
            len: 2000,
            one_sub: true,
        };
        let mut c = BlockCursor::new(b);
        assert_eq!(
            (c.get(996).is_some(), c.get(997), c.get(998).is_some()),
            (true, None, true)
        );
        let mut v = Vec::new();
        assert_eq!(b.read(990, &mut v, 20), 7);
        assert_eq!((b.to_vec().len(), b.to_vec_checked()), (997, None));
    }
}
