//! Benchmarks of the fingerprint index (run by `bench/fpindex.sh`).
//!
//! fpbench build DIR N            insert N random fingerprints
//! fpbench query DIR N            negative / cached positive / cache-missing lookups
//! fpbench compact DIR            merge all runs into one
//! fpbench rss DIR N              open and look up with no cache (peak RSS)
//! fpbench negbatch DIR M         M negative lookups in batches of 4096 (for profiles)
//! fpbench trace DIR DEVICE V M MODE...
//!     the seed's experiment: V versions of M fingerprints with backup-stream
//!     locality, ingested in order (lookup, insert if new), per mode
//!     (eager, lazy:RING, auto) on DEVICE (tmpfs, disk = O_DIRECT, slow =
//!     10 ms simulated latency behind the I/O trait); prints the time split.

use std::path::Path;
use std::time::{Duration, Instant};

use onecopy_fpindex::{Config, FsIo, Index, Io, Mode, SlowIo};

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fingerprint number `i` of a stream (`salt` tells streams apart).
fn fp(salt: u64, i: u64) -> u128 {
    let a = mix(i ^ (salt << 48));
    ((mix(a) as u128) << 64) | mix(a ^ 0x5555_AAAA_5555_AAAA) as u128
}

/// CPU seconds this process used so far (user + system, from /proc): the
/// machine is shared, so rates are also given per CPU second.
fn cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    (f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0)) / 100.0
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn build(dir: &Path, n: u64) {
    let cfg = Config {
        memtable_entries: 4 << 20,
        mode: Mode::Eager,
        ..Default::default()
    };
    let mut ix = Index::open(dir, cfg).expect("open");
    let t = Instant::now();
    for i in 0..n {
        ix.insert(fp(1, i), i, 0).expect("insert");
    }
    ix.flush().expect("flush");
    ix.finish_merges().expect("merge");
    ix.commit().expect("commit");
    let el = t.elapsed();
    let s = ix.stats();
    println!(
        "build: {n} entries in {:.1} s ({:.2} M inserts/s), {} runs, {} flushes, {} merges, filter+directory+bitmap {:.3} B/entry",
        secs(el),
        n as f64 / secs(el) / 1e6,
        ix.runs(),
        s.flushes,
        s.merges,
        ix.ram_bytes() as f64 / n as f64
    );
}

fn query(dir: &Path, n: u64) {
    let cfg = Config {
        cache_entries: 1 << 20,
        mode: Mode::Eager,
        ..Default::default()
    };
    let t = Instant::now();
    let mut ix = Index::open(dir, cfg).expect("open");
    println!(
        "open: {:.3} s, {} entries, {} runs, RAM (filter+directory+bitmap) {:.3} B/entry",
        secs(t.elapsed()),
        ix.len(),
        ix.runs(),
        ix.ram_bytes() as f64 / n as f64
    );
    // Negative lookups: fingerprints never inserted.
    let m = 20_000_000u64;
    let c0 = cpu();
    let t = Instant::now();
    let mut found = 0;
    for i in 0..m {
        found += ix.lookup(fp(2, i)).expect("lookup").is_some() as u64;
    }
    let el = t.elapsed();
    let cpu_neg = cpu() - c0;
    let s = ix.stats();
    // The same one at a time, keys generated ahead in blocks of 4096 and
    // only the lookups timed (as the batched figure below).
    let mut el_k = Duration::ZERO;
    for b in 0..(m / 4096) {
        let keys: Vec<u128> = (0..4096).map(|i| fp(4, b * 4096 + i)).collect();
        let t = Instant::now();
        for &k in &keys {
            found += ix.lookup(k).expect("lookup").is_some() as u64;
        }
        el_k += t.elapsed();
    }
    let mut el_b = Duration::ZERO;
    let c0 = cpu();
    let mut batched = 0u64;
    for b in 0..(m / 4096) {
        let keys: Vec<u128> = (0..4096).map(|i| fp(3, b * 4096 + i)).collect();
        let t = Instant::now();
        batched += ix
            .lookup_many(&keys)
            .expect("lookup")
            .iter()
            .filter(|f| f.is_some())
            .count() as u64;
        el_b += t.elapsed();
    }
    let cpu_b = cpu() - c0;
    println!(
        "negative, batches of 4096 (lookup_many): {:.2} M lookups/s wall ({:.1} ns each, key generation excluded), {:.2} M per CPU second (incl. key generation), found {batched}",
        (m / 4096 * 4096) as f64 / secs(el_b) / 1e6,
        secs(el_b) * 1e9 / (m / 4096 * 4096) as f64,
        (m / 4096 * 4096) as f64 / cpu_b.max(0.01) / 1e6
    );
    println!(
        "negative, one at a time, key generation excluded: {:.2} M lookups/s wall ({:.1} ns each)",
        (m / 4096 * 4096) as f64 / secs(el_k) / 1e6,
        secs(el_k) * 1e9 / (m / 4096 * 4096) as f64
    );
    println!(
        "negative: {:.2} M lookups/s wall ({:.1} ns each), {:.2} M per CPU second, false positives {} ({:.2e}), found {found}",
        m as f64 / secs(el) / 1e6,
        secs(el) * 1e9 / m as f64,
        m as f64 / cpu_neg.max(0.01) / 1e6,
        s.filter_false_positives,
        s.filter_false_positives as f64 / m as f64
    );
    print_smaps(&["AnonHugePages"]);
    // Cache-missing positives: random inserted keys, cold cache.
    ix.reset_stats();
    ix.clear_cache();
    let k = 20_000u64;
    let t = Instant::now();
    for j in 0..k {
        let i = mix(j) % n;
        assert_eq!(ix.lookup(fp(1, i)).expect("lookup"), Some(i));
    }
    let el = t.elapsed();
    let s = ix.stats();
    println!(
        "cache-missing positive: {:.1} us each, {:.4} index reads per cache-missing lookup, {:.4} prefetch reads per lookup ({} skipped: no locality), {:.4} device reads per cache-missing lookup in all",
        secs(el) * 1e6 / k as f64,
        s.index_reads as f64 / s.disk_lookups.max(1) as f64,
        s.prefetch_reads as f64 / s.disk_lookups.max(1) as f64,
        s.prefetch_skipped,
        (s.index_reads + s.prefetch_reads) as f64 / s.disk_lookups.max(1) as f64
    );
    // Positives from the cache: a run of consecutive inserts, warmed, then re-read.
    ix.clear_cache();
    let span = 500_000u64.min(n);
    for i in 0..span {
        ix.lookup(fp(1, i)).expect("lookup");
    }
    ix.reset_stats();
    let rounds = 20;
    let c0 = cpu();
    let t = Instant::now();
    for _ in 0..rounds {
        for i in 0..span {
            assert_eq!(ix.lookup(fp(1, i)).expect("lookup"), Some(i));
        }
    }
    let el = t.elapsed();
    let s = ix.stats();
    println!(
        "cached positive: {:.2} M lookups/s wall, {:.2} M per CPU second, cache hits {:.4}, disk lookups {}",
        (span * rounds) as f64 / secs(el) / 1e6,
        (span * rounds) as f64 / (cpu() - c0).max(0.01) / 1e6,
        s.cache_hits as f64 / s.lookups as f64,
        s.disk_lookups
    );
}

/// Only negative lookups in batches of 4096 (`lookup_many`), for
/// profiles: CPU seconds with and without the lookups, so that the key
/// generation can be taken out.
fn negbatch(dir: &Path, m: u64) {
    let cfg = Config {
        mode: Mode::Eager,
        ..Default::default()
    };
    let mut ix = Index::open(dir, cfg).expect("open");
    let batches = m / 4096;
    let keys = |b: u64| -> Vec<u128> { (0..4096).map(|i| fp(3, b * 4096 + i)).collect() };
    let c0 = cpu();
    let mut sink = 0u128;
    for b in 0..batches {
        sink ^= keys(b)[b as usize % 4096];
    }
    let cpu_keys = cpu() - c0;
    let c0 = cpu();
    let t = Instant::now();
    let mut found = 0;
    for b in 0..batches {
        found += ix
            .lookup_many(&keys(b))
            .expect("lookup")
            .iter()
            .flatten()
            .count();
    }
    let (el, c) = (secs(t.elapsed()), cpu() - c0);
    let n = (batches * 4096) as f64;
    println!(
        "negbatch: {} runs, {n} lookups, {:.2} M per CPU s incl. keys, {:.2} M per CPU s of lookups alone (keys {cpu_keys:.2} s of {c:.2} s), {:.2} M/s wall, found {found} ({})",
        ix.runs(),
        n / c.max(0.01) / 1e6,
        n / (c - cpu_keys).max(0.01) / 1e6,
        n / el / 1e6,
        sink & 1
    );
}

/// A backup stream: version 0 random; each next version keeps the
/// previous one with 2% of it changed in runs of 1-64 blocks (new data),
/// and 1% of runs moved elsewhere (reordering), like successive backups
/// of a changing tree.
struct Trace {
    cur: Vec<u128>,
    next_new: u64,
    seed: u64,
}

impl Trace {
    fn new(m: usize) -> Trace {
        let cur = (0..m as u64).map(|i| fp(7, i)).collect();
        Trace {
            cur,
            next_new: m as u64,
            seed: 12345,
        }
    }

    fn rnd(&mut self) -> u64 {
        self.seed = mix(self.seed);
        self.seed
    }

    fn advance(&mut self) {
        let m = self.cur.len();
        let mut changed = 0;
        while changed < m / 50 {
            let len = (1 + self.rnd() % 64) as usize;
            let at = self.rnd() as usize % m.saturating_sub(len).max(1);
            for j in at..(at + len).min(m) {
                self.cur[j] = fp(7, self.next_new);
                self.next_new += 1;
            }
            changed += len;
        }
        for _ in 0..(m / 100 / 32) {
            let a = self.rnd() as usize % (m - 32);
            let b = self.rnd() as usize % (m - 32);
            for j in 0..32 {
                self.cur.swap(a + j, b + j);
            }
        }
    }
}

fn open_device(dir: &Path, device: &str) -> Box<dyn Io> {
    match device {
        "tmpfs" => Box::new(FsIo::new(dir, false).expect("dir")),
        "disk" => Box::new(FsIo::new(dir, true).expect("dir")),
        "slow" => Box::new(SlowIo::new(
            FsIo::new(dir, false).expect("dir"),
            Duration::from_millis(10),
            150_000_000,
        )),
        _ => panic!("device: tmpfs, disk or slow"),
    }
}

fn parse_mode(s: &str) -> Mode {
    match s {
        "eager" => Mode::Eager,
        "auto" => Mode::Auto,
        _ => Mode::Lazy {
            ring: s
                .strip_prefix("lazy:")
                .and_then(|r| r.parse().ok())
                .expect("mode eager, auto or lazy:RING"),
        },
    }
}

fn trace(dir: &Path, device: &str, versions: usize, m: usize, mode: Mode) {
    let _ = std::fs::remove_dir_all(dir);
    let cfg = Config {
        memtable_entries: 1 << 18,
        cache_entries: 1 << 19,
        timing: true,
        mode,
        ..Default::default()
    };
    let mut ix = Index::open_with(open_device(dir, device), cfg.clone()).expect("open");
    let mut tr = Trace::new(m);
    let batch = 1 << 16;
    let mut total = 0u64;
    let mut dups = 0u64;
    let mut ingest_cpu = Duration::ZERO;
    let mut chosen = String::new();
    let mut phase = (Instant::now(), cpu());
    for v in 0..versions {
        if v > 0 {
            tr.advance();
        }
        if v == 1 {
            // Auto decides at open (and lazy sizes its coalesced reads):
            // reopen once there is a run to measure.
            ix.commit().expect("commit");
            drop(ix);
            ix = Index::open_with(open_device(dir, device), cfg.clone()).expect("reopen");
            chosen = format!(
                "{:?} (device {:.0} ns, RAM {:.0} ns)",
                ix.mode(),
                ix.device_ns,
                ix.ram_ns
            );
            ix.reset_stats();
            ingest_cpu = Duration::ZERO;
            phase = (Instant::now(), cpu());
        }
        let cur = tr.cur.clone();
        for (c, chunk) in cur.chunks(batch).enumerate() {
            let found = ix.lookup_batch(chunk).expect("lookup");
            let t = Instant::now();
            for (j, (&k, f)) in chunk.iter().zip(found).enumerate() {
                match f {
                    Some(_) => dups += 1,
                    None => {
                        ix.insert(k, (v * m + c * batch + j) as u64, v as u32)
                            .expect("insert");
                    }
                }
            }
            ingest_cpu += t.elapsed();
            total += chunk.len() as u64;
        }
        if v == 0 {
            // The table starts on disk: the first version is the base backup.
            ix.flush().expect("flush");
            ix.clear_cache();
            ix.reset_stats();
        }
    }
    let s = ix.stats();
    let (wall, cpu_s) = (secs(phase.0.elapsed()), cpu() - phase.1);
    let ms = |ns: u64| ns as f64 / 1e9;
    let lookup_total = ms(s.filter_ns + s.cache_ns + s.disk_ns + s.post_lookup_ns);
    println!(
        "{device:6} {:18} fps {total} dup {:.3} | filter {:.2} s cache {:.2} s disk {:.2} s post {:.2} s = {:.2} s | disk lookups {} index reads {} prefetch reads {} | insert {:.1} s | versions 1.. wall {wall:.1} s cpu {cpu_s:.1} s | {chosen}",
        format!("{mode:?}"),
        dups as f64 / total as f64,
        ms(s.filter_ns),
        ms(s.cache_ns),
        ms(s.disk_ns),
        ms(s.post_lookup_ns),
        lookup_total,
        s.disk_lookups,
        s.index_reads,
        s.prefetch_reads,
        secs(ingest_cpu),
    );
}

/// The RAM of an open index: negative and cache-missing lookups with no
/// cache (peak RSS measured around it by `bench/fpindex.sh`).
fn rss(dir: &Path, n: u64) {
    let cfg = Config {
        cache_entries: 0,
        mode: Mode::Eager,
        ..Default::default()
    };
    let mut ix = Index::open(dir, cfg).expect("open");
    let mut found = 0;
    for i in 0..10_000_000 {
        found += ix.lookup(fp(2, i)).expect("lookup").is_some() as u64;
    }
    for j in 0..10_000 {
        let i = mix(j) % n;
        found += ix.lookup(fp(1, i)).expect("lookup").is_some() as u64;
    }
    println!(
        "rss: {} entries, {found} found, filter+directory+bitmap {:.3} B/entry",
        ix.len(),
        ix.ram_bytes() as f64 / n as f64
    );
    print_smaps(&["AnonHugePages", "Rss"]);
}

/// Prints this process's `smaps_rollup` lines that start with one of
/// `keys`: whether the filters got huge pages explains much of the spread
/// between sittings (a probe that misses the TLB too costs a page walk).
fn print_smaps(keys: &[&str]) {
    let smaps = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    for l in smaps
        .lines()
        .filter(|l| keys.iter().any(|k| l.starts_with(k)))
    {
        println!("  {l}");
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let num = |i: usize| {
        a.get(i)
            .and_then(|s| s.parse::<u64>().ok())
            .expect("number")
    };
    match a.get(1).map(String::as_str) {
        Some("build") => build(Path::new(&a[2]), num(3)),
        Some("query") => query(Path::new(&a[2]), num(3)),
        Some("rss") => rss(Path::new(&a[2]), num(3)),
        Some("negbatch") => negbatch(Path::new(&a[2]), num(3)),
        Some("compact") => {
            let cfg = Config {
                mode: Mode::Eager,
                ..Default::default()
            };
            let mut ix = Index::open(Path::new(&a[2]), cfg).expect("open");
            let t = Instant::now();
            ix.compact().expect("compact");
            println!(
                "compact: {} entries into {} run in {:.1} s",
                ix.len(),
                ix.runs(),
                secs(t.elapsed())
            );
        }
        Some("trace") => {
            for m in &a[6..] {
                trace(
                    Path::new(&a[2]),
                    &a[3],
                    num(4) as usize,
                    num(5) as usize,
                    parse_mode(m),
                );
            }
        }
        _ => eprintln!("usage: see the top of examples/fpbench.rs"),
    }
}
