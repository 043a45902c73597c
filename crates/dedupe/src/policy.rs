//! Who may take part in a run, and what a run leaves settled: the rules
//! the command line applies to every file, kept here to be unit-tested.

use onecopy_ioctl::fs::inode_flags::{APPEND, IMMUTABLE, NOCOW};

/// What a file may be in a dedupe operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    /// Its data may be shared into other files.
    pub can_be_src: bool,
    /// Its data may be replaced by a shared copy.
    pub can_be_dest: bool,
}

/// The roles of a file: one outside the roots (known from the catalog), in
/// a read-only subvolume, immutable or append-only is a source only; a
/// nocow file is neither (the kernel refuses to share its extents).
pub fn roles(outside_roots: bool, read_only: bool, inode_flags: u32) -> Roles {
    let nocow = inode_flags & NOCOW != 0;
    let protected = inode_flags & (IMMUTABLE | APPEND) != 0;
    Roles {
        can_be_src: !nocow,
        can_be_dest: !outside_roots && !read_only && !protected && !nocow,
    }
}

/// [`roles`], then the permission rule: a file that would be a destination
/// but that this user may not dedupe into (`may_dedupe_into`, asked only
/// then; [`crate::access::may_dedupe_into`] in a run) is a source only.
/// The flag says it was demoted for that reason (counted in the report).
pub fn roles_with_access(
    outside_roots: bool,
    read_only: bool,
    inode_flags: u32,
    may_dedupe_into: impl FnOnce() -> bool,
) -> (Roles, bool) {
    let mut r = roles(outside_roots, read_only, inode_flags);
    let denied = r.can_be_dest && !may_dedupe_into();
    if denied {
        r.can_be_dest = false;
    }
    (r, denied)
}

/// Whether a file is settled after this run: every planned range of it was
/// shared or found permanently unshareable (`!unsettled`), the run was not
/// interrupted, and a dry run (which changes nothing) settles nothing that
/// was not settled before (`was_settled`: a known file's settledness; true
/// for a file new to the catalog, which a dry run settles when it had
/// nothing to share, since a dry run marks every file it would change
/// unsettled).
pub fn settled_after_run(stopped: bool, unsettled: bool, dry_run: bool, was_settled: bool) -> bool {
    !stopped && !unsettled && (!dry_run || was_settled)
}

/// Whether a file's catalog record must be written: new, changed since it
/// was recorded (`dirty`) or changing settledness, and never when it was
/// modified within a second of being read (`racy`: it may have been read
/// half old, half new with timestamps that do not show it).
pub fn record_needs_write(known: Option<(bool, bool)>, settled_now: bool, racy: bool) -> bool {
    let changed = match known {
        Some((dirty, settled)) => dirty || settled != settled_now,
        None => true,
    };
    changed && !racy
}

/// What the catalog must be told about a file after the run: `Some(settled)`
/// when its record must be written, with whether it is settled now.
/// `known`: its digests came from the catalog (with its `dirty` and
/// `settled` marks, else it is new); `unsettled`: a planned range of it was
/// left undone; `stopped`: the run was interrupted.
pub fn record_update(
    f: &onecopy_scan::HashedFile,
    known: bool,
    stopped: bool,
    unsettled: bool,
    dry_run: bool,
) -> Option<bool> {
    // A dry run changes nothing, so it settles nothing that was not
    // settled before.
    let was = !known || f.settled();
    let settled_now = settled_after_run(stopped, unsettled, dry_run, was);
    let known = known.then(|| (f.dirty(), f.settled()));
    record_needs_write(known, settled_now, f.racy()).then_some(settled_now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_follow_location_and_flags() {
        let both = Roles {
            can_be_src: true,
            can_be_dest: true,
        };
        let src_only = Roles {
            can_be_src: true,
            can_be_dest: false,
        };
        assert_eq!(roles(false, false, 0), both);
        assert_eq!(roles(true, false, 0), src_only);
        assert_eq!(roles(false, true, 0), src_only);
        assert_eq!(roles(false, false, IMMUTABLE), src_only);
        assert_eq!(roles(false, false, APPEND), src_only);
        let neither = Roles {
            can_be_src: false,
            can_be_dest: false,
        };
        assert_eq!(roles(false, false, NOCOW), neither);
    }

    #[test]
    fn no_permission_makes_a_destination_a_source_only() {
        let src_only = Roles {
            can_be_src: true,
            can_be_dest: false,
        };
        let (r, denied) = roles_with_access(false, false, 0, || false);
        assert_eq!((r, denied), (src_only, true));
        let (r, denied) = roles_with_access(false, false, 0, || true);
        assert!(r.can_be_dest && !denied);
        // Not asked (and not counted) when the file is no destination anyway.
        let (r, denied) = roles_with_access(true, false, 0, || panic!("access asked for a source"));
        assert_eq!((r, denied), (src_only, false));
    }

    #[test]
    fn settled_needs_a_complete_real_run() {
        assert!(settled_after_run(false, false, false, false));
        assert!(!settled_after_run(true, false, false, true));
        assert!(!settled_after_run(false, true, false, true));
        // A dry run keeps what was settled and settles no known file anew.
        assert!(settled_after_run(false, false, true, true));
        assert!(!settled_after_run(false, false, true, false));
    }

    #[test]
    fn record_update_reads_the_marks() {
        use onecopy_scan::{Digests, HashedFile, Marks, Tree};
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"x").unwrap();
        let m = std::fs::metadata(&p).unwrap();
        let mut tree = Tree::new();
        let entry = tree.add_file(&p, &m, 1, 0, 4096).unwrap();
        let mut f = HashedFile::new(entry, Digests::default(), 0, 0, 0);
        // New: written, settled unless left undone.
        assert_eq!(record_update(&f, false, false, false, false), Some(true));
        assert_eq!(record_update(&f, false, false, true, false), Some(false));
        // Known, settled and clean: nothing to write.
        f.entry.marks.set(Marks::SETTLED, true);
        assert_eq!(record_update(&f, true, false, false, false), None);
        // Known and dirty: rewritten; a dry run keeps it settled.
        f.entry.marks.set(Marks::DIRTY, true);
        assert_eq!(record_update(&f, true, false, false, true), Some(true));
        // Racy: never written.
        f.entry.marks.set(Marks::RACY, true);
        assert_eq!(record_update(&f, false, false, false, false), None);
    }

    #[test]
    fn records_are_written_only_when_something_changed() {
        assert!(record_needs_write(None, false, false));
        assert!(!record_needs_write(None, true, true));
        assert!(!record_needs_write(Some((false, true)), true, false));
        assert!(record_needs_write(Some((false, false)), true, false));
        assert!(record_needs_write(Some((true, true)), true, false));
        assert!(!record_needs_write(Some((true, true)), true, true));
    }
}
