//! Maintenance: statistics, statfs, garbage collection and compaction,
//! consistency check (fsck) and scrub.

use std::collections::HashMap;

use serde::Serialize;

use crate::cache::Piece;
use crate::chunks::Chunks;
use crate::container::{self, Hash, CONTAINER_HEADER};
use crate::error::{Result, StoreError};
use crate::index::{set_meta, IndexFigures};
use crate::meta::ChunkLoc;
use crate::pack::Pack;
use crate::store::{piece_at, Inner, Store};

/// A record gc writes, and the chunks in it (row id, place in a pack,
/// length).
type Move = (container::Encoded, Vec<(u64, Option<u32>, u32)>);

/// Unreferenced chunk rows `prune` reads at a time.
const PRUNE_BATCH: u64 = 4096;

/// What `store stats` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    pub files: u64,
    pub directories: u64,
    /// Sum of file sizes.
    pub logical_bytes: u64,
    /// Bytes of file data held in chunks (logical minus holes).
    pub referenced_bytes: u64,
    /// Bytes of distinct referenced chunks, before compression.
    pub unique_bytes: u64,
    /// Bytes of those chunks as stored (compressed, with record headers).
    pub stored_bytes: u64,
    /// Bytes of all container files (includes garbage until `gc`).
    pub container_bytes: u64,
    pub containers: u64,
    pub chunks: u64,
    pub unreferenced_chunks: u64,
    /// referenced / unique.
    pub dedupe_ratio: f64,
    /// unique / stored.
    pub compression_ratio: f64,
    /// Fingerprint index entries (one per indexed chunk).
    pub index_entries: u64,
    /// RAM the index holds per entry: its filters, directories and
    /// liveness bitmap (`onecopy-fpindex`; the memtable of recent entries
    /// and the locality cache are bounded apart). Recorded at the index's
    /// last commit when the store is mounted by another process.
    pub index_ram_bytes_per_entry: f64,
    /// The index's quota (entries), if any (`store init --index-quota`).
    pub index_quota: Option<u64>,
    /// New chunks stored without dedupe because the index was at its quota.
    pub index_quota_skipped: u64,
    /// Chunks the index does not hold (refused by the quota, or pruned).
    pub unindexed_chunks: u64,
    /// Bytes written as new chunks, found duplicate, and kept as holes.
    pub written_new_bytes: u64,
    pub written_duplicate_bytes: u64,
    pub written_zero_bytes: u64,
}

/// What `statfs` reports: the backing filesystem's space.
#[derive(Debug, Clone, Copy)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
}

/// What `gc` did.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct GcReport {
    /// History rows no kept snapshot sees any more.
    #[serde(default)]
    pub history_dropped: u64,
    pub chunks_dropped: u64,
    pub containers_deleted: u64,
    pub containers_compacted: u64,
    pub bytes_freed: u64,
    /// Why compaction stopped before the end (no room on a full disk:
    /// the containers with nothing live are deleted first, and need none).
    #[serde(default)]
    pub compaction_stopped: Option<String>,
    /// Containers left as they are because a live chunk in them is
    /// damaged (the error): `fsck --repair` names the files it costs.
    #[serde(default)]
    pub containers_damaged: Vec<String>,
}

/// What `fsck` found (and, with repair, fixed).
#[derive(Debug, Clone, Default, Serialize)]
pub struct FsckReport {
    pub problems: Vec<String>,
    pub repaired: u64,
}

/// What `scrub` found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScrubReport {
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    pub damaged: Vec<String>,
    /// The damaged chunks' ids and what is wrong with each.
    #[serde(skip)]
    pub damaged_ids: Vec<(u64, String)>,
    /// What is wrong with the fingerprint index (its files, or entries
    /// that disagree with the chunk rows): not damage to stored data, which
    /// reads back exactly; the next open rebuilds the index.
    pub index_problems: Vec<String>,
}

fn compute_stats(
    db: &rusqlite::Connection,
    c: &crate::store::WriteCounters,
    index: Option<IndexFigures>,
    quota: Option<u64>,
) -> Result<Stats> {
    let q = |sql: &str| -> Result<u64> {
        Ok(db
            .query_row(sql, [], |r| r.get::<_, Option<i64>>(0))?
            .unwrap_or(0) as u64)
    };
    let version: u64 = db.pragma_query_value(None, "user_version", |r| r.get(0))?;
    // A store another process has open at an older format (read-only
    // stats never migrate) keeps its counts in `chunks`.
    let counts = if version >= 6 {
        "chunk_refs"
    } else {
        "(SELECT id, refs FROM chunks)"
    };
    let live = |col: &str| {
        format!("SELECT SUM({col}) FROM chunks c JOIN {counts} r ON r.id = c.id WHERE r.refs > 0")
    };
    let referenced = q("SELECT SUM(len) FROM extents")?;
    let unique = q(&live("c.raw_len"))?;
    let stored = if version >= 7 {
        q(&live(crate::chunks::STORED_SHARE))?
    } else {
        q(&live("c.stored_len"))?
    };
    let chunks = q("SELECT COUNT(*) FROM chunks")?;
    let unindexed = if version >= 2 {
        q("SELECT COUNT(*) FROM chunks WHERE indexed = 0")?
    } else {
        0
    };
    let index = index.unwrap_or(IndexFigures {
        entries: chunks - unindexed,
        ..IndexFigures::default()
    });
    let ratio = |a: u64, b: u64| if b == 0 { 1.0 } else { a as f64 / b as f64 };
    Ok(Stats {
        files: q("SELECT COUNT(*) FROM inodes WHERE kind = 1")?,
        directories: q("SELECT COUNT(*) FROM inodes WHERE kind = 2")?,
        logical_bytes: q("SELECT SUM(size) FROM inodes WHERE kind = 1")?,
        referenced_bytes: referenced,
        unique_bytes: unique,
        stored_bytes: stored,
        container_bytes: q("SELECT SUM(length) FROM containers")?,
        containers: q("SELECT COUNT(*) FROM containers")?,
        chunks,
        unreferenced_chunks: q(&format!("SELECT COUNT(*) FROM {counts} WHERE refs <= 0"))?,
        dedupe_ratio: ratio(referenced, unique),
        compression_ratio: ratio(unique, stored),
        index_entries: index.entries,
        index_ram_bytes_per_entry: if index.entries == 0 {
            0.0
        } else {
            index.ram_bytes as f64 / index.entries as f64
        },
        index_quota: quota,
        index_quota_skipped: index.quota_skipped,
        unindexed_chunks: unindexed,
        written_new_bytes: c.new_bytes,
        written_duplicate_bytes: c.dup_bytes,
        written_zero_bytes: c.zero_bytes,
    })
}

/// Containers whose live fraction is below this are compacted.
const COMPACT_BELOW: f64 = 0.5;

impl Store {
    /// Space and dedupe statistics.
    pub fn stats(&self) -> Result<Stats> {
        let g = self.lock();
        let f = g.index.figures();
        compute_stats(&g.db, &g.counters, Some(f), g.index.quota())
    }

    /// Statistics of a store that may be mounted by another process, as of
    /// its last commit (at most a second old while mounted).
    pub fn stats_readonly(dir: &std::path::Path) -> Result<Stats> {
        let cfg = Store::read_config(dir)?;
        let meta = dir.join("meta.sqlite");
        if !meta.is_file() {
            return Err(StoreError::NotAStore {
                path: meta,
                why: "no meta.sqlite".into(),
            });
        }
        let db = rusqlite::Connection::open_with_flags(
            meta,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )?;
        let counters = crate::store::load_counters(&db)?;
        let figures = crate::index::recorded_figures(&db)?;
        compute_stats(&db, &counters, figures, cfg.index_quota)
    }

    /// Free space of the filesystem holding the store.
    pub fn statfs(&self) -> Result<StatFs> {
        let s = rustix::fs::statvfs(&self.dir).map_err(|e| StoreError::Io {
            path: self.dir.clone(),
            source: e.into(),
        })?;
        let scale = |n: u64| n.saturating_mul(s.f_frsize) / 4096;
        Ok(StatFs {
            blocks: scale(s.f_blocks),
            bfree: scale(s.f_bfree),
            bavail: scale(s.f_bavail),
            files: s.f_files,
            ffree: s.f_ffree,
            bsize: 4096,
        })
    }

    /// Drops index entries of chunks nobody references (their bytes are
    /// reclaimed by the next `gc`).
    /// Each leaves the fingerprint index through its journal.
    pub fn prune(&self) -> Result<u64> {
        let (mut after, mut n) = (0u64, 0u64);
        // In batches by id, each its own transaction with the lock let go
        // in between: the rows held stay few, writers wait for one batch
        // at most, and the index's queue grows by a batch at a time. A
        // crash between batches leaves the rest to the next gc.
        loop {
            let mut g = self.lock();
            let dead = Chunks(&g.db).unreferenced(after, PRUNE_BATCH)?;
            let Some(&(last, _)) = dead.last() else {
                self.commit_locked(&mut g, true)?;
                return Ok(n);
            };
            let Inner { db, index, .. } = &mut *g;
            for (id, hash) in &dead {
                if let Ok(h) = Hash::try_from(hash.as_slice()) {
                    index.dropped(db, &h, *id)?;
                }
                Chunks(db).delete(*id)?;
            }
            self.commit_locked(&mut g, false)?;
            (after, n) = (last, n + dead.len() as u64);
        }
    }

    /// `store prune --days`: drops from the fingerprint index the chunks
    /// referenced once whose entry is older than `age` (ZFS `ddtprune`):
    /// they stay stored and readable, but a new copy of them is no longer
    /// found. Marked in the database and journaled first, then removed
    /// from the index (`crate::index`); returns how many.
    pub fn prune_index(&self, age: std::time::Duration) -> Result<u64> {
        self.flush_all(true)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let before = now.saturating_sub(age).as_secs().min(u32::MAX as u64) as u32;
        let mut g = self.lock();
        let n = {
            let Inner { db, index, .. } = &mut *g;
            index.prune_marks(db, before)?
        };
        self.commit_locked(&mut g, true)?;
        g.settle_index()?;
        self.commit_locked(&mut g, true)?;
        Ok(n)
    }

    /// Reclaims unreferenced chunks: containers with nothing live are
    /// deleted, containers less than half live are compacted into new
    /// ones. Works one container at a time, so writers wait at most for one.
    /// A second gc meanwhile waits for this one, then runs.
    pub fn gc(&self) -> Result<GcReport> {
        // A poisoned guard only means the other gc failed: run anyway.
        let _one = self.gc_running.lock().unwrap_or_else(|e| e.into_inner());
        self.flush_all(true)?;
        let history_dropped = self.reclaim_history()?;
        let mut rep = GcReport {
            history_dropped,
            chunks_dropped: self.prune()?,
            ..GcReport::default()
        };
        let mut sealed: Vec<(u64, u64, u64)> = {
            let g = self.lock();
            let mut st = g.db.prepare(&format!(
                "SELECT k.id, k.length, COALESCE(SUM({}), 0) FROM containers k
                 LEFT JOIN chunks c ON c.container = k.id WHERE k.sealed = 1 GROUP BY k.id",
                crate::chunks::STORED_SHARE
            ))?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        // The containers with nothing live first: deleting them needs no
        // room, and on a full disk gives back the room compaction needs.
        sealed.sort_by_key(|&(_, _, live)| live > 0);
        for (id, length, live) in sealed {
            let payload = length.saturating_sub(CONTAINER_HEADER).max(1);
            if live > 0 && live as f64 / payload as f64 >= COMPACT_BELOW {
                continue;
            }
            match self.compact(id) {
                Ok(()) => {}
                Err(e @ (StoreError::LowSpace { .. } | StoreError::NoSpace)) if live > 0 => {
                    rep.compaction_stopped = Some(e.to_string());
                    break;
                }
                // One damaged chunk must not keep every other container
                // from being reclaimed: this one stays, said.
                Err(e @ StoreError::Damaged { .. }) => {
                    rep.containers_damaged.push(e.to_string());
                    continue;
                }
                Err(e) => return Err(e),
            }
            rep.bytes_freed += length.saturating_sub(live);
            if live == 0 {
                rep.containers_deleted += 1;
            } else {
                rep.containers_compacted += 1;
            }
        }
        let (stray, stray_bytes) = self.delete_stray_containers()?;
        rep.containers_deleted += stray;
        rep.bytes_freed += stray_bytes;
        // The rows dropped by gc and by the unlinks before it leave free
        // pages in meta.sqlite: give them back.
        let mut g = self.lock();
        if crate::meta::release_free_pages(&g.db)? > 0 {
            self.commit_locked(&mut g, false)?;
        }
        Ok(rep)
    }

    /// Copies the live chunks of container `id` to the open container,
    /// commits the new locations durably, then deletes the old file.
    /// Records are copied as stored (no recompression) once checked
    /// ([`Store::checked_move`]), so the copies held take at most the
    /// container's stored bytes, whatever its chunks decompress to; a
    /// pack some of whose chunks are gone is made again of the others.
    fn compact(&self, id: u64) -> Result<()> {
        let live = self.chunks_in(id)?;
        // Reading (and checking) the live chunks needs no lock: only gc
        // moves chunks, one gc runs at a time, and the container is sealed.
        let mut moves = Vec::new();
        for rows in live.chunk_by(|a, b| a.2.offset == b.2.offset) {
            moves.push(self.checked_move(rows)?);
        }
        {
            let mut g = self.lock();
            for (rec, members) in moves {
                let new = self.append_encoded(&mut g, &rec)?;
                for (chunk, inner, raw_len) in members {
                    let loc = match inner {
                        Some(at) => Pack::member(new, at, raw_len),
                        None => ChunkLoc { raw_len, ..new },
                    };
                    Chunks(&g.db).relocate(chunk, loc, 0)?;
                }
            }
            g.db.execute("DELETE FROM containers WHERE id = ?1", [id])?;
        }
        self.commit(true)?;
        self.containers.delete(id)
    }

    /// The chunk rows of container `id` (row id, BLAKE3, location) in
    /// offset order: what compaction moves and scrub reads.
    fn chunks_in(&self, id: u64) -> Result<Vec<(u64, Vec<u8>, ChunkLoc)>> {
        Chunks(&self.lock().db).in_container(id)
    }

    /// The record gc writes for the live `rows` of one stored record,
    /// checked first (framing, CRC, decoding, lengths, the BLAKE3 of each
    /// chunk against its row and of the record against its header), and
    /// where each chunk is in it (row id, place in a pack, length). The
    /// stored record itself unless it is a pack that lost chunks: then a
    /// new pack of the others (or the one left, alone). One record is
    /// decoded at a time and dropped; a damaged record is an error (gc
    /// stops, as before, and `scrub` / `fsck` say where).
    fn checked_move(&self, rows: &[(u64, Vec<u8>, ChunkLoc)]) -> Result<Move> {
        let first = rows[0].2;
        let rec = self
            .containers
            .read(first.container, first.offset, first.stored_len as usize)?;
        let record = self.decode_record(&rec, first)?;
        let mut pieces = Vec::with_capacity(rows.len());
        for (_, hash, loc) in rows {
            let piece = piece_at(record.clone(), *loc)?;
            if self.fingerprint(&piece)[..] != hash[..] {
                return Err(container::damaged(
                    first.container,
                    first.offset,
                    "bytes differ from the chunk's BLAKE3",
                ));
            }
            pieces.push(piece);
        }
        let id_ok = match first.inner {
            Some(_) => rec[..32] == self.fingerprint(pieces[0].record()),
            None => rec[..32] == rows[0].1[..],
        };
        if !id_ok {
            return Err(container::damaged(
                first.container,
                first.offset,
                "bytes differ from the record's BLAKE3",
            ));
        }
        let kept: usize = pieces.iter().map(|p| p.len()).sum();
        if first.inner.is_none() || kept == pieces[0].record().len() {
            let members = rows
                .iter()
                .map(|(c, _, l)| (*c, l.inner.map(|p| p.at), l.raw_len))
                .collect();
            let raw_len = pieces[0].record().len() as u32;
            return Ok((
                container::Encoded {
                    bytes: rec,
                    raw_len,
                },
                members,
            ));
        }
        Ok(self.repack(rows, &pieces))
    }

    /// A record of the chunks `pieces` (of `rows`) that a pack kept: a
    /// new pack of them in their order, or the one left alone.
    fn repack(&self, rows: &[(u64, Vec<u8>, ChunkLoc)], pieces: &[Piece]) -> Move {
        let packing = self.cfg.packing();
        if let ([(chunk, hash, loc)], [piece]) = (rows, pieces) {
            let hash: Hash = hash[..].try_into().expect("checked against the chunk");
            return (
                self.encode_chunk(&hash, piece, packing),
                vec![(*chunk, None, loc.raw_len)],
            );
        }
        let raw = pieces.iter().map(|p| &p[..]).collect::<Vec<_>>().concat();
        let mut inner = 0u32;
        let members = rows
            .iter()
            .map(|(c, _, l)| {
                inner += l.raw_len;
                (*c, Some(inner - l.raw_len), l.raw_len)
            })
            .collect();
        (self.encode_pack(&raw, packing), members)
    }

    /// Deletes container files the database does not know (left by a crash
    /// between creating a container and committing it, or by a write that
    /// failed before its commit): how many, and their bytes.
    fn delete_stray_containers(&self) -> Result<(u64, u64)> {
        let g = self.lock();
        let (mut n, mut bytes) = (0, 0);
        for id in self.containers.list()? {
            let known: i64 =
                g.db.query_row("SELECT COUNT(*) FROM containers WHERE id = ?1", [id], |r| {
                    r.get(0)
                })?;
            if known == 0 && id != g.writer.id {
                let len = self.containers.len(id)?.unwrap_or(0);
                self.containers.delete(id)?;
                n += 1;
                bytes += len;
            }
        }
        Ok((n, bytes))
    }

    /// fsck of the fingerprint index against the chunk rows; with
    /// `repair`, any difference rebuilds the index from the rows (after W
    /// is durably reset, so a crash during the rebuild replays it all).
    fn check_index(&self, g: &mut Inner, repair: bool, rep: &mut FsckReport) -> Result<()> {
        let found = {
            let Inner { db, index, .. } = &mut *g;
            index.check(db)?
        };
        if found.is_empty() {
            return Ok(());
        }
        rep.problems.extend(found.iter().cloned());
        if repair {
            set_meta(&g.db, "index_synced", 0)?;
            self.commit_locked(g, true)?;
            let Inner { db, index, .. } = g;
            index.rebuild(db)?;
            rep.repaired += found.len() as u64;
        }
        Ok(())
    }

    /// For `fsck --repair`: every file range whose chunk is damaged is a
    /// problem it cannot repair (nothing is invented); the rest of each
    /// file stays readable.
    fn report_damaged_extents(&self, rep: &mut FsckReport) -> Result<()> {
        let bad: HashMap<u64, String> = self.scrub_chunks()?.damaged_ids.into_iter().collect();
        if bad.is_empty() {
            return Ok(());
        }
        // One pass over the file maps (`extents` has no index on chunk).
        let g = self.lock();
        let mut st =
            g.db.prepare("SELECT ino, off, len, chunk FROM extents ORDER BY ino, off")?;
        let mut rows = st.query([])?;
        while let Some(r) = rows.next()? {
            let Some(why) = bad.get(&r.get::<_, u64>(3)?) else {
                continue;
            };
            let (ino, off, len): (u64, u64, u64) = (r.get(0)?, r.get(1)?, r.get(2)?);
            rep.problems.push(format!(
                "inode {ino} offset {off} length {len}: {why}; cannot be salvaged (reads give EIO)"
            ));
        }
        Ok(())
    }

    /// Reads every referenced chunk and checks its checksum and BLAKE3,
    /// then checks the fingerprint index against the chunk rows (as fsck
    /// does, without repairing): a damaged index file is reported too.
    pub fn scrub(&self) -> Result<ScrubReport> {
        let mut rep = self.scrub_chunks()?;
        // Durable first, as for fsck: the index is then comparable.
        self.flush_all(true)?;
        let mut g = self.lock();
        let Inner { db, index, .. } = &mut *g;
        rep.index_problems = index.check(db)?;
        Ok(rep)
    }

    /// Reads every referenced chunk and checks its checksum and BLAKE3.
    /// Container by container (the rows of one held at a time, read in
    /// offset order), so scrub's memory does not grow with the store.
    fn scrub_chunks(&self) -> Result<ScrubReport> {
        let containers = Chunks(&self.lock().db).containers()?;
        let mut rep = ScrubReport::default();
        for id in containers {
            self.scrub_container(id, &mut rep)?;
        }
        Ok(rep)
    }

    /// Reads and checks every chunk row of container `id`. Damage in a
    /// remote store's cache copy drops the copy, and the bucket's copy is
    /// checked instead (see [`container::ContainerStore::drop_damaged_copy`]).
    fn scrub_container(&self, id: u64, rep: &mut ScrubReport) -> Result<()> {
        let mut one = ScrubReport::default();
        self.scrub_rows(id, &mut one)?;
        if !one.damaged.is_empty() && self.containers.drop_damaged_copy(id) {
            one = ScrubReport::default();
            self.scrub_rows(id, &mut one)?;
        }
        // Every field named: a new one cannot be left out of the sum.
        let ScrubReport {
            chunks_checked,
            bytes_checked,
            damaged,
            damaged_ids,
            index_problems,
        } = one;
        rep.chunks_checked += chunks_checked;
        rep.bytes_checked += bytes_checked;
        rep.damaged.extend(damaged);
        rep.damaged_ids.extend(damaged_ids);
        rep.index_problems.extend(index_problems);
        Ok(())
    }

    /// [`Store::scrub_container`]'s pass over the rows of container `id`.
    fn scrub_rows(&self, id: u64, rep: &mut ScrubReport) -> Result<()> {
        let rows = self.chunks_in(id)?;
        for rows in rows.chunk_by(|a, b| a.2.offset == b.2.offset) {
            self.scrub_record(rows, rep);
        }
        Ok(())
    }

    /// [`Store::scrub_rows`] for the rows of one record, read and
    /// decoded once (a pack's chunks share it).
    fn scrub_record(&self, rows: &[(u64, Vec<u8>, ChunkLoc)], rep: &mut ScrubReport) {
        let first = rows[0].2;
        let record = self
            .containers
            .read(first.container, first.offset, first.stored_len as usize)
            .and_then(|rec| self.decode_record(&rec, first));
        for (id, hash, loc) in rows {
            let (id, loc) = (*id, *loc);
            rep.chunks_checked += 1;
            let piece = match &record {
                Ok(r) => piece_at(r.clone(), loc).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match piece {
                Ok(raw) if self.fingerprint(&raw)[..] == hash[..] => {
                    rep.bytes_checked += raw.len() as u64
                }
                Ok(_) => {
                    rep.damaged.push(format!("chunk {id}: BLAKE3 mismatch"));
                    rep.damaged_ids
                        .push((id, format!("chunk {id}: BLAKE3 mismatch")));
                }
                Err(e) => {
                    rep.damaged.push(format!("chunk {id}: {e}"));
                    rep.damaged_ids.push((id, format!("chunk {id}: {e}")));
                }
            }
        }
    }

    /// Every container the metadata names exists and is at least as long
    /// as committed.
    fn check_containers(&self, g: &Inner, rep: &mut FsckReport) -> Result<()> {
        let mut st = g.db.prepare("SELECT id, length FROM containers")?;
        let rows = st.query_map([], |r| Ok((r.get::<_, u64>(0)?, r.get::<_, u64>(1)?)))?;
        for row in rows {
            let (id, length) = row?;
            match self.containers.len(id)? {
                None => rep.problems.push(format!("container {id} is missing")),
                Some(l) if l < length => rep.problems.push(format!(
                    "container {id} is shorter ({l}) than committed ({length})"
                )),
                _ => {}
            }
        }
        Ok(())
    }

    /// What `PRAGMA integrity_check` finds wrong in the database (its
    /// first 20 lines), none when it says "ok".
    fn sqlite_damage(db: &rusqlite::Connection) -> Result<Vec<String>> {
        let mut st = db.prepare("PRAGMA integrity_check(20)")?;
        let lines = st.query_map([], |r| r.get::<_, String>(0))?;
        let lines = lines.collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(lines.into_iter().filter(|l| l != "ok").collect())
    }

    /// Checks the metadata's invariants; with `repair`, fixes what can be
    /// fixed without inventing data.
    pub fn fsck(&self, repair: bool) -> Result<FsckReport> {
        // Durable: the fingerprint index is then up to date and comparable.
        self.flush_all(true)?;
        let mut g = self.lock();
        let mut rep = FsckReport::default();
        // Damage SQLite sees first: the checks below would only fail on it
        // with what a damaged row made of them (a NULL inode number...).
        let damage = Self::sqlite_damage(&g.db)?;
        if !damage.is_empty() {
            rep.problems.extend(
                damage
                    .into_iter()
                    .map(|d| format!("metadata database: {d}")),
            );
            rep.problems.push(
                "the metadata database is damaged: nothing else was checked or repaired; \
                 keep a copy of the store directory and restore what you need from a snapshot \
                 or (a remote store) `store init --recover`"
                    .into(),
            );
            return Ok(rep);
        }
        for (what, sql, fix) in FSCK_CHECKS {
            let found: Vec<(i64, i64, i64)> = {
                let mut st = g.db.prepare(sql)?;
                let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
                rows.collect::<rusqlite::Result<_>>()?
            };
            for (a, b, c) in &found {
                rep.problems.push(format!("{what} ({a}, {b}, {c})"));
            }
            if let (true, Some(fix), false) = (repair, fix, found.is_empty()) {
                g.db.execute_batch(fix)?;
                rep.repaired += found.len() as u64;
            }
        }
        self.check_containers(&g, &mut rep)?;
        self.check_index(&mut g, repair, &mut rep)?;
        if repair {
            drop(g);
            self.report_damaged_extents(&mut rep)?;
            g = self.lock();
            self.remove_orphans_locked(&mut g)?;
            self.commit_locked(&mut g, true)?;
        }
        let _ = container::RECORD_HEADER;
        Ok(rep)
    }
}

/// fsck's checks of the metadata: what a row found means, the query that
/// finds the rows (three columns, printed), and the repair, if one needs
/// no invented data.
const FSCK_CHECKS: &[(&str, &str, Option<&str>)] = &[
    (
        "reference count differs from the file maps (chunk, count or -1 if none, references)",
        "SELECT c.id, COALESCE(r.refs, -1), COALESCE(n.n, 0) FROM chunks c
             LEFT JOIN chunk_refs r ON r.id = c.id LEFT JOIN (SELECT chunk,
             COUNT(*) n FROM (SELECT chunk FROM extents UNION ALL SELECT chunk
             FROM extents_hist) GROUP BY chunk) n ON n.chunk = c.id
             WHERE r.refs IS NOT COALESCE(n.n, 0)",
        Some(
            "INSERT INTO chunk_refs (id, refs) SELECT id, 0 FROM chunks
                  WHERE id NOT IN (SELECT id FROM chunk_refs);
                  UPDATE chunk_refs SET refs = 0;
                  UPDATE chunk_refs SET refs = n.n FROM (SELECT chunk, COUNT(*) n FROM
                  (SELECT chunk FROM extents UNION ALL SELECT chunk FROM extents_hist)
                  GROUP BY chunk) n WHERE n.chunk = chunk_refs.id;",
        ),
    ),
    (
        "reference count of a missing chunk (id, count, 0)",
        "SELECT r.id, r.refs, 0 FROM chunk_refs r LEFT JOIN chunks c ON c.id = r.id
             WHERE c.id IS NULL",
        Some("DELETE FROM chunk_refs WHERE id NOT IN (SELECT id FROM chunks)"),
    ),
    (
        "extent points at a missing chunk",
        "SELECT e.ino, e.off, e.chunk FROM (SELECT ino, off, chunk FROM extents
             UNION ALL SELECT ino, off, chunk FROM extents_hist) e
             LEFT JOIN chunks c ON c.id = e.chunk WHERE c.id IS NULL",
        None,
    ),
    (
        "chunk beyond its container's committed length",
        "SELECT c.id, c.container, c.offset FROM chunks c LEFT JOIN containers k
             ON k.id = c.container WHERE k.id IS NULL OR c.offset + c.stored_len > k.length",
        None,
    ),
    (
        "directory entry points at a missing inode",
        "SELECT d.parent, d.ino, 0 FROM dirents d LEFT JOIN inodes i ON i.ino = d.ino
             WHERE i.ino IS NULL",
        Some("DELETE FROM dirents WHERE ino NOT IN (SELECT ino FROM inodes)"),
    ),
    (
        "link count differs from the directory entries",
        "SELECT i.ino, i.nlink, COALESCE(n.n, 0) FROM inodes i LEFT JOIN (SELECT ino,
             COUNT(*) n FROM dirents GROUP BY ino) n ON n.ino = i.ino
             WHERE i.kind != 2 AND i.nlink != COALESCE(n.n, 0)",
        Some(
            "UPDATE inodes SET nlink = 0 WHERE kind != 2;
                  UPDATE inodes SET nlink = n.n FROM (SELECT ino, COUNT(*) n FROM dirents
                  GROUP BY ino) n WHERE n.ino = inodes.ino AND inodes.kind != 2;",
        ),
    ),
    (
        "directory's parent differs from its entry",
        "SELECT i.ino, COALESCE(i.parent, 0), d.parent FROM dirents d
             JOIN inodes i ON i.ino = d.ino WHERE i.kind = 2 AND i.parent IS NOT d.parent",
        Some(
            "UPDATE inodes SET parent = d.parent FROM dirents d
                  WHERE d.ino = inodes.ino AND inodes.kind = 2",
        ),
    ),
    (
        "data bytes differ from the file map",
        "SELECT i.ino, i.data, COALESCE(n.n, 0) FROM inodes i LEFT JOIN (SELECT ino,
             SUM(len) n FROM extents GROUP BY ino) n ON n.ino = i.ino
             WHERE i.data != COALESCE(n.n, 0)",
        Some(crate::migrate::V4_RECOMPUTE_DATA),
    ),
    (
        "extent past the end of its file",
        "SELECT e.ino, e.off, e.len FROM extents e JOIN inodes i ON i.ino = e.ino
             WHERE e.off + e.len > i.size",
        None,
    ),
    (
        "history row that died before it was born (inode, born, died)",
        "SELECT ino, born, died FROM inodes_hist WHERE died <= born
             UNION ALL SELECT ino, born, died FROM extents_hist WHERE died <= born
             UNION ALL SELECT ino, born, died FROM xattrs_hist WHERE died <= born
             UNION ALL SELECT ino, born, died FROM dirents_hist WHERE died <= born",
        None,
    ),
    (
        "snapshot of an epoch not yet closed (id, epoch, open epoch)",
        "SELECT s.id, s.epoch, CAST(m.value AS INTEGER) FROM snapshots s
             JOIN meta m ON m.key = 'epoch' WHERE s.epoch >= CAST(m.value AS INTEGER)",
        None,
    ),
];
