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

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use rusqlite::params;

use crate::data::{adjacent_run, planned, Planned};
use crate::error::Result;
use crate::snap::split_view;
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
                let raw = self.decode_loc(&span[at..at + lk.stored_len as usize], lk)?;
                self.cache.insert(gen, &lk, std::sync::Arc::new(raw));
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
                    "SELECT e.off, e.len, c.container, c.offset, c.stored_len, c.raw_len
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
                let rows = st.query_map(params![a, epoch, u, FILE_BYTES], planned)?;
                rows.collect::<rusqlite::Result<_>>()?
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
