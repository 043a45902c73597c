//! `onecopy-fuse`: serves an [`onecopy_store::Store`] through FUSE with
//! `fuser` (pure Rust: no libfuse; mounts directly as root, through
//! `fusermount3` otherwise). Multi-threaded, writeback cache, the largest
//! `max_write` the kernel accepts. [`NullFs`] is the same adapter with
//! writes discarded: the FUSE ceiling the benchmarks compare against.

mod behind;
mod core;
mod dev;
mod lend;
mod null;
mod uring;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{Config, FileType, Filesystem, InitFlags, KernelConfig};
use onecopy_store::{Kind, Store};

pub(crate) use dev::flush_reply;

/// Kernel mount flags (`ro`, `nosuid`, ...) a caller may add to
/// [`mount_config`]'s options.
pub use fuser::MountOption;
pub use null::NullFs;

/// How long the kernel may cache attributes and names (only this process
/// changes the store).
const TTL: Duration = Duration::from_secs(1);

/// `st_blksize`: the I/O size programs are told to prefer.
const BLKSIZE: u32 = 128 * 1024;

/// FUSE worker threads of a mount unless told otherwise: one per CPU, at
/// least 2 (a slow `fsync` or gc pass does not hold up every other
/// request), at most 16. On this 2-CPU VM 2 threads beat 4 (the former
/// default) at every workload measured (4 rounds alternately): fio 1 MiB
/// 1st write 522 against 406 MB/s, cold read 1016 against 888, `cp -a` of
/// 10,000 files 4.26 against 4.67 s; 1 thread lost on reads and `cp -a`
/// (709 MB/s, 5.88 s), 3 on `cp -a` (4.92 s): a thread beyond the CPUs is
/// a cold thread woken for a request.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 16)
}

/// Mount options and threads used for every onecopy mount.
///
/// The mount's type reads `fuse.onecopy` in /proc/mounts (so `mount -o
/// remount` and `umount -t` find the onecopy helper): fuser passes its
/// `Subtype` only to fusermount3, so a mount made directly by root names
/// the subtype as a kernel option instead.
pub fn mount_config(fsname: &str, threads: usize) -> Config {
    let mut c = Config::default();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let subtype = if unsafe { libc::geteuid() } == 0 {
        MountOption::CUSTOM("subtype=onecopy".into())
    } else {
        MountOption::Subtype("onecopy".into())
    };
    c.mount_options = vec![
        MountOption::FSName(fsname.to_string()),
        subtype,
        MountOption::DefaultPermissions,
    ];
    // Every user may use the mount; the kernel checks permissions.
    c.acl = fuser::SessionACL::All;
    c.n_threads = Some(threads.max(1));
    c.clone_fd = true;
    c
}

/// Mounts `fs` on `mountpoint` and serves it until unmounted.
pub fn serve<F: Filesystem>(fs: F, mountpoint: &Path, config: &Config) -> std::io::Result<()> {
    fuser::mount(fs, mountpoint, config)
}

/// Which kernel interface carries a mount's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// `/dev/fuse`, read by `fuser` threads (one per CPU).
    Dev,
    /// FUSE over io_uring: a ring per CPU, each request served on its
    /// caller's CPU (needs the fuse module's `enable_uring`).
    Uring,
}

impl Transport {
    /// The transport of a mount that names none: FUSE over io_uring when
    /// this kernel serves it to this process now (no [`uring_refusal`]),
    /// else `/dev/fuse`. io_uring answers each request on its caller's
    /// CPU: small files cost half the time, and big files meet the same
    /// goals (ARCHITECTURE.md, "FUSE adapter").
    pub fn preferred() -> Transport {
        match uring_refusal() {
            None => Transport::Uring,
            Some(_) => Transport::Dev,
        }
    }

    /// How `mount -o transport=` names it.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Dev => "dev",
            Transport::Uring => "uring",
        }
    }
}

/// Why this kernel would not serve this process FUSE over io_uring now,
/// or `None` if it would: the fuse module's `enable_uring` must be `Y`
/// (the kernel has the transport and root turned it on), and
/// `kernel.io_uring_disabled` must let the process make rings (0; or 1
/// for root, taken as privileged, and members of `kernel.io_uring_group`).
/// Over io_uring a mount appears before its rings are made, so a refusal
/// found only then would unmount a mount already reported ready.
pub fn uring_refusal() -> Option<String> {
    let read = |p: &str| std::fs::read_to_string(p).map(|v| v.trim().to_string());
    let enable = "/sys/module/fuse/parameters/enable_uring";
    if read(enable).ok().as_deref() != Some("Y") {
        return Some(format!(
            "FUSE over io_uring is off in this kernel ({enable} is not Y)"
        ));
    }
    let disabled = "/proc/sys/kernel/io_uring_disabled";
    match read(disabled).as_deref() {
        Err(_) | Ok("0") => None,
        Ok("1") if may_make_rings() => None,
        Ok(v) => Some(format!(
            "io_uring is turned off for this process ({disabled} is {v})"
        )),
    }
}

/// Under `io_uring_disabled` = 1: whether this process holds
/// `CAP_SYS_ADMIN` (the kernel's test, not the uid: root without it is
/// refused) or is in `kernel.io_uring_group` (-1, or unreadable: no group).
fn may_make_rings() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if effective_caps(&status).is_some_and(|c| c & (1 << CAP_SYS_ADMIN) != 0) {
        return true;
    }
    let group = std::fs::read_to_string("/proc/sys/kernel/io_uring_group");
    let Some(g) = group
        .ok()
        .and_then(|g| g.trim().parse::<libc::gid_t>().ok())
    else {
        return false;
    };
    // SAFETY: getegid has no preconditions and cannot fail.
    if unsafe { libc::getegid() } == g {
        return true;
    }
    // SAFETY: a size of 0 asks only for the count.
    let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    let mut groups = vec![0 as libc::gid_t; n.max(0) as usize];
    // SAFETY: `groups` has room for the count passed.
    let n = unsafe { libc::getgroups(n, groups.as_mut_ptr()) };
    n > 0 && groups[..n as usize].contains(&g)
}

/// The bit of `CAP_SYS_ADMIN` in a capability set (linux/capability.h).
const CAP_SYS_ADMIN: u32 = 21;

/// The effective capability set in a `/proc/PID/status` text (`CapEff:`,
/// hexadecimal), or None where it has none or it does not parse.
fn effective_caps(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(line.trim(), 16).ok()
}

/// Mounts the store over `transport` and serves it until unmounted,
/// committing its metadata every second (see the crash model), with store
/// inode `root` as the mount's root: 1, or a snapshot's root
/// (`Store::snapshot_root`), then mounted read-only. `ready` runs once the
/// mount is in place (to daemonize).
pub fn serve_store_on(
    transport: Transport,
    store: Arc<Store>,
    root: u64,
    mountpoint: &Path,
    config: &Config,
    ready: impl FnOnce(),
) -> std::io::Result<()> {
    store.keep_until_forgotten();
    let mut config = config.clone();
    if root != 1 {
        config.mount_options.push(fuser::MountOption::RO);
    }
    let (behind, drops) = behind::Behind::new(store.is_remote());
    let core = core::Core::new(store.clone(), root, behind);
    let session = match transport {
        Transport::Dev => Session::Dev(fuser::Session::new(
            dev::StoreFs::new(core),
            mountpoint,
            &config,
        )?),
        Transport::Uring => Session::Uring(uring::session(core, mountpoint, &config)?),
    };
    session.drop_behind(drops);
    if transport == Transport::Dev {
        // fuser has read the init reply by now; over io_uring the kernel
        // reads it later (`uring::UringFs::negotiated` widens it then).
        widen_readahead(mountpoint);
    }
    ready();
    let stop = Arc::new(Stop::default());
    let committer = {
        let (store, stop) = (store.clone(), stop.clone());
        named("onecopy-commit", move || {
            // The same error every second (a poisoned store fails every
            // commit until remounted) is reported once.
            let mut last = String::new();
            while !stop.wait(Duration::from_secs(1)) {
                match store.flush_all(false) {
                    Err(e) if e.to_string() != last => {
                        last = e.to_string();
                        onecopy_store::warn!("onecopy: periodic commit failed: {last}");
                    }
                    Err(_) => {}
                    Ok(()) => last.clear(),
                }
            }
        })?
    };
    let releaser = {
        let (store, stop) = (store.clone(), stop.clone());
        named("onecopy-release", move || {
            while !stop.is_set() {
                if store.wait_for_releases(Duration::from_millis(10)) {
                    store.settle_releases();
                }
            }
        })?
    };
    // Decodes the next files of a walk reading the mount (see the
    // store's `ahead.rs`).
    let reader = {
        let (store, stop) = (store.clone(), stop.clone());
        named("onecopy-ahead", move || {
            while !stop.is_set() {
                store.read_ahead(Duration::from_millis(50));
            }
        })?
    };
    let pusher = (store.is_remote() || store.is_follower())
        .then(|| spawn_pusher(store.clone(), stop.clone()))
        .transpose()?;
    let r = session.run();
    stop.set();
    let _ = committer.join();
    let _ = releaser.join();
    let _ = reader.join();
    if let Some(p) = pusher {
        let _ = p.join();
    }
    store
        .flush_all(true)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    store
        .close_remote()
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    r
}

/// A background thread of the mount, named so that `top -H`, `ps -L`
/// and profiles tell them apart.
fn named(
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name(name.into()).spawn(f)
}

/// The mount's end, told to its background threads: a thread waiting
/// for its next round wakes at once (an unmount used to wait up to a
/// second for the committer's sleep to end).
#[derive(Default)]
struct Stop {
    set: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Stop {
    fn set(&self) {
        *self.set.lock().unwrap() = true;
        self.cv.notify_all();
    }

    fn is_set(&self) -> bool {
        *self.set.lock().unwrap()
    }

    /// Waits `d` or until set; whether set.
    fn wait(&self, d: Duration) -> bool {
        let g = self.set.lock().unwrap();
        *self.cv.wait_timeout_while(g, d, |set| !*set).unwrap().0
    }
}

/// A mounted session of either transport.
enum Session {
    Dev(fuser::Session<dev::StoreFs>),
    Uring(uring::Session),
}

impl Session {
    /// Sends the pages to drop behind writers (see `behind.rs`) to the
    /// kernel through this transport's notifications.
    fn drop_behind(&self, drops: std::sync::mpsc::Receiver<behind::Pages>) {
        match self {
            Session::Dev(s) => {
                let n = s.notifier();
                behind::serve(drops, move |ino, off, len| {
                    n.inval_inode(fuser::INodeNo(ino), off, len)
                })
            }
            Session::Uring(s) => {
                let n = s.notifier();
                behind::serve(drops, move |ino, off, len| n.inval_inode(ino, off, len))
            }
        }
    }

    /// Serves requests until the filesystem is unmounted.
    fn run(self) -> std::io::Result<()> {
        match self {
            Session::Dev(s) => s.run(),
            Session::Uring(s) => s.run(),
        }
    }
}

/// A remote store's pushes to its bucket (or a follower's moves to the
/// bucket's latest state), every [`Store::push_every`], on a thread of
/// their own (a push may wait a minute for uploads; commits go on
/// meanwhile).
fn spawn_pusher(
    store: Arc<Store>,
    stop: Arc<Stop>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    named("onecopy-push", move || {
        let mut last = String::new();
        let mut due = std::time::Instant::now() + store.push_every();
        // Woken every 200 ms: `push_every` may change meanwhile.
        while !stop.wait(Duration::from_millis(200)) {
            if std::time::Instant::now() < due {
                continue;
            }
            due = std::time::Instant::now() + store.push_every();
            let r = match store.is_follower() {
                true => store.follow_remote().map(|_| ()),
                false => store.push_remote().map(|_| ()),
            };
            match r {
                Err(e) if e.to_string() != last => {
                    last = e.to_string();
                    onecopy_store::warn!("onecopy: exchange with the bucket failed: {last}");
                }
                Err(_) => {}
                Ok(_) => last.clear(),
            }
        }
    })
}

/// Readahead asked of the kernel, KiB.
const READAHEAD_KB: u32 = 4096;

/// The kernel keeps a FUSE mount's readahead at the default 128 KiB
/// whatever `max_readahead` the init reply offers; as root, raise it
/// through the mount's backing-device entry in sysfs (found in
/// `/proc/self/mountinfo`: a `stat` of the mount point would wait for
/// this very process). Best effort: unprivileged mounts keep 128 KiB.
pub(crate) fn widen_readahead(mountpoint: &Path) {
    let Ok(mp) = mountpoint.canonicalize() else {
        return;
    };
    let Ok(mounts) = onecopy_ioctl::mounts::read() else {
        return;
    };
    let dev = mounts
        .into_iter()
        .rev()
        .find(|m| m.mount_point == mp)
        .map(|m| m.dev);
    if let Some(dev) = dev {
        let path = format!("/sys/class/bdi/{dev}/read_ahead_kb");
        if let Err(e) = std::fs::write(&path, READAHEAD_KB.to_string()) {
            if e.kind() != std::io::ErrorKind::PermissionDenied {
                onecopy_store::warn!("onecopy: cannot set readahead ({path}): {e}");
            }
        }
    }
}

/// Sets the kernel options every onecopy mount wants. Among them
/// FUSE_HANDLE_KILLPRIV_V2: the kernel then marks the mount `SB_NOSEC`
/// and stops asking for `security.capability` (a `GETXATTR` round trip)
/// before every `write(2)` of a file that has no setuid, setgid or
/// capability; in exchange the filesystem clears setuid/setgid itself
/// (see [`setid_kill`]). Measured: fio 1 MiB writes waited 2.1 s of 5 s
/// for those answers while the mount's threads were busy storing.
/// READDIRPLUS (with the kernel's AUTO choice): listings carry attributes,
/// no `LOOKUP` per entry for `ls -l`, `find` or `du`. FUSE_POSIX_ACL: the
/// kernel enforces POSIX ACLs (read with GETXATTR and cached) in its
/// permission checks; the store inherits default ACLs and keeps mode and
/// ACL in step (`acl.rs`), with the umask passed through (FUSE_DONT_MASK).
/// FUSE_EXPORT_SUPPORT: file handles (`open_by_handle_at`, NFS export)
/// stay valid after the kernel forgets an inode; it looks the number up
/// again with `.` and `..` (see `Store::lookup`).
///
/// A follower (a read-only mount of a bucket) sees its files change under
/// it at each move to the writer's latest state: no writeback cache, under
/// which the kernel keeps its own size and mtime of a cached file and
/// would serve a file seen mid-write short for as long as it stays
/// cached; and its cached pages are dropped when a file's mtime changes
/// (`AUTO_INVAL_DATA`), as they are when its size does.
pub(crate) fn tune(config: &mut KernelConfig, follower: bool) {
    let caching = match follower {
        false => InitFlags::FUSE_WRITEBACK_CACHE,
        true => InitFlags::FUSE_AUTO_INVAL_DATA,
    };
    let wanted = caching
        | InitFlags::FUSE_PARALLEL_DIROPS
        | InitFlags::FUSE_ASYNC_DIO
        | InitFlags::FUSE_BIG_WRITES
        | InitFlags::FUSE_HANDLE_KILLPRIV_V2
        | InitFlags::FUSE_DO_READDIRPLUS
        | InitFlags::FUSE_READDIRPLUS_AUTO
        | InitFlags::FUSE_POSIX_ACL
        | InitFlags::FUSE_DONT_MASK
        | InitFlags::FUSE_EXPORT_SUPPORT;
    let _ = config.add_capabilities(wanted & config.capabilities());
    let _ = config
        .set_max_readahead(4 << 20)
        .or_else(|max| config.set_max_readahead(max));
    let _ = config.set_max_background(64);
}

fn time(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

fn ns(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i64,
        Err(e) => -(e.duration().as_nanos() as i64),
    }
}

pub(crate) fn file_type(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::Char => FileType::CharDevice,
        Kind::Block => FileType::BlockDevice,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_caps_read_from_status() {
        let root = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        assert!(effective_caps(root).unwrap() & (1 << CAP_SYS_ADMIN) != 0);
        // root in a container that dropped CAP_SYS_ADMIN (bit 21)
        let dropped = "CapEff:\t00000000a80425fb\n";
        assert_eq!(effective_caps(dropped).unwrap() & (1 << CAP_SYS_ADMIN), 0);
        assert_eq!(effective_caps("Name:\tx\n"), None);
        assert_eq!(effective_caps("CapEff:\tzz\n"), None);
    }
}
