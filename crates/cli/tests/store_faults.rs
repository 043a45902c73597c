//! The inline store under faults (issue 11), through a real FUSE mount:
//! kill -9 of the mount process at random points of a mixed workload,
//! a full backing filesystem, flipped bytes in containers and metadata,
//! permissions and the store lock. Every case checks each file against an
//! independent record, the documented exit code or errno, that nothing
//! panicked, and that the store is usable afterwards (fsck clean,
//! remount). Needs root and /dev/fuse.
//!
//! `ONECOPY_FAULT_KILLS` sets the number of kills (CI: 30);
//! `bench/store-faults.sh` runs many more.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use onecopy_testfs::{FsKind, LoopFs};

mod store_common;
use store_common::*;

fn container_bytes_on_disk(store: &Path) -> u64 {
    let mut n = 0;
    for d in std::fs::read_dir(store.join("containers")).unwrap() {
        for f in std::fs::read_dir(d.unwrap().path()).unwrap() {
            n += f.unwrap().metadata().unwrap().len();
        }
    }
    n
}

// ---------------------------------------------------------------------
// The mixed workload and its independent record.
//
// File `id` is known by names `f<id>` and `f<id>-<n>` (renames and hard
// links keep the prefix). Every 8-byte word written to it at offset `o`
// is `id << 48 | gen << 32 | o / 8`: a word read back is either zero (a
// hole, a truncation, a lost write) or carries this file's id and its own
// offset, so a byte never written to the file is detected wherever it
// lands. Offsets and lengths are multiples of 8.
// ---------------------------------------------------------------------

#[derive(Default, Clone)]
struct FileRec {
    names: Vec<String>,
    content: Vec<u8>,
    /// Name and content at the last fsync (or as found after a restart),
    /// valid while `clean` (nothing touched the file since).
    synced: Option<(String, Vec<u8>)>,
    clean: bool,
}

#[derive(Default)]
struct Record {
    files: BTreeMap<u64, FileRec>,
    next_id: u64,
    next_name: u64,
    gen: u64,
    gcs: u64,
}

fn id_of(name: &str) -> Option<u64> {
    name.strip_prefix('f')?.split('-').next()?.parse().ok()
}

/// One random operation against the mount; the record is marked unclean
/// before the operation (it may half-happen at a kill) and updated after.
///
/// `live` is cleared just before the mount is killed: an operation that
/// ends after that may have run on the plain directory left under the
/// mount point by the unmount, so it is not recorded (nor checked).
fn step(
    mnt: &Path,
    store: &Path,
    rec: &Mutex<Record>,
    rng: &mut Rng,
    live: &AtomicBool,
) -> std::io::Result<()> {
    let (op, id, name) = {
        let mut r = rec.lock().unwrap();
        let op = rng.below(100);
        let ids: Vec<u64> = r.files.keys().copied().collect();
        if ids.is_empty() || op < 12 {
            r.next_id += 1;
            let id = r.next_id;
            r.files.insert(
                id,
                FileRec {
                    names: vec![format!("f{id}")],
                    ..FileRec::default()
                },
            );
            (0, id, format!("f{id}"))
        } else {
            let id = ids[rng.below(ids.len() as u64) as usize];
            let f = r.files.get_mut(&id).unwrap();
            f.clean = false;
            let name = f.names[rng.below(f.names.len() as u64) as usize].clone();
            (op, id, name)
        }
    };
    let path = mnt.join(&name);
    let upd = |f: &mut dyn FnMut(&mut Record)| {
        if live.load(Ordering::SeqCst) {
            f(&mut rec.lock().unwrap())
        }
    };
    match op {
        0 => {
            File::create(&path)?;
        }
        1..=39 => {
            // write, overwrite or append
            let size = rec.lock().unwrap().files[&id].content.len() as u64;
            let off = if op < 15 { size } else { rng.below(size + 1) } & !7;
            let len = (1 + rng.below(if op.is_multiple_of(3) {
                600_000
            } else {
                20_000
            })) * 8;
            let gen = {
                let mut r = rec.lock().unwrap();
                r.gen += 1;
                r.gen
            };
            let data = pattern(id, gen, off, len);
            File::options()
                .write(true)
                .open(&path)?
                .write_all_at(&data, off)?;
            upd(&mut |r| {
                let c = &mut r.files.get_mut(&id).unwrap().content;
                if c.len() < (off + len) as usize {
                    c.resize((off + len) as usize, 0);
                }
                c[off as usize..(off + len) as usize].copy_from_slice(&data);
            });
        }
        40..=49 => {
            let size = rec.lock().unwrap().files[&id].content.len() as u64;
            let to = rng.below(size + 200_000) & !7;
            File::options().write(true).open(&path)?.set_len(to)?;
            upd(&mut |r| r.files.get_mut(&id).unwrap().content.resize(to as usize, 0));
        }
        50..=69 => {
            File::options().write(true).open(&path)?.sync_all()?;
            upd(&mut |r| {
                let f = r.files.get_mut(&id).unwrap();
                f.synced = Some((name.clone(), f.content.clone()));
                f.clean = true;
            });
        }
        70..=77 => {
            let new = {
                let mut r = rec.lock().unwrap();
                r.next_name += 1;
                format!("f{id}-{}", r.next_name)
            };
            std::fs::rename(&path, mnt.join(&new))?;
            upd(&mut |r| {
                let f = r.files.get_mut(&id).unwrap();
                f.names.retain(|n| *n != name);
                f.names.push(new.clone());
            });
        }
        78..=83 => {
            let new = {
                let mut r = rec.lock().unwrap();
                r.next_name += 1;
                format!("f{id}-{}", r.next_name)
            };
            std::fs::hard_link(&path, mnt.join(&new))?;
            upd(&mut |r| r.files.get_mut(&id).unwrap().names.push(new.clone()));
        }
        84..=91 => {
            std::fs::remove_file(&path)?;
            upd(&mut |r| {
                let f = r.files.get_mut(&id).unwrap();
                f.names.retain(|n| *n != name);
                if f.names.is_empty() {
                    r.files.remove(&id);
                }
            });
        }
        92..=96 => {
            // read back and compare while running
            let got = std::fs::read(&path)?;
            let r = rec.lock().unwrap();
            assert!(
                !live.load(Ordering::SeqCst) || got == r.files[&id].content,
                "{name}: read differs from what was written (live)"
            );
        }
        _ => {
            // online gc through the mount process (it may be killed during it)
            let out = onecopy(&["store", "gc", store.to_str().unwrap()]);
            if !out.status.success() {
                return Err(std::io::Error::other("gc failed"));
            }
            rec.lock().unwrap().gcs += 1;
        }
    }
    Ok(())
}

/// After a restart: every name belongs to a file of the record, every
/// word is the file's own or zero, every clean fsync'd file reads exactly
/// as at its fsync. The record is then reset to what the store holds.
fn check_after_restart(mnt: &Path, rec: &Mutex<Record>, round: usize) {
    let mut r = rec.lock().unwrap();
    let mut found: BTreeMap<u64, FileRec> = BTreeMap::new();
    for e in std::fs::read_dir(mnt).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        let id = id_of(&name).unwrap_or_else(|| panic!("round {round}: stray name {name}"));
        assert!(id <= r.next_id, "round {round}: {name} was never created");
        let data = std::fs::read(e.path()).unwrap();
        if let Some(at) = foreign_word(id, &data) {
            panic!("round {round}: {name} holds bytes never written to it at {at}");
        }
        let f = found.entry(id).or_default();
        if !f.names.is_empty() {
            assert_eq!(f.content, data, "round {round}: hard links of {id} differ");
        }
        f.names.push(name);
        f.content = data;
    }
    for (id, f) in &r.files {
        if let (true, Some((name, content))) = (f.clean, &f.synced) {
            let got = found.get(id).filter(|g| g.names.contains(name));
            let got = got.unwrap_or_else(|| panic!("round {round}: fsync'd {name} is gone"));
            assert!(
                got.content == *content,
                "round {round}: fsync'd {name} lost bytes ({} vs {} bytes)",
                got.content.len(),
                content.len()
            );
        }
    }
    for f in found.values_mut() {
        f.synced = Some((f.names[0].clone(), f.content.clone()));
        f.clean = true;
    }
    r.files = found;
}

fn kills() -> usize {
    std::env::var("ONECOPY_FAULT_KILLS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30)
}

#[test]
fn kill_9_at_random_points_of_a_mixed_workload() {
    require_fuse();
    for chunking in ["fixed:64K", "cdc:16K/64K/256K"] {
        kill_rounds(chunking, kills() / 2);
    }
}

fn kill_rounds(chunking: &str, rounds: usize) {
    // A 16-entry memtable: the fingerprint index writes a run, and merges
    // runs, every few dozen chunks, so kills land in those too.
    let s = scratch(&[
        "--chunking",
        chunking,
        "--container-size",
        "1M",
        "--index-memtable",
        "16",
    ]);
    let mut rng = Rng::seeded(chunking);
    let rec = Arc::new(Mutex::new(Record::default()));
    for round in 0..rounds {
        let m = Mount::new(&s);
        let (mnt, store, rec2) = (s.mnt.clone(), s.store.clone(), rec.clone());
        let mut wrng = Rng(rng.next() | 1);
        let live = Arc::new(AtomicBool::new(true));
        let live2 = live.clone();
        let worker = std::thread::spawn(move || {
            while live2.load(Ordering::SeqCst)
                && step(&mnt, &store, &rec2, &mut wrng, &live2).is_ok()
            {}
        });
        std::thread::sleep(Duration::from_millis(100 + rng.below(900)));
        live.store(false, Ordering::SeqCst);
        m.kill();
        worker.join().expect("workload thread");
        fsck_clean(&s.store);
        let m = Mount::new(&s);
        check_after_restart(&s.mnt, &rec, round);
        m.unmount();
    }
    let runs = std::fs::read_dir(s.store.join("index"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("run-")
        })
        .count();
    assert!(runs >= 1, "the fingerprint index never wrote a run");
    // No leak: after gc every stored chunk is referenced, and once every
    // file is gone gc leaves no chunk and at most the open container.
    let out = onecopy(&["store", "gc", s.store.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let st = stats(&s.store);
    assert_eq!(st["unreferenced_chunks"], 0, "{st}");
    assert!(
        st["unique_bytes"].as_u64() <= st["logical_bytes"].as_u64(),
        "{st}"
    );
    let m = Mount::new(&s);
    for e in std::fs::read_dir(&s.mnt).unwrap() {
        std::fs::remove_file(e.unwrap().path()).unwrap();
    }
    m.unmount();
    let out = onecopy(&["store", "gc", s.store.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let st = stats(&s.store);
    assert_eq!(
        (st["chunks"].as_u64(), st["stored_bytes"].as_u64()),
        (Some(0), Some(0)),
        "{st}"
    );
    let left = container_bytes_on_disk(&s.store);
    assert!(left <= 2 << 20, "{left} container bytes left with no data");
    fsck_clean(&s.store);
    eprintln!(
        "{chunking}: {rounds} kills, {} online gcs",
        rec.lock().unwrap().gcs
    );
}

// ---------------------------------------------------------------------
// Corruption.
// ---------------------------------------------------------------------

/// Records of every container: (container path, record offset, stored len).
fn records(store: &Path) -> Vec<(PathBuf, u64, u64)> {
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(store.join("containers"))
        .unwrap()
        .flat_map(|d| std::fs::read_dir(d.unwrap().path()).unwrap())
        .map(|f| f.unwrap().path())
        .collect();
    files.sort();
    for p in files {
        let bytes = std::fs::read(&p).unwrap();
        let mut at = 16usize;
        while at + 48 <= bytes.len() {
            let stored = u32::from_le_bytes(bytes[at + 36..at + 40].try_into().unwrap()) as usize;
            out.push((p.clone(), at as u64, stored as u64));
            at += 48 + stored;
        }
    }
    out
}

fn flip(path: &Path, at: u64) {
    let f = File::options().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x5a;
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn flipped_bytes_are_reported_and_read_as_eio() {
    require_fuse();
    let mut rng = Rng::seeded("corruption");
    let s = scratch(&["--compress", "none", "--container-size", "1M"]);
    let m = Mount::new(&s);
    let mut want = BTreeMap::new();
    for id in 1..=6u64 {
        let data = pattern(id, 1, 0, (1 << 20) + id * 4096);
        std::fs::write(s.mnt.join(format!("f{id}")), &data).unwrap();
        want.insert(id, data);
    }
    m.unmount();
    // Damage three distinct chunks: a payload byte (past the first word,
    // which says whose chunk it is), a header byte, a CRC byte.
    let recs = records(&s.store);
    assert!(recs.len() >= 6 * 16, "{} records", recs.len());
    let mut damaged = BTreeMap::new();
    for (k, field) in [(0usize, "payload"), (1, "raw length"), (2, "crc")] {
        let (path, at, stored) = loop {
            let r = &recs[rng.below(recs.len() as u64) as usize];
            let bytes = std::fs::read(&r.0).unwrap();
            let w = u64::from_le_bytes(bytes[r.1 as usize + 48..][..8].try_into().unwrap());
            let key = (w >> 48, (w & 0xffff_ffff) * 8);
            if let std::collections::btree_map::Entry::Vacant(e) = damaged.entry(key) {
                e.insert(field);
                break r.clone();
            }
        };
        let pos = match k {
            0 => at + 48 + 8 + rng.below(stored - 8),
            1 => at + 32,
            _ => at + 44,
        };
        flip(&path, pos);
    }
    let scrub = onecopy(&["store", "scrub", s.store.to_str().unwrap()]);
    assert_eq!(scrub.status.code(), Some(1), "{scrub:?}");
    let text = String::from_utf8_lossy(&scrub.stdout);
    assert!(text.contains(", 3 damaged"), "scrub: {text}");
    // Through the mount: a damaged chunk is EIO, every other byte reads
    // exactly as written.
    let m = Mount::new(&s);
    for (id, data) in &want {
        let f = File::open(s.mnt.join(format!("f{id}"))).unwrap();
        for off in (0..data.len() as u64).step_by(64 << 10) {
            let n = (64 << 10).min(data.len() - off as usize);
            let mut buf = vec![0u8; n];
            let r = f.read_exact_at(&mut buf, off);
            if damaged.contains_key(&(*id, off)) {
                let e = r.expect_err("damaged chunk read");
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "f{id}@{off}: {e}");
            } else {
                r.unwrap_or_else(|e| panic!("f{id}@{off}: {e}"));
                assert!(
                    buf == data[off as usize..off as usize + n],
                    "f{id}@{off}: wrong bytes"
                );
            }
        }
    }
    m.unmount();
    // fsck --repair names what it cannot salvage and exits 1.
    let fsck = onecopy(&["store", "fsck", "--repair", s.store.to_str().unwrap()]);
    assert_eq!(fsck.status.code(), Some(1), "{fsck:?}");
    let text = String::from_utf8_lossy(&fsck.stdout);
    for (id, off) in damaged.keys() {
        assert!(
            text.contains(&format!("offset {off}")),
            "fsck does not name f{id}@{off}: {text}"
        );
    }
    // The store stays usable: new writes and remount work.
    let m = Mount::new(&s);
    std::fs::write(s.mnt.join("new"), b"after damage").unwrap();
    m.unmount();
    let m = Mount::new(&s);
    assert_eq!(std::fs::read(s.mnt.join("new")).unwrap(), b"after damage");
    m.unmount();
}

#[test]
fn damaged_metadata_is_an_error_not_a_panic() {
    require_fuse();
    let s = scratch(&[]);
    let m = Mount::new(&s);
    std::fs::write(s.mnt.join("a"), b"x").unwrap();
    m.unmount();
    let st = s.store.to_str().unwrap();
    let db = s.store.join("meta.sqlite");
    let good = std::fs::read(&db).unwrap();
    // The SQLite header overwritten: every command fails with exit 4.
    let mut bad = good.clone();
    bad[..16].copy_from_slice(b"garbage garbage!");
    std::fs::write(&db, &bad).unwrap();
    for args in [
        vec!["store", "fsck", st],
        vec!["store", "scrub", st],
        vec!["store", "gc", st],
    ] {
        let out = onecopy(&args);
        assert_eq!(out.status.code(), Some(4), "{args:?}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("metadata database"));
    }
    let out = onecopy(&["mount", st, s.mnt.to_str().unwrap()]);
    assert!(!out.status.success() && !is_mounted(&s.mnt), "{out:?}");
    // A damaged store.json: not a store (exit 2).
    std::fs::write(&db, &good).unwrap();
    std::fs::write(s.store.join("store.json"), b"{\"magic\":").unwrap();
    let out = onecopy(&["store", "fsck", st]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// Flips one byte in `what` (a file name prefix under DIR/index) at
/// `at`, or mid-file; returns the file's name.
fn flip_index_file(store: &Path, what: &str, at: Option<u64>) -> String {
    let dir = store.join("index");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(what))
        .collect();
    names.sort();
    let name = names
        .first()
        .unwrap_or_else(|| panic!("no {what} in {names:?}"));
    let len = std::fs::metadata(dir.join(name)).unwrap().len();
    assert!(len > 0, "{name} is empty");
    flip(&dir.join(name), at.unwrap_or(len / 2));
    name.clone()
}

fn duplicate_bytes(store: &Path) -> u64 {
    stats(store)["written_duplicate_bytes"].as_u64().unwrap()
}

/// Issue 11: flipped bytes in each kind of index file (manifest, live
/// bitmap, a run page, a segment page, the log) of an unmounted store.
/// fsck reports it (exit 1); a mount returns exactly the written bytes and
/// takes every write (damage costs dedupe, never data: hits are confirmed
/// against the row's full hash and a damaged page turns the index off
/// until it is rebuilt); `fsck --repair` rebuilds it; new copies dedupe.
#[test]
fn flipped_index_bytes_cost_dedupe_never_data() {
    require_fuse();
    const LEN: u64 = 512 << 10;
    let files = |m: &Path, prefix: &str| {
        for id in 1..=9u64 {
            let got = std::fs::read(m.join(format!("{prefix}{id}"))).unwrap();
            assert!(got == pattern(id, 1, 0, LEN), "{prefix}{id}: wrong bytes");
        }
    };
    // 72 chunks, a 16-entry memtable: runs, merges, and 8 records in the log.
    for (what, at) in [
        ("MANIFEST", None),
        ("live-", None),
        ("run-", Some(100)),
        ("segments", Some(100)),
        ("log-", None),
    ] {
        let s = scratch(&["--compress", "none", "--index-memtable", "16"]);
        let st = s.store.to_str().unwrap();
        let m = Mount::new(&s);
        for id in 1..=9u64 {
            std::fs::write(s.mnt.join(format!("f{id}")), pattern(id, 1, 0, LEN)).unwrap();
        }
        m.unmount();
        let name = flip_index_file(&s.store, what, at);
        // scrub reports it too (on a copy: the open that finds the damage
        // rebuilds the index, and fsck below must still see it).
        let copy = s.store.with_extension("scrubbed");
        let cp = std::process::Command::new("cp")
            .args(["-a", st, copy.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(cp.success());
        let scrub = onecopy(&["store", "scrub", copy.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&scrub.stdout);
        assert_eq!(scrub.status.code(), Some(1), "{name}: scrub: {scrub:?}");
        assert!(text.contains("fingerprint index"), "{name}: scrub: {text}");
        // Not counted as damaged chunks: every chunk reads back exactly.
        assert!(
            text.contains(", 0 damaged; fingerprint index: "),
            "{name}: scrub: {text}"
        );
        std::fs::remove_dir_all(&copy).unwrap();
        let fsck = onecopy(&["store", "fsck", st]);
        let text = String::from_utf8_lossy(&fsck.stdout);
        assert_eq!(fsck.status.code(), Some(1), "{name}: {fsck:?}");
        assert!(text.contains("fingerprint index"), "{name}: {text}");
        // Served exactly, and copies are taken (deduped or not).
        let m = Mount::new(&s);
        files(&s.mnt, "f");
        for id in 1..=9u64 {
            std::fs::write(s.mnt.join(format!("d{id}")), pattern(id, 1, 0, LEN)).unwrap();
        }
        files(&s.mnt, "d");
        m.unmount();
        let fsck = onecopy(&["store", "fsck", "--repair", st]);
        assert!(fsck.status.success(), "{name}: repair: {fsck:?}");
        fsck_clean(&s.store);
        // Rebuilt: a new copy dedupes, everything still reads back.
        let before = duplicate_bytes(&s.store);
        let m = Mount::new(&s);
        std::fs::write(s.mnt.join("c1"), pattern(1, 1, 0, LEN)).unwrap();
        m.unmount();
        assert_eq!(
            duplicate_bytes(&s.store) - before,
            LEN,
            "{name}: no dedupe after repair"
        );
        let m = Mount::new(&s);
        files(&s.mnt, "f");
        files(&s.mnt, "d");
        m.unmount();
        fsck_clean(&s.store);
    }
}

// ---------------------------------------------------------------------
// Out of space.
// ---------------------------------------------------------------------

fn random_bytes(rng: &mut Rng, len: usize) -> Vec<u8> {
    (0..len.div_ceil(8))
        .flat_map(|_| rng.next().to_le_bytes())
        .take(len)
        .collect()
}

/// Writes and fsyncs `data` as `path`; the errno of the first failure.
fn write_synced(path: &Path, data: &[u8]) -> Result<(), i32> {
    let r = (|| {
        let f = File::create(path)?;
        f.write_all_at(data, 0)?;
        f.sync_all()
    })();
    r.map_err(|e| e.raw_os_error().unwrap_or(-1))
}

#[test]
fn full_backing_filesystem_gives_enospc_and_recovers() {
    require_fuse();
    let mut rng = Rng::seeded("enospc");
    let lo = LoopFs::new(FsKind::Ext4, 64 << 20).unwrap();
    let s = scratch_in(lo.path(), &["--compress", "none", "--container-size", "1M"]);
    let ballast = lo.path().join("ballast");
    std::fs::write(&ballast, vec![1u8; 8 << 20]).unwrap();
    let m = Mount::new(&s);
    let mut kept = BTreeMap::new();
    let mut err = None;
    for i in 0..40 {
        let data = random_bytes(&mut rng, (2 << 20) + i * 4096);
        let name = format!("f{i}");
        match write_synced(&s.mnt.join(&name), &data) {
            Ok(()) => {
                kept.insert(name, data);
            }
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    assert_eq!(err, Some(libc::ENOSPC), "the program sees ENOSPC");
    // Still serving: what was fsync'd reads back.
    for (name, data) in &kept {
        assert!(std::fs::read(s.mnt.join(name)).unwrap() == *data, "{name}");
    }
    // gc on the full disk: it succeeds, stops compacting (exit 1) or
    // fails with exit 4 and says so, and the mount keeps serving what was
    // there.
    // An unlink on the full disk may fail with ENOSPC (SQLite needs room
    // in its WAL, there is no reserve yet); then the file is intact.
    let first = kept.keys().next().unwrap().clone();
    match std::fs::remove_file(s.mnt.join(&first)) {
        Ok(()) => {
            kept.remove(&first);
        }
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "unlink: {e}"),
    }
    let gc = onecopy(&["store", "gc", s.store.to_str().unwrap()]);
    assert!(matches!(gc.status.code(), Some(0 | 1 | 4)), "{gc:?}");
    for (name, data) in &kept {
        assert!(
            std::fs::read(s.mnt.join(name)).unwrap() == *data,
            "{name} after gc on a full disk"
        );
    }
    // Space freed outside the store: service is normal again.
    std::fs::remove_file(&ballast).unwrap();
    let data = random_bytes(&mut rng, 3 << 20);
    write_synced(&s.mnt.join("after"), &data).expect("write once space is freed");
    kept.insert("after".into(), data);
    // Space freed inside the store: delete files, online gc, write again.
    let gone: Vec<String> = kept.keys().filter(|n| n.len() == 2).cloned().collect();
    for name in &gone {
        std::fs::remove_file(s.mnt.join(name)).unwrap();
        kept.remove(name);
    }
    let gc = onecopy(&["store", "gc", s.store.to_str().unwrap()]);
    assert!(gc.status.success(), "{gc:?}");
    let mut more = 0;
    for i in 0..8 {
        let data = random_bytes(&mut rng, 2 << 20);
        let name = format!("g{i}");
        if write_synced(&s.mnt.join(&name), &data).is_ok() {
            kept.insert(name, data);
            more += 1;
        }
    }
    assert!(more >= 4, "only {more} files fit after gc freed space");
    m.unmount();
    fsck_clean(&s.store);
    let m = Mount::new(&s);
    for (name, data) in &kept {
        assert!(
            std::fs::read(s.mnt.join(name)).unwrap() == *data,
            "{name} after remount"
        );
    }
    m.unmount();
}

/// Writes `data` as the new file `path` and closes it without an fsync;
/// the errno of the first failure, the close's included (its `FLUSH`
/// carries a failed write-back).
fn write_closed(path: &Path, data: &[u8]) -> Result<(), i32> {
    use std::io::Write;
    use std::os::fd::IntoRawFd;
    let errno = |e: std::io::Error| e.raw_os_error().unwrap_or(-1);
    let mut f = File::create(path).map_err(errno)?;
    f.write_all(data).map_err(errno)?;
    match unsafe { libc::close(f.into_raw_fd()) } {
        0 => Ok(()),
        _ => Err(errno(std::io::Error::last_os_error())),
    }
}

/// 1-24 KiB that compress about by half: words from a small vocabulary
/// between runs of random bytes, unlike any other file's.
fn small_text(rng: &mut Rng) -> Vec<u8> {
    let len = 1024 + rng.below(23 << 10) as usize;
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        match rng.below(3) {
            0 => out.extend_from_slice(&rng.next().to_le_bytes()),
            _ => out.extend_from_slice(
                ["alpha ", "beta ", "gamma ", "delta\n"][rng.below(4) as usize].as_bytes(),
            ),
        }
    }
    out.truncate(len);
    out
}

/// Small files closed without an fsync are stored later, packed together
/// by the mount's releasing thread: the room they take is promised when
/// they are written. On a disk that fills, a program gets `ENOSPC` from a
/// create, a write or the close, and every file whose close succeeded
/// reads back whole, before and after a remount, with packs in the store.
#[test]
fn small_files_closed_on_a_filling_disk_are_packed_and_kept() {
    require_fuse();
    let mut rng = Rng::seeded("enospc-packs");
    let lo = LoopFs::new(FsKind::Ext4, 64 << 20).unwrap();
    let s = scratch_in(lo.path(), &["--container-size", "1M"]);
    let m = Mount::new(&s);
    let mut kept = BTreeMap::new();
    let mut err = None;
    for i in 0..60_000u64 {
        let dir = s.mnt.join(format!("d{}", i / 256));
        if i % 256 == 0 {
            if let Err(e) = std::fs::create_dir(&dir) {
                err = e.raw_os_error();
                break;
            }
        }
        let name = format!("d{}/f{i}", i / 256);
        let data = small_text(&mut rng);
        match write_closed(&s.mnt.join(&name), &data) {
            Ok(()) => {
                kept.insert(name, data);
            }
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    eprintln!("{} files closed before {err:?}", kept.len());
    assert_eq!(err, Some(libc::ENOSPC), "the program sees ENOSPC");
    assert!(kept.len() > 1000, "only {} files fit", kept.len());
    let check = |when: &str| {
        for (name, data) in &kept {
            let got = std::fs::read(s.mnt.join(name));
            assert!(got.as_ref().ok() == Some(data), "{name} {when}: {got:?}");
        }
    };
    check("on the full disk");
    m.unmount();
    fsck_clean(&s.store);
    let db = rusqlite::Connection::open(s.store.join("meta.sqlite")).unwrap();
    let packed: u64 = db
        .query_row(
            "SELECT count(*) FROM chunks WHERE inner IS NOT NULL",
            [],
            |r| r.get(0),
        )
        .unwrap();
    drop(db);
    assert!(packed > 100, "only {packed} chunks packed");
    let m = Mount::new(&s);
    check("after a remount");
    m.unmount();
}

/// Issue 11: the index's disk fills while it flushes runs and merges them
/// (a 16-entry memtable: a run every 16 new chunks; DIR/index on a small
/// filesystem of its own so that its writes are the ones that fail).
/// Programs get ENOSPC or success, never wrong data (a file whose fsync
/// failed holds its own words or zeros); once space is freed service is
/// normal, and fsck is clean or `fsck --repair` rebuilds the index.
#[test]
fn enospc_during_index_flushes_and_merges() {
    require_fuse();
    const LEN: u64 = 64 << 10;
    let lo = LoopFs::new(FsKind::Ext4, 64 << 20).unwrap();
    let s = scratch_in(lo.path(), &["--compress", "none", "--index-memtable", "16"]);
    // DIR/index on a filesystem of its own, filled up: only the index's
    // writes (log appends, runs, segment pages, bitmap, manifest) fail.
    let small = LoopFs::new(FsKind::Ext4, 32 << 20).unwrap();
    let index = s.store.join("index");
    let moved = small.path().join("index");
    std::fs::create_dir(&moved).unwrap();
    if index.exists() {
        for e in std::fs::read_dir(&index).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), moved.join(e.file_name())).unwrap();
        }
        std::fs::remove_dir_all(&index).unwrap();
    }
    std::os::unix::fs::symlink(&moved, &index).unwrap();
    let ballast = small.path().join("ballast");
    let m = Mount::new(&s);
    // name -> pattern id; new files and copies of earlier ones (index hits).
    let mut kept: BTreeMap<String, u64> = BTreeMap::new();
    let mut errors = Vec::new();
    type Failed = Vec<(String, u64, i32)>;
    let write = |i: u64, kept: &mut BTreeMap<String, u64>, errors: &mut Failed| {
        let id = if i % 3 == 2 { i - 1 } else { i + 1 };
        let name = format!("f{i}");
        match write_synced(&s.mnt.join(&name), &pattern(id, 1, 0, LEN)) {
            Ok(()) => {
                kept.insert(name, id);
            }
            Err(e) => errors.push((name, id, e)),
        }
    };
    for i in 0..30 {
        write(i, &mut kept, &mut errors);
    }
    assert!(errors.is_empty(), "{errors:?}");
    fill_leaving(&ballast, 0);
    for i in 30..130 {
        write(i, &mut kept, &mut errors);
    }
    eprintln!("{} written, {} failed", kept.len(), errors.len());
    assert!(!errors.is_empty(), "the index's disk never filled");
    assert!(
        kept.len() > 30,
        "copies (no new entries) still succeed on the full disk"
    );
    for (name, id, e) in &errors {
        assert_eq!(*e, libc::ENOSPC, "{name}");
        if let Ok(got) = std::fs::read(s.mnt.join(name)) {
            assert_eq!(
                foreign_word(*id, &got),
                None,
                "{name}: a word never written"
            );
        }
    }
    let check = |mnt: &Path, kept: &BTreeMap<String, u64>, when: &str| {
        for (name, id) in kept {
            let got = std::fs::read(mnt.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(got == pattern(*id, 1, 0, LEN), "{name} {when}: wrong bytes");
        }
    };
    check(&s.mnt, &kept, "on the full disk");
    std::fs::remove_file(&ballast).unwrap();
    for i in 200..212u64 {
        let id = if i % 2 == 0 { i } else { 1 };
        let name = format!("g{i}");
        write_synced(&s.mnt.join(&name), &pattern(id, 1, 0, LEN)).expect("write once freed");
        kept.insert(name, id);
    }
    check(&s.mnt, &kept, "once space is freed");
    m.unmount();
    let st = s.store.to_str().unwrap();
    let fsck = onecopy(&["store", "fsck", st]);
    let text = String::from_utf8_lossy(&fsck.stdout).into_owned();
    if !fsck.status.success() {
        assert_eq!(fsck.status.code(), Some(1), "{fsck:?}");
        for line in text.lines().filter(|l| !l.contains("problems")) {
            assert!(
                line.contains("fingerprint index"),
                "not an index finding: {line}"
            );
        }
        let repair = onecopy(&["store", "fsck", "--repair", st]);
        assert!(repair.status.success(), "{repair:?}");
    }
    eprintln!("fsck after the full disk: {text}");
    fsck_clean(&s.store);
    let m = Mount::new(&s);
    check(&s.mnt, &kept, "after remount");
    m.unmount();
}

// ---------------------------------------------------------------------
// Permissions and the lock.
// ---------------------------------------------------------------------

/// Runs `sh -c script` as user and group 65534 (nobody).
fn as_nobody(script: &str) -> Output {
    Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            script,
        ])
        .output()
        .unwrap()
}

#[test]
fn store_is_private_locked_and_checks_permissions() {
    require_fuse();
    let s = scratch(&[]);
    let mode = std::fs::metadata(&s.store).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o700, "store directory mode {mode:o}");
    let m = Mount::new(&s);
    // A second mount (or offline command) of the same store is refused.
    let other = s.store.with_extension("mnt2");
    std::fs::create_dir(&other).unwrap();
    let out = onecopy(&[
        "mount",
        "-f",
        s.store.to_str().unwrap(),
        other.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("in use"));
    assert!(!is_mounted(&other));
    // Another user: the kernel checks the mode bits (default_permissions).
    let mnt = s.mnt.to_str().unwrap();
    std::fs::write(s.mnt.join("secret"), b"root only").unwrap();
    std::fs::set_permissions(s.mnt.join("secret"), PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::create_dir(s.mnt.join("pub")).unwrap();
    std::fs::set_permissions(s.mnt.join("pub"), PermissionsExt::from_mode(0o777)).unwrap();
    std::fs::write(s.mnt.join("suid"), b"program").unwrap();
    std::fs::set_permissions(s.mnt.join("suid"), PermissionsExt::from_mode(0o6777)).unwrap();
    for script in [
        format!("cat {mnt}/secret"),
        format!("echo x >> {mnt}/secret"),
        format!("echo x > {mnt}/new"),
        format!("mkdir {mnt}/d"),
        format!("rm {mnt}/suid"),
    ] {
        let out = as_nobody(&script);
        assert!(!out.status.success(), "{script} succeeded as nobody");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
            "{script}: {out:?}"
        );
    }
    let out = as_nobody(&format!("echo mine > {mnt}/pub/mine && cat {mnt}/pub/mine"));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "mine\n", "{out:?}");
    // A write by another user clears setuid and setgid.
    let out = as_nobody(&format!("echo more >> {mnt}/suid"));
    assert!(out.status.success(), "{out:?}");
    let mode = std::fs::metadata(s.mnt.join("suid")).unwrap().mode() & 0o7777;
    assert_eq!(
        mode, 0o777,
        "setuid/setgid kept after a write by another user"
    );
    assert_eq!(std::fs::read(s.mnt.join("secret")).unwrap(), b"root only");
    // `system.*` names other than the POSIX ACLs are nobody's to set or
    // remove (the kernel leaves them to the filesystem): EOPNOTSUPP, as on
    // ext4 and tmpfs, for root too.
    for script in [
        format!("setfattr -n system.evil -v pwned {mnt}/secret"),
        format!("setfattr -x system.evil {mnt}/secret"),
    ] {
        let as_root = Command::new("sh").args(["-c", &script]).output().unwrap();
        for out in [as_nobody(&script), as_root] {
            assert!(!out.status.success(), "{script}: {out:?}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("Operation not supported"), "{script}: {err}");
        }
    }
    let out = sh(&format!(
        "setfacl -m u:65534:r {mnt}/secret && getfacl -c {mnt}/secret"
    ));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("user:nobody:r--"),
        "{out:?}"
    );
    assert_eq!(as_nobody(&format!("cat {mnt}/secret")).stdout, b"root only");
    m.unmount();
    fsck_clean(&s.store);
}

/// The setuid/setgid/capability cases (run by [`cases_in`]), each
/// as `name: result` lines.
const SETID_CASES: &str = r#"
nb() { setpriv --reuid=65534 --regid=65534 --clear-groups sh -c "$1" 2>/dev/null; }
new() { echo p > "$1"; chmod "$2" "$1"; }
md() { echo "$1: $(stat -c %a "$1")"; }
cap() { echo "$1: '$(getcap "$1" | cut -d' ' -f2)'"; }
new w1 6777; nb 'echo x >> w1'; md w1
new w2 6777; echo x >> w2; md w2
new w3 2777; nb 'echo x >> w3'; md w3
new w4 2767; nb 'echo x >> w4'; md w4
new w5 777; nb 'echo x >> w5'; chmod 6777 w5; nb 'echo y >> w5'; md w5
new c1 6777; chown 65534 c1; md c1
new c2 6755; chown 65534:65534 c2; md c2
new c3 6777; chgrp 65534 c3; md c3
new t1 6777; nb 'truncate -s 1 t1'; md t1
new t2 6777; truncate -s 1 t2; md t2
new t3 6777; nb ': > t3'; md t3
new f1 6777; nb 'fallocate -l 1M f1'; md f1
new u1 6777; nb 'touch u1'; md u1
new k1 644; setcap cap_net_raw+ep k1; echo x >> k1; cap k1
new k2 644; setcap cap_net_raw+ep k2; chown 65534 k2; cap k2
new k3 644; setcap cap_net_raw+ep k3; truncate -s 0 k3; cap k3
new k4 644; echo y >> k4; setcap cap_net_raw+ep k4; cap k4; echo z >> k4; cap k4
"#;

/// Runs shell `script` in `dir`, made reachable (and writable) for user
/// nobody, as root; its output.
fn cases_in(dir: &Path, script: &str) -> String {
    let mut p = dir.to_path_buf();
    while p.pop() && p != Path::new("/") {
        let mode = std::fs::metadata(&p).unwrap().mode();
        std::fs::set_permissions(&p, PermissionsExt::from_mode(mode | 0o711)).unwrap();
    }
    std::fs::set_permissions(dir, PermissionsExt::from_mode(0o777)).unwrap();
    let out = Command::new("sh")
        .current_dir(dir)
        .args(["-c", script])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// Writes, truncates, `fallocate`s and `chown`s clear setuid, setgid
/// and `security.capability` through the mount exactly as the kernel does
/// on a local filesystem (the mount clears setuid/setgid itself, having
/// taken that job over with FUSE_HANDLE_KILLPRIV_V2): the same script's
/// output on the backing filesystem is the oracle.
#[test]
fn setid_bits_and_capabilities_clear_as_on_a_local_filesystem() {
    require_fuse();
    assert!(
        Command::new("setcap").arg("-v").output().is_ok(),
        "setcap is missing (scripts/test.sh installs libcap2-bin)"
    );
    let s = scratch(&[]);
    let native = s.mnt.with_extension("native");
    std::fs::create_dir(&native).unwrap();
    let want = cases_in(&native, SETID_CASES);
    // The cases did something: the local filesystem cleared these.
    let cleared = [
        "w1: 777",
        "w2: 6777",
        "c1: 777",
        "t1: 777",
        "k1: ''",
        "k4: 'cap_net_raw=ep'\nk4: ''",
    ];
    for line in cleared {
        assert!(want.contains(line), "{line} not in\n{want}");
    }
    let m = Mount::new(&s);
    let got = cases_in(&s.mnt, SETID_CASES);
    assert_eq!(got, want, "through the mount vs the local filesystem");
    m.unmount();
    fsck_clean(&s.store);
}

/// POSIX ACL cases: each line prints what a user sees (`ok`/`denied`),
/// modes, and `getfacl` of new nodes. `nb` runs as nobody.
const ACL_CASES: &str = r#"
nb() { setpriv --reuid=65534 --regid=65534 --clear-groups sh -c "$1" 2>/dev/null && echo ok || echo denied; }
md() { echo "$1: $(stat -c %a "$1")"; }
fa() { getfacl -cp "$1" 2>/dev/null | sed "s|^|$1 |"; }
umask 022
echo secret > a1; chmod 644 a1; setfacl -m u:nobody:--- a1; echo "a1 read: $(nb 'cat a1 >/dev/null')"; md a1
echo x > a2; chmod 600 a2; setfacl -m u:nobody:rw- a2; echo "a2 write: $(nb 'echo y >> a2')"; md a2
echo x > a3; setfacl -m u:nobody:rw-,m::r-- a3; echo "a3 write: $(nb 'echo y >> a3')"; md a3
echo x > a4; setfacl -m u:nobody:rwx a4; chmod 604 a4; md a4; fa a4; echo "a4 write: $(nb 'echo y >> a4')"
mkdir d1; chmod 777 d1; setfacl -m u:nobody:--x d1; echo "d1 list: $(nb 'ls d1 >/dev/null')"; echo "d1 create: $(nb 'touch d1/n')"
mkdir d2; setfacl -d -m u:nobody:rwx,m::rwx d2; setfacl -m u:nobody:rwx d2
touch d2/f; md d2/f; fa d2/f
mkdir d2/sub; md d2/sub; fa d2/sub
echo "d2/f write: $(nb 'echo z >> d2/f')"
(umask 077; touch d2/g); md d2/g; fa d2/g
chmod 640 d2/f; md d2/f; fa d2/f
mkdir d3; touch d3/f; md d3/f; fa d3/f
"#;

/// POSIX ACLs are enforced through the mount (they were stored but not
/// checked: a user an ACL denied could read the file), default ACLs are
/// inherited by new files and directories in place of the umask, and
/// `setfacl` and `chmod` keep mode and ACL in step: the same script on
/// the local filesystem under the store is the oracle.
#[test]
fn posix_acls_are_enforced_and_inherited_as_on_a_local_filesystem() {
    require_fuse();
    assert!(
        Command::new("setfacl").arg("--version").output().is_ok(),
        "setfacl is missing (scripts/test.sh installs acl)"
    );
    let s = scratch(&[]);
    let native = s.mnt.with_extension("native");
    std::fs::create_dir(&native).unwrap();
    let want = cases_in(&native, ACL_CASES);
    for line in [
        "a1 read: denied",
        "a2 write: ok",
        "a3 write: denied",
        "d1 create: denied",
        "d2/f write: ok",
    ] {
        assert!(want.contains(line), "{line} not in the oracle:\n{want}");
    }
    let m = Mount::new(&s);
    let got = cases_in(&s.mnt, ACL_CASES);
    assert_eq!(got, want, "through the mount vs the local filesystem");
    m.unmount();
    // After a remount (nothing cached) the ACLs still hold.
    let m = Mount::new(&s);
    let out = as_nobody(&format!("cat {}/a1", s.mnt.display()));
    assert!(
        !out.status.success(),
        "a1 readable by nobody after a remount"
    );
    m.unmount();
    fsck_clean(&s.store);
}

/// A file handle for `path` (name_to_handle_at), as NFS keeps one.
fn handle_of(path: &Path) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut buf = vec![0u8; 8 + 128];
    buf[..4].copy_from_slice(&128u32.to_ne_bytes());
    let mut mount_id = 0;
    // SAFETY: buf is a file_handle header with 128 bytes of room.
    let r = unsafe {
        libc::name_to_handle_at(
            libc::AT_FDCWD,
            c.as_ptr(),
            buf.as_mut_ptr().cast(),
            &mut mount_id,
            0,
        )
    };
    assert_eq!(
        r,
        0,
        "name_to_handle_at: {}",
        std::io::Error::last_os_error()
    );
    buf
}

/// Opens the file `handle` names (open_by_handle_at), reading its bytes.
fn read_by_handle(mnt: &Path, handle: &mut [u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::fd::{AsRawFd, FromRawFd};
    let dir = File::open(mnt)?;
    // SAFETY: handle came from name_to_handle_at.
    let fd = unsafe {
        libc::open_by_handle_at(dir.as_raw_fd(), handle.as_mut_ptr().cast(), libc::O_RDONLY)
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned here.
    let mut f = unsafe { File::from_raw_fd(fd) };
    let mut v = Vec::new();
    f.read_to_end(&mut v)?;
    Ok(v)
}

/// File handles outlive the kernel's memory of the inode (they went
/// stale once it dropped it, so the mount could not be exported over
/// NFS: xfstests generic/426, 467, 477, 756, 777): after the caches are
/// dropped, and after a remount, a handle opens its file; a deleted
/// file's handle is ESTALE.
#[test]
fn file_handles_survive_dropped_caches_and_remounts() {
    require_fuse();
    let s = scratch(&[]);
    let m = Mount::new(&s);
    std::fs::create_dir_all(s.mnt.join("d/e")).unwrap();
    std::fs::write(s.mnt.join("d/e/f"), b"by handle").unwrap();
    std::fs::write(s.mnt.join("gone"), b"x").unwrap();
    let mut f = handle_of(&s.mnt.join("d/e/f"));
    let mut d = handle_of(&s.mnt.join("d/e"));
    let mut gone = handle_of(&s.mnt.join("gone"));
    std::fs::remove_file(s.mnt.join("gone")).unwrap();
    std::fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
    assert_eq!(read_by_handle(&s.mnt, &mut f).unwrap(), b"by handle");
    let e = read_by_handle(&s.mnt, &mut gone).expect_err("a deleted file");
    assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
    m.unmount();
    let m = Mount::new(&s);
    assert_eq!(
        read_by_handle(&s.mnt, &mut f).unwrap(),
        b"by handle",
        "after a remount"
    );
    // A directory's handle, and its parent found through `..`.
    let dir = File::open(&s.mnt).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: d came from name_to_handle_at.
    let fd =
        unsafe { libc::open_by_handle_at(dir.as_raw_fd(), d.as_mut_ptr().cast(), libc::O_RDONLY) };
    assert!(
        fd >= 0,
        "directory handle: {}",
        std::io::Error::last_os_error()
    );
    let p = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
    assert_eq!(p, s.mnt.join("d/e"), "the directory's path is rebuilt");
    // SAFETY: fd is ours.
    unsafe { libc::close(fd) };
    drop(dir);
    m.unmount();
}

/// Directories replaced by `rename` or removed while open, then
/// `fstat`ed and listed through the open descriptor.
const OPEN_DIR_CASES: &str = r#"
import os, sys
d = sys.argv[1]
os.mkdir(f"{d}/a"); os.mkdir(f"{d}/b")
fa = os.open(f"{d}/a", os.O_RDONLY); fb = os.open(f"{d}/b", os.O_RDONLY)
os.rename(f"{d}/a", f"{d}/b")
print("replaced:", os.fstat(fb).st_nlink, os.listdir(f"/proc/self/fd/{fb}"))
print("moved:", os.fstat(fa).st_nlink)
os.rmdir(f"{d}/b")
print("removed:", os.fstat(fa).st_nlink, os.listdir(f"/proc/self/fd/{fa}"))
os.close(fa); os.close(fb)
print("gone:", os.path.exists(f"{d}/b"))
os.mkdir(f"{d}/c"); os.chdir(f"{d}/c"); os.rmdir(f"{d}/c")
import time; time.sleep(1.2)  # past the mount's attribute timeout
print("cwd removed:", os.stat(".").st_nlink)
os.chdir(".."); print("chdir .. from it:", os.getcwd() == d)
"#;

/// `fstat` of an open directory that `rename` replaced, or `rmdir`
/// removed, gives `nlink` 0 and an empty listing, as on a disk filesystem
/// (it gave ENOENT: xfstests generic/035); a process whose working
/// directory was removed can `stat` it and `chdir("..")` out of it (it
/// got ENOENT: generic/011); closed, it is gone and fsck is clean.
#[test]
fn directories_removed_while_open_stay_until_closed() {
    require_fuse();
    let s = scratch(&[]);
    let native = s.mnt.with_extension("native");
    std::fs::create_dir(&native).unwrap();
    let run = |dir: &Path| {
        let out = Command::new("python3")
            .args(["-c", OPEN_DIR_CASES])
            .arg(dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let want = run(&native);
    assert!(want.contains("replaced: 0 []"), "{want}");
    let m = Mount::new(&s);
    assert_eq!(
        run(&s.mnt),
        want,
        "through the mount vs the local filesystem"
    );
    m.unmount();
    fsck_clean(&s.store);
}

/// Times the store sets (creation) and times the kernel sets (a write's
/// mtime under the writeback cache) come from one clock: a file written
/// after another was made never shows an earlier mtime (on the store's
/// finer clock it could, by up to a tick: xfstests generic/423).
#[test]
fn a_later_file_never_has_an_earlier_time() {
    use std::os::unix::fs::MetadataExt;
    require_fuse();
    let s = scratch(&[]);
    let m = Mount::new(&s);
    let ns = |md: &std::fs::Metadata| md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128;
    let mut earlier = Vec::new();
    for i in 0..300 {
        let a = s.mnt.join(format!("a{i}"));
        File::create(&a).unwrap();
        let b = s.mnt.join(format!("b{i}"));
        let f = File::create(&b).unwrap();
        f.write_all_at(b"x", 0).unwrap();
        f.sync_all().unwrap();
        drop(f);
        let (ta, tb) = (
            ns(&std::fs::metadata(&a).unwrap()),
            ns(&std::fs::metadata(&b).unwrap()),
        );
        if tb < ta {
            earlier.push((i, ta - tb));
        }
    }
    assert!(
        earlier.is_empty(),
        "written later, mtime earlier by ns: {earlier:?}"
    );
    m.unmount();
}

/// The times a program saw stay after a remount. Under the writeback
/// cache the kernel owns a file's mtime and ctime and sends them at close
/// (SETATTR) after the pages (WRITE, queued in the background); when the
/// store's threads ran that WRITE last it stamped its own clock over them
/// and a file's times moved at the next mount (xfstests generic/003, one
/// run in three).
#[test]
fn times_a_program_saw_survive_a_remount() {
    use std::os::unix::fs::MetadataExt;
    require_fuse();
    let s = scratch(&[]);
    let times = |p: &Path| {
        let md = std::fs::metadata(p).unwrap();
        (md.mtime(), md.mtime_nsec(), md.ctime(), md.ctime_nsec())
    };
    let mut seen = Vec::new();
    // The first writes of a mount are the slowest to run (statements
    // not yet prepared): each round starts a new one.
    for round in 0..12 {
        let m = Mount::new(&s);
        for i in 0..10 {
            let p = s.mnt.join(format!("f{round}-{i}"));
            std::fs::write(&p, format!("{i}\n")).unwrap();
            seen.push((p.clone(), times(&p)));
        }
        m.unmount();
    }
    let m = Mount::new(&s);
    let moved: Vec<_> = seen
        .iter()
        .filter(|(p, t)| times(p) != *t)
        .map(|(p, t)| (p.file_name().unwrap().to_owned(), *t, times(p)))
        .collect();
    assert!(moved.is_empty(), "times changed by a remount: {moved:?}");
    m.unmount();
}

/// `sync -f` after `rm -r` succeeds. The kernel writes back a removed
/// file's times (its unlink moved the cached ctime) after the store has
/// deleted the file; that SETATTR got ENOENT, which the next `syncfs`
/// reported as an error.
#[test]
fn syncfs_after_removing_a_tree_reports_no_error() {
    require_fuse();
    let s = scratch(&[]);
    let m = Mount::new(&s);
    let mnt = s.mnt.display();
    let out = sh(&format!(
        "mkdir -p {mnt}/t/u && for i in 1 2 3; do echo $i > {mnt}/t/u/f$i; done && \
         sync -f {mnt} && rm -r {mnt}/t && sync -f {mnt} && echo synced"
    ));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "synced");
    m.unmount();
    fsck_clean(&s.store);
}

// ---------------------------------------------------------------------
// Hostile input.
// ---------------------------------------------------------------------

fn sh(script: &str) -> Output {
    let out = Command::new("sh").args(["-c", script]).output().unwrap();
    assert!(out.status.success(), "{script}: {out:?}");
    out
}

/// Listings carry attributes (`READDIRPLUS`): after a remount, with the
/// kernel's caches dropped, what `find` prints of every entry (type, mode,
/// size, links, owner, target, mtime) is the source tree's, including a
/// file still open with unflushed writes.
#[test]
fn listings_with_attributes_match_the_source() {
    require_fuse();
    let s = scratch(&[]);
    let m = Mount::new(&s);
    let mnt = s.mnt.to_str().unwrap();
    let src = s.mnt.parent().unwrap().join("src");
    let src = src.to_str().unwrap();
    sh(&format!(
        "mkdir -p {src}/d/e && cd {src} && for i in $(seq 1 300); do \
           head -c $((i * 997)) /dev/urandom > d/f$i; chmod $((600 + i % 8 * 10 + i % 5)) d/f$i; \
           chown $((i % 3)):$((i % 4)) d/f$i; done && \
         ln d/f1 d/e/hard && ln -s ../f2 d/e/link && mkfifo d/e/fifo && touch -d @1000000000 d/f3"
    ));
    sh(&format!("cp -a {src}/d {mnt}/d"));
    // Every entry of d (directories without their size, which is the
    // filesystem's own).
    let list = |root: &str| {
        let out = sh(&format!(
            "cd {root}/d && find . -type d -printf '%p %y %m %n %U %G %T@\\n' -o \
             -printf '%p %y %m %s %n %U %G %l %T@\\n' | sort"
        ));
        String::from_utf8(out.stdout).unwrap()
    };
    let differ = |got: &str, want: &str| -> Vec<String> {
        let (g, w): (Vec<_>, Vec<_>) = (got.lines().collect(), want.lines().collect());
        let mut d: Vec<String> = g
            .iter()
            .filter(|l| !w.contains(l))
            .map(|l| format!("+{l}"))
            .collect();
        d.extend(w.iter().filter(|l| !g.contains(l)).map(|l| format!("-{l}")));
        d
    };
    let want = list(src);
    assert_eq!(want.lines().count(), 305, "{want}");
    assert_eq!(differ(&list(mnt), &want), Vec::<String>::new(), "mounted");
    m.unmount();
    let m = Mount::new(&s);
    sh("sync; echo 3 > /proc/sys/vm/drop_caches");
    assert_eq!(differ(&list(mnt), &want), Vec::<String>::new(), "remounted");
    // A file written and not yet closed is listed with its size.
    let f = File::create(s.mnt.join("d/open")).unwrap();
    f.write_all_at(&[7u8; 70_000], 0).unwrap();
    let ls = sh(&format!("ls -ln {mnt}/d | grep ' open$'"));
    let line = String::from_utf8_lossy(&ls.stdout).to_string();
    assert_eq!(line.split_whitespace().nth(4), Some("70000"), "{line}");
    drop(f);
    m.unmount();
    fsck_clean(&s.store);
}

/// A sparse file looks sparse through the mount: `st_blocks` and `du`
/// count its data, not its holes, before and after a remount, and `cp`
/// (which only looks for holes in a file whose blocks are fewer than its
/// size) copies it out sparse, byte for byte.
#[test]
fn sparse_files_stay_sparse_through_du_and_cp() {
    require_fuse();
    let s = scratch(&[]);
    let m = Mount::new(&s);
    let mnt = s.mnt.to_str().unwrap();
    let out = s.mnt.parent().unwrap().join("out");
    std::fs::create_dir(&out).unwrap();
    let out = out.to_str().unwrap();
    sh(&format!(
        "truncate -s 1G {mnt}/sparse && \
         head -c 1048576 /dev/urandom | dd of={mnt}/sparse bs=64k seek=4096 conv=notrunc status=none && \
         sync {mnt}/sparse"
    ));
    let check = |round: &str| {
        let md = std::fs::metadata(s.mnt.join("sparse")).unwrap();
        assert_eq!(md.len(), 1 << 30, "{round}");
        // 1 MiB of data on 64 KiB chunks: 2,048 blocks of 512 bytes.
        assert_eq!(md.blocks(), 2048, "{round}");
        let du = sh(&format!("du -k {mnt}/sparse"));
        let kib: u64 = String::from_utf8_lossy(&du.stdout)
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(kib, 1024, "{round}: du");
        sh(&format!(
            "rm -f {out}/copy && cp --sparse=auto {mnt}/sparse {out}/copy && cmp {mnt}/sparse {out}/copy"
        ));
        let copy = std::fs::metadata(format!("{out}/copy")).unwrap();
        assert!(
            copy.blocks() * 512 <= 4 << 20,
            "{round}: copy holds {} blocks",
            copy.blocks()
        );
    };
    check("mounted");
    m.unmount();
    fsck_clean(&s.store);
    let m = Mount::new(&s);
    check("remounted");
    m.unmount();
}

/// Names with newlines, invalid UTF-8 and 255 bytes, a deep tree, a
/// 1 TB sparse file and xattrs at the kernel's size limit all round-trip
/// through the mount and a remount.
#[test]
fn hostile_names_deep_trees_huge_sparse_files_and_big_xattrs() {
    require_fuse();
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let s = scratch(&[]);
    let m = Mount::new(&s);
    let long = vec![b'n'; 255];
    let names: Vec<&[u8]> = vec![
        b"a\nb",
        b"\xff\xfe\x80",
        &long,
        b"-rf",
        b" space ",
        b"tab\tand\rcr",
        b"..x",
    ];
    for (i, n) in names.iter().enumerate() {
        std::fs::write(s.mnt.join(OsStr::from_bytes(n)), format!("file {i}")).unwrap();
    }
    let too_long = s.mnt.join(OsStr::from_bytes(&[b'n'; 256]));
    let e = std::fs::write(&too_long, b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENAMETOOLONG), "{e}");
    let mnt = s.mnt.to_str().unwrap();
    // A tree 2,000 levels deep (paths far beyond PATH_MAX), built and
    // read with relative steps.
    sh(&format!(
        "cd {mnt} && i=0; while [ $i -lt 2000 ]; do mkdir d && cd d || exit 1; i=$((i+1)); done; echo deep > f"
    ));
    // A 1 TB sparse file with data at both ends.
    let huge = s.mnt.join("huge");
    let f = File::create(&huge).unwrap();
    f.set_len(1 << 40).unwrap();
    f.write_all_at(b"head", 0).unwrap();
    f.write_all_at(b"tail", (1 << 40) - 4).unwrap();
    f.sync_all().unwrap();
    drop(f);
    // xattrs: the largest value the kernel passes (64 KiB), a 255-byte name.
    let xname = format!("user.{}", "x".repeat(250));
    sh(&format!(
        "python3 -c \"import os; os.setxattr('{mnt}/huge', b'user.big', bytes(range(256)) * 256); \
         os.setxattr('{mnt}/huge', b'{xname}', b'v')\""
    ));
    let check = |round: &str| {
        let mut got: Vec<Vec<u8>> = std::fs::read_dir(&s.mnt)
            .unwrap()
            .map(|e| e.unwrap().file_name().as_bytes().to_vec())
            .collect();
        got.sort();
        let mut want: Vec<Vec<u8>> = names.iter().map(|n| n.to_vec()).collect();
        want.extend([b"d".to_vec(), b"huge".to_vec()]);
        want.sort();
        assert_eq!(got, want, "{round}: names");
        for (i, n) in names.iter().enumerate() {
            let data = std::fs::read(s.mnt.join(OsStr::from_bytes(n))).unwrap();
            assert_eq!(data, format!("file {i}").as_bytes(), "{round}");
        }
        let depth = sh(&format!(
            "cd {mnt} && n=0; while [ -d d ]; do cd d; n=$((n+1)); done; echo $n; cat f"
        ));
        assert_eq!(
            String::from_utf8_lossy(&depth.stdout),
            "2000\ndeep\n",
            "{round}"
        );
        let f = File::open(&huge).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 1 << 40);
        let mut b = [9u8; 4];
        for (at, want) in [(0, b"head"), ((1 << 40) - 4, b"tail"), (1 << 39, &[0u8; 4])] {
            f.read_exact_at(&mut b, at).unwrap();
            assert_eq!(&b, want, "{round}: huge@{at}");
        }
        let x = sh(&format!(
            "python3 -c \"import os; v = os.getxattr('{mnt}/huge', b'user.big'); \
             assert v == bytes(range(256)) * 256; print(os.getxattr('{mnt}/huge', b'{xname}'))\""
        ));
        assert_eq!(String::from_utf8_lossy(&x.stdout), "b'v'\n", "{round}");
    };
    check("mounted");
    m.unmount();
    fsck_clean(&s.store);
    let st = stats(&s.store);
    assert!(st["stored_bytes"].as_u64().unwrap() < 1 << 20, "{st}");
    let m = Mount::new(&s);
    check("remounted");
    m.unmount();
}
