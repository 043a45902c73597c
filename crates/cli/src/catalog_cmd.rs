//! `onecopy catalog`: statistics and forgetting paths.

use std::path::PathBuf;

use anyhow::Result;
use indicatif::HumanBytes;
use onecopy_catalog::Catalog;

use crate::args::{CatalogAction, CatalogArgs};
use crate::exit;

fn catalogs(a: &CatalogArgs) -> Vec<PathBuf> {
    if let Some(p) = &a.hashfile {
        return vec![p.clone()];
    }
    let dir = crate::dedupe_cmd::default_catalog_dir();
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "sqlite"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

pub fn run(a: CatalogArgs) -> Result<u8> {
    let paths = catalogs(&a);
    let mut failed = false;
    let mut out = Vec::new();
    for p in &paths {
        if !p.exists() {
            eprintln!("onecopy: {}: no such catalog", p.display());
            failed = true;
            continue;
        }
        // Open with whatever block size it has: stats and forget do not
        // depend on it, and opening never rewrites records.
        let cat = match Catalog::open_existing(p) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("onecopy: {e}");
                failed = true;
                continue;
            }
        };
        match &a.action {
            CatalogAction::Stats => match cat.stats() {
                Ok(s) => out.push(serde_json::to_value(&s)?),
                Err(e) => {
                    eprintln!("onecopy: {e}");
                    failed = true;
                }
            },
            CatalogAction::Forget { paths: forget } => {
                let mut cat = cat;
                let mut total = 0;
                for f in forget {
                    let abs = std::fs::canonicalize(f).unwrap_or_else(|_| f.clone());
                    match cat.forget(&abs) {
                        Ok(n) => total += n,
                        Err(e) => {
                            eprintln!("onecopy: {e}");
                            failed = true;
                        }
                    }
                }
                out.push(
                    serde_json::json!({ "path": p.display().to_string(), "forgotten": total }),
                );
            }
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else if paths.is_empty() {
        println!(
            "No catalogs in {}",
            crate::dedupe_cmd::default_catalog_dir().display()
        );
    } else {
        for v in &out {
            if let Some(n) = v.get("forgotten") {
                println!("{}: forgot {} files", v["path"].as_str().unwrap_or(""), n);
            } else {
                println!(
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
        }
    }
    Ok(if failed { exit::PARTIAL } else { exit::OK })
}
