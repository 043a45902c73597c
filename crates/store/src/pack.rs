//! Small chunks compressed together: a flush of released small files
//! puts its new chunks under [`PACK_BELOW`] bytes into packs of at most
//! [`PACK_MAX`] raw bytes, one record each (`container::PACK`), so that
//! zstd sees more than one small file at a time (measured:
//! bench/notes/store-compression.md, "Small chunks compressed together").
//!
//! Invariants: a pack holds at least two chunks, each at its row's
//! `inner` for its `raw_len`, one after another; a chunk of a pack is
//! read by decoding the whole pack (at most [`PACK_MAX`]), which the read
//! cache keeps for the pack's other chunks.

use std::collections::HashMap;

use crate::container::{Encoded, Hash};
use crate::meta::{ChunkLoc, PackAt};

/// Chunks shorter than this are packed.
pub(crate) const PACK_BELOW: usize = 32 << 10;
/// Raw bytes of a pack at most.
pub(crate) const PACK_MAX: usize = 128 << 10;

/// zstd's level for a pack in a store compressing at `level`: two lower,
/// at least 1. A pack of 128 KiB at level 1 keeps as few bytes as one of
/// 64 KiB at 3 and costs the releasing thread less (measured:
/// bench/notes/store-compression.md, "Packs of 128 KiB at level 1").
pub(crate) fn pack_level(level: i32) -> i32 {
    (level - 2).max(1)
}

/// A pack's record, and where it went once appended (by the first of its
/// chunks stored; the others share it).
pub(crate) struct Pack {
    pub enc: Encoded,
    pub at: Option<ChunkLoc>,
}

impl Pack {
    /// The location of the chunk of `len` bytes at `inner` in the pack
    /// appended at `at`.
    pub fn member(at: ChunkLoc, inner: u32, len: u32) -> ChunkLoc {
        ChunkLoc {
            raw_len: len,
            inner: Some(PackAt {
                at: inner,
                of: at.raw_len,
            }),
            ..at
        }
    }
}

/// A new chunk's record made outside the store's lock: alone, or its
/// place in a pack.
pub(crate) enum Prepared<'a> {
    Alone(Encoded),
    Packed(&'a mut Pack, u32),
}

/// The records a flush made outside the lock, by chunk fingerprint.
#[derive(Default)]
pub(crate) struct Encodings {
    alone: HashMap<Hash, Encoded>,
    packed: HashMap<Hash, (usize, u32)>,
    packs: Vec<Pack>,
}

impl Encodings {
    /// Takes chunk `h`'s record (a chunk is stored once per flush; a
    /// pack stays for its other chunks).
    pub fn take(&mut self, h: &Hash) -> Option<Prepared<'_>> {
        if let Some(e) = self.alone.remove(h) {
            return Some(Prepared::Alone(e));
        }
        let (i, inner) = self.packed.remove(h)?;
        Some(Prepared::Packed(&mut self.packs[i], inner))
    }

    /// Encodes `chunks` (fingerprint, bytes; each distinct): those under
    /// [`PACK_BELOW`] in packs of consecutive chunks of at most
    /// [`PACK_MAX`] bytes, `pack(raw)` making each pack's record;
    /// a chunk left alone in its group, and every larger one, by `alone`.
    pub fn build(
        chunks: &[(Hash, &[u8])],
        alone: impl Fn(&Hash, &[u8]) -> Encoded,
        pack: impl Fn(&[u8]) -> Encoded,
    ) -> Encodings {
        let mut out = Encodings::default();
        let mut group: Vec<(Hash, &[u8])> = Vec::new();
        let mut bytes = 0;
        for &(h, data) in chunks {
            if data.len() >= PACK_BELOW {
                out.alone.insert(h, alone(&h, data));
                continue;
            }
            if bytes + data.len() > PACK_MAX {
                out.close(&mut group, &alone, &pack);
                bytes = 0;
            }
            bytes += data.len();
            group.push((h, data));
        }
        out.close(&mut group, &alone, &pack);
        out
    }

    /// Encodes `group` as one pack (or its one chunk alone) and empties it.
    fn close(
        &mut self,
        group: &mut Vec<(Hash, &[u8])>,
        alone: &impl Fn(&Hash, &[u8]) -> Encoded,
        pack: &impl Fn(&[u8]) -> Encoded,
    ) {
        if let [(h, data)] = group[..] {
            self.alone.insert(h, alone(&h, data));
        } else if group.len() > 1 {
            let raw = group.iter().map(|&(_, d)| d).collect::<Vec<_>>().concat();
            let mut inner = 0u32;
            for (h, d) in group.iter() {
                self.packed.insert(*h, (self.packs.len(), inner));
                inner += d.len() as u32;
            }
            self.packs.push(Pack {
                enc: pack(&raw),
                at: None,
            });
        }
        group.clear();
    }

    /// Every record alone (a flush that makes no packs).
    pub fn alone(alone: HashMap<Hash, Encoded>) -> Encodings {
        Encodings {
            alone,
            ..Encodings::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(raw: &[u8]) -> Encoded {
        Encoded {
            bytes: raw.to_vec(),
            raw_len: raw.len() as u32,
        }
    }

    #[test]
    fn small_chunks_are_packed_in_order_up_to_the_limit() {
        let sizes = [
            1000usize, 31_000, 31_000, 31_000, 32_768, 31_000, 9_000, 5_000,
        ];
        let data: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| vec![i as u8; n])
            .collect();
        let chunks: Vec<(Hash, &[u8])> = data
            .iter()
            .enumerate()
            .map(|(i, d)| ([i as u8; 32], &d[..]))
            .collect();
        let mut e = Encodings::build(&chunks, |_, d| enc(d), enc);
        // 32,768 is not small; 9,000 would take the first pack past 128
        // KiB and opens the second.
        assert_eq!(e.packs.len(), 2);
        assert_eq!(e.packs[0].enc.raw_len, 125_000);
        assert_eq!(e.packs[1].enc.raw_len, 14_000);
        let want = [
            (0, 0, 0),
            (1, 0, 1000),
            (2, 0, 32_000),
            (3, 0, 63_000),
            (5, 0, 94_000),
        ];
        for (i, p, at) in want.into_iter().chain([(6, 1, 0), (7, 1, 9000)]) {
            assert_eq!(e.packed.get(&[i; 32]), Some(&(p, at)), "chunk {i}");
        }
        assert!(matches!(e.take(&[4; 32]), Some(Prepared::Alone(_))));
        assert!(matches!(
            e.take(&[2; 32]),
            Some(Prepared::Packed(_, 32_000))
        ));
        assert!(e.take(&[2; 32]).is_none(), "taken once");
    }

    #[test]
    fn packs_compress_two_levels_below_the_store_and_never_below_one() {
        let levels: Vec<i32> = [1, 2, 3, 4, 19].map(pack_level).into();
        assert_eq!(levels, [1, 1, 1, 2, 17]);
    }

    #[test]
    fn a_lone_small_chunk_is_not_a_pack() {
        let a = [1u8; 100];
        let big = vec![2u8; 60_000];
        let chunks = [([1; 32], &a[..]), ([2; 32], &big[..])];
        let mut e = Encodings::build(&chunks, |_, d| enc(d), enc);
        assert!(e.packs.is_empty());
        assert!(matches!(e.take(&[1; 32]), Some(Prepared::Alone(_))));
    }
}
