//! Constrained decoding (structured outputs): a [`Constraint`] a request gives (any JSON object,
//! a JSON Schema, a regular expression or a Lark grammar) compiled by llguidance into a matcher
//! that says, before each token, which tokens may come next. The sampler sets every other
//! token's logit to −∞ ([`Grammar::mask`]), so the output always parses.
//!
//! A [`GrammarCompiler`] is built once per tokenizer ([`Tokenizer::grammars`]): the token trie
//! of the vocabulary and llguidance's parser factory, plus a small thread pool of its own.
//! Masks are computed on that pool, not on the engine's thread: after a token is sampled the
//! matcher consumes it and computes the next mask in the background while the next forward
//! pass runs, and the sampler waits for it only when that step's logits are ready
//! ([`Grammar::advance`]). A batch's unconstrained sequences never wait for a mask; a
//! constrained one waits only if its mask took longer than the forward pass.
//!
//! JSON is generated compactly (`", "` and `": "` separators, no free whitespace): a small model
//! given free whitespace can fill `max_tokens` with newlines. A schema's own `x-guidance`
//! options take precedence.

mod tokens;

use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};

use crate::tokenizer::Tokenizer;

/// Most bytes of a schema, regular expression or grammar.
pub const MAX_CONSTRAINT_BYTES: usize = 64 * 1024;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {type: "json_object"}`).
    JsonObject,
    /// A JSON Schema, as JSON text.
    JsonSchema(String),
    /// A regular expression the whole output matches (Rust `regex` syntax).
    Regex(String),
    /// A grammar in llguidance's Lark dialect (it may embed JSON schemas with `%json`).
    Lark(String),
}

impl Constraint {
    /// The constraint's source text (empty for [`Constraint::JsonObject`]).
    pub fn source(&self) -> &str {
        match self {
            Constraint::JsonObject => "",
            Constraint::JsonSchema(s) | Constraint::Regex(s) | Constraint::Lark(s) => s,
        }
    }

    /// What kind of constraint this is, as users name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonObject => "json_object",
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "lark",
        }
    }

    /// The llguidance grammar of this constraint.
    fn grammar(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            Constraint::JsonSchema(text) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| format!("the schema is not valid JSON: {e}"))?;
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err("the schema must be a JSON object (or true/false)".into());
                }
                TopLevelGrammar::from_json_schema(compact(schema))
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// `schema` with compact separators and no free whitespace, unless it sets its own.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(map) = schema.as_object_mut() {
        map.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// A constraint that cannot be compiled: what was wrong, in llguidance's words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// Compiles constraints for one tokenizer's vocabulary and computes their masks.
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// Every end-of-generation id: when the grammar allows the first, it allows them all.
    eos: Vec<u32>,
    pool: rayon::ThreadPool,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.factory.tok_env().tok_trie().vocab_size())
            .field("eos", &self.eos)
            .finish()
    }
}

impl GrammarCompiler {
    /// The compiler of `tokenizer`'s vocabulary (byte-level BPE or byte-fallback tokenizers).
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, GrammarError> {
        let env: TokEnv = Arc::new(tokens::TokenEnv::new(tokenizer)?);
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| GrammarError(format!("building the token trie: {e}")))?;
        // Errors reach the request that caused them; nothing goes to stderr.
        factory.quiet();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get() / 2)
            .clamp(1, 4);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("grammar-{i}"))
            .build()
            .map_err(|e| GrammarError(format!("starting the grammar threads: {e}")))?;
        Ok(Self {
            factory,
            eos: tokenizer.eos_token_ids().to_vec(),
            pool,
        })
    }

    /// Compiles `constraint` into a fresh matcher, at the start of the output. Compiling is
    /// what checks a constraint: a schema that is not JSON Schema, an unsupported keyword, a
    /// regular expression or grammar that does not parse, or one that matches nothing.
    pub fn compile(&self, constraint: &Constraint) -> Result<Matcher, GrammarError> {
        if constraint.source().len() > MAX_CONSTRAINT_BYTES {
            return Err(GrammarError(format!(
                "the {} is {} bytes, more than the {MAX_CONSTRAINT_BYTES} allowed",
                constraint.kind(),
                constraint.source().len()
            )));
        }
        let grammar = constraint.grammar().map_err(GrammarError)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError(e.to_string()))?;
        let mut matcher = Matcher::new(Ok(parser));
        // A grammar that matches nothing is refused here, not at the first token.
        let mask = matcher
            .compute_mask()
            .map_err(|e| GrammarError(e.to_string()))?;
        if mask.is_zero() && !matcher.is_accepting().unwrap_or(false) {
            return Err(GrammarError(format!(
                "the {} matches no output",
                constraint.kind()
            )));
        }
        Ok(matcher)
    }

    /// Checks `constraint` and says how long compiling it took.
    pub fn check(&self, constraint: &Constraint) -> Result<Duration, GrammarError> {
        let started = Instant::now();
        self.compile(constraint)?;
        Ok(started.elapsed())
    }
}

/// What a background mask job sends back: the matcher, advanced, and the mask of its next
/// token (or why there is none).
type MaskJob = (Option<Matcher>, Result<SimpleVob, String>);

/// One sequence's constraint as sampling goes: a matcher and the mask of its next token, being
/// computed in the background between [`advance`](Self::advance) and [`mask`](Self::mask).
pub struct Grammar {
    compiler: Arc<GrammarCompiler>,
    pending: Option<Receiver<MaskJob>>,
    matcher: Option<Matcher>,
    /// Why the constraint failed mid-output; the sequence then ends.
    error: Option<String>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("pending", &self.pending.is_some())
            .field("error", &self.error)
            .finish()
    }
}

impl Grammar {
    /// Starts `constraint` after `generated` tokens of output (none for a new request; the
    /// first token when a decode worker takes over from a prefill worker): compiling, replaying
    /// those tokens and computing the first mask all happen in the background.
    pub fn start(
        compiler: Arc<GrammarCompiler>,
        constraint: Constraint,
        generated: &[u32],
    ) -> Self {
        let (tx, rx) = mpsc::sync_channel(1);
        let generated = generated.to_vec();
        let job = Arc::clone(&compiler);
        compiler.pool.spawn(move || {
            let result = match job.compile(&constraint) {
                Ok(mut matcher) => {
                    let mask = matcher
                        .consume_tokens(&generated)
                        .and_then(|()| matcher.compute_mask_or_eos())
                        .map_err(|e| e.to_string());
                    (Some(matcher), mask)
                }
                Err(e) => (None, Err(e.0)),
            };
            let _ = tx.send(result);
        });
        Self {
            compiler,
            pending: Some(rx),
            matcher: None,
            error: None,
        }
    }

    /// Why the constraint failed, if it did: the output so far is all there is.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// Sets the logit of every token the constraint does not allow next to −∞, waiting for
    /// the mask if it is still being computed. After a failure only end-of-sequence is allowed.
    pub fn mask(&mut self, logits: &mut [f32]) {
        let job = self.pending.take().map(|rx| rx.recv());
        let mask = match job {
            Some(Ok((matcher, Ok(mask)))) => {
                self.matcher = matcher;
                Some(mask)
            }
            Some(Ok((matcher, Err(e)))) => {
                self.matcher = matcher;
                self.error.get_or_insert(e);
                None
            }
            Some(Err(_)) => {
                self.error
                    .get_or_insert_with(|| "the grammar thread stopped".into());
                None
            }
            None => {
                self.error
                    .get_or_insert_with(|| "no mask was computed for this token".into());
                None
            }
        };
        let eos = &self.compiler.eos;
        let eos_allowed = mask
            .as_ref()
            .is_none_or(|m| eos.first().is_some_and(|&t| m.is_allowed(t)));
        for (token, x) in logits.iter_mut().enumerate() {
            let t = token as u32;
            let allowed = match &mask {
                Some(m) => {
                    (token < m.len() && m.is_allowed(t)) || (eos_allowed && eos.contains(&t))
                }
                None => eos.contains(&t),
            };
            if !allowed {
                *x = f32::NEG_INFINITY;
            }
        }
    }

    /// Feeds the sampled `token` to the matcher and starts computing the next mask. An
    /// end-of-sequence token ends the output: nothing more is computed.
    pub fn advance(&mut self, token: u32) {
        if self.error.is_some() || self.compiler.eos.contains(&token) {
            return;
        }
        let Some(mut matcher) = self.matcher.take() else {
            return;
        };
        let (tx, rx) = mpsc::sync_channel(1);
        self.compiler.pool.spawn(move || {
            let mask = matcher
                .consume_token(token)
                .and_then(|()| matcher.compute_mask_or_eos())
                .map_err(|e| e.to_string());
            let _ = tx.send((Some(matcher), mask));
        });
        self.pending = Some(rx);
    }
}

#[cfg(test)]
mod tests;
