//! What `onecopy watch` needs besides the dedupe engine: a source of
//! changed files ([`ChangeSource`]: fanotify filesystem marks, or nothing,
//! in which case the caller looks periodically: [`LastPass::look`], on
//! btrfs a tree search with [`changed_files`]), the rule deciding when a
//! batch of changes has settled enough to dedupe ([`Debounce`]), which of
//! its files are too fresh to dedupe yet ([`fresh`]), whether a pass
//! names files or walks ([`pass_walks`]), and where the last pass began,
//! kept across restarts ([`generation`]).

mod btrfs_changes;
mod debounce;
mod fanotify;
pub mod fid;
pub mod fresh;
pub mod generation;
mod look;

pub use btrfs_changes::changed_files;
pub use debounce::{Batch, Debounce};
pub use fanotify::{Change, ChangeSource, Mode, WatchError};
pub use look::{
    generations, load_allows, load_average, pass_walks, LastPass, Look, OwnFiles, CLOCK_SLACK,
    PASS_ARGS_MAX, TREE_SEARCH_LIMIT,
};
