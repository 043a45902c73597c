//! A bounded cache of decoded chunks for reads, and a small helper that
//! spreads CPU work (hashing, compression) over the machine's cores.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::meta::ChunkLoc;

/// A chunk's bytes inside the decoded bytes of its record: all of them
/// for a chunk alone in its record, a stretch of a pack's
/// ([`ChunkLoc::inner`]). Made only by [`Piece::of`], which checks that
/// the record's bytes fit the location.
#[derive(Clone)]
pub(crate) struct Piece {
    record: Arc<Vec<u8>>,
    at: usize,
    len: usize,
}

impl Piece {
    /// The chunk at `loc` in `record`, its record's decoded bytes: `None`
    /// unless they fit (a chunk alone is the whole record; a packed one
    /// lies inside a pack of the length its row says).
    pub fn of(record: Arc<Vec<u8>>, loc: &ChunkLoc) -> Option<Piece> {
        let len = loc.raw_len as usize;
        let at = match loc.inner {
            None if record.len() == len => 0,
            Some(p) if p.of as usize == record.len() && (p.at as usize) + len <= record.len() => {
                p.at as usize
            }
            _ => return None,
        };
        Some(Piece { record, at, len })
    }

    /// The decoded bytes of the whole record.
    pub fn record(&self) -> &[u8] {
        &self.record
    }
}

impl std::ops::Deref for Piece {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.record[self.at..self.at + self.len]
    }
}

/// Decoded records recently read, keyed by (container, offset): a pack's
/// whole, so that each of its chunks is served by one decode.
///
/// Invariant: a record at a (container, offset) never changes while the
/// store is open — containers are append-only and write-once, and a new
/// container always gets an id above every id on disk or in the database,
/// so an id is never reused. A cached entry is therefore never stale, even
/// after gc moved the chunk elsewhere. Where that could fail — a
/// follower taking the writer's newer metadata (a restarted writer may
/// reuse the id of a container gc deleted), a rolled-back commit — the
/// cache is cleared, and inserts located before the clear are refused
/// (`generation`). An entry serves only locations it fits ([`Piece::of`],
/// and a pack only chunks located in a pack). Evicts in
/// insertion order (reads are mostly sequential) once `limit` bytes are
/// held.
pub(crate) struct ChunkCache {
    limit: usize,
    inner: Mutex<CacheInner>,
}

/// A decoded record, and whether it is a pack.
type Decoded = (Arc<Vec<u8>>, bool);

#[derive(Default)]
struct CacheInner {
    map: HashMap<(u64, u64), Decoded>,
    order: VecDeque<(u64, u64)>,
    bytes: usize,
    /// Times cleared.
    generation: u64,
}

impl ChunkCache {
    pub fn new(limit: usize) -> Self {
        ChunkCache {
            limit,
            inner: Mutex::new(CacheInner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets everything (after a rolled-back commit: the containers
    /// written in it are strays whose ids gc may free for reuse), and
    /// refuses inserts of chunks located before (see [`ChunkCache::insert`]).
    pub fn clear(&self) {
        let mut c = self.lock();
        let generation = c.generation + 1;
        *c = CacheInner {
            generation,
            ..CacheInner::default()
        };
    }

    /// How many times the cache was cleared: read under the store's lock
    /// with the plan that locates chunks, and given back to `insert`.
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// The chunk at `loc`, for a plan made at `generation`: none if the
    /// cache was cleared since (the entry may be for a container that
    /// reuses the id the plan meant).
    pub fn get(&self, generation: u64, loc: &ChunkLoc) -> Option<Piece> {
        let c = self.lock();
        if c.generation != generation {
            return None;
        }
        let (record, pack) = c.map.get(&(loc.container, loc.offset))?;
        if *pack != loc.inner.is_some() {
            return None;
        }
        Piece::of(record.clone(), loc)
    }

    /// Keeps the decoded record of `piece`, at `loc`, located by a plan
    /// made at `generation`: if the cache was cleared since, the record
    /// may be a rolled-back one whose container id is freed, and it is
    /// not kept (a reader between the plan and the clear would otherwise
    /// leave an entry a reused id could meet).
    pub fn insert(&self, generation: u64, loc: &ChunkLoc, piece: &Piece) {
        let raw = piece.record.clone();
        if raw.len() > self.limit / 4 {
            return;
        }
        let mut c = self.lock();
        if c.generation != generation {
            return;
        }
        let key = (loc.container, loc.offset);
        let len = raw.len();
        if c.map.insert(key, (raw, loc.inner.is_some())).is_some() {
            return;
        }
        c.order.push_back(key);
        c.bytes += len;
        while c.bytes > self.limit {
            let Some(old) = c.order.pop_front() else {
                break;
            };
            if let Some((v, _)) = c.map.remove(&old) {
                c.bytes -= v.len();
            }
        }
    }
}

/// The CPUs the process may run on: its main thread's affinity, read
/// once. A thread serving a ring of FUSE over io_uring is pinned to one
/// CPU, and every thread it starts inherits that (as does
/// `available_parallelism` on it): hashing and compressing spread from
/// such a thread ran on that one CPU while the other idled.
fn process_cpus() -> Option<&'static rustix::thread::CpuSet> {
    static CPUS: std::sync::OnceLock<Option<rustix::thread::CpuSet>> = std::sync::OnceLock::new();
    CPUS.get_or_init(|| rustix::thread::sched_getaffinity(Some(rustix::process::getpid())).ok())
        .as_ref()
}

/// Lets the calling thread run on every CPU of the process (see
/// [`process_cpus`]), once per thread; a failure leaves it as it is.
pub fn unpin_thread() {
    thread_local!(static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    if DONE.replace(true) {
        return;
    }
    if let Some(cpus) = process_cpus() {
        let _ = rustix::thread::sched_setaffinity(None, cpus);
    }
}

/// Worker threads used for hashing and compression: the cores available,
/// at most 8. Asked once: `available_parallelism` reads cgroup files on
/// every call, which cost more than hashing a small file's page. Asked on
/// a thread of its own, unpinned: the first caller may be a pinned ring
/// worker, for which it answers 1.
fn workers() -> usize {
    static WORKERS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *WORKERS.get_or_init(|| {
        std::thread::spawn(|| {
            unpin_thread();
            std::thread::available_parallelism().map_or(1, |n| n.get())
        })
        .join()
        .unwrap_or(1)
        .min(8)
    })
}

/// `items.iter().map(f).collect()`, spread over the cores in contiguous
/// slices (order kept). Small inputs stay on the calling thread.
pub(crate) fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let n = workers().min(items.len() / 2).max(1);
    if n == 1 {
        return items.iter().map(f).collect();
    }
    let per = items.len().div_ceil(n);
    let f = &f;
    std::thread::scope(|s| {
        let mut parts = items.chunks(per);
        let first = parts.next().unwrap_or(&[]);
        let handles: Vec<_> = parts
            .map(|part| {
                s.spawn(move || {
                    unpin_thread();
                    part.iter().map(f).collect::<Vec<R>>()
                })
            })
            .collect();
        let mut out: Vec<R> = first.iter().map(f).collect();
        for h in handles {
            out.extend(h.join().expect("worker panicked"));
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::PackAt;

    #[test]
    fn par_map_keeps_order() {
        let v: Vec<u32> = (0..1001).collect();
        assert_eq!(
            par_map(&v, |x| x * 2),
            v.iter().map(|x| x * 2).collect::<Vec<_>>()
        );
        assert_eq!(par_map(&v[..1], |x| x + 1), vec![1]);
        assert!(par_map(&v[..0], |x| *x).is_empty());
    }

    /// A thread pinned to one CPU (as a ring worker of FUSE over io_uring
    /// is) still spreads work over all of the process's CPUs.
    #[test]
    fn par_map_from_a_pinned_thread_uses_every_cpu() {
        use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
        let all = *process_cpus().expect("the process's CPUs");
        let first = (0..CpuSet::MAX_CPU).find(|&c| all.is_set(c)).unwrap();
        std::thread::spawn(move || {
            let mut one = CpuSet::new();
            one.set(first);
            sched_setaffinity(None, &one).unwrap();
            let v: Vec<u32> = (0..64).collect();
            let counts = par_map(&v, |_| sched_getaffinity(None).unwrap().count());
            // The first slice runs on the calling thread, the last on a
            // spread one (when there is more than one CPU).
            assert_eq!(counts[0], 1);
            let spread = if workers() > 1 { all.count() } else { 1 };
            assert_eq!(counts[63], spread);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn cache_evicts_oldest_beyond_limit() {
        let c = ChunkCache::new(400);
        let loc = |o| ChunkLoc {
            container: 1,
            offset: o,
            stored_len: 0,
            raw_len: 100,
            inner: None,
        };
        let piece = |l: &ChunkLoc, b: u8| Piece::of(Arc::new(vec![b; 100]), l).unwrap();
        for o in 0..5 {
            c.insert(0, &loc(o), &piece(&loc(o), o as u8));
        }
        assert!(c.get(0, &loc(0)).is_none(), "oldest entry evicted");
        assert_eq!(c.get(0, &loc(4)).unwrap()[0], 4);
        assert_eq!(c.get(0, &loc(1)).unwrap().len(), 100);
        c.clear();
        c.insert(0, &loc(7), &piece(&loc(7), 7));
        assert!(c.get(1, &loc(7)).is_none(), "located before the clear");
        c.insert(1, &loc(7), &piece(&loc(7), 7));
        assert!(c.get(1, &loc(7)).is_some());
        assert!(c.get(0, &loc(7)).is_none(), "a plan from before the clear");
    }

    #[test]
    fn a_cached_pack_serves_each_of_its_chunks_and_nothing_else() {
        let c = ChunkCache::new(1 << 20);
        let at = |inner: Option<u32>, raw_len| ChunkLoc {
            container: 3,
            offset: 16,
            stored_len: 90,
            raw_len,
            inner: inner.map(|at| PackAt { at, of: 30 }),
        };
        let pack: Vec<u8> = (0..30u8).collect();
        let first = Piece::of(Arc::new(pack), &at(Some(0), 10)).unwrap();
        c.insert(0, &at(Some(0), 10), &first);
        assert_eq!(
            &c.get(0, &at(Some(0), 10)).unwrap()[..],
            &(0..10).collect::<Vec<u8>>()[..]
        );
        assert_eq!(
            &c.get(0, &at(Some(10), 20)).unwrap()[..],
            &(10..30).collect::<Vec<u8>>()[..]
        );
        assert!(c.get(0, &at(Some(20), 11)).is_none(), "past the pack's end");
        assert!(
            c.get(0, &at(None, 30)).is_none(),
            "a chunk alone is not a pack"
        );
        assert!(Piece::of(Arc::new(vec![0; 30]), &at(None, 29)).is_none());
        let other_length = Piece::of(Arc::new(vec![0; 31]), &at(Some(0), 10));
        assert!(other_length.is_none(), "a pack of another length");
    }
}
