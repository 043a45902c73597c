//! Reading files once and fingerprinting their blocks.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};

use crate::{FileEntry, Marks, Progress, ScanError, SkipReason, Tree};

// The digest scheme lives in `onecopy_digest`; re-exported for
// callers of the reader.
use onecopy_digest::sub_of_block;
use onecopy_digest::{digest_block, sub_digest, WholeDigest};
pub use onecopy_digest::{
    window_digest, zero_block_digest, BlockDigest, Blocks, PagedDigests, SubDigest,
};

/// How to read and fingerprint.
#[derive(Debug, Clone)]
pub struct HashOptions {
    /// Bytes per fingerprinted block; a multiple of the filesystem block.
    pub block_size: u64,
    /// Reader threads; each owns one read buffer for its whole life.
    pub threads: usize,
    /// Bytes per `read` call (rounded up to a multiple of `block_size`).
    pub read_size: usize,
}

impl Default for HashOptions {
    fn default() -> Self {
        HashOptions {
            block_size: 64 * 1024,
            threads: 4,
            read_size: 4 << 20,
        }
    }
}

/// A file with its fingerprints: 88 bytes (see `tests::record_sizes`);
/// its path is in the run's [`crate::Tree`], its digests in the run's
/// [`DigestStore`]. Whether it is racy (and, for a file known from the
/// catalog, settled, outside the roots or dirty) is in `entry.marks`.
#[derive(Debug, Clone)]
pub struct HashedFile {
    /// The file as it was when it was read (stat taken on the open file).
    pub entry: FileEntry,
    /// Where the block and sub-block digests are.
    pub digests: Digests,
    /// Digest of the whole content (of the block digests and the size),
    /// as two halves: a `u128` field would align the record to 16 bytes.
    whole: [u64; 2],
    /// `FS_IOC_GETFLAGS` of the inode (immutable, append-only, nocow ...).
    pub inode_flags: u32,
    /// The inode generation (`FS_IOC_GETVERSION`, a 32-bit value; 0 where
    /// unknown).
    pub generation: u32,
}

impl AsRef<FileEntry> for HashedFile {
    fn as_ref(&self) -> &FileEntry {
        &self.entry
    }
}

impl AsRef<FileEntry> for FileEntry {
    fn as_ref(&self) -> &FileEntry {
        self
    }
}

impl HashedFile {
    pub fn new(
        entry: FileEntry,
        digests: Digests,
        whole: u128,
        inode_flags: u32,
        generation: u32,
    ) -> HashedFile {
        HashedFile {
            entry,
            digests,
            whole: [whole as u64, (whole >> 64) as u64],
            inode_flags,
            generation,
        }
    }

    /// Digest of the whole content.
    pub fn whole(&self) -> u128 {
        self.whole[0] as u128 | (self.whole[1] as u128) << 64
    }

    /// Modified (mtime or ctime) less than [`RACY_MARGIN_NS`] before it
    /// was read: a write racing the read may not show in the timestamps,
    /// so the digests must not be trusted by a later run.
    pub fn racy(&self) -> bool {
        self.entry.marks.has(Marks::RACY)
    }

    /// Known from the catalog and settled by an earlier run.
    pub fn settled(&self) -> bool {
        self.entry.marks.has(Marks::SETTLED)
    }

    /// Known from the catalog, outside this run's roots: a source only.
    pub fn outside_roots(&self) -> bool {
        self.entry.marks.has(Marks::OUTSIDE_ROOTS)
    }

    /// Known from the catalog, with a record to rewrite.
    pub fn dirty(&self) -> bool {
        self.entry.marks.has(Marks::DIRTY)
    }

    /// One digest per `block_size` block; the last covers the partial tail.
    pub fn blocks<'a>(&self, store: &'a DigestStore) -> Blocks<'a> {
        store.blocks(&self.digests)
    }

    /// One digest per filesystem block (the device's block), kept only for
    /// files read in this run (empty for files known from a catalog) and
    /// only when a block spans several (empty at `-b 4K` on 4 KiB blocks,
    /// where every shifted window is a block): 8 bytes per 4 KiB read, for
    /// matching data at shifted offsets.
    pub fn subs<'a>(&self, store: &'a DigestStore) -> &'a [SubDigest] {
        store.subs(&self.digests)
    }
}

/// Where a file's digests are in the run's [`DigestStore`]: its block
/// digests followed by its sub-block digests, two to a slot. 16 B.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Digests {
    chunk: u32,
    at: u32,
    blocks: u32,
    subs: u32,
}

/// Blocks above which a list is long: written to the scratch file as it
/// is made ([`SpillHandle::begin`]) and moved to and from the catalog in
/// pieces, never held whole (64 Ki blocks: 256 MiB of file at 4 KiB).
pub const LONG_LIST: u64 = 1 << 16;

impl Digests {
    /// A long list in the scratch file (see [`LONG_LIST`]): the catalog
    /// moves it in pieces through a [`SpillHandle`].
    pub fn is_long(&self) -> bool {
        self.chunk == SPILLED && u64::from(self.blocks.max(self.subs)) > LONG_LIST
    }

    /// Every block is a single sub-block's ([`onecopy_digest::block_of_sub`]).
    pub fn one_sub(&self) -> bool {
        self.blocks == 0 && self.subs > 0
    }

    /// `n` blocks from word `at` of the scratch file, one word each when
    /// `one_sub`, else two.
    fn spilled(at: u64, n: u64, one_sub: bool) -> Digests {
        let (at, n) = (at as u32, n as u32);
        Digests {
            chunk: SPILLED,
            at,
            blocks: if one_sub { 0 } else { n },
            subs: if one_sub { n } else { 0 },
        }
    }
}

/// Words per block in the scratch file: a single sub-block's digest is
/// its sub-digest, any other the low then the high half.
fn words_per_block(one_sub: bool) -> u64 {
    if one_sub {
        1
    } else {
        2
    }
}

/// Appends `blocks` to `out` as scratch-file words (little-endian; see
/// [`words_per_block`]).
fn put_words(out: &mut Vec<u8>, blocks: &[BlockDigest], one_sub: bool) {
    for &b in blocks {
        out.extend_from_slice(&(b as u64).to_le_bytes());
        if !one_sub {
            out.extend_from_slice(&((b >> 64) as u64).to_le_bytes());
        }
    }
}

/// Every file's digests in one run, in chunks of 1 MiB that never move
/// (a list longer than a chunk gets a chunk of its own): a file's digests
/// cost their 16 B slots and no allocation of their own, and a chunk's
/// unused tail is never touched (so never resident).
///
/// A store made by [`DigestStore::spilling_to`] keeps the lists that have
/// no sub-digests (every known file's, and at a block of one filesystem
/// block every file's) in an unnamed scratch file instead, read back in
/// batches of words through a 512 KiB cache ([`Blocks::Paged`]): the
/// planner walks each file's list once in order and a matched source's
/// from the match on, so the file's pages stay in the page cache, not in
/// the process. Lists with sub-digests stay in RAM (the planner takes
/// them as slices).
#[derive(Debug, Default)]
pub struct DigestStore {
    chunks: Vec<Vec<u128>>,
    spill: Option<Arc<Spill>>,
}

/// `Digests::chunk` of a list in the scratch file (`at` is then its
/// first 8-byte word there).
const SPILLED: u32 = u32::MAX;

impl DigestStore {
    /// Slots per chunk.
    const CHUNK: usize = 1 << 16;

    pub fn new() -> DigestStore {
        DigestStore::default()
    }

    /// A store that keeps lists without sub-digests in an unnamed scratch
    /// file in `dir` (created if absent; the file has no name, so nothing
    /// is left behind however the process ends). The error if the file
    /// can not be made: the caller then uses [`DigestStore::new`] (the
    /// same answers, in RAM).
    pub fn spilling_to(dir: &std::path::Path) -> std::io::Result<DigestStore> {
        Ok(DigestStore {
            chunks: Vec::new(),
            spill: Some(Arc::new(Spill::create(dir)?)),
        })
    }

    /// The scratch file, for lists written and read in pieces; `None` for
    /// a store in RAM.
    pub fn spill_handle(&self) -> Option<SpillHandle> {
        self.spill.clone().map(SpillHandle)
    }

    /// Stores `blocks` and `subs` (packed two to a slot in native byte
    /// order); where they are. Blocks of one sub-block each (the matching
    /// block is the filesystem block) are stored as their sub-digests, 8 B
    /// each: `Digests { blocks: 0, subs: n }`, which no other file has (a
    /// file with sub-digests has blocks).
    pub fn push(&mut self, blocks: &[BlockDigest], subs: &[SubDigest]) -> Digests {
        let one_sub = subs.is_empty() && blocks.iter().all(|&b| sub_of_block(b).is_some());
        if subs.is_empty() && !blocks.is_empty() {
            if let Some(d) = self.spill.as_ref().and_then(|s| s.push(blocks, one_sub)) {
                return d;
            }
        }
        if one_sub && !blocks.is_empty() {
            // Their sub-digests are their low halves.
            let low = |i: usize| blocks[i] as u64;
            return self.push_slots(&[], blocks.len(), low);
        }
        self.push_slots(blocks, subs.len(), |i| subs[i])
    }

    /// Why the scratch file failed, if it did (lists it could not give
    /// back were seen as shorter: matches missed, nothing wrong).
    pub fn spill_error(&self) -> Option<String> {
        self.spill.as_ref()?.lock().error.clone()
    }

    /// Stores `blocks` then `nsubs` sub-digests, `sub(i)` the i-th.
    fn push_slots(
        &mut self,
        blocks: &[BlockDigest],
        nsubs: usize,
        sub: impl Fn(usize) -> SubDigest,
    ) -> Digests {
        let n = blocks.len() + nsubs.div_ceil(2);
        let fits = self
            .chunks
            .last()
            .is_some_and(|c| c.capacity() - c.len() >= n);
        if !fits {
            self.chunks.push(Vec::with_capacity(n.max(Self::CHUNK)));
        }
        let chunk = self.chunks.len() - 1;
        let c = &mut self.chunks[chunk];
        let at = c.len();
        c.extend_from_slice(blocks);
        c.extend((0..nsubs).step_by(2).map(|i| {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&sub(i).to_ne_bytes());
            if i + 1 < nsubs {
                b[8..].copy_from_slice(&sub(i + 1).to_ne_bytes());
            }
            u128::from_ne_bytes(b)
        }));
        Digests {
            chunk: chunk as u32,
            at: at as u32,
            blocks: blocks.len() as u32,
            subs: nsubs as u32,
        }
    }

    fn slots(&self, d: &Digests) -> &[u128] {
        if d.blocks == 0 && d.subs == 0 {
            return &[];
        }
        let n = d.blocks as usize + (d.subs as usize).div_ceil(2);
        &self.chunks[d.chunk as usize][d.at as usize..][..n]
    }

    /// The block digests of `d`.
    pub fn blocks(&self, d: &Digests) -> Blocks<'_> {
        if d.chunk == SPILLED {
            if let Some(s) = &self.spill {
                return s.blocks(d);
            }
        }
        if d.blocks == 0 {
            return Blocks::OneSub(self.packed(d));
        }
        Blocks::Full(&self.slots(d)[..d.blocks as usize])
    }

    /// The sub-block digests of `d` (none where blocks are single
    /// sub-blocks).
    pub fn subs(&self, d: &Digests) -> &[SubDigest] {
        if d.blocks == 0 || d.chunk == SPILLED {
            return &[];
        }
        self.packed(d)
    }

    /// The u64s packed after `d`'s block digests.
    fn packed(&self, d: &Digests) -> &[SubDigest] {
        // `push` wrote each pair in native byte order, so u64 `i` of the
        // packed slots is sub-digest `i` (bytemuck checks size and
        // alignment: a u128 holds two u64s).
        let all: &[u64] = bytemuck::cast_slice(&self.slots(d)[d.blocks as usize..]);
        &all[..d.subs as usize]
    }

    /// Bytes of the chunks' slots in use (the scratch file aside).
    pub fn used_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.len() * 16).sum()
    }
}

/// The scratch file of a spilling [`DigestStore`].
#[derive(Debug)]
struct Spill {
    file: Mutex<SpillFile>,
}

#[derive(Debug)]
struct SpillFile {
    file: File,
    /// Bytes written to the file.
    written: u64,
    /// Words after `written`, not yet written (all of them, and kept, if
    /// a write failed).
    pending: Vec<u8>,
    /// Page `p` is in slot `p % SLOTS` if anywhere.
    pages: Vec<Option<Page>>,
    error: Option<String>,
    /// A write failed: later lists stay in RAM.
    broken: bool,
}

impl Spill {
    /// Bytes per cached page, and pages cached.
    const PAGE: usize = 8 << 10;
    const SLOTS: usize = 64;
    /// Pending bytes written at once.
    const WRITE: usize = 256 << 10;

    fn create(dir: &std::path::Path) -> std::io::Result<Spill> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        // The catalogs' directory, made private as the catalog makes it
        // (this may run first).
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(true).mode(0o600);
        let file = match o.clone().custom_flags(libc::O_TMPFILE).open(dir) {
            Ok(f) => f,
            // No O_TMPFILE here: a name removed as soon as it is open.
            Err(_) => {
                let name = dir.join(format!("digests-{}-{}", std::process::id(), now_ns()));
                let f = o.create_new(true).open(&name)?;
                std::fs::remove_file(&name)?;
                f
            }
        };
        Ok(Spill {
            file: Mutex::new(SpillFile {
                file,
                written: 0,
                pending: Vec::new(),
                pages: Vec::new(),
                error: None,
                broken: false,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SpillFile> {
        self.file.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn blocks(&self, d: &Digests) -> Blocks<'_> {
        Blocks::Paged {
            src: self,
            at: u64::from(d.at),
            len: d.blocks.max(d.subs),
            one_sub: d.blocks == 0,
        }
    }

    /// Appends `blocks` (as one word each when `one_sub`, else two); where
    /// they are, or `None` (the caller keeps them in RAM) when the file
    /// failed or its word numbers would not fit a `Digests`.
    fn push(&self, blocks: &[BlockDigest], one_sub: bool) -> Option<Digests> {
        let mut f = self.lock();
        if f.broken {
            return None;
        }
        let at = (f.written + f.pending.len() as u64) / 8;
        let words = blocks.len() as u64 * words_per_block(one_sub);
        if at + words > u64::from(SPILLED) || blocks.len() > u32::MAX as usize {
            return None;
        }
        put_words(&mut f.pending, blocks, one_sub);
        if f.pending.len() >= Self::WRITE {
            f.flush();
        }
        Some(Digests::spilled(at, blocks.len() as u64, one_sub))
    }
}

/// A cached page of the scratch file: its number, how many of its bytes
/// were in the file when it was read, those bytes.
#[derive(Debug)]
struct Page {
    n: u64,
    valid: usize,
    bytes: Box<[u8]>,
}

impl SpillFile {
    /// Writes the pending words; false (and broken) if that failed.
    fn flush(&mut self) -> bool {
        use std::os::unix::fs::FileExt;
        if self.broken {
            return false;
        }
        match self.file.write_all_at(&self.pending, self.written) {
            Ok(()) => {
                self.written += self.pending.len() as u64;
                self.pending.clear();
                true
            }
            Err(e) => {
                self.fail(&e);
                false
            }
        }
    }

    fn fail(&mut self, e: &std::io::Error) {
        self.error
            .get_or_insert_with(|| format!("scratch file of block digests: {e}"));
        self.broken = true;
    }

    /// Forgets cached pages that overlap bytes `start..end`.
    fn forget_pages(&mut self, start: u64, end: u64) {
        let page = Spill::PAGE as u64;
        for slot in &mut self.pages {
            if slot
                .as_ref()
                .is_some_and(|p| p.n * page < end && (p.n + 1) * page > start)
            {
                *slot = None;
            }
        }
    }

    /// The word at byte `off`, through the page cache.
    fn word(&mut self, off: u64) -> Option<u64> {
        let word = |b: &[u8]| Some(u64::from_le_bytes(b.get(..8)?.try_into().ok()?));
        if off >= self.written {
            return word(self.pending.get((off - self.written) as usize..)?);
        }
        let page = off / Spill::PAGE as u64;
        let within = (off % Spill::PAGE as u64) as usize;
        let slot = (page % Spill::SLOTS as u64) as usize;
        if self.pages.is_empty() {
            self.pages.resize_with(Spill::SLOTS, || None);
        }
        let fresh = matches!(&self.pages[slot], Some(p) if p.n == page && within + 8 <= p.valid);
        if !fresh {
            self.load(page, slot)?;
        }
        let p = self.pages[slot].as_ref()?;
        word(&p.bytes[within..p.valid])
    }

    /// Reads page `page` into `slot`.
    fn load(&mut self, page: u64, slot: usize) -> Option<()> {
        use std::os::unix::fs::FileExt;
        let mut bytes = match self.pages[slot].take() {
            Some(p) => p.bytes,
            None => vec![0u8; Spill::PAGE].into_boxed_slice(),
        };
        let start = page * Spill::PAGE as u64;
        let want = (self.written - start).min(Spill::PAGE as u64) as usize;
        if let Err(e) = self.file.read_exact_at(&mut bytes[..want], start) {
            self.error
                .get_or_insert_with(|| format!("scratch file of block digests: {e}"));
            return None;
        }
        self.pages[slot] = Some(Page {
            n: page,
            valid: want,
            bytes,
        });
        Some(())
    }
}

impl PagedDigests for Spill {
    fn words(&self, i: u64, out: &mut [u64]) -> usize {
        let mut f = self.lock();
        onecopy_digest::fill_words(out, |n| f.word((i + n) * 8))
    }
}

/// The scratch file of a spilling [`DigestStore`], shared: a long list
/// ([`LONG_LIST`]) is written to it in pieces as a file is read or a
/// catalog record is loaded, and read from it in pieces as the catalog
/// is written, so that no list is ever held whole in RAM.
#[derive(Debug, Clone)]
pub struct SpillHandle(Arc<Spill>);

/// A list being written into its room in the scratch file
/// ([`SpillHandle::begin`]).
#[derive(Debug)]
pub struct ListWriter {
    /// First word of its room.
    at: u64,
    /// Blocks it has room for, and blocks written.
    len: u64,
    done: u64,
    one_sub: bool,
    buf: Vec<u8>,
}

impl SpillHandle {
    /// Room for a list of `len` blocks (one word each when `one_sub`, else
    /// two), written in order by [`SpillHandle::write`]; `None` when the
    /// file failed or the list would not fit a [`Digests`]. The room is a
    /// hole in the file until it is written; nobody reads it before
    /// [`SpillHandle::finish`] hands out its `Digests`.
    pub fn begin(&self, len: u64, one_sub: bool) -> Option<ListWriter> {
        let mut f = self.0.lock();
        if !f.flush() {
            return None;
        }
        let at = f.written / 8;
        let words = len * words_per_block(one_sub);
        if len > u64::from(u32::MAX) || at + words > u64::from(SPILLED) {
            return None;
        }
        let end = f.written + words * 8;
        if let Err(e) = f.file.set_len(end) {
            f.fail(&e);
            return None;
        }
        f.written = end;
        Some(ListWriter {
            at,
            len,
            done: 0,
            one_sub,
            buf: Vec::new(),
        })
    }

    /// Writes the next `blocks` of `w`'s list. An error if they do not fit
    /// its room, if a block of a `one_sub` list is not a single
    /// sub-block's, or if the write failed.
    pub fn write(&self, w: &mut ListWriter, blocks: &[BlockDigest]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
        if w.done + blocks.len() as u64 > w.len {
            return Err(bad("digest list longer than its room"));
        }
        if w.one_sub && !blocks.iter().all(|&b| sub_of_block(b).is_some()) {
            return Err(bad("not a single sub-block's digest"));
        }
        w.buf.clear();
        put_words(&mut w.buf, blocks, w.one_sub);
        let per = words_per_block(w.one_sub);
        let mut f = self.0.lock();
        if let Err(e) = f.file.write_all_at(&w.buf, (w.at + w.done * per) * 8) {
            f.fail(&e);
            return Err(e);
        }
        w.done += blocks.len() as u64;
        Ok(())
    }

    /// Where `w`'s list is, once every block it had room for is written;
    /// `None` if some were not.
    pub fn finish(&self, w: ListWriter) -> Option<Digests> {
        if w.done != w.len {
            return None;
        }
        let per = words_per_block(w.one_sub);
        self.0
            .lock()
            .forget_pages(w.at * 8, (w.at + w.len * per) * 8);
        Some(Digests::spilled(w.at, w.len, w.one_sub))
    }

    /// The blocks of a list in the scratch file ([`Digests::is_long`]).
    pub fn blocks(&self, d: &Digests) -> Blocks<'_> {
        self.0.blocks(d)
    }
}

/// See [`HashedFile::racy`]: covers the kernel's coarse timestamp clock.
pub const RACY_MARGIN_NS: i64 = 1_000_000_000;

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// What [`hash_files`] produced, sorted by `(dev, ino)`.
#[derive(Debug, Default)]
pub struct HashOutput {
    pub files: Vec<HashedFile>,
    pub skipped: BTreeMap<SkipReason, u64>,
    pub errors: Vec<ScanError>,
    pub bytes_read: u64,
    /// Files (among `files`) not read: each sits in the same extents as a
    /// file read earlier in the run (a snapshot's copy, a reflink copy),
    /// whose digests it reuses ([`crate::layout`]).
    pub files_same_extents: u64,
    pub bytes_same_extents: u64,
}

enum Outcome {
    /// Read whole (its digests in the store).
    Done(HashedFile, u64),
    /// Not read: the digests of a file read earlier with its layout.
    SameExtents(HashedFile, u64),
    Skip(SkipReason),
    Error(ScanError),
}

/// A file read in this run whose extents others share.
#[derive(Debug, Clone, Copy)]
struct Earlier {
    digests: Digests,
    whole: u128,
    /// When its read began (ns since the epoch).
    started: i64,
}

/// A layout key's state in the run.
enum Slot {
    /// A reader thread is reading a file with this layout.
    Reading,
    Read(Earlier),
}

/// The files read in this run, by layout key: a reader meeting a key
/// another thread is reading waits for that read instead of repeating it.
#[derive(Default)]
struct Layouts {
    slots: Mutex<HashMap<u128, Slot>>,
    changed: Condvar,
}

/// What [`Layouts::claim`] found.
enum Claim<'a> {
    /// Nobody had read this layout: the caller reads it, and fills the
    /// claim (or drops it, leaving the layout to the next file).
    Mine(Claimed<'a>),
    Earlier(Earlier),
}

impl Layouts {
    fn claim(&self, key: u128) -> Claim<'_> {
        let mut slots = self.slots.lock().unwrap();
        loop {
            match slots.get(&key) {
                None => {
                    slots.insert(key, Slot::Reading);
                    return Claim::Mine(Claimed { layouts: self, key });
                }
                Some(Slot::Read(e)) => return Claim::Earlier(*e),
                Some(Slot::Reading) => slots = self.changed.wait(slots).unwrap(),
            }
        }
    }
}

/// A layout this thread is reading; unfilled when dropped, it is released.
struct Claimed<'a> {
    layouts: &'a Layouts,
    key: u128,
}

impl Claimed<'_> {
    fn fill(self, e: Earlier) {
        self.layouts
            .slots
            .lock()
            .unwrap()
            .insert(self.key, Slot::Read(e));
        // Drop wakes the waiters.
    }
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        let mut slots = self.layouts.slots.lock().unwrap();
        if matches!(slots.get(&self.key), Some(Slot::Reading)) {
            slots.remove(&self.key);
        }
        self.layouts.changed.notify_all();
    }
}

/// Reads and fingerprints every file, `opts.threads` files at a time.
/// Files that fail or change while being read are recorded, not returned.
/// The files come back sorted by `(dev, ino)`, the walk's order; `tree`
/// holds their paths and devices.
///
/// Memory: the input list shrinks as readers take entries from it (each
/// entry moves into its result, path included), and results go straight
/// into the output list, which is sorted in place: one record per file at
/// any time, never an input list, a result list and an output list at once.
pub fn hash_files(
    files: Vec<FileEntry>,
    tree: &Tree,
    store: &mut DigestStore,
    opts: &HashOptions,
    progress: &Progress,
) -> HashOutput {
    hash_files_with(files, tree, store, opts, progress, &NoKnownCopies)
}

/// Files known from an earlier run (a catalog) that a file about to be
/// read may share its extents with.
pub trait KnownCopies: Sync {
    /// Known files that may hold the same bytes as `e` in the same
    /// extents (a snapshot's copy of a file keeps its inode number, size
    /// and mtime in the other subvolume), best first; the reader skips any
    /// on `e`'s own device (the same inode, changed since). Their entries
    /// are their stat when read, their digests in the run's store.
    fn candidates(&self, e: &FileEntry) -> Vec<&HashedFile>;
}

/// No known files.
pub struct NoKnownCopies;

impl KnownCopies for NoKnownCopies {
    fn candidates(&self, _: &FileEntry) -> Vec<&HashedFile> {
        Vec::new()
    }
}

/// [`hash_files`], where a file laid out as a known copy of it is now
/// takes that copy's digests unread.
pub fn hash_files_with(
    files: Vec<FileEntry>,
    tree: &Tree,
    store: &mut DigestStore,
    opts: &HashOptions,
    progress: &Progress,
    known: &dyn KnownCopies,
) -> HashOutput {
    let store = Mutex::new(store);
    let bs = opts.block_size.max(512) as usize;
    let read_size = opts.read_size.max(bs).div_ceil(bs) * bs;
    let mut files = files;
    // Reversed, so that popping hands the entries out in order.
    files.reverse();
    let queue = Mutex::new(Queue { files, taken: 0 });
    let n = queue.lock().unwrap().files.len();
    // Reserved, not touched: pages are used as results arrive.
    let out = Mutex::new(HashOutput {
        files: Vec::with_capacity(n),
        ..HashOutput::default()
    });
    let layouts = Layouts::default();
    let spill = store.lock().unwrap().spill_handle();
    let reader = Reader {
        tree,
        bs,
        layouts: &layouts,
        store: &store,
        spill: spill.as_ref(),
        known,
        progress,
    };
    std::thread::scope(|s| {
        for _ in 0..opts.threads.max(1) {
            s.spawn(|| {
                // Made at the first file: a run with nothing to read (a
                // warm run) makes no buffer.
                let mut buf = Vec::new();
                let mut scratch = Scratch::default();
                let mut mine = Vec::new();
                loop {
                    if progress.cancelled() {
                        break;
                    }
                    let Some(entry) = queue.lock().unwrap().next() else {
                        break;
                    };
                    if buf.is_empty() {
                        buf = vec![0u8; read_size];
                    }
                    let outcome = reader.hash_one(entry, &mut buf, &mut scratch);
                    progress.files_done.fetch_add(1, Ordering::Relaxed);
                    mine.push(outcome);
                    if mine.len() >= 256 {
                        out.lock().unwrap().add(&mut mine);
                    }
                }
                out.lock().unwrap().add(&mut mine);
            });
        }
    });
    // Entries not reached (cancelled) go now.
    drop(queue);
    let mut out = out.into_inner().unwrap();
    out.files.shrink_to_fit();
    out.files
        .sort_unstable_by_key(|f| (f.entry.dev, f.entry.ino));
    out
}

/// A reader thread's digest lists, reused from file to file.
#[derive(Default)]
struct Scratch {
    blocks: Vec<BlockDigest>,
    subs: Vec<SubDigest>,
}

/// Where one file's digests go as they are made: into `scratch`, or, for
/// a long list, through `scratch` into its room in the scratch file.
struct Sink<'a> {
    scratch: &'a mut Scratch,
    whole: WholeDigest,
    keep_subs: bool,
    long: Option<(&'a SpillHandle, ListWriter)>,
}

impl Sink<'_> {
    /// Blocks a long list gathers before they are written.
    const PIECE: usize = 1 << 14;

    fn push(&mut self, b: BlockDigest) -> std::io::Result<()> {
        self.whole.add(b);
        self.scratch.blocks.push(b);
        if !self.keep_subs {
            self.scratch.subs.clear();
        }
        if self.scratch.blocks.len() >= Self::PIECE {
            self.write_out()?;
        }
        Ok(())
    }

    /// A long list's gathered blocks go to the scratch file.
    fn write_out(&mut self) -> std::io::Result<()> {
        if let Some((spill, w)) = &mut self.long {
            spill.write(w, &self.scratch.blocks).map_err(|e| {
                std::io::Error::new(e.kind(), format!("scratch file of block digests: {e}"))
            })?;
            self.scratch.blocks.clear();
        }
        Ok(())
    }

    /// The whole-file digest, and where a long list is.
    fn finish(mut self, size: u64) -> std::io::Result<(u128, Option<Digests>)> {
        self.write_out()?;
        let long = match self.long {
            None => None,
            Some((spill, w)) => Some(spill.finish(w).ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, "digest list cut short")
            })?),
        };
        Ok((self.whole.finish(size), long))
    }
}

/// The entries still to read, last first; shrinks as they are taken.
struct Queue {
    files: Vec<FileEntry>,
    taken: usize,
}

impl Iterator for Queue {
    type Item = FileEntry;

    fn next(&mut self) -> Option<FileEntry> {
        let e = self.files.pop()?;
        self.taken += 1;
        if self.taken.is_multiple_of(SHRINK_EVERY) {
            // Give back what was taken (a large list shrinks in place).
            self.files.shrink_to_fit();
        }
        Some(e)
    }
}

impl HashOutput {
    fn add(&mut self, outcomes: &mut Vec<Outcome>) {
        for r in outcomes.drain(..) {
            match r {
                Outcome::Done(f, n) => {
                    self.bytes_read += n;
                    self.files.push(f);
                }
                Outcome::SameExtents(f, n) => {
                    self.files_same_extents += 1;
                    self.bytes_same_extents += n;
                    self.files.push(f);
                }
                Outcome::Skip(r) => *self.skipped.entry(r).or_default() += 1,
                Outcome::Error(e) => self.errors.push(e),
            }
        }
    }
}

/// Entries taken between two shrinks of the input list.
const SHRINK_EVERY: usize = 1 << 14;

/// What the reader threads share.
struct Reader<'a, 's> {
    tree: &'a Tree,
    /// The block size.
    bs: usize,
    layouts: &'a Layouts,
    store: &'a Mutex<&'s mut DigestStore>,
    /// The store's scratch file, where long lists are written as read.
    spill: Option<&'a SpillHandle>,
    known: &'a dyn KnownCopies,
    progress: &'a Progress,
}

impl Reader<'_, '_> {
    /// Adds the bytes it reads to `progress.bytes_done` as it reads them,
    /// so a progress display shows the true rate even inside one large
    /// file. A file read whole comes back with its digests in `scratch`
    /// (and `digests` not set yet); a file in the same extents as one read
    /// earlier comes back with that file's digests, unread.
    fn hash_one(&self, entry: FileEntry, buf: &mut [u8], scratch: &mut Scratch) -> Outcome {
        let path = self.tree.path(entry.name);
        let device = self.tree.device(entry.dev);
        let (mut f, mut entry) = match open_listed(entry, &path, device.dev) {
            Ok(opened) => opened,
            Err(outcome) => return outcome,
        };
        let read_start = now_ns();
        let inode_flags = onecopy_ioctl::fs::inode_flags(f.as_fd()).unwrap_or(0);
        // The kernel's value is 32 bits.
        let generation = onecopy_ioctl::fs::inode_generation(f.as_fd()).unwrap_or(0) as u32;
        let ids = (inode_flags, generation);
        let key = crate::layout::key(&f, entry.ino, entry.size);
        if let Some(c) = key.and_then(|k| self.known_copy(k, &f, &entry, device.dev)) {
            let racy = entry.mtime_ns.max(entry.ctime_ns) >= now_ns() - RACY_MARGIN_NS;
            return self.unread(entry, (c.digests, c.whole()), ids, racy);
        }
        let claim = key.map(|k| self.layouts.claim(k));
        if let Some(Claim::Earlier(e)) = &claim {
            if unchanged_since(e, &f, &entry, device.dev) {
                return self.unread(entry, (e.digests, e.whole), ids, false);
            }
        }
        let (total, whole, long) = match self.read(&mut f, &entry, device, (buf, scratch)) {
            Ok(read) => read,
            Err(outcome) => return outcome,
        };
        let racy = entry.mtime_ns.max(entry.ctime_ns) >= read_start - RACY_MARGIN_NS;
        entry.marks.set(Marks::RACY, racy);
        // Only files read whole get digests in the store.
        let digests = long.unwrap_or_else(|| {
            let mut store = self.store.lock().unwrap();
            store.push(&scratch.blocks, &scratch.subs)
        });
        if let (Some(Claim::Mine(c)), false) = (claim, racy) {
            // A racy file's digests are not lent to others.
            c.fill(Earlier {
                digests,
                whole,
                started: read_start,
            });
        }
        let f = HashedFile::new(entry, digests, whole, inode_flags, generation);
        Outcome::Done(f, total)
    }

    /// Reads `f` whole into `scratch`'s digest lists (a long list into
    /// the scratch file, see [`LONG_LIST`]): the bytes read, the
    /// whole-file digest and where a long list went, or the outcome when
    /// it fails or changes.
    fn read(
        &self,
        f: &mut File,
        entry: &FileEntry,
        device: &crate::Device,
        (buf, scratch): (&mut [u8], &mut Scratch),
    ) -> Result<(u64, u128, Option<Digests>), Outcome> {
        let path = || self.tree.path(entry.name);
        advise_sequential(f);
        let sub = (device.block as usize).clamp(512, self.bs);
        let blocks = entry.size.div_ceil(self.bs as u64);
        if blocks > u64::from(u32::MAX) {
            return Err(Outcome::Skip(SkipReason::TooManyBlocks));
        }
        let long = self
            .spill
            .filter(|_| blocks > LONG_LIST)
            .and_then(|s| Some((s, s.begin(blocks, sub == self.bs)?)));
        // At a block of one sub-block, a window at a sub-block offset is a
        // block: the sub-digests would only repeat what `blocks` says. A
        // long list keeps none (they would be 8 B per sub-block in RAM):
        // shifted copies inside such a file are not looked for.
        let keep_subs = sub < self.bs && long.is_none();
        let shape = (self.bs, sub, entry.size);
        let mut sink = Sink {
            scratch,
            whole: WholeDigest::default(),
            keep_subs,
            long,
        };
        let failed = |source: std::io::Error| {
            if self.progress.cancelled() {
                return Outcome::Skip(SkipReason::Interrupted);
            }
            Outcome::Error(ScanError::Read {
                path: path(),
                source,
            })
        };
        let read = digest_all(f, buf, shape, &mut sink, self.progress);
        // A file changed while read is skipped as such, whatever the read
        // made of it (one that grew past its long list's room failed it).
        let whole_read = !matches!(read, Ok(total) if total != entry.size);
        match f.metadata() {
            Ok(m) if entry.unchanged(device.dev, &m) && whole_read => {}
            Ok(_) => return Err(Outcome::Skip(SkipReason::ChangedWhileReading)),
            Err(source) => {
                return Err(Outcome::Error(ScanError::Stat {
                    path: path(),
                    source,
                }))
            }
        }
        let total = read.map_err(failed)?;
        let (whole, long) = sink.finish(total).map_err(failed)?;
        Ok((total, whole, long))
    }

    /// The outcome of a file not read: `digests` and `whole` are those of
    /// a file in the same extents.
    fn unread(
        &self,
        mut entry: FileEntry,
        (digests, whole): (Digests, u128),
        (inode_flags, generation): (u32, u32),
        racy: bool,
    ) -> Outcome {
        let n = entry.size;
        self.progress.bytes_done.fetch_add(n, Ordering::Relaxed);
        entry.marks.set(Marks::RACY, racy);
        entry.marks.set(Marks::SAME_EXTENTS, true);
        let f = HashedFile::new(entry, digests, whole, inode_flags, generation);
        Outcome::SameExtents(f, n)
    }
}

impl Reader<'_, '_> {
    /// The known copy of `entry` (open as `f`, laid out as `key`) laid out
    /// as `key` too, checked now with both unchanged around it: then both
    /// read the same shared extents now, and the copy has not changed
    /// since its digests were taken.
    fn known_copy(&self, key: u128, f: &File, entry: &FileEntry, dev: u64) -> Option<&HashedFile> {
        let mut candidates = self.known.candidates(entry).into_iter();
        candidates.find(|c| self.same_layout(c, key, (f, entry, dev)))
    }

    /// Whether the known file `c` is laid out as `key` now, on another
    /// device than `f`, both unchanged around the look.
    fn same_layout(
        &self,
        c: &HashedFile,
        key: u128,
        (f, e, dev): (&File, &FileEntry, u64),
    ) -> bool {
        let cdev = self.tree.device(c.entry.dev).dev;
        if cdev == dev {
            return false;
        }
        let Ok(cf) = crate::longpath::open_noatime(&self.tree.path(c.entry.name)) else {
            return false;
        };
        let same =
            |file: &File, x: &FileEntry, d: u64| file.metadata().is_ok_and(|m| x.unchanged(d, &m));
        same(&cf, &c.entry, cdev)
            && crate::layout::key(&cf, c.entry.ino, c.entry.size) == Some(key)
            && same(&cf, &c.entry, cdev)
            && same(f, e, dev)
    }
}

/// Whether `earlier`'s digests hold for `f`, whose layout (just taken) is
/// the one `earlier` was read with: `f` has not changed since before that
/// read began, so it referenced the same shared extents then, which
/// nothing overwrites in place; and it did not change while its layout
/// was taken.
fn unchanged_since(earlier: &Earlier, f: &File, entry: &FileEntry, dev: u64) -> bool {
    entry.mtime_ns.max(entry.ctime_ns) < earlier.started - RACY_MARGIN_NS
        && f.metadata().is_ok_and(|m| entry.unchanged(dev, &m))
}

/// Opens the file `entry` lists at `path` and checks that it still is a
/// regular, non-empty file on device `dev`: the file and its entry as
/// now, else the outcome to report.
fn open_listed(
    entry: FileEntry,
    path: &std::path::Path,
    dev: u64,
) -> Result<(File, FileEntry), Outcome> {
    let f = match crate::longpath::open_noatime(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Outcome::Skip(SkipReason::Vanished))
        }
        Err(source) => {
            let path = path.to_path_buf();
            return Err(Outcome::Error(ScanError::Open { path, source }));
        }
    };
    let meta = f.metadata().map_err(|source| {
        let path = path.to_path_buf();
        Outcome::Error(ScanError::Stat { path, source })
    })?;
    if !meta.is_file() {
        return Err(Outcome::Skip(SkipReason::NotRegular));
    }
    // Another file moved in from another device: not the file listed.
    if meta.dev() != dev {
        return Err(Outcome::Skip(SkipReason::Vanished));
    }
    let entry = FileEntry::from_meta(entry.name, entry.dev, &meta);
    if entry.size == 0 {
        return Err(Outcome::Skip(SkipReason::TooSmall));
    }
    Ok((f, entry))
}

/// Reads `f` to its end through `buf`, digesting every block of `bs`
/// bytes (sub-blocks of `sub`) into `sink`; the bytes covered. Whole
/// blocks in holes (`SEEK_DATA`) are not read: they are zeros, and get
/// the zero block's digests.
fn digest_all(
    f: &mut File,
    buf: &mut [u8],
    (bs, sub, size): (usize, usize, u64),
    sink: &mut Sink<'_>,
    progress: &Progress,
) -> std::io::Result<u64> {
    sink.scratch.blocks.clear();
    sink.scratch.subs.clear();
    // Whole blocks end here: a partial tail is always read.
    let full_end = size - size % bs as u64;
    let mut total = 0u64;
    loop {
        if total < full_end {
            total = skip_hole(f, (total, full_end), (bs, sub), sink, progress)?;
        }
        let n = read_full(f, buf)?;
        for chunk in buf[..n].chunks(bs) {
            let b = digest_block(chunk, bs, sub, &mut sink.scratch.subs);
            sink.push(b)?;
        }
        total += n as u64;
        progress.bytes_done.fetch_add(n as u64, Ordering::Relaxed);
        if n < buf.len() {
            return Ok(total);
        }
        // A file of 100 GiB held a SIGINT for a minute, one of 1 TiB for
        // ten: the run stops within one buffer instead.
        if progress.cancelled() {
            return Err(std::io::Error::from(std::io::ErrorKind::Interrupted));
        }
    }
}

/// Digests the whole blocks of the hole at `pos` (before `full_end`) as
/// zeros, unread, and leaves `f`'s offset where the hole ends (`pos` if
/// there is none): that offset.
fn skip_hole(
    f: &mut File,
    (pos, full_end): (u64, u64),
    (bs, sub): (usize, usize),
    sink: &mut Sink<'_>,
    progress: &Progress,
) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let end = hole_end(f, pos, full_end, bs as u64).unwrap_or(pos);
    if end > pos {
        let zero = zero_block_digest(bs as u64, sub as u64);
        let zero_sub = sub_digest(&vec![0u8; sub]);
        for n in 0..(end - pos) / bs as u64 {
            if sink.keep_subs {
                let subs = &mut sink.scratch.subs;
                subs.extend(std::iter::repeat_n(zero_sub, bs / sub));
            }
            sink.push(zero)?;
            // A hole of terabytes is millions of blocks: the run stops
            // within a few of them, as within one buffer of data.
            if n % (1 << 20) == 0 && progress.cancelled() {
                return Err(std::io::Error::from(std::io::ErrorKind::Interrupted));
            }
        }
        progress.bytes_done.fetch_add(end - pos, Ordering::Relaxed);
    }
    // SEEK_DATA moved the offset.
    f.seek(SeekFrom::Start(end))
}

/// Where the hole of whole blocks at `pos` ends, if there is one (and
/// `pos` is before `full_end`, the end of the file's whole blocks).
/// `None` where the filesystem does not tell, or says data.
fn hole_end(f: &File, pos: u64, full_end: u64, bs: u64) -> Option<u64> {
    if pos >= full_end {
        return None;
    }
    let end = match onecopy_ioctl::fs::next_data(f.as_fd(), pos).ok()? {
        Some(data) => data - data % bs,
        None => full_end,
    };
    let end = end.min(full_end);
    (end > pos).then_some(end)
}

/// Reads until `buf` is full or end of file; returns the bytes read.
fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn advise_sequential(f: &File) {
    // Advisory only: a refusal changes nothing but read-ahead.
    let _ = onecopy_ioctl::fs::fadvise(f.as_fd(), onecopy_ioctl::fs::Advice::Sequential);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn progress_counts_every_byte_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 3 * 65536 + 100]).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        let mut tree = Tree::new();
        let entry = tree.add_file(&path, &meta, 1, 0, 4096).unwrap();
        let opts = HashOptions {
            block_size: 65536,
            threads: 1,
            read_size: 65536,
        };
        let progress = Progress::default();
        let out = hash_files(
            vec![entry],
            &tree,
            &mut DigestStore::new(),
            &opts,
            &progress,
        );
        assert_eq!(out.files.len(), 1);
        assert_eq!(out.bytes_read, 3 * 65536 + 100);
        assert_eq!(progress.bytes_done.load(Ordering::Relaxed), out.bytes_read);
        assert_eq!(progress.files_done.load(Ordering::Relaxed), 1);
    }

    /// A sparse file of `size` bytes at `path` with data at `at` (a few
    /// KiB each, unaligned) and a partial tail.
    fn sparse_file(path: &std::path::Path, size: u64, at: &[u64]) -> Vec<(u64, Vec<u8>)> {
        use std::os::unix::fs::FileExt;
        let f = File::create(path).unwrap();
        f.set_len(size).unwrap();
        let mut put = Vec::new();
        for (n, &a) in at.iter().chain([size - 10].iter()).enumerate() {
            let data: Vec<u8> = (0..(size - a).min(9000))
                .map(|i| (i as usize * 31 + n) as u8 | 1)
                .collect();
            f.write_all_at(&data, a).unwrap();
            put.push((a, data));
        }
        f.sync_all().unwrap();
        put
    }

    /// The digests of reading `path` whole, block by block.
    fn digests_of_reading(path: &std::path::Path, bs: usize) -> (Vec<u128>, Vec<u64>, u128) {
        let bytes = std::fs::read(path).unwrap();
        let mut subs = Vec::new();
        let blocks: Vec<u128> = bytes
            .chunks(bs)
            .map(|c| digest_block(c, bs, 4096, &mut subs))
            .collect();
        let whole = onecopy_digest::whole_digest(&blocks, bytes.len() as u64);
        (blocks, subs, whole)
    }

    /// Hashes `path` with a block of `bs` into `store`: the file.
    fn hash_one_file(path: &std::path::Path, bs: u64, store: &mut DigestStore) -> HashedFile {
        let meta = std::fs::metadata(path).unwrap();
        let mut tree = Tree::new();
        let e = tree.add_file(path, &meta, 1, 0, 4096).unwrap();
        let opts = HashOptions {
            block_size: bs,
            threads: 1,
            read_size: 1 << 20,
        };
        let out = hash_files(vec![e], &tree, store, &opts, &Progress::default());
        assert!(out.errors.is_empty(), "{:?}", out.errors);
        out.files.into_iter().next().expect("the file hashed")
    }

    /// Holes are digested as the zeros they read as, without being read:
    /// the same block and sub-block digests, and whole digest, as reading
    /// every byte gives, at a block of one sub-block and of several.
    #[test]
    fn holes_digest_as_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        sparse_file(
            &path,
            (40 << 20) + 100,
            &[5000, 3 << 20, (17 << 20) + 65536],
        );
        for bs in [4096, 65536] {
            let want = digests_of_reading(&path, bs as usize);
            let mut store = DigestStore::new();
            let f = hash_one_file(&path, bs, &mut store);
            assert_eq!(f.blocks(&store).to_vec(), want.0, "blocks at {bs}");
            if bs > 4096 {
                assert_eq!(f.subs(&store), &want.1[..], "sub-blocks at {bs}");
            }
            assert_eq!(f.whole(), want.2, "whole at {bs}");
        }
    }

    /// A list of more than LONG_LIST blocks is written to the scratch file
    /// as it is made, never held whole: the same digests as a store in
    /// RAM gives, and a long list in the store. At a block of several
    /// sub-blocks it keeps no sub-digests.
    #[test]
    fn long_lists_go_to_the_scratch_file_as_they_are_made() {
        let dir = tempfile::tempdir().unwrap();
        for bs in [4096u64, 65536] {
            let path = dir.path().join(format!("long-{bs}"));
            let size = (LONG_LIST + 5) * bs + 123;
            sparse_file(&path, size, &[7 * bs + 5, (LONG_LIST - 2) * bs]);
            let mut ram = DigestStore::new();
            let want = hash_one_file(&path, bs, &mut ram);
            assert!(!want.digests.is_long());
            let mut spilling = DigestStore::spilling_to(dir.path()).unwrap();
            let got = hash_one_file(&path, bs, &mut spilling);
            assert!(got.digests.is_long(), "a long list at {bs}");
            assert_eq!(got.digests.one_sub(), bs == 4096);
            assert_eq!(spilling.used_bytes(), 0, "nothing of it in RAM");
            assert_eq!(got.blocks(&spilling).to_vec(), want.blocks(&ram).to_vec());
            assert!(got.subs(&spilling).is_empty());
            assert_eq!(got.whole(), want.whole());
            let h = spilling.spill_handle().unwrap();
            assert_eq!(h.blocks(&got.digests).to_vec(), want.blocks(&ram).to_vec());
        }
    }

    /// Sub-digests are kept only when a block spans several sub-blocks.
    #[test]
    fn sub_digests_only_below_the_block_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..5 * 4096 + 10).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        let mut tree = Tree::new();
        let e = tree.add_file(&path, &meta, 1, 0, 4096).unwrap();
        let mut store = DigestStore::new();
        let mut run = |bs: u64| {
            let opts = HashOptions {
                block_size: bs,
                threads: 1,
                read_size: 65536,
            };
            hash_files(
                vec![e.clone()],
                &tree,
                &mut store,
                &opts,
                &Progress::default(),
            )
            .files
            .remove(0)
        };
        let small = run(4096);
        let big = run(16384);
        assert_eq!(small.blocks(&store).len(), 6);
        assert!(small.subs(&store).is_empty());
        assert_eq!(big.blocks(&store).len(), 2);
        assert_eq!(big.subs(&store).len(), 6);
        // The 4 KiB block digests are what the sub-digests would have
        // given, and are kept as them (8 B each).
        assert!(matches!(small.blocks(&store), Blocks::OneSub(_)));
        for (i, b) in small.blocks(&store).iter().enumerate() {
            let sub = big.subs(&store)[i];
            assert_eq!(b, onecopy_digest::block_of_sub(sub), "block {i}");
        }
    }

    /// Results come back in the walk's order (dev, ino) whatever thread
    /// read them, and missing files are counted.
    #[test]
    fn output_in_walk_order_across_threads() {
        let dir = tempfile::tempdir().unwrap();
        let mut entries = Vec::new();
        let mut tree = Tree::new();
        for i in 0..300u32 {
            let path = dir.path().join(format!("f{i}"));
            std::fs::write(&path, i.to_le_bytes().repeat(1 + i as usize * 7)).unwrap();
            let meta = std::fs::metadata(&path).unwrap();
            entries.push(tree.add_file(&path, &meta, 1, 0, 4096).unwrap());
        }
        std::fs::remove_file(dir.path().join("f17")).unwrap();
        let opts = HashOptions {
            block_size: 4096,
            threads: 3,
            read_size: 4096,
        };
        let out = hash_files(
            entries,
            &tree,
            &mut DigestStore::new(),
            &opts,
            &Progress::default(),
        );
        let keys: Vec<(u64, u64)> = out
            .files
            .iter()
            .map(|f| (tree.device(f.entry.dev).dev, f.entry.ino))
            .collect();
        let mut want: Vec<(u64, u64)> = (0..300)
            .filter(|&i| i != 17)
            .map(|i| {
                let m = std::fs::metadata(dir.path().join(format!("f{i}"))).unwrap();
                (m.dev(), m.ino())
            })
            .collect();
        want.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!(out.skipped.get(&SkipReason::Vanished), Some(&1));
    }
}

#[cfg(test)]
mod digests_tests {
    use super::{Blocks, DigestStore, Digests};

    /// Blocks and sub-blocks come back as packed, odd counts included, and
    /// a list never moves or straddles chunks.
    #[test]
    fn packed_digests_round_trip() {
        let mut store = DigestStore::new();
        let mut kept = Vec::new();
        for ns in [0usize, 1, 2, 5, 70_000, 3] {
            let blocks: Vec<u128> = (0..3).map(|i| i * (u128::MAX / 7) + ns as u128).collect();
            let subs: Vec<u64> = (0..ns as u64)
                .map(|i| i.wrapping_mul(0x0123_4567_89ab_cdef))
                .collect();
            let d = store.push(&blocks, &subs);
            kept.push((d, blocks, subs));
        }
        for (d, blocks, subs) in &kept {
            assert_eq!(store.blocks(d).to_vec(), &blocks[..]);
            assert_eq!(store.subs(d), &subs[..]);
        }
        // Blocks of one sub-block each keep as sub-digests.
        let one: Vec<u128> = (0..9u64).map(onecopy_digest::block_of_sub).collect();
        let d = store.push(&one, &[]);
        assert!(matches!(store.blocks(&d), Blocks::OneSub(s) if s.len() == 9));
        assert_eq!(store.blocks(&d).to_vec(), one);
        assert!(store.subs(&d).is_empty());
        assert!(store.subs(&Digests::default()).is_empty());
        assert!(DigestStore::new().blocks(&Digests::default()).is_empty());
    }

    /// A spilling store gives back exactly what a RAM store does: lists
    /// without sub-digests from its scratch file (written in pieces, read
    /// through its page cache in any order), lists with them from RAM.
    #[test]
    fn spilled_digests_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mut spill = DigestStore::spilling_to(&dir.path().join("new")).unwrap();
        let mut ram = DigestStore::new();
        let mut kept = Vec::new();
        for n in 0..400u64 {
            let len = (n * 37 % 900) as usize;
            let blocks: Vec<u128> = if n % 3 == 0 {
                (0..len as u64)
                    .map(|i| onecopy_digest::block_of_sub(i ^ n << 20))
                    .collect()
            } else {
                (0..len as u128)
                    .map(|i| i * (u128::MAX / 1001) + n as u128)
                    .collect()
            };
            let subs: Vec<u64> = if n % 5 == 1 { vec![n; len * 2] } else { vec![] };
            kept.push((
                spill.push(&blocks, &subs),
                ram.push(&blocks, &subs),
                blocks,
                subs,
            ));
        }
        // Nothing is left in the directory: the scratch file has no name.
        assert_eq!(
            std::fs::read_dir(dir.path().join("new")).unwrap().count(),
            0
        );
        assert!(spill.used_bytes() < ram.used_bytes() / 2);
        for (s, r, blocks, subs) in kept.iter().rev().chain(kept.iter()) {
            let b = spill.blocks(s);
            assert_eq!(b.len(), blocks.len());
            assert_eq!(b.to_vec_checked().as_ref(), Some(blocks));
            assert_eq!(ram.blocks(r).to_vec(), *blocks);
            assert_eq!(spill.subs(s), &subs[..]);
            if !blocks.is_empty() {
                assert_eq!(b.get(blocks.len() - 1), blocks.last().copied());
                assert_eq!(b.get(blocks.len()), None);
            }
        }
        assert_eq!(spill.spill_error(), None);
        // No usable directory: the caller falls back to RAM.
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(DigestStore::spilling_to(&file.join("sub")).is_err());
    }

    /// The per-file records stay at the sizes ARCHITECTURE.md ("Memory of
    /// a run") states: 48 B walked, 88 B read or known (plus 16 B per
    /// block and 8 B per sub-block in the store).
    #[test]
    fn record_sizes() {
        assert_eq!(std::mem::size_of::<Digests>(), 16);
        assert_eq!(std::mem::size_of::<crate::FileEntry>(), 48);
        assert_eq!(std::mem::size_of::<super::HashedFile>(), 88);
        assert_eq!(std::mem::size_of::<crate::NameId>(), 8);
    }
}
