//! Snapshots: read-only views of the whole namespace as it was at one
//! instant, made and deleted in constant time (ARCHITECTURE.md,
//! "Snapshots"; the choice measured in bench/notes/snapshots.md).
//!
//! Invariants:
//! - `meta.epoch` E is the open epoch; a snapshot made now gets epoch E
//!   and E becomes E + 1, in one transaction committed durably.
//! - A live row of `inodes`, `dirents`, `xattrs` or `extents` has `born`
//!   <= the epoch it was last written in; written while snapshots exist,
//!   it has `born` = E (the triggers stamp it).
//! - A row version written in epoch b and changed or deleted in epoch d
//!   is, if b < d, in the table's `_hist` twin as `(born b, died d)`: the
//!   triggers of [`triggers_sql`] copy it before the change, so no
//!   statement of the store has to know about snapshots.
//! - Snapshot s (epoch e) sees a live row with `born <= e`, and a history
//!   row with `born <= e < died`; at most one version of a key matches.
//! - A chunk's `refs` counts its `extents` and `extents_hist` rows: the
//!   copy adds the reference the change then drops.
//! - Deleting a snapshot removes its row only; gc drops the history rows
//!   no kept snapshot sees, with their references, and prune then frees
//!   the chunks only they held.

use rusqlite::types::Value;
use rusqlite::{params, params_from_iter, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};
use crate::store::{time_now, Inner, Store};

/// A kept snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Its number (never reused); its files' inode numbers in a mount
    /// carry it (see [`view_ino`]).
    pub id: u64,
    pub name: String,
    /// The epoch whose end it shows.
    pub epoch: u64,
    /// When it was made (ns since the epoch, the store's clock).
    pub time_ns: i64,
}

/// A snapshot with its sizes (`snapshot list`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotInfo {
    #[serde(flatten)]
    pub snapshot: Snapshot,
    /// Sum of its regular files' sizes.
    pub logical_bytes: u64,
    /// Bytes of the chunks only it holds (as stored): what deleting it
    /// and running gc frees.
    pub exclusive_bytes: u64,
}

/// The namespace tables and how their history copies name them: key
/// columns, then the other columns.
const TABLES: &[(&str, &[&str], &[&str])] = &[
    (
        "inodes",
        &["ino"],
        &[
            "kind", "perm", "uid", "gid", "nlink", "size", "atime_ns", "mtime_ns", "ctime_ns",
            "rdev", "target", "parent", "data",
        ],
    ),
    ("dirents", &["parent", "cookie"], &["name", "ino"]),
    ("xattrs", &["ino", "name"], &["value"]),
    ("extents", &["ino", "off"], &["len", "chunk"]),
];

/// The triggers that keep history while snapshots exist, for open epoch
/// `e`: before a row born before `e` changes or goes, its old version is
/// copied into the `_hist` table with `died = e` (an extent's chunk gains
/// the reference); a row written gets `born = e`.
pub(crate) fn triggers_sql(e: u64) -> String {
    let mut sql = drop_triggers_sql();
    for (t, keys, cols) in TABLES {
        let all: Vec<&str> = keys.iter().chain(cols.iter()).copied().collect();
        let hist_cols = format!("{}, born, died", all.join(", "));
        let old_vals = all
            .iter()
            .map(|c| format!("OLD.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        let copy = format!(
            "INSERT INTO {t}_hist ({hist_cols}) VALUES ({old_vals}, OLD.born, {e});{}",
            if *t == "extents" {
                " UPDATE chunk_refs SET refs = refs + 1 WHERE id = OLD.chunk;"
            } else {
                ""
            }
        );
        let new_key = keys
            .iter()
            .map(|k| format!("{k} = NEW.{k}"))
            .collect::<Vec<_>>()
            .join(" AND ");
        let stamp = format!("UPDATE {t} SET born = {e} WHERE {new_key};");
        sql += &format!(
            "CREATE TRIGGER snap_{t}_upd AFTER UPDATE OF {cols} ON {t} WHEN OLD.born < {e}
                 BEGIN {copy} {stamp} END;
             CREATE TRIGGER snap_{t}_del AFTER DELETE ON {t} WHEN OLD.born < {e}
                 BEGIN {copy} END;
             CREATE TRIGGER snap_{t}_ins AFTER INSERT ON {t} WHEN NEW.born < {e}
                 BEGIN {stamp} END;\n",
            cols = all.join(", "),
        );
    }
    sql
}

/// Drops the history triggers (none left when no snapshot is kept).
pub(crate) fn drop_triggers_sql() -> String {
    let mut sql = String::new();
    for (t, _, _) in TABLES {
        for op in ["upd", "del", "ins"] {
            sql += &format!("DROP TRIGGER IF EXISTS snap_{t}_{op};\n");
        }
    }
    sql
}

/// Bits of an inode number below a snapshot's id (see [`view_ino`]).
pub const VIEW_SHIFT: u32 = 48;

/// The inode number, in a mount, of inode `ino` as snapshot `id` shows
/// it. Live inode numbers stay below 2^48.
pub fn view_ino(id: u64, ino: u64) -> u64 {
    (id << VIEW_SHIFT) | ino
}

/// The snapshot and inode an inode number of a view names, if it is one.
pub fn split_view(ino: u64) -> Option<(u64, u64)> {
    let id = ino >> VIEW_SHIFT;
    (id != 0).then_some((id, ino & ((1 << VIEW_SHIFT) - 1)))
}

/// A snapshot name: 1 to 255 bytes of UTF-8, no `/`, no control
/// character (a newline split `snapshot list`'s lines), not `.` or `..`
/// (it is a directory's name in the mount).
pub fn check_snapshot_name(name: &str) -> Result<()> {
    let bad = name.is_empty()
        || name.len() > 255
        || name == "."
        || name == ".."
        || name.contains('/')
        || name.contains(char::is_control);
    match bad {
        true => Err(StoreError::BadOption(format!(
            "snapshot name {name:?}: 1 to 255 bytes, no '/' or control character, not '.' \
             or '..'"
        ))),
        false => Ok(()),
    }
}

pub(crate) fn epoch(db: &Connection) -> Result<u64> {
    let v: String = db.query_row("SELECT value FROM meta WHERE key = 'epoch'", [], |r| {
        r.get(0)
    })?;
    v.parse().map_err(|_| StoreError::Damaged {
        container: 0,
        offset: 0,
        why: format!("meta.epoch is {v:?}"),
    })
}

fn snapshot_of(r: &rusqlite::Row) -> rusqlite::Result<Snapshot> {
    let name: Vec<u8> = r.get(1)?;
    Ok(Snapshot {
        id: r.get(0)?,
        name: String::from_utf8_lossy(&name).into_owned(),
        epoch: r.get(2)?,
        time_ns: r.get(3)?,
    })
}

/// The kept snapshots, oldest first.
pub(crate) fn list(db: &Connection) -> Result<Vec<Snapshot>> {
    let mut st = db.prepare_cached("SELECT id, name, epoch, time_ns FROM snapshots ORDER BY id")?;
    let rows = st.query_map([], snapshot_of)?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Snapshot `name`, if kept.
pub(crate) fn find(db: &Connection, name: &str) -> Result<Option<Snapshot>> {
    let mut st =
        db.prepare_cached("SELECT id, name, epoch, time_ns FROM snapshots WHERE name = ?1")?;
    Ok(st.query_row([name.as_bytes()], snapshot_of).optional()?)
}

/// Snapshot number `id`, if kept.
pub(crate) fn by_id(db: &Connection, id: u64) -> Result<Option<Snapshot>> {
    let mut st =
        db.prepare_cached("SELECT id, name, epoch, time_ns FROM snapshots WHERE id = ?1")?;
    Ok(st.query_row([id], snapshot_of).optional()?)
}

/// Deletes snapshot `id`'s row (in the open transaction); with none
/// left, the history triggers go too.
pub(crate) fn remove(db: &Connection, id: u64) -> Result<()> {
    db.execute("DELETE FROM snapshots WHERE id = ?1", [id])?;
    let left: u64 = db.query_row("SELECT COUNT(*) FROM snapshots", [], |r| r.get(0))?;
    if left == 0 {
        db.execute_batch(&drop_triggers_sql())?;
    }
    Ok(())
}

impl Store {
    /// Makes snapshot `name` of the whole namespace: everything written to
    /// the store before the call (buffers included) is in it, nothing
    /// written after. Constant time in the number of files (one row, the
    /// epoch, the triggers), plus storing what is buffered.
    pub fn snapshot_create(&self, name: &str) -> Result<Snapshot> {
        check_snapshot_name(name)?;
        // Most buffered data outside the lock, the rest under it.
        self.flush_all(false)?;
        let mut g = self.lock();
        if find(&g.db, name)?.is_some() {
            return Err(StoreError::AlreadyExists);
        }
        let inos: Vec<u64> = g.dirty.keys().copied().collect();
        for ino in inos {
            self.flush_file_locked(&mut g, ino)?;
        }
        let last: u64 = g.db.query_row(
            "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'snapshots'), 0)",
            [],
            |r| r.get(0),
        )?;
        if last + 1 >= crate::view::VIRTUAL_ID {
            return Err(StoreError::BadOption(format!(
                "{last} snapshots were made in this store, the most it numbers"
            )));
        }
        let e = epoch(&g.db)?;
        let time_ns = time_now();
        g.db.execute(
            "INSERT INTO snapshots (name, epoch, time_ns) VALUES (?1, ?2, ?3)",
            params![name.as_bytes(), e, time_ns],
        )?;
        let id = g.db.last_insert_rowid() as u64;
        g.db.execute(
            "UPDATE meta SET value = ?1 WHERE key = 'epoch'",
            [(e + 1).to_string()],
        )?;
        g.db.execute_batch(&triggers_sql(e + 1))?;
        g.epoch = e + 1;
        if let Err(err) = self.commit_locked(&mut g, true) {
            g.epoch = epoch(&g.db)?;
            return Err(err);
        }
        Ok(Snapshot {
            id,
            name: name.into(),
            epoch: e,
            time_ns,
        })
    }

    /// The inode number of snapshot `name`'s root (to serve it alone).
    pub fn snapshot_root(&self, name: &str) -> Result<u64> {
        let s = find(&self.lock().db, name)?.ok_or(StoreError::NotFound)?;
        Ok(view_ino(s.id, 1))
    }

    /// Deletes snapshot `name` (constant time: its row; gc frees what
    /// only it held).
    pub fn snapshot_delete(&self, name: &str) -> Result<Snapshot> {
        let mut g = self.lock();
        let s = find(&g.db, name)?.ok_or(StoreError::NotFound)?;
        remove(&g.db, s.id)?;
        self.commit_locked(&mut g, true)?;
        Ok(s)
    }

    /// The kept snapshots with their sizes, oldest first.
    pub fn snapshot_list(&self) -> Result<Vec<SnapshotInfo>> {
        let g = self.lock();
        let all = list(&g.db)?;
        all.iter()
            .map(|s| {
                Ok(SnapshotInfo {
                    snapshot: s.clone(),
                    logical_bytes: logical_bytes(&g.db, s.epoch)?,
                    exclusive_bytes: exclusive_bytes(&g.db, s.epoch)?,
                })
            })
            .collect()
    }

    /// Drops, in batches each its own transaction, the history rows no
    /// kept snapshot sees, with their chunks' references (gc, before
    /// prune). Each batch looks at the next [`RECLAIM_BATCH`] rows in key
    /// order after the last one seen, so a pass reads each row once
    /// however many are kept. Returns the rows dropped.
    pub(crate) fn reclaim_history(&self) -> Result<u64> {
        let mut n = 0;
        for (t, keys, _) in TABLES {
            let mut after = None;
            loop {
                let mut g = self.lock();
                let (k, last) = reclaim_batch(&mut g, t, keys, after.as_deref())?;
                self.commit_locked(&mut g, false)?;
                n += k;
                match last {
                    Some(last) => after = Some(last),
                    None => break,
                }
            }
        }
        Ok(n)
    }
}

/// History rows looked at per transaction.
#[cfg(not(test))]
const RECLAIM_BATCH: u64 = 4096;
/// Small in tests, so that a pass takes several batches.
#[cfg(test)]
const RECLAIM_BATCH: u64 = 3;

/// A history row no kept snapshot sees (SQL condition on table `h`).
const UNSEEN: &str = "NOT EXISTS (SELECT 1 FROM snapshots s
    WHERE s.epoch >= h.born AND s.epoch < h.died)";

/// Looks at the next [`RECLAIM_BATCH`] rows of `t`'s history after key
/// `after` (key columns then `born`) and drops those no kept snapshot
/// sees; returns how many, and the last key looked at (`None`: the table
/// is done).
fn reclaim_batch(
    g: &mut Inner,
    t: &str,
    keys: &[&str],
    after: Option<&[Value]>,
) -> Result<(u64, Option<Vec<Value>>)> {
    let cols = format!("{}, born", keys.join(", "));
    let marks = vec!["?"; keys.len() + 1].join(", ");
    let from = match after {
        Some(_) => format!("({cols}) > ({marks})"),
        None => "1".into(),
    };
    let window =
        format!("SELECT {cols} FROM {t}_hist WHERE {from} ORDER BY {cols} LIMIT {RECLAIM_BATCH}");
    let args = after.unwrap_or_default();
    let last: Option<Vec<Value>> = {
        let desc = cols.replace(',', " DESC,") + " DESC";
        let sql = format!("SELECT {cols} FROM ({window}) ORDER BY {desc} LIMIT 1");
        let mut st = g.db.prepare_cached(&sql)?;
        let n = keys.len() + 1;
        st.query_row(params_from_iter(args), |r| {
            (0..n).map(|i| r.get(i)).collect()
        })
        .optional()?
    };
    if last.is_none() {
        return Ok((0, None));
    }
    let dead = |sel: &str| {
        format!("SELECT {sel} FROM {t}_hist h WHERE ({cols}) IN ({window}) AND {UNSEEN}")
    };
    if t == "extents" {
        let sql = format!(
            "UPDATE chunk_refs SET refs = refs - n.n FROM (SELECT chunk, COUNT(*) n
                 FROM ({}) GROUP BY chunk) n WHERE n.chunk = chunk_refs.id",
            dead("chunk")
        );
        g.db.execute(&sql, params_from_iter(args))?;
    }
    let sql = format!("DELETE FROM {t}_hist WHERE ({cols}) IN ({})", dead(&cols));
    let n = g.db.execute(&sql, params_from_iter(args))? as u64;
    Ok((n, last))
}

/// Sum of the sizes of the regular files snapshot epoch `e` sees.
fn logical_bytes(db: &Connection, e: u64) -> Result<u64> {
    let sql = "SELECT COALESCE(SUM(size), 0) FROM (
        SELECT size, kind FROM inodes WHERE born <= ?1 AND nlink > 0
        UNION ALL SELECT size, kind FROM inodes_hist WHERE born <= ?1 AND died > ?1
            AND nlink > 0) WHERE kind = 1";
    Ok(db.query_row(sql, [e], |r| r.get::<_, i64>(0))?.max(0) as u64)
}

/// Stored bytes of the chunks referenced only by history rows that
/// snapshot epoch `e` sees and no other kept snapshot does (one pass over
/// the history, grouped by chunk).
fn exclusive_bytes(db: &Connection, e: u64) -> Result<u64> {
    let only_e = "h.born <= ?1 AND h.died > ?1 AND NOT EXISTS (SELECT 1 FROM snapshots s
        WHERE s.epoch != ?1 AND s.epoch >= h.born AND s.epoch < h.died)";
    only_held_by(db, only_e, [e])
}

/// Stored bytes of the chunks all of whose references are history rows
/// matching `cond` (on `h`, with `args`); a chunk in a pack counts its
/// share ([`crate::chunks::STORED_SHARE`]).
fn only_held_by(db: &Connection, cond: &str, args: impl rusqlite::Params) -> Result<u64> {
    let sql = format!(
        "SELECT COALESCE(SUM({}), 0) FROM chunks c JOIN (SELECT chunk, COUNT(*) n
             FROM extents_hist h WHERE {cond} GROUP BY chunk) u ON u.chunk = c.id
             JOIN chunk_refs r ON r.id = c.id
         WHERE r.refs = u.n",
        crate::chunks::STORED_SHARE
    );
    Ok(db.query_row(&sql, args, |r| r.get::<_, i64>(0))?.max(0) as u64)
}

/// Stored bytes gc would free now: the chunks only history rows no kept
/// snapshot sees hold.
pub(crate) fn reclaimable_bytes(db: &Connection) -> Result<u64> {
    only_held_by(db, UNSEEN, [])
}

#[cfg(test)]
mod name_tests {
    use super::check_snapshot_name;

    /// Names that cannot be a directory's name in the mount, or that
    /// would split a line of `snapshot list`, are refused.
    #[test]
    fn snapshot_names() {
        for good in ["daily-2026-12-07", "a b", "é", &"x".repeat(255)] {
            check_snapshot_name(good).unwrap();
        }
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "nl\nname",
            "tab\there",
            "nul\0",
            &"x".repeat(256),
        ] {
            assert!(check_snapshot_name(bad).is_err(), "{bad:?}");
        }
    }
}
