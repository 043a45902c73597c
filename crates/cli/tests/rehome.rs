//! Re-homing on real loop-mounted btrfs and XFS: version chains of
//! near-copies and files assembled from shared pieces must free (nearly)
//! all their duplicate bytes as measured by compsize (btrfs) or FIEMAP
//! (XFS), and a run killed at any point, also while copying, must leave
//! exactly the names the tree had and no allocated space behind.

mod common;

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use onecopy_testfs::{checksum_tree, physical_bytes, shared_bytes_between, FsKind, LoopFs, Prng};

const BLOCK: u64 = 4096;

/// Bytes the files under `root` keep allocated: compsize's "Disk Usage"
/// on btrfs (whole extents, each once: it sees bookending), the union of
/// FIEMAP physical ranges on XFS (which frees per block).
fn disk_usage(kind: FsKind, root: &Path) -> u64 {
    match kind {
        FsKind::Btrfs => {
            let out = Command::new("compsize")
                .arg("-b")
                .arg(root)
                .output()
                .expect("run compsize (package btrfs-compsize)");
            let text = String::from_utf8_lossy(&out.stdout);
            text.lines()
                .find(|l| l.starts_with("TOTAL"))
                .and_then(|l| l.split_whitespace().nth(2))
                .and_then(|t| t.parse().ok())
                .unwrap_or_else(|| panic!("unparsable compsize output: {text:?}"))
        }
        _ => physical_bytes(files_under(root)),
    }
}

/// Every regular file below `root`, sorted.
fn files_under(root: &Path) -> Vec<PathBuf> {
    names(root)
        .into_iter()
        .filter(|p| p.is_file())
        .collect::<Vec<_>>()
}

/// Runs `btrfs ARGS...`, which must succeed.
fn btrfs(args: &[&Path]) {
    let ok = Command::new("btrfs").args(args).status().unwrap().success();
    assert!(ok, "btrfs {args:?}");
}

/// Every name below `root` (what `find` prints), sorted.
fn names(root: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
            out.insert(e.path());
        }
    }
    out
}

fn write_file(p: &Path, data: &[u8]) {
    mkparent(p);
    let mut f = File::create(p).unwrap();
    f.write_all(data).unwrap();
}

/// One chain group: an original of `size` random bytes and, to depth
/// `length`, `fanout` successors per version, each its predecessor with
/// one more 32-byte change. Returns (predecessor, file) pairs and the
/// bytes an ideal deduper at `block` granularity keeps.
fn make_chain(
    root: &Path,
    size: u64,
    length: u32,
    fanout: u32,
    seed: u64,
    block: u64,
) -> (Vec<(PathBuf, PathBuf)>, u64) {
    let mut rng = Prng::new(seed);
    let mut base = vec![0u8; size as usize];
    rng.fill(&mut base);
    let orig = root.join("v");
    write_file(&orig, &base);
    let mut pairs = Vec::new();
    let mut ideal = round4k(size);
    let mut level = vec![(orig, base)];
    for _ in 0..length {
        let mut next = Vec::new();
        for (path, data) in &level {
            for k in 0..fanout {
                let mut d = data.clone();
                let off = rng.below(size - 32 + 1);
                rng.fill(&mut d[off as usize..off as usize + 32]);
                let p = PathBuf::from(format!("{}.{k}", path.display()));
                write_file(&p, &d);
                ideal += ((off + 32).div_ceil(block) - off / block) * block;
                pairs.push((path.clone(), p.clone()));
                next.push((p, d));
            }
        }
        level = next;
    }
    (pairs, ideal)
}

/// Runs `onecopy dedupe ARGS root` and checks the outcome against the
/// measurement: contents unchanged, at least `share` of the duplicate
/// bytes (what the files keep beyond `ideal`) really freed, and the
/// report's `bytes_freed` agreeing with the measured figure. The run is
/// made under frequent commits ([`Committer`]).
fn dedupe_and_measure(fs: &LoopFs, root: &Path, ideal: u64, args: &[&str], share: f64) -> Run {
    let kind = fs.kind();
    fs.sync();
    let sums = checksum_tree(root);
    let before = disk_usage(kind, root);
    let dup = before - ideal;
    let r = {
        let _commits = Committer::start(root);
        dedupe(&[root], args)
    };
    r.assert_ok("dedupe");
    fs.sync();
    let freed = before.saturating_sub(disk_usage(kind, root));
    eprintln!(
        "{kind} {}: duplicate {:.1} MiB, freed {:.1} MiB (report {:.1} MiB, re-homing wrote {:.1} MiB)",
        root.display(),
        mib(dup),
        mib(freed),
        mib(r.u("bytes_freed")),
        mib(r.u("rehome_bytes_written"))
    );
    assert_eq!(checksum_tree(root), sums, "contents changed");
    assert!(
        freed as f64 >= share * dup as f64,
        "{kind}: freed {freed} of {dup} duplicate bytes (< {share})"
    );
    assert_close(
        "reported bytes_freed vs measured",
        r.u("bytes_freed"),
        freed,
        tol(freed, 3, MIB),
    );
    r
}

/// Commits the filesystem holding a directory every 100 ms until dropped,
/// as the periodic commits of a slow run on a loaded machine do: space
/// that dedupe freed early in the run is then reused by later allocations
/// (re-homed copies), possibly at the very address where a freed extent
/// started, which the report must not mistake for the old extent.
struct Committer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Committer {
    fn start(dir: &Path) -> Committer {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = File::open(dir).expect("open the tree to commit it");
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                let _ = onecopy_ioctl::fs::syncfs(std::os::fd::AsFd::as_fd(&f));
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Committer {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Committer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Chains of length 1, 2 and 8 and a fan-out of 3: >= 95% of the
/// duplicate bytes are really freed, the report agrees with the
/// measurement, contents are unchanged and each version shares all but
/// its changed blocks with its predecessor.
fn chains(kind: FsKind) {
    let fs = new_fs(kind, 768 * MIB);
    let root = fs.path().join("chains");
    // Not a multiple of the block size: the tails take part too.
    let size = 6 * MIB + 1234;
    let mut pairs = Vec::new();
    let mut ideal = 0;
    for (g, (length, fanout)) in [(1, 1), (2, 1), (8, 1), (2, 3)].into_iter().enumerate() {
        let dir = root.join(format!("c{g}"));
        let (p, i) = make_chain(&dir, size, length, fanout, 40 + g as u64, DEFAULT_BLOCK);
        pairs.extend(p);
        ideal += i;
    }
    dedupe_and_measure(&fs, &root, ideal, &[], 0.95);
    for (pred, v) in &pairs {
        let shared = shared_bytes_between(pred, v);
        assert!(
            shared + 2 * DEFAULT_BLOCK >= size,
            "{}: shares only {shared} bytes with {}",
            v.display(),
            pred.display()
        );
    }
    let r2 = dedupe(&[&root], &[]);
    r2.assert_ok("second run");
    assert_eq!(r2.u("bytes_deduped"), 0);
}

/// 1 MiB files assembled from a pool of 8 KiB random pieces at 4 KiB
/// offsets; returns the bytes of distinct 4 KiB blocks.
fn make_pieces(root: &Path, files: u64, seed: u64) -> u64 {
    let mut rng = Prng::new(seed);
    let pool = files * 16;
    let piece = |id: u64| {
        let mut b = vec![0u8; 8192];
        Prng::derive(seed, id).fill(&mut b);
        b
    };
    let mut distinct = BTreeSet::new();
    let mut fillers = 0u64;
    for i in 0..files {
        let mut data = Vec::with_capacity(MIB as usize);
        while (data.len() as u64) < MIB {
            if rng.chance(0.1) {
                let mut b = vec![0u8; BLOCK as usize];
                rng.fill(&mut b);
                data.extend_from_slice(&b);
                fillers += 1;
                continue;
            }
            let id = rng.below(pool);
            let take = (MIB as usize - data.len()).min(8192);
            data.extend_from_slice(&piece(id)[..take]);
            distinct.insert((id, 0));
            if take > BLOCK as usize {
                distinct.insert((id, 1));
            }
        }
        write_file(&root.join(format!("p{}/f{i:04}", i / 100)), &data);
    }
    (distinct.len() as u64 + fillers) * BLOCK
}

/// The "pieces" shape with `-b 4K`: >= 90% of the 4 KiB ideal.
fn pieces(kind: FsKind) {
    let fs = new_fs(kind, 1024 * MIB);
    let root = fs.path().join("pieces");
    let ideal = make_pieces(&root, 300, 7);
    dedupe_and_measure(&fs, &root, ideal, &["-b", "4K"], 0.90);
}

/// Space allocated on the filesystem beyond what its files keep: a
/// leaked temporary copy would show here.
fn unexplained(fs: &LoopFs, kind: FsKind) -> i64 {
    fs.sync();
    fs.used_bytes() as i64 - disk_usage(kind, fs.path()) as i64
}

/// Whether `pid` is writing a temporary copy: it has an open file that is
/// an unnamed one (`/mnt/#123 (deleted)`) or an old-style named one
/// (`.onecopy-tmp.<pid>/...`), with bytes in it.
fn copying(pid: u32) -> bool {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    rd.flatten().any(|e| {
        let tmp = std::fs::read_link(e.path()).is_ok_and(|t| {
            let t = t.to_string_lossy();
            t.contains(".onecopy-tmp") || (t.contains("/#") && t.ends_with("(deleted)"))
        });
        tmp && std::fs::metadata(e.path()).is_ok_and(|m| m.is_file() && m.len() > 0)
    })
}

/// A tree where re-homing has a long copy to make: `a`'s first 24 MiB are
/// a copy of `b` (written first, so canonical), so after dedupe 40 MiB of
/// `a`'s 64 MiB extent stay live and are re-homed at once; chains add many
/// short copies.
fn make_kill_tree(root: &Path) {
    let _ = std::fs::remove_dir_all(root);
    let mut rng = Prng::new(3);
    let mut a = vec![0u8; (64 * MIB) as usize];
    rng.fill(&mut a);
    write_file(&root.join("b"), &a[..(24 * MIB) as usize]);
    write_file(&root.join("z/a"), &a);
    make_chain(&root.join("ch"), 4 * MIB, 3, 2, 5, DEFAULT_BLOCK);
}

/// Starts `onecopy dedupe` on `root` and SIGKILLs it when `kill_at`
/// passes or, with `at_copy`, a moment after a re-homing copy is open.
/// Returns whether the kill landed during a copy, and how long it ran.
fn run_and_kill(root: &Path, kill_at: Duration, at_copy: bool, rng: &mut Prng) -> (bool, Duration) {
    let cache = std::env::temp_dir().join(format!("onecopy-kill-{}", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_onecopy"))
        .env("ONECOPY_CACHE_DIR", &cache)
        .args(["dedupe", "--quiet", "--no-catalog"])
        .arg(root)
        .spawn()
        .unwrap();
    let t = Instant::now();
    let mut saw_copy = false;
    while child.try_wait().unwrap().is_none() {
        if at_copy && copying(child.id()) {
            saw_copy = true;
            std::thread::sleep(Duration::from_millis(rng.range(0, 20)));
            break;
        }
        if !at_copy && t.elapsed() >= kill_at {
            break;
        }
        std::thread::sleep(Duration::from_micros(300));
    }
    let _ = child.kill();
    let _ = child.wait();
    (saw_copy, t.elapsed())
}

/// SIGKILL at random points of a run, half of them while a re-homing copy
/// is open, each on a fresh tree: the filesystem keeps exactly its names
/// and contents, and no space stays allocated for a temporary copy.
fn killed(kind: FsKind) {
    let fs = new_fs(kind, 1024 * MIB);
    let root = fs.path().join("k");
    let mut rng = Prng::new(17);
    // The length of a whole run bounds the random kill times.
    make_kill_tree(&root);
    fs.sync();
    let (_, whole) = run_and_kill(&root, Duration::from_secs(600), false, &mut rng);
    let mut mid_copy = 0;
    for i in 0..6u64 {
        make_kill_tree(&root);
        fs.sync();
        let sums = checksum_tree(&root);
        let all_names = names(fs.path());
        let leak0 = unexplained(&fs, kind);
        let at = Duration::from_micros(rng.below(whole.as_micros() as u64 + 1));
        let (saw_copy, ran) = run_and_kill(&root, at, i % 2 == 0, &mut rng);
        mid_copy += u32::from(saw_copy);
        assert_eq!(names(fs.path()), all_names, "kill {i}: names changed");
        assert_eq!(checksum_tree(&root), sums, "kill {i}: contents changed");
        let leak = unexplained(&fs, kind);
        eprintln!(
            "{kind}: kill {i} after {ran:?} of {whole:?} ({}): allocated beyond the files {:.1} MiB (before {:.1})",
            if saw_copy { "mid-copy" } else { "random time" },
            leak as f64 / MIB as f64,
            leak0 as f64 / MIB as f64
        );
        assert!(
            leak <= leak0 + 4 * MIB as i64,
            "kill {i}: {leak} bytes allocated beyond the files (was {leak0})"
        );
    }
    if kind == FsKind::Btrfs {
        assert!(
            mid_copy >= 2,
            "only {mid_copy} kills landed during a re-homing copy"
        );
    }
    // A run to the end after a kill finishes cleanly.
    let names_now = names(fs.path());
    dedupe(&[&root], &["--no-catalog"]).assert_ok("final run");
    assert_eq!(names(fs.path()), names_now);
}

/// Re-homing shares the copy into a file that the run's plan never named
/// as a destination: the "already shared" files of an interrupted run
/// are re-homed by the next run.
fn resumes_after_interrupt(kind: FsKind) {
    let fs = new_fs(kind, 512 * MIB);
    let root = fs.path().join("r");
    let (_, ideal) = make_chain(&root, 8 * MIB, 2, 1, 9, DEFAULT_BLOCK);
    fs.sync();
    // The first run shares but does not re-home; the second must.
    dedupe(&[&root], &["--rehome-max-write", "0", "--no-catalog"]).assert_ok("no re-homing");
    dedupe_and_measure(&fs, &root, ideal, &["--no-catalog"], 0.95);
}

/// btrfs: an extent a snapshot also references can not be released, so
/// re-homing writes nothing for it (LOGICAL_INO finds the snapshot's
/// reference), and the snapshot's files keep their extents.
#[test]
fn snapshot_owner_blocks_rehoming_btrfs() {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let vol = fs.path().join("vol");
    btrfs(&[Path::new("subvolume"), Path::new("create"), &vol]);
    make_chain(&vol.join("c"), 8 * MIB, 2, 1, 21, DEFAULT_BLOCK);
    fs.sync();
    let snap = fs.path().join("snap");
    btrfs(&[
        Path::new("subvolume"),
        Path::new("snapshot"),
        Path::new("-r"),
        &vol,
        &snap,
    ]);
    let sums = checksum_tree(&snap);
    let r = dedupe(&[&vol], &[]);
    r.assert_ok("dedupe beside a snapshot");
    assert!(r.u("bytes_deduped") > 0);
    assert_eq!(
        r.u("rehome_bytes_written"),
        0,
        "wrote copies that free nothing"
    );
    assert_eq!(checksum_tree(&snap), sums);
}

/// btrfs: a read-only snapshot named first is no place for re-homing's
/// unnamed temporary files (EROFS): they go to a changed file's
/// directory instead, and the bookended extent is freed in the first run
/// (it failed, exit 1, and later runs trusted the files as done).
#[test]
fn a_read_only_first_root_does_not_stop_rehoming_btrfs() {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let live = fs.path().join("live");
    btrfs(&[Path::new("subvolume"), Path::new("create"), &live]);
    let (a, b) = (
        onecopy_testfs::random_bytes(4 * MIB as usize, 91),
        onecopy_testfs::random_bytes(4 * MIB as usize, 92),
    );
    write_file(&live.join("s"), &a);
    let snap = fs.path().join("snap");
    btrfs(&[
        Path::new("subvolume"),
        Path::new("snapshot"),
        Path::new("-r"),
        &live,
        &snap,
    ]);
    write_file(&live.join("d"), &[a.clone(), b].concat());
    fs.sync();
    let sums = checksum_tree(&live);
    let r = dedupe(&[&snap, &live], &[]);
    r.assert_ok("the read-only snapshot first");
    assert!(r.u("rehome_bytes_written") > 0, "nothing re-homed");
    assert!(r.u("bytes_freed") > 0, "nothing freed");
    assert_eq!(checksum_tree(&live), sums);
    let want: BTreeSet<PathBuf> = ["s", "d"].map(|n| live.join(n)).into();
    assert_eq!(names(&live), want, "a name left in the tree");
}

/// btrfs: an extent whose only live bytes are a short file tail shared by
/// two files (here `b` and its copy `c`, whose blocks were shared with `a`)
/// is re-homed into a copy both files share. A temporary copy holding just
/// those bytes would be stored inline in btrfs metadata, and sharing an
/// inline extent into a file makes the kernel write a private block into
/// each destination: the files would lose the tail they shared, and a later
/// run would find it again.
#[test]
fn a_lone_shared_tail_stays_shared_btrfs() {
    let fs = new_fs(FsKind::Btrfs, 512 * MIB);
    let root = fs.path().join("t");
    let body = onecopy_testfs::random_bytes(3 * BLOCK as usize, 77);
    let mut whole = body.clone();
    whole.extend_from_slice(&onecopy_testfs::random_bytes(77, 78));
    write_file(&root.join("a"), &body);
    write_file(&root.join("b"), &whole);
    write_file(&root.join("c"), &whole);
    fs.sync();
    let sums = checksum_tree(&root);
    // Access times far in the past, set after the checksums' reads: any
    // read would move them (relatime).
    let names = ["a", "b", "c"].map(|n| root.join(n));
    let touched = Command::new("touch")
        .args(["-a", "-d", "2020-01-01"])
        .args(&names)
        .status()
        .unwrap();
    assert!(touched.success());
    let atimes = || names.clone().map(|p| std::fs::metadata(p).unwrap().atime());
    let before = atimes();
    let r = dedupe(&[&root], &[]);
    r.assert_ok("dedupe of a body and two copies with a tail");
    assert!(
        r.u("rehome_bytes_written") > 0,
        "the tail's extent was not re-homed: the case is not exercised"
    );
    assert_eq!(atimes(), before, "the run read a file and moved its atime");
    assert_eq!(checksum_tree(&root), sums);
    let tail = |p: &Path| {
        let x = onecopy_testfs::data_extents(p);
        let last = *x.last().expect("an extent");
        assert_eq!(
            last.logical + last.length,
            4 * BLOCK,
            "{}: {x:?}",
            p.display()
        );
        last.physical
    };
    assert_eq!(
        tail(&root.join("b")),
        tail(&root.join("c")),
        "the copies no longer share their tail"
    );
    let again = dedupe(&[&root], &["--dry-run", "--no-catalog"]);
    again.assert_ok("a fresh plan");
    assert_eq!(
        again.u("bytes_would_share"),
        0,
        "a fresh plan finds more to share"
    );
}

per_fs!(chains, pieces, killed, resumes_after_interrupt);
