//! Test fixtures for onecopy's integration tests: real filesystems on loop
//! devices, content checksums and extent-sharing checks. No mocks: every
//! helper talks to the running kernel.
//!
//! Most of this crate needs root (mounting, `mkfs`, `losetup`); integration
//! tests that use it are expected to run as root. [`is_root`] lets a test
//! skip itself with a message elsewhere.
//!
//! # Example
//!
//! ```no_run
//! use onecopy_testfs::{checksum_tree, is_fully_shared, write_random, FsKind, LoopFs};
//!
//! let fs = LoopFs::new(FsKind::Btrfs, 512 << 20).unwrap();
//! let a = fs.path().join("a");
//! let b = fs.path().join("b");
//! write_random(&a, 8 << 20, 1).unwrap();
//! onecopy_testfs::copy_no_reflink(&a, &b).unwrap();
//! let before = checksum_tree(fs.path());
//! let used = fs.used_bytes();
//! // ... run the deduper on fs.path() ...
//! assert_eq!(checksum_tree(fs.path()), before);
//! assert!(is_fully_shared(&a, &b));
//! assert!(fs.used_bytes() < used);
//! // Dropping `fs` unmounts it and deletes the image.
//! ```
//!
//! # Conventions
//!
//! Constructors and write helpers return [`std::io::Result`]. Query helpers
//! used inside assertions ([`LoopFs::used_bytes`], [`checksum_tree`],
//! [`shared_bytes_between`], ...) return plain values and **panic** with a
//! descriptive message on I/O errors: they are test fixtures, and a failing
//! query is a failing test.

mod checksum;
mod cmd;
mod extents;
mod loopfs;
mod proxy;
pub mod seed;
mod weed;
mod write;

pub use checksum::{checksum_file, checksum_tree};
pub use cmd::is_root;
pub use extents::{
    btrfs_extent_items, btrfs_pinned_bytes, data_extents, extents, is_fully_shared, physical_bytes,
    physical_ranges, shared_bytes_between, shared_flag_bytes, Range,
};
pub use loopfs::{bind_mount_ro, btrfs_du, BindMount, BtrfsDu, FsKind, LoopFs};
pub use proxy::{FaultProxy, Faults};
pub use weed::Weed;
pub use write::{copy_no_reflink, random_bytes, reflink_copy, write_in_chunks, write_random, Prng};

/// btrfs file extent item type re-exported from `onecopy-ioctl`.
pub use onecopy_ioctl::btrfs::{FileExtent, FileExtentKind};
/// FIEMAP extent type re-exported from `onecopy-ioctl` for convenience.
pub use onecopy_ioctl::fiemap::Extent;
