//! [`Tokenizer`] from a Hugging Face model directory.
//!
//! * `tokenizer.json` (required): the `tokenizers` pipeline as saved by `transformers`.
//! * `tokenizer_config.json`: `bos_token` / `eos_token` (strings or `AddedToken` objects),
//!   `add_bos_token`, `chat_template` (a string, or a list of named templates: `default` is
//!   used). When this file is absent, the BOS/EOS ids come from `generation_config.json`, then
//!   `config.json`.
//! * `chat_template.jinja`: overrides `tokenizer_config.json`'s template, as in `transformers`.
//! * `generation_config.json` (else `config.json`): `eos_token_id`, a number or a list; every
//!   id becomes an end-of-generation token ([`Tokenizer::eos_token_ids`]).
//!
//! Whether encoding with special tokens prepends BOS is `add_bos_token` when given, else what
//! `tokenizer.json`'s post-processor does (a `TemplateProcessing` that starts with BOS, as in
//! Llama 3, says yes).

use super::checkpoint::read_json;
use crate::error::{Error, Result};
use crate::tokenizer::{Tokenizer, TokenizerParts};
use serde_json::Value;
use std::path::Path;

impl Tokenizer {
    /// Loads the tokenizer of a Hugging Face model directory.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let tokenizer_config = read_optional_json(&dir.join("tokenizer_config.json"))?;
        let generation_config = read_optional_json(&dir.join("generation_config.json"))?;
        let model_config = read_optional_json(&dir.join("config.json"))?;
        let vocab = inner.get_vocab_size(true);

        // Ids given as numbers: generation_config.json first, then config.json.
        let ids_of = |key: &str| -> Result<Vec<u32>> {
            for (file, json) in [
                ("generation_config.json", &generation_config),
                ("config.json", &model_config),
            ] {
                if let Some(v) = json.as_ref().and_then(|j| j.get(key)) {
                    if !v.is_null() {
                        return token_ids(v, vocab)
                            .map_err(|e| Error::Tokenizer(format!("{file}: {key} {v} {e}")));
                    }
                }
            }
            Ok(Vec::new())
        };
        let (bos, eos) = match &tokenizer_config {
            Some(tc) => (
                special_token(tc, "bos_token", &inner)?,
                special_token(tc, "eos_token", &inner)?,
            ),
            None => (
                ids_of("bos_token_id")?.first().copied(),
                ids_of("eos_token_id")?.first().copied(),
            ),
        };
        let add_bos = match tokenizer_config
            .as_ref()
            .and_then(|tc| tc.get("add_bos_token"))
        {
            Some(Value::Bool(b)) => *b,
            _ => post_processor_adds(&inner, bos)?,
        };
        let chat_template = chat_template(dir, tokenizer_config.as_ref())?;
        Ok(Self::from_parts(TokenizerParts {
            inner,
            bos,
            eos,
            extra_eos: ids_of("eos_token_id")?,
            add_bos,
            chat_template,
        }))
    }
}

/// A JSON file that may be absent.
fn read_optional_json(path: &Path) -> Result<Option<Value>> {
    if path.is_file() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// A number or a list of numbers, each a token id below `vocab`.
fn token_ids(v: &Value, vocab: usize) -> std::result::Result<Vec<u32>, String> {
    let one = |x: &Value| {
        x.as_u64()
            .filter(|&i| (i as usize) < vocab)
            .map(|i| i as u32)
            .ok_or_else(|| format!("is not a token id below the vocabulary size {vocab}"))
    };
    match v {
        Value::Array(list) => list.iter().map(one).collect(),
        other => Ok(vec![one(other)?]),
    }
}

/// The id of `tokenizer_config.json`'s `key` token (a string or an `AddedToken` object with
/// `content`); `None` when absent or null.
fn special_token(tc: &Value, key: &str, inner: &tokenizers::Tokenizer) -> Result<Option<u32>> {
    let content = match tc.get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s.as_str(),
        Some(v) => v.get("content").and_then(Value::as_str).ok_or_else(|| {
            Error::Tokenizer(format!(
                "tokenizer_config.json: {key} should be a string or have a `content`, found {v}"
            ))
        })?,
    };
    inner.token_to_id(content).map(Some).ok_or_else(|| {
        Error::Tokenizer(format!(
            "tokenizer_config.json: {key} `{content}` is not in tokenizer.json's vocabulary"
        ))
    })
}

/// Whether `tokenizer.json`'s post-processor puts BOS first when adding special tokens.
fn post_processor_adds(inner: &tokenizers::Tokenizer, bos: Option<u32>) -> Result<bool> {
    let Some(bos) = bos else { return Ok(false) };
    let enc = inner
        .encode("", true)
        .map_err(|e| Error::Tokenizer(format!("probing the post-processor: {e}")))?;
    Ok(enc.get_ids().first() == Some(&bos))
}

/// The chat template: `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`
/// (a string, or the one named `default` in a list of `{name, template}`).
fn chat_template(dir: &Path, tc: Option<&Value>) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|source| Error::Io {
                path: jinja,
                source,
            });
    }
    match tc.and_then(|tc| tc.get("chat_template")) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => Ok(list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string)),
        Some(v) => Err(Error::Tokenizer(format!(
            "tokenizer_config.json: chat_template should be a string or a list, found {v}"
        ))),
    }
}
