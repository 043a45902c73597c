//! The progress display as a user sees it: `onecopy dedupe` runs in a real
//! terminal (a detached tmux session, 120x40), the screen is captured with
//! `tmux capture-pane` while it runs and after it exits.
//!
//! Asserts that the "reading" bar's byte counter advances with the bytes
//! read (never `0 B` once files have been read), and that no bar line is
//! left on screen under the final summary.

mod common;

use std::os::fd::AsFd;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use onecopy_testfs::{copy_no_reflink, write_random, FsKind};

const SESSION_COLS: &str = "120";
const SESSION_ROWS: &str = "40";
const DONE_MARK: &str = "ONECOPY-EXIT=";

fn tmux(args: &[&str]) -> String {
    let out = Command::new("tmux")
        .args(args)
        .output()
        .expect("tmux must be installed (scripts/test.sh installs it)");
    assert!(
        out.status.success(),
        "tmux {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Kills the tmux session when the test ends, passed or not.
struct Session(String);

impl Drop for Session {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .status();
    }
}

/// Evicts a file's pages so that the run reads from the device.
fn evict(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        let _ = onecopy_ioctl::fs::fadvise(f.as_fd(), onecopy_ioctl::fs::Advice::DontNeed);
    }
}

/// The "reading:" line of a frame: (bytes shown, files shown).
fn reading_line(frame: &str) -> Option<(String, u64)> {
    let line = frame.lines().find(|l| l.starts_with("reading: ["))?;
    let after = line.split_once("] ")?.1;
    let bytes = after.split('/').next()?.trim().to_string();
    let files = after
        .trim_end()
        .strip_suffix(" files")?
        .rsplit(' ')
        .next()?
        .parse()
        .ok()?;
    Some((bytes, files))
}

#[test]
fn progress_in_a_real_terminal() {
    let fs = new_fs(FsKind::Btrfs, 3 << 30);
    let dir = fs.path().join("tree");
    std::fs::create_dir(&dir).unwrap();
    for i in 0..16u64 {
        let a = dir.join(format!("orig{i}"));
        write_random(&a, 48 * MIB, 100 + i).unwrap();
        copy_no_reflink(&a, &dir.join(format!("copy{i}"))).unwrap();
    }
    fs.sync();
    for e in std::fs::read_dir(&dir).unwrap() {
        evict(&e.unwrap().path());
    }
    if let Some(img) = fs.image() {
        evict(img);
    }

    let name = format!("onecopy-progress-{}", std::process::id());
    let cmd = format!(
        "{} dedupe --no-catalog -j 2 {}; echo {DONE_MARK}$?; sleep 600",
        env!("CARGO_BIN_EXE_onecopy"),
        dir.display()
    );
    tmux(&[
        "new-session",
        "-d",
        "-s",
        &name,
        "-x",
        SESSION_COLS,
        "-y",
        SESSION_ROWS,
        &cmd,
    ]);
    let _session = Session(name.clone());

    let start = Instant::now();
    let mut frames = Vec::new();
    let last = loop {
        let f = tmux(&["capture-pane", "-p", "-t", &name]);
        if f.contains(DONE_MARK) {
            break f;
        }
        frames.push(f);
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "run did not end"
        );
        std::thread::sleep(Duration::from_millis(40));
    };

    let reading: Vec<(String, u64)> = frames.iter().filter_map(|f| reading_line(f)).collect();
    let mid: Vec<&String> = frames
        .iter()
        .filter(|f| reading_line(f).is_some())
        .collect();
    eprintln!(
        "{} frames, {} showing the reading bar; mid-run:\n{}\nthe end:\n{}",
        frames.len(),
        reading.len(),
        mid.get(mid.len() / 2)
            .map(|f| f.trim_end())
            .unwrap_or("(none)"),
        last.trim_end()
    );
    assert!(!reading.is_empty(), "no frame showed the reading bar");
    for (bytes, files) in &reading {
        assert!(
            *files == 0 || bytes != "0 B",
            "reading bar at 0 B after {files} files"
        );
    }
    assert!(
        reading.iter().any(|(b, _)| b != "0 B"),
        "the reading bar never advanced: {reading:?}"
    );
    let mut shown: Vec<&str> = reading.iter().map(|(b, _)| b.as_str()).collect();
    shown.dedup();
    assert!(
        shown.len() >= 3,
        "the byte counter should move during the read: {shown:?}"
    );

    assert!(
        last.contains(&format!("{DONE_MARK}0")),
        "exit status: {last}"
    );
    assert!(last.contains("Scanned 32 files"), "no summary: {last}");
    for stale in ["walking:", "reading:", "sharing:", "planning:"] {
        assert!(
            !last.contains(stale),
            "stale progress line {stale:?} left on screen:\n{last}"
        );
    }
}
