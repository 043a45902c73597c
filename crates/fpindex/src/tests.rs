//! Model tests: random operations against a `HashMap` oracle, with
//! flushes, merges, reopen and simulated power loss.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;

use crate::{Config, Index, Inserted, MemIo, Mode};

#[derive(Debug, Clone)]
enum Op {
    Insert(u8, u64, u32),
    Lookup(u8),
    Incref(u8),
    Decref(u8),
    Delete(u8),
    Prune(u32),
    Commit,
    Flush,
    Compact,
    Reopen,
    PowerLoss,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (any::<u8>(), any::<u64>(), 0u32..10).prop_map(|(k, l, b)| Op::Insert(k, l, b)),
        6 => any::<u8>().prop_map(Op::Lookup),
        2 => any::<u8>().prop_map(Op::Incref),
        2 => any::<u8>().prop_map(Op::Decref),
        1 => any::<u8>().prop_map(Op::Delete),
        1 => (0u32..10).prop_map(Op::Prune),
        2 => Just(Op::Commit),
        1 => Just(Op::Flush),
        1 => Just(Op::Compact),
        1 => Just(Op::Reopen),
        1 => Just(Op::PowerLoss),
    ]
}

/// Spreads a small key over the whole key space (top bits vary too).
fn key(k: u8) -> u128 {
    (k as u128 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
}

type Oracle = HashMap<u128, (u64, u32, u32)>;

fn cfg(quota: Option<u64>, cache: usize) -> Config {
    Config {
        memtable_entries: 7,
        cache_entries: cache,
        max_entries: quota,
        max_runs: 3,
        mode: Mode::Eager,
        // Segment windows of 3 pages with a quota, the measured default otherwise.
        prefetch_pages: quota.map(|_| 3),
        // Runs of more than a few keys get several filter partitions.
        partition_keys: 4,
        ..Default::default()
    }
}

fn check_all(ix: &mut Index, oracle: &Oracle) {
    for k in 0..=255u8 {
        let want = oracle.get(&key(k)).map(|v| v.0);
        assert_eq!(ix.lookup(key(k)).unwrap(), want, "lookup {k}");
        let e = ix.get(key(k)).unwrap().map(|e| (e.loc, e.refs, e.born));
        assert_eq!(e, oracle.get(&key(k)).copied(), "entry {k}");
    }
    assert_eq!(ix.len(), oracle.len() as u64);
    let keys: Vec<u128> = (0..=255u8).chain(0..=255u8).map(key).collect();
    let want: Vec<Option<u64>> = keys.iter().map(|k| oracle.get(k).map(|v| v.0)).collect();
    ix.clear_cache();
    assert_eq!(
        ix.lookup_batch_with(&keys, Mode::Eager).unwrap(),
        want,
        "eager batch"
    );
    for ring in [1, 4, 64] {
        ix.clear_cache();
        assert_eq!(
            ix.lookup_batch_with(&keys, Mode::Lazy { ring }).unwrap(),
            want,
            "lazy ring {ring}"
        );
    }
}

fn run_ops(ops: Vec<Op>, quota: Option<u64>, cache: usize) {
    run_ops_with(ops, cfg(quota, cache));
}

fn run_ops_with(ops: Vec<Op>, cfg: Config) {
    let quota = cfg.max_entries;
    let mem = Arc::new(MemIo::default());
    let open = |m: &Arc<MemIo>| Index::open_with(Box::new(m.clone()), cfg.clone()).unwrap();
    let mut ix = open(&mem);
    let mut oracle = Oracle::new();
    let mut durable = Oracle::new();
    for op in ops {
        let flushes = ix.stats().flushes;
        match op {
            Op::Insert(k, l, b) => {
                let got = ix.insert(key(k), l, b).unwrap();
                let want = match oracle.get(&key(k)) {
                    Some(v) => Inserted::Exists(v.0),
                    None if quota.is_some_and(|q| oracle.len() as u64 >= q) => Inserted::NotIndexed,
                    None => {
                        oracle.insert(key(k), (l, 1, b));
                        Inserted::New
                    }
                };
                assert_eq!(got, want);
            }
            Op::Lookup(k) => {
                assert_eq!(ix.lookup(key(k)).unwrap(), oracle.get(&key(k)).map(|v| v.0))
            }
            Op::Incref(k) => {
                let want = oracle.get_mut(&key(k)).map(|v| {
                    v.1 += 1;
                    v.1
                });
                assert_eq!(ix.incref(key(k)).unwrap(), want);
            }
            Op::Decref(k) => {
                let want = oracle.get_mut(&key(k)).map(|v| {
                    v.1 -= 1;
                    v.1
                });
                if want == Some(0) {
                    oracle.remove(&key(k));
                }
                assert_eq!(ix.decref(key(k)).unwrap(), want);
            }
            Op::Delete(k) => {
                assert_eq!(ix.delete(key(k)).unwrap(), oracle.remove(&key(k)).is_some())
            }
            Op::Prune(t) => {
                let before = oracle.len();
                oracle.retain(|_, v| !(v.1 == 1 && v.2 < t));
                assert_eq!(ix.prune(t).unwrap(), (before - oracle.len()) as u64);
                durable = oracle.clone();
            }
            Op::Commit => {
                ix.commit().unwrap();
                durable = oracle.clone();
            }
            Op::Flush => ix.flush().unwrap(),
            Op::Compact => ix.compact().unwrap(),
            Op::Reopen => {
                ix.commit().unwrap();
                durable = oracle.clone();
                drop(ix);
                ix = open(&mem);
            }
            Op::PowerLoss => {
                drop(ix);
                mem.power_loss();
                oracle = durable.clone();
                ix = open(&mem);
                check_all(&mut ix, &oracle);
            }
        }
        if ix.stats().flushes != flushes {
            durable = oracle.clone();
        }
    }
    check_all(&mut ix, &oracle);
    ix.commit().unwrap();
    drop(ix);
    check_all(&mut open(&mem), &oracle);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn model(ops in proptest::collection::vec(op(), 1..300)) {
        run_ops(ops, None, 40);
    }

    #[test]
    fn model_with_quota(ops in proptest::collection::vec(op(), 1..300), q in 1u64..30) {
        run_ops(ops, Some(q), 40);
    }

    #[test]
    fn model_without_cache(ops in proptest::collection::vec(op(), 1..200)) {
        run_ops(ops, None, 0);
    }

    /// Tiered merging (three runs at a time, up to 8 runs) answers as the
    /// oracle does too, with and without a quota.
    #[test]
    fn model_tiered(ops in proptest::collection::vec(op(), 1..300), q in proptest::option::of(1u64..30)) {
        run_ops_with(ops, Config { merge_tier: Some(3), max_runs: 8, ..cfg(q, 40) });
    }
}

#[test]
fn index_can_move_between_threads() {
    fn send<T: Send>() {}
    send::<Index>();
}

/// `lookup_many` (filter blocks prefetched ahead, definite negatives
/// answered from the filters) returns exactly what `lookup` returns one
/// at a time, on random present, deleted and absent keys spread over
/// several runs and the memtable.
fn many_matches_one_at_a_time(
    keys: Vec<u128>,
    deleted: Vec<usize>,
    probes: Vec<(bool, usize, u128)>,
) {
    let mem = Arc::new(MemIo::default());
    let cfg = Config {
        memtable_entries: 97,
        cache_entries: 64,
        mode: Mode::Eager,
        ..Default::default()
    };
    let mut ix = Index::open_with(Box::new(mem), cfg).unwrap();
    let mut oracle = HashMap::new();
    for (i, &k) in keys.iter().enumerate() {
        if ix.insert(k, i as u64, 0).unwrap() == Inserted::New {
            oracle.insert(k, i as u64);
        }
    }
    for d in deleted {
        let k = keys[d % keys.len()];
        assert_eq!(ix.delete(k).unwrap(), oracle.remove(&k).is_some());
    }
    let batch: Vec<u128> = probes
        .iter()
        .map(|&(present, i, other)| if present { keys[i % keys.len()] } else { other })
        .collect();
    let want: Vec<Option<u64>> = batch.iter().map(|k| oracle.get(k).copied()).collect();
    ix.clear_cache();
    let many = ix.lookup_many(&batch).unwrap();
    ix.clear_cache();
    let one: Vec<Option<u64>> = batch.iter().map(|&k| ix.lookup(k).unwrap()).collect();
    assert_eq!(many, one);
    assert_eq!(many, want);
    assert!(ix.runs() >= 1, "keys spread over runs and the memtable");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
    #[test]
    fn lookup_many_equals_lookup(
        keys in proptest::collection::vec(any::<u128>(), 200..1500),
        deleted in proptest::collection::vec(any::<usize>(), 0..50),
        probes in proptest::collection::vec((any::<bool>(), any::<usize>(), any::<u128>()), 1..600),
    ) {
        many_matches_one_at_a_time(keys, deleted, probes);
    }
}

/// A [`MemIo`] whose appends can be made to fail half-way, as `ENOSPC`
/// does: the first few bytes land, then the error.
#[derive(Default)]
struct FullIo {
    mem: MemIo,
    /// Appends still allowed; the next one after is torn.
    budget: std::sync::atomic::AtomicI64,
    /// The next sync fails and loses what was not synced.
    fail_sync: std::sync::atomic::AtomicBool,
}

impl crate::Io for FullIo {
    fn read_at(&self, name: &str, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.mem.read_at(name, off, buf)
    }
    fn append(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        use std::sync::atomic::Ordering;
        if data.is_empty() || self.budget.fetch_sub(1, Ordering::SeqCst) > 0 {
            return self.mem.append(name, data);
        }
        self.mem.append(name, &data[..data.len().min(5)])?;
        Err(std::io::Error::from_raw_os_error(libc::ENOSPC))
    }
    fn sync(&self, name: &str) -> std::io::Result<()> {
        if self
            .fail_sync
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            self.mem.drop_unsynced(name);
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        self.mem.sync(name)
    }
    fn len(&self, name: &str) -> std::io::Result<Option<u64>> {
        self.mem.len(name)
    }
    fn truncate(&self, name: &str, len: u64) -> std::io::Result<()> {
        self.mem.truncate(name, len)
    }
    fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        self.mem.rename(from, to)
    }
    fn remove(&self, name: &str) -> std::io::Result<()> {
        self.mem.remove(name)
    }
    fn list(&self) -> std::io::Result<Vec<String>> {
        self.mem.list()
    }
}

/// Issue 11: an append that fails half-way (`ENOSPC`) in the log, a run,
/// the segments, the bitmap or the manifest, at every position of a
/// workload with flushes and merges, then retried as the store does
/// (the same operation again once space is back). After a successful
/// commit and a power loss every committed entry is there with its
/// location, and no entry was invented.
#[test]
fn torn_appends_lose_no_committed_entry() {
    use std::sync::atomic::Ordering;
    for fail_at in 0..120i64 {
        let io = Arc::new(FullIo::default());
        io.budget.store(i64::MAX, Ordering::SeqCst);
        let cfg = Config {
            memtable_entries: 5,
            max_runs: 3,
            mode: Mode::Eager,
            ..Default::default()
        };
        let open = |io: &Arc<FullIo>| Index::open_with(Box::new(io.clone()), cfg.clone()).unwrap();
        let mut ix = open(&io);
        io.budget.store(fail_at, Ordering::SeqCst);
        let mut failures = 0;
        for k in 0..=200u8 {
            let loc = 1000 + k as u64;
            // Retry each operation until it succeeds, space freed after
            // the first failure.
            loop {
                let r = ix.insert(key(k), loc, 0).and_then(|i| {
                    if k % 7 == 0 {
                        ix.commit()?;
                    }
                    Ok(i)
                });
                match r {
                    Ok(Inserted::New) | Ok(Inserted::Exists(_)) => break,
                    Ok(Inserted::NotIndexed) => panic!("no quota"),
                    Err(_) => {
                        failures += 1;
                        io.budget.store(i64::MAX, Ordering::SeqCst);
                    }
                }
            }
        }
        ix.commit().unwrap();
        io.mem.power_loss();
        drop(ix);
        let mut ix = open(&io);
        for k in 0..=255u8 {
            let want = (k <= 200).then_some(1000 + k as u64);
            assert_eq!(
                ix.lookup(key(k)).unwrap(),
                want,
                "fail_at {fail_at} key {k}"
            );
        }
        assert_eq!(ix.len(), 201, "fail_at {fail_at}");
        assert!(
            fail_at > 100 || failures == 1,
            "fail_at {fail_at}: {failures}"
        );
    }
}

/// An index on a [`FullIo`] with room for everything and a memtable that
/// never flushes (the log alone), holding keys 0, 1 and 2, each committed.
fn log_only_index_with_three_commits() -> (Arc<FullIo>, Config, Index) {
    use std::sync::atomic::Ordering;
    let io = Arc::new(FullIo::default());
    io.budget.store(i64::MAX, Ordering::SeqCst);
    let cfg = Config {
        memtable_entries: 1000,
        mode: Mode::Eager,
        ..Default::default()
    };
    let mut ix = Index::open_with(Box::new(io.clone()), cfg.clone()).unwrap();
    for k in 0..3u8 {
        ix.insert(key(k), k as u64, 0).unwrap();
        ix.commit().unwrap();
    }
    (io, cfg, ix)
}

/// The log alone (no flush): a commit whose append is torn by `ENOSPC`,
/// then successful commits. Replay must see every record after the tear.
#[test]
fn torn_log_append_hides_no_later_record() {
    use std::sync::atomic::Ordering;
    let (io, cfg, mut ix) = log_only_index_with_three_commits();
    ix.insert(key(3), 3, 0).unwrap();
    io.budget.store(0, Ordering::SeqCst);
    assert!(ix.commit().is_err(), "the torn append fails the commit");
    io.budget.store(i64::MAX, Ordering::SeqCst);
    for k in 4..10u8 {
        ix.insert(key(k), k as u64, 0).unwrap();
        ix.commit().unwrap();
    }
    io.mem.power_loss();
    drop(ix);
    let mut ix = Index::open_with(Box::new(io.clone()), cfg).unwrap();
    for k in 0..12u8 {
        let want = (k < 10).then_some(k as u64);
        assert_eq!(ix.lookup(key(k)).unwrap(), want, "key {k}");
    }
    assert_eq!(ix.len(), 10);
}

/// A log sync that fails and loses the unsynced records (as Linux may
/// drop pages whose writeback failed), then a successful commit: the lost
/// records are written again, nothing committed is missing after a power
/// loss.
#[test]
fn failed_log_sync_then_success_loses_nothing() {
    use std::sync::atomic::Ordering;
    let (io, cfg, mut ix) = log_only_index_with_three_commits();
    ix.insert(key(3), 3, 0).unwrap();
    ix.insert(key(4), 4, 0).unwrap();
    io.fail_sync.store(true, Ordering::SeqCst);
    assert!(ix.commit().is_err(), "the failed sync fails the commit");
    ix.insert(key(5), 5, 0).unwrap();
    ix.commit().unwrap();
    io.mem.power_loss();
    drop(ix);
    let mut ix = Index::open_with(Box::new(io.clone()), cfg).unwrap();
    for k in 0..8u8 {
        let want = (k < 6).then_some(k as u64);
        assert_eq!(ix.lookup(key(k)).unwrap(), want, "key {k}");
    }
    assert_eq!(ix.len(), 6);
}
