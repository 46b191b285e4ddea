//! The router's OpenAI-compatible HTTP API (axum), beside its gRPC `Inference` service and over
//! the same shared state: every generating request goes down the gRPC service's own generate
//! path ([`generate`]), so validation, routing, queueing and cancellation are the same for both.
//!
//! Routes (docs/HTTP.md has the parameters and the error mapping):
//! * `POST /v1/completions` ([`completions`]) and `POST /v1/chat/completions` ([`chat`]):
//!   JSON, or server-sent events ending in `data: [DONE]` with `"stream": true`;
//! * `GET /v1/models`, `GET /v1/models/{model}`;
//! * `GET /health` (the process is up) and `GET /ready` (a decode worker is known: decode
//!   workers prefill locally when no prefill worker is, so one can serve a request);
//! * `GET /metrics`, the process's Prometheus metrics, when [`HttpConfig::metrics`] is set
//!   (where aiperf and Prometheus look first; the same text as the metrics port).
//!
//! Errors are OpenAI's `{"error": {...}}` with their status ([`error`]). With an API key
//! configured, every `/v1` route wants `Authorization: Bearer <key>` (compared in constant
//! time); `/health`, `/ready` and `/metrics` stay open for probes and scrapers, as vLLM's. With a certificate the API is served
//! over HTTPS ([`tls`]).

pub mod args;
pub mod chat;
pub mod choices;
pub mod completions;
pub mod error;
pub mod generate;
pub mod limits;
pub mod params;
pub mod structured;
pub mod tls;
pub mod tokens;
pub mod tools;

use std::future::Future;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use tokio::net::TcpListener;

use crate::service::state::MintedId;
use crate::{InferenceService, Shared};
pub use args::HttpArgs;
pub use error::ApiError;
use limits::{ConnectionUse, Limited};

/// Default largest request body, in bytes.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;

/// Default largest `n` (and `best_of`).
pub const DEFAULT_MAX_N: u32 = 16;

/// Default most prompts in one `/v1/completions` request.
pub const DEFAULT_MAX_PROMPTS: usize = 64;

/// Settings of the HTTP API.
#[derive(Clone)]
pub struct HttpConfig {
    /// The bearer key every `/v1` request must carry; `None` leaves the API open.
    pub api_key: Option<String>,
    /// Largest request body; a larger one is refused with 413.
    pub max_body_bytes: usize,
    /// Connections open at once, and the idle, header and body deadlines ([`limits`]).
    pub limits: limits::ConnectionLimits,
    /// The process's metrics, served on `GET /metrics` (no API key: counts and latencies,
    /// nothing about a request's content); `None` serves no `/metrics` here.
    pub metrics: Option<&'static nibble_telemetry::Metrics>,
    /// Largest `n` and `best_of` (400 naming the parameter above).
    pub max_n: u32,
    /// Most prompts in one completions request (400 naming `prompt` above).
    pub max_prompts: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            api_key: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            limits: limits::ConnectionLimits::default(),
            metrics: None,
            max_n: DEFAULT_MAX_N,
            max_prompts: DEFAULT_MAX_PROMPTS,
        }
    }
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .field("max_body_bytes", &self.max_body_bytes)
            .field("limits", &self.limits)
            .field("metrics", &self.metrics.is_some())
            .field("max_n", &self.max_n)
            .field("max_prompts", &self.max_prompts)
            .finish()
    }
}

/// What the handlers share.
#[derive(Clone)]
pub struct HttpState {
    service: InferenceService,
    config: Arc<HttpConfig>,
    /// When the API started (`created` of the model list).
    started: u64,
}

impl HttpState {
    /// State over the router's shared state.
    pub fn new(shared: Arc<Shared>, config: HttpConfig) -> Self {
        Self {
            service: InferenceService(shared),
            config: Arc::new(config),
            started: generate::unix_now(),
        }
    }

    fn shared(&self) -> &Shared {
        &self.service.0
    }

    /// The served model's name.
    fn model(&self) -> &str {
        self.shared().config().served_model()
    }

    fn config(&self) -> &HttpConfig {
        &self.config
    }

    fn tokenizer(&self) -> Arc<nibble_engine::Tokenizer> {
        Arc::clone(&self.shared().config().tokenizer)
    }

    /// A new response id, also the request id the workers log: minted by the router
    /// ([`Shared::mint_request_id`]), unguessable.
    fn next_id(&self, kind: &str) -> MintedId {
        self.shared().mint_request_id(kind)
    }
}

/// The API's routes over `shared`.
pub fn router(shared: Arc<Shared>, config: HttpConfig) -> axum::Router {
    let limit = config.max_body_bytes;
    let body_limits = limits::request::BodyLimits {
        max_bytes: limit,
        timeout: config.limits.body_timeout,
    };
    let metrics = config.metrics;
    let state = HttpState::new(shared, config);
    let v1 = axum::Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*model}", get(model))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    let mut open = axum::Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready));
    if let Some(metrics) = metrics {
        open = open.route("/metrics", nibble_telemetry::route(metrics));
    }
    axum::Router::new()
        .merge(v1)
        .merge(open)
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(
            body_limits,
            limits::request::guard,
        ))
        .layer(middleware::from_fn(count))
        .with_state(state)
}

/// Counts every response by route and status ([`crate::metrics::HTTP_RESPONSES_TOTAL`]).
async fn count(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let response = next.run(request).await;
    crate::metrics::http_response(route, response.status());
    response
}

/// Serves the API on `listener` until `shutdown` completes (open streams are let finish).
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    config: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    // Small SSE events must not wait on Nagle's algorithm.
    let listener = listener.tap_io(|tcp| {
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(%err, "TCP_NODELAY");
        }
    });
    let limits = config.limits;
    let _upkeep = config.metrics.map(upkeep);
    let app = router(shared, config).into_make_service_with_connect_info::<ConnectionUse>();
    axum::serve(Limited::new(listener, limits), app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Keeps `metrics`' histograms drained while the API serves them (stops when dropped).
fn upkeep(metrics: &'static nibble_telemetry::Metrics) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(nibble_telemetry::upkeep(metrics)))
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// [`serve`], over HTTPS when `tls` is given.
pub async fn serve_tls(
    listener: TcpListener,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    shared: Arc<Shared>,
    config: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    match tls {
        None => serve(listener, shared, config, shutdown).await,
        Some(tls) => {
            let limits = config.limits;
            let _upkeep = config.metrics.map(upkeep);
            let listener = Limited::new(tls::TlsListener::new(listener, tls)?, limits);
            let app = router(shared, config).into_make_service_with_connect_info::<ConnectionUse>();
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}

/// The request body, or 413 / 400.
fn read_body(state: &HttpState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(state.config.max_body_bytes)
        } else {
            ApiError::bad_body(rejection.body_text())
        }
    })
}

/// Marks a generating request's response with its id (`x-request-id`), which the router and
/// the workers log, whether it succeeded or not.
fn with_request_id(mut response: Response, id: &str) -> Response {
    if let Ok(value) = header::HeaderValue::from_str(id) {
        response.headers_mut().insert(REQUEST_ID, value);
    }
    response
}

/// The response header carrying the request id.
pub const REQUEST_ID: &str = "x-request-id";

/// A token's text, as OpenAI's log-probabilities spell it.
fn token_text(tokenizer: &nibble_engine::Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

/// Checks the bearer key when one is configured.
async fn authorize(State(state): State<HttpState>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        // Constant time in the key's bytes, as the gRPC API checks it.
        if !nibble_security::bearer_matches(given, key) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

async fn ready(State(state): State<HttpState>) -> Response {
    let (stats, reachable) = {
        let router = state.shared().router();
        (router.stats(), router.reachable_decode_workers())
    };
    // Ready while a decode worker is registered and answering: requests can be served.
    let ready = reachable > 0;
    let body = Json(serde_json::json!({
        "status": if ready { "ready" } else { "not ready" },
        "prefill_workers": stats.prefill_workers,
        "decode_workers": stats.decode_workers,
        "unreachable_workers": stats.unreachable_workers,
    }));
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, body).into_response()
}

fn model_json(state: &HttpState) -> serde_json::Value {
    serde_json::json!({
        "id": state.model(),
        "object": "model",
        "created": state.started,
        "owned_by": "nibble",
        "max_model_len": state.shared().config().max_context,
    })
}

async fn models(State(state): State<HttpState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "object": "list", "data": [model_json(&state)] }))
}

async fn model(State(state): State<HttpState>, Path(model): Path<String>) -> Response {
    if model == state.model() {
        Json(model_json(&state)).into_response()
    } else {
        ApiError::unknown_model(&model, state.model()).into_response()
    }
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::no_route(method.as_str(), uri.path())
}

async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}
