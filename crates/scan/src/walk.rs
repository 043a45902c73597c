//! Parallel listing of regular files under the roots.

use std::collections::{BTreeMap, HashMap};
use std::fs::Metadata;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use globset::{Glob, GlobSet, GlobSetBuilder};
use ignore::{WalkBuilder, WalkState};

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
    /// Walker threads.
    pub threads: usize,
}

/// A regular file found by the walk.
#[derive(Debug, Clone)]
pub struct FileEntry {
    pub path: PathBuf,
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    /// Hard links to the inode (a link changes ctime, not the data).
    pub nlink: u64,
    pub fs: FsId,
    /// The btrfs subvolume id (0 elsewhere): with `ino`, a key that stays
    /// valid across mounts.
    pub subvol: u64,
    /// In a read-only btrfs subvolume (a read-only snapshot): a source
    /// only, never a destination.
    pub read_only: bool,
    /// The filesystem's block size: dedupe offsets are multiples of it.
    pub fs_block: u64,
}

impl FileEntry {
    pub fn from_meta(
        path: PathBuf,
        m: &Metadata,
        fs: FsId,
        subvol: u64,
        fs_block: u64,
    ) -> FileEntry {
        FileEntry {
            path,
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
            ctime_ns: m.ctime() * 1_000_000_000 + m.ctime_nsec(),
            nlink: m.nlink(),
            fs,
            subvol,
            read_only: false,
            fs_block,
        }
    }

    /// The same from a raw `stat` (descriptor-relative walks).
    pub fn from_stat(
        path: PathBuf,
        st: &rustix::fs::Stat,
        fs: FsId,
        subvol: u64,
        fs_block: u64,
    ) -> FileEntry {
        FileEntry {
            path,
            dev: st.st_dev,
            ino: st.st_ino,
            size: st.st_size as u64,
            mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec as i64,
            ctime_ns: st.st_ctime * 1_000_000_000 + st.st_ctime_nsec as i64,
            nlink: st.st_nlink,
            fs,
            subvol,
            read_only: false,
            fs_block,
        }
    }

    /// Whether `m` (a fresh stat of the same path) shows the file unchanged.
    pub fn unchanged(&self, m: &Metadata) -> bool {
        m.dev() == self.dev
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
    pub skipped: BTreeMap<SkipReason, u64>,
    pub errors: Vec<ScanError>,
}

#[derive(Clone, Copy)]
struct DevInfo {
    fs: FsId,
    subvol: u64,
    /// A read-only btrfs subvolume.
    read_only: bool,
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
    fn get(&self, dev: u64, path: &Path) -> Option<DevInfo> {
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
            onecopy_ioctl::fs::fs_info(f.as_fd()).ok().map(|i| DevInfo {
                fs: i.fsid,
                subvol: onecopy_ioctl::btrfs::subvol_id(f.as_fd()).unwrap_or(0),
                read_only: onecopy_ioctl::btrfs::subvol_read_only(f.as_fd()).unwrap_or(false),
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
        self.map.lock().unwrap().insert(dev, info);
        info
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
struct Collected {
    files: Vec<FileEntry>,
    skipped: BTreeMap<SkipReason, u64>,
    errors: Vec<ScanError>,
    /// Directories whose path exceeds PATH_MAX: walked with descriptors.
    too_long: Vec<PathBuf>,
}

impl Collected {
    fn skip(&mut self, r: SkipReason) {
        *self.skipped.entry(r).or_default() += 1;
    }
}

fn path_read_only(p: &Path) -> bool {
    use std::os::fd::AsFd;
    std::fs::File::open(p)
        .ok()
        .and_then(|f| onecopy_ioctl::fs::on_read_only_mount(f.as_fd()).ok())
        .unwrap_or(false)
}

/// `(dev, ino)` of the active swap files (`/proc/swaps`): the kernel
/// refuses to share their extents (ETXTBSY), so they are left out.
fn active_swap_files() -> std::collections::HashSet<(u64, u64)> {
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
}

impl Sink {
    fn flush(&mut self) {
        let mut g = self.all.lock().unwrap();
        g.files.append(&mut self.local.files);
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
    let globs = Arc::new(build_globs(&opts.excludes).unwrap_or_else(|_| GlobSet::empty()));
    let swaps = Arc::new(active_swap_files());
    let devs = Arc::new(DevCache {
        map: Mutex::new(HashMap::new()),
    });
    let mut out = Collected::default();
    for root in &opts.roots {
        let root_dev = match std::fs::symlink_metadata(root) {
            Ok(m) => m.dev(),
            Err(source) => {
                out.errors.push(ScanError::Stat {
                    path: root.clone(),
                    source,
                });
                continue;
            }
        };
        let root_fs = devs.get(root_dev, root).map(|d| d.fs);
        let mut builder = WalkBuilder::new(root);
        builder
            .standard_filters(false)
            .hidden(false)
            .follow_links(false)
            .same_file_system(false)
            .threads(opts.threads.max(1));
        let all = Arc::new(Mutex::new(Collected::default()));
        {
            let globs = globs.clone();
            let devs_f = devs.clone();
            let one_fs = opts.one_file_system;
            let all_f = all.clone();
            builder.filter_entry(move |e| {
                if e.depth() == 0 {
                    return true;
                }
                if e.file_name()
                    .to_string_lossy()
                    .starts_with(crate::TMP_DIR_PREFIX)
                {
                    return false;
                }
                let excluded = !globs.is_empty()
                    && (globs.is_match(e.path()) || globs.is_match(Path::new(e.file_name())));
                if excluded {
                    all_f.lock().unwrap().skip(SkipReason::Excluded);
                    return false;
                }
                if one_fs && e.file_type().is_some_and(|t| t.is_dir()) {
                    if let Ok(m) = e.metadata() {
                        if m.dev() != root_dev {
                            let fs = devs_f.get(m.dev(), e.path()).map(|d| d.fs);
                            if fs.is_none() || fs != root_fs {
                                all_f.lock().unwrap().skip(SkipReason::OtherFilesystem);
                                return false;
                            }
                        }
                    }
                }
                true
            });
        }
        let min_size = opts.min_size;
        builder.build_parallel().run(|| {
            let all = all.clone();
            let devs = devs.clone();
            let swaps = swaps.clone();
            let mut sink = Sink {
                local: Collected::default(),
                all,
            };
            Box::new(move |res| {
                let local = &mut sink.local;
                if progress.cancelled() {
                    return WalkState::Quit;
                }
                let ent = match res {
                    Ok(e) => e,
                    Err(err) => {
                        let path = error_path(&err).unwrap_or_default();
                        let source = err
                            .into_io_error()
                            .unwrap_or_else(|| std::io::Error::other("walk error"));
                        if source.raw_os_error() == Some(libc::ENAMETOOLONG)
                            && !path.as_os_str().is_empty()
                        {
                            local.too_long.push(path);
                            return WalkState::Continue;
                        }
                        local.errors.push(ScanError::Walk { path, source });
                        return WalkState::Continue;
                    }
                };
                let ft = ent.file_type();
                if ft.is_some_and(|t| t.is_dir()) {
                    return WalkState::Continue;
                }
                if !ft.is_some_and(|t| t.is_file()) {
                    local.skip(SkipReason::NotRegular);
                    return WalkState::Continue;
                }
                let meta = match ent.metadata() {
                    Ok(m) => m,
                    Err(err) => {
                        let source = err
                            .into_io_error()
                            .unwrap_or_else(|| std::io::Error::other("stat failed"));
                        // Deleted between listing and stat: nothing to do.
                        if source.kind() == std::io::ErrorKind::NotFound {
                            local.skip(SkipReason::Vanished);
                            return WalkState::Continue;
                        }
                        local.errors.push(ScanError::Stat {
                            path: ent.path().to_path_buf(),
                            source,
                        });
                        return WalkState::Continue;
                    }
                };
                let Some(dev) = devs.get(meta.dev(), ent.path()) else {
                    local.skip(SkipReason::UnsupportedFilesystem);
                    return WalkState::Continue;
                };
                if !dev.supported {
                    local.skip(SkipReason::UnsupportedFilesystem);
                    return WalkState::Continue;
                }
                if meta.size() < min_size.max(dev.min_size) {
                    local.skip(SkipReason::TooSmall);
                    return WalkState::Continue;
                }
                if swaps.contains(&(meta.dev(), meta.ino())) {
                    local.skip(SkipReason::SwapFile);
                    return WalkState::Continue;
                }
                progress.files_found.fetch_add(1, Ordering::Relaxed);
                progress
                    .bytes_found
                    .fetch_add(meta.size(), Ordering::Relaxed);
                let mut e =
                    FileEntry::from_meta(ent.into_path(), &meta, dev.fs, dev.subvol, dev.block);
                e.read_only = dev.read_only;
                local.files.push(e);
                if local.files.len() >= 4096 {
                    sink.flush();
                }
                WalkState::Continue
            })
        });
        // Every visitor's Sink has flushed on drop by now.
        let mut got = std::mem::take(&mut *all.lock().unwrap());
        // Deeper than PATH_MAX: walk those subtrees with descriptors.
        for dir in std::mem::take(&mut got.too_long) {
            if progress.cancelled() {
                break;
            }
            let keep_name = |p: &Path| {
                let name = p.file_name().unwrap_or_default();
                !(name.to_string_lossy().starts_with(crate::TMP_DIR_PREFIX)
                    || (!globs.is_empty()
                        && (globs.is_match(p) || globs.is_match(Path::new(name)))))
            };
            let one_fs = opts.one_file_system;
            let keep_dir = |_: &Path, st: &rustix::fs::Stat| !one_fs || st.st_dev == root_dev;
            let (found, errs) = crate::longpath::walk(&dir, &keep_dir, &keep_name);
            for (path, source) in errs {
                got.errors.push(ScanError::Walk { path, source });
            }
            for f in found {
                let size = f.stat.st_size as u64;
                let Some(dev) = devs.get(f.stat.st_dev, &f.path) else {
                    *got.skipped
                        .entry(SkipReason::UnsupportedFilesystem)
                        .or_default() += 1;
                    continue;
                };
                if !dev.supported {
                    *got.skipped
                        .entry(SkipReason::UnsupportedFilesystem)
                        .or_default() += 1;
                    continue;
                }
                if size < opts.min_size.max(dev.min_size) {
                    *got.skipped.entry(SkipReason::TooSmall).or_default() += 1;
                    continue;
                }
                progress.files_found.fetch_add(1, Ordering::Relaxed);
                progress.bytes_found.fetch_add(size, Ordering::Relaxed);
                let mut e = FileEntry::from_stat(f.path, &f.stat, dev.fs, dev.subvol, dev.block);
                e.read_only = dev.read_only;
                got.files.push(e);
            }
        }
        out.files.append(&mut got.files);
        out.errors.append(&mut got.errors);
        for (k, v) in got.skipped {
            *out.skipped.entry(k).or_default() += v;
        }
    }
    // One entry per inode: further names are hardlinks.
    out.files
        .sort_unstable_by(|a, b| (a.dev, a.ino, &a.path).cmp(&(b.dev, b.ino, &b.path)));
    // Of several names of one inode, keep one on a writable mount (a
    // read-only bind mount of the same files would make it a source only).
    let mut i = 0;
    while i < out.files.len() {
        let mut j = i + 1;
        while j < out.files.len()
            && out.files[j].dev == out.files[i].dev
            && out.files[j].ino == out.files[i].ino
        {
            j += 1;
        }
        if j - i > 1 && path_read_only(&out.files[i].path) {
            if let Some(k) = (i + 1..j).find(|&k| !path_read_only(&out.files[k].path)) {
                out.files.swap(i, k);
            }
        }
        i = j;
    }
    let before = out.files.len();
    out.files.dedup_by(|b, a| a.dev == b.dev && a.ino == b.ino);
    let links = (before - out.files.len()) as u64;
    if links > 0 {
        *out.skipped.entry(SkipReason::Hardlink).or_default() += links;
        progress.files_found.fetch_sub(links, Ordering::Relaxed);
    }
    WalkOutput {
        files: out.files,
        skipped: out.skipped,
        errors: out.errors,
    }
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
}
