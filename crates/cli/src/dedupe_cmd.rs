//! `onecopy dedupe`: walk → read and hash → match and plan → act → report.

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use onecopy_catalog::{Catalog, FileRecord, Known};
use onecopy_dedupe::{policy, ExecOptions, ExecProgress, Model, RehomeOptions};
use onecopy_ioctl::fs::{fs_info, FsInfo, FsKind};
use onecopy_plan::{PlanFile, PlanInput, PlanOptions};
use onecopy_scan::{FsId, HashOptions, HashedFile, Progress, WalkOptions};

use crate::args::DedupeArgs;
use crate::exit;
use crate::output::{Report, Ui};

/// A root's filesystem, checked before any scanning.
struct Root {
    info: FsInfo,
}

/// Checks a root: a path that can not be opened is a usage error (exit 2),
/// a filesystem that can not dedupe is exit 3.
fn check_root(path: &Path) -> Result<Root, (u8, String)> {
    let f =
        std::fs::File::open(path).map_err(|e| (exit::USAGE, format!("{}: {e}", path.display())))?;
    let info = fs_info(f.as_fd()).map_err(|e| {
        (
            exit::UNSUPPORTED,
            format!("{}: cannot identify filesystem: {e}", path.display()),
        )
    })?;
    check_fs(path, &f, info).map_err(|m| (exit::UNSUPPORTED, m))
}

fn check_fs(path: &Path, f: &std::fs::File, info: FsInfo) -> Result<Root, String> {
    if !info.kind.supports_dedupe() {
        return Err(format!(
            "{} is on {}, which can not share extents; onecopy dedupes on btrfs and XFS (reflink=1)",
            path.display(),
            info.kind.name()
        ));
    }
    if info.kind == FsKind::Xfs && onecopy_ioctl::fs::xfs_has_reflink(f.as_fd()).ok() == Some(false)
    {
        return Err(format!(
            "{} is on XFS without reflink support (made with -m reflink=0); it can not share extents",
            path.display()
        ));
    }
    if info.read_only {
        return Err(format!(
            "{} is on a read-only mount; nothing can be deduped there",
            path.display()
        ));
    }
    Ok(Root { info })
}

pub fn run(a: DedupeArgs) -> Result<u8> {
    let started = Instant::now();
    // Large groups are opened in batches sized from this limit.
    onecopy_dedupe::fdlimit::raise_nofile_limit();
    // Signals first: a Ctrl-C at any point ends in a report and exit 130.
    let scan_progress = Arc::new(Progress::default());
    let exec_progress = Arc::new(ExecProgress::default());
    let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // A second signal ends the process at once; the next run removes
        // whatever temporary directory that leaves behind.
        signal_hook::flag::register_conditional_shutdown(
            sig,
            exit::INTERRUPTED as i32,
            interrupted.clone(),
        )?;
        signal_hook::flag::register(sig, interrupted.clone())?;
    }
    let watcher = {
        let interrupted = interrupted.clone();
        let sp = scan_progress.clone();
        let ep = exec_progress.clone();
        std::thread::spawn(move || loop {
            if interrupted.load(Ordering::Relaxed) {
                sp.cancel.store(true, Ordering::Relaxed);
                ep.cancel.store(true, Ordering::Relaxed);
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        })
    };
    drop(watcher);
    let ui = Ui::new(a.quiet || a.json, a.verbose);
    if let Err(e) = onecopy_scan::validate_excludes(&a.excludes) {
        eprintln!("onecopy: invalid --exclude pattern: {e}");
        return Ok(exit::USAGE);
    }
    if a.threads == 0 {
        eprintln!("onecopy: --threads must be at least 1");
        return Ok(exit::USAGE);
    }
    // Refuse clearly, before scanning.
    let mut roots = Vec::new();
    for p in &a.paths {
        match check_root(p) {
            Ok(r) => roots.push(r),
            Err((code, msg)) => {
                eprintln!("onecopy: {msg}");
                return Ok(code);
            }
        }
    }
    for r in &roots {
        let fsb = r.info.block_size;
        if a.block_size == 0 || !a.block_size.is_multiple_of(fsb) {
            eprintln!(
                "onecopy: --block-size {} is not a multiple of the filesystem block size {fsb}",
                a.block_size
            );
            return Ok(exit::USAGE);
        }
        if a.block_size > u32::MAX as u64 {
            eprintln!("onecopy: --block-size {} is too large", a.block_size);
            return Ok(exit::USAGE);
        }
    }
    if let Some(msg) = foreign_hashfile(&a) {
        eprintln!("onecopy: {msg}");
        return Ok(exit::USAGE);
    }
    let free_before = settled_free(&a.paths);
    // Absolute, symlink-free roots: catalog records hold absolute paths.
    let roots_abs: Vec<PathBuf> = a
        .paths
        .iter()
        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
        .collect();

    let mut report = Report::new(&a);

    // Walk.
    let t = Instant::now();
    let spinner = ui.spinner("walking", &scan_progress);
    let walked = onecopy_scan::walk(
        &WalkOptions {
            roots: roots_abs.clone(),
            one_file_system: !a.cross_filesystems,
            excludes: a.excludes.clone(),
            min_size: a.min_size,
            threads: a.threads.max(2),
        },
        &scan_progress,
    );
    ui.finish(spinner);
    report.phases.insert("walk", t.elapsed().as_secs_f64());
    report.add_skips(&walked.skipped);
    report.add_scan_errors(walked.errors);
    report.files_scanned = walked.files.len() as u64;
    report.bytes_scanned = walked.files.iter().map(|f| f.size).sum();

    // Split by filesystem; consult each filesystem's catalog.
    let t = Instant::now();
    let mut per_fs: BTreeMap<FsId, FsRun> = onecopy_scan::split_by(walked.files, |e| e.fs)
        .into_iter()
        .map(|(fs, walked)| (fs, FsRun::new(walked)))
        .collect();
    let mut to_read = Vec::new();
    for run in per_fs.values_mut() {
        let walked = std::mem::take(&mut run.walked);
        if a.no_catalog {
            append_moving(&mut to_read, walked);
            continue;
        }
        let path = catalog_path(&a, &run.key);
        // Records are classified as the catalog is read: none is kept.
        let mut classifier =
            onecopy_catalog::Classifier::new(&run.key, run.fs, run.fs_block, walked, &roots_abs);
        let opened = Catalog::open_and_scan(&path, a.block_size, a.hashfile.is_none(), &mut |r| {
            classifier.offer(r)
        });
        match opened {
            Ok((cat, why)) => {
                if let Some(why) = why {
                    ui.warn(&format!("{why}; the catalog was set aside and is rebuilt"));
                    report.catalog_rebuilt = true;
                    classifier.forget();
                }
                let c = classifier.finish();
                report.files_known += c.known.len() as u64;
                report.files_renamed += c.renamed;
                report.catalogs.push(path.display().to_string());
                append_moving(&mut to_read, c.to_read);
                run.known = c.known;
                run.deleted = c.deleted;
                run.catalog = Some(cat);
            }
            Err(e) => {
                ui.warn(&format!("{e}; running without a catalog"));
                classifier.forget();
                append_moving(&mut to_read, classifier.finish().to_read);
            }
        }
    }
    report.phases.insert("catalog", t.elapsed().as_secs_f64());

    // Read and hash what the catalogs did not know.
    let t = Instant::now();
    let to_read_bytes = to_read.iter().map(|f| f.size).sum();
    let bar = ui.bytes_bar("reading", to_read_bytes, &scan_progress);
    let mut hashed = onecopy_scan::hash_files(
        to_read,
        &HashOptions {
            block_size: a.block_size,
            threads: a.threads,
            read_size: 4 << 20,
        },
        &scan_progress,
    );
    ui.finish(bar);
    report.phases.insert("hash", t.elapsed().as_secs_f64());
    report.add_skips(&hashed.skipped);
    report.add_scan_errors(std::mem::take(&mut hashed.errors));
    report.files_read = hashed.files.len() as u64;
    report.bytes_read = hashed.bytes_read;
    if a.verbose {
        report.read_paths = Some(
            hashed
                .files
                .iter()
                .map(|f| f.entry.path.display().to_string())
                .collect(),
        );
    }
    for (fs, fresh) in onecopy_scan::split_by(std::mem::take(&mut hashed.files), |f| f.entry.fs) {
        if let Some(run) = per_fs.get_mut(&fs) {
            run.fresh = fresh;
        }
    }

    // Match and plan, one filesystem at a time, then act, then remember.
    for (&fs, run) in per_fs.iter_mut() {
        // Sources first: files outside the roots, then settled ones, so
        // that known canonical copies stay canonical.
        run.known.sort_by_key(|k| (!k.outside_roots, !k.settled));
        let files: Vec<&HashedFile> = run
            .known
            .iter()
            .map(|k| &k.file)
            .chain(run.fresh.iter())
            .collect();
        let settled: Vec<bool> = run
            .known
            .iter()
            .map(|k| k.settled)
            .chain(run.fresh.iter().map(|_| false))
            .collect();
        let outside: Vec<bool> = run
            .known
            .iter()
            .map(|k| k.outside_roots)
            .chain(run.fresh.iter().map(|_| false))
            .collect();
        let mut unsettled = vec![false; files.len()];
        if !scan_progress.cancelled() {
            let t = Instant::now();
            // Roles once per file (1 B each); the planner's views of the
            // records are made as it asks for them.
            let roles: Vec<u8> = files
                .iter()
                .zip(&outside)
                .map(|(f, &out)| {
                    // Readable but not this user's to change: a source only.
                    let (roles, denied) =
                        policy::roles_with_access(out, f.entry.read_only, f.inode_flags, || {
                            onecopy_dedupe::access::may_dedupe_into(&f.entry.path)
                        });
                    report.files_source_only += denied as u64;
                    u8::from(roles.can_be_dest) | u8::from(roles.can_be_src) << 1
                })
                .collect();
            let plan = onecopy_plan::plan_input(
                &PlanView {
                    files: &files,
                    roles: &roles,
                },
                &PlanOptions {
                    block_size: a.block_size,
                    zero_digest: onecopy_scan::zero_block_digest(a.block_size, run.fs_block),
                    min_run: 0,
                    sub_size: run.fs_block,
                },
            );
            drop(roles);
            *report.phases.entry("plan").or_default() += t.elapsed().as_secs_f64();
            report.add_plan(&plan.stats);

            let t = Instant::now();
            let entries: Vec<&onecopy_scan::FileEntry> = files.iter().map(|f| &f.entry).collect();
            let model = entries
                .first()
                .map_or(Model::Ranges, |e| Model::probe(&e.path, e.ino));
            let total: u64 = plan.ops.iter().map(|o| o.candidate_bytes()).sum();
            let bar = ui.dedupe_bar(a.dry_run, total, &exec_progress);
            // Unnamed temporary files opened in a root (O_TMPFILE): no
            // name ever appears there.
            let rehome =
                (model == Model::Extents && !a.dry_run && a.rehome_max_write > 0).then(|| {
                    let parent = onecopy_dedupe::tmpdir::parent_for(&roots_abs, fs);
                    onecopy_dedupe::tmpdir::remove_stale(&parent);
                    RehomeOptions {
                        tmp_dir: parent,
                        max_write: a.rehome_max_write,
                    }
                });
            let rep = onecopy_dedupe::execute(
                &entries,
                &plan,
                &ExecOptions {
                    dry_run: a.dry_run,
                    model,
                    rehome,
                },
                &settled,
                &exec_progress,
            );
            ui.finish(bar);
            *report.phases.entry("dedupe").or_default() += t.elapsed().as_secs_f64();
            unsettled.clone_from(&rep.unsettled);
            report.add_exec(rep);
        }

        // Remember: every file seen now, and forget the ones gone. An
        // interrupted run may have missed files, so it deletes nothing and
        // settles nothing.
        if let Some(cat) = run.catalog.as_mut() {
            let t = Instant::now();
            let stopped = interrupted.load(Ordering::Relaxed);
            let this_run = cat.run();
            let key = run.key.clone();
            // Only what changed is written: a warm run rewrites nothing.
            let records = files.iter().enumerate().filter_map(|(i, f)| {
                // A dry run changes nothing, so it settles nothing that
                // was not settled before.
                let known = run.known.get(i);
                let was = known.is_none_or(|k| k.settled);
                let settled_now = policy::settled_after_run(stopped, unsettled[i], a.dry_run, was);
                let known = known.map(|k| (k.dirty, k.settled));
                policy::record_needs_write(known, settled_now, f.racy).then(|| FileRecord {
                    fs: key.clone(),
                    subvol: f.entry.subvol,
                    ino: f.entry.ino,
                    generation: f.generation,
                    path: f.entry.path.clone(),
                    size: f.entry.size,
                    mtime_ns: f.entry.mtime_ns,
                    ctime_ns: f.entry.ctime_ns,
                    nlink: f.entry.nlink,
                    whole: f.whole,
                    blocks: f.blocks().to_vec(),
                    flags: f.inode_flags,
                    settled: settled_now,
                    last_seen: this_run,
                })
            });
            // Consumed by commit_run one record at a time: no second copy
            // of every path and digest list.
            let deletes = if stopped {
                Vec::new()
            } else {
                std::mem::take(&mut run.deleted)
            };
            if let Err(e) = cat.commit_run(&roots_abs, records, &deletes) {
                let cat = run.catalog.take().expect("the catalog just written");
                ui.warn(&catalog_not_updated(cat, e));
            }
            *report.phases.entry("catalog").or_default() += t.elapsed().as_secs_f64();
        }
    }

    if !a.dry_run {
        report.fs_free_delta = settled_free(&a.paths)
            .zip(free_before)
            .map(|(after, before)| after as i64 - before as i64);
    }
    report.elapsed_secs = started.elapsed().as_secs_f64();
    report.interrupted = interrupted.load(Ordering::Relaxed);
    let code = if report.interrupted {
        exit::INTERRUPTED
    } else if report.errors.is_empty() {
        exit::OK
    } else {
        exit::PARTIAL
    };
    report.exit_code = code;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    ui.summary(&report);
    Ok(code)
}

/// The planner's view of one filesystem's records: `roles[i]` holds
/// `can_be_dest` in bit 0 and `can_be_src` in bit 1 for `files[i]`.
struct PlanView<'a> {
    files: &'a [&'a HashedFile],
    roles: &'a [u8],
}

impl PlanInput for PlanView<'_> {
    fn len(&self) -> usize {
        self.files.len()
    }

    fn file(&self, i: u32) -> PlanFile<'_> {
        let (f, r) = (self.files[i as usize], self.roles[i as usize]);
        PlanFile {
            size: f.entry.size,
            blocks: f.blocks(),
            subs: f.subs(),
            whole: f.whole,
            can_be_dest: r & 1 != 0,
            can_be_src: r & 2 != 0,
        }
    }
}

/// One filesystem's share of the run.
struct FsRun {
    fs: FsId,
    fs_block: u64,
    /// Stable identity of the filesystem (UUID, else `f_fsid`).
    key: String,
    walked: Vec<onecopy_scan::FileEntry>,
    known: Vec<Known>,
    fresh: Vec<HashedFile>,
    deleted: Vec<(String, u64, u64)>,
    catalog: Option<Catalog>,
}

impl FsRun {
    /// `walked` is not empty (the lists come from [`onecopy_scan::split_by`]).
    fn new(walked: Vec<onecopy_scan::FileEntry>) -> FsRun {
        let (fs, fs_block) = (walked[0].fs, walked[0].fs_block);
        FsRun {
            fs,
            fs_block,
            key: fs_key(fs),
            walked,
            known: Vec::new(),
            fresh: Vec::new(),
            deleted: Vec::new(),
            catalog: None,
        }
    }
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

/// A filesystem identity that survives remounts: `FsInfo::fsid` is derived
/// from the filesystem's UUID on btrfs and XFS.
fn fs_key(fsid: FsId) -> String {
    format!("fs-{fsid:016x}")
}

/// Where the catalogs live by default: `$ONECOPY_CACHE_DIR` if set, else
/// `/var/cache/onecopy` for root, `$XDG_CACHE_HOME/onecopy` (or
/// `~/.cache/onecopy`) for others.
pub fn default_catalog_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("ONECOPY_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if rustix::process::geteuid().is_root() {
        return PathBuf::from("/var/cache/onecopy");
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(x).join("onecopy");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("onecopy")
}

/// `--hashfile` names an existing file that is not a catalog: refused
/// before anything runs, and the file is left untouched.
fn foreign_hashfile(a: &DedupeArgs) -> Option<String> {
    let path = a.hashfile.as_ref().filter(|_| !a.no_catalog)?;
    (onecopy_catalog::identify(path).ok()? == onecopy_catalog::Existing::Foreign)
        .then(|| onecopy_catalog::CatalogError::NotACatalog { path: path.clone() }.to_string())
}

fn catalog_path(a: &DedupeArgs, key: &str) -> PathBuf {
    match &a.hashfile {
        Some(p) => p.clone(),
        None => default_catalog_dir().join(format!("{key}.sqlite")),
    }
}

/// Free bytes summed over the distinct filesystems of `paths`, after
/// committing them so that freed extents show.
fn settled_free(paths: &[PathBuf]) -> Option<u64> {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    for p in paths {
        let f = std::fs::File::open(p).ok()?;
        let _ = onecopy_ioctl::fs::syncfs(f.as_fd());
        let i = fs_info(f.as_fd()).ok()?;
        if seen.insert(i.fsid) {
            total += i.free_bytes;
        }
    }
    Some(total)
}

/// What to say when a run's catalog could not be written. Damage that
/// loading did not notice (SQLite reports it only when a write reaches the
/// damaged page) sets the catalog aside, so that the next run rebuilds it
/// rather than failing the same way forever; the files are unaffected.
fn catalog_not_updated(cat: Catalog, e: onecopy_catalog::CatalogError) -> String {
    if !e.is_damage() {
        return format!("cannot update the catalog: {e}");
    }
    match cat.set_aside_damaged() {
        Ok(aside) => format!(
            "cannot update the catalog: {e}; it is damaged and was set aside as {}; the next run rebuilds it",
            aside.display()
        ),
        Err(e2) => format!("cannot update the catalog: {e}; setting it aside failed: {e2}"),
    }
}
