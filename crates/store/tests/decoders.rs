//! Decoders of every on-disk structure the store reads, fed arbitrary and
//! mutated bytes (issue 11): they return errors, never panic, and a
//! damaged record never decodes. Covers container records, `store.json`,
//! and the option parsers; `meta.sqlite` is SQLite's own format (a
//! damaged header is tested through the CLI in tests/store_faults.rs).

use onecopy_store::container::{decode, decode_into, encode, RECORD_HEADER};
use onecopy_store::seal::{Cipher, Keys};
use onecopy_store::{Chunking, Compress, Store};
use proptest::prelude::*;

fn codec() -> impl Strategy<Value = Compress> {
    prop_oneof![
        Just(Compress::Zstd),
        Just(Compress::Lz4),
        Just(Compress::None)
    ]
}

/// A record header with a valid CRC over arbitrary fields and payload.
fn framed(raw_len: u32, codec: u8, payload: &[u8]) -> Vec<u8> {
    let mut rec = vec![7u8; 32];
    rec.extend_from_slice(&raw_len.to_le_bytes());
    rec.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    rec.extend_from_slice(&[codec, 0, 0, 0]);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&rec);
    crc.update(payload);
    rec.extend_from_slice(&crc.finalize().to_le_bytes());
    rec.extend_from_slice(payload);
    rec
}

/// A fixed key (the cases need not differ in it), of each cipher.
fn keys() -> [Keys; 3] {
    Cipher::ALL.map(|c| Keys::from_master([7; 64], c))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = decode(&bytes, 1, 16, None);
        for k in keys() {
            let _ = decode(&bytes, 1, 16, Some(&k));
        }
    }

    #[test]
    fn valid_crc_over_garbage_is_an_error_or_exact(
        raw_len in prop_oneof![0u32..70_000, Just(u32::MAX), Just(4 << 20)],
        codec in prop_oneof![0u8..5, 0x80u8..0x85],
        payload in proptest::collection::vec(any::<u8>(), 0..2000),
    ) {
        let rec = framed(raw_len, codec, &payload);
        let [a, b, c] = keys();
        for k in [None, Some(a), Some(b), Some(c)] {
            if let Ok((_, raw)) = decode(&rec, 1, 16, k.as_ref()) {
                prop_assert_eq!(raw.len(), raw_len as usize);
            }
        }
    }

    #[test]
    fn round_trip_and_any_flip_is_detected(
        raw in proptest::collection::vec(0u8..4, 1..20_000),
        compress in codec(),
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let hash = *blake3_like(&raw);
        let enc = encode(&hash, &raw, compress, None);
        let (h, back) = decode(&enc.bytes, 1, 16, None).unwrap();
        prop_assert_eq!(h, hash);
        prop_assert_eq!(&back, &raw);
        let mut bad = enc.bytes.clone();
        let i = at.index(bad.len());
        bad[i] ^= 1 << bit;
        prop_assert!(decode(&bad, 1, 16, None).is_err(), "flip at {} of {}", i, bad.len());
        let cut = at.index(bad.len().max(RECORD_HEADER + 1) - 1);
        prop_assert!(decode(&enc.bytes[..cut], 1, 16, None).is_err());
        // The same, sealed with each cipher (ids keyed, as a store makes
        // them). A v2 record's CRC is left to its AEAD when read with
        // the key: a flip there reads exactly the bytes stored.
        for k in keys() {
            let sealed = encode(&k.fingerprint(&raw), &raw, compress, Some(&k));
            prop_assert_eq!(&decode(&sealed.bytes, 1, 16, Some(&k)).unwrap().1, &raw);
            let mut out = vec![0; raw.len()];
            decode_into(&sealed.bytes, 1, 16, &mut out, Some(&k)).unwrap();
            prop_assert_eq!(&out, &raw);
            let mut bad = sealed.bytes.clone();
            let i = at.index(bad.len());
            bad[i] ^= 1 << bit;
            if (44..RECORD_HEADER).contains(&i) && k.cipher() == Cipher::Aes256GcmV2 {
                prop_assert_eq!(&decode(&bad, 1, 16, Some(&k)).unwrap().1, &raw);
                continue;
            }
            prop_assert!(decode(&bad, 1, 16, Some(&k)).is_err(), "sealed: flip at {}", i);
            let into = decode_into(&bad, 1, 16, &mut out, Some(&k));
            prop_assert!(into.is_err(), "sealed, decoded into: flip at {}", i);
        }
    }

    #[test]
    fn option_parsers_never_panic(s in ".{0,40}") {
        let _ = s.parse::<Chunking>();
        let _ = s.parse::<Compress>();
        let _ = onecopy_store::config::parse_size(&s);
        let _ = format!("fixed:{s}").parse::<Chunking>();
        let _ = format!("cdc:{s}").parse::<Chunking>();
    }
}

/// Any 32 bytes will do as the record's identity.
fn blake3_like(raw: &[u8]) -> Box<[u8; 32]> {
    let mut h = [0u8; 32];
    for (i, b) in raw.iter().enumerate() {
        h[i % 32] = h[i % 32].wrapping_mul(31).wrapping_add(*b);
    }
    Box::new(h)
}

#[test]
fn damaged_store_json_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let good = serde_json_of_default(dir.path());
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..300 {
        let mut bytes = good.clone();
        for _ in 0..1 + (rng % 4) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let i = (rng % bytes.len() as u64) as usize;
            bytes[i] = (rng >> 32) as u8;
        }
        if rng.is_multiple_of(5) {
            bytes.truncate((rng >> 8) as usize % bytes.len());
        }
        std::fs::write(dir.path().join("store.json"), &bytes).unwrap();
        // Either an error or a config that passed every check.
        if let Ok(cfg) = Store::read_config(dir.path()) {
            assert!(cfg.chunking.max_chunk() <= 4 << 20);
        }
    }
}

fn serde_json_of_default(dir: &std::path::Path) -> Vec<u8> {
    Store::init(&dir.join("s"), &onecopy_store::StoreConfig::default()).unwrap();
    std::fs::read(dir.join("s/store.json")).unwrap()
}
