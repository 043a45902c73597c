//! File data: the per-file write buffer, reads that overlay it on stored
//! chunks, and the flush that cuts buffered pages into chunks (fixed or
//! FastCDC), dedupes them and updates the file map.

use std::collections::BTreeMap;

use rusqlite::{params, OptionalExtension};

use crate::config::Chunking;
use crate::error::{Result, StoreError};
use crate::meta::{ChunkId, ChunkLoc};
use crate::ns::Kind;
use crate::store::{time_now, Inner, Store};

/// Buffered writes of one file: whole pages, newer than the stored chunks.
#[derive(Default)]
pub(crate) struct DirtyFile {
    pub pages: BTreeMap<u64, Box<[u8]>>,
}

/// A file is flushed to chunks once this much of it is buffered.
const DIRTY_LIMIT: u64 = 16 << 20;
/// Largest file size accepted.
const MAX_SIZE: u64 = 1 << 52;
/// Buffer page size with content-defined chunking.
const CDC_PAGE: u64 = 64 << 10;

/// A stored extent: file offset, length, and where its chunk is.
type Planned = (u64, u64, ChunkLoc);
/// A buffered page: file offset and bytes.
type Page = (u64, Box<[u8]>);

fn is_zero(b: &[u8]) -> bool {
    b.iter().all(|&x| x == 0)
}

/// Copies the part of `src` (at file offset `src_off`) that falls in
/// `dst` (at file offset `dst_off`).
fn copy_overlap(dst: &mut [u8], dst_off: u64, src: &[u8], src_off: u64) {
    let lo = dst_off.max(src_off);
    let hi = (dst_off + dst.len() as u64).min(src_off + src.len() as u64);
    if lo < hi {
        let (d, s) = ((lo - dst_off) as usize, (lo - src_off) as usize);
        let n = (hi - lo) as usize;
        dst[d..d + n].copy_from_slice(&src[s..s + n]);
    }
}

impl Store {
    fn page_size(&self) -> u64 {
        match self.cfg.chunking {
            Chunking::Fixed { size } => size as u64,
            Chunking::Cdc { .. } => CDC_PAGE,
        }
    }

    /// A file is opened: it stays alive while open even if unlinked.
    pub fn open_file(&self, ino: u64) -> Result<Attr> {
        let mut g = self.lock();
        let a = g.attr(ino)?;
        *g.open_count.entry(ino).or_default() += 1;
        Ok(a)
    }

    /// A file handle is closed: its buffer is written to chunks.
    pub fn release_file(&self, ino: u64) -> Result<()> {
        let mut g = self.lock();
        let r = self.flush_file_locked(&mut g, ino);
        let n = g.open_count.entry(ino).or_default();
        *n = n.saturating_sub(1);
        if *n == 0 {
            g.open_count.remove(&ino);
            if g.attr(ino).is_ok() {
                self.maybe_delete(&mut g, ino)?;
            }
        }
        r
    }

    /// Writes the file's buffer to chunks (no commit).
    pub fn flush_file(&self, ino: u64) -> Result<()> {
        let mut g = self.lock();
        self.flush_file_locked(&mut g, ino)
    }

    /// `fsync`: the file's data and metadata (and everything committed
    /// before) become durable.
    pub fn fsync(&self, ino: u64) -> Result<()> {
        self.flush_file(ino)?;
        self.commit(true)
    }

    /// Writes `data` at `off`.
    pub fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<usize> {
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
        for idx in off / p..=(end - 1) / p {
            let ps = idx * p;
            let whole = off <= ps && end >= ps + p;
            if !g
                .dirty
                .get(&ino)
                .is_some_and(|d| d.pages.contains_key(&idx))
            {
                let page = if whole || ps >= a.size {
                    vec![0u8; p as usize]
                } else {
                    let plan = self.plan(&g, ino, ps, (ps + p).min(a.size))?;
                    let mut page = vec![0u8; p as usize];
                    self.fill(&mut page, ps, &plan)?;
                    page
                };
                g.dirty
                    .entry(ino)
                    .or_default()
                    .pages
                    .insert(idx, page.into_boxed_slice());
            }
            let page = g.dirty.get_mut(&ino).unwrap().pages.get_mut(&idx).unwrap();
            copy_overlap(page, ps, data, off);
        }
        let size = a.size.max(end);
        g.db.prepare_cached(
            "UPDATE inodes SET size = ?2, mtime_ns = ?3, ctime_ns = ?3 WHERE ino = ?1",
        )?
        .execute(params![ino, size, time_now()])?;
        if g.dirty[&ino].pages.len() as u64 * p >= DIRTY_LIMIT {
            self.flush_file_locked(&mut g, ino)?;
        }
        Ok(data.len())
    }

    /// `fallocate`: mode 0 / KEEP_SIZE reserve nothing (chunks are
    /// allocated on write) but extend the size unless KEEP_SIZE;
    /// PUNCH_HOLE|KEEP_SIZE and ZERO_RANGE zero the range (zero chunks are
    /// holes). Other modes are refused.
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

    /// Reads up to `len` bytes at `off` (short at the end of the file).
    pub fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        match self.read_once(ino, off, len) {
            // gc may have moved a chunk and deleted its old container
            // between planning and reading: plan again once.
            Err(StoreError::Io { .. }) => self.read_once(ino, off, len),
            r => r,
        }
    }

    fn read_once(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        let (start, plan, overlays) = {
            let g = self.lock();
            let a = g.attr(ino)?;
            if a.kind == Kind::Dir {
                return Err(StoreError::IsDir);
            }
            let end = off.saturating_add(len as u64).min(a.size);
            if off >= end {
                return Ok(Vec::new());
            }
            let plan = self.plan(&g, ino, off, end)?;
            let p = self.page_size();
            let overlays: Vec<(u64, Box<[u8]>)> = match g.dirty.get(&ino) {
                Some(d) => d
                    .pages
                    .range(off / p..=(end - 1) / p)
                    .map(|(i, pg)| (i * p, pg.clone()))
                    .collect(),
                None => Vec::new(),
            };
            ((off, end), plan, overlays)
        };
        let mut buf = vec![0u8; (start.1 - start.0) as usize];
        self.fill(&mut buf, start.0, &plan)?;
        for (po, page) in overlays {
            copy_overlap(&mut buf, start.0, &page, po);
        }
        Ok(buf)
    }

    /// The stored extents overlapping `[start, end)` of a file.
    fn plan(&self, g: &Inner, ino: u64, start: u64, end: u64) -> Result<Vec<Planned>> {
        let from = start.saturating_sub(self.cfg.chunking.max_chunk() as u64);
        let mut st = g.db.prepare_cached(
            "SELECT e.off, e.len, c.container, c.offset, c.stored_len, c.raw_len
             FROM extents e JOIN chunks c ON c.id = e.chunk
             WHERE e.ino = ?1 AND e.off >= ?2 AND e.off < ?3 ORDER BY e.off",
        )?;
        let rows = st.query_map(params![ino, from, end], |r| {
            Ok((r.get(0)?, r.get(1)?, crate::meta::loc_of(r, 2)?))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (o, l, loc): Planned = row?;
            if o + l > start {
                out.push((o, l, loc));
            }
        }
        Ok(out)
    }

    /// Copies planned extents into `buf` (file offset `at`).
    fn fill(&self, buf: &mut [u8], at: u64, plan: &[Planned]) -> Result<()> {
        for &(o, l, loc) in plan {
            let data = self.read_loc(loc)?;
            let n = (l as usize).min(data.len());
            copy_overlap(buf, at, &data[..n], o);
        }
        Ok(())
    }

    /// Cuts the file's buffered pages into chunks and records them.
    pub(crate) fn flush_file_locked(&self, g: &mut Inner, ino: u64) -> Result<()> {
        let Some(df) = g.dirty.remove(&ino) else {
            return Ok(());
        };
        let size = g.attr(ino)?.size;
        let p = self.page_size();
        let mut runs: Vec<(u64, Vec<Page>)> = Vec::new();
        for (idx, page) in df.pages {
            let ps = idx * p;
            if ps >= size {
                continue;
            }
            match runs.last_mut() {
                Some((_, pages)) if pages.last().is_some_and(|(o, _)| o + p == ps) => {
                    pages.push((ps, page))
                }
                _ => runs.push((ps, vec![(ps, page)])),
            }
        }
        for (start, pages) in runs {
            match self.cfg.chunking {
                Chunking::Fixed { .. } => {
                    for (ps, page) in pages {
                        let len = p.min(size - ps) as usize;
                        self.replace_chunk(g, ino, ps, &page[..len])?;
                    }
                }
                Chunking::Cdc { min, avg, max } => {
                    let end = (pages.last().unwrap().0 + p).min(size);
                    self.rechunk(g, ino, start, end, &pages, (min, avg, max))?;
                }
            }
        }
        Ok(())
    }

    /// The extent containing file offset `pos`: (off, len, chunk).
    fn extent_at(&self, g: &Inner, ino: u64, pos: u64) -> Result<Option<(u64, u64, ChunkId)>> {
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
    fn drop_extents(&self, g: &Inner, ino: u64, start: u64, end: u64) -> Result<()> {
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
                "INSERT INTO extents (ino, off, len, chunk) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![ino, off, data.len() as u64, id])?;
        }
        Ok(())
    }

    /// Content-defined re-chunking of a dirty region widened to the chunk
    /// boundaries around it (and the chunk before it).
    fn rechunk(
        &self,
        g: &mut Inner,
        ino: u64,
        start: u64,
        end: u64,
        pages: &[Page],
        (min, avg, max): (u32, u32, u32),
    ) -> Result<()> {
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
        let mut buf = vec![0u8; (b - a) as usize];
        let plan = self.plan(g, ino, a, b)?;
        self.fill(&mut buf, a, &plan)?;
        for (po, page) in pages {
            copy_overlap(&mut buf, a, page, *po);
        }
        self.drop_extents(g, ino, a, b)?;
        for c in fastcdc::v2020::FastCDC::new(&buf, min, avg, max) {
            let data = &buf[c.offset..c.offset + c.length];
            self.replace_chunk(g, ino, a + c.offset as u64, data)?;
        }
        Ok(())
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
                    self.fill(&mut data, o, &plan)?;
                    self.replace_chunk(g, ino, o, &data)?;
                }
            }
            self.drop_extents(g, ino, size, u64::MAX >> 1)?;
        }
        g.db.prepare_cached("UPDATE inodes SET size = ?2 WHERE ino = ?1")?
            .execute(params![ino, size])?;
        Ok(())
    }
}

use crate::ns::Attr;
