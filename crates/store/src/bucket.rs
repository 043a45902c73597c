//! What a remote store's bucket holds besides containers, and how a cache
//! is made from it: the manifest, the metadata segments, the key.
//!
//! Objects (keys under the store's prefix):
//! - `data/XX/ID.occ`: containers ([`crate::remote`]);
//! - `meta/GEN-RANDOM.seg`: metadata segments ([`crate::pages`]), sealed
//!   whole in an encrypted store, bound to their key;
//! - `keys/ID`: the master key wrapped by the passphrase ([`crate::seal`]);
//! - `manifest`: an envelope (`magic`, `format`, and either the manifest
//!   in clear or, named `key`, the key object and the sealed manifest).
//!   Replaced only by swap; the commit point ([`crate::mirror`]).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use onecopy_objects::{LocalObjects, ObjectError, Objects, S3Config, S3Objects, Tag};
use serde::{Deserialize, Serialize};

use crate::config::{RemoteSpec, StoreConfig};
use crate::error::{Result, StoreError};
use crate::seal::{self, Cipher, Keys};

/// Key of the manifest.
pub const MANIFEST: &str = "manifest";
const MAGIC: &str = "onecopy-remote";
/// Manifest format this code writes and reads.
pub const FORMAT: u64 = 1;
/// The local directory of a cache's own files, in the store's directory.
pub(crate) const CACHE_DIR: &str = "remote";

/// One segment as the manifest names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRef {
    pub key: String,
    pub bytes: u64,
}

/// What the bucket's store is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
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

/// The `manifest` object as stored.
#[derive(Debug, Serialize, Deserialize)]
struct Envelope {
    magic: String,
    format: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    manifest: Option<Manifest>,
    /// The key object that opens `sealed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sealed: Option<String>,
}

/// An encrypted store's keys and the name of its key object.
#[derive(Clone)]
pub struct Sealing {
    pub keys: Arc<Keys>,
    pub key: String,
}

impl Sealing {
    /// `bytes` sealed as object `name` (its associated data).
    pub fn seal(&self, name: &str, bytes: &[u8]) -> Vec<u8> {
        self.keys.seal(name.as_bytes(), bytes)
    }

    /// Object `name`'s plaintext; damage (or another key) is an error.
    pub fn open(&self, name: &str, bytes: &[u8]) -> Result<Vec<u8>> {
        self.keys
            .open(name.as_bytes(), bytes)
            .ok_or_else(|| remote_err(format!("the bucket's {name} does not open: damaged")))
    }
}

pub(crate) fn remote_err(why: impl Into<String>) -> StoreError {
    StoreError::Remote { why: why.into() }
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

fn read_envelope(objects: &dyn Objects) -> Result<Option<(Envelope, Tag)>> {
    let (bytes, tag) = match objects.get(MANIFEST) {
        Ok(got) => got,
        Err(ObjectError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let e: Envelope = serde_json::from_slice(&bytes)
        .map_err(|e| remote_err(format!("the bucket's manifest is not readable: {e}")))?;
    if e.magic != MAGIC {
        return Err(remote_err(
            "the bucket's manifest is not an onecopy store's",
        ));
    }
    if e.format != FORMAT {
        return Err(StoreError::Version {
            path: MANIFEST.into(),
            found: e.format,
            supported: FORMAT,
        });
    }
    Ok(Some((e, tag)))
}

/// The manifest and its tag, opened with `sealing` if the store is
/// encrypted; `None` when the bucket holds no store.
pub fn read_manifest(
    objects: &dyn Objects,
    sealing: Option<&Sealing>,
) -> Result<Option<(Manifest, Tag)>> {
    let Some((e, tag)) = read_envelope(objects)? else {
        return Ok(None);
    };
    let m = match (e.manifest, e.sealed, sealing) {
        (Some(m), None, None) => m,
        (None, Some(sealed), Some(s)) => {
            let bytes = hex::decode(sealed).map_err(|_| remote_err("a damaged manifest"))?;
            let plain = s.open(MANIFEST, &bytes)?;
            serde_json::from_slice(&plain)
                .map_err(|e| remote_err(format!("the bucket's manifest is not readable: {e}")))?
        }
        (None, Some(_), None) => return Err(remote_err("the bucket's store is encrypted")),
        _ => {
            return Err(remote_err(
                "the bucket's store is not encrypted as this cache says",
            ))
        }
    };
    Ok(Some((m, tag)))
}

/// The manifest object's bytes.
pub fn encode_manifest(m: &Manifest, sealing: Option<&Sealing>) -> Vec<u8> {
    let mut e = Envelope {
        magic: MAGIC.into(),
        format: FORMAT,
        manifest: None,
        key: None,
        sealed: None,
    };
    match sealing {
        None => e.manifest = Some(m.clone()),
        Some(s) => {
            let plain = serde_json::to_vec(m).expect("serializes");
            e.key = Some(s.key.clone());
            e.sealed = Some(hex::encode(s.seal(MANIFEST, &plain)));
        }
    }
    serde_json::to_vec_pretty(&e).expect("serializes")
}

/// A new master key, wrapped with `password` into a new key object.
pub(crate) fn create_key(objects: &dyn Objects, password: &[u8]) -> Result<Sealing> {
    let keys = Keys::generate();
    let kf = seal::wrap(&keys, password)?;
    let key = format!("keys/{}", crate::mirror::random_hex());
    objects.put_new_settled(
        &key,
        serde_json::to_vec_pretty(&kf).expect("serializes").into(),
    )?;
    Ok(Sealing {
        keys: Arc::new(keys),
        key,
    })
}

/// The keys of key object `key`, unwrapped with `password`.
fn open_key(objects: &dyn Objects, key: &str, password: &[u8]) -> Result<Sealing> {
    let (bytes, _) = objects.get(key)?;
    let kf: seal::KeyFile = serde_json::from_slice(&bytes)
        .map_err(|e| remote_err(format!("the bucket's {key} is not a key: {e}")))?;
    Ok(Sealing {
        keys: Arc::new(seal::unwrap(&kf, password)?),
        key: key.to_string(),
    })
}

/// The cache's key file: the master key in hex, after `CIPHER:` unless
/// the cipher is the one of stores made before ciphers were named.
fn local_key_text(keys: &Keys) -> String {
    let master = hex::encode(keys.master());
    match keys.cipher() {
        Cipher::XChaCha20Poly1305 => master,
        c => format!("{}:{master}", c.name()),
    }
}

fn parse_local_key(text: &str) -> Option<Keys> {
    let text = text.trim();
    let (cipher, master) = match text.split_once(':') {
        Some((name, master)) => (Cipher::from_name(name)?, master),
        None => (Cipher::XChaCha20Poly1305, text),
    };
    let master: [u8; 64] = hex::decode(master).ok()?.try_into().ok()?;
    Some(Keys::from_master(master, cipher))
}

/// Keeps the master key in the cache (`remote/key`, mode 0600).
pub(crate) fn save_local_key(dir: &Path, keys: &Keys) -> Result<()> {
    let path = dir.join(CACHE_DIR).join("key");
    let mut f = std::fs::File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(StoreError::io(&path))?;
    f.write_all(local_key_text(keys).as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(StoreError::io(&path))
}

/// The cache's copy of the master key, for the store whose key object is
/// `key`.
pub(crate) fn load_local_key(dir: &Path, key: &str) -> Result<Sealing> {
    let path = dir.join(CACHE_DIR).join("key");
    let text = std::fs::read_to_string(&path).map_err(StoreError::io(&path))?;
    let keys = parse_local_key(&text).ok_or_else(|| StoreError::NotAStore {
        path: path.clone(),
        why: "not a key".into(),
    })?;
    Ok(Sealing {
        keys: Arc::new(keys),
        key: key.to_string(),
    })
}

/// A bucket opened: its objects, keys, manifest and the manifest's tag.
pub(crate) type Opened = (Arc<dyn Objects>, Option<Sealing>, Manifest, Tag);

/// The bucket of `spec`, its keys (unwrapped with `password`) and its
/// manifest.
pub(crate) fn open_bucket(spec: &RemoteSpec, password: Option<&[u8]>) -> Result<Opened> {
    let objects = connect(spec)?;
    let Some((e, _)) = read_envelope(&*objects)? else {
        // A URL naming no store is a usage error, as a directory that is
        // not one (exit 2; it was 4).
        return Err(StoreError::NotAStore {
            path: spec.url.clone().into(),
            why: "no manifest in the bucket".into(),
        });
    };
    let sealing = match (&e.key, password) {
        (Some(key), Some(pw)) => Some(open_key(&*objects, key, pw)?),
        (Some(_), None) => return Err(StoreError::PasswordNeeded),
        (None, Some(_)) => return Err(StoreError::NotEncrypted),
        (None, None) => None,
    };
    let (m, tag) = read_manifest(&*objects, sealing.as_ref())?
        .ok_or_else(|| remote_err("the manifest vanished: try again"))?;
    Ok((objects, sealing, m, tag))
}

/// Makes `dir` a new cache holding the state manifest `m` names: its
/// database, the key, and `store.json` with `remote` (the key object
/// named). The fingerprint index is rebuilt at the first open.
fn build_cache(
    dir: &Path,
    objects: &dyn Objects,
    m: &Manifest,
    sealing: Option<&Sealing>,
    remote: RemoteSpec,
) -> Result<()> {
    crate::store::make_store_dir(dir)?;
    let cache = dir.join(CACHE_DIR);
    std::fs::create_dir_all(&cache).map_err(StoreError::io(&cache))?;
    let image = cache.join("image.db");
    rebuild_image(objects, m, &image, sealing)?;
    let meta = dir.join("meta.sqlite");
    std::fs::copy(&image, &meta).map_err(StoreError::io(&meta))?;
    if !remote.read_only {
        let db = rusqlite::Connection::open(&meta)?;
        // Every indexed row goes into the new fingerprint index at open.
        // A follower never writes: it needs no index (its W is the
        // writer's, so its open replays nearly nothing).
        crate::index::reset_watermark(&db)?;
        set_container_floor(&db, objects)?;
    }
    if let Some(s) = sealing {
        save_local_key(dir, &s.keys)?;
    }
    let remote = RemoteSpec {
        key: sealing.map(|s| s.key.clone()),
        ..remote
    };
    let cfg = StoreConfig {
        remote: Some(remote),
        ..m.config.clone()
    };
    crate::store::write_config(dir, &cfg)
}

/// Container ids a cache taking a store over leaves to the cache it takes
/// it from: that one may have uploaded containers after its last push
/// that a listing misses (listings are never trusted complete), and an
/// id used twice made this cache's upload fail for ever ("the bucket
/// holds a different object under this container's key").
const TAKEOVER_GAP: u64 = 1 << 20;

/// Records in `db` the first container id this new cache may use: past
/// every id its metadata and the bucket's listing know, by
/// [`TAKEOVER_GAP`] (read by the store's `first_free_id`).
fn set_container_floor(db: &rusqlite::Connection, objects: &dyn Objects) -> Result<()> {
    let known: u64 = db.query_row("SELECT COALESCE(MAX(id), 0) FROM containers", [], |r| {
        r.get(0)
    })?;
    let listed = (objects.list("data")?.iter())
        .filter_map(|l| crate::remote::id_of(&l.key))
        .max()
        .unwrap_or(0);
    db.execute(
        crate::meta::SET_META,
        rusqlite::params![
            CONTAINER_FLOOR,
            (known.max(listed) + TAKEOVER_GAP).to_string()
        ],
    )?;
    Ok(())
}

/// The `meta` key of [`set_container_floor`].
pub(crate) const CONTAINER_FLOOR: &str = "container_floor";

/// Makes `dir` a cache of the store in the bucket `spec` names, from the
/// bucket alone ([`build_cache`]), the key unwrapped with `password` (an
/// encrypted store). The manifest is then swapped to name this cache as
/// its writer: a cache left on another machine can no longer push.
///
/// Refused while another cache holds the lease, unless `force` (the user
/// knows its machine is gone): the new cache takes the lease.
pub fn recover(
    dir: &Path,
    spec: &RemoteSpec,
    password: Option<&[u8]>,
    force: bool,
) -> Result<Manifest> {
    let (objects, sealing, m, tag) = open_bucket(spec, password)?;
    // DIR checked before the lease is taken: a recover refused for its
    // directory left a lease no cache held (the writer refused for two
    // minutes, or with --force fenced for nothing).
    crate::store::check_store_dir(dir)?;
    let writer = crate::mirror::random_hex();
    let lease = crate::lease::acquire(&*objects, &writer, crate::lease::TTL_MIN, force)?;
    let remote = RemoteSpec {
        read_only: false,
        ..spec.clone()
    };
    if let Err(e) = build_cache(dir, &*objects, &m, sealing.as_ref(), remote) {
        crate::lease::release(&*objects, &writer, &lease);
        return Err(e);
    }
    let mut next = m.clone();
    next.generation += 1;
    crate::mirror::save_writer(dir, &writer)?;
    next.writer = writer;
    next.time_ns = crate::store::precise_now();
    let bytes = encode_manifest(&next, sealing.as_ref());
    objects
        .swap_settled(MANIFEST, bytes.into(), Some(&tag))
        .map_err(|e| match e {
            ObjectError::Conflict { .. } => {
                remote_err("the bucket's manifest changed while recovering: try again")
            }
            e => e.into(),
        })?;
    Ok(next)
}

/// Makes `dir` a read-only cache that follows the store in the bucket:
/// no lease, no writer; opened, it serves the manifest's state and
/// moves to each new one ([`crate::Store::follow_remote`]).
pub fn follow(dir: &Path, spec: &RemoteSpec, password: Option<&[u8]>) -> Result<Manifest> {
    let (objects, sealing, m, _) = open_bucket(spec, password)?;
    let remote = RemoteSpec {
        read_only: true,
        ..spec.clone()
    };
    build_cache(dir, &*objects, &m, sealing.as_ref(), remote)?;
    Ok(m)
}

/// Writes the image a manifest names into `path`, checking its hash.
pub(crate) fn rebuild_image(
    objects: &dyn Objects,
    m: &Manifest,
    path: &Path,
    sealing: Option<&Sealing>,
) -> Result<()> {
    let f = std::fs::File::create(path).map_err(StoreError::io(path))?;
    extend_image(objects, m, 0, path, sealing)?;
    f.sync_all().map_err(StoreError::io(path))
}

/// Applies the segments of manifest `m` from index `from` on to the image
/// in `path` (the image of its first `from` segments), then checks that
/// the result is the image `m` names.
pub(crate) fn extend_image(
    objects: &dyn Objects,
    m: &Manifest,
    from: usize,
    path: &Path,
    sealing: Option<&Sealing>,
) -> Result<()> {
    let f = std::fs::File::options()
        .read(true)
        .write(true)
        .open(path)
        .map_err(StoreError::io(path))?;
    let mut said = None;
    for s in &m.segments[from..] {
        let (bytes, _) = objects.get(&s.key)?;
        let bytes = match sealing {
            Some(k) => k.open(&s.key, &bytes)?,
            None => bytes.to_vec(),
        };
        said = Some(crate::pages::apply(&f, path, &bytes)?);
    }
    let (_, whole) = crate::pages::hashes(path, m.page_size)?;
    if whole != m.image || said.is_some_and(|s| s != m.image) {
        return Err(remote_err(format!(
            "the metadata the manifest names (generation {}) does not rebuild its image",
            m.generation
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cache's key file keeps the cipher; one written before ciphers
    /// were named (hex alone) is an XChaCha20-Poly1305 store's.
    #[test]
    fn the_local_key_file_names_its_cipher() {
        for cipher in Cipher::ALL {
            let k = Keys::from_master([7; 64], cipher);
            let back = parse_local_key(&local_key_text(&k)).unwrap();
            assert_eq!((back.cipher(), back.master()), (cipher, &[7; 64]));
        }
        let old = parse_local_key(&format!("{}\n", hex::encode([7u8; 64]))).unwrap();
        assert_eq!(old.cipher(), Cipher::XChaCha20Poly1305);
        assert!(parse_local_key("rot13:00").is_none());
        assert!(parse_local_key("abc").is_none());
    }
}
