//! Encryption of a remote store: what its bucket holds is sealed on the
//! client, so the bucket's owner reads nothing and can change nothing
//! unseen.
//!
//! - A random master key (64 bytes: the data key, then the id key) is
//!   made at `store init --remote`. It is kept in the bucket wrapped
//!   (`keys/ID`: XChaCha20-Poly1305 under a key derived from the
//!   passphrase by Argon2id), and in the cache (`remote/key`, mode 0600:
//!   the cache holds the plain metadata anyway).
//! - Chunk ids are BLAKE3 keyed with the id key: the owner cannot test
//!   whether a known file is stored.
//! - Container records, metadata segments and the manifest are sealed
//!   under the data key with a random 24-byte nonce each, bound by their
//!   associated data to what they are (a record to its header: id,
//!   lengths and codec; an object to its key): a record or object moved,
//!   swapped or changed fails to open, and is reported as damage.
//! - The store's [`Cipher`] is fixed when it is made and named in its key
//!   object. New stores use AES-256-GCM (8-12x faster on
//!   CPUs with AES-NI: bench/notes/remote.md), each blob under its own
//!   key derived from the data key and the first 12 nonce bytes, the
//!   other 12 its GCM nonce: 96-bit random GCM nonces under one key would
//!   be safe for only about 2^32 blobs. Older stores keep
//!   XChaCha20-Poly1305; the layout (nonce, ciphertext, tag) is the same.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use chacha20poly1305::aead::{Aead, AeadInOut, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};
use serde::{Deserialize, Serialize};

use crate::container::Hash;
use crate::error::{Result, StoreError};

/// Bytes a sealed blob adds: the nonce and the tag.
pub const OVERHEAD: usize = NONCE + TAG;
const NONCE: usize = 24;
const TAG: usize = 16;

/// The AEAD an encrypted store seals its blobs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cipher {
    /// Stores made before ciphers were named (before 2026-12).
    XChaCha20Poly1305,
    /// AES-256-GCM under a key per blob (see the module's doc); a
    /// container record bound to its id and raw length.
    Aes256Gcm,
    /// [`Cipher::Aes256Gcm`], a container record bound to its whole
    /// header but the CRC (id, lengths, codec byte, reserved bytes): its
    /// codec is authenticated too, and a reader with the key needs no
    /// CRC. What stores made since 2026-12-08 use.
    Aes256GcmV2,
}

impl Cipher {
    /// What new stores use.
    pub const NEW: Cipher = Cipher::Aes256GcmV2;

    /// The name kept in key objects and in the cache's key file.
    pub fn name(self) -> &'static str {
        match self {
            Cipher::XChaCha20Poly1305 => "xchacha20-poly1305",
            Cipher::Aes256Gcm => "aes-256-gcm",
            Cipher::Aes256GcmV2 => "aes-256-gcm-v2",
        }
    }

    /// Every cipher this code reads.
    pub const ALL: [Cipher; 3] = [
        Cipher::XChaCha20Poly1305,
        Cipher::Aes256Gcm,
        Cipher::Aes256GcmV2,
    ];

    /// Bytes of a container record's header its AEAD binds: 36 (id and
    /// raw length) or 44 (all but the CRC).
    pub fn record_aad_len(self) -> usize {
        match self {
            Cipher::XChaCha20Poly1305 | Cipher::Aes256Gcm => 36,
            Cipher::Aes256GcmV2 => 44,
        }
    }

    /// Whether a record's AEAD binds all its CRC covers (the codec byte
    /// among it): a reader with the key needs no CRC.
    pub fn binds_header(self) -> bool {
        self.record_aad_len() == 44
    }

    pub fn from_name(name: &str) -> Option<Cipher> {
        Cipher::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// The data key, ready for its cipher.
enum DataKey {
    XChaCha(Box<XChaCha20Poly1305>),
    /// The key blobs' own keys are derived from.
    Aes([u8; 32]),
}

/// The keys of an encrypted store.
pub struct Keys {
    cipher: Cipher,
    data: DataKey,
    ids: [u8; 32],
    master: [u8; 64],
}

fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).expect("getrandom");
    b
}

impl Keys {
    /// A new random master key, for a new store.
    pub fn generate() -> Keys {
        Keys::from_master(random(), Cipher::NEW)
    }

    pub fn from_master(master: [u8; 64], cipher: Cipher) -> Keys {
        let key: [u8; 32] = master[..32].try_into().unwrap();
        let data = match cipher {
            Cipher::XChaCha20Poly1305 => {
                DataKey::XChaCha(Box::new(XChaCha20Poly1305::new(&Key::from(key))))
            }
            Cipher::Aes256Gcm | Cipher::Aes256GcmV2 => DataKey::Aes(key),
        };
        Keys {
            cipher,
            data,
            ids: master[32..].try_into().unwrap(),
            master,
        }
    }

    pub fn master(&self) -> &[u8; 64] {
        &self.master
    }

    pub fn cipher(&self) -> Cipher {
        self.cipher
    }

    /// A chunk's id: BLAKE3 keyed with the id key.
    pub fn fingerprint(&self, data: &[u8]) -> Hash {
        *blake3::keyed_hash(&self.ids, data).as_bytes()
    }

    /// `nonce || ciphertext || tag` of `plain`, bound to `aad`.
    pub fn seal(&self, aad: &[u8], plain: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(OVERHEAD + plain.len());
        self.seal_into(aad, plain, &mut out);
        out
    }

    /// [`Keys::seal`] appended to `out` ([`OVERHEAD`] bytes more than
    /// `plain`): the plaintext is copied once, into its place in `out`.
    pub fn seal_into(&self, aad: &[u8], plain: &[u8], out: &mut Vec<u8>) {
        match &self.data {
            DataKey::XChaCha(aead) => seal_xchacha_into(aead, aad, plain, out),
            DataKey::Aes(key) => seal_aes_into(key, aad, plain, out),
        }
    }

    /// The plaintext of [`Keys::seal`]'s output; `None` when it was made
    /// with another key or `aad`, or changed since.
    pub fn open(&self, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        let mut out = vec![0; sealed.len().checked_sub(OVERHEAD)?];
        self.open_into(aad, sealed, &mut out).then_some(out)
    }

    /// [`Keys::open`] straight into `out`, which must be exactly
    /// [`OVERHEAD`] bytes shorter than `sealed`; false (and `out` holding
    /// unspecified bytes) when it does not open or the lengths differ.
    pub fn open_into(&self, aad: &[u8], sealed: &[u8], out: &mut [u8]) -> bool {
        if sealed.len() != out.len() + OVERHEAD {
            return false;
        }
        let (nonce, rest) = sealed.split_at(NONCE);
        let (body, tag) = rest.split_at(out.len());
        let nonce: &[u8; NONCE] = nonce.try_into().unwrap();
        match &self.data {
            DataKey::XChaCha(aead) => {
                out.copy_from_slice(body);
                let Ok(tag) = tag.try_into() else {
                    return false;
                };
                aead.decrypt_inout_detached(&XNonce::from(*nonce), aad, out.into(), tag)
                    .is_ok()
            }
            DataKey::Aes(key) => {
                let (key, gcm) = blob_key(key, nonce);
                key.open_separate_gather(gcm, Aad::from(aad), body, tag, out)
                    .is_ok()
            }
        }
    }
}

/// The AES-256-GCM key of the blob whose nonce is `nonce`, and its GCM
/// nonce. Distinct blobs get distinct keys unless their random 96-bit
/// prefixes collide, and then their GCM nonces still differ.
fn blob_key(data: &[u8; 32], nonce: &[u8; NONCE]) -> (LessSafeKey, Nonce) {
    let mut material = [0u8; 32 + 12];
    material[..32].copy_from_slice(data);
    material[32..].copy_from_slice(&nonce[..12]);
    let key = blake3::derive_key("onecopy 2026-12-02 AES-256-GCM blob key", &material);
    let key = UnboundKey::new(&AES_256_GCM, &key).expect("a 32-byte key");
    let gcm: [u8; 12] = nonce[12..].try_into().unwrap();
    (LessSafeKey::new(key), Nonce::assume_unique_for_key(gcm))
}

/// nonce | ciphertext | tag appended to `out`: a fresh random nonce, and
/// the plaintext copied once into its place, where `encrypt` turns it
/// into ciphertext and returns the tag.
fn seal_appending(
    plain: &[u8],
    out: &mut Vec<u8>,
    encrypt: impl FnOnce(&[u8; NONCE], &mut [u8]) -> [u8; TAG],
) {
    let nonce: [u8; NONCE] = random();
    out.reserve(OVERHEAD + plain.len());
    out.extend_from_slice(&nonce);
    let start = out.len();
    out.extend_from_slice(plain);
    let tag = encrypt(&nonce, &mut out[start..]);
    out.extend_from_slice(&tag);
}

fn seal_aes_into(data: &[u8; 32], aad: &[u8], plain: &[u8], out: &mut Vec<u8>) {
    seal_appending(plain, out, |nonce, body| {
        let (key, gcm) = blob_key(data, nonce);
        let tag = key
            .seal_in_place_separate_tag(gcm, Aad::from(aad), body)
            .expect("AES-256-GCM seals any length a record has");
        tag.as_ref().try_into().expect("a 16-byte tag")
    })
}

fn seal_xchacha_into(aead: &XChaCha20Poly1305, aad: &[u8], plain: &[u8], out: &mut Vec<u8>) {
    seal_appending(plain, out, |nonce, body| {
        let tag = aead
            .encrypt_inout_detached(&XNonce::from(*nonce), aad, body.into())
            .expect("XChaCha20-Poly1305 seals any length a record has");
        tag.into()
    })
}

fn open_with(aead: &XChaCha20Poly1305, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
    if sealed.len() < OVERHEAD {
        return None;
    }
    let nonce: [u8; NONCE] = sealed[..NONCE].try_into().unwrap();
    aead.decrypt(
        &XNonce::from(nonce),
        Payload {
            msg: &sealed[NONCE..],
            aad,
        },
    )
    .ok()
}

/// A master key wrapped by a passphrase: the `keys/ID` object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyFile {
    /// `argon2id`.
    pub kdf: String,
    /// Argon2 memory (KiB), passes and lanes.
    pub m_kib: u32,
    pub t: u32,
    pub p: u32,
    pub salt: String,
    /// The sealed master key (hex).
    pub sealed: String,
    /// The store's [`Cipher`] (absent in key files made before 2026-12:
    /// XChaCha20-Poly1305).
    #[serde(default = "old_cipher")]
    pub cipher: String,
}

fn old_cipher() -> String {
    Cipher::XChaCha20Poly1305.name().into()
}

/// What a wrapped master key is bound to: its store's cipher too, so
/// that a key file whose cipher was changed does not open.
fn master_aad(cipher: Cipher) -> Vec<u8> {
    match cipher {
        Cipher::XChaCha20Poly1305 => b"onecopy master key".to_vec(),
        c => format!("onecopy master key; cipher {}", c.name()).into_bytes(),
    }
}

/// Argon2id's cost for new keys: 64 MiB, 3 passes (about 0.25 s here).
const M_KIB: u32 = 64 * 1024;
const PASSES: u32 = 3;

/// The most a key object may ask of Argon2 (it is the bucket's, so its
/// owner's: 2^32 - 1 passes spun for ever): 4 GiB, 64 passes, 64 lanes.
const MAX_M_KIB: u32 = 4 << 20;
const MAX_PASSES: u32 = 64;
const MAX_LANES: u32 = 64;

fn kek(password: &[u8], salt: &[u8], m_kib: u32, t: u32, p: u32) -> Result<XChaCha20Poly1305> {
    let bad = |e: argon2::Error| StoreError::BadOption(format!("the key's Argon2 settings: {e}"));
    if m_kib > MAX_M_KIB || t > MAX_PASSES || p > MAX_LANES {
        return Err(StoreError::BadOption(format!(
            "the key's Argon2 settings (m={m_kib} KiB, t={t}, p={p}) are beyond what onecopy \
             makes or accepts (m <= {MAX_M_KIB}, t <= {MAX_PASSES}, p <= {MAX_LANES})"
        )));
    }
    let params = argon2::Params::new(m_kib, t, p, Some(32)).map_err(bad)?;
    let a = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let mut out = [0u8; 32];
    a.hash_password_into(password, salt, &mut out)
        .map_err(bad)?;
    Ok(XChaCha20Poly1305::new(&Key::from(out)))
}

/// Wraps `keys` with `password`.
pub fn wrap(keys: &Keys, password: &[u8]) -> Result<KeyFile> {
    let salt: [u8; 16] = random();
    let k = kek(password, &salt, M_KIB, PASSES, 1)?;
    let mut sealed = Vec::new();
    seal_xchacha_into(&k, &master_aad(keys.cipher()), keys.master(), &mut sealed);
    Ok(KeyFile {
        kdf: "argon2id".into(),
        m_kib: M_KIB,
        t: PASSES,
        p: 1,
        salt: hex::encode(salt),
        sealed: hex::encode(sealed),
        cipher: keys.cipher().name().into(),
    })
}

/// Unwraps a key file; [`StoreError::WrongPassword`] when `password` is
/// not the one it was wrapped with.
pub fn unwrap(kf: &KeyFile, password: &[u8]) -> Result<Keys> {
    let bad = || StoreError::Remote {
        why: "the bucket's key object is damaged".into(),
    };
    if kf.kdf != "argon2id" {
        return Err(bad());
    }
    let cipher = Cipher::from_name(&kf.cipher).ok_or_else(|| StoreError::Remote {
        why: format!(
            "the bucket's store is sealed with {}, which this onecopy does not know: upgrade onecopy",
            kf.cipher
        ),
    })?;
    let salt = hex::decode(&kf.salt).map_err(|_| bad())?;
    let sealed = hex::decode(&kf.sealed).map_err(|_| bad())?;
    let k = kek(password, &salt, kf.m_kib, kf.t, kf.p)?;
    let master = open_with(&k, &master_aad(cipher), &sealed).ok_or(StoreError::WrongPassword)?;
    let master: [u8; 64] = master.try_into().map_err(|_| bad())?;
    Ok(Keys::from_master(master, cipher))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_blobs_open_only_with_their_key_and_aad() {
        for cipher in Cipher::ALL {
            sealed_blobs_open_only_with_their_key_and_aad_in(cipher);
        }
    }

    fn sealed_blobs_open_only_with_their_key_and_aad_in(cipher: Cipher) {
        let k = Keys::from_master(random(), cipher);
        let s = k.seal(b"a", b"hello");
        assert_eq!(s.len(), 5 + OVERHEAD);
        assert_eq!(opened(&k, b"a", &s).unwrap(), b"hello");
        assert!(opened(&k, b"b", &s).is_none(), "another aad");
        let other = Keys::from_master(random(), cipher);
        assert!(opened(&other, b"a", &s).is_none(), "another key");
        let mut bad = s.clone();
        bad[30] ^= 1;
        assert!(opened(&k, b"a", &bad).is_none(), "a changed byte");
        assert!(opened(&k, b"a", &s[..10]).is_none(), "cut short");
        assert_ne!(k.seal(b"a", b"hello"), s, "a fresh nonce each time");
        assert!(!k.open_into(b"a", &s, &mut [0; 4]), "an output too short");
    }

    /// `open` and `open_into` agree: the plaintext, or `None`.
    fn opened(k: &Keys, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        let plain = k.open(aad, sealed);
        let mut out = vec![0; sealed.len().saturating_sub(OVERHEAD)];
        assert_eq!(k.open_into(aad, sealed, &mut out), plain.is_some());
        if let Some(p) = &plain {
            assert_eq!(p, &out);
        }
        plain
    }

    #[test]
    fn a_key_file_opens_with_its_password_only() {
        let k = Keys::generate();
        let kf = wrap(&k, b"correct horse").unwrap();
        assert_eq!(kf.cipher, Cipher::NEW.name());
        let back = unwrap(&kf, b"correct horse").unwrap();
        assert_eq!(back.master(), k.master());
        assert_eq!(back.cipher(), Cipher::NEW);
        assert!(matches!(
            unwrap(&kf, b"wrong"),
            Err(StoreError::WrongPassword)
        ));
        assert_ne!(
            k.fingerprint(b"x"),
            *blake3::hash(b"x").as_bytes(),
            "ids are keyed"
        );
    }

    /// A key object asking Argon2 for more than onecopy makes is refused
    /// at once (2^32 - 1 passes spun with no word).
    #[test]
    fn a_key_file_asking_too_much_of_argon2_is_refused() {
        let kf = wrap(&Keys::generate(), b"pw").unwrap();
        for (m_kib, t, p) in [
            (M_KIB, u32::MAX, 1),
            (u32::MAX, PASSES, 1),
            (M_KIB, PASSES, 1 << 20),
        ] {
            let hostile = KeyFile {
                m_kib,
                t,
                p,
                ..kf.clone()
            };
            let t0 = std::time::Instant::now();
            assert!(matches!(
                unwrap(&hostile, b"pw"),
                Err(StoreError::BadOption(_))
            ));
            assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        }
    }

    fn fixture_master() -> [u8; 64] {
        std::array::from_fn(|i| i as u8)
    }

    /// Blobs sealed by earlier versions open with today's code: the
    /// formats are frozen (these were made with the master key 0, 1, ..63
    /// and associated data `fixture`).
    #[test]
    fn blobs_of_both_ciphers_stay_readable() {
        let fixtures = [
            (Cipher::XChaCha20Poly1305, "8b2e7636f5ae38ca4c8b994b8c2a336844300d73a6160e7e8a6376783491e935ac2f4b650530dd63297e8d3999255c4366c4e2f520"),
            (Cipher::Aes256Gcm, "235a0f2e7afb7a1a8362eaa5e66b331baa8faf7d67696a93c2426e5f866cdb8d61322dfc796c9285cc847ff309da2790c0f9fbe379"),
            // v2 differs from AES-256-GCM in what a record binds, not in blobs.
            (Cipher::Aes256GcmV2, "235a0f2e7afb7a1a8362eaa5e66b331baa8faf7d67696a93c2426e5f866cdb8d61322dfc796c9285cc847ff309da2790c0f9fbe379"),
        ];
        for (cipher, blob) in fixtures {
            let k = Keys::from_master(fixture_master(), cipher);
            let blob = hex::decode(blob).unwrap();
            assert_eq!(
                opened(&k, b"fixture", &blob).unwrap(),
                b"kept readable",
                "{cipher:?}"
            );
            let other = match cipher {
                Cipher::XChaCha20Poly1305 => Cipher::Aes256Gcm,
                Cipher::Aes256Gcm | Cipher::Aes256GcmV2 => Cipher::XChaCha20Poly1305,
            };
            let k = Keys::from_master(fixture_master(), other);
            assert!(
                opened(&k, b"fixture", &blob).is_none(),
                "{cipher:?} read as {other:?}"
            );
        }
    }

    /// A key file made before ciphers were named (no `cipher`) unwraps to
    /// an XChaCha20-Poly1305 store's keys; one whose cipher was changed
    /// does not unwrap.
    #[test]
    fn a_key_file_from_before_ciphers_were_named_still_opens() {
        let old = r#"{"kdf":"argon2id","m_kib":65536,"t":3,"p":1,"salt":"4694ffaef821aac336a7d1558e37c49d","sealed":"b87d1a611731922f7b37684d5e61c029efaab664fa8751104f3d93c8e7da269693ad17374b64af24d413a89d98e2b3d5ec8a4b34c06a58808c4959f085ba7ac1c767534aabb6f8b3a5822e2f3a9eec7824da2eef912772e31eaea28448a1931c228136469aad9f6d"}"#;
        let kf: KeyFile = serde_json::from_str(old).unwrap();
        let k = unwrap(&kf, b"pw").unwrap();
        assert_eq!(k.cipher(), Cipher::XChaCha20Poly1305);
        assert_eq!(k.master(), &fixture_master());
        let mut changed = kf.clone();
        changed.cipher = Cipher::Aes256Gcm.name().into();
        assert!(matches!(
            unwrap(&changed, b"pw"),
            Err(StoreError::WrongPassword)
        ));
        changed.cipher = "rot13".into();
        assert!(matches!(
            unwrap(&changed, b"pw"),
            Err(StoreError::Remote { .. })
        ));
    }
}
