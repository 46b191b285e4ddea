//! The gRPC services on an [`EngineHandle`]: `Worker` (worker.proto) and, on decode workers,
//! `KvTransfer` (transfer.proto, in [`kv_transfer`]). Both share one [`WorkerState`]: the pending
//! reservations, the map from request ids to engine ids, the transfer counters and, when this
//! worker offers it, its NCCL pairs.

mod kv_transfer;

pub use kv_transfer::TransferService;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nibble_engine::sampling::check_context;
use nibble_engine::scheduler::SeqId;
use nibble_engine::Event;
use nibble_proto::v1::worker_server::Worker;
use nibble_proto::{request, v1};
use nibble_security::{Peers, Security};
use tokio_stream::wrappers::{BroadcastStream, UnboundedReceiverStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::actor::EngineHandle;
use crate::convert;
use crate::error::{Error, Result};
use crate::metrics::{self, Direction};
use crate::role::{Pass, RoleGate};
use crate::transfer::nccl::NcclTransport;
use crate::transfer::{Pending, Reservations, TransferCounters};

/// What a worker says about itself.
#[derive(Debug, Clone)]
pub struct WorkerIdentity {
    /// Unique in the cluster.
    pub worker_id: String,
    pub role: v1::WorkerRole,
    /// The model served.
    pub model: String,
    /// Where this worker's KvTransfer service listens (empty if it accepts no pages).
    pub transfer_address: String,
    /// How long a reservation waits to be filled and decoded when the request names no TTL.
    pub reservation_ttl: Duration,
}

/// State shared by the services of one worker.
pub struct WorkerState {
    engine: EngineHandle,
    identity: WorkerIdentity,
    /// TLS and the internal token: what this worker's server requires and how it dials decode
    /// workers.
    security: Security,
    peers: Peers,
    reservations: Reservations,
    /// Request id → engine id, for Abort.
    requests: Mutex<HashMap<String, SeqId>>,
    next_id: AtomicU64,
    counters: TransferCounters,
    /// Set once, before serving, when this worker offers NCCL.
    nccl: OnceLock<Arc<NcclTransport>>,
    /// The role now, and which calls it lets in.
    gate: RoleGate,
}

impl WorkerState {
    /// A worker without TLS or internal token.
    pub fn new(engine: EngineHandle, identity: WorkerIdentity) -> Arc<Self> {
        Self::with_security(engine, identity, Security::default())
            .expect("no security settings cannot be invalid")
    }

    /// A worker that serves and dials peers with `security`. Its gauges are sampled whenever
    /// the process's metrics are scraped ([`nibble_telemetry::register`]), for as long as it
    /// lives.
    pub fn with_security(
        engine: EngineHandle,
        identity: WorkerIdentity,
        security: Security,
    ) -> Result<Arc<Self>> {
        let state = Arc::new(Self {
            peers: security.peers()?,
            security,
            engine,
            reservations: Reservations::default(),
            requests: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            counters: TransferCounters::default(),
            nccl: OnceLock::new(),
            gate: RoleGate::new(identity.role),
            identity,
        });
        metrics::describe();
        nibble_telemetry::register(&state);
        Ok(state)
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    /// Who this worker is; its `role` is the one it started with ([`role`](Self::role) is the
    /// one it has now).
    pub fn identity(&self) -> &WorkerIdentity {
        &self.identity
    }

    /// The role now.
    pub fn role(&self) -> v1::WorkerRole {
        self.gate.role()
    }

    /// The role and the gate of the calls it lets in.
    pub fn gate(&self) -> &RoleGate {
        &self.gate
    }

    /// Whether no call of either role is open and no reservation waits: a role change can
    /// complete.
    pub fn drained(&self) -> bool {
        self.gate.open_passes() == 0 && self.reservations.is_empty()
    }

    fn admit(&self, role: v1::WorkerRole) -> Result<Pass> {
        self.gate.admit(role, &self.identity.worker_id)
    }

    /// What this worker's server requires (TLS, the internal token).
    pub fn security(&self) -> &Security {
        &self.security
    }

    /// Offers NCCL transfers (before serving; the registration advertises its endpoint).
    /// Fails if NCCL was already set.
    pub fn set_nccl(&self, nccl: Arc<NcclTransport>) -> Result<()> {
        self.nccl
            .set(nccl)
            .map_err(|_| Error::InvalidArgument("NCCL is already set up on this worker".into()))
    }

    /// This worker's NCCL pairs, when it offers NCCL.
    pub fn nccl(&self) -> Option<&Arc<NcclTransport>> {
        self.nccl.get()
    }

    /// Pages and bytes this worker moved.
    pub fn counters(&self) -> &TransferCounters {
        &self.counters
    }

    /// Reservations waiting to be filled and decoded.
    pub fn pending_reservations(&self) -> usize {
        self.reservations.len()
    }

    fn requests(&self) -> std::sync::MutexGuard<'_, HashMap<String, SeqId>> {
        self.requests.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A fresh engine id for `request_id`, remembered until [`forget`](Self::forget).
    fn track(&self, request_id: &str) -> Result<SeqId> {
        if request_id.is_empty() {
            return Err(Error::InvalidArgument(
                "request_id must not be empty".into(),
            ));
        }
        let id = SeqId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let mut requests = self.requests();
        if requests.contains_key(request_id) {
            return Err(Error::InvalidArgument(format!(
                "request_id {request_id:?} is already in use on this worker"
            )));
        }
        requests.insert(request_id.to_string(), id);
        Ok(id)
    }

    fn forget(&self, request_id: &str, id: SeqId) {
        let mut requests = self.requests();
        if requests.get(request_id) == Some(&id) {
            requests.remove(request_id);
        }
    }

    fn check_fingerprint(&self, theirs: u64) -> Result<()> {
        let info = self.engine.info();
        let ours = info.fingerprint;
        if theirs == ours {
            Ok(())
        } else {
            Err(Error::FingerprintMismatch {
                ours,
                theirs,
                format: info.kv_format.describe(),
            })
        }
    }

    /// Tokens left after `prompt` in the context and in the whole pool.
    fn room(&self, prompt: usize) -> usize {
        let info = self.engine.info();
        info.max_context
            .min(info.total_pages * info.page_size)
            .saturating_sub(prompt)
    }

    async fn reserve(self: &Arc<Self>, r: v1::ReserveRequest) -> Result<v1::ReserveResponse> {
        // The reservation, once made, keeps a role change waiting until its Decode ends.
        let _pass = self.admit(v1::WorkerRole::Decode)?;
        self.check_fingerprint(r.kv_format_fingerprint)?;
        let info = self.engine.info();
        if let Some(max) = r.max_tokens {
            check_context(r.token_ids.len(), max as usize, info.max_context)
                .map_err(|e| Error::Request(e.into()))?;
        }
        let id = self.track(&r.request_id)?;
        let prompt_tokens = r.token_ids.len();
        let reservation = match self.engine.reserve(id, r.token_ids).await {
            Ok(reservation) => reservation,
            Err(e) => {
                self.forget(&r.request_id, id);
                return Err(e);
            }
        };
        let first = reservation.cached_tokens / info.page_size;
        let count = reservation.pages.len() - first;
        self.reservations.insert(
            id.0,
            Pending::new(
                r.request_id.clone(),
                reservation.pages.clone(),
                first,
                info.kv_format.sequence(prompt_tokens),
            ),
        );
        // A caller may shorten the reservation's life, never lengthen it past the worker's
        // --reservation-ttl-ms: pages held for a peer that never pushes come back in time.
        let ttl = r.ttl_ms.map_or(self.identity.reservation_ttl, |ms| {
            Duration::from_millis(ms.into()).min(self.identity.reservation_ttl)
        });
        tracing::debug!(
            reservation = id.0,
            cached_tokens = reservation.cached_tokens,
            pages = count,
            "reserved"
        );
        let state = Arc::clone(self);
        tokio::spawn(
            async move {
                tokio::time::sleep(ttl).await;
                if let Some(p) = state.reservations.remove(id.0) {
                    tracing::info!(reservation = id.0, "reservation expired unfilled");
                    state.forget(&p.request_id, id);
                    state.engine.abort_now(id);
                }
            }
            .in_current_span(),
        );
        Ok(v1::ReserveResponse {
            reservation_id: id.0,
            cached_tokens: reservation.cached_tokens as u32,
            first_page_index: first as u32,
            page_count: count as u32,
            page_ids: reservation.pages[first..].iter().map(|p| p.0).collect(),
            ttl_ms: ttl.as_millis().min(u32::MAX.into()) as u32,
            kv_format_fingerprint: info.fingerprint,
        })
    }

    async fn prefill(self: &Arc<Self>, r: v1::PrefillRequest) -> Result<v1::PrefillResponse> {
        let _pass = self.admit(v1::WorkerRole::Prefill)?;
        if let Some(target) = &r.target {
            self.check_fingerprint(target.kv_format_fingerprint)?;
        }
        // A prefill samples one token; room for more would only refuse long prompts.
        let params = request::sampling_params(r.sampling.as_ref(), None, r.logprobs.as_ref(), 1);
        let id = self.track(&r.request_id)?;
        let guard = Held {
            state: self,
            request_id: &r.request_id,
            id,
        };
        let started = Instant::now();
        let prompt_tokens = r.token_ids.len();
        let mut events = self.engine.submit_prefill(id, r.token_ids, params).await?;
        let (token, logprobs, pages, usage) = loop {
            match events.recv().await {
                Some(Event::Prefilled {
                    token,
                    logprobs,
                    pages,
                    usage,
                    ..
                }) => break (token, logprobs, pages, usage),
                Some(Event::Finished { error, .. }) => {
                    return Err(match error {
                        Some(e) => Error::Failed(e),
                        None => Error::Aborted(r.request_id.clone()),
                    })
                }
                Some(Event::Token { .. } | Event::PromptLogprobs { .. }) => {}
                // The events end without an end only when the engine thread is gone.
                None => return Err(Error::EngineStopped),
            }
        };
        let role = metrics::role_label(self);
        let took = started.elapsed();
        metrics::prefill_duration(role, took);
        tracing::info!(
            prompt_tokens,
            cached_tokens = usage.cached_tokens,
            millis = took.as_millis() as u64,
            "prefilled"
        );
        let transfer = match &r.target {
            Some(target) => {
                let first = target.first_page_index as usize;
                let end = first + target.page_count as usize;
                if end != pages.len() {
                    return Err(Error::InvalidArgument(format!(
                        "target: pages {first}..{end} do not end at the prompt's {} pages",
                        pages.len()
                    )));
                }
                if first == end {
                    // The decode worker holds every page already (a prompt of whole pages it
                    // has cached, and no recent window to fill): it awaits nothing, and a push
                    // of no page would be refused.
                    tracing::debug!(
                        reservation = target.reservation_id,
                        "the decode worker holds the whole prompt: nothing to push"
                    );
                    Some(v1::TransferSummary::default())
                } else {
                    let summary = self.push(&r.request_id, target, &pages[first..]).await?;
                    metrics::transfer(role, Direction::Sent, summary.pages as u64, summary.bytes);
                    metrics::transfer_duration(role, Direction::Sent, summary.duration);
                    metrics::transfer_backend(role, Direction::Sent, summary.backend);
                    Some(v1::TransferSummary {
                        pages: summary.pages as u32,
                        bytes: summary.bytes,
                        duration_us: summary.duration.as_micros() as u64,
                        backend: summary.backend as i32,
                    })
                }
            }
            None => None,
        };
        drop(guard);
        Ok(v1::PrefillResponse {
            first_token: token,
            logprob: convert::logprob(token, logprobs),
            cached_tokens: usage.cached_tokens as u32,
            transfer,
        })
    }

    async fn decode(self: &Arc<Self>, mut r: v1::DecodeRequest) -> Result<DecodeStream> {
        let room = self.room(r.token_ids.len());
        let mut params = request::sampling_params(
            r.sampling.as_ref(),
            r.stopping.as_ref(),
            r.logprobs.as_ref(),
            room,
        );
        params.skip_special_tokens = r.skip_special_tokens.unwrap_or(true);
        let mut stop_tokens = params.stop_token_ids.clone();
        stop_tokens.extend(&self.engine.info().eos);
        // A reservation's Decode continues work this worker took as a decode worker; a Decode
        // without one is new work.
        let pass = match r.handoff {
            Some(_) => self.gate.resume(),
            None => self.admit(v1::WorkerRole::Decode)?,
        };
        // A resumed request's output so far replaces the hand-off's first token.
        let resumed = std::mem::take(&mut r.generated_token_ids);
        // What the stream's end says of the last token, if the resumed output already ends it.
        let mut last_token = resumed.last().copied();
        let resuming = !resumed.is_empty();
        let (id, events) = match &r.handoff {
            Some(h) => {
                self.reservations
                    .take_complete(h.reservation_id, &r.request_id)?;
                let id = SeqId(h.reservation_id);
                let started = match resuming {
                    false => self.engine.start_decode(id, h.first_token, params).await,
                    true => self.engine.resume_decode(id, resumed, params).await,
                };
                match started {
                    Ok(events) => (id, events),
                    Err(e) => {
                        self.forget(&r.request_id, id);
                        self.engine.abort_now(id);
                        return Err(e);
                    }
                }
            }
            None => {
                let id = self.track(&r.request_id)?;
                let submitted = match resuming {
                    false => self.engine.submit(id, r.token_ids, params).await,
                    true => {
                        (self.engine)
                            .submit_resumed(id, r.token_ids, resumed, params)
                            .await
                    }
                };
                match submitted {
                    Ok(events) => (id, events),
                    Err(e) => {
                        self.forget(&r.request_id, id);
                        return Err(e);
                    }
                }
            }
        };
        let role = metrics::role_label(self);
        let mut tracked = Tracked {
            state: Arc::clone(self),
            request_id: r.request_id,
            id,
            span: tracing::Span::current(),
            role,
            tokens: metrics::generation_tokens(role),
            outcome: None,
            _pass: pass,
        };
        // The engine starts a handed-off decode from its first token without log-probabilities;
        // the prefill worker computed them (the alternatives too) and they travel in the
        // hand-off.
        let mut first_logprob = (r.handoff.as_ref())
            .filter(|_| !resuming)
            .and_then(|h| h.first_logprob.clone());
        let ended = Arc::new(AtomicBool::new(false));
        let seen_end = Arc::clone(&ended);
        let stream = UnboundedReceiverStream::new(events).map(move |event| {
            // `tracked` forgets the request id and counts the call when the stream is dropped.
            let _span = tracked.span.clone().entered();
            match event {
                Event::Token {
                    token,
                    logprobs,
                    text,
                    ..
                } => {
                    let logprob = convert::logprob(token, logprobs)
                        .or_else(|| first_logprob.take().filter(|l| l.token_id == token));
                    first_logprob = None;
                    last_token = Some(token);
                    tracked.tokens.increment(1);
                    Ok(v1::DecodeResponse {
                        token_ids: vec![token],
                        text,
                        logprobs: logprob.into_iter().collect(),
                        ..Default::default()
                    })
                }
                Event::Finished {
                    reason,
                    text,
                    usage,
                    error,
                    ..
                } => {
                    ended.store(true, Ordering::Relaxed);
                    let result = if let Some(e) = error {
                        Err(Error::Failed(e).into())
                    } else if reason == nibble_engine::scheduler::FinishReason::Aborted {
                        Err(Error::Aborted(tracked.request_id.clone()).into())
                    } else {
                        let stop_token = last_token.is_some_and(|t| stop_tokens.contains(&t));
                        Ok(v1::DecodeResponse {
                            text,
                            finish_reason: convert::finish_reason(reason, stop_token) as i32,
                            usage: Some(convert::usage(&usage)),
                            ..Default::default()
                        })
                    };
                    tracked.finish(&result, &usage);
                    result
                }
                Event::PromptLogprobs { logprobs, .. } => Ok(v1::DecodeResponse {
                    prompt_logprobs: logprobs
                        .into_iter()
                        .filter_map(|(token, l)| convert::logprob(token, Some(l)))
                        .collect(),
                    ..Default::default()
                }),
                Event::Prefilled { .. } => Err(Status::internal("unexpected prefill event")),
            }
        });
        // Events that stop before the request's end mean the engine thread is gone: the stream
        // ends with UNAVAILABLE, never as if the answer were complete.
        let cut = tokio_stream::iter([()]).filter_map(move |()| {
            (!seen_end.load(Ordering::Relaxed)).then(|| Err(Error::EngineStopped.into()))
        });
        Ok(Box::pin(stream.chain(cut)))
    }

    async fn abort(&self, request_id: &str) -> Result<v1::AbortResponse> {
        let Some(id) = self.requests().remove(request_id) else {
            return Ok(v1::AbortResponse {
                found: false,
                freed_pages: 0,
            });
        };
        self.reservations.remove(id.0);
        let before = self.engine.load().await?.free_pages;
        let found = self.engine.abort(id).await?;
        let after = self.engine.load().await?.free_pages;
        Ok(v1::AbortResponse {
            found,
            freed_pages: after.saturating_sub(before) as u32,
        })
    }

    /// The engine's published load: a poll never waits behind a long step.
    async fn load(&self) -> Result<v1::LoadResponse> {
        let l = self.engine.published_load()?;
        Ok(v1::LoadResponse {
            free_pages: l.free_pages as u64,
            total_pages: l.total_pages as u64,
            evictable_pages: l.evictable_pages as u64,
            running_requests: l.running as u32,
            waiting_requests: l.waiting as u32,
            pending_reservations: self.reservations.len() as u32,
            queued_prefill_tokens: l.prefill_backlog as u64,
        })
    }

    fn info(&self) -> v1::InfoResponse {
        let info = self.engine.info();
        v1::InfoResponse {
            worker_id: self.identity.worker_id.clone(),
            role: self.role() as i32,
            model: self.identity.model.clone(),
            kv_format: Some(info.kv_format.wire()),
            kv_format_fingerprint: info.fingerprint,
            max_context: info.max_context as u32,
            transfer_address: self.identity.transfer_address.clone(),
        }
    }
}

/// Releases a prefilled request's held pages and forgets its id when the call ends, however it
/// ends (a cancelled call drops the future).
struct Held<'a> {
    state: &'a WorkerState,
    request_id: &'a str,
    id: SeqId,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.state.engine.abort_now(self.id);
        self.state.forget(self.request_id, self.id);
    }
}

/// A decoding request while its stream lives: counts its tokens and, when the stream is
/// dropped, forgets its id and counts the call (`cancelled` when it never finished).
struct Tracked {
    state: Arc<WorkerState>,
    request_id: String,
    id: SeqId,
    /// The call's `request` span, entered for every event.
    span: tracing::Span,
    role: &'static str,
    tokens: ::metrics::Counter,
    outcome: Option<tonic::Code>,
    /// Held until the stream ends: a role change waits for it.
    _pass: Pass,
}

impl Tracked {
    fn finish(
        &mut self,
        result: &std::result::Result<v1::DecodeResponse, Status>,
        usage: &nibble_engine::Usage,
    ) {
        match result {
            Ok(response) => {
                self.outcome = Some(tonic::Code::Ok);
                tracing::info!(
                    prompt_tokens = usage.prompt_tokens,
                    cached_tokens = usage.cached_tokens,
                    completion_tokens = usage.completion_tokens,
                    finish_reason = v1::FinishReason::try_from(response.finish_reason)
                        .map_or("unknown", |r| r.as_str_name()),
                    "decoded"
                );
            }
            Err(status) => {
                self.outcome = Some(status.code());
                if nibble_proto::serving::is_server_fault(status.code()) {
                    tracing::warn!(%status, "decode failed");
                } else {
                    tracing::debug!(%status, "decode refused");
                }
            }
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.state.forget(&self.request_id, self.id);
        let code = self.outcome.unwrap_or_else(|| {
            let _span = self.span.enter();
            tracing::debug!("decode stream dropped before it finished");
            tonic::Code::Cancelled
        });
        metrics::call(self.role, "decode", code);
    }
}

type DecodeStream = Pin<Box<dyn Stream<Item = Result<v1::DecodeResponse, Status>> + Send>>;
type KvEventStream = Pin<Box<dyn Stream<Item = Result<v1::KvEventBatch, Status>> + Send>>;

/// The `Worker` gRPC service.
#[derive(Clone)]
pub struct WorkerService(pub Arc<WorkerState>);

/// The span every log line about one request carries: `request{request_id=... call=...}`.
/// The router names the request; the same id reaches every worker it touches.
fn request_span(call: &'static str, request_id: &str) -> tracing::Span {
    tracing::info_span!("request", request_id = %request_id, call)
}

/// Counts one call when it ends: by its result's code, or `cancelled` when the caller went
/// away first (tonic then drops the handler's future, and this with it).
struct Call {
    role: &'static str,
    call: &'static str,
    code: tonic::Code,
}

impl Call {
    fn start(state: &WorkerState, call: &'static str) -> Self {
        Self {
            role: metrics::role_label(state),
            call,
            code: tonic::Code::Cancelled,
        }
    }

    /// The call's result as a gRPC status; a failure is logged.
    fn end<T>(mut self, result: Result<T>) -> std::result::Result<T, Status> {
        let result = result.map_err(Status::from);
        match &result {
            Ok(_) => self.code = tonic::Code::Ok,
            Err(status) => {
                self.code = status.code();
                if nibble_proto::serving::is_server_fault(status.code()) {
                    tracing::warn!(%status, "{} failed", self.call);
                } else {
                    tracing::debug!(%status, "{} refused", self.call);
                }
            }
        }
        result
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        metrics::call(self.role, self.call, self.code);
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn info(
        &self,
        _: Request<v1::InfoRequest>,
    ) -> Result<Response<v1::InfoResponse>, Status> {
        Ok(Response::new(self.0.info()))
    }

    async fn reserve(
        &self,
        request: Request<v1::ReserveRequest>,
    ) -> Result<Response<v1::ReserveResponse>, Status> {
        let request = request.into_inner();
        let span = request_span("reserve", &request.request_id);
        async {
            let call = Call::start(&self.0, "reserve");
            call.end(self.0.reserve(request).await).map(Response::new)
        }
        .instrument(span)
        .await
    }

    async fn prefill(
        &self,
        request: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        let request = request.into_inner();
        let span = request_span("prefill", &request.request_id);
        async {
            let call = Call::start(&self.0, "prefill");
            call.end(self.0.prefill(request).await).map(Response::new)
        }
        .instrument(span)
        .await
    }

    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: Request<v1::DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        let request = request.into_inner();
        let span = request_span("decode", &request.request_id);
        async {
            match self.0.decode(request).await {
                // The stream counts the call when it ends.
                Ok(stream) => Ok(Response::new(stream)),
                Err(e) => Call::start(&self.0, "decode").end(Err(e)),
            }
        }
        .instrument(span)
        .await
    }

    async fn abort(
        &self,
        request: Request<v1::AbortRequest>,
    ) -> Result<Response<v1::AbortResponse>, Status> {
        let request_id = request.into_inner().request_id;
        let span = request_span("abort", &request_id);
        async {
            let response = self.0.abort(&request_id).await?;
            tracing::debug!(
                found = response.found,
                freed_pages = response.freed_pages,
                "aborted"
            );
            Ok(Response::new(response))
        }
        .instrument(span)
        .await
    }

    async fn load(
        &self,
        _: Request<v1::LoadRequest>,
    ) -> Result<Response<v1::LoadResponse>, Status> {
        Ok(Response::new(self.0.load().await?))
    }

    type SubscribeKvEventsStream = KvEventStream;

    async fn subscribe_kv_events(
        &self,
        _: Request<v1::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        // A lagging subscriber skips batches: it sees the gap in ids and resyncs.
        let stream =
            BroadcastStream::new(self.0.engine.subscribe_kv_events()).filter_map(|batch| {
                batch.ok().map(|batch| {
                    Ok(v1::KvEventBatch {
                        instance_id: batch.instance_id,
                        events: batch.events.iter().map(v1::KvEvent::from).collect(),
                    })
                })
            });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn kv_snapshot(
        &self,
        _: Request<v1::KvSnapshotRequest>,
    ) -> Result<Response<v1::KvSnapshotResponse>, Status> {
        let cache = self.0.engine.kv_snapshot().await?;
        Ok(Response::new(v1::KvSnapshotResponse::new(
            cache.instance_id,
            &cache.snapshot,
        )))
    }
}
