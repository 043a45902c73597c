//! `onecopy watch PATH...`: continuous mode. Files written and closed,
//! created or renamed into the PATHs (fanotify filesystem marks; without
//! them, a periodic look: on btrfs a tree search for what changed since
//! the last pass, elsewhere an incremental walk) are deduped once writes have been quiet for `--settle` seconds,
//! by an incremental `onecopy dedupe` run: the catalog means only new and
//! changed files are read, and it is what carries the state across
//! restarts (the first pass after a start catches up on what changed while
//! stopped). SIGTERM/SIGINT end the run in progress cleanly, then exit 0.
//!
//! This module handles arguments, signals, the pass's child process and
//! the lines it prints; the rules (when a batch is due, which files are
//! too fresh, search or walk, the saved generations) are `onecopy_watch`'s.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use onecopy_catalog::place;
use onecopy_dedupe::roots;
use onecopy_watch::{fresh, Batch, Change, ChangeSource, Debounce, LastPass, Look, Mode, OwnFiles};

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

    /// Do not read or dedupe files in btrfs snapshots (as for dedupe):
    /// changes inside one are left alone.
    #[arg(long)]
    pub exclude_snapshots: bool,

    /// Files read in parallel per pass (1 to 256).
    #[arg(short = 'j', long, value_name = "N", default_value_t = 2,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(1..=crate::args::MAX_THREADS))]
    pub threads: usize,

    /// Print nothing but errors (no line per pass).
    #[arg(short, long)]
    pub quiet: bool,
}

const TICK: Duration = Duration::from_millis(200);

pub fn run(a: WatchArgs) -> anyhow::Result<u8> {
    // Checked as `dedupe` checks them, with its exit codes: a root that
    // is not there is a usage error, one that cannot be deduped is
    // refused (watch used to say so and then wait for ever).
    if let Err(code) = crate::dedupe_cmd::check_roots(&a.paths, "onecopy watch") {
        return Ok(code);
    }
    let roots = canonical_roots(&a.paths)?;
    let identities = roots.iter().map(|r| identity(r)).collect();
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
        match ChangeSource::best(&roots, &[]) {
            Ok((s, None)) => Some(s),
            Ok((s, Some(why))) => {
                errln!(
                    "onecopy watch: fanotify names ({why}): watching writes only; \
                     files renamed into a PATH wait for a look every {}s",
                    a.interval
                );
                Some(s)
            }
            Err(e) => {
                errln!("onecopy watch: {e}; looking every {}s instead", a.interval);
                None
            }
        }
    };
    let mut w = Watcher {
        a: &a,
        roots,
        stop,
        debounce: Debounce::new(secs(a.settle), secs(a.max_delay)),
        last: LastPass::default(),
        held: false,
        own: OwnFiles::new(place::default_dir(), a.hashfile.clone()),
        identities,
        retry: Retry::default(),
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
    w.catch_up();
    w.run(source.as_ref())
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

/// A root's device and inode: the directory it names now.
fn identity(root: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(root).ok()?;
    Some((m.dev(), m.ino()))
}

/// After a failed pass, when to walk every PATH again: 10 s, doubling
/// to `--interval` while passes keep failing.
#[derive(Debug, Default)]
struct Retry {
    at: Option<Instant>,
    wait: Duration,
}

impl Retry {
    fn failed(&mut self, now: Instant, most: Duration) -> Duration {
        self.wait =
            (self.wait * 2).clamp(Duration::from_secs(10), most.max(Duration::from_secs(10)));
        self.at = Some(now + self.wait);
        self.wait
    }

    fn succeeded(&mut self) {
        *self = Retry::default();
    }

    /// Whether a retry is due now (then it is taken).
    fn due(&mut self, now: Instant) -> bool {
        let due = self.at.is_some_and(|at| now >= at);
        if due {
            self.at = None;
        }
        due
    }
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
    /// Where the last pass began (generations empty before the first).
    last: LastPass,
    /// A batch is held back by the load limit (noted once per hold).
    held: bool,
    own: OwnFiles,
    /// Each root's (device, inode) at the start: a root removed, renamed
    /// or unmounted since ends the run.
    identities: Vec<Option<(u64, u64)>>,
    retry: Retry,
}

impl Watcher<'_> {
    /// Catches up on what changed while not running: on btrfs, when the
    /// last run left its generations, a tree search since them; else a
    /// pass over every PATH (cheap: the catalog).
    fn catch_up(&mut self) {
        let caught_up = match LastPass::saved(&place::default_dir(), &self.roots) {
            Some(last) => {
                self.last = last;
                let settled = Instant::now() - secs(self.a.settle);
                match self.look() {
                    Some(v) => v
                        .into_iter()
                        .for_each(|p| self.debounce.touch(Some(p), settled)),
                    None => self.debounce.touch(None, settled),
                }
                true
            }
            None => false,
        };
        if !caught_up {
            self.debounce
                .touch(None, Instant::now() - secs(self.a.max_delay));
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    fn note(&self, msg: &str) {
        if !self.a.quiet {
            errln!("onecopy watch: {msg}");
        }
    }

    fn run(&mut self, source: Option<&ChangeSource>) -> anyhow::Result<u8> {
        let mut next_look = Instant::now() + secs(self.a.interval);
        let mut next_full = Instant::now() + secs(self.a.full_interval);
        while !self.stopped() {
            if let Some(gone) = self.root_gone() {
                errln!(
                    "onecopy watch: {}: gone (removed, renamed or unmounted); stopping",
                    gone.display()
                );
                return Ok(exit::USAGE);
            }
            if self.retry.due(Instant::now()) {
                self.debounce
                    .touch(None, Instant::now() - secs(self.a.settle));
            }
            match source {
                Some(s) => self.wait_changes(s)?,
                None => {
                    std::thread::sleep(TICK);
                    if Instant::now() >= next_look {
                        self.periodic_look(&mut next_full);
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

    /// A root that no longer names the directory it named at the start.
    fn root_gone(&self) -> Option<&PathBuf> {
        let now = self.roots.iter().map(|r| identity(r));
        let mut both = self.roots.iter().zip(self.identities.iter().zip(now));
        both.find(|(_, (then, now))| now.is_none() || *then != now)
            .map(|(r, _)| r)
    }

    /// Up to a tick of fanotify's changes into the batch.
    fn wait_changes(&mut self, s: &ChangeSource) -> anyhow::Result<()> {
        let now = Instant::now();
        for c in s.wait(TICK)? {
            match c {
                Change::Written(p) if self.own.contains(&p) => {}
                Change::Written(p) => self.debounce.touch(Some(p), now),
                Change::Lost => self.debounce.touch(None, now),
            }
        }
        Ok(())
    }

    /// Without fanotify: a walk every `--full-interval`, else a look.
    fn periodic_look(&mut self, next_full: &mut Instant) {
        let settled = Instant::now() - secs(self.a.settle);
        if Instant::now() >= *next_full {
            self.debounce.touch(None, settled);
            *next_full = Instant::now() + secs(self.a.full_interval);
            return;
        }
        match self.look() {
            Some(v) => v
                .into_iter()
                .for_each(|p| self.debounce.touch(Some(p), settled)),
            None => self.debounce.touch(None, settled),
        }
    }

    /// A look since the last pass ([`LastPass::look`]), noted: the files
    /// changed (maybe none), or None for a walk.
    fn look(&self) -> Option<Vec<PathBuf>> {
        let t = Instant::now();
        let skip = |p: &Path| self.own.contains(p);
        match self.last.look(&self.roots, skip) {
            Look::Walk => None,
            Look::Unchanged => {
                self.note(&format!(
                    "nothing committed since the last pass (btrfs generation checked in {:.0?}): no walk",
                    t.elapsed()
                ));
                Some(Vec::new())
            }
            Look::Failed { root, error } => {
                self.note(&format!(
                    "tree search of {}: {error}; walking",
                    root.display()
                ));
                None
            }
            Look::Searched(files) => {
                self.note(&format!(
                    "btrfs tree search since generation {}: {} changed file(s) in {:.1?}{}",
                    self.last.generations.iter().flatten().min().unwrap_or(&0),
                    files.len(),
                    t.elapsed(),
                    if files.is_empty() { ": no walk" } else { "" },
                ));
                Some(files)
            }
        }
    }

    /// Whether the load average allows a pass now (noted once per hold).
    fn load_ok(&mut self) -> bool {
        let load = onecopy_watch::load_average();
        let ok = onecopy_watch::load_allows(self.a.max_load, load);
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

    /// One incremental dedupe: over every root for an unnamed change or a
    /// batch too large to name, else over the batch's files that still
    /// exist and have settled (the catalog supplies the rest of the
    /// filesystem as sources, without a walk); too fresh ones wait.
    fn pass(&mut self, batch: Batch) -> anyhow::Result<()> {
        let settled = fresh::settled(&batch.paths);
        for p in settled.fresh {
            self.debounce.touch(Some(p.clone()), Instant::now());
        }
        // Only files and directories under the roots: a symbolic link
        // renamed in would have the pass dedupe what it points at, and a
        // socket failed the whole pass (the child checks again).
        let ready: Vec<&PathBuf> = (settled.ready.into_iter())
            .filter(|p| roots::confined(p, &self.roots).is_ok())
            .collect();
        let walk = onecopy_watch::pass_walks(batch.unknown, &ready);
        let roots: Vec<&PathBuf> = if walk {
            self.roots.iter().collect()
        } else {
            ready
        };
        if roots.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        self.last = LastPass::begin(&self.roots);
        let child = self.spawn_dedupe(&roots, walk)?;
        let Some((status, out)) = self.wait_child(child)? else {
            return Ok(());
        };
        let what = if walk {
            "look over every path".to_string()
        } else {
            let first = batch.since.map_or(0.0, |s| s.elapsed().as_secs_f64());
            format!("{} changed file(s), first {first:.2}s ago", roots.len())
        };
        // Exit 1 is a pass done in part (files that changed or failed are
        // in its report); anything else did not run.
        if !matches!(status.code(), Some(c) if c == i32::from(exit::OK) || c == i32::from(exit::PARTIAL))
        {
            let wait = self.retry.failed(Instant::now(), secs(self.a.interval));
            errln!(
                "onecopy watch: {what}: the pass failed ({status}); every path is looked at again in {}s",
                wait.as_secs()
            );
            return Ok(());
        }
        self.retry.succeeded();
        let report: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
        self.note_pass(&what, &report, started);
        // A walk reads whatever it meets, racy files too: read them again
        // once settled, so that the catalog holds them.
        let read = report["read_paths"].as_array().into_iter().flatten();
        let read = read.map(|p| PathBuf::from(p.as_str().unwrap_or_default()));
        for p in fresh::read_while_fresh(read, started.elapsed()) {
            self.debounce.touch(Some(p), Instant::now());
        }
        // Everything changed before the pass began is deduped or recorded:
        // the next start searches from there (only when nothing waits).
        if !self.debounce.pending() {
            self.last.save(&place::default_dir(), &self.roots);
        }
        Ok(())
    }

    /// The line of a pass, from its `--json` report.
    fn note_pass(&self, what: &str, report: &serde_json::Value, started: Instant) {
        let n = |k: &str| report[k].as_u64().unwrap_or(0);
        self.note(&format!(
            "{what}: scanned {}, read {} file(s), shared {} bytes in {:.2}s",
            n("files_scanned"),
            n("files_read"),
            n("bytes_deduped"),
            started.elapsed().as_secs_f64(),
        ));
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
        if self.a.exclude_snapshots {
            cmd.arg("--exclude-snapshots");
        }
        for r in &self.roots {
            cmd.arg("--within").arg(r);
        }
        cmd.arg("--").args(roots).stdout(Stdio::piped());
        cmd.spawn().context("starting a dedupe pass")
    }

    /// The pass's exit status and stdout, or None when stopped by a
    /// signal meanwhile.
    fn wait_child(
        &self,
        mut child: Child,
    ) -> anyhow::Result<Option<(std::process::ExitStatus, Vec<u8>)>> {
        let mut stdout = child.stdout.take().context("dedupe stdout")?;
        let reader = std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = std::io::Read::read_to_end(&mut stdout, &mut buf);
            buf
        });
        let mut signalled = false;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if self.stopped() && !signalled {
                let pid = rustix::process::Pid::from_child(&child);
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                signalled = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let out = reader.join().unwrap_or_default();
        Ok((!signalled).then_some((status, out)))
    }
}
