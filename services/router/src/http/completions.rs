//! `POST /v1/completions`: a text (or token-id) prompt completed as is.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use nibble_proto::v1;
use nibble_proto::v1::generate_request::Prompt;
use serde::Deserialize;

use super::error::{ApiError, ParamNames};
use super::generate::{self, finish_reason, usage_json, ChunkFormat};
use super::params::{self, Common, Delivery};
use super::{read_body, with_request_id, HttpState};
use crate::service::state::MintedId;

/// OpenAI's default `max_tokens` for completions.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// Most alternatives per token `logprobs` may ask for (OpenAI's limit for completions).
pub const MAX_LOGPROBS: u32 = 5;

/// `prompt`: a string, a list of one string, token ids, or a list of one list of token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// The body of `POST /v1/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub common: Common,
    pub prompt: Option<PromptInput>,
    pub max_tokens: Option<u32>,
    /// Alternatives per token, 0 to [`MAX_LOGPROBS`]; set (even to 0) returns `logprobs`.
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
}

struct Parsed {
    request: v1::GenerateRequest,
    delivery: Delivery,
    /// Whether log-probabilities were asked for (`logprobs` set, even to 0).
    logprobs: bool,
    /// The parameters refusals name.
    names: ParamNames,
}

fn parse(body: CompletionRequest, served: &str, request_id: String) -> Result<Parsed, ApiError> {
    let c = &body.common;
    c.check_model(served)?;
    let delivery = c.delivery()?;
    if body.echo == Some(true) {
        return Err(ApiError::invalid("echo", "is not supported"));
    }
    if body.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "is not supported"));
    }
    if body.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid("best_of", "only best_of=1 is supported"));
    }
    if let Some(k) = body.logprobs.filter(|k| *k > MAX_LOGPROBS) {
        return Err(ApiError::invalid(
            "logprobs",
            format!("must be between 0 and {MAX_LOGPROBS}, got {k}"),
        ));
    }
    let one = |n: usize| {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::invalid(
                "prompt",
                format!("exactly one prompt is supported, got a batch of {n}"),
            ))
        }
    };
    let prompt = match body.prompt {
        None => return Err(ApiError::invalid("prompt", "is required")),
        Some(PromptInput::Text(text)) => Prompt::Text(text),
        Some(PromptInput::Tokens(ids)) => Prompt::Tokens(v1::TokenIds { ids }),
        Some(PromptInput::Texts(mut texts)) => {
            one(texts.len())?;
            Prompt::Text(texts.remove(0))
        }
        Some(PromptInput::TokenLists(mut lists)) => {
            one(lists.len())?;
            Prompt::Tokens(v1::TokenIds {
                ids: lists.remove(0),
            })
        }
    };
    let max_tokens = body.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let request = v1::GenerateRequest {
        request_id,
        model: served.to_string(),
        prompt: Some(prompt),
        add_special_tokens: None,
        sampling: Some(c.sampling()?),
        stopping: Some(c.stopping(Some(max_tokens))),
        logprobs: body.logprobs.map(|k| v1::LogprobsOptions {
            enabled: true,
            top_logprobs: k,
        }),
        skip_special_tokens: c.skip_special_tokens,
    };
    Ok(Parsed {
        request,
        delivery,
        logprobs: body.logprobs.is_some(),
        names: ParamNames {
            prompt: "prompt",
            max_tokens: "max_tokens",
            constraint: c.structured.param(),
        },
    })
}

/// The handler.
pub async fn completions(
    State(state): State<HttpState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let id = state.next_id("cmpl");
    let response = run(state, body, id.clone())
        .await
        .unwrap_or_else(IntoResponse::into_response);
    with_request_id(response, id.as_str())
}

async fn run(
    state: HttpState,
    body: Result<Bytes, BytesRejection>,
    id: MintedId,
) -> Result<Response, ApiError> {
    let body: CompletionRequest = params::parse_body(&read_body(&state, body)?)?;
    let served = state.model().to_string();
    let parsed = parse(body, &served, id.to_string())?;
    let names = parsed.names;
    let started = generate::start(&state.service, &id, parsed.request, names).await?;
    let mut format = CompletionChunks {
        id: id.to_string(),
        model: served,
        created: generate::unix_now(),
        logprobs: parsed.logprobs.then(|| LogprobText::new(&state)),
        include_usage: parsed.delivery.include_usage,
    };
    if parsed.delivery.stream {
        return Ok(generate::sse(started, format, names));
    }
    let collected = generate::collect(started, names).await?;
    let logprobs = format
        .logprobs
        .as_mut()
        .map(|l| l.json(&collected.logprobs));
    Ok(Json(serde_json::json!({
        "id": format.id,
        "object": "text_completion",
        "created": format.created,
        "model": format.model,
        "choices": [{
            "index": 0,
            "text": collected.text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(collected.finish_reason),
        }],
        "usage": collected.usage.as_ref().map(usage_json),
    }))
    .into_response())
}

/// Completions' `logprobs` object, with text offsets running over the whole completion.
/// `top_logprobs` has one object per token mapping the text of each of the `logprobs` most
/// likely tokens to its log-probability, plus the chosen token's (OpenAI: "up to logprobs+1
/// elements"); a text two tokens share is listed once, with the more likely one's value.
struct LogprobText {
    tokenizer: std::sync::Arc<nibble_engine::Tokenizer>,
    offset: usize,
}

impl LogprobText {
    fn new(state: &HttpState) -> Self {
        Self {
            tokenizer: state.tokenizer(),
            offset: 0,
        }
    }

    fn json(&mut self, logprobs: &[v1::TokenLogprob]) -> serde_json::Value {
        let mut tokens = Vec::new();
        let mut values = Vec::new();
        let mut top = Vec::new();
        let mut offsets = Vec::new();
        for lp in logprobs {
            let text = super::token_text(&self.tokenizer, lp.token_id);
            let mut alternatives = serde_json::Map::new();
            for alt in &lp.top {
                alternatives
                    .entry(super::token_text(&self.tokenizer, alt.token_id))
                    .or_insert(alt.logprob.into());
            }
            alternatives
                .entry(text.clone())
                .or_insert(lp.logprob.into());
            offsets.push(self.offset);
            self.offset += text.chars().count();
            tokens.push(text);
            values.push(lp.logprob);
            top.push(serde_json::Value::Object(alternatives));
        }
        serde_json::json!({
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": top,
            "text_offset": offsets,
        })
    }
}

struct CompletionChunks {
    id: String,
    model: String,
    created: u64,
    logprobs: Option<LogprobText>,
    include_usage: bool,
}

impl ChunkFormat for CompletionChunks {
    fn chunks(&mut self, chunk: v1::GenerateResponse) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        let finish = finish_reason(chunk.finish_reason);
        if !chunk.text.is_empty() || finish.is_some() || !chunk.logprobs.is_empty() {
            let logprobs = self.logprobs.as_mut().map(|l| l.json(&chunk.logprobs));
            let mut json = serde_json::json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": chunk.text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }],
            });
            if self.include_usage {
                json["usage"] = serde_json::Value::Null;
            }
            out.push(json);
        }
        if let (true, Some(usage)) = (self.include_usage, &chunk.usage) {
            out.push(serde_json::json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage_json(usage),
            }));
        }
        out
    }
}
