//! Serving the router: the `Inference` service, `grpc.health.v1` and server reflection on a
//! listener the caller bound, and optionally the OpenAI-compatible HTTP API on a second one,
//! with membership followed from a [`Discovery`] watch.
//!
//! Security comes from the [`ServiceConfig`]: with a certificate both APIs serve TLS (no client
//! certificates: the public's clients authenticate with the API key), and with an API key every
//! `Inference` call must carry `authorization: Bearer <key>` (UNAUTHENTICATED otherwise), as
//! every `/v1` HTTP request must. Health and reflection stay open (they change nothing).

use std::future::Future;
use std::sync::Arc;

use nibble_discovery::Discovery;
use nibble_proto::v1::inference_server::InferenceServer;
use nibble_security::{ClientCerts, RequireBearer};
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;

use crate::http::HttpConfig;
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
    #[error("HTTP API: {0}")]
    Http(std::io::Error),
    #[error(transparent)]
    Security(#[from] nibble_security::Error),
}

/// Largest `Inference` request message, in bytes (a prompt of about a million tokens); larger
/// ones fail OUT_OF_RANGE before they are decoded.
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

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

/// [`serve`], and the HTTP API on `http`'s listener when given.
pub async fn serve_with_http(
    listener: TcpListener,
    http: Option<HttpListener>,
    config: ServiceConfig,
    discovery: Arc<dyn Discovery>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve_shared_with_http(listener, http, Shared::new(config)?, discovery, shutdown).await
}

/// [`serve`] over state the caller made (and may inspect: the router, its index).
pub async fn serve_shared(
    listener: TcpListener,
    shared: Arc<Shared>,
    discovery: Arc<dyn Discovery>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve_shared_with_http(listener, None, shared, discovery, shutdown).await
}

/// The OpenAI-compatible HTTP API's listener and settings.
#[derive(Debug)]
pub struct HttpListener {
    pub listener: TcpListener,
    pub config: HttpConfig,
}

/// [`serve_shared`], and the HTTP API on `http`'s listener when given, until `shutdown`.
pub async fn serve_shared_with_http(
    listener: TcpListener,
    http: Option<HttpListener>,
    shared: Arc<Shared>,
    discovery: Arc<dyn Discovery>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    use tonic::server::NamedService;
    let reflection =
        nibble_proto::serving::reflection(&[InferenceServer::<InferenceService>::NAME])
            .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let tls = shared.config().security.tls.clone();
    let max_connections = shared.config().grpc_max_connections;
    let http_tls = match &tls {
        Some(tls) => tls.http_server(ClientCerts::None)?,
        None => None,
    };
    let mut builder = nibble_proto::serving::server();
    if let Some(tls) = tls.as_ref().and_then(|t| t.grpc_server(ClientCerts::None)) {
        builder = builder.tls_config(tls)?;
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let signal = move |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|&s| s).await;
    };
    let http = http.map(|HttpListener { listener, config }| {
        tokio::spawn(crate::http::serve_tls(
            listener,
            http_tls,
            Arc::clone(&shared),
            config,
            signal(stopped.clone()),
        ))
    });
    let stop_on_signal = stop.clone();
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_on_signal.send(true);
    });
    let membership = tokio::spawn(follow_membership(Arc::clone(&shared), discovery));
    let (health, health_service) = nibble_proto::serving::health();
    health
        .set_serving::<InferenceServer<InferenceService>>()
        .await;
    let api_key = RequireBearer::new(shared.config().api_key.clone(), "API key");
    let inference =
        InferenceServer::new(InferenceService(shared)).max_decoding_message_size(MAX_REQUEST_BYTES);
    let router = builder
        .add_service(health_service)
        .add_service(reflection.v1)
        .add_service(reflection.v1alpha)
        .add_service(InterceptedService::new(inference, api_key));
    let result = nibble_proto::serving::serve_with_drain(
        |stop| {
            let capped = nibble_proto::serving::incoming(listener, max_connections);
            router.serve_with_incoming_shutdown(capped, stop)
        },
        signal(stopped),
        nibble_proto::serving::DRAIN_GRACE,
    )
    .await;
    membership.abort();
    // The gRPC server is done (shut down or failed): so is the HTTP API.
    let _ = stop.send(true);
    if let Some(http) = http {
        // Open event streams get the same grace as gRPC calls.
        match tokio::time::timeout(nibble_proto::serving::DRAIN_GRACE, http).await {
            Err(_) | Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => return Err(ServeError::Http(e)),
            Ok(Err(e)) => return Err(ServeError::Http(std::io::Error::other(e))),
        }
    }
    result.map_err(Into::into)
}
