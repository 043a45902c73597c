//! Errors that cost a file's data reach that file's `fsync` (issue 29),
//! through a real FUSE mount: the kernel writes a program's pages back on
//! its own schedule, the mount stores them in the background, and when
//! storing fails (a full disk, a dying disk) the program that calls
//! `fsync` later must either find every byte stored or get the error.
//! Needs root and /dev/fuse (they fail without them).

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use onecopy_testfs::{FsKind, LoopFs};

mod store_common;
use store_common::*;

/// Eager writeback held by the tests of this file, which run in
/// parallel: the first to take it saves the `vm.*` sysctls and sets them,
/// the last to let go puts them back. (Each test restoring its own could
/// put the 30 s default back while another still waited for a write-back
/// after a second: that one's `fsync` then found nothing refused.)
static EAGER: Mutex<(usize, Vec<(String, String)>)> = Mutex::new((0, Vec::new()));

struct EagerWriteback;

/// The kernel writes dirty pages of the mount back after about a second
/// (as `vm.dirty_expire_centisecs=100`), not at the program's `fsync`,
/// until the guard and every other test's are dropped.
fn eager_writeback() -> EagerWriteback {
    let mut g = EAGER.lock().unwrap_or_else(|e| e.into_inner());
    if g.0 == 0 {
        let set = [
            ("dirty_expire_centisecs", "100"),
            ("dirty_writeback_centisecs", "50"),
        ];
        g.1 = set
            .iter()
            .map(|(name, value)| {
                let path = format!("/proc/sys/vm/{name}");
                let old = std::fs::read_to_string(&path).unwrap();
                std::fs::write(&path, value).unwrap();
                (path, old)
            })
            .collect();
    }
    g.0 += 1;
    EagerWriteback
}

impl Drop for EagerWriteback {
    fn drop(&mut self) {
        let mut g = EAGER.lock().unwrap_or_else(|e| e.into_inner());
        g.0 -= 1;
        if g.0 == 0 {
            for (path, old) in g.1.drain(..) {
                let _ = std::fs::write(&path, old.trim());
            }
        }
    }
}

fn drop_caches() {
    let _ = Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

fn random_bytes(seed: &str, len: usize) -> Vec<u8> {
    let mut rng = Rng::seeded(seed);
    (0..len.div_ceil(8))
        .flat_map(|_| rng.next().to_le_bytes())
        .take(len)
        .collect()
}

fn same(path: &Path, want: &[u8], when: &str) {
    let got = std::fs::read(path).unwrap_or_else(|e| panic!("{when}: read: {e}"));
    let diff = got.iter().zip(want).position(|(a, b)| a != b);
    assert!(
        got.len() == want.len() && diff.is_none(),
        "{when}: {} bytes, {} wanted, first difference at {diff:?}",
        got.len(),
        want.len()
    );
}

/// The reproduction of issue 29: a program writes 8 MiB without `fsync`
/// while the store's disk is full; space is freed; the program's `fsync`
/// must not say 0 while the file lacks what was written. (Before: the
/// pages a failed flush took were gone and `fsync` had nothing left to
/// report.) The mount's commit (every second) sees the disk full, so it
/// refuses the kernel's write-back of those pages (it could not store
/// them: a file closed without `fsync` would lose them at unmount) and
/// `fsync` reports ENOSPC even after space is back, as Linux reports a
/// write-back error; the program writes again and that is stored, every
/// byte there after dropping caches and after a remount. Both chunkings.
#[test]
fn a_failed_background_flush_loses_nothing() {
    require_fuse();
    let _wb = eager_writeback();
    for chunking in ["fixed:64K", "cdc:16K/64K/256K"] {
        let lo = LoopFs::new(FsKind::Ext4, 96 << 20).unwrap();
        let s = scratch_in(lo.path(), &["--compress", "none", "--chunking", chunking]);
        let m = Mount::new(&s);
        let path = s.mnt.join("f");
        let mut f = File::create(&path).unwrap();
        let ballast = lo.path().join("ballast");
        fill_leaving(&ballast, 1 << 20);
        std::thread::sleep(Duration::from_millis(2500));
        let data = random_bytes(chunking, 8 << 20);
        f.write_all(&data).unwrap();
        // Written back by the kernel (after a second) and refused.
        std::thread::sleep(Duration::from_millis(2500));
        std::fs::remove_file(&ballast).unwrap();
        let e = f.sync_all().expect_err("fsync after a refused write-back");
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{chunking}: {e}");
        f.write_all_at(&data, 0).unwrap();
        f.sync_all()
            .unwrap_or_else(|e| panic!("{chunking}: fsync once space is back: {e}"));
        drop(f);
        same(&path, &data, &format!("{chunking}: after fsync"));
        drop_caches();
        same(&path, &data, &format!("{chunking}: after drop_caches"));
        m.unmount();
        fsck_clean(&s.store);
        let m = Mount::new(&s);
        same(&path, &data, &format!("{chunking}: after a remount"));
        m.unmount();
    }
}

/// While the disk stays full, every write's `fsync` reports ENOSPC (the
/// mount refuses what it could not store), never success; once space is
/// back the same bytes written again are stored. A second file of
/// another program, fsync'd before the disk filled, is never touched.
#[test]
fn fsync_reports_enospc_while_the_disk_stays_full() {
    require_fuse();
    let _wb = eager_writeback();
    for chunking in ["fixed:64K", "cdc:16K/64K/256K"] {
        let lo = LoopFs::new(FsKind::Ext4, 96 << 20).unwrap();
        let s = scratch_in(lo.path(), &["--compress", "none", "--chunking", chunking]);
        let m = Mount::new(&s);
        let safe = random_bytes("safe", 1 << 20);
        let mut g = File::create(s.mnt.join("safe")).unwrap();
        g.write_all(&safe).unwrap();
        g.sync_all().unwrap();
        drop(g);
        let ballast = lo.path().join("ballast");
        fill_leaving(&ballast, 1 << 20);
        let data = random_bytes(chunking, 8 << 20);
        let path = s.mnt.join("f");
        let f = File::create(&path).unwrap();
        for round in 0..2 {
            f.write_all_at(&data, 0).unwrap();
            let e = f.sync_all().expect_err("fsync on a full disk succeeded");
            assert_eq!(
                e.raw_os_error(),
                Some(libc::ENOSPC),
                "{chunking} {round}: {e}"
            );
        }
        same(
            &s.mnt.join("safe"),
            &safe,
            "the other file on the full disk",
        );
        std::fs::remove_file(&ballast).unwrap();
        f.write_all_at(&data, 0).unwrap();
        f.sync_all()
            .unwrap_or_else(|e| panic!("{chunking}: fsync once space is back: {e}"));
        drop(f);
        drop_caches();
        same(&path, &data, &format!("{chunking}: after drop_caches"));
        m.unmount();
        fsck_clean(&s.store);
        let m = Mount::new(&s);
        same(&path, &data, &format!("{chunking}: after a remount"));
        same(&s.mnt.join("safe"), &safe, "the other file after a remount");
        m.unmount();
    }
}

/// EIO from the disk under the containers (XFS shut down under them, as
/// a failing device does): a program's unsynced data cannot be stored,
/// and its `fsync` says so; it never returns success. After the disk is
/// back and the store remounted, what was fsync'd before is intact and
/// fsck is clean.
#[test]
fn eio_under_the_containers_reaches_fsync() {
    require_fuse();
    let _wb = eager_writeback();
    for chunking in ["fixed:64K", "cdc:16K/64K/256K"] {
        let s = scratch(&["--compress", "none", "--chunking", chunking]);
        let disk = LoopFs::new(FsKind::Xfs, 512 << 20).unwrap();
        let cdir = s.store.join("containers");
        move_onto(&cdir, disk.path());
        let m = Mount::new(&s);
        let safe = random_bytes("safe", 2 << 20);
        let mut g = File::create(s.mnt.join("safe")).unwrap();
        g.write_all(&safe).unwrap();
        g.sync_all().unwrap();
        drop(g);
        let data = random_bytes(chunking, 8 << 20);
        let f = File::create(s.mnt.join("f")).unwrap();
        f.write_all_at(&data, 0).unwrap();
        let out = Command::new("xfs_io")
            .args(["-x", "-c", "shutdown"])
            .arg(disk.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "xfs_io shutdown: {out:?}");
        let e = f.sync_all().expect_err("fsync on a dead disk succeeded");
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{chunking}: {e}");
        drop(f);
        // The mount cannot store what it holds: it stops with an error.
        m.kill();
        remount(&disk);
        fsck_clean(&s.store);
        let m = Mount::new(&s);
        same(
            &s.mnt.join("safe"),
            &safe,
            &format!("{chunking}: fsync'd file"),
        );
        // Never fsync'd: as after a crash, each byte is the one written
        // or zero (a hole), never another.
        let f = std::fs::read(s.mnt.join("f")).unwrap_or_default();
        let wrong = f.iter().zip(&data).position(|(&a, &b)| a != 0 && a != b);
        assert!(
            f.len() <= data.len() && wrong.is_none(),
            "{chunking}: the unsynced file holds other bytes at {wrong:?}"
        );
        m.unmount();
        drop(disk);
    }
}

/// Puts directory `dir` (made at the store's first open if missing) on
/// mounted filesystem `mnt`, with a symlink to it in its place.
fn move_onto(dir: &Path, mnt: &Path) {
    let to = mnt.join("containers");
    if dir.exists() {
        let st = Command::new("cp")
            .arg("-a")
            .arg(dir)
            .arg(&to)
            .status()
            .unwrap();
        assert!(st.success());
        std::fs::remove_dir_all(dir).unwrap();
    } else {
        std::fs::create_dir(&to).unwrap();
    }
    std::os::unix::fs::symlink(&to, dir).unwrap();
}

/// Unmounts and mounts again the loop filesystem `fs` (after an XFS
/// shutdown, the mount replays its log).
fn remount(fs: &LoopFs) {
    let img = fs.image().expect("a loop image");
    assert!(Command::new("umount")
        .arg(fs.path())
        .status()
        .unwrap()
        .success());
    let out = Command::new("mount")
        .args(["-t", "xfs", "-o", "loop"])
        .arg(img)
        .arg(fs.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "mount {img:?}: {out:?}");
}
