//! The workload generators. Each builds a deterministic plan from the seed
//! first (cheap), then writes it. Large-file workloads are written by one
//! thread, sequentially, so the extent layout is as reproducible as the
//! filesystem allows; small-file workloads are written by a thread pool.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use onecopy_testfs::Prng;
use rayon::prelude::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;
const BUF: usize = 1 << 20;

/// What was generated.
pub struct Summary {
    pub files: u64,
    pub dirs: u64,
    pub bytes: u64,
    /// Bytes that are duplicates of data stored elsewhere in the tree (what
    /// an ideal deduper could share; see `note` for the granularity).
    pub duplicate_bytes: u64,
    pub note: &'static str,
}

/// Stream-id namespaces, so that content, prefixes and plan decisions never
/// draw from the same pseudo-random stream.
mod ns {
    pub const PLAN: u64 = 1 << 62;
    pub const PREFIX: u64 = 1 << 61;
    pub const PIECE: u64 = 1 << 60;
    pub const FILLER: u64 = 1 << 59;
}

/// 32 bytes written over a file's content at an offset.
type Patch = (u64, [u8; 32]);

/// A file's content: concatenated pseudo-random segments (each its own
/// stream, so a segment's bytes do not depend on what precedes it), with
/// byte patches applied at absolute offsets.
struct FileSpec {
    path: PathBuf,
    segments: Vec<(u64, u64)>,
    patches: Vec<Patch>,
}

impl FileSpec {
    fn len(&self) -> u64 {
        self.segments.iter().map(|s| s.1).sum()
    }
}

fn write_spec(seed: u64, spec: &FileSpec, buf: &mut [u8]) -> io::Result<()> {
    let mut f = File::create(&spec.path)?;
    let mut pos = 0u64;
    for &(stream, len) in &spec.segments {
        let mut rng = Prng::derive(seed, stream);
        let mut left = len;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            let b = &mut buf[..n];
            rng.fill(b);
            for (off, bytes) in &spec.patches {
                let (lo, hi) = (*off, off + bytes.len() as u64);
                let (s, e) = (lo.max(pos), hi.min(pos + n as u64));
                if s < e {
                    b[(s - pos) as usize..(e - pos) as usize]
                        .copy_from_slice(&bytes[(s - lo) as usize..(e - lo) as usize]);
                }
            }
            f.write_all(b)?;
            pos += n as u64;
            left -= n as u64;
        }
    }
    Ok(())
}

/// Creates the parent directories and writes all specs, in order, from one
/// thread.
fn write_all_sequential(seed: u64, specs: &[FileSpec]) -> Result<u64> {
    let mut dirs: Vec<&Path> = specs.iter().filter_map(|s| s.path.parent()).collect();
    dirs.sort();
    dirs.dedup();
    for d in &dirs {
        std::fs::create_dir_all(d).with_context(|| format!("mkdir {}", d.display()))?;
    }
    let mut buf = vec![0u8; BUF];
    for s in specs {
        write_spec(seed, s, &mut buf).with_context(|| format!("writing {}", s.path.display()))?;
    }
    Ok(dirs.len() as u64)
}

fn summary(specs: &[FileSpec], dirs: u64, duplicate_bytes: u64, note: &'static str) -> Summary {
    Summary {
        files: specs.len() as u64,
        dirs,
        bytes: specs.iter().map(FileSpec::len).sum(),
        duplicate_bytes,
        note,
    }
}

/// A nix-store-like 32-character hash (base32 alphabet of nix).
fn nix_hash(rng: &mut Prng) -> String {
    const ALPHA: &[u8] = b"0123456789abcdfghijklmnpqrsvwxyz";
    (0..32)
        .map(|_| ALPHA[rng.below(32) as usize] as char)
        .collect()
}

/// `small`: `dd/D/F` holding `printf "%*s" 1024 F`, 1000 files per
/// directory, D from 1, F from 1 to 1000.
pub fn small(dir: &Path, files: u64) -> Result<Summary> {
    let per_dir = 1000u64;
    let ndirs = files.div_ceil(per_dir);
    let root = dir.join("dd");
    (1..=ndirs).into_par_iter().try_for_each(|d| {
        let p = root.join(d.to_string());
        std::fs::create_dir_all(&p).with_context(|| format!("mkdir {}", p.display()))
    })?;
    (0..files).into_par_iter().try_for_each(|i| {
        let (d, f) = (i / per_dir + 1, i % per_dir + 1);
        let p = root.join(d.to_string()).join(f.to_string());
        let content = format!("{f:>1024}");
        std::fs::write(&p, content).with_context(|| format!("writing {}", p.display()))
    })?;
    let distinct = files.min(per_dir);
    Ok(Summary {
        files,
        dirs: ndirs + 1,
        bytes: files * 1024,
        duplicate_bytes: (files - distinct) * 1024,
        note: "logical bytes of files whose content occurs earlier; 1 KiB files are inline \
               extents on btrfs and can not be shared there",
    })
}

/// `dupes`: large random files, each content written 2 or 3 times.
pub fn dupes(dir: &Path, total: u64, seed: u64) -> Result<Summary> {
    let mut rng = Prng::derive(seed, ns::PLAN | 1);
    let max = (total / 8).clamp(64 * KIB, 256 * MIB);
    let min = (8 * MIB).min(max / 2);
    let subdirs = ["a", "b", "c/deep", "d"];
    let mut specs = Vec::new();
    let (mut used, mut dup) = (0u64, 0u64);
    for u in 0u64.. {
        let copies = 2 + rng.below(2);
        let mut sz = rng.range(min, max);
        if rng.chance(0.25) {
            sz = (sz / BLOCK * BLOCK).max(BLOCK);
        }
        let room = (total - used) / copies;
        sz = sz.min(room);
        if sz < BLOCK || (u > 0 && sz < min / 4) {
            break;
        }
        for j in 0..copies {
            let sub = subdirs[((u + j) % subdirs.len() as u64) as usize];
            specs.push(FileSpec {
                path: dir.join(sub).join(format!("file{u:04}-copy{j}.bin")),
                segments: vec![(u, sz)],
                patches: vec![],
            });
        }
        used += sz * copies;
        dup += sz * (copies - 1);
    }
    let dirs = write_all_sequential(seed, &specs)?;
    Ok(summary(
        &specs,
        dirs,
        dup,
        "bytes of every copy beyond the first",
    ))
}

/// `near`: base files plus 1-3 variants each with a 32-byte change.
pub fn near(dir: &Path, total: u64, seed: u64) -> Result<Summary> {
    let mut rng = Prng::derive(seed, ns::PLAN | 2);
    let max = (total / 16).clamp(64 * KIB, 64 * MIB);
    let min = MIB.min(max / 2);
    let mut specs = Vec::new();
    let (mut used, mut dup) = (0u64, 0u64);
    for b in 0u64.. {
        let variants = 1 + rng.below(3);
        let mut sz = rng.range(min, max);
        let room = (total - used) / (variants + 1);
        sz = sz.min(room);
        if sz < 2 * BLOCK || (b > 0 && sz < min / 4) {
            break;
        }
        for v in 0..=variants {
            let mut patches = vec![];
            if v > 0 {
                let off = rng.below(sz - 32 + 1);
                let mut bytes = [0u8; 32];
                rng.fill(&mut bytes);
                patches.push((off, bytes));
                let first = off / BLOCK * BLOCK;
                let last = ((off + 32).div_ceil(BLOCK) * BLOCK).min(sz);
                dup += sz - (last - first);
            }
            let store = format!("{}-pkg{b:03}-1.0", nix_hash(&mut rng));
            specs.push(FileSpec {
                path: dir.join(store).join("lib").join(format!("libpkg{b:03}.so")),
                segments: vec![(b, sz)],
                patches,
            });
        }
        used += sz * (variants + 1);
    }
    let dirs = write_all_sequential(seed, &specs)?;
    Ok(summary(
        &specs,
        dirs,
        dup,
        "bytes of variants in 4 KiB blocks identical to the base at the same offset",
    ))
}

/// `shifted`: one content behind prefixes of different lengths.
pub fn shifted(dir: &Path, total: u64, seed: u64, align: u64) -> Result<Summary> {
    let mut rng = Prng::derive(seed, ns::PLAN | 3);
    let max = (total / 16).clamp(64 * KIB, 64 * MIB);
    let min = (4 * MIB).min(max / 2);
    let mut specs = Vec::new();
    let (mut used, mut dup) = (0u64, 0u64);
    let mut prefix_id = 0u64;
    for g in 0u64.. {
        let n = 3 + rng.below(3);
        let c = rng.range(min, max);
        let prefixes: Vec<u64> = (0..n)
            .map(|j| if j == 0 { 0 } else { rng.range(1, 64) * align })
            .collect();
        let need = c * n + prefixes.iter().sum::<u64>();
        if used + need > total {
            break;
        }
        for (j, &p) in prefixes.iter().enumerate() {
            let mut segments = vec![];
            if p > 0 {
                segments.push((ns::PREFIX | prefix_id, p));
                prefix_id += 1;
            }
            segments.push((g, c));
            specs.push(FileSpec {
                path: dir.join(format!("g{g:03}")).join(format!("shift{j}.bin")),
                segments,
                patches: vec![],
            });
        }
        used += need;
        dup += c * (n - 1);
    }
    let dirs = write_all_sequential(seed, &specs)?;
    Ok(summary(
        &specs,
        dirs,
        dup,
        "bytes of shared content beyond its first occurrence (block-aligned when --align \
         is a multiple of 4096)",
    ))
}

/// `many`: a large deep tree of small and medium files, ~30% copies.
pub fn many(dir: &Path, files: u64, seed: u64) -> Result<Summary> {
    const WORDS: [&str; 12] = [
        "lib", "share", "src", "include", "doc", "bin", "etc", "data", "locale", "python3", "site",
        "pkg",
    ];
    let mut rng = Prng::derive(seed, ns::PLAN | 4);
    // A 10-ary heap of directories, each named by 1-2 path components, so
    // the depth grows like 1.5 * log10(files / 10) plus the root.
    let ndirs = (files / 10).max(1) as usize;
    let mut dirs: Vec<PathBuf> = Vec::with_capacity(ndirs);
    dirs.push(dir.join("tree"));
    let mut intermediate = 0u64;
    for k in 1..ndirs {
        let parent = &dirs[(k - 1) / 10];
        let w = WORDS[rng.below(WORDS.len() as u64) as usize];
        let mut p = parent.join(format!("{w}{k}"));
        if rng.chance(0.5) {
            p.push(WORDS[rng.below(WORDS.len() as u64) as usize]);
            intermediate += 1;
        }
        dirs.push(p);
    }
    // (content stream, size) per file; copies reuse an earlier entry.
    let mut plan: Vec<(u64, u32)> = Vec::with_capacity(files as usize);
    let (mut bytes, mut dup) = (0u64, 0u64);
    for i in 0..files {
        if i > 0 && rng.chance(0.3) {
            let j = rng.below(i) as usize;
            let e = plan[j];
            plan.push(e);
            dup += e.1 as u64;
            bytes += e.1 as u64;
            continue;
        }
        let r = rng.below(1000);
        let size = if r < 20 {
            0
        } else if r < 970 {
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            (16.0 * KIB as f64 * u * u) as u64 + 1
        } else if r < 997 {
            rng.range(16 * KIB, 64 * KIB)
        } else {
            rng.range(64 * KIB, MIB)
        };
        plan.push((i, size as u32));
        bytes += size;
    }
    dirs.par_iter().try_for_each(|d| {
        std::fs::create_dir_all(d).with_context(|| format!("mkdir {}", d.display()))
    })?;
    let nd = dirs.len() as u128;
    let path_of =
        |i: u64| dirs[(i as u128 * nd / files as u128) as usize].join(format!("f{i}.dat"));
    (0..files).into_par_iter().try_for_each_init(
        || vec![0u8; MIB as usize],
        |buf, i| {
            let (stream, size) = plan[i as usize];
            let b = &mut buf[..size as usize];
            Prng::derive(seed, stream).fill(b);
            let p = path_of(i);
            std::fs::write(&p, &*b).with_context(|| format!("writing {}", p.display()))
        },
    )?;
    Ok(Summary {
        files,
        dirs: dirs.len() as u64 + intermediate,
        bytes,
        duplicate_bytes: dup,
        note: "bytes of files that are byte copies of earlier files",
    })
}

/// `chains`: version chains of near-copies. Each group is an original and
/// its descendants: every version has `fanout` successors, down to depth
/// `length`, and each successor is its predecessor plus one more 32-byte
/// change (successive builds, VM images patched over time). Files of
/// 24 MiB (less if `total` is small), written with ordinary writes.
pub fn chains(dir: &Path, total: u64, seed: u64, length: u32, fanout: u32) -> Result<Summary> {
    let mut rng = Prng::derive(seed, ns::PLAN | 5);
    let fanout = u64::from(fanout.max(1));
    let per_group: u64 = (0..=length).map(|d| fanout.pow(d)).sum();
    let sz = (24 * MIB)
        .min(total / per_group / BLOCK * BLOCK)
        .max(16 * BLOCK);
    let groups = (total / (per_group * sz)).max(1);
    let mut specs = Vec::new();
    let mut unique_blocks = 0u64;
    for g in 0..groups {
        let gdir = dir.join(format!("c{g:02}"));
        // (name, patches) of the versions at the current depth.
        let mut level: Vec<(String, Vec<Patch>)> = vec![("v".into(), vec![])];
        unique_blocks += sz / BLOCK;
        for _ in 0..=length {
            let mut next = Vec::new();
            for (name, patches) in &level {
                specs.push(FileSpec {
                    path: gdir.join(name),
                    segments: vec![(g, sz)],
                    patches: patches.clone(),
                });
                for k in 0..fanout {
                    let off = rng.below(sz - 32 + 1);
                    let mut bytes = [0u8; 32];
                    rng.fill(&mut bytes);
                    let mut p = patches.clone();
                    p.push((off, bytes));
                    next.push((format!("{name}.{k}"), p));
                }
            }
            level = next;
        }
    }
    // Each change makes the blocks it touches new content, which its
    // descendants share unless they change them again.
    for s in &specs {
        if let Some((off, _)) = s.patches.last() {
            unique_blocks += (off + 32).div_ceil(BLOCK) - off / BLOCK;
        }
    }
    let dirs = write_all_sequential(seed, &specs)?;
    let bytes: u64 = specs.iter().map(FileSpec::len).sum();
    Ok(summary(
        &specs,
        dirs,
        bytes - unique_blocks * BLOCK,
        "bytes beyond the distinct 4 KiB blocks of each chain",
    ))
}

/// `pieces`: `files` files of 1 MiB assembled from a shared pool of 8 KiB
/// random pieces placed at 4 KiB-aligned offsets (one unique 4 KiB filler
/// block between pieces now and then shifts them off 8 KiB alignment).
/// About 70% of the bytes are duplicates at 4 KiB.
pub fn pieces(dir: &Path, files: u64, seed: u64) -> Result<Summary> {
    const PIECE: u64 = 8 * KIB;
    const FILE: u64 = MIB;
    let mut rng = Prng::derive(seed, ns::PLAN | 6);
    let pool = (files * 16).max(1);
    let mut seen = std::collections::HashSet::new();
    let mut fillers = 0u64;
    let mut specs = Vec::new();
    for i in 0..files {
        let mut segments = Vec::new();
        let mut pos = 0u64;
        while pos < FILE {
            if rng.chance(0.1) {
                segments.push((ns::FILLER | fillers, BLOCK));
                fillers += 1;
                pos += BLOCK;
                continue;
            }
            let id = rng.below(pool);
            let len = PIECE.min(FILE - pos);
            segments.push((ns::PIECE | id, len));
            seen.insert((id, 0));
            if len > BLOCK {
                seen.insert((id, 1));
            }
            pos += len;
        }
        specs.push(FileSpec {
            path: dir
                .join(format!("p{:02}", i / 100))
                .join(format!("f{i:04}.bin")),
            segments,
            patches: vec![],
        });
    }
    let dirs = write_all_sequential(seed, &specs)?;
    let unique = (seen.len() as u64 + fillers) * BLOCK;
    Ok(summary(
        &specs,
        dirs,
        files * FILE - unique,
        "bytes beyond the distinct 4 KiB blocks (8 KiB pieces at 4 KiB-aligned offsets)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn read_tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
        let mut out = BTreeMap::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    out.insert(
                        p.strip_prefix(root).unwrap().to_path_buf(),
                        std::fs::read(&p).unwrap(),
                    );
                }
            }
        }
        out
    }

    #[test]
    fn small_matches_printf() {
        let t = tempfile::tempdir().unwrap();
        let s = small(t.path(), 2500).unwrap();
        assert_eq!(
            (s.files, s.bytes, s.duplicate_bytes),
            (2500, 2_560_000, 1_536_000)
        );
        let f = std::fs::read(t.path().join("dd/3/7")).unwrap();
        assert_eq!(f.len(), 1024);
        assert!(f[..1023].iter().all(|&b| b == b' ') && f[1023] == b'7');
        assert!(t.path().join("dd/3/500").exists() && !t.path().join("dd/3/501").exists());
    }

    #[test]
    fn dupes_are_copies_and_deterministic() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let s = dupes(a.path(), 8 << 20, 5).unwrap();
        dupes(b.path(), 8 << 20, 5).unwrap();
        let (ta, tb) = (read_tree(a.path()), read_tree(b.path()));
        assert_eq!(ta, tb);
        assert_eq!(ta.values().map(|v| v.len() as u64).sum::<u64>(), s.bytes);
        let mut by_content: BTreeMap<&[u8], u64> = BTreeMap::new();
        for v in ta.values() {
            *by_content.entry(v).or_default() += 1;
        }
        assert!(by_content.values().all(|&n| n == 2 || n == 3));
        let unique: u64 = by_content.keys().map(|k| k.len() as u64).sum();
        assert_eq!(s.bytes - unique, s.duplicate_bytes);
    }

    #[test]
    fn near_variants_differ_by_32_bytes() {
        let t = tempfile::tempdir().unwrap();
        near(t.path(), 16 << 20, 3).unwrap();
        let tree = read_tree(t.path());
        let mut groups: BTreeMap<String, Vec<&Vec<u8>>> = BTreeMap::new();
        for (p, v) in &tree {
            groups
                .entry(p.file_name().unwrap().to_string_lossy().into())
                .or_default()
                .push(v);
        }
        assert!(groups.len() >= 2);
        for files in groups.values() {
            assert!((2..=4).contains(&files.len()));
            for x in &files[1..] {
                let diff = x
                    .iter()
                    .zip(files[0].iter())
                    .filter(|(a, b)| a != b)
                    .count();
                assert!(diff <= 64, "{diff} bytes differ");
            }
        }
    }

    #[test]
    fn shifted_shares_suffix() {
        let t = tempfile::tempdir().unwrap();
        let s = shifted(t.path(), 32 << 20, 4, 4096).unwrap();
        assert!(s.files >= 3);
        let tree = read_tree(t.path());
        let g0: Vec<&Vec<u8>> = tree
            .iter()
            .filter(|(p, _)| p.starts_with("g000"))
            .map(|(_, v)| v)
            .collect();
        let base = g0.iter().map(|v| v.len()).min().unwrap();
        for v in &g0 {
            assert_eq!((v.len() - base) % 4096, 0);
            assert_eq!(&v[v.len() - base..], &g0[0][g0[0].len() - base..]);
        }
    }

    /// Distinct 4 KiB blocks of a tree.
    fn distinct_blocks(tree: &BTreeMap<PathBuf, Vec<u8>>) -> u64 {
        let mut set = std::collections::HashSet::new();
        for v in tree.values() {
            for b in v.chunks(BLOCK as usize) {
                set.insert(b.to_vec());
            }
        }
        set.len() as u64
    }

    #[test]
    fn chains_change_one_more_block_per_version() {
        let t = tempfile::tempdir().unwrap();
        let s = chains(t.path(), 7 * MIB, 2, 2, 1).unwrap();
        let tree = read_tree(t.path());
        assert_eq!(
            s.files,
            3 * tree.keys().filter(|p| p.ends_with("v")).count() as u64
        );
        let v = &tree[Path::new("c00/v")];
        let v0 = &tree[Path::new("c00/v.0")];
        let v1 = &tree[Path::new("c00/v.0.0")];
        let diff = |a: &[u8], b: &[u8]| a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert!((1..=32).contains(&diff(v, v0)) && (1..=32).contains(&diff(v0, v1)));
        assert!(diff(v, v1) > diff(v, v0) || diff(v, v1) >= 1);
        assert_eq!(s.bytes - distinct_blocks(&tree) * BLOCK, s.duplicate_bytes);
        // Fan-out: every version has two successors.
        let t2 = tempfile::tempdir().unwrap();
        let s2 = chains(t2.path(), 8 * MIB, 3, 2, 2).unwrap();
        assert_eq!(s2.files % 7, 0);
    }

    #[test]
    fn pieces_share_blocks_at_4k() {
        let t = tempfile::tempdir().unwrap();
        let s = pieces(t.path(), 20, 4).unwrap();
        let tree = read_tree(t.path());
        assert_eq!(tree.len(), 20);
        assert!(tree.values().all(|v| v.len() as u64 == MIB));
        assert_eq!(s.bytes - distinct_blocks(&tree) * BLOCK, s.duplicate_bytes);
        assert!(s.duplicate_bytes > 0);
    }

    #[test]
    fn many_has_copies() {
        let t = tempfile::tempdir().unwrap();
        let s = many(t.path(), 3000, 9).unwrap();
        let tree = read_tree(t.path());
        assert_eq!(tree.len(), 3000);
        assert_eq!(tree.values().map(|v| v.len() as u64).sum::<u64>(), s.bytes);
        assert!(s.duplicate_bytes > 0 && s.duplicate_bytes < s.bytes);
    }
}
