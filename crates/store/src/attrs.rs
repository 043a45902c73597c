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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::Connection;

use crate::ns::Attr;

/// Entries kept before the map is emptied (about 100 bytes each).
const MAX_ENTRIES: usize = 16_384;

/// The rows, shared with the connection's hooks. The lock is never held
/// while a statement runs (the update hook takes it).
#[derive(Clone, Default)]
pub(crate) struct AttrCache(Arc<Mutex<HashMap<u64, Attr>>>);

impl AttrCache {
    fn map(&self) -> MutexGuard<'_, HashMap<u64, Attr>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serves `db` from now on: its hooks drop what its statements change,
    /// and nothing from an earlier connection is kept.
    pub(crate) fn attach(&self, db: &Connection) {
        let rows = self.clone();
        db.update_hook(Some(
            move |_: rusqlite::hooks::Action, _: &str, table: &str, rowid: i64| {
                if table == "inodes" {
                    rows.map().remove(&(rowid as u64));
                }
            },
        ));
        let rows = self.clone();
        db.rollback_hook(Some(move || rows.clear()));
        self.clear();
    }

    pub(crate) fn get(&self, ino: u64) -> Option<Attr> {
        self.map().get(&ino).copied()
    }

    /// Keeps `a`, which must be its row as it now stands.
    pub(crate) fn put(&self, a: Attr) {
        let mut m = self.map();
        if m.len() >= MAX_ENTRIES {
            m.clear();
        }
        m.insert(a.ino, a);
    }

    pub(crate) fn clear(&self) {
        self.map().clear();
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
    fn a_new_connection_starts_empty_and_the_map_stays_bounded() {
        let c = AttrCache::default();
        for ino in 0..MAX_ENTRIES as u64 + 10 {
            c.put(attr(ino));
        }
        assert!(c.map().len() <= MAX_ENTRIES);
        c.attach(&Connection::open_in_memory().unwrap());
        assert!(c.map().is_empty());
    }
}
