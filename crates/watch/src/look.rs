//! Without fanotify, a periodic look decides what a pass covers: nothing,
//! the files a btrfs tree search names, or a walk of every root
//! ([`LastPass::look`]); and a batch too large to name on a command line
//! is a walk as well ([`pass_walks`]).

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use crate::generation;

/// More changed files than this from a tree search: walk instead.
pub const TREE_SEARCH_LIMIT: usize = 10_000;
/// Bytes of file names a pass is given on its command line at most (well
/// under ARG_MAX); a larger batch runs over the whole roots.
pub const PASS_ARGS_MAX: usize = 256 << 10;
/// Seconds a ctime may lag the wall clock read before it (coarse clock,
/// rounding to seconds).
pub const CLOCK_SLACK: u64 = 2;

/// Where the last pass began.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LastPass {
    /// The btrfs generation of each root's filesystem (None where unknown:
    /// not btrfs, or an old kernel); empty before the first pass.
    pub generations: Vec<Option<u64>>,
    /// Wall-clock seconds: a tree search keeps files whose ctime is at
    /// least this minus [`CLOCK_SLACK`].
    pub wall: u64,
}

/// What a periodic look found.
#[derive(Debug)]
pub enum Look {
    /// No filesystem generation moved since the last pass began.
    Unchanged,
    /// The files a tree search found changed (maybe none).
    Searched(Vec<PathBuf>),
    /// The tree search of `root` failed: walk.
    Failed {
        root: PathBuf,
        error: std::io::Error,
    },
    /// Walk (not every root on btrfs, no pass seen them yet, or the
    /// search found too many).
    Walk,
}

/// How a look starts, from the roots' generations `now` and the last
/// pass's `last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    Walk,
    Unchanged,
    Search,
}

fn start(now: &[Option<u64>], last: &[Option<u64>]) -> Start {
    if !now.iter().all(Option::is_some) || last.len() != now.len() {
        Start::Walk
    } else if now == last {
        Start::Unchanged
    } else {
        Start::Search
    }
}

impl LastPass {
    /// A pass beginning now over `roots`.
    pub fn begin(roots: &[PathBuf]) -> LastPass {
        LastPass {
            generations: generations(roots),
            wall: wall_secs(),
        }
    }

    /// What the previous run saved for `roots` in `dir`, when it saved
    /// every one of them.
    pub fn saved(dir: &Path, roots: &[PathBuf]) -> Option<LastPass> {
        LastPass::from_saved(roots.iter().map(|r| generation::load(dir, r)))
    }

    /// From each root's saved (generation, wall second): the earliest
    /// wall second, as a search must cover every root since its own.
    fn from_saved(saved: impl Iterator<Item = Option<(u64, u64)>>) -> Option<LastPass> {
        let saved: Vec<(u64, u64)> = saved.collect::<Option<_>>()?;
        Some(LastPass {
            generations: saved.iter().map(|&(g, _)| Some(g)).collect(),
            wall: saved.iter().map(|&(_, t)| t).min().unwrap_or(0),
        })
    }

    /// Saves it for the next start (roots of unknown generation: not).
    pub fn save(&self, dir: &Path, roots: &[PathBuf]) {
        for (r, g) in roots.iter().zip(&self.generations) {
            if let Some(g) = g {
                generation::save(dir, r, *g, self.wall);
            }
        }
    }

    /// A periodic look. Where every root is on btrfs and was seen by the
    /// last pass: [`Look::Unchanged`] when no generation moved since (one
    /// ioctl per root), else the files a tree search finds changed since,
    /// leaving out those `skip` names. Otherwise a walk.
    pub fn look(&self, roots: &[PathBuf], skip: impl Fn(&Path) -> bool) -> Look {
        match start(&generations(roots), &self.generations) {
            Start::Walk => return Look::Walk,
            Start::Unchanged => return Look::Unchanged,
            Start::Search => {}
        }
        let min_ctime = self.wall.saturating_sub(CLOCK_SLACK);
        let mut files = Vec::new();
        for (root, since) in roots.iter().zip(&self.generations) {
            let since = since.unwrap_or(0);
            match crate::changed_files(root, since, min_ctime, TREE_SEARCH_LIMIT) {
                Ok(Some(v)) => files.extend(v.into_iter().filter(|p| !skip(p))),
                Ok(None) => return Look::Walk,
                Err(error) => {
                    let root = root.clone();
                    return Look::Failed { root, error };
                }
            }
        }
        Look::Searched(files)
    }
}

/// Whether a pass over the batch's `named` files (`unknown`: something
/// changed that no path names) must walk every root instead.
pub fn pass_walks(unknown: bool, named: &[&PathBuf]) -> bool {
    let arg_bytes: usize = named.iter().map(|p| p.as_os_str().len() + 1).sum();
    unknown || arg_bytes > PASS_ARGS_MAX
}

/// onecopy's own catalog directory and `--hashfile`: a pass writes them,
/// and seeing that as a change would start a pass again, forever.
#[derive(Debug, Clone)]
pub struct OwnFiles(Vec<PathBuf>);

impl OwnFiles {
    /// The catalog directory and the hashfile, canonical where they exist.
    pub fn new(catalog_dir: PathBuf, hashfile: Option<PathBuf>) -> OwnFiles {
        let v = std::iter::once(catalog_dir).chain(hashfile);
        OwnFiles(v.map(|p| std::fs::canonicalize(&p).unwrap_or(p)).collect())
    }

    /// Whether `p` is one of them or under one.
    pub fn contains(&self, p: &Path) -> bool {
        self.0.iter().any(|o| p.starts_with(o))
    }
}

/// The btrfs generation of each root's filesystem, where known.
pub fn generations(roots: &[PathBuf]) -> Vec<Option<u64>> {
    roots
        .iter()
        .map(|r| {
            let f = onecopy_scan::longpath::open_nonblocking(r).ok()?;
            onecopy_ioctl::btrfs::fs_generation(f.as_fd()).ok()
        })
        .collect()
}

/// Seconds since the epoch.
fn wall_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether the 1-minute load average `load` (None: unknown) allows a
/// pass under `max_load` (0 or less: no limit).
pub fn load_allows(max_load: f64, load: Option<f64>) -> bool {
    max_load <= 0.0 || load.is_none_or(|l| l <= max_load)
}

/// The 1-minute load average from /proc/loadavg.
pub fn load_average() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_only_where_every_root_is_btrfs_and_was_seen() {
        let (a, b) = (Some(5), Some(9));
        assert_eq!(start(&[a, b], &[a, b]), Start::Unchanged);
        assert_eq!(start(&[a, Some(10)], &[a, b]), Start::Search);
        // A root not on btrfs (or an old kernel): walk.
        assert_eq!(start(&[a, None], &[a, None]), Start::Walk);
        // Before any pass, or roots that no pass saw: walk.
        assert_eq!(start(&[a, b], &[]), Start::Walk);
        assert_eq!(start(&[a, b], &[a]), Start::Walk);
    }

    #[test]
    fn looking_without_btrfs_walks() {
        let d = tempfile::tempdir().unwrap();
        let roots = vec![d.path().to_path_buf()];
        if generations(&roots)[0].is_some() {
            return; // the temporary directory is on btrfs here
        }
        let last = LastPass::begin(&roots);
        assert!(matches!(last.look(&roots, |_| false), Look::Walk));
        assert!(LastPass::saved(d.path(), &roots).is_none());
    }

    #[test]
    fn a_saved_pass_needs_every_root_and_starts_at_the_earliest() {
        let saved = [Some((5, 100)), Some((9, 50))];
        let last = LastPass::from_saved(saved.into_iter()).unwrap();
        assert_eq!(last.generations, [Some(5), Some(9)]);
        assert_eq!(last.wall, 50);
        let partly = [Some((5, 100)), None];
        assert_eq!(LastPass::from_saved(partly.into_iter()), None);
        let d = tempfile::tempdir().unwrap();
        let roots = vec![PathBuf::from("/r1"), PathBuf::from("/r2")];
        assert_eq!(LastPass::saved(d.path(), &roots), None);
    }

    #[test]
    fn a_batch_too_large_to_name_walks() {
        let one = PathBuf::from("x".repeat(PASS_ARGS_MAX - 1));
        assert!(!pass_walks(false, &[&one]));
        assert!(pass_walks(true, &[&one]));
        assert!(pass_walks(true, &[]));
        let over = PathBuf::from("x".repeat(PASS_ARGS_MAX));
        assert!(pass_walks(false, &[&over]));
        let half = PathBuf::from("x".repeat(PASS_ARGS_MAX / 2 - 1));
        assert!(!pass_walks(false, &[&half, &half]));
        assert!(pass_walks(false, &[&half, &half, &one]));
    }

    #[test]
    fn own_files_are_not_changes() {
        let own = OwnFiles::new("/nonexistent/cache".into(), Some("/h/cat".into()));
        assert!(own.contains(Path::new("/nonexistent/cache/fs-1.sqlite")));
        assert!(own.contains(Path::new("/h/cat")));
        assert!(!own.contains(Path::new("/h/cat2")));
        assert!(
            !own.contains(Path::new("/r/.onecopy-tmp.1/f")),
            "a user's name"
        );
    }

    #[test]
    fn the_load_limit() {
        assert!(load_allows(0.0, Some(99.0)));
        assert!(load_allows(2.0, Some(2.0)));
        assert!(!load_allows(2.0, Some(2.01)));
        assert!(load_allows(2.0, None));
    }
}
