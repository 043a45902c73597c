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

fn write_file(s: &Store, name: &str, data: &[u8]) -> u64 {
    let a = s.mknod(1, name.as_bytes(), node()).unwrap();
    s.open_file(a.ino).unwrap();
    s.write(a.ino, 0, data).unwrap();
    s.release_file(a.ino).unwrap();
    a.ino
}

#[test]
fn failed_commit_on_a_full_disk_loses_only_its_own_work() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let lo = LoopFs::new(FsKind::Ext4, 64 << 20).unwrap();
    let dir = lo.path().join("store");
    let cfg = StoreConfig {
        chunking: "fixed:4K".parse().unwrap(),
        compress: "none".parse().unwrap(),
        container_size: 256 << 10,
        ..StoreConfig::default()
    };
    Store::init(&dir, &cfg).unwrap();
    let s = Store::open(&dir).unwrap();
    let first = bytes(1, 64 << 10);
    let a = write_file(&s, "a", &first);
    s.commit(true).unwrap();
    // A large transaction (new containers, hundreds of chunk rows) whose
    // records reach the containers before the disk fills; its COMMIT
    // needs room in the WAL and fails.
    let lost = write_file(&s, "lost", &bytes(2, 3 << 20));
    let ballast = lo.path().join("ballast");
    fill(&ballast);
    let e = s.commit(false).expect_err("COMMIT on a full disk");
    assert_eq!(e.errno(), libc::ENOSPC, "{e}");
    assert!(
        s.lookup(1, b"lost").is_err(),
        "the rolled-back file is gone"
    );
    std::fs::remove_file(&ballast).unwrap();
    // Service resumes: new files get new inode numbers, and their chunks
    // survive a commit, gc and a reopen.
    let later = bytes(3, 2 << 20);
    let b = write_file(&s, "b", &later);
    assert_ne!(
        b, lost,
        "inode {lost} of the rolled-back file handed out again"
    );
    s.commit(true).unwrap();
    s.gc().unwrap();
    let read = |s: &Store, ino: u64, len: usize| s.read(ino, 0, len);
    assert!(read(&s, a, first.len()).unwrap() == first);
    let got = read(&s, b, later.len()).unwrap_or_else(|e| panic!("b after gc: {e}"));
    assert!(got == later, "b after gc");
    let fsck = s.fsck(false).unwrap();
    assert!(fsck.problems.is_empty(), "{:?}", fsck.problems);
    drop(s);
    let s = Store::open(&dir).unwrap();
    assert!(read(&s, b, later.len()).unwrap() == later, "b after reopen");
    let fsck = s.fsck(false).unwrap();
    assert!(fsck.problems.is_empty(), "{:?}", fsck.problems);
}
