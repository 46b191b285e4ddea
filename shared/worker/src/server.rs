//! Serving a worker: its `Worker` and `KvTransfer` services (pages land only in a decode
//! worker's reservations, so a prefill worker has none to fill; it serves `KvTransfer` because it
//! may become a decode worker in place), `grpc.health.v1` and server reflection, on a listener the caller bound, until a shutdown future completes.
//!
//! With the state's [`Security`](nibble_security::Security): TLS when it has a certificate
//! (client certificates required when it has a CA), and every `Worker` and `KvTransfer` call
//! must carry the internal token when one is set (UNAUTHENTICATED otherwise). Health and
//! reflection need no token: they change nothing and say nothing about requests.

use std::future::Future;
use std::sync::Arc;

use nibble_proto::v1::kv_transfer_server::KvTransferServer;
use nibble_proto::v1::worker_server::WorkerServer;
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;

use crate::error::Result;
use crate::service::{TransferService, WorkerService, WorkerState};
use crate::AbortOnDrop;

/// Largest gRPC message accepted or sent: page pushes carry several pages per message.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Serves `state` on `listener` until `shutdown` completes (then open calls get
/// [`DRAIN_GRACE`](nibble_proto::serving::DRAIN_GRACE) to end), `KvTransfer` on the same listener.
/// If the engine stops, every service (and the overall
/// status) turns NOT_SERVING at once; the caller's `shutdown` should watch for it too
/// ([`EngineHandle::stopped`](crate::EngineHandle::stopped)) to leave the membership.
pub async fn serve(
    state: Arc<WorkerState>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let max_connections = nibble_proto::serving::DEFAULT_MAX_CONNECTIONS;
    serve_capped(state, listener, max_connections, shutdown).await
}

/// [`serve`] with at most `max_connections` connections open at once (more are closed as they
/// arrive).
pub async fn serve_capped(
    state: Arc<WorkerState>,
    listener: TcpListener,
    max_connections: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let (health, health_service) = nibble_proto::serving::health();
    health.set_serving::<WorkerServer<WorkerService>>().await;
    use tonic::server::NamedService;
    let served = [
        WorkerServer::<WorkerService>::NAME,
        KvTransferServer::<TransferService>::NAME,
    ];
    let reflection = nibble_proto::serving::reflection(&served)
        .map_err(|e| std::io::Error::other(format!("reflection: {e}")))?;
    let security = state.security().clone();
    let token = security.require_internal_token();
    let transfer = InterceptedService::new(
        KvTransferServer::new(TransferService(Arc::clone(&state)))
            .max_decoding_message_size(MAX_MESSAGE_BYTES),
        token.clone(),
    );
    health
        .set_serving::<KvTransferServer<TransferService>>()
        .await;
    let engine = state.engine().clone();
    let watchdog = tokio::spawn(async move {
        let reason = engine.stopped().await;
        tracing::error!(%reason, "the engine has stopped: health is NOT_SERVING");
        health
            .set_not_serving::<WorkerServer<WorkerService>>()
            .await;
        health
            .set_not_serving::<KvTransferServer<TransferService>>()
            .await;
        health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
    });
    let _watchdog = AbortOnDrop(watchdog);
    let worker = InterceptedService::new(
        WorkerServer::new(WorkerService(state))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
        token,
    );
    let mut builder = nibble_proto::serving::server()
        .initial_stream_window_size(crate::transfer::STREAM_WINDOW_BYTES)
        .initial_connection_window_size(crate::transfer::CONNECTION_WINDOW_BYTES);
    if let Some(tls) = security.internal_server_tls() {
        builder = builder.tls_config(tls)?;
    }
    let router = builder
        .add_service(health_service)
        .add_service(reflection.v1)
        .add_service(reflection.v1alpha)
        .add_service(worker)
        .add_service(transfer);
    nibble_proto::serving::serve_with_drain(
        |stop| {
            let incoming = nibble_proto::serving::incoming(listener, max_connections);
            router.serve_with_incoming_shutdown(incoming, stop)
        },
        shutdown,
        nibble_proto::serving::DRAIN_GRACE,
    )
    .await?;
    Ok(())
}
