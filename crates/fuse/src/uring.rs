//! The FUSE-over-io_uring transport (`-o transport=uring`): the kernel
//! hands each request to a ring of the CPU its caller runs on, served by
//! a worker thread pinned there (`fractal-fuse`, async on compio), so a
//! program's one-at-a-time requests never wait for a wake-up on another
//! CPU: measured at half fuser's time for `cp -a` of small files
//! (bench/notes/store-transport.md). [`UringFs`] answers from the same
//! [`Core`] as the `/dev/fuse` transport.
//!
//! A worker serves every request of its CPU in turn, so what may block
//! for long (a `fsync`'s durable commit, sharing or promising ranges)
//! runs on compio's blocking pool and the worker goes on, and so do big
//! reads and writes ([`INLINE_IO_MAX`]); lookups, attributes, small
//! reads and writes and `release` (whose storing of the file's buffer
//! the store leaves to its releasing thread: `Core::release`) are
//! answered inline.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;
use std::time::SystemTime;

use fractal_fuse::{
    DirectoryEntry, DirectoryEntryPlus, FileAttr, FileHandleId, FileType, Filesystem, FsResult,
    InodeId, ReplyAttr, ReplyCreate, ReplyEntry, ReplyInit, ReplyOpen, ReplyReadlink, ReplyStatfs,
    ReplyXattr, Request, SetAttrTime, Timestamp,
};
use onecopy_store::{Attr, Kind, SetAttr, SetidKill};

use fractal_fuse::abi;

use crate::core::{Caller, Core, Node, Rename, Ret, Xattr};
use crate::lend::{lend, lend_mut};
use crate::TTL;

/// The store as a `fractal-fuse` filesystem, and where it is mounted.
pub(crate) struct UringFs(pub Arc<Core>, std::path::PathBuf);

fn who(req: &Request) -> Caller {
    Caller {
        uid: req.uid,
        gid: req.gid,
        pid: req.pid,
    }
}

/// A time in the wire's form: seconds as the kernel's two's complement
/// (times before 1970 are negative) and nanoseconds below one second.
fn ts(ns: i64) -> Timestamp {
    let sec = ns.div_euclid(1_000_000_000);
    Timestamp::new(sec as u64, ns.rem_euclid(1_000_000_000) as u32)
}

fn ns_of(t: SetAttrTime) -> i64 {
    match t {
        SetAttrTime::Now => crate::ns(SystemTime::now()),
        SetAttrTime::Specific(t) => wire_ns(t),
    }
}

fn wire_ns(t: Timestamp) -> i64 {
    (t.sec as i64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.nsec as i64)
}

fn kind(k: Kind) -> FileType {
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

fn fattr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: a.ino,
        size: a.size,
        blocks: a.blocks(),
        atime: ts(a.atime_ns),
        mtime: ts(a.mtime_ns),
        ctime: ts(a.ctime_ns),
        mode: kind(a.kind).to_mode() | a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: crate::BLKSIZE,
    }
}

/// The smallest `fuse_dirent` (24 bytes and a one-byte name, 8-aligned)
/// and `fuse_direntplus` (a `fuse_entry_out` of 128 bytes more).
const DIRENT_MIN: usize = 32;
const DIRENTPLUS_MIN: usize = 160;

/// How many entries of at least `min` bytes a listing of `size` bytes
/// can hold: the most worth reading for it. This kernel asks for up to
/// 128 KiB at once; a listing cut at a fixed 128 entries left the rest
/// of a large directory to plain `READDIR`s, after which each of its
/// entries cost a `LOOKUP`. At most 1,024, for the store's lock.
fn fitting(size: u32, min: usize) -> usize {
    (size as usize / min).clamp(1, 1024)
}

fn entry(r: Ret<Attr>) -> FsResult<ReplyEntry> {
    r.map(|a| ReplyEntry {
        ttl: TTL,
        attr: fattr(&a),
        generation: 0,
    })
}

fn attr(r: Ret<Attr>) -> FsResult<ReplyAttr> {
    r.map(|a| ReplyAttr {
        ttl: TTL,
        attr: fattr(&a),
    })
}

fn opened(r: Ret<()>) -> FsResult<ReplyOpen> {
    r.map(|()| ReplyOpen {
        fh: FileHandleId(0),
        flags: 0,
        backing_id: 0,
    })
}

fn xattr(r: Ret<Xattr>) -> FsResult<ReplyXattr> {
    r.map(|x| match x {
        Xattr::Size(n) => ReplyXattr::Size(n),
        Xattr::Data(v) => ReplyXattr::Data(v),
    })
}

impl UringFs {
    /// Runs `op` on compio's blocking pool (see the module's note); a
    /// panic there answers EIO.
    async fn blocking<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Core) -> Ret<T> + Send + 'static,
    ) -> Ret<T> {
        let core = self.0.clone();
        compio_runtime::spawn_blocking(move || {
            // The pool's threads inherit the worker's pin to one CPU.
            onecopy_store::unpin_thread();
            op(&core)
        })
        .await
        .unwrap_or(Err(libc::EIO))
    }
}

impl Filesystem for UringFs {
    async fn init(&self, _req: Request) -> FsResult<ReplyInit> {
        Ok(ReplyInit {
            max_write: MAX_WRITE,
            max_readahead: 4 << 20,
            max_background: 64,
            congestion_threshold: 48,
        })
    }

    /// Also widens the mount's readahead now: the kernel takes the init
    /// reply's (at most its own 128 KiB) when it reads it, which over
    /// this transport is after the mount returned, so a widening before
    /// it was undone (cold reads of a big file went in 256 KiB `READ`s,
    /// two at a time: bench/notes/store-transport.md, "Four ring entries
    /// per CPU; readahead over io_uring"). On a thread of its own: it
    /// reads the mount table while the rings are not serving yet.
    fn negotiated(&self, flags: u64) {
        self.0.init(flags & abi::FUSE_WRITEBACK_CACHE as u64 != 0);
        let mountpoint = self.1.clone();
        let _ = std::thread::Builder::new()
            .name("onecopy-readahead".into())
            .spawn(move || crate::widen_readahead(&mountpoint));
    }

    async fn destroy(&self) {
        let core = self.0.clone();
        let _ = compio_runtime::spawn_blocking(move || core.destroy()).await;
    }

    fn forget(&self, _req: Request, inode: InodeId, _nlookup: u64) {
        self.0.forget(inode.0)
    }

    async fn lookup(&self, _req: Request, parent: InodeId, name: &OsStr) -> FsResult<ReplyEntry> {
        entry(self.0.lookup(parent.0, name.as_bytes()))
    }

    async fn getattr(
        &self,
        _req: Request,
        inode: InodeId,
        _fh: Option<FileHandleId>,
        _flags: u32,
    ) -> FsResult<ReplyAttr> {
        attr(self.0.getattr(inode.0))
    }

    async fn setattr(
        &self,
        req: Request,
        inode: InodeId,
        _fh: Option<FileHandleId>,
        s: fractal_fuse::SetAttr,
    ) -> FsResult<ReplyAttr> {
        let set = SetAttr {
            perm: s.mode.map(|m| m & 0o7777),
            uid: s.uid,
            gid: s.gid,
            size: s.size,
            atime_ns: s.atime.map(ns_of),
            mtime_ns: s.mtime.map(ns_of),
            ctime_ns: s.ctime.map(wire_ns),
            kill_setid: SetidKill::Keep,
        };
        // FATTR_KILL_SUIDGID, or (as the `/dev/fuse` transport does) a
        // caller other than root.
        let kill = s.kill_suidgid || req.uid != 0;
        attr(self.0.setattr(who(&req), inode.0, set, kill))
    }

    async fn readlink(&self, _req: Request, inode: InodeId) -> FsResult<ReplyReadlink> {
        self.0.readlink(inode.0).map(|data| ReplyReadlink { data })
    }

    async fn symlink(
        &self,
        req: Request,
        parent: InodeId,
        name: &OsStr,
        link: &OsStr,
    ) -> FsResult<ReplyEntry> {
        let (name, link) = (name.as_bytes(), link.as_bytes());
        entry(self.0.symlink(who(&req), parent.0, name, link))
    }

    async fn mknod_ext(
        &self,
        req: Request,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        umask: u32,
    ) -> FsResult<ReplyEntry> {
        let n = Node { mode, umask, rdev };
        entry(self.0.mknod(who(&req), parent.0, name.as_bytes(), n))
    }

    async fn mkdir(
        &self,
        req: Request,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        umask: u32,
    ) -> FsResult<ReplyEntry> {
        let mode = mode | libc::S_IFDIR;
        let n = Node {
            mode,
            umask,
            rdev: 0,
        };
        entry(self.0.mknod(who(&req), parent.0, name.as_bytes(), n))
    }

    async fn unlink(&self, _req: Request, parent: InodeId, name: &OsStr) -> FsResult<()> {
        self.0.unlink(parent.0, name.as_bytes())
    }

    async fn rmdir(&self, _req: Request, parent: InodeId, name: &OsStr) -> FsResult<()> {
        self.0.rmdir(parent.0, name.as_bytes())
    }

    async fn rename(
        &self,
        _req: Request,
        parent: InodeId,
        name: &OsStr,
        new_parent: InodeId,
        new_name: &OsStr,
        flags: u32,
    ) -> FsResult<()> {
        let f = Rename {
            noreplace: flags & libc::RENAME_NOREPLACE != 0,
            exchange: flags & libc::RENAME_EXCHANGE != 0,
            whiteout: flags & libc::RENAME_WHITEOUT != 0,
        };
        let (from, to) = (
            (parent.0, name.as_bytes()),
            (new_parent.0, new_name.as_bytes()),
        );
        self.0.rename(from, to, f)
    }

    async fn link(
        &self,
        _req: Request,
        inode: InodeId,
        new_parent: InodeId,
        new_name: &OsStr,
    ) -> FsResult<ReplyEntry> {
        entry(self.0.link(inode.0, new_parent.0, new_name.as_bytes()))
    }

    async fn open(&self, _req: Request, inode: InodeId, flags: u32) -> FsResult<ReplyOpen> {
        opened(self.0.open(inode.0, flags as i32))
    }

    async fn read(
        &self,
        _req: Request,
        inode: InodeId,
        _fh: FileHandleId,
        offset: u64,
        buf: &mut [u8],
    ) -> FsResult<usize> {
        if buf.len() < INLINE_IO_MAX {
            return self.0.read_into(inode.0, offset, buf);
        }
        // On the pool, so that the kernel's readahead `READ`s of one CPU
        // are served side by side, into the ring's buffer (`crate::lend`).
        // SAFETY: `_lender` is dropped when this future ends or is dropped.
        let (ino, (_lender, mut loan)) = (inode.0, unsafe { lend_mut(buf) });
        self.blocking(move |c| c.read_into(ino, offset, loan.bytes_mut()))
            .await
    }

    async fn write(
        &self,
        req: Request,
        inode: InodeId,
        _fh: FileHandleId,
        offset: u64,
        data: &[u8],
        write_flags: u32,
        _flags: u32,
    ) -> FsResult<usize> {
        let (kill, who, ino) = (write_flags & WRITE_KILL_SUIDGID != 0, who(&req), inode.0);
        // A write that would wait for uploads waits on the pool, not in
        // the ring's worker (which would stall the ring's other requests).
        if data.len() < INLINE_IO_MAX && !self.0.write_would_wait() {
            return Ok(self.0.write(who, ino, offset, data, kill)? as usize);
        }
        // The bytes are read where the ring holds them (`crate::lend`).
        // SAFETY: `_lender` is dropped when this future ends or is dropped.
        let (_lender, loan) = unsafe { lend(data) };
        let n = self
            .blocking(move |c| c.write(who, ino, offset, loan.bytes(), kill))
            .await?;
        Ok(n as usize)
    }

    /// ENOSYS, so the kernel stops sending it (see `dev::flush_reply`).
    async fn flush(
        &self,
        _req: Request,
        _inode: InodeId,
        _fh: FileHandleId,
        _lock_owner: u64,
    ) -> FsResult<()> {
        Err(libc::ENOSYS)
    }

    async fn release(
        &self,
        _req: Request,
        inode: InodeId,
        _fh: FileHandleId,
        _flags: u32,
        _lock_owner: u64,
        _flush: bool,
        _flock_release: bool,
    ) -> FsResult<()> {
        self.0.release(inode.0, false)
    }

    async fn fsync(
        &self,
        _req: Request,
        inode: InodeId,
        _fh: FileHandleId,
        _datasync: bool,
    ) -> FsResult<()> {
        let ino = inode.0;
        self.blocking(move |c| c.fsync(ino)).await
    }

    async fn opendir(&self, _req: Request, inode: InodeId, _flags: u32) -> FsResult<ReplyOpen> {
        opened(self.0.open(inode.0, libc::O_RDONLY))
    }

    async fn readdir(
        &self,
        _req: Request,
        inode: InodeId,
        _fh: FileHandleId,
        offset: u64,
        size: u32,
    ) -> FsResult<Vec<DirectoryEntry>> {
        let entries = self.0.readdir(inode.0, offset, fitting(size, DIRENT_MIN))?;
        let entries = entries.into_iter().map(|e| DirectoryEntry {
            ino: e.ino,
            offset: e.next as u64,
            kind: kind(e.kind),
            name: e.name,
        });
        Ok(entries.collect())
    }

    async fn readdirplus(
        &self,
        _req: Request,
        inode: InodeId,
        _fh: FileHandleId,
        offset: u64,
        size: u32,
    ) -> FsResult<Vec<DirectoryEntryPlus>> {
        let max = fitting(size, DIRENTPLUS_MIN);
        let entries = self.0.readdirplus(inode.0, offset, max)?;
        let entries = entries.into_iter().map(|(e, a)| DirectoryEntryPlus {
            ino: e.ino,
            offset: e.next as u64,
            kind: kind(e.kind),
            name: e.name,
            entry_ttl: TTL,
            attr: fattr(&a),
            generation: 0,
        });
        Ok(entries.collect())
    }

    async fn releasedir(
        &self,
        _req: Request,
        inode: InodeId,
        _fh: FileHandleId,
        _flags: u32,
    ) -> FsResult<()> {
        self.0.release(inode.0, true)
    }

    async fn fsyncdir(
        &self,
        _req: Request,
        _inode: InodeId,
        _fh: FileHandleId,
        _datasync: bool,
    ) -> FsResult<()> {
        self.blocking(|c| c.fsyncdir()).await
    }

    async fn statfs(&self, _req: Request, _inode: InodeId) -> FsResult<ReplyStatfs> {
        let s = self.0.statfs()?;
        Ok(ReplyStatfs {
            blocks: s.blocks,
            bfree: s.bfree,
            bavail: s.bavail,
            files: s.files,
            ffree: s.ffree,
            bsize: s.bsize,
            namelen: 255,
            frsize: s.bsize,
        })
    }

    async fn create_ext(
        &self,
        req: Request,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: u32,
        _open_flags: u32,
    ) -> FsResult<ReplyCreate> {
        let n = Node {
            mode,
            umask,
            rdev: 0,
        };
        let a = self.0.create(who(&req), parent.0, name.as_bytes(), n)?;
        Ok(ReplyCreate {
            ttl: TTL,
            attr: fattr(&a),
            generation: 0,
            fh: FileHandleId(0),
            flags: 0,
        })
    }

    async fn fallocate(
        &self,
        _req: Request,
        inode: InodeId,
        _fh: FileHandleId,
        offset: u64,
        length: u64,
        mode: u32,
    ) -> FsResult<()> {
        let ino = inode.0;
        self.blocking(move |c| c.fallocate(ino, offset, length, mode as i32))
            .await
    }

    async fn copy_file_range(
        &self,
        _req: Request,
        inode_in: InodeId,
        _fh_in: FileHandleId,
        off_in: u64,
        inode_out: InodeId,
        _fh_out: FileHandleId,
        off_out: u64,
        length: u64,
        _flags: u64,
    ) -> FsResult<usize> {
        let (from, to) = ((inode_in.0, off_in), (inode_out.0, off_out));
        let n = self
            .blocking(move |c| c.copy_range(from, to, length))
            .await?;
        Ok(n as usize)
    }

    async fn setxattr(
        &self,
        req: Request,
        inode: InodeId,
        name: &OsStr,
        value: &[u8],
        flags: u32,
    ) -> FsResult<()> {
        let name = name.as_bytes();
        self.0
            .setxattr(who(&req), inode.0, name, value, flags as i32)
    }

    async fn getxattr(
        &self,
        _req: Request,
        inode: InodeId,
        name: &OsStr,
        size: u32,
    ) -> FsResult<ReplyXattr> {
        xattr(self.0.getxattr(inode.0, name.as_bytes(), size))
    }

    async fn listxattr(&self, _req: Request, inode: InodeId, size: u32) -> FsResult<ReplyXattr> {
        xattr(self.0.listxattr(inode.0, size))
    }

    async fn removexattr(&self, _req: Request, inode: InodeId, name: &OsStr) -> FsResult<()> {
        self.0.removexattr(inode.0, name.as_bytes())
    }
}

/// FUSE_WRITE_KILL_SUIDGID in a `WRITE`'s flags.
const WRITE_KILL_SUIDGID: u32 = 1 << 2;

/// The largest write the kernel sends (its `max_pages_limit`, 256 pages,
/// by default): each ring entry holds a buffer of this size.
const MAX_WRITE: u32 = 1 << 20;

/// A mounted io_uring session and the filesystem it will serve.
pub(crate) struct Session {
    session: fractal_fuse::Session,
    fs: UringFs,
}

impl Session {
    /// Notifications to the kernel (usable for the whole mount's life).
    pub fn notifier(&self) -> fractal_fuse::FuseNotifier {
        fractal_fuse::FuseNotifier::from(self.session.fuse_fd())
    }

    /// Serves requests until the filesystem is unmounted.
    pub fn run(self) -> std::io::Result<()> {
        self.session.run(self.fs)
    }
}

/// The kernel options every onecopy mount asks for beyond the crate's
/// defaults, as `crate::tune` does for the `/dev/fuse` transport (see
/// there why each): the writeback cache (`AUTO_INVAL_DATA` for a
/// follower instead), KILLPRIV_V2, POSIX ACLs with the umask passed
/// through, and export support.
fn init_flags(follower: bool) -> u64 {
    let caching = match follower {
        false => abi::FUSE_WRITEBACK_CACHE,
        true => abi::FUSE_AUTO_INVAL_DATA,
    };
    [
        caching,
        abi::FUSE_HANDLE_KILLPRIV_V2,
        abi::FUSE_POSIX_ACL,
        abi::FUSE_DONT_MASK,
        abi::FUSE_EXPORT_SUPPORT,
    ]
    .iter()
    .fold(0, |f, &x| f | x as u64)
}

/// The crate's default flags a onecopy mount does without: the store's
/// `open` does not truncate (no `ATOMIC_O_TRUNC`: the kernel sends a
/// `SETATTR` instead), and under the writeback cache the kernel's own
/// size and times must not be dropped at every attribute change
/// (`AUTO_INVAL_DATA`, which a follower asks for again).
fn not_wanted(follower: bool) -> u64 {
    let inval = match follower {
        false => abi::FUSE_AUTO_INVAL_DATA,
        true => 0,
    };
    (abi::FUSE_ATOMIC_O_TRUNC | inval) as u64
}

/// Reads and writes of at least this many bytes run on the blocking
/// pool, so that the worker goes on with the next request: the kernel
/// queues a file's writeback, and a reader's readahead, on the ring of
/// the CPU that sends them, and served inline, one at a time, big writes
/// reached 0.70x the `/dev/fuse` transport's speed, whose threads take
/// any request; on the pool, 1 MiB writes of a 2 GiB file went 400 ->
/// 455 MB/s (medians of 5), and cold reads of it, once the readahead was
/// 4 MiB, 747-873 -> 944-1,138 MiB/s (4 rounds alternating;
/// bench/notes/store-transport.md, "Four ring entries per CPU;
/// readahead over io_uring"). Smaller ones, the small files' path, stay
/// inline.
const INLINE_IO_MAX: usize = 128 << 10;

/// Ring entries per CPU: requests one CPU's callers may have in flight.
/// Each entry maps a [`MAX_WRITE`] buffer, made resident as requests
/// reach it (PATCHES.md 11): at most 16 MiB per CPU. A request
/// sent to the blocking pool keeps its entry until it is answered, and
/// writes held there for a slow bucket can be many: at 4 entries (whose
/// 2nd write of a 2 GiB file went 795 -> 980 MB/s) they took every entry
/// of a CPU and a `mkdir` from it waited 27 s (test
/// `a_slow_bucket_holds_writers_not_the_mount`; bench/notes/store-transport.md,
/// "Four ring entries per CPU; readahead over io_uring").
const QUEUE_DEPTH: u16 = 16;

/// Mounts `core`'s store with the options of `config` (the `/dev/fuse`
/// transport's, translated) and the kernel options every onecopy mount
/// wants (see `crate::tune`).
pub(crate) fn session(
    core: Core,
    mountpoint: &std::path::Path,
    config: &fuser::Config,
) -> std::io::Result<Session> {
    use fuser::MountOption as M;
    let mut opts = fractal_fuse::MountOptions::new()
        .allow_other(true)
        .init_flags(
            init_flags(core.store.is_follower()),
            not_wanted(core.store.is_follower()),
        );
    let mut custom = Vec::new();
    for o in &config.mount_options {
        match o {
            M::FSName(n) => opts = opts.fs_name(n.clone()),
            M::Subtype(t) => opts = opts.subtype(t.clone()),
            M::CUSTOM(c) => match c.strip_prefix("subtype=") {
                Some(t) => opts = opts.subtype(t),
                None => custom.push(c.clone()),
            },
            M::DefaultPermissions => opts = opts.default_permissions(true),
            M::RO => opts = opts.read_only(true),
            M::NoSuid => custom.push("nosuid".into()),
            M::Suid => custom.push("suid".into()),
            M::NoDev => custom.push("nodev".into()),
            M::Dev => custom.push("dev".into()),
            M::NoExec => custom.push("noexec".into()),
            M::Exec => custom.push("exec".into()),
            M::RW => custom.push("rw".into()),
            M::NoAtime => custom.push("noatime".into()),
            M::Atime => custom.push("atime".into()),
            M::Sync => custom.push("sync".into()),
            M::DirSync => custom.push("dirsync".into()),
            other => {
                let e = format!("mount option {other:?} is not offered over io_uring");
                return Err(std::io::Error::new(std::io::ErrorKind::Unsupported, e));
            }
        }
    }
    if !custom.is_empty() {
        opts = opts.custom_options(custom.join(","));
    }
    let session = fractal_fuse::Session::new(mountpoint.to_path_buf(), opts)?
        .with_worker_count(config.n_threads.unwrap_or(2))
        .with_queue_depth(QUEUE_DEPTH);
    let fs = UringFs(Arc::new(core), mountpoint.to_path_buf());
    Ok(Session { session, fs })
}
