//! The index: log + memtable in front of sealed runs, the locality cache,
//! and the operations the store and out-of-band dedupe need.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::bitmap::Bitmap;
use crate::bloom;
use crate::cache::Cache;
use crate::error::{corrupt, Ctx, Result};
use crate::filter::probe;
use crate::format::{
    decode_record, decode_segment_page, encode_record, encode_segment_page, Entry, Manifest, PAGE,
    PER_SEGMENT, RECORD,
};
use crate::io::{FsIo, Io};
use crate::run::{run_name, Run, RunWriter};
use crate::KeyMap;

pub(crate) const MANIFEST: &str = "MANIFEST";
const MANIFEST_TMP: &str = "MANIFEST.tmp";
pub(crate) const SEGMENTS: &str = "segments";
/// Size ratio under which two neighbouring runs are merged.
const MERGE_RATIO: u64 = 4;
/// Log bytes buffered before a write (a `commit` writes and syncs).
const LOG_BUFFER: usize = 1 << 20;

fn log_name(id: u64) -> String {
    format!("log-{id:016x}")
}

fn bitmap_name(id: u64) -> String {
    format!("live-{id:016x}")
}

/// How lookups are made (see [`crate::lazy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One lookup at a time (the seed's Algorithm 1).
    Eager,
    /// Batched lookups in hash buckets with a locality ring of `ring`
    /// fingerprints (Algorithm 2).
    Lazy { ring: usize },
    /// Measure the device at open and pick by the seed's model (section 4).
    Auto,
}

/// Tuning of an index.
#[derive(Debug, Clone)]
pub struct Config {
    /// Entries held in the memtable before it is sealed into a run (the
    /// memory cap of the mutable part: about 80 bytes each).
    pub memtable_entries: usize,
    /// Entries held by the locality cache (about 60 bytes each).
    pub cache_entries: usize,
    /// Quota: above this many live entries new fingerprints are not indexed.
    pub max_entries: Option<u64>,
    /// Read run and segment pages with `O_DIRECT` where the filesystem allows.
    pub direct_io: bool,
    /// Measure the time split filter / cache / disk (costs ~50 ns a lookup).
    pub timing: bool,
    /// Runs beyond which all are merged.
    pub max_runs: usize,
    /// Segment pages (170 entries each) loaded per disk hit; `None`: from
    /// the device's latency measured at open (1 on RAM-speed devices, up
    /// to 16 on a disk with milliseconds of latency).
    pub prefetch_pages: Option<u64>,
    pub mode: Mode,
    /// Keys per filter partition of a new run: a flush or merge holds one
    /// partition's keys while it builds its filter (about 40 B each).
    pub partition_keys: u64,
    /// Write the log. Without it nothing since the last flush survives a
    /// reopen: only for an index that is never reopened (a scratch one).
    pub log: bool,
    /// `None`: the two newest runs merge while the older is at most
    /// [`MERGE_RATIO`] times the newer (few runs; an entry is rewritten
    /// about 9 times over 120 flushes). `Some(t)`: tiered, the `t` newest
    /// runs merge once the oldest of them is at most twice the newest
    /// (about 3.5 rewrites over 120 flushes for t = 4, and up to t - 1
    /// runs left per size tier, 9 in all there): for an insert-heavy
    /// scratch index, with `max_runs` raised to match.
    pub merge_tier: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            memtable_entries: 1 << 20,
            cache_entries: 1 << 20,
            max_entries: None,
            direct_io: false,
            timing: false,
            max_runs: 8,
            prefetch_pages: None,
            mode: Mode::Auto,
            partition_keys: crate::filter::PARTITION_KEYS,
            log: true,
            merge_tier: None,
        }
    }
}

/// What [`Index::insert`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    New,
    /// Already indexed at this location (reference count unchanged).
    Exists(u64),
    /// Over quota: not indexed (counted in [`Stats::quota_skipped`]).
    NotIndexed,
}

/// Counters and the time split of lookups (like the seed's Table 4).
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub lookups: u64,
    pub memtable_hits: u64,
    pub filter_negatives: u64,
    pub cache_hits: u64,
    /// Lookups that reached the disk (missed memtable, filter and cache).
    pub disk_lookups: u64,
    pub disk_hits: u64,
    /// Run pages read to answer lookups.
    pub index_reads: u64,
    /// Segment pages read to fill the cache after a disk hit.
    pub prefetch_reads: u64,
    /// Segment loads skipped because recent ones were not used.
    pub prefetch_skipped: u64,
    /// Filter said maybe, the run did not have it.
    pub filter_false_positives: u64,
    pub quota_skipped: u64,
    pub flushes: u64,
    pub merges: u64,
    pub filter_ns: u64,
    pub cache_ns: u64,
    pub disk_ns: u64,
    /// Lazy mode: time spent in post-lookups of the locality ring.
    pub post_lookup_ns: u64,
    /// Lazy mode: batched disk reads (one per run region read).
    pub batch_reads: u64,
}

/// The fingerprint index. Not thread-safe; wrap it in a lock to share it.
pub struct Index {
    pub(crate) io: Arc<dyn Io>,
    pub(crate) cfg: Config,
    man: Manifest,
    pub(crate) runs: Vec<Arc<Run>>,
    pub(crate) mem: KeyMap<Entry>,
    /// Every key of `mem` (cleared with it): absent keys skip the map.
    mem_filter: bloom::Mutable,
    pub(crate) cache: Cache,
    live: Bitmap,
    log_buf: Vec<u8>,
    /// Bytes of the current log known to hold whole records.
    log_len: u64,
    /// An append to the log failed (it may have written part of its
    /// records): the log is cut back to `log_len` before the next append,
    /// so no torn record hides the ones after it from replay.
    log_torn: bool,
    /// Log bytes appended since its last successful sync. A failed sync
    /// may have dropped them (Linux marks the pages clean after a failed
    /// writeback, so a later sync succeeds without them): they are
    /// written again after the synced part before the next commit.
    unsynced: Vec<u8>,
    pub(crate) stats: Stats,
    /// Chosen by `Mode::Auto` at open (or the configured mode).
    pub(crate) mode: Mode,
    merge: Option<MergeJob>,
    window: HitWindow,
    /// The manifest as last written.
    durable: Manifest,
    /// Measured at open for `Mode::Auto`: device random read / RAM access.
    pub device_ns: f64,
    pub ram_ns: f64,
    /// Lazy mode: pages between two wanted pages read through in one read.
    pub coalesce_pages: u64,
    /// Segment pages loaded by one read after a disk hit (from
    /// `Config::prefetch_pages` or the device measured at open).
    pub prefetch_pages: u64,
}

/// Merges sorted entry streams (later streams newer), yielding the newest
/// version of each key.
fn merged<'a>(
    inputs: Vec<Box<dyn Iterator<Item = Result<Entry>> + Send + 'a>>,
) -> impl Iterator<Item = Result<Entry>> + Send + 'a {
    let mut inputs = inputs;
    let mut heap: BinaryHeap<Reverse<(u128, Reverse<usize>)>> = BinaryHeap::new();
    let mut heads: Vec<Option<Entry>> = vec![None; inputs.len()];
    let mut err = None;
    for (i, it) in inputs.iter_mut().enumerate() {
        match it.next() {
            Some(Ok(e)) => {
                heap.push(Reverse((e.key, Reverse(i))));
                heads[i] = Some(e);
            }
            Some(Err(e)) => err = Some(e),
            None => {}
        }
    }
    let mut last: Option<u128> = None;
    std::iter::from_fn(move || loop {
        if let Some(e) = err.take() {
            heap.clear();
            return Some(Err(e));
        }
        let Reverse((key, Reverse(i))) = heap.pop()?;
        let e = heads[i].take()?;
        match inputs[i].next() {
            Some(Ok(n)) => {
                heap.push(Reverse((n.key, Reverse(i))));
                heads[i] = Some(n);
            }
            Some(Err(x)) => err = Some(x),
            None => {}
        }
        if last == Some(key) {
            continue;
        }
        last = Some(key);
        // Ties pop the newest stream first (highest index).
        return Some(Ok(e));
    })
}

impl Index {
    /// Opens (or creates) the index in directory `dir`.
    pub fn open(dir: &Path, cfg: Config) -> Result<Index> {
        let io = FsIo::new(dir, cfg.direct_io).ctx(&dir.display().to_string())?;
        Self::open_with(Box::new(io), cfg)
    }

    /// Opens the index over any [`Io`] (tests inject latency and power loss).
    pub fn open_with(io: Box<dyn Io>, cfg: Config) -> Result<Index> {
        let io: Arc<dyn Io> = Arc::from(io);
        let man = match io.len(MANIFEST).ctx(MANIFEST)? {
            None => Manifest {
                generation: 1,
                log: 1,
                ..Default::default()
            },
            Some(_) => {
                let b = io.read_all(MANIFEST).ctx(MANIFEST)?;
                Manifest::decode(&b)
                    .ok_or_else(|| corrupt(MANIFEST, "manifest checksum or version"))?
            }
        };
        let fresh = io.len(MANIFEST).ctx(MANIFEST)?.is_none();
        let runs = man
            .runs
            .iter()
            .map(|&id| Run::open(io.as_ref(), id).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let live = match man.bitmap {
            0 => Bitmap::default(),
            id => {
                let name = bitmap_name(id);
                let b = io.read_all(&name).ctx(&name)?;
                Bitmap::decode(&b).ok_or_else(|| corrupt(&name, "bitmap checksum"))?
            }
        };
        let mut ix = Index {
            io,
            mode: cfg.mode,
            cache: Cache::new(cfg.cache_entries),
            mem_filter: bloom::Mutable::new(cfg.memtable_entries),
            cfg,
            man,
            runs,
            mem: KeyMap::default(),
            live,
            log_buf: Vec::new(),
            log_len: 0,
            log_torn: false,
            unsynced: Vec::new(),
            stats: Stats::default(),
            device_ns: 0.0,
            ram_ns: 0.0,
            coalesce_pages: 0,
            prefetch_pages: 1,
            merge: None,
            window: HitWindow::default(),
            durable: Manifest::default(),
        };
        ix.durable = ix.man.clone();
        ix.stats.quota_skipped = ix.man.quota_skipped;
        if fresh {
            ix.write_manifest(true)?;
        }
        ix.clean_orphans()?;
        ix.replay()?;
        crate::lazy::measure_device(&mut ix)?;
        if ix.cfg.mode == Mode::Auto {
            ix.mode = crate::lazy::choose_mode(&mut ix);
        }
        Ok(ix)
    }

    fn seg_base(&self) -> u64 {
        self.man.segment_pages * PER_SEGMENT as u64
    }

    /// Removes files a crash left behind and trims the segment file.
    fn clean_orphans(&mut self) -> Result<()> {
        let mut keep: Vec<String> = self.man.runs.iter().map(|&id| run_name(id)).collect();
        keep.push(log_name(self.man.log));
        keep.push(bitmap_name(self.man.bitmap));
        for name in self.io.list().ctx(".")? {
            let ours = ["run-", "log-", "live-"]
                .iter()
                .any(|p| name.starts_with(p))
                || name == MANIFEST_TMP;
            if ours && !keep.contains(&name) {
                self.io.remove(&name).ctx(&name)?;
            }
        }
        let want = self.man.segment_pages * PAGE as u64;
        match self.io.len(SEGMENTS).ctx(SEGMENTS)? {
            Some(len) if len > want => self.io.truncate(SEGMENTS, want).ctx(SEGMENTS)?,
            Some(len) if len < want => {
                return Err(corrupt(SEGMENTS, "shorter than the manifest says"))
            }
            None if want > 0 => return Err(corrupt(SEGMENTS, "missing")),
            _ => {}
        }
        Ok(())
    }

    /// Replays the log into the memtable; a torn or damaged tail (an
    /// uncommitted write) is cut off.
    fn replay(&mut self) -> Result<()> {
        let name = log_name(self.man.log);
        let data = match self.io.len(&name).ctx(&name)? {
            Some(_) => self.io.read_all(&name).ctx(&name)?,
            None => Vec::new(),
        };
        let mut off = 0;
        while let Some(e) = data.get(off..).and_then(decode_record) {
            self.apply(e);
            off += RECORD;
        }
        if off < data.len() {
            self.io.truncate(&name, off as u64).ctx(&name)?;
            self.io.sync(&name).ctx(&name)?;
        }
        self.log_len = off as u64;
        Ok(())
    }

    /// Applies one entry state to the memtable (live operation and replay).
    fn apply(&mut self, e: Entry) {
        if e.is_tombstone() {
            self.live.clear(e.seq);
            self.man.live = self.man.live.saturating_sub(1);
            self.cache.remove(e.key);
        } else if e.seq >= self.man.next_seq {
            self.man.next_seq = e.seq + 1;
            self.live.set(e.seq);
            self.man.live += 1;
        }
        self.mem_filter.insert(probe(e.key));
        self.mem.insert(e.key, e);
    }

    /// The memtable's entry of `key`: its filter first, the map only for
    /// keys it admits.
    #[inline]
    pub(crate) fn mem_get(&self, key: u128) -> Option<Entry> {
        if !self.mem_admits(key) {
            return None;
        }
        self.mem.get(&key).copied()
    }

    /// Whether the memtable may hold `key` (its filter admits it).
    #[inline]
    fn mem_admits(&self, key: u128) -> bool {
        !self.mem.is_empty() && self.mem_filter.contains(probe(key))
    }

    /// Logs and applies one entry state.
    fn put(&mut self, e: Entry) -> Result<()> {
        if self.cfg.log {
            self.log_buf.extend_from_slice(&encode_record(&e));
        }
        self.apply(e);
        if self.log_buf.len() >= LOG_BUFFER {
            self.write_log()?;
        }
        if let Some(pace) = self.merge.as_ref().map(|j| j.pace) {
            self.merge_step(pace)?;
        }
        if self.mem.len() >= self.cfg.memtable_entries {
            self.flush()?;
        }
        Ok(())
    }

    /// Appends the buffered records to the log. A failed append (`ENOSPC`
    /// half-way) keeps them buffered and marks the log torn; the next call
    /// first cuts the log back to its last whole record, so the records
    /// are written once, in order, right after the committed ones.
    fn write_log(&mut self) -> Result<()> {
        let name = log_name(self.man.log);
        if self.log_torn {
            self.io.truncate(&name, self.log_len).ctx(&name)?;
            self.log_torn = false;
        }
        if !self.log_buf.is_empty() {
            if let Err(e) = self.io.append(&name, &self.log_buf) {
                self.log_torn = true;
                return Err(e).ctx(&name);
            }
            self.log_len += self.log_buf.len() as u64;
            self.unsynced.append(&mut self.log_buf);
        }
        Ok(())
    }

    /// Makes every operation so far durable (writes and syncs the log).
    /// A failed sync puts the records since the last good one back in
    /// the buffer and cuts the log back to it at the next write.
    pub fn commit(&mut self) -> Result<()> {
        self.write_log()?;
        let name = log_name(self.man.log);
        self.io.append(&name, &[]).ctx(&name)?;
        if let Err(e) = self.io.sync(&name) {
            self.log_len -= self.unsynced.len() as u64;
            let mut again = std::mem::take(&mut self.unsynced);
            again.append(&mut self.log_buf);
            self.log_buf = again;
            self.log_torn = true;
            return Err(e).ctx(&name);
        }
        self.unsynced.clear();
        Ok(())
    }

    /// Live entries.
    pub fn len(&self) -> u64 {
        self.man.live
    }

    pub fn is_empty(&self) -> bool {
        self.man.live == 0
    }

    pub fn stats(&self) -> Stats {
        self.stats.clone()
    }

    pub fn reset_stats(&mut self) {
        let q = self.stats.quota_skipped;
        self.stats = Stats {
            quota_skipped: q,
            ..Default::default()
        };
    }

    /// The lookup mode in force (what `Auto` chose).
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Bytes of RAM of the filters, directories and liveness bitmap (the
    /// per-entry cost; the memtable and cache are bounded separately).
    pub fn ram_bytes(&self) -> usize {
        self.runs.iter().map(|r| r.ram_bytes()).sum::<usize>() + self.live.bytes()
    }

    /// Entries held by the locality cache now.
    pub fn cache_len(&self) -> usize {
        self.cache.len()
    }

    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Drops the locality cache (benchmarks start cold with it).
    pub fn clear_cache(&mut self) {
        self.cache.clear();
    }

    /// Indexes `key` at `loc` with one reference, unless it is known.
    pub fn insert(&mut self, key: u128, loc: u64, born: u32) -> Result<Inserted> {
        // The check is not counted as a caller's lookup.
        let saved = self.stats.clone();
        let known = self.lookup(key);
        self.stats = saved;
        if let Some(l) = known? {
            return Ok(Inserted::Exists(l));
        }
        if self.cfg.max_entries.is_some_and(|m| self.man.live >= m) {
            self.stats.quota_skipped += 1;
            self.man.quota_skipped += 1;
            return Ok(Inserted::NotIndexed);
        }
        let e = Entry {
            key,
            loc,
            refs: 1,
            born,
            seq: self.man.next_seq,
        };
        self.put(e)?;
        Ok(Inserted::New)
    }

    /// The full entry of `key` (memtable, then runs newest first).
    pub fn get(&mut self, key: u128) -> Result<Option<Entry>> {
        if let Some(e) = self.mem_get(key) {
            return Ok((!e.is_tombstone()).then_some(e));
        }
        for r in self.runs.iter().rev() {
            if !r.filter.contains(key) {
                continue;
            }
            let (e, reads) = r.find(self.io.as_ref(), key)?;
            self.stats.index_reads += reads as u64;
            if let Some(e) = e {
                return Ok((!e.is_tombstone()).then_some(e));
            }
        }
        Ok(None)
    }

    /// Eager lookup (Algorithm 1): memtable, filters, cache, then at most
    /// one run page read; a disk hit loads its segment into the cache.
    ///
    /// The common answer, "certainly new", is decided inline in a few
    /// dozen instructions (no run's filter nor the memtable's admits the
    /// key): a negative lookup waits on one cache miss, and the fewer
    /// instructions it takes the more of them the CPU overlaps.
    #[inline]
    pub fn lookup(&mut self, key: u128) -> Result<Option<u64>> {
        if self.window.cache_first || self.cfg.timing {
            return self.lookup_probed(key, None);
        }
        let in_runs = self.runs.iter().any(|r| r.filter.contains(key));
        if in_runs || self.mem_admits(key) {
            return self.lookup_probed(key, Some(in_runs));
        }
        self.stats.lookups += 1;
        self.stats.filter_negatives += 1;
        self.window.note(false);
        Ok(None)
    }

    /// Eager lookups of many keys, answering exactly as [`Index::lookup`]
    /// one at a time. The filters (and the memtable's) are probed for the
    /// whole batch first, run by run, each key's filter block prefetched a
    /// few dozen keys ahead so that the cache misses overlap (a probe is
    /// bound by memory latency, not by the CPU); a key that no filter
    /// admits is answered at once, the others go the way of `lookup`.
    pub fn lookup_many(&mut self, keys: &[u128]) -> Result<Vec<Option<u64>>> {
        let t = self.cfg.timing.then(Instant::now);
        let mut maybe = vec![false; keys.len()];
        for r in &self.runs {
            r.filter.contains_many(keys, &mut maybe);
        }
        let in_mem = self.mem_filter_many(keys);
        self.lap(t, |s| &mut s.filter_ns);
        let mut out = Vec::with_capacity(keys.len());
        for (i, &key) in keys.iter().enumerate() {
            if maybe[i] || in_mem.get(i).copied().unwrap_or(false) {
                out.push(self.lookup_probed(key, Some(maybe[i]))?);
            } else {
                // In no run and not in the memtable, hence not in the
                // cache either (it holds only live entries of runs).
                self.stats.lookups += 1;
                self.stats.filter_negatives += 1;
                self.window.note(false);
                out.push(None);
            }
        }
        Ok(out)
    }

    /// Which of `keys` the memtable's filter admits (empty: none, the
    /// memtable being empty), blocks prefetched ahead.
    fn mem_filter_many(&self, keys: &[u128]) -> Vec<bool> {
        if self.mem.is_empty() {
            return Vec::new();
        }
        let f = &self.mem_filter;
        let mut out = Vec::with_capacity(keys.len());
        for (i, &key) in keys.iter().enumerate() {
            if let Some(&next) = keys.get(i + bloom::PREFETCH_AHEAD) {
                f.prefetch(probe(next));
            }
            out.push(f.contains(probe(key)));
        }
        out
    }

    /// [`Index::lookup`] with the filters' answer known (`Some`) or not.
    /// While most recent lookups are cache hits (a duplicate stream), the
    /// cache is asked before the filters: one memory access instead of a
    /// filter probe per run.
    #[inline(never)]
    fn lookup_probed(&mut self, key: u128, probed: Option<bool>) -> Result<Option<u64>> {
        self.stats.lookups += 1;
        if probed.is_none() && !self.window.cache_first {
            // The runs' Bloom blocks load while the memtable and the cache
            // are asked, and all runs' at once instead of one after another
            // (not in a duplicate stream, which the cache answers).
            for r in &self.runs {
                r.filter.prefetch(key);
            }
        }
        if let Some(e) = self.mem_get(key) {
            self.stats.memtable_hits += 1;
            return Ok((!e.is_tombstone()).then_some(e.loc));
        }
        let t = self.cfg.timing.then(Instant::now);
        let cache_first = self.window.cache_first;
        let hit = if cache_first {
            self.cache.get(key)
        } else {
            None
        };
        let t = self.lap(t, |s| &mut s.cache_ns);
        if hit.is_some() {
            self.window.note(true);
            self.stats.cache_hits += 1;
            return Ok(hit);
        }
        let maybe = probed.unwrap_or_else(|| self.runs.iter().any(|r| r.filter.contains(key)));
        let t = self.lap(t, |s| &mut s.filter_ns);
        if !maybe {
            self.window.note(false);
            self.stats.filter_negatives += 1;
            return Ok(None);
        }
        let hit = if cache_first {
            None
        } else {
            self.cache.get(key)
        };
        let t = self.lap(t, |s| &mut s.cache_ns);
        self.window.note(hit.is_some());
        if hit.is_some() {
            self.stats.cache_hits += 1;
            return Ok(hit);
        }
        let found = self.disk_lookup(key)?;
        self.lap(t, |s| &mut s.disk_ns);
        Ok(found)
    }

    /// Adds the time since `t` to a stat; returns now.
    pub(crate) fn lap(
        &mut self,
        t: Option<Instant>,
        f: impl Fn(&mut Stats) -> &mut u64,
    ) -> Option<Instant> {
        let t = t?;
        let now = Instant::now();
        *f(&mut self.stats) += (now - t).as_nanos() as u64;
        Some(now)
    }

    /// Looks `key` up in the runs (newest first) and prefetches its
    /// segment on a hit.
    fn disk_lookup(&mut self, key: u128) -> Result<Option<u64>> {
        self.stats.disk_lookups += 1;
        let sim0 = self.io.simulated_ns();
        let mut found = None;
        for i in (0..self.runs.len()).rev() {
            if !self.runs[i].filter.contains(key) {
                continue;
            }
            let (e, reads) = self.runs[i].find(self.io.as_ref(), key)?;
            self.stats.index_reads += reads as u64;
            match e {
                Some(e) => {
                    found = Some(e);
                    break;
                }
                None => self.stats.filter_false_positives += 1,
            }
        }
        let out = match found {
            Some(e) if !e.is_tombstone() => {
                self.stats.disk_hits += 1;
                self.prefetch(e.seq)?;
                Some(e.loc)
            }
            _ => None,
        };
        self.stats.disk_ns += self.io.simulated_ns() - sim0;
        Ok(out)
    }

    /// Loads the segment page holding sequence number `seq` into the cache
    /// (its entries still live), unless cached or not yet flushed.
    pub(crate) fn prefetch(&mut self, seq: u64) -> Result<()> {
        let group = seq / PER_SEGMENT as u64;
        if seq >= self.seg_base() || self.cache.has_group(group) || self.cfg.cache_entries == 0 {
            return Ok(());
        }
        // Random lookups gain nothing from neighbours: then load only one
        // group in 32, enough to notice when locality comes back.
        if self.cache.locality_poor() && !self.stats.disk_hits.is_multiple_of(32) {
            self.stats.prefetch_skipped += 1;
            return Ok(());
        }
        // One read of the aligned window of `prefetch_pages` segment pages
        // around the hit: on a slow device a few more pages cost about
        // nothing next to the access itself.
        let k = self.prefetch_pages.max(1);
        let start = group - group % k;
        let end = (start + k).min(self.man.segment_pages);
        let mut buf = vec![0u8; ((end - start) as usize) * PAGE];
        self.io
            .read_at(SEGMENTS, start * PAGE as u64, &mut buf)
            .ctx(SEGMENTS)?;
        self.stats.prefetch_reads += 1;
        self.cache.note_read();
        for (i, page) in buf.chunks_exact(PAGE).enumerate() {
            let g = start + i as u64;
            if g != group && self.cache.has_group(g) {
                continue;
            }
            // A damaged page only costs its prefetch (fsck's `verify`
            // reports it); the lookup itself was answered by the run.
            let Some(slots) = decode_segment_page(page) else {
                self.stats.prefetch_skipped += 1;
                continue;
            };
            let base = g * PER_SEGMENT as u64;
            let live = &self.live;
            let entries: Vec<(u128, u64)> = slots
                .into_iter()
                .enumerate()
                .filter(|(i, _)| live.get(base + *i as u64))
                .map(|(_, s)| s)
                .collect();
            self.cache.insert_group(g, entries);
        }
        Ok(())
    }

    /// Adds a reference; returns the new count (`None`: not indexed).
    pub fn incref(&mut self, key: u128) -> Result<Option<u32>> {
        let Some(mut e) = self.get(key)? else {
            return Ok(None);
        };
        e.refs = e.refs.saturating_add(1);
        self.put(e)?;
        Ok(Some(e.refs))
    }

    /// Drops a reference; at zero the entry is deleted. Returns the new count.
    pub fn decref(&mut self, key: u128) -> Result<Option<u32>> {
        let Some(mut e) = self.get(key)? else {
            return Ok(None);
        };
        if e.refs <= 1 {
            self.delete_entry(e)?;
            return Ok(Some(0));
        }
        e.refs -= 1;
        self.put(e)?;
        Ok(Some(e.refs))
    }

    /// Deletes `key` whatever its count; false if it was not indexed.
    pub fn delete(&mut self, key: u128) -> Result<bool> {
        let Some(e) = self.get(key)? else {
            return Ok(false);
        };
        self.delete_entry(e)?;
        Ok(true)
    }

    fn delete_entry(&mut self, e: Entry) -> Result<()> {
        self.put(Entry { refs: 0, ..e })
    }

    /// Deletes every entry referenced once and inserted before `older_than`
    /// (ZFS `ddtprune`); returns how many. Durable when it returns.
    pub fn prune(&mut self, older_than: u32) -> Result<u64> {
        let victims = self.prune_candidates(older_than)?;
        for &e in &victims {
            self.delete_entry(e)?;
        }
        self.commit()?;
        Ok(victims.len() as u64)
    }

    /// What [`Index::prune`] would delete: the live entries referenced
    /// once and inserted before `older_than`. A caller that keeps its own
    /// record of what is indexed (the store) marks them there durably
    /// first, then deletes them, so a crash in between leaves nothing
    /// unaccounted for.
    pub fn prune_candidates(&self, older_than: u32) -> Result<Vec<Entry>> {
        self.entries()
            .filter(|e| {
                e.as_ref().map_or(true, |e| {
                    !e.is_tombstone() && e.refs == 1 && e.born < older_than
                })
            })
            .collect()
    }

    /// Every entry's newest state (tombstones included), in key order.
    /// Checks every segment page's checksum (runs are checked by
    /// [`Index::scan`], the manifest, bitmap and filters at open).
    pub fn verify(&self) -> Result<()> {
        let n = self.man.segment_pages as usize;
        if n == 0 {
            return Ok(());
        }
        let mut buf = vec![0u8; n * PAGE];
        self.io.read_at(SEGMENTS, 0, &mut buf).ctx(SEGMENTS)?;
        for page in buf.chunks_exact(PAGE) {
            decode_segment_page(page).ok_or_else(|| corrupt(SEGMENTS, "page checksum"))?;
        }
        Ok(())
    }

    /// Every entry's newest state (tombstones included) in key order, all
    /// of them in a Vec: for tests and small indexes; see [`Index::entries`].
    pub fn scan(&self) -> Result<Vec<Entry>> {
        self.entries().collect()
    }

    /// Every entry's newest state (tombstones included) in key order,
    /// streamed: RAM for a page batch per run and a sorted copy of the
    /// memtable, whatever the index's size.
    pub fn entries(&self) -> impl Iterator<Item = Result<Entry>> + Send + 'static {
        let mut mem: Vec<Entry> = self.mem.values().copied().collect();
        mem.sort_unstable_by_key(|e| e.key);
        let mut inputs: Vec<Box<dyn Iterator<Item = Result<Entry>> + Send>> = Vec::new();
        for r in &self.runs {
            inputs.push(Box::new(Run::iter(r, &self.io)));
        }
        inputs.push(Box::new(mem.into_iter().map(Ok)));
        merged(inputs)
    }

    /// Seals the memtable into a new run, its new inserts into segment
    /// pages, and switches the manifest atomically.
    /// A failure leaves the index as it was (the memtable and its log
    /// stay; the files written are orphans, removed at the next open).
    pub fn flush(&mut self) -> Result<()> {
        if self.mem.is_empty() {
            return Ok(());
        }
        let before = (self.man.clone(), self.durable.clone());
        if let Err(e) = self.seal_memtable() {
            let generation = self.man.generation;
            (self.man, self.durable) = before;
            // Ids handed out stay used: a retry never reuses a file name.
            self.man.generation = generation;
            return Err(e);
        }
        self.mem.clear();
        self.mem_filter.clear();
        self.log_buf.clear();
        self.log_len = 0;
        self.log_torn = false;
        self.unsynced.clear();
        self.stats.flushes += 1;
        self.maybe_merge()
    }

    /// The fallible part of [`Index::flush`]: writes the run, segment
    /// pages, bitmap, a new empty log and the manifest naming them.
    fn seal_memtable(&mut self) -> Result<()> {
        let mut es: Vec<Entry> = self.mem.values().copied().collect();
        es.sort_unstable_by_key(|e| e.key);
        let run_id = self.next_id();
        let mut w = RunWriter::new(
            self.io.clone(),
            run_id,
            es.len() as u64,
            self.cfg.partition_keys,
        )?;
        for &e in &es {
            w.push(e)?;
        }
        let run = w.finish()?;
        let pages = self.write_segments(&es)?;
        let bitmap_id = self.next_id();
        let bname = bitmap_name(bitmap_id);
        self.io.remove(&bname).ctx(&bname)?;
        self.io.append(&bname, &self.live.encode()).ctx(&bname)?;
        self.io.sync(&bname).ctx(&bname)?;
        let log_id = self.next_id();
        let lname = log_name(log_id);
        self.io.remove(&lname).ctx(&lname)?;
        self.io.append(&lname, &[]).ctx(&lname)?;
        self.io.sync(&lname).ctx(&lname)?;
        let old = self.man.clone();
        self.man.runs.push(run_id);
        self.man.bitmap = bitmap_id;
        self.man.log = log_id;
        self.man.segment_pages += pages;
        self.man.next_seq = self.man.segment_pages * PER_SEGMENT as u64;
        self.write_manifest(true)?;
        self.runs.push(Arc::new(run));
        for name in [log_name(old.log), bitmap_name(old.bitmap)] {
            // The manifest no longer names them: a failure leaves an orphan.
            let _ = self.io.remove(&name);
        }
        Ok(())
    }

    fn next_id(&mut self) -> u64 {
        self.man.generation += 1;
        self.man.generation
    }

    /// Appends segment pages for the inserts since the last flush, in
    /// insertion order; returns how many pages.
    fn write_segments(&mut self, es: &[Entry]) -> Result<u64> {
        let base = self.seg_base();
        let n = self.man.next_seq.saturating_sub(base);
        let pages = n.div_ceil(PER_SEGMENT as u64);
        if pages == 0 {
            return Ok(0);
        }
        let mut slots: Vec<Option<(u128, u64)>> = vec![None; (pages as usize) * PER_SEGMENT];
        for e in es.iter().filter(|e| e.seq >= base && !e.is_tombstone()) {
            slots[(e.seq - base) as usize] = Some((e.key, e.loc));
        }
        let mut out = Vec::with_capacity(pages as usize * PAGE);
        for chunk in slots.chunks(PER_SEGMENT) {
            out.extend_from_slice(&encode_segment_page(chunk));
        }
        // Pages a crash left past the manifest's end were trimmed at open;
        // those of a failed flush (a torn append) are cut off here.
        let want = base / PER_SEGMENT as u64 * PAGE as u64;
        if self
            .io
            .len(SEGMENTS)
            .ctx(SEGMENTS)?
            .is_some_and(|l| l != want)
        {
            self.io.truncate(SEGMENTS, want).ctx(SEGMENTS)?;
        }
        self.io.append(SEGMENTS, &out).ctx(SEGMENTS)?;
        self.io.sync(SEGMENTS).ctx(SEGMENTS)?;
        Ok(pages)
    }

    /// Writes the manifest. `all`: the whole state (at a flush, when the
    /// memtable is in runs); otherwise only the run list and id counter
    /// change from the last one written, since the counters of operations
    /// still in the log must come from replaying it.
    fn write_manifest(&mut self, all: bool) -> Result<()> {
        self.man.quota_skipped = self.stats.quota_skipped.max(self.man.quota_skipped);
        if all {
            self.durable = self.man.clone();
        } else {
            self.durable.runs = self.man.runs.clone();
            self.durable.generation = self.man.generation;
        }
        self.io.remove(MANIFEST_TMP).ctx(MANIFEST_TMP)?;
        self.io
            .append(MANIFEST_TMP, &self.durable.encode())
            .ctx(MANIFEST_TMP)?;
        self.io.sync(MANIFEST_TMP).ctx(MANIFEST_TMP)?;
        self.io.rename(MANIFEST_TMP, MANIFEST).ctx(MANIFEST)
    }

    /// Size-tiered merging: the two newest runs merge while the older is
    /// at most [`MERGE_RATIO`] times the newer (O(log n) runs, few of
    /// them: every run costs a filter probe per negative lookup), or with
    /// [`Config::merge_tier`] the `t` newest once the oldest of them is at
    /// most twice the newest; all merge beyond `max_runs`. Starts a paced
    /// merge; does not wait for it.
    fn maybe_merge(&mut self) -> Result<()> {
        if self.merge.is_some() {
            return Ok(());
        }
        let n = self.runs.len();
        if n < 2 {
            return Ok(());
        }
        if n > self.cfg.max_runs {
            return self.start_merge(0, n);
        }
        let (count, ratio) = match self.cfg.merge_tier {
            Some(t) if t >= 2 => (t, 2),
            _ => (2, MERGE_RATIO),
        };
        if n >= count && self.runs[n - count].entries <= ratio * self.runs[n - 1].entries {
            self.start_merge(n - count, count)
        } else {
            Ok(())
        }
    }

    /// Starts merging runs `from..from + count` into one (streaming: a page
    /// batch per input and one filter partition in RAM); tombstones are
    /// dropped when the oldest run is included. The work is done
    /// [`Index::merge_step`] by step, paced by the operations.
    fn start_merge(&mut self, from: usize, count: usize) -> Result<()> {
        let inputs_runs = &self.runs[from..from + count];
        let total: u64 = inputs_runs.iter().map(|r| r.entries).sum();
        let inputs: Vec<Box<dyn Iterator<Item = Result<Entry>> + Send>> = inputs_runs
            .iter()
            .map(|r| {
                Box::new(Run::iter(r, &self.io)) as Box<dyn Iterator<Item = Result<Entry>> + Send>
            })
            .collect();
        let id = self.next_id();
        let writer = RunWriter::new(self.io.clone(), id, total, self.cfg.partition_keys)?;
        // Finish within half a memtable's worth of operations.
        let pace = (2 * total).div_ceil(self.cfg.memtable_entries.max(1) as u64) as usize + 16;
        self.merge = Some(MergeJob {
            from,
            count,
            bottom: from == 0,
            inputs: Box::new(merged(inputs)),
            writer,
            pace,
        });
        Ok(())
    }

    /// Advances the merge in progress by up to `budget` entries; switches
    /// the manifest when it is done.
    /// A failure abandons the merge (its partial run is an orphan, removed
    /// at the next open); the runs stay as they were and a later flush
    /// starts it again.
    pub fn merge_step(&mut self, budget: usize) -> Result<()> {
        let r = self.merge_step_inner(budget);
        if r.is_err() {
            self.merge = None;
        }
        r
    }

    fn merge_step_inner(&mut self, budget: usize) -> Result<()> {
        let Some(job) = self.merge.as_mut() else {
            return Ok(());
        };
        for _ in 0..budget {
            match job.inputs.next() {
                Some(e) => {
                    let e = e?;
                    if !(job.bottom && e.is_tombstone()) {
                        job.writer.push(e)?;
                    }
                }
                None => return self.finish_merge(),
            }
        }
        Ok(())
    }

    /// Merges every run into one (after a bulk load: a negative lookup then
    /// probes a single filter). Waits for it.
    pub fn compact(&mut self) -> Result<()> {
        self.finish_merges()?;
        if self.runs.len() > 1 {
            self.start_merge(0, self.runs.len())?;
        }
        self.finish_merges()
    }

    /// Completes the merges in progress and any they lead to.
    pub fn finish_merges(&mut self) -> Result<()> {
        while self.merge.is_some() {
            self.merge_step(usize::MAX)?;
        }
        Ok(())
    }

    fn finish_merge(&mut self) -> Result<()> {
        let Some(job) = self.merge.take() else {
            return Ok(());
        };
        let run = job.writer.finish()?;
        let old: Vec<u64> = self
            .man
            .runs
            .splice(job.from..job.from + job.count, [run.id])
            .collect();
        if let Err(e) = self.write_manifest(false) {
            self.man
                .runs
                .splice(job.from..job.from + 1, old.iter().copied());
            return Err(e);
        }
        self.runs
            .splice(job.from..job.from + job.count, [Arc::new(run)]);
        self.stats.merges += 1;
        for r in old {
            let name = run_name(r);
            self.io.remove(&name).ctx(&name)?;
        }
        self.maybe_merge()
    }
}

/// Cache hits among the last lookups that passed the memtable, by windows
/// of 1024: decides whether the cache is asked before the filters.
#[derive(Default)]
struct HitWindow {
    lookups: u32,
    hits: u32,
    cache_first: bool,
}

impl HitWindow {
    fn note(&mut self, hit: bool) {
        self.lookups += 1;
        self.hits += hit as u32;
        if self.lookups == 1024 {
            self.cache_first = self.hits * 2 > self.lookups;
            self.lookups = 0;
            self.hits = 0;
        }
    }
}

/// A merge in progress: its output run is invisible until the manifest
/// names it; a crash leaves an orphan file that open deletes.
pub(crate) struct MergeJob {
    from: usize,
    count: usize,
    bottom: bool,
    inputs: Box<dyn Iterator<Item = Result<Entry>> + Send>,
    writer: RunWriter,
    /// Entries merged per operation.
    pace: usize,
}
