//! Shared helpers for the integration tests: running the real `onecopy`
//! binary, reading its `--json` report, building duplicate trees and
//! comparing space figures with tolerances.
//!
//! Everything here talks to the running kernel (loop-mounted filesystems
//! from `onecopy-testfs`); nothing is mocked.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use onecopy_testfs::{copy_no_reflink, is_root, write_random, FsKind, LoopFs};
use serde_json::Value;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// The default `--block-size` of `onecopy dedupe`.
pub const DEFAULT_BLOCK: u64 = 4 * KIB;

/// Runs `$f(FsKind::Btrfs)` and `$f(FsKind::Xfs)` as two tests,
/// `$f::btrfs` and `$f::xfs`.
#[macro_export]
macro_rules! per_fs {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn btrfs() {
                    super::$name(onecopy_testfs::FsKind::Btrfs)
                }
                #[test]
                fn xfs() {
                    super::$name(onecopy_testfs::FsKind::Xfs)
                }
            }
        )*
    };
}

/// A fresh loop-mounted filesystem of `kind` and `size` bytes. Panics with
/// a clear message when not root: these tests exist to run on real
/// filesystems, so silently skipping would prove nothing.
pub fn new_fs(kind: FsKind, size: u64) -> LoopFs {
    assert!(
        is_root(),
        "the onecopy integration tests mount loop filesystems and must run as root"
    );
    LoopFs::new(kind, size).unwrap_or_else(|e| panic!("making a {kind} loop filesystem: {e}"))
}

/// One run of the binary.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    /// The parsed `--json` report, if stdout held one.
    pub json: Option<Value>,
}

impl Run {
    /// The JSON report; panics (showing stderr) if there is none.
    pub fn report(&self) -> &Value {
        self.json.as_ref().unwrap_or_else(|| {
            panic!(
                "no JSON report (exit {}); stdout: {:?}; stderr: {:?}",
                self.code, self.stdout, self.stderr
            )
        })
    }

    /// An unsigned top-level field of the report.
    pub fn u(&self, field: &str) -> u64 {
        let v = &self.report()[field];
        v.as_u64()
            .unwrap_or_else(|| panic!("report field {field:?} is not an unsigned number: {v}"))
    }

    /// `files_skipped.<reason>` (0 when absent).
    pub fn skipped(&self, reason: &str) -> u64 {
        let m = &self.report()["files_skipped"];
        assert!(m.is_object(), "files_skipped is not an object: {m}");
        m.get(reason).map_or(0, |v| {
            v.as_u64()
                .unwrap_or_else(|| panic!("files_skipped.{reason} is not a number: {v}"))
        })
    }

    /// The `errors` array of the report.
    pub fn errors(&self) -> &Vec<Value> {
        self.report()["errors"]
            .as_array()
            .expect("report field errors is an array")
    }

    /// Asserts exit code 0, no errors, and a consistent `exit_code`.
    pub fn assert_ok(&self, ctx: &str) {
        assert_eq!(
            self.code, 0,
            "{ctx}: exit code {} (stderr: {:?})",
            self.code, self.stderr
        );
        assert!(
            self.errors().is_empty(),
            "{ctx}: errors reported: {:?}",
            self.errors()
        );
        assert_eq!(self.u("exit_code"), 0, "{ctx}: report exit_code");
    }
}

/// Runs `onecopy ARGS...` and captures its outcome. The JSON report is
/// parsed when stdout holds one.
pub fn onecopy<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    // Catalogs of the throw-away test filesystems stay out of /var/cache.
    let cache = std::env::temp_dir().join(format!("onecopy-tests-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_onecopy"))
        .env("ONECOPY_CACHE_DIR", cache)
        .args(args)
        .output()
        .expect("run the onecopy binary");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_str::<Value>(stdout.trim()).ok();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout,
        stderr,
        json,
    }
}

/// `onecopy dedupe --json EXTRA... PATHS...`.
pub fn dedupe<P: AsRef<Path>>(paths: &[P], extra: &[&str]) -> Run {
    let mut args: Vec<&OsStr> = vec!["dedupe".as_ref(), "--json".as_ref()];
    args.extend(extra.iter().map(|s| OsStr::new(*s)));
    args.extend(paths.iter().map(|p| p.as_ref().as_os_str()));
    onecopy(args)
}

/// `|a - b| <= tol`, with a message giving both values in MiB.
#[track_caller]
pub fn assert_close(what: &str, got: u64, want: u64, tol: u64) {
    let diff = got.abs_diff(want);
    eprintln!(
        "{what}: got {:.3} MiB, expected {:.3} MiB (tolerance {:.3} MiB)",
        mib(got),
        mib(want),
        mib(tol)
    );
    assert!(
        diff <= tol,
        "{what}: got {got} ({:.2} MiB), expected {want} ({:.2} MiB) within {tol} ({:.2} MiB); off by {:.2} MiB",
        mib(got),
        mib(want),
        mib(tol),
        mib(diff)
    );
}

pub fn mib(b: u64) -> f64 {
    b as f64 / MIB as f64
}

/// A tolerance of `pct` percent of `x` plus `slack` bytes.
pub fn tol(x: u64, pct: u64, slack: u64) -> u64 {
    x * pct / 100 + slack
}

/// Rounds up to a multiple of 4 KiB (the allocation unit of both test
/// filesystems).
pub fn round4k(x: u64) -> u64 {
    x.div_ceil(4096) * 4096
}

/// Space change between two `used_bytes` readings (positive = freed).
pub fn drop_of(before: u64, after: u64) -> i64 {
    before as i64 - after as i64
}

/// Creates the parent directories of `p`.
pub fn mkparent(p: &Path) {
    if let Some(d) = p.parent() {
        std::fs::create_dir_all(d).unwrap_or_else(|e| panic!("mkdir {}: {e}", d.display()));
    }
}

/// One original and its byte copies.
#[derive(Debug, Clone)]
pub struct DupSet {
    pub original: PathBuf,
    pub copies: Vec<PathBuf>,
    pub len: u64,
}

impl DupSet {
    /// Bytes of space the copies occupy (what deduping them frees).
    pub fn dup_alloc(&self) -> u64 {
        round4k(self.len) * self.copies.len() as u64
    }
    /// Logical bytes of the copies.
    pub fn dup_bytes(&self) -> u64 {
        self.len * self.copies.len() as u64
    }
}

/// Writes random originals (`(relative path, len, seed)`) under `root` and
/// `ncopies[i]` plain byte copies of each (own extents, never reflinked) in
/// other directories.
pub fn make_dupes(root: &Path, specs: &[(&str, u64, u64, usize)]) -> Vec<DupSet> {
    let mut out = Vec::new();
    for &(rel, len, seed, ncopies) in specs {
        let original = root.join(rel);
        mkparent(&original);
        write_random(&original, len, seed).unwrap();
        let mut copies = Vec::new();
        for c in 0..ncopies {
            let name = original.file_name().unwrap().to_string_lossy().into_owned();
            let copy = root
                .join(format!("copy{c}"))
                .join(format!("sub-{seed}"))
                .join(name);
            mkparent(&copy);
            assert_eq!(copy_no_reflink(&original, &copy).unwrap(), len);
            copies.push(copy);
        }
        out.push(DupSet {
            original,
            copies,
            len,
        });
    }
    out
}

/// The `dupes` workload used by several tests: sizes deliberately not
/// multiples of 4 KiB, each file present 2 or 3 times.
pub const DUPES: &[(&str, u64, u64, usize)] = &[
    ("orig/a/three.bin", 3 * MIB + 123, 11, 2),
    ("orig/a/ten.bin", 10 * MIB, 12, 1),
    ("orig/b/seven.bin", 7 * MIB + 4097, 13, 2),
    ("orig/b/c/odd.bin", 5 * MIB + 65_537, 14, 1),
];

/// Unique files next to the duplicates (they must not change or be shared).
pub fn make_uniques(root: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for (i, len) in [(0u64, 2 * MIB + 5), (1, 700 * KIB), (2, 4 * MIB)] {
        let p = root.join("unique").join(format!("u{i}.bin"));
        mkparent(&p);
        write_random(&p, len, 1000 + i).unwrap();
        v.push(p);
    }
    v
}

/// Writes `data` to `path` in `chunk`-byte pieces from the last piece to
/// the first (positional writes), fsyncing each: the file's extents are
/// allocated in reverse logical order.
pub fn write_reverse_chunks(path: &Path, data: &[u8], chunk: usize) {
    let f = File::create(path).unwrap();
    let n = data.len().div_ceil(chunk);
    for i in (0..n).rev() {
        let s = i * chunk;
        let e = (s + chunk).min(data.len());
        f.write_all_at(&data[s..e], s as u64).unwrap();
        f.sync_data().unwrap();
    }
}

/// Writes `data` to `path` in `chunk`-byte pieces, interleaved with pieces
/// of random filler appended to `filler`, fsyncing after each: `path` ends
/// up in many small extents scattered between the filler's.
pub fn write_interleaved(path: &Path, data: &[u8], chunk: usize, filler: &Path, seed: u64) {
    let mut f = File::create(path).unwrap();
    let mut g = OpenOptions::new()
        .create(true)
        .append(true)
        .open(filler)
        .unwrap();
    let mut rng = onecopy_testfs::Prng::new(seed);
    let mut junk = vec![0u8; chunk];
    for piece in data.chunks(chunk) {
        f.write_all(piece).unwrap();
        f.sync_data().unwrap();
        rng.fill(&mut junk);
        g.write_all(&junk).unwrap();
        g.sync_data().unwrap();
    }
}
