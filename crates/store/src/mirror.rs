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

use onecopy_objects::{LocalObjects, ObjectError, Objects, S3Config, S3Objects, Tag};
use rusqlite::Connection;
use serde::{Deserialize, Serialize};

use crate::config::{RemoteSpec, StoreConfig};
use crate::error::{Result, StoreError};
use crate::pages::{self, PageHash};
use crate::remote::Tiered;

/// Key of the manifest.
pub const MANIFEST: &str = "manifest";
const MANIFEST_MAGIC: &str = "onecopy-remote";
/// Manifest format this code writes and reads.
pub const MANIFEST_FORMAT: u64 = 1;
/// How often a writing mount pushes its metadata.
pub const PUSH_EVERY: Duration = Duration::from_secs(30);
/// The local directory of the mirror's files, in the store's directory.
const MIRROR_DIR: &str = "remote";
/// Deltas are chained on a base until they add up to more than this
/// share of the base (percent): a recovery then reads at most about
/// twice the base.
const CHAIN_PERCENT: u64 = 100;

/// One segment as the manifest names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRef {
    pub key: String,
    pub bytes: u64,
}

/// The `manifest` object: what the bucket's store is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub magic: String,
    pub format: u64,
    /// One more at every push.
    pub generation: u64,
    /// The id of the cache that pushed it (its `remote/writer` file).
    pub writer: String,
    pub time_ns: i64,
    /// The store's settings (without `remote`).
    pub config: StoreConfig,
    pub page_size: u32,
    /// BLAKE3 of the image the segments make.
    pub image: String,
    /// The base first, then deltas in order.
    pub segments: Vec<SegmentRef>,
}

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

/// Connects to the object store a spec names: `s3://BUCKET/PREFIX`, or
/// `file:///DIR` (a directory, for tests and shared file systems).
pub fn connect(spec: &RemoteSpec) -> Result<Arc<dyn Objects>> {
    if let Some(path) = spec.url.strip_prefix("file://") {
        return Ok(Arc::new(LocalObjects::new(path)?));
    }
    let mut c = S3Config::from_url(&spec.url)?;
    c.endpoint = spec.endpoint.clone();
    c.region = spec.region.clone();
    if let Some(secs) = spec.patience_secs {
        c.patience = Duration::from_secs(secs);
    }
    Ok(Arc::new(S3Objects::new(&c)?))
}

fn remote_err(why: impl Into<String>) -> StoreError {
    StoreError::Remote { why: why.into() }
}

fn fenced(why: String) -> StoreError {
    StoreError::Fenced { why }
}

/// The manifest and its tag; `None` when the bucket holds no store.
pub fn read_manifest(objects: &dyn Objects) -> Result<Option<(Manifest, Tag)>> {
    let (bytes, tag) = match objects.get(MANIFEST) {
        Ok(got) => got,
        Err(ObjectError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let m: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| remote_err(format!("the bucket's manifest is not readable: {e}")))?;
    if m.magic != MANIFEST_MAGIC {
        return Err(remote_err(
            "the bucket's manifest is not an onecopy store's",
        ));
    }
    if m.format != MANIFEST_FORMAT {
        return Err(StoreError::Version {
            path: MANIFEST.into(),
            found: m.format,
            supported: MANIFEST_FORMAT,
        });
    }
    Ok(Some((m, tag)))
}

fn random_hex() -> String {
    let mut b = [0u8; 16];
    rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).expect("getrandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A new writer id for the cache in `dir` (a store made or recovered).
pub(crate) fn new_writer(dir: &Path) -> Result<String> {
    let d = dir.join(MIRROR_DIR);
    std::fs::create_dir_all(&d).map_err(StoreError::io(&d))?;
    let id = random_hex();
    crate::store::write_synced(&d.join("writer"), id.as_bytes())?;
    Ok(id)
}

/// The push side, held by a store opened on a remote.
pub(crate) struct Mirror {
    objects: Arc<dyn Objects>,
    tiered: Arc<Tiered>,
    dir: PathBuf,
    writer: String,
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
}

impl Mirror {
    /// Opens the mirror of the store in `store_dir`: refused when the
    /// bucket's manifest was pushed by another cache.
    pub(crate) fn open(
        store_dir: &Path,
        objects: Arc<dyn Objects>,
        tiered: Arc<Tiered>,
    ) -> Result<Mirror> {
        let dir = store_dir.join(MIRROR_DIR);
        let wpath = dir.join("writer");
        let writer = std::fs::read_to_string(&wpath).map_err(StoreError::io(&wpath))?;
        let manifest = read_manifest(&*objects)?;
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
        Ok(Mirror {
            objects,
            tiered,
            dir,
            writer,
            every_ms: (PUSH_EVERY.as_millis() as u64).into(),
            state: Mutex::new(State {
                manifest,
                hashes,
                reader: None,
                version: None,
                fenced: None,
            }),
        })
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
        let mut seg = pages::diff(&image, page_size, &self.st.hashes)?;
        if seg.changed == 0 && doomed.is_empty() && self.st.manifest.is_some() {
            return Ok(None);
        }
        let chain_bytes: u64 = self.chain().iter().map(|s| s.bytes).sum();
        let base_bytes = self.chain().first().map_or(0, |s| s.bytes);
        let base = self.st.hashes.is_empty()
            || chain_bytes + seg.bytes.len() as u64 > base_bytes * (100 + CHAIN_PERCENT) / 100;
        if base && !self.st.hashes.is_empty() {
            seg = pages::diff(&image, page_size, &[])?;
        }
        let generation = self.st.manifest.as_ref().map_or(0, |(m, _)| m.generation) + 1;
        let key = format!("meta/{generation:016x}-{}.seg", random_hex());
        let bytes = seg.bytes.len() as u64;
        self.mirror
            .objects
            .put_new(&key, std::mem::take(&mut seg.bytes).into())?;
        let mut segments = if base {
            Vec::new()
        } else {
            self.chain().to_vec()
        };
        segments.push(SegmentRef { key, bytes });
        let m = Manifest {
            magic: MANIFEST_MAGIC.into(),
            format: MANIFEST_FORMAT,
            generation,
            writer: self.mirror.writer.clone(),
            time_ns: crate::store::time_now(),
            config: StoreConfig {
                remote: None,
                ..cfg.clone()
            },
            page_size,
            image: seg.image.clone(),
            segments,
        };
        let dropped: Vec<String> = self
            .chain()
            .iter()
            .filter(|s| !m.segments.contains(s))
            .map(|s| s.key.clone())
            .collect();
        self.swap(m)?;
        self.st.hashes = seg.hashes;
        let kept = self.mirror.dir.join("image.db");
        std::fs::rename(&image, &kept).map_err(StoreError::io(&kept))?;
        // Nothing the bucket's store names any more: best effort (a key
        // left behind is garbage, found by the next `store gc`).
        for key in dropped {
            let _ = self.mirror.objects.delete(&key);
        }
        for &id in doomed {
            let _ = self.mirror.objects.delete(&crate::remote::object_key(id));
        }
        Ok(Some(PushReport {
            generation,
            pages: seg.changed,
            bytes,
            base,
        }))
    }

    fn chain(&self) -> &[SegmentRef] {
        self.st.manifest.as_ref().map_or(&[], |(m, _)| &m.segments)
    }

    /// The commit point. A conflict means another cache took the store
    /// over: this one stops pushing.
    fn swap(&mut self, m: Manifest) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(&m).expect("serializes");
        let expected = self.st.manifest.as_ref().map(|(_, t)| t.clone());
        match self
            .mirror
            .objects
            .swap(MANIFEST, bytes.into(), expected.as_ref())
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

/// Makes `dir` a cache of the store in the bucket `spec` names, from the
/// bucket alone: the database rebuilt from the manifest's segments (the
/// fingerprint index is rebuilt at the first open), the store's settings
/// from the manifest. The manifest is then swapped to name this cache as
/// its writer: a cache left on another machine can no longer push.
pub fn recover(dir: &Path, spec: &RemoteSpec) -> Result<Manifest> {
    let objects = connect(spec)?;
    let Some((m, tag)) = read_manifest(&*objects)? else {
        return Err(remote_err(format!(
            "{} holds no store (no manifest)",
            spec.url
        )));
    };
    crate::store::make_store_dir(dir)?;
    let mdir = dir.join(MIRROR_DIR);
    std::fs::create_dir_all(&mdir).map_err(StoreError::io(&mdir))?;
    let image = mdir.join("image.db");
    rebuild_image(&*objects, &m, &image)?;
    let meta = dir.join("meta.sqlite");
    std::fs::copy(&image, &meta).map_err(StoreError::io(&meta))?;
    {
        let db = Connection::open(&meta)?;
        // Every indexed row goes into the new fingerprint index at open.
        crate::index::reset_watermark(&db)?;
    }
    let writer = new_writer(dir)?;
    let mut next = m.clone();
    next.generation += 1;
    next.writer = writer;
    next.time_ns = crate::store::time_now();
    let bytes = serde_json::to_vec_pretty(&next).expect("serializes");
    objects
        .swap(MANIFEST, bytes.into(), Some(&tag))
        .map_err(|e| match e {
            ObjectError::Conflict { .. } => {
                remote_err("the bucket's manifest changed while recovering: try again")
            }
            e => e.into(),
        })?;
    let cfg = StoreConfig {
        remote: Some(spec.clone()),
        ..m.config.clone()
    };
    crate::store::write_config(dir, &cfg)?;
    Ok(next)
}

/// Writes the image a manifest names into `path`, checking its hash.
fn rebuild_image(objects: &dyn Objects, m: &Manifest, path: &Path) -> Result<()> {
    let f = std::fs::File::options()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(path)
        .map_err(StoreError::io(path))?;
    let mut said = String::new();
    for s in &m.segments {
        let (bytes, _) = objects.get(&s.key)?;
        said = pages::apply(&f, path, &bytes)?;
    }
    let (_, whole) = pages::hashes(path, m.page_size)?;
    if whole != m.image || said != m.image {
        return Err(remote_err(format!(
            "the metadata the manifest names (generation {}) does not rebuild its image",
            m.generation
        )));
    }
    f.sync_all().map_err(StoreError::io(path))
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
        let tiered = Arc::new(Tiered::new(local, objects.clone()));
        let mut store = Self::open_with(dir, tiered.clone())?;
        store.mirror = Some(Mirror::open(dir, objects, tiered)?);
        Ok(store)
    }

    /// Checks, before a remote store is made, that its bucket holds none.
    pub(crate) fn bucket_is_free(spec: &RemoteSpec) -> Result<()> {
        if read_manifest(&*connect(spec)?)?.is_some() {
            return Err(StoreError::BucketInUse {
                url: spec.url.clone(),
            });
        }
        Ok(())
    }

    /// Makes the new store in `dir` the bucket's: its writer id, and a
    /// first push (the manifest of an empty store).
    pub(crate) fn first_push(dir: &Path) -> Result<()> {
        new_writer(dir)?;
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
        let doomed = m.tiered().take_doomed();
        if !push.changed()? && doomed.is_empty() {
            return Ok(None);
        }
        let frozen = (|| {
            let mut g = self.lock();
            if g.writer.len > crate::container::CONTAINER_HEADER {
                self.roll(&mut g)?;
            }
            self.commit_locked(&mut g, true)?;
            push.freeze()?;
            Ok::<_, StoreError>(g.writer.id)
        })();
        let r = frozen.and_then(|below| push.run(below, &doomed, &self.cfg, wait));
        if r.is_err() {
            m.tiered().return_doomed(doomed);
        }
        r
    }

    /// How often a mount pushes (default [`PUSH_EVERY`]).
    pub fn push_every(&self) -> Duration {
        let ms = self
            .mirror
            .as_ref()
            .map_or(0, |m| m.every_ms.load(std::sync::atomic::Ordering::Relaxed));
        Duration::from_millis(ms)
    }

    /// Sets how often a mount pushes (`-o push=SECS`).
    pub fn set_push_every(&self, every: Duration) {
        if let Some(m) = &self.mirror {
            m.every_ms.store(
                every.as_millis() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
    }

    /// Whether the store lives in a bucket.
    pub fn is_remote(&self) -> bool {
        self.mirror.is_some()
    }

    /// The last push of a remote store (unmount, end of a command): what
    /// is committed reaches the bucket, waiting up to 10 minutes for its
    /// uploads.
    pub fn close_remote(&self) -> Result<()> {
        if self.mirror.is_some() {
            self.flush_all(true)?;
            self.push_remote_within(FINAL_PUSH_WAIT)?;
        }
        Ok(())
    }
}
