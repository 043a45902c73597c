//! Byte formats: entries, sorted pages, segment pages, log records, the
//! manifest and the run trailer. Every decoder is total: bad bytes give
//! `None`, never a panic (property-tested).

/// Size of every page of a run or segment file.
pub const PAGE: usize = 4096;
/// Bytes of one encoded [`Entry`].
pub const ENTRY: usize = 40;
const PAGE_HEAD: usize = 8;
/// Entries per sorted page.
pub const PER_PAGE: usize = (PAGE - PAGE_HEAD) / ENTRY;
/// Bytes of one segment slot (key, location).
const SLOT: usize = 24;
/// Slots per segment page: the locality group loaded into the cache on a hit.
pub const PER_SEGMENT: usize = (PAGE - PAGE_HEAD) / SLOT;
/// Bytes of one log record.
pub const RECORD: usize = 8 + ENTRY;

const SORTED_MAGIC: u16 = 0x5053; // "SP"
const SEGMENT_MAGIC: u16 = 0x4753; // "SG"

/// One fingerprint's entry. `refs == 0` marks a tombstone (a delete that
/// shadows older runs until a merge reaches the oldest run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub key: u128,
    pub loc: u64,
    pub refs: u32,
    /// Insertion time (caller's clock, e.g. seconds), for prune by age.
    pub born: u32,
    /// Insertion sequence number: its slot in the segment file.
    pub seq: u64,
}

impl Entry {
    pub fn is_tombstone(&self) -> bool {
        self.refs == 0
    }

    pub fn encode(&self, out: &mut [u8]) {
        out[0..16].copy_from_slice(&self.key.to_le_bytes());
        out[16..24].copy_from_slice(&self.loc.to_le_bytes());
        out[24..28].copy_from_slice(&self.refs.to_le_bytes());
        out[28..32].copy_from_slice(&self.born.to_le_bytes());
        out[32..40].copy_from_slice(&self.seq.to_le_bytes());
    }

    pub fn decode(b: &[u8]) -> Option<Entry> {
        let b: &[u8; ENTRY] = b.get(..ENTRY)?.try_into().ok()?;
        Some(Entry {
            key: u128::from_le_bytes(b[0..16].try_into().ok()?),
            loc: u64::from_le_bytes(b[16..24].try_into().ok()?),
            refs: u32::from_le_bytes(b[24..28].try_into().ok()?),
            born: u32::from_le_bytes(b[28..32].try_into().ok()?),
            seq: u64::from_le_bytes(b[32..40].try_into().ok()?),
        })
    }
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn seal_page(page: &mut [u8; PAGE], count: usize, magic: u16) {
    page[4..6].copy_from_slice(&(count as u16).to_le_bytes());
    page[6..8].copy_from_slice(&magic.to_le_bytes());
    let crc = crc32fast::hash(&page[4..]);
    page[0..4].copy_from_slice(&crc.to_le_bytes());
}

/// Checks a page's checksum and magic; returns its entry count.
fn open_page(page: &[u8], magic: u16, max: usize) -> Option<usize> {
    if page.len() != PAGE || u32_at(page, 0)? != crc32fast::hash(&page[4..]) {
        return None;
    }
    let count = u16::from_le_bytes(page[4..6].try_into().ok()?) as usize;
    let m = u16::from_le_bytes(page[6..8].try_into().ok()?);
    (m == magic && count <= max).then_some(count)
}

/// Encodes up to [`PER_PAGE`] sorted entries into one page.
pub fn encode_sorted_page(entries: &[Entry]) -> [u8; PAGE] {
    let mut page = [0u8; PAGE];
    for (i, e) in entries.iter().take(PER_PAGE).enumerate() {
        e.encode(&mut page[PAGE_HEAD + i * ENTRY..]);
    }
    seal_page(&mut page, entries.len().min(PER_PAGE), SORTED_MAGIC);
    page
}

/// Decodes a sorted page, `None` if damaged.
pub fn decode_sorted_page(page: &[u8]) -> Option<Vec<Entry>> {
    let n = open_page(page, SORTED_MAGIC, PER_PAGE)?;
    (0..n)
        .map(|i| Entry::decode(&page[PAGE_HEAD + i * ENTRY..]))
        .collect()
}

/// Encodes a segment page: slot `i` holds `(key, loc)` or nothing (a seq
/// number whose insert was deleted before the flush, or padding).
pub fn encode_segment_page(slots: &[Option<(u128, u64)>]) -> [u8; PAGE] {
    let mut page = [0u8; PAGE];
    for (i, s) in slots.iter().take(PER_SEGMENT).enumerate() {
        if let Some((k, l)) = s {
            let at = PAGE_HEAD + i * SLOT;
            page[at..at + 16].copy_from_slice(&k.to_le_bytes());
            page[at + 16..at + 24].copy_from_slice(&l.to_le_bytes());
        }
    }
    seal_page(&mut page, slots.len().min(PER_SEGMENT), SEGMENT_MAGIC);
    page
}

/// Decodes a segment page into its slots (`(key, loc)` per slot).
pub fn decode_segment_page(page: &[u8]) -> Option<Vec<(u128, u64)>> {
    let n = open_page(page, SEGMENT_MAGIC, PER_SEGMENT)?;
    (0..n)
        .map(|i| {
            let at = PAGE_HEAD + i * SLOT;
            Some((
                u128::from_le_bytes(page.get(at..at + 16)?.try_into().ok()?),
                u64_at(page, at + 16)?,
            ))
        })
        .collect()
}

/// A log record: the new state of one entry (a tombstone for a delete).
pub fn encode_record(e: &Entry) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    r[4] = 1; // record format version
    e.encode(&mut r[8..]);
    let crc = crc32fast::hash(&r[4..]);
    r[0..4].copy_from_slice(&crc.to_le_bytes());
    r
}

/// Decodes one log record; `None` ends the replay (torn or damaged tail).
pub fn decode_record(b: &[u8]) -> Option<Entry> {
    let r = b.get(..RECORD)?;
    if u32_at(r, 0)? != crc32fast::hash(&r[4..]) || r[4] != 1 {
        return None;
    }
    Entry::decode(&r[8..])
}

/// Length-prefixed, checksummed blob with a magic and version: the
/// manifest, the run trailer, the liveness bitmap.
pub fn seal_blob(magic: &[u8; 8], version: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 24);
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// Opens a blob made by [`seal_blob`]: its version and body.
pub fn open_blob<'a>(magic: &[u8; 8], b: &'a [u8]) -> Option<(u32, &'a [u8])> {
    if b.get(..8)? != magic {
        return None;
    }
    let version = u32_at(b, 8)?;
    let len = usize::try_from(u64_at(b, 12)?).ok()?;
    let crc = u32_at(b, 20)?;
    let body = b.get(24..24usize.checked_add(len)?)?;
    (crc32fast::hash(body) == crc).then_some((version, body))
}

/// The manifest: which files make up the index, atomically replaced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Manifest {
    pub generation: u64,
    pub log: u64,
    pub next_seq: u64,
    pub segment_pages: u64,
    pub live: u64,
    pub quota_skipped: u64,
    pub bitmap: u64,
    pub runs: Vec<u64>,
}

pub const MANIFEST_MAGIC: &[u8; 8] = b"OCFPMAN\0";
pub const MANIFEST_VERSION: u32 = 1;

impl Manifest {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        for v in [
            self.generation,
            self.log,
            self.next_seq,
            self.segment_pages,
            self.live,
            self.quota_skipped,
            self.bitmap,
            self.runs.len() as u64,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for r in &self.runs {
            b.extend_from_slice(&r.to_le_bytes());
        }
        seal_blob(MANIFEST_MAGIC, MANIFEST_VERSION, &b)
    }

    pub fn decode(b: &[u8]) -> Option<Manifest> {
        let (version, body) = open_blob(MANIFEST_MAGIC, b)?;
        if version != MANIFEST_VERSION {
            return None;
        }
        let f = |i: usize| u64_at(body, i * 8);
        let nruns = usize::try_from(f(7)?).ok()?;
        if nruns > body.len() / 8 {
            return None;
        }
        let runs = (0..nruns).map(|i| f(8 + i)).collect::<Option<Vec<_>>>()?;
        Some(Manifest {
            generation: f(0)?,
            log: f(1)?,
            next_seq: f(2)?,
            segment_pages: f(3)?,
            live: f(4)?,
            quota_skipped: f(5)?,
            bitmap: f(6)?,
            runs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn e(k: u128) -> Entry {
        Entry {
            key: k,
            loc: k as u64 * 3,
            refs: 2,
            born: 7,
            seq: k as u64,
        }
    }

    #[test]
    fn pages_round_trip() {
        let es: Vec<Entry> = (0..PER_PAGE as u128).map(e).collect();
        let p = encode_sorted_page(&es);
        assert_eq!(decode_sorted_page(&p).unwrap(), es);
        let slots = vec![Some((5u128, 6u64)), None, Some((7, 8))];
        let s = encode_segment_page(&slots);
        assert_eq!(
            decode_segment_page(&s).unwrap(),
            vec![(5, 6), (0, 0), (7, 8)]
        );
        let mut bad = p;
        bad[100] ^= 1;
        assert_eq!(decode_sorted_page(&bad), None);
        assert_eq!(decode_segment_page(&p), None, "magic tells pages apart");
    }

    #[test]
    fn record_and_manifest_round_trip() {
        let r = encode_record(&e(99));
        assert_eq!(decode_record(&r), Some(e(99)));
        assert_eq!(decode_record(&r[..RECORD - 1]), None);
        let m = Manifest {
            generation: 3,
            runs: vec![1, 5],
            live: 9,
            ..Default::default()
        };
        assert_eq!(Manifest::decode(&m.encode()), Some(m));
    }

    proptest! {
        #[test]
        fn decoders_never_panic(b in proptest::collection::vec(any::<u8>(), 0..5000)) {
            let _ = decode_sorted_page(&b);
            let _ = decode_segment_page(&b);
            let _ = decode_record(&b);
            let _ = Manifest::decode(&b);
            let _ = open_blob(MANIFEST_MAGIC, &b);
            let _ = Entry::decode(&b);
        }

        #[test]
        fn damaged_manifest_is_refused(flip in 0usize..200, bit in 0u8..8) {
            let m = Manifest { generation: 1, runs: vec![2, 3, 4], ..Default::default() };
            let mut b = m.encode();
            let i = flip % b.len();
            b[i] ^= 1 << bit;
            prop_assert_ne!(Manifest::decode(&b), Some(m));
        }
    }
}
