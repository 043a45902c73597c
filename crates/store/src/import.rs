//! Bulk import of a tree into an open store, without FUSE
//! (`onecopy store import`).
//!
//! Data flow: one walker thread (the caller's) reads directories, creates
//! directories, symlinks and special files at once and hands regular files
//! to worker threads through a bounded queue. A worker reads its file in
//! pieces of [`PIECE`] bytes (holes skipped with `SEEK_DATA`/`SEEK_HOLE`),
//! cuts them into chunks, and hashes and compresses them outside the
//! store's lock; only the fingerprint lookups, the record appends and the
//! metadata rows are done under it.
//!
//! Invariants:
//! - A regular file is written into an inode that has no name (nlink 0)
//!   and gets its name only once all its bytes are stored and the source
//!   was unchanged while it was read. A file that fails is deleted with
//!   its references; after a crash, an unnamed inode is an orphan that
//!   opening the store deletes. So no partial file is ever presented.
//! - Destination names are checked before anything is written: an
//!   existing name is refused, never merged.
//! - Errors of the source (unreadable, vanished, changed twice while read)
//!   are per file: recorded in the report, the import goes on. Errors of
//!   the store (a full disk, I/O) stop the import; the open transaction is
//!   then never committed, so the store is as at the last commit.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{File, Metadata};
use std::io::ErrorKind;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};

use rusqlite::params;

use crate::cache::par_map;
use crate::config::Chunking;
use crate::container::{Encoded, Hash};
use crate::data::is_zero;
use crate::error::StoreError;
use crate::ns::{Kind, NewNode};
use crate::pack::Prepared;
use crate::store::{time_now, Inner, Store};

/// Bytes of a file read, cut and stored at a time (per worker).
const PIECE: usize = 4 << 20;
/// A durable commit is made after this many bytes were read, so a crash
/// loses at most about this much of the import.
const COMMIT_EVERY: u64 = 256 << 20;
/// Regular files queued for the workers at most.
const QUEUE: usize = 256;
/// Largest xattr list or value read (the Linux limit).
const XATTR_MAX: usize = 64 << 10;

/// Why an import, or one source file of it, failed. Each carries the
/// source path (or the destination name) it is about.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The source could not be read (per file: the import goes on).
    #[error("{path}: {source}")]
    Source {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The source changed while it was read, twice (per file).
    #[error("{path}: changed while it was read (size or mtime moved), twice; not imported")]
    Changed { path: PathBuf },
    /// A source argument is unusable (checked before anything is written).
    #[error("{path}: {why}")]
    BadSource { path: PathBuf, why: String },
    /// The destination already exists in the store (checked before
    /// anything is written; nothing is merged or overwritten).
    #[error("{dest}: already exists in the store; nothing was imported")]
    Exists { dest: String },
    /// A component of the destination directory is not a directory.
    #[error("{dest}: not a directory in the store")]
    NotDir { dest: String },
    /// The store failed (full disk, I/O): the import stopped.
    #[error("{path}: store: {source}")]
    Store {
        path: PathBuf,
        #[source]
        source: StoreError,
    },
}

impl ImportError {
    /// Whether this error stopped the import (a store error) rather than
    /// skipping one source file.
    pub fn is_fatal(&self) -> bool {
        matches!(self, ImportError::Store { .. })
    }

    /// Whether the store ran out of space.
    pub fn is_no_space(&self) -> bool {
        matches!(self, ImportError::Store { source, .. } if source.errno() == libc::ENOSPC)
    }
}

fn store_err(path: &Path) -> impl FnOnce(StoreError) -> ImportError + '_ {
    move |source| ImportError::Store {
        path: path.into(),
        source,
    }
}

fn src_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImportError + '_ {
    move |source| ImportError::Source {
        path: path.into(),
        source,
    }
}

/// How to import.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// Directory inside the store the sources go into (`/a/b`), created
    /// like `mkdir -p`.
    pub to: Vec<u8>,
    /// A durable commit is made after this many bytes were read (a crash
    /// loses at most about this much).
    pub commit_every: u64,
    /// Worker threads reading and storing files (0: four per core, 4 to
    /// 16: reads of files not in the page cache wait for the disk, and
    /// several in flight keep it busy; measured on 2 cores, 4 versions
    /// of /usr/include + python, cold: 2 threads 6.2-7.5 s, 4: 5.2 s,
    /// 8: 4.3-5.0 s, 16: 4.7 s).
    pub threads: usize,
}

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            to: b"/".to_vec(),
            commit_every: COMMIT_EVERY,
            threads: 0,
        }
    }
}

/// Counters an observer (a progress bar) may read while the import runs.
#[derive(Debug, Default)]
pub struct ImportProgress {
    /// Bytes of file data read so far.
    pub bytes: AtomicU64,
    /// Entries (of any kind) imported so far.
    pub entries: AtomicU64,
}

/// What an import did.
#[derive(Debug, Default)]
pub struct ImportReport {
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    /// Names added to files imported under another name (hardlinks).
    pub hardlinks: u64,
    /// FIFOs and device nodes.
    pub specials: u64,
    /// Bytes of file data (apparent sizes of the files imported).
    pub bytes: u64,
    /// Of those, bytes stored for the first time, found already stored,
    /// and all-zero (holes) (before compression).
    pub new_bytes: u64,
    pub dup_bytes: u64,
    pub zero_bytes: u64,
    /// Per-file errors: these sources are not in the store.
    pub failed: Vec<ImportError>,
    /// What was skipped on purpose (sockets, xattrs that could not be
    /// read or stored).
    pub notes: Vec<String>,
}

/// Further names of multiply-linked sources, by source (dev, ino): the
/// store directory and name of each.
type ExtraLinks = HashMap<(u64, u64), Vec<(u64, Vec<u8>)>>;

/// The source attributes an imported inode gets.
#[derive(Debug, Clone, Copy)]
struct SrcAttr {
    kind: Kind,
    perm: u32,
    uid: u32,
    gid: u32,
    size: u64,
    atime_ns: i64,
    mtime_ns: i64,
    rdev: u32,
}

/// The kernel's `new_encode_dev` (what FUSE passes as `rdev`).
fn encode_dev(rdev: u64) -> u32 {
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)
}

fn src_attr(md: &Metadata, kind: Kind) -> SrcAttr {
    SrcAttr {
        kind,
        perm: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        size: if kind == Kind::Symlink { md.size() } else { 0 },
        atime_ns: md.atime() * 1_000_000_000 + md.atime_nsec(),
        mtime_ns: md.mtime() * 1_000_000_000 + md.mtime_nsec(),
        rdev: encode_dev(md.rdev()),
    }
}

/// A regular file handed to a worker.
struct FileJob {
    src: PathBuf,
    parent: u64,
    name: Vec<u8>,
    md: Metadata,
    /// (dev, ino) of a source with more than one link.
    link_key: Option<(u64, u64)>,
}

/// State shared by the walker and the workers.
struct Shared<'a> {
    progress: &'a ImportProgress,
    stop: AtomicBool,
    fatal: Mutex<Option<ImportError>>,
    report: Mutex<ImportReport>,
    /// Store inode of each multiply-linked source imported.
    linked: Mutex<HashMap<(u64, u64), u64>>,
    since_commit: AtomicU64,
    commit_every: u64,
    /// (dev, ino) of the store's directory: never imported into itself.
    store_dir: Option<(u64, u64)>,
}

impl Shared<'_> {
    fn progress(&self) -> &ImportProgress {
        self.progress
    }

    /// Records the error that stops the import: the first, unless it was
    /// a node gone missing and a full disk follows. A commit that fails
    /// for want of space rolls back the nodes made since the last one, and
    /// another worker can meet that (NotFound) before the committing one
    /// records the cause.
    fn set_fatal(&self, e: ImportError) {
        let mut f = self.fatal.lock().unwrap_or_else(|p| p.into_inner());
        let gone = |old: &ImportError| {
            matches!(
                old,
                ImportError::Store {
                    source: StoreError::NotFound,
                    ..
                }
            )
        };
        if f.as_ref().is_none_or(|old| gone(old) && e.is_no_space()) {
            *f = Some(e);
        }
        self.stop.store(true, Ordering::SeqCst);
    }

    fn record(&self, r: Result<(), ImportError>) {
        match r {
            Ok(()) => {}
            Err(e) if e.is_fatal() => self.set_fatal(e),
            Err(e) => self.report().failed.push(e),
        }
    }

    fn report(&self) -> std::sync::MutexGuard<'_, ImportReport> {
        self.report.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// The file name an argument is imported under.
fn base_name(src: &Path) -> Result<Vec<u8>, ImportError> {
    let name = match src.file_name() {
        Some(n) => n.to_os_string(),
        None => std::fs::canonicalize(src)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_os_string()))
            .ok_or_else(|| ImportError::BadSource {
                path: src.into(),
                why: "has no name to import it under (give a directory below /)".into(),
            })?,
    };
    Ok(name.as_bytes().to_vec())
}

/// The components of a store path (`/a/b`), empty ones and `.` dropped.
fn components(to: &[u8]) -> Result<Vec<&[u8]>, ImportError> {
    let parts: Vec<&[u8]> = to
        .split(|&b| b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
        .collect();
    if parts.contains(&&b".."[..]) {
        return Err(ImportError::BadSource {
            path: PathBuf::from(OsStr::from_bytes(to)),
            why: "`..` is not allowed in the destination path".into(),
        });
    }
    Ok(parts)
}

impl Store {
    /// Copies each of `srcs` (directory, file, symlink, special file) into
    /// the store as `to/basename(src)`, preserving data (holes stay holes),
    /// mode, owner, atime/mtime, symlinks, hardlinks among the imported
    /// files, xattrs, FIFOs and device nodes. `to` is created like
    /// `mkdir -p`. Refuses, before writing anything, a destination name
    /// that exists. Per-file failures are in the report; a store failure
    /// is the `Err`, and then nothing since the last commit is committed.
    /// Ends with a durable commit.
    pub fn import(
        &self,
        srcs: &[PathBuf],
        opts: &ImportOptions,
        progress: &ImportProgress,
    ) -> Result<ImportReport, ImportError> {
        let to = &opts.to[..];
        let plan = self.plan_import(srcs, to)?;
        let here = self.dir.as_path();
        let dest = self.mkdir_p(to).map_err(store_err(here))?;
        let shared = Shared {
            progress,
            stop: AtomicBool::new(false),
            fatal: Mutex::new(None),
            report: Mutex::new(ImportReport::default()),
            linked: Mutex::new(HashMap::new()),
            since_commit: AtomicU64::new(0),
            commit_every: opts.commit_every.max(1),
            store_dir: std::fs::metadata(&self.dir)
                .ok()
                .map(|m| (m.dev(), m.ino())),
        };
        let counters0 = self.lock().counters;
        let threads = match opts.threads {
            0 => std::thread::available_parallelism()
                .map(|n| 4 * n.get())
                .unwrap_or(4)
                .clamp(4, 16),
            n => n,
        };
        let mut extra_links: ExtraLinks = HashMap::new();
        let (tx, rx) = mpsc::sync_channel::<FileJob>(QUEUE);
        let rx = Mutex::new(rx);
        std::thread::scope(|sc| {
            for _ in 0..threads {
                let (rx, shared) = (&rx, &shared);
                sc.spawn(move || {
                    let mut buf = Vec::new();
                    loop {
                        let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok(job) = job else { break };
                        if shared.stopped() {
                            continue;
                        }
                        let r = self.import_file(shared, &job, &mut buf);
                        shared.record(r);
                    }
                });
            }
            for (src, name) in &plan {
                if shared.stopped() {
                    break;
                }
                let r = self.walk(&shared, &tx, &mut extra_links, src, dest, name);
                shared.record(r);
            }
            drop(tx);
        });
        if let Some(e) = shared
            .fatal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            return Err(e);
        }
        self.add_extra_links(&shared, extra_links)
            .map_err(store_err(here))?;
        {
            let g = self.lock();
            g.touch(dest, true).map_err(store_err(here))?;
        }
        self.flush_all(true).map_err(store_err(here))?;
        let mut rep = std::mem::take(&mut *shared.report());
        let c = self.lock().counters;
        rep.new_bytes = c.new_bytes - counters0.new_bytes;
        rep.dup_bytes = c.dup_bytes - counters0.dup_bytes;
        rep.zero_bytes = c.zero_bytes - counters0.zero_bytes;
        Ok(rep)
    }

    /// Checks the arguments and the destination before anything is
    /// written: every source exists, names are distinct, none exists in
    /// the destination, the destination path has no non-directory.
    fn plan_import(
        &self,
        srcs: &[PathBuf],
        to: &[u8],
    ) -> Result<Vec<(PathBuf, Vec<u8>)>, ImportError> {
        let mut plan: Vec<(PathBuf, Vec<u8>)> = Vec::new();
        for src in srcs {
            std::fs::symlink_metadata(src).map_err(src_err(src))?;
            let name = base_name(src)?;
            if plan.iter().any(|(_, n)| *n == name) {
                return Err(ImportError::BadSource {
                    path: src.into(),
                    why: "two sources have this name; import them with different --to".into(),
                });
            }
            plan.push((src.clone(), name));
        }
        let here = self.dir.as_path();
        let show = |parts: &[&[u8]]| {
            let mut s = String::new();
            for p in parts {
                s.push('/');
                s.push_str(&String::from_utf8_lossy(p));
            }
            if s.is_empty() {
                s.push('/');
            }
            s
        };
        let parts = components(to)?;
        let meta = crate::view::META_DIR_NAME;
        let clash = match parts.first() {
            Some(&p) => (p == meta).then(|| PathBuf::from(OsStr::from_bytes(to))),
            None => plan
                .iter()
                .find(|(_, n)| n == meta)
                .map(|(src, _)| src.clone()),
        };
        if let Some(path) = clash {
            return Err(ImportError::BadSource {
                path,
                why: "would be the store's `/.onecopy`, its directory of snapshots; import \
                      it under another name (--to)"
                    .into(),
            });
        }
        let mut dir = Some(1u64);
        for (i, part) in parts.iter().enumerate() {
            let Some(d) = dir else { break };
            let g = self.lock();
            dir = match g.child(d, part).map_err(store_err(here))? {
                Some(ino) if g.attr(ino).map_err(store_err(here))?.kind == Kind::Dir => Some(ino),
                Some(_) => {
                    return Err(ImportError::NotDir {
                        dest: show(&parts[..=i]),
                    })
                }
                None => None,
            };
        }
        if let Some(d) = dir {
            let g = self.lock();
            for (_, name) in &plan {
                if g.child(d, name).map_err(store_err(here))?.is_some() {
                    let mut p = parts.clone();
                    p.push(name.as_slice());
                    return Err(ImportError::Exists { dest: show(&p) });
                }
            }
        }
        Ok(plan)
    }

    /// The directory `to`, created like `mkdir -p` (mode 0755, root).
    fn mkdir_p(&self, to: &[u8]) -> crate::Result<u64> {
        let mut dir = 1u64;
        for part in components(to).map_err(|_| StoreError::Invalid)? {
            let found = self.lock().child(dir, part)?;
            dir = match found {
                Some(ino) => ino,
                None => {
                    let node = NewNode::root_owned(Kind::Dir, 0o755);
                    self.mknod(dir, part, node)?.ino
                }
            };
        }
        Ok(dir)
    }

    /// Imports `src` as `parent/name`: directories recursively (the
    /// walker's thread), regular files through the workers.
    fn walk(
        &self,
        shared: &Shared,
        tx: &mpsc::SyncSender<FileJob>,
        links: &mut ExtraLinks,
        src: &Path,
        parent: u64,
        name: &[u8],
    ) -> Result<(), ImportError> {
        if shared.stopped() {
            return Ok(());
        }
        let md = std::fs::symlink_metadata(src).map_err(src_err(src))?;
        if Some((md.dev(), md.ino())) == shared.store_dir {
            shared
                .report()
                .notes
                .push(format!("{}: the store itself, skipped", src.display()));
            return Ok(());
        }
        let ft = md.file_type();
        if ft.is_file() {
            queue_file(tx, links, src, parent, name, md);
            return Ok(());
        }
        if ft.is_socket() {
            shared
                .report()
                .notes
                .push(format!("{}: socket skipped", src.display()));
            return Ok(());
        }
        let (kind, target) = node_kind(src, ft)?;
        // A directory that cannot be listed is not created.
        let entries = match kind {
            Kind::Dir => Some(std::fs::read_dir(src).map_err(src_err(src))?),
            _ => None,
        };
        let xattrs = read_xattrs(XattrSrc::Path(src), shared, src);
        let a = src_attr(&md, kind);
        let ino = {
            let g = self.lock();
            let ino = self
                .put_node(&g, parent, name, &a, 1, target.as_deref())
                .map_err(store_err(src))?;
            self.put_xattrs(&g, ino, &xattrs, shared, src)
                .map_err(store_err(src))?;
            ino
        };
        shared.progress().entries.fetch_add(1, Ordering::Relaxed);
        {
            let mut r = shared.report();
            match kind {
                Kind::Dir => r.directories += 1,
                Kind::Symlink => r.symlinks += 1,
                _ => r.specials += 1,
            }
        }
        if let Some(entries) = entries {
            self.walk_entries(shared, tx, links, src, ino, entries);
        }
        Ok(())
    }

    /// Walks the entries of directory `src` (store inode `ino`); errors
    /// are recorded, and one listing the directory ends it.
    fn walk_entries(
        &self,
        shared: &Shared,
        tx: &mpsc::SyncSender<FileJob>,
        links: &mut ExtraLinks,
        src: &Path,
        ino: u64,
        entries: std::fs::ReadDir,
    ) {
        for e in entries {
            if shared.stopped() {
                break;
            }
            let e = match e {
                Ok(e) => e,
                Err(e) => {
                    shared.record(Err(src_err(src)(e)));
                    break;
                }
            };
            let child = e.path();
            let r = self.walk(shared, tx, links, &child, ino, e.file_name().as_bytes());
            shared.record(r);
        }
    }

    /// Inserts an inode with the source's attributes (ctime now) and, when
    /// `nlink` > 0, names it `parent/name`. The parent's times are left
    /// alone (they are the source's, or the destination's, touched once).
    fn put_node(
        &self,
        g: &Inner,
        parent: u64,
        name: &[u8],
        a: &SrcAttr,
        nlink: u32,
        target: Option<&[u8]>,
    ) -> crate::Result<u64> {
        crate::ns::check_name(name)?;
        let is_dir = a.kind == Kind::Dir;
        g.db.prepare_cached(
            "INSERT INTO inodes (kind, perm, uid, gid, nlink, size, atime_ns, mtime_ns, ctime_ns,
             rdev, target, parent, born)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
        )?
        .execute(params![
            a.kind as i64,
            a.perm,
            a.uid,
            a.gid,
            if is_dir { 2 } else { nlink },
            a.size,
            a.atime_ns,
            a.mtime_ns,
            time_now(),
            a.rdev,
            target,
            is_dir.then_some(parent),
            g.epoch
        ])?;
        let ino = g.db.last_insert_rowid() as u64;
        if nlink > 0 {
            g.add_dirent(parent, name, ino)?;
            if is_dir {
                g.add_nlink(parent, 1)?;
            }
        }
        Ok(ino)
    }

    /// Stores the xattrs read from the source; one the store refuses (an
    /// ACL it cannot parse) is skipped with a note.
    fn put_xattrs(
        &self,
        g: &Inner,
        ino: u64,
        xattrs: &[(Vec<u8>, Vec<u8>)],
        shared: &Shared,
        src: &Path,
    ) -> crate::Result<()> {
        for (name, value) in xattrs {
            let skip = if !crate::acl::keeps_xattr(name) {
                Some("a system attribute of the source's filesystem, not kept")
            } else if name == crate::acl::ACCESS && crate::acl::Acl::parse(value).is_none() {
                Some("not understood, skipped")
            } else {
                None
            };
            if let Some(why) = skip {
                let (path, name) = (src.display(), String::from_utf8_lossy(name));
                shared
                    .report()
                    .notes
                    .push(format!("{path}: xattr {name} {why}"));
                continue;
            }
            g.seen.saw(name);
            g.db.prepare_cached(
                "INSERT INTO xattrs (ino, name, value, born) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (ino, name) DO UPDATE SET value = excluded.value",
            )?
            .execute(params![ino, name, value, g.epoch])?;
        }
        Ok(())
    }

    /// Imports one regular file (a worker): read it, store it into an
    /// unnamed inode, and name it only if the source did not change
    /// meanwhile (one retry).
    fn import_file(
        &self,
        shared: &Shared,
        job: &FileJob,
        buf: &mut Vec<u8>,
    ) -> Result<(), ImportError> {
        let src = &job.src;
        for attempt in 0..2 {
            let f = File::options()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(src)
                .map_err(src_err(src))?;
            let before = f.metadata().map_err(src_err(src))?;
            if before.dev() != job.md.dev() || before.ino() != job.md.ino() {
                if attempt == 0 {
                    continue;
                }
                return Err(ImportError::Changed { path: src.clone() });
            }
            let mut a = src_attr(&before, Kind::File);
            a.size = before.size();
            let ino = {
                let g = self.lock();
                self.put_node(&g, 0, b"", &a, 0, None)
                    .map_err(store_err(src))?
            };
            let read = self.store_file_data(shared, &f, ino, &before, src, buf);
            let after = f.metadata().map_err(src_err(src));
            let changed = match (&read, &after) {
                (Ok(n), Ok(after)) => {
                    *n != before.size()
                        || after.size() != before.size()
                        || after.mtime() != before.mtime()
                        || after.mtime_nsec() != before.mtime_nsec()
                }
                _ => false,
            };
            if read.is_err() || after.is_err() || changed {
                self.abandon(ino).map_err(store_err(src))?;
                read?;
                after?;
                if attempt == 0 {
                    continue;
                }
                return Err(ImportError::Changed { path: src.clone() });
            }
            let xattrs = read_xattrs(XattrSrc::File(&f), shared, src);
            {
                let g = self.lock();
                g.add_dirent(job.parent, &job.name, ino)
                    .map_err(store_err(src))?;
                g.db.prepare_cached("UPDATE inodes SET nlink = 1, size = ?2 WHERE ino = ?1")
                    .and_then(|mut s| s.execute(params![ino, before.size()]))
                    .map_err(|e| store_err(src)(e.into()))?;
                self.put_xattrs(&g, ino, &xattrs, shared, src)
                    .map_err(store_err(src))?;
            }
            if let Some(k) = job.link_key {
                lock_linked(shared).insert(k, ino);
            }
            shared.progress().entries.fetch_add(1, Ordering::Relaxed);
            let mut r = shared.report();
            r.files += 1;
            r.bytes += before.size();
            return Ok(());
        }
        Err(ImportError::Changed { path: src.clone() })
    }

    /// Deletes an unnamed inode being imported, with its references.
    fn abandon(&self, ino: u64) -> crate::Result<()> {
        let mut g = self.lock();
        self.maybe_delete(&mut g, ino)
    }

    /// Reads `f` (expected `md.size()` bytes) into inode `ino`, data regions
    /// only. Returns the file's size as read (short if it shrank).
    /// Source errors are `Source`, store errors `Store`.
    fn store_file_data(
        &self,
        shared: &Shared,
        f: &File,
        ino: u64,
        md: &Metadata,
        src: &Path,
        buf: &mut Vec<u8>,
    ) -> Result<u64, ImportError> {
        let (size, blocks) = (md.size(), md.blocks());
        let mut pos = 0u64;
        // Fixed chunks stay aligned to their size (the write path replaces
        // a page's chunk by its aligned start): regions are widened to
        // chunk boundaries.
        let align = match self.cfg.chunking {
            Chunking::Fixed { size } => size as u64,
            Chunking::Cdc { .. } => 1,
        };
        let mut data = 0u64;
        for (start, end) in data_regions(f, size, blocks).map_err(src_err(src))? {
            if shared.stopped() {
                return Err(ImportError::Changed { path: src.into() });
            }
            let start = (start / align * align).max(pos);
            let end = end.div_ceil(align).saturating_mul(align).min(size);
            if start >= end {
                continue;
            }
            let got = self.store_region(shared, f, ino, start, end, buf, src)?;
            pos = start + got;
            data += got;
            if got < end - start {
                return Ok(pos);
            }
        }
        // The holes skipped count as zero bytes, as zero chunks do.
        self.lock().counters.zero_bytes += size - data;
        Ok(size)
    }

    /// Reads `[start, end)` of `f` in pieces, cuts, stores. Returns the
    /// bytes read (short at an early end of file).
    #[allow(clippy::too_many_arguments)]
    fn store_region(
        &self,
        shared: &Shared,
        f: &File,
        ino: u64,
        start: u64,
        end: u64,
        buf: &mut Vec<u8>,
        src: &Path,
    ) -> Result<u64, ImportError> {
        let max = self.cfg.chunking.max_chunk() as usize;
        if buf.len() < PIECE + max {
            // Once per worker: zeroed once, then reused (no memset per file).
            *buf = vec![0u8; PIECE + max];
        }
        // File offset of buf[0]; buf[..len] holds bytes not stored yet.
        let (mut at, mut len) = (start, 0usize);
        loop {
            let want = buf.len().min((end - at) as usize);
            let mut short = false;
            if len < want {
                let n = read_full(f, &mut buf[len..want], at + len as u64).map_err(src_err(src))?;
                self.count_read(shared, n as u64).map_err(store_err(src))?;
                short = len + n < want;
                len += n;
            }
            let eof = short || at + len as u64 >= end;
            let cuts = self.cut(&buf[..len], eof);
            let consumed = cuts.last().map_or(0, |&(o, l)| o + l);
            let chunks: Vec<(u64, &[u8])> = cuts
                .iter()
                .map(|&(o, l)| (at + o as u64, &buf[o..o + l]))
                .collect();
            self.store_chunks(ino, &chunks).map_err(store_err(src))?;
            buf.copy_within(consumed..len, 0);
            len -= consumed;
            at += consumed as u64;
            if eof && len == 0 {
                return Ok(at - start);
            }
            if shared.stopped() {
                return Err(ImportError::Changed { path: src.into() });
            }
        }
    }

    /// Chunk boundaries in `buf` (offset, length) whose cut is final: all
    /// of them at the end of the data (`eof`), else those with `max`
    /// bytes of look-ahead (FastCDC decides a cut from the chunk's start
    /// and at most `max` bytes after it, so the cuts equal a whole-file
    /// cut).
    fn cut(&self, buf: &[u8], eof: bool) -> Vec<(usize, usize)> {
        match self.cfg.chunking {
            Chunking::Fixed { size } => {
                let size = size as usize;
                let n = if eof {
                    buf.len()
                } else {
                    buf.len() / size * size
                };
                (0..n).step_by(size).map(|o| (o, size.min(n - o))).collect()
            }
            Chunking::Cdc { min, avg, max } => {
                let mut out = Vec::new();
                for c in fastcdc::v2020::FastCDC::new(buf, min, avg, max) {
                    if !eof && c.offset + max as usize > buf.len() {
                        break;
                    }
                    out.push((c.offset, c.length));
                }
                out
            }
        }
    }

    /// Counts bytes read; makes a durable commit every [`COMMIT_EVERY`].
    fn count_read(&self, shared: &Shared, n: u64) -> crate::Result<()> {
        shared.progress().bytes.fetch_add(n, Ordering::Relaxed);
        let total = shared.since_commit.fetch_add(n, Ordering::Relaxed) + n;
        if total >= shared.commit_every
            && shared
                .since_commit
                .compare_exchange(total, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.commit(true)?;
        }
        Ok(())
    }

    /// Stores the chunks of one piece of file `ino` (file offset, bytes):
    /// BLAKE3 and compression outside the lock, then lookups, appends and
    /// file-map rows under it. All-zero chunks are holes.
    fn store_chunks(&self, ino: u64, chunks: &[(u64, &[u8])]) -> crate::Result<()> {
        if chunks.is_empty() {
            return Ok(());
        }
        let hash =
            |&(_, d): &(u64, &[u8])| -> Option<Hash> { (!is_zero(d)).then(|| self.fingerprint(d)) };
        let hashes: Vec<Option<Hash>> = if chunks.len() >= 8 {
            par_map(chunks, hash)
        } else {
            chunks.iter().map(hash).collect()
        };
        let known: Vec<Hash> = hashes.iter().flatten().copied().collect();
        let found = {
            let mut g = self.lock();
            let Inner { db, index, .. } = &mut *g;
            index.lookup_many(db, &known)?
        };
        let mut unknown: Vec<usize> = Vec::new();
        let mut k = 0;
        for (i, h) in hashes.iter().enumerate() {
            if h.is_some() {
                if found[k].is_none() {
                    unknown.push(i);
                }
                k += 1;
            }
        }
        let compress = self.cfg.packing();
        let enc = |&i: &usize| -> (usize, Encoded) {
            let h = hashes[i].expect("only data chunks are unknown");
            (i, self.encode_chunk(&h, chunks[i].1, compress))
        };
        let encoded: Vec<(usize, Encoded)> = if unknown.len() >= 4 {
            par_map(&unknown, enc)
        } else {
            unknown.iter().map(enc).collect()
        };
        let mut encoded: HashMap<usize, Encoded> = encoded.into_iter().collect();
        self.containers.admit();
        let mut g = self.lock();
        let mut end = 0u64;
        for (i, (&(off, data), h)) in chunks.iter().zip(&hashes).enumerate() {
            end = end.max(off + data.len() as u64);
            let Some(h) = h else {
                g.counters.zero_bytes += data.len() as u64;
                continue;
            };
            let id = self.put_hashed(&mut g, h, data, encoded.remove(&i).map(Prepared::Alone))?;
            g.db.prepare_cached(
                "INSERT INTO extents (ino, off, len, chunk, born) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![ino, off, data.len() as u64, id, g.epoch])?;
        }
        g.db.prepare_cached("UPDATE inodes SET size = MAX(size, ?2) WHERE ino = ?1")?
            .execute(params![ino, end])?;
        Ok(())
    }

    /// Names the other links of multiply-linked sources after their file
    /// was imported (a source that failed gets none).
    fn add_extra_links(&self, shared: &Shared, links: ExtraLinks) -> crate::Result<()> {
        let linked = std::mem::take(&mut *lock_linked(shared));
        let g = self.lock();
        for (k, names) in links {
            let Some(&ino) = linked.get(&k) else { continue };
            for (parent, name) in &names {
                g.add_dirent(*parent, name, ino)?;
                g.add_nlink(ino, 1)?;
                shared.report().hardlinks += 1;
                shared.progress().entries.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

/// Queues regular file `src` for the workers; a further name of a
/// multiply-linked file already queued is kept for the end instead.
fn queue_file(
    tx: &mpsc::SyncSender<FileJob>,
    links: &mut ExtraLinks,
    src: &Path,
    parent: u64,
    name: &[u8],
    md: Metadata,
) {
    let link_key = (md.nlink() > 1).then(|| (md.dev(), md.ino()));
    if let Some(k) = link_key {
        if let Some(names) = links.get_mut(&k) {
            names.push((parent, name.to_vec()));
            return;
        }
        links.insert(k, Vec::new());
    }
    let job = FileJob {
        src: src.into(),
        parent,
        name: name.to_vec(),
        md,
        link_key,
    };
    // The workers only stop taking jobs when the scope ends.
    let _ = tx.send(job);
}

/// The store kind of a source that is not a regular file or a socket,
/// and a symlink's target.
fn node_kind(src: &Path, ft: std::fs::FileType) -> Result<(Kind, Option<Vec<u8>>), ImportError> {
    Ok(if ft.is_dir() {
        (Kind::Dir, None)
    } else if ft.is_symlink() {
        let t = std::fs::read_link(src).map_err(src_err(src))?;
        (Kind::Symlink, Some(t.into_os_string().into_vec()))
    } else if ft.is_fifo() {
        (Kind::Fifo, None)
    } else if ft.is_char_device() {
        (Kind::Char, None)
    } else if ft.is_block_device() {
        (Kind::Block, None)
    } else {
        return Err(ImportError::BadSource {
            path: src.into(),
            why: "unknown file type".into(),
        });
    })
}

fn lock_linked<'a>(shared: &'a Shared) -> std::sync::MutexGuard<'a, HashMap<(u64, u64), u64>> {
    shared.linked.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads until `buf` is full or the end of the file; returns bytes read.
fn read_full(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], off + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The regions of `f` holding data, `[start, end)`, from `SEEK_DATA` /
/// `SEEK_HOLE` (the whole file where the filesystem has no such support,
/// or when its allocated blocks, `blocks` of 512 bytes, cover its size:
/// no hole worth two more system calls per file).
fn data_regions(f: &File, size: u64, blocks: u64) -> std::io::Result<Vec<(u64, u64)>> {
    use onecopy_ioctl::fs::{next_data, next_hole};
    use std::os::fd::AsFd;
    if blocks.saturating_mul(512) >= size {
        return Ok(vec![(0, size)]);
    }
    let errno = |e: &std::io::Error, n| e.raw_os_error() == Some(n);
    let mut out = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        let start = match next_data(f.as_fd(), pos) {
            Ok(Some(s)) => s,
            Ok(None) => break,
            Err(e) if errno(&e, libc::EINVAL) && pos == 0 => return Ok(vec![(0, size)]),
            Err(e) => return Err(e),
        };
        let end = match next_hole(f.as_fd(), start) {
            Ok(e) => e.min(size),
            Err(e) if errno(&e, libc::ENXIO) => size,
            Err(e) => return Err(e),
        };
        if end <= start {
            break;
        }
        out.push((start, end));
        pos = end;
    }
    Ok(out)
}

enum XattrSrc<'a> {
    Path(&'a Path),
    File(&'a File),
}

/// The source's extended attributes; one that cannot be read is skipped
/// with a note.
fn read_xattrs(from: XattrSrc, shared: &Shared, src: &Path) -> Vec<(Vec<u8>, Vec<u8>)> {
    let list_into = |buf: &mut [u8]| match &from {
        XattrSrc::Path(p) => rustix::fs::llistxattr(*p, buf),
        XattrSrc::File(f) => rustix::fs::flistxattr(f, buf),
    };
    // Most entries have none or a short list: a small buffer first, the
    // 64 KiB ones only for an entry that needs them.
    let mut list = vec![0u8; 256];
    let n = match list_into(&mut list[..]) {
        Err(rustix::io::Errno::RANGE) => {
            list = vec![0u8; XATTR_MAX];
            list_into(&mut list[..])
        }
        r => r,
    };
    let n = match n {
        Ok(n) => n,
        Err(rustix::io::Errno::NOTSUP) => return Vec::new(),
        Err(e) => {
            shared.report().notes.push(format!(
                "{}: xattrs not listed ({}), skipped",
                src.display(),
                std::io::Error::from(e)
            ));
            return Vec::new();
        }
    };
    if n == 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut value = vec![0u8; XATTR_MAX];
    for name in list[..n].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let name_os = OsStr::from_bytes(name);
        let r = match &from {
            XattrSrc::Path(p) => rustix::fs::lgetxattr(*p, name_os, &mut value[..]),
            XattrSrc::File(f) => rustix::fs::fgetxattr(f, name_os, &mut value[..]),
        };
        match r {
            Ok(len) => out.push((name.to_vec(), value[..len].to_vec())),
            Err(e) => shared.report().notes.push(format!(
                "{}: xattr {} not read ({}), skipped",
                src.display(),
                String::from_utf8_lossy(name),
                std::io::Error::from(e)
            )),
        }
    }
    out
}

/// Entries and bytes of regular files below `srcs` (symlinks not
/// followed; unreadable parts count as nothing): the total a progress bar
/// shows. Costs one `lstat` per entry.
pub fn measure(srcs: &[PathBuf]) -> (u64, u64) {
    fn walk(p: &Path, acc: &mut (u64, u64)) {
        let Ok(md) = std::fs::symlink_metadata(p) else {
            return;
        };
        acc.0 += 1;
        if md.is_file() {
            acc.1 += md.size();
        } else if md.is_dir() {
            for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
                walk(&e.path(), acc);
            }
        }
    }
    let mut acc = (0, 0);
    for s in srcs {
        walk(s, &mut acc);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StoreConfig;

    /// A source named `.onecopy` at the store's root, or `--to
    /// /.onecopy`, is refused before anything is written: the name is the
    /// snapshots' directory, and what was imported under it could not be
    /// reached through the mount.
    #[test]
    fn nothing_is_imported_as_the_snapshots_directory() {
        let dir = tempfile::tempdir().unwrap();
        Store::init(&dir.path().join("s"), &StoreConfig::default()).unwrap();
        let s = Store::open(&dir.path().join("s")).unwrap();
        let src = dir.path().join("d/.onecopy");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("f"), b"hi").unwrap();
        let import = |src: &Path, to: &[u8]| {
            let opts = ImportOptions {
                to: to.to_vec(),
                ..ImportOptions::default()
            };
            s.import(&[src.to_path_buf()], &opts, &ImportProgress::default())
        };
        for (src, to) in [(&src, &b"/"[..]), (&src.with_file_name(""), b"/.onecopy/x")] {
            let e = import(src, to).unwrap_err();
            assert!(matches!(e, ImportError::BadSource { .. }), "{e}");
        }
        assert!(
            s.lock().child(1, b".onecopy").unwrap().is_none(),
            "nothing made"
        );
        import(&src, b"/x").unwrap();
        assert!(s
            .lookup(s.lookup(1, b"x").unwrap().ino, b".onecopy")
            .is_ok());
    }

    /// A file imported piece by piece (three 4 MiB pieces and a tail) is
    /// cut exactly where FastCDC cuts the whole file, and reads back.
    #[test]
    fn streamed_cdc_cuts_equal_whole_file_cuts() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = StoreConfig {
            chunking: "cdc:16K/64K/256K".parse().unwrap(),
            ..StoreConfig::default()
        };
        Store::init(&dir.path().join("s"), &cfg).unwrap();
        let s = Store::open(&dir.path().join("s")).unwrap();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let data: Vec<u8> = (0..13 * (1 << 20) + 777)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 56) as u8
            })
            .collect();
        let src = dir.path().join("f");
        std::fs::write(&src, &data).unwrap();
        let rep = s
            .import(
                &[src],
                &ImportOptions::default(),
                &ImportProgress::default(),
            )
            .unwrap();
        assert!(rep.failed.is_empty());
        let ino = s.lookup(1, b"f").unwrap().ino;
        let got: Vec<(u64, u64)> = {
            let g = s.lock();
            let mut st =
                g.db.prepare("SELECT off, len FROM extents WHERE ino = ?1 ORDER BY off")
                    .unwrap();
            st.query_map([ino], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .collect::<rusqlite::Result<_>>()
                .unwrap()
        };
        let want: Vec<(u64, u64)> =
            fastcdc::v2020::FastCDC::new(&data, 16 << 10, 64 << 10, 256 << 10)
                .map(|c| (c.offset as u64, c.length as u64))
                .collect();
        assert_eq!(got, want);
        assert!(s.read(ino, 0, data.len()).unwrap() == data);
        assert!(s.fsck(false).unwrap().problems.is_empty());
    }
}
