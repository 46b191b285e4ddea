//! The task behind one etcd watch: list, follow from the listed revision, and list again whenever
//! the watch breaks (etcd restarted, the connection dropped, the revision was compacted).

use std::sync::Arc;

use etcd_client::{EventType, WatchOptions, WatchResponse};
use tokio::sync::mpsc;

use super::Inner;
use crate::watch::WatchState;
use crate::{Role, WorkerEvent};

pub(super) struct WatchTask {
    pub(super) inner: Arc<Inner>,
    pub(super) role: Option<Role>,
    pub(super) state: WatchState,
    pub(super) tx: mpsc::Sender<WorkerEvent>,
    pub(super) closing: tokio::sync::watch::Receiver<bool>,
}

/// Whether the watch goes on.
enum Next {
    Resync,
    Stop,
}

impl WatchTask {
    pub(super) async fn run(mut self) {
        loop {
            match self.inner.list_at(self.role).await {
                Ok((workers, revision)) => {
                    let events = self.state.resync(workers);
                    if !self.send(events).await {
                        return;
                    }
                    if let Next::Stop = self.follow(revision).await {
                        return;
                    }
                }
                Err(err) => tracing::debug!(%err, "etcd watch: listing failed; retrying"),
            }
            tokio::select! {
                _ = self.tx.closed() => return,
                _ = self.closing.wait_for(|closing| *closing) => return,
                _ = tokio::time::sleep(self.inner.config.retry_interval) => {}
            }
        }
    }

    /// Follows changes after `revision` until the watch breaks or the consumer leaves.
    async fn follow(&mut self, revision: i64) -> Next {
        let mut client = self.inner.client.clone();
        let prefix = self.inner.layout.workers_prefix(self.role);
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut stream = match self
            .inner
            .call("watch", client.watch(prefix, Some(options)))
            .await
        {
            Ok(stream) => stream,
            Err(err) => {
                tracing::debug!(%err, "etcd watch: could not start; resyncing");
                return Next::Resync;
            }
        };
        loop {
            let message = tokio::select! {
                _ = self.tx.closed() => return Next::Stop,
                _ = self.closing.wait_for(|closing| *closing) => return Next::Stop,
                message = stream.message() => message,
            };
            let response = match message {
                Ok(Some(response)) => response,
                Ok(None) => {
                    tracing::debug!("etcd watch: stream ended; resyncing");
                    return Next::Resync;
                }
                Err(err) => {
                    tracing::debug!(%err, "etcd watch: stream failed; resyncing");
                    return Next::Resync;
                }
            };
            if response.canceled() || response.compact_revision() > 0 {
                tracing::debug!(
                    reason = response.cancel_reason(),
                    "etcd watch: canceled; resyncing"
                );
                return Next::Resync;
            }
            let events = self.apply(&response);
            if !self.send(events).await {
                return Next::Stop;
            }
        }
    }

    /// The events a watch response brings.
    fn apply(&mut self, response: &WatchResponse) -> Vec<WorkerEvent> {
        let mut events = Vec::new();
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            match event.event_type() {
                EventType::Put => match self.inner.decode(kv) {
                    Ok(info) => events.extend(self.state.put(info)),
                    Err(err) => tracing::warn!(%err, "etcd watch: skipping a registration"),
                },
                EventType::Delete => {
                    let key = String::from_utf8_lossy(kv.key());
                    if let Some((role, id)) = self.inner.layout.parse_worker(&key) {
                        events.extend(self.state.remove(role, id));
                    }
                }
            }
        }
        events
    }

    /// Sends events in order; false once the consumer is gone.
    async fn send(&self, events: Vec<WorkerEvent>) -> bool {
        for event in events {
            if self.tx.send(event).await.is_err() {
                return false;
            }
        }
        true
    }
}
