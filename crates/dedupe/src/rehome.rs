//! Re-homing: releasing btrfs extents that dedupe left "bookended".
//!
//! btrfs frees an extent only when none of its bytes is referenced. After
//! duplicate ranges were shared, files may still reference a "live
//! remainder" of an old, large extent, which keeps all of it allocated.
//! The remainder may be referenced by several files: in a chain of
//! near-copies, `v1` shares the block carrying `v0`'s change with `v0`'s
//! old extent.
//!
//! Re-homing copies the live remainder of such an extent, once, into an
//! unnamed temporary file (`O_TMPFILE`, see [`crate::tmpdir`]) and asks
//! `FIDEDUPERANGE` to share the copy into *every* file that references the
//! extent: the kernel compares the bytes, so a concurrent change only makes
//! the call fail. Once no byte of the old extent is referenced, btrfs frees
//! it. The user's files are never written; the temporary file has no name
//! and disappears when it is closed, or when the process dies.
//!
//! Which extents: those whose every reference (`LOGICAL_INO`) is a scanned,
//! unchanged, writable file of this run, and whose live bytes are fewer
//! than the extent's size — the copy writes `live` bytes and releases the
//! whole extent. Extents are taken by the most bytes released per byte
//! written first, within a bound on the bytes written per run.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use onecopy_ioctl::btrfs::{self, FileExtentKind};
use onecopy_ioctl::dedupe::{dedupe_range, describe_errno, DedupeDest, DedupeStatus};

use crate::{DedupeError, DestSkip, ExecProgress, ExecReport, Files};

/// Re-homing settings.
#[derive(Debug, Clone)]
pub struct RehomeOptions {
    /// A directory on the filesystem being deduped, in which unnamed
    /// temporary files are opened (`O_TMPFILE`: no name ever appears): a
    /// root on it, or `None` (then, as when a root refuses, e.g. a
    /// read-only snapshot, the directory of a file being deduped).
    pub tmp_dir: Option<PathBuf>,
    /// At most this many bytes copied per run (0 disables re-homing).
    pub max_write: u64,
}

/// One scanned file's reference to part of an extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ref {
    pub file: u32,
    pub file_offset: u64,
    /// Where the referenced bytes start inside the extent.
    pub extent_offset: u64,
    pub len: u64,
}

/// An on-disk extent and every reference to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pinned {
    pub disk_bytenr: u64,
    pub disk_bytes: u64,
    pub refs: Vec<Ref>,
}

impl Pinned {
    /// The referenced byte ranges of the extent, merged, as (start, end).
    pub fn live(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self
            .refs
            .iter()
            .filter(|r| r.len > 0)
            .map(|r| (r.extent_offset, r.extent_offset + r.len))
            .collect();
        v.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        for (s, e) in v {
            match out.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => out.push((s, e)),
            }
        }
        out
    }

    /// The bytes of the extent's blocks that hold live data (`block`: the
    /// filesystem block size): what a copy allocates. The slack after a
    /// file's last byte is not worth a copy of the rest.
    pub fn live_bytes(&self, block: u64) -> u64 {
        let block = block.max(1);
        let mut total = 0u64;
        let mut end = 0u64;
        for (s, e) in self.live() {
            let (s, e) = ((s / block * block).max(end), e.div_ceil(block) * block);
            total += e.saturating_sub(s);
            end = end.max(e);
        }
        total
    }
}

/// The extents worth re-homing, best first: those that release more than
/// they write, by bytes released per byte written, while the bytes
/// written stay within `budget`. Also returns the worthwhile extents that
/// did not fit in the budget.
pub fn choose(pinned: Vec<Pinned>, budget: u64, block: u64) -> (Vec<Pinned>, Vec<Pinned>) {
    let mut worth: Vec<(u64, Pinned)> = pinned
        .into_iter()
        .map(|p| (p.live_bytes(block), p))
        .filter(|(live, p)| *live > 0 && *live < p.disk_bytes)
        .collect();
    // released / written, descending, compared without division.
    worth.sort_by(|(la, a), (lb, b)| {
        (u128::from(b.disk_bytes) * u128::from(*la))
            .cmp(&(u128::from(a.disk_bytes) * u128::from(*lb)))
            .then(a.disk_bytenr.cmp(&b.disk_bytenr))
    });
    let mut left = budget;
    let (mut out, mut over) = (Vec::new(), Vec::new());
    for (live, p) in worth {
        if live <= left {
            left -= live;
            out.push(p);
        } else {
            over.push(p);
        }
    }
    (out, over)
}

/// Lays the live ranges out in temporary files: each inner list is one
/// file, its ranges stored back to back. `FIDEDUPERANGE` accepts a length
/// that is not a multiple of `block` only when it reaches the end of both
/// files, so a range ending off a block boundary (a file's tail) goes last
/// in its temporary file.
pub fn segments(live: &[(u64, u64)], block: u64) -> Vec<Vec<(u64, u64)>> {
    let block = block.max(1);
    let (mut aligned, mut tails): (Vec<_>, Vec<_>) =
        live.iter().partition(|r| r.1.is_multiple_of(block));
    let mut out = Vec::new();
    if !tails.is_empty() {
        aligned.push(tails.remove(0));
    }
    if !aligned.is_empty() {
        out.push(aligned);
    }
    out.extend(tails.into_iter().map(|t| vec![t]));
    out
}

/// Where extent offset `eo` lands in the temporary files, each holding
/// its segment from `lead` bytes on: (segment, offset in its file).
fn place(segs: &[Vec<(u64, u64)>], lead: u64, eo: u64) -> Option<(usize, u64)> {
    for (i, seg) in segs.iter().enumerate() {
        let mut at = lead;
        for &(s, e) in seg {
            if s <= eo && eo < e {
                return Some((i, at + eo - s));
            }
            at += e - s;
        }
    }
    None
}

/// The references a file's extent items make, clamped to its size.
fn file_refs(file: u32, f: &File, size: u64) -> std::io::Result<Vec<(u64, u64, Ref)>> {
    let ino = f.metadata()?.ino();
    Ok(btrfs::file_extents(f.as_fd(), ino)?
        .into_iter()
        // A compressed extent's size on disk is not what a copy writes.
        .filter(|x| x.kind == FileExtentKind::Regular && x.disk_bytenr != 0 && x.compression == 0)
        .filter(|x| x.file_offset < size)
        .map(|x| {
            let r = Ref {
                file,
                file_offset: x.file_offset,
                extent_offset: x.offset,
                len: x.num_bytes.min(size - x.file_offset),
            };
            (x.disk_bytenr, x.disk_num_bytes, r)
        })
        .collect())
}

/// Where this run's unnamed temporary files go: the preferred directory
/// (a root on the filesystem) if it takes one, else the directory of one
/// of the first files changed (on the filesystem by definition), or the
/// last refusal.
fn tmp_dir(
    files: &Files<'_>,
    changed: &[u32],
    opts: &RehomeOptions,
) -> Result<PathBuf, (PathBuf, std::io::Error)> {
    let parents = changed
        .iter()
        .take(4)
        .filter_map(|&f| files.path(f).parent().map(Path::to_path_buf));
    let mut last = None;
    for dir in opts.tmp_dir.clone().into_iter().chain(parents) {
        match crate::tmpdir::anonymous_file(&dir) {
            Ok(_) => return Ok(dir),
            Err(e) => last = Some((dir, e)),
        }
    }
    Err(last.unwrap_or_else(|| (PathBuf::new(), std::io::ErrorKind::NotFound.into())))
}

/// No directory took an unnamed temporary file: re-homing is off for this
/// run, said once, and (unless the filesystem has no `O_TMPFILE` at all)
/// the files it changed stay unsettled.
fn unavailable(dir: &Path, e: std::io::Error, changed: &[u32], rep: &mut ExecReport) {
    let why = format!(
        "{}: cannot open an unnamed temporary file (O_TMPFILE): {e}; extents that dedupe left partly referenced stay allocated",
        dir.display()
    );
    if crate::tmpdir::is_unsupported(&e) {
        // For good on this filesystem: nothing to try again.
        rep.stats.rehome_unavailable = Some(why);
        return;
    }
    rep.errors.push(DedupeError::Rehome {
        path: dir.to_path_buf(),
        why,
    });
    // Not done: a later run (another root first, a remount) tries again.
    for &f in changed {
        rep.unsettled[f as usize] = true;
    }
}

/// Re-homes the extents the files changed by this run leave bookended.
pub(crate) fn rehome(
    files: &mut Files<'_>,
    changed: &[u32],
    opts: &RehomeOptions,
    progress: &ExecProgress,
    rep: &mut ExecReport,
) {
    let Some(first) = changed.first() else { return };
    // Unnamed temporary files or nothing: never a name in the user's tree.
    let dir = match tmp_dir(files, changed, opts) {
        Ok(dir) => dir,
        Err((dir, e)) => return unavailable(&dir, e, changed, rep),
    };

    // Commit first: extent back references added by this run must be
    // visible to LOGICAL_INO.
    if let Ok(f) = files.get(*first) {
        let _ = onecopy_ioctl::fs::syncfs(f.as_fd());
    }
    let pinned = collect(files, changed, rep);
    let block = files.device(*first).block;
    let (chosen, over) = choose(pinned, opts.max_write, block);
    rep.stats.rehome_over_budget += over.len() as u64;
    // Not done: a later run must look at these files again.
    for r in over.iter().flat_map(|p| &p.refs) {
        rep.unsettled[r.file as usize] = true;
    }
    let mut buf = vec![0u8; 1 << 20];
    for p in chosen {
        if progress.cancel.load(Ordering::Relaxed) {
            return;
        }
        rehome_extent(files, &p, &dir, &mut buf, rep);
    }
}

/// The partly referenced extents of the changed files whose every
/// reference is a file of this run that re-homing may change.
fn collect(files: &mut Files<'_>, changed: &[u32], rep: &mut ExecReport) -> Vec<Pinned> {
    let mut refs_of: HashMap<u32, Vec<(u64, u64, Ref)>> = HashMap::new();
    // Extent -> (size, the changed files' references to it).
    let mut extents: BTreeMap<u64, (u64, Vec<Ref>)> = BTreeMap::new();
    for &i in changed {
        let Some(r) = read_refs(files, i, rep) else {
            continue;
        };
        for (b, n, x) in &r {
            extents.entry(*b).or_insert((*n, Vec::new())).1.push(*x);
        }
        refs_of.insert(i, r);
    }
    let by_key: HashMap<(u64, u64), u32> = (0..files.entries.len() as u32)
        .map(|i| ((files.device(i).subvol, files.entry(i).ino), i))
        .collect();
    let mut out = Vec::new();
    for (bytenr, (disk_bytes, own)) in extents {
        let p = Pinned {
            disk_bytenr: bytenr,
            disk_bytes,
            refs: own,
        };
        // Fully referenced by the changed files alone: nothing to gain.
        let block = files.device(p.refs[0].file).block;
        if p.live_bytes(block) >= disk_bytes {
            continue;
        }
        if let Some(p) = with_all_owners(files, p, &by_key, &mut refs_of, rep) {
            out.push(p);
        }
    }
    out
}

/// A file's references, if it may take part in re-homing (unchanged since
/// it was scanned, writable, not protected).
fn read_refs(files: &mut Files<'_>, i: u32, rep: &mut ExecReport) -> Option<Vec<(u64, u64, Ref)>> {
    let f = files.get(i).ok()?;
    let read_only = files.device(i).read_only;
    if !files.unchanged(i, &f) || read_only || crate::dest_refusal(&f).is_some() {
        return None;
    }
    match file_refs(i, &f, files.entry(i).size) {
        Ok(r) => Some(r),
        Err(source) => {
            rep.errors.push(DedupeError::Fiemap {
                path: files.path(i),
                source,
            });
            None
        }
    }
}

/// Adds the references of every other owner of `p`'s extent; `None` when
/// an owner is not a file re-homing may change (outside the run, in a
/// snapshot, read-only, changed).
fn with_all_owners(
    files: &mut Files<'_>,
    mut p: Pinned,
    by_key: &HashMap<(u64, u64), u32>,
    refs_of: &mut HashMap<u32, Vec<(u64, u64, Ref)>>,
    rep: &mut ExecReport,
) -> Option<Pinned> {
    let f = files.get(p.refs.first()?.file).ok()?;
    let owners = btrfs::extent_owners(f.as_fd(), p.disk_bytenr).ok()??;
    let mut others: Vec<u32> = Vec::new();
    for o in owners {
        let &i = by_key.get(&(o.root, o.ino))?;
        if !p.refs.iter().any(|r| r.file == i) && !others.contains(&i) {
            others.push(i);
        }
    }
    for i in others {
        if let std::collections::hash_map::Entry::Vacant(v) = refs_of.entry(i) {
            v.insert(read_refs(files, i, rep)?);
        }
        let r = refs_of.get(&i)?;
        p.refs.extend(
            r.iter()
                .filter(|(b, _, _)| *b == p.disk_bytenr)
                .map(|t| t.2),
        );
    }
    p.refs.sort_unstable();
    p.refs.dedup();
    Some(p)
}

/// Copies `p`'s live bytes into unnamed temporary files and shares them
/// into every reference. Files of an extent not re-homed whole (an
/// error, a change) are left unsettled: a later run tries again.
fn rehome_extent(
    files: &mut Files<'_>,
    p: &Pinned,
    dir: &Path,
    buf: &mut [u8],
    rep: &mut ExecReport,
) {
    if !rehome_extent_whole(files, p, dir, buf, rep) {
        for r in &p.refs {
            rep.unsettled[r.file as usize] = true;
        }
    }
}

/// [`rehome_extent`]'s work: whether every reference now shares the copy
/// (its temporary files opened in `dir`).
fn rehome_extent_whole(
    files: &mut Files<'_>,
    p: &Pinned,
    dir: &Path,
    buf: &mut [u8],
    rep: &mut ExecReport,
) -> bool {
    let block = files.device(p.refs[0].file).block;
    let segs = segments(&p.live(), block);
    // Each temporary file holds its segment from one block on, after a
    // hole: a file of at most one block may be stored inline in btrfs
    // metadata, and sharing an inline extent makes the kernel write a
    // private copy into every destination (files that shared the bytes
    // would no longer share them). A hole allocates nothing.
    let lead = block;
    let mut tmps = Vec::with_capacity(segs.len());
    for _ in &segs {
        match crate::tmpdir::anonymous_file(dir) {
            Ok(t) => tmps.push(t),
            Err(e) => {
                rep.errors.push(DedupeError::Rehome {
                    path: dir.to_path_buf(),
                    why: format!("cannot open an unnamed temporary file: {e}"),
                });
                return false;
            }
        }
    }
    for r in &p.refs {
        let f = files.get(r.file);
        if let Ok(f) = &f {
            files.involved[r.file as usize] = true;
            files.snapshot_before(r.file, f);
        }
    }
    let written = match copy_live(files, p, &segs, lead, &tmps, buf) {
        Ok(n) => n,
        Err((file, why)) => {
            // A file changed under us (truncated, rewritten) is a race the
            // run skips, not an error: nothing was shared yet.
            if changed_under_us(files, file) {
                crate::skip(rep, file, DestSkip::Changed);
                return false;
            }
            rep.errors.push(DedupeError::Rehome {
                path: files.path(file),
                why,
            });
            return false;
        }
    };
    rep.stats.rehome_bytes_written += written;
    let mut all = true;
    for r in &p.refs {
        let Some((seg, at)) = place(&segs, lead, r.extent_offset) else {
            all = false;
            continue;
        };
        all &= share_back(files, &tmps[seg], at, r, rep);
    }
    if all {
        rep.stats.rehome_extents += 1;
        rep.stats.rehome_bytes_released += p.disk_bytes;
    }
    all
}

/// Copies each live byte of `p` once, from a file that references it, to
/// its place in the temporary files (see [`place`]). Returns the bytes
/// written, or the file that could not be read and why.
fn copy_live(
    files: &mut Files<'_>,
    p: &Pinned,
    segs: &[Vec<(u64, u64)>],
    lead: u64,
    tmps: &[File],
    buf: &mut [u8],
) -> Result<u64, (u32, String)> {
    let mut refs = p.refs.clone();
    refs.sort_by_key(|r| r.extent_offset);
    let (mut done_to, mut written) = (0u64, 0u64);
    for r in refs {
        let end = r.extent_offset + r.len;
        let mut eo = r.extent_offset.max(done_to);
        let src = files.get(r.file).map_err(|e| (r.file, e.to_string()))?;
        while eo < end {
            let (seg, at) = place(segs, lead, eo).ok_or((r.file, "layout".to_string()))?;
            let want = ((end - eo) as usize).min(buf.len());
            let n = src
                .read_at(&mut buf[..want], r.file_offset + (eo - r.extent_offset))
                .map_err(|e| (r.file, e.to_string()))?;
            if n == 0 {
                return Err((r.file, "file shrank".into()));
            }
            tmps[seg]
                .write_all_at(&buf[..n], at)
                .map_err(|e| (r.file, format!("writing the temporary copy: {e}")))?;
            eo += n as u64;
            written += n as u64;
        }
        done_to = done_to.max(end);
    }
    Ok(written)
}

/// Whether file `i` changed (or vanished) since it was read.
fn changed_under_us(files: &mut Files<'_>, i: u32) -> bool {
    match files.get(i) {
        Ok(f) => !files.unchanged(i, &f),
        Err(e) => e.is_not_found(),
    }
}

/// Shares `r.len` bytes at `at` of `tmp` into `r`'s file. Returns whether
/// all of them were shared.
fn share_back(files: &mut Files<'_>, tmp: &File, at: u64, r: &Ref, rep: &mut ExecReport) -> bool {
    let path = files.path(r.file);
    let Ok(f) = files.get(r.file) else {
        return false;
    };
    let mut done = 0u64;
    while done < r.len {
        rep.stats.dedupe_ioctls += 1;
        let res = dedupe_range(
            tmp.as_fd(),
            at + done,
            r.len - done,
            &[DedupeDest {
                fd: f.as_fd(),
                offset: r.file_offset + done,
            }],
        );
        let why = match res.as_deref() {
            Ok([DedupeStatus::Same { bytes }]) if *bytes > 0 => {
                done += bytes;
                continue;
            }
            Ok([DedupeStatus::Differs]) => {
                crate::skip(rep, r.file, DestSkip::DataDiffers);
                rep.stale[r.file as usize] = true;
                return false;
            }
            Ok([DedupeStatus::Error(e)]) => describe_errno(*e),
            Ok(_) => "the kernel shared no bytes".into(),
            Err(e) => e
                .raw_os_error()
                .map(describe_errno)
                .unwrap_or_else(|| e.to_string()),
        };
        // The kernel refuses a range past a file's end (EINVAL) when a
        // writer truncated it since it was read: a change, not an error.
        if !files.unchanged(r.file, &f) {
            crate::skip(rep, r.file, DestSkip::Changed);
            return false;
        }
        rep.errors.push(DedupeError::Rehome { path, why });
        return false;
    }
    rep.stats.rehome_ranges += 1;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(file: u32, eo: u64, len: u64) -> Ref {
        Ref {
            file,
            file_offset: eo,
            extent_offset: eo,
            len,
        }
    }

    fn pinned(bytenr: u64, size: u64, refs: Vec<Ref>) -> Pinned {
        Pinned {
            disk_bytenr: bytenr,
            disk_bytes: size,
            refs,
        }
    }

    #[test]
    fn live_merges_overlapping_references() {
        // A chain: v0 and v1 both reference v0's changed block.
        let p = pinned(
            1,
            100,
            vec![r(0, 10, 10), r(1, 10, 10), r(1, 15, 10), r(2, 50, 5)],
        );
        assert_eq!(p.live(), vec![(10, 25), (50, 55)]);
        assert_eq!(p.live_bytes(1), 20);
        // In whole blocks: [10, 30) and [50, 60).
        assert_eq!(p.live_bytes(10), 30);
        assert_eq!(p.live_bytes(100), 100);
    }

    #[test]
    fn chooses_by_net_gain_within_budget() {
        let a = pinned(1, 100, vec![r(0, 0, 90)]); // writes 90, frees 100
        let b = pinned(2, 100, vec![r(0, 0, 10)]); // writes 10, frees 100
        let c = pinned(3, 100, vec![r(0, 0, 100)]); // fully live: no gain
        let d = pinned(4, 100, vec![r(0, 0, 60)]);
        let (got, over) = choose(vec![a.clone(), b.clone(), c, d.clone()], 1000, 1);
        // A large live fraction is still worth it: no fixed ratio.
        assert_eq!(got, vec![b.clone(), d.clone(), a.clone()]);
        assert!(over.is_empty());
        // The budget takes the best ratios first and skips what overflows.
        let (got, over) = choose(vec![a.clone(), b.clone(), d.clone()], 95, 1);
        assert_eq!(got, vec![b.clone(), d]);
        assert_eq!(over, vec![a]);
        assert_eq!(choose(vec![b.clone()], 0, 1), (vec![], vec![b]));
        // A file's tail: live up to its last byte, the rest of the last
        // block is slack, not a gain.
        let tail = pinned(5, 8192, vec![r(0, 0, 8000)]);
        assert_eq!(choose(vec![tail], 1 << 20, 4096).0, vec![]);
    }

    #[test]
    fn unaligned_tails_end_their_temporary_file() {
        let live = [(0, 4096), (8192, 10000), (16384, 20480), (24576, 30000)];
        let s = segments(&live, 4096);
        assert_eq!(
            s,
            vec![
                vec![(0, 4096), (16384, 20480), (8192, 10000)],
                vec![(24576, 30000)]
            ]
        );
        assert_eq!(place(&s, 0, 16384 + 5), Some((0, 4096 + 5)));
        assert_eq!(place(&s, 0, 8192), Some((0, 8192)));
        assert_eq!(place(&s, 0, 24577), Some((1, 1)));
        assert_eq!(place(&s, 0, 5000), None);
        // After a lead of one block, in every temporary file.
        assert_eq!(place(&s, 4096, 16384 + 5), Some((0, 8192 + 5)));
        assert_eq!(place(&s, 4096, 24577), Some((1, 4097)));
        assert_eq!(place(&s, 4096, 5000), None);
        assert!(segments(&[], 4096).is_empty());
    }
}
