//! Space accounting: which physical allocations a set of files pins, and
//! how many bytes stop being pinned between two snapshots.
//!
//! The allocation unit depends on the filesystem:
//! * **btrfs** frees an extent only when no byte of it is referenced, so the
//!   unit is the whole on-disk extent (`disk_bytenr`, `disk_num_bytes`) from
//!   the file extent items, which FIEMAP alone does not reveal.
//! * **XFS** keeps a reference count per block, so the unit is the byte
//!   range reported by FIEMAP.
//!
//! Something outside the scanned roots (a snapshot, a reflinked copy
//! elsewhere) may still reference an allocation the scanned files let go:
//! * with whole extents (btrfs, root), every extent that left the scanned
//!   files is looked up after a commit
//!   ([`onecopy_ioctl::btrfs::extent_backrefs`]): one whose extent item
//!   (same start, same length) still exists is still referenced and not
//!   freed.
//!   Exact: space freed early in the run may be reused by a later
//!   allocation (a re-homed copy) covering the old start, which is another
//!   extent.
//! * with byte ranges (XFS, btrfs without root), which offer no such
//!   lookup, an allocation FIEMAP flagged shared before the run is never
//!   claimed: a lower bound, never an overstatement. So is an extent whose
//!   lookup failed.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;

use onecopy_ioctl::btrfs::{self, FileExtentKind};
use onecopy_ioctl::fiemap;

/// A physical allocation referenced by a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Unit {
    pub start: u64,
    pub len: u64,
}

/// The units one file references, and which of them FIEMAP flagged shared.
#[derive(Debug, Clone, Default)]
pub struct FileUnits {
    pub units: Vec<(Unit, bool)>,
}

/// Which accounting model applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Model {
    /// Whole extents (btrfs, with the tree search available).
    Extents,
    /// Byte ranges (XFS; btrfs without CAP_SYS_ADMIN, approximately).
    Ranges,
}

impl Model {
    /// The model for a filesystem, probed on `sample`, one of its files
    /// (inode `ino`): whole extents on btrfs when the tree search is allowed
    /// (root), byte ranges otherwise, or when the file can not be opened.
    pub fn probe(sample: &std::path::Path, ino: u64) -> Model {
        use std::os::fd::AsFd;
        let Ok(f) = onecopy_scan::longpath::open_nonblocking(sample) else {
            return Model::Ranges;
        };
        match onecopy_ioctl::fs::fs_info(f.as_fd()) {
            Ok(i) if i.kind == onecopy_ioctl::fs::FsKind::Btrfs => {
                if onecopy_ioctl::btrfs::file_extents(f.as_fd(), ino).is_ok() {
                    Model::Extents
                } else {
                    Model::Ranges
                }
            }
            _ => Model::Ranges,
        }
    }
}

/// Reads the units `f` references under `model`. Under
/// [`Model::Extents`] every unit counts as shared: whether it is is asked
/// of the extent tree after the run, not of FIEMAP, whose SHARED flag
/// costs a walk of the extent's back references through every snapshot.
pub fn file_units(f: &File, model: Model) -> std::io::Result<FileUnits> {
    let mut units = Vec::new();
    match model {
        Model::Extents => {
            let ino = f.metadata()?.ino();
            for x in btrfs::file_extents(f.as_fd(), ino)? {
                if x.kind == FileExtentKind::Inline || x.disk_bytenr == 0 {
                    continue;
                }
                let u = Unit {
                    start: x.disk_bytenr,
                    len: x.disk_num_bytes,
                };
                units.push((u, true));
            }
        }
        Model::Ranges => {
            for e in fiemap::fiemap(f.as_fd())? {
                if e.is_undedupable() {
                    continue;
                }
                units.push((
                    Unit {
                        start: e.physical,
                        len: e.length,
                    },
                    e.is_shared(),
                ));
            }
        }
    }
    units.sort_unstable();
    units.dedup();
    Ok(FileUnits { units })
}

/// Net bytes released between two snapshots of the same files: the
/// allocations `before` pinned that nothing in `after` pins any more, less
/// the allocations `after` pins that are new (such as re-homed copies).
///
/// `referenced(u)` tells whether anything on the filesystem still
/// references extent `u` (exactly that start and length) now (`None`:
/// unknown); it is asked only under [`Model::Extents`], for extents the
/// files no longer pin. Without an answer, an extent shared before the run
/// is claimed only when at least two snapshotted files referenced it (both
/// now gone); under [`Model::Ranges`], never.
pub fn freed_bytes(
    model: Model,
    before: &[&FileUnits],
    after: &[&FileUnits],
    referenced: &mut dyn FnMut(Unit) -> Option<bool>,
) -> u64 {
    // How many snapshotted files referenced each unit before.
    let mut known: HashMap<Unit, (u32, bool)> = HashMap::new();
    for fu in before {
        for &(u, shared) in &fu.units {
            let e = known.entry(u).or_insert((0, false));
            e.0 += 1;
            e.1 |= shared;
        }
    }
    let all_before: Vec<Unit> = known.keys().copied().collect();
    let unknown_claimable =
        |(n, shared): (u32, bool)| !shared || (n >= 2 && model == Model::Extents);
    let after_units: Vec<Unit> = after
        .iter()
        .flat_map(|f| f.units.iter().map(|(u, _)| *u))
        .collect();
    match model {
        Model::Extents => {
            use std::collections::HashSet;
            // An extent is its (start, length): a new extent may be
            // allocated where a freed one started.
            let still: HashSet<Unit> = after_units.iter().copied().collect();
            let was: HashSet<Unit> = all_before.iter().copied().collect();
            let gone: u64 = known
                .iter()
                .filter(|(u, _)| !still.contains(u))
                .filter(|&(&u, &k)| referenced(u).map_or(unknown_claimable(k), |r| !r))
                .map(|(u, _)| u.len)
                .sum();
            let new: u64 = still
                .iter()
                .filter(|u| !was.contains(u))
                .map(|u| u.len)
                .sum();
            gone.saturating_sub(new)
        }
        Model::Ranges => {
            let claimable = known
                .iter()
                .filter(|&(_, &k)| unknown_claimable(k))
                .map(|(&u, _)| u);
            let c = merge(claimable.collect());
            let a = merge(after_units);
            let b = merge(all_before);
            let gone = measure(&c) - overlap(&c, &a);
            let new = measure(&a) - overlap(&a, &b);
            gone.saturating_sub(new)
        }
    }
}

/// The units `before` pinned that nothing in `after` pins: what the run
/// let go, freed or still held elsewhere. Sorted, each once.
pub fn let_go(before: &[&FileUnits], after: &[&FileUnits]) -> Vec<Unit> {
    use std::collections::HashSet;
    let still: HashSet<Unit> = after
        .iter()
        .flat_map(|f| f.units.iter().map(|(u, _)| *u))
        .collect();
    let mut out: Vec<Unit> = before
        .iter()
        .flat_map(|f| f.units.iter().map(|(u, _)| *u))
        .filter(|u| !still.contains(u))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Of the extents a run let go (whole extents, [`Model::Extents`]), those
/// that only read-only snapshots still reference: deleting those
/// snapshots frees them. `roots(u)` lists the subvolumes referencing `u`
/// now (`None`: unknown, not counted); `read_only(root)` tells a read-only
/// snapshot. Returns their bytes and the snapshots, sorted.
pub fn pinned_by_snapshots(
    let_go: &[Unit],
    roots: &mut dyn FnMut(Unit) -> Option<Vec<u64>>,
    read_only: &dyn Fn(u64) -> bool,
) -> (u64, Vec<u64>) {
    let mut bytes = 0;
    let mut snapshots = std::collections::BTreeSet::new();
    for &u in let_go {
        let Some(r) = roots(u) else { continue };
        if !r.is_empty() && r.iter().all(|&root| read_only(root)) {
            bytes += u.len;
            snapshots.extend(r);
        }
    }
    (bytes, snapshots.into_iter().collect())
}

/// Sorted, non-overlapping union of ranges.
fn merge(mut v: Vec<Unit>) -> Vec<Unit> {
    v.sort_unstable();
    let mut out: Vec<Unit> = Vec::with_capacity(v.len());
    for u in v {
        if u.len == 0 {
            continue;
        }
        if let Some(last) = out.last_mut() {
            let end = last.start + last.len;
            if u.start <= end {
                last.len = end.max(u.start + u.len) - last.start;
                continue;
            }
        }
        out.push(u);
    }
    out
}

fn measure(v: &[Unit]) -> u64 {
    v.iter().map(|u| u.len).sum()
}

/// Bytes in both merged lists.
fn overlap(a: &[Unit], b: &[Unit]) -> u64 {
    let (mut i, mut j, mut total) = (0, 0, 0u64);
    while i < a.len() && j < b.len() {
        let (s, e) = (
            a[i].start.max(b[j].start),
            (a[i].start + a[i].len).min(b[j].start + b[j].len),
        );
        if s < e {
            total += e - s;
        }
        if a[i].start + a[i].len < b[j].start + b[j].len {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_only_snapshots_hold_are_freed_with_them() {
        let u = |start| Unit { start, len: 100 };
        let fu = |v: &[Unit]| FileUnits {
            units: v.iter().map(|&x| (x, true)).collect(),
        };
        let (b1, b2, a1) = (fu(&[u(0), u(100)]), fu(&[u(200), u(100)]), fu(&[u(0)]));
        let gone = let_go(&[&b1, &b2], &[&a1]);
        assert_eq!(gone, vec![u(100), u(200)]);
        // 100: snapshots 7 and 8 only; 200: snapshot 7 and a writable 5.
        let mut roots = |x: Unit| match x.start {
            100 => Some(vec![7, 8, 7]),
            200 => Some(vec![7, 5]),
            _ => None,
        };
        let ro = |r: u64| r >= 7;
        assert_eq!(
            pinned_by_snapshots(&gone, &mut roots, &ro),
            (100, vec![7, 8])
        );
        let mut nobody = |_| Some(vec![]);
        assert_eq!(
            pinned_by_snapshots(&gone, &mut nobody, &ro),
            (0, vec![]),
            "freed now"
        );
        let mut unknown = |_| None;
        assert_eq!(pinned_by_snapshots(&gone, &mut unknown, &ro), (0, vec![]));
    }

    /// Only btrfs (with the tree search) accounts whole extents; a file
    /// elsewhere, or one that can not be opened, is accounted in ranges.
    #[test]
    fn model_probe_off_btrfs_is_ranges() {
        let base = tempfile::tempdir().unwrap();
        let f = base.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&f).unwrap());
        let on_btrfs = {
            use std::os::fd::AsFd;
            let h = File::open(&f).unwrap();
            onecopy_ioctl::fs::fs_info(h.as_fd()).unwrap().kind == onecopy_ioctl::fs::FsKind::Btrfs
        };
        if !on_btrfs {
            assert_eq!(Model::probe(&f, ino), Model::Ranges);
        }
        assert_eq!(
            Model::probe(&base.path().join("missing"), ino),
            Model::Ranges
        );
    }

    fn none(_: Unit) -> Option<bool> {
        None
    }

    fn fu(v: &[(u64, u64, bool)]) -> FileUnits {
        FileUnits {
            units: v
                .iter()
                .map(|&(s, l, sh)| (Unit { start: s, len: l }, sh))
                .collect(),
        }
    }

    #[test]
    fn ranges_free_what_is_no_longer_referenced() {
        let before = fu(&[(100, 50, false)]);
        let after_dst = fu(&[(0, 30, false), (120, 20, false)]);
        let src = fu(&[(0, 30, false)]);
        assert_eq!(
            freed_bytes(
                Model::Ranges,
                &[&before, &src],
                &[&after_dst, &src],
                &mut none
            ),
            30
        );
    }

    #[test]
    fn new_allocations_are_subtracted() {
        // A 50-byte extent is released, a 5-byte re-homed copy is new.
        let before = fu(&[(100, 50, false)]);
        let after = fu(&[(0, 30, false), (500, 5, false)]);
        let src = fu(&[(0, 30, false)]);
        assert_eq!(
            freed_bytes(Model::Extents, &[&before, &src], &[&after, &src], &mut none),
            45
        );
        assert_eq!(
            freed_bytes(Model::Ranges, &[&before, &src], &[&after, &src], &mut none),
            45
        );
    }

    #[test]
    fn extents_stay_while_any_byte_is_referenced() {
        let before = fu(&[(100, 50, false), (200, 10, false)]);
        let after = fu(&[(120, 5, false)]);
        // Extent 100 is still referenced (bookended); extent 200 is freed.
        let after_extent = fu(&[(100, 50, false)]);
        assert_eq!(
            freed_bytes(Model::Extents, &[&before], &[&after_extent], &mut none),
            10
        );
        assert_eq!(
            freed_bytes(Model::Ranges, &[&before], &[&after], &mut none),
            55
        );
    }

    #[test]
    fn shared_units_need_two_known_referrers() {
        let a = fu(&[(100, 50, true)]);
        let b = fu(&[(100, 50, true)]);
        assert_eq!(freed_bytes(Model::Extents, &[&a], &[], &mut none), 0);
        assert_eq!(freed_bytes(Model::Extents, &[&a, &b], &[], &mut none), 50);
        // Byte ranges can not see outside references: never claimed.
        assert_eq!(freed_bytes(Model::Ranges, &[&a, &b], &[], &mut none), 0);
    }

    #[test]
    fn extents_still_referenced_elsewhere_are_not_freed() {
        // a and b shared extent 100 and both left it, but a snapshot (or a
        // reflinked copy outside the roots) still references it.
        let a = fu(&[(100, 50, true), (300, 20, false)]);
        let b = fu(&[(100, 50, true)]);
        let mut refs = |u: Unit| Some(u.start == 100);
        assert_eq!(freed_bytes(Model::Extents, &[&a, &b], &[], &mut refs), 20);
        let mut gone = |_| Some(false);
        assert_eq!(freed_bytes(Model::Extents, &[&a, &b], &[], &mut gone), 70);
        // With an answer, one referrer is enough: nothing holds it now.
        assert_eq!(freed_bytes(Model::Extents, &[&b], &[], &mut gone), 50);
    }

    /// Space freed during the run may be reused by a re-homed copy that
    /// starts where an old extent started: the old extent is still gone
    /// and the copy is new.
    #[test]
    fn a_new_extent_at_a_freed_start_is_another_extent() {
        let before = fu(&[(100, 50, false)]);
        let after = fu(&[(100, 10, false)]);
        let mut gone = |_| Some(false);
        assert_eq!(
            freed_bytes(Model::Extents, &[&before], &[&after], &mut gone),
            40
        );
    }
}
