//! `onecopy watch PATH...`: continuous mode. Files written and closed
//! under the PATHs (fanotify filesystem marks; without them, a periodic
//! look) are deduped once writes have been quiet for `--settle` seconds,
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
use onecopy_watch::{Batch, Change, ChangeSource, Debounce};

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

    /// Hold a batch while the 1-minute load average is above LOAD
    /// (0: no limit).
    #[arg(long, value_name = "LOAD", default_value_t = 0.0)]
    pub max_load: f64,

    /// Block size for matching (as for dedupe).
    #[arg(short = 'b', long, value_name = "SIZE", default_value = "64K")]
    pub block_size: String,

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
    let source = if a.poll {
        None
    } else {
        match ChangeSource::fanotify(&roots, &[onecopy_scan::TMP_DIR_PREFIX]) {
            Ok(s) => Some(s),
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
    };
    w.note(&format!(
        "watching {} path(s) with {}",
        w.roots.len(),
        if source.is_some() {
            "fanotify"
        } else {
            "periodic looks"
        }
    ));
    // Catch up on what changed while not running (cheap: the catalog).
    w.debounce.touch(None, Instant::now() - secs(a.max_delay));
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
}

impl Watcher<'_> {
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
        while !self.stopped() {
            match source {
                Some(s) => {
                    let now = Instant::now();
                    for c in s.wait(TICK)? {
                        match c {
                            Change::Written(p) => self.debounce.touch(Some(p), now),
                            Change::Lost => self.debounce.touch(None, now),
                        }
                    }
                }
                None => {
                    std::thread::sleep(TICK);
                    if Instant::now() >= next_look {
                        if self.changed_since_last_pass() {
                            let settled = Instant::now() - secs(self.a.settle);
                            self.debounce.touch(None, settled);
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

    /// Whether a periodic look must walk: false only when every root is
    /// on btrfs and no filesystem generation moved since the last pass
    /// began (one ioctl per root instead of a walk).
    fn changed_since_last_pass(&self) -> bool {
        let t = Instant::now();
        let now = generations(&self.roots);
        let same = now.iter().all(Option::is_some) && now == self.generations;
        if same {
            self.note(&format!(
                "nothing committed since the last pass (btrfs generation checked in {:.0?}): no walk",
                t.elapsed()
            ));
        }
        !same
    }

    fn load_ok(&self) -> bool {
        self.a.max_load <= 0.0 || load_average().is_none_or(|l| l <= self.a.max_load)
    }

    /// One incremental dedupe over the roots holding the batch's files.
    fn pass(&mut self, batch: Batch) -> anyhow::Result<()> {
        let roots: Vec<&PathBuf> = self
            .roots
            .iter()
            .filter(|r| batch.unknown || batch.paths.iter().any(|p| p.starts_with(r)))
            .collect();
        if roots.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        self.generations = generations(&self.roots);
        let child = self.spawn_dedupe(&roots)?;
        let Some(out) = self.wait_child(child)? else {
            return Ok(());
        };
        let report: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
        let n = |k: &str| report[k].as_u64().unwrap_or(0);
        let what = match batch.paths.len() {
            0 => "look over every path".to_string(),
            n => format!(
                "{n} changed file(s), first {:.2}s ago",
                batch.since.map_or(0.0, |s| s.elapsed().as_secs_f64())
            ),
        };
        self.note(&format!(
            "{what}: read {} file(s), shared {} bytes in {:.2}s",
            n("files_read"),
            n("bytes_deduped"),
            started.elapsed().as_secs_f64(),
        ));
        Ok(())
    }

    fn spawn_dedupe(&self, roots: &[&PathBuf]) -> anyhow::Result<Child> {
        let exe = std::env::current_exe().context("finding the onecopy binary")?;
        let mut cmd = std::process::Command::new(exe);
        cmd.args([
            "dedupe",
            "--json",
            "--quiet",
            "--block-size",
            &self.a.block_size,
        ]);
        cmd.args(["--threads", &self.a.threads.to_string()]);
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
