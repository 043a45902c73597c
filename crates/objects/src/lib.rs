//! The object seam: where a store keeps what it has sealed.
//!
//! An [`Objects`] holds whole objects under string keys. Every object but
//! one kind is written once ([`Objects::put_new`], refused when the key is
//! taken) and deleted whole; reads may take any byte range. The one kind
//! that changes, a manifest or a lease, is replaced only by
//! [`Objects::swap`], a compare-and-swap on the version [`Tag`] the
//! reader last saw (S3's `If-Match`; `If-None-Match: *` to create).
//!
//! Two implementations: [`LocalObjects`] (a directory) and [`S3Objects`]
//! (an S3-compatible server through the `object_store` crate).
//!
//! Invariants every implementation keeps:
//! - an object `put_new` returned `Ok` for is durable and reads back
//!   exactly; a failed `put_new` leaves no object or a whole one, never
//!   a part;
//! - of two `swap`s given the same expected tag, at most one succeeds;
//! - a listing may miss objects made recently (S3 listings are not
//!   promised complete by every server): callers never conclude from a
//!   listing that an object does not exist.

mod error;
mod local;
mod pool;
mod s3;

pub use error::{ObjectError, Result};
pub use local::LocalObjects;
pub use pool::Pool;
pub use s3::{S3Config, S3Objects};

use bytes::Bytes;
use std::ops::Range;

/// The version of an object as [`Objects::swap`] compares it: an S3 ETag,
/// or for a local object its size, change time and inode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tag(pub String);

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub key: String,
    pub size: u64,
}

/// Whole objects under string keys (`/`-separated, no leading `/`).
pub trait Objects: Send + Sync {
    /// Stores `bytes` as `key` unless an object has that key
    /// ([`ObjectError::Exists`] then, and the old object is untouched).
    fn put_new(&self, key: &str, bytes: Bytes) -> Result<()>;
    /// Bytes `range` of `key`, which must lie within the object.
    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes>;
    /// The size of `key`, `None` if there is no such object.
    fn size(&self, key: &str) -> Result<Option<u64>>;
    /// The whole of `key` and its version.
    fn get(&self, key: &str) -> Result<(Bytes, Tag)>;
    /// The whole of `key` if it is at most `max` bytes long; `Ok(None)`
    /// if it is longer or there is no such object. Here: the size asked
    /// first, then the object; a bucket answers in one request, reading
    /// no body past the size it announced.
    fn get_at_most(&self, key: &str, max: u64) -> Result<Option<Bytes>> {
        match self.size(key)? {
            Some(n) if n <= max => self.get(key).map(|(b, _)| Some(b)),
            _ => Ok(None),
        }
    }
    /// Replaces `key` by `bytes` if its version is `expected`, or creates
    /// it if `expected` is `None` and there is none; returns the new
    /// version. [`ObjectError::Conflict`] when the object changed (or
    /// appeared, or vanished) since `expected` was read.
    fn swap(&self, key: &str, bytes: Bytes, expected: Option<&Tag>) -> Result<Tag>;
    /// Removes `key`; removing what is not there is not an error.
    fn delete(&self, key: &str) -> Result<()>;
    /// The objects under directory `dir` (keys `dir/…`; every object when
    /// `dir` is empty), maybe not all (see the module's invariants), in
    /// no promised order.
    fn list(&self, dir: &str) -> Result<Vec<Listed>>;

    /// [`Objects::put_new`], settled: an `Exists` whose object holds
    /// exactly `bytes` is success (an earlier try took effect and its
    /// answer was lost, then the retry found it).
    fn put_new_settled(&self, key: &str, bytes: Bytes) -> Result<()> {
        match self.put_new(key, bytes.clone()) {
            Err(ObjectError::Exists { key }) => match self.get(&key) {
                Ok((there, _)) if there == bytes => Ok(()),
                _ => Err(ObjectError::Exists { key }),
            },
            r => r,
        }
    }

    /// [`Objects::swap`], settled: a `Conflict` whose object now holds
    /// exactly `bytes` is success (a lost answer, as above); callers make
    /// every swapped object unique (a generation, a time, a nonce), so
    /// that only their own write can match.
    fn swap_settled(&self, key: &str, bytes: Bytes, expected: Option<&Tag>) -> Result<Tag> {
        match self.swap(key, bytes.clone(), expected) {
            Err(ObjectError::Conflict { key }) => match self.get(&key) {
                Ok((there, tag)) if there == bytes => Ok(tag),
                _ => Err(ObjectError::Conflict { key }),
            },
            r => r,
        }
    }
}

/// Checks a key: relative, `/`-separated, no empty, `.` or `..` part, no
/// NUL. Both implementations refuse others, so a key means the same in each.
fn check_key(key: &str) -> Result<()> {
    let bad = key.is_empty()
        || key.contains('\0')
        || key
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..");
    if bad {
        return Err(ObjectError::BadKey {
            key: key.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked() {
        for k in ["a", "a/b", "containers/00/0001.occ"] {
            assert!(check_key(k).is_ok(), "{k}");
        }
        for k in ["", "/a", "a/", "a//b", "a/../b", ".", "a/./b", "a\0b"] {
            assert!(
                matches!(check_key(k), Err(ObjectError::BadKey { .. })),
                "{k:?}"
            );
        }
    }
}
