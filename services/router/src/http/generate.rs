//! One generation through the router's own gRPC `Generate` path ([`InferenceService`]): the
//! same validation, routing, queueing and cancellation as a gRPC client gets. The first chunk
//! is awaited before anything is answered, so that a request refused on the way (no worker,
//! a full queue, a worker's refusal) gets its HTTP status instead of a broken stream.
//!
//! Dropping a [`Started`] (or the SSE body holding it) drops the gRPC stream, which cancels the
//! request and frees its pages on the workers, exactly as a gRPC client's cancel does.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use nibble_proto::v1;
use nibble_proto::v1::inference_server::Inference;
use tokio_stream::{Stream, StreamExt};

use super::choices::Merged;
use super::error::{ApiError, ParamNames};
use super::params::Delivery;
use crate::service::state::MintedId;
use crate::InferenceService;

/// The router's response stream.
pub type GenerateStream = <InferenceService as Inference>::GenerateStream;

/// A request whose first chunk has arrived.
pub struct Started {
    pub first: v1::GenerateResponse,
    pub rest: GenerateStream,
}

/// Sends `request` down the generate path and waits for its first chunk. `names` are the
/// endpoint's OpenAI parameters that refusals name.
pub async fn start(
    service: &InferenceService,
    id: &MintedId,
    request: v1::GenerateRequest,
    names: ParamNames,
) -> Result<Started, ApiError> {
    // The id this API minted names the request on the workers too.
    let mut call = tonic::Request::new(request);
    call.extensions_mut().insert(id.clone());
    let mut rest = service
        .generate(call)
        .await
        .map_err(|s| ApiError::from_status(&s, names))?
        .into_inner();
    match rest.next().await {
        Some(Ok(first)) => Ok(Started { first, rest }),
        Some(Err(status)) => Err(ApiError::from_status(&status, names)),
        None => Err(ApiError::internal(
            "the generate stream ended without a response",
        )),
    }
}

/// Everything a finished generation returned.
#[derive(Debug, Default)]
pub struct Collected {
    pub request_id: String,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<v1::TokenLogprob>,
    /// With prompt log-probabilities: the prompt's tokens and the entries of all but the first.
    pub prompt_token_ids: Vec<u32>,
    pub prompt_logprobs: Vec<v1::TokenLogprob>,
    pub finish_reason: i32,
}

impl Collected {
    fn add(&mut self, chunk: v1::GenerateResponse) {
        self.request_id = chunk.request_id;
        self.text.push_str(&chunk.text);
        self.token_ids.extend(chunk.token_ids);
        self.logprobs.extend(chunk.logprobs);
        self.prompt_token_ids.extend(chunk.prompt_token_ids);
        self.prompt_logprobs.extend(chunk.prompt_logprobs);
        if chunk.finish_reason != 0 {
            self.finish_reason = chunk.finish_reason;
        }
    }

    /// The sum of the generated tokens' log-probabilities (`best_of`'s ranking).
    pub fn cumulative_logprob(&self) -> f32 {
        self.logprobs.iter().map(|l| l.logprob).sum()
    }
}

/// Reads every choice to its end: each one's result by index, and the usage of them all.
pub async fn collect(
    mut merged: Merged,
    prompts: &[usize],
    names: ParamNames,
) -> Result<(BTreeMap<u32, Collected>, v1::Usage), ApiError> {
    let mut collected: BTreeMap<u32, Collected> = BTreeMap::new();
    let mut tally = Tally::default();
    while let Some((index, chunk)) = merged.next().await {
        let chunk = chunk.map_err(|s| ApiError::from_status(&s, names))?;
        tally.add(prompts[index as usize], index, &chunk);
        collected.entry(index).or_default().add(chunk);
    }
    Ok((collected, tally.usage()))
}

/// Usage over the choices of one response: prompt tokens counted once per prompt, completion
/// tokens summed over the choices, cached tokens the most any choice of a prompt reused (the
/// later choices of a prompt reuse the first one's pages). Kept as the chunks arrive, so it is
/// also the usage so far.
#[derive(Debug, Default)]
pub struct Tally {
    /// Per prompt: its tokens, and the most cached tokens a choice of it had.
    prompts: BTreeMap<usize, (u32, u32)>,
    /// Per choice: tokens generated so far.
    completions: BTreeMap<u32, u32>,
}

impl Tally {
    /// Counts one chunk of choice `index` (of prompt `prompt`).
    pub fn add(&mut self, prompt: usize, index: u32, chunk: &v1::GenerateResponse) {
        let counts = self.prompts.entry(prompt).or_default();
        if let Some(n) = chunk.prompt_tokens {
            counts.0 = n;
        }
        let completion = self.completions.entry(index).or_default();
        *completion += chunk.token_ids.len() as u32;
        if let Some(usage) = &chunk.usage {
            counts.0 = usage.prompt_tokens;
            counts.1 = counts.1.max(usage.cached_tokens);
            *completion = usage.completion_tokens;
        }
    }

    /// The usage so far.
    pub fn usage(&self) -> v1::Usage {
        v1::Usage {
            prompt_tokens: self.prompts.values().map(|c| c.0).sum(),
            completion_tokens: self.completions.values().sum(),
            cached_tokens: self.prompts.values().map(|c| c.1).sum(),
        }
    }
}

/// Turns the router's chunks into the JSON chunks of one endpoint's stream.
pub trait ChunkFormat: Send + Unpin + 'static {
    /// The JSON chunks one router chunk of choice `index` becomes (none when it adds nothing to
    /// send); without `usage`, which the stream adds.
    fn chunks(&mut self, index: u32, chunk: v1::GenerateResponse) -> Vec<serde_json::Value>;

    /// The last chunk of a stream with `include_usage`: no choices, the usage.
    fn usage_chunk(&self, usage: serde_json::Value) -> serde_json::Value;
}

/// The server-sent events of started choices: one `data:` event per JSON chunk (the choices
/// interleaved as their tokens come, each chunk naming its choice's `index`), an error event
/// (`data: {"error": ...}`) if a generation fails midway, the usage chunk with
/// `include_usage`, and `data: [DONE]` last. `prompts[index]` is choice `index`'s prompt.
pub fn sse<F: ChunkFormat>(
    merged: Merged,
    prompts: Vec<usize>,
    format: F,
    delivery: Delivery,
    names: ParamNames,
) -> Response {
    let stream = SseStream {
        rest: Some(merged),
        pending: std::collections::VecDeque::new(),
        format,
        names,
        prompts,
        tally: Tally::default(),
        delivery,
    };
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn json_event(value: &serde_json::Value) -> Event {
    Event::default().data(value.to_string())
}

struct SseStream<F> {
    /// The choices' chunks; `None` once they ended (only queued events are left).
    rest: Option<Merged>,
    pending: std::collections::VecDeque<Event>,
    format: F,
    names: ParamNames,
    prompts: Vec<usize>,
    tally: Tally,
    delivery: Delivery,
}

impl<F: ChunkFormat> SseStream<F> {
    fn add(&mut self, index: u32, chunk: v1::GenerateResponse) {
        self.tally.add(self.prompts[index as usize], index, &chunk);
        // Every chunk carries the usage so far, or `null` before the usage chunk, or nothing.
        let usage = if self.delivery.continuous_usage {
            Some(usage_json(&self.tally.usage()))
        } else {
            self.delivery
                .include_usage
                .then_some(serde_json::Value::Null)
        };
        for mut json in self.format.chunks(index, chunk) {
            if let Some(usage) = &usage {
                json["usage"] = usage.clone();
            }
            self.pending.push_back(json_event(&json));
        }
    }

    fn end(&mut self) {
        if self.delivery.include_usage {
            let usage = self.format.usage_chunk(usage_json(&self.tally.usage()));
            self.pending.push_back(json_event(&usage));
        }
        self.pending.push_back(Event::default().data("[DONE]"));
        self.rest = None;
    }
}

impl<F: ChunkFormat> Stream for SseStream<F> {
    type Item = Result<Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(event) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(event)));
            }
            let Some(rest) = this.rest.as_mut() else {
                return Poll::Ready(None);
            };
            match Pin::new(rest).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some((index, Ok(chunk)))) => this.add(index, chunk),
                Poll::Ready(Some((_, Err(status)))) => {
                    // Dropping the others cancels them.
                    let error = ApiError::from_status(&status, this.names);
                    let body = serde_json::to_value(error.body()).unwrap_or_default();
                    this.pending.push_back(json_event(&body));
                    this.pending.push_back(Event::default().data("[DONE]"));
                    this.rest = None;
                }
                Poll::Ready(None) => this.end(),
            }
        }
    }
}

/// OpenAI's finish reason for the router's.
pub fn finish_reason(reason: i32) -> Option<&'static str> {
    match v1::FinishReason::try_from(reason).ok()? {
        v1::FinishReason::Unspecified => None,
        v1::FinishReason::Length => Some("length"),
        v1::FinishReason::StopToken | v1::FinishReason::StopString => Some("stop"),
    }
}

/// OpenAI's usage object.
pub fn usage_json(usage: &v1::Usage) -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": usage.cached_tokens },
    })
}

/// Seconds since the Unix epoch, for `created`.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
