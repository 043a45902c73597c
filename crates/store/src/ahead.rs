//! Reading ahead across files. A tree copied out of the mount (`cp -a`,
//! `rsync`, `tar c`) is read one small file after another, each a
//! `READ` the copying program waits for, and the kernel reads ahead
//! only within a file. A tree copied in got its inode numbers in the
//! order it was walked, so a walk out reads them in rising order: when
//! a file read from its start follows the last such file closely, a
//! thread of the mount decodes the next files' first chunks into the
//! read cache ([`crate::cache::ChunkCache`]) while the program copies.
//!
//! Invariants: reading ahead changes nothing but the read cache, whose
//! entries are never stale (a record never changes), so a read returns
//! the same bytes with or without it; its errors are dropped (the
//! program's own read meets and reports them); it decodes at most
//! [`AHEAD_BYTES`] per window, well inside the cache's bound.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use rusqlite::params;

use crate::data::{adjacent_run, planned, planned_or_missing, Planned};
use crate::error::Result;
use crate::snap::{split_view, view_ino};
use crate::store::Store;
use crate::view::view_extents_sql;

/// Inode numbers read ahead of the file being read.
const WINDOW: u64 = 64;
/// The largest step between two files read from their start that still
/// counts as a walk (a directory or an empty file between them).
const STEP: u64 = 8;
/// Bytes of each file read ahead: its first chunks (the kernel reads
/// ahead within a file once it is being read).
const FILE_BYTES: u64 = 256 << 10;
/// Bytes decoded ahead per window at most.
pub(crate) const AHEAD_BYTES: u64 = 8 << 20;

/// Where the walk is, shared by the reading threads and the one that
/// reads ahead.
#[derive(Default)]
pub(crate) struct Ahead {
    st: Mutex<State>,
    cv: Condvar,
    plans: Mutex<Plans>,
}

/// The plans of snapshot files' first [`FILE_BYTES`] that the last two
/// windows located (the one being read and the next), so that their
/// `READ`s need no statement. Invariant: a plan equals what
/// [`crate::view`]'s plan statement returns while the read cache's
/// generation is `gen`: a snapshot's extents never change, and a chunk
/// moves or goes only with a new generation.
#[derive(Default)]
struct Plans {
    gen: u64,
    last: HashMap<u64, Vec<Planned>>,
    before: HashMap<u64, Vec<Planned>>,
}

#[derive(Default)]
struct State {
    /// The inode last read from its start.
    last: u64,
    /// Inodes up to this one were asked for.
    horizon: u64,
    /// Inode numbers to read ahead: after the first, up to the second.
    want: Option<(u64, u64)>,
}

impl Ahead {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// File `ino` is read from its start: if it continues a walk and
    /// the window ahead of it is half used, the next window is wanted.
    pub(crate) fn started(&self, ino: u64) {
        let mut s = self.lock();
        let walk = ino > s.last && ino - s.last <= STEP;
        s.last = ino;
        if !walk {
            s.horizon = ino;
            return;
        }
        if s.horizon >= ino + WINDOW / 2 {
            return;
        }
        let from = s.horizon.max(ino);
        s.horizon = ino + WINDOW;
        s.want = Some((from, s.horizon));
        self.cv.notify_one();
    }

    /// Waits up to `timeout` for a window to read ahead.
    pub(crate) fn wanted(&self, timeout: Duration) -> Option<(u64, u64)> {
        let s = self.lock();
        let (mut s, _) = self
            .cv
            .wait_timeout_while(s, timeout, |s| s.want.is_none())
            .unwrap_or_else(|e| e.into_inner());
        s.want.take()
    }

    /// Keeps the plans of a window located at generation `gen` (by
    /// snapshot inode number, each in offset order) and the window's
    /// before it, if of the same generation; older ones go.
    fn keep_plans(&self, gen: u64, plans: HashMap<u64, Vec<Planned>>) {
        let mut p = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let last = std::mem::replace(&mut p.last, plans);
        p.before = if p.gen == gen { last } else { HashMap::new() };
        p.gen = gen;
    }

    /// The kept plan of snapshot inode `ino`'s extents that start in
    /// `from..end`, if one was located at generation `gen` and covers
    /// them (`end` within [`FILE_BYTES`]).
    pub(crate) fn plan(&self, ino: u64, gen: u64, from: u64, end: u64) -> Option<Vec<Planned>> {
        let p = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        if p.gen != gen || end > FILE_BYTES {
            return None;
        }
        let rows = p.last.get(&ino).or_else(|| p.before.get(&ino))?;
        Some(
            rows.iter()
                .filter(|r| r.0 >= from && r.0 < end)
                .copied()
                .collect(),
        )
    }
}

impl Store {
    /// Waits up to `timeout` for a walk to read ahead of, and reads the
    /// window ahead (the mount's read-ahead thread calls this in a loop).
    pub fn read_ahead(&self, timeout: Duration) {
        if let Some((after, upto)) = self.ahead.wanted(timeout) {
            let _ = self.read_window(after, upto);
        }
    }

    /// Decodes into the read cache the first chunks of inodes `after+1`
    /// to `upto` that it lacks.
    fn read_window(&self, after: u64, upto: u64) -> Result<()> {
        let (plan, gen) = self.plan_window(after, upto)?;
        let mut i = 0;
        while i < plan.len() {
            let j = adjacent_run(&plan, i, |_| true);
            let (loc, last) = (plan[i].2, plan[j - 1].2);
            let len = last.offset + last.stored_len as u64 - loc.offset;
            let span = self
                .containers
                .read(loc.container, loc.offset, len as usize)?;
            for &(_, _, lk) in &plan[i..j] {
                let at = (lk.offset - loc.offset) as usize;
                let piece = self.decode_piece(&span[at..at + lk.stored_len as usize], lk)?;
                self.cache.insert(gen, &lk, &piece);
            }
            i = j;
        }
        Ok(())
    }

    /// The chunks [`Store::read_window`] decodes, in container order,
    /// without those the cache holds, at most [`AHEAD_BYTES`] of them;
    /// and the cache's generation they were located at.
    fn plan_window(&self, after: u64, upto: u64) -> Result<(Vec<Planned>, u64)> {
        let g = self.lock();
        let gen = self.cache.generation();
        let rows: Vec<Planned> = match (split_view(after), split_view(upto)) {
            (None, None) => {
                let mut st = g.db.prepare_cached(
                    "SELECT e.off, e.len, c.container, c.offset, c.stored_len, c.raw_len, c.inner, c.pack_raw
                     FROM extents e JOIN chunks c ON c.id = e.chunk
                     WHERE e.ino > ?1 AND e.ino <= ?2 AND e.off < ?3",
                )?;
                let rows = st.query_map(params![after, upto, FILE_BYTES], planned)?;
                rows.collect::<rusqlite::Result<_>>()?
            }
            (Some((id, a)), Some((same, u))) if id == same => {
                let Some(epoch) = self.view_epoch(&g, id)? else {
                    return Ok((Vec::new(), gen));
                };
                let sql =
                    crate::view::once!(view_extents_sql("ino > ?1 AND ino <= ?3 AND off < ?4"));
                let mut st = g.db.prepare_cached(sql)?;
                let rows = st.query_map(params![a, epoch, u, FILE_BYTES], |r| {
                    Ok((r.get::<_, u64>(8)?, planned_or_missing(r)?))
                })?;
                let rows = rows.collect::<rusqlite::Result<Vec<_>>>()?;
                // An extent whose chunk row is missing: no plans kept (its
                // reads plan again, and fail).
                if rows.iter().any(|(_, p)| p.is_err()) {
                    return Ok((Vec::new(), gen));
                }
                let rows: Vec<(u64, Planned)> = (rows.into_iter())
                    .filter_map(|(i, p)| Some((i, p.ok()?)))
                    .collect();
                self.ahead.keep_plans(gen, by_inode(id, &rows));
                rows.into_iter().map(|(_, p)| p).collect()
            }
            _ => Vec::new(),
        };
        drop(g);
        let mut out: Vec<Planned> = Vec::new();
        let mut bytes = 0;
        for p in rows {
            if bytes >= AHEAD_BYTES {
                break;
            }
            if self.cache.get(gen, &p.2).is_none() {
                bytes += p.2.raw_len as u64;
                out.push(p);
            }
        }
        out.sort_by_key(|p| (p.2.container, p.2.offset));
        out.dedup_by_key(|p| (p.2.container, p.2.offset));
        Ok((out, gen))
    }
}

/// A window's rows (snapshot `id`'s inode numbers) as plans by
/// snapshot inode number, each in offset order.
fn by_inode(id: u64, rows: &[(u64, Planned)]) -> HashMap<u64, Vec<Planned>> {
    let mut plans: HashMap<u64, Vec<Planned>> = HashMap::new();
    for &(ino, p) in rows {
        plans.entry(view_ino(id, ino)).or_default().push(p);
    }
    for rows in plans.values_mut() {
        rows.sort_by_key(|p| p.0);
    }
    plans
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::ChunkLoc;

    #[test]
    fn a_walk_wants_the_next_window_when_half_of_it_is_read() {
        let a = Ahead::default();
        a.started(10);
        assert_eq!(a.wanted(Duration::ZERO), None, "one file is no walk");
        a.started(11);
        assert_eq!(a.wanted(Duration::ZERO), Some((11, 11 + WINDOW)));
        a.started(12 + STEP);
        assert_eq!(a.wanted(Duration::ZERO), None, "too far: a new start");
        a.started(13 + STEP);
        let next = 13 + STEP + WINDOW;
        assert_eq!(a.wanted(Duration::ZERO), Some((13 + STEP, next)));
        let mid = next - WINDOW / 2 + 1;
        for ino in 14 + STEP..mid {
            a.started(ino);
            assert_eq!(a.wanted(Duration::ZERO), None, "the window is ahead");
        }
        a.started(mid);
        assert_eq!(a.wanted(Duration::ZERO), Some((next, mid + WINDOW)));
        a.started(5);
        a.started(5);
        assert_eq!(a.wanted(Duration::ZERO), None, "backwards is no walk");
    }

    #[test]
    fn a_kept_plan_serves_only_its_generation_and_first_bytes() {
        let a = Ahead::default();
        let loc = |offset| ChunkLoc {
            container: 1,
            offset,
            stored_len: 10,
            raw_len: 4096,
            inner: None,
        };
        let rows = [
            (7, (4096, 4096, loc(20))),
            (7, (0, 4096, loc(0))),
            (8, (0, 9, loc(40))),
        ];
        a.keep_plans(3, by_inode(2, &rows));
        let f = view_ino(2, 7);
        assert_eq!(
            a.plan(f, 3, 0, 8192),
            Some(vec![(0, 4096, loc(0)), (4096, 4096, loc(20))])
        );
        assert_eq!(a.plan(f, 3, 4096, 5000), Some(vec![(4096, 4096, loc(20))]));
        assert_eq!(
            a.plan(f, 3, 8192, FILE_BYTES),
            Some(vec![]),
            "past its extents"
        );
        assert_eq!(a.plan(f, 4, 0, 8192), None, "another generation");
        assert_eq!(
            a.plan(f, 3, 0, FILE_BYTES + 1),
            None,
            "past the first bytes"
        );
        assert_eq!(a.plan(view_ino(2, 9), 3, 0, 10), None, "not located");
        a.keep_plans(4, HashMap::new());
        assert_eq!(
            a.plan(view_ino(2, 8), 4, 0, 10),
            None,
            "dropped with its generation"
        );
        let window = |i: u64| by_inode(2, &[(i, (0, 1, loc(0)))]);
        a.keep_plans(4, window(10));
        a.keep_plans(4, window(11));
        assert!(
            a.plan(view_ino(2, 10), 4, 0, 1).is_some(),
            "the window before"
        );
        a.keep_plans(4, window(12));
        assert_eq!(
            a.plan(view_ino(2, 10), 4, 0, 1),
            None,
            "dropped two windows on"
        );
        assert!(a.plan(view_ino(2, 11), 4, 0, 1).is_some());
        assert!(a.plan(view_ino(2, 12), 4, 0, 1).is_some());
    }
}
