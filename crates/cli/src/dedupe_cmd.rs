//! `onecopy dedupe`: walk → consult the catalog → read and hash → match
//! and plan → act → remember → report.
//!
//! This module parses nothing itself (`args.rs` does), draws progress and
//! prints; every rule is in an engine crate: which roots qualify
//! (`onecopy_dedupe::roots`), what the catalog knows
//! (`onecopy_catalog::consult`), who may be a source or destination and
//! where re-homing copies go (`onecopy_dedupe::fsrun`), what a run leaves
//! settled and which records it writes (`onecopy_dedupe::policy`), where
//! catalogs and spill files go (`onecopy_catalog::place`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use onecopy_catalog::{place, Catalog, Classifier, FileRecord};
use onecopy_dedupe::{fsrun, policy, roots, ExecOptions, ExecProgress};
use onecopy_ioctl::fs::fs_info;
use onecopy_plan::TableBudget;
use onecopy_scan::{
    hash_files_with, DigestStore, FileEntry, FsId, HashOptions, HashedFile, KnownCopies, Progress,
    Tree, WalkOptions,
};

use crate::args::{DedupeArgs, DEFAULT_BLOCK};
use crate::exit;
use crate::output::{ErrorRecord, Report, Ui};

/// The progress counters the engines update, and the flag a signal sets.
struct Signals {
    scan: Arc<Progress>,
    exec: Arc<ExecProgress>,
    interrupted: Arc<AtomicBool>,
}

impl Signals {
    /// SIGINT and SIGTERM set `interrupted` (a second one ends the process
    /// at once); a watcher thread turns it into cancelling both engines,
    /// so a Ctrl-C at any point ends in a report and exit 130.
    fn install() -> Result<Signals> {
        let s = Signals {
            scan: Arc::new(Progress::default()),
            exec: Arc::new(ExecProgress::default()),
            interrupted: Arc::new(AtomicBool::new(false)),
        };
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            signal_hook::flag::register_conditional_shutdown(
                sig,
                exit::INTERRUPTED as i32,
                s.interrupted.clone(),
            )?;
            signal_hook::flag::register(sig, s.interrupted.clone())?;
        }
        let (flag, scan, exec) = (s.interrupted.clone(), s.scan.clone(), s.exec.clone());
        std::thread::spawn(move || loop {
            if flag.load(Ordering::Relaxed) {
                scan.cancel.store(true, Ordering::Relaxed);
                exec.cancel.store(true, Ordering::Relaxed);
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        });
        Ok(s)
    }

    fn stopped(&self) -> bool {
        self.interrupted.load(Ordering::Relaxed)
    }
}

pub fn run(a: DedupeArgs) -> Result<u8> {
    let started = Instant::now();
    fixed_mmap_threshold();
    // Large groups are opened in batches sized from this limit.
    onecopy_dedupe::fdlimit::raise_nofile_limit();
    // Signals first: a Ctrl-C at any point ends in a report and exit 130.
    let sig = Signals::install()?;
    let ui = Ui::new(a.quiet || a.json, a.verbose);
    let mut a = a;
    if !a.within.is_empty() {
        a.paths = confined_roots(&a.paths, &a.within);
    }
    match check_args(&a) {
        Ok(block) => a.block_size = Some(block),
        Err(code) => return Ok(code),
    }
    let free_before = settled_free(&a.paths);
    // Absolute, symlink-free roots: catalog records hold absolute paths.
    let roots_abs: Vec<PathBuf> = a
        .paths
        .iter()
        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
        .collect();
    let mut report = Report::new(&a);
    let (walked, mut tree) = walk(&a, &roots_abs, &ui, &sig, &mut report);
    // Every file's digests, known or read; the lists without sub-digests
    // in a scratch file next to the catalogs (in RAM if it can not be
    // made: the same answers).
    let mut store = DigestStore::spilling_to(&spill_dir(&a)).unwrap_or_default();
    let Runs { mut runs, to_read } = consult(
        &a,
        walked,
        (&mut tree, &mut store),
        &roots_abs,
        &ui,
        &mut report,
    );
    read(
        &a,
        to_read,
        (&tree, &mut store),
        &mut runs,
        &ui,
        &sig,
        &mut report,
    );
    // Match and plan, one filesystem at a time, then act, then remember.
    let at = (&tree, &store);
    for (&fs, run) in runs.iter_mut() {
        let left = act(&a, fs, run, at, &roots_abs, &ui, &sig, &mut report);
        remember(&a, run, at, &roots_abs, &left, &ui, &sig, &mut report);
    }
    if let Some(e) = store.spill_error() {
        ui.warn(&format!("{e}; matching found less than it could"));
        report.errors.push(ErrorRecord {
            path: spill_dir(&a).display().to_string(),
            error: e,
        });
    }
    finish(&a, report, started, free_before, &sig, &ui)
}

/// Large allocations (128 KiB and up) get pages of their own, given back
/// when freed, instead of staying resident under the planner's peak
/// (measured on `many` 1M, warm: 4.3-4.6 MiB lower peak at 4 KiB blocks,
/// 4.6-5 MiB at 64 KiB; 0.3-0.5 s more planning at 4 KiB, within the
/// totals' noise). Only this command: the mount keeps glibc's default.
fn fixed_mmap_threshold() {
    onecopy_ioctl::process::fix_mmap_threshold(128 << 10);
}

/// Refuses bad arguments and roots clearly, before scanning: the exit code
/// if so, else the block size to match with (`-b`, or the largest block
/// size of the roots' filesystems and at least [`DEFAULT_BLOCK`]).
fn check_args(a: &DedupeArgs) -> Result<u64, u8> {
    let usage = |msg: String| {
        errln!("onecopy: {msg}");
        exit::USAGE
    };
    if let Err(e) = onecopy_scan::validate_excludes(&a.excludes) {
        return Err(usage(format!("invalid --exclude pattern: {e}")));
    }
    let infos: Vec<u64> = check_roots(&a.paths, "onecopy")?
        .iter()
        .map(|i| i.block_size)
        .collect();
    let fs_max = infos.iter().copied().max().unwrap_or(0);
    let block = a.block_size.unwrap_or(fs_max.max(DEFAULT_BLOCK));
    for fs_block in infos {
        roots::check_block_size(block, fs_block).map_err(usage)?;
    }
    match foreign_hashfile(a) {
        Some(msg) => Err(usage(msg)),
        None => Ok(block),
    }
}

/// Lists the files under the roots.
fn walk(
    a: &DedupeArgs,
    roots: &[PathBuf],
    ui: &Ui,
    sig: &Signals,
    report: &mut Report,
) -> (Vec<FileEntry>, Tree) {
    let t = Instant::now();
    let spinner = ui.spinner("walking", &sig.scan);
    let walked = onecopy_scan::walk(
        &WalkOptions {
            roots: roots.to_vec(),
            one_file_system: !a.cross_filesystems,
            excludes: a.excludes.clone(),
            min_size: a.min_size,
            exclude_snapshots: a.exclude_snapshots,
            threads: a.threads.max(2),
        },
        &sig.scan,
    );
    ui.finish(spinner);
    report.phases.insert("walk", t.elapsed().as_secs_f64());
    report.add_skips(&walked.skipped);
    report.add_scan_errors(walked.errors);
    report.snapshots_by_difference = walked.snapshot_diff;
    report.files_scanned = walked.files.len() as u64;
    report.bytes_scanned = walked.files.iter().map(|f| f.size).sum();
    (walked.files, walked.tree)
}

/// Each filesystem's share of a run, and the files still to read.
struct Runs {
    runs: BTreeMap<FsId, FsRun>,
    to_read: Vec<FileEntry>,
}

/// Splits the walked files by filesystem and asks each filesystem's
/// catalog which are known (their digests go to `store`).
fn consult(
    a: &DedupeArgs,
    walked: Vec<FileEntry>,
    (tree, store): (&mut Tree, &mut DigestStore),
    roots: &[PathBuf],
    ui: &Ui,
    report: &mut Report,
) -> Runs {
    let t = Instant::now();
    let mut per_fs: BTreeMap<FsId, FsRun> =
        onecopy_scan::split_by(walked, |e| tree.device(e.dev).fs)
            .into_iter()
            .map(|(fs, walked)| (fs, FsRun::new(walked, tree)))
            .collect();
    let mut to_read = Vec::new();
    for run in per_fs.values_mut() {
        let walked = std::mem::take(&mut run.walked);
        if a.no_catalog {
            append_moving(&mut to_read, walked);
            continue;
        }
        let path = place::catalog_path(a.hashfile.as_deref(), &run.key);
        let fs = (run.fs, run.fs_block);
        let classifier = Classifier::new(&run.key, fs, walked, (&mut *tree, &mut *store), roots);
        let c = onecopy_catalog::consult(&path, a.block(), a.hashfile.is_none(), classifier);
        if let Some(why) = &c.rebuilt {
            ui.warn(&format!("{why}; the catalog was set aside and is rebuilt"));
            report.catalog_rebuilt = true;
        }
        if let Some(e) = &c.failed {
            ui.warn(&format!("{e}; running without a catalog"));
        } else {
            let outside = c
                .classified
                .known
                .iter()
                .filter(|k| k.outside_roots())
                .count();
            report.files_known += (c.classified.known.len() - outside) as u64;
            report.files_known_outside += outside as u64;
            report.files_renamed += c.classified.renamed;
            report.catalogs.push(path.display().to_string());
        }
        let mut known = c.classified.known;
        fsrun::sources_first(&mut known);
        run.known = known.len();
        run.files = known;
        run.deleted = c.classified.deleted;
        run.catalog = c.catalog;
        append_moving(&mut to_read, c.classified.to_read);
    }
    report.phases.insert("catalog", t.elapsed().as_secs_f64());
    Runs {
        runs: per_fs,
        to_read,
    }
}

/// Reads and hashes what the catalogs did not know; each filesystem's
/// files go after its known ones.
fn read(
    a: &DedupeArgs,
    to_read: Vec<FileEntry>,
    (tree, store): (&Tree, &mut DigestStore),
    per_fs: &mut BTreeMap<FsId, FsRun>,
    ui: &Ui,
    sig: &Signals,
    report: &mut Report,
) {
    let t = Instant::now();
    let to_read_bytes = to_read.iter().map(|f| f.size).sum();
    let bar = ui.bytes_bar("reading", to_read_bytes, &sig.scan);
    let opts = HashOptions {
        block_size: a.block(),
        threads: a.threads,
        read_size: 4 << 20,
    };
    let known = KnownByInode::new(&to_read, per_fs, tree);
    let mut hashed = hash_files_with(to_read, tree, store, &opts, &sig.scan, &known);
    drop(known);
    ui.finish(bar);
    report.phases.insert("hash", t.elapsed().as_secs_f64());
    report.add_skips(&hashed.skipped);
    report.add_scan_errors(std::mem::take(&mut hashed.errors));
    report.files_read = hashed.files.len() as u64 - hashed.files_same_extents;
    report.bytes_read = hashed.bytes_read;
    report.files_same_extents = hashed.files_same_extents;
    report.bytes_same_extents = hashed.bytes_same_extents;
    if a.verbose {
        // Read, or from the same extents as a file read: every file
        // not known from a catalog.
        let paths = hashed.files.iter().map(|f| tree.path(f.entry.name));
        report.read_paths = Some(paths.map(|p| p.display().to_string()).collect());
    }
    let fresh = std::mem::take(&mut hashed.files);
    for (fs, fresh) in onecopy_scan::split_by(fresh, |f| tree.device(f.entry.dev).fs) {
        if let Some(run) = per_fs.get_mut(&fs) {
            onecopy_scan::append_shrinking(&mut run.files, fresh);
        }
    }
}

/// Known files by (filesystem, inode, size, mtime), for the files to
/// read: a new snapshot's files keep the inode numbers and times of the
/// files they were taken of, so one of those, if known, is a candidate
/// copy ([`KnownCopies`]). Holds only keys of files to read.
struct KnownByInode<'a> {
    /// At most [`KnownByInode::TRIES`] per key, writable subvolumes' first
    /// (a snapshot is most often taken of a live subvolume).
    map: HashMap<(FsId, u64, u64, i64), Vec<&'a HashedFile>>,
    tree: &'a Tree,
}

impl<'a> KnownByInode<'a> {
    const TRIES: usize = 3;

    fn new(to_read: &[FileEntry], per_fs: &'a BTreeMap<FsId, FsRun>, tree: &'a Tree) -> Self {
        let key = |e: &FileEntry| (tree.device(e.dev).fs, e.ino, e.size, e.mtime_ns);
        let wanted: HashSet<_> = to_read.iter().map(key).collect();
        let mut map = HashMap::new();
        for run in per_fs.values() {
            for f in &run.files[..run.known] {
                let k = key(&f.entry);
                if !wanted.contains(&k) {
                    continue;
                }
                let v: &mut Vec<&HashedFile> = map.entry(k).or_default();
                if !tree.device(f.entry.dev).read_only {
                    v.insert(0, f);
                } else if v.len() < Self::TRIES {
                    v.push(f);
                }
                v.truncate(Self::TRIES);
            }
        }
        KnownByInode { map, tree }
    }
}

impl KnownCopies for KnownByInode<'_> {
    fn candidates(&self, e: &FileEntry) -> Vec<&HashedFile> {
        let fs = self.tree.device(e.dev).fs;
        let key = (fs, e.ino, e.size, e.mtime_ns);
        self.map.get(&key).cloned().unwrap_or_default()
    }
}

/// What a run leaves to the next, per file (see [`onecopy_dedupe::ExecReport`]).
struct Left {
    unsettled: Vec<bool>,
    stale: Vec<bool>,
}

/// Plans one filesystem's dedupe and carries it out; returns which files
/// were left unsettled or stale (none when the run was stopped).
#[allow(clippy::too_many_arguments)]
fn act(
    a: &DedupeArgs,
    fs: FsId,
    run: &FsRun,
    (tree, store): (&Tree, &DigestStore),
    roots: &[PathBuf],
    ui: &Ui,
    sig: &Signals,
    report: &mut Report,
) -> Left {
    if sig.scan.cancelled() {
        let none = vec![false; run.files.len()];
        return Left {
            unsettled: none.clone(),
            stale: none,
        };
    }
    let t = Instant::now();
    let spill = spill_dir(a);
    let budget = TableBudget {
        memory: a.memory,
        spill_dir: Some(spill.clone()),
    };
    let sizes = (a.block(), run.fs_block);
    let (plan, denied) = fsrun::plan(&run.files, (tree, store), sizes, &budget);
    if let Some(e) = &plan.table_error {
        ui.warn(&format!("{e}; matching found less than it could"));
        report.errors.push(ErrorRecord {
            path: spill.display().to_string(),
            error: e.clone(),
        });
    }
    report.files_source_only += denied;
    *report.phases.entry("plan").or_default() += t.elapsed().as_secs_f64();
    report.add_plan(&plan.stats);

    let t = Instant::now();
    let model = fsrun::model(&run.files, tree);
    let total: u64 = plan.ops.iter().map(|o| o.candidate_bytes()).sum();
    let bar = ui.dedupe_bar(a.dry_run, total, &sig.exec);
    let opts = ExecOptions {
        dry_run: a.dry_run,
        model,
        rehome: fsrun::rehome_options(model, a.dry_run, a.rehome_max_write, roots, fs),
        recheck: onecopy_dedupe::Recheck {
            every: a.recheck_every,
            seed: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
        },
    };
    let mut rep = onecopy_dedupe::execute(&run.files, tree, &plan, &opts, &sig.exec);
    ui.finish(bar);
    *report.phases.entry("dedupe").or_default() += t.elapsed().as_secs_f64();
    let left = Left {
        unsettled: std::mem::take(&mut rep.unsettled),
        stale: std::mem::take(&mut rep.stale),
    };
    report.add_exec(rep);
    left
}

/// Remembers every file seen now and forgets the ones gone; only records
/// that changed are written (a warm run rewrites nothing). An interrupted
/// run may have missed files, so it deletes nothing and settles nothing.
#[allow(clippy::too_many_arguments)]
fn remember(
    a: &DedupeArgs,
    run: &mut FsRun,
    at: (&Tree, &DigestStore),
    roots: &[PathBuf],
    left: &Left,
    ui: &Ui,
    sig: &Signals,
    report: &mut Report,
) {
    let Some(cat) = run.catalog.as_mut() else {
        return;
    };
    let t = Instant::now();
    let stopped = sig.stopped();
    let this_run = cat.run();
    let (key, known) = (&run.key, run.known);
    // Consumed by commit_run one record at a time: no second copy of
    // every path and digest list.
    let mut deletes = if stopped {
        Vec::new()
    } else {
        std::mem::take(&mut run.deleted)
    };
    // A stale file's record goes: the next run reads it.
    let subvol = |f: &onecopy_scan::HashedFile| at.0.device(f.entry.dev).subvol;
    let stale = run.files.iter().zip(&left.stale).filter(|(_, s)| **s);
    deletes.extend(stale.map(|(f, _)| (key.clone(), subvol(f), f.entry.ino)));
    let records = run.files.iter().enumerate().filter_map(|(i, f)| {
        if left.stale[i] {
            return None;
        }
        let settled = policy::record_update(f, i < known, stopped, left.unsettled[i], a.dry_run)?;
        FileRecord::of(key, f, at, settled, this_run)
    });
    if let Err(e) = cat.commit_run(roots, records, &deletes) {
        let cat = run.catalog.take().expect("the catalog just written");
        let path = cat.path().display().to_string();
        // Damage set aside is rebuilt (a warning); anything else (a full
        // disk, a permission, damage that could not be set aside) loses
        // this run's work to every later run until it is fixed: an error
        // (exit 1).
        match cat.after_failed_update(e) {
            failed @ onecopy_catalog::FailedUpdate::SetAside { .. } => ui.warn(&failed.to_string()),
            failed => report.errors.push(ErrorRecord {
                path,
                error: failed.to_string(),
            }),
        }
    }
    *report.phases.entry("catalog").or_default() += t.elapsed().as_secs_f64();
}

/// Completes and prints the report; the exit code.
fn finish(
    a: &DedupeArgs,
    mut report: Report,
    started: Instant,
    free_before: Option<u64>,
    sig: &Signals,
    ui: &Ui,
) -> Result<u8> {
    if !a.dry_run {
        report.fs_free_delta = settled_free(&a.paths)
            .zip(free_before)
            .map(|(after, before)| after as i64 - before as i64);
    }
    report.elapsed_secs = started.elapsed().as_secs_f64();
    report.interrupted = sig.stopped();
    let code = if report.interrupted {
        exit::INTERRUPTED
    } else if report.errors.is_empty() {
        exit::OK
    } else {
        exit::PARTIAL
    };
    report.exit_code = code;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    }
    ui.summary(&report);
    Ok(code)
}

/// One filesystem's share of the run.
struct FsRun {
    fs: FsId,
    fs_block: u64,
    /// Stable identity of the filesystem (UUID, else `f_fsid`).
    key: String,
    /// Until the catalog is consulted.
    walked: Vec<FileEntry>,
    /// The known files (sources first), then the files read.
    files: Vec<HashedFile>,
    /// How many of `files` are known.
    known: usize,
    deleted: Vec<(String, u64, u64)>,
    catalog: Option<Catalog>,
}

impl FsRun {
    /// `walked` is not empty (the lists come from [`onecopy_scan::split_by`]).
    fn new(walked: Vec<FileEntry>, tree: &Tree) -> FsRun {
        let d = tree.device(walked[0].dev);
        FsRun {
            fs: d.fs,
            fs_block: d.block,
            key: place::fs_key(d.fs),
            walked,
            files: Vec::new(),
            known: 0,
            deleted: Vec::new(),
            catalog: None,
        }
    }
}

/// Where this run's spill files go (`onecopy_catalog::place`).
fn spill_dir(a: &DedupeArgs) -> PathBuf {
    place::spill_dir(a.hashfile.as_deref(), a.no_catalog)
}

/// Appends `more` to `to`, moving the list instead of copying it when `to`
/// is empty (one filesystem: the usual case).
fn append_moving<T>(to: &mut Vec<T>, mut more: Vec<T>) {
    if to.is_empty() {
        *to = more;
    } else {
        to.append(&mut more);
    }
}

/// `--hashfile` names an existing file that is not a catalog: refused
/// before anything runs, and the file is left untouched.
fn foreign_hashfile(a: &DedupeArgs) -> Option<String> {
    let path = a.hashfile.as_ref().filter(|_| !a.no_catalog)?;
    (onecopy_catalog::identify(path).ok()? == onecopy_catalog::Existing::Foreign)
        .then(|| onecopy_catalog::CatalogError::NotACatalog { path: path.clone() }.to_string())
}

/// The filesystem of every root, checked for deduping (`dedupe` and
/// `watch`); or the exit code of the first that fails, said on stderr
/// after `who`: 2 for a path that cannot be opened, 3 for a filesystem
/// that refuses.
pub fn check_roots(paths: &[PathBuf], who: &str) -> Result<Vec<onecopy_ioctl::fs::FsInfo>, u8> {
    paths
        .iter()
        .map(|p| {
            roots::check_root(p).map_err(|e| {
                errln!("{who}: {e}");
                if e.is_usage() {
                    exit::USAGE
                } else {
                    exit::REFUSED
                }
            })
        })
        .collect()
}

/// The roots of `paths` a run confined to `within` may take
/// ([`roots::confined`], and a filesystem that can dedupe), canonical;
/// each other one is said on stderr and skipped (`watch`: one socket or
/// symbolic link in a batch failed the whole pass).
pub fn confined_roots(paths: &[PathBuf], within: &[PathBuf]) -> Vec<PathBuf> {
    let within: Vec<PathBuf> = within
        .iter()
        .filter_map(|w| std::fs::canonicalize(w).ok())
        .collect();
    let ok = |p: &PathBuf| {
        let real = roots::confined(p, &within).map_err(|e| format!("{}: {e}", p.display()))?;
        roots::check_root(&real).map_err(|e| e.to_string())?;
        Ok::<_, String>(real)
    };
    let mut kept = Vec::new();
    for p in paths {
        match ok(p) {
            Ok(real) => kept.push(real),
            Err(why) => errln!("onecopy: skipped {why}"),
        }
    }
    kept
}

/// Free bytes summed over the distinct filesystems of `paths`, after
/// committing them so that freed extents show.
fn settled_free(paths: &[PathBuf]) -> Option<u64> {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    for p in paths {
        let f = onecopy_scan::longpath::open_nonblocking(p).ok()?;
        let i = fs_info(f.as_fd()).ok()?;
        // One commit per filesystem, not per root (--fdupes gives
        // thousands of file roots on one).
        if seen.insert(i.fsid) {
            let _ = onecopy_ioctl::fs::syncfs(f.as_fd());
            total += fs_info(f.as_fd()).ok()?.free_bytes;
        }
    }
    Some(total)
}
