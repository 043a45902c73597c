//! Mount options (`-o a,b,c`) and the `mount.onecopy` helper that
//! mount(8) runs for `-t onecopy` and for `/etc/fstab` lines of type
//! `onecopy`: `mount.onecopy SPEC DIR [-sfnv] [-N NS] [-o OPTIONS]`.
//! The same helper named `mount.fuse.onecopy` serves `-t fuse.onecopy`
//! (the FUSE type/subtype form, used by fstab lines of type
//! `fuse.onecopy` and by xfstests with `FSTYP=fuse FUSE_SUBTYP=.onecopy`).
//! The helper is this binary under another name (a symlink); it mounts
//! the way `onecopy mount SPEC DIR -o OPTIONS` does (daemonized, returning
//! once the mount is ready). SPEC may also be written `onecopy:STORE`, the
//! source the mount shows in /proc/mounts, so that what `findmnt` reports
//! can be mounted again. `-o remount,...` changes the flags of the mount
//! on DIR in place (`ro`/`rw`, `nosuid`, ...), the daemon serving on.
//! mount(8) passes a helper only the options that differ from its own
//! defaults (`rw,suid,dev,exec`), so, as libfuse's `mount.fuse` does, the
//! helper mounts `dev,suid` unless `nodev`/`nosuid` are given (`onecopy
//! mount` keeps `nosuid,nodev` as its default).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use rustix::fs::StatVfsMountFlags;
use rustix::mount::MountFlags;

use onecopy_fuse::MountOption;

use crate::exit;
use crate::mount_cmd::{self, MountArgs};

/// The name mount(8) runs the helper by.
pub const HELPER_NAME: &str = "mount.onecopy";

/// Every name the binary acts as the helper under: `-t onecopy` and
/// `-t fuse.onecopy`.
pub const HELPER_NAMES: [&str; 2] = [HELPER_NAME, "mount.fuse.onecopy"];

/// Mount options, parsed.
#[derive(Debug, Default, PartialEq)]
pub struct MountOpts {
    /// Kernel flags passed to the mount (`ro`, `nosuid`, ...).
    pub kernel: Vec<MountOption>,
    /// `threads=N`: FUSE worker threads.
    pub threads: Option<usize>,
    /// `push=SECS`: how often a remote store's metadata goes to its
    /// bucket (the recovery point; default 30).
    pub push: Option<u64>,
    /// `relatime` (the default), `strictatime`, `noatime`: how reads move
    /// access times, which the store keeps (the kernel leaves atime of a
    /// FUSE inode to the filesystem).
    pub atime: Option<onecopy_store::Atime>,
    /// `transport=dev|uring`: how the kernel hands requests over
    /// (default `dev`; `uring` needs the fuse module's `enable_uring`).
    pub transport: Option<onecopy_fuse::Transport>,
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
        || no_effect(o)
}

/// Standard mount(8) options that are valid on any filesystem but change
/// nothing on this one, so they are accepted (as on other FUSE file
/// systems) rather than refused:
/// - `nodiratime`, `diratime`, `norelatime`, `nostrictatime`: directory
///   atimes are not kept, and the file policy is set by `relatime`,
///   `strictatime` and `noatime` (see [`MountOpts::atime`]);
/// - `lazytime`: no timestamps are written back lazily, the store keeps them;
/// - `iversion`: there is no i_version to maintain over FUSE;
/// - `mand`: mandatory locking is gone from Linux (5.15) and ignored.
fn no_effect(o: &str) -> bool {
    matches!(
        o,
        "norelatime"
            | "nostrictatime"
            | "diratime"
            | "nodiratime"
            | "lazytime"
            | "nolazytime"
            | "iversion"
            | "noiversion"
            | "mand"
            | "nomand"
    )
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
/// The number `n` of option `o`, at least 1 (`form` says how it is
/// written, for the error).
fn positive(o: &str, n: &str, form: &str) -> Result<u64, String> {
    n.parse()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("bad mount option {o:?}: {form} >= 1"))
}

/// `transport=`'s value.
fn transport(t: &str) -> Result<onecopy_fuse::Transport, String> {
    match t {
        "dev" => Ok(onecopy_fuse::Transport::Dev),
        "uring" => Ok(onecopy_fuse::Transport::Uring),
        _ => Err(format!("bad mount option transport={t:?}: dev or uring")),
    }
}

pub fn parse(list: &str, sloppy: bool) -> Result<MountOpts, String> {
    let mut opts = MountOpts::default();
    for o in list.split(',') {
        match o {
            "relatime" | "atime" => opts.atime = Some(onecopy_store::Atime::Relative),
            "strictatime" => opts.atime = Some(onecopy_store::Atime::Strict),
            "noatime" => opts.atime = Some(onecopy_store::Atime::Never),
            _ => {}
        }
        if matches!(o, "relatime" | "strictatime") {
            continue;
        }
        if let Some(k) = kernel(o) {
            opts.kernel.push(k);
        } else if let Some(n) = o.strip_prefix("threads=") {
            opts.threads = Some(positive(o, n, "threads=N with N")? as usize);
        } else if let Some(n) = o.strip_prefix("push=") {
            opts.push = Some(positive(o, n, "push=SECS with SECS")?);
        } else if let Some(t) = o.strip_prefix("transport=") {
            opts.transport = Some(transport(t)?);
        } else if !ignored(o) && !sloppy {
            return Err(format!("unknown mount option {o:?}"));
        }
    }
    Ok(opts)
}

/// Options the FUSE kernel module shows for a mount (/proc/mounts), which
/// mount(8) passes back on a remount given only the mount point; they can
/// not be changed and are ignored by a remount.
fn fuse_kernel_option(o: &str) -> bool {
    [
        "user_id=",
        "group_id=",
        "rootmode=",
        "fd=",
        "max_read=",
        "blksize=",
        "fsname=",
        "subtype=",
        "source=",
    ]
    .iter()
    .any(|p| o.starts_with(p))
}

/// The flags for `mount(2)` `MS_REMOUNT` of a mount whose flags are now
/// `current`, with the option list of `-o remount,...` applied. The
/// kernel resets every flag not passed, so the current ones are kept
/// unless an option changes them.
///
/// `threads=`, `push=` and `transport=` can not change on a running
/// mount: each is refused unless it is among `kept`, the options the
/// mount was started with (a remount passing the mount's own options
/// again, as xfstests does, changes nothing).
fn remount_flags(
    current: MountFlags,
    list: &str,
    sloppy: bool,
    kept: &[String],
) -> Result<MountFlags, String> {
    let mut f = current;
    for o in list.split(',') {
        if let Some(k) = kernel(o) {
            let (set, clear) = match k {
                MountOption::RO => (MountFlags::RDONLY, MountFlags::empty()),
                MountOption::NoSuid => (MountFlags::NOSUID, MountFlags::empty()),
                MountOption::Suid => (MountFlags::empty(), MountFlags::NOSUID),
                MountOption::NoDev => (MountFlags::NODEV, MountFlags::empty()),
                MountOption::Dev => (MountFlags::empty(), MountFlags::NODEV),
                MountOption::NoExec => (MountFlags::NOEXEC, MountFlags::empty()),
                MountOption::Exec => (MountFlags::empty(), MountFlags::NOEXEC),
                MountOption::NoAtime => (MountFlags::NOATIME, MountFlags::RELATIME),
                MountOption::Atime => (MountFlags::empty(), MountFlags::NOATIME),
                MountOption::Sync => (MountFlags::SYNCHRONOUS, MountFlags::empty()),
                MountOption::DirSync => (MountFlags::DIRSYNC, MountFlags::empty()),
                _ => (MountFlags::empty(), MountFlags::empty()),
            };
            f = (f - clear) | set;
        } else if o == "rw" {
            f -= MountFlags::RDONLY;
        } else if o == "async" {
            f -= MountFlags::SYNCHRONOUS;
        } else if ["threads=", "push=", "transport="]
            .iter()
            .any(|p| o.starts_with(p))
        {
            if !sloppy && !kept.iter().any(|k| k == o) {
                return Err(format!("{o}: can not be changed by remount"));
            }
        } else if o != "remount"
            && !matches!(o, "relatime" | "strictatime")
            && !ignored(o)
            && !fuse_kernel_option(o)
            && !sloppy
        {
            return Err(format!("unknown mount option {o:?}"));
        }
    }
    Ok(f)
}

/// The flags of the mount on `dir` as `mount(2)` takes them.
fn current_flags(dir: &Path) -> std::io::Result<MountFlags> {
    let st = rustix::fs::statvfs(dir)?.f_flag;
    let mut f = MountFlags::empty();
    for (s, m) in [
        (StatVfsMountFlags::RDONLY, MountFlags::RDONLY),
        (StatVfsMountFlags::NOSUID, MountFlags::NOSUID),
        (StatVfsMountFlags::NODEV, MountFlags::NODEV),
        (StatVfsMountFlags::NOEXEC, MountFlags::NOEXEC),
        (StatVfsMountFlags::SYNCHRONOUS, MountFlags::SYNCHRONOUS),
        (StatVfsMountFlags::NOATIME, MountFlags::NOATIME),
        (StatVfsMountFlags::NODIRATIME, MountFlags::NODIRATIME),
        (StatVfsMountFlags::RELATIME, MountFlags::RELATIME),
        // ST_NOSYMFOLLOW, not named by rustix.
        (
            StatVfsMountFlags::from_bits_retain(0x2000),
            MountFlags::NOSYMFOLLOW,
        ),
    ] {
        if st.contains(s) {
            f |= m;
        }
    }
    Ok(f)
}

/// The `-o` options of the `onecopy mount` serving `store` (its pid from
/// `mount.pid`, its options from its command line); none when there is
/// no such process. Read only: nothing is signalled.
fn running_options(store: &Path) -> Vec<String> {
    let Ok(pid) = std::fs::read_to_string(store.join("mount.pid")) else {
        return Vec::new();
    };
    let Ok(cmd) = std::fs::read(format!("/proc/{}/cmdline", pid.trim())) else {
        return Vec::new();
    };
    let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
    if !args.iter().any(|a| *a == b"mount") {
        return Vec::new();
    }
    args.windows(2)
        .filter(|w| w[0] == b"-o")
        .flat_map(|w| {
            String::from_utf8_lossy(w[1])
                .split(',')
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `-o remount,...`: changes the flags of the mount on `dir` in place.
fn remount(h: &HelperArgs) -> ExitCode {
    let flags = current_flags(&h.dir)
        .map_err(|e| format!("{}: {e}", h.dir.display()))
        .and_then(|cur| {
            let kept = running_options(&store_dir(&h.spec));
            remount_flags(cur, &h.options, h.sloppy, &kept)
        });
    let flags = match flags {
        Ok(f) => f,
        Err(e) => {
            errln!("{HELPER_NAME}: {e}");
            return ExitCode::from(exit::USAGE);
        }
    };
    if h.verbose {
        errln!("{HELPER_NAME}: remounting {} ({flags:?})", h.dir.display());
    }
    if h.fake {
        return ExitCode::from(exit::OK);
    }
    match rustix::mount::mount_remount(&h.dir, flags, "") {
        Ok(()) => ExitCode::from(exit::OK),
        Err(e) => {
            errln!("{HELPER_NAME}: remount {}: {e}", h.dir.display());
            ExitCode::from(exit::REFUSED)
        }
    }
}

/// The options of a mount made by the helper: what mount(8) passed, with
/// its defaults `dev` and `suid` (which it does not pass on) added unless
/// it passed `nodev` / `nosuid` (both would conflict).
fn helper_options(passed: &str) -> String {
    let given = |o: &str| passed.split(',').any(|p| p == o);
    let mut opts: Vec<&str> = Vec::new();
    for (on, off) in [("dev", "nodev"), ("suid", "nosuid")] {
        if !given(on) && !given(off) {
            opts.push(on);
        }
    }
    if !passed.is_empty() {
        opts.push(passed);
    }
    opts.join(",")
}

/// The store directory SPEC names: itself, or without the `onecopy:`
/// prefix of the source the mount shows in /proc/mounts (when SPEC as
/// written is not a directory).
fn store_dir(spec: &Path) -> PathBuf {
    match spec.to_str().and_then(|s| s.strip_prefix("onecopy:")) {
        Some(dir) if !spec.is_dir() && !dir.is_empty() => PathBuf::from(dir),
        _ => spec.to_path_buf(),
    }
}

/// True when this process was started as `mount.onecopy` or
/// `mount.fuse.onecopy`.
pub fn invoked_as_helper(argv0: &std::ffi::OsStr) -> bool {
    std::path::Path::new(argv0)
        .file_name()
        .is_some_and(|n| HELPER_NAMES.iter().any(|h| n == *h))
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
            errln!("{HELPER_NAME}: {e}");
            return ExitCode::from(exit::USAGE);
        }
    };
    if h.options.split(',').any(|o| o == "remount") {
        return remount(&h);
    }
    let options = helper_options(&h.options);
    if let Err(e) = parse(&options, h.sloppy) {
        errln!("{HELPER_NAME}: {e}");
        return ExitCode::from(exit::USAGE);
    }
    if h.verbose {
        errln!(
            "{HELPER_NAME}: mounting {} on {} (options {:?})",
            h.spec.display(),
            h.dir.display(),
            h.options
        );
    }
    if h.fake {
        return ExitCode::from(exit::OK);
    }
    mount_cmd::run(MountArgs {
        dir: store_dir(&h.spec),
        mountpoint: Some(h.dir),
        remote: None,
        endpoint: None,
        region: None,
        password_file: None,
        read_only: false,
        own_cache: false,
        foreground: false,
        threads: onecopy_fuse::default_threads(),
        options: Some(options),
        sloppy: h.sloppy,
        notify_ready: false,
        snapshot: None,
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
        assert_eq!(parse("push=5", false).unwrap().push, Some(5));
        let uring = Some(onecopy_fuse::Transport::Uring);
        assert_eq!(parse("transport=uring", false).unwrap().transport, uring);
        assert!(parse("transport=x", false)
            .unwrap_err()
            .contains("dev or uring"));
        assert!(parse("push=0", false).is_err());
    }

    #[test]
    fn standard_options_without_effect_are_accepted() {
        // What mount(8), fstab lines and xfstests pass.
        let o = parse(
            "rw,relatime,nodiratime,lazytime,iversion,strictatime,norelatime,\
             diratime,nolazytime,noiversion,nostrictatime,mand,nomand",
            false,
        )
        .unwrap();
        let strict = Some(onecopy_store::Atime::Strict);
        assert_eq!(
            o,
            MountOpts {
                atime: strict,
                ..MountOpts::default()
            }
        );
        let o = parse("noatime,relatime,nodev", false).unwrap();
        assert_eq!(o.kernel, vec![MountOption::NoAtime, MountOption::NoDev]);
        assert_eq!(
            o.atime,
            Some(onecopy_store::Atime::Relative),
            "the last one counts"
        );
        // Options that would change something we can not apply stay errors.
        assert!(parse("nosymfollow", false).is_err());
        assert!(parse("relatime2", false).is_err());
    }

    #[test]
    fn remount_keeps_flags_not_named() {
        let cur = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::RELATIME;
        // mount(8) given SPEC and DIR passes only what was asked.
        let f = remount_flags(cur, "ro,remount", false, &[]).unwrap();
        assert_eq!(f, cur | MountFlags::RDONLY);
        // Given only DIR it passes back what /proc/mounts shows.
        let f = remount_flags(
            f,
            "rw,nosuid,nodev,relatime,remount,user_id=0,group_id=0,\
             default_permissions,allow_other",
            false,
            &[],
        )
        .unwrap();
        assert_eq!(f, cur);
        let f = remount_flags(cur, "remount,suid,noexec,noatime,sync", false, &[]).unwrap();
        assert_eq!(
            f,
            MountFlags::NODEV | MountFlags::NOEXEC | MountFlags::NOATIME | MountFlags::SYNCHRONOUS
        );
        assert!(remount_flags(cur, "remount,bogus", false, &[]).is_err());
        assert_eq!(remount_flags(cur, "remount,bogus", true, &[]).unwrap(), cur);
        assert!(remount_flags(cur, "remount,threads=2", false, &[]).is_err());
        let kept = ["transport=uring".to_string()];
        assert!(remount_flags(cur, "remount,transport=uring", false, &kept).is_ok());
        assert!(remount_flags(cur, "remount,transport=dev", false, &kept).is_err());
    }

    #[test]
    fn helper_mounts_dev_suid_unless_told_otherwise() {
        let k = |passed: &str| parse(&helper_options(passed), false).unwrap().kernel;
        assert_eq!(k(""), vec![MountOption::Dev, MountOption::Suid]);
        assert_eq!(k("rw"), vec![MountOption::Dev, MountOption::Suid]);
        // Never both of a pair: fuser refuses conflicting options.
        assert_eq!(
            k("rw,nosuid,nodev"),
            vec![MountOption::NoSuid, MountOption::NoDev]
        );
        assert_eq!(k("nosuid"), vec![MountOption::Dev, MountOption::NoSuid]);
        assert_eq!(
            k("nodev,noexec"),
            vec![MountOption::Suid, MountOption::NoDev, MountOption::NoExec]
        );
        // `onecopy mount` itself adds nothing.
        assert_eq!(parse("rw", false).unwrap().kernel, vec![]);
    }

    #[test]
    fn spec_may_be_the_mount_source() {
        let d = std::env::temp_dir();
        let src = format!("onecopy:{}", d.display());
        assert_eq!(store_dir(Path::new(&src)), d);
        assert_eq!(store_dir(&d), d);
        assert_eq!(store_dir(Path::new("/srv/s")), PathBuf::from("/srv/s"));
        assert_eq!(store_dir(Path::new("onecopy:")), PathBuf::from("onecopy:"));
    }

    #[test]
    fn helper_name() {
        assert!(invoked_as_helper("/sbin/mount.onecopy".as_ref()));
        assert!(invoked_as_helper("mount.onecopy".as_ref()));
        assert!(invoked_as_helper("/sbin/mount.fuse.onecopy".as_ref()));
        assert!(invoked_as_helper("mount.fuse.onecopy".as_ref()));
        assert!(!invoked_as_helper("/usr/bin/onecopy".as_ref()));
        assert!(!invoked_as_helper("/sbin/mount.fuse".as_ref()));
        assert!(!invoked_as_helper("/sbin/mount.fuse.other".as_ref()));
    }
}
