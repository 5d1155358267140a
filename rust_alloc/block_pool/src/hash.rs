//! Hashing: the prefix-cache chain hash and a fast hasher for integer-keyed maps.

use std::hash::{BuildHasher, Hasher};

const K: u64 = 0x9E37_79B9_7F4A_7C15;

#[inline]
fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Hash of a full block: chains the parent's hash, the salt and the block's token ids.
/// Hits are verified against the stored tokens and parent, so collisions are harmless.
pub fn chain_hash(parent: u64, salt: u64, tokens: &[u32]) -> u64 {
    let mut h = mix(parent ^ K) ^ mix(salt.wrapping_add(K.rotate_left(17)));
    for pair in tokens.chunks(2) {
        let v = pair[0] as u64 | (pair.get(1).copied().unwrap_or(u32::MAX) as u64) << 32;
        h = (h.rotate_left(23) ^ v).wrapping_mul(K);
    }
    mix(h ^ tokens.len() as u64)
}

/// A multiply-rotate hasher for integer keys (sequence ids, chain hashes).
#[derive(Default, Clone, Copy)]
pub struct FxBuild;

#[derive(Default)]
pub struct FxHasher(u64);

impl BuildHasher for FxBuild {
    type Hasher = FxHasher;
    fn build_hasher(&self) -> FxHasher { FxHasher(0) }
}

impl Hasher for FxHasher {
    fn finish(&self) -> u64 { mix(self.0) }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(K);
        }
    }
    fn write_u64(&mut self, i: u64) { self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(K); }
    fn write_i64(&mut self, i: i64) { self.write_u64(i as u64) }
    fn write_u32(&mut self, i: u32) { self.write_u64(i as u64) }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn chain_hash_depends_on_everything() {
        let a = chain_hash(0, 0, &[1, 2, 3, 4]);
        assert_ne!(a, chain_hash(1, 0, &[1, 2, 3, 4]));
        assert_ne!(a, chain_hash(0, 1, &[1, 2, 3, 4]));
        assert_ne!(a, chain_hash(0, 0, &[1, 2, 4, 3]));
        assert_ne!(chain_hash(0, 0, &[1, 2, 3]), chain_hash(0, 0, &[1, 2, 3, u32::MAX]));
        assert_eq!(a, chain_hash(0, 0, &[1, 2, 3, 4]));
    }
}
