//! NCCL page transfer: a prefill worker P (rank 0) sends a request's pages from its GPU to a
//! decode worker D's GPU (rank 1) over a two-rank link per (P, D) pair.
//!
//! * Set-up, ahead of traffic ([`pairing`]): P watches the registrations and sets a pair up as
//!   soon as it sees a decode worker it may send to over NCCL (both offer NCCL, on different
//!   GPUs, with the same KV format), and again when one returns after leaving. A transfer that
//!   finds its pair down sets it up itself; one that finds a set-up under way waits for it (its
//!   deadline bounds the wait) instead of starting a second. To set up, P makes a unique id,
//!   puts it in the coordination store under `nccl/{P}/{D}/{instance}-{generation}` (bound to
//!   P's session, so etcd's lease removes it if P dies), and calls D's `KvTransfer.NcclConnect`
//!   naming the key; both join at once (each on a blocking thread, with the same deadline) and P
//!   deletes the key. A set-up that fails leaves the pair on gRPC for `retry_after`.
//! * A transfer ([`NcclTransport::send_pages`]): P gathers the pages into a pooled staging
//!   buffer on its engine's stream, then, in its turn on the pair, calls D's
//!   `KvTransfer.NcclPages` with what is coming (reservation, page indices, page bytes,
//!   KV-format fingerprint). D checks it like a PushPages stream, posts the receive into a
//!   pooled buffer and answers `ready`; P sends and its turn ends; D scatters the bytes into the
//!   reserved pages and answers `done`. Up to `max_in_flight` transfers of a pair are under way
//!   at once: the next one gathers while one sends, and sends while the one before is
//!   scattered, but sends (and so D's receives, each posted after the one before completed) go
//!   one at a time in the order of the turns.
//! * Staging buffers ([`nibble_nccl::staging::StagingPool`], one per worker for both sides) are
//!   reused, never cleared, and kept idle up to `staging_pool_bytes`.
//! * Failure: a refusal before `ready` leaves the link alone; anything after it (an NCCL error, a
//!   deadline, a broken control stream) breaks the link on both sides (NCCL aborts it) and the
//!   next transfer connects again. The caller falls back to the gRPC stream for that request.
//!   A peer that leaves the membership has its pair dropped at once. Pages stay owned as in the
//!   gRPC path: P holds its pages until the prefill call ends, D's reservation is filled only by
//!   the final scatter and freed by Abort or its TTL.
//! * Checks: D claims the named pages of its reservation before `ready` (each once, as a
//!   PushPages stream does) and checks the received bytes before the scatter (on a host copy of
//!   a device buffer, `Backend::staged_host_bytes`); pages that fail release the reservation and
//!   answer INVALID_ARGUMENT after `done`'s place. P then keeps the link (the bytes moved fine)
//!   and does not fall back: the same bytes would be refused over gRPC.

mod pairing;
mod receiver;
mod sender;

pub use pairing::PairFilter;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nibble_discovery::{Discovery, NcclEndpoint};
use nibble_nccl::link::{Link, LinkFactory};
use nibble_nccl::staging::{PoolStats, StagingPool};
use tokio::sync::Mutex as AsyncMutex;

use crate::error::{Error, Result};
use receiver::ReceiverPair;
use sender::SenderEntry;

/// The longest a receiver waits for a sender's id and rank, whatever the sender asks.
const MAX_CONNECT_WAIT: Duration = Duration::from_secs(300);

/// Whether a worker may use NCCL: `--kv-transfer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransferMode {
    /// NCCL when this worker runs on a GPU, NCCL loads and a coordination store is configured;
    /// the gRPC stream otherwise.
    #[default]
    Auto,
    /// Only the gRPC stream (this worker advertises no NCCL endpoint).
    Grpc,
}

impl std::str::FromStr for TransferMode {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "grpc" => Ok(Self::Grpc),
            _ => Err(format!(
                "unknown transfer mode {s:?} (expected auto or grpc)"
            )),
        }
    }
}

impl std::fmt::Display for TransferMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Grpc => "grpc",
        })
    }
}

/// Whether this worker offers NCCL, or why not: forced gRPC, no GPU, no coordination store to
/// exchange ids through, or NCCL not loading (`load` is only called when everything else holds).
pub fn offer_nccl(
    mode: TransferMode,
    on_gpu: bool,
    coordination: bool,
    load: impl FnOnce() -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    if mode == TransferMode::Grpc {
        return Err("--kv-transfer grpc".into());
    }
    if !on_gpu {
        return Err("the engine runs on the CPU".into());
    }
    if !coordination {
        return Err("no coordination store (--etcd-endpoints) to exchange NCCL ids through".into());
    }
    load()
}

/// Deadlines of the NCCL path.
#[derive(Debug, Clone, Copy)]
pub struct NcclTimeouts {
    /// Joining a pair, and each transfer's completion.
    pub timeout: Duration,
    /// How long a pair whose set-up failed uses gRPC before it is tried again.
    pub retry_after: Duration,
}

impl Default for NcclTimeouts {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            retry_after: Duration::from_secs(60),
        }
    }
}

/// Bounds of the NCCL path's memory and concurrency.
#[derive(Debug, Clone, Copy)]
pub struct NcclLimits {
    /// Bytes of idle staging buffers kept for reuse (both sides together); buffers given back
    /// past it are freed.
    pub staging_pool_bytes: usize,
    /// Transfers of one pair under way at once (gathering, waiting for their turn, sending or
    /// being scattered); more wait before they gather.
    pub max_in_flight: usize,
}

impl Default for NcclLimits {
    fn default() -> Self {
        Self {
            staging_pool_bytes: 2 << 30,
            max_in_flight: 4,
        }
    }
}

/// Why an NCCL transfer did not happen; the request then moves over gRPC.
#[derive(Debug)]
pub struct NcclFailure {
    /// `connect` (setting up the pair), `refused` (the receiver turned the request down before
    /// anything moved) or `transfer` (the link failed mid-way; both ends dropped it).
    pub reason: &'static str,
    pub error: Error,
}

/// How this worker's pairs were set up since it started (as sender).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnectTotals {
    /// Set-ups started ahead of traffic (a registration seen), successful or not.
    pub ahead: u64,
    /// Set-ups a transfer started because it found its pair down.
    pub on_request: u64,
    /// Of both, those that failed.
    pub failed: u64,
}

#[derive(Default)]
struct ConnectCounters {
    ahead: AtomicU64,
    on_request: AtomicU64,
    failed: AtomicU64,
}

/// This worker's NCCL pairs, as sender and as receiver.
pub struct NcclTransport {
    links: Arc<dyn LinkFactory>,
    discovery: Arc<dyn Discovery>,
    worker_id: String,
    endpoint: NcclEndpoint,
    timeouts: NcclTimeouts,
    limits: NcclLimits,
    /// Distinguishes this process's keys from an earlier life's (whose lease may not have
    /// expired yet).
    instance: u64,
    generation: AtomicU64,
    connects: ConnectCounters,
    pool: Arc<StagingPool>,
    senders: Mutex<HashMap<String, Arc<SenderEntry>>>,
    receivers: Mutex<HashMap<String, Arc<AsyncMutex<ReceiverPair>>>>,
    closed: AtomicBool,
}

impl NcclTransport {
    /// NCCL transfers of worker `worker_id` through `links`, exchanging ids through
    /// `discovery`; it advertises `endpoint`. Default [`NcclLimits`].
    pub fn new(
        links: Arc<dyn LinkFactory>,
        discovery: Arc<dyn Discovery>,
        worker_id: String,
        endpoint: NcclEndpoint,
        timeouts: NcclTimeouts,
    ) -> Self {
        Self::with_limits(
            links,
            discovery,
            worker_id,
            endpoint,
            timeouts,
            NcclLimits::default(),
        )
    }

    /// [`new`](Self::new) with `limits`.
    pub fn with_limits(
        links: Arc<dyn LinkFactory>,
        discovery: Arc<dyn Discovery>,
        worker_id: String,
        endpoint: NcclEndpoint,
        timeouts: NcclTimeouts,
        limits: NcclLimits,
    ) -> Self {
        let instance = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(32);
        let pool = Arc::new(StagingPool::new(
            links.allocator(),
            limits.staging_pool_bytes,
        ));
        Self {
            links,
            discovery,
            worker_id,
            endpoint,
            timeouts,
            limits: NcclLimits {
                max_in_flight: limits.max_in_flight.max(1),
                ..limits
            },
            instance,
            generation: AtomicU64::new(0),
            connects: ConnectCounters::default(),
            pool,
            senders: Mutex::default(),
            receivers: Mutex::default(),
            closed: AtomicBool::new(false),
        }
    }

    /// What this worker advertises in its registration.
    pub fn endpoint(&self) -> &NcclEndpoint {
        &self.endpoint
    }

    /// `"nccl"`, or `"memory"` for the in-process twin.
    pub fn link_name(&self) -> &'static str {
        self.links.name()
    }

    /// Pairs this worker set up as sender since it started (each connect attempt counts).
    pub fn connects(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Set-ups by what started them.
    pub fn connect_totals(&self) -> ConnectTotals {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ConnectTotals {
            ahead: get(&self.connects.ahead),
            on_request: get(&self.connects.on_request),
            failed: get(&self.connects.failed),
        }
    }

    /// The staging pool's allocations, reuses and bytes.
    pub fn staging(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Pairs with a link, both roles (a pair busy with a transfer counts).
    pub fn live_links(&self) -> usize {
        let senders = lock(&self.senders).values().filter(|e| e.is_up()).count();
        let receivers = lock(&self.receivers)
            .values()
            .filter(|p| p.try_lock().map_or(true, |p| p.link.is_some()))
            .count();
        senders + receivers
    }

    /// Whether this worker has a live link to decode worker `decode` (as sender).
    pub fn has_link_to(&self, decode: &str) -> bool {
        lock(&self.senders).get(decode).is_some_and(|e| e.is_up())
    }

    /// Drops every pair: NCCL communicators are destroyed (or aborted when broken) once their
    /// in-flight transfer, if any, ends. Later transfers fall back to gRPC.
    pub async fn shutdown(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let senders: Vec<_> = lock(&self.senders).drain().map(|(_, e)| e).collect();
        let receivers: Vec<_> = lock(&self.receivers).drain().map(|(_, p)| p).collect();
        for entry in &senders {
            entry.retire();
        }
        let pool = Arc::clone(&self.pool);
        let _ = tokio::task::spawn_blocking(move || {
            drop(senders);
            drop(receivers);
            pool.clear();
        })
        .await;
    }

    /// Drops the pairs with worker `peer` (it left the membership), both roles.
    pub fn forget_peer(&self, peer: &str) {
        self.forget_sender_pair(peer);
        self.forget_receiver_pair(peer);
    }

    /// Drops the pair with decode worker `decode` once the transfer holding its turn ends;
    /// transfers waiting for a turn fail and fall back.
    pub fn forget_sender_pair(&self, decode: &str) {
        let Some(entry) = lock(&self.senders).remove(decode) else {
            return;
        };
        tracing::info!(peer = decode, "NCCL pair dropped: the decode worker left");
        entry.retire();
        tokio::spawn(async move {
            let mut pair = entry.turn.lock().await;
            entry.take_link(&mut pair);
        });
    }

    /// Drops the pair with prefill worker `prefill` (a receive under way ends with its
    /// deadline).
    pub fn forget_receiver_pair(&self, prefill: &str) {
        if let Some(pair) = lock(&self.receivers).remove(prefill) {
            tracing::info!(peer = prefill, "NCCL pair dropped: the prefill worker left");
            tokio::task::spawn_blocking(move || drop(pair));
        }
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Relaxed) {
            Err(Error::Link("the worker is shutting down".into()))
        } else {
            Ok(())
        }
    }

    /// Runs `op` on a link on a blocking thread; the link comes back unless `op` failed (a
    /// failed link is dropped there, which aborts NCCL). `carried` travels with it and comes
    /// back whatever happened.
    async fn on_link<C: Send + 'static, T: Send + 'static>(
        &self,
        slot: &mut Option<Box<dyn Link>>,
        carried: C,
        op: impl FnOnce(&mut dyn Link, &mut C, Duration) -> Result<T> + Send + 'static,
    ) -> (Option<C>, Result<T>) {
        let Some(mut link) = slot.take() else {
            return (
                Some(carried),
                Err(Error::Link("the pair has no link".into())),
            );
        };
        let timeout = self.timeouts.timeout;
        let joined = tokio::task::spawn_blocking(move || {
            let mut carried = carried;
            let result = op(link.as_mut(), &mut carried, timeout);
            (result.is_ok().then_some(link), carried, result)
        })
        .await;
        match joined {
            Ok((link, carried, result)) => {
                *slot = link;
                (Some(carried), result)
            }
            Err(_) => (None, Err(Error::Link("the link task panicked".into()))),
        }
    }
}

/// Sets a flag when dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Drops a link on a blocking thread (destroying an NCCL communicator may wait).
fn retire(link: Box<dyn Link>) {
    tokio::task::spawn_blocking(move || drop(link));
}

/// Codes with which a receiver turns one request down while its link stays usable.
fn request_level(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::FailedPrecondition | tonic::Code::InvalidArgument | tonic::Code::AlreadyExists
    )
}

fn push_error(address: &str, status: tonic::Status) -> Error {
    Error::Push {
        address: address.to_string(),
        status,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_is_offered_only_with_a_gpu_coordination_and_the_library() {
        let loads = || Ok(());
        assert_eq!(offer_nccl(TransferMode::Auto, true, true, loads), Ok(()));
        let why = |r: std::result::Result<(), String>| r.unwrap_err();
        assert!(why(offer_nccl(TransferMode::Grpc, true, true, loads)).contains("grpc"));
        assert!(why(offer_nccl(TransferMode::Auto, false, true, loads)).contains("CPU"));
        assert!(why(offer_nccl(TransferMode::Auto, true, false, loads)).contains("coordination"));
        assert_eq!(
            why(offer_nccl(TransferMode::Auto, true, true, || Err(
                "no libnccl".into()
            ))),
            "no libnccl"
        );
        let mut called = false;
        let _ = offer_nccl(TransferMode::Grpc, true, true, || {
            called = true;
            Ok(())
        });
        assert!(!called, "forced gRPC never loads NCCL");
    }

    #[test]
    fn modes_parse() {
        assert_eq!("auto".parse::<TransferMode>(), Ok(TransferMode::Auto));
        assert_eq!("grpc".parse::<TransferMode>(), Ok(TransferMode::Grpc));
        assert!("nccl".parse::<TransferMode>().is_err());
        assert_eq!(TransferMode::Grpc.to_string(), "grpc");
    }
}
