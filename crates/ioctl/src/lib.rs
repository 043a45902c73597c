//! Safe wrappers around the Linux ioctls onecopy needs.
//!
//! This is the only crate of the workspace that contains `unsafe` code. Every
//! wrapper takes a borrowed file descriptor, builds the kernel's argument
//! structure in a properly aligned buffer, and decodes the answer with safe,
//! bounds-checked parsing: a malformed answer is an error, never undefined
//! behaviour or a panic.
//!
//! * [`dedupe`]: `FIDEDUPERANGE`, the kernel-verified "share these bytes" call.
//! * [`fiemap`]: `FS_IOC_FIEMAP`, the logical → physical extent map of a file.
//! * [`fs`]: filesystem identification (`fstatfs`), inode flags and generation.
//! * [`btrfs`]: btrfs file extent items (`BTRFS_IOC_TREE_SEARCH_V2`), which
//!   reveal the full size of the extent a file range pins.
//! * [`changed`]: btrfs inodes changed since a transaction (tree search by
//!   minimum transid) and their paths (`BTRFS_IOC_INO_PATHS`).
//! * [`process`]: the I/O scheduling priority (`ioprio_set`/`ioprio_get`).
//! * [`handle`]: `open_by_handle_at`, to name what fanotify reports by
//!   file handle.
//! * [`prefetch`]: a software prefetch hint (no memory access, only timing),
//!   for the fingerprint index's batched filter probes.
//! * [`bloom_block`]: the fingerprint index's Bloom block probe, with AVX2
//!   chosen at run time where the CPU has it.

pub mod bloom_block;
pub mod btrfs;
pub mod changed;
pub mod dedupe;
pub mod fiemap;
pub mod fs;
pub mod handle;
pub mod mounts;
pub mod prefetch;
pub mod process;

/// Little-endian/native field readers used by the decoders. All return
/// `None` when the slice is too short, so decoders never index out of bounds.
pub(crate) mod bytes {
    pub fn u64_at(b: &[u8], off: usize) -> Option<u64> {
        let s = b.get(off..off.checked_add(8)?)?;
        Some(u64::from_ne_bytes(s.try_into().ok()?))
    }
    pub fn u32_at(b: &[u8], off: usize) -> Option<u32> {
        let s = b.get(off..off.checked_add(4)?)?;
        Some(u32::from_ne_bytes(s.try_into().ok()?))
    }
    pub fn u8_at(b: &[u8], off: usize) -> Option<u8> {
        b.get(off).copied()
    }
    /// Little-endian: btrfs on-disk items are little-endian on every host.
    pub fn le_u64_at(b: &[u8], off: usize) -> Option<u64> {
        let s = b.get(off..off.checked_add(8)?)?;
        Some(u64::from_le_bytes(s.try_into().ok()?))
    }
    pub fn le_u32_at(b: &[u8], off: usize) -> Option<u32> {
        let s = b.get(off..off.checked_add(4)?)?;
        Some(u32::from_le_bytes(s.try_into().ok()?))
    }
}

/// An 8-byte aligned, zeroed buffer for ioctl argument structures.
pub(crate) struct AlignedBuf {
    words: Vec<u64>,
}

impl AlignedBuf {
    pub fn new(bytes: usize) -> Self {
        AlignedBuf {
            words: vec![0u64; bytes.div_ceil(8)],
        }
    }
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: u64 has no padding and any byte pattern is a valid u8; the
        // length is exactly the allocation's size in bytes.
        unsafe {
            std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.words.len() * 8)
        }
    }
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        // SAFETY: as above; the borrow is unique.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.words.as_mut_ptr().cast::<u8>(),
                self.words.len() * 8,
            )
        }
    }
    pub fn put_u64(&mut self, off: usize, v: u64) {
        self.as_mut_bytes()[off..off + 8].copy_from_slice(&v.to_ne_bytes());
    }
    pub fn put_u32(&mut self, off: usize, v: u32) {
        self.as_mut_bytes()[off..off + 4].copy_from_slice(&v.to_ne_bytes());
    }
    pub fn put_u16(&mut self, off: usize, v: u16) {
        self.as_mut_bytes()[off..off + 2].copy_from_slice(&v.to_ne_bytes());
    }
    pub fn as_mut_ptr(&mut self) -> *mut libc::c_void {
        self.words.as_mut_ptr().cast()
    }
}

/// Issues `ioctl(fd, request, buf)`, turning -1 into the thread's errno.
pub(crate) fn ioctl_buf(
    fd: std::os::fd::BorrowedFd<'_>,
    request: libc::c_ulong,
    buf: &mut AlignedBuf,
) -> std::io::Result<libc::c_int> {
    use std::os::fd::AsRawFd;
    // SAFETY: `buf` is a live, writable allocation at least as large as the
    // structure the request encodes (callers size it from the same layout),
    // and `fd` is a valid open descriptor for the duration of the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, buf.as_mut_ptr()) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}
