//! Errors of the object seam, each naming the key it concerns.

/// What went wrong with an object.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("object {key}: not found")]
    NotFound { key: String },
    #[error("object {key}: already exists")]
    Exists { key: String },
    #[error("object {key}: changed since it was read (conditional write refused)")]
    Conflict { key: String },
    #[error("object key {key:?} is not valid (relative, /-separated, no empty, . or .. parts)")]
    BadKey { key: String },
    #[error("object {key}: {source}")]
    Io {
        key: String,
        #[source]
        source: std::io::Error,
    },
    #[error("object {key}: {source}{}", credentials_hint(source))]
    Remote {
        key: String,
        #[source]
        source: Box<object_store::Error>,
    },
    #[error("object store configuration: {0}")]
    Config(String),
}

pub type Result<T, E = ObjectError> = std::result::Result<T, E>;

/// With no credentials in the environment or `~/.aws`, the client asks the
/// instance metadata service (169.254.169.254), whose refusal said nothing
/// about credentials.
fn credentials_hint(e: &object_store::Error) -> &'static str {
    match e.to_string().contains("169.254.169.254") {
        true => {
            " (no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, \
             or a profile in ~/.aws/credentials)"
        }
        false => "",
    }
}

impl ObjectError {
    pub(crate) fn io(key: &str, source: std::io::Error) -> Self {
        match source.kind() {
            std::io::ErrorKind::NotFound => ObjectError::NotFound {
                key: key.to_string(),
            },
            _ => ObjectError::Io {
                key: key.to_string(),
                source,
            },
        }
    }

    /// Maps `object_store`'s answers to ours: a missing object, a taken
    /// key and a failed precondition have their own variants.
    pub(crate) fn remote(key: &str, source: object_store::Error) -> Self {
        let key = key.to_string();
        match source {
            object_store::Error::NotFound { .. } => ObjectError::NotFound { key },
            object_store::Error::AlreadyExists { .. } => ObjectError::Exists { key },
            object_store::Error::Precondition { .. } => ObjectError::Conflict { key },
            source => ObjectError::Remote {
                key,
                source: Box::new(source),
            },
        }
    }
}
