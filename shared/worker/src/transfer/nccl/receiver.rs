//! The receiving side (decode worker) of NCCL pairs: joining a pair a sender set up, and one
//! receive at a time per pair, in the order the sender's transfers asked for them.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nibble_discovery::KvKey;
use nibble_nccl::link::{Link, Rank};
use nibble_nccl::staging::Pooled;
use nibble_proto::v1;
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use super::{lock, CancelOnDrop, NcclTransport, MAX_CONNECT_WAIT};
use crate::error::{Error, Result};

/// A pair as the receiver sees it.
pub(crate) struct ReceiverPair {
    pub(super) link: Option<Box<dyn Link>>,
    generation: u64,
}

impl NcclTransport {
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

    /// Receives `bytes` bytes on a locked pair into a pooled staging buffer (it goes back to
    /// the pool when the caller drops it, after the scatter); a failure drops the pair.
    pub(crate) async fn recv(
        &self,
        sender: &str,
        pair: &mut ReceiverGuard,
        bytes: usize,
    ) -> Result<Pooled> {
        let into = self.pool.take(bytes)?;
        let (into, result) = self
            .on_link(&mut pair.0.link, into, move |link, into, timeout| {
                Ok(link.recv(into.get_mut()?, bytes, timeout)?)
            })
            .await;
        match (into, result) {
            (Some(into), Ok(())) => Ok(into),
            (into, result) => {
                // The link was aborted: nothing writes into the buffer any more, but it held
                // a failed transfer's bytes; free it rather than pool it.
                if let Some(into) = into {
                    into.discard();
                }
                let mut receivers = lock(&self.receivers);
                let ours = OwnedMutexGuard::mutex(&pair.0);
                if receivers.get(sender).is_some_and(|p| Arc::ptr_eq(p, ours)) {
                    receivers.remove(sender);
                }
                Err(result.err().unwrap_or_else(|| {
                    Error::Link("the receive task lost the staging buffer".into())
                }))
            }
        }
    }
}

/// A receiver pair held for one transfer.
pub(crate) struct ReceiverGuard(OwnedMutexGuard<ReceiverPair>);
