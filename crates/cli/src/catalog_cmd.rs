//! `onecopy catalog`: statistics and forgetting paths.

use std::path::{Path, PathBuf};

use anyhow::Result;
use indicatif::HumanBytes;
use onecopy_catalog::{place, Catalog};

use crate::args::{CatalogAction, CatalogArgs};
use crate::exit;

fn catalogs(a: &CatalogArgs) -> Vec<PathBuf> {
    if let Some(p) = &a.hashfile {
        return vec![p.clone()];
    }
    place::catalogs_in(&place::default_dir())
}

pub fn run(a: CatalogArgs) -> Result<u8> {
    let paths = catalogs(&a);
    let mut failed = false;
    let mut out = Vec::new();
    for p in &paths {
        if !p.exists() {
            errln!("onecopy: {}: no such catalog", p.display());
            failed = true;
            continue;
        }
        // Open with whatever block size it has: stats and forget do not
        // depend on it, and opening never rewrites records.
        let cat = match Catalog::open_existing(p) {
            Ok(c) => c,
            // A file the user named that is not a catalog: refused, as
            // `dedupe --hashfile` refuses it.
            Err(e @ onecopy_catalog::CatalogError::NotACatalog { .. }) if a.hashfile.is_some() => {
                errln!("onecopy: {e}");
                return Ok(exit::USAGE);
            }
            Err(e) => {
                errln!("onecopy: {e}");
                failed = true;
                continue;
            }
        };
        let (value, ok) = act(cat, &a.action, p)?;
        out.extend(value);
        failed |= !ok;
    }
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&out)?);
    } else if paths.is_empty() {
        outln!("No catalogs in {}", place::default_dir().display());
    } else {
        out.iter().for_each(print_text);
    }
    Ok(if failed { exit::PARTIAL } else { exit::OK })
}

/// Carries out `action` on the catalog `cat` at `p`: what to report (if
/// anything), and whether it all went well (errors are printed).
fn act(
    mut cat: Catalog,
    action: &CatalogAction,
    p: &Path,
) -> Result<(Option<serde_json::Value>, bool)> {
    match action {
        CatalogAction::Stats => match cat.stats() {
            Ok(s) => Ok((Some(serde_json::to_value(&s)?), true)),
            Err(e) => {
                errln!("onecopy: {e}");
                Ok((None, false))
            }
        },
        CatalogAction::Forget { paths: forget } => {
            let mut ok = true;
            let mut total = 0;
            for f in forget {
                let abs = resolved(f);
                match cat.forget(&abs) {
                    Ok(n) => total += n,
                    Err(e) => {
                        errln!("onecopy: {e}");
                        ok = false;
                    }
                }
            }
            let v = serde_json::json!({ "path": p.display().to_string(), "forgotten": total });
            Ok((Some(v), ok))
        }
    }
}

/// `path` as the catalog keeps paths (absolute, symlinks and `..`
/// resolved); a deleted file's through its directory, which may remain.
fn resolved(path: &std::path::Path) -> std::path::PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    match (abs.parent(), abs.file_name()) {
        (Some(dir), Some(name)) => std::fs::canonicalize(dir).map_or(abs.clone(), |d| d.join(name)),
        _ => abs,
    }
}

/// One catalog's line of text output.
fn print_text(v: &serde_json::Value) {
    if let Some(n) = v.get("forgotten") {
        outln!("{}: forgot {} files", v["path"].as_str().unwrap_or(""), n);
        return;
    }
    outln!(
        "{}: {} files, {} blocks, {} of file data; {} on disk; {} runs, last at {}",
        v["path"].as_str().unwrap_or(""),
        v["files"],
        v["blocks"],
        HumanBytes(v["bytes"].as_u64().unwrap_or(0)),
        HumanBytes(v["file_size_on_disk"].as_u64().unwrap_or(0)),
        v["runs"],
        v["last_run_unix"]
            .as_i64()
            .map(|t| format!("unix time {t}"))
            .unwrap_or_else(|| "never".into()),
    );
}
