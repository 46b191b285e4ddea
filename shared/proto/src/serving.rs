//! What every nibble gRPC server serves next to its own API: `grpc.health.v1` and server
//! reflection, in both its versions (`grpc.reflection.v1`, and `v1alpha`, the only one older
//! clients such as grpcurl 1.8 speak), listing exactly the services that server runs
//! ([`reflection`]); and how every server stops ([`serve_with_drain`]).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::server::HealthReporter;
use tonic_reflection::server::{v1, v1alpha};

/// The fully-qualified name of the health service, which every nibble server runs.
pub const HEALTH_SERVICE: &str = "grpc.health.v1.Health";
/// The fully-qualified names of the two reflection services, which every nibble server runs.
pub const REFLECTION_SERVICES: [&str; 2] = [
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

/// The reflection services of a server, v1 and v1alpha, to add to it side by side.
pub struct Reflection<V1, V1Alpha> {
    pub v1: v1::ServerReflectionServer<V1>,
    pub v1alpha: v1alpha::ServerReflectionServer<V1Alpha>,
}

/// The reflection services of a server that runs `services` (fully-qualified names, e.g.
/// `nibble.v1.Worker`; `<S as tonic::server::NamedService>::NAME`) besides health and
/// reflection: both versions list those, [`HEALTH_SERVICE`] and [`REFLECTION_SERVICES`], and
/// nothing else, and describe every `nibble.v1` file.
pub fn reflection(
    services: &[&str],
) -> Result<
    Reflection<impl v1::ServerReflection, impl v1alpha::ServerReflection>,
    tonic_reflection::server::Error,
> {
    let builder = || {
        let mut builder = tonic_reflection::server::Builder::configure()
            .include_reflection_service(false)
            .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(
                tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
            );
        let names = services
            .iter()
            .copied()
            .chain([HEALTH_SERVICE])
            .chain(REFLECTION_SERVICES);
        for name in names {
            builder = builder.with_service_name(name);
        }
        builder
    };
    Ok(Reflection {
        v1: builder().build_v1()?,
        v1alpha: builder().build_v1alpha()?,
    })
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

/// Connections a gRPC server keeps open at once, by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// How often a gRPC server pings a connection that sent nothing, and how long it waits for the
/// answer before it closes the connection: a dead peer (a killed process, a cut network) is
/// noticed within a minute instead of holding its streams open.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// A gRPC server builder with nibble's connection settings: HTTP/2 keep-alive pings
/// ([`KEEPALIVE_INTERVAL`], [`KEEPALIVE_TIMEOUT`]) and TCP keep-alive.
pub fn server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .tcp_keepalive(Some(Duration::from_secs(60)))
}

/// The connections a server accepts on `listener`, at most `max_connections` open at once
/// (more are closed as they arrive, logged at most once a second), with `TCP_NODELAY` set: a
/// gRPC response (headers, data, trailers) goes out as several small writes, which Nagle's
/// algorithm would otherwise hold back until the peer's delayed ACK, some 40 ms.
pub fn incoming(
    listener: tokio::net::TcpListener,
    max_connections: usize,
) -> impl tokio_stream::Stream<Item = std::io::Result<Capped<tokio::net::TcpStream>>> {
    use tokio_stream::StreamExt;
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(max_connections.max(1)));
    let refused = RefusalLog::new("gRPC");
    tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .filter_map(move |accepted| match accepted {
            Ok(tcp) => match std::sync::Arc::clone(&permits).try_acquire_owned() {
                Ok(permit) => Some(Ok(Capped {
                    io: tcp,
                    _permit: permit,
                })),
                Err(_) => {
                    refused.note();
                    None
                }
            },
            Err(e) => Some(Err(e)),
        })
}

/// A connection holding its place under a server's cap until it closes.
pub struct Capped<IO> {
    io: IO,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Capped<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Capped<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<IO: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Capped<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Counts events and logs them at most once per `period` (the first one at once), so that a
/// flood of them (connections refused or evicted at a listener's cap) cannot flood the log.
#[derive(Debug)]
pub struct PeriodicLog {
    period: Duration,
    count: std::sync::atomic::AtomicU64,
    last: std::sync::Mutex<Option<std::time::Instant>>,
}

impl PeriodicLog {
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            count: Default::default(),
            last: Default::default(),
        }
    }

    /// One more event; `log` is called with the total so far when a line is due.
    pub fn note(&self, log: impl FnOnce(u64)) {
        use std::sync::atomic::Ordering;
        let total = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|at| at.elapsed() >= self.period) {
            *last = Some(std::time::Instant::now());
            log(total);
        }
    }
}

/// Counts the connections a listener refused at its cap and logs them at most once a second.
#[derive(Debug)]
pub struct RefusalLog {
    what: &'static str,
    log: PeriodicLog,
}

impl RefusalLog {
    /// A log for the listener of `what` (`"HTTP"`, `"gRPC"`).
    pub fn new(what: &'static str) -> Self {
        Self {
            what,
            log: PeriodicLog::new(Duration::from_secs(1)),
        }
    }

    /// One more refused connection.
    pub fn note(&self) {
        self.log.note(|total| {
            tracing::warn!(
                listener = self.what,
                refused_total = total,
                "connection limit reached: refusing"
            )
        });
    }
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

#[cfg(test)]
mod periodic_log_tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn periodic_log_logs_the_first_event_then_at_most_once_a_period() {
        let log = PeriodicLog::new(Duration::from_secs(3600));
        let mut logged = Vec::new();
        for _ in 0..5 {
            log.note(|total| logged.push(total));
        }
        assert_eq!(logged, vec![1]);
        assert_eq!(log.count.load(Ordering::Relaxed), 5);
    }
}
