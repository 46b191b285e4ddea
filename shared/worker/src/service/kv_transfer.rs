//! The receiving and sending ends of page transfers on [`WorkerState`]: the `KvTransfer` service
//! of decode workers (the gRPC stream, and the NCCL control calls), and the prefill worker's
//! choice between NCCL and the gRPC stream for one request.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use nibble_engine::scheduler::SeqId;
use nibble_kvcache::PageId;
use nibble_proto::v1;
use nibble_proto::v1::kv_transfer_server::KvTransfer;
use nibble_proto::v1::nccl_pages_progress::Stage;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use super::{Call, WorkerState};
use crate::error::{Error, Result};
use crate::metrics::{self, Direction};
use crate::transfer::{self, PushSummary};

type ProgressStream = Pin<Box<dyn Stream<Item = Result<v1::NcclPagesProgress, Status>> + Send>>;

impl WorkerState {
    /// Moves a prefilled request's `pages` to `target`: over NCCL when the router allowed it and
    /// this worker has it, falling back to the gRPC stream when NCCL fails for this request.
    pub(super) async fn push(
        &self,
        request_id: &str,
        target: &v1::TransferTarget,
        pages: &[PageId],
    ) -> Result<PushSummary> {
        let role = metrics::role_label(self);
        let wants_nccl = target.backend == v1::TransferBackend::Nccl as i32;
        if let (true, Some(nccl)) = (wants_nccl, self.nccl()) {
            match nccl
                .send_pages(&self.engine, &self.peers, request_id, target, pages)
                .await
            {
                Ok(summary) => {
                    self.counters.pushed(&summary);
                    tracing::info!(
                        to = %target.address,
                        reservation = target.reservation_id,
                        pages = summary.pages,
                        bytes = summary.bytes,
                        micros = summary.duration.as_micros() as u64,
                        "sent pages over NCCL"
                    );
                    return Ok(summary);
                }
                // Pages the decode worker refused would be refused over gRPC too: it
                // released the reservation.
                Err(failure) if failure.error.is_refusal() => return Err(failure.error),
                Err(failure) => {
                    self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
                    metrics::fallback(role, failure.reason);
                    tracing::warn!(
                        to = %target.address,
                        reason = failure.reason,
                        error = %failure.error,
                        "NCCL transfer failed; falling back to the gRPC stream"
                    );
                }
            }
        } else if wants_nccl {
            tracing::debug!("NCCL allowed but not set up on this worker: using the gRPC stream");
        }
        transfer::push_pages(
            &self.engine,
            &self.peers,
            request_id,
            target,
            pages,
            &self.counters,
        )
        .await
    }

    async fn receive(
        &self,
        mut stream: Streaming<v1::PushPagesRequest>,
    ) -> Result<v1::PushPagesResponse> {
        let start = Instant::now();
        let Some(first) = stream.message().await.map_err(push_status)? else {
            return Err(Error::InvalidArgument(
                "the stream carried no message".into(),
            ));
        };
        let theirs = first.kv_format_fingerprint.ok_or_else(|| {
            Error::InvalidArgument("kv_format_fingerprint is required on the first message".into())
        })?;
        self.check_fingerprint(theirs)?;
        let reservation = first.reservation_id;
        let request_id = self
            .reservations
            .request_id(reservation)
            .ok_or(Error::UnknownReservation(reservation))?;
        tracing::Span::current().record("request_id", tracing::field::display(&request_id));
        let mut claimed = Vec::new();
        let received = self
            .receive_pages(reservation, first, &mut stream, &mut claimed)
            .await;
        let (pages, bytes, complete) = match received {
            Ok(totals) => totals,
            Err(e) => return Err(self.failed_push(reservation, &claimed, e).await),
        };
        let role = metrics::role_label(self);
        metrics::transfer_duration(role, Direction::Received, start.elapsed());
        metrics::transfer_backend(role, Direction::Received, v1::TransferBackend::Grpc);
        tracing::info!(
            reservation,
            pages,
            bytes,
            complete,
            micros = start.elapsed().as_micros() as u64,
            "received pages"
        );
        Ok(v1::PushPagesResponse {
            pages: pages as u32,
            bytes,
            complete,
        })
    }

    /// Reads a push's messages from `first` on: claims each message's pages, checks their
    /// bytes, writes them into the reservation. Returns the pages and bytes received and
    /// whether the reservation is complete; `claimed` collects the pages claimed so far.
    async fn receive_pages(
        &self,
        reservation: u64,
        first: v1::PushPagesRequest,
        stream: &mut Streaming<v1::PushPagesRequest>,
        claimed: &mut Vec<u32>,
    ) -> Result<(usize, u64, bool)> {
        let role = metrics::role_label(self);
        let page_bytes = self.engine.info().page_bytes;
        let (mut pages, mut bytes, mut complete) = (0usize, 0u64, false);
        let mut next = Some(first);
        while let Some(message) = next {
            if message.reservation_id != 0 && message.reservation_id != reservation {
                return Err(Error::InvalidArgument(format!(
                    "reservation_id changed from {reservation} to {} mid-stream",
                    message.reservation_id
                )));
            }
            let claim = self
                .reservations
                .claim(reservation, &message.page_indices)?;
            claimed.extend_from_slice(&claim.indices);
            let len = message.data.len() as u64;
            // Checked off the engine thread, before a byte is written.
            claim.check(&message.data, page_bytes)?;
            self.engine
                .import_pages(SeqId(reservation), claim.targets.clone(), message.data)
                .await?;
            complete = self.reservations.fill(reservation, &claim)?;
            pages += claim.indices.len();
            bytes += len;
            let count = claim.indices.len() as u64;
            self.counters.received(count, len);
            metrics::transfer(role, Direction::Received, count, len);
            next = stream.message().await.map_err(push_status)?;
        }
        Ok((pages, bytes, complete))
    }

    /// What a failed push leaves: a refused one (pages that are not the reservation's, or
    /// bytes no writer produces) releases its reservation at once, so nothing of it is ever
    /// decoded or cached and its pages return to the pool; one that broke off (the sender or
    /// the link went away) gives its pages back for a retry. Returns the error to answer.
    async fn failed_push(&self, reservation: u64, claimed: &[u32], error: Error) -> Error {
        let Some(reason) = refusal(&error) else {
            self.reservations.unclaim(reservation, claimed);
            return error;
        };
        metrics::refused(metrics::role_label(self), reason);
        tracing::warn!(reservation, reason, %error, "refused pages: reservation released");
        if let Some(p) = self.reservations.remove(reservation) {
            let id = SeqId(reservation);
            self.forget(&p.request_id, id);
            if let Err(e) = self.engine.abort(id).await {
                tracing::warn!(reservation, error = %e, "releasing the reservation failed");
            }
        }
        error
    }

    /// The receiving end of an NCCL transfer (see `transfer::nccl`): checks, `ready`, the
    /// receive, the scatter into the reserved pages, `done`.
    async fn receive_nccl(self: &Arc<Self>, r: v1::NcclPagesRequest) -> Result<ProgressStream> {
        let nccl = self
            .nccl()
            .cloned()
            .ok_or_else(|| Error::NcclUnavailable("not set up".into()))?;
        self.check_fingerprint(r.kv_format_fingerprint)?;
        let page_bytes = self.engine.info().page_bytes;
        if r.page_bytes as usize != page_bytes {
            return Err(Error::InvalidArgument(format!(
                "page_bytes: this worker's pages are {page_bytes} bytes, not {}",
                r.page_bytes
            )));
        }
        if r.page_indices.is_empty() {
            return Err(Error::InvalidArgument(
                "page_indices must not be empty".into(),
            ));
        }
        let reservation = r.reservation_id;
        let request_id = self
            .reservations
            .request_id(reservation)
            .ok_or(Error::UnknownReservation(reservation))?;
        tracing::Span::current().record("request_id", tracing::field::display(&request_id));
        let claim = match self.reservations.claim(reservation, &r.page_indices) {
            Ok(claim) => claim,
            Err(e) => return Err(self.failed_push(reservation, &[], e).await),
        };
        let mut pair = match nccl.receiver(&r.sender_id, r.generation).await {
            Ok(pair) => pair,
            Err(e) => {
                self.reservations.unclaim(reservation, &claim.indices);
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::channel(2);
        let state = Arc::clone(self);
        let bytes = r.page_indices.len() * page_bytes;
        tokio::spawn(
            async move {
                let start = Instant::now();
                let ready = Stage::Ready(v1::NcclReady {
                    bytes: bytes as u64,
                });
                let progress = |stage| v1::NcclPagesProgress { stage: Some(stage) };
                if tx.send(Ok(progress(ready))).await.is_err() {
                    // The sender left before anything was posted.
                    state.reservations.unclaim(reservation, &claim.indices);
                    return;
                }
                let received = async {
                    let mut staging = nccl.recv(&r.sender_id, &mut pair, bytes).await?;
                    // The next transfer of the pair may start.
                    drop(pair);
                    // The engine checks the pages (on a host copy of a device buffer) before
                    // it writes them, and that the reservation still holds them (an Abort or
                    // the TTL may have taken it meanwhile).
                    let (targets, check) = (claim.targets.clone(), claim.clone());
                    let check = Box::new(move |data: &[u8]| check.check(data, page_bytes));
                    let owner = SeqId(reservation);
                    let buffer = staging.take_out()?;
                    let (buffer, scattered) = state
                        .engine
                        .scatter_staging(owner, targets, buffer, check)
                        .await;
                    if let Some(buffer) = buffer {
                        // Back to the pool when `staging` drops.
                        staging.restore(buffer);
                    }
                    scattered?;
                    state.reservations.fill(reservation, &claim)
                }
                .await;
                let received = match received {
                    Err(e) => Err(state.failed_push(reservation, &claim.indices, e).await),
                    ok => ok,
                };
                let result = match received {
                    Ok(complete) => {
                        let role = metrics::role_label(&state);
                        let pages = r.page_indices.len() as u64;
                        state.counters.received(pages, bytes as u64);
                        metrics::transfer(role, Direction::Received, pages, bytes as u64);
                        metrics::transfer_duration(role, Direction::Received, start.elapsed());
                        metrics::transfer_backend(
                            role,
                            Direction::Received,
                            v1::TransferBackend::Nccl,
                        );
                        tracing::info!(
                            reservation,
                            pages,
                            bytes,
                            complete,
                            micros = start.elapsed().as_micros() as u64,
                            "received pages over NCCL"
                        );
                        Ok(progress(Stage::Done(v1::PushPagesResponse {
                            pages: pages as u32,
                            bytes: bytes as u64,
                            complete,
                        })))
                    }
                    Err(e) => {
                        tracing::warn!(reservation, error = %e, "NCCL receive failed");
                        Err(Status::from(e))
                    }
                };
                let _ = tx.send(result).await;
            }
            .in_current_span(),
        );
        Ok(Box::pin(ReceiverStream::new(rx)))
    }
}

/// A push stream's failure: a message that does not decode is the sender's fault
/// (INVALID_ARGUMENT from the codec); anything else broke the stream.
fn push_status(status: Status) -> Error {
    match status.code() {
        tonic::Code::InvalidArgument => {
            Error::InvalidArgument(format!("a PushPages message: {}", status.message()))
        }
        _ => Error::Aborted(format!("page stream broke: {status}")),
    }
}

/// Whether `error` refuses a push for what it sent (its `reason` label), rather than the
/// stream or the engine failing.
fn refusal(error: &Error) -> Option<&'static str> {
    use nibble_kvfmt::check::Check;
    Some(match error {
        Error::BadPage { fault, .. } => match fault.check {
            Check::Nvfp4Scale(_) => "nvfp4_scale",
            Check::Fp8Element(_) => "fp8_element",
            Check::Bf16Element(_) => "bf16_element",
            Check::WindowValue(_) => "window_value",
            Check::Length { .. } | Check::Index { .. } => "page",
        },
        Error::DuplicatePage(_) => "duplicate_page",
        Error::InvalidArgument(_) => "invalid",
        _ => return None,
    })
}

/// The `KvTransfer` gRPC service of a decode worker.
#[derive(Clone)]
pub struct TransferService(pub Arc<WorkerState>);

#[tonic::async_trait]
impl KvTransfer for TransferService {
    async fn push_pages(
        &self,
        request: Request<Streaming<v1::PushPagesRequest>>,
    ) -> Result<Response<v1::PushPagesResponse>, Status> {
        // The request id is known once the first message names the reservation.
        let span = tracing::info_span!(
            "request",
            request_id = tracing::field::Empty,
            call = "push_pages"
        );
        async {
            let call = Call::start(&self.0, "push_pages");
            call.end(self.0.receive(request.into_inner()).await)
                .map(Response::new)
        }
        .instrument(span)
        .await
    }

    async fn nccl_connect(
        &self,
        request: Request<v1::NcclConnectRequest>,
    ) -> Result<Response<v1::NcclConnectResponse>, Status> {
        let request = request.into_inner();
        let span = tracing::info_span!("nccl_connect", peer = %request.sender_id);
        async {
            let call = Call::start(&self.0, "nccl_connect");
            let result = match self.0.nccl() {
                Some(nccl) => nccl.accept(request).await,
                None => Err(Error::NcclUnavailable("not set up".into())),
            };
            call.end(result).map(Response::new)
        }
        .instrument(span)
        .await
    }

    type NcclPagesStream = ProgressStream;

    async fn nccl_pages(
        &self,
        request: Request<v1::NcclPagesRequest>,
    ) -> Result<Response<Self::NcclPagesStream>, Status> {
        let request = request.into_inner();
        let span = tracing::info_span!(
            "request",
            request_id = tracing::field::Empty,
            call = "nccl_pages"
        );
        async {
            let call = Call::start(&self.0, "nccl_pages");
            call.end(self.0.receive_nccl(request).await)
                .map(Response::new)
        }
        .instrument(span)
        .await
    }
}
