//! `onecopy store import`: a tree imported offline reads back through a
//! real FUSE mount with every attribute `cp -a` keeps; a mounted store
//! and an existing destination are refused; an unreadable source is
//! reported (exit 1) while the rest is imported; a full disk stops the
//! import with the store consistent; a kill -9 leaves `store fsck` clean
//! and no partial file. Needs root and /dev/fuse.

mod store_common;

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use onecopy_testfs::{checksum_file, FsKind, LoopFs};
use store_common::{fsck_clean, onecopy, require_fuse, scratch, stats, Mount, Rng};

const MIB: u64 = 1 << 20;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn write_rng(path: &Path, rng: &mut Rng, len: usize) {
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&rng.next().to_le_bytes());
    }
    v.truncate(len);
    std::fs::write(path, v).unwrap();
}

fn set_mtime(path: &Path, sec: i64, nsec: i64) {
    use rustix::fs::{utimensat, AtFlags, Timespec, Timestamps, CWD};
    let t = Timespec {
        tv_sec: sec,
        tv_nsec: nsec as _,
    };
    let ts = Timestamps {
        last_access: t,
        last_modification: t,
    };
    utimensat(CWD, path, &ts, AtFlags::SYMLINK_NOFOLLOW).unwrap();
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// The tree of the first test, under `root/src`: files of several sizes,
/// duplicates, a 1 GiB sparse file with data at both ends, a symlink, a
/// hardlink pair, a FIFO, a user xattr, a non-UTF-8 name and a name with
/// a newline, modes 0600/0755/04755, an owner other than root, set mtimes.
fn build_tree(root: &Path) -> PathBuf {
    let src = root.join("src");
    let sub = src.join("sub dir");
    std::fs::create_dir_all(&sub).unwrap();
    let mut rng = Rng::seeded("store_import::tree");
    std::fs::write(src.join("empty"), b"").unwrap();
    std::fs::write(src.join("tiny"), b"x").unwrap();
    write_rng(&src.join("multi"), &mut rng, 3 * MIB as usize + 12_345);
    std::fs::copy(src.join("multi"), sub.join("multi-dup")).unwrap();
    write_rng(&sub.join("small"), &mut rng, 70_000);
    std::fs::copy(sub.join("small"), src.join("small-dup")).unwrap();
    let sparse = src.join("sparse");
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::create(&sparse).unwrap();
        f.write_all_at(&[7u8; 100_000], 0).unwrap();
        f.write_all_at(&[9u8; 50_000], (1 << 30) - 50_000).unwrap();
    }
    std::os::unix::fs::symlink("sub dir/small", src.join("link")).unwrap();
    std::fs::hard_link(src.join("tiny"), sub.join("tiny-hardlink")).unwrap();
    let fifo = CString::new(src.join("fifo").as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);
    // A character device (as /dev/null: 1, 3) and a socket (skipped).
    let dev = CString::new(sub.join("null-dev").as_os_str().as_bytes()).unwrap();
    let rdev = libc::makedev(1, 3);
    assert_eq!(
        unsafe { libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o620, rdev) },
        0
    );
    drop(std::os::unix::net::UnixListener::bind(src.join("sock")).unwrap());
    rustix::fs::setxattr(
        src.join("small-dup"),
        "user.onecopy",
        b"value\0with nul",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
    std::fs::write(src.join(OsStr::from_bytes(b"bad-\xff\xfe-name")), b"raw").unwrap();
    std::fs::write(src.join("new\nline"), b"newline").unwrap();
    chmod(&src.join("multi"), 0o600);
    chmod(&sub.join("small"), 0o755);
    chmod(&src.join("small-dup"), 0o4755);
    rustix::fs::chown(
        src.join("tiny"),
        Some(rustix::process::Uid::from_raw(1234)),
        Some(rustix::process::Gid::from_raw(5678)),
    )
    .unwrap();
    let mut t = 1_000_000_000i64;
    for p in [
        "empty",
        "tiny",
        "multi",
        "sparse",
        "small-dup",
        "link",
        "fifo",
        "sub dir/small",
        "sub dir",
    ] {
        t += 86_400 + 17;
        set_mtime(&src.join(p), t, 123_456_789);
    }
    set_mtime(&src, 1_500_000_000, 5);
    src
}

/// What is compared of one entry: type and mode, owner, size, mtime,
/// link count, symlink target, content checksum, user xattr, device.
type Entry = (
    u32,
    u32,
    u32,
    u64,
    i64,
    i64,
    u64,
    Vec<u8>,
    u128,
    Vec<u8>,
    u64,
);

fn describe(root: &Path) -> BTreeMap<Vec<u8>, Entry> {
    fn walk(root: &Path, p: &Path, out: &mut BTreeMap<Vec<u8>, Entry>) {
        let md = std::fs::symlink_metadata(p).unwrap();
        let rel = p
            .strip_prefix(root)
            .unwrap()
            .as_os_str()
            .as_bytes()
            .to_vec();
        let ft = md.file_type();
        let target = if ft.is_symlink() {
            std::fs::read_link(p)
                .unwrap()
                .as_os_str()
                .as_bytes()
                .to_vec()
        } else {
            Vec::new()
        };
        let sum = if ft.is_file() {
            checksum_file(p).unwrap()
        } else {
            0
        };
        let mut xattr = vec![0u8; 256];
        let x = if ft.is_symlink() {
            Err(rustix::io::Errno::NODATA)
        } else {
            rustix::fs::getxattr(p, "user.onecopy", &mut xattr[..])
        };
        let xattr = x.map(|n| xattr[..n].to_vec()).unwrap_or_default();
        // A directory's size and link count are the filesystem's own.
        let (size, nlink) = if ft.is_dir() {
            (0, 0)
        } else {
            (md.size(), md.nlink())
        };
        out.insert(
            rel,
            (
                md.mode(),
                md.uid(),
                md.gid(),
                size,
                md.mtime(),
                md.mtime_nsec(),
                nlink,
                target,
                sum,
                xattr,
                md.rdev(),
            ),
        );
        if ft.is_dir() {
            for e in std::fs::read_dir(p).unwrap() {
                walk(root, &e.unwrap().path(), out);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn import(store: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["store", "import", s(store)];
    args.extend_from_slice(extra);
    onecopy(&args)
}

/// A tree imported offline (fixed and content-defined chunking) reads
/// back through the mount with its data, modes, owners, mtimes, symlink,
/// hardlink (one inode, 2 links), FIFO, xattr and raw names; the sparse
/// 1 GiB file stays sparse in the store; fsck is clean.
#[test]
fn import_preserves_the_tree_and_reads_back_through_the_mount() {
    require_fuse();
    let work = tempfile::tempdir_in(scratch_dir()).unwrap();
    let src = build_tree(work.path());
    let mut want = describe(&src);
    assert!(want.remove(&b"sock"[..]).is_some(), "the socket was made");
    for chunking in ["fixed:64K", "cdc:16K/64K/256K"] {
        let sc = scratch(&["--chunking", chunking]);
        let out = import(&sc.store, &[s(&src), "--to", "/backups/one", "--json"]);
        assert_eq!(code(&out), 0, "{chunking}: {}", text(&out));
        let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(rep["hardlinks"], 1, "{rep}");
        assert_eq!(rep["specials"], 2, "{rep}");
        assert!(rep["notes"].to_string().contains("socket skipped"), "{rep}");
        assert_eq!(rep["failed"].as_array().unwrap().len(), 0, "{rep}");
        fsck_clean(&sc.store);
        let st = stats(&sc.store);
        let stored = st["stored_bytes"].as_u64().unwrap();
        assert!(st["logical_bytes"].as_u64().unwrap() > 1 << 30, "{st}");
        assert!(
            stored < 5 * MIB,
            "{chunking}: {stored} bytes stored: duplicates or holes were stored"
        );
        let m = Mount::new(&sc);
        let got = describe(&sc.mnt.join("backups/one/src"));
        for (name, e) in &want {
            let g = got.get(name).unwrap_or_else(|| {
                panic!("{chunking}: {:?} missing", String::from_utf8_lossy(name))
            });
            assert_eq!(g, e, "{chunking}: {:?}", String::from_utf8_lossy(name));
        }
        assert_eq!(got.len(), want.len(), "{chunking}: extra entries");
        let a = std::fs::metadata(sc.mnt.join("backups/one/src/tiny")).unwrap();
        let b = std::fs::metadata(sc.mnt.join("backups/one/src/sub dir/tiny-hardlink")).unwrap();
        assert_eq!((a.ino(), a.nlink()), (b.ino(), 2), "{chunking}: hardlink");
        let fifo = std::fs::symlink_metadata(sc.mnt.join("backups/one/src/fifo")).unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_fifo(&fifo.file_type()));
        // An imported file is an ordinary store file: a write into the
        // data at the sparse file's end (not aligned to a chunk) reads
        // back over the imported bytes around it.
        let tail = (1u64 << 30) - 50_000;
        let want_tail = {
            let mut v = vec![0u8; 50_000 - 20_000];
            v.extend_from_slice(&[9u8; 50_000]);
            v[50_000 - 20_000 + 333..50_000 - 20_000 + 343].copy_from_slice(b"0123456789");
            v
        };
        {
            use std::os::unix::fs::FileExt;
            let p = sc.mnt.join("backups/one/src/sparse");
            let f = std::fs::File::options().write(true).open(&p).unwrap();
            f.write_all_at(b"0123456789", tail + 333).unwrap();
            f.sync_all().unwrap();
            drop(f);
            let f = std::fs::File::open(&p).unwrap();
            let mut got = vec![0u8; want_tail.len()];
            f.read_exact_at(&mut got, tail - 30_000).unwrap();
            assert!(got == want_tail, "{chunking}: write into an imported file");
        }
        m.unmount();
        fsck_clean(&sc.store);
    }
}

fn scratch_dir() -> &'static Path {
    std::fs::create_dir_all("/var/tmp/store-tests").unwrap();
    Path::new("/var/tmp/store-tests")
}

/// A mounted store is refused with the in-use exit code (3) and one line;
/// an existing destination is refused (exit 2) with nothing written; a
/// destination path through a file is refused (exit 2).
#[test]
fn import_refuses_a_mounted_store_and_an_existing_destination() {
    require_fuse();
    let work = tempfile::tempdir_in(scratch_dir()).unwrap();
    let src = work.path().join("data");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("f"), b"first").unwrap();
    let sc = scratch(&[]);
    let m = Mount::new(&sc);
    let out = import(&sc.store, &[s(&src)]);
    assert_eq!(code(&out), 3, "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("in use"), "{err}");
    m.unmount();

    let out = import(&sc.store, &[s(&src)]);
    assert_eq!(code(&out), 0, "{}", text(&out));
    // A source holding the store itself: the store is skipped with a note.
    let holder = sc.store.parent().unwrap();
    let out = import(&sc.store, &[s(holder), "--to", "/holder"]);
    assert_eq!(code(&out), 0, "{}", text(&out));
    assert!(text(&out).contains("the store itself"), "{}", text(&out));
    let before = stats(&sc.store);
    std::fs::write(src.join("f"), b"second version").unwrap();
    std::fs::write(src.join("g"), b"new file").unwrap();
    let out = import(&sc.store, &[s(&src)]);
    assert_eq!(code(&out), 2, "{}", text(&out));
    assert!(text(&out).contains("already exists"), "{}", text(&out));
    // Also when only one of several sources collides.
    let other = work.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let out = import(&sc.store, &[s(&other), s(&src)]);
    assert_eq!(code(&out), 2, "{}", text(&out));
    let out = import(&sc.store, &[s(&other), "--to", "/data/f/below"]);
    assert_eq!(code(&out), 2, "{}", text(&out));
    let after = stats(&sc.store);
    for k in ["files", "directories", "logical_bytes", "written_new_bytes"] {
        assert_eq!(before[k], after[k], "{k} changed: something was written");
    }
    fsck_clean(&sc.store);
    let m = Mount::new(&sc);
    assert_eq!(std::fs::read(sc.mnt.join("data/f")).unwrap(), b"first");
    assert!(!sc.mnt.join("other").exists());
    m.unmount();
}

/// Flips one payload byte of the only container record that holds
/// `needle` (compression off, so payloads are the raw bytes).
fn damage_record_holding(store: &Path, needle: &[u8]) {
    let mut hit = 0;
    for d in std::fs::read_dir(store.join("containers")).unwrap() {
        for f in std::fs::read_dir(d.unwrap().path()).unwrap() {
            let p = f.unwrap().path();
            let mut b = std::fs::read(&p).unwrap();
            if let Some(at) = b.windows(needle.len()).position(|w| w == needle) {
                b[at] ^= 0xff;
                std::fs::write(&p, b).unwrap();
                hit += 1;
            }
        }
    }
    assert_eq!(hit, 1, "record holding the needle not found once");
}

/// A source file whose read fails with EIO (it lives on a second store,
/// mounted, whose chunk was damaged) is reported with exit 1 and left
/// out; everything else is imported and fsck is clean.
#[test]
fn import_reports_an_unreadable_file_and_imports_the_rest() {
    require_fuse();
    let mut rng = Rng::seeded("store_import::unreadable");
    let work = tempfile::tempdir_in(scratch_dir()).unwrap();
    let plain = work.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    write_rng(&plain.join("a"), &mut rng, 200_000);
    // The failing source: files on a mounted store with a damaged chunk.
    let sick = scratch(&["--compress", "none", "--chunking", "fixed:4K"]);
    let m = Mount::new(&sick);
    write_rng(&sick.mnt.join("bad"), &mut rng, 40_000);
    write_rng(&sick.mnt.join("good"), &mut rng, 40_000);
    let bad = std::fs::read(sick.mnt.join("bad")).unwrap();
    m.unmount();
    damage_record_holding(&sick.store, &bad[8192..8192 + 64]);
    let m = Mount::new(&sick);
    assert!(
        std::fs::read(sick.mnt.join("bad")).is_err(),
        "damage not seen"
    );
    let good = checksum_file(&sick.mnt.join("good")).unwrap();

    let sc = scratch(&[]);
    let out = import(&sc.store, &[s(&plain), s(&sick.mnt)]);
    assert_eq!(code(&out), 1, "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad"), "{err}");
    assert!(!err.contains("good"), "{err}");
    m.unmount();
    fsck_clean(&sc.store);
    let m = Mount::new(&sc);
    let got = sc.mnt.join(sick.mnt.file_name().unwrap());
    assert!(!got.join("bad").exists(), "a failed file is in the store");
    assert_eq!(checksum_file(&got.join("good")).unwrap(), good);
    assert_eq!(
        checksum_file(&sc.mnt.join("plain/a")).unwrap(),
        checksum_file(&plain.join("a")).unwrap()
    );
    m.unmount();
}

/// A store on a small filesystem: the import of more than fits stops with
/// the no-space message and exit 4; once space is freed, fsck is clean and
/// every file the store names has the source's bytes.
#[test]
fn import_stops_on_a_full_disk_and_leaves_the_store_consistent() {
    require_fuse();
    let mut rng = Rng::seeded("store_import::enospc");
    let work = tempfile::tempdir_in(scratch_dir()).unwrap();
    let src = work.path().join("big");
    std::fs::create_dir(&src).unwrap();
    for i in 0..12 {
        write_rng(&src.join(format!("f{i:02}")), &mut rng, 4 * MIB as usize);
    }
    let fs = LoopFs::new(FsKind::Tmpfs, 64 * MIB).unwrap();
    let ballast = fs.path().join("ballast");
    write_rng(&ballast, &mut rng, 30 * MIB as usize);
    let sc = store_common::scratch_in(fs.path(), &["--compress", "none"]);
    let out = import(&sc.store, &[s(&src), "--commit-every", "8M"]);
    assert_eq!(code(&out), 4, "{}", text(&out));
    assert!(text(&out).contains("No space left"), "{}", text(&out));
    std::fs::remove_file(&ballast).unwrap();
    fsck_clean(&sc.store);
    let n = same_as_source(&sc, "big", &src);
    eprintln!("{n} complete files kept after ENOSPC");
}

/// A store that filled its disk itself: nothing else to delete, and the
/// room is held by the containers the failed import did not commit.
/// `store gc` runs on the full disk (the store's reserve is given back
/// when the store opens; before, every command failed with "metadata
/// database: No space left") and gives that room back, counted in its
/// report; fsck is clean and the files kept are whole.
#[test]
fn gc_on_a_disk_the_import_filled_gives_the_room_back() {
    require_fuse();
    let mut rng = Rng::seeded("store_import::filled");
    let work = tempfile::tempdir_in(scratch_dir()).unwrap();
    let src = work.path().join("big");
    std::fs::create_dir(&src).unwrap();
    for i in 0..8 {
        write_rng(&src.join(format!("f{i:02}")), &mut rng, 12 * MIB as usize);
    }
    let fs = LoopFs::new(FsKind::Ext4, 64 * MIB).unwrap();
    let sc = store_common::scratch_in(fs.path(), &["--compress", "none"]);
    let out = import(&sc.store, &[s(&src)]);
    assert_eq!(code(&out), 4, "{}", text(&out));
    assert!(text(&out).contains("store gc"), "{}", text(&out));
    let avail = || rustix::fs::statvfs(fs.path()).unwrap().f_bavail * 4096;
    let before = avail();
    let out = onecopy(&["store", "gc", s(&sc.store)]);
    assert!([0, 1].contains(&code(&out)), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    let freed: u64 = said
        .split("freed ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no bytes freed in {said:?}"));
    let gained = avail() - before;
    assert!(
        gained > 16 * MIB,
        "gc gave back {gained} bytes (before: {before})"
    );
    assert!(
        freed > 16 * MIB && freed <= gained + MIB,
        "reported {freed}, gained {gained}"
    );
    fsck_clean(&sc.store);
    let n = same_as_source(&sc, "big", &src);
    eprintln!("{n} complete files kept; gc freed {freed}");
}

/// Every file under `name` in the store equals its source under `src`;
/// returns how many there are.
fn same_as_source(sc: &store_common::Scratch, name: &str, src: &Path) -> usize {
    let m = Mount::new(sc);
    let dir = sc.mnt.join(name);
    let mut n = 0;
    if dir.exists() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            assert_eq!(
                checksum_file(&e.path()).unwrap(),
                checksum_file(&src.join(e.file_name())).unwrap(),
                "{:?} differs from its source",
                e.file_name()
            );
            n += 1;
        }
    }
    m.unmount();
    n
}

/// kill -9 in the middle of an import: fsck is clean and every file the
/// store names has the source's bytes (none partial).
#[test]
fn import_killed_leaves_a_clean_store_and_no_partial_file() {
    require_fuse();
    let mut rng = Rng::seeded("store_import::kill");
    let work = tempfile::tempdir_in(scratch_dir()).unwrap();
    let src = work.path().join("tree");
    std::fs::create_dir(&src).unwrap();
    for i in 0..48 {
        write_rng(
            &src.join(format!("f{i:02}")),
            &mut rng,
            MIB as usize + i * 1000,
        );
    }
    for delay in [30u64 + rng.below(90), 120 + rng.below(150)] {
        let sc = scratch(&[]);
        let mut child = Command::new(store_common::BIN)
            .args([
                "store",
                "import",
                s(&sc.store),
                s(&src),
                "--commit-every",
                "4M",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay));
        let _ = child.kill();
        child.wait().unwrap();
        fsck_clean(&sc.store);
        let n = same_as_source(&sc, "tree", &src);
        eprintln!("killed at {delay} ms: {n} complete files in the store");
    }
}

/// A file that keeps growing while it is read (a log being written) is
/// reported as changed (exit 1) and not imported, twice read; a quiet
/// file beside it is imported.
#[test]
fn import_reports_a_file_changing_while_read() {
    require_fuse();
    let mut rng = Rng::seeded("store_import::changing");
    let work = tempfile::tempdir_in(scratch_dir()).unwrap();
    let src = work.path().join("live");
    std::fs::create_dir(&src).unwrap();
    write_rng(&src.join("quiet"), &mut rng, 100_000);
    write_rng(&src.join("log"), &mut rng, 48 * MIB as usize);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let sc = scratch(&[]);
    let out = std::thread::scope(|th| {
        th.spawn(|| {
            use std::io::Write;
            let mut f = std::fs::File::options()
                .append(true)
                .open(src.join("log"))
                .unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                f.write_all(b"more\n").unwrap();
                std::thread::sleep(Duration::from_micros(500));
            }
        });
        let out = import(&sc.store, &[s(&src)]);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        out
    });
    assert_eq!(code(&out), 1, "{}", text(&out));
    assert!(
        text(&out).contains("changed while it was read"),
        "{}",
        text(&out)
    );
    fsck_clean(&sc.store);
    let m = Mount::new(&sc);
    assert!(
        !sc.mnt.join("live/log").exists(),
        "a changing file was imported"
    );
    assert_eq!(
        checksum_file(&sc.mnt.join("live/quiet")).unwrap(),
        checksum_file(&src.join("quiet")).unwrap()
    );
    m.unmount();
}
