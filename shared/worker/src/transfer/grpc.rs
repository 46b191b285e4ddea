//! The gRPC page stream: [`push_pages`] sends a prefilled request's pages to a decode worker's
//! `KvTransfer.PushPages` in messages of about [`MESSAGE_BYTES`], exporting, sending and
//! importing in a pipeline.

use std::time::{Duration, Instant};

use nibble_kvcache::PageId;
use nibble_proto::v1;
use nibble_proto::v1::kv_transfer_client::KvTransferClient;
use nibble_security::Peers;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::TransferCounters;
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

/// What a push moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushSummary {
    pub pages: usize,
    pub bytes: u64,
    pub duration: Duration,
    /// How the pages moved.
    pub backend: v1::TransferBackend,
}

/// Pushes this worker's `pages` (the prompt's pages from `target.first_page_index` on) into the
/// decode worker's reservation named by `target`.
pub async fn push_pages(
    engine: &EngineHandle,
    peers: &Peers,
    request_id: &str,
    target: &v1::TransferTarget,
    pages: &[PageId],
    counters: &TransferCounters,
) -> Result<PushSummary> {
    let start = Instant::now();
    let address = target.address.clone();
    let channel = peers
        .endpoint(&address)?
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .connect()
        .await
        .map_err(|source| Error::Connect {
            address: address.clone(),
            source,
        })?;
    let mut client = KvTransferClient::new(peers.with_token(channel))
        .max_encoding_message_size(crate::server::MAX_MESSAGE_BYTES);
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
        backend: v1::TransferBackend::Grpc,
    };
    counters.pushed(&summary);
    tracing::info!(
        to = %address,
        reservation = target.reservation_id,
        pages = summary.pages,
        bytes = summary.bytes,
        micros = summary.duration.as_micros() as u64,
        "pushed pages"
    );
    Ok(summary)
}
