//! What `onecopy watch` needs besides the dedupe engine: a source of
//! changed files ([`Fanotify`] filesystem marks, or nothing, in which case
//! the caller polls) and the rule deciding when a batch of changes has
//! settled enough to dedupe ([`Debounce`]).

mod debounce;
mod fanotify;

pub use debounce::{Batch, Debounce};
pub use fanotify::{Change, ChangeSource, WatchError};
