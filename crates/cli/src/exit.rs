//! The exit codes of every command, in one table: `--help` shows
//! [`HELP`] and the README the same table. A command maps its errors here
//! and nowhere else.

/// Done (with `--dry-run`, decided).
pub const OK: u8 = 0;
/// Done in part, and what was not is listed: files or ranges that failed
/// (`dedupe`, `catalog`), problems found (`store fsck`, `scrub`), sources
/// left out (`store import`).
pub const PARTIAL: u8 = 1;
/// Bad arguments or options, or a path that is not what the command
/// needs: not a store, a store of a newer format, a directory that is not
/// empty for `store init`, an import destination that exists.
pub const USAGE: u8 = 2;
/// Refused, nothing done: a root on a filesystem that can not share
/// extents or is read-only; a store in use (mounted, or held by another
/// command); a mount point already mounted on; a mount that failed.
pub const REFUSED: u8 = 3;
/// An I/O or internal error.
pub const FATAL: u8 = 4;
/// Interrupted (SIGINT/SIGTERM); what was done so far is reported.
pub const INTERRUPTED: u8 = 130;

/// Writes a command's output to stdout ([`stdout_failed`] on failure).
pub fn write_out(args: std::fmt::Arguments) {
    use std::io::Write as _;
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        stdout_failed(e);
    }
}

/// Writing a command's output failed: a reader that went away ends the
/// process by SIGPIPE, as it ends `ls | head`'s `ls` (Rust ignores the
/// signal, so it is raised again here); any other failure is an I/O
/// error, [`FATAL`].
pub fn stdout_failed(e: std::io::Error) -> ! {
    use std::io::Write as _;
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        // SAFETY: restoring a signal's default action and raising it
        // have no preconditions; nothing else runs after this.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::raise(libc::SIGPIPE);
        }
    }
    let _ = writeln!(std::io::stderr(), "onecopy: standard output: {e}");
    std::process::exit(i32::from(FATAL))
}

/// The table as `--help` prints it.
pub const HELP: &str = "Exit codes: 0 done; 1 done in part (failed files or ranges, \
problems found, sources left out: listed); 2 bad arguments, not a store, a newer store \
format, init on a directory that is not empty, an import destination that exists; 3 refused: \
a filesystem that can not share extents or is read-only, a store in use, a mount point \
already mounted on, a mount that failed; 4 I/O or internal error; 130 interrupted.";
