//! Moving pages between workers: the gRPC `KvTransfer` stream ([`grpc`], any two machines) and
//! NCCL ([`nccl`], GPU to GPU, over a [`link`]), the receiving side's checks ([`Reservations`],
//! [`Claim`]), and the counters of both directions.
//!
//! A page is one contiguous unit (every layer's K and V data with their scales), so it travels as
//! `page_bytes` bytes and lands unchanged in the reserved page. Every transfer names the
//! sender's KV-format fingerprint; the receiver refuses a mismatch before writing a byte. A
//! receiver trusts no page: each is one the reservation awaits, named once, and holds no byte a
//! writer never produces (NaN or negative block scales, NaN FP8 codes, non-finite BF16:
//! [`nibble_kvfmt::check`]) before it is written, let alone decoded or cached. A push that fails
//! those checks releases its reservation.
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
use nibble_kvfmt::SequencePages;

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

/// Where one of a reservation's pages to receive stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// No push has named it yet.
    Empty,
    /// A push named it; its bytes are being checked and written.
    Claimed,
    /// Its bytes passed the checks and landed.
    Filled,
}

/// A reservation waiting for its pages and its Decode call.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    pub request_id: String,
    /// Every page of the prompt, in sequence order, then the window's.
    pub pages: Vec<PageId>,
    /// Sequence position of the first page to receive.
    pub first_page_index: usize,
    /// What the pages must hold: the sequence's layout, window and length.
    pub sequence: SequencePages,
    /// Where each of `pages[first_page_index..]` stands.
    slots: Vec<Slot>,
}

impl Pending {
    /// A reservation of `pages` whose first `first_page_index` the receiver already holds.
    pub fn new(
        request_id: String,
        pages: Vec<PageId>,
        first_page_index: usize,
        sequence: SequencePages,
    ) -> Self {
        debug_assert_eq!(pages.len(), sequence.pages(), "one page per sequence page");
        let slots = vec![Slot::Empty; pages.len() - first_page_index];
        Self {
            request_id,
            pages,
            first_page_index,
            sequence,
            slots,
        }
    }

    pub fn filled_count(&self) -> usize {
        self.slots.iter().filter(|s| **s == Slot::Filled).count()
    }

    pub fn is_complete(&self) -> bool {
        self.slots.iter().all(|s| *s == Slot::Filled)
    }
}

/// The pages of a reservation one push claimed: where they go and what they must hold.
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    /// The pages' sequence positions, as the push named them.
    pub indices: Vec<u32>,
    /// The receiver's pages they land in, in the same order.
    pub targets: Vec<PageId>,
    pub sequence: SequencePages,
}

impl Claim {
    /// Checks `data`, the claimed pages' bytes back to back (`page_bytes` each), before
    /// anything reads them ([`SequencePages::check`]).
    pub fn check(&self, data: &[u8], page_bytes: usize) -> Result<()> {
        if data.len() != self.indices.len() * page_bytes {
            return Err(Error::InvalidArgument(format!(
                "data must be {} pages of {page_bytes} bytes, got {} bytes",
                self.indices.len(),
                data.len()
            )));
        }
        for (&index, page) in self.indices.iter().zip(data.chunks_exact(page_bytes)) {
            self.sequence
                .check(index as usize, page)
                .map_err(|fault| Error::BadPage { index, fault })?;
        }
        Ok(())
    }
}

/// The decode worker's pending reservations, by reservation id.
///
/// Each page to receive is named by exactly one push: [`claim`](Reservations::claim) takes the
/// pages a push names (refusing a page outside the reservation, or one already named, by this
/// push or an earlier one), [`fill`](Reservations::fill) marks them landed, and
/// [`unclaim`](Reservations::unclaim) gives a broken push's pages back for a retry.
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

    /// Claims the pages `indices` of reservation `id` for one push: each must be one of the
    /// pages the reservation awaits, named once and by no earlier push. Nothing is claimed on
    /// error.
    pub fn claim(&self, id: u64, indices: &[u32]) -> Result<Claim> {
        let mut guard = self.lock();
        let p = guard.get_mut(&id).ok_or(Error::UnknownReservation(id))?;
        let mut named = vec![false; p.slots.len()];
        let mut at = Vec::with_capacity(indices.len());
        for &i in indices {
            let slot = (i as usize)
                .checked_sub(p.first_page_index)
                .filter(|at| *at < p.slots.len())
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "page_indices: page {i} is outside the reservation's pages {}..{}",
                        p.first_page_index,
                        p.pages.len()
                    ))
                })?;
            if named[slot] || p.slots[slot] != Slot::Empty {
                return Err(Error::DuplicatePage(i));
            }
            named[slot] = true;
            at.push(slot);
        }
        for &slot in &at {
            p.slots[slot] = Slot::Claimed;
        }
        Ok(Claim {
            indices: indices.to_vec(),
            targets: indices.iter().map(|&i| p.pages[i as usize]).collect(),
            sequence: p.sequence,
        })
    }

    /// Marks a claim's pages landed; returns whether the reservation is now complete.
    pub fn fill(&self, id: u64, claim: &Claim) -> Result<bool> {
        let mut guard = self.lock();
        let p = guard.get_mut(&id).ok_or(Error::UnknownReservation(id))?;
        for &i in &claim.indices {
            p.slots[i as usize - p.first_page_index] = Slot::Filled;
        }
        Ok(p.is_complete())
    }

    /// Gives the pages `indices` of a push that broke off (claimed, or landed) back to the
    /// reservation, so that a retry may send them again. A reservation gone meanwhile is left
    /// gone.
    pub fn unclaim(&self, id: u64, indices: &[u32]) {
        if let Some(p) = self.lock().get_mut(&id) {
            for &i in indices {
                p.slots[i as usize - p.first_page_index] = Slot::Empty;
            }
        }
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
                expected: p.slots.len(),
            });
        }
        Ok(guard.remove(&id).expect("checked above"))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pending>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use nibble_kvfmt::{KvDtype, PageLayout, WindowLayout};

    use super::*;

    /// Reservation 7: a 40-token prompt (3 pages) of which the first is cached, then a
    /// 16-token window in 4 pages: pages 1 to 6 await bytes.
    fn reservations() -> Reservations {
        let layout = PageLayout::new(1, 1, 16, 16, KvDtype::Nvfp4).unwrap();
        let window = WindowLayout::new(&layout, 16).unwrap();
        let sequence = SequencePages::new(layout, window, 40);
        let pages = (10..17).map(PageId).collect();
        let r = Reservations::default();
        r.insert(7, Pending::new("r".into(), pages, 1, sequence));
        r
    }

    fn message(e: Error) -> String {
        e.to_string()
    }

    #[test]
    fn a_push_claims_the_reservations_pages_once_each() {
        let r = reservations();
        let claim = r.claim(7, &[2, 1]).unwrap();
        assert_eq!(claim.targets, vec![PageId(12), PageId(11)]);
        // Claimed pages cannot be named again, by this push or another, even before they land.
        assert_eq!(
            message(r.claim(7, &[1]).unwrap_err()),
            "page_indices: page 1 of the reservation was already named"
        );
        assert!(!r.fill(7, &claim).unwrap());
        assert!(matches!(r.claim(7, &[2]), Err(Error::DuplicatePage(2))));
        let rest = r.claim(7, &[3, 4, 5, 6]).unwrap();
        assert!(r.fill(7, &rest).unwrap(), "every page landed");
        assert!(r.take_complete(7, "r").is_ok());
    }

    #[test]
    fn a_push_naming_a_page_twice_or_outside_claims_nothing() {
        let r = reservations();
        assert!(matches!(
            r.claim(7, &[1, 3, 1]),
            Err(Error::DuplicatePage(1))
        ));
        assert_eq!(
            message(r.claim(7, &[3, 7]).unwrap_err()),
            "page_indices: page 7 is outside the reservation's pages 1..7"
        );
        assert_eq!(
            message(r.claim(7, &[0]).unwrap_err()),
            "page_indices: page 0 is outside the reservation's pages 1..7",
            "a page the receiver already holds is not the sender's to write"
        );
        // None of those claimed anything.
        let all = r.claim(7, &[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(all.targets.len(), 6);
        assert!(matches!(
            r.claim(8, &[1]),
            Err(Error::UnknownReservation(8))
        ));
    }

    #[test]
    fn a_broken_push_gives_its_pages_back_for_a_retry() {
        let r = reservations();
        let first = r.claim(7, &[1, 2]).unwrap();
        r.fill(7, &first).unwrap();
        r.claim(7, &[3, 4, 5, 6]).unwrap();
        r.unclaim(7, &[1, 2, 3, 4, 5, 6]);
        let retry = r.claim(7, &[1, 2, 3, 4, 5, 6]).unwrap();
        assert!(r.fill(7, &retry).unwrap());
        r.remove(7);
        r.unclaim(7, &[1]); // gone meanwhile: nothing to do
    }

    #[test]
    fn a_claim_checks_the_bytes_of_its_pages() {
        let r = reservations();
        let claim = r.claim(7, &[2, 3]).unwrap();
        let page = 16 * 2 * 9;
        let mut data = vec![0u8; 2 * page];
        assert!(claim.check(&data, page).is_ok());
        assert_eq!(
            message(claim.check(&data[1..], page).unwrap_err()),
            format!(
                "data must be 2 pages of {page} bytes, got {} bytes",
                2 * page - 1
            )
        );
        // A NaN block scale in the prompt's last page (token 3 of 8 there).
        data[16 * 8 + 3] = 0x7F;
        let e = claim.check(&data, page).unwrap_err();
        assert!(matches!(e, Error::BadPage { index: 2, .. }), "{e}");
        assert_eq!(
            e.to_string(),
            "page 2 of the reservation: NVFP4 block scale 0x7f at byte 131 \
             (layer 0 K, head 0, token 3) is NaN: scales are 0x00..=0x7e"
        );
    }
}
