//! Deterministic content and file writers with controlled extent layouts.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::Path;

use crate::cmd::run;

/// A small, fast, deterministic PRNG (xoshiro256++ seeded by splitmix64).
///
/// Not cryptographic. The byte stream for a seed is fixed forever: tests and
/// the workload generator rely on it to recreate identical data.
#[derive(Debug, Clone)]
pub struct Prng {
    s: [u64; 4],
}

fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Prng {
    /// A generator whose whole output is determined by `seed`.
    pub fn new(seed: u64) -> Prng {
        let mut x = seed;
        let s = [
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
        ];
        Prng { s }
    }

    /// A generator for sub-stream `stream` of `seed` (e.g. one per file),
    /// independent of the order in which streams are used.
    pub fn derive(seed: u64, stream: u64) -> Prng {
        let mut x = seed ^ stream.wrapping_mul(0xD6E8_FEB8_6659_FD93);
        let mixed = splitmix64(&mut x) ^ stream;
        Prng::new(mixed)
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform value in `[0, n)` (`n > 0`; Lemire's multiply-shift, with
    /// negligible bias for the ranges used in tests).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Prng::below(0)");
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// A uniform value in `[lo, hi]`.
    #[inline]
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi, "Prng::range({lo}, {hi})");
        if hi - lo == u64::MAX {
            return self.next_u64();
        }
        lo + self.below(hi - lo + 1)
    }

    /// `true` with probability `p`.
    #[inline]
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64) < p
    }

    /// Fills `buf` with random bytes, consuming one `u64` per 8 bytes (the
    /// unused bytes of a final partial word are discarded). Filling in
    /// pieces whose lengths are multiples of 8 therefore gives the same
    /// stream as one big fill.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let w = self.next_u64().to_le_bytes();
            let n = rest.len();
            rest.copy_from_slice(&w[..n]);
        }
    }
}

/// `len` deterministic pseudo-random bytes for `seed` (the same bytes
/// [`write_random`] writes).
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    Prng::new(seed).fill(&mut v);
    v
}

const BUF: usize = 1 << 20;

/// Creates (or truncates) `path` and writes `len` deterministic
/// pseudo-random bytes for `seed` with buffered writes (≥ 1 GB/s of
/// generation). Content equals [`random_bytes`]`(len, seed)`.
pub fn write_random(path: &Path, len: u64, seed: u64) -> io::Result<()> {
    let mut f = File::create(path)?;
    let mut rng = Prng::new(seed);
    let mut buf = vec![0u8; BUF];
    let mut left = len;
    while left > 0 {
        let n = left.min(BUF as u64) as usize;
        rng.fill(&mut buf[..n]);
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    Ok(())
}

/// Creates (or truncates) `path` and writes `data` in `chunk`-byte writes,
/// calling `fsync` after each one if `fsync_each`. On btrfs, fsyncing each
/// chunk makes each its own extent item, which gives a file with the same
/// bytes as a one-shot write but a different extent layout (FIEMAP may still
/// report physically adjacent items as one extent; see
/// [`btrfs_extent_items`](crate::btrfs_extent_items)).
pub fn write_in_chunks(path: &Path, data: &[u8], chunk: usize, fsync_each: bool) -> io::Result<()> {
    assert!(chunk > 0, "write_in_chunks: chunk must be > 0");
    let mut f = File::create(path)?;
    for piece in data.chunks(chunk) {
        f.write_all(piece)?;
        if fsync_each {
            f.sync_data()?;
        }
    }
    Ok(())
}

/// Copies `src` to `dst` (created or truncated) with plain reads and writes,
/// so the copy has its own extents. (`std::fs::copy` uses
/// `copy_file_range`, which btrfs and XFS may turn into a reflink.)
/// Returns the number of bytes copied.
pub fn copy_no_reflink(src: &Path, dst: &Path) -> io::Result<u64> {
    let mut from = File::open(src)?;
    let mut to = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(dst)?;
    let mut buf = vec![0u8; BUF];
    let mut total = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n])?;
        total += n as u64;
    }
    Ok(total)
}

/// `cp --reflink=always src dst`: a copy that shares all of `src`'s extents.
pub fn reflink_copy(src: &Path, dst: &Path) -> io::Result<()> {
    run(
        "cp",
        [
            "--reflink=always".as_ref(),
            src.as_os_str(),
            dst.as_os_str(),
        ],
    )
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_chunk_independent() {
        let a = random_bytes(10_000, 42);
        assert_eq!(a, random_bytes(10_000, 42));
        assert_ne!(a, random_bytes(10_000, 43));
        let mut b = vec![0u8; 10_000];
        let mut rng = Prng::new(42);
        for piece in b.chunks_mut(8 * 100) {
            rng.fill(piece);
        }
        assert_eq!(a, b);
        // Prefix property.
        assert_eq!(&random_bytes(100, 42)[..], &a[..100]);
    }

    #[test]
    fn ranges() {
        let mut r = Prng::new(1);
        for _ in 0..10_000 {
            let v = r.range(3, 7);
            assert!((3..=7).contains(&v));
        }
        assert_ne!(Prng::derive(1, 1).next_u64(), Prng::derive(1, 2).next_u64());
    }

    #[test]
    fn write_random_matches_random_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r");
        let len = (3 << 20) + 5;
        write_random(&p, len as u64, 9).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), random_bytes(len, 9));
        let q = dir.path().join("q");
        assert_eq!(copy_no_reflink(&p, &q).unwrap(), len as u64);
        assert_eq!(std::fs::read(&q).unwrap(), std::fs::read(&p).unwrap());
        let c = dir.path().join("c");
        write_in_chunks(&c, &random_bytes(len, 9), 4096 * 3, false).unwrap();
        assert_eq!(std::fs::read(&c).unwrap(), std::fs::read(&p).unwrap());
    }
}
