//! One filesystem's share of a run, between the engines: which files are
//! offered as sources first, what each file may be, the planner's view of
//! the records, and where re-homing copies go.

use std::path::PathBuf;

use onecopy_plan::{Plan, PlanFile, PlanInput, PlanOptions, TableBudget};
use onecopy_scan::{DigestStore, FsId, HashedFile, Tree};

use crate::{policy, Model, RehomeOptions};

/// Orders known files so that sources come first: files outside the
/// roots, then settled ones, so that known canonical copies stay
/// canonical. Stable: the walk's order is kept within each kind.
pub fn sources_first(known: &mut [HashedFile]) {
    known.sort_by_key(|k| (!k.outside_roots(), !k.settled()));
}

/// A file's roles packed in one byte: [`CAN_BE_DEST`], [`CAN_BE_SRC`].
pub const CAN_BE_DEST: u8 = 1;
pub const CAN_BE_SRC: u8 = 2;

/// The roles of every file (1 B each), and how many files this user may
/// not dedupe into (sources only; asked only of would-be destinations).
pub fn roles(files: &[HashedFile], tree: &Tree) -> (Vec<u8>, u64) {
    let mut denied = 0u64;
    let roles = files
        .iter()
        .map(|f| {
            let read_only = tree.device(f.entry.dev).read_only;
            let (r, no) =
                policy::roles_with_access(f.outside_roots(), read_only, f.inode_flags, || {
                    crate::access::may_dedupe_into(&tree.path(f.entry.name))
                });
            denied += no as u64;
            (u8::from(r.can_be_dest) * CAN_BE_DEST) | (u8::from(r.can_be_src) * CAN_BE_SRC)
        })
        .collect();
    (roles, denied)
}

/// The planner's view of one filesystem's records: each file's view is
/// made when the planner asks for it, so no list of views exists.
pub struct PlanView<'a> {
    pub files: &'a [HashedFile],
    /// Their digests.
    pub store: &'a DigestStore,
    /// From [`roles`].
    pub roles: &'a [u8],
}

impl PlanInput for PlanView<'_> {
    fn len(&self) -> usize {
        self.files.len()
    }

    fn file(&self, i: u32) -> PlanFile<'_> {
        let (f, r) = (&self.files[i as usize], self.roles[i as usize]);
        PlanFile {
            size: f.entry.size,
            blocks: f.blocks(self.store),
            subs: f.subs(self.store),
            whole: f.whole(),
            can_be_dest: r & CAN_BE_DEST != 0,
            can_be_src: r & CAN_BE_SRC != 0,
        }
    }

    fn source_only(&self, i: u32) -> bool {
        self.roles[i as usize] & (CAN_BE_SRC | CAN_BE_DEST) == CAN_BE_SRC
    }
}

/// Plans one filesystem's files (`block_size` digests, `fs_block`
/// sub-digests; paths in `tree`, digests in `store`; the block table
/// within `budget`); also returns how many files were sources only for
/// lack of permission.
pub fn plan(
    files: &[HashedFile],
    (tree, store): (&Tree, &DigestStore),
    (block_size, fs_block): (u64, u64),
    budget: &TableBudget,
) -> (Plan, u64) {
    let (roles, denied) = roles(files, tree);
    let plan = onecopy_plan::plan_input(
        &PlanView {
            files,
            store,
            roles: &roles,
        },
        &PlanOptions {
            block_size,
            zero_digest: onecopy_scan::zero_block_digest(block_size, fs_block),
            min_run: 0,
            sub_size: fs_block,
        },
        budget,
    );
    (plan, denied)
}

/// The accounting model of a filesystem, probed on its first file.
pub fn model(files: &[HashedFile], tree: &Tree) -> Model {
    files.first().map_or(Model::Ranges, |f| {
        Model::probe(&tree.path(f.entry.name), f.entry.ino)
    })
}

/// Re-homing for filesystem `fs`: only where whole extents are accounted
/// (btrfs as root), not in a dry run, and with a budget; its unnamed
/// temporary files are opened in a root on `fs` when there is one.
pub fn rehome_options(
    model: Model,
    dry_run: bool,
    max_write: u64,
    roots: &[PathBuf],
    fs: FsId,
) -> Option<RehomeOptions> {
    if model != Model::Extents || dry_run || max_write == 0 {
        return None;
    }
    Some(RehomeOptions {
        tmp_dir: crate::tmpdir::parent_for(roots, fs),
        max_write,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use onecopy_scan::{Digests, FileEntry, Marks};

    fn file(tree: &mut Tree, marks: u8, flags: u32) -> HashedFile {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"x").unwrap();
        let m = std::fs::metadata(&p).unwrap();
        let mut entry: FileEntry = tree.add_file(&p, &m, 1, 0, 4096).unwrap();
        for bit in [Marks::SETTLED, Marks::OUTSIDE_ROOTS] {
            entry.marks.set(bit, marks & bit != 0);
        }
        HashedFile::new(entry, Digests::default(), marks as u128, flags, 0)
    }

    #[test]
    fn outside_then_settled_first_order_kept() {
        let mut tree = Tree::new();
        let (o, s) = (Marks::OUTSIDE_ROOTS, Marks::SETTLED);
        let mut v: Vec<HashedFile> = [0, s, o, 0, o | s, s]
            .iter()
            .map(|&m| file(&mut tree, m, 0))
            .collect();
        let before: Vec<_> = v.iter().map(|f| f.entry.name).collect();
        sources_first(&mut v);
        let kinds: Vec<u128> = v.iter().map(|f| f.whole()).collect();
        let (o, s) = (o as u128, s as u128);
        assert_eq!(kinds, [o | s, o, s, s, 0, 0]);
        // Stable: the two unsettled files keep their order.
        assert_eq!(v[4].entry.name, before[0]);
        assert_eq!(v[5].entry.name, before[3]);
    }

    #[test]
    fn roles_packed_per_file() {
        let mut tree = Tree::new();
        let nocow = onecopy_ioctl::fs::inode_flags::NOCOW;
        let v = vec![
            file(&mut tree, 0, 0),
            file(&mut tree, Marks::OUTSIDE_ROOTS, 0),
            file(&mut tree, 0, nocow),
        ];
        let (r, _) = roles(&v, &tree);
        assert_eq!(r, [CAN_BE_DEST | CAN_BE_SRC, CAN_BE_SRC, 0]);
        let store = DigestStore::new();
        let view = PlanView {
            files: &v,
            store: &store,
            roles: &r,
        };
        assert!(view.file(0).can_be_dest && !view.file(1).can_be_dest);
    }

    #[test]
    fn rehome_only_for_real_runs_on_extents() {
        let roots = [PathBuf::from("/nonexistent")];
        assert!(rehome_options(Model::Ranges, false, 1, &roots, 0).is_none());
        assert!(rehome_options(Model::Extents, true, 1, &roots, 0).is_none());
        assert!(rehome_options(Model::Extents, false, 0, &roots, 0).is_none());
        let o = rehome_options(Model::Extents, false, 7, &roots, 0).unwrap();
        assert_eq!(o.max_write, 7);
    }
}
