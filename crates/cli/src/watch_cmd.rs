//! `onecopy watch PATH...`: continuous mode. Files written and closed,
//! created or renamed into the PATHs (fanotify filesystem marks; without
//! them, a periodic look: on btrfs a tree search for what changed since
//! the last pass, elsewhere an incremental walk) are deduped once writes have been quiet for `--settle` seconds,
//! by an incremental `onecopy dedupe` run: the catalog means only new and
//! changed files are read, and it is what carries the state across
//! restarts (the first pass after a start catches up on what changed while
//! stopped). SIGTERM/SIGINT end the run in progress cleanly, then exit 0.

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use onecopy_watch::{Batch, Change, ChangeSource, Debounce, Mode};

use crate::exit;

#[derive(Debug, Args)]
pub struct WatchArgs {
    /// Directories to keep deduped.
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<PathBuf>,

    /// Seconds without writes before a batch of changed files is deduped.
    #[arg(long, value_name = "SECS", default_value_t = 2.0)]
    pub settle: f64,

    /// Dedupe at the latest this many seconds after the first change of a
    /// batch, even while writes go on.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub max_delay: f64,

    /// Without fanotify: look at every PATH this often (an incremental
    /// walk; unchanged files are not read).
    #[arg(long, value_name = "SECS", default_value_t = 300.0)]
    pub interval: f64,

    /// Do not use fanotify even where it works: periodic looks only.
    #[arg(long)]
    pub poll: bool,

    /// Periodic looks on btrfs name the changed files by tree search; walk
    /// every PATH anyway this often (finds changes in nested subvolumes).
    #[arg(long, value_name = "SECS", default_value_t = 3600.0)]
    pub full_interval: f64,

    /// Run at idle I/O priority and nice 19 (passes inherit both).
    #[arg(long)]
    pub idle: bool,

    /// Hold a batch while the 1-minute load average is above LOAD
    /// (0: no limit).
    #[arg(long, value_name = "LOAD", default_value_t = 0.0)]
    pub max_load: f64,

    /// Block size for matching (as for dedupe; default: the filesystem
    /// block size).
    #[arg(short = 'b', long, value_name = "SIZE")]
    pub block_size: Option<String>,

    /// RAM for the block table of each pass (as for dedupe).
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,

    /// Catalog file (as for dedupe).
    #[arg(long, value_name = "PATH")]
    pub hashfile: Option<PathBuf>,

    /// Skip entries matching GLOB (repeatable, as for dedupe).
    #[arg(short = 'e', long = "exclude", value_name = "GLOB")]
    pub excludes: Vec<String>,

    /// Files read in parallel per pass.
    #[arg(short = 'j', long, value_name = "N", default_value_t = 2)]
    pub threads: usize,

    /// Print nothing but errors (no line per pass).
    #[arg(short, long)]
    pub quiet: bool,
}

const TICK: Duration = Duration::from_millis(200);

pub fn run(a: WatchArgs) -> anyhow::Result<u8> {
    let roots = canonical_roots(&a.paths)?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    if a.idle {
        onecopy_ioctl::process::set_idle_io_priority().context("idle I/O priority")?;
        let _ = rustix::process::nice(19);
    }
    let source = if a.poll {
        None
    } else {
        match ChangeSource::best(&roots, &[onecopy_scan::TMP_DIR_PREFIX]) {
            Ok((s, None)) => Some(s),
            Ok((s, Some(why))) => {
                eprintln!(
                    "onecopy watch: fanotify names ({why}): watching writes only; \
                     files renamed into a PATH wait for a look every {}s",
                    a.interval
                );
                Some(s)
            }
            Err(e) => {
                eprintln!("onecopy watch: {e}; looking every {}s instead", a.interval);
                None
            }
        }
    };
    let mut w = Watcher {
        a: &a,
        roots,
        stop,
        debounce: Debounce::new(secs(a.settle), secs(a.max_delay)),
        generations: Vec::new(),
        since_wall: 0,
        held: false,
        own: own_files(&a),
    };
    w.note(&format!(
        "watching {} path(s) with {}",
        w.roots.len(),
        match source.as_ref().map(ChangeSource::mode) {
            Some(Mode::Names) => "fanotify (writes, creations, renames)",
            Some(Mode::Writes) => "fanotify (writes only)",
            None => "periodic looks",
        }
    ));
    // Catch up on what changed while not running: on btrfs, when the last
    // run left its generations, a tree search since them; else a pass over
    // every PATH (cheap: the catalog).
    let saved: Vec<Option<(u64, u64)>> = w.roots.iter().map(|r| load_generation(r)).collect();
    let caught_up = saved.iter().all(Option::is_some) && {
        w.generations = saved.iter().map(|s| s.map(|(g, _)| g)).collect();
        w.since_wall = saved.iter().flatten().map(|&(_, t)| t).min().unwrap_or(0);
        let settled = Instant::now() - secs(a.settle);
        match w.look() {
            Look::Nothing => true,
            Look::Files(v) => {
                v.into_iter()
                    .for_each(|p| w.debounce.touch(Some(p), settled));
                true
            }
            Look::Walk => false,
        }
    };
    if !caught_up {
        w.debounce.touch(None, Instant::now() - secs(a.max_delay));
    }
    w.run(source.as_ref())
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

fn canonical_roots(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    paths
        .iter()
        .map(|p| std::fs::canonicalize(p).with_context(|| format!("{}", p.display())))
        .collect()
}

struct Watcher<'a> {
    a: &'a WatchArgs,
    roots: Vec<PathBuf>,
    stop: Arc<AtomicBool>,
    debounce: Debounce,
    /// btrfs generations of the roots' filesystems when the last pass
    /// started (None where unknown: not btrfs, or an old kernel).
    generations: Vec<Option<u64>>,
    /// Wall-clock seconds when the last pass began: a tree search keeps
    /// files whose ctime is at least this minus [`CLOCK_SLACK`].
    since_wall: u64,
    /// A batch is held back by the load limit (noted once per hold).
    held: bool,
    /// onecopy's own catalog directory and file: a pass writes them, and
    /// seeing that as a change would start a pass again, forever.
    own: Vec<PathBuf>,
}

/// More changed files than this from a tree search: walk instead.
const TREE_SEARCH_LIMIT: usize = 10_000;
/// Bytes of file names a pass is given on its command line at most (well
/// under ARG_MAX); a larger batch runs over the whole PATHs.
const PASS_ARGS_MAX: usize = 256 << 10;

impl Watcher<'_> {
    fn is_own(&self, p: &std::path::Path) -> bool {
        self.own.iter().any(|o| p.starts_with(o))
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    fn note(&self, msg: &str) {
        if !self.a.quiet {
            eprintln!("onecopy watch: {msg}");
        }
    }

    fn run(&mut self, source: Option<&ChangeSource>) -> anyhow::Result<u8> {
        let mut next_look = Instant::now() + secs(self.a.interval);
        let mut next_full = Instant::now() + secs(self.a.full_interval);
        while !self.stopped() {
            match source {
                Some(s) => {
                    let now = Instant::now();
                    for c in s.wait(TICK)? {
                        match c {
                            Change::Written(p) if self.is_own(&p) => {}
                            Change::Written(p) => self.debounce.touch(Some(p), now),
                            Change::Lost => self.debounce.touch(None, now),
                        }
                    }
                }
                None => {
                    std::thread::sleep(TICK);
                    if Instant::now() >= next_look {
                        let settled = Instant::now() - secs(self.a.settle);
                        if Instant::now() >= next_full {
                            self.debounce.touch(None, settled);
                            next_full = Instant::now() + secs(self.a.full_interval);
                        } else {
                            match self.look() {
                                Look::Nothing => {}
                                Look::Files(v) => {
                                    for p in v {
                                        self.debounce.touch(Some(p), settled);
                                    }
                                }
                                Look::Walk => self.debounce.touch(None, settled),
                            }
                        }
                        next_look = Instant::now() + secs(self.a.interval);
                    }
                }
            }
            if self.debounce.due(Instant::now()) && self.load_ok() {
                let batch = self.debounce.take();
                self.pass(batch)?;
            }
        }
        self.note("stopped");
        Ok(exit::OK)
    }

    /// A periodic look. Where every root is on btrfs and was seen by a
    /// previous pass: nothing when no filesystem generation moved since
    /// that pass began (one ioctl per root), else the files a tree search
    /// finds changed since then. Otherwise (or when the search fails or
    /// finds too many), a walk.
    fn look(&self) -> Look {
        let t = Instant::now();
        let now = generations(&self.roots);
        if !now.iter().all(Option::is_some) || self.generations.len() != self.roots.len() {
            return Look::Walk;
        }
        if now == self.generations {
            self.note(&format!(
                "nothing committed since the last pass (btrfs generation checked in {:.0?}): no walk",
                t.elapsed()
            ));
            return Look::Nothing;
        }
        let mut files = Vec::new();
        for (root, since) in self.roots.iter().zip(&self.generations) {
            let since = since.unwrap_or(0);
            let min_ctime = self.since_wall.saturating_sub(CLOCK_SLACK);
            match onecopy_watch::changed_files(root, since, min_ctime, TREE_SEARCH_LIMIT) {
                Ok(Some(v)) => {
                    files.extend(v.into_iter().filter(|p| !in_tmp_dir(p) && !self.is_own(p)))
                }
                Ok(None) => return Look::Walk,
                Err(e) => {
                    self.note(&format!("tree search of {}: {e}; walking", root.display()));
                    return Look::Walk;
                }
            }
        }
        self.note(&format!(
            "btrfs tree search since generation {}: {} changed file(s) in {:.1?}{}",
            self.generations.iter().flatten().min().unwrap_or(&0),
            files.len(),
            t.elapsed(),
            if files.is_empty() { ": no walk" } else { "" },
        ));
        if files.is_empty() {
            Look::Nothing
        } else {
            Look::Files(files)
        }
    }

    /// Whether the load average allows a pass now (noted once per hold).
    fn load_ok(&mut self) -> bool {
        let load = load_average();
        let ok = self.a.max_load <= 0.0 || load.is_none_or(|l| l <= self.a.max_load);
        if !ok && !self.held {
            self.note(&format!(
                "load average {:.2} above --max-load {}: holding the batch",
                load.unwrap_or(0.0),
                self.a.max_load
            ));
        }
        self.held = !ok;
        ok
    }

    /// One incremental dedupe: over every root for an unnamed change,
    /// else over the batch's files that still exist (the catalog supplies
    /// the rest of the filesystem as sources, without a walk).
    fn pass(&mut self, batch: Batch) -> anyhow::Result<()> {
        // A file changed within the catalog's racy margin would be read but
        // not recorded, and a later pass naming only new files could not
        // match against it: it waits for the next batch.
        let mut named = Vec::new();
        for p in &batch.paths {
            match changed_within(p, RACY) {
                None => {}
                Some(true) => self.debounce.touch(Some(p.clone()), Instant::now()),
                Some(false) => named.push(p),
            }
        }
        let arg_bytes: usize = named.iter().map(|p| p.as_os_str().len() + 1).sum();
        let walk = batch.unknown || arg_bytes > PASS_ARGS_MAX;
        let roots: Vec<&PathBuf> = if walk {
            self.roots.iter().collect()
        } else {
            named
        };
        if roots.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        self.generations = generations(&self.roots);
        self.since_wall = wall_secs();
        let child = self.spawn_dedupe(&roots, walk)?;
        let Some(out) = self.wait_child(child)? else {
            return Ok(());
        };
        let report: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
        let n = |k: &str| report[k].as_u64().unwrap_or(0);
        let what = if walk {
            "look over every path".to_string()
        } else {
            format!(
                "{} changed file(s), first {:.2}s ago",
                roots.len(),
                batch.since.map_or(0.0, |s| s.elapsed().as_secs_f64())
            )
        };
        self.note(&format!(
            "{what}: scanned {}, read {} file(s), shared {} bytes in {:.2}s",
            n("files_scanned"),
            n("files_read"),
            n("bytes_deduped"),
            started.elapsed().as_secs_f64(),
        ));
        let at_start = self.generations.clone();
        let wall_at_start = self.since_wall;
        // A walk reads whatever it meets, racy files too: read them again
        // once settled, so that the catalog holds them.
        let since = started.elapsed() + RACY;
        for p in report["read_paths"].as_array().into_iter().flatten() {
            let p = PathBuf::from(p.as_str().unwrap_or_default());
            if changed_within(&p, since) == Some(true) {
                self.debounce.touch(Some(p), Instant::now());
            }
        }
        // Everything changed before the pass began is deduped or recorded:
        // the next start searches from there (only when nothing waits).
        if !self.debounce.pending() {
            for (r, g) in self.roots.iter().zip(&at_start) {
                if let Some(g) = g {
                    save_generation(r, *g, wall_at_start);
                }
            }
        }
        Ok(())
    }

    /// A dedupe pass over `roots`; with `list_read`, its report names the
    /// files it read.
    fn spawn_dedupe(&self, roots: &[&PathBuf], list_read: bool) -> anyhow::Result<Child> {
        let exe = std::env::current_exe().context("finding the onecopy binary")?;
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["dedupe", "--json", "--quiet"]);
        if let Some(b) = &self.a.block_size {
            cmd.args(["--block-size", b]);
        }
        if let Some(m) = &self.a.memory {
            cmd.args(["--memory", m]);
        }
        cmd.args(["--threads", &self.a.threads.to_string()]);
        if list_read {
            cmd.arg("--verbose");
        }
        if let Some(h) = &self.a.hashfile {
            cmd.arg("--hashfile").arg(h);
        }
        for e in &self.a.excludes {
            cmd.args(["--exclude", e]);
        }
        cmd.arg("--").args(roots).stdout(Stdio::piped());
        cmd.spawn().context("starting a dedupe pass")
    }

    /// The pass's stdout, or None when stopped by a signal meanwhile.
    fn wait_child(&self, mut child: Child) -> anyhow::Result<Option<Vec<u8>>> {
        let mut stdout = child.stdout.take().context("dedupe stdout")?;
        let reader = std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = std::io::Read::read_to_end(&mut stdout, &mut buf);
            buf
        });
        let mut signalled = false;
        loop {
            if let Some(_status) = child.try_wait()? {
                break;
            }
            if self.stopped() && !signalled {
                let pid = rustix::process::Pid::from_child(&child);
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                signalled = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = reader.join().unwrap_or_default();
        Ok((!signalled).then_some(out))
    }
}

/// The catalog's racy margin ([`onecopy_scan::RACY_MARGIN_NS`]) and a
/// little more for the coarse clock.
const RACY: Duration = Duration::from_millis(onecopy_scan::RACY_MARGIN_NS as u64 / 1_000_000 + 100);

/// Whether `p`'s mtime or ctime lies within `d` of now (None: gone).
fn changed_within(p: &std::path::Path, d: Duration) -> Option<bool> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(p).ok()?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_nanos() as i128;
    let t = (m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128)
        .max(m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128);
    Some(now - t < d.as_nanos() as i128)
}

/// The catalog directory (and `--hashfile`), canonical where they exist.
fn own_files(a: &WatchArgs) -> Vec<PathBuf> {
    let mut v = vec![crate::dedupe_cmd::default_catalog_dir()];
    v.extend(a.hashfile.clone());
    v.into_iter()
        .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
        .collect()
}

/// Where the generation a root's last pass began at is kept: the catalog
/// directory, one file per root (named by a hash of its path), holding
/// the filesystem's UUID and the generation.
fn generation_file(root: &std::path::Path) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    root.hash(&mut h);
    crate::dedupe_cmd::default_catalog_dir().join(format!("watch-{:016x}.generation", h.finish()))
}

fn fs_uuid_hex(root: &std::path::Path) -> Option<String> {
    let f = std::fs::File::open(root).ok()?;
    let u = onecopy_ioctl::btrfs::fs_uuid(std::os::fd::AsFd::as_fd(&f)).ok()?;
    Some(u.iter().map(|b| format!("{b:02x}")).collect())
}

/// The saved generation of `root` and the wall-clock second of that
/// pass's start, if they were saved for this filesystem.
fn load_generation(root: &std::path::Path) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(generation_file(root)).ok()?;
    let mut f = text.split_whitespace();
    let (uuid, gen, wall) = (f.next()?, f.next()?, f.next()?);
    (Some(uuid.to_string()) == fs_uuid_hex(root)).then_some(())?;
    Some((gen.parse().ok()?, wall.parse().ok()?))
}

/// Seconds since the epoch.
fn wall_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Seconds a ctime may lag the wall clock read before it (coarse clock,
/// rounding to seconds).
const CLOCK_SLACK: u64 = 2;

/// Saves `gen` for `root` (atomically; a failure only costs a walk at the
/// next start).
fn save_generation(root: &std::path::Path, gen: u64, wall: u64) {
    let Some(uuid) = fs_uuid_hex(root) else {
        return;
    };
    let path = generation_file(root);
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, format!("{uuid} {gen} {wall}\n")).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
}

/// What a periodic look found.
enum Look {
    Nothing,
    Files(Vec<PathBuf>),
    Walk,
}

/// Inside one of onecopy's own temporary directories.
fn in_tmp_dir(p: &std::path::Path) -> bool {
    p.components().any(|c| {
        c.as_os_str()
            .to_string_lossy()
            .starts_with(onecopy_scan::TMP_DIR_PREFIX)
    })
}

/// The btrfs generation of each root's filesystem, where known.
fn generations(roots: &[PathBuf]) -> Vec<Option<u64>> {
    roots
        .iter()
        .map(|r| {
            let f = std::fs::File::open(r).ok()?;
            onecopy_ioctl::btrfs::fs_generation(std::os::fd::AsFd::as_fd(&f)).ok()
        })
        .collect()
}

/// The 1-minute load average from /proc/loadavg.
fn load_average() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    s.split_whitespace().next()?.parse().ok()
}
