//! Containers whose sealed copies live in an object store: the container
//! being written is a local file ([`LocalDir`]); a sealed one is uploaded
//! whole, write-once ([`Objects::put_new`]), by a background thread, and
//! read back with ranged GETs once its local copy is gone. The local
//! directory is then the store's cache of the bucket.
//!
//! Invariants:
//! - the object of container `id` holds exactly the container's bytes up
//!   to the length it was sealed at, or more (a longer object whose first
//!   `len` bytes match is accepted: a tail past the committed length is
//!   garbage nobody references, as in a local container after a crash);
//! - a container is uploaded only once sealed, and never written after;
//! - a local copy is read before the bucket's: they hold the same bytes.
//!
//! - a container deleted (gc) leaves the bucket only when the metadata
//!   the bucket holds no longer refers to it: its key waits in `doomed`
//!   until a push ([`crate::mirror`]) has swapped in a manifest taken
//!   after the delete.
//!
//! - the local directory is a bounded cache: a local copy is evicted
//!   (least recently used first) only once its container is in the
//!   bucket; a read that misses fetches the whole object back (up to
//!   [`WHOLE_FETCH_MAX`]; larger ones are read by ranges), served from
//!   memory until its local copy is written ([`crate::fetch`]);
//! - a local copy found damaged (a read, scrub) is dropped and the bucket's
//!   read instead only if it is evictable: the only copy stays, and its
//!   damage is `EIO`.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use onecopy_objects::{ObjectError, Objects, Pool};

use crate::container::{ContainerStore, LocalDir};
use crate::error::{Result, StoreError};
use crate::fetch::Fetcher;
use bytes::Bytes;

/// Objects up to this size are fetched whole into the cache on a miss
/// (sequential reads of a file then cost one GET per container).
pub const WHOLE_FETCH_MAX: u64 = 64 << 20;

/// Sealed containers that may wait for their upload before a writer is
/// held ([`ContainerStore::admit`]): up to 4 x 32 MiB (a push seals the
/// open container early). Unbounded, a 4 GiB write ran ahead of its
/// uploads and left half of them for after it (132-136 MiB/s until in
/// the bucket); 4 gave 142-149, 8 139-152 (bench/notes/remote.md, stop
/// 58). It also bounds what a dead machine
/// can take with it beyond the bucket's last commit.
pub const UPLOAD_BACKLOG: usize = 4;

/// How long one write waits for the upload backlog to shrink: an upload
/// that is slow, not failing, holds writers only this long at a time.
const ADMIT_WAIT: Duration = Duration::from_secs(30);

/// Local copies of containers that are in the bucket: evictable.
#[derive(Default)]
pub(crate) struct Lru {
    /// id -> (bytes, last use).
    held: std::collections::HashMap<u64, (u64, u64)>,
    total: u64,
    tick: u64,
}

impl Lru {
    fn add(&mut self, id: u64, len: u64) {
        self.tick += 1;
        if let Some((old, _)) = self.held.insert(id, (len, self.tick)) {
            self.total -= old;
        }
        self.total += len;
    }

    fn touch(&mut self, id: u64) {
        self.tick += 1;
        if let Some(e) = self.held.get_mut(&id) {
            e.1 = self.tick;
        }
    }

    fn forget(&mut self, id: u64) {
        if let Some((len, _)) = self.held.remove(&id) {
            self.total -= len;
        }
    }

    /// The ids to evict, least recently used first, to get under `limit`.
    fn over(&mut self, limit: u64) -> Vec<u64> {
        if self.total <= limit {
            return Vec::new();
        }
        let mut by_age: Vec<(u64, u64, u64)> = self
            .held
            .iter()
            .map(|(&id, &(len, t))| (t, id, len))
            .collect();
        by_age.sort_unstable();
        let mut out = Vec::new();
        for (_, id, len) in by_age {
            if self.total <= limit {
                break;
            }
            self.held.remove(&id);
            self.total -= len;
            out.push(id);
        }
        out
    }
}

/// The key of container `id` in the bucket.
pub fn object_key(id: u64) -> String {
    format!("data/{:02x}/{id:016x}.occ", id & 0xff)
}

pub(crate) fn id_of(key: &str) -> Option<u64> {
    let name = key.rsplit('/').next()?.strip_suffix(".occ")?;
    u64::from_str_radix(name, 16).ok()
}

#[derive(Default)]
struct Queue {
    /// Sealed containers not yet in the bucket: id -> sealed length.
    pending: BTreeMap<u64, u64>,
    /// The container being uploaded now.
    busy: Option<u64>,
    /// The last upload's error, cleared by a success.
    failed: Option<String>,
    /// The container whose upload failed last: the next attempt takes the
    /// one after it, so one that keeps failing holds up no other.
    skip_to: u64,
    stop: bool,
}

impl Queue {
    /// [`UPLOAD_BACKLOG`] containers wait while uploads work and the tier
    /// runs: writers wait.
    fn holds_writers(&self) -> bool {
        self.pending.len() >= UPLOAD_BACKLOG && self.failed.is_none() && !self.stop
    }
}

struct Uploads {
    q: Mutex<Queue>,
    cv: Condvar,
}

/// A local directory in front of an object store.
pub struct Tiered {
    local: Arc<LocalDir>,
    objects: Arc<dyn Objects>,
    up: Arc<Uploads>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Containers deleted here whose objects wait for the next push.
    doomed: Mutex<Vec<u64>>,
    /// The evictable local copies and the cache's bound in bytes.
    lru: Arc<Mutex<Lru>>,
    limit: u64,
    /// Fetches of whole containers (see [`crate::fetch`]).
    fetcher: Arc<Fetcher>,
    /// A follower's tier: nothing goes to the bucket.
    read_only: bool,
}

impl Tiered {
    /// A tier whose local copies of uploaded containers add up to at
    /// most `limit` bytes (`u64::MAX`: kept); fails only if its threads
    /// cannot start.
    pub fn new(local: LocalDir, objects: Arc<dyn Objects>, limit: u64) -> Result<Tiered> {
        let local = Arc::new(local);
        let lru = Arc::new(Mutex::new(Lru::default()));
        let fetcher = Fetcher::start(local.clone(), objects.clone(), lru.clone(), limit)?;
        let up = Arc::new(Uploads {
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
        });
        let worker = {
            let root = local.root().to_path_buf();
            let (local, objects, up) = (local.clone(), objects.clone(), up.clone());
            let (lru, limit) = (lru.clone(), limit);
            std::thread::Builder::new()
                .name("onecopy-upload".into())
                .spawn(move || {
                    upload_loop(&local, &*objects, &up, &|id, len| {
                        evict(&local, &lru, limit, Some((id, len)))
                    })
                })
                .map_err(StoreError::io(root))?
        };
        Ok(Tiered {
            local,
            objects,
            up,
            worker: Mutex::new(Some(worker)),
            doomed: Mutex::new(Vec::new()),
            lru,
            limit,
            fetcher,
            read_only: false,
        })
    }

    /// A tier that only reads the bucket (a follower's): sealed
    /// containers are not uploaded, deletes stay local.
    pub fn reader(local: LocalDir, objects: Arc<dyn Objects>, limit: u64) -> Result<Tiered> {
        let mut t = Tiered::new(local, objects, limit)?;
        t.read_only = true;
        Ok(t)
    }

    /// Bytes of local copies the cache may evict, now.
    pub fn cached_bytes(&self) -> u64 {
        self.lru.lock().unwrap().total
    }

    /// Finds container `id`: just fetched (its bytes in memory), else its
    /// local copy (read with `local`), fetching it whole on a miss; else
    /// to be read from the bucket by ranges.
    fn read_cached<T>(
        &self,
        id: u64,
        mut local: impl FnMut(&LocalDir) -> Result<T>,
    ) -> Result<Found<T>> {
        for fetched in [false, true] {
            if let Some(b) = self.fetcher.fresh(id) {
                self.fetcher.want_next(id);
                return Ok(Found::Fresh(b));
            }
            match local(&self.local) {
                Err(e) if is_missing(&e) => {}
                r => {
                    self.lru.lock().unwrap().touch(id);
                    return r.map(Found::Local);
                }
            }
            if fetched || !self.fetcher.fetch(id)? {
                break;
            }
            self.fetcher.want_next(id);
        }
        Ok(Found::Bucket)
    }

    /// The containers deleted since the last call, whose objects are to
    /// go once a manifest taken from now on is in.
    pub fn take_doomed(&self) -> Vec<u64> {
        std::mem::take(&mut *self.doomed.lock().unwrap())
    }

    /// Gives back what [`Tiered::take_doomed`] took (a push failed).
    pub fn return_doomed(&self, ids: Vec<u64>) {
        self.doomed.lock().unwrap().extend(ids);
    }

    /// Waits until every sealed container below `below` is in the bucket,
    /// at most `limit`.
    pub fn wait_uploaded_below(&self, below: u64, limit: Duration) -> Result<()> {
        let q = self.up.q.lock().unwrap();
        let waiting = |q: &Queue| q.pending.range(..below).next().is_some();
        let (q, _) = self
            .up
            .cv
            .wait_timeout_while(q, limit, |q| waiting(q))
            .unwrap();
        match q.pending.range(..below).next() {
            None => Ok(()),
            Some((id, _)) => Err(StoreError::ShutDown {
                why: format!(
                    "container {id} is not uploaded yet: {}",
                    q.failed.as_deref().unwrap_or("still uploading")
                ),
            }),
        }
    }

    /// Waits until every sealed container is in the bucket, at most
    /// `limit`; the last upload error if some are still missing then.
    pub fn wait_uploaded(&self, limit: Duration) -> Result<()> {
        self.wait_uploaded_below(u64::MAX, limit)
    }

    /// Reads from the bucket: a range of a container whose local copy is
    /// gone.
    fn fetch(&self, id: u64, offset: u64, len: usize) -> Result<Vec<u8>> {
        let key = object_key(id);
        let got = self
            .objects
            .get_range(&key, offset..offset + len as u64)
            .map_err(object_error)?;
        exact(id, offset, len, &got).map(<[u8]>::to_vec)
    }
}

/// Where [`Tiered::read_cached`] found a container.
enum Found<T> {
    /// Read from the local copy.
    Local(T),
    /// Fetched whole, its local copy not written yet.
    Fresh(Bytes),
    /// Neither: read it from the bucket by ranges.
    Bucket,
}

impl Drop for Tiered {
    fn drop(&mut self) {
        self.fetcher.stop();
        self.up.q.lock().unwrap().stop = true;
        self.up.cv.notify_all();
        if let Some(w) = self.worker.lock().unwrap().take() {
            let _ = w.join();
        }
    }
}

pub(crate) fn object_error(e: ObjectError) -> StoreError {
    StoreError::Object(e)
}

fn is_missing(e: &StoreError) -> bool {
    matches!(e, StoreError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

/// Bytes `offset..offset + len` of container `id`, whose whole object is
/// `b`, borrowed from it.
fn within(b: &Bytes, id: u64, offset: u64, len: usize) -> Result<&[u8]> {
    let tail = b.get(offset as usize..).unwrap_or_default();
    exact(id, offset, len, &tail[..tail.len().min(len)])
}

/// `got`, read from the bucket at `offset` of container `id`, if it is
/// the `len` bytes asked for; shorter is damage.
fn exact(id: u64, offset: u64, len: usize, got: &[u8]) -> Result<&[u8]> {
    if got.len() != len {
        return Err(StoreError::Damaged {
            container: id,
            offset,
            why: format!(
                "the bucket's object is shorter ({} of {len} bytes)",
                got.len()
            ),
        });
    }
    Ok(got)
}

/// Registers `added` as evictable and deletes the least recently used
/// local copies beyond `limit` (a copy being read stays readable: its
/// open descriptor keeps the file).
pub(crate) fn evict(local: &LocalDir, lru: &Mutex<Lru>, limit: u64, added: Option<(u64, u64)>) {
    let gone = {
        let mut l = lru.lock().unwrap();
        if let Some((id, len)) = added {
            l.add(id, len);
        }
        l.over(limit)
    };
    for id in gone {
        let _ = local.delete(id);
    }
}

/// Deletes the least recently used local copies the LRU lists until
/// `bytes` are freed (all of them if they hold less); the bytes freed.
pub(crate) fn shed(local: &LocalDir, lru: &Mutex<Lru>, bytes: u64) -> u64 {
    let (gone, freed) = {
        let mut l = lru.lock().unwrap();
        let before = l.total;
        let gone = l.over(before.saturating_sub(bytes));
        (gone, before - l.total)
    };
    for id in gone {
        let _ = local.delete(id);
    }
    freed
}

/// Puts container `id`'s first `len` bytes in the bucket, unless an
/// object whose first `len` bytes are the same is there already. The
/// create-only PUT goes first: asking the bucket before every upload
/// would cost a round trip per container for the rare one already there
/// (an upload whose answer was lost, a listing gap after a crash).
fn upload(
    local: &LocalDir,
    objects: &dyn Objects,
    pool: &Arc<Pool>,
    id: u64,
    len: u64,
) -> Result<()> {
    let key = object_key(id);
    let mut buf = pool.take(len as usize);
    match local.read_append(id, 0, len as usize, &mut buf) {
        Err(e) if is_missing(&e) => {
            return match objects.size(&key).map_err(object_error)? {
                Some(there) if there >= len => Ok(()),
                // Lost from both (the bucket's copy deleted or cut by its
                // owner): nothing can ever upload it, and waiting for it
                // held every push, fsck and unmount for ten minutes.
                _ => {
                    crate::warn!(
                        "onecopy: container {id} is neither in the cache nor whole in the bucket: \
                         its chunks read as damaged (EIO); `onecopy store scrub` lists them"
                    );
                    Ok(())
                }
            };
        }
        r => r?,
    };
    let bytes = Pool::bytes(pool, buf, 0);
    // `Bytes` shares the buffer: the bytes are not copied again.
    match objects.put_new(&key, bytes.clone()) {
        Err(ObjectError::Exists { .. }) => same_prefix(objects, id, &bytes),
        r => r.map_err(object_error),
    }
}

/// Checks that the bucket's object of `id` begins with `bytes` (an
/// earlier upload whose answer was lost, or one made before a crash).
fn same_prefix(objects: &dyn Objects, id: u64, bytes: &[u8]) -> Result<()> {
    let there = objects
        .get_range(&object_key(id), 0..bytes.len() as u64)
        .map_err(object_error)?;
    if there[..] != *bytes {
        return Err(StoreError::Damaged {
            container: id,
            offset: 0,
            why: "the bucket holds a different object under this container's key".into(),
        });
    }
    Ok(())
}

/// The upload thread: the lowest pending container first, except that
/// after a failure the next attempt is the next container (round the
/// queue); a failure is kept for [`Tiered::wait_uploaded`] and the queue
/// waits a pause growing to 30 s.
fn upload_loop(local: &LocalDir, objects: &dyn Objects, up: &Uploads, uploaded: &dyn Fn(u64, u64)) {
    let mut pause = Duration::from_millis(100);
    // One upload at a time: its buffer serves the next once the client
    // lets it go (a fresh one cost 5% of a writing mount's samples in
    // page faults and zeroing; bench/notes/remote.md, stop 61).
    let pool = Pool::keeping(1);
    loop {
        let (id, len) = {
            let mut q = up.q.lock().unwrap();
            q.busy = None;
            up.cv.notify_all();
            q = up
                .cv
                .wait_while(q, |q| q.pending.is_empty() && !q.stop)
                .unwrap();
            if q.stop {
                return;
            }
            let next = q.pending.range(q.skip_to..).next();
            let (&id, &len) = next.or_else(|| q.pending.iter().next()).unwrap();
            q.busy = Some(id);
            (id, len)
        };
        let r = upload(local, objects, &pool, id, len);
        if r.is_ok() {
            uploaded(id, len);
        }
        let mut q = up.q.lock().unwrap();
        match r {
            Ok(()) => {
                if q.pending.get(&id) == Some(&len) {
                    q.pending.remove(&id);
                }
                q.failed = None;
                q.skip_to = 0;
                pause = Duration::from_millis(100);
                drop(q);
                // Kept for this read (see `Tiered::drop_cache`); a commit
                // from now on drops what its sync leaves dirty here.
                local.drop_cache(id);
            }
            Err(e) => {
                q.failed = Some(e.to_string());
                q.skip_to = id + 1;
                drop(up.cv.wait_timeout_while(q, pause, |q| !q.stop).unwrap());
                pause = (pause * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// A follower makes no container: every id is the writer's to use. Its
/// store never appends (its mount is read-only); creating and syncing
/// are no-ops so that opening it works.
impl ContainerStore for Tiered {
    fn create(&self, id: u64) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.local.create(id)
    }

    fn append(&self, id: u64, bytes: &[u8]) -> Result<()> {
        if self.read_only {
            return Err(StoreError::ShutDown {
                why: "a follower of a bucket is read-only".into(),
            });
        }
        self.local.append(id, bytes)
    }

    fn read(&self, id: u64, offset: u64, len: usize) -> Result<Vec<u8>> {
        match self.read_cached(id, |l| l.read(id, offset, len))? {
            Found::Local(v) => Ok(v),
            Found::Fresh(b) => within(&b, id, offset, len).map(<[u8]>::to_vec),
            Found::Bucket => self.fetch(id, offset, len),
        }
    }

    fn read_into(&self, id: u64, offset: u64, bufs: &mut [&mut [u8]]) -> Result<()> {
        use crate::container::{scatter, scatter_slice};
        match self.read_cached(id, |l| l.read_into(id, offset, bufs))? {
            Found::Local(()) => Ok(()),
            Found::Fresh(b) => {
                // Straight from the fetched buffer: no copy in between.
                let len = bufs.iter().map(|b| b.len()).sum();
                scatter_slice(within(&b, id, offset, len)?, bufs);
                Ok(())
            }
            Found::Bucket => scatter(|len| self.fetch(id, offset, len), bufs),
        }
    }

    fn with_bytes(
        &self,
        id: u64,
        offset: u64,
        len: usize,
        f: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let local = |l: &LocalDir| {
            let mut v = vec![0u8; len];
            l.read_into(id, offset, &mut [&mut v]).map(|()| v)
        };
        match self.read_cached(id, local)? {
            Found::Local(v) => f(&v),
            // Where the fetch put them: a cold read of a sealed store
            // copied every record aside before opening it.
            Found::Fresh(b) => f(within(&b, id, offset, len)?),
            Found::Bucket => f(&self.fetch(id, offset, len)?),
        }
    }

    /// A local copy already evicted was in the bucket, whole (it is
    /// uploaded only once sealed): durable there.
    fn sync(&self, id: u64) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        match self.local.sync(id) {
            Err(e) if is_missing(&e) => match self.objects.size(&object_key(id)) {
                Ok(Some(_)) => Ok(()),
                _ => Err(e),
            },
            r => r,
        }
    }

    fn start_sync(&self, id: u64) {
        self.local.start_sync(id)
    }

    /// Not while the container waits for its upload: the upload would
    /// read it back from the disk, stalling the PUTs behind it (the
    /// upload drops the cache once done).
    fn drop_cache(&self, id: u64) {
        let q = self.up.q.lock().unwrap();
        if !q.pending.contains_key(&id) {
            drop(q);
            self.local.drop_cache(id)
        }
    }

    fn sealed(&self, id: u64, len: u64) {
        if self.read_only {
            return;
        }
        self.up.q.lock().unwrap().pending.insert(id, len);
        self.up.cv.notify_all();
    }

    /// Holds the writer while [`UPLOAD_BACKLOG`] containers wait for
    /// their upload, unless the last upload failed (the bucket is away:
    /// writes go on into the local cache) or the tier stops.
    fn admit(&self) {
        if self.read_only {
            return;
        }
        let q = self.up.q.lock().unwrap();
        let held = self
            .up
            .cv
            .wait_timeout_while(q, ADMIT_WAIT, |q| q.holds_writers());
        drop(held.unwrap());
    }

    fn admits_now(&self) -> bool {
        self.read_only || !self.up.q.lock().unwrap().holds_writers()
    }

    fn remote(&self) -> bool {
        true
    }

    /// Only a copy of a container the bucket holds (the LRU lists exactly
    /// those): a container not uploaded yet has no other copy. The LRU
    /// stays locked until the copy is gone, so that a reader that met the
    /// same damage meanwhile finds it gone, and reads again too: a copy
    /// fetched again meanwhile is fresh (and kept), one not listed and
    /// not there was dropped (or never fetched): both read well now.
    fn drop_damaged_copy(&self, id: u64) -> bool {
        let mut lru = self.lru.lock().unwrap();
        if self.fetcher.fresh(id).is_some() {
            return true;
        }
        if lru.held.contains_key(&id) {
            lru.forget(id);
            return self.local.delete(id).is_ok();
        }
        matches!(self.local.len(id), Ok(None))
    }

    /// Copies the LRU lists (in the bucket), least recently used first.
    fn shed(&self, bytes: u64) -> u64 {
        shed(&self.local, &self.lru, bytes)
    }

    /// Queues the sealed containers the bucket's listing lacks or holds
    /// shorter: one listing, not a request per container (a listing may
    /// miss new objects; those are queued, and the upload finds them).
    fn resume(&self, sealed: Vec<(u64, u64)>) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        let listed: std::collections::HashMap<u64, u64> = self
            .objects
            .list("data")
            .map_err(object_error)?
            .into_iter()
            .filter_map(|l| Some((id_of(&l.key)?, l.size)))
            .collect();
        let mut q = self.up.q.lock().unwrap();
        let mut up = Vec::new();
        for (id, len) in sealed {
            if listed.get(&id).is_none_or(|&size| size < len) {
                q.pending.insert(id, len);
            } else {
                up.push(id);
            }
        }
        self.up.cv.notify_all();
        drop(q);
        // Local copies of what is in the bucket: the cache's to evict.
        for id in up {
            if let Some(n) = self.local.len(id)? {
                evict(&self.local, &self.lru, self.limit, Some((id, n)));
            }
        }
        Ok(())
    }

    fn len(&self, id: u64) -> Result<Option<u64>> {
        match self.local.len(id)? {
            Some(n) => Ok(Some(n)),
            None => self.objects.size(&object_key(id)).map_err(object_error),
        }
    }

    /// Forgets a pending upload (waiting out one in flight), deletes the
    /// local copy, and dooms the object (see the module's invariants).
    fn delete(&self, id: u64) -> Result<()> {
        let mut q = self.up.q.lock().unwrap();
        q.pending.remove(&id);
        let q = self.up.cv.wait_while(q, |q| q.busy == Some(id)).unwrap();
        drop(q);
        self.lru.lock().unwrap().forget(id);
        self.local.delete(id)?;
        if !self.read_only {
            self.doomed.lock().unwrap().push(id);
        }
        Ok(())
    }

    /// The local containers and the bucket's (whose listing may miss the
    /// newest: those are local until uploaded, or were listed before).
    fn list(&self) -> Result<Vec<u64>> {
        let mut ids = self.local.list()?;
        let listed = self.objects.list("data").map_err(object_error)?;
        ids.extend(listed.iter().filter_map(|l| id_of(&l.key)));
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits up to 30 s for `ok`, failing with `what`.
    fn eventually(what: &str, ok: &dyn Fn() -> bool) {
        let t0 = std::time::Instant::now();
        while !ok() {
            assert!(t0.elapsed().as_secs() < 30, "{what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A miss fetches its whole container and serves it at once; the
    /// next container is fetched ahead and lands in the cache, and the
    /// read of that one asks for the two after it; a read past an
    /// object's end is damage, never made-up bytes.
    #[test]
    fn a_miss_fetches_the_container_and_the_next_one_ahead() {
        let d = tempfile::tempdir().unwrap();
        let objects = Arc::new(onecopy_objects::LocalObjects::new(d.path().join("b")).unwrap());
        let body =
            |id: u64| -> Vec<u8> { (0..1u32 << 20).map(|i| (i as u64 * id) as u8).collect() };
        for id in 1..=4 {
            objects.put_new(&object_key(id), body(id).into()).unwrap();
        }
        let local = LocalDir::new(d.path().join("cache"));
        let t = Tiered::reader(local, objects, u64::MAX).unwrap();
        assert_eq!(t.read(1, 4096, 8192).unwrap(), body(1)[4096..12288]);
        let cached = |id| t.local.len(id).unwrap().is_some();
        eventually("container 2 fetched ahead", &|| cached(1) && cached(2));
        std::thread::sleep(Duration::from_millis(200));
        assert!(!cached(3), "a miss asks for one container ahead only");
        t.read(2, 0, 10).unwrap();
        eventually("3 and 4 fetched ahead of a walk", &|| {
            cached(3) && cached(4)
        });
        let mut a = vec![0u8; 100];
        let mut b = vec![0u8; 28];
        t.read_into(2, 1000, &mut [&mut a, &mut b]).unwrap();
        assert_eq!([a, b].concat(), body(2)[1000..1128]);
        assert!(matches!(
            t.read(3, (1 << 20) - 10, 20),
            Err(StoreError::Damaged { container: 3, .. })
        ));
    }

    /// The last three containers installed stay in memory (their local
    /// copies were written around the page cache), older ones leave it.
    #[test]
    fn the_last_installed_containers_are_served_from_memory() {
        let d = tempfile::tempdir().unwrap();
        let objects = Arc::new(onecopy_objects::LocalObjects::new(d.path().join("b")).unwrap());
        let body =
            |id: u64| -> Vec<u8> { (0..1u32 << 16).map(|i| (i as u64 ^ id) as u8).collect() };
        for id in 1..=6 {
            objects.put_new(&object_key(id), body(id).into()).unwrap();
        }
        let t = Tiered::reader(LocalDir::new(d.path().join("cache")), objects, u64::MAX).unwrap();
        let in_memory = |id| t.fetcher.fresh(id).is_some();
        let cached = |id| t.local.len(id).unwrap().is_some();
        t.read(1, 0, 10).unwrap();
        eventually("1 and 2 installed", &|| cached(1) && cached(2));
        assert!(in_memory(1) && in_memory(2));
        // Misses, not a walk: each fetches one container ahead.
        t.read(3, 0, 10).unwrap();
        eventually("3 and 4 installed", &|| cached(3) && cached(4));
        t.read(5, 0, 10).unwrap();
        eventually("1, 2 and 3 out of memory", &|| {
            cached(5) && cached(6) && !in_memory(1) && !in_memory(2) && !in_memory(3)
        });
        assert!(in_memory(4) && in_memory(5) && in_memory(6));
        t.local.delete(6).unwrap();
        assert_eq!(t.read(6, 100, 50).unwrap(), body(6)[100..150]);
    }

    /// A reader walking containers, slower than the bucket: the container
    /// it is in stays in memory while the two it asked ahead are fetched
    /// and installed, and leaves once it moved on.
    #[test]
    fn a_walking_reader_keeps_its_container_in_memory() {
        let d = tempfile::tempdir().unwrap();
        let objects = Arc::new(onecopy_objects::LocalObjects::new(d.path().join("b")).unwrap());
        for id in 1..=5 {
            objects
                .put_new(&object_key(id), vec![id as u8; 1 << 16].into())
                .unwrap();
        }
        let t = Tiered::reader(LocalDir::new(d.path().join("cache")), objects, u64::MAX).unwrap();
        let in_memory = |id| t.fetcher.fresh(id).is_some();
        let cached = |id| t.local.len(id).unwrap().is_some();
        t.read(1, 0, 10).unwrap();
        eventually("2 fetched ahead", &|| cached(2));
        t.read(2, 0, 10).unwrap();
        eventually("3 and 4 fetched ahead", &|| cached(3) && cached(4));
        std::thread::sleep(Duration::from_millis(200));
        assert!(in_memory(2), "the reader's container left memory");
        assert_eq!(t.read(2, 100, 4).unwrap(), [2; 4]);
        t.read(3, 0, 10).unwrap();
        eventually("2 out of memory once the reader moved on", &|| {
            cached(5) && !in_memory(2)
        });
        assert!(in_memory(3));
    }

    /// A bucket whose PUTs wait until let through (`open`), or fail at
    /// once (`down`).
    struct Gate {
        inner: onecopy_objects::LocalObjects,
        state: Mutex<(bool, bool)>,
        cv: Condvar,
    }

    impl Gate {
        fn set(&self, open: bool, down: bool) {
            *self.state.lock().unwrap() = (open, down);
            self.cv.notify_all();
        }
    }

    impl Objects for Gate {
        fn put_new(&self, key: &str, bytes: Bytes) -> onecopy_objects::Result<()> {
            let st = self.state.lock().unwrap();
            let st = self
                .cv
                .wait_while(st, |(open, down)| !*open && !*down)
                .unwrap();
            if st.1 {
                let source = std::io::Error::other("injected");
                return Err(ObjectError::Io {
                    key: key.into(),
                    source,
                });
            }
            drop(st);
            self.inner.put_new(key, bytes)
        }
        fn get_range(&self, key: &str, r: std::ops::Range<u64>) -> onecopy_objects::Result<Bytes> {
            self.inner.get_range(key, r)
        }
        fn size(&self, key: &str) -> onecopy_objects::Result<Option<u64>> {
            self.inner.size(key)
        }
        fn get(&self, key: &str) -> onecopy_objects::Result<(Bytes, onecopy_objects::Tag)> {
            self.inner.get(key)
        }
        fn swap(
            &self,
            key: &str,
            bytes: Bytes,
            expected: Option<&onecopy_objects::Tag>,
        ) -> onecopy_objects::Result<onecopy_objects::Tag> {
            self.inner.swap(key, bytes, expected)
        }
        fn delete(&self, key: &str) -> onecopy_objects::Result<()> {
            self.inner.delete(key)
        }
        fn list(&self, dir: &str) -> onecopy_objects::Result<Vec<onecopy_objects::Listed>> {
            self.inner.list(dir)
        }
    }

    /// A writer is held while UPLOAD_BACKLOG sealed containers wait for
    /// the bucket and let go once one is in; with the bucket failing it
    /// is not held (writes go on into the local cache).
    #[test]
    fn a_writer_waits_for_a_full_upload_backlog_only_while_uploads_work() {
        let d = tempfile::tempdir().unwrap();
        let gate = Arc::new(Gate {
            inner: onecopy_objects::LocalObjects::new(d.path().join("b")).unwrap(),
            state: Mutex::new((false, false)),
            cv: Condvar::new(),
        });
        let t = Arc::new(
            Tiered::new(LocalDir::new(d.path().join("c")), gate.clone(), u64::MAX).unwrap(),
        );
        let seal = |id: u64| {
            t.create(id).unwrap();
            t.append(id, b"bytes").unwrap();
            t.sealed(id, t.len(id).unwrap().unwrap());
        };
        for id in 1..UPLOAD_BACKLOG as u64 {
            seal(id);
        }
        t.admit();
        seal(UPLOAD_BACKLOG as u64);
        let (tx, rx) = std::sync::mpsc::channel();
        let writer = {
            let t = t.clone();
            std::thread::spawn(move || {
                t.admit();
                tx.send(()).unwrap();
            })
        };
        let held = rx.recv_timeout(Duration::from_millis(300));
        assert!(held.is_err(), "a full backlog holds the writer");
        assert!(!t.admits_now());
        gate.set(true, false);
        rx.recv_timeout(Duration::from_secs(30))
            .expect("let go once uploads move");
        writer.join().unwrap();
        t.wait_uploaded(Duration::from_secs(30)).unwrap();
        assert!(t.admits_now());
        gate.set(false, true);
        for id in 10..10 + 2 * UPLOAD_BACKLOG as u64 {
            seal(id);
        }
        eventually("an upload failed", &|| {
            t.wait_uploaded(Duration::ZERO).is_err()
        });
        assert!(t.admits_now());
        let t0 = std::time::Instant::now();
        t.admit();
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a failing bucket holds no writer"
        );
    }

    /// An upload PUTs without asking first; an object already there is
    /// accepted only if it begins with the container's bytes; a local
    /// copy gone is fine only if the bucket holds the container.
    #[test]
    fn an_upload_accepts_only_the_same_bytes_already_there() {
        let d = tempfile::tempdir().unwrap();
        let objects = onecopy_objects::LocalObjects::new(d.path().join("b")).unwrap();
        let local = LocalDir::new(d.path().join("cache"));
        for id in 1..=3 {
            local.create(id).unwrap();
            local.append(id, b"abcdef").unwrap();
        }
        let len = local.len(1).unwrap().unwrap();
        let bytes = |id| local.read(id, 0, len as usize).unwrap();
        let longer = [&bytes(2)[..], b"XYZ"].concat();
        let mut other = bytes(3);
        *other.last_mut().unwrap() ^= 1;
        objects.put_new(&object_key(2), longer.into()).unwrap();
        objects.put_new(&object_key(3), other.into()).unwrap();
        // One pool for every upload, as the upload thread has: each
        // upload reads into the buffer the one before let go.
        let pool = Pool::keeping(1);
        let upload = |id| upload(&local, &objects, &pool, id, len);
        upload(1).unwrap();
        assert_eq!(objects.get_range(&object_key(1), 0..len).unwrap(), bytes(1));
        assert_eq!(pool.kept(), 1, "the buffer let go");
        upload(2).unwrap();
        assert!(matches!(
            upload(3),
            Err(StoreError::Damaged { container: 3, .. })
        ));
        local.delete(1).unwrap();
        upload(1).unwrap();
        // In neither place: it can never go up; said and left.
        upload(4).unwrap();
    }

    #[test]
    fn keys_name_their_container() {
        assert_eq!(object_key(0x1a2b), "data/2b/0000000000001a2b.occ");
        assert_eq!(id_of(&object_key(0x1a2b)), Some(0x1a2b));
        assert_eq!(id_of("data/2b/x.occ"), None);
    }
}
