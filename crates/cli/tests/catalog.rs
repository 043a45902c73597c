//! Issue 4, proven on real filesystems: the persistent catalog and
//! incremental runs. Every case runs `onecopy dedupe --json -v --hashfile H
//! ROOT` as a binary on loop-mounted btrfs and XFS (reflink=1) images and
//! asserts, from the report's `read_paths`, `files_read` and `files_known`,
//! exactly which files were read, and that the dedupe result is right:
//! every file's checksum, and extent sharing through FIEMAP.
//!
//! The catalog file `H` lives in a temporary directory outside the
//! filesystem under test, so the tests can inspect (`onecopy catalog stats`)
//! and damage it.
//!
//! Needs root (mkfs, loop devices, mount).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs::{FileTimes, Metadata, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use onecopy_testfs::{
    checksum_tree, copy_no_reflink, extents, is_fully_shared, physical_ranges, random_bytes,
    shared_bytes_between, shared_flag_bytes, write_random, FsKind, LoopFs, Prng,
};
use serde_json::Value;

const FS_SIZE: u64 = 512 * MIB;

per_fs!(
    warm_rerun,
    rename_and_move,
    content_changed_mtime_restored,
    content_changed_mtime_restored_then_renamed,
    truncate_and_rewrite,
    delete,
    hardlink_added,
    new_copy_of_old_file,
    block_runs_against_known_files,
    outside_roots,
    damage_foreign,
    damage_truncated,
    damage_version,
    damage_record,
    damage_meta_index,
    damage_runs_type,
    damage_random_flips,
    sigkill,
);

/// Two originals with byte copies, and three unique files: 8 files.
const SPECS: &[(&str, u64, u64, usize)] = &[
    ("orig/a/x.bin", MIB + 123, 21, 2),
    ("orig/b/y.bin", 2 * MIB + 4097, 22, 1),
];

/// A fresh filesystem and a catalog file outside it.
struct Scene {
    root: PathBuf,
    h: PathBuf,
    _dir: tempfile::TempDir,
    // Dropped last: unmounts.
    fs: LoopFs,
}

impl Scene {
    fn new(kind: FsKind) -> Scene {
        let fs = new_fs(kind, FS_SIZE);
        // Paths in the report are absolute and symlink-free.
        let root = std::fs::canonicalize(fs.path()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let h = std::fs::canonicalize(dir.path())
            .unwrap()
            .join("cat.sqlite");
        Scene {
            root,
            h,
            _dir: dir,
            fs,
        }
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn rel(&self, p: &Path) -> PathBuf {
        p.strip_prefix(&self.root).unwrap().to_path_buf()
    }

    /// `onecopy dedupe --json -v --hashfile H ROOTS...`; never a panic.
    fn run(&self, ctx: &str, roots: &[&Path]) -> Run {
        self.run_with(ctx, &[], roots)
    }

    /// [`Scene::run`] with `extra` arguments before the roots.
    fn run_with(&self, ctx: &str, extra: &[&str], roots: &[&Path]) -> Run {
        let mut args: Vec<&OsStr> = vec![
            "dedupe".as_ref(),
            "--json".as_ref(),
            "-v".as_ref(),
            "--hashfile".as_ref(),
            self.h.as_os_str(),
        ];
        args.extend(extra.iter().map(OsStr::new));
        args.extend(roots.iter().map(|p| p.as_os_str()));
        let r = onecopy(args);
        assert_no_panic(ctx, &r);
        r
    }

    /// A run over the whole filesystem.
    fn run_root(&self, ctx: &str) -> Run {
        self.run(ctx, &[&self.root])
    }

    /// `onecopy catalog stats --json --hashfile H`, the one catalog's object.
    fn stats(&self) -> Value {
        let r = onecopy([
            OsStr::new("catalog"),
            OsStr::new("stats"),
            OsStr::new("--json"),
            OsStr::new("--hashfile"),
            self.h.as_os_str(),
        ]);
        assert_no_panic("catalog stats", &r);
        assert_eq!(r.code, 0, "catalog stats failed: {:?}", r.stderr);
        let all = r.report().as_array().expect("stats --json is an array");
        assert_eq!(all.len(), 1, "stats of one --hashfile: {all:?}");
        all[0].clone()
    }

    /// Records in the catalog.
    fn catalog_files(&self) -> u64 {
        let s = self.stats();
        s["files"]
            .as_u64()
            .unwrap_or_else(|| panic!("catalog stats has no files count: {s}"))
    }

    /// `H` with a suffix (`.broken`, `-wal`).
    fn h_with(&self, suffix: &str) -> PathBuf {
        let mut p = self.h.as_os_str().to_owned();
        p.push(suffix);
        PathBuf::from(p)
    }
}

#[track_caller]
fn assert_no_panic(ctx: &str, r: &Run) {
    assert!(
        !r.stderr.contains("panicked") && r.code != 101,
        "{ctx}: onecopy panicked (exit {}): {}",
        r.code,
        r.stderr
    );
}

/// `read_paths` of a `-v` report, as a set (its entries must be distinct).
fn read_paths(r: &Run) -> BTreeSet<PathBuf> {
    let v = r.report()["read_paths"]
        .as_array()
        .unwrap_or_else(|| panic!("no read_paths in a --verbose report: {}", r.stdout));
    let set: BTreeSet<PathBuf> = v
        .iter()
        .map(|p| PathBuf::from(p.as_str().expect("read_paths holds strings")))
        .collect();
    assert_eq!(set.len(), v.len(), "read_paths lists a file twice: {v:?}");
    set
}

/// Exactly `want` were fingerprinted (read, or from the same extents as a
/// file read): `read_paths` and the counts agree with it.
#[track_caller]
fn assert_read(ctx: &str, r: &Run, want: &[&Path]) {
    let want: BTreeSet<PathBuf> = want.iter().map(|p| p.to_path_buf()).collect();
    let got = read_paths(r);
    let extra: Vec<_> = got.difference(&want).collect();
    let missing: Vec<_> = want.difference(&got).collect();
    assert!(
        extra.is_empty() && missing.is_empty(),
        "{ctx}: wrong files read; read but should not have been: {extra:?}; \
         not read but should have been: {missing:?}"
    );
    let fresh = r.u("files_read") + r.u("files_same_extents");
    assert_eq!(
        fresh,
        want.len() as u64,
        "{ctx}: files_read + files_same_extents"
    );
}

fn rebuilt(r: &Run) -> bool {
    r.report()["catalog_rebuilt"]
        .as_bool()
        .expect("catalog_rebuilt is a boolean")
}

/// The report names `H` as its only catalog.
#[track_caller]
fn assert_catalog(ctx: &str, r: &Run, h: &Path) {
    let cats: Vec<&str> = r.report()["catalogs"]
        .as_array()
        .expect("catalogs is an array")
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(cats, vec![h.to_str().unwrap()], "{ctx}: catalogs used");
}

/// A warm run over an unchanged tree of `n` files: nothing read, nothing
/// deduped, everything known.
#[track_caller]
fn assert_warm(ctx: &str, r: &Run, n: u64) {
    r.assert_ok(ctx);
    assert_read(ctx, r, &[]);
    assert_eq!(r.u("files_known"), n, "{ctx}: files_known");
    assert_eq!(r.u("files_renamed"), 0, "{ctx}: files_renamed");
    assert_eq!(r.u("dedupe_ioctls"), 0, "{ctx}: dedupe_ioctls");
    assert_eq!(r.u("bytes_deduped"), 0, "{ctx}: bytes_deduped");
    assert!(!rebuilt(r), "{ctx}: catalog_rebuilt on a warm run");
}

/// Every range the run skipped for a reason that means "the data it
/// planned with was stale".
#[track_caller]
fn assert_no_stale_skips(ctx: &str, r: &Run) {
    let m = &r.report()["ranges_skipped"];
    for reason in ["data_differs", "changed", "refused"] {
        assert_eq!(
            m.get(reason).and_then(Value::as_u64).unwrap_or(0),
            0,
            "{ctx}: ranges_skipped.{reason} (planned from stale digests?): {m}"
        );
    }
}

/// Checksums of every regular file under `root` (relative paths), leaving
/// out onecopy's own temporary directories.
fn tree_sums(root: &Path) -> BTreeMap<PathBuf, u128> {
    checksum_tree(root)
        .into_iter()
        .filter(|(p, _)| {
            !p.components()
                .any(|c| c.as_os_str().to_string_lossy().starts_with(".onecopy-tmp"))
        })
        .collect()
}

#[track_caller]
fn assert_shared(ctx: &str, a: &Path, b: &Path) {
    assert!(
        is_fully_shared(a, b) && is_fully_shared(b, a),
        "{ctx}: {} is not fully shared with {} ({} of {} bytes shared); extents of the first: {:?}; of the second: {:?}",
        b.display(),
        a.display(),
        shared_bytes_between(a, b),
        std::fs::metadata(b).unwrap().len(),
        extents(b),
        extents(a),
    );
}

#[track_caller]
fn assert_sets_shared(ctx: &str, sets: &[DupSet]) {
    for s in sets {
        for c in &s.copies {
            assert_shared(ctx, &s.original, c);
        }
    }
}

fn all_files(sets: &[DupSet], more: &[PathBuf]) -> Vec<PathBuf> {
    sets.iter()
        .flat_map(|s| std::iter::once(s.original.clone()).chain(s.copies.iter().cloned()))
        .chain(more.iter().cloned())
        .collect()
}

fn refs(v: &[PathBuf]) -> Vec<&Path> {
    v.iter().map(PathBuf::as_path).collect()
}

fn mtime_ns(m: &Metadata) -> i64 {
    m.mtime() * 1_000_000_000 + m.mtime_nsec()
}

fn ctime_ns(m: &Metadata) -> i64 {
    m.ctime() * 1_000_000_000 + m.ctime_nsec()
}

/// `touch -r`: gives `path` the access and modification times of `m`, and
/// checks that it took (to the nanosecond).
fn restore_times(path: &Path, m: &Metadata) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.set_times(
        FileTimes::new()
            .set_accessed(m.accessed().unwrap())
            .set_modified(m.modified().unwrap()),
    )
    .unwrap();
    drop(f);
    let now = std::fs::metadata(path).unwrap();
    assert_eq!(
        mtime_ns(&now),
        mtime_ns(m),
        "{}: mtime not restored",
        path.display()
    );
}

/// Rewrites `data` at `offset` of `path` in place (pwrite, no truncation,
/// so the size is unchanged), then puts the old mtime back. Checks the
/// preconditions that make this the hard case: same size, same mtime, only
/// the ctime differs.
fn pwrite_keep_mtime(path: &Path, offset: u64, data: &[u8]) {
    let before = std::fs::metadata(path).unwrap();
    assert!(offset + data.len() as u64 <= before.len());
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, offset).unwrap();
    f.sync_all().unwrap();
    drop(f);
    restore_times(path, &before);
    let after = std::fs::metadata(path).unwrap();
    assert_eq!(
        after.len(),
        before.len(),
        "{}: size changed",
        path.display()
    );
    assert_eq!(after.ino(), before.ino());
    assert_ne!(
        ctime_ns(&after),
        ctime_ns(&before),
        "{}: the kernel did not change ctime",
        path.display()
    );
}

/// Truncates `path` to zero and writes `data` (a different size), then puts
/// the old mtime back.
fn truncate_rewrite_keep_mtime(path: &Path, data: &[u8]) {
    let before = std::fs::metadata(path).unwrap();
    assert_ne!(before.len(), data.len() as u64);
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(0).unwrap();
    f.write_all_at(data, 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    restore_times(path, &before);
    assert_eq!(std::fs::metadata(path).unwrap().ino(), before.ino());
}

fn move_to(from: &Path, to: &Path) {
    mkparent(to);
    std::fs::rename(from, to)
        .unwrap_or_else(|e| panic!("rename {} -> {}: {e}", from.display(), to.display()));
}

/// Moves the key `from` of a checksum map to `to` (after a rename).
fn rekey(sums: &mut BTreeMap<PathBuf, u128>, from: PathBuf, to: PathBuf) {
    let v = sums
        .remove(&from)
        .unwrap_or_else(|| panic!("{} not in the checksums", from.display()));
    sums.insert(to, v);
}

/// onecopy's racy-clean margin (`RACY_MARGIN_NS` in `onecopy-scan`): a
/// file modified (mtime or ctime) less than this before it is read is read
/// but never remembered, since a write racing the read may not show in the
/// timestamps.
const RACY_MARGIN: Duration = Duration::from_secs(1);

/// Waits until every file written so far is older than [`RACY_MARGIN`].
/// Called after every change to the tree, before the run that should
/// remember it.
fn settle() {
    std::thread::sleep(RACY_MARGIN + Duration::from_millis(150));
}

/// A run-to-run seed: `$ONECOPY_TEST_SEED`, else the clock (printed, so a
/// failure can be replayed).
fn test_seed(what: &str) -> u64 {
    onecopy_testfs::seed::replayable("ONECOPY_TEST_SEED", what)
}

fn kind_tag(kind: FsKind) -> u64 {
    match kind {
        FsKind::Btrfs => 1,
        FsKind::Xfs => 2,
        _ => 3,
    }
}

/// Case 1: a warm rerun of an unchanged tree reads nothing, issues no
/// ioctl, and trusts the settled duplicates from the catalog.
fn warm_rerun(kind: FsKind) {
    let s = Scene::new(kind);
    let sets = make_dupes(&s.root, SPECS);
    let uniques = make_uniques(&s.root);
    let all = all_files(&sets, &uniques);
    let n = all.len() as u64;
    settle();
    let sums = tree_sums(&s.root);

    let r = s.run_root("cold run");
    r.assert_ok("cold run");
    assert_read("cold run", &r, &refs(&all));
    assert_eq!(r.u("files_known"), 0, "cold run: files_known");
    assert!(!rebuilt(&r), "cold run: a new catalog is not a rebuilt one");
    assert_catalog("cold run", &r, &s.h);
    assert!(r.u("dedupe_ioctls") > 0, "cold run deduped nothing");
    assert_sets_shared("cold run", &sets);
    assert_eq!(tree_sums(&s.root), sums, "cold run changed file contents");
    assert_eq!(s.catalog_files(), n, "catalog records after the cold run");

    for i in 1..=2 {
        let ctx = format!("warm run {i}");
        // Every settled file trusted (none picked to look at again).
        let r = s.run_with(&ctx, &["--recheck-every", "0"], &[&s.root]);
        assert_warm(&ctx, &r, n);
        assert_catalog(&ctx, &r, &s.h);
        assert!(
            r.u("ranges_settled") > 0,
            "{ctx}: duplicates exist but no range was trusted as settled"
        );
        assert_eq!(r.u("bytes_freed"), 0, "{ctx}: bytes_freed");
        assert_eq!(tree_sums(&s.root), sums, "{ctx}: file contents changed");
        assert_sets_shared(&ctx, &sets);
        assert_eq!(s.catalog_files(), n, "{ctx}: catalog records");
    }
}

/// Case 1b (btrfs): a pair an earlier run shared and settled, unshared
/// since by a defragment, which leaves mtime and ctime as they were, is
/// trusted while no run looks at it again, and shared again by the first
/// run that does (each run looks at about one settled file in 8;
/// `--recheck-every 1`: every one). It was trusted for ever.
#[test]
fn a_defragmented_pair_is_shared_again_btrfs() {
    let s = Scene::new(FsKind::Btrfs);
    let sets = make_dupes(&s.root, SPECS);
    settle();
    s.run_root("cold run").assert_ok("cold run");
    assert_sets_shared("cold run", &sets);
    let copy = &sets[0].copies[0];
    let out = std::process::Command::new("btrfs")
        .args(["filesystem", "defragment", "-f", "-czstd"])
        .arg(copy)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    s.fs.sync();
    let unshared = || !is_fully_shared(&sets[0].original, copy);
    assert!(unshared(), "the defragment unshared nothing");
    let r = s.run_with("trusted", &["--recheck-every", "0"], &[&s.root]);
    assert_warm("trusted", &r, s.catalog_files());
    assert!(unshared(), "trusted, still unshared");
    let r = s.run_with("looked at", &["--recheck-every", "1"], &[&s.root]);
    r.assert_ok("looked at");
    assert_eq!(r.u("ranges_settled"), 0, "every file looked at");
    assert!(r.u("dedupe_ioctls") > 0, "nothing shared again");
    assert_sets_shared("looked at", &sets);
}

/// Case 2: renamed and moved files (also a renamed directory) are not
/// read again, are counted in `files_renamed`, stay shared, and serve as
/// the source of a new copy at their new path.
fn rename_and_move(kind: FsKind) {
    let s = Scene::new(kind);
    let sets = make_dupes(&s.root, SPECS);
    let uniques = make_uniques(&s.root);
    let n = all_files(&sets, &uniques).len() as u64;
    settle();
    let r = s.run_root("first run");
    r.assert_ok("first run");
    assert_eq!(r.u("files_read"), n);
    assert_sets_shared("first run", &sets);
    let mut sums = tree_sums(&s.root);

    let x = &sets[0];
    let y = &sets[1];
    // Rename in place.
    let x_renamed = s.p("orig/a/x-renamed.bin");
    move_to(&x.original, &x_renamed);
    rekey(&mut sums, s.rel(&x.original), s.rel(&x_renamed));
    // Move to another directory.
    let x_moved = s.p("moved/deep/x-moved.bin");
    move_to(&x.copies[0], &x_moved);
    rekey(&mut sums, s.rel(&x.copies[0]), s.rel(&x_moved));
    // Rename the directory holding y (its ctime does not change).
    std::fs::rename(s.p("orig/b"), s.p("orig/b2")).unwrap();
    let y_moved = s.p("orig/b2/y.bin");
    assert_eq!(y.original, s.p("orig/b/y.bin"));
    rekey(&mut sums, s.rel(&y.original), s.rel(&y_moved));
    // A unique file moved.
    let u_moved = s.p("moved/u1.bin");
    move_to(&uniques[1], &u_moved);
    rekey(&mut sums, s.rel(&uniques[1]), s.rel(&u_moved));
    // And a new byte copy of the renamed file.
    let x_new = s.p("fresh/x-new.bin");
    mkparent(&x_new);
    copy_no_reflink(&x_renamed, &x_new).unwrap();
    sums.insert(s.rel(&x_new), sums[&s.rel(&x_renamed)]);
    assert_eq!(shared_bytes_between(&x_renamed, &x_new), 0);
    assert_eq!(tree_sums(&s.root), sums, "test set-up");

    settle();
    let r = s.run_root("after renames");
    r.assert_ok("after renames");
    assert_read("after renames", &r, &[&x_new]);
    assert_eq!(r.u("files_known"), n, "after renames: files_known");
    assert_eq!(
        r.u("files_renamed"),
        4,
        "after renames: files_renamed (x renamed, x copy moved, y's directory renamed, u1 moved)"
    );
    assert_eq!(tree_sums(&s.root), sums, "file contents changed");
    for c in [&x_moved, &x.copies[1], &x_new] {
        assert_shared("after renames", &x_renamed, c);
    }
    assert_shared("after renames", &y_moved, &y.copies[0]);
    assert_eq!(s.catalog_files(), n + 1, "catalog records after renames");

    let r = s.run_with("warm after renames", &["--recheck-every", "0"], &[&s.root]);
    assert_warm("warm after renames", &r, n + 1);
    assert!(r.u("ranges_settled") > 0);
    assert_eq!(tree_sums(&s.root), sums);
}

/// Case 3b: a copy whose contents change with its mtime put back and is
/// then renamed passes as known (a rename moves ctime, the inode's
/// generation vouches): its old digests plan a share the kernel refuses
/// (the bytes differ), and that drops both files' records, so the next
/// run reads them and shares the copy with the file it now copies. It was trusted with its
/// old digests in every run.
fn content_changed_mtime_restored_then_renamed(kind: FsKind) {
    let s = Scene::new(kind);
    let size = MIB + 123;
    let (a, b, y) = (s.p("a/A.bin"), s.p("b/B.bin"), s.p("y/Y.bin"));
    for f in [&a, &b, &y] {
        mkparent(f);
    }
    write_random(&a, size, 41).unwrap();
    copy_no_reflink(&a, &b).unwrap();
    write_random(&y, size, 42).unwrap();
    settle();
    s.run_root("first run").assert_ok("first run");
    assert_shared("first run", &a, &b);
    pwrite_keep_mtime(&b, 0, &std::fs::read(&y).unwrap());
    let b2 = s.p("b/B2.bin");
    std::fs::rename(&b, &b2).unwrap();
    let sums = tree_sums(&s.root);
    settle();
    let ask = ["--recheck-every", "1"];
    let r = s.run_with("stale digests", &ask, &[&s.root]);
    assert_eq!(r.u("files_renamed"), 1, "stale digests: files_renamed");
    assert_eq!(tree_sums(&s.root), sums, "file contents changed");
    let r = s.run_with("read again", &ask, &[&s.root]);
    r.assert_ok("read again");
    // Both sides of the refused share: either may be the stale one.
    assert_read("read again", &r, &[&a, &b2]);
    assert_shared("read again", &y, &b2);
    assert_eq!(tree_sums(&s.root), sums, "file contents changed");
}

/// Case 3: content rewritten in place at the same size with the mtime put
/// back (`touch -r`) is read again; a new duplicate is deduped, a new
/// unique content is no longer shared and reads as written.
fn content_changed_mtime_restored(kind: FsKind) {
    let s = Scene::new(kind);
    let size = MIB + 3 * 4096 + 123;
    let p = s.p("p/P.bin");
    let pc = s.p("copy/Pc.bin");
    let pc2 = s.p("copy/Pc2.bin");
    let q = s.p("q/Q.bin");
    let r_ = s.p("r/R.bin");
    for f in [&p, &pc, &pc2, &q, &r_] {
        mkparent(f);
    }
    write_random(&p, size, 31).unwrap();
    copy_no_reflink(&p, &pc).unwrap();
    copy_no_reflink(&p, &pc2).unwrap();
    write_random(&q, size, 32).unwrap();
    write_random(&r_, size, 33).unwrap();

    settle();
    let r = s.run_root("first run");
    r.assert_ok("first run");
    assert_eq!(r.u("files_read"), 5);
    assert_shared("first run", &p, &pc);
    assert_shared("first run", &p, &pc2);

    let p_data = std::fs::read(&p).unwrap();
    // Q becomes a duplicate of P.
    pwrite_keep_mtime(&q, 0, &p_data);
    assert_eq!(shared_bytes_between(&p, &q), 0);
    // Pc gets new, unique content.
    let pc_data = random_bytes(size as usize, 34);
    pwrite_keep_mtime(&pc, 0, &pc_data);
    // Pc2 gets 4 KiB changed inside its fourth block.
    let patch = random_bytes(4096, 35);
    let patch_at = 3 * DEFAULT_BLOCK + 100;
    pwrite_keep_mtime(&pc2, patch_at, &patch);
    let mut pc2_data = p_data.clone();
    pc2_data[patch_at as usize..patch_at as usize + 4096].copy_from_slice(&patch);
    let sums = tree_sums(&s.root);

    settle();
    let r = s.run_root("after touch -r");
    r.assert_ok("after touch -r");
    assert_read("after touch -r", &r, &[&q, &pc, &pc2]);
    assert_eq!(r.u("files_known"), 2, "after touch -r: files_known (P, R)");
    assert_no_stale_skips("after touch -r", &r);
    assert_eq!(tree_sums(&s.root), sums, "file contents changed");
    assert_eq!(std::fs::read(&q).unwrap(), p_data);
    assert_eq!(std::fs::read(&pc).unwrap(), pc_data, "Pc reads as written");
    assert_eq!(
        std::fs::read(&pc2).unwrap(),
        pc2_data,
        "Pc2 reads as written"
    );
    assert_shared("Q now duplicates P", &p, &q);
    assert_eq!(
        shared_bytes_between(&p, &pc) + shared_bytes_between(&pc, &p),
        0,
        "Pc has new content but is still shared with P"
    );
    assert_eq!(shared_flag_bytes(&pc), 0, "Pc's unique content is shared");
    let pc2_shared = shared_bytes_between(&p, &pc2);
    // Unshared: the blocks the patch touches and at most the partial tail.
    let touched = (patch_at + 4096).div_ceil(DEFAULT_BLOCK) - patch_at / DEFAULT_BLOCK;
    assert!(
        pc2_shared >= size - (touched + 1) * DEFAULT_BLOCK && pc2_shared < size,
        "Pc2: {pc2_shared} of {size} bytes shared with P"
    );
    assert_eq!(shared_flag_bytes(&r_), 0, "R is unique");

    let r = s.run_root("warm after touch -r");
    assert_warm("warm after touch -r", &r, 5);
    assert_eq!(tree_sums(&s.root), sums);
}

/// Case 4: a file truncated and rewritten (another size), a file only
/// truncated: both read again, and deduped where they still duplicate.
fn truncate_and_rewrite(kind: FsKind) {
    let s = Scene::new(kind);
    let size = 2 * MIB + 123;
    let p = s.p("p/P.bin");
    let t = s.p("c/T.bin");
    let v = s.p("c/V.bin");
    let u = s.p("u/U.bin");
    for f in [&p, &t, &u] {
        mkparent(f);
    }
    write_random(&p, size, 41).unwrap();
    copy_no_reflink(&p, &t).unwrap();
    copy_no_reflink(&p, &v).unwrap();
    write_random(&u, 900 * KIB, 42).unwrap();

    settle();
    let r = s.run_root("first run");
    r.assert_ok("first run");
    assert_eq!(r.u("files_read"), 4);
    assert_shared("first run", &p, &t);
    assert_shared("first run", &p, &v);

    let p_data = std::fs::read(&p).unwrap();
    // T: truncated, then rewritten with P's first 1 MiB + 5000 bytes.
    let t_data = p_data[..(MIB + 5000) as usize].to_vec();
    truncate_rewrite_keep_mtime(&t, &t_data);
    assert_eq!(shared_bytes_between(&p, &t), 0, "T has fresh extents");
    // V: only truncated to 1 MiB.
    let before = std::fs::metadata(&v).unwrap();
    OpenOptions::new()
        .write(true)
        .open(&v)
        .unwrap()
        .set_len(MIB)
        .unwrap();
    restore_times(&v, &before);
    // U: truncated and rewritten with new content one block longer.
    let u_data = random_bytes((900 * KIB + DEFAULT_BLOCK + 1) as usize, 43);
    truncate_rewrite_keep_mtime(&u, &u_data);
    let sums = tree_sums(&s.root);

    settle();
    let r = s.run_root("after truncation");
    r.assert_ok("after truncation");
    assert_read("after truncation", &r, &[&t, &v, &u]);
    assert_eq!(r.u("files_known"), 1, "after truncation: files_known (P)");
    assert_no_stale_skips("after truncation", &r);
    assert_eq!(tree_sums(&s.root), sums, "file contents changed");
    assert_eq!(std::fs::read(&t).unwrap(), t_data);
    assert_eq!(std::fs::read(&u).unwrap(), u_data);
    assert_eq!(std::fs::read(&v).unwrap(), &p_data[..MIB as usize]);
    // T's 16 whole blocks are P's; its 5000-byte tail block is not.
    let t_shared = shared_bytes_between(&p, &t);
    assert!(
        t_shared >= MIB,
        "T: only {t_shared} bytes shared with P, expected its first 1 MiB"
    );
    assert!(is_fully_shared(&p, &v), "V is not inside P's extents");
    assert_eq!(shared_flag_bytes(&u), 0, "U's new content is shared");

    let r = s.run_root("warm after truncation");
    assert_warm("warm after truncation", &r, 4);
    assert_eq!(tree_sums(&s.root), sums);
}

/// `catalog forget` of a deleted file named relative to the current
/// directory forgets it (it printed "forgot 0 files": the path could not
/// be resolved, so it was compared as given with the absolute ones kept).
#[test]
fn forget_by_a_relative_path_of_a_deleted_file() {
    let s = Scene::new(FsKind::Xfs);
    let sets = make_dupes(&s.root, SPECS);
    settle();
    s.run_root("first run").assert_ok("first run");
    let n = s.catalog_files();
    let forget = |rel: &Path, cwd: &Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_onecopy"))
            .args(["catalog", "forget", "--json", "--hashfile"])
            .arg(&s.h)
            .arg(rel)
            .current_dir(cwd)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v.as_array().map_or(&v, |a| &a[0])["forgotten"].as_u64()
    };
    let gone = &sets[0].copies[0];
    std::fs::remove_file(gone).unwrap();
    let (dir, name) = (gone.parent().unwrap(), gone.file_name().unwrap());
    assert_eq!(forget(Path::new(name), dir), Some(1), "by its name");
    // Through `..`, from the directory above.
    let other = &sets[1].copies[0];
    std::fs::remove_file(other).unwrap();
    let d = other.parent().unwrap();
    let d_name = Path::new(d.file_name().unwrap());
    let rel = d_name
        .join("..")
        .join(d_name)
        .join(other.file_name().unwrap());
    assert_eq!(forget(&rel, d.parent().unwrap()), Some(1), "through ..");
    assert_eq!(s.catalog_files(), n - 2);
}

/// Case 5: deleted files (a whole directory) leave the catalog; a file
/// deleted and replaced, at the same or at another path, by one of the
/// same size and mtime (on XFS usually with the same inode number) is
/// read, and the old record leaves the catalog.
fn delete(kind: FsKind) {
    let s = Scene::new(kind);
    let sets = make_dupes(&s.root, SPECS);
    let uniques = make_uniques(&s.root);
    let n = all_files(&sets, &uniques).len() as u64;
    settle();
    let r = s.run_root("first run");
    r.assert_ok("first run");
    assert_eq!(r.u("files_read"), n);
    assert_eq!(s.catalog_files(), n, "catalog records after the first run");

    let x = &sets[0];
    let y = &sets[1];
    // Deleted, and a new file with other content of the same size put at
    // the same path (y's original) or at another path (x's second copy)
    // with the old file's mtime. Each time with a sync after the unlink, so
    // that XFS can hand out the same inode number again (btrfs does not
    // reuse one within a mount): then only the ctime, or the path and the
    // inode generation, tell the new file from the old one.
    let y_data = random_bytes(y.len as usize, 55);
    let x1_data = random_bytes(x.len as usize, 56);
    let x1_new = s.p("elsewhere/x1-new.bin");
    mkparent(&x1_new);
    for (old_path, new_path, data) in [
        (&y.original, &y.original, &y_data),
        (&x.copies[1], &x1_new, &x1_data),
    ] {
        let old = std::fs::metadata(old_path).unwrap();
        std::fs::remove_file(old_path).unwrap();
        for attempt in 0..3 {
            if attempt > 0 {
                std::fs::remove_file(new_path).unwrap();
            }
            s.fs.sync();
            std::fs::write(new_path, data).unwrap();
            if kind != FsKind::Xfs || std::fs::metadata(new_path).unwrap().ino() == old.ino() {
                break;
            }
        }
        restore_times(new_path, &old);
        eprintln!(
            "{} replaced by {}: inode {} (was {})",
            old_path.display(),
            new_path.display(),
            std::fs::metadata(new_path).unwrap().ino(),
            old.ino()
        );
    }
    std::fs::remove_dir_all(s.p("unique")).unwrap();
    let sums = tree_sums(&s.root);

    settle();
    let r = s.run_root("after deletes");
    r.assert_ok("after deletes");
    assert_read("after deletes", &r, &[&y.original, &x1_new]);
    assert_eq!(r.u("files_known"), 3, "after deletes: files_known");
    assert_no_stale_skips("after deletes", &r);
    assert_eq!(
        s.catalog_files(),
        5,
        "catalog records after deleting 5 of 8 files and creating 2"
    );
    assert_eq!(tree_sums(&s.root), sums, "file contents changed");
    assert_eq!(std::fs::read(&y.original).unwrap(), y_data);
    assert_eq!(std::fs::read(&x1_new).unwrap(), x1_data);
    assert_eq!(shared_bytes_between(&y.copies[0], &y.original), 0);
    assert_eq!(shared_bytes_between(&x.original, &x1_new), 0);
    assert_shared("after deletes", &x.original, &x.copies[0]);

    let r = s.run_root("warm after deletes");
    assert_warm("warm after deletes", &r, 5);
    assert_eq!(s.catalog_files(), 5);
}

/// Case 6: hardlinks added to known files (names sorting before and after
/// the known name, in the same and in other directories) cause no read.
fn hardlink_added(kind: FsKind) {
    let s = Scene::new(kind);
    let sets = make_dupes(&s.root, SPECS);
    let uniques = make_uniques(&s.root);
    let n = all_files(&sets, &uniques).len() as u64;
    settle();
    let r = s.run_root("first run");
    r.assert_ok("first run");
    assert_eq!(r.u("files_read"), n);

    let links = [
        (&sets[0].original, s.p("orig/a/zz-link.bin")), // after, same dir
        (&sets[1].original, s.p("orig/b/aa-link.bin")), // before, same dir
        (&uniques[0], s.p("links/u0-link.bin")),        // before, other dir
        (&uniques[2], s.p("zlinks/u2-link.bin")),       // after, other dir
    ];
    for (target, link) in &links {
        mkparent(link);
        std::fs::hard_link(target, link).unwrap();
    }
    let sums = tree_sums(&s.root);

    settle();
    let r = s.run_root("after hardlinks");
    r.assert_ok("after hardlinks");
    assert_eq!(r.u("files_scanned"), n, "one entry per inode");
    assert_eq!(r.skipped("hardlink"), links.len() as u64);
    assert_read("after hardlinks", &r, &[]);
    assert_eq!(r.u("files_known"), n, "after hardlinks: files_known");
    assert_eq!(r.u("dedupe_ioctls"), 0, "after hardlinks: dedupe_ioctls");
    assert_eq!(tree_sums(&s.root), sums, "file contents changed");
    assert_sets_shared("after hardlinks", &sets);

    let r = s.run_root("warm after hardlinks");
    assert_warm("warm after hardlinks", &r, n);
}

/// Case 7: a new byte copy of an old file is the only file read, and is
/// deduped against the old file, which stays the canonical copy.
fn new_copy_of_old_file(kind: FsKind) {
    let s = Scene::new(kind);
    let a = s.p("old/A.bin");
    let c = s.p("old/C.bin");
    let cc = s.p("old/copy/Cc.bin");
    mkparent(&cc);
    write_random(&a, 2 * MIB + 77, 71).unwrap();
    write_random(&c, MIB + MIB / 2, 72).unwrap();
    copy_no_reflink(&c, &cc).unwrap();
    let uniques = make_uniques(&s.root);
    let n = 3 + uniques.len() as u64;
    settle();
    let r = s.run_root("first run");
    r.assert_ok("first run");
    assert_eq!(r.u("files_read"), n);
    assert_shared("first run", &c, &cc);
    let phys_a = physical_ranges(&a);
    let phys_c = physical_ranges(&c);

    let a_new = s.p("new/deep/A-copy.bin");
    let c_new = s.p("new/C-copy.bin");
    mkparent(&a_new);
    copy_no_reflink(&a, &a_new).unwrap();
    copy_no_reflink(&c, &c_new).unwrap();
    assert_eq!(shared_bytes_between(&a, &a_new), 0);
    let sums = tree_sums(&s.root);

    settle();
    let r = s.run_root("after new copies");
    r.assert_ok("after new copies");
    assert_read("after new copies", &r, &[&a_new, &c_new]);
    assert_eq!(
        r.u("bytes_read"),
        2 * MIB + 77 + MIB + MIB / 2,
        "only the new copies' bytes are read"
    );
    assert_eq!(r.u("files_known"), n, "after new copies: files_known");
    assert_eq!(tree_sums(&s.root), sums, "file contents changed");
    assert_shared("new copy of A", &a, &a_new);
    assert_shared("new copy of C", &c, &c_new);
    assert_shared("old copy of C", &c, &cc);
    assert_eq!(physical_ranges(&a), phys_a, "A is no longer where it was");
    assert_eq!(physical_ranges(&c), phys_c, "C is no longer where it was");
    let want = round4k(2 * MIB + 77) + round4k(MIB + MIB / 2);
    assert_close(
        "bytes_freed",
        r.u("bytes_freed"),
        want,
        tol(want, 3, 128 * KIB),
    );

    let r = s.run_root("warm after new copies");
    assert_warm("warm after new copies", &r, n + 2);
}

/// Case 7b: new files' blocks are matched against known files' block
/// digests, which a run keeps out of RAM (a scratch file next to the
/// catalog) and reads back when planning: a part of a known file inside a
/// new file, at a shifted offset, is shared with it, at the 4 KiB default
/// and at `-b 64K`; a renamed known file, whose record is rewritten from
/// those digests, is matched by the next run's new file too.
fn block_runs_against_known_files(kind: FsKind) {
    for block in [None, Some("64K")] {
        let ctx = |what: &str| format!("{what} (-b {})", block.unwrap_or("default"));
        let extra: Vec<&str> = block.map(|b| vec!["-b", b]).unwrap_or_default();
        let s = Scene::new(kind);
        let run = |what: &str| {
            settle();
            let r = s.run_with(&ctx(what), &extra, &[&s.root]);
            r.assert_ok(&ctx(what));
            r
        };
        // At least 90% of `part` (copied from `src` into `dst`) is shared.
        let mostly_shared = |what: &str, src: &Path, dst: &Path, part: &[u8]| {
            let shared = shared_bytes_between(src, dst);
            assert!(
                shared >= part.len() as u64 * 9 / 10,
                "{}: {shared} of {} bytes shared",
                ctx(what),
                part.len()
            );
        };
        let (a, r_old, r_new) = (s.p("old/A.bin"), s.p("old/R.bin"), s.p("old/R2.bin"));
        mkparent(&a);
        let a_data = random_bytes((2 * MIB + 77) as usize, 81);
        let r_data = random_bytes((MIB + 5) as usize, 82);
        std::fs::write(&a, &a_data).unwrap();
        std::fs::write(&r_old, &r_data).unwrap();
        assert_eq!(run("first run").u("files_read"), 2);

        // 12 KiB of its own, A's 64 KiB-aligned [256 KiB, 1.5 MiB), 40 KiB
        // of its own: no whole-file copy, only block runs find it.
        let n = s.p("new/N.bin");
        let part = &a_data[(256 * KIB) as usize..(3 * MIB / 2) as usize];
        mkparent(&n);
        let mut data = random_bytes((12 * KIB) as usize, 83);
        data.extend_from_slice(part);
        data.extend(random_bytes((40 * KIB) as usize, 84));
        std::fs::write(&n, &data).unwrap();
        std::fs::rename(&r_old, &r_new).unwrap();
        let sums = tree_sums(&s.root);
        let r = run("after N");
        assert_read(&ctx("after N"), &r, &[&n]);
        assert_eq!(r.u("files_renamed"), 1, "{}", ctx("after N: renamed"));
        assert_eq!(tree_sums(&s.root), sums, "{}", ctx("contents changed"));
        mostly_shared("after N: A in N", &a, &n, part);

        // The renamed file's rewritten record still matches: 8 KiB of its
        // own, R's [64 KiB, 832 KiB), no more.
        let m = s.p("new/M.bin");
        let part = &r_data[(64 * KIB) as usize..(832 * KIB) as usize];
        let mut data = random_bytes((8 * KIB) as usize, 85);
        data.extend_from_slice(part);
        std::fs::write(&m, &data).unwrap();
        let sums = tree_sums(&s.root);
        let r = run("after M");
        assert_read(&ctx("after M"), &r, &[&m]);
        assert_eq!(tree_sums(&s.root), sums, "{}", ctx("contents changed"));
        mostly_shared("after M: R2 in M", &r_new, &m, part);
        // The scratch file had no name: only the catalog is left.
        for e in std::fs::read_dir(s.h.parent().unwrap()).unwrap() {
            let name = e.unwrap().file_name();
            let name = name.to_string_lossy();
            assert!(
                name.starts_with("cat.sqlite"),
                "{}: {name} left",
                ctx("end")
            );
        }
    }
}

/// Case 8: files of another run's roots serve as sources (never as
/// destinations) while unchanged; a changed or deleted one does not and
/// leaves the catalog.
fn outside_roots(kind: FsKind) {
    let s = Scene::new(kind);
    let a = s.p("a");
    let b = s.p("b");
    let f1 = s.p("a/f1.bin");
    let f2 = s.p("a/f2.bin");
    let f3 = s.p("a/sub/f3.bin");
    let f4 = s.p("a/f4.bin");
    mkparent(&f3);
    write_random(&f1, MIB + MIB / 2, 81).unwrap();
    write_random(&f2, MIB + 7, 82).unwrap();
    write_random(&f3, 700 * KIB, 83).unwrap();
    write_random(&f4, 600 * KIB, 84).unwrap();

    settle();
    let r = s.run("run on a", &[&a]);
    r.assert_ok("run on a");
    assert_read("run on a", &r, &[&f1, &f2, &f3, &f4]);
    assert_eq!(s.catalog_files(), 4);

    let b1 = s.p("b/f1-copy.bin");
    let b2 = s.p("b/deep/f2-old.bin");
    mkparent(&b2);
    copy_no_reflink(&f1, &b1).unwrap();
    copy_no_reflink(&f2, &b2).unwrap();
    let f2_old = std::fs::read(&f2).unwrap();
    // f2 changes after run 1 (same size, mtime put back): b2 still holds
    // its old content, which must not be deduped against it.
    let f2_new = random_bytes(f2_old.len(), 85);
    pwrite_keep_mtime(&f2, 0, &f2_new);
    std::fs::remove_file(&f4).unwrap();
    let phys_f1 = physical_ranges(&f1);
    let phys_f3 = physical_ranges(&f3);
    let sums = tree_sums(&s.root);

    settle();
    let r = s.run("run on b", &[&b]);
    r.assert_ok("run on b");
    assert_read("run on b", &r, &[&b1, &b2]);
    assert_eq!(r.u("files_known"), 0, "run on b: files_known under b");
    assert_eq!(
        r.u("files_known_outside"),
        2,
        "run on b: files_known_outside (a/f1 and a/sub/f3, unchanged outside the roots)"
    );
    assert_no_stale_skips("run on b", &r);
    assert_eq!(tree_sums(&s.root), sums, "file contents changed");
    assert_shared("b's copy of a/f1", &f1, &b1);
    assert_eq!(
        physical_ranges(&f1),
        phys_f1,
        "a/f1 was used as a destination"
    );
    assert_eq!(physical_ranges(&f3), phys_f3, "a/f3 was touched");
    assert_eq!(std::fs::read(&f2).unwrap(), f2_new);
    assert_eq!(std::fs::read(&b2).unwrap(), f2_old);
    assert_eq!(
        shared_bytes_between(&f2, &b2) + shared_bytes_between(&b2, &f2),
        0,
        "b's copy of f2's old content shares with the changed f2"
    );
    assert_eq!(
        s.catalog_files(),
        4,
        "catalog after the run on b: a/f1, a/f3, b's two files (a/f2 changed, a/f4 gone)"
    );

    // Back on a: only the changed f2 is read; b's files are known sources.
    let r = s.run("second run on a", &[&a]);
    r.assert_ok("second run on a");
    assert_read("second run on a", &r, &[&f2]);
    assert_eq!(
        r.u("files_known"),
        2,
        "second run on a: files_known (f1, f3)"
    );
    assert_eq!(
        r.u("files_known_outside"),
        2,
        "second run on a: files_known_outside (b's two)"
    );
    assert_eq!(r.u("dedupe_ioctls"), 0, "second run on a: dedupe_ioctls");
    assert_no_stale_skips("second run on a", &r);
    assert_eq!(tree_sums(&s.root), sums, "file contents changed");
    assert_shared("b's copy of a/f1", &f1, &b1);

    let r = s.run_root("run on both");
    assert_warm("run on both", &r, 5);
}

/// How a catalog file is damaged.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// Random bytes: not SQLite at all.
    Foreign,
    /// Cut to half its length.
    Truncated,
    /// `PRAGMA user_version` (4 bytes, big-endian, at offset 60) set to 99.
    Version99,
    /// Bytes of a record (inside a file's path) flipped: the record is
    /// damaged for sure.
    RecordFlips,
    /// The `block_size` key of the `meta` table's primary-key index
    /// (`sqlite_autoindex_meta_1`) changed to `block_sizf`: SQLite reports
    /// nothing, but the index no longer matches the table.
    MetaIndexFlip,
    /// The serial type of the `started` column of the `runs` rows changed
    /// from integer to text of the same length: a well-formed record with a
    /// value of the wrong type.
    RunsTypeFlip,
    /// Random bytes flipped in the middle half of the file (trial `n`).
    RandomFlips(u64),
}

/// The SQLite page size (big-endian u16 at offset 16; 1 means 65536).
fn sqlite_page_size(data: &[u8]) -> usize {
    match u16::from_be_bytes([data[16], data[17]]) {
        1 => 65536,
        n => n as usize,
    }
}

/// The type byte of the b-tree page holding file offset `off`
/// (0x0a: leaf index page, 0x0d: leaf table page).
fn sqlite_page_type(data: &[u8], off: usize) -> u8 {
    let ps = sqlite_page_size(data);
    let page = off / ps;
    data[page * ps + if page == 0 { 100 } else { 0 }]
}

/// Offsets of every occurrence of `needle` in `data`.
fn find_all(data: &[u8], needle: &[u8]) -> Vec<usize> {
    data.windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect()
}

/// The SQLite varint encoding of `v` (only the one- and two-byte forms
/// are needed here).
fn sqlite_varint(v: u64) -> Vec<u8> {
    assert!(v < 1 << 14);
    if v < 0x80 {
        vec![v as u8]
    } else {
        vec![0x80 | (v >> 7) as u8, (v & 0x7f) as u8]
    }
}

/// Offsets of the serial type bytes of `started` in the `runs` records
/// `(run INTEGER PRIMARY KEY, started INTEGER, roots TEXT)` whose roots are
/// `roots`, with the size of the integer: the record is
/// `[header size][0 (run, the rowid)][int type][text type][int][roots]`.
fn runs_started_types(data: &[u8], roots: &[u8]) -> Vec<(usize, usize)> {
    let text = sqlite_varint(2 * roots.len() as u64 + 13);
    let mut out = Vec::new();
    for at in find_all(data, roots) {
        for (t, size) in [(1u8, 1usize), (2, 2), (3, 3), (4, 4), (5, 6), (6, 8)] {
            let Some(hdr) = at.checked_sub(size + text.len() + 3) else {
                continue;
            };
            let want: Vec<u8> = [vec![(3 + text.len()) as u8, 0, t], text.clone()].concat();
            if data[hdr..hdr + want.len()] == want[..] {
                out.push((hdr + 2, size));
            }
        }
    }
    out
}

fn damage(h: &Path, how: Damage, marker: &[u8], root: &Path, seed: u64) {
    let len = std::fs::metadata(h).unwrap().len();
    let f = OpenOptions::new().read(true).write(true).open(h).unwrap();
    match how {
        Damage::Foreign => {
            f.set_len(0).unwrap();
            f.write_all_at(&random_bytes(64 * KIB as usize, seed), 0)
                .unwrap();
        }
        Damage::Truncated => f.set_len(len / 2).unwrap(),
        Damage::Version99 => f.write_all_at(&99u32.to_be_bytes(), 60).unwrap(),
        Damage::RecordFlips => {
            let data = std::fs::read(h).unwrap();
            let at: Vec<usize> = data
                .windows(marker.len())
                .enumerate()
                .filter(|(_, w)| *w == marker)
                .map(|(i, _)| i)
                .collect();
            assert!(
                !at.is_empty(),
                "the catalog does not hold the path {:?}",
                String::from_utf8_lossy(marker)
            );
            for i in at {
                let j = (i + marker.len() - 3) as u64;
                f.write_all_at(&[data[j as usize] ^ 0x5a], j).unwrap();
            }
        }
        Damage::MetaIndexFlip => {
            let data = std::fs::read(h).unwrap();
            let at: Vec<usize> = find_all(&data, b"block_size")
                .into_iter()
                .filter(|&i| sqlite_page_type(&data, i) == 0x0a)
                .collect();
            assert_eq!(at.len(), 1, "block_size in the meta index: {at:?}");
            let j = at[0] + b"block_size".len() - 1;
            f.write_all_at(b"f", j as u64).unwrap();
        }
        Damage::RunsTypeFlip => {
            let data = std::fs::read(h).unwrap();
            let at = runs_started_types(&data, root.as_os_str().as_encoded_bytes());
            assert!(!at.is_empty(), "no runs record found in the catalog");
            for (j, size) in at {
                f.write_all_at(&[2 * size as u8 + 13], j as u64).unwrap();
            }
        }
        Damage::RandomFlips(trial) => {
            let mut rng = Prng::derive(seed, trial);
            let data = std::fs::read(h).unwrap();
            let (lo, hi) = (len / 4, len * 3 / 4);
            let mut flipped = Vec::new();
            for _ in 0..12 {
                let j = rng.range(lo, hi - 1);
                let x = 1u8 << rng.below(8);
                f.write_all_at(&[data[j as usize] ^ x], j).unwrap();
                flipped.push(j);
            }
            eprintln!("random flips in a {len}-byte catalog at {flipped:?}");
        }
    }
    f.sync_all().ok();
}

/// Case 9a: a foreign file (random bytes) at `H`. It is not a catalog, so
/// it is refused (exit 2) and left byte for byte as it was, never set
/// aside (issue 8); once it is gone, the next run builds a catalog.
fn damage_foreign(kind: FsKind) {
    let s = Scene::new(kind);
    make_dupes(&s.root, SPECS);
    settle();
    s.run_root("first run").assert_ok("first run");
    let seed = test_seed("damage_foreign") ^ kind_tag(kind);
    damage(&s.h, Damage::Foreign, b"", &s.root, seed);
    let bytes = std::fs::read(&s.h).unwrap();
    let r = s.run_root("foreign file at H");
    assert_eq!(r.code, 2, "foreign file at H: stderr {:?}", r.stderr);
    assert!(
        r.stderr.contains("not an onecopy catalog"),
        "no clear message: {:?}",
        r.stderr
    );
    assert_eq!(std::fs::read(&s.h).unwrap(), bytes, "H was modified");
    assert!(!s.h_with(".broken").exists(), "H was set aside");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(s.h_with(suffix));
    }
    s.run_root("after removal").assert_ok("after removal");
}

/// Case 9b: `H` truncated to half its length.
fn damage_truncated(kind: FsKind) {
    catalog_damage(kind, &[Damage::Truncated]);
}

/// Case 9c: a catalog of format (`PRAGMA user_version`) 99.
fn damage_version(kind: FsKind) {
    catalog_damage(kind, &[Damage::Version99]);
}

/// Case 9d: bytes of a file's record flipped.
fn damage_record(kind: FsKind) {
    catalog_damage(kind, &[Damage::RecordFlips]);
}

/// Case 9e: the `meta` table's index no longer matches the table.
fn damage_meta_index(kind: FsKind) {
    catalog_damage(kind, &[Damage::MetaIndexFlip]);
}

/// Case 9f: a `runs` row holds text where an integer belongs.
fn damage_runs_type(kind: FsKind) {
    catalog_damage(kind, &[Damage::RunsTypeFlip]);
}

/// Case 9g: random bytes flipped in the middle of the file, four times.
fn damage_random_flips(kind: FsKind) {
    catalog_damage(
        kind,
        &[
            Damage::RandomFlips(0),
            Damage::RandomFlips(1),
            Damage::RandomFlips(2),
            Damage::RandomFlips(3),
        ],
    );
}

/// Case 9: a damaged catalog, one damage after the other (each after a
/// warm run). Damage to the header or the records (foreign, truncated,
/// other version, record bytes) is detected: the catalog is set aside and
/// rebuilt with a clear warning, every file is read again. Other damage is
/// either detected the same way or harmless: the catalog is then used as
/// it is (only new files read). Either way: exit 0, never a panic, every
/// file as before, every copy shared, `catalog stats` works and counts
/// every file, and the next run is warm.
fn catalog_damage(kind: FsKind, cases: &[Damage]) {
    let s = Scene::new(kind);
    let seed = test_seed("catalog_damage") ^ kind_tag(kind);
    let mut sets = make_dupes(&s.root, SPECS);
    let uniques = make_uniques(&s.root);
    settle();
    let r = s.run_root("first run");
    r.assert_ok("first run");
    let r = s.run_root("warm run");
    let mut n = all_files(&sets, &uniques).len() as u64;
    assert_warm("warm run", &r, n);
    let marker = sets[0].original.as_os_str().as_encoded_bytes().to_vec();

    for (i, &how) in cases.iter().enumerate() {
        let ctx = format!("{how:?}");
        // A new copy each time: the run after the damage has work to do.
        let set = &mut sets[i % 2];
        let new_copy = s.p(&format!("new/{i}/copy.bin"));
        mkparent(&new_copy);
        copy_no_reflink(&set.original, &new_copy).unwrap();
        set.copies.push(new_copy.clone());
        n += 1;
        let all = all_files(&sets, &uniques);
        settle();
        let sums = tree_sums(&s.root);
        let _ = std::fs::remove_file(s.h_with(".broken"));
        assert!(
            !s.h_with("-wal").exists()
                || std::fs::metadata(s.h_with("-wal")).unwrap().len() == 0,
            "{ctx}: a WAL with content is left after a clean run; damaging the main file would not test much"
        );

        damage(&s.h, how, &marker, &s.root, seed ^ i as u64);
        let r = s.run_root(&ctx);
        assert_eq!(
            r.code, 0,
            "{ctx}: exit code {} (stderr: {:?})",
            r.code, r.stderr
        );
        r.assert_ok(&ctx);
        let detected = rebuilt(&r);
        // Damage to the records or the header must be detected; damage
        // elsewhere may be detected (and rebuilt), or be harmless.
        let must_detect = matches!(
            how,
            Damage::Foreign | Damage::Truncated | Damage::Version99 | Damage::RecordFlips
        );
        if must_detect {
            assert!(detected, "{ctx}: the damage was not detected");
        }
        if detected {
            assert_read(&ctx, &r, &refs(&all));
            assert_eq!(r.u("files_known"), 0, "{ctx}: files_known");
            assert!(
                s.h_with(".broken").exists(),
                "{ctx}: the damaged catalog was not set aside as {}",
                s.h_with(".broken").display()
            );
            assert!(
                r.stderr.contains(s.h.to_str().unwrap()) && r.stderr.contains("rebuilt"),
                "{ctx}: no clear message naming the catalog: {:?}",
                r.stderr
            );
        } else {
            eprintln!(
                "{ctx}: damage not detected; {} files read",
                r.u("files_read")
            );
            // Not detected: then the catalog must be used as it is. Records
            // silently lost (files read again without a rebuild and its
            // warning) mean damage went unnoticed.
            assert_read(&format!("{ctx} (undetected)"), &r, &[&new_copy]);
            assert_eq!(r.u("files_known"), n - 1, "{ctx} (undetected): files_known");
            if r.stderr.contains("damaged and was set aside") {
                // Found only when the run's commit reached the damaged
                // page: set aside, and the next run rebuilds it.
                eprintln!("{ctx}: damage found at commit");
                assert!(
                    s.h_with(".broken").exists() && !s.h.exists(),
                    "{ctx}: the catalog damaged at commit was not set aside"
                );
                let rb = format!("{ctx}: rebuilding run");
                let r = s.run_root(&rb);
                r.assert_ok(&rb);
                assert_read(&rb, &r, &refs(&all));
            }
        }
        if matches!(how, Damage::Version99) {
            assert!(
                r.stderr.contains("99"),
                "{ctx}: the message does not give the format found: {:?}",
                r.stderr
            );
        }
        assert_no_stale_skips(&ctx, &r);
        assert_eq!(tree_sums(&s.root), sums, "{ctx}: file contents changed");
        assert_sets_shared(&ctx, &sets);
        assert_eq!(s.catalog_files(), n, "{ctx}: catalog records after the run");

        let warm = format!("{ctx}: next run");
        let r = s.run_root(&warm);
        assert_warm(&warm, &r, n);
        assert_eq!(tree_sums(&s.root), sums, "{warm}: file contents changed");
    }
}

/// Bytes the process `pid` has read so far (`rchar` of `/proc/PID/io`).
fn rchar(pid: u32) -> Option<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("rchar:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Case 10: SIGKILL at random points of runs (cold, and with everything
/// forgotten), then a normal run: exit 0, nothing rebuilt, every file as
/// before, every copy shared, no temporary directory left; then a warm run.
fn sigkill(kind: FsKind) {
    let s = Scene::new(kind);
    let mut rng = Prng::new(test_seed("sigkill") ^ kind_tag(kind));
    let names: Vec<String> = (0..6).map(|i| format!("orig/o{i}.bin")).collect();
    let specs: Vec<(&str, u64, u64, usize)> = names
        .iter()
        .enumerate()
        .map(|(i, nm)| (nm.as_str(), 6 * MIB + i as u64 * 4097, 100 + i as u64, 1))
        .collect();
    let mut sets = make_dupes(&s.root, &specs);
    let uniques = make_uniques(&s.root);

    let trials = 8;
    let mut killed = 0;
    // How long a run takes after reading (plan, dedupe, accounting,
    // catalog): measured from the last normal run that read everything.
    let mut tail = Duration::from_millis(20);
    // What a run that fingerprints every file reads: copies shared by an
    // earlier run are read once (files in the same extents), so less than
    // the files' total after the first trial.
    let mut full_read = None;
    for k in 0..trials {
        let set = &mut sets[k % 6];
        let copy = s.p(&format!("new/{k}/copy.bin"));
        mkparent(&copy);
        copy_no_reflink(&set.original, &copy).unwrap();
        set.copies.push(copy);
        if k > 0 {
            // Everything is read again: the killed run has a run's worth of
            // work and a large commit.
            let r = onecopy([
                OsStr::new("catalog"),
                OsStr::new("forget"),
                OsStr::new("--hashfile"),
                s.h.as_os_str(),
                s.root.as_os_str(),
            ]);
            assert_no_panic("forget", &r);
            assert_eq!(r.code, 0, "catalog forget: {:?}", r.stderr);
        }
        let files = all_files(&sets, &uniques);
        let n = files.len() as u64;
        let total: u64 = files
            .iter()
            .map(|f| std::fs::metadata(f).unwrap().len())
            .sum();
        settle();
        let sums = tree_sums(&s.root);

        // Where to kill: two runs in three while reading (after a random
        // share of the data was read), one in three after reading (in
        // planning, dedupe, accounting or the catalog commit).
        let reads = full_read.unwrap_or(total);
        let (threshold, after) = if rng.below(3) < 2 {
            (rng.below(reads), Duration::ZERO)
        } else {
            (
                reads,
                Duration::from_micros(rng.below(tail.as_micros() as u64 + 1)),
            )
        };
        let report = s.h.with_extension(format!("trial-{k}.json"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_onecopy"))
            .args([OsStr::new("dedupe"), OsStr::new("--json"), OsStr::new("-v")])
            .arg("--hashfile")
            .arg(&s.h)
            .arg(&s.root)
            .stdout(std::fs::File::create(&report).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        while child.try_wait().unwrap().is_none() && rchar(pid).unwrap_or(0) < threshold {
            std::thread::sleep(Duration::from_micros(200));
        }
        std::thread::sleep(after);
        let _ = child.kill();
        let status = child.wait().unwrap();
        let ctx =
            format!("trial {k} (SIGKILL after {threshold} of {total} bytes read, then {after:?})");
        if status.signal() == Some(libc::SIGKILL) {
            killed += 1;
        } else {
            assert_eq!(status.code(), Some(0), "{ctx}: the run ended {status:?}");
            eprintln!("{ctx}: finished before the kill");
            // It read what a run now reads (copies an earlier run shared
            // are read once): aim the next kills within that.
            let out: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
            full_read = out["bytes_read"].as_u64().or(full_read);
        }
        assert_eq!(
            tree_sums(&s.root),
            sums,
            "{ctx}: file contents changed by the killed run"
        );

        let r = s.run_root(&ctx);
        r.assert_ok(&ctx);
        let fresh = r.u("files_read") + r.u("files_same_extents");
        if fresh == n {
            let ph = &r.report()["phases"];
            let secs: f64 = ["plan", "dedupe", "catalog"]
                .iter()
                .filter_map(|p| ph.get(*p).and_then(Value::as_f64))
                .sum();
            tail = Duration::from_secs_f64(secs);
            full_read = Some(r.u("bytes_read"));
        }
        assert!(!rebuilt(&r), "{ctx}: the catalog was damaged by SIGKILL");
        assert_eq!(r.u("files_scanned"), n, "{ctx}: files_scanned");
        assert_eq!(
            fresh + r.u("files_known"),
            n,
            "{ctx}: every file is read or known"
        );
        assert_eq!(tree_sums(&s.root), sums, "{ctx}: file contents changed");
        assert_sets_shared(&ctx, &sets);
        let left: Vec<_> = std::fs::read_dir(&s.root)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|nm| nm.to_string_lossy().starts_with(".onecopy-tmp"))
            .collect();
        assert!(
            left.is_empty(),
            "{ctx}: temporary directories left: {left:?}"
        );

        let warm = format!("{ctx}: warm run");
        let r = s.run_root(&warm);
        assert_warm(&warm, &r, n);
    }
    eprintln!("{killed} of {trials} runs killed");
    assert!(
        killed >= trials / 2,
        "only {killed} of {trials} runs were killed before they finished"
    );
}
