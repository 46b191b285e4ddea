//! Connection limits of the HTTP API: [`Limited`], an axum [`Listener`] over another that
//! caps the connections open at once and closes a connection that moves no byte, either way,
//! for its idle timeout.
//!
//! The idle timeout covers what a slow or hostile client does with a connection it holds: a
//! request's headers that stop arriving, a body declared and never sent, a keep-alive left open.
//! A streamed answer keeps its connection busy (tokens, and SSE keep-alive comments every 15 s),
//! so it is never cut while it runs. Past the cap a new connection gets `503` with `Connection:
//! close` and is closed; the refusals are logged at most once per second with their count.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use axum::serve::{IncomingStream, Listener};
use nibble_proto::serving::RefusalLog;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// The limits of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once; more are refused.
    pub max_connections: usize,
    /// How long a connection may move no byte before it is closed.
    pub idle_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// Connections open at once, by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// How long a connection may stay silent, by default.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// What a connection past the cap is told: a 503 in OpenAI's error shape.
fn refusal() -> Vec<u8> {
    let body = r#"{"error":{"message":"too many open connections","type":"server_error","param":null,"code":"service_unavailable"}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Retry-After: 1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A listener that holds its connections to [`ConnectionLimits`].
pub struct Limited<L> {
    inner: L,
    permits: Arc<Semaphore>,
    idle: Duration,
    refusals: Arc<RefusalLog>,
}

impl<L> Limited<L> {
    pub fn new(inner: L, limits: ConnectionLimits) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            idle: limits.idle_timeout,
            refusals: Arc::new(RefusalLog::new("HTTP")),
        }
    }
}

impl<L> Listener for Limited<L>
where
    L: Listener,
    L::Io: Unpin,
{
    type Io = Guarded<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (io, addr) = self.inner.accept().await;
            match Arc::clone(&self.permits).try_acquire_owned() {
                Ok(permit) => return (Guarded::new(io, permit, self.idle), addr),
                Err(_) => {
                    self.refusals.note();
                    let mut io = io;
                    tokio::spawn(async move {
                        let refuse = async {
                            io.write_all(&refusal()).await?;
                            io.shutdown().await
                        };
                        let _ = tokio::time::timeout(Duration::from_secs(1), refuse).await;
                    });
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// How many of a connection's requests are being handled, shared by the connection and its
/// handlers ([`hold_open`]).
#[derive(Debug, Clone, Default)]
pub struct ConnectionUse(Arc<AtomicUsize>);

impl<L> Connected<IncomingStream<'_, Limited<L>>> for ConnectionUse
where
    L: Listener,
    L::Io: Unpin,
{
    fn connect_info(stream: IncomingStream<'_, Limited<L>>) -> Self {
        stream.io().busy.clone()
    }
}

/// Marks the connection busy while a request is handled, so a long non-streamed answer is not
/// taken for an idle connection.
pub async fn hold_open(request: Request, next: Next) -> Response {
    let _busy = request
        .extensions()
        .get::<ConnectInfo<ConnectionUse>>()
        .map(|c| Busy::new(&c.0));
    next.run(request).await
}

/// One request being handled on a connection, until dropped (answered or abandoned).
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn new(conn: &ConnectionUse) -> Self {
        conn.0.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(&conn.0))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection holding its place under the cap, closed when it moves no byte for `idle`
/// while no request of it is being handled.
///
/// Each read or write that moves bytes only notes the time; the timer is moved (once per idle
/// period at most) when it fires early, so the hot path of a streamed answer costs a clock read.
pub struct Guarded<IO> {
    io: IO,
    _permit: OwnedSemaphorePermit,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    /// When bytes last moved (or a request of it was last seen being handled).
    last: Instant,
    busy: ConnectionUse,
}

impl<IO> Guarded<IO> {
    fn new(io: IO, permit: OwnedSemaphorePermit, idle: Duration) -> Self {
        Self {
            io,
            _permit: permit,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
            last: Instant::now(),
            busy: ConnectionUse::default(),
        }
    }

    /// Pending, unless the connection has been idle too long. A request being handled (a
    /// non-streamed answer being generated) moves no byte but is not idle.
    fn check_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        if self.busy.0.load(Ordering::Relaxed) > 0 {
            self.last = Instant::now();
        }
        while self.deadline.as_mut().poll(cx).is_ready() {
            let due = self.last + self.idle;
            if due <= Instant::now() {
                return Poll::Ready(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the connection was idle too long",
                ));
            }
            // Bytes moved since the timer was set: wait out the rest of the period.
            self.deadline.as_mut().reset(due);
        }
        Poll::Pending
    }

    /// A write's result, noting progress; a pending write counts towards the idle timeout.
    fn wrote(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match polled {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.last = Instant::now();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => self.check_idle(cx).map(Err),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Guarded<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                if buf.filled().len() > before {
                    this.last = Instant::now();
                }
                Poll::Ready(result)
            }
            Poll::Pending => this.check_idle(cx).map(Err),
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Guarded<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.wrote(cx, polled)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.wrote(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}
