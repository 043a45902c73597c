//! The inline store through a real FUSE mount (issue 10): real programs
//! (cp -a, tar, rsync, git, sqlite3, fio) write and read through the
//! kernel, every file is checksummed in and out, data survives a remount,
//! dedupe shows in `store stats`, and a kill -9 of the mount process loses
//! no fsync'd byte and leaves fsck clean. Needs root and /dev/fuse.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use onecopy_testfs::{checksum_file, checksum_tree, write_random};

mod store_common;
use store_common::*;

fn run(cmd: &str, args: &[&str], dir: Option<&Path>) -> Output {
    let mut c = Command::new(cmd);
    c.args(args);
    if let Some(d) = dir {
        c.current_dir(d);
    }
    let out = c.output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A source tree of real files: this repository's crates, plus large
/// files with duplicates and holes.
fn source_tree(root: &Path) -> BTreeMap<PathBuf, u128> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    run(
        "cp",
        &[
            "-a",
            src.to_str().unwrap(),
            root.join("crates").to_str().unwrap(),
        ],
        None,
    );
    let big = root.join("big");
    std::fs::create_dir(&big).unwrap();
    write_random(&big.join("a.bin"), 24 << 20, 1).unwrap();
    std::fs::copy(big.join("a.bin"), big.join("a-copy.bin")).unwrap();
    let f = File::create(big.join("sparse")).unwrap();
    f.set_len(100 << 20).unwrap();
    drop(f);
    std::os::unix::fs::symlink("a.bin", big.join("link")).unwrap();
    std::fs::hard_link(big.join("a.bin"), big.join("hard")).unwrap();
    checksum_tree(root)
}

#[test]
fn real_programs_through_the_mount() {
    real_programs(&["-o", "transport=dev"]);
}

/// The same over FUSE over io_uring (needs the fuse module's
/// `enable_uring`; scripts/test.sh turns it on).
#[test]
fn real_programs_over_io_uring() {
    require_uring();
    real_programs(&["-o", "transport=uring"]);
}

/// cp, tar, rsync, git, sqlite3 through a mount made with `mount_args`:
/// every file back identical, across remounts and a gc.
fn real_programs(mount_args: &[&str]) {
    require_fuse();
    let s = scratch(&[]);
    let src_tmp = tempfile::tempdir_in("/var/tmp/store-tests").unwrap();
    let src = src_tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let sums = source_tree(&src);
    let m = Mount::with_args(&s, mount_args);
    let mnt = s.mnt.clone();
    let (srcs, mnts) = (src.to_str().unwrap(), mnt.to_str().unwrap());

    run("cp", &["-a", srcs, &format!("{mnts}/cp")], None);
    run(
        "sh",
        &[
            "-c",
            &format!("mkdir {mnts}/tar && tar -C {srcs} -cf - . | tar -C {mnts}/tar -xf -"),
        ],
        None,
    );
    run(
        "rsync",
        &["-a", &format!("{srcs}/"), &format!("{mnts}/rsync/")],
        None,
    );
    for copy in ["cp", "tar", "rsync"] {
        assert_eq!(
            checksum_tree(&mnt.join(copy)),
            sums,
            "{copy}: contents differ"
        );
    }
    let meta = |p: &Path| std::fs::symlink_metadata(p).unwrap();
    use std::os::unix::fs::MetadataExt;
    let (a, b) = (
        meta(&src.join("big/a.bin")),
        meta(&mnt.join("cp/big/a.bin")),
    );
    assert_eq!(
        (a.mode(), a.mtime(), a.nlink()),
        (b.mode(), b.mtime(), b.nlink())
    );
    assert_eq!(
        std::fs::read_link(mnt.join("rsync/big/link")).unwrap(),
        Path::new("a.bin")
    );

    // git: clone a local repository into the mount and check it.
    let repo = src_tmp.path().join("repo");
    run("git", &["init", "-q", repo.to_str().unwrap()], None);
    run(
        "cp",
        &["-a", &format!("{srcs}/crates"), repo.to_str().unwrap()],
        None,
    );
    let git = |args: &[&str], dir: &Path| {
        let mut all = vec!["-c", "user.name=t", "-c", "user.email=t@t"];
        all.extend_from_slice(args);
        run("git", &all, Some(dir))
    };
    git(&["add", "-A"], &repo);
    git(&["commit", "-qm", "one"], &repo);
    git(
        &[
            "clone",
            "-q",
            "--no-local",
            repo.to_str().unwrap(),
            &format!("{mnts}/clone"),
        ],
        &mnt,
    );
    git(&["fsck", "--full", "--strict"], &mnt.join("clone"));
    git(&["status", "--porcelain"], &mnt.join("clone"));

    // SQLite: a database with transactions, then an integrity check.
    let db = format!("{mnts}/db.sqlite");
    let sql = "CREATE TABLE t(k INTEGER PRIMARY KEY, v BLOB);
        WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)
        INSERT INTO t SELECT i, randomblob(200) FROM n;
        DELETE FROM t WHERE k % 3 = 0; UPDATE t SET v = randomblob(300) WHERE k % 5 = 0;";
    run("sqlite3", &[&db, sql], None);
    let out = run(
        "sqlite3",
        &[&db, "PRAGMA integrity_check; SELECT count(*) FROM t;"],
        None,
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n13334\n");
    let db_sum = checksum_file(Path::new(&db)).unwrap();

    // Dedupe is visible: three copies of the tree cost about one.
    std::thread::sleep(Duration::from_millis(600));
    let st = stats(&s.store);
    assert!(st["dedupe_ratio"].as_f64().unwrap() > 2.5, "{st}");
    assert!(
        st["written_duplicate_bytes"].as_u64().unwrap() > 100 << 20,
        "{st}"
    );

    m.unmount();
    fsck_clean(&s.store);
    let m = Mount::with_args(&s, mount_args);
    for copy in ["cp", "tar", "rsync"] {
        assert_eq!(checksum_tree(&mnt.join(copy)), sums, "{copy} after remount");
    }
    assert_eq!(checksum_file(Path::new(&db)).unwrap(), db_sum);
    git(&["fsck", "--full"], &mnt.join("clone"));
    run(
        "rm",
        &["-rf", &format!("{mnts}/cp"), &format!("{mnts}/tar")],
        None,
    );
    m.unmount();
    fsck_clean(&s.store);
    let gc = onecopy(&["store", "gc", s.store.to_str().unwrap()]);
    assert!(gc.status.success());
    let scrub = onecopy(&["store", "scrub", s.store.to_str().unwrap()]);
    assert!(
        scrub.status.success(),
        "{}",
        String::from_utf8_lossy(&scrub.stdout)
    );
    let m = Mount::with_args(&s, mount_args);
    assert_eq!(checksum_tree(&mnt.join("rsync")), sums, "after gc");
    m.unmount();
}

#[test]
fn fio_verify_through_the_mount() {
    require_fuse();
    for chunking in ["fixed:64K", "cdc:16K/64K/256K"] {
        let s = scratch(&["--chunking", chunking, "--compress", "lz4"]);
        let m = Mount::new(&s);
        let file = format!("--filename={}/fio.dat", s.mnt.display());
        for rw in ["randwrite", "write"] {
            let out = run(
                "fio",
                &[
                    "--name=v",
                    &file,
                    "--size=48M",
                    &format!("--rw={rw}"),
                    "--bsrange=512-256k",
                    "--verify=crc32c",
                    "--verify_fatal=1",
                    "--do_verify=1",
                    // No `local-v-0-verify.state` left in the working directory.
                    "--verify_state_save=0",
                    "--ioengine=psync",
                    "--randseed=7",
                    "--output-format=terse",
                ],
                None,
            );
            assert!(
                !String::from_utf8_lossy(&out.stderr).contains("verify"),
                "{chunking} {rw}"
            );
        }
        m.unmount();
        fsck_clean(&s.store);
    }
}

#[test]
fn kill_9_during_writes_keeps_fsynced_files() {
    kill_9_during_writes(&["-o", "transport=dev"]);
}

#[test]
fn kill_9_during_writes_over_io_uring() {
    require_uring();
    kill_9_during_writes(&["-o", "transport=uring"]);
}

/// The mount (made with `mount_args`) killed with SIGKILL while files are
/// written and fsync'd: every fsync'd file is back after remount.
fn kill_9_during_writes(mount_args: &[&str]) {
    require_fuse();
    let s = scratch(&[]);
    let m = Mount::with_args(&s, mount_args);
    let mut synced = BTreeMap::new();
    for i in 0..6u64 {
        let p = s.mnt.join(format!("synced-{i}"));
        write_random(&p, (i + 1) << 20, 100 + i).unwrap();
        File::options()
            .append(true)
            .open(&p)
            .unwrap()
            .sync_all()
            .unwrap();
        synced.insert(format!("synced-{i}"), checksum_file(&p).unwrap());
    }
    // Keep writing (unsynced) while the mount process is killed, into a
    // directory of the mount (fsync'd): once the dead mount is detached,
    // its path no longer resolves, so the writer stops instead of filling
    // the directory under the mount point.
    let busy = s.mnt.join("busy");
    std::fs::create_dir(&busy).unwrap();
    File::open(&busy).unwrap().sync_all().unwrap();
    let writer = std::thread::spawn(move || {
        for i in 0.. {
            let Ok(mut f) = File::create(busy.join(format!("busy-{i}"))) else {
                return;
            };
            if f.write_all(&vec![i as u8 + 1; 3 << 20]).is_err() {
                return;
            }
        }
    });
    std::thread::sleep(Duration::from_millis(700));
    m.kill();
    let _ = writer.join();
    fsck_clean(&s.store);
    let m = Mount::new(&s);
    for (name, sum) in &synced {
        assert_eq!(
            checksum_file(&s.mnt.join(name)).unwrap(),
            *sum,
            "{name} lost bytes"
        );
    }
    // Whatever survived of the unsynced files is whole chunks of their
    // own bytes, never another file's.
    for e in std::fs::read_dir(s.mnt.join("busy")).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        if let Some(i) = name.strip_prefix("busy-") {
            let want = i.parse::<u64>().unwrap() as u8 + 1;
            let data = std::fs::read(e.path()).unwrap();
            assert!(
                data.iter().all(|&b| b == want || b == 0),
                "{name} has foreign bytes"
            );
        }
    }
    std::fs::write(s.mnt.join("after"), b"still writable").unwrap();
    m.unmount();
    fsck_clean(&s.store);
}

/// A local store keeps the pages of a long write (drop-behind is for
/// remote stores: `store_remote.rs`), and reads every byte back.
#[test]
fn a_local_store_keeps_a_writers_pages() {
    require_fuse();
    let s = scratch(&["--compress", "none"]);
    let m = Mount::new(&s);
    let (f, want) = write_in_order(&s.mnt.join("stream"), 144);
    // Give a drop the time it would take.
    std::thread::sleep(Duration::from_millis(500));
    let pages = resident_pages(&f, 48 << 20, 64 << 20);
    assert!(pages > 15_000, "only {pages} of 16,384 pages cached");
    let mut got = vec![0; want.len()];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut got, 0).unwrap();
    assert!(got == want);
    drop(f);
    m.unmount();
}

#[test]
fn damaged_chunk_reads_as_eio() {
    require_fuse();
    let s = scratch(&["--compress", "none"]);
    let m = Mount::new(&s);
    write_random(&s.mnt.join("f"), 1 << 20, 9).unwrap();
    m.unmount();
    let cont = std::fs::read_dir(s.store.join("containers/01"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&cont).unwrap();
    bytes[16 + 48 + 1000] ^= 0x40;
    std::fs::write(&cont, bytes).unwrap();
    let m = Mount::new(&s);
    let err = std::fs::read(s.mnt.join("f")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    m.unmount();
    let scrub = onecopy(&["store", "scrub", s.store.to_str().unwrap()]);
    assert_eq!(scrub.status.code(), Some(1), "scrub reports the damage");
}

#[test]
fn clear_errors_and_exit_codes() {
    require_fuse();
    let s = scratch(&[]);
    let st = s.store.to_str().unwrap();
    let again = onecopy(&["store", "init", st]);
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    let bad = onecopy(&[
        "store",
        "init",
        "/var/tmp/store-tests/x",
        "--chunking",
        "fixed:1000",
    ]);
    assert_eq!(bad.status.code(), Some(2));
    let not = onecopy(&["store", "stats", "/var/tmp"]);
    assert_eq!(not.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&not.stderr).contains("not an onecopy store"));
    let mnt = s.mnt.to_str().unwrap();
    let daemon = onecopy(&["mount", st, mnt]);
    assert!(
        daemon.status.success(),
        "{}",
        String::from_utf8_lossy(&daemon.stderr)
    );
    assert!(
        is_mounted(&s.mnt),
        "the daemon returns once the mount is ready"
    );
    let busy = onecopy(&["store", "fsck", st]);
    assert_eq!(busy.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&busy.stderr).contains("in use"));
    std::fs::write(s.mnt.join("x"), b"x").unwrap();
    run("fusermount3", &["-u", mnt], None);
    let t = Instant::now();
    while onecopy(&["store", "fsck", st]).status.code() == Some(3) {
        assert!(t.elapsed() < Duration::from_secs(30), "daemon did not exit");
        std::thread::sleep(Duration::from_millis(100));
    }
    fsck_clean(&s.store);
}

/// A mount that names no transport is served over FUSE over io_uring
/// when the kernel offers it (the fuse module's `enable_uring`, on for
/// the tests): its process holds io_uring instances and says which
/// transport it chose; `transport=dev` still picks `/dev/fuse`.
#[test]
fn a_mount_naming_no_transport_is_served_over_io_uring_when_offered() {
    require_uring();
    for (args, want) in [(&[][..], "uring"), (&["-o", "transport=dev"][..], "dev")] {
        let s = scratch(&[]);
        let m = Mount::exactly(&s, args);
        std::fs::write(s.mnt.join("f"), b"x").unwrap();
        assert_eq!(std::fs::read(s.mnt.join("f")).unwrap(), b"x");
        let t0 = Instant::now();
        while want == "uring" && m.io_urings() == 0 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(m.io_urings() > 0, want == "uring", "{args:?}: {}", m.log());
        let said = format!("over transport={want}");
        assert!(m.log().contains(&said), "{args:?}: {}", m.log());
        m.unmount();
    }
}

/// The second pass's transport joins a mount's own `-o` list, and is
/// not added where a transport is named.
#[test]
fn the_run_transport_joins_the_mount_options() {
    let dev = || Some("dev".to_string());
    assert_eq!(with_run_transport(&[], dev()), ["-o", "transport=dev"]);
    let push = with_run_transport(&["-o", "push=1"], dev());
    assert_eq!(push, ["-o", "push=1,transport=dev"]);
    let named = with_run_transport(&["-o", "transport=uring"], dev());
    assert_eq!(named, ["-o", "transport=uring"]);
    assert_eq!(with_run_transport(&["-o", "ro"], None), ["-o", "ro"]);
}

/// A mount reads ahead 4 MiB over either transport. Over io_uring the
/// kernel reads the init reply after the mount appears and set the
/// readahead back to 128 KiB (a cold read of a big file went in
/// 256 KiB `READ`s, two at a time), so it is widened once negotiated.
#[test]
fn mounts_read_ahead_four_mib_over_both_transports() {
    require_fuse();
    require_uring();
    for t in ["transport=dev", "transport=uring"] {
        let s = scratch(&[]);
        let m = Mount::with_args(&s, &["-o", t]);
        let mnt = s.mnt.canonicalize().unwrap();
        let dev = onecopy_ioctl::mounts::read()
            .unwrap()
            .into_iter()
            .rev()
            .find(|m| m.mount_point == mnt)
            .map(|m| m.dev)
            .unwrap_or_else(|| panic!("{t}: {} not in mountinfo", mnt.display()));
        let path = format!("/sys/class/bdi/{dev}/read_ahead_kb");
        let t0 = Instant::now();
        let mut kb = String::new();
        while t0.elapsed() < Duration::from_secs(10) {
            kb = std::fs::read_to_string(&path).unwrap();
            if kb.trim() == "4096" {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(kb.trim(), "4096", "{t}: {path}");
        m.unmount();
    }
}
