//! A COMMIT that fails with `SQLITE_FULL` on a full backing filesystem
//! (issue 11). SQLite rolls the transaction back; the store must carry
//! on from the last commit as if the rolled-back work had been lost in a
//! crash, and once space is freed keep every later file intact: no inode
//! number handed out twice (the kernel may still cache the rolled-back
//! inode under it) and no chunk committed into a container the database
//! forgot (gc would delete it as a stray). Needs root (a loop ext4).

use std::fs::File;
use std::path::Path;

use onecopy_store::{Kind, NewNode, Store, StoreConfig};
use onecopy_testfs::{is_root, FsKind, LoopFs};

fn node() -> NewNode {
    NewNode::root_owned(Kind::File, 0o644)
}

/// Distinct, incompressible-enough bytes.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len / 8)
        .flat_map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes()
        })
        .collect()
}

/// Fills the filesystem holding `ballast` with allocated blocks.
fn fill(ballast: &Path) {
    use rustix::fs::{fallocate, FallocateFlags};
    let f = File::create(ballast).unwrap();
    let mut at = 0u64;
    for step in [1u64 << 20, 64 << 10, 4 << 10] {
        while fallocate(&f, FallocateFlags::empty(), at, step).is_ok() {
            at += step;
        }
    }
    f.sync_all().unwrap();
}

/// A new store in `DIR/store` on a loop ext4 of `size` bytes (root only).
fn store_on_loop(size: u64) -> (LoopFs, std::path::PathBuf, Store) {
    assert!(
        is_root(),
        "this test mounts a loop ext4 and must run as root"
    );
    let lo = LoopFs::new(FsKind::Ext4, size).unwrap();
    let dir = lo.path().join("store");
    Store::init(&dir, &config()).unwrap();
    let s = Store::open(&dir).unwrap();
    (lo, dir, s)
}

fn write_file(s: &Store, name: &str, data: &[u8]) -> u64 {
    let a = s.mknod(1, name.as_bytes(), node()).unwrap();
    s.open_file(a.ino).unwrap();
    s.write(a.ino, 0, data).unwrap();
    s.release_file(a.ino).unwrap();
    a.ino
}

/// The disk fills while a large transaction is open: the commit still
/// succeeds (the store gives its reserve back to the filesystem for it),
/// nothing acknowledged is lost, and new data and files are refused with
/// ENOSPC (a write before it is buffered) until space is back, when
/// writes resume.
#[test]
fn a_commit_on_a_full_disk_uses_the_reserve_and_loses_nothing() {
    let (lo, dir, s) = store_on_loop(64 << 20);
    let first = bytes(1, 64 << 10);
    let a = write_file(&s, "a", &first);
    s.commit(true).unwrap();
    // A large transaction (new containers, hundreds of chunk rows) whose
    // records reach the containers before the disk fills.
    let big = bytes(2, 3 << 20);
    let kept = write_file(&s, "kept", &big);
    let ballast = lo.path().join("ballast");
    fill(&ballast);
    s.commit(false).expect("the commit has the reserve's room");
    assert!(read(&s, kept, big.len()) == big, "acknowledged work kept");
    // Low on space: nothing new is taken in.
    let e = s
        .mknod(1, b"new", node())
        .expect_err("a new file on a full disk");
    assert_eq!(e.errno(), libc::ENOSPC, "{e}");
    let e = s.fsync(a).and_then(|_| {
        s.open_file(a)?;
        s.write(a, 0, &bytes(9, 64 << 10))?;
        s.fsync(a)
    });
    assert_eq!(
        e.expect_err("new data on a full disk").errno(),
        libc::ENOSPC
    );
    // The write was refused before it was buffered: its room was not
    // there to promise (a file closed without an fsync must never meet a
    // full disk when it is stored later).
    assert!(
        read(&s, a, 64 << 10) == first,
        "a refused write changes nothing"
    );
    std::fs::remove_file(&ballast).unwrap();
    // Space is back: writes are taken in and stored, new files work.
    s.write(a, 0, &bytes(9, 64 << 10)).unwrap();
    s.fsync(a).expect("stored once space is back");
    s.release_file(a).unwrap();
    let later = bytes(3, 2 << 20);
    let b = write_file(&s, "b", &later);
    s.commit(true).unwrap();
    s.gc().unwrap();
    assert!(read(&s, a, 64 << 10) == bytes(9, 64 << 10));
    assert!(read(&s, b, later.len()) == later);
    drop(s);
    let s = Store::open(&dir).unwrap();
    assert!(read(&s, kept, big.len()) == big, "kept after reopen");
    assert!(read(&s, b, later.len()) == later, "b after reopen");
    let fsck = s.fsck(false).unwrap();
    assert!(fsck.problems.is_empty(), "{:?}", fsck.problems);
}

/// Bytes a write buffered while there was room are kept when the disk
/// fills before they are stored: while it stays full every `fsync`
/// reports ENOSPC (8 MiB is more than the half of the released reserve
/// buffered bytes may use), and once space is back the next one stores
/// them whole.
#[test]
fn bytes_buffered_before_the_disk_filled_are_kept_until_stored() {
    let (lo, dir, s) = store_on_loop(64 << 20);
    let f = s.mknod(1, b"f", node()).unwrap().ino;
    s.open_file(f).unwrap();
    let data = bytes(5, 8 << 20);
    s.write(f, 0, &data).unwrap();
    let ballast = lo.path().join("ballast");
    fill(&ballast);
    for round in 0..3 {
        let e = s.fsync(f).expect_err("fsync on a full disk");
        assert_eq!(e.errno(), libc::ENOSPC, "round {round}: {e}");
    }
    std::fs::remove_file(&ballast).unwrap();
    s.fsync(f).expect("stored once space is back");
    s.release_file(f).unwrap();
    drop(s);
    let s = Store::open(&dir).unwrap();
    assert!(read(&s, f, data.len()) == data, "whole after a reopen");
    let fsck = s.fsck(false).unwrap();
    assert!(fsck.problems.is_empty(), "{:?}", fsck.problems);
}

/// Leaves about `free` bytes free on the filesystem holding `ballast`.
fn fill_but(ballast: &Path, free: u64) {
    fill(ballast);
    let f = File::options().write(true).open(ballast).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len.saturating_sub(free)).unwrap();
    f.sync_all().unwrap();
}

/// A few bytes written into a page inside a file cost the whole page
/// when the file is stored: on a nearly full disk, 8 bytes into each
/// 64 KiB page of a file are refused with ENOSPC once the pages they
/// make dirty would not fit, never taken in and lost when the closed
/// file is stored. Every write acknowledged is there after a reopen; so
/// are the appends of files whose stored chunks a CDC flush cuts again.
#[test]
fn small_writes_into_stored_pages_are_charged_whole_pages() {
    for chunking in ["fixed:64K", "cdc:16K/64K/256K"] {
        let lo = LoopFs::new(FsKind::Ext4, 64 << 20).unwrap();
        let dir = lo.path().join("store");
        let cfg = StoreConfig {
            chunking: chunking.parse().unwrap(),
            ..config()
        };
        Store::init(&dir, &cfg).unwrap();
        let s = Store::open(&dir).unwrap();
        let data = bytes(21, 15 << 20);
        let a = write_file(&s, "a", &data);
        let small: Vec<u64> = (0..20)
            .map(|i| write_file(&s, &format!("s{i}"), &bytes(30 + i, 256 << 10)))
            .collect();
        s.commit(true).unwrap();
        fill_but(&lo.path().join("ballast"), 7 << 20);
        // The store looks at the free space at each commit (the ballast is
        // another program's).
        s.commit(true).unwrap();
        let mut want = data.clone();
        let (mut taken, mut refused) = (0, 0);
        s.open_file(a).unwrap();
        for page in 0..(15 << 20) / (64 << 10) {
            let at = page * (64 << 10) + 100;
            match s.write(a, at as u64, b"changed!") {
                Ok(_) => {
                    want[at..at + 8].copy_from_slice(b"changed!");
                    taken += 1;
                }
                Err(e) => {
                    assert_eq!(e.errno(), libc::ENOSPC, "{chunking}: {e}");
                    refused += 1;
                }
            }
        }
        s.release_file(a).unwrap();
        let mut appended = Vec::new();
        for (i, &f) in small.iter().enumerate() {
            s.open_file(f).unwrap();
            let ok = s.write(f, 256 << 10, &bytes(60 + i as u64, 4096)).is_ok();
            s.release_file(f).unwrap();
            appended.push(ok);
        }
        assert!(
            taken > 0 && refused > 0,
            "{chunking}: {taken} taken, {refused} refused"
        );
        // As an unmount does: every closed file's buffer stored.
        s.flush_all(true).expect("room for every write taken in");
        drop(s);
        let s = Store::open(&dir).unwrap();
        assert!(
            read(&s, a, want.len()) == want,
            "{chunking}: an acknowledged write lost"
        );
        for (i, (&f, &ok)) in small.iter().zip(&appended).enumerate() {
            let mut want = bytes(30 + i as u64, 256 << 10);
            if ok {
                want.extend_from_slice(&bytes(60 + i as u64, 4096));
            }
            let got = s.read(f, 0, 260 << 10).unwrap();
            assert!(got == want, "{chunking}: s{i} (append taken: {ok})");
        }
        let fsck = s.fsck(false).unwrap();
        assert!(fsck.problems.is_empty(), "{chunking}: {:?}", fsck.problems);
    }
}

/// Large xattr values on a nearly full disk take room as written data
/// does: once they would not fit beside the reserve `setxattr` is
/// ENOSPC, the commit after them succeeds (any user could shut the store
/// down by filling its log past the reserve), and every value set is
/// there after a reopen.
#[test]
fn xattr_values_on_a_nearly_full_disk_are_refused_not_committed_past_the_reserve() {
    let (lo, dir, s) = store_on_loop(64 << 20);
    let f = write_file(&s, "f", b"x");
    s.commit(true).unwrap();
    fill_but(&lo.path().join("ballast"), 6 << 20);
    s.commit(true).unwrap();
    let value = bytes(41, 60_000);
    let mut set = 0;
    let refused = loop {
        let name = format!("user.big{set}");
        match s.setxattr(f, name.as_bytes(), &value, false, false) {
            Ok(()) => set += 1,
            Err(e) => break e,
        }
        assert!(set < 1000, "never refused");
    };
    assert_eq!(refused.errno(), libc::ENOSPC, "{refused}");
    assert!(set > 0, "nothing set");
    s.commit(true).expect("the commit of what was taken in");
    drop(s);
    let s = Store::open(&dir).unwrap();
    for i in 0..set {
        let got = s.getxattr(f, format!("user.big{i}").as_bytes()).unwrap();
        assert!(got == value, "user.big{i}");
    }
    let fsck = s.fsck(false).unwrap();
    assert!(fsck.problems.is_empty(), "{:?}", fsck.problems);
}

/// A hole punched on a full disk (to free space, or as a program zeroes
/// a range) is never refused: zeros take no room.
#[test]
fn a_hole_punched_on_a_full_disk_is_not_refused() {
    let (lo, _dir, s) = store_on_loop(64 << 20);
    let data = bytes(11, 4 << 20);
    let f = write_file(&s, "f", &data);
    s.commit(true).unwrap();
    let ballast = lo.path().join("ballast");
    fill(&ballast);
    s.commit(false).unwrap();
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    s.open_file(f).unwrap();
    s.fallocate(f, 0, 1 << 20, punch)
        .expect("a hole punched on a full disk");
    s.fsync(f).expect("the hole stored on a full disk");
    s.release_file(f).unwrap();
    let mut want = data;
    want[..1 << 20].fill(0);
    assert!(read(&s, f, want.len()) == want);
}

/// The disk fills again after the reserve was given back (another
/// program took that room too): a COMMIT fails and SQLite rolls it back.
/// The store then shuts down, like a filesystem that lost its journal:
/// every later call fails with EIO rather than serve a namespace that
/// lost what programs were told was done. Reopened, it is as at its last
/// commit, fsck clean, and takes writes again once space is freed; no
/// inode number of the lost transaction is handed out twice (the kernel
/// may still cache the rolled-back inode under it) and no chunk is
/// committed into a container the database forgot.
#[test]
fn a_rolled_back_commit_shuts_the_store_down() {
    let (lo, dir, s) = store_on_loop(64 << 20);
    let first = bytes(1, 64 << 10);
    let a = write_file(&s, "a", &first);
    s.commit(true).unwrap();
    let ballast = lo.path().join("ballast");
    fill(&ballast);
    // Make work for a commit that needs room (renames touch only the
    // database; the xattrs fit in the room the store saw at its last
    // commit, before another program filled the disk), then take the
    // reserve's room as well once the store gave it back.
    for i in 0..2000u32 {
        let (from, to) = if i % 2 == 0 {
            (&b"a"[..], &b"z"[..])
        } else {
            (&b"z"[..], &b"a"[..])
        };
        s.rename(1, from, 1, to, Default::default()).unwrap();
        s.setxattr(
            a,
            format!("user.k{i}").as_bytes(),
            &[7u8; 200],
            false,
            false,
        )
        .unwrap();
    }
    // A write larger than the room it saw makes the store look again: it
    // is low, gives its reserve back, and takes nothing new in.
    s.open_file(a).unwrap();
    let e = s.write(a, 0, &bytes(4, 64 << 20)).expect_err("no room");
    assert_eq!(e.errno(), libc::ENOSPC, "{e}");
    let lost = s.mknod(1, b"x", node()).map(|_| ());
    assert!(lost.is_err(), "low on space");
    fill(&lo.path().join("ballast2"));
    let e = s.commit(false).expect_err("COMMIT on a full disk");
    assert_eq!(e.errno(), libc::ENOSPC, "{e}");
    let e = s.check_live().expect_err("the store shut down");
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert_eq!(
        s.commit(true).expect_err("no commit after").errno(),
        libc::EIO
    );
    drop(s);
    std::fs::remove_file(&ballast).unwrap();
    std::fs::remove_file(lo.path().join("ballast2")).unwrap();
    let s = Store::open(&dir).unwrap();
    assert!(read(&s, a, first.len()) == first, "a as last committed");
    assert!(s.getxattr(a, b"user.k0").is_err(), "the lost work is lost");
    let later = bytes(3, 2 << 20);
    let b = write_file(&s, "b", &later);
    assert_ne!(b, a);
    s.commit(true).unwrap();
    s.gc().unwrap();
    assert!(read(&s, b, later.len()) == later, "b after gc");
    let fsck = s.fsck(false).unwrap();
    assert!(fsck.problems.is_empty(), "{:?}", fsck.problems);
}

fn config() -> StoreConfig {
    StoreConfig {
        chunking: "fixed:4K".parse().unwrap(),
        compress: "none".parse().unwrap(),
        container_size: 256 << 10,
        ..StoreConfig::default()
    }
}

fn read(s: &Store, ino: u64, len: usize) -> Vec<u8> {
    s.read(ino, 0, len).unwrap()
}

/// `fallocate` promises room: a request larger than the free space fails
/// at once with ENOSPC (it used to succeed, reserving nothing), a granted
/// one shows in `st_blocks`, other files' writes meet ENOSPC before they
/// eat into it, and the file itself then writes its whole range on the
/// otherwise full disk. The promise survives a reopen and goes with the
/// file.
#[test]
fn fallocate_promises_room_that_other_writes_leave_free() {
    let (_lo, dir, s) = store_on_loop(128 << 20);
    let f = s.mknod(1, b"f", node()).unwrap().ino;
    let e = s
        .fallocate(f, 0, 1 << 40, 0)
        .expect_err("1 TiB on a 128 MiB disk");
    assert_eq!(e.errno(), libc::ENOSPC, "{e}");
    assert_eq!(
        s.getattr(f).unwrap().size,
        0,
        "a refused fallocate changes nothing"
    );
    const ROOM: usize = 16 << 20;
    s.fallocate(f, 0, ROOM as u64, 0).unwrap();
    let blocks = s.getattr(f).unwrap().blocks();
    assert!(
        blocks >= (ROOM / 512) as u64,
        "st_blocks {blocks} counts the promise"
    );
    // Another file fills the disk: it stops short of f's room.
    let g = s.mknod(1, b"g", node()).unwrap().ino;
    s.open_file(g).unwrap();
    let mut at = 0u64;
    let full = loop {
        let r = s
            .write(g, at, &bytes(at + 7, 1 << 20))
            .and_then(|_| s.fsync(g));
        match r {
            Ok(()) => at += 1 << 20,
            Err(e) => break e,
        }
        assert!(at < 1 << 30, "the disk never filled");
    };
    assert_eq!(full.errno(), libc::ENOSPC, "{full}");
    // The disk is full for g; f writes all of its promised range.
    let data = bytes(99, ROOM);
    s.open_file(f).unwrap();
    s.write(f, 0, &data).unwrap();
    s.fsync(f)
        .expect("f's preallocated range is written on a full disk");
    assert!(read(&s, f, ROOM) == data);
    assert!(
        s.getattr(f).unwrap().blocks() <= blocks,
        "writing the range did not grow it"
    );
    s.release_file(f).unwrap();
    s.release_file(g).ok();
    // A promise is kept across a reopen, and goes with the file.
    s.unlink(1, b"g").unwrap();
    s.commit(true).unwrap();
    s.gc().unwrap();
    let h = s.mknod(1, b"h", node()).unwrap().ino;
    s.fallocate(h, 0, 4 << 20, 0).unwrap();
    s.commit(true).unwrap();
    drop(s);
    let s = Store::open(&dir).unwrap();
    assert!(
        s.getattr(h).unwrap().blocks() >= 8192,
        "the promise after a reopen"
    );
    s.unlink(1, b"h").unwrap();
    s.commit(true).unwrap();
    assert!(read(&s, f, ROOM) == data, "f after reopen");
    let fsck = s.fsck(false).unwrap();
    assert!(fsck.problems.is_empty(), "{:?}", fsck.problems);
}
