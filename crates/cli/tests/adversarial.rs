//! Issue 5: the adversarial and fault-injection suite for out-of-band
//! dedupe. Every case runs the real `onecopy` binary on loop-mounted btrfs
//! and XFS (reflink=1) while a hostile condition holds, then checks that
//! every file reads exactly as before (or exactly as a concurrent writer
//! left it), that onecopy exited with its documented code and a clear
//! message, never panicked, and that a following clean run completes
//! correctly with exit 0.
//!
//! The catalog (issue 4) is attacked through the binary: damaged,
//! truncated, foreign-version catalogs and dry runs. Its record decoding
//! under arbitrary bytes is fuzzed in `crates/catalog`'s own tests, the
//! FIEMAP and btrfs tree-search decoders in `crates/ioctl`'s.
//!
//! Needs root (mkfs, loop devices, mount, chattr, swapon, setpriv).

mod common;
#[path = "adversarial/support.rs"]
mod support;
#[path = "adversarial/writer.rs"]
mod writer;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use onecopy_testfs::{
    checksum_file, checksum_tree, copy_no_reflink, random_bytes, shared_bytes_between,
    write_random, FsKind, Prng,
};
use support::*;

per_fs!(
    concurrent_writer,
    unreadable_as_nobody,
    immutable_and_append_only,
    active_swap_file,
    open_for_writing,
    read_only_bind_mounts,
    nested_mounts,
    file_roots,
    hostile_names,
    long_paths,
    deep_tree,
    sparse_files,
    sparse_over_4gib,
    empty_and_zero_files,
    hardlink_farm,
    symlink_loops,
    out_of_space,
    sigint_at_random_points,
    sigkill_at_random_points,
    whole_copies_converge_with_block_runs,
    catalog_dry_runs_settle_nothing,
    damaged_catalogs,
);

/// A seed for the randomised cases: `ONECOPY_ADVERSARIAL_SEED` or the
/// clock, printed so a failure can be replayed.
fn seed(case: &str) -> u64 {
    onecopy_testfs::seed::replayable("ONECOPY_ADVERSARIAL_SEED", case)
}

fn sums_of(paths: &[PathBuf]) -> BTreeMap<PathBuf, u128> {
    paths
        .iter()
        .map(|p| (p.clone(), checksum_file(p).unwrap()))
        .collect()
}

fn flat(groups: &[Vec<PathBuf>]) -> Vec<PathBuf> {
    groups.iter().flatten().cloned().collect()
}

/// After a complete run on a quiet tree, planning again from scratch
/// (no catalog) must find nothing left to share: every duplicate converged
/// on one physical copy.
#[track_caller]
fn assert_nothing_left(ctx: &str, root: &Path) {
    let r = dedupe(&[root], &["--dry-run", "--no-catalog"]);
    r.assert_ok();
    assert_eq!(
        r.u("bytes_would_share"),
        0,
        "{ctx}: a fresh plan still finds data to share (ranges_skipped {})",
        r.report()["ranges_skipped"]
    );
}

// ---------------------------------------------------------------------------
// Concurrent writer
// ---------------------------------------------------------------------------

/// Files modified, appended to, truncated, deleted, renamed and replaced by
/// a concurrent writer while onecopy scans and dedupes the same tree, run
/// after run. Every run must end with exit 0 and no error (a file that
/// changed or vanished is a skip, as documented, not a failure); afterwards
/// every file holds exactly what the writer last wrote, the files it never
/// touched are unchanged, and a clean run shares every duplicate.
fn concurrent_writer(kind: FsKind) {
    let seed = seed("concurrent_writer");
    let fs = new_fs(kind, 768 * MIB);
    let root = fs.path();
    let stable = dup_groups(&root.join("stable"), 4, 3, 2 * MIB + 4097, seed);
    let stable_files = flat(&stable);
    let stable_sums = sums_of(&stable_files);
    let w = writer::Writer::new(&root.join("live"), 12, seed ^ 0x5eed);

    let stop = Arc::new(AtomicBool::new(false));
    let handle = {
        let stop = stop.clone();
        let mut w = w;
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                w.step();
                std::thread::sleep(Duration::from_micros(300));
            }
            w
        })
    };
    let mut changed = 0;
    let mut runs = Vec::new();
    for i in 0..8 {
        let extra: &[&str] = match i % 3 {
            0 => &[],
            1 => &["-j", "1"],
            _ => &["-b", "4K"],
        };
        let r = dedupe(&[root], extra);
        runs.push(r);
        let r = runs.last().unwrap();
        if r.json.is_some() {
            changed += r.files_skipped("changed_while_reading")
                + r.ranges_skipped("changed")
                + r.ranges_skipped("data_differs");
        }
    }
    stop.store(true, Ordering::Relaxed);
    let w = handle.join().expect("the writer thread failed");
    eprintln!(
        "concurrent_writer/{kind}: writer ops {:?}; races onecopy noticed: {changed}",
        w.ops
    );
    let total_ops: u64 = w.ops.values().sum();
    assert!(total_ops > 100, "the writer barely ran ({total_ops} ops)");
    for r in &runs {
        r.assert_ok();
    }

    let verify = |ctx: &str| {
        let got = read_tree(&root.join("live"));
        let want: BTreeMap<PathBuf, &Vec<u8>> = w
            .files
            .iter()
            .map(|(p, d)| (p.strip_prefix(root.join("live")).unwrap().to_path_buf(), d))
            .collect();
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{ctx}: the set of files differs from what the writer left"
        );
        for (p, d) in &want {
            assert!(
                &got[p] == *d,
                "{ctx}: {} does not hold what the writer last wrote",
                p.display()
            );
        }
        assert_same(
            &format!("{ctx}: untouched files"),
            &sums_of(&stable_files),
            &stable_sums,
        );
    };
    verify("after the racing runs");

    let r = dedupe(&[root], &[]);
    r.assert_ok();
    verify("after the clean run");
    assert_nothing_left("after the clean run", root);
    assert_groups_shared("untouched duplicates", &stable);
    // Everything the writer left that is identical is now shared.
    let mut by_content: BTreeMap<&Vec<u8>, Vec<PathBuf>> = BTreeMap::new();
    for (p, d) in &w.files {
        if d.len() as u64 >= 64 * KIB {
            by_content.entry(d).or_default().push(p.clone());
        }
    }
    let groups: Vec<Vec<PathBuf>> = by_content.into_values().filter(|g| g.len() > 1).collect();
    eprintln!(
        "concurrent_writer/{kind}: {} duplicate groups left by the writer",
        groups.len()
    );
    assert_groups_shared("duplicates the writer left", &groups);
}

// ---------------------------------------------------------------------------
// Files onecopy may not or can not touch
// ---------------------------------------------------------------------------

/// Run as `nobody` over a tree it owns, with files and a directory it can
/// not read: each unreadable entry is one clear error (exit 1, as
/// documented for per-file failures), everything else is deduped; once
/// readable, a clean run shares the rest.
fn unreadable_as_nobody(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    open_up(fs.path().parent().unwrap());
    let base = fs.path().join("home");
    let groups = dup_groups(&base, 3, 3, 2 * MIB + 123, 61);
    // Sorted first, so it is likely the first file the walk meets.
    let locked = base.join("aaa-locked.bin");
    copy_no_reflink(&groups[0][0], &locked).unwrap();
    let locked2 = base.join("g1").join("locked.bin");
    copy_no_reflink(&groups[1][0], &locked2).unwrap();
    let locked_dir = base.join("locked-dir");
    let hidden = locked_dir.join("hidden.bin");
    put(&hidden, &std::fs::read(&groups[2][0]).unwrap());
    give_to_nobody(&base);
    chmod(&locked, 0o000);
    chmod(&locked2, 0o000);
    chmod(&locked_dir, 0o000);
    let sums = checksum_tree(fs.path());

    let r = dedupe_as_nobody(&[&base], &[]);
    r.assert_code(EXIT_PARTIAL);
    let errors = r.errors();
    assert_eq!(
        errors.len(),
        3,
        "want one error per unreadable entry, got {errors:?}"
    );
    for p in [&locked, &locked2, &locked_dir] {
        let name = p.file_name().unwrap().to_str().unwrap();
        assert!(
            errors
                .iter()
                .any(|(path, e)| path.ends_with(name) && e.contains("Permission denied")),
            "no clear error for {}: {errors:?}",
            p.display()
        );
        assert!(
            r.stderr.contains(name),
            "stderr does not name {name}: {}",
            r.stderr
        );
    }
    assert_groups_shared("readable duplicates", &groups);
    assert_unshared(
        "unreadable files",
        &[locked.clone(), locked2.clone(), hidden.clone()],
    );
    assert_same("file contents changed", &checksum_tree(fs.path()), &sums);

    chmod(&locked, 0o644);
    chmod(&locked2, 0o644);
    chmod(&locked_dir, 0o755);
    let r = dedupe_as_nobody(&[&base], &[]);
    r.assert_ok();
    let mut all = groups.clone();
    all[0].push(locked);
    all[1].push(locked2);
    all[2].push(hidden);
    assert_groups_shared("after the clean run", &all);
    assert_same("file contents changed", &checksum_tree(fs.path()), &sums);
}

/// Immutable and append-only files are never destinations (their extents
/// stay exactly as they were) but may be sources; no error, exit 0.
fn immutable_and_append_only(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let groups = dup_groups(&root.join("d"), 3, 3, 3 * MIB + 5, 71);
    let immutable = vec![
        groups[0][1].clone(),
        groups[2][0].clone(),
        groups[2][1].clone(),
        groups[2][2].clone(),
    ];
    let append_only = vec![groups[1][0].clone(), groups[1][2].clone()];
    let protected: Vec<PathBuf> = immutable.iter().chain(&append_only).cloned().collect();
    let flags_i = Attrs::set("+i", &immutable);
    let flags_a = Attrs::set("+a", &append_only);
    let before = layouts(&protected);
    let sums = checksum_tree(root);

    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_same("file contents changed", &checksum_tree(root), &sums);
    assert_eq!(
        layouts(&protected),
        before,
        "immutable or append-only files were deduped into"
    );
    let g = &groups;
    assert!(
        same_physical(&g[0][0], &g[0][2]),
        "the writable pair of group 0 was not shared"
    );
    assert!(
        same_physical(&g[1][0], &g[1][1]) || same_physical(&g[1][2], &g[1][1]),
        "the writable file of group 1 was not shared with an append-only source"
    );

    drop(flags_i);
    drop(flags_a);
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_groups_shared("after removing the flags", &groups);
    assert_same("file contents changed", &checksum_tree(root), &sums);
}

/// An active swap file (btrfs: nocow, as swapon requires; XFS: plain) with
/// two byte copies of it: the swap file is left alone, its copies are
/// shared with each other, no error.
fn active_swap_file(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let sw = root.join("swap").join("swapfile");
    mkparent(&sw);
    File::create(&sw).unwrap();
    if kind == FsKind::Btrfs {
        run("chattr", &[OsStr::new("+C"), sw.as_os_str()]);
    }
    {
        let mut f = OpenOptions::new().write(true).open(&sw).unwrap();
        f.write_all(&random_bytes(16 * MIB as usize, 81)).unwrap();
        f.sync_all().unwrap();
    }
    chmod(&sw, 0o600);
    run("mkswap", &[sw.as_os_str()]);
    let copies = vec![root.join("swap").join("copy1"), root.join("copy2")];
    for c in &copies {
        copy_no_reflink(&sw, c).unwrap();
    }
    let other = dup_groups(&root.join("other"), 1, 2, 2 * MIB, 82);
    fs.sync();
    run("swapon", &[sw.as_os_str()]);
    let swap = Swap(sw.clone());
    let before = layouts(std::slice::from_ref(&sw));
    let sums = checksum_tree(root);

    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_eq!(
        layouts(std::slice::from_ref(&sw)),
        before,
        "the active swap file was touched"
    );
    assert!(
        same_physical(&copies[0], &copies[1]),
        "the copies of the swap file were not shared with each other"
    );
    assert_groups_shared("other duplicates", &other);
    assert_same("file contents changed", &checksum_tree(root), &sums);

    drop(swap);
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_same("file contents changed", &checksum_tree(root), &sums);
}

/// A file another process holds open for writing is deduped like any
/// other (the kernel locks and compares); a write through that process's
/// descriptor afterwards lands in that file only.
fn open_for_writing(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let groups = dup_groups(&root.join("d"), 2, 2, 2 * MIB + 1, 91);
    let target = groups[0][1].clone();
    let mut holder = Holder(
        Command::new("sh")
            .args([
                "-c",
                r#"exec 3<>"$0"; echo ready; read line; printf %s "$line" >&3; exec 3>&-; echo done"#,
            ])
            .arg(&target)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut out = BufReader::new(holder.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    let sums = checksum_tree(root);

    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_same("file contents changed", &checksum_tree(root), &sums);
    assert_groups_shared("with a writer holding a file open", &groups);

    // Write through the descriptor opened before the dedupe.
    let mut stdin = holder.0.stdin.take().unwrap();
    stdin.write_all(b"HELLO-FROM-THE-WRITER\n").unwrap();
    drop(stdin);
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "done");
    let mut want = std::fs::read(&groups[0][0]).unwrap();
    want[..21].copy_from_slice(b"HELLO-FROM-THE-WRITER");
    assert!(
        std::fs::read(&target).unwrap() == want,
        "the held descriptor's write did not land in its file"
    );
    assert_eq!(
        checksum_file(&groups[0][0]).unwrap(),
        sums[groups[0][0].strip_prefix(root).unwrap()],
        "a write into a deduped file changed its source"
    );
    let r = dedupe(&[root], &[]);
    r.assert_ok();
}

/// Read-only bind mounts inside the tree: one of a directory outside the
/// tree, one of a directory inside it (its files are reachable writable
/// too, under a path that sorts later). Files reachable only read-only are
/// a clear skip (at most sources), never an error storm; files also
/// reachable writable are deduped.
fn read_only_bind_mounts(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let tree = root.join("tree");
    let rw = dup_groups(&tree.join("rw"), 2, 2, 2 * MIB + 7, 101);
    let outside = dup_groups(&root.join("outside"), 2, 2, 2 * MIB + 9, 102);
    // Copies of a tree group outside too: the ro view holds duplicates of
    // writable files.
    let extra_outside = root.join("outside").join("copy-of-rw.bin");
    copy_no_reflink(&rw[0][0], &extra_outside).unwrap();
    let inside = dup_groups(&tree.join("z-inside"), 1, 3, 2 * MIB + 11, 103);
    let ro_outside = Mounted::bind_ro(&root.join("outside"), &tree.join("ro-outside"));
    let ro_inside = Mounted::bind_ro(&tree.join("z-inside"), &tree.join("a-ro-inside"));
    let mut outside_files = flat(&outside);
    outside_files.push(extra_outside);
    let before = layouts(&outside_files);
    let sums = checksum_tree(root);

    let r = dedupe(&[&tree], &[]);
    r.assert_ok();
    assert_same("file contents changed", &checksum_tree(root), &sums);
    assert_eq!(
        layouts(&outside_files),
        before,
        "files reachable only through a read-only mount were changed"
    );
    assert_groups_shared("writable duplicates", &rw);
    assert_groups_shared("files reachable writable and read-only", &inside);

    drop(ro_inside);
    drop(ro_outside);
    let r = dedupe(&[&tree], &[]);
    r.assert_ok();
    // The read-only views are gone now: compare the files themselves.
    let mut real = sums.clone();
    real.retain(|p, _| !p.starts_with("tree/a-ro-inside") && !p.starts_with("tree/ro-outside"));
    assert_same("file contents changed", &checksum_tree(root), &real);
}

/// btrfs: a read-only snapshot inside the tree is never deduped into (with
/// or without `--cross-filesystems`): its extents stay as they were, no
/// error.
#[test]
fn read_only_snapshot_btrfs() {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let root = fs.path();
    let vol = root.join("vol");
    btrfs(&["subvolume", "create"], &[&vol]);
    let before_snap = dup_groups(&vol.join("old"), 2, 2, 2 * MIB + 3, 111);
    fs.sync();
    let snap = vol.join("snap-ro");
    btrfs(&["subvolume", "snapshot", "-r"], &[&vol, &snap]);
    let after_snap = dup_groups(&vol.join("new"), 1, 2, 2 * MIB + 5, 112);
    let snap_files: Vec<PathBuf> = flat(&before_snap)
        .iter()
        .map(|p| snap.join(p.strip_prefix(&vol).unwrap()))
        .collect();
    let before = layouts(&snap_files);
    let sums = checksum_tree(root);

    for extra in [&[][..], &["--cross-filesystems"][..]] {
        let r = dedupe(&[&vol], extra);
        r.assert_ok();
        assert_same(&format!("{extra:?}"), &checksum_tree(root), &sums);
        assert_eq!(
            layouts(&snap_files),
            before,
            "{extra:?}: files of the read-only snapshot were deduped into"
        );
        assert_groups_shared("outside the snapshot", &before_snap);
        assert_groups_shared("outside the snapshot", &after_snap);
    }
    let ro = run(
        "btrfs",
        &[
            OsStr::new("property"),
            OsStr::new("get"),
            snap.as_os_str(),
            OsStr::new("ro"),
        ],
    );
    assert_eq!(ro.trim(), "ro=true");
}

/// btrfs, issue 34: `--exclude-snapshots` enters no snapshot, read-only or
/// writable, and walks no root inside one: their files are neither listed,
/// read nor deduped (same contents, same extents), each snapshot is counted
/// once as skipped, and the live duplicates are shared as ever. Without the
/// option the snapshots' files are scanned.
#[test]
fn exclude_snapshots_btrfs() {
    const LEN: u64 = 2 * MIB + 3;
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let root = fs.path();
    let vol = root.join("vol");
    btrfs(&["subvolume", "create"], &[&vol]);
    let live = dup_groups(&vol.join("data"), 2, 2, LEN, 141);
    fs.sync();
    let snap_ro = root.join("snap-ro");
    let snap_rw = root.join("backups").join("snap-rw");
    mkparent(&snap_rw);
    for (snap, ro) in [(&snap_ro, true), (&snap_rw, false)] {
        let mut args = vec![OsStr::new("subvolume"), OsStr::new("snapshot")];
        if ro {
            args.push(OsStr::new("-r"));
        }
        args.extend([vol.as_os_str(), snap.as_os_str()]);
        run("btrfs", &args);
    }
    // Duplicates only the writable snapshot holds: deduped without the
    // option, never with it.
    let rw_extra = dup_groups(&snap_rw.join("extra"), 1, 2, LEN + 2, 142);
    fs.sync();
    let mut snap_files: Vec<PathBuf> = [&snap_ro, &snap_rw]
        .iter()
        .flat_map(|s| {
            flat(&live)
                .into_iter()
                .map(|p| s.join(p.strip_prefix(&vol).unwrap()))
        })
        .collect();
    snap_files.extend(flat(&rw_extra));
    assert_eq!(snap_files.len(), 10);
    let snap_layouts = layouts(&snap_files);
    let sums = checksum_tree(root);

    // Roots inside snapshots: skipped whole, nothing listed, no error.
    let r = dedupe(
        &[snap_rw.clone(), snap_ro.join("data")],
        &["--no-catalog", "--exclude-snapshots"],
    );
    r.assert_ok();
    assert_eq!(r.u("files_scanned"), 0, "files of snapshot roots listed");
    assert_eq!(r.u("bytes_read"), 0, "files of snapshot roots read");
    assert_eq!(r.files_skipped("snapshot"), 2, "{}", r.report());

    // The whole mount: only the live subvolume's files.
    let live_bytes = LEN * flat(&live).len() as u64;
    let r = dedupe(
        &[root],
        &["--no-catalog", "--exclude-snapshots", "--verbose"],
    );
    r.assert_ok();
    assert_eq!(
        r.files_skipped("snapshot"),
        2,
        "snapshots not entered: {}",
        r.report()["files_skipped"]
    );
    assert_eq!(r.u("files_scanned"), flat(&live).len() as u64);
    assert_eq!(r.u("bytes_scanned"), live_bytes);
    assert!(
        r.u("bytes_read") > 0 && r.u("bytes_read") <= live_bytes,
        "bytes_read {} for {live_bytes} live bytes",
        r.u("bytes_read")
    );
    let read: Vec<PathBuf> = r.report()["read_paths"]
        .as_array()
        .expect("read_paths in a --verbose report")
        .iter()
        .map(|p| PathBuf::from(p.as_str().unwrap()))
        .collect();
    assert!(!read.is_empty(), "nothing read");
    // Read paths are canonical, as the roots are made.
    let live_dir = vol.canonicalize().unwrap();
    let elsewhere: Vec<&PathBuf> = read.iter().filter(|p| !p.starts_with(&live_dir)).collect();
    assert!(
        elsewhere.is_empty(),
        "files outside the live subvolume read: {elsewhere:?}"
    );
    assert_groups_shared("live duplicates", &live);
    assert_same("file contents changed", &checksum_tree(root), &sums);
    assert_eq!(
        layouts(&snap_files),
        snap_layouts,
        "files of the snapshots were deduped into"
    );
    assert!(
        !same_physical(&rw_extra[0][0], &rw_extra[0][1]),
        "duplicates in the writable snapshot were shared"
    );

    // Without the option the snapshots are walked, the read-only one by
    // its difference from vol: its files are vol's, unchanged but for the
    // dedupe, and not listed (a dry run: nothing changes).
    let r = dedupe(&[root], &["--no-catalog", "--dry-run"]);
    r.assert_ok();
    assert_eq!(r.files_skipped("snapshot"), 0);
    let diff = &r.report()["snapshots_by_difference"];
    assert_eq!(diff["snapshots"], 1, "{diff}");
    assert_eq!(diff["files_as_parent"], flat(&live).len() as u64, "{diff}");
    assert_eq!(
        r.u("files_scanned"),
        (flat(&live).len() + snap_files.len() - flat(&live).len()) as u64,
        "snapshot files not scanned without --exclude-snapshots"
    );
    // The live duplicates are all shared by now: what is left to share is
    // in the writable snapshot.
    assert!(
        r.u("bytes_would_share") >= 2 * MIB,
        "the writable snapshot's duplicates were not found: {}",
        r.report()
    );
    assert_same("file contents changed", &checksum_tree(root), &sums);
    assert_eq!(
        layouts(&snap_files),
        snap_layouts,
        "a dry run changed extents"
    );
}

/// btrfs: a writable subvolume inside the tree is the same filesystem and
/// is crossed (ARCHITECTURE: "btrfs subvolumes are crossed"): duplicates
/// on either side of it are shared.
#[test]
fn nested_subvolume_btrfs() {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let root = fs.path();
    let sub = root.join("sub");
    btrfs(&["subvolume", "create"], &[&sub]);
    let a = root.join("plain").join("a.bin");
    mkparent(&a);
    write_random(&a, 3 * MIB + 1, 121).unwrap();
    let b = sub.join("b.bin");
    copy_no_reflink(&a, &b).unwrap();
    let sums = checksum_tree(root);
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_same("file contents changed", &checksum_tree(root), &sums);
    assert!(
        same_physical(&a, &b),
        "duplicates across a btrfs subvolume boundary were not shared (files_skipped {})",
        r.report()["files_skipped"]
    );
}

// ---------------------------------------------------------------------------
// Mounts, other filesystems, roots
// ---------------------------------------------------------------------------

/// Another filesystem of the same kind and a tmpfs mounted inside the
/// tree: not entered by default (counted as skipped); with
/// `--cross-filesystems` the nested filesystem is deduped on its own and
/// the tmpfs is skipped as unsupported; never a cross-filesystem error.
/// Roots on two filesystems at once work too.
fn nested_mounts(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let inner = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let outer = dup_groups(&root.join("data"), 2, 2, 2 * MIB + 1, 131);
    // The inner filesystem holds its own duplicates and copies of outer files.
    let inner_groups = dup_groups(&inner.path().join("own"), 1, 2, 2 * MIB + 3, 132);
    let inner_copy = inner.path().join("copy-of-outer.bin");
    copy_no_reflink(&outer[0][0], &inner_copy).unwrap();
    let mut inner_files = flat(&inner_groups);
    inner_files.push(inner_copy.clone());
    let inner_mnt = Mounted::bind(inner.path(), &root.join("mnt-inner"));
    let tmp_mnt = Mounted::tmpfs(&root.join("mnt-tmpfs"), 64 * MIB);
    let tmp_copy = root.join("mnt-tmpfs").join("copy-of-outer.bin");
    copy_no_reflink(&outer[0][0], &tmp_copy).unwrap();
    let inner_layout = layouts(&inner_files);
    let sums = checksum_tree(root);
    let outer_sums = checksum_tree(&root.join("data"));

    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_eq!(
        r.files_skipped("other_filesystem"),
        2,
        "nested mounts not reported as skipped"
    );
    assert_eq!(
        r.u("files_scanned"),
        4,
        "files of nested mounts were scanned"
    );
    assert_groups_shared("outer duplicates", &outer);
    assert_eq!(
        layouts(&inner_files),
        inner_layout,
        "a nested mount was entered"
    );
    assert_same("file contents changed", &checksum_tree(root), &sums);

    let r = dedupe(&[root], &["--cross-filesystems"]);
    r.assert_ok();
    assert!(
        r.files_skipped("unsupported_filesystem") >= 1,
        "the tmpfs file was not skipped as unsupported: {}",
        r.report()["files_skipped"]
    );
    assert_groups_shared("inner duplicates", &inner_groups);
    assert_same("file contents changed", &checksum_tree(root), &sums);

    // Roots on two filesystems at once (one given through its own mount).
    drop(tmp_mnt);
    drop(inner_mnt);
    let other = new_fs(kind, 512 * MIB);
    let other_groups = dup_groups(&other.path().join("x"), 1, 2, MIB + 5, 133);
    let other_copy = other.path().join("copy-of-outer.bin");
    copy_no_reflink(&outer[1][0], &other_copy).unwrap();
    let r = dedupe(&[root, other.path()], &[]);
    r.assert_ok();
    assert_groups_shared("second root", &other_groups);
    assert_same(
        "file contents changed",
        &checksum_tree(&root.join("data")),
        &outer_sums,
    );
}

/// ext4 and tmpfs roots are refused up front with exit 3 and a short,
/// clear message, also as a single file and next to a btrfs root (nothing
/// is scanned then).
#[test]
fn unsupported_roots() {
    let btrfs = new_fs(FsKind::Btrfs, 256 * MIB);
    let ext4 = new_fs(FsKind::Ext4, 64 * MIB);
    let tmpfs = new_fs(FsKind::Tmpfs, 64 * MIB);
    let ok = dup_groups(btrfs.path(), 1, 2, MIB + 1, 141);
    for (fs, name) in [(&ext4, "ext"), (&tmpfs, "tmpfs")] {
        let g = dup_groups(fs.path(), 1, 2, MIB + 1, 142);
        let sums = checksum_tree(fs.path());
        for root in [fs.path(), g[0][0].as_path()] {
            let r = dedupe(&[root], &[]);
            r.assert_code(EXIT_UNSUPPORTED);
            let msg = r.stderr.trim();
            assert!(
                msg.contains(name) && msg.contains(&*root.to_string_lossy()),
                "unclear refusal for {}: {msg:?}",
                root.display()
            );
            assert!(msg.lines().count() <= 2, "want a short message: {msg:?}");
            assert!(r.json.is_none() || r.u("files_scanned") == 0);
        }
        let r = dedupe(&[btrfs.path(), fs.path()], &[]);
        r.assert_code(EXIT_UNSUPPORTED);
        assert_unshared("next to an unsupported root", &flat(&ok));
        assert_same(fs.kind().name(), &checksum_tree(fs.path()), &sums);
    }
    let r = dedupe(&[btrfs.path()], &[]);
    r.assert_ok();
    assert_groups_shared("the supported root alone", &ok);
}

/// Roots that are single files: alone (nothing to do), the same file
/// twice (no dedupe of a file with itself), a file inside a directory root
/// (counted once); a root that is a symlink loop or missing is a bad
/// argument (exit 2) with a clear message.
fn file_roots(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let g = dup_groups(&root.join("d"), 1, 3, 2 * MIB + 1, 151);
    let sums = checksum_tree(root);

    let r = dedupe(&[&g[0][0]], &[]);
    r.assert_ok();
    assert_eq!(r.u("files_scanned"), 1);
    assert_eq!(r.u("dedupe_ioctls"), 0);
    let r = dedupe(&[&g[0][0], &g[0][0]], &[]);
    r.assert_ok();
    assert_eq!(r.u("dedupe_ioctls"), 0, "a file was deduped with itself");
    assert_unshared("single-file roots", &g[0]);
    let r = dedupe(&[root.join("d"), g[0][1].clone()], &[]);
    r.assert_ok();
    assert_eq!(
        r.u("files_scanned"),
        3,
        "a file given twice was counted twice"
    );
    assert_groups_shared("directory and file root", &g);
    assert_same("file contents changed", &checksum_tree(root), &sums);

    let lp = root.join("loop");
    std::os::unix::fs::symlink(&lp, &lp).unwrap();
    let missing = root.join("missing");
    for (p, words) in [(&lp, "symbolic links"), (&missing, "No such file")] {
        let r = dedupe(&[p], &[]);
        r.assert_code(EXIT_USAGE);
        let msg = r.stderr.trim();
        assert!(
            msg.contains(&*p.to_string_lossy()) && msg.contains(words),
            "unclear message for {}: {msg:?}",
            p.display()
        );
        assert!(msg.lines().count() <= 2, "want a short message: {msg:?}");
    }
}

// ---------------------------------------------------------------------------
// Names, paths and tree shapes
// ---------------------------------------------------------------------------

/// File and directory names with newlines, tabs, escape sequences, glob
/// characters, leading dashes and invalid UTF-8, under a root whose own
/// name is like that: all deduped, the JSON report stays valid.
fn hostile_names(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let base = fs
        .path()
        .join(OsStr::from_bytes(b"root\nwith newline \xff\xfe"));
    let dirs: [&[u8]; 3] = [b"dir\nnl", b"\x80dir\xc3\x28", b"plain"];
    let names: [&[u8]; 10] = [
        b"new\nline.bin",
        b"\xff\xfe\xfd.bin",
        b"tab\tsp ace.bin",
        b"-n",
        b"--json",
        b"back\\slash\"quote",
        b"\xc3\x28",
        b"*?[glob]",
        b".hidden",
        b"\x1b[31mred\x1b[0m",
    ];
    let data = [
        random_bytes(MIB as usize + 3, 161),
        random_bytes(MIB as usize + 5, 162),
    ];
    let mut groups = vec![Vec::new(), Vec::new()];
    for (i, n) in names.iter().enumerate() {
        let p = base
            .join(OsStr::from_bytes(dirs[i % 3]))
            .join(OsStr::from_bytes(n));
        put(&p, &data[i % 2]);
        groups[i % 2].push(p);
    }
    let sums = checksum_tree(&base);

    let r = dedupe(&[&base], &[]);
    r.assert_ok();
    assert_eq!(r.u("files_scanned"), names.len() as u64);
    assert_groups_shared("hostile names", &groups);
    assert_same("file contents changed", &checksum_tree(&base), &sums);
    // Text output too.
    let r = onecopy(&[OsStr::new("dedupe"), base.as_os_str()]);
    r.assert_ok();
    assert_same("file contents changed", &checksum_tree(&base), &sums);
}

/// Paths of about 4,000 bytes (nested directories of 255-byte names), in
/// two branches, plus a short one: all three copies shared.
fn long_paths(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let data = random_bytes(MIB as usize + 7, 171);
    let short = root.join("short.bin");
    put(&short, &data);
    let mut files = vec![short];
    for branch in ["A", "B"] {
        // 255-byte directory names, then one shorter, then a 200-byte
        // file name: 4,000 bytes in all.
        let mut p = root.join("long").join(branch);
        let mut need = 4000 - p.as_os_str().len() - 201;
        let mut i = 0;
        while need > 256 {
            p = p.join(format!("{i:03}{}", "x".repeat(252)));
            need -= 256;
            i += 1;
        }
        if need > 1 {
            p = p.join("y".repeat(need - 1));
        }
        let f = p.join("f".repeat(200));
        assert!(
            f.as_os_str().len() >= 3999,
            "path only {} bytes",
            f.as_os_str().len()
        );
        put(&f, &data);
        files.push(f);
    }
    let sums = checksum_tree(root);
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_eq!(r.u("files_scanned"), 3);
    assert_groups_shared("4,000-byte paths", &[files]);
    assert_same("file contents changed", &checksum_tree(root), &sums);
}

const DEEP: usize = 10_000;
const DEEP_MID: usize = 1_000;

/// Goes `depth` levels down `d/d/d/...` from `top`, fd-relative.
fn descend(top: &Path, depth: usize) -> std::os::fd::OwnedFd {
    let mut fd = open_dir(top);
    for _ in 0..depth {
        fd = open_dir_at(&fd, b"d");
    }
    fd
}

/// A tree 10,000 directories deep (paths of 20,000 bytes, far beyond
/// PATH_MAX): no crash, and its files are deduped like any other — the
/// kernel takes descriptors, not paths.
fn deep_tree(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let data = random_bytes(MIB as usize + 17, 181);
    let top = root.join("top.bin");
    put(&top, &data);
    let unique = random_bytes(MIB as usize, 182);
    std::fs::create_dir(root.join("deep")).unwrap();
    let mut fd = open_dir(&root.join("deep"));
    for level in 1..=DEEP {
        fd = mkdir_at(&fd, b"d");
        if level == DEEP_MID {
            open_file_at(&fd, b"mid.bin", true)
                .write_all(&data)
                .unwrap();
        }
    }
    open_file_at(&fd, b"bottom.bin", true)
        .write_all(&data)
        .unwrap();
    open_file_at(&fd, b"unique.bin", true)
        .write_all(&unique)
        .unwrap();
    drop(fd);
    let top_sum = checksum_file(&top).unwrap();

    let started = Instant::now();
    let r = dedupe(&[root], &[]);
    eprintln!("deep_tree/{kind}: run took {:?}", started.elapsed());
    r.assert_sane();

    // Contents first: whatever the outcome, nothing may have changed.
    let read_at = |depth: usize, name: &[u8]| {
        let mut v = Vec::new();
        open_file_at(&descend(&root.join("deep"), depth), name, false)
            .read_to_end(&mut v)
            .unwrap();
        v
    };
    assert_eq!(checksum_file(&top).unwrap(), top_sum, "top.bin changed");
    assert!(read_at(DEEP_MID, b"mid.bin") == data, "mid.bin changed");
    assert!(read_at(DEEP, b"bottom.bin") == data, "bottom.bin changed");
    assert!(read_at(DEEP, b"unique.bin") == unique, "unique.bin changed");

    r.assert_ok();
    assert_eq!(
        r.u("files_scanned"),
        4,
        "not every file of the deep tree was found"
    );
    let top_f = File::open(&top).unwrap();
    let mid_f = open_file_at(&descend(&root.join("deep"), DEEP_MID), b"mid.bin", false);
    let bottom_f = open_file_at(&descend(&root.join("deep"), DEEP), b"bottom.bin", false);
    assert!(
        fd_fully_shared(&top_f, &mid_f),
        "mid.bin (depth 1,000) was not shared"
    );
    assert!(
        fd_fully_shared(&top_f, &bottom_f),
        "bottom.bin (depth 10,000) was not shared"
    );
}

/// Sparse files (data islands in holes), their twin and a dense file with
/// the same bytes: shared, contents unchanged, no space used up by holes,
/// and a second run issues no dedupe call.
fn sparse_files(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let len = 64 * MIB;
    let islands = [
        (0, MIB, 191u64),
        (10 * MIB, MIB, 192),
        (40 * MIB + 64 * KIB, 512 * KIB, 193),
    ];
    let make = |p: &Path, seed_xor: u64| {
        let f = File::create(p).unwrap();
        f.set_len(len).unwrap();
        for &(off, n, s) in &islands {
            f.write_all_at(&random_bytes(n as usize, s ^ seed_xor), off)
                .unwrap();
        }
    };
    let s1 = root.join("sparse1");
    let s2 = root.join("sparse2");
    let s3 = root.join("sparse-unique");
    make(&s1, 0);
    make(&s2, 0);
    make(&s3, 0xabc);
    let dense = root.join("dense");
    {
        let mut buf = vec![0u8; len as usize];
        for &(off, n, s) in &islands {
            buf[off as usize..(off + n) as usize].copy_from_slice(&random_bytes(n as usize, s));
        }
        std::fs::write(&dense, &buf).unwrap();
    }
    let sums = checksum_tree(root);
    let used0 = fs.used_bytes();

    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_same("file contents changed", &checksum_tree(root), &sums);
    let used1 = fs.used_bytes();
    assert!(
        used1 <= used0 + MIB,
        "dedupe of sparse files used space: {used0} -> {used1}"
    );
    let island_bytes: u64 = islands.iter().map(|i| i.1).sum();
    assert!(
        shared_bytes_between(&s1, &s2) >= island_bytes,
        "the twin sparse files' data was not shared ({} of {island_bytes} bytes)",
        shared_bytes_between(&s1, &s2)
    );
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_eq!(
        r.u("dedupe_ioctls"),
        0,
        "second run over sparse files issued dedupe calls"
    );
    assert_same("file contents changed", &checksum_tree(root), &sums);
}

/// A sparse file over 4 GiB holding the same 2 MiB at offset 1 MiB and
/// beyond 4 GiB, and a small file holding them after a unique header:
/// all three copies end up on the same physical bytes (offsets and lengths
/// beyond 32 bits), nothing else changes, no space is used.
fn sparse_over_4gib(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let data = random_bytes(2 * MIB as usize, 201);
    let far = 4 * GIB + 2 * MIB;
    let big = root.join("big");
    {
        let f = File::create(&big).unwrap();
        f.set_len(4 * GIB + 8 * MIB).unwrap();
        f.write_all_at(&data, MIB).unwrap();
        f.write_all_at(&data, far).unwrap();
        f.write_all_at(&random_bytes(64 * KIB as usize, 202), 4 * GIB + 6 * MIB)
            .unwrap();
    }
    let small = root.join("small");
    {
        let mut v = random_bytes(64 * KIB as usize, 203);
        v.extend_from_slice(&data);
        std::fs::write(&small, &v).unwrap();
    }
    let digests = [sparse_digest(&big), sparse_digest(&small)];
    let used0 = fs.used_bytes();

    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_eq!(
        [sparse_digest(&big), sparse_digest(&small)],
        digests,
        "file contents changed"
    );
    let used1 = fs.used_bytes();
    assert!(used1 <= used0 + MIB, "space used: {used0} -> {used1}");
    let low = physical_of(&big, MIB, 2 * MIB);
    assert_eq!(
        physical_of(&big, far, 2 * MIB),
        low,
        "the copy beyond 4 GiB was not shared with the one at 1 MiB"
    );
    assert_eq!(
        physical_of(&small, 64 * KIB, 2 * MIB),
        low,
        "the small file was not shared with the big one"
    );
}

/// Empty files, files smaller than a block, and all-zero files (dense,
/// and a sparse one). As documented, empty files and (on btrfs, where they
/// are inline in metadata) files of at most 2048 bytes are skipped as too
/// small; larger small files are deduped as a whole (on XFS even a 1-byte
/// file owns a block). No error, no space growth, and a second run issues
/// no dedupe call.
fn empty_and_zero_files(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    for i in 0..5 {
        put(&root.join("empty").join(format!("e{i}")), b"");
    }
    // Pairs of identical small files: 1 byte, 100 bytes, 2048 bytes (the
    // btrfs inline limit), 2049 bytes, 4095 bytes.
    let mut tiny = Vec::new();
    for n in [1usize, 100, 2048, 2049, 4095] {
        let pair: Vec<PathBuf> = (0..2)
            .map(|c| root.join("tiny").join(format!("t{n}-{c}")))
            .collect();
        for p in &pair {
            put(p, &vec![7u8; n]);
        }
        tiny.push((n, pair));
    }
    for (i, n) in [MIB, MIB, MIB, 4 * KIB, 4 * KIB, 64 * KIB + 1]
        .iter()
        .enumerate()
    {
        put(
            &root.join("zero").join(format!("z{i}")),
            &vec![0u8; *n as usize],
        );
    }
    File::create(root.join("zero").join("sparse-zero"))
        .unwrap()
        .set_len(MIB)
        .unwrap();
    let sums = checksum_tree(root);
    let used0 = fs.used_bytes();

    let r = dedupe(&[root], &[]);
    r.assert_ok();
    let inline = |n: usize| kind == FsKind::Btrfs && n <= 2048;
    let want_small = 5 + 2 * tiny.iter().filter(|(n, _)| inline(*n)).count() as u64;
    assert_eq!(
        r.files_skipped("too_small"),
        want_small,
        "files skipped as too small: {}",
        r.report()["files_skipped"]
    );
    assert_same("file contents changed", &checksum_tree(root), &sums);
    for (n, pair) in &tiny {
        if !inline(*n) {
            assert!(
                same_physical(&pair[0], &pair[1]),
                "identical {n}-byte files were not shared"
            );
        }
    }
    let used1 = fs.used_bytes();
    assert!(used1 <= used0 + MIB, "space used: {used0} -> {used1}");
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_eq!(r.u("dedupe_ioctls"), 0, "second run issued dedupe calls");
    assert_same("file contents changed", &checksum_tree(root), &sums);
}

/// Two inodes with 1,000 names each and the same content, plus a plain
/// copy: each inode is read once, all three are shared, every link still
/// reads the same and the link counts are unchanged.
fn hardlink_farm(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let a = root.join("farm-a").join("0.bin");
    put(&a, &random_bytes(256 * KIB as usize + 3, 211));
    let b = root.join("farm-b").join("0.bin");
    mkparent(&b);
    copy_no_reflink(&a, &b).unwrap();
    let c = root.join("plain.bin");
    copy_no_reflink(&a, &c).unwrap();
    for first in [&a, &b] {
        let dir = first.parent().unwrap();
        for i in 1..1000 {
            let l = dir
                .join(format!("s{}", i % 10))
                .join(format!("link{i}.bin"));
            mkparent(&l);
            std::fs::hard_link(first, &l).unwrap();
        }
    }
    let sums = checksum_tree(root);

    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_eq!(
        r.u("files_scanned"),
        3,
        "an inode was scanned more than once"
    );
    assert_eq!(r.files_skipped("hardlink"), 2 * 999);
    assert_same("file contents changed", &checksum_tree(root), &sums);
    assert_groups_shared("hardlink farms", &[vec![a.clone(), b.clone(), c]]);
    for p in [&a, &b] {
        assert_eq!(std::fs::metadata(p).unwrap().nlink(), 1000);
    }
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_eq!(r.u("dedupe_ioctls"), 0, "second run issued dedupe calls");
}

/// Symlink loops and symlinks to `/`, to the mount point, to `..`, to a
/// file outside the tree and dangling ones: never followed (counted as not
/// regular), no error; a root that is a symlink loop is a bad argument.
fn symlink_loops(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let g = dup_groups(&root.join("data"), 1, 2, MIB + 1, 221);
    let outside = fs.path().parent().unwrap().join("outside.bin");
    copy_no_reflink(&g[0][0], &outside).unwrap();
    let links = root.join("links");
    std::fs::create_dir(&links).unwrap();
    let targets: [(&str, PathBuf); 9] = [
        ("self", links.join("self")),
        ("a", links.join("b")),
        ("b", links.join("a")),
        ("dot", PathBuf::from(".")),
        ("up", PathBuf::from("..")),
        ("abs-root", PathBuf::from("/")),
        ("mount-point", root.to_path_buf()),
        ("dangling", PathBuf::from("nowhere")),
        ("outside", outside.clone()),
    ];
    for (name, t) in &targets {
        std::os::unix::fs::symlink(t, links.join(name)).unwrap();
    }
    std::os::unix::fs::symlink("../data/g0/c0.bin", links.join("to-dupe")).unwrap();
    let sums = checksum_tree(root);

    let started = Instant::now();
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(r.u("files_scanned"), 2, "a symlink was followed");
    assert_eq!(r.files_skipped("not_regular"), targets.len() as u64 + 1);
    assert_groups_shared("next to symlink loops", &g);
    assert_same("file contents changed", &checksum_tree(root), &sums);

    let r = dedupe(&[links.join("self")], &[]);
    r.assert_code(EXIT_USAGE);
    assert!(
        r.stderr.contains("symbolic links"),
        "unclear message: {:?}",
        r.stderr
    );
}

// ---------------------------------------------------------------------------
// Out of space
// ---------------------------------------------------------------------------

/// Writes `chunk`-byte pieces of random data to `f` until ENOSPC.
fn fill(f: &mut File, rng: &mut Prng, chunk: usize) {
    let mut buf = vec![0u8; chunk];
    loop {
        rng.fill(&mut buf);
        match f.write_all(&buf) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling: {e}"),
        }
    }
    let _ = f.sync_all();
}

/// A small filesystem filled to the last few KiB (data, and on btrfs
/// metadata too) holding near duplicates, whose dedupe frees nothing until
/// btrfs re-homes their unique remainders into new extents: dedupe and
/// re-homing may fail for lack of space, but only with a clear "no space"
/// error per affected file, never a changed byte or a left-over temporary
/// directory; once space is freed, a clean run shares everything.
fn out_of_space(kind: FsKind) {
    let fs = new_fs(kind, 256 * MIB);
    let root = fs.path();
    // Near duplicates: one 32-byte change each, in different blocks.
    let base = random_bytes(8 * MIB as usize, 232);
    let mut near = Vec::new();
    for i in 0..4u64 {
        let mut v = base.clone();
        if i > 0 {
            let at = (i * 2 * MIB + 12_345) as usize;
            v[at..at + 32].copy_from_slice(&random_bytes(32, 233 + i));
        }
        let p = root.join("near").join(format!("n{i}.bin"));
        put(&p, &v);
        near.push(p);
    }
    fs.sync();
    let filler = root.join("filler");
    let mut rng = Prng::new(234);
    let mut f = File::create(&filler).unwrap();
    fill(&mut f, &mut rng, MIB as usize);
    fill(&mut f, &mut rng, 4096);
    let len = f.metadata().unwrap().len();
    drop(f);
    let mut small_files = 0;
    if kind == FsKind::Btrfs {
        // Inline extents live in metadata: fill that too.
        let dir = root.join("meta-filler");
        std::fs::create_dir(&dir).unwrap();
        let data = random_bytes(2000, 235);
        loop {
            let p = dir.join(small_files.to_string());
            match std::fs::write(&p, &data) {
                Ok(()) => small_files += 1,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                    // Its content is undefined after a failed write.
                    let _ = std::fs::remove_file(&p);
                    break;
                }
                Err(e) => panic!("filling metadata: {e}"),
            }
            if small_files >= 200_000 {
                break;
            }
        }
    }
    fs.sync();
    let free = {
        let fd = File::open(root).unwrap();
        use std::os::fd::AsFd;
        onecopy_ioctl::fs::fs_info(fd.as_fd()).unwrap().avail_bytes
    };
    eprintln!(
        "out_of_space/{kind}: filler {len} bytes and {small_files} small files, {free} bytes available"
    );
    let sums = user_sums(root);

    let r = dedupe(&[root], &[]);
    r.assert_sane();
    let errors = r.errors();
    eprintln!(
        "out_of_space/{kind}: exit {:?}, {} errors {:?}, rehome {} of {} ranges",
        r.code(),
        errors.len(),
        errors.iter().take(5).collect::<Vec<_>>(),
        r.u("rehome_extents"),
        r.u("rehome_ranges")
    );
    assert!(
        matches!(r.code(), Some(EXIT_OK) | Some(EXIT_PARTIAL)),
        "exit code {:?}",
        r.code()
    );
    for (p, e) in &errors {
        assert!(
            e.to_lowercase().contains("no space left"),
            "an error other than 'no space left' on a full filesystem: {p}: {e}"
        );
    }
    assert!(
        errors.len() <= near.len() + 1,
        "an error storm: {} errors",
        errors.len()
    );
    assert_same("file contents changed", &user_sums(root), &sums);
    assert!(
        tmp_dirs(root).is_empty(),
        "temporary directory left: {:?}",
        tmp_dirs(root)
    );

    std::fs::remove_file(&filler).unwrap();
    if small_files > 0 {
        std::fs::remove_dir_all(root.join("meta-filler")).unwrap();
    }
    fs.sync();
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    for n in &near[1..] {
        assert!(
            shared_bytes_between(&near[0], n) >= 8 * MIB - 64 * KIB,
            "near duplicate {} not shared",
            n.display()
        );
    }
    assert!(tmp_dirs(root).is_empty(), "temporary directory left");
    let mut sums_after = sums;
    sums_after.retain(|p, _| p.starts_with("near"));
    assert_same("file contents changed", &user_sums(root), &sums_after);
}

// ---------------------------------------------------------------------------
// Signals
// ---------------------------------------------------------------------------

/// Asserts two checksum maps are equal, naming the paths that differ.
#[track_caller]
fn assert_same(ctx: &str, got: &BTreeMap<PathBuf, u128>, want: &BTreeMap<PathBuf, u128>) {
    let differ: Vec<&PathBuf> = got
        .keys()
        .chain(want.keys())
        .filter(|p| got.get(*p) != want.get(*p))
        .collect();
    assert!(
        differ.is_empty(),
        "{ctx}: file contents changed: {differ:?}"
    );
}

/// Whether process `pid` holds an unnamed (`O_TMPFILE`) file open.
/// Whether process `pid` (our child, not yet waited for) has exited.
fn exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
    })
}

fn holds_unnamed_file(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|rd| {
        rd.flatten().any(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| {
                let t = t.to_string_lossy();
                t.contains("/#") && t.ends_with("(deleted)")
            })
        })
    })
}

/// Checksums of the user's files: everything but onecopy's own temporary
/// directories (a SIGKILLed run leaves its lock file behind).
fn user_sums(root: &Path) -> BTreeMap<PathBuf, u128> {
    let mut m = checksum_tree(root);
    m.retain(|p, _| {
        !p.components()
            .next()
            .is_some_and(|c| c.as_os_str().as_bytes().starts_with(b".onecopy-tmp."))
    });
    m
}

/// One batch of work for a signalled run: whole duplicates, near
/// duplicates (btrfs re-homing) and many small duplicates, so that a run
/// spends time in every phase. Returns the whole groups and the near files.
fn signal_batch(root: &Path, batch: u64) -> (Vec<Vec<PathBuf>>, Vec<PathBuf>) {
    let dir = root.join(format!("batch{batch}"));
    let seed = 7000 + batch * 100;
    let whole = dup_groups(&dir.join("whole"), 6, 3, 3 * MIB + 4097, seed);
    let base = random_bytes(6 * MIB as usize, seed ^ 1);
    let mut near = Vec::new();
    for i in 0..4u64 {
        let mut v = base.clone();
        if i > 0 {
            let at = (i * MIB + 777) as usize;
            v[at..at + 32].copy_from_slice(&random_bytes(32, seed ^ (10 + i)));
        }
        let p = dir.join("near").join(format!("n{i}.bin"));
        put(&p, &v);
        near.push(p);
    }
    for g in 0..300u64 {
        let d = random_bytes(12 * KIB as usize, seed ^ (100 + g));
        for c in 0..2 {
            put(
                &dir.join("small")
                    .join(format!("s{}", g % 10))
                    .join(format!("{g}-{c}")),
                &d,
            );
        }
    }
    (whole, near)
}

/// The clean run after signals: exit 0, no temporary directory left, every
/// duplicate shared, every file unchanged; a further run has nothing to do.
fn clean_run_after_signals(
    root: &Path,
    sums: &BTreeMap<PathBuf, u128>,
    whole: &[Vec<PathBuf>],
    near: &[Vec<PathBuf>],
) {
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert!(
        tmp_dirs(root).is_empty(),
        "temporary directory left: {:?}",
        tmp_dirs(root)
    );
    assert_same("after the clean run", &user_sums(root), sums);
    assert_groups_shared("after the clean run", whole);
    for set in near {
        for n in &set[1..] {
            assert!(
                shared_bytes_between(&set[0], n) >= 6 * MIB - 64 * KIB,
                "near duplicate {} not shared",
                n.display()
            );
        }
    }
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_eq!(r.u("dedupe_ioctls"), 0, "a further run issued dedupe calls");
    assert!(
        r.u("files_known") > 0,
        "the catalog is not usable after the signalled runs"
    );
}

/// Signals are sent at least this long after the start: the process must
/// have reached `main` (before that, no program can handle a signal).
const MIN_DELAY: Duration = Duration::from_millis(50);

/// Runs onecopy on a fresh batch (batch 0) to learn how long a run with one
/// batch of new work takes.
fn calibrate(fs: &onecopy_testfs::LoopFs, kind: FsKind) -> Duration {
    let root = fs.path();
    signal_batch(root, 0);
    fs.sync();
    let t = Instant::now();
    dedupe(&[root], &[]).assert_ok();
    let span = t.elapsed();
    eprintln!("signals/{kind}: a run over one new batch takes {span:?}");
    span
}

/// SIGINT at random points of several runs, each with a fresh batch of
/// work: each interrupted run exits 130 with a report saying so and
/// removes its temporary directory; every file is unchanged; then a normal
/// run finishes the job and leaves nothing behind.
fn sigint_at_random_points(kind: FsKind) {
    let seed = seed("sigint_at_random_points");
    let mut rng = Prng::new(seed);
    let fs = new_fs(kind, 768 * MIB);
    let root = fs.path();
    let span = calibrate(&fs, kind);
    let (mut whole, mut near) = (Vec::new(), Vec::new());
    let mut interrupted = 0;
    let mut problems = Vec::new();
    let rounds = 5;
    for i in 1..=rounds {
        let (w, n) = signal_batch(root, i);
        whole.extend(w);
        near.push(n);
        // The last round starts while the new batch is still being written
        // back (onecopy's start-up syncfs takes a while then); the others
        // at a random point of a run over committed data.
        let delay = if i == rounds {
            MIN_DELAY
        } else {
            fs.sync();
            MIN_DELAY.max(span.mul_f64(rng.below(900) as f64 / 1000.0))
        };
        let sums = user_sums(root);
        let (child, what) = spawn_dedupe(&[root], &[]);
        std::thread::sleep(delay);
        send_signal(child.id(), libc::SIGINT);
        let out = wait_outcome(child, format!("{what} (SIGINT after {delay:?})"));
        eprintln!(
            "sigint/{kind}: after {delay:?}: exit {:?}, signal {:?}",
            out.code(),
            out.status.signal()
        );
        match out.code() {
            Some(EXIT_INTERRUPTED) => {
                out.assert_code(EXIT_INTERRUPTED);
                assert_eq!(
                    out.report()["interrupted"],
                    true,
                    "report not marked interrupted"
                );
                assert!(
                    tmp_dirs(root).is_empty(),
                    "an interrupted run left its temporary directory: {:?}",
                    tmp_dirs(root)
                );
                interrupted += 1;
            }
            Some(EXIT_OK) => out.assert_ok(), // finished before the signal
            None => problems.push(format!(
                "{}: ended by signal {:?} instead of exiting 130 with a report",
                out.what,
                out.status.signal()
            )),
            Some(c) => panic!(
                "{}: exit {c} after SIGINT; stderr {:?}",
                out.what, out.stderr
            ),
        }
        assert_same("after SIGINT", &user_sums(root), &sums);
    }
    let sums = user_sums(root);
    clean_run_after_signals(root, &sums, &whole, &near);
    assert!(problems.is_empty(), "SIGINT not handled: {problems:#?}");
    assert!(
        interrupted >= 2,
        "only {interrupted} of {rounds} runs were interrupted by SIGINT"
    );
}

/// SIGKILL at random points of several runs, each with a fresh batch of
/// work (and, on btrfs, once while a re-homing copy is open): every file
/// unchanged, no name left in the tree; the next normal run finishes the
/// job.
fn sigkill_at_random_points(kind: FsKind) {
    let seed = seed("sigkill_at_random_points");
    let mut rng = Prng::new(seed);
    // Up to 11 batches of about 85 MiB each before dedupe.
    let fs = new_fs(kind, 1200 * MIB);
    let root = fs.path();
    let span = calibrate(&fs, kind);
    let (mut whole, mut near) = (Vec::new(), Vec::new());
    let mut killed = 0;
    let mut killed_copying = false;
    let rounds = 5;
    // The last phase kills a run while it holds a re-homing copy; a run
    // that ends before it is seen doing so (a copy open for a few
    // milliseconds, on a loaded machine) is followed by another batch, up
    // to six times.
    for i in 1..=rounds + 6 {
        if i > rounds + 1 && (killed_copying || kind != FsKind::Btrfs) {
            break;
        }
        let (w, n) = signal_batch(root, i);
        whole.extend(w);
        near.push(n);
        fs.sync();
        let sums = user_sums(root);
        let (child, what) = spawn_dedupe(&[root], &[]);
        let delay = if i <= rounds {
            let d = MIN_DELAY.max(span.mul_f64(rng.below(900) as f64 / 1000.0));
            std::thread::sleep(d);
            d
        } else {
            // Kill as soon as this run holds a re-homing copy (btrfs
            // re-homing opens unnamed O_TMPFILE files; XFS never does:
            // killed at mid-run).
            // Generous on btrfs: the wait ends as soon as the copy is
            // open, and a loaded machine (CI) stretches the run.
            let limit = if kind == FsKind::Btrfs {
                (span * 4).max(Duration::from_secs(60))
            } else {
                span / 2
            };
            let t0 = Instant::now();
            let mut copying = false;
            while !copying && t0.elapsed() < limit && !exited(child.id()) {
                copying = holds_unnamed_file(child.id());
                std::thread::sleep(Duration::from_micros(200));
            }
            killed_copying |= copying;
            t0.elapsed()
        };
        send_signal(child.id(), libc::SIGKILL);
        let out = wait_outcome(child, format!("{what} (SIGKILL after {delay:?})"));
        eprintln!(
            "sigkill/{kind}: after {delay:?}: {:?}; temporary directories {:?}",
            out.status,
            tmp_dirs(root)
        );
        if out.code() == Some(EXIT_OK) {
            out.assert_ok();
        } else {
            assert_eq!(out.status.signal(), Some(libc::SIGKILL), "{}", out.what);
            killed += 1;
        }
        assert_same(
            "file contents changed after SIGKILL",
            &user_sums(root),
            &sums,
        );
    }
    assert!(killed >= 2, "only {killed} runs were killed");
    if kind == FsKind::Btrfs {
        assert!(
            killed_copying,
            "no run was seen holding a re-homing copy (6 tries)"
        );
    }
    if killed_copying {
        // Killed holding a copy: no name was ever made for it.
        assert!(
            tmp_dirs(root).is_empty(),
            "names left: {:?}",
            tmp_dirs(root)
        );
    }
    let sums = user_sums(root);
    clean_run_after_signals(root, &sums, &whole, &near);
}

// ---------------------------------------------------------------------------
// Convergence and the catalog
// ---------------------------------------------------------------------------

/// The deterministic form of what the concurrent writer found: two
/// identical files (a whole-file group) whose first MiB also exists in an
/// older file. The canonical copy of the group must not be moved onto the
/// older file's extents while its copy keeps the old ones: all three
/// converge, nothing is left to share, and later runs (trusting the
/// catalog) do not claim otherwise.
fn whole_copies_converge_with_block_runs(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let old = root.join("a").join("old.bin");
    put(&old, &random_bytes(2 * MIB as usize, 261));
    dedupe(&[root], &[]).assert_ok();
    let mut data = std::fs::read(&old).unwrap()[..MIB as usize].to_vec();
    data.extend_from_slice(&random_bytes(300_000, 262));
    let c1 = root.join("b").join("c1.bin");
    let c2 = root.join("c").join("c2.bin");
    put(&c1, &data);
    put(&c2, &data);
    let sums = checksum_tree(root);

    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_same("file contents changed", &checksum_tree(root), &sums);
    assert_eq!(
        physical_of(&c1, 0, MIB),
        physical_of(&old, 0, MIB),
        "the first MiB of c1.bin was not shared with old.bin"
    );
    assert!(
        same_physical(&c1, &c2),
        "c1.bin and c2.bin (identical) do not share their extents: c1 {:?}, c2 {:?}",
        physical_of(&c1, 0, data.len() as u64),
        physical_of(&c2, 0, data.len() as u64)
    );
    assert_nothing_left("after one run", root);
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_eq!(r.u("dedupe_ioctls"), 0, "second run issued dedupe calls");
}

/// Dry runs record what they read, but must not record files as
/// "settled": a real run afterwards still shares them.
fn catalog_dry_runs_settle_nothing(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let groups = dup_groups(&root.join("d"), 2, 2, 2 * MIB + 3, 271);
    for _ in 0..2 {
        let r = dedupe(&[root], &["--dry-run"]);
        r.assert_ok();
        assert!(r.u("bytes_would_share") > 0, "dry run found nothing");
    }
    assert_unshared("after dry runs", &flat(&groups));
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    assert_groups_shared("after dry runs and a real run", &groups);
    assert_nothing_left("after dry runs and a real run", root);
}

/// The `<catalog>.broken*` entries next to catalog `cat`.
fn set_aside(cat: &Path) -> Vec<PathBuf> {
    let name = cat.file_name().unwrap().as_bytes().to_vec();
    std::fs::read_dir(cat.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.as_bytes();
            n.starts_with(&name) && n.len() > name.len() && n[name.len()..].starts_with(b".broken")
        })
        .map(|e| e.path())
        .collect()
}

/// The catalog file of `root`'s filesystem, from a run's report.
fn catalog_of(r: &Outcome) -> PathBuf {
    let c = r.report()["catalogs"]
        .as_array()
        .and_then(|a| a.first())
        .and_then(|c| c.as_str())
        .unwrap_or_else(|| panic!("no catalog in the report: {}", r.stdout));
    PathBuf::from(c)
}

/// Damaged, truncated, foreign-version and unusable catalogs: every run
/// still exits 0 with a correct result (a damaged catalog is set aside and
/// rebuilt with a warning, never misread), and the next run finds a
/// usable catalog again.
fn damaged_catalogs(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path();
    let mut groups = dup_groups(&root.join("d"), 2, 2, MIB + 3, 281);
    past_racy_window();
    let r = dedupe(&[root], &[]);
    r.assert_ok();
    let cat = catalog_of(&r);
    assert!(cat.is_file(), "no catalog at {}", cat.display());
    let mut rng = Prng::new(282);
    let damages: [&str; 7] = [
        "truncated to half",
        "truncated to zero",
        "garbage",
        "bytes flipped",
        "foreign version",
        "newer version",
        "a directory",
    ];
    for (i, what) in damages.iter().enumerate() {
        // New work for this run, so that it has something to dedupe.
        groups.extend(dup_groups(
            &root.join(format!("n{i}")),
            1,
            2,
            MIB + 5,
            283 + i as u64,
        ));
        past_racy_window();
        for ext in ["-wal", "-shm"] {
            let mut p = cat.clone().into_os_string();
            p.push(ext);
            let _ = std::fs::remove_file(&p);
        }
        for b in set_aside(&cat) {
            if b.is_dir() {
                std::fs::remove_dir_all(&b).unwrap();
            } else {
                std::fs::remove_file(&b).unwrap();
            }
        }
        let mut bytes = std::fs::read(&cat).unwrap();
        match *what {
            "truncated to half" => bytes.truncate(bytes.len() / 2),
            "truncated to zero" => bytes.clear(),
            "garbage" => rng.fill(&mut bytes),
            "bytes flipped" => {
                for _ in 0..64 {
                    let at = 100 + rng.below(bytes.len() as u64 - 100) as usize;
                    bytes[at] ^= 1 << rng.below(8);
                }
            }
            // SQLite keeps `PRAGMA user_version` at offset 60, big-endian.
            "foreign version" => bytes[60..64].copy_from_slice(&0x4f43_4f50u32.to_be_bytes()),
            "newer version" => {
                let v = u32::from_be_bytes(bytes[60..64].try_into().unwrap());
                bytes[60..64].copy_from_slice(&(v + 1).to_be_bytes());
            }
            _ => {}
        }
        if *what == "a directory" {
            std::fs::remove_file(&cat).unwrap();
            std::fs::create_dir(&cat).unwrap();
        } else {
            std::fs::write(&cat, &bytes).unwrap();
        }
        let sums = checksum_tree(root);

        let r = dedupe(&[root], &[]);
        r.assert_ok();
        eprintln!("damaged_catalogs/{kind}: {what}: stderr {:?}", r.stderr);
        assert_same(what, &checksum_tree(root), &sums);
        assert_groups_shared(what, &groups);
        // An empty file is a valid empty SQLite database (nothing to
        // misread) and flipped bytes may land in unused space.
        if !["bytes flipped", "truncated to zero"].contains(what) {
            assert!(
                r.stderr.contains("catalog"),
                "{what}: no warning about the catalog: {:?}",
                r.stderr
            );
            assert!(
                !set_aside(&cat).is_empty(),
                "{what}: the damaged catalog was not set aside as .broken"
            );
        }
        if cat.is_dir() {
            // Not set aside: onecopy ran without a catalog.
            std::fs::remove_dir(&cat).unwrap();
            continue;
        }
        let r = dedupe(&[root], &[]);
        r.assert_ok();
        assert!(
            r.u("files_known") > 0,
            "{what}: the catalog is not usable after the run that met it"
        );
        assert_eq!(
            r.u("dedupe_ioctls"),
            0,
            "{what}: a further run issued dedupe calls"
        );
    }
    assert_nothing_left("after damaged catalogs", root);
}

/// The catalog's decoding under arbitrary bytes, in process: hundreds of
/// random mutations of a real catalog (bit flips, truncations, overwritten
/// ranges, copied pages, the header included) are opened and loaded the
/// way a run does. Never a panic, and never a misread: every record that
/// loads is one the original catalog holds. Digest blobs of any length
/// decode or are refused, never panic.
#[test]
fn catalog_decoding_fuzz() {
    use onecopy_catalog::{blob_to_digests, digests_to_blob, Catalog};
    let seed = seed("catalog_decoding_fuzz");
    let mut rng = Prng::new(seed);
    let fs = new_fs(FsKind::Btrfs, 256 * MIB);
    let root = fs.path();
    for i in 0..24u64 {
        let len = rng.range(4096, 600 * KIB);
        let p = root.join(format!("d{}", i % 4)).join(format!("f{i}"));
        mkparent(&p);
        write_random(&p, len, seed ^ i).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let orig = dir.path().join("orig.sqlite");
    let hashfile = format!("--hashfile={}", orig.display());
    past_racy_window();
    dedupe(&[root], &[&hashfile]).assert_ok();
    let records = Catalog::open_existing(&orig)
        .and_then(|c| c.load_all())
        .expect("load the fresh catalog");
    assert_eq!(records.len(), 24);
    let bytes = std::fs::read(&orig).unwrap();
    let (mut rebuilt, mut loaded) = (0, 0);
    for i in 0..300 {
        let mut b = bytes.clone();
        match rng.below(4) {
            0 => {
                for _ in 0..rng.range(1, 16) {
                    let at = rng.below(b.len() as u64) as usize;
                    b[at] ^= 1 << rng.below(8);
                }
            }
            1 => b.truncate(rng.below(b.len() as u64) as usize),
            2 => {
                let at = rng.below(b.len() as u64) as usize;
                let n = (rng.range(1, 4096) as usize).min(b.len() - at);
                rng.fill(&mut b[at..at + n]);
            }
            _ => {
                let pages = b.len() / 4096;
                let (from, to) = (
                    rng.below(pages as u64) as usize,
                    rng.below(pages as u64) as usize,
                );
                let page = b[from * 4096..(from + 1) * 4096].to_vec();
                b[to * 4096..(to + 1) * 4096].copy_from_slice(&page);
            }
        }
        let p = dir.path().join(format!("m{i}.sqlite"));
        std::fs::write(&p, &b).unwrap();
        match Catalog::open_or_rebuild(&p, 64 * KIB) {
            Ok((c, why)) => {
                rebuilt += why.is_some() as u32;
                let got = c
                    .load_all()
                    .expect("a catalog open_or_rebuild returned loads");
                loaded += got.len();
                for r in &got {
                    assert!(
                        records.contains(r),
                        "mutation {i}: a record that the original catalog does not hold: {r:?}"
                    );
                }
            }
            Err(e) => eprintln!("catalog_decoding_fuzz: mutation {i}: {e}"),
        }
    }
    eprintln!("catalog_decoding_fuzz: {rebuilt} of 300 rebuilt, {loaded} records loaded");
    for _ in 0..2000 {
        let n = rng.below(200) as usize;
        let mut b = vec![0u8; n];
        rng.fill(&mut b);
        if rng.below(2) == 0 && n > 1 {
            b[0] = 1; // the packed form's tag
        }
        let packed = n % 8 == 1 && n > 1 && b[0] == 1;
        match blob_to_digests(&b) {
            Some(v) => {
                assert!(n.is_multiple_of(16) || packed, "{n} bytes decoded");
                assert_eq!(v.len(), if packed { n / 8 } else { n / 16 });
                if packed {
                    assert_eq!(digests_to_blob(&v), b, "a packed blob round-trips");
                } else {
                    let back: Vec<u8> = v.iter().flat_map(|d| d.to_le_bytes()).collect();
                    assert_eq!(back, b);
                }
            }
            None => assert!(!n.is_multiple_of(16) && !packed, "{n} bytes refused"),
        }
    }
}
