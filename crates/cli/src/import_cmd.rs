//! `onecopy store import`: parses, draws the progress bar, prints the
//! summary. The rules (what is preserved, what is refused, the crash
//! model) are in `onecopy_store::import`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use indicatif::HumanBytes;
use onecopy_store::{ImportError, ImportOptions, ImportProgress, ImportReport, StoreError};

use crate::exit;
use crate::progress::Bars;
use crate::store_cmd::error_code;

const TEMPLATE: &str =
    "{prefix}: [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta} {msg}";

/// Runs the import; returns the exit code.
pub fn run(dir: &Path, srcs: &[PathBuf], opts: &ImportOptions, json: bool) -> u8 {
    let store = match crate::control::open_store(dir) {
        Ok(s) => s,
        Err(e @ StoreError::Locked { .. }) => {
            errln!("onecopy: {e}; unmount it to import, or copy into the mount");
            return exit::REFUSED;
        }
        Err(e) => {
            errln!("onecopy: {e}");
            return error_code(&e);
        }
    };
    let progress = Arc::new(ImportProgress::default());
    let draw = std::io::stderr().is_terminal() && !json;
    let bars = Bars::new(draw);
    let live = if draw {
        let (entries, total) = onecopy_store::import_measure(srcs);
        let p = progress.clone();
        bars.show(Some(total), TEMPLATE, "importing", move |pb| {
            pb.set_position(p.bytes.load(Ordering::Relaxed));
            pb.set_message(format!(
                "{}/{entries} entries",
                p.entries.load(Ordering::Relaxed)
            ));
        })
    } else {
        None
    };
    let start = Instant::now();
    let r = store.import(srcs, opts, &progress);
    bars.finish(live);
    let secs = start.elapsed().as_secs_f64();
    match r {
        Ok(rep) => {
            report(&rep, secs, json);
            if rep.failed.is_empty() {
                exit::OK
            } else {
                exit::PARTIAL
            }
        }
        Err(e) => fatal(&e),
    }
}

fn fatal(e: &ImportError) -> u8 {
    match e {
        ImportError::Exists { .. }
        | ImportError::NotDir { .. }
        | ImportError::BadSource { .. }
        | ImportError::Source { .. } => {
            errln!("onecopy: {e}");
            exit::USAGE
        }
        _ if e.is_no_space() => {
            errln!(
                "onecopy: {e}; import stopped: the store keeps what was committed before \
                 (consistent: `store fsck` finds nothing); `store gc` gives back the room \
                 the rest took; import the rest under a new name"
            );
            exit::FATAL
        }
        _ => {
            errln!("onecopy: {e}; import stopped: the store keeps what was committed before");
            exit::FATAL
        }
    }
}

fn report(r: &ImportReport, secs: f64, json: bool) {
    for n in &r.notes {
        errln!("onecopy: note: {n}");
    }
    for e in &r.failed {
        errln!("onecopy: not imported: {e}");
    }
    let rate = r.bytes as f64 / secs.max(1e-9);
    if json {
        let v = serde_json::json!({
            "files": r.files,
            "directories": r.directories,
            "symlinks": r.symlinks,
            "hardlinks": r.hardlinks,
            "specials": r.specials,
            "bytes": r.bytes,
            "new_bytes": r.new_bytes,
            "duplicate_bytes": r.dup_bytes,
            "zero_bytes": r.zero_bytes,
            "seconds": secs,
            "failed": r.failed.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
            "notes": r.notes,
        });
        outln!("{}", serde_json::to_string_pretty(&v).expect("serializes"));
        return;
    }
    outln!(
        "imported {} files ({}), {} directories, {} symlinks, {} hardlinks, {} special files \
         in {:.1} s ({}/s)",
        r.files,
        HumanBytes(r.bytes),
        r.directories,
        r.symlinks,
        r.hardlinks,
        r.specials,
        secs,
        HumanBytes(rate as u64)
    );
    outln!(
        "new {}, duplicate {}, zero (holes) {}",
        HumanBytes(r.new_bytes),
        HumanBytes(r.dup_bytes),
        HumanBytes(r.zero_bytes)
    );
    if !r.failed.is_empty() {
        outln!("{} entries not imported (listed above)", r.failed.len());
    }
}
