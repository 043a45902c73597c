//! The report (text and JSON) and progress bars.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use indicatif::HumanBytes;
use onecopy_dedupe::{DestSkip, ExecProgress, ExecReport, ExecStats};
use onecopy_plan::PlanStats;
use onecopy_scan::{Progress, ScanError, SkipReason, SnapshotDiff};
use serde::Serialize;

use crate::args::DedupeArgs;
use crate::progress::{Bars, Live};

#[derive(Debug, Serialize)]
pub struct ErrorRecord {
    pub path: String,
    pub error: String,
}

/// Everything a run reports. Serialized as the `--json` output; field
/// names are a stable interface.
#[derive(Debug, Serialize, Default)]
pub struct Report {
    pub version: u32,
    pub dry_run: bool,
    pub roots: Vec<String>,
    pub block_size: u64,
    /// Eligible regular files found by the walk (one per inode).
    pub files_scanned: u64,
    pub bytes_scanned: u64,
    /// Files read and fingerprinted.
    pub files_read: u64,
    pub bytes_read: u64,
    /// Files not read because their bytes sit in the same extents as a
    /// file read in this run (snapshots, reflink copies): its
    /// fingerprints were reused.
    pub files_same_extents: u64,
    pub bytes_same_extents: u64,
    /// Read-only snapshots of walked subvolumes, listed by difference:
    /// `snapshots`, and `files_as_parent`/`bytes_as_parent`, their files
    /// not listed at all (the same inode, unchanged, as in the subvolume
    /// they were taken of, whose file stands for them).
    pub snapshots_by_difference: SnapshotDiff,
    /// Files under the PATHs whose fingerprints came from the catalog
    /// (not read).
    pub files_known: u64,
    /// Files outside the PATHs, known from the catalog and unchanged,
    /// used as sources only.
    pub files_known_outside: u64,
    /// Of those, files found under a new path (renamed or moved).
    pub files_renamed: u64,
    /// Catalog files used.
    pub catalogs: Vec<String>,
    /// A catalog was damaged, foreign or of another format, and rebuilt.
    pub catalog_rebuilt: bool,
    /// With --verbose: the paths of the files read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_paths: Option<Vec<String>>,
    /// Files not considered, by reason.
    pub files_skipped: BTreeMap<SkipReason, u64>,
    /// Files this user may read but not change (not the owner, no write
    /// permission, not root): used as sources only, never deduped into.
    pub files_source_only: u64,
    pub plan: PlanStats,
    /// Bytes of RAM per indexed block in the fingerprint table.
    pub index_bytes_per_block: u64,
    /// What the executor did: dedupe_ioctls, ranges_deduped, bytes_deduped
    /// (newly shared), bytes_already_shared, ranges_settled, bytes_freed
    /// (allocations no file pins any more), bytes_would_share (dry run),
    /// rehome_* (rehome_bytes_written: bytes copied to release partly
    /// referenced extents; bytes_freed is net of them), ranges_skipped
    /// (by reason).
    #[serde(flatten)]
    pub exec: ExecStats,
    /// Change of the filesystems' free space over the run, after commit.
    pub fs_free_delta: Option<i64>,
    pub errors: Vec<ErrorRecord>,
    pub phases: BTreeMap<&'static str, f64>,
    pub elapsed_secs: f64,
    pub interrupted: bool,
    pub exit_code: u8,
}

impl Report {
    pub fn new(a: &DedupeArgs) -> Report {
        Report {
            version: 1,
            dry_run: a.dry_run,
            roots: a.paths.iter().map(|p| p.display().to_string()).collect(),
            block_size: a.block(),
            index_bytes_per_block: onecopy_plan::FingerprintTable::BYTES_PER_ENTRY as u64,
            ..Default::default()
        }
    }

    pub fn add_skips(&mut self, s: &BTreeMap<SkipReason, u64>) {
        for (k, v) in s {
            *self.files_skipped.entry(*k).or_default() += v;
        }
    }

    pub fn add_scan_errors(&mut self, errs: Vec<ScanError>) {
        for e in errs {
            self.errors.push(ErrorRecord {
                path: e.path().display().to_string(),
                error: e.to_string(),
            });
        }
    }

    pub fn add_plan(&mut self, p: &PlanStats) {
        let q = &mut self.plan;
        q.whole_file_groups += p.whole_file_groups;
        q.whole_file_dests += p.whole_file_dests;
        q.whole_file_bytes += p.whole_file_bytes;
        q.block_runs += p.block_runs;
        q.block_run_bytes += p.block_run_bytes;
        q.index_entries += p.index_entries;
        q.index_memory_bytes = q.index_memory_bytes.max(p.index_memory_bytes);
        q.index_spilled += p.index_spilled;
        q.index_disk_reads += p.index_disk_reads;
    }

    pub fn add_exec(&mut self, r: ExecReport) {
        self.exec.merge(&r.stats);
        for e in r.errors {
            self.errors.push(ErrorRecord {
                path: e.path().display().to_string(),
                error: e.to_string(),
            });
        }
    }
}

/// Progress and text output on stderr/stdout.
pub struct Ui {
    quiet: bool,
    verbose: bool,
    bars: Bars,
}

pub type Bar = Option<Live>;

const BYTES_TEMPLATE: &str =
    "{prefix}: [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta} {msg}";

impl Ui {
    pub fn new(quiet: bool, verbose: bool) -> Ui {
        Ui {
            quiet,
            verbose,
            // Bars whenever stderr is a terminal (also with --json, whose report
            // goes to stdout); never on a pipe or file.
            bars: Bars::new(std::io::stderr().is_terminal()),
        }
    }

    pub fn spinner(&self, what: &'static str, p: &Arc<Progress>) -> Bar {
        let p = p.clone();
        self.bars
            .show(None, "{spinner} {prefix}: {msg}", what, move |pb| {
                pb.set_message(format!(
                    "{} files, {}",
                    p.files_found.load(Ordering::Relaxed),
                    HumanBytes(p.bytes_found.load(Ordering::Relaxed))
                ));
            })
    }

    pub fn bytes_bar(&self, what: &'static str, total: u64, p: &Arc<Progress>) -> Bar {
        let p = p.clone();
        self.bars
            .show(Some(total), BYTES_TEMPLATE, what, move |pb| {
                pb.set_position(p.bytes_done.load(Ordering::Relaxed));
                pb.set_message(format!("{} files", p.files_done.load(Ordering::Relaxed)));
            })
    }

    pub fn dedupe_bar(&self, dry: bool, total: u64, p: &Arc<ExecProgress>) -> Bar {
        let p = p.clone();
        let what = if dry { "planning" } else { "sharing" };
        self.bars
            .show(Some(total), BYTES_TEMPLATE, what, move |pb| {
                pb.set_position(p.bytes_done.load(Ordering::Relaxed));
                pb.set_message(format!("{} ops", p.ops_done.load(Ordering::Relaxed)));
            })
    }

    pub fn finish(&self, bar: Bar) {
        self.bars.finish(bar);
    }

    pub fn warn(&self, msg: &str) {
        self.bars.eprintln(&format!("onecopy: warning: {msg}"));
    }

    pub fn summary(&self, r: &Report) {
        let shown = if self.verbose { usize::MAX } else { 10 };
        for e in r.errors.iter().take(shown) {
            errln!("onecopy: {}", e.error);
        }
        if r.errors.len() > shown {
            errln!(
                "onecopy: ... and {} more errors (use --verbose to list all)",
                r.errors.len() - shown
            );
        }
        if self.quiet {
            return;
        }
        print_files(r);
        outln!(
            "Found {} identical-file groups ({} copies) and {} block runs ({})",
            r.plan.whole_file_groups,
            r.plan.whole_file_dests,
            r.plan.block_runs,
            h(r.plan.block_run_bytes)
        );
        if r.dry_run {
            outln!(
                "Dry run: would share {} (about {} freed); {} already shared{}",
                h(r.exec.bytes_would_share),
                h(r.exec.bytes_freed),
                h(r.exec.bytes_already_shared),
                settled(&r.exec)
            );
        } else {
            print_shared(r);
            print_pinned(&r.exec);
            print_rehomed(&r.exec);
        }
        if !r.exec.skipped.is_empty() {
            outln!("Ranges not deduped: {}", counts(&r.exec.skipped, dest_name));
        }
        if r.interrupted {
            outln!("Interrupted: the figures above cover the work done before the signal.");
        }
    }
}

fn h(b: u64) -> String {
    HumanBytes(b).to_string()
}

/// `N name` for each entry of `m`, comma-separated.
fn counts<K: Copy>(m: &BTreeMap<K, u64>, name: fn(K) -> &'static str) -> String {
    let parts: Vec<String> = m.iter().map(|(k, v)| format!("{v} {}", name(*k))).collect();
    parts.join(", ")
}

/// The summary's lines about files: scanned and read, known, skipped,
/// sources only.
fn print_files(r: &Report) {
    outln!(
        "Scanned {} files ({}), read {} ({}) in {:.1}s",
        r.files_scanned,
        h(r.bytes_scanned),
        r.files_read,
        h(r.bytes_read),
        r.elapsed_secs
    );
    if r.files_same_extents > 0 {
        outln!(
            "In extents already read, not read again: {} files ({}: snapshots, reflink copies)",
            r.files_same_extents,
            h(r.bytes_same_extents)
        );
    }
    let d = &r.snapshots_by_difference;
    if d.snapshots > 0 {
        outln!(
            "Listed {} read-only snapshots by their difference from the subvolume they were taken of: {} unchanged files ({}) not looked at",
            d.snapshots,
            d.files_as_parent,
            h(d.bytes_as_parent)
        );
    }
    if r.files_known > 0 {
        outln!(
            "Known from the catalog, not read: {} files ({} renamed or moved)",
            r.files_known,
            r.files_renamed
        );
    }
    if r.files_known_outside > 0 {
        outln!(
            "Known from the catalog outside the PATHs, used as sources: {} files",
            r.files_known_outside
        );
    }
    if !r.files_skipped.is_empty() {
        outln!("Skipped files: {}", counts(&r.files_skipped, skip_name));
    }
    if r.files_source_only > 0 {
        outln!(
            "Used as sources only: {} files you may read but not change (not yours, no write permission)",
            r.files_source_only
        );
    }
}

/// The ranges an earlier run settled, trusted without being looked at (so
/// not in the bytes found already shared: their holes are unknown).
fn settled(e: &ExecStats) -> String {
    match e.ranges_settled {
        0 => String::new(),
        n => format!(", {n} ranges settled by earlier runs"),
    }
}

/// The summary's lines about what a real run shared and freed.
fn print_shared(r: &Report) {
    outln!(
        "Shared {} in {} ranges with {} dedupe calls; {} were already shared{}",
        h(r.exec.bytes_deduped),
        r.exec.ranges_deduped,
        r.exec.dedupe_ioctls,
        h(r.exec.bytes_already_shared),
        settled(&r.exec)
    );
    out!("Freed {}", h(r.exec.bytes_freed));
    if r.exec.rehome_bytes_written > 0 {
        out!(
            ", after writing {} to re-home",
            h(r.exec.rehome_bytes_written)
        );
    }
    if let Some(d) = r.fs_free_delta {
        out!(
            " (filesystem free space changed by {}{})",
            if d < 0 { "-" } else { "+" },
            h(d.unsigned_abs())
        );
    }
    outln!();
}

/// The summary's line about what read-only snapshots still hold.
fn print_pinned(e: &ExecStats) {
    if e.bytes_pinned_by_snapshots > 0 {
        let ids: Vec<String> = e.pinning_snapshots.iter().map(u64::to_string).collect();
        outln!(
            "{} more will be freed when the {} read-only snapshots holding it are deleted (subvolume ids {})",
            h(e.bytes_pinned_by_snapshots),
            e.pinning_snapshots.len(),
            ids.join(", ")
        );
    }
}

/// The summary's lines about re-homing.
fn print_rehomed(e: &ExecStats) {
    if e.rehome_ranges > 0 {
        outln!(
            "Re-homed {} remainders: wrote {} to release {} partly referenced extents ({}); the freed figure is net of the bytes written",
            e.rehome_ranges,
            h(e.rehome_bytes_written),
            e.rehome_extents,
            h(e.rehome_bytes_released)
        );
    }
    if e.rehome_over_budget > 0 {
        outln!(
            "{} partly referenced extents stay allocated: re-homing them would pass --rehome-max-write",
            e.rehome_over_budget
        );
    }
    if let Some(why) = &e.rehome_unavailable {
        outln!("Re-homing skipped: {why}");
    }
}

fn skip_name(k: SkipReason) -> &'static str {
    match k {
        SkipReason::TooSmall => "too small",
        SkipReason::NotRegular => "not regular files",
        SkipReason::OtherFilesystem => "on other filesystems",
        SkipReason::Excluded => "excluded",
        SkipReason::Snapshot => "in btrfs snapshots",
        SkipReason::Hardlink => "extra hardlinks",
        SkipReason::ChangedWhileReading => "changed while reading",
        SkipReason::Vanished => "deleted while running",
        SkipReason::SwapFile => "active swap files",
        SkipReason::UnsupportedFilesystem => "on unsupported filesystems",
        SkipReason::Interrupted => "left part-read by the interruption",
        SkipReason::TooManyBlocks => "over 2^32 blocks (use a larger --block-size)",
    }
}

fn dest_name(k: DestSkip) -> &'static str {
    match k {
        DestSkip::AlreadyShared => "already shared",
        DestSkip::Changed => "changed since read",
        DestSkip::DataDiffers => "data differs",
        DestSkip::Protected => "immutable or append-only",
        DestSkip::ReadOnly => "read-only (mount or snapshot)",
        DestSkip::NotShareable => "inline/unwritten extents",
        DestSkip::Refused => "refused",
        DestSkip::Cancelled => "cancelled",
    }
}
