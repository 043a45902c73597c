//! Typed errors of the store. Each carries what it is about (a path, an
//! inode, a container) so the message alone says where it happened.

use std::path::PathBuf;

/// Every error the store can return.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: fingerprint index: {source}")]
    Index {
        path: PathBuf,
        #[source]
        source: onecopy_fpindex::Error,
    },
    #[error("metadata database: {}", db_text(.0))]
    Db(#[from] rusqlite::Error),
    #[error("{path}: not an onecopy store ({why})")]
    NotAStore { path: PathBuf, why: String },
    #[error(
        "{path}: store format {found} is not supported (this onecopy reads format {supported})"
    )]
    Version {
        path: PathBuf,
        found: u64,
        supported: u64,
    },
    #[error("{path}: a store already exists here")]
    Exists { path: PathBuf },
    #[error("{path} exists: a restore makes a new directory, never writes into one")]
    DestExists { path: PathBuf },
    #[error(
        "{path}: directory is not empty ({entry} is there); a store needs a new or empty directory"
    )]
    NotEmptyDir { path: PathBuf, entry: String },
    #[error("{path}: not a directory; a store needs a new or empty directory")]
    NotADirectory { path: PathBuf },
    #[error("{path}: the store is in use by another process (mounted?)")]
    Locked { path: PathBuf },
    #[error("container {container} offset {offset}: damaged chunk ({why})")]
    Damaged {
        container: u64,
        offset: u64,
        why: String,
    },
    /// Damaged metadata: an extent names a chunk row that is not there.
    #[error("inode {ino} offset {off}: its extent names a chunk the metadata does not hold (run `onecopy store fsck`)")]
    MissingChunk { ino: u64, off: u64 },
    #[error("invalid option: {0}")]
    BadOption(String),
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    AlreadyExists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("invalid argument")]
    Invalid,
    #[error("no such attribute")]
    NoAttr,
    #[error("operation not supported")]
    NotSupported,
    #[error("file name too long")]
    NameTooLong,
    #[error("file too large")]
    TooBig,
    #[error("no space left on device")]
    NoSpace,
    #[error(
        "container {container}: a sync failed earlier ({why}); nothing is committed until \
         the store is reopened (unmount and mount again: the last commit is replayed)"
    )]
    Poisoned { container: u64, why: String },
    #[error(
        "chunk {chunk}: {dropped} references dropped but {} held; the counts differ from \
         the file maps (run `onecopy store fsck --repair`)",
        refs.map_or("none (no such chunk)".to_string(), |r| r.to_string())
    )]
    RefUnderflow {
        chunk: u64,
        refs: Option<u64>,
        dropped: u64,
    },
    #[error(
        "{path}: No space left on device (what is left is the store's reserve for \
         committing what it holds; free space to write again)"
    )]
    LowSpace { path: PathBuf },
    #[error("the store shut down ({why}); unmount and mount it again")]
    ShutDown { why: String },
    #[error(transparent)]
    Object(#[from] onecopy_objects::ObjectError),
    #[error("remote store: {why}")]
    Remote { why: String },
    #[error(
        "{url} already holds a store: make a cache of it with \
         `onecopy store init DIR --recover --remote {url}`"
    )]
    BucketInUse { url: String },
    #[error("wrong password: it does not open the bucket's key")]
    WrongPassword,
    #[error(
        "the bucket's store is encrypted: give its password with --password-file FILE \
         or the ONECOPY_PASSWORD environment variable"
    )]
    PasswordNeeded,
    /// A password was given for a bucket whose store is not encrypted:
    /// its owner could have put a plain store of their own in place of an
    /// encrypted one (writes would then reach it in clear).
    #[error(
        "the bucket's store is not encrypted, but a password was given: refused \
         (a store made with --no-encryption is opened without one)"
    )]
    NotEncrypted,
    /// Another cache is the bucket's writer (see `mirror.rs`).
    #[error("remote store: {why}")]
    Fenced { why: String },
}

impl StoreError {
    /// A remote store's settings that cannot work (a bad endpoint): a
    /// usage error, not an I/O one.
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            StoreError::Object(onecopy_objects::ObjectError::Config(_))
        )
    }

    /// The errno a file-system call reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            StoreError::NotFound => libc::ENOENT,
            StoreError::AlreadyExists => libc::EEXIST,
            StoreError::NotDir => libc::ENOTDIR,
            StoreError::IsDir => libc::EISDIR,
            StoreError::NotEmpty => libc::ENOTEMPTY,
            StoreError::Invalid | StoreError::BadOption(_) => libc::EINVAL,
            StoreError::NoAttr => libc::ENODATA,
            StoreError::TooBig => libc::EFBIG,
            StoreError::NameTooLong => libc::ENAMETOOLONG,
            StoreError::NotSupported => libc::EOPNOTSUPP,
            StoreError::NoSpace | StoreError::LowSpace { .. } => libc::ENOSPC,
            StoreError::Io { source, .. } => match source.raw_os_error() {
                Some(libc::ENOSPC) => libc::ENOSPC,
                Some(libc::EDQUOT) => libc::EDQUOT,
                _ => libc::EIO,
            },
            StoreError::Index {
                source: onecopy_fpindex::Error::Io { source, .. },
                ..
            } if source.raw_os_error() == Some(libc::ENOSPC) => libc::ENOSPC,
            StoreError::Db(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DiskFull =>
            {
                libc::ENOSPC
            }
            _ => libc::EIO,
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> StoreError {
        let path = path.into();
        move |source| StoreError::Io { path, source }
    }
}

/// SQLite's text, with a full disk named as the system names it ("No space
/// left on device"), as every other out-of-space error of the store reads.
fn db_text(e: &rusqlite::Error) -> String {
    match e {
        rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DiskFull => {
            format!("No space left on device ({e})")
        }
        _ => e.to_string(),
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A full disk met by SQLite reads like one met by a write, and maps
    /// to ENOSPC.
    #[test]
    fn a_full_metadata_database_says_no_space() {
        let full = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
            None,
        );
        let e = StoreError::Db(full);
        assert_eq!(e.errno(), libc::ENOSPC);
        assert!(
            e.to_string()
                .starts_with("metadata database: No space left on device ("),
            "{e}"
        );
        let busy = StoreError::Db(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY),
            None,
        ));
        assert!(!busy.to_string().contains("No space"), "{busy}");
    }
}
