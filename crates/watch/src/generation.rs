//! Where the last pass began, kept across restarts, so that the first look
//! after a start can be a btrfs tree search instead of a walk.
//!
//! # On-disk format
//!
//! One file per root in the catalog directory, named
//! `watch-<16 hex digits>.generation` (the digits: std's `DefaultHasher`
//! of the root's path), holding one line:
//!
//! ```text
//! <filesystem UUID, 32 lowercase hex digits> <btrfs generation> <wall-clock second>\n
//! ```
//!
//! Written to `*.tmp` and renamed over the file. A file that is missing,
//! damaged, or saved for another filesystem (another UUID at that path) is
//! ignored: it costs one walk, never a missed change.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

/// What one root's generation file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    /// The filesystem's UUID in lowercase hex.
    pub uuid: String,
    /// The btrfs generation when the pass began.
    pub generation: u64,
    /// Seconds since the epoch when the pass began.
    pub wall: u64,
}

impl Saved {
    /// Parses a file's text; None when any field is missing or damaged.
    pub fn parse(text: &str) -> Option<Saved> {
        let mut f = text.split_whitespace();
        let (uuid, generation, wall) = (f.next()?, f.next()?, f.next()?);
        Some(Saved {
            uuid: uuid.to_string(),
            generation: generation.parse().ok()?,
            wall: wall.parse().ok()?,
        })
    }

    /// The file's text.
    pub fn to_text(&self) -> String {
        format!("{} {} {}\n", self.uuid, self.generation, self.wall)
    }
}

/// The generation file of `root` in the catalog directory `dir`.
pub fn generation_file(dir: &Path, root: &Path) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    root.hash(&mut h);
    dir.join(format!("watch-{:016x}.generation", h.finish()))
}

/// The UUID of `root`'s btrfs filesystem in lowercase hex (None: not
/// btrfs, or unreadable).
pub fn fs_uuid_hex(root: &Path) -> Option<String> {
    let f = onecopy_scan::longpath::open_nonblocking(root).ok()?;
    let u = onecopy_ioctl::btrfs::fs_uuid(f.as_fd()).ok()?;
    Some(u.iter().map(|b| format!("{b:02x}")).collect())
}

/// The saved generation of `root` and the wall-clock second of that
/// pass's start, if they were saved for the filesystem now at `root`.
pub fn load(dir: &Path, root: &Path) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(generation_file(dir, root)).ok()?;
    load_text(&text, fs_uuid_hex(root).as_deref())
}

/// [`load`] of a file's `text` for the filesystem of UUID `uuid`.
fn load_text(text: &str, uuid: Option<&str>) -> Option<(u64, u64)> {
    let s = Saved::parse(text)?;
    (Some(s.uuid.as_str()) == uuid).then_some((s.generation, s.wall))
}

/// Saves `generation` and `wall` for `root` (atomically; a failure only
/// costs a walk at the next start).
pub fn save(dir: &Path, root: &Path, generation: u64, wall: u64) {
    let Some(uuid) = fs_uuid_hex(root) else {
        return;
    };
    let saved = Saved {
        uuid,
        generation,
        wall,
    };
    save_text(&generation_file(dir, root), &saved.to_text());
}

fn save_text(path: &Path, text: &str) {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, text).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn the_text_is_one_line_of_three_fields() {
        let s = Saved {
            uuid: UUID.into(),
            generation: 12345,
            wall: 1_700_000_000,
        };
        assert_eq!(s.to_text(), format!("{UUID} 12345 1700000000\n"));
        assert_eq!(Saved::parse(&s.to_text()), Some(s));
    }

    #[test]
    fn a_file_round_trips_for_its_filesystem_only() {
        let d = tempfile::tempdir().unwrap();
        let path = generation_file(d.path(), Path::new("/mnt/a"));
        let s = Saved {
            uuid: UUID.into(),
            generation: 7,
            wall: 9,
        };
        save_text(&path, &s.to_text());
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(load_text(&text, Some(UUID)), Some((7, 9)));
        // Recreated at the same path (another UUID), or not btrfs now.
        let other = "fedcba9876543210fedcba9876543210";
        assert_eq!(load_text(&text, Some(other)), None);
        assert_eq!(load_text(&text, None), None);
        assert!(!path.with_extension("tmp").exists());
    }

    #[test]
    fn a_damaged_file_is_ignored() {
        for text in [
            "",
            "\n",
            UUID,
            &format!("{UUID} 7"),
            &format!("{UUID} seven 9"),
            &format!("{UUID} 7 -9"),
            &format!("{UUID} 18446744073709551616 9"),
            "\u{0}\u{0}\u{0}",
        ] {
            assert_eq!(load_text(text, Some(UUID)), None, "{text:?}");
        }
        // Extra fields (a later format appending one) are not damage.
        assert_eq!(
            load_text(&format!("{UUID} 7 9 x"), Some(UUID)),
            Some((7, 9))
        );
    }

    #[test]
    fn file_names_are_per_root_and_stable() {
        let dir = Path::new("/var/cache/onecopy");
        let a = generation_file(dir, Path::new("/mnt/a"));
        assert_eq!(a, generation_file(dir, Path::new("/mnt/a")));
        assert_ne!(a, generation_file(dir, Path::new("/mnt/b")));
        assert_eq!(a.parent(), Some(dir));
        let name = a.file_name().unwrap().to_str().unwrap();
        let hex = name
            .strip_prefix("watch-")
            .and_then(|n| n.strip_suffix(".generation"))
            .unwrap();
        assert!(hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn not_btrfs_saves_nothing() {
        let d = tempfile::tempdir().unwrap();
        if fs_uuid_hex(d.path()).is_some() {
            return; // the temporary directory is on btrfs here
        }
        save(d.path(), d.path(), 1, 2);
        assert_eq!(load(d.path(), d.path()), None);
        assert!(!generation_file(d.path(), d.path()).exists());
    }
}
