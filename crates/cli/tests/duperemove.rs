//! `onecopy duperemove`: duperemove's command lines on a real btrfs, with
//! checksums before and after and sharing read back with FIEMAP; and
//! `jdupes -r DIR | onecopy duperemove --fdupes` with the real jdupes.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use onecopy_testfs::{checksum_tree, copy_no_reflink, is_fully_shared, write_random, FsKind};

fn duperemove(args: &[&str]) -> Run {
    let mut v = vec!["duperemove"];
    v.extend_from_slice(args);
    let r = onecopy(v);
    assert_eq!(r.code, 0, "onecopy duperemove {args:?}: {r:?}");
    r
}

fn shared_sets(sets: &[DupSet]) -> bool {
    sets.iter()
        .all(|s| s.copies.iter().all(|c| is_fully_shared(&s.original, c)))
}

fn none_shared(sets: &[DupSet]) -> bool {
    sets.iter()
        .all(|s| s.copies.iter().all(|c| !is_fully_shared(&s.original, c)))
}

#[test]
fn duperemove_command_lines() {
    let fs = new_fs(FsKind::Btrfs, 1 << 30);
    let root = fs.path().join("data");
    let sets = make_dupes(&root, DUPES);
    let uniques = make_uniques(&root);
    // A copy whose name matches --exclude: must stay unshared.
    let skipped = root.join("copy0/kept.skip");
    copy_no_reflink(&sets[1].original, &skipped).unwrap();
    fs.sync();
    let before = checksum_tree(&root);
    let dir = root.to_str().unwrap();

    // Without -d: a report, nothing changes.
    duperemove(&["-rh", dir]);
    fs.sync();
    assert!(none_shared(&sets), "shared without -d");

    // A hashfile the real duperemove made (a script moving to onecopy
    // names it): kept aside, a catalog made in its place.
    let hashfile = fs.path().join("hashes");
    let elsewhere = fs.path().join("other");
    std::fs::create_dir(&elsewhere).unwrap();
    write_random(&elsewhere.join("f"), MIB, 99).unwrap();
    let made = Command::new("duperemove")
        .arg("-q")
        .arg(format!("--hashfile={}", hashfile.display()))
        .arg(elsewhere.join("f"))
        .output()
        .expect("duperemove must be installed (scripts/test.sh installs it)");
    assert!(made.status.success(), "{made:?}");
    let theirs = std::fs::read(&hashfile).unwrap();
    let r = duperemove(&[
        "-dhr",
        "-q",
        "-b",
        "64K",
        "--dedupe-options=partial,same",
        "--exclude=*.skip",
        &format!("--hashfile={}", hashfile.display()),
        dir,
    ]);
    fs.sync();
    assert!(shared_sets(&sets), "duplicates not shared by -dr");
    assert!(
        !is_fully_shared(&sets[1].original, &skipped),
        "--exclude ignored"
    );
    for u in &uniques {
        for s in &sets {
            assert!(!is_fully_shared(u, &s.original));
        }
    }
    assert!(hashfile.exists(), "--hashfile not used");
    let aside = fs.path().join("hashes.duperemove");
    assert_eq!(
        std::fs::read(&aside).unwrap(),
        theirs,
        "duperemove's hashfile kept"
    );
    assert!(r.stderr.contains("kept as"), "{}", r.stderr);
    let cat = onecopy(["catalog", "stats", "--hashfile", hashfile.to_str().unwrap()]);
    assert_eq!(cat.code, 0, "{cat:?}");
    assert_eq!(checksum_tree(&root), before, "contents changed");
}

#[test]
fn without_r_only_the_files_directly_in_a_directory() {
    let fs = new_fs(FsKind::Btrfs, 1 << 30);
    let top = fs.path().join("top");
    std::fs::create_dir_all(top.join("sub")).unwrap();
    write_random(&top.join("a"), 2 * MIB, 7).unwrap();
    copy_no_reflink(&top.join("a"), &top.join("b")).unwrap();
    copy_no_reflink(&top.join("a"), &top.join("sub/c")).unwrap();
    fs.sync();
    duperemove(&["-d", top.to_str().unwrap()]);
    fs.sync();
    assert!(is_fully_shared(&top.join("a"), &top.join("b")));
    assert!(!is_fully_shared(&top.join("a"), &top.join("sub/c")));
}

fn pipe_jdupes(dir: &Path) -> Run {
    let mut jd = Command::new("jdupes")
        .args(["-r", "-q"])
        .arg(dir)
        .stdout(Stdio::piped())
        .spawn()
        .expect("jdupes must be installed (scripts/test.sh installs it)");
    let out = Command::new(env!("CARGO_BIN_EXE_onecopy"))
        .env(
            "ONECOPY_CACHE_DIR",
            std::env::temp_dir().join("onecopy-tests-jdupes"),
        )
        .args(["duperemove", "--fdupes"])
        .stdin(jd.stdout.take().unwrap())
        .output()
        .unwrap();
    assert!(jd.wait().unwrap().success());
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        json: None,
    }
}

#[test]
fn jdupes_groups_on_stdin() {
    let fs = new_fs(FsKind::Btrfs, 1 << 30);
    let root = fs.path().join("data");
    let sets = make_dupes(&root, DUPES);
    let uniques = make_uniques(&root);
    fs.sync();
    let before = checksum_tree(&root);
    let r = pipe_jdupes(&root);
    assert_eq!(r.code, 0, "{r:?}");
    fs.sync();
    assert!(shared_sets(&sets), "jdupes groups not shared: {r:?}");
    for u in &uniques {
        assert!(!is_fully_shared(u, &sets[0].original));
    }
    assert_eq!(checksum_tree(&root), before, "contents changed");
}
