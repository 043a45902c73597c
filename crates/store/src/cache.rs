//! A bounded cache of decoded chunks for reads, and a small helper that
//! spreads CPU work (hashing, compression) over the machine's cores.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::meta::ChunkLoc;

/// Decoded bytes of recently read chunks, keyed by (container, offset).
///
/// Invariant: a record at a (container, offset) never changes while the
/// store is open — containers are append-only and write-once, and a new
/// container always gets an id above every id on disk or in the database,
/// so an id is never reused. A cached entry is therefore never stale, even
/// after gc moved the chunk elsewhere. Where that could fail — a
/// follower taking the writer's newer metadata (a restarted writer may
/// reuse the id of a container gc deleted), a rolled-back commit — the
/// cache is cleared, and inserts located before the clear are refused
/// (`generation`). Evicts in
/// insertion order (reads are mostly sequential) once `limit` bytes are
/// held.
pub(crate) struct ChunkCache {
    limit: usize,
    inner: Mutex<CacheInner>,
}

#[derive(Default)]
struct CacheInner {
    map: HashMap<(u64, u64), Arc<Vec<u8>>>,
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

    /// The decoded bytes at `loc`, for a plan made at `generation`: none
    /// if the cache was cleared since (the entry may be for a container
    /// that reuses the id the plan meant).
    pub fn get(&self, generation: u64, loc: &ChunkLoc) -> Option<Arc<Vec<u8>>> {
        let c = self.lock();
        if c.generation != generation {
            return None;
        }
        c.map.get(&(loc.container, loc.offset)).cloned()
    }

    /// Keeps the decoded bytes of the record at `loc`, located by a plan
    /// made at `generation`: if the cache was cleared since, the record
    /// may be a rolled-back one whose container id is freed, and it is
    /// not kept (a reader between the plan and the clear would otherwise
    /// leave an entry a reused id could meet).
    pub fn insert(&self, generation: u64, loc: &ChunkLoc, raw: Arc<Vec<u8>>) {
        if raw.len() > self.limit / 4 {
            return;
        }
        let mut c = self.lock();
        if c.generation != generation {
            return;
        }
        let key = (loc.container, loc.offset);
        let len = raw.len();
        if c.map.insert(key, raw).is_some() {
            return;
        }
        c.order.push_back(key);
        c.bytes += len;
        while c.bytes > self.limit {
            let Some(old) = c.order.pop_front() else {
                break;
            };
            if let Some(v) = c.map.remove(&old) {
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
        };
        for o in 0..5 {
            c.insert(0, &loc(o), Arc::new(vec![o as u8; 100]));
        }
        assert!(c.get(0, &loc(0)).is_none(), "oldest entry evicted");
        assert_eq!(c.get(0, &loc(4)).unwrap()[0], 4);
        assert_eq!(c.get(0, &loc(1)).unwrap().len(), 100);
        c.clear();
        c.insert(0, &loc(7), Arc::new(vec![7; 100]));
        assert!(c.get(1, &loc(7)).is_none(), "located before the clear");
        c.insert(1, &loc(7), Arc::new(vec![7; 100]));
        assert!(c.get(1, &loc(7)).is_some());
        assert!(c.get(0, &loc(7)).is_none(), "a plan from before the clear");
    }
}
