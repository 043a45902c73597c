//! The inline store at scale (issue 11, hostile input), through a real
//! FUSE mount: a directory with very many entries and a very deep tree,
//! each checked against what was created, again after a remount, with
//! fsck clean. Needs root and /dev/fuse.
//!
//! `ONECOPY_SCALE_ENTRIES` sets the directory size (CI: 100,000;
//! `bench/store-scale.sh` runs 1,000,000) and `ONECOPY_SCALE_DEPTH` the
//! tree depth (CI: 10,000). Each phase's time and the mount's peak RSS
//! are printed.

use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Instant;

mod store_common;
use store_common::*;

fn env_count(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Prints how long a phase took and returns its result.
fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    eprintln!("  {what}: {:.1} s", t.elapsed().as_secs_f64());
    r
}

// --- *at system calls on raw descriptors (paths beyond PATH_MAX) ---------

fn c(name: &str) -> CString {
    CString::new(name).unwrap()
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap()
}

fn open_at(dir: RawFd, name: &CStr, flags: i32, mode: u32) -> Result<OwnedFd, i32> {
    // SAFETY: `name` is NUL-terminated; a non-negative result is a new fd we own.
    let fd = unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        return Err(errno());
    }
    // SAFETY: `fd` was just returned by openat and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_dir(dir: RawFd, name: &CStr) -> OwnedFd {
    open_at(dir, name, libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .unwrap_or_else(|e| panic!("openat {name:?}: errno {e}"))
}

fn check(rc: i32, what: impl std::fmt::Debug) {
    assert!(rc == 0, "{what:?}: errno {}", errno());
}

fn stat_at(dir: RawFd, name: &CStr) -> Result<libc::stat, i32> {
    // SAFETY: an all-zero stat is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `name` is NUL-terminated and `st` is a valid out-pointer.
    let rc = unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    if rc == 0 {
        Ok(st)
    } else {
        Err(errno())
    }
}

fn write_fd(fd: &OwnedFd, data: &[u8]) {
    // SAFETY: `data` is a valid buffer of its length.
    let n = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
    assert_eq!(n, data.len() as isize, "write: errno {}", errno());
}

fn read_fd(fd: &OwnedFd) -> Vec<u8> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` is a valid buffer of its length.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n >= 0, "read: errno {}", errno());
    buf.truncate(n as usize);
    buf
}

// --- a directory with very many entries ------------------------------------

/// Entry `i`'s name: mostly short, every 1,000th is 255 bytes long.
fn entry_name(i: u64) -> String {
    let base = format!("e{i:07}");
    if i % 1000 == 7 {
        format!("{base}{}", "x".repeat(255 - base.len()))
    } else {
        base
    }
}

/// What a file in the big directory holds: its own name.
fn entry_content(name: &str) -> Vec<u8> {
    name.as_bytes()[..name.len().min(32)].to_vec()
}

/// Reads the whole directory and checks its names against `want` (sorted).
fn check_listing(dir: &Path, want: &[String], round: &str) {
    let mut got: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(got.len(), want.len(), "{round}: entry count");
    got.sort();
    assert!(got == want, "{round}: names differ");
}

/// Looks up `k` pseudo-random names of `want` (stat: regular file of the
/// right size) and as many absent ones (`ENOENT`).
fn check_lookups(dir: RawFd, want: &[String], k: usize, round: &str) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..k {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let name = &want[(x >> 33) as usize % want.len()];
        let st = stat_at(dir, &c(name)).unwrap_or_else(|e| panic!("{round}: stat {name}: {e}"));
        assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFREG, "{round}: {name}");
        let want_len = entry_content(name.trim_start_matches("moved-")).len();
        assert_eq!(st.st_size as usize, want_len, "{round}: size of {name}");
        let absent = format!("z{}", &name[1..]);
        assert_eq!(
            stat_at(dir, &c(&absent)).err(),
            Some(libc::ENOENT),
            "{round}"
        );
    }
}

/// Opens `k` files spread over `want` and compares their content.
fn check_contents(dir: RawFd, want: &[String], k: usize, round: &str) {
    let step = (want.len() / k.max(1)).max(1);
    for name in want.iter().step_by(step) {
        let fd = open_at(dir, &c(name), libc::O_RDONLY, 0)
            .unwrap_or_else(|e| panic!("{round}: open {name}: {e}"));
        let orig = name.trim_start_matches("moved-");
        assert_eq!(read_fd(&fd), entry_content(orig), "{round}: {name}");
    }
}

/// Creates `n` files in one directory, each holding its name's prefix.
fn create_entries(dir: RawFd, n: u64) {
    for i in 0..n {
        let name = entry_name(i);
        let fd = open_at(
            dir,
            &c(&name),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o644,
        )
        .unwrap_or_else(|e| panic!("create {name}: errno {e}"));
        write_fd(&fd, &entry_content(&name));
    }
}

/// Renames every 100th entry (to `moved-NAME`) and unlinks the next one;
/// returns the sorted names that remain.
fn rename_and_unlink(dir: RawFd, n: u64) -> Vec<String> {
    let mut names = Vec::with_capacity(n as usize);
    for i in 0..n {
        let name = entry_name(i);
        match i % 100 {
            // 255-byte names keep theirs: `moved-` would make them too long.
            1 if name.len() < 200 => {
                let to = format!("moved-{name}");
                // SAFETY: both names are NUL-terminated.
                let rc = unsafe { libc::renameat(dir, c(&name).as_ptr(), dir, c(&to).as_ptr()) };
                check(rc, ("renameat", &name));
                names.push(to);
            }
            2 => {
                // SAFETY: the name is NUL-terminated.
                check(unsafe { libc::unlinkat(dir, c(&name).as_ptr(), 0) }, &name);
            }
            _ => names.push(name),
        }
    }
    names.sort();
    names
}

/// A directory with `ONECOPY_SCALE_ENTRIES` (CI 100,000) entries through
/// the mount: create, list (count and every name), look up present and
/// absent names, rename and unlink 1% each, list again; then after a
/// remount: fsck clean, same listing, lookups and contents, and rmdir of
/// the non-empty directory is `ENOTEMPTY`.
#[test]
fn directory_with_very_many_entries() {
    require_fuse();
    let n = env_count("ONECOPY_SCALE_ENTRIES", 100_000);
    eprintln!("directory of {n} entries");
    let s = scratch(&[]);
    let m = Mount::new(&s);
    let big = s.mnt.join("big");
    std::fs::create_dir(&big).unwrap();
    let d = open_dir(libc::AT_FDCWD, &c(big.to_str().unwrap()));
    timed("create", || create_entries(d.as_raw_fd(), n));
    let mut all: Vec<String> = (0..n).map(entry_name).collect();
    all.sort();
    timed("readdir", || check_listing(&big, &all, "created"));
    timed("lookups", || {
        check_lookups(d.as_raw_fd(), &all, 10_000, "created")
    });
    let left = timed("rename+unlink 2%", || rename_and_unlink(d.as_raw_fd(), n));
    timed("readdir", || check_listing(&big, &left, "renamed"));
    drop(d);
    eprintln!("  mount peak RSS: {} KiB", m.peak_rss_kib());
    timed("unmount", || m.unmount());
    timed("fsck", || fsck_clean(&s.store));
    let m = timed("remount", || Mount::new(&s));
    let d = open_dir(libc::AT_FDCWD, &c(big.to_str().unwrap()));
    timed("readdir (cold)", || check_listing(&big, &left, "remounted"));
    timed("lookups (cold)", || {
        check_lookups(d.as_raw_fd(), &left, 10_000, "remounted")
    });
    timed("contents", || {
        check_contents(d.as_raw_fd(), &left, 2_000, "remounted")
    });
    // SAFETY: the name is NUL-terminated.
    let rc = unsafe {
        libc::unlinkat(
            libc::AT_FDCWD,
            c(big.to_str().unwrap()).as_ptr(),
            libc::AT_REMOVEDIR,
        )
    };
    assert!(
        rc != 0 && errno() == libc::ENOTEMPTY,
        "rmdir of a full directory"
    );
    drop(d);
    eprintln!("  mount peak RSS: {} KiB", m.peak_rss_kib());
    m.unmount();
    let st = stats(&s.store);
    assert_eq!(st["files"].as_u64(), Some(left.len() as u64), "{st}");
}

// --- a very deep tree --------------------------------------------------------

/// Builds `depth` nested directories `d` below `root` with mkdirat/openat
/// (the path is far beyond PATH_MAX) and writes `f` at the bottom.
fn build_deep(root: RawFd, depth: u64) {
    let mut cur = open_dir(root, &c("."));
    for _ in 0..depth {
        // SAFETY: the name is NUL-terminated.
        check(
            unsafe { libc::mkdirat(cur.as_raw_fd(), c("d").as_ptr(), 0o755) },
            "mkdirat",
        );
        cur = open_dir(cur.as_raw_fd(), &c("d"));
    }
    let f = open_at(
        cur.as_raw_fd(),
        &c("f"),
        libc::O_WRONLY | libc::O_CREAT,
        0o644,
    )
    .unwrap();
    write_fd(&f, b"at the bottom");
    // SAFETY: `f` is an open descriptor.
    check(unsafe { libc::fsync(f.as_raw_fd()) }, "fsync");
}

/// Walks down `d` as far as it goes; returns the depth and the bottom dir.
fn walk_down(root: RawFd) -> (u64, OwnedFd) {
    let mut cur = open_dir(root, &c("."));
    let mut depth = 0;
    while let Ok(next) = open_at(
        cur.as_raw_fd(),
        &c("d"),
        libc::O_RDONLY | libc::O_DIRECTORY,
        0,
    ) {
        cur = next;
        depth += 1;
    }
    (depth, cur)
}

/// Removes the tree from its bottom `cur` up, through `..`.
fn remove_deep(mut cur: OwnedFd, depth: u64) {
    // SAFETY: the name is NUL-terminated.
    check(
        unsafe { libc::unlinkat(cur.as_raw_fd(), c("f").as_ptr(), 0) },
        "unlink f",
    );
    for _ in 0..depth {
        let up = open_dir(cur.as_raw_fd(), &c(".."));
        drop(cur);
        // SAFETY: the name is NUL-terminated.
        let rc = unsafe { libc::unlinkat(up.as_raw_fd(), c("d").as_ptr(), libc::AT_REMOVEDIR) };
        check(rc, "rmdir d");
        cur = up;
    }
}

/// A tree `ONECOPY_SCALE_DEPTH` (CI 10,000) levels deep built with
/// *at calls through the mount, a file at the bottom fsync'd; after a
/// remount: fsck clean, the walk finds exactly that depth and the file's
/// bytes, rmdir of the top is `ENOTEMPTY`; then the tree is removed
/// bottom-up and the store holds no file or directory but the root.
#[test]
fn tree_ten_thousand_levels_deep() {
    require_fuse();
    let depth = env_count("ONECOPY_SCALE_DEPTH", 10_000);
    eprintln!("tree of {depth} levels");
    let s = scratch(&[]);
    let m = Mount::new(&s);
    let root = open_dir(libc::AT_FDCWD, &c(s.mnt.to_str().unwrap()));
    timed("build", || build_deep(root.as_raw_fd(), depth));
    drop(root);
    timed("unmount", || m.unmount());
    timed("fsck", || fsck_clean(&s.store));
    let m = timed("remount", || Mount::new(&s));
    let root = open_dir(libc::AT_FDCWD, &c(s.mnt.to_str().unwrap()));
    let (got, bottom) = timed("walk", || walk_down(root.as_raw_fd()));
    assert_eq!(got, depth, "depth after remount");
    let f = open_at(bottom.as_raw_fd(), &c("f"), libc::O_RDONLY, 0).unwrap();
    assert_eq!(read_fd(&f), b"at the bottom");
    drop(f);
    // SAFETY: the name is NUL-terminated.
    let rc = unsafe { libc::unlinkat(root.as_raw_fd(), c("d").as_ptr(), libc::AT_REMOVEDIR) };
    assert!(
        rc != 0 && errno() == libc::ENOTEMPTY,
        "rmdir of the non-empty top"
    );
    timed("remove", || remove_deep(bottom, depth));
    assert_eq!(stat_at(root.as_raw_fd(), &c("d")).err(), Some(libc::ENOENT));
    drop(root);
    eprintln!("  mount peak RSS: {} KiB", m.peak_rss_kib());
    m.unmount();
    fsck_clean(&s.store);
    let st = stats(&s.store);
    assert_eq!(st["files"].as_u64(), Some(0), "{st}");
    assert_eq!(st["directories"].as_u64(), Some(1), "{st}");
}
