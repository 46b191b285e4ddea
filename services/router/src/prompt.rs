//! A prompt as the router sees it: its length and the chained hashes of its full pages.
//!
//! Invariant: a [`Prompt`] has at least one token, a positive page size, and exactly
//! `tokens / page_size` block hashes (a trailing partial page is never cached, so never hashed).
//! Hashing happens here, outside the router's state, so a service can do it before it takes its
//! turn on the router.

use nibble_kvcache::{hash_blocks, BlockHash};

use crate::{Error, Result};

/// A validated prompt (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    hashes: Vec<BlockHash>,
    tokens: usize,
    page_size: u32,
    /// A scoring request's: computed whole on its decode worker ([`Prompt::scored`]).
    scored: bool,
}

impl Prompt {
    /// Hashes `token_ids` in pages of `page_size` tokens.
    pub fn new(token_ids: &[u32], page_size: u32) -> Result<Self> {
        check(token_ids.len(), page_size)?;
        Ok(Self {
            hashes: hash_blocks(token_ids, page_size as usize),
            tokens: token_ids.len(),
            page_size,
            scored: false,
        })
    }

    /// A prompt of `tokens` tokens whose full pages of `page_size` hash to `hashes`.
    pub fn from_hashes(hashes: Vec<BlockHash>, tokens: usize, page_size: u32) -> Result<Self> {
        check(tokens, page_size)?;
        let expected = tokens / page_size as usize;
        if hashes.len() != expected {
            return Err(Error::HashCount {
                tokens,
                page_size,
                expected,
                got: hashes.len(),
            });
        }
        Ok(Self {
            hashes,
            tokens,
            page_size,
            scored: false,
        })
    }

    /// The same prompt of a scoring request (prompt log-probabilities), which its decode worker
    /// computes whole: routed without a prefill worker.
    pub fn scored(self) -> Self {
        Self {
            scored: true,
            ..self
        }
    }

    /// Whether it is a scoring request's.
    pub fn is_scored(&self) -> bool {
        self.scored
    }

    /// The chained hashes of the prompt's full pages.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Tokens in the prompt.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Tokens per page the hashes were computed with.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Pages the whole prompt occupies, the last possibly partial.
    pub fn pages(&self) -> usize {
        self.tokens.div_ceil(self.page_size as usize)
    }
}

fn check(tokens: usize, page_size: u32) -> Result<()> {
    if page_size == 0 {
        return Err(Error::InvalidConfig {
            field: "page_size",
            reason: "must be positive",
        });
    }
    if tokens == 0 {
        return Err(Error::EmptyPrompt);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_full_pages_only() {
        let tokens: Vec<u32> = (0..40).collect();
        let prompt = Prompt::new(&tokens, 16).unwrap();
        assert_eq!(prompt.hashes().len(), 2);
        assert_eq!((prompt.tokens(), prompt.pages()), (40, 3));
        assert_eq!(
            Prompt::from_hashes(prompt.hashes().to_vec(), 40, 16).unwrap(),
            prompt
        );
    }

    #[test]
    fn rejects_what_cannot_be_routed() {
        assert!(matches!(Prompt::new(&[], 16), Err(Error::EmptyPrompt)));
        assert!(matches!(
            Prompt::new(&[1], 0),
            Err(Error::InvalidConfig { .. })
        ));
        let err = Prompt::from_hashes(vec![BlockHash(1)], 40, 16).unwrap_err();
        assert_eq!(
            err.to_string(),
            "a prompt of 40 tokens has 2 full pages of 16, got 1 block hashes"
        );
    }
}
