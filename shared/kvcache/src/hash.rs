//! Chained block hashes: the identity of a full page of tokens *and everything before it*.
//!
//! `h_0 = xxh3_64(tokens[0..P] as little-endian u32, seed = SEED)` and
//! `h_i = xxh3_64(tokens[iP..(i+1)P], seed = h_{i-1})`. Equal hashes mean equal prefixes (up to
//! 64-bit collisions), so a prefix index keyed by them is a radix tree over pages. The function is
//! stable across processes and machines: the router and every worker compute the same values.

use std::fmt;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the first block's hash ("nibble v1").
pub const SEED: u64 = 0x6e69_6262_6c65_7631;

/// The chained hash of one full page of tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockHash(pub u64);

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Hashes one block given its parent's hash (`None` for the first block).
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    BlockHash(xxh3_64_with_seed(&bytes, parent.map_or(SEED, |p| p.0)))
}

/// Chained hashes of every *full* page of `tokens`; a trailing partial page is not hashed.
///
/// # Panics
/// If `page_size` is 0.
pub fn hash_blocks(tokens: &[u32], page_size: usize) -> Vec<BlockHash> {
    let mut hashes = Vec::with_capacity(tokens.len() / page_size.max(1));
    extend_hashes(&mut hashes, tokens, page_size);
    hashes
}

/// Extends `hashes`, the chain of the first `hashes.len()` full pages of a sequence, to every
/// full page of `tokens` (that sequence's first tokens), hashing only the pages after the chain:
/// a growing sequence keeps its chain. A chain already as long is left as it is.
///
/// # Panics
/// If `page_size` is 0.
pub fn extend_hashes(hashes: &mut Vec<BlockHash>, tokens: &[u32], page_size: usize) {
    assert!(page_size > 0, "page size must be positive");
    let done = (hashes.len() * page_size).min(tokens.len());
    for block in tokens[done..].chunks_exact(page_size) {
        let h = hash_block(hashes.last().copied(), block);
        hashes.push(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_and_ignores_partial_pages() {
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = hash_blocks(&tokens, 16);
        assert_eq!(hashes.len(), 2);
        assert_eq!(hashes, hash_blocks(&tokens[..32], 16));
        assert_eq!(hashes[1], hash_block(Some(hashes[0]), &tokens[16..32]));
        let mut grown = hash_blocks(&tokens[..20], 16);
        extend_hashes(&mut grown, &tokens, 16);
        assert_eq!(grown, hashes, "extending a chain equals hashing it whole");
    }

    #[test]
    fn same_block_after_different_prefix_differs() {
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[0] = 999;
        let (ha, hb) = (hash_blocks(&a, 16), hash_blocks(&b, 16));
        assert_ne!(ha[0], hb[0]);
        assert_ne!(
            ha[1], hb[1],
            "the second block inherits the first's difference"
        );
    }

    #[test]
    fn stable_value() {
        // Changing this value breaks every router and worker that share a prefix index.
        let tokens: Vec<u32> = (0..16).collect();
        assert_eq!(hash_blocks(&tokens, 16)[0], hash_block(None, &tokens));
        assert_eq!(hash_block(None, &[]).0, xxh3_64_with_seed(&[], SEED));
    }
}
