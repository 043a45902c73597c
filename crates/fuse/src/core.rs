//! The adapter's rules, whatever transport carries the requests: each
//! FUSE operation in the store's terms, answered with a value or an
//! errno. The transports (`dev.rs`: `fuser` reading `/dev/fuse`;
//! `uring.rs`: FUSE over io_uring) only decode requests and encode these
//! answers, so both serve the same filesystem.
//!
//! Invariants every operation keeps: nothing is served once the store
//! has shut down (`Store::check_live`: a rolled-back commit answers EIO
//! from then on); nothing that would change a snapshot or the
//! directories above them is done (EROFS); inode numbers cross the
//! transport mapped by [`Core::ino`] / [`Core::out`], so a snapshot's
//! mount sees its root as inode 1.

use onecopy_store::{
    Attr, DirEntry, Kind, NewNode, RenameFlags, SetAttr, SetidKill, StatFs, Store, StoreError,
};
use std::sync::Arc;

use crate::behind::Behind;

/// A `LOOKUP` answer meaning "no such name" that the kernel keeps for
/// the entry timeout (inode number 0 is never an inode).
pub(crate) const ABSENT: Attr = Attr::ZERO;

/// An errno, as the kernel gets it.
pub(crate) type Errno = i32;

/// An operation's answer.
pub(crate) type Ret<T> = Result<T, Errno>;

/// The credentials a request carries.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

/// An extended attribute answer: the size asked for (a zero-size call),
/// or the value.
pub(crate) enum Xattr {
    Size(u32),
    Data(Vec<u8>),
}

/// The store as the mount sees it.
pub(crate) struct Core {
    pub store: Arc<Store>,
    /// The store inode the mount's root (FUSE inode 1) stands for: the
    /// store's root, or a snapshot's (`onecopy mount --snapshot`).
    root: u64,
    /// Files written in order, whose pages behind the writer may go.
    behind: Behind,
    /// Requests the kernel is told, once, this mount never needs.
    bare: Bare,
}

/// What a snapshot's mount answers ENOSYS, so that the kernel stops
/// asking (a cold `cp -a` out of a snapshot sent `OPEN`, `RELEASE`,
/// `GETXATTR` and `LISTXATTR`, 5.4 of its 7.5 requests per file,
/// bench/notes/snapshots.md). A snapshot never changes, so what is
/// true of it at mount time stays true.
#[derive(Debug, Clone, Copy, Default)]
struct Bare {
    /// `OPEN` of a snapshot's file or directory counts nothing and its
    /// `RELEASE` does nothing (`Store::open_file`). On ENOSYS the kernel
    /// opens without asking (FUSE_NO_OPEN_SUPPORT, FUSE_NO_OPENDIR_SUPPORT:
    /// it keeps pages and directory listings as `FOPEN_KEEP_CACHE` and
    /// `FOPEN_CACHE_DIR` would) and sends no `RELEASE`.
    no_open: bool,
    /// The snapshot holds no extended attribute (no ACL either). On
    /// ENOSYS the kernel answers `EOPNOTSUPP` itself from then on, and
    /// finds no ACL; copies (`cp -a`, libattr) take that as "none".
    no_xattrs: bool,
}

impl Bare {
    fn of(store: &Store, root: u64) -> Bare {
        if root == 1 {
            return Bare::default();
        }
        Bare {
            no_open: true,
            no_xattrs: !store.view_has_xattrs(root).unwrap_or(true),
        }
    }
}

pub(crate) fn errno(e: StoreError) -> Errno {
    e.errno()
}

impl Core {
    pub fn new(store: Arc<Store>, root: u64, behind: Behind) -> Self {
        Core {
            bare: Bare::of(&store, root),
            store,
            root,
            behind,
        }
    }

    /// The store inode a FUSE inode number names.
    pub fn ino(&self, x: u64) -> u64 {
        if x == 1 {
            self.root
        } else {
            x
        }
    }

    /// The FUSE inode number of a store inode: the root's is 1 (and so,
    /// in a snapshot's mount, is the directory above it, which `..` of
    /// the root names).
    pub fn out(&self, ino: u64) -> u64 {
        let above = self.root != 1 && ino == onecopy_store::SNAPSHOTS_DIR_INO;
        if ino == self.root || above {
            1
        } else {
            ino
        }
    }

    /// EIO once the store has shut down (see the module's invariants).
    fn live(&self) -> Ret<()> {
        self.store.check_live().map_err(errno)
    }

    /// [`Core::live`], and EROFS when any of `inos` (FUSE numbers) is a
    /// snapshot's or above them.
    fn writable(&self, inos: &[u64]) -> Ret<()> {
        self.live()?;
        match inos
            .iter()
            .any(|&i| onecopy_store::is_read_only(self.ino(i)))
        {
            true => Err(libc::EROFS),
            false => Ok(()),
        }
    }

    /// The attributes with the inode number the kernel knows.
    fn attr(&self, r: Result<Attr, StoreError>) -> Ret<Attr> {
        let mut a = r.map_err(errno)?;
        a.ino = self.out(a.ino);
        Ok(a)
    }

    /// Whether the store's clock should leave a file's times to the
    /// kernel: it owns mtime and ctime under the writeback cache.
    pub fn init(&self, writeback: bool) {
        if writeback {
            self.store.leave_file_times_to_kernel();
        }
    }

    pub fn destroy(&self) {
        if let Err(e) = self.store.flush_all(true) {
            onecopy_store::warn!("onecopy: final commit failed: {e}");
        }
    }

    /// The kernel dropped the inode: a nameless one is deleted now (see
    /// `Store::keep_until_forgotten`).
    pub fn forget(&self, ino: u64) {
        if let Err(e) = self.store.forget(&[self.ino(ino)]) {
            onecopy_store::warn!("onecopy: forgetting inode {}: {e}", self.ino(ino));
        }
    }

    /// The entry `name` of `parent`; absent, [`ABSENT`] where the kernel
    /// may cache that (see [`Core::caches_absence`]), else `ENOENT`.
    /// `rsync` looks a name up again after making it under a temporary
    /// one, and every program probes names before creating them.
    pub fn lookup(&self, parent: u64, name: &[u8]) -> Ret<Attr> {
        self.live()?;
        if name.len() > 255 {
            return Err(libc::ENAMETOOLONG);
        }
        let parent = self.ino(parent);
        if parent == self.root && self.root != 1 && name == b".." {
            // A snapshot's mount: nothing above its root.
            return self.attr(self.store.getattr(parent));
        }
        match self.attr(self.store.lookup(parent, name)) {
            Err(libc::ENOENT) if self.caches_absence(parent) => Ok(ABSENT),
            r => r,
        }
    }

    /// Whether the kernel may keep "no such name" in directory `parent`
    /// (a store inode) for the entry timeout, like a name it found: only
    /// where every name appears through this kernel, a live directory of
    /// a writer's mount. Snapshot directories (a snapshot made over the
    /// control channel appears there), a snapshot's mount and a follower
    /// (names arrive with pushes) answer `ENOENT`, which is not cached.
    fn caches_absence(&self, parent: u64) -> bool {
        self.root == 1 && !self.store.is_follower() && !onecopy_store::is_read_only(parent)
    }

    pub fn getattr(&self, ino: u64) -> Ret<Attr> {
        self.live()?;
        self.attr(self.store.getattr(self.ino(ino)))
    }

    /// `set.kill_setid` is decided here (see [`setid_kill`]); `kill`
    /// is the kernel's FATTR_KILL_SUIDGID where the transport passes it
    /// on, else whether the caller is not root.
    pub fn setattr(&self, who: Caller, ino: u64, mut set: SetAttr, kill: bool) -> Ret<Attr> {
        self.writable(&[ino])?;
        let ino = self.ino(ino);
        // chmod by a non-root caller outside the file's group drops setgid
        // (what the VFS does for local filesystems).
        if let Some(m) = set.perm.filter(|m| who.uid != 0 && m & 0o2000 != 0) {
            if matches!(self.store.getattr(ino), Ok(a) if !in_group(who, a.gid)) {
                set.perm = Some(m & !0o2000);
            }
        }
        set.kill_setid = setid_kill(&self.store, who, ino, &set, false, kill);
        let times_only =
            set.perm.is_none() && set.size.is_none() && set.uid.is_none() && set.gid.is_none();
        match self.store.setattr(ino, set) {
            Err(StoreError::NotFound) if times_only => Ok(gone(self.out(ino))),
            r => self.attr(r),
        }
    }

    pub fn readlink(&self, ino: u64) -> Ret<Vec<u8>> {
        self.live()?;
        self.store.readlink(self.ino(ino)).map_err(errno)
    }

    /// A new node of the kind `mode` names (`mkdir` passes `S_IFDIR`).
    pub fn mknod(&self, who: Caller, parent: u64, name: &[u8], node: Node) -> Ret<Attr> {
        self.writable(&[parent])?;
        let n = new_node(who, node);
        self.attr(self.store.mknod(self.ino(parent), name, n))
    }

    pub fn unlink(&self, parent: u64, name: &[u8]) -> Ret<()> {
        self.writable(&[parent])?;
        self.store.unlink(self.ino(parent), name).map_err(errno)
    }

    pub fn rmdir(&self, parent: u64, name: &[u8]) -> Ret<()> {
        self.writable(&[parent])?;
        self.store.rmdir(self.ino(parent), name).map_err(errno)
    }

    pub fn symlink(&self, who: Caller, parent: u64, name: &[u8], target: &[u8]) -> Ret<Attr> {
        self.writable(&[parent])?;
        let r = self
            .store
            .symlink(self.ino(parent), name, target, who.uid, who.gid);
        self.attr(r)
    }

    /// `whiteout` (RENAME_WHITEOUT, overlayfs's) is refused: EINVAL.
    pub fn rename(&self, from: (u64, &[u8]), to: (u64, &[u8]), f: Rename) -> Ret<()> {
        self.writable(&[from.0, to.0])?;
        if f.whiteout {
            return Err(libc::EINVAL);
        }
        let flags = RenameFlags {
            noreplace: f.noreplace,
            exchange: f.exchange,
        };
        let r = self
            .store
            .rename(self.ino(from.0), from.1, self.ino(to.0), to.1, flags);
        r.map_err(errno)
    }

    pub fn link(&self, ino: u64, newparent: u64, newname: &[u8]) -> Ret<Attr> {
        self.writable(&[ino, newparent])?;
        let r = self.store.link(self.ino(ino), self.ino(newparent), newname);
        self.attr(r)
    }

    /// A file or directory open is counted, so that one removed or
    /// replaced while open stays readable until closed, as on a disk
    /// filesystem; in a snapshot's mount, ENOSYS (see [`Bare`]).
    pub fn open(&self, ino: u64, flags: i32) -> Ret<()> {
        if self.bare.no_open {
            return Err(libc::ENOSYS);
        }
        match flags & (libc::O_WRONLY | libc::O_RDWR | libc::O_TRUNC) != 0 {
            true => self.writable(&[ino])?,
            false => self.live()?,
        }
        self.store
            .open_file(self.ino(ino))
            .map(|_| ())
            .map_err(errno)
    }

    /// `RELEASE` of a file or a directory, answered at once: the kernel
    /// sends it after `close(2)` returned and waits for nothing, so the
    /// storing of the file's buffer runs on the mount's releasing thread
    /// (`Store::release_later`), on another CPU than the program closing
    /// files (inline, it took a third of that program's CPU: cp -a of
    /// 20,000 files 10.1 s inline, 6.7 s deferred, medians of 4,
    /// bench/notes/store-transport.md).
    pub fn release(&self, ino: u64, dir: bool) -> Ret<()> {
        if !dir {
            self.live()?;
            self.behind.released(ino);
        }
        self.store.release_later(self.ino(ino));
        Ok(())
    }

    pub fn create(&self, who: Caller, parent: u64, name: &[u8], node: Node) -> Ret<Attr> {
        self.writable(&[parent])?;
        let n = new_node(who, node);
        self.attr(self.store.create_open(self.ino(parent), name, n))
    }

    pub fn read(&self, ino: u64, offset: u64, size: u32) -> Ret<Vec<u8>> {
        self.live()?;
        let r = self.store.read(self.ino(ino), offset, size as usize);
        r.map_err(errno)
    }

    /// [`Core::read`] into the transport's reply buffer.
    pub fn read_into(&self, ino: u64, offset: u64, buf: &mut [u8]) -> Ret<usize> {
        self.live()?;
        let r = self.store.read_into(self.ino(ino), offset, buf);
        r.map_err(errno)
    }

    /// Whether a write now would wait for the store's uploads (a request
    /// thread should not: see `dev.rs`'s `Deferred`).
    pub fn write_would_wait(&self) -> bool {
        self.store.write_would_wait()
    }

    /// `kill` is FUSE_WRITE_KILL_SUIDGID.
    pub fn write(&self, who: Caller, ino: u64, offset: u64, data: &[u8], kill: bool) -> Ret<u32> {
        self.writable(&[ino])?;
        let fuse_ino = ino;
        let ino = self.ino(ino);
        if kill {
            let mut set = SetAttr::default();
            set.kill_setid = setid_kill(&self.store, who, ino, &set, true, who.uid != 0);
            self.store.setattr(ino, set).map_err(errno)?;
        }
        let n = self.store.write(ino, offset, data).map_err(errno)?;
        self.behind.wrote(fuse_ino, offset, n as u64);
        Ok(n as u32)
    }

    pub fn fsync(&self, ino: u64) -> Ret<()> {
        self.live()?;
        self.store.fsync(self.ino(ino)).map_err(errno)
    }

    /// A directory's `fsync`: everything committed durably.
    pub fn fsyncdir(&self) -> Ret<()> {
        self.live()?;
        self.store.commit(true).map_err(errno)
    }

    /// Up to `max` entries after cookie `offset`, numbered as the kernel
    /// knows them.
    pub fn readdir(&self, ino: u64, offset: u64, max: usize) -> Ret<Vec<DirEntry>> {
        self.live()?;
        let r = self.store.readdir(self.ino(ino), offset as i64, max);
        let mut entries = r.map_err(errno)?;
        for e in &mut entries {
            e.ino = self.out(e.ino);
        }
        Ok(entries)
    }

    /// Entries with their attributes, so that `ls -l`, `find`, `du` and
    /// `rsync` of a directory need no `LOOKUP` per entry.
    pub fn readdirplus(&self, ino: u64, offset: u64, max: usize) -> Ret<Vec<(DirEntry, Attr)>> {
        self.live()?;
        let r = self.store.readdir_plus(self.ino(ino), offset as i64, max);
        let mut entries = r.map_err(errno)?;
        for (e, a) in &mut entries {
            e.ino = self.out(e.ino);
            a.ino = e.ino;
        }
        Ok(entries)
    }

    /// `copy_file_range` (coreutils `cp`, among others): whole chunks are
    /// shared, not copied (`Store::copy_range`). A store error the
    /// kernel could retry as a plain copy (a range overlapping itself)
    /// answers EOPNOTSUPP so that it does.
    pub fn copy_range(&self, from: (u64, u64), to: (u64, u64), len: u64) -> Ret<u64> {
        self.writable(&[to.0])?;
        let r = self
            .store
            .copy_range(self.ino(from.0), from.1, self.ino(to.0), to.1, len);
        match r {
            Err(StoreError::Invalid) => Err(libc::EOPNOTSUPP),
            r => r.map_err(errno),
        }
    }

    pub fn fallocate(&self, ino: u64, offset: u64, length: u64, mode: i32) -> Ret<()> {
        self.writable(&[ino])?;
        let r = self.store.fallocate(self.ino(ino), offset, length, mode);
        r.map_err(errno)
    }

    pub fn statfs(&self) -> Ret<StatFs> {
        self.live()?;
        self.store.statfs().map_err(errno)
    }

    /// Setting an access ACL by a caller neither root nor in the file's
    /// group clears setgid, as the kernel's `posix_acl_update_mode` does
    /// for a disk filesystem (the kernel's FUSE_SETXATTR_ACL_KILL_SGID
    /// says the same; not every transport passes it on).
    pub fn setxattr(
        &self,
        who: Caller,
        ino: u64,
        name: &[u8],
        value: &[u8],
        flags: i32,
    ) -> Ret<()> {
        self.writable(&[ino])?;
        let ino = self.ino(ino);
        let (create, replace) = (
            flags & libc::XATTR_CREATE != 0,
            flags & libc::XATTR_REPLACE != 0,
        );
        let r = self.store.setxattr(ino, name, value, create, replace);
        if r.is_err() || name != b"system.posix_acl_access" || who.uid == 0 {
            return r.map_err(errno);
        }
        match self.store.getattr(ino).map_err(errno)? {
            a if a.perm & 0o2000 != 0 && !in_group(who, a.gid) => {
                let set = SetAttr {
                    perm: Some(a.perm & !0o2000),
                    ..SetAttr::default()
                };
                self.store.setattr(ino, set).map(|_| ()).map_err(errno)
            }
            _ => Ok(()),
        }
    }

    /// Ok, or ENOSYS in a snapshot's mount that holds no extended
    /// attribute (see [`Bare`]).
    fn serves_xattrs(&self) -> Ret<()> {
        match self.bare.no_xattrs {
            true => Err(libc::ENOSYS),
            false => Ok(()),
        }
    }

    pub fn getxattr(&self, ino: u64, name: &[u8], size: u32) -> Ret<Xattr> {
        self.live()?;
        self.serves_xattrs()?;
        xattr(size, self.store.getxattr(self.ino(ino), name))
    }

    pub fn listxattr(&self, ino: u64, size: u32) -> Ret<Xattr> {
        self.live()?;
        self.serves_xattrs()?;
        let r = self.store.listxattr(self.ino(ino)).map(|names| {
            names
                .into_iter()
                .flat_map(|mut n| {
                    n.push(0);
                    n
                })
                .collect()
        });
        xattr(size, r)
    }

    pub fn removexattr(&self, ino: u64, name: &[u8]) -> Ret<()> {
        self.writable(&[ino])?;
        self.store.removexattr(self.ino(ino), name).map_err(errno)
    }
}

/// A new node's request: the mode unmasked (FUSE_DONT_MASK) with the
/// umask beside it, which the store applies unless the directory has a
/// default ACL.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Node {
    pub mode: u32,
    pub umask: u32,
    pub rdev: u32,
}

/// `rename`'s flags.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Rename {
    pub noreplace: bool,
    pub exchange: bool,
    pub whiteout: bool,
}

fn new_node(who: Caller, n: Node) -> NewNode {
    NewNode {
        kind: kind_of_mode(n.mode),
        perm: n.mode & 0o7777,
        umask: n.umask,
        uid: who.uid,
        gid: who.gid,
        rdev: n.rdev,
    }
}

fn xattr(size: u32, r: Result<Vec<u8>, StoreError>) -> Ret<Xattr> {
    match r.map_err(errno)? {
        v if size == 0 => Ok(Xattr::Size(v.len() as u32)),
        v if v.len() <= size as usize => Ok(Xattr::Data(v)),
        _ => Err(libc::ERANGE),
    }
}

/// Which set-id bits a `SETATTR` or a `WRITE` clears. The mount
/// negotiates FUSE_HANDLE_KILLPRIV_V2, so the kernel no longer sends the
/// mode change that does it: the filesystem must, at a `chown` (any
/// caller), and at a write, a truncate, or a change of nothing but that
/// (`fallocate` extending a file) by a caller without `CAP_FSETID`
/// (`unprivileged`: the kernel's FATTR_KILL_SUIDGID or
/// FUSE_WRITE_KILL_SUIDGID where the transport passes it on, else "not
/// root"; `write` for a write). Setgid without group execute goes too
/// when the caller is neither root nor in the file's group, as the VFS
/// does. `security.capability` the kernel still removes itself.
fn setid_kill(
    store: &Store,
    who: Caller,
    ino: u64,
    set: &SetAttr,
    write: bool,
    unprivileged: bool,
) -> SetidKill {
    let chown = set.uid.is_some() || set.gid.is_some();
    let nothing = set.perm.is_none()
        && set.size.is_none()
        && set.atime_ns.is_none()
        && set.mtime_ns.is_none()
        && set.ctime_ns.is_none();
    if !(chown || unprivileged && (write || set.size.is_some() || nothing)) {
        return SetidKill::Keep;
    }
    match store.getattr(ino) {
        Ok(a) if who.uid != 0 && a.perm & 0o2000 != 0 && !in_group(who, a.gid) => SetidKill::All,
        _ => SetidKill::Exec,
    }
}

/// Whether the caller's primary or supplementary groups include `gid`.
fn in_group(who: Caller, gid: u32) -> bool {
    if who.gid == gid {
        return true;
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", who.pid)).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(gid)))
}

/// What a times-only SETATTR of an inode the store has deleted gets. The
/// kernel sends one when it writes back a removed file's times (the
/// unlink moved its cached ctime) after the store deleted the nameless,
/// closed file; nobody can see those times any more, and an ENOENT there
/// became an error of the next `syncfs` (`sync -f` after `rm -r` failed).
fn gone(ino: u64) -> Attr {
    Attr { ino, ..ABSENT }
}

pub(crate) fn kind_of_mode(mode: u32) -> Kind {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => Kind::Dir,
        libc::S_IFIFO => Kind::Fifo,
        libc::S_IFSOCK => Kind::Socket,
        libc::S_IFCHR => Kind::Char,
        libc::S_IFBLK => Kind::Block,
        libc::S_IFLNK => Kind::Symlink,
        _ => Kind::File,
    }
}
