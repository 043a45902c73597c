//! Proves the fixtures against the real kernel. Needs root: without it
//! every test fails (a skipped test proves nothing).

use std::path::Path;

use onecopy_testfs::*;

/// Always true: fails the test when not root.
fn root_or_skip() -> bool {
    assert!(
        is_root(),
        "these tests mount loop filesystems and must run as root"
    );
    true
}

/// Write a file, see it in FIEMAP and in used space, reflink it and see the
/// copy fully shared, byte-copy it and see nothing shared.
fn basic(kind: FsKind) {
    let fs = LoopFs::new(kind, 512 << 20).unwrap();
    assert!(fs.path().is_dir());
    assert_eq!(fs.kind(), kind);
    let used0 = fs.used_bytes();

    let a = fs.path().join("a");
    let len = (16 << 20) + 123;
    write_random(&a, len, 7).unwrap();
    let exts = data_extents(&a);
    assert!(!exts.is_empty(), "{kind}: no extents for a fresh file");
    let mapped: u64 = exts.iter().map(|e| e.length).sum();
    assert!(mapped >= len, "{kind}: mapped {mapped} < {len}");
    assert!(physical_bytes([&a]) >= len);

    let used1 = fs.used_bytes();
    assert!(
        used1 >= used0 + len - (1 << 20),
        "{kind}: used {used0} -> {used1} after writing {len}"
    );

    // Reflink copy: fully shared, costs (almost) no space.
    let b = fs.path().join("b");
    reflink_copy(&a, &b).unwrap();
    assert!(is_fully_shared(&a, &b), "{kind}: reflink copy not shared");
    assert!(is_fully_shared(&b, &a));
    assert!(shared_bytes_between(&a, &b) >= len);
    assert!(shared_flag_bytes(&b) >= len);
    assert_eq!(physical_bytes([&a, &b]), physical_bytes([&a]));
    let used2 = fs.used_bytes();
    assert!(
        used2 < used1 + (2 << 20),
        "{kind}: reflink copy grew used space {used1} -> {used2}"
    );

    // Plain copy: same bytes, nothing shared, space doubles.
    let c = fs.path().join("c");
    assert_eq!(copy_no_reflink(&a, &c).unwrap(), len);
    assert_eq!(checksum_file(&a).unwrap(), checksum_file(&c).unwrap());
    assert_eq!(shared_bytes_between(&a, &c), 0);
    assert!(!is_fully_shared(&a, &c));
    assert!(physical_bytes([&a, &c]) >= 2 * len);
    let used3 = fs.used_bytes();
    assert!(
        used3 >= used2 + len - (1 << 20),
        "{kind}: {used2} -> {used3}"
    );

    // Checksums notice a one-byte change and nothing else.
    let before = checksum_tree(fs.path());
    assert_eq!(before.len(), 3);
    assert!(before.contains_key(Path::new("a")));
    let mut data = std::fs::read(&c).unwrap();
    data[1000] ^= 1;
    std::fs::write(&c, &data).unwrap();
    let after = checksum_tree(fs.path());
    assert_eq!(after.len(), 3);
    assert_eq!(before[Path::new("a")], after[Path::new("a")]);
    assert_ne!(before[Path::new("c")], after[Path::new("c")]);
}

#[test]
fn btrfs_basic() {
    if root_or_skip() {
        basic(FsKind::Btrfs);
    }
}

#[test]
fn xfs_basic() {
    if root_or_skip() {
        basic(FsKind::Xfs);
    }
}

#[test]
fn btrfs_du_and_chunked_layout() {
    if !root_or_skip() {
        return;
    }
    let fs = LoopFs::new(FsKind::Btrfs, 256 << 20).unwrap();
    let data = random_bytes(4 << 20, 3);
    let a = fs.path().join("one-shot");
    let b = fs.path().join("chunked");
    write_in_chunks(&a, &data, data.len(), true).unwrap();
    write_in_chunks(&b, &data, 256 << 10, true).unwrap();
    // FIEMAP may merge physically adjacent extents; the btrfs items do not.
    assert_eq!(btrfs_extent_items(&a).len(), 1);
    assert_eq!(
        btrfs_extent_items(&b).len(),
        16,
        "{:?}",
        btrfs_extent_items(&b)
    );
    assert_eq!(btrfs_pinned_bytes([&a, &b]), 8 << 20);
    assert_eq!(checksum_file(&a).unwrap(), checksum_file(&b).unwrap());
    fs.sync();
    let du = fs.btrfs_du(".");
    assert_eq!(du.total, 8 << 20);
    assert_eq!(du.exclusive, 8 << 20);
    assert_eq!(du.set_shared, 0);
    let c = fs.path().join("clone");
    reflink_copy(&a, &c).unwrap();
    fs.sync();
    let du = btrfs_du(fs.path());
    assert_eq!(du.total, 12 << 20);
    assert_eq!(du.exclusive, 4 << 20);
    assert_eq!(du.set_shared, 4 << 20);

    // Bookending: overwrite 4 KiB inside a file; the old extent stays
    // pinned whole while the rest of it is still referenced.
    let mut f = std::fs::OpenOptions::new().write(true).open(&a).unwrap();
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(1 << 20)).unwrap();
    std::io::Write::write_all(&mut f, &[0u8; 4096]).unwrap();
    f.sync_all().unwrap();
    assert_eq!(btrfs_extent_items(&a).len(), 3);
    assert_eq!(physical_bytes([&a]), 4 << 20);
    assert_eq!(btrfs_pinned_bytes([&a]), (4 << 20) + 4096);
}

#[test]
fn ext4_and_tmpfs_mount() {
    if !root_or_skip() {
        return;
    }
    for kind in [FsKind::Ext4, FsKind::Tmpfs] {
        let fs = LoopFs::new(kind, 64 << 20).unwrap();
        let p = fs.path().join("f");
        write_random(&p, 1 << 20, 1).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20);
        assert!(reflink_copy(&p, &fs.path().join("g")).is_err());
        assert!(fs.used_bytes() >= 1 << 20);
        assert_eq!(fs.image().is_some(), kind != FsKind::Tmpfs);
    }
}

#[test]
fn read_only_views() {
    if !root_or_skip() {
        return;
    }
    let fs = LoopFs::new(FsKind::Xfs, 300 << 20).unwrap();
    std::fs::create_dir(fs.path().join("sub")).unwrap();
    write_random(&fs.path().join("sub/f"), 4096, 1).unwrap();
    {
        let ro = fs.bind_mount_ro("sub").unwrap();
        let view = ro.path().join("f");
        assert_eq!(std::fs::read(&view).unwrap(), random_bytes(4096, 1));
        let err = std::fs::write(&view, b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(30 /* EROFS */));
        // The source stays writable.
        std::fs::write(fs.path().join("sub/g"), b"ok").unwrap();
        assert!(ro.path().join("g").exists());
    }
    fs.remount_ro().unwrap();
    let err = std::fs::write(fs.path().join("sub/h"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(30));
    fs.remount_rw().unwrap();
    std::fs::write(fs.path().join("sub/h"), b"x").unwrap();
}

#[test]
fn many_in_parallel() {
    if !root_or_skip() {
        return;
    }
    let handles: Vec<_> = (0..6)
        .map(|i| {
            std::thread::spawn(move || {
                let kind = if i % 2 == 0 {
                    FsKind::Btrfs
                } else {
                    FsKind::Xfs
                };
                let fs = LoopFs::new(kind, 320 << 20).unwrap();
                let p = fs.path().join("x");
                write_random(&p, 1 << 20, i).unwrap();
                assert_eq!(
                    checksum_file(&p).unwrap(),
                    xxhash_rust::xxh3::xxh3_128(&random_bytes(1 << 20, i))
                );
                let dev = fs.device().unwrap().to_string();
                let img = fs.image().unwrap().to_path_buf();
                drop(fs);
                assert!(!img.exists(), "image {} left behind", img.display());
                dev
            })
        })
        .collect();
    let mut devs: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    devs.sort();
    assert_eq!(devs.len(), 6);
}
