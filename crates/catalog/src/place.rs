//! Where a run's catalogs and scratch files go.
//!
//! - The catalogs live in one directory ([`default_dir`]), one per
//!   filesystem, named by the filesystem's identity ([`fs_key`],
//!   [`catalog_path`]); `--hashfile` names a single catalog instead.
//! - Spill files (the digest store's lists, a block table past
//!   `--memory`) go next to the catalogs ([`spill_dir`]): never in a
//!   user's tree, and not in `/tmp`, which may be tmpfs and hold them in
//!   RAM.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use onecopy_scan::FsId;

/// Where the catalogs live by default: `$ONECOPY_CACHE_DIR` if set, else
/// `/var/cache/onecopy` for root, `$XDG_CACHE_HOME/onecopy` (or
/// `~/.cache/onecopy`) for others.
pub fn default_dir() -> PathBuf {
    default_dir_from(
        |k| std::env::var_os(k),
        rustix::process::geteuid().is_root(),
    )
}

/// [`default_dir`] for the environment `var` and a user who is root or
/// not; an empty `ONECOPY_CACHE_DIR` or `XDG_CACHE_HOME` counts as unset.
fn default_dir_from(var: impl Fn(&str) -> Option<OsString>, root: bool) -> PathBuf {
    let set = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = set("ONECOPY_CACHE_DIR") {
        return d;
    }
    if root {
        return PathBuf::from("/var/cache/onecopy");
    }
    if let Some(x) = set("XDG_CACHE_HOME") {
        return x.join("onecopy");
    }
    // Without HOME: the user's home from the password database (never
    // the working directory, which may be the tree being deduped); a user
    // with none gets a path that cannot be made, and runs without a
    // catalog.
    let home = set("HOME")
        .or_else(std::env::home_dir)
        .unwrap_or_else(|| PathBuf::from("/nonexistent"));
    home.join(".cache").join("onecopy")
}

/// A filesystem identity that survives remounts (`FsInfo::fsid` is
/// derived from the filesystem's UUID on btrfs and XFS): the `fs` column
/// of its records and the name of its catalog.
pub fn fs_key(fsid: FsId) -> String {
    format!("fs-{fsid:016x}")
}

/// The catalog of the filesystem `fs_key`: `hashfile` when one is given,
/// else `<default_dir>/<fs_key>.sqlite`.
pub fn catalog_path(hashfile: Option<&Path>, fs_key: &str) -> PathBuf {
    match hashfile {
        Some(p) => p.to_path_buf(),
        None => default_dir().join(format!("{fs_key}.sqlite")),
    }
}

/// Where spill files go: the directory of `hashfile` when one is used
/// (not with `no_catalog`) and has one, else [`default_dir`].
pub fn spill_dir(hashfile: Option<&Path>, no_catalog: bool) -> PathBuf {
    hashfile
        .filter(|_| !no_catalog)
        .and_then(Path::parent)
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(default_dir, Path::to_path_buf)
}

/// The catalogs in `dir` (files named `*.sqlite`), sorted; none when it
/// cannot be read.
pub fn catalogs_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "sqlite"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn the_cache_dir_variable_wins_even_for_root() {
        let e = [("ONECOPY_CACHE_DIR", "/c"), ("XDG_CACHE_HOME", "/x")];
        assert_eq!(default_dir_from(env(&e), true), Path::new("/c"));
        assert_eq!(default_dir_from(env(&e), false), Path::new("/c"));
    }

    #[test]
    fn root_uses_var_cache() {
        let e = [("ONECOPY_CACHE_DIR", ""), ("XDG_CACHE_HOME", "/x")];
        assert_eq!(
            default_dir_from(env(&e), true),
            Path::new("/var/cache/onecopy")
        );
    }

    #[test]
    fn users_use_xdg_then_home() {
        let e = [("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(default_dir_from(env(&e), false), Path::new("/x/onecopy"));
        let e = [("XDG_CACHE_HOME", ""), ("HOME", "/h")];
        assert_eq!(
            default_dir_from(env(&e), false),
            Path::new("/h/.cache/onecopy")
        );
        // Never relative: the working directory may be the tree deduped.
        let without_home = default_dir_from(env(&[]), false);
        assert!(without_home.is_absolute(), "{}", without_home.display());
        assert!(without_home.ends_with(".cache/onecopy"));
    }

    #[test]
    fn fs_key_is_sixteen_hex_digits() {
        assert_eq!(fs_key(0xab), "fs-00000000000000ab");
        assert_eq!(
            catalog_path(None, &fs_key(1)),
            default_dir().join("fs-0000000000000001.sqlite")
        );
    }

    #[test]
    fn a_hashfile_is_the_catalog_and_places_the_spill() {
        let h = Path::new("/d/cat.sqlite");
        assert_eq!(catalog_path(Some(h), "fs-1"), h);
        assert_eq!(spill_dir(Some(h), false), Path::new("/d"));
    }

    #[test]
    fn the_spill_goes_to_the_default_dir_otherwise() {
        assert_eq!(spill_dir(None, false), default_dir());
        // A bare file name has no directory of its own.
        assert_eq!(
            spill_dir(Some(Path::new("cat.sqlite")), false),
            default_dir()
        );
        // Without a catalog, a --hashfile is not used.
        assert_eq!(spill_dir(Some(Path::new("/d/c")), true), default_dir());
    }

    #[test]
    fn catalogs_in_lists_sqlite_files_sorted() {
        let d = tempfile::tempdir().unwrap();
        for n in ["b.sqlite", "a.sqlite", "a.sqlite-wal", "x.generation"] {
            std::fs::write(d.path().join(n), b"").unwrap();
        }
        let names: Vec<_> = catalogs_in(d.path())
            .into_iter()
            .map(|p| p.file_name().unwrap().to_owned())
            .collect();
        assert_eq!(names, ["a.sqlite", "b.sqlite"]);
        assert!(catalogs_in(&d.path().join("missing")).is_empty());
    }
}
