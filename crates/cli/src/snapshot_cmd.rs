//! `onecopy store snapshot ...`: make, list and delete snapshots of a
//! store, by its directory or a mount point of it. When the store is
//! mounted the mount does it (over the control channel, after the kernel
//! has handed it what programs wrote); otherwise this process opens it.

use std::path::{Path, PathBuf};

use clap::Subcommand;

use crate::control::{self, Request};
use crate::exit;
use onecopy_store::{Change, ForgetReport, Keep, Snapshot, SnapshotInfo, Store, StoreError};

#[derive(Debug, Subcommand)]
pub enum SnapshotAction {
    /// Snapshot the whole store now (constant time). Everything written
    /// to the mount before the command is in it; nothing after.
    Create {
        /// The store's directory, or a mount point of it.
        store: PathBuf,
        /// 1 to 255 bytes, no '/'.
        name: String,
    },
    /// The snapshots, oldest first: name, time, logical bytes, and the
    /// bytes only it holds (what deleting it and `store gc` free).
    List {
        store: PathBuf,
        /// Print JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Delete a snapshot (constant time); `store gc` then frees what only
    /// it held.
    Delete { store: PathBuf, name: String },
    /// Write snapshot NAME's tree as the new directory DEST (keeps what
    /// `cp -a` keeps), reading the store directly, not through a mount:
    /// a mounted store's mount process does it.
    Restore {
        store: PathBuf,
        name: String,
        dest: PathBuf,
    },
    /// Paths added (+), removed (-) and changed (M) from snapshot OLD to
    /// snapshot NEW.
    Diff {
        store: PathBuf,
        old: String,
        new: String,
        /// Print JSON on stdout.
        #[arg(long)]
        json: bool,
    },
}

/// `onecopy store forget`: a retention policy in the style of `restic
/// forget`.
#[derive(Debug, clap::Args)]
pub struct ForgetArgs {
    /// The store's directory, or a mount point of it.
    store: PathBuf,
    /// Keep the N most recent snapshots.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_last: u32,
    /// Keep the most recent snapshot of each of the last N days (UTC)
    /// that have one.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_daily: u32,
    /// ... of each of the last N ISO weeks that have one.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_weekly: u32,
    /// ... of each of the last N months that have one.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_monthly: u32,
    /// ... of each of the last N years that have one.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_yearly: u32,
    /// Say what would be removed; remove nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print JSON on stdout.
    #[arg(long)]
    json: bool,
}

impl ForgetArgs {
    /// The store or mount point named.
    pub fn store(&self) -> &std::path::Path {
        &self.store
    }
}

/// Runs `store forget`.
pub fn forget(a: ForgetArgs) -> Result<u8, StoreError> {
    let keep = Keep {
        last: a.keep_last,
        daily: a.keep_daily,
        weekly: a.keep_weekly,
        monthly: a.keep_monthly,
        yearly: a.keep_yearly,
    };
    let dir = store_dir(&a.store);
    let req = Request::SnapshotForget {
        keep,
        dry_run: a.dry_run,
    };
    let rep: ForgetReport = in_store(&dir, req, |s| s.snapshot_forget(keep, a.dry_run))?;
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&rep).expect("serializes")
        );
        return Ok(exit::OK);
    }
    for s in &rep.keep {
        outln!("keep    {}  {}", utc(s.time_ns), s.name);
    }
    let verb = if a.dry_run { "would remove" } else { "remove" };
    for s in &rep.remove {
        outln!("{verb:<7} {}  {}", utc(s.time_ns), s.name);
    }
    outln!(
        "{} kept, {} {} ({} stored bytes to free){}",
        rep.keep.len(),
        rep.remove.len(),
        if a.dry_run {
            "would be removed"
        } else {
            "removed"
        },
        rep.frees_bytes,
        if a.dry_run || rep.remove.is_empty() {
            ""
        } else {
            "; `onecopy store gc` frees what only they held"
        }
    );
    Ok(exit::OK)
}

/// The store directory `path` names: a store's directory, or the mount
/// point of an onecopy mount (its source is `onecopy:DIR`).
pub fn store_dir(path: &Path) -> PathBuf {
    if path.join("store.json").exists() {
        return path.to_path_buf();
    }
    let want = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mounts = onecopy_ioctl::mounts::read().unwrap_or_default();
    mounts
        .into_iter()
        .filter(|m| m.mount_point == want)
        .find_map(|m| m.source.strip_prefix("onecopy:").map(PathBuf::from))
        .unwrap_or_else(|| path.to_path_buf())
}

/// Runs `req` in the store's mount, or, when none serves it, with `local`
/// on the store opened here.
fn in_store<T: serde::de::DeserializeOwned>(
    dir: &Path,
    req: Request,
    local: impl FnOnce(&Store) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    match control::request(dir, &req) {
        Some(r) => r,
        None => match control::open_store(dir) {
            Ok(s) => local(&s),
            // Locked, yet nobody answered: a mount still starting.
            Err(e) => Err(e),
        },
    }
}

/// A snapshot name not found, or taken, said as such.
fn named(name: &str) -> impl FnOnce(StoreError) -> StoreError + '_ {
    move |e| match e {
        StoreError::NotFound => StoreError::BadOption(format!("no snapshot named {name:?}")),
        StoreError::AlreadyExists => {
            StoreError::BadOption(format!("a snapshot named {name:?} exists"))
        }
        e => e,
    }
}

pub fn run(action: SnapshotAction) -> Result<u8, StoreError> {
    match action {
        SnapshotAction::Create { store, name } => {
            let dir = store_dir(&store);
            let req = Request::SnapshotCreate { name: name.clone() };
            let s: Snapshot =
                in_store(&dir, req, |s| s.snapshot_create(&name)).map_err(named(&name))?;
            outln!("created snapshot {} of {}", s.name, dir.display());
            Ok(exit::OK)
        }
        SnapshotAction::Delete { store, name } => {
            let dir = store_dir(&store);
            let req = Request::SnapshotDelete { name: name.clone() };
            let s: Snapshot =
                in_store(&dir, req, |s| s.snapshot_delete(&name)).map_err(named(&name))?;
            outln!(
                "deleted snapshot {}; `onecopy store gc` frees what only it held",
                s.name
            );
            Ok(exit::OK)
        }
        SnapshotAction::Diff {
            store,
            old,
            new,
            json,
        } => {
            let dir = store_dir(&store);
            let req = Request::SnapshotDiff {
                old: old.clone(),
                new: new.clone(),
            };
            let changes: Vec<Change> = in_store(&dir, req, |s| s.snapshot_diff(&old, &new))?;
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&changes).expect("serializes")
                );
            } else {
                for c in &changes {
                    outln!("{} {}", c.what, c.path);
                }
            }
            Ok(exit::OK)
        }
        SnapshotAction::Restore { store, name, dest } => restore(&store, &name, &dest),
        SnapshotAction::List { store, json } => {
            let dir = store_dir(&store);
            let list: Vec<SnapshotInfo> =
                in_store(&dir, Request::SnapshotList, |s| s.snapshot_list())?;
            print_list(&list, json);
            Ok(exit::OK)
        }
    }
}

/// `snapshot restore`: by the store's mount when it is mounted (which
/// reads the store without the kernel's round trips), else here. DEST
/// is made absolute here: the mount's working directory is not ours.
fn restore(store: &Path, name: &str, dest: &Path) -> Result<u8, StoreError> {
    let dir = store_dir(store);
    if dest.symlink_metadata().is_ok() {
        return Err(StoreError::DestExists { path: dest.into() });
    }
    let dest = std::path::absolute(dest).map_err(|source| StoreError::Io {
        path: dest.into(),
        source,
    })?;
    let req = Request::SnapshotRestore {
        name: name.into(),
        dest: dest.clone(),
    };
    let rep = in_store(&dir, req, |s| s.snapshot_restore(name, &dest)).map_err(named(name))?;
    for e in &rep.errors {
        errln!("onecopy: {e}");
    }
    outln!(
        "restored {} files ({} bytes), {} directories, {} symlinks, {} hard links, {} others to {}",
        rep.files,
        rep.bytes,
        rep.directories,
        rep.symlinks,
        rep.hardlinks,
        rep.specials,
        dest.display()
    );
    Ok(if rep.errors.is_empty() {
        exit::OK
    } else {
        exit::PARTIAL
    })
}

fn print_list(list: &[SnapshotInfo], json: bool) {
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(list).expect("serializes")
        );
        return;
    }
    outln!(
        "{:<24} {:<20} {:>16} {:>16}",
        "NAME",
        "TIME (UTC)",
        "LOGICAL",
        "ONLY IT HOLDS"
    );
    for s in list {
        outln!(
            "{:<24} {:<20} {:>16} {:>16}",
            s.snapshot.name,
            utc(s.snapshot.time_ns),
            s.logical_bytes,
            s.exclusive_bytes
        );
    }
}

/// A time in ns since the epoch as RFC 3339 (UTC, seconds).
fn utc(ns: i64) -> String {
    let t =
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(ns.max(0) as u64 / 1_000_000_000);
    humantime::format_rfc3339_seconds(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_print_as_utc_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(1_795_891_341_000_000_000), "2026-11-28T18:42:21Z");
    }
}
