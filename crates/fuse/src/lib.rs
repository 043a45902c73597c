//! `onecopy-fuse`: serves an [`onecopy_store::Store`] through FUSE with
//! `fuser` (pure Rust: no libfuse; mounts directly as root, through
//! `fusermount3` otherwise). Multi-threaded, writeback cache, the largest
//! `max_write` the kernel accepts. [`NullFs`] is the same adapter with
//! writes discarded: the FUSE ceiling the benchmarks compare against.

mod null;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite,
    ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use onecopy_store::{Attr, Kind, NewNode, RenameFlags, SetAttr, SetidKill, Store, StoreError};

/// Kernel mount flags (`ro`, `nosuid`, ...) a caller may add to
/// [`mount_config`]'s options.
pub use fuser::MountOption;
pub use null::NullFs;

/// How long the kernel may cache attributes and names (only this process
/// changes the store).
const TTL: Duration = Duration::from_secs(1);

/// The store as a FUSE filesystem.
pub struct StoreFs {
    store: Arc<Store>,
    /// The store inode the mount's root (FUSE inode 1) stands for: the
    /// store's root, or a snapshot's (`onecopy mount --snapshot`).
    root: u64,
}

impl StoreFs {
    pub fn new(store: Arc<Store>) -> Self {
        StoreFs { store, root: 1 }
    }

    /// A read-only mount of one snapshot: its root is the mount's root.
    pub fn of_snapshot(store: Arc<Store>, root: u64) -> Self {
        StoreFs { store, root }
    }

    /// The store inode a FUSE inode number names.
    fn ino(&self, x: INodeNo) -> u64 {
        if x.0 == 1 {
            self.root
        } else {
            x.0
        }
    }

    /// The FUSE inode number of a store inode: the root's is 1 (and so,
    /// in a snapshot's mount, is the directory above it, which `..` of
    /// the root names).
    fn out(&self, ino: u64) -> u64 {
        let above = self.root != 1 && ino == onecopy_store::SNAPSHOTS_DIR_INO;
        if ino == self.root || above {
            1
        } else {
            ino
        }
    }

    fn fattr(&self, a: &Attr) -> FileAttr {
        FileAttr {
            ino: INodeNo(self.out(a.ino)),
            ..fattr(a)
        }
    }

    fn entry(&self, reply: ReplyEntry, r: Result<Attr, StoreError>) {
        match r {
            Ok(a) => reply.entry(&TTL, &self.fattr(&a), Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }
}

/// FUSE worker threads of a mount unless told otherwise: one per CPU, at
/// least 2 (a slow `fsync` or gc pass does not hold up every other
/// request), at most 16. On this 2-CPU VM 2 threads beat 4 (the former
/// default) at every workload measured (4 rounds alternately): fio 1 MiB
/// 1st write 522 against 406 MB/s, cold read 1016 against 888, `cp -a` of
/// 10,000 files 4.26 against 4.67 s; 1 thread lost on reads and `cp -a`
/// (709 MB/s, 5.88 s), 3 on `cp -a` (4.92 s): a thread beyond the CPUs is
/// a cold thread woken for a request.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 16)
}

/// Mount options and threads used for every onecopy mount.
///
/// The mount's type reads `fuse.onecopy` in /proc/mounts (so `mount -o
/// remount` and `umount -t` find the onecopy helper): fuser passes its
/// `Subtype` only to fusermount3, so a mount made directly by root names
/// the subtype as a kernel option instead.
pub fn mount_config(fsname: &str, threads: usize) -> Config {
    let mut c = Config::default();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let subtype = if unsafe { libc::geteuid() } == 0 {
        MountOption::CUSTOM("subtype=onecopy".into())
    } else {
        MountOption::Subtype("onecopy".into())
    };
    c.mount_options = vec![
        MountOption::FSName(fsname.to_string()),
        subtype,
        MountOption::DefaultPermissions,
    ];
    // Every user may use the mount; the kernel checks permissions.
    c.acl = fuser::SessionACL::All;
    c.n_threads = Some(threads.max(1));
    c.clone_fd = true;
    c
}

/// Mounts `fs` on `mountpoint` and serves it until unmounted.
pub fn serve<F: Filesystem>(fs: F, mountpoint: &Path, config: &Config) -> std::io::Result<()> {
    fuser::mount(fs, mountpoint, config)
}

/// Mounts the store and serves it until unmounted, committing its
/// metadata every second (see the crash model); `ready` runs once the
/// mount is in place (to daemonize).
pub fn serve_store(
    store: Arc<Store>,
    mountpoint: &Path,
    config: &Config,
    ready: impl FnOnce(),
) -> std::io::Result<()> {
    serve_store_at(store, 1, mountpoint, config, ready)
}

/// [`serve_store`] with store inode `root` as the mount's root: 1, or a
/// snapshot's root (`Store::snapshot_root`), then mounted read-only.
pub fn serve_store_at(
    store: Arc<Store>,
    root: u64,
    mountpoint: &Path,
    config: &Config,
    ready: impl FnOnce(),
) -> std::io::Result<()> {
    store.keep_until_forgotten();
    let mut config = config.clone();
    if root != 1 {
        config.mount_options.push(fuser::MountOption::RO);
    }
    let fs = StoreFs::of_snapshot(store.clone(), root);
    let session = fuser::Session::new(fs, mountpoint, &config)?;
    widen_readahead(mountpoint, READAHEAD_KB);
    ready();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let committer = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            // The same error every second (a poisoned store fails every
            // commit until remounted) is reported once.
            let mut last = String::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_secs(1));
                match store.flush_all(false) {
                    Err(e) if e.to_string() != last => {
                        last = e.to_string();
                        eprintln!("onecopy: periodic commit failed: {last}");
                    }
                    Err(_) => {}
                    Ok(()) => last.clear(),
                }
            }
        })
    };
    let pusher = (store.is_remote() || store.is_follower())
        .then(|| spawn_pusher(store.clone(), stop.clone()));
    let r = session.run();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = committer.join();
    if let Some(p) = pusher {
        let _ = p.join();
    }
    store
        .flush_all(true)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    store
        .close_remote()
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    r
}

/// A remote store's pushes to its bucket (or a follower's moves to the
/// bucket's latest state), every [`Store::push_every`], on a thread of
/// their own (a push may wait a minute for uploads; commits go on
/// meanwhile).
fn spawn_pusher(
    store: Arc<Store>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut last = String::new();
        let mut due = std::time::Instant::now() + store.push_every();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(200));
            if std::time::Instant::now() < due {
                continue;
            }
            due = std::time::Instant::now() + store.push_every();
            let r = match store.is_follower() {
                true => store.follow_remote().map(|_| ()),
                false => store.push_remote().map(|_| ()),
            };
            match r {
                Err(e) if e.to_string() != last => {
                    last = e.to_string();
                    eprintln!("onecopy: exchange with the bucket failed: {last}");
                }
                Err(_) => {}
                Ok(_) => last.clear(),
            }
        }
    })
}

/// Readahead asked of the kernel, KiB.
const READAHEAD_KB: u32 = 4096;

/// The kernel keeps a FUSE mount's readahead at the default 128 KiB
/// whatever `max_readahead` the init reply offers; as root, raise it
/// through the mount's backing-device entry in sysfs (found in
/// `/proc/self/mountinfo`: a `stat` of the mount point would wait for
/// this very process). Best effort: unprivileged mounts keep 128 KiB.
fn widen_readahead(mountpoint: &Path, kb: u32) {
    let Ok(mp) = mountpoint.canonicalize() else {
        return;
    };
    let Ok(mounts) = onecopy_ioctl::mounts::read() else {
        return;
    };
    let dev = mounts
        .into_iter()
        .rev()
        .find(|m| m.mount_point == mp)
        .map(|m| m.dev);
    if let Some(dev) = dev {
        let path = format!("/sys/class/bdi/{dev}/read_ahead_kb");
        if let Err(e) = std::fs::write(&path, kb.to_string()) {
            if e.kind() != std::io::ErrorKind::PermissionDenied {
                eprintln!("onecopy: cannot set readahead ({path}): {e}");
            }
        }
    }
}

/// Which set-id bits a `SETATTR` or a `WRITE` clears. The mount
/// negotiates FUSE_HANDLE_KILLPRIV_V2, so the kernel no longer sends the
/// mode change that does it: the filesystem must, at a `chown` (any
/// caller), and at a write, a truncate, or a change of nothing but that
/// (`fallocate` extending a file) by a caller without `CAP_FSETID`. The
/// kernel flags those with FATTR_KILL_SUIDGID, which fuser does not pass
/// on (a caller other than root stands for it), and writes with
/// FUSE_WRITE_KILL_SUIDGID (`write` true). Setgid without group execute
/// goes too when the caller is neither root nor in the file's group, as
/// the VFS does. `security.capability` the kernel still removes itself.
fn setid_kill(store: &Store, req: &Request, ino: u64, set: &SetAttr, write: bool) -> SetidKill {
    let chown = set.uid.is_some() || set.gid.is_some();
    let nothing = set.perm.is_none()
        && set.size.is_none()
        && set.atime_ns.is_none()
        && set.mtime_ns.is_none()
        && set.ctime_ns.is_none();
    let unprivileged = req.uid() != 0;
    if !(chown || unprivileged && (write || set.size.is_some() || nothing)) {
        return SetidKill::Keep;
    }
    match store.getattr(ino) {
        Ok(a) if unprivileged && a.perm & 0o2000 != 0 && !in_group(req, a.gid) => SetidKill::All,
        _ => SetidKill::Exec,
    }
}

/// Sets the kernel options every onecopy mount wants. Among them
/// FUSE_HANDLE_KILLPRIV_V2: the kernel then marks the mount `SB_NOSEC`
/// and stops asking for `security.capability` (a `GETXATTR` round trip)
/// before every `write(2)` of a file that has no setuid, setgid or
/// capability; in exchange the filesystem clears setuid/setgid itself
/// (see [`setid_kill`]). Measured: fio 1 MiB writes waited 2.1 s of 5 s
/// for those answers while the mount's threads were busy storing.
/// READDIRPLUS (with the kernel's AUTO choice): listings carry attributes,
/// no `LOOKUP` per entry for `ls -l`, `find` or `du`. FUSE_POSIX_ACL: the
/// kernel enforces POSIX ACLs (read with GETXATTR and cached) in its
/// permission checks; the store inherits default ACLs and keeps mode and
/// ACL in step (`acl.rs`), with the umask passed through (FUSE_DONT_MASK).
/// FUSE_EXPORT_SUPPORT: file handles (`open_by_handle_at`, NFS export)
/// stay valid after the kernel forgets an inode; it looks the number up
/// again with `.` and `..` (see `Store::lookup`).
///
/// A follower (a read-only mount of a bucket) sees its files change under
/// it at each move to the writer's latest state: no writeback cache, under
/// which the kernel keeps its own size and mtime of a cached file and
/// would serve a file seen mid-write short for as long as it stays
/// cached; and its cached pages are dropped when a file's mtime changes
/// (`AUTO_INVAL_DATA`), as they are when its size does.
pub(crate) fn tune(config: &mut KernelConfig, follower: bool) {
    let caching = match follower {
        false => InitFlags::FUSE_WRITEBACK_CACHE,
        true => InitFlags::FUSE_AUTO_INVAL_DATA,
    };
    let wanted = caching
        | InitFlags::FUSE_PARALLEL_DIROPS
        | InitFlags::FUSE_ASYNC_DIO
        | InitFlags::FUSE_BIG_WRITES
        | InitFlags::FUSE_HANDLE_KILLPRIV_V2
        | InitFlags::FUSE_DO_READDIRPLUS
        | InitFlags::FUSE_READDIRPLUS_AUTO
        | InitFlags::FUSE_POSIX_ACL
        | InitFlags::FUSE_DONT_MASK
        | InitFlags::FUSE_EXPORT_SUPPORT;
    let _ = config.add_capabilities(wanted & config.capabilities());
    let _ = config
        .set_max_readahead(4 << 20)
        .or_else(|max| config.set_max_readahead(max));
    let _ = config.set_max_background(64);
}

/// The answer to `FLUSH`, sent at every `close(2)` after the kernel wrote
/// the file's dirty pages (whose errors `close` returns): ENOSYS, so the
/// kernel stops sending it, one round trip less per file closed. The
/// store has nothing to do there: a file's buffer is stored at `release`
/// and made durable by `fsync`; POSIX locks are the kernel's (no lock
/// calls are implemented), so no lock owner needs the call either.
pub(crate) fn flush_reply(reply: ReplyEmpty) {
    reply.error(Errno::ENOSYS)
}

/// What a times-only SETATTR of an inode the store has deleted gets. The
/// kernel sends one when it writes back a removed file's times (the
/// unlink moved its cached ctime) after the store deleted the nameless,
/// closed file; nobody can see those times any more, and an ENOENT there
/// became an error of the next `syncfs` (`sync -f` after `rm -r` failed).
fn gone(ino: u64) -> Attr {
    Attr {
        ino,
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
    }
}

fn errno(e: StoreError) -> Errno {
    Errno::from_i32(e.errno())
}

fn time(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

fn ns(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i64,
        Err(e) => -(e.duration().as_nanos() as i64),
    }
}

fn tor(t: TimeOrNow) -> i64 {
    match t {
        TimeOrNow::SpecificTime(t) => ns(t),
        TimeOrNow::Now => ns(SystemTime::now()),
    }
}

pub(crate) fn file_type(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::Char => FileType::CharDevice,
        Kind::Block => FileType::BlockDevice,
    }
}

fn kind_of_mode(mode: u32) -> Kind {
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

fn fattr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks(),
        atime: time(a.atime_ns),
        mtime: time(a.mtime_ns),
        ctime: time(a.ctime_ns),
        crtime: time(a.ctime_ns),
        kind: file_type(a.kind),
        perm: a.perm as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: 128 * 1024,
        flags: 0,
    }
}

fn empty(reply: ReplyEmpty, r: Result<(), StoreError>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(e)),
    }
}

fn data(reply: ReplyData, r: Result<Vec<u8>, StoreError>) {
    match r {
        Ok(d) => reply.data(&d),
        Err(e) => reply.error(errno(e)),
    }
}

fn xattr_reply(reply: ReplyXattr, size: u32, r: Result<Vec<u8>, StoreError>) {
    match r {
        Ok(v) if size == 0 => reply.size(v.len() as u32),
        Ok(v) if v.len() <= size as usize => reply.data(&v),
        Ok(_) => reply.error(Errno::ERANGE),
        Err(e) => reply.error(errno(e)),
    }
}

/// Whether the caller's primary or supplementary groups include `gid`.
fn in_group(req: &Request, gid: u32) -> bool {
    if req.gid() == gid {
        return true;
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", req.pid())).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(gid)))
}

/// A new node as asked: the mode unmasked (FUSE_DONT_MASK) and the
/// umask beside it, which the store applies unless the directory has a
/// default ACL.
fn node(req: &Request, mode: u32, umask: u32, rdev: u32) -> NewNode {
    NewNode {
        kind: kind_of_mode(mode),
        perm: mode & 0o7777,
        umask,
        uid: req.uid(),
        gid: req.gid(),
        rdev,
    }
}

/// Answers EIO and returns when the store has shut down (a rolled-back
/// commit: see `Store::check_live`), so the mount serves nothing of a
/// namespace that lost acknowledged work.
/// Answers EROFS and returns when a request would change a snapshot or
/// the directories above them (inode numbers the store calls read-only).
macro_rules! writable {
    ($reply:expr, $($ino:expr),+) => {
        if $(onecopy_store::is_read_only($ino))||+ {
            return $reply.error(Errno::EROFS);
        }
    };
}

macro_rules! live {
    ($fs:expr, $reply:expr) => {
        if let Err(e) = $fs.store.check_live() {
            return $reply.error(errno(e));
        }
    };
}

impl Filesystem for StoreFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        tune(config, self.store.is_follower());
        if config
            .capabilities()
            .contains(InitFlags::FUSE_WRITEBACK_CACHE)
        {
            self.store.leave_file_times_to_kernel();
        }
        Ok(())
    }

    fn destroy(&mut self) {
        if let Err(e) = self.store.flush_all(true) {
            eprintln!("onecopy: final commit failed: {e}");
        }
    }

    /// The kernel dropped the inode (BATCH_FORGET comes here too, one
    /// inode at a time: fuser does not export its type): a nameless one is
    /// deleted now (see `Store::keep_until_forgotten`).
    fn forget(&self, _req: &Request, ino: INodeNo, _nlookup: u64) {
        if let Err(e) = self.store.forget(&[self.ino(ino)]) {
            eprintln!("onecopy: forgetting inode {}: {e}", self.ino(ino));
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        live!(self, reply);
        if name.len() > 255 {
            return reply.error(Errno::ENAMETOOLONG);
        }
        let parent = self.ino(parent);
        if parent == self.root && self.root != 1 && name.as_bytes() == b".." {
            // A snapshot's mount: nothing above its root.
            return self.entry(reply, self.store.getattr(parent));
        }
        self.entry(reply, self.store.lookup(parent, name.as_bytes()))
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        live!(self, reply);
        match self.store.getattr(self.ino(ino)) {
            Ok(a) => reply.attr(&TTL, &self.fattr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(ino));
        // chmod by a non-root caller outside the file's group drops setgid
        // (what the VFS does for local filesystems).
        let mode = mode.map(|m| {
            if req.uid() == 0 || m & 0o2000 == 0 {
                return m;
            }
            match self.store.getattr(self.ino(ino)) {
                Ok(a) if !in_group(req, a.gid) => m & !0o2000,
                _ => m,
            }
        });
        let mut set = SetAttr {
            perm: mode,
            uid,
            gid,
            size,
            atime_ns: atime.map(tor),
            mtime_ns: mtime.map(tor),
            ctime_ns: ctime.map(ns),
            kill_setid: SetidKill::Keep,
        };
        set.kill_setid = setid_kill(&self.store, req, self.ino(ino), &set, false);
        let times_only =
            set.perm.is_none() && set.size.is_none() && set.uid.is_none() && set.gid.is_none();
        match self.store.setattr(self.ino(ino), set) {
            Ok(a) => reply.attr(&TTL, &self.fattr(&a)),
            Err(StoreError::NotFound) if times_only => {
                reply.attr(&TTL, &self.fattr(&gone(self.ino(ino))))
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        live!(self, reply);
        data(reply, self.store.readlink(self.ino(ino)))
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(parent));
        let n = node(req, mode, umask, rdev);
        self.entry(
            reply,
            self.store.mknod(self.ino(parent), name.as_bytes(), n),
        )
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(parent));
        let n = node(req, mode | libc::S_IFDIR, umask, 0);
        self.entry(
            reply,
            self.store.mknod(self.ino(parent), name.as_bytes(), n),
        )
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        live!(self, reply);
        writable!(reply, self.ino(parent));
        empty(reply, self.store.unlink(self.ino(parent), name.as_bytes()))
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        live!(self, reply);
        writable!(reply, self.ino(parent));
        empty(reply, self.store.rmdir(self.ino(parent), name.as_bytes()))
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(parent));
        let t = target.as_os_str().as_bytes();
        self.entry(
            reply,
            self.store
                .symlink(self.ino(parent), name.as_bytes(), t, req.uid(), req.gid()),
        )
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(parent), self.ino(newparent));
        if flags.contains(fuser::RenameFlags::RENAME_WHITEOUT) {
            return reply.error(Errno::EINVAL);
        }
        let f = RenameFlags {
            noreplace: flags.contains(fuser::RenameFlags::RENAME_NOREPLACE),
            exchange: flags.contains(fuser::RenameFlags::RENAME_EXCHANGE),
        };
        let r = self.store.rename(
            self.ino(parent),
            name.as_bytes(),
            self.ino(newparent),
            newname.as_bytes(),
            f,
        );
        empty(reply, r)
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(ino), self.ino(newparent));
        self.entry(
            reply,
            self.store
                .link(self.ino(ino), self.ino(newparent), newname.as_bytes()),
        )
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        live!(self, reply);
        if flags.0 & (libc::O_WRONLY | libc::O_RDWR | libc::O_TRUNC) != 0 {
            writable!(reply, self.ino(ino));
        }
        match self.store.open_file(self.ino(ino)) {
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// A directory open is counted like a file's, so that one removed or
    /// replaced by `rename` while open stays readable (empty, `nlink` 0)
    /// until closed, as on a disk filesystem.
    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        live!(self, reply);
        match self.store.open_file(self.ino(ino)) {
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        empty(reply, self.store.release_file(self.ino(ino)))
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(parent));
        let n = node(req, mode, umask, 0);
        match self.store.create_open(self.ino(parent), name.as_bytes(), n) {
            Ok(a) => reply.created(
                &TTL,
                &self.fattr(&a),
                Generation(0),
                FileHandle(0),
                FopenFlags::empty(),
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        live!(self, reply);
        data(reply, self.store.read(self.ino(ino), offset, size as usize))
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(ino));
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            let mut kill = SetAttr::default();
            kill.kill_setid = setid_kill(&self.store, req, self.ino(ino), &kill, true);
            if let Err(e) = self.store.setattr(self.ino(ino), kill) {
                return reply.error(errno(e));
            }
        }
        match self.store.write(self.ino(ino), offset, data) {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lo: LockOwner,
        reply: ReplyEmpty,
    ) {
        flush_reply(reply)
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        live!(self, reply);
        empty(reply, self.store.release_file(self.ino(ino)))
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        live!(self, reply);
        empty(reply, self.store.fsync(self.ino(ino)))
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        live!(self, reply);
        match self.store.readdir(self.ino(ino), offset as i64, 256) {
            Ok(entries) => {
                for e in entries {
                    let name = OsStr::from_bytes(&e.name);
                    if reply.add(
                        INodeNo(self.out(e.ino)),
                        e.next as u64,
                        file_type(e.kind),
                        name,
                    ) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Entries with their attributes, so that `ls -l`, `find`, `du` and
    /// `rsync` of a directory need no `LOOKUP` per entry (the kernel asks
    /// for this on a directory's first listing and after lookups in it).
    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        live!(self, reply);
        match self.store.readdir_plus(self.ino(ino), offset as i64, 128) {
            Ok(entries) => {
                for (e, a) in entries {
                    let name = OsStr::from_bytes(&e.name);
                    let (next, attr) = (e.next as u64, self.fattr(&a));
                    if reply.add(
                        INodeNo(self.out(e.ino)),
                        next,
                        name,
                        &TTL,
                        &attr,
                        Generation(0),
                    ) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    /// `copy_file_range` (coreutils `cp`, among others): whole chunks are
    /// shared, not copied (`Store::copy_range`). A store error the
    /// kernel could retry as a plain copy (a range overlapping itself)
    /// answers EOPNOTSUPP so that it does.
    #[allow(clippy::too_many_arguments)]
    fn copy_file_range(
        &self,
        _req: &Request,
        ino_in: INodeNo,
        _fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        _fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(ino_out));
        let r = self.store.copy_range(
            self.ino(ino_in),
            offset_in,
            self.ino(ino_out),
            offset_out,
            len,
        );
        match r {
            Ok(n) => reply.written(n.min(u32::MAX as u64) as u32),
            Err(StoreError::Invalid) => reply.error(Errno::EOPNOTSUPP),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(ino));
        empty(
            reply,
            self.store.fallocate(self.ino(ino), offset, length, mode),
        )
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        live!(self, reply);
        empty(reply, self.store.commit(true))
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        live!(self, reply);
        match self.store.statfs() {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, 255, s.bsize,
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Setting an access ACL by a caller neither root nor in the file's
    /// group clears setgid, as the kernel's `posix_acl_update_mode` does
    /// for a disk filesystem (it would tell the filesystem with
    /// FUSE_SETXATTR_ACL_KILL_SGID, which fuser does not parse).
    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        live!(self, reply);
        writable!(reply, self.ino(ino));
        let (create, replace) = (
            flags & libc::XATTR_CREATE != 0,
            flags & libc::XATTR_REPLACE != 0,
        );
        let r = self
            .store
            .setxattr(self.ino(ino), name.as_bytes(), value, create, replace);
        if r.is_ok() && name.as_bytes() == b"system.posix_acl_access" && req.uid() != 0 {
            match self.store.getattr(self.ino(ino)) {
                Ok(a) if a.perm & 0o2000 != 0 && !in_group(req, a.gid) => {
                    let set = SetAttr {
                        perm: Some(a.perm & !0o2000),
                        ..SetAttr::default()
                    };
                    return empty(reply, self.store.setattr(self.ino(ino), set).map(|_| ()));
                }
                Ok(_) => {}
                Err(e) => return reply.error(errno(e)),
            }
        }
        empty(reply, r)
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        live!(self, reply);
        xattr_reply(
            reply,
            size,
            self.store.getxattr(self.ino(ino), name.as_bytes()),
        )
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        live!(self, reply);
        let r = self.store.listxattr(self.ino(ino)).map(|names| {
            names
                .into_iter()
                .flat_map(|mut n| {
                    n.push(0);
                    n
                })
                .collect()
        });
        xattr_reply(reply, size, r)
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        live!(self, reply);
        writable!(reply, self.ino(ino));
        empty(
            reply,
            self.store.removexattr(self.ino(ino), name.as_bytes()),
        )
    }
}
