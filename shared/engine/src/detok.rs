//! Incremental detokenization: text deltas for a stream of tokens.
//!
//! Byte-level BPE tokens do not map one-to-one to characters: one character can span several
//! tokens, and a token decoded alone can differ from the same token decoded after its neighbours.
//! [`Detokenizer`] decodes a short window — the tokens since the last emitted text plus a few
//! before them for context — and emits only text that is complete: nothing while the window ends
//! in an unfinished UTF-8 sequence (decoded as U+FFFD), which the next tokens complete.

/// Turns a stream of token ids into text deltas.
#[derive(Debug, Clone)]
pub struct Detokenizer {
    tokens: Vec<u32>,
    /// Start of the context window: tokens before it are never decoded again.
    prefix: usize,
    /// End of the tokens whose text was emitted.
    read: usize,
}

/// Prompt tokens kept as context for the first output tokens.
const PROMPT_CONTEXT: usize = 4;

impl Detokenizer {
    /// A detokenizer continuing after `prompt` (whose text is not emitted).
    pub fn new(prompt: &[u32]) -> Self {
        let tail = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
        Self {
            tokens: tail.to_vec(),
            prefix: 0,
            read: tail.len(),
        }
    }

    /// Adds one token; returns the text that became complete (often empty).
    pub fn push<E>(
        &mut self,
        token: u32,
        decode: impl Fn(&[u32]) -> Result<String, E>,
    ) -> Result<String, E> {
        self.tokens.push(token);
        let before = decode(&self.tokens[self.prefix..self.read])?;
        let after = decode(&self.tokens[self.prefix..])?;
        if after.ends_with('\u{FFFD}') || after.len() <= before.len() {
            return Ok(String::new());
        }
        let delta = match after.strip_prefix(before.as_str()) {
            Some(rest) => rest.to_string(),
            // The context decoded differently once extended: emit from the first differing char.
            None => {
                let common = before
                    .char_indices()
                    .zip(after.chars())
                    .find(|((_, a), b)| a != b)
                    .map_or(before.len(), |((i, _), _)| i);
                after[common..].to_string()
            }
        };
        self.prefix = self.read;
        self.read = self.tokens.len();
        self.compact();
        Ok(delta)
    }

    /// The text of tokens not yet emitted (called when the stream ends).
    pub fn finish<E>(&mut self, decode: impl Fn(&[u32]) -> Result<String, E>) -> Result<String, E> {
        let before = decode(&self.tokens[self.prefix..self.read])?;
        let after = decode(&self.tokens[self.prefix..])?;
        self.prefix = self.tokens.len();
        self.read = self.tokens.len();
        Ok(after.get(before.len()..).unwrap_or_default().to_string())
    }

    /// Drops tokens that will never be decoded again, so memory stays bounded.
    fn compact(&mut self) {
        if self.prefix > 64 {
            self.tokens.drain(..self.prefix);
            self.read -= self.prefix;
            self.prefix = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy byte-level vocabulary: token i < 256 is byte i.
    fn decode(ids: &[u32]) -> Result<String, ()> {
        let bytes: Vec<u8> = ids.iter().map(|t| *t as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn stream(prompt: &str, text: &str) -> Vec<String> {
        let prompt: Vec<u32> = prompt.bytes().map(u32::from).collect();
        let mut d = Detokenizer::new(&prompt);
        let mut out: Vec<String> = text
            .bytes()
            .map(|b| d.push(u32::from(b), decode).unwrap())
            .collect();
        out.push(d.finish(decode).unwrap());
        out
    }

    #[test]
    fn ascii_streams_token_by_token() {
        let out = stream("Hi", "abc");
        assert_eq!(out, vec!["a", "b", "c", ""]);
    }

    #[test]
    fn multibyte_characters_wait_until_complete() {
        let out = stream("", "é€!");
        assert_eq!(out.concat(), "é€!");
        assert_eq!(out[0], "", "first byte of é alone is incomplete");
        assert_eq!(out[1], "é");
        assert_eq!(out[4], "€");
    }

    #[test]
    fn long_streams_stay_bounded_and_exact() {
        let text: String = "naïve café ".repeat(50);
        let out = stream("x", &text);
        assert_eq!(out.concat(), text);
    }

    #[test]
    fn an_unfinished_tail_is_flushed_at_the_end() {
        let prompt: Vec<u32> = vec![];
        let mut d = Detokenizer::new(&prompt);
        assert_eq!(d.push(0xC3, decode).unwrap(), "");
        assert_eq!(d.finish(decode).unwrap(), "\u{FFFD}");
    }
}
