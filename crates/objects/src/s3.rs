//! Objects in an S3-compatible bucket, through the `object_store` crate.

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder, S3ConditionalPut};
use object_store::path::Path as ObjPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    RetryConfig, UpdateVersion,
};

use crate::{check_key, Listed, ObjectError, Objects, Pool, Result, Tag};

/// Where a bucket is and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Config {
    pub bucket: String,
    /// Keys are stored under `PREFIX/` (empty: at the bucket's root).
    pub prefix: String,
    /// `http://host:port` of an S3-compatible server; AWS when `None`.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    /// How long a failing request is retried (timeouts, 5xx, refused
    /// connections) before it fails.
    pub patience: Duration,
}

impl S3Config {
    /// Parses `s3://BUCKET[/PREFIX]`.
    pub fn from_url(url: &str) -> Result<Self> {
        let bad = || ObjectError::Config(format!("{url:?} is not s3://BUCKET[/PREFIX]"));
        let rest = url.strip_prefix("s3://").ok_or_else(bad)?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        if bucket.is_empty() || (!prefix.is_empty() && check_key(prefix).is_err()) {
            return Err(bad());
        }
        Ok(S3Config {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            endpoint: None,
            region: None,
            patience: Duration::from_secs(60),
        })
    }
}

/// Objects in a bucket. Credentials come the AWS way: the environment
/// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`),
/// else the `AWS_PROFILE` (or `default`) profile of `~/.aws/credentials`.
///
/// Requests run on a small runtime of the object's own: the methods block
/// and must not be called from inside another async runtime. Failed
/// requests (timeouts, 5xx) are retried with backoff for
/// [`S3Config::patience`];
/// a conditional PUT whose answer was lost may therefore come back as
/// `Exists` or `Conflict` although it took effect, which callers settle by
/// reading the object.
pub struct S3Objects {
    store: AmazonS3,
    prefix: String,
    rt: tokio::runtime::Runtime,
    /// Buffers of whole objects fetched before, for the next fetch.
    pool: std::sync::Arc<Pool>,
}

/// An endpoint is an `http://` or `https://` URL with a host (object_store
/// panicked signing a request to `notaurl`).
fn check_endpoint(e: &str) -> Result<()> {
    let bad = |why: &str| Err(ObjectError::Config(format!("endpoint {e:?}: {why}")));
    match url::Url::parse(e) {
        Err(err) => bad(&format!("not a URL ({err}); e.g. http://127.0.0.1:8333")),
        Ok(u) if !matches!(u.scheme(), "http" | "https") => bad("not http:// or https://"),
        Ok(u) if u.host_str().is_none_or(str::is_empty) => bad("no host"),
        Ok(_) => Ok(()),
    }
}

impl S3Objects {
    pub fn new(config: &S3Config) -> Result<Self> {
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(&config.bucket)
            .with_conditional_put(S3ConditionalPut::ETagMatch)
            // What goes up is sealed or checked by the store itself (AEAD
            // tags, chunk hashes); a SHA-256 of every body for the request
            // signature was an eighth of a writing mount's CPU.
            .with_unsigned_payload(true)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(5),
                    base: 2.0,
                },
                max_retries: 1000,
                retry_timeout: config.patience,
            })
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(Duration::from_secs(60))
                    .with_connect_timeout(Duration::from_secs(5)),
            );
        b = b.with_region(config.region.as_deref().unwrap_or("us-east-1"));
        if let Some(e) = &config.endpoint {
            check_endpoint(e)?;
            b = b
                .with_endpoint(e)
                .with_allow_http(e.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
            if let Some((id, secret, token)) = profile_credentials() {
                b = b.with_access_key_id(id).with_secret_access_key(secret);
                if let Some(t) = token {
                    b = b.with_token(t);
                }
            }
        }
        let store = b.build().map_err(|e| ObjectError::Config(e.to_string()))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("onecopy-s3")
            .enable_all()
            .build()
            .map_err(|e| ObjectError::Config(format!("async runtime: {e}")))?;
        Ok(S3Objects {
            store,
            prefix: config.prefix.clone(),
            rt,
            pool: Pool::keeping(FETCHES_KEPT),
        })
    }

    fn path(&self, key: &str) -> Result<ObjPath> {
        check_key(key)?;
        Ok(ObjPath::from(self.full(key)))
    }

    fn full(&self, key: &str) -> String {
        match self.prefix.as_str() {
            "" => key.to_string(),
            p => format!("{p}/{key}"),
        }
    }

    fn put(&self, key: &str, bytes: Bytes, mode: PutMode) -> Result<Option<String>> {
        let path = self.path(key)?;
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        let r = self
            .rt
            .block_on(self.store.put_opts(&path, PutPayload::from(bytes), opts));
        r.map(|p| p.e_tag).map_err(|e| ObjectError::remote(key, e))
    }
}

impl Objects for S3Objects {
    fn put_new(&self, key: &str, bytes: Bytes) -> Result<()> {
        self.put(key, bytes, PutMode::Create).map(|_| ())
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        let path = self.path(key)?;
        let r = self.rt.block_on(self.store.get_range(&path, range));
        r.map_err(|e| ObjectError::remote(key, e))
    }

    fn size(&self, key: &str) -> Result<Option<u64>> {
        let path = self.path(key)?;
        match self.rt.block_on(self.store.head(&path)) {
            Ok(m) => Ok(Some(m.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(ObjectError::remote(key, e)),
        }
    }

    fn get(&self, key: &str) -> Result<(Bytes, Tag)> {
        let path = self.path(key)?;
        let remote = |e| ObjectError::remote(key, e);
        self.rt.block_on(async {
            let got = self.store.get(&path).await.map_err(remote)?;
            let tag = got.meta.e_tag.clone().ok_or_else(|| no_etag(key))?;
            Ok((got.bytes().await.map_err(remote)?, Tag(tag)))
        })
    }

    /// One GET: its answer's headers tell the size, and the body of a
    /// longer object is dropped unread (the connection closed) instead of
    /// asking for the size with a HEAD first (a round trip per container
    /// fetched).
    fn get_at_most(&self, key: &str, max: u64) -> Result<Option<Bytes>> {
        let path = self.path(key)?;
        let remote = |e| ObjectError::remote(key, e);
        self.rt.block_on(async {
            let got = match self.store.get(&path).await {
                Ok(g) => g,
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(remote(e)),
            };
            if got.meta.size > max {
                return Ok(None);
            }
            let len = got.meta.size as usize;
            let mut body = got.into_stream();
            let mut buf = Aligned::new(len, &self.pool);
            let short = || {
                let why = format!("the body was not the {len} bytes announced");
                ObjectError::io(
                    key,
                    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, why),
                )
            };
            while let Some(piece) = body.try_next().await.map_err(remote)? {
                if !buf.push(&piece, len) {
                    return Err(short());
                }
            }
            buf.finish(len).map(Some).ok_or_else(short)
        })
    }

    fn swap(&self, key: &str, bytes: Bytes, expected: Option<&Tag>) -> Result<Tag> {
        let mode = match expected {
            None => PutMode::Create,
            Some(t) => PutMode::Update(UpdateVersion {
                e_tag: Some(t.0.clone()),
                version: None,
            }),
        };
        match self.put(key, bytes, mode) {
            Ok(Some(etag)) => Ok(Tag(etag)),
            Ok(None) => Err(no_etag(key)),
            Err(ObjectError::Exists { key } | ObjectError::NotFound { key }) => {
                Err(ObjectError::Conflict { key })
            }
            Err(e) => Err(e),
        }
    }

    fn delete(&self, key: &str) -> Result<()> {
        let path = self.path(key)?;
        match self.rt.block_on(self.store.delete(&path)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(ObjectError::remote(key, e)),
        }
    }

    fn list(&self, dir: &str) -> Result<Vec<Listed>> {
        let under = match (self.prefix.as_str(), dir) {
            ("", "") => None,
            (_, "") => Some(ObjPath::from(self.prefix.as_str())),
            _ => Some(self.path(dir)?),
        };
        let skip = match self.prefix.as_str() {
            "" => 0,
            p => p.len() + 1,
        };
        let found: Vec<_> = self
            .rt
            .block_on(self.store.list(under.as_ref()).try_collect())
            .map_err(|e| ObjectError::remote(dir, e))?;
        Ok(found
            .into_iter()
            .filter_map(|m| {
                let key = m.location.as_ref().get(skip..)?.to_string();
                Some(Listed { key, size: m.size })
            })
            .collect())
    }
}

fn no_etag(key: &str) -> ObjectError {
    ObjectError::Config(format!(
        "object {key}: the server gave no ETag, which conditional writes need"
    ))
}

/// `aws_access_key_id`, `aws_secret_access_key` and `aws_session_token` of
/// profile `AWS_PROFILE` (or `default`) in `AWS_SHARED_CREDENTIALS_FILE`
/// (or `~/.aws/credentials`).
fn profile_credentials() -> Option<(String, String, Option<String>)> {
    let file = match std::env::var_os("AWS_SHARED_CREDENTIALS_FILE") {
        Some(f) => std::path::PathBuf::from(f),
        None => std::path::PathBuf::from(std::env::var_os("HOME")?).join(".aws/credentials"),
    };
    let text = std::fs::read_to_string(file).ok()?;
    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
    parse_profile(&text, &profile)
}

fn parse_profile(text: &str, profile: &str) -> Option<(String, String, Option<String>)> {
    let (mut id, mut secret, mut token, mut inside) = (None, None, None, false);
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == profile;
        } else if let (true, Some((k, v))) = (inside, line.split_once('=')) {
            let v = Some(v.trim().to_string());
            match k.trim() {
                "aws_access_key_id" => id = v,
                "aws_secret_access_key" => secret = v,
                "aws_session_token" => token = v,
                _ => {}
            }
        }
    }
    Some((id?, secret?, token))
}

/// Where a whole fetched object's bytes start: on this boundary, so that
/// a caller may write them to a file with `O_DIRECT` without staging them
/// in an aligned copy first (a property callers may use, never rely on).
const FETCH_ALIGN: usize = 4096;

/// Fetch buffers kept for the next fetches (see [`Pool`]): the fetches in
/// flight (the cache asks for two containers ahead) and one being let go.
const FETCHES_KEPT: usize = 3;

/// A body collected into one buffer whose first byte lies on a
/// [`FETCH_ALIGN`] boundary (the room before it is never part of the
/// bytes handed out).
struct Aligned {
    buf: Vec<u8>,
    start: usize,
    pool: std::sync::Arc<Pool>,
}

impl Aligned {
    fn new(len: usize, pool: &std::sync::Arc<Pool>) -> Aligned {
        let mut buf = pool.take(len + FETCH_ALIGN);
        let start = buf.as_ptr().align_offset(FETCH_ALIGN).min(FETCH_ALIGN);
        buf.resize(start, 0);
        Aligned {
            buf,
            start,
            pool: pool.clone(),
        }
    }

    /// Appends `piece` unless the bytes would pass `len` (then false).
    fn push(&mut self, piece: &[u8], len: usize) -> bool {
        let fits = self.buf.len() - self.start + piece.len() <= len;
        if fits {
            self.buf.extend_from_slice(piece);
        }
        fits
    }

    /// The bytes, if they are exactly `len` long (the buffer goes back to
    /// the pool either way).
    fn finish(self, len: usize) -> Option<Bytes> {
        let whole = self.buf.len() - self.start == len;
        let bytes = Pool::bytes(&self.pool, self.buf, self.start);
        whole.then_some(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collected_body_starts_aligned_and_is_exactly_its_length() {
        let pool = Pool::keeping(FETCHES_KEPT);
        for len in [0, 1, 4095, 4096, 100_000] {
            let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut a = Aligned::new(len, &pool);
            for piece in data.chunks(7000) {
                assert!(a.push(piece, len));
            }
            let b = a.finish(len).unwrap();
            assert_eq!(b.as_ptr() as usize % FETCH_ALIGN, 0);
            assert_eq!(&b[..], &data[..]);
        }
        let mut short = Aligned::new(10, &pool);
        assert!(short.push(b"12345", 10));
        assert!(short.finish(10).is_none());
        let mut long = Aligned::new(4, &pool);
        assert!(!long.push(b"12345", 4));
    }

    /// A fetched body's buffer serves the next fetch once every reference
    /// to the body is gone, not before; the pool keeps at most FETCHES_KEPT.
    #[test]
    fn a_fetch_buffer_is_reused_once_let_go() {
        let pool = Pool::keeping(FETCHES_KEPT);
        let fetch = |len: usize| {
            let mut a = Aligned::new(len, &pool);
            assert!(a.push(&vec![7; len], len));
            a.finish(len).unwrap()
        };
        let first = fetch(100_000);
        let kept = first.clone();
        drop(first);
        let second = fetch(100_000);
        assert_ne!(second.as_ptr(), kept.as_ptr(), "a buffer still referenced");
        let at = kept.as_ptr();
        drop(kept);
        assert_eq!(fetch(100_000).as_ptr(), at, "a buffer let go");
        let many: Vec<Bytes> = (0..FETCHES_KEPT + 2).map(|_| fetch(10)).collect();
        drop(many);
        drop(second);
        assert_eq!(pool.kept(), FETCHES_KEPT);
    }

    #[test]
    fn urls_parse() {
        let c = S3Config::from_url("s3://b/p/q/").unwrap();
        assert_eq!((c.bucket.as_str(), c.prefix.as_str()), ("b", "p/q"));
        assert_eq!(S3Config::from_url("s3://b").unwrap().prefix, "");
        for bad in ["s3://", "http://b/p", "s3://b/a/../c", "b/p"] {
            assert!(S3Config::from_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn profiles_parse() {
        let text = "[default]\naws_access_key_id = A\naws_secret_access_key=S\n\n\
                    [other]\naws_access_key_id=B\naws_secret_access_key=T\naws_session_token=X\n";
        assert_eq!(
            parse_profile(text, "default"),
            Some(("A".into(), "S".into(), None))
        );
        assert_eq!(
            parse_profile(text, "other"),
            Some(("B".into(), "T".into(), Some("X".into())))
        );
        assert_eq!(parse_profile(text, "none"), None);
    }
}
