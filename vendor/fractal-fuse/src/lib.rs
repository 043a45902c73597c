// Modified for onecopy from fractal-fuse 0.6.1: see PATCHES.md.
#![doc = include_str!("../README.md")]

pub mod abi;
pub mod dispatch;
pub mod filesystem;
pub mod mount;
pub mod notify;
pub mod passthrough;
pub mod ring;
pub mod session;
mod sideband;
pub mod types;

pub use filesystem::{Filesystem, FsResult};
pub use mount::{DEFAULT_INIT_FLAGS, MountOptions};
pub use notify::FuseNotifier;
pub use ring::DEFAULT_QUEUE_DEPTH;
pub use session::{Session, SessionShutdownHandle};
pub use types::*;
