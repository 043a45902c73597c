//! Whether an existing file is an onecopy catalog, decided without
//! changing a byte of it (nor its `-wal`/`-shm`, nor its times): only such
//! a file may ever be rebuilt or set aside; any other file a user names is
//! refused.
//!
//! A catalog is a SQLite database whose header carries
//! [`APPLICATION_ID`] (`PRAGMA application_id`, big-endian at byte 68).
//! Catalogs written before the id existed (id 0) are recognised by their
//! `meta` row `magic = onecopy-catalog`, read through a read-only,
//! `immutable` connection that takes no lock and writes nothing.

use std::io::Read;
use std::path::Path;

use rusqlite::{Connection, OpenFlags};

use crate::MAGIC;

/// `PRAGMA application_id` of every catalog: "onec" in ASCII.
pub const APPLICATION_ID: i32 = 0x6f6e_6563;

const SQLITE_HEADER: &[u8; 16] = b"SQLite format 3\0";

/// What lies at a catalog path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Nothing (or an empty file): a catalog may be created there.
    Nothing,
    /// An onecopy catalog, perhaps damaged past its header.
    Catalog,
    /// Anything else: never to be touched.
    Foreign,
}

/// Looks at `path` without modifying it.
pub fn identify(path: &Path) -> std::io::Result<Existing> {
    // A FIFO named as the catalog opens at once (and is then foreign)
    // instead of waiting for a writer.
    let mut f = match onecopy_scan::longpath::open_nonblocking(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Existing::Nothing),
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Ok(Existing::Foreign);
    }
    if meta.len() == 0 {
        return Ok(Existing::Nothing);
    }
    let mut head = [0u8; 100];
    let n = read_full(&mut f, &mut head)?;
    Ok(classify_header(&head[..n]).unwrap_or_else(|| legacy_magic(path)))
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Decides from the first 100 bytes; `None`: a SQLite database with no
/// application id, which only its `meta` table can tell.
fn classify_header(head: &[u8]) -> Option<Existing> {
    if head.len() < 100 || &head[..16] != SQLITE_HEADER {
        return Some(Existing::Foreign);
    }
    let id = i32::from_be_bytes(head[68..72].try_into().ok()?);
    match id {
        APPLICATION_ID => Some(Existing::Catalog),
        0 => None,
        _ => Some(Existing::Foreign),
    }
}

/// A catalog of before the application id: its `meta` magic row.
fn legacy_magic(path: &Path) -> Existing {
    let uri = format!("file:{}?immutable=1", uri_escape(path));
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let magic = Connection::open_with_flags(uri, flags).and_then(|c| {
        c.query_row("SELECT value FROM meta WHERE key = 'magic'", [], |r| {
            r.get::<_, String>(0)
        })
    });
    match magic {
        Ok(m) if m == MAGIC => Existing::Catalog,
        _ => Existing::Foreign,
    }
}

/// Whether `path` is duperemove's hashfile (a SQLite database whose
/// `config` table names duperemove's keys), looked at read-only and
/// `immutable`, as [`identify`] does.
pub fn is_duperemove_hashfile(path: &Path) -> bool {
    if identify(path).ok() != Some(Existing::Foreign) {
        return false;
    }
    let uri = format!("file:{}?immutable=1", uri_escape(path));
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    Connection::open_with_flags(uri, flags)
        .and_then(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM config WHERE keyname IN ('hash_type', 'version_major')",
                [],
                |r| r.get::<_, i64>(0),
            )
        })
        .is_ok_and(|n| n == 2)
}

/// Percent-encodes a path for a SQLite `file:` URI.
fn uri_escape(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut s = String::new();
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers() {
        assert_eq!(classify_header(b"hello"), Some(Existing::Foreign));
        let mut h = [0u8; 100];
        h[..16].copy_from_slice(SQLITE_HEADER);
        assert_eq!(classify_header(&h), None);
        h[68..72].copy_from_slice(&APPLICATION_ID.to_be_bytes());
        assert_eq!(classify_header(&h), Some(Existing::Catalog));
        h[68..72].copy_from_slice(&7i32.to_be_bytes());
        assert_eq!(classify_header(&h), Some(Existing::Foreign));
    }

    #[test]
    fn escapes_uri_specials() {
        assert_eq!(uri_escape(Path::new("/a b/c?d#%")), "/a%20b/c%3Fd%23%25");
    }

    #[test]
    fn files_are_identified() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x?y");
        assert_eq!(identify(&p).unwrap(), Existing::Nothing);
        std::fs::write(&p, b"").unwrap();
        assert_eq!(identify(&p).unwrap(), Existing::Nothing);
        std::fs::write(&p, b"some text").unwrap();
        assert_eq!(identify(&p).unwrap(), Existing::Foreign);
        std::fs::remove_file(&p).unwrap();
        let c = Connection::open(&p).unwrap();
        c.execute_batch("CREATE TABLE meta (key TEXT, value TEXT);")
            .unwrap();
        assert_eq!(identify(&p).unwrap(), Existing::Foreign);
        c.execute("INSERT INTO meta VALUES ('magic', ?1)", [MAGIC])
            .unwrap();
        assert_eq!(identify(&p).unwrap(), Existing::Catalog);
        assert_eq!(identify(d.path()).unwrap(), Existing::Foreign);
    }
}
