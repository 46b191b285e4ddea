//! [`StaticRegistry`]: the in-process registry, and [`StaticDiscovery`], one session on it.
//!
//! A registry is shared by cloning it (an `Arc` inside); each process-like participant takes its
//! own [`session`](StaticRegistry::session). A session plays the part of an etcd lease: what it
//! registers or puts is removed when it is closed or dropped, which is how tests simulate a
//! worker that dies. Changes are published on a bounded broadcast channel while the registry lock
//! is held, so a watch that snapshots under the same lock sees every later change exactly once;
//! a watch that falls behind the channel resynchronizes from a fresh snapshot.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{broadcast, mpsc, watch, Notify};

use crate::task::TaskGuard;
use crate::watch::{WatchState, WATCH_BUFFER};
use crate::{
    Capacity, Discovery, Error, KvKey, Lifetime, Result, Role, WorkerEvent, WorkerId, WorkerInfo,
    WorkerWatch,
};

/// The session of durable values: no session ends it.
const DURABLE: u64 = 0;

/// Changes buffered for watches by default.
const DEFAULT_CHANGE_BUFFER: usize = 1024;

/// A value and the session that holds it.
#[derive(Debug)]
struct Held<T> {
    session: u64,
    value: T,
}

#[derive(Debug, Default)]
struct State {
    workers: BTreeMap<(Role, WorkerId), Held<WorkerInfo>>,
    kv: BTreeMap<KvKey, Held<Vec<u8>>>,
    next_session: u64,
}

impl State {
    fn list(&self, role: Option<Role>) -> Vec<WorkerInfo> {
        self.workers
            .values()
            .filter(|h| role.is_none_or(|r| r == h.value.role))
            .map(|h| h.value.clone())
            .collect()
    }
}

/// A registry change, as watches receive it.
#[derive(Debug, Clone)]
enum Change {
    Put(WorkerInfo),
    Removed(Role, WorkerId),
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    changes: broadcast::Sender<Change>,
    kv_changed: Notify,
    watch_buffer: usize,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent, so a panic elsewhere cannot have
        // left it half-changed.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn publish(&self, change: Change) {
        // No receivers is fine: nobody is watching.
        let _ = self.changes.send(change);
    }
}

/// The in-process registry. Cloning shares it.
#[derive(Debug, Clone)]
pub struct StaticRegistry {
    shared: Arc<Shared>,
}

impl Default for StaticRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl StaticRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::with_buffer(DEFAULT_CHANGE_BUFFER)
    }

    /// An empty registry whose watches buffer `changes` changes (at least 1) before they fall
    /// behind and resynchronize. Small values exercise the resync path in tests.
    pub fn with_buffer(changes: usize) -> Self {
        let changes = changes.max(1);
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                changes: broadcast::channel(changes).0,
                kv_changed: Notify::new(),
                watch_buffer: changes.min(WATCH_BUFFER),
            }),
        }
    }

    /// A new session on this registry.
    pub fn session(&self) -> StaticDiscovery {
        let session = {
            let mut state = self.shared.state();
            state.next_session += 1;
            state.next_session
        };
        StaticDiscovery {
            shared: Arc::clone(&self.shared),
            session,
            closing: watch::channel(false).0,
        }
    }
}

/// One session on a [`StaticRegistry`]; ends (removing what it holds) on close or drop.
#[derive(Debug)]
pub struct StaticDiscovery {
    shared: Arc<Shared>,
    session: u64,
    closing: watch::Sender<bool>,
}

impl StaticDiscovery {
    fn check_open(&self) -> Result<()> {
        if *self.closing.borrow() {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// Removes everything this session holds and ends its watches.
    fn end(&self) {
        self.closing.send_replace(true);
        let mut state = self.shared.state();
        let mine: Vec<(Role, WorkerId)> = state
            .workers
            .iter()
            .filter(|(_, h)| h.session == self.session)
            .map(|(k, _)| k.clone())
            .collect();
        for (role, id) in mine {
            state.workers.remove(&(role, id.clone()));
            self.shared.publish(Change::Removed(role, id));
        }
        state.kv.retain(|_, h| h.session != self.session);
        drop(state);
        self.shared.kv_changed.notify_waiters();
    }

    /// Applies `f` to a worker this session holds and publishes the result.
    fn modify(&self, role: Role, id: &WorkerId, f: impl FnOnce(&mut WorkerInfo)) -> Result<()> {
        self.check_open()?;
        let mut state = self.shared.state();
        match state.workers.get_mut(&(role, id.clone())) {
            Some(held) if held.session == self.session => {
                f(&mut held.value);
                self.shared.publish(Change::Put(held.value.clone()));
                Ok(())
            }
            _ => Err(Error::NotRegistered {
                role,
                id: id.clone(),
            }),
        }
    }
}

impl Drop for StaticDiscovery {
    fn drop(&mut self) {
        self.end();
    }
}

#[async_trait]
impl Discovery for StaticDiscovery {
    async fn register(&self, worker: WorkerInfo) -> Result<()> {
        self.check_open()?;
        let mut state = self.shared.state();
        let key = (worker.role, worker.id.clone());
        if let Some(held) = state.workers.get(&key) {
            if held.session != self.session {
                return Err(Error::AlreadyRegistered {
                    role: key.0,
                    id: key.1,
                });
            }
        }
        state.workers.insert(
            key,
            Held {
                session: self.session,
                value: worker.clone(),
            },
        );
        self.shared.publish(Change::Put(worker));
        Ok(())
    }

    async fn update_capacity(&self, role: Role, id: &WorkerId, capacity: Capacity) -> Result<()> {
        self.modify(role, id, |w| w.capacity = capacity)
    }

    async fn deregister(&self, role: Role, id: &WorkerId) -> Result<()> {
        self.check_open()?;
        let mut state = self.shared.state();
        let key = (role, id.clone());
        match state.workers.get(&key) {
            Some(held) if held.session == self.session => {
                state.workers.remove(&key);
                self.shared.publish(Change::Removed(role, id.clone()));
                Ok(())
            }
            _ => Err(Error::NotRegistered {
                role,
                id: id.clone(),
            }),
        }
    }

    async fn list(&self, role: Option<Role>) -> Result<Vec<WorkerInfo>> {
        self.check_open()?;
        Ok(self.shared.state().list(role))
    }

    async fn watch(&self, role: Option<Role>) -> Result<WorkerWatch> {
        self.check_open()?;
        let (tx, rx) = mpsc::channel(self.shared.watch_buffer);
        let (changes, initial) = {
            let state = self.shared.state();
            (self.shared.changes.subscribe(), state.list(None))
        };
        let task = WatchTask {
            shared: Arc::clone(&self.shared),
            state: WatchState::new(role),
            tx,
            closing: self.closing.subscribe(),
        };
        Ok(WorkerWatch::new(
            rx,
            TaskGuard::spawn(task.run(changes, initial)),
        ))
    }

    async fn put(&self, key: &KvKey, value: Vec<u8>) -> Result<()> {
        self.check_open()?;
        self.shared.state().kv.insert(
            key.clone(),
            Held {
                session: self.session,
                value,
            },
        );
        self.shared.kv_changed.notify_waiters();
        Ok(())
    }

    async fn get(&self, key: &KvKey) -> Result<Option<Vec<u8>>> {
        self.check_open()?;
        Ok(self.shared.state().kv.get(key).map(|h| h.value.clone()))
    }

    async fn wait_for(&self, key: &KvKey, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Register interest before looking, so a put between the two is not missed.
            let notified = self.shared.kv_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(value) = self.get(key).await? {
                return Ok(value);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Error::Timeout {
                    key: key.to_string(),
                    waited: timeout,
                });
            }
        }
    }

    async fn delete(&self, key: &KvKey) -> Result<()> {
        self.check_open()?;
        self.shared.state().kv.remove(key);
        Ok(())
    }

    async fn campaign(&self, key: &KvKey, value: Vec<u8>) -> Result<bool> {
        self.check_open()?;
        let mut state = self.shared.state();
        let held = state.kv.entry(key.clone()).or_insert(Held {
            session: self.session,
            value,
        });
        let holds = held.session == self.session;
        drop(state);
        self.shared.kv_changed.notify_waiters();
        Ok(holds)
    }

    async fn holds(&self, key: &KvKey) -> Result<bool> {
        self.check_open()?;
        let state = self.shared.state();
        Ok(state.kv.get(key).is_some_and(|h| h.session == self.session))
    }

    async fn put_holding(
        &self,
        office: &KvKey,
        key: &KvKey,
        value: Vec<u8>,
        lifetime: Lifetime,
    ) -> Result<bool> {
        self.check_open()?;
        let mut state = self.shared.state();
        if state
            .kv
            .get(office)
            .is_none_or(|h| h.session != self.session)
        {
            return Ok(false);
        }
        let session = match lifetime {
            Lifetime::Session => self.session,
            Lifetime::Durable => DURABLE,
        };
        state.kv.insert(key.clone(), Held { session, value });
        drop(state);
        self.shared.kv_changed.notify_waiters();
        Ok(true)
    }

    async fn close(&self) -> Result<()> {
        self.check_open()?;
        self.end();
        Ok(())
    }
}

/// The task behind one static watch.
struct WatchTask {
    shared: Arc<Shared>,
    state: WatchState,
    tx: mpsc::Sender<WorkerEvent>,
    closing: watch::Receiver<bool>,
}

impl WatchTask {
    async fn run(mut self, mut changes: broadcast::Receiver<Change>, initial: Vec<WorkerInfo>) {
        let events = self.state.resync(initial);
        if !self.send(events).await {
            return;
        }
        loop {
            let change = tokio::select! {
                _ = self.tx.closed() => return,
                _ = self.closing.wait_for(|closing| *closing) => return,
                change = changes.recv() => change,
            };
            let events = match change {
                Ok(Change::Put(info)) => self.state.put(info).into_iter().collect(),
                Ok(Change::Removed(role, id)) => self.state.remove(role, id).into_iter().collect(),
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let workers = {
                        let state = self.shared.state();
                        changes = self.shared.changes.subscribe();
                        state.list(None)
                    };
                    self.state.resync(workers)
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if !self.send(events).await {
                return;
            }
        }
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
