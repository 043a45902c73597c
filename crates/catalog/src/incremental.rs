//! Deciding, from the catalog, which walked files must be read again.
//!
//! A file is known (its digests are reused, it is not read) when the
//! catalog holds a record for its `(filesystem, subvolume, inode)` with the
//! same size and mtime and:
//! * the same ctime, or
//! * another path or link count (a rename, move, `link` or `unlink`
//!   updates ctime) and the same inode generation, which rules out a
//!   reused inode number.
//!
//! So a rename costs no read, while a content change whose mtime was put
//! back (`touch -r`) is caught by its ctime. Records of files under the
//! roots that the walk did not see are deleted. Records outside the roots
//! are kept, and used as dedupe sources (never destinations) while their
//! file still exists unchanged.

use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use onecopy_digest::sub_of_block;
use onecopy_scan::{DigestStore, Digests, FileEntry, FsId, HashedFile, Marks, Tree};

use crate::{Catalog, CatalogError, FileRecord};

/// What consulting one filesystem's catalog gave ([`consult`]).
pub struct Consulted {
    /// The catalog, to be updated after the run; `None` when it could not
    /// be opened (`failed`), and the run goes on without one.
    pub catalog: Option<Catalog>,
    pub classified: Classified,
    /// Why the catalog was set aside and rebuilt part way through, if it
    /// was: what it had given was forgotten.
    pub rebuilt: Option<CatalogError>,
    /// Why no catalog could be used, if so: every file is read.
    pub failed: Option<CatalogError>,
}

/// Opens the catalog at `path` (`own`: onecopy's default path, whose
/// unreadable content may be set aside) and classifies the walked files
/// against it, each record as it is read: the catalog is read once and no
/// list of records is held. A catalog found damaged part way is rebuilt
/// and what it gave is forgotten; one that can not be opened leaves every
/// file to read.
pub fn consult(
    path: &std::path::Path,
    block_size: u64,
    own: bool,
    mut classifier: Classifier<'_>,
) -> Consulted {
    classifier.one_sub_blocks = block_size == classifier.fs_block;
    let spill = classifier.store.spill_handle();
    let offer = &mut |r| classifier.offer(r);
    let opened = Catalog::open_and_scan(path, block_size, (own, spill), offer);
    match opened {
        Ok((catalog, rebuilt)) => {
            if rebuilt.is_some() {
                classifier.forget();
            }
            Consulted {
                catalog: Some(catalog),
                classified: classifier.finish(),
                rebuilt,
                failed: None,
            }
        }
        Err(e) => {
            classifier.forget();
            Consulted {
                catalog: None,
                classified: classifier.finish(),
                rebuilt: None,
                failed: Some(e),
            }
        }
    }
}

impl FileRecord {
    /// The record of `f` (its path in `tree`, its digests in `store`) on
    /// filesystem `fs_key`, as run `last_seen` leaves it (`settled`);
    /// `None` if `store` could not give all its digests back (its scratch
    /// file failed): no record is better than one with digests missing,
    /// the file is then read again by a later run. A long list stays in
    /// the scratch file: the catalog reads it from there in pieces.
    pub fn of(
        fs_key: &str,
        f: &HashedFile,
        (tree, store): (&Tree, &DigestStore),
        settled: bool,
        last_seen: u64,
    ) -> Option<Self> {
        let long = f.digests.is_long().then_some(f.digests);
        let blocks = match long {
            Some(_) => Vec::new(),
            None => f.blocks(store).to_vec_checked()?,
        };
        Some(FileRecord {
            fs: fs_key.to_string(),
            subvol: tree.device(f.entry.dev).subvol,
            ino: f.entry.ino,
            generation: f.generation.into(),
            path: tree.path(f.entry.name),
            size: f.entry.size,
            mtime_ns: f.entry.mtime_ns,
            ctime_ns: f.entry.ctime_ns,
            nlink: f.entry.nlink.into(),
            whole: f.whole(),
            blocks,
            long,
            flags: f.inode_flags,
            settled,
            last_seen,
        })
    }
}

/// What [`classify`] decided.
#[derive(Debug, Default)]
pub struct Classified {
    /// Files whose digests come from the catalog; `entry.marks` says which
    /// are settled, outside the roots (sources only) or dirty (their
    /// record must be rewritten).
    pub known: Vec<HashedFile>,
    pub to_read: Vec<FileEntry>,
    /// Catalog keys to delete: files gone, changed outside the roots, or
    /// no longer found under the roots.
    pub deleted: Vec<(String, u64, u64)>,
    /// Known files found under another path than recorded.
    pub renamed: u64,
}

/// Whether `p` is one of `roots` or below one: its ancestors looked up,
/// not every root compared (20,000 file roots from `--fdupes` took 195 s
/// of comparisons).
fn under_roots(p: &std::path::Path, roots: &std::collections::HashSet<&std::path::Path>) -> bool {
    p.ancestors().any(|a| roots.contains(a))
}

/// The known file `entry` with what its record gives.
fn known_file(mut entry: FileEntry, h: Hit, outside: bool) -> HashedFile {
    entry.marks.set(Marks::SETTLED, h.settled);
    entry.marks.set(Marks::DIRTY, h.dirty);
    entry.marks.set(Marks::OUTSIDE_ROOTS, outside);
    HashedFile::new(entry, h.blocks, h.whole, h.flags, h.generation)
}

fn generation_of(path: &std::path::Path) -> Option<u64> {
    let f = onecopy_scan::longpath::open(path, rustix::fs::OFlags::empty()).ok()?;
    onecopy_ioctl::fs::inode_generation(f.as_fd()).ok()
}

/// Splits the walked files of one filesystem (`fs_key`, `fs`, `fs_block`)
/// into known and to-read, against that filesystem's `records`. `roots`
/// must be absolute, as the walked paths are; `tree` holds the walked
/// paths, and gets those of known files outside the roots; `store` gets
/// the known files' digests.
pub fn classify(
    fs_key: &str,
    (fs, fs_block): (FsId, u64),
    records: Vec<FileRecord>,
    walked: Vec<FileEntry>,
    (tree, store): (&mut Tree, &mut DigestStore),
    roots: &[PathBuf],
) -> Classified {
    let mut c = Classifier::new(fs_key, (fs, fs_block), walked, (tree, store), roots);
    for r in records {
        c.offer(r);
    }
    c.finish()
}

/// A catalog record that matched a walked file and is trusted: what the
/// known file takes from it (its path is not kept).
struct Hit {
    /// Position in the walked list.
    at: u32,
    dirty: bool,
    settled: bool,
    flags: u32,
    generation: u32,
    whole: u128,
    blocks: Digests,
}

impl Hit {
    /// Its digests go to `store`.
    fn new(at: usize, rec: FileRecord, dirty: bool, store: &mut DigestStore) -> Hit {
        Hit {
            at: at as u32,
            dirty,
            settled: rec.settled,
            flags: rec.flags,
            // The kernel's generation is 32 bits; a larger value (a
            // damaged record) only fails to match.
            generation: rec.generation as u32,
            whole: rec.whole,
            blocks: rec.long.unwrap_or_else(|| store.push(&rec.blocks, &[])),
        }
    }
}

/// [`classify`] one record at a time, as the catalog is read: no list of
/// records is ever held. Memory: the walked list, plus per trusted record
/// its block digests and 64 B, plus the records of files outside the
/// roots. Walked files are found by binary search in the walked list
/// (sorted by device and inode, each device one subvolume), not by a map.
pub struct Classifier<'a> {
    fs_key: &'a str,
    fs: FsId,
    fs_block: u64,
    roots: std::collections::HashSet<&'a std::path::Path>,
    walked: Vec<FileEntry>,
    tree: &'a mut Tree,
    store: &'a mut DigestStore,
    /// `(subvolume, start, end)`: runs of `walked` of one device (one
    /// subvolume), sorted by inode within; the runs sorted by subvolume.
    runs: Vec<(u64, usize, usize)>,
    hits: Vec<Hit>,
    outside: Vec<HashedFile>,
    deleted: Vec<(String, u64, u64)>,
    renamed: u64,
    /// The block is the filesystem block: a record whose digests are not
    /// all [`onecopy_digest::block_of_sub`] digests (written before
    /// that scheme) is not trusted, so its file is read again.
    one_sub_blocks: bool,
}

impl<'a> Classifier<'a> {
    /// `walked`: the walked files of the filesystem (`fs_key`, `fs`,
    /// `fs_block`), their paths in `tree`; known files' digests go to
    /// `store`. `roots` must be absolute, as the walked paths are.
    pub fn new(
        fs_key: &'a str,
        (fs, fs_block): (FsId, u64),
        mut walked: Vec<FileEntry>,
        (tree, store): (&'a mut Tree, &'a mut DigestStore),
        roots: &'a [PathBuf],
    ) -> Classifier<'a> {
        if !walked.is_sorted_by_key(|e| (e.dev, e.ino)) {
            walked.sort_unstable_by_key(|e| (e.dev, e.ino));
        }
        let mut runs = Vec::new();
        let mut start = 0;
        for w in walked.chunk_by(|a, b| a.dev == b.dev) {
            runs.push((tree.device(w[0].dev).subvol, start, start + w.len()));
            start += w.len();
        }
        runs.sort_unstable_by_key(|r| r.0);
        Classifier {
            fs_key,
            fs,
            fs_block,
            roots: roots.iter().map(PathBuf::as_path).collect(),
            walked,
            tree,
            store,
            runs,
            hits: Vec::new(),
            outside: Vec::new(),
            deleted: Vec::new(),
            renamed: 0,
            one_sub_blocks: false,
        }
    }

    /// The position in `walked` of the file `(subvol, ino)`.
    fn find(&self, subvol: u64, ino: u64) -> Option<usize> {
        let from = self.runs.partition_point(|r| r.0 < subvol);
        self.runs[from..]
            .iter()
            .take_while(|r| r.0 == subvol)
            .find_map(|&(_, s, e)| {
                let i = self.walked[s..e]
                    .binary_search_by_key(&ino, |w| w.ino)
                    .ok()?;
                Some(s + i)
            })
    }

    /// Takes one catalog record into account (records of other
    /// filesystems are ignored).
    pub fn offer(&mut self, rec: FileRecord) {
        if rec.fs != self.fs_key {
            return;
        }
        match self.find(rec.subvol, rec.ino) {
            Some(at) => self.offer_walked(at, rec),
            None => self.offer_unmet(rec),
        }
    }

    fn offer_walked(&mut self, at: usize, rec: FileRecord) {
        let e = &self.walked[at];
        let same_data = rec.size == e.size && rec.mtime_ns == e.mtime_ns;
        // A rename or a new or removed hard link changes ctime but not the
        // data: trusted when the inode generation proves it is the same file.
        let moved = !self.tree.path_is(e.name, &rec.path);
        let relinked = moved || rec.nlink != u64::from(e.nlink);
        let known = if !same_data {
            false
        } else if rec.ctime_ns == e.ctime_ns {
            true
        } else if relinked {
            generation_of(&self.tree.path(e.name)) == Some(rec.generation)
        } else {
            false
        };
        if !known || !self.current_scheme(&rec) {
            return;
        }
        self.renamed += moved as u64;
        let dirty = relinked || rec.ctime_ns != e.ctime_ns;
        self.hits.push(Hit::new(at, rec, dirty, self.store));
    }

    /// A record the walk did not meet: deleted if under the roots, else a
    /// source while its file still exists unchanged.
    fn offer_unmet(&mut self, rec: FileRecord) {
        if under_roots(&rec.path, &self.roots) || !self.current_scheme(&rec) {
            self.deleted.push((rec.fs, rec.subvol, rec.ino));
            return;
        }
        match std::fs::symlink_metadata(&rec.path) {
            Ok(m)
                if m.is_file()
                    && m.ino() == rec.ino
                    && m.size() == rec.size
                    && m.mtime() * 1_000_000_000 + m.mtime_nsec() == rec.mtime_ns
                    && m.ctime() * 1_000_000_000 + m.ctime_nsec() == rec.ctime_ns =>
            {
                let added = self
                    .tree
                    .add_file(&rec.path, &m, self.fs, rec.subvol, self.fs_block);
                // A name that does not fit the tree: not used as a source.
                if let Ok(entry) = added {
                    let hit = Hit::new(0, rec, false, self.store);
                    self.outside.push(known_file(entry, hit, true));
                }
            }
            _ => self.deleted.push((rec.fs, rec.subvol, rec.ino)),
        }
    }

    /// Whether `rec`'s digests are of the scheme this run computes.
    fn current_scheme(&self, rec: &FileRecord) -> bool {
        match rec.long {
            _ if !self.one_sub_blocks => true,
            // Read as a packed blob, or it is not trusted.
            Some(d) => d.one_sub(),
            None => rec.blocks.iter().all(|&b| sub_of_block(b).is_some()),
        }
    }

    /// Forgets every record offered so far (the catalog turned out
    /// corrupt part way and was rebuilt): every walked file is read.
    pub fn forget(&mut self) {
        self.hits = Vec::new();
        self.outside = Vec::new();
        self.deleted = Vec::new();
        self.renamed = 0;
    }

    /// The decision: known files in walk order, then those outside the
    /// roots; files to read in walk order. The walked list is consumed
    /// from its end and shrinks as it goes: each entry moves (path
    /// included) into the known or to-read list, never copied.
    pub fn finish(self) -> Classified {
        let Classifier {
            mut walked,
            mut hits,
            outside,
            deleted,
            renamed,
            ..
        } = self;
        hits.sort_unstable_by_key(|h| h.at);
        hits.dedup_by_key(|h| h.at);
        let mut known = Vec::with_capacity(hits.len() + outside.len());
        let mut to_read = Vec::with_capacity(walked.len().saturating_sub(hits.len()));
        let mut moved = 0usize;
        while let Some(entry) = walked.pop() {
            let at = walked.len() as u32;
            match hits.last() {
                Some(h) if h.at == at => {
                    let h = hits.pop().expect("just seen");
                    known.push(known_file(entry, h, false));
                }
                _ => to_read.push(entry),
            }
            moved += 1;
            if moved.is_multiple_of(1 << 14) {
                walked.shrink_to_fit();
                hits.shrink_to_fit();
            }
        }
        known.reverse();
        to_read.reverse();
        known.extend(outside);
        Classified {
            known,
            to_read,
            deleted,
            renamed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(fs: &str, e: &FileEntry, path: &std::path::Path) -> FileRecord {
        FileRecord {
            fs: fs.into(),
            subvol: 0,
            ino: e.ino,
            generation: 0,
            path: path.to_path_buf(),
            size: e.size,
            mtime_ns: e.mtime_ns,
            ctime_ns: e.ctime_ns,
            nlink: e.nlink.into(),
            whole: e.ino as u128,
            blocks: vec![e.ino as u128],
            long: None,
            flags: 0,
            settled: true,
            last_seen: 1,
        }
    }

    /// `n` small files in a new directory, walked: (the directory, its
    /// canonical path, the tree, the entries sorted by device and inode).
    fn walked_files(n: u8) -> (tempfile::TempDir, PathBuf, Tree, Vec<FileEntry>) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let mut walked = Vec::new();
        let mut tree = Tree::new();
        for i in 0..n {
            let p = root.join(format!("f{i}"));
            std::fs::write(&p, [i; 10]).unwrap();
            let m = std::fs::metadata(&p).unwrap();
            walked.push(tree.add_file(&p, &m, 1, 0, 4096).unwrap());
        }
        walked.sort_unstable_by_key(|e| (e.dev, e.ino));
        (dir, root, tree, walked)
    }

    /// Records offered in any order are matched to walked files by
    /// identity; known and to-read lists keep the walk's order, records of
    /// other filesystems are ignored, unmet records under the roots are
    /// deleted, and `forget` drops everything offered.
    #[test]
    fn records_matched_in_any_order_and_forgotten() {
        let (_dir, root, mut tree, walked) = walked_files(6);
        let path = |e: &FileEntry| tree.path(e.name);
        let mut recs: Vec<FileRecord> = [4, 1, 3]
            .iter()
            .map(|&i| record("fs-a", &walked[i], &path(&walked[i])))
            .collect();
        recs.push(record("fs-b", &walked[0], &path(&walked[0])));
        let mut gone = record("fs-a", &walked[5], &root.join("gone"));
        gone.ino = u64::MAX;
        recs.push(gone);
        let roots = [root.clone()];
        let mut store = DigestStore::new();
        let c = classify(
            "fs-a",
            (1, 4096),
            recs.clone(),
            walked.clone(),
            (&mut tree, &mut store),
            &roots,
        );
        let inos = |v: &[FileEntry]| v.iter().map(|e| e.ino).collect::<Vec<_>>();
        let known: Vec<u64> = c.known.iter().map(|k| k.entry.ino).collect();
        assert_eq!(known, inos(&[1, 3, 4].map(|i| walked[i].clone())));
        assert!(c
            .known
            .iter()
            .all(|k| k.blocks(&store).get(0) == Some(k.entry.ino as u128)
                && k.settled()
                && !k.dirty()));
        assert_eq!(
            inos(&c.to_read),
            inos(&[0, 2, 5].map(|i| walked[i].clone()))
        );
        assert_eq!(c.deleted, vec![("fs-a".to_string(), 0, u64::MAX)]);

        let mut cl = Classifier::new(
            "fs-a",
            (1, 4096),
            walked.clone(),
            (&mut tree, &mut store),
            &roots,
        );
        for r in recs {
            cl.offer(r);
        }
        cl.forget();
        let c = cl.finish();
        assert!(c.known.is_empty() && c.deleted.is_empty());
        assert_eq!(inos(&c.to_read), inos(&walked));
    }

    /// At a block of one filesystem block, a record whose digests are of
    /// the older scheme (not `block_of_sub` digests) is not trusted: its
    /// file is read again; one of the current scheme is known, its digests
    /// kept as 8-byte sub-digests.
    #[test]
    fn records_of_an_older_digest_scheme_are_read_again() {
        let (_dir, root, mut tree, walked) = walked_files(2);
        let old = record("fs-a", &walked[0], &tree.path(walked[0].name));
        let mut new = record("fs-a", &walked[1], &tree.path(walked[1].name));
        new.blocks = vec![onecopy_digest::block_of_sub(7)];
        let roots = [root.clone()];
        let mut store = DigestStore::new();
        let mut cl = Classifier::new(
            "fs-a",
            (1, 4096),
            walked.clone(),
            (&mut tree, &mut store),
            &roots,
        );
        cl.one_sub_blocks = true;
        cl.offer(old);
        cl.offer(new);
        let c = cl.finish();
        assert_eq!(c.known.len(), 1);
        assert_eq!(c.known[0].entry.ino, walked[1].ino);
        assert!(matches!(
            c.known[0].blocks(&store),
            onecopy_scan::Blocks::OneSub([7])
        ));
        assert_eq!(c.to_read.len(), 1);
        assert_eq!(c.to_read[0].ino, walked[0].ino);
    }
}
