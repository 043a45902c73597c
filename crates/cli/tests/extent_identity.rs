//! Issue 34: files whose bytes sit in the same extents (btrfs snapshots,
//! reflink copies, files an earlier run shared) are read once; the others
//! reuse that read's fingerprints. Real binary, loop-mounted btrfs and XFS
//! (reflink=1); the outcomes checked are the run's own byte counters
//! (`bytes_read`, `bytes_same_extents`), contents and FIEMAP sharing.
//!
//! Needs root (mkfs, loop devices, mount).

mod common;
#[path = "adversarial/support.rs"]
mod support;

use std::ffi::OsStr;
use std::path::PathBuf;

use onecopy_testfs::{checksum_tree, FsKind};
use support::*;

per_fs!(
    reflink_copies_are_read_once,
    a_second_run_reads_shared_files_once,
    space_kept_past_the_end_splits_no_copies
);

mod snapshots_are_read_once {
    #[test]
    fn btrfs() {
        super::snapshots_are_read_once()
    }
}

mod a_new_snapshot_costs_no_reads {
    #[test]
    fn btrfs() {
        super::a_new_snapshot_costs_no_reads()
    }
}

mod snapshots_are_listed_by_their_difference {
    #[test]
    fn btrfs() {
        super::snapshots_are_listed_by_their_difference()
    }
}

mod a_much_changed_snapshot_is_searched_whole {
    #[test]
    fn btrfs() {
        super::a_much_changed_snapshot_is_searched_whole()
    }
}

mod what_snapshots_pin_is_freed_with_them {
    #[test]
    fn btrfs() {
        super::what_snapshots_pin_is_freed_with_them()
    }
}
mod what_a_writable_snapshot_also_holds_is_not_pinned {
    #[test]
    fn btrfs() {
        super::what_a_writable_snapshot_also_holds_is_not_pinned()
    }
}

/// `e` (6 MiB), `r` a reflink copy of it, `f` a byte copy: `r` is not
/// read; all three end up sharing.
fn reflink_copies_are_read_once(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path().join("tree");
    let (e, r, f) = (root.join("e.bin"), root.join("r.bin"), root.join("f.bin"));
    mkparent(&e);
    onecopy_testfs::write_random(&e, 6 * MIB, 7).unwrap();
    onecopy_testfs::reflink_copy(&e, &r).unwrap();
    onecopy_testfs::copy_no_reflink(&e, &f).unwrap();
    settle(&fs);
    let sums = checksum_tree(&root);
    let out = dedupe(&[&root], &["--no-catalog"]);
    out.assert_ok();
    assert_eq!(
        out.u("bytes_read"),
        12 * MIB,
        "e (or r) and f read, once each"
    );
    assert_eq!(out.u("files_read"), 2);
    assert_eq!(out.u("files_same_extents"), 1);
    assert_eq!(out.u("bytes_same_extents"), 6 * MIB);
    assert_eq!(checksum_tree(&root), sums, "contents changed");
    assert!(
        same_physical(&e, &r) && same_physical(&e, &f),
        "not all shared"
    );
}

/// After a run has shared a byte copy, a run without the catalog reads
/// the shared bytes once.
fn a_second_run_reads_shared_files_once(kind: FsKind) {
    second_run_reads_copies_once(kind, false)
}

/// The same with space kept past the end of one copy (`fallocate
/// --keep-size`; XFS's speculative preallocation leaves the same behind):
/// that space is never read, so the copy still keys with the others.
fn space_kept_past_the_end_splits_no_copies(kind: FsKind) {
    second_run_reads_copies_once(kind, true)
}

fn second_run_reads_copies_once(kind: FsKind, kept_past_end: bool) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path().join("tree");
    let files: Vec<PathBuf> = (0..4).map(|i| root.join(format!("c{i}.bin"))).collect();
    mkparent(&files[0]);
    onecopy_testfs::write_random(&files[0], 4 * MIB, 8).unwrap();
    for f in &files[1..] {
        onecopy_testfs::copy_no_reflink(&files[0], f).unwrap();
    }
    if kept_past_end {
        let past = (4 * MIB).to_string();
        let c0 = files[0].to_str().unwrap();
        run("fallocate", &["--keep-size", "-o", &past, "-l", &past, c0]);
    }
    settle(&fs);
    let sums = checksum_tree(&root);
    let first = dedupe(&[&root], &["--no-catalog"]);
    first.assert_ok();
    assert_eq!(first.u("bytes_read"), 16 * MIB, "byte copies are all read");
    assert_eq!(first.u("files_same_extents"), 0);
    assert_eq!(first.u("bytes_deduped"), 12 * MIB, "{}", first.stdout);
    fs.sync();
    let second = dedupe(&[&root], &["--no-catalog"]);
    second.assert_ok();
    let said = &second.stdout;
    assert_eq!(second.u("bytes_read"), 4 * MIB, "read once: {said}");
    assert_eq!(second.u("files_same_extents"), 3, "{said}");
    assert_eq!(second.u("bytes_deduped"), 0, "nothing left: {said}");
    assert_eq!(checksum_tree(&root), sums, "contents changed");
}

/// A subvolume with a byte copy and a reflink copy, then three read-only
/// snapshots of it: the data on disk is read once, whatever the number of
/// snapshots; the live copies are shared; no content changes.
fn snapshots_are_read_once() {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let vol = fs.path().join("vol");
    btrfs(&["subvolume", "create"], &[&vol]);
    let (d, a, e, r) = (
        vol.join("d.bin"),
        vol.join("z/a.bin"),
        vol.join("e.bin"),
        vol.join("z/r.bin"),
    );
    mkparent(&a);
    onecopy_testfs::write_random(&d, 8 * MIB, 101).unwrap();
    onecopy_testfs::copy_no_reflink(&d, &a).unwrap();
    onecopy_testfs::write_random(&e, 6 * MIB, 102).unwrap();
    onecopy_testfs::reflink_copy(&e, &r).unwrap();
    fs.sync();
    for i in 0..3 {
        let snap = fs.path().join(format!("snap{i}"));
        btrfs(&["subvolume", "snapshot", "-r"], &[&vol, &snap]);
    }
    settle(&fs);
    let sums = checksum_tree(fs.path());
    let out = dedupe(&[fs.path()], &["--no-catalog"]);
    out.assert_ok();
    // On disk: d, a and e (r and every snapshot copy are the same extents).
    assert_eq!(out.u("bytes_read"), 22 * MIB, "each extent read once");
    assert_eq!(out.u("files_read"), 3);
    // r; the snapshots' files are not even listed: unchanged since.
    assert_eq!(out.u("files_same_extents"), 1);
    assert_eq!(out.u("bytes_same_extents"), 6 * MIB);
    let diff = &out.report()["snapshots_by_difference"];
    assert_eq!(diff["snapshots"], 3, "{diff}");
    assert_eq!(diff["files_as_parent"], 3 * 4, "{diff}");
    assert_eq!(diff["bytes_as_parent"], 3 * 28 * MIB, "{diff}");
    assert_eq!(checksum_tree(fs.path()), sums, "contents changed");
    assert!(same_physical(&d, &a), "the live byte copy was not shared");
}

/// Read-only snapshots of a walked subvolume are listed by difference:
/// their files unchanged since are not looked at, the others are (an old
/// version, a file kept only in a snapshot), so a live file equal to a
/// file deleted since the snapshot is shared with the snapshot's copy. A
/// writable snapshot is walked. Without the privilege to search the trees
/// (as nobody), the snapshots are walked instead.
fn snapshots_are_listed_by_their_difference() {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let vol = fs.path().join("vol");
    btrfs(&["subvolume", "create"], &[&vol]);
    let (keep, chg, del) = (
        vol.join("keep.bin"),
        vol.join("z/chg.bin"),
        vol.join("del.bin"),
    );
    mkparent(&chg);
    onecopy_testfs::write_random(&keep, 4 * MIB, 401).unwrap();
    onecopy_testfs::write_random(&chg, 4 * MIB, 402).unwrap();
    onecopy_testfs::write_random(&del, 5 * MIB, 403).unwrap();
    // Files that stay as they are: the changes below are few against
    // them, so the snapshots are compared by the changes alone.
    let pad = pad_files(&vol, 16, 410);
    // Read once now: under relatime a first read after a write rewrites
    // the inode item (atime), which would count as a change since s0.
    checksum_tree(&vol);
    fs.sync();
    let s0 = fs.path().join("snaps/s0");
    mkparent(&s0);
    btrfs(&["subvolume", "snapshot", "-r"], &[&vol, &s0]);
    // After s0: chg rewritten, del deleted; then s1 and w; then del's
    // bytes back as a new file, held by nothing else.
    onecopy_testfs::write_random(&chg, 4 * MIB, 404).unwrap();
    std::fs::remove_file(&del).unwrap();
    fs.sync();
    let s1 = fs.path().join("snaps/s1");
    btrfs(&["subvolume", "snapshot", "-r"], &[&vol, &s1]);
    btrfs(&["subvolume", "snapshot"], &[&vol, &fs.path().join("w")]);
    let again = vol.join("again.bin");
    onecopy_testfs::copy_no_reflink(&s0.join("del.bin"), &again).unwrap();
    settle(&fs);
    let sums = checksum_tree(fs.path());
    let nobody = dedupe_as_nobody(&[fs.path()], &["--no-catalog", "--dry-run"]);
    nobody.assert_ok();
    let d = &nobody.report()["snapshots_by_difference"];
    assert_eq!(d["snapshots"], 0, "nobody cannot search the trees: {d}");
    let n = pad.len() as u64;
    assert_eq!(
        nobody.u("files_scanned"),
        3 + 2 + 3 + 2 + 4 * n,
        "every file walked"
    );
    let out = dedupe(&[fs.path()], &["--no-catalog"]);
    out.assert_ok();
    let d = &out.report()["snapshots_by_difference"];
    assert_eq!(d["snapshots"], 2, "{d}");
    // s0: keep; s1: keep, chg; and the pad files in both.
    assert_eq!(d["files_as_parent"], 3 + 2 * n, "{d}");
    assert_eq!(d["bytes_as_parent"], 12 * MIB + 2 * n * PAD, "{d}");
    // vol's 3, w's 2, s0's old chg and del; the pad files in vol and w.
    assert_eq!(out.u("files_scanned"), 7 + 2 * n);
    // keep, chg old and new, del and again, the pad files: each extent
    // once.
    assert_eq!(out.u("bytes_read"), 22 * MIB + n * PAD);
    assert_eq!(checksum_tree(fs.path()), sums, "contents changed");
    assert!(
        same_physical(&again, &s0.join("del.bin")),
        "the live copy of a file kept only in s0 was not shared with it: {}",
        out.stdout
    );
    assert_eq!(out.u("bytes_freed"), 5 * MIB, "again's own extent");
}

const PAD: u64 = 8192;

/// `n` files of 8 KiB (each its own data) in `dir/pad`.
fn pad_files(dir: &std::path::Path, n: u64, seed: u64) -> Vec<PathBuf> {
    let files: Vec<PathBuf> = (0..n).map(|i| dir.join(format!("pad/p{i}"))).collect();
    mkparent(&files[0]);
    for (i, f) in files.iter().enumerate() {
        onecopy_testfs::write_random(f, PAD, seed + i as u64).unwrap();
    }
    files
}

/// A read-only snapshot whose subvolume changed much since (most files'
/// ctime moved, one deleted) is compared with the subvolume through its
/// whole tree: the files changed since and the one kept only in the
/// snapshot are listed, the unchanged one is not.
fn a_much_changed_snapshot_is_searched_whole() {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let vol = fs.path().join("vol");
    btrfs(&["subvolume", "create"], &[&vol]);
    let keep = vol.join("keep.bin");
    onecopy_testfs::write_random(&keep, 4 * MIB, 501).unwrap();
    let pad = pad_files(&vol, 16, 510);
    fs.sync();
    let s0 = fs.path().join("s0");
    btrfs(&["subvolume", "snapshot", "-r"], &[&vol, &s0]);
    for f in &pad[1..] {
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o600);
        std::fs::set_permissions(f, mode).unwrap();
    }
    std::fs::remove_file(&pad[0]).unwrap();
    settle(&fs);
    let sums = checksum_tree(fs.path());
    let out = dedupe(&[fs.path()], &["--no-catalog", "--dry-run"]);
    out.assert_ok();
    let d = &out.report()["snapshots_by_difference"];
    assert_eq!(d["snapshots"], 1, "{d}");
    assert_eq!(d["files_as_parent"], 1, "keep only: {d}");
    assert_eq!(d["bytes_as_parent"], 4 * MIB, "{d}");
    // vol: keep and 15 pad files; s0: the 15 changed and the deleted one.
    assert_eq!(out.u("files_scanned"), 1 + 15 + 16);
    let same = out.u("files_same_extents");
    assert_eq!(same, 15, "s0's copies of the changed ones");
    assert_eq!(checksum_tree(fs.path()), sums, "contents changed");
}

/// With a catalog: after a run over a subvolume and two read-only
/// snapshots, a third snapshot is taken; the next run reads nothing (its
/// files are laid out as the known files they were taken of), and a file
/// changed in the live subvolume is read.
fn a_new_snapshot_costs_no_reads() {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let cat = tempfile::tempdir().unwrap();
    let hashfile = cat.path().join("catalog.db");
    let hashfile = hashfile.to_str().unwrap();
    let vol = fs.path().join("vol");
    btrfs(&["subvolume", "create"], &[&vol]);
    let (d, a, e) = (vol.join("d.bin"), vol.join("a.bin"), vol.join("e.bin"));
    onecopy_testfs::write_random(&d, 8 * MIB, 301).unwrap();
    onecopy_testfs::copy_no_reflink(&d, &a).unwrap();
    onecopy_testfs::write_random(&e, 6 * MIB, 302).unwrap();
    fs.sync();
    for i in 0..2 {
        let snap = fs.path().join(format!("s{i}"));
        btrfs(&["subvolume", "snapshot", "-r"], &[&vol, &snap]);
    }
    settle(&fs);
    let first = dedupe(&[fs.path()], &["--hashfile", hashfile]);
    first.assert_ok();
    assert_eq!(first.u("bytes_read"), 22 * MIB, "each extent read once");
    assert!(same_physical(&d, &a));
    btrfs(
        &["subvolume", "snapshot", "-r"],
        &[&vol, &fs.path().join("s2")],
    );
    let f = vol.join("f.bin");
    onecopy_testfs::write_random(&f, 2 * MIB, 303).unwrap();
    settle(&fs);
    let sums = checksum_tree(fs.path());
    let second = dedupe(&[fs.path()], &["--hashfile", hashfile]);
    second.assert_ok();
    assert_eq!(
        second.u("bytes_read"),
        2 * MIB,
        "only the new live file is read"
    );
    // The three snapshots' files are the live ones, not even listed (a
    // was deduped in the first run: the same bytes in other extents).
    let diff = &second.report()["snapshots_by_difference"];
    assert_eq!(diff["snapshots"], 3, "{diff}");
    assert_eq!(diff["files_as_parent"], 3 * 3, "{diff}");
    assert_eq!(diff["bytes_as_parent"], 3 * 22 * MIB, "{diff}");
    assert_eq!(checksum_tree(fs.path()), sums, "contents changed");
}

/// Two byte copies in a subvolume with three read-only snapshots: sharing
/// them frees nothing now; the report names the snapshots that hold the
/// copies' old extents and their size, and deleting those snapshots frees
/// that much data (within 2%).
fn what_snapshots_pin_is_freed_with_them() {
    let (fs, vol, snaps) = two_pairs_and_three_snapshots(201);
    let (d, a) = (vol.join("d.bin"), vol.join("a.bin"));
    let (e, e2) = (vol.join("e.bin"), vol.join("e2.bin"));
    settle(&fs);
    let sums = checksum_tree(fs.path());
    let out = dedupe(&[fs.path()], &["--no-catalog"]);
    out.assert_ok();
    assert_eq!(checksum_tree(fs.path()), sums, "contents changed");
    assert!(
        same_physical(&d, &a) && same_physical(&e, &e2),
        "not shared"
    );
    assert_eq!(out.u("bytes_freed"), 0, "the snapshots hold every extent");
    let pinned = out.u("bytes_pinned_by_snapshots");
    assert_eq!(pinned, 14 * MIB, "the old extents of one copy of each");
    let ids = out.report()["pinning_snapshots"].as_array().unwrap().len();
    assert_eq!(ids, 3, "all three snapshots hold them");
    assert_deleting_frees(&fs, &snaps, pinned);
}

/// Subvolume `vol` holding two pairs of byte copies (d.bin and a.bin,
/// 8 MiB; e.bin and e2.bin, 6 MiB; random from `seed`), and three
/// read-only snapshots of it, s0-s2.
fn two_pairs_and_three_snapshots(seed: u64) -> (onecopy_testfs::LoopFs, PathBuf, Vec<PathBuf>) {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let vol = fs.path().join("vol");
    btrfs(&["subvolume", "create"], &[&vol]);
    let (d, e) = (vol.join("d.bin"), vol.join("e.bin"));
    onecopy_testfs::write_random(&d, 8 * MIB, seed).unwrap();
    onecopy_testfs::copy_no_reflink(&d, &vol.join("a.bin")).unwrap();
    onecopy_testfs::write_random(&e, 6 * MIB, seed + 1).unwrap();
    onecopy_testfs::copy_no_reflink(&e, &vol.join("e2.bin")).unwrap();
    fs.sync();
    let snaps: Vec<PathBuf> = (0..3).map(|i| fs.path().join(format!("s{i}"))).collect();
    for s in &snaps {
        btrfs(&["subvolume", "snapshot", "-r"], &[&vol, s]);
    }
    (fs, vol, snaps)
}

/// Deleting `snaps` frees `pinned` bytes of data, within 2%.
#[track_caller]
fn assert_deleting_frees(fs: &onecopy_testfs::LoopFs, snaps: &[PathBuf], pinned: u64) {
    let before = data_used(fs);
    btrfs(
        &["subvolume", "delete"],
        &snaps.iter().map(|p| p.as_path()).collect::<Vec<_>>(),
    );
    // A commit wakes the cleaner, which drops the deleted trees; sync
    // waits for it.
    fs.sync();
    btrfs(&["subvolume", "sync"], &[fs.path()]);
    let freed = before - data_used(fs);
    let off = (freed as f64 - pinned as f64).abs() / pinned as f64;
    assert!(
        off <= 0.02,
        "deleting the snapshots freed {freed} bytes, {pinned} predicted"
    );
}

/// As above, with a writable snapshot outside the run that keeps one of
/// the two pairs (the other pair deleted from it): what it holds is not
/// counted as pinned by the read-only snapshots, and deleting those frees
/// exactly the rest (the owners of old extents are asked once per set of
/// tree leaves holding them; this one tells two such sets apart).
fn what_a_writable_snapshot_also_holds_is_not_pinned() {
    let (fs, vol, snaps) = two_pairs_and_three_snapshots(211);
    let (d, a) = (vol.join("d.bin"), vol.join("a.bin"));
    let (e, e2) = (vol.join("e.bin"), vol.join("e2.bin"));
    let w = fs.path().join("w");
    btrfs(&["subvolume", "snapshot"], &[&vol, &w]);
    std::fs::remove_file(w.join("d.bin")).unwrap();
    std::fs::remove_file(w.join("a.bin")).unwrap();
    settle(&fs);
    let sums = checksum_tree(fs.path());
    let mut roots = vec![vol.clone()];
    roots.extend(snaps.iter().cloned());
    let out = dedupe(&roots, &["--no-catalog"]);
    out.assert_ok();
    assert_eq!(checksum_tree(fs.path()), sums, "contents changed");
    assert!(
        same_physical(&d, &a) && same_physical(&e, &e2),
        "not shared"
    );
    let pinned = out.u("bytes_pinned_by_snapshots");
    assert_eq!(
        pinned,
        8 * MIB,
        "the old extent of d or a; w holds e's and e2's"
    );
    assert_deleting_frees(&fs, &snaps, pinned);
}

/// Data bytes in use (`btrfs filesystem df`: data chunks only, no
/// metadata), after a sync.
fn data_used(fs: &onecopy_testfs::LoopFs) -> u64 {
    fs.sync();
    let out = run(
        "btrfs",
        &[
            OsStr::new("filesystem"),
            OsStr::new("df"),
            OsStr::new("-b"),
            fs.path().as_os_str(),
        ],
    );
    let line = out
        .lines()
        .find(|l| l.starts_with("Data,"))
        .expect("a Data line");
    let used = line.split("used=").nth(1).expect("used=");
    used.trim().parse().expect("used bytes")
}

/// Synced, and older than the racy margin (1 s): a file changed within a
/// second of a read neither lends its fingerprints nor borrows them.
fn settle(fs: &onecopy_testfs::LoopFs) {
    fs.sync();
    std::thread::sleep(std::time::Duration::from_millis(1500));
}
