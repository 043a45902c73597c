//! Reading snapshots through the store's inode-number API. A mount shows
//! them under `/.onecopy/snapshots/NAME` (hidden: the root's listing does
//! not name `.onecopy`, so `cp -a`, `rsync`, `find` and `du` of the mount
//! do not walk every snapshot), read-only.
//!
//! Inode numbers: a live inode keeps its number (below 2^48); inode `i`
//! as snapshot `id` shows it is `id << 48 | i` ([`view_ino`]); the two
//! directories above the snapshots use id [`VIRTUAL_ID`]. A view's rows
//! are the live rows born at or before its epoch and the history rows
//! alive at it (`snap.rs`).

use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::data::ReadBuf;
use crate::error::{Result, StoreError};
use crate::ns::{self, name_cookie, Attr, DirEntry, Kind};
use crate::snap::{self, split_view, view_ino};
use crate::store::{Inner, Store};

/// The id standing for the virtual directories (no snapshot gets it).
pub const VIRTUAL_ID: u64 = 0xFFFF;
/// `/.onecopy`.
pub const META_DIR_INO: u64 = VIRTUAL_ID << snap::VIEW_SHIFT | 1;
/// `/.onecopy/snapshots`.
pub const SNAPSHOTS_DIR_INO: u64 = VIRTUAL_ID << snap::VIEW_SHIFT | 2;
/// The name of the hidden directory at the root.
pub const META_DIR_NAME: &[u8] = b".onecopy";

/// What an inode number names.
enum Node {
    Live(u64),
    MetaDir,
    SnapshotsDir,
    /// Inode `ino` as a kept snapshot shows it.
    View(At, u64),
}

/// A kept snapshot, as its views need it.
#[derive(Clone, Copy)]
struct At {
    id: u64,
    epoch: u64,
}

/// Whose extent rows a copy shares: live inode `ino`'s, or (`epoch`) the
/// ones a snapshot at that epoch sees for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Source {
    pub ino: u64,
    pub epoch: Option<u64>,
}

/// Whether `ino` is a snapshot's or a virtual directory's (read-only).
pub fn is_read_only(ino: u64) -> bool {
    split_view(ino).is_some()
}

/// Whether `parent/name` is the reserved `/.onecopy`.
pub(crate) fn is_reserved(parent: u64, name: &[u8]) -> bool {
    parent == 1 && name == META_DIR_NAME
}

/// An attribute row of inode `ino` as snapshot `id` shows it, from the
/// [`ns::ATTR_COLS`] starting at column `at`.
fn attr_of(r: &Row, id: u64, at: usize) -> rusqlite::Result<Attr> {
    let a = ns::attr_at(r, at)?;
    Ok(Attr {
        ino: view_ino(id, a.ino),
        ..a
    })
}

/// A statement's text built once: a view's statements are fixed, and
/// building them on every request cost a cold `cp -a` out of a
/// snapshot 1-2% of the mount's samples in `format!` alone.
macro_rules! once {
    ($e:expr) => {{
        static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| $e);
        SQL.as_str()
    }};
}
pub(crate) use once;

/// `SELECT cols` of table `t` restricted by `cond`, as epoch `?E` sees it
/// (`e` is the parameter's number).
pub(crate) fn visible(t: &str, cols: &str, cond: &str, e: usize) -> String {
    format!(
        "SELECT {cols} FROM {t} WHERE {cond} AND born <= ?{e}
         UNION ALL SELECT {cols} FROM {t}_hist WHERE {cond} AND born <= ?{e} AND died > ?{e}"
    )
}

/// Inode `ino`'s attributes as snapshot `s` shows them (kept in
/// `g.attrs`: a snapshot never changes).
fn view_attr(g: &Inner, s: At, ino: u64) -> Result<Attr> {
    if let Some(a) = g.attrs.get(view_ino(s.id, ino)) {
        debug_assert_eq!(
            view_attr_row(&g.db, s, ino).ok(),
            Some(a),
            "cached view row"
        );
        return Ok(a);
    }
    let a = view_attr_row(&g.db, s, ino)?;
    g.attrs.put(a);
    Ok(a)
}

fn view_attr_row(db: &Connection, s: At, ino: u64) -> Result<Attr> {
    let sql = once!(visible("inodes", ns::ATTR_COLS, "ino = ?1", 2));
    let mut st = db.prepare_cached(sql)?;
    st.query_row(params![ino, s.epoch], |r| attr_of(r, s.id, 0))
        .optional()?
        .ok_or(StoreError::NotFound)
}

/// Inode `ino`'s extended attribute names as snapshot `s` shows them,
/// in name order (kept in `g.attrs`).
fn view_xattr_names(g: &Inner, s: At, ino: u64) -> Result<Vec<Vec<u8>>> {
    let key = view_ino(s.id, ino);
    if let Some(names) = g.attrs.xattr_names(key) {
        return Ok(names);
    }
    if !view_any_xattrs(g, s)? {
        return Ok(Vec::new());
    }
    let sql = once!(format!(
        "{} ORDER BY 1",
        visible("xattrs", "name", "ino = ?1", 2)
    ));
    let mut st = g.db.prepare_cached(sql)?;
    let rows = st.query_map(params![ino, s.epoch], |r| r.get(0))?;
    let names: Vec<Vec<u8>> = rows.collect::<rusqlite::Result<_>>()?;
    g.attrs.put_xattr_names(key, &names);
    Ok(names)
}

/// Whether snapshot `s` holds any extended attribute (kept in
/// `g.attrs`): most trees hold none, and then a file's names need no
/// statement.
fn view_any_xattrs(g: &Inner, s: At) -> Result<bool> {
    if let Some(any) = g.attrs.xattrs_any(s.id) {
        return Ok(any);
    }
    let sql = once!(format!(
        "SELECT EXISTS ({})",
        visible("xattrs", "1", "1", 1)
    ));
    let any =
        g.db.prepare_cached(sql)?
            .query_row([s.epoch], |r| r.get(0))?;
    g.attrs.put_xattrs_any(s.id, any);
    Ok(any)
}

fn view_parent(db: &Connection, s: At, dir: u64) -> Result<u64> {
    if dir == 1 {
        return Ok(SNAPSHOTS_DIR_INO);
    }
    let sql = once!(visible("inodes", "parent", "ino = ?1", 2));
    let p: Option<Option<u64>> = db
        .prepare_cached(sql)?
        .query_row(params![dir, s.epoch], |r| r.get(0))
        .optional()?;
    Ok(view_ino(s.id, p.flatten().unwrap_or(1)))
}

fn view_child(db: &Connection, s: At, parent: u64, name: &[u8]) -> Result<Option<u64>> {
    let sql = once!(visible("dirents", "ino", ns::NAME_RANGE, 4));
    let mut st = db.prepare_cached(sql)?;
    let key = params![parent, name_cookie(name), name, s.epoch];
    Ok(st.query_row(key, |r| r.get(0)).optional()?)
}

impl Store {
    /// What `ino` names; `NotFound` for a deleted snapshot's.
    fn node(&self, g: &Inner, ino: u64) -> Result<Node> {
        Ok(match split_view(ino) {
            None => Node::Live(ino),
            Some((VIRTUAL_ID, 1)) => Node::MetaDir,
            Some((VIRTUAL_ID, 2)) => Node::SnapshotsDir,
            Some((id, ino)) => {
                let epoch = self.view_epoch(g, id)?.ok_or(StoreError::NotFound)?;
                Node::View(At { id, epoch }, ino)
            }
        })
    }

    /// The epoch of snapshot `id`, if kept (kept in `g.attrs`).
    pub(crate) fn view_epoch(&self, g: &Inner, id: u64) -> Result<Option<u64>> {
        if let Some(e) = g.attrs.epoch(id) {
            return Ok(Some(e));
        }
        let Some(s) = snap::by_id(&g.db, id)? else {
            return Ok(None);
        };
        g.attrs.put_epoch(id, s.epoch);
        Ok(Some(s.epoch))
    }

    /// A `copy_file_range` source: a live file's stored inode, or the
    /// inode and epoch a snapshot's view of it names, with its attributes
    /// (`IsDir` for the virtual directories).
    pub(crate) fn copy_source(&self, g: &Inner, ino: u64) -> Result<(Source, Attr)> {
        match self.node(g, ino)? {
            Node::Live(ino) => Ok((Source { ino, epoch: None }, g.attr(ino)?)),
            Node::View(s, i) => {
                let a = view_attr(g, s, i)?;
                Ok((
                    Source {
                        ino: i,
                        epoch: Some(s.epoch),
                    },
                    a,
                ))
            }
            Node::MetaDir | Node::SnapshotsDir => Err(StoreError::IsDir),
        }
    }

    /// A virtual directory's attributes: read-only, the root's owner and
    /// times.
    fn virtual_attr(&self, g: &Inner, ino: u64) -> Result<Attr> {
        let root = g.attr(1)?;
        Ok(Attr {
            ino,
            kind: Kind::Dir,
            perm: 0o555,
            nlink: 2,
            size: 0,
            data: 0,
            ..root
        })
    }

    /// [`Store::lookup`] in a read-only directory.
    pub(crate) fn view_lookup(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        let g = self.lock();
        match (self.node(&g, parent)?, name) {
            (_, b".") => self.view_getattr_locked(&g, parent),
            (Node::View(s, dir), b"..") => {
                let up = view_parent(&g.db, s, dir)?;
                self.view_getattr_locked(&g, up)
            }
            (Node::MetaDir, b"..") => g.attr(1),
            (Node::SnapshotsDir, b"..") => self.virtual_attr(&g, META_DIR_INO),
            (Node::MetaDir, b"snapshots") => self.virtual_attr(&g, SNAPSHOTS_DIR_INO),
            (Node::MetaDir, _) => Err(StoreError::NotFound),
            (Node::SnapshotsDir, name) => {
                let name = std::str::from_utf8(name).map_err(|_| StoreError::NotFound)?;
                let s = snap::find(&g.db, name)?.ok_or(StoreError::NotFound)?;
                let at = At {
                    id: s.id,
                    epoch: s.epoch,
                };
                view_attr(&g, at, 1)
            }
            (Node::View(s, dir), name) => {
                let a = view_attr(&g, s, dir)?;
                if a.kind != Kind::Dir {
                    return Err(StoreError::NotDir);
                }
                let ino = view_child(&g.db, s, dir, name)?.ok_or(StoreError::NotFound)?;
                view_attr(&g, s, ino)
            }
            (Node::Live(_), _) => unreachable!("a live parent is looked up by Store::lookup"),
        }
    }

    /// Whether any inode of the snapshot `ino` belongs to has an extended
    /// attribute (ACLs are ones); `true` for an inode of no snapshot. A
    /// snapshot never changes, so a mount of one that has none may tell
    /// the kernel it keeps none (`onecopy-fuse`'s `Core`).
    pub fn view_has_xattrs(&self, ino: u64) -> Result<bool> {
        let g = self.lock();
        let Node::View(s, _) = self.node(&g, ino)? else {
            return Ok(true);
        };
        view_any_xattrs(&g, s)
    }

    /// [`Store::getattr`] of a read-only inode.
    pub(crate) fn view_getattr(&self, ino: u64) -> Result<Attr> {
        let g = self.lock();
        self.view_getattr_locked(&g, ino)
    }

    fn view_getattr_locked(&self, g: &Inner, ino: u64) -> Result<Attr> {
        match self.node(g, ino)? {
            Node::Live(ino) => self.attr_with_dirty(g, ino),
            Node::MetaDir | Node::SnapshotsDir => self.virtual_attr(g, ino),
            Node::View(s, ino) => view_attr(g, s, ino),
        }
    }

    /// [`Store::readdir_plus`] of a read-only directory: "." and ".."
    /// at offsets 1 and 2, then each entry at its key + 3 (a snapshot
    /// directory's cookie, a snapshot's id), stable while it exists.
    pub(crate) fn view_readdir_plus(
        &self,
        ino: u64,
        offset: i64,
        max: usize,
    ) -> Result<Vec<(DirEntry, Attr)>> {
        let g = self.lock();
        let after = (offset - 3).max(-1);
        // (cookie, name, inode, its attributes when already read)
        type Child = (i64, Vec<u8>, u64, Option<Attr>);
        let (up, children): (u64, Vec<Child>) = match self.node(&g, ino)? {
            Node::MetaDir => {
                let snaps =
                    (after < 0).then_some((0, b"snapshots".to_vec(), SNAPSHOTS_DIR_INO, None));
                (1, snaps.into_iter().collect())
            }
            Node::SnapshotsDir => {
                let snaps = snap::list(&g.db)?.into_iter();
                let named = snaps.filter(|s| s.id as i64 > after).take(max);
                let named =
                    named.map(|s| (s.id as i64, s.name.into_bytes(), view_ino(s.id, 1), None));
                (META_DIR_INO, named.collect())
            }
            Node::View(s, dir) => {
                if view_attr(&g, s, dir)?.kind != Kind::Dir {
                    return Err(StoreError::NotDir);
                }
                let up = view_parent(&g.db, s, dir)?;
                let children = view_children(&g.db, s, dir, after, max)?.into_iter();
                (
                    up,
                    children.map(|(c, n, a)| (c, n, a.ino, Some(a))).collect(),
                )
            }
            Node::Live(_) => unreachable!("a live directory is listed by Store::readdir"),
        };
        let dots = [
            (-2, b".".to_vec(), ino, None),
            (-1, b"..".to_vec(), up, None),
        ];
        let dots = dots.into_iter().filter(|d| d.0 + 3 > offset);
        let mut out = Vec::new();
        for (key, name, child, a) in dots.chain(children).take(max) {
            let a = match a {
                Some(a) => {
                    g.attrs.put(a);
                    a
                }
                None => self.view_getattr_locked(&g, child)?,
            };
            let e = DirEntry {
                ino: child,
                kind: a.kind,
                name,
                next: key + 3,
            };
            out.push((e, a));
        }
        Ok(out)
    }

    /// The target of a symbolic link in a snapshot.
    pub(crate) fn view_readlink(&self, ino: u64) -> Result<Vec<u8>> {
        let g = self.lock();
        let Node::View(s, ino) = self.node(&g, ino)? else {
            return Err(StoreError::Invalid);
        };
        let sql = once!(visible("inodes", "kind, target", "ino = ?1", 2));
        let (kind, target): (i64, Option<Vec<u8>>) =
            g.db.prepare_cached(sql)?
                .query_row(params![ino, s.epoch], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()?
                .ok_or(StoreError::NotFound)?;
        match (Kind::from_i64(kind), target) {
            (Kind::Symlink, Some(t)) => Ok(t),
            _ => Err(StoreError::Invalid),
        }
    }

    /// Extended attributes of a read-only inode: `Some(name)`'s value, or
    /// with `None` every name.
    pub(crate) fn view_xattrs(&self, ino: u64, name: Option<&[u8]>) -> Result<Vec<Vec<u8>>> {
        let g = self.lock();
        let Node::View(s, ino) = self.node(&g, ino)? else {
            self.view_getattr_locked(&g, ino)?;
            return match name {
                Some(_) => Err(StoreError::NoAttr),
                None => Ok(Vec::new()),
            };
        };
        view_attr(&g, s, ino)?;
        let names = view_xattr_names(&g, s, ino)?;
        let Some(name) = name else {
            return Ok(names);
        };
        if !names.iter().any(|n| n == name) {
            return Err(StoreError::NoAttr);
        }
        let sql = once!(visible("xattrs", "value", "ino = ?1 AND name = ?3", 2));
        let mut st = g.db.prepare_cached(sql)?;
        let value = st.query_row(params![ino, s.epoch, name], |r| r.get(0));
        Ok(vec![value.optional()?.ok_or(StoreError::NoAttr)?])
    }

    /// Reads a file of a snapshot (as [`Store::read`]).
    pub(crate) fn view_read(
        &self,
        ino: u64,
        off: u64,
        len: usize,
        out: &mut impl ReadBuf,
    ) -> Result<usize> {
        let full = ino;
        let (start, end, plan, gen) = {
            let g = self.lock();
            let Node::View(s, ino) = self.node(&g, ino)? else {
                return Err(StoreError::IsDir);
            };
            let a = view_attr(&g, s, ino)?;
            if a.kind == Kind::Dir {
                return Err(StoreError::IsDir);
            }
            let end = off.saturating_add(len as u64).min(a.size);
            if off >= end {
                return Ok(0);
            }
            let from = off.saturating_sub(self.cfg.chunking.max_chunk() as u64);
            let gen = self.cache.generation();
            let plan = match self.ahead.plan(full, gen, from, end) {
                Some(kept) => {
                    debug_assert_eq!(
                        view_plan(&g.db, s, ino, from, end).ok(),
                        Some(kept.clone()),
                        "kept view plan"
                    );
                    kept
                }
                None => view_plan(&g.db, s, ino, from, end)?,
            };
            (off, end, plan, gen)
        };
        let plan: Vec<_> = plan.into_iter().filter(|p| p.0 + p.1 > start).collect();
        let buf = out.take((end - start) as usize);
        self.fill(buf, start, &plan, gen)?;
        Ok(buf.len())
    }
}

/// Up to `max` entries of a snapshot's directory with a cookie above
/// `after`, in cookie order, each with its inode's row as the snapshot
/// shows it (cookie, name, attributes), in one statement: a row per
/// entry took a cold `cp -a` out of a snapshot 160 us per directory
/// listing against 27 us for the null filesystem.
///
/// An entry's row is the live one born at or before the epoch, else the
/// history row alive at it (at most one of the two, as [`visible`]).
fn view_children(
    db: &Connection,
    s: At,
    dir: u64,
    after: i64,
    max: usize,
) -> Result<Vec<(i64, Vec<u8>, Attr)>> {
    let sql = once!({
        let dirents = visible(
            "dirents",
            "cookie, name, ino",
            "parent = ?1 AND cookie > ?3",
            2,
        );
        let cols = ns::ATTR_COLS.split(", ");
        let cols: Vec<String> = cols.map(|c| format!("COALESCE(i.{c}, h.{c})")).collect();
        format!(
            "SELECT d.cookie, d.name, {} FROM ({dirents} ORDER BY cookie LIMIT ?4) d
             LEFT JOIN inodes i ON i.ino = d.ino AND i.born <= ?2
             LEFT JOIN inodes_hist h ON i.ino IS NULL AND h.ino = d.ino
                 AND h.born <= ?2 AND h.died > ?2
             ORDER BY d.cookie",
            cols.join(", ")
        )
    });
    let mut st = db.prepare_cached(sql)?;
    let rows = st.query_map(params![dir, s.epoch, after, max as i64], |r| {
        let found: Option<u64> = r.get(2)?;
        let a = found.map(|_| attr_of(r, s.id, 2)).transpose()?;
        Ok((r.get(0)?, r.get(1)?, a))
    })?;
    let rows: Vec<(i64, Vec<u8>, Option<Attr>)> = rows.collect::<rusqlite::Result<_>>()?;
    // A name whose inode the snapshot does not hold: as a lookup of it.
    let found = rows
        .into_iter()
        .map(|(c, n, a)| Ok((c, n, a.ok_or(StoreError::NotFound)?)));
    found.collect()
}

/// The extents of `ino` as the snapshot sees them with `from <= off <
/// end`, with their chunks' locations, in file order.
fn view_plan(
    db: &Connection,
    s: At,
    ino: u64,
    from: u64,
    end: u64,
) -> Result<Vec<crate::data::Planned>> {
    let sql = once!(format!(
        "{} ORDER BY e.off",
        view_extents_sql("ino = ?1 AND off >= ?3 AND off < ?4")
    ));
    let mut st = db.prepare_cached(sql)?;
    let rows = st.query_map(
        params![ino, s.epoch, from, end],
        crate::data::planned_or_missing,
    )?;
    let rows = rows.collect::<rusqlite::Result<Vec<_>>>()?;
    let missing = |off| StoreError::MissingChunk { ino, off };
    rows.into_iter().map(|r| r.map_err(missing)).collect()
}

/// The extents a snapshot (epoch `?2`) sees with `cond`, with their
/// chunks' locations, as rows [`crate::data::planned`] reads, then the inode.
pub(crate) fn view_extents_sql(cond: &str) -> String {
    format!(
        "SELECT e.off, e.len, c.container, c.offset, c.stored_len, c.raw_len, c.inner,
         c.pack_raw, e.ino FROM ({}) e
         LEFT JOIN chunks c ON c.id = e.chunk",
        visible("extents", "ino, off, len, chunk", cond, 2)
    )
}
