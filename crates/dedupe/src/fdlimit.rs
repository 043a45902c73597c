//! File descriptor budget: a group of copies can be far larger than the
//! process may hold open, so destinations are opened in bounded batches
//! and the open-file cache is sized from `RLIMIT_NOFILE`.

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// Descriptors kept free for everything else the process holds (the
/// catalog, stdio, the walker's and readers' descriptors, SQLite's files).
const RESERVE: u64 = 64;

/// At most this many files stay open in the executor's cache.
const MAX_CACHE: usize = 256;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns the soft
/// limit now in force (`None`: unlimited).
pub fn raise_nofile_limit() -> Option<u64> {
    let cur = getrlimit(Resource::Nofile);
    if cur.current != cur.maximum {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: cur.maximum,
                maximum: cur.maximum,
            },
        );
    }
    getrlimit(Resource::Nofile).current
}

/// How many destinations one batch opens at once, and how many files the
/// cache may keep besides, for a soft limit of `limit` descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdBudget {
    pub batch: usize,
    pub cache: usize,
}

impl FdBudget {
    /// The budget under the process's current soft limit.
    pub fn current() -> FdBudget {
        FdBudget::for_limit(getrlimit(Resource::Nofile).current)
    }

    /// The budget for `limit` descriptors (`None`: unlimited): a batch of at
    /// most `max_batch` (the kernel's per-call count) and a cache, both
    /// shrunk so that batch + cache + a reserve fit, never below 1 each.
    pub fn for_limit(limit: Option<u64>) -> FdBudget {
        FdBudget::fit(limit, onecopy_ioctl::dedupe::MAX_DESTS_PER_CALL)
    }

    fn fit(limit: Option<u64>, max_batch: usize) -> FdBudget {
        let avail = limit.map_or(u64::MAX, |l| l.saturating_sub(RESERVE)) as usize;
        let batch = max_batch.min(avail / 2).max(1);
        let cache = MAX_CACHE.min(avail.saturating_sub(batch)).max(1);
        FdBudget { batch, cache }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_fits_the_limit() {
        for limit in [16u64, 100, 256, 1024, 4096, 1 << 20] {
            let b = FdBudget::fit(Some(limit), 127);
            assert!(b.batch >= 1 && b.cache >= 1);
            assert!(b.batch <= 127);
            if limit > RESERVE + 2 {
                assert!(
                    (b.batch + b.cache) as u64 + RESERVE <= limit,
                    "{limit}: {b:?}"
                );
            }
        }
        assert_eq!(
            FdBudget::fit(None, 127),
            FdBudget {
                batch: 127,
                cache: MAX_CACHE
            }
        );
        assert_eq!(FdBudget::fit(Some(1024), 127).batch, 127);
        assert_eq!(FdBudget::fit(Some(256), 127).batch, 96);
    }

    #[test]
    fn raising_keeps_a_usable_limit() {
        let hard = getrlimit(Resource::Nofile).maximum;
        let now = raise_nofile_limit();
        assert_eq!(now, hard);
    }
}
