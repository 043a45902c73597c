//! Files changed anywhere on the filesystems of the roots, from one
//! fanotify group with filesystem marks (`FAN_MARK_FILESYSTEM`; needs
//! CAP_SYS_ADMIN). Two kinds, the first that the kernel and filesystem
//! allow:
//!
//! * [`Mode::Names`] (`FAN_REPORT_DFID_NAME`, Linux 5.9+, filesystems with
//!   file handles): files written and closed, created, and renamed or moved
//!   into place. Each event names a directory by handle (opened with
//!   `open_by_handle_at`) and an entry in it.
//! * [`Mode::Writes`] (`FAN_CLOSE_WRITE` with an open descriptor): files
//!   written and closed only; a file renamed into a root is not seen until
//!   the next full look.
//!
//! Events outside the roots are dropped. A queue overflow is reported as
//! [`Change::Lost`]: the caller then looks at every root.

use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::fanotify::{EventFFlags, Fanotify, InitFlags, MarkFlags, MaskFlags};

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("fanotify is not available: {0}")]
    Init(#[source] Errno),
    #[error("cannot watch the filesystem of {path}: {source}")]
    Mark {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("reading fanotify events: {0}")]
    Read(#[source] Errno),
}

/// One observed change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A file under a root was written and closed.
    Written(PathBuf),
    /// Events were lost (queue overflow): anything may have changed.
    Lost,
}

/// What a [`ChangeSource`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Writes, creations and renames, named by directory handle and name.
    Names,
    /// Writes only, named by an open descriptor.
    Writes,
}

/// A fanotify group watching the filesystems of some roots.
pub struct ChangeSource {
    fan: Fanotify,
    roots: Vec<PathBuf>,
    ignore: Vec<String>,
    mode: Mode,
    /// Per root: its directory (for `open_by_handle_at`) and the kernel
    /// fsid of its filesystem (Names mode only).
    mounts: Vec<(std::fs::File, [u8; 8])>,
}

/// `FAN_REPORT_DIR_FID | FAN_REPORT_NAME`.
const REPORT_DFID_NAME: u32 = 0x0000_0c00;

impl ChangeSource {
    /// The best source the kernel allows for `roots`: [`Mode::Names`], else
    /// [`Mode::Writes`], with the reason Names was refused.
    pub fn best(
        roots: &[PathBuf],
        ignore: &[&str],
    ) -> Result<(ChangeSource, Option<WatchError>), WatchError> {
        match ChangeSource::names(roots, ignore) {
            Ok(s) => Ok((s, None)),
            Err(why) => Ok((ChangeSource::fanotify(roots, ignore)?, Some(why))),
        }
    }

    /// Which events this source reports.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// A [`Mode::Names`] source (`FAN_REPORT_DFID_NAME`).
    pub fn names(roots: &[PathBuf], ignore: &[&str]) -> Result<ChangeSource, WatchError> {
        let flags = InitFlags::FAN_CLASS_NOTIF
            | InitFlags::FAN_CLOEXEC
            | InitFlags::FAN_NONBLOCK
            | InitFlags::from_bits_retain(REPORT_DFID_NAME);
        let fan = Fanotify::init(flags, EventFFlags::O_RDONLY | EventFFlags::O_LARGEFILE)
            .map_err(WatchError::Init)?;
        let mask = MaskFlags::from_bits_retain(
            crate::fid::CLOSE_WRITE | crate::fid::MOVED_TO | crate::fid::CREATE | crate::fid::ONDIR,
        );
        let mut mounts = Vec::new();
        for r in roots {
            let dir = mark_filesystem(&fan, r, mask)?;
            let fsid = onecopy_ioctl::handle::kernel_fsid(dir.as_fd()).map_err(|source| {
                WatchError::Open {
                    path: r.clone(),
                    source,
                }
            })?;
            mounts.push((dir, fsid));
        }
        Ok(ChangeSource {
            fan,
            roots: roots.to_vec(),
            ignore: ignore.iter().map(|s| s.to_string()).collect(),
            mode: Mode::Names,
            mounts,
        })
    }

    /// Watches the filesystems holding `roots` (canonical paths). Files in
    /// a directory whose name starts with one of `ignore` (onecopy's own
    /// temporary directories) are not reported: deduping must not wake
    /// the watcher up again.
    pub fn fanotify(roots: &[PathBuf], ignore: &[&str]) -> Result<ChangeSource, WatchError> {
        let fan = Fanotify::init(
            InitFlags::FAN_CLASS_NOTIF | InitFlags::FAN_CLOEXEC | InitFlags::FAN_NONBLOCK,
            EventFFlags::O_RDONLY | EventFFlags::O_LARGEFILE | EventFFlags::O_CLOEXEC,
        )
        .map_err(WatchError::Init)?;
        for r in roots {
            mark_filesystem(&fan, r, MaskFlags::FAN_CLOSE_WRITE)?;
        }
        Ok(ChangeSource {
            fan,
            roots: roots.to_vec(),
            ignore: ignore.iter().map(|s| s.to_string()).collect(),
            mode: Mode::Writes,
            mounts: Vec::new(),
        })
    }

    /// Waits up to `timeout` for changes and returns those under the roots.
    pub fn wait(&self, timeout: Duration) -> Result<Vec<Change>, WatchError> {
        let ms = timeout.as_millis().min(u16::MAX as u128) as u16;
        let mut fds = [PollFd::new(self.fan.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(0) | Err(Errno::EINTR) => return Ok(Vec::new()),
            Ok(_) => {}
            Err(e) => return Err(WatchError::Read(e)),
        }
        match self.mode {
            Mode::Names => self.read_named(),
            Mode::Writes => self.read_fds(),
        }
    }

    /// Events of a Names group, as paths under the roots.
    fn read_named(&self) -> Result<Vec<Change>, WatchError> {
        let mut buf = vec![0u8; 64 << 10];
        let n = match nix::unistd::read(&self.fan, &mut buf) {
            Ok(n) => n,
            Err(Errno::EAGAIN) | Err(Errno::EINTR) => return Ok(Vec::new()),
            Err(e) => return Err(WatchError::Read(e)),
        };
        let mut out = Vec::new();
        for ev in crate::fid::decode_events(&buf[..n]) {
            if ev.mask & crate::fid::Q_OVERFLOW != 0 {
                out.push(Change::Lost);
                continue;
            }
            let Some(named) = ev.named else {
                out.push(Change::Lost);
                continue;
            };
            if !crate::fid::names_a_change(ev.mask) {
                continue;
            }
            let Some(dir) = self.dir_path(&named.fsid, &named.dir_handle) else {
                continue;
            };
            let p = dir
                .join(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&named.name));
            if under(&p, &self.roots) && !ignored(&p, &self.ignore) {
                out.push(Change::Written(p));
            }
        }
        Ok(out)
    }

    /// The path of the directory named by `handle` on the filesystem `fsid`
    /// (None when no root is on it, or the directory is gone).
    fn dir_path(&self, fsid: &[u8; 8], handle: &[u8]) -> Option<PathBuf> {
        let (mount, _) = self.mounts.iter().find(|(_, f)| f == fsid)?;
        let fd = onecopy_ioctl::handle::open_by_handle(mount.as_fd(), handle).ok()?;
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()
    }

    /// Events of a Writes group, named through their descriptors.
    fn read_fds(&self) -> Result<Vec<Change>, WatchError> {
        let events = match self.fan.read_events() {
            Ok(ev) => ev,
            Err(Errno::EAGAIN) | Err(Errno::EINTR) => return Ok(Vec::new()),
            Err(e) => return Err(WatchError::Read(e)),
        };
        let mut out = Vec::new();
        for ev in events {
            if ev.mask().contains(MaskFlags::FAN_Q_OVERFLOW) {
                out.push(Change::Lost);
                continue;
            }
            let Some(fd) = ev.fd() else {
                out.push(Change::Lost);
                continue;
            };
            let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
            if let Ok(p) = std::fs::read_link(link) {
                if under(&p, &self.roots) && !ignored(&p, &self.ignore) {
                    out.push(Change::Written(p));
                }
            }
        }
        Ok(out)
    }
}

/// Whether `p` is one of `roots` or below one.
fn under(p: &Path, roots: &[PathBuf]) -> bool {
    roots.iter().any(|r| p.starts_with(r))
}

/// A deleted file (its link ends in " (deleted)"), or one inside a
/// directory named with an ignored prefix.
fn ignored(p: &Path, prefixes: &[String]) -> bool {
    p.as_os_str().as_encoded_bytes().ends_with(b" (deleted)")
        || p.components().any(|c| {
            let c = c.as_os_str().to_string_lossy();
            prefixes.iter().any(|x| c.starts_with(x.as_str()))
        })
}

/// Opens root `r` and marks its whole filesystem for `mask` events;
/// returns the open root.
fn mark_filesystem(fan: &Fanotify, r: &Path, mask: MaskFlags) -> Result<std::fs::File, WatchError> {
    let dir = onecopy_scan::longpath::open_nonblocking(r).map_err(|source| WatchError::Open {
        path: r.to_path_buf(),
        source,
    })?;
    fan.mark::<_, Path>(
        MarkFlags::FAN_MARK_ADD | MarkFlags::FAN_MARK_FILESYSTEM,
        mask,
        dir.as_fd(),
        None,
    )
    .map_err(|source| WatchError::Mark {
        path: r.to_path_buf(),
        source,
    })?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_paths_below_a_root() {
        let roots = vec![PathBuf::from("/srv/a"), PathBuf::from("/data")];
        assert!(under(Path::new("/srv/a/x/y"), &roots));
        assert!(under(Path::new("/data"), &roots));
        assert!(!under(Path::new("/srv/ab"), &roots));
        assert!(!under(Path::new("/var/cache/onecopy/c.db"), &roots));
    }

    #[test]
    fn own_temporary_files_and_deleted_ones_are_ignored() {
        let x = vec![".onecopy-tmp.".to_string()];
        assert!(ignored(Path::new("/d/.onecopy-tmp.42/lock"), &x));
        assert!(ignored(Path::new("/d/f (deleted)"), &x));
        assert!(!ignored(Path::new("/d/onecopy-tmp/f"), &x));
        assert!(!ignored(Path::new("/d/f"), &x));
    }
}
