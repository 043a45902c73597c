//! A null filesystem on fractal-fuse (FUSE over io_uring), made to match
//! onecopy's fuser `NullFs` (crates/fuse/src/null.rs): names and
//! attributes in memory, written data discarded, reads return zeros
//! (files report the blocks of their size, so `cp` copies them whole,
//! not as holes),
//! xattrs accepted and forgotten (`getxattr` answers ENODATA), `FLUSH`
//! left at ENOSYS, writeback cache, 1 s TTLs. It exists to measure the
//! transport (bench/notes/store-transport.md, "fractal-fuse ... measured"), nothing else.
//!
//! Usage: ffuse-null MOUNTPOINT [WORKERS] [QUEUE_DEPTH]
//! (foreground; unmount with `fusermount3 -u`; `NULL_WRITEBACK=0` mounts
//! without the writeback cache). Needs
//! `/sys/module/fuse/parameters/enable_uring` = Y.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fractal_fuse::abi::FUSE_ROOT_ID;
use fractal_fuse::{
    DirectoryEntry, DirectoryEntryPlus, EEXIST, EINVAL, ENOENT, ENOTEMPTY, Errno, FileAttr,
    FileHandleId, FileType, Filesystem, FsResult, InodeId, MountOptions, ReplyAttr, ReplyCreate,
    ReplyEntry, ReplyInit, ReplyOpen, ReplyReadlink, ReplyStatfs, ReplyXattr, Request, Session,
    SetAttr, SetAttrTime, Timestamp,
};

const TTL: Duration = Duration::from_secs(1);

/// One object: its attributes (mode carries the type bits) and, for a
/// symlink, its target.
struct Node {
    attr: FileAttr,
    target: Vec<u8>,
}

/// Invariant: every name in `names` points at a key of `nodes`.
struct Tree {
    names: BTreeMap<(u64, Vec<u8>), u64>,
    nodes: HashMap<u64, Node>,
    next: u64,
}

struct NullFs {
    tree: Mutex<Tree>,
}

fn now() -> Timestamp {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    Timestamp::new(d.as_secs(), d.subsec_nanos())
}

fn new_attr(ino: u64, mode: u32, req: &Request) -> FileAttr {
    let t = now();
    let dir = mode & libc::S_IFMT == libc::S_IFDIR;
    FileAttr {
        ino,
        size: 0,
        blocks: 0,
        atime: t,
        mtime: t,
        ctime: t,
        mode,
        nlink: if dir { 2 } else { 1 },
        uid: req.uid,
        gid: req.gid,
        rdev: 0,
        blksize: 128 * 1024,
    }
}

fn kind(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFBLK => FileType::BlockDevice,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

fn entry(attr: FileAttr) -> ReplyEntry {
    ReplyEntry { ttl: TTL, attr, generation: 0 }
}

fn key(parent: InodeId, name: &OsStr) -> (u64, Vec<u8>) {
    (parent.0, name.as_bytes().to_vec())
}

impl NullFs {
    fn new() -> Self {
        let root = Request { unique: 0, uid: 0, gid: 0, pid: 0 };
        let mut nodes = HashMap::new();
        let attr = new_attr(FUSE_ROOT_ID, libc::S_IFDIR | 0o755, &root);
        nodes.insert(FUSE_ROOT_ID, Node { attr, target: Vec::new() });
        let tree = Tree { names: BTreeMap::new(), nodes, next: FUSE_ROOT_ID + 1 };
        NullFs { tree: Mutex::new(tree) }
    }

    fn tree(&self) -> MutexGuard<'_, Tree> {
        self.tree.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `name` in `parent` as a new object of `mode` (EEXIST if taken).
    fn add(
        &self, req: &Request, parent: InodeId, name: &OsStr, mode: u32, target: &[u8],
    ) -> FsResult<FileAttr> {
        let mut t = self.tree();
        let k = key(parent, name);
        if t.names.contains_key(&k) {
            return Err(EEXIST);
        }
        let ino = t.next;
        t.next += 1;
        let mut attr = new_attr(ino, mode, req);
        attr.size = target.len() as u64;
        t.names.insert(k, ino);
        t.nodes.insert(ino, Node { attr, target: target.to_vec() });
        Ok(attr)
    }

    /// Removes `name` from `parent`; `dir` says which kind it must be.
    fn remove(&self, parent: InodeId, name: &OsStr, dir: bool) -> FsResult<()> {
        let mut t = self.tree();
        let k = key(parent, name);
        let ino = *t.names.get(&k).ok_or(ENOENT)?;
        if dir && t.names.range((ino, Vec::new())..(ino + 1, Vec::new())).next().is_some() {
            return Err(ENOTEMPTY);
        }
        t.names.remove(&k);
        if let Some(n) = t.nodes.get_mut(&ino) {
            n.attr.nlink = n.attr.nlink.saturating_sub(1);
        }
        Ok(())
    }

    /// The children of `dir` after position `offset` (1 and 2 are `.` and
    /// `..`), at most `max` of them.
    fn list(&self, dir: InodeId, offset: u64, max: usize) -> FsResult<Vec<DirectoryEntryPlus>> {
        let t = self.tree();
        let me = t.nodes.get(&dir.0).ok_or(ENOENT)?.attr;
        let dots = [(dir.0, b".".to_vec(), me), (dir.0, b"..".to_vec(), me)];
        let kids = t.names.range((dir.0, Vec::new())..(dir.0 + 1, Vec::new()));
        let all = dots.into_iter().chain(kids.map(|((_, n), i)| (*i, n.clone(), t.nodes[i].attr)));
        let plus = |(i, (ino, name, attr)): (usize, (u64, Vec<u8>, FileAttr))| {
            let (offset, kind, ttl) = (i as u64 + 1, kind(attr.mode), TTL);
            DirectoryEntryPlus { ino, offset, kind, name, entry_ttl: ttl, attr, generation: 0 }
        };
        Ok(all.enumerate().skip(offset as usize).take(max).map(plus).collect())
    }
}

impl Filesystem for NullFs {
    async fn init(&self, _req: Request) -> FsResult<ReplyInit> {
        // As onecopy's `tune`: 4 MiB readahead (the kernel may lower it),
        // 64 background requests; 1 MiB writes (the kernel's page limit).
        Ok(ReplyInit {
            max_write: 1 << 20,
            max_readahead: 4 << 20,
            max_background: 64,
            congestion_threshold: 48,
        })
    }

    async fn lookup(&self, _req: Request, parent: InodeId, name: &OsStr) -> FsResult<ReplyEntry> {
        let t = self.tree();
        let ino = t.names.get(&key(parent, name)).ok_or(ENOENT)?;
        Ok(entry(t.nodes[ino].attr))
    }

    async fn getattr(
        &self, _req: Request, inode: InodeId, _fh: Option<FileHandleId>, _flags: u32,
    ) -> FsResult<ReplyAttr> {
        let attr = self.tree().nodes.get(&inode.0).ok_or(ENOENT)?.attr;
        Ok(ReplyAttr { ttl: TTL, attr })
    }

    async fn setattr(
        &self, _req: Request, inode: InodeId, _fh: Option<FileHandleId>, s: SetAttr,
    ) -> FsResult<ReplyAttr> {
        let mut t = self.tree();
        let a = &mut t.nodes.get_mut(&inode.0).ok_or(ENOENT)?.attr;
        let at = |x: SetAttrTime| match x {
            SetAttrTime::Now => now(),
            SetAttrTime::Specific(t) => t,
        };
        if let Some(m) = s.mode {
            a.mode = (a.mode & libc::S_IFMT) | (m & 0o7777);
        }
        a.uid = s.uid.unwrap_or(a.uid);
        a.gid = s.gid.unwrap_or(a.gid);
        a.size = s.size.unwrap_or(a.size);
        a.blocks = a.size.div_ceil(512);
        a.atime = s.atime.map_or(a.atime, at);
        a.mtime = s.mtime.map_or(a.mtime, at);
        a.ctime = s.ctime.unwrap_or_else(now);
        Ok(ReplyAttr { ttl: TTL, attr: *a })
    }

    async fn readlink(&self, _req: Request, inode: InodeId) -> FsResult<ReplyReadlink> {
        let data = self.tree().nodes.get(&inode.0).ok_or(ENOENT)?.target.clone();
        Ok(ReplyReadlink { data })
    }

    async fn symlink(
        &self, req: Request, parent: InodeId, name: &OsStr, link: &OsStr,
    ) -> FsResult<ReplyEntry> {
        self.add(&req, parent, name, libc::S_IFLNK | 0o777, link.as_bytes()).map(entry)
    }

    async fn mknod(
        &self, req: Request, parent: InodeId, name: &OsStr, mode: u32, _rdev: u32,
    ) -> FsResult<ReplyEntry> {
        self.add(&req, parent, name, mode, b"").map(entry)
    }

    async fn mkdir(
        &self, req: Request, parent: InodeId, name: &OsStr, mode: u32, _umask: u32,
    ) -> FsResult<ReplyEntry> {
        // The kernel applied the umask already (FUSE_DONT_MASK is not set).
        self.add(&req, parent, name, libc::S_IFDIR | (mode & 0o7777), b"").map(entry)
    }

    async fn unlink(&self, _req: Request, parent: InodeId, name: &OsStr) -> FsResult<()> {
        self.remove(parent, name, false)
    }

    async fn rmdir(&self, _req: Request, parent: InodeId, name: &OsStr) -> FsResult<()> {
        self.remove(parent, name, true)
    }

    async fn rename(
        &self, _req: Request, parent: InodeId, name: &OsStr, new_parent: InodeId, new_name: &OsStr,
        flags: u32,
    ) -> FsResult<()> {
        let mut t = self.tree();
        let to = key(new_parent, new_name);
        if flags & libc::RENAME_EXCHANGE != 0 {
            return Err(EINVAL);
        }
        if flags & libc::RENAME_NOREPLACE != 0 && t.names.contains_key(&to) {
            return Err(EEXIST);
        }
        let ino = t.names.remove(&key(parent, name)).ok_or(ENOENT)?;
        t.names.insert(to, ino);
        Ok(())
    }

    async fn link(
        &self, _req: Request, inode: InodeId, new_parent: InodeId, new_name: &OsStr,
    ) -> FsResult<ReplyEntry> {
        let mut t = self.tree();
        let k = key(new_parent, new_name);
        if t.names.contains_key(&k) {
            return Err(EEXIST);
        }
        let n = t.nodes.get_mut(&inode.0).ok_or(ENOENT)?;
        n.attr.nlink += 1;
        let attr = n.attr;
        t.names.insert(k, inode.0);
        Ok(entry(attr))
    }

    async fn open(&self, _req: Request, inode: InodeId, flags: u32) -> FsResult<ReplyOpen> {
        // fractal-fuse always negotiates FUSE_ATOMIC_O_TRUNC: the kernel
        // leaves O_TRUNC to `open` instead of sending a SETATTR.
        if flags & libc::O_TRUNC as u32 != 0
            && let Some(n) = self.tree().nodes.get_mut(&inode.0)
        {
            n.attr.size = 0;
            n.attr.blocks = 0;
        }
        Ok(ReplyOpen { fh: FileHandleId(0), flags: 0, backing_id: 0 })
    }

    async fn create(
        &self, req: Request, parent: InodeId, name: &OsStr, mode: u32, _flags: u32,
    ) -> FsResult<ReplyCreate> {
        let attr = self.add(&req, parent, name, libc::S_IFREG | (mode & 0o7777), b"")?;
        Ok(ReplyCreate { ttl: TTL, attr, generation: 0, fh: FileHandleId(0), flags: 0 })
    }

    async fn read(
        &self, _req: Request, inode: InodeId, _fh: FileHandleId, offset: u64, buf: &mut [u8],
    ) -> FsResult<usize> {
        let size = self.tree().nodes.get(&inode.0).map_or(0, |n| n.attr.size);
        let n = size.saturating_sub(offset).min(buf.len() as u64) as usize;
        buf[..n].fill(0);
        Ok(n)
    }

    async fn write(
        &self, _req: Request, inode: InodeId, _fh: FileHandleId, offset: u64, data: &[u8],
        _wf: u32, _flags: u32,
    ) -> FsResult<usize> {
        if let Some(n) = self.tree().nodes.get_mut(&inode.0) {
            n.attr.size = n.attr.size.max(offset + data.len() as u64);
            n.attr.blocks = n.attr.size.div_ceil(512);
        }
        Ok(data.len())
    }

    // `flush` stays at the trait's ENOSYS, as onecopy answers: the kernel
    // then stops sending it.

    async fn release(
        &self, _req: Request, _inode: InodeId, _fh: FileHandleId, _flags: u32, _lo: u64,
        _flush: bool, _fr: bool,
    ) -> FsResult<()> {
        Ok(())
    }

    async fn fsync(
        &self, _req: Request, _inode: InodeId, _fh: FileHandleId, _datasync: bool,
    ) -> FsResult<()> {
        Ok(())
    }

    async fn opendir(&self, _req: Request, _inode: InodeId, _flags: u32) -> FsResult<ReplyOpen> {
        Ok(ReplyOpen { fh: FileHandleId(0), flags: 0, backing_id: 0 })
    }

    async fn readdir(
        &self, _req: Request, inode: InodeId, _fh: FileHandleId, offset: u64, size: u32,
    ) -> FsResult<Vec<DirectoryEntry>> {
        // A dirent is 24 bytes and the name, padded to 8; 280 covers 255.
        let max = (size as usize / 280).max(1);
        let list = self.list(inode, offset, max)?;
        let plain = |e: DirectoryEntryPlus| DirectoryEntry {
            ino: e.ino,
            offset: e.offset,
            kind: e.kind,
            name: e.name,
        };
        Ok(list.into_iter().map(plain).collect())
    }

    async fn readdirplus(
        &self, _req: Request, inode: InodeId, _fh: FileHandleId, offset: u64, size: u32,
    ) -> FsResult<Vec<DirectoryEntryPlus>> {
        // An entry_out (128 bytes) more per entry than readdir.
        let max = (size as usize / 408).max(1);
        self.list(inode, offset, max)
    }

    async fn releasedir(
        &self, _req: Request, _inode: InodeId, _fh: FileHandleId, _flags: u32,
    ) -> FsResult<()> {
        Ok(())
    }

    async fn statfs(&self, _req: Request, _inode: InodeId) -> FsResult<ReplyStatfs> {
        let files = self.tree().nodes.len() as u64;
        let (big, bsize, namelen) = (1 << 30, 4096, 255);
        let (blocks, bfree, bavail, ffree, frsize) = (big, big, big, big, bsize);
        Ok(ReplyStatfs { blocks, bfree, bavail, files, ffree, bsize, namelen, frsize })
    }

    async fn access(&self, _req: Request, _inode: InodeId, _mask: u32) -> FsResult<()> {
        Ok(())
    }

    async fn setxattr(
        &self, _req: Request, _inode: InodeId, _name: &OsStr, _value: &[u8], _flags: u32,
    ) -> FsResult<()> {
        Ok(())
    }

    async fn getxattr(
        &self, _req: Request, _inode: InodeId, _name: &OsStr, _size: u32,
    ) -> FsResult<ReplyXattr> {
        Err(libc::ENODATA as Errno)
    }

    async fn listxattr(&self, _req: Request, _inode: InodeId, size: u32) -> FsResult<ReplyXattr> {
        Ok(if size == 0 { ReplyXattr::Size(0) } else { ReplyXattr::Data(Vec::new()) })
    }

    async fn removexattr(&self, _req: Request, _inode: InodeId, _name: &OsStr) -> FsResult<()> {
        Ok(())
    }
}

fn arg(args: &[String], i: usize, default: usize) -> usize {
    args.get(i).map_or(default, |s| {
        s.parse().unwrap_or_else(|_| {
            eprintln!("ffuse-null: {s}: not a number");
            std::process::exit(2)
        })
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(mnt) = args.first() else {
        eprintln!("usage: ffuse-null MOUNTPOINT [WORKERS] [QUEUE_DEPTH]");
        std::process::exit(2);
    };
    let workers = arg(&args, 1, 2);
    let depth = arg(&args, 2, 32) as u16;
    // onecopy's mount: fsname, subtype, default_permissions, allow_other
    // (fuser's SessionACL::All), writeback cache.
    let opts = MountOptions::new()
        .fs_name("onecopy-null")
        .custom_options("subtype=onecopy")
        .default_permissions(true)
        .allow_other(true)
        .write_back(std::env::var_os("NULL_WRITEBACK").is_none_or(|v| v != "0"));
    let run = Session::new(PathBuf::from(mnt), opts)
        .and_then(|s| s.with_worker_count(workers).with_queue_depth(depth).run(NullFs::new()));
    if let Err(e) = run {
        eprintln!("ffuse-null: {e}");
        std::process::exit(3);
    }
}
