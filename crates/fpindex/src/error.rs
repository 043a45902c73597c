//! Typed errors; each names the index file concerned.

/// An index error, naming the file (relative to the index directory).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{file}: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: damaged index file ({what})")]
    Corrupt { file: String, what: &'static str },
}

pub type Result<T> = std::result::Result<T, Error>;

/// Adds the file name to an I/O error.
pub(crate) trait Ctx<T> {
    fn ctx(self, file: &str) -> Result<T>;
}

impl<T> Ctx<T> for std::io::Result<T> {
    fn ctx(self, file: &str) -> Result<T> {
        self.map_err(|source| Error::Io {
            file: file.to_string(),
            source,
        })
    }
}

pub(crate) fn corrupt(file: &str, what: &'static str) -> Error {
    Error::Corrupt {
        file: file.to_string(),
        what,
    }
}
