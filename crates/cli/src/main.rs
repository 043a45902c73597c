//! `onecopy`: the command-line front end. It parses arguments, draws
//! progress and prints; the work happens in the engine crates.

/// `println!` that never panics: a reader that went away (`| head`) ends
/// the process as SIGPIPE ends `ls`; any other failure (stdout on a full
/// disk) is reported on stderr, exit 4 ([`exit::stdout_failed`]).
macro_rules! outln {
    () => {
        $crate::exit::write_out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::exit::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` as [`outln!`] is `println!`.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::exit::write_out(format_args!($($arg)*))
    };
}

/// `eprintln!` that never panics: a message that cannot be written (a
/// mount's log on a full disk, stderr closed) is lost, never fatal.
macro_rules! errln {
    ($($arg:tt)*) => {
        onecopy_store::warn!($($arg)*)
    };
}

mod args;
mod catalog_cmd;
mod control;
mod dedupe_cmd;
mod duperemove_cmd;
mod exit;
mod generate_cmd;
mod import_cmd;
mod mount_cmd;
mod mount_helper;
mod output;
mod progress;
mod snapshot_cmd;
mod store_cmd;
mod watch_cmd;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let mut argv = std::env::args_os();
    if argv
        .next()
        .is_some_and(|a0| mount_helper::invoked_as_helper(&a0))
    {
        return mount_helper::run(&argv.collect::<Vec<_>>());
    }
    let cli = match args::Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() {
                exit::USAGE
            } else {
                exit::OK
            });
        }
    };
    let code = match cli.command {
        args::Command::Dedupe(a) => match dedupe_cmd::run(a) {
            Ok(code) => code,
            Err(e) => {
                errln!("onecopy: {e:#}");
                exit::FATAL
            }
        },
        args::Command::Catalog(a) => match catalog_cmd::run(a) {
            Ok(code) => code,
            Err(e) => {
                errln!("onecopy: {e:#}");
                exit::FATAL
            }
        },
        args::Command::Store(a) => return store_cmd::run(a),
        args::Command::Mount(a) => return mount_cmd::run(a),
        args::Command::Duperemove(a) => duperemove_cmd::run(a).unwrap_or_else(|e| {
            errln!("onecopy: {e:#}");
            exit::FATAL
        }),
        args::Command::Watch(a) => watch_cmd::run(a).unwrap_or_else(|e| {
            errln!("onecopy watch: {e:#}");
            exit::FATAL
        }),
        args::Command::Generate(a) => generate_cmd::run(a).unwrap_or_else(|e| {
            errln!("onecopy: {e:#}");
            exit::FATAL
        }),
    };
    ExitCode::from(code)
}
