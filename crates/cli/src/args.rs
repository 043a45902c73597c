use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Most threads `-j` asks for: more only add threads waiting on the same
/// disks (100,000 made a run spin for minutes, deaf to SIGTERM).
pub const MAX_THREADS: u64 = 256;

/// Find identical data on btrfs and XFS and share it with the kernel's
/// FIDEDUPERANGE, which compares the bytes itself: no file ever reads
/// differently.
#[derive(Debug, Parser)]
#[command(name = "onecopy", version, propagate_version = true)]
#[command(
    after_help = crate::exit::HELP
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Find identical data under PATHs and share it (out-of-band dedupe).
    Dedupe(DedupeArgs),
    /// Inspect or prune the catalogs that make later runs incremental.
    Catalog(CatalogArgs),
    /// Create, inspect and maintain inline dedupe stores.
    Store(crate::store_cmd::StoreArgs),
    /// Mount a store as a filesystem (FUSE); unmount with `fusermount3 -u`
    /// or `umount`.
    Mount(crate::mount_cmd::MountArgs),
    /// Keep PATHs deduped: dedupe new and changed files seconds after
    /// their last write, until SIGTERM.
    Watch(crate::watch_cmd::WatchArgs),
    /// duperemove's command line (-r -d -h -q -b --hashfile --fdupes ...),
    /// run as `onecopy dedupe`; see the README for the differences.
    Duperemove(crate::duperemove_cmd::DuperemoveArgs),
    /// Write man pages or shell completions into DIR (for packagers).
    #[command(hide = true)]
    Generate(crate::generate_cmd::GenerateArgs),
}

#[derive(Debug, Args)]
pub struct CatalogArgs {
    #[command(subcommand)]
    pub action: CatalogAction,

    /// Work on this catalog file instead of every catalog in the default
    /// directory.
    #[arg(long, value_name = "PATH", global = true)]
    pub hashfile: Option<PathBuf>,

    /// Print JSON on stdout.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum CatalogAction {
    /// Files, blocks, bytes, size on disk and last run of each catalog.
    Stats,
    /// Forget every file at or below each PATH (it is read again next time).
    Forget {
        #[arg(required = true, value_name = "PATH")]
        paths: Vec<PathBuf>,
    },
}

#[derive(Debug, Args)]
pub struct DedupeArgs {
    /// Files and directories to dedupe (directories are walked recursively).
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<PathBuf>,

    /// Decide and report what would be shared and freed, touching nothing.
    #[arg(short = 'n', long)]
    pub dry_run: bool,

    /// Print a machine-readable JSON summary on stdout.
    #[arg(long)]
    pub json: bool,

    /// Block size for matching (a multiple of the filesystem block size),
    /// e.g. 4K, 64K, 1M [default: the filesystem block size, 4K on most].
    /// Larger finds fewer partial duplicates and uses less memory.
    #[arg(short = 'b', long, value_name = "SIZE", value_parser = parse_size)]
    pub block_size: Option<u64>,

    /// RAM for the table of block fingerprints. A table that would not fit
    /// is kept on disk instead, as a temporary index in the cache
    /// directory (about 4 bytes of RAM per block on top), with the same
    /// results.
    #[arg(long, value_name = "SIZE", default_value = "2M", value_parser = parse_size)]
    pub memory: u64,

    /// Skip files smaller than SIZE. Empty files, and on btrfs files of at
    /// most 2048 bytes (stored inline in metadata), are always skipped.
    #[arg(long, value_name = "SIZE", default_value = "0", value_parser = parse_size)]
    pub min_size: u64,

    /// Skip entries whose path or name matches GLOB (repeatable); a
    /// matching directory is not entered.
    #[arg(short = 'e', long = "exclude", value_name = "GLOB")]
    pub excludes: Vec<String>,

    /// Descend into other filesystems mounted below the roots.
    #[arg(long)]
    pub cross_filesystems: bool,

    /// Do not read or dedupe files in btrfs snapshots (subvolumes made by
    /// `btrfs subvolume snapshot`, read-only or not). Without it, read-only
    /// snapshots are read as sources only.
    #[arg(long)]
    pub exclude_snapshots: bool,

    /// On btrfs, copy at most SIZE per run to release extents that dedupe
    /// left partly referenced ("re-homing"): the live remainder of such an
    /// extent is copied once into an unnamed temporary file and shared back
    /// into every file that references it with FIDEDUPERANGE, when that
    /// releases more than it writes. 0 disables.
    #[arg(long, value_name = "SIZE", default_value = "4G", value_parser = parse_size)]
    pub rehome_max_write: u64,

    /// Use this catalog file instead of the default one per filesystem
    /// (under /var/cache/onecopy for root, else $XDG_CACHE_HOME/onecopy).
    #[arg(long, value_name = "PATH", conflicts_with = "no_catalog")]
    pub hashfile: Option<PathBuf>,

    /// Read every file and keep nothing: no catalog is read or written.
    #[arg(long)]
    pub no_catalog: bool,

    /// Only roots that are regular files or directories (not symbolic
    /// links) lying under these directories; others are skipped, not
    /// refused (`watch` passes the files its events named).
    #[arg(long, value_name = "DIR", hide = true)]
    pub within: Vec<PathBuf>,

    /// Settled files looked at again each run: about one in N (0: none, 1:
    /// all; tests choose).
    #[arg(long, value_name = "N", default_value_t = onecopy_dedupe::Recheck::EVERY, hide = true)]
    pub recheck_every: u64,

    /// Files read in parallel (1 to 256).
    #[arg(short = 'j', long, value_name = "N", default_value_t = 4,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_THREADS))]
    pub threads: usize,

    /// Print nothing but errors (and the JSON summary with --json).
    #[arg(short, long)]
    pub quiet: bool,

    /// List each error instead of only the first few.
    #[arg(short, long)]
    pub verbose: bool,
}

impl DedupeArgs {
    /// The matching block size (resolved from the filesystems when not
    /// given, before anything runs).
    pub fn block(&self) -> u64 {
        self.block_size.unwrap_or(DEFAULT_BLOCK)
    }
}

/// The block size when neither `-b` nor a filesystem block larger than it
/// says otherwise.
pub const DEFAULT_BLOCK: u64 = 4096;

/// Parses sizes like `4096`, `4K`, `64KiB`, `1M`, `2G`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("not a size: {s:?}"))?;
    let mul: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("unknown size unit in {s:?} (use K, M, G or T)")),
    };
    n.checked_mul(mul)
        .ok_or_else(|| format!("size too large: {s:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert!(parse_size("x").is_err());
        assert!(parse_size("1Q").is_err());
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
