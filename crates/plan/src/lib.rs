//! Matching and planning: from block fingerprints to dedupe operations.
//!
//! Two passes, both linear in the number of blocks:
//!
//! 1. **Whole files.** Files with equal size and whole-file digest form a
//!    group; every member becomes a destination of one operation whose
//!    source is the group's first member (its canonical copy).
//! 2. **Block runs.** Every block of the remaining files (and of the
//!    canonical copies) is looked up in a first-occurrence
//!    [`BlockTable`] (in RAM, or on disk beyond the memory budget: the
//!    same answers). A block seen before starts a run, which is
//!    extended block by block while both sides keep matching; the run's
//!    source is always made of first occurrences, so every copy of some
//!    data is deduped against the one canonical place and all copies
//!    converge on one physical extent. Matching ignores how files are split
//!    into extents: any block-aligned offset matches any other.
//!
//! All-zero blocks never start a run and are not indexed (sharing every
//! zero block of a filesystem with one extent would be a storm of tiny
//! dedupes for no gain); a run already under way continues through them.

use std::cell::RefCell;
use std::collections::HashMap;

use onecopy_blocktable::TableStats;
pub use onecopy_blocktable::{BlockRef, BlockTable, FingerprintTable, TableBudget};
pub use onecopy_digest::{BlockCursor, Blocks};

/// One file as the planner sees it.
#[derive(Debug, Clone, Copy)]
pub struct PlanFile<'a> {
    pub size: u64,
    pub blocks: Blocks<'a>,
    /// Sub-block digests (one per `PlanOptions::sub_size` bytes), or empty.
    /// With them, the file is also matched at every sub-block offset, not
    /// only at block boundaries.
    pub subs: &'a [u64],
    pub whole: u128,
    /// May be a destination (not immutable, append-only, ...).
    pub can_be_dest: bool,
    /// May be a source.
    pub can_be_src: bool,
}

/// The files to plan, handed out one at a time: a caller that already
/// holds its records builds each view when the planner asks for it, so no
/// list of views (64 B per file) exists next to the records.
pub trait PlanInput {
    /// Number of files; indices run from 0 to `len() - 1`.
    fn len(&self) -> usize;
    /// Whether there are no files.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The file at index `i` (`i < len()`).
    fn file(&self, i: u32) -> PlanFile<'_>;
    /// Whether file `i` may be a source but not a destination (a
    /// read-only snapshot's copy); implementations that know it without
    /// the digests say so cheaply.
    fn source_only(&self, i: u32) -> bool {
        let f = self.file(i);
        f.can_be_src && !f.can_be_dest
    }
}

impl PlanInput for [PlanFile<'_>] {
    fn len(&self) -> usize {
        <[PlanFile<'_>]>::len(self)
    }
    fn file(&self, i: u32) -> PlanFile<'_> {
        self[i as usize]
    }
}

/// Planner settings.
#[derive(Debug, Clone, Copy)]
pub struct PlanOptions {
    /// The block size the digests were computed with.
    pub block_size: u64,
    /// Digest of an all-zero block of `block_size` bytes.
    pub zero_digest: u128,
    /// Runs shorter than this many bytes are not planned.
    pub min_run: u64,
    /// Bytes per sub-block digest (the filesystem block size); divides
    /// `block_size`.
    pub sub_size: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    WholeFile,
    BlockRun,
}

/// A destination range: `file` at `offset`, `len` bytes (from the op).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dest {
    pub file: u32,
    pub offset: u64,
}

/// Share `[src_offset, src_offset + len)` of `src` into every destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    pub kind: OpKind,
    pub src: u32,
    pub src_offset: u64,
    pub len: u64,
    pub dests: Vec<Dest>,
}

impl Op {
    /// Bytes this op asks to share (candidates, not freed bytes).
    pub fn candidate_bytes(&self) -> u64 {
        self.len * self.dests.len() as u64
    }
}

/// Figures about one planning pass.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct PlanStats {
    pub whole_file_groups: u64,
    pub whole_file_dests: u64,
    pub whole_file_bytes: u64,
    pub block_runs: u64,
    pub block_run_bytes: u64,
    pub index_entries: u64,
    pub index_memory_bytes: u64,
    /// Planning passes whose block table did not fit the memory budget and
    /// lived on disk.
    pub index_spilled: u64,
    /// Device reads of those tables' lookups.
    pub index_disk_reads: u64,
}

#[derive(Debug, Default)]
pub struct Plan {
    /// Largest candidate savings first.
    pub ops: Vec<Op>,
    pub stats: PlanStats,
    /// Why the spilled block table stopped answering, if it did (the plan
    /// then found less, nothing wrong).
    pub table_error: Option<String>,
}

/// Which aligned blocks the block table stored as the first occurrence
/// of their digest: one bit per block of the files planned in pass 2, in
/// file order, and where every 16th file's bits start (0.5 B per file;
/// another file's start is summed from the lengths before it in its
/// group). With it, [`extend`] checks that a run's source block is its
/// digest's canonical copy by a bit test instead of a table lookup (one
/// per block of every run). The bit of a block equals
/// `table.get(digest) == Some(block)` while the table holds every block it
/// called new ([`BlockTable::holds_all`]); after that the table is asked.
struct FirstBits<'c> {
    covered: &'c [bool],
    group: Vec<u64>,
    bits: Vec<u64>,
}

/// Files per entry of [`FirstBits::group`].
const GROUP: usize = 16;

impl<'c> FirstBits<'c> {
    /// Bits for the blocks of every file not `covered`; also returns
    /// their number.
    fn new<F: PlanInput + ?Sized>(files: &F, covered: &'c [bool]) -> (FirstBits<'c>, u64) {
        let mut bits = FirstBits {
            covered,
            group: Vec::with_capacity(files.len().div_ceil(GROUP)),
            bits: Vec::new(),
        };
        let mut n = 0u64;
        for i in 0..files.len() as u32 {
            if (i as usize).is_multiple_of(GROUP) {
                bits.group.push(n);
            }
            n += bits.len(files, i);
        }
        bits.bits = vec![0; n.div_ceil(64) as usize];
        (bits, n)
    }

    /// Blocks of file `i` that have bits.
    fn len<F: PlanInput + ?Sized>(&self, files: &F, i: u32) -> u64 {
        if self.covered[i as usize] {
            return 0;
        }
        files.file(i).blocks.len() as u64
    }

    /// The bit of file `f`'s block 0.
    fn base<F: PlanInput + ?Sized>(&self, files: &F, f: u32) -> u64 {
        let g = f as usize / GROUP;
        let before = (g * GROUP) as u32..f;
        self.group[g] + before.map(|i| self.len(files, i)).sum::<u64>()
    }

    fn set(&mut self, bit: u64) {
        self.bits[(bit / 64) as usize] |= 1 << (bit % 64);
    }

    fn get(&self, bit: u64) -> bool {
        self.bits[(bit / 64) as usize] & (1 << (bit % 64)) != 0
    }
}

/// Whether the table first saw `d` at `at` (whose digest is `d`); `bit`
/// is `at`'s in `first`.
fn is_first(
    table: &mut BlockTable,
    first: &FirstBits<'_>,
    bit: u64,
    d: u128,
    at: BlockRef,
) -> bool {
    if !table.holds_all() {
        return table.get(d) == Some(at);
    }
    let set = first.get(bit);
    debug_assert!(
        set == (table.get(d) == Some(at)) || !table.holds_all(),
        "first-occurrence bit of {at:?} disagrees with the table"
    );
    set
}

/// Extends a match of `f` at block position `i` (in `f`'s blocks, via
/// `win`) against the canonical block `src`: returns the run length in
/// blocks. `win(j)` gives `f`'s digest `j` blocks after the start, or None
/// past the end.
fn extend(
    (table, first, base): (&mut BlockTable, &FirstBits<'_>, u64),
    g: &PlanFile<'_>,
    src: BlockRef,
    limit: usize,
    zero: u128,
    win: &dyn Fn(usize) -> Option<u128>,
) -> usize {
    let k = src.block as usize;
    let mut source = BlockCursor::new(g.blocks);
    let mut len = 1usize;
    // Trailing zero blocks add nothing a run needs: it ends after its last
    // other block (the first is one: zero blocks start no run). Kept as
    // the run grows, not found by walking back: a paged list read
    // backwards costs a batch per block.
    let mut end = 1usize;
    while len < limit && k + len < g.blocks.len() {
        let Some(d) = win(len) else { break };
        let at = BlockRef {
            file: src.file,
            block: (k + len) as u32,
        };
        let bit = base + (k + len) as u64;
        if Some(d) != source.get(k + len) || (d != zero && !is_first(table, first, bit, d, at)) {
            break;
        }
        len += 1;
        if d != zero {
            end = len;
        }
    }
    end
}

/// The digests of the block-sized windows of one file, by position: a
/// sub-block (of `sub` bytes), or a block when stepping by whole blocks.
struct Windows<'a> {
    f: PlanFile<'a>,
    cursor: RefCell<BlockCursor<'a>>,
    bs: u64,
    sub: u64,
    /// Positions per block.
    k: usize,
    /// Positions in the file.
    n: usize,
}

impl<'a> Windows<'a> {
    fn new(f: PlanFile<'a>, bs: u64, sub: u64) -> Windows<'a> {
        let k = (bs / sub) as usize;
        Windows {
            f,
            cursor: RefCell::new(BlockCursor::new(f.blocks)),
            bs,
            sub,
            k,
            n: if k == 1 { f.blocks.len() } else { f.subs.len() },
        }
    }

    /// Digest of the block-sized window starting at position `s`.
    fn get(&self, s: usize) -> Option<u128> {
        if s >= self.n {
            return None;
        }
        if s.is_multiple_of(self.k) {
            return self.cursor.borrow_mut().get(s / self.k);
        }
        onecopy_digest::window_at(self.f.subs, s, self.bs, self.sub, self.f.size)
    }
}

/// Where the table first saw `d`. With `at` (an aligned block of a file
/// that may be a source), `d` is inserted there if new, and its bit set.
fn first_seen(
    (table, first, base): (&mut BlockTable, &mut FirstBits<'_>, u64),
    d: u128,
    at: Option<BlockRef>,
) -> Option<BlockRef> {
    let Some(at) = at else {
        return table.get(d);
    };
    let earlier = table.insert_first(d, at);
    if earlier.is_none() {
        first.set(base + at.block as u64);
    }
    earlier
}

/// Blocks a run whose source starts at `src_off` may take: within one
/// file (`same_file`) the source must end before the destination at
/// `dst_off` starts.
fn run_limit(same_file: bool, src_off: u64, dst_off: u64, bs: u64) -> usize {
    if same_file {
        (dst_off.saturating_sub(src_off) / bs) as usize
    } else {
        usize::MAX
    }
}

/// Block runs of `files[fi]` starting at every multiple of `step` bytes:
/// the sub-block size when the file's sub-digests are at hand (the digest
/// of the block-sized window at each offset is computed from them, so data
/// shifted by any multiple of the filesystem block is found), else the
/// block size. Only the file's block-aligned blocks are indexed.
fn match_runs<F: PlanInput + ?Sized>(
    files: &F,
    fi: u32,
    opts: &PlanOptions,
    step: u64,
    (table, first, base): (&mut BlockTable, &mut FirstBits<'_>, u64),
    emit: &mut dyn FnMut(u32, u64, u32, u64, u64),
) {
    let f = files.file(fi);
    let w = Windows::new(f, opts.block_size, step);
    let (bs, k) = (opts.block_size, w.k);
    let mut s = 0usize;
    while s < w.n {
        let Some(d) = w.get(s) else { break };
        let at = (s.is_multiple_of(k) && f.can_be_src).then(|| BlockRef {
            file: fi,
            block: (s / k) as u32,
        });
        let found = if d == opts.zero_digest {
            None
        } else {
            first_seen((&mut *table, &mut *first, base), d, at)
        };
        let Some(src) = found else {
            s += 1;
            continue;
        };
        let g = files.file(src.file);
        let (dst_off, src_off) = (s as u64 * step, src.block as u64 * bs);
        let limit = run_limit(src.file == fi, src_off, dst_off, bs);
        if !f.can_be_dest || !g.can_be_src || limit == 0 {
            s += 1;
            continue;
        }
        let src_base = first.base(files, src.file);
        let len = extend(
            (&mut *table, &*first, src_base),
            &g,
            src,
            limit,
            opts.zero_digest,
            &|j| w.get(s + j * k),
        );
        let bytes = (len as u64 * bs)
            .min(g.size - src_off)
            .min(f.size - dst_off);
        emit(src.file, src_off, fi, dst_off, bytes);
        s += len * k;
    }
}

/// Plans the dedupe of `files` (all on one filesystem), the block table
/// in RAM.
pub fn plan(files: &[PlanFile<'_>], opts: &PlanOptions) -> Plan {
    plan_input(files, opts, &TableBudget::unbounded())
}

/// [`plan`] over files handed out one at a time by `files`, the block
/// table within `budget` (spilled to disk beyond it, same answers).
pub fn plan_input<F: PlanInput + ?Sized>(
    files: &F,
    opts: &PlanOptions,
    budget: &TableBudget,
) -> Plan {
    let mut stats = PlanStats::default();
    // Pass 1: whole files.
    let whole = whole_files(files, &mut stats);
    // Pass 2: block runs over everything not already a whole-file copy.
    let (runs, ts) = block_runs(files, opts, budget, &whole, &mut stats);
    stats.index_entries = ts.entries;
    stats.index_memory_bytes = ts.memory_bytes;
    stats.index_spilled = u64::from(ts.spilled);
    stats.index_disk_reads = ts.disk_reads;
    let mut ops = whole.ops;
    for ((src, src_offset, len), dests) in runs {
        ops.push(Op {
            kind: OpKind::BlockRun,
            src,
            src_offset,
            len,
            dests,
        });
    }
    ops.sort_unstable_by(|a, b| {
        b.candidate_bytes()
            .cmp(&a.candidate_bytes())
            .then(a.src.cmp(&b.src))
            .then(a.src_offset.cmp(&b.src_offset))
    });
    Plan {
        ops,
        stats,
        table_error: ts.error,
    }
}

/// What pass 1 leaves: its ops, which files they cover as destinations,
/// and each canonical copy's op (whose destinations are its copies): no
/// second list of the copies.
struct WholeFiles {
    ops: Vec<Op>,
    covered: Vec<bool>,
    copies_of: HashMap<u32, u32>,
}

impl WholeFiles {
    /// The whole-file copies of `file`, if it is a canonical copy.
    fn copies(&self, file: u32) -> impl Iterator<Item = u32> + '_ {
        let op = self.copies_of.get(&file).map(|&k| &self.ops[k as usize]);
        op.into_iter().flat_map(|o| o.dests.iter().map(|d| d.file))
    }
}

/// Pass 1: one whole-file op per group of equal (size, whole digest).
fn whole_files<F: PlanInput + ?Sized>(files: &F, stats: &mut PlanStats) -> WholeFiles {
    let mut w = WholeFiles {
        ops: Vec::new(),
        covered: vec![false; files.len()],
        copies_of: HashMap::new(),
    };
    for_each_group(files, |g| {
        let Some(op) = whole_file_op(files, g) else {
            return;
        };
        for d in &op.dests {
            w.covered[d.file as usize] = true;
        }
        w.copies_of.insert(op.src, w.ops.len() as u32);
        stats.whole_file_groups += 1;
        stats.whole_file_dests += op.dests.len() as u64;
        stats.whole_file_bytes += op.candidate_bytes();
        w.ops.push(op);
    });
    w
}

/// Calls `each` with every group of two or more non-empty files of equal
/// (size, whole digest), in the order of their first members. The groups
/// are runs of one sorted index list: 4 bytes per file, no map of
/// per-group lists, freed before the block table is built.
fn for_each_group<F: PlanInput + ?Sized>(files: &F, mut each: impl FnMut(&[u32])) {
    let mut order: Vec<u32> = (0..files.len() as u32)
        .filter(|&i| !files.file(i).blocks.is_empty())
        .collect();
    let key = |i: u32| {
        let f = files.file(i);
        (f.size, f.whole)
    };
    order.sort_unstable_by_key(|&i| (key(i), i));
    let mut groups: Vec<&[u32]> = order
        .chunk_by(|&a, &b| key(a) == key(b))
        .filter(|g| g.len() > 1)
        .collect();
    groups.sort_unstable_by_key(|g| g[0]);
    groups.into_iter().for_each(&mut each);
}

/// The whole-file op of group `g`: its first member that may be a source
/// but not a destination (a read-only snapshot's file: the others may all
/// be deduped into it), else its first member that may be a source, into
/// every other member that may be a destination (None: no source, or no
/// destination).
fn whole_file_op<F: PlanInput + ?Sized>(files: &F, g: &[u32]) -> Option<Op> {
    let &src = g
        .iter()
        .find(|&&i| files.source_only(i))
        .or_else(|| g.iter().find(|&&i| files.file(i).can_be_src))?;
    let dests: Vec<Dest> = g
        .iter()
        .filter(|&&i| i != src && files.file(i).can_be_dest)
        .map(|&i| Dest { file: i, offset: 0 })
        .collect();
    (!dests.is_empty()).then(|| Op {
        kind: OpKind::WholeFile,
        src,
        src_offset: 0,
        len: files.file(src).size,
        dests,
    })
}

/// Block runs keyed by source range (file, offset, bytes), so equal
/// ranges share one op.
type Runs = HashMap<(u32, u64, u64), Vec<Dest>>;

/// Pass 2: the block runs of every file `whole` does not cover; the
/// figures of the block table, dropped before returning.
fn block_runs<F: PlanInput + ?Sized>(
    files: &F,
    opts: &PlanOptions,
    budget: &TableBudget,
    whole: &WholeFiles,
    stats: &mut PlanStats,
) -> (Runs, TableStats) {
    let (mut first, total_blocks) = FirstBits::new(files, &whole.covered);
    let mut table = BlockTable::new(total_blocks as usize, budget);
    let mut runs = Runs::new();
    let mut state = (&mut table, &mut first, &mut runs, &mut *stats);
    // Source-only files first (a read-only snapshot's copies): their
    // blocks become the table's sources, so that the writable copies met
    // later are deduped into them, not left beside them.
    let n = files.len() as u32;
    let uncovered = |fi: u32| !whole.covered[fi as usize];
    for fi in (0..n).filter(|&fi| uncovered(fi) && files.source_only(fi)) {
        let base = state.1.base(files, fi);
        file_runs(files, fi, base, opts, whole, &mut state);
    }
    // File `fi`'s first bit ([`FirstBits::base`], kept as the files go).
    let mut base = 0u64;
    for fi in (0..n).filter(|&fi| uncovered(fi)) {
        let f = files.file(fi);
        debug_assert_eq!(base, state.1.base(files, fi));
        if !files.source_only(fi) {
            file_runs(files, fi, base, opts, whole, &mut state);
        }
        base += f.blocks.len() as u64;
    }
    (runs, table.stats())
}

/// The block table, its first bits, the runs found and the figures, as
/// pass 2 goes.
type Pass2<'a, 'c> = (
    &'a mut BlockTable,
    &'a mut FirstBits<'c>,
    &'a mut Runs,
    &'a mut PlanStats,
);

/// Pass 2 for one file whose first bit is `base`.
fn file_runs<F: PlanInput + ?Sized>(
    files: &F,
    fi: u32,
    base: u64,
    opts: &PlanOptions,
    whole: &WholeFiles,
    (table, first, runs, stats): &mut Pass2<'_, '_>,
) {
    let f = files.file(fi);
    let bs = opts.block_size;
    let shifted = !f.subs.is_empty() && opts.sub_size > 0 && opts.sub_size < bs;
    let step = if shifted { opts.sub_size } else { bs };
    match_runs(
        files,
        fi,
        opts,
        step,
        (table, first, base),
        &mut |s, so, d, dof, n| add_run(runs, whole, opts, (s, so, d, dof, n), stats),
    );
}

/// Adds a run of `bytes` from `src` at `src_off` to `dst` at `dst_off`
/// (unless shorter than `min_run`). A canonical copy that is itself a
/// block-run destination takes its whole-file copies along: they get the
/// same run, so that all of them end on the run's source extent instead
/// of pinning the old one.
fn add_run(
    runs: &mut Runs,
    whole: &WholeFiles,
    opts: &PlanOptions,
    (src, src_off, dst, dst_off, bytes): (u32, u64, u32, u64, u64),
    stats: &mut PlanStats,
) {
    if bytes < opts.min_run.max(1) {
        return;
    }
    let e = runs.entry((src, src_off, bytes)).or_default();
    for file in std::iter::once(dst).chain(whole.copies(dst)) {
        e.push(Dest {
            file,
            offset: dst_off,
        });
        stats.block_runs += 1;
        stats.block_run_bytes += bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u64 = 4;
    const Z: u128 = 0;

    fn opts() -> PlanOptions {
        PlanOptions {
            block_size: BS,
            zero_digest: Z,
            min_run: 1,
            sub_size: 0,
        }
    }

    fn pf(blocks: &[u128]) -> PlanFile<'_> {
        let whole = blocks
            .iter()
            .fold(17u128, |a, b| a.wrapping_mul(31).wrapping_add(*b));
        PlanFile {
            size: blocks.len() as u64 * BS,
            blocks: Blocks::Full(blocks),
            subs: &[],
            whole,
            can_be_dest: true,
            can_be_src: true,
        }
    }

    #[test]
    fn whole_file_group_has_one_source() {
        let a = [1, 2, 3];
        let files = [pf(&a), pf(&a), pf(&a)];
        let p = plan(&files, &opts());
        assert_eq!(p.ops.len(), 1);
        assert_eq!(p.ops[0].kind, OpKind::WholeFile);
        assert_eq!(p.ops[0].src, 0);
        assert_eq!(p.ops[0].dests.len(), 2);
        assert_eq!(p.ops[0].len, 12);
    }

    #[test]
    fn shifted_run_is_found_at_any_block_offset() {
        let a = [1, 2, 3, 4, 5];
        let b = [9, 8, 2, 3, 4, 7];
        let p = plan(&[pf(&a), pf(&b)], &opts());
        assert_eq!(p.ops.len(), 1);
        let op = &p.ops[0];
        assert_eq!((op.src, op.src_offset, op.len), (0, 4, 12));
        assert_eq!(op.dests, vec![Dest { file: 1, offset: 8 }]);
    }

    #[test]
    fn near_duplicates_share_all_but_the_changed_block() {
        let a = [1, 2, 3, 4, 5, 6];
        let b = [1, 2, 3, 40, 5, 6];
        let c = [1, 2, 3, 4, 5, 60];
        let p = plan(&[pf(&a), pf(&b), pf(&c)], &opts());
        let shared: u64 = p.ops.iter().map(|o| o.candidate_bytes()).sum();
        assert_eq!(shared, (5 + 5) * BS);
        // Every source range lies in file 0: copies converge on it.
        assert!(p.ops.iter().all(|o| o.src == 0));
    }

    #[test]
    fn whole_file_copies_follow_their_canonical_into_block_runs() {
        // c's first block also starts a (canonical) run in a; b is a whole
        // copy of c. The run into c must also go into b.
        let a = [1, 2, 9];
        let c = [1, 2, 3, 4];
        let files = [pf(&a), pf(&c), pf(&c)];
        let p = plan(&files, &opts());
        let run = p
            .ops
            .iter()
            .find(|o| o.kind == OpKind::BlockRun)
            .expect("a block run");
        let mut dests: Vec<u32> = run.dests.iter().map(|d| d.file).collect();
        dests.sort();
        assert_eq!(dests, vec![1, 2]);
    }

    #[test]
    fn zero_blocks_do_not_start_runs() {
        let a = [Z, Z, Z, 1];
        let b = [Z, Z, Z, 2];
        let p = plan(&[pf(&a), pf(&b)], &opts());
        assert!(p.ops.is_empty());
    }

    #[test]
    fn runs_continue_through_zero_blocks() {
        let a = [1, Z, 2, 5];
        let b = [1, Z, 2, 6];
        let p = plan(&[pf(&a), pf(&b)], &opts());
        assert_eq!(p.ops.len(), 1);
        assert_eq!(p.ops[0].len, 3 * BS);
    }

    /// A run ends at its last non-zero block, however many zero blocks
    /// follow before the files differ.
    #[test]
    fn runs_end_before_trailing_zero_blocks() {
        let a = [1, Z, 2, Z, Z, Z, 5];
        let b = [1, Z, 2, Z, Z, Z, 6];
        let p = plan(&[pf(&a), pf(&b)], &opts());
        assert_eq!(p.ops.len(), 1);
        assert_eq!(p.ops[0].len, 3 * BS);
    }

    #[test]
    fn same_file_runs_do_not_overlap() {
        let a = [1, 2, 1, 2, 1, 2];
        let p = plan(&[pf(&a)], &opts());
        for op in &p.ops {
            for d in &op.dests {
                assert!(op.src_offset + op.len <= d.offset);
            }
        }
        let shared: u64 = p.ops.iter().map(|o| o.candidate_bytes()).sum();
        assert_eq!(shared, 4 * BS);
    }

    /// A copy that may only be a source (a read-only snapshot's) is the
    /// source of its group wherever it comes: the one writable copy is
    /// deduped into it, not left alone.
    #[test]
    fn a_source_only_copy_is_the_source_of_its_group() {
        let a = [1, 2, 3];
        for at in 0..3 {
            let mut files = vec![pf(&a), pf(&a), pf(&a)];
            files[at].can_be_dest = false;
            let p = plan(&files, &opts());
            assert_eq!(p.ops.len(), 1);
            assert_eq!(p.ops[0].src, at as u32);
            let dests: Vec<u32> = p.ops[0].dests.iter().map(|d| d.file).collect();
            let want: Vec<u32> = (0..3).filter(|&i| i != at as u32).collect();
            assert_eq!(dests, want);
        }
        let mut ro = pf(&a);
        ro.can_be_dest = false;
        let p = plan(&[pf(&a), ro], &opts());
        assert_eq!((p.ops[0].src, p.ops[0].dests.len()), (1, 1));
    }

    /// The same for block runs: a run shared with a source-only file is
    /// deduped into it, though a writable file holding it comes first.
    #[test]
    fn a_source_only_copy_is_the_source_of_its_runs() {
        let (a, b) = ([1, 2, 3, 9], [5, 1, 2, 3]);
        let mut ro = pf(&b);
        ro.can_be_dest = false;
        let p = plan(&[pf(&a), ro], &opts());
        assert_eq!(p.ops.len(), 1, "{:?}", p.ops);
        let op = &p.ops[0];
        assert_eq!((op.src, op.src_offset, op.len), (1, BS, 3 * BS));
        assert_eq!((op.dests[0].file, op.dests[0].offset), (0, 0));
    }

    #[test]
    fn immutable_files_are_sources_only() {
        let a = [1, 2, 3];
        let mut f0 = pf(&a);
        f0.can_be_dest = false;
        let mut f1 = pf(&a);
        f1.can_be_dest = false;
        let p = plan(&[f0, f1], &opts());
        assert!(p.ops.is_empty());
    }

    /// Blocks of 4 sub-blocks; block digests derived from sub-digests as
    /// the scanner does.
    fn blocks_of(subs: &[u64], size: u64, sub: u64) -> Vec<u128> {
        let bs = 4 * sub;
        subs.chunks(4)
            .enumerate()
            .map(|(i, c)| {
                let len = bs.min(size - i as u64 * bs);
                onecopy_digest::window_digest(c, len, len == bs)
            })
            .collect()
    }

    #[test]
    fn data_shifted_by_sub_blocks_is_found() {
        let sub = 1u64;
        // a: 12 sub-blocks of unique data; b: 3 other sub-blocks, then a.
        let a_subs: Vec<u64> = (100..112).collect();
        let mut b_subs: Vec<u64> = vec![7, 8, 9];
        b_subs.extend(&a_subs);
        let a_blocks = blocks_of(&a_subs, 12, sub);
        let b_blocks = blocks_of(&b_subs, 15, sub);
        let o = PlanOptions {
            block_size: 4,
            zero_digest: Z,
            min_run: 1,
            sub_size: sub,
        };
        let fa = PlanFile {
            size: 12,
            blocks: Blocks::Full(&a_blocks),
            subs: &a_subs,
            whole: 1,
            can_be_dest: true,
            can_be_src: true,
        };
        let fb = PlanFile {
            size: 15,
            blocks: Blocks::Full(&b_blocks),
            subs: &b_subs,
            whole: 2,
            can_be_dest: true,
            can_be_src: true,
        };
        let p = plan(&[fa, fb], &o);
        assert_eq!(p.ops.len(), 1, "{:?}", p.ops);
        let op = &p.ops[0];
        assert_eq!((op.src, op.src_offset, op.len), (0, 0, 12));
        assert_eq!(op.dests, vec![Dest { file: 1, offset: 3 }]);
        // Without sub-digests only aligned blocks are compared: no match.
        let fb2 = PlanFile { subs: &[], ..fb };
        let fa2 = PlanFile { subs: &[], ..fa };
        assert!(plan(&[fa2, fb2], &o).ops.is_empty());
    }

    #[test]
    fn partial_tails_match_only_at_both_ends() {
        // Sizes 10 and 10 with tail digests equal: allowed (both at EOF).
        let a = [1, 2, 3];
        let b = [7, 2, 3];
        let mut fa = pf(&a);
        fa.size = 10;
        let mut fb = pf(&b);
        fb.size = 10;
        let p = plan(&[fa, fb], &opts());
        assert_eq!(p.ops.len(), 1);
        assert_eq!((p.ops[0].src_offset, p.ops[0].len), (4, 6));
    }

    /// A plan made with the block table spilled to disk (a budget far below
    /// its size) is the plan made in RAM, over files with shared runs,
    /// repeats within files, zero blocks and whole-file copies.
    #[test]
    fn spilled_table_plans_exactly_as_ram() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        // 300 files of up to 400 blocks drawn from a pool of 20,000 block
        // values in runs, so that runs repeat across and within files.
        let files: Vec<Vec<u128>> = (0..300)
            .map(|_| {
                let mut v = Vec::new();
                let n = 1 + rnd(400);
                while (v.len() as u64) < n {
                    let start = rnd(20_000);
                    for j in 0..1 + rnd(40) {
                        v.push(if rnd(50) == 0 {
                            Z
                        } else {
                            (start + j) as u128 + 1
                        });
                    }
                }
                v
            })
            .collect();
        let mut views: Vec<PlanFile<'_>> = files.iter().map(|b| pf(b)).collect();
        views.push(pf(&files[3]));
        let d = tempfile::tempdir().unwrap();
        let tiny = TableBudget {
            memory: 4096,
            spill_dir: Some(d.path().into()),
        };
        let ram = plan(&views, &opts());
        let disk = plan_input(&views[..], &opts(), &tiny);
        assert_eq!(ram.stats.index_spilled, 0);
        assert_eq!(disk.stats.index_spilled, 1);
        assert!(disk.table_error.is_none());
        assert!(ram.stats.block_runs > 1000, "{:?}", ram.stats);
        // Ops of equal savings, source and offset may come in any order.
        let key = |o: &Op| (o.src, o.src_offset, o.len);
        let sorted = |mut v: Vec<Op>| {
            v.sort_by_key(key);
            v
        };
        assert_eq!(sorted(ram.ops), sorted(disk.ops));
        assert_eq!(ram.stats.index_entries, disk.stats.index_entries);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
