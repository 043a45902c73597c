//! `onecopy-workload`: deterministic test and benchmark data sets for
//! onecopy (see the "Workloads every benchmark should cover" section of the
//! product brief).
//!
//! ```text
//! onecopy-workload small   --dir D [--files 100000]
//! onecopy-workload dupes   --dir D [--size 2G]
//! onecopy-workload near    --dir D [--size 1G]
//! onecopy-workload shifted --dir D [--size 1G] [--align 4096]
//! onecopy-workload many    --dir D [--files 1000000]
//! onecopy-workload chains  --dir D [--size 432M] [--chain 2] [--fanout 1]
//! onecopy-workload pieces  --dir D [--files 300]
//! ```
//!
//! The same `--seed` always produces byte-identical trees. A one-line JSON
//! summary goes to stdout.

mod gen;
mod size;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    /// The seed's tree: dd/D/F holding `printf "%*s" 1024 F`, 100 dirs x
    /// 1000 files (`--files` scales it; 1000 files per dir).
    Small,
    /// Large random files (8 MiB - 256 MiB), each content present 2 or 3
    /// times as plain byte copies, in a few directories. Total `--size`
    /// (default 2 GiB).
    Dupes,
    /// Base random files with 1-3 variants each that differ by 32 bytes at
    /// a random offset (nix-store builds differing in an embedded path).
    /// Total `--size` (default 1 GiB).
    Near,
    /// The same content behind random-length prefixes (multiples of
    /// `--align`, default 4096) in 3-5 files per group. Total `--size`
    /// (default 1 GiB).
    Shifted,
    /// `--files` (default 1,000,000) small and medium files (mostly
    /// 0-16 KiB, a few up to 1 MiB) in a deep tree (depth ~6-10, fan-out
    /// ~10); about 30% of files are copies of others.
    Many,
    /// Version chains: an original of 24 MiB and successors, each its
    /// predecessor plus one 32-byte change, `--chain` deep with `--fanout`
    /// successors per version. Total `--size` (default 432 MiB: six
    /// chains orig -> v0 -> v1).
    Chains,
    /// `--files` (default 300) files of 1 MiB assembled from a shared pool
    /// of 8 KiB random pieces at 4 KiB-aligned offsets (~70% duplicate at
    /// 4 KiB).
    Pieces,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Small => "small",
            Kind::Dupes => "dupes",
            Kind::Near => "near",
            Kind::Shifted => "shifted",
            Kind::Many => "many",
            Kind::Chains => "chains",
            Kind::Pieces => "pieces",
        }
    }
}

/// Generate a deterministic dedupe workload.
#[derive(Debug, Parser)]
#[command(name = "onecopy-workload", version, about)]
pub struct Cli {
    /// Which workload to generate.
    #[arg(value_enum)]
    pub kind: Kind,
    /// Directory to fill (created if missing; existing files of the same
    /// names are overwritten).
    #[arg(long)]
    pub dir: PathBuf,
    /// Total bytes for dupes/near/shifted, e.g. 2G, 512MiB, 1073741824.
    #[arg(long, value_parser = size::parse_size)]
    pub size: Option<u64>,
    /// Number of files for small/many.
    #[arg(long)]
    pub files: Option<u64>,
    /// Seed: the same seed gives byte-identical trees.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Prefix granularity for `shifted`, in bytes (4096 = block-aligned
    /// shifts; 1 = arbitrary shifts, for content-defined chunking).
    #[arg(long, default_value_t = 4096)]
    pub align: u64,
    /// Successors after the original in each `chains` group.
    #[arg(long, default_value_t = 2)]
    pub chain: u32,
    /// Successors of each version in `chains`.
    #[arg(long, default_value_t = 1)]
    pub fanout: u32,
    /// Writer threads for small/many (default: number of CPUs). Large-file
    /// workloads are written by one thread so the extent layout is
    /// reproducible.
    #[arg(long)]
    pub threads: Option<usize>,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(t) = cli.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t.max(1))
            .build_global()
            .context("thread pool")?;
    }
    if cli.align == 0 {
        bail!("--align must be at least 1");
    }
    std::fs::create_dir_all(&cli.dir).with_context(|| format!("creating {}", cli.dir.display()))?;
    let start = Instant::now();
    let s = match cli.kind {
        Kind::Small => gen::small(&cli.dir, cli.files.unwrap_or(100_000))?,
        Kind::Dupes => gen::dupes(&cli.dir, cli.size.unwrap_or(2 << 30), cli.seed)?,
        Kind::Near => gen::near(&cli.dir, cli.size.unwrap_or(1 << 30), cli.seed)?,
        Kind::Shifted => gen::shifted(&cli.dir, cli.size.unwrap_or(1 << 30), cli.seed, cli.align)?,
        Kind::Many => gen::many(&cli.dir, cli.files.unwrap_or(1_000_000), cli.seed)?,
        Kind::Chains => gen::chains(
            &cli.dir,
            cli.size.unwrap_or(432 << 20),
            cli.seed,
            cli.chain,
            cli.fanout,
        )?,
        Kind::Pieces => gen::pieces(&cli.dir, cli.files.unwrap_or(300), cli.seed)?,
    };
    let secs = start.elapsed().as_secs_f64();
    let summary = serde_json::json!({
        "workload": cli.kind.name(),
        "dir": cli.dir,
        "seed": cli.seed,
        "files": s.files,
        "dirs": s.dirs,
        "bytes": s.bytes,
        "duplicate_bytes": s.duplicate_bytes,
        "duplicate_note": s.note,
        "seconds": (secs * 1000.0).round() / 1000.0,
    });
    println!("{summary}");
    Ok(())
}
