//! The dedupe executor: carries out a [`Plan`] with `FIDEDUPERANGE` and
//! measures the space it really freed.
//!
//! Invariants:
//! * User files are opened read-only and only ever passed to
//!   `FIDEDUPERANGE`, which compares the bytes under a lock: a file that
//!   changed since it was read is at worst not deduped.
//! * Before any ioctl, a destination range is skipped when it already maps
//!   to the same physical bytes as the source (FIEMAP), when the range
//!   holds inline, unwritten or unknown extents, and when the file changed
//!   since it was scanned or is immutable or append-only. A second run over
//!   a deduped tree therefore issues no ioctl.
//! * Freed bytes come from snapshots of the allocations the destination
//!   files pin, taken just before their first dedupe and after the run
//!   ([`account`]); they are never candidate bytes.

pub mod access;
pub mod account;
pub mod fdlimit;
pub mod fsrun;
pub mod policy;
mod rehome;
pub mod roots;
pub mod tmpdir;

pub use rehome::RehomeOptions;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use onecopy_ioctl::dedupe::{
    dedupe_range, describe_errno, DedupeDest, DedupeStatus, MAX_DESTS_PER_CALL,
};
use onecopy_ioctl::fiemap::{self, Extent};
use onecopy_ioctl::fs::inode_flags as iflags;
use onecopy_plan::{Dest, Op, Plan};
use onecopy_scan::{Device, FileEntry, Marks, Tree};

use account::FileUnits;
pub use account::Model;

/// Executor settings.
#[derive(Debug, Clone)]
pub struct ExecOptions {
    /// Decide and report, but issue no dedupe.
    pub dry_run: bool,
    pub model: Model,
    /// Re-home the live remainders of partly shared extents (btrfs only).
    pub rehome: Option<RehomeOptions>,
    /// Settled files looked at again this run (see [`Recheck`]).
    pub recheck: Recheck,
}

/// Which settled files a run looks at again, their ranges asked of the
/// filesystem instead of trusted: about one in `every` (0: none, 1: all),
/// picked by `seed` (a new value each run, e.g. the time). What `stat`
/// cannot tell from an unchanged file (a defragmented copy, a read-only
/// snapshot made writable, contents changed with their times put back) is
/// found within a few runs: at [`Recheck::EVERY`], about a quarter of the
/// cost of asking for every pair (a pair is trusted only if neither file
/// is picked).
#[derive(Debug, Clone, Copy)]
pub struct Recheck {
    pub every: u64,
    pub seed: u64,
}

impl Recheck {
    /// The default share: one settled file in 8 each run.
    pub const EVERY: u64 = 8;

    /// Whether a settled file of inode `ino` is trusted this run.
    fn trusts(self, ino: u64) -> bool {
        if self.every == 0 {
            return true;
        }
        // splitmix64's finaliser: inode numbers are dense, the pick is not.
        let mut x = ino ^ self.seed;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        !(x ^ (x >> 31)).is_multiple_of(self.every)
    }
}

/// Why a destination range was not deduped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DestSkip {
    /// Already maps to the source's physical bytes.
    AlreadyShared,
    /// The source or destination changed since it was read.
    Changed,
    /// The kernel found different bytes (changed under us).
    DataDiffers,
    /// Immutable or append-only inode.
    Protected,
    /// On a read-only mount or in a read-only btrfs snapshot.
    ReadOnly,
    /// Inline, unwritten (preallocated) or unknown extents in the range.
    NotShareable,
    /// The kernel refused (see the errors).
    Refused,
    /// Stopped by the user before this range.
    Cancelled,
}

/// A per-range problem: recorded and reported, never fatal.
#[derive(Debug, thiserror::Error)]
pub enum DedupeError {
    #[error("{path}: cannot open: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot map extents: {source}")]
    Fiemap {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{dst}: dedupe from {src} refused: {why}")]
    Refused {
        src: PathBuf,
        dst: PathBuf,
        why: String,
    },
    #[error("{path}: cannot re-home the unique remainder of a partly shared extent: {why}")]
    Rehome { path: PathBuf, why: String },
}

impl DedupeError {
    /// The file the problem is about (the destination, for a refusal).
    pub fn path(&self) -> &std::path::Path {
        match self {
            DedupeError::Open { path, .. }
            | DedupeError::Fiemap { path, .. }
            | DedupeError::Rehome { path, .. } => path,
            DedupeError::Refused { dst, .. } => dst,
        }
    }

    /// The file was not there any more.
    pub fn is_not_found(&self) -> bool {
        matches!(self, DedupeError::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// What the executor did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ExecStats {
    pub ops: u64,
    pub dedupe_ioctls: u64,
    /// Destination ranges (fully or partly) shared by this run.
    pub ranges_deduped: u64,
    /// Bytes the kernel reported newly shared.
    pub bytes_deduped: u64,
    pub ranges_already_shared: u64,
    /// Data bytes (holes not counted) of the ranges this run found already
    /// shared by looking at both files' extents; settled ranges are not
    /// looked at, so not counted.
    pub bytes_already_shared: u64,
    /// Of those ranges, those between files an earlier run settled and that
    /// are unchanged since: trusted without a FIEMAP check.
    pub ranges_settled: u64,
    /// Bytes the run unpinned (see [`account`]); an estimate in a dry run.
    pub bytes_freed: u64,
    /// Bytes of extents the run let go that only read-only snapshots still
    /// reference: freed when those snapshots are deleted (btrfs, root).
    pub bytes_pinned_by_snapshots: u64,
    /// Those snapshots' subvolume ids.
    pub pinning_snapshots: Vec<u64>,
    /// Dry run: bytes that would be newly shared.
    pub bytes_would_share: u64,
    /// Re-homed remainder ranges (btrfs bookending, see `rehome`).
    pub rehome_ranges: u64,
    /// Bytes copied into fresh extents by re-homing.
    pub rehome_bytes_written: u64,
    /// Extents fully released by re-homing, and their size.
    pub rehome_extents: u64,
    pub rehome_bytes_released: u64,
    /// Extents worth re-homing left pinned by the bound on bytes written.
    pub rehome_over_budget: u64,
    /// Why re-homing did not run at all (the filesystem refused unnamed
    /// temporary files), if so.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rehome_unavailable: Option<String>,
    /// Destination ranges not deduped, by reason.
    #[serde(rename = "ranges_skipped")]
    pub skipped: BTreeMap<DestSkip, u64>,
}

impl ExecStats {
    /// Adds another run's figures (one per filesystem) to these.
    pub fn merge(&mut self, o: &ExecStats) {
        self.ops += o.ops;
        self.dedupe_ioctls += o.dedupe_ioctls;
        self.ranges_deduped += o.ranges_deduped;
        self.bytes_deduped += o.bytes_deduped;
        self.ranges_already_shared += o.ranges_already_shared;
        self.bytes_already_shared += o.bytes_already_shared;
        self.ranges_settled += o.ranges_settled;
        self.bytes_freed += o.bytes_freed;
        self.bytes_pinned_by_snapshots += o.bytes_pinned_by_snapshots;
        self.pinning_snapshots.extend(&o.pinning_snapshots);
        self.pinning_snapshots.sort_unstable();
        self.pinning_snapshots.dedup();
        self.bytes_would_share += o.bytes_would_share;
        self.rehome_ranges += o.rehome_ranges;
        self.rehome_bytes_written += o.rehome_bytes_written;
        self.rehome_extents += o.rehome_extents;
        self.rehome_bytes_released += o.rehome_bytes_released;
        self.rehome_over_budget += o.rehome_over_budget;
        if self.rehome_unavailable.is_none() {
            self.rehome_unavailable.clone_from(&o.rehome_unavailable);
        }
        for (k, v) in &o.skipped {
            *self.skipped.entry(*k).or_default() += v;
        }
    }
}

/// Counters for a progress display; `cancel` stops after the current call.
#[derive(Debug, Default)]
pub struct ExecProgress {
    pub ops_done: AtomicU64,
    pub bytes_done: AtomicU64,
    pub cancel: AtomicBool,
}

/// The outcome of [`execute`].
#[derive(Debug, Default)]
pub struct ExecReport {
    pub stats: ExecStats,
    pub errors: Vec<DedupeError>,
    /// Files for which some planned range was neither shared nor found
    /// permanently unshareable (changed, refused, cancelled): a later run
    /// must look at them again.
    pub unsettled: Vec<bool>,
    /// Files the kernel found holding other bytes than their digests say
    /// though `stat` shows no change (contents changed with their times
    /// put back): their digests are not to be kept, a later run reads them.
    pub stale: Vec<bool>,
}

/// The files a plan's indices name, by index (a list of entries or of
/// read records: no list of references is made for the executor).
pub trait EntryList {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The file at `i` (`i < len()`).
    fn entry(&self, i: u32) -> &FileEntry;
}

impl<T: AsRef<FileEntry>> EntryList for Vec<T> {
    fn len(&self) -> usize {
        Vec::len(self)
    }
    fn entry(&self, i: u32) -> &FileEntry {
        self[i as usize].as_ref()
    }
}

/// Open files, bounded, and per-file snapshots.
struct Files<'a> {
    entries: &'a dyn EntryList,
    /// The paths and devices of `entries`.
    tree: &'a Tree,
    open: HashMap<u32, std::rc::Rc<File>>,
    /// At most this many files stay in `open`.
    max_open: usize,
    model: Model,
    before: HashMap<u32, FileUnits>,
    involved: Vec<bool>,
    /// Deduped by this run, or found already shared: their old extents
    /// may be left partly referenced (re-homing candidates).
    changed: Vec<bool>,
}

impl<'a> Files<'a> {
    fn entry(&self, i: u32) -> &'a FileEntry {
        self.entries.entry(i)
    }

    fn device(&self, i: u32) -> &'a Device {
        self.tree.device(self.entry(i).dev)
    }

    fn path(&self, i: u32) -> PathBuf {
        self.tree.path(self.entry(i).name)
    }

    fn get(&mut self, i: u32) -> Result<std::rc::Rc<File>, DedupeError> {
        if let Some(f) = self.open.get(&i) {
            return Ok(f.clone());
        }
        if self.open.len() >= self.max_open {
            self.open.clear();
        }
        let path = self.path(i);
        // Re-homing reads through it: never touch the file's atime.
        let f = onecopy_scan::longpath::open_noatime(&path)
            .map_err(|source| DedupeError::Open { path, source })?;
        let f = std::rc::Rc::new(f);
        self.open.insert(i, f.clone());
        Ok(f)
    }

    fn unchanged(&self, i: u32, f: &File) -> bool {
        f.metadata()
            .is_ok_and(|m| self.entry(i).unchanged(self.device(i).dev, &m))
    }

    /// The files the run opened as a source or destination.
    fn involved_ids(&self) -> Vec<u32> {
        (0..self.entries.len() as u32)
            .filter(|&i| self.involved[i as usize])
            .collect()
    }

    /// Snapshots the allocations of `i` before its first change.
    fn snapshot_before(&mut self, i: u32, f: &File) {
        if !self.before.contains_key(&i) {
            let u = account::file_units(f, self.model).unwrap_or_default();
            self.before.insert(i, u);
        }
    }
}

/// Where a piece of a range's data lives, see [`physical_layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    /// Offset in the range.
    offset: u64,
    /// The btrfs extent (its `disk_bytenr`); 0 for a FIEMAP address.
    extent: u64,
    /// Where the piece starts: in the extent's data (uncompressed bytes),
    /// or its FIEMAP physical address.
    at: u64,
    len: u64,
}

/// A range's pieces, contiguous ones merged.
type Layout = Vec<Piece>;

fn push_piece(out: &mut Layout, p: Piece) {
    if let Some(last) = out.last_mut() {
        if last.offset + last.len == p.offset
            && last.extent == p.extent
            && last.at + last.len == p.at
        {
            last.len += p.len;
            return;
        }
    }
    out.push(p);
}

/// A range's physical layout relative to its start; two ranges with equal
/// layouts share their data already. `None` if the range holds data the
/// filesystem can not share (inline, unwritten, unknown). Under
/// [`Model::Extents`] from the btrfs file extent items, which place a
/// range inside a compressed extent too; otherwise from FIEMAP, whose
/// SHARED flag costs a walk of each extent's back references on btrfs.
fn physical_layout(f: &File, model: Model, off: u64, len: u64) -> std::io::Result<Option<Layout>> {
    match model {
        Model::Extents => extent_layout(f, off, len),
        Model::Ranges => fiemap_layout(f, off, len),
    }
}

fn extent_layout(f: &File, off: u64, len: u64) -> std::io::Result<Option<Layout>> {
    use onecopy_ioctl::btrfs::{self, FileExtentKind};
    let ino = std::os::unix::fs::MetadataExt::ino(&f.metadata()?);
    let end = off + len;
    let mut out = Layout::new();
    for x in btrfs::file_extents_in(f.as_fd(), ino, off, end)? {
        let (s, t) = (
            x.file_offset.max(off),
            (x.file_offset + x.num_bytes).min(end),
        );
        match x.kind {
            FileExtentKind::Regular if x.disk_bytenr == 0 => continue, // a hole
            FileExtentKind::Regular => {}
            _ => return Ok(None), // inline, preallocated (zeros), unknown
        }
        let at = x.offset + (s - x.file_offset);
        let extent = x.disk_bytenr;
        push_piece(
            &mut out,
            Piece {
                offset: s - off,
                extent,
                at,
                len: t - s,
            },
        );
    }
    Ok(Some(out))
}

fn fiemap_layout(f: &File, off: u64, len: u64) -> std::io::Result<Option<Layout>> {
    let ext: Vec<Extent> = fiemap::fiemap_range(f.as_fd(), off, len)?;
    let end = off + len;
    let mut out: Layout = Vec::new();
    for e in ext {
        let s = e.logical.max(off);
        let t = e.logical_end().min(end);
        if s >= t {
            continue;
        }
        if e.is_undedupable() || e.is_unwritten() {
            return Ok(None);
        }
        let at = e.physical + (s - e.logical);
        push_piece(
            &mut out,
            Piece {
                offset: s - off,
                extent: 0,
                at,
                len: t - s,
            },
        );
    }
    Ok(Some(out))
}

/// Carries out `plan` over `entries` (the files the plan's indices name;
/// their paths and devices in `tree`).
///
/// A file marked [`Marks::SETTLED`] was settled by an earlier run and is
/// unchanged since: ranges between two such files are taken as already
/// shared without asking the filesystem, unless this run picked either
/// to look at again ([`Recheck`]).
pub fn execute(
    entries: &dyn EntryList,
    tree: &Tree,
    plan: &Plan,
    opts: &ExecOptions,
    progress: &ExecProgress,
) -> ExecReport {
    let budget = fdlimit::FdBudget::current();
    let mut files = Files {
        entries,
        tree,
        open: HashMap::new(),
        max_open: budget.cache,
        model: opts.model,
        before: HashMap::new(),
        involved: vec![false; entries.len()],
        changed: vec![false; entries.len()],
    };
    let mut rep = ExecReport {
        unsettled: vec![false; entries.len()],
        stale: vec![false; entries.len()],
        ..Default::default()
    };
    let settled = |i: u32| {
        let e = entries.entry(i);
        e.marks.has(Marks::SETTLED) && opts.recheck.trusts(e.ino)
    };
    for op in &plan.ops {
        if progress.cancel.load(Ordering::Relaxed) {
            skip_all(&mut rep, op, DestSkip::Cancelled);
            continue;
        }
        rep.stats.ops += 1;
        // Destinations in bounded batches: each batch's files are closed
        // before the next is opened, whatever the size of the group.
        for part in in_batches(op, budget.batch) {
            if progress.cancel.load(Ordering::Relaxed) {
                skip_all(&mut rep, &part, DestSkip::Cancelled);
                continue;
            }
            run_op(&part, &mut files, opts, &settled, progress, &mut rep);
        }
        progress.ops_done.fetch_add(1, Ordering::Relaxed);
    }
    // Bookending: release extents pinned by unique remainders.
    if let (Some(ro), false, Model::Extents) = (&opts.rehome, opts.dry_run, opts.model) {
        if ro.max_write > 0 && !progress.cancel.load(Ordering::Relaxed) {
            let changed: Vec<u32> = (0..entries.len() as u32)
                .filter(|&i| files.changed[i as usize])
                .collect();
            rehome::rehome(&mut files, &changed, ro, progress, &mut rep);
        }
    }
    account_run(&mut files, tree, opts, &mut rep);
    rep
}

/// Sets `bytes_freed` (and what read-only snapshots pin) from the
/// involved files' allocations before and after the run.
fn account_run(files: &mut Files<'_>, tree: &Tree, opts: &ExecOptions, rep: &mut ExecReport) {
    if opts.dry_run {
        // The estimate: every byte that would be shared frees its block
        // (exact on XFS; on btrfs re-homing releases what bookending pins).
        rep.stats.bytes_freed = rep.stats.bytes_would_share;
    } else if !files.before.is_empty() {
        files.open.clear();
        let mut after = Vec::new();
        for i in files.involved_ids() {
            if let Ok(f) = files.get(i) {
                after.push(account::file_units(&f, opts.model).unwrap_or_default());
            }
        }
        let fd = any_involved(files).filter(|_| opts.model == Model::Extents);
        let before: Vec<&FileUnits> = files.before.values().collect();
        let after: Vec<&FileUnits> = after.iter().collect();
        let (referenced, pins) = match &fd {
            Some(fd) => {
                let _ = onecopy_ioctl::fs::syncfs(fd.as_fd());
                let gone = account::let_go(&before, &after);
                let read_only = read_only_subvols(tree);
                fates(&gone, fd, &|r| read_only.contains(&r))
            }
            None => Default::default(),
        };
        let mut referenced = |u| referenced.get(&u).copied().flatten();
        rep.stats.bytes_freed = account::freed_bytes(opts.model, &before, &after, &mut referenced);
        (
            rep.stats.bytes_pinned_by_snapshots,
            rep.stats.pinning_snapshots,
        ) = pins;
    }
}

/// An open file among those the run involved (for filesystem-wide
/// lookups), if any opens.
fn any_involved(files: &mut Files<'_>) -> Option<std::rc::Rc<File>> {
    let involved = files.involved_ids();
    involved.into_iter().find_map(|i| files.get(i).ok())
}

/// The read-only snapshots the walk met (their subvolume ids).
fn read_only_subvols(tree: &Tree) -> std::collections::HashSet<u64> {
    tree.devices()
        .iter()
        .filter(|d| d.read_only)
        .map(|d| d.subvol)
        .collect()
}

/// What the filesystem says, after the run's commit, of the extents the
/// run let go (btrfs, [`Model::Extents`]): whether each is still
/// referenced (`None`: unknown), and [`account::pinned_by_snapshots`]:
/// the bytes only read-only snapshots hold, and those snapshots.
///
/// Lookups run on rayon's threads: each is kernel CPU time. Who holds an
/// extent is asked of `LOGICAL_INO`, a walk of its back references
/// through every snapshot's tree, once per set of tree leaves
/// that reference it: extents referenced by the same leaves only (those
/// a subvolume copied on write while its snapshots shared them) are held
/// by the same subvolumes. An extent also referenced by (subvolume,
/// inode) is asked alone.
fn fates(
    gone: &[account::Unit],
    fd: &File,
    read_only: &(dyn Fn(u64) -> bool + Sync),
) -> (HashMap<account::Unit, Option<bool>>, (u64, Vec<u64>)) {
    use onecopy_ioctl::btrfs;
    use rayon::prelude::*;
    let backrefs: Vec<_> = gone
        .par_iter()
        .map(|u| btrfs::extent_backrefs(fd.as_fd(), u.start))
        .collect();
    let mut referenced = HashMap::with_capacity(gone.len());
    // Extents still held only by tree leaves, by those leaves.
    let mut groups: HashMap<Vec<u64>, Vec<account::Unit>> = HashMap::new();
    let mut alone = Vec::new();
    for (&u, b) in gone.iter().zip(backrefs) {
        let held = b.map(|b| b.filter(|b| b.len == u.len));
        referenced.insert(u, held.as_ref().ok().map(Option::is_some));
        match held {
            Ok(Some(b)) if !b.by_owner => groups.entry(b.leaves).or_default().push(u),
            Ok(Some(_)) => alone.push(vec![u]),
            _ => {}
        }
    }
    let mut asks: Vec<Vec<account::Unit>> = groups.into_values().collect();
    asks.extend(alone);
    let pins: Vec<_> = asks
        .par_iter()
        .map(|members| {
            let roots = btrfs::extent_owners(fd.as_fd(), members[0].start)
                .ok()
                .flatten();
            let roots: Option<Vec<u64>> = roots.map(|o| o.iter().map(|o| o.root).collect());
            account::pinned_by_snapshots(members, &mut |_| roots.clone(), read_only)
        })
        .collect();
    let (mut bytes, mut snaps) = (0, std::collections::BTreeSet::new());
    for (b, s) in pins {
        bytes += b;
        snaps.extend(s);
    }
    (referenced, (bytes, snaps.into_iter().collect()))
}

/// Why an open file may not be a destination at all (immutable or
/// append-only inode, read-only mount), if so.
fn dest_refusal(f: &File) -> Option<DestSkip> {
    let fl = iflags(f.as_fd()).unwrap_or(0);
    if fl & (onecopy_ioctl::fs::inode_flags::IMMUTABLE | onecopy_ioctl::fs::inode_flags::APPEND)
        != 0
    {
        return Some(DestSkip::Protected);
    }
    if onecopy_ioctl::fs::on_read_only_mount(f.as_fd()).unwrap_or(false) {
        return Some(DestSkip::ReadOnly);
    }
    None
}

/// `op` split into ops of at most `batch` destinations each.
fn in_batches(op: &Op, batch: usize) -> Vec<std::borrow::Cow<'_, Op>> {
    if op.dests.len() <= batch {
        return vec![std::borrow::Cow::Borrowed(op)];
    }
    op.dests
        .chunks(batch.max(1))
        .map(|d| {
            std::borrow::Cow::Owned(Op {
                kind: op.kind,
                src: op.src,
                src_offset: op.src_offset,
                len: op.len,
                dests: d.to_vec(),
            })
        })
        .collect()
}

fn skip(rep: &mut ExecReport, file: u32, why: DestSkip) {
    *rep.stats.skipped.entry(why).or_default() += 1;
    if matches!(
        why,
        DestSkip::Changed | DestSkip::DataDiffers | DestSkip::Refused | DestSkip::Cancelled
    ) {
        rep.unsettled[file as usize] = true;
    }
}

fn skip_all(rep: &mut ExecReport, op: &Op, why: DestSkip) {
    for d in &op.dests {
        skip(rep, d.file, why);
    }
}

/// Counts a destination range found already shared with its source:
/// `Some(bytes)` of data its layout showed, `None` when trusted from an
/// earlier run without asking the filesystem (its holes unknown).
fn already_shared(rep: &mut ExecReport, file: u32, seen: Option<u64>) {
    rep.stats.ranges_already_shared += 1;
    match seen {
        Some(bytes) => rep.stats.bytes_already_shared += bytes,
        None => rep.stats.ranges_settled += 1,
    }
    skip(rep, file, DestSkip::AlreadyShared);
}

/// A destination that passed every check, with how far it has been shared.
struct Pending {
    file: u32,
    offset: u64,
    f: Rc<File>,
    done: u64,
    counted: bool,
}

/// Carries out one operation: checks the source, decides per destination,
/// then shares the ranges that need it.
fn run_op(
    op: &Op,
    files: &mut Files<'_>,
    opts: &ExecOptions,
    settled: &dyn Fn(u32) -> bool,
    progress: &ExecProgress,
    rep: &mut ExecReport,
) {
    // Settled by an earlier run on both sides, unchanged since: trusted.
    let trusted: Vec<bool> = op
        .dests
        .iter()
        .map(|d| settled(op.src) && settled(d.file))
        .collect();
    if trusted.iter().all(|t| *t) {
        for d in &op.dests {
            already_shared(rep, d.file, None);
        }
        return;
    }
    let Some((src, src_layout)) = open_source(op, files, rep) else {
        return;
    };
    let mut todo: Vec<Pending> = Vec::new();
    for (d, trusted) in op.dests.iter().zip(&trusted) {
        if *trusted {
            already_shared(rep, d.file, None);
        } else if let Some(f) = check_dest(op.len, d, &src_layout, files, rep) {
            todo.push(Pending {
                file: d.file,
                offset: d.offset,
                f,
                done: 0,
                counted: false,
            });
        }
    }
    if todo.is_empty() {
        return;
    }
    if opts.dry_run {
        rep.stats.bytes_would_share += op.len * todo.len() as u64;
        // Not done, so not settled.
        for p in &todo {
            rep.unsettled[p.file as usize] = true;
        }
        return;
    }
    files.involved[op.src as usize] = true;
    files.snapshot_before(op.src, &src);
    for p in &todo {
        files.involved[p.file as usize] = true;
        files.snapshot_before(p.file, &p.f);
    }
    share(op, &src, todo, files, progress, rep);
}

/// Opens the source of `op` and reads its layout; `None` (with every
/// destination skipped) if it changed, vanished or cannot be shared.
fn open_source(op: &Op, files: &mut Files<'_>, rep: &mut ExecReport) -> Option<(Rc<File>, Layout)> {
    let src = match files.get(op.src) {
        Ok(f) => f,
        // Deleted or renamed since it was read: a change, not an error.
        Err(e) if e.is_not_found() => {
            skip_all(rep, op, DestSkip::Changed);
            return None;
        }
        Err(e) => {
            rep.errors.push(e);
            skip_all(rep, op, DestSkip::Refused);
            return None;
        }
    };
    if !files.unchanged(op.src, &src) {
        skip_all(rep, op, DestSkip::Changed);
        return None;
    }
    match physical_layout(&src, files.model, op.src_offset, op.len) {
        Ok(Some(l)) => Some((src, l)),
        Ok(None) => {
            skip_all(rep, op, DestSkip::NotShareable);
            None
        }
        Err(source) => {
            rep.errors.push(DedupeError::Fiemap {
                path: files.path(op.src),
                source,
            });
            skip_all(rep, op, DestSkip::Refused);
            None
        }
    }
}

/// Whether destination `d` may and must be shared: unchanged, not
/// protected or read-only, shareable, and not sharing the source's extents
/// already. Records the reason when not.
fn check_dest(
    len: u64,
    d: &Dest,
    src_layout: &[Piece],
    files: &mut Files<'_>,
    rep: &mut ExecReport,
) -> Option<Rc<File>> {
    let f = match files.get(d.file) {
        Ok(f) => f,
        Err(e) if e.is_not_found() => {
            skip(rep, d.file, DestSkip::Changed);
            return None;
        }
        Err(e) => {
            rep.errors.push(e);
            skip(rep, d.file, DestSkip::Refused);
            return None;
        }
    };
    if !files.unchanged(d.file, &f) {
        skip(rep, d.file, DestSkip::Changed);
        return None;
    }
    let refusal = if files.device(d.file).read_only {
        Some(DestSkip::ReadOnly)
    } else {
        dest_refusal(&f)
    };
    if let Some(why) = refusal {
        skip(rep, d.file, why);
        return None;
    }
    match physical_layout(&f, files.model, d.offset, len) {
        Ok(Some(l)) if l == src_layout => {
            // Shared by an earlier (perhaps interrupted) run: its old
            // extents may still wait to be re-homed.
            files.changed[d.file as usize] = true;
            already_shared(rep, d.file, Some(l.iter().map(|p| p.len).sum()));
            None
        }
        Ok(Some(_)) => Some(f),
        Ok(None) => {
            skip(rep, d.file, DestSkip::NotShareable);
            None
        }
        Err(source) => {
            rep.errors.push(DedupeError::Fiemap {
                path: files.path(d.file),
                source,
            });
            skip(rep, d.file, DestSkip::Refused);
            None
        }
    }
}

/// Shares `op`'s source range into every pending destination. Each
/// destination advances at its own pace; one call serves the destinations
/// that have reached the same point.
fn share(
    op: &Op,
    src: &File,
    mut pending: Vec<Pending>,
    files: &mut Files<'_>,
    progress: &ExecProgress,
    rep: &mut ExecReport,
) {
    let mut ids: Vec<usize> = (0..pending.len()).collect();
    while !ids.is_empty() {
        if progress.cancel.load(Ordering::Relaxed) {
            for &k in &ids {
                skip(rep, pending[k].file, DestSkip::Cancelled);
            }
            return;
        }
        let done = ids.iter().map(|&k| pending[k].done).min().unwrap_or(0);
        let group: Vec<usize> = ids
            .iter()
            .copied()
            .filter(|&k| pending[k].done == done)
            .take(MAX_DESTS_PER_CALL)
            .collect();
        let len = match next_span(op, src, done, group.iter().map(|&k| &pending[k])) {
            Span::Data(len) => len,
            Span::Holes(n) => {
                for &k in &group {
                    pending[k].done += n;
                }
                ids.retain(|&k| pending[k].done < op.len);
                continue;
            }
        };
        let dests: Vec<DedupeDest<'_>> = group
            .iter()
            .map(|&k| DedupeDest {
                fd: pending[k].f.as_fd(),
                offset: pending[k].offset + done,
            })
            .collect();
        rep.stats.dedupe_ioctls += 1;
        let res = dedupe_range(src.as_fd(), op.src_offset + done, len, &dests);
        drop(dests);
        let statuses = match res {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) => continue,
            // The source range past its end: the file may have shrunk.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                vec![Ok(DedupeStatus::Error(libc::EINVAL)); group.len()]
            }
            Err(e) => {
                let why = e
                    .raw_os_error()
                    .map(describe_errno)
                    .unwrap_or_else(|| e.to_string());
                vec![Err(why); group.len()]
            }
            Ok(st) => st.into_iter().map(Ok).collect(),
        };
        let mut finished: Vec<usize> = Vec::new();
        for (&k, st) in group.iter().zip(statuses) {
            if apply_status(op, src, &mut pending[k], st, files, progress, rep) {
                finished.push(k);
            }
        }
        ids.retain(|k| !finished.contains(k));
    }
}

/// What `op`'s range holds from `done` on, in `src` and the
/// destinations of a group.
#[derive(Debug, PartialEq, Eq)]
enum Span {
    /// Bytes that are a hole in all of them: there is nothing to share
    /// there, and the kernel would only compare zeros (a minute per 100
    /// GiB).
    Holes(u64),
    /// Bytes to share in one call: up to where each of them has reached a
    /// hole (holes in only some of them are shared as any range is: a
    /// destination's zeros become the source's hole).
    Data(u64),
}

/// [`Span`] at `done`, from `SEEK_DATA` and `SEEK_HOLE` (the whole rest
/// of the range where a filesystem does not tell). A file written
/// meanwhile only loses a range to share: the kernel compares the bytes.
fn next_span<'a>(op: &Op, src: &File, done: u64, group: impl Iterator<Item = &'a Pending>) -> Span {
    use onecopy_ioctl::fs::{next_data, next_hole};
    let left = op.len - done;
    // (bytes of hole at `at`, bytes to the first hole from `at`)
    let look = |f: &File, at: u64| {
        let hole = match next_data(f.as_fd(), at) {
            Ok(Some(data)) => data.saturating_sub(at).min(left),
            Ok(None) => left,
            Err(_) => 0,
        };
        let data = match (hole, next_hole(f.as_fd(), at)) {
            (0, Ok(h)) => h.saturating_sub(at).min(left),
            (0, Err(_)) => left,
            _ => 0,
        };
        (hole, data)
    };
    let (mut holes, mut data) = look(src, op.src_offset + done);
    for p in group {
        let (h, d) = look(&p.f, p.offset + done);
        holes = holes.min(h);
        data = data.max(d);
    }
    match holes {
        0 => Span::Data(data.max(1).min(left)),
        n => Span::Holes(n),
    }
}

/// Records what the kernel said about one destination (`Err`: the whole
/// call failed with that reason); true when the destination is finished.
fn apply_status(
    op: &Op,
    src: &File,
    p: &mut Pending,
    st: Result<DedupeStatus, String>,
    files: &mut Files<'_>,
    progress: &ExecProgress,
    rep: &mut ExecReport,
) -> bool {
    let refused = |rep: &mut ExecReport, why: String| {
        rep.errors.push(DedupeError::Refused {
            src: files.path(op.src),
            dst: files.path(p.file),
            why,
        });
        skip(rep, p.file, DestSkip::Refused);
        true
    };
    match st {
        Ok(DedupeStatus::Same { bytes }) if bytes > 0 => {
            if !p.counted {
                p.counted = true;
                rep.stats.ranges_deduped += 1;
                files.changed[p.file as usize] = true;
            }
            p.done += bytes;
            rep.stats.bytes_deduped += bytes;
            progress.bytes_done.fetch_add(bytes, Ordering::Relaxed);
            p.done >= op.len
        }
        Ok(DedupeStatus::Same { .. }) => refused(rep, "the kernel shared no bytes".into()),
        Ok(DedupeStatus::Differs) => {
            skip(rep, p.file, DestSkip::DataDiffers);
            // One of the two is not what its digests say.
            rep.stale[p.file as usize] = true;
            rep.stale[op.src as usize] = true;
            true
        }
        // EINVAL for a range past the end of a file another program
        // has just truncated: a change, not a refusal.
        Ok(DedupeStatus::Error(libc::EINVAL))
            if !files.unchanged(op.src, src) || !files.unchanged(p.file, &p.f) =>
        {
            skip(rep, p.file, DestSkip::Changed);
            true
        }
        Ok(DedupeStatus::Error(errno)) => refused(rep, describe_errno(errno)),
        Err(why) => refused(rep, why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// About one settled file in `every` is looked at again, a different
    /// one each run; 0 trusts all, 1 none.
    #[test]
    fn a_run_looks_again_at_about_one_settled_file_in_every() {
        let share = |seed| {
            (0..80_000u64)
                .filter(|&i| !Recheck { every: 8, seed }.trusts(i))
                .count()
        };
        for seed in [0, 1, 0xdead_beef] {
            let n = share(seed);
            assert!((9_000..11_000).contains(&n), "seed {seed}: {n} of 80,000");
        }
        let picked = |seed| {
            (0..64u64)
                .filter(|&i| !Recheck { every: 8, seed }.trusts(i))
                .collect::<Vec<_>>()
        };
        assert_ne!(picked(1), picked(2), "each run picks others");
        assert!((0..1000).all(|i| Recheck { every: 0, seed: 5 }.trusts(i)));
        assert!((0..1000).all(|i| !Recheck { every: 1, seed: 5 }.trusts(i)));
    }
    use onecopy_plan::{Dest, OpKind};

    #[test]
    fn large_groups_are_split_in_bounded_batches() {
        let op = Op {
            kind: OpKind::WholeFile,
            src: 0,
            src_offset: 0,
            len: 4096,
            dests: (1..=300).map(|f| Dest { file: f, offset: 0 }).collect(),
        };
        let parts = in_batches(&op, 127);
        assert_eq!(
            parts.iter().map(|p| p.dests.len()).collect::<Vec<_>>(),
            [127, 127, 46]
        );
        let files: Vec<u32> = parts
            .iter()
            .flat_map(|p| p.dests.iter().map(|d| d.file))
            .collect();
        assert_eq!(files, (1..=300).collect::<Vec<_>>());
        assert!(parts.iter().all(|p| p.src == 0 && p.len == 4096));
        assert_eq!(in_batches(&op, 1000).len(), 1);
    }
}
