//! The namespace: inodes, directories, links, symlinks, attributes and
//! extended attributes, all in the metadata database.

use std::sync::atomic::Ordering;

use rusqlite::{params, OptionalExtension, Row};

use crate::acl::{self, Acl};
use crate::error::{Result, StoreError};

use crate::store::{time_now, Inner, Store};
use crate::view;

/// One batch of a directory's entries after cookie `?2`, in cookie order
/// (the primary key: each batch costs O(batch + log n), never a sort).
pub(crate) const READDIR_SQL: &str =
    "SELECT d.cookie, d.ino, i.kind, d.name FROM dirents d JOIN inodes i ON i.ino = d.ino
     WHERE d.parent = ?1 AND d.cookie > ?2 ORDER BY d.cookie LIMIT ?3";

/// Cookies per name hash: a name's cookie is `name_cookie(name) + k`,
/// `k` the lowest in `0..COOKIE_SPAN` free in its directory.
const COOKIE_SPAN: i64 = 1 << 16;

/// The rows of `?1`'s cookie range that may hold name `?3` (`?2` is
/// [`name_cookie`]); the range holds one row but for hash collisions. A
/// macro, so that statements are built from it at compile time (a
/// statement formatted per call cost an allocation and a hash of a new
/// string on every lookup).
macro_rules! name_range {
    () => {
        "parent = ?1 AND cookie BETWEEN ?2 AND ?2 + 65535 AND name = ?3"
    };
}

/// The rows of a name's cookie range in `{table}` (`?2` is
/// [`name_cookie`]), and whether each is name `?3`.
pub(crate) const SLOTS_SQL: &str = "SELECT cookie, name = ?3 FROM {table}
     WHERE parent = ?1 AND cookie BETWEEN ?2 AND ?2 + 65535 ORDER BY cookie";

/// The first cookie of `name`: 31 bits of its BLAKE3 shifted left by 16,
/// so below 2^47 (6 bytes in an SQLite record, not 8). Entries are keyed
/// by `(parent, cookie)`: the name is stored once, a lookup seeks its
/// hash's range (one row unless names of a directory share 31 hash bits:
/// a few pairs in a directory of 100,000 names, and harmless), and
/// `readdir` resumes after a cookie that stays the entry's own while it
/// exists (a rename gives a new one), so an entry present throughout a
/// listing is returned exactly once.
pub(crate) fn name_cookie(name: &[u8]) -> i64 {
    let h = blake3::hash(name);
    let v = u32::from_le_bytes(h.as_bytes()[..4].try_into().expect("4 bytes"));
    (i64::from(v >> 1)) << 16
}

/// Inserts the entry `parent/name -> ino` into `table` (`dirents`, or the
/// new table during a migration) with the lowest free cookie of its
/// hash's range. A name already there is `AlreadyExists`; a range with
/// no cookie left (65,536 names of one 31-bit hash: crafted names, at
/// about 2^31 hashes each) is `NoSpace`.
pub(crate) fn insert_dirent(
    db: &rusqlite::Connection,
    table: &str,
    parent: u64,
    name: &[u8],
    ino: u64,
    born: u64,
) -> Result<()> {
    let cookie = free_cookie(db, table, parent, name)?;
    insert_dirent_at(db, table, (parent, cookie), name, ino, born)
}

/// The cookie [`insert_dirent`] would give `parent/name`, or why it
/// cannot be added (`AlreadyExists`, `NoSpace`).
pub(crate) fn free_cookie(
    db: &rusqlite::Connection,
    table: &str,
    parent: u64,
    name: &[u8],
) -> Result<i64> {
    let base = name_cookie(name);
    let mut cookie = base;
    {
        let mut st = db.prepare_cached(&SLOTS_SQL.replace("{table}", table))?;
        let mut rows = st.query(params![parent, base, name])?;
        while let Some(r) = rows.next()? {
            if r.get::<_, bool>(1)? {
                return Err(StoreError::AlreadyExists);
            }
            if r.get::<_, i64>(0)? == cookie {
                cookie += 1;
            }
        }
    }
    if cookie >= base + COOKIE_SPAN {
        return Err(StoreError::NoSpace);
    }
    Ok(cookie)
}

/// Inserts the entry at `(parent, cookie)`, from [`free_cookie`] under
/// the same lock.
fn insert_dirent_at(
    db: &rusqlite::Connection,
    table: &str,
    (parent, cookie): (u64, i64),
    name: &[u8],
    ino: u64,
    born: u64,
) -> Result<()> {
    db.prepare_cached(&format!(
        "INSERT INTO {table} (parent, cookie, name, ino, born) VALUES (?1, ?2, ?3, ?4, ?5)"
    ))?
    .execute(params![parent, cookie, name, ino, born])?;
    Ok(())
}

/// Kinds of inodes, with their numbers in the `inodes` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File = 1,
    Dir = 2,
    Symlink = 3,
    Fifo = 4,
    Socket = 5,
    Char = 6,
    Block = 7,
}

impl Kind {
    pub(crate) fn from_i64(v: i64) -> Kind {
        match v {
            2 => Kind::Dir,
            3 => Kind::Symlink,
            4 => Kind::Fifo,
            5 => Kind::Socket,
            6 => Kind::Char,
            7 => Kind::Block,
            _ => Kind::File,
        }
    }
}

/// An inode's attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    /// Permission bits including setuid/setgid/sticky (mode & 0o7777).
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub rdev: u32,
    /// Bytes of a file held in chunks: stored ones (`inodes.data`) and,
    /// where the store answers, those buffered and not yet stored. Holes,
    /// zero chunks among them, are not counted.
    pub data: u64,
}

impl Attr {
    /// Every field zero, inode 0 (never an inode's number).
    pub const ZERO: Attr = Attr {
        ino: 0,
        kind: Kind::File,
        perm: 0,
        uid: 0,
        gid: 0,
        nlink: 0,
        size: 0,
        atime_ns: 0,
        mtime_ns: 0,
        ctime_ns: 0,
        rdev: 0,
        data: 0,
    };

    /// `st_blocks` (512-byte units): the data, at most the size rounded
    /// up. Below `size / 512` for a sparse file, which is what `cp`,
    /// `tar` and `du` look at.
    pub fn blocks(&self) -> u64 {
        self.data.min(self.size.next_multiple_of(512)).div_ceil(512)
    }
}

impl NewNode {
    /// A node of `kind` with permission bits `perm`, owned by root (uid and
    /// gid 0), with no device number.
    pub fn root_owned(kind: Kind, perm: u32) -> NewNode {
        NewNode {
            kind,
            perm,
            uid: 0,
            gid: 0,
            rdev: 0,
            umask: 0,
        }
    }
}

/// Changes asked by `setattr`; `None` leaves a field alone.
#[derive(Debug, Default, Clone, Copy)]
pub struct SetAttr {
    pub perm: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime_ns: Option<i64>,
    pub mtime_ns: Option<i64>,
    pub ctime_ns: Option<i64>,
    /// Set-id bits to clear on anything but a directory, after `perm` is
    /// applied: what the VFS does at a `chown`, and at a truncate or write
    /// by a caller without `CAP_FSETID`. A mount that hands this job to
    /// the filesystem (FUSE_HANDLE_KILLPRIV_V2) asks for it here.
    pub kill_setid: SetidKill,
}

/// Which set-id bits a change clears (see [`SetAttr::kill_setid`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum SetidKill {
    /// Neither.
    #[default]
    Keep,
    /// Setuid, and setgid when the group may execute (a caller in the
    /// file's group, or privileged).
    Exec,
    /// Setuid and setgid (a caller neither in the file's group nor
    /// privileged).
    All,
}

impl SetidKill {
    /// `perm` after the kill.
    fn apply(self, perm: u32) -> u32 {
        match self {
            SetidKill::Keep => perm,
            SetidKill::Exec if perm & 0o010 == 0 => perm & !0o4000,
            SetidKill::Exec | SetidKill::All => perm & !0o6000,
        }
    }
}

/// Who creates an inode, and how.
#[derive(Debug, Clone, Copy)]
pub struct NewNode {
    pub kind: Kind,
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    /// The creating process's umask, applied unless the directory has a
    /// default ACL, which then stands in for it (`perm` is the mode asked
    /// for, not yet masked).
    pub umask: u32,
}

/// One directory entry as `readdir` returns it.
#[derive(Debug, Clone)]
pub struct DirEntry {
    pub ino: u64,
    pub kind: Kind,
    pub name: Vec<u8>,
    /// Cookie to continue after this entry.
    pub next: i64,
}

/// Flags of `rename`.
#[derive(Debug, Default, Clone, Copy)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
}

/// The xattr holding file capabilities, which the kernel looks up before
/// every write to a file (to drop it).
pub(crate) const CAPS: &[u8] = b"security.capability";

/// The attribute columns, in [`attr_of`]'s order.
macro_rules! attr_cols {
    () => {
        "ino, kind, perm, uid, gid, nlink, size, atime_ns, mtime_ns, ctime_ns, rdev, data"
    };
}

/// The entries of name `?3`'s cookie range in directory `?1` (`?2` is
/// [`name_cookie`]), in cookie order: each one's cookie, whether it is
/// `?3`, and for that one the attributes of its inode (a name only ever
/// sits in a directory, so a hit needs no check of the parent). One
/// statement answers a lookup and, for a name not there, the cookie
/// [`free_cookie`] would give it (see [`Absent`]).
pub(crate) const LOOKUP_SQL: &str =
    "SELECT d.cookie, d.name = ?3, i.ino, i.kind, i.perm, i.uid, i.gid, i.nlink, i.size,
     i.atime_ns, i.mtime_ns, i.ctime_ns, i.rdev, i.data
     FROM dirents d LEFT JOIN inodes i ON d.name = ?3 AND i.ino = d.ino
     WHERE d.parent = ?1 AND d.cookie BETWEEN ?2 AND ?2 + 65535 ORDER BY d.cookie";

/// A name a lookup found absent, and the cookie a create would give it:
/// the kernel looks a name up before it creates it, and the create then
/// needs no statement of its own to find the cookie.
///
/// Invariant: valid only under the next guard of the store's lock after
/// the lookup's ([`Inner::locks`] one more): no statement ran between.
#[derive(Debug)]
pub(crate) struct Absent {
    pub parent: u64,
    pub name: Vec<u8>,
    pub cookie: i64,
    /// [`Inner::locks`] of the lookup's guard.
    pub lock: u64,
}

/// [`attr_of`]'s columns, for statements built at run time.
pub(crate) const ATTR_COLS: &str = attr_cols!();

/// The rows of name `?3` in directory `?1` (`?2` is [`name_cookie`]),
/// for statements built at run time.
pub(crate) const NAME_RANGE: &str = name_range!();

/// The inode `?1/?3` names (`?2` is [`name_cookie`]).
pub(crate) const CHILD_SQL: &str = concat!("SELECT ino FROM dirents WHERE ", name_range!());

pub(crate) fn attr_of(r: &Row) -> rusqlite::Result<Attr> {
    attr_at(r, 0)
}

/// [`attr_of`] of the [`ATTR_COLS`] starting at column `at`.
pub(crate) fn attr_at(r: &Row, at: usize) -> rusqlite::Result<Attr> {
    Ok(Attr {
        ino: r.get(at)?,
        kind: Kind::from_i64(r.get(at + 1)?),
        perm: r.get(at + 2)?,
        uid: r.get(at + 3)?,
        gid: r.get(at + 4)?,
        nlink: r.get(at + 5)?,
        size: r.get(at + 6)?,
        atime_ns: r.get(at + 7)?,
        mtime_ns: r.get(at + 8)?,
        ctime_ns: r.get(at + 9)?,
        rdev: r.get(at + 10)?,
        data: r.get(at + 11)?,
    })
}

/// Xattrs a new node starts with (name, value).
type InitialXattrs = Vec<(&'static [u8], Vec<u8>)>;

/// A new node's mode and the ACL xattrs it starts with: its directory's
/// default ACL, when there is one, makes its access ACL (kept if it says
/// more than the mode) and, for a directory, its default ACL, and the
/// umask is not applied; otherwise the mode is the one asked for less
/// the umask. Symbolic links have no ACLs.
fn inherit_acl(g: &Inner, parent: u64, node: &NewNode) -> Result<(u32, InitialXattrs)> {
    let asked = node.perm & 0o7777;
    let def = match node.kind {
        Kind::Symlink => None,
        _ => g.xattr(parent, acl::DEFAULT)?,
    };
    let Some(def) = def else {
        return Ok((asked & !node.umask, Vec::new()));
    };
    let Some(mut access) = Acl::parse(&def) else {
        return Ok((asked & !node.umask, Vec::new()));
    };
    let perm = access.create_masq(asked);
    let mut acls = Vec::new();
    if !access.mode().1 {
        acls.push((acl::ACCESS, access.to_xattr()));
    }
    if node.kind == Kind::Dir {
        acls.push((acl::DEFAULT, def));
    }
    Ok((perm, acls))
}

/// `chmod`: the access ACL, if the node has one, takes the new bits.
fn chmod_acl(g: &Inner, ino: u64, perm: u32) -> Result<()> {
    let Some(mut a) = g.xattr(ino, acl::ACCESS)?.as_deref().and_then(Acl::parse) else {
        return Ok(());
    };
    a.chmod(perm);
    g.db.prepare_cached("UPDATE xattrs SET value = ?3 WHERE ino = ?1 AND name = ?2")?
        .execute(params![ino, acl::ACCESS, a.to_xattr()])?;
    Ok(())
}

pub(crate) fn check_name(name: &[u8]) -> Result<()> {
    if name.len() > 255 {
        return Err(StoreError::NameTooLong);
    }
    Ok(())
}

impl Inner {
    /// The value of xattr `name` of `ino`, if it has one.
    pub(crate) fn xattr(&self, ino: u64, name: &[u8]) -> Result<Option<Vec<u8>>> {
        if !self.seen.may_hold(name) {
            return Ok(None);
        }
        let mut st = self
            .db
            .prepare_cached("SELECT value FROM xattrs WHERE ino = ?1 AND name = ?2")?;
        Ok(st.query_row(params![ino, name], |r| r.get(0)).optional()?)
    }

    /// An inode's row: from [`AttrCache`](crate::attrs::AttrCache) when
    /// it holds it (checked against the row in debug builds).
    pub(crate) fn attr(&self, ino: u64) -> Result<Attr> {
        if let Some(a) = self.attrs.get(ino) {
            debug_assert_eq!(self.attr_row(ino).ok(), Some(a), "cached row of {ino}");
            return Ok(a);
        }
        let a = self.attr_row(ino)?;
        self.attrs.put(a);
        Ok(a)
    }

    fn attr_row(&self, ino: u64) -> Result<Attr> {
        let mut st = self.db.prepare_cached(concat!(
            "SELECT ",
            attr_cols!(),
            " FROM inodes WHERE ino = ?1"
        ))?;
        st.query_row([ino], attr_of)
            .optional()?
            .ok_or(StoreError::NotFound)
    }

    pub(crate) fn child(&self, parent: u64, name: &[u8]) -> Result<Option<u64>> {
        let mut st = self.db.prepare_cached(CHILD_SQL)?;
        Ok(st
            .query_row(params![parent, name_cookie(name), name], |r| r.get(0))
            .optional()?)
    }

    fn dir_attr(&self, ino: u64) -> Result<Attr> {
        let a = self.attr(ino)?;
        if a.kind != Kind::Dir {
            return Err(StoreError::NotDir);
        }
        Ok(a)
    }

    /// Runs `sql`, which changes only `ino`'s row and only columns of
    /// [`Attr`], with `p`; `change` makes the same change to the row's
    /// cached copy, if there is one (equal to the row), so the next
    /// request reads it from memory.
    ///
    /// A change that leaves the cached row as it is runs no statement:
    /// `cp -a` and `rsync -a` chown a file to the owner it was made with
    /// and touch its directory again within one tick of the coarse clock
    /// (bench/notes/store-transport.md, "Updates that change nothing").
    pub(crate) fn update_inode<P: rusqlite::Params>(
        &self,
        ino: u64,
        sql: &str,
        p: P,
        change: impl FnOnce(&mut Attr),
    ) -> Result<()> {
        let Some(before) = self.attrs.get(ino) else {
            self.db.prepare_cached(sql)?.execute(p)?;
            return Ok(());
        };
        let mut after = before;
        change(&mut after);
        if after == before {
            debug_assert_eq!(self.attr_row(ino).ok(), Some(before), "cached row of {ino}");
            return Ok(());
        }
        self.db.prepare_cached(sql)?.execute(p)?;
        self.attrs.put(after);
        Ok(())
    }

    pub(crate) fn touch(&self, ino: u64, mtime: bool) -> Result<()> {
        let t = time_now();
        let sql = if mtime {
            "UPDATE inodes SET mtime_ns = ?2, ctime_ns = ?2 WHERE ino = ?1"
        } else {
            "UPDATE inodes SET ctime_ns = ?2 WHERE ino = ?1"
        };
        self.update_inode(ino, sql, params![ino, t], |a| {
            if mtime {
                a.mtime_ns = t;
            }
            a.ctime_ns = t;
        })
    }

    pub(crate) fn add_nlink(&self, ino: u64, delta: i64) -> Result<()> {
        let sql = "UPDATE inodes SET nlink = nlink + ?2 WHERE ino = ?1";
        self.update_inode(ino, sql, params![ino, delta], |a| {
            a.nlink = (a.nlink as i64 + delta) as u32;
        })
    }

    /// Adds the entry `parent/name` for `ino`; a name already there is
    /// `AlreadyExists` (callers that looked first never meet it).
    pub(crate) fn add_dirent(&self, parent: u64, name: &[u8], ino: u64) -> Result<()> {
        check_name(name)?;
        insert_dirent(&self.db, "dirents", parent, name, ino, self.epoch)
    }

    /// The cookie for `parent/name` that the lookup just before this
    /// guard found free, if that lookup was of this name (see [`Absent`]):
    /// the name is not there.
    pub(crate) fn take_absent(&self, parent: u64, name: &[u8]) -> Option<i64> {
        let m = self.absent.take()?;
        (m.lock.wrapping_add(1) == self.locks && m.parent == parent && m.name == name)
            .then_some(m.cookie)
    }

    fn del_dirent(&self, parent: u64, name: &[u8]) -> Result<()> {
        self.db
            .prepare_cached(concat!("DELETE FROM dirents WHERE ", name_range!()))?
            .execute(params![parent, name_cookie(name), name])?;
        Ok(())
    }

    /// Removes the entry `parent/name` if it names `ino` (a rename within
    /// one directory has just added the new name beside it).
    fn del_dirent_of(&self, parent: u64, name: &[u8], ino: u64) -> Result<()> {
        self.db
            .prepare_cached(concat!(
                "DELETE FROM dirents WHERE ",
                name_range!(),
                " AND ino = ?4"
            ))?
            .execute(params![parent, name_cookie(name), name, ino])?;
        Ok(())
    }

    /// Records that directory `dir`'s entry is now in `parent` (a no-op
    /// for other kinds: only directories keep their parent).
    fn set_parent(&self, dir: u64, parent: u64) -> Result<()> {
        self.db
            .prepare_cached("UPDATE inodes SET parent = ?2 WHERE ino = ?1 AND kind = 2")?
            .execute(params![dir, parent])?;
        Ok(())
    }

    fn is_empty_dir(&self, ino: u64) -> Result<bool> {
        let mut st = self
            .db
            .prepare_cached("SELECT 1 FROM dirents WHERE parent = ?1 LIMIT 1")?;
        Ok(st.query_row([ino], |_| Ok(())).optional()?.is_none())
    }

    fn parent_of(&self, dir: u64) -> Result<u64> {
        if dir == 1 {
            return Ok(1);
        }
        let mut st = self
            .db
            .prepare_cached("SELECT parent FROM inodes WHERE ino = ?1")?;
        let parent: Option<Option<u64>> = st.query_row([dir], |r| r.get(0)).optional()?;
        Ok(parent.flatten().unwrap_or(1))
    }
}

/// Bytes an xattr row takes beside its name and value (row, index).
const XATTR_ROW: u64 = 256;

impl Store {
    /// The inode named `name` in directory `parent`.
    ///
    /// `.` and `..` are answered too, for any inode number: the kernel
    /// asks them to turn an NFS file handle (or `open_by_handle_at`) back
    /// into an inode after it forgot it (FUSE_EXPORT_SUPPORT). Inode
    /// numbers are never reused, so a number alone names one inode.
    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        if view::is_read_only(parent) {
            return self.view_lookup(parent, name);
        }
        if view::is_reserved(parent, name) {
            return self.view_getattr(view::META_DIR_INO);
        }
        let g = self.lock();
        match name {
            // A handle of an inode with no name left is stale.
            b"." => {
                let a = self.attr_with_dirty(&g, parent)?;
                return if a.nlink == 0 {
                    Err(StoreError::NotFound)
                } else {
                    Ok(a)
                };
            }
            b".." => {
                g.dir_attr(parent)?;
                let up = g.parent_of(parent)?;
                return self.attr_with_dirty(&g, up);
            }
            _ => {}
        }
        let base = name_cookie(name);
        let mut free = base;
        let mut st = g.db.prepare_cached(LOOKUP_SQL)?;
        let mut rows = st.query(params![parent, base, name])?;
        while let Some(r) = rows.next()? {
            if r.get::<_, bool>(1)? {
                let mut a = attr_at(r, 2)?;
                g.attrs.put(a);
                a.data += self.buffered(&g, a.ino);
                return Ok(a);
            }
            if r.get::<_, i64>(0)? == free {
                free += 1;
            }
        }
        drop(rows);
        drop(st);
        // Not found: the parent decides between ENOENT and ENOTDIR.
        g.dir_attr(parent)?;
        if free < base + COOKIE_SPAN {
            let (name, cookie, lock) = (name.to_vec(), free, g.locks);
            g.absent.set(Some(Absent {
                parent,
                name,
                cookie,
                lock,
            }));
        }
        Err(StoreError::NotFound)
    }

    /// An inode's attributes.
    pub fn getattr(&self, ino: u64) -> Result<Attr> {
        if view::is_read_only(ino) {
            return self.view_getattr(ino);
        }
        let g = self.lock();
        self.attr_with_dirty(&g, ino)
    }

    pub(crate) fn attr_with_dirty(&self, g: &Inner, ino: u64) -> Result<Attr> {
        let mut a = g.attr(ino)?;
        a.data += self.buffered(g, ino);
        Ok(a)
    }

    /// Bytes of `ino` counted in `st_blocks` beyond its stored data: pages
    /// buffered and not yet stored (a page that overwrites stored bytes
    /// counts twice until it is flushed) and room promised by `fallocate`,
    /// at most up to the size (see [`Attr::blocks`]).
    fn buffered(&self, g: &Inner, ino: u64) -> u64 {
        let pages = g
            .dirty
            .get(&ino)
            .map_or(0, |d| d.pages.len() as u64 * self.page_size());
        pages + g.prealloc.get(&ino).copied().unwrap_or(0)
    }

    /// Creates a node (file, directory, device, fifo, socket).
    pub fn mknod(&self, parent: u64, name: &[u8], node: NewNode) -> Result<Attr> {
        let g = self.lock();
        self.create_locked(&g, parent, name, node, None)
    }

    /// Creates a file and opens it (`open(O_CREAT)`), under one lock:
    /// [`Store::mknod`] then [`Store::open_file`].
    pub fn create_open(&self, parent: u64, name: &[u8], node: NewNode) -> Result<Attr> {
        let mut g = self.lock();
        let a = self.create_locked(&g, parent, name, node, None)?;
        *g.open_count.entry(a.ino).or_default() += 1;
        Ok(a)
    }

    /// Creates a symbolic link to `target`.
    pub fn symlink(
        &self,
        parent: u64,
        name: &[u8],
        target: &[u8],
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        let g = self.lock();
        let node = NewNode {
            kind: Kind::Symlink,
            perm: 0o777,
            uid,
            gid,
            rdev: 0,
            umask: 0,
        };
        self.create_locked(&g, parent, name, node, Some(target))
    }

    fn create_locked(
        &self,
        g: &Inner,
        parent: u64,
        name: &[u8],
        node: NewNode,
        target: Option<&[u8]>,
    ) -> Result<Attr> {
        let pa = g.dir_attr(parent)?;
        check_name(name)?;
        if view::is_reserved(parent, name) {
            return Err(StoreError::AlreadyExists);
        }
        // The name looked up too: AlreadyExists.
        let cookie = match g.take_absent(parent, name) {
            Some(cookie) => cookie,
            None => free_cookie(&g.db, "dirents", parent, name)?,
        };
        self.room_for_more(g, 0)?;
        let (mut perm, acls) = inherit_acl(g, parent, &node)?;
        let mut gid = node.gid;
        if pa.perm & 0o2000 != 0 {
            gid = pa.gid;
            if node.kind == Kind::Dir {
                perm |= 0o2000;
            }
        }
        let t = time_now();
        let is_dir = node.kind == Kind::Dir;
        let size = target.map_or(0, |t| t.len() as u64);
        let nlink = if is_dir { 2 } else { 1 };
        g.db.prepare_cached(
            "INSERT INTO inodes (kind, perm, uid, gid, nlink, size, atime_ns, mtime_ns, ctime_ns,
             rdev, target, parent, born)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?7, ?8, ?9, ?10, ?11)",
        )?
        .execute(params![
            node.kind as i64,
            perm,
            node.uid,
            gid,
            nlink,
            size,
            t,
            node.rdev,
            target,
            is_dir.then_some(parent),
            g.epoch
        ])?;
        let ino = g.db.last_insert_rowid() as u64;
        // Exactly the row just inserted (no read back).
        let a = Attr {
            ino,
            kind: node.kind,
            perm,
            uid: node.uid,
            gid,
            nlink,
            size,
            atime_ns: t,
            mtime_ns: t,
            ctime_ns: t,
            rdev: node.rdev,
            data: 0,
        };
        g.attrs.put(a);
        for (name, value) in acls {
            g.seen.saw(name);
            g.db.prepare_cached(
                "INSERT INTO xattrs (ino, name, value, born) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![ino, name, value, g.epoch])?;
        }
        insert_dirent_at(&g.db, "dirents", (parent, cookie), name, ino, g.epoch)?;
        if is_dir {
            g.add_nlink(parent, 1)?;
        }
        g.touch(parent, true)?;
        Ok(a)
    }

    /// The target of a symbolic link.
    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        if view::is_read_only(ino) {
            return self.view_readlink(ino);
        }
        let g = self.lock();
        let mut st =
            g.db.prepare_cached("SELECT kind, target FROM inodes WHERE ino = ?1")?;
        let (kind, target): (i64, Option<Vec<u8>>) = st
            .query_row([ino], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?
            .ok_or(StoreError::NotFound)?;
        match (Kind::from_i64(kind), target) {
            (Kind::Symlink, Some(t)) => Ok(t),
            _ => Err(StoreError::Invalid),
        }
    }

    /// Removes a non-directory name.
    pub fn unlink(&self, parent: u64, name: &[u8]) -> Result<()> {
        let mut g = self.lock();
        g.dir_attr(parent)?;
        let ino = g.child(parent, name)?.ok_or(StoreError::NotFound)?;
        if g.attr(ino)?.kind == Kind::Dir {
            return Err(StoreError::IsDir);
        }
        g.del_dirent(parent, name)?;
        g.touch(parent, true)?;
        self.drop_link(&mut g, ino)
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()> {
        let mut g = self.lock();
        g.dir_attr(parent)?;
        let ino = g.child(parent, name)?.ok_or(StoreError::NotFound)?;
        g.dir_attr(ino)?;
        if !g.is_empty_dir(ino)? {
            return Err(StoreError::NotEmpty);
        }
        g.del_dirent(parent, name)?;
        g.add_nlink(parent, -1)?;
        g.touch(parent, true)?;
        g.db.execute("UPDATE inodes SET nlink = 0 WHERE ino = ?1", [ino])?;
        self.unlinked(&mut g, ino)
    }

    /// One name less for `ino`; deletes it when no name and no open file
    /// is left (see [`Store::unlinked`]).
    fn drop_link(&self, g: &mut Inner, ino: u64) -> Result<()> {
        g.add_nlink(ino, -1)?;
        g.touch(ino, false)?;
        self.unlinked(g, ino)
    }

    /// `ino` lost a name or an open handle: deleted if it has neither
    /// left, unless it is a directory the kernel may still hold as a
    /// working directory (on a mount: see [`Store::keep_until_forgotten`]),
    /// which [`Store::forget`] deletes. A file the kernel holds is an
    /// open one, counted already; its chunks are freed at once, so a gc
    /// right after `rm` finds them.
    pub(crate) fn unlinked(&self, g: &mut Inner, ino: u64) -> Result<()> {
        if self.kernel_refs.load(Ordering::Relaxed) && g.attr(ino)?.kind == Kind::Dir {
            return Ok(());
        }
        self.maybe_delete(g, ino)
    }

    /// Directories with no name stay until the kernel forgets them, as a disk
    /// filesystem keeps an unlinked inode while it is referenced: a
    /// process whose working directory was removed can still `stat` it
    /// (`nlink` 0) and `chdir("..")` out of it (the kernel's permission
    /// check asks for its attributes; xfstests generic/011 got ENOENT).
    /// Set by the FUSE adapter, which passes FORGETs to [`Store::forget`];
    /// nameless inodes left at unmount go at the next open.
    pub fn keep_until_forgotten(&self) {
        self.kernel_refs.store(true, Ordering::Relaxed);
    }

    /// The kernel forgot these inodes: those with no name and no open
    /// handle are deleted.
    pub fn forget(&self, inos: &[u64]) -> Result<()> {
        let mut g = self.lock();
        for &ino in inos {
            if matches!(g.attr(ino), Ok(a) if a.nlink == 0) {
                self.maybe_delete(&mut g, ino)?;
            }
        }
        Ok(())
    }

    pub(crate) fn maybe_delete(&self, g: &mut Inner, ino: u64) -> Result<()> {
        let a = g.attr(ino)?;
        if a.nlink > 0 || g.open_count.get(&ino).copied().unwrap_or(0) > 0 {
            return Ok(());
        }
        g.dirty.remove(&ino);
        Self::use_room(g, ino, None);
        let refs: Vec<(u64, u64)> = {
            let mut st = g.db.prepare_cached(
                "SELECT chunk, COUNT(*) FROM extents WHERE ino = ?1 GROUP BY chunk",
            )?;
            let rows = st.query_map([ino], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        self.release_chunks(g, &refs)?;
        // The row first: the trigger that keeps `inodes.data` then finds
        // nothing to update for each extent deleted after it.
        for sql in [
            "DELETE FROM inodes WHERE ino = ?1",
            "DELETE FROM extents WHERE ino = ?1",
            "DELETE FROM xattrs WHERE ino = ?1",
        ] {
            g.db.prepare_cached(sql)?.execute([ino])?;
        }
        Ok(())
    }

    /// Deletes inodes left with no name (unlinked while open before a
    /// crash or unmount).
    pub(crate) fn remove_orphans(&self) -> Result<()> {
        let mut g = self.lock();
        self.remove_orphans_locked(&mut g)?;
        self.commit_locked(&mut g, false)
    }

    pub(crate) fn remove_orphans_locked(&self, g: &mut Inner) -> Result<()> {
        let orphans: Vec<u64> = {
            let mut st = g.db.prepare("SELECT ino FROM inodes WHERE nlink <= 0")?;
            let rows = st.query_map([], |r| r.get(0))?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        for ino in orphans {
            self.maybe_delete(g, ino)?;
        }
        Ok(())
    }

    /// A new name for an existing non-directory inode.
    pub fn link(&self, ino: u64, parent: u64, name: &[u8]) -> Result<Attr> {
        let g = self.lock();
        g.dir_attr(parent)?;
        if g.attr(ino)?.kind == Kind::Dir {
            return Err(StoreError::IsDir);
        }
        if view::is_reserved(parent, name) || g.child(parent, name)?.is_some() {
            return Err(StoreError::AlreadyExists);
        }
        g.add_dirent(parent, name, ino)?;
        g.add_nlink(ino, 1)?;
        g.touch(ino, false)?;
        g.touch(parent, true)?;
        self.attr_with_dirty(&g, ino)
    }

    /// Renames `parent/name` to `newparent/newname`.
    pub fn rename(
        &self,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        flags: RenameFlags,
    ) -> Result<()> {
        let mut g = self.lock();
        // The kernel looked the new name up just before, most often.
        let absent = g.take_absent(newparent, newname);
        g.dir_attr(parent)?;
        g.dir_attr(newparent)?;
        let src = g.child(parent, name)?.ok_or(StoreError::NotFound)?;
        let sa = g.attr(src)?;
        check_name(newname)?;
        if view::is_reserved(newparent, newname) {
            return Err(StoreError::AlreadyExists);
        }
        let dst = match absent {
            Some(_) => None,
            None => g.child(newparent, newname)?,
        };
        if sa.kind == Kind::Dir && self.is_ancestor(&g, src, newparent)? {
            return Err(StoreError::Invalid);
        }
        let (from, to) = ((parent, name), (newparent, newname));
        if flags.exchange {
            let dst = dst.ok_or(StoreError::NotFound)?;
            return self.exchange(&mut g, from, (src, sa.kind), to, dst);
        }
        if let Some(dst) = dst {
            if dst == src {
                return Ok(());
            }
            if flags.noreplace {
                return Err(StoreError::AlreadyExists);
            }
            self.displace(&mut g, to, dst, sa.kind)?;
        }
        // The new entry first: if it fails (no cookie left), the old
        // one is still there.
        match absent {
            Some(cookie) => {
                let at = (newparent, cookie);
                insert_dirent_at(&g.db, "dirents", at, newname, src, g.epoch)?
            }
            None => g.add_dirent(newparent, newname, src)?,
        }
        g.del_dirent_of(parent, name, src)?;
        if sa.kind == Kind::Dir && parent != newparent {
            g.set_parent(src, newparent)?;
            g.add_nlink(parent, -1)?;
            g.add_nlink(newparent, 1)?;
        }
        g.touch(src, false)?;
        g.touch(parent, true)?;
        g.touch(newparent, true)?;
        Ok(())
    }

    /// `RENAME_EXCHANGE`: `from` (naming `src`) and `to` (naming `dst`)
    /// swap inodes; directories moved change parents and link counts.
    fn exchange(
        &self,
        g: &mut Inner,
        (parent, name): (u64, &[u8]),
        (src, src_kind): (u64, Kind),
        (newparent, newname): (u64, &[u8]),
        dst: u64,
    ) -> Result<()> {
        let dst_kind = g.attr(dst)?.kind;
        if dst_kind == Kind::Dir && self.is_ancestor(g, dst, parent)? {
            return Err(StoreError::Invalid);
        }
        let set = concat!("UPDATE dirents SET ino = ?4 WHERE ", name_range!());
        g.db.execute(set, params![parent, name_cookie(name), name, dst])?;
        g.db.execute(set, params![newparent, name_cookie(newname), newname, src])?;
        if parent != newparent {
            g.set_parent(src, newparent)?;
            g.set_parent(dst, parent)?;
            let d = (src_kind == Kind::Dir) as i64 - (dst_kind == Kind::Dir) as i64;
            g.add_nlink(parent, -d)?;
            g.add_nlink(newparent, d)?;
        }
        for ino in [src, dst] {
            g.touch(ino, false)?;
        }
        g.touch(parent, true)?;
        g.touch(newparent, true)
    }

    /// Removes `dst`, named `newparent/newname`, which a rename of an
    /// inode of kind `src_kind` replaces (a directory only by an empty
    /// directory, a non-directory only by a non-directory).
    fn displace(
        &self,
        g: &mut Inner,
        (newparent, newname): (u64, &[u8]),
        dst: u64,
        src_kind: Kind,
    ) -> Result<()> {
        let dst_kind = g.attr(dst)?.kind;
        match (src_kind == Kind::Dir, dst_kind == Kind::Dir) {
            (true, false) => return Err(StoreError::NotDir),
            (false, true) => return Err(StoreError::IsDir),
            (true, true) if !g.is_empty_dir(dst)? => return Err(StoreError::NotEmpty),
            _ => {}
        }
        g.del_dirent(newparent, newname)?;
        if dst_kind == Kind::Dir {
            g.add_nlink(newparent, -1)?;
            g.db.execute("UPDATE inodes SET nlink = 0 WHERE ino = ?1", [dst])?;
            self.unlinked(g, dst)
        } else {
            self.drop_link(g, dst)
        }
    }

    /// Whether `dir` is `node` or below it.
    fn is_ancestor(&self, g: &Inner, node: u64, mut dir: u64) -> Result<bool> {
        loop {
            if dir == node {
                return Ok(true);
            }
            if dir == 1 {
                return Ok(false);
            }
            dir = g.parent_of(dir)?;
        }
    }

    /// Entries of a directory after cookie `offset` ("." and ".." first,
    /// cookies 1 and 2; an entry's is its `dirents.cookie` + 3).
    pub fn readdir(&self, ino: u64, offset: i64, max: usize) -> Result<Vec<DirEntry>> {
        if view::is_read_only(ino) {
            let all = self.view_readdir_plus(ino, offset, max)?;
            return Ok(all.into_iter().map(|(e, _)| e).collect());
        }
        let g = self.lock();
        g.readdir(ino, offset, max)
    }

    /// [`Store::readdir`] with each entry's attributes, as `getattr`
    /// would give them, read under the same lock.
    pub fn readdir_plus(&self, ino: u64, offset: i64, max: usize) -> Result<Vec<(DirEntry, Attr)>> {
        if view::is_read_only(ino) {
            return self.view_readdir_plus(ino, offset, max);
        }
        let g = self.lock();
        let entries = g.readdir(ino, offset, max)?;
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let a = self.attr_with_dirty(&g, e.ino)?;
            out.push((e, a));
        }
        Ok(out)
    }

    /// Changes attributes; a size change truncates or extends the file.
    pub fn setattr(&self, ino: u64, set: SetAttr) -> Result<Attr> {
        let mut g = self.lock();
        let a = g.attr(ino)?;
        if let Some(size) = set.size {
            if a.kind == Kind::Dir {
                return Err(StoreError::IsDir);
            }
            self.truncate_locked(&mut g, ino, size)?;
        }
        let t = time_now();
        let perm = set.perm.map_or(a.perm, |p| p & 0o7777);
        if set.perm.is_some() {
            chmod_acl(&g, ino, perm)?;
        }
        let new = Attr {
            perm: if a.kind == Kind::Dir {
                perm
            } else {
                set.kill_setid.apply(perm)
            },
            uid: set.uid.unwrap_or(a.uid),
            gid: set.gid.unwrap_or(a.gid),
            size: set.size.unwrap_or(a.size),
            atime_ns: set.atime_ns.unwrap_or(a.atime_ns),
            mtime_ns: set
                .mtime_ns
                .unwrap_or(if set.size.is_some() { t } else { a.mtime_ns }),
            ctime_ns: set.ctime_ns.unwrap_or(t),
            ..a
        };
        g.update_inode(
            ino,
            "UPDATE inodes SET perm = ?2, uid = ?3, gid = ?4, atime_ns = ?5, mtime_ns = ?6,
             ctime_ns = ?7 WHERE ino = ?1",
            params![
                ino,
                new.perm,
                new.uid,
                new.gid,
                new.atime_ns,
                new.mtime_ns,
                new.ctime_ns,
            ],
            |r| {
                (r.perm, r.uid, r.gid) = (new.perm, new.uid, new.gid);
                (r.atime_ns, r.mtime_ns, r.ctime_ns) = (new.atime_ns, new.mtime_ns, new.ctime_ns);
            },
        )?;
        // The row as updated: truncate_locked set the size and, through
        // the extents it dropped, the data; nothing else changed under the
        // lock.
        let data = match set.size {
            Some(_) => g.attr(ino)?.data,
            None => a.data,
        };
        Ok(Attr {
            data: data + self.buffered(&g, ino),
            ..new
        })
    }

    /// Sets an extended attribute (`create`: must not exist; `replace`:
    /// must exist); ENOSPC when its value does not fit beside the
    /// reserve ([`Store::room_for_metadata`]).
    pub fn setxattr(
        &self,
        ino: u64,
        name: &[u8],
        value: &[u8],
        create: bool,
        replace: bool,
    ) -> Result<()> {
        if !acl::keeps_xattr(name) {
            return Err(StoreError::NotSupported);
        }
        let mut g = self.lock();
        let a = g.attr(ino)?;
        let acl_mode = match name == acl::ACCESS {
            true => Some(Acl::parse(value).ok_or(StoreError::Invalid)?.mode()),
            false => None,
        };
        // A row will be written: its flags and its room are checked before
        // anything changes (an access ACL changes the mode too).
        if !acl_mode.is_some_and(|(_, minimal)| minimal) {
            let exists =
                g.db.prepare_cached("SELECT 1 FROM xattrs WHERE ino = ?1 AND name = ?2")?
                    .query_row(params![ino, name], |_| Ok(()))
                    .optional()?
                    .is_some();
            if create && exists {
                return Err(StoreError::AlreadyExists);
            }
            if replace && !exists {
                return Err(StoreError::NoAttr);
            }
            // Metadata, but a value may be 64 KiB: it takes room as
            // written data does (the log, then the database), or a full
            // disk fails the next commit and the store shuts down.
            self.room_for_metadata(&mut g, XATTR_ROW + 2 * (name.len() + value.len()) as u64)?;
        }
        if let Some((perm, minimal)) = acl_mode {
            let (perm, t) = ((a.perm & 0o7000) | perm, time_now());
            g.update_inode(
                ino,
                "UPDATE inodes SET perm = ?2, ctime_ns = ?3 WHERE ino = ?1",
                params![ino, perm, t],
                |r| (r.perm, r.ctime_ns) = (perm, t),
            )?;
            if minimal {
                // An ACL that says no more than the mode is the mode.
                if g.seen.may_hold(name) {
                    g.db.prepare_cached("DELETE FROM xattrs WHERE ino = ?1 AND name = ?2")?
                        .execute(params![ino, name])?;
                }
                return Ok(());
            }
        }
        g.seen.saw(name);
        g.db.prepare_cached(
            "INSERT INTO xattrs (ino, name, value, born) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (ino, name) DO UPDATE SET value = excluded.value",
        )?
        .execute(params![ino, name, value, g.epoch])?;
        g.touch(ino, false)
    }

    /// The value of an extended attribute.
    pub fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        if !acl::keeps_xattr(name) {
            // Rows of such names set before they were refused are hidden.
            return Err(StoreError::NotSupported);
        }
        if name == CAPS && !view::is_read_only(ino) && !self.seen.may_hold(CAPS) {
            // The kernel asks this before every write(2): answer without
            // waiting for the lock while no file has capabilities.
            return Err(StoreError::NoAttr);
        }
        if view::is_read_only(ino) {
            let mut v = self.view_xattrs(ino, Some(name))?;
            return v.pop().ok_or(StoreError::NoAttr);
        }
        let g = self.lock();
        g.attr(ino)?;
        g.xattr(ino, name)?.ok_or(StoreError::NoAttr)
    }

    /// Names of all extended attributes.
    pub fn listxattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        if view::is_read_only(ino) {
            return self.view_xattrs(ino, None);
        }
        let g = self.lock();
        g.attr(ino)?;
        let mut st =
            g.db.prepare_cached("SELECT name FROM xattrs WHERE ino = ?1 ORDER BY name")?;
        let rows = st.query_map([ino], |r| r.get::<_, Vec<u8>>(0))?;
        let names: Vec<Vec<u8>> = rows.collect::<rusqlite::Result<_>>()?;
        Ok(names.into_iter().filter(|n| acl::keeps_xattr(n)).collect())
    }

    /// Removes an extended attribute.
    pub fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()> {
        if !acl::keeps_xattr(name) {
            return Err(StoreError::NotSupported);
        }
        let g = self.lock();
        let n =
            g.db.prepare_cached("DELETE FROM xattrs WHERE ino = ?1 AND name = ?2")?
                .execute(params![ino, name])?;
        if n == 0 {
            return Err(StoreError::NoAttr);
        }
        g.touch(ino, false)
    }
}

impl Inner {
    /// Up to `max` entries of directory `ino` after cookie `offset`
    /// ("." and ".." first, at offsets 1 and 2).
    fn readdir(&self, ino: u64, offset: i64, max: usize) -> Result<Vec<DirEntry>> {
        self.dir_attr(ino)?;
        let mut out = Vec::new();
        if offset < 1 {
            out.push(DirEntry {
                ino,
                kind: Kind::Dir,
                name: b".".to_vec(),
                next: 1,
            });
        }
        if offset < 2 {
            out.push(DirEntry {
                ino: self.parent_of(ino)?,
                kind: Kind::Dir,
                name: b"..".to_vec(),
                next: 2,
            });
        }
        let mut st = self.db.prepare_cached(READDIR_SQL)?;
        let rows = st.query_map(params![ino, (offset - 3).max(-1), max as i64], |r| {
            Ok(DirEntry {
                next: r.get::<_, i64>(0)? + 3,
                ino: r.get(1)?,
                kind: Kind::from_i64(r.get(2)?),
                name: r.get(3)?,
            })
        })?;
        for e in rows {
            out.push(e?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The statements spell a name's cookie range out as SQL text: each
    /// must end where [`COOKIE_SPAN`] ends it.
    #[test]
    fn sql_cookie_ranges_match_the_span() {
        let last = format!("?2 + {} ", COOKIE_SPAN - 1);
        for sql in [NAME_RANGE, SLOTS_SQL, LOOKUP_SQL] {
            assert_eq!(sql.matches(&last).count(), 1, "{sql}");
        }
    }

    /// The lookup reads its inode's columns in [`attr_of`]'s order.
    #[test]
    fn the_lookup_reads_the_attribute_columns() {
        let cols: Vec<String> = ATTR_COLS.split(", ").map(|c| format!("i.{c}")).collect();
        let sql: String = LOOKUP_SQL.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            sql.contains(&format!("?3, {} FROM", cols.join(", "))),
            "{sql}"
        );
    }
}
