//! Sealed runs: entries sorted by key in checksummed pages, followed by
//! the run's filter, its directory (top 64 bits of each page's first key)
//! and a versioned trailer. A lookup reads at most one page.

use std::sync::Arc;

use crate::error::{corrupt, Ctx, Result};
use crate::filter::{FilterBuilder, RunFilter};
use crate::format::{
    self, decode_sorted_page, encode_sorted_page, open_blob, seal_blob, Entry, PAGE, PER_PAGE,
};
use crate::io::Io;

const TRAILER_MAGIC: &[u8; 8] = b"OCFPRUN\0";
const DIR_MAGIC: &[u8; 8] = b"OCFPDIR\0";
const RUN_VERSION: u32 = 1;
/// Pages written per `append` while building a run.
const WRITE_BATCH: usize = 256;
/// Pages a merge reads from each input at a time (128 KiB: a merge of many
/// runs holds one batch per input, read and decoded).
const READ_BATCH: usize = 32;

pub fn run_name(id: u64) -> String {
    format!("run-{id:016x}")
}

/// An open sealed run: its filter and directory in RAM, pages on disk.
pub struct Run {
    pub id: u64,
    pub name: String,
    pub entries: u64,
    pub pages: u64,
    pub dir: Vec<u64>,
    pub filter: RunFilter,
}

impl Run {
    /// Loads a run's trailer, filter and directory.
    pub fn open(io: &dyn Io, id: u64) -> Result<Run> {
        let name = run_name(id);
        let len = io
            .len(&name)
            .ctx(&name)?
            .ok_or_else(|| corrupt(&name, "missing run"))?;
        if len < PAGE as u64 || len % PAGE as u64 != 0 {
            return Err(corrupt(&name, "length"));
        }
        let mut t = vec![0u8; PAGE];
        io.read_at(&name, len - PAGE as u64, &mut t).ctx(&name)?;
        let (v, body) = open_blob(TRAILER_MAGIC, &t).ok_or_else(|| corrupt(&name, "trailer"))?;
        if v != RUN_VERSION {
            return Err(corrupt(&name, "unknown run version"));
        }
        let f = |i: usize| format::u64_at(body, i * 8).ok_or_else(|| corrupt(&name, "trailer"));
        let (entries, pages, filter_off, filter_len, dir_len) = (f(0)?, f(1)?, f(2)?, f(3)?, f(4)?);
        let blob_end = filter_off
            .checked_add(filter_len)
            .and_then(|x| x.checked_add(dir_len));
        if pages.checked_mul(PAGE as u64) != Some(filter_off)
            || blob_end.is_none_or(|e| e > len - PAGE as u64)
        {
            return Err(corrupt(&name, "trailer offsets"));
        }
        let mut io_err = None;
        let filter = RunFilter::decode_with(|off, len| {
            if off.checked_add(len)? as u64 > filter_len {
                return None;
            }
            let mut b = vec![0u8; len];
            match io.read_at(&name, filter_off + off as u64, &mut b) {
                Ok(()) => Some(b),
                Err(e) => {
                    io_err = Some(e);
                    None
                }
            }
        });
        if let Some(e) = io_err {
            return Err(e).ctx(&name);
        }
        let filter = filter.ok_or_else(|| corrupt(&name, "filter"))?;
        let mut db = vec![0u8; dir_len as usize];
        io.read_at(&name, filter_off + filter_len, &mut db)
            .ctx(&name)?;
        let (_, dbody) = open_blob(DIR_MAGIC, &db).ok_or_else(|| corrupt(&name, "directory"))?;
        let dir: Vec<u64> = dbody
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        if dir.len() as u64 != pages {
            return Err(corrupt(&name, "directory size"));
        }
        Ok(Run {
            id,
            name,
            entries,
            pages,
            dir,
            filter,
        })
    }

    /// Bytes of RAM held (filter and directory).
    pub fn ram_bytes(&self) -> usize {
        self.filter.bytes() + self.dir.len() * 8
    }

    /// The page that holds `key` if any page does (the last page whose
    /// first key is not above it; keys sharing their top half across a
    /// page boundary are handled by [`Run::find`]).
    pub fn page_of(&self, key: u128) -> Option<u64> {
        let hi = (key >> 64) as u64;
        let n = self.dir.partition_point(|&first| first <= hi);
        n.checked_sub(1).map(|p| p as u64)
    }

    /// Reads page `p` (one device read).
    pub fn read_page(&self, io: &dyn Io, p: u64) -> Result<Vec<Entry>> {
        let mut buf = vec![0u8; PAGE];
        io.read_at(&self.name, p * PAGE as u64, &mut buf)
            .ctx(&self.name)?;
        decode_sorted_page(&buf).ok_or_else(|| corrupt(&self.name, "page checksum"))
    }

    /// Finds `key` on disk: one page read (two in the astronomically rare
    /// case of a page boundary inside keys sharing their top 64 bits).
    /// Returns the entry and the number of reads made.
    pub fn find(&self, io: &dyn Io, key: u128) -> Result<(Option<Entry>, u32)> {
        let Some(mut p) = self.page_of(key) else {
            return Ok((None, 0));
        };
        let mut reads = 0;
        loop {
            let page = self.read_page(io, p)?;
            reads += 1;
            if let Ok(i) = page.binary_search_by_key(&key, |e| e.key) {
                return Ok((Some(page[i]), reads));
            }
            let hi = (key >> 64) as u64;
            if p == 0 || self.dir[p as usize] != hi || page.first().is_some_and(|e| e.key < key) {
                return Ok((None, reads));
            }
            p -= 1;
        }
    }

    /// Looks `key` up in an already read page.
    pub fn find_in(page: &[Entry], key: u128) -> Option<Entry> {
        page.binary_search_by_key(&key, |e| e.key)
            .ok()
            .map(|i| page[i])
    }

    /// Streams the run's entries in key order, reading `WRITE_BATCH` pages
    /// at a time.
    pub fn iter(run: &Arc<Run>, io: &Arc<dyn Io>) -> RunIter {
        RunIter {
            run: run.clone(),
            io: io.clone(),
            next_page: 0,
            buf: Vec::new(),
            at: 0,
        }
    }
}

pub struct RunIter {
    run: Arc<Run>,
    io: Arc<dyn Io>,
    next_page: u64,
    buf: Vec<Entry>,
    at: usize,
}

impl Iterator for RunIter {
    type Item = Result<Entry>;
    fn next(&mut self) -> Option<Result<Entry>> {
        while self.at == self.buf.len() {
            if self.next_page >= self.run.pages {
                return None;
            }
            let n = (self.run.pages - self.next_page).min(READ_BATCH as u64);
            let mut raw = vec![0u8; n as usize * PAGE];
            let name = &self.run.name;
            if let Err(e) = self
                .io
                .read_at(name, self.next_page * PAGE as u64, &mut raw)
                .ctx(name)
            {
                self.next_page = self.run.pages;
                return Some(Err(e));
            }
            self.next_page += n;
            self.buf.clear();
            self.at = 0;
            for page in raw.chunks_exact(PAGE) {
                match decode_sorted_page(page) {
                    Some(es) => self.buf.extend(es),
                    None => {
                        self.next_page = self.run.pages;
                        return Some(Err(corrupt(name, "page checksum")));
                    }
                }
            }
        }
        self.at += 1;
        Some(Ok(self.buf[self.at - 1]))
    }
}

/// Writes a run from entries in ascending key order.
pub struct RunWriter {
    io: Arc<dyn Io>,
    id: u64,
    name: String,
    page: Vec<Entry>,
    out: Vec<u8>,
    dir: Vec<u64>,
    filter: FilterBuilder,
    entries: u64,
    pages: u64,
}

impl RunWriter {
    /// A writer for at most `max_entries` entries (sizes the filter).
    /// A run of at most `max_entries`, its filter in partitions of about
    /// `part_keys` keys.
    pub fn new(io: Arc<dyn Io>, id: u64, max_entries: u64, part_keys: u64) -> Result<Self> {
        let name = run_name(id);
        io.remove(&name).ctx(&name)?;
        let filter = FilterBuilder::new(max_entries, part_keys).ctx(&name)?;
        Ok(RunWriter {
            io,
            id,
            name,
            page: Vec::with_capacity(PER_PAGE),
            out: Vec::new(),
            dir: Vec::new(),
            filter,
            entries: 0,
            pages: 0,
        })
    }

    pub fn push(&mut self, e: Entry) -> Result<()> {
        self.filter.push(e.key).ctx(&self.name)?;
        self.page.push(e);
        self.entries += 1;
        if self.page.len() == PER_PAGE {
            self.seal_page()?;
        }
        Ok(())
    }

    fn seal_page(&mut self) -> Result<()> {
        if self.page.is_empty() {
            return Ok(());
        }
        self.dir.push((self.page[0].key >> 64) as u64);
        self.out.extend_from_slice(&encode_sorted_page(&self.page));
        self.page.clear();
        self.pages += 1;
        if self.out.len() >= WRITE_BATCH * PAGE {
            self.io.append(&self.name, &self.out).ctx(&self.name)?;
            self.out.clear();
        }
        Ok(())
    }

    /// Writes the filter, directory and trailer, syncs, and opens the run.
    pub fn finish(mut self) -> Result<Run> {
        self.seal_page()?;
        let filter = self.filter.finish().ctx(&self.name)?;
        let fblob = filter.encode();
        let dbody: Vec<u8> = self.dir.iter().flat_map(|d| d.to_le_bytes()).collect();
        let dblob = seal_blob(DIR_MAGIC, RUN_VERSION, &dbody);
        let filter_off = self.pages * PAGE as u64;
        let mut body = Vec::new();
        for v in [
            self.entries,
            self.pages,
            filter_off,
            fblob.len() as u64,
            dblob.len() as u64,
        ] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        let mut trailer = seal_blob(TRAILER_MAGIC, RUN_VERSION, &body);
        let tail = (filter_off as usize + fblob.len() + dblob.len()) % PAGE;
        let pad = (PAGE - tail) % PAGE;
        self.out.extend_from_slice(&fblob);
        self.out.extend_from_slice(&dblob);
        self.out.resize(self.out.len() + pad, 0);
        trailer.resize(PAGE, 0);
        self.out.extend_from_slice(&trailer);
        self.io.append(&self.name, &self.out).ctx(&self.name)?;
        self.io.sync(&self.name).ctx(&self.name)?;
        Ok(Run {
            id: self.id,
            name: self.name,
            entries: self.entries,
            pages: self.pages,
            dir: self.dir,
            filter,
        })
    }
}
