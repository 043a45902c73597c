//! Helpers of the adversarial suite: running the real binary (also as an
//! unprivileged user and as a child to be signalled), reading its `--json`
//! report, building duplicate trees, guards that undo hostile set-ups
//! (mounts, swap, inode flags, holder processes) even when a test fails,
//! and fd-relative helpers for trees deeper than `PATH_MAX`.
//!
//! Everything talks to the running kernel; nothing is mocked.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::hash::{DefaultHasher, Hasher};
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::Duration;

use onecopy_testfs::{copy_no_reflink, write_random};
use serde_json::Value;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Exit codes documented in the README.
pub const EXIT_OK: i32 = 0;
pub const EXIT_PARTIAL: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_UNSUPPORTED: i32 = 3;
pub const EXIT_INTERRUPTED: i32 = 130;

// The per-filesystem test macro (`per_fs!`) and `new_fs` are shared with
// the other integration tests (tests/common).
pub use crate::common::new_fs;

/// What one run of the binary did.
#[derive(Debug)]
pub struct Outcome {
    pub what: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub json: Option<Value>,
}

impl Outcome {
    pub fn from_output(what: String, out: Output) -> Outcome {
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let json = serde_json::from_str::<Value>(stdout.trim()).ok();
        Outcome {
            what,
            status: out.status,
            stdout,
            stderr,
            json,
        }
    }

    /// The exit code (`None` when a signal ended the process).
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// The JSON report; panics (showing the run) if there is none.
    pub fn report(&self) -> &Value {
        self.json.as_ref().unwrap_or_else(|| {
            panic!(
                "{}: no JSON report ({}); stdout {:?}; stderr {:?}",
                self.what, self.status, self.stdout, self.stderr
            )
        })
    }

    /// An unsigned top-level field of the report.
    pub fn u(&self, field: &str) -> u64 {
        let v = &self.report()[field];
        v.as_u64().unwrap_or_else(|| {
            panic!(
                "{}: report field {field:?} is not an unsigned number: {v}",
                self.what
            )
        })
    }

    fn map_entry(&self, map: &str, key: &str) -> u64 {
        let m = &self.report()[map];
        assert!(m.is_object(), "{}: {map} is not an object: {m}", self.what);
        m.get(key).map_or(0, |v| v.as_u64().unwrap_or(0))
    }

    /// `files_skipped.<reason>` (0 when absent).
    pub fn files_skipped(&self, reason: &str) -> u64 {
        self.map_entry("files_skipped", reason)
    }

    /// `ranges_skipped.<reason>` (0 when absent).
    pub fn ranges_skipped(&self, reason: &str) -> u64 {
        self.map_entry("ranges_skipped", reason)
    }

    /// The `errors` of the report as `(path, error)`.
    pub fn errors(&self) -> Vec<(String, String)> {
        self.report()["errors"]
            .as_array()
            .unwrap_or_else(|| panic!("{}: report field errors is not an array", self.what))
            .iter()
            .map(|e| {
                (
                    e["path"].as_str().unwrap_or_default().to_string(),
                    e["error"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect()
    }

    /// What every run must satisfy, whatever the hostile condition: no
    /// panic, no death by a signal it was not sent, a documented exit code,
    /// and (when there is a report) a report consistent with the exit code.
    #[track_caller]
    pub fn assert_sane(&self) {
        for bad in ["panicked", "RUST_BACKTRACE", "stack overflow", "overflowed"] {
            assert!(
                !self.stderr.contains(bad),
                "{}: stderr contains {bad:?}: {}",
                self.what,
                self.stderr
            );
        }
        let code = self.code().unwrap_or_else(|| {
            panic!(
                "{}: ended by signal {:?}; stderr {:?}",
                self.what,
                self.status.signal(),
                self.stderr
            )
        });
        assert!(
            [
                EXIT_OK,
                EXIT_PARTIAL,
                EXIT_USAGE,
                EXIT_UNSUPPORTED,
                EXIT_INTERRUPTED
            ]
            .contains(&code),
            "{}: undocumented exit code {code}; stderr {:?}",
            self.what,
            self.stderr
        );
        if let Some(j) = &self.json {
            assert_eq!(
                j["exit_code"].as_i64(),
                Some(code as i64),
                "{}: report exit_code differs from the process's",
                self.what
            );
            let errors = self.errors();
            if code == EXIT_OK {
                assert!(
                    errors.is_empty(),
                    "{}: exit 0 with errors {errors:?}",
                    self.what
                );
            }
            if code == EXIT_PARTIAL {
                assert!(
                    !errors.is_empty(),
                    "{}: exit 1 without errors in the report",
                    self.what
                );
            }
            for (path, error) in &errors {
                assert!(
                    !error.trim().is_empty() && !path.trim().is_empty(),
                    "{}: unclear error record {path:?}: {error:?}",
                    self.what
                );
            }
        }
    }

    /// Sane, exit 0 and no errors.
    #[track_caller]
    pub fn assert_ok(&self) {
        self.assert_sane();
        assert_eq!(
            self.code(),
            Some(EXIT_OK),
            "{}: exit code (stderr {:?}; errors {:?})",
            self.what,
            self.stderr,
            self.json.as_ref().map(|_| self.errors())
        );
    }

    /// Sane and the given exit code.
    #[track_caller]
    pub fn assert_code(&self, want: i32) {
        self.assert_sane();
        assert_eq!(
            self.code(),
            Some(want),
            "{}: exit code (stderr {:?})",
            self.what,
            self.stderr
        );
    }
}

pub fn describe(args: &[&OsStr]) -> String {
    let mut s = String::from("onecopy");
    for a in args {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

pub fn dedupe_args<'a, P: AsRef<Path>>(paths: &'a [P], extra: &'a [&'a str]) -> Vec<&'a OsStr> {
    let mut args: Vec<&OsStr> = vec!["dedupe".as_ref(), "--json".as_ref()];
    args.extend(extra.iter().map(|s| OsStr::new(*s)));
    args.extend(paths.iter().map(|p| p.as_ref().as_os_str()));
    args
}

/// The catalog directory of this test process (`ONECOPY_CACHE_DIR`): out
/// of `/var/cache`, world-writable and sticky so that runs as `nobody` can
/// keep their catalogs too. Each loop filesystem has its own UUID, so
/// parallel tests never share a catalog.
pub fn cache_dir() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    static CLEANED: std::sync::Once = std::sync::Once::new();
    CLEANED.call_once(|| {
        // Catalog directories of earlier test processes that are gone.
        if let Ok(rd) = std::fs::read_dir(std::env::temp_dir()) {
            for e in rd.flatten() {
                let name = e.file_name();
                let Some(pid) = name
                    .to_str()
                    .and_then(|n| n.strip_prefix("onecopy-adversarial-"))
                else {
                    continue;
                };
                if !Path::new("/proc").join(pid).exists() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    });
    let d = std::env::temp_dir().join(format!("onecopy-adversarial-{}", std::process::id()));
    if std::fs::create_dir_all(&d).is_ok() {
        let _ = std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777));
    }
    d
}

pub fn command(program: &str) -> Command {
    let mut c = Command::new(program);
    c.env("ONECOPY_CACHE_DIR", cache_dir()).stdin(Stdio::null());
    c
}

/// Runs `onecopy ARGS...` as root.
pub fn onecopy(args: &[&OsStr]) -> Outcome {
    let out = command(env!("CARGO_BIN_EXE_onecopy"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run the onecopy binary");
    Outcome::from_output(describe(args), out)
}

/// `onecopy dedupe --json EXTRA... PATHS...` as root.
pub fn dedupe<P: AsRef<Path>>(paths: &[P], extra: &[&str]) -> Outcome {
    onecopy(&dedupe_args(paths, extra))
}

/// `onecopy dedupe --json EXTRA... PATHS...` as the unprivileged user
/// `nobody` (no supplementary groups, no capabilities).
pub fn dedupe_as_nobody<P: AsRef<Path>>(paths: &[P], extra: &[&str]) -> Outcome {
    let args = dedupe_args(paths, extra);
    let out = command("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
        .arg(env!("CARGO_BIN_EXE_onecopy"))
        .args(&args)
        .output()
        .expect("run setpriv");
    Outcome::from_output(format!("(as nobody) {}", describe(&args)), out)
}

/// Starts `onecopy dedupe --json EXTRA... PATHS...` as a child with its
/// output captured, to be signalled.
pub fn spawn_dedupe<P: AsRef<Path>>(paths: &[P], extra: &[&str]) -> (Child, String) {
    let args = dedupe_args(paths, extra);
    let child = command(env!("CARGO_BIN_EXE_onecopy"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the onecopy binary");
    (child, describe(&args))
}

/// Waits for a child from [`spawn_dedupe`].
pub fn wait_outcome(child: Child, what: String) -> Outcome {
    let out = child.wait_with_output().expect("wait for onecopy");
    Outcome::from_output(what, out)
}

/// What a finished child cost: the bytes it read (`rchar`: from files,
/// pipes, anything) and its peak resident memory.
#[derive(Debug, Clone, Copy)]
pub struct Cost {
    pub rchar: u64,
    pub max_rss: u64,
}

/// Waits for a child from [`spawn_dedupe`], with what it cost: its
/// `/proc/PID/io` read while it is a zombie, then its `rusage` as it is
/// reaped.
pub fn wait_costed(mut child: Child, what: String) -> (Outcome, Cost) {
    fn drain(r: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                r.read_to_end(&mut v).expect("read the child's output");
            }
            v
        })
    }
    let (out, err) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let pid = child.id() as libc::pid_t;
    // SAFETY: waitid(2) on our own unreaped child, into a zeroed siginfo;
    // WNOWAIT leaves it a zombie.
    let r = unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT,
        )
    };
    assert_eq!(r, 0, "waitid: {}", std::io::Error::last_os_error());
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).expect("the zombie's io");
    let rchar = io
        .lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .and_then(|n| n.parse().ok())
        .expect("rchar in /proc/PID/io");
    let mut status = 0;
    // SAFETY: wait4(2) reaps our own child, into a zeroed rusage.
    let (r, ru) = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        (libc::wait4(pid, &mut status, 0, &mut ru), ru)
    };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    let output = Output {
        status: ExitStatus::from_raw(status),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    };
    let cost = Cost {
        rchar,
        max_rss: ru.ru_maxrss as u64 * 1024,
    };
    (Outcome::from_output(what, output), cost)
}

/// The catalog does not remember files modified within a second of being
/// read ("racily clean"); tests that expect records wait that long first.
pub fn past_racy_window() {
    std::thread::sleep(std::time::Duration::from_millis(1100));
}

/// Sends `sig` to process `pid`.
pub fn send_signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid this test spawned and has not reaped yet.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Creates the parent directories of `p`.
pub fn mkparent(p: &Path) {
    if let Some(d) = p.parent() {
        std::fs::create_dir_all(d).unwrap_or_else(|e| panic!("mkdir {}: {e}", d.display()));
    }
}

/// Writes `data` to `p` (creating parents) with plain writes.
pub fn put(p: &Path, data: &[u8]) {
    mkparent(p);
    std::fs::write(p, data).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
}

/// `groups` groups of `copies` identical random files of `len` bytes under
/// `dir`: `dir/g<i>/c<j>.bin`, every copy a byte copy with its own extents.
pub fn dup_groups(
    dir: &Path,
    groups: usize,
    copies: usize,
    len: u64,
    seed: u64,
) -> Vec<Vec<PathBuf>> {
    (0..groups)
        .map(|g| {
            let first = dir.join(format!("g{g}")).join("c0.bin");
            mkparent(&first);
            write_random(&first, len, seed.wrapping_mul(1000).wrapping_add(g as u64)).unwrap();
            let mut v = vec![first.clone()];
            for c in 1..copies {
                let p = dir.join(format!("g{g}")).join(format!("c{c}.bin"));
                assert_eq!(copy_no_reflink(&first, &p).unwrap(), len);
                v.push(p);
            }
            v
        })
        .collect()
}

/// Physical address of each piece of `[off, off + len)` of `path`
/// (FIEMAP); physically contiguous pieces are merged, so equal results mean
/// the same bytes whatever the extent boundaries. Extents beyond the range
/// (such as XFS's speculative preallocation past EOF) do not count.
pub fn physical_of(path: &Path, off: u64, len: u64) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = Vec::new();
    for e in onecopy_testfs::data_extents(path) {
        let s = e.logical.max(off);
        let t = (e.logical + e.length).min(off + len);
        if s < t {
            let piece = (e.physical + (s - e.logical), t - s);
            match v.last_mut() {
                Some(last) if last.0 + last.1 == piece.0 => last.1 += piece.1,
                _ => v.push(piece),
            }
        }
    }
    v
}

/// Whether every block of `a` and `b` (same size) is the same physical
/// block: the two files are fully shared.
pub fn same_physical(a: &Path, b: &Path) -> bool {
    let (la, lb) = (
        std::fs::metadata(a).unwrap().len(),
        std::fs::metadata(b).unwrap().len(),
    );
    let len = la.div_ceil(4096) * 4096;
    la == lb
        && !physical_of(a, 0, len).is_empty()
        && physical_of(a, 0, len) == physical_of(b, 0, len)
}

/// Asserts every member of every group is fully shared with the first.
#[track_caller]
pub fn assert_groups_shared(ctx: &str, groups: &[Vec<PathBuf>]) {
    for g in groups {
        for p in &g[1..] {
            assert!(
                same_physical(&g[0], p),
                "{ctx}: {} is not fully shared with {} ({} bytes in common)",
                p.display(),
                g[0].display(),
                onecopy_testfs::shared_bytes_between(&g[0], p)
            );
        }
    }
}

/// Asserts none of `paths` has a byte in a shared extent.
#[track_caller]
pub fn assert_unshared(ctx: &str, paths: &[PathBuf]) {
    for p in paths {
        assert_eq!(
            onecopy_testfs::shared_flag_bytes(p),
            0,
            "{ctx}: {} has shared extents",
            p.display()
        );
    }
}

/// Physical layout of each file (FIEMAP), to assert files were not touched.
pub fn layouts(paths: &[PathBuf]) -> BTreeMap<PathBuf, Vec<(u64, u64, u64)>> {
    paths
        .iter()
        .map(|p| {
            (
                p.clone(),
                onecopy_testfs::extents(p)
                    .iter()
                    .map(|e| (e.logical, e.physical, e.length))
                    .collect(),
            )
        })
        .collect()
}

/// onecopy's temporary directories anywhere under `root` (a few levels).
pub fn tmp_dirs(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![(root.to_path_buf(), 0)];
    while let Some((d, depth)) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            if e.file_name().as_bytes().starts_with(b".onecopy-tmp.") {
                out.push(e.path());
            } else if depth < 4 && e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push((e.path(), depth + 1));
            }
        }
    }
    out
}

/// Runs a shell command line, panicking with its output on failure.
#[track_caller]
pub fn sh(line: &str) -> String {
    let out = Command::new("sh")
        .args(["-c", line])
        .stdin(Stdio::null())
        .output()
        .expect("run sh");
    assert!(
        out.status.success(),
        "`{line}` failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a program with arguments, panicking with its output on failure.
#[track_caller]
/// `btrfs ARGS... PATHS...`: its stdout; panics when it fails.
pub fn btrfs(args: &[&str], paths: &[&Path]) -> String {
    let mut all: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    all.extend(paths.iter().map(|p| p.as_os_str()));
    run("btrfs", &all)
}

pub fn run<S: AsRef<OsStr>>(program: &str, args: &[S]) -> String {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        out.status.success(),
        "`{program} {:?}` failed ({}): {}",
        args.iter()
            .map(|a| a.as_ref().to_string_lossy().into_owned())
            .collect::<Vec<_>>(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn try_run<S: AsRef<OsStr>>(program: &str, args: &[S]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A mount made by a test, unmounted on drop (also when the test fails).
pub struct Mounted(pub PathBuf);

impl Mounted {
    /// `mount --bind src dst` then `remount,bind,ro`.
    pub fn bind_ro(src: &Path, dst: &Path) -> Mounted {
        std::fs::create_dir_all(dst).unwrap();
        run(
            "mount",
            &[OsStr::new("--bind"), src.as_os_str(), dst.as_os_str()],
        );
        let m = Mounted(dst.to_path_buf());
        run(
            "mount",
            &[
                OsStr::new("-o"),
                OsStr::new("remount,bind,ro"),
                dst.as_os_str(),
            ],
        );
        m
    }

    /// A tmpfs of `size` bytes on `dst`.
    pub fn tmpfs(dst: &Path, size: u64) -> Mounted {
        std::fs::create_dir_all(dst).unwrap();
        run(
            "mount",
            &[
                OsStr::new("-t"),
                OsStr::new("tmpfs"),
                OsStr::new("-o"),
                OsStr::new(&format!("size={size}")),
                OsStr::new("tmpfs"),
                dst.as_os_str(),
            ],
        );
        Mounted(dst.to_path_buf())
    }

    /// A bind mount of `src` (a whole other filesystem) on `dst`.
    pub fn bind(src: &Path, dst: &Path) -> Mounted {
        std::fs::create_dir_all(dst).unwrap();
        run(
            "mount",
            &[OsStr::new("--bind"), src.as_os_str(), dst.as_os_str()],
        );
        Mounted(dst.to_path_buf())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        for _ in 0..20 {
            if try_run("umount", &[self.0.as_os_str()]) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = try_run("umount", &[OsStr::new("-l"), self.0.as_os_str()]);
    }
}

/// An active swap file, `swapoff`ed on drop.
pub struct Swap(pub PathBuf);

impl Drop for Swap {
    fn drop(&mut self) {
        let _ = try_run("swapoff", &[self.0.as_os_str()]);
    }
}

/// Inode flags set with `chattr`, removed on drop so the fixture can clean
/// up.
pub struct Attrs(pub Vec<PathBuf>);

impl Attrs {
    pub fn set(flag: &str, paths: &[PathBuf]) -> Attrs {
        for p in paths {
            run("chattr", &[OsStr::new(flag), p.as_os_str()]);
        }
        Attrs(paths.to_vec())
    }
}

impl Drop for Attrs {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = try_run(
                "chattr",
                &[OsStr::new("-i"), OsStr::new("-a"), p.as_os_str()],
            );
        }
    }
}

/// A helper process, killed and reaped on drop.
pub struct Holder(pub Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A digest of a file's logical content (size and every non-zero 4 KiB
/// block with its offset) that reads only its data segments
/// (`SEEK_DATA`/`SEEK_HOLE`), for sparse files of many GiB. A hole and
/// written zeros give the same digest, as they read the same.
pub fn sparse_digest(path: &Path) -> (u64, u64) {
    let mut f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let size = f.metadata().unwrap().len();
    let mut h = DefaultHasher::new();
    h.write_u64(size);
    let mut pos = 0u64;
    let mut buf = vec![0u8; 4 << 20];
    let zero = [0u8; 4096];
    while pos < size {
        // SAFETY: lseek on an open descriptor.
        let data = unsafe { libc::lseek(f.as_raw_fd(), pos as i64, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: only a hole remains
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(f.as_raw_fd(), data, libc::SEEK_HOLE) };
        let (start, end) = (data as u64, (hole as u64).min(size));
        f.seek(SeekFrom::Start(start)).unwrap();
        let mut at = start;
        while at < end {
            let want = ((end - at) as usize).min(buf.len());
            f.read_exact(&mut buf[..want]).unwrap();
            for (i, blk) in buf[..want].chunks(4096).enumerate() {
                if blk != &zero[..blk.len()] {
                    h.write_u64(at + i as u64 * 4096);
                    h.write(blk);
                }
            }
            at += want as u64;
        }
        pos = end;
    }
    (size, h.finish())
}

/// Reference data extents of an open file (physical start, length).
pub fn fd_physical(f: &File) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = onecopy_ioctl::fiemap::fiemap(f.as_fd())
        .expect("FIEMAP")
        .iter()
        .filter(|e| !e.is_undedupable() && e.length > 0)
        .map(|e| (e.physical, e.length))
        .collect();
    v.sort_unstable();
    v
}

/// Whether every data byte of `b` lives inside `a`'s physical ranges.
pub fn fd_fully_shared(a: &File, b: &File) -> bool {
    let set = fd_physical(a);
    let inside = |p: u64, l: u64| {
        let mut covered = 0;
        for &(s, n) in &set {
            let (lo, hi) = (s.max(p), (s + n).min(p + l));
            if lo < hi {
                covered += hi - lo;
            }
        }
        covered == l
    };
    let exts = onecopy_ioctl::fiemap::fiemap(b.as_fd()).expect("FIEMAP");
    !exts.iter().any(|e| e.is_undedupable()) && exts.iter().all(|e| inside(e.physical, e.length))
}

fn cstr(name: &[u8]) -> CString {
    CString::new(name).expect("no NUL in names")
}

/// `mkdirat(dir, name)` then `openat(dir, name, O_DIRECTORY)`.
pub fn mkdir_at(dir: &OwnedFd, name: &[u8]) -> OwnedFd {
    let c = cstr(name);
    // SAFETY: valid descriptor and NUL-terminated name.
    let r = unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o755) };
    assert!(
        r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST),
        "mkdirat: {}",
        std::io::Error::last_os_error()
    );
    open_dir_at(dir, name)
}

/// `openat(dir, name, O_DIRECTORY)`.
pub fn open_dir_at(dir: &OwnedFd, name: &[u8]) -> OwnedFd {
    let c = cstr(name);
    // SAFETY: valid descriptor and NUL-terminated name.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    assert!(fd >= 0, "openat: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor we own.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Opens the directory `path` (which must be shorter than `PATH_MAX`).
pub fn open_dir(path: &Path) -> OwnedFd {
    File::open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
        .into()
}

/// Opens `name` in `dir`, for reading or (created, truncated) for writing.
pub fn open_file_at(dir: &OwnedFd, name: &[u8], write: bool) -> File {
    let c = cstr(name);
    let flags = if write {
        libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC
    } else {
        libc::O_RDONLY | libc::O_CLOEXEC
    };
    // SAFETY: valid descriptor and NUL-terminated name.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags, 0o644) };
    assert!(fd >= 0, "openat file: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor we own.
    File::from(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Makes `dir` traversable and readable by everyone (the fixture's
/// temporary directories are private).
pub fn open_up(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// `chown -R nobody:nogroup path`.
pub fn give_to_nobody(path: &Path) {
    run(
        "chown",
        &[
            OsStr::new("-R"),
            OsStr::new("nobody:nogroup"),
            path.as_os_str(),
        ],
    );
}

/// Sets the permission bits of `p`.
pub fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", p.display()));
}

/// Every file under `root` with its content, keyed by relative path.
pub fn read_tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                let p = e.path();
                let data =
                    std::fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
                out.insert(p.strip_prefix(root).unwrap().to_path_buf(), data);
            }
        }
    }
    out
}
