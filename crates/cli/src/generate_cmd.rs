//! `onecopy generate`: writes the man pages and shell completions from the
//! clap definitions, so they never drift from `--help`. Hidden; used by
//! packaging (see the `.deb` metadata in Cargo.toml and scripts/deb.sh).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, CommandFactory, ValueEnum};
use clap_complete::Shell;

use crate::args::Cli;
use crate::exit;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// What to write.
    #[arg(value_enum)]
    pub what: Artifact,
    /// Directory to write into (created if missing).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Artifact {
    /// One man page per command and subcommand (onecopy.1, onecopy-dedupe.1, ...).
    Man,
    /// Completions for bash (onecopy.bash), zsh (_onecopy) and fish (onecopy.fish).
    Completions,
}

const SHELLS: [Shell; 3] = [Shell::Bash, Shell::Zsh, Shell::Fish];

pub fn run(a: GenerateArgs) -> anyhow::Result<u8> {
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    match a.what {
        Artifact::Man => clap_mangen::generate_to(Cli::command(), &a.dir)
            .with_context(|| format!("writing man pages to {}", a.dir.display()))?,
        Artifact::Completions => {
            let mut cmd = Cli::command();
            for shell in SHELLS {
                clap_complete::generate_to(shell, &mut cmd, "onecopy", &a.dir)
                    .with_context(|| format!("writing {shell} completions"))?;
            }
        }
    }
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `onecopy-dedupe`, `onecopy-catalog-stats`, ... for every visible
    /// command, so a new subcommand is covered without editing this test.
    fn page_names(cmd: &clap::Command, prefix: &str, out: &mut Vec<String>) {
        let name = if prefix.is_empty() {
            cmd.get_name().to_string()
        } else {
            format!("{prefix}-{}", cmd.get_name())
        };
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            page_names(sub, &name, out);
        }
        out.push(name);
    }

    fn generate(what: Artifact) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let a = GenerateArgs {
            what,
            dir: dir.path().join("out"),
        };
        assert_eq!(run(a).unwrap(), exit::OK);
        dir
    }

    #[test]
    fn a_man_page_for_every_command() {
        let dir = generate(Artifact::Man);
        let mut names = Vec::new();
        page_names(&Cli::command(), "", &mut names);
        assert!(names.contains(&"onecopy-dedupe".to_string()), "{names:?}");
        for n in &names {
            let page = std::fs::read_to_string(dir.path().join("out").join(format!("{n}.1")))
                .unwrap_or_else(|e| panic!("no man page {n}.1: {e}"));
            assert!(
                page.starts_with(".ie") || page.contains(".TH"),
                "{n}.1: {page}"
            );
        }
        let dedupe = std::fs::read_to_string(dir.path().join("out/onecopy-dedupe.1")).unwrap();
        assert!(dedupe.contains("block\\-size"), "{dedupe}");
        assert!(!dir.path().join("out/onecopy-generate.1").exists());
    }

    #[test]
    fn completions_for_three_shells() {
        let dir = generate(Artifact::Completions);
        for f in ["onecopy.bash", "_onecopy", "onecopy.fish"] {
            let text = std::fs::read_to_string(dir.path().join("out").join(f))
                .unwrap_or_else(|e| panic!("no {f}: {e}"));
            assert!(text.contains("dedupe"), "{f} lacks the dedupe subcommand");
            assert!(text.contains("block-size"), "{f} lacks --block-size");
        }
        let bash = std::process::Command::new("bash")
            .arg("-n")
            .arg(dir.path().join("out/onecopy.bash"))
            .status()
            .unwrap();
        assert!(bash.success(), "bash -n rejects the bash completion");
    }
}
