//! Measured comparison of the two candidate catalog backends (issue 4):
//! rusqlite (bundled SQLite; WAL, synchronous=NORMAL, WITHOUT ROWID table) and
//! redb 2 (one `(u64, u64) -> &[u8]` table).
//!
//! ```text
//! cargo run --release -p onecopy-bench-catalog-backends -- all
//! cargo run --release -p onecopy-bench-catalog-backends -- all \
//!     --n 10000 --big-n 1000 --digest-n 100000 --lookups 10000 --reps 1 --trials 3   # quick
//! ```
//!
//! Subcommands: `all` (perf + crash + corrupt), `perf`, `crash`, `corrupt`.
//!
//! Options:
//! - `--n` small-file records (default 1,000,000); `--big-n` records of ~100 blocks
//!   (default 100,000); `--digest-n` block-digest entries (default 10,000,000);
//!   `--lookups` digest lookups (default 1,000,000); `--reps` (default 3);
//! - `--trials` crash / corruption trials (default 20); `--corrupt-m` records in the
//!   corruption test database (default 20,000); `--kill-max-ms` (default 1500);
//! - `--dir` (default /tmp/onecopy-backend-compare); `--seed`; `--backends sqlite,redb`;
//!   `--phases a,b` (subset of the perf phases, e.g. `digest-cold,digest-lookup`);
//! - `--order random|seq` key order of the file bulk inserts; `--digest-sorted` sort the
//!   digest batch in memory before inserting it;
//! - `--sqlite-cache-mib` (0 = SQLite default, 2 MiB); `--sqlite-sync` (default NORMAL);
//!   `--sqlite-rowid` files table as a rowid table with a UNIQUE (subvol, ino) index
//!   instead of WITHOUT ROWID; `--redb-cache-mib` (0 = redb default, 1 GiB);
//! - `--verbose`.
//!
//! Every measured phase runs in its own process (the binary re-executes itself
//! with an internal `child-*` subcommand), so the peak RSS (VmHWM) of a phase is
//! that of one backend doing one thing. The parent prints markdown tables with
//! the median of `--reps` repetitions.

use std::collections::{BTreeMap, HashMap};
use std::error::Error;
use std::fs::{self, OpenOptions};
use std::hint::black_box;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::process::ExitStatusExt;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use redb::{ReadableTable, TableDefinition};
use rusqlite::types::ValueRef;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;
type Key = (u64, u64);
/// Value of the block-digest index: (subvol, ino, block number).
type DVal = (u64, u64, u32);

const FILES: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("files");
const DIGESTS: TableDefinition<u64, (u64, u64, u32)> = TableDefinition::new("digest");

// ---------------------------------------------------------------------------
// Deterministic data
// ---------------------------------------------------------------------------

/// SplitMix64 finaliser: a bijection on u64.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(mix64(seed ^ 0x5DEE_CE66_D1CE_4E5B))
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            ((self.next_u64() as u128 * n as u128) >> 64) as u64
        }
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// A bijection on `[0, 2^bits)`, used to give inode numbers in a realistic
/// range but in random order.
fn perm(i: u64, bits: u32) -> u64 {
    let mask = if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    };
    let s = (bits / 2).max(1);
    let mut x = i & mask;
    for c in [
        0x9E37_79B9_7F4A_7C15u64,
        0xBF58_476D_1CE4_E5B9,
        0x94D0_49BB_1331_11EB,
    ] {
        x = x.wrapping_mul(c | 1) & mask;
        x ^= x >> s;
        x ^= (c >> 7) & mask;
    }
    x
}

fn bits_for(n: u64) -> u32 {
    (64 - n.max(2).saturating_sub(1).leading_zeros()).max(1)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// Every file has one 64 KiB block.
    Small,
    /// 90% one block, 9% 100..=1000 blocks, 1% 1000..=10000 blocks (mean ~100).
    Big,
}

#[derive(Clone, PartialEq, Eq, Debug)]
struct Rec {
    path: Vec<u8>,
    size: u64,
    mtime: i64,
    ctime: i64,
    generation: u64,
    digest: [u8; 16],
    blocks: Vec<u8>,
}

/// Outcome of reading one record back.
enum Got {
    Missing,
    /// The backend returned bytes that do not decode as a record.
    Bad,
    Ok(Rec),
}

fn gen_rec(i: u64, version: u64, mode: Mode, seed: u64, nblocks: Option<u64>) -> Rec {
    let mut r = Rng::new(i ^ (version << 48) ^ seed.rotate_left(17));
    let nb = nblocks.unwrap_or(match mode {
        Mode::Small => 1,
        Mode::Big => match r.below(1000) {
            0..=899 => 1,
            900..=989 => 100 + r.below(901),
            _ => 1000 + r.below(9001),
        },
    });
    let plen = 60 + r.below(61) as usize;
    let mut path = format!("/srv/data/d{:04}/f{:010}_", i % 9973, i).into_bytes();
    while path.len() < plen {
        path.push(b'a' + r.below(26) as u8);
    }
    let size = (nb - 1) * 65536 + 1 + r.below(65536);
    let mtime = 1_600_000_000_000_000_000i64 + r.below(100_000_000_000_000_000) as i64;
    let ctime = mtime + r.below(1_000_000_000) as i64;
    let generation = r.below(10_000_000);
    let mut digest = [0u8; 16];
    r.fill(&mut digest);
    let mut blocks = vec![0u8; nb as usize * 16];
    r.fill(&mut blocks);
    Rec {
        path,
        size,
        mtime,
        ctime,
        generation,
        digest,
        blocks,
    }
}

fn file_key(i: u64, n: u64, cfg: &Cfg) -> Key {
    if cfg.order_seq {
        (5, 256 + i)
    } else {
        (5 + mix64(i ^ cfg.seed) % 4, 256 + perm(i, bits_for(n)))
    }
}

fn digest_key(i: u64, seed: u64) -> u64 {
    mix64(i ^ seed.rotate_left(31))
}

fn digest_val(i: u64) -> DVal {
    (5, 256 + i / 100, (i % 100) as u32)
}

const HDR: usize = 8 * 4 + 16 + 4;

fn encode(r: &Rec, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&r.size.to_le_bytes());
    out.extend_from_slice(&r.mtime.to_le_bytes());
    out.extend_from_slice(&r.ctime.to_le_bytes());
    out.extend_from_slice(&r.generation.to_le_bytes());
    out.extend_from_slice(&r.digest);
    out.extend_from_slice(&(r.path.len() as u32).to_le_bytes());
    out.extend_from_slice(&r.path);
    out.extend_from_slice(&r.blocks);
}

fn decode(b: &[u8]) -> Got {
    if b.len() < HDR {
        return Got::Bad;
    }
    let u = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let plen = u32::from_le_bytes(b[48..52].try_into().unwrap()) as usize;
    if HDR + plen > b.len() || (b.len() - HDR - plen) & 15 != 0 {
        return Got::Bad;
    }
    Got::Ok(Rec {
        size: u(0),
        mtime: u(8) as i64,
        ctime: u(16) as i64,
        generation: u(24),
        digest: b[32..48].try_into().unwrap(),
        path: b[HDR..HDR + plen].to_vec(),
        blocks: b[HDR + plen..].to_vec(),
    })
}

// ---------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug, PartialOrd, Ord)]
enum Backend {
    Sqlite,
    Redb,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Redb => "redb",
        }
    }
    fn parse(s: &str) -> Backend {
        match s {
            "sqlite" => Backend::Sqlite,
            "redb" => Backend::Redb,
            _ => panic!("unknown backend {s:?} (sqlite|redb)"),
        }
    }
}

#[derive(Clone, Debug)]
struct Cfg {
    n: u64,
    big_n: u64,
    digest_n: u64,
    lookups: u64,
    reps: usize,
    trials: usize,
    corrupt_m: u64,
    dir: PathBuf,
    seed: u64,
    backends: Vec<Backend>,
    order_seq: bool,
    digest_sorted: bool,
    phases: Option<Vec<String>>,
    sqlite_cache_mib: u64,
    sqlite_sync: String,
    sqlite_rowid: bool,
    redb_cache_mib: u64,
    kill_max_ms: u64,
    verbose: bool,
}

impl Cfg {
    fn parse(args: &[String]) -> (Cfg, Vec<String>) {
        let mut c = Cfg {
            n: 1_000_000,
            big_n: 100_000,
            digest_n: 10_000_000,
            lookups: 1_000_000,
            reps: 3,
            trials: 20,
            corrupt_m: 20_000,
            dir: PathBuf::from("/tmp/onecopy-backend-compare"),
            seed: 42,
            backends: vec![Backend::Sqlite, Backend::Redb],
            order_seq: false,
            digest_sorted: false,
            phases: None,
            sqlite_cache_mib: 0,
            sqlite_sync: "NORMAL".into(),
            sqlite_rowid: false,
            redb_cache_mib: 0,
            kill_max_ms: 1500,
            verbose: false,
        };
        let mut pos = Vec::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut val = || {
                it.next()
                    .unwrap_or_else(|| panic!("{a} needs a value"))
                    .clone()
            };
            let num = |s: String| -> u64 {
                s.replace('_', "")
                    .parse()
                    .unwrap_or_else(|_| panic!("bad number {s:?}"))
            };
            match a.as_str() {
                "--n" => c.n = num(val()),
                "--big-n" => c.big_n = num(val()),
                "--digest-n" => c.digest_n = num(val()),
                "--lookups" => c.lookups = num(val()),
                "--reps" => c.reps = num(val()) as usize,
                "--trials" => c.trials = num(val()) as usize,
                "--corrupt-m" => c.corrupt_m = num(val()),
                "--dir" => c.dir = PathBuf::from(val()),
                "--seed" => c.seed = num(val()),
                "--backends" => c.backends = val().split(',').map(Backend::parse).collect(),
                "--order" => c.order_seq = val() == "seq",
                "--digest-sorted" => c.digest_sorted = true,
                "--sqlite-rowid" => c.sqlite_rowid = true,
                "--phases" => c.phases = Some(val().split(',').map(String::from).collect()),
                "--sqlite-cache-mib" => c.sqlite_cache_mib = num(val()),
                "--sqlite-sync" => c.sqlite_sync = val().to_uppercase(),
                "--redb-cache-mib" => c.redb_cache_mib = num(val()),
                "--kill-max-ms" => c.kill_max_ms = num(val()),
                "--verbose" => c.verbose = true,
                s if s.starts_with("--") => panic!("unknown option {s}"),
                _ => pos.push(a.clone()),
            }
        }
        (c, pos)
    }

    fn to_args(&self) -> Vec<String> {
        let mut v: Vec<String> = [
            ("--n", self.n),
            ("--big-n", self.big_n),
            ("--digest-n", self.digest_n),
            ("--lookups", self.lookups),
            ("--corrupt-m", self.corrupt_m),
            ("--seed", self.seed),
            ("--sqlite-cache-mib", self.sqlite_cache_mib),
            ("--redb-cache-mib", self.redb_cache_mib),
        ]
        .iter()
        .flat_map(|(k, v)| [k.to_string(), v.to_string()])
        .collect();
        v.push("--dir".into());
        v.push(self.dir.display().to_string());
        v.push("--sqlite-sync".into());
        v.push(self.sqlite_sync.clone());
        v.push("--order".into());
        v.push(if self.order_seq { "seq" } else { "random" }.into());
        if self.digest_sorted {
            v.push("--digest-sorted".into());
        }
        if self.sqlite_rowid {
            v.push("--sqlite-rowid".into());
        }
        v
    }
}

// ---------------------------------------------------------------------------
// The two backends behind one small trait
// ---------------------------------------------------------------------------

trait Store: Sized {
    /// Open or create, creating the tables if needed.
    fn create(path: &Path, cfg: &Cfg) -> Res<Self>;
    /// Open an existing database; never creates anything.
    fn open(path: &Path, cfg: &Cfg) -> Res<Self>;
    /// Insert `n` records produced by `f` in one write transaction.
    fn insert_files(&mut self, n: u64, f: impl FnMut(u64) -> (Key, Rec)) -> Res<()>;
    /// Iterate over every record (one read transaction).
    fn scan_files(&self, f: impl FnMut(Key, Got)) -> Res<()>;
    /// Point lookups (one read transaction).
    fn get_files(&self, keys: impl Iterator<Item = Key>, f: impl FnMut(Key, Got)) -> Res<()>;
    /// Upserts and deletes in one write transaction, committed durably.
    fn apply_files(&mut self, puts: &[(Key, Rec)], dels: &[Key]) -> Res<()>;
    fn insert_digests(&mut self, n: u64, f: impl FnMut(u64) -> (u64, DVal)) -> Res<()>;
    fn get_digests(&self, keys: &[u64], f: impl FnMut(u64, Option<DVal>)) -> Res<()>;
    /// Backend's own integrity check: Ok(true) = clean.
    fn integrity(&mut self) -> Res<bool>;
    fn compact(&mut self) -> Res<()>;
}

struct Sql {
    conn: Connection,
}

const SQL_FILES_COLS: &str = "
  subvol INTEGER NOT NULL, ino INTEGER NOT NULL, path BLOB NOT NULL,
  size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
  generation INTEGER NOT NULL, digest BLOB NOT NULL, blocks BLOB NOT NULL";

const SQL_DIGEST: &str = "CREATE TABLE IF NOT EXISTS digest(
  d INTEGER PRIMARY KEY, subvol INTEGER NOT NULL, ino INTEGER NOT NULL, blk INTEGER NOT NULL);";

/// The files table: WITHOUT ROWID with the composite primary key (default), or
/// (`--sqlite-rowid`) an ordinary rowid table with a UNIQUE (subvol, ino) index,
/// which keeps large rows out of the index b-tree.
fn sql_schema(cfg: &Cfg) -> String {
    if cfg.sqlite_rowid {
        format!("CREATE TABLE IF NOT EXISTS files({SQL_FILES_COLS}, UNIQUE(subvol, ino));\n{SQL_DIGEST}")
    } else {
        format!(
            "CREATE TABLE IF NOT EXISTS files({SQL_FILES_COLS},\n  PRIMARY KEY(subvol, ino)) WITHOUT ROWID;\n{SQL_DIGEST}"
        )
    }
}

const SQL_INSERT: &str = "INTO files(subvol, ino, path, size, mtime_ns, ctime_ns, generation, digest, blocks) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9)";

const SQL_COLS: &str = "path, size, mtime_ns, ctime_ns, generation, digest, blocks";

impl Sql {
    fn setup(conn: Connection, cfg: &Cfg) -> Res<Sql> {
        let mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(format!("journal_mode is {mode}, not wal").into());
        }
        conn.pragma_update(None, "synchronous", &cfg.sqlite_sync)?;
        if cfg.sqlite_cache_mib > 0 {
            conn.pragma_update(None, "cache_size", -((cfg.sqlite_cache_mib * 1024) as i64))?;
        }
        Ok(Sql { conn })
    }
}

fn row_rec(row: &rusqlite::Row<'_>, base: usize) -> rusqlite::Result<Got> {
    let blob = |i: usize| -> rusqlite::Result<Option<Vec<u8>>> {
        Ok(match row.get_ref(base + i)? {
            ValueRef::Blob(b) => Some(b.to_vec()),
            _ => None,
        })
    };
    let int = |i: usize| -> rusqlite::Result<Option<i64>> {
        Ok(match row.get_ref(base + i)? {
            ValueRef::Integer(v) => Some(v),
            _ => None,
        })
    };
    let (
        Some(path),
        Some(size),
        Some(mtime),
        Some(ctime),
        Some(generation),
        Some(dg),
        Some(blocks),
    ) = (
        blob(0)?,
        int(1)?,
        int(2)?,
        int(3)?,
        int(4)?,
        blob(5)?,
        blob(6)?,
    )
    else {
        return Ok(Got::Bad);
    };
    let Ok(digest) = <[u8; 16]>::try_from(dg.as_slice()) else {
        return Ok(Got::Bad);
    };
    Ok(Got::Ok(Rec {
        path,
        size: size as u64,
        mtime,
        ctime,
        generation: generation as u64,
        digest,
        blocks,
    }))
}

impl Store for Sql {
    fn create(path: &Path, cfg: &Cfg) -> Res<Self> {
        let s = Sql::setup(Connection::open(path)?, cfg)?;
        s.conn.execute_batch(&sql_schema(cfg))?;
        Ok(s)
    }

    fn open(path: &Path, cfg: &Cfg) -> Res<Self> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        Sql::setup(Connection::open_with_flags(path, flags)?, cfg)
    }

    fn insert_files(&mut self, n: u64, mut f: impl FnMut(u64) -> (Key, Rec)) -> Res<()> {
        let tx = self.conn.transaction()?;
        {
            let mut st = tx.prepare_cached(&format!("INSERT {SQL_INSERT}"))?;
            for i in 0..n {
                let ((s, ino), r) = f(i);
                st.execute(params![
                    s as i64,
                    ino as i64,
                    r.path,
                    r.size as i64,
                    r.mtime,
                    r.ctime,
                    r.generation as i64,
                    &r.digest[..],
                    r.blocks
                ])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn scan_files(&self, mut f: impl FnMut(Key, Got)) -> Res<()> {
        let tx = self.conn.unchecked_transaction()?;
        {
            let mut st = tx.prepare(&format!("SELECT subvol, ino, {SQL_COLS} FROM files"))?;
            let mut rows = st.query([])?;
            while let Some(row) = rows.next()? {
                let k: (i64, i64) = (row.get(0)?, row.get(1)?);
                f((k.0 as u64, k.1 as u64), row_rec(row, 2)?);
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn get_files(&self, keys: impl Iterator<Item = Key>, mut f: impl FnMut(Key, Got)) -> Res<()> {
        let tx = self.conn.unchecked_transaction()?;
        {
            let mut st = tx.prepare_cached(&format!(
                "SELECT {SQL_COLS} FROM files WHERE subvol = ?1 AND ino = ?2"
            ))?;
            for k in keys {
                let mut rows = st.query(params![k.0 as i64, k.1 as i64])?;
                let got = match rows.next()? {
                    Some(row) => row_rec(row, 0)?,
                    None => Got::Missing,
                };
                f(k, got);
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn apply_files(&mut self, puts: &[(Key, Rec)], dels: &[Key]) -> Res<()> {
        let tx = self.conn.transaction()?;
        {
            let mut put = tx.prepare_cached(&format!("INSERT OR REPLACE {SQL_INSERT}"))?;
            for ((s, ino), r) in puts {
                put.execute(params![
                    *s as i64,
                    *ino as i64,
                    r.path,
                    r.size as i64,
                    r.mtime,
                    r.ctime,
                    r.generation as i64,
                    &r.digest[..],
                    r.blocks
                ])?;
            }
            let mut del = tx.prepare_cached("DELETE FROM files WHERE subvol = ?1 AND ino = ?2")?;
            for (s, ino) in dels {
                del.execute(params![*s as i64, *ino as i64])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn insert_digests(&mut self, n: u64, mut f: impl FnMut(u64) -> (u64, DVal)) -> Res<()> {
        let tx = self.conn.transaction()?;
        {
            let mut st = tx.prepare_cached("INSERT INTO digest VALUES (?1,?2,?3,?4)")?;
            for i in 0..n {
                let (d, (s, ino, b)) = f(i);
                st.execute(params![d as i64, s as i64, ino as i64, b])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn get_digests(&self, keys: &[u64], mut f: impl FnMut(u64, Option<DVal>)) -> Res<()> {
        let tx = self.conn.unchecked_transaction()?;
        {
            let mut st = tx.prepare_cached("SELECT subvol, ino, blk FROM digest WHERE d = ?1")?;
            for &d in keys {
                let v = st
                    .query_row([d as i64], |r| {
                        Ok((
                            r.get::<_, i64>(0)? as u64,
                            r.get::<_, i64>(1)? as u64,
                            r.get(2)?,
                        ))
                    })
                    .optional()?;
                f(d, v);
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn integrity(&mut self) -> Res<bool> {
        let mut st = self.conn.prepare("PRAGMA integrity_check")?;
        let rows: Vec<String> = st
            .query_map([], |r| r.get::<_, String>(0))?
            .collect::<Result<_, _>>()?;
        Ok(rows.len() == 1 && rows[0] == "ok")
    }

    fn compact(&mut self) -> Res<()> {
        self.conn.execute_batch("VACUUM")?;
        Ok(())
    }
}

struct Rdb {
    db: redb::Database,
}

impl Rdb {
    fn builder(cfg: &Cfg) -> redb::Builder {
        let mut b = redb::Builder::new();
        if cfg.redb_cache_mib > 0 {
            b.set_cache_size(cfg.redb_cache_mib as usize * 1024 * 1024);
        }
        b
    }
}

impl Store for Rdb {
    fn create(path: &Path, cfg: &Cfg) -> Res<Self> {
        let db = Rdb::builder(cfg).create(path)?;
        let tx = db.begin_write()?;
        tx.open_table(FILES)?;
        tx.open_table(DIGESTS)?;
        tx.commit()?;
        Ok(Rdb { db })
    }

    fn open(path: &Path, cfg: &Cfg) -> Res<Self> {
        Ok(Rdb {
            db: Rdb::builder(cfg).open(path)?,
        })
    }

    fn insert_files(&mut self, n: u64, mut f: impl FnMut(u64) -> (Key, Rec)) -> Res<()> {
        let tx = self.db.begin_write()?;
        {
            let mut t = tx.open_table(FILES)?;
            let mut buf = Vec::new();
            for i in 0..n {
                let (k, r) = f(i);
                encode(&r, &mut buf);
                t.insert(k, buf.as_slice())?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn scan_files(&self, mut f: impl FnMut(Key, Got)) -> Res<()> {
        let tx = self.db.begin_read()?;
        let t = tx.open_table(FILES)?;
        for e in t.iter()? {
            let (k, v) = e?;
            f(k.value(), decode(v.value()));
        }
        Ok(())
    }

    fn get_files(&self, keys: impl Iterator<Item = Key>, mut f: impl FnMut(Key, Got)) -> Res<()> {
        let tx = self.db.begin_read()?;
        let t = tx.open_table(FILES)?;
        for k in keys {
            let got = match t.get(k)? {
                Some(v) => decode(v.value()),
                None => Got::Missing,
            };
            f(k, got);
        }
        Ok(())
    }

    fn apply_files(&mut self, puts: &[(Key, Rec)], dels: &[Key]) -> Res<()> {
        let tx = self.db.begin_write()?;
        {
            let mut t = tx.open_table(FILES)?;
            let mut buf = Vec::new();
            for (k, r) in puts {
                encode(r, &mut buf);
                t.insert(*k, buf.as_slice())?;
            }
            for k in dels {
                t.remove(*k)?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn insert_digests(&mut self, n: u64, mut f: impl FnMut(u64) -> (u64, DVal)) -> Res<()> {
        let tx = self.db.begin_write()?;
        {
            let mut t = tx.open_table(DIGESTS)?;
            for i in 0..n {
                let (d, v) = f(i);
                t.insert(d, v)?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn get_digests(&self, keys: &[u64], mut f: impl FnMut(u64, Option<DVal>)) -> Res<()> {
        let tx = self.db.begin_read()?;
        let t = tx.open_table(DIGESTS)?;
        for &d in keys {
            f(d, t.get(d)?.map(|v| v.value()));
        }
        Ok(())
    }

    fn integrity(&mut self) -> Res<bool> {
        Ok(self.db.check_integrity()?)
    }

    fn compact(&mut self) -> Res<()> {
        for _ in 0..16 {
            if !self.db.compact()? {
                break;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn vm_hwm_kib() -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// User + system CPU time of this process in ms (from /proc/self/stat, 100 Hz ticks).
fn cpu_ms() -> f64 {
    let stat = fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) * 10.0
}

fn side_files(db: &Path) -> Vec<PathBuf> {
    let s = db.display().to_string();
    vec![
        db.to_path_buf(),
        PathBuf::from(format!("{s}-wal")),
        PathBuf::from(format!("{s}-shm")),
        PathBuf::from(format!("{s}-journal")),
    ]
}

fn remove_db(db: &Path) {
    for p in side_files(db) {
        let _ = fs::remove_file(p);
    }
}

/// (apparent bytes, allocated bytes) of the database and its side files.
fn db_size(db: &Path) -> (u64, u64) {
    side_files(db)
        .iter()
        .filter_map(|p| fs::metadata(p).ok())
        .fold((0, 0), |(a, b), m| (a + m.len(), b + m.blocks() * 512))
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

fn db_path(cfg: &Cfg, b: Backend, what: &str) -> PathBuf {
    cfg.dir.join(format!("{what}.{}", b.name()))
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ").chars().take(160).collect()
}

fn panic_msg(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic".into()
    }
}

struct ChildOut {
    status: Option<ExitStatus>,
    timed_out: bool,
    stdout: String,
    stderr: String,
}

fn run_child(args: &[String], timeout: Duration) -> ChildOut {
    let exe = std::env::current_exe().expect("current_exe");
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t1 = thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let t2 = thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if Instant::now() > deadline => {
                timed_out = true;
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => thread::sleep(Duration::from_millis(5)),
            Err(_) => break None,
        }
    };
    ChildOut {
        status,
        timed_out,
        stdout: t1.join().unwrap_or_default(),
        stderr: t2.join().unwrap_or_default(),
    }
}

fn parse_result(stdout: &str) -> Option<BTreeMap<String, String>> {
    let line = stdout.lines().rev().find(|l| l.starts_with("RESULT "))?;
    let rest = &line["RESULT ".len()..];
    let (kv, msg) = match rest.split_once(" msg=") {
        Some((a, b)) => (a, Some(b)),
        None => (rest, None),
    };
    let mut m: BTreeMap<String, String> = kv
        .split_whitespace()
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if let Some(msg) = msg {
        m.insert("msg".into(), msg.to_string());
    }
    Some(m)
}

fn print_result(kv: &[(String, String)]) {
    let mut line = String::from("RESULT");
    let mut msg = None;
    for (k, v) in kv {
        if k == "msg" {
            msg = Some(v.clone());
        } else {
            line.push_str(&format!(" {k}={v}"));
        }
    }
    if let Some(m) = msg {
        line.push_str(&format!(" msg={m}"));
    }
    println!("{line}");
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

macro_rules! kv {
    ($($k:expr => $v:expr),* $(,)?) => {
        Vec::from([$(($k.to_string(), $v.to_string())),*])
    };
}

// ---------------------------------------------------------------------------
// Performance children
// ---------------------------------------------------------------------------

fn bench_child<B: Store>(cfg: &Cfg, phase: &str, db: &Path) -> Res<Vec<(String, String)>> {
    let (what, step) = phase.split_once('-').unwrap_or((phase, ""));
    let (mode, n) = match what {
        "small" => (Mode::Small, cfg.n),
        "big" => (Mode::Big, cfg.big_n),
        _ => (Mode::Small, cfg.digest_n),
    };
    let gen = |i: u64| (file_key(i, n, cfg), gen_rec(i, 0, mode, cfg.seed, None));
    let out: Vec<(String, String)>;
    match phase {
        _ if step == "kill" => {
            // Open, commit one tiny transaction, then wait for SIGKILL from the parent.
            let mut s = B::open(db, cfg)?;
            s.apply_files(&[(SENTINEL, counter_rec(1))], &[])?;
            println!("READY");
            std::io::stdout().flush()?;
            thread::sleep(Duration::from_secs(3600));
            return Err("not killed".into());
        }
        _ if step == "reopen" => {
            // First open after an unclean shutdown: time until the first read works.
            let (t, c0) = (Instant::now(), cpu_ms());
            let s = B::open(db, cfg)?;
            let mut ok = false;
            s.get_files(std::iter::once(SENTINEL), |_, g| {
                ok = matches!(g, Got::Ok(_))
            })?;
            let reopen = t.elapsed();
            let reopen_cpu = cpu_ms() - c0;
            if !ok {
                return Err("record committed before the kill is missing".into());
            }
            drop(s);
            let hwm = vm_hwm_kib();
            out = kv!["reopen_ms" => ms(reopen), "reopen_cpu_ms" => reopen_cpu, "hwm_kib" => hwm];
        }
        "small-cold" | "big-cold" => {
            remove_db(db);
            // Cost of generating the records alone (included in insert_ms for both).
            let t = Instant::now();
            let (mut sink, mut blocks) = (0u64, 0u64);
            for i in 0..n {
                let (k, r) = gen(i);
                sink ^= k.1 ^ r.size;
                blocks += r.blocks.len() as u64 / 16;
            }
            black_box(sink);
            let gen_ms = t.elapsed();
            let (t, c0) = (Instant::now(), cpu_ms());
            let mut s = B::create(db, cfg)?;
            s.insert_files(n, gen)?;
            let commit = t.elapsed();
            drop(s);
            let total = t.elapsed();
            let total_cpu = cpu_ms() - c0;
            let hwm = vm_hwm_kib();
            let (size, alloc) = db_size(db);
            let t = Instant::now();
            let mut s = B::open(db, cfg)?;
            s.compact()?;
            drop(s);
            let compact = t.elapsed();
            let (csize, _) = db_size(db);
            out = kv!["n" => n, "blocks" => blocks, "gen_ms" => ms(gen_ms),
                "commit_ms" => ms(commit), "total_ms" => ms(total), "total_cpu_ms" => total_cpu, "size" => size,
                "alloc" => alloc, "hwm_kib" => hwm, "compact_ms" => ms(compact),
                "compact_size" => csize];
        }
        "small-warm" | "big-warm" => {
            let t0 = Instant::now();
            let s = B::open(db, cfg)?;
            s.get_files(std::iter::once(SENTINEL), |_, g| {
                black_box(matches!(g, Got::Missing));
            })?;
            let open = t0.elapsed();
            let (t, c0) = (Instant::now(), cpu_ms());
            let mut all: Vec<(Key, Rec)> = Vec::with_capacity(n as usize);
            let mut bad = 0u64;
            s.scan_files(|k, g| match g {
                Got::Ok(r) => all.push((k, r)),
                _ => bad += 1,
            })?;
            let scan = t.elapsed();
            let scan_cpu = cpu_ms() - c0;
            if all.len() as u64 != n || bad != 0 {
                return Err(
                    format!("scan returned {} records ({bad} bad), want {n}", all.len()).into(),
                );
            }
            let mut rng = Rng::new(cfg.seed ^ 0x1234);
            let mut order: Vec<u64> = (0..n).collect();
            rng.shuffle(&mut order);
            let (t, c0) = (Instant::now(), cpu_ms());
            let (mut found, mut sink) = (0u64, 0u64);
            s.get_files(order.iter().map(|&i| file_key(i, n, cfg)), |_, g| {
                if let Got::Ok(r) = g {
                    found += 1;
                    sink ^= r.size ^ r.blocks.len() as u64;
                }
            })?;
            let lookup = t.elapsed();
            let lookup_cpu = cpu_ms() - c0;
            black_box(sink);
            if found != n {
                return Err(format!("lookups found {found} of {n}").into());
            }
            // Spot-check content against the generator.
            for &i in order.iter().take(1000) {
                let (k, r) = gen(i);
                let mut ok = false;
                s.get_files(std::iter::once(k), |_, g| {
                    ok = matches!(g, Got::Ok(x) if x == r)
                })?;
                if !ok {
                    return Err(format!("record {i} differs from what was written").into());
                }
            }
            let m = (n / 100) as usize;
            let puts: Vec<(Key, Rec)> = order[..m]
                .iter()
                .map(|&i| (file_key(i, n, cfg), gen_rec(i, 1, mode, cfg.seed, None)))
                .collect();
            let dels: Vec<Key> = order[m..2 * m]
                .iter()
                .map(|&i| file_key(i, n, cfg))
                .collect();
            let mut s = s;
            let (t, c0) = (Instant::now(), cpu_ms());
            s.apply_files(&puts, &dels)?;
            let upd = t.elapsed();
            drop(s);
            let upd_close = t.elapsed();
            let upd_cpu = cpu_ms() - c0;
            let total = t0.elapsed();
            let hwm = vm_hwm_kib();
            black_box(&all);
            let (size, alloc) = db_size(db);
            out = kv!["open_ms" => ms(open), "scan_ms" => ms(scan), "lookup_ms" => ms(lookup),
                "update_ms" => ms(upd), "update_close_ms" => ms(upd_close),
                "scan_cpu_ms" => scan_cpu, "lookup_cpu_ms" => lookup_cpu, "update_cpu_ms" => upd_cpu,
                "total_ms" => ms(total), "hwm_kib" => hwm, "size_after" => size, "alloc_after" => alloc];
        }
        "digest-cold" => {
            remove_db(db);
            let (t, c0) = (Instant::now(), cpu_ms());
            let mut s = B::create(db, cfg)?;
            if cfg.digest_sorted {
                // Collect and sort the batch first (included in the time), then insert in key order.
                let mut v: Vec<(u64, u64)> = (0..n).map(|i| (digest_key(i, cfg.seed), i)).collect();
                v.sort_unstable();
                s.insert_digests(n, |j| (v[j as usize].0, digest_val(v[j as usize].1)))?;
            } else {
                s.insert_digests(n, |i| (digest_key(i, cfg.seed), digest_val(i)))?;
            }
            let commit = t.elapsed();
            drop(s);
            let total = t.elapsed();
            let total_cpu = cpu_ms() - c0;
            let hwm = vm_hwm_kib();
            let (size, alloc) = db_size(db);
            out = kv!["n" => n, "commit_ms" => ms(commit), "total_ms" => ms(total), "total_cpu_ms" => total_cpu,
                "size" => size, "alloc" => alloc, "hwm_kib" => hwm];
        }
        "digest-lookup" => {
            let mut rng = Rng::new(cfg.seed ^ 0xd16e57);
            let mut keys = Vec::with_capacity(cfg.lookups as usize);
            let mut want = HashMap::with_capacity(cfg.lookups as usize);
            for _ in 0..cfg.lookups {
                let hit = rng.below(2) == 0;
                let i = if hit { rng.below(n) } else { n + rng.below(n) };
                let d = digest_key(i, cfg.seed);
                keys.push(d);
                want.insert(d, hit.then(|| digest_val(i)));
            }
            let (t, c0) = (Instant::now(), cpu_ms());
            let s = B::open(db, cfg)?;
            let (mut hits, mut wrong) = (0u64, 0u64);
            s.get_digests(&keys, |d, v| {
                hits += v.is_some() as u64;
                wrong += (want.get(&d) != Some(&v)) as u64;
            })?;
            drop(s);
            let lookup = t.elapsed();
            let lookup_cpu = cpu_ms() - c0;
            let hwm = vm_hwm_kib();
            out = kv!["lookup_ms" => ms(lookup), "lookup_cpu_ms" => lookup_cpu, "hits" => hits, "wrong" => wrong,
                "hwm_kib" => hwm];
            if wrong != 0 {
                return Err(format!("{wrong} digest lookups returned wrong results").into());
            }
        }
        _ => return Err(format!("unknown phase {phase}").into()),
    }
    Ok(out)
}

/// A key no generated record uses; the `kill` phases write it.
const SENTINEL: Key = (9, 9);

const PHASES: [&str; 12] = [
    "small-cold",
    "small-warm",
    "small-kill",
    "small-reopen",
    "big-cold",
    "big-warm",
    "big-kill",
    "big-reopen",
    "digest-cold",
    "digest-lookup",
    "digest-kill",
    "digest-reopen",
];

/// Run a `kill` phase: wait until the child has committed and says READY, then SIGKILL it.
fn run_kill_child(args: &[String]) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| e.to_string())?;
    let so = child.stdout.take().unwrap();
    let ready = BufReader::new(so)
        .lines()
        .map_while(Result::ok)
        .any(|l| l == "READY");
    let _ = child.kill();
    let _ = child.wait();
    if ready {
        Ok(())
    } else {
        Err("child exited without READY".into())
    }
}

type PerfResults = BTreeMap<(Backend, &'static str), Vec<BTreeMap<String, String>>>;

fn run_perf(cfg: &Cfg) -> PerfResults {
    fs::create_dir_all(&cfg.dir).expect("create dir");
    let mut res: PerfResults = BTreeMap::new();
    for rep in 0..cfg.reps {
        // Alternate which backend goes first, to spread drift in machine load.
        let mut order = cfg.backends.clone();
        if rep % 2 == 1 {
            order.reverse();
        }
        for &b in &order {
            for phase in PHASES {
                if cfg
                    .phases
                    .as_ref()
                    .is_some_and(|p| !p.iter().any(|x| x == phase))
                {
                    continue;
                }
                let what = phase.split('-').next().unwrap();
                let db = db_path(cfg, b, what);
                let mut args = vec![
                    "child-bench".to_string(),
                    b.name().into(),
                    phase.into(),
                    db.display().to_string(),
                ];
                args.extend(cfg.to_args());
                let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
                if phase.ends_with("-kill") {
                    if let Err(e) = run_kill_child(&args) {
                        eprintln!("rep {} {} {phase} FAILED: {e}", rep + 1, b.name());
                    }
                    continue;
                }
                let out = run_child(&args, Duration::from_secs(3 * 3600));
                let r = parse_result(&out.stdout);
                match (&out.status, r) {
                    (Some(st), Some(mut r)) if st.success() => {
                        r.insert(
                            "load1".into(),
                            load.split_whitespace().next().unwrap_or("?").into(),
                        );
                        eprintln!("rep {} {:6} {:13} {:?}", rep + 1, b.name(), phase, r);
                        res.entry((b, phase)).or_default().push(r);
                    }
                    _ => {
                        eprintln!(
                            "rep {} {} {phase} FAILED: status {:?}\n{}\n{}",
                            rep + 1,
                            b.name(),
                            out.status,
                            out.stdout,
                            out.stderr
                        );
                    }
                }
            }
            // Leave the big digest database for the next rep to recreate; remove files to
            // keep /tmp tidy.
            for what in ["small", "big", "digest"] {
                remove_db(&db_path(cfg, b, what));
            }
        }
    }
    res
}

fn perf_table(cfg: &Cfg, res: &PerfResults) -> String {
    let get = |b: Backend, phase: &str, key: &str| -> Option<f64> {
        let rs = res.iter().find(|((bb, p), _)| *bb == b && *p == phase)?.1;
        let mut v: Vec<f64> = rs
            .iter()
            .filter_map(|r| r.get(key)?.parse::<f64>().ok())
            .collect();
        (!v.is_empty()).then(|| median(&mut v))
    };
    let big_blocks = get(cfg.backends[0], "big-cold", "blocks").unwrap_or(cfg.big_n as f64);
    // (phase, result key, unit, label). Units: s = ms -> seconds, ms = as is,
    // MiB = KiB -> MiB, B/x = bytes divided by the number of x.
    #[rustfmt::skip]
    let rows: [(&str, &str, &str, &str); 45] = [
        ("small-cold", "total_ms", "s", "insert N small records, 1 txn, incl. close (s)"),
        ("small-cold", "total_cpu_ms", "s", "  same, CPU time user+sys (s)"),
        ("small-cold", "gen_ms", "s", "  generating the records alone, included above (s)"),
        ("small-cold", "size", "B/small", "file size, bytes/record"),
        ("small-cold", "alloc", "B/small", "allocated on disk, bytes/record"),
        ("small-cold", "compact_size", "B/small", "after VACUUM / compact(), bytes/record"),
        ("small-cold", "hwm_kib", "MiB", "peak RSS cold (MiB)"),
        ("small-warm", "open_ms", "ms", "warm: open + first lookup after clean close (ms)"),
        ("small-warm", "scan_ms", "s", "warm: full scan into memory (s)"),
        ("small-warm", "scan_cpu_ms", "s", "  same, CPU time (s)"),
        ("small-warm", "lookup_ms", "s", "warm: N random point lookups (s)"),
        ("small-warm", "lookup_cpu_ms", "s", "  same, CPU time (s)"),
        ("small-warm", "update_close_ms", "s3", "warm: update 1% + delete 1%, commit + close (s)"),
        ("small-warm", "total_ms", "s", "warm: whole warm process (s)"),
        ("small-warm", "size_after", "B/small", "file size after the update, bytes/record"),
        ("small-warm", "alloc_after", "B/small", "allocated after the update, bytes/record"),
        ("small-warm", "hwm_kib", "MiB", "peak RSS warm (MiB)"),
        ("small-reopen", "reopen_ms", "ms", "open + first lookup after SIGKILL (ms)"),
        ("big-cold", "total_ms", "s", "insert N records of ~100 blocks, 1 txn, incl. close (s)"),
        ("big-cold", "total_cpu_ms", "s", "  same, CPU time (s)"),
        ("big-cold", "size", "B/big", "file size, bytes/record"),
        ("big-cold", "size", "B/block", "file size, bytes/block digest"),
        ("big-cold", "alloc", "B/big", "allocated on disk, bytes/record"),
        ("big-cold", "compact_size", "B/big", "after VACUUM / compact(), bytes/record"),
        ("big-cold", "hwm_kib", "MiB", "peak RSS cold (MiB)"),
        ("big-warm", "open_ms", "ms", "warm: open + first lookup after clean close (ms)"),
        ("big-warm", "scan_ms", "s", "warm: full scan into memory (s)"),
        ("big-warm", "scan_cpu_ms", "s", "  same, CPU time (s)"),
        ("big-warm", "lookup_ms", "s", "warm: N random point lookups (s)"),
        ("big-warm", "lookup_cpu_ms", "s", "  same, CPU time (s)"),
        ("big-warm", "update_close_ms", "s3", "warm: update 1% + delete 1%, commit + close (s)"),
        ("big-warm", "size_after", "B/big", "file size after the update, bytes/record"),
        ("big-warm", "alloc_after", "B/big", "allocated after the update, bytes/record"),
        ("big-warm", "hwm_kib", "MiB", "peak RSS warm (MiB)"),
        ("big-reopen", "reopen_ms", "ms", "open + first lookup after SIGKILL (ms)"),
        ("digest-cold", "total_ms", "s", "insert digest entries, 1 txn, incl. close (s)"),
        ("digest-cold", "total_cpu_ms", "s", "  same, CPU time (s)"),
        ("digest-cold", "size", "B/digest", "file size, bytes/entry"),
        ("digest-cold", "alloc", "B/digest", "allocated on disk, bytes/entry"),
        ("digest-cold", "hwm_kib", "MiB", "peak RSS insert (MiB)"),
        ("digest-lookup", "lookup_ms", "s", "random lookups, 50% hits, incl. open + close (s)"),
        ("digest-lookup", "lookup_cpu_ms", "s", "  same, CPU time (s)"),
        ("digest-lookup", "hwm_kib", "MiB", "peak RSS lookups (MiB)"),
        ("digest-reopen", "reopen_ms", "ms", "open + first lookup after SIGKILL (ms)"),
        ("small-cold", "compact_ms", "s", "(small) VACUUM / compact() time (s)"),
    ];
    let fmt = |unit: &str, x: f64| -> String {
        match unit {
            "s" => format!("{:.2}", x / 1000.0),
            "s3" => format!("{:.3}", x / 1000.0),
            "ms" => format!("{x:.1}"),
            "MiB" => format!("{:.0}", x / 1024.0),
            "B/small" => format!("{:.0}", x / cfg.n as f64),
            "B/big" => format!("{:.0}", x / cfg.big_n as f64),
            "B/block" => format!("{:.1}", x / big_blocks),
            "B/digest" => format!("{:.1}", x / cfg.digest_n as f64),
            _ => format!("{x}"),
        }
    };
    let mut s = String::new();
    s.push_str(&format!(
        "\n### Performance (median of {} runs; small N = {}, big N = {} with {:.0} blocks in all, digest N = {}, digest lookups = {}, file key order {}, digest insert order {})\n\n",
        cfg.reps,
        cfg.n,
        cfg.big_n,
        big_blocks,
        cfg.digest_n,
        cfg.lookups,
        if cfg.order_seq { "sequential" } else { "random" },
        if cfg.digest_sorted { "sorted in memory first" } else { "random" }
    ));
    s.push_str("| workload | metric |");
    for b in &cfg.backends {
        s.push_str(&format!(" {} |", b.name()));
    }
    let ratio = cfg.backends.len() == 2;
    if ratio {
        s.push_str(&format!(
            " {}/{} |",
            cfg.backends[1].name(),
            cfg.backends[0].name()
        ));
    }
    s.push_str("\n|---|---|");
    for _ in &cfg.backends {
        s.push_str("---:|");
    }
    if ratio {
        s.push_str("---:|");
    }
    s.push('\n');
    for (phase, key, unit, label) in rows {
        let vals: Vec<Option<f64>> = cfg.backends.iter().map(|&b| get(b, phase, key)).collect();
        if vals.iter().all(Option::is_none) {
            continue;
        }
        let workload = phase.split('-').next().unwrap();
        s.push_str(&format!("| {workload} | {label} |"));
        for v in &vals {
            match v {
                Some(x) => s.push_str(&format!(" {} |", fmt(unit, *x))),
                None => s.push_str(" – |"),
            }
        }
        if ratio {
            match (vals[0], vals[1]) {
                (Some(a), Some(b)) if a > 0.0 => s.push_str(&format!(" {:.2}× |", b / a)),
                _ => s.push_str(" – |"),
            }
        }
        s.push('\n');
    }
    s.push_str("\nRaw per-run values (load1 = 1-minute load average when the phase started):\n\n");
    for ((b, phase), rs) in res {
        for (i, r) in rs.iter().enumerate() {
            let kv: Vec<String> = r.iter().map(|(k, v)| format!("{k}={v}")).collect();
            s.push_str(&format!(
                "- {} {} run {}: {}\n",
                b.name(),
                phase,
                i + 1,
                kv.join(" ")
            ));
        }
    }
    s
}

// ---------------------------------------------------------------------------
// Crash safety
// ---------------------------------------------------------------------------

const CRASH_RECS: u64 = 50;
const CRASH_KEEP: u64 = 10;
const CRASH_LAG: u64 = 20;
const COUNTER: Key = (0, 0);

fn crash_key(t: u64, j: u64) -> Key {
    (1, t * 100 + j)
}

fn crash_rec(t: u64, j: u64, seed: u64) -> Rec {
    let mut r = Rng::new(t.wrapping_mul(1000) + j);
    let nb = if j == 0 && t.rem_euclid(25) == 0 {
        2000
    } else {
        1 + r.below(32)
    };
    gen_rec(t * 100 + j, 7, Mode::Small, seed, Some(nb))
}

fn counter_rec(t: u64) -> Rec {
    Rec {
        path: b"counter".to_vec(),
        size: t,
        mtime: 0,
        ctime: 0,
        generation: 0,
        digest: [0; 16],
        blocks: Vec::new(),
    }
}

/// Transaction `t`: insert 50 records, set the counter to `t`, delete records
/// 10..50 of transaction `t - 20`.
fn crash_txn(t: u64, seed: u64) -> (Vec<(Key, Rec)>, Vec<Key>) {
    let mut puts: Vec<(Key, Rec)> = (0..CRASH_RECS)
        .map(|j| (crash_key(t, j), crash_rec(t, j, seed)))
        .collect();
    puts.push((COUNTER, counter_rec(t)));
    let dels = if t > CRASH_LAG {
        (CRASH_KEEP..CRASH_RECS)
            .map(|j| crash_key(t - CRASH_LAG, j))
            .collect()
    } else {
        Vec::new()
    };
    (puts, dels)
}

fn crash_child<B: Store>(cfg: &Cfg, db: &Path) -> Res<()> {
    let mut s = B::create(db, cfg)?;
    let mut c = 0;
    s.get_files(std::iter::once(COUNTER), |_, g| {
        if let Got::Ok(r) = g {
            c = r.size
        }
    })?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {c}")?;
    out.flush()?;
    for t in c + 1.. {
        let (puts, dels) = crash_txn(t, cfg.seed);
        s.apply_files(&puts, &dels)?;
        writeln!(out, "C {t}")?;
        out.flush()?;
    }
    Ok(())
}

/// Returns the committed transaction number found in the database, or a
/// description of what is wrong.
fn crash_verify<B: Store>(cfg: &Cfg, db: &Path) -> Res<Result<(u64, Duration), String>> {
    let t = Instant::now();
    let s = B::create(db, cfg)?;
    let mut c = None;
    s.get_files(std::iter::once(COUNTER), |_, g| {
        c = match g {
            Got::Ok(r) => Some(Some(r.size)),
            Got::Missing => Some(None),
            Got::Bad => None,
        }
    })?;
    let open = t.elapsed();
    let Some(c) = c else {
        return Ok(Err("counter record undecodable".into()));
    };
    let c = c.unwrap_or(0);
    let mut map = HashMap::new();
    let mut bad = 0;
    s.scan_files(|k, g| match g {
        Got::Ok(r) => {
            map.insert(k, r);
        }
        _ => bad += 1,
    })?;
    if bad > 0 {
        return Ok(Err(format!("{bad} undecodable records")));
    }
    let mut expected = if c > 0 { 1 } else { 0 };
    for tt in 1..=c {
        for j in 0..CRASH_RECS {
            let k = crash_key(tt, j);
            let live = j < CRASH_KEEP || tt + CRASH_LAG > c;
            match (live, map.get(&k)) {
                (true, Some(r)) if *r == crash_rec(tt, j, cfg.seed) => expected += 1,
                (true, Some(_)) => {
                    return Ok(Err(format!("txn {tt} record {j} has wrong content")))
                }
                (true, None) => {
                    return Ok(Err(format!("txn {tt} record {j} missing (counter {c})")))
                }
                (false, Some(_)) => {
                    return Ok(Err(format!("txn {tt} record {j} should have been deleted")))
                }
                (false, None) => {}
            }
        }
    }
    if map.len() != expected {
        return Ok(Err(format!(
            "{} records, expected {expected}: records of an uncommitted txn present",
            map.len()
        )));
    }
    Ok(Ok((c, open)))
}

#[derive(Default, Debug)]
struct CrashSummary {
    trials: usize,
    before_ready: usize,
    ok: usize,
    inflight_survived: usize,
    lost: usize,
    wrong: usize,
    open_err: usize,
    panics: usize,
    child_failed: usize,
    commits_per_s: Vec<f64>,
    recover_ms: Vec<f64>,
    final_txn: u64,
    final_size: u64,
    notes: Vec<String>,
}

fn run_crash(cfg: &Cfg) -> BTreeMap<Backend, CrashSummary> {
    fs::create_dir_all(&cfg.dir).expect("create dir");
    let mut out = BTreeMap::new();
    for &b in &cfg.backends {
        let db = db_path(cfg, b, "crash");
        remove_db(&db);
        let mut rng = Rng::new(cfg.seed ^ 0xc7a5 ^ b as u64);
        let mut sum = CrashSummary::default();
        for trial in 0..cfg.trials {
            let delay = Duration::from_millis(rng.below(cfg.kill_max_ms.max(1)));
            let mut args = vec![
                "child-crash".to_string(),
                b.name().into(),
                db.display().to_string(),
            ];
            args.extend(cfg.to_args());
            let exe = std::env::current_exe().expect("current_exe");
            let spawned = Instant::now();
            let mut child = Command::new(exe)
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn");
            let so = child.stdout.take().unwrap();
            let mut se = child.stderr.take().unwrap();
            let (tx, rx) = mpsc::channel();
            let reader = thread::spawn(move || {
                for line in BufReader::new(so).lines() {
                    let Ok(line) = line else { break };
                    if tx.send((Instant::now(), line)).is_err() {
                        break;
                    }
                }
            });
            let errs = thread::spawn(move || {
                let mut s = String::new();
                let _ = se.read_to_string(&mut s);
                s
            });
            thread::sleep(delay);
            let exited_early = matches!(child.try_wait(), Ok(Some(_)));
            let _ = child.kill(); // SIGKILL
            let _ = child.wait();
            let _ = reader.join();
            let stderr = errs.join().unwrap_or_default();
            let (mut ready, mut last, mut first_c, mut last_c, mut commits) =
                (None, 0u64, None, None, 0u64);
            for (at, line) in rx.try_iter() {
                if line.starts_with("READY") {
                    ready = Some(at);
                } else if let Some(t) = line.strip_prefix("C ") {
                    last = t.trim().parse().unwrap_or(last);
                    first_c.get_or_insert(at);
                    last_c = Some(at);
                    commits += 1;
                }
            }
            sum.trials += 1;
            if exited_early {
                sum.child_failed += 1;
                sum.notes.push(format!(
                    "trial {trial}: child exited before the kill: {}",
                    one_line(&stderr)
                ));
            }
            if ready.is_none() {
                sum.before_ready += 1;
            }
            if let (Some(r), Some(l)) = (ready, last_c) {
                let dt = l.duration_since(r).as_secs_f64();
                if commits >= 5 && dt > 0.0 {
                    sum.commits_per_s.push(commits as f64 / dt);
                }
            }
            let prev = sum.final_txn;
            let v = panic::catch_unwind(AssertUnwindSafe(|| match b {
                Backend::Sqlite => crash_verify::<Sql>(cfg, &db),
                Backend::Redb => crash_verify::<Rdb>(cfg, &db),
            }));
            let verdict = match v {
                Err(p) => {
                    sum.panics += 1;
                    format!("PANIC {}", panic_msg(&*p))
                }
                Ok(Err(e)) => {
                    sum.open_err += 1;
                    format!("ERROR {}", one_line(&e.to_string()))
                }
                Ok(Ok(Err(why))) => {
                    sum.wrong += 1;
                    format!("WRONG {why}")
                }
                Ok(Ok(Ok((c, open)))) => {
                    sum.recover_ms.push(open.as_secs_f64() * 1000.0);
                    let floor = if ready.is_some() {
                        last.max(prev)
                    } else {
                        prev
                    };
                    if c < floor {
                        sum.lost += 1;
                        format!("LOST: db has txn {c}, child reported {last} committed")
                    } else if c > last.max(prev) + 1 {
                        sum.wrong += 1;
                        format!("WRONG: db has txn {c}, child reported only {last}")
                    } else {
                        sum.ok += 1;
                        if c == last + 1 && c > prev {
                            sum.inflight_survived += 1;
                        }
                        sum.final_txn = c;
                        format!("ok: txn {c} (child reported {last}), open {}", ms(open))
                    }
                }
            };
            if !verdict.starts_with("ok") {
                sum.notes.push(format!("trial {trial}: {verdict}"));
            }
            if cfg.verbose {
                eprintln!(
                    "crash {} trial {trial}: kill after {} ms (spawned {} ms ago), {commits} commits: {verdict}",
                    b.name(),
                    delay.as_millis(),
                    spawned.elapsed().as_millis()
                );
            }
        }
        sum.final_size = db_size(&db).0;
        eprintln!("crash {}: {:?}", b.name(), sum);
        remove_db(&db);
        out.insert(b, sum);
    }
    out
}

fn crash_table(cfg: &Cfg, res: &BTreeMap<Backend, CrashSummary>) -> String {
    let mut s = format!(
        "\n### Crash safety (SIGKILL at a random moment in 0–{} ms after spawn, {} trials per backend, same database across trials; each txn = 50 inserts + counter update + 40 deletes)\n\n",
        cfg.kill_max_ms, cfg.trials
    );
    s.push_str("| backend | trials | killed before first commit | reopened, all committed txns intact | last in-flight txn also present | committed txn lost | wrong / partial data | error on reopen | panic | small-txn commits/s (median) | reopen after kill, ms (median) | txns at end | db bytes at end |\n");
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (b, r) in res {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.1} | {} | {} |\n",
            b.name(),
            r.trials,
            r.before_ready,
            r.ok,
            r.inflight_survived,
            r.lost,
            r.wrong,
            r.open_err,
            r.panics,
            median(&mut r.commits_per_s.clone()),
            median(&mut r.recover_ms.clone()),
            r.final_txn,
            r.final_size
        ));
    }
    for (b, r) in res {
        for n in &r.notes {
            s.push_str(&format!("\n- {}: {}", b.name(), n));
        }
    }
    s.push('\n');
    s
}

// ---------------------------------------------------------------------------
// Corruption
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Damage {
    TruncHalf,
    TruncRandom,
    Flip1,
    Flip16,
    Flip1Head,
}

impl Damage {
    fn name(self) -> &'static str {
        match self {
            Damage::TruncHalf => "truncate to 1/2",
            Damage::TruncRandom => "truncate to random length",
            Damage::Flip1 => "flip 1 random byte",
            Damage::Flip16 => "flip 16 random bytes",
            Damage::Flip1Head => "flip 1 byte in first 8 KiB",
        }
    }
}

fn damage(path: &Path, d: Damage, rng: &mut Rng) -> std::io::Result<String> {
    let f = OpenOptions::new().read(true).write(true).open(path)?;
    let len = f.metadata()?.len();
    match d {
        Damage::TruncHalf => {
            f.set_len(len / 2)?;
            Ok(format!("len {len} -> {}", len / 2))
        }
        Damage::TruncRandom => {
            let l = 1 + rng.below(len - 1);
            f.set_len(l)?;
            Ok(format!("len {len} -> {l}"))
        }
        Damage::Flip1 | Damage::Flip16 | Damage::Flip1Head => {
            let (k, region) = match d {
                Damage::Flip1 => (1, len),
                Damage::Flip16 => (16, len),
                _ => (1, len.min(8192)),
            };
            let mut at = Vec::new();
            for _ in 0..k {
                let pos = rng.below(region);
                let mut b = [0u8];
                f.read_exact_at(&mut b, pos)?;
                b[0] ^= 1 + rng.below(255) as u8;
                f.write_all_at(&b, pos)?;
                at.push(pos);
            }
            Ok(format!("flipped at {at:?}"))
        }
    }
}

/// Open, optionally run the backend's integrity check, read every record by
/// scan and by key, and compare with what was written.
fn check_child<B: Store>(cfg: &Cfg, db: &Path, integrity: bool) -> Vec<(String, String)> {
    let m = cfg.corrupt_m;
    let detected = |phase: &str, e: &dyn std::fmt::Display| kv!["outcome" => "detected", "phase" => phase, "msg" => one_line(&e.to_string())];
    let mut s = match B::open(db, cfg) {
        Ok(s) => s,
        Err(e) => return detected("open", &e),
    };
    let mut flagged = None;
    if integrity {
        match s.integrity() {
            Err(e) => return detected("integrity-check", &e),
            Ok(false) => flagged = Some("integrity check failed (redb: repaired)"),
            Ok(true) => {}
        }
    }
    let mut map = HashMap::new();
    let mut wrong = 0u64;
    if let Err(e) = s.scan_files(|k, g| match g {
        Got::Ok(r) => {
            map.insert(k, r);
        }
        _ => wrong += 1,
    }) {
        return detected("scan", &e);
    }
    let mut seen = 0u64;
    for i in 0..m {
        let (k, want) = (
            file_key(i, m, cfg),
            gen_rec(i, 0, Mode::Big, cfg.seed, None),
        );
        match map.get(&k) {
            Some(r) if *r == want => seen += 1,
            Some(_) => {
                wrong += 1;
                seen += 1
            }
            None => wrong += 1,
        }
    }
    wrong += map.len() as u64 - seen;
    let mut lookup_wrong = 0u64;
    let keys = (0..m).map(|i| file_key(i, m, cfg));
    if let Err(e) = s.get_files(keys, |k, g| {
        let i = map.get(&k).map(|r| r.path.clone());
        match (g, i) {
            (Got::Ok(r), Some(p)) if r.path == p => {}
            (Got::Missing, None) => {}
            _ => lookup_wrong += 1,
        }
    }) {
        return detected("lookup", &e);
    }
    if let Some(f) = flagged {
        return kv!["outcome" => "detected", "phase" => "integrity-check", "wrong" => wrong,
            "msg" => f];
    }
    if wrong + lookup_wrong > 0 {
        return kv!["outcome" => "wrong", "phase" => "read", "wrong" => wrong,
            "lookup_wrong" => lookup_wrong, "msg" => format!("{wrong} of {m} records wrong/missing/extra, no error")];
    }
    kv!["outcome" => "intact", "phase" => "read"]
}

#[derive(Default, Debug, Clone)]
struct DamageSummary {
    trials: usize,
    intact: usize,
    detected: usize,
    wrong: usize,
    panic: usize,
    abort: usize,
    hang: usize,
    notes: Vec<String>,
}

type CorruptResults = BTreeMap<(Backend, bool, Damage), DamageSummary>;

fn run_corrupt(cfg: &Cfg) -> (CorruptResults, BTreeMap<Backend, u64>) {
    fs::create_dir_all(&cfg.dir).expect("create dir");
    let mut res: CorruptResults = BTreeMap::new();
    let mut sizes = BTreeMap::new();
    for &b in &cfg.backends {
        let pristine = db_path(cfg, b, "pristine");
        remove_db(&pristine);
        let m = cfg.corrupt_m;
        let gen = |i| {
            (
                file_key(i, m, cfg),
                gen_rec(i, 0, Mode::Big, cfg.seed, None),
            )
        };
        match b {
            Backend::Sqlite => Sql::create(&pristine, cfg).and_then(|mut s| s.insert_files(m, gen)),
            Backend::Redb => Rdb::create(&pristine, cfg).and_then(|mut s| s.insert_files(m, gen)),
        }
        .expect("build pristine database");
        let (len, _) = db_size(&pristine);
        assert_eq!(
            len,
            fs::metadata(&pristine).unwrap().len(),
            "side files left behind"
        );
        sizes.insert(b, len);
        let victim = db_path(cfg, b, "victim");
        for d in [
            Damage::TruncHalf,
            Damage::TruncRandom,
            Damage::Flip1,
            Damage::Flip16,
            Damage::Flip1Head,
        ] {
            let trials = if d == Damage::TruncHalf {
                1
            } else {
                cfg.trials
            };
            for trial in 0..trials {
                for integrity in [false, true] {
                    // Same damage for both check modes.
                    let mut rng =
                        Rng::new(cfg.seed ^ ((d as u64) << 32) ^ trial as u64 ^ ((b as u64) << 40));
                    remove_db(&victim);
                    fs::copy(&pristine, &victim).expect("copy");
                    let what = damage(&victim, d, &mut rng).expect("damage");
                    let mut args = vec![
                        "child-check".to_string(),
                        b.name().into(),
                        victim.display().to_string(),
                        if integrity { "1" } else { "0" }.into(),
                    ];
                    args.extend(cfg.to_args());
                    let out = run_child(&args, Duration::from_secs(300));
                    let e = res.entry((b, integrity, d)).or_default();
                    e.trials += 1;
                    let r = parse_result(&out.stdout);
                    let outcome = if out.timed_out {
                        e.hang += 1;
                        "hang (killed after 300 s)".to_string()
                    } else if let Some(r) = r {
                        let o = r.get("outcome").cloned().unwrap_or_default();
                        match o.as_str() {
                            "intact" => e.intact += 1,
                            "detected" => e.detected += 1,
                            "wrong" => e.wrong += 1,
                            "panic" => e.panic += 1,
                            _ => {}
                        }
                        format!(
                            "{o} at {}: {}",
                            r.get("phase").map(String::as_str).unwrap_or("?"),
                            r.get("msg").map(String::as_str).unwrap_or("")
                        )
                    } else {
                        e.abort += 1;
                        let sig = out.status.and_then(|s| s.signal());
                        format!(
                            "process died (status {:?}, signal {sig:?}): {}",
                            out.status.and_then(|s| s.code()),
                            one_line(&out.stderr)
                        )
                    };
                    let note = format!(
                        "{} [{}]: {what}: {outcome}",
                        d.name(),
                        if integrity { "check" } else { "read" }
                    );
                    if cfg.verbose {
                        eprintln!("corrupt {}: {note}", b.name());
                    }
                    if !outcome.starts_with("intact") && !outcome.starts_with("detected") {
                        e.notes.push(note);
                    }
                }
            }
        }
        remove_db(&victim);
        remove_db(&pristine);
    }
    (res, sizes)
}

fn corrupt_table(cfg: &Cfg, res: &CorruptResults, sizes: &BTreeMap<Backend, u64>) -> String {
    let sz: Vec<String> = sizes
        .iter()
        .map(|(b, l)| format!("{} {:.1} MiB", b.name(), *l as f64 / 1048576.0))
        .collect();
    let mut s = format!(
        "\n### Corruption detection ({} records of ~100 blocks on average; database size {}; each damaged copy opened in a fresh process, then every record read by scan and by key and compared with what was written)\n\n",
        cfg.corrupt_m,
        sz.join(", ")
    );
    s.push_str("`read` = open + read everything; `check` = open + backend integrity check (SQLite `PRAGMA integrity_check`, redb `Database::check_integrity`) + read everything.\n\n");
    s.push_str("| backend | damage | path | trials | intact (no effect) | detected (error) | silent wrong data | panic | process abort | hang |\n");
    s.push_str("|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for ((b, integrity, d), r) in res {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            b.name(),
            d.name(),
            if *integrity { "check" } else { "read" },
            r.trials,
            r.intact,
            r.detected,
            r.wrong,
            r.panic,
            r.abort,
            r.hang
        ));
    }
    s.push_str("\nNon-detected / abnormal outcomes (first 5 per row):\n");
    for ((b, _, _), r) in res {
        for n in r.notes.iter().take(5) {
            s.push_str(&format!("\n- {}: {}", b.name(), n));
        }
    }
    s.push('\n');
    s
}

// ---------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------

fn env_header(cfg: &Cfg) -> String {
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    let dir = cfg.dir.display().to_string();
    let fs_line = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && dir.starts_with(f[1]))
                .then(|| (f[1].len(), format!("{} on {}", f[2], f[1])))
        })
        .max()
        .map(|x| x.1)
        .unwrap_or_default();
    format!(
        "## onecopy catalog backend comparison\n\nSQLite {} (rusqlite 0.37, bundled; WAL, synchronous={}, cache_size {}, files table {}), redb 2 (cache {}), kernel {}, {} CPUs, database dir {} ({}), seed {}\n",
        rusqlite::version(),
        cfg.sqlite_sync,
        if cfg.sqlite_cache_mib > 0 { format!("{} MiB", cfg.sqlite_cache_mib) } else { "default (2 MiB)".into() },
        if cfg.sqlite_rowid { "rowid + UNIQUE(subvol, ino)" } else { "WITHOUT ROWID, PRIMARY KEY(subvol, ino)" },
        if cfg.redb_cache_mib > 0 { format!("{} MiB", cfg.redb_cache_mib) } else { "default (1 GiB)".into() },
        kernel.trim(),
        cpus,
        dir,
        fs_line,
        cfg.seed
    )
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cfg, pos) = Cfg::parse(&args);
    let cmd = pos.first().map(String::as_str).unwrap_or("all");
    match cmd {
        "child-bench" => {
            let (b, phase, db) = (Backend::parse(&pos[1]), pos[2].as_str(), Path::new(&pos[3]));
            let r = match b {
                Backend::Sqlite => bench_child::<Sql>(&cfg, phase, db),
                Backend::Redb => bench_child::<Rdb>(&cfg, phase, db),
            };
            match r {
                Ok(kv) => print_result(&kv),
                Err(e) => {
                    eprintln!("{} {phase}: {e}", b.name());
                    std::process::exit(1);
                }
            }
        }
        "child-crash" => {
            let (b, db) = (Backend::parse(&pos[1]), Path::new(&pos[2]));
            let r = match b {
                Backend::Sqlite => crash_child::<Sql>(&cfg, db),
                Backend::Redb => crash_child::<Rdb>(&cfg, db),
            };
            if let Err(e) = r {
                eprintln!("crash child: {e}");
                std::process::exit(1);
            }
        }
        "child-check" => {
            let (b, db, integrity) = (Backend::parse(&pos[1]), Path::new(&pos[2]), pos[3] == "1");
            panic::set_hook(Box::new(|info| {
                eprintln!("panic: {}", one_line(&info.to_string()))
            }));
            let r = panic::catch_unwind(AssertUnwindSafe(|| match b {
                Backend::Sqlite => check_child::<Sql>(&cfg, db, integrity),
                Backend::Redb => check_child::<Rdb>(&cfg, db, integrity),
            }));
            match r {
                Ok(kv) => print_result(&kv),
                Err(p) => print_result(&kv!["outcome" => "panic", "phase" => "any",
                    "msg" => one_line(&panic_msg(&*p))]),
            }
        }
        "perf" | "crash" | "corrupt" | "all" => {
            panic::set_hook(Box::new(|info| {
                eprintln!("panic: {}", one_line(&info.to_string()))
            }));
            let mut report = env_header(&cfg);
            if cmd == "perf" || cmd == "all" {
                let r = run_perf(&cfg);
                report.push_str(&perf_table(&cfg, &r));
            }
            if cmd == "crash" || cmd == "all" {
                let r = run_crash(&cfg);
                report.push_str(&crash_table(&cfg, &r));
            }
            if cmd == "corrupt" || cmd == "all" {
                let (r, sizes) = run_corrupt(&cfg);
                report.push_str(&corrupt_table(&cfg, &r, &sizes));
            }
            println!("{report}");
            let _ = fs::remove_dir(&cfg.dir);
        }
        other => {
            eprintln!(
                "unknown command {other:?}; use all | perf | crash | corrupt (see the file header)"
            );
            std::process::exit(2);
        }
    }
}
