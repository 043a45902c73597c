//! The store's metadata in its bucket: the bucket alone is the store.
//!
//! A push freezes a committed state whose containers are all sealed,
//! copies the database page for page into a local image (SQLite's backup
//! API, from a read transaction: writers go on), waits until those
//! containers are uploaded, puts the pages that changed since the last
//! push as a write-once segment ([`crate::pages`]), and then replaces the
//! `manifest` object with one naming the segments, only from the version
//! it last read (`If-Match`). That swap is the single commit point: a
//! state is in the bucket once, and only once, the manifest names it.
//!
//! Invariants:
//! - every container a manifest's image refers to was uploaded before the
//!   manifest was swapped in;
//! - a container gc deleted leaves the bucket only after a manifest that
//!   no longer refers to it is in (`Tiered::take_doomed`);
//! - the manifest names its writer (the cache that pushed it); a cache
//!   whose id is not the manifest's does not write: a newer cache took
//!   the store over (`store init --recover`), and the old one is fenced
//!   by the swap's tag and refused at open.
//!
//! Recovery point: the last push (every [`PUSH_EVERY`] while the mount
//! writes, and at unmount).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use onecopy_objects::{ObjectError, Objects, Tag};
use rusqlite::Connection;

use crate::bucket::{
    connect, encode_manifest, read_manifest, Manifest, Sealing, SegmentRef, CACHE_DIR, MANIFEST,
};
use crate::config::{RemoteSpec, StoreConfig};
use crate::error::{Result, StoreError};
use crate::pages::{self, PageHash};
use crate::remote::Tiered;

/// How long the objects of containers gc deleted stay in the bucket after
/// the manifest that no longer names them (followers of an older state
/// read them meanwhile).
pub const DELETE_GRACE: Duration = Duration::from_secs(600);
/// How often a writing mount pushes its metadata.
pub const PUSH_EVERY: Duration = Duration::from_secs(30);
/// Deltas are chained on a base until they add up to more than this
/// share of the base (percent): a recovery then reads at most about
/// twice the base.
const CHAIN_PERCENT: u64 = 100;

/// What one push did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushReport {
    pub generation: u64,
    /// Pages carried and the segment's size.
    pub pages: u64,
    pub bytes: u64,
    /// Whether the segment was a new base.
    pub base: bool,
}

fn fenced(why: String) -> StoreError {
    StoreError::Fenced { why }
}

pub(crate) fn random_hex() -> String {
    let mut b = [0u8; 16];
    rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).expect("getrandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A new writer id for the cache in `dir` (a store made or recovered).
pub(crate) fn new_writer(dir: &Path) -> Result<String> {
    let id = random_hex();
    save_writer(dir, &id)?;
    Ok(id)
}

/// Keeps `id` as the writer id of the cache in `dir`.
pub(crate) fn save_writer(dir: &Path, id: &str) -> Result<()> {
    let d = dir.join(CACHE_DIR);
    std::fs::create_dir_all(&d).map_err(StoreError::io(&d))?;
    crate::store::write_synced(&d.join("writer"), id.as_bytes())
}

/// The push side, held by a store opened on a remote.
pub(crate) struct Mirror {
    objects: Arc<dyn Objects>,
    tiered: Arc<Tiered>,
    dir: PathBuf,
    writer: String,
    sealing: Option<Sealing>,
    /// How long an object gc deleted stays for followers of older states.
    grace: Duration,
    /// [`crate::Store::push_every`], in milliseconds.
    every_ms: std::sync::atomic::AtomicU64,
    state: Mutex<State>,
}

struct State {
    /// The manifest in the bucket and its tag (`None`: none yet).
    manifest: Option<(Manifest, Tag)>,
    /// Fingerprints of the pages of the manifest's image (empty: the next
    /// push is a base).
    hashes: Vec<PageHash>,
    /// A read connection to the database: the source of the images.
    reader: Option<Connection>,
    /// `PRAGMA data_version` at the last push's image.
    version: Option<i64>,
    /// Set when the swap found another writer's manifest: no more pushes.
    fenced: Option<String>,
    /// The version of the lease this cache holds ([`crate::lease`]).
    lease: Option<Tag>,
}

impl Mirror {
    /// Opens the mirror of the store in `store_dir`: refused when the
    /// bucket's manifest was pushed by another cache.
    pub(crate) fn open(
        store_dir: &Path,
        objects: Arc<dyn Objects>,
        tiered: Arc<Tiered>,
        sealing: Option<Sealing>,
    ) -> Result<Mirror> {
        let dir = store_dir.join(CACHE_DIR);
        let wpath = dir.join("writer");
        let writer = std::fs::read_to_string(&wpath).map_err(StoreError::io(&wpath))?;
        let manifest = read_manifest(&*objects, sealing.as_ref())?;
        let mut hashes = Vec::new();
        if let Some((m, _)) = &manifest {
            if m.writer != writer {
                return Err(fenced(format!(
                    "the bucket's store was last written by another cache ({}, generation {}); \
                     this one is out of date: make a new cache with \
                     `onecopy store init --recover`",
                    m.writer, m.generation
                )));
            }
            let image = dir.join("image.db");
            if image.exists() {
                let (h, whole) = pages::hashes(&image, m.page_size)?;
                if whole == m.image {
                    hashes = h;
                }
            }
        }
        let lease = crate::lease::acquire(&*objects, &writer, lease_ttl(PUSH_EVERY), false)?;
        Ok(Mirror {
            objects,
            tiered,
            dir,
            writer,
            sealing,
            grace: DELETE_GRACE,
            every_ms: (PUSH_EVERY.as_millis() as u64).into(),
            state: Mutex::new(State {
                manifest,
                hashes,
                reader: None,
                version: None,
                fenced: None,
                lease: Some(lease),
            }),
        })
    }

    fn every(&self) -> Duration {
        Duration::from_millis(self.every_ms.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Renews the lease (at every push); a lease another cache took
    /// fences this one.
    fn renew_lease(&self, st: &mut State) -> Result<()> {
        let Some(tag) = &st.lease else {
            return Err(fenced("this cache gave its lease back".into()));
        };
        match crate::lease::renew(&*self.objects, &self.writer, tag, lease_ttl(self.every())) {
            Ok(t) => {
                st.lease = Some(t);
                Ok(())
            }
            Err(StoreError::Fenced { why }) => {
                st.fenced = Some(why.clone());
                Err(fenced(why))
            }
            Err(e) => Err(e),
        }
    }

    /// Gives the lease back (a store closing).
    fn release_lease(&self) {
        let mut st = self.lock();
        if let Some(tag) = st.lease.take() {
            crate::lease::release(&*self.objects, &self.writer, &tag);
        }
    }

    pub(crate) fn tiered(&self) -> &Arc<Tiered> {
        &self.tiered
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A push in progress: [`Store::push_remote`](crate::Store::push_remote)
/// holds the mirror's state for its length (one push at a time).
pub(crate) struct Push<'a> {
    mirror: &'a Mirror,
    st: std::sync::MutexGuard<'a, State>,
}

impl<'a> Push<'a> {
    pub(crate) fn start(mirror: &'a Mirror, meta: &Path) -> Result<Push<'a>> {
        let mut st = mirror.lock();
        if let Some(why) = &st.fenced {
            return Err(fenced(why.clone()));
        }
        if st.reader.is_none() {
            let c = Connection::open_with_flags(
                meta,
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY
                    | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )?;
            st.reader = Some(c);
        }
        Ok(Push { mirror, st })
    }

    /// Whether the database changed since the last push (or there was
    /// none in this process).
    pub(crate) fn changed(&mut self) -> Result<bool> {
        let v: i64 = self
            .reader()
            .pragma_query_value(None, "data_version", |r| r.get(0))?;
        Ok(self.st.version != Some(v) || self.st.manifest.is_none())
    }

    fn reader(&self) -> &Connection {
        self.st.reader.as_ref().expect("opened in start")
    }

    /// The time of the manifest in the bucket (0: none yet).
    pub(crate) fn published_ns(&self) -> i64 {
        self.st.manifest.as_ref().map_or(0, |(m, _)| m.time_ns)
    }

    /// Begins the read transaction whose state is pushed: called under
    /// the store's lock, right after a commit.
    pub(crate) fn freeze(&mut self) -> Result<()> {
        let r = self.reader();
        r.execute_batch("BEGIN")?;
        // The first read fixes the transaction's snapshot.
        r.query_row("SELECT COUNT(*) FROM meta", [], |r| r.get::<_, i64>(0))?;
        let v: i64 = r.pragma_query_value(None, "data_version", |r| r.get(0))?;
        self.st.version = Some(v);
        Ok(())
    }

    /// Copies the frozen state to `remote/image.new` and ends the read
    /// transaction.
    fn image(&mut self) -> Result<PathBuf> {
        let path = self.mirror.dir.join("image.new");
        let _ = std::fs::remove_file(&path);
        let r = (|| {
            let mut dst = Connection::open(&path)?;
            dst.pragma_update(None, "journal_mode", "OFF")?;
            dst.pragma_update(None, "synchronous", "OFF")?;
            let b = rusqlite::backup::Backup::new(self.reader(), &mut dst)?;
            b.step(-1)?;
            Ok::<_, rusqlite::Error>(())
        })();
        self.reader().execute_batch("COMMIT")?;
        r?;
        Ok(path)
    }

    /// Pushes the frozen state: every container below `below` is sealed
    /// (those the state may refer to); `doomed` containers were deleted
    /// before it was frozen.
    pub(crate) fn run(
        mut self,
        below: u64,
        doomed: &[u64],
        cfg: &StoreConfig,
        wait: Duration,
    ) -> Result<Option<PushReport>> {
        let image = self.image()?;
        self.mirror.tiered.wait_uploaded_below(below, wait)?;
        let page_size = page_size(&image)?;
        let Some((mut seg, base)) = self.segment(&image, page_size, doomed)? else {
            return Ok(None);
        };
        let generation = self.st.manifest.as_ref().map_or(0, |(m, _)| m.generation) + 1;
        let new = self.upload(generation, std::mem::take(&mut seg.bytes))?;
        let bytes = new.bytes;
        let m = self.manifest(generation, cfg, page_size, &seg.image, base, new);
        let dropped = self.replaced_by(&m);
        self.swap(m)?;
        self.st.hashes = seg.hashes;
        let kept = self.mirror.dir.join("image.db");
        std::fs::rename(&image, &kept).map_err(StoreError::io(&kept))?;
        // Nothing the bucket's store names any more: best effort (a key
        // left behind is garbage, found by the next `store gc`).
        for key in dropped {
            let _ = self.mirror.objects.delete(&key);
        }
        Ok(Some(PushReport {
            generation,
            pages: seg.changed,
            bytes,
            base,
        }))
    }

    /// The segment to push and whether it is a new base: the pages
    /// changed since the last push, or the whole image once the chain of
    /// deltas would outgrow its base by [`CHAIN_PERCENT`] (or there is no
    /// base yet). `None` when nothing changed and nothing was deleted.
    fn segment(
        &self,
        image: &Path,
        page_size: u32,
        doomed: &[u64],
    ) -> Result<Option<(pages::Segment, bool)>> {
        let seg = pages::diff(image, page_size, &self.st.hashes)?;
        if seg.changed == 0 && doomed.is_empty() && self.st.manifest.is_some() {
            return Ok(None);
        }
        let chain_bytes: u64 = self.chain().iter().map(|s| s.bytes).sum();
        let base_bytes = self.chain().first().map_or(0, |s| s.bytes);
        let grown = chain_bytes + seg.bytes.len() as u64 > base_bytes * (100 + CHAIN_PERCENT) / 100;
        if self.st.hashes.is_empty() {
            Ok(Some((seg, true)))
        } else if grown {
            Ok(Some((pages::diff(image, page_size, &[])?, true)))
        } else {
            Ok(Some((seg, false)))
        }
    }

    /// Puts a segment (sealed when the store is encrypted) as a new
    /// object of generation `generation`.
    fn upload(&self, generation: u64, body: Vec<u8>) -> Result<SegmentRef> {
        let key = format!("meta/{generation:016x}-{}.seg", random_hex());
        let body = match &self.mirror.sealing {
            Some(s) => s.seal(&key, &body),
            None => body,
        };
        let bytes = body.len() as u64;
        self.mirror.objects.put_new_settled(&key, body.into())?;
        Ok(SegmentRef { key, bytes })
    }

    /// The manifest naming `new` after the chain (or alone, as a `base`).
    fn manifest(
        &self,
        generation: u64,
        cfg: &StoreConfig,
        page_size: u32,
        image: &str,
        base: bool,
        new: SegmentRef,
    ) -> Manifest {
        let mut segments = if base {
            Vec::new()
        } else {
            self.chain().to_vec()
        };
        segments.push(new);
        Manifest {
            generation,
            writer: self.mirror.writer.clone(),
            time_ns: crate::store::precise_now(),
            config: StoreConfig {
                remote: None,
                ..cfg.clone()
            },
            page_size,
            image: image.to_string(),
            segments,
        }
    }

    /// The segments of the current chain that `m` no longer names.
    fn replaced_by(&self, m: &Manifest) -> Vec<String> {
        let old = self.chain().iter();
        let gone = old.filter(|s| !m.segments.contains(s));
        gone.map(|s| s.key.clone()).collect()
    }

    fn chain(&self) -> &[SegmentRef] {
        self.st.manifest.as_ref().map_or(&[], |(m, _)| &m.segments)
    }

    /// The commit point. A conflict means another cache took the store
    /// over: this one stops pushing.
    fn swap(&mut self, m: Manifest) -> Result<()> {
        let bytes = encode_manifest(&m, self.mirror.sealing.as_ref());
        let expected = self.st.manifest.as_ref().map(|(_, t)| t.clone());
        match self
            .mirror
            .objects
            .swap_settled(MANIFEST, bytes.into(), expected.as_ref())
        {
            Ok(tag) => {
                self.st.manifest = Some((m, tag));
                Ok(())
            }
            Err(ObjectError::Conflict { .. }) => {
                let why = "the bucket's manifest was replaced by another cache: this one no \
                           longer writes to the bucket (make a new cache with \
                           `onecopy store init --recover`)"
                    .to_string();
                self.st.fenced = Some(why.clone());
                Err(fenced(why))
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// The page size of a database image (header bytes 16-17; 1 means 64 KiB).
fn page_size(image: &Path) -> Result<u32> {
    use std::io::Read;
    let mut head = [0u8; 18];
    std::fs::File::open(image)
        .and_then(|mut f| f.read_exact(&mut head))
        .map_err(StoreError::io(image))?;
    Ok(match u16::from_be_bytes([head[16], head[17]]) {
        1 => 65536,
        n => n as u32,
    })
}

/// The table of containers whose objects wait to be deleted (made when
/// a remote store is opened; a local store has none).
pub(crate) const DOOMED_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS doomed (id INTEGER PRIMARY KEY, at_ns INTEGER NOT NULL)";

/// Records containers gc deleted: their objects go once a manifest taken
/// after this is in, and the grace has passed.
fn record_doomed(db: &Connection, ids: &[u64]) -> Result<()> {
    let now = crate::store::precise_now();
    for &id in ids {
        db.execute(
            "INSERT OR IGNORE INTO doomed (id, at_ns) VALUES (?1, ?2)",
            rusqlite::params![id, now],
        )?;
    }
    Ok(())
}

/// The time of the manifest in the bucket (0: none).
fn push_published(m: &Mirror) -> i64 {
    m.lock().manifest.as_ref().map_or(0, |(m, _)| m.time_ns)
}

/// How long a lease is taken for: four pushes, at least
/// [`crate::lease::TTL_MIN`].
fn lease_ttl(every: Duration) -> Duration {
    (every * 4).max(crate::lease::TTL_MIN)
}

/// How long a periodic push waits for the uploads its state needs.
const PUSH_WAIT: Duration = Duration::from_secs(60);
/// How long the last push (unmount, close) waits for them.
const FINAL_PUSH_WAIT: Duration = Duration::from_secs(600);

impl crate::Store {
    /// Opens a remote store's cache in `dir`: containers through
    /// [`Tiered`], metadata pushed by [`crate::Store::push_remote`].
    pub(crate) fn open_remote(dir: &Path, spec: &RemoteSpec) -> Result<crate::Store> {
        let objects = connect(spec)?;
        let local = crate::container::LocalDir::new(dir.join("containers"));
        let limit = spec.cache_size.unwrap_or(crate::config::DEFAULT_CACHE);
        let tiered = Arc::new(Tiered::new(local, objects.clone(), limit)?);
        let sealing = match &spec.key {
            Some(key) => Some(crate::bucket::load_local_key(dir, key)?),
            None => None,
        };
        let keys = sealing.as_ref().map(|s| s.keys.clone());
        // Before the cache is opened: a cache out of date must not upload
        // what it holds.
        // The local lock first: a second process on this cache (a command
        // while it is mounted) must not touch the lease, or it would fence
        // the mount.
        let lock = Self::lock_dir(dir)?;
        let mut mirror = Mirror::open(dir, objects, tiered.clone(), sealing)?;
        let mut store = Self::open_locked(dir, tiered, lock)?;
        store.lock().db.execute_batch(DOOMED_TABLE)?;
        mirror.grace = spec.grace_secs.map_or(DELETE_GRACE, Duration::from_secs);
        store.keys = keys;
        store.mirror = Some(mirror);
        Ok(store)
    }

    /// Before a remote store is made in `dir`: checks that its bucket
    /// holds none, and with a password makes its key (the store is then
    /// encrypted: `spec.key` names the key object). Returns the keys.
    pub(crate) fn prepare_bucket(
        spec: &mut RemoteSpec,
        password: Option<&[u8]>,
    ) -> Result<Option<Sealing>> {
        let objects = connect(spec)?;
        if objects.size(MANIFEST)?.is_some() {
            return Err(StoreError::BucketInUse {
                url: spec.url.clone(),
            });
        }
        let sealing = match password {
            Some(pw) => Some(crate::bucket::create_key(&*objects, pw)?),
            None => None,
        };
        spec.key = sealing.as_ref().map(|s| s.key.clone());
        Ok(sealing)
    }

    /// Makes the new store in `dir` the bucket's: its writer id, and a
    /// first push (the manifest of an empty store).
    pub(crate) fn first_push(dir: &Path, sealing: Option<Sealing>) -> Result<()> {
        new_writer(dir)?;
        if let Some(s) = sealing {
            crate::bucket::save_local_key(dir, &s.keys)?;
        }
        Self::open(dir)?.close_remote()
    }

    /// Pushes the committed metadata to the bucket if it changed since the
    /// last push (see the module's documentation); `None` when there was
    /// nothing to push or the store is not remote.
    pub fn push_remote(&self) -> Result<Option<PushReport>> {
        self.push_remote_within(PUSH_WAIT)
    }

    fn push_remote_within(&self, wait: Duration) -> Result<Option<PushReport>> {
        let Some(m) = &self.mirror else {
            return Ok(None);
        };
        self.commit(false)?;
        let mut push = Push::start(m, &self.dir.join("meta.sqlite"))?;
        m.renew_lease(&mut push.st)?;
        let doomed = m.tiered().take_doomed();
        if !push.changed()? && doomed.is_empty() {
            let published = push.published_ns();
            drop(push);
            self.delete_doomed(m, published);
            return Ok(None);
        }
        let frozen = (|| {
            let mut g = self.lock();
            record_doomed(&g.db, &doomed)?;
            if g.writer.len > crate::container::CONTAINER_HEADER {
                self.roll(&mut g)?;
            }
            self.commit_locked(&mut g, true)?;
            push.freeze()?;
            Ok::<_, StoreError>(g.writer.id)
        })();
        let r = frozen.and_then(|below| push.run(below, &doomed, &self.cfg, wait));
        match &r {
            Ok(_) => {
                let published = push_published(m);
                self.delete_doomed(m, published);
            }
            // Not recorded when the freeze failed before the commit.
            Err(_) => m.tiered().return_doomed(doomed),
        }
        r
    }

    /// Deletes the objects of containers gc deleted, once a manifest
    /// taken after the delete is in (`published`, its time) and the grace
    /// has passed (a follower may still read an older state). Best
    /// effort: what fails stays recorded and is tried at the next push.
    fn delete_doomed(&self, m: &Mirror, published: i64) {
        let cutoff = published.min(crate::store::precise_now() - m.grace.as_nanos() as i64);
        let due: Vec<u64> = {
            let g = self.lock();
            let st =
                g.db.prepare_cached("SELECT id FROM doomed WHERE at_ns < ?1");
            let Ok(mut st) = st else { return };
            let rows = st.query_map([cutoff], |r| r.get(0));
            rows.map(|r| r.flatten().collect()).unwrap_or_default()
        };
        let mut gone = Vec::new();
        for id in due {
            match m.objects.delete(&crate::remote::object_key(id)) {
                Ok(()) => gone.push(id),
                Err(_) => break,
            }
        }
        let g = self.lock();
        for id in gone {
            let _ = g.db.execute("DELETE FROM doomed WHERE id = ?1", [id]);
        }
    }

    /// How often a mount pushes, or a follower looks for a new state
    /// (default [`PUSH_EVERY`]).
    pub fn push_every(&self) -> Duration {
        let cell = match (&self.mirror, &self.follower) {
            (Some(m), _) => &m.every_ms,
            (None, Some(f)) => &f.every_ms,
            (None, None) => return PUSH_EVERY,
        };
        Duration::from_millis(cell.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Sets how often a mount pushes or follows (`-o push=SECS`).
    pub fn set_push_every(&self, every: Duration) {
        let cell = match (&self.mirror, &self.follower) {
            (Some(m), _) => &m.every_ms,
            (None, Some(f)) => &f.every_ms,
            (None, None) => return,
        };
        cell.store(
            every.as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Whether a write now would wait for uploads first (a remote
    /// store's full upload backlog, see [`crate::remote::UPLOAD_BACKLOG`]).
    pub fn write_would_wait(&self) -> bool {
        !self.containers.admits_now()
    }

    /// Whether the store lives in a bucket.
    pub fn is_remote(&self) -> bool {
        self.mirror.is_some()
    }

    /// The last push of a remote store (unmount, end of a command): what
    /// is committed reaches the bucket, waiting up to 10 minutes for its
    /// uploads.
    pub fn close_remote(&self) -> Result<()> {
        if let Some(m) = &self.mirror {
            if m.lock().lease.is_none() {
                return Ok(());
            }
            self.flush_all(true)?;
            self.push_remote_within(FINAL_PUSH_WAIT)?;
            m.release_lease();
        }
        Ok(())
    }
}
