//! Copies inside the store (`copy_file_range`): whole chunks are shared,
//! not copied, so copying a file of any size adds no stored bytes and
//! costs a row per chunk.
//!
//! Rules: a chunk is shared when it lies wholly inside the source range
//! and lands where the destination's chunking would have cut it (fixed
//! chunking: the same offset modulo the chunk size; content-defined
//! chunking: only a whole file copied over the whole destination). A
//! short last chunk of the source is shared only when nothing of the
//! destination lies beyond it. Every other byte is read and written as by
//! `read` and `write`. Holes stay holes.

use rusqlite::params;

use crate::config::Chunking;
use crate::error::{Result, StoreError};
use crate::ns::{Attr, Kind};
use crate::store::{time_now, Inner, Store};
use crate::view::Source;

/// Bytes copied by reading and writing at a time.
const BYTES_STEP: u64 = 1 << 20;

/// The most one request copies: a FUSE reply counts at most `u32::MAX`
/// bytes, and the kernel cuts a larger copy at this much (page-aligned).
const MAX_REQUEST: u64 = u32::MAX as u64 & !0xfff;

/// The part of a copy whose chunks are shared: source range
/// `[start, end)` lands at `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shared {
    start: u64,
    end: u64,
    out: u64,
}

impl Store {
    /// Copies `len` bytes of file `src` from `off_in` to file `dst` at
    /// `off_out` (no further than the source's end); returns the bytes
    /// copied. Overlapping ranges of one file are refused (`Invalid`).
    pub fn copy_range(
        &self,
        src: u64,
        off_in: u64,
        dst: u64,
        off_out: u64,
        len: u64,
    ) -> Result<u64> {
        let len = request_len(self.cfg.chunking, off_in, len, MAX_REQUEST);
        let (len, shared) = {
            let mut g = self.lock();
            let (from, sa) = self.copy_source(&g, src)?;
            let (len, shared) = self.plan_copy(&mut g, (from, sa), off_in, dst, off_out, len)?;
            if let Some(sh) = shared {
                self.share(&mut g, from, dst, sh)?;
            }
            (len, shared)
        };
        let (a, b) = (off_in, off_in + len);
        match shared {
            Some(sh) => {
                self.copy_bytes(src, a, sh.start, dst, off_out)?;
                self.copy_bytes(src, sh.end, b, dst, sh.out + (sh.end - sh.start))?;
            }
            None => self.copy_bytes(src, a, b, dst, off_out)?,
        }
        Ok(len)
    }

    /// Checks the files, stores the source's buffer, chooses the shared
    /// part and stores the destination's buffer if it touches that part.
    fn plan_copy(
        &self,
        g: &mut Inner,
        (src, sa): (Source, Attr),
        off_in: u64,
        dst: u64,
        off_out: u64,
        len: u64,
    ) -> Result<(u64, Option<Shared>)> {
        let da = g.attr(dst)?;
        for a in [&sa, &da] {
            match a.kind {
                Kind::File => {}
                Kind::Dir => return Err(StoreError::IsDir),
                _ => return Err(StoreError::Invalid),
            }
        }
        let len = len.min(sa.size.saturating_sub(off_in));
        let live = src.epoch.is_none();
        if live && src.ino == dst && off_in < off_out + len && off_out < off_in + len {
            return Err(StoreError::Invalid);
        }
        if live {
            self.flush_file_locked(g, src.ino)?;
        }
        let (end, dst_size) = (off_in + len, da.size);
        let shared = match self.cfg.chunking {
            Chunking::Fixed { size } => {
                fixed_share(size as u64, off_in, end, off_out, sa.size, dst_size)
            }
            Chunking::Cdc { .. } => {
                (off_in == 0 && off_out == 0 && end == sa.size && dst_size <= end && len > 0)
                    .then_some(Shared {
                        start: 0,
                        end,
                        out: 0,
                    })
            }
        };
        if let Some(sh) = shared {
            self.flush_if_buffered(g, dst, sh.out, sh.out + (sh.end - sh.start))?;
        }
        Ok((len, shared))
    }

    /// Stores `dst`'s buffer if it holds a page of `[from, to)` (which the
    /// shared chunks replace) or is being stored now. Pages elsewhere stay
    /// buffered: a partial chunk a caller's copy left at its end is then
    /// completed by the caller's next copy (e.g. a program copying in
    /// pieces), not stored alone as a short chunk.
    fn flush_if_buffered(&self, g: &mut Inner, dst: u64, from: u64, to: u64) -> Result<()> {
        let ps = self.page_size();
        let busy = g.dirty.get(&dst).is_some_and(|d| {
            d.flushing || d.pages.range(from / ps..to.div_ceil(ps)).next().is_some()
        });
        if busy {
            self.flush_file_locked(g, dst)?;
        }
        Ok(())
    }

    /// Maps the shared part's chunks into `dst` (what it held there goes),
    /// one more reference per extent, and sets its size and times:
    /// set-wise statements whatever the number of chunks.
    ///
    /// Every statement binds the same seven parameters: source inode,
    /// range start and end, destination, its offset, the open epoch and
    /// the epoch a snapshot source is seen at (unused for a live one).
    fn share(&self, g: &mut Inner, src: Source, dst: u64, sh: Shared) -> Result<()> {
        let out_end = sh.out + (sh.end - sh.start);
        self.drop_extents(g, dst, sh.out, out_end)?;
        let [distinct_sql, insert_sql, repeats_sql] = share_sql(src.epoch.is_some());
        let view_epoch = src.epoch.unwrap_or(0);
        let p = [src.ino, sh.start, sh.end, dst, sh.out, g.epoch, view_epoch];
        // One reference per distinct chunk; a chunk the range holds more
        // than once (repeated content) gets the rest below.
        let distinct = run_with(&g.db, distinct_sql, &p)?;
        let rows = without_triggers(&g.db, || run_with(&g.db, insert_sql, &p))?;
        if rows > distinct {
            run_with(&g.db, repeats_sql, &p)?;
        }
        g.db.prepare_cached(
            "UPDATE inodes SET size = MAX(size, ?2), mtime_ns = ?3, ctime_ns = ?3,
             data = data + (SELECT COALESCE(SUM(len), 0) FROM extents
                            WHERE ino = ?1 AND off >= ?4 AND off < ?2)
             WHERE ino = ?1",
        )?
        .execute(params![dst, out_end, time_now(), sh.out])?;
        Ok(())
    }

    /// Copies source bytes `[a, b)` to `out` of `dst` by reading and
    /// writing, a piece at a time.
    fn copy_bytes(&self, src: u64, mut a: u64, b: u64, dst: u64, mut out: u64) -> Result<()> {
        while a < b {
            let n = (b - a).min(BYTES_STEP);
            let data = self.read(src, a, n as usize)?;
            if data.is_empty() {
                break;
            }
            self.write(dst, out, &data)?;
            a += data.len() as u64;
            out += data.len() as u64;
        }
        Ok(())
    }
}

/// [`Store::share`]'s statements (see it for their parameters), over
/// the live source's extent rows or a snapshot's view of them.
fn share_sql(view: bool) -> [&'static str; 3] {
    fn build(rows: &str) -> [String; 3] {
        [
            format!(
                "UPDATE chunk_refs SET refs = refs + 1 WHERE id IN
                 (SELECT chunk FROM ({rows}))"
            ),
            format!(
                "INSERT INTO extents (ino, off, len, chunk, born)
                 SELECT ?4, off - ?2 + ?5, len, chunk, ?6 FROM ({rows})"
            ),
            format!(
                "UPDATE chunk_refs SET refs = refs + n.n - 1 FROM (SELECT chunk, COUNT(*) n
                 FROM ({rows}) GROUP BY chunk HAVING COUNT(*) > 1) n
                 WHERE n.chunk = chunk_refs.id"
            ),
        ]
    }
    static LIVE: std::sync::LazyLock<[String; 3]> = std::sync::LazyLock::new(|| {
        build("SELECT off, len, chunk FROM extents WHERE ino = ?1 AND off >= ?2 AND off < ?3")
    });
    static VIEW: std::sync::LazyLock<[String; 3]> = std::sync::LazyLock::new(|| {
        let cond = "ino = ?1 AND off >= ?2 AND off < ?3";
        build(&crate::view::visible("extents", "off, len, chunk", cond, 7))
    });
    let s = if view { &*VIEW } else { &*LIVE };
    [s[0].as_str(), s[1].as_str(), s[2].as_str()]
}

/// Runs statement `sql` with its parameters taken from `p` by number
/// (`?N` is `p[N - 1]`; a statement may leave some unnamed).
fn run_with(db: &rusqlite::Connection, sql: &str, p: &[u64]) -> rusqlite::Result<usize> {
    let mut st = db.prepare_cached(sql)?;
    for i in 1..=st.parameter_count() {
        st.raw_bind_parameter(i, p[i - 1])?;
    }
    st.raw_execute()
}

/// Runs `insert` with the connection's triggers off: one set-wise insert
/// of many extents, whose caller adds their bytes to `inodes.data` in one
/// statement instead of a trigger per row (`V4_DATA_TRIGGERS`; the
/// snapshot triggers do nothing for rows born in the open epoch). Turning
/// them off and on again expires the prepared statements (SQLite
/// re-prepares each at its next use). Triggers are on again whatever
/// `insert` returns.
fn without_triggers(
    db: &rusqlite::Connection,
    insert: impl FnOnce() -> rusqlite::Result<usize>,
) -> Result<usize> {
    use rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_TRIGGER as TRIGGERS;
    db.set_db_config(TRIGGERS, false)?;
    let r = insert();
    db.set_db_config(TRIGGERS, true)?;
    Ok(r?)
}

/// How much of a `len`-byte copy from `off_in` one request does: all of
/// it below `max`; a request of `max` or more (cut by the kernel, or to be
/// cut here) ends on a chunk boundary under fixed chunking, so the next
/// one starts on one and no partial chunk is left buffered between the
/// two (a commit in between would store it alone, an unreferenced short
/// chunk once the next request completed it). A shorter copy than asked
/// is a normal answer: the caller asks again for the rest.
fn request_len(chunking: Chunking, off_in: u64, len: u64, max: u64) -> u64 {
    if len < max {
        return len;
    }
    match chunking {
        Chunking::Fixed { size } => {
            let end = (off_in + max) / size as u64 * size as u64;
            if end > off_in {
                end - off_in
            } else {
                max
            }
        }
        Chunking::Cdc { .. } => max,
    }
}

/// The chunks of `[start, end)` a fixed-chunking copy to `out` shares:
/// whole chunks at the same offset modulo `cs`, plus the source's short
/// last chunk when the copy reaches the source's end and nothing of the
/// destination lies beyond the copy.
fn fixed_share(
    cs: u64,
    start: u64,
    end: u64,
    out: u64,
    src_size: u64,
    dst_size: u64,
) -> Option<Shared> {
    if start % cs != out % cs {
        return None;
    }
    let first = start.next_multiple_of(cs);
    let mut last = end / cs * cs;
    let out_end = out + (end - start);
    if end == src_size && !end.is_multiple_of(cs) && dst_size <= out_end {
        last = end;
    }
    (first < last).then_some(Shared {
        start: first,
        end: last,
        out: out + (first - start),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_cut_at_the_reply_limit_ends_on_a_chunk_boundary() {
        let fixed = Chunking::Fixed { size: 100 };
        assert_eq!(request_len(fixed, 0, 500, 1000), 500, "under the limit");
        assert_eq!(request_len(fixed, 0, 1050, 1050), 1000, "cut by the kernel");
        assert_eq!(request_len(fixed, 0, 5000, 1050), 1000);
        assert_eq!(request_len(fixed, 30, 5000, 1050), 970, "ends at 1000");
        assert_eq!(request_len(fixed, 30, 5000, 60), 60, "no boundary in reach");
        let cdc = Chunking::Cdc {
            min: 10,
            avg: 20,
            max: 40,
        };
        assert_eq!(request_len(cdc, 30, 5000, 1050), 1050);
    }

    #[test]
    fn fixed_copies_share_whole_chunks_at_congruent_offsets() {
        let sh = |start, end, out, src, dst| fixed_share(100, start, end, out, src, dst);
        // A whole file over an empty one: every chunk, the short last too.
        assert_eq!(
            sh(0, 250, 0, 250, 0),
            Some(Shared {
                start: 0,
                end: 250,
                out: 0
            })
        );
        // The short last one not when the destination goes on past it.
        assert_eq!(
            sh(0, 250, 0, 250, 400),
            Some(Shared {
                start: 0,
                end: 200,
                out: 0
            })
        );
        // Unaligned ends are copied as bytes around the shared middle.
        assert_eq!(
            sh(30, 370, 1030, 1000, 0),
            Some(Shared {
                start: 100,
                end: 300,
                out: 1100
            })
        );
        // Offsets that do not agree modulo the chunk size share nothing.
        assert_eq!(sh(0, 1000, 50, 1000, 0), None);
        // A range inside one chunk shares nothing.
        assert_eq!(sh(10, 90, 10, 1000, 0), None);
    }
}
