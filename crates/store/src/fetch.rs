//! Whole containers fetched from the bucket into a remote store's cache.
//!
//! A read that misses its container fetches the whole object (one GET per
//! container, not one per chunk) and serves it from memory at once; a
//! thread of its own writes the local copy (the write and its `fdatasync`
//! are off the reader's path). The first read of a fetched container
//! asks for the next one, and for the next [`AHEAD`] once the reader
//! reached a container asked ahead (a file written in one go lies in
//! consecutive containers), so a sequential reader finds the next
//! container fetched, or being fetched, when it gets there, and the
//! server has the one after it to send meanwhile.
//!
//! Invariants:
//! - each container is fetched once at a time: a reader that wants one in
//!   flight waits for it;
//! - a fetched container is always in memory or installed locally (it
//!   leaves memory only once its local copy is in place, or its install
//!   failed: then the next read fetches it again);
//! - the last [`KEPT`] installed containers stay in memory too: their
//!   readers are still in them (a reader walking containers is in the
//!   oldest of them while the ones it asked ahead are installed), and the
//!   local copies were written around the page cache;
//! - memory holds at most [`INSTALL_QUEUE`] + 2 + [`KEPT`] fetched
//!   containers: the fetch thread waits for the installer when it lags.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Condvar, Mutex};

use bytes::Bytes;
use onecopy_objects::Objects;

use crate::container::{ContainerStore, LocalDir};
use crate::error::{Result, StoreError};
use crate::remote::{evict, object_error, object_key, shed, Lru, WHOLE_FETCH_MAX};

/// Fetched containers waiting for their local copies to be written.
const INSTALL_QUEUE: usize = 2;

/// Containers asked ahead lately (a read of each asks once).
const ASKED: usize = 16;

/// Containers asked for ahead of the one being read.
const AHEAD: usize = 2;

/// Installed containers kept in memory, newest last: the one a walking
/// reader is in and the [`AHEAD`] it asked for. With one fewer, a reader
/// slower than the bucket read the rest of its container back from the
/// disk (bench/notes/remote.md, "A slow reader's container kept in
/// memory").
const KEPT: usize = AHEAD + 1;

/// Fetches whole containers into the cache.
pub(crate) struct Fetcher {
    shared: Arc<Shared>,
    objects: Arc<dyn Objects>,
    limit: u64,
    flight: Mutex<HashSet<u64>>,
    cv: Condvar,
    install: SyncSender<(u64, Bytes)>,
    ahead: Mutex<Option<SyncSender<u64>>>,
    asked: Mutex<VecDeque<u64>>,
}

/// What the fetcher and its installer thread both hold.
struct Shared {
    local: Arc<LocalDir>,
    lru: Arc<Mutex<Lru>>,
    /// Fetched containers whose local copies are not in place yet, and
    /// the [`KEPT`] last installed.
    fresh: Mutex<HashMap<u64, Bytes>>,
    /// The installed containers still in `fresh`, oldest first.
    kept: Mutex<VecDeque<u64>>,
}

impl Fetcher {
    /// A fetcher into `local`, whose evictable copies add up to at most
    /// `limit` bytes; starts its installer and fetch-ahead threads (fails
    /// only if they cannot start).
    pub(crate) fn start(
        local: Arc<LocalDir>,
        objects: Arc<dyn Objects>,
        lru: Arc<Mutex<Lru>>,
        limit: u64,
    ) -> Result<Arc<Fetcher>> {
        let shared = Arc::new(Shared {
            local,
            lru,
            fresh: Mutex::new(HashMap::new()),
            kept: Mutex::new(VecDeque::new()),
        });
        let (install, todo) = sync_channel::<(u64, Bytes)>(INSTALL_QUEUE);
        let s = shared.clone();
        let root = shared.local.root().to_path_buf();
        std::thread::Builder::new()
            .name("onecopy-install".into())
            .spawn(move || {
                for (id, bytes) in todo {
                    s.install(id, bytes, limit);
                }
            })
            .map_err(StoreError::io(&root))?;
        let f = Arc::new(Fetcher {
            shared,
            objects,
            limit,
            flight: Mutex::new(HashSet::new()),
            cv: Condvar::new(),
            install,
            ahead: Mutex::new(None),
            asked: Mutex::new(VecDeque::new()),
        });
        let (tx, rx) = sync_channel::<u64>(AHEAD);
        let weak = Arc::downgrade(&f);
        std::thread::Builder::new()
            .name("onecopy-fetch".into())
            .spawn(move || {
                for id in rx {
                    match weak.upgrade() {
                        Some(f) => drop(f.fetch(id)),
                        None => break,
                    }
                }
            })
            .map_err(StoreError::io(&root))?;
        *f.ahead.lock().unwrap() = Some(tx);
        Ok(f)
    }

    /// Stops fetching ahead (the store is closing).
    pub(crate) fn stop(&self) {
        self.ahead.lock().unwrap().take();
    }

    /// The bytes of container `id` if it was fetched and its local copy
    /// is not in place yet, or was put there last.
    pub(crate) fn fresh(&self, id: u64) -> Option<Bytes> {
        self.shared.fresh.lock().unwrap().get(&id).cloned()
    }

    /// Asks for the containers after `id` to be fetched, each once, as
    /// far as the fetch thread's queue has room: [`AHEAD`] of them when
    /// `id` was itself asked ahead (a reader walking the containers),
    /// else one (a random reader fetches one container more per miss).
    pub(crate) fn want_next(&self, id: u64) {
        let mut asked = self.asked.lock().unwrap();
        let ahead = self.ahead.lock().unwrap();
        let Some(tx) = &*ahead else {
            return;
        };
        let depth = if asked.contains(&id) { AHEAD as u64 } else { 1 };
        for next in id + 1..=id + depth {
            if asked.contains(&next) {
                continue;
            }
            if tx.try_send(next).is_err() {
                return;
            }
            if asked.len() >= ASKED {
                asked.pop_front();
            }
            asked.push_back(next);
        }
    }

    /// Whether container `id` is local or in memory now (fetched whole if
    /// it was neither and is small enough; `false`: read it by ranges, or
    /// it is in no bucket).
    pub(crate) fn fetch(&self, id: u64) -> Result<bool> {
        {
            let mut f = self.flight.lock().unwrap();
            loop {
                if self.shared.fresh.lock().unwrap().contains_key(&id)
                    || self.shared.local.len(id)?.is_some()
                {
                    return Ok(true);
                }
                if !f.contains(&id) {
                    break;
                }
                f = self.cv.wait(f).unwrap();
            }
            f.insert(id);
        }
        let r = self.get(id);
        self.flight.lock().unwrap().remove(&id);
        self.cv.notify_all();
        r
    }

    fn get(&self, id: u64) -> Result<bool> {
        let key = object_key(id);
        let max = WHOLE_FETCH_MAX.min(self.limit);
        let Some(bytes) = self.objects.get_at_most(&key, max).map_err(object_error)? else {
            return Ok(false);
        };
        self.shared.fresh.lock().unwrap().insert(id, bytes.clone());
        if self.install.send((id, bytes)).is_err() {
            self.shared.fresh.lock().unwrap().remove(&id);
            return Err(StoreError::ShutDown {
                why: "the cache's install thread is gone".into(),
            });
        }
        Ok(true)
    }
}

impl Shared {
    /// Writes the local copy of container `id`, then lets the bytes of
    /// the oldest kept one go from memory (of this one at once if the
    /// write failed: the next read fetches again).
    fn install(&self, id: u64, bytes: Bytes, limit: u64) {
        let len = bytes.len() as u64;
        let installed = self.local.install(id, &bytes).is_ok() || {
            // A disk short of room: the oldest copies give way, once.
            shed(&self.local, &self.lru, 2 * len);
            self.local.install(id, &bytes).is_ok()
        };
        if !installed {
            self.fresh.lock().unwrap().remove(&id);
            return;
        }
        evict(&self.local, &self.lru, limit, Some((id, len)));
        let mut kept = self.kept.lock().unwrap();
        kept.push_back(id);
        if kept.len() > KEPT {
            let old = kept.pop_front();
            self.fresh.lock().unwrap().remove(&old.unwrap());
        }
    }
}
