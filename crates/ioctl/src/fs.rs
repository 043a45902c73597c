//! Filesystem identification and per-inode facts: which filesystem a file
//! lives on, whether it is mounted read-only, its block size, its inode
//! flags (immutable, append-only, nocow) and generation.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// The filesystems onecopy tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FsKind {
    Btrfs,
    Xfs,
    Ext4,
    Tmpfs,
    Overlay,
    Nfs,
    Zfs,
    Bcachefs,
    Other(u64),
}

impl FsKind {
    pub fn from_magic(magic: u64) -> FsKind {
        match magic {
            0x9123_683E => FsKind::Btrfs,
            0x5846_5342 => FsKind::Xfs,
            0xEF53 => FsKind::Ext4,
            0x0102_1994 => FsKind::Tmpfs,
            0x794C_7630 => FsKind::Overlay,
            0x6969 => FsKind::Nfs,
            0x2FC1_2FC1 => FsKind::Zfs,
            0xCA45_1A4E => FsKind::Bcachefs,
            m => FsKind::Other(m),
        }
    }
    pub fn name(&self) -> String {
        match self {
            FsKind::Btrfs => "btrfs".into(),
            FsKind::Xfs => "xfs".into(),
            FsKind::Ext4 => "ext2/3/4".into(),
            FsKind::Tmpfs => "tmpfs".into(),
            FsKind::Overlay => "overlayfs".into(),
            FsKind::Nfs => "nfs".into(),
            FsKind::Zfs => "zfs".into(),
            FsKind::Bcachefs => "bcachefs".into(),
            FsKind::Other(m) => format!("unknown filesystem (magic {m:#x})"),
        }
    }
    /// Whether onecopy knows how to dedupe on this filesystem at all.
    pub fn supports_dedupe(&self) -> bool {
        matches!(self, FsKind::Btrfs | FsKind::Xfs)
    }
}

/// What `fstatfs` says about the filesystem holding a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsInfo {
    pub kind: FsKind,
    /// Preferred block size; dedupe offsets must be multiples of it.
    pub block_size: u64,
    pub read_only: bool,
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub avail_bytes: u64,
    /// Identifies the filesystem: derived from its UUID where the kernel
    /// tells it (btrfs, XFS, ext4), so that all subvolumes of one btrfs
    /// share it; else `f_fsid`.
    pub fsid: u64,
}

pub fn fs_info(fd: BorrowedFd<'_>) -> io::Result<FsInfo> {
    // SAFETY: statfs is plain old data; zeroed is a valid value.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `s` is a valid, writable statfs and `fd` is open.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut s) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fsid_t is two ints; reading it as bytes is always valid.
    let fsid_raw: [i32; 2] = unsafe { std::mem::transmute(s.f_fsid) };
    let kind = FsKind::from_magic(s.f_type as u64);
    let uuid = match kind {
        FsKind::Btrfs => crate::btrfs::fs_uuid(fd).ok(),
        _ => fs_uuid(fd).ok(),
    }
    .filter(|u| *u != [0u8; 16]);
    let fsid = match uuid {
        Some(u) => {
            let lo = u64::from_le_bytes(u[..8].try_into().unwrap());
            let hi = u64::from_le_bytes(u[8..].try_into().unwrap());
            lo ^ hi.rotate_left(32)
        }
        None => (fsid_raw[0] as u32 as u64) | ((fsid_raw[1] as u32 as u64) << 32),
    };
    let bsize = s.f_bsize as u64;
    // SAFETY: statvfs is plain old data; zeroed is a valid value.
    let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `v` is a valid, writable statvfs and `fd` is open.
    if unsafe { libc::fstatvfs(fd.as_raw_fd(), &mut v) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(FsInfo {
        kind,
        block_size: bsize,
        read_only: v.f_flag & libc::ST_RDONLY != 0,
        total_bytes: s.f_blocks as u64 * s.f_frsize as u64,
        free_bytes: s.f_bfree as u64 * s.f_frsize as u64,
        avail_bytes: s.f_bavail as u64 * s.f_frsize as u64,
        fsid,
    })
}

/// Inode flags (`FS_IOC_GETFLAGS`).
pub mod inode_flags {
    pub const IMMUTABLE: u32 = 0x0000_0010;
    pub const APPEND: u32 = 0x0000_0020;
    pub const NOCOW: u32 = 0x0080_0000;
}

const FS_IOC_GETFLAGS: libc::c_ulong = 0x8008_6601;
const FS_IOC_GETVERSION: libc::c_ulong = 0x8008_7601;

/// The inode's `FS_*_FL` flags. Filesystems without the ioctl give ENOTTY.
pub fn inode_flags(fd: BorrowedFd<'_>) -> io::Result<u32> {
    let mut v: libc::c_long = 0;
    // SAFETY: the kernel writes an int-sized value into `v`, which is larger.
    let r = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            FS_IOC_GETFLAGS as _,
            &mut v as *mut libc::c_long,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v as u32)
}

/// The inode generation (`FS_IOC_GETVERSION`): changes when an inode number
/// is reused for a new file.
pub fn inode_generation(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut v: libc::c_long = 0;
    // SAFETY: as for inode_flags.
    let r = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            FS_IOC_GETVERSION as _,
            &mut v as *mut libc::c_long,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v as u32 as u64)
}

/// Access-pattern advice for `posix_fadvise`.
#[derive(Debug, Clone, Copy)]
pub enum Advice {
    Sequential,
    DontNeed,
}

/// `lseek(fd, at, SEEK_DATA)`: where the first data at or after `at`
/// starts, or `None` when there is none before the end (`ENXIO`). Moves
/// the descriptor's offset there.
pub fn next_data(fd: BorrowedFd<'_>, at: u64) -> io::Result<Option<u64>> {
    match seek(fd, at, libc::SEEK_DATA) {
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(None),
        r => r.map(Some),
    }
}

/// `lseek(fd, at, SEEK_HOLE)`: where the first hole at or after `at`
/// starts (the end of the file is one). Moves the descriptor's offset
/// there.
pub fn next_hole(fd: BorrowedFd<'_>, at: u64) -> io::Result<u64> {
    seek(fd, at, libc::SEEK_HOLE)
}

fn seek(fd: BorrowedFd<'_>, at: u64, whence: i32) -> io::Result<u64> {
    let at = i64::try_from(at).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: plain syscall on an open descriptor; no memory is passed.
    let r = unsafe { libc::lseek(fd.as_raw_fd(), at, whence) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as u64)
}

/// `posix_fadvise(fd, 0, 0, advice)` over the whole file.
pub fn fadvise(fd: BorrowedFd<'_>, advice: Advice) -> io::Result<()> {
    fadvise_range(fd, 0, 0, advice)
}

/// `posix_fadvise(fd, offset, len, advice)` (`len` 0: to the end).
pub fn fadvise_range(fd: BorrowedFd<'_>, offset: u64, len: u64, advice: Advice) -> io::Result<()> {
    let a = match advice {
        Advice::Sequential => libc::POSIX_FADV_SEQUENTIAL,
        Advice::DontNeed => libc::POSIX_FADV_DONTNEED,
    };
    // SAFETY: plain syscall on an open descriptor; no memory is passed.
    let r = unsafe { libc::posix_fadvise(fd.as_raw_fd(), offset as i64, len as i64, a) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// `sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`: starts writeback of
/// the file's dirty pages and returns without waiting for it (it may wait
/// for a congested device queue). A hint: it makes nothing durable (no
/// metadata, no device cache flush), so `fdatasync` is still needed for
/// that, but the data is on its way to the device meanwhile.
pub fn start_writeback(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: plain syscall on an open descriptor; no memory is passed.
    let r = unsafe { libc::sync_file_range(fd.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `fd` is on a read-only mount (`fstatvfs`), cheaper than
/// [`fs_info`].
pub fn on_read_only_mount(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: statvfs is plain old data; zeroed is a valid value.
    let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `v` is a valid, writable statvfs and `fd` is open.
    if unsafe { libc::fstatvfs(fd.as_raw_fd(), &mut v) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v.f_flag & libc::ST_RDONLY != 0)
}

/// `syncfs(fd)`: commits the filesystem holding `fd`, so that space freed
/// by earlier operations shows in [`fs_info`].
pub fn syncfs(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: plain syscall on an open descriptor.
    if unsafe { libc::syncfs(fd.as_raw_fd()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `XFS_IOC_FSGEOMETRY_V4`: `_IOR('X', 124, struct xfs_fsop_geom_v4)`.
const XFS_IOC_FSGEOMETRY_V4: libc::c_ulong = 0x8070_587C;
const XFS_GEOM_SIZE_V4: usize = 112;
const XFS_GEOM_FLAGS_OFFSET: usize = 92;
const XFS_FSOP_GEOM_FLAGS_REFLINK: u32 = 1 << 20;

/// Whether the XFS filesystem holding `fd` was made with `reflink=1`
/// (without it, every dedupe fails with EOPNOTSUPP).
pub fn xfs_has_reflink(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let mut buf = crate::AlignedBuf::new(XFS_GEOM_SIZE_V4);
    crate::ioctl_buf(fd, XFS_IOC_FSGEOMETRY_V4, &mut buf)?;
    let flags = crate::bytes::u32_at(buf.as_bytes(), XFS_GEOM_FLAGS_OFFSET).unwrap_or(0);
    Ok(flags & XFS_FSOP_GEOM_FLAGS_REFLINK != 0)
}

/// `FS_IOC_GETFSUUID`: `_IOR(0x15, 0, struct fsuuid2)` (Linux 6.5+).
const FS_IOC_GETFSUUID: libc::c_ulong = 0x8011_1500;

/// The filesystem's UUID, stable across mounts and device renumbering.
/// Filesystems or kernels without `FS_IOC_GETFSUUID` give an error.
pub fn fs_uuid(fd: BorrowedFd<'_>) -> io::Result<[u8; 16]> {
    let mut buf = crate::AlignedBuf::new(17);
    crate::ioctl_buf(fd, FS_IOC_GETFSUUID, &mut buf)?;
    let b = buf.as_bytes();
    let len = b[0] as usize;
    if len == 0 || len > 16 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "bad uuid length",
        ));
    }
    let mut out = [0u8; 16];
    out[..len].copy_from_slice(&b[1..1 + len]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn identifies_tmp() {
        let f = tempfile::tempfile().unwrap();
        let info = fs_info(f.as_fd()).unwrap();
        assert!(info.block_size >= 512);
        assert!(!info.read_only);
        assert_eq!(FsKind::from_magic(0x9123_683E), FsKind::Btrfs);
        assert!(FsKind::Xfs.supports_dedupe() && !FsKind::Ext4.supports_dedupe());
    }

    #[test]
    fn data_and_holes() {
        use std::os::unix::fs::FileExt;
        let f = tempfile::tempfile().unwrap();
        f.set_len(1 << 20).unwrap();
        f.write_all_at(&[1u8; 4096], 512 << 10).unwrap();
        // Filesystems without holes report all of it as data.
        let data = next_data(f.as_fd(), 0).unwrap().unwrap();
        assert!(data <= 512 << 10);
        assert!(next_hole(f.as_fd(), data).unwrap() > data);
        assert_eq!(next_data(f.as_fd(), 1 << 20).unwrap(), None);
        assert_eq!(next_hole(f.as_fd(), 0).unwrap() % 4096, 0);
    }

    #[test]
    fn writeback_starts_on_a_file_and_fails_on_a_pipe() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 65536]).unwrap();
        start_writeback(f.as_fd()).unwrap();
        f.sync_data().unwrap();
        let (r, _w) = std::io::pipe().unwrap();
        assert_eq!(
            start_writeback(r.as_fd()).unwrap_err().raw_os_error(),
            Some(libc::ESPIPE)
        );
    }
}
