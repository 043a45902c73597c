//! The block table of one planning pass, bounded in RAM.
//!
//! [`BlockTable`] answers "where did I first see this block?" like
//! [`FingerprintTable`], from one of two homes chosen when it is made:
//!
//! - **RAM**: the hash table, when one sized for every block of the pass
//!   fits the memory budget ([`FingerprintTable::bytes_for`]);
//! - **disk**: otherwise a scratch `onecopy-fpindex` index in a directory
//!   of its own under the spill directory, whose memtable and locality
//!   cache are sized from the budget and whose filters and page
//!   directories cost about 3.5 bytes per distinct block beyond it.
//!   Entries are stored in insertion order, so a run of duplicate blocks
//!   costs about one device read per segment page, not one per block.
//!
//! Answers are exact in both homes. A failing disk (full, unreadable) makes
//! the table answer "not seen" from then on and keeps the first error:
//! dedupe then finds less, never anything wrong (the kernel compares the
//! bytes of every request anyway).
//!
//! The scratch directory is removed when the table is dropped; one left by
//! a killed run (named after its process id) is removed by the next table
//! made under the same spill directory once that process is gone.

use std::path::{Path, PathBuf};

use onecopy_fpindex::{Config, FsIo, Index, Inserted, Mode};

use crate::{BlockRef, FingerprintTable};

/// How much RAM a table may use and where it spills beyond that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableBudget {
    /// Bytes of RAM for the table's entries (the disk home's memtable,
    /// cache and filter building; its filters and directories, ~3.5 B per
    /// block, come on top).
    pub memory: u64,
    /// Where a table that does not fit goes; `None`: it stays in RAM
    /// whatever its size.
    pub spill_dir: Option<PathBuf>,
}

impl TableBudget {
    /// No bound: the table always lives in RAM.
    pub fn unbounded() -> TableBudget {
        TableBudget {
            memory: u64::MAX,
            spill_dir: None,
        }
    }
}

/// About how many bytes of RAM one memtable entry of the disk home costs.
const MEMTABLE_ENTRY_BYTES: u64 = 80;
/// About how many bytes of RAM one locality-cache entry costs.
const CACHE_ENTRY_BYTES: u64 = 60;
/// About how many bytes of RAM a key costs while its run's filter is built.
const FILTER_BUILD_BYTES: u64 = 40;
/// Prefix of scratch directory names: `.onecopy-spill-<pid>-<n>`.
const SCRATCH_PREFIX: &str = ".onecopy-spill-";
/// The file in each scratch directory that proves it is one: a directory
/// of a scratch name without it (a user's, when `--hashfile` puts the
/// catalog in a tree) is never removed.
const MARK: &str = "onecopy-spill-table";
const MARK_TEXT: &[u8] = b"a block table onecopy spilled; removed with its run\n";

/// Figures of a table, for the report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Distinct blocks indexed.
    pub entries: u64,
    /// Bytes of RAM held (RAM home: its capacity; disk home: memtable and
    /// cache bounds plus filters and directories).
    pub memory_bytes: u64,
    /// Whether the table lived on disk.
    pub spilled: bool,
    /// Device reads the disk home made for lookups.
    pub disk_reads: u64,
    /// The first error of the disk home, after which it answered "not seen".
    pub error: Option<String>,
}

/// First-occurrence table of block digests, in RAM or spilled to disk.
pub enum BlockTable {
    Ram(FingerprintTable),
    Disk(Box<DiskTable>),
}

impl BlockTable {
    /// A table for at most `blocks` insertions within `budget`: in RAM if
    /// they fit or there is nowhere to spill, else on disk. A disk home
    /// that cannot be made answers "not seen" to everything and keeps the
    /// error in its stats.
    pub fn new(blocks: usize, budget: &TableBudget) -> BlockTable {
        let need = FingerprintTable::bytes_for(blocks) as u64;
        match &budget.spill_dir {
            Some(dir) if need > budget.memory => match DiskTable::create(dir, budget.memory) {
                Ok(t) => BlockTable::Disk(Box::new(t)),
                Err(e) => BlockTable::Disk(Box::new(DiskTable::failed(e))),
            },
            _ => BlockTable::Ram(FingerprintTable::with_capacity(blocks.min(1 << 26))),
        }
    }

    /// Inserts `at` for `digest` unless the digest is known; returns the
    /// earlier location if there was one.
    pub fn insert_first(&mut self, digest: u128, at: BlockRef) -> Option<BlockRef> {
        match self {
            BlockTable::Ram(t) => t.insert_first(digest, at),
            BlockTable::Disk(t) => t.insert_first(digest, at),
        }
    }

    /// The first location of `digest`, if indexed.
    pub fn get(&mut self, digest: u128) -> Option<BlockRef> {
        match self {
            BlockTable::Ram(t) => t.get(digest),
            BlockTable::Disk(t) => t.get(digest),
        }
    }

    /// Whether every [`BlockTable::insert_first`] that answered `None`
    /// stored its location (so that [`BlockTable::get`] gives it back):
    /// true until a disk home fails or declines an entry.
    pub fn holds_all(&self) -> bool {
        match self {
            BlockTable::Ram(_) => true,
            BlockTable::Disk(t) => t.ix.is_some() && !t.declined,
        }
    }

    pub fn stats(&self) -> TableStats {
        match self {
            BlockTable::Ram(t) => TableStats {
                entries: t.len() as u64,
                memory_bytes: t.memory_bytes() as u64,
                ..Default::default()
            },
            BlockTable::Disk(t) => t.stats(),
        }
    }
}

/// The disk home: a scratch fingerprint index that removes its directory
/// when dropped.
pub struct DiskTable {
    /// `None` once it failed (or if it could not be made).
    ix: Option<Index>,
    dir: Option<PathBuf>,
    entries: u64,
    /// The memtable and cache bounds, bytes.
    bounded_bytes: u64,
    error: Option<String>,
    /// An insert was not indexed (a quota): not every new block is held.
    declined: bool,
}

impl DiskTable {
    fn create(spill_dir: &Path, memory: u64) -> Result<DiskTable, String> {
        std::fs::create_dir_all(spill_dir).map_err(|e| format!("{}: {e}", spill_dir.display()))?;
        remove_stale(spill_dir);
        let dir = scratch_dir(spill_dir)?;
        // A third each for the memtable, the cache and building a run's
        // filter (one partition's keys at a time).
        let third = memory / 3;
        let cfg = Config {
            memtable_entries: (third / MEMTABLE_ENTRY_BYTES).clamp(1024, 1 << 24) as usize,
            cache_entries: (third / CACHE_ENTRY_BYTES).clamp(1024, 1 << 24) as usize,
            partition_keys: (third / FILTER_BUILD_BYTES).clamp(4096, 1 << 20),
            mode: Mode::Eager,
            // Never reopened: nothing to replay.
            log: false,
            // Insert-heavy: tiered merges rewrite an entry about 3.5 times
            // over 120 flushes, against 9 for the pairwise policy; the
            // extra runs' filters are small and cached.
            merge_tier: Some(4),
            max_runs: 24,
            ..Config::default()
        };
        let bounded_bytes = cfg.memtable_entries as u64 * MEMTABLE_ENTRY_BYTES
            + cfg.cache_entries as u64 * CACHE_ENTRY_BYTES;
        let opened = FsIo::scratch(&dir)
            .map_err(|e| format!("{}: {e}", dir.display()))
            .and_then(|io| Index::open_with(Box::new(io), cfg).map_err(|e| e.to_string()));
        match opened {
            Ok(ix) => Ok(DiskTable {
                ix: Some(ix),
                dir: Some(dir),
                entries: 0,
                bounded_bytes,
                error: None,
                declined: false,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    /// A table that answers "not seen" to everything, keeping why.
    fn failed(error: String) -> DiskTable {
        DiskTable {
            ix: None,
            dir: None,
            entries: 0,
            bounded_bytes: 0,
            error: Some(format!("spilled block table: {error}")),
            declined: false,
        }
    }

    fn fail(&mut self, e: onecopy_fpindex::Error) {
        self.ix = None;
        self.error
            .get_or_insert_with(|| format!("spilled block table: {e}"));
    }

    fn insert_first(&mut self, digest: u128, at: BlockRef) -> Option<BlockRef> {
        let ix = self.ix.as_mut()?;
        match ix.insert(digest, pack(at), 0) {
            Ok(Inserted::New) => {
                self.entries += 1;
                None
            }
            Ok(Inserted::Exists(loc)) => Some(unpack(loc)),
            Ok(Inserted::NotIndexed) => {
                self.declined = true;
                None
            }
            Err(e) => {
                self.fail(e);
                None
            }
        }
    }

    fn get(&mut self, digest: u128) -> Option<BlockRef> {
        let ix = self.ix.as_mut()?;
        match ix.lookup(digest) {
            Ok(loc) => loc.map(unpack),
            Err(e) => {
                self.fail(e);
                None
            }
        }
    }

    fn stats(&self) -> TableStats {
        let (ram, reads) = self.ix.as_ref().map_or((0, 0), |ix| {
            let s = ix.stats();
            (ix.ram_bytes() as u64, s.index_reads + s.prefetch_reads)
        });
        TableStats {
            entries: self.entries,
            memory_bytes: self.bounded_bytes + ram,
            spilled: true,
            disk_reads: reads,
            error: self.error.clone(),
        }
    }
}

impl Drop for DiskTable {
    fn drop(&mut self) {
        self.ix = None;
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

fn pack(at: BlockRef) -> u64 {
    (at.file as u64) << 32 | at.block as u64
}

fn unpack(loc: u64) -> BlockRef {
    BlockRef {
        file: (loc >> 32) as u32,
        block: loc as u32,
    }
}

/// A new directory `.onecopy-spill-<pid>-<n>` under `parent`, made
/// `0700`, with its [`MARK`].
fn scratch_dir(parent: &Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::DirBuilderExt;
    let pid = std::process::id();
    for n in 0..1000u32 {
        let d = parent.join(format!("{SCRATCH_PREFIX}{pid}-{n}"));
        match std::fs::DirBuilder::new().mode(0o700).create(&d) {
            Ok(()) => {
                let marked = std::fs::write(d.join(MARK), MARK_TEXT);
                return marked.map(|_| d.clone()).map_err(|e| {
                    let _ = std::fs::remove_dir_all(&d);
                    format!("{}: {e}", d.display())
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(format!("{}: {e}", d.display())),
        }
    }
    Err(format!("{}: no free scratch name", parent.display()))
}

/// Removes scratch directories under `parent` left by killed runs: only
/// one that is provably a scratch directory (its name, its [`MARK`] with
/// our text, our owner) and whose process is gone.
fn remove_stale(parent: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(parent) else {
        return;
    };
    let me = rustix::process::geteuid().as_raw();
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SCRATCH_PREFIX))
            .and_then(|r| r.split_once('-'))
            .filter(|(_, n)| n.parse::<u32>().is_ok())
            .and_then(|(p, _)| p.parse::<u32>().ok())
        else {
            continue;
        };
        let dir = e.path();
        let ours = std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir() && m.uid() == me)
            && std::fs::read(dir.join(MARK)).is_ok_and(|t| t == MARK_TEXT);
        let alive = Path::new("/proc").join(pid.to_string()).exists();
        if ours && !alive {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spilled(dir: &Path, memory: u64) -> BlockTable {
        let b = TableBudget {
            memory,
            spill_dir: Some(dir.to_path_buf()),
        };
        BlockTable::new(1 << 20, &b)
    }

    fn key(i: u64) -> u128 {
        let x = (i as u128 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
        x ^ (x >> 61)
    }

    #[test]
    fn ram_when_it_fits_disk_beyond() {
        let d = tempfile::tempdir().unwrap();
        let fits = TableBudget {
            memory: 1 << 30,
            spill_dir: Some(d.path().into()),
        };
        assert!(matches!(BlockTable::new(1000, &fits), BlockTable::Ram(_)));
        assert!(matches!(spilled(d.path(), 1 << 16), BlockTable::Disk(_)));
        let nowhere = TableBudget {
            memory: 0,
            spill_dir: None,
        };
        assert!(matches!(
            BlockTable::new(1000, &nowhere),
            BlockTable::Ram(_)
        ));
    }

    /// The disk home answers exactly as the RAM home over enough blocks to
    /// flush and merge several runs, and leaves nothing behind.
    #[test]
    fn disk_answers_as_ram_and_cleans_up() {
        let d = tempfile::tempdir().unwrap();
        let mut disk = spilled(d.path(), 1 << 16);
        let mut ram = FingerprintTable::default();
        for i in 0..40_000u64 {
            // Every third key repeats an earlier one.
            let k = if i % 3 == 2 { key(i / 7) } else { key(i) };
            let at = BlockRef {
                file: (i / 100) as u32,
                block: (i % 100) as u32,
            };
            assert_eq!(disk.insert_first(k, at), ram.insert_first(k, at), "{i}");
        }
        for i in 0..45_000u64 {
            assert_eq!(disk.get(key(i)), ram.get(key(i)), "{i}");
        }
        let s = disk.stats();
        assert!(s.spilled && s.error.is_none());
        assert_eq!(s.entries, ram.len() as u64);
        assert!(s.disk_reads > 0);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        drop(disk);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }

    /// A killed run's scratch directory goes; a user's directory of the
    /// same shape (no mark, another mark, a live pid) stays, with its files.
    #[test]
    fn only_marked_scratch_of_a_dead_process_is_removed() {
        let d = tempfile::tempdir().unwrap();
        // Pid numbers this large are never handed out (pid_max <= 2^22).
        let dead = |n: u32| d.path().join(format!("{SCRATCH_PREFIX}4294967290-{n}"));
        std::fs::create_dir(dead(0)).unwrap();
        std::fs::write(dead(0).join(MARK), MARK_TEXT).unwrap();
        std::fs::write(dead(0).join("x"), b"x").unwrap();
        for (n, mark) in [(1, None), (2, Some(&b"photos"[..]))] {
            std::fs::create_dir(dead(n)).unwrap();
            std::fs::write(dead(n).join("family.jpg"), b"precious").unwrap();
            if let Some(m) = mark {
                std::fs::write(dead(n).join(MARK), m).unwrap();
            }
        }
        let users = d.path().join("spill-2023-photos");
        std::fs::create_dir(&users).unwrap();
        std::fs::write(users.join("family.jpg"), b"precious").unwrap();
        let mine = d
            .path()
            .join(format!("{SCRATCH_PREFIX}{}-7", std::process::id()));
        std::fs::create_dir(&mine).unwrap();
        std::fs::write(mine.join(MARK), MARK_TEXT).unwrap();
        let other = d.path().join("catalog.sqlite");
        std::fs::write(&other, b"x").unwrap();
        let t = spilled(d.path(), 1 << 16);
        assert!(!dead(0).exists(), "a killed run's scratch");
        for kept in [dead(1), dead(2), users.clone()] {
            assert_eq!(std::fs::read(kept.join("family.jpg")).unwrap(), b"precious");
        }
        assert!(mine.exists() && other.exists());
        drop(t);
    }

    #[test]
    fn an_unusable_spill_dir_answers_not_seen_with_the_reason() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let mut t = spilled(&file, 1 << 16);
        let at = BlockRef { file: 0, block: 0 };
        assert_eq!(t.insert_first(1, at), None);
        assert_eq!(t.insert_first(1, at), None);
        assert_eq!(t.get(1), None);
        let e = t.stats().error.unwrap();
        assert!(e.contains("spilled block table") && e.contains("/f"), "{e}");
    }
}
