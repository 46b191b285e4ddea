//! A pass-through hasher for maps keyed by [`BlockHash`](nibble_kvcache::BlockHash).
//!
//! Block hashes are already `xxh3_64` outputs, uniformly spread over all 64 bits, so hashing them
//! again (SipHash, the std default) only costs time on the router's hottest path. The hasher
//! returns the key itself. Keys other than one `u64` are folded with a multiply so the hasher stays
//! correct (if slower) for any key type.

use std::hash::{BuildHasherDefault, Hasher};

/// Builds [`BlockHasher`]s.
pub(crate) type BuildBlockHasher = BuildHasherDefault<BlockHasher>;

/// Returns a `u64` key as its own hash.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = self.0.rotate_left(5) ^ value;
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(*byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use nibble_kvcache::BlockHash;

    use super::*;

    #[test]
    fn a_block_hash_is_its_own_hash() {
        let build = BuildBlockHasher::default();
        for value in [0, 1, u64::MAX, 0x1234_5678_9abc_def0] {
            assert_eq!(build.hash_one(BlockHash(value)), value);
        }
    }

    #[test]
    fn other_keys_still_hash() {
        let build = BuildBlockHasher::default();
        assert_ne!(build.hash_one("ab"), build.hash_one("ba"));
        assert_ne!(build.hash_one(7u32), 0);
    }
}
