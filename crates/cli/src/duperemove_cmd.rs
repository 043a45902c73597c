//! `onecopy duperemove ARGS...`: duperemove's common command line, mapped
//! onto `onecopy dedupe` so that existing scripts work with one word
//! changed. The mapping is pure ([`to_dedupe_argv`]); the differences are
//! listed in the README.

use std::ffi::OsString;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{ArgAction, Args, Parser};

use crate::args::{Cli, Command};
use crate::exit;

/// Run with duperemove's options: -r, -d, -A, -h, -q, -v, -x, -b SIZE,
/// --hashfile, --dedupe-options, --exclude, --fdupes, --io-threads.
/// Without -d nothing is changed (a dry run).
#[derive(Debug, Args)]
#[command(disable_help_flag = true)]
pub struct DuperemoveArgs {
    /// Walk directories recursively (without it, only the files directly
    /// in a directory given are read).
    #[arg(short = 'r')]
    pub recurse: bool,
    /// Dedupe; without it, only report what would be shared.
    #[arg(short = 'd')]
    pub dedupe: bool,
    /// Open files read-only (onecopy always does; accepted for scripts).
    #[arg(short = 'A')]
    pub read_only: bool,
    /// Human-readable sizes (onecopy always prints them; accepted).
    #[arg(short = 'h')]
    pub human: bool,
    /// Quiet: print only errors.
    #[arg(short = 'q')]
    pub quiet: bool,
    /// Be verbose (list every error).
    #[arg(short = 'v')]
    pub verbose: bool,
    /// Stay on the filesystem of each path (without -x, like duperemove,
    /// other filesystems mounted below are walked too).
    #[arg(short = 'x')]
    pub one_filesystem: bool,
    /// Block size for matching (duperemove's default is 128K, onecopy's the
    /// filesystem block, 4K on most).
    #[arg(short = 'b', value_name = "SIZE")]
    pub block_size: Option<String>,
    /// onecopy's catalog file (not duperemove's SQLite format: an existing
    /// duperemove hashfile is renamed to FILE.duperemove and a catalog made
    /// in its place; any other file that is not a catalog is refused).
    #[arg(long, value_name = "FILE")]
    pub hashfile: Option<PathBuf>,
    /// Comma-separated [no]partial, [no]same, [no]fiemap, [no]block: all
    /// accepted; onecopy always matches partial extents and within a file.
    #[arg(long = "dedupe-options", value_name = "OPTIONS", value_delimiter = ',')]
    pub dedupe_options: Vec<String>,
    /// Skip paths matching PATTERN (repeatable).
    #[arg(long = "exclude", value_name = "PATTERN")]
    pub excludes: Vec<String>,
    /// Read fdupes/jdupes output (groups of paths separated by blank
    /// lines) on stdin and dedupe those files.
    #[arg(long)]
    pub fdupes: bool,
    /// Files read in parallel.
    #[arg(long = "io-threads", value_name = "N")]
    pub io_threads: Option<usize>,
    /// Accepted and ignored (onecopy's matching is not thread-bound).
    #[arg(long = "cpu-threads", value_name = "N")]
    pub cpu_threads: Option<usize>,
    /// Accepted and ignored (zero blocks are matched like any other).
    #[arg(long = "skip-zeroes")]
    pub skip_zeroes: bool,
    /// Accepted and ignored.
    #[arg(long = "lookup-extents", value_name = "yes|no")]
    pub lookup_extents: Option<String>,
    /// Print help.
    #[arg(long, action = ArgAction::Help)]
    pub help: Option<bool>,
    /// Files and directories; `-` reads paths from stdin, one per line.
    #[arg(value_name = "FILE")]
    pub files: Vec<PathBuf>,
}

const DEDUPE_OPTIONS: [&str; 4] = ["partial", "same", "fiemap", "block"];

pub fn run(a: DuperemoveArgs) -> anyhow::Result<u8> {
    let stdin = std::io::stdin().lock();
    let files = match gather_files(&a, stdin) {
        Ok(f) => f,
        Err(e) => {
            errln!("onecopy duperemove: {e:#}");
            return Ok(exit::USAGE);
        }
    };
    let argv = match to_dedupe_argv(&a, files) {
        Ok(v) => v,
        Err(e) => {
            errln!("onecopy duperemove: {e:#}");
            return Ok(exit::USAGE);
        }
    };
    let cli = match Cli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return Ok(exit::USAGE);
        }
    };
    // Only a command line that will run moves a file of the user's.
    if let Some(h) = a.hashfile.as_deref() {
        if let Err(e) = set_aside_duperemove_hashfile(h) {
            errln!("onecopy duperemove: {e:#}");
            return Ok(exit::FATAL);
        }
    }
    match cli.command {
        Command::Dedupe(d) => crate::dedupe_cmd::run(d),
        _ => unreachable!("to_dedupe_argv builds a dedupe command line"),
    }
}

/// duperemove's own hashfile at `path` (a script written for duperemove
/// names it) is renamed to `PATH.duperemove` (or `.duperemove.N`, never
/// over a file), and onecopy makes its catalog at `path`. Any other file
/// that is not a catalog stays untouched and is refused, as by `dedupe`.
fn set_aside_duperemove_hashfile(path: &Path) -> anyhow::Result<()> {
    if !onecopy_catalog::is_duperemove_hashfile(path) {
        return Ok(());
    }
    let aside = (0..100)
        .map(|n| {
            let mut name = path.as_os_str().to_owned();
            name.push(".duperemove");
            if n > 0 {
                name.push(format!(".{n}"));
            }
            PathBuf::from(name)
        })
        .find(|p| std::fs::symlink_metadata(p).is_err())
        .context("no free name to set duperemove's hashfile aside")?;
    rename_noreplace(path, &aside).with_context(|| format!("setting {} aside", path.display()))?;
    errln!(
        "onecopy duperemove: {} is duperemove's hashfile: kept as {}; onecopy keeps its own catalog there",
        path.display(),
        aside.display()
    );
    Ok(())
}

/// Renames `from` to `to`, failing if `to` exists.
fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    renameat_with(CWD, from, CWD, to, RenameFlags::NOREPLACE).map_err(Into::into)
}

/// The paths to dedupe: the FILE arguments (directories expanded one
/// level without -r), `-` and --fdupes read from `input`.
pub fn gather_files(a: &DuperemoveArgs, input: impl BufRead) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    if a.fdupes {
        out.extend(read_paths(input)?);
    } else {
        let mut input = Some(input);
        for f in &a.files {
            if f.as_os_str() == "-" {
                let i = input.take().context("'-' given twice")?;
                out.extend(read_paths(i)?);
            } else if !a.recurse && f.is_dir() {
                out.extend(files_in(f)?);
            } else {
                out.push(f.clone());
            }
        }
    }
    if out.is_empty() {
        bail!("no files to dedupe (give FILEs, '-' or --fdupes input)");
    }
    Ok(out)
}

/// Non-empty lines as paths, as bytes (a Linux name need not be UTF-8):
/// fdupes/jdupes groups are separated by blank lines, and onecopy finds
/// the identical ones among all of them itself.
fn read_paths(input: impl BufRead) -> anyhow::Result<Vec<PathBuf>> {
    use std::os::unix::ffi::OsStrExt;
    let mut out = Vec::new();
    for line in input.split(b'\n') {
        let mut line = line.context("reading paths from stdin")?;
        // A CRLF list, as lines() read it.
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        if !line.trim_ascii().is_empty() {
            out.push(PathBuf::from(std::ffi::OsStr::from_bytes(&line)));
        }
    }
    Ok(out)
}

/// The regular files directly in `dir` (duperemove without -r).
fn files_in(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e.with_context(|| format!("reading {}", dir.display()))?;
        if e.file_type().is_ok_and(|t| t.is_file()) {
            out.push(e.path());
        }
    }
    out.sort();
    Ok(out)
}

/// The `onecopy dedupe` command line equivalent to `a` over `files`.
pub fn to_dedupe_argv(a: &DuperemoveArgs, files: Vec<PathBuf>) -> anyhow::Result<Vec<OsString>> {
    for o in &a.dedupe_options {
        let base = o.strip_prefix("no").unwrap_or(o);
        if !DEDUPE_OPTIONS.contains(&base) {
            bail!("unknown --dedupe-options value {o:?} (known: [no]partial, [no]same, [no]fiemap, [no]block)");
        }
    }
    let mut v: Vec<OsString> = vec!["onecopy".into(), "dedupe".into()];
    // duperemove dedupes fdupes groups without -d.
    if !a.dedupe && !a.fdupes {
        v.push("--dry-run".into());
    }
    if !a.one_filesystem {
        v.push("--cross-filesystems".into());
    }
    if a.quiet {
        v.push("--quiet".into());
    }
    if a.verbose {
        v.push("--verbose".into());
    }
    if let Some(b) = &a.block_size {
        v.extend(["--block-size".into(), b.into()]);
    }
    if let Some(h) = &a.hashfile {
        v.extend(["--hashfile".into(), h.into()]);
    }
    if let Some(n) = a.io_threads {
        v.extend(["--threads".into(), n.to_string().into()]);
    }
    for e in &a.excludes {
        v.extend(["--exclude".into(), e.into()]);
    }
    v.push("--".into());
    v.extend(files.into_iter().map(OsString::from));
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Parser)]
    struct T {
        #[command(flatten)]
        a: DuperemoveArgs,
    }

    fn parse(args: &[&str]) -> DuperemoveArgs {
        T::try_parse_from(std::iter::once("duperemove").chain(args.iter().copied()))
            .unwrap()
            .a
    }

    fn argv(args: &[&str], files: &[&str]) -> Vec<String> {
        let a = parse(args);
        let files = files.iter().map(PathBuf::from).collect();
        to_dedupe_argv(&a, files)
            .unwrap()
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    /// Paths from stdin are bytes: a name that is not UTF-8 is read as
    /// it is (one such name stopped the whole run, exit 2).
    #[test]
    fn paths_from_stdin_need_not_be_utf8() {
        use std::os::unix::ffi::OsStrExt;
        let got = read_paths(&b"/t/caf\xe9\n\n/t/b\r\n  \n"[..]).unwrap();
        let names: Vec<&[u8]> = got.iter().map(|p| p.as_os_str().as_bytes()).collect();
        assert_eq!(names, [&b"/t/caf\xe9"[..], &b"/t/b"[..]]);
    }

    #[test]
    fn common_scripts_map_to_dedupe() {
        assert_eq!(
            argv(
                &["-dhr", "-x", "-b", "128k", "--hashfile=/h", "/d"],
                &["/d"]
            ),
            "onecopy dedupe --block-size 128k --hashfile /h -- /d"
                .split(' ')
                .collect::<Vec<_>>()
        );
        let v = argv(&["-r", "-q", "--exclude=*.tmp", "/d"], &["/d"]);
        assert!(v.contains(&"--dry-run".to_string()), "{v:?}");
        assert!(v.contains(&"--cross-filesystems".to_string()), "{v:?}");
        assert!(v.windows(2).any(|w| w == ["--exclude", "*.tmp"]), "{v:?}");
        let v = argv(&["--fdupes"], &["/a", "/b"]);
        assert!(
            !v.contains(&"--dry-run".to_string()),
            "fdupes mode dedupes: {v:?}"
        );
    }

    #[test]
    fn dedupe_options_are_checked() {
        let a = parse(&["-d", "--dedupe-options=partial,nosame", "f"]);
        assert!(to_dedupe_argv(&a, vec!["f".into()]).is_ok());
        let a = parse(&["-d", "--dedupe-options=partial,bogus", "f"]);
        assert!(to_dedupe_argv(&a, vec!["f".into()]).is_err());
    }

    #[test]
    fn every_mapped_command_line_parses() {
        let a = parse(&["-dr", "-b", "64K", "--io-threads=2", "-v", "/x"]);
        let v = to_dedupe_argv(&a, vec!["/x".into()]).unwrap();
        let cli = Cli::try_parse_from(v).unwrap();
        match cli.command {
            Command::Dedupe(d) => {
                assert_eq!(d.block_size, Some(64 << 10));
                assert_eq!(d.threads, 2);
                assert!(d.verbose && !d.dry_run);
            }
            c => panic!("{c:?}"),
        }
    }

    #[test]
    fn fdupes_groups_and_stdin_lists() {
        let a = parse(&["--fdupes"]);
        let input = "/a/1\n/a/2\n\n/b/1\n/b/2\n\n";
        let f = gather_files(&a, input.as_bytes()).unwrap();
        assert_eq!(f, ["/a/1", "/a/2", "/b/1", "/b/2"].map(PathBuf::from));
        assert!(gather_files(&a, "".as_bytes()).is_err());
        let a = parse(&["-d", "-"]);
        let f = gather_files(&a, "/x\n/y\n".as_bytes()).unwrap();
        assert_eq!(f, ["/x", "/y"].map(PathBuf::from));
    }

    #[test]
    fn without_r_a_directory_gives_its_files_only() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("f"), b"x").unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("sub/g"), b"x").unwrap();
        let dir = d.path().to_str().unwrap();
        let f = gather_files(&parse(&[dir]), "".as_bytes()).unwrap();
        assert_eq!(f, vec![d.path().join("f")]);
        let f = gather_files(&parse(&["-r", dir]), "".as_bytes()).unwrap();
        assert_eq!(f, vec![d.path().to_path_buf()]);
    }
}
