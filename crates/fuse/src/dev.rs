//! The `/dev/fuse` transport: `fuser` reads requests on one thread per
//! CPU (each with a cloned descriptor) and [`StoreFs`] answers them from
//! [`Core`]. Nothing here decides anything: it converts.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::SystemTime;

use fuser::{
    Errno, FileAttr, FileHandle, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
    Request, TimeOrNow, WriteFlags,
};
use onecopy_store::{Attr, SetAttr, SetidKill};

use crate::core::{Caller, Core, Node, Rename, Ret, Xattr};
use crate::{file_type, ns, TTL};

/// The store as a `fuser` filesystem.
pub(crate) struct StoreFs(pub Arc<Core>, Deferred);

impl StoreFs {
    pub fn new(core: Core) -> StoreFs {
        StoreFs(Arc::new(core), Deferred::start())
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Writes that would wait for a remote store's uploads, done in order on a
/// thread of their own: a request thread held there stalled every other
/// request it would have served, for as long as an upload takes (on a
/// slow uplink, each held thread froze the mount for seconds). The kernel
/// bounds what waits here (background writes: `max_background`; others
/// hold their caller), and orders what depends on a write (fsync, flush,
/// truncate) after its reply.
struct Deferred {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Deferred {
    /// Without the thread (it could not start) writes wait in place.
    fn start() -> Deferred {
        let (tx, rx) = channel::<Job>();
        let spawned = std::thread::Builder::new()
            .name("held-writes".into())
            .spawn(move || rx.into_iter().for_each(|job| job()));
        match spawned {
            Ok(t) => Deferred {
                tx: Some(tx),
                thread: Some(t),
            },
            Err(_) => Deferred {
                tx: None,
                thread: None,
            },
        }
    }

    /// Runs `job` on the thread, or here if it is gone.
    fn run(&self, job: Job) {
        let Some(tx) = &self.tx else {
            return job();
        };
        if let Err(e) = tx.send(job) {
            (e.0)()
        }
    }

    /// Waits until every write handed over is done.
    fn finish(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Deferred {
    fn drop(&mut self) {
        self.finish()
    }
}

fn who(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        pid: req.pid(),
    }
}

pub(crate) fn fattr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks(),
        atime: crate::time(a.atime_ns),
        mtime: crate::time(a.mtime_ns),
        ctime: crate::time(a.ctime_ns),
        crtime: crate::time(a.ctime_ns),
        kind: file_type(a.kind),
        perm: a.perm as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: crate::BLKSIZE,
        flags: 0,
    }
}

fn tor(t: TimeOrNow) -> i64 {
    match t {
        TimeOrNow::SpecificTime(t) => ns(t),
        TimeOrNow::Now => ns(SystemTime::now()),
    }
}

fn entry(reply: ReplyEntry, r: Ret<Attr>) {
    match r {
        Ok(a) => reply.entry(&TTL, &fattr(&a), Generation(0)),
        Err(e) => reply.error(Errno::from_i32(e)),
    }
}

fn attr(reply: ReplyAttr, r: Ret<Attr>) {
    match r {
        Ok(a) => reply.attr(&TTL, &fattr(&a)),
        Err(e) => reply.error(Errno::from_i32(e)),
    }
}

fn empty(reply: ReplyEmpty, r: Ret<()>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(Errno::from_i32(e)),
    }
}

fn opened(reply: ReplyOpen, r: Ret<()>) {
    match r {
        Ok(()) => reply.opened(FileHandle(0), FopenFlags::empty()),
        Err(e) => reply.error(Errno::from_i32(e)),
    }
}

fn data(reply: ReplyData, r: Ret<Vec<u8>>) {
    match r {
        Ok(d) => reply.data(&d),
        Err(e) => reply.error(Errno::from_i32(e)),
    }
}

/// Fills a listing reply from batches of up to `n` entries read after a
/// cookie (`batch(after, n)`), until `add` says the reply is full (it returns that and the
/// entry's cookie) or the directory ends. The kernel asks for up to 128
/// KiB at once here; one batch of 128 left the rest of a large directory
/// to plain `READDIR`s, after which each entry cost a `LOOKUP`. An error
/// after some entries ends the reply with them (the kernel's next
/// request meets it again).
fn fill_listing<T>(
    mut after: u64,
    n: usize,
    batch: impl Fn(u64, usize) -> Ret<Vec<T>>,
    mut add: impl FnMut(T) -> (bool, u64),
) -> Ret<()> {
    let mut added = false;
    loop {
        let entries = match batch(after, n) {
            Ok(e) => e,
            Err(_) if added => return Ok(()),
            Err(e) => return Err(e),
        };
        let more = entries.len() == n;
        for e in entries {
            let (full, next) = add(e);
            if full {
                return Ok(());
            }
            (after, added) = (next, true);
        }
        if !more {
            return Ok(());
        }
    }
}

fn written(reply: ReplyWrite, r: Ret<u64>) {
    match r {
        Ok(n) => reply.written(n.min(u32::MAX as u64) as u32),
        Err(e) => reply.error(Errno::from_i32(e)),
    }
}

fn xattr(reply: ReplyXattr, r: Ret<Xattr>) {
    match r {
        Ok(Xattr::Size(n)) => reply.size(n),
        Ok(Xattr::Data(v)) => reply.data(&v),
        Err(e) => reply.error(Errno::from_i32(e)),
    }
}

impl Filesystem for StoreFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        crate::tune(config, self.0.store.is_follower());
        let caps = config.capabilities();
        self.0.init(caps.contains(InitFlags::FUSE_WRITEBACK_CACHE));
        Ok(())
    }

    /// Held writes are done before the last commit.
    fn destroy(&mut self) {
        self.1.finish();
        self.0.destroy()
    }

    /// BATCH_FORGET comes here too, one inode at a time: fuser does not
    /// export its type.
    fn forget(&self, _req: &Request, ino: INodeNo, _nlookup: u64) {
        self.0.forget(ino.0)
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        entry(reply, self.0.lookup(parent.0, name.as_bytes()))
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        attr(reply, self.0.getattr(ino.0))
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
        let set = SetAttr {
            perm: mode,
            uid,
            gid,
            size,
            atime_ns: atime.map(tor),
            mtime_ns: mtime.map(tor),
            ctime_ns: ctime.map(ns),
            kill_setid: SetidKill::Keep,
        };
        // fuser does not pass FATTR_KILL_SUIDGID on: a caller other than
        // root stands for it.
        attr(reply, self.0.setattr(who(req), ino.0, set, req.uid() != 0))
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        data(reply, self.0.readlink(ino.0))
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
        let n = Node { mode, umask, rdev };
        entry(reply, self.0.mknod(who(req), parent.0, name.as_bytes(), n))
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
        let mode = mode | libc::S_IFDIR;
        let n = Node {
            mode,
            umask,
            rdev: 0,
        };
        entry(reply, self.0.mknod(who(req), parent.0, name.as_bytes(), n))
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.0.unlink(parent.0, name.as_bytes()))
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.0.rmdir(parent.0, name.as_bytes()))
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let t = target.as_os_str().as_bytes();
        entry(
            reply,
            self.0.symlink(who(req), parent.0, name.as_bytes(), t),
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
        let f = Rename {
            noreplace: flags.contains(fuser::RenameFlags::RENAME_NOREPLACE),
            exchange: flags.contains(fuser::RenameFlags::RENAME_EXCHANGE),
            whiteout: flags.contains(fuser::RenameFlags::RENAME_WHITEOUT),
        };
        let (from, to) = (
            (parent.0, name.as_bytes()),
            (newparent.0, newname.as_bytes()),
        );
        empty(reply, self.0.rename(from, to, f))
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        entry(reply, self.0.link(ino.0, newparent.0, newname.as_bytes()))
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        opened(reply, self.0.open(ino.0, flags.0))
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        opened(reply, self.0.open(ino.0, libc::O_RDONLY))
    }

    fn releasedir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        empty(reply, self.0.release(ino.0, true))
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
        let n = Node {
            mode,
            umask,
            rdev: 0,
        };
        match self.0.create(who(req), parent.0, name.as_bytes(), n) {
            Ok(a) => reply.created(
                &TTL,
                &fattr(&a),
                Generation(0),
                FileHandle(0),
                FopenFlags::empty(),
            ),
            Err(e) => reply.error(Errno::from_i32(e)),
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
        data(reply, self.0.read(ino.0, offset, size))
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
        let (kill, who) = (
            write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID),
            who(req),
        );
        let store = move |core: &Core, data: &[u8]| {
            let r = core.write(who, ino.0, offset, data, kill);
            written(reply, r.map(u64::from))
        };
        if !self.0.write_would_wait() {
            return store(&self.0, data);
        }
        let (core, data) = (self.0.clone(), data.to_vec());
        self.1.run(Box::new(move || store(&core, &data)))
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
        empty(reply, self.0.release(ino.0, false))
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        empty(reply, self.0.fsync(ino.0))
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let batch = |after, n| self.0.readdir(ino.0, after, n);
        let r = fill_listing(offset, 256, batch, |e| {
            let name = OsStr::from_bytes(&e.name);
            let (ino, kind) = (INodeNo(e.ino), file_type(e.kind));
            (reply.add(ino, e.next as u64, kind, name), e.next as u64)
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let batch = |after, n| self.0.readdirplus(ino.0, after, n);
        let r = fill_listing(offset, 128, batch, |(e, a)| {
            let name = OsStr::from_bytes(&e.name);
            let (next, attr) = (e.next as u64, fattr(&a));
            let full = reply.add(INodeNo(e.ino), next, name, &TTL, &attr, Generation(0));
            (full, next)
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

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
        let (from, to) = ((ino_in.0, offset_in), (ino_out.0, offset_out));
        written(reply, self.0.copy_range(from, to, len))
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
        empty(reply, self.0.fallocate(ino.0, offset, length, mode))
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        empty(reply, self.0.fsyncdir())
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.0.statfs() {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, 255, s.bsize,
            ),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

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
        let r = self
            .0
            .setxattr(who(req), ino.0, name.as_bytes(), value, flags);
        empty(reply, r)
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        xattr(reply, self.0.getxattr(ino.0, name.as_bytes(), size))
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        xattr(reply, self.0.listxattr(ino.0, size))
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.0.removexattr(ino.0, name.as_bytes()))
    }
}

/// The answer to `FLUSH`, sent at every `close(2)` after the kernel wrote
/// the file's dirty pages (whose errors `close` returns): ENOSYS, so the
/// kernel stops sending it, one round trip less per file closed. The
/// store has nothing to do there: a file's buffer is stored after `release`
/// and made durable by `fsync`; POSIX locks are the kernel's (no lock
/// calls are implemented), so no lock owner needs the call either.
pub(crate) fn flush_reply(reply: ReplyEmpty) {
    reply.error(Errno::ENOSYS)
}

#[cfg(test)]
mod tests {
    use super::fill_listing;

    /// A directory of `len` entries with cookies 1..=len, read in batches
    /// of `n` after a cookie, into a reply of `room` entries: what the
    /// reply holds and how many batches were read.
    fn listed(
        len: u64,
        n: usize,
        room: usize,
        from: u64,
        fail_at: Option<u64>,
    ) -> (Vec<u64>, usize, i32) {
        let batches = std::cell::Cell::new(0);
        let batch = |after: u64, n: usize| {
            batches.set(batches.get() + 1);
            if fail_at.is_some_and(|f| after >= f) {
                return Err(libc::EIO);
            }
            Ok((after + 1..=len).take(n).collect::<Vec<_>>())
        };
        let mut got = Vec::new();
        let r = fill_listing(from, n, batch, |c| {
            let full = got.len() == room;
            if !full {
                got.push(c);
            }
            (full, c)
        });
        (got, batches.get(), r.err().unwrap_or(0))
    }

    #[test]
    fn a_listing_fills_its_reply_across_batches() {
        let all = |a: u64, b: u64| (a..=b).collect::<Vec<_>>();
        let cases = [
            ("to the end", (300, 1000, 0, None), (all(1, 300), 3, 0)),
            (
                "an empty last batch",
                (256, 1000, 0, None),
                (all(1, 256), 3, 0),
            ),
            ("until full", (300, 200, 0, None), (all(1, 200), 2, 0)),
            (
                "after a cookie",
                (300, 200, 250, None),
                (all(251, 300), 1, 0),
            ),
            (
                "an error after entries",
                (300, 1000, 0, Some(128)),
                (all(1, 128), 2, 0),
            ),
            (
                "an error first",
                (300, 1000, 0, Some(0)),
                (vec![], 1, libc::EIO),
            ),
        ];
        for (what, (len, room, from, fail_at), want) in cases {
            assert_eq!(listed(len, 128, room, from, fail_at), want, "{what}");
        }
    }
}
