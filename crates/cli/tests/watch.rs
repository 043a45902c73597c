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
    let fs = new_fs(FsKind::Btrfs, 1 << 30);
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
        // Deduping must not wake the watcher up: once the catch-up pass
        // and the sharing pass are logged, no pass follows.
        w.wait_log(" file(s), shared ", 2);
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
    fs.sync();
    assert!(
        is_fully_shared(&orig, &later),
        "not caught up after a restart"
    );
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
