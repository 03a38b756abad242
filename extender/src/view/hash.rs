//! The view's hashing: a fast hasher for its short keys, and a hash of annotation values that
//! tells a changed value from a renewed one.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// `FxHash`: a fast hash for the view's short keys (node names, UIDs). They come from the API
/// server, not from anyone who could choose colliding keys, so `SipHash`'s flood resistance is
/// not needed, and it cost a quarter of a 5,000-node filter.
#[derive(Clone, Copy, Debug, Default)]
pub struct FxHasher(u64);

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by node name or UID.
pub type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// A hash of an annotation value, to tell an unchanged one without keeping it.
pub(super) fn value_hash(value: &str) -> u64 {
    use std::hash::BuildHasher as _;
    std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(value)
}
