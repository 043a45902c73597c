//! Content checksums of whole trees, to assert "every file unchanged".

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

/// xxh3-128 of the full contents of one file.
pub fn checksum_file(path: &Path) -> io::Result<u128> {
    let mut f = File::open(path)?;
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.update(&buf[..n]);
    }
    Ok(h.digest128())
}

/// xxh3-128 of every regular file under `root`, keyed by the path relative
/// to `root`. Symlinks are neither followed nor hashed; other special files
/// are skipped. Compare the maps before and after an operation to assert
/// that no file's contents changed (and none appeared or vanished).
///
/// # Panics
/// On I/O errors while walking or reading.
pub fn checksum_tree(root: &Path) -> BTreeMap<PathBuf, u128> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let rd =
            std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()));
        for entry in rd {
            let entry = entry.unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()));
            let path = entry.path();
            let ft = entry
                .file_type()
                .unwrap_or_else(|e| panic!("file type of {}: {e}", path.display()));
            if ft.is_dir() {
                stack.push(path);
            } else if ft.is_file() {
                let sum =
                    checksum_file(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
                let rel = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
                out.insert(rel, sum);
            }
        }
    }
    out
}
