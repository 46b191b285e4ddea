//! Moving pages between workers: the gRPC `KvTransfer` stream ([`grpc`], any two machines) and
//! NCCL ([`nccl`], GPU to GPU, over a [`link`]), the receiving side's checks ([`Reservations`]),
//! and the counters of both directions.
//!
//! A page is one contiguous unit (every layer's K and V data with their scales), so it travels as
//! `page_bytes` opaque bytes and lands unchanged in the reserved page. Every transfer names the
//! sender's KV-format fingerprint; the receiver refuses a mismatch before writing a byte.
//!
//! Which way: the router sets `TransferTarget.backend` to NCCL when both workers advertise an
//! NCCL endpoint on different GPUs ([`nibble_discovery::WorkerInfo::nccl_to`]); the prefill worker
//! then tries NCCL and falls back to the gRPC stream for that request when NCCL is not set up on
//! it or fails (counted in `nibble_worker_kv_transfer_fallbacks_total`).

pub mod grpc;
pub mod nccl;

pub use grpc::{
    pages_per_message, push_pages, PushSummary, CONNECTION_WINDOW_BYTES, MESSAGE_BYTES,
    STREAM_WINDOW_BYTES,
};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use nibble_kvcache::PageId;

use crate::error::{Error, Result};

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
    /// Of `pushes`, those that went over NCCL.
    pub nccl_pushes: AtomicU64,
    /// Transfers that tried NCCL and fell back to the gRPC stream.
    pub fallbacks: AtomicU64,
}

/// A point-in-time copy of [`TransferCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferTotals {
    pub pushes: u64,
    pub pages_sent: u64,
    pub bytes_sent: u64,
    pub pages_received: u64,
    pub bytes_received: u64,
    pub nccl_pushes: u64,
    pub fallbacks: u64,
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
            nccl_pushes: get(&self.nccl_pushes),
            fallbacks: get(&self.fallbacks),
        }
    }

    /// Counts one finished push, over whichever backend `summary` names.
    pub fn pushed(&self, summary: &PushSummary) {
        self.pushes.fetch_add(1, Ordering::Relaxed);
        if summary.backend == nibble_proto::v1::TransferBackend::Nccl {
            self.nccl_pushes.fetch_add(1, Ordering::Relaxed);
        }
        self.pages_sent
            .fetch_add(summary.pages as u64, Ordering::Relaxed);
        self.bytes_sent.fetch_add(summary.bytes, Ordering::Relaxed);
    }

    /// Counts received pages.
    pub fn received(&self, pages: u64, bytes: u64) {
        self.pages_received.fetch_add(pages, Ordering::Relaxed);
        self.bytes_received.fetch_add(bytes, Ordering::Relaxed);
    }
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

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
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
