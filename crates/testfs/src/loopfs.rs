//! Loop-mounted scratch filesystems and read-only bind mounts.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::thread::sleep;
use std::time::Duration;

use tempfile::TempDir;

use crate::cmd::{is_root, run};

/// Serialises loop device allocation between the threads of one process
/// (cargo runs the tests of a binary in parallel). Other processes are
/// handled by retrying.
static LOOP_LOCK: Mutex<()> = Mutex::new(());

/// Environment variable naming the directory that holds images and mount
/// points (default: the system temporary directory).
pub const TESTFS_DIR_ENV: &str = "ONECOPY_TESTFS_DIR";

/// The filesystems [`LoopFs`] can create.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FsKind {
    /// `mkfs.btrfs -q -f` (reflink and dedupe capable).
    Btrfs,
    /// `mkfs.xfs -q -f -m reflink=1` (reflink and dedupe capable).
    Xfs,
    /// `mkfs.ext4 -q -F` (no data sharing: dedupe must refuse).
    Ext4,
    /// `mount -t tmpfs` (no FIEMAP, no data sharing).
    Tmpfs,
}

impl FsKind {
    /// All kinds, for table-driven tests.
    pub const ALL: [FsKind; 4] = [FsKind::Btrfs, FsKind::Xfs, FsKind::Ext4, FsKind::Tmpfs];

    /// Short lowercase name (`"btrfs"`, `"xfs"`, `"ext4"`, `"tmpfs"`).
    pub fn name(self) -> &'static str {
        match self {
            FsKind::Btrfs => "btrfs",
            FsKind::Xfs => "xfs",
            FsKind::Ext4 => "ext4",
            FsKind::Tmpfs => "tmpfs",
        }
    }

    /// Whether the filesystem can share data between files
    /// (`FICLONE`/`FIDEDUPERANGE`).
    pub fn supports_sharing(self) -> bool {
        matches!(self, FsKind::Btrfs | FsKind::Xfs)
    }

    /// The smallest image `mkfs` accepts; [`LoopFs::new`] raises smaller
    /// requests to this.
    pub fn min_size(self) -> u64 {
        match self {
            FsKind::Btrfs => 128 << 20,
            FsKind::Xfs => 300 << 20,
            FsKind::Ext4 => 16 << 20,
            FsKind::Tmpfs => 1 << 20,
        }
    }
}

impl std::fmt::Display for FsKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FsKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "btrfs" => Ok(FsKind::Btrfs),
            "xfs" => Ok(FsKind::Xfs),
            "ext4" => Ok(FsKind::Ext4),
            "tmpfs" => Ok(FsKind::Tmpfs),
            other => Err(format!("unknown filesystem kind {other:?}")),
        }
    }
}

/// A freshly made filesystem mounted on a private temporary directory.
///
/// The image is a sparse file in a unique temporary directory (under
/// `$ONECOPY_TESTFS_DIR`, default the system temp dir), formatted and
/// mounted with `mount -o loop`. Dropping the value unmounts it (retrying,
/// then lazily if it stays busy), detaches the loop device and deletes the
/// image. Many instances may live at once in parallel test threads.
#[derive(Debug)]
pub struct LoopFs {
    kind: FsKind,
    size: u64,
    mnt: PathBuf,
    image: Option<PathBuf>,
    device: Option<String>,
    /// Holds `fs.img` and `mnt/`; `None` once kept on a failed unmount.
    dir: Option<TempDir>,
}

impl LoopFs {
    /// Creates, formats and mounts a `size_bytes` filesystem of `kind`.
    ///
    /// `size_bytes` is raised to [`FsKind::min_size`]. Needs root and the
    /// matching `mkfs` tool; the error says which is missing.
    pub fn new(kind: FsKind, size_bytes: u64) -> io::Result<LoopFs> {
        if !is_root() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "onecopy-testfs: LoopFs needs root (mount, mkfs, loop devices)",
            ));
        }
        let size = size_bytes.max(kind.min_size());
        let base = std::env::var_os(TESTFS_DIR_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = tempfile::Builder::new()
            .prefix(&format!("onecopy-testfs-{}-", kind.name()))
            .tempdir_in(&base)?;
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt)?;

        let mut fs = LoopFs {
            kind,
            size,
            mnt,
            image: None,
            device: None,
            dir: Some(dir),
        };
        if kind == FsKind::Tmpfs {
            run(
                "mount",
                [
                    "-t".as_ref(),
                    "tmpfs".as_ref(),
                    "-o".as_ref(),
                    format!("size={size}").as_ref(),
                    "tmpfs".as_ref(),
                    fs.mnt.as_os_str(),
                ],
            )?;
            return Ok(fs);
        }

        let image = fs.dir.as_ref().expect("dir present").path().join("fs.img");
        File::create(&image)?.set_len(size)?;
        fs.image = Some(image.clone());
        let img = image.as_os_str();
        match kind {
            FsKind::Btrfs => run("mkfs.btrfs", ["-q".as_ref(), "-f".as_ref(), img])?,
            FsKind::Xfs => run(
                "mkfs.xfs",
                [
                    "-q".as_ref(),
                    "-f".as_ref(),
                    "-m".as_ref(),
                    "reflink=1".as_ref(),
                    img,
                ],
            )?,
            FsKind::Ext4 => run("mkfs.ext4", ["-q".as_ref(), "-F".as_ref(), img])?,
            FsKind::Tmpfs => unreachable!(),
        };
        fs.mount_loop()?;
        Ok(fs)
    }

    fn mount_loop(&mut self) -> io::Result<()> {
        let image = self.image.clone().expect("image present");
        let mut last_err = None;
        for attempt in 0..6u64 {
            if attempt > 0 {
                sleep(Duration::from_millis(100 * attempt));
            }
            let res = {
                let _guard = LOOP_LOCK.lock().unwrap_or_else(|e| e.into_inner());
                run(
                    "mount",
                    [
                        "-o".as_ref(),
                        "loop".as_ref(),
                        image.as_os_str(),
                        self.mnt.as_os_str(),
                    ],
                )
            };
            match res {
                Ok(_) => {
                    self.device = mount_source(&self.mnt);
                    return Ok(());
                }
                Err(e) => {
                    // A half-done attempt may have left a loop device behind.
                    detach_loops_of(&image);
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.expect("at least one attempt"))
    }

    /// The mount point (the filesystem's root directory).
    pub fn path(&self) -> &Path {
        &self.mnt
    }

    /// The kind this filesystem was made with.
    pub fn kind(&self) -> FsKind {
        self.kind
    }

    /// The image size in bytes (after raising to the minimum).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The backing image file (`None` for tmpfs).
    pub fn image(&self) -> Option<&Path> {
        self.image.as_deref()
    }

    /// The loop device, e.g. `/dev/loop3` (`None` for tmpfs).
    pub fn device(&self) -> Option<&str> {
        self.device.as_deref()
    }

    /// Flushes the filesystem so space accounting is settled: `sync -f` on
    /// the mount point and, on btrfs, `btrfs filesystem sync` (a transaction
    /// commit, twice, so that extents freed by the first are released).
    ///
    /// # Panics
    /// If the sync commands fail.
    pub fn sync(&self) {
        run("sync", ["-f".as_ref(), self.mnt.as_os_str()]).expect("sync -f");
        if self.kind == FsKind::Btrfs {
            for _ in 0..2 {
                run(
                    "btrfs",
                    ["filesystem".as_ref(), "sync".as_ref(), self.mnt.as_os_str()],
                )
                .expect("btrfs filesystem sync");
            }
        }
    }

    /// Used space in bytes (statvfs total − free) after a [`sync`](Self::sync).
    /// On btrfs this includes metadata and system chunks' used space.
    ///
    /// # Panics
    /// On I/O errors.
    pub fn used_bytes(&self) -> u64 {
        self.sync();
        let f = File::open(&self.mnt).expect("open mount point");
        let info = onecopy_ioctl::fs::fs_info(f.as_fd()).expect("statfs");
        info.total_bytes - info.free_bytes
    }

    /// Remounts the whole filesystem read-only.
    pub fn remount_ro(&self) -> io::Result<()> {
        self.sync();
        run(
            "mount",
            ["-o".as_ref(), "remount,ro".as_ref(), self.mnt.as_os_str()],
        )
        .map(drop)
    }

    /// Remounts the filesystem read-write (undoes [`remount_ro`](Self::remount_ro)).
    pub fn remount_rw(&self) -> io::Result<()> {
        run(
            "mount",
            ["-o".as_ref(), "remount,rw".as_ref(), self.mnt.as_os_str()],
        )
        .map(drop)
    }

    /// A read-only bind mount of `src` (absolute, or relative to the mount
    /// point). See [`bind_mount_ro`].
    pub fn bind_mount_ro(&self, src: impl AsRef<Path>) -> io::Result<BindMount> {
        bind_mount_ro(&self.mnt.join(src.as_ref()))
    }

    /// `btrfs filesystem du -s` of a path inside this filesystem.
    ///
    /// # Panics
    /// If the filesystem is not btrfs or the command fails.
    pub fn btrfs_du(&self, path: impl AsRef<Path>) -> BtrfsDu {
        assert_eq!(
            self.kind,
            FsKind::Btrfs,
            "btrfs_du on a {} filesystem",
            self.kind
        );
        btrfs_du(&self.mnt.join(path.as_ref()))
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let unmounted = unmount(&self.mnt);
        if let Some(image) = &self.image {
            detach_loops_of(image);
        }
        if !unmounted {
            // Never let TempDir recurse into a still-mounted filesystem.
            if let Some(dir) = self.dir.take() {
                let kept = dir.keep();
                eprintln!(
                    "onecopy-testfs: could not unmount {}; leaving {} in place",
                    self.mnt.display(),
                    kept.display()
                );
            }
        }
    }
}

/// A read-only bind mount; dropping it unmounts it and removes its mount
/// point.
#[derive(Debug)]
pub struct BindMount {
    target: PathBuf,
    source: PathBuf,
    dir: Option<TempDir>,
}

impl BindMount {
    /// Where the read-only view is mounted.
    pub fn path(&self) -> &Path {
        &self.target
    }

    /// The directory that is shown read-only.
    pub fn source(&self) -> &Path {
        &self.source
    }
}

impl Drop for BindMount {
    fn drop(&mut self) {
        if !unmount(&self.target) {
            if let Some(dir) = self.dir.take() {
                let kept = dir.keep();
                eprintln!(
                    "onecopy-testfs: could not unmount bind mount {}; leaving it",
                    kept.display()
                );
            }
        }
    }
}

/// Bind-mounts directory `src` read-only on a fresh temporary directory
/// (`mount --bind`, then `mount -o remount,bind,ro`). Writes through the
/// returned [`BindMount::path`] fail with `EROFS`; `src` itself stays
/// writable.
pub fn bind_mount_ro(src: &Path) -> io::Result<BindMount> {
    if !is_root() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "onecopy-testfs: bind mounts need root",
        ));
    }
    let source = src.canonicalize()?;
    let base = std::env::var_os(TESTFS_DIR_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::Builder::new()
        .prefix("onecopy-testfs-bind-")
        .tempdir_in(base)?;
    let target = dir.path().join("ro");
    std::fs::create_dir(&target)?;
    run(
        "mount",
        ["--bind".as_ref(), source.as_os_str(), target.as_os_str()],
    )?;
    let guard = BindMount {
        target,
        source,
        dir: Some(dir),
    };
    run(
        "mount",
        [
            "-o".as_ref(),
            "remount,bind,ro".as_ref(),
            guard.target.as_os_str(),
        ],
    )?;
    Ok(guard)
}

/// What `btrfs filesystem du -s --raw` reports for a path, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BtrfsDu {
    /// Bytes referenced by the files under the path.
    pub total: u64,
    /// Bytes referenced only by those files (nothing outside shares them).
    pub exclusive: u64,
    /// Bytes of the set of shared extents, each counted once.
    pub set_shared: u64,
}

/// Runs `btrfs filesystem du -s --raw PATH` and parses its summary line.
///
/// # Panics
/// If the command fails or its output can not be parsed.
pub fn btrfs_du(path: &Path) -> BtrfsDu {
    let out = run(
        "btrfs",
        [
            "filesystem".as_ref(),
            "du".as_ref(),
            "-s".as_ref(),
            "--raw".as_ref(),
            path.as_os_str(),
        ],
    )
    .expect("btrfs filesystem du");
    parse_btrfs_du(&out)
        .unwrap_or_else(|| panic!("unparsable `btrfs filesystem du` output: {out:?}"))
}

fn parse_btrfs_du(out: &str) -> Option<BtrfsDu> {
    let line = out.lines().rev().find(|l| {
        l.split_whitespace()
            .next()
            .is_some_and(|t| t.parse::<u64>().is_ok())
    })?;
    let mut it = line.split_whitespace().map(|t| {
        if t == "-" {
            Some(0)
        } else {
            t.parse::<u64>().ok()
        }
    });
    Some(BtrfsDu {
        total: it.next()??,
        exclusive: it.next()??,
        set_shared: it.next()??,
    })
}

/// The mount source (device) of mount point `mnt` (the topmost mount).
fn mount_source(mnt: &Path) -> Option<String> {
    let mounts = onecopy_ioctl::mounts::read().ok()?;
    mounts
        .into_iter()
        .rev()
        .find(|m| m.mount_point == mnt)
        .map(|m| m.source)
}

/// Whether anything is mounted on `path` (exact mount point match).
fn is_mounted(path: &Path) -> bool {
    onecopy_ioctl::mounts::read().is_ok_and(|m| m.iter().any(|m| m.mount_point == path))
}

/// Unmounts `mnt` (all stacked mounts), retrying while busy and falling back
/// to a lazy unmount. Returns whether nothing is mounted there afterwards.
fn unmount(mnt: &Path) -> bool {
    for attempt in 0..20u64 {
        if !is_mounted(mnt) {
            return true;
        }
        if run("umount", [mnt.as_os_str()]).is_err() {
            sleep(Duration::from_millis(50 * (attempt + 1)));
        }
    }
    while is_mounted(mnt) {
        if run("umount", ["-l".as_ref(), mnt.as_os_str()]).is_err() {
            break;
        }
    }
    !is_mounted(mnt)
}

/// Detaches every loop device still backed by `image` (normally none: `mount
/// -o loop` sets autoclear, so unmounting detaches).
fn detach_loops_of(image: &Path) {
    let Ok(out) = run(
        "losetup",
        [
            "-n".as_ref(),
            "-O".as_ref(),
            "NAME".as_ref(),
            "-j".as_ref(),
            image.as_os_str(),
        ],
    ) else {
        return;
    };
    for dev in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let _guard = LOOP_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let _ = run("losetup", ["-d", dev]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_du() {
        let out =
            "     Total   Exclusive  Set shared  Filename\n  8388608     4096   8384512  /mnt/x\n";
        assert_eq!(
            parse_btrfs_du(out),
            Some(BtrfsDu {
                total: 8388608,
                exclusive: 4096,
                set_shared: 8384512
            })
        );
        assert_eq!(
            parse_btrfs_du("Total Exclusive Set shared Filename\n0 0 - /m\n"),
            Some(BtrfsDu::default())
        );
        assert_eq!(parse_btrfs_du("garbage"), None);
    }

    #[test]
    fn kinds_roundtrip() {
        for k in FsKind::ALL {
            assert_eq!(k.name().parse::<FsKind>().unwrap(), k);
        }
    }
}
