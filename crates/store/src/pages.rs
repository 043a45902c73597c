//! Page deltas of a database image: how the metadata reaches a bucket.
//!
//! An image is a SQLite database file copied page for page (the backup
//! API keeps each page where it is, so a change to a few rows changes a
//! few pages). A *segment* holds the pages of an image that differ from
//! the previous image, and the image's length; the first segment of a
//! chain (the *base*) holds every page. Applying a chain's segments in
//! order to an empty file gives the last image exactly.
//!
//! Segment format 1 (zstd-compressed as a whole):
//! `b"OCPG"`, u32 format, u32 page size, u64 pages in the image, then
//! entries of u32 page number and the page, ended by page number
//! `u32::MAX`, then the BLAKE3 of the whole image (32 bytes). All
//! integers little-endian.
//!
//! Page 0 is carried with its commit counters zeroed ([`normalize`]).
//!
//! Invariants: a segment is applied only to the image it was made
//! against (the manifest orders them); the image hash at its end is
//! checked after the last segment is applied, so a chain with a missing
//! or foreign segment is refused, never used.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{Result, StoreError};

const MAGIC: &[u8; 4] = b"OCPG";
const FORMAT: u32 = 1;
const END: u32 = u32::MAX;
/// zstd level of segments: metadata pages shrink well at a low level.
const LEVEL: i32 = 3;

/// A page's fingerprint: the first 16 bytes of its BLAKE3.
pub type PageHash = [u8; 16];

/// A segment made by [`diff`].
pub struct Segment {
    /// The compressed segment.
    pub bytes: Vec<u8>,
    /// Fingerprints of the new image's pages.
    pub hashes: Vec<PageHash>,
    /// BLAKE3 of the new image, hex.
    pub image: String,
    /// Pages the segment carries.
    pub changed: u64,
}

/// Zeroes what SQLite changes in the header (page 0) at every commit,
/// even one that changed no row: the file change counter (bytes 24-27)
/// and the version-valid-for number (92-95). Both zero still agree, so
/// the header's page count stays trusted. Images are compared, hashed and
/// carried this way: an idle mount's commits make no delta.
fn normalize(no: u64, page: &mut [u8]) {
    if no == 0 && page.len() >= 100 {
        page[24..28].fill(0);
        page[92..96].fill(0);
    }
}

fn page_hash(page: &[u8]) -> PageHash {
    blake3::hash(page).as_bytes()[..16].try_into().unwrap()
}

fn bad(path: &Path, why: impl Into<String>) -> StoreError {
    StoreError::NotAStore {
        path: path.into(),
        why: why.into(),
    }
}

/// The segment taking an image whose pages had fingerprints `old` to the
/// image in `path` (every page when `old` is empty: a base).
pub fn diff(path: &Path, page_size: u32, old: &[PageHash]) -> Result<Segment> {
    let io = StoreError::io(path);
    let mut f = File::open(path).map_err(io)?;
    let len = f.metadata().map_err(StoreError::io(path))?.len();
    if len % page_size as u64 != 0 {
        return Err(bad(path, "an image that is not a whole number of pages"));
    }
    let pages = len / page_size as u64;
    let mut z = zstd::Encoder::new(Vec::new(), LEVEL).map_err(StoreError::io(path))?;
    let mut head = Vec::with_capacity(20);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&FORMAT.to_le_bytes());
    head.extend_from_slice(&page_size.to_le_bytes());
    head.extend_from_slice(&pages.to_le_bytes());
    z.write_all(&head).map_err(StoreError::io(path))?;
    let mut whole = blake3::Hasher::new();
    let mut page = vec![0u8; page_size as usize];
    let mut hashes = Vec::with_capacity(pages as usize);
    let mut changed = 0;
    for no in 0..pages {
        f.read_exact(&mut page).map_err(StoreError::io(path))?;
        normalize(no, &mut page);
        whole.update(&page);
        let h = page_hash(&page);
        if old.get(no as usize) != Some(&h) {
            z.write_all(&(no as u32).to_le_bytes())
                .and_then(|()| z.write_all(&page))
                .map_err(StoreError::io(path))?;
            changed += 1;
        }
        hashes.push(h);
    }
    let image = whole.finalize();
    z.write_all(&END.to_le_bytes())
        .and_then(|()| z.write_all(image.as_bytes()))
        .map_err(StoreError::io(path))?;
    Ok(Segment {
        bytes: z.finish().map_err(StoreError::io(path))?,
        hashes,
        image: image.to_hex().to_string(),
        changed,
    })
}

/// Fingerprints of the pages of the image in `path`, and its BLAKE3 (hex).
pub fn hashes(path: &Path, page_size: u32) -> Result<(Vec<PageHash>, String)> {
    let mut f = File::open(path).map_err(StoreError::io(path))?;
    let mut whole = blake3::Hasher::new();
    let mut page = vec![0u8; page_size as usize];
    let mut out = Vec::new();
    loop {
        match f.read_exact(&mut page) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(StoreError::io(path)(e)),
        }
        normalize(out.len() as u64, &mut page);
        whole.update(&page);
        out.push(page_hash(&page));
    }
    Ok((out, whole.finalize().to_hex().to_string()))
}

/// Applies segment `seg` to the image in `file` (at `path`, for errors);
/// returns the image hash the segment says the result has.
pub fn apply(file: &File, path: &Path, seg: &[u8]) -> Result<String> {
    let mut z = zstd::Decoder::new(seg).map_err(|e| bad(path, format!("segment: {e}")))?;
    let mut head = [0u8; 20];
    read(&mut z, &mut head, path)?;
    if &head[..4] != MAGIC || u32::from_le_bytes(head[4..8].try_into().unwrap()) != FORMAT {
        return Err(bad(path, "not a metadata segment of format 1"));
    }
    let page_size = u32::from_le_bytes(head[8..12].try_into().unwrap()) as u64;
    let pages = u64::from_le_bytes(head[12..20].try_into().unwrap());
    if !(512..=65536).contains(&page_size) {
        return Err(bad(path, format!("segment page size {page_size}")));
    }
    file.set_len(pages * page_size)
        .map_err(StoreError::io(path))?;
    let mut page = vec![0u8; page_size as usize];
    loop {
        let mut no = [0u8; 4];
        read(&mut z, &mut no, path)?;
        let no = u32::from_le_bytes(no);
        if no == END {
            break;
        }
        if no as u64 >= pages {
            return Err(bad(path, format!("segment page {no} past its image")));
        }
        read(&mut z, &mut page, path)?;
        file.write_all_at(&page, no as u64 * page_size)
            .map_err(StoreError::io(path))?;
    }
    let mut image = [0u8; 32];
    read(&mut z, &mut image, path)?;
    Ok(blake3::Hash::from(image).to_hex().to_string())
}

fn read(z: &mut impl Read, buf: &mut [u8], path: &Path) -> Result<()> {
    z.read_exact(buf)
        .map_err(|e| bad(path, format!("a segment cut short: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(path: &Path, pages: &[u8]) {
        let bytes: Vec<u8> = pages.iter().flat_map(|&b| vec![b; 512]).collect();
        std::fs::write(path, bytes).unwrap();
    }

    /// A chain of a base and deltas (growing, changing, shrinking)
    /// rebuilds the last image exactly, and carries only changed pages.
    #[test]
    fn a_chain_rebuilds_the_last_image() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        let out = File::options()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&dst)
            .unwrap();
        let mut old = Vec::new();
        for (pages, want_changed) in [
            (&[1u8, 2, 3][..], 3),
            (&[1, 2, 3, 4, 5][..], 2),
            (&[1, 9, 3, 4, 5][..], 1),
            (&[1, 9][..], 0),
        ] {
            image(&src, pages);
            let seg = diff(&src, 512, &old).unwrap();
            assert_eq!(seg.changed, want_changed, "{pages:?}");
            let said = apply(&out, &dst, &seg.bytes).unwrap();
            assert_eq!(said, seg.image);
            let mut want = std::fs::read(&src).unwrap();
            normalize(0, &mut want[..512]);
            assert_eq!(std::fs::read(&dst).unwrap(), want);
            assert_eq!(hashes(&dst, 512).unwrap(), (seg.hashes.clone(), seg.image));
            old = seg.hashes;
        }
    }

    /// A segment cut short or of another kind is refused.
    #[test]
    fn a_damaged_segment_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        image(&src, &[1, 2, 3]);
        let seg = diff(&src, 512, &[]).unwrap();
        let out = File::create(dir.path().join("dst")).unwrap();
        let cut = &seg.bytes[..seg.bytes.len() / 2];
        assert!(apply(&out, &src, cut).is_err());
        assert!(apply(&out, &src, b"not zstd at all").is_err());
        let other = zstd::encode_all(&b"OCPX\x01\0\0\0"[..], 1).unwrap();
        assert!(apply(&out, &src, &other).is_err());
    }
}
