//! [`Shared`]: what the service, the followers and the HTTP API share.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use nibble_proto::v1::worker_client::WorkerClient;
use nibble_security::{AuthChannel, Peers};

use super::ServiceConfig;
use crate::admission::Admission;
use crate::{metrics, Error, Router, MAX_WORKERS};

/// Largest gRPC message the router's worker clients accept.
const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// Most worker clients cached at once (prefill and decode members, and room to spare).
const MAX_CLIENTS: usize = 4 * MAX_WORKERS;

/// State shared by the service, the membership task and the KV-event tasks.
#[derive(Debug)]
pub struct Shared {
    router: Mutex<Router>,
    config: ServiceConfig,
    /// How workers are dialed (TLS, the internal token).
    peers: Peers,
    clients: Mutex<HashMap<String, WorkerClient<AuthChannel>>>,
    admission: Admission,
}

impl Shared {
    /// Shared state over a new [`Router`]. Its gauges are sampled whenever the process's
    /// metrics are scraped ([`nibble_telemetry::register`]), for as long as it lives.
    pub fn new(config: ServiceConfig) -> crate::Result<Arc<Self>> {
        let shared = Arc::new(Self {
            router: Mutex::new(Router::new(config.router.clone())?),
            peers: config.security.peers()?,
            admission: Admission::new(config.admission),
            config,
            clients: Mutex::new(HashMap::new()),
        });
        metrics::describe(shared.config.served_model());
        nibble_telemetry::register(&shared);
        Ok(shared)
    }

    /// What the router serves.
    pub fn config(&self) -> &ServiceConfig {
        &self.config
    }

    /// The routing core (locked).
    pub fn router(&self) -> MutexGuard<'_, Router> {
        self.router.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The admission queue (requests running and waiting).
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// A client of the worker at `address` (`host:port`: `https://` when TLS is on), cached per
    /// address while the worker is a member ([`Shared::forget_client`]); its calls carry the
    /// internal token when one is set.
    pub fn client(&self, address: &str) -> Result<WorkerClient<AuthChannel>, Error> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = clients.get(address) {
            return Ok(client.clone());
        }
        // Members are at most MAX_WORKERS per role; anything beyond is a departed worker's.
        if clients.len() >= MAX_CLIENTS {
            clients.clear();
        }
        let channel = self.peers.connect_lazy(address)?;
        let client = WorkerClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        clients.insert(address.to_string(), client.clone());
        Ok(client)
    }

    /// Drops the cached client of `address` (its worker left).
    pub fn forget_client(&self, address: &str) {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        clients.remove(address);
    }

    /// A new request id, `{kind}-` and 128 random bits: unique, and unguessable, so no client
    /// can name (or abort) another's request on the workers.
    pub fn mint_request_id(&self, kind: &str) -> MintedId {
        MintedId(format!("{kind}-{:032x}", rand::random::<u128>()))
    }
}

/// A request id this router minted ([`Shared::mint_request_id`]): the only ids that name work
/// on workers. A client's own id is a label for its responses and the router's logs. The HTTP
/// API, in process, marks its calls with the id it minted as a request extension, which no
/// remote client can set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MintedId(String);

impl MintedId {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id of choice `index` of a response of several (`n`, a list of prompts): choice 0
    /// keeps this id, choice i > 0 is `{id}-{i}`, so each names its own work on the workers.
    pub fn choice(&self, index: u32) -> MintedId {
        match index {
            0 => self.clone(),
            i => MintedId(format!("{}-{i}", self.0)),
        }
    }
}

impl std::fmt::Display for MintedId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
