//! Files written and closed anywhere on the filesystems of the roots,
//! from one fanotify group with filesystem marks (`FAN_MARK_FILESYSTEM`,
//! `FAN_CLOSE_WRITE`; needs CAP_SYS_ADMIN). Each event carries an open
//! descriptor whose `/proc/self/fd` link names the file; events outside
//! the roots are dropped. A queue overflow is reported as
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

/// A fanotify group watching the filesystems of some roots.
pub struct ChangeSource {
    fan: Fanotify,
    roots: Vec<PathBuf>,
    ignore: Vec<String>,
}

impl ChangeSource {
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
            let dir = std::fs::File::open(r).map_err(|source| WatchError::Open {
                path: r.clone(),
                source,
            })?;
            fan.mark::<_, Path>(
                MarkFlags::FAN_MARK_ADD | MarkFlags::FAN_MARK_FILESYSTEM,
                MaskFlags::FAN_CLOSE_WRITE,
                dir.as_fd(),
                None,
            )
            .map_err(|source| WatchError::Mark {
                path: r.clone(),
                source,
            })?;
        }
        Ok(ChangeSource {
            fan,
            roots: roots.to_vec(),
            ignore: ignore.iter().map(|s| s.to_string()).collect(),
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
