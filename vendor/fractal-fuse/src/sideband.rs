// Added for onecopy to fractal-fuse 0.6.1 (Apache-2.0): see PATCHES.md.
//! The classic `/dev/fuse` channel, serviced next to the io_uring rings.
//!
//! FUSE-over-io_uring carries ordinary requests only. The kernel keeps
//! queueing FORGET / BATCH_FORGET and INTERRUPT on the classic `/dev/fuse`
//! queue (fs/fuse/dev_uring.c: `fuse_io_uring_ops.send_forget =
//! fuse_dev_queue_forget`, `.send_interrupt = fuse_dev_queue_interrupt`),
//! and an ordinary request can land there too: one that races the switch
//! to the rings (`fuse_send_one` reads `fiq->ops` unlocked) or one resent
//! by `FUSE_NOTIFY_RESEND`. Unread, forgets never reach the filesystem and
//! pile up in the kernel for the life of the mount, and a stranded request
//! never completes (its caller hangs, and `umount` with it).
//!
//! One thread (`fuse-sideband`) polls the fd and reads it: forgets go to
//! [`Filesystem::forget`] / [`Filesystem::batch_forget`], interrupts are
//! dropped (the interrupted request still gets its normal reply), and any
//! other request is laid out as a ring entry and answered through the
//! normal dispatch path, on a compio runtime created on first use.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::thread;

use compio_runtime::Runtime;
use tracing::{debug, error, warn};

use crate::abi::*;
use crate::dispatch;
use crate::filesystem::Filesystem;
use crate::ring::RingEntry;
use crate::types::{InodeId, Request};

/// The running side-channel thread; stopped and joined on drop.
pub(crate) struct Sideband {
    /// eventfd that tells the thread to stop.
    stop: OwnedFd,
    thread: Option<thread::JoinHandle<()>>,
}

impl Sideband {
    /// Start servicing `fd` for `fs`. `max_write` and `negotiated` are the
    /// values sent in the INIT reply.
    pub(crate) fn start<F: Filesystem>(
        fd: Arc<OwnedFd>,
        fs: Arc<F>,
        max_write: u32,
        negotiated: u64,
    ) -> io::Result<Self> {
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if stop < 0 {
            return Err(io::Error::last_os_error());
        }
        let stop = unsafe { OwnedFd::from_raw_fd(stop) };
        let stop_fd = stop.as_raw_fd();
        // The kernel refuses reads into less than this (fuse_dev_do_read:
        // header + fuse_write_in + max_write, at least FUSE_MIN_READ_BUFFER);
        // it applies max_write as at least 4096.
        let buf_len = (FUSE_MIN_READ_BUFFER as usize).max(
            size_of::<fuse_in_header>() + size_of::<fuse_write_in>() + max_write.max(4096) as usize,
        );
        let setxattr_ext = negotiated & FUSE_SETXATTR_EXT as u64 != 0;
        let thread = thread::Builder::new()
            .name("fuse-sideband".to_string())
            .spawn(move || run(&fd, stop_fd, &*fs, buf_len, setxattr_ext))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Sideband {
    fn drop(&mut self) {
        let one: u64 = 1;
        let r = unsafe {
            libc::write(
                self.stop.as_raw_fd(),
                (&one as *const u64).cast(),
                size_of::<u64>(),
            )
        };
        if r < 0 {
            error!(
                "sideband: cannot signal stop: {}",
                io::Error::last_os_error()
            );
            return; // joining could hang
        }
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            error!("sideband thread panicked");
        }
    }
}

/// What a non-forget request needs: a runtime for its future and a ring
/// entry to lay it out in. Created on first use (rare).
struct Stray {
    rt: Runtime,
    entry: RingEntry,
}

fn run<F: Filesystem>(fd: &OwnedFd, stop: RawFd, fs: &F, buf_len: usize, setxattr_ext: bool) {
    let fuse_fd = fd.as_raw_fd();
    // calloc'ed: pages become resident only as far as requests fill them.
    let mut buf = vec![0u8; buf_len];
    let mut stray: Option<Stray> = None;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: fuse_fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            error!("sideband: poll failed: {e}");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if fds[0].revents & libc::POLLIN == 0 {
            if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                debug!("sideband: /dev/fuse disconnected");
                return;
            }
            continue;
        }
        let n = unsafe { libc::read(fuse_fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // The request went away meanwhile, or try again.
                Some(libc::ENOENT | libc::EINTR | libc::EAGAIN) => continue,
                // Unmounted / aborted.
                Some(libc::ENODEV) => return,
                _ => {
                    error!("sideband: reading /dev/fuse failed: {e}");
                    return;
                }
            }
        }
        handle(
            fuse_fd,
            fs,
            &buf[..n as usize],
            buf_len,
            &mut stray,
            setxattr_ext,
        );
    }
}

fn handle<F: Filesystem>(
    fuse_fd: RawFd,
    fs: &F,
    msg: &[u8],
    buf_len: usize,
    stray: &mut Option<Stray>,
    setxattr_ext: bool,
) {
    let hdr_len = size_of::<fuse_in_header>();
    if msg.len() < hdr_len {
        warn!("sideband: short read of {} bytes", msg.len());
        return;
    }
    let hdr: fuse_in_header = unsafe { std::ptr::read_unaligned(msg.as_ptr().cast()) };
    let body = &msg[hdr_len..msg.len().min(hdr.len as usize).max(hdr_len)];
    let req = Request {
        unique: hdr.unique,
        uid: hdr.uid,
        gid: hdr.gid,
        pid: hdr.pid,
    };
    match hdr.opcode {
        FUSE_FORGET => {
            if body.len() < size_of::<fuse_forget_in>() {
                warn!("sideband: short FORGET");
                return;
            }
            let arg: fuse_forget_in = unsafe { std::ptr::read_unaligned(body.as_ptr().cast()) };
            let r = panic::catch_unwind(AssertUnwindSafe(|| {
                fs.forget(req, InodeId(hdr.nodeid), arg.nlookup)
            }));
            if r.is_err() {
                error!("filesystem forget panicked");
            }
        }
        FUSE_BATCH_FORGET => {
            let head = size_of::<fuse_batch_forget_in>();
            if body.len() < head {
                warn!("sideband: short BATCH_FORGET");
                return;
            }
            let arg: fuse_batch_forget_in =
                unsafe { std::ptr::read_unaligned(body.as_ptr().cast()) };
            let one = size_of::<fuse_forget_one>();
            let list = &body[head..];
            let count = (arg.count as usize).min(list.len() / one);
            let inodes: Vec<(InodeId, u64)> = (0..count)
                .map(|i| {
                    let f: fuse_forget_one =
                        unsafe { std::ptr::read_unaligned(list[i * one..].as_ptr().cast()) };
                    (InodeId(f.nodeid), f.nlookup)
                })
                .collect();
            let r = panic::catch_unwind(AssertUnwindSafe(|| fs.batch_forget(req, &inodes)));
            if r.is_err() {
                error!("filesystem batch_forget panicked");
            }
        }
        // No reply is expected to either.
        FUSE_INTERRUPT | FUSE_NOTIFY_REPLY => {
            debug!("sideband: ignoring opcode {}", hdr.opcode);
        }
        _ => {
            debug!(
                "sideband: request opcode={} unique={} on /dev/fuse",
                hdr.opcode, hdr.unique
            );
            let error =
                match dispatch_stray(fuse_fd, fs, msg, &hdr, body, buf_len, stray, setxattr_ext) {
                    Ok(()) => return,
                    Err(e) => e,
                };
            error!(
                "sideband: cannot serve opcode {} unique {}: {error}",
                hdr.opcode, hdr.unique
            );
            reply(fuse_fd, hdr.unique, -libc::EIO, &[]);
        }
    }
}

/// Serve an ordinary request that arrived on `/dev/fuse`: lay it out as the
/// ring would (in_header, per-opcode header in `op_in`, rest as payload),
/// run the normal dispatch and write its answer back to `/dev/fuse`.
#[allow(clippy::too_many_arguments)]
fn dispatch_stray<F: Filesystem>(
    fuse_fd: RawFd,
    fs: &F,
    msg: &[u8],
    hdr: &fuse_in_header,
    body: &[u8],
    buf_len: usize,
    stray: &mut Option<Stray>,
    setxattr_ext: bool,
) -> io::Result<()> {
    let op_len = dispatch::op_in_size(hdr.opcode, setxattr_ext);
    if body.len() < op_len {
        return Err(io::Error::other("request shorter than its header"));
    }
    let stray = match stray {
        Some(s) => s,
        None => stray.insert(Stray {
            rt: Runtime::new()?,
            // Room for any payload that fits the read buffer.
            entry: RingEntry::new(buf_len)?,
        }),
    };
    let payload = &body[op_len..];
    let entry = &mut stray.entry;
    {
        let h = entry.header_mut();
        h.in_out.fill(0);
        h.in_out[..size_of::<fuse_in_header>()]
            .copy_from_slice(&msg[..size_of::<fuse_in_header>()]);
        h.op_in.fill(0);
        h.op_in[..op_len].copy_from_slice(&body[..op_len]);
        h.ring_ent_in_out = fuse_uring_ent_in_out {
            payload_sz: payload.len() as u32,
            ..Default::default()
        };
    }
    entry.payload_mut()[..payload.len()].copy_from_slice(payload);

    let (answer, panicked) = stray.rt.block_on(dispatch::dispatch(fs, entry));
    if panicked.is_err() {
        error!("filesystem op panicked (opcode {})", hdr.opcode);
    }
    if answer.is_none() {
        return Ok(());
    }
    let out: fuse_out_header =
        unsafe { std::ptr::read_unaligned(entry.header().in_out.as_ptr().cast()) };
    reply(fuse_fd, hdr.unique, out.error, entry.payload());
    Ok(())
}

/// Write a reply (header and body) to `/dev/fuse`.
fn reply(fuse_fd: RawFd, unique: u64, error: i32, body: &[u8]) {
    let out = fuse_out_header {
        len: (size_of::<fuse_out_header>() + body.len()) as u32,
        error,
        unique,
    };
    let iov = [
        libc::iovec {
            iov_base: (&out as *const fuse_out_header).cast_mut().cast(),
            iov_len: size_of::<fuse_out_header>(),
        },
        libc::iovec {
            iov_base: body.as_ptr().cast_mut().cast(),
            iov_len: body.len(),
        },
    ];
    let n = if body.is_empty() { 1 } else { 2 };
    if unsafe { libc::writev(fuse_fd, iov.as_ptr(), n) } < 0 {
        let e = io::Error::last_os_error();
        // ENOENT: the request was interrupted or aborted meanwhile.
        if e.raw_os_error() != Some(libc::ENOENT) {
            warn!("sideband: reply to unique {unique} failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filesystem::FsResult;
    use crate::types::*;
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    use std::sync::Mutex;
    use std::time::Duration;

    #[derive(Default)]
    struct Fs {
        forgotten: Mutex<Vec<(u64, u64)>>,
    }

    fn attr(ino: u64) -> FileAttr {
        FileAttr {
            ino,
            mode: libc::S_IFREG | 0o644,
            nlink: 1,
            ..Default::default()
        }
    }

    impl Filesystem for Fs {
        async fn lookup(&self, _: Request, _: InodeId, name: &OsStr) -> FsResult<ReplyEntry> {
            assert_eq!(name.as_bytes(), b"abc");
            Ok(ReplyEntry {
                ttl: Duration::from_secs(1),
                attr: attr(7),
                generation: 0,
            })
        }
        async fn getattr(
            &self,
            _: Request,
            inode: InodeId,
            _: Option<FileHandleId>,
            _: u32,
        ) -> FsResult<ReplyAttr> {
            Ok(ReplyAttr {
                ttl: Duration::from_secs(1),
                attr: attr(inode.0),
            })
        }
        fn forget(&self, _: Request, inode: InodeId, n: u64) {
            self.forgotten.lock().unwrap().push((inode.0, n));
        }
    }

    fn bytes<T>(v: &T) -> &[u8] {
        unsafe { std::slice::from_raw_parts((v as *const T).cast(), size_of::<T>()) }
    }

    fn msg(opcode: u32, nodeid: u64, unique: u64, body: &[u8]) -> Vec<u8> {
        let hdr = fuse_in_header {
            len: (size_of::<fuse_in_header>() + body.len()) as u32,
            opcode,
            unique,
            nodeid,
            ..Default::default()
        };
        let mut m = bytes(&hdr).to_vec();
        m.extend_from_slice(body);
        m
    }

    /// A SOCK_SEQPACKET pair standing in for /dev/fuse: (daemon end, kernel end).
    fn pair() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK,
                0,
                fds.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0);
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    fn answer(kernel: &OwnedFd) -> Option<(fuse_out_header, Vec<u8>)> {
        let mut buf = vec![0u8; 4096];
        let n = unsafe { libc::read(kernel.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return None;
        }
        buf.truncate(n as usize);
        let out: fuse_out_header = unsafe { std::ptr::read_unaligned(buf.as_ptr().cast()) };
        assert_eq!(out.len as usize, buf.len());
        Some((out, buf[size_of::<fuse_out_header>()..].to_vec()))
    }

    #[test]
    fn stray_requests_are_answered_and_forgets_delivered() {
        let fs = Fs::default();
        let (daemon, kernel) = pair();
        let fd = daemon.as_raw_fd();
        let mut stray = None;
        let buf_len = 64 * 1024;

        // GETATTR: a per-opcode header, no payload.
        let m = msg(FUSE_GETATTR, 5, 42, bytes(&fuse_getattr_in::default()));
        handle(fd, &fs, &m, buf_len, &mut stray, true);
        let (out, body) = answer(&kernel).expect("GETATTR answered");
        assert_eq!((out.error, out.unique), (0, 42));
        assert_eq!(body.len(), size_of::<fuse_attr_out>());
        let a: fuse_attr_out = unsafe { std::ptr::read_unaligned(body.as_ptr().cast()) };
        assert_eq!(a.attr.ino, 5);

        // LOOKUP: no per-opcode header, the name is the payload.
        let m = msg(FUSE_LOOKUP, 1, 44, b"abc\0");
        handle(fd, &fs, &m, buf_len, &mut stray, true);
        let (out, body) = answer(&kernel).expect("LOOKUP answered");
        assert_eq!((out.error, out.unique), (0, 44));
        let e: fuse_entry_out = unsafe { std::ptr::read_unaligned(body.as_ptr().cast()) };
        assert_eq!(e.nodeid, 7);

        // An opcode the filesystem leaves at its default: ENOSYS.
        let m = msg(FUSE_ACCESS, 1, 46, bytes(&fuse_access_in::default()));
        handle(fd, &fs, &m, buf_len, &mut stray, true);
        let (out, body) = answer(&kernel).expect("ACCESS answered");
        assert_eq!((out.error, out.unique, body.len()), (-libc::ENOSYS, 46, 0));

        // FORGET and BATCH_FORGET reach the filesystem, unanswered.
        let m = msg(FUSE_FORGET, 9, 48, bytes(&fuse_forget_in { nlookup: 3 }));
        handle(fd, &fs, &m, buf_len, &mut stray, true);
        let mut body = bytes(&fuse_batch_forget_in { count: 2, dummy: 0 }).to_vec();
        for (nodeid, nlookup) in [(10, 1), (11, 2)] {
            body.extend_from_slice(bytes(&fuse_forget_one { nodeid, nlookup }));
        }
        handle(
            fd,
            &fs,
            &msg(FUSE_BATCH_FORGET, 0, 50, &body),
            buf_len,
            &mut stray,
            true,
        );
        // INTERRUPT: dropped, unanswered.
        handle(
            fd,
            &fs,
            &msg(FUSE_INTERRUPT, 0, 53, &[0; 8]),
            buf_len,
            &mut stray,
            true,
        );
        assert!(answer(&kernel).is_none());
        assert_eq!(
            *fs.forgotten.lock().unwrap(),
            vec![(9, 3), (10, 1), (11, 2)]
        );
    }
}
