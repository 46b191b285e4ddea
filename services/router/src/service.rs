//! The router's gRPC `Inference` service (inference.proto) over a shared [`Router`]: it
//! validates and tokenizes requests, hashes them in pages, routes them to a decode worker D
//! and maybe a prefill worker P, drives `Reserve` on D → `Prefill` on P (which pushes pages to
//! D) → `Decode` on D, and streams D's tokens back. Membership comes from a discovery watch;
//! each worker's KV-event stream feeds the prefix index (a gap triggers a snapshot).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nibble_discovery::{Discovery, Role, WorkerEvent, WorkerId, WorkerInfo};
use nibble_engine::sampling::MAX_TOP_LOGPROBS;
use nibble_engine::{ChatMessage, Tokenizer};
use nibble_proto::v1;
use nibble_proto::v1::worker_client::WorkerClient;
use nibble_security::{AuthChannel, Peers, Secret, Security};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::admission::{Admission, AdmissionConfig, Place};
use crate::metrics::{self, Outcome};
use crate::{Error, LoadReport, Prompt, Router, RouterConfig, SyncStatus, WorkerSet};

/// Largest gRPC message the router's worker clients accept.
const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// Pause before a worker's KV-event subscription is retried.
const RESUBSCRIBE_DELAY: Duration = Duration::from_millis(200);
/// Prefill workers tried per request before it fails.
const PREFILL_ATTEMPTS: usize = 3;
/// How often each worker's load is polled, by default.
pub const DEFAULT_LOAD_INTERVAL: Duration = Duration::from_millis(250);

/// What the router serves.
#[derive(Clone)]
pub struct ServiceConfig {
    /// The routing core's configuration (its `model` is the name clients use).
    pub router: RouterConfig,
    /// The model's tokenizer (and chat template).
    pub tokenizer: Arc<Tokenizer>,
    /// Longest prompt plus completion, in tokens (0: unknown, not checked).
    pub max_context: u32,
    /// How many requests run at once and wait (see [`Admission`]).
    pub admission: AdmissionConfig,
    /// How often each worker's `Load` is polled.
    pub load_interval: Duration,
    /// Largest `stopping.max_tokens` a request may ask for (INVALID_ARGUMENT above).
    pub max_tokens_limit: u32,
    /// The bearer key every `Inference` call must carry (`None`: open). The HTTP API checks
    /// its own [`HttpConfig::api_key`](crate::HttpConfig), set from the same flag.
    pub api_key: Option<Secret>,
    /// TLS of the public APIs and of the worker clients, and the internal token they send.
    pub security: Security,
}

impl ServiceConfig {
    /// The defaults for routing with `router` and `tokenizer`, prompts up to `max_context`.
    pub fn new(router: RouterConfig, tokenizer: Arc<Tokenizer>, max_context: u32) -> Self {
        Self {
            router,
            tokenizer,
            max_context,
            admission: AdmissionConfig::default(),
            load_interval: DEFAULT_LOAD_INTERVAL,
            max_tokens_limit: nibble_engine::sampling::MAX_TOKENS_LIMIT,
            api_key: None,
            security: Security::default(),
        }
    }
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("router", &self.router)
            .field("max_context", &self.max_context)
            .field("admission", &self.admission)
            .field("load_interval", &self.load_interval)
            .field("max_tokens_limit", &self.max_tokens_limit)
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .field("security", &self.security)
            .finish_non_exhaustive()
    }
}

/// State shared by the service, the membership task and the KV-event tasks.
#[derive(Debug)]
pub struct Shared {
    router: Mutex<Router>,
    config: ServiceConfig,
    /// How workers are dialed (TLS, the internal token).
    peers: Peers,
    clients: Mutex<HashMap<String, WorkerClient<AuthChannel>>>,
    /// Names requests that come without an id: `router-{prefix}-{n}`, the prefix unique to this
    /// process so that ids stay unique across routers (and across a router's restarts).
    id_prefix: String,
    next_request: AtomicU64,
    admission: Admission,
}

impl Shared {
    /// Shared state over a new [`Router`]. Its gauges are sampled whenever the process's
    /// metrics are scraped ([`nibble_telemetry::register`]), for as long as it lives.
    pub fn new(config: ServiceConfig) -> crate::Result<Arc<Self>> {
        let shared = Arc::new(Self {
            router: Mutex::new(Router::new(config.router.clone())?),
            peers: config.security.peers()?,
            admission: Admission::new(config.admission),
            config,
            clients: Mutex::new(HashMap::new()),
            id_prefix: process_prefix(),
            next_request: AtomicU64::new(1),
        });
        metrics::describe();
        nibble_telemetry::register(&shared);
        Ok(shared)
    }

    /// What the router serves.
    pub fn config(&self) -> &ServiceConfig {
        &self.config
    }

    /// The routing core (locked).
    pub fn router(&self) -> MutexGuard<'_, Router> {
        self.router.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The admission queue (requests running and waiting).
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// A client of the worker at `address` (`host:port`: `https://` when TLS is on), cached per
    /// address; its calls carry the internal token when one is set.
    pub fn client(&self, address: &str) -> Result<WorkerClient<AuthChannel>, Status> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = clients.get(address) {
            return Ok(client.clone());
        }
        let channel = self
            .peers
            .connect_lazy(address)
            .map_err(|e| Status::internal(format!("worker: {e}")))?;
        let client = WorkerClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        clients.insert(address.to_string(), client.clone());
        Ok(client)
    }
}

/// Eight hex digits from the clock, telling this process's request ids from another's.
fn process_prefix() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{:08x}", now.subsec_nanos() ^ now.as_secs() as u32)
}

/// Follows `discovery`'s membership until the watch ends: applies every event to the router
/// and keeps one KV-event subscription task per tracked worker.
pub async fn follow_membership(shared: Arc<Shared>, discovery: Arc<dyn Discovery>) {
    let mut watch = match discovery.watch(None).await {
        Ok(watch) => watch,
        Err(err) => {
            tracing::error!(%err, "cannot watch workers");
            return;
        }
    };
    let mut tasks: HashMap<(Role, WorkerId), (String, JoinHandle<()>)> = HashMap::new();
    while let Some(event) = watch.next().await {
        let key = match &event {
            WorkerEvent::Added(info) | WorkerEvent::Updated(info) => (info.role, info.id.clone()),
            WorkerEvent::Removed { role, id } => (*role, id.clone()),
        };
        let info = match &event {
            WorkerEvent::Added(info) | WorkerEvent::Updated(info) => Some(info.clone()),
            WorkerEvent::Removed { .. } => None,
        };
        if let Err(err) = shared.router().apply_worker_event(event) {
            tracing::warn!(%err, "worker refused");
        }
        let tracked = shared.router().slot(key.0, &key.1).is_ok();
        match info.filter(|_| tracked) {
            Some(info) => {
                let same = tasks.get(&key).is_some_and(|(address, task)| {
                    *address == info.addresses.grpc && !task.is_finished()
                });
                if !same {
                    let task = tokio::spawn(follow_worker(Arc::clone(&shared), info.clone()));
                    if let Some((_, old)) = tasks.insert(key, (info.addresses.grpc.clone(), task)) {
                        old.abort();
                    }
                }
            }
            None => {
                if let Some((_, task)) = tasks.remove(&key) {
                    task.abort();
                }
            }
        }
    }
    for (_, (_, task)) in tasks {
        task.abort();
    }
}

/// Follows one worker until the task is aborted: its KV events ([`follow_kv_events`]) and its
/// load ([`poll_load`]).
async fn follow_worker(shared: Arc<Shared>, info: WorkerInfo) {
    tokio::join!(
        follow_kv_events(Arc::clone(&shared), info.clone()),
        poll_load(shared, info)
    );
}

/// Reports the worker's `Load` to the router every `load_interval` while it is tracked. A failed
/// poll is skipped: the router's own accounting carries the estimate until the next report.
async fn poll_load(shared: Arc<Shared>, info: WorkerInfo) {
    let mut ticks = tokio::time::interval(shared.config.load_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Ok(mut client) = shared.client(&info.addresses.grpc) else {
            return;
        };
        let load = match client.load(v1::LoadRequest {}).await {
            Ok(load) => load.into_inner(),
            Err(status) => {
                tracing::debug!(role = %info.role, id = %info.id, %status, "load poll failed");
                continue;
            }
        };
        if shared
            .router()
            .report_load(info.role, &info.id, LoadReport::from(&load))
            .is_err()
        {
            return; // no longer tracked
        }
    }
}

/// Feeds one worker's KV events into the router until the task is aborted, resubscribing
/// after errors and asking for a snapshot whenever the router reports a gap.
async fn follow_kv_events(shared: Arc<Shared>, info: WorkerInfo) {
    let (role, id) = (info.role, info.id.clone());
    loop {
        if let Err(err) = subscribe_once(&shared, &info).await {
            tracing::debug!(%role, %id, %err, "KV-event stream ended");
        }
        if shared.router().slot(role, &id).is_err() {
            return;
        }
        tokio::time::sleep(RESUBSCRIBE_DELAY).await;
    }
}

async fn subscribe_once(shared: &Shared, info: &WorkerInfo) -> Result<(), Status> {
    let mut client = shared.client(&info.addresses.grpc)?;
    let mut stream = client
        .subscribe_kv_events(v1::SubscribeKvEventsRequest {})
        .await?
        .into_inner();
    while let Some(batch) = stream.message().await? {
        let report = shared
            .router()
            .apply_kv_batch(info.role, &info.id, batch)
            .map_err(|e| Status::internal(e.to_string()))?;
        metrics::kv_sync(info.role, &report);
        if matches!(report.status, SyncStatus::SnapshotNeeded(_)) {
            let snapshot = client
                .kv_snapshot(v1::KvSnapshotRequest {})
                .await?
                .into_inner();
            let report = shared
                .router()
                .apply_kv_snapshot_response(info.role, &info.id, &snapshot)
                .map_err(|e| Status::internal(e.to_string()))?;
            metrics::kv_sync(info.role, &report);
        }
    }
    Ok(())
}

/// The `Inference` service.
#[derive(Debug, Clone)]
pub struct InferenceService(pub Arc<Shared>);

fn invalid(field: &str, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}

fn route_error(err: Error) -> Status {
    match err {
        Error::NoDecodeWorkers => Status::unavailable(err.to_string()),
        other => Status::internal(other.to_string()),
    }
}

impl InferenceService {
    fn check_model(&self, model: &str) -> Result<(), Status> {
        let ours = &self.0.config.router.model;
        if !model.is_empty() && model != ours {
            return Err(invalid(
                "model",
                format!("unknown model {model:?} (this router serves {ours:?})"),
            ));
        }
        Ok(())
    }

    /// Validates a request and returns its prompt's token ids.
    fn prompt_tokens(&self, req: &v1::GenerateRequest) -> Result<Vec<u32>, Status> {
        use v1::generate_request::Prompt as P;
        self.check_model(&req.model)?;
        if let Some(s) = &req.sampling {
            if let Some(p) = s.top_p {
                if !(p > 0.0 && p <= 1.0) {
                    return Err(invalid("sampling.top_p", format!("{p} is outside (0, 1]")));
                }
            }
            if let Some(t) = s.temperature {
                if !(t >= 0.0 && t.is_finite()) {
                    return Err(invalid("sampling.temperature", format!("{t} must be >= 0")));
                }
            }
        }
        if let Some(l) = &req.logprobs {
            let k = l.top_logprobs;
            if k > MAX_TOP_LOGPROBS {
                return Err(invalid(
                    "logprobs.top_logprobs",
                    format!("must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
                ));
            }
            if k > 0 && !l.enabled {
                return Err(invalid(
                    "logprobs.top_logprobs",
                    "requires logprobs.enabled",
                ));
            }
        }
        let max_tokens = req.stopping.as_ref().and_then(|s| s.max_tokens);
        let limit = self.0.config.max_tokens_limit;
        if let Some(max) = max_tokens.filter(|m| !(1..=limit).contains(m)) {
            return Err(invalid(
                "stopping.max_tokens",
                format!("must be between 1 and {limit}, got {max}"),
            ));
        }
        let tokenizer = &self.0.config.tokenizer;
        let internal = |e: nibble_engine::Error| Status::internal(format!("tokenizer: {e}"));
        let ids = match &req.prompt {
            None => return Err(invalid("prompt", "is required (text, tokens or chat)")),
            Some(P::Text(text)) => {
                if text.is_empty() {
                    return Err(invalid("prompt", "text must not be empty"));
                }
                tokenizer
                    .encode(text, req.add_special_tokens.unwrap_or(true))
                    .map_err(internal)?
            }
            Some(P::Tokens(tokens)) => {
                let vocab = tokenizer.vocab_size();
                if let Some(bad) = tokens.ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(invalid(
                        "prompt.tokens",
                        format!("token id {bad} is outside the vocabulary of {vocab}"),
                    ));
                }
                tokens.ids.clone()
            }
            Some(P::Chat(chat)) => {
                if chat.messages.is_empty() {
                    return Err(invalid("prompt.chat", "needs at least one message"));
                }
                let messages: Vec<ChatMessage> = chat
                    .messages
                    .iter()
                    .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
                    .collect();
                let text = tokenizer
                    .render_chat(&messages, chat.add_generation_prompt.unwrap_or(true))
                    .map_err(|e| invalid("prompt.chat", e))?;
                tokenizer.encode(&text, false).map_err(internal)?
            }
        };
        if ids.is_empty() {
            return Err(invalid("prompt", "must not be empty"));
        }
        let context = self.0.config.max_context as usize;
        if context > 0 && ids.len() + max_tokens.unwrap_or(1) as usize > context {
            return Err(invalid(
                "prompt",
                format!(
                    "{} prompt tokens plus max_tokens exceed the context of {context}",
                    ids.len()
                ),
            ));
        }
        Ok(ids)
    }
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send>>;

impl InferenceService {
    /// Validates, admits and routes `req` (in its `request` span), then dispatches it on its
    /// own task and returns its response stream. An error refuses the request.
    async fn start(
        &self,
        req: v1::GenerateRequest,
        arrived: Instant,
    ) -> Result<GenerateStream, Status> {
        let tokens = self.prompt_tokens(&req)?;
        let prompt = Prompt::new(&tokens, self.0.config.router.page_size)
            .map_err(|e| invalid("prompt", e))?;
        metrics::duration(metrics::PREPROCESS_DURATION_SECONDS, arrived.elapsed());
        let queued = Instant::now();
        let place = self.0.admission.admit().await?;
        metrics::duration(metrics::QUEUE_WAIT_SECONDS, queued.elapsed());
        let routed = {
            let mut router = self.0.router();
            let deciding = Instant::now();
            let routed = router
                .route(&prompt, WorkerSet::EMPTY)
                .map_err(route_error)?;
            let decision = &routed.decision;
            metrics::decision(
                decision.reason,
                deciding.elapsed(),
                decision.prompt_tokens,
                decision.decode.cached_tokens,
            );
            routed
        };
        tracing::debug!(
            ticket = %routed.ticket,
            decode = %routed.decision.decode.worker.id,
            prefill = ?routed.decision.prefill.as_ref().map(|p| p.worker.id.to_string()),
            reason = %routed.decision.reason,
            prompt_tokens = tokens.len(),
            "routed"
        );
        let (tx, rx) = mpsc::channel(16);
        let flow = Flow {
            shared: Arc::clone(&self.0),
            req,
            tokens,
            prompt,
            routed,
            _place: place,
            arrived,
            first_token: None,
            last_token: None,
            generated: 0,
        };
        tokio::spawn(flow.run(tx).in_current_span());
        Ok(Box::pin(ReceiverStream::new(rx)))
    }
}

#[tonic::async_trait]
impl v1::inference_server::Inference for InferenceService {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<GenerateStream>, Status> {
        let arrived = Instant::now();
        let mut req = request.into_inner();
        if req.request_id.is_empty() {
            let n = self.0.next_request.fetch_add(1, Ordering::Relaxed);
            req.request_id = format!("router-{}-{n}", self.0.id_prefix);
        }
        // Every log line about the request, here and on its workers, carries its id.
        let span = tracing::info_span!("request", request_id = %req.request_id);
        // A client that goes away while its request waits for a place drops this future.
        let mut unanswered = Unanswered(Some(span.clone()));
        let started = self.start(req, arrived).instrument(span.clone()).await;
        unanswered.0 = None;
        match started {
            // The flow counts it from here.
            Ok(stream) => Ok(Response::new(stream)),
            Err(status) => {
                metrics::request(Outcome::Refused, status.code());
                span.in_scope(|| tracing::info!(%status, "refused"));
                Err(status)
            }
        }
    }

    async fn tokenize(
        &self,
        request: Request<v1::TokenizeRequest>,
    ) -> Result<Response<v1::TokenizeResponse>, Status> {
        let req = request.into_inner();
        self.check_model(&req.model)?;
        let tokenizer = &self.0.config.tokenizer;
        let token_ids = tokenizer
            .encode(&req.text, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| Status::internal(format!("tokenizer: {e}")))?;
        let tokens = token_ids
            .iter()
            .map(|&id| tokenizer.inner().id_to_token(id).unwrap_or_default())
            .collect();
        Ok(Response::new(v1::TokenizeResponse { token_ids, tokens }))
    }

    async fn list_models(
        &self,
        _request: Request<v1::ListModelsRequest>,
    ) -> Result<Response<v1::ListModelsResponse>, Status> {
        let stats = self.0.router().stats();
        Ok(Response::new(v1::ListModelsResponse {
            models: vec![v1::ModelInfo {
                name: self.0.config.router.model.clone(),
                max_context: self.0.config.max_context,
                kv_format: None,
                prefill_workers: stats.prefill_workers as u32,
                decode_workers: stats.decode_workers as u32,
                is_default: true,
            }],
        }))
    }
}

/// Counts a request as cancelled if dropped while it holds the request's span: its client left
/// before it was dispatched.
struct Unanswered(Option<tracing::Span>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(span) = self.0.take() {
            metrics::request(Outcome::Cancelled, tonic::Code::Cancelled);
            span.in_scope(|| tracing::info!("cancelled by the client before dispatch"));
        }
    }
}

/// One dispatched request, driven on its own task.
struct Flow {
    shared: Arc<Shared>,
    req: v1::GenerateRequest,
    tokens: Vec<u32>,
    prompt: Prompt,
    routed: crate::Routed,
    /// The running place, held until the flow ends.
    _place: Place,
    /// When the request arrived, and when its first and latest tokens were sent.
    arrived: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Tokens sent.
    generated: u64,
}

/// Why a flow stopped early.
enum Stop {
    Cancelled,
    Failed(Status),
}

impl From<Status> for Stop {
    fn from(status: Status) -> Self {
        Stop::Failed(status)
    }
}

impl Flow {
    async fn run(mut self, tx: mpsc::Sender<Result<v1::GenerateResponse, Status>>) {
        let ticket = self.routed.ticket;
        let mut prefill_address = None;
        let outcome = tokio::select! {
            outcome = self.drive(&tx, &mut prefill_address) => outcome,
            () = tx.closed() => Err(Stop::Cancelled),
        };
        let ended = Instant::now();
        let ttft_ms = self
            .first_token
            .map(|t| (t - self.arrived).as_secs_f64() * 1e3);
        if outcome.is_ok() {
            metrics::request(Outcome::Finished, tonic::Code::Ok);
            metrics::duration(metrics::REQUEST_DURATION_SECONDS, ended - self.arrived);
            tracing::info!(
                prompt_tokens = self.tokens.len(),
                completion_tokens = self.generated,
                reason = %self.routed.decision.reason,
                ttft_ms,
                millis = (ended - self.arrived).as_millis() as u64,
                "finished"
            );
        }
        if let Err(stop) = outcome {
            // Free whatever the workers hold for the request.
            let abort = v1::AbortRequest {
                request_id: self.req.request_id.clone(),
            };
            let decode = self.routed.decision.decode.worker.addresses.grpc.clone();
            for address in std::iter::once(decode).chain(prefill_address) {
                if let Ok(mut client) = self.shared.client(&address) {
                    let _ = client.abort(abort.clone()).await;
                }
            }
            match stop {
                Stop::Cancelled => {
                    metrics::request(Outcome::Cancelled, tonic::Code::Cancelled);
                    tracing::info!(
                        completion_tokens = self.generated,
                        "cancelled by the client"
                    )
                }
                Stop::Failed(status) => {
                    metrics::request(Outcome::Failed, status.code());
                    tracing::warn!(%status, "request failed");
                    let _ = tx.send(Err(status)).await;
                }
            }
        }
        self.shared.router().finish(ticket);
    }

    async fn drive(
        &mut self,
        tx: &mpsc::Sender<Result<v1::GenerateResponse, Status>>,
        prefill_address: &mut Option<String>,
    ) -> Result<(), Stop> {
        let decision = &self.routed.decision;
        let decode_worker = Arc::clone(&decision.decode.worker);
        let mut decode = self.shared.client(&decode_worker.addresses.grpc)?;
        let request_id = self.req.request_id.clone();
        let max_tokens = self.req.stopping.as_ref().and_then(|s| s.max_tokens);
        let mut reserved_cached = 0;
        let handoff = match decision.prefill.clone() {
            None => None,
            Some(mut prefill) => {
                let reservation = decode
                    .reserve(v1::ReserveRequest {
                        request_id: request_id.clone(),
                        token_ids: self.tokens.clone(),
                        kv_format_fingerprint: decode_worker.kv_fingerprint,
                        ttl_ms: None,
                        max_tokens,
                    })
                    .await?
                    .into_inner();
                reserved_cached = reservation.cached_tokens;
                let mut target = v1::TransferTarget {
                    address: decode_worker
                        .addresses
                        .transfer
                        .clone()
                        .unwrap_or_else(|| decode_worker.addresses.grpc.clone()),
                    reservation_id: reservation.reservation_id,
                    first_page_index: reservation.first_page_index,
                    page_count: reservation.page_count,
                    page_ids: reservation.page_ids.clone(),
                    kv_format_fingerprint: reservation.kv_format_fingerprint,
                    backend: v1::TransferBackend::Grpc as i32,
                    decode_worker_id: decode_worker.id.to_string(),
                };
                let mut attempt = 0;
                let prefilled = loop {
                    attempt += 1;
                    *prefill_address = Some(prefill.worker.addresses.grpc.clone());
                    target.backend = transfer_backend(&prefill.worker, &decode_worker) as i32;
                    let mut client = self.shared.client(&prefill.worker.addresses.grpc)?;
                    let result = client
                        .prefill(v1::PrefillRequest {
                            request_id: request_id.clone(),
                            token_ids: self.tokens.clone(),
                            sampling: self.req.sampling,
                            logprobs: self.req.logprobs,
                            target: Some(target.clone()),
                        })
                        .await;
                    match result {
                        Ok(response) => break response.into_inner(),
                        Err(status) if retryable(&status) && attempt < PREFILL_ATTEMPTS => {
                            tracing::warn!(worker = %prefill.worker.id, %status, "prefill failed; retrying");
                            metrics::count(metrics::PREFILL_RETRIES_TOTAL, 1);
                            let next = self
                                .shared
                                .router()
                                .retry_prefill(self.routed.ticket, &self.prompt)
                                .map_err(|e| Status::internal(e.to_string()))?;
                            match next {
                                Some(next) => prefill = next,
                                None => {
                                    return Err(Status::unavailable(format!(
                                    "prefill failed and no other prefill worker is left: {status}"
                                ))
                                    .into())
                                }
                            }
                        }
                        Err(status) => return Err(status.into()),
                    }
                };
                self.shared.router().prefill_done(self.routed.ticket);
                *prefill_address = None;
                Some(v1::Handoff {
                    reservation_id: reservation.reservation_id,
                    first_token: prefilled.first_token,
                    first_logprob: prefilled.logprob,
                })
            }
        };
        let mut stream = decode
            .decode(v1::DecodeRequest {
                request_id: request_id.clone(),
                token_ids: self.tokens.clone(),
                handoff,
                sampling: self.req.sampling,
                stopping: self.req.stopping.clone(),
                logprobs: self.req.logprobs,
                skip_special_tokens: self.req.skip_special_tokens,
            })
            .await?
            .into_inner();
        while let Some(chunk) = stream.message().await? {
            if !chunk.token_ids.is_empty() {
                self.sent_tokens(chunk.token_ids.len());
            }
            let usage = chunk.usage.map(|mut u| {
                u.cached_tokens = u.cached_tokens.max(reserved_cached);
                u
            });
            let response = v1::GenerateResponse {
                request_id: request_id.clone(),
                text: chunk.text,
                token_ids: chunk.token_ids,
                logprobs: chunk.logprobs,
                finish_reason: chunk.finish_reason,
                usage,
            };
            if tx.send(Ok(response)).await.is_err() {
                return Err(Stop::Cancelled);
            }
        }
        Ok(())
    }
}

impl Flow {
    /// Times `n` tokens about to be sent: the first one's time to first token, and each later
    /// one's gap after the previous.
    fn sent_tokens(&mut self, n: usize) {
        let now = Instant::now();
        match self.last_token {
            None => {
                self.first_token = Some(now);
                metrics::duration(metrics::TIME_TO_FIRST_TOKEN_SECONDS, now - self.arrived);
            }
            Some(last) => metrics::duration(metrics::INTER_TOKEN_LATENCY_SECONDS, now - last),
        }
        self.last_token = Some(now);
        self.generated += n as u64;
        metrics::count(metrics::GENERATION_TOKENS_TOTAL, n as u64);
    }
}

/// How pages move from `prefill` to `decode`: NCCL when both advertise it on different GPUs
/// (the prefill worker still falls back to gRPC if NCCL fails), the gRPC stream otherwise.
fn transfer_backend(prefill: &WorkerInfo, decode: &WorkerInfo) -> v1::TransferBackend {
    if prefill.nccl_to(decode) {
        v1::TransferBackend::Nccl
    } else {
        v1::TransferBackend::Grpc
    }
}

fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Internal
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
    )
}

#[cfg(test)]
mod transfer_tests {
    use nibble_discovery::{Addresses, Capacity, NcclEndpoint, Role, WorkerId, WorkerInfo};
    use nibble_proto::v1::TransferBackend;

    use super::transfer_backend;

    fn worker(role: Role, gpu: Option<&str>) -> WorkerInfo {
        WorkerInfo {
            role,
            id: WorkerId::new(format!("{role}-0")).unwrap(),
            addresses: Addresses::default(),
            model: "m".into(),
            kv_fingerprint: 7,
            page_size: 16,
            capacity: Capacity::default(),
            nccl: gpu.map(|gpu| NcclEndpoint {
                host: "h".into(),
                gpu: gpu.into(),
            }),
        }
    }

    #[test]
    fn nccl_when_both_workers_offer_it_on_two_gpus() {
        let p = worker(Role::Prefill, Some("GPU-0"));
        let d = worker(Role::Decode, Some("GPU-1"));
        assert_eq!(transfer_backend(&p, &d), TransferBackend::Nccl);
        let same_gpu = worker(Role::Decode, Some("GPU-0"));
        assert_eq!(transfer_backend(&p, &same_gpu), TransferBackend::Grpc);
        let cpu = worker(Role::Decode, None);
        assert_eq!(transfer_backend(&p, &cpu), TransferBackend::Grpc);
        assert_eq!(
            transfer_backend(&worker(Role::Prefill, None), &d),
            TransferBackend::Grpc,
            "a prefill worker forced to gRPC advertises no endpoint"
        );
    }
}
