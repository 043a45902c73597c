//! A read-only cache that follows a remote store: `onecopy mount
//! --read-only --remote` on another machine. It takes no lease and never
//! writes to the bucket; it serves the state the manifest named when it
//! was made, and at each [`crate::Store::follow_remote`] moves to the
//! state the manifest names now: the new segments applied to its pristine
//! image (`remote/image.db`), or the chain rebuilt when the writer began
//! a new base, then the database swapped under the store's lock.
//!
//! Invariants: the database served is always a whole state a manifest
//! named (the image's hash is checked before the swap); containers it
//! refers to were uploaded before that manifest was swapped in, and are
//! deleted only after a later manifest no longer refers to them (a grace
//! period covers a follower still on an older state).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use onecopy_objects::Objects;

use crate::bucket::{read_manifest, Manifest, Sealing, CACHE_DIR};
use crate::config::RemoteSpec;
use crate::error::{Result, StoreError};
use crate::remote::Tiered;

/// The follower's side of a read-only cache.
pub(crate) struct Follower {
    objects: Arc<dyn Objects>,
    sealing: Option<Sealing>,
    dir: PathBuf,
    /// The manifest whose state is served.
    at: Mutex<Manifest>,
    /// [`crate::Store::push_every`]: how often a mount follows, ms.
    pub(crate) every_ms: std::sync::atomic::AtomicU64,
}

impl Follower {
    fn image(&self) -> PathBuf {
        self.dir.join(CACHE_DIR).join("image.db")
    }

    /// The image of manifest `m` in `remote/image.next`: the segments
    /// past those of the state served applied to a copy of its image, or
    /// the whole chain when it does not continue it.
    fn next_image(&self, at: &Manifest, m: &Manifest) -> Result<PathBuf> {
        let next = self.dir.join(CACHE_DIR).join("image.next");
        let n = at.segments.len();
        let continues = m.segments.len() >= n && m.segments[..n] == at.segments[..];
        if !continues {
            crate::bucket::rebuild_image(&*self.objects, m, &next, self.sealing.as_ref())?;
            return Ok(next);
        }
        std::fs::copy(self.image(), &next).map_err(StoreError::io(&next))?;
        crate::bucket::extend_image(&*self.objects, m, n, &next, self.sealing.as_ref())?;
        Ok(next)
    }
}

impl crate::Store {
    /// Opens a follower's cache in `dir` (see the module's documentation).
    pub(crate) fn open_follower(dir: &Path, spec: &RemoteSpec) -> Result<crate::Store> {
        let objects = crate::bucket::connect(spec)?;
        let sealing = match &spec.key {
            Some(key) => Some(crate::bucket::load_local_key(dir, key)?),
            None => None,
        };
        let (at, _) = read_manifest(&*objects, sealing.as_ref())?
            .ok_or_else(|| crate::bucket::remote_err("the bucket holds no store"))?;
        let local = crate::container::LocalDir::new(dir.join("containers"));
        let limit = spec.cache_size.unwrap_or(crate::config::DEFAULT_CACHE);
        let tiered = Arc::new(Tiered::reader(local, objects.clone(), limit)?);
        let mut store = Self::open_with(dir, tiered)?;
        store.keys = sealing.as_ref().map(|s| s.keys.clone());
        let f = Follower {
            objects,
            sealing,
            dir: dir.into(),
            at: Mutex::new(at),
            every_ms: (crate::mirror::PUSH_EVERY.as_millis() as u64).into(),
        };
        // The cache may have been made from an older state.
        let (_, whole) = crate::pages::hashes(&f.image(), f.at.lock().unwrap().page_size)?;
        if whole != f.at.lock().unwrap().image {
            f.at.lock().unwrap().segments.clear();
        }
        store.follower = Some(f);
        store.follow_remote()?;
        Ok(store)
    }

    /// Whether this store is a read-only follower of a bucket.
    pub fn is_follower(&self) -> bool {
        self.follower.is_some()
    }

    /// Moves a follower to the state the bucket's manifest names now;
    /// the new generation, or `None` when it is the one served.
    pub fn follow_remote(&self) -> Result<Option<u64>> {
        let Some(f) = &self.follower else {
            return Ok(None);
        };
        let (m, _) = read_manifest(&*f.objects, f.sealing.as_ref())?
            .ok_or_else(|| crate::bucket::remote_err("the bucket's manifest vanished"))?;
        let mut at = f.at.lock().unwrap_or_else(|p| p.into_inner());
        if m.image == at.image && !at.segments.is_empty() {
            return Ok(None);
        }
        // Every push and recover moves the generation on: an older one is
        // an old manifest put back (by the bucket's owner), never followed
        // (the served tree went back in time without a word).
        if m.generation < at.generation {
            return Err(crate::bucket::remote_err(format!(
                "the bucket's manifest went back from generation {} to {}: not followed \
                 (an old manifest put back?)",
                at.generation, m.generation
            )));
        }
        let next = f.next_image(&at, &m)?;
        let live = self.dir.join("meta.sqlite.next");
        std::fs::copy(&next, &live).map_err(StoreError::io(&live))?;
        std::fs::rename(&next, f.image()).map_err(StoreError::io(f.image()))?;
        self.replace_db(&live)?;
        *at = m;
        Ok(Some(at.generation))
    }
}
