//! The persistent catalog: what onecopy learned about each file, so that an
//! unchanged file is never read twice.
//!
//! # On-disk format (version 6)
//!
//! One SQLite database (WAL journal, `synchronous=NORMAL`) per catalog file.
//! `PRAGMA user_version` holds [`FORMAT_VERSION`] and the `meta` table holds
//! `magic = onecopy-catalog`, `block_size` and `records`: the number of
//! rows of `files`, counted through its unique index in the same
//! transaction as every change (absent in catalogs written before it; the
//! next commit adds it). Loading scans the table itself and compares: a
//! damaged page that drops or adds records silently is found. A database whose version or
//! magic differ, that is not SQLite at all, or that fails to load, is set
//! aside (renamed `*.broken`) and rebuilt: it is never misread.
//!
//! ```sql
//! CREATE TABLE files (
//!   fs TEXT, subvol INTEGER, ino INTEGER,   -- key: filesystem identity, btrfs subvolume, inode
//!   generation INTEGER, path BLOB,          -- path: absolute, raw bytes
//!   size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER, nlink INTEGER,
//!   whole BLOB,                             -- 16 bytes, XXH3-128, little-endian
//!   blocks BLOB,                            -- 16 bytes per block, little-endian
//!                                           -- (XXH3-128 of the block's XXH3-64
//!                                           -- filesystem-block digests; version 1
//!                                           -- hashed the bytes directly), or,
//!                                           -- since version 5, packed: byte 0x01
//!                                           -- then 8 bytes per block, the XXH3-64
//!                                           -- of a block that is one filesystem
//!                                           -- block (matching at 4 KiB)
//!   flags INTEGER,                          -- FS_IOC_GETFLAGS inode flags
//!   settled INTEGER,                        -- 1: every planned range was shared last run
//!   last_seen INTEGER,                      -- run number
//!   checksum INTEGER,                       -- XXH3-64 of all fields above
//!   UNIQUE (fs, subvol, ino));              -- a rowid table: see below
//! CREATE TABLE lists (                      -- since version 6
//!   fs TEXT, subvol INTEGER, ino INTEGER,   -- a record's key
//!   blocks BLOB,                            -- as `files.blocks`, when that is 0x02
//!   UNIQUE (fs, subvol, ino));
//! ```
//!
//! A list of more than [`LONG_LIST`](onecopy_scan::LONG_LIST) blocks is kept in `lists`, and its
//! record's `blocks` is the single byte 0x02: there the blob is a row's
//! last column, so SQLite writes it in pieces (`zeroblob`, then
//! incremental blob I/O) without first making it whole in RAM, as it
//! would for a column followed by others. Every transaction that changes
//! `files` drops the `lists` rows no record refers to. Format 6 only adds
//! the table: a format 4 or 5 catalog opens as one.
//!
//! A rowid table with a unique index, not a `WITHOUT ROWID` table keyed by
//! the identity: records carry digest blobs that overflow their pages, and
//! a `WITHOUT ROWID` key search then reads its large neighbours too
//! (measured: 100,000 records of ~100 blocks, 100,000 point lookups in
//! 3.77 s against 0.55-0.76 s with a rowid table). The page cache is set
//! to 64 MiB (the comparison is `bench/catalog-backends`).
//!
//! # Crash model
//!
//! Each run's changes are written in one transaction at the end of the run.
//! A run killed before commit leaves the previous run's catalog, which is
//! still correct: records are only trusted for files whose identity (inode,
//! size, mtime, ctime, and generation where it is checked) still matches, and
//! the kernel verifies every dedupe byte by byte anyway. SQLite's journal makes
//! the commit atomic. Each record carries a checksum, so a damaged page that
//! SQLite itself does not notice is still detected on load.
//!
//! # Memory
//!
//! A record's digests are held whole only up to [`LONG_LIST`](onecopy_scan::LONG_LIST) blocks. A
//! longer list (a file of more than 256 MiB at 4 KiB blocks) goes between
//! its `lists` blob and the run's scratch file ([`SpillHandle`]) in
//! pieces, so that a 1 TiB file costs the run no more RAM than a small
//! one. A blob longer than SQLite allows (1 GB: a file over about 476 GiB
//! at 4 KiB blocks) is not written: that file is read again by each run.

mod identify;
mod incremental;
pub mod place;

pub use identify::{identify, is_duperemove_hashfile, Existing, APPLICATION_ID};
pub use incremental::{classify, consult, Classified, Classifier, Consulted};

use std::path::{Path, PathBuf};

use onecopy_digest::{block_of_sub, sub_of_block, Blocks};
use onecopy_scan::{Digests, SpillHandle};
use rusqlite::{params, Connection, OpenFlags};
use xxhash_rust::xxh3::Xxh3;

/// The catalog format this build reads and writes.
pub const FORMAT_VERSION: i64 = 6;
const MAGIC: &str = "onecopy-catalog";

/// A catalog, its records, and why it was rebuilt if it was
/// ([`Catalog::open_and_load`]).
pub type Loaded = (Catalog, Vec<FileRecord>, Option<CatalogError>);

/// What the catalog knows about one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRecord {
    pub fs: String,
    pub subvol: u64,
    pub ino: u64,
    pub generation: u64,
    pub path: PathBuf,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub nlink: u64,
    pub whole: u128,
    /// Its block digests; empty when they are `long`.
    pub blocks: Vec<u128>,
    /// A list of more than [`LONG_LIST`](onecopy_scan::LONG_LIST) blocks, in the run's scratch
    /// file instead of `blocks` (see the module's "Memory").
    pub long: Option<Digests>,
    pub flags: u32,
    pub settled: bool,
    pub last_seen: u64,
}

impl FileRecord {
    fn checksum(&self) -> i64 {
        let mut h = self.checksum_head();
        for d in &self.blocks {
            h.update(&d.to_le_bytes());
        }
        self.checksum_tail(h)
    }

    /// The checksum's hash over the fields before the digests; they follow,
    /// then [`FileRecord::checksum_tail`].
    fn checksum_head(&self) -> Xxh3 {
        use std::os::unix::ffi::OsStrExt;
        let mut h = Xxh3::new();
        h.update(self.fs.as_bytes());
        for v in [
            self.subvol,
            self.ino,
            self.generation,
            self.size,
            self.nlink,
        ] {
            h.update(&v.to_le_bytes());
        }
        h.update(&(self.path.as_os_str().len() as u64).to_le_bytes());
        h.update(self.path.as_os_str().as_bytes());
        h.update(&self.mtime_ns.to_le_bytes());
        h.update(&self.ctime_ns.to_le_bytes());
        h.update(&self.whole.to_le_bytes());
        // Over the 16-byte digests whatever the blob's packing, so that
        // format 4 records keep their checksums.
        h
    }

    fn checksum_tail(&self, mut h: Xxh3) -> i64 {
        h.update(&self.flags.to_le_bytes());
        h.update(&[self.settled as u8]);
        h.update(&self.last_seen.to_le_bytes());
        h.digest() as i64
    }
}

/// Why a catalog could not be used as it was.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Sqlite {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("{path}: catalog format {found} is not format {FORMAT_VERSION} of this onecopy")]
    Version { path: PathBuf, found: i64 },
    #[error("{path}: not an onecopy catalog")]
    Foreign { path: PathBuf },
    /// An existing file that is not a catalog: left exactly as it is.
    #[error("{path} exists and is not an onecopy catalog; it is left untouched (choose another path, or remove it yourself)")]
    NotACatalog { path: PathBuf },
    #[error("{path}: damaged record ({what})")]
    Corrupt { path: PathBuf, what: String },
}

impl CatalogError {
    /// A failure of the machine, not of the catalog's bytes: I/O, a full
    /// disk, a lock held, no permission, no memory.
    pub fn is_circumstance(&self) -> bool {
        use rusqlite::ErrorCode as C;
        match self {
            CatalogError::Io { .. } => true,
            CatalogError::Sqlite { source, .. } => matches!(
                source.sqlite_error_code(),
                Some(
                    C::DiskFull
                        | C::SystemIoFailure
                        | C::DatabaseBusy
                        | C::DatabaseLocked
                        | C::CannotOpen
                        | C::ReadOnly
                        | C::PermissionDenied
                        | C::OutOfMemory
                )
            ),
            _ => false,
        }
    }

    /// The catalog file itself is damaged (not an I/O or usage error):
    /// it should be set aside and rebuilt.
    pub fn is_damage(&self) -> bool {
        use rusqlite::ErrorCode::{DatabaseCorrupt, NotADatabase};
        match self {
            CatalogError::Corrupt { .. } | CatalogError::Foreign { .. } => true,
            CatalogError::Sqlite { source, .. } => matches!(
                source.sqlite_error_code(),
                Some(DatabaseCorrupt | NotADatabase)
            ),
            _ => false,
        }
    }
}

/// What [`Catalog::after_failed_update`] did with the catalog.
#[derive(Debug)]
pub enum FailedUpdate {
    /// Not damage: the catalog stays where it is.
    Kept { error: CatalogError },
    /// Damaged: renamed to `aside`; the next run rebuilds it.
    SetAside { error: CatalogError, aside: PathBuf },
    /// Damaged, and renaming it failed too.
    SetAsideFailed {
        error: CatalogError,
        set_aside: CatalogError,
    },
}

impl std::fmt::Display for FailedUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FailedUpdate::Kept { error } => write!(f, "cannot update the catalog: {error}"),
            FailedUpdate::SetAside { error, aside } => write!(
                f,
                "cannot update the catalog: {error}; it is damaged and was set aside as {}; the next run rebuilds it",
                aside.display()
            ),
            FailedUpdate::SetAsideFailed { error, set_aside } => write!(
                f,
                "cannot update the catalog: {error}; setting it aside failed: {set_aside}"
            ),
        }
    }
}

/// Counts for `onecopy catalog stats`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CatalogStats {
    pub path: String,
    pub files: u64,
    pub blocks: u64,
    pub bytes: u64,
    pub file_size_on_disk: u64,
    pub runs: u64,
    pub last_run_unix: Option<i64>,
    pub block_size: Option<u64>,
}

/// SQLite page cache per open catalog, in KiB.
pub const CACHE_KIB: i64 = 8192;

/// SQLite page cache while every record is scanned ([`Catalog::for_each`]),
/// in KiB.
pub const SCAN_CACHE_KIB: i64 = 1024;

/// An open catalog.
pub struct Catalog {
    conn: Connection,
    path: PathBuf,
    run: u64,
    /// `meta.records` as read at open (`None`: written before it existed).
    records: Option<u64>,
    /// Where long lists go as they are read, and come from as they are
    /// written ([`Catalog::open_and_scan`]); without it they are read into
    /// RAM, and records that have them are not written.
    spill: Option<SpillHandle>,
}

/// An order-independent summary of `(key, rowid)` pairs: the table and
/// its unique index hold the same pairs exactly when their sums agree
/// (up to a 2^-64 chance), in constant memory.
#[derive(Default, PartialEq, Eq, Debug)]
struct KeySum {
    count: u64,
    sum: u64,
}

impl KeySum {
    fn add(&mut self, fs: &str, subvol: u64, ino: u64, rowid: i64) {
        let mut h = Xxh3::new();
        h.update(fs.as_bytes());
        h.update(&subvol.to_le_bytes());
        h.update(&ino.to_le_bytes());
        h.update(&rowid.to_le_bytes());
        self.count += 1;
        self.sum = self.sum.wrapping_add(h.digest());
    }
}

/// What `meta` says.
struct Meta {
    block_size: u64,
    records: Option<u64>,
}

/// Reads `meta` by a full scan of the table (not through its index, whose
/// damage SQLite's quick check does not see) and checks it: exactly one
/// magic row, exactly one numeric block size, at most one numeric record
/// count.
fn read_meta(conn: &Connection, path: &Path) -> Result<Meta, CatalogError> {
    let sq = sqlite_err(path);
    let mut st = conn
        .prepare("SELECT key, value FROM meta NOT INDEXED")
        .map_err(sq)?;
    let mut rows = st.query([]).map_err(sq)?;
    let (mut magic, mut bs, mut recs) = (Vec::new(), Vec::new(), Vec::new());
    while let Some(r) = rows.next().map_err(sq)? {
        let key: String = r.get(0).map_err(sq)?;
        let value: String = r.get(1).map_err(sq)?;
        match key.as_str() {
            "magic" => magic.push(value),
            "block_size" => bs.push(value),
            "records" => recs.push(value),
            _ => {}
        }
    }
    if magic.len() != 1 || magic[0] != MAGIC {
        return Err(CatalogError::Foreign {
            path: path.to_path_buf(),
        });
    }
    let block_size = one_number(path, "block size", &bs)?
        .ok_or_else(|| corrupt_err(path, "no block size row"))?;
    let records = one_number(path, "record count", &recs)?;
    Ok(Meta {
        block_size,
        records,
    })
}

fn corrupt_err(path: &Path, what: &str) -> CatalogError {
    CatalogError::Corrupt {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

/// The number in zero or one `meta` rows; more rows, or text that is not
/// a number, is damage.
fn one_number(path: &Path, name: &str, rows: &[String]) -> Result<Option<u64>, CatalogError> {
    match rows {
        [] => Ok(None),
        [one] => one
            .parse::<u64>()
            .map(Some)
            .map_err(|_| corrupt_err(path, &format!("{name} {one:?}"))),
        _ => Err(corrupt_err(path, &format!("{} {name} rows", rows.len()))),
    }
}

/// Drops the `lists` rows no record refers to, counts `files` (SQLite
/// counts through the smallest index, the unique key, a structure apart
/// from the table that loading scans) and records the count in `meta`.
/// Called inside each transaction that changes `files`.
fn store_record_count(conn: &Connection) -> rusqlite::Result<u64> {
    conn.execute(
        "DELETE FROM lists WHERE NOT EXISTS (SELECT 1 FROM files f
           WHERE f.fs = lists.fs AND f.subvol = lists.subvol AND f.ino = lists.ino
             AND f.blocks = ?1)",
        [IN_LISTS],
    )?;
    let n: i64 = conn.query_row("SELECT count(*) FROM files", [], |r| r.get(0))?;
    conn.execute(
        "INSERT OR REPLACE INTO meta VALUES ('records', ?1)",
        [n.to_string()],
    )?;
    Ok(n as u64)
}

/// First byte of a packed digest blob (format 5): every block digest of
/// the list is a [`block_of_sub`] digest and is stored as its 8-byte
/// sub-digest. A packed blob is 1 + 8n bytes, never a multiple of 16,
/// so it cannot be mistaken for a blob of 16-byte digests.
const PACKED: u8 = 1;

/// The whole `blocks` blob of a record whose list is in `lists` (format
/// 6).
const IN_LISTS: &[u8] = &[2];

/// The `blocks` blob of `v`: packed (8 B per block) when every digest is
/// a single filesystem block's ([`sub_of_block`]; all of them at the
/// default 4 KiB matching), else 16 B per block.
pub fn digests_to_blob(v: &[u128]) -> Vec<u8> {
    let packed = !v.is_empty() && v.iter().all(|&d| sub_of_block(d).is_some());
    let mut b = Vec::with_capacity(1 + v.len() * digest_bytes(packed));
    if packed {
        b.push(PACKED);
    }
    v.iter().for_each(|&d| put_digest(&mut b, d, packed));
    b
}

/// Decodes a `blocks` blob: 16-byte digests, or a packed blob of 8-byte
/// sub-digests ([`digests_to_blob`]); `None` if it is neither.
pub fn blob_to_digests(b: &[u8]) -> Option<Vec<u128>> {
    let (packed, _) = blob_shape(b.len() as u64)?;
    let digests = if packed {
        b.strip_prefix(&[PACKED])?
    } else {
        b
    };
    Some(
        digests
            .chunks_exact(digest_bytes(packed))
            .map(digest_from)
            .collect(),
    )
}

/// Bytes of one digest in a `blocks` blob.
fn digest_bytes(packed: bool) -> usize {
    if packed {
        8
    } else {
        16
    }
}

/// Appends `d` to a `blocks` blob, little-endian: its sub-digest when the
/// blob is `packed`, else all 16 bytes.
fn put_digest(out: &mut Vec<u8>, d: u128, packed: bool) {
    match packed {
        true => out.extend_from_slice(&(d as u64).to_le_bytes()),
        false => out.extend_from_slice(&d.to_le_bytes()),
    }
}

/// The digest in `c`: 8 bytes of a packed blob, or 16.
fn digest_from(c: &[u8]) -> u128 {
    match c.len() {
        8 => block_of_sub(u64::from_le_bytes(c.try_into().unwrap())),
        _ => u128::from_le_bytes(c.try_into().unwrap()),
    }
}

/// Where a list kept in `lists` goes as [`row_record`] reads it.
#[derive(Clone, Copy)]
enum Lists<'a> {
    /// Into the record's `blocks`.
    Ram,
    /// Into the scratch file, then the record's `long` (into `blocks` if
    /// the scratch file fails).
    Spill(&'a SpillHandle),
    /// Nowhere: only checked against the record's checksum and counted
    /// (for commands that need no digests: `stats`, `forget`).
    Checked,
}

/// The record in row `r` of [`Catalog::scan_each`]'s query, its
/// checksum checked, and its number of block digests; a list kept in
/// `lists` goes where `lists` says, in pieces.
fn row_record(
    r: &rusqlite::Row<'_>,
    path: &Path,
    (conn, lists): (&Connection, Lists<'_>),
) -> Result<(FileRecord, u64), CatalogError> {
    use std::os::unix::ffi::OsStringExt;
    let sq = sqlite_err(path);
    let corrupt = |what: &str| corrupt_err(path, what);
    let whole: Vec<u8> = r.get(8).map_err(sq)?;
    let blocks: Vec<u8> = r.get(9).map_err(sq)?;
    let mut rec = FileRecord {
        fs: r.get(0).map_err(sq)?,
        subvol: r.get::<_, i64>(1).map_err(sq)? as u64,
        ino: r.get::<_, i64>(2).map_err(sq)? as u64,
        generation: r.get::<_, i64>(3).map_err(sq)? as u64,
        path: PathBuf::from(std::ffi::OsString::from_vec(
            r.get::<_, Vec<u8>>(4).map_err(sq)?,
        )),
        size: r.get::<_, i64>(5).map_err(sq)? as u64,
        mtime_ns: r.get(6).map_err(sq)?,
        ctime_ns: r.get(7).map_err(sq)?,
        nlink: r.get::<_, i64>(14).map_err(sq)? as u64,
        whole: u128::from_le_bytes(
            whole
                .as_slice()
                .try_into()
                .map_err(|_| corrupt("whole digest"))?,
        ),
        blocks: Vec::new(),
        long: None,
        flags: r.get::<_, i64>(10).map_err(sq)? as u32,
        settled: r.get::<_, i64>(11).map_err(sq)? != 0,
        last_seen: r.get::<_, i64>(12).map_err(sq)? as u64,
    };
    let sum: i64 = r.get(13).map_err(sq)?;
    let (found, count) = if blocks == IN_LISTS {
        read_list(conn, lists, &mut rec, path)?
    } else {
        rec.blocks = blob_to_digests(&blocks).ok_or_else(|| corrupt("block digests"))?;
        (rec.checksum(), rec.blocks.len() as u64)
    };
    if sum != found {
        return Err(corrupt("checksum mismatch"));
    }
    Ok((rec, count))
}

/// Blocks moved between a `lists` blob and the scratch file at once.
const PIECE: usize = 1 << 14;

/// Whether a `blocks` blob of `len` bytes is packed, and its blocks.
fn blob_shape(len: u64) -> Option<(bool, u64)> {
    if len.is_multiple_of(16) {
        Some((false, len / 16))
    } else if len > 1 && (len - 1).is_multiple_of(8) {
        Some((true, (len - 1) / 8))
    } else {
        None
    }
}

/// Reads `rec`'s list from `lists` in pieces, where `to` says (into
/// `rec.blocks` when the scratch file fails); `rec`'s checksum over it
/// and its length.
fn read_list(
    conn: &Connection,
    to: Lists<'_>,
    rec: &mut FileRecord,
    path: &Path,
) -> Result<(i64, u64), CatalogError> {
    if !matches!(to, Lists::Ram) {
        match read_list_into(conn, to, rec, path) {
            Err(ListError::Scratch) => {}
            Err(ListError::Catalog(e)) => return Err(e),
            Ok(found) => return Ok(found),
        }
    }
    match read_list_into(conn, Lists::Ram, rec, path) {
        Ok(found) => Ok(found),
        Err(ListError::Catalog(e)) => Err(e),
        Err(ListError::Scratch) => unreachable!("no scratch file was used"),
    }
}

/// Why [`read_list_into`] stopped.
enum ListError {
    /// The catalog: damaged, or its disk.
    Catalog(CatalogError),
    /// The scratch file (full, broken): read into RAM instead.
    Scratch,
}

impl From<CatalogError> for ListError {
    fn from(e: CatalogError) -> Self {
        ListError::Catalog(e)
    }
}

/// [`read_list`] where `to` says, the scratch file's failure returned.
fn read_list_into(
    conn: &Connection,
    to: Lists<'_>,
    rec: &mut FileRecord,
    path: &Path,
) -> Result<(i64, u64), ListError> {
    use rusqlite::OptionalExtension;
    use std::io::Read;
    let sq = sqlite_err(path);
    let corrupt = || corrupt_err(path, "block digests");
    let found: Option<(i64, i64)> = conn
        .query_row(
            "SELECT rowid, length(blocks) FROM lists WHERE fs = ?1 AND subvol = ?2 AND ino = ?3",
            params![rec.fs, rec.subvol as i64, rec.ino as i64],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()
        .map_err(sq)?;
    let (rowid, len) = found.ok_or_else(corrupt)?;
    let (packed, n) = blob_shape(len as u64).ok_or_else(corrupt)?;
    let mut blob = conn
        .blob_open(rusqlite::MAIN_DB, "lists", "blocks", rowid, true)
        .map_err(sq)?;
    if packed {
        let mut tag = [0u8];
        blob.read_exact(&mut tag).map_err(blob_err(path))?;
        if tag[0] != PACKED {
            return Err(corrupt().into());
        }
    }
    let per = digest_bytes(packed);
    let mut w = match to {
        Lists::Spill(s) => Some((s, s.begin(n, packed).ok_or(ListError::Scratch)?)),
        Lists::Ram | Lists::Checked => None,
    };
    rec.blocks.clear();
    let mut h = rec.checksum_head();
    let (mut bytes, mut piece) = (Vec::new(), Vec::new());
    let mut left = n as usize;
    while left > 0 {
        let k = left.min(PIECE);
        bytes.resize(k * per, 0);
        blob.read_exact(&mut bytes).map_err(blob_err(path))?;
        piece.clear();
        piece.extend(bytes.chunks_exact(per).map(digest_from));
        piece.iter().for_each(|d| h.update(&d.to_le_bytes()));
        match &mut w {
            Some((s, w)) => s.write(w, &piece).map_err(|_| ListError::Scratch)?,
            None if matches!(to, Lists::Checked) => {}
            None => rec.blocks.extend_from_slice(&piece),
        }
        left -= k;
    }
    if let Some((s, w)) = w {
        rec.long = Some(s.finish(w).ok_or(ListError::Scratch)?);
    }
    Ok((rec.checksum_tail(h), n))
}

/// An error of reading a blob: SQLite's own (damage is then seen as
/// damage, and the catalog rebuilt), else I/O.
fn blob_err(path: &Path) -> impl Fn(std::io::Error) -> CatalogError + '_ {
    move |e: std::io::Error| match e.downcast::<rusqlite::Error>() {
        Ok(source) => sqlite_err(path)(source),
        Err(e) => io_err(path)(e),
    }
}

/// Writes `upserts`, replacing the records of the same keys. A record
/// with a long list is written from `spill` in pieces, or, when that can
/// not be (no scratch file, a list it could not give back, a blob longer
/// than SQLite allows), not at all: its old record goes, and its file is
/// read again by the next run.
fn upsert_records(
    conn: &Connection,
    upserts: impl IntoIterator<Item = FileRecord>,
    spill: Option<&SpillHandle>,
) -> rusqlite::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let mut ins = conn.prepare(
        "INSERT OR REPLACE INTO files (fs, subvol, ino, generation, path, size, mtime_ns, ctime_ns, whole, blocks, flags, settled, last_seen, checksum, nlink) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
    )?;
    for r in upserts {
        let list = match r.long {
            None => None,
            Some(d) => match spill.map(|s| s.blocks(&d)).and_then(list_blob) {
                Some(list) => Some(list),
                None => {
                    delete_records(conn, &[(r.fs.clone(), r.subvol, r.ino)])?;
                    continue;
                }
            },
        };
        let (blob, sum) = match list {
            None => (digests_to_blob(&r.blocks), r.checksum()),
            // Its checksum once its list is written.
            Some(_) => (IN_LISTS.to_vec(), 0),
        };
        ins.execute(params![
            r.fs,
            r.subvol as i64,
            r.ino as i64,
            r.generation as i64,
            r.path.as_os_str().as_bytes(),
            r.size as i64,
            r.mtime_ns,
            r.ctime_ns,
            &r.whole.to_le_bytes()[..],
            blob,
            r.flags as i64,
            r.settled as i64,
            r.last_seen as i64,
            sum,
            r.nlink as i64,
        ])?;
        if let Some(list) = list {
            write_list(conn, conn.last_insert_rowid(), list, &r)?;
        }
    }
    Ok(())
}

/// The longest `lists` blob written: SQLite's longest row (its default
/// `SQLITE_MAX_LENGTH`, which the bundled build keeps) less room for the
/// row's other columns and header.
const MAX_BLOB: u64 = 1_000_000_000 - (64 << 10);

/// A long list as its `lists` blob will hold it.
struct ListBlob<'a> {
    blocks: Blocks<'a>,
    /// Packed (a list of single sub-blocks), and the blob's length.
    packed: bool,
    len: i64,
}

/// `b` as a `lists` blob, if SQLite can hold it.
fn list_blob(b: Blocks<'_>) -> Option<ListBlob<'_>> {
    let packed = matches!(b, Blocks::Paged { one_sub: true, .. });
    let len = u64::from(packed) + (b.len() * digest_bytes(packed)) as u64;
    (len <= MAX_BLOB).then_some(ListBlob {
        blocks: b,
        packed,
        len: len as i64,
    })
}

/// Writes `list`, the long list of `r` (the record in `files` row
/// `rowid`), into `lists` in pieces, then `r`'s checksum; the record goes
/// if the list can not be read whole (its file is read again by the next
/// run).
fn write_list(
    conn: &Connection,
    rowid: i64,
    list: ListBlob<'_>,
    r: &FileRecord,
) -> rusqlite::Result<()> {
    use std::io::Write;
    let ListBlob {
        blocks: b,
        packed,
        len,
    } = list;
    conn.execute(
        "INSERT OR REPLACE INTO lists (fs, subvol, ino, blocks) VALUES (?1, ?2, ?3, zeroblob(?4))",
        params![r.fs, r.subvol as i64, r.ino as i64, len],
    )?;
    let list = conn.last_insert_rowid();
    let mut blob = conn.blob_open(rusqlite::MAIN_DB, "lists", "blocks", list, false)?;
    let mut h = r.checksum_head();
    let mut bytes = Vec::new();
    if packed {
        bytes.push(PACKED);
    }
    let mut piece = Vec::new();
    let mut at = 0;
    while at < b.len() {
        piece.clear();
        let got = b.read(at, &mut piece, PIECE);
        if got == 0 {
            drop(blob);
            conn.execute("DELETE FROM files WHERE rowid = ?1", [rowid])?;
            return Ok(());
        }
        for &d in &piece {
            h.update(&d.to_le_bytes());
            put_digest(&mut bytes, d, packed);
        }
        blob.write_all(&bytes).map_err(io_to_sqlite)?;
        bytes.clear();
        at += got;
    }
    drop(blob);
    let sum = r.checksum_tail(h);
    conn.execute(
        "UPDATE files SET checksum = ?1 WHERE rowid = ?2",
        params![sum, rowid],
    )?;
    Ok(())
}

fn io_to_sqlite(e: std::io::Error) -> rusqlite::Error {
    rusqlite::Error::ToSqlConversionFailure(Box::new(e))
}

/// Deletes the records of the keys (fs, subvol, ino) in `deletes`.
fn delete_records(conn: &Connection, deletes: &[(String, u64, u64)]) -> rusqlite::Result<()> {
    let mut del = conn.prepare("DELETE FROM files WHERE fs = ?1 AND subvol = ?2 AND ino = ?3")?;
    for (fs, sv, ino) in deletes {
        del.execute(params![fs, *sv as i64, *ino as i64])?;
    }
    Ok(())
}

/// Records run `run` over `roots`, started now.
fn record_run(conn: &Connection, run: u64, roots: &[PathBuf]) -> rusqlite::Result<()> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let roots: Vec<String> = roots.iter().map(|p| p.display().to_string()).collect();
    conn.execute(
        "INSERT OR REPLACE INTO runs VALUES (?1, ?2, ?3)",
        params![run as i64, now, roots.join("\n")],
    )?;
    Ok(())
}

/// Wraps SQLite's errors with the catalog's `path`.
fn sqlite_err(path: &Path) -> impl Fn(rusqlite::Error) -> CatalogError + Copy + '_ {
    move |source| CatalogError::Sqlite {
        path: path.to_path_buf(),
        source,
    }
}

/// Wraps I/O errors with `path`.
fn io_err(path: &Path) -> impl Fn(std::io::Error) -> CatalogError + Copy + '_ {
    move |source| CatalogError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Creates the directory `path` goes in (mode 0700: a catalog names the
/// files of trees other users may not see, and their fingerprints).
fn create_parent(path: &Path) -> Result<(), CatalogError> {
    use std::os::unix::fs::DirBuilderExt;
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err(dir)),
        _ => Ok(()),
    }
}

/// Opens the database at `path` (`fresh`: a file being created) with the
/// catalog's settings; its `user_version`. A file that is not SQLite is
/// [`CatalogError::Foreign`].
fn connect(path: &Path, fresh: bool) -> Result<(Connection, i64), CatalogError> {
    let sq = sqlite_err(path);
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(sq)?;
    conn.busy_timeout(std::time::Duration::from_secs(30))
        .map_err(sq)?;
    // Any non-SQLite file fails here.
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(|e| match e {
            rusqlite::Error::SqliteFailure(ref f, _)
                if f.code == rusqlite::ErrorCode::NotADatabase =>
            {
                CatalogError::Foreign {
                    path: path.to_path_buf(),
                }
            }
            e => sq(e),
        })?;
    if fresh {
        // The id goes into the main file's header first (rollback
        // journal, committed), before WAL mode sends everything else to
        // the `-wal`: a run killed at any later point leaves a file
        // that is recognised as a catalog (and rebuilt), not refused.
        conn.pragma_update(None, "application_id", APPLICATION_ID)
            .map_err(sq)?;
    }
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(sq)?;
    // A bounded page cache (KiB when negative): records are written in
    // key order, so a small cache costs no extra I/O, and the run's
    // memory stays independent of the catalog's size.
    conn.pragma_update(None, "cache_size", -CACHE_KIB)
        .map_err(sq)?;
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(sq)?;
    Ok((conn, version))
}

/// Makes an empty database a catalog for `block_size`; one that holds
/// tables already is [`CatalogError::Foreign`].
fn create_tables(conn: &Connection, path: &Path, block_size: u64) -> Result<(), CatalogError> {
    let sq = sqlite_err(path);
    let has_tables: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
        .map_err(sq)?;
    if has_tables > 0 {
        return Err(CatalogError::Foreign {
            path: path.to_path_buf(),
        });
    }
    conn.execute_batch(
        "BEGIN;
         CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
         CREATE TABLE files (
           fs TEXT NOT NULL, subvol INTEGER NOT NULL, ino INTEGER NOT NULL,
           generation INTEGER NOT NULL, path BLOB NOT NULL,
           size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
           nlink INTEGER NOT NULL,
           whole BLOB NOT NULL, blocks BLOB NOT NULL, flags INTEGER NOT NULL,
           settled INTEGER NOT NULL, last_seen INTEGER NOT NULL, checksum INTEGER NOT NULL,
           UNIQUE (fs, subvol, ino));
         CREATE TABLE runs (run INTEGER PRIMARY KEY, started INTEGER NOT NULL, roots TEXT NOT NULL);
         CREATE TABLE lists (
           fs TEXT NOT NULL, subvol INTEGER NOT NULL, ino INTEGER NOT NULL, blocks BLOB NOT NULL,
           UNIQUE (fs, subvol, ino));
         COMMIT;",
    )
    .map_err(sq)?;
    conn.execute("INSERT INTO meta VALUES ('magic', ?1)", [MAGIC])
        .map_err(sq)?;
    conn.execute(
        "INSERT INTO meta VALUES ('block_size', ?1)",
        [block_size.to_string()],
    )
    .map_err(sq)?;
    conn.pragma_update(None, "user_version", FORMAT_VERSION)
        .map_err(sq)?;
    conn.pragma_update(None, "application_id", APPLICATION_ID)
        .map_err(sq)
}

/// Digests of another block size are useless: empties `files` and
/// records `block_size`; the record count (0).
fn reset_block_size(conn: &Connection, block_size: u64) -> rusqlite::Result<u64> {
    conn.execute_batch("DELETE FROM files;")?;
    conn.execute(
        "UPDATE meta SET value = ?1 WHERE key = 'block_size'",
        [block_size.to_string()],
    )?;
    store_record_count(conn)
}

/// The number of the run about to start: one past the last recorded.
fn next_run(conn: &Connection) -> rusqlite::Result<u64> {
    let last = conn.query_row(
        "SELECT coalesce(max(CAST(run AS INTEGER)), 0) FROM runs",
        [],
        |r| r.get::<_, i64>(0),
    )?;
    Ok(last as u64 + 1)
}

impl Catalog {
    /// Opens the catalog at `path` for `block_size`, creating it if absent.
    /// A catalog of another format, block size, or that is not a catalog,
    /// is an error: see [`Catalog::open_or_rebuild`].
    pub fn open(path: &Path, block_size: u64) -> Result<Catalog, CatalogError> {
        let sq = sqlite_err(path);
        create_parent(path)?;
        // Never open another program's file read-write: SQLite would
        // switch its journal mode, create a WAL and change its times.
        let fresh = match identify(path).map_err(io_err(path))? {
            Existing::Foreign => {
                return Err(CatalogError::NotACatalog {
                    path: path.to_path_buf(),
                })
            }
            Existing::Nothing => true,
            Existing::Catalog => false,
        };
        if fresh {
            // Made here, mode 0600, before SQLite makes it 0644 (its WAL
            // and shared memory files take the database file's mode).
            use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
            let f = std::fs::File::options()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(path)
                .map_err(io_err(path))?;
            // An empty file that was there already (counted as none).
            f.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(io_err(path))?;
        }
        let (conn, version) = connect(path, fresh)?;
        if fresh || version == 0 {
            create_tables(&conn, path, block_size)?;
        } else if version == 4 || version == 5 {
            // Format 5 only adds packed blobs, 6 the `lists` table: older
            // catalogs are one once it is there (older binaries then see
            // 6 and rebuild theirs).
            conn.execute_batch(
                "BEGIN;
                 CREATE TABLE IF NOT EXISTS lists (
                   fs TEXT NOT NULL, subvol INTEGER NOT NULL, ino INTEGER NOT NULL,
                   blocks BLOB NOT NULL, UNIQUE (fs, subvol, ino));
                 PRAGMA user_version = 6;
                 COMMIT;",
            )
            .map_err(sq)?;
        } else if version != FORMAT_VERSION {
            return Err(CatalogError::Version {
                path: path.to_path_buf(),
                found: version,
            });
        }
        let meta = read_meta(&conn, path)?;
        let mut records = meta.records;
        // Catalogs from before the application id get it now.
        conn.pragma_update(None, "application_id", APPLICATION_ID)
            .map_err(sq)?;
        if meta.block_size != block_size {
            records = Some(reset_block_size(&conn, block_size).map_err(sq)?);
        }
        let run = next_run(&conn).map_err(sq)?;
        Ok(Catalog {
            conn,
            path: path.to_path_buf(),
            run,
            records,
            spill: None,
        })
    }

    /// Opens an existing catalog with whatever block size it was made for
    /// (for inspection and pruning).
    pub fn open_existing(path: &Path) -> Result<Catalog, CatalogError> {
        // Another program's file is never opened by SQLite.
        if identify(path).map_err(io_err(path))? != Existing::Catalog {
            return Err(CatalogError::NotACatalog {
                path: path.to_path_buf(),
            });
        }
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(sqlite_err(path))?;
        let bs = read_meta(&conn, path)?.block_size;
        drop(conn);
        Catalog::open(path, bs)
    }

    /// Opens the catalog at a path the user named, and if it is a damaged
    /// catalog or one of another format, sets it aside as `<path>.broken`
    /// and creates a new one. An existing file that is not a catalog is
    /// refused ([`CatalogError::NotACatalog`]) and left untouched. Returns
    /// the reason it was rebuilt, if it was.
    pub fn open_or_rebuild(
        path: &Path,
        block_size: u64,
    ) -> Result<(Catalog, Option<CatalogError>), CatalogError> {
        Self::rebuild_if(path, block_size, false).map(|(c, _, why)| (c, why))
    }

    /// The same at onecopy's own default path (its cache directory, its
    /// `fs-<id>.sqlite` name): whatever is there was a catalog
    /// once, so unreadable content is set aside and rebuilt too.
    pub fn open_or_rebuild_own(
        path: &Path,
        block_size: u64,
    ) -> Result<(Catalog, Option<CatalogError>), CatalogError> {
        Self::rebuild_if(path, block_size, true).map(|(c, _, why)| (c, why))
    }

    /// [`Catalog::open_or_rebuild`], also returning every record: checking
    /// the catalog reads them all, so a run loads it once, not twice.
    pub fn open_and_load(path: &Path, block_size: u64) -> Result<Loaded, CatalogError> {
        Self::rebuild_if(path, block_size, false)
    }

    /// [`Catalog::open_or_rebuild_own`], also returning every record.
    pub fn open_and_load_own(path: &Path, block_size: u64) -> Result<Loaded, CatalogError> {
        Self::rebuild_if(path, block_size, true)
    }

    fn rebuild_if(path: &Path, block_size: u64, own: bool) -> Result<Loaded, CatalogError> {
        let mut records = Vec::new();
        let keep = &mut |r| records.push(r);
        let (c, why) = Self::scan_or_rebuild(path, block_size, (own, None), keep)?;
        if why.is_some() {
            records = Vec::new();
        }
        Ok((c, records, why))
    }

    /// [`Catalog::open_or_rebuild`] (`own`: [`Catalog::open_or_rebuild_own`])
    /// that hands every record to `f` as it is checked, one at a time: a
    /// run reads the catalog once and keeps no list of records. When a
    /// record fails its check part way, the catalog is set aside and
    /// rebuilt, and the reason is returned: `f` has then seen some records
    /// of the old catalog, which the caller must forget. Long lists go to
    /// `spill` as they are read, and come from it when the catalog is
    /// written (see the module's "Memory").
    pub fn open_and_scan(
        path: &Path,
        block_size: u64,
        (own, spill): (bool, Option<SpillHandle>),
        f: &mut dyn FnMut(FileRecord),
    ) -> Result<(Catalog, Option<CatalogError>), CatalogError> {
        Self::scan_or_rebuild(path, block_size, (own, spill), f)
    }

    fn scan_or_rebuild(
        path: &Path,
        block_size: u64,
        (own, spill): (bool, Option<SpillHandle>),
        f: &mut dyn FnMut(FileRecord),
    ) -> Result<(Catalog, Option<CatalogError>), CatalogError> {
        let open = |path| {
            Catalog::open(path, block_size).map(|c| Catalog {
                spill: spill.clone(),
                ..c
            })
        };
        match open(path).and_then(|c| c.for_each(f).map(|()| c)) {
            Ok(c) => Ok((c, None)),
            Err(e @ CatalogError::NotACatalog { .. }) if !own => Err(e),
            // A full disk, I/O, a lock or a permission says nothing
            // against the catalog: it stays for the next run.
            Err(e) if e.is_circumstance() => Err(e),
            // Damage (whatever form SQLite or decoding gives it), another
            // format, a file in our place: rebuilt.
            Err(why) => {
                Self::set_aside(path, own)?;
                Ok((open(path)?, Some(why)))
            }
        }
    }

    fn set_aside(path: &Path, own: bool) -> Result<(), CatalogError> {
        // A user-named path only ever if it is a catalog (checked again:
        // this renames a user's file).
        if !own && identify(path).ok() != Some(Existing::Catalog) {
            return Err(CatalogError::NotACatalog {
                path: path.to_path_buf(),
            });
        }
        let mut aside = path.as_os_str().to_owned();
        aside.push(".broken");
        let _ = std::fs::remove_file(&aside);
        std::fs::rename(path, &aside).map_err(|source| CatalogError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        for ext in ["-wal", "-shm"] {
            let mut p = path.as_os_str().to_owned();
            p.push(ext);
            let _ = std::fs::remove_file(p);
        }
        Ok(())
    }

    /// The rule after a failed update: a catalog whose update failed
    /// because it is damaged (damage its loading did not notice: SQLite
    /// reports it only when a write reaches the damaged page) is set aside,
    /// so that the next run rebuilds it rather than failing the same way
    /// forever; any other failure leaves it where it is. Files are never
    /// affected either way.
    pub fn after_failed_update(self, error: CatalogError) -> FailedUpdate {
        if !error.is_damage() {
            return FailedUpdate::Kept { error };
        }
        match self.set_aside_damaged() {
            Ok(aside) => FailedUpdate::SetAside { error, aside },
            Err(set_aside) => FailedUpdate::SetAsideFailed { error, set_aside },
        }
    }

    /// Closes a catalog found damaged after it was opened (see
    /// [`CatalogError::is_damage`]) and renames it `<path>.broken`, which
    /// is returned; the next open creates a new one.
    pub fn set_aside_damaged(self) -> Result<PathBuf, CatalogError> {
        let path = self.path;
        drop(self.conn);
        // Opened by this process as a catalog: ours to rename.
        Self::set_aside(&path, true)?;
        let mut aside = path.into_os_string();
        aside.push(".broken");
        Ok(PathBuf::from(aside))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// This run's number (one more than the last recorded run).
    pub fn run(&self) -> u64 {
        self.run
    }

    /// Every record, checked against its checksum: every long list held
    /// whole at once, so for tests; commands use [`Catalog::for_each`].
    pub fn load_all(&self) -> Result<Vec<FileRecord>, CatalogError> {
        let mut out = Vec::new();
        self.for_each(&mut |r| out.push(r))?;
        Ok(out)
    }

    /// Hands every record to `f` in storage order, each checked against
    /// its checksum before it is handed over; stops at the first that
    /// fails (the records before it have been handed over). The record
    /// count and the key index are checked after the last record: their
    /// error comes after every record was handed over.
    ///
    /// The scan reads each page once, so it runs with a page cache of
    /// [`SCAN_CACHE_KIB`], not [`CACHE_KIB`]: a warm run's catalog pages
    /// would otherwise stay cached through its planning, the run's peak.
    pub fn for_each(&self, f: &mut dyn FnMut(FileRecord)) -> Result<(), CatalogError> {
        let lists = self.spill.as_ref().map_or(Lists::Ram, Lists::Spill);
        self.scan(lists, &mut |r, _| f(r))
    }

    /// [`Catalog::for_each`] for commands that need no digests: every
    /// record is checked, but a long list is only counted (never held,
    /// whatever its length), handed over with its record's `long` unset.
    fn for_each_counted(&self, f: &mut dyn FnMut(FileRecord, u64)) -> Result<(), CatalogError> {
        self.scan(Lists::Checked, f)
    }

    fn scan(
        &self,
        lists: Lists<'_>,
        f: &mut dyn FnMut(FileRecord, u64),
    ) -> Result<(), CatalogError> {
        // Only memory: a refusal changes nothing else.
        let _ = self.conn.pragma_update(None, "cache_size", -SCAN_CACHE_KIB);
        let scanned = self.scan_each(lists, f);
        let _ = self.conn.pragma_update(None, "cache_size", -CACHE_KIB);
        scanned
    }

    fn scan_each(
        &self,
        lists: Lists<'_>,
        f: &mut dyn FnMut(FileRecord, u64),
    ) -> Result<(), CatalogError> {
        let sq = sqlite_err(&self.path);
        let mut st = self
            .conn
            .prepare(
                "SELECT fs, subvol, ino, generation, path, size, mtime_ns, ctime_ns, whole, blocks,
                        flags, settled, last_seen, checksum, nlink, rowid FROM files NOT INDEXED",
            )
            .map_err(sq)?;
        let long = (&self.conn, lists);
        let mut rows = st.query([]).map_err(sq)?;
        let mut keys = KeySum::default();
        while let Some(r) = rows.next().map_err(sq)? {
            let (rec, count) = row_record(r, &self.path, long)?;
            keys.add(&rec.fs, rec.subvol, rec.ino, r.get(15).map_err(sq)?);
            f(rec, count);
        }
        if keys != self.index_keys().map_err(sq)? {
            return Err(CatalogError::Corrupt {
                path: self.path.clone(),
                what: "the key index does not match the records".into(),
            });
        }
        match self.records {
            Some(n) if n != keys.count => Err(CatalogError::Corrupt {
                path: self.path.clone(),
                what: format!("{} records found, {n} recorded", keys.count),
            }),
            _ => Ok(()),
        }
    }

    /// [`KeySum`] of the unique key index, read from the index alone: a
    /// damaged index that SQLite does not notice would make an upsert
    /// replace the wrong record.
    fn index_keys(&self) -> rusqlite::Result<KeySum> {
        let mut st = self.conn.prepare(
            "SELECT fs, subvol, ino, rowid FROM files INDEXED BY sqlite_autoindex_files_1
             ORDER BY fs, subvol, ino",
        )?;
        let mut rows = st.query([])?;
        let mut keys = KeySum::default();
        while let Some(r) = rows.next()? {
            let fs: String = r.get(0)?;
            keys.add(
                &fs,
                r.get::<_, i64>(1)? as u64,
                r.get::<_, i64>(2)? as u64,
                r.get(3)?,
            );
        }
        Ok(keys)
    }

    /// Writes a run's changes in one transaction: `upserts` replace records
    /// with the same key, `deletes` remove keys; the run is recorded.
    pub fn commit_run(
        &mut self,
        roots: &[PathBuf],
        upserts: impl IntoIterator<Item = FileRecord>,
        deletes: &[(String, u64, u64)],
    ) -> Result<(), CatalogError> {
        let sq = sqlite_err(&self.path);
        let tx = self.conn.transaction().map_err(sq)?;
        upsert_records(&tx, upserts, self.spill.as_ref()).map_err(sq)?;
        delete_records(&tx, deletes).map_err(sq)?;
        record_run(&tx, self.run, roots).map_err(sq)?;
        let records = store_record_count(&tx).map_err(sq)?;
        tx.commit().map_err(sq)?;
        self.records = Some(records);
        Ok(())
    }

    /// Removes every record whose path is `prefix` or below it. Returns the
    /// number removed.
    /// Records are looked at one at a time, their lists checked, never held.
    pub fn forget(&mut self, prefix: &Path) -> Result<u64, CatalogError> {
        let mut gone: Vec<(String, u64, u64)> = Vec::new();
        self.for_each_counted(&mut |r, _| {
            if r.path.starts_with(prefix) {
                gone.push((r.fs, r.subvol, r.ino));
            }
        })?;
        let n = gone.len() as u64;
        let path = self.path.clone();
        let sq = |source| CatalogError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self.conn.transaction().map_err(sq)?;
        delete_records(&tx, &gone).map_err(sq)?;
        let records = store_record_count(&tx).map_err(sq)?;
        tx.commit().map_err(sq)?;
        self.records = Some(records);
        Ok(n)
    }

    /// Counts for display, summed one record at a time, long lists
    /// checked but never held (three 100 GiB sparse files' lists took
    /// 1.24 GB, and one list was still read whole after that).
    pub fn stats(&self) -> Result<CatalogStats, CatalogError> {
        let (mut files, mut blocks, mut bytes) = (0u64, 0u64, 0u64);
        self.for_each_counted(&mut |r, count| {
            files += 1;
            blocks += count;
            bytes += r.size;
        })?;
        let sq = |source| CatalogError::Sqlite {
            path: self.path.clone(),
            source,
        };
        let (runs, last): (i64, Option<i64>) = self
            .conn
            .query_row(
                "SELECT count(*), max(CAST(started AS INTEGER)) FROM runs",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(sq)?;
        let bs: Option<String> = self
            .conn
            .query_row("SELECT value FROM meta WHERE key = 'block_size'", [], |r| {
                r.get(0)
            })
            .ok();
        let mut size = 0;
        for ext in ["", "-wal"] {
            let mut p = self.path.as_os_str().to_owned();
            p.push(ext);
            size += std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        }
        Ok(CatalogStats {
            path: self.path.display().to_string(),
            files,
            blocks,
            bytes,
            file_size_on_disk: size,
            runs: runs as u64,
            last_run_unix: last,
            block_size: bs.and_then(|b| b.parse().ok()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use onecopy_scan::DigestStore;

    fn rec(ino: u64) -> FileRecord {
        FileRecord {
            fs: "uuid:ab".into(),
            subvol: 5,
            ino,
            generation: 7,
            path: PathBuf::from(format!("/data/f{ino}")),
            size: 100_000,
            mtime_ns: 1,
            ctime_ns: 2,
            nlink: 1,
            whole: 0xdead_beef,
            blocks: vec![1, 2, u128::MAX],
            long: None,
            flags: 0,
            settled: false,
            last_seen: 1,
        }
    }

    /// A catalog opened on a full disk is kept for the next run: a full
    /// disk says nothing against it (it was renamed `.broken` and an
    /// empty one made, so the next run read every file again). Needs root
    /// (a 2 MiB tmpfs).
    #[test]
    fn a_full_disk_is_not_damage() {
        let fs = onecopy_testfs::LoopFs::new(onecopy_testfs::FsKind::Tmpfs, 2 << 20)
            .expect("a 2 MiB tmpfs (needs root)");
        let m = fs.path();
        let p = m.join("c.sqlite");
        let mut c = Catalog::open(&p, 65536).unwrap();
        c.commit_run(&[], (1..50).map(rec).collect::<Vec<_>>(), &[])
            .unwrap();
        drop(c);
        let before = std::fs::read(&p).unwrap();
        let mut filler = std::fs::File::create(m.join("filler")).unwrap();
        while std::io::Write::write_all(&mut filler, &[7; 4096]).is_ok() {}
        drop(filler);
        match Catalog::open_or_rebuild_own(&p, 65536) {
            Err(e) => assert!(!e.is_damage(), "{e}"),
            Ok((c, why)) => {
                assert!(why.is_none(), "{why:?}");
                assert_eq!(c.load_all().unwrap().len(), 49);
            }
        }
        assert!(!m.join("c.sqlite.broken").exists(), "set aside");
        assert_eq!(std::fs::read(&p).unwrap(), before);
    }

    /// A new catalog and the directories made for it are closed to other
    /// users: it names files of trees they may not see.
    #[test]
    fn a_new_catalog_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("made/here/fs-1.sqlite");
        let c = Catalog::open(&path, 4096).unwrap();
        c.stats().unwrap();
        drop(c);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        assert_eq!(mode(&d.path().join("made")), 0o700);
    }

    /// A failed update sets the catalog aside only when it is damage; an
    /// I/O error leaves the file where it is.
    #[test]
    fn failed_updates_set_aside_only_damaged_catalogs() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let c = Catalog::open(&p, 65536).unwrap();
        let io = CatalogError::Io {
            path: p.clone(),
            source: std::io::Error::other("no space left on device"),
        };
        let kept = c.after_failed_update(io);
        assert!(matches!(kept, FailedUpdate::Kept { .. }), "{kept}");
        assert!(p.exists());
        let c = Catalog::open(&p, 65536).unwrap();
        let damage = CatalogError::Corrupt {
            path: p.clone(),
            what: "test".into(),
        };
        let aside = c.after_failed_update(damage);
        let FailedUpdate::SetAside { aside: to, .. } = &aside else {
            panic!("{aside}");
        };
        assert!(!p.exists() && to.exists(), "{aside}");
        assert!(aside.to_string().contains("the next run rebuilds it"));
    }

    #[test]
    fn roundtrip_and_delete() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let mut c = Catalog::open(&p, 65536).unwrap();
        c.commit_run(&[], vec![rec(1), rec(2)], &[]).unwrap();
        assert_eq!(c.load_all().unwrap().len(), 2);
        c.commit_run(&[], Vec::new(), &[("uuid:ab".into(), 5, 1)])
            .unwrap();
        let all = c.load_all().unwrap();
        assert_eq!(all, vec![rec(2)]);
        drop(c);
        let c = Catalog::open(&p, 65536).unwrap();
        assert_eq!(c.run(), 2);
        assert_eq!(c.stats().unwrap().files, 1);
    }

    #[test]
    fn other_block_size_starts_over() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let mut c = Catalog::open(&p, 65536).unwrap();
        c.commit_run(&[], vec![rec(1)], &[]).unwrap();
        drop(c);
        let c = Catalog::open(&p, 4096).unwrap();
        assert!(c.load_all().unwrap().is_empty());
    }

    #[test]
    fn foreign_and_damaged_files_are_rebuilt() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let text = b"this is not a database at all, just some text that is long enough";
        std::fs::write(&p, text).unwrap();
        // Not a catalog: refused, never set aside.
        assert!(matches!(
            Catalog::open(&p, 65536),
            Err(CatalogError::NotACatalog { .. })
        ));
        assert!(matches!(
            Catalog::open_or_rebuild(&p, 65536),
            Err(CatalogError::NotACatalog { .. })
        ));
        assert_eq!(std::fs::read(&p).unwrap(), text);
        // At onecopy's own default path, whatever is there is rebuilt.
        let (c, why) = Catalog::open_or_rebuild_own(&p, 65536).unwrap();
        assert!(matches!(why, Some(CatalogError::NotACatalog { .. })));
        drop(c);
        assert_eq!(
            std::fs::read(d.path().join("c.sqlite.broken")).unwrap(),
            text
        );
        std::fs::remove_file(&p).unwrap();
        // A catalog damaged past its header is set aside and rebuilt.
        let c = Catalog::open(&p, 65536).unwrap();
        drop(c);
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(1000).unwrap();
        drop(f);
        let (c, why) = Catalog::open_or_rebuild(&p, 65536).unwrap();
        assert!(why.is_some());
        assert!(c.load_all().unwrap().is_empty());
        drop(c);
        // A record whose checksum does not match is detected.
        let mut c = Catalog::open(&p, 65536).unwrap();
        c.commit_run(&[], vec![rec(1)], &[]).unwrap();
        c.conn.execute("UPDATE files SET size = 5", []).unwrap();
        assert!(matches!(c.load_all(), Err(CatalogError::Corrupt { .. })));
        drop(c);
        let (c, why) = Catalog::open_or_rebuild(&p, 65536).unwrap();
        assert!(matches!(why, Some(CatalogError::Corrupt { .. })));
        assert!(c.load_all().unwrap().is_empty());
        // Another format version.
        c.conn.pragma_update(None, "user_version", 99).unwrap();
        drop(c);
        assert!(matches!(
            Catalog::open(&p, 65536),
            Err(CatalogError::Version { found: 99, .. })
        ));
        let (_c, why) = Catalog::open_or_rebuild(&p, 65536).unwrap();
        assert!(matches!(why, Some(CatalogError::Version { .. })));
    }

    #[test]
    fn a_new_catalog_is_recognised_before_any_checkpoint() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let c = Catalog::open(&p, 65536).unwrap();
        // Still open: the tables live in the WAL, the header in the file.
        let head = std::fs::read(&p).unwrap();
        assert_eq!(head[68..72], APPLICATION_ID.to_be_bytes());
        assert_eq!(identify(&p).unwrap(), Existing::Catalog);
        drop(c);
    }

    #[test]
    fn open_and_load_returns_the_records_it_checked() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let (mut c, recs, why) = Catalog::open_and_load(&p, 65536).unwrap();
        assert!(recs.is_empty() && why.is_none());
        c.commit_run(&[], vec![rec(1), rec(2)], &[]).unwrap();
        drop(c);
        let (c, recs, why) = Catalog::open_and_load(&p, 65536).unwrap();
        assert!(why.is_none());
        assert_eq!(recs, c.load_all().unwrap());
        assert_eq!(recs.len(), 2);
    }

    #[test]
    fn a_record_lost_without_a_checksum_error_is_detected() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let mut c = Catalog::open(&p, 65536).unwrap();
        c.commit_run(&[], vec![rec(1), rec(2), rec(3)], &[])
            .unwrap();
        // What a damaged b-tree page can do: a record gone, every other
        // one intact and checksummed.
        c.conn
            .execute("DELETE FROM files WHERE ino = 2", [])
            .unwrap();
        drop(c);
        let c = Catalog::open(&p, 65536).unwrap();
        match c.load_all() {
            Err(CatalogError::Corrupt { what, .. }) => {
                assert_eq!(what, "2 records found, 3 recorded")
            }
            other => panic!("not detected: {other:?}"),
        }
        drop(c);
        let (_c, recs, why) = Catalog::open_and_load(&p, 65536).unwrap();
        assert!(matches!(why, Some(CatalogError::Corrupt { .. })));
        assert!(recs.is_empty());
    }

    #[test]
    fn a_catalog_without_a_record_count_loads_and_gets_one() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let mut c = Catalog::open(&p, 65536).unwrap();
        c.commit_run(&[], vec![rec(1), rec(2)], &[]).unwrap();
        c.conn
            .execute("DELETE FROM meta WHERE key = 'records'", [])
            .unwrap();
        drop(c);
        let mut c = Catalog::open(&p, 65536).unwrap();
        assert_eq!(c.load_all().unwrap().len(), 2);
        c.commit_run(&[], vec![rec(3)], &[]).unwrap();
        c.forget(Path::new("/data/f1")).unwrap();
        drop(c);
        let c = Catalog::open(&p, 65536).unwrap();
        assert_eq!(c.records, Some(2));
        assert_eq!(c.load_all().unwrap().len(), 2);
    }

    #[test]
    fn blob_decoding_rejects_bad_lengths() {
        assert_eq!(blob_to_digests(&[0u8; 32]).unwrap().len(), 2);
        assert!(blob_to_digests(&[0u8; 17]).is_none());
        assert!(blob_to_digests(&[PACKED]).is_none());
        assert!(blob_to_digests(&[PACKED, 0, 0]).is_none());
    }

    /// A format 4 catalog (16-byte blobs only, no `lists`) opens as the
    /// current format with its records, checksums included; new records
    /// of 4 KiB matching are then written packed, next to the old ones.
    #[test]
    fn format_4_catalogs_are_read_and_upgraded() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let mut old = rec(1);
        old.blocks = (1..=64u64).map(block_of_sub).collect();
        let mut c = Catalog::open(&p, 4096).unwrap();
        c.commit_run(&[], [rec(2)], &[]).unwrap();
        // What format 4 wrote for a 4 KiB list: 16 bytes per block.
        let full: Vec<u8> = old.blocks.iter().flat_map(|b| b.to_le_bytes()).collect();
        c.conn
            .execute(
                "INSERT INTO files (fs, subvol, ino, generation, path, size, mtime_ns, ctime_ns,
                 whole, blocks, flags, settled, last_seen, checksum, nlink)
                 VALUES (?1, 5, 1, 7, ?2, 100000, 1, 2, ?3, ?4, 0, 0, 1, ?5, 1)",
                params![
                    old.fs,
                    b"/data/f1".as_slice(),
                    &old.whole.to_le_bytes()[..],
                    full,
                    old.checksum()
                ],
            )
            .unwrap();
        store_record_count(&c.conn).unwrap();
        c.conn.execute_batch("DROP TABLE lists").unwrap();
        c.conn.pragma_update(None, "user_version", 4).unwrap();
        drop(c);
        let mut c = Catalog::open(&p, 4096).unwrap();
        let v: i64 = c
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, FORMAT_VERSION);
        let mut got = c.load_all().unwrap();
        got.sort_by_key(|r| r.ino);
        assert_eq!(got, vec![old.clone(), rec(2)]);
        let mut new = old.clone();
        new.ino = 3;
        c.commit_run(&[], [new.clone()], &[]).unwrap();
        let len: i64 = c
            .conn
            .query_row("SELECT length(blocks) FROM files WHERE ino = 3", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(len, 1 + 8 * 64);
        assert_eq!(c.load_all().unwrap().len(), 3);
        let lists: i64 = c
            .conn
            .query_row("SELECT count(*) FROM lists", [], |r| r.get(0))
            .unwrap();
        assert_eq!(lists, 0);
    }

    /// `blocks` written to a scratch file in `dir` as a long list: the
    /// store (kept alive), its handle, and where the list is.
    fn long_list(
        dir: &Path,
        blocks: &[u128],
        one_sub: bool,
    ) -> (DigestStore, SpillHandle, Digests) {
        let store = DigestStore::spilling_to(dir).unwrap();
        let h = store.spill_handle().unwrap();
        let mut w = h.begin(blocks.len() as u64, one_sub).unwrap();
        for piece in blocks.chunks(1000) {
            h.write(&mut w, piece).unwrap();
        }
        let d = h.finish(w).unwrap();
        assert!(d.is_long());
        (store, h, d)
    }

    /// A catalog at `p` scanned with a scratch file in `dir`, and a long
    /// list written there (kept by the store returned): the list's digests
    /// and where they are.
    fn with_long_list(
        p: &Path,
        dir: &Path,
        one_sub: bool,
    ) -> (Catalog, DigestStore, Vec<u128>, Digests) {
        let want = long_digests(one_sub);
        let (store, h, list) = long_list(dir, &want, one_sub);
        let (c, _) = Catalog::open_and_scan(p, 4096, (true, Some(h)), &mut |_| ()).unwrap();
        (c, store, want, list)
    }

    /// `rec(ino)` with the long list `list`.
    fn long_rec(ino: u64, list: Digests) -> FileRecord {
        FileRecord {
            blocks: Vec::new(),
            long: Some(list),
            ..rec(ino)
        }
    }

    fn long_digests(one_sub: bool) -> Vec<u128> {
        let n = onecopy_scan::LONG_LIST + 10;
        (0..n)
            .map(|i| match one_sub {
                true => block_of_sub(i * 77),
                false => (i as u128) << 70 | 5,
            })
            .collect()
    }

    /// A record's long list goes to `lists` and back in pieces: read into
    /// a scratch file by a run (a long list there, the same digests), or
    /// into RAM by `load_all`; packed at 4 KiB matching, 16 B otherwise.
    #[test]
    fn long_lists_go_to_the_catalog_and_back_in_pieces() {
        let d = tempfile::tempdir().unwrap();
        for one_sub in [true, false] {
            let p = d.path().join(format!("c-{one_sub}.sqlite"));
            let (mut c, _store, want, list) = with_long_list(&p, d.path(), one_sub);
            c.commit_run(&[], [long_rec(1, list), rec(2)], &[]).unwrap();
            let (inline, listed): (Vec<u8>, i64) = c
                .conn
                .query_row(
                    "SELECT f.blocks, length(l.blocks) FROM files f JOIN lists l USING (fs, subvol, ino)",
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .unwrap();
            assert_eq!(inline, IN_LISTS);
            let n = want.len() as i64;
            assert_eq!(listed, if one_sub { 1 + 8 * n } else { 16 * n });
            drop(c);

            let store2 = DigestStore::spilling_to(d.path()).unwrap();
            let h2 = store2.spill_handle().unwrap();
            let mut seen = Vec::new();
            let (_c, why) =
                Catalog::open_and_scan(&p, 4096, (true, Some(h2.clone())), &mut |r| seen.push(r))
                    .unwrap();
            assert!(why.is_none());
            seen.sort_by_key(|r| r.ino);
            assert_eq!(seen[1], rec(2));
            let got = seen[0].long.expect("a long list in the scratch file");
            assert!(seen[0].blocks.is_empty());
            assert_eq!(h2.blocks(&got).to_vec(), want);

            let mut all = Catalog::open(&p, 4096).unwrap().load_all().unwrap();
            all.sort_by_key(|r| r.ino);
            assert_eq!(all[0].blocks, want);
            assert_eq!(all[0].long, None);
        }
    }

    /// A scratch file that fails (its disk full) while a long list is read
    /// into it costs RAM, not the catalog: the list is read into the
    /// record instead (the whole catalog used to be dropped for the run).
    /// Needs root (a 1 MiB tmpfs).
    #[test]
    fn a_full_scratch_file_reads_long_lists_into_ram() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let (mut c, _store, want, list) = with_long_list(&p, d.path(), true);
        c.commit_run(&[], [long_rec(1, list)], &[]).unwrap();
        drop(c);
        let fs = onecopy_testfs::LoopFs::new(onecopy_testfs::FsKind::Tmpfs, 1 << 20).unwrap();
        let full = DigestStore::spilling_to(fs.path()).unwrap();
        std::fs::write(fs.path().join("ballast"), vec![1u8; 2 << 20]).unwrap_err();
        let mut seen = Vec::new();
        let spill = full.spill_handle();
        let (_c, why) =
            Catalog::open_and_scan(&p, 4096, (true, spill), &mut |r| seen.push(r)).unwrap();
        assert!(why.is_none(), "{why:?}");
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].long, None);
        assert_eq!(seen[0].blocks, want);
    }

    /// A list no record refers to goes in the same transaction: its record
    /// rewritten short, or deleted, or forgotten.
    #[test]
    fn lists_without_their_record_go() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let lists = |c: &Catalog| -> i64 {
            c.conn
                .query_row("SELECT count(*) FROM lists", [], |r| r.get(0))
                .unwrap()
        };
        let (mut c, _store, _, list) = with_long_list(&p, d.path(), true);
        let long = |ino| long_rec(ino, list);
        c.commit_run(&[], [long(1), long(2), long(3)], &[]).unwrap();
        assert_eq!(lists(&c), 3);
        c.commit_run(&[], [rec(1)], &[]).unwrap();
        assert_eq!(lists(&c), 2);
        c.commit_run(&[], [], &[("uuid:ab".into(), 5, 2)]).unwrap();
        assert_eq!(lists(&c), 1);
        assert_eq!(c.forget(Path::new("/data/f3")).unwrap(), 1);
        assert_eq!(lists(&c), 0);
        assert_eq!(c.load_all().unwrap(), vec![rec(1)]);
    }

    /// A flipped byte in a list is found by its record's checksum, read
    /// into a scratch file or into RAM; a record whose list is missing is
    /// damage too.
    #[test]
    fn a_damaged_list_is_found() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.sqlite");
        let (mut c, _store, _, list) = with_long_list(&p, d.path(), false);
        c.commit_run(&[], [long_rec(1, list)], &[]).unwrap();
        {
            use std::io::{Seek, SeekFrom, Write};
            let mut b = c
                .conn
                .blob_open(rusqlite::MAIN_DB, "lists", "blocks", 1, false)
                .unwrap();
            b.seek(SeekFrom::Start(100)).unwrap();
            b.write_all(&[0xff]).unwrap();
        }
        assert!(matches!(c.load_all(), Err(CatalogError::Corrupt { .. })));
        assert!(matches!(
            c.for_each(&mut |_| ()),
            Err(CatalogError::Corrupt { .. })
        ));
        c.conn.execute("DELETE FROM lists", []).unwrap();
        assert!(matches!(c.load_all(), Err(CatalogError::Corrupt { .. })));
    }

    /// Lists of single-filesystem-block digests are stored at 8 bytes per
    /// block and come back exactly; any other list stays at 16.
    #[test]
    fn one_sub_lists_are_packed() {
        let subs: Vec<u128> = (1..=1000u64).map(|i| block_of_sub(i * 77)).collect();
        let b = digests_to_blob(&subs);
        assert_eq!((b.len(), b[0]), (1 + 8 * 1000, PACKED));
        assert_eq!(blob_to_digests(&b), Some(subs.clone()));
        let mut mixed = subs;
        mixed.push(12345u128 << 64 | 6789);
        let b = digests_to_blob(&mixed);
        assert_eq!(b.len(), 16 * 1001);
        assert_eq!(blob_to_digests(&b), Some(mixed));
        assert!(digests_to_blob(&[]).is_empty());
        assert_eq!(blob_to_digests(&[]), Some(vec![]));
    }
}
