//! Connection limits of the HTTP API: [`Limited`], an axum [`Listener`] over another, holds its
//! connections to [`ConnectionLimits`], and [`request::guard`], the outermost middleware, holds
//! each request to its body deadline.
//!
//! * **A cap that idle clients cannot fill.** At most `max_connections` are open at once. At the
//!   cap, a new connection closes the one, among those not being answered, that has moved no
//!   byte for the longest (an idle keep-alive, a connection that never sent a whole request), as
//!   nginx reclaims keep-alive connections when it runs out: whoever holds connections without
//!   using them cannot lock out probes or real clients. Only when every connection under the cap
//!   is being answered is a new one refused, `503` with `Connection: close`. Evictions and
//!   refusals are logged at most once per period, with their counts.
//! * **Deadlines** ([`conn`]): a request's headers must arrive within `header_timeout` of their
//!   first byte; a connection that moves no byte for `idle_timeout` while none of its requests is
//!   being answered is closed; and a request's whole body must arrive within `body_timeout` of
//!   its headers ([`request`]), else `408` and the connection is closed. A request being
//!   answered (a non-streamed answer being generated, a stream of tokens) is never cut.
//!
//! Every close and refusal is counted in [`crate::metrics::HTTP_CONNECTIONS_CLOSED_TOTAL`].

mod conn;
pub mod fds;
pub mod request;

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use nibble_proto::serving::{PeriodicLog, RefusalLog};
use tokio::io::AsyncWriteExt;
use tokio::sync::oneshot;
use tokio::time::Instant;

pub use conn::{ConnectionUse, Guarded};

use crate::metrics::{self, ConnectionClosed};

/// The limits of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once; past it, the longest-idle connection not being answered is
    /// closed, and only when there is none is the new one refused.
    pub max_connections: usize,
    /// How long a connection may move no byte, while no request of it is answered.
    pub idle_timeout: Duration,
    /// How long a request's headers may take, from their first byte to their last.
    pub header_timeout: Duration,
    /// How long a request's body may take, from its headers to its last byte.
    pub body_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: fds::DEFAULT_MAX_CONNECTIONS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
        }
    }
}

/// How long a connection may stay silent, by default.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a request's headers may take, by default.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request's body may take, by default (4 MiB at 140 KB/s).
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// What a connection past the cap is told: a 503 in OpenAI's error shape.
fn refusal() -> Vec<u8> {
    let body = r#"{"error":{"message":"too many open connections, all of them being answered; retry shortly","type":"server_error","param":null,"code":"service_unavailable"}}"#;
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
    open: Arc<Open>,
    limits: ConnectionLimits,
    refusals: Arc<RefusalLog>,
}

impl<L> Limited<L> {
    pub fn new(inner: L, limits: ConnectionLimits) -> Self {
        Self {
            inner,
            open: Arc::new(Open::new(limits.max_connections.max(1))),
            limits,
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
            match self.open.admit() {
                Some(place) => return (Guarded::new(io, place, self.limits), addr),
                None => {
                    self.refusals.note();
                    metrics::connection_closed(ConnectionClosed::Refused);
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

impl<L> Connected<IncomingStream<'_, Limited<L>>> for ConnectionUse
where
    L: Listener,
    L::Io: Unpin,
{
    fn connect_info(stream: IncomingStream<'_, Limited<L>>) -> Self {
        stream.io().usage()
    }
}

/// The connections open on one listener, for the cap and for eviction.
struct Open {
    max: usize,
    /// When the listener started: activity times are milliseconds since.
    epoch: Instant,
    next_id: AtomicU64,
    connections: Mutex<HashMap<u64, Entry>>,
    evictions: PeriodicLog,
}

/// One open connection as the listener sees it.
struct Entry {
    usage: ConnectionUse,
    /// Closes the connection (its [`Guarded`] ends with an error when this is sent or dropped).
    evict: oneshot::Sender<()>,
}

/// A connection's place under the cap, given back when its [`Guarded`] is dropped.
pub struct Place {
    open: Arc<Open>,
    id: u64,
    usage: ConnectionUse,
    evicted: oneshot::Receiver<()>,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.open.lock().remove(&self.id);
    }
}

impl Open {
    fn new(max: usize) -> Self {
        Self {
            max,
            epoch: Instant::now(),
            next_id: AtomicU64::new(0),
            connections: Mutex::new(HashMap::new()),
            evictions: PeriodicLog::new(Duration::from_secs(10)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.connections.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for a new connection: a free one, or the place of the connection that has been
    /// silent longest among those not being answered, which is closed. `None` when every
    /// connection under the cap is being answered.
    fn admit(self: &Arc<Self>) -> Option<Place> {
        let usage = ConnectionUse::new(self.epoch);
        let mut open = self.lock();
        if open.len() >= self.max {
            let victim = open
                .iter()
                .filter(|(_, e)| e.usage.evictable())
                .min_by_key(|(id, e)| (e.usage.last_active(), **id))
                .map(|(id, _)| *id)?;
            if let Some(entry) = open.remove(&victim) {
                let _ = entry.evict.send(());
            }
            drop(open);
            metrics::connection_closed(ConnectionClosed::Evicted);
            self.evictions.note(|total| {
                tracing::info!(
                    listener = "HTTP",
                    evicted_total = total,
                    max_connections = self.max,
                    "connection limit reached: closing the connections idle longest for new ones"
                )
            });
            open = self.lock();
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (evict, evicted) = oneshot::channel();
        open.insert(
            id,
            Entry {
                usage: usage.clone(),
                evict,
            },
        );
        Some(Place {
            open: Arc::clone(self),
            id,
            usage,
            evicted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_cap_evicts_the_longest_silent_connection_not_being_answered() {
        let open = Arc::new(Open::new(3));
        let mut first = open.admit().unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let mut second = open.admit().unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let mut third = open.admit().unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        // The first moved bytes since: the second is now the one silent longest.
        first.usage.touch();
        let mut fourth = open.admit().expect("a place made by eviction");
        assert!(
            second.evicted.try_recv().is_ok(),
            "the longest silent is closed"
        );
        assert!(first.evicted.try_recv().is_err());
        assert_eq!(open.lock().len(), 3);
        // A connection being answered is never closed for another, however silent.
        let answering = third.usage.start_request().working();
        let _fifth = open.admit().expect("the first or the fourth is evictable");
        assert!(third.evicted.try_recv().is_err(), "the answering one stays");
        assert!(first.evicted.try_recv().is_ok() || fourth.evicted.try_recv().is_ok());
        // A request whose body is still arriving is not being answered yet: evictable.
        drop(answering);
        let _receiving = third.usage.start_request();
        assert!(third.usage.evictable());
        // Every connection under the cap being answered: refused.
        let full = Arc::new(Open::new(2));
        let (a, b) = (full.admit().unwrap(), full.admit().unwrap());
        let _busy = (
            a.usage.start_request().working(),
            b.usage.start_request().working(),
        );
        assert!(full.admit().is_none());
        // A place given back is free again.
        drop(_busy);
        drop(a);
        assert!(full.admit().is_some());
    }
}
