//! `POST /v1/completions`: a text (or token-id) prompt completed as is.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use nibble_proto::v1;
use nibble_proto::v1::generate_request::Prompt;
use serde::Deserialize;

use std::collections::{BTreeMap, HashMap, HashSet};

use super::choices;
use super::error::{ApiError, ParamNames};
use super::generate::{self, finish_reason, usage_json, ChunkFormat, Collected};
use super::params::{self, Common, Delivery};
use super::{read_body, with_request_id, HttpState};
use crate::service::state::MintedId;

/// OpenAI's default `max_tokens` for completions.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// Most alternatives per token `logprobs` may ask for (OpenAI's limit for completions).
pub const MAX_LOGPROBS: u32 = 5;

/// `prompt`: a string, token ids, a list of strings or a list of token-id lists (one choice, or
/// `n`, per prompt).
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

/// The parameters refusals name.
const NAMES: ParamNames = ParamNames {
    prompt: "prompt",
    max_tokens: "max_tokens",
    constraint: "response_format",
};

/// A parsed completion request.
struct Parsed {
    /// One request per prompt.
    prompts: Vec<v1::GenerateRequest>,
    /// What `echo` puts before each prompt's completions (`None` without echo).
    echo: Option<Vec<String>>,
    /// Choices returned per prompt, and generated per prompt (`best_of`, at least `n`).
    n: u32,
    best_of: u32,
    delivery: Delivery,
    /// Whether log-probabilities were asked for (`logprobs` set, even to 0).
    logprobs: bool,
    /// The parameters refusals name.
    names: ParamNames,
}

fn parse(
    body: CompletionRequest,
    state: &HttpState,
    served: &str,
    request_id: String,
) -> Result<Parsed, ApiError> {
    let c = &body.common;
    c.check_model(served)?;
    let delivery = c.delivery()?;
    let config = state.config();
    let n = c.n(config.max_n)?;
    let best_of = body.best_of.unwrap_or(n);
    if !(n..=config.max_n).contains(&best_of) {
        return Err(ApiError::invalid(
            "best_of",
            format!(
                "must be between n ({n}) and {}, got {best_of}",
                config.max_n
            ),
        ));
    }
    if best_of > n && delivery.stream {
        return Err(ApiError::invalid(
            "best_of",
            "must equal n when streaming (the best choices are known only at the end)",
        ));
    }
    if body.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "is not supported"));
    }
    if let Some(k) = body.logprobs.filter(|k| *k > MAX_LOGPROBS) {
        return Err(ApiError::invalid(
            "logprobs",
            format!("must be between 0 and {MAX_LOGPROBS}, got {k}"),
        ));
    }
    let echo = body.echo.unwrap_or(false);
    let max_tokens = body.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    // max_tokens 0 without echo is refused by the engine's rule (0 only to score a prompt), on
    // the generate path like any range.
    let prompts = match body.prompt {
        None => return Err(ApiError::invalid("prompt", "is required")),
        Some(PromptInput::Text(text)) => vec![Prompt::Text(text)],
        Some(PromptInput::Tokens(ids)) => vec![Prompt::Tokens(v1::TokenIds { ids })],
        Some(PromptInput::Texts(texts)) => texts.into_iter().map(Prompt::Text).collect(),
        Some(PromptInput::TokenLists(lists)) => lists
            .into_iter()
            .map(|ids| Prompt::Tokens(v1::TokenIds { ids }))
            .collect(),
    };
    if prompts.is_empty() || prompts.len() > config.max_prompts {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "must hold 1 to {} prompts, got {}",
                config.max_prompts,
                prompts.len()
            ),
        ));
    }
    let skip_special = c.skip_special_tokens.unwrap_or(true);
    let echo_texts = echo.then(|| {
        let tokenizer = state.tokenizer();
        prompts
            .iter()
            .map(|p| match p {
                Prompt::Text(text) => text.clone(),
                Prompt::Tokens(ids) => tokenizer.decode(&ids.ids, skip_special).unwrap_or_default(),
                Prompt::Chat(_) => String::new(),
            })
            .collect()
    });
    // best_of ranks by the completion's log-probability, so it always asks for them. Echo with
    // log-probabilities (or with nothing to generate) scores the prompt.
    let wants_logprobs = body.logprobs.is_some() || best_of > n;
    let prompt_logprobs = match (echo, body.logprobs) {
        (true, Some(k)) => Some(k),
        (true, None) if max_tokens == 0 => Some(0),
        _ => None,
    };
    let sampling = c.sampling()?;
    let stopping = c.stopping(Some(max_tokens));
    let requests = prompts
        .into_iter()
        .map(|prompt| v1::GenerateRequest {
            request_id: request_id.clone(),
            model: served.to_string(),
            prompt: Some(prompt),
            add_special_tokens: None,
            sampling: Some(sampling.clone()),
            stopping: Some(stopping.clone()),
            logprobs: (wants_logprobs || prompt_logprobs.is_some()).then(|| v1::LogprobsOptions {
                enabled: wants_logprobs,
                top_logprobs: body.logprobs.unwrap_or(0),
                prompt_logprobs,
            }),
            skip_special_tokens: c.skip_special_tokens,
        })
        .collect();
    Ok(Parsed {
        prompts: requests,
        echo: echo_texts,
        n,
        best_of,
        delivery,
        logprobs: body.logprobs.is_some(),
        names: ParamNames {
            constraint: c.structured.param(),
            ..NAMES
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
    let parsed = parse(body, &state, &served, id.to_string())?;
    let choices = choices::fan_out(parsed.prompts, parsed.best_of);
    let prompts: Vec<usize> = choices.iter().map(|c| c.prompt).collect();
    let (merged, routes) = choices::start_all(&state.service, &id, choices, parsed.names).await?;
    let logprobs = parsed.logprobs.then(|| state.tokenizer());
    let mut format = CompletionChunks {
        id: id.to_string(),
        model: served,
        created: generate::unix_now(),
        offsets: HashMap::new(),
        logprobs,
        echo: parsed.echo,
        echoed: HashSet::new(),
        prompts: prompts.clone(),
    };
    if parsed.delivery.stream {
        return Ok(routes.headers(generate::sse(
            merged,
            prompts,
            format,
            parsed.delivery,
            parsed.names,
        )));
    }
    let (collected, usage) = generate::collect(merged, &prompts, parsed.names).await?;
    // Per prompt, its best `n` of `best_of` by cumulative log-probability, re-indexed in order.
    let mut by_prompt: BTreeMap<usize, Vec<(u32, Collected)>> = BTreeMap::new();
    for (index, c) in collected {
        by_prompt
            .entry(prompts[index as usize])
            .or_default()
            .push((index, c));
    }
    let mut choices = Vec::new();
    for (prompt, mut group) in by_prompt {
        if parsed.best_of > parsed.n {
            keep_best(&mut group, parsed.n as usize);
        }
        for (i, (index, c)) in group.into_iter().enumerate() {
            let out = prompt as u32 * parsed.n + i as u32;
            choices.push(format.choice(index, out, c));
        }
    }
    let response = Json(serde_json::json!({
        "id": format.id,
        "object": "text_completion",
        "created": format.created,
        "model": format.model,
        "choices": choices,
        "usage": usage_json(&usage),
    }))
    .into_response();
    Ok(routes.headers(response))
}

/// `best_of`: keeps the `n` choices of highest cumulative log-probability, most likely first
/// (equal ones in index order).
fn keep_best(group: &mut Vec<(u32, Collected)>, n: usize) {
    group.sort_by(|a, b| {
        (b.1.cumulative_logprob())
            .total_cmp(&a.1.cumulative_logprob())
            .then(a.0.cmp(&b.0))
    });
    group.truncate(n);
}

/// Completions' `logprobs` object for some tokens of one choice, with text offsets running over
/// its whole text (`offset` carries them from chunk to chunk). `top_logprobs` has one object per
/// token mapping the text of each of the `logprobs` most likely tokens to its log-probability,
/// plus the chosen token's (OpenAI: "up to logprobs+1 elements"); a text two tokens share is
/// listed once, with the more likely one's value. An echoed prompt's first token has `null` for
/// both, as OpenAI and vLLM return (nothing comes before it).
fn logprobs_json(
    tokenizer: &nibble_engine::Tokenizer,
    offset: &mut usize,
    entries: &[(u32, Option<&v1::TokenLogprob>)],
) -> serde_json::Value {
    let mut tokens = Vec::new();
    let mut values = Vec::new();
    let mut top = Vec::new();
    let mut offsets = Vec::new();
    for &(token_id, lp) in entries {
        let text = super::token_text(tokenizer, token_id);
        match lp {
            None => {
                values.push(serde_json::Value::Null);
                top.push(serde_json::Value::Null);
            }
            Some(lp) => {
                let mut alternatives = serde_json::Map::new();
                for alt in &lp.top {
                    alternatives
                        .entry(super::token_text(tokenizer, alt.token_id))
                        .or_insert(alt.logprob.into());
                }
                alternatives
                    .entry(text.clone())
                    .or_insert(lp.logprob.into());
                values.push(lp.logprob.into());
                top.push(serde_json::Value::Object(alternatives));
            }
        }
        offsets.push(*offset);
        *offset += text.chars().count();
        tokens.push(text);
    }
    serde_json::json!({
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// The log-probability entries of some of a choice's chunks: the echoed prompt's (its first
/// token without one) when `echo_prompt`, then the completion's.
fn entries<'a>(
    echo_prompt: bool,
    prompt_ids: &[u32],
    prompt: &'a [v1::TokenLogprob],
    completion: &'a [v1::TokenLogprob],
) -> Vec<(u32, Option<&'a v1::TokenLogprob>)> {
    let mut out = Vec::new();
    if echo_prompt {
        out.extend(prompt_ids.first().map(|t| (*t, None)));
        out.extend(prompt.iter().map(|l| (l.token_id, Some(l))));
    }
    out.extend(completion.iter().map(|l| (l.token_id, Some(l))));
    out
}

struct CompletionChunks {
    id: String,
    model: String,
    created: u64,
    /// Each choice's text offset so far (for `text_offset`).
    offsets: HashMap<u32, usize>,
    /// Present when log-probabilities were asked for (to spell the tokens).
    logprobs: Option<std::sync::Arc<nibble_engine::Tokenizer>>,
    /// With echo, each prompt's text.
    echo: Option<Vec<String>>,
    /// Choices whose echo was sent (streaming).
    echoed: HashSet<u32>,
    /// Each choice's prompt.
    prompts: Vec<usize>,
}

impl CompletionChunks {
    /// The echoed prompt of choice `index`, the first time it is asked for.
    fn echo_once(&mut self, index: u32) -> Option<&str> {
        let prompt = self.prompts[index as usize];
        let texts = self.echo.as_ref()?;
        self.echoed.insert(index).then(|| texts[prompt].as_str())
    }

    /// One whole choice of a non-streamed answer: generated as `index`, returned as `out`.
    fn choice(&mut self, index: u32, out: u32, c: Collected) -> serde_json::Value {
        let echo = self.echo_once(index).map(str::to_string);
        let offset = self.offsets.entry(index).or_default();
        let logprobs = self.logprobs.as_ref().map(|t| {
            let lps = entries(
                echo.is_some(),
                &c.prompt_token_ids,
                &c.prompt_logprobs,
                &c.logprobs,
            );
            logprobs_json(t, offset, &lps)
        });
        serde_json::json!({
            "index": out,
            "text": echo.unwrap_or_default() + &c.text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(c.finish_reason),
        })
    }
}

impl ChunkFormat for CompletionChunks {
    fn chunks(&mut self, index: u32, chunk: v1::GenerateResponse) -> Vec<serde_json::Value> {
        let finish = finish_reason(chunk.finish_reason);
        let echo = self.echo_once(index).map(str::to_string);
        let echoing = self.echo.is_some();
        if chunk.text.is_empty()
            && finish.is_none()
            && chunk.logprobs.is_empty()
            && chunk.prompt_logprobs.is_empty()
            && echo.is_none()
        {
            return Vec::new();
        }
        let offset = self.offsets.entry(index).or_default();
        let logprobs = self.logprobs.as_ref().map(|t| {
            // The prompt's first token comes with the echo; its other entries as they come.
            let mut lps = entries(echo.is_some(), &chunk.prompt_token_ids, &[], &[]);
            if echoing {
                lps.extend(chunk.prompt_logprobs.iter().map(|l| (l.token_id, Some(l))));
            }
            lps.extend(entries(false, &[], &[], &chunk.logprobs));
            logprobs_json(t, offset, &lps)
        });
        vec![serde_json::json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": index,
                "text": echo.unwrap_or_default() + &chunk.text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }],
        })]
    }

    fn usage_chunk(&self, usage: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scored(logprobs: &[f32]) -> Collected {
        Collected {
            logprobs: (logprobs.iter())
                .map(|&logprob| v1::TokenLogprob {
                    logprob,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn best_of_keeps_the_most_likely_choices_first() {
        let mut group = vec![
            (0, scored(&[-1.0, -2.0])),
            (1, scored(&[-0.5, -0.25])),
            (2, scored(&[-3.0])),
            (3, scored(&[-0.75])),
        ];
        keep_best(&mut group, 2);
        let kept: Vec<u32> = group.iter().map(|(i, _)| *i).collect();
        assert_eq!(kept, vec![1, 3], "-0.75 twice: the lower index first");
    }
}
