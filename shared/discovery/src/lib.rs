//! Membership and coordination for a nibble cluster.
//!
//! Every process (router, prefill or decode worker) holds one *session*: on etcd, one lease kept
//! alive in the background; in process, one handle on a shared [`StaticRegistry`]. It registers
//! itself under `{root}/workers/{role}/{id}` (root `/nibble/v1` by default) with its addresses,
//! model, KV-format fingerprint, page size, capacity and NCCL endpoint; the registration lives
//! exactly as long as the session. Routers [`watch`](Discovery::watch) the registrations as a
//! stream of [`WorkerEvent`]s that starts with the current members and survives lost connections
//! by resynchronizing. A small key-value store under `{root}/kv/` (values also bound to the session)
//! carries coordination data such as NCCL unique ids.
//!
//! [`EtcdDiscovery`] is the production implementation, [`StaticDiscovery`] its in-process twin
//! for `nibble up` and tests; both implement [`Discovery`] with the same semantics.

mod error;
mod etcd;
mod keys;
mod outage;
mod static_registry;
mod task;
mod watch;
mod worker;

use std::time::Duration;

use async_trait::async_trait;

pub use error::{Error, Result};
pub use etcd::{unreachable_hint, EtcdConfig, EtcdDiscovery};
pub use keys::{KvKey, DEFAULT_ROOT};
pub use outage::{Failure, OutageLog, Recovered, OUTAGE_LOG_PERIOD};
pub use static_registry::{StaticDiscovery, StaticRegistry};
pub use watch::{WorkerEvent, WorkerWatch};
pub use worker::{Addresses, Capacity, NcclEndpoint, Role, WorkerId, WorkerInfo};

/// How long a value written by [`Discovery::put_holding`] lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// Until the writing session ends.
    Session,
    /// Until it is overwritten or deleted.
    Durable,
}

/// One process's view of cluster membership and coordination state.
///
/// Everything this session writes (registrations and key-value entries, except
/// [`Lifetime::Durable`] values) disappears when the session ends: on [`close`](Discovery::close), when the value is dropped, or (etcd) when the
/// process dies and its lease expires.
#[async_trait]
pub trait Discovery: Send + Sync {
    /// Registers a worker under this session. Registering the same role and id again from the
    /// same session replaces the entry; an entry held by another live session is
    /// [`Error::AlreadyRegistered`].
    async fn register(&self, worker: WorkerInfo) -> Result<()>;

    /// Updates the capacity of a worker this session registered.
    async fn update_capacity(&self, role: Role, id: &WorkerId, capacity: Capacity) -> Result<()>;

    /// Removes a worker this session registered.
    async fn deregister(&self, role: Role, id: &WorkerId) -> Result<()>;

    /// Every registered worker (of one role, or all), ordered by role then id.
    async fn list(&self, role: Option<Role>) -> Result<Vec<WorkerInfo>>;

    /// A stream of membership changes (of one role, or all). It first yields
    /// [`WorkerEvent::Added`] for every current member, then changes as they happen. After a
    /// lost connection it resynchronizes and yields the differences, so a consumer that applies
    /// every event always converges on the registry's contents.
    async fn watch(&self, role: Option<Role>) -> Result<WorkerWatch>;

    /// Stores a value under `key`, bound to this session.
    async fn put(&self, key: &KvKey, value: Vec<u8>) -> Result<()>;

    /// The value under `key`, if any.
    async fn get(&self, key: &KvKey) -> Result<Option<Vec<u8>>>;

    /// The value under `key`, waiting up to `timeout` for someone to put it.
    async fn wait_for(&self, key: &KvKey, timeout: Duration) -> Result<Vec<u8>>;

    /// Removes `key` (a no-op when absent).
    async fn delete(&self, key: &KvKey) -> Result<()>;

    /// An election: takes `key` for this session if no session holds it, storing `value` (who
    /// holds it). True when this session holds the key after the call. The key lives as long
    /// as the session, but unlike [`put`](Self::put)'s values it is never written again under a
    /// renewed etcd lease: a session that lost it (its lease expired) has lost the office and
    /// must campaign again, behind whoever took it meanwhile.
    async fn campaign(&self, key: &KvKey, value: Vec<u8>) -> Result<bool>;

    /// Whether this session holds `key` ([`campaign`](Self::campaign)) now.
    async fn holds(&self, key: &KvKey) -> Result<bool>;

    /// Writes `value` under `key` only while this session holds `office`, checked atomically
    /// with the write (a leader that lost its office between deciding and writing writes
    /// nothing); true if written. With [`Lifetime::Session`] the value goes with the session
    /// (and, like the office, is not written again under a renewed lease); with
    /// [`Lifetime::Durable`] it stays until overwritten or deleted.
    async fn put_holding(
        &self,
        office: &KvKey,
        key: &KvKey,
        value: Vec<u8>,
        lifetime: Lifetime,
    ) -> Result<bool>;

    /// Ends the session now: every registration and value it holds is removed, and later calls
    /// fail with [`Error::Closed`].
    async fn close(&self) -> Result<()>;
}
