//! Pairs set up ahead of traffic: a task follows the membership and, while this worker is a
//! prefill worker, sets a pair up with every decode worker it may send to over NCCL (both offer
//! NCCL, on different GPUs, with the same KV format, and the decode worker is not draining) as
//! soon as it appears, so that no request pays the set-up. A worker that leaves a role has its
//! pairs of that role dropped (as sender to a decode worker, as receiver from a prefill worker);
//! one that returns is paired again. Every few seconds the task also retries the pairs that are
//! down (a failed set-up once its retry delay passed, a pair a link error broke, a role this
//! worker took since).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use nibble_discovery::{Role, WorkerEvent, WorkerInfo};
use nibble_security::Peers;
use tokio::task::JoinHandle;

use super::NcclTransport;

/// How often pairs that are down are set up again.
const RECHECK_EVERY: Duration = Duration::from_secs(5);

/// Which decode workers this worker pairs with ahead of traffic.
#[derive(Clone)]
pub struct PairFilter {
    /// This worker's KV-format fingerprint: decode workers with another are never paired.
    pub fingerprint: u64,
    /// Whether this worker sends now (it is a prefill worker); asked at every event.
    pub is_sender: Arc<dyn Fn() -> bool + Send + Sync>,
}

impl NcclTransport {
    /// Starts pairing ahead of traffic (see the module header), dialing peers with `peers`.
    /// The task ends when the transport shuts down; aborting the handle stops it too.
    pub fn spawn_pairing(self: &Arc<Self>, peers: Peers, filter: PairFilter) -> JoinHandle<()> {
        let this = Arc::clone(self);
        tokio::spawn(async move { this.pair_ahead(peers, filter).await })
    }

    async fn pair_ahead(self: Arc<Self>, peers: Peers, filter: PairFilter) {
        // Decode workers to pair with: id -> KvTransfer address.
        let mut known: HashMap<String, String> = HashMap::new();
        while self.check_open().is_ok() {
            let mut watch = match self.discovery.watch(None).await {
                Ok(watch) => watch,
                Err(e) => {
                    tracing::warn!(error = %e, "NCCL pairing cannot watch the membership; retrying");
                    tokio::time::sleep(RECHECK_EVERY).await;
                    continue;
                }
            };
            let mut tick = tokio::time::interval(RECHECK_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await; // the first tick is immediate
            loop {
                tokio::select! {
                    event = watch.next() => match event {
                        None => break,
                        Some(event) => self.on_event(event, &filter, &peers, &mut known),
                    },
                    _ = tick.tick() => {
                        if self.check_open().is_err() {
                            return;
                        }
                        if (filter.is_sender)() {
                            for (id, address) in &known {
                                if !self.has_link_to(id) {
                                    self.spawn_connect(id, address, &peers);
                                }
                            }
                        }
                    }
                }
            }
            // The session's watch ended (it closed): look again later.
            tokio::time::sleep(RECHECK_EVERY).await;
        }
    }

    fn on_event(
        self: &Arc<Self>,
        event: WorkerEvent,
        filter: &PairFilter,
        peers: &Peers,
        known: &mut HashMap<String, String>,
    ) {
        match event {
            WorkerEvent::Added(w) | WorkerEvent::Updated(w) => {
                if w.role != Role::Decode || w.id.as_str() == self.worker_id {
                    return;
                }
                match self.pairable(&w, filter) {
                    Some(address) => {
                        if (filter.is_sender)() && !self.has_link_to(w.id.as_str()) {
                            self.spawn_connect(w.id.as_str(), &address, peers);
                        }
                        known.insert(w.id.to_string(), address);
                    }
                    None => {
                        known.remove(w.id.as_str());
                    }
                }
            }
            WorkerEvent::Removed { role, id } => {
                if id.as_str() == self.worker_id {
                    return;
                }
                match role {
                    Role::Decode => {
                        known.remove(id.as_str());
                        self.forget_sender_pair(id.as_str());
                    }
                    Role::Prefill => self.forget_receiver_pair(id.as_str()),
                    Role::Router => {}
                }
            }
        }
    }

    /// `w`'s KvTransfer address when this worker may pair with it.
    fn pairable(&self, w: &WorkerInfo, filter: &PairFilter) -> Option<String> {
        let nccl = w.nccl.as_ref()?;
        let ok =
            nccl.gpu != self.endpoint.gpu && w.kv_fingerprint == filter.fingerprint && !w.draining;
        ok.then(|| {
            w.addresses
                .transfer
                .clone()
                .unwrap_or_else(|| w.addresses.grpc.clone())
        })
    }

    fn spawn_connect(self: &Arc<Self>, decode: &str, address: &str, peers: &Peers) {
        let this = Arc::clone(self);
        let (decode, address, peers) = (decode.to_string(), address.to_string(), peers.clone());
        tokio::spawn(async move {
            if let Err(e) = this.connect_ahead(&decode, &address, &peers).await {
                tracing::debug!(peer = %decode, error = %e, "no NCCL pair ahead of traffic");
            }
        });
    }
}
