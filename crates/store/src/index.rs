//! The store's fingerprint lookups through the persistent index of
//! `onecopy-fpindex` (issue 9), in `DIR/index`.
//!
//! Invariants (the crash model in ARCHITECTURE.md):
//! - The `chunks` row (id, BLAKE3-256, location, references) is the source
//!   of truth and changes in the same SQLite transaction as the file maps.
//!   The index maps a 128-bit key (the first 16 bytes of the BLAKE3) to a
//!   row id; every hit is confirmed by reading the row and comparing all
//!   32 bytes, so a stale or colliding entry is a miss, never a false
//!   duplicate.
//! - The index only ever receives the operations of SQLite transactions
//!   that are durable (committed with `synchronous=FULL`): until then they
//!   wait here (`waiting` answers lookups for them), so neither a kill nor
//!   a power loss can leave an entry for a row that does not exist.
//! - `index_synced` (in `meta`) is a chunk id W such that every row with
//!   id <= W and `indexed = 1` is durably in the index. It advances only
//!   after the index's own commit. On open the rows above W are inserted
//!   again (a range query on the primary key: replay, not a rescan).
//! - Deletions (gc dropping rows, prune) are journaled in `index_drops` in
//!   the transaction that makes them, applied to the index once durable,
//!   and the journal rows cleared after the index's commit; open replays
//!   what is left.
//! - `indexed = 0` marks rows the index refused (quota) or pruned: they are
//!   not re-inserted, and fsck expects them absent.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use onecopy_fpindex::{Config, Index, Inserted, Mode};
use rusqlite::{params, Connection, OptionalExtension};

use crate::chunks::Chunks;
use crate::config::StoreConfig;
use crate::container::Hash;
use crate::error::{Result, StoreError};
use crate::meta::{ChunkId, ChunkLoc};

/// The index's directory inside the store.
pub const INDEX_DIR: &str = "index";
/// Memtable entries by default (about 80 B each while in RAM, with the
/// hash map's slack ~8 MiB): 4 GiB of 64 KiB chunks per sealed run.
pub const DEFAULT_MEMTABLE: usize = 1 << 16;
/// Locality-cache entries (about 60 B each: 8 MiB at most).
const CACHE_ENTRIES: usize = 1 << 17;
/// Operations waiting for a durable commit beyond which the next commit
/// is made durable (bounds `waiting` to a few MiB).
const MAX_WAITING: usize = 1 << 16;
/// The index is committed (its log fsynced, W advanced) after this many
/// applied operations, or at a durable commit this long after the last.
const SYNC_OPS: usize = 1 << 16;
const SYNC_EVERY: Duration = Duration::from_secs(5);
/// Operations applied by one unforced durable commit (an `fsync`): the
/// rest wait for the next, so that a burst (gc deleting thousands of
/// rows) does not stall one writer behind the store's lock for all of it;
/// but never more than [`MAX_WAITING`] stay queued.
const APPLY_SLICE: usize = 2048;

/// The index key of a chunk: the first 16 bytes of its BLAKE3-256.
pub fn key_of(hash: &Hash) -> u128 {
    let mut k = [0u8; 16];
    k.copy_from_slice(&hash[..16]);
    u128::from_le_bytes(k)
}

/// Seconds since the epoch, as the index's insertion time.
fn now_secs() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs().min(u32::MAX as u64) as u32)
        .unwrap_or(0)
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Insert(u128, ChunkId),
    Drop(u128, ChunkId),
}

/// Figures of the index for `stats`.
#[derive(Debug, Clone, Copy, Default)]
pub struct IndexFigures {
    pub entries: u64,
    pub ram_bytes: u64,
    pub quota_skipped: u64,
}

/// The fingerprint index and the operations waiting to reach it.
pub(crate) struct StoreIndex {
    path: PathBuf,
    cfg: Config,
    fp: Index,
    /// Operations of the open SQLite transaction.
    open_ops: Vec<Op>,
    /// Operations of committed transactions not yet known durable.
    committed_ops: Vec<Op>,
    /// Inserts not yet applied to `fp`: key -> row.
    waiting: HashMap<u128, ChunkId>,
    /// Highest row id applied to `fp`.
    applied_max: ChunkId,
    /// W as last recorded.
    synced: ChunkId,
    applied_since_sync: usize,
    /// Journal rows (`index_drops`) applied, cleared at the next sync.
    drops_applied: Vec<ChunkId>,
    /// Rows the index refused (quota), marked `indexed = 0` at the next sync.
    refused: Vec<ChunkId>,
    /// Chunks refused by the quota, ever (kept in `meta` with W: the
    /// index's own counter reaches its manifest only at a flush).
    quota_skipped: u64,
    last_sync: Instant,
    /// A damaged index file was found while serving (a page checksum):
    /// from then on the index is not used (lookups miss, operations are
    /// not applied) and W is 0, so the next open rebuilds it. Damage costs
    /// dedupe, never a write.
    damaged: Option<String>,
    /// The index was found damaged at open and rebuilt (fsck reports it).
    rebuilt_at_open: Option<String>,
}

fn idx_err(path: &Path) -> impl FnOnce(onecopy_fpindex::Error) -> StoreError + '_ {
    move |source| StoreError::Index {
        path: path.into(),
        source,
    }
}

/// The index's settings for a store.
fn config_for(cfg: &StoreConfig) -> Config {
    Config {
        memtable_entries: cfg.index_memtable.unwrap_or(DEFAULT_MEMTABLE).max(1),
        cache_entries: CACHE_ENTRIES,
        max_entries: cfg.index_quota,
        // The seed and bench/fpindex.sh: eager wins on RAM, SSD and this
        // disk; a flush's keys are looked up together with lookup_many.
        mode: Mode::Eager,
        ..Config::default()
    }
}

fn meta_u64(db: &Connection, key: &str) -> Result<Option<u64>> {
    let v: Option<String> = db
        .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
        .optional()?;
    Ok(v.and_then(|v| v.parse().ok()))
}

pub(crate) fn set_meta(db: &Connection, key: &str, v: u64) -> Result<()> {
    db.prepare_cached(crate::meta::SET_META)?
        .execute(params![key, v.to_string()])?;
    Ok(())
}

/// The index figures recorded at the last sync (for a store mounted by
/// another process).
pub(crate) fn recorded_figures(db: &Connection) -> Result<Option<IndexFigures>> {
    let Some(entries) = meta_u64(db, "index_entries")? else {
        return Ok(None);
    };
    Ok(Some(IndexFigures {
        entries,
        ram_bytes: meta_u64(db, "index_ram_bytes")?.unwrap_or(0),
        quota_skipped: meta_u64(db, "index_quota_skipped")?.unwrap_or(0),
    }))
}

impl StoreIndex {
    /// Opens the index of the store in `dir` and replays what the database
    /// holds beyond it. A damaged index is rebuilt from the database (the
    /// source of truth); an I/O error is returned.
    pub fn open(dir: &Path, db: &Connection, cfg: &StoreConfig) -> Result<StoreIndex> {
        let path = dir.join(INDEX_DIR);
        let cfg = config_for(cfg);
        // (A symbolic link to a directory, the index on another device,
        // is a directory here.)
        let not_a_dir = path.metadata().is_ok_and(|m| !m.is_dir());
        let opened = match not_a_dir {
            true => Err("not a directory".to_string()),
            false => match Index::open(&path, cfg.clone()) {
                Err(e @ onecopy_fpindex::Error::Corrupt { .. }) => Err(e.to_string()),
                Err(e) => return Err(idx_err(&path)(e)),
                Ok(fp) if Self::lost(db, &fp)? => {
                    Err("empty, though the metadata has indexed chunks (deleted?)".to_string())
                }
                Ok(fp) => Ok(fp),
            },
        };
        let (fp, mut rebuilt) = match opened {
            Ok(fp) => (fp, None),
            Err(why) => (
                Self::rebuild_at_open(db, &path, &cfg, why.clone())?,
                Some(why),
            ),
        };
        // W = 0 over a non-empty index: damage was found while serving (it
        // was reported then), or a kill came before the first W or during
        // a rebuild. The replay from 0 re-inserts every row anyway; wiping
        // first drops any damaged page. Not reported: it can be routine.
        let damaged_before = meta_u64(db, "index_synced")?.unwrap_or(0) == 0 && !fp.is_empty();
        let fp = match damaged_before {
            true => {
                Self::wipe(&path)?;
                Index::open(&path, cfg.clone()).map_err(idx_err(&path))?
            }
            false => fp,
        };
        let mut ix = Self::open_with(path.clone(), cfg.clone(), fp, db)?;
        // Damage found now, during the replay: rebuild.
        if let Some(why) = ix.damaged.take() {
            let fp = Self::rebuild_at_open(db, &path, &cfg, why.clone())?;
            ix = Self::open_with(path, cfg, fp, db)?;
            rebuilt = Some(why);
        }
        ix.rebuilt_at_open = ix.rebuilt_at_open.take().or(rebuilt);
        Ok(ix)
    }

    /// An empty index where W says rows were applied and indexed chunks
    /// remain: its files were deleted (an index opened where none is is
    /// made empty, and dedupe against stored chunks would stop silently).
    fn lost(db: &Connection, fp: &Index) -> Result<bool> {
        let w = meta_u64(db, "index_synced")?.unwrap_or(0);
        if w == 0 || !fp.is_empty() {
            return Ok(false);
        }
        let sql = "SELECT EXISTS (SELECT 1 FROM chunks WHERE indexed = 1 AND id <= ?1)";
        Ok(db.query_row(sql, [w], |r| r.get(0))?)
    }

    /// Durably sets W = 0, wipes the index and opens it empty (the replay
    /// then inserts every indexed row).
    fn rebuild_at_open(db: &Connection, path: &Path, cfg: &Config, why: String) -> Result<Index> {
        crate::warn!(
            "onecopy: {}: {why}; rebuilding the fingerprint index from the metadata",
            path.display()
        );
        reset_watermark(db)?;
        Self::wipe(path)?;
        Index::open(path, cfg.clone()).map_err(idx_err(path))
    }

    /// Wraps an open index and replays the rows above W into it.
    fn open_with(path: PathBuf, cfg: Config, fp: Index, db: &Connection) -> Result<StoreIndex> {
        let synced = meta_u64(db, "index_synced")?.unwrap_or(0);
        let quota_skipped = meta_u64(db, "index_quota_skipped")?.unwrap_or(0);
        let mut ix = StoreIndex {
            path,
            cfg,
            fp,
            open_ops: Vec::new(),
            committed_ops: Vec::new(),
            waiting: HashMap::new(),
            applied_max: synced,
            synced,
            applied_since_sync: 0,
            drops_applied: Vec::new(),
            refused: Vec::new(),
            quota_skipped,
            last_sync: Instant::now(),
            damaged: None,
            rebuilt_at_open: None,
        };
        db.execute_batch("BEGIN")?;
        let r = ix.replay(db).and_then(|_| ix.sync(db));
        match r {
            Ok(()) => db.execute_batch("COMMIT")?,
            Err(e) => {
                let _ = db.execute_batch("ROLLBACK");
                return Err(e);
            }
        }
        Ok(ix)
    }

    fn wipe(path: &Path) -> Result<()> {
        let link = path.symlink_metadata().is_ok_and(|m| m.is_symlink());
        let r = match path.metadata() {
            // Something else in its place is set aside, not deleted.
            Ok(m) if !m.is_dir() => std::fs::rename(path, path.with_extension("broken")),
            // The index on another device: its directory stays, emptied.
            Ok(_) if link => std::fs::read_dir(path).and_then(|mut d| {
                d.try_for_each(|e| {
                    let p = e?.path();
                    std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p))
                })
            }),
            _ => std::fs::remove_dir_all(path),
        };
        match r {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(StoreError::io(path)(e)),
            _ => Ok(()),
        }
    }

    /// Applies the journaled deletions, then inserts every indexed row
    /// above W (ids ascending).
    fn replay(&mut self, db: &Connection) -> Result<()> {
        let drops: Vec<(ChunkId, Vec<u8>)> = {
            let mut st = db.prepare("SELECT id, key FROM index_drops ORDER BY id")?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        for (id, key) in drops {
            let Ok(k) = <[u8; 16]>::try_from(key.as_slice()) else {
                self.drops_applied.push(id);
                continue;
            };
            self.apply(db, Op::Drop(u128::from_le_bytes(k), id))?;
        }
        Chunks(db).each_indexed(self.synced, |id, h| {
            self.apply(db, Op::Insert(key_of(&h), id))
        })
    }

    /// The row whose chunk is `hash`, if the index (or a waiting insert)
    /// names one and the row confirms it.
    pub fn lookup(&mut self, db: &Connection, hash: &Hash) -> Result<Option<(ChunkId, ChunkLoc)>> {
        let k = key_of(hash);
        let id = match self.waiting.get(&k) {
            Some(&id) => Some(id),
            None if self.damaged.is_some() => None,
            None => {
                let r = self.fp.lookup(k);
                self.fp_ok(r)?.flatten()
            }
        };
        match id {
            Some(id) => confirm(db, id, hash),
            None => Ok(None),
        }
    }

    /// [`StoreIndex::lookup`] of many chunks at once (one batched probe of
    /// the index's filters).
    pub fn lookup_many(
        &mut self,
        db: &Connection,
        hashes: &[Hash],
    ) -> Result<Vec<Option<(ChunkId, ChunkLoc)>>> {
        let mut ids: Vec<Option<ChunkId>> = Vec::with_capacity(hashes.len());
        let mut ask = Vec::new();
        let mut ask_at = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            let k = key_of(h);
            ids.push(self.waiting.get(&k).copied());
            if ids[i].is_none() {
                ask.push(k);
                ask_at.push(i);
            }
        }
        let found = match self.damaged {
            Some(_) => vec![None; ask.len()],
            None => {
                let r = self.fp.lookup_many(&ask);
                self.fp_ok(r)?.unwrap_or_else(|| vec![None; ask.len()])
            }
        };
        for (i, f) in ask_at.into_iter().zip(found) {
            ids[i] = f;
        }
        let mut out = Vec::with_capacity(hashes.len());
        for (h, id) in hashes.iter().zip(ids) {
            out.push(match id {
                Some(id) => confirm(db, id, h)?,
                None => None,
            });
        }
        Ok(out)
    }

    /// A row was inserted for `hash` in the open transaction.
    pub fn added(&mut self, hash: &Hash, id: ChunkId) {
        let k = key_of(hash);
        self.open_ops.push(Op::Insert(k, id));
        self.waiting.insert(k, id);
    }

    /// Row `id` (chunk `hash`) leaves the index in the open transaction
    /// (deleted, or pruned): journaled in `index_drops`.
    pub fn dropped(&mut self, db: &Connection, hash: &Hash, id: ChunkId) -> Result<()> {
        let k = key_of(hash);
        db.prepare_cached("INSERT OR REPLACE INTO index_drops (id, key) VALUES (?1, ?2)")?
            .execute(params![id, &k.to_le_bytes()[..]])?;
        self.open_ops.push(Op::Drop(k, id));
        if self.waiting.get(&k) == Some(&id) {
            self.waiting.remove(&k);
        }
        Ok(())
    }

    /// The open transaction committed (not necessarily durably).
    pub fn committed(&mut self) {
        self.committed_ops.append(&mut self.open_ops);
    }

    /// The open transaction was rolled back: its operations never happened.
    pub fn rolled_back(&mut self) {
        for op in self.open_ops.drain(..) {
            if let Op::Insert(k, id) = op {
                if self.waiting.get(&k) == Some(&id) {
                    self.waiting.remove(&k);
                }
            }
        }
    }

    /// Whether the next commit should be made durable so that waiting
    /// operations can reach the index.
    pub fn wants_durable(&self) -> bool {
        self.committed_ops.len() >= MAX_WAITING
    }

    /// Every committed transaction is durable: their operations go to the
    /// index, which is committed when enough has accumulated (or `force`).
    /// Database writes (W, marks, journal) go into the open transaction.
    /// On an error the operations not applied stay queued for next time.
    /// Unless `force`, at most [`APPLY_SLICE`] operations are applied, the
    /// oldest first; the rest stay queued in order (W then covers only the
    /// applied inserts, whose ids are below every queued one).
    pub fn made_durable(&mut self, db: &Connection, force: bool) -> Result<()> {
        let len = self.committed_ops.len();
        let n = if force {
            len
        } else {
            // Never leave more than MAX_WAITING queued: a writer that makes
            // more new chunks between commits than a slice would otherwise
            // grow the queue (and `waiting`, and the replay) without bound.
            len.min(APPLY_SLICE).max(len.saturating_sub(MAX_WAITING))
        };
        let ops: Vec<Op> = self.committed_ops.drain(..n).collect();
        for (i, &op) in ops.iter().enumerate() {
            if let Err(e) = self.apply(db, op) {
                let rest = std::mem::take(&mut self.committed_ops);
                self.committed_ops = ops[i..].iter().copied().chain(rest).collect();
                return Err(e);
            }
        }
        let due = self.applied_since_sync >= SYNC_OPS
            || (self.applied_since_sync > 0 && self.last_sync.elapsed() >= SYNC_EVERY);
        if force || due {
            self.sync(db)?;
        }
        Ok(())
    }

    /// Applies one durable operation to the index.
    fn apply(&mut self, db: &Connection, op: Op) -> Result<()> {
        if self.damaged.is_none() {
            let r = self.apply_to_index(db, op);
            if let Err(StoreError::Index {
                source: e @ onecopy_fpindex::Error::Corrupt { .. },
                ..
            }) = r
            {
                self.note_damage(e);
            } else {
                return r;
            }
        }
        // A damaged index: the row stays out of it until the rebuild.
        if let Op::Insert(k, id) = op {
            if self.waiting.get(&k) == Some(&id) {
                self.waiting.remove(&k);
            }
        }
        Ok(())
    }

    /// `Ok(None)` for a damaged index file (noted: the index is then
    /// out of use until rebuilt), the value otherwise.
    fn fp_ok<T>(&mut self, r: onecopy_fpindex::Result<T>) -> Result<Option<T>> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e @ onecopy_fpindex::Error::Corrupt { .. }) => {
                self.note_damage(e);
                Ok(None)
            }
            Err(e) => Err(idx_err(&self.path)(e)),
        }
    }

    fn note_damage(&mut self, e: onecopy_fpindex::Error) {
        if self.damaged.is_none() {
            crate::warn!(
                "onecopy: {}: {e}; dedupe against stored chunks is off until the \
                 fingerprint index is rebuilt (at the next mount or fsck --repair)",
                self.path.display()
            );
            self.damaged = Some(e.to_string());
            self.synced = 0;
            self.applied_max = 0;
        }
    }

    fn apply_to_index(&mut self, db: &Connection, op: Op) -> Result<()> {
        let path = self.path.clone();
        match op {
            Op::Insert(k, id) => {
                match self.fp.insert(k, id, now_secs()).map_err(idx_err(&path))? {
                    Inserted::New => {}
                    Inserted::Exists(x) if x == id => {}
                    Inserted::Exists(x) => {
                        if indexed_row_has(db, x, k)? {
                            // Another indexed row has this key (a 128-bit
                            // collision): this one stays out.
                            self.refused.push(id);
                        } else {
                            // A stale entry: replace it.
                            self.fp.delete(k).map_err(idx_err(&path))?;
                            let again = self.fp.insert(k, id, now_secs());
                            if again.map_err(idx_err(&path))? == Inserted::NotIndexed {
                                self.refused.push(id);
                                self.quota_skipped += 1;
                            }
                        }
                    }
                    Inserted::NotIndexed => {
                        self.refused.push(id);
                        self.quota_skipped += 1;
                    }
                }
                if self.waiting.get(&k) == Some(&id) {
                    self.waiting.remove(&k);
                }
                self.applied_max = self.applied_max.max(id);
            }
            Op::Drop(k, id) => {
                let e = self.fp.get(k).map_err(idx_err(&path))?;
                if e.is_some_and(|e| e.loc == id) {
                    self.fp.delete(k).map_err(idx_err(&path))?;
                }
                self.drops_applied.push(id);
            }
        }
        self.applied_since_sync += 1;
        Ok(())
    }

    /// Commits the index, then records in the open transaction: W, the
    /// refused rows' marks, the applied journal rows' removal, figures.
    pub fn sync(&mut self, db: &Connection) -> Result<()> {
        if self.damaged.is_none() {
            let r = self.fp.commit();
            self.fp_ok(r)?;
        }
        if self.damaged.is_some() {
            // W = 0: the next open rebuilds the index.
            self.synced = 0;
            self.applied_max = 0;
            self.drops_applied.clear();
        }
        self.synced = self.synced.max(self.applied_max);
        set_meta(db, "index_synced", self.synced)?;
        {
            for id in self.refused.drain(..) {
                Chunks(db).mark_unindexed(id)?;
            }
            let mut st = db.prepare_cached("DELETE FROM index_drops WHERE id = ?1")?;
            for id in self.drops_applied.drain(..) {
                st.execute([id])?;
            }
        }
        let f = self.figures();
        set_meta(db, "index_entries", f.entries)?;
        set_meta(db, "index_ram_bytes", f.ram_bytes)?;
        set_meta(db, "index_quota_skipped", f.quota_skipped)?;
        self.applied_since_sync = 0;
        self.last_sync = Instant::now();
        Ok(())
    }

    /// Entries, RAM of filters + directories + bitmap, quota refusals.
    pub fn figures(&self) -> IndexFigures {
        IndexFigures {
            entries: self.fp.len(),
            ram_bytes: self.fp.ram_bytes() as u64,
            quota_skipped: self.quota_skipped,
        }
    }

    /// The configured quota.
    pub fn quota(&self) -> Option<u64> {
        self.cfg.max_entries
    }

    /// Nothing waits for the index (after a durable commit and a sync).
    #[cfg(test)]
    pub fn is_settled(&self) -> bool {
        self.open_ops.is_empty() && self.committed_ops.is_empty() && self.waiting.is_empty()
    }

    /// Marks the rows to prune (entries referenced once, inserted before
    /// `older_than`, whose row has at most one reference) `indexed = 0`
    /// and journals their removal in the open transaction; returns how
    /// many. The caller then commits durably, which removes them.
    pub fn prune_marks(&mut self, db: &Connection, older_than: u32) -> Result<u64> {
        let cands = self
            .fp
            .prune_candidates(older_than)
            .map_err(idx_err(&self.path))?;
        let mut n = 0;
        for e in cands {
            let Some((h, refs)) = Chunks(db).fingerprint_refs(e.loc)? else {
                continue;
            };
            let Ok(h) = Hash::try_from(h.as_slice()) else {
                continue;
            };
            if key_of(&h) != e.key || refs > 1 {
                continue;
            }
            Chunks(db).mark_unindexed(e.loc)?;
            self.dropped(db, &h, e.loc)?;
            n += 1;
        }
        Ok(n)
    }

    /// Compares the index with the chunk rows: every indexed row must be
    /// found at its id, no row marked `indexed = 0` may be, and every entry
    /// must name a row with its key. Call when settled.
    ///
    /// Streamed, in RAM bounded whatever the store's size: each entry (in
    /// key order) is checked against the row it names; as entries have
    /// distinct keys and a row one key, the valid ones name distinct rows,
    /// so if there are as many as indexed rows, every indexed row is in the
    /// index. Only when fewer are the rows looked up one by one, to name
    /// the missing.
    pub fn check(&mut self, db: &Connection) -> Result<Vec<String>> {
        let mut problems = Vec::new();
        if let Some(why) = self.rebuilt_at_open.take() {
            problems.push(format!(
                "the fingerprint index was damaged ({why}) and was rebuilt from the metadata"
            ));
        }
        let r = self.fp.verify();
        let verified = self.fp_ok(r)?.is_some();
        let valid = match self.damaged.clone() {
            None if verified => self.check_entries(db, &mut problems)?,
            _ => None,
        };
        let Some(valid) = valid else {
            let why = self.damaged.clone().unwrap_or_default();
            problems.push(format!("the fingerprint index is damaged: {why}"));
            return Ok(problems);
        };
        let mut st = db.prepare("SELECT id, length(hash) FROM chunks WHERE length(hash) != 32")?;
        let mut rows = st.query([])?;
        while let Some(r) = rows.next()? {
            let (id, len): (ChunkId, i64) = (r.get(0)?, r.get(1)?);
            problems.push(format!("chunk {id} has a fingerprint of {len} bytes"));
        }
        let indexed: u64 = db.query_row(
            "SELECT COUNT(*) FROM chunks WHERE indexed != 0 AND length(hash) = 32",
            [],
            |r| r.get(0),
        )?;
        if valid < indexed {
            self.name_missing(db, &mut problems)?;
        }
        Ok(problems)
    }

    /// Checks every index entry against the row it names; the number of
    /// valid entries, or None when the index turned out damaged.
    fn check_entries(
        &mut self,
        db: &Connection,
        problems: &mut Vec<String>,
    ) -> Result<Option<u64>> {
        let rows = Chunks(db);
        let mut valid = 0;
        let mut failed = None;
        for e in self.fp.entries() {
            let e = match e {
                Ok(e) => e,
                Err(err) => {
                    failed = Some(err);
                    break;
                }
            };
            if e.is_tombstone() {
                continue;
            }
            let row = rows.fingerprint(e.loc)?;
            let same = row
                .as_ref()
                .and_then(|(h, _)| Hash::try_from(h.as_slice()).ok());
            match (same.map(|h| key_of(&h)), row.map(|r| r.1)) {
                (Some(k), Some(false)) if k == e.key => problems.push(format!(
                    "chunk {} is marked not indexed but is in the fingerprint index",
                    e.loc
                )),
                (Some(k), _) if k == e.key => valid += 1,
                _ => problems.push(format!(
                    "fingerprint index entry {:032x} points at chunk {}, which is missing \
                     or has another fingerprint",
                    e.key, e.loc
                )),
            }
        }
        match failed {
            None => Ok(Some(valid)),
            Some(err) => self.fp_ok(Err::<(), _>(err)).map(|_| None),
        }
    }

    /// Names the indexed rows the index does not find at their id (one
    /// lookup per row: only when the counts showed some are missing).
    fn name_missing(&mut self, db: &Connection, problems: &mut Vec<String>) -> Result<()> {
        Chunks(db).each_indexed(0, |id, h| {
            let got = self.fp.get(key_of(&h));
            if self.fp_ok(got)?.flatten().map(|e| e.loc) != Some(id) {
                problems.push(format!("chunk {id} is missing from the fingerprint index"));
            }
            Ok(())
        })
    }

    /// Builds the index again from the chunk rows (fsck --repair, or a
    /// damaged index). W is set to 0 and committed by the caller first, so
    /// a crash during the rebuild leads to a full replay at the next open.
    pub fn rebuild(&mut self, db: &Connection) -> Result<()> {
        Self::wipe(&self.path)?;
        self.fp = Index::open(&self.path, self.cfg.clone()).map_err(idx_err(&self.path))?;
        self.synced = 0;
        self.applied_max = 0;
        self.damaged = None;
        self.refused.clear();
        self.drops_applied.clear();
        self.replay(db)?;
        self.sync(db)
    }
}

/// Sets W to 0 durably (before the index is wiped and rebuilt), outside
/// any transaction.
pub(crate) fn reset_watermark(db: &Connection) -> Result<()> {
    db.pragma_update(None, "synchronous", "FULL")?;
    let r = set_meta(db, "index_synced", 0);
    db.pragma_update(None, "synchronous", "NORMAL")?;
    r
}

/// Whether row `id` exists, is indexed and has key `k`.
fn indexed_row_has(db: &Connection, id: ChunkId, k: u128) -> Result<bool> {
    let row = Chunks(db).fingerprint(id)?;
    Ok(row.is_some_and(|(h, indexed)| {
        indexed && Hash::try_from(h.as_slice()).is_ok_and(|h| key_of(&h) == k)
    }))
}

/// Row `id` if it holds exactly `hash`.
fn confirm(db: &Connection, id: ChunkId, hash: &Hash) -> Result<Option<(ChunkId, ChunkLoc)>> {
    Ok(Chunks(db)
        .row(id)?
        .filter(|(h, _)| h == hash)
        .map(|(_, loc)| (id, loc)))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{Kind, NewNode, Store, StoreConfig};

    fn cfg(quota: Option<u64>) -> StoreConfig {
        StoreConfig {
            chunking: "fixed:4K".parse().unwrap(),
            container_size: 1 << 20,
            index_quota: quota,
            // Flushes and merges of the index every few dozen chunks.
            index_memtable: Some(16),
            ..StoreConfig::default()
        }
    }

    fn store(quota: Option<u64>) -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        Store::init(dir.path(), &cfg(quota)).unwrap();
        let s = Store::open(dir.path()).unwrap();
        (dir, s)
    }

    /// `n` distinct 4 KiB chunks from `seed`.
    fn data(n: usize, seed: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * 4096);
        let mut i = 0u64;
        while out.len() < n * 4096 {
            out.extend_from_slice(
                blake3::hash(&[seed, i].map(u64::to_le_bytes).concat()).as_bytes(),
            );
            i += 1;
        }
        out
    }

    fn put(s: &Store, name: &str, bytes: &[u8]) -> u64 {
        let node = NewNode::root_owned(Kind::File, 0o644);
        let ino = s.mknod(1, name.as_bytes(), node).unwrap().ino;
        s.open_file(ino).unwrap();
        s.write(ino, 0, bytes).unwrap();
        s.release_file(ino).unwrap();
        ino
    }

    fn clean(s: &Store) {
        let r = s.fsck(false).unwrap();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
    }

    /// Dedupe is answered by the index across reopens, with many index
    /// flushes and merges; its entries are exactly the chunks.
    #[test]
    fn index_answers_dedupe_across_reopens() {
        let (dir, s) = store(None);
        let a = data(300, 1);
        put(&s, "a", &a);
        s.flush_all(true).unwrap();
        let st = s.stats().unwrap();
        assert_eq!((st.chunks, st.index_entries), (300, 300));
        drop(s);
        let s = Store::open(dir.path()).unwrap();
        let new_before = s.stats().unwrap().written_new_bytes;
        let b = put(&s, "b", &a);
        assert_eq!(s.stats().unwrap().written_new_bytes, new_before);
        assert_eq!(s.stats().unwrap().chunks, 300);
        assert!(s.read(b, 0, a.len()).unwrap() == a);
        clean(&s);
        assert!(s.lock().index.is_settled());
    }

    /// A kill after commits that were never made durable for the index:
    /// the rows above W are replayed at open, so nothing is lost, and the
    /// index matches the rows. Also with W lost entirely.
    #[test]
    fn rows_beyond_the_watermark_are_replayed() {
        let (dir, s) = store(None);
        let a = data(100, 2);
        put(&s, "a", &a);
        // Committed, not durable: the index has not seen these rows.
        s.commit(false).unwrap();
        assert_eq!(s.lock().index.figures().entries, 0);
        drop(s);
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(s.lock().index.figures().entries, 100);
        let new_before = s.stats().unwrap().written_new_bytes;
        put(&s, "b", &a);
        assert_eq!(s.stats().unwrap().written_new_bytes, new_before);
        clean(&s);
        {
            let g = s.lock();
            super::set_meta(&g.db, "index_synced", 0).unwrap();
        }
        s.commit(true).unwrap();
        drop(s);
        let s = Store::open(dir.path()).unwrap();
        clean(&s);
        assert_eq!(s.stats().unwrap().index_entries, 100);
    }

    /// A writer that makes far more new chunks between commits than one
    /// durable commit applies (no fsync: the periodic commits only) leaves
    /// at most MAX_WAITING operations queued, in RAM and for the replay.
    #[test]
    fn queued_index_operations_stay_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = StoreConfig {
            index_memtable: None,
            ..cfg(None)
        };
        Store::init(dir.path(), &cfg).unwrap();
        let s = Store::open(dir.path()).unwrap();
        let node = NewNode::root_owned(Kind::File, 0o644);
        let ino = s.mknod(1, b"big", node).unwrap().ino;
        s.open_file(ino).unwrap();
        let pages = 3 * super::MAX_WAITING as u64;
        let mut most = 0;
        for first in (0..pages).step_by(4096) {
            let mut buf = vec![0u8; 4096 * 4096];
            for (i, page) in buf.chunks_mut(4096).enumerate() {
                page[..8].copy_from_slice(&(first + i as u64 + 1).to_le_bytes());
            }
            s.write(ino, first * 4096, &buf).unwrap();
            s.flush_all(false).unwrap();
            most = most.max(s.lock().index.committed_ops.len());
        }
        assert!(most <= super::MAX_WAITING + 4096, "{most} queued");
        s.release_file(ino).unwrap();
        s.flush_all(true).unwrap();
        assert_eq!(s.stats().unwrap().index_entries, pages);
    }

    /// An index entry pointing at the wrong row is a miss (the row's full
    /// BLAKE3 differs), never a false duplicate; it is replaced.
    #[test]
    fn stale_entry_is_a_miss_never_a_false_duplicate() {
        let (dir, s) = store(None);
        let a = data(10, 3);
        put(&s, "a", &a);
        s.flush_all(true).unwrap();
        drop(s);
        let b = data(1, 4);
        let kb = super::key_of(blake3::hash(&b).as_bytes());
        {
            let mut fp = onecopy_fpindex::Index::open(
                &dir.path().join(super::INDEX_DIR),
                onecopy_fpindex::Config::default(),
            )
            .unwrap();
            // Chunk 1 holds other bytes.
            fp.insert(kb, 1, 0).unwrap();
            fp.commit().unwrap();
        }
        let s = Store::open(dir.path()).unwrap();
        assert!(!s.fsck(false).unwrap().problems.is_empty());
        let ino = put(&s, "b", &b);
        assert!(s.read(ino, 0, 4096).unwrap() == b);
        assert_eq!(s.stats().unwrap().chunks, 11);
        clean(&s);
    }

    /// The streamed check names each kind of difference: an entry whose
    /// row is gone, an indexed row the index lacks, and a row marked not
    /// indexed that the index still has.
    #[test]
    fn fsck_names_every_kind_of_index_difference() {
        let (_dir, s) = store(None);
        put(&s, "a", &data(20, 6));
        s.flush_all(true).unwrap();
        let ids: Vec<(u64, Vec<u8>)> = {
            let g = s.lock();
            let mut st =
                g.db.prepare("SELECT id, hash FROM chunks ORDER BY id")
                    .unwrap();
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
            rows.collect::<rusqlite::Result<_>>().unwrap()
        };
        {
            let mut g = s.lock();
            crate::chunks::Chunks(&g.db).delete(ids[0].0).unwrap();
            g.db.execute("UPDATE chunks SET indexed = 0 WHERE id = ?1", [ids[1].0])
                .unwrap();
            let k = super::key_of(&ids[2].1.as_slice().try_into().unwrap());
            g.index.fp.delete(k).unwrap();
        }
        let r = s.fsck(false).unwrap();
        let has = |what: &str, id: u64| {
            r.problems
                .iter()
                .any(|p| p.contains(what) && p.contains(&format!("chunk {id}")))
        };
        assert!(has("which is missing", ids[0].0), "{:?}", r.problems);
        assert!(has("marked not indexed", ids[1].0), "{:?}", r.problems);
        assert!(
            has("missing from the fingerprint index", ids[2].0),
            "{:?}",
            r.problems
        );
        // The fourth: the file's extent on the deleted row.
        assert!(r
            .problems
            .iter()
            .any(|p| p.contains("extent points at a missing chunk")));
        assert_eq!(r.problems.len(), 4, "{:?}", r.problems);
    }

    /// A lost index (its directory deleted) or a file in its place is
    /// rebuilt at the next open, and fsck says so once: dedupe against
    /// stored chunks goes on (a deleted index was made again empty, every
    /// later copy stored again; a file in its place failed every command).
    #[test]
    fn a_lost_or_replaced_index_is_rebuilt_at_open() {
        let (dir, s) = store(None);
        let a = data(50, 5);
        put(&s, "a", &a);
        s.flush_all(true).unwrap();
        drop(s);
        let index = dir.path().join(super::INDEX_DIR);
        for case in ["deleted", "a file"] {
            std::fs::remove_dir_all(&index).unwrap();
            if case == "a file" {
                std::fs::write(&index, "not an index").unwrap();
            }
            let s = Store::open(dir.path()).unwrap();
            let new_before = s.stats().unwrap().written_new_bytes;
            put(&s, case, &a);
            assert_eq!(s.stats().unwrap().written_new_bytes, new_before, "{case}");
            let r = s.fsck(false).unwrap();
            assert_eq!(r.problems.len(), 1, "{case}: {:?}", r.problems);
            assert!(
                r.problems[0].contains("rebuilt"),
                "{case}: {:?}",
                r.problems
            );
            clean(&s);
            drop(s);
            let s = Store::open(dir.path()).unwrap();
            clean(&s);
        }
        assert!(index.with_extension("broken").is_file());
    }

    /// Over the quota, new chunks are stored without dedupe, counted, and
    /// not replayed into the index at open.
    #[test]
    fn quota_stores_new_chunks_without_dedupe() {
        let (dir, s) = store(Some(20));
        let a = data(30, 6);
        put(&s, "a", &a);
        s.flush_all(true).unwrap();
        let st = s.stats().unwrap();
        assert_eq!(st.index_entries, 20);
        assert_eq!(st.index_quota, Some(20));
        assert_eq!(st.index_quota_skipped, 10);
        assert_eq!(st.unindexed_chunks, 10);
        let b = put(&s, "b", &a);
        s.flush_all(true).unwrap();
        // The 20 indexed chunks dedupe, the 10 others are stored again.
        assert_eq!(s.stats().unwrap().chunks, 40);
        assert!(s.read(b, 0, a.len()).unwrap() == a);
        clean(&s);
        drop(s);
        let s = Store::open(dir.path()).unwrap();
        let st = s.stats().unwrap();
        assert_eq!(st.index_entries, 20);
        // The second copy's 10 refusals count too, across the reopen.
        assert_eq!(st.index_quota_skipped, 20);
        clean(&s);
    }

    /// prune --days 0 drops the entries of chunks referenced once (not of
    /// shared ones); they stay readable; a reopen does not bring them back;
    /// gc's deletions leave the index too.
    #[test]
    fn prune_and_gc_remove_entries() {
        let (dir, s) = store(None);
        let a = data(20, 7);
        let u = data(10, 8);
        put(&s, "a1", &a);
        put(&s, "a2", &a);
        let ui = put(&s, "u", &u);
        s.flush_all(true).unwrap();
        assert_eq!(s.stats().unwrap().index_entries, 30);
        // Entries are born now: prune those older than "in 2 seconds".
        std::thread::sleep(Duration::from_millis(1100));
        assert_eq!(s.prune_index(Duration::ZERO).unwrap(), 10);
        let st = s.stats().unwrap();
        assert_eq!((st.index_entries, st.unindexed_chunks), (20, 10));
        assert!(s.read(ui, 0, u.len()).unwrap() == u);
        clean(&s);
        drop(s);
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(s.stats().unwrap().index_entries, 20);
        clean(&s);
        s.unlink(1, b"a1").unwrap();
        s.unlink(1, b"a2").unwrap();
        s.gc().unwrap();
        let st = s.stats().unwrap();
        assert_eq!((st.chunks, st.index_entries), (10, 0));
        clean(&s);
    }

    /// A format-1 store (unique hash index, no index directory) is
    /// migrated at open: same data, dedupe through the new index.
    #[test]
    fn format_1_store_is_migrated() {
        let (dir, s) = store(None);
        let a = data(40, 9);
        let ino = put(&s, "a", &a);
        s.flush_all(true).unwrap();
        drop(s);
        // Turn it into what the format-1 code wrote.
        {
            let db = rusqlite::Connection::open(dir.path().join("meta.sqlite")).unwrap();
            crate::meta::downgrade_to_v2(&db);
            db.execute_batch(
                "CREATE TABLE c1 (id INTEGER PRIMARY KEY AUTOINCREMENT, hash BLOB NOT NULL UNIQUE,
                   container INTEGER NOT NULL, offset INTEGER NOT NULL, stored_len INTEGER NOT NULL,
                   raw_len INTEGER NOT NULL, refs INTEGER NOT NULL);
                 INSERT INTO c1 SELECT id, hash, container, offset, stored_len, raw_len, refs FROM chunks;
                 DROP TABLE chunks; ALTER TABLE c1 RENAME TO chunks;
                 CREATE INDEX chunks_container ON chunks (container);
                 DROP TABLE index_drops;
                 DELETE FROM meta WHERE key LIKE 'index_%';
                 UPDATE meta SET value = '1' WHERE key = 'format';
                 PRAGMA user_version = 1;",
            )
            .unwrap();
        }
        std::fs::remove_dir_all(dir.path().join(super::INDEX_DIR)).unwrap();
        let json = dir.path().join("store.json");
        let text = std::fs::read_to_string(&json).unwrap();
        std::fs::write(&json, text.replace("\"format\": 2", "\"format\": 1")).unwrap();
        assert_eq!(Store::read_config(dir.path()).unwrap().format, 1);
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(Store::read_config(dir.path()).unwrap().format, 2);
        assert!(s.read(ino, 0, a.len()).unwrap() == a);
        assert_eq!(s.stats().unwrap().index_entries, 40);
        let new_before = s.stats().unwrap().written_new_bytes;
        put(&s, "b", &a);
        assert_eq!(s.stats().unwrap().written_new_bytes, new_before);
        clean(&s);
    }
}
