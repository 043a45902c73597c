//! `FIDEDUPERANGE`: ask the kernel to make destination ranges share the
//! source range's extents, after it compared the bytes under a lock.
//!
//! The kernel never changes what a file reads through this call: if the
//! bytes differ it reports [`DedupeStatus::Differs`] and does nothing.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use crate::AlignedBuf;

const HEADER: usize = 24; // struct file_dedupe_range
const INFO: usize = 32; // struct file_dedupe_range_info
/// `_IOWR(0x94, 54, struct file_dedupe_range)`.
const FIDEDUPERANGE: libc::c_ulong = 0xC018_9436;

/// How many destinations one call may carry: the kernel refuses argument
/// structures larger than a page (4096 bytes).
pub const MAX_DESTS_PER_CALL: usize = (4096 - HEADER) / INFO;

/// One destination of a dedupe request.
#[derive(Debug, Clone, Copy)]
pub struct DedupeDest<'fd> {
    pub fd: BorrowedFd<'fd>,
    pub offset: u64,
}

/// What the kernel said about one destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DedupeStatus {
    /// The bytes were identical and are now shared (`bytes` of them; this
    /// may be less than requested: the caller continues from there).
    Same { bytes: u64 },
    /// The bytes differ: nothing was changed.
    Differs,
    /// The kernel refused this destination with an errno (EINVAL for
    /// misalignment or overlap, EPERM for immutable/append-only, ETXTBSY for
    /// an active swap file, EXDEV across filesystems, ...).
    Error(i32),
}

impl DedupeStatus {
    /// A human explanation of a refused destination.
    pub fn describe(&self) -> String {
        match *self {
            DedupeStatus::Same { bytes } => format!("shared {bytes} bytes"),
            DedupeStatus::Differs => "data differs (file changed since it was read)".into(),
            DedupeStatus::Error(e) => describe_errno(e),
        }
    }
}

/// Explains an errno returned by `FIDEDUPERANGE` in the terms a user needs.
pub fn describe_errno(errno: i32) -> String {
    let why = match errno {
        libc::EINVAL => "invalid range (unaligned, overlapping or past end of file)",
        libc::EPERM => "operation not permitted (immutable or append-only file?)",
        libc::EACCES => "permission denied",
        libc::ETXTBSY => "file is busy (active swap file?)",
        libc::EXDEV => "files are on different filesystems",
        libc::EOPNOTSUPP => "filesystem does not support dedupe (XFS without reflink?)",
        libc::EISDIR => "is a directory",
        libc::ENOSPC => "no space left on device",
        libc::ENOMEM => "out of memory",
        libc::EAGAIN => "resource temporarily busy",
        libc::EBADF => "bad file descriptor (file not open for reading?)",
        libc::EFBIG => "file too large",
        _ => "",
    };
    let os = io::Error::from_raw_os_error(errno);
    if why.is_empty() {
        os.to_string()
    } else {
        format!("{why} [{os}]")
    }
}

/// Issues one `FIDEDUPERANGE` call: `len` bytes of `src` at `src_offset`
/// against every destination (at most [`MAX_DESTS_PER_CALL`]).
///
/// Returns one status per destination, in order. An `Err` means the call as
/// a whole failed (for example EINVAL on the source range, EOPNOTSUPP on the
/// filesystem); per-destination refusals come back as [`DedupeStatus::Error`].
/// The source must be open for reading; destinations may be read-only when
/// the caller owns them or has CAP_SYS_ADMIN.
pub fn dedupe_range(
    src: BorrowedFd<'_>,
    src_offset: u64,
    len: u64,
    dests: &[DedupeDest<'_>],
) -> io::Result<Vec<DedupeStatus>> {
    if dests.is_empty() {
        return Ok(Vec::new());
    }
    if dests.len() > MAX_DESTS_PER_CALL {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("at most {MAX_DESTS_PER_CALL} destinations per call"),
        ));
    }
    let mut buf = AlignedBuf::new(HEADER + INFO * dests.len());
    buf.put_u64(0, src_offset);
    buf.put_u64(8, len);
    buf.put_u16(16, dests.len() as u16);
    for (i, d) in dests.iter().enumerate() {
        let base = HEADER + INFO * i;
        buf.put_u64(base, d.fd.as_raw_fd() as i64 as u64);
        buf.put_u64(base + 8, d.offset);
    }
    crate::ioctl_buf(src, FIDEDUPERANGE, &mut buf)?;
    Ok(decode_statuses(buf.as_bytes(), dests.len()))
}

fn decode_statuses(b: &[u8], n: usize) -> Vec<DedupeStatus> {
    (0..n)
        .map(|i| {
            let base = HEADER + INFO * i;
            let bytes = crate::bytes::u64_at(b, base + 16).unwrap_or(0);
            let status = crate::bytes::u32_at(b, base + 24).unwrap_or(u32::MAX) as i32;
            match status {
                0 => DedupeStatus::Same { bytes },
                1 => DedupeStatus::Differs,
                s if s < 0 => DedupeStatus::Error(-s),
                s => DedupeStatus::Error(s),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_limit() {
        assert_eq!(MAX_DESTS_PER_CALL, 127);
    }

    #[test]
    fn describes_errors() {
        assert!(describe_errno(libc::EPERM).contains("immutable"));
        assert!(describe_errno(libc::EXDEV).contains("different filesystems"));
        assert!(DedupeStatus::Differs.describe().contains("differs"));
    }
}
