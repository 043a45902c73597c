//! What the store's integration tests share: running `onecopy`, a store
//! in a scratch directory, a foreground mount (its stderr checked for
//! panics), a replayable random source, fsck and stats. Each test file
//! uses part of it.
#![allow(dead_code)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use onecopy_testfs::is_root;

pub const BIN: &str = env!("CARGO_BIN_EXE_onecopy");

pub fn onecopy(args: &[&str]) -> Output {
    let out = Command::new(BIN).args(args).output().expect("run onecopy");
    no_panic(&String::from_utf8_lossy(&out.stderr), args);
    out
}

/// stdout of a run that must succeed (its output shown if it did not).
pub fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

pub fn no_panic(stderr: &str, what: impl std::fmt::Debug) {
    assert!(!stderr.contains("panicked"), "{what:?} panicked: {stderr}");
}

/// These tests exist to run the store through a real FUSE mount: without
/// root and /dev/fuse they fail (a skipped test proves nothing).
pub fn require_fuse() {
    assert!(
        is_root() && Path::new("/dev/fuse").exists(),
        "the store's integration tests mount FUSE and must run as root with /dev/fuse"
    );
}

/// [`require_fuse`], and FUSE over io_uring served by the kernel (the
/// fuse module's `enable_uring`, which scripts/test.sh turns on): a test
/// of the `transport=uring` mount fails without it.
pub fn require_uring() {
    require_fuse();
    let param = "/sys/module/fuse/parameters/enable_uring";
    let on = std::fs::read_to_string(param).unwrap_or_default();
    assert_eq!(on.trim(), "Y", "{param}: FUSE over io_uring is off");
}

/// Runs `$f(transport, mount_args)` as two tests, `$f::dev` over
/// `/dev/fuse` and `$f::io_uring` (which needs `enable_uring`);
/// `transport` ("dev", "uring") tells buckets and stores apart.
#[macro_export]
macro_rules! per_transport {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn dev() {
                    super::$name("dev", &["-o", "transport=dev"])
                }
                #[test]
                fn io_uring() {
                    super::require_uring();
                    super::$name("uring", &["-o", "transport=uring"])
                }
            }
        )*
    };
}

/// `extra` mount arguments with `transport=T` added to their `-o` list
/// (or as one) when `t` is `Some(T)` and they name no transport.
pub fn with_run_transport(extra: &[&str], t: Option<String>) -> Vec<String> {
    let mut args: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
    let Some(t) = t.filter(|_| !extra.iter().any(|a| a.contains("transport="))) else {
        return args;
    };
    match args.iter().position(|a| a == "-o") {
        Some(i) if i + 1 < args.len() => args[i + 1] = format!("{},transport={t}", args[i + 1]),
        _ => args.extend(["-o".to_string(), format!("transport={t}")]),
    }
    args
}

/// A small deterministic generator (xorshift64*), seeded per test so a
/// failure can be replayed with `ONECOPY_FAULT_SEED`.
pub struct Rng(pub u64);

impl Rng {
    pub fn seeded(what: &str) -> Rng {
        Rng(onecopy_testfs::seed::replayable("ONECOPY_FAULT_SEED", what) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A store in a scratch directory and its mount point.
pub struct Scratch {
    _tmp: Option<tempfile::TempDir>,
    pub store: PathBuf,
    pub mnt: PathBuf,
}

impl Scratch {
    /// A store made elsewhere, mounted on `mnt` (removed by its maker).
    pub fn existing(store: PathBuf, mnt: PathBuf) -> Scratch {
        Scratch {
            _tmp: None,
            store,
            mnt,
        }
    }
}

pub fn scratch_in(parent: &Path, init_args: &[&str]) -> Scratch {
    let tmp = tempfile::tempdir_in(parent).unwrap();
    let store = tmp.path().join("store");
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut args = vec!["store", "init", store.to_str().unwrap()];
    args.extend_from_slice(init_args);
    let out = onecopy(&args);
    assert!(out.status.success(), "{out:?}");
    Scratch {
        _tmp: Some(tmp),
        store,
        mnt,
    }
}

pub fn scratch(init_args: &[&str]) -> Scratch {
    scratch_in(tests_root(), init_args)
}

/// Where the tests' temporary directories go (made if missing).
fn tests_root() -> &'static Path {
    let root = Path::new("/var/tmp/store-tests");
    std::fs::create_dir_all(root).unwrap();
    root
}

pub fn is_mounted(mnt: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let m = mnt.to_str().unwrap();
    info.lines().any(|l| l.split(' ').nth(4) == Some(m))
}

/// A foreground mount process whose stderr is kept (checked for panics).
pub struct Mount {
    child: Option<Child>,
    pub mnt: PathBuf,
    stderr: PathBuf,
    /// Holds `stderr`, off the store's own filesystem: a test that fills
    /// that one (a small cache disk) still sees what the mount printed.
    _log: tempfile::TempDir,
}

impl Mount {
    pub fn new(s: &Scratch) -> Mount {
        Self::with_args(s, &[])
    }

    /// A mount with `extra` arguments and, if they name no transport,
    /// the one `ONECOPY_TEST_TRANSPORT` asks for (scripts/test.sh runs the
    /// FUSE suites a second time with `dev`: a mount that names none is
    /// served over io_uring while the tests turn `enable_uring` on, and
    /// over `/dev/fuse` on most users' kernels).
    pub fn with_args(s: &Scratch, extra: &[&str]) -> Mount {
        let run = std::env::var("ONECOPY_TEST_TRANSPORT").ok();
        let args = with_run_transport(extra, run.filter(|t| !t.is_empty()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::exactly(s, &args)
    }

    /// A mount with exactly `extra` arguments.
    pub fn exactly(s: &Scratch, extra: &[&str]) -> Mount {
        let log = tempfile::tempdir_in(tests_root()).unwrap();
        let stderr = log.path().join("mount-stderr");
        let child = Command::new(BIN)
            .args(["mount", "-f"])
            .args(extra)
            .arg(&s.store)
            .arg(&s.mnt)
            .stdout(Stdio::null())
            .stderr(
                File::options()
                    .create(true)
                    .append(true)
                    .open(&stderr)
                    .unwrap(),
            )
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !is_mounted(&s.mnt) {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "mount did not appear: {}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Mount {
            child: Some(child),
            mnt: s.mnt.clone(),
            stderr,
            _log: log,
        }
    }

    /// The mount process's peak resident set (VmHWM), in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        let pid = self.child.as_ref().unwrap().id();
        let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        st.lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap()
    }

    /// How many io_uring instances the mount process holds (FUSE over
    /// io_uring: a ring per CPU; `/dev/fuse`: none).
    pub fn io_urings(&self) -> usize {
        let pid = self.child.as_ref().unwrap().id();
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.as_os_str() == "anon_inode:[io_uring]")
            .count()
    }

    /// What the mount process printed to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn check_stderr(&self) {
        no_panic(
            &std::fs::read_to_string(&self.stderr).unwrap_or_default(),
            "mount",
        );
    }

    /// Unmounts (not lazily). A descriptor of the mount duplicated into a
    /// child another test thread is spawning (between its fork and exec)
    /// makes the unmount fail with "busy" for a moment: retried briefly.
    pub fn unmount(mut self) {
        let mut tries = 0;
        loop {
            let out = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.mnt)
                .output()
                .unwrap();
            if out.status.success() {
                break;
            }
            tries += 1;
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(tries < 20 && err.contains("busy"), "fusermount3 -u: {err}");
            eprintln!("fusermount3 -u (try {tries}): {err}");
            std::thread::sleep(Duration::from_millis(100));
        }
        let st = self.child.take().unwrap().wait().unwrap();
        self.check_stderr();
        assert!(
            st.success(),
            "mount process exited with {st}: {}",
            self.log()
        );
    }

    pub fn kill(mut self) {
        let mut c = self.child.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
        let _ = Command::new("fusermount3")
            .args(["-u", "-z"])
            .arg(&self.mnt)
            .status();
        self.check_stderr();
        assert!(!is_mounted(&self.mnt));
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("fusermount3")
                .args(["-u", "-z"])
                .arg(&self.mnt)
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn fsck_clean(store: &Path) {
    let out = onecopy(&["store", "fsck", store.to_str().unwrap()]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("0 problems"),
        "fsck found problems: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn stats(store: &Path) -> serde_json::Value {
    let out = onecopy(&["store", "stats", store.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The 8-byte word written at offset `off` of file `id` in generation
/// `gen` by the fault and concurrency tests: a word read back is zero or
/// carries its file's id and its own offset, so a byte that was never
/// written to the file is found wherever it lands.
pub fn word(id: u64, gen: u64, off: u64) -> [u8; 8] {
    (id << 48 | (gen & 0xffff) << 32 | (off / 8) & 0xffff_ffff).to_le_bytes()
}

/// Offset of the first word of `data` (read at file offset `at`) that is
/// neither zero nor one of `owner(offset)`'s own words there (a short
/// last word is read as if padded with zeros).
pub fn foreign_word_at(data: &[u8], at: u64, owner: impl Fn(u64) -> u64) -> Option<u64> {
    data.chunks(8).enumerate().find_map(|(i, w)| {
        let mut b = [0u8; 8];
        b[..w.len()].copy_from_slice(w);
        let v = u64::from_le_bytes(b);
        let off = at + i as u64 * 8;
        let ok = v == 0 || (v >> 48 == owner(off) && v & 0xffff_ffff == off / 8);
        (!ok).then_some(off)
    })
}

/// Offset of the first word of `data` (read from offset 0 of file `id`)
/// that is neither zero nor file `id`'s own word at its offset.
pub fn foreign_word(id: u64, data: &[u8]) -> Option<u64> {
    foreign_word_at(data, 0, |_| id)
}

/// `len / 8` words of file `id`, generation `gen`, from offset `off`.
pub fn pattern(id: u64, gen: u64, off: u64, len: u64) -> Vec<u8> {
    (0..len / 8)
        .flat_map(|i| word(id, gen, off + i * 8))
        .collect()
}

/// Fills the filesystem holding `ballast` (allocated blocks, not delayed
/// allocation, whose reservations overestimate) until it is full, then
/// frees `leave` bytes. (`statvfs` then shows more: ext4 keeps a reserve
/// that even root's writes do not get.)
pub fn fill_leaving(ballast: &Path, leave: u64) {
    use rustix::fs::{fallocate, statvfs, FallocateFlags};
    let f = File::create(ballast).unwrap();
    let mut at = 0u64;
    for step in [1u64 << 20, 64 << 10, 4 << 10] {
        while fallocate(&f, FallocateFlags::empty(), at, step).is_ok() {
            at += step;
        }
    }
    f.set_len(at.saturating_sub(leave)).unwrap();
    f.sync_all().unwrap();
    let st = statvfs(ballast).unwrap();
    eprintln!(
        "ballast {at} bytes, {} bytes free",
        st.f_bfree * st.f_frsize
    );
}

/// `mib` MiB written in order into the new file `path` through the mount
/// (1 MiB `pwrite`s of [`pattern`]) and fsync'd: the open handle and the
/// bytes. A `fdatasync` every [`IN_ORDER_SYNC`] MiB keeps the kernel's
/// writeback of the file in order to within that: with one sync at the
/// end, writeback under a loaded test run sent the pages out of order by
/// more than drop-behind follows (`REORDER`, 32 MiB), as a random writer's.
pub fn write_in_order(path: &Path, mib: u64) -> (File, Vec<u8>) {
    use std::os::unix::fs::FileExt;
    let f = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .unwrap();
    let mut want = Vec::new();
    for i in 0..mib {
        let piece = pattern(1, 0, i << 20, 1 << 20);
        f.write_all_at(&piece, i << 20).unwrap();
        want.extend_from_slice(&piece);
        if (i + 1) % IN_ORDER_SYNC == 0 {
            f.sync_data().unwrap();
        }
    }
    f.sync_all().unwrap();
    (f, want)
}

/// MiB [`write_in_order`] writes between two syncs.
const IN_ORDER_SYNC: u64 = 16;

/// Pages of `len` bytes of `f` from `off` in the page cache (`mincore`
/// of a shared read-only mapping, which faults nothing in).
pub fn resident_pages(f: &File, off: i64, len: usize) -> usize {
    use std::os::fd::AsRawFd;
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            off,
        );
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        let mut vec = vec![0u8; len.div_ceil(4096)];
        let r = libc::mincore(p, len, vec.as_mut_ptr());
        libc::munmap(p, len);
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 != 0).count()
    }
}
