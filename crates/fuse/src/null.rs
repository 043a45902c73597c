//! A filesystem on the same FUSE crate and settings whose files discard
//! what is written: the ceiling a FUSE store can reach on this machine.
//! It keeps a tree of names, attributes and symlink targets in memory (so
//! `cp -a` and `rsync -a` of a real tree run on it, and can be copied out
//! again) and nothing else: reads return zeros, xattrs are accepted and
//! forgotten. Files report the blocks of their size: one reporting none
//! looks sparse to `cp`, which then writes its zeros out as holes and
//! copies out faster than any filesystem holding the data could.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Mutex;
use std::time::SystemTime;

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, ReplyXattr, Request,
    TimeOrNow, WriteFlags,
};

/// Names and attributes only.
pub struct NullFs {
    inner: Mutex<Tree>,
}

struct Tree {
    /// Each directory's entries, by name.
    dirs: HashMap<u64, BTreeMap<Vec<u8>, u64>>,
    attrs: HashMap<u64, FileAttr>,
    links: HashMap<u64, Vec<u8>>,
    next: u64,
}

impl Default for NullFs {
    fn default() -> Self {
        let mut attrs = HashMap::new();
        attrs.insert(1, attr(1, FileType::Directory, 0o755, 0, 0));
        NullFs {
            inner: Mutex::new(Tree {
                dirs: HashMap::from([(1, BTreeMap::new())]),
                attrs,
                links: HashMap::new(),
                next: 2,
            }),
        }
    }
}

fn attr(ino: u64, kind: FileType, perm: u32, uid: u32, gid: u32) -> FileAttr {
    let now = SystemTime::now();
    FileAttr {
        ino: INodeNo(ino),
        size: 0,
        blocks: 0,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
        kind,
        perm: (perm & 0o7777) as u16,
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid,
        gid,
        rdev: 0,
        blksize: 128 * 1024,
        flags: 0,
    }
}

fn tor(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

impl NullFs {
    fn tree(&self) -> std::sync::MutexGuard<'_, Tree> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `name` in `parent` (EEXIST if taken).
    fn add(
        &self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        kind: FileType,
        mode: u32,
    ) -> Result<FileAttr, Errno> {
        let mut t = self.tree();
        let ino = t.next;
        let entries = t.dirs.get_mut(&parent).ok_or(Errno::ENOTDIR)?;
        if entries.contains_key(name.as_bytes()) {
            return Err(Errno::EEXIST);
        }
        entries.insert(name.as_bytes().to_vec(), ino);
        t.next += 1;
        let a = attr(ino, kind, mode, req.uid(), req.gid());
        t.attrs.insert(ino, a);
        if kind == FileType::Directory {
            t.dirs.insert(ino, BTreeMap::new());
        }
        Ok(a)
    }

    /// Removes `name` from `parent`; a directory only when empty.
    fn remove(&self, parent: u64, name: &OsStr, dir: bool) -> Result<(), Errno> {
        let mut t = self.tree();
        let entries = t.dirs.get(&parent).ok_or(Errno::ENOTDIR)?;
        let ino = *entries.get(name.as_bytes()).ok_or(Errno::ENOENT)?;
        match (dir, t.dirs.get(&ino)) {
            (true, None) => return Err(Errno::ENOTDIR),
            (false, Some(_)) => return Err(Errno::EISDIR),
            (true, Some(e)) if !e.is_empty() => return Err(Errno::ENOTEMPTY),
            _ => {}
        }
        t.dirs.get_mut(&parent).unwrap().remove(name.as_bytes());
        t.dirs.remove(&ino);
        t.attrs.remove(&ino);
        t.links.remove(&ino);
        Ok(())
    }

    /// Moves `name` to `newname`, replacing a file there (as `rsync`'s
    /// rename of its temporary file does).
    fn mv(&self, parent: u64, name: &OsStr, to: u64, newname: &OsStr) -> Result<(), Errno> {
        let mut t = self.tree();
        let from = t.dirs.get_mut(&parent).ok_or(Errno::ENOTDIR)?;
        let ino = from.remove(name.as_bytes()).ok_or(Errno::ENOENT)?;
        let Some(dest) = t.dirs.get_mut(&to) else {
            t.dirs
                .get_mut(&parent)
                .unwrap()
                .insert(name.as_bytes().to_vec(), ino);
            return Err(Errno::ENOTDIR);
        };
        if let Some(old) = dest.insert(newname.as_bytes().to_vec(), ino) {
            t.attrs.remove(&old);
            t.links.remove(&old);
        }
        Ok(())
    }

    /// `parent`'s entries after cookie `offset` (an entry's cookie is its
    /// place in name order plus one), with their attributes.
    fn list(&self, parent: u64, offset: u64) -> Result<Vec<(u64, Vec<u8>, FileAttr)>, Errno> {
        let t = self.tree();
        let entries = t.dirs.get(&parent).ok_or(Errno::ENOTDIR)?;
        Ok(entries
            .iter()
            .enumerate()
            .skip(offset as usize)
            .filter_map(|(i, (n, ino))| Some((i as u64 + 1, n.clone(), *t.attrs.get(ino)?)))
            .collect())
    }
}

fn empty(reply: ReplyEmpty, r: Result<(), Errno>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

impl Filesystem for NullFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        crate::tune(config, false);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let t = self.tree();
        let ino = t.dirs.get(&parent.0).and_then(|d| d.get(name.as_bytes()));
        match ino.and_then(|i| t.attrs.get(i)) {
            Some(a) => reply.entry(&crate::TTL, a, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.tree().attrs.get(&ino.0) {
            Some(a) => reply.attr(&crate::TTL, a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut t = self.tree();
        let Some(a) = t.attrs.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        if let Some(m) = mode {
            a.perm = (m & 0o7777) as u16;
        }
        a.uid = uid.unwrap_or(a.uid);
        a.gid = gid.unwrap_or(a.gid);
        a.size = size.unwrap_or(a.size);
        a.blocks = a.size.div_ceil(512);
        a.atime = atime.map_or(a.atime, tor);
        a.mtime = mtime.map_or(a.mtime, tor);
        reply.attr(&crate::TTL, a)
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
        match self.add(req, parent.0, name, FileType::Directory, mode & !umask) {
            Ok(a) => reply.entry(&crate::TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        match self.add(req, parent.0, name, FileType::Symlink, 0o777) {
            Ok(mut a) => {
                let t = target.as_os_str().as_bytes().to_vec();
                let mut tree = self.tree();
                a.size = t.len() as u64;
                tree.attrs.insert(a.ino.0, a);
                tree.links.insert(a.ino.0, t);
                reply.entry(&crate::TTL, &a, Generation(0))
            }
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.tree().links.get(&ino.0) {
            Some(t) => reply.data(t),
            None => reply.error(Errno::EINVAL),
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::empty())
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
        match self.add(req, parent.0, name, FileType::RegularFile, mode & !umask) {
            Ok(a) => reply.created(
                &crate::TTL,
                &a,
                Generation(0),
                FileHandle(0),
                FopenFlags::empty(),
            ),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _wf: WriteFlags,
        _flags: OpenFlags,
        _lo: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let end = offset + data.len() as u64;
        if let Some(a) = self.tree().attrs.get_mut(&ino.0) {
            a.size = a.size.max(end);
            a.blocks = a.size.div_ceil(512);
        }
        reply.written(data.len() as u32)
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lo: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let len = self.tree().attrs.get(&ino.0).map_or(0, |a| a.size);
        let n = len.saturating_sub(offset).min(size as u64) as usize;
        reply.data(&vec![0; n])
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lo: LockOwner,
        reply: ReplyEmpty,
    ) {
        crate::flush_reply(reply)
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok()
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.remove(parent.0, name, false))
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.remove(parent.0, name, true))
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        _flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        empty(reply, self.mv(parent.0, name, newparent.0, newname))
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::empty())
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        match self.list(ino.0, offset) {
            Ok(entries) => {
                for (next, name, a) in entries {
                    if reply.add(a.ino, next, a.kind, OsStr::from_bytes(&name)) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(e),
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
        match self.list(ino.0, offset) {
            Ok(entries) => {
                for (next, name, a) in entries {
                    let name = OsStr::from_bytes(&name);
                    if reply.add(a.ino, next, name, &crate::TTL, &a, Generation(0)) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(e),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        reply.ok()
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        reply.error(Errno::ENODATA)
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: ReplyXattr) {
        if size == 0 {
            reply.size(0)
        } else {
            reply.data(&[])
        }
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.ok()
    }
}
