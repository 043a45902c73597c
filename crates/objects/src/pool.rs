//! Large buffers kept for reuse. A new buffer of a whole container (32
//! MiB) comes from `mmap` (it is past glibc's threshold), and the kernel
//! zeroes and maps each of its pages on first touch: a twelfth of the
//! machine's samples in a cold read's fetch thread, and 5% of a writing
//! mount's in its upload thread (bench/notes/remote.md, stops 59 and 61).
//!
//! Invariant: a buffer is handed out to one holder at a time; it goes
//! back to its pool only when the last reference to the [`Bytes`] made
//! of it is gone, and a pool keeps at most the number it was made with,
//! so an idle store holds no more than that.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

/// Buffers let go and kept for the next [`Pool::take`].
pub struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
    keep: usize,
}

impl Pool {
    /// A pool that keeps at most `keep` buffers.
    pub fn keeping(keep: usize) -> Arc<Pool> {
        Arc::new(Pool {
            free: Mutex::new(Vec::new()),
            keep,
        })
    }

    /// An empty buffer that holds at least `cap` bytes: a kept one if one
    /// is large enough, else a new one (and one kept goes, so that the
    /// sizes kept follow what is asked). A new one holds the next power
    /// of two, so that it serves the next objects of about its size too
    /// (sealed containers differ by a record or two; a buffer sized
    /// exactly to one was too small for the next one). Only the pages
    /// written count: the room past them is address space.
    pub fn take(&self, cap: usize) -> Vec<u8> {
        let mut free = self.free.lock().unwrap();
        match free.iter().position(|b| b.capacity() >= cap) {
            Some(i) => free.swap_remove(i),
            None => {
                free.pop();
                Vec::with_capacity(cap.checked_next_power_of_two().unwrap_or(cap))
            }
        }
    }

    fn give(&self, mut buf: Vec<u8>) {
        buf.clear();
        let mut free = self.free.lock().unwrap();
        if free.len() < self.keep {
            free.push(buf);
        }
    }

    /// `buf[start..]` as [`Bytes`]; `buf` comes back to `pool` when the
    /// last reference goes.
    pub fn bytes(pool: &Arc<Pool>, buf: Vec<u8>, start: usize) -> Bytes {
        Bytes::from_owner(Pooled {
            buf,
            start,
            pool: pool.clone(),
        })
    }

    /// How many buffers are kept now.
    pub fn kept(&self) -> usize {
        self.free.lock().unwrap().len()
    }
}

/// A pooled buffer's bytes handed out as [`Bytes`].
struct Pooled {
    buf: Vec<u8>,
    start: usize,
    pool: Arc<Pool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf[self.start..]
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_comes_back_only_when_its_last_reference_goes() {
        let pool = Pool::keeping(2);
        let mut buf = pool.take(100);
        buf.extend_from_slice(&[1; 100]);
        let at = buf.as_ptr();
        let b = Pool::bytes(&pool, buf, 10);
        assert_eq!(&b[..], &[1; 90][..]);
        let kept = b.clone();
        drop(b);
        assert_eq!(pool.kept(), 0, "a clone still holds it");
        drop(kept);
        assert_eq!(pool.kept(), 1);
        let again = pool.take(50);
        assert_eq!((again.as_ptr(), again.len()), (at, 0), "reused, empty");
        assert_eq!(pool.take(100).capacity(), 128, "the next power of two");
        let big = pool.take(1000);
        assert_ne!(big.as_ptr(), at, "too small a buffer is not handed out");
        assert!(big.capacity() >= 1000);
        for _ in 0..3 {
            drop(Pool::bytes(&pool, vec![0; 10], 0));
        }
        assert_eq!(pool.kept(), 2, "no more than it keeps");
    }
}
