//! Lazy lookup (the seed's Algorithm 2, after "Lazy exact deduplication")
//! and the auto mode (its section 4 model).
//!
//! Lazy: a fingerprint that passes the filter and misses the cache
//! ("pre-lookup") waits in a hash bucket (by key range, hence by run page
//! region) and joins the current locality ring. A bucket that reaches
//! [`BUCKET_THRESHOLD`] is looked up as a batch: the pages its members need
//! are read with adjacent pages coalesced into one read (up to
//! `coalesce_pages` apart). Each hit loads its segment into the cache, and
//! the pending members of its ring are looked up in the cache again
//! ("post-lookup"), which resolves most of them without a disk read.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use crate::error::{corrupt, Ctx, Result};
use crate::format::{decode_sorted_page, Entry, PAGE};
use crate::index::{Index, Mode};
use crate::run::Run;

/// Members of a bucket that trigger its batch lookup.
pub const BUCKET_THRESHOLD: usize = 16;
/// Buckets (by the key's top bits).
const BUCKET_BITS: u32 = 10;
/// Largest coalesced read, in pages.
const MAX_READ_PAGES: u64 = 256;

struct Pending {
    ring: usize,
    done: bool,
}

struct Batch<'k> {
    keys: &'k [u128],
    /// Whether some run's filter admits each key (probed for the whole
    /// batch at once, prefetching: see `RunFilter::contains_many`).
    maybe: Vec<bool>,
    out: Vec<Option<u64>>,
    pending: HashMap<usize, Pending>,
    rings: Vec<Vec<usize>>,
    buckets: HashMap<usize, Vec<usize>>,
    ring_size: usize,
}

impl Index {
    /// Looks up many fingerprints in stream order with the index's mode
    /// (`Auto` resolved at open).
    pub fn lookup_batch(&mut self, keys: &[u128]) -> Result<Vec<Option<u64>>> {
        self.lookup_batch_with(keys, self.mode)
    }

    /// Looks up many fingerprints with the given mode.
    pub fn lookup_batch_with(&mut self, keys: &[u128], mode: Mode) -> Result<Vec<Option<u64>>> {
        let ring = match mode {
            Mode::Lazy { ring } => ring.max(1),
            Mode::Eager | Mode::Auto => return self.lookup_many(keys),
        };
        let t = self.cfg.timing.then(Instant::now);
        let mut maybe = vec![false; keys.len()];
        for r in &self.runs {
            r.filter.contains_many(keys, &mut maybe);
        }
        self.lap(t, |s| &mut s.filter_ns);
        let mut b = Batch {
            keys,
            maybe,
            out: vec![None; keys.len()],
            pending: HashMap::new(),
            rings: vec![Vec::new()],
            buckets: HashMap::new(),
            ring_size: ring,
        };
        for rank in 0..keys.len() {
            if let Some(bucket) = self.lazy_front(&mut b, rank)? {
                if b.buckets.get(&bucket).map_or(0, Vec::len) >= BUCKET_THRESHOLD {
                    self.flush_bucket(&mut b, bucket)?;
                }
            }
        }
        let left: Vec<usize> = b.buckets.keys().copied().collect();
        for bucket in left {
            self.flush_bucket(&mut b, bucket)?;
        }
        Ok(b.out)
    }

    /// Memtable, filter and pre-lookup; returns the bucket the key waits
    /// in if it must go to disk.
    fn lazy_front(&mut self, b: &mut Batch, rank: usize) -> Result<Option<usize>> {
        let key = b.keys[rank];
        self.stats.lookups += 1;
        if let Some(e) = self.mem_get(key) {
            self.stats.memtable_hits += 1;
            b.out[rank] = (!e.is_tombstone()).then_some(e.loc);
            return Ok(None);
        }
        let t = self.cfg.timing.then(Instant::now);
        if !b.maybe[rank] {
            self.stats.filter_negatives += 1;
            return Ok(None);
        }
        let hit = self.cache.get(key);
        self.lap(t, |s| &mut s.cache_ns);
        if hit.is_some() {
            self.stats.cache_hits += 1;
            b.out[rank] = hit;
            return Ok(None);
        }
        if b.rings.last().is_some_and(|r| r.len() >= b.ring_size) {
            b.rings.push(Vec::new());
        }
        let ring = b.rings.len() - 1;
        b.rings[ring].push(rank);
        b.pending.insert(rank, Pending { ring, done: false });
        let bucket = ((key >> 64) as u64 >> (64 - BUCKET_BITS)) as usize;
        b.buckets.entry(bucket).or_default().push(rank);
        Ok(Some(bucket))
    }

    /// Batch lookup of one bucket, then post-lookups of the rings of hits.
    fn flush_bucket(&mut self, b: &mut Batch, bucket: usize) -> Result<()> {
        let members: Vec<usize> = b
            .buckets
            .remove(&bucket)
            .unwrap_or_default()
            .into_iter()
            .filter(|r| b.pending.get(r).is_some_and(|p| !p.done))
            .collect();
        if members.is_empty() {
            return Ok(());
        }
        let t = self.cfg.timing.then(Instant::now);
        let sim0 = self.io.simulated_ns();
        self.stats.disk_lookups += members.len() as u64;
        let found = self.batch_read(b.keys, &members)?;
        let mut hits = Vec::new();
        for (rank, e) in members.iter().copied().zip(found) {
            if let Some(p) = b.pending.get_mut(&rank) {
                p.done = true;
            }
            let e = match e {
                Some(e) => Some(e),
                // Filter false positive in the newest candidate run, or
                // older runs to try: the exact path.
                None => self.get(b.keys[rank])?,
            };
            if let Some(e) = e.filter(|e| !e.is_tombstone()) {
                self.stats.disk_hits += 1;
                b.out[rank] = Some(e.loc);
                self.prefetch(e.seq)?;
                hits.push(rank);
            }
        }
        self.stats.disk_ns += self.io.simulated_ns() - sim0;
        let t = self.lap(t, |s| &mut s.disk_ns);
        for rank in hits {
            self.post_lookup(b, rank);
        }
        self.lap(t, |s| &mut s.post_lookup_ns);
        Ok(())
    }

    /// Resolves from the cache the still pending members of `rank`'s ring.
    fn post_lookup(&mut self, b: &mut Batch, rank: usize) {
        let Some(ring) = b.pending.get(&rank).map(|p| p.ring) else {
            return;
        };
        for &r in &b.rings[ring] {
            let Some(p) = b.pending.get_mut(&r) else {
                continue;
            };
            if p.done {
                continue;
            }
            if let Some(loc) = self.cache.get(b.keys[r]) {
                p.done = true;
                b.out[r] = Some(loc);
                self.stats.cache_hits += 1;
            }
        }
    }

    /// Reads, for each member, the page of the newest run whose filter
    /// admits it, coalescing nearby pages into one read; returns the entry
    /// found in that page (`None`: not there, caller retries exactly).
    fn batch_read(&mut self, keys: &[u128], members: &[usize]) -> Result<Vec<Option<Entry>>> {
        let mut want: BTreeMap<(usize, u64), Vec<usize>> = BTreeMap::new();
        let mut out = vec![None; members.len()];
        for (i, &rank) in members.iter().enumerate() {
            let key = keys[rank];
            let run = (0..self.runs.len())
                .rev()
                .find(|&r| self.runs[r].filter.contains(key));
            if let Some(page) = run.and_then(|r| self.runs[r].page_of(key).map(|p| (r, p))) {
                want.entry(page).or_default().push(i);
            }
        }
        let pages: Vec<(usize, u64)> = want.keys().copied().collect();
        let mut i = 0;
        while i < pages.len() {
            let (run, first) = pages[i];
            let mut j = i;
            while j + 1 < pages.len()
                && pages[j + 1].0 == run
                && pages[j + 1].1 - pages[j].1 <= self.coalesce_pages + 1
                && pages[j + 1].1 - first < MAX_READ_PAGES
            {
                j += 1;
            }
            let last = pages[j].1;
            let r: &Run = &self.runs[run];
            let mut buf = vec![0u8; ((last - first + 1) as usize) * PAGE];
            self.io
                .read_at(&r.name, first * PAGE as u64, &mut buf)
                .ctx(&r.name)?;
            self.stats.batch_reads += 1;
            self.stats.index_reads += 1;
            for &(_, p) in &pages[i..=j] {
                let at = ((p - first) as usize) * PAGE;
                let page = decode_sorted_page(&buf[at..at + PAGE])
                    .ok_or_else(|| corrupt(&r.name, "page checksum"))?;
                for &m in &want[&(run, p)] {
                    out[m] = Run::find_in(&page, keys[members[m]]);
                }
            }
            i = j + 1;
        }
        Ok(out)
    }
}

/// Picks the mode by the seed's model from the device and RAM latencies
/// (RAM measured here): lazy when their ratio exceeds [`LAZY_RATIO`], with
/// the ring size fitted to the seed's Table 5 (512 on HDD, 64 on Optane).
pub(crate) fn choose_mode(ix: &mut Index) -> Mode {
    measure_ram(ix);
    mode_for_ratio(ix.device_ns / ix.ram_ns.max(1.0))
}

/// Device/RAM latency ratio above which lazy lookup wins: the right-hand
/// side of the seed's inequality (8) for a backup stream (the seed found
/// 554 on its trace; ours is measured by `bench/fpindex.sh`).
pub const LAZY_RATIO: f64 = 554.0;

/// The mode the model picks for a device/RAM latency ratio.
pub fn mode_for_ratio(ratio: f64) -> Mode {
    if ratio <= LAZY_RATIO {
        return Mode::Eager;
    }
    // log2(ring) = a + b log2(ratio) through (88415, 512) and (192, 64).
    let b = (9.0 - 6.0) / (88415f64.log2() - 192f64.log2());
    let a = 9.0 - b * 88415f64.log2();
    let ring = 2f64.powf((a + b * ratio.log2()).round()).clamp(8.0, 2048.0);
    Mode::Lazy {
        ring: ring as usize,
    }
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Sets `ram_ns`: a random access in a 32 MiB array, the fastest of 8
/// rounds (a shared machine's preemptions inflate some rounds, never
/// deflate them).
pub(crate) fn measure_ram(ix: &mut Index) {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let ram: Vec<u64> = (0..(4u64 << 20)).collect();
    let mut ram_ns = f64::MAX;
    let mut acc = 0u64;
    for _ in 0..8 {
        let n = 25_000;
        let t = Instant::now();
        for _ in 0..n {
            acc = acc.wrapping_add(ram[(xorshift(&mut s) ^ acc & 1) as usize % ram.len()]);
        }
        ram_ns = ram_ns.min(t.elapsed().as_nanos() as f64 / n as f64);
    }
    ix.ram_ns = ram_ns + (acc & 1) as f64 * 1e-9;
}

/// Sets `device_ns` (the median of 33 random 4 KiB reads of the largest
/// run; the RAM latency while nothing is on disk) and from it the pages a
/// read may span for about the price of the access itself (1 GB/s
/// assumed): the lazy mode's coalescing distance and the prefetch depth.
pub(crate) fn measure_device(ix: &mut Index) -> Result<()> {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let (name, pages) = match ix.runs.iter().max_by_key(|r| r.pages) {
        Some(r) => (r.name.clone(), r.pages),
        None => (String::new(), 0),
    };
    if pages == 0 {
        ix.device_ns = 100.0; // nothing on disk yet
    } else {
        let mut times = Vec::new();
        let mut buf = vec![0u8; PAGE];
        for _ in 0..33 {
            let p = xorshift(&mut s) % pages;
            let sim0 = ix.io.simulated_ns();
            let t = Instant::now();
            ix.io.read_at(&name, p * PAGE as u64, &mut buf).ctx(&name)?;
            times.push(t.elapsed().as_nanos() as u64 + (ix.io.simulated_ns() - sim0));
        }
        times.sort_unstable();
        ix.device_ns = times[times.len() / 2] as f64;
    }
    let pages_per_access = (ix.device_ns / PAGE as f64) as u64;
    ix.coalesce_pages = pages_per_access.min(MAX_READ_PAGES);
    ix.prefetch_pages = ix
        .cfg
        .prefetch_pages
        .unwrap_or((pages_per_access / 8).clamp(1, 16));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_picks_like_the_seed() {
        assert_eq!(mode_for_ratio(6.15), Mode::Eager);
        assert_eq!(mode_for_ratio(192.31), Mode::Eager);
        assert_eq!(mode_for_ratio(88_415.0), Mode::Lazy { ring: 512 });
        let Mode::Lazy { ring } = mode_for_ratio(1000.0) else {
            panic!()
        };
        assert!((64..=512).contains(&ring));
    }
}
