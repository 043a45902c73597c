//! The metadata database (SQLite through rusqlite): schema, versioning, and
//! the [`ChunkIndex`] the store reaches its fingerprint table through.

use rusqlite::{params, Connection, OptionalExtension};

use crate::container::Hash;
use crate::error::{Result, StoreError};

/// `PRAGMA user_version` of `meta.sqlite`. Version 2: `chunks.hash` is
/// no longer unique nor indexed (the fingerprint index in `DIR/index`
/// answers lookups), `chunks.indexed` says whether the fingerprint index
/// holds the chunk, and `index_drops` journals deletions from it.
pub const META_VERSION: u64 = 2;

/// Indexes added after format 1 was released; created at open when
/// missing (an index changes no data, so older binaries still open the
/// store). `dirents_order` serves `readdir`'s `parent = ? AND id > ?
/// ORDER BY id`: without it each batch of entries sorted the whole
/// directory, quadratic in its size.
const LATER_INDEXES: &str = "CREATE INDEX IF NOT EXISTS dirents_order ON dirents (parent, id);";

const SCHEMA: &str = "
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE inodes (
    ino INTEGER PRIMARY KEY AUTOINCREMENT, kind INTEGER NOT NULL, perm INTEGER NOT NULL,
    uid INTEGER NOT NULL, gid INTEGER NOT NULL, nlink INTEGER NOT NULL, size INTEGER NOT NULL,
    atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    rdev INTEGER NOT NULL, target BLOB);
CREATE TABLE dirents (
    id INTEGER PRIMARY KEY AUTOINCREMENT, parent INTEGER NOT NULL, name BLOB NOT NULL,
    ino INTEGER NOT NULL, UNIQUE (parent, name));
CREATE INDEX dirents_ino ON dirents (ino);
CREATE INDEX dirents_order ON dirents (parent, id);
CREATE TABLE xattrs (ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (ino, name)) WITHOUT ROWID;
CREATE TABLE extents (ino INTEGER NOT NULL, off INTEGER NOT NULL, len INTEGER NOT NULL,
    chunk INTEGER NOT NULL, PRIMARY KEY (ino, off)) WITHOUT ROWID;
CREATE INDEX extents_chunk ON extents (chunk);
CREATE TABLE chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT, hash BLOB NOT NULL, container INTEGER NOT NULL,
    offset INTEGER NOT NULL, stored_len INTEGER NOT NULL, raw_len INTEGER NOT NULL,
    refs INTEGER NOT NULL, indexed INTEGER NOT NULL DEFAULT 1);
CREATE INDEX chunks_container ON chunks (container);
CREATE TABLE index_drops (id INTEGER PRIMARY KEY, key BLOB NOT NULL);
CREATE TABLE containers (id INTEGER PRIMARY KEY, length INTEGER NOT NULL, sealed INTEGER NOT NULL);
";

/// Opens (or, with `create`, creates) the metadata database.
pub fn open_db(path: &std::path::Path, create: bool) -> Result<Connection> {
    if !create && !path.exists() {
        return Err(StoreError::NotAStore {
            path: path.into(),
            why: "no meta.sqlite".into(),
        });
    }
    let conn = Connection::open(path)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "cache_size", -65536)?;
    conn.pragma_update(None, "foreign_keys", "OFF")?;
    if create {
        conn.execute_batch(SCHEMA)?;
        conn.execute(
            "INSERT INTO meta VALUES ('magic', 'onecopy-store'), ('format', ?1)",
            [META_VERSION.to_string()],
        )?;
        conn.pragma_update(None, "user_version", META_VERSION)?;
    } else {
        let mut v: u64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if v == 1 {
            migrate_v1(&conn)?;
            v = META_VERSION;
        }
        if v != META_VERSION {
            return Err(StoreError::Version {
                path: path.into(),
                found: v,
                supported: META_VERSION,
            });
        }
        add_later_indexes(&conn);
    }
    Ok(conn)
}

/// Format 1 to 2, in one transaction: `chunks` is rebuilt without the
/// UNIQUE constraint on `hash` (its automatic index cannot be dropped
/// alone) and with `indexed`, keeping ids and the AUTOINCREMENT counter;
/// `index_drops` is created. The fingerprint index is then built at open
/// from every row (its watermark, `index_synced`, is absent: 0).
fn migrate_v1(conn: &Connection) -> Result<()> {
    conn.execute_batch(
        "BEGIN;
         CREATE TABLE chunks_v2 (
            id INTEGER PRIMARY KEY AUTOINCREMENT, hash BLOB NOT NULL, container INTEGER NOT NULL,
            offset INTEGER NOT NULL, stored_len INTEGER NOT NULL, raw_len INTEGER NOT NULL,
            refs INTEGER NOT NULL, indexed INTEGER NOT NULL DEFAULT 1);
         INSERT INTO chunks_v2 (id, hash, container, offset, stored_len, raw_len, refs)
            SELECT id, hash, container, offset, stored_len, raw_len, refs FROM chunks;
         UPDATE sqlite_sequence SET seq = MAX(seq, (SELECT COALESCE(MAX(seq), 0)
            FROM sqlite_sequence WHERE name = 'chunks')) WHERE name = 'chunks_v2';
         DROP TABLE chunks;
         ALTER TABLE chunks_v2 RENAME TO chunks;
         CREATE INDEX chunks_container ON chunks (container);
         CREATE TABLE index_drops (id INTEGER PRIMARY KEY, key BLOB NOT NULL);
         DELETE FROM meta WHERE key = 'index_synced';
         UPDATE meta SET value = '2' WHERE key = 'format';
         PRAGMA user_version = 2;
         COMMIT;",
    )
    .inspect_err(|_| {
        let _ = conn.execute_batch("ROLLBACK");
    })?;
    Ok(())
}

/// Creates the [`LATER_INDEXES`] a store made by an older binary lacks.
/// A failure (a full disk, a read-only store) is not fatal: every query
/// is still correct without them, only slower.
fn add_later_indexes(conn: &Connection) {
    if let Err(e) = conn.execute_batch(LATER_INDEXES) {
        eprintln!("onecopy: could not add indexes to the metadata database: {e}");
    }
}

/// Where a chunk's record sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLoc {
    pub container: u64,
    pub offset: u64,
    /// Record length: header plus stored payload.
    pub stored_len: u32,
    pub raw_len: u32,
}

/// Opaque chunk number that file maps refer to.
pub type ChunkId = u64;

/// The chunk rows as the store uses them: the source of truth of what is
/// stored, where, and how often referenced. Lookups by fingerprint go
/// through the fingerprint index (`crate::index::StoreIndex`), which maps
/// a fingerprint to a row id that is always confirmed against the row.
pub trait ChunkIndex {
    /// The chunk row `id`'s full BLAKE3 and location, if the row exists.
    fn row(&self, id: ChunkId) -> Result<Option<(Hash, ChunkLoc)>>;
    /// Records a new chunk with one reference.
    fn insert(&self, hash: &Hash, loc: ChunkLoc) -> Result<ChunkId>;
    /// Adds `n` references.
    fn incref(&self, id: ChunkId, n: u64) -> Result<()>;
    /// Drops `n` references; returns how many remain.
    fn decref(&self, id: ChunkId, n: u64) -> Result<u64>;
    /// Where chunk `id` is.
    fn location(&self, id: ChunkId) -> Result<ChunkLoc>;
}

/// [`ChunkIndex`] over the `chunks` table.
pub struct SqlIndex<'a>(pub &'a Connection);

/// A `ChunkLoc` from four columns starting at `at` (container, offset,
/// stored_len, raw_len).
pub(crate) fn loc_of(r: &rusqlite::Row, at: usize) -> rusqlite::Result<ChunkLoc> {
    Ok(ChunkLoc {
        container: r.get(at)?,
        offset: r.get(at + 1)?,
        stored_len: r.get(at + 2)?,
        raw_len: r.get(at + 3)?,
    })
}

impl ChunkIndex for SqlIndex<'_> {
    fn row(&self, id: ChunkId) -> Result<Option<(Hash, ChunkLoc)>> {
        let mut st = self.0.prepare_cached(
            "SELECT hash, container, offset, stored_len, raw_len FROM chunks WHERE id = ?1",
        )?;
        let row = st
            .query_row([id], |r| Ok((r.get::<_, Vec<u8>>(0)?, loc_of(r, 1)?)))
            .optional()?;
        Ok(row.and_then(|(h, loc)| Some((Hash::try_from(h.as_slice()).ok()?, loc))))
    }

    fn insert(&self, hash: &Hash, loc: ChunkLoc) -> Result<ChunkId> {
        let mut st = self.0.prepare_cached(
            "INSERT INTO chunks (hash, container, offset, stored_len, raw_len, refs)
             VALUES (?1, ?2, ?3, ?4, ?5, 1)",
        )?;
        st.execute(params![
            &hash[..],
            loc.container,
            loc.offset,
            loc.stored_len,
            loc.raw_len
        ])?;
        Ok(self.0.last_insert_rowid() as u64)
    }

    fn incref(&self, id: ChunkId, n: u64) -> Result<()> {
        let mut st = self
            .0
            .prepare_cached("UPDATE chunks SET refs = refs + ?2 WHERE id = ?1")?;
        st.execute(params![id, n])?;
        Ok(())
    }

    fn decref(&self, id: ChunkId, n: u64) -> Result<u64> {
        let mut st = self.0.prepare_cached(
            "UPDATE chunks SET refs = MAX(refs - ?2, 0) WHERE id = ?1 RETURNING refs",
        )?;
        Ok(st
            .query_row(params![id, n], |r| r.get(0))
            .optional()?
            .unwrap_or(0))
    }

    fn location(&self, id: ChunkId) -> Result<ChunkLoc> {
        let mut st = self.0.prepare_cached(
            "SELECT container, offset, stored_len, raw_len FROM chunks WHERE id = ?1",
        )?;
        st.query_row([id], |r| loc_of(r, 0))
            .optional()?
            .ok_or(StoreError::Damaged {
                container: 0,
                offset: 0,
                why: format!("chunk {id} missing from the index"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_counts_references() {
        let dir = tempfile::tempdir().unwrap();
        let db = open_db(&dir.path().join("m.sqlite"), true).unwrap();
        let idx = SqlIndex(&db);
        let h = [3u8; 32];
        let loc = ChunkLoc {
            container: 1,
            offset: 16,
            stored_len: 100,
            raw_len: 200,
        };
        let id = idx.insert(&h, loc).unwrap();
        assert_eq!(idx.row(id).unwrap(), Some((h, loc)));
        assert_eq!(idx.row(id + 1).unwrap(), None);
        idx.incref(id, 2).unwrap();
        assert_eq!(idx.decref(id, 1).unwrap(), 2);
        assert_eq!(idx.decref(id, 5).unwrap(), 0);
        assert_eq!(idx.location(id).unwrap(), loc);
        drop(db);
        assert!(open_db(&dir.path().join("m.sqlite"), false).is_ok());
        assert!(open_db(&dir.path().join("none.sqlite"), false).is_err());
    }
}

#[cfg(test)]
mod index_tests {
    use super::*;

    fn readdir_plan(conn: &Connection) -> String {
        let sql = format!("EXPLAIN QUERY PLAN {}", crate::ns::READDIR_SQL);
        let mut st = conn.prepare(&sql).unwrap();
        let rows = st
            .query_map(rusqlite::params![5, 100, 256], |r| r.get::<_, String>(3))
            .unwrap();
        rows.map(|r| r.unwrap()).collect::<Vec<_>>().join("; ")
    }

    /// readdir walks `dirents_order` and never sorts the whole directory,
    /// also in a store made before the index existed.
    #[test]
    fn readdir_uses_an_index_in_new_and_old_stores() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.sqlite");
        let conn = open_db(&path, true).unwrap();
        let plan = readdir_plan(&conn);
        assert!(
            plan.contains("dirents_order") && !plan.contains("TEMP B-TREE"),
            "{plan}"
        );
        conn.execute_batch("DROP INDEX dirents_order").unwrap();
        assert!(readdir_plan(&conn).contains("TEMP B-TREE"));
        drop(conn);
        let conn = open_db(&path, false).unwrap();
        let plan = readdir_plan(&conn);
        assert!(
            plan.contains("dirents_order") && !plan.contains("TEMP B-TREE"),
            "{plan}"
        );
    }
}
