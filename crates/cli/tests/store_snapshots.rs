//! Store snapshots through a real mount (issue 31): made while writers
//! write and fsync, browsed read-only under `/.onecopy/snapshots`,
//! deleted with gc freeing what only they held, and intact across kill -9.
//! Needs root and /dev/fuse.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use onecopy_testfs::{checksum_file, checksum_tree};

mod store_common;
use store_common::*;

fn snapshot(args: &[&str]) -> Output {
    let mut all = vec!["store", "snapshot"];
    all.extend_from_slice(args);
    onecopy(&all)
}

fn sh(script: &str) -> Output {
    Command::new("sh").args(["-c", script]).output().unwrap()
}

/// `cp -a` of what is in directory `from` into directory `to`.
fn copy_into(from: &Path, to: &Path) {
    ok(sh(&format!("cp -a {}/. {}/", from.display(), to.display())));
}

fn snap_dir(mnt: &Path, name: &str) -> PathBuf {
    mnt.join(".onecopy/snapshots").join(name)
}

/// A tree copied in with `cp -a`, snapshotted by mount point, then
/// changed: the snapshot shows the tree as it was (every file's
/// checksum), is hidden from the root's listing, refuses writes with
/// EROFS, survives a remount, and once deleted gc frees what only it held
/// while the live tree stays whole.
#[test]
fn a_snapshot_keeps_the_tree_as_it_was_and_frees_its_bytes_when_deleted() {
    require_fuse();
    let s = scratch(&["--compress", "none"]);
    let src = s.mnt.with_extension("src");
    ok(sh(&format!(
        "mkdir -p {0}/d/e && head -c 3000000 /dev/urandom > {0}/big && \
         echo hello > {0}/d/e/small && ln -s d/e/small {0}/link && \
         setfattr -n user.k -v v1 {0}/big",
        src.display()
    )));
    let want = checksum_tree(&src);
    let m = Mount::new(&s);
    copy_into(&src, &s.mnt);
    let mnt = s.mnt.to_str().unwrap();
    ok(snapshot(&["create", mnt, "before"]));
    // A bad name is a bad argument through the mount too.
    for bad in ["a/b", "..", ""] {
        let out = snapshot(&["create", mnt, bad]);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {out:?}");
    }
    let snap = snap_dir(&s.mnt, "before");
    ok(sh(&format!(
        "head -c 3000000 /dev/urandom > {0}/big && rm -r {0}/d && echo new > {0}/added",
        mnt
    )));
    assert_eq!(checksum_tree(&snap), want, "the snapshot as the tree was");
    assert_eq!(
        std::fs::read_link(snap.join("link")).unwrap(),
        Path::new("d/e/small")
    );
    let v = sh(&format!(
        "getfattr --only-values -n user.k {}/big",
        snap.display()
    ));
    assert_eq!(String::from_utf8_lossy(&v.stdout), "v1");
    let listing = ok(sh(&format!("ls -a {mnt}")));
    assert!(!listing.contains(".onecopy"), "hidden: {listing}");
    for w in [
        format!("echo x > {}/big", snap.display()),
        format!("touch {}/new", snap.display()),
        format!("rm {}/big", snap.display()),
        format!("mkdir {mnt}/.onecopy"),
    ] {
        let out = sh(&w);
        assert!(!out.status.success(), "{w} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("Read-only file system") || err.contains("File exists"),
            "{w}: {err}"
        );
    }
    ok(snapshot(&["create", mnt, "after"]));
    let diff = ok(snapshot(&["diff", mnt, "before", "after"]));
    for line in ["M /big", "- /d/e/small", "- /d", "+ /added"] {
        assert!(diff.lines().any(|l| l == line), "{line} not in:\n{diff}");
    }
    let dry = ok(onecopy(&[
        "store",
        "forget",
        mnt,
        "--keep-last",
        "1",
        "--dry-run",
    ]));
    assert!(
        dry.contains("would remove") && dry.contains("before"),
        "{dry}"
    );
    ok(snapshot(&["delete", mnt, "after"]));
    let list = ok(snapshot(&["list", mnt, "--json"]));
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list[0]["name"], "before");
    let only = list[0]["exclusive_bytes"].as_u64().unwrap();
    assert!(only >= 3_000_000, "the old big file's bytes: {list}");
    m.unmount();

    let m = Mount::new(&s);
    assert_eq!(checksum_tree(&snap), want, "after a remount");
    let live = checksum_tree(&s.mnt);
    let before = stats(&s.store)["stored_bytes"].as_u64().unwrap();
    ok(snapshot(&["delete", mnt, "before"]));
    assert!(!snap.exists());
    ok(onecopy(&["store", "gc", s.store.to_str().unwrap()]));
    let after = stats(&s.store)["stored_bytes"].as_u64().unwrap();
    assert_eq!(before - after, only, "gc freed what only the snapshot held");
    assert_eq!(checksum_tree(&s.mnt), live, "the live tree is whole");
    m.unmount();
    fsck_clean(&s.store);
    let out = snapshot(&["delete", s.store.to_str().unwrap(), "before"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no snapshot named"));
}

/// Four writers overwrite their files in place, one generation after
/// another (each word carries its file, generation and offset), fsyncing
/// each, while snapshots are made by mount point: in every snapshot each
/// word of each file is that file's own word at its offset (no byte of
/// anything else), of a generation no older than the last one fsync'd
/// before `create` was called.
#[test]
fn snapshots_taken_under_writers_hold_everything_fsynced_before() {
    const LEN: u64 = 256 << 10;
    require_fuse();
    let s = scratch(&[]);
    let m = Mount::new(&s);
    let stop = Arc::new(AtomicBool::new(false));
    let synced: Arc<Mutex<BTreeMap<u64, u64>>> = Arc::default();
    let writers: Vec<_> = (0..4u64)
        .map(|id| {
            let (stop, synced, mnt) = (stop.clone(), synced.clone(), s.mnt.clone());
            std::thread::spawn(move || {
                let f = File::create(mnt.join(format!("w{id}"))).unwrap();
                let mut gen = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    gen += 1;
                    f.write_all_at(&pattern(id, gen, 0, LEN), 0).unwrap();
                    f.sync_all().unwrap();
                    synced.lock().unwrap().insert(id, gen);
                }
            })
        })
        .collect();
    while synced.lock().unwrap().len() < 4 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut taken = Vec::new();
    for i in 0..5 {
        let name = format!("s{i}");
        let before = synced.lock().unwrap().clone();
        ok(snapshot(&["create", s.mnt.to_str().unwrap(), &name]));
        taken.push((name, before));
        std::thread::sleep(std::time::Duration::from_millis(150));
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    for (name, before) in &taken {
        for (id, min_gen) in before {
            let data = std::fs::read(snap_dir(&s.mnt, name).join(format!("w{id}"))).unwrap();
            assert_eq!(data.len() as u64, LEN, "{name}/w{id}");
            assert_eq!(
                foreign_word(*id, &data),
                None,
                "{name}/w{id}: a foreign byte"
            );
            let oldest = data
                .chunks(8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap()) >> 32 & 0xffff)
                .min()
                .unwrap();
            assert!(
                oldest >= min_gen & 0xffff,
                "{name}/w{id}: generation {oldest} < {min_gen} fsync'd before"
            );
        }
    }
    m.unmount();
    fsck_clean(&s.store);
}

/// `cp` inside the mount (coreutils uses `copy_file_range`) shares the
/// chunks: the copy reads back identical and adds no stored bytes; a
/// copy to an unaligned offset (Python's `os.copy_file_range`) is right
/// too.
#[test]
fn copies_inside_the_mount_share_chunks() {
    require_fuse();
    let s = scratch(&["--compress", "none"]);
    let m = Mount::new(&s);
    let mnt = s.mnt.to_str().unwrap();
    ok(sh(&format!(
        "head -c 67108864 /dev/urandom > {mnt}/big && sync {mnt}/big"
    )));
    let figure = |k: &str| stats(&s.store)[k].as_u64().unwrap();
    let (before, dup_before) = (figure("stored_bytes"), figure("written_duplicate_bytes"));
    let t = std::time::Instant::now();
    ok(sh(&format!("cp {mnt}/big {mnt}/copy && sync {mnt}/copy")));
    let took = t.elapsed();
    let sum = |p: &str| checksum_file(&s.mnt.join(p)).unwrap();
    assert_eq!(sum("copy"), sum("big"));
    assert_eq!(
        figure("stored_bytes"),
        before,
        "cp added stored bytes (took {took:?})"
    );
    // Shared, not written again and found duplicate.
    assert_eq!(
        figure("written_duplicate_bytes"),
        dup_before,
        "cp wrote the bytes"
    );
    let py = format!(
        "import os\nsrc = os.open('{mnt}/big', os.O_RDONLY)\n\
         dst = os.open('{mnt}/part', os.O_WRONLY | os.O_CREAT)\n\
         n = os.copy_file_range(src, dst, 5000000, 1234, 777)\nprint(n)"
    );
    let out = Command::new("python3").args(["-c", &py]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "5000000",
        "{out:?}"
    );
    let big = std::fs::read(s.mnt.join("big")).unwrap();
    let part = std::fs::read(s.mnt.join("part")).unwrap();
    assert_eq!(part.len(), 777 + 5_000_000);
    assert_eq!(part[777..], big[1234..1234 + 5_000_000]);
    m.unmount();
    fsck_clean(&s.store);
}

/// `cp` out of `.onecopy/snapshots/NAME` into the live tree shares the
/// snapshot's chunks (it wrote zeros, or failed with ENOENT, when the
/// source was a snapshot's file): the copy, and a `copy_file_range` over
/// a file holding other bytes, read back as the snapshot's file, after a
/// remount too, and add no stored bytes.
#[test]
fn a_copy_out_of_a_snapshot_shares_its_chunks() {
    require_fuse();
    let s = scratch(&["--compress", "none"]);
    let m = Mount::new(&s);
    let mnt = s.mnt.to_str().unwrap();
    ok(sh(&format!(
        "head -c 8388608 /dev/urandom > {mnt}/f && head -c 1000000 /dev/urandom > {mnt}/victim"
    )));
    let sum = |p: &Path| checksum_file(p).unwrap();
    let want = sum(&s.mnt.join("f"));
    ok(snapshot(&["create", mnt, "s1"]));
    ok(sh(&format!(
        "head -c 8388608 /dev/urandom > {mnt}/f && sync {mnt}/f"
    )));
    ok(snapshot(&["create", mnt, "s2"]));
    let figure = |k: &str| stats(&s.store)[k].as_u64().unwrap();
    let before = (figure("stored_bytes"), figure("written_duplicate_bytes"));
    let from = snap_dir(&s.mnt, "s1").join("f");
    ok(sh(&format!(
        "cp {} {mnt}/restored && sync {mnt}/restored",
        from.display()
    )));
    let py = format!(
        "import os\nsrc = os.open('{}', os.O_RDONLY)\n\
         dst = os.open('{mnt}/victim', os.O_WRONLY)\n\
         print(os.copy_file_range(src, dst, 8388608, 0, 0))",
        from.display()
    );
    let out = Command::new("python3").args(["-c", &py]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "8388608",
        "{out:?}"
    );
    ok(sh(&format!("sync {mnt}/victim")));
    for name in ["restored", "victim"] {
        assert_eq!(sum(&s.mnt.join(name)), want, "{name}");
    }
    let after = (figure("stored_bytes"), figure("written_duplicate_bytes"));
    assert_eq!(after, before, "the copies stored or wrote bytes");
    m.unmount();
    fsck_clean(&s.store);
    let m = Mount::new(&s);
    for name in ["restored", "victim"] {
        assert_eq!(sum(&s.mnt.join(name)), want, "{name}, remounted");
    }
    m.unmount();
}

/// Checksums of the files of a flat directory.
type Sums = BTreeMap<std::ffi::OsString, u128>;

/// [`Sums`] of `dir`, or `None` if any read fails (a mount killed).
fn flat_sums(dir: &Path) -> Option<Sums> {
    let mut out = Sums::new();
    for e in std::fs::read_dir(dir).ok()? {
        let e = e.ok()?;
        out.insert(e.file_name(), checksum_file(&e.path()).ok()?);
    }
    Some(out)
}

/// What the snapshot workload learned for sure before a kill.
#[derive(Default)]
struct Known {
    /// Snapshots whose `create` returned, with their files' checksums
    /// read right after (when the mount was not killed first).
    made: BTreeMap<String, Option<Sums>>,
    /// Snapshots whose `delete` (or `forget`) returned.
    deleted: Vec<String>,
    /// Snapshots a `delete` or `forget` in flight may remove.
    maybe: std::collections::BTreeSet<String>,
}

/// `store forget --keep-last 2`: what it removed (its JSON answer) joins
/// the known deleted; until it answers, any snapshot may go.
fn forget(mnt: &Path, known: &Mutex<Known>) -> bool {
    {
        let mut k = known.lock().unwrap();
        let alive: Vec<String> = k.made.keys().cloned().collect();
        k.maybe.extend(alive);
    }
    let out = onecopy(&[
        "store",
        "forget",
        mnt.to_str().unwrap(),
        "--keep-last",
        "2",
        "--json",
    ]);
    if !out.status.success() {
        return false;
    }
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let removed = rep["remove"].as_array().unwrap();
    let names = removed
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string());
    let mut k = known.lock().unwrap();
    k.deleted.extend(names);
    k.maybe.clear();
    true
}

/// One round: writers rewrite files while snapshots are made, deleted,
/// forgotten and collected (gc), until the mount is killed with -9 at a
/// random point.
fn snapshot_round(s: &Scratch, round: usize, rng: &mut Rng, known: &Arc<Mutex<Known>>) {
    let m = Mount::new(s);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, mnt) = (stop.clone(), s.mnt.clone());
        std::thread::spawn(move || {
            for gen in 1u64.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let id = gen % 8;
                let p = mnt.join(format!("f{id}"));
                let Ok(f) = File::create(&p) else { break };
                let len = (gen % 5 + 1) * (48 << 10);
                if f.write_all_at(&pattern(id, gen, 0, len), 0).is_err() {
                    break;
                }
            }
        })
    };
    let worker = {
        let (stop, mnt, store, known) =
            (stop.clone(), s.mnt.clone(), s.store.clone(), known.clone());
        std::thread::spawn(move || {
            for i in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let name = format!("r{round}-{i}");
                let out = snapshot(&["create", mnt.to_str().unwrap(), &name]);
                if !out.status.success() {
                    break;
                }
                let sums = flat_sums(&snap_dir(&mnt, &name));
                known.lock().unwrap().made.insert(name, sums);
                if i % 3 == 2 {
                    let old = format!("r{round}-{}", i - 2);
                    known.lock().unwrap().maybe.insert(old.clone());
                    let out = snapshot(&["delete", mnt.to_str().unwrap(), &old]);
                    if !out.status.success() {
                        break;
                    }
                    let mut k = known.lock().unwrap();
                    k.maybe.remove(&old);
                    k.deleted.push(old);
                    onecopy(&["store", "gc", store.to_str().unwrap()]);
                }
                if i % 5 == 4 && !forget(&mnt, &known) {
                    break;
                }
            }
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(300 + rng.below(2500)));
    m.kill();
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    worker.join().unwrap();
}

/// kill -9 of the mount at random points while snapshots are made,
/// deleted, forgotten and collected under writers: after each, fsck is clean, every
/// snapshot whose `create` returned is there and reads back exactly as
/// it did, every one whose `delete` returned is gone, and any other
/// (in flight at the kill) is wholly there or wholly absent.
#[test]
fn kill_9_during_create_delete_forget_and_gc_leaves_snapshots_whole_or_absent() {
    require_fuse();
    let s = scratch(&["--container-size", "1M"]);
    let mut rng = Rng::seeded("snapshots");
    let known = Arc::new(Mutex::new(Known::default()));
    for round in 0..6 {
        snapshot_round(&s, round, &mut rng, &known);
        fsck_clean(&s.store);
        let m = Mount::new(&s);
        let listed = ok(snapshot(&["list", s.mnt.to_str().unwrap(), "--json"]));
        let listed: Vec<serde_json::Value> = serde_json::from_str(&listed).unwrap();
        let names: Vec<String> = listed
            .iter()
            .map(|v| v["name"].as_str().unwrap().to_string())
            .collect();
        let mut k = known.lock().unwrap();
        for (name, sums) in &k.made {
            if k.deleted.contains(name) {
                assert!(
                    !names.contains(name),
                    "round {round}: {name} deleted, yet listed"
                );
                continue;
            }
            if !names.contains(name) && k.maybe.contains(name) {
                continue; // removed by a delete or forget cut short
            }
            assert!(names.contains(name), "round {round}: {name} lost");
            let now = flat_sums(&snap_dir(&s.mnt, name));
            assert!(now.is_some(), "round {round}: {name} unreadable");
            if sums.is_some() {
                assert_eq!(&now, sums, "round {round}: {name}");
            }
        }
        for name in names.iter().filter(|n| !k.made.contains_key(*n)) {
            // In flight at the kill: readable whole (no EIO, no foreign byte).
            for id in 0..8u64 {
                let p = snap_dir(&s.mnt, name).join(format!("f{id}"));
                if let Ok(data) = std::fs::read(&p) {
                    assert_eq!(foreign_word(id, &data), None, "{name}/f{id}");
                }
            }
        }
        // What a cut-short removal did is known now.
        let gone: Vec<String> = std::mem::take(&mut k.maybe)
            .into_iter()
            .filter(|n| !names.contains(n))
            .collect();
        k.deleted.extend(gone);
        drop(k);
        m.unmount();
    }
    assert!(known.lock().unwrap().made.len() >= 6, "snapshots were made");
}

/// `stat` lines (type, mode, owner, size but a directory's, mtime, link
/// count) and the checksum of every file under `root`, by relative path.
fn inventory(root: &Path) -> String {
    let out = sh(&format!(
        "cd {} && find . -mindepth 1 | sort | while read -r p; do \
         if [ -d \"$p\" ]; then f='%n %F %a %u:%g %Y %h'; else f='%n %F %a %u:%g %s %Y %h'; fi; \
         stat -c \"$f\" \"$p\"; \
         [ -f \"$p\" ] && [ ! -L \"$p\" ] && md5sum < \"$p\"; \
         getfattr --absolute-names -d -m user. \"$p\" 2>/dev/null | sed 1d; done",
        root.display()
    ));
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// A snapshot is restored without a mount (`snapshot restore`) and
/// mounted alone (`mount --snapshot`, read-only): both give back the tree
/// as it was (types, modes, owners, sizes, mtimes, hard links, xattrs,
/// bytes; holes stay holes), and a restore never writes over anything.
#[test]
fn a_snapshot_is_restored_and_mounted_alone_as_it_was() {
    require_fuse();
    let s = scratch(&[]);
    let src = s.mnt.with_extension("src");
    ok(sh(&format!(
        "mkdir -p {0}/d && head -c 300000 /dev/urandom > {0}/d/f && chmod 4750 {0}/d/f && \
         chown 12:34 {0}/d/f && ln {0}/d/f {0}/hard && ln -s d/f {0}/sym && mkfifo {0}/fifo && \
         truncate -s 50M {0}/sparse && echo tail >> {0}/sparse && \
         setfattr -n user.k -v v {0}/d && chmod 700 {0}/d && touch -d 2001-01-01 {0}/d",
        src.display()
    )));
    let want = inventory(&src);
    let m = Mount::new(&s);
    copy_into(&src, &s.mnt);
    ok(snapshot(&["create", s.mnt.to_str().unwrap(), "s"]));
    ok(sh(&format!("rm -r {}/d", s.mnt.display())));
    m.unmount();

    let dest = s.mnt.with_extension("restored");
    let store = s.store.to_str().unwrap();
    ok(snapshot(&["restore", store, "s", dest.to_str().unwrap()]));
    assert_eq!(inventory(&dest), want, "restored");
    let du = ok(sh(&format!("du -k {}/sparse | cut -f1", dest.display())));
    assert!(
        du.trim().parse::<u64>().unwrap() < 1024,
        "the hole stayed a hole: {du}"
    );
    let again = snapshot(&["restore", store, "s", dest.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(2), "{again:?}");

    let m = Mount::with_args(&s, &["--snapshot", "s"]);
    assert_eq!(inventory(&s.mnt), want, "mounted alone");
    let out = sh(&format!("touch {}/new", s.mnt.display()));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Read-only file system"));
    let up = ok(sh(&format!("cd {}/.. && pwd", s.mnt.display())));
    assert_eq!(up.trim(), s.mnt.parent().unwrap().to_str().unwrap());
    m.unmount();
    fsck_clean(&s.store);
}

/// `snapshot restore` of a mounted store is done by its mount (named by
/// the store's directory or the mount point, DEST relative to the
/// caller's directory): the tree comes back as it was while the mount
/// goes on serving; an existing DEST is refused and left as it was; an
/// unknown snapshot is named.
#[test]
fn a_mounted_store_restores_a_snapshot_through_its_mount() {
    require_fuse();
    let s = scratch(&[]);
    let src = s.mnt.with_extension("src");
    ok(sh(&format!(
        "mkdir -p {0}/d && head -c 300000 /dev/urandom > {0}/d/f && ln {0}/d/f {0}/hard && \
         ln -s d/f {0}/sym && setfattr -n user.k -v v {0}/d/f && chmod 640 {0}/d/f && \
         touch -d 2001-01-01 {0}/d",
        src.display()
    )));
    let want = inventory(&src);
    let m = Mount::new(&s);
    copy_into(&src, &s.mnt);
    ok(snapshot(&["create", s.mnt.to_str().unwrap(), "s"]));
    ok(sh(&format!(
        "rm -r {}/d && echo new > {0}/new",
        s.mnt.display()
    )));
    let here = s.mnt.parent().unwrap();
    for (by, dest) in [(&s.store, "by-store"), (&s.mnt, "by-mount")] {
        let out = Command::new(BIN)
            .args([
                "store",
                "snapshot",
                "restore",
                by.to_str().unwrap(),
                "s",
                dest,
            ])
            .current_dir(here)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(inventory(&here.join(dest)), want, "restored by {by:?}");
    }
    let again = snapshot(&[
        "restore",
        s.mnt.to_str().unwrap(),
        "s",
        here.join("by-mount").to_str().unwrap(),
    ]);
    assert_eq!(again.status.code(), Some(2), "{again:?}");
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("exists"),
        "{again:?}"
    );
    assert_eq!(inventory(&here.join("by-mount")), want, "left as it was");
    let none = snapshot(&[
        "restore",
        s.mnt.to_str().unwrap(),
        "nope",
        here.join("x").to_str().unwrap(),
    ]);
    assert_eq!(none.status.code(), Some(2), "{none:?}");
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("no snapshot named"),
        "{none:?}"
    );
    assert_eq!(
        std::fs::read(s.mnt.join("new")).unwrap(),
        b"new\n",
        "the mount serves on"
    );
    m.unmount();
    fsck_clean(&s.store);
}

/// A restore run by the mount stops when its caller is killed: the
/// destination stops growing long before the snapshot is all there, and
/// the mount goes on serving (a second restore then brings it all back).
#[test]
fn a_restore_by_the_mount_stops_when_its_caller_dies() {
    require_fuse();
    let s = scratch(&[]);
    let m = Mount::new(&s);
    ok(sh(&format!(
        "for i in $(seq 100); do head -c 4M /dev/urandom > {}/f$i; done",
        s.mnt.display()
    )));
    let want = checksum_tree(&s.mnt);
    ok(snapshot(&["create", s.mnt.to_str().unwrap(), "s"]));
    let dest = s.mnt.with_extension("restored");
    let mut caller = Command::new(BIN)
        .args(["store", "snapshot", "restore", s.mnt.to_str().unwrap(), "s"])
        .arg(&dest)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let files = || std::fs::read_dir(&dest).map_or(0, |d| d.count());
    let t = std::time::Instant::now();
    while files() == 0 && t.elapsed() < std::time::Duration::from_secs(30) {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    caller.kill().unwrap();
    caller.wait().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let a = files();
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert_eq!(files(), a, "the restore stopped");
    assert!(
        (1..50).contains(&a),
        "{a} of 100 files restored before it stopped"
    );
    let again = s.mnt.with_extension("again");
    ok(snapshot(&[
        "restore",
        s.mnt.to_str().unwrap(),
        "s",
        again.to_str().unwrap(),
    ]));
    assert_eq!(checksum_tree(&again), want);
    m.unmount();
    fsck_clean(&s.store);
}

/// A snapshot mounted alone tells the kernel, at its first open, that
/// its files and directories need no `OPEN` (and so no `RELEASE`), and,
/// when it holds no extended attribute, that it has none: over both
/// transports every file reads back as it was, opened again and again,
/// and extended attributes are "not supported" only in the snapshot
/// that has none.
fn a_snapshot_mounted_alone_needs_no_open(_: &str, transport: &[&str]) {
    require_fuse();
    let s = scratch(&[]);
    let src = s.mnt.with_extension("src");
    ok(sh(&format!(
        "mkdir -p {0}/d/e && for i in 1 2 3; do head -c $((i * 70000)) /dev/urandom > {0}/d/f$i; done && \
         echo small > {0}/d/e/s && ln {0}/d/f1 {0}/hard && ln -s d/f2 {0}/sym && chmod 600 {0}/d/f3 && \
         mkfifo {0}/fifo && touch -d 2001-01-01 {0}/d",
        src.display()
    )));
    let bare = inventory(&src);
    let m = Mount::with_args(&s, transport);
    copy_into(&src, &s.mnt);
    ok(snapshot(&["create", s.mnt.to_str().unwrap(), "bare"]));
    for root in [&src, &s.mnt] {
        ok(sh(&format!(
            "setfattr -n user.k -v v {}/d/f1",
            root.display()
        )));
    }
    ok(snapshot(&["create", s.mnt.to_str().unwrap(), "with"]));
    let with = inventory(&src);
    m.unmount();
    for (name, want) in [("bare", &bare), ("with", &with)] {
        let args = [&["--snapshot", name][..], transport].concat();
        let m = Mount::with_args(&s, &args);
        for round in 0..2 {
            assert_eq!(&inventory(&s.mnt), want, "{name}, round {round}");
        }
        let got = sh(&format!(
            "getfattr -n user.k --only-values {}/d/f1",
            s.mnt.display()
        ));
        match name {
            "bare" => assert!(
                String::from_utf8_lossy(&got.stderr).contains("Operation not supported"),
                "{got:?}"
            ),
            _ => assert_eq!(got.stdout, b"v", "{got:?}"),
        }
        m.unmount();
    }
    fsck_clean(&s.store);
}

per_transport!(a_snapshot_mounted_alone_needs_no_open);

/// Absent names are cached by the kernel only where every name appears
/// through it: a snapshot looked up before it exists is there as soon as
/// `snapshot create` returns (made over the control channel, not through
/// the kernel), over both transports; a live name looked up absent and
/// then made through the mount is there at once too.
#[test]
fn a_name_looked_up_before_it_exists_is_seen_once_made() {
    require_uring();
    for args in [&["-o", "transport=dev"][..], &["-o", "transport=uring"][..]] {
        let s = scratch(&[]);
        let m = Mount::with_args(&s, args);
        let mnt = s.mnt.to_str().unwrap();
        std::fs::write(s.mnt.join("f"), b"x").unwrap();
        let snap = snap_dir(&s.mnt, "early");
        for _ in 0..3 {
            assert!(std::fs::metadata(&snap).is_err(), "{args:?}");
        }
        ok(snapshot(&["create", mnt, "early"]));
        assert_eq!(
            std::fs::read(snap.join("f")).unwrap(),
            b"x",
            "{args:?}: the new snapshot is seen at once"
        );
        let live = s.mnt.join("later");
        assert!(std::fs::metadata(&live).is_err());
        std::fs::write(&live, b"y").unwrap();
        assert_eq!(std::fs::read(&live).unwrap(), b"y", "{args:?}");
        m.unmount();
    }
}
