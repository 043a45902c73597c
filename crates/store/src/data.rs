//! File data: the per-file write buffer, reads that overlay it on stored
//! chunks, and the flush that cuts buffered pages into chunks (fixed or
//! FastCDC), dedupes them and updates the file map.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rusqlite::{params, OptionalExtension};

use crate::cache::par_map;
use crate::config::Chunking;
use crate::container::{self, Hash};
use crate::error::{Result, StoreError};
use crate::meta::{ChunkId, ChunkLoc};
use crate::ns::Kind;
use crate::pack::Encodings;
use crate::store::{lock_free_here, time_now, Atime, Inner, Store};

/// Buffered writes of one file: whole pages, newer than the stored chunks.
///
/// A page begun past the file's end holds only the bytes written so far
/// (a 1 KiB file buffers 1 KiB, not a zeroed 64 KiB page): bytes past a
/// page's length are zeros ([`page_prefix`]), and nothing is stored there
/// while it is buffered (the range was past the end; a truncation or a
/// `copy_file_range` over it stores the buffer first).
///
/// Pages are shared (`Arc`) so that a flush can hash and compress a
/// snapshot of them outside the store's lock; a write to a page the flush
/// holds copies it first (`Arc::make_mut`), so the flush sees that the
/// page changed (`Arc::ptr_eq` fails) and leaves it dirty.
#[derive(Default)]
pub(crate) struct DirtyFile {
    pub pages: BTreeMap<u64, Arc<Vec<u8>>>,
    /// A flush of this file is running outside the lock.
    pub flushing: bool,
}

impl DirtyFile {
    /// Bytes buffered (the pages' own, no headers).
    pub fn bytes(&self) -> u64 {
        self.pages.values().map(|pg| pg.len() as u64).sum()
    }

    /// The pages, shared, for a flush outside the lock (marked `flushing`).
    fn snapshot(&mut self) -> Vec<Page> {
        self.flushing = true;
        self.pages.iter().map(|(&i, pg)| (i, pg.clone())).collect()
    }
}

/// The first `len` bytes of a buffered page, zeros past its length.
fn page_prefix(page: &[u8], len: usize) -> Cow<'_, [u8]> {
    if page.len() >= len {
        Cow::Borrowed(&page[..len])
    } else {
        let mut v = page.to_vec();
        v.resize(len, 0);
        Cow::Owned(v)
    }
}

/// What a flush outside the lock found in one snapshot page.
enum Cut {
    /// The page lies past the end of the file.
    Past,
    /// `len` bytes, all zero: a hole.
    Zero(usize),
    /// `len` bytes with this BLAKE3-256.
    Data(usize, Hash),
}

/// A file is flushed to chunks once this much of it is buffered.
const DIRTY_LIMIT: u64 = 16 << 20;
/// All files' buffers together: a write that finds this much buffered
/// flushes the file with the most (so many files open for writing do not
/// hold up to [`DIRTY_LIMIT`] each; see "Memory of the mount").
pub(crate) const DIRTY_TOTAL_LIMIT: u64 = 64 << 20;
/// Largest file size accepted: the kernel's for a FUSE file
/// (`MAX_LFS_FILESIZE`). It refuses writes past it itself; a smaller limit
/// here could not be told to it, and a write it had taken into its page
/// cache would be refused only at writeback, its bytes lost.
const MAX_SIZE: u64 = i64::MAX as u64;
/// Largest read of adjacent records in one `pread`.
const MAX_SPAN: u64 = 8 << 20;
/// Files released by [`Store::release_later`] that wake the thread
/// settling them (which otherwise looks every few milliseconds).
const RELEASE_BATCH: usize = 64;
/// Buffer page size with content-defined chunking.
const CDC_PAGE: u64 = 64 << 10;
/// A buffer of one page at most this long is stored with the lock held
/// throughout ([`Store::flush_file`]).
pub(crate) const SMALL_FLUSH: usize = 16 << 10;
/// Released files with at most this many buffered pages are flushed
/// together ([`Store::settle_releases`]).
const BATCH_PAGES: usize = 4;

/// The file with the most buffered pages (none being flushed), when all
/// buffers together reach [`DIRTY_TOTAL_LIMIT`]. One file alone is
/// bounded by [`DIRTY_LIMIT`]: only several are summed (a pass over the
/// files with buffers, which are the files being written).
fn most_buffered_over_total(dirty: &HashMap<u64, DirtyFile>, page: u64) -> Option<u64> {
    if dirty.len() < 2 {
        return None;
    }
    let pages: u64 = dirty.values().map(|d| d.pages.len() as u64).sum();
    if pages * page < DIRTY_TOTAL_LIMIT {
        return None;
    }
    dirty
        .iter()
        .filter(|(_, d)| !d.flushing)
        .max_by_key(|(_, d)| d.pages.len())
        .map(|(&ino, _)| ino)
}

/// A stored extent: file offset, length, and where its chunk is.
pub(crate) type Planned = (u64, u64, ChunkLoc);

/// A [`Planned`] from a row of `e.off, e.len, c.container, c.offset,
/// c.stored_len, c.raw_len`.
pub(crate) fn planned(r: &rusqlite::Row) -> rusqlite::Result<Planned> {
    Ok((r.get(0)?, r.get(1)?, crate::chunks::loc_of(r, 2)?))
}

/// [`planned`] for a row of `extents LEFT JOIN chunks`: `Err(offset)` of
/// an extent whose chunk row is missing (damaged metadata: its bytes are
/// unknown, never a hole).
pub(crate) fn planned_or_missing(
    r: &rusqlite::Row,
) -> rusqlite::Result<std::result::Result<Planned, u64>> {
    match r.get::<_, Option<u64>>(2)? {
        Some(_) => planned(r).map(Ok),
        None => Ok(Err(r.get(0)?)),
    }
}

/// The end of the run of records from `plan[i]` that lie one after
/// another in one container, within [`MAX_SPAN`], each after the first
/// also passing `more` (read with one call).
pub(crate) fn adjacent_run(plan: &[Planned], i: usize, more: impl Fn(&Planned) -> bool) -> usize {
    let first = plan[i].2;
    let mut end = first.offset + first.stored_len as u64;
    let mut j = i + 1;
    while j < plan.len()
        && plan[j].2.container == first.container
        && plan[j].2.offset == end
        && end - first.offset < MAX_SPAN
        && more(&plan[j])
    {
        end += plan[j].2.stored_len as u64;
        j += 1;
    }
    j
}
/// A buffered page: file offset and bytes.
type Page = (u64, Arc<Vec<u8>>);
/// A file's buffer taken for a flush: file, size when taken, pages.
type Snapshot = (u64, u64, Vec<Page>);

/// Whether `b` is all zero bytes (a hole). Word-wise: a byte loop is
/// several times slower in a debug build.
pub(crate) fn is_zero(b: &[u8]) -> bool {
    let words = b.chunks_exact(8);
    let tail = words.remainder();
    tail.iter().all(|&x| x == 0)
        && words
            .into_iter()
            .all(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) == 0)
}

/// Where each record of a span lands in a buffer covering
/// `[at, end_at)` when it can be read in place: stored raw, used whole,
/// wholly inside, and after the one before (the plan is in file order and
/// extents never overlap). `None`: read aside and decoded. In an
/// encrypted store (`sealed`) every record is sealed, never raw: a
/// compressed payload plus the seal's 40 bytes can have the raw length,
/// which once made a 139-byte file read as EIO.
fn direct_places(recs: &[Planned], at: u64, end_at: u64, sealed: bool) -> Vec<Option<usize>> {
    if sealed {
        return vec![None; recs.len()];
    }
    let mut next = 0usize;
    recs.iter()
        .map(|&(o, l, lk)| {
            let raw = lk.raw_len as u64;
            let place = (l == raw
                && lk.inner.is_none()
                && o >= at
                && o + raw <= end_at
                && lk.stored_len as u64 == container::RECORD_HEADER as u64 + raw
                && (o - at) as usize >= next)
                .then(|| (o - at) as usize);
            if let Some(d) = place {
                next = d + raw as usize;
            }
            place
        })
        .collect()
}

/// The vectored read's buffers for a span, in container order: for a
/// record read in place its header (one of `headers`) then its place in
/// `buf`; for the others their stretch of `aside`.
fn span_buffers<'a>(
    buf: &'a mut [u8],
    recs: &[Planned],
    direct: &[Option<usize>],
    headers: &'a mut [[u8; container::RECORD_HEADER]],
    aside: &'a mut [u8],
) -> Vec<&'a mut [u8]> {
    let mut bufs: Vec<&mut [u8]> = Vec::with_capacity(2 * recs.len());
    let mut hdrs = headers.iter_mut();
    let (mut rest, mut rest_at) = (buf, 0usize);
    let mut rest_aside = aside;
    for (r, d) in recs.iter().zip(direct) {
        if let Some(d) = *d {
            bufs.push(&mut hdrs.next().expect("one header per direct record")[..]);
            let tail = std::mem::take(&mut rest);
            let (_, tail) = tail.split_at_mut(d - rest_at);
            let (dst, tail) = tail.split_at_mut(r.2.raw_len as usize);
            bufs.push(dst);
            (rest, rest_at) = (tail, d + r.2.raw_len as usize);
        } else {
            let tail = std::mem::take(&mut rest_aside);
            let (rec, tail) = tail.split_at_mut(r.2.stored_len as usize);
            bufs.push(rec);
            rest_aside = tail;
        }
    }
    bufs
}

/// Copies the part of `src` (at file offset `src_off`) that falls in
/// `dst` (at file offset `dst_off`).
pub(crate) fn copy_overlap(dst: &mut [u8], dst_off: u64, src: &[u8], src_off: u64) {
    let lo = dst_off.max(src_off);
    let hi = (dst_off + dst.len() as u64).min(src_off + src.len() as u64);
    if lo < hi {
        let (d, s) = ((lo - dst_off) as usize, (lo - src_off) as usize);
        let n = (hi - lo) as usize;
        dst[d..d + n].copy_from_slice(&src[s..s + n]);
    }
}

impl Store {
    pub(crate) fn page_size(&self) -> u64 {
        match self.cfg.chunking {
            Chunking::Fixed { size } => size as u64,
            Chunking::Cdc { .. } => CDC_PAGE,
        }
    }

    /// A file (or directory) is opened: it stays alive while open even if
    /// unlinked (a directory removed while open reads as empty, `nlink` 0).
    pub fn open_file(&self, ino: u64) -> Result<Attr> {
        if crate::view::is_read_only(ino) {
            return self.view_getattr(ino);
        }
        let mut g = self.lock();
        let a = g.attr(ino)?;
        *g.open_count.entry(ino).or_default() += 1;
        Ok(a)
    }

    /// A file (or directory) handle is closed: a file's buffer is written
    /// to chunks; a node with no name and no open handle left is deleted.
    pub fn release_file(&self, ino: u64) -> Result<()> {
        if crate::view::is_read_only(ino) {
            return Ok(());
        }
        let r = self.flush_file(ino);
        self.closed(&mut self.lock(), ino)?;
        r
    }

    /// A handle of `ino` is gone, its buffer flushed: a node with no name
    /// and no open handle left is deleted.
    fn closed(&self, g: &mut Inner, ino: u64) -> Result<()> {
        let n = g.open_count.entry(ino).or_default();
        *n = n.saturating_sub(1);
        if *n == 0 {
            g.open_count.remove(&ino);
            if g.attr(ino).is_ok() {
                self.unlinked(g, ino)?;
            }
        }
        Ok(())
    }

    /// A file handle is closed, and its release ([`Store::release_file`])
    /// left to [`Store::settle_releases`] on another thread: the closing
    /// program's CPU is not spent storing its bytes (a FUSE `RELEASE` is
    /// answered asynchronously; nothing waits for it). Every path that
    /// must see released files (`flush_all`: commits, unmount, gc,
    /// snapshots) settles them first; an error there leaves the buffer in
    /// place for the next flush, as one in `release_file` would.
    pub fn release_later(&self, ino: u64) {
        if crate::view::is_read_only(ino) {
            return; // nothing to store, no handle counted (`open_file`)
        }
        let mut q = self.released.lock().unwrap_or_else(|e| e.into_inner());
        q.push(ino);
        // One wake-up per batch: a futex wake per file cost the closing
        // program's CPU more than the release saved it.
        if q.len() == RELEASE_BATCH {
            self.released_cv.notify_one();
        }
    }

    /// Waits until [`RELEASE_BATCH`] files were released by
    /// [`Store::release_later`], or `timeout` passed; whether any is
    /// waiting.
    pub fn wait_for_releases(&self, timeout: std::time::Duration) -> bool {
        let q = self.released.lock().unwrap_or_else(|e| e.into_inner());
        let (q, _) = self
            .released_cv
            .wait_timeout_while(q, timeout, |q| q.len() < RELEASE_BATCH)
            .unwrap_or_else(|e| e.into_inner());
        !q.is_empty()
    }

    /// Releases the files [`Store::release_later`] queued.
    /// Failures keep the file's buffer (stored by a later flush, reported
    /// by its `fsync`), as in [`Store::release_file`].
    ///
    /// The small files among them are flushed together
    /// ([`Store::flush_small_files`]): the lock is taken four times for
    /// the lot (buffers, lookup, store, handles), and their hashing and
    /// compression run outside it, where a file at a time held it while
    /// its page was compressed, or took it four times, against the
    /// requests of the program writing the next files. A queue that grew
    /// while the thread was busy is settled [`RELEASE_BATCH`] files at a
    /// time, so that no hold of the lock covers all of it.
    ///
    /// A file released twice in one batch (`rsync` closes each file, then
    /// opens it again to set its mode) is flushed once: its buffer then
    /// holds what both handles wrote.
    pub fn settle_releases(&self) {
        let q = std::mem::take(&mut *self.released.lock().unwrap_or_else(|e| e.into_inner()));
        for part in q.chunks(RELEASE_BATCH) {
            let mut seen = HashSet::with_capacity(part.len());
            let once: Vec<u64> = part.iter().copied().filter(|&i| seen.insert(i)).collect();
            for ino in self.flush_small_files(&once) {
                let _ = self.flush_file(ino);
            }
            let mut g = self.lock();
            for &ino in part {
                let _ = self.closed(&mut g, ino);
            }
        }
    }

    /// Flushes the buffers of at most [`BATCH_PAGES`] pages of `inos`
    /// together; returns the files left to [`Store::flush_file`] (larger
    /// buffers, hashed and compressed on every core, or any error reading
    /// a file's row). A failure keeps the file's buffer, as in
    /// [`Store::flush_file`].
    ///
    /// With content-defined chunking only new files of at most the
    /// smallest chunk are taken: FastCDC cuts none of them, so each is one
    /// chunk of the whole file, as a page is here.
    fn flush_small_files(&self, inos: &[u64]) -> Vec<u64> {
        let (files, rest) = self.take_small_buffers(inos);
        let cuts: Vec<Vec<Cut>> = files
            .iter()
            .map(|(_, size, pages)| self.cut_pages(*size, pages, false))
            .collect();
        let snaps: Vec<(&[Page], &[Cut])> = files
            .iter()
            .zip(&cuts)
            .map(|((_, _, pages), cuts)| (&pages[..], &cuts[..]))
            .collect();
        // Its own statement: a guard made inside the next one would live
        // to that statement's end, through the compression.
        let unknown = Self::unknown(&mut self.lock(), &snaps);
        debug_assert!(
            lock_free_here(),
            "a batch compressed under the store's lock"
        );
        let mut encoded = unknown.map(|unknown| self.encode_unknown(&snaps, &unknown, false));
        let mut g = self.lock();
        for ((ino, _, pages), cuts) in files.iter().zip(&cuts) {
            let stored = encoded.as_mut().is_ok_and(|encoded| {
                g.flushing = Some(*ino);
                let r = self.apply_snapshot(&mut g, *ino, pages, cuts, encoded);
                g.flushing = None;
                r.is_ok()
            });
            if !stored {
                Self::flush_failed(&mut g, *ino);
            }
        }
        rest
    }

    /// The buffers of `inos` [`Store::flush_small_files`] takes (each
    /// marked `flushing`), and the files it leaves.
    fn take_small_buffers(&self, inos: &[u64]) -> (Vec<Snapshot>, Vec<u64>) {
        let (mut files, mut rest) = (Vec::new(), Vec::new());
        let mut g = self.lock();
        for &ino in inos {
            let a = match g.attr(ino) {
                Ok(a) => a,
                Err(StoreError::NotFound) => continue,
                Err(_) => {
                    rest.push(ino);
                    continue;
                }
            };
            let size = a.size;
            let fits = |d: &DirtyFile| match self.cfg.chunking {
                Chunking::Fixed { .. } => d.pages.len() <= BATCH_PAGES,
                Chunking::Cdc { min, .. } => {
                    a.data == 0 && size <= u64::from(min) && d.pages.keys().eq([&0])
                }
            };
            match g.dirty.get_mut(&ino) {
                Some(d) if fits(d) && !d.flushing => {
                    files.push((ino, size, d.snapshot()));
                }
                Some(_) => rest.push(ino),
                None => {}
            }
        }
        (files, rest)
    }

    /// Writes the file's buffer to chunks (no commit). With fixed
    /// chunking, hashing and compression run outside the lock on all
    /// cores (see [`Store::flush_snapshot`]), except for a buffer of one
    /// page of at most 16 KiB (`SMALL_FLUSH`), stored under the lock.
    pub fn flush_file(&self, ino: u64) -> Result<()> {
        if let Chunking::Cdc { min, avg, max } = self.cfg.chunking {
            return self.flush_cdc(ino, (min, avg, max));
        }
        let mut g = self.lock();
        let size = match g.attr(ino) {
            Ok(a) => a.size,
            Err(StoreError::NotFound) => return Ok(()),
            Err(e) => return Err(e),
        };
        let Some(d) = g.dirty.get_mut(&ino) else {
            return Ok(());
        };
        let pages = d.snapshot();
        // A small file's one page: hashing and compressing a few KiB
        // under the lock costs less than taking it twice more (against
        // the requests of the program writing the next file).
        let small = matches!(&pages[..], [(_, pg)] if pg.len() <= SMALL_FLUSH);
        if small {
            // The lock is still held here: the failure is marked under it.
            let r = self.flush_snapshot(Some(&mut g), ino, size, &pages);
            if r.is_err() {
                Self::flush_failed(&mut g, ino);
            }
            return r;
        }
        drop(g);
        let r = self.flush_snapshot(None, ino, size, &pages);
        if r.is_err() {
            Self::flush_failed(&mut self.lock(), ino);
        }
        r
    }

    /// After a failed flush: the file's remaining buffer is left to the
    /// next one (`flushing` off).
    pub(crate) fn flush_failed(g: &mut Inner, ino: u64) {
        if let Some(d) = g.dirty.get_mut(&ino) {
            d.flushing = false;
        }
    }

    /// Stores a snapshot of a file's dirty pages (page index, bytes; file
    /// size `size` when taken): BLAKE3 of every page and compression of
    /// the pages the index does not know happen outside the lock, in
    /// parallel; then, under the lock, records are appended (so they are
    /// in a container synced before any commit that references them) and
    /// the file map is updated once per run of pages. A page written,
    /// truncated or flushed by someone else meanwhile is no longer the
    /// same `Arc` in the dirty map and is skipped. With `held`, the lock
    /// is held throughout instead.
    fn flush_snapshot(
        &self,
        mut held: Option<&mut Inner>,
        ino: u64,
        size: u64,
        pages: &[(u64, Arc<Vec<u8>>)],
    ) -> Result<()> {
        let cuts = self.cut_pages(size, pages, true);
        let snap = [(pages, &cuts[..])];
        let unknown = match held.as_deref_mut() {
            Some(g) => Self::unknown(g, &snap)?,
            None => Self::unknown(&mut self.lock(), &snap)?,
        };
        debug_assert!(
            held.is_some() || lock_free_here(),
            "compressed under the lock"
        );
        let mut encoded = self.encode_unknown(&snap, &unknown, true);
        let mut own;
        let g = match held {
            Some(g) => g,
            None => {
                own = self.lock();
                &mut *own
            }
        };
        g.flushing = Some(ino);
        let r = self.apply_snapshot(g, ino, pages, &cuts, &mut encoded);
        g.flushing = None;
        r
    }

    /// What each snapshot page holds (file size `size` when taken): BLAKE3
    /// of every data page, outside the lock (on every core when
    /// `parallel`).
    fn cut_pages(&self, size: u64, pages: &[Page], parallel: bool) -> Vec<Cut> {
        let p = self.page_size();
        let cut = |(idx, page): &Page| {
            let ps = idx * p;
            if ps >= size {
                return Cut::Past;
            }
            let len = p.min(size - ps) as usize;
            let data = page_prefix(page, len);
            if is_zero(&data) {
                Cut::Zero(len)
            } else {
                Cut::Data(len, self.fingerprint(&data))
            }
        };
        match parallel {
            true => par_map(pages, cut),
            false => pages.iter().map(cut).collect(),
        }
    }

    /// The distinct fingerprints of snapshots (pages and their cuts) that
    /// the index does not know, looked up in one batch.
    fn unknown(g: &mut Inner, snaps: &[(&[Page], &[Cut])]) -> Result<HashSet<Hash>> {
        let mut seen = HashSet::new();
        let hashes: Vec<Hash> = snaps
            .iter()
            .flat_map(|(_, cuts)| cuts.iter())
            .filter_map(|c| match c {
                Cut::Data(_, h) if seen.insert(*h) => Some(*h),
                _ => None,
            })
            .collect();
        let Inner { db, index, .. } = g;
        let found = index.lookup_many(db, &hashes)?;
        Ok(hashes
            .into_iter()
            .zip(found)
            .filter(|(_, f)| f.is_none())
            .map(|(h, _)| h)
            .collect())
    }

    /// Each `unknown` chunk of the snapshots encoded once, outside the
    /// lock: on every core when `parallel`, else in this thread with the
    /// small chunks packed ([`crate::pack`]).
    fn encode_unknown(
        &self,
        snaps: &[(&[Page], &[Cut])],
        unknown: &HashSet<Hash>,
        parallel: bool,
    ) -> Encodings {
        let mut todo = HashSet::new();
        let new: Vec<(Hash, &[u8], usize)> = snaps
            .iter()
            .flat_map(|(pages, cuts)| pages.iter().zip(cuts.iter()))
            .filter_map(|((_, page), cut)| match *cut {
                Cut::Data(len, h) if unknown.contains(&h) && todo.insert(h) => {
                    Some((h, &page[..], len))
                }
                _ => None,
            })
            .collect();
        let compress = self.cfg.packing();
        if parallel {
            let encode = |&(h, page, len): &(Hash, &[u8], usize)| {
                (h, self.encode_chunk(&h, &page_prefix(page, len), compress))
            };
            return Encodings::alone(par_map(&new, encode).into_iter().collect());
        }
        let bytes: Vec<Cow<'_, [u8]>> =
            new.iter().map(|&(_, p, len)| page_prefix(p, len)).collect();
        let chunks: Vec<(Hash, &[u8])> =
            new.iter().zip(&bytes).map(|(n, b)| (n.0, &b[..])).collect();
        Encodings::build(
            &chunks,
            |h, data| self.encode_chunk(h, data, compress),
            |raw| self.encode_pack(raw, compress),
        )
    }

    /// The locked end of [`Store::flush_snapshot`].
    fn apply_snapshot(
        &self,
        g: &mut Inner,
        ino: u64,
        pages: &[(u64, Arc<Vec<u8>>)],
        cuts: &[Cut],
        encoded: &mut Encodings,
    ) -> Result<()> {
        let (size, mapped) = match g.attr(ino) {
            Ok(a) => (a.size, a.data > 0),
            Err(StoreError::NotFound) => return Ok(()),
            Err(e) => return Err(e),
        };
        let p = self.page_size();
        // (page start, stored length, chunk or hole)
        let mut done: Vec<(u64, u64, Option<ChunkId>)> = Vec::new();
        for ((idx, page), cut) in pages.iter().zip(cuts) {
            let Some(d) = g.dirty.get_mut(&ino) else {
                break;
            };
            if !d.pages.get(idx).is_some_and(|cur| Arc::ptr_eq(cur, page)) {
                continue;
            }
            d.pages.remove(idx);
            let ps = idx * p;
            if ps >= size {
                continue;
            }
            let len = p.min(size - ps) as usize;
            let data = page_prefix(page, len);
            let data = &*data;
            let put = match *cut {
                Cut::Zero(l) if l == len => Ok(None),
                Cut::Data(l, h) if l == len => {
                    self.put_hashed(g, &h, data, encoded.take(&h)).map(Some)
                }
                // The size moved under an unchanged page: cut it again here.
                _ if is_zero(data) => Ok(None),
                _ => self.put_chunk(g, data).map(Some),
            };
            let chunk = match put {
                Ok(c) => c,
                Err(e) => {
                    // The page goes back into the buffer, unchanged (the
                    // lock was held since it was taken out): it is stored
                    // by the next flush, or the next `fsync` reports why
                    // it cannot be. Chunks stored so far hold a reference
                    // each: map them, or their counts would exceed the
                    // file maps.
                    if let Some(d) = g.dirty.get_mut(&ino) {
                        d.pages.insert(*idx, page.clone());
                        d.flushing = false;
                    }
                    self.record_extents(g, ino, &done, mapped)?;
                    return Err(e);
                }
            };
            if chunk.is_none() {
                g.counters.zero_bytes += len as u64;
            }
            done.push((ps, len as u64, chunk));
        }
        match g.dirty.get_mut(&ino) {
            Some(d) if d.pages.is_empty() => {
                g.dirty.remove(&ino);
            }
            Some(d) => d.flushing = false,
            None => {}
        }
        self.record_extents(g, ino, &done, mapped)
    }

    /// Replaces the file map at the given page starts: the old extents of
    /// each contiguous run are dropped with one statement, then the new
    /// ones inserted. `mapped` is false for a file with no extents at all
    /// (`inodes.data` 0, read under the same lock): nothing to drop, two
    /// statements less for every new file.
    fn record_extents(
        &self,
        g: &Inner,
        ino: u64,
        done: &[(u64, u64, Option<ChunkId>)],
        mapped: bool,
    ) -> Result<()> {
        let p = self.page_size();
        let mut i = 0;
        while mapped && i < done.len() {
            let mut j = i + 1;
            while j < done.len() && done[j].0 == done[j - 1].0 + p {
                j += 1;
            }
            self.drop_extents(g, ino, done[i].0, done[j - 1].0 + 1)?;
            i = j;
        }
        let mut st = g.db.prepare_cached(
            "INSERT INTO extents (ino, off, len, chunk, born) VALUES (?1, ?2, ?3, ?4, ?5)",
        )?;
        for &(off, len, chunk) in done {
            if let Some(id) = chunk {
                st.execute(params![ino, off, len, id, g.epoch])?;
            }
        }
        Ok(())
    }

    /// `fsync`: the file's data and metadata (and everything committed
    /// before) become durable.
    pub fn fsync(&self, ino: u64) -> Result<()> {
        self.flush_file(ino)?;
        self.commit(true)
    }

    /// The pages `data` written at `off` replaces whole, copied (before
    /// the store's lock is taken: copying a 1 MiB write under it held up
    /// every other request).
    fn whole_pages(&self, off: u64, data: &[u8]) -> Vec<Page> {
        let p = self.page_size();
        let end = off.saturating_add(data.len() as u64);
        let first = off.div_ceil(p);
        (first..end / p)
            .map(|idx| {
                let at = (idx * p - off) as usize;
                (idx, Arc::new(data[at..at + p as usize].to_vec()))
            })
            .collect()
    }

    /// What storing `ino`'s buffer `d` may cost the disk at most: each
    /// page and its records' headers, and under CDC, for a file with
    /// stored data, the stored chunks either side of each run of pages,
    /// which its flush cuts again ([`crate::cdc`]).
    pub(crate) fn buffer_cost(&self, g: &Inner, ino: u64, d: &DirtyFile) -> u64 {
        let pages: u64 = d
            .pages
            .values()
            .map(|pg| pg.len() as u64 + self.page_records())
            .sum();
        let widen = self.run_widening(g, ino);
        if widen == 0 {
            return pages;
        }
        let mut runs = 0;
        let mut next = None;
        for &idx in d.pages.keys() {
            runs += u64::from(next != Some(idx));
            next = Some(idx + 1);
        }
        pages + runs * widen
    }

    /// What a write of `[off, end)` adds to [`Store::buffer_cost`], as
    /// (page bytes, the rest): a page it makes dirty at the length it will
    /// have (whole inside the file) and the growth of pages already dirty;
    /// their headers and the widening of a run it starts. Pages that hold
    /// only the zeros written (stored as holes) cost nothing.
    pub(crate) fn buffer_growth(
        &self,
        g: &Inner,
        ino: u64,
        (off, end): (u64, u64),
        a: &Attr,
        zeros: bool,
    ) -> (u64, u64) {
        let p = self.page_size();
        let d = g.dirty.get(&ino);
        let (first, last) = (off / p, (end - 1) / p);
        let (mut grows, mut extra) = (0, 0);
        for idx in first..=last {
            let ps = idx * p;
            let had = d.and_then(|d| d.pages.get(&idx)).map(|pg| pg.len() as u64);
            let whole = off <= ps && ps + p <= end;
            if zeros && had.is_none() && (whole || ps >= a.size) {
                continue;
            }
            // A new page inside the file is read whole and stored whole.
            let len = match had.is_none() && ps < a.size && !whole {
                true => p,
                false => end.min(ps + p) - ps,
            };
            match had {
                Some(had) => grows += len.saturating_sub(had),
                None => (grows, extra) = (grows + len, extra + self.page_records()),
            }
        }
        let adjoins = d.is_some_and(|d| {
            let next = d.pages.range(first.saturating_sub(1)..=last + 1).next();
            next.is_some()
        });
        // A run of holes only (zeros, a punched range) costs nothing: it
        // is never refused, whatever its flush cuts again.
        if !adjoins && grows > 0 {
            extra += self.run_widening(g, ino);
        }
        (grows, extra)
    }

    /// Headers a page's records may need: one per smallest chunk, at most
    /// 16 (chunks that small are packed, several to a record).
    fn page_records(&self) -> u64 {
        let records = (self.page_size() / self.cfg.chunking.min_chunk() as u64).clamp(1, 16);
        records * (container::RECORD_HEADER + crate::seal::OVERHEAD) as u64
    }

    /// Bytes a CDC flush of a run of pages may store beyond them in a file
    /// with stored data (an extent cut again either side); 0 otherwise.
    fn run_widening(&self, g: &Inner, ino: u64) -> u64 {
        match self.cfg.chunking {
            Chunking::Cdc { max, .. } if g.attr(ino).is_ok_and(|a| a.data > 0) => 2 * max as u64,
            _ => 0,
        }
    }

    /// Writes `data` at `off`.
    pub fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<usize> {
        self.containers.admit();
        let mut copies = self.whole_pages(off, data).into_iter().peekable();
        let mut g = self.lock();
        let a = g.attr(ino)?;
        match a.kind {
            Kind::File => {}
            Kind::Dir => return Err(StoreError::IsDir),
            _ => return Err(StoreError::Invalid),
        }
        let end = off
            .checked_add(data.len() as u64)
            .ok_or(StoreError::TooBig)?;
        if end > MAX_SIZE {
            return Err(StoreError::TooBig);
        }
        if data.is_empty() {
            return Ok(0);
        }
        let p = self.page_size();
        self.make_room(&mut g, ino)?;
        let grows = self.buffer_growth(&g, ino, (off, end), &a, is_zero(data));
        self.room_to_buffer(&mut g, ino, grows)?;
        for idx in off / p..=(end - 1) / p {
            let ps = idx * p;
            if let Some((_, page)) = copies.next_if(|&(i, _)| i == idx) {
                // Replaced outright: no read of the old bytes, no copy of
                // a page a flush may be holding.
                g.dirty.entry(ino).or_default().pages.insert(idx, page);
                continue;
            }
            if !g
                .dirty
                .get(&ino)
                .is_some_and(|d| d.pages.contains_key(&idx))
            {
                // Past the end, only what is written (see DirtyFile).
                let mut page = Vec::new();
                if ps < a.size {
                    page = vec![0u8; p as usize];
                    let plan = self.plan(&g, ino, ps, (ps + p).min(a.size))?;
                    self.fill(&mut page, ps, &plan, self.cache.generation())?;
                }
                g.dirty
                    .entry(ino)
                    .or_default()
                    .pages
                    .insert(idx, Arc::new(page));
            }
            let page = g.dirty.get_mut(&ino).unwrap().pages.get_mut(&idx).unwrap();
            let page = Arc::make_mut(page);
            let need = (end.min(ps + p) - ps) as usize;
            if page.len() < need {
                page.resize(need, 0);
            }
            copy_overlap(page.as_mut_slice(), ps, data, off);
        }
        let size = a.size.max(end);
        if self.kernel_times.load(Ordering::Relaxed) {
            if size != a.size {
                let sql = "UPDATE inodes SET size = ?2 WHERE ino = ?1";
                g.update_inode(ino, sql, params![ino, size], |r| r.size = size)?;
            }
        } else {
            let t = time_now();
            g.update_inode(
                ino,
                "UPDATE inodes SET size = ?2, mtime_ns = ?3, ctime_ns = ?3 WHERE ino = ?1",
                params![ino, size, t],
                |r| (r.size, r.mtime_ns, r.ctime_ns) = (size, t, t),
            )?;
        }
        let d = &g.dirty[&ino];
        let buffered = d.pages.len() as u64 * p;
        if buffered >= DIRTY_LIMIT && !d.flushing {
            drop(g);
            self.flush_for_room(ino)?;
        } else if buffered >= 4 * DIRTY_LIMIT {
            // Writers outrun the flush outside the lock: hold them here.
            self.flush_file_locked(&mut g, ino)?;
        } else if let Some(other) = most_buffered_over_total(&g.dirty, p) {
            drop(g);
            // Another file's failure is reported by its own close or
            // fsync, which flushes again; this write succeeded.
            if let Err(e) = self.flush_for_room(other) {
                if other == ino {
                    return Err(e);
                }
            }
        }
        Ok(data.len())
    }

    /// A flush a write makes to bound the buffers. With CDC it holds the
    /// lock, so that writers wait for it: one outside the lock let a
    /// sequential writer outrun it to the 4x bound, whose flush under
    /// the lock then took its pages (dd of 2 GiB: 343-414 -> 269-306
    /// MB/s). Closes, `fsync` and commits flush outside the lock.
    fn flush_for_room(&self, ino: u64) -> Result<()> {
        match self.cfg.chunking {
            Chunking::Cdc { .. } => self.flush_file_locked(&mut self.lock(), ino),
            Chunking::Fixed { .. } => self.flush_file(ino),
        }
    }

    /// Before a write buffers more: a buffer this far over its limits is
    /// one whose flushes fail (a full disk) or fall behind, so it is
    /// stored under the lock first, and the write refused if it cannot
    /// be. Pages that could not be stored stay buffered, so without this
    /// a full disk would let buffers grow without bound.
    fn make_room(&self, g: &mut Inner, ino: u64) -> Result<()> {
        let p = self.page_size();
        let pages = |d: &DirtyFile| d.pages.len() as u64 * p;
        if g.dirty
            .get(&ino)
            .is_some_and(|d| pages(d) >= 4 * DIRTY_LIMIT)
        {
            self.flush_file_locked(g, ino)?;
        }
        if g.dirty.values().map(pages).sum::<u64>() >= 4 * DIRTY_TOTAL_LIMIT {
            let most = g.dirty.iter().max_by_key(|(_, d)| d.pages.len());
            if let Some((&other, _)) = most {
                self.flush_file_locked(g, other)?;
            }
        }
        Ok(())
    }

    /// `fallocate`: mode 0 / KEEP_SIZE promise the file room for the
    /// range's bytes not stored yet (ENOSPC at once if the filesystem does
    /// not have it beside the store's reserve and earlier promises), so
    /// that writing them later never meets ENOSPC: other files' writes
    /// leave that room free, this file's use it up (`st_blocks` counts
    /// it); it goes when the file is deleted or truncated to 0. They
    /// extend the size unless KEEP_SIZE. PUNCH_HOLE|KEEP_SIZE and
    /// ZERO_RANGE zero the range (zero chunks are holes). Other modes are
    /// refused.
    pub fn fallocate(&self, ino: u64, off: u64, len: u64, mode: i32) -> Result<()> {
        let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let zero = mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0;
        let known =
            libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
        if mode & !known != 0 || (mode & libc::FALLOC_FL_PUNCH_HOLE != 0 && !keep) {
            return Err(StoreError::NotSupported);
        }
        let end = off
            .checked_add(len)
            .filter(|&e| e <= MAX_SIZE)
            .ok_or(StoreError::TooBig)?;
        let size = self.getattr(ino)?.size;
        if !zero {
            // Whole pages, as they are stored: writing any byte of the
            // range then uses room promised here (st_blocks does not
            // grow); their headers are stored on the reserve's slack.
            let p = self.page_size();
            let (a, b) = (off / p * p, end.div_ceil(p).saturating_mul(p).min(MAX_SIZE));
            let mut g = self.lock();
            let stored = self.stored_in(&g, ino, a, b)?;
            self.promise_room(&mut g, ino, (b - a).saturating_sub(stored))?;
        }
        if zero {
            let zend = if keep { end.min(size) } else { end };
            let zeros = vec![0u8; 1 << 20];
            let mut at = off;
            while at < zend {
                let n = (zend - at).min(zeros.len() as u64) as usize;
                self.write(ino, at, &zeros[..n])?;
                at += n as u64;
            }
        }
        if !keep && end > size {
            let mut g = self.lock();
            let now = g.attr(ino)?.size;
            if end > now {
                self.truncate_locked(&mut g, ino, end)?;
            }
        }
        Ok(())
    }

    /// A read of `a`: its access time moves as the mount's policy says
    /// (see [`Atime`]; the kernel leaves atime of FUSE inodes to the
    /// filesystem, and asks for it again after a read).
    fn accessed(&self, g: &Inner, a: &Attr) -> Result<()> {
        let now = time_now();
        let due = match self.atime_policy() {
            Atime::Never => false,
            Atime::Strict => now != a.atime_ns,
            Atime::Relative => {
                a.atime_ns <= a.mtime_ns
                    || a.atime_ns <= a.ctime_ns
                    || now - a.atime_ns >= 24 * 3600 * 1_000_000_000
            }
        };
        if due {
            g.db.prepare_cached("UPDATE inodes SET atime_ns = ?2 WHERE ino = ?1")?
                .execute(params![a.ino, now])?;
        }
        Ok(())
    }

    /// Reads up to `len` bytes at `off` (short at the end of the file).
    pub fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        // A retried read may end shorter than the attempt before it.
        let n = self.read_to(ino, off, len, &mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Reads up to `buf.len()` bytes at `off` into `buf` and returns how
    /// many (fewer only at the end of the file), as [`Store::read`]
    /// without a buffer of its own: a FUSE transport whose reply buffer
    /// is at hand saves an allocation and a copy. Invariant: every byte
    /// of `buf[..n]` is written (a hole's as zeros), so nothing that was
    /// in the buffer before can reach the reader.
    pub fn read_into(&self, ino: u64, off: u64, buf: &mut [u8]) -> Result<usize> {
        let len = buf.len();
        self.read_to(ino, off, len, &mut Taken(buf))
    }

    fn read_to(&self, ino: u64, off: u64, len: usize, out: &mut impl ReadBuf) -> Result<usize> {
        if off == 0 {
            self.ahead.started(ino);
        }
        let mut once = || match crate::view::is_read_only(ino) {
            true => self.view_read(ino, off, len, out),
            false => self.read_once(ino, off, len, out),
        };
        let mut r = once();
        // gc may have moved a chunk and deleted its old container between
        // planning and reading: plan again once.
        if matches!(r, Err(StoreError::Io { .. })) {
            r = once();
        }
        // A damaged cache copy of a container the bucket holds: read the
        // bucket's instead, once per container (its damage too is `EIO`).
        let mut dropped = HashSet::new();
        while let Err(StoreError::Damaged { container, .. }) = r {
            if !dropped.insert(container) || !self.containers.drop_damaged_copy(container) {
                break;
            }
            r = once();
        }
        r
    }

    fn read_once(&self, ino: u64, off: u64, len: usize, out: &mut impl ReadBuf) -> Result<usize> {
        let (start, plan, overlays) = {
            let g = self.lock();
            let a = g.attr(ino)?;
            if a.kind == Kind::Dir {
                return Err(StoreError::IsDir);
            }
            self.accessed(&g, &a)?;
            let end = off.saturating_add(len as u64).min(a.size);
            if off >= end {
                return Ok(0);
            }
            let plan = self.plan(&g, ino, off, end)?;
            let p = self.page_size();
            let overlays: Vec<Page> = match g.dirty.get(&ino) {
                Some(d) => d
                    .pages
                    .range(off / p..=(end - 1) / p)
                    .map(|(i, pg)| (i * p, pg.clone()))
                    .collect(),
                None => Vec::new(),
            };
            ((off, end), (plan, self.cache.generation()), overlays)
        };
        let buf = out.take((start.1 - start.0) as usize);
        self.fill(buf, start.0, &plan.0, plan.1)?;
        for (po, page) in overlays {
            copy_overlap(buf, start.0, &page, po);
        }
        Ok(buf.len())
    }

    /// The stored extents overlapping `[start, end)` of a file.
    pub(crate) fn plan(&self, g: &Inner, ino: u64, start: u64, end: u64) -> Result<Vec<Planned>> {
        let from = start.saturating_sub(self.cfg.chunking.max_chunk() as u64);
        let mut st = g.db.prepare_cached(
            "SELECT e.off, e.len, c.container, c.offset, c.stored_len, c.raw_len, c.inner, c.pack_raw
             FROM extents e LEFT JOIN chunks c ON c.id = e.chunk
             WHERE e.ino = ?1 AND e.off >= ?2 AND e.off < ?3 ORDER BY e.off",
        )?;
        let rows = st.query_map(params![ino, from, end], planned_or_missing)?;
        let mut out = Vec::new();
        for row in rows {
            let (o, l, loc): Planned = row?.map_err(|off| StoreError::MissingChunk { ino, off })?;
            if o + l > start {
                out.push((o, l, loc));
            }
        }
        Ok(out)
    }

    /// Copies planned extents into `buf` (file offset `at`).
    /// Chunks come from the read cache when there; the others are read
    /// with one read per run of records adjacent in one container (a file
    /// written sequentially is laid out so), each checked and decoded.
    /// A raw chunk wholly inside `buf` is read straight into place behind
    /// its header (`preadv`: no copy at all), a compressed one is decoded
    /// into place; only a chunk the read covers in part is decoded aside
    /// and cached, for the read that wants its other part.
    ///
    /// Every byte of `buf` is written, whatever it held: the extents'
    /// bytes, zeros in the holes between them (so a caller's buffer need
    /// not be zeroed first, and a read never shows what it held before).
    pub(crate) fn fill(&self, buf: &mut [u8], at: u64, plan: &[Planned], gen: u64) -> Result<()> {
        zero_gaps(buf, at, plan);
        let mut i = 0;
        while i < plan.len() {
            let (o, l, loc) = plan[i];
            if let Some(data) = self.cache.get(gen, &loc) {
                copy_extent(buf, at, &data, (o, l));
                i += 1;
                continue;
            }
            let j = adjacent_run(plan, i, |p| self.cache.get(gen, &p.2).is_none());
            self.fill_span(buf, at, &plan[i..j], gen)?;
            i = j;
        }
        Ok(())
    }

    /// [`Store::fill`] for records adjacent in one container, read with
    /// one vectored call: stored-raw records wholly inside `buf` land in
    /// place (their headers aside), the others aside to be decoded.
    fn fill_span(&self, buf: &mut [u8], at: u64, recs: &[Planned], gen: u64) -> Result<()> {
        let direct = direct_places(recs, at, at + buf.len() as u64, self.keys.is_some());
        let n_direct = direct.iter().flatten().count();
        let first = recs[0].2;
        if n_direct == 0 {
            // All decoded aside (a sealed store's always are): from where
            // the backend holds them if it does, not copied first.
            let len = recs.iter().map(|r| r.2.stored_len as usize).sum();
            let mut finish =
                |aside: &[u8]| self.finish_span(buf, at, recs, (&direct, &[], aside), gen);
            return self
                .containers
                .with_bytes(first.container, first.offset, len, &mut finish);
        }
        let mut headers = vec![[0u8; container::RECORD_HEADER]; n_direct];
        let aside_len: usize = recs
            .iter()
            .zip(&direct)
            .filter(|(_, d)| d.is_none())
            .map(|(r, _)| r.2.stored_len as usize)
            .sum();
        let mut aside = vec![0u8; aside_len];
        {
            let mut bufs = span_buffers(buf, recs, &direct, &mut headers, &mut aside);
            self.containers
                .read_into(first.container, first.offset, &mut bufs)?;
        }
        self.finish_span(buf, at, recs, (&direct, &headers, &aside), gen)
    }

    /// Checks the records [`Store::fill_span`] read in place and decodes
    /// the ones read aside into `buf` (a record only partly inside it is
    /// decoded whole, its overlap copied, and kept in the cache).
    fn finish_span(
        &self,
        buf: &mut [u8],
        at: u64,
        recs: &[Planned],
        (direct, headers, aside): (&[Option<usize>], &[[u8; container::RECORD_HEADER]], &[u8]),
        gen: u64,
    ) -> Result<()> {
        let end_at = at + buf.len() as u64;
        let (mut h, mut a) = (0, 0);
        for (&(o, l, lk), d) in recs.iter().zip(direct) {
            if let Some(d) = *d {
                let payload = &buf[d..d + lk.raw_len as usize];
                container::check_raw(&headers[h], payload, lk.container, lk.offset)?;
                h += 1;
                continue;
            }
            let rec = &aside[a..a + lk.stored_len as usize];
            a += lk.stored_len as usize;
            let raw = lk.raw_len as u64;
            if l == raw && lk.inner.is_none() && o >= at && o + raw <= end_at {
                let d = (o - at) as usize;
                let out = &mut buf[d..d + raw as usize];
                container::decode_into(rec, lk.container, lk.offset, out, self.keys.as_deref())?;
            } else {
                let data = self.decode_piece(rec, lk)?;
                copy_extent(buf, at, &data, (o, l));
                self.cache.insert(gen, &lk, &data);
            }
        }
        Ok(())
    }

    /// Cuts the file's buffered pages into chunks and records them. Each
    /// run of pages is stored whole or not at all: when storing fails
    /// (ENOSPC, EIO), the pages not stored go back into the buffer, the
    /// file map is as before for them, and the error is returned (the
    /// next flush tries again; `fsync` reports it).
    pub(crate) fn flush_file_locked(&self, g: &mut Inner, ino: u64) -> Result<()> {
        let before = g.flushing.replace(ino);
        let r = self.flush_runs(g, ino);
        g.flushing = before;
        r
    }

    /// [`Store::flush_file_locked`] with `g.flushing` set.
    pub(crate) fn flush_runs(&self, g: &mut Inner, ino: u64) -> Result<()> {
        let Some(df) = g.dirty.remove(&ino) else {
            return Ok(());
        };
        let size = match g.attr(ino) {
            Ok(a) => a.size,
            Err(StoreError::NotFound) => return Ok(()),
            Err(e) => {
                g.dirty.insert(ino, df);
                return Err(e);
            }
        };
        let p = self.page_size();
        let mut runs: Vec<Vec<(u64, Page)>> = Vec::new();
        for (idx, page) in df.pages {
            let ps = idx * p;
            if ps >= size {
                continue;
            }
            match runs.last_mut() {
                Some(run) if run.last().is_some_and(|(_, (o, _))| o + p == ps) => {
                    run.push((idx, (ps, page)))
                }
                _ => runs.push(vec![(idx, (ps, page))]),
            }
        }
        let mut runs = runs.into_iter();
        while let Some(run) = runs.next() {
            let stored = self.store_run(g, ino, size, &run);
            if let Err((done, e)) = stored {
                let back = run.into_iter().skip(done).chain(runs.flatten());
                let d = g.dirty.entry(ino).or_default();
                for (idx, (_, page)) in back {
                    d.pages.entry(idx).or_insert(page);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Stores one run of contiguous pages (see
    /// [`Store::flush_file_locked`]); on failure, how many of its pages
    /// were stored (with fixed chunks, page by page; with CDC, none).
    fn store_run(
        &self,
        g: &mut Inner,
        ino: u64,
        size: u64,
        run: &[(u64, Page)],
    ) -> std::result::Result<(), (usize, StoreError)> {
        let p = self.page_size();
        match self.cfg.chunking {
            Chunking::Fixed { .. } => {
                for (i, (_, (ps, page))) in run.iter().enumerate() {
                    let len = p.min(size - ps) as usize;
                    self.replace_chunk(g, ino, *ps, &page_prefix(page, len))
                        .map_err(|e| (i, e))?;
                }
                Ok(())
            }
            Chunking::Cdc { min, avg, max } => {
                let start = run[0].1 .0;
                let end = (run[run.len() - 1].1 .0 + p).min(size);
                let pages: Vec<Page> = run.iter().map(|(_, pg)| pg.clone()).collect();
                self.rechunk(g, ino, start, end, &pages, (min, avg, max))
                    .map_err(|e| (0, e))
            }
        }
    }

    /// Bytes of stored extents starting in `[start, end)`.
    fn stored_in(&self, g: &Inner, ino: u64, start: u64, end: u64) -> Result<u64> {
        let mut st = g.db.prepare_cached(
            "SELECT COALESCE(SUM(len), 0) FROM extents WHERE ino = ?1 AND off >= ?2 AND off < ?3",
        )?;
        Ok(st.query_row(params![ino, start, end], |r| r.get(0))?)
    }

    /// The extent containing file offset `pos`: (off, len, chunk).
    pub(crate) fn extent_at(
        &self,
        g: &Inner,
        ino: u64,
        pos: u64,
    ) -> Result<Option<(u64, u64, ChunkId)>> {
        let mut st = g.db.prepare_cached(
            "SELECT off, len, chunk FROM extents WHERE ino = ?1 AND off <= ?2
             ORDER BY off DESC LIMIT 1",
        )?;
        let e: Option<(u64, u64, ChunkId)> = st
            .query_row(params![ino, pos], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .optional()?;
        Ok(e.filter(|&(o, l, _)| pos < o + l))
    }

    /// Drops the extents starting in `[start, end)` and their references.
    pub(crate) fn drop_extents(&self, g: &Inner, ino: u64, start: u64, end: u64) -> Result<()> {
        let refs: Vec<(ChunkId, u64)> = {
            let mut st = g.db.prepare_cached(
                "SELECT chunk, COUNT(*) FROM extents WHERE ino = ?1 AND off >= ?2 AND off < ?3
                 GROUP BY chunk",
            )?;
            let rows = st.query_map(params![ino, start, end], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        self.release_chunks(g, &refs)?;
        g.db.prepare_cached("DELETE FROM extents WHERE ino = ?1 AND off >= ?2 AND off < ?3")?
            .execute(params![ino, start, end])?;
        Ok(())
    }

    /// Stores `data` as the chunk at `off` (a hole if all zero), replacing
    /// whatever extent started there.
    fn replace_chunk(&self, g: &mut Inner, ino: u64, off: u64, data: &[u8]) -> Result<()> {
        let new = if is_zero(data) {
            g.counters.zero_bytes += data.len() as u64;
            None
        } else {
            Some(self.put_chunk(g, data)?)
        };
        self.drop_extents(g, ino, off, off + 1)?;
        if let Some(id) = new {
            g.db.prepare_cached(
                "INSERT INTO extents (ino, off, len, chunk, born) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![ino, off, data.len() as u64, id, g.epoch])?;
        }
        Ok(())
    }

    /// Content-defined re-chunking of a dirty region widened to the chunk
    /// boundaries around it (and the chunk before it). All chunks are
    /// stored before the file map changes: if one cannot be, the
    /// references taken are dropped again and the map is untouched.
    fn rechunk(
        &self,
        g: &mut Inner,
        ino: u64,
        start: u64,
        end: u64,
        pages: &[Page],
        chunking: (u32, u32, u32),
    ) -> Result<()> {
        let span = self.cdc_span(g, ino, start, end)?;
        let mut buf = self.span_bytes(&span)?;
        for (po, page) in pages {
            copy_overlap(&mut buf, span.a, page, *po);
        }
        let cuts = self.cut_span(&buf, chunking);
        let made = self.store_cuts(g, &buf, span.a, &cuts, Default::default())?;
        self.replace_span(g, ino, span.a, span.b, &made)
    }

    /// Sets the file's size: chunks past it are dropped, the one across it
    /// is cut.
    pub(crate) fn truncate_locked(&self, g: &mut Inner, ino: u64, size: u64) -> Result<()> {
        if size > MAX_SIZE {
            return Err(StoreError::TooBig);
        }
        self.flush_file_locked(g, ino)?;
        let old = g.attr(ino)?.size;
        if size < old {
            if let Some((o, l, _)) = self.extent_at(g, ino, size)? {
                if o < size {
                    let plan = self.plan(g, ino, o, o + l)?;
                    let mut data = vec![0u8; (size - o) as usize];
                    self.fill(&mut data, o, &plan, self.cache.generation())?;
                    self.replace_chunk(g, ino, o, &data)?;
                }
            }
            self.drop_extents(g, ino, size, u64::MAX >> 1)?;
        }
        g.db.prepare_cached("UPDATE inodes SET size = ?2 WHERE ino = ?1")?
            .execute(params![ino, size])?;
        // Room promised beyond the new size is given back.
        if let Some(room) = g.prealloc.get(&ino).copied() {
            if room > size {
                let give_back = if size == 0 { None } else { Some(room - size) };
                Self::use_room(g, ino, give_back);
            }
        }
        Ok(())
    }
}

use crate::ns::Attr;

/// Where a read's bytes go, handed out once the read knows how many.
pub(crate) trait ReadBuf {
    /// `n` bytes (no more than the read asked for) holding anything: the
    /// read writes every one ([`Store::fill`]).
    fn take(&mut self, n: usize) -> &mut [u8];
}

impl ReadBuf for Vec<u8> {
    fn take(&mut self, n: usize) -> &mut [u8] {
        *self = vec![0; n];
        self
    }
}

/// A caller's buffer, not zeroed first: [`Store::fill`] writes each byte
/// (zeroing it cost a cold remote read 4-9% of the mount's CPU).
struct Taken<'a>(&'a mut [u8]);

impl ReadBuf for Taken<'_> {
    fn take(&mut self, n: usize) -> &mut [u8] {
        &mut self.0[..n]
    }
}

/// The extent `(o, l)` of a file, whose chunk's bytes are `data`, into
/// `buf` (at file offset `at`): past a chunk shorter than the extent,
/// zeros, as in a hole.
fn copy_extent(buf: &mut [u8], at: u64, data: &[u8], (o, l): (u64, u64)) {
    let n = (l as usize).min(data.len());
    copy_overlap(buf, at, &data[..n], o);
    if n < l as usize {
        copy_overlap(buf, at, &vec![0; l as usize - n], o + n as u64);
    }
}

/// Zeroes the bytes of `buf` (at file offset `at`) that no extent of
/// `plan` (in offset order, not overlapping) covers.
fn zero_gaps(buf: &mut [u8], at: u64, plan: &[Planned]) {
    let end = at + buf.len() as u64;
    let mut from = at;
    for &(o, l, _) in plan {
        if o > from {
            let to = o.min(end);
            buf[(from - at) as usize..(to - at) as usize].fill(0);
        }
        from = from.max(o + l);
        if from >= end {
            return;
        }
    }
    buf[(from - at) as usize..].fill(0);
}

#[cfg(test)]
mod tests {
    use crate::{Kind, NewNode, Store, StoreConfig};

    /// A new store made with `cfg` in a temporary directory, opened, with
    /// one empty file `f` created and open: (directory, store, its inode).
    fn store_with_open_file(cfg: &StoreConfig) -> (tempfile::TempDir, Store, u64) {
        let dir = tempfile::tempdir().unwrap();
        Store::init(dir.path(), cfg).unwrap();
        let s = Store::open(dir.path()).unwrap();
        let node = NewNode::root_owned(Kind::File, 0o644);
        let ino = s.mknod(1, b"f", node).unwrap().ino;
        s.open_file(ino).unwrap();
        (dir, s, ino)
    }

    /// Writers and flushes race on the same pages of one file (flushes
    /// hash outside the lock): at the end every page holds the bytes of
    /// its last write, before and after a reopen.
    #[test]
    fn flushes_outside_the_lock_never_lose_a_later_write() {
        for chunking in ["fixed:4K", "cdc:2K/8K/32K"] {
            race_writes_and_flushes(chunking);
        }
    }

    /// See [`flushes_outside_the_lock_never_lose_a_later_write`]. With
    /// CDC the file's 64 KiB pages each take 16 of the 4 KiB writes.
    fn race_writes_and_flushes(chunking: &str) {
        let cfg = StoreConfig {
            chunking: chunking.parse().unwrap(),
            container_size: 1 << 20,
            ..StoreConfig::default()
        };
        let (dir, s, ino) = store_with_open_file(&cfg);
        let page = |pg: u64, v: u64| -> Vec<u8> {
            let mut b = Vec::with_capacity(4096);
            while b.len() < 4096 {
                b.extend_from_slice(
                    blake3::hash(&[pg, v].map(u64::to_le_bytes).concat()).as_bytes(),
                );
            }
            b
        };
        const PAGES: u64 = 64;
        const ROUNDS: u64 = 40;
        std::thread::scope(|sc| {
            for t in 0..2u64 {
                let s = &s;
                sc.spawn(move || {
                    for v in 0..ROUNDS {
                        for pg in (t..PAGES).step_by(2) {
                            // Half-page writes too, so pages are read back
                            // from stored chunks and copied on write.
                            let b = page(pg, v);
                            s.write(ino, pg * 4096, &b[..2048]).unwrap();
                            s.write(ino, pg * 4096 + 2048, &b[2048..]).unwrap();
                        }
                        s.flush_file(ino).unwrap();
                    }
                });
            }
            sc.spawn(|| {
                for _ in 0..200 {
                    s.flush_file(ino).unwrap();
                }
            });
        });
        let want: Vec<u8> = (0..PAGES).flat_map(|pg| page(pg, ROUNDS - 1)).collect();
        assert!(
            s.read(ino, 0, want.len()).unwrap() == want,
            "{chunking}: before flush"
        );
        s.release_file(ino).unwrap();
        s.flush_all(true).unwrap();
        drop(s);
        let s = Store::open(dir.path()).unwrap();
        assert!(
            s.read(ino, 0, want.len()).unwrap() == want,
            "{chunking}: after reopen"
        );
        assert!(s.fsck(false).unwrap().problems.is_empty(), "{chunking}");
    }

    /// Reads at every alignment against chunks (decoded in place when
    /// wholly inside the read, through the cache when cut) return the
    /// written bytes, holes included, for every codec, into a buffer of
    /// their own or the caller's.
    #[test]
    fn reads_at_any_alignment_return_the_written_bytes() {
        for compress in ["lz4", "zstd", "none"] {
            let cfg = StoreConfig {
                chunking: "fixed:4K".parse().unwrap(),
                compress: compress.parse().unwrap(),
                ..StoreConfig::default()
            };
            let (_dir, s, ino) = store_with_open_file(&cfg);
            // Text-like pages (compressible), a hole, then random-ish bytes.
            let mut want: Vec<u8> = (0..40_000u32)
                .map(|i| b"abcdefgh"[(i % 8) as usize])
                .collect();
            want.extend(std::iter::repeat_n(0u8, 9000));
            want.extend((0..30_001u32).map(|i| blake3::hash(&i.to_le_bytes()).as_bytes()[0]));
            s.write(ino, 0, &want).unwrap();
            // A hole never written (no extent), then a last page.
            let tail_at = want.len() + 10_000;
            want.resize(tail_at, 0);
            s.write(ino, tail_at as u64, b"tail").unwrap();
            want.extend(b"tail");
            s.release_file(ino).unwrap();
            for (off, len) in [
                (0, want.len()),
                (1, 4095),
                (4095, 2),
                (4096, 8192),
                (3000, 50_000),
                (70_000, 20_000),
                (75_000, 20_000),
                (tail_at, 100),
                (want.len(), 10),
            ] {
                // A fresh store each time would defeat the cache; reading
                // twice checks both the cold and the cached path.
                let end = (off + len).min(want.len());
                for _ in 0..2 {
                    let got = s.read(ino, off as u64, len).unwrap();
                    assert!(got == want[off..end], "{compress} read {off}+{len}");
                }
                // Into a buffer holding other bytes: none of them shows.
                let mut buf = vec![0xa5; len];
                let n = s.read_into(ino, off as u64, &mut buf).unwrap();
                assert!(
                    buf[..n] == want[off..end],
                    "{compress} read_into {off}+{len}"
                );
            }
        }
    }

    /// A flipped bit anywhere in a raw record read straight into place
    /// (header or payload) makes the read an error, never wrong bytes.
    #[test]
    fn damage_in_a_record_read_in_place_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = StoreConfig {
            chunking: "fixed:4K".parse().unwrap(),
            compress: "none".parse().unwrap(),
            ..StoreConfig::default()
        };
        Store::init(dir.path(), &cfg).unwrap();
        let data: Vec<u8> = (0..16_384u32)
            .map(|i| blake3::hash(&i.to_le_bytes()).as_bytes()[1])
            .collect();
        let s = Store::open(dir.path()).unwrap();
        let node = NewNode::root_owned(Kind::File, 0o644);
        let ino = s.mknod(1, b"f", node).unwrap().ino;
        s.write(ino, 0, &data).unwrap();
        s.flush_all(true).unwrap();
        drop(s);
        let cont = std::fs::read_dir(dir.path().join("containers/01"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let clean = std::fs::read(&cont).unwrap();
        // The second record: header fields, CRC, payload.
        let rec = 16 + 48 + 4096;
        for at in [
            rec + 3,
            rec + 33,
            rec + 37,
            rec + 40,
            rec + 45,
            rec + 48,
            rec + 48 + 4095,
        ] {
            let mut bad = clean.clone();
            bad[at] ^= 0x01;
            std::fs::write(&cont, &bad).unwrap();
            let s = Store::open(dir.path()).unwrap();
            assert!(
                s.read(ino, 0, data.len()).is_err(),
                "flip at {at} undetected"
            );
            assert!(s.read(ino, 4096, 4096).is_err(), "flip at {at} undetected");
            drop(s);
        }
        std::fs::write(&cont, &clean).unwrap();
        let s = Store::open(dir.path()).unwrap();
        assert!(s.read(ino, 0, data.len()).unwrap() == data);
    }

    /// `security.capability` is answered without the lock while no file
    /// has one: once set it must read back, also after a reopen.
    #[test]
    fn capability_xattr_reads_back_after_the_fast_path() {
        let dir = tempfile::tempdir().unwrap();
        Store::init(dir.path(), &StoreConfig::default()).unwrap();
        let s = Store::open(dir.path()).unwrap();
        let node = NewNode::root_owned(Kind::File, 0o755);
        let ino = s.mknod(1, b"f", node).unwrap().ino;
        let caps = b"security.capability";
        assert!(matches!(
            s.getxattr(ino, caps),
            Err(crate::StoreError::NoAttr)
        ));
        s.setxattr(ino, caps, b"\x01\x02", false, false).unwrap();
        assert_eq!(s.getxattr(ino, caps).unwrap(), b"\x01\x02");
        s.flush_all(true).unwrap();
        drop(s);
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(s.getxattr(ino, caps).unwrap(), b"\x01\x02");
    }
}
