//! The store: opening (with replay), the group commit, and the chunk layer
//! (put with dedupe, get with checks) shared by file data and maintenance.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::{params, Connection, OptionalExtension};

use crate::attrs::AttrCache;
use crate::cache::{ChunkCache, Piece};
use crate::chunks::Chunks;
use crate::config::{StoreConfig, FORMAT, FORMAT_MIN, MAGIC};
use crate::container::{self, ContainerStore, Encoded, Hash, LocalDir, CONTAINER_HEADER};
use crate::data::DirtyFile;
use crate::error::{Result, StoreError};
use crate::index::StoreIndex;
use crate::meta::{open_db, ChunkId, ChunkLoc};
use crate::ns::Absent;
use crate::pack::{Pack, Prepared};
use crate::seen::XattrsSeen;
use crate::space::Reserve;

/// Counters of what writes did since the store was opened (kept in `meta`
/// across mounts by the commit).
#[derive(Debug, Default, Clone, Copy)]
pub struct WriteCounters {
    /// Bytes of chunks stored for the first time (before compression).
    pub new_bytes: u64,
    /// Bytes of chunks found already stored.
    pub dup_bytes: u64,
    /// Bytes of all-zero chunks kept as holes.
    pub zero_bytes: u64,
}

/// How reads move a file's access time: the mount's atime option.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Atime {
    /// Never (`noatime`; the default of a store opened outside a mount).
    #[default]
    Never,
    /// When atime is not after mtime or ctime, or a day old (`relatime`,
    /// the mount's default, as the kernel's).
    Relative,
    /// At every read (`strictatime`).
    Strict,
}

/// Bytes a remote store's cache gives back at least when the disk is
/// short of room (see [`ContainerStore::shed`]), so that a disk kept full
/// by the cache is not asked again at every write.
const SHED_AT_LEAST: u64 = 64 << 20;

/// Room a remote store's cache keeps free beside the reserve at each
/// commit, by giving back copies: the database's WAL and the push's image
/// of it grow without asking for room, and on a cache disk kept full by
/// copies they took the reserve's room from the unmount's commit, which
/// failed with SQLITE_FULL (test `names_alone_on_a_cache_disk_full_of_copies`
/// reproduces it without this room). A local store
/// has no copies to give back: for it this changes nothing.
const COMMIT_ROOM: u64 = 16 << 20;

/// Everything behind the store's lock.
pub(crate) struct Inner {
    pub db: Connection,
    /// Copies of `inodes` rows (see `attrs.rs` for why they stay equal).
    pub attrs: AttrCache,
    pub dirty: HashMap<u64, DirtyFile>,
    pub open_count: HashMap<u64, u32>,
    pub writer: Writer,
    pub counters: WriteCounters,
    /// The fingerprint index (see `crate::index` for its invariants).
    pub index: StoreIndex,
    /// Room promised by `fallocate` and not yet used, by inode (kept in
    /// the `prealloc` table; see [`Store::fallocate`]).
    pub prealloc: HashMap<u64, u64>,
    /// Inodes whose `prealloc` changed since the last commit.
    pub prealloc_dirty: BTreeSet<u64>,
    /// The file whose buffer is being stored: its appends may use its own
    /// preallocated room.
    pub flushing: Option<u64>,
    /// Room for more buffered bytes (see [`Store::room_to_buffer`]): free
    /// beside the reserve, promised and buffered bytes when last asked,
    /// less what writes buffered since.
    pub room_seen: u64,
    /// Metadata bytes taken in since the last commit by requests that
    /// charge it ([`Store::room_for_metadata`]): in the open transaction, not
    /// yet on the disk, so the free space does not show them.
    pub meta_unsaved: u64,
    /// The open epoch (`meta.epoch`): rows inserted carry it as `born`,
    /// so that the history triggers need not stamp them (see `snap.rs`).
    pub epoch: u64,
    /// The same as [`Store::seen`].
    pub seen: Arc<XattrsSeen>,
    /// Guards of this lock taken so far ([`Locked::new`] counts them).
    pub locks: u64,
    /// The last name a lookup found absent (see [`Absent`]).
    pub absent: std::cell::Cell<Option<Absent>>,
}

impl Inner {
    /// Applies every durable operation to the fingerprint index and
    /// commits it (W and the journal are recorded in the open transaction).
    pub(crate) fn settle_index(&mut self) -> Result<()> {
        self.index.made_durable(&self.db, true)
    }
}

/// Why the store stopped committing (see [`Store::poison`]).
#[derive(Debug, Clone)]
pub(crate) struct Poison {
    pub container: u64,
    pub why: String,
}

/// The open container chunks are appended to.
pub(crate) struct Writer {
    pub id: u64,
    pub len: u64,
    /// Containers appended to since the last commit.
    pub unsynced: BTreeSet<u64>,
    /// An append failed (ENOSPC, EIO): the file may hold part of a record
    /// past `len`, so nothing more is appended to it; the next record
    /// seals it at `len` and starts a new container.
    pub tainted: bool,
    /// The id the next container gets: above every id in the database
    /// and every container file when the store was opened, and above
    /// every container made since. The store's lock file makes this
    /// process the only one that creates containers, so the container
    /// directory is listed once, at open, not at every new container
    /// (that listing, under the store's lock, cost a directory scan per
    /// 4 MiB written: O(containers) each time).
    pub next_id: u64,
}

/// An open store. All calls are thread-safe.
pub struct Store {
    pub(crate) dir: PathBuf,
    pub(crate) cfg: StoreConfig,
    pub(crate) containers: Arc<dyn ContainerStore>,
    pub(crate) inner: Mutex<Inner>,
    /// Decoded chunks recently read (outside the lock).
    pub(crate) cache: ChunkCache,
    /// Where a walk reading files is, for reading ahead of it.
    pub(crate) ahead: crate::ahead::Ahead,
    /// Which xattrs the store asks itself any inode may hold (read
    /// without the lock: the kernel asks `security.capability` before
    /// every write).
    pub(crate) seen: Arc<XattrsSeen>,
    /// Set when a container sync failed. The kernel may have dropped the
    /// pages it could not write while a later sync of the same file
    /// succeeds (its error is reported once, to one caller), so the open
    /// transaction, which may reference those bytes, must never commit:
    /// every later commit (and so every `fsync`) fails with `EIO` until the
    /// store is reopened, which replays the last good commit. Every
    /// container sync runs holding this lock, so a sync that succeeds
    /// after another's failure consumed the error still sees the poison.
    poison: Mutex<Option<Poison>>,
    /// The atime policy (an [`Atime`] as u8).
    atime: std::sync::atomic::AtomicU8,
    /// Nameless inodes wait for the kernel's FORGET (see
    /// [`Store::keep_until_forgotten`]).
    pub(crate) kernel_refs: AtomicBool,
    /// Writes leave files' mtime and ctime alone (see
    /// [`Store::leave_file_times_to_kernel`]).
    pub(crate) kernel_times: AtomicBool,
    /// Held by a running gc: a second one (two `store gc` on one mount)
    /// waits for it, so it never copies from a container the first has
    /// just compacted and deleted.
    pub(crate) gc_running: Mutex<()>,
    /// Files closed whose release waits for [`Store::settle_releases`]
    /// (see [`Store::release_later`]).
    pub(crate) released: Mutex<Vec<u64>>,
    pub(crate) released_cv: std::sync::Condvar,
    /// The metadata reserve (see `space.rs`), checked before each commit.
    reserve: Mutex<Reserve>,
    /// Whether the reserve is released: new data and files get ENOSPC.
    low: AtomicBool,
    /// Why the store shut down: a COMMIT was rolled back (a full disk
    /// despite the reserve), so work that programs were told was done is
    /// lost. From then on every request fails with EIO, as a crashed
    /// filesystem would, until the store is reopened (which replays the
    /// last commit); see [`Store::check_live`].
    shut_down: Mutex<Option<String>>,
    /// The bucket a remote store lives in (its metadata side).
    pub(crate) mirror: Option<crate::mirror::Mirror>,
    /// A read-only cache following its bucket (`follow.rs`).
    pub(crate) follower: Option<crate::follow::Follower>,
    /// An encrypted store's keys: chunk ids keyed, records sealed.
    pub(crate) keys: Option<Arc<crate::seal::Keys>>,
    _lock: File,
}

/// A remote store's last push (see [`Store::close_remote`]); an error
/// is said on stderr (nothing is lost: the cache holds it, and the next
/// open pushes it).
impl Drop for Store {
    fn drop(&mut self) {
        if let Err(e) = self.close_remote() {
            crate::warn!(
                "onecopy: {}: the last push to the bucket failed: {e}",
                self.dir.display()
            );
        }
    }
}

/// Bytes of decoded chunks the read cache keeps.
const CACHE_BYTES: usize = 64 << 20;

/// Now, in nanoseconds since the epoch, from the clock the kernel stamps
/// inodes with (CLOCK_REALTIME_COARSE, a tick's resolution). The kernel
/// sets some of a file's times itself (mtime and ctime of writes and
/// `chmod` under the writeback cache) and the store sets the others: on
/// one clock, a file made later never shows an earlier time than one made
/// before it (on the fine clock it could, by up to a tick: xfstests
/// generic/423).
fn now_ns() -> i64 {
    clock_ns(rustix::time::ClockId::RealtimeCoarse)
}

/// `clock`'s time in nanoseconds since the epoch.
fn clock_ns(clock: rustix::time::ClockId) -> i64 {
    let t = rustix::time::clock_gettime(clock);
    t.tv_sec.saturating_mul(1_000_000_000) + t.tv_nsec
}

pub(crate) fn time_now() -> i64 {
    now_ns()
}

/// The wall clock at full resolution, for times compared to order
/// events one thread makes microseconds apart (a gc delete recorded, then
/// the manifest that follows it): the coarse clock of [`time_now`] ticks
/// every few milliseconds, and would give both the same time.
pub(crate) fn precise_now() -> i64 {
    clock_ns(rustix::time::ClockId::Realtime)
}

/// How long [`lock_dir`] tries before answering `Locked`.
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_millis(200);

/// Takes the store's `flock`, trying again for [`LOCK_PATIENCE`]: a lock
/// just let go can still be held for a moment by a child this process
/// forked while the lock file was open (the descriptor lives in the child
/// until its `exec` closes it), and a store opened right after another
/// handle on it closed must not be refused for that.
fn lock_dir(dir: &Path) -> Result<File> {
    let path = dir.join("lock");
    let f = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(StoreError::io(&path))?;
    let start = std::time::Instant::now();
    loop {
        match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(f),
            Err(rustix::io::Errno::INTR) => {}
            Err(_) if start.elapsed() < LOCK_PATIENCE => {
                std::thread::sleep(std::time::Duration::from_millis(5))
            }
            Err(_) => return Err(StoreError::Locked { path: dir.into() }),
        }
    }
}

impl Store {
    /// Creates a new, empty store in `dir`, which may exist but must be
    /// empty (a fresh filesystem's `lost+found` aside): a store shares its
    /// directory with nothing (`Exists` if it holds a store,
    /// `NotEmptyDir` if it holds anything else).
    /// The directory is created mode 0700: the store holds other users'
    /// file data, readable by whoever can read its containers.
    pub fn init(dir: &Path, cfg: &StoreConfig) -> Result<()> {
        Self::init_with(dir, cfg, None)
    }

    /// [`Store::init`]; a remote store (`cfg.remote`) given a password is
    /// encrypted (see `seal.rs`).
    pub fn init_with(dir: &Path, cfg: &StoreConfig, password: Option<&[u8]>) -> Result<()> {
        let mut cfg = cfg.clone();
        let sealing = match &mut cfg.remote {
            Some(spec) => Self::prepare_bucket(spec, password)?,
            None => None,
        };
        let cfg = &cfg;
        make_store_dir(dir)?;
        let _lock = lock_dir(dir)?;
        let db = open_db(&dir.join("meta.sqlite"), true)?;
        let t = now_ns();
        db.execute(
            "INSERT INTO inodes (ino, kind, perm, uid, gid, nlink, size, atime_ns, mtime_ns,
             ctime_ns, rdev) VALUES (1, 2, 493, 0, 0, 2, 0, ?1, ?1, ?1, 0)",
            [t],
        )?;
        drop(db);
        // Written last, synced, then renamed into place: a crash leaves
        // either no store.json (init can run again) or a whole one.
        write_config(dir, cfg)?;
        if cfg.remote.is_some() {
            drop(_lock);
            Self::first_push(dir, sealing)?;
        }
        Ok(())
    }

    /// Reads `store.json` without opening the store.
    /// Formats [`FORMAT_MIN`] to [`FORMAT`] are read; opening migrates.
    pub fn read_config(dir: &Path) -> Result<StoreConfig> {
        let path = dir.join("store.json");
        let bytes = std::fs::read(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                StoreError::NotAStore {
                    path: dir.into(),
                    why: "no store.json; create one with `onecopy store init`".into(),
                }
            } else {
                StoreError::io(&path)(e)
            }
        })?;
        let cfg: StoreConfig =
            serde_json::from_slice(&bytes).map_err(|e| StoreError::NotAStore {
                path: path.clone(),
                why: e.to_string(),
            })?;
        if cfg.magic != MAGIC {
            return Err(StoreError::NotAStore {
                path,
                why: "wrong magic".into(),
            });
        }
        if !(FORMAT_MIN..=FORMAT).contains(&cfg.format) {
            return Err(StoreError::Version {
                path,
                found: cfg.format,
                supported: FORMAT,
            });
        }
        Ok(cfg)
    }

    /// Opens the store in `dir`, taking its lock and replaying the state a
    /// crash may have left (see the crash model in ARCHITECTURE.md).
    pub fn open(dir: &Path) -> Result<Store> {
        match Self::read_config(dir)?.remote {
            Some(spec) if spec.read_only => Self::open_follower(dir, &spec),
            Some(spec) => Self::open_remote(dir, &spec),
            None => Self::open_with(dir, Arc::new(LocalDir::new(dir.join("containers")))),
        }
    }

    /// Opens the store with its containers in another [`ContainerStore`]
    /// (an object store, or a fault-injecting backend in tests); the
    /// metadata stays in `dir`.
    pub fn open_with(dir: &Path, containers: Arc<dyn ContainerStore>) -> Result<Store> {
        Self::open_locked(dir, containers, lock_dir(dir)?)
    }

    /// [`Store::open_with`] with the store's lock taken (`lock`, from
    /// [`Store::lock_dir`]).
    pub(crate) fn open_locked(
        dir: &Path,
        containers: Arc<dyn ContainerStore>,
        lock: File,
    ) -> Result<Store> {
        let mut cfg = Self::read_config(dir)?;
        // First: on a full disk it gives back the room that opening the
        // database (replaying its last commit) needs.
        let reserve = Reserve::open(dir);
        let db = open_db(&dir.join("meta.sqlite"), false)?;
        if cfg.format < FORMAT {
            // open_db migrated the database; the index is built below.
            cfg.format = FORMAT;
            write_config(dir, &cfg)?;
        }
        let writer = replay(&db, &*containers)?;
        resume_uploads(&db, &*containers)?;
        let prealloc = load_prealloc(&db)?;
        let index = StoreIndex::open(dir, &db, &cfg)?;
        let counters = load_counters(&db)?;
        let seen = Arc::new(XattrsSeen::load(&db)?);
        db.execute_batch("BEGIN")?;
        let epoch = crate::snap::epoch(&db)?;
        let attrs = AttrCache::default();
        attrs.attach(&db);
        let low = AtomicBool::new(reserve.is_low());
        let store = Store {
            dir: dir.into(),
            cfg,
            containers,
            inner: Mutex::new(Inner {
                db,
                attrs,
                dirty: HashMap::new(),
                open_count: HashMap::new(),
                writer,
                counters,
                index,
                prealloc,
                prealloc_dirty: BTreeSet::new(),
                flushing: None,
                room_seen: 0,
                meta_unsaved: 0,
                epoch,
                seen: seen.clone(),
                locks: 0,
                absent: Default::default(),
            }),
            cache: ChunkCache::new(CACHE_BYTES),
            ahead: Default::default(),
            seen,
            poison: Mutex::new(None),
            gc_running: Mutex::new(()),
            released: Mutex::new(Vec::new()),
            released_cv: std::sync::Condvar::new(),
            kernel_refs: AtomicBool::new(false),
            kernel_times: AtomicBool::new(false),
            atime: std::sync::atomic::AtomicU8::new(Atime::Never as u8),
            reserve: Mutex::new(reserve),
            low,
            shut_down: Mutex::new(None),
            mirror: None,
            follower: None,
            keys: None,
            _lock: lock,
        };
        store.remove_orphans()?;
        Ok(store)
    }

    /// Serves another database, `new` (a follower's next state): the
    /// connection is closed, `new` renamed over `meta.sqlite` and opened,
    /// and what the store keeps in memory from the database reloaded. A
    /// failure part-way shuts the store down (it has no database).
    pub(crate) fn replace_db(&self, new: &Path) -> Result<()> {
        let mut g = self.lock();
        let r = self.replace_db_locked(&mut g, new);
        if let Err(e) = &r {
            self.shut_down(format!("the next state could not be opened: {e}"));
        }
        r
    }

    fn replace_db_locked(&self, g: &mut Inner, new: &Path) -> Result<()> {
        let meta = self.dir.join("meta.sqlite");
        drop(std::mem::replace(&mut g.db, Connection::open_in_memory()?));
        std::fs::rename(new, &meta).map_err(StoreError::io(&meta))?;
        let db = open_db(&meta, false)?;
        let (id, len): (u64, u64) = db.query_row(
            "SELECT id, length FROM containers WHERE sealed = 0 ORDER BY id DESC LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        // Read-only: the writer never appends (tainted) nor commits rows.
        g.writer = Writer {
            id,
            len,
            unsynced: BTreeSet::new(),
            tainted: true,
            next_id: id + 1,
        };
        g.counters = load_counters(&db)?;
        g.epoch = crate::snap::epoch(&db)?;
        g.prealloc = load_prealloc(&db)?;
        g.seen.reload(&db)?;
        db.execute_batch("BEGIN")?;
        g.attrs.attach(&db);
        g.db = db;
        self.cache.clear();
        Ok(())
    }

    /// Takes the store's lock (one process at a time): `Locked` if
    /// another holds it.
    pub(crate) fn lock_dir(dir: &Path) -> Result<File> {
        lock_dir(dir)
    }

    /// Sets how reads move access times (a mount's atime option).
    pub fn set_atime(&self, a: Atime) {
        self.atime.store(a as u8, Ordering::Relaxed);
    }

    /// A mount with the kernel's writeback cache: the kernel stamps a
    /// regular file's mtime and ctime at each `write(2)` and sends them
    /// (SETATTR) when it writes the inode back, while the pages travel as
    /// background WRITEs that the mount's threads may run after that
    /// SETATTR. A WRITE that stamped the store's clock would then replace
    /// the times programs saw (they moved at the next mount), so from now
    /// on writes leave them to the kernel. A store opened outside a mount
    /// stamps them at each write.
    pub fn leave_file_times_to_kernel(&self) {
        self.kernel_times.store(true, Ordering::Relaxed);
    }

    pub(crate) fn atime_policy(&self) -> Atime {
        match self.atime.load(Ordering::Relaxed) {
            x if x == Atime::Relative as u8 => Atime::Relative,
            x if x == Atime::Strict as u8 => Atime::Strict,
            _ => Atime::Never,
        }
    }

    /// The store's settings.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn lock(&self) -> Locked<'_> {
        Locked::new(self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Commits all metadata changes. Containers written since the last
    /// commit are made durable first (most of that outside the lock, so
    /// writers do not wait for the disk); with `durable` the commit itself
    /// is too (synchronous=FULL), as `fsync` requires.
    pub fn commit(&self, durable: bool) -> Result<()> {
        let pending: Vec<u64> = self.lock().writer.unsynced.iter().copied().collect();
        for id in pending {
            self.sync_container(id)?;
        }
        let mut g = self.lock();
        self.commit_locked(&mut g, durable)
    }

    /// Writes every buffered file and commits (as on unmount).
    /// With `durable` (unmount, gc, fsck) the fingerprint index is also
    /// brought up to date and committed, so the next open replays nothing.
    ///
    /// A file whose buffer cannot be stored (a full disk) keeps it and
    /// does not hold up the others or the commit of everything else: its
    /// error is returned after the commit.
    pub fn flush_all(&self, durable: bool) -> Result<()> {
        self.settle_releases();
        let inos: Vec<u64> = self.lock().dirty.keys().copied().collect();
        let mut first = None;
        for ino in inos {
            if let Err(e) = self.flush_file(ino) {
                first.get_or_insert(e);
            }
        }
        self.commit(durable)?;
        if durable {
            let mut g = self.lock();
            g.settle_index()?;
            self.commit_locked(&mut g, true)?;
        }
        first.map_or(Ok(()), Err)
    }

    /// Commits and opens the next transaction. The store always works
    /// inside one: a COMMIT that fails (SQLITE_FULL on a full disk) may
    /// have rolled the transaction back (its changes are lost as in a
    /// crash, and the caller gets the error); a new one is begun so that
    /// service resumes once space is freed.
    ///
    /// A rolled-back COMMIT loses work programs were told was done (files
    /// closed in the last second vanish), so the store shuts down: see
    /// [`Store::check_live`]. The reserve makes that rare (`space.rs`).
    pub(crate) fn commit_locked(&self, g: &mut Inner, durable: bool) -> Result<()> {
        self.check_live()?;
        let inos = inode_seq(&g.db)?;
        g.room_seen = self.room_beside(g, COMMIT_ROOM);
        let r = self.commit_and_begin(g, durable);
        // Written by the commit (or rolled back): the free space shows it.
        g.meta_unsaved = 0;
        if g.db.is_autocommit() {
            if let Err(e) = &r {
                g.index.rolled_back();
                self.shut_down(format!("a metadata commit was rolled back: {e}"));
            }
            g.db.execute_batch("BEGIN")?;
            self.after_rollback(g, inos)?;
        }
        r
    }

    /// Stops the store (see [`Store::check_live`]); said once on stderr.
    fn shut_down(&self, why: String) {
        let mut s = self.shut_down.lock().unwrap_or_else(|e| e.into_inner());
        if s.is_none() {
            crate::warn!(
                "onecopy: the store shut down ({why}); every request fails with EIO \
                 until it is unmounted and mounted again"
            );
            *s = Some(why);
        }
    }

    /// `Err(ShutDown)` once the store shut down: the mount answers every
    /// request with EIO, commits fail, the store must be reopened.
    pub fn check_live(&self) -> Result<()> {
        let s = self.shut_down.lock().unwrap_or_else(|e| e.into_inner());
        match &*s {
            Some(why) => Err(StoreError::ShutDown { why: why.clone() }),
            None => Ok(()),
        }
    }

    /// The reserve, released or taken back for the free space now, with
    /// `low` set to match.
    fn adjusted_reserve(&self) -> MutexGuard<'_, Reserve> {
        let mut r = self.reserve.lock().unwrap_or_else(|e| e.into_inner());
        self.low.store(r.adjust(), Ordering::Relaxed);
        r
    }

    /// `Err(LowSpace)` while the store is low on space (the reserve is
    /// released for commits) and writing `more` bytes would leave less
    /// than the reserve's size free: nothing new is taken in. Checked at
    /// each call, so writes resume as soon as space is back.
    ///
    /// Room promised to other files' preallocations is kept free too (the
    /// file being stored, `g.flushing`, may use its own).
    pub(crate) fn room_for_more(&self, g: &Inner, more: u64) -> Result<()> {
        let own = g
            .flushing
            .and_then(|i| g.prealloc.get(&i))
            .copied()
            .unwrap_or(0);
        let held = g.prealloc.values().sum::<u64>() - own;
        if !self.low.load(Ordering::Relaxed) && held == 0 {
            return Ok(());
        }
        let short = || {
            let r = self.adjusted_reserve();
            let fits = match g.flushing {
                // Buffered bytes, given room when they were written.
                Some(_) => r.has_room_for_promised(more, held),
                None => r.has_room(more, held),
            };
            (r.is_low() || held > 0) && !fits
        };
        if short() && (!self.shed_copies(more) || short()) {
            return Err(StoreError::LowSpace {
                path: self.dir.clone(),
            });
        }
        Ok(())
    }

    /// Before a write buffers `more` bytes of `ino`: they must fit in
    /// the free space beside the reserve, the room promised to
    /// preallocations (their own file's covers them) and the bytes
    /// buffered already, or the write fails with ENOSPC. A file closed
    /// without an fsync is stored later by the releasing thread, when no
    /// program can be told of a failure: its bytes must never meet a
    /// full disk. The filesystem is asked only when the room seen at the
    /// last commit or look, less what writes buffered since, runs out.
    /// Zeros take no room (they are stored as holes: a hole punched to
    /// free space is never refused).
    ///
    /// `(bytes, extra)` is what the write adds to the cost of storing the
    /// file's buffer ([`Store::buffer_growth`]): a few bytes written into
    /// a page inside the file cost the whole page, not their own length,
    /// and `extra` its headers and a CDC run's widening. The file's
    /// preallocated room (`fallocate`: the range's bytes) covers the
    /// bytes it buffers once: a write within what is left of it is taken
    /// (its headers go on the reserve's slack when stored, as before);
    /// past it, the bytes beyond and `extra` need room.
    pub(crate) fn room_to_buffer(
        &self,
        g: &mut Inner,
        ino: u64,
        (bytes, extra): (u64, u64),
    ) -> Result<()> {
        let own = g.prealloc.get(&ino).copied().unwrap_or(0);
        let free_own = own.saturating_sub(g.dirty.get(&ino).map_or(0, DirtyFile::bytes));
        if bytes <= free_own {
            return Ok(());
        }
        self.room_to_hold(g, bytes - free_own + extra)
    }

    /// `more` bytes (buffered data, or metadata such as an xattr's value)
    /// taken from the room seen at the last commit or look, the
    /// filesystem asked again when it runs out: ENOSPC when they do not
    /// fit beside the reserve, promised room and buffered bytes.
    pub(crate) fn room_to_hold(&self, g: &mut Inner, more: u64) -> Result<()> {
        if g.room_seen < more {
            g.room_seen = self.room_beside(g, more);
            if g.room_seen < more {
                return Err(StoreError::NoSpace);
            }
        }
        g.room_seen -= more;
        Ok(())
    }

    /// [`Store::room_to_hold`] for metadata the open transaction takes in
    /// (counted in [`Inner::meta_unsaved`] until the commit).
    pub(crate) fn room_for_metadata(&self, g: &mut Inner, more: u64) -> Result<()> {
        self.room_to_hold(g, more)?;
        g.meta_unsaved += more;
        Ok(())
    }

    /// Free bytes beside the reserve (while released), promised room and
    /// buffered bytes not covered by their own file's promise; the
    /// reserve adjusted first (see `space.rs`). Under `want`, a remote
    /// store's cache gives back copies of containers the bucket holds.
    fn room_beside(&self, g: &Inner, want: u64) -> u64 {
        let promised = |ino: &u64| g.prealloc.get(ino).copied().unwrap_or(0);
        let held: u64 = g.prealloc.values().sum();
        let buffered: u64 = (g.dirty.iter())
            .map(|(ino, d)| self.buffer_cost(g, *ino, d).saturating_sub(promised(ino)))
            .sum();
        let keep = held.saturating_add(buffered).saturating_add(g.meta_unsaved);
        let room = self.adjusted_reserve().room(keep);
        if room >= want || !self.shed_copies(want - room) {
            return room;
        }
        self.adjusted_reserve().room(keep)
    }

    /// The disk is `short` bytes short: a remote store's cache gives
    /// back copies of containers the bucket holds, at least
    /// [`SHED_AT_LEAST`]; whether it freed any.
    fn shed_copies(&self, short: u64) -> bool {
        self.containers.shed(short.max(SHED_AT_LEAST)) > 0
    }

    /// Promises `bytes` more room to `ino` (`fallocate`), or fails with
    /// ENOSPC when the filesystem does not have them beside the reserve
    /// and what other files were promised.
    pub(crate) fn promise_room(&self, g: &mut Inner, ino: u64, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let held: u64 = g.prealloc.values().sum();
        if !self.adjusted_reserve().has_room(bytes, held) {
            return Err(StoreError::NoSpace);
        }
        *g.prealloc.entry(ino).or_default() += bytes;
        g.prealloc_dirty.insert(ino);
        Ok(())
    }

    /// `ino`'s promised room is used up by `bytes` just stored, or given
    /// back whole (`None`: the file was deleted or emptied).
    pub(crate) fn use_room(g: &mut Inner, ino: u64, bytes: Option<u64>) {
        let Some(left) = g.prealloc.get_mut(&ino) else {
            return;
        };
        *left = bytes.map_or(0, |b| left.saturating_sub(b));
        if *left == 0 {
            g.prealloc.remove(&ino);
        }
        g.prealloc_dirty.insert(ino);
    }

    /// After a COMMIT that rolled back, the memory of the store is brought
    /// back to the last commit, as a reopen would: the open container may
    /// be one whose row was rolled back (chunks appended to it later would
    /// be committed into a container gc deletes as a stray), so the
    /// writer moves on to a new container; inode numbers handed out in
    /// the lost transaction are never handed out again (`inos`, the
    /// highest before the COMMIT: the kernel may still cache those inodes,
    /// and a write buffer of one would be flushed into the new file);
    /// write buffers of inodes that no longer exist are dropped, and the
    /// read cache forgets the rolled-back containers.
    fn after_rollback(&self, g: &mut Inner, inos: i64) -> Result<()> {
        g.attrs.clear();
        // First: the statements below may fail (a full disk).
        self.cache.clear();
        g.db.execute(
            "UPDATE sqlite_sequence SET seq = MAX(seq, ?1) WHERE name = 'inodes'",
            [inos],
        )?;
        // No container I/O here (the disk may still be full): the open
        // container of the last commit is sealed at its committed length
        // (the lost transaction may have appended to it), and the writer
        // starts a new container at its next record.
        let open: Option<(u64, u64)> =
            g.db.query_row(
                "SELECT id, length FROM containers WHERE sealed = 0 ORDER BY id DESC LIMIT 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        g.db.execute("UPDATE containers SET sealed = 1 WHERE sealed = 0", [])?;
        let (id, len) = open.unwrap_or((g.writer.id, g.writer.len));
        self.containers.sealed(id, len);
        // Containers the lost transaction made stay on disk with no row:
        // `next_id`, kept in memory, is above them too.
        g.writer = Writer {
            id,
            len,
            unsynced: BTreeSet::new(),
            tainted: true,
            next_id: g.writer.next_id,
        };
        let gone: Vec<u64> = g
            .dirty
            .keys()
            .copied()
            .filter(|&ino| matches!(g.attr(ino), Err(StoreError::NotFound)))
            .collect();
        for ino in gone {
            g.dirty.remove(&ino);
        }
        Ok(())
    }

    /// `Err` once a container sync has failed (see [`Store::poison`]).
    fn check_poison(&self) -> Result<()> {
        let p = self.poison.lock().unwrap_or_else(|e| e.into_inner());
        match &*p {
            Some(p) => Err(StoreError::Poisoned {
                container: p.container,
                why: p.why.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Syncs container `id`; a failure poisons the store (see
    /// [`Store::poison`]), and a poisoned store syncs nothing.
    fn sync_container(&self, id: u64) -> Result<()> {
        let mut p = self.poison.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = &*p {
            return Err(StoreError::Poisoned {
                container: p.container,
                why: p.why.clone(),
            });
        }
        self.containers.sync(id).inspect_err(|e| {
            *p = Some(Poison {
                container: id,
                why: e.to_string(),
            });
        })
    }

    fn commit_and_begin(&self, g: &mut Inner, durable: bool) -> Result<()> {
        // A failed sync (ENOSPC, EIO) poisons the store: the bytes it
        // should have made durable may be gone even if a later sync of
        // the same container succeeds, so nothing is committed again.
        // All writebacks are started first, so the syncs overlap.
        for &id in &g.writer.unsynced {
            self.containers.start_sync(id);
        }
        while let Some(&id) = g.writer.unsynced.first() {
            self.sync_container(id)?;
            g.writer.unsynced.remove(&id);
            // Not the open container: a dropped partial page would be
            // read back from the disk at its next append.
            if id != g.writer.id {
                self.containers.drop_cache(id);
            }
        }
        // Also when nothing was left to sync: another thread's sync (of
        // these very bytes) may have failed; this waits for it.
        self.check_poison()?;
        let (id, len) = (g.writer.id, g.writer.len);
        g.db.execute(
            "UPDATE containers SET length = ?2 WHERE id = ?1",
            params![id, len],
        )?;
        save_counters(&g.db, &g.counters)?;
        save_prealloc(&g.db, &g.prealloc, &mut g.prealloc_dirty)?;
        g.db.execute_batch("COMMIT")?;
        g.index.committed();
        // Index operations wait for a durable commit: make one when too
        // many wait.
        let durable = durable || g.index.wants_durable();
        if durable {
            // The safety level can only change between transactions: a
            // small FULL transaction syncs the WAL, and with it every
            // frame committed before.
            g.db.pragma_update(None, "synchronous", "FULL")?;
            let r =
                g.db.execute_batch("BEGIN")
                    .and_then(|_| save_counters(&g.db, &g.counters).map_err(to_sql))
                    .and_then(|_| g.db.execute_batch("COMMIT"));
            g.db.pragma_update(None, "synchronous", "NORMAL")?;
            r?;
        }
        g.db.execute_batch("BEGIN")?;
        if durable {
            g.index.made_durable(&g.db, false)?;
        }
        Ok(())
    }

    /// Stores `data` (not all zero) once: returns the chunk it is now a
    /// reference to, a new one or an existing one.
    pub(crate) fn put_chunk(&self, g: &mut Inner, data: &[u8]) -> Result<ChunkId> {
        let hash: Hash = self.fingerprint(data);
        self.put_hashed(g, &hash, data, None)
    }

    /// [`Store::put_chunk`] with the hash (and, for a chunk expected to be
    /// new, its record or its place in a pack) computed beforehand outside
    /// the lock.
    pub(crate) fn put_hashed(
        &self,
        g: &mut Inner,
        hash: &Hash,
        data: &[u8],
        enc: Option<Prepared<'_>>,
    ) -> Result<ChunkId> {
        let hash = *hash;
        let Inner { db, index, .. } = g;
        if let Some((id, loc)) = index.lookup(db, &hash)? {
            let same = !self.cfg.verify || self.verify_hit(id, loc, data)?;
            if same {
                Chunks(&g.db).incref(id, 1)?;
                g.counters.dup_bytes += data.len() as u64;
                return Ok(id);
            }
            // The stored copy is damaged: write a healthy one and point the
            // index at it (its references stay).
            let loc = self.append_record(g, &hash, data)?;
            Self::used_room(g, loc);
            Chunks(&g.db).relocate(id, loc, 1)?;
            return Ok(id);
        }
        let loc = match enc {
            Some(Prepared::Alone(enc)) => self.append_encoded(g, &enc)?,
            Some(Prepared::Packed(pack, inner)) => self.put_in_pack(g, pack, inner, data)?,
            None => self.append_encoded(g, &self.encode_chunk(&hash, data, self.cfg.packing()))?,
        };
        Self::used_room(g, loc);
        g.counters.new_bytes += data.len() as u64;
        let id = Chunks(&g.db).insert(&hash, loc)?;
        g.index.added(&hash, id);
        Ok(id)
    }

    /// The location of `data`, at `inner` in `pack`: the pack is appended
    /// by the first of its chunks stored.
    fn put_in_pack(
        &self,
        g: &mut Inner,
        pack: &mut Pack,
        inner: u32,
        data: &[u8],
    ) -> Result<ChunkLoc> {
        let at = match pack.at {
            Some(at) => at,
            None => *pack.at.insert(self.append_encoded(g, &pack.enc)?),
        };
        Ok(Pack::member(at, inner, data.len() as u32))
    }

    /// A chunk just stored at `loc` for the file being flushed uses its
    /// stored bytes (its share of a pack's) from the room promised to it.
    fn used_room(g: &mut Inner, loc: ChunkLoc) {
        if let Some(ino) = g.flushing {
            Self::use_room(g, ino, Some(loc.stored_share()));
        }
    }

    /// `Ok(true)` when the stored chunk equals `data`, `Ok(false)` when it
    /// is damaged; a different chunk under the same BLAKE3 is an error.
    fn verify_hit(&self, id: ChunkId, loc: ChunkLoc, data: &[u8]) -> Result<bool> {
        match self.read_loc(loc) {
            Ok(stored) if *stored == *data => Ok(true),
            Ok(_) => Err(StoreError::Damaged {
                container: loc.container,
                offset: loc.offset,
                why: format!("chunk {id}: different bytes under the same BLAKE3-256"),
            }),
            Err(StoreError::Damaged { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Appends a record to the open container, starting a new container
    /// when this one is full.
    pub(crate) fn append_record(
        &self,
        g: &mut Inner,
        hash: &Hash,
        data: &[u8],
    ) -> Result<ChunkLoc> {
        let enc = self.encode_chunk(hash, data, self.cfg.packing());
        self.append_encoded(g, &enc)
    }

    /// Appends an encoded record (see [`Store::append_record`]); its
    /// location says it holds one chunk (`inner` none).
    pub(crate) fn append_encoded(&self, g: &mut Inner, enc: &Encoded) -> Result<ChunkLoc> {
        self.room_for_more(g, enc.bytes.len() as u64 + CONTAINER_HEADER)?;
        let w = &mut g.writer;
        let full =
            w.len > CONTAINER_HEADER && w.len + enc.bytes.len() as u64 > self.cfg.container_size;
        if full || w.tainted {
            self.roll(g)?;
        }
        let w = &mut g.writer;
        if let Err(e) = self.containers.append(w.id, &enc.bytes) {
            w.tainted = true;
            return Err(e);
        }
        let loc = ChunkLoc {
            container: w.id,
            offset: w.len,
            stored_len: enc.bytes.len() as u32,
            raw_len: enc.raw_len,
            inner: None,
        };
        w.len += enc.bytes.len() as u64;
        w.unsynced.insert(w.id);
        Ok(loc)
    }

    /// Seals the open container and starts a new one.
    ///
    /// The id is spent even if the create fails part-way (a file may be
    /// left): the next attempt takes the one after it. The old container
    /// is sealed only once the new one exists: a container the database
    /// calls sealed is one gc may compact and delete, so the writer must
    /// never append to one (a failed create leaves the writer where it
    /// was, refusing to append while tainted or full). The containers
    /// still to sync move over with it. The sealed container's bytes go
    /// to the device now rather than all at the next commit.
    pub(crate) fn roll(&self, g: &mut Inner) -> Result<()> {
        let w = &mut g.writer;
        let id = w.next_id;
        w.next_id += 1;
        let mut fresh = new_container(&g.db, &*self.containers, id)?;
        g.db.execute(
            "UPDATE containers SET length = ?2, sealed = 1 WHERE id = ?1",
            params![w.id, w.len],
        )?;
        self.containers.start_sync(w.id);
        self.containers.sealed(w.id, w.len);
        fresh.unsynced.append(&mut w.unsynced);
        *w = fresh;
        Ok(())
    }

    /// Reads and checks one chunk.
    pub(crate) fn read_loc(&self, loc: ChunkLoc) -> Result<Piece> {
        let rec = self
            .containers
            .read(loc.container, loc.offset, loc.stored_len as usize)?;
        self.decode_piece(&rec, loc)
    }

    /// Checks and decodes the record `rec` read from `loc`: the chunk, a
    /// piece of the record's decoded bytes (a pack's whole, which the
    /// cache keeps for the pack's other chunks).
    pub(crate) fn decode_piece(&self, rec: &[u8], loc: ChunkLoc) -> Result<Piece> {
        let raw = self.decode_record(rec, loc)?;
        piece_at(raw, loc)
    }

    /// The decoded bytes of the whole record `rec` read from `loc`.
    pub(crate) fn decode_record(&self, rec: &[u8], loc: ChunkLoc) -> Result<Arc<Vec<u8>>> {
        let (_, raw) = container::decode(rec, loc.container, loc.offset, self.keys.as_deref())?;
        if container::is_pack(rec) != loc.inner.is_some() {
            let why = "a pack where the index says a chunk alone, or the reverse";
            return Err(container::damaged(loc.container, loc.offset, why));
        }
        Ok(Arc::new(raw))
    }

    /// A chunk's id: BLAKE3 of its bytes, keyed in an encrypted store.
    pub(crate) fn fingerprint(&self, data: &[u8]) -> Hash {
        match &self.keys {
            Some(k) => k.fingerprint(data),
            None => *blake3::hash(data).as_bytes(),
        }
    }

    /// A pack's record (`raw`: its chunks one after another) at the pack's
    /// level ([`crate::pack::pack_level`]), sealed in an encrypted store;
    /// its id is the fingerprint of `raw`.
    pub(crate) fn encode_pack(&self, raw: &[u8], packing: crate::config::Packing) -> Encoded {
        let packing = crate::config::Packing {
            zstd_level: crate::pack::pack_level(packing.zstd_level),
            ..packing
        };
        container::encode_pack(&self.fingerprint(raw), raw, packing, self.keys.as_deref())
    }

    /// A chunk's record, sealed in an encrypted store.
    pub(crate) fn encode_chunk(
        &self,
        hash: &Hash,
        data: &[u8],
        packing: crate::config::Packing,
    ) -> Encoded {
        container::encode(hash, data, packing, self.keys.as_deref())
    }
}

/// The chunk at `loc` in its record's decoded bytes `record` (checked
/// by [`Store::decode_record`]): a record that does not hold the chunk's
/// bytes where the row says is damaged.
pub(crate) fn piece_at(record: Arc<Vec<u8>>, loc: ChunkLoc) -> Result<Piece> {
    Piece::of(record, &loc).ok_or_else(|| {
        container::damaged(loc.container, loc.offset, "length differs from the index")
    })
}

impl Store {
    /// Drops `n` references to each chunk.
    pub(crate) fn release_chunks(&self, g: &Inner, chunks: &[(ChunkId, u64)]) -> Result<()> {
        let rows = Chunks(&g.db);
        for &(id, n) in chunks {
            rows.decref(id, n)?;
        }
        Ok(())
    }
}

/// Starts container `id` (see [`Writer::next_id`]), the only one its
/// writer has to sync so far.
fn new_container(db: &Connection, cs: &dyn ContainerStore, id: u64) -> Result<Writer> {
    cs.create(id)?;
    insert_container(db, id)
}

/// The row of new container `id` (its file made), and a writer for it.
fn insert_container(db: &Connection, id: u64) -> Result<Writer> {
    db.execute(
        "INSERT INTO containers (id, length, sealed) VALUES (?1, ?2, 0)",
        params![id, CONTAINER_HEADER],
    )?;
    Ok(Writer {
        id,
        len: CONTAINER_HEADER,
        unsynced: BTreeSet::from([id]),
        tainted: false,
        next_id: id + 1,
    })
}

/// The id above every container the database or the container store
/// knows, and at least `floor` ([`container_floor`]; see
/// [`Writer::next_id`]).
fn first_free_id(db: &Connection, cs: &dyn ContainerStore, floor: u64) -> Result<u64> {
    let max_db: u64 = db.query_row("SELECT COALESCE(MAX(id), 0) FROM containers", [], |r| {
        r.get(0)
    })?;
    let max_fs = cs.list()?.last().copied().unwrap_or(0);
    Ok((max_db.max(max_fs) + 1).max(floor))
}

/// The first container id a cache that took a remote store over may use
/// (`bucket::set_container_floor`; 0 for any other store): ids below are
/// the cache before it's, which may have uploaded them unseen.
fn container_floor(db: &Connection) -> Result<u64> {
    let floor: Option<String> = db
        .query_row(
            "SELECT value FROM meta WHERE key = ?1",
            [crate::bucket::CONTAINER_FLOOR],
            |r| r.get(0),
        )
        .optional()?;
    Ok(floor.and_then(|v| v.parse().ok()).unwrap_or(0))
}

/// Hands a remote backend every sealed container, so that those not yet
/// in the bucket (a mount stopped before their upload) are uploaded
/// (the backend skips what it finds there).
fn resume_uploads(db: &Connection, cs: &dyn ContainerStore) -> Result<()> {
    if !cs.remote() {
        return Ok(());
    }
    let mut st = db.prepare("SELECT id, length FROM containers WHERE sealed = 1")?;
    let rows = st.query_map([], |r| Ok((r.get::<_, u64>(0)?, r.get::<_, u64>(1)?)))?;
    let sealed = rows.collect::<rusqlite::Result<Vec<_>>>()?;
    cs.resume(sealed)
}

/// Crash recovery: the open container is continued only if its file ends
/// exactly at its committed length; otherwise it is sealed there (the tail
/// is garbage nobody references) and a new one is started.
fn replay(db: &Connection, cs: &dyn ContainerStore) -> Result<Writer> {
    let open: Option<(u64, u64)> = db
        .query_row(
            "SELECT id, length FROM containers WHERE sealed = 0 ORDER BY id DESC LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    let floor = container_floor(db)?;
    let next_id = first_free_id(db, cs, floor)?;
    if let Some((id, _)) = open.filter(|&(id, len)| id < floor && len == CONTAINER_HEADER) {
        // The empty container the bucket's image names is the cache
        // before this one's to fill and upload: this one begins its own.
        db.execute("DELETE FROM containers WHERE id = ?1", [id])?;
    } else if let Some((id, len)) = open {
        let mut there = cs.len(id)?;
        // The empty container a bucket's image names (begun at a push) is
        // in no bucket: a recovered cache begins it again.
        if there.is_none() && len == CONTAINER_HEADER && cs.remote() {
            cs.create(id)?;
            cs.sync(id)?;
            there = cs.len(id)?;
        }
        if there == Some(len) {
            return Ok(Writer {
                id,
                len,
                unsynced: BTreeSet::new(),
                tainted: false,
                next_id,
            });
        }
        db.execute("UPDATE containers SET sealed = 1 WHERE id = ?1", [id])?;
        cs.sealed(id, len);
    }
    // Outside any transaction, the row is committed at once: the file
    // must be durable first, or a power cut leaves a row longer than its
    // container (fsck: "shorter than committed"). Elsewhere the row waits
    // for the commit, which syncs the container before it.
    cs.create(next_id)?;
    cs.sync(next_id)?;
    let mut w = insert_container(db, next_id)?;
    w.unsynced.clear();
    Ok(w)
}

/// The highest inode number handed out so far (AUTOINCREMENT's counter).
fn inode_seq(db: &Connection) -> Result<i64> {
    let seq: Option<i64> = db
        .query_row(
            "SELECT seq FROM sqlite_sequence WHERE name = 'inodes'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    Ok(seq.unwrap_or(1))
}

/// Makes `dir` for a new store, or takes it, mode 0700 either way: it
/// may exist but must be empty, a fresh filesystem's `lost+found` aside (`Exists` if it holds a
/// store, `NotEmptyDir` if it holds anything else).
pub(crate) fn make_store_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    check_store_dir(dir)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(StoreError::io(dir))?;
    // An empty directory made by the user keeps its own mode otherwise,
    // and every file of the store (its data in the clear for a local
    // store) would be as readable as that directory.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(StoreError::io(dir))
}

/// Whether `dir` can be made a new store by [`make_store_dir`] (it need
/// not exist yet), without making it.
pub(crate) fn check_store_dir(dir: &Path) -> Result<()> {
    // A file (or a link to one) in the way: the user's, left alone.
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => return Err(StoreError::NotADirectory { path: dir.into() }),
        Err(_) => return Ok(()),
        Ok(_) => {}
    }
    let cfg_path = dir.join("store.json");
    if cfg_path.exists() || dir.join("meta.sqlite").exists() {
        return Err(StoreError::Exists { path: dir.into() });
    }
    let entries = std::fs::read_dir(dir).map_err(StoreError::io(dir))?;
    let foreign = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n != "lost+found");
    match foreign {
        Some(entry) => Err(StoreError::NotEmptyDir {
            path: dir.into(),
            entry,
        }),
        None => Ok(()),
    }
}

/// Writes `store.json` atomically (see [`write_synced`]).
pub(crate) fn write_config(dir: &Path, cfg: &StoreConfig) -> Result<()> {
    let json = serde_json::to_vec_pretty(cfg).expect("config serializes");
    write_synced(&dir.join("store.json"), &json)
}

/// Writes `path` atomically: a temporary file beside it, fsync, rename,
/// fsync of the directory. A crash leaves the old file or the new one.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        std::io::Write::write_all(&mut f, bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    };
    write().map_err(StoreError::io(path))
}

fn to_sql(e: StoreError) -> rusqlite::Error {
    match e {
        StoreError::Db(e) => e,
        e => rusqlite::Error::ToSqlConversionFailure(Box::new(e)),
    }
}

/// The `prealloc` table (room promised by `fallocate`, by inode): made
/// when a store is first opened by a release that has it; an older one
/// ignores it, and rows of inodes it deleted are dropped at open.
const PREALLOC_TABLE: &str = "CREATE TABLE IF NOT EXISTS prealloc (
    ino INTEGER PRIMARY KEY, bytes INTEGER NOT NULL);
    DELETE FROM prealloc WHERE bytes <= 0 OR ino NOT IN (SELECT ino FROM inodes);";

fn load_prealloc(db: &Connection) -> Result<HashMap<u64, u64>> {
    db.execute_batch(PREALLOC_TABLE)?;
    let mut st = db.prepare("SELECT ino, bytes FROM prealloc")?;
    let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

fn save_prealloc(
    db: &Connection,
    prealloc: &HashMap<u64, u64>,
    dirty: &mut BTreeSet<u64>,
) -> Result<()> {
    for ino in std::mem::take(dirty) {
        match prealloc.get(&ino) {
            Some(&b) => db
                .prepare_cached("INSERT OR REPLACE INTO prealloc (ino, bytes) VALUES (?1, ?2)")?
                .execute(params![ino, b])?,
            None => db
                .prepare_cached("DELETE FROM prealloc WHERE ino = ?1")?
                .execute([ino])?,
        };
    }
    Ok(())
}

pub(crate) fn load_counters(db: &Connection) -> Result<WriteCounters> {
    let get = |k: &str| -> Result<u64> {
        let v: Option<String> = db
            .query_row("SELECT value FROM meta WHERE key = ?1", [k], |r| r.get(0))
            .optional()?;
        Ok(v.and_then(|v| v.parse().ok()).unwrap_or(0))
    };
    Ok(WriteCounters {
        new_bytes: get("new_bytes")?,
        dup_bytes: get("dup_bytes")?,
        zero_bytes: get("zero_bytes")?,
    })
}

fn save_counters(db: &Connection, c: &WriteCounters) -> Result<()> {
    let mut st = db.prepare_cached(crate::meta::SET_META)?;
    for (k, v) in [
        ("new_bytes", c.new_bytes),
        ("dup_bytes", c.dup_bytes),
        ("zero_bytes", c.zero_bytes),
    ] {
        st.execute(params![k, v.to_string()])?;
    }
    Ok(())
}

/// The store's lock held (the guard [`Store::lock`] returns). Debug
/// builds count the guards each thread holds, so that work meant to run
/// with the lock free (hashing, compression) can assert it
/// ([`lock_free_here`]).
pub(crate) struct Locked<'a>(MutexGuard<'a, Inner>);

#[cfg(debug_assertions)]
thread_local! {
    static HELD: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

impl<'a> Locked<'a> {
    fn new(mut g: MutexGuard<'a, Inner>) -> Self {
        g.locks = g.locks.wrapping_add(1);
        #[cfg(debug_assertions)]
        HELD.with(|h| h.set(h.get() + 1));
        Locked(g)
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        HELD.with(|h| h.set(h.get() - 1));
    }
}

impl std::ops::Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.0
    }
}

/// Whether this thread holds no store lock (always true in release
/// builds, which do not count).
pub(crate) fn lock_free_here() -> bool {
    #[cfg(debug_assertions)]
    return HELD.with(|h| h.get() == 0);
    #[cfg(not(debug_assertions))]
    true
}
