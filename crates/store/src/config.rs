//! The store's settings, fixed at `init` and kept in `store.json`.

use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};

/// Store format this code writes. Format 2 (fingerprint lookups through
/// `onecopy-fpindex` in `DIR/index`, no unique hash index in SQLite).
pub const FORMAT: u64 = 2;
/// Oldest store format this code opens; a format-1 store is migrated to
/// format 2 when opened for writing.
pub const FORMAT_MIN: u64 = 1;
/// Magic string in `store.json`.
pub const MAGIC: &str = "onecopy-store";

/// How files are cut into chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Chunking {
    /// Chunks of `size` bytes aligned in the file (the last one shorter).
    Fixed { size: u32 },
    /// FastCDC 2020 with these minimum / average / maximum sizes.
    Cdc { min: u32, avg: u32, max: u32 },
}

impl Default for Chunking {
    fn default() -> Self {
        Chunking::Fixed { size: 64 * 1024 }
    }
}

/// Parses a size such as `4096`, `64K`, `1M`.
pub fn parse_size(s: &str) -> Result<u32> {
    let bad = || StoreError::BadOption(format!("'{s}' is not a size (e.g. 4096, 64K, 1M, 1G)"));
    let (num, mul) = match s.as_bytes().last() {
        Some(b'k' | b'K') => (&s[..s.len() - 1], 1 << 10),
        Some(b'm' | b'M') => (&s[..s.len() - 1], 1 << 20),
        Some(b'g' | b'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    let bytes = n.checked_mul(mul).ok_or_else(bad)?;
    u32::try_from(bytes).map_err(|_| bad())
}

impl std::str::FromStr for Chunking {
    type Err = StoreError;
    /// `fixed:SIZE` or `cdc:MIN/AVG/MAX`.
    fn from_str(s: &str) -> Result<Self> {
        let c = if let Some(size) = s.strip_prefix("fixed:") {
            Chunking::Fixed {
                size: parse_size(size)?,
            }
        } else if let Some(spec) = s.strip_prefix("cdc:") {
            let parts: Vec<&str> = spec.split('/').collect();
            let [min, avg, max] = parts[..] else {
                return Err(StoreError::BadOption(format!(
                    "'{s}': expected cdc:MIN/AVG/MAX"
                )));
            };
            Chunking::Cdc {
                min: parse_size(min)?,
                avg: parse_size(avg)?,
                max: parse_size(max)?,
            }
        } else {
            return Err(StoreError::BadOption(format!(
                "'{s}': expected fixed:SIZE or cdc:MIN/AVG/MAX"
            )));
        };
        c.validate()?;
        Ok(c)
    }
}

impl Chunking {
    /// Smallest chunk this chunking cuts (a file's last may be shorter).
    pub fn min_chunk(&self) -> u32 {
        match *self {
            Chunking::Fixed { size } => size,
            Chunking::Cdc { min, .. } => min,
        }
    }

    /// Largest chunk this chunking produces.
    pub fn max_chunk(&self) -> u32 {
        match *self {
            Chunking::Fixed { size } => size,
            Chunking::Cdc { max, .. } => max,
        }
    }

    fn validate(&self) -> Result<()> {
        let ok = match *self {
            Chunking::Fixed { size } => (4096..=4 << 20).contains(&size) && size.is_power_of_two(),
            Chunking::Cdc { min, avg, max } => {
                (fastcdc::v2020::MINIMUM_MIN..=fastcdc::v2020::MINIMUM_MAX).contains(&min)
                    && (fastcdc::v2020::AVERAGE_MIN..=fastcdc::v2020::AVERAGE_MAX).contains(&avg)
                    && (fastcdc::v2020::MAXIMUM_MIN..=4 << 20).contains(&max)
                    && min <= avg
                    && avg <= max
            }
        };
        if ok {
            Ok(())
        } else {
            Err(StoreError::BadOption(format!(
                "chunking {self:?}: fixed sizes are powers of two from 4K to 4M; \
                 cdc needs MIN <= AVG <= MAX within FastCDC's bounds (MAX <= 4M)"
            )))
        }
    }
}

/// Compression of stored chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compress {
    /// zstd for every chunk: smallest, but it spends its time on
    /// incompressible data too.
    Zstd,
    /// lz4 for every chunk: fastest; it gives up on incompressible data
    /// at memory speed.
    Lz4,
    /// The default: lz4 on an 8 KiB sample of the chunk, as a test that
    /// costs little, chooses: raw if the sample does not shrink, lz4 if it
    /// shrinks by less than [`AUTO_WORTH_PERCENT`] says, zstd otherwise.
    /// Incompressible data costs the test; compressible data is stored as
    /// small as zstd stores it, at zstd's cost alone.
    #[default]
    Auto,
    None,
}

/// `auto` recompresses with zstd a chunk that lz4 shrank to at most this
/// percentage of its size: below that zstd rarely gains enough to pay
/// its time.
pub const AUTO_WORTH_PERCENT: usize = 97;

/// zstd's level when a store does not set one (zstd's own default).
pub const ZSTD_LEVEL: i32 = 3;

/// `--compress` with an optional zstd level: `auto`, `auto:N`, `zstd`,
/// `zstd:N` (N 1 to 19), `lz4` or `none`.
pub fn parse_compress(s: &str) -> Result<(Compress, Option<i32>)> {
    let Some((name, level)) = s.split_once(':') else {
        return Ok((s.parse()?, None));
    };
    let codec: Compress = name.parse()?;
    if !matches!(codec, Compress::Zstd | Compress::Auto) {
        return Err(StoreError::BadOption(format!(
            "'{s}': only zstd and auto take a level"
        )));
    }
    match level.parse::<i32>() {
        Ok(n) if (1..=19).contains(&n) => Ok((codec, Some(n))),
        _ => Err(StoreError::BadOption(format!(
            "'{s}': a zstd level is 1 to 19"
        ))),
    }
}

/// How chunks are packed: the codec and, for zstd, its level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packing {
    pub compress: Compress,
    pub zstd_level: i32,
}

impl From<Compress> for Packing {
    fn from(compress: Compress) -> Packing {
        Packing {
            compress,
            zstd_level: ZSTD_LEVEL,
        }
    }
}

impl std::str::FromStr for Compress {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Compress::Auto),
            "zstd" => Ok(Compress::Zstd),
            "lz4" => Ok(Compress::Lz4),
            "none" => Ok(Compress::None),
            _ => Err(StoreError::BadOption(format!(
                "'{s}': expected auto, zstd, lz4 or none"
            ))),
        }
    }
}

/// Contents of `store.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreConfig {
    pub magic: String,
    pub format: u64,
    pub chunking: Chunking,
    pub compress: Compress,
    /// Compare bytes on a fingerprint hit.
    pub verify: bool,
    /// Target size of a container file.
    pub container_size: u64,
    /// Fingerprint index quota: once this many chunks are indexed, new
    /// chunks are stored without dedupe (ZFS `dedup_table_quota`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_quota: Option<u64>,
    /// Entries the fingerprint index keeps in its memtable before sealing
    /// it into a run (default 65,536; tests set a few hundred so that
    /// flushes and merges happen often).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_memtable: Option<usize>,
    /// zstd's level (1-19; default [`ZSTD_LEVEL`]); only with zstd and
    /// auto.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zstd_level: Option<i32>,
    /// The object store the store lives in (`store init --remote`); the
    /// directory is then its cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteSpec>,
}

/// The default bound of a remote store's local cache of containers.
pub const DEFAULT_CACHE: u64 = 4 << 30;

/// Parses a byte count such as `4096`, `512M`, `2G`, `1T`.
pub fn parse_bytes(s: &str) -> Result<u64> {
    let bad = || StoreError::BadOption(format!("'{s}' is not a size (e.g. 512M, 2G)"));
    let (num, shift) = match s.as_bytes().last() {
        Some(b'k' | b'K') => (&s[..s.len() - 1], 10),
        Some(b'm' | b'M') => (&s[..s.len() - 1], 20),
        Some(b'g' | b'G') => (&s[..s.len() - 1], 30),
        Some(b't' | b'T') => (&s[..s.len() - 1], 40),
        _ => (s, 0),
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    n.checked_mul(1 << shift).ok_or_else(bad)
}

/// Where a remote store's bucket is (credentials are not kept: they come
/// the AWS way, from the environment or `~/.aws/credentials`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteSpec {
    /// `s3://BUCKET/PREFIX`, or `file:///DIR`.
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// Bytes of containers the cache keeps locally once they are in the
    /// bucket (default [`DEFAULT_CACHE`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_size: Option<u64>,
    /// A cache that follows the bucket's store, read-only (`mount
    /// --read-only --remote`): it never writes to the bucket.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// The key object of an encrypted store (`keys/ID`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// How long objects of deleted containers stay for followers, seconds
    /// (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_secs: Option<u64>,
    /// How long failing requests are retried, seconds (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patience_secs: Option<u64>,
}

impl StoreConfig {
    /// The codec and level new chunks are packed with.
    pub fn packing(&self) -> Packing {
        Packing {
            compress: self.compress,
            zstd_level: self.zstd_level.unwrap_or(ZSTD_LEVEL),
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            magic: MAGIC.into(),
            format: FORMAT,
            chunking: Chunking::default(),
            compress: Compress::default(),
            verify: false,
            container_size: 4 << 20,
            index_quota: None,
            index_memtable: None,
            zstd_level: None,
            remote: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("1m").unwrap(), 1 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        // Over 4 GiB, and a product past u64 (it used to wrap or panic).
        for bad in [
            "4G",
            "x",
            "",
            "K",
            "99999999999999999M",
            "18446744073709551615K",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn parses_chunking() {
        assert_eq!(
            "fixed:64K".parse::<Chunking>().unwrap(),
            Chunking::Fixed { size: 65536 }
        );
        assert_eq!(
            "cdc:16K/64K/256K".parse::<Chunking>().unwrap(),
            Chunking::Cdc {
                min: 16384,
                avg: 65536,
                max: 262144
            }
        );
        assert!("fixed:1000".parse::<Chunking>().is_err());
        assert!("cdc:64K/16K/256K".parse::<Chunking>().is_err());
        assert!("rabin:1".parse::<Chunking>().is_err());
        assert!("zip".parse::<Compress>().is_err());
        assert_eq!(parse_compress("zstd:6").unwrap(), (Compress::Zstd, Some(6)));
        assert_eq!(parse_compress("lz4").unwrap(), (Compress::Lz4, None));
        assert_eq!(parse_compress("auto").unwrap(), (Compress::Auto, None));
        assert_eq!(parse_compress("auto:6").unwrap(), (Compress::Auto, Some(6)));
        assert!(parse_compress("lz4:6").is_err());
        assert!(parse_compress("auto:20").is_err());
        assert!(parse_compress("brotli:3").is_err());
        assert!(parse_compress("zstd:0").is_err());
        assert!(parse_compress("zstd:20").is_err());
        assert!(parse_compress("lz4:3").is_err());
    }
}
