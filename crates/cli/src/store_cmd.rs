//! `onecopy store ...`: create and maintain inline dedupe stores. Thin
//! glue over `onecopy-store`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::exit;
use crate::snapshot_cmd::store_dir;
use onecopy_store::{Chunking, Store, StoreConfig, StoreError};

#[derive(Debug, Args)]
#[command(
    after_help = crate::exit::HELP
)]
pub struct StoreArgs {
    #[command(subcommand)]
    pub action: StoreAction,
}

#[derive(Debug, Subcommand)]
pub enum StoreAction {
    /// Create an empty store in DIR.
    Init(InitArgs),
    /// Delete the snapshots a retention policy does not keep (as `restic
    /// forget`); `store gc` then frees what only they held.
    Forget(crate::snapshot_cmd::ForgetArgs),
    /// Snapshots: create, list, delete.
    Snapshot {
        #[command(subcommand)]
        action: crate::snapshot_cmd::SnapshotAction,
    },
    /// Logical and stored bytes, dedupe and compression ratios, chunks.
    Stats {
        dir: PathBuf,
        /// Print JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Reclaim unreferenced chunks and compact half-empty containers. On a
    /// mounted store the mount process runs it (online, writers keep
    /// going) and this waits for its report.
    Gc { dir: PathBuf },
    /// Check the metadata's invariants; exit 1 if anything is wrong.
    Fsck {
        dir: PathBuf,
        /// Fix what can be fixed without inventing data (reference counts,
        /// link counts, dangling names, orphans).
        #[arg(long)]
        repair: bool,
    },
    /// Read every chunk and verify its checksum and BLAKE3; exit 1 if any
    /// is damaged.
    Scrub { dir: PathBuf },
    /// Copy each SRC (directory, file, symlink, FIFO, device) into the
    /// store as PATH/basename(SRC) without mounting it, preserving what
    /// `cp -a` does: data (holes stay holes), mode, owner, atime/mtime,
    /// symlinks, hardlinks among the imported files, xattrs. The store must
    /// not be mounted; an existing destination name is refused before
    /// anything is written. Sources that cannot be read (or change while
    /// read) are listed and left out (exit 1); the rest is imported.
    Import(ImportArgs),
    /// Drop index entries of chunks nobody references (gc reclaims their
    /// bytes); with --days, also the fingerprint index entries of chunks
    /// referenced once and indexed more than DAYS days ago (as ZFS
    /// ddtprune): they stay stored, but a new copy is no longer deduped.
    Prune {
        dir: PathBuf,
        /// Age in days (0: every chunk referenced once).
        #[arg(long, value_name = "DAYS")]
        days: Option<u64>,
    },
}

/// `store init`'s arguments.
#[derive(Debug, Args)]
pub struct InitArgs {
    pub dir: PathBuf,
    /// `fixed:SIZE` (default fixed:64K; for VM images and random writes)
    /// or `cdc:MIN/AVG/MAX` (FastCDC; for backups and archives).
    #[arg(long, default_value = "fixed:64K")]
    pub chunking: String,
    /// Chunk compression: auto (default: lz4 tests a sample of each
    /// chunk and the ones it shrinks are stored with zstd, so
    /// incompressible data costs a test and the rest zstd's size), auto:LEVEL, zstd
    /// or zstd:LEVEL (zstd for every chunk; level 1-19, default 3:
    /// higher is smaller and slower on new data), lz4 (fastest) or
    /// none. Chunks that do not shrink are stored raw.
    #[arg(long, default_value = "auto")]
    pub compress: String,
    /// Also compare bytes when a fingerprint is found (as ZFS
    /// dedup=verify); heals a damaged stored copy.
    #[arg(long)]
    pub verify: bool,
    /// Target size of a container file (default 4M; 32M for a remote
    /// store: fewer, larger objects in the bucket).
    #[arg(long)]
    pub container_size: Option<String>,
    /// Fingerprint index quota in entries (chunks): above it, new
    /// chunks are stored without dedupe (as ZFS dedup_table_quota);
    /// `store stats` counts them. Default: no quota.
    #[arg(long, value_name = "N")]
    pub index_quota: Option<u64>,
    /// Entries the fingerprint index buffers in RAM before writing a
    /// sorted run (about 80 bytes each; default 65536).
    #[arg(long, value_name = "N", hide = true)]
    pub index_memtable: Option<usize>,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

/// `store import`'s arguments.
#[derive(Debug, Args)]
pub struct ImportArgs {
    /// The store (not mounted).
    pub dir: PathBuf,
    /// What to copy in: directories (recursively), files, symlinks (not
    /// followed), FIFOs, device nodes.
    #[arg(required = true, value_name = "SRC")]
    pub srcs: Vec<PathBuf>,
    /// Directory inside the store to import into (created like
    /// `mkdir -p`).
    #[arg(long, value_name = "PATH", default_value = "/")]
    pub to: PathBuf,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Make a durable commit after this many bytes read (a crash loses
    /// at most about this much of the import).
    #[arg(long, value_name = "SIZE", default_value = "256M", hide = true)]
    pub commit_every: String,
    /// Worker threads (0: four per core, 4 to 16; at most 256).
    #[arg(long, value_name = "N", default_value_t = 0, hide = true,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(0..=crate::args::MAX_THREADS))]
    pub threads: usize,
}

/// Where a remote store lives (`store init --remote`).
#[derive(Debug, clap::Args)]
pub struct RemoteArgs {
    /// Keep the store in an S3-compatible bucket, `s3://BUCKET/PREFIX`
    /// (credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or
    /// ~/.aws/credentials); DIR is then its local cache. Metadata is
    /// pushed every 30 s while mounted and at unmount.
    #[arg(long, value_name = "URL")]
    remote: Option<String>,
    /// The S3 server, e.g. http://127.0.0.1:8333 (default: AWS).
    #[arg(long, value_name = "URL", requires = "remote")]
    endpoint: Option<String>,
    /// The bucket's region.
    #[arg(long, requires = "remote")]
    region: Option<String>,
    /// Bytes of containers DIR keeps once they are in the bucket (least
    /// recently used go first; a read of one gone fetches it back).
    #[arg(long, value_name = "SIZE", default_value = "4G", requires = "remote")]
    cache_size: String,
    /// Make DIR a new cache of the store already in the bucket (the
    /// machine that held the old cache is gone, or it is moving): the
    /// metadata comes from the bucket, and the old cache can no longer
    /// write. The other settings come from the bucket too.
    #[arg(long, requires = "remote")]
    recover: bool,
    /// With --recover: take the store even though another cache holds
    /// its lease (only when that cache's machine is gone: the other
    /// cache can no longer write, and loses what it did not push).
    #[arg(long, requires = "recover")]
    force: bool,
    /// The passphrase of the store's key, on the first line of FILE (or
    /// in the ONECOPY_PASSWORD environment variable). A remote store is
    /// encrypted with it (the key itself is random, kept in the bucket
    /// wrapped by the passphrase and in DIR).
    #[arg(long, value_name = "FILE", requires = "remote")]
    password_file: Option<PathBuf>,
    /// Keep the remote store unencrypted (its bucket's owner can read it).
    #[arg(long, requires = "remote", conflicts_with = "password_file")]
    no_encryption: bool,
}

impl RemoteArgs {
    fn spec(&self) -> Result<Option<onecopy_store::config::RemoteSpec>, StoreError> {
        let Some(url) = self.remote.clone() else {
            return Ok(None);
        };
        Ok(Some(onecopy_store::config::RemoteSpec {
            url,
            endpoint: self.endpoint.clone(),
            region: self.region.clone(),
            cache_size: Some(onecopy_store::config::parse_bytes(&self.cache_size)?),
            key: None,
            read_only: false,
            grace_secs: None,
            patience_secs: None,
        }))
    }

    /// The passphrase (see [`read_password`]); `None` with
    /// --no-encryption.
    fn password(&self) -> Result<Option<Vec<u8>>, StoreError> {
        if self.no_encryption {
            return Ok(None);
        }
        read_password(self.password_file.as_deref())
    }
}

/// The passphrase: the first line of `file`, else `ONECOPY_PASSWORD`;
/// `None` with neither.
pub fn read_password(file: Option<&Path>) -> Result<Option<Vec<u8>>, StoreError> {
    if let Some(f) = file {
        // A file that cannot be read is a bad option (exit 2), as any
        // path that cannot be opened.
        let text = std::fs::read(f)
            .map_err(|e| StoreError::BadOption(format!("--password-file {}: {e}", f.display())))?;
        let line = text.split(|&b| b == b'\n').next().unwrap_or_default();
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            return Err(StoreError::BadOption(format!(
                "{}: an empty password",
                f.display()
            )));
        }
        return Ok(Some(line.to_vec()));
    }
    Ok(std::env::var_os("ONECOPY_PASSWORD")
        .filter(|p| !p.is_empty())
        .map(|p| std::os::unix::ffi::OsStrExt::as_bytes(p.as_os_str()).to_vec()))
}

/// Maps a store error to its exit code.
pub fn error_code(e: &StoreError) -> u8 {
    match e {
        StoreError::NotAStore { .. }
        | StoreError::Version { .. }
        | StoreError::Exists { .. }
        | StoreError::DestExists { .. }
        | StoreError::NotEmptyDir { .. }
        | StoreError::NotADirectory { .. }
        | StoreError::BucketInUse { .. }
        | StoreError::WrongPassword
        | StoreError::PasswordNeeded
        | StoreError::NotEncrypted
        | StoreError::BadOption(_) => exit::USAGE,
        e if e.is_config() => exit::USAGE,
        StoreError::Locked { .. } | StoreError::Fenced { .. } => exit::REFUSED,
        _ => exit::FATAL,
    }
}

fn fail(e: StoreError) -> ExitCode {
    errln!("onecopy: {e}");
    ExitCode::from(error_code(&e))
}

pub fn run(args: StoreArgs) -> ExitCode {
    let target = target(&args.action).to_path_buf();
    match act(args.action) {
        Ok(c) => ExitCode::from(c),
        // SQLite's messages name no file: say which store's it is.
        Err(e @ StoreError::Db(_)) => {
            errln!("onecopy: {}: {e}", target.display());
            ExitCode::from(error_code(&e))
        }
        Err(e) => fail(e),
    }
}

/// The store (or, for the snapshot commands, the mount point) a command
/// names.
fn target(action: &StoreAction) -> &Path {
    use crate::snapshot_cmd::SnapshotAction as S;
    match action {
        StoreAction::Init(a) => &a.dir,
        StoreAction::Forget(a) => a.store(),
        StoreAction::Snapshot { action } => match action {
            S::Create { store, .. }
            | S::List { store, .. }
            | S::Delete { store, .. }
            | S::Restore { store, .. }
            | S::Diff { store, .. } => store,
        },
        StoreAction::Import(a) => &a.dir,
        StoreAction::Stats { dir, .. }
        | StoreAction::Gc { dir }
        | StoreAction::Fsck { dir, .. }
        | StoreAction::Scrub { dir }
        | StoreAction::Prune { dir, .. } => dir,
    }
}

/// One store command; its exit code (from `exit.rs`).
fn act(action: StoreAction) -> Result<u8, StoreError> {
    match action {
        StoreAction::Init(a) => init(a),
        // A mount point names its store, as for the snapshot commands.
        StoreAction::Stats { dir, json } => stats(&store_dir(&dir), json),
        StoreAction::Snapshot { action } => crate::snapshot_cmd::run(action),
        StoreAction::Forget(a) => crate::snapshot_cmd::forget(a),
        StoreAction::Gc { dir } => gc(&store_dir(&dir)),
        StoreAction::Fsck { dir, repair } => fsck(&store_dir(&dir), repair),
        StoreAction::Scrub { dir } => scrub(&store_dir(&dir)),
        StoreAction::Import(a) => import(a),
        StoreAction::Prune { dir, days } => prune(&store_dir(&dir), days),
    }
}

/// `store init`: a new store, or with `--recover` a cache rebuilt from
/// its bucket.
fn init(a: InitArgs) -> Result<u8, StoreError> {
    let remote = &a.remote;
    if remote.recover {
        return recover(&a.dir, remote);
    }
    let size = if remote.remote.is_some() { "32M" } else { "4M" };
    let mut cfg = init_config(
        &a.chunking,
        &a.compress,
        a.verify,
        a.container_size.as_deref().unwrap_or(size),
        a.index_quota,
        a.index_memtable,
    )?;
    cfg.remote = remote.spec()?;
    let pw = remote.password()?;
    if cfg.remote.is_some() && pw.is_none() && !remote.no_encryption {
        return Err(StoreError::BadOption(
            "a remote store is encrypted: give its password with --password-file FILE \
             or ONECOPY_PASSWORD (or choose --no-encryption)"
                .into(),
        ));
    }
    Store::init_with(&a.dir, &cfg, pw.as_deref())?;
    let what = format!("{}, {}", a.chunking, a.compress);
    match &cfg.remote {
        Some(r) => outln!("created store {} in {} ({what})", a.dir.display(), r.url),
        None => outln!("created store {} ({what})", a.dir.display()),
    }
    Ok(exit::OK)
}

/// `store init --recover`: a cache for `dir` from the bucket alone.
fn recover(dir: &Path, remote: &RemoteArgs) -> Result<u8, StoreError> {
    let spec = remote.spec()?.expect("--recover requires --remote");
    let pw = remote.password()?;
    let m = onecopy_store::bucket::recover(dir, &spec, pw.as_deref(), remote.force)?;
    outln!(
        "recovered store {} from {} (generation {}, {} metadata segments)",
        dir.display(),
        spec.url,
        m.generation,
        m.segments.len()
    );
    Ok(exit::OK)
}

/// `store import`.
fn import(a: ImportArgs) -> Result<u8, StoreError> {
    use std::os::unix::ffi::OsStrExt;
    let opts = onecopy_store::ImportOptions {
        to: a.to.as_os_str().as_bytes().to_vec(),
        commit_every: onecopy_store::config::parse_size(&a.commit_every)? as u64,
        threads: a.threads,
    };
    Ok(crate::import_cmd::run(&a.dir, &a.srcs, &opts, a.json))
}

/// `--container-size` bounds: a container smaller than a few records
/// only makes files (or objects) by the thousand, and one is read or
/// fetched whole.
const CONTAINER_MIN: u64 = 64 << 10;
const CONTAINER_MAX: u64 = 1 << 30;

/// The settings `store init` was given.
fn init_config(
    chunking: &str,
    compress: &str,
    verify: bool,
    container_size: &str,
    index_quota: Option<u64>,
    index_memtable: Option<usize>,
) -> Result<StoreConfig, StoreError> {
    if index_memtable == Some(0) {
        return Err(StoreError::BadOption(
            "--index-memtable must be at least 1".into(),
        ));
    }
    let (codec, zstd_level) = onecopy_store::config::parse_compress(compress)?;
    let container_size = onecopy_store::config::parse_size(container_size)? as u64;
    if !(CONTAINER_MIN..=CONTAINER_MAX).contains(&container_size) {
        return Err(StoreError::BadOption(format!(
            "--container-size must be between {}K and {}G",
            CONTAINER_MIN >> 10,
            CONTAINER_MAX >> 30
        )));
    }
    Ok(StoreConfig {
        chunking: chunking.parse::<Chunking>()?,
        compress: codec,
        zstd_level,
        verify,
        container_size,
        index_quota,
        index_memtable,
        ..StoreConfig::default()
    })
}

fn stats(dir: &Path, json: bool) -> Result<u8, StoreError> {
    let s = Store::stats_readonly(dir)?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&s).expect("serializes"));
    } else {
        print_stats(&s);
    }
    Ok(exit::OK)
}

/// gc in this process, or by the mount serving the store.
fn gc(dir: &Path) -> Result<u8, StoreError> {
    let r = match crate::control::open_store(dir) {
        Ok(s) => s.gc()?,
        Err(StoreError::Locked { path }) => {
            crate::control::request_gc(dir).ok_or(StoreError::Locked { path })??
        }
        Err(e) => return Err(e),
    };
    outln!(
        "dropped {} chunks, deleted {} and compacted {} containers, freed {} bytes",
        r.chunks_dropped,
        r.containers_deleted,
        r.containers_compacted,
        r.bytes_freed
    );
    for why in &r.containers_damaged {
        errln!(
            "onecopy: not compacted: {why}; `onecopy store fsck --repair` names the files it costs"
        );
    }
    if let Some(why) = &r.compaction_stopped {
        errln!("onecopy: compaction stopped: {why}");
        return Ok(exit::PARTIAL);
    }
    Ok(if r.containers_damaged.is_empty() {
        exit::OK
    } else {
        exit::PARTIAL
    })
}

fn fsck(dir: &Path, repair: bool) -> Result<u8, StoreError> {
    let r = crate::control::open_store(dir)?.fsck(repair)?;
    for p in &r.problems {
        outln!("{p}");
    }
    outln!("{} problems, {} repaired", r.problems.len(), r.repaired);
    Ok(if r.problems.len() as u64 > r.repaired {
        exit::PARTIAL
    } else {
        exit::OK
    })
}

fn scrub(dir: &Path) -> Result<u8, StoreError> {
    let r = crate::control::open_store(dir)?.scrub()?;
    for d in r.damaged.iter().chain(&r.index_problems) {
        outln!("{d}");
    }
    out!(
        "checked {} chunks ({} bytes), {} damaged",
        r.chunks_checked,
        r.bytes_checked,
        r.damaged.len()
    );
    if !r.index_problems.is_empty() {
        out!(
            "; fingerprint index: {} problems (stored data is not affected; the next open rebuilds it)",
            r.index_problems.len()
        );
    }
    outln!();
    Ok(if r.damaged.is_empty() && r.index_problems.is_empty() {
        exit::OK
    } else {
        exit::PARTIAL
    })
}

fn prune(dir: &Path, days: Option<u64>) -> Result<u8, StoreError> {
    let s = crate::control::open_store(dir)?;
    let n = s.prune()?;
    outln!("pruned {n} unreferenced index entries");
    if let Some(days) = days {
        let age = std::time::Duration::from_secs(days.saturating_mul(86_400));
        let n = s.prune_index(age)?;
        outln!("pruned {n} entries of chunks referenced once, older than {days} days");
    }
    Ok(exit::OK)
}

fn print_stats(s: &onecopy_store::Stats) {
    outln!("files:              {}", s.files);
    outln!("directories:        {}", s.directories);
    outln!("logical bytes:      {}", s.logical_bytes);
    outln!("referenced bytes:   {}", s.referenced_bytes);
    outln!("unique bytes:       {}", s.unique_bytes);
    outln!("stored bytes:       {}", s.stored_bytes);
    outln!("container bytes:    {}", s.container_bytes);
    outln!("dedupe ratio:       {:.2}", s.dedupe_ratio);
    outln!("compression ratio:  {:.2}", s.compression_ratio);
    outln!(
        "chunks:             {} ({} unreferenced)",
        s.chunks,
        s.unreferenced_chunks
    );
    outln!(
        "index entries:      {} ({:.1} bytes of RAM each)",
        s.index_entries,
        s.index_ram_bytes_per_entry
    );
    match s.index_quota {
        Some(q) => outln!(
            "index quota:        {q} entries ({} chunks stored without dedupe over it)",
            s.index_quota_skipped
        ),
        None => outln!("index quota:        none"),
    }
    outln!("chunks not indexed: {}", s.unindexed_chunks);
    outln!("written new:        {}", s.written_new_bytes);
    outln!("written duplicate:  {}", s.written_duplicate_bytes);
    outln!("written zero:       {}", s.written_zero_bytes);
}
