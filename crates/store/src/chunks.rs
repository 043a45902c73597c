//! The `chunks` rows: what is stored, where, and how often referenced.
//! Every read and change of a chunk row on the store's paths (writes,
//! deletes, gc, the fingerprint index's bookkeeping) goes through
//! [`Chunks`]; only fsck's checks and `stats`' totals query the table
//! directly, as checkers that must not rely on the code they check.
//!
//! Invariants (ARCHITECTURE.md, "meta.sqlite" and "Store" 4 and 9):
//! - Every `chunks` row has one `chunk_refs` row of the same id and no
//!   other `chunk_refs` row exists; its `refs` equals the number of
//!   `extents` and `extents_hist` rows naming the chunk; a decrement
//!   below zero is refused ([`StoreError::RefUnderflow`]).
//! - A row's `hash` is the BLAKE3-256 of the chunk's bytes and never
//!   changes; a relocation changes only where the bytes are.
//! - `indexed = 0` marks a row the fingerprint index must not hold
//!   (refused by its quota, or pruned); lookups by fingerprint go through
//!   `crate::index::StoreIndex`, whose answers are confirmed against the
//!   row.

use rusqlite::{params, Connection, OptionalExtension};

use crate::container::Hash;
use crate::error::{Result, StoreError};
use crate::meta::{ChunkId, ChunkLoc, PackAt};

/// The chunk rows of one connection (inside its open transaction).
pub(crate) struct Chunks<'a>(pub &'a Connection);

/// A `ChunkLoc` from six columns starting at `at` (container, offset,
/// stored_len, raw_len, inner, pack_raw).
pub(crate) fn loc_of(r: &rusqlite::Row, at: usize) -> rusqlite::Result<ChunkLoc> {
    let inner: Option<u32> = r.get(at + 4)?;
    let of: Option<u32> = r.get(at + 5)?;
    Ok(ChunkLoc {
        container: r.get(at)?,
        offset: r.get(at + 1)?,
        stored_len: r.get(at + 2)?,
        raw_len: r.get(at + 3)?,
        inner: inner.map(|at| PackAt {
            at,
            of: of.unwrap_or(0),
        }),
    })
}

/// A chunk's stored bytes (on `c`, a `chunks` row): its record's, or
/// for a chunk in a pack the pack's in proportion to its raw length (what
/// the chunk costs; gc frees it by making the pack again without it;
/// `ChunkLoc::stored_share` in Rust).
pub(crate) const STORED_SHARE: &str = "CASE WHEN c.inner IS NULL THEN c.stored_len
    ELSE c.stored_len * c.raw_len / c.pack_raw END";

impl Chunks<'_> {
    /// The chunk row `id`'s full BLAKE3 and location, if the row exists.
    pub fn row(&self, id: ChunkId) -> Result<Option<(Hash, ChunkLoc)>> {
        let mut st = self.0.prepare_cached(
            "SELECT hash, container, offset, stored_len, raw_len, inner, pack_raw FROM chunks
             WHERE id = ?1",
        )?;
        let row = st
            .query_row([id], |r| Ok((r.get::<_, Vec<u8>>(0)?, loc_of(r, 1)?)))
            .optional()?;
        Ok(row.and_then(|(h, loc)| Some((Hash::try_from(h.as_slice()).ok()?, loc))))
    }

    /// Row `id`'s fingerprint bytes (as stored: fsck checks their length)
    /// and its `indexed` flag.
    pub fn fingerprint(&self, id: ChunkId) -> Result<Option<(Vec<u8>, bool)>> {
        let mut st = self
            .0
            .prepare_cached("SELECT hash, indexed FROM chunks WHERE id = ?1")?;
        Ok(st
            .query_row([id], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? != 0)))
            .optional()?)
    }

    /// Row `id`'s fingerprint bytes and reference count.
    pub fn fingerprint_refs(&self, id: ChunkId) -> Result<Option<(Vec<u8>, i64)>> {
        let mut st = self.0.prepare_cached(
            "SELECT c.hash, r.refs FROM chunks c JOIN chunk_refs r ON r.id = c.id
                 WHERE c.id = ?1",
        )?;
        Ok(st
            .query_row([id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?)
    }

    /// Records a new chunk with one reference.
    pub fn insert(&self, hash: &Hash, loc: ChunkLoc) -> Result<ChunkId> {
        let mut st = self.0.prepare_cached(
            "INSERT INTO chunks (hash, container, offset, stored_len, raw_len, inner, pack_raw)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )?;
        st.execute(params![
            &hash[..],
            loc.container,
            loc.offset,
            loc.stored_len,
            loc.raw_len,
            loc.inner.map(|p| p.at),
            loc.inner.map(|p| p.of)
        ])?;
        let id = self.0.last_insert_rowid();
        self.0
            .prepare_cached("INSERT INTO chunk_refs (id, refs) VALUES (?1, 1)")?
            .execute([id])?;
        Ok(id as u64)
    }

    /// Adds `n` references.
    pub fn incref(&self, id: ChunkId, n: u64) -> Result<()> {
        let mut st = self
            .0
            .prepare_cached("UPDATE chunk_refs SET refs = refs + ?2 WHERE id = ?1")?;
        st.execute(params![id, n])?;
        Ok(())
    }

    /// Drops `n` references; returns how many remain. More references
    /// dropped than the chunk has is an error, and the count stays as it
    /// was: the counts no longer match the file maps (fsck says so and
    /// `--repair` recounts), and a count clamped at 0 would let a later
    /// prune delete a chunk files still use.
    pub fn decref(&self, id: ChunkId, n: u64) -> Result<u64> {
        let mut st = self.0.prepare_cached(
            "UPDATE chunk_refs SET refs = refs - ?2 WHERE id = ?1 AND refs >= ?2
             RETURNING refs",
        )?;
        if let Some(left) = st.query_row(params![id, n], |r| r.get(0)).optional()? {
            return Ok(left);
        }
        let refs = self.fingerprint_refs(id)?.map(|(_, r)| r.max(0) as u64);
        Err(StoreError::RefUnderflow {
            chunk: id,
            refs,
            dropped: n,
        })
    }

    /// Chunk `id`'s bytes now live at `loc` (same length once decoded:
    /// gc's copy or repack, or a healthy copy of a damaged record), with
    /// `add_refs` more references.
    pub fn relocate(&self, id: ChunkId, loc: ChunkLoc, add_refs: u64) -> Result<()> {
        let mut st = self.0.prepare_cached(
            "UPDATE chunks SET container = ?2, offset = ?3, stored_len = ?4, inner = ?5,
             pack_raw = ?6 WHERE id = ?1",
        )?;
        let (at, of) = (loc.inner.map(|p| p.at), loc.inner.map(|p| p.of));
        st.execute(params![
            id,
            loc.container,
            loc.offset,
            loc.stored_len,
            at,
            of
        ])?;
        if add_refs > 0 {
            self.incref(id, add_refs)?;
        }
        Ok(())
    }

    /// Deletes row `id` (its references are gone).
    pub fn delete(&self, id: ChunkId) -> Result<()> {
        let mut st = self.0.prepare_cached("DELETE FROM chunks WHERE id = ?1")?;
        st.execute([id])?;
        let mut st = self
            .0
            .prepare_cached("DELETE FROM chunk_refs WHERE id = ?1")?;
        st.execute([id])?;
        Ok(())
    }

    /// Marks row `id` as one the fingerprint index must not hold.
    pub fn mark_unindexed(&self, id: ChunkId) -> Result<()> {
        let mut st = self
            .0
            .prepare_cached("UPDATE chunks SET indexed = 0 WHERE id = ?1")?;
        st.execute([id])?;
        Ok(())
    }

    /// Up to `limit` rows with no reference and an id above `after`, in id
    /// order (id, fingerprint bytes): what prune deletes.
    pub fn unreferenced(&self, after: ChunkId, limit: u64) -> Result<Vec<(ChunkId, Vec<u8>)>> {
        let mut st = self.0.prepare_cached(
            "SELECT r.id, c.hash FROM chunk_refs r JOIN chunks c ON c.id = r.id
             WHERE r.id > ?1 AND r.refs <= 0 ORDER BY r.id LIMIT ?2",
        )?;
        let rows = st.query_map(params![after, limit], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The rows of container `id` (row id, fingerprint bytes, location) in
    /// offset order: what compaction moves and scrub reads.
    pub fn in_container(&self, id: u64) -> Result<Vec<(ChunkId, Vec<u8>, ChunkLoc)>> {
        let mut st = self.0.prepare_cached(
            "SELECT id, hash, container, offset, stored_len, raw_len, inner, pack_raw FROM chunks
             WHERE container = ?1 ORDER BY offset, inner",
        )?;
        let rows = st.query_map([id], |r| Ok((r.get(0)?, r.get(1)?, loc_of(r, 2)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The containers any row points into, ascending.
    pub fn containers(&self) -> Result<Vec<u64>> {
        let mut st = self
            .0
            .prepare("SELECT DISTINCT container FROM chunks ORDER BY container")?;
        let rows = st.query_map([], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Calls `f` with each indexed row above `after` (id, BLAKE3), in id
    /// order; rows whose fingerprint is not 32 bytes are skipped (fsck
    pub fn each_indexed(
        &self,
        after: ChunkId,
        mut f: impl FnMut(ChunkId, Hash) -> Result<()>,
    ) -> Result<()> {
        let mut st = self
            .0
            .prepare("SELECT id, hash FROM chunks WHERE id > ?1 AND indexed != 0 ORDER BY id")?;
        let mut rows = st.query([after])?;
        while let Some(r) = rows.next()? {
            let (id, hash): (ChunkId, Vec<u8>) = (r.get(0)?, r.get(1)?);
            if let Ok(h) = Hash::try_from(hash.as_slice()) {
                f(id, h)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::open_db;

    fn loc(container: u64, offset: u64) -> ChunkLoc {
        ChunkLoc {
            container,
            offset,
            stored_len: 100,
            raw_len: 200,
            inner: None,
        }
    }

    #[test]
    fn rows_count_references() {
        let dir = tempfile::tempdir().unwrap();
        let db = open_db(&dir.path().join("m.sqlite"), true).unwrap();
        let rows = Chunks(&db);
        let h = [3u8; 32];
        let id = rows.insert(&h, loc(1, 16)).unwrap();
        assert_eq!(rows.row(id).unwrap(), Some((h, loc(1, 16))));
        assert_eq!(rows.row(id + 1).unwrap(), None);
        rows.incref(id, 2).unwrap();
        assert_eq!(rows.decref(id, 1).unwrap(), 2);
        let e = rows.decref(id, 5).expect_err("an underflow is an error");
        assert!(
            matches!(e, StoreError::RefUnderflow { refs: Some(2), .. }),
            "{e}"
        );
        assert_eq!(e.errno(), libc::EIO);
        assert_eq!(rows.decref(id, 2).unwrap(), 0, "the count was kept");
        assert!(rows.decref(id + 7, 1).is_err(), "a missing chunk");
        drop(db);
        assert!(open_db(&dir.path().join("m.sqlite"), false).is_ok());
        assert!(open_db(&dir.path().join("none.sqlite"), false).is_err());
    }

    #[test]
    fn relocation_prune_and_index_flags() {
        let dir = tempfile::tempdir().unwrap();
        let db = open_db(&dir.path().join("m.sqlite"), true).unwrap();
        let rows = Chunks(&db);
        let a = rows.insert(&[1u8; 32], loc(1, 16)).unwrap();
        let b = rows.insert(&[2u8; 32], loc(1, 116)).unwrap();
        let c = rows.insert(&[3u8; 32], loc(2, 16)).unwrap();
        rows.relocate(a, loc(3, 16), 1).unwrap();
        assert_eq!(rows.row(a).unwrap(), Some(([1u8; 32], loc(3, 16))));
        assert_eq!(rows.fingerprint_refs(a).unwrap(), Some((vec![1u8; 32], 2)));
        assert_eq!(rows.containers().unwrap(), vec![1, 2, 3]);
        let in1: Vec<_> = rows
            .in_container(1)
            .unwrap()
            .into_iter()
            .map(|r| r.0)
            .collect();
        assert_eq!(in1, vec![b]);
        rows.decref(b, 1).unwrap();
        rows.decref(c, 1).unwrap();
        let dead: Vec<_> = rows
            .unreferenced(0, 1)
            .unwrap()
            .into_iter()
            .map(|r| r.0)
            .collect();
        assert_eq!(dead, vec![b], "in id order, at most the limit");
        assert_eq!(rows.unreferenced(b, 10).unwrap()[0].0, c);
        rows.mark_unindexed(a).unwrap();
        assert_eq!(rows.fingerprint(a).unwrap(), Some((vec![1u8; 32], false)));
        let mut seen = Vec::new();
        rows.each_indexed(0, |id, _| {
            seen.push(id);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![b, c]);
        rows.delete(b).unwrap();
        assert_eq!(rows.row(b).unwrap(), None);
        let counts: u64 = db
            .query_row("SELECT COUNT(*) FROM chunk_refs WHERE id = ?1", [b], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(counts, 0, "the count goes with the row");
    }
}
