//! The flush of a file's buffer with content-defined chunks (FastCDC),
//! with the cutting, hashing and compression outside the store's lock.
//!
//! Chunk boundaries depend on the bytes around them, so a CDC flush cuts
//! a whole span: the buffered run widened to the stored extents it
//! touches ([`Span`]). Under the lock a [`Snap`] is taken: the run's
//! pages (shared `Arc`s), the file's size and the span with its stored
//! extents. Outside it the span is cut, hashed and its new chunks
//! compressed. Back under the lock the result is applied only if nothing
//! it was made from changed: no smaller size, every page still the same
//! `Arc` in the buffer (a write copies a shared page first), the same
//! span over the same stored extents. Otherwise the flush is redone
//! under the lock ([`Store::flush_file_locked`]), which is always
//! correct. A failure leaves the pages in the buffer, as in that path.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use rusqlite::params;

use crate::cache::par_map;
use crate::container::{Encoded, Hash};
use crate::data::{copy_overlap, is_zero, Planned, SMALL_FLUSH};
use crate::error::{Result, StoreError};
use crate::meta::ChunkId;
use crate::pack::Prepared;
use crate::store::{lock_free_here, Inner, Store};

/// The byte range a CDC flush re-cuts, `[a, b)`: a run of buffered
/// pages widened to the extents it cuts into, and those extents (from
/// one chunk's length before `a`).
#[derive(PartialEq, Debug)]
pub(crate) struct Span {
    pub a: u64,
    pub b: u64,
    pub plan: Vec<Planned>,
}

/// What a CDC flush outside the lock was made from (see the module).
struct Snap {
    size: u64,
    /// (page index, bytes), contiguous.
    pages: Vec<(u64, Arc<Vec<u8>>)>,
    span: Span,
    /// The span's bytes: stored, then the pages over them.
    buf: Vec<u8>,
}

/// A chunk of a span: offset in it, length, and hash (`None`: zeros).
pub(crate) type Cut = (usize, usize, Option<Hash>);

/// Stored extents and what a span's chunks are: (file offset, length,
/// chunk or hole).
pub(crate) type Made = Vec<(u64, u64, Option<ChunkId>)>;

impl Store {
    /// The span a flush of the buffered bytes `[start, end)` re-cuts.
    /// A file with no extents (`inodes.data` 0: a new file) asks nothing.
    pub(crate) fn cdc_span(&self, g: &Inner, ino: u64, start: u64, end: u64) -> Result<Span> {
        if g.attr(ino)?.data == 0 {
            let (a, b, plan) = (start, end, Vec::new());
            return Ok(Span { a, b, plan });
        }
        let mut a = start;
        if a > 0 {
            if let Some((o, _, _)) = self.extent_at(g, ino, a - 1)? {
                a = o;
            }
        }
        let mut b = end;
        if let Some((o, l, _)) = self.extent_at(g, ino, b)? {
            if o < b {
                b = o + l;
            }
        }
        let plan = self.plan(g, ino, a, b)?;
        Ok(Span { a, b, plan })
    }

    /// `flush_file` with CDC: a file's buffer of one run of pages, more
    /// than one small page, is cut, hashed and compressed outside the
    /// lock; any other buffer is stored under it.
    pub(crate) fn flush_cdc(&self, ino: u64, chunking: (u32, u32, u32)) -> Result<()> {
        let mut g = self.lock();
        let Some(mut snap) = self.cdc_snapshot(&mut g, ino)? else {
            return self.flush_file_locked(&mut g, ino);
        };
        drop(g);
        for (idx, page) in &snap.pages {
            copy_overlap(&mut snap.buf, snap.span.a, page, idx * self.page_size());
        }
        let cuts = self.cut_span(&snap.buf, chunking);
        let encoded = match self.encode_new(&snap.buf, &cuts) {
            Ok(e) => e,
            Err(e) => {
                Self::flush_failed(&mut self.lock(), ino);
                return Err(e);
            }
        };
        let mut g = self.lock();
        g.flushing = Some(ino);
        let r = self.apply_cdc(&mut g, ino, &snap, &cuts, encoded);
        g.flushing = None;
        r
    }

    /// Under the lock: the snapshot a flush outside it starts from, with
    /// the span's stored bytes read into a buffer for it (marks the file
    /// as being flushed). `None`: flush under the lock instead (no
    /// buffer, one small page, pages not in one run, another flush
    /// running).
    fn cdc_snapshot(&self, g: &mut Inner, ino: u64) -> Result<Option<Snap>> {
        let size = match g.attr(ino) {
            Ok(a) => a.size,
            Err(StoreError::NotFound) => return Ok(None),
            Err(e) => return Err(e),
        };
        let p = self.page_size();
        let Some(d) = g.dirty.get(&ino).filter(|d| !d.flushing) else {
            return Ok(None);
        };
        let pages: Vec<(u64, Arc<Vec<u8>>)> = d
            .pages
            .range(..size.div_ceil(p))
            .map(|(&i, pg)| (i, pg.clone()))
            .collect();
        let (Some(first), Some(last)) = (pages.first(), pages.last()) else {
            return Ok(None);
        };
        let one_run = last.0 - first.0 + 1 == pages.len() as u64;
        let small = pages.len() == 1 && first.1.len() <= SMALL_FLUSH;
        if !one_run || small || pages.len() != d.pages.len() {
            return Ok(None);
        }
        let (start, end) = (first.0 * p, ((last.0 + 1) * p).min(size));
        let span = self.cdc_span(g, ino, start, end)?;
        let buf = self.span_bytes(&span)?;
        if let Some(d) = g.dirty.get_mut(&ino) {
            d.flushing = true;
        }
        Ok(Some(Snap {
            size,
            pages,
            span,
            buf,
        }))
    }

    /// The records of the chunks the index does not know, each encoded
    /// once, in parallel (the index is asked under the lock, in one
    /// batch).
    fn encode_new(&self, buf: &[u8], cuts: &[Cut]) -> Result<HashMap<Hash, Encoded>> {
        let mut seen = HashSet::new();
        // (offset, length, hash) of each distinct data chunk
        let data: Vec<(usize, usize, Hash)> = cuts
            .iter()
            .filter_map(|&(o, l, h)| h.filter(|h| seen.insert(*h)).map(|h| (o, l, h)))
            .collect();
        let distinct: Vec<Hash> = data.iter().map(|d| d.2).collect();
        let found = {
            let mut g = self.lock();
            let Inner { db, index, .. } = &mut *g;
            index.lookup_many(db, &distinct)?
        };
        let unknown: Vec<(usize, usize, Hash)> = data
            .into_iter()
            .zip(found)
            .filter_map(|(d, f)| f.is_none().then_some(d))
            .collect();
        let packing = self.cfg.packing();
        debug_assert!(
            lock_free_here(),
            "CDC chunks compressed under the store's lock"
        );
        Ok(par_map(&unknown, |&(o, l, h)| {
            (h, self.encode_chunk(&h, &buf[o..o + l], packing))
        })
        .into_iter()
        .collect())
    }

    /// The locked end of [`Store::flush_cdc`]: the chunks replace the
    /// span's extents and the pages leave the buffer, if nothing they
    /// were made from changed; else the buffer is stored here.
    fn apply_cdc(
        &self,
        g: &mut Inner,
        ino: u64,
        snap: &Snap,
        cuts: &[Cut],
        encoded: HashMap<Hash, Encoded>,
    ) -> Result<()> {
        Self::flush_failed(g, ino); // the mark is off from here on
        let size = match g.attr(ino) {
            Ok(a) => a.size,
            Err(StoreError::NotFound) => {
                g.dirty.remove(&ino); // gone meanwhile: nothing to store
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let p = self.page_size();
        let same_pages = g.dirty.get(&ino).is_some_and(|d| {
            snap.pages
                .iter()
                .all(|(i, pg)| d.pages.get(i).is_some_and(|cur| Arc::ptr_eq(cur, pg)))
        });
        // A file that grew (a writer appending meanwhile: new pages past
        // these) still has these bytes at these offsets, zeros after them.
        let (first, last) = (snap.pages[0].0, snap.pages[snap.pages.len() - 1].0);
        let (start, end) = (first * p, ((last + 1) * p).min(snap.size));
        if size < snap.size || !same_pages || self.cdc_span(g, ino, start, end)? != snap.span {
            return self.flush_runs(g, ino);
        }
        let a = snap.span.a;
        let made = self.store_cuts(g, &snap.buf, a, cuts, encoded)?;
        self.replace_span(g, ino, a, snap.span.b, &made)?;
        if let Some(d) = g.dirty.get_mut(&ino) {
            for (i, _) in &snap.pages {
                d.pages.remove(i);
            }
            if d.pages.is_empty() {
                g.dirty.remove(&ino);
            }
        }
        Ok(())
    }

    /// A span's bytes cut into chunks (FastCDC), each hashed, in parallel.
    pub(crate) fn cut_span(&self, buf: &[u8], (min, avg, max): (u32, u32, u32)) -> Vec<Cut> {
        let offsets: Vec<(usize, usize)> = fastcdc::v2020::FastCDC::new(buf, min, avg, max)
            .map(|c| (c.offset, c.length))
            .collect();
        par_map(&offsets, |&(o, l)| {
            let data = &buf[o..o + l];
            (o, l, (!is_zero(data)).then(|| self.fingerprint(data)))
        })
    }

    /// The stored bytes of a span (zeros where it has none).
    pub(crate) fn span_bytes(&self, span: &Span) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; (span.b - span.a) as usize];
        self.fill(&mut buf, span.a, &span.plan, self.cache.generation())?;
        Ok(buf)
    }

    /// Under the lock: the chunks `cuts` of `buf` (the span from `a`)
    /// stored in order, each new one from its record in `encoded` if
    /// there. On a failure the references taken so far are dropped.
    pub(crate) fn store_cuts(
        &self,
        g: &mut Inner,
        buf: &[u8],
        a: u64,
        cuts: &[Cut],
        mut encoded: HashMap<Hash, Encoded>,
    ) -> Result<Made> {
        let mut made: Made = Vec::with_capacity(cuts.len());
        for &(o, l, h) in cuts {
            let chunk = match h {
                None => None,
                Some(h) => match self.put_hashed(
                    g,
                    &h,
                    &buf[o..o + l],
                    encoded.remove(&h).map(Prepared::Alone),
                ) {
                    Ok(id) => Some(id),
                    Err(e) => {
                        self.release_made(g, &made)?;
                        return Err(e);
                    }
                },
            };
            made.push((a + o as u64, l as u64, chunk));
        }
        Ok(made)
    }

    /// Drops the references chunks made for a span took, after a failure.
    pub(crate) fn release_made(&self, g: &Inner, made: &Made) -> Result<()> {
        let taken: Vec<(ChunkId, u64)> =
            made.iter().filter_map(|m| m.2.map(|id| (id, 1))).collect();
        self.release_chunks(g, &taken)
    }

    /// The extents starting in `[a, b)` are replaced by `made` (a file with
    /// none, a new one, has nothing to drop).
    pub(crate) fn replace_span(
        &self,
        g: &mut Inner,
        ino: u64,
        a: u64,
        b: u64,
        made: &Made,
    ) -> Result<()> {
        if g.attr(ino)?.data > 0 {
            self.drop_extents(g, ino, a, b)?;
        }
        let mut st = g.db.prepare_cached(
            "INSERT INTO extents (ino, off, len, chunk, born) VALUES (?1, ?2, ?3, ?4, ?5)",
        )?;
        for &(off, len, chunk) in made {
            match chunk {
                Some(id) => {
                    st.execute(params![ino, off, len, id, g.epoch])?;
                }
                None => g.counters.zero_bytes += len,
            }
        }
        Ok(())
    }
}
