//! One connection under the limits: [`Guarded`], its I/O, which ends it when a deadline passes or
//! the listener evicts it, and [`ConnectionUse`], what it shares with its requests (through
//! axum's `ConnectInfo`) and with the listener.
//!
//! The connection's clock has three states. Between requests it is *idle*: it is closed after
//! `idle_timeout` without a byte. From the first byte of a request, while no request of it has
//! begun, it is *reading headers*: it is closed `header_timeout` after that byte, however
//! steadily the bytes come (a client trickling headers is not idle). From the moment the API
//! begins a request ([`ConnectionUse::start_request`], by the middleware, once hyper has the
//! headers) until the answer's last byte is handed over, the connection has no clock of its own:
//! the body deadline ([`super::request`]) and then the answer govern it.
//!
//! Each read or write that moves bytes only notes the time; the timer is moved (once per period
//! at most) when it fires early, so the hot path of a streamed answer costs a clock read.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use super::{ConnectionLimits, Place};
use crate::metrics::{self, ConnectionClosed};

/// What a connection's requests and its listener know of it.
#[derive(Debug, Clone)]
pub struct ConnectionUse(Arc<Usage>);

#[derive(Debug)]
struct Usage {
    /// The listener's epoch: `last_active` counts milliseconds since.
    epoch: Instant,
    last_active: AtomicU64,
    /// Requests begun and not yet answered to their last byte.
    requests: AtomicUsize,
    /// Of those, the ones whose body has arrived: these are being answered.
    working: AtomicUsize,
    /// Requests ever begun on the connection (a change ends the headers' deadline).
    started: AtomicU64,
}

impl ConnectionUse {
    pub(super) fn new(epoch: Instant) -> Self {
        let usage = Self(Arc::new(Usage {
            epoch,
            last_active: AtomicU64::new(0),
            requests: AtomicUsize::new(0),
            working: AtomicUsize::new(0),
            started: AtomicU64::new(0),
        }));
        usage.touch();
        usage
    }

    /// Notes that bytes moved (or a request ended) now.
    pub(super) fn touch(&self) {
        let millis = self.0.epoch.elapsed().as_millis() as u64;
        self.0.last_active.store(millis, Ordering::Relaxed);
    }

    /// When bytes last moved, in milliseconds since the listener's epoch.
    pub(super) fn last_active(&self) -> u64 {
        self.0.last_active.load(Ordering::Relaxed)
    }

    /// Whether the listener may close it for a new connection: no request of it is being
    /// answered (it is idle, or its request has not arrived whole).
    pub(super) fn evictable(&self) -> bool {
        self.0.working.load(Ordering::Relaxed) == 0
    }

    /// A request begins on the connection (its headers have arrived), until the guard is
    /// dropped with the answer's last byte.
    pub fn start_request(&self) -> RequestGuard {
        self.0.requests.fetch_add(1, Ordering::Relaxed);
        self.0.started.fetch_add(1, Ordering::Relaxed);
        RequestGuard {
            usage: Arc::clone(&self.0),
            working: false,
        }
    }
}

/// One request of a connection, from its headers to its answer's last byte.
#[derive(Debug)]
pub struct RequestGuard {
    usage: Arc<Usage>,
    working: bool,
}

impl RequestGuard {
    /// The request's body has arrived: it is being answered, and its connection is no longer
    /// one the listener may close for another.
    pub fn working(mut self) -> Self {
        if !std::mem::replace(&mut self.working, true) {
            self.usage.working.fetch_add(1, Ordering::Relaxed);
        }
        self
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if self.working {
            self.usage.working.fetch_sub(1, Ordering::Relaxed);
        }
        self.usage.requests.fetch_sub(1, Ordering::Relaxed);
        ConnectionUse(Arc::clone(&self.usage)).touch();
    }
}

/// A connection holding its [`Place`] under the cap, ended by its deadlines ([module
/// docs](self)) or when the listener evicts it.
pub struct Guarded<IO> {
    io: IO,
    place: Place,
    idle: Duration,
    header: Duration,
    deadline: Pin<Box<Sleep>>,
    /// When bytes last moved (or a request of it was last seen being handled).
    last: Instant,
    /// When the headers being read began, and the count of requests begun then.
    head: Option<(Instant, u64)>,
    /// The listener closed it for another (its signal is not polled again).
    evicted: bool,
}

impl<IO> Guarded<IO> {
    pub(super) fn new(io: IO, place: Place, limits: ConnectionLimits) -> Self {
        Self {
            io,
            place,
            idle: limits.idle_timeout,
            header: limits.header_timeout,
            deadline: Box::pin(tokio::time::sleep(limits.idle_timeout)),
            last: Instant::now(),
            head: None,
            evicted: false,
        }
    }

    /// What the connection shares with its requests.
    pub fn usage(&self) -> ConnectionUse {
        self.place.usage.clone()
    }

    fn usage_now(&self) -> (usize, u64) {
        let usage = &self.place.usage.0;
        (
            usage.requests.load(Ordering::Relaxed),
            usage.started.load(Ordering::Relaxed),
        )
    }

    /// Notes bytes read now: bytes read while no request has begun are a request's headers,
    /// and the first of them starts the headers' deadline.
    fn read_bytes(&mut self) {
        let now = Instant::now();
        self.last = now;
        self.place.usage.touch();
        let (requests, started) = self.usage_now();
        if requests == 0 && !matches!(self.head, Some((_, begun)) if begun == started) {
            self.head = Some((now, started));
        }
    }

    /// Pending, unless the connection must end: evicted, or past a deadline.
    fn check(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        if self.evicted || Pin::new(&mut self.place.evicted).poll(cx).is_ready() {
            self.evicted = true;
            return Poll::Ready(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed for a new connection: the connection limit was reached",
            ));
        }
        let (requests, started) = self.usage_now();
        if requests > 0 {
            // A request is being read or answered: neither idle nor reading headers.
            self.last = Instant::now();
            self.head = None;
        }
        let head_due = match self.head {
            Some((since, begun)) if begun == started => Some(since + self.header),
            _ => {
                self.head = None;
                None
            }
        };
        loop {
            let idle_due = self.last + self.idle;
            let due = head_due.map_or(idle_due, |head| head.min(idle_due));
            let now = Instant::now();
            if due <= now {
                let (why, what) = match head_due {
                    Some(head) if head <= idle_due => (
                        ConnectionClosed::HeaderTimeout,
                        "the request's headers did not arrive in time",
                    ),
                    _ => (
                        ConnectionClosed::IdleTimeout,
                        "the connection was idle too long",
                    ),
                };
                metrics::connection_closed(why);
                tracing::debug!(reason = why.as_str(), "closing an HTTP connection");
                return Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, what));
            }
            let set = self.deadline.deadline();
            if due < set || set <= now {
                self.deadline.as_mut().reset(due);
            }
            if self.deadline.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }

    /// A write's result, noting progress; a pending write counts towards the deadlines.
    fn wrote(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match polled {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.last = Instant::now();
                    self.place.usage.touch();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => self.check(cx).map(Err),
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
                    this.read_bytes();
                }
                Poll::Ready(result)
            }
            Poll::Pending => this.check(cx).map(Err),
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
