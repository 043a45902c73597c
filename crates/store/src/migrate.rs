//! Migrations of `meta.sqlite` from older formats, frozen: each upgrade
//! spells out its own SQL and the scheme of the format it writes, and
//! calls nothing the live store may change later (a change to, say, how
//! directory entries are keyed must not change what an old migration
//! does). The live code may use a frozen definition while its format is
//! current (`V4_*`), and gets its own when the format moves on.

use rusqlite::{params, Connection};

use crate::error::{Result, StoreError};

/// Invariant: `inodes.data = SUM(extents.len)` of the inode, whatever
/// statement adds or removes an extent (a write's flush, a truncate, a
/// punched hole, import, unlink, fsck's repairs), in the same transaction.
pub(crate) const V4_DATA_TRIGGERS: &str = "
CREATE TRIGGER extents_data_ins AFTER INSERT ON extents BEGIN
    UPDATE inodes SET data = data + NEW.len WHERE ino = NEW.ino; END;
CREATE TRIGGER extents_data_del AFTER DELETE ON extents BEGIN
    UPDATE inodes SET data = data - OLD.len WHERE ino = OLD.ino; END;
CREATE TRIGGER extents_data_upd AFTER UPDATE OF ino, len ON extents BEGIN
    UPDATE inodes SET data = data - OLD.len WHERE ino = OLD.ino;
    UPDATE inodes SET data = data + NEW.len WHERE ino = NEW.ino; END;
";

/// Format 5: snapshots. Each namespace row carries `born`, the epoch it
/// was last written in; a row a snapshot may see is copied, before it
/// changes or goes, into its table's `_hist` twin with `died`, the epoch
/// of the change (the copying triggers exist only while snapshots do; see
/// `snap.rs`). `meta.epoch` is the open epoch. A store made at format 5
/// runs these after the format-4 schema too.
pub(crate) const V5_SNAPSHOTS: &str = "
ALTER TABLE inodes ADD COLUMN born INTEGER NOT NULL DEFAULT 0;
ALTER TABLE dirents ADD COLUMN born INTEGER NOT NULL DEFAULT 0;
ALTER TABLE xattrs ADD COLUMN born INTEGER NOT NULL DEFAULT 0;
ALTER TABLE extents ADD COLUMN born INTEGER NOT NULL DEFAULT 0;
CREATE TABLE snapshots (id INTEGER PRIMARY KEY AUTOINCREMENT, name BLOB NOT NULL UNIQUE,
    epoch INTEGER NOT NULL, time_ns INTEGER NOT NULL);
CREATE TABLE inodes_hist (ino INTEGER NOT NULL, born INTEGER NOT NULL, died INTEGER NOT NULL,
    kind INTEGER NOT NULL, perm INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
    nlink INTEGER NOT NULL, size INTEGER NOT NULL, atime_ns INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL, rdev INTEGER NOT NULL, target BLOB,
    parent INTEGER, data INTEGER NOT NULL, PRIMARY KEY (ino, born)) WITHOUT ROWID;
CREATE TABLE dirents_hist (parent INTEGER NOT NULL, cookie INTEGER NOT NULL,
    born INTEGER NOT NULL, died INTEGER NOT NULL, name BLOB NOT NULL, ino INTEGER NOT NULL,
    PRIMARY KEY (parent, cookie, born)) WITHOUT ROWID;
CREATE TABLE xattrs_hist (ino INTEGER NOT NULL, name BLOB NOT NULL, born INTEGER NOT NULL,
    died INTEGER NOT NULL, value BLOB NOT NULL, PRIMARY KEY (ino, name, born)) WITHOUT ROWID;
CREATE TABLE extents_hist (ino INTEGER NOT NULL, off INTEGER NOT NULL, born INTEGER NOT NULL,
    died INTEGER NOT NULL, len INTEGER NOT NULL, chunk INTEGER NOT NULL,
    PRIMARY KEY (ino, off, born)) WITHOUT ROWID;
INSERT OR IGNORE INTO meta (key, value) VALUES ('epoch', '0');
";

/// Format 6: reference counts in their own narrow table, `chunk_refs`
/// (one row per `chunks` row, same id). A copy inside the store adds a
/// reference to every chunk it shares: for 65,536 chunks the counts
/// fill 142 pages here against 886 for `chunks` (a 4 GiB copy's update
/// 27-39 ms against 41-55, bench/notes/snapshots.md). A store made at
/// format 6 runs this after the format-5 schema too.
pub(crate) const V6_CHUNK_REFS: &str = "
CREATE TABLE chunk_refs (id INTEGER PRIMARY KEY, refs INTEGER NOT NULL);
INSERT INTO chunk_refs (id, refs) SELECT id, refs FROM chunks;
ALTER TABLE chunks DROP COLUMN refs;
";

/// Format 7: a chunk may share a record (a pack) with others, at
/// `inner` in its decoded bytes of `pack_raw`; both NULL for a chunk
/// alone in its record.
pub(crate) const V7_PACKS: &str = "
ALTER TABLE chunks ADD COLUMN inner INTEGER;
ALTER TABLE chunks ADD COLUMN pack_raw INTEGER;
";

/// Format 6 to 7, in one transaction: [`V7_PACKS`] (columns added
/// with no default: no row is rewritten).
pub(crate) fn v6_to_v7(conn: &Connection) -> Result<()> {
    in_transaction(
        conn,
        &format!(
            "{V7_PACKS}
             UPDATE meta SET value = '7' WHERE key = 'format';
             PRAGMA user_version = 7;"
        ),
    )
}

/// The statement format-5 history triggers run to give a chunk the
/// reference of an extent moved to history, and its format-6 spelling.
const V5_HIST_INCREF: &str = "UPDATE chunks SET refs = refs + 1 WHERE id = OLD.chunk;";
const V6_HIST_INCREF: &str = "UPDATE chunk_refs SET refs = refs + 1 WHERE id = OLD.chunk;";

/// Format 5 to 6, in one transaction: [`V6_CHUNK_REFS`] (the `chunks`
/// table is rewritten once without `refs`). The history triggers that
/// exist while snapshots are kept name `chunks.refs`, which SQLite will
/// not drop under them: they are dropped first and made again, their
/// text as stored with the reference update re-aimed at `chunk_refs`.
pub(crate) fn v5_to_v6(conn: &Connection) -> Result<()> {
    in_transaction_with(conn, v5_to_v6_body)
}

/// [`v5_to_v6`]'s statements, inside its transaction.
fn v5_to_v6_body(conn: &Connection) -> Result<()> {
    let triggers: Vec<(String, String)> = {
        let mut st = conn.prepare(
            "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND instr(sql, ?1) > 0",
        )?;
        let rows = st.query_map([V5_HIST_INCREF], |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    for (name, _) in &triggers {
        conn.execute_batch(&format!("DROP TRIGGER \"{name}\";"))?;
    }
    conn.execute_batch(V6_CHUNK_REFS)?;
    for (_, sql) in &triggers {
        conn.execute_batch(&sql.replace(V5_HIST_INCREF, V6_HIST_INCREF))?;
    }
    conn.execute_batch(
        "UPDATE meta SET value = '6' WHERE key = 'format';
         PRAGMA user_version = 6;",
    )?;
    Ok(())
}

/// Format 4 to 5, in one transaction: [`V5_SNAPSHOTS`] (columns added
/// with a default: no row is rewritten).
pub(crate) fn v4_to_v5(conn: &Connection) -> Result<()> {
    in_transaction(
        conn,
        &format!(
            "{V5_SNAPSHOTS}
             UPDATE meta SET value = '5' WHERE key = 'format';
             PRAGMA user_version = 5;"
        ),
    )
}

/// Runs `body` in one transaction, rolled back whole if it fails.
fn in_transaction_with(conn: &Connection, body: fn(&Connection) -> Result<()>) -> Result<()> {
    conn.execute_batch("BEGIN")?;
    let r = body(conn).and_then(|()| Ok(conn.execute_batch("COMMIT")?));
    if r.is_err() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    r
}

/// Runs `sql` in one transaction, rolled back whole if any statement
/// fails (each migration step is one).
fn in_transaction(conn: &Connection, sql: &str) -> Result<()> {
    conn.execute_batch(&format!("BEGIN; {sql} COMMIT;"))
        .inspect_err(|_| {
            let _ = conn.execute_batch("ROLLBACK");
        })?;
    Ok(())
}

/// Sets every `inodes.data` from the file map in one grouped pass (the
/// migration to format 4, and fsck's repair of a wrong count in a
/// format-4 store).
pub(crate) const V4_RECOMPUTE_DATA: &str = "
UPDATE inodes SET data = 0;
UPDATE inodes SET data = n.n FROM (SELECT ino, SUM(len) n FROM extents GROUP BY ino) n
    WHERE n.ino = inodes.ino;
";

/// Format 1 to 2, in one transaction: `chunks` is rebuilt without the
/// UNIQUE constraint on `hash` (its automatic index cannot be dropped
/// alone) and with `indexed`, keeping ids and the AUTOINCREMENT counter;
/// `index_drops` is created. The fingerprint index is then built at open
/// from every row (its watermark, `index_synced`, is absent: 0).
pub(crate) fn v1_to_v2(conn: &Connection) -> Result<()> {
    in_transaction(
        conn,
        "CREATE TABLE chunks_v2 (
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
         PRAGMA user_version = 2;",
    )
}

/// Format 2 to 3, in one transaction: `dirents` is rebuilt as a WITHOUT
/// ROWID table keyed by `(parent, cookie)` (each name stored once instead
/// of in the table and in the index of `UNIQUE (parent, name)`; the
/// `dirents_ino` and `dirents_order` indexes go with the old table),
/// directories get `inodes.parent`, and `extents_chunk` is dropped. Then
/// the file is rewritten once (`VACUUM`) without the pages this freed and
/// with `auto_vacuum = INCREMENTAL`, as a new store has.
pub(crate) fn v2_to_v3(conn: &Connection) -> Result<()> {
    in_transaction_with(conn, v2_to_v3_body)?;
    let r = conn.execute_batch(
        "PRAGMA auto_vacuum = INCREMENTAL; VACUUM; PRAGMA wal_checkpoint(TRUNCATE);",
    );
    if let Err(e) = r {
        // Still correct, only larger.
        crate::warn!("onecopy: could not compact the metadata database: {e}");
    }
    Ok(())
}

/// [`v2_to_v3`]'s statements, inside its transaction.
fn v2_to_v3_body(conn: &Connection) -> Result<()> {
    conn.execute_batch(
        "CREATE TABLE dirents_v3 (parent INTEGER NOT NULL, cookie INTEGER NOT NULL,
            name BLOB NOT NULL, ino INTEGER NOT NULL, PRIMARY KEY (parent, cookie)) WITHOUT ROWID;
         ALTER TABLE inodes ADD COLUMN parent INTEGER;
         CREATE INDEX IF NOT EXISTS dirents_ino ON dirents (ino);
         UPDATE inodes SET parent = (SELECT d.parent FROM dirents d WHERE d.ino = inodes.ino
            LIMIT 1) WHERE kind = 2 AND ino != 1;",
    )?;
    {
        let mut st = conn.prepare("SELECT parent, name, ino FROM dirents ORDER BY parent, id")?;
        let mut rows = st.query([])?;
        while let Some(r) = rows.next()? {
            let (parent, name, ino): (u64, Vec<u8>, u64) = (r.get(0)?, r.get(1)?, r.get(2)?);
            v3_insert_dirent(conn, parent, &name, ino)?;
        }
    }
    conn.execute_batch(
        "DROP TABLE dirents;
         ALTER TABLE dirents_v3 RENAME TO dirents;
         DROP INDEX IF EXISTS extents_chunk;
         UPDATE meta SET value = '3' WHERE key = 'format';
         PRAGMA user_version = 3;",
    )?;
    Ok(())
}

/// Format 3 to 4, in one transaction: `inodes.data` is added, filled
/// from each file's extents (one pass over `extents`), and kept by
/// [`V4_DATA_TRIGGERS`] from then on.
pub(crate) fn v3_to_v4(conn: &Connection) -> Result<()> {
    in_transaction(
        conn,
        &format!(
            "ALTER TABLE inodes ADD COLUMN data INTEGER NOT NULL DEFAULT 0;
             {V4_RECOMPUTE_DATA}
             {V4_DATA_TRIGGERS}
             UPDATE meta SET value = '4' WHERE key = 'format';
             PRAGMA user_version = 4;"
        ),
    )
}

/// The first cookie of `name` in format 3 (and 4): 31 bits of its BLAKE3
/// shifted left by 16 (see `ns::name_cookie`, the live scheme).
fn v3_name_cookie(name: &[u8]) -> i64 {
    let h = blake3::hash(name);
    let v = u32::from_le_bytes(h.as_bytes()[..4].try_into().expect("4 bytes"));
    (i64::from(v >> 1)) << 16
}

/// Inserts `parent/name -> ino` into format 3's `dirents_v3` with the
/// lowest free cookie of the name's 65,536-cookie range.
fn v3_insert_dirent(conn: &Connection, parent: u64, name: &[u8], ino: u64) -> Result<()> {
    let base = v3_name_cookie(name);
    let taken: Vec<i64> = {
        let mut st = conn.prepare_cached(
            "SELECT cookie FROM dirents_v3 WHERE parent = ?1 AND cookie BETWEEN ?2 AND ?2 + 65535
             ORDER BY cookie",
        )?;
        let rows = st.query_map(params![parent, base], |r| r.get(0))?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    let cookie = (base..base + (1 << 16))
        .find(|c| taken.binary_search(c).is_err())
        .ok_or(StoreError::NoSpace)?;
    conn.prepare_cached(
        "INSERT INTO dirents_v3 (parent, cookie, name, ino) VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute(params![parent, cookie, name, ino])?;
    Ok(())
}
