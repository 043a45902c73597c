//! The metadata database (SQLite through rusqlite): schema and versioning.
//! The `chunks` rows are read and changed through [`crate::chunks`].

use rusqlite::{config::DbConfig, Connection};

use crate::error::{Result, StoreError};

/// `PRAGMA user_version` of `meta.sqlite`. Version 2: `chunks.hash` is
/// no longer unique nor indexed (the fingerprint index in `DIR/index`
/// answers lookups), `chunks.indexed` says whether the fingerprint index
/// holds the chunk, and `index_drops` journals deletions from it.
/// Version 3: `dirents` is a WITHOUT ROWID table keyed by `(parent,
/// cookie)` holding each name once (see [`crate::ns::name_cookie`]), a
/// directory's parent is `inodes.parent`, and `extents` has no index on
/// `chunk` (only fsck wanted it, and it now scans once).
/// Version 4: `inodes.data`, the bytes of a file held in stored chunks
/// (holes not counted: what `st_blocks` reports), kept equal to the sum
/// of the file's `extents.len` by the triggers of
/// [`crate::migrate::V4_DATA_TRIGGERS`].
/// Version 5: snapshots ([`crate::migrate::V5_SNAPSHOTS`]).
/// Version 6: reference counts in `chunk_refs`
/// ([`crate::migrate::V6_CHUNK_REFS`]).
/// Version 7: `chunks.inner` and `pack_raw`, a chunk's place inside a
/// pack record ([`crate::migrate::V7_PACKS`]).
pub const META_VERSION: u64 = 7;

const SCHEMA: &str = "
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE inodes (
    ino INTEGER PRIMARY KEY AUTOINCREMENT, kind INTEGER NOT NULL, perm INTEGER NOT NULL,
    uid INTEGER NOT NULL, gid INTEGER NOT NULL, nlink INTEGER NOT NULL, size INTEGER NOT NULL,
    atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    rdev INTEGER NOT NULL, target BLOB, parent INTEGER, data INTEGER NOT NULL DEFAULT 0);
CREATE TABLE dirents (parent INTEGER NOT NULL, cookie INTEGER NOT NULL, name BLOB NOT NULL,
    ino INTEGER NOT NULL, PRIMARY KEY (parent, cookie)) WITHOUT ROWID;
CREATE TABLE xattrs (ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (ino, name)) WITHOUT ROWID;
CREATE TABLE extents (ino INTEGER NOT NULL, off INTEGER NOT NULL, len INTEGER NOT NULL,
    chunk INTEGER NOT NULL, PRIMARY KEY (ino, off)) WITHOUT ROWID;
CREATE TABLE chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT, hash BLOB NOT NULL, container INTEGER NOT NULL,
    offset INTEGER NOT NULL, stored_len INTEGER NOT NULL, raw_len INTEGER NOT NULL,
    refs INTEGER NOT NULL, indexed INTEGER NOT NULL DEFAULT 1);
CREATE INDEX chunks_container ON chunks (container);
CREATE TABLE index_drops (id INTEGER PRIMARY KEY, key BLOB NOT NULL);
CREATE TABLE containers (id INTEGER PRIMARY KEY, length INTEGER NOT NULL, sealed INTEGER NOT NULL);
";

/// Sets a `meta` row. `INSERT OR REPLACE` moves the row to a new rowid at
/// every commit, so an idle mount's commits change a few pages and a
/// remote store's push carries them. An upsert avoided that, but changed
/// how a nearly full disk fills: store_storms'
/// `enospc_during_compaction_then_gc_completes` then failed (its online
/// gc stayed out of space after the ballast was removed), not yet
/// understood; the old statement is kept until it is.
pub(crate) const SET_META: &str = "INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)";

/// Prepared statements kept per connection. The store's hot paths use
/// about 55 distinct ones (`prepare_cached`); with rusqlite's default of
/// 16 a `cp -a` into the mount re-parsed SQL for every file (profile:
/// the parser and malloc at 6% of the mount's CPU).
const STATEMENT_CACHE: usize = 128;

/// Whether the database has the store's `meta` table (read only).
fn holds_store_metadata(conn: &Connection) -> Result<bool> {
    let n: i64 = conn.query_row(
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'meta'",
        [],
        |r| r.get(0),
    )?;
    Ok(n > 0)
}

/// Opens (or, with `create`, creates) the metadata database. An older
/// version (1, 2 or 3) is migrated, one step per transaction.
pub fn open_db(path: &std::path::Path, create: bool) -> Result<Connection> {
    if !create && !path.exists() {
        return Err(StoreError::NotAStore {
            path: path.into(),
            why: "no meta.sqlite".into(),
        });
    }
    let conn = Connection::open(path)?;
    if !create && !holds_store_metadata(&conn)? {
        // Checked before the first pragma below writes to the file: a
        // database of another program (or an empty file) is left as it is.
        return Err(StoreError::NotAStore {
            path: path.into(),
            why: "meta.sqlite holds no store's metadata".into(),
        });
    }
    if create {
        // Before anything is written (WAL mode writes the header): gc
        // can then give freed pages back ([`release_free_pages`]).
        conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
    }
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "cache_size", -65536)?;
    // Dirty pages stay in memory until COMMIT: a spill into the WAL in
    // the middle of a transaction that meets a full disk would roll the
    // whole transaction back under a statement, and later statements
    // would commit one by one. With no spill, SQLITE_FULL can only come
    // from COMMIT, which the store handles (see `space.rs`).
    conn.pragma_update(None, "cache_spill", "OFF")?;
    conn.pragma_update(None, "foreign_keys", "OFF")?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    // Plans that do not depend on bound values: otherwise SQLite
    // recompiles a statement at each new value of a parameter its planner
    // looked at (a `LIMIT ?`, a `LIKE ?`), and a cached statement is
    // parsed again on every use. A cold `cp -a` out of a snapshot parsed
    // its directory listing once per `READDIR` (2,117 of them).
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    if create {
        conn.execute_batch(SCHEMA)?;
        conn.execute_batch(crate::migrate::V4_DATA_TRIGGERS)?;
        conn.execute_batch(crate::migrate::V5_SNAPSHOTS)?;
        conn.execute_batch(crate::migrate::V6_CHUNK_REFS)?;
        conn.execute_batch(crate::migrate::V7_PACKS)?;
        conn.execute(
            "INSERT INTO meta VALUES ('magic', 'onecopy-store'), ('format', ?1)",
            [META_VERSION.to_string()],
        )?;
        conn.pragma_update(None, "user_version", META_VERSION)?;
    } else {
        let mut v: u64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if v == 1 {
            crate::migrate::v1_to_v2(&conn)?;
            v = 2;
        }
        if v == 2 {
            crate::migrate::v2_to_v3(&conn)?;
            v = 3;
        }
        if v == 3 {
            crate::migrate::v3_to_v4(&conn)?;
            v = 4;
        }
        if v == 4 {
            crate::migrate::v4_to_v5(&conn)?;
            v = 5;
        }
        if v == 5 {
            crate::migrate::v5_to_v6(&conn)?;
            v = 6;
        }
        if v == 6 {
            crate::migrate::v6_to_v7(&conn)?;
            v = 7;
        }
        if v != META_VERSION {
            return Err(StoreError::Version {
                path: path.into(),
                found: v,
                supported: META_VERSION,
            });
        }
    }
    Ok(conn)
}

/// Gives the database's free pages back to the file system (gc calls it
/// after dropping rows): `PRAGMA incremental_vacuum` moves pages from the
/// end of the file into the free ones, at a cost in the pages freed, not
/// in the database's size; the file shrinks at the next commit. Only when
/// at least [`RELEASE_MIN_PAGES`] are free: fewer are soon reused. A
/// database without `auto_vacuum = INCREMENTAL` (none the code makes) is
/// left alone. Returns the pages released.
pub(crate) fn release_free_pages(conn: &Connection) -> Result<u64> {
    let mode: u64 = conn.pragma_query_value(None, "auto_vacuum", |r| r.get(0))?;
    let free: u64 = conn.pragma_query_value(None, "freelist_count", |r| r.get(0))?;
    if mode != 2 || free < RELEASE_MIN_PAGES {
        return Ok(0);
    }
    // Each step frees one page: step to the end.
    let mut st = conn.prepare("PRAGMA incremental_vacuum")?;
    let mut rows = st.query([])?;
    while rows.next()?.is_some() {}
    Ok(free)
}

/// Free pages (4 KiB each) below which [`release_free_pages`] keeps them.
pub(crate) const RELEASE_MIN_PAGES: u64 = 256;

/// Where a chunk's record sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLoc {
    pub container: u64,
    pub offset: u64,
    /// Record length: header plus stored payload (of the whole pack for
    /// a chunk packed with others).
    pub stored_len: u32,
    /// The chunk's length (not the pack's).
    pub raw_len: u32,
    /// `Some`: the record is a pack (`container::PACK`) and the chunk is
    /// its decoded bytes `at..at + raw_len`; `None`: the record holds
    /// this chunk alone.
    pub inner: Option<PackAt>,
}

impl ChunkLoc {
    /// The stored bytes this chunk costs: its record's, or its share of
    /// a pack's in proportion to its raw length (`chunks::STORED_SHARE`
    /// in SQL).
    pub fn stored_share(&self) -> u64 {
        match self.inner {
            None => u64::from(self.stored_len),
            Some(p) => {
                u64::from(self.stored_len) * u64::from(self.raw_len) / u64::from(p.of.max(1))
            }
        }
    }
}

/// Where a chunk is in a pack: at `at` of the pack's `of` decoded bytes
/// (`chunks.inner`, `chunks.pack_raw`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackAt {
    pub at: u32,
    pub of: u32,
}

/// Opaque chunk number that file maps refer to.
pub type ChunkId = u64;

/// Turns a current database back into what format-6 code wrote (no
/// `chunks.inner`: every chunk alone in its record).
#[cfg(test)]
pub(crate) fn downgrade_to_v6(conn: &Connection) {
    conn.execute_batch(
        "ALTER TABLE chunks DROP COLUMN inner;
         ALTER TABLE chunks DROP COLUMN pack_raw;
         UPDATE meta SET value = '6' WHERE key = 'format';
         PRAGMA user_version = 6;",
    )
    .unwrap();
}

/// Turns a current database back into what format-5 code wrote:
/// reference counts in `chunks.refs`, history triggers that count there.
#[cfg(test)]
pub(crate) fn downgrade_to_v5(conn: &Connection) {
    downgrade_to_v6(conn);
    let triggers: Vec<(String, String)> = {
        let mut st = conn
            .prepare("SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND instr(sql, 'chunk_refs') > 0")
            .unwrap();
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.map(|r| r.unwrap()).collect()
    };
    for (name, _) in &triggers {
        conn.execute_batch(&format!("DROP TRIGGER {name};"))
            .unwrap();
    }
    conn.execute_batch(
        "ALTER TABLE chunks ADD COLUMN refs INTEGER NOT NULL DEFAULT 0;
         UPDATE chunks SET refs = r.refs FROM chunk_refs r WHERE r.id = chunks.id;
         DROP TABLE chunk_refs;
         UPDATE meta SET value = '5' WHERE key = 'format';
         PRAGMA user_version = 5;",
    )
    .unwrap();
    for (_, sql) in &triggers {
        conn.execute_batch(&sql.replace("UPDATE chunk_refs SET", "UPDATE chunks SET"))
            .unwrap();
    }
}

/// Turns a current database back into what format-4 code wrote (no
/// snapshots, no history, no `born`).
#[cfg(test)]
pub(crate) fn downgrade_to_v4(conn: &Connection) {
    downgrade_to_v5(conn);
    conn.execute_batch(&crate::snap::drop_triggers_sql())
        .unwrap();
    conn.execute_batch(
        "DROP TABLE snapshots; DROP TABLE inodes_hist; DROP TABLE dirents_hist;
         DROP TABLE xattrs_hist; DROP TABLE extents_hist;
         ALTER TABLE inodes DROP COLUMN born; ALTER TABLE dirents DROP COLUMN born;
         ALTER TABLE xattrs DROP COLUMN born; ALTER TABLE extents DROP COLUMN born;
         DELETE FROM meta WHERE key = 'epoch';
         UPDATE meta SET value = '4' WHERE key = 'format';
         PRAGMA user_version = 4;",
    )
    .unwrap();
}

/// Turns a current database back into what format-2 code wrote (its
/// `dirents` DDL verbatim, `extents_chunk`, no `inodes.parent`), with the
/// entries' ids in an order unrelated to their cookies.
#[cfg(test)]
pub(crate) fn downgrade_to_v2(conn: &Connection) {
    downgrade_to_v4(conn);
    conn.execute_batch(
        "CREATE TABLE dirents_v2 (
            id INTEGER PRIMARY KEY AUTOINCREMENT, parent INTEGER NOT NULL, name BLOB NOT NULL,
            ino INTEGER NOT NULL, UNIQUE (parent, name));
         INSERT INTO dirents_v2 (parent, name, ino)
            SELECT parent, name, ino FROM dirents ORDER BY name DESC;
         DROP TABLE dirents;
         ALTER TABLE dirents_v2 RENAME TO dirents;
         CREATE INDEX dirents_ino ON dirents (ino);
         CREATE INDEX dirents_order ON dirents (parent, id);
         ALTER TABLE inodes DROP COLUMN parent;
         CREATE INDEX extents_chunk ON extents (chunk);
         DROP TRIGGER extents_data_ins;
         DROP TRIGGER extents_data_del;
         DROP TRIGGER extents_data_upd;
         ALTER TABLE inodes DROP COLUMN data;
         UPDATE meta SET value = '2' WHERE key = 'format';
         PRAGMA user_version = 2;",
    )
    .unwrap();
}

#[cfg(test)]
mod plan_tests {
    use super::*;

    /// The query plan of `sql` (parameters bound to small numbers).
    fn plan(conn: &Connection, sql: &str) -> String {
        let mut st = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let n = st.parameter_count();
        let args: Vec<i64> = (0..n as i64).map(|i| i + 5).collect();
        let rows = st
            .query_map(rusqlite::params_from_iter(args), |r| r.get::<_, String>(3))
            .unwrap();
        rows.map(|r| r.unwrap()).collect::<Vec<_>>().join("; ")
    }

    /// readdir walks the primary key from the cookie on and never sorts
    /// the directory; a lookup by name seeks its hash's cookie range.
    #[test]
    fn readdir_and_lookup_seek_the_primary_key() {
        let dir = tempfile::tempdir().unwrap();
        let conn = open_db(&dir.path().join("meta.sqlite"), true).unwrap();
        let p = plan(&conn, crate::ns::READDIR_SQL);
        assert!(
            p.contains("SEARCH d USING PRIMARY KEY (parent=? AND cookie>?)")
                && !p.contains("TEMP B-TREE"),
            "{p}"
        );
        let p = plan(&conn, crate::ns::CHILD_SQL);
        assert!(
            p.contains("USING PRIMARY KEY (parent=? AND cookie>? AND cookie<?)"),
            "{p}"
        );
        let p = plan(&conn, crate::ns::LOOKUP_SQL);
        assert!(
            p.contains("SEARCH d USING PRIMARY KEY (parent=? AND cookie>? AND cookie<?)")
                && p.contains("SEARCH i USING INTEGER PRIMARY KEY (rowid=?)")
                && !p.contains("TEMP B-TREE"),
            "{p}"
        );
    }

    /// A format-2 database (as its code wrote it) becomes format 3 at
    /// open: one table per name, no dropped index left, parents set.
    #[test]
    fn format_2_database_is_migrated_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.sqlite");
        let conn = open_db(&path, true).unwrap();
        conn.execute_batch(
            "INSERT INTO inodes VALUES (1, 2, 493, 0, 0, 3, 0, 0, 0, 0, 0, NULL, NULL, 0, 0),
                (2, 2, 493, 0, 0, 2, 0, 0, 0, 0, 0, NULL, 1, 0, 0),
                (3, 1, 420, 0, 0, 2, 0, 0, 0, 0, 0, NULL, NULL, 0, 0);",
        )
        .unwrap();
        for (parent, name, ino) in [(1, &b"d"[..], 2), (2, b"f", 3), (1, b"g", 3)] {
            crate::ns::insert_dirent(&conn, "dirents", parent, name, ino, 0).unwrap();
        }
        downgrade_to_v2(&conn);
        drop(conn);
        let conn = open_db(&path, false).unwrap();
        let v: u64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(v, META_VERSION);
        let names: Vec<String> = conn
            .prepare("SELECT name FROM sqlite_schema WHERE type = 'index' ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "chunks_container",
                "sqlite_autoindex_meta_1",
                "sqlite_autoindex_snapshots_1"
            ]
        );
        let rows: Vec<(u64, Vec<u8>, u64, i64)> = conn
            .prepare("SELECT parent, name, ino, cookie FROM dirents ORDER BY parent, name")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .map(|r| r.unwrap())
            .collect();
        let want = [(1, &b"d"[..], 2), (1, b"g", 3), (2, b"f", 3)];
        assert_eq!(rows.len(), want.len());
        for ((p, n, i, c), (wp, wn, wi)) in rows.iter().zip(want) {
            assert_eq!(
                (*p, n.as_slice(), *i, *c),
                (wp, wn, wi, crate::ns::name_cookie(wn))
            );
        }
        let parent: Option<u64> = conn
            .query_row("SELECT parent FROM inodes WHERE ino = 2", [], |r| r.get(0))
            .unwrap();
        assert_eq!(parent, Some(1));
        let free: u64 = conn
            .pragma_query_value(None, "freelist_count", |r| r.get(0))
            .unwrap();
        assert_eq!(free, 0, "the migration's freed pages were given back");
        let mode: u64 = conn
            .pragma_query_value(None, "auto_vacuum", |r| r.get(0))
            .unwrap();
        assert_eq!(mode, 2, "auto_vacuum = INCREMENTAL, as in a new store");
    }

    /// fsck's checks count references and links with one grouped pass,
    /// never a scan of a table per row of another.
    #[test]
    fn fsck_counts_are_not_correlated_scans() {
        let dir = tempfile::tempdir().unwrap();
        let conn = open_db(&dir.path().join("meta.sqlite"), true).unwrap();
        for sql in [
            "SELECT c.id, COALESCE(r.refs, -1), COALESCE(n.n, 0) FROM chunks c
             LEFT JOIN chunk_refs r ON r.id = c.id LEFT JOIN (SELECT chunk,
             COUNT(*) n FROM extents GROUP BY chunk) n ON n.chunk = c.id
             WHERE r.refs IS NOT COALESCE(n.n, 0)",
            "SELECT i.ino, i.nlink, COALESCE(n.n, 0) FROM inodes i LEFT JOIN (SELECT ino,
             COUNT(*) n FROM dirents GROUP BY ino) n ON n.ino = i.ino
             WHERE i.kind != 2 AND i.nlink != COALESCE(n.n, 0)",
            "SELECT i.ino, COALESCE(i.parent, 0), d.parent FROM dirents d
             JOIN inodes i ON i.ino = d.ino WHERE i.kind = 2 AND i.parent IS NOT d.parent",
            "UPDATE chunk_refs SET refs = n.n FROM (SELECT chunk, COUNT(*) n FROM extents
             GROUP BY chunk) n WHERE n.chunk = chunk_refs.id",
            "UPDATE inodes SET nlink = n.n FROM (SELECT ino, COUNT(*) n FROM dirents
             GROUP BY ino) n WHERE n.ino = inodes.ino AND inodes.kind != 2",
            "UPDATE inodes SET parent = d.parent FROM dirents d
             WHERE d.ino = inodes.ino AND inodes.kind = 2",
        ] {
            let p = plan(&conn, sql);
            // At most one pass over each of the two tables, and the inner
            // side found by key.
            assert!(
                !p.contains("CORRELATED") && p.matches("SCAN").count() <= 2,
                "{p}"
            );
            assert!(
                p.contains("PRIMARY KEY") || p.contains("COVERING INDEX"),
                "{p}"
            );
        }
    }
}

#[cfg(test)]
mod open_tests {
    use super::*;

    /// An empty file or another program's database where meta.sqlite
    /// should be: not a store, and the file not written (WAL mode was set
    /// on it before anything was checked).
    #[test]
    fn a_foreign_database_is_not_a_store_and_is_left_alone() {
        let d = tempfile::tempdir().unwrap();
        let empty = d.path().join("empty.sqlite");
        std::fs::write(&empty, b"").unwrap();
        let other = d.path().join("other.sqlite");
        Connection::open(&other)
            .unwrap()
            .execute_batch("CREATE TABLE notes (t TEXT); INSERT INTO notes VALUES ('mine');")
            .unwrap();
        for path in [empty, other] {
            let before = std::fs::read(&path).unwrap();
            let e = open_db(&path, false).unwrap_err();
            assert!(matches!(e, StoreError::NotAStore { .. }), "{e}");
            assert_eq!(std::fs::read(&path).unwrap(), before, "{}", path.display());
        }
    }
}
