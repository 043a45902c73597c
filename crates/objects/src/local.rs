//! Objects as files under a directory: the object seam on a local disk.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::ops::Range;
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use rustix::fs::{flock, FlockOperation};

use crate::{check_key, Listed, ObjectError, Objects, Result, Tag};

/// Where objects are written before they take their name (same
/// filesystem, so that naming is a rename or a link).
const TMP: &str = ".tmp";
/// Held (flock) while a `swap` compares and replaces.
const SWAP_LOCK: &str = ".swap.lock";

/// Objects as files: key `a/b` is `ROOT/a/b`.
///
/// Invariant: an object has its name only once its bytes are durable
/// (written to a temporary file in `ROOT/.tmp`, synced, then named by a
/// link that fails if the name is taken, or a rename for `swap`, and the
/// directory synced). Files and directories are private to the owner.
pub struct LocalObjects {
    root: PathBuf,
}

impl LocalObjects {
    /// Objects under `root`, created (mode 0700) if missing.
    pub fn new(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        let tmp = root.join(TMP);
        mkdirs(&tmp).map_err(|e| ObjectError::io(TMP, e))?;
        Ok(LocalObjects { root })
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        check_key(key)?;
        Ok(self.root.join(key))
    }

    /// A synced temporary file holding `bytes`, in the parent of `path`'s
    /// filesystem, ready to be named.
    fn staged(&self, key: &str, bytes: &[u8]) -> Result<tempfile::NamedTempFile> {
        let io = |e| ObjectError::io(key, e);
        let mut f = tempfile::NamedTempFile::new_in(self.root.join(TMP)).map_err(io)?;
        f.write_all(bytes).map_err(io)?;
        f.as_file().sync_data().map_err(io)?;
        Ok(f)
    }

    /// Makes `path`'s parent directory exist and returns it.
    fn parent(&self, key: &str, path: &Path) -> Result<PathBuf> {
        let dir = path.parent().unwrap_or(&self.root).to_path_buf();
        mkdirs(&dir).map_err(|e| ObjectError::io(key, e))?;
        Ok(dir)
    }
}

fn mkdirs(dir: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// An object's version: a hash of its bytes, as S3's ETag is. (Inode,
/// size and change time were tried first: a rewrite within one clock
/// tick could reuse the freed inode and match a stale tag.)
fn tag_of(bytes: &[u8]) -> Tag {
    Tag(blake3::hash(bytes).to_hex()[..32].to_string())
}

impl Objects for LocalObjects {
    fn put_new(&self, key: &str, bytes: Bytes) -> Result<()> {
        let path = self.path(key)?;
        let dir = self.parent(key, &path)?;
        let staged = self.staged(key, &bytes)?;
        match staged.persist_noclobber(&path) {
            Ok(_) => {}
            Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(ObjectError::Exists {
                    key: key.to_string(),
                })
            }
            Err(e) => return Err(ObjectError::io(key, e.error)),
        }
        sync_dir(&dir).map_err(|e| ObjectError::io(key, e))
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        let io = |e| ObjectError::io(key, e);
        let f = File::open(self.path(key)?).map_err(io)?;
        let mut buf = vec![0; range.end.saturating_sub(range.start) as usize];
        let mut at = 0;
        while at < buf.len() {
            match f.read_at(&mut buf[at..], range.start + at as u64) {
                Ok(0) => break,
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
        buf.truncate(at);
        Ok(buf.into())
    }

    fn size(&self, key: &str) -> Result<Option<u64>> {
        match fs::metadata(self.path(key)?) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ObjectError::io(key, e)),
        }
    }

    fn get(&self, key: &str) -> Result<(Bytes, Tag)> {
        let io = |e| ObjectError::io(key, e);
        let mut f = File::open(self.path(key)?).map_err(io)?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf).map_err(io)?;
        let tag = tag_of(&buf);
        Ok((buf.into(), tag))
    }

    fn swap(&self, key: &str, bytes: Bytes, expected: Option<&Tag>) -> Result<Tag> {
        let io = |e| ObjectError::io(key, e);
        let path = self.path(key)?;
        let dir = self.parent(key, &path)?;
        let lock = File::create(self.root.join(TMP).join(SWAP_LOCK)).map_err(io)?;
        flock(&lock, FlockOperation::LockExclusive).map_err(|e| io(e.into()))?;
        let now = match fs::read(&path) {
            Ok(b) => Some(tag_of(&b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io(e)),
        };
        if now.as_ref() != expected {
            return Err(ObjectError::Conflict {
                key: key.to_string(),
            });
        }
        let staged = self.staged(key, &bytes)?;
        staged.persist(&path).map_err(|e| io(e.error))?;
        sync_dir(&dir).map_err(io)?;
        Ok(tag_of(&bytes))
    }

    fn delete(&self, key: &str) -> Result<()> {
        match fs::remove_file(self.path(key)?) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(ObjectError::io(key, e)),
            _ => Ok(()),
        }
    }

    fn list(&self, dir: &str) -> Result<Vec<Listed>> {
        if !dir.is_empty() {
            check_key(dir)?;
        }
        let mut out = Vec::new();
        walk(&self.root, dir, &mut out).map_err(|e| ObjectError::io(dir, e))?;
        Ok(out)
    }
}

/// Adds the files under `ROOT/dir`, recursively.
fn walk(root: &Path, dir: &str, out: &mut Vec<Listed>) -> std::io::Result<()> {
    let entries = match fs::read_dir(root.join(dir)) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if dir.is_empty() && name == TMP {
            continue;
        }
        let key = if dir.is_empty() {
            name
        } else {
            format!("{dir}/{name}")
        };
        let kind = entry.file_type()?;
        if kind.is_dir() {
            walk(root, &key, out)?;
        } else if kind.is_file() {
            let size = entry.metadata()?.len();
            out.push(Listed { key, size });
        }
    }
    Ok(())
}
