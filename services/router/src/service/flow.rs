//! [`Flow`]: one dispatched request, from `Reserve` on its decode worker to the last token;
//! [`failover`] moves it to another decode worker when its own fails.

use std::sync::Arc;
use std::time::Instant;

use nibble_discovery::WorkerInfo;
use nibble_proto::v1;
use tokio::sync::mpsc;
use tonic::Status;

use super::Shared;
use crate::admission::Place;
use crate::metrics::{self, Outcome, Resume};
use crate::{Error, Prompt, Routed};

mod failover;

/// Prefill workers tried per request before the decode worker prefills it itself.
const PREFILL_ATTEMPTS: usize = 3;
/// How long a best-effort abort may take (its worker may be gone).
const ABORT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// One dispatched request, driven on its own task.
pub struct Flow {
    shared: Arc<Shared>,
    /// The request, under the id this router minted for it.
    req: v1::GenerateRequest,
    /// The client's own id, which its responses carry instead of the minted one.
    label: Option<String>,
    tokens: Vec<u32>,
    prompt: Prompt,
    routed: Routed,
    /// The running place, held until the flow ends.
    _place: Place,
    /// When the request arrived, and when its first and latest tokens were sent.
    arrived: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Tokens sent.
    generated: u64,
    /// Whether any chunk was sent (a scoring request's first ones carry no token).
    sent: bool,
    /// The token ids sent, in order: what a decode worker resuming the request replays.
    streamed: Vec<u32>,
    /// Times the request was resumed on another decode worker after its own failed mid-stream.
    resumes: u32,
}

/// Why a flow stopped early.
enum Stop {
    Cancelled,
    Failed(Status),
    /// Its decode stream broke (`Status`, for the log) after it had been resumed as many times
    /// as `--max-resumes` allows.
    Exhausted(Status),
}

impl From<Status> for Stop {
    fn from(status: Status) -> Self {
        Stop::Failed(status)
    }
}

impl From<Error> for Stop {
    fn from(e: Error) -> Self {
        Stop::Failed(e.into())
    }
}

/// What the client is told of a failure. A refusal of the request itself (INVALID_ARGUMENT,
/// OUT_OF_RANGE: its parameters; RESOURCE_EXHAUSTED: no room for it now) is passed on as it is:
/// its message is written for clients and names what was wrong. Anything else is the cluster's
/// fault, whoever reported it (a transport error, a worker's internals, a decode worker's
/// refusal of pushed pages, a misconfigured peer): it becomes a stable sentence for its code and
/// the request's id, and its own message, which may name internal addresses, goes only to the
/// log, where the id finds it.
fn public(status: Status, id: &str) -> Status {
    use tonic::Code;
    if refusal(status.code()) {
        return status;
    }
    let (code, said) = match status.code() {
        // UNKNOWN is how tonic reports a stream whose connection broke (a worker killed
        // mid-stream), CANCELLED a call its worker dropped: to the client, a worker that
        // stopped answering.
        Code::Unavailable | Code::Unknown | Code::Cancelled => (
            Code::Unavailable,
            "a worker serving the request stopped answering; retry it",
        ),
        Code::DeadlineExceeded => (
            Code::DeadlineExceeded,
            "a worker took too long to serve the request",
        ),
        _ => (Code::Internal, "the cluster failed the request"),
    };
    let message = format!("{said} (request {id})");
    Status::with_metadata(code, message, status.metadata().clone())
}

/// Whether a worker's `code` refuses the request itself, which its client can fix or retry later:
/// its parameters, or no room for it now.
fn refusal(code: tonic::Code) -> bool {
    use tonic::Code;
    matches!(
        code,
        Code::InvalidArgument | Code::OutOfRange | Code::ResourceExhausted
    )
}

/// What the client is told when its request's decode stream broke once more than it may be
/// resumed: UNAVAILABLE, as the failure is the cluster's and a retry may succeed.
fn exhausted(resumes: u32, id: &str) -> Status {
    let times = match resumes {
        1 => "once".to_string(),
        2 => "twice".to_string(),
        n => format!("{n} times"),
    };
    Status::unavailable(format!(
        "the request's decode worker failed mid-stream after it had been resumed {times}, the \
         most this router allows; retry it (request {id})"
    ))
}

impl Flow {
    /// A routed request holding its running `place`, dispatched by [`Flow::run`].
    pub fn new(
        shared: Arc<Shared>,
        req: v1::GenerateRequest,
        tokens: Vec<u32>,
        prompt: Prompt,
        routed: Routed,
        place: Place,
        arrived: Instant,
    ) -> Self {
        Self {
            shared,
            req,
            label: None,
            tokens,
            prompt,
            routed,
            _place: place,
            arrived,
            first_token: None,
            last_token: None,
            generated: 0,
            sent: false,
            streamed: Vec::new(),
            resumes: 0,
        }
    }

    /// Responses carry `label` (the client's id) when one is given.
    pub fn labelled(self, label: Option<String>) -> Self {
        Self { label, ..self }
    }

    /// Drives the request to its end, sending its responses (or its failure) on `tx`; frees
    /// what the workers hold for it if it ends early.
    pub async fn run(mut self, tx: mpsc::Sender<Result<v1::GenerateResponse, Status>>) {
        let mut prefill_address = None;
        let outcome = tokio::select! {
            outcome = self.drive_with_failover(&tx, &mut prefill_address) => outcome,
            () = tx.closed() => Err(Stop::Cancelled),
        };
        let ended = Instant::now();
        let ttft_ms = self
            .first_token
            .map(|t| (t - self.arrived).as_secs_f64() * 1e3);
        match &outcome {
            _ if self.resumes == 0 => {}
            Ok(()) => metrics::resume(Resume::Completed),
            Err(Stop::Failed(_)) => metrics::resume(Resume::Failed),
            Err(Stop::Cancelled | Stop::Exhausted(_)) => {}
        }
        if outcome.is_ok() {
            let model = self.shared.config().served_model();
            metrics::request(model, Outcome::Finished, tonic::Code::Ok);
            metrics::model_duration(
                metrics::REQUEST_DURATION_SECONDS,
                model,
                ended - self.arrived,
            );
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
            let decode = self.routed.decision.decode.worker.addresses.grpc.clone();
            self.abort_on(std::iter::once(decode).chain(prefill_address))
                .await;
            match stop {
                Stop::Cancelled => {
                    let model = self.shared.config().served_model();
                    metrics::request(model, Outcome::Cancelled, tonic::Code::Cancelled);
                    tracing::info!(
                        completion_tokens = self.generated,
                        "cancelled by the client"
                    )
                }
                Stop::Failed(status) => {
                    let model = self.shared.config().served_model();
                    metrics::request(model, Outcome::Failed, status.code());
                    if refusal(status.code()) {
                        tracing::info!(%status, "request refused by a worker");
                    } else {
                        tracing::warn!(%status, "request failed");
                    }
                    let id = self.label.as_deref().unwrap_or(&self.req.request_id);
                    let _ = tx.send(Err(public(status, id))).await;
                }
                Stop::Exhausted(status) => {
                    let model = self.shared.config().served_model();
                    metrics::request(model, Outcome::Failed, status.code());
                    tracing::warn!(%status, resumes = self.resumes, "decode failed mid-stream; resumes exhausted");
                    let id = self.label.as_deref().unwrap_or(&self.req.request_id);
                    let _ = tx.send(Err(exhausted(self.resumes, id))).await;
                }
            }
        }
        self.shared.router().finish(self.routed.ticket);
    }

    /// Aborts the request on every worker at `addresses` (best effort, briefly).
    async fn abort_on(&self, addresses: impl Iterator<Item = String>) {
        for address in addresses {
            abort(&self.shared, &self.req.request_id, &address).await;
        }
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
        // After a chunk was sent this is a resumption: the new decode worker replays the tokens
        // sent, and what the client already has (the prompt's log-probabilities) is not asked
        // for again.
        let resuming = self.sent;
        let resumed = match resuming {
            true => self.streamed.clone(),
            false => Vec::new(),
        };
        let mut logprobs = self.req.logprobs;
        if let Some(l) = logprobs.as_mut().filter(|_| resuming) {
            l.prompt_logprobs = None;
        }
        let mut reserved_cached = 0;
        let mut route = v1::Route {
            decode_worker: decode_worker.id.to_string(),
            prefill_worker: String::new(),
            reason: decision.reason.as_str().to_string(),
        };
        // A scoring request is routed without a prefill worker (`Prompt::scored`).
        let scoring = self.prompt.is_scored();
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
                            sampling: self.req.sampling.clone(),
                            logprobs: self.req.logprobs,
                            target: Some(target.clone()),
                        })
                        .await;
                    match result {
                        Ok(response) => break Some(response.into_inner()),
                        Err(status) if retryable(&status) && attempt < PREFILL_ATTEMPTS => {
                            tracing::warn!(worker = %prefill.worker.id, %status, "prefill failed; retrying");
                            metrics::count(metrics::PREFILL_RETRIES_TOTAL, 1);
                            let next = self
                                .shared
                                .router()
                                .retry_prefill(self.routed.ticket, &self.prompt)?;
                            match next {
                                Some(next) => prefill = next,
                                // No prefill worker left: the decode worker prefills it.
                                None => break None,
                            }
                        }
                        Err(status) => return Err(status.into()),
                    }
                };
                self.shared.router().prefill_done(self.routed.ticket);
                *prefill_address = None;
                match prefilled {
                    Some(prefilled) => {
                        // After any retry: the worker that did prefill it.
                        route.prefill_worker = prefill.worker.id.to_string();
                        Some(v1::Handoff {
                            reservation_id: reservation.reservation_id,
                            first_token: prefilled.first_token,
                            // A resumed decode starts from the tokens sent instead.
                            first_logprob: prefilled.logprob.filter(|_| !resuming),
                        })
                    }
                    None => {
                        tracing::warn!("no prefill worker can take the prompt; prefilling on the decode worker");
                        metrics::count(metrics::LOCAL_PREFILL_FALLBACKS_TOTAL, 1);
                        route.reason = "prefill_failed".to_string();
                        // Its reservation goes; the decode call below prefills from scratch.
                        let abort = v1::AbortRequest {
                            request_id: request_id.clone(),
                        };
                        decode.abort(abort).await?;
                        reserved_cached = 0;
                        None
                    }
                }
            }
        };
        let mut stream = decode
            .decode(v1::DecodeRequest {
                request_id: request_id.clone(),
                token_ids: self.tokens.clone(),
                handoff,
                sampling: self.req.sampling.clone(),
                stopping: self.req.stopping.clone(),
                logprobs,
                skip_special_tokens: self.req.skip_special_tokens,
                generated_token_ids: resumed,
            })
            .await?
            .into_inner();
        let label = self.label.clone().unwrap_or_else(|| request_id.clone());
        let mut started = false;
        while let Some(chunk) = stream.message().await? {
            if !chunk.token_ids.is_empty() {
                if resuming && !std::mem::replace(&mut started, true) {
                    // The new decode worker has computed the prompt.
                    self.shared.router().first_token(self.routed.ticket);
                }
                self.sent_tokens(chunk.token_ids.len());
                self.streamed.extend_from_slice(&chunk.token_ids);
            }
            let usage = chunk.usage.map(|mut u| {
                u.cached_tokens = u.cached_tokens.max(reserved_cached);
                u
            });
            let first = !std::mem::replace(&mut self.sent, true);
            let prompt_tokens = first.then_some(self.tokens.len() as u32);
            let prompt_token_ids = match first && scoring {
                true => self.tokens.clone(),
                false => Vec::new(),
            };
            let response = v1::GenerateResponse {
                request_id: label.clone(),
                text: chunk.text,
                token_ids: chunk.token_ids,
                logprobs: chunk.logprobs,
                finish_reason: chunk.finish_reason,
                usage,
                prompt_logprobs: chunk.prompt_logprobs,
                prompt_token_ids,
                prompt_tokens,
                route: first.then(|| route.clone()),
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
        let model = self.shared.config().served_model();
        match self.last_token {
            None => {
                self.first_token = Some(now);
                self.shared.router().first_token(self.routed.ticket);
                let ttft = now - self.arrived;
                metrics::model_duration(metrics::TIME_TO_FIRST_TOKEN_SECONDS, model, ttft);
            }
            Some(last) => {
                metrics::model_duration(metrics::INTER_TOKEN_LATENCY_SECONDS, model, now - last)
            }
        }
        self.last_token = Some(now);
        self.generated += n as u64;
        metrics::model_count(metrics::GENERATION_TOKENS_TOTAL, model, n as u64);
    }
}

/// Aborts request `request_id` on the worker at `address` (best effort, at most
/// [`ABORT_TIMEOUT`]).
async fn abort(shared: &Shared, request_id: &str, address: &str) {
    let abort = v1::AbortRequest {
        request_id: request_id.to_string(),
    };
    if let Ok(mut client) = shared.client(address) {
        let _ = tokio::time::timeout(ABORT_TIMEOUT, client.abort(abort)).await;
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

    use super::{public, transfer_backend};

    #[test]
    fn server_faults_reach_clients_as_stable_sentences_with_the_id() {
        let transport =
            tonic::Status::unavailable("tcp connect error: Connection refused (os 111)");
        let told = public(transport, "cmpl-7");
        assert_eq!(told.code(), tonic::Code::Unavailable);
        assert_eq!(
            told.message(),
            "a worker serving the request stopped answering; retry it (request cmpl-7)"
        );
        // A stream broken under the router (tonic says UNKNOWN): the worker stopped answering.
        let broken = public(
            tonic::Status::unknown("h2 protocol error: error reading a body"),
            "x",
        );
        assert_eq!(broken.code(), tonic::Code::Unavailable);
        assert_eq!(
            broken.message(),
            "a worker serving the request stopped answering; retry it (request x)"
        );
        let internal = public(tonic::Status::internal("hyper::Error(Io, ..)"), "x");
        assert_eq!(
            internal.message(),
            "the cluster failed the request (request x)"
        );
        // Pages a decode worker refused (the prefill worker's DATA_LOSS), a misconfigured peer
        // or a lost reservation: the cluster's fault, never its address.
        for status in [
            tonic::Status::data_loss("page push to 10.0.0.7:50061: status: InvalidArgument"),
            tonic::Status::failed_precondition("KV-format fingerprint 1 differs at 10.0.0.7"),
            tonic::Status::not_found("no pending reservation 3"),
            tonic::Status::unauthenticated("page push to 10.0.0.7:50061: missing token"),
            tonic::Status::aborted("request router-1 was aborted"),
        ] {
            let told = public(status, "x");
            assert_eq!(told.code(), tonic::Code::Internal);
            assert_eq!(told.message(), "the cluster failed the request (request x)");
        }
        let dropped = public(tonic::Status::cancelled("h2 stream reset by 10.0.0.7"), "x");
        assert_eq!(dropped.code(), tonic::Code::Unavailable);
        // A refusal keeps its message, which names the field.
        let refused = tonic::Status::invalid_argument("max_tokens must be at least 1, got 0");
        assert_eq!(
            public(refused, "x").message(),
            "max_tokens must be at least 1, got 0"
        );
    }

    #[test]
    fn a_request_out_of_resumes_is_told_so_with_its_id() {
        let told = super::exhausted(1, "cmpl-9");
        assert_eq!(told.code(), tonic::Code::Unavailable);
        assert_eq!(
            told.message(),
            "the request's decode worker failed mid-stream after it had been resumed once, the \
             most this router allows; retry it (request cmpl-9)"
        );
        assert!(super::exhausted(0, "x")
            .message()
            .contains("resumed 0 times"));
    }

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
            draining: false,
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
