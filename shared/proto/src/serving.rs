//! What every nibble gRPC server serves next to its own API: `grpc.health.v1` and server
//! reflection (v1) covering the `nibble.v1` services and the health service; and how every
//! server stops ([`serve_with_drain`]).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::server::HealthReporter;
use tonic_reflection::server::v1::{ServerReflection, ServerReflectionServer};

/// The reflection service, describing every `nibble.v1` file and `grpc.health.v1`.
pub fn reflection(
) -> Result<ServerReflectionServer<impl ServerReflection>, tonic_reflection::server::Error> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
}

/// The health service and the reporter that sets its statuses. The overall status ("") starts
/// SERVING; a service marks itself with [`HealthReporter::set_serving`] once it is ready.
pub fn health() -> (HealthReporter, HealthServer<impl Health>) {
    tonic_health::server::health_reporter()
}

/// Completes when the process is asked to stop: Ctrl-C (SIGINT) or SIGTERM (what Kubernetes and
/// `docker stop` send).
pub async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// The connections a server accepts on `listener`, with `TCP_NODELAY` set: a gRPC response
/// (headers, data, trailers) goes out as several small writes, which Nagle's algorithm would
/// otherwise hold back until the peer's delayed ACK, some 40 ms.
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// How long a stopping server waits for open calls (token streams, KV-event subscriptions) to
/// end before it closes them.
pub const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// The signal a server built by [`serve_with_drain`] stops accepting on.
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs the server `serve` builds until `shutdown` completes, then lets open calls finish for at
/// most `grace` before returning (dropping whatever is still open). Long-lived streams, such as
/// a router's KV-event subscription, would otherwise keep a graceful shutdown waiting forever.
pub async fn serve_with_drain<F, E>(
    serve: impl FnOnce(StopSignal) -> F,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> Result<(), E>
where
    F: Future<Output = Result<(), E>>,
{
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = serve(Box::pin(async move {
        let _ = stopped.await;
    }));
    tokio::pin!(serving, shutdown);
    tokio::select! {
        result = &mut serving => return result,
        () = &mut shutdown => {}
    }
    let _ = stop.send(());
    match tokio::time::timeout(grace, serving).await {
        Ok(result) => result,
        Err(_) => Ok(()),
    }
}

/// Whether a failure with `code` is the server's (worth a WARN in its log) rather than the
/// client's (a bad argument, a missing or refused thing, a cancellation: logged at info or debug,
/// so a client cannot flood the warnings).
pub fn is_server_fault(code: tonic::Code) -> bool {
    use tonic::Code;
    matches!(
        code,
        Code::Internal
            | Code::Unknown
            | Code::DataLoss
            | Code::Unavailable
            | Code::DeadlineExceeded
    )
}

#[cfg(test)]
mod drain_tests {
    use super::*;

    #[tokio::test]
    async fn a_server_that_never_drains_is_stopped_after_the_grace() {
        let started = std::time::Instant::now();
        let result: Result<(), ()> = serve_with_drain(
            |_stop| std::future::pending(),
            async {},
            Duration::from_millis(50),
        )
        .await;
        assert!(result.is_ok());
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_server_that_drains_returns_its_result() {
        let result: Result<(), &str> = serve_with_drain(
            |stop| async move {
                stop.await;
                Err("drained")
            },
            async {},
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(result, Err("drained"));
    }
}
