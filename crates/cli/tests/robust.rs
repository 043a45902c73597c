//! Issue 8, items 3, 4 and 6: onecopy under ordinary limits and ordinary
//! users. Each case runs the real binary on loop-mounted btrfs and XFS
//! (reflink=1) and checks outcomes: contents, FIEMAP sharing, space.
//!
//! * Large duplicate groups dedupe completely under a low descriptor limit.
//! * `--hashfile` never renames or modifies a file that is not a catalog.
//! * `bytes_freed` never counts extents still referenced outside the roots.
//! * An ordinary user's read-only files are sources only, never errors.
//!
//! Needs root (mkfs, loop devices, mount, setpriv).

mod common;
#[path = "adversarial/support.rs"]
mod support;

use std::ffi::OsStr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use onecopy_testfs::{checksum_tree, FsKind};
use support::*;

per_fs!(
    large_group_low_fd_limit,
    hashfile_text_file,
    hashfile_foreign_sqlite,
    hashfile_damaged_catalog,
    read_only_files_are_sources_as_nobody,
    freed_excludes_reflinks_outside_roots,
    fifos_are_never_waited_on,
    huge_sparse_files_are_neither_read_nor_held,
    repeated_roots_are_walked_once,
    a_catalog_that_cannot_be_updated_is_an_error,
);

mod freed_excludes_snapshot_extents {
    #[test]
    fn btrfs() {
        super::freed_excludes_snapshot_extents()
    }
}

/// Runs `onecopy dedupe --json EXTRA... PATHS...` with a hard and soft
/// `RLIMIT_NOFILE` of `nofile`.
fn dedupe_with_nofile<P: AsRef<Path>>(nofile: u64, paths: &[P], extra: &[&str]) -> Outcome {
    let args = dedupe_args(paths, extra);
    let out = command("sh")
        .arg("-c")
        .arg(format!("ulimit -n {nofile} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_onecopy"))
        .args(&args)
        .output()
        .expect("run sh");
    Outcome::from_output(format!("(ulimit -n {nofile}) {}", describe(&args)), out)
}

/// Item 3: 3,000 byte copies of one 64 KiB file, run with at most 256
/// open descriptors: exit 0, every copy shares the first's extents,
/// contents unchanged, and the space of 2,999 copies is freed.
fn large_group_low_fd_limit(kind: FsKind) {
    const COPIES: usize = 3000;
    const LEN: u64 = 64 * KIB;
    let fs = new_fs(kind, 1024 * MIB);
    let root = fs.path().join("tree");
    let groups = dup_groups(&root, 1, COPIES, LEN, 81);
    let sums = checksum_tree(&root);
    let used = fs.used_bytes();

    let r = dedupe_with_nofile(256, &[&root], &[]);
    r.assert_ok();
    assert_eq!(checksum_tree(&root), sums, "file contents changed");
    assert_groups_shared("the large group", &groups);
    let want = (COPIES as u64 - 1) * LEN;
    let freed = used.saturating_sub(fs.used_bytes());
    eprintln!(
        "{kind}: {COPIES} copies, ulimit -n 256: freed {freed} (df), reported {}, {} ioctls",
        r.u("bytes_freed"),
        r.report()["dedupe_ioctls"]
    );
    assert!(
        freed >= want * 9 / 10,
        "df shows {freed} bytes freed, want at least 90% of {want}"
    );
}

/// `path` with `suffix` appended (`-wal`, `.broken`).
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

/// Contents and mtime (ns) of `path` and its `-wal`/`-shm`/`.broken`
/// companions (`None` where absent).
fn fingerprint(path: &Path) -> Vec<Option<(Vec<u8>, i64, i64)>> {
    ["", "-wal", "-shm", ".broken"]
        .iter()
        .map(|s| {
            let p = with_suffix(path, s);
            let m = std::fs::metadata(&p).ok()?;
            Some((std::fs::read(&p).unwrap(), m.mtime(), m.mtime_nsec()))
        })
        .collect()
}

/// A scratch directory for hash files, outside the roots, removed with
/// the test (each run left 513 MB under a fixed /tmp name).
fn scratch(kind: FsKind, case: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("onecopy-robust-{case}-{kind}-"))
        .tempdir_in("/var/tmp")
        .unwrap()
}

/// A small tree with one duplicate group.
fn small_tree(kind: FsKind) -> (onecopy_testfs::LoopFs, PathBuf, Vec<Vec<PathBuf>>) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path().join("tree");
    let groups = dup_groups(&root, 1, 3, 2 * MIB + 77, 91);
    (fs, root, groups)
}

/// Asserts a refused run: exit 2, a one-line message naming `h`, nothing
/// deduped, `h` and its companions exactly as they were.
#[track_caller]
fn assert_refused(r: &Outcome, h: &Path, before: &[Option<(Vec<u8>, i64, i64)>], root: &Path) {
    r.assert_sane();
    assert_eq!(
        r.code(),
        Some(EXIT_USAGE),
        "{}: stderr {:?}",
        r.what,
        r.stderr
    );
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "not one line: {:?}", r.stderr);
    assert!(
        lines[0].contains(h.to_str().unwrap()) && lines[0].contains("not an onecopy catalog"),
        "unclear message: {:?}",
        lines[0]
    );
    assert!(
        fingerprint(h) == before,
        "{} or a companion was modified",
        h.display()
    );
    let _ = root;
}

/// Item 4: `--hashfile` naming a text file (with `-wal`/`-shm` beside it).
fn hashfile_text_file(kind: FsKind) {
    let (_fs, root, groups) = small_tree(kind);
    let scratch_dir = scratch(kind, "text");
    let dir = scratch_dir.path();
    let h = dir.join("some.txt");
    std::fs::write(&h, "my notes\nnot a database\n").unwrap();
    std::fs::write(with_suffix(&h, "-wal"), "wal of someone else").unwrap();
    std::fs::write(with_suffix(&h, "-shm"), "shm of someone else").unwrap();
    let before = fingerprint(&h);
    let sums = checksum_tree(&root);
    let r = dedupe(&[&root], &["--hashfile", h.to_str().unwrap()]);
    assert_refused(&r, &h, &before, &root);
    assert_eq!(checksum_tree(&root), sums);
    assert_unshared("nothing is deduped after a refusal", &groups[0]);
    // `catalog` refuses it the same way (it exited 1, "file is not a
    // database"), for each action.
    for action in [&["stats"][..], &["forget", "/x"]] {
        let mut args: Vec<&OsStr> = vec!["catalog".as_ref(), "--hashfile".as_ref(), h.as_ref()];
        args.extend(action.iter().map(OsStr::new));
        let r = onecopy(&args);
        r.assert_code(EXIT_USAGE);
        assert!(
            r.stderr.contains("is not an onecopy catalog"),
            "{}",
            r.stderr
        );
        assert_eq!(fingerprint(&h), before, "{action:?} changed the file");
    }
}

/// Item 4: `--hashfile` naming another program's SQLite database in WAL
/// mode, held open with uncheckpointed writes (so `-wal` and `-shm` exist).
fn hashfile_foreign_sqlite(kind: FsKind) {
    let (_fs, root, _groups) = small_tree(kind);
    let scratch_dir = scratch(kind, "sqlite");
    let dir = scratch_dir.path();
    let h = dir.join("app.db");
    let db = rusqlite::Connection::open(&h).unwrap();
    db.execute_batch(
        "PRAGMA journal_mode=WAL; PRAGMA wal_autocheckpoint=0;
         CREATE TABLE meta (key TEXT, value TEXT);
         INSERT INTO meta VALUES ('magic', 'someone-else');
         CREATE TABLE files (name TEXT); INSERT INTO files VALUES ('x');",
    )
    .unwrap();
    assert!(with_suffix(&h, "-wal").exists() && with_suffix(&h, "-shm").exists());
    let before = fingerprint(&h);
    let r = dedupe(&[&root], &["--hashfile", h.to_str().unwrap()]);
    assert_refused(&r, &h, &before, &root);
    let n: i64 = db
        .query_row("SELECT count(*) FROM files", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 1);
    drop(db);
    // Closed and checkpointed (no WAL): still refused.
    let before = fingerprint(&h);
    let r = dedupe(&[&root], &["--hashfile", h.to_str().unwrap()]);
    assert_refused(&r, &h, &before, &root);
}

/// Item 4: a real catalog damaged past its header is still set aside as
/// `.broken` and rebuilt (exit 0).
fn hashfile_damaged_catalog(kind: FsKind) {
    let (_fs, root, groups) = small_tree(kind);
    let scratch_dir = scratch(kind, "damaged");
    let dir = scratch_dir.path();
    let h = dir.join("cat.sqlite");
    let hs = h.to_str().unwrap();
    dedupe(&[&root], &["--hashfile", hs]).assert_ok();
    let len = std::fs::metadata(&h).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&h).unwrap();
    f.set_len(len / 2).unwrap();
    drop(f);
    let new_copy = root.join("g0").join("late.bin");
    onecopy_testfs::copy_no_reflink(&groups[0][0], &new_copy).unwrap();
    let r = dedupe(&[&root], &["--hashfile", hs]);
    r.assert_ok();
    assert!(with_suffix(&h, ".broken").exists(), "not set aside");
    assert!(r.stderr.contains("rebuilt"), "no warning: {:?}", r.stderr);
    assert!(same_physical(&groups[0][0], &new_copy));
}

/// Item 6: run as `nobody` over its own files and root's files it may read
/// but not change. Root's files are sources only: never deduped into (their
/// extents stay as they were), no error, exit 0, and the summary counts
/// them and says why. `nobody`'s own copies are shared.
fn read_only_files_are_sources_as_nobody(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    open_up(fs.path().parent().unwrap());
    let base = fs.path().join("home");
    // Group 0: three of nobody's copies and two of root's; group 1: root's only.
    let groups = dup_groups(&base, 2, 3, 2 * MIB + 321, 97);
    give_to_nobody(&base);
    let mut roots_files = vec![
        groups[1][0].clone(),
        groups[1][1].clone(),
        groups[1][2].clone(),
    ];
    for i in 0..2 {
        let p = base.join("g0").join(format!("root{i}.bin"));
        onecopy_testfs::copy_no_reflink(&groups[0][0], &p).unwrap();
        roots_files.push(p);
    }
    for p in &roots_files {
        std::os::unix::fs::chown(p, Some(0), Some(0)).unwrap();
        chmod(p, 0o644);
    }
    let before = layouts(&roots_files);
    let sums = checksum_tree(fs.path());

    // The text summary says how many and why.
    let out = command("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
        .arg(env!("CARGO_BIN_EXE_onecopy"))
        .args(["dedupe", "--dry-run", "--no-catalog"])
        .arg(&base)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "dry run: {out:?}");
    assert!(
        stdout.contains("sources only: 5 files") && stdout.contains("no write permission"),
        "the summary does not explain the read-only files: {stdout}"
    );

    let r = dedupe_as_nobody(&[&base], &[]);
    r.assert_ok();
    assert_eq!(r.u("files_source_only"), 5, "files_source_only");
    assert_eq!(r.ranges_skipped("refused"), 0);
    assert_eq!(checksum_tree(fs.path()), sums, "file contents changed");
    assert_eq!(
        layouts(&roots_files),
        before,
        "root's files were deduped into"
    );
    let mine = &groups[0];
    for p in &mine[1..] {
        assert!(same_physical(&mine[0], p), "{} not shared", p.display());
    }
}

/// The scene of item 6: under `dir`, `d.bin` (created first: the lowest
/// inode, so the canonical copy), `z/a.bin` a byte copy of it and `z/b.bin`
/// a reflink of `a`; and an independent pair `e/1.bin`, `e/2.bin` whose
/// deduping really frees 6 MiB. Returns (d, a, b, e1, e2).
fn honest_scene(dir: &Path) -> [PathBuf; 5] {
    let d = dir.join("d.bin");
    let (a, b) = (dir.join("z/a.bin"), dir.join("z/b.bin"));
    let (e1, e2) = (dir.join("e/1.bin"), dir.join("e/2.bin"));
    mkparent(&a);
    mkparent(&e1);
    onecopy_testfs::write_random(&d, 8 * MIB, 101).unwrap();
    onecopy_testfs::copy_no_reflink(&d, &a).unwrap();
    onecopy_testfs::reflink_copy(&a, &b).unwrap();
    onecopy_testfs::write_random(&e1, 6 * MIB, 102).unwrap();
    onecopy_testfs::copy_no_reflink(&e1, &e2).unwrap();
    [d, a, b, e1, e2]
}

/// Runs onecopy over `root` and checks the report against `df`: the claim
/// is within 1 MiB of what was really freed, which is `want` (±1 MiB).
fn assert_honest(fs: &onecopy_testfs::LoopFs, root: &Path, files: &[PathBuf; 5], want: u64) {
    let [d, a, b, e1, e2] = files;
    let sums = checksum_tree(root);
    let used = fs.used_bytes();
    let r = dedupe(&[root], &["--no-catalog"]);
    r.assert_ok();
    assert_eq!(checksum_tree(root), sums, "file contents changed");
    assert!(
        same_physical(d, a) && same_physical(d, b),
        "precondition: d.bin (lowest inode) was to be the canonical copy"
    );
    assert!(same_physical(e1, e2), "the independent pair was not shared");
    let measured = used as i64 - fs.used_bytes() as i64;
    let claimed = r.u("bytes_freed");
    eprintln!(
        "{}: bytes_freed {claimed} ({:.2} MiB), df freed {measured} ({:.2} MiB), want {:.2} MiB",
        fs.kind(),
        mib(claimed),
        measured as f64 / MIB as f64,
        mib(want)
    );
    assert!(
        claimed.abs_diff(want) <= MIB && (claimed as i64).abs_diff(measured) <= MIB,
        "bytes_freed {claimed} does not match the {measured} bytes df shows freed (expected {want})"
    );
}

fn mib(b: u64) -> f64 {
    b as f64 / MIB as f64
}

/// Item 6: `a` and `b` share an extent with a reflinked copy outside the
/// roots; deduping them onto `d` frees nothing of it, and the report must
/// not claim it. On XFS only the independent pair's 6 MiB is freed.
fn freed_excludes_reflinks_outside_roots(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path().join("tree");
    let files = honest_scene(&root);
    let outside = fs.path().join("outside/c.bin");
    mkparent(&outside);
    onecopy_testfs::reflink_copy(&files[1], &outside).unwrap();
    assert_honest(&fs, &root, &files, 6 * MIB);
    assert!(!same_physical(&files[1], &outside), "c.bin was changed");
}

/// Item 6: a read-only snapshot taken before the run holds every extent of
/// the subvolume: deduping it frees nothing, and the report must say so.
fn freed_excludes_snapshot_extents() {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let vol = fs.path().join("vol");
    btrfs(&["subvolume", "create"], &[&vol]);
    let files = honest_scene(&vol);
    let snap = fs.path().join("snap");
    btrfs(&["subvolume", "snapshot", "-r"], &[&vol, &snap]);
    assert_honest(&fs, &vol, &files, 0);
}

/// A catalog that cannot take the run's records (its disk full) is kept
/// as it was, and the run says so with exit 1: its work would otherwise
/// be lost to every later run without a sign in the exit code. The files
/// are deduped all the same.
fn a_catalog_that_cannot_be_updated_is_an_error(kind: FsKind) {
    let (fs, root, groups) = small_tree(kind);
    for i in 0..2000u64 {
        let p = fs.path().join(format!(
            "many/{:02}/file-with-a-longish-name-{i:06}",
            i % 50
        ));
        mkparent(&p);
        onecopy_testfs::write_random(&p, 5000, 1000 + i).unwrap();
    }
    let sums = checksum_tree(&root);
    // Files changed within the last second are not recorded.
    past_racy_window();
    // 160 KiB free: room for an empty catalog, not for 2,000 records.
    let small = onecopy_testfs::LoopFs::new(FsKind::Tmpfs, 1 << 20).expect("a 1 MiB tmpfs");
    std::fs::write(
        small.path().join("ballast"),
        vec![1u8; (1 << 20) - (160 << 10)],
    )
    .unwrap();
    let h = small.path().join("catalog.sqlite");
    let r = dedupe(&[fs.path()], &["--hashfile", h.to_str().unwrap()]);
    r.assert_code(1);
    assert!(
        r.stderr.contains("cannot update the catalog"),
        "{}",
        r.stderr
    );
    let errors = r.report()["errors"].to_string();
    assert!(errors.contains("catalog.sqlite"), "{errors}");
    assert!(h.exists(), "the catalog is kept");
    assert_eq!(checksum_tree(&root), sums, "file contents changed");
    assert_groups_shared("the group", &groups);
}

/// A root named twice, or below another root, is walked once: each file
/// counted once, none taken for a hard link of itself.
fn repeated_roots_are_walked_once(kind: FsKind) {
    let (_fs, root, groups) = small_tree(kind);
    let sums = checksum_tree(&root);
    let sub = groups[0][0].parent().unwrap().to_path_buf();
    let r = dedupe(&[&root, &root, &sub], &["--no-catalog"]);
    r.assert_ok();
    assert_eq!(r.u("files_scanned"), 3, "{}", r.stdout);
    assert_eq!(
        r.report()["files_skipped"]["hardlink"],
        serde_json::Value::Null,
        "{}",
        r.stdout
    );
    assert_eq!(checksum_tree(&root), sums, "file contents changed");
    assert_groups_shared("the group", &groups);
}

/// A FIFO named as a root, met in the tree or named as `--hashfile` is
/// never waited on: its open blocked for want of a writer, for ever, and
/// a first SIGINT or SIGTERM could not end it (`watch` then hung on its
/// child). Each run here is killed after 120 s, so a regression fails
/// instead of hanging the suite.
fn fifos_are_never_waited_on(kind: FsKind) {
    let (_fs, root, groups) = small_tree(kind);
    let scratch_dir = scratch(kind, "fifo");
    let dir = scratch_dir.path();
    let (inside, named, hashfile) = (
        root.join("fifo"),
        root.with_file_name("root.fifo"),
        dir.join("h.fifo"),
    );
    for f in [&inside, &named, &hashfile] {
        let made = command("mkfifo").arg(f).status().unwrap();
        assert!(made.success(), "mkfifo {}", f.display());
    }
    let sums = checksum_tree(&root);
    let run = |args: &[&OsStr]| {
        let out = command("timeout")
            .args(["-s", "KILL", "120"])
            .arg(env!("CARGO_BIN_EXE_onecopy"))
            .args(args)
            .output()
            .unwrap();
        Outcome::from_output(describe(args), out)
    };
    let (r, n, h) = (root.as_os_str(), named.as_os_str(), hashfile.as_os_str());
    let r1 = run(&["dedupe".as_ref(), "--json".as_ref(), n, r]);
    r1.assert_sane();
    assert_eq!(r1.code(), Some(0), "{}: {:?}", r1.what, r1.stderr);
    let rep: serde_json::Value = serde_json::from_str(&r1.stdout).unwrap();
    assert_eq!(rep["files_skipped"]["not_regular"], 2, "{}", r1.stdout);
    let r2 = run(&["duperemove".as_ref(), "-r".as_ref(), "-d".as_ref(), n, r]);
    assert_eq!(r2.code(), Some(0), "{}: {:?}", r2.what, r2.stderr);
    let r3 = run(&["dedupe".as_ref(), "--hashfile".as_ref(), h, r]);
    assert_eq!(r3.code(), Some(EXIT_USAGE), "{}: {:?}", r3.what, r3.stderr);
    assert_eq!(checksum_tree(&root), sums);
    let _ = groups;
}

/// Two 64 GiB sparse files holding the same 3 MiB of data: the run reads
/// their data, not their holes (it used to read all 128 GiB: a minute
/// per 100 GiB), shares the data, and its memory does not grow with the
/// files' size (their digest lists, 16 Mi blocks each at 4 KiB, go
/// through the scratch file and the catalog in pieces: it used to peak
/// at 1.25 GB per 100 GiB file). The next run knows both from the
/// catalog and reads nothing.
fn huge_sparse_files_are_neither_read_nor_held(kind: FsKind) {
    const SIZE: u64 = 64 << 30;
    let (fs, root, _groups) = small_tree(kind);
    let data: Vec<u8> = (0..MIB as u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let sparse = fs.path().join("sparse");
    std::fs::create_dir(&sparse).unwrap();
    let big = [sparse.join("a"), sparse.join("b")];
    for p in &big {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::create(p).unwrap();
        f.set_len(SIZE).unwrap();
        for at in [0, 40 << 30, SIZE - MIB] {
            f.write_all_at(&data, at).unwrap();
        }
        f.sync_all().unwrap();
    }
    let sums = (
        checksum_tree(&root),
        big.each_ref().map(|p| sparse_digest(p)),
    );
    let scratch_dir = scratch(kind, "sparse");
    let h = scratch_dir.path().join("catalog.sqlite");
    let hashfile = ["--hashfile", h.to_str().unwrap()];
    past_racy_window();

    let (child, what) = spawn_dedupe(&[&root, &sparse], &hashfile);
    let (first, cost) = wait_costed(child, what);
    first.assert_ok();
    eprintln!("{kind}: first run {cost:?}");
    let after = (
        checksum_tree(&root),
        big.each_ref().map(|p| sparse_digest(p)),
    );
    assert_eq!(after, sums, "file contents changed");
    assert!(
        same_physical(&big[0], &big[1]),
        "the sparse copies are not shared"
    );
    // Their digest lists go through the scratch file and the catalog
    // (128 MiB each): a few times that, not the 128 GiB of holes.
    assert!(cost.rchar < 8 << 30, "the holes were read: {cost:?}");
    assert!(
        cost.max_rss < 200 * MIB,
        "memory grew with the files: {cost:?}"
    );
    let deduped = first.u("bytes_deduped");
    assert!(
        deduped < 64 * MIB,
        "{deduped} bytes deduped: holes were shared"
    );

    let trusted = [hashfile[0], hashfile[1], "--recheck-every", "0"];
    let (child, what) = spawn_dedupe(&[&root, &sparse], &trusted);
    let (second, cost) = wait_costed(child, what);
    second.assert_ok();
    eprintln!("{kind}: second run {cost:?}");
    assert_eq!(second.u("files_read"), 0, "{}", second.stdout);
    assert!(second.u("files_known") >= 2, "{}", second.stdout);
    assert!(
        cost.max_rss < 200 * MIB,
        "memory grew with the files: {cost:?}"
    );
    // Holes are not "already shared" bytes (they were: 64 GiB per pair),
    // whether the pair is trusted as settled or looked at again.
    assert!(second.u("ranges_settled") > 0, "{}", second.stdout);
    let looked = [hashfile[0], hashfile[1], "--recheck-every", "1"];
    let (child, what) = spawn_dedupe(&[&root, &sparse], &looked);
    let third = wait_outcome(child, what);
    third.assert_ok();
    for r in [&second, &third] {
        let seen = r.u("bytes_already_shared");
        assert!(
            seen < 64 * MIB,
            "{seen} bytes already shared: holes counted"
        );
    }
    assert!(
        third.u("bytes_already_shared") >= 3 * MIB,
        "{}",
        third.stdout
    );

    // `catalog stats` and `forget` check every list but hold none (one
    // list, 16 Mi blocks, was read whole: 256 MiB).
    let h = h.to_str().unwrap();
    let b = big[1].to_str().unwrap();
    for args in [
        vec!["catalog", "stats", "--json", "--hashfile", h],
        vec!["catalog", "forget", "--hashfile", h, b],
        vec!["catalog", "stats", "--json", "--hashfile", h],
    ] {
        let child = command(env!("CARGO_BIN_EXE_onecopy"))
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (r, cost) = wait_costed(child, args.join(" "));
        assert_eq!(r.code(), Some(0), "{}: {:?}", r.what, r.stderr);
        eprintln!("{kind}: {} {cost:?}: {}", r.what, r.stdout);
        assert!(cost.max_rss < 100 * MIB, "{}: {cost:?}", r.what);
        assert!(!r.stdout.contains("forgot 0"), "{}", r.stdout);
    }
}
