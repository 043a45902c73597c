//! Parallel listing of regular files under the roots.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::Metadata;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use globset::{Glob, GlobSet, GlobSetBuilder};
use ignore::{WalkBuilder, WalkState};

use crate::tree::{DevId, Device, DirInterner, LocalNames, NameId, Tree};
use crate::{Progress, ScanError, SkipReason};

/// Identifies one filesystem (`f_fsid`): all subvolumes of a btrfs share it.
pub type FsId = u64;

/// What to list.
#[derive(Debug, Clone)]
pub struct WalkOptions {
    pub roots: Vec<PathBuf>,
    /// Stay on the filesystem of each root (btrfs subvolumes of the same
    /// filesystem are crossed: they can share extents).
    pub one_file_system: bool,
    /// Glob patterns matched against each entry's full path and its name;
    /// a matching directory is not entered.
    pub excludes: Vec<String>,
    /// Files smaller than this are skipped (never below one fs block).
    pub min_size: u64,
    /// Do not enter btrfs snapshots (subvolumes with a parent UUID,
    /// read-only or not), nor walk a root inside one; each is counted once
    /// as [`SkipReason::Snapshot`]. Without it, read-only snapshots are
    /// listed and only ever sources.
    pub exclude_snapshots: bool,
    /// Walker threads.
    pub threads: usize,
}

/// Run state carried in a file's record (bits of [`FileEntry::marks`]),
/// in what would otherwise be padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Marks(u8);

impl Marks {
    /// Modified less than [`crate::RACY_MARGIN_NS`] before it was read: its
    /// digests must not be trusted by a later run.
    pub const RACY: u8 = 1;
    /// Known from the catalog, and every range planned for it was shared
    /// by an earlier run.
    pub const SETTLED: u8 = 2;
    /// Known from the catalog, outside this run's roots: a source only.
    pub const OUTSIDE_ROOTS: u8 = 4;
    /// Known from the catalog, but its record must be rewritten (new path
    /// or ctime).
    pub const DIRTY: u8 = 8;
    /// Not read: its digests are those of a file read earlier in the run
    /// from the same extents ([`crate::layout`]).
    pub const SAME_EXTENTS: u8 = 16;

    pub fn has(self, bit: u8) -> bool {
        self.0 & bit != 0
    }

    pub fn set(&mut self, bit: u8, on: bool) {
        if on {
            self.0 |= bit;
        } else {
            self.0 &= !bit;
        }
    }
}

/// A regular file found by the walk: 48 bytes (see
/// `tests::entry_is_48_bytes`); its path and device facts are in the run's
/// [`Tree`].
#[derive(Debug, Clone)]
pub struct FileEntry {
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    /// The path, in the run's [`Tree`].
    pub name: NameId,
    /// The device (number, filesystem, subvolume, block size, read-only),
    /// in the run's [`Tree`].
    pub dev: DevId,
    /// Hard links to the inode (a link changes ctime, not the data),
    /// saturated at `u16::MAX`: only compared, to tell a relink from a
    /// change, and a saturated count only costs a read.
    pub nlink: u16,
    pub marks: Marks,
}

fn saturate(nlink: u64) -> u16 {
    nlink.min(u16::MAX as u64) as u16
}

impl FileEntry {
    pub fn from_meta(name: NameId, dev: DevId, m: &Metadata) -> FileEntry {
        FileEntry {
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
            ctime_ns: m.ctime() * 1_000_000_000 + m.ctime_nsec(),
            name,
            dev,
            nlink: saturate(m.nlink()),
            marks: Marks::default(),
        }
    }

    /// The same from a raw `stat` (descriptor-relative walks).
    pub fn from_stat(name: NameId, dev: DevId, st: &rustix::fs::Stat) -> FileEntry {
        FileEntry {
            ino: st.st_ino,
            size: st.st_size as u64,
            mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec as i64,
            ctime_ns: st.st_ctime * 1_000_000_000 + st.st_ctime_nsec as i64,
            name,
            dev,
            nlink: saturate(st.st_nlink),
            marks: Marks::default(),
        }
    }

    /// Whether `m` (a fresh stat of the same path) shows the file unchanged;
    /// `dev` is the device number of `self.dev`.
    pub fn unchanged(&self, dev: u64, m: &Metadata) -> bool {
        m.dev() == dev
            && m.ino() == self.ino
            && m.size() == self.size
            && m.mtime() * 1_000_000_000 + m.mtime_nsec() == self.mtime_ns
            && m.ctime() * 1_000_000_000 + m.ctime_nsec() == self.ctime_ns
    }
}

/// The walk's result: files sorted by (device, inode), one entry per inode.
#[derive(Debug, Default)]
pub struct WalkOutput {
    pub files: Vec<FileEntry>,
    /// The paths and devices the entries refer to.
    pub tree: Tree,
    pub skipped: BTreeMap<SkipReason, u64>,
    pub errors: Vec<ScanError>,
    /// What listing read-only snapshots by difference left out.
    pub snapshot_diff: crate::snapdiff::SnapshotDiff,
}

#[derive(Clone, Copy)]
struct DevInfo {
    /// In the walk's tree, when the device can dedupe.
    id: Option<DevId>,
    fs: FsId,
    subvol: u64,
    /// A read-only btrfs subvolume.
    read_only: bool,
    /// A btrfs snapshot (read-only or not).
    snapshot: bool,
    /// The btrfs subvolume's UUID, the one it is a snapshot of, and the
    /// transaction that made it (zeros elsewhere).
    uuid: [u8; 16],
    parent_uuid: [u8; 16],
    otransid: u64,
    ctransid: u64,
    block: u64,
    /// The smallest file that can own a data block of its own.
    min_size: u64,
    supported: bool,
}

/// btrfs stores files of up to `max_inline` bytes (2048 by default) inside
/// metadata, where nothing can be shared; XFS always gives file data its
/// own blocks, so even a 1-byte file frees a block when deduped. A btrfs
/// file above the threshold that is inline anyway (compression, a larger
/// `max_inline`) is caught by the FIEMAP check before any dedupe.
const BTRFS_MAX_INLINE: u64 = 2048;

/// Caches what `statfs` says per device number; devices are few.
struct DevCache {
    map: Mutex<HashMap<u64, Option<DevInfo>>>,
}

impl DevCache {
    /// The facts of device `dev` (met at `path`); a device that can dedupe
    /// is added to `tree` the first time.
    fn get(&self, dev: u64, path: &Path, tree: &Mutex<DirInterner>) -> Option<DevInfo> {
        if let Some(v) = self.map.lock().unwrap().get(&dev) {
            return *v;
        }
        // An unreadable file is identified through its directory (same
        // device unless the file is itself a mount point, which it is not).
        let open = |p: &Path| crate::longpath::open(p, rustix::fs::OFlags::empty()).ok();
        let opened = open(path)
            .filter(|f| f.metadata().is_ok_and(|m| m.dev() == dev))
            .or_else(|| path.parent().and_then(open))
            .filter(|f| f.metadata().is_ok_and(|m| m.dev() == dev));
        let info = opened.and_then(|f| {
            use std::os::fd::AsFd;
            let i = onecopy_ioctl::fs::fs_info(f.as_fd()).ok()?;
            // Not btrfs (or a kernel before 4.18): neither fact.
            let sv = onecopy_ioctl::btrfs::subvol_info(f.as_fd()).unwrap_or_default();
            Some(DevInfo {
                id: None,
                fs: i.fsid,
                subvol: onecopy_ioctl::btrfs::subvol_id(f.as_fd()).unwrap_or(0),
                read_only: sv.read_only,
                snapshot: sv.snapshot,
                uuid: sv.uuid,
                parent_uuid: sv.parent_uuid,
                otransid: sv.otransid,
                ctransid: sv.ctransid,
                block: i.block_size.max(512),
                min_size: if i.kind == onecopy_ioctl::fs::FsKind::Btrfs {
                    BTRFS_MAX_INLINE + 1
                } else {
                    1
                },
                // A read-only mount is judged per file when deduping (bind
                // mounts share the device number with writable ones).
                supported: i.kind.supports_dedupe(),
            })
        });
        let mut map = self.map.lock().unwrap();
        if let Some(v) = map.get(&dev) {
            // Another thread was first.
            return *v;
        }
        let info = info.map(|mut d| {
            if d.supported {
                d.id = tree
                    .lock()
                    .unwrap()
                    .add_device(Device {
                        dev,
                        fs: d.fs,
                        subvol: d.subvol,
                        read_only: d.read_only,
                        block: d.block,
                    })
                    .ok();
            }
            d
        });
        map.insert(dev, info);
        info
    }
}

/// The inode number of every btrfs subvolume's root directory.
const SUBVOL_ROOT_INO: u64 = 256;

/// The rules both walkers apply to every entry: the parallel walker and
/// the descriptor walker for paths beyond PATH_MAX ([`crate::longpath`]).
pub(crate) struct Filters {
    globs: GlobSet,
    swaps: HashSet<(u64, u64)>,
    devs: DevCache,
    /// The walk's directories and devices, shared by the walker threads.
    pub(crate) tree: Mutex<DirInterner>,
    /// btrfs subvolumes whose root directory the walk entered, by UUID.
    subvols: Mutex<HashMap<[u8; 16], PathBuf>>,
    /// Read-only snapshots met and not entered: listed after the walk,
    /// by difference where their parent subvolume was walked
    /// ([`crate::snapdiff`]). Path and device number.
    deferred: Mutex<Vec<(PathBuf, u64)>>,
    one_file_system: bool,
    exclude_snapshots: bool,
    min_size: u64,
}

/// Where a root lives, for the one-file-system rule.
#[derive(Clone, Copy)]
struct RootInfo {
    dev: u64,
    fs: Option<FsId>,
}

impl Filters {
    fn new(opts: &WalkOptions, swaps: HashSet<(u64, u64)>) -> Filters {
        Filters {
            globs: build_globs(&opts.excludes).unwrap_or_else(|_| GlobSet::empty()),
            swaps,
            devs: DevCache {
                map: Mutex::new(HashMap::new()),
            },
            tree: Mutex::new(DirInterner::new(Tree::new())),
            subvols: Mutex::default(),
            deferred: Mutex::default(),
            one_file_system: opts.one_file_system,
            exclude_snapshots: opts.exclude_snapshots,
            min_size: opts.min_size,
        }
    }

    /// Whether to look at the entry `path` at all (excluded names counted
    /// as skipped). Every other name is the user's: onecopy makes nothing
    /// in a tree it walks.
    pub(crate) fn name(&self, path: &Path) -> Result<(), Option<SkipReason>> {
        let name = path.file_name().unwrap_or_default();
        if !self.globs.is_empty()
            && (self.globs.is_match(path) || self.globs.is_match(Path::new(name)))
        {
            return Err(Some(SkipReason::Excluded));
        }
        Ok(())
    }

    /// Whether to enter the directory `path` (device `dev`, inode `ino`):
    /// with `one_file_system`, only on the root's filesystem, whose btrfs
    /// subvolumes (other device numbers, same fsid) are crossed; with
    /// `exclude_snapshots`, not into a btrfs snapshot. A read-only
    /// snapshot is not entered now but kept for [`walk_snapshots`]
    /// (`Err(None)`: not a skip). A directory on the root's device
    /// passes: each btrfs subvolume has a device number of its own, and
    /// the root itself is judged by [`Filters::root`].
    fn dir(
        &self,
        root: RootInfo,
        dev: u64,
        ino: u64,
        path: &Path,
    ) -> Result<(), Option<SkipReason>> {
        if dev == root.dev {
            return Ok(());
        }
        let info = self.devs.get(dev, path, &self.tree);
        if self.one_file_system {
            let fs = info.map(|d| d.fs);
            if fs.is_none() || fs != root.fs {
                return Err(Some(SkipReason::OtherFilesystem));
            }
        }
        let Some(d) = info.filter(|d| d.uuid != [0; 16] && ino == SUBVOL_ROOT_INO) else {
            return Ok(());
        };
        if self.exclude_snapshots && d.snapshot {
            return Err(Some(SkipReason::Snapshot));
        }
        if d.snapshot && d.read_only {
            self.deferred
                .lock()
                .unwrap()
                .push((path.to_path_buf(), dev));
            return Err(None);
        }
        self.note_whole(d.uuid, path);
        Ok(())
    }

    /// Notes that the walk covers the whole of the subvolume whose root
    /// directory `path` is (if it is one).
    fn whole_subvol(&self, dev: u64, ino: u64, path: &Path) {
        if ino != SUBVOL_ROOT_INO {
            return;
        }
        if let Some(d) = self.devs.get(dev, path, &self.tree) {
            if d.uuid != [0; 16] {
                self.note_whole(d.uuid, path);
            }
        }
    }

    /// Subvolume `uuid`'s root, `path`, is walked.
    fn note_whole(&self, uuid: [u8; 16], path: &Path) {
        self.subvols
            .lock()
            .unwrap()
            .insert(uuid, path.to_path_buf());
    }

    /// Whether to walk the root `path` on device `dev` at all: with
    /// `exclude_snapshots`, not when it is inside a btrfs snapshot.
    fn root(&self, dev: u64, path: &Path) -> Result<(), SkipReason> {
        if self.exclude_snapshots
            && self
                .devs
                .get(dev, path, &self.tree)
                .is_some_and(|d| d.snapshot)
        {
            return Err(SkipReason::Snapshot);
        }
        Ok(())
    }

    /// Whether a regular file is a candidate; its device if so.
    pub(crate) fn file(
        &self,
        dev: u64,
        ino: u64,
        size: u64,
        path: &Path,
    ) -> Result<DevId, SkipReason> {
        if self.swaps.contains(&(dev, ino)) {
            return Err(SkipReason::SwapFile);
        }
        let info = self.devs.get(dev, path, &self.tree);
        let Some((info, id)) = info.and_then(|d| Some((d, d.id?))) else {
            return Err(SkipReason::UnsupportedFilesystem);
        };
        if size < self.min_size.max(info.min_size) {
            return Err(SkipReason::TooSmall);
        }
        Ok(id)
    }
}

fn build_globs(patterns: &[String]) -> Result<GlobSet, globset::Error> {
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        b.add(Glob::new(p)?);
    }
    b.build()
}

/// Checks the exclude patterns; a bad pattern is reported before walking.
pub fn validate_excludes(patterns: &[String]) -> Result<(), String> {
    build_globs(patterns).map(|_| ()).map_err(|e| e.to_string())
}

#[derive(Default)]
pub(crate) struct Collected {
    files: Vec<FileEntry>,
    /// The names of `files` (positions local until [`Collected::flush_names`]).
    names: LocalNames,
    skipped: BTreeMap<SkipReason, u64>,
    pub(crate) errors: Vec<ScanError>,
    /// Directories whose path exceeds PATH_MAX: walked with descriptors.
    too_long: Vec<PathBuf>,
}

impl Collected {
    pub(crate) fn skip(&mut self, r: SkipReason) {
        *self.skipped.entry(r).or_default() += 1;
    }

    /// Moves `got`'s files (their names already in the shared tree),
    /// errors and skips into this one.
    fn absorb(&mut self, mut got: Collected) {
        if self.files.is_empty() {
            // The usual single root: the list moves, it is not copied.
            self.files = std::mem::take(&mut got.files);
        } else {
            self.files.append(&mut got.files);
        }
        self.errors.append(&mut got.errors);
        for (k, v) in got.skipped {
            *self.skipped.entry(k).or_default() += v;
        }
    }

    /// Records a candidate file at `path`: its name goes to the local
    /// arena, its directory to the shared tree.
    pub(crate) fn add(
        &mut self,
        path: &Path,
        tree: &Mutex<DirInterner>,
        make: impl FnOnce(NameId) -> FileEntry,
    ) {
        match self.names.add(path, tree) {
            Ok(name) => self.files.push(make(name)),
            Err(e) => self.errors.push(ScanError::Walk {
                path: path.to_path_buf(),
                source: std::io::Error::other(e),
            }),
        }
    }

    /// Moves the local names into the shared tree and makes the positions
    /// of `files` final; files whose names do not fit are dropped with an
    /// error. Returns the files.
    pub(crate) fn flush_names(&mut self, tree: &mut DirInterner) -> Vec<FileEntry> {
        let mut files = std::mem::take(&mut self.files);
        match self.names.flush(tree) {
            Ok(base) => {
                for f in &mut files {
                    f.name.at += base;
                }
            }
            Err(e) => {
                self.errors.push(ScanError::Walk {
                    path: PathBuf::new(),
                    source: std::io::Error::other(format!("{} files not listed: {e}", files.len())),
                });
                files.clear();
            }
        }
        files
    }
}

fn path_read_only(p: &Path) -> bool {
    use std::os::fd::AsFd;
    crate::longpath::open_nonblocking(p)
        .ok()
        .and_then(|f| onecopy_ioctl::fs::on_read_only_mount(f.as_fd()).ok())
        .unwrap_or(false)
}

/// `(dev, ino)` of the active swap files (`/proc/swaps`): the kernel
/// refuses to share their extents (ETXTBSY), so they are left out.
fn active_swap_files() -> HashSet<(u64, u64)> {
    let Ok(text) = std::fs::read("/proc/swaps") else {
        return Default::default();
    };
    text.split(|&b| b == b'\n')
        .skip(1)
        .filter_map(|line| {
            let name = line.split(|&b| b == b' ' || b == b'\t').next()?;
            let path = unescape_octal(name);
            let m = std::fs::metadata(std::ffi::OsStr::from_bytes(&path)).ok()?;
            Some((m.dev(), m.ino()))
        })
        .collect()
}

/// Decodes the `\ooo` escapes the kernel uses for spaces and other bytes
/// in `/proc` paths.
fn unescape_octal(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// The path an `ignore` error is about, looking through its wrappers.
fn error_path(e: &ignore::Error) -> Option<PathBuf> {
    match e {
        ignore::Error::WithPath { path, .. } => Some(path.clone()),
        ignore::Error::WithDepth { err, .. } | ignore::Error::WithLineNumber { err, .. } => {
            error_path(err)
        }
        ignore::Error::Loop { child, .. } => Some(child.clone()),
        ignore::Error::Partial(errs) => errs.iter().find_map(error_path),
        _ => None,
    }
}

/// A walker thread's buffer; flushes into the shared result in batches and
/// when the walker drops the visitor.
struct Sink {
    local: Collected,
    all: Arc<Mutex<Collected>>,
    filters: Arc<Filters>,
}

impl Sink {
    fn flush(&mut self) {
        let mut files = self
            .local
            .flush_names(&mut self.filters.tree.lock().unwrap());
        let mut g = self.all.lock().unwrap();
        g.files.append(&mut files);
        g.errors.append(&mut self.local.errors);
        g.too_long.append(&mut self.local.too_long);
        for (k, v) in std::mem::take(&mut self.local.skipped) {
            *g.skipped.entry(k).or_default() += v;
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Lists the regular files under the roots. Per-entry problems are
/// recorded in the output, never fatal.
pub fn walk(opts: &WalkOptions, progress: &Progress) -> WalkOutput {
    let filters = Arc::new(Filters::new(opts, active_swap_files()));
    let mut out = Collected::default();
    let mut walked = std::collections::HashSet::new();
    for root in &opts.roots {
        // Named twice: walked once (a root inside another is walked
        // again, as excludes and subvolumes decide; its entries are
        // merged by `one_entry_per_inode`).
        if !walked.insert(root) {
            continue;
        }
        let (root_dev, root_ino, root_dir) = match std::fs::symlink_metadata(root) {
            Ok(m) => (m.dev(), m.ino(), m.is_dir()),
            Err(source) => {
                out.errors.push(ScanError::Stat {
                    path: root.clone(),
                    source,
                });
                continue;
            }
        };
        let info = RootInfo {
            dev: root_dev,
            fs: filters
                .devs
                .get(root_dev, root, &filters.tree)
                .map(|d| d.fs),
        };
        if let Err(r) = filters.root(root_dev, root) {
            out.skip(r);
            continue;
        }
        filters.whole_subvol(root_dev, root_ino, root);
        // A file root is one entry: one walker thread, which ends at once
        // (more wait for work a millisecond at a time: --fdupes gives
        // thousands of file roots).
        let threads = if root_dir { opts.threads } else { 1 };
        walk_one(root, info, threads, &filters, progress, &mut out);
    }
    let diff = walk_snapshots(opts.threads, &filters, progress, &mut out);
    let interner = std::mem::take(&mut *filters.tree.lock().unwrap());
    let tree = interner.finish(|map| {
        for f in &mut out.files {
            f.dev = map[f.dev.0 as usize];
        }
    });
    let (repeats, links) = one_entry_per_inode(&mut out.files, &tree);
    if links > 0 {
        *out.skipped.entry(SkipReason::Hardlink).or_default() += links;
    }
    progress
        .files_found
        .fetch_sub(repeats + links, Ordering::Relaxed);
    // The list grew by doubling: give the slack back before it is kept.
    out.files.shrink_to_fit();
    WalkOutput {
        files: out.files,
        tree,
        skipped: out.skipped,
        errors: out.errors,
        snapshot_diff: diff,
    }
}

/// Walks one root (or a snapshot taken as one) into `out`.
fn walk_one(
    root: &Path,
    info: RootInfo,
    threads: usize,
    filters: &Arc<Filters>,
    progress: &Progress,
    out: &mut Collected,
) {
    let mut got = walk_root(root, info, threads, filters, progress);
    for dir in std::mem::take(&mut got.too_long) {
        if progress.cancelled() {
            break;
        }
        walk_long(&dir, info, filters, progress, &mut got);
    }
    out.absorb(got);
}

/// The read-only snapshots the walk met: each listed by difference from
/// the subvolume it was taken of when the walk entered that one's root
/// ([`crate::snapdiff`]), else walked whole (and the snapshots met in it
/// after it).
fn walk_snapshots(
    threads: usize,
    filters: &Arc<Filters>,
    progress: &Progress,
    out: &mut Collected,
) -> crate::snapdiff::SnapshotDiff {
    let mut diff = Default::default();
    let mut parents = HashMap::new();
    loop {
        let next = filters.deferred.lock().unwrap().pop();
        let Some((snap, dev)) = next else { break };
        if progress.cancelled() {
            break;
        }
        let Some(info) = filters.devs.get(dev, &snap, &filters.tree) else {
            continue;
        };
        let parent = filters
            .subvols
            .lock()
            .unwrap()
            .get(&info.parent_uuid)
            .cloned();
        if let Some(parent) = parent {
            let mut mine = Collected::default();
            let snapshot = crate::snapdiff::Snapshot {
                path: &snap,
                dev,
                otransid: info.otransid,
                ctransid: info.ctransid,
                parent: &parent,
            };
            let listed = crate::snapdiff::list(
                &snapshot,
                &mut parents,
                filters,
                progress,
                &mut mine,
                &mut diff,
            );
            mine.files = mine.flush_names(&mut filters.tree.lock().unwrap());
            out.absorb(mine);
            if listed.is_ok() {
                continue;
            }
        }
        filters.whole_subvol(dev, SUBVOL_ROOT_INO, &snap);
        let root = RootInfo {
            dev,
            fs: Some(info.fs),
        };
        walk_one(&snap, root, threads, filters, progress, out);
    }
    diff
}

/// Walks one root in parallel; directories beyond PATH_MAX are left in
/// `too_long` for [`walk_long`].
fn walk_root(
    root: &Path,
    info: RootInfo,
    threads: usize,
    filters: &Arc<Filters>,
    progress: &Progress,
) -> Collected {
    let mut builder = WalkBuilder::new(root);
    builder
        .standard_filters(false)
        .hidden(false)
        .follow_links(false)
        .same_file_system(false)
        .threads(threads.max(1));
    let all = Arc::new(Mutex::new(Collected::default()));
    {
        let filters = filters.clone();
        let all = all.clone();
        builder.filter_entry(move |e| e.depth() == 0 || enter_entry(e, info, &filters, &all));
    }
    builder.build_parallel().run(|| {
        let mut sink = Sink {
            local: Collected::default(),
            all: all.clone(),
            filters: filters.clone(),
        };
        Box::new(move |res| {
            if progress.cancelled() {
                return WalkState::Quit;
            }
            visit(res, &sink.filters, progress, &mut sink.local);
            if sink.local.files.len() >= 4096 {
                sink.flush();
            }
            WalkState::Continue
        })
    });
    // Every visitor's Sink has flushed on drop by now.
    let got = std::mem::take(&mut *all.lock().unwrap());
    got
}

/// The parallel walker's entry filter: names, then directories.
fn enter_entry(
    e: &ignore::DirEntry,
    root: RootInfo,
    filters: &Filters,
    all: &Mutex<Collected>,
) -> bool {
    let verdict = filters.name(e.path()).and_then(|()| {
        if !e.file_type().is_some_and(|t| t.is_dir()) {
            return Ok(());
        }
        match e.metadata() {
            Ok(m) => filters.dir(root, m.dev(), m.ino(), e.path()),
            Err(_) => Ok(()),
        }
    });
    match verdict {
        Ok(()) => true,
        Err(Some(r)) => {
            all.lock().unwrap().skip(r);
            false
        }
        Err(None) => false,
    }
}

/// Records one entry of the parallel walk.
fn visit(
    res: Result<ignore::DirEntry, ignore::Error>,
    filters: &Filters,
    progress: &Progress,
    local: &mut Collected,
) {
    let ent = match res {
        Ok(e) => e,
        Err(err) => return walk_error(err, local),
    };
    let ft = ent.file_type();
    if ft.is_some_and(|t| t.is_dir()) {
        return;
    }
    if !ft.is_some_and(|t| t.is_file()) {
        return local.skip(SkipReason::NotRegular);
    }
    let meta = match ent.metadata() {
        Ok(m) => m,
        Err(err) => {
            let source = err
                .into_io_error()
                .unwrap_or_else(|| std::io::Error::other("stat failed"));
            // Deleted between listing and stat: nothing to do.
            if source.kind() == std::io::ErrorKind::NotFound {
                return local.skip(SkipReason::Vanished);
            }
            let path = ent.path().to_path_buf();
            return local.errors.push(ScanError::Stat { path, source });
        }
    };
    let dev = match filters.file(meta.dev(), meta.ino(), meta.size(), ent.path()) {
        Ok(d) => d,
        Err(r) => return local.skip(r),
    };
    count_found(progress, meta.size());
    local.add(ent.path(), &filters.tree, |name| {
        FileEntry::from_meta(name, dev, &meta)
    });
}

/// Records a walk error; a path beyond PATH_MAX is kept for [`walk_long`].
fn walk_error(err: ignore::Error, local: &mut Collected) {
    let path = error_path(&err).unwrap_or_default();
    let source = err
        .into_io_error()
        .unwrap_or_else(|| std::io::Error::other("walk error"));
    if source.raw_os_error() == Some(libc::ENAMETOOLONG) && !path.as_os_str().is_empty() {
        local.too_long.push(path);
    } else {
        local.errors.push(ScanError::Walk { path, source });
    }
}

pub(crate) fn count_found(progress: &Progress, size: u64) {
    progress.files_found.fetch_add(1, Ordering::Relaxed);
    progress.bytes_found.fetch_add(size, Ordering::Relaxed);
}

/// Walks a directory deeper than PATH_MAX with descriptors, under the same
/// [`Filters`] as the parallel walker.
fn walk_long(
    dir: &Path,
    root: RootInfo,
    filters: &Filters,
    progress: &Progress,
    got: &mut Collected,
) {
    let mut mine = Collected::default();
    let skipped = std::cell::RefCell::new(BTreeMap::<SkipReason, u64>::new());
    let skip = |r: SkipReason| *skipped.borrow_mut().entry(r).or_default() += 1;
    let keep_name = |p: &Path| match filters.name(p) {
        Ok(()) => true,
        Err(r) => {
            r.map(skip);
            false
        }
    };
    let keep_dir = |p: &Path, st: &rustix::fs::Stat| {
        filters
            .dir(root, st.st_dev, st.st_ino, p)
            .map_err(|r| r.map(skip))
            .is_ok()
    };
    let (found, errs) = crate::longpath::walk(dir, &keep_dir, &keep_name);
    for (path, source) in errs {
        got.errors.push(ScanError::Walk { path, source });
    }
    for (r, n) in skipped.into_inner() {
        *got.skipped.entry(r).or_default() += n;
    }
    for f in found {
        let size = f.stat.st_size as u64;
        let dev = match filters.file(f.stat.st_dev, f.stat.st_ino, size, &f.path) {
            Ok(d) => d,
            Err(r) => {
                got.skip(r);
                continue;
            }
        };
        count_found(progress, size);
        mine.add(&f.path, &filters.tree, |name| {
            FileEntry::from_stat(name, dev, &f.stat)
        });
    }
    let mut files = mine.flush_names(&mut filters.tree.lock().unwrap());
    got.files.append(&mut files);
    got.errors.append(&mut mine.errors);
}

/// Sorts by (device, inode) and keeps one entry per inode (further names
/// are hardlinks), preferring a name on a writable mount (a read-only bind
/// mount of the same files would make it a source only). Returns how many
/// entries were a name met again, and how many further names (hard links)
/// were dropped.
fn one_entry_per_inode(files: &mut Vec<FileEntry>, tree: &Tree) -> (u64, u64) {
    files.sort_unstable_by(|a, b| {
        (a.dev, a.ino)
            .cmp(&(b.dev, b.ino))
            .then_with(|| tree.path(a.name).cmp(&tree.path(b.name)))
    });
    // The same name met twice (a root named twice, or inside another
    // root): one entry, not a hard link of itself.
    let listed = files.len();
    files.dedup_by(|b, a| {
        (a.dev, a.ino) == (b.dev, b.ino) && tree.path(a.name) == tree.path(b.name)
    });
    let repeats = (listed - files.len()) as u64;
    let mut i = 0;
    while i < files.len() {
        let mut j = i + 1;
        while j < files.len() && files[j].dev == files[i].dev && files[j].ino == files[i].ino {
            j += 1;
        }
        let read_only = |k: usize| path_read_only(&tree.path(files[k].name));
        if j - i > 1 && read_only(i) {
            if let Some(k) = (i + 1..j).find(|&k| !read_only(k)) {
                files.swap(i, k);
            }
        }
        i = j;
    }
    let before = files.len();
    files.dedup_by(|b, a| a.dev == b.dev && a.ino == b.ino);
    (repeats, (before - files.len()) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_escapes() {
        assert_eq!(unescape_octal(br"/swap\040file"), b"/swap file".to_vec());
        assert_eq!(unescape_octal(br"/a\134b"), b"/a\\b".to_vec());
        assert_eq!(unescape_octal(br"/odd\9x\7"), br"/odd\9x\7".to_vec());
        assert_eq!(unescape_octal(br"\777"), vec![255u8]);
    }

    fn opts(excludes: &[&str]) -> WalkOptions {
        WalkOptions {
            roots: vec![],
            one_file_system: true,
            excludes: excludes.iter().map(|s| s.to_string()).collect(),
            min_size: 0,
            exclude_snapshots: false,
            threads: 1,
        }
    }

    #[test]
    fn filters_exclude_names_and_no_other() {
        let f = Filters::new(&opts(&["*.iso", "/x/cache"]), HashSet::new());
        assert_eq!(
            f.name(Path::new("/x/a.iso")),
            Err(Some(SkipReason::Excluded))
        );
        assert_eq!(
            f.name(Path::new("/x/cache")),
            Err(Some(SkipReason::Excluded))
        );
        // A user's name, however much it looks like onecopy's.
        assert_eq!(f.name(Path::new("/x/.onecopy-tmp.42")), Ok(()));
        assert_eq!(f.name(Path::new("/x/a.txt")), Ok(()));
    }

    #[test]
    fn filters_skip_swap_files_before_anything_else() {
        let f = Filters::new(&opts(&[]), [(7, 9)].into_iter().collect());
        assert_eq!(
            f.file(7, 9, 1 << 30, Path::new("/nowhere")).err(),
            Some(SkipReason::SwapFile)
        );
        // The same device seen from its root is not "another filesystem".
        let root = RootInfo {
            dev: 7,
            fs: Some(1),
        };
        assert_eq!(f.dir(root, 7, 256, Path::new("/nowhere")), Ok(()));
        assert_eq!(
            f.dir(root, 8, 256, Path::new("/nowhere")),
            Err(Some(SkipReason::OtherFilesystem))
        );
    }

    /// `exclude_snapshots` keeps the walk out of btrfs snapshots (devices
    /// whose facts say so), below a root and as a root, on its own or with
    /// `one_file_system`; without it writable snapshots are entered and
    /// read-only ones kept for later (not counted as skipped), at their
    /// root directory only; other subvolumes' roots are noted as walked.
    #[test]
    fn filters_skip_snapshots_only_when_asked() {
        let snap = DevInfo {
            id: None,
            fs: 1,
            subvol: 300,
            read_only: true,
            snapshot: true,
            uuid: [3; 16],
            parent_uuid: [2; 16],
            otransid: 40,
            ctransid: 40,
            block: 4096,
            min_size: BTRFS_MAX_INLINE + 1,
            supported: true,
        };
        let writable_snap = DevInfo {
            read_only: false,
            subvol: 301,
            uuid: [4; 16],
            ..snap
        };
        let live = DevInfo {
            read_only: false,
            snapshot: false,
            subvol: 302,
            uuid: [2; 16],
            parent_uuid: [0; 16],
            ..snap
        };
        let root = RootInfo {
            dev: 7,
            fs: Some(1),
        };
        let p = Path::new("/nowhere");
        for one_fs in [true, false] {
            for exclude in [false, true] {
                let mut o = opts(&[]);
                o.one_file_system = one_fs;
                o.exclude_snapshots = exclude;
                let f = Filters::new(&o, HashSet::new());
                f.devs.map.lock().unwrap().extend([
                    (8, Some(snap)),
                    (9, Some(writable_snap)),
                    (10, Some(live)),
                ]);
                let want = if exclude {
                    Err(SkipReason::Snapshot)
                } else {
                    Ok(())
                };
                let ctx = format!("one_file_system {one_fs}, exclude_snapshots {exclude}");
                let later = if exclude {
                    Err(Some(SkipReason::Snapshot))
                } else {
                    Err(None)
                };
                assert_eq!(f.dir(root, 8, 256, p), later, "{ctx}");
                assert_eq!(f.dir(root, 9, 256, p), want.map_err(Some), "{ctx}");
                assert_eq!(f.dir(root, 10, 256, p), Ok(()), "{ctx}");
                let deferred = f.deferred.lock().unwrap().clone();
                let want_deferred = if exclude {
                    vec![]
                } else {
                    vec![(p.to_path_buf(), 8)]
                };
                assert_eq!(deferred, want_deferred, "{ctx}");
                let subvols = f.subvols.lock().unwrap().clone();
                assert_eq!(subvols.get(&[2; 16]).map(|p| p.as_path()), Some(p), "{ctx}");
                assert_eq!(subvols.contains_key(&[4; 16]), !exclude, "{ctx}");
                assert!(!subvols.contains_key(&[3; 16]), "{ctx}");
                // A directory of a subvolume seen first below its root (a
                // bind mount of part of it) is entered, not noted.
                assert_eq!(f.dir(root, 8, 300, p), Ok(()), "{ctx}");
                assert_eq!(f.deferred.lock().unwrap().len(), want_deferred.len());
                assert_eq!(f.root(8, p), want, "{ctx}");
                assert_eq!(f.root(9, p), want, "{ctx}");
                assert_eq!(f.root(10, p), Ok(()), "{ctx}");
                // Inside a root that is itself a snapshot (same device):
                // the root's verdict covers it.
                let in_snap = RootInfo {
                    dev: 8,
                    fs: Some(1),
                };
                assert_eq!(f.dir(in_snap, 8, 256, p), Ok(()), "{ctx}");
                // Another filesystem is that first.
                if one_fs {
                    let other = RootInfo {
                        dev: 7,
                        fs: Some(2),
                    };
                    assert_eq!(
                        f.dir(other, 8, 256, p),
                        Err(Some(SkipReason::OtherFilesystem)),
                        "{ctx}"
                    );
                }
            }
        }
    }

    /// The descriptor walker applies the same filters: excluded names are
    /// not listed from a deep tree either; a name like onecopy's is.
    #[test]
    fn long_path_walk_uses_the_shared_filters() {
        let base = tempfile::tempdir().unwrap();
        for d in ["keep", "skip.iso", ".onecopy-tmp.1"] {
            std::fs::create_dir(base.path().join(d)).unwrap();
            std::fs::write(base.path().join(d).join("f"), b"x").unwrap();
        }
        let f = Filters::new(&opts(&["*.iso"]), HashSet::new());
        let m = std::fs::metadata(base.path()).unwrap();
        let root = RootInfo {
            dev: m.dev(),
            fs: None,
        };
        let mut got = Collected::default();
        walk_long(base.path(), root, &f, &Progress::default(), &mut got);
        assert_eq!(got.skipped.get(&SkipReason::Excluded), Some(&1));
        // keep/f and .onecopy-tmp.1/f reached the file rules (tmpfs or
        // not, they were seen).
        let seen = got.files.len() as u64 + got.skipped.values().sum::<u64>() - 1;
        assert_eq!(seen, 2, "{:?}", got.skipped);
        let tree = std::mem::take(&mut *f.tree.lock().unwrap()).finish(|_| {});
        assert!(got.files.iter().all(|e| {
            let p = tree.path(e.name);
            p.ends_with("keep/f") || p.ends_with(".onecopy-tmp.1/f")
        }));
    }
}
