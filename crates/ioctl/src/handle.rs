//! `open_by_handle_at(2)`: opens what a file handle (as fanotify reports
//! with `FAN_REPORT_FID`/`FAN_REPORT_DFID_NAME`) names, on the filesystem
//! of `mount_fd`. Needs CAP_DAC_READ_SEARCH.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `struct file_handle` header: `handle_bytes` (u32), `handle_type` (i32).
const HEADER: usize = 8;
/// The kernel's `MAX_HANDLE_SZ`.
const MAX_HANDLE: usize = 128;

/// Opens, with `O_PATH`, the object named by `handle`: a `struct
/// file_handle` as the kernel wrote it (header then `handle_bytes` bytes).
/// A handle whose header disagrees with its length is `InvalidData`.
pub fn open_by_handle(mount_fd: BorrowedFd<'_>, handle: &[u8]) -> io::Result<OwnedFd> {
    let bytes = handle
        .get(..4)
        .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .filter(|&n| n <= MAX_HANDLE && HEADER + n <= handle.len())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad file handle"))?;
    let mut buf = crate::AlignedBuf::new(HEADER + MAX_HANDLE);
    buf.as_mut_bytes()[..HEADER + bytes].copy_from_slice(&handle[..HEADER + bytes]);
    let flags = libc::O_PATH | libc::O_CLOEXEC;
    // SAFETY: `buf` holds a complete `struct file_handle` (header and
    // `handle_bytes` bytes, checked above, within its allocation) and
    // lives across the call; `mount_fd` is an open descriptor.
    let r = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            mount_fd.as_raw_fd() as libc::c_long,
            buf.as_mut_ptr(),
            flags as libc::c_long,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a non-negative return is a new descriptor that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(r as libc::c_int) })
}

/// The kernel's `f_fsid` of the filesystem holding `fd`, as 8 bytes in
/// memory order: what fanotify puts in its `fsid` field.
pub fn kernel_fsid(fd: BorrowedFd<'_>) -> io::Result<[u8; 8]> {
    // SAFETY: statfs is plain old data; zeroed is a valid value.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `s` is a valid, writable statfs and `fd` is open.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut s) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fsid_t is two ints; reading it as bytes is always valid.
    let raw: [i32; 2] = unsafe { std::mem::transmute(s.f_fsid) };
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&raw[0].to_ne_bytes());
    out[4..].copy_from_slice(&raw[1].to_ne_bytes());
    Ok(out)
}
