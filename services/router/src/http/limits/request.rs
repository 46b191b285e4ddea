//! [`guard`], the HTTP API's outermost limit on a request: it marks the request's connection as
//! answering it until the answer's last byte ([`super::conn`]: neither idle nor one to evict
//! meanwhile), refuses a `Content-Length` over the body limit at once (413, before any body is
//! read), and reads the whole body within the body deadline: a body declared and never sent, or
//! trickled, gets `408` and its connection is closed, whatever the handler.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::connect_info::ConnectInfo;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio_stream::StreamExt;

use super::conn::{ConnectionUse, RequestGuard};
use crate::http::ApiError;
use crate::metrics::{self, ConnectionClosed};

/// What [`guard`] holds a request's body to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyLimits {
    /// Largest body, in bytes (413 above).
    pub max_bytes: usize,
    /// How long the whole body may take to arrive after the headers (408 past it).
    pub timeout: Duration,
}

/// The middleware (module docs).
pub async fn guard(State(limits): State<BodyLimits>, request: Request, next: Next) -> Response {
    let begun = request
        .extensions()
        .get::<ConnectInfo<ConnectionUse>>()
        .map(|c| c.0.start_request());
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|bytes| bytes > limits.max_bytes as u64) {
        return held(ApiError::too_large(limits.max_bytes).into_response(), begun);
    }
    let (parts, body) = request.into_parts();
    let body = if body.is_end_stream() {
        body
    } else {
        match tokio::time::timeout(limits.timeout, read(body, limits.max_bytes)).await {
            Ok(Ok(bytes)) => Body::from(bytes),
            Ok(Err(Unread::TooLarge)) => {
                return held(ApiError::too_large(limits.max_bytes).into_response(), begun)
            }
            Ok(Err(Unread::Failed(err))) => {
                return held(ApiError::bad_body(err).into_response(), begun)
            }
            Err(_) => {
                metrics::connection_closed(ConnectionClosed::BodyTimeout);
                tracing::debug!(
                    timeout_secs = limits.timeout.as_secs_f64(),
                    "request body too slow: closing its HTTP connection"
                );
                let mut response = ApiError::body_timeout(limits.timeout).into_response();
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                return held(response, begun);
            }
        }
    };
    let working = begun.map(RequestGuard::working);
    held(next.run(Request::from_parts(parts, body)).await, working)
}

/// Why a body was not read.
enum Unread {
    TooLarge,
    Failed(axum::Error),
}

/// The whole of `body`, at most `max` bytes of it.
async fn read(body: Body, max: usize) -> Result<Bytes, Unread> {
    let mut chunks = body.into_data_stream();
    let mut whole = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(Unread::Failed)?;
        if whole.len() + chunk.len() > max {
            return Err(Unread::TooLarge);
        }
        whole.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(whole))
}

/// `response`, its request's guard held until its body's last byte is handed over.
fn held(response: Response, guard: Option<RequestGuard>) -> Response {
    match guard {
        None => response,
        Some(guard) => response.map(|body| {
            Body::new(Held {
                body,
                _guard: guard,
            })
        }),
    }
}

/// A response body holding its request's guard.
struct Held {
    body: Body,
    _guard: RequestGuard,
}

impl HttpBody for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
