//! What `onecopy watch` needs besides the dedupe engine: a source of
//! changed files ([`ChangeSource`]: fanotify filesystem marks, or nothing,
//! in which case the caller polls, on btrfs with [`changed_files`]) and the
//! rule deciding when a batch of changes has
//! settled enough to dedupe ([`Debounce`]).

mod btrfs_changes;
mod debounce;
mod fanotify;
pub mod fid;

pub use btrfs_changes::changed_files;
pub use debounce::{Batch, Debounce};
pub use fanotify::{Change, ChangeSource, Mode, WatchError};
