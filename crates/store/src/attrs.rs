//! Copies of `inodes` rows kept in memory: a small file through the mount
//! is about ten requests, and nearly each one read its inode's row again
//! (`SELECT ... FROM inodes WHERE ino = ?`, a dozen a file: 9% of the
//! mount's CPU in `cp -a` of small files).
//!
//! Invariant: an entry equals its row as the store's connection sees it.
//! - SQLite's update hook drops the entry of every `inodes` row any
//!   statement or trigger inserts, updates or deletes, as it happens.
//! - The rollback hook drops them all; so do the store's own partial
//!   rollbacks (`ROLLBACK TO`, [`AttrCache::clear`]) and a new connection
//!   ([`AttrCache::attach`]).
//! - An entry is put only from a row just read, or from the values a
//!   statement that just succeeded wrote (write-through, so the next
//!   request does not read back what the last one wrote).
//!
//! Debug builds check every hit against the row.
//!
//! Snapshots' rows are kept here too, by view inode number (`snap.rs`:
//! above 2^48, never a live row's), with the kept snapshots' epochs,
//! whether each holds any extended attribute, and their files' extended
//! attribute names: a snapshot never changes, so
//! these entries go only when the `snapshots` table changes (a snapshot
//! made or deleted), on a rollback, and with a new connection. Reading
//! a file out of a snapshot asked SQLite for its snapshot, its row and
//! its attribute names on every request (perf of a cold `cp -a` out of
//! one: the snapshot's row 8% and the attribute requests 11% of the
//! mount's samples; 3% are left, each inode's first listing).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::Connection;

use crate::ns::Attr;
use crate::view::is_read_only;

/// Entries kept before the map is emptied (about 100 bytes each).
const MAX_ENTRIES: usize = 16_384;

/// What is kept (see the module's doc for when each entry goes).
#[derive(Default)]
struct Rows {
    /// Live rows by inode number, snapshots' rows by view inode number.
    attrs: HashMap<u64, Attr>,
    /// Kept snapshots' epochs by snapshot id.
    epochs: HashMap<u64, u64>,
    /// Extended attribute names by view inode number, in name order.
    xattr_names: HashMap<u64, Vec<Vec<u8>>>,
    /// Whether a kept snapshot holds any extended attribute, by id.
    xattrs_any: HashMap<u64, bool>,
}

impl Rows {
    fn clear(&mut self) {
        self.attrs.clear();
        self.epochs.clear();
        self.xattr_names.clear();
        self.xattrs_any.clear();
    }

    /// Forgets everything of snapshots (their table changed).
    fn clear_views(&mut self) {
        self.attrs.retain(|&ino, _| !is_read_only(ino));
        self.epochs.clear();
        self.xattr_names.clear();
        self.xattrs_any.clear();
    }
}

/// The rows, shared with the connection's hooks. The lock is never held
/// while a statement runs (the update hook takes it).
#[derive(Clone, Default)]
pub(crate) struct AttrCache(Arc<Mutex<Rows>>);

impl AttrCache {
    fn map(&self) -> MutexGuard<'_, Rows> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serves `db` from now on: its hooks drop what its statements change,
    /// and nothing from an earlier connection is kept.
    pub(crate) fn attach(&self, db: &Connection) {
        let rows = self.clone();
        db.update_hook(Some(
            move |_: rusqlite::hooks::Action, _: &str, table: &str, rowid: i64| match table {
                "inodes" => drop(rows.map().attrs.remove(&(rowid as u64))),
                "snapshots" => rows.map().clear_views(),
                _ => {}
            },
        ));
        let rows = self.clone();
        db.rollback_hook(Some(move || rows.clear()));
        self.clear();
    }

    pub(crate) fn get(&self, ino: u64) -> Option<Attr> {
        self.map().attrs.get(&ino).copied()
    }

    /// Keeps `a`, which must be its row as it now stands (a view
    /// inode's: as its snapshot shows it).
    pub(crate) fn put(&self, a: Attr) {
        let mut m = self.map();
        if m.attrs.len() >= MAX_ENTRIES {
            m.attrs.clear();
        }
        m.attrs.insert(a.ino, a);
    }

    /// The epoch of kept snapshot `id`, if known.
    pub(crate) fn epoch(&self, id: u64) -> Option<u64> {
        self.map().epochs.get(&id).copied()
    }

    /// Keeps snapshot `id`'s epoch, just read from its row.
    pub(crate) fn put_epoch(&self, id: u64, epoch: u64) {
        self.map().epochs.insert(id, epoch);
    }

    /// The extended attribute names of view inode `ino`, if known.
    pub(crate) fn xattr_names(&self, ino: u64) -> Option<Vec<Vec<u8>>> {
        self.map().xattr_names.get(&ino).cloned()
    }

    /// Keeps view inode `ino`'s attribute names, just read.
    pub(crate) fn put_xattr_names(&self, ino: u64, names: &[Vec<u8>]) {
        let mut m = self.map();
        if m.xattr_names.len() >= MAX_ENTRIES {
            m.xattr_names.clear();
        }
        m.xattr_names.insert(ino, names.to_vec());
    }

    /// Whether kept snapshot `id` holds any extended attribute, if known.
    pub(crate) fn xattrs_any(&self, id: u64) -> Option<bool> {
        self.map().xattrs_any.get(&id).copied()
    }

    /// Keeps whether snapshot `id` holds any extended attribute, just read.
    pub(crate) fn put_xattrs_any(&self, id: u64, any: bool) {
        self.map().xattrs_any.insert(id, any);
    }

    pub(crate) fn clear(&self) {
        self.map().clear();
    }

    /// How many snapshots' rows and epochs are kept.
    #[cfg(test)]
    fn views_kept(&self) -> usize {
        let m = self.map();
        m.attrs.keys().filter(|&&i| is_read_only(i)).count() + m.epochs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(ino: u64) -> Attr {
        Attr {
            ino,
            nlink: 1,
            ..Attr::ZERO
        }
    }

    #[test]
    fn statements_and_triggers_drop_what_they_change() {
        let db = Connection::open_in_memory().unwrap();
        db.execute_batch(
            "CREATE TABLE inodes (ino INTEGER PRIMARY KEY, size INTEGER);
             CREATE TABLE extents (ino INTEGER, len INTEGER);
             CREATE TRIGGER grow AFTER INSERT ON extents BEGIN
               UPDATE inodes SET size = size + NEW.len WHERE ino = NEW.ino; END;
             INSERT INTO inodes VALUES (1, 0), (2, 0), (3, 0);",
        )
        .unwrap();
        let c = AttrCache::default();
        c.attach(&db);
        for ino in 1..=3 {
            c.put(attr(ino));
        }
        db.execute("UPDATE inodes SET size = 5 WHERE ino = 1", [])
            .unwrap();
        assert!(c.get(1).is_none());
        db.execute("INSERT INTO extents VALUES (2, 7)", []).unwrap();
        assert!(c.get(2).is_none(), "a trigger's update drops the row too");
        assert!(c.get(3).is_some());
        db.execute_batch("BEGIN; DELETE FROM extents; ROLLBACK")
            .unwrap();
        assert!(c.get(3).is_none(), "a rollback drops every row");
    }

    #[test]
    fn a_change_to_the_snapshots_table_drops_every_view_entry() {
        let db = Connection::open_in_memory().unwrap();
        db.execute_batch(
            "CREATE TABLE inodes (ino INTEGER PRIMARY KEY);
             CREATE TABLE snapshots (id INTEGER PRIMARY KEY, epoch INTEGER);
             INSERT INTO snapshots VALUES (1, 4);",
        )
        .unwrap();
        let c = AttrCache::default();
        c.attach(&db);
        let view = crate::snap::view_ino(1, 5);
        c.put(attr(5));
        c.put(attr(view));
        c.put_epoch(1, 4);
        c.put_xattr_names(view, &[b"user.a".to_vec()]);
        db.execute("UPDATE inodes SET ino = 6 WHERE ino = 7", [])
            .unwrap();
        assert_eq!(c.views_kept(), 2, "other tables leave views alone");
        db.execute("INSERT INTO snapshots VALUES (2, 9)", [])
            .unwrap();
        assert_eq!(c.views_kept(), 0);
        assert!(c.xattr_names(view).is_none());
        assert!(c.get(5).is_some(), "live rows stay");
    }

    #[test]
    fn a_new_connection_starts_empty_and_the_map_stays_bounded() {
        let c = AttrCache::default();
        for ino in 0..MAX_ENTRIES as u64 + 10 {
            c.put(attr(ino));
        }
        assert!(c.map().attrs.len() <= MAX_ENTRIES);
        c.attach(&Connection::open_in_memory().unwrap());
        assert!(c.map().attrs.is_empty());
    }
}
