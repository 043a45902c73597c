//! The I/O the index does, behind a trait so tests can inject latency and
//! simulated power loss. Names are plain file names inside one directory.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// File operations of the index. Every method names a file in one directory.
pub trait Io: Send + Sync {
    /// Reads exactly `buf.len()` bytes at `off`.
    fn read_at(&self, name: &str, off: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Appends `data` (creating the file).
    fn append(&self, name: &str, data: &[u8]) -> io::Result<()>;
    /// Makes everything appended to `name` durable.
    fn sync(&self, name: &str) -> io::Result<()>;
    /// The file's length, `None` if it does not exist.
    fn len(&self, name: &str) -> io::Result<Option<u64>>;
    fn truncate(&self, name: &str, len: u64) -> io::Result<()>;
    /// Atomically replaces `to` by `from`, durably (directory synced).
    fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    fn remove(&self, name: &str) -> io::Result<()>;
    fn list(&self) -> io::Result<Vec<String>>;
    /// Simulated device time spent so far (0 for a real device).
    fn simulated_ns(&self) -> u64 {
        0
    }
    /// Reads a whole file.
    fn read_all(&self, name: &str) -> io::Result<Vec<u8>> {
        let len = self
            .len(name)?
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let mut buf = vec![0; len as usize];
        self.read_at(name, 0, &mut buf)?;
        Ok(buf)
    }
}

/// Files in a real directory. With `direct`, page-aligned reads of run and
/// segment files bypass the page cache (`O_DIRECT`), falling back to
/// buffered reads where the filesystem refuses it (tmpfs).
pub struct FsIo {
    dir: PathBuf,
    direct: bool,
    /// Whether `sync` reaches the device (false for a scratch index).
    durable: bool,
    files: Mutex<HashMap<String, (File, Option<File>)>>,
}

impl FsIo {
    pub fn new(dir: &Path, direct: bool) -> io::Result<FsIo> {
        std::fs::create_dir_all(dir)?;
        Ok(FsIo {
            dir: dir.to_path_buf(),
            direct,
            durable: true,
            files: Mutex::new(HashMap::new()),
        })
    }

    /// Files for an index that lives for one process and is removed after
    /// it (a dedupe run's spilled block table): `sync` does nothing, since
    /// nothing of it has to survive a crash. Such an index must never be
    /// reopened after a crash.
    pub fn scratch(dir: &Path) -> io::Result<FsIo> {
        let mut io = FsIo::new(dir, false)?;
        io.durable = false;
        Ok(io)
    }

    fn with_file<T>(
        &self,
        name: &str,
        f: impl FnOnce(&File, Option<&File>) -> io::Result<T>,
    ) -> io::Result<T> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if !files.contains_key(name) {
            let path = self.dir.join(name);
            let file = OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .open(&path)?;
            let direct = self
                .direct
                .then(|| {
                    OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_DIRECT)
                        .open(&path)
                        .ok()
                })
                .flatten();
            files.insert(name.to_string(), (file, direct));
        }
        let (file, direct) = &files[name];
        f(file, direct.as_ref())
    }
}

const ALIGN: usize = 4096;

fn read_direct(file: &File, off: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut raw = vec![0u8; buf.len() + ALIGN];
    let skip = (ALIGN - raw.as_ptr() as usize % ALIGN) % ALIGN;
    let aligned = &mut raw[skip..skip + buf.len()];
    file.read_exact_at(aligned, off)?;
    buf.copy_from_slice(aligned);
    Ok(())
}

impl Io for FsIo {
    fn read_at(&self, name: &str, off: u64, buf: &mut [u8]) -> io::Result<()> {
        let aligned = off.is_multiple_of(ALIGN as u64) && buf.len().is_multiple_of(ALIGN);
        self.with_file(name, |f, d| match d {
            Some(d) if aligned => read_direct(d, off, buf),
            _ => f.read_exact_at(buf, off),
        })
    }
    fn append(&self, name: &str, data: &[u8]) -> io::Result<()> {
        use std::io::Write;
        self.with_file(name, |mut f, _| f.write_all(data))
    }
    fn sync(&self, name: &str) -> io::Result<()> {
        if !self.durable {
            return Ok(());
        }
        self.with_file(name, |f, _| f.sync_data())
    }
    fn len(&self, name: &str) -> io::Result<Option<u64>> {
        match std::fs::metadata(self.dir.join(name)) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        self.with_file(name, |f, _| f.set_len(len))
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        files.remove(from);
        files.remove(to);
        std::fs::rename(self.dir.join(from), self.dir.join(to))?;
        if !self.durable {
            return Ok(());
        }
        File::open(&self.dir)?.sync_all()
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        match std::fs::remove_file(self.dir.join(name)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
    fn list(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir)? {
            out.push(e?.file_name().to_string_lossy().into_owned());
        }
        Ok(out)
    }
}

/// A simulated slow device in front of another [`Io`]: every read costs
/// `latency` plus its bytes at `bytes_per_sec`, added to a virtual clock
/// (and slept for real only when `sleep` is set). Used to reproduce the
/// seed's slow-device results without waiting hours; documented as a
/// simulation wherever its figures are quoted.
pub struct SlowIo<I> {
    pub inner: I,
    pub latency: Duration,
    pub bytes_per_sec: u64,
    pub sleep: bool,
    virtual_ns: AtomicU64,
}

impl<I: Io> SlowIo<I> {
    pub fn new(inner: I, latency: Duration, bytes_per_sec: u64) -> Self {
        SlowIo {
            inner,
            latency,
            bytes_per_sec,
            sleep: false,
            virtual_ns: AtomicU64::new(0),
        }
    }
}

impl<I: Io> Io for SlowIo<I> {
    fn read_at(&self, name: &str, off: u64, buf: &mut [u8]) -> io::Result<()> {
        let ns = self.latency.as_nanos() as u64
            + buf.len() as u64 * 1_000_000_000 / self.bytes_per_sec.max(1);
        self.virtual_ns.fetch_add(ns, Ordering::Relaxed);
        if self.sleep {
            std::thread::sleep(Duration::from_nanos(ns));
        }
        self.inner.read_at(name, off, buf)
    }
    fn append(&self, name: &str, data: &[u8]) -> io::Result<()> {
        self.inner.append(name, data)
    }
    fn sync(&self, name: &str) -> io::Result<()> {
        self.inner.sync(name)
    }
    fn len(&self, name: &str) -> io::Result<Option<u64>> {
        self.inner.len(name)
    }
    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        self.inner.truncate(name, len)
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.inner.remove(name)
    }
    fn list(&self) -> io::Result<Vec<String>> {
        self.inner.list()
    }
    fn simulated_ns(&self) -> u64 {
        self.virtual_ns.load(Ordering::Relaxed)
    }
}

#[derive(Default, Clone)]
struct MemFile {
    data: Vec<u8>,
    synced: Option<Vec<u8>>,
}

/// Files in RAM with a power-loss simulation: [`MemIo::power_loss`] keeps
/// of every file only what was synced (renames are durable when done).
#[derive(Default)]
pub struct MemIo {
    files: Mutex<HashMap<String, MemFile>>,
}

impl MemIo {
    /// Drops everything not yet synced, as a power cut would.
    pub fn power_loss(&self) {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        files.retain(|_, f| f.synced.is_some());
        for f in files.values_mut() {
            f.data = f.synced.clone().unwrap_or_default();
        }
    }

    /// Drops what was appended to `name` since its last sync, as Linux
    /// may after a failed writeback.
    pub fn drop_unsynced(&self, name: &str) {
        if let Some(f) = self.files().get_mut(name) {
            f.data = f.synced.clone().unwrap_or_default();
        }
    }

    fn files(&self) -> std::sync::MutexGuard<'_, HashMap<String, MemFile>> {
        self.files.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn not_found() -> io::Error {
    io::Error::from(io::ErrorKind::NotFound)
}

impl Io for MemIo {
    fn read_at(&self, name: &str, off: u64, buf: &mut [u8]) -> io::Result<()> {
        let files = self.files();
        let f = files.get(name).ok_or_else(not_found)?;
        let end = off as usize + buf.len();
        if end > f.data.len() {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        buf.copy_from_slice(&f.data[off as usize..end]);
        Ok(())
    }
    fn append(&self, name: &str, data: &[u8]) -> io::Result<()> {
        self.files()
            .entry(name.to_string())
            .or_default()
            .data
            .extend_from_slice(data);
        Ok(())
    }
    fn sync(&self, name: &str) -> io::Result<()> {
        let mut files = self.files();
        let f = files.entry(name.to_string()).or_default();
        f.synced = Some(f.data.clone());
        Ok(())
    }
    fn len(&self, name: &str) -> io::Result<Option<u64>> {
        Ok(self.files().get(name).map(|f| f.data.len() as u64))
    }
    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        let mut files = self.files();
        let f = files.get_mut(name).ok_or_else(not_found)?;
        f.data.resize(len as usize, 0);
        Ok(())
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let mut files = self.files();
        let mut f = files.remove(from).ok_or_else(not_found)?;
        // The directory entry is durable; the content only as far as synced.
        f.synced.get_or_insert_with(Vec::new);
        files.insert(to.to_string(), f);
        Ok(())
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.files().remove(name);
        Ok(())
    }
    fn list(&self) -> io::Result<Vec<String>> {
        Ok(self.files().keys().cloned().collect())
    }
}

impl<T: Io + ?Sized> Io for std::sync::Arc<T> {
    fn read_at(&self, name: &str, off: u64, buf: &mut [u8]) -> io::Result<()> {
        (**self).read_at(name, off, buf)
    }
    fn append(&self, name: &str, data: &[u8]) -> io::Result<()> {
        (**self).append(name, data)
    }
    fn sync(&self, name: &str) -> io::Result<()> {
        (**self).sync(name)
    }
    fn len(&self, name: &str) -> io::Result<Option<u64>> {
        (**self).len(name)
    }
    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        (**self).truncate(name, len)
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        (**self).rename(from, to)
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        (**self).remove(name)
    }
    fn list(&self) -> io::Result<Vec<String>> {
        (**self).list()
    }
    fn simulated_ns(&self) -> u64 {
        (**self).simulated_ns()
    }
}
