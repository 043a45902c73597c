//! Chunk containers: append-only, write-once files of chunk records, behind
//! the [`ContainerStore`] trait so that another backend (an object store)
//! can hold them. The record format is in ARCHITECTURE.md.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::config::{Compress, Packing, AUTO_WORTH_PERCENT};
use crate::error::{Result, StoreError};
use crate::seal::{Keys, OVERHEAD};

/// Magic at the start of every container.
pub const CONTAINER_MAGIC: &[u8; 8] = b"OCCONT01";
/// Bytes before the first record.
pub const CONTAINER_HEADER: u64 = 16;
/// Bytes of a record header.
pub const RECORD_HEADER: usize = 48;

/// A chunk's identity: BLAKE3-256 of its raw bytes.
pub type Hash = [u8; 32];

/// How a payload is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Raw = 0,
    Zstd = 1,
    Lz4 = 2,
}

/// A record ready to append: header and payload in one buffer.
pub struct Encoded {
    pub bytes: Vec<u8>,
    pub raw_len: u32,
}

/// Compresses `raw` (kept raw when that does not shrink it), seals it
/// with `keys` when given, and frames it.
pub fn encode(
    hash: &Hash,
    raw: &[u8],
    packing: impl Into<Packing>,
    keys: Option<&Keys>,
) -> Encoded {
    encode_flagged(hash, raw, packing.into(), keys, 0)
}

/// Codec-byte flag of a pack: the decoded payload is several chunks one
/// after another, each located by its row (`chunks.inner`, its
/// length); the header's id is the fingerprint of the whole. A pack
/// holds at least two chunks.
pub const PACK: u8 = 0x40;

/// [`encode`] for a pack: `raw` is its chunks one after another, `id`
/// the fingerprint of `raw`.
pub fn encode_pack(id: &Hash, raw: &[u8], packing: Packing, keys: Option<&Keys>) -> Encoded {
    encode_flagged(id, raw, packing, keys, PACK)
}

/// Whether a checked record is a pack.
pub fn is_pack(rec: &[u8]) -> bool {
    rec.len() > 40 && rec[40] & PACK != 0
}

fn encode_flagged(
    hash: &Hash,
    raw: &[u8],
    packing: Packing,
    keys: Option<&Keys>,
    flags: u8,
) -> Encoded {
    let packed = match packing.compress {
        Compress::Zstd => zstd_compress(raw, packing.zstd_level)
            .ok()
            .map(|p| (Codec::Zstd, p)),
        Compress::Lz4 => Some((Codec::Lz4, lz4_flex::block::compress(raw))),
        Compress::Auto => auto(raw, packing.zstd_level),
        Compress::None => None,
    };
    let (codec, payload): (Codec, &[u8]) = match &packed {
        Some((c, p)) if p.len() < raw.len() => (*c, p),
        _ => (Codec::Raw, raw),
    };
    Encoded {
        bytes: frame(hash, raw.len() as u32, codec as u8 | flags, payload, keys),
        raw_len: raw.len() as u32,
    }
}

/// Codec-byte flag of a sealed record: its payload is the encoded
/// payload sealed ([`crate::seal`]), bound to the header bytes its
/// cipher names ([`record_aad`]). The CRC covers the sealed bytes, so
/// damage is found without the key too. In an encrypted store every
/// record is sealed.
const SEALED: u8 = 0x80;

/// The header bytes a sealed record's AEAD binds under `keys`: 0-35 (id,
/// raw length) or, since [`crate::seal::Cipher::Aes256GcmV2`], 0-43 (all
/// but the CRC, the codec byte among them).
fn record_aad<'r>(header: &'r [u8], keys: &Keys) -> &'r [u8] {
    &header[..keys.cipher().record_aad_len()]
}

/// A record: header (id, raw length, stored length, codec byte, CRC of
/// header and payload) and payload, sealed with `keys` when given. The
/// payload is copied once, into its place.
fn frame(hash: &Hash, raw_len: u32, codec: u8, payload: &[u8], keys: Option<&Keys>) -> Vec<u8> {
    let (stored, flag) = match keys {
        Some(_) => (payload.len() + OVERHEAD, SEALED),
        None => (payload.len(), 0),
    };
    let mut bytes = Vec::with_capacity(RECORD_HEADER + stored);
    bytes.extend_from_slice(hash);
    bytes.extend_from_slice(&raw_len.to_le_bytes());
    bytes.extend_from_slice(&(stored as u32).to_le_bytes());
    bytes.extend_from_slice(&[codec | flag, 0, 0, 0, 0, 0, 0, 0]);
    match keys {
        Some(k) => {
            let header: [u8; 44] = bytes[..44].try_into().unwrap();
            k.seal_into(record_aad(&header, k), payload, &mut bytes);
        }
        None => bytes.extend_from_slice(payload),
    }
    debug_assert_eq!(bytes.len(), RECORD_HEADER + stored);
    set_crc(&mut bytes);
    bytes
}

/// A record's CRC: over its header's first 44 bytes and its payload.
fn record_crc(head: &[u8], payload: &[u8]) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head[..44]);
    crc.update(payload);
    crc.finalize()
}

/// Writes record `rec`'s CRC into its header (tests use it to forge
/// records a bucket's owner could make).
pub(crate) fn set_crc(rec: &mut [u8]) {
    let crc = record_crc(rec, &rec[RECORD_HEADER..]).to_le_bytes();
    rec[44..RECORD_HEADER].copy_from_slice(&crc);
}

/// The codec and encoded payload of a checked record: a sealed one
/// opened with `keys`.
fn unseal<'a>(
    rec: &[u8],
    codec: u8,
    payload: &'a [u8],
    keys: Option<&Keys>,
    (container, offset): (u64, u64),
) -> Result<(u8, std::borrow::Cow<'a, [u8]>)> {
    let bad = |why| damaged(container, offset, why);
    let keys = match (codec & SEALED != 0, keys) {
        (false, None) => return Ok((codec, payload.into())),
        (false, Some(_)) => return Err(bad("a record not sealed, in an encrypted store")),
        (true, None) => return Err(bad("a sealed record and no key")),
        (true, Some(k)) => k,
    };
    let open = keys
        .open(record_aad(rec, keys), payload)
        .ok_or_else(|| bad("a sealed record that does not open"))?;
    Ok((codec & !SEALED, open.into()))
}

/// A sealed record whose codec its AEAD does not bind (ciphers before
/// [`crate::seal::Cipher::Aes256GcmV2`]) and whose codec is not raw:
/// its decoded bytes must have the record's id, or a codec byte changed
/// with its CRC could decode the opened bytes to others.
fn vouch(
    rec: &[u8],
    raw: &[u8],
    keys: Option<&Keys>,
    (container, offset): (u64, u64),
) -> Result<()> {
    let Some(k) = keys else { return Ok(()) };
    if k.cipher().binds_header() || rec[40] & 0x3f == Codec::Raw as u8 {
        return Ok(());
    }
    if k.fingerprint(raw)[..] != rec[..32] {
        return Err(damaged(
            container,
            offset,
            "decoded bytes that are not the record's",
        ));
    }
    Ok(())
}

thread_local! {
    /// This thread's zstd compression context and its level, reused from
    /// chunk to chunk: a new context per chunk cost 14 of a 64 KiB chunk's
    /// 72 us and 8 of a 4 KiB chunk's 21 (level 3, text).
    static ZSTD: RefCell<Option<(zstd::bulk::Compressor<'static>, i32)>> =
        const { RefCell::new(None) };
    /// This thread's zstd decompression context (a new one per chunk cost
    /// 8 of 26 us at 64 KiB, 7 of 12 us at 4 KiB).
    static UNZSTD: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// zstd at `level` with this thread's context, its level set anew when
/// it differs (a flush alternates packs at their level and larger chunks
/// at the store's). A context that failed is dropped, not reused.
fn zstd_compress(raw: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    ZSTD.with(|cell| {
        let mut c = match cell.borrow_mut().take() {
            Some((c, l)) if l == level => c,
            Some((mut c, _)) => {
                c.set_compression_level(level)?;
                c
            }
            None => zstd::bulk::Compressor::new(level)?,
        };
        let out = c.compress(raw)?;
        *cell.borrow_mut() = Some((c, level));
        Ok(out)
    })
}

/// Runs `f` with this thread's zstd decompression context. A context that
/// failed (a damaged payload) is dropped, not reused.
fn with_unzstd<T>(
    f: impl FnOnce(&mut zstd::bulk::Decompressor<'static>) -> std::io::Result<T>,
) -> std::io::Result<T> {
    UNZSTD.with(|cell| {
        let mut d = match cell.borrow_mut().take() {
            Some(d) => d,
            None => zstd::bulk::Decompressor::new()?,
        };
        let out = f(&mut d)?;
        *cell.borrow_mut() = Some(d);
        Ok(out)
    })
}

/// Bytes of a chunk `auto` tests with lz4: four slices of a quarter of
/// this, spread over the chunk (the whole chunk when it is no larger).
const AUTO_SAMPLE: usize = 8192;

/// What `auto` tests: the chunk itself when it is at most
/// [`AUTO_SAMPLE`] bytes, else slices at 0, 1/4, 1/2 and 3/4 of it.
fn auto_sample(raw: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if raw.len() <= AUTO_SAMPLE {
        return raw.into();
    }
    let slice = AUTO_SAMPLE / 4;
    let mut sample = Vec::with_capacity(AUTO_SAMPLE);
    for i in 0..4 {
        sample.extend_from_slice(&raw[i * raw.len() / 4..][..slice]);
    }
    sample.into()
}

/// `auto`: lz4 on a sample of the chunk decides. A sample lz4 cannot
/// shrink leaves the chunk raw (`None`) and one it barely shrinks (to more
/// than [`AUTO_WORTH_PERCENT`]) has the chunk compressed by lz4; otherwise
/// the chunk is compressed by zstd at `level` (a chunk tested whole keeps
/// the smaller of the two). Neither codec runs over a chunk that will
/// be stored raw or by the other.
fn auto(raw: &[u8], level: i32) -> Option<(Codec, Vec<u8>)> {
    let sample = auto_sample(raw);
    let whole = sample.len() == raw.len();
    let test = lz4_flex::block::compress(&sample);
    if test.len() >= sample.len() {
        return None;
    }
    let lz4 = || (Codec::Lz4, lz4_flex::block::compress(raw));
    if test.len() * 100 > sample.len() * AUTO_WORTH_PERCENT {
        return Some(if whole { (Codec::Lz4, test) } else { lz4() });
    }
    let fallback = whole.then_some((Codec::Lz4, test));
    match zstd_compress(raw, level) {
        Ok(z) if fallback.as_ref().is_none_or(|(_, l)| z.len() < l.len()) => Some((Codec::Zstd, z)),
        _ => fallback,
    }
}

/// Checks a record's framing and checksum: (raw length, codec byte,
/// payload). Any mismatch is an error. A sealed record read with keys
/// whose AEAD binds all the CRC covers is left to the AEAD.
fn check<'r>(
    rec: &'r [u8],
    container: u64,
    offset: u64,
    keys: Option<&Keys>,
) -> Result<(usize, u8, &'r [u8])> {
    if rec.len() < RECORD_HEADER {
        return Err(damaged(container, offset, "short record"));
    }
    let u32_at = |i: usize| u32::from_le_bytes(rec[i..i + 4].try_into().unwrap());
    let (raw_len, stored_len) = (u32_at(32) as usize, u32_at(36) as usize);
    if rec.len() != RECORD_HEADER + stored_len {
        return Err(damaged(container, offset, "length mismatch"));
    }
    let payload = &rec[RECORD_HEADER..];
    let sealed_whole = rec[40] & SEALED != 0 && keys.is_some_and(|k| k.cipher().binds_header());
    if !sealed_whole && record_crc(rec, payload) != u32_at(44) {
        return Err(damaged(container, offset, "checksum mismatch"));
    }
    Ok((raw_len, rec[40], payload))
}

/// The error for a damaged record at `offset` of `container`.
pub(crate) fn damaged(container: u64, offset: u64, why: &str) -> StoreError {
    StoreError::Damaged {
        container,
        offset,
        why: why.to_string(),
    }
}

/// Checks and decodes one record (header and payload; a pack's whole).
/// Any mismatch is an error: a damaged record never decodes to wrong bytes.
pub fn decode(
    rec: &[u8],
    container: u64,
    offset: u64,
    keys: Option<&Keys>,
) -> Result<(Hash, Vec<u8>)> {
    let (raw_len, codec, payload) = check(rec, container, offset, keys)?;
    let (codec, payload) = unseal(rec, codec, payload, keys, (container, offset))?;
    let bad = |why| damaged(container, offset, why);
    let raw = match codec & !PACK {
        // A sealed record's opened bytes are kept, not copied again.
        0 => payload.into_owned(),
        1 => with_unzstd(|d| d.decompress(&payload, raw_len)).map_err(|_| bad("zstd"))?,
        2 => lz4_flex::block::decompress(&payload, raw_len).map_err(|_| bad("lz4"))?,
        _ => return Err(bad("unknown codec")),
    };
    if raw.len() != raw_len {
        return Err(bad("decoded length"));
    }
    vouch(rec, &raw, keys, (container, offset))?;
    Ok((rec[..32].try_into().unwrap(), raw))
}

/// Checks a raw record read in two parts, `header` (its
/// [`RECORD_HEADER`] bytes) and `payload`, the bytes the index expects:
/// the header must say raw, with this length, and its CRC must match.
pub fn check_raw(header: &[u8], payload: &[u8], container: u64, offset: u64) -> Result<()> {
    let bad = |why| damaged(container, offset, why);
    if header.len() != RECORD_HEADER {
        return Err(bad("short record"));
    }
    let u32_at = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().unwrap());
    if u32_at(32) as usize != payload.len() || u32_at(36) as usize != payload.len() {
        return Err(bad("length differs from the index"));
    }
    if record_crc(header, payload) != u32_at(44) {
        return Err(bad("checksum mismatch"));
    }
    if header[40] != Codec::Raw as u8 {
        return Err(bad("length differs from the index"));
    }
    Ok(())
}

/// [`decode`] straight into `out`, whose length is the raw length the
/// caller expects (from the index): no allocation, and a raw record costs
/// one copy. Every check of [`decode`] applies; a record of another raw
/// length is damaged. On error `out` holds unspecified bytes.
pub fn decode_into(
    rec: &[u8],
    container: u64,
    offset: u64,
    out: &mut [u8],
    keys: Option<&Keys>,
) -> Result<()> {
    let (raw_len, codec, payload) = check(rec, container, offset, keys)?;
    let bad = |why| damaged(container, offset, why);
    if raw_len != out.len() || codec & PACK != 0 {
        return Err(bad("length differs from the index"));
    }
    if let (SEALED, Some(k)) = (codec, keys) {
        // Sealed (flag) and raw (codec 0): opened straight into `out`, no copy between.
        let opened = k.open_into(record_aad(rec, k), payload, out);
        return opened
            .then_some(())
            .ok_or_else(|| bad("a sealed record that does not open"));
    }
    let (codec, payload) = unseal(rec, codec, payload, keys, (container, offset))?;
    let payload = &payload[..];
    let n = match codec {
        0 if payload.len() == raw_len => {
            out.copy_from_slice(payload);
            raw_len
        }
        0 => return Err(bad("decoded length")),
        1 => {
            with_unzstd(|d| d.decompress_to_buffer(payload, &mut *out)).map_err(|_| bad("zstd"))?
        }
        2 => lz4_flex::block::decompress_into(payload, out).map_err(|_| bad("lz4"))?,
        _ => return Err(bad("unknown codec")),
    };
    if n != raw_len {
        return Err(bad("decoded length"));
    }
    vouch(rec, out, keys, (container, offset))
}

/// Where container files live. Containers are never overwritten: a store
/// appends to one open container, seals it, and deletes whole containers.
pub trait ContainerStore: Send + Sync {
    /// Creates container `id` with its header; fails if it exists.
    fn create(&self, id: u64) -> Result<()>;
    /// Appends bytes at the end of container `id`.
    fn append(&self, id: u64, bytes: &[u8]) -> Result<()>;
    /// Reads `len` bytes at `offset`.
    fn read(&self, id: u64, offset: u64, len: usize) -> Result<Vec<u8>>;
    /// Reads the bytes at `offset` into `bufs` in turn (as many bytes as
    /// they hold). The default reads with [`ContainerStore::read`] and
    /// copies; a backend that can scatter (`preadv`) saves the copy.
    fn read_into(&self, id: u64, offset: u64, bufs: &mut [&mut [u8]]) -> Result<()> {
        scatter(|len| self.read(id, offset, len), bufs)
    }
    /// Calls `f` with the `len` bytes at `offset`. The default reads them
    /// into a buffer first ([`ContainerStore::read_into`]); a backend that
    /// holds them in memory already (a remote store's fetched containers)
    /// lends them where they are, with no copy.
    fn with_bytes(
        &self,
        id: u64,
        offset: u64,
        len: usize,
        f: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let mut v = vec![0u8; len];
        self.read_into(id, offset, &mut [&mut v])?;
        f(&v)
    }
    /// Makes everything appended to `id` durable.
    fn sync(&self, id: u64) -> Result<()>;
    /// Starts writing what was appended to `id` to the device without
    /// waiting for it: a hint (errors are left to [`ContainerStore::sync`],
    /// which still makes the bytes durable). The store gives it when it
    /// seals a container and before a commit's syncs, so that the device
    /// works while writes go on and the syncs find their bytes written.
    fn start_sync(&self, _id: u64) {}
    /// Lets the page cache drop container `id`'s pages once they are
    /// written: a hint, given for sealed containers after their sync. The
    /// bytes a program reads back are cached by the kernel on the mount's
    /// side already; a second copy of them here costs fresh memory at
    /// every write.
    fn drop_cache(&self, _id: u64) {}
    /// Container `id` is sealed at `len` bytes (never appended to again):
    /// a backend that keeps sealed containers elsewhere (an object store,
    /// [`crate::remote::Tiered`]) starts moving it there. A hint: it
    /// returns at once and reports nothing.
    fn sealed(&self, _id: u64, _len: u64) {}
    /// Called by a write before it buffers more, with no lock held: a
    /// backend whose sealed containers wait to move elsewhere may hold the
    /// writer while too many wait (see [`crate::remote::Tiered`]).
    fn admit(&self) {}
    /// Whether [`ContainerStore::admit`] would return at once now.
    fn admits_now(&self) -> bool {
        true
    }
    /// Every sealed container (id, length), at open: a remote backend
    /// moves those not yet elsewhere (a mount stopped before their
    /// upload).
    fn resume(&self, sealed: Vec<(u64, u64)>) -> Result<()> {
        for (id, len) in sealed {
            self.sealed(id, len);
        }
        Ok(())
    }
    /// Whether sealed containers go elsewhere ([`ContainerStore::sealed`]
    /// does something), so that opening the store hands it every sealed
    /// container that has a local copy.
    fn remote(&self) -> bool {
        false
    }
    /// A read found damage in container `id`: a backend that holds the
    /// container elsewhere too (a remote store's bucket) drops its local
    /// copy, so that the next read fetches the container again; whether
    /// it did. A copy that is the only one is never dropped.
    fn drop_damaged_copy(&self, _id: u64) -> bool {
        false
    }
    /// The disk is short of room: a backend that keeps copies of
    /// containers held elsewhere too (a remote store's cache) deletes the
    /// least recently used of them until `bytes` are freed; the bytes it
    /// freed. A copy that is the only one is never deleted.
    fn shed(&self, _bytes: u64) -> u64 {
        0
    }
    /// Current length of container `id` (None if it does not exist).
    fn len(&self, id: u64) -> Result<Option<u64>>;
    /// Deletes a whole container.
    fn delete(&self, id: u64) -> Result<()>;
    /// Ids of all containers.
    fn list(&self) -> Result<Vec<u64>>;
}

/// Reads as many bytes as `bufs` hold with `read`, then copies them into
/// `bufs` in turn.
pub(crate) fn scatter(
    read: impl FnOnce(usize) -> Result<Vec<u8>>,
    bufs: &mut [&mut [u8]],
) -> Result<()> {
    let data = read(bufs.iter().map(|b| b.len()).sum())?;
    scatter_slice(&data, bufs);
    Ok(())
}

/// Copies `data`, exactly as long as `bufs` together, into `bufs` in turn.
pub(crate) fn scatter_slice(data: &[u8], bufs: &mut [&mut [u8]]) {
    let mut at = 0;
    for b in bufs.iter_mut() {
        b.copy_from_slice(&data[at..at + b.len()]);
        at += b.len();
    }
}

/// Reads of at least this many bytes are let go from the page cache once
/// read (see [`LocalDir::read_into`]).
const STREAM_READ: u64 = 256 << 10;

/// Containers as files under a local directory.
///
/// Invariant: a container is durable, name included, once [`ContainerStore::sync`]
/// returned: its directory is synced then, not at `create` (ext4 would make
/// a directory sync at every `create` wait for the writeback of every
/// container written since; after the container's own `fdatasync` it has
/// nothing left to wait for).
pub struct LocalDir {
    root: PathBuf,
    open: Mutex<HashMap<u64, Arc<File>>>,
    /// Containers created whose directory entry is not yet synced.
    unnamed: Mutex<std::collections::HashSet<u64>>,
}

impl LocalDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        LocalDir {
            root: root.into(),
            open: Mutex::new(HashMap::new()),
            unnamed: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// The directory the containers are in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, id: u64) -> PathBuf {
        self.root
            .join(format!("{:02x}", id & 0xff))
            .join(format!("{id:016x}.occ"))
    }

    /// Puts a whole sealed container read from elsewhere (a bucket) in
    /// place: written beside, synced, then renamed, so that a crash never
    /// leaves part of one under its name.
    pub fn install(&self, id: u64, bytes: &[u8]) -> Result<()> {
        let path = self.path(id);
        let dir = path.parent().unwrap();
        std::fs::create_dir_all(dir).map_err(StoreError::io(dir))?;
        let part = path.with_extension("occ.part");
        // Around the page cache: a cache copy is read, if ever, later.
        let write = || -> std::io::Result<()> {
            crate::direct::write_synced(&part, bytes)?;
            std::fs::rename(&part, &path)
        };
        if let Err(e) = write() {
            // A full disk: what was written of the part would stay,
            // unlisted, never evicted.
            let _ = std::fs::remove_file(&part);
            return Err(StoreError::io(&path)(e));
        }
        // A file opened under the name before is not the container now.
        self.open.lock().unwrap().remove(&id);
        Ok(())
    }

    fn file(&self, id: u64) -> Result<Arc<File>> {
        let mut open = self.open.lock().unwrap();
        if let Some(f) = open.get(&id) {
            return Ok(f.clone());
        }
        if open.len() > 256 {
            open.clear();
        }
        let path = self.path(id);
        let f = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&path)
            .map_err(StoreError::io(&path))?;
        check_header(&f, id, &path)?;
        let f = Arc::new(f);
        open.insert(id, f.clone());
        Ok(f)
    }
}

/// Checks that `f` (at `path`) begins with container `id`'s header: a
/// file copied or moved over another's name holds records the store would
/// read as this container's (each passes its own checksum): wrong bytes,
/// not `EIO`.
fn check_header(f: &File, id: u64, path: &Path) -> Result<()> {
    let mut head = [0u8; CONTAINER_HEADER as usize];
    let n = rustix::io::pread(f, &mut head, 0).map_err(|e| StoreError::io(path)(e.into()))?;
    if n < head.len() || &head[..8] != CONTAINER_MAGIC {
        return Err(damaged(id, 0, "no container header"));
    }
    if head[8..] != id.to_le_bytes() {
        return Err(damaged(id, 0, "the file holds another container's header"));
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(StoreError::io(dir))
}

impl LocalDir {
    /// Appends `len` bytes of container `id` at `offset` to `buf`, read
    /// into its spare room (not zeroed first; a caller that reuses `buf`
    /// saves the fresh pages too). A read into a roomier buffer may take
    /// more; what lies past `len` is cut off.
    pub fn read_append(&self, id: u64, offset: u64, len: usize, buf: &mut Vec<u8>) -> Result<()> {
        let f = self.file(id)?;
        let start = buf.len();
        buf.reserve(len);
        while buf.len() < start + len {
            let at = offset + (buf.len() - start) as u64;
            match rustix::io::pread(&*f, rustix::buffer::spare_capacity(&mut *buf), at) {
                Ok(0) => {
                    return Err(damaged(id, offset, "container shorter than the record"));
                }
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(StoreError::io(self.path(id))(e.into())),
            }
        }
        buf.truncate(start + len);
        Ok(())
    }
}

impl ContainerStore for LocalDir {
    fn create(&self, id: u64) -> Result<()> {
        let path = self.path(id);
        let dir = path.parent().unwrap();
        if !dir.is_dir() {
            std::fs::create_dir_all(dir).map_err(StoreError::io(dir))?;
            sync_dir(&self.root)?;
        }
        let mut f = OpenOptions::new()
            .read(true)
            .append(true)
            .create_new(true)
            .open(&path)
            .map_err(StoreError::io(&path))?;
        let mut header = CONTAINER_MAGIC.to_vec();
        header.extend_from_slice(&id.to_le_bytes());
        f.write_all(&header).map_err(StoreError::io(&path))?;
        self.unnamed.lock().unwrap().insert(id);
        self.open.lock().unwrap().insert(id, Arc::new(f));
        Ok(())
    }

    fn append(&self, id: u64, bytes: &[u8]) -> Result<()> {
        let f = self.file(id)?;
        (&*f)
            .write_all(bytes)
            .map_err(StoreError::io(self.path(id)))
    }

    /// Reads into a buffer that is not zeroed first (reads of up to 8 MiB
    /// are the read path's main cost besides the copies).
    fn read(&self, id: u64, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut buf = Vec::with_capacity(len);
        self.read_append(id, offset, len, &mut buf)?;
        Ok(buf)
    }

    /// One `preadv` (more only after a short read): payloads land in
    /// their final buffers.
    fn read_into(&self, id: u64, offset: u64, bufs: &mut [&mut [u8]]) -> Result<()> {
        let f = self.file(id)?;
        let mut slices: Vec<std::io::IoSliceMut<'_>> = bufs
            .iter_mut()
            .map(|b| std::io::IoSliceMut::new(b))
            .collect();
        let mut rest = &mut slices[..];
        let mut at = offset;
        while rest.iter().any(|s| !s.is_empty()) {
            match rustix::io::preadv(&*f, rest, at) {
                Ok(0) => return Err(damaged(id, offset, "container shorter than the record")),
                Ok(n) => {
                    std::io::IoSliceMut::advance_slices(&mut rest, n);
                    at += n as u64;
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(StoreError::io(self.path(id))(e.into())),
            }
        }
        // A long read is a file read in order: the kernel caches its
        // bytes on the mount's side, and the container's copy would only
        // cost fresh memory (see `drop_cache`). Short reads stay cached.
        if at - offset >= STREAM_READ {
            let _ = onecopy_ioctl::fs::fadvise_range(
                std::os::fd::AsFd::as_fd(&*f),
                offset,
                at - offset,
                onecopy_ioctl::fs::Advice::DontNeed,
            );
        }
        Ok(())
    }

    /// `fdatasync`, then the directory's `fsync` if the container is new.
    fn sync(&self, id: u64) -> Result<()> {
        self.file(id)?
            .sync_data()
            .map_err(StoreError::io(self.path(id)))?;
        if self.unnamed.lock().unwrap().remove(&id) {
            let path = self.path(id);
            sync_dir(path.parent().unwrap()).inspect_err(|_| {
                self.unnamed.lock().unwrap().insert(id);
            })?;
        }
        Ok(())
    }

    /// `sync_file_range(SYNC_FILE_RANGE_WRITE)` over the whole file.
    fn start_sync(&self, id: u64) {
        if let Ok(f) = self.file(id) {
            let _ = onecopy_ioctl::fs::start_writeback(std::os::fd::AsFd::as_fd(&*f));
        }
    }

    /// `posix_fadvise(POSIX_FADV_DONTNEED)` over the whole file.
    fn drop_cache(&self, id: u64) {
        if let Ok(f) = self.file(id) {
            let _ = onecopy_ioctl::fs::fadvise(
                std::os::fd::AsFd::as_fd(&*f),
                onecopy_ioctl::fs::Advice::DontNeed,
            );
        }
    }

    fn len(&self, id: u64) -> Result<Option<u64>> {
        match std::fs::metadata(self.path(id)) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io(self.path(id))(e)),
        }
    }

    /// The open-file table stays locked until the name is gone: a reader
    /// opening it meanwhile would keep the deleted file as the container.
    fn delete(&self, id: u64) -> Result<()> {
        let mut open = self.open.lock().unwrap();
        open.remove(&id);
        self.unnamed.lock().unwrap().remove(&id);
        let path = self.path(id);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(StoreError::io(path)(e)),
            _ => Ok(()),
        }
    }

    fn list(&self) -> Result<Vec<u64>> {
        let mut ids = Vec::new();
        let Ok(dirs) = std::fs::read_dir(&self.root) else {
            return Ok(ids);
        };
        for d in dirs.flatten() {
            for f in std::fs::read_dir(d.path()).into_iter().flatten().flatten() {
                let name = f.file_name();
                let name = name.to_string_lossy();
                if let Some(hex) = name.strip_suffix(".occ") {
                    if let Ok(id) = u64::from_str_radix(hex, 16) {
                        ids.push(id);
                    }
                }
            }
        }
        ids.sort_unstable();
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_detect_damage() {
        for compress in [
            Compress::Auto,
            Compress::Zstd,
            Compress::Lz4,
            Compress::None,
        ] {
            for raw in [
                vec![7u8; 5000],
                (0..5000u32).map(|i| ((i * 7919) >> 3) as u8).collect(),
            ] {
                let hash = *blake3::hash(&raw).as_bytes();
                let enc = encode(&hash, &raw, compress, None);
                let (h, back) = decode(&enc.bytes, 1, 16, None).unwrap();
                assert_eq!((h, &back), (hash, &raw));
                for i in [0, 33, 40, 47, enc.bytes.len() - 1] {
                    let mut bad = enc.bytes.clone();
                    bad[i] ^= 0x10;
                    assert!(decode(&bad, 1, 16, None).is_err(), "flip at {i} undetected");
                }
                assert!(decode(&enc.bytes[..enc.bytes.len() - 1], 1, 16, None).is_err());
            }
        }
    }

    /// `auto` keeps incompressible chunks raw, leaves the barely
    /// compressible to lz4 (zstd is not tried) and stores compressible
    /// ones as zstd does, never larger than lz4 would.
    #[test]
    fn auto_picks_by_what_lz4_finds() {
        let mut rnd = 0x9e37_79b9_7f4a_7c15u64;
        let mut noise = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    rnd ^= rnd << 13;
                    rnd ^= rnd >> 7;
                    rnd ^= rnd << 17;
                    rnd as u8
                })
                .collect()
        };
        let random = noise(65536);
        // 24 zero bytes in every KiB: lz4 saves about 2% anywhere.
        let barely: Vec<u8> = (0..64)
            .flat_map(|_| {
                let mut k = noise(1000);
                k.extend_from_slice(&[0; 24]);
                k
            })
            .collect();
        let words = ["chunk ", "store ", "index ", "the ", "of ", "dedupe "];
        let text: Vec<u8> = (0..20000usize)
            .flat_map(|i| words[(i * 7 + i / 3) % words.len()].bytes())
            .take(65536)
            .collect();
        let codec = |raw: &[u8], c: Compress| {
            let e = encode(blake3::hash(raw).as_bytes(), raw, c, None);
            assert_eq!(decode(&e.bytes, 1, 0, None).unwrap().1, raw);
            (e.bytes[40], e.bytes.len())
        };
        assert_eq!(codec(&random, Compress::Auto).0, Codec::Raw as u8);
        assert_eq!(codec(&barely, Compress::Auto).0, Codec::Lz4 as u8);
        let (c, auto_len) = codec(&text, Compress::Auto);
        assert_eq!(c, Codec::Zstd as u8);
        assert_eq!(auto_len, codec(&text, Compress::Zstd).1);
        assert!(auto_len < codec(&text, Compress::Lz4).1);
        // Chunks of at most 8 KiB are tested whole, the same way.
        assert_eq!(codec(&random[..8192], Compress::Auto).0, Codec::Raw as u8);
        assert_eq!(codec(&barely[..8192], Compress::Auto).0, Codec::Lz4 as u8);
        assert_eq!(codec(&text[..4096], Compress::Auto).0, Codec::Zstd as u8);
    }

    /// The sample reaches into every quarter of a chunk: text in any one
    /// quarter of noise is found and the chunk compressed; what the
    /// sample misses (a few compressible bytes between its slices) is not.
    #[test]
    fn auto_samples_every_quarter() {
        let mut rnd = 0x2545_f491_4f6c_dd1du64;
        let noise: Vec<u8> = (0..65536)
            .map(|_| {
                rnd ^= rnd << 13;
                rnd ^= rnd >> 7;
                rnd ^= rnd << 17;
                rnd as u8
            })
            .collect();
        for q in 0..4 {
            let mut raw = noise.clone();
            raw[q * 16384..][..16384].fill(b'a');
            let e = encode(blake3::hash(&raw).as_bytes(), &raw, Compress::Auto, None);
            assert_eq!(e.bytes[40], Codec::Zstd as u8, "quarter {q}");
            assert!(e.bytes.len() < 50_000);
        }
        let mut raw = noise.clone();
        raw[4096..8192].fill(0);
        let e = encode(blake3::hash(&raw).as_bytes(), &raw, Compress::Auto, None);
        assert_eq!(e.bytes[40], Codec::Raw as u8);
    }

    /// `decode_into` accepts exactly what `decode` accepts, with the same
    /// bytes, and refuses an output of another length.
    /// A sealed record decodes with its key only, to the same bytes; a
    /// flipped byte anywhere, another key, or no key is damage.
    #[test]
    fn sealed_records_open_with_their_key_only() {
        for cipher in crate::seal::Cipher::ALL {
            sealed_records_open_with_their_key_only_in(cipher);
        }
    }

    fn sealed_records_open_with_their_key_only_in(cipher: crate::seal::Cipher) {
        let keys = Keys::from_master(
            *blake3::hash(b"records")
                .as_bytes()
                .repeat(2)
                .first_chunk()
                .unwrap(),
            cipher,
        );
        let raw = b"some bytes, some bytes, some bytes, some bytes".repeat(50);
        let hash = keys.fingerprint(&raw);
        for compress in [Compress::None, Compress::Zstd, Compress::Lz4] {
            let enc = encode(&hash, &raw, compress, Some(&keys));
            let (h, back) = decode(&enc.bytes, 1, 16, Some(&keys)).unwrap();
            assert_eq!((h, &back[..]), (hash, &raw[..]));
            let mut out = vec![0u8; raw.len()];
            decode_into(&enc.bytes, 1, 16, &mut out, Some(&keys)).unwrap();
            assert_eq!(out, raw);
            let other = Keys::generate();
            for k in [None, Some(&other)] {
                assert!(decode(&enc.bytes, 1, 16, k).is_err());
                assert!(decode_into(&enc.bytes, 1, 16, &mut out, k).is_err());
            }
            for i in (0..enc.bytes.len()).step_by(7) {
                let mut bad = enc.bytes.clone();
                bad[i] ^= 1;
                assert!(decode(&bad, 1, 16, Some(&keys)).is_err(), "flip at {i}");
                let into = decode_into(&bad, 1, 16, &mut out, Some(&keys));
                assert!(into.is_err(), "flip at {i}, decoded into");
            }
            // A flip under a CRC made again: the AEAD alone refuses it.
            let mut forged = enc.bytes.clone();
            forged[RECORD_HEADER + 30] ^= 1;
            set_crc(&mut forged);
            assert!(decode(&forged, 1, 16, Some(&keys)).is_err());
            assert!(decode_into(&forged, 1, 16, &mut out, Some(&keys)).is_err());
            let plain = &raw[..16];
            assert!(
                !enc.bytes.windows(16).any(|w| w == plain),
                "plaintext in a sealed record"
            );
        }
    }

    /// A record sealed with `keys` made again with its codec byte set to
    /// `codec` and a CRC to match, as a bucket's owner could.
    fn recodec(rec: &[u8], codec: u8) -> Vec<u8> {
        let mut forged = rec.to_vec();
        forged[40] = codec;
        set_crc(&mut forged);
        forged
    }

    /// In an encrypted store a record that is not sealed is damage: a
    /// bucket's owner cannot put plain records of their choosing in.
    #[test]
    fn an_unsealed_record_does_not_decode_with_a_key() {
        let raw = b"chosen by whoever writes the bucket".repeat(40);
        for cipher in crate::seal::Cipher::ALL {
            let keys = Keys::from_master([3; 64], cipher);
            for compress in [Compress::None, Compress::Zstd, Compress::Lz4] {
                let plain = encode(&keys.fingerprint(&raw), &raw, compress, None);
                assert!(decode(&plain.bytes, 1, 16, None).is_ok());
                let err = decode(&plain.bytes, 1, 16, Some(&keys)).unwrap_err();
                assert!(err.to_string().contains("not sealed"), "{err}");
                let mut out = vec![0u8; raw.len()];
                assert!(decode_into(&plain.bytes, 1, 16, &mut out, Some(&keys)).is_err());
            }
        }
    }

    /// A sealed raw record whose bytes are also a zstd frame of the same
    /// length (a file a user was given to store) read as zstd after its
    /// codec byte and CRC were changed: never its frame's content. v2
    /// binds the codec byte; older ciphers check the decoded bytes' id.
    #[test]
    fn a_changed_codec_byte_never_decodes_to_other_bytes() {
        let inner = b"what the bucket's owner wants read".repeat(30);
        let mut frame = zstd::bulk::compress(&inner, 3).unwrap();
        let pad = inner.len() - frame.len() - 8;
        frame.extend_from_slice(&0x184D_2A50u32.to_le_bytes()); // a skippable frame
        frame.extend_from_slice(&(pad as u32).to_le_bytes());
        frame.resize(inner.len(), 0xa5);
        assert_eq!(zstd::stream::decode_all(&frame[..]).unwrap(), inner);
        for cipher in crate::seal::Cipher::ALL {
            let keys = Keys::from_master([5; 64], cipher);
            let rec = encode(
                &keys.fingerprint(&frame),
                &frame,
                Compress::None,
                Some(&keys),
            );
            assert_eq!(rec.bytes[40], SEALED | Codec::Raw as u8);
            assert_eq!(decode(&rec.bytes, 1, 16, Some(&keys)).unwrap().1, frame);
            let forged = recodec(&rec.bytes, SEALED | Codec::Zstd as u8);
            let err = decode(&forged, 1, 16, Some(&keys)).unwrap_err();
            assert!(
                matches!(err, StoreError::Damaged { .. }),
                "{cipher:?}: {err}"
            );
            let mut out = vec![0u8; frame.len()];
            let into = decode_into(&forged, 1, 16, &mut out, Some(&keys));
            assert!(into.is_err(), "{cipher:?}: decoded into");
        }
    }

    /// A v2 record read with its key needs no CRC (the AEAD binds every
    /// byte the CRC covers); without the key the CRC still finds damage.
    #[test]
    fn a_v2_record_is_checked_by_its_aead() {
        let keys = Keys::from_master([9; 64], crate::seal::Cipher::Aes256GcmV2);
        let raw = b"v2 ".repeat(3000);
        let mut rec = encode(&keys.fingerprint(&raw), &raw, Compress::Zstd, Some(&keys)).bytes;
        rec[45] ^= 1;
        assert_eq!(decode(&rec, 1, 16, Some(&keys)).unwrap().1, raw);
        assert!(check(&rec, 1, 16, None).is_err());
    }

    #[test]
    fn a_thread_context_changes_level_as_asked() {
        let raw: Vec<u8> = (0..200_000u32)
            .flat_map(|i| (i % 977).to_le_bytes())
            .collect();
        for level in [3, 1, 3, 19, 1] {
            let ours = zstd_compress(&raw, level).unwrap();
            assert_eq!(
                ours,
                zstd::bulk::compress(&raw, level).unwrap(),
                "level {level}"
            );
        }
    }

    #[test]
    fn decode_into_agrees_with_decode() {
        for compress in [
            Compress::Auto,
            Compress::Zstd,
            Compress::Lz4,
            Compress::None,
        ] {
            let raw: Vec<u8> = (0..5000u32).map(|i| ((i * 7919) >> 3) as u8).collect();
            let hash = *blake3::hash(&raw).as_bytes();
            let enc = encode(&hash, &raw, compress, None);
            let mut out = vec![0u8; raw.len()];
            decode_into(&enc.bytes, 1, 16, &mut out, None).unwrap();
            assert_eq!(out, raw);
            for n in [raw.len() - 1, raw.len() + 1] {
                let mut out = vec![0u8; n];
                assert!(decode_into(&enc.bytes, 1, 16, &mut out, None).is_err());
            }
            for i in 0..enc.bytes.len() {
                let mut bad = enc.bytes.clone();
                bad[i] ^= 0x04;
                let mut out = vec![0u8; raw.len()];
                let got = decode_into(&bad, 1, 16, &mut out, None).map(|_| out);
                let want = decode(&bad, 1, 16, None).map(|(_, r)| r);
                assert_eq!(got.is_ok(), want.is_ok(), "flip at {i}");
                assert!(got.is_err(), "flip at {i} undetected");
            }
        }
    }

    /// The thread's reused zstd contexts: a payload zstd refuses (its CRC
    /// made valid, as a bug rather than the disk would) is an error, and
    /// the same thread then still decodes good records and compresses at
    /// another level and back.
    #[test]
    fn zstd_contexts_survive_a_refused_payload_and_a_level_change() {
        let text: Vec<u8> = (0..30000u32)
            .map(|i| b"onecopy "[(i % 8) as usize])
            .collect();
        let hash = *blake3::hash(&text).as_bytes();
        let at = |level| Packing {
            compress: Compress::Zstd,
            zstd_level: level,
        };
        let good = encode(&hash, &text, at(3), None);
        assert_eq!(good.bytes[40], Codec::Zstd as u8);
        let mut bad = good.bytes.clone();
        bad[RECORD_HEADER] ^= 0xff; // the zstd frame's magic number
        set_crc(&mut bad);
        assert!(decode(&bad, 1, 16, None).is_err());
        let mut out = vec![0u8; text.len()];
        assert!(decode_into(&bad, 1, 16, &mut out, None).is_err());
        for level in [3, 19, 1, 3] {
            let e = encode(&hash, &text, at(level), None);
            assert_eq!(
                decode(&e.bytes, 1, 16, None).unwrap().1,
                text,
                "level {level}"
            );
            decode_into(&e.bytes, 1, 16, &mut out, None).unwrap();
            assert_eq!(out, text);
        }
        assert_eq!(encode(&hash, &text, at(3), None).bytes, good.bytes);
    }

    #[test]
    fn incompressible_is_stored_raw() {
        let raw: Vec<u8> = (0..4096)
            .map(|i| blake3::hash(&[i as u8, (i >> 8) as u8]).as_bytes()[0])
            .collect();
        let enc = encode(&[0; 32], &raw, Compress::Zstd, None);
        assert_eq!(enc.bytes[40], Codec::Raw as u8);
    }

    #[test]
    fn local_dir_appends_reads_lists_deletes() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalDir::new(dir.path());
        store.create(5).unwrap();
        assert!(store.create(5).is_err(), "a container is never recreated");
        store.append(5, b"hello").unwrap();
        store.sync(5).unwrap();
        assert_eq!(store.read(5, CONTAINER_HEADER, 5).unwrap(), b"hello");
        store.drop_cache(5);
        assert_eq!(store.read(5, CONTAINER_HEADER, 5).unwrap(), b"hello");
        assert_eq!(store.len(5).unwrap(), Some(CONTAINER_HEADER + 5));
        assert!(store.read(5, CONTAINER_HEADER, 6).is_err());
        // Into a roomier buffer that holds bytes already: exactly the
        // bytes asked for are appended, however much the read took.
        let mut buf = Vec::with_capacity(4096);
        buf.extend_from_slice(b">>");
        store
            .read_append(5, CONTAINER_HEADER + 1, 3, &mut buf)
            .unwrap();
        assert_eq!(buf, b">>ell");
        assert_eq!(store.list().unwrap(), vec![5]);
        store.delete(5).unwrap();
        assert_eq!(store.list().unwrap(), Vec::<u64>::new());
    }

    /// A new container's directory entry is synced by its first sync (the
    /// commit's), not at `create`; a deleted one is forgotten.
    #[test]
    fn local_dir_names_a_container_durably_at_its_first_sync() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalDir::new(dir.path());
        store.create(7).unwrap();
        store.create(8).unwrap();
        assert_eq!(store.unnamed.lock().unwrap().len(), 2);
        store.start_sync(7);
        store.sync(7).unwrap();
        assert!(!store.unnamed.lock().unwrap().contains(&7));
        store.delete(8).unwrap();
        assert!(store.unnamed.lock().unwrap().is_empty());
        store.sync(7).unwrap();
    }
}
