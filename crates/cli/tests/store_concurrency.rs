//! The inline store under concurrency (issue 11), through a real FUSE
//! mount: many writers and readers on one file and on many (rename and
//! unlink storms, open-unlink-read, `mmap` writes, parallel gc and
//! `ENOSPC` during compaction are in `store_storms.rs`). Every case checks each file against its writer's own
//! record (the word pattern `id<<48 | gen<<32 | offset/8` of
//! `store_faults.rs`), the errno or exit code, that nothing panicked,
//! that fsck is clean and that a remount serves the same bytes. Needs
//! root and /dev/fuse.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

mod store_common;
use store_common::*;

// ---------------------------------------------------------------------
// Many writers and readers on one file and on many.
// ---------------------------------------------------------------------

const WRITERS: u64 = 8;
/// Writer `w` owns the stripes `k * WRITERS + w` of the shared file; a
/// stripe is not a multiple of the 64 KiB chunk, so writers share chunks.
const STRIPE: u64 = 24 << 10;
const STRIPES_EACH: u64 = 12;
const SHARED_ID: u64 = 1000;

fn stripe_owner(off: u64) -> u64 {
    SHARED_ID + (off / STRIPE) % WRITERS
}

/// What one writer left: its own file's bytes, and its stripes of the
/// shared file by offset.
type WriterLog = (Vec<u8>, BTreeMap<u64, Vec<u8>>);

/// Writer `w`'s loop: rewrites its stripes of `shared` and its own file
/// `own-w` (overwrites, appends, truncates), fsyncs now and then and
/// checks after each step that its own ranges read as it last wrote them.
/// Returns the final content of `own-w` and of its stripes.
fn writer(mnt: &Path, w: u64, rounds: u64, seed: u64) -> WriterLog {
    let mut rng = Rng(seed | 1);
    let shared = File::options()
        .read(true)
        .write(true)
        .open(mnt.join("shared"))
        .unwrap();
    let own_path = mnt.join(format!("own-{w}"));
    let own = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&own_path)
        .unwrap();
    let mut own_log: Vec<u8> = Vec::new();
    let mut stripes = BTreeMap::new();
    for gen in 1..=rounds {
        let k = rng.below(STRIPES_EACH);
        let off = (k * WRITERS + w) * STRIPE;
        let data = pattern(SHARED_ID + w, gen, off, STRIPE);
        shared.write_all_at(&data, off).unwrap();
        stripes.insert(off, data);
        // own file: overwrite or append, sometimes truncate
        let id = w + 1;
        if rng.below(8) == 0 {
            let to = rng.below(own_log.len() as u64 + 1) & !7;
            own.set_len(to).unwrap();
            own_log.truncate(to as usize);
        } else {
            let off = rng.below(own_log.len() as u64 + 1) & !7;
            let len = (1 + rng.below(40_000)) * 8;
            let data = pattern(id, gen, off, len);
            own.write_all_at(&data, off).unwrap();
            let end = (off + len) as usize;
            if own_log.len() < end {
                own_log.resize(end, 0);
            }
            own_log[off as usize..end].copy_from_slice(&data);
        }
        if rng.below(6) == 0 {
            own.sync_all().unwrap();
            shared.sync_data().unwrap();
        }
        check_own(&shared, &own, &stripes, &own_log, w, gen);
    }
    (own_log, stripes)
}

fn check_own(
    shared: &File,
    own: &File,
    stripes: &BTreeMap<u64, Vec<u8>>,
    own_log: &[u8],
    w: u64,
    gen: u64,
) {
    for (off, want) in stripes {
        let mut got = vec![0u8; want.len()];
        shared.read_exact_at(&mut got, *off).unwrap();
        assert!(got == *want, "writer {w} gen {gen}: shared@{off} differs");
    }
    assert_eq!(own.metadata().unwrap().len(), own_log.len() as u64);
    let mut got = vec![0u8; own_log.len()];
    own.read_exact_at(&mut got, 0).unwrap();
    assert!(got == own_log, "writer {w} gen {gen}: own file differs");
}

/// Readers of the shared file: every word is zero or the word its
/// stripe's owner writes at that offset, whatever the interleaving.
fn reader(mnt: &Path, stop: &AtomicBool, reads: &AtomicU64) {
    let f = File::open(mnt.join("shared")).unwrap();
    let len = STRIPES_EACH * WRITERS * STRIPE;
    let mut rng = Rng(reads.fetch_add(1, Ordering::SeqCst) * 7919 + 17);
    while !stop.load(Ordering::SeqCst) {
        let at = rng.below(len) & !7;
        let mut buf = vec![0u8; (len - at).min(300 << 10) as usize];
        let n = f.read_at(&mut buf, at).unwrap();
        if let Some(bad) = foreign_word_at(&buf[..n & !7], at, stripe_owner) {
            panic!("reader: shared@{bad} holds a word nobody wrote there");
        }
        reads.fetch_add(1, Ordering::SeqCst);
    }
}

fn check_writers_results(mnt: &Path, results: &[WriterLog], when: &str) {
    let shared = std::fs::read(mnt.join("shared")).unwrap();
    assert_eq!(
        shared.len() as u64,
        STRIPES_EACH * WRITERS * STRIPE,
        "{when}"
    );
    if let Some(bad) = foreign_word_at(&shared, 0, stripe_owner) {
        panic!("{when}: shared@{bad} holds a word nobody wrote there");
    }
    for (w, (own, stripes)) in results.iter().enumerate() {
        let got = std::fs::read(mnt.join(format!("own-{w}"))).unwrap();
        assert!(got == *own, "{when}: own-{w} differs from its writer's log");
        for (off, want) in stripes {
            let got = &shared[*off as usize..*off as usize + want.len()];
            assert!(got == want.as_slice(), "{when}: shared@{off} (writer {w})");
        }
    }
}

#[test]
fn many_writers_and_readers_on_one_file_and_on_many() {
    require_fuse();
    let mut rng = Rng::seeded("writers");
    let s = scratch(&[]);
    let m = Mount::new(&s);
    let shared = File::create(s.mnt.join("shared")).unwrap();
    shared.set_len(STRIPES_EACH * WRITERS * STRIPE).unwrap();
    drop(shared);
    let stop = AtomicBool::new(false);
    let reads = AtomicU64::new(0);
    let seeds: Vec<u64> = (0..WRITERS).map(|_| rng.next()).collect();
    let results = std::thread::scope(|sc| {
        let readers: Vec<_> = (0..2)
            .map(|_| sc.spawn(|| reader(&s.mnt, &stop, &reads)))
            .collect();
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (mnt, seed) = (&s.mnt, seeds[w as usize]);
                sc.spawn(move || writer(mnt, w, 30, seed))
            })
            .collect();
        let r: Vec<_> = writers.into_iter().map(|h| h.join().unwrap()).collect();
        stop.store(true, Ordering::SeqCst);
        readers.into_iter().for_each(|h| h.join().unwrap());
        r
    });
    assert!(reads.load(Ordering::SeqCst) > 2, "the readers never ran");
    check_writers_results(&s.mnt, &results, "mounted");
    m.unmount();
    fsck_clean(&s.store);
    let m = Mount::new(&s);
    check_writers_results(&s.mnt, &results, "remounted");
    m.unmount();
}
