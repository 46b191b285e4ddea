//! `GET /metrics`: the Prometheus text exposition of the process's [`Metrics`], on a listener
//! the caller bound. Nothing else is served there.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::Metrics;

/// The exposition format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How often histogram samples are drained into buckets between scrapes.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Binds the metrics listener; the error names the flag that gave `address`.
pub async fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    crate::listen::bind("--metrics-listen", address).await
}

/// Serves `GET /metrics` from `metrics` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    metrics: &'static Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = axum::Router::new()
        .route("/metrics", route(metrics))
        .fallback(|| async { (StatusCode::NOT_FOUND, "nibble serves GET /metrics here\n") });
    let upkeep = tokio::spawn(upkeep(metrics));
    let served = axum::serve(listener, app.into_make_service())
        .with_graceful_shutdown(shutdown)
        .await;
    upkeep.abort();
    served
}

/// `GET /metrics` of `metrics`, to add to any axum router (the router's HTTP API serves it too).
/// Whoever serves it runs [`upkeep`] beside it.
pub fn route<S: Clone + Send + Sync + 'static>(
    metrics: &'static Metrics,
) -> axum::routing::MethodRouter<S> {
    get(move || async move {
        let body = metrics.render().await;
        ([(header::CONTENT_TYPE, CONTENT_TYPE)], body)
    })
}

/// Drains histogram samples into their buckets every few seconds, forever (abort the task
/// that runs it to stop).
pub async fn upkeep(metrics: &'static Metrics) {
    let mut ticks = tokio::time::interval(UPKEEP_INTERVAL);
    loop {
        ticks.tick().await;
        metrics.upkeep();
    }
}

/// A metrics endpoint served in the background; dropping it stops it.
#[derive(Debug)]
pub struct MetricsServer {
    address: SocketAddr,
    task: JoinHandle<()>,
}

impl MetricsServer {
    /// The address it listens on.
    pub fn address(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a binary's `--metrics-listen` / `--no-metrics` flags do: unless `address` is `None`,
/// binds it, serves `/metrics` there in the background ([`spawn`]) and prints
/// `{who} metrics on ADDRESS` on stdout (the bound address, so port 0 can be found).
pub async fn start(
    address: Option<SocketAddr>,
    who: &str,
) -> std::io::Result<Option<MetricsServer>> {
    let Some(address) = address else {
        return Ok(None);
    };
    start_bound(Some(bind(address).await?), who)
}

/// [`start`] on a listener bound earlier ([`bind`]: a binary binds every port before it loads
/// anything), or nothing when `None`.
pub fn start_bound(
    listener: Option<TcpListener>,
    who: &str,
) -> std::io::Result<Option<MetricsServer>> {
    let Some(listener) = listener else {
        return Ok(None);
    };
    let server = spawn(listener)?;
    println!("{who} metrics on {}", server.address());
    Ok(Some(server))
}

/// Installs the process's recorder and serves `/metrics` on `listener` in the background until
/// the returned [`MetricsServer`] is dropped.
pub fn spawn(listener: TcpListener) -> std::io::Result<MetricsServer> {
    let address = listener.local_addr()?;
    let metrics = crate::install();
    let task = tokio::spawn(async move {
        if let Err(e) = serve(listener, metrics, std::future::pending()).await {
            tracing::error!(error = %e, "the metrics endpoint stopped");
        }
    });
    Ok(MetricsServer { address, task })
}
