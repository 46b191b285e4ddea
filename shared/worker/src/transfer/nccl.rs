//! NCCL page transfer: a prefill worker P (rank 0) sends a request's pages from its GPU to a
//! decode worker D's GPU (rank 1) over a two-rank link per (P, D) pair.
//!
//! * Set-up, lazily on a pair's first transfer: P makes a unique id, puts it in the coordination
//!   store under `nccl/{P}/{D}/{instance}-{generation}` (bound to P's session, so etcd's lease
//!   removes it if P dies), and calls D's `KvTransfer.NcclConnect` naming the key; both join at
//!   once (each on a blocking thread, with the same deadline) and P deletes the key. A connect that
//!   fails leaves the pair on gRPC for `retry_after`.
//! * A transfer ([`NcclTransport::send_pages`]): P gathers the pages into a staging buffer on its
//!   engine's stream and calls D's `KvTransfer.NcclPages` with what is coming (reservation, page
//!   indices, page bytes, KV-format fingerprint). D checks it like a PushPages stream, posts the
//!   receive and answers `ready`; P sends; D scatters the bytes into the reserved pages and
//!   answers `done`. One transfer per pair at a time (each side holds the pair's lock throughout),
//!   so sends and receives pair up in order.
//! * Failure: a refusal before `ready` leaves the link alone; anything after it (an NCCL error, a
//!   deadline, a broken control stream) breaks the link on both sides (NCCL aborts it) and the
//!   next transfer connects again. The caller falls back to the gRPC stream for that request.
//!   Pages stay owned as in the gRPC path: P holds its pages until the prefill call ends, D's
//!   reservation is filled only by the final scatter and freed by Abort or its TTL.
//! * Checks: D claims the named pages of its reservation before `ready` (each once, as a
//!   PushPages stream does) and checks the received bytes before the scatter (on a host copy of
//!   a device buffer, `Backend::staged_host_bytes`); pages that fail release the reservation and
//!   answer INVALID_ARGUMENT after `done`'s place. P then keeps the link (the bytes moved fine)
//!   and does not fall back: the same bytes would be refused over gRPC.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nibble_discovery::{Discovery, KvKey, NcclEndpoint};
use nibble_kvcache::PageId;
use nibble_proto::v1;
use nibble_proto::v1::kv_transfer_client::KvTransferClient;
use nibble_proto::v1::nccl_pages_progress::Stage;
use nibble_security::Peers;
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use super::PushSummary;
use crate::actor::EngineHandle;
use crate::error::{Error, Result};
use nibble_nccl::link::{Link, LinkFactory, Rank, Staging};

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

/// Why an NCCL transfer did not happen; the request then moves over gRPC.
#[derive(Debug)]
pub struct NcclFailure {
    /// `connect` (setting up the pair), `refused` (the receiver turned the request down before
    /// anything moved) or `transfer` (the link failed mid-way; both ends dropped it).
    pub reason: &'static str,
    pub error: Error,
}

/// A pair as the sender sees it.
#[derive(Default)]
struct SenderPair {
    link: Option<Box<dyn Link>>,
    generation: u64,
    /// Set-up failed: gRPC until then.
    retry_at: Option<Instant>,
}

/// A pair as the receiver sees it.
struct ReceiverPair {
    link: Option<Box<dyn Link>>,
    generation: u64,
}

type Pairs<T> = Mutex<HashMap<String, Arc<AsyncMutex<T>>>>;

/// This worker's NCCL pairs, as sender and as receiver.
pub struct NcclTransport {
    links: Arc<dyn LinkFactory>,
    discovery: Arc<dyn Discovery>,
    worker_id: String,
    endpoint: NcclEndpoint,
    timeouts: NcclTimeouts,
    /// Distinguishes this process's keys from an earlier life's (whose lease may not have
    /// expired yet).
    instance: u64,
    generation: AtomicU64,
    senders: Pairs<SenderPair>,
    receivers: Pairs<ReceiverPair>,
    closed: AtomicBool,
}

impl NcclTransport {
    /// NCCL transfers of worker `worker_id` through `links`, exchanging ids through
    /// `discovery`; it advertises `endpoint`.
    pub fn new(
        links: Arc<dyn LinkFactory>,
        discovery: Arc<dyn Discovery>,
        worker_id: String,
        endpoint: NcclEndpoint,
        timeouts: NcclTimeouts,
    ) -> Self {
        let instance = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(32);
        Self {
            links,
            discovery,
            worker_id,
            endpoint,
            timeouts,
            instance,
            generation: AtomicU64::new(0),
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

    /// Pairs with a link, both roles (a pair busy with a transfer counts).
    pub fn live_links(&self) -> usize {
        let senders = lock(&self.senders)
            .values()
            .filter(|p| p.try_lock().map_or(true, |p| p.link.is_some()))
            .count();
        let receivers = lock(&self.receivers)
            .values()
            .filter(|p| p.try_lock().map_or(true, |p| p.link.is_some()))
            .count();
        senders + receivers
    }

    /// Drops every pair: NCCL communicators are destroyed (or aborted when broken) once their
    /// in-flight transfer, if any, ends. Later transfers fall back to gRPC.
    pub async fn shutdown(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let senders: Vec<_> = lock(&self.senders).drain().map(|(_, p)| p).collect();
        let receivers: Vec<_> = lock(&self.receivers).drain().map(|(_, p)| p).collect();
        let _ = tokio::task::spawn_blocking(move || {
            drop(senders);
            drop(receivers);
        })
        .await;
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Relaxed) {
            Err(Error::Link("the worker is shutting down".into()))
        } else {
            Ok(())
        }
    }

    // ---- the sender (prefill worker) ----

    /// Sends `pages` (P's ids, in the order of `target`'s pages) into D's reservation over the
    /// pair's link, setting the pair up first if needed.
    pub async fn send_pages(
        &self,
        engine: &EngineHandle,
        peers: &Peers,
        request_id: &str,
        target: &v1::TransferTarget,
        pages: &[PageId],
    ) -> std::result::Result<PushSummary, NcclFailure> {
        let fail = |reason| move |error| NcclFailure { reason, error };
        self.check_open().map_err(fail("refused"))?;
        let start = Instant::now();
        let decode = target.decode_worker_id.clone();
        if decode.is_empty() {
            return Err(fail("refused")(Error::InvalidArgument(
                "target.decode_worker_id is needed for NCCL".into(),
            )));
        }
        let pair = Arc::clone(lock(&self.senders).entry(decode.clone()).or_default());
        let mut pair = pair.lock_owned().await;
        if pair.link.is_none() {
            if let Some(at) = pair.retry_at.filter(|at| *at > Instant::now()) {
                return Err(fail("connect")(Error::Link(format!(
                    "set-up failed recently; retrying in {:?}",
                    at - Instant::now()
                ))));
            }
            if let Err(e) = self
                .connect(&mut pair, &decode, &target.address, peers)
                .await
            {
                pair.retry_at = Some(Instant::now() + self.timeouts.retry_after);
                return Err(fail("connect")(e));
            }
        }
        let page_bytes = engine.info().page_bytes;
        let indices: Vec<u32> =
            (target.first_page_index..target.first_page_index + pages.len() as u32).collect();
        let staging = engine
            .gather_staging(pages.to_vec())
            .await
            .map_err(fail("refused"))?;
        let mut client = KvTransferClient::new(
            peers.with_token(
                peers
                    .endpoint(&target.address)
                    .map_err(|e| fail("refused")(e.into()))?
                    .connect()
                    .await
                    .map_err(|source| {
                        fail("refused")(Error::Connect {
                            address: target.address.clone(),
                            source,
                        })
                    })?,
            ),
        );
        let request = v1::NcclPagesRequest {
            sender_id: self.worker_id.clone(),
            generation: pair.generation,
            reservation_id: target.reservation_id,
            page_indices: indices,
            page_bytes: page_bytes as u64,
            kv_format_fingerprint: engine.info().fingerprint,
            request_id: request_id.to_string(),
        };
        let mut stream = match client.nccl_pages(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => {
                if !request_level(status.code()) {
                    drop_link(&mut pair.link); // D lost the pair (or never had it): set up again next time
                }
                return Err(fail("refused")(push_error(&target.address, status)));
            }
        };
        let ready = self.next_stage(&mut stream, &target.address).await;
        match ready {
            Ok(Stage::Ready(r)) if r.bytes as usize == staging.len() => {}
            other => {
                drop_link(&mut pair.link);
                let error = match other {
                    Err(e) => e,
                    Ok(stage) => Error::Link(format!(
                        "expected ready for {} bytes, got {stage:?}",
                        staging.len()
                    )),
                };
                return Err(fail("refused")(error));
            }
        }
        // Past `ready`, every failure breaks the link on both sides.
        let sent = self
            .on_link(&mut pair.link, move |link, timeout| {
                Ok(link.send(staging, timeout)?)
            })
            .await;
        if let Err(e) = sent {
            drop_link(&mut pair.link);
            return Err(fail("transfer")(e));
        }
        let done = match self.next_stage(&mut stream, &target.address).await {
            Ok(Stage::Done(done)) => done,
            // The receiver refused what arrived (a page that fails its checks): the link moved
            // the bytes and stays.
            Err(e @ Error::Push { .. }) if e.is_refusal() => return Err(fail("refused")(e)),
            other => {
                drop_link(&mut pair.link);
                let error = match other {
                    Err(e) => e,
                    Ok(stage) => Error::Link(format!("expected done, got {stage:?}")),
                };
                return Err(fail("transfer")(error));
            }
        };
        if !done.complete || done.pages as usize != pages.len() {
            drop_link(&mut pair.link);
            return Err(fail("transfer")(Error::Link(format!(
                "{} of {} pages arrived (complete: {})",
                done.pages,
                pages.len(),
                done.complete
            ))));
        }
        Ok(PushSummary {
            pages: done.pages as usize,
            bytes: done.bytes,
            duration: start.elapsed(),
            backend: v1::TransferBackend::Nccl,
        })
    }

    /// Sets up the pair with decode worker `decode` at `address` (see the module header).
    async fn connect(
        &self,
        pair: &mut OwnedMutexGuard<SenderPair>,
        decode: &str,
        address: &str,
        peers: &Peers,
    ) -> Result<()> {
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let key = KvKey::new(format!(
            "nccl/{}/{decode}/{:016x}-{generation}",
            self.worker_id, self.instance
        ))?;
        let links = Arc::clone(&self.links);
        let id = tokio::task::spawn_blocking(move || links.new_id())
            .await
            .map_err(|_| Error::Link("the id task panicked".into()))??;
        self.discovery.put(&key, id.clone()).await?;
        let timeout = self.timeouts.timeout;
        let cancel = Arc::new(AtomicBool::new(false));
        let joining = {
            let (links, cancel) = (Arc::clone(&self.links), Arc::clone(&cancel));
            tokio::task::spawn_blocking(move || links.join(&id, Rank::Sender, timeout, &cancel))
        };
        let connected = async {
            let channel =
                peers
                    .endpoint(address)?
                    .connect()
                    .await
                    .map_err(|source| Error::Connect {
                        address: address.to_string(),
                        source,
                    })?;
            KvTransferClient::new(peers.with_token(channel))
                .nccl_connect(v1::NcclConnectRequest {
                    sender_id: self.worker_id.clone(),
                    key: key.to_string(),
                    generation,
                    timeout_ms: timeout.as_millis().min(u32::MAX.into()) as u32,
                })
                .await
                .map_err(|status| push_error(address, status))
        }
        .await;
        if connected.is_err() {
            cancel.store(true, Ordering::Relaxed); // D will not join: stop waiting for it
        }
        let joined = joining
            .await
            .map_err(|_| Error::Link("the join task panicked".into()))
            .and_then(|r| Ok(r?));
        if let Err(e) = self.discovery.delete(&key).await {
            tracing::debug!(%key, error = %e, "deleting the NCCL id failed; it goes with the lease");
        }
        match (joined, connected) {
            (Ok(link), Ok(_)) => {
                tracing::info!(
                    peer = decode,
                    generation,
                    link = self.links.name(),
                    "NCCL pair up"
                );
                pair.link = Some(link);
                pair.generation = generation;
                pair.retry_at = None;
                Ok(())
            }
            (Ok(link), Err(e)) => {
                retire(link);
                Err(e)
            }
            (Err(e), Ok(_)) => Err(e),
            // D's answer says why (the id never appeared, it has no NCCL, ...).
            (Err(_), Err(e)) => Err(e),
        }
    }

    /// The next progress message, within the deadline.
    async fn next_stage(
        &self,
        stream: &mut tonic::Streaming<v1::NcclPagesProgress>,
        address: &str,
    ) -> Result<Stage> {
        match tokio::time::timeout(self.timeouts.timeout, stream.message()).await {
            Err(_) => Err(Error::Link(format!(
                "no progress from {address} within {:?}",
                self.timeouts.timeout
            ))),
            Ok(Err(status)) => Err(push_error(address, status)),
            Ok(Ok(None)) => Err(Error::Link(format!("{address} ended the transfer early"))),
            Ok(Ok(Some(progress))) => progress
                .stage
                .ok_or_else(|| Error::Link("a progress message without a stage".into())),
        }
    }

    /// Runs `op` on the pair's link on a blocking thread; the link comes back unless `op`
    /// failed (a failed link is dropped there, which aborts NCCL).
    async fn on_link<T: Send + 'static>(
        &self,
        slot: &mut Option<Box<dyn Link>>,
        op: impl FnOnce(&mut dyn Link, Duration) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let mut link = slot
            .take()
            .ok_or_else(|| Error::Link("the pair has no link".into()))?;
        let timeout = self.timeouts.timeout;
        let (link, result) = tokio::task::spawn_blocking(move || {
            let result = op(link.as_mut(), timeout);
            (result.is_ok().then_some(link), result)
        })
        .await
        .map_err(|_| Error::Link("the link task panicked".into()))?;
        *slot = link;
        result
    }

    // ---- the receiver (decode worker) ----

    /// Joins sender `r.sender_id`'s pair (the `NcclConnect` call).
    pub async fn accept(&self, r: v1::NcclConnectRequest) -> Result<v1::NcclConnectResponse> {
        self.check_open()?;
        nibble_discovery::WorkerId::new(r.sender_id.clone())?;
        let key = KvKey::new(r.key)?;
        let timeout = match r.timeout_ms {
            0 => self.timeouts.timeout,
            ms => Duration::from_millis(ms.into()).min(MAX_CONNECT_WAIT),
        };
        let started = Instant::now();
        let id = self.discovery.wait_for(&key, timeout).await?;
        let cancel = Arc::new(AtomicBool::new(false));
        // The caller giving up (P's side failed) drops this future: stop waiting then.
        let _cancel_on_drop = CancelOnDrop(Arc::clone(&cancel));
        let links = Arc::clone(&self.links);
        let left = timeout.saturating_sub(started.elapsed());
        let link =
            tokio::task::spawn_blocking(move || links.join(&id, Rank::Receiver, left, &cancel))
                .await
                .map_err(|_| Error::Link("the join task panicked".into()))??;
        let pair = Arc::new(AsyncMutex::new(ReceiverPair {
            link: Some(link),
            generation: r.generation,
        }));
        let old = lock(&self.receivers).insert(r.sender_id.clone(), pair);
        if let Some(old) = old {
            tokio::task::spawn_blocking(move || drop(old));
        }
        tracing::info!(peer = %r.sender_id, generation = r.generation, link = self.links.name(), "NCCL pair up");
        Ok(v1::NcclConnectResponse {
            receiver_id: self.worker_id.clone(),
        })
    }

    /// The pair of sender `sender` at `generation`, locked for one transfer.
    pub(crate) async fn receiver(&self, sender: &str, generation: u64) -> Result<ReceiverGuard> {
        self.check_open()?;
        let missing = || Error::NoCommunicator {
            sender: sender.to_string(),
            generation,
        };
        let pair = lock(&self.receivers)
            .get(sender)
            .cloned()
            .ok_or_else(missing)?;
        let pair = pair.lock_owned().await;
        if pair.generation != generation || pair.link.is_none() {
            return Err(missing());
        }
        Ok(ReceiverGuard(pair))
    }

    /// Receives `bytes` bytes on a locked pair; a failure drops the pair.
    pub(crate) async fn recv(
        &self,
        sender: &str,
        pair: &mut ReceiverGuard,
        bytes: usize,
    ) -> Result<Staging> {
        let result = self
            .on_link(&mut pair.0.link, move |link, timeout| {
                Ok(link.recv(bytes, timeout)?)
            })
            .await;
        if result.is_err() {
            let mut receivers = lock(&self.receivers);
            let ours = OwnedMutexGuard::mutex(&pair.0);
            if receivers.get(sender).is_some_and(|p| Arc::ptr_eq(p, ours)) {
                receivers.remove(sender);
            }
        }
        result
    }
}

/// A receiver pair held for one transfer.
pub(crate) struct ReceiverGuard(OwnedMutexGuard<ReceiverPair>);

/// Sets a flag when dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Takes the pair's link away, dropping it off the async runtime.
fn drop_link(slot: &mut Option<Box<dyn Link>>) {
    if let Some(link) = slot.take() {
        retire(link);
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
