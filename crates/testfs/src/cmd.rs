//! Running the external tools (`mkfs.*`, `mount`, `losetup`, `btrfs`).

use std::ffi::OsStr;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::process::{Command, Stdio};

/// Runs `program args...`, returning its stdout. A non-zero exit becomes an
/// error carrying the command line and its stderr; a missing program becomes
/// [`io::ErrorKind::NotFound`] with a hint on what to install.
pub(crate) fn run<I, S>(program: &str, args: I) -> io::Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<_> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    let line = || {
        let mut s = program.to_string();
        for a in &args {
            s.push(' ');
            s.push_str(&a.to_string_lossy());
        }
        s
    };
    let out = Command::new(program)
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("`{program}` not found ({}); {}", e, install_hint(program)),
                )
            } else {
                io::Error::new(e.kind(), format!("running `{}`: {e}", line()))
            }
        })?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "`{}` failed ({}): {}",
            line(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn install_hint(program: &str) -> &'static str {
    match program {
        "mkfs.btrfs" | "btrfs" => "install it with `apt-get install -y btrfs-progs`",
        "mkfs.xfs" => "install it with `apt-get install -y xfsprogs`",
        "mkfs.ext4" => "install it with `apt-get install -y e2fsprogs`",
        _ => "install util-linux / coreutils",
    }
}

/// Whether the process runs with effective uid 0 (needed for mounting).
///
/// Reads the owner of `/proc/self`, which is the effective uid, so no
/// `unsafe` call is needed.
pub fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}
