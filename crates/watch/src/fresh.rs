//! Which files are too fresh to dedupe yet.
//!
//! The catalog does not record a file changed less than its racy margin
//! ([`onecopy_scan::RACY_MARGIN_NS`]) before it was read, and a later
//! pass naming only new files could not match against a file it does not
//! hold: such a file waits for the next batch ([`settled`]), and one that
//! a walk read while fresh is read again once it settles
//! ([`read_while_fresh`]).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The catalog's racy margin and a little more for the coarse clock.
pub const RACY: Duration =
    Duration::from_millis(onecopy_scan::RACY_MARGIN_NS as u64 / 1_000_000 + 100);

/// Whether `p`'s mtime or ctime lies within `d` of now (None: gone).
pub fn changed_within(p: &Path, d: Duration) -> Option<bool> {
    let m = std::fs::symlink_metadata(p).ok()?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_nanos() as i128;
    let ns = |s: i64, n: i64| s as i128 * 1_000_000_000 + n as i128;
    let changed = ns(m.mtime(), m.mtime_nsec()).max(ns(m.ctime(), m.ctime_nsec()));
    Some(within(changed, now, d))
}

/// Whether a change at `changed` (ns) lies within `d` of `now` (ns); a
/// change in the future (a clock set back) does.
fn within(changed: i128, now: i128, d: Duration) -> bool {
    now - changed < d.as_nanos() as i128
}

/// A batch's files split by [`RACY`]: those ready to dedupe, and those
/// changed too recently (to wait for the next batch); files gone since
/// are in neither.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Settled<'a> {
    pub ready: Vec<&'a PathBuf>,
    pub fresh: Vec<&'a PathBuf>,
}

/// Splits `paths` by [`RACY`] (see [`Settled`]).
pub fn settled<'a>(paths: impl IntoIterator<Item = &'a PathBuf>) -> Settled<'a> {
    settled_by(paths, RACY)
}

fn settled_by<'a>(paths: impl IntoIterator<Item = &'a PathBuf>, d: Duration) -> Settled<'a> {
    let mut s = Settled::default();
    for p in paths {
        match changed_within(p, d) {
            None => {}
            Some(true) => s.fresh.push(p),
            Some(false) => s.ready.push(p),
        }
    }
    s
}

/// Of the files a pass that took `took` read, those changed within
/// [`RACY`] of its start: read but not recorded, to read again once
/// settled.
pub fn read_while_fresh(read: impl IntoIterator<Item = PathBuf>, took: Duration) -> Vec<PathBuf> {
    let since = took + RACY;
    read.into_iter()
        .filter(|p| changed_within(p, since) == Some(true))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i128 = 1_000_000_000;

    #[test]
    fn the_boundary_is_exclusive() {
        let d = Duration::from_secs(1);
        assert!(within(100 * S, 100 * S, d));
        assert!(within(100 * S, 101 * S - 1, d));
        assert!(!within(100 * S, 101 * S, d));
        assert!(!within(100 * S, 200 * S, d));
        // A change stamped after now (the clock went back) is fresh.
        assert!(within(101 * S, 100 * S, d));
        // Nothing is within no time.
        assert!(!within(100 * S, 100 * S, Duration::ZERO));
    }

    #[test]
    fn racy_covers_the_catalog_margin() {
        assert!(RACY.as_nanos() > onecopy_scan::RACY_MARGIN_NS as u128);
        assert_eq!(RACY, Duration::from_millis(1100));
    }

    #[test]
    fn a_file_just_written_is_fresh_and_a_gone_one_is_neither() {
        let d = tempfile::tempdir().unwrap();
        let (new, gone) = (d.path().join("new"), d.path().join("gone"));
        std::fs::write(&new, b"x").unwrap();
        assert_eq!(changed_within(&new, Duration::from_secs(3600)), Some(true));
        assert_eq!(changed_within(&new, Duration::ZERO), Some(false));
        assert_eq!(changed_within(&gone, RACY), None);
        let paths = [new.clone(), gone.clone()];
        let s = settled(&paths);
        assert_eq!(s.fresh, [&new]);
        assert!(s.ready.is_empty());
        assert_eq!(read_while_fresh(paths.clone(), Duration::ZERO), [new]);
    }

    #[test]
    fn an_older_file_is_ready() {
        let d = tempfile::tempdir().unwrap();
        let (old, new) = (d.path().join("old"), d.path().join("new"));
        std::fs::write(&old, b"x").unwrap();
        // ctime cannot be set back: ask about a span shorter than its age.
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(&new, b"x").unwrap();
        let span = Duration::from_millis(200);
        assert_eq!(changed_within(&old, span), Some(false));
        let paths = [old.clone(), new.clone()];
        let s = settled_by(&paths, span);
        assert_eq!((s.ready, s.fresh), (vec![&old], vec![&new]));
    }
}
