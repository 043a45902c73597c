//! Mount options (`-o a,b,c`) and the `mount.onecopy` helper that
//! mount(8) runs for `-t onecopy` and for `/etc/fstab` lines of type
//! `onecopy`: `mount.onecopy SPEC DIR [-sfnv] [-N NS] [-o OPTIONS]`.
//! The helper is this binary under another name (a symlink); it mounts
//! the way `onecopy mount SPEC DIR -o OPTIONS` does (daemonized, returning
//! once the mount is ready).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use onecopy_fuse::MountOption;

use crate::mount_cmd::{self, MountArgs};
use crate::store_cmd::code;

/// The name mount(8) runs the helper by.
pub const HELPER_NAME: &str = "mount.onecopy";

/// Mount options, parsed.
#[derive(Debug, Default, PartialEq)]
pub struct MountOpts {
    /// Kernel flags passed to the mount (`ro`, `nosuid`, ...).
    pub kernel: Vec<MountOption>,
    /// `threads=N`: FUSE worker threads.
    pub threads: Option<usize>,
}

/// Options mount(8) and fstab use that mean nothing to the mount itself
/// (`allow_other` and `default_permissions` are always on).
fn ignored(o: &str) -> bool {
    matches!(
        o,
        "" | "defaults"
            | "auto"
            | "noauto"
            | "user"
            | "nouser"
            | "users"
            | "owner"
            | "group"
            | "_netdev"
            | "nofail"
            | "allow_other"
            | "allow_root"
            | "default_permissions"
            | "rw"
            | "async"
            | "loud"
            | "silent"
    ) || o.starts_with("x-")
        || o.starts_with("comment=")
}

fn kernel(o: &str) -> Option<MountOption> {
    Some(match o {
        "ro" => MountOption::RO,
        "nosuid" => MountOption::NoSuid,
        "suid" => MountOption::Suid,
        "nodev" => MountOption::NoDev,
        "dev" => MountOption::Dev,
        "noexec" => MountOption::NoExec,
        "exec" => MountOption::Exec,
        "noatime" => MountOption::NoAtime,
        "atime" => MountOption::Atime,
        "sync" => MountOption::Sync,
        "dirsync" => MountOption::DirSync,
        _ => return None,
    })
}

/// Parses a comma-separated option list. An unknown option is an error
/// unless `sloppy` (mount -s), which skips it.
pub fn parse(list: &str, sloppy: bool) -> Result<MountOpts, String> {
    let mut opts = MountOpts::default();
    for o in list.split(',') {
        if let Some(k) = kernel(o) {
            opts.kernel.push(k);
        } else if let Some(n) = o.strip_prefix("threads=") {
            let n: usize = n
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("bad mount option {o:?}: threads=N with N >= 1"))?;
            opts.threads = Some(n);
        } else if !ignored(o) && !sloppy {
            return Err(format!("unknown mount option {o:?}"));
        }
    }
    Ok(opts)
}

/// True when this process was started as `mount.onecopy`.
pub fn invoked_as_helper(argv0: &std::ffi::OsStr) -> bool {
    std::path::Path::new(argv0)
        .file_name()
        .is_some_and(|n| n == HELPER_NAME)
}

/// What mount(8) asked for.
#[derive(Debug, PartialEq)]
struct HelperArgs {
    spec: PathBuf,
    dir: PathBuf,
    options: String,
    sloppy: bool,
    fake: bool,
    verbose: bool,
}

/// Parses `SPEC DIR [-sfnv] [-N NS] [-o OPTIONS] [-t TYPE]` (flags may
/// come first, be grouped, and `-oOPTS` may be joined).
fn parse_helper(args: &[OsString]) -> Result<HelperArgs, String> {
    let mut pos = Vec::new();
    let (mut options, mut sloppy, mut fake, mut verbose) = (Vec::new(), false, false, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if !s.starts_with('-') || s == "-" {
            pos.push(PathBuf::from(a));
            continue;
        }
        let flags = &s[1..];
        for (i, c) in flags.char_indices() {
            match c {
                's' => sloppy = true,
                'f' => fake = true,
                'n' => {}
                'v' => verbose = true,
                'o' | 'N' | 't' => {
                    let rest = &flags[i + 1..];
                    let value = if rest.is_empty() {
                        it.next()
                            .ok_or_else(|| format!("-{c} needs a value"))?
                            .to_string_lossy()
                            .into_owned()
                    } else {
                        rest.to_string()
                    };
                    match c {
                        'o' => options.push(value),
                        'N' => return Err("-N (mount namespaces) is not supported".into()),
                        _ => {}
                    }
                    break;
                }
                _ => return Err(format!("unknown flag -{c}")),
            }
        }
    }
    let [spec, dir]: [PathBuf; 2] = pos
        .try_into()
        .map_err(|_| "usage: mount.onecopy STORE MOUNTPOINT [-sfnv] [-o OPTIONS]".to_string())?;
    Ok(HelperArgs {
        spec,
        dir,
        options: options.join(","),
        sloppy,
        fake,
        verbose,
    })
}

/// Runs as `mount.onecopy` with mount(8)'s arguments (without argv[0]).
pub fn run(args: &[OsString]) -> ExitCode {
    let h = match parse_helper(args) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("{HELPER_NAME}: {e}");
            return ExitCode::from(code::USAGE);
        }
    };
    if let Err(e) = parse(&h.options, h.sloppy) {
        eprintln!("{HELPER_NAME}: {e}");
        return ExitCode::from(code::USAGE);
    }
    if h.verbose {
        eprintln!(
            "{HELPER_NAME}: mounting {} on {} (options {:?})",
            h.spec.display(),
            h.dir.display(),
            h.options
        );
    }
    if h.fake {
        return ExitCode::from(code::OK);
    }
    mount_cmd::run(MountArgs {
        dir: h.spec,
        mountpoint: h.dir,
        foreground: false,
        threads: onecopy_fuse::default_threads(),
        options: Some(h.options),
        sloppy: h.sloppy,
        notify_ready: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn parses_what_mount_passes() {
        let h = parse_helper(&os(&["/srv/s", "/mnt/x", "-o", "rw,allow_other"])).unwrap();
        assert_eq!(h.spec, PathBuf::from("/srv/s"));
        assert_eq!(h.dir, PathBuf::from("/mnt/x"));
        assert_eq!(h.options, "rw,allow_other");
        let h = parse_helper(&os(&["-sv", "-oro,threads=2", "a", "b", "-n"])).unwrap();
        assert!(h.sloppy && h.verbose && !h.fake);
        assert_eq!(h.options, "ro,threads=2");
        assert!(parse_helper(&os(&["a"])).is_err());
        assert!(parse_helper(&os(&["a", "b", "-x"])).is_err());
        assert!(parse_helper(&os(&["a", "b", "-o"])).is_err());
    }

    #[test]
    fn options() {
        let o = parse(
            "defaults,allow_other,ro,nosuid,threads=8,x-systemd.automount",
            false,
        );
        let o = o.unwrap();
        assert_eq!(o.kernel, vec![MountOption::RO, MountOption::NoSuid]);
        assert_eq!(o.threads, Some(8));
        assert!(parse("bogus", false).unwrap_err().contains("bogus"));
        assert_eq!(parse("bogus", true).unwrap(), MountOpts::default());
        assert!(parse("threads=0", false).is_err());
    }

    #[test]
    fn helper_name() {
        assert!(invoked_as_helper("/sbin/mount.onecopy".as_ref()));
        assert!(invoked_as_helper("mount.onecopy".as_ref()));
        assert!(!invoked_as_helper("/usr/bin/onecopy".as_ref()));
    }
}
