//! Re-homing: releasing btrfs extents that dedupe left "bookended".
//!
//! btrfs frees an extent only when none of its bytes is referenced. After a
//! file's duplicate ranges were shared, the file may still reference a
//! small unique remainder of an old, large extent, which keeps all of it
//! allocated. Re-homing copies that remainder into a fresh file in
//! onecopy's temporary directory (a new, small extent) and then asks
//! `FIDEDUPERANGE` to share the copy into the user's file: the kernel
//! compares the bytes, so a concurrent change only makes the call fail.
//! Once no byte of the old extent is referenced, btrfs frees it. The user's
//! file is never written; the temporary file is unlinked right after.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use onecopy_ioctl::btrfs::{self, FileExtentKind};
use onecopy_ioctl::dedupe::{dedupe_range, describe_errno, DedupeDest, DedupeStatus};
use onecopy_ioctl::fiemap;

use crate::{DedupeError, ExecProgress, ExecStats};

/// Re-homing settings.
#[derive(Debug, Clone)]
pub struct RehomeOptions {
    /// A directory on the same filesystem, owned by onecopy, for the
    /// temporary copies.
    pub tmp_dir: PathBuf,
    /// Re-home when the remainder is at most this fraction of the extent
    /// it pins (0 disables re-homing).
    pub max_ratio: f64,
}

/// One candidate: the ranges of a file that still pin one extent.
struct Pinned {
    extent_bytes: u64,
    ranges: Vec<(u64, u64)>,
}

/// Finds the extents `f` still pins only partly, whose remainder is small
/// enough to re-home.
fn candidates(f: &File, size: u64, max_ratio: f64) -> std::io::Result<Vec<Pinned>> {
    let ino = f.metadata()?.ino();
    let mut by_extent: BTreeMap<u64, Pinned> = BTreeMap::new();
    for x in btrfs::file_extents(f.as_fd(), ino)? {
        if x.kind != FileExtentKind::Regular || x.disk_bytenr == 0 || x.file_offset >= size {
            continue;
        }
        let p = by_extent.entry(x.disk_bytenr).or_insert(Pinned {
            extent_bytes: x.disk_num_bytes,
            ranges: Vec::new(),
        });
        p.ranges
            .push((x.file_offset, x.num_bytes.min(size - x.file_offset)));
    }
    let map = fiemap::fiemap(f.as_fd())?;
    let mut out = Vec::new();
    for (_, p) in by_extent {
        let remainder: u64 = p.ranges.iter().map(|r| r.1).sum();
        if remainder == 0 || remainder as f64 > max_ratio * p.extent_bytes as f64 {
            continue;
        }
        // Any other reference (another file, a snapshot) keeps the extent
        // allocated whatever this file does: leave it alone.
        let shared = p.ranges.iter().any(|&(off, len)| {
            map.iter()
                .any(|e| e.is_shared() && e.logical < off + len && off < e.logical_end())
        });
        if !shared {
            out.push(p);
        }
    }
    Ok(out)
}

/// Copies `[off, off + len)` of `src` into a new temporary file.
fn copy_out(src: &File, off: u64, len: u64, tmp: &Path, buf: &mut [u8]) -> std::io::Result<File> {
    let mut t = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(tmp)?;
    let mut done = 0u64;
    while done < len {
        let want = ((len - done) as usize).min(buf.len());
        let n = src.read_at(&mut buf[..want], off + done)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "file shrank",
            ));
        }
        t.write_all(&buf[..n])?;
        done += n as u64;
    }
    Ok(t)
}

/// Re-homes the small remainders of `path` (opened as `f`, `size` bytes).
/// Updates `stats` (`rehome_*`) and records problems in `errors`.
pub(crate) fn rehome_file(
    path: &Path,
    f: &File,
    size: u64,
    opts: &RehomeOptions,
    progress: &ExecProgress,
    stats: &mut ExecStats,
    errors: &mut Vec<DedupeError>,
) {
    let pinned = match candidates(f, size, opts.max_ratio) {
        Ok(p) => p,
        Err(source) => {
            errors.push(DedupeError::Fiemap {
                path: path.to_path_buf(),
                source,
            });
            return;
        }
    };
    let mut buf = vec![0u8; 1 << 20];
    for p in pinned {
        let mut ok = true;
        let mut written = 0u64;
        for &(off, len) in &p.ranges {
            if progress.cancel.load(Ordering::Relaxed) {
                return;
            }
            let tmp = opts.tmp_dir.join(format!(
                "rehome-{}-{}",
                std::process::id(),
                stats.rehome_ranges
            ));
            let res = copy_out(f, off, len, &tmp, &mut buf);
            let _ = std::fs::remove_file(&tmp);
            let t = match res {
                Ok(t) => t,
                Err(e) => {
                    errors.push(DedupeError::Rehome {
                        path: path.to_path_buf(),
                        why: e.to_string(),
                    });
                    ok = false;
                    break;
                }
            };
            written += len;
            stats.rehome_ranges += 1;
            let mut done = 0u64;
            while done < len {
                stats.dedupe_ioctls += 1;
                let r = dedupe_range(
                    t.as_fd(),
                    done,
                    len - done,
                    &[DedupeDest {
                        fd: f.as_fd(),
                        offset: off + done,
                    }],
                );
                match r.as_deref() {
                    Ok([DedupeStatus::Same { bytes }]) if *bytes > 0 => done += bytes,
                    Ok([DedupeStatus::Differs]) => {
                        *stats
                            .skipped
                            .entry(crate::DestSkip::DataDiffers)
                            .or_default() += 1;
                        ok = false;
                        break;
                    }
                    Ok([DedupeStatus::Error(e)]) => {
                        errors.push(DedupeError::Rehome {
                            path: path.to_path_buf(),
                            why: describe_errno(*e),
                        });
                        ok = false;
                        break;
                    }
                    Ok(_) => {
                        errors.push(DedupeError::Rehome {
                            path: path.to_path_buf(),
                            why: "the kernel shared no bytes".into(),
                        });
                        ok = false;
                        break;
                    }
                    Err(e) => {
                        let why = e
                            .raw_os_error()
                            .map(describe_errno)
                            .unwrap_or_else(|| e.to_string());
                        errors.push(DedupeError::Rehome {
                            path: path.to_path_buf(),
                            why,
                        });
                        ok = false;
                        break;
                    }
                }
            }
            if !ok {
                break;
            }
        }
        stats.rehome_bytes_written += written;
        if ok {
            stats.rehome_extents += 1;
            stats.rehome_bytes_released += p.extent_bytes;
        }
    }
}
