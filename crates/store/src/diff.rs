//! What changed between two snapshots, from the rows written between
//! their epochs (not a walk of both trees): names added and removed, and
//! files whose content or attributes changed (`atime` aside).

use std::collections::{BTreeMap, HashMap, HashSet};

use rusqlite::{params, Connection};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};
use crate::ns::Kind;
use crate::snap::{self, Snapshot};
use crate::store::Store;
use crate::view::visible;

/// One changed path.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Change {
    /// `+` added, `-` removed, `M` changed (content, attributes, or the
    /// name now naming another file).
    pub what: char,
    /// From the root, `/`-separated, each name [`escaped`]: one change per
    /// line, and names that are not UTF-8 told apart.
    pub path: String,
}

/// Directory entries one epoch sees and the other does not: `(parent,
/// name, ino)` rows with `born <= ?1 < died` (history) or `born <= ?1`
/// (live) and not visible at `?2`.
const ONLY_AT: &str = "
    SELECT parent, name, ino FROM dirents WHERE born <= ?1 AND born > ?2
    UNION ALL SELECT parent, name, ino FROM dirents_hist
        WHERE born <= ?1 AND died > ?1 AND (born > ?2 OR died <= ?2)";

/// Inodes whose row (`inodes`) or content (`extents`, `xattrs`) was
/// written between the epochs `?1 < ?2`, with 1 when the content was.
const REWRITTEN: &str = "
    SELECT ino, MAX(content) FROM (
        SELECT ino, 0 AS content FROM inodes WHERE born > ?1 AND born <= ?2
        UNION ALL SELECT ino, 0 FROM inodes_hist WHERE died > ?1 AND died <= ?2
        UNION ALL SELECT ino, 1 FROM extents WHERE born > ?1 AND born <= ?2
        UNION ALL SELECT ino, 1 FROM extents_hist WHERE died > ?1 AND died <= ?2
        UNION ALL SELECT ino, 1 FROM xattrs WHERE born > ?1 AND born <= ?2
        UNION ALL SELECT ino, 1 FROM xattrs_hist WHERE died > ?1 AND died <= ?2)
    GROUP BY ino";

impl Store {
    /// The changes from snapshot `old` to snapshot `new`, by path.
    pub fn snapshot_diff(&self, old: &str, new: &str) -> Result<Vec<Change>> {
        let g = self.lock();
        let find = |n: &str| {
            snap::find(&g.db, n)?
                .ok_or_else(|| StoreError::BadOption(format!("no snapshot named {n:?}")))
        };
        let (a, b) = (find(old)?, find(new)?);
        let (lo, hi) = if a.epoch <= b.epoch {
            (&a, &b)
        } else {
            (&b, &a)
        };
        let forward = a.epoch <= b.epoch;
        let mut paths = Paths::default();
        let mut out = BTreeMap::new();
        let removed = rows(&g.db, ONLY_AT, lo.epoch, hi.epoch)?;
        let added = rows(&g.db, ONLY_AT, hi.epoch, lo.epoch)?;
        let replaced: HashSet<(u64, Vec<u8>)> = {
            let names: HashSet<_> = removed.iter().map(|r| (r.0, r.1.clone())).collect();
            added
                .iter()
                .map(|r| (r.0, r.1.clone()))
                .filter(|k| names.contains(k))
                .collect()
        };
        let (gone, came) = if forward { ('-', '+') } else { ('+', '-') };
        for (set, view, sign) in [(&removed, lo, gone), (&added, hi, came)] {
            for (parent, name, _) in set {
                let what = match replaced.contains(&(*parent, name.clone())) {
                    true => 'M',
                    false => sign,
                };
                let path = paths.of(&g.db, view, *parent, name)?;
                out.insert(path, what);
            }
        }
        for (parent, name) in changed_names(&g.db, lo, hi)? {
            let path = paths.of(&g.db, hi, parent, &name)?;
            out.entry(path).or_insert('M');
        }
        Ok(out
            .into_iter()
            .map(|(path, what)| Change { what, path })
            .collect())
    }
}

/// `(parent, name, ino)` rows of `sql` for epochs `x`, `y`.
fn rows(db: &Connection, sql: &str, x: u64, y: u64) -> Result<Vec<(u64, Vec<u8>, u64)>> {
    let mut st = db.prepare(sql)?;
    let r = st.query_map(params![x, y], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    Ok(r.collect::<rusqlite::Result<_>>()?)
}

/// The names (in `hi`) of files both snapshots see whose content,
/// xattrs or attributes other than atime differ.
fn changed_names(db: &Connection, lo: &Snapshot, hi: &Snapshot) -> Result<Vec<(u64, Vec<u8>)>> {
    let attrs = "kind, size, perm, uid, gid, mtime_ns, ctime_ns, target";
    let sql = visible("inodes", attrs, "ino = ?1", 2);
    let at = |e: u64, ino: u64| -> Result<Option<Vec<rusqlite::types::Value>>> {
        let mut st = db.prepare_cached(&sql)?;
        let mut rows = st.query(params![ino, e])?;
        Ok(match rows.next()? {
            Some(r) => Some((0..8).map(|i| r.get(i)).collect::<rusqlite::Result<_>>()?),
            None => None,
        })
    };
    let mut changed = HashSet::new();
    let mut st = db.prepare(REWRITTEN)?;
    let inos: Vec<(u64, bool)> = st
        .query_map(params![lo.epoch, hi.epoch], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    for (ino, content) in inos {
        let (x, y) = (at(lo.epoch, ino)?, at(hi.epoch, ino)?);
        let is_dir = y
            .as_ref()
            .is_some_and(|v| v[0] == (Kind::Dir as i64).into());
        if x.is_some() && y.is_some() && (content || x != y) && !is_dir {
            changed.insert(ino);
        }
    }
    if changed.is_empty() {
        return Ok(Vec::new());
    }
    // One pass over the names `hi` sees.
    let mut st = db.prepare(&visible("dirents", "parent, name, ino", "1", 1))?;
    let all = st.query_map([hi.epoch], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    let mut out = Vec::new();
    for r in all {
        let (parent, name, ino): (u64, Vec<u8>, u64) = r?;
        if changed.contains(&ino) {
            out.push((parent, name));
        }
    }
    Ok(out)
}

/// A name as text that gives its bytes back: a backslash, control
/// characters and bytes that are not UTF-8 as `\\`, `\n`, `\t` or `\xNN`
/// (a newline split a line of `snapshot diff` in two, and every invalid
/// byte showed as U+FFFD).
pub fn escaped(name: &[u8]) -> String {
    let mut out = String::with_capacity(name.len());
    for chunk in name.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\t' => out.push_str("\\t"),
                c if c.is_control() && c.is_ascii() => {
                    out.push_str(&format!("\\x{:02x}", c as u32))
                }
                c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
                c => out.push(c),
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// Directory paths as a snapshot sees them, remembered.
#[derive(Default)]
struct Paths {
    dirs: HashMap<(u64, u64), String>,
}

impl Paths {
    /// The path of `parent/name` in `s`.
    fn of(&mut self, db: &Connection, s: &Snapshot, parent: u64, name: &[u8]) -> Result<String> {
        let dir = self.dir(db, s, parent)?;
        let sep = if dir.ends_with('/') { "" } else { "/" };
        Ok(format!("{dir}{sep}{}", escaped(name)))
    }

    /// The path of directory `ino` in `s`.
    fn dir(&mut self, db: &Connection, s: &Snapshot, ino: u64) -> Result<String> {
        if ino == 1 {
            return Ok("/".into());
        }
        if let Some(p) = self.dirs.get(&(s.epoch, ino)) {
            return Ok(p.clone());
        }
        let parent: u64 = db
            .prepare_cached(&visible("inodes", "parent", "ino = ?1", 2))?
            .query_row(params![ino, s.epoch], |r| r.get(0))?;
        // The parent's entries only (its key prefix), not every name.
        let name: Vec<u8> = db
            .prepare_cached(&visible("dirents", "name", "parent = ?1 AND ino = ?2", 3))?
            .query_row(params![parent, ino, s.epoch], |r| r.get(0))?;
        let p = self.of(db, s, parent, &name)?;
        self.dirs.insert((s.epoch, ino), p.clone());
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::escaped;

    #[test]
    fn escaped_names_give_their_bytes_back() {
        assert_eq!(escaped(b"plain name.txt"), "plain name.txt");
        assert_eq!(escaped("caf\u{e9}".as_bytes()), "caf\u{e9}");
        assert_eq!(escaped(b"a\nb\tc\\d"), "a\\nb\\tc\\\\d");
        assert_eq!(escaped(b"bad\xff\x80"), "bad\\xff\\x80");
        assert_eq!(escaped(b"\x01\x7f"), "\\x01\\x7f");
        assert_eq!(escaped("\u{85}".as_bytes()), "\\u{85}");
    }
}
