// Modified for onecopy from fractal-fuse 0.6.1: see PATCHES.md.
use std::ffi::{CString, OsString};
use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;

use nix::sys::socket::{self, AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType};
use tracing::debug;

use crate::abi::*;

fn find_fusermount3() -> io::Result<std::path::PathBuf> {
    which::which("fusermount3")
        .map_err(|err| io::Error::other(format!("find fusermount3 binary failed {err:?}")))
}

/// Mount a FUSE filesystem using fusermount3 (unprivileged mount).
/// Returns the /dev/fuse file descriptor.
pub fn fusermount(mount_options: &MountOptions, mount_path: &Path) -> io::Result<OwnedFd> {
    let (sock0, sock1) = socket::socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::empty(),
    )?;

    let binary_path = find_fusermount3()?;

    let options = build_mount_options(mount_options);
    debug!("mount options {:?}", options);

    let fd0 = sock0.as_raw_fd();

    let status = Command::new(binary_path)
        .env("_FUSE_COMMFD", fd0.to_string())
        .args([OsString::from("-o"), options, mount_path.into()])
        .status()?;

    if !status.success() {
        return Err(io::Error::other("fusermount3 failed"));
    }

    let fd1 = sock1.as_raw_fd();
    let fuse_fd = receive_fuse_fd(fd1)?;

    Ok(unsafe { OwnedFd::from_raw_fd(fuse_fd) })
}

/// Mount a FUSE filesystem: as root by the `mount(2)` system call
/// ([`mount_direct`]), otherwise through fusermount3 ([`fusermount`]).
/// Returns the `/dev/fuse` file descriptor and whether it was a direct
/// mount (which [`unmount`] needs to know).
pub fn mount(mount_options: &MountOptions, mount_path: &Path) -> io::Result<(OwnedFd, bool)> {
    if unsafe { libc::geteuid() } == 0 {
        mount_direct(mount_options, mount_path).map(|fd| (fd, true))
    } else {
        fusermount(mount_options, mount_path).map(|fd| (fd, false))
    }
}

/// Unmount what [`mount`] mounted (`direct` as it returned).
pub fn unmount(mount_path: &Path, direct: bool) -> io::Result<()> {
    if !direct {
        return fusermount_unmount(mount_path);
    }
    let path = CString::new(mount_path.as_os_str().as_bytes())?;
    if unsafe { libc::umount2(path.as_ptr(), 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Mount a FUSE filesystem by the `mount(2)` system call (needs
/// `CAP_SYS_ADMIN`), as libfuse does for root: opens `/dev/fuse` and
/// mounts with type `fuse` (`fuse.SUBTYPE` with a subtype), source
/// `fsname`, `nosuid,nodev` unless `suid`/`dev` are given among the custom
/// options. `rootmode` is a file mode (e.g. `libc::S_IFDIR`; default: the
/// type of the mount point). Of the custom options, the generic ones
/// (`ro`, `rw`, `[no]suid`, `[no]dev`, `[no]exec`, `[no]atime`,
/// `[no]diratime`, `relatime`, `strictatime`, `sync`, `async`, `dirsync`)
/// become mount flags, `subtype=` and `fsname=` are honoured, the
/// fusermount-only `allow_root`, `auto_unmount` and `nonempty` are
/// ignored, and the rest is passed to the kernel.
pub fn mount_direct(opts: &MountOptions, mount_path: &Path) -> io::Result<OwnedFd> {
    let dev = CString::new("/dev/fuse")?;
    let fd = unsafe { libc::open(dev.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };

    let rootmode = match opts.rootmode {
        Some(m) => m,
        None => {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(mount_path)?.mode() & libc::S_IFMT
        }
    };
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if opts.read_only {
        flags |= libc::MS_RDONLY;
    }
    let mut fsname = opts.fs_name.clone().unwrap_or_else(|| "fuse".to_string());
    let mut subtype = opts.subtype.clone();
    let mut data = vec![
        format!("fd={}", fd.as_raw_fd()),
        format!("rootmode={:o}", rootmode),
        format!(
            "user_id={}",
            opts.uid.unwrap_or_else(|| unsafe { libc::getuid() })
        ),
        format!(
            "group_id={}",
            opts.gid.unwrap_or_else(|| unsafe { libc::getgid() })
        ),
    ];
    if opts.allow_other {
        data.push("allow_other".to_string());
    }
    if opts.default_permissions {
        data.push("default_permissions".to_string());
    }
    let custom = opts
        .custom_options
        .as_ref()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    for opt in custom.split(',').filter(|o| !o.is_empty()) {
        let (set, clear) = match opt {
            "ro" => (libc::MS_RDONLY, 0),
            "rw" => (0, libc::MS_RDONLY),
            "nosuid" => (libc::MS_NOSUID, 0),
            "suid" => (0, libc::MS_NOSUID),
            "nodev" => (libc::MS_NODEV, 0),
            "dev" => (0, libc::MS_NODEV),
            "noexec" => (libc::MS_NOEXEC, 0),
            "exec" => (0, libc::MS_NOEXEC),
            "noatime" => (libc::MS_NOATIME, 0),
            "atime" => (0, libc::MS_NOATIME),
            "nodiratime" => (libc::MS_NODIRATIME, 0),
            "diratime" => (0, libc::MS_NODIRATIME),
            "relatime" => (libc::MS_RELATIME, 0),
            "strictatime" => (libc::MS_STRICTATIME, 0),
            "sync" => (libc::MS_SYNCHRONOUS, 0),
            "async" => (0, libc::MS_SYNCHRONOUS),
            "dirsync" => (libc::MS_DIRSYNC, 0),
            "allow_root" | "auto_unmount" | "nonempty" => {
                // allow_root: root owns the mount, so it is the default.
                debug!("direct mount: ignoring option {opt}");
                continue;
            }
            _ => {
                if let Some(v) = opt.strip_prefix("subtype=") {
                    subtype = Some(v.to_string());
                } else if let Some(v) = opt.strip_prefix("fsname=") {
                    fsname = v.to_string();
                } else {
                    data.push(opt.to_string());
                }
                continue;
            }
        };
        flags = (flags | set) & !clear;
    }
    let fstype = match &subtype {
        Some(st) => format!("fuse.{st}"),
        None => "fuse".to_string(),
    };
    let data = data.join(",");
    debug!("mount(2): source={fsname} type={fstype} flags={flags:#x} data={data}");

    let source = CString::new(fsname)?;
    let target = CString::new(mount_path.as_os_str().as_bytes())?;
    let fstype = CString::new(fstype)?;
    let data = CString::new(data)?;
    let r = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Unmount a FUSE filesystem.
pub fn fusermount_unmount(mount_path: &Path) -> io::Result<()> {
    let binary_path = find_fusermount3()?;

    let status = Command::new(binary_path)
        .arg("-u")
        .arg(mount_path.as_os_str())
        .status()?;

    if !status.success() {
        return Err(io::Error::other("fusermount3 -u failed"));
    }

    Ok(())
}

fn receive_fuse_fd(sock_fd: RawFd) -> io::Result<RawFd> {
    let mut buf = vec![];
    let mut cmsg_buf = nix::cmsg_space!([RawFd; 1]);
    let mut bufs = [IoSliceMut::new(&mut buf)];

    let msg = socket::recvmsg::<()>(sock_fd, &mut bufs, Some(&mut cmsg_buf), MsgFlags::empty())
        .map_err(io::Error::from)?;

    if let Some(ControlMessageOwned::ScmRights(fds)) = msg.cmsgs().map_err(io::Error::from)?.next()
    {
        if fds.is_empty() {
            return Err(io::Error::other("no fuse fd received"));
        }
        Ok(fds[0])
    } else {
        Err(io::Error::other("failed to receive fuse fd"))
    }
}

fn build_mount_options(opts: &MountOptions) -> OsString {
    let mut parts = vec![
        format!(
            "user_id={}",
            opts.uid.unwrap_or_else(|| unsafe { libc::getuid() })
        ),
        format!(
            "group_id={}",
            opts.gid.unwrap_or_else(|| unsafe { libc::getgid() })
        ),
        format!("rootmode={}", opts.rootmode.unwrap_or(40000)),
        format!("fsname={}", opts.fs_name.as_deref().unwrap_or("fuse")),
    ];

    if opts.allow_root {
        parts.push("allow_root".to_string());
    }
    if opts.allow_other {
        parts.push("allow_other".to_string());
    }
    if opts.read_only {
        parts.push("ro".to_string());
    }
    if opts.default_permissions {
        parts.push("default_permissions".to_string());
    }
    if let Some(subtype) = &opts.subtype {
        parts.push(format!("subtype={subtype}"));
    }

    let mut options = OsString::from(parts.join(","));

    if let Some(custom) = &opts.custom_options {
        options.push(",");
        options.push(custom);
    }

    options
}

/// Mount options for a FUSE filesystem.
#[derive(Debug, Clone, Default)]
pub struct MountOptions {
    pub allow_other: bool,
    pub allow_root: bool,
    pub default_permissions: bool,
    pub read_only: bool,
    pub fs_name: Option<String>,
    /// `user_id` / `group_id` of the mount (who may access it without
    /// `allow_other`). Direct mounts only: fusermount3 always uses the
    /// caller's.
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// The file type of the root. Direct mounts only (fusermount3 takes it
    /// from the mount point, as does a direct mount by default): a mode
    /// value such as `libc::S_IFDIR`.
    pub rootmode: Option<u32>,
    pub custom_options: Option<OsString>,
    pub dont_mask: bool,
    pub no_open_support: bool,
    pub no_open_dir_support: bool,
    pub handle_killpriv: bool,
    pub write_back: bool,
    pub force_readdir_plus: bool,
    pub passthrough: bool,
    /// Advertise FUSE_POSIX_LOCKS so the kernel routes fcntl(F_SETLK)
    /// requests to the userspace `getlk`/`setlk` handlers. Leave off
    /// unless the [`Filesystem`](crate::Filesystem) impl actually
    /// implements them; otherwise the kernel's local-only lock fallback
    /// is preferable to userspace ENOSYS.
    pub posix_locks: bool,
    /// Same gate for `FUSE_FLOCK_LOCKS` -> the `flock` handler.
    pub flock_locks: bool,
    /// Mount subtype: the mount's type reads `fuse.SUBTYPE`.
    pub subtype: Option<String>,
    /// INIT flags requested on top of the defaults
    /// ([`DEFAULT_INIT_FLAGS`]) and those the options above imply.
    pub init_flags_add: u64,
    /// INIT flags not to request, even if a default or an option above
    /// implies them (`FUSE_OVER_IO_URING` and `FUSE_INIT_EXT` excepted).
    pub init_flags_remove: u64,
}

/// The INIT capability flags requested unless removed with
/// [`MountOptions::init_flags`]: `ASYNC_READ`, `BIG_WRITES`,
/// `AUTO_INVAL_DATA`, `DO_READDIRPLUS`, `READDIRPLUS_AUTO`, `ASYNC_DIO`,
/// `PARALLEL_DIROPS`, `MAX_PAGES`, `SETXATTR_EXT` (with the transport's
/// `OVER_IO_URING` and `INIT_EXT`). Unlike upstream 0.6.1,
/// `FUSE_ATOMIC_O_TRUNC` is not among them: with it the kernel leaves
/// `O_TRUNC` to `open` (no SETATTR is sent), so only a filesystem that
/// truncates in `open` should add it.
pub const DEFAULT_INIT_FLAGS: u64 = FUSE_OVER_IO_URING
    | FUSE_INIT_EXT as u64
    | FUSE_ASYNC_READ as u64
    | FUSE_BIG_WRITES as u64
    | FUSE_AUTO_INVAL_DATA as u64
    | FUSE_DO_READDIRPLUS as u64
    | FUSE_READDIRPLUS_AUTO as u64
    | FUSE_ASYNC_DIO as u64
    | FUSE_PARALLEL_DIROPS as u64
    | FUSE_MAX_PAGES as u64
    | FUSE_SETXATTR_EXT as u64;

impl MountOptions {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn fs_name(mut self, name: impl Into<String>) -> Self {
        self.fs_name = Some(name.into());
        self
    }

    pub fn allow_other(mut self, allow: bool) -> Self {
        self.allow_other = allow;
        self
    }

    pub fn allow_root(mut self, allow: bool) -> Self {
        self.allow_root = allow;
        self
    }

    pub fn read_only(mut self, ro: bool) -> Self {
        self.read_only = ro;
        self
    }

    pub fn default_permissions(mut self, dp: bool) -> Self {
        self.default_permissions = dp;
        self
    }

    pub fn dont_mask(mut self, dm: bool) -> Self {
        self.dont_mask = dm;
        self
    }

    pub fn no_open_support(mut self, nos: bool) -> Self {
        self.no_open_support = nos;
        self
    }

    pub fn no_open_dir_support(mut self, nos: bool) -> Self {
        self.no_open_dir_support = nos;
        self
    }

    pub fn write_back(mut self, wb: bool) -> Self {
        self.write_back = wb;
        self
    }

    pub fn force_readdir_plus(mut self, rdp: bool) -> Self {
        self.force_readdir_plus = rdp;
        self
    }

    pub fn passthrough(mut self, pt: bool) -> Self {
        self.passthrough = pt;
        self
    }

    pub fn posix_locks(mut self, pl: bool) -> Self {
        self.posix_locks = pl;
        self
    }

    pub fn flock_locks(mut self, fl: bool) -> Self {
        self.flock_locks = fl;
        self
    }

    /// The mount's subtype: its type then reads `fuse.SUBTYPE`.
    pub fn subtype(mut self, subtype: impl Into<String>) -> Self {
        self.subtype = Some(subtype.into());
        self
    }

    /// Also request these INIT flags (ORed in; e.g.
    /// `abi::FUSE_HANDLE_KILLPRIV_V2 as u64`). The kernel grants only those
    /// it supports; [`Filesystem::negotiated`](crate::Filesystem::negotiated)
    /// tells which. Only flags whose requests the dispatch layer can parse
    /// belong here (not, e.g., `FUSE_SECURITY_CTX`).
    pub fn extra_init_flags(mut self, flags: u64) -> Self {
        self.init_flags_add |= flags;
        self
    }

    /// Request the INIT flags `add` and do not request `remove` (removal
    /// wins over defaults, the options above and `add`). Accumulates over
    /// calls. E.g. writeback cache without `FUSE_AUTO_INVAL_DATA` and with
    /// `FUSE_HANDLE_KILLPRIV_V2`:
    /// `.write_back(true).init_flags(FUSE_HANDLE_KILLPRIV_V2 as u64,
    /// FUSE_AUTO_INVAL_DATA as u64)`.
    pub fn init_flags(mut self, add: u64, remove: u64) -> Self {
        self.init_flags_add |= add;
        self.init_flags_remove |= remove;
        self
    }

    pub fn custom_options(mut self, opts: impl Into<OsString>) -> Self {
        self.custom_options = Some(opts.into());
        self
    }

    /// The INIT flags to request of the kernel (before the intersection
    /// with what it offers).
    pub fn wanted_init_flags(&self) -> u64 {
        let mut want = DEFAULT_INIT_FLAGS;
        // Lock advertisement is opt-in: enabling these flags routes all
        // fcntl/flock calls to userspace, where they ENOSYS unless the
        // Filesystem impl provides getlk/setlk/flock. Leaving them off lets
        // the kernel handle local-only locks.
        if self.posix_locks {
            want |= FUSE_POSIX_LOCKS as u64;
        }
        if self.flock_locks {
            want |= FUSE_FLOCK_LOCKS as u64;
        }
        if self.dont_mask {
            want |= FUSE_DONT_MASK as u64;
        }
        if self.no_open_support {
            want |= FUSE_NO_OPEN_SUPPORT as u64;
        }
        if self.no_open_dir_support {
            want |= FUSE_NO_OPENDIR_SUPPORT as u64;
        }
        if self.handle_killpriv {
            want |= FUSE_HANDLE_KILLPRIV as u64;
        }
        if self.passthrough {
            // FUSE_PASSTHROUGH and FUSE_WRITEBACK_CACHE are mutually exclusive
            want |= FUSE_PASSTHROUGH;
        } else if self.write_back {
            want |= FUSE_WRITEBACK_CACHE as u64;
        }
        want |= self.init_flags_add;
        want &= !self.init_flags_remove;
        // The transport itself.
        want | FUSE_OVER_IO_URING | FUSE_INIT_EXT as u64
    }
}
