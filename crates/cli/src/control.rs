//! The mount's control channel: how `onecopy store gc` reaches the process
//! that has the store mounted. A Unix socket, `DIR/control.sock`, in the
//! store's own directory (mode 0700: only the store's owner reaches it),
//! made by the mount process while it holds the store's lock. A request is
//! one line (`gc`), the answer one line of JSON. Nothing here signals a
//! process or trusts a pid file: a stale socket left by a killed mount
//! refuses the connection, and a mount that dies while answering closes
//! it, which the caller reads as "gone".

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use onecopy_store::{GcReport, Store, StoreError};

/// Longest wait for a mount that was just unmounted to let go of its
/// store (its final commit: about 1-2.5 s measured under xfstests).
const EXIT_WAIT: Duration = Duration::from_secs(60);

/// Opens the store in `dir`. When its lock is held by a mount that has
/// been unmounted and is still writing its final commit (the lock's
/// holder is an `onecopy mount` process, the store is no longer
/// mounted), waits for it, saying so once on
/// stderr, for at most [`EXIT_WAIT`]: `umount` followed at once by
/// `mount`, `fsck` or `gc` then works instead of failing with "in use".
pub fn open_store(dir: &Path) -> Result<Store, StoreError> {
    let start = Instant::now();
    let (mut said, mut unseen) = (false, 0);
    loop {
        match Store::open(dir) {
            Err(StoreError::Locked { .. })
                if start.elapsed() < EXIT_WAIT && last_mount_exiting(dir, &mut unseen) =>
            {
                if !said {
                    errln!(
                        "onecopy: waiting for the store's last mount to finish its final commit \
                         (up to {} s)",
                        EXIT_WAIT.as_secs()
                    );
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            r => return r,
        }
    }
}

/// The store's lock is held by an `onecopy mount` process (from
/// /proc/locks; nothing is signalled, so a pid that is no longer ours
/// costs at most a wait) and the store is not mounted any more. A lock
/// with no holder listed, or whose holder has gone since /proc/locks
/// was read, was let go between the looks: worth another try, a few
/// times (`unseen` counts them).
fn last_mount_exiting(dir: &Path, unseen: &mut u32) -> bool {
    let holder = match lock_holder(&dir.join("lock")).map(holder_kind) {
        Some(Holder::Mount) => true,
        Some(Holder::Other) => false,
        None | Some(Holder::Gone) => {
            *unseen += 1;
            *unseen <= 20
        }
    };
    holder && !is_mounted(dir)
}

/// The pid holding a flock on `path`, from /proc/locks (lines such as
/// `1: FLOCK ADVISORY WRITE 1234 08:01:5678 0 EOF`).
fn lock_holder(path: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(path).ok()?.ino();
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let at = f.iter().position(|&w| w == "FLOCK")?;
        let (pid, id) = (f.get(at + 3)?, f.get(at + 4)?);
        let file_ino: u64 = id.rsplit(':').next()?.parse().ok()?;
        (file_ino == ino).then(|| pid.parse().ok())?
    })
}

/// What a lock's holder is.
#[derive(Debug, PartialEq, Eq)]
enum Holder {
    /// This program's `mount` command (or its `mount.onecopy` helper).
    Mount,
    /// Any other process.
    Other,
    /// No such process any more: it exited after /proc/locks was read.
    Gone,
}

/// What process `pid` is. A process that is exiting has no command line
/// any more (its memory is gone before its files are closed): then its
/// name says it.
fn holder_kind(pid: u32) -> Holder {
    let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        let gone = !Path::new(&format!("/proc/{pid}")).exists();
        return if gone { Holder::Gone } else { Holder::Other };
    };
    let mount = if cmd.is_empty() {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let comm = comm.trim();
        comm == "onecopy" || comm.starts_with("mount.") && comm.contains("onecopy")
    } else {
        let mut args = cmd.split(|&b| b == 0).map(String::from_utf8_lossy);
        let prog = args.next().unwrap_or_default();
        let name = Path::new(prog.as_ref())
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        match name.as_deref() {
            Some("onecopy") => args.any(|a| a == "mount"),
            Some(n) => n.starts_with("mount.") && n.contains("onecopy"),
            None => false,
        }
    };
    if mount {
        Holder::Mount
    } else {
        Holder::Other
    }
}

/// Whether a onecopy mount of the store in `dir` is in the mount table
/// (its source is `onecopy:DIR`, DIR canonical).
pub fn is_mounted(dir: &Path) -> bool {
    let Ok(dir) = dir.canonicalize() else {
        return false;
    };
    let Ok(mounts) = onecopy_ioctl::mounts::read() else {
        return false;
    };
    mounts.iter().any(|m| {
        m.source
            .strip_prefix("onecopy:")
            .is_some_and(|p| Path::new(p) == dir)
    })
}

/// The socket's path in store directory `dir`.
pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join("control.sock")
}

/// A request to the mount, one JSON line.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    Gc,
    /// Store what programs wrote (`syncfs` of the mount) and snapshot it.
    SnapshotCreate {
        name: String,
    },
    SnapshotDelete {
        name: String,
    },
    SnapshotList,
    SnapshotDiff {
        old: String,
        new: String,
    },
    SnapshotForget {
        keep: onecopy_store::Keep,
        dry_run: bool,
    },
    /// Write a snapshot's tree as the new directory `dest` (absolute, as
    /// this process sees it). Only the mount's own user or root reaches
    /// the socket (mode 0600), who could write there themselves.
    SnapshotRestore {
        name: String,
        dest: PathBuf,
    },
}

/// Serves requests for `store`, mounted on `mountpoint`, on its socket,
/// from a thread of its own, until the process exits. Holds the store
/// weakly: once the mount ends a late request is answered with an error.
/// Called with the store's lock held, so a socket file already there is a
/// dead mount's and is replaced. The socket is removed by [`Listening`]'s
/// drop.
pub fn listen(store: &Arc<Store>, mountpoint: &Path) -> std::io::Result<Listening> {
    use std::os::unix::fs::PermissionsExt;
    let path = socket_path(store.dir());
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    let weak = Arc::downgrade(store);
    let mountpoint = mountpoint.to_path_buf();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let (weak, mnt) = (weak.clone(), mountpoint.clone());
            std::thread::spawn(move || answer(conn, &weak, &mnt));
        }
    });
    Ok(Listening { path })
}

/// The socket of a mount that is serving; removed when dropped (before
/// the store is closed and its lock released).
pub struct Listening {
    path: PathBuf,
}

impl Drop for Listening {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn answer(conn: UnixStream, store: &Weak<Store>, mountpoint: &Path) {
    let mut line = String::new();
    if BufReader::new(&conn).read_line(&mut line).is_err() {
        return;
    }
    let reply = match (serde_json::from_str::<Request>(&line), store.upgrade()) {
        (Ok(req), Some(store)) => {
            until_caller_leaves(&conn, |left| serve(&store, req, mountpoint, left))
        }
        (_, None) => serde_json::json!({ "error": "the mount is ending" }),
        (Err(e), _) => serde_json::json!({ "error": format!("unknown request: {e}") }),
    };
    let _ = writeln!(&conn, "{reply}");
}

/// Runs `f` with a flag set once the caller has closed its end of
/// `conn` (it sends nothing after its request, so a read that returns
/// means it is gone): a long request (a restore) stops when its caller
/// is killed. Without a thread to watch, `f` runs to its end.
fn until_caller_leaves<T>(conn: &UnixStream, f: impl FnOnce(&AtomicBool) -> T) -> T {
    let left = AtomicBool::new(false);
    std::thread::scope(|sc| {
        let watch = std::thread::Builder::new().spawn_scoped(sc, || {
            let _ = (&mut &*conn).read(&mut [0u8; 1]);
            left.store(true, Ordering::Relaxed);
        });
        let r = f(&left);
        if watch.is_ok() {
            // Wakes the watcher's read (the answer is still written).
            let _ = conn.shutdown(std::net::Shutdown::Read);
        }
        r
    })
}

/// Runs one request; its JSON answer. `left`: the caller went away.
fn serve(store: &Store, req: Request, mountpoint: &Path, left: &AtomicBool) -> serde_json::Value {
    let r = match req {
        Request::Gc => store.gc().map(|r| {
            // What gc freed goes back to the kernel now, not when the
            // allocator next happens to trim.
            onecopy_ioctl::process::release_free_memory();
            serde_json::to_value(r)
        }),
        Request::SnapshotCreate { name } => {
            sync_mount(mountpoint).and_then(|_| store.snapshot_create(&name).map(to_json))
        }
        Request::SnapshotDelete { name } => store.snapshot_delete(&name).map(to_json),
        Request::SnapshotList => store.snapshot_list().map(to_json),
        Request::SnapshotDiff { old, new } => store.snapshot_diff(&old, &new).map(to_json),
        Request::SnapshotForget { keep, dry_run } => {
            store.snapshot_forget(keep, dry_run).map(to_json)
        }
        Request::SnapshotRestore { name, dest } => store
            .snapshot_restore_until(&name, &dest, left)
            .map(to_json),
    };
    match r {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => serde_json::json!({ "error": e.to_string() }),
        // Bad arguments stay bad arguments at the caller (exit 2).
        Err(StoreError::BadOption(why)) => {
            let e = StoreError::BadOption(why.clone());
            serde_json::json!({ "error": e.to_string(), "errno": e.errno(), "bad_option": why })
        }
        Err(e) => serde_json::json!({ "error": e.to_string(), "errno": e.errno() }),
    }
}

fn to_json<T: serde::Serialize>(v: T) -> serde_json::Result<serde_json::Value> {
    serde_json::to_value(v)
}

/// Has the kernel send what programs wrote to the mount (its writeback
/// cache) to the store: `syncfs` on the mount point, by a child process
/// (coreutils' `sync -f`). Never by a thread of the mount: opening the
/// mount point and the sync wait, uninterruptibly, for the mount's own
/// answers, and such a thread left waiting when the mount is killed
/// (`kill -9`) keeps the process from ever exiting, so the kernel never
/// aborts the mount and every program using it hangs. A child is not
/// part of the mount: the kill ends the mount, the kernel aborts its
/// requests, and the child's sync fails.
fn sync_mount(mountpoint: &Path) -> Result<(), StoreError> {
    let io = |source| StoreError::Io {
        path: mountpoint.into(),
        source,
    };
    let sync = ["/usr/bin/sync", "/bin/sync"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("sync");
    let status = std::process::Command::new(sync)
        .arg("--file-system")
        .arg(mountpoint)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(io)?;
    match status.success() {
        true => Ok(()),
        false => Err(io(std::io::Error::other(format!("{sync}: {status}")))),
    }
}

/// Asks the mount of the store in `dir` to run `req` and waits for its
/// answer. `None` when no mount answers (no socket, or a stale one); an
/// error when the request failed or the mount died meanwhile.
pub fn request<T: serde::de::DeserializeOwned>(
    dir: &Path,
    req: &Request,
) -> Option<Result<T, StoreError>> {
    let conn = UnixStream::connect(socket_path(dir)).ok()?;
    let failed = |why: String| StoreError::Io {
        path: dir.into(),
        source: std::io::Error::other(format!("the mount: {why}")),
    };
    let line = serde_json::to_string(req).expect("serializes");
    if writeln!(&conn, "{line}").is_err() {
        return Some(Err(failed("it did not take the request".into())));
    }
    let mut line = String::new();
    let read = BufReader::new(&conn).read_line(&mut line);
    if read.is_err() || line.is_empty() {
        return Some(Err(failed("it ended before answering".into())));
    }
    let v: serde_json::Value = match serde_json::from_str(&line) {
        Ok(v) => v,
        Err(e) => return Some(Err(failed(format!("unreadable answer: {e}")))),
    };
    if let Some(why) = v.get("bad_option").and_then(|w| w.as_str()) {
        return Some(Err(StoreError::BadOption(why.to_string())));
    }
    if let Some(e) = v.get("error") {
        let text = e.as_str().unwrap_or_default().to_string();
        return Some(Err(match v.get("errno").and_then(|n| n.as_i64()) {
            Some(n) if n == libc::ENOENT as i64 => StoreError::NotFound,
            Some(n) if n == libc::EEXIST as i64 => StoreError::AlreadyExists,
            _ => failed(text),
        }));
    }
    Some(serde_json::from_value(v).map_err(|e| failed(format!("unreadable answer: {e}"))))
}

/// Asks the mount of the store in `dir` to run gc (see [`request`]).
pub fn request_gc(dir: &Path) -> Option<Result<GcReport, StoreError>> {
    request(dir, &Request::Gc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store served on its socket answers gc; once the mount's socket
    /// is gone (or left behind by a dead process) nobody answers, and no
    /// signal is sent anywhere.
    #[test]
    fn gc_is_asked_over_the_socket_and_a_stale_socket_answers_nothing() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("s");
        Store::init(&dir, &Default::default()).unwrap();
        let store = Arc::new(Store::open(&dir).unwrap());
        let listening = listen(&store, d.path()).unwrap();
        let mode = std::fs::metadata(socket_path(&dir)).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
        let rep = request_gc(&dir).expect("the mount answers").unwrap();
        assert_eq!(rep.chunks_dropped, 0);
        let create = |name: &str| {
            let req = Request::SnapshotCreate { name: name.into() };
            request::<serde_json::Value>(&dir, &req).expect("answers")
        };
        assert_eq!(create("mon").unwrap()["name"], "mon");
        assert!(matches!(create("mon"), Err(StoreError::AlreadyExists)));
        let list: serde_json::Value = request(&dir, &Request::SnapshotList).unwrap().unwrap();
        assert_eq!(list[0]["name"], "mon");
        let gone = Request::SnapshotDelete { name: "tue".into() };
        let r = request::<serde_json::Value>(&dir, &gone).unwrap();
        assert!(matches!(r, Err(StoreError::NotFound)), "{r:?}");
        drop(listening);
        assert!(request_gc(&dir).is_none(), "no socket: nobody to ask");
        // A socket file nobody listens on (a mount killed with -9).
        let stale = UnixListener::bind(socket_path(&dir)).unwrap();
        drop(stale);
        assert!(request_gc(&dir).is_none(), "a stale socket answers nothing");
    }

    /// A lock's holder is found in /proc/locks; a holder that exited
    /// since is `Gone` (the lock was let go: try again), not a stranger
    /// whose lock makes the store "in use".
    #[test]
    fn a_holder_that_exited_counts_as_let_go() {
        let d = tempfile::tempdir().unwrap();
        let lock = d.path().join("lock");
        let f = std::fs::File::create(&lock).unwrap();
        rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
        assert_eq!(lock_holder(&lock), Some(std::process::id()));
        assert_eq!(holder_kind(std::process::id()), Holder::Other);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(holder_kind(pid), Holder::Gone);
        drop(f);
        assert_eq!(lock_holder(&lock), None);
    }
}
