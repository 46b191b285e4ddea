//! Moving pages between workers over the gRPC `KvTransfer` stream: the sending side
//! ([`push_pages`]), the receiving side's checks ([`Reservations`]), and the counters of both.
//!
//! A page is one contiguous unit (every layer's K and V data with their scales), so it travels as
//! `page_bytes` opaque bytes and lands unchanged in the reserved page. The first message carries
//! the sender's KV-format fingerprint; the receiver refuses a mismatch before writing a byte.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nibble_kvcache::PageId;
use nibble_proto::v1;
use nibble_proto::v1::kv_transfer_client::KvTransferClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::actor::EngineHandle;
use crate::error::{Error, Result};

/// Bytes of page data per `PushPagesRequest` message (at least one page): large enough that
/// per-message costs vanish, small enough to pipeline export, send and import.
pub const MESSAGE_BYTES: usize = 4 << 20;

/// HTTP/2 flow-control windows of page streams, both ends. The 64 KiB default stalls a
/// stream of multi-megabyte messages on window updates; these let several messages fly.
pub const STREAM_WINDOW_BYTES: u32 = 16 << 20;
/// See [`STREAM_WINDOW_BYTES`].
pub const CONNECTION_WINDOW_BYTES: u32 = 32 << 20;

/// Pages per message for pages of `page_bytes`.
pub fn pages_per_message(page_bytes: usize) -> usize {
    (MESSAGE_BYTES / page_bytes.max(1)).max(1)
}

/// Pages and bytes moved by this worker, both directions.
#[derive(Debug, Default)]
pub struct TransferCounters {
    /// Transfers this worker pushed.
    pub pushes: AtomicU64,
    /// Pages this worker pushed.
    pub pages_sent: AtomicU64,
    /// Page bytes this worker pushed (data and scales, no metadata).
    pub bytes_sent: AtomicU64,
    /// Pages this worker received.
    pub pages_received: AtomicU64,
    /// Page bytes this worker received.
    pub bytes_received: AtomicU64,
}

/// A point-in-time copy of [`TransferCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferTotals {
    pub pushes: u64,
    pub pages_sent: u64,
    pub bytes_sent: u64,
    pub pages_received: u64,
    pub bytes_received: u64,
}

impl TransferCounters {
    pub fn totals(&self) -> TransferTotals {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TransferTotals {
            pushes: get(&self.pushes),
            pages_sent: get(&self.pages_sent),
            bytes_sent: get(&self.bytes_sent),
            pages_received: get(&self.pages_received),
            bytes_received: get(&self.bytes_received),
        }
    }
}

/// What a push moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushSummary {
    pub pages: usize,
    pub bytes: u64,
    pub duration: Duration,
}

/// Pushes this worker's `pages` (the prompt's pages from `target.first_page_index` on) into the
/// decode worker's reservation named by `target`.
pub async fn push_pages(
    engine: &EngineHandle,
    request_id: &str,
    target: &v1::TransferTarget,
    pages: &[PageId],
    counters: &TransferCounters,
) -> Result<PushSummary> {
    let start = Instant::now();
    let address = target.address.clone();
    let uri = if address.contains("://") {
        address.clone()
    } else {
        format!("http://{address}")
    };
    let connect = |source| Error::Connect {
        address: address.clone(),
        source,
    };
    let channel = tonic::transport::Endpoint::from_shared(uri)
        .map_err(connect)?
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .connect()
        .await
        .map_err(connect)?;
    let mut client =
        KvTransferClient::new(channel).max_encoding_message_size(crate::server::MAX_MESSAGE_BYTES);
    let (tx, rx) = mpsc::channel(2);
    let first = target.first_page_index as usize;
    let per_message = pages_per_message(engine.info().page_bytes);
    let chunks: Vec<Vec<PageId>> = pages.chunks(per_message).map(<[_]>::to_vec).collect();
    let fingerprint = engine.info().fingerprint;
    let producer = {
        let engine = engine.clone();
        let request_id = request_id.to_string();
        let reservation_id = target.reservation_id;
        tokio::spawn(async move {
            let mut index = first as u32;
            for (n, chunk) in chunks.into_iter().enumerate() {
                let count = chunk.len() as u32;
                let data = engine.export_pages(chunk).await?;
                let message = v1::PushPagesRequest {
                    reservation_id,
                    page_indices: (index..index + count).collect(),
                    data: data.into(),
                    kv_format_fingerprint: (n == 0).then_some(fingerprint),
                    request_id: if n == 0 {
                        request_id.clone()
                    } else {
                        String::new()
                    },
                };
                index += count;
                if tx.send(message).await.is_err() {
                    break; // the call ended; its status says why
                }
            }
            Ok::<(), Error>(())
        })
    };
    let response = client.push_pages(ReceiverStream::new(rx)).await;
    let produced = producer.await.map_err(|_| Error::EngineStopped)?;
    let response = response
        .map_err(|status| Error::Push {
            address: address.clone(),
            status,
        })?
        .into_inner();
    produced?;
    if !response.complete || response.pages as usize != pages.len() {
        return Err(Error::Push {
            address,
            status: tonic::Status::data_loss(format!(
                "{} of {} pages arrived",
                response.pages,
                pages.len()
            )),
        });
    }
    let summary = PushSummary {
        pages: response.pages as usize,
        bytes: response.bytes,
        duration: start.elapsed(),
    };
    counters.pushes.fetch_add(1, Ordering::Relaxed);
    counters
        .pages_sent
        .fetch_add(summary.pages as u64, Ordering::Relaxed);
    counters
        .bytes_sent
        .fetch_add(summary.bytes, Ordering::Relaxed);
    tracing::info!(
        request_id,
        to = %address,
        reservation = target.reservation_id,
        pages = summary.pages,
        bytes = summary.bytes,
        micros = summary.duration.as_micros() as u64,
        "pushed pages"
    );
    Ok(summary)
}

/// A reservation waiting for its pages and its Decode call.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    pub request_id: String,
    /// Every page of the prompt, in sequence order.
    pub pages: Vec<PageId>,
    /// Sequence position of the first page to receive.
    pub first_page_index: usize,
    /// Which of `pages[first_page_index..]` arrived.
    pub filled: Vec<bool>,
}

impl Pending {
    pub fn filled_count(&self) -> usize {
        self.filled.iter().filter(|f| **f).count()
    }

    pub fn is_complete(&self) -> bool {
        self.filled.iter().all(|f| *f)
    }
}

/// The decode worker's pending reservations, by reservation id.
#[derive(Debug, Default)]
pub(crate) struct Reservations {
    pending: Mutex<HashMap<u64, Pending>>,
}

impl Reservations {
    pub fn insert(&self, id: u64, pending: Pending) {
        self.lock().insert(id, pending);
    }

    pub fn remove(&self, id: u64) -> Option<Pending> {
        self.lock().remove(&id)
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn request_id(&self, id: u64) -> Option<String> {
        self.lock().get(&id).map(|p| p.request_id.clone())
    }

    /// Checks `indices` against reservation `id` and returns the pages to write them to. Marks
    /// them filled only through [`mark`](Self::mark), after the bytes landed.
    pub fn targets(&self, id: u64, indices: &[u32]) -> Result<Vec<PageId>> {
        let guard = self.lock();
        let p = guard.get(&id).ok_or(Error::UnknownReservation(id))?;
        indices
            .iter()
            .map(|&i| {
                let at = (i as usize)
                    .checked_sub(p.first_page_index)
                    .filter(|at| *at < p.filled.len())
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "page_indices: {i} is outside the reservation's pages {}..{}",
                            p.first_page_index,
                            p.pages.len()
                        ))
                    })?;
                if p.filled[at] {
                    return Err(Error::DuplicatePage(i));
                }
                Ok(p.pages[i as usize])
            })
            .collect()
    }

    /// Marks pages filled; returns whether the reservation is now complete.
    pub fn mark(&self, id: u64, indices: &[u32]) -> Result<bool> {
        let mut guard = self.lock();
        let p = guard.get_mut(&id).ok_or(Error::UnknownReservation(id))?;
        for &i in indices {
            p.filled[i as usize - p.first_page_index] = true;
        }
        Ok(p.is_complete())
    }

    /// Takes a complete reservation for decoding.
    pub fn take_complete(&self, id: u64, request_id: &str) -> Result<Pending> {
        let mut guard = self.lock();
        let p = guard.get(&id).ok_or(Error::UnknownReservation(id))?;
        if p.request_id != request_id {
            return Err(Error::InvalidArgument(format!(
                "handoff.reservation_id {id} belongs to request {:?}, not {request_id:?}",
                p.request_id
            )));
        }
        if !p.is_complete() {
            return Err(Error::Incomplete {
                id,
                filled: p.filled_count(),
                expected: p.filled.len(),
            });
        }
        Ok(guard.remove(&id).expect("checked above"))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pending>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}
