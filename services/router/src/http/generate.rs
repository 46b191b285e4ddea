//! One generation through the router's own gRPC `Generate` path ([`InferenceService`]): the
//! same validation, routing, queueing and cancellation as a gRPC client gets. The first chunk
//! is awaited before anything is answered, so that a request refused on the way (no worker,
//! a full queue, a worker's refusal) gets its HTTP status instead of a broken stream.
//!
//! Dropping a [`Started`] (or the SSE body holding it) drops the gRPC stream, which cancels the
//! request and frees its pages on the workers, exactly as a gRPC client's cancel does.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use nibble_proto::v1;
use nibble_proto::v1::inference_server::Inference;
use tokio_stream::{Stream, StreamExt};

use super::error::{ApiError, ParamNames};
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
    pub finish_reason: i32,
    pub usage: Option<v1::Usage>,
}

impl Collected {
    fn add(&mut self, chunk: v1::GenerateResponse) {
        self.request_id = chunk.request_id;
        self.text.push_str(&chunk.text);
        self.token_ids.extend(chunk.token_ids);
        self.logprobs.extend(chunk.logprobs);
        if chunk.finish_reason != 0 {
            self.finish_reason = chunk.finish_reason;
        }
        if chunk.usage.is_some() {
            self.usage = chunk.usage;
        }
    }
}

/// Reads a started generation to its end.
pub async fn collect(started: Started, names: ParamNames) -> Result<Collected, ApiError> {
    let Started { first, mut rest } = started;
    let mut collected = Collected::default();
    collected.add(first);
    while let Some(chunk) = rest.next().await {
        let chunk = chunk.map_err(|s| ApiError::from_status(&s, names))?;
        collected.add(chunk);
    }
    Ok(collected)
}

/// Turns the router's chunks into the JSON chunks of one endpoint's stream.
pub trait ChunkFormat: Send + Unpin + 'static {
    /// The JSON chunks one router chunk becomes (none when it adds nothing to send).
    fn chunks(&mut self, chunk: v1::GenerateResponse) -> Vec<serde_json::Value>;
}

/// The server-sent events of a started generation: one `data:` event per JSON chunk, an error
/// event (`data: {"error": ...}`) if the generation fails midway, and `data: [DONE]` last.
pub fn sse<F: ChunkFormat>(started: Started, format: F, names: ParamNames) -> Response {
    let mut stream = SseStream {
        rest: Some(started.rest),
        pending: std::collections::VecDeque::new(),
        format,
        names,
    };
    let first = stream.format.chunks(started.first);
    stream.pending.extend(first.iter().map(json_event));
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn json_event(value: &serde_json::Value) -> Event {
    Event::default().data(value.to_string())
}

struct SseStream<F> {
    /// The router's stream; `None` once it ended (only queued events are left).
    rest: Option<GenerateStream>,
    pending: std::collections::VecDeque<Event>,
    format: F,
    names: ParamNames,
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
            match rest.as_mut().poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) => {
                    let chunks = this.format.chunks(chunk);
                    this.pending.extend(chunks.iter().map(json_event));
                }
                Poll::Ready(Some(Err(status))) => {
                    let error = ApiError::from_status(&status, this.names);
                    let body = serde_json::to_value(error.body()).unwrap_or_default();
                    this.pending.push_back(json_event(&body));
                    this.pending.push_back(Event::default().data("[DONE]"));
                    this.rest = None;
                }
                Poll::Ready(None) => {
                    this.pending.push_back(Event::default().data("[DONE]"));
                    this.rest = None;
                }
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
