//! `onecopy mount DIR MOUNTPOINT`: serve a store through FUSE. Without
//! `-f` the command re-runs itself in the foreground as a child, waits
//! until the child's mount is ready, and exits (the child is the daemon;
//! its messages go to DIR/mount.log).

use onecopy_fuse::Transport;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;

use clap::Args;
use onecopy_store::Store;

use crate::exit;
use crate::mount_helper;
use crate::store_cmd::error_code;

#[derive(Debug, Args)]
#[command(
    after_help = crate::exit::HELP
)]
pub struct MountArgs {
    /// The store (made with `onecopy store init`); with --remote, the
    /// mount point.
    pub dir: PathBuf,
    /// Where to mount it.
    pub mountpoint: Option<PathBuf>,
    /// Mount the store in this bucket read-only, from a private cache made
    /// for the mount (`s3://BUCKET/PREFIX`; needs --read-only): it serves
    /// the last state the writer pushed and follows new ones (every 30 s,
    /// or -o push=SECS). Takes the password like `store init --recover`.
    #[arg(long, value_name = "URL", requires = "read_only")]
    pub remote: Option<String>,
    /// With --remote: the S3 server (default: AWS).
    #[arg(long, value_name = "URL", requires = "remote")]
    pub endpoint: Option<String>,
    /// With --remote: the bucket's region.
    #[arg(long, requires = "remote")]
    pub region: Option<String>,
    /// With --remote: the passphrase on the first line of FILE (or in
    /// ONECOPY_PASSWORD).
    #[arg(long, value_name = "FILE", requires = "remote")]
    pub password_file: Option<PathBuf>,
    /// Mount read-only (as -o ro); with --remote, a read-only mount
    /// following the bucket.
    #[arg(long)]
    pub read_only: bool,
    /// Internal: the cache is the mount's own, removed at unmount.
    #[arg(long, hide = true)]
    pub own_cache: bool,
    /// Stay in the foreground until unmounted (SIGINT/SIGTERM unmount).
    #[arg(short = 'f', long)]
    pub foreground: bool,
    /// FUSE worker threads (default: one per CPU, at least 2, at most 16).
    #[arg(long, default_value_t = onecopy_fuse::default_threads(),
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub threads: usize,
    /// Mount options, comma-separated: ro, nosuid, nodev, noexec, noatime,
    /// sync, dirsync, threads=N, transport=dev|uring (default: uring when the kernel's fuse
    /// module has enable_uring on, else dev), push=SECS (a remote store's metadata
    /// goes to its bucket every SECS, default 30); fstab's defaults, auto, noauto, user,
    /// nofail, _netdev, x-*, allow_other are accepted and ignored.
    #[arg(short = 'o', long = "options")]
    pub options: Option<String>,
    /// Skip unknown mount options instead of refusing them (mount -s).
    #[arg(long, hide = true)]
    pub sloppy: bool,
    /// Mount snapshot NAME alone, read-only, instead of the live tree.
    #[arg(long, value_name = "NAME")]
    pub snapshot: Option<String>,
    /// Internal: print "ready" on stdout once mounted.
    #[arg(long, hide = true)]
    pub notify_ready: bool,
}

/// The mount point (resolved by [`run`]).
fn mnt(a: &MountArgs) -> &Path {
    a.mountpoint.as_deref().expect("resolved in run")
}

/// `--read-only --remote URL MOUNTPOINT`: makes the mount's own cache, a
/// follower of the bucket, in a private directory under /var/tmp, and
/// turns the arguments into a mount of it.
fn follow_cache(a: &mut MountArgs) -> Result<(), ExitCode> {
    let fail = |e: &dyn std::fmt::Display, code: u8| {
        errln!("onecopy: {e}");
        ExitCode::from(code)
    };
    if a.mountpoint.is_some() {
        return Err(fail(
            &"with --remote, give only the mount point",
            exit::USAGE,
        ));
    }
    let spec = onecopy_store::RemoteSpec {
        url: a.remote.clone().expect("checked"),
        endpoint: a.endpoint.clone(),
        region: a.region.clone(),
        cache_size: None,
        read_only: true,
        key: None,
        grace_secs: None,
        patience_secs: None,
    };
    let pw = crate::store_cmd::read_password(a.password_file.as_deref())
        .map_err(|e| fail(&e, error_code(&e)))?;
    let cache = tempfile::Builder::new()
        .prefix("onecopy-follow.")
        .tempdir_in("/var/tmp")
        .map_err(|e| fail(&e, exit::FATAL))?
        .keep();
    if let Err(e) = onecopy_store::bucket::follow(&cache, &spec, pw.as_deref()) {
        let _ = std::fs::remove_dir_all(&cache);
        return Err(fail(&e, error_code(&e)));
    }
    a.mountpoint = Some(std::mem::replace(&mut a.dir, cache));
    a.remote = None;
    a.own_cache = true;
    add_ro(a);
    Ok(())
}

/// Adds `ro` to the mount options.
fn add_ro(a: &mut MountArgs) {
    let ro = match a.options.take() {
        Some(o) => format!("{o},ro"),
        None => "ro".into(),
    };
    a.options = Some(ro);
}

/// C allocator arenas of a mount: its FUSE workers and gc threads share
/// them (ARCHITECTURE "Memory of the mount": 8 arenas held ~110 MiB free
/// at 1 M files).
const MALLOC_ARENAS: u32 = 2;

pub fn run(mut a: MountArgs) -> ExitCode {
    onecopy_ioctl::process::limit_malloc_arenas(MALLOC_ARENAS);
    if a.remote.is_some() {
        if let Err(code) = follow_cache(&mut a) {
            return code;
        }
    } else if a.read_only {
        add_ro(&mut a);
    }
    if a.mountpoint.is_none() {
        errln!("onecopy: mount DIR MOUNTPOINT (or --read-only --remote URL MOUNTPOINT)");
        return ExitCode::from(exit::USAGE);
    }
    if !mnt(&a).is_dir() {
        let why = match std::fs::symlink_metadata(mnt(&a)) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "no such directory",
            _ => "mount point is not a directory",
        };
        errln!("onecopy: {}: {why}", mnt(&a).display());
        return ExitCode::from(exit::USAGE);
    }
    if let Some(why) = tangled(&a.dir, mnt(&a)) {
        errln!("onecopy: {}: {why}", mnt(&a).display());
        if a.own_cache {
            let _ = std::fs::remove_dir_all(&a.dir);
        }
        return ExitCode::from(exit::USAGE);
    }
    match mount_helper::parse(a.options.as_deref().unwrap_or(""), a.sloppy) {
        Err(e) => {
            errln!("onecopy: {e}");
            return ExitCode::from(exit::USAGE);
        }
        Ok(o) if o.transport == Some(Transport::Uring) => {
            if let Some(why) = onecopy_fuse::uring_refusal() {
                errln!("onecopy: transport=uring: {why}");
                return ExitCode::from(exit::USAGE);
            }
        }
        Ok(_) => {}
    }
    if let Err(e) = Store::read_config(&a.dir) {
        errln!("onecopy: {e}");
        return ExitCode::from(error_code(&e));
    }
    if is_mount_point(mnt(&a)) {
        errln!(
            "onecopy: {}: already a mount point (busy); unmount it first",
            mnt(&a).display()
        );
        return ExitCode::from(exit::REFUSED);
    }
    if a.foreground {
        foreground(&a)
    } else {
        daemonize(&a)
    }
}

/// Why a mount of the store `dir` on `mnt` would reach its own files
/// through itself, if it would: the mount point inside the store (the
/// store's files then hidden behind the mount), or the store under the
/// mount point. Its first write of the store through itself would wait
/// for itself, for ever.
fn tangled(dir: &Path, mnt: &Path) -> Option<String> {
    let (Ok(d), Ok(m)) = (dir.canonicalize(), mnt.canonicalize()) else {
        return None;
    };
    if m.starts_with(&d) {
        Some(format!("mount point is in the store {}", d.display()))
    } else if d.starts_with(&m) {
        Some(format!(
            "the store {} is under this mount point",
            d.display()
        ))
    } else {
        None
    }
}

fn foreground(a: &MountArgs) -> ExitCode {
    let store = match crate::control::open_store(&a.dir) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            errln!("onecopy: {e}");
            return ExitCode::from(error_code(&e));
        }
    };
    let pid_file = a.dir.join("mount.pid");
    let _ = std::fs::write(&pid_file, std::process::id().to_string());
    let control = match crate::control::listen(&store, mnt(a)) {
        Ok(c) => Some(c),
        Err(e) => {
            errln!("onecopy: control socket (online gc): {e}; `store gc` cannot reach this mount");
            None
        }
    };
    handle_signals(mnt(a).to_path_buf());
    let opts =
        mount_helper::parse(a.options.as_deref().unwrap_or(""), a.sloppy).expect("checked in run");
    // The canonical path: `store gc` and `fsck` find the mount by it.
    let dir = a.dir.canonicalize().unwrap_or_else(|_| a.dir.clone());
    let name = format!("onecopy:{}", dir.display());
    store.set_atime(opts.atime.unwrap_or(onecopy_store::Atime::Relative));
    if let Some(secs) = opts.push {
        store.set_push_every(std::time::Duration::from_secs(secs));
    }
    let mut config = onecopy_fuse::mount_config(&name, opts.threads.unwrap_or(a.threads));
    config.mount_options.extend(opts.kernel);
    let notify = a.notify_ready;
    let root = match &a.snapshot {
        None => 1,
        Some(name) => match store.snapshot_root(name) {
            Ok(r) => r,
            Err(_) => {
                errln!("onecopy: {}: no snapshot named {name:?}", a.dir.display());
                drop(control);
                close_store(store);
                let _ = std::fs::remove_file(&pid_file);
                return ExitCode::from(exit::USAGE);
            }
        },
    };
    let transport = opts.transport.unwrap_or_else(Transport::preferred);
    onecopy_store::warn!(
        "onecopy: mounting {} over transport={}",
        mnt(a).display(),
        transport.name()
    );
    let r = onecopy_fuse::serve_store_on(transport, store.clone(), root, mnt(a), &config, || {
        if notify {
            let mut out = std::io::stdout();
            let _ = writeln!(out, "ready");
            let _ = out.flush();
        }
    });
    drop(control);
    close_store(store);
    let _ = std::fs::remove_file(&pid_file);
    if a.own_cache {
        let _ = std::fs::remove_dir_all(&a.dir);
    }
    match r {
        Ok(()) => ExitCode::from(exit::OK),
        Err(e) => {
            onecopy_store::warn!("onecopy: mount {}: {e}", mnt(a).display());
            ExitCode::from(exit::REFUSED)
        }
    }
}

/// Closes the store once every other holder (an online gc still running)
/// let go, so that its lock is released before `mount.pid` is removed and
/// the process exits: the lock must not outlive the pid file, or an
/// offline command run right after the daemon is seen gone finds the
/// store "in use" (the kernel closes a dying process's files only after
/// all its threads have exited).
fn close_store(mut store: Arc<Store>) {
    loop {
        match Arc::try_unwrap(store) {
            Ok(s) => return drop(s),
            Err(still_shared) => store = still_shared,
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// SIGINT/SIGTERM lazily unmount, which ends the session cleanly.
fn handle_signals(mountpoint: PathBuf) {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) else {
        return;
    };
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            let _ = rustix::mount::unmount(&mountpoint, rustix::mount::UnmountFlags::DETACH);
        }
    });
}

fn daemonize(a: &MountArgs) -> ExitCode {
    let log_path = a.dir.join("mount.log");
    let log = match std::fs::File::options()
        .create(true)
        .append(true)
        .open(&log_path)
    {
        Ok(f) => f,
        Err(e) => {
            let c = if a.dir.is_dir() {
                exit::FATAL
            } else {
                exit::USAGE
            };
            errln!("onecopy: {}: {e}", log_path.display());
            return ExitCode::from(c);
        }
    };
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("onecopy"));
    let mut child = match Command::new(exe)
        .arg("mount")
        .arg(&a.dir)
        .arg(mnt(a))
        .args(["-f", "--notify-ready", "--threads", &a.threads.to_string()])
        .args(a.options.iter().flat_map(|o| ["-o", o.as_str()]))
        .args(a.sloppy.then_some("--sloppy"))
        .args(a.snapshot.iter().flat_map(|n| ["--snapshot", n.as_str()]))
        .args(a.own_cache.then_some("--own-cache"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .process_group(0)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            errln!("onecopy: can not start the mount process: {e}");
            return ExitCode::from(exit::FATAL);
        }
    };
    let mut line = String::new();
    let out = child.stdout.take().expect("piped");
    let _ = BufReader::new(out).read_line(&mut line);
    if line.trim() == "ready" {
        return ExitCode::from(exit::OK);
    }
    let status = child.wait().ok().and_then(|s| s.code()).unwrap_or(4) as u8;
    errln!("onecopy: mount failed: {}", last_line(&log_path));
    ExitCode::from(if status == 0 { exit::FATAL } else { status })
}

/// The log's last line that is not blank: the daemon's reason for failing
/// (a message carrying a tool's own newline ends in a blank line).
fn last_line(path: &Path) -> String {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .rfind(|l| !l.trim().is_empty())
                .map(|l| l.trim_start_matches("onecopy: ").to_string())
        })
        .unwrap_or_else(|| "see the log".into())
}

/// True when a filesystem is already mounted on `path` (a mount over it
/// would hide it; refused as busy). An autofs trigger does not count:
/// systemd's automount (`x-systemd.automount`) mounts over it.
fn is_mount_point(path: &Path) -> bool {
    let Ok(path) = path.canonicalize() else {
        return false;
    };
    let Ok(mounts) = onecopy_ioctl::mounts::read() else {
        return false;
    };
    mounts
        .iter()
        .any(|m| m.mount_point == path && m.fstype != "autofs")
}
