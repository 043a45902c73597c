//! A hostile concurrent writer: modifies, appends to, truncates, deletes,
//! renames, replaces and creates files under its own directory, keeping its
//! own record of what every file must contain. Used while onecopy scans and
//! dedupes the same tree.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use onecopy_testfs::Prng;

use crate::support::{KIB, MIB};

/// Most bytes the writer keeps (its files stay "a few MiB" each).
const MAX_TOTAL: usize = 96 << 20;
const MAX_FILE: usize = 6 << 20;

pub struct Writer {
    dirs: Vec<PathBuf>,
    /// What every file the writer owns must contain (absolute paths).
    pub files: BTreeMap<PathBuf, Vec<u8>>,
    rng: Prng,
    next: u64,
    /// How many times each operation was done.
    pub ops: BTreeMap<&'static str, u64>,
}

impl Writer {
    /// Creates `groups` groups of 3 identical files (1–3 MiB, sizes not
    /// block multiples) spread over four directories under `base`.
    pub fn new(base: &Path, groups: usize, seed: u64) -> Writer {
        let dirs: Vec<PathBuf> = (0..4).map(|i| base.join(format!("d{i}"))).collect();
        for d in &dirs {
            std::fs::create_dir_all(d).unwrap();
        }
        let mut w = Writer {
            dirs,
            files: BTreeMap::new(),
            rng: Prng::new(seed),
            next: 0,
            ops: BTreeMap::new(),
        };
        for g in 0..groups {
            let len = w.rng.range(MIB, 3 * MIB) as usize + g;
            let data = w.random(len);
            for c in 0..3 {
                let p = w.dirs[(g + c) % 4].join(format!("f{g}-{c}.bin"));
                std::fs::write(&p, &data).unwrap();
                w.files.insert(p, data.clone());
            }
        }
        w
    }

    fn random(&mut self, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.rng.fill(&mut v);
        v
    }

    fn pick(&mut self) -> Option<PathBuf> {
        if self.files.is_empty() {
            return None;
        }
        let i = self.rng.below(self.files.len() as u64) as usize;
        self.files.keys().nth(i).cloned()
    }

    fn fresh(&mut self, ext: &str) -> PathBuf {
        self.next += 1;
        let d = self.rng.below(self.dirs.len() as u64) as usize;
        self.dirs[d].join(format!("w{}.{ext}", self.next))
    }

    fn total(&self) -> usize {
        self.files.values().map(Vec::len).sum()
    }

    /// Content for a new or replaced file: half the time a copy of another
    /// file (a new duplicate for onecopy to find), else random.
    fn new_content(&mut self) -> Vec<u8> {
        if self.rng.chance(0.5) {
            if let Some(p) = self.pick() {
                return self.files[&p].clone();
            }
        }
        let len = self.rng.range(64 * KIB, 3 * MIB) as usize;
        self.random(len)
    }

    /// One random mutation. Returns its name.
    pub fn step(&mut self) -> &'static str {
        let n = self.files.len();
        let op = if n < 12 {
            "create"
        } else if n > 60 || self.total() > MAX_TOTAL {
            "delete"
        } else {
            match self.rng.below(100) {
                0..=24 => "modify",
                25..=37 => "append",
                38..=47 => "truncate",
                48..=56 => "delete",
                57..=71 => "rename",
                72..=86 => "replace",
                _ => "create",
            }
        };
        let op = self.apply(op);
        *self.ops.entry(op).or_default() += 1;
        op
    }

    fn apply(&mut self, op: &'static str) -> &'static str {
        let Some(p) = self.pick() else {
            return self.apply_create();
        };
        match op {
            "modify" => {
                let len = self.files[&p].len();
                if len == 0 {
                    return self.apply("append");
                }
                let off = self.rng.below(len as u64) as usize;
                let n = (self.rng.range(1, 64 * KIB) as usize).min(len - off);
                let bytes = self.random(n);
                let f = OpenOptions::new().write(true).open(&p).unwrap();
                f.write_all_at(&bytes, off as u64).unwrap();
                self.files.get_mut(&p).unwrap()[off..off + n].copy_from_slice(&bytes);
                op
            }
            "append" => {
                if self.files[&p].len() > MAX_FILE {
                    return self.apply("truncate");
                }
                let n = self.rng.range(1, 256 * KIB) as usize;
                let bytes = self.random(n);
                let mut f = OpenOptions::new().append(true).open(&p).unwrap();
                f.write_all(&bytes).unwrap();
                self.files.get_mut(&p).unwrap().extend_from_slice(&bytes);
                op
            }
            "truncate" => {
                let len = self.files[&p].len() as u64;
                // Sometimes to a block boundary, sometimes anywhere.
                let mut to = self.rng.below(len + 1);
                if self.rng.chance(0.5) {
                    to -= to % 4096;
                }
                let f = OpenOptions::new().write(true).open(&p).unwrap();
                f.set_len(to).unwrap();
                self.files.get_mut(&p).unwrap().truncate(to as usize);
                op
            }
            "delete" => {
                std::fs::remove_file(&p).unwrap();
                self.files.remove(&p);
                op
            }
            "rename" => {
                let to = self.fresh("bin");
                std::fs::rename(&p, &to).unwrap();
                let data = self.files.remove(&p).unwrap();
                self.files.insert(to, data);
                op
            }
            "replace" => {
                let data = self.new_content();
                let tmp = self.fresh("part");
                std::fs::write(&tmp, &data).unwrap();
                std::fs::rename(&tmp, &p).unwrap();
                self.files.insert(p, data);
                op
            }
            _ => self.apply_create(),
        }
    }

    fn apply_create(&mut self) -> &'static str {
        let data = self.new_content();
        let p = self.fresh("bin");
        std::fs::write(&p, &data).unwrap();
        self.files.insert(p, data);
        "create"
    }
}
