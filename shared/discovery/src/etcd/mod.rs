//! [`EtcdDiscovery`]: discovery on etcd.
//!
//! One `EtcdDiscovery` is one session: it grants one lease at connect and attaches every key it
//! writes to it. A background task ([`lease`]) keeps the lease alive; when etcd reports the lease
//! gone (it expired while we were cut off, or etcd lost its data), the task grants a new one and
//! writes every key this session owns again, so a worker that loses its lease registers again
//! without help. Watches ([`watch`]) list, then follow etcd's watch from the listed revision,
//! and list again whenever the watch breaks.
//!
//! Dropping an `EtcdDiscovery` stops the keep-alive without revoking the lease, exactly like a
//! crash: its keys vanish when the lease expires. [`Discovery::close`] revokes it at once.

mod lease;
mod watch;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use tokio::sync::{mpsc, Mutex};

use crate::keys::Layout;
use crate::task::TaskGuard;
use crate::watch::{WatchState, WATCH_BUFFER};
use crate::{
    Capacity, Discovery, Error, KvKey, Lifetime, Result, Role, WorkerId, WorkerInfo, WorkerWatch,
    DEFAULT_ROOT,
};

/// How to reach etcd and how to hold the session's lease.
#[derive(Debug, Clone, PartialEq)]
pub struct EtcdConfig {
    /// Client URLs, such as `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Root of every key (default `/nibble/v1`); clusters sharing one etcd use different roots.
    pub root: String,
    /// Lease time-to-live: how long the session's keys outlive the process. Whole seconds,
    /// at least 1 (etcd may raise very short ones to its minimum).
    pub lease_ttl: Duration,
    /// Limit on establishing a connection.
    pub connect_timeout: Duration,
    /// Limit on one request.
    pub request_timeout: Duration,
    /// Pause before retrying after etcd could not be reached.
    pub retry_interval: Duration,
}

impl EtcdConfig {
    /// Defaults for `endpoints`: 10 s lease, 3 s connect timeout, 5 s request timeout, 500 ms
    /// retry interval.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            root: DEFAULT_ROOT.to_string(),
            lease_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(5),
            retry_interval: Duration::from_millis(500),
        }
    }

    fn ttl_seconds(&self) -> i64 {
        let secs = self.lease_ttl.as_secs() + u64::from(self.lease_ttl.subsec_nanos() > 0);
        i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
    }
}

/// A key this session wrote, to be written again under a new lease.
#[derive(Debug, Clone)]
enum Owned {
    Worker(WorkerInfo),
    Value(Vec<u8>),
}

impl Owned {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Owned::Worker(info) => encode(info),
            Owned::Value(value) => value.clone(),
        }
    }
}

fn encode(info: &WorkerInfo) -> Vec<u8> {
    serde_json::to_vec(info).expect("a WorkerInfo always serializes")
}

/// The lease and everything written under it. Held locked while writing, so a re-registration
/// and an update never interleave.
#[derive(Debug)]
struct Session {
    lease: i64,
    owned: BTreeMap<String, Owned>,
}

/// What the session, the keep-alive task and the watch tasks share.
struct Inner {
    client: Client,
    config: EtcdConfig,
    layout: Layout,
    session: Mutex<Session>,
    closing: tokio::sync::watch::Sender<bool>,
}

impl Inner {
    /// Runs one etcd request under the request timeout.
    async fn call<T>(
        &self,
        op: &'static str,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.config.request_timeout, request).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(source)) => Err(Error::Etcd { op, source }),
            Err(_) => Err(Error::EtcdTimeout {
                op,
                after: self.config.request_timeout,
            }),
        }
    }

    fn is_closing(&self) -> bool {
        *self.closing.borrow()
    }

    fn check_open(&self) -> Result<()> {
        if self.is_closing() {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    async fn grant(&self) -> Result<i64> {
        let mut client = self.client.clone();
        let ttl = self.config.ttl_seconds();
        let granted = self
            .call("lease grant", client.lease_grant(ttl, None))
            .await?;
        Ok(granted.id())
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: i64) -> Result<()> {
        let mut client = self.client.clone();
        let options = PutOptions::new().with_lease(lease);
        self.call("put", client.put(key, value, Some(options)))
            .await
            .map(drop)
    }

    /// Every registration under `prefix` and the revision of the read.
    async fn list_at(&self, role: Option<Role>) -> Result<(Vec<WorkerInfo>, i64)> {
        let mut client = self.client.clone();
        let prefix = self.layout.workers_prefix(role);
        let response = self
            .call(
                "list",
                client.get(prefix, Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let revision = response.header().map_or(0, |h| h.revision());
        let mut workers: Vec<WorkerInfo> = response
            .kvs()
            .iter()
            .filter_map(|kv| match self.decode(kv) {
                Ok(info) => Some(info),
                Err(err) => {
                    tracing::warn!(%err, "skipping a registration");
                    None
                }
            })
            .collect();
        workers.sort_by(|a, b| (a.role, &a.id).cmp(&(b.role, &b.id)));
        Ok((workers, revision))
    }

    /// A registration, checked against the key it is stored under.
    fn decode(&self, kv: &KeyValue) -> Result<WorkerInfo> {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        let info: WorkerInfo =
            serde_json::from_slice(kv.value()).map_err(|source| Error::Malformed {
                key: key.clone(),
                source,
            })?;
        if self.layout.parse_worker(&key) != Some((info.role, info.id.clone())) {
            let source = <serde_json::Error as serde::de::Error>::custom(
                "role and id differ from the key's",
            );
            return Err(Error::Malformed { key, source });
        }
        Ok(info)
    }
}

/// The one line a process logs when etcd cannot be reached: e.g. `etcd at
/// http://127.0.0.1:2379 is not reachable (connection refused); retrying in 0.2 s — is etcd
/// running? (--etcd-endpoints)`. Every nibble binary names etcd with `--etcd-endpoints`.
pub fn unreachable_hint(config: &EtcdConfig, error: &Error, retry_in: Duration) -> String {
    format!(
        "etcd at {} is not reachable ({}); retrying in {:.1} s — is etcd running? \
         (--etcd-endpoints)",
        config.endpoints.join(", "),
        error.brief(),
        retry_in.as_secs_f64()
    )
}

/// Discovery on etcd; see the module docs.
pub struct EtcdDiscovery {
    inner: Arc<Inner>,
    _keeper: TaskGuard,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("endpoints", &self.inner.config.endpoints)
            .field("root", &self.inner.config.root)
            .finish_non_exhaustive()
    }
}

impl EtcdDiscovery {
    /// [`connect`](Self::connect), retried until it succeeds: a process started while etcd is
    /// down (or not yet up) waits for it with backoff (0.2 s doubling to 5 s), logging one line
    /// per failed attempt, instead of exiting ([`unreachable_hint`]: where, why in a few words,
    /// when again, and the flag that names etcd). Cancel it by dropping the future.
    pub async fn connect_retrying(config: EtcdConfig) -> Self {
        let mut delay = Duration::from_millis(200);
        loop {
            match Self::connect(config.clone()).await {
                Ok(discovery) => return discovery,
                Err(err) => tracing::warn!("{}", unreachable_hint(&config, &err, delay)),
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    /// Connects, grants the session's lease and starts keeping it alive.
    pub async fn connect(config: EtcdConfig) -> Result<Self> {
        let options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_keep_alive(Duration::from_secs(5), config.request_timeout)
            .with_keep_alive_while_idle(true);
        let client = match tokio::time::timeout(
            config.connect_timeout,
            Client::connect(&config.endpoints, Some(options)),
        )
        .await
        {
            Ok(Ok(client)) => client,
            Ok(Err(source)) => {
                return Err(Error::Etcd {
                    op: "connect",
                    source,
                })
            }
            Err(_) => {
                return Err(Error::EtcdTimeout {
                    op: "connect",
                    after: config.connect_timeout,
                })
            }
        };
        let layout = Layout::new(&config.root);
        let mut inner = Inner {
            client,
            config,
            layout,
            session: Mutex::new(Session {
                lease: 0,
                owned: BTreeMap::new(),
            }),
            closing: tokio::sync::watch::channel(false).0,
        };
        let lease = inner.grant().await?;
        inner.session.get_mut().lease = lease;
        let inner = Arc::new(inner);
        let keeper = TaskGuard::spawn(lease::keep_alive(Arc::clone(&inner)));
        Ok(Self {
            inner,
            _keeper: keeper,
        })
    }

    /// The id of the session's current lease (it changes when the lease is lost and renewed).
    pub async fn lease_id(&self) -> i64 {
        self.inner.session.lock().await.lease
    }
}

impl Drop for EtcdDiscovery {
    fn drop(&mut self) {
        // Ends this session's watches; the lease is left to expire, like a crash.
        self.inner.closing.send_replace(true);
    }
}

#[async_trait]
impl Discovery for EtcdDiscovery {
    async fn register(&self, worker: WorkerInfo) -> Result<()> {
        let inner = &self.inner;
        inner.check_open()?;
        let key = inner.layout.worker(worker.role, &worker.id);
        let value = encode(&worker);
        let mut session = inner.session.lock().await;
        let lease = session.lease;
        let txn = Txn::new()
            .when([Compare::version(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.as_str(),
                value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let mut client = inner.client.clone();
        let response = inner.call("register", client.txn(txn)).await?;
        if !response.succeeded() {
            let holder = response.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => get.kvs().first().map(KeyValue::lease),
                _ => None,
            });
            if holder != Some(lease) {
                return Err(Error::AlreadyRegistered {
                    role: worker.role,
                    id: worker.id,
                });
            }
            inner.put(&key, value, lease).await?;
        }
        session.owned.insert(key, Owned::Worker(worker));
        Ok(())
    }

    async fn update_capacity(&self, role: Role, id: &WorkerId, capacity: Capacity) -> Result<()> {
        let inner = &self.inner;
        inner.check_open()?;
        let key = inner.layout.worker(role, id);
        let mut session = inner.session.lock().await;
        let lease = session.lease;
        let Some(Owned::Worker(info)) = session.owned.get_mut(&key) else {
            return Err(Error::NotRegistered {
                role,
                id: id.clone(),
            });
        };
        info.capacity = capacity;
        let value = encode(info);
        inner.put(&key, value, lease).await
    }

    async fn deregister(&self, role: Role, id: &WorkerId) -> Result<()> {
        let inner = &self.inner;
        inner.check_open()?;
        let key = inner.layout.worker(role, id);
        let mut session = inner.session.lock().await;
        if !matches!(session.owned.get(&key), Some(Owned::Worker(_))) {
            return Err(Error::NotRegistered {
                role,
                id: id.clone(),
            });
        }
        let mut client = inner.client.clone();
        inner
            .call("deregister", client.delete(key.as_str(), None))
            .await?;
        session.owned.remove(&key);
        Ok(())
    }

    async fn list(&self, role: Option<Role>) -> Result<Vec<WorkerInfo>> {
        self.inner.check_open()?;
        Ok(self.inner.list_at(role).await?.0)
    }

    async fn watch(&self, role: Option<Role>) -> Result<WorkerWatch> {
        self.inner.check_open()?;
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        let task = watch::WatchTask {
            inner: Arc::clone(&self.inner),
            role,
            state: WatchState::new(role),
            tx,
            closing: self.inner.closing.subscribe(),
        };
        Ok(WorkerWatch::new(rx, TaskGuard::spawn(task.run())))
    }

    async fn put(&self, key: &KvKey, value: Vec<u8>) -> Result<()> {
        let inner = &self.inner;
        inner.check_open()?;
        let key = inner.layout.kv(key);
        let mut session = inner.session.lock().await;
        inner.put(&key, value.clone(), session.lease).await?;
        session.owned.insert(key, Owned::Value(value));
        Ok(())
    }

    async fn campaign(&self, key: &KvKey, value: Vec<u8>) -> Result<bool> {
        let inner = &self.inner;
        inner.check_open()?;
        let full = inner.layout.kv(key);
        let session = inner.session.lock().await;
        let lease = session.lease;
        let txn = Txn::new()
            .when([Compare::version(full.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                full.as_str(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(full.as_str(), None)]);
        let mut client = inner.client.clone();
        let response = inner.call("campaign", client.txn(txn)).await?;
        if response.succeeded() {
            return Ok(true);
        }
        let holder = response.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().map(KeyValue::lease),
            _ => None,
        });
        Ok(holder == Some(lease))
    }

    async fn holds(&self, key: &KvKey) -> Result<bool> {
        let inner = &self.inner;
        inner.check_open()?;
        let lease = inner.session.lock().await.lease;
        let mut client = inner.client.clone();
        let response = inner
            .call("get", client.get(inner.layout.kv(key), None))
            .await?;
        Ok(response.kvs().first().map(KeyValue::lease) == Some(lease))
    }

    async fn put_holding(
        &self,
        office: &KvKey,
        key: &KvKey,
        value: Vec<u8>,
        lifetime: Lifetime,
    ) -> Result<bool> {
        let inner = &self.inner;
        inner.check_open()?;
        let session = inner.session.lock().await;
        let lease = session.lease;
        let options = match lifetime {
            Lifetime::Session => Some(PutOptions::new().with_lease(lease)),
            Lifetime::Durable => None,
        };
        let office = inner.layout.kv(office);
        let txn = Txn::new()
            .when([Compare::lease(office.as_str(), CompareOp::Equal, lease)])
            .and_then([TxnOp::put(inner.layout.kv(key).as_str(), value, options)]);
        let mut client = inner.client.clone();
        let response = inner.call("put (holding)", client.txn(txn)).await?;
        Ok(response.succeeded())
    }

    async fn get(&self, key: &KvKey) -> Result<Option<Vec<u8>>> {
        let inner = &self.inner;
        inner.check_open()?;
        let mut client = inner.client.clone();
        let response = inner
            .call("get", client.get(inner.layout.kv(key), None))
            .await?;
        Ok(response.kvs().first().map(|kv| kv.value().to_vec()))
    }

    async fn wait_for(&self, key: &KvKey, timeout: Duration) -> Result<Vec<u8>> {
        let inner = &self.inner;
        inner.check_open()?;
        let full = inner.layout.kv(key);
        let deadline = tokio::time::Instant::now() + timeout;
        let timed_out = || Error::Timeout {
            key: key.to_string(),
            waited: timeout,
        };
        loop {
            match wait_once(inner, &full, deadline).await {
                Ok(Some(value)) => return Ok(value),
                Ok(None) => {}
                Err(err) => tracing::debug!(%err, key = %full, "waiting for a key; retrying"),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(timed_out());
            }
            let pause = tokio::time::sleep(inner.config.retry_interval);
            if tokio::time::timeout_at(deadline, pause).await.is_err() {
                return Err(timed_out());
            }
        }
    }

    async fn delete(&self, key: &KvKey) -> Result<()> {
        let inner = &self.inner;
        inner.check_open()?;
        let key = inner.layout.kv(key);
        let mut session = inner.session.lock().await;
        let mut client = inner.client.clone();
        inner
            .call("delete", client.delete(key.as_str(), None))
            .await?;
        session.owned.remove(&key);
        Ok(())
    }

    async fn close(&self) -> Result<()> {
        let inner = &self.inner;
        inner.check_open()?;
        inner.closing.send_replace(true);
        let mut session = inner.session.lock().await;
        session.owned.clear();
        let mut client = inner.client.clone();
        inner
            .call("lease revoke", client.lease_revoke(session.lease))
            .await
            .map(drop)
    }
}

/// One attempt of [`Discovery::wait_for`]: reads the key, then watches it from the read's
/// revision until it is put, the watch breaks (`Ok(None)`) or the deadline passes.
async fn wait_once(
    inner: &Inner,
    key: &str,
    deadline: tokio::time::Instant,
) -> Result<Option<Vec<u8>>> {
    let mut client = inner.client.clone();
    let response = inner.call("get", client.get(key, None)).await?;
    if let Some(kv) = response.kvs().first() {
        return Ok(Some(kv.value().to_vec()));
    }
    let revision = response.header().map_or(0, |h| h.revision());
    let options = WatchOptions::new().with_start_revision(revision + 1);
    let mut stream = inner
        .call("watch", client.watch(key, Some(options)))
        .await?;
    loop {
        let Ok(message) = tokio::time::timeout_at(deadline, stream.message()).await else {
            return Ok(None);
        };
        let Some(response) = message.map_err(|source| Error::Etcd {
            op: "watch",
            source,
        })?
        else {
            return Ok(None);
        };
        let put = response
            .events()
            .iter()
            .filter(|e| e.event_type() == etcd_client::EventType::Put)
            .find_map(|e| e.kv());
        if let Some(kv) = put {
            return Ok(Some(kv.value().to_vec()));
        }
        if response.canceled() {
            return Ok(None);
        }
    }
}
