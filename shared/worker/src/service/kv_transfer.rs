//! The receiving and sending ends of page transfers on [`WorkerState`]: the `KvTransfer` service
//! of decode workers (the gRPC stream, and the NCCL control calls), and the prefill worker's
//! choice between NCCL and the gRPC stream for one request.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

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
            let targets = self
                .reservations
                .targets(reservation, &message.page_indices)?;
            let len = message.data.len() as u64;
            if message.data.len() != targets.len() * page_bytes {
                return Err(Error::InvalidArgument(format!(
                    "data must be {} pages of {page_bytes} bytes, got {len} bytes",
                    targets.len()
                )));
            }
            self.engine.import_pages(targets, message.data).await?;
            complete = self.reservations.mark(reservation, &message.page_indices)?;
            pages += message.page_indices.len();
            bytes += len;
            let count = message.page_indices.len() as u64;
            self.counters.received(count, len);
            metrics::transfer(role, Direction::Received, count, len);
            next = stream.message().await.map_err(push_status)?;
        }
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
        self.reservations.targets(reservation, &r.page_indices)?;
        let mut pair = nccl.receiver(&r.sender_id, r.generation).await?;
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
                    return; // the sender left before anything was posted
                }
                let received = async {
                    let staging = nccl.recv(&r.sender_id, &mut pair, bytes).await?;
                    // The next transfer of the pair may start.
                    drop(pair);
                    // Checked again: an Abort or the TTL may have taken the reservation
                    // meanwhile.
                    let targets = state.reservations.targets(reservation, &r.page_indices)?;
                    state.engine.scatter_staging(targets, staging).await?;
                    state.reservations.mark(reservation, &r.page_indices)
                }
                .await;
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

fn push_status(status: Status) -> Error {
    Error::Aborted(format!("page stream broke: {status}"))
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
