//! The sending side (prefill worker) of NCCL pairs: setting a pair up (ahead of traffic or on a
//! transfer's path, never twice at once) and transfers, sent one at a time in the order they
//! took their turn on the pair (see the parent module).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nibble_discovery::KvKey;
use nibble_kvcache::PageId;
use nibble_nccl::link::{Link, Rank};
use nibble_proto::v1;
use nibble_proto::v1::kv_transfer_client::KvTransferClient;
use nibble_proto::v1::nccl_pages_progress::Stage;
use nibble_security::Peers;
use tokio::sync::{Mutex as AsyncMutex, Semaphore};

use super::{lock, push_error, request_level, retire, NcclFailure, NcclTransport};
use crate::actor::EngineHandle;
use crate::error::{Error, Result};
use crate::metrics;
use crate::transfer::PushSummary;

/// One pair as the sender sees it. `turn` is held to set the pair up and to send, so set-ups
/// and sends of the pair never overlap and sends go in the order of the turns (tokio's mutex is
/// fair).
pub(super) struct SenderEntry {
    pub(super) turn: AsyncMutex<SenderPair>,
    /// Whether `turn`'s pair has a link (readable without waiting for the turn).
    up: AtomicBool,
    /// The decode worker left (or this worker shuts down): no new set-up or send.
    retired: AtomicBool,
    /// Set-up failed: gRPC until then.
    retry_at: Mutex<Option<Instant>>,
    /// Transfers under way (`NcclLimits::max_in_flight`).
    in_flight: Semaphore,
}

#[derive(Default)]
pub(super) struct SenderPair {
    link: Option<Box<dyn Link>>,
    generation: u64,
}

impl SenderEntry {
    fn new(max_in_flight: usize) -> Self {
        Self {
            turn: AsyncMutex::default(),
            up: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            retry_at: Mutex::new(None),
            in_flight: Semaphore::new(max_in_flight),
        }
    }

    pub(super) fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    pub(super) fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
    }

    fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// Drops the pair's link (off the async runtime).
    pub(super) fn take_link(&self, pair: &mut SenderPair) {
        if let Some(link) = pair.link.take() {
            retire(link);
        }
        self.up.store(false, Ordering::Relaxed);
    }

    fn install(&self, pair: &mut SenderPair, link: Box<dyn Link>, generation: u64) {
        if let Some(old) = pair.link.replace(link) {
            retire(old);
        }
        pair.generation = generation;
        *lock(&self.retry_at) = None;
        self.up.store(true, Ordering::Relaxed);
    }

    /// How long the pair stays on gRPC after a failed set-up, if it does now.
    fn backoff(&self) -> Option<Duration> {
        let at = (*lock(&self.retry_at))?;
        at.checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    }
}

/// What started a set-up, as metrics and logs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Trigger {
    /// The decode worker's registration was seen.
    Ahead,
    /// A transfer found its pair down.
    Request,
}

impl Trigger {
    fn label(self) -> &'static str {
        match self {
            Trigger::Ahead => "ahead",
            Trigger::Request => "request",
        }
    }
}

impl NcclTransport {
    fn sender_entry(&self, decode: &str) -> Arc<SenderEntry> {
        let max = self.limits.max_in_flight;
        let mut senders = lock(&self.senders);
        let entry = senders
            .entry(decode.to_string())
            .or_insert_with(|| Arc::new(SenderEntry::new(max)));
        Arc::clone(entry)
    }

    /// Sets the pair with decode worker `decode` (KvTransfer at `address`) up ahead of traffic,
    /// unless it is up, being set up or sending, or waiting out a failed set-up. Returns whether
    /// it made a link now.
    pub async fn connect_ahead(&self, decode: &str, address: &str, peers: &Peers) -> Result<bool> {
        self.check_open()?;
        let entry = self.sender_entry(decode);
        if entry.is_up() || entry.backoff().is_some() {
            return Ok(false);
        }
        // Busy: another set-up or a transfer holds the turn.
        let Ok(mut pair) = entry.turn.try_lock() else {
            return Ok(false);
        };
        if pair.link.is_some() || entry.is_retired() {
            return Ok(false);
        }
        self.connect(&entry, &mut pair, decode, address, peers, Trigger::Ahead)
            .await?;
        Ok(true)
    }

    /// Sends `pages` (P's ids, in the order of `target`'s pages) into D's reservation over the
    /// pair's link, setting the pair up first if needed (or waiting for a set-up under way).
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
        let decode = target.decode_worker_id.as_str();
        if decode.is_empty() {
            return Err(fail("refused")(Error::InvalidArgument(
                "target.decode_worker_id is needed for NCCL".into(),
            )));
        }
        let entry = self.sender_entry(decode);
        let backoff = |entry: &SenderEntry| {
            entry.backoff().map(|wait| {
                fail("connect")(Error::Link(format!(
                    "set-up failed recently; retrying in {wait:?}"
                )))
            })
        };
        if let (false, Some(failure)) = (entry.is_up(), backoff(&entry)) {
            return Err(failure);
        }
        let _permit = entry
            .in_flight
            .acquire()
            .await
            .map_err(|_| fail("refused")(Error::Link("the pair is closed".into())))?;

        // Gathered before the turn: this overlaps the send of the transfer ahead.
        let page_bytes = engine.info().page_bytes;
        let bytes = pages.len() * page_bytes;
        let mut staging = self
            .pool
            .take(bytes)
            .map_err(|e| fail("refused")(e.into()))?;
        let buffer = staging.take_out().map_err(|e| fail("refused")(e.into()))?;
        let (buffer, gathered) = engine.gather_staging(pages.to_vec(), buffer).await;
        if let Some(buffer) = buffer {
            staging.restore(buffer);
        }
        gathered.map_err(fail("refused"))?;

        let mut pair = entry.turn.lock().await;
        if entry.is_retired() {
            return Err(fail("connect")(Error::Link(format!(
                "decode worker {decode} left; its pair is gone"
            ))));
        }
        if pair.link.is_none() {
            if let Some(failure) = backoff(&entry) {
                return Err(failure);
            }
            self.connect(
                &entry,
                &mut pair,
                decode,
                &target.address,
                peers,
                Trigger::Request,
            )
            .await
            .map_err(fail("connect"))?;
        }
        let generation = pair.generation;
        let request = v1::NcclPagesRequest {
            sender_id: self.worker_id.clone(),
            generation,
            reservation_id: target.reservation_id,
            page_indices: (target.first_page_index..).take(pages.len()).collect(),
            page_bytes: page_bytes as u64,
            kv_format_fingerprint: engine.info().fingerprint,
            request_id: request_id.to_string(),
        };
        // Bounded: a decode worker that never answers must not hold the pair's turn.
        let answered = tokio::time::timeout(self.control_deadline(), async {
            let channel = peers
                .endpoint(&target.address)?
                .connect()
                .await
                .map_err(|source| Error::Connect {
                    address: target.address.clone(),
                    source,
                })?;
            let mut client = KvTransferClient::new(peers.with_token(channel));
            Ok::<_, Error>(client.nccl_pages(request).await)
        })
        .await;
        let mut stream = match answered {
            Ok(Ok(Ok(response))) => response.into_inner(),
            Ok(Ok(Err(status))) => {
                if !request_level(status.code()) {
                    // D lost the pair (or never had it): set up again next time.
                    entry.take_link(&mut pair);
                }
                return Err(fail("refused")(push_error(&target.address, status)));
            }
            Ok(Err(e)) => return Err(fail("refused")(e)),
            Err(_) => {
                // D may yet post the receive: the link is no longer in step.
                entry.take_link(&mut pair);
                return Err(fail("refused")(Error::Link(format!(
                    "{} did not answer NcclPages within {:?}",
                    target.address,
                    self.control_deadline()
                ))));
            }
        };
        match self.next_stage(&mut stream, &target.address).await {
            Ok(Stage::Ready(r)) if r.bytes as usize == bytes => {}
            other => {
                entry.take_link(&mut pair);
                let error = match other {
                    Err(e) => e,
                    Ok(stage) => {
                        Error::Link(format!("expected ready for {bytes} bytes, got {stage:?}"))
                    }
                };
                return Err(fail("refused")(error));
            }
        }
        // Past `ready`, every failure breaks the link on both sides.
        let (staging, sent) = self
            .on_link(&mut pair.link, staging, |link, staging, timeout| {
                Ok(link.send(staging.get()?, timeout)?)
            })
            .await;
        if let Err(e) = sent {
            entry.take_link(&mut pair);
            if let Some(staging) = staging {
                staging.discard();
            }
            return Err(fail("transfer")(e));
        }
        // The link no longer reads the buffer, and the next transfer of the pair may send
        // while D scatters this one.
        drop(staging);
        drop(pair);
        let done = match self.next_stage(&mut stream, &target.address).await {
            Ok(Stage::Done(done)) => done,
            // The receiver refused what arrived (a page that fails its checks): the link moved
            // the bytes and stays.
            Err(e @ Error::Push { .. }) if e.is_refusal() => return Err(fail("refused")(e)),
            other => {
                self.break_generation(&entry, generation).await;
                let error = match other {
                    Err(e) => e,
                    Ok(stage) => Error::Link(format!("expected done, got {stage:?}")),
                };
                return Err(fail("transfer")(error));
            }
        };
        if !done.complete || done.pages as usize != pages.len() {
            self.break_generation(&entry, generation).await;
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

    /// Drops the pair's link if it is still the one of `generation` (a transfer that failed
    /// after its turn ended).
    async fn break_generation(&self, entry: &SenderEntry, generation: u64) {
        let mut pair = entry.turn.lock().await;
        if pair.generation == generation {
            entry.take_link(&mut pair);
        }
    }

    /// Sets the pair up (the caller holds its turn), counting and timing it.
    async fn connect(
        &self,
        entry: &SenderEntry,
        pair: &mut SenderPair,
        decode: &str,
        address: &str,
        peers: &Peers,
        trigger: Trigger,
    ) -> Result<()> {
        match trigger {
            Trigger::Ahead => &self.connects.ahead,
            Trigger::Request => &self.connects.on_request,
        }
        .fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let joined = self.join_pair(decode, address, peers).await;
        let took = started.elapsed();
        metrics::nccl_connect(trigger.label(), joined.is_ok(), took);
        match joined {
            Ok((link, generation)) if entry.is_retired() => {
                retire(link);
                tracing::info!(
                    peer = decode,
                    generation,
                    "NCCL pair up after its peer left: dropped"
                );
                Err(Error::Link(format!("decode worker {decode} left")))
            }
            Ok((link, generation)) => {
                entry.install(pair, link, generation);
                tracing::info!(
                    peer = decode,
                    generation,
                    trigger = trigger.label(),
                    millis = took.as_millis() as u64,
                    link = self.links.name(),
                    "NCCL pair up"
                );
                Ok(())
            }
            Err(e) => {
                self.connects.failed.fetch_add(1, Ordering::Relaxed);
                *lock(&entry.retry_at) = Some(Instant::now() + self.timeouts.retry_after);
                tracing::warn!(
                    peer = decode,
                    trigger = trigger.label(),
                    error = %e,
                    retry_after = ?self.timeouts.retry_after,
                    "NCCL pair set-up failed; the pair uses gRPC until the retry"
                );
                Err(e)
            }
        }
    }

    /// The set-up itself (see the parent module): the new link and its generation.
    async fn join_pair(
        &self,
        decode: &str,
        address: &str,
        peers: &Peers,
    ) -> Result<(Box<dyn Link>, u64)> {
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
        let deadline = self.control_deadline();
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
        };
        // Bounded: a decode worker that never answers must not hold the pair's turn.
        let connected = tokio::time::timeout(deadline, connected)
            .await
            .unwrap_or_else(|_| {
                Err(Error::Link(format!(
                    "{address} did not answer NcclConnect within {deadline:?}"
                )))
            });
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
            (Ok(link), Ok(_)) => Ok((link, generation)),
            (Ok(link), Err(e)) => {
                retire(link);
                Err(e)
            }
            (Err(e), Ok(_)) => Err(e),
            // D's answer says why (the id never appeared, it has no NCCL, ...).
            (Err(_), Err(e)) => Err(e),
        }
    }

    /// How long a control call (NcclConnect, NcclPages up to its headers) may take: the
    /// receiver's own waits (the id and the join, or a receive ahead of it) are bounded by the
    /// transfer deadline, so twice that means it is not answering.
    fn control_deadline(&self) -> Duration {
        self.timeouts.timeout.saturating_mul(2)
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
}
