//! Tokenizers: a `tokenizers::Tokenizer` rebuilt from GGUF metadata or read from a Hugging Face
//! `tokenizer.json` (see [`crate::hf`]), plus the special token ids and chat template that come
//! with it. [`Tokenizer::load`] picks the source by path.
//!
//! Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is supported. For the SmolLM/StarCoder
//! family (`tokenizer.ggml.pre` = `smollm`, `starcoder`, `refact`) the pre-tokenizer splits every
//! digit into its own piece, then applies GPT-2's byte-level split; for Qwen2 (`qwen2`) the text
//! is split by Qwen2's own regex (`QWEN2_SPLIT`, digits one by one too) and then mapped to
//! byte-level symbols without a further split; `gpt2`/absent means GPT-2's split alone; any other
//! pre-tokenizer is refused by name rather than guessed. Control and user-defined tokens (types 3
//! and 4) are added as special tokens so they match as a whole in text such as chat templates.

use crate::chat::{self, ChatMessage};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::grammar::{GrammarCompiler, GrammarError};
use crate::tools::{tool_json, Tool, ToolFormat};
use std::sync::{Arc, OnceLock};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::byte_level::ByteLevel as ByteLevelProcessor;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

/// GGUF token type of control tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF token type of user-defined tokens.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Qwen2's pre-tokenizer split (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2`, the `Split` of Hugging
/// Face's Qwen2 `tokenizer.json` with its `(?i:...)` contractions spelled out): contractions,
/// letter runs with at most one leading non-letter, single digits, punctuation runs with an
/// optional leading space and trailing newlines, then whitespace runs.
const QWEN2_SPLIT: &str = concat!(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
    r"|[^\r\n\p{L}\p{N}]?\p{L}+",
    r"|\p{N}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// A text tokenizer with the model's special tokens and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    /// Every end-of-generation id, `eos` first.
    eos_ids: Vec<u32>,
    add_bos: bool,
    chat_template: Option<String>,
    /// The constraint compiler of this vocabulary, built on first use.
    grammars: OnceLock<std::result::Result<Arc<GrammarCompiler>, GrammarError>>,
}

/// What [`Tokenizer::from_parts`] assembles.
pub(crate) struct TokenizerParts {
    pub inner: tokenizers::Tokenizer,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Further end-of-generation ids (duplicates and `eos` itself are dropped).
    pub extra_eos: Vec<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

impl Tokenizer {
    /// Loads the tokenizer of a model path: a Hugging Face model directory
    /// ([`Tokenizer::from_hf_dir`]) or a GGUF file ([`Tokenizer::from_gguf`]).
    pub fn load(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            Self::from_hf_dir(path)
        } else {
            Self::from_gguf(&GgufFile::open(path)?)
        }
    }

    pub(crate) fn from_parts(parts: TokenizerParts) -> Self {
        let mut eos_ids: Vec<u32> = parts.eos.into_iter().collect();
        for id in parts.extra_eos {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        Self {
            inner: parts.inner,
            bos: parts.bos,
            eos: parts.eos.or(eos_ids.first().copied()),
            eos_ids,
            add_bos: parts.add_bos,
            chat_template: parts.chat_template,
            grammars: OnceLock::new(),
        }
    }

    /// Rebuilds the tokenizer stored in a GGUF file's metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file.require_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(Error::Tokenizer(format!(
                "tokenizer.ggml.model `{model}` is not supported (only byte-level BPE, `gpt2`)"
            )));
        }
        let tokens = file.require_str_array("tokenizer.ggml.tokens")?;
        let merges = file
            .require_str_array("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::Tokenizer(format!("merge `{m}` has no space")))
            })
            .collect::<Result<Vec<_>>>()?;
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| Error::Tokenizer(format!("building BPE: {e}")))?;

        let pre = file
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let pre_tokenizer = pre_tokenizer(pre)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner
            .with_pre_tokenizer(Some(pre_tokenizer))
            .with_decoder(Some(ByteLevelDecoder::default()))
            .with_post_processor(Some(ByteLevelProcessor::new(false, false, true)));

        let special: Vec<AddedToken> = match file.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(types) => {
                let types = types.as_array().ok_or_else(|| {
                    Error::Tokenizer("tokenizer.ggml.token_type is not an array".into())
                })?;
                if types.len() != tokens.len() {
                    return Err(Error::Tokenizer(format!(
                        "{} token types for {} tokens",
                        types.len(),
                        tokens.len()
                    )));
                }
                tokens
                    .iter()
                    .zip(types)
                    .filter(|(_, ty)| {
                        matches!(
                            ty.as_i64(),
                            Some(TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED)
                        )
                    })
                    .map(|(t, _)| AddedToken::from(t.to_string(), true))
                    .collect()
            }
        };
        inner
            .add_special_tokens(special)
            .map_err(|e| Error::Tokenizer(format!("adding special tokens: {e}")))?;

        let id = |key: &str| -> Result<Option<u32>> {
            match file.get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .filter(|&i| (i as usize) < tokens.len())
                    .map(|i| Some(i as u32))
                    .ok_or_else(|| Error::Tokenizer(format!("{key} = {v} is not a token id"))),
            }
        };
        Ok(Self::from_parts(TokenizerParts {
            inner,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            extra_eos: Vec::new(),
            add_bos: file
                .get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            chat_template: file
                .get("tokenizer.chat_template")
                .and_then(|v| v.as_str())
                .map(str::to_string),
        }))
    }

    /// Encodes text. Special tokens written in the text (`<|im_start|>`) become their ids;
    /// with `add_special`, a BOS token is prepended when the model asks for one.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(format!("encoding: {e}")))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text, dropping special tokens when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| Error::Tokenizer(format!("decoding: {e}")))
    }

    /// Vocabulary size, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Beginning-of-sequence token.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos
    }

    /// Every token that ends generation: the EOS token first, then (Hugging Face models) the
    /// other ids of `generation_config.json`'s `eos_token_id` list, such as ChatML's
    /// `<|im_end|>` next to `<|endoftext|>`.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether [`Tokenizer::encode`] with `add_special` prepends the BOS token.
    pub fn adds_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// The token id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The model's chat template (Jinja source), if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders a conversation with the model's chat template; with `add_generation_prompt`,
    /// ends with the header of the assistant's turn.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_chat_with_tools(messages, &[], add_generation_prompt)
    }

    /// Renders a conversation whose model may call `tools`: the template gets them as `tools`;
    /// a template that never renders `tools` gets them in the system message instead, in the
    /// Hermes call format ([`ToolFormat::preamble`]).
    pub fn render_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::ChatTemplate("the model has no chat template".into()))?;
        let token = |id: Option<u32>| {
            id.and_then(|i| self.inner.id_to_token(i))
                .unwrap_or_default()
        };
        let (bos, eos) = (token(self.bos), token(self.eos));
        let mut options = chat::RenderOptions {
            add_generation_prompt,
            bos_token: &bos,
            eos_token: &eos,
            tools: None,
        };
        if tools.is_empty() {
            return chat::render_with(template, messages, options);
        }
        if !ToolFormat::template_shows_tools(Some(template)) {
            let preamble = ToolFormat::preamble(tools);
            let mut with = messages.to_vec();
            match with.first_mut() {
                Some(first) if first.role == "system" => {
                    first.content = format!("{}\n\n{preamble}", first.content);
                }
                _ => with.insert(0, ChatMessage::new("system", preamble)),
            }
            return chat::render_with(template, &with, options);
        }
        let listed = serde_json::Value::Array(tools.iter().map(tool_json).collect());
        options.tools = Some(&listed);
        chat::render_with(template, messages, options)
    }

    /// The compiler of structured-output constraints for this vocabulary, built on first use
    /// (the token trie takes tens of milliseconds) and shared from then on.
    pub fn grammars(&self) -> std::result::Result<&Arc<GrammarCompiler>, GrammarError> {
        self.grammars
            .get_or_init(|| GrammarCompiler::new(self).map(Arc::new))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Builds [`grammars`](Self::grammars) on a thread of its own, so that the first
    /// constrained request does not wait for the token trie (half a second for a 49K
    /// vocabulary) on a serving thread.
    pub fn warm_grammars(self: &Arc<Self>) {
        let tokenizer = Arc::clone(self);
        let _ = std::thread::Builder::new()
            .name("grammar-warm".into())
            .spawn(move || {
                // On failure constrained requests are refused with the reason; the rest is served.
                let _ = tokenizer.grammars();
            });
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The pre-tokenizer named by `tokenizer.ggml.pre` (`default` when absent); unknown names are
/// refused so that text is never split in a way the model was not trained on.
fn pre_tokenizer(pre: &str) -> Result<Sequence> {
    // GPT-2's split, then bytes mapped to their byte-level symbols.
    let gpt2 = || ByteLevel::new(false, true, true);
    Ok(match pre {
        // Digits one by one, then GPT-2's split (SmolLM, StarCoder, Refact).
        "smollm" | "starcoder" | "refact" => {
            Sequence::new(vec![Digits::new(true).into(), gpt2().into()])
        }
        // Qwen2's regex (digits one by one as well), then only the byte-level mapping.
        "qwen2" => {
            let split = Split::new(
                SplitPattern::Regex(QWEN2_SPLIT.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| Error::Tokenizer(format!("building the qwen2 split regex: {e}")))?;
            Sequence::new(vec![
                split.into(),
                ByteLevel::new(false, false, false).into(),
            ])
        }
        "gpt2" | "default" => Sequence::new(vec![gpt2().into()]),
        other => {
            return Err(Error::Tokenizer(format!(
                "pre-tokenizer `{other}` (tokenizer.ggml.pre) is not supported \
                 (supported: smollm, starcoder, refact, qwen2, gpt2, default)"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufBuilder, Value};
    #[test]
    fn tokenizer_refuses_unknown_pre_tokenizers() {
        let tokens = ["a", "b", "ab"].map(|t| Value::String(t.into())).to_vec();
        let base = || {
            GgufBuilder::new()
                .meta("tokenizer.ggml.model", Value::String("gpt2".into()))
                .meta("tokenizer.ggml.tokens", Value::Array(tokens.clone()))
                .meta(
                    "tokenizer.ggml.merges",
                    Value::Array(vec![Value::String("a b".into())]),
                )
        };
        let file = GgufFile::from_bytes(base().build()).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        assert_eq!(tok.encode("ab", false).unwrap(), [2]);
        let file = GgufFile::from_bytes(
            base()
                .meta("tokenizer.ggml.pre", Value::String("llama-bpe".into()))
                .build(),
        )
        .unwrap();
        let e = Tokenizer::from_gguf(&file).err().unwrap();
        assert!(e.to_string().contains("llama-bpe"), "{e}");
    }

    /// A GGUF tokenizer whose vocabulary is the 256 byte-level symbols (sorted) plus `extra`
    /// tokens, with `merges`, pre-tokenizer `pre`.
    fn byte_level_tokenizer(pre: &str, extra: &[&str], merges: &[&str]) -> Tokenizer {
        let mut symbols: Vec<String> = ByteLevel::alphabet()
            .into_iter()
            .map(String::from)
            .collect();
        symbols.sort();
        symbols.extend(extra.iter().map(|t| t.to_string()));
        let str_array =
            |items: Vec<String>| Value::Array(items.into_iter().map(Value::String).collect());
        let image = GgufBuilder::new()
            .meta("tokenizer.ggml.model", Value::String("gpt2".into()))
            .meta("tokenizer.ggml.pre", Value::String(pre.into()))
            .meta("tokenizer.ggml.tokens", str_array(symbols))
            .meta(
                "tokenizer.ggml.merges",
                str_array(merges.iter().map(|m| m.to_string()).collect()),
            )
            .build();
        Tokenizer::from_gguf(&GgufFile::from_bytes(image).unwrap()).unwrap()
    }

    /// The pieces of `text` (as slices of the original text) after the pre-tokenizer.
    fn pieces<'t>(tok: &Tokenizer, text: &'t str) -> Vec<&'t str> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let mut pts = PreTokenizedString::from(text);
        let pre = tok.inner().get_pre_tokenizer().unwrap();
        pre.pre_tokenize(&mut pts).unwrap();
        pts.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, (a, b), _)| &text[a..b])
            .collect()
    }

    /// The qwen2 split of a text with contractions, a digit run, currency, newlines (LF, CRLF,
    /// blank lines), tabs, trailing spaces, CJK with a full-width comma and accented words.
    /// Expected pieces from Python's `regex` module (2026.5.9) with the pattern of
    /// [`QWEN2_SPLIT`]: `regex.findall(PAT, TEXT)`.
    #[test]
    fn qwen2_splits_like_the_reference_regex() {
        const TEXT: &str =
            "I'm sure it's 12345 THEY'LL pay £3.50!\n\n  def f(x):\r\n\treturn x  \n\
                            你好，世界 café naïve Ünïcödé";
        const WANT: [&str; 33] = [
            "I",
            "'m",
            " sure",
            " it",
            "'s",
            " ",
            "1",
            "2",
            "3",
            "4",
            "5",
            " THEY",
            "'LL",
            " pay",
            " £",
            "3",
            ".",
            "5",
            "0",
            "!\n\n",
            " ",
            " def",
            " f",
            "(x",
            "):\r\n",
            "\treturn",
            " x",
            "  \n",
            "你好",
            "，世界",
            " café",
            " naïve",
            " Ünïcödé",
        ];
        let tok = byte_level_tokenizer("qwen2", &[], &[]);
        assert_eq!(pieces(&tok, TEXT), WANT);
        // Every byte becomes one byte-level symbol and decodes back to the text.
        let ids = tok.encode(TEXT, false).unwrap();
        assert_eq!(ids.len(), TEXT.len());
        assert_eq!(tok.decode(&ids, false).unwrap(), TEXT);
    }

    /// Merges never cross qwen2's pieces: with a `1 2` merge in the vocabulary, GPT-2's split
    /// keeps "12" together and merges it, qwen2's splits the digits apart first.
    #[test]
    fn qwen2_keeps_digits_apart_where_gpt2_merges_them() {
        let merges = ["1 2", "a b"];
        let qwen2 = byte_level_tokenizer("qwen2", &["12", "ab"], &merges);
        let gpt2 = byte_level_tokenizer("gpt2", &["12", "ab"], &merges);
        let id = |t: &Tokenizer, s: &str| t.token_to_id(s).unwrap();
        assert_eq!(
            qwen2.encode("ab12", false).unwrap(),
            [id(&qwen2, "ab"), id(&qwen2, "1"), id(&qwen2, "2")]
        );
        assert_eq!(
            gpt2.encode("ab12", false).unwrap(),
            [id(&gpt2, "ab"), id(&gpt2, "12")]
        );
    }
}
