//! `nibble generate`: one request through the serving [`Engine`], its text streamed to stdout.
//!
//! Every flag is checked before the weights load (sampling ranges, the calibration file, the KV
//! budget). The engine runs the request's prompt (chunked prefill) and then decodes; each text
//! delta is written and flushed as soon as a step produces it, and the text ends with a newline.
//! Stderr gets one summary line (token counts, finish reason, prefill and decode speed) and, with
//! `--logprobs`, one JSON line `{"logprobs":[{"token":ID,"text":"...","logprob":X},...]}`.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nibble_engine::scheduler::{FinishReason, SchedulerConfig, SeqId};
use nibble_engine::{Backend, ChatMessage, Engine, EngineConfig, Event, Tokenizer, Usage};
use serde::Serialize;

use crate::cli::GenerateArgs;
use crate::load::Opened;
use crate::{Error, Result};

/// Bytes in the unit of `--kv-budget-mib`.
const MIB: usize = 1 << 20;

/// One generated token and its log-probability.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    /// The token decoded alone (special tokens kept).
    pub text: String,
    pub logprob: f32,
}

/// What one generation produced besides its text.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub usage: Usage,
    pub reason: FinishReason,
    /// From the first step to the first token: the prompt's prefill.
    pub prefill: Duration,
    /// From the first token to the end: every later token.
    pub decode: Duration,
    /// Per token, with `--logprobs`.
    pub logprobs: Vec<TokenLogprob>,
}

impl Summary {
    /// The one-line report printed on stderr.
    pub fn line(&self) -> String {
        let u = &self.usage;
        let prefilled = u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens);
        let decoded = u.completion_tokens.saturating_sub(1);
        format!(
            "prompt {} tokens ({} cached), completion {} tokens, finish {}; \
             prefill {prefilled} tokens in {:.2} s ({}), decode {decoded} tokens in {:.2} s ({})",
            u.prompt_tokens,
            u.cached_tokens,
            u.completion_tokens,
            reason_name(self.reason),
            self.prefill.as_secs_f64(),
            rate(prefilled, self.prefill),
            self.decode.as_secs_f64(),
            rate(decoded, self.decode),
        )
    }
}

fn rate(tokens: usize, time: Duration) -> String {
    if tokens == 0 || time.is_zero() {
        "- tok/s".into()
    } else {
        format!("{:.1} tok/s", tokens as f64 / time.as_secs_f64())
    }
}

/// `length`, `stop`, `aborted`: the reason as OpenAI-style APIs spell it.
fn reason_name(reason: FinishReason) -> String {
    format!("{reason:?}").to_lowercase()
}

/// The prompt's token ids: the text as given (with the model's BOS when it asks for one), or
/// rendered by the chat template (which writes its own special tokens).
fn prompt_tokens(tokenizer: &Tokenizer, args: &GenerateArgs) -> Result<Vec<u32>> {
    if !args.chat {
        return Ok(tokenizer.encode(&args.prompt, true)?);
    }
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(ChatMessage::new("system", system.as_str()));
    }
    messages.push(ChatMessage::new("user", args.prompt.as_str()));
    let text = tokenizer.render_chat(&messages, true)?;
    Ok(tokenizer.encode(&text, false)?)
}

/// Runs `nibble generate`: text to `out`, the summary (and logprobs) to `diag`.
pub fn run(args: &GenerateArgs, out: &mut impl Write, diag: &mut impl Write) -> Result<()> {
    let params = args.sampling.params()?;
    let budget = args
        .kv_budget_mib
        .checked_mul(MIB)
        .ok_or_else(|| Error::Flag {
            flag: "--kv-budget-mib",
            reason: format!("{} MiB does not fit in memory", args.kv_budget_mib),
        })?;
    let opened = Opened::open(&args.model)?;
    let kv = opened.kv_config(args.kv_dtype, &args.quant)?;
    let prompt = prompt_tokens(opened.tokenizer(), args)?;
    let (model, tokenizer) = opened.load(Some(&kv))?;
    let config = EngineConfig {
        kv,
        kv_budget_bytes: budget,
        scheduler: SchedulerConfig::default(),
    };
    let tokenizer = Arc::new(tokenizer);
    let summary = crate::with_model!(model, |model| {
        let mut engine = Engine::new(model, tokenizer, config)?;
        engine.submit(SeqId(0), prompt, params)?;
        stream(&mut engine, out)?
    });
    writeln!(diag, "{}", summary.line()).map_err(Error::Stderr)?;
    if args.sampling.logprobs {
        let json = serde_json::json!({ "logprobs": summary.logprobs });
        writeln!(diag, "{json}").map_err(Error::Stderr)?;
    }
    Ok(())
}

/// Steps `engine` until its one request finishes, writing text as it comes.
pub fn stream<B: Backend>(engine: &mut Engine<B>, out: &mut impl Write) -> Result<Summary> {
    let mut write = |text: &str| -> Result<()> {
        out.write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .map_err(Error::Stdout)
    };
    let start = Instant::now();
    let mut first_token: Option<Instant> = None;
    let mut logprobs = Vec::new();
    let tokenizer = Arc::clone(engine.tokenizer());
    while engine.has_work() {
        for event in engine.step() {
            // A plain request yields only these two; `Prefilled` belongs to prefill-only
            // (disaggregated) requests, which this command never submits.
            if let Event::Token {
                token,
                logprobs: computed,
                text,
                ..
            } = event
            {
                first_token.get_or_insert_with(Instant::now);
                if let Some(computed) = computed {
                    logprobs.push(TokenLogprob {
                        token,
                        text: tokenizer.decode(&[token], false)?,
                        logprob: computed.logprob,
                    });
                }
                write(&text)?;
            } else if let Event::Finished {
                reason,
                text,
                usage,
                error,
                ..
            } = event
            {
                write(&text)?;
                write("\n")?;
                if let Some(error) = error {
                    return Err(Error::Generation(error.to_string()));
                }
                let end = Instant::now();
                let first = first_token.unwrap_or(end);
                return Ok(Summary {
                    usage,
                    reason,
                    prefill: first - start,
                    decode: end - first,
                    logprobs,
                });
            }
        }
    }
    Err(Error::Generation(
        "the engine went idle before the request finished".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_is_one_line_with_rates() {
        let s = Summary {
            usage: Usage {
                prompt_tokens: 10,
                completion_tokens: 5,
                cached_tokens: 2,
            },
            reason: FinishReason::Length,
            prefill: Duration::from_millis(100),
            decode: Duration::from_millis(200),
            logprobs: Vec::new(),
        };
        let line = s.line();
        assert_eq!(
            line,
            "prompt 10 tokens (2 cached), completion 5 tokens, finish length; \
             prefill 8 tokens in 0.10 s (80.0 tok/s), decode 4 tokens in 0.20 s (20.0 tok/s)"
        );
    }

    #[test]
    fn empty_phases_have_no_rate() {
        let s = Summary {
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 1,
                cached_tokens: 0,
            },
            reason: FinishReason::Stop,
            prefill: Duration::from_millis(10),
            decode: Duration::ZERO,
            logprobs: Vec::new(),
        };
        assert!(
            s.line().ends_with("decode 0 tokens in 0.00 s (- tok/s)"),
            "{}",
            s.line()
        );
        assert!(s.line().contains("finish stop"));
    }
}
