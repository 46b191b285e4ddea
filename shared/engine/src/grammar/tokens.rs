//! The vocabulary as llguidance sees it: every token's bytes in a token trie, and a way to
//! tokenize bytes (for the literal strings of a grammar).

use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use super::GrammarError;
use crate::tokenizer::Tokenizer;

/// A tokenizer's trie and encoder.
pub(super) struct TokenEnv {
    trie: TokTrie,
    encoder: tokenizers::Tokenizer,
}

impl TokenEnv {
    /// The bytes of every token of `tokenizer` (from its `tokenizer.json` form: byte-level BPE
    /// or byte fallback), special tokens marked as llguidance expects.
    pub(super) fn new(tokenizer: &Tokenizer) -> Result<Self, GrammarError> {
        let json = serde_json::to_value(tokenizer.inner())
            .map_err(|e| GrammarError(format!("reading the vocabulary: {e}")))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| GrammarError(format!("reading the vocabulary: {e}")))?;
        let vocab = words.len().max(tokenizer.vocab_size());
        words.resize(vocab, Vec::new());
        let eos = tokenizer
            .eos_token_id()
            .ok_or_else(|| GrammarError("the tokenizer has no end-of-sequence token".into()))?;
        let mut info = TokRxInfo::new(vocab as u32, eos);
        info.tok_bos = tokenizer.bos_token_id();
        info.tok_end_of_turn = tokenizer.eos_token_ids().get(1).copied();
        Ok(Self {
            trie: TokTrie::from(&info, &words),
            encoder: tokenizer.inner().clone(),
        })
    }
}

impl TokenizerEnv for TokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(s);
        match self.encoder.encode(text.as_ref(), false) {
            Ok(enc) => enc.get_ids().to_vec(),
            // The trie's greedy tokenization is always available.
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}
