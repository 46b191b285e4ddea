//! Membership streams: [`WorkerEvent`], the [`WorkerWatch`] stream, and [`WatchState`], which
//! turns raw changes and full resyncs into the minimal events a consumer needs.
//!
//! Invariant: a consumer that applies every event it receives holds exactly what the
//! [`WatchState`] holds, which after each resync equals the registry's contents.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::mpsc;
use tokio_stream::Stream;

use crate::task::TaskGuard;
use crate::{Role, WorkerId, WorkerInfo};

/// Events buffered per watch before the producer waits for the consumer.
pub(crate) const WATCH_BUFFER: usize = 256;

/// One change of membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerEvent {
    /// A worker appeared (or was already there when the watch started).
    Added(WorkerInfo),
    /// A known worker's registration changed (capacity, addresses, ...).
    Updated(WorkerInfo),
    /// A worker left: deregistered, closed, or its session expired.
    Removed { role: Role, id: WorkerId },
}

/// What a watch has told its consumer so far.
#[derive(Debug, Default)]
pub(crate) struct WatchState {
    role: Option<Role>,
    known: BTreeMap<(Role, WorkerId), WorkerInfo>,
}

impl WatchState {
    /// A state watching one role, or all.
    pub(crate) fn new(role: Option<Role>) -> Self {
        Self {
            role,
            known: BTreeMap::new(),
        }
    }

    fn wants(&self, role: Role) -> bool {
        self.role.is_none_or(|r| r == role)
    }

    /// A worker was put; the event to report, if anything changed.
    pub(crate) fn put(&mut self, info: WorkerInfo) -> Option<WorkerEvent> {
        if !self.wants(info.role) {
            return None;
        }
        let key = (info.role, info.id.clone());
        match self.known.insert(key, info.clone()) {
            None => Some(WorkerEvent::Added(info)),
            Some(old) if old != info => Some(WorkerEvent::Updated(info)),
            Some(_) => None,
        }
    }

    /// A worker was removed; the event to report, if it was known.
    pub(crate) fn remove(&mut self, role: Role, id: WorkerId) -> Option<WorkerEvent> {
        self.known
            .remove(&(role, id.clone()))
            .map(|_| WorkerEvent::Removed { role, id })
    }

    /// The registry now holds exactly `workers`; the events that bring the consumer there.
    pub(crate) fn resync(&mut self, workers: Vec<WorkerInfo>) -> Vec<WorkerEvent> {
        let fresh: BTreeMap<(Role, WorkerId), WorkerInfo> = workers
            .into_iter()
            .filter(|w| self.wants(w.role))
            .map(|w| ((w.role, w.id.clone()), w))
            .collect();
        let gone: Vec<(Role, WorkerId)> = self
            .known
            .keys()
            .filter(|k| !fresh.contains_key(*k))
            .cloned()
            .collect();
        let mut events: Vec<WorkerEvent> = gone
            .into_iter()
            .filter_map(|(role, id)| self.remove(role, id))
            .collect();
        events.extend(fresh.into_values().filter_map(|w| self.put(w)));
        events
    }
}

/// A stream of [`WorkerEvent`]s; see [`Discovery::watch`](crate::Discovery::watch). Dropping it
/// stops the watch.
#[derive(Debug)]
pub struct WorkerWatch {
    events: mpsc::Receiver<WorkerEvent>,
    _task: TaskGuard,
}

impl WorkerWatch {
    /// A watch fed by a task that sends into the other end of `events`.
    pub(crate) fn new(events: mpsc::Receiver<WorkerEvent>, task: TaskGuard) -> Self {
        Self {
            events,
            _task: task,
        }
    }

    /// The next event; `None` once the session is closed.
    pub async fn next(&mut self) -> Option<WorkerEvent> {
        self.events.recv().await
    }
}

impl Stream for WorkerWatch {
    type Item = WorkerEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<WorkerEvent>> {
        self.events.poll_recv(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Addresses, Capacity};

    fn worker(role: Role, id: &str, free: u64) -> WorkerInfo {
        WorkerInfo {
            role,
            id: WorkerId::new(id).unwrap(),
            addresses: Addresses::default(),
            model: "m".into(),
            kv_fingerprint: 1,
            page_size: 16,
            capacity: Capacity {
                free_pages: free,
                total_pages: 100,
            },
            nccl: None,
            draining: false,
        }
    }

    #[test]
    fn put_reports_only_changes() {
        let mut state = WatchState::new(None);
        let a = worker(Role::Decode, "a", 1);
        assert_eq!(state.put(a.clone()), Some(WorkerEvent::Added(a.clone())));
        assert_eq!(state.put(a.clone()), None);
        let a2 = worker(Role::Decode, "a", 2);
        assert_eq!(state.put(a2.clone()), Some(WorkerEvent::Updated(a2)));
        let id = WorkerId::new("a").unwrap();
        assert!(state.remove(Role::Decode, id.clone()).is_some());
        assert_eq!(state.remove(Role::Decode, id), None);
    }

    #[test]
    fn filters_by_role() {
        let mut state = WatchState::new(Some(Role::Prefill));
        assert_eq!(state.put(worker(Role::Decode, "d", 1)), None);
        assert!(state.put(worker(Role::Prefill, "p", 1)).is_some());
        let events = state.resync(vec![worker(Role::Decode, "d", 1)]);
        assert_eq!(
            events,
            vec![WorkerEvent::Removed {
                role: Role::Prefill,
                id: WorkerId::new("p").unwrap()
            }]
        );
    }

    #[test]
    fn resync_yields_the_difference() {
        let mut state = WatchState::new(None);
        for w in [
            worker(Role::Decode, "keep", 1),
            worker(Role::Decode, "change", 1),
            worker(Role::Prefill, "gone", 1),
        ] {
            state.put(w);
        }
        let events = state.resync(vec![
            worker(Role::Decode, "keep", 1),
            worker(Role::Decode, "change", 5),
            worker(Role::Router, "new", 0),
        ]);
        assert_eq!(
            events,
            vec![
                WorkerEvent::Removed {
                    role: Role::Prefill,
                    id: WorkerId::new("gone").unwrap()
                },
                WorkerEvent::Updated(worker(Role::Decode, "change", 5)),
                WorkerEvent::Added(worker(Role::Router, "new", 0)),
            ]
        );
        assert!(state
            .resync(vec![
                worker(Role::Decode, "keep", 1),
                worker(Role::Decode, "change", 5),
                worker(Role::Router, "new", 0),
            ])
            .is_empty());
    }
}
