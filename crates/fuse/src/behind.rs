//! Drop-behind: the kernel's page cache of a file written in order is let
//! go once the store holds the bytes, far enough behind the writer.
//!
//! Under the writeback cache every byte written through the mount is
//! first copied into the kernel's pages of the mount's file, and those
//! pages stay after their `WRITE` until the file's next open (opens do not
//! keep the cache) or memory pressure. A long write in order thus takes a
//! fresh page per 4 KiB; on a VM whose freed pages go back to the host a
//! fresh page costs a host fault, while a page just freed is taken again
//! for nothing. Letting the pages behind the writer go recycles them
//! (bench/notes/remote.md, "Drop-behind"). Remote stores' mounts only:
//! see [`Behind::new`].
//!
//! Invariants:
//! - only bytes the store holds are dropped: a run's range with no hole
//!   (no byte it has not stored), [`WINDOW`] or more behind its furthest
//!   write. A dropped page is read back from the store, as after any
//!   eviction; one written again since is dirty, and the kernel writes
//!   it out before dropping it.
//! - a file written at random (a database, a VM image) is not dropped:
//!   its writes leave holes (or jump past [`REORDER`]), which end the run
//!   or stop its drops at the first hole, and filling them by chance
//!   writes more than twice the span, which ends the run too.
//! - small files cost nothing: no run is kept for a file until a write
//!   ends past [`WINDOW`].

use std::collections::HashMap;
use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;

/// How far behind the furthest write of a run pages are kept (for a
/// reader of the file's tail; what is dropped is stored already).
pub(crate) const WINDOW: u64 = 32 << 20;
/// How far past a run's end a write may start and still continue it:
/// the writes in flight (64 background requests of up to 1 MiB on
/// `/dev/fuse`; 2 rings of 16 over io_uring) are served by several
/// threads, and stored up to ~17 MiB out of order (measured over
/// io_uring).
pub(crate) const REORDER: u64 = 32 << 20;
/// Holes a run may have; one more ends it (not a stream).
const MAX_HOLES: usize = 64;
/// Pages are dropped in steps this large: one notification per step.
pub(crate) const STEP: u64 = 8 << 20;
/// Runs kept at most; past it all are forgotten (a run lost only costs
/// its file's drop-behind until its next write past the window).
const MAX_RUNS: usize = 1024;

/// A file's writes in (nearly) increasing order.
#[derive(Debug, Clone, PartialEq)]
struct Run {
    /// Where its first write began.
    start: u64,
    /// Bytes its writes carried from `start` on.
    bytes: u64,
    /// The furthest end of its writes.
    next: u64,
    /// The byte ranges below `next` it has not stored, in order.
    holes: Vec<Range<u64>>,
    /// Dropped from the run's start up to here.
    dropped: u64,
}

impl Run {
    /// A run whose first write stored was `[start, end)`.
    fn new(start: u64, end: u64) -> Run {
        Run {
            start,
            bytes: end - start,
            next: end,
            holes: Vec::new(),
            dropped: start,
        }
    }

    /// A write of `[off, end)` stored: the range to drop now, if any. A
    /// write past the end leaves a hole; one up to [`REORDER`] past it
    /// continues the run, one further (or one hole too many) starts a new
    /// run. A write below the end fills what it covers of the holes. A
    /// stream writes its bytes once: a run that wrote twice its span is
    /// rewriting (at random, its holes filled by chance) and starts anew.
    fn wrote(&mut self, off: u64, end: u64) -> Option<Range<u64>> {
        // What lies below the run's start is not its business.
        self.bytes += end.saturating_sub(off.max(self.start));
        let span = self.next.max(end) - self.start;
        if off > self.next + REORDER
            || (off > self.next && self.holes.len() == MAX_HOLES)
            || self.bytes > 2 * span
        {
            *self = Run::new(off, end);
            return None;
        }
        if off > self.next {
            self.holes.push(self.next..off);
        }
        fill(&mut self.holes, off..end.min(self.next));
        self.next = self.next.max(end);
        let stored = self.holes.first().map_or(self.next, |h| h.start);
        let upto = self.next.saturating_sub(WINDOW).min(stored) / STEP * STEP;
        (upto >= self.dropped + STEP).then(|| {
            let r = self.dropped..upto;
            self.dropped = upto;
            r
        })
    }
}

/// `holes` (in order, disjoint) less what `w` covers.
fn fill(holes: &mut Vec<Range<u64>>, w: Range<u64>) {
    if w.is_empty() || holes.is_empty() {
        return;
    }
    let mut out = Vec::with_capacity(holes.len() + 1);
    for h in holes.drain(..) {
        if h.end <= w.start || h.start >= w.end {
            out.push(h);
            continue;
        }
        if h.start < w.start {
            out.push(h.start..w.start);
        }
        if w.end < h.end {
            out.push(w.end..h.end);
        }
    }
    *holes = out;
}

/// A range of a FUSE inode's pages to drop.
pub(crate) type Pages = (u64, Range<u64>);

/// The runs of the mount's files, and where their ranges to drop go.
pub(crate) struct Behind {
    /// Whether pages are dropped at all (see [`Behind::new`]).
    on: bool,
    runs: Mutex<HashMap<u64, Run>>,
    tx: Mutex<Sender<Pages>>,
}

impl Behind {
    /// A tracker and the receiving end of its drops (for the transport's
    /// notifier, [`serve`]); `on` for a remote store's mount only: there
    /// the writes' fresh pages cost the machine 7% of its CPU per MiB,
    /// while a local store's 2 GiB write lost 5% with drops (likely as
    /// its containers' pages, let go once sealed, are recycled already).
    pub fn new(on: bool) -> (Behind, Receiver<Pages>) {
        let (tx, rx) = channel();
        let b = Behind {
            on,
            runs: Mutex::new(HashMap::new()),
            tx: Mutex::new(tx),
        };
        (b, rx)
    }

    /// FUSE inode `ino` was written at `[off, off + len)` and the store
    /// holds it: sends what may be dropped now.
    pub fn wrote(&self, ino: u64, off: u64, len: u64) {
        if !self.on {
            return;
        }
        let end = off + len;
        let mut runs = self.runs.lock().unwrap();
        let out = match runs.get_mut(&ino) {
            Some(run) => run.wrote(off, end),
            None if end > WINDOW => {
                if runs.len() >= MAX_RUNS {
                    runs.clear();
                }
                runs.insert(ino, Run::new(off, end));
                None
            }
            None => None,
        };
        drop(runs);
        if let Some(r) = out {
            // No receiver (a transport without notifications): nothing
            // is dropped, as before.
            let _ = self.tx.lock().unwrap().send((ino, r));
        }
    }

    /// The file's handle was released: its run ends.
    pub fn released(&self, ino: u64) {
        if !self.on {
            return;
        }
        let mut runs = self.runs.lock().unwrap();
        if !runs.is_empty() {
            runs.remove(&ino);
        }
    }
}

/// Sends each drop to the kernel with `notify` (a transport's
/// `FUSE_NOTIFY_INVAL_INODE`) on a thread of its own, so that no request
/// waits for the kernel's page locks; ends when the tracker is gone. A
/// thread that cannot start costs only the drops (reported once).
pub(crate) fn serve(
    rx: Receiver<Pages>,
    notify: impl Fn(u64, i64, i64) -> std::io::Result<()> + Send + 'static,
) {
    let spawned = std::thread::Builder::new()
        .name("drop-behind".into())
        .spawn(move || {
            for (ino, r) in rx {
                // ENOENT: the kernel forgot the inode; its pages are gone.
                let _ = notify(ino, r.start as i64, (r.end - r.start) as i64);
            }
        });
    if let Err(e) = spawned {
        onecopy_store::warn!(
            "onecopy: pages behind writers are kept (no thread to drop them: {e})"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 1 << 20;

    /// Writes `[0, total)` in `piece`s; the ranges dropped.
    fn in_order(piece: u64, total: u64) -> Vec<Range<u64>> {
        let (b, rx) = Behind::new(true);
        let mut off = 0;
        while off < total {
            let len = piece.min(total - off);
            b.wrote(7, off, len);
            off += len;
        }
        drop(b);
        rx.into_iter()
            .map(|(ino, r)| {
                assert_eq!(ino, 7);
                r
            })
            .collect()
    }

    #[test]
    fn off_drops_nothing() {
        let (b, rx) = Behind::new(false);
        for i in 0..100 {
            b.wrote(4, i * M, M);
        }
        drop(b);
        assert_eq!(rx.into_iter().count(), 0);
    }

    #[test]
    fn small_files_are_not_tracked() {
        let (b, rx) = Behind::new(true);
        for ino in 0..5000 {
            b.wrote(ino, 0, WINDOW);
        }
        assert!(b.runs.lock().unwrap().is_empty());
        drop(b);
        assert_eq!(rx.into_iter().count(), 0);
    }

    #[test]
    fn a_file_written_in_order_is_dropped_once_behind_the_window() {
        for piece in [4096, M, 3 * M + 5, 16 * M] {
            let total = 300 * M + 123;
            let drops = in_order(piece, total);
            // The run starts with the first write that ends past the
            // window (small files are not tracked).
            let first = WINDOW / piece * piece;
            let mut at = first;
            for r in &drops {
                assert_eq!(r.start, at, "contiguous, each byte once ({piece})");
                assert_eq!(r.end % STEP, 0, "whole steps ({piece})");
                at = r.end;
            }
            assert!(at + WINDOW <= total, "never within the window ({piece})");
            assert!(at + WINDOW + STEP > total, "all else dropped ({piece})");
        }
    }

    #[test]
    fn a_stream_stored_a_little_out_of_order_is_dropped() {
        let (b, rx) = Behind::new(true);
        let total = 300 * M;
        // 1 MiB writes, each group of 6 stored last to first.
        for group in (0..total / M).collect::<Vec<_>>().chunks(6) {
            for &i in group.iter().rev() {
                b.wrote(9, i * M, M);
            }
        }
        drop(b);
        let drops: Vec<_> = rx.into_iter().map(|(_, r)| r).collect();
        assert!(drops.windows(2).all(|w| w[0].end == w[1].start));
        assert!(drops[0].start <= WINDOW + 6 * M, "{:?}", drops[0]);
        assert!(drops.last().unwrap().end + WINDOW + STEP > total);
    }

    #[test]
    fn writes_a_little_out_of_order_continue_the_run() {
        let mut run = Run::new(WINDOW, WINDOW + M);
        // Stored out of order: a hole, then filled.
        assert_eq!(run.wrote(WINDOW + 2 * M, WINDOW + 3 * M), None);
        assert_eq!(run.holes, vec![WINDOW + M..WINDOW + 2 * M]);
        // Far enough on, but the hole stops the drop below it.
        assert_eq!(run.wrote(WINDOW + 3 * M, 2 * WINDOW + 20 * M), None);
        assert_eq!(
            run.wrote(WINDOW + M, WINDOW + 2 * M),
            Some(WINDOW..WINDOW + 16 * M)
        );
        assert!(run.holes.is_empty());
        // A rewrite far behind: counted, nothing else changes.
        let before = run.clone();
        assert_eq!(run.wrote(M, 2 * M), None);
        assert_eq!(
            (&run.holes, run.next, run.dropped),
            (&before.holes, before.next, before.dropped)
        );
        // A jump forward past REORDER: a new run, nothing dropped.
        let jump = run.next + REORDER + 1;
        assert_eq!(run.wrote(jump, jump + M), None);
        assert_eq!(run, Run::new(jump, jump + M));
        // Moved on by writes that leave holes: nothing dropped, and one
        // hole too many ends the run.
        for k in 1..=MAX_HOLES as u64 {
            let at = jump + k * 2 * M;
            assert_eq!(run.wrote(at, at + M), None);
        }
        assert_eq!(run.holes.len(), MAX_HOLES);
        let at = run.next + M;
        assert_eq!(run.wrote(at, at + M), None);
        assert_eq!(run, Run::new(at, at + M));
    }

    #[test]
    fn filling_holes() {
        let mut h = vec![0..10, 20..30, 40..50];
        fill(&mut h, 5..25);
        assert_eq!(h, vec![0..5, 25..30, 40..50]);
        fill(&mut h, 26..27);
        assert_eq!(h, vec![0..5, 25..26, 27..30, 40..50]);
        fill(&mut h, 0..100);
        assert!(h.is_empty());
    }

    #[test]
    fn random_writes_drop_nothing() {
        let sizes = [80 * M, 256 * M, 1 << 30, 4 << 30];
        let cases = sizes
            .iter()
            .flat_map(|&s| [4096, 64 << 10, M].map(|p| (s, p)));
        for (size, piece) in cases {
            for seed in 1..=4u64 {
                let (b, rx) = Behind::new(true);
                let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                for _ in 0..20_000 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    b.wrote(3, x % (size / piece) * piece, piece);
                }
                drop(b);
                assert_eq!(rx.into_iter().count(), 0, "{size} {piece} {seed}");
            }
        }
    }

    #[test]
    fn release_ends_the_run_and_runs_are_bounded() {
        let (b, _rx) = Behind::new(true);
        b.wrote(1, 0, WINDOW + 1);
        b.released(1);
        assert!(b.runs.lock().unwrap().is_empty());
        for ino in 0..(MAX_RUNS as u64 + 10) {
            b.wrote(ino, 0, WINDOW + 1);
        }
        assert!(b.runs.lock().unwrap().len() <= MAX_RUNS);
    }
}
