//! `onecopy watch`: the real binary runs against a loop btrfs while files
//! are written; the copies must be shared (FIEMAP) within a bound, their
//! contents unchanged, and SIGTERM must end it with exit code 0. Prints
//! the measured latency from the last write to sharing.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use onecopy_testfs::{checksum_file, copy_no_reflink, is_fully_shared, write_random, FsKind};

/// A deadline the watcher must meet; the measured figure is printed.
const BOUND: Duration = Duration::from_secs(30);

struct Watch {
    child: Child,
    log: PathBuf,
}

impl Watch {
    fn start(root: &Path, scratch: &Path, extra: &[&str]) -> Watch {
        let log = scratch.join("watch.log");
        let child = Command::new(env!("CARGO_BIN_EXE_onecopy"))
            .env("ONECOPY_CACHE_DIR", scratch.join("cache"))
            .arg("watch")
            .args(["--settle", "1"])
            .args(extra)
            .arg(root)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let w = Watch { child, log };
        // The first pass (catching up through the catalog) ends first.
        w.wait_log(" file(s), shared ", 1);
        w
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_log(&self, what: &str, times: usize) {
        let t = Instant::now();
        while self.log().matches(what).count() < times {
            assert!(
                t.elapsed() < BOUND,
                "no {what:?} in the log: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, then the exit code (it must come within 10 s).
    fn term(mut self) -> i32 {
        let pid = rustix::process::Pid::from_child(&self.child);
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code().unwrap_or(-1);
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "no exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes copies of `orig` while the watcher runs; returns the latency
/// from the end of the last write to all copies shared.
fn copies_get_shared(fs: &onecopy_testfs::LoopFs, root: &Path, orig: &Path) -> Duration {
    let copies: Vec<PathBuf> = (0..3).map(|i| root.join(format!("new/copy{i}"))).collect();
    std::fs::create_dir_all(root.join("new")).unwrap();
    for c in &copies {
        copy_no_reflink(orig, c).unwrap();
    }
    let written = Instant::now();
    loop {
        fs.sync();
        if copies.iter().all(|c| is_fully_shared(orig, c)) {
            return written.elapsed();
        }
        assert!(
            written.elapsed() < BOUND,
            "copies not shared within {BOUND:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn watch_mode(extra: &[&str]) {
    watch_mode_on(FsKind::Btrfs, extra)
}

fn watch_mode_on(kind: FsKind, extra: &[&str]) {
    let fs = new_fs(kind, 1 << 30);
    let scratch = tempfile::tempdir().unwrap();
    let root = fs.path().join("w");
    std::fs::create_dir(&root).unwrap();
    let orig = root.join("orig");
    write_random(&orig, 8 * MIB + 5, 42).unwrap();
    fs.sync();
    let w = Watch::start(&root, scratch.path(), extra);
    let latency = copies_get_shared(&fs, &root, &orig);
    eprintln!("watch {extra:?}: copies shared {latency:.2?} after the last write");
    // The files themselves (a pass may have its re-homing directory in
    // the tree at this moment, so the tree is not walked here).
    let want = checksum_file(&orig).unwrap();
    for i in 0..3 {
        let c = root.join(format!("new/copy{i}"));
        assert_eq!(checksum_file(&c).unwrap(), want, "{} changed", c.display());
    }
    if extra.is_empty() {
        // Deduping must not wake the watcher up: once the sharing pass is
        // logged and a file read too soon after its last change
        // (catalog's racy margin, about 1 s) has been read again, no pass
        // follows.
        w.wait_log(" file(s), shared ", 2);
        std::thread::sleep(Duration::from_millis(2500));
        let passes = w.log().matches(" file(s), shared ").count();
        std::thread::sleep(Duration::from_secs(3));
        assert_eq!(
            w.log().matches(" file(s), shared ").count(),
            passes,
            "{}",
            w.log()
        );
    }
    let log = w.log();
    assert_eq!(w.term(), 0, "exit code after SIGTERM; log:\n{log}");
    eprintln!("{log}");

    // Written while stopped: the first pass after a restart shares it.
    let later = root.join("later");
    copy_no_reflink(&orig, &later).unwrap();
    let w = Watch::start(&root, scratch.path(), extra);
    wait_shared(&fs, &orig, std::slice::from_ref(&later), &w);
    eprintln!("after the restart:\n{}", w.log());
    assert_eq!(w.term(), 0);
    // SIGTERM ended every pass cleanly: nothing of onecopy's is left.
    let names: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().all(|n| !n.starts_with(".onecopy-tmp")),
        "{names:?}"
    );
}

/// A look over an unchanged btrfs is one ioctl, not a walk.
#[test]
fn periodic_look_over_an_unchanged_btrfs_does_not_walk() {
    let fs = new_fs(FsKind::Btrfs, 1 << 30);
    let scratch = tempfile::tempdir().unwrap();
    let root = fs.path().join("w");
    std::fs::create_dir(&root).unwrap();
    write_random(&root.join("unique"), 4 * MIB, 9).unwrap();
    fs.sync();
    let w = Watch::start(&root, scratch.path(), &["--poll", "--interval", "1"]);
    w.wait_log("no walk", 2);
    let log = w.log();
    assert_eq!(w.term(), 0);
    eprintln!("{log}");
}

#[test]
fn btrfs_generation_moves_only_with_changes() {
    use std::os::fd::AsFd;
    let fs = new_fs(FsKind::Btrfs, 1 << 30);
    let gen = || {
        let f = std::fs::File::open(fs.path()).unwrap();
        onecopy_ioctl::btrfs::fs_generation(f.as_fd()).unwrap()
    };
    fs.sync();
    let g0 = gen();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(gen(), g0, "generation moved on an idle filesystem");
    write_random(&fs.path().join("f"), MIB, 1).unwrap();
    fs.sync();
    assert!(gen() > g0, "generation did not move after a write and sync");
}

#[test]
fn fanotify_mode() {
    watch_mode(&[]);
}

#[test]
fn periodic_mode() {
    watch_mode(&["--poll", "--interval", "1"]);
}

#[test]
fn fanotify_mode_xfs() {
    watch_mode_on(FsKind::Xfs, &[]);
}

#[test]
fn periodic_mode_xfs() {
    watch_mode_on(FsKind::Xfs, &["--poll", "--interval", "1"]);
}

/// Files written elsewhere on the filesystem, then renamed (a file) or
/// moved (a directory holding one) into the watched tree, with no write
/// after: fanotify with names reports the rename, so they are shared
/// within the bound without any walk.
fn renamed_into_the_tree(kind: FsKind) {
    let fs = new_fs(kind, 1 << 30);
    let scratch = tempfile::tempdir().unwrap();
    let root = fs.path().join("w");
    let outside = fs.path().join("outside");
    std::fs::create_dir_all(outside.join("d")).unwrap();
    std::fs::create_dir(&root).unwrap();
    let orig = root.join("orig");
    write_random(&orig, 4 * MIB + 3, 7).unwrap();
    copy_no_reflink(&orig, &outside.join("f")).unwrap();
    copy_no_reflink(&orig, &outside.join("d/g")).unwrap();
    fs.sync();
    let w = Watch::start(&root, scratch.path(), &["--interval", "100000"]);
    assert!(
        w.log().contains("fanotify (writes, creations, renames)"),
        "{}",
        w.log()
    );
    std::fs::rename(outside.join("f"), root.join("f")).unwrap();
    std::fs::rename(outside.join("d"), root.join("d")).unwrap();
    let moved = Instant::now();
    let want = checksum_file(&orig).unwrap();
    let targets = [root.join("f"), root.join("d/g")];
    loop {
        fs.sync();
        if targets.iter().all(|t| is_fully_shared(&orig, t)) {
            break;
        }
        assert!(
            moved.elapsed() < BOUND,
            "renamed files not shared within {BOUND:?}: {}",
            w.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "{kind:?}: renamed files shared {:.2?} after the rename",
        moved.elapsed()
    );
    for t in &targets {
        assert_eq!(checksum_file(t).unwrap(), want, "{} changed", t.display());
    }
    let log = w.log();
    assert_eq!(w.term(), 0, "{log}");
    eprintln!("{log}");
}

#[test]
fn renamed_into_the_tree_btrfs() {
    renamed_into_the_tree(FsKind::Btrfs);
}

#[test]
fn renamed_into_the_tree_xfs() {
    renamed_into_the_tree(FsKind::Xfs);
}

/// A periodic look over a slightly changed btrfs names the changed files by
/// tree search: of many files, only the 3 new ones are scanned and read,
/// and they are shared, contents unchanged.
#[test]
fn periodic_look_reads_only_the_files_a_tree_search_names() {
    let fs = new_fs(FsKind::Btrfs, 1 << 30);
    let scratch = tempfile::tempdir().unwrap();
    let root = fs.path().join("w");
    std::fs::create_dir_all(root.join("many")).unwrap();
    for i in 0..200 {
        write_random(&root.join(format!("many/{i}")), 64 * 1024, 1000 + i).unwrap();
    }
    let orig = root.join("orig");
    write_random(&orig, 2 * MIB, 5).unwrap();
    fs.sync();
    // Past the catalog's racy margin, so the first walk records every file
    // for good (a racy one would be read again by later passes).
    std::thread::sleep(Duration::from_millis(1500));
    let w = Watch::start(&root, scratch.path(), &["--poll", "--interval", "1"]);
    // Wait until a look finds nothing and is the last thing logged: every
    // pass from here on is the copies'.
    let t = Instant::now();
    let mark = loop {
        let log = w.log();
        if log.trim_end().ends_with(": no walk") {
            break log.len();
        }
        assert!(t.elapsed() < BOUND, "never idle: {log}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let copies: Vec<PathBuf> = (0..3).map(|i| root.join(format!("many/c{i}"))).collect();
    for c in &copies {
        copy_no_reflink(&orig, c).unwrap();
    }
    fs.sync();
    w.wait_log("btrfs tree search since generation", 1);
    let t = Instant::now();
    while !copies.iter().all(|c| is_fully_shared(&orig, c)) {
        assert!(t.elapsed() < BOUND, "not shared: {}", w.log());
        std::thread::sleep(Duration::from_millis(100));
        fs.sync();
    }
    // The passes since the copies were given the searched files, not the
    // tree: each scanned a handful (copies, and at most a few inodes whose
    // atime the previous pass moved) where a walk scans 204, and together
    // they read the 3 copies. A btrfs commit can fall between two copies,
    // so they may be split over consecutive passes; a copy caught half
    // written is read once more when it settles.
    let t = Instant::now();
    let (passes, log) = loop {
        let log = w.log();
        let passes: Vec<(u64, u64)> = log[mark..]
            .lines()
            .filter(|l| l.contains(" changed file(s), first "))
            .map(|l| (count_after(l, "scanned "), count_after(l, "read ")))
            .collect();
        if passes.iter().map(|p| p.1).sum::<u64>() >= 3 {
            break (passes, log);
        }
        assert!(t.elapsed() < BOUND, "copies not read: {log}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let read: u64 = passes.iter().map(|p| p.1).sum();
    assert!((3..=6).contains(&read), "{log}");
    assert!(passes.iter().all(|p| p.0 < 10), "{log}");
    assert!(!log[mark..].contains("look over every path"), "{log}");
    assert!(log.contains("btrfs tree search since generation"), "{log}");
    let want = checksum_file(&orig).unwrap();
    for c in &copies {
        assert_eq!(checksum_file(c).unwrap(), want);
    }
    assert_eq!(w.term(), 0);
    eprintln!("{log}");
}

/// The number after `what` in a pass line, e.g. `count_after(l, "read ")`.
fn count_after(line: &str, what: &str) -> u64 {
    line.split(what)
        .nth(1)
        .and_then(|r| r.split([',', ' ']).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {what:?} count in {line}"))
}

/// `--idle`: the watcher and its passes run in the idle I/O class at nice
/// 19; `--max-load` below the current load holds the first pass back.
#[test]
fn idle_priority_and_load_limit() {
    let fs = new_fs(FsKind::Btrfs, 1 << 30);
    let scratch = tempfile::tempdir().unwrap();
    let root = fs.path().join("w");
    std::fs::create_dir(&root).unwrap();
    write_random(&root.join("f"), MIB, 3).unwrap();
    let w = Watch::start(&root, scratch.path(), &["--idle"]);
    let pid = w.child.id();
    assert_eq!(
        onecopy_ioctl::process::io_class(pid).unwrap(),
        onecopy_ioctl::process::IoClass::Idle
    );
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_comm = stat.rsplit(')').next().unwrap();
    let nice: i32 = after_comm
        .split_whitespace()
        .nth(16)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(nice, 19, "{stat}");
    assert_eq!(w.term(), 0);

    // A load limit no machine meets while this test runs (it spins).
    let spin = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let s2 = spin.clone();
    let spinner =
        std::thread::spawn(move || while s2.load(std::sync::atomic::Ordering::Relaxed) {});
    std::thread::sleep(Duration::from_secs(2));
    let log = scratch.path().join("held.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_onecopy"))
        .env("ONECOPY_CACHE_DIR", scratch.path().join("cache"))
        .args(["watch", "--settle", "0", "--max-load", "0.001"])
        .arg(&root)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    spin.store(false, std::sync::atomic::Ordering::Relaxed);
    spinner.join().unwrap();
    assert!(text.contains("holding the batch"), "{text}");
    assert!(!text.contains(" file(s), shared "), "{text}");
}

/// The catalog inside the watched tree: the pass that writes it must not
/// start another pass (fanotify with names sees every close-write there).
#[test]
fn own_catalog_in_the_tree_does_not_wake_it() {
    let fs = new_fs(FsKind::Btrfs, 1 << 30);
    let root = fs.path().join("w");
    std::fs::create_dir(&root).unwrap();
    write_random(&root.join("f"), MIB, 4).unwrap();
    let cache = root.join("cache");
    std::fs::create_dir(&cache).unwrap();
    // Watch::start puts the catalog in scratch/cache: scratch = root.
    let w = Watch::start(&root, &root, &[]);
    w.wait_log(" file(s), shared ", 1);
    assert!(
        cache.read_dir().unwrap().next().is_some(),
        "no catalog written"
    );
    // Any racy re-read comes within ~2 s; then nothing more.
    std::thread::sleep(Duration::from_millis(2500));
    let passes = w.log().matches(" file(s), shared ").count();
    std::thread::sleep(Duration::from_secs(4));
    let log = w.log();
    assert_eq!(log.matches(" file(s), shared ").count(), passes, "{log}");
    assert_eq!(w.term(), 0);
}

/// A restart over an unchanged btrfs searches from the generation the last
/// run saved: no pass, no walk. A file written while stopped is then found
/// by the search and shared, read alone.
#[test]
fn a_restart_over_an_unchanged_btrfs_does_not_walk() {
    let fs = new_fs(FsKind::Btrfs, 1 << 30);
    let scratch = tempfile::tempdir().unwrap();
    let root = fs.path().join("w");
    std::fs::create_dir(&root).unwrap();
    let orig = root.join("orig");
    write_random(&orig, 2 * MIB, 11).unwrap();
    for i in 0..50 {
        write_random(&root.join(format!("u{i}")), 64 * 1024, 100 + i).unwrap();
    }
    fs.sync();
    // Past the racy margin and the search's 2 s ctime slack.
    std::thread::sleep(Duration::from_millis(3200));
    let w = Watch::start(&root, scratch.path(), &[]);
    std::thread::sleep(Duration::from_millis(2500)); // any re-read done
    assert_eq!(w.term(), 0);
    fs.sync();

    let log = scratch.path().join("again.log");
    let start = || {
        Command::new(env!("CARGO_BIN_EXE_onecopy"))
            .env("ONECOPY_CACHE_DIR", scratch.path().join("cache"))
            .args(["watch", "--settle", "1"])
            .arg(&root)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap()
    };
    let stop = |mut c: Child| {
        let pid = rustix::process::Pid::from_child(&c);
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
        assert!(c.wait().unwrap().success());
        std::fs::read_to_string(&log).unwrap()
    };
    let c = start();
    std::thread::sleep(Duration::from_secs(3));
    let text = stop(c);
    assert!(text.contains(": no walk"), "{text}");
    assert!(!text.contains(" file(s), shared "), "{text}");

    let later = root.join("later");
    copy_no_reflink(&orig, &later).unwrap();
    fs.sync();
    std::thread::sleep(Duration::from_millis(1200));
    let c = start();
    let t = Instant::now();
    while !is_fully_shared(&orig, &later) {
        assert!(
            t.elapsed() < BOUND,
            "{}",
            std::fs::read_to_string(&log).unwrap()
        );
        std::thread::sleep(Duration::from_millis(100));
        fs.sync();
    }
    std::thread::sleep(Duration::from_millis(300));
    let text = stop(c);
    assert!(
        text.contains("btrfs tree search since generation"),
        "{text}"
    );
    assert!(!text.contains("look over every path"), "{text}");
    assert_eq!(
        checksum_file(&later).unwrap(),
        checksum_file(&orig).unwrap()
    );
    eprintln!("{text}");
}

/// PATHs that cannot be watched end `watch` at once with `dedupe`'s exit
/// codes: 2 for one that is not there (it was 4), 3 for one on a
/// filesystem that cannot share extents (it said so, then waited for
/// ever). Each run is killed after 60 s, so a regression fails.
#[test]
fn watch_refuses_what_it_cannot_watch() {
    let scratch = tempfile::tempdir().unwrap();
    let tmpfs = onecopy_testfs::LoopFs::new(FsKind::Tmpfs, 16 << 20).unwrap();
    let run = |path: &Path| {
        let out = Command::new("timeout")
            .args(["-s", "KILL", "60"])
            .arg(env!("CARGO_BIN_EXE_onecopy"))
            .args(["watch", "--settle", "1"])
            .arg(path)
            .env("ONECOPY_CACHE_DIR", scratch.path())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&scratch.path().join("not-there"));
    assert_eq!(code, Some(2), "{err}");
    let (code, err) = run(tmpfs.path());
    assert_eq!(code, Some(3), "{err}");
    assert!(err.contains("can not share extents"), "{err}");
}

/// Waits until `orig` and every copy are shared, or fails after [`BOUND`].
fn wait_shared(fs: &onecopy_testfs::LoopFs, orig: &Path, copies: &[PathBuf], w: &Watch) {
    let t = Instant::now();
    loop {
        fs.sync();
        if copies.iter().all(|c| is_fully_shared(orig, c)) {
            return;
        }
        assert!(
            t.elapsed() < BOUND,
            "{copies:?} not shared within {BOUND:?}: {}",
            w.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether process `pid` has a child now (the watcher's pass).
fn has_child(pid: u32) -> bool {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks.flatten().any(|t| {
        std::fs::read_to_string(t.path().join("children")).is_ok_and(|c| !c.trim().is_empty())
    })
}

/// What a user can put in a watched tree, in a batch with a new copy:
/// - a symbolic link to a directory outside it, renamed in: the pass
///   followed it and deduped what it points at (as root);
/// - a unix socket renamed in: the pass refused every root (exit 2),
///   the batch's copy was never shared, and watch said the pass went
///   well;
/// - files made while a pass runs (fanotify merges each one's creation
///   and close_write into one event, which was dropped: never shared);
/// - a catalog damaged into another file: each pass fails, and says so;
/// - the root renamed away: watch stops with exit 2 (it went silent).
fn hostile_entries(kind: FsKind) {
    let fs = new_fs(kind, 1 << 30);
    let scratch = tempfile::tempdir().unwrap();
    let root = fs.path().join("w");
    let outside = fs.path().join("outside");
    std::fs::create_dir_all(outside.join("dir")).unwrap();
    std::fs::create_dir(&root).unwrap();
    let orig = root.join("orig");
    write_random(&orig, MIB, 11).unwrap();
    let inner = outside.join("dir/inner");
    copy_no_reflink(&orig, &inner).unwrap();
    fs.sync();
    let hashfile = scratch.path().join("catalog.sqlite");
    let h = hashfile.to_str().unwrap();
    let w = Watch::start(
        &root,
        scratch.path(),
        &["--interval", "100000", "--hashfile", h],
    );

    std::os::unix::fs::symlink(outside.join("dir"), outside.join("l")).unwrap();
    std::fs::rename(outside.join("l"), root.join("link")).unwrap();
    let copy1 = root.join("copy1");
    copy_no_reflink(&orig, &copy1).unwrap();
    wait_shared(&fs, &orig, &[copy1], &w);
    let sock = std::os::unix::net::UnixListener::bind(outside.join("sock")).unwrap();
    std::fs::rename(outside.join("sock"), root.join("sock")).unwrap();
    let copy2 = root.join("copy2");
    copy_no_reflink(&orig, &copy2).unwrap();
    wait_shared(&fs, &orig, &[copy2], &w);
    drop(sock);

    // Copies made while a pass reads a large new file.
    let big = root.join("big");
    write_random(&big, 256 * MIB, 12).unwrap();
    fs.sync();
    let t = Instant::now();
    while !has_child(w.child.id()) {
        assert!(t.elapsed() < BOUND, "no pass: {}", w.log());
        std::thread::sleep(Duration::from_millis(1));
    }
    let during: Vec<PathBuf> = (0..3).map(|i| root.join(format!("during{i}"))).collect();
    for c in &during {
        copy_no_reflink(&orig, c).unwrap();
    }
    let made_during = has_child(w.child.id());
    wait_shared(&fs, &orig, &during, &w);
    eprintln!("{kind}: copies made during a pass: {made_during}");
    fs.sync();
    assert!(
        !is_fully_shared(&orig, &inner),
        "a file outside the watched tree was deduped through a link: {}",
        w.log()
    );

    std::fs::write(&hashfile, "my notes, not a catalog\n").unwrap();
    copy_no_reflink(&orig, &root.join("copy3")).unwrap();
    w.wait_log("the pass failed", 1);
    let moved = fs.path().join("w-renamed");
    std::fs::rename(&root, &moved).unwrap();
    let log = w.log();
    let mut w = w;
    let t = Instant::now();
    let code = loop {
        if let Some(s) = w.child.try_wait().unwrap() {
            break s.code();
        }
        assert!(t.elapsed() < BOUND, "still running: {}", w.log());
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = format!("{log}{}", &w.log()[log.len()..]);
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("gone (removed, renamed or unmounted)"),
        "{log}"
    );
    eprintln!("{log}");
}

#[test]
fn hostile_entries_btrfs() {
    hostile_entries(FsKind::Btrfs);
}

#[test]
fn hostile_entries_xfs() {
    hostile_entries(FsKind::Xfs);
}
