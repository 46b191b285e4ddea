//! Serving the router: the `Inference` service, `grpc.health.v1` and server reflection on a
//! listener the caller bound, with membership followed from a [`Discovery`] watch.

use std::future::Future;
use std::sync::Arc;

use nibble_discovery::Discovery;
use nibble_proto::v1::inference_server::InferenceServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

use crate::service::{follow_membership, InferenceService, ServiceConfig, Shared};

/// Why serving failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Router(#[from] crate::Error),
    #[error("reflection: {0}")]
    Reflection(String),
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
}

/// Serves the router on `listener` until `shutdown` completes, following worker membership
/// from `discovery`.
pub async fn serve(
    listener: TcpListener,
    config: ServiceConfig,
    discovery: Arc<dyn Discovery>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve_shared(listener, Shared::new(config)?, discovery, shutdown).await
}

/// [`serve`] over state the caller made (and may inspect: the router, its index).
pub async fn serve_shared(
    listener: TcpListener,
    shared: Arc<Shared>,
    discovery: Arc<dyn Discovery>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let membership = tokio::spawn(follow_membership(Arc::clone(&shared), discovery));
    let (health, health_service) = nibble_proto::serving::health();
    health
        .set_serving::<InferenceServer<InferenceService>>()
        .await;
    let reflection =
        nibble_proto::serving::reflection().map_err(|e| ServeError::Reflection(e.to_string()))?;
    let router = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection)
        .add_service(InferenceServer::new(InferenceService(shared)));
    let result = nibble_proto::serving::serve_with_drain(
        |stop| router.serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop),
        shutdown,
        nibble_proto::serving::DRAIN_GRACE,
    )
    .await;
    membership.abort();
    result.map_err(Into::into)
}
