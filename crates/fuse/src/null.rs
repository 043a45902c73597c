//! A filesystem on the same FUSE crate and settings whose files discard
//! what is written: the ceiling a FUSE store can reach on this machine.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::Mutex;
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyEntry, ReplyOpen,
    ReplyWrite, Request, WriteFlags,
};

/// Files that only remember their names and sizes.
#[derive(Default)]
pub struct NullFs {
    files: Mutex<HashMap<Vec<u8>, (u64, u64)>>,
}

fn attr(ino: u64, size: u64, dir: bool) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: if dir {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: if dir { 0o755 } else { 0o644 },
        nlink: if dir { 2 } else { 1 },
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 128 * 1024,
        flags: 0,
    }
}

const TTL: Duration = Duration::from_secs(1);

impl NullFs {
    fn by_ino(&self, ino: u64) -> Option<u64> {
        self.files
            .lock()
            .unwrap()
            .values()
            .find(|v| v.0 == ino)
            .map(|v| v.1)
    }
}

impl Filesystem for NullFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        crate::tune(config);
        Ok(())
    }

    fn lookup(&self, _req: &Request, _parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        use std::os::unix::ffi::OsStrExt;
        match self.files.lock().unwrap().get(name.as_bytes()) {
            Some(&(ino, size)) => reply.entry(&TTL, &attr(ino, size, false), Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino.0 == 1 {
            return reply.attr(&TTL, &attr(1, 0, true));
        }
        match self.by_ino(ino.0) {
            Some(size) => reply.attr(&TTL, &attr(ino.0, size, false)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut files = self.files.lock().unwrap();
        for v in files.values_mut() {
            if v.0 == ino.0 {
                v.1 = size.unwrap_or(v.1);
                return reply.attr(&TTL, &attr(v.0, v.1, false));
            }
        }
        reply.attr(&TTL, &attr(1, 0, true))
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::empty())
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        use std::os::unix::ffi::OsStrExt;
        let mut files = self.files.lock().unwrap();
        let ino = files.len() as u64 + 2;
        let e = *files.entry(name.as_bytes().to_vec()).or_insert((ino, 0));
        reply.created(
            &TTL,
            &attr(e.0, e.1, false),
            Generation(0),
            FileHandle(0),
            FopenFlags::empty(),
        )
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
        for v in self.files.lock().unwrap().values_mut() {
            if v.0 == ino.0 {
                v.1 = v.1.max(end);
            }
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
        let len = self.by_ino(ino.0).unwrap_or(0);
        let n = len.saturating_sub(offset).min(size as u64) as usize;
        reply.data(&vec![0; n])
    }
}
