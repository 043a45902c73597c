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
//!   with XChaCha20-Poly1305 under the data key, a random 24-byte nonce
//!   each, bound by their associated data to what they are (a record to
//!   its chunk id and length, an object to its key): a record or object
//!   moved, swapped or changed fails to open, and is reported as damage.

use chacha20poly1305::aead::{Aead, AeadInOut, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};
use serde::{Deserialize, Serialize};

use crate::container::Hash;
use crate::error::{Result, StoreError};

/// Bytes a sealed blob adds: the nonce and the tag.
pub const OVERHEAD: usize = NONCE + 16;
const NONCE: usize = 24;

/// The keys of an encrypted store.
pub struct Keys {
    aead: XChaCha20Poly1305,
    ids: [u8; 32],
    master: [u8; 64],
}

fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).expect("getrandom");
    b
}

impl Keys {
    /// A new random master key.
    pub fn generate() -> Keys {
        Keys::from_master(random())
    }

    pub fn from_master(master: [u8; 64]) -> Keys {
        let data: [u8; 32] = master[..32].try_into().unwrap();
        Keys {
            aead: XChaCha20Poly1305::new(&Key::from(data)),
            ids: master[32..].try_into().unwrap(),
            master,
        }
    }

    pub fn master(&self) -> &[u8; 64] {
        &self.master
    }

    /// A chunk's id: BLAKE3 keyed with the id key.
    pub fn fingerprint(&self, data: &[u8]) -> Hash {
        *blake3::keyed_hash(&self.ids, data).as_bytes()
    }

    /// `nonce || ciphertext || tag` of `plain`, bound to `aad`.
    pub fn seal(&self, aad: &[u8], plain: &[u8]) -> Vec<u8> {
        seal_with(&self.aead, aad, plain)
    }

    /// The plaintext of [`Keys::seal`]'s output; `None` when it was made
    /// with another key or `aad`, or changed since.
    pub fn open(&self, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        open_with(&self.aead, aad, sealed)
    }
}

fn seal_with(aead: &XChaCha20Poly1305, aad: &[u8], plain: &[u8]) -> Vec<u8> {
    let nonce: [u8; NONCE] = random();
    // nonce | ciphertext | tag, the plaintext copied once.
    let mut out = Vec::with_capacity(OVERHEAD + plain.len());
    out.extend_from_slice(&nonce);
    out.extend_from_slice(plain);
    let tag = aead
        .encrypt_inout_detached(&XNonce::from(nonce), aad, (&mut out[NONCE..]).into())
        .expect("XChaCha20-Poly1305 seals any length a record has");
    out.extend_from_slice(&tag);
    out
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
}

/// Argon2id's cost for new keys: 64 MiB, 3 passes (about 0.25 s here).
const M_KIB: u32 = 64 * 1024;
const PASSES: u32 = 3;

fn kek(password: &[u8], salt: &[u8], m_kib: u32, t: u32, p: u32) -> Result<XChaCha20Poly1305> {
    let bad = |e: argon2::Error| StoreError::BadOption(format!("the key's Argon2 settings: {e}"));
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
    Ok(KeyFile {
        kdf: "argon2id".into(),
        m_kib: M_KIB,
        t: PASSES,
        p: 1,
        salt: hex::encode(salt),
        sealed: hex::encode(seal_with(&k, b"onecopy master key", keys.master())),
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
    let salt = hex::decode(&kf.salt).map_err(|_| bad())?;
    let sealed = hex::decode(&kf.sealed).map_err(|_| bad())?;
    let k = kek(password, &salt, kf.m_kib, kf.t, kf.p)?;
    let master = open_with(&k, b"onecopy master key", &sealed).ok_or(StoreError::WrongPassword)?;
    let master: [u8; 64] = master.try_into().map_err(|_| bad())?;
    Ok(Keys::from_master(master))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_blobs_open_only_with_their_key_and_aad() {
        let k = Keys::generate();
        let s = k.seal(b"a", b"hello");
        assert_eq!(s.len(), 5 + OVERHEAD);
        assert_eq!(k.open(b"a", &s).unwrap(), b"hello");
        assert!(k.open(b"b", &s).is_none(), "another aad");
        assert!(Keys::generate().open(b"a", &s).is_none(), "another key");
        let mut bad = s.clone();
        bad[30] ^= 1;
        assert!(k.open(b"a", &bad).is_none(), "a changed byte");
        assert!(k.open(b"a", &s[..10]).is_none(), "cut short");
        assert_ne!(k.seal(b"a", b"hello"), s, "a fresh nonce each time");
    }

    #[test]
    fn a_key_file_opens_with_its_password_only() {
        let k = Keys::generate();
        let kf = wrap(&k, b"correct horse").unwrap();
        assert_eq!(unwrap(&kf, b"correct horse").unwrap().master(), k.master());
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
}
