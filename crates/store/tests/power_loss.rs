//! Power loss simulated below the store (issue 11). `Lossy` is a
//! [`ContainerStore`] over real files that cuts the power at a random
//! backend operation: that operation and every later one fail, and every
//! container byte not made durable by `sync` is dropped (the file is
//! truncated to its last synced length). The store is then reopened on
//! the real files and checked against an independent record.
//!
//! SQLite cannot be put behind the trait (it does its own I/O), so its
//! side is simulated in two ways: `sqlite_as_written` keeps every page
//! SQLite wrote (a process crash, or a power loss after the OS wrote the
//! WAL back), `sqlite_back_to_last_fsync` restores the database files as
//! they were after the last `fsync` returned (the worst a power loss can
//! do to `synchronous=NORMAL` commits). The second runs without gc, whose
//! durable commits happen inside the store where no snapshot can be taken.
//! Deleted containers stay deleted (a real power loss could bring one
//! back; it would be a stray that gc removes).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use onecopy_store::container::{ContainerStore, LocalDir};
use onecopy_store::{Kind, NewNode, RenameFlags, SetAttr, Store, StoreConfig, StoreError};

/// Deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Odd (xorshift needs a non-zero state); replay with `ONECOPY_FAULT_SEED`.
fn seed(case: &str) -> u64 {
    onecopy_testfs::seed::replayable("ONECOPY_FAULT_SEED", case) | 1
}

struct LossState {
    ops_left: u64,
    dead: bool,
    /// Synced length of every container.
    durable: HashMap<u64, u64>,
    /// The sync call (counted from 1) that fails with `EIO`, the way
    /// Linux reports a failed writeback: the pages it could not write are
    /// marked clean, so the bytes are lost at the next power cut although
    /// a later sync of the same file succeeds.
    fail_sync: Option<u64>,
    /// How long the failing sync takes (other threads' syncs run
    /// meanwhile).
    fail_pause: std::time::Duration,
    syncs: u64,
    /// (container, from, to): bytes a failed sync lost.
    lost: Vec<(u64, u64, u64)>,
}

/// Real container files, and a power cut at the `ops_left`-th operation.
struct Lossy {
    inner: LocalDir,
    root: PathBuf,
    st: Mutex<LossState>,
}

fn cut() -> StoreError {
    StoreError::Io {
        path: "power cut".into(),
        source: std::io::Error::from_raw_os_error(libc::EIO),
    }
}

impl Lossy {
    fn new(root: &Path, ops_left: u64) -> Lossy {
        let inner = LocalDir::new(root);
        let mut durable = HashMap::new();
        for id in inner.list().unwrap() {
            durable.insert(id, inner.len(id).unwrap().unwrap());
        }
        Lossy {
            inner,
            root: root.into(),
            st: Mutex::new(LossState {
                ops_left,
                dead: false,
                durable,
                fail_sync: None,
                fail_pause: std::time::Duration::ZERO,
                syncs: 0,
                lost: Vec::new(),
            }),
        }
    }

    /// Counts one operation; Err once the power is off.
    fn tick(&self) -> Result<std::sync::MutexGuard<'_, LossState>, StoreError> {
        let mut st = self.st.lock().unwrap();
        if st.dead {
            return Err(cut());
        }
        st.ops_left -= 1;
        if st.ops_left == 0 {
            st.dead = true;
            return Err(cut());
        }
        Ok(st)
    }

    fn dead(&self) -> bool {
        self.st.lock().unwrap().dead
    }

    /// Whether the sync chosen to fail has failed.
    fn sync_failed(&self) -> bool {
        !self.st.lock().unwrap().lost.is_empty()
    }

    /// What the disk holds after the cut: each container truncated to its
    /// synced length.
    fn lose_unsynced(&self) {
        let st = self.st.lock().unwrap();
        for id in self.inner.list().unwrap() {
            let keep = st.durable.get(&id).copied().unwrap_or(0);
            let p = self
                .root
                .join(format!("{:02x}", id & 0xff))
                .join(format!("{id:016x}.occ"));
            let f = std::fs::File::options().write(true).open(&p).unwrap();
            if f.metadata().unwrap().len() > keep {
                f.set_len(keep).unwrap();
            }
            for &(_, from, to) in st.lost.iter().filter(|l| l.0 == id) {
                let to = to.min(keep);
                if to > from {
                    use std::os::unix::fs::FileExt;
                    f.write_all_at(&vec![0u8; (to - from) as usize], from)
                        .unwrap();
                }
            }
        }
    }
}

impl ContainerStore for Lossy {
    fn create(&self, id: u64) -> onecopy_store::Result<()> {
        let mut st = self.tick()?;
        st.durable.insert(id, 0);
        self.inner.create(id)
    }
    fn append(&self, id: u64, bytes: &[u8]) -> onecopy_store::Result<()> {
        let _st = self.tick()?;
        // A cut in the middle of a write keeps part of it (unsynced).
        self.inner.append(id, bytes)
    }
    fn read(&self, id: u64, offset: u64, len: usize) -> onecopy_store::Result<Vec<u8>> {
        if self.dead() {
            return Err(cut());
        }
        self.inner.read(id, offset, len)
    }
    fn sync(&self, id: u64) -> onecopy_store::Result<()> {
        let mut st = self.tick()?;
        st.syncs += 1;
        let len = self.inner.len(id)?.unwrap_or(0);
        let from = st.durable.get(&id).copied().unwrap_or(0);
        if st.fail_sync == Some(st.syncs) && len > from {
            st.lost.push((id, from, len));
            let pause = st.fail_pause;
            drop(st);
            std::thread::sleep(pause);
            return Err(cut());
        }
        if st.fail_sync == Some(st.syncs) {
            st.fail_sync = Some(st.syncs + 1);
        }
        self.inner.sync(id)?;
        let len = self.inner.len(id)?.unwrap_or(0);
        st.durable.insert(id, len);
        Ok(())
    }
    fn len(&self, id: u64) -> onecopy_store::Result<Option<u64>> {
        self.inner.len(id)
    }
    fn delete(&self, id: u64) -> onecopy_store::Result<()> {
        let mut st = self.tick()?;
        st.durable.remove(&id);
        self.inner.delete(id)
    }
    fn list(&self) -> onecopy_store::Result<Vec<u64>> {
        self.inner.list()
    }
}

// The record: file `id` is named `f<id>` or `f<id>-<n>`; every word written
// at offset `o` is `id << 48 | gen << 32 | o / 8` (see tests/store_faults.rs
// of the CLI), so a foreign byte is detected wherever it lands.

fn pattern(id: u64, gen: u64, off: u64, len: u64) -> Vec<u8> {
    (0..len / 8)
        .flat_map(|i| {
            (id << 48 | (gen & 0xffff) << 32 | ((off / 8 + i) & 0xffff_ffff)).to_le_bytes()
        })
        .collect()
}

fn foreign_word(id: u64, data: &[u8]) -> Option<usize> {
    data.chunks(8).enumerate().find_map(|(i, w)| {
        let mut b = [0u8; 8];
        b[..w.len()].copy_from_slice(w);
        let v = u64::from_le_bytes(b);
        let ok = v == 0 || (v >> 48 == id && v & 0xffff_ffff == i as u64);
        (!ok).then_some(i * 8)
    })
}

#[derive(Default, Clone)]
struct FileRec {
    ino: u64,
    names: Vec<String>,
    content: Vec<u8>,
    synced: Option<(String, Vec<u8>)>,
    clean: bool,
}

#[derive(Default)]
struct Record {
    files: BTreeMap<u64, FileRec>,
    next_id: u64,
    next_name: u64,
    gen: u64,
}

fn node() -> NewNode {
    NewNode::root_owned(Kind::File, 0o644)
}

/// One random operation through the store's API; true after an fsync.
fn step(s: &Store, r: &mut Record, rng: &mut Rng, gc: bool) -> onecopy_store::Result<bool> {
    let op = rng.below(100);
    if r.files.is_empty() || op < 10 {
        r.next_id += 1;
        let id = r.next_id;
        let name = format!("f{id}");
        r.files.insert(
            id,
            FileRec {
                names: vec![name.clone()],
                ..FileRec::default()
            },
        );
        let ino = s.mknod(1, name.as_bytes(), node())?.ino;
        r.files.get_mut(&id).unwrap().ino = ino;
        return Ok(false);
    }
    let ids: Vec<u64> = r.files.keys().copied().collect();
    let id = ids[rng.below(ids.len() as u64) as usize];
    let f = r.files.get_mut(&id).unwrap();
    f.clean = false;
    let name = f.names[rng.below(f.names.len() as u64) as usize].clone();
    let ino = f.ino;
    match op {
        10..=44 => {
            let size = f.content.len() as u64;
            let off = if op < 20 { size } else { rng.below(size + 1) } & !7;
            let len = (1 + rng.below(if op.is_multiple_of(4) { 40_000 } else { 3_000 })) * 8;
            r.gen += 1;
            let data = pattern(id, r.gen, off, len);
            s.write(ino, off, &data)?;
            let c = &mut r.files.get_mut(&id).unwrap().content;
            if c.len() < (off + len) as usize {
                c.resize((off + len) as usize, 0);
            }
            c[off as usize..(off + len) as usize].copy_from_slice(&data);
            if op.is_multiple_of(3) {
                s.flush_file(ino)?;
            }
        }
        45..=52 => {
            let to = rng.below(f.content.len() as u64 + 50_000) & !7;
            s.setattr(
                ino,
                SetAttr {
                    size: Some(to),
                    ..SetAttr::default()
                },
            )?;
            f.content.resize(to as usize, 0);
        }
        53..=70 => {
            s.fsync(ino)?;
            let f = r.files.get_mut(&id).unwrap();
            f.synced = Some((name, f.content.clone()));
            f.clean = true;
            return Ok(true);
        }
        71..=77 => {
            r.next_name += 1;
            let new = format!("f{id}-{}", r.next_name);
            let flags = RenameFlags::default();
            s.rename(1, name.as_bytes(), 1, new.as_bytes(), flags)?;
            let f = r.files.get_mut(&id).unwrap();
            f.names.retain(|n| *n != name);
            f.names.push(new);
        }
        78..=82 => {
            r.next_name += 1;
            let new = format!("f{id}-{}", r.next_name);
            s.link(ino, 1, new.as_bytes())?;
            r.files.get_mut(&id).unwrap().names.push(new);
        }
        83..=89 => {
            s.unlink(1, name.as_bytes())?;
            let f = r.files.get_mut(&id).unwrap();
            f.names.retain(|n| *n != name);
            if f.names.is_empty() {
                r.files.remove(&id);
            }
        }
        90..=95 => s.commit(false)?,
        _ if gc => {
            s.gc()?;
        }
        _ => {
            let got = s.read(ino, 0, f.content.len())?;
            assert!(got == f.content, "f{id}: live read differs");
        }
    }
    Ok(false)
}

/// Checks the reopened store against the record, then resets the record
/// to what the store holds.
fn check(s: &Store, r: &mut Record, round: usize) {
    let fsck = s.fsck(false).unwrap();
    assert!(
        fsck.problems.is_empty(),
        "round {round}: {:?}",
        fsck.problems
    );
    let mut found: BTreeMap<u64, FileRec> = BTreeMap::new();
    for e in s.readdir(1, 0, usize::MAX).unwrap() {
        let name = String::from_utf8(e.name).unwrap();
        if name == "." || name == ".." {
            continue;
        }
        let id: u64 = name[1..].split('-').next().unwrap().parse().unwrap();
        assert!(id <= r.next_id, "round {round}: {name} never created");
        let size = s.getattr(e.ino).unwrap().size;
        let data = s.read(e.ino, 0, size as usize).unwrap();
        if let Some(at) = foreign_word(id, &data) {
            panic!("round {round}: {name} holds bytes never written to it at {at}");
        }
        let f = found.entry(id).or_default();
        f.ino = e.ino;
        f.names.push(name);
        f.content = data;
    }
    for (id, f) in &r.files {
        if let (true, Some((name, content))) = (f.clean, &f.synced) {
            let got = found.get(id).filter(|g| g.names.contains(name));
            let got = got.unwrap_or_else(|| panic!("round {round}: fsync'd {name} is gone"));
            assert!(
                got.content == *content,
                "round {round}: fsync'd {name} differs ({} vs {} bytes)",
                got.content.len(),
                content.len()
            );
        }
    }
    for f in found.values_mut() {
        f.synced = Some((f.names[0].clone(), f.content.clone()));
        f.clean = true;
    }
    r.files = found;
}

fn snapshot(dir: &Path, to: &Path) {
    for f in ["meta.sqlite", "meta.sqlite-wal"] {
        let _ = std::fs::remove_file(to.join(f));
        if dir.join(f).exists() {
            std::fs::copy(dir.join(f), to.join(f)).unwrap();
        }
    }
}

fn restore(from: &Path, dir: &Path) {
    for f in ["meta.sqlite", "meta.sqlite-wal", "meta.sqlite-shm"] {
        let _ = std::fs::remove_file(dir.join(f));
        if from.join(f).exists() {
            std::fs::copy(from.join(f), dir.join(f)).unwrap();
        }
    }
}

fn power_cuts(chunking: &str, sqlite_rollback: bool, rounds: usize) {
    let mut rng = Rng(seed(&format!(
        "power_cuts({chunking}, rollback={sqlite_rollback})"
    )));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let snap = tmp.path().join("snap");
    std::fs::create_dir(&snap).unwrap();
    let cfg = StoreConfig {
        chunking: chunking.parse().unwrap(),
        container_size: 64 << 10,
        ..StoreConfig::default()
    };
    Store::init(&dir, &cfg).unwrap();
    snapshot(&dir, &snap);
    let mut rec = Record::default();
    for round in 0..rounds {
        let lossy = Arc::new(Lossy::new(&dir.join("containers"), 1 + rng.below(300)));
        let mut wrng = Rng(rng.next() | 1);
        match Store::open_with(&dir, lossy.clone()) {
            Ok(s) => loop {
                let r = step(&s, &mut rec, &mut wrng, !sqlite_rollback);
                if lossy.dead() {
                    break;
                }
                match r {
                    // The database as it stands after a durable commit.
                    Ok(true) if sqlite_rollback => snapshot(&dir, &snap),
                    Ok(_) => {}
                    Err(e) => panic!("round {round}: error before the cut: {e}"),
                }
            },
            // The cut came while opening (recovering) the store itself.
            Err(_) if lossy.dead() => {}
            Err(e) => panic!("round {round}: open failed before the cut: {e}"),
        }
        lossy.lose_unsynced();
        if sqlite_rollback {
            restore(&snap, &dir);
        }
        let s = Store::open(&dir).unwrap();
        check(&s, &mut rec, round);
        s.commit(true).unwrap();
        drop(s);
        snapshot(&dir, &snap);
    }
    let s = Store::open(&dir).unwrap();
    s.gc().unwrap();
    assert_eq!(s.stats().unwrap().unreferenced_chunks, 0);
    let names: Vec<Vec<u8>> = s
        .readdir(1, 0, usize::MAX)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .filter(|n| n != b"." && n != b"..")
        .collect();
    for n in names {
        s.unlink(1, &n).unwrap();
    }
    s.gc().unwrap();
    let st = s.stats().unwrap();
    assert_eq!((st.chunks, st.stored_bytes), (0, 0), "leak: {st:?}");
}

#[test]
fn sqlite_as_written_fixed() {
    power_cuts("fixed:4K", false, 25);
}

#[test]
fn sqlite_as_written_cdc() {
    power_cuts("cdc:2K/8K/32K", false, 25);
}

#[test]
fn sqlite_back_to_last_fsync_fixed() {
    power_cuts("fixed:4K", true, 25);
}

#[test]
fn sqlite_back_to_last_fsync_cdc() {
    power_cuts("cdc:2K/8K/32K", true, 25);
}

/// A container sync fails once (its bytes lost, as Linux may drop pages
/// whose writeback failed) and later syncs succeed: the failed sync and
/// every later commit and `fsync` must report an error (the store is
/// poisoned until reopened), and after a power cut no committed map may
/// point at the lost bytes: every file reads without `EIO`, holds no
/// foreign bytes, fsck is clean, and what was fsync'd before reads back.
fn failed_sync_then_success(chunking: &str, rounds: usize) {
    let mut rng = Rng(seed(&format!("failed_sync_then_success({chunking})")));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let cfg = StoreConfig {
        chunking: chunking.parse().unwrap(),
        container_size: 64 << 10,
        ..StoreConfig::default()
    };
    Store::init(&dir, &cfg).unwrap();
    let mut rec = Record::default();
    let mut failed_after = 0;
    for round in 0..rounds {
        let lossy = Arc::new(Lossy::new(&dir.join("containers"), u64::MAX));
        let s = Store::open_with(&dir, lossy.clone()).unwrap();
        {
            // A sync of the workload fails (one at open would fail the open).
            let mut st = lossy.st.lock().unwrap();
            st.fail_sync = Some(st.syncs + 1 + rng.below(25));
        }
        let mut wrng = Rng(rng.next() | 1);
        let mut after = 0;
        while after < 40 {
            let failed_before = lossy.sync_failed();
            let r = step(&s, &mut rec, &mut wrng, true);
            match r {
                Err(e) if lossy.sync_failed() => {
                    assert_eq!(e.errno(), libc::EIO, "round {round}: {e}");
                    failed_after += failed_before as usize;
                }
                Err(e) => panic!("round {round}: error before the failed sync: {e}"),
                Ok(synced) => assert!(
                    !(synced && lossy.sync_failed()),
                    "round {round}: an fsync succeeded after a failed sync"
                ),
            }
            after += lossy.sync_failed() as usize;
        }
        let e = s.commit(true).unwrap_err();
        assert_eq!(e.errno(), libc::EIO, "round {round}: {e}");
        drop(s);
        lossy.lose_unsynced();
        let s = Store::open(&dir).unwrap();
        check(&s, &mut rec, round);
        s.commit(true).unwrap();
    }
    assert!(failed_after > 0, "no commit was tried after a failed sync");
    let s = Store::open(&dir).unwrap();
    s.gc().unwrap();
    assert_eq!(s.stats().unwrap().unreferenced_chunks, 0);
}

#[test]
fn failed_sync_poisons_until_reopened_fixed() {
    failed_sync_then_success("fixed:4K", 12);
}

#[test]
fn failed_sync_poisons_until_reopened_cdc() {
    failed_sync_then_success("cdc:2K/8K/32K", 12);
}

/// An `fsync` whose container sync runs while another thread's sync of
/// the same container is failing (Linux reports the error to one caller
/// only; the other's sync succeeds) must fail too, and nothing of the
/// poisoned transaction may be committed.
#[test]
fn an_fsync_racing_a_failed_sync_fails_too() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let cfg = StoreConfig {
        chunking: "fixed:4K".parse().unwrap(),
        container_size: 1 << 20,
        ..StoreConfig::default()
    };
    Store::init(&dir, &cfg).unwrap();
    let lossy = Arc::new(Lossy::new(&dir.join("containers"), u64::MAX));
    let s = Store::open_with(&dir, lossy.clone()).unwrap();
    let a = s.mknod(1, b"f1", node()).unwrap().ino;
    s.write(a, 0, &pattern(1, 1, 0, 64 << 10)).unwrap();
    s.flush_file(a).unwrap();
    {
        let mut st = lossy.st.lock().unwrap();
        st.fail_sync = Some(st.syncs + 1);
        st.fail_pause = std::time::Duration::from_millis(300);
    }
    let (first, second) = std::thread::scope(|sc| {
        let h = sc.spawn(|| s.commit(false));
        std::thread::sleep(std::time::Duration::from_millis(100));
        let second = s.fsync(a);
        (h.join().unwrap(), second)
    });
    assert!(first.is_err(), "the failing sync's commit succeeded");
    let e = second.expect_err("an fsync racing the failed sync succeeded");
    assert_eq!(e.errno(), libc::EIO, "{e}");
    drop(s);
    lossy.lose_unsynced();
    let s = Store::open(&dir).unwrap();
    assert!(
        s.lookup(1, b"f1").is_err(),
        "f1 was committed after the sync failed"
    );
    let mut rec = Record::default();
    check(&s, &mut rec, 0);
}
