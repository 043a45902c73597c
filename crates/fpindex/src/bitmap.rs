//! One bit per insertion sequence number: set while the entry inserted
//! with it is live. It lets a segment page loaded into the cache skip
//! entries deleted since (1 bit of RAM per entry ever inserted).

use crate::format::{open_blob, seal_blob};

const MAGIC: &[u8; 8] = b"OCFPLIV\0";

#[derive(Default, Clone, PartialEq, Eq, Debug)]
pub struct Bitmap(Vec<u64>);

impl Bitmap {
    pub fn set(&mut self, i: u64) {
        let w = (i / 64) as usize;
        if w >= self.0.len() {
            self.0.resize(w + 1, 0);
        }
        self.0[w] |= 1 << (i % 64);
    }

    pub fn clear(&mut self, i: u64) {
        if let Some(w) = self.0.get_mut((i / 64) as usize) {
            *w &= !(1 << (i % 64));
        }
    }

    pub fn get(&self, i: u64) -> bool {
        self.0
            .get((i / 64) as usize)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    pub fn bytes(&self) -> usize {
        self.0.len() * 8
    }

    pub fn encode(&self) -> Vec<u8> {
        let body: Vec<u8> = self.0.iter().flat_map(|w| w.to_le_bytes()).collect();
        seal_blob(MAGIC, 1, &body)
    }

    pub fn decode(b: &[u8]) -> Option<Bitmap> {
        let (v, body) = open_blob(MAGIC, b)?;
        if v != 1 || body.len() % 8 != 0 {
            return None;
        }
        Some(Bitmap(
            body.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut b = Bitmap::default();
        b.set(3);
        b.set(200);
        b.clear(3);
        assert!(!b.get(3) && b.get(200) && !b.get(10_000));
        assert_eq!(Bitmap::decode(&b.encode()), Some(b));
    }
}
