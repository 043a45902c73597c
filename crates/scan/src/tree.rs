//! The walked tree: devices, directories and file names, held once per run
//! and referred to by every [`crate::FileEntry`] through small ids.
//!
//! Memory: a file's name costs one length byte plus its bytes in one
//! arena (no allocation of its own); a directory is held once for all of
//! its files, as its parent's id and its own name (8 B plus the name); a
//! device's facts (number, filesystem, subvolume, block size, read-only)
//! once for all of its files. A [`FileEntry`]
//! carries an 8-byte [`NameId`] and a 4-byte [`DevId`] instead.
//!
//! [`FileEntry`]: crate::FileEntry

use std::collections::HashMap;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use crate::FsId;

/// A device of the walk: index into [`Tree::devices`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DevId(pub u32);

/// Where a file's path lives in its [`Tree`]: its directory and the
/// position of its name in the name arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NameId {
    pub dir: u32,
    pub at: u32,
}

/// What is known about one device number (a filesystem, or one btrfs
/// subvolume of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Device {
    /// `st_dev`.
    pub dev: u64,
    /// `f_fsid`: every subvolume of one btrfs shares it.
    pub fs: FsId,
    /// The btrfs subvolume id (0 elsewhere).
    pub subvol: u64,
    /// A read-only btrfs subvolume: its files are sources only.
    pub read_only: bool,
    /// The filesystem's block size: dedupe offsets are multiples of it.
    pub block: u64,
}

/// Why a path could not be added (limits of the compact ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TreeFull {
    #[error("more than 4 GiB of file names in one run")]
    Names,
    #[error("more than 4 billion directories in one run")]
    Dirs,
    #[error("more than 4 billion devices in one run")]
    Devices,
}

/// A directory: its parent ([`TOP`] for "/" or "", the start of every
/// path) and the position of its name in the name arena.
#[derive(Debug, Clone, Copy)]
struct Dir {
    parent: u32,
    at: u32,
}

/// The parent of a top directory ("/" or "").
const TOP: u32 = u32::MAX;

/// Devices, directories and names of one run (see the module doc).
#[derive(Debug, Default)]
pub struct Tree {
    devices: Vec<Device>,
    dirs: Vec<Dir>,
    /// Each name: one length byte (names are at most 255 bytes on Linux;
    /// longer components are refused) followed by its bytes.
    names: Vec<u8>,
}

impl Tree {
    pub fn new() -> Tree {
        Tree::default()
    }

    /// The facts of device `id` (an id this tree handed out).
    pub fn device(&self, id: DevId) -> &Device {
        &self.devices[id.0 as usize]
    }

    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The id of device number `dev`, if the tree has it.
    pub fn device_id(&self, dev: u64) -> Option<DevId> {
        let i = self.devices.iter().position(|x| x.dev == dev)?;
        Some(DevId(i as u32))
    }

    /// Adds device `d` (callers look up [`Tree::device_id`] first: a
    /// device number is added once).
    pub fn add_device(&mut self, d: Device) -> Result<DevId, TreeFull> {
        let id = u32::try_from(self.devices.len()).map_err(|_| TreeFull::Devices)?;
        self.devices.push(d);
        Ok(DevId(id))
    }

    /// Appends the path of directory `id` to `out`.
    fn dir_path(&self, id: u32, out: &mut Vec<u8>) {
        let mut chain = Vec::new();
        let mut i = id;
        loop {
            chain.push(i);
            let d = self.dirs[i as usize];
            if d.parent == TOP {
                break;
            }
            i = d.parent;
        }
        for &i in chain.iter().rev() {
            join(out, self.name(self.dirs[i as usize].at));
        }
    }

    /// Whether directory `id` is `path`, without building it.
    fn dir_is(&self, mut id: u32, mut path: &[u8]) -> bool {
        loop {
            let d = self.dirs[id as usize];
            let name = self.name(d.at);
            if d.parent == TOP {
                return path == name;
            }
            let Some(rest) = path.strip_suffix(name) else {
                return false;
            };
            let p = self.dirs[d.parent as usize];
            let pname = self.name(p.at);
            // No separator after "" or "/" (see `join`).
            let sep = p.parent != TOP || !(pname.is_empty() || pname.ends_with(b"/"));
            path = match (sep, rest.strip_suffix(b"/")) {
                (false, _) => rest,
                (true, Some(r)) => r,
                (true, None) => return false,
            };
            id = d.parent;
        }
    }

    /// Adds directory `name` under `parent` ([`TOP`]: a top directory).
    fn push_dir(&mut self, parent: u32, name: &[u8]) -> Result<u32, TreeFull> {
        let id = u32::try_from(self.dirs.len())
            .ok()
            .filter(|&i| i != TOP)
            .ok_or(TreeFull::Dirs)?;
        let at = push_name(&mut self.names, name)?;
        self.dirs.push(Dir { parent, at });
        Ok(id)
    }

    /// Adds every directory of `dir` from its top down, each new (for the
    /// few paths added after the walk); the id of `dir`.
    fn push_chain(&mut self, dir: &[u8]) -> Result<u32, TreeFull> {
        let (top, rest) = match dir.strip_prefix(b"/") {
            Some(r) => (&b"/"[..], r),
            None => (&b""[..], dir),
        };
        let mut id = self.push_dir(TOP, top)?;
        for c in rest.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
            id = self.push_dir(id, c)?;
        }
        Ok(id)
    }

    /// The name at `at`.
    fn name(&self, at: u32) -> &[u8] {
        let at = at as usize;
        let len = self.names[at] as usize;
        &self.names[at + 1..at + 1 + len]
    }

    /// The full path of `id`.
    pub fn path(&self, id: NameId) -> PathBuf {
        let mut b = Vec::with_capacity(80);
        self.dir_path(id.dir, &mut b);
        join(&mut b, self.name(id.at));
        PathBuf::from(std::ffi::OsString::from_vec(b))
    }

    /// Whether `id` names `p`, without building the path.
    pub fn path_is(&self, id: NameId, p: &Path) -> bool {
        let (pdir, pname) = split(p);
        pname == self.name(id.at) && self.dir_is(id.dir, pdir)
    }

    /// Adds the path `p` (its directories are not shared with others: for
    /// the few paths added after the walk).
    pub fn add_path(&mut self, p: &Path) -> Result<NameId, TreeFull> {
        let (dir, name) = split(p);
        let dir = self.push_chain(dir)?;
        let at = push_name(&mut self.names, name)?;
        Ok(NameId { dir, at })
    }

    /// An entry for the file at `path` with stat `m`, on a device with the
    /// given facts (added if new): for files met outside the walk.
    pub fn add_file(
        &mut self,
        path: &Path,
        m: &std::fs::Metadata,
        fs: FsId,
        subvol: u64,
        block: u64,
    ) -> Result<crate::FileEntry, TreeFull> {
        use std::os::unix::fs::MetadataExt;
        let dev = match self.device_id(m.dev()) {
            Some(d) => d,
            None => self.add_device(Device {
                dev: m.dev(),
                fs,
                subvol,
                read_only: false,
                block,
            })?,
        };
        let name = self.add_path(path)?;
        Ok(crate::FileEntry::from_meta(name, dev, m))
    }

    /// Appends `names` (a walker thread's arena) and returns the offset its
    /// positions must be shifted by.
    fn append_names(&mut self, names: &[u8]) -> Result<u32, TreeFull> {
        let base = u32::try_from(self.names.len()).map_err(|_| TreeFull::Names)?;
        if self.names.len() + names.len() > u32::MAX as usize {
            return Err(TreeFull::Names);
        }
        self.names.extend_from_slice(names);
        Ok(base)
    }

    /// Gives back the arenas' spare capacity (they grew by doubling).
    pub fn shrink_to_fit(&mut self) {
        self.dirs.shrink_to_fit();
        self.names.shrink_to_fit();
    }

    /// Bytes held by the arenas.
    pub fn heap_bytes(&self) -> usize {
        self.dirs.capacity() * std::mem::size_of::<Dir>() + self.names.capacity()
    }

    /// Renumbers the devices in order of device number (the walk meets
    /// them in an order that varies between runs); returns the map from
    /// old to new ids.
    fn sort_devices(&mut self) -> Vec<DevId> {
        let mut order: Vec<usize> = (0..self.devices.len()).collect();
        order.sort_unstable_by_key(|&i| self.devices[i].dev);
        let mut map = vec![DevId(0); order.len()];
        for (new, &old) in order.iter().enumerate() {
            map[old] = DevId(new as u32);
        }
        self.devices = order.iter().map(|&i| self.devices[i]).collect();
        map
    }
}

/// Appends path component `name` to `out`, with a separator unless `out`
/// is "" or ends with one ("/").
fn join(out: &mut Vec<u8>, name: &[u8]) {
    if !out.is_empty() && !out.ends_with(b"/") {
        out.push(b'/');
    }
    out.extend_from_slice(name);
}

/// `p` as (directory bytes, name bytes): "/a/b" is ("/a", "b"), "b" is
/// ("", "b"), "/b" is ("/", "b").
fn split(p: &Path) -> (&[u8], &[u8]) {
    let b = p.as_os_str().as_bytes();
    let b = b.strip_suffix(b"/").unwrap_or(b);
    match b.iter().rposition(|&c| c == b'/') {
        Some(0) => (&b[..1], &b[1..]),
        Some(i) => (&b[..i], &b[i + 1..]),
        None => (&[], b),
    }
}

/// Appends a length-prefixed name to an arena; its position.
fn push_name(names: &mut Vec<u8>, name: &[u8]) -> Result<u32, TreeFull> {
    let len = u8::try_from(name.len()).map_err(|_| TreeFull::Names)?;
    let at = u32::try_from(names.len()).map_err(|_| TreeFull::Names)?;
    names.push(len);
    names.extend_from_slice(name);
    Ok(at)
}

/// Builds a [`Tree`] from several walker threads: directories are interned
/// (each full directory path held once), names go to per-thread arenas
/// ([`LocalNames`]) that are appended in batches.
#[derive(Debug, Default)]
pub(crate) struct DirInterner {
    tree: Tree,
    /// xxh3 of a directory path -> its id. A hash shared by two paths
    /// (never seen in practice) only costs a second copy of the directory.
    ids: HashMap<u64, u32>,
}

impl DirInterner {
    pub(crate) fn new(tree: Tree) -> DirInterner {
        DirInterner {
            tree,
            ids: HashMap::new(),
        }
    }

    pub(crate) fn add_device(&mut self, d: Device) -> Result<DevId, TreeFull> {
        self.tree.add_device(d)
    }

    /// The id of directory `dir` if known.
    fn lookup(&self, dir: &[u8]) -> Option<u32> {
        let &id = self.ids.get(&xxhash_rust::xxh3::xxh3_64(dir))?;
        self.tree.dir_is(id, dir).then_some(id)
    }

    /// The id of directory `dir`, added with every missing ancestor if new
    /// (iteratively: trees may be thousands of levels deep).
    fn intern(&mut self, dir: &[u8]) -> Result<u32, TreeFull> {
        // Ends of the prefixes of `dir` not known yet, longest first.
        let mut missing = Vec::new();
        let mut end = dir.len();
        let mut parent = TOP;
        loop {
            let prefix = &dir[..end];
            if let Some(id) = self.lookup(prefix) {
                parent = id;
                break;
            }
            missing.push(end);
            if prefix.is_empty() || prefix == b"/" {
                break;
            }
            end = match prefix.iter().rposition(|&c| c == b'/') {
                Some(0) => 1,
                Some(i) => i,
                None => 0,
            };
        }
        for &end in missing.iter().rev() {
            let prefix = &dir[..end];
            let name = if parent == TOP {
                prefix
            } else {
                let start = prefix.iter().rposition(|&c| c == b'/').map_or(0, |i| i + 1);
                &prefix[start..]
            };
            parent = self.tree.push_dir(parent, name)?;
            self.ids
                .entry(xxhash_rust::xxh3::xxh3_64(prefix))
                .or_insert(parent);
        }
        Ok(parent)
    }

    /// The tree, with devices numbered in device order; `remap` is called
    /// with the map from old to new device ids, to renumber entries.
    pub(crate) fn finish(self, remap: impl FnOnce(&[DevId])) -> Tree {
        let mut tree = self.tree;
        let map = tree.sort_devices();
        remap(&map);
        tree.shrink_to_fit();
        tree
    }
}

/// One walker thread's names, and the directory it met last (files of one
/// directory mostly come one after another).
#[derive(Debug, Default)]
pub(crate) struct LocalNames {
    names: Vec<u8>,
    last_dir: Vec<u8>,
    last_id: Option<u32>,
}

impl LocalNames {
    /// Adds `p`: its directory interned in `shared` (locked only when the
    /// directory differs from the last one), its name in the local arena.
    /// The position is local until [`LocalNames::flush`].
    pub(crate) fn add(
        &mut self,
        p: &Path,
        shared: &std::sync::Mutex<DirInterner>,
    ) -> Result<NameId, TreeFull> {
        let (dir, name) = split(p);
        let dir_id = match self.last_id {
            Some(id) if self.last_dir == dir => id,
            _ => {
                let id = shared.lock().unwrap().intern(dir)?;
                self.last_dir.clear();
                self.last_dir.extend_from_slice(dir);
                self.last_id = Some(id);
                id
            }
        };
        let at = push_name(&mut self.names, name)?;
        Ok(NameId { dir: dir_id, at })
    }

    /// Moves the local names into the shared tree; returns the amount the
    /// positions handed out since the last flush must be shifted by.
    pub(crate) fn flush(&mut self, shared: &mut DirInterner) -> Result<u32, TreeFull> {
        let base = shared.tree.append_names(&self.names);
        self.names.clear();
        base
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn paths_round_trip() {
        let mut t = Tree::new();
        for p in ["/a/b/c", "/c", "rel", "x/y", "/a/b/"] {
            let id = t.add_path(Path::new(p)).unwrap();
            let want = Path::new(p.strip_suffix('/').unwrap_or(p));
            assert_eq!(t.path(id), want, "{p}");
            assert!(t.path_is(id, want));
            assert!(!t.path_is(id, Path::new("/a/b/d")));
        }
        let long = "n".repeat(256);
        assert_eq!(t.add_path(Path::new(&long)), Err(TreeFull::Names));
    }

    #[test]
    fn directories_are_held_once() {
        let shared = Mutex::new(DirInterner::new(Tree::new()));
        let mut local = LocalNames::default();
        let a = local.add(Path::new("/d/one"), &shared).unwrap();
        let b = local.add(Path::new("/e/two"), &shared).unwrap();
        let c = local.add(Path::new("/d/three"), &shared).unwrap();
        assert_eq!(a.dir, c.dir);
        assert_ne!(a.dir, b.dir);
        let mut s = shared.into_inner().unwrap();
        let base = local.flush(&mut s).unwrap();
        let tree = s.finish(|_| {});
        let shift = |n: NameId| NameId {
            at: n.at + base,
            ..n
        };
        assert_eq!(tree.path(shift(c)), Path::new("/d/three"));
        assert_eq!(tree.path(shift(b)), Path::new("/e/two"));
        // "/", "/d", "/e".
        assert_eq!(tree.dirs.len(), 3);
    }

    #[test]
    fn nested_and_relative_directories() {
        let shared = Mutex::new(DirInterner::new(Tree::new()));
        let mut local = LocalNames::default();
        let paths = ["/a/b/c/f", "/a/b/g", "/a/x/c/f", "rel/d/f", "/f", "top"];
        let ids: Vec<NameId> = paths
            .iter()
            .map(|p| local.add(Path::new(p), &shared).unwrap())
            .collect();
        let mut s = shared.into_inner().unwrap();
        let base = local.flush(&mut s).unwrap();
        let tree = s.finish(|_| {});
        for (p, id) in paths.iter().zip(&ids) {
            let id = NameId {
                at: id.at + base,
                ..*id
            };
            assert_eq!(tree.path(id), Path::new(p));
            assert!(tree.path_is(id, Path::new(p)));
            assert!(!tree.path_is(id, Path::new("/a/b/c/g")));
        }
        // "/", "/a", "/a/b", "/a/b/c", "/a/x", "/a/x/c", "", "rel", "rel/d".
        assert_eq!(tree.dirs.len(), 9);
        let first = NameId {
            at: ids[0].at + base,
            ..ids[0]
        };
        assert!(!tree.path_is(first, Path::new("/a/bc/f")));
        assert!(!tree.path_is(first, Path::new("a/b/c/f")));
    }

    #[test]
    fn devices_numbered_in_device_order() {
        let mut s = DirInterner::new(Tree::new());
        let d = |dev| Device {
            dev,
            fs: 1,
            subvol: 0,
            read_only: false,
            block: 4096,
        };
        assert_eq!(s.add_device(d(9)).unwrap(), DevId(0));
        assert_eq!(s.add_device(d(3)).unwrap(), DevId(1));
        assert_eq!(s.tree.device_id(9), Some(DevId(0)));
        let mut seen = Vec::new();
        let t = s.finish(|m| seen = m.to_vec());
        assert_eq!(seen, vec![DevId(1), DevId(0)]);
        assert_eq!(t.device(DevId(0)).dev, 3);
    }
}
