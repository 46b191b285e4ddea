//! Following the cluster: membership from a discovery watch, and per tracked worker its
//! KV-event stream (into the prefix index) and its load.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use nibble_discovery::{Discovery, Role, WorkerEvent, WorkerId, WorkerInfo};
use nibble_proto::v1;
use tokio::task::JoinHandle;
use tonic::Status;

use super::Shared;
use crate::{metrics, KvEvent, LoadReport, SyncStatus};

/// Pause before a worker's KV-event subscription is retried.
const RESUBSCRIBE_DELAY: Duration = Duration::from_millis(200);

/// Follows `discovery`'s membership until the watch ends: applies every event to the router
/// and keeps one KV-event subscription task per tracked worker.
pub async fn follow_membership(shared: Arc<Shared>, discovery: Arc<dyn Discovery>) {
    let mut watch = match discovery.watch(None).await {
        Ok(watch) => watch,
        Err(err) => {
            tracing::error!(%err, "cannot watch workers");
            return;
        }
    };
    let mut tasks: HashMap<(Role, WorkerId), (String, JoinHandle<()>)> = HashMap::new();
    while let Some(event) = watch.next().await {
        let key = match &event {
            WorkerEvent::Added(info) | WorkerEvent::Updated(info) => (info.role, info.id.clone()),
            WorkerEvent::Removed { role, id } => (*role, id.clone()),
        };
        let info = match &event {
            WorkerEvent::Added(info) | WorkerEvent::Updated(info) => Some(info.clone()),
            WorkerEvent::Removed { .. } => None,
        };
        if let Err(err) = shared.router().apply_worker_event(event) {
            tracing::warn!(%err, "worker refused");
        }
        let tracked = shared.router().slot(key.0, &key.1).is_ok();
        match info.filter(|_| tracked) {
            Some(info) => {
                let same = tasks.get(&key).is_some_and(|(address, task)| {
                    *address == info.addresses.grpc && !task.is_finished()
                });
                if !same {
                    let task = tokio::spawn(follow_worker(Arc::clone(&shared), info.clone()));
                    if let Some((_, old)) = tasks.insert(key, (info.addresses.grpc.clone(), task)) {
                        old.abort();
                    }
                }
            }
            None => {
                if let Some((address, task)) = tasks.remove(&key) {
                    task.abort();
                    shared.forget_client(&address);
                }
            }
        }
    }
    for (_, (_, task)) in tasks {
        task.abort();
    }
}

/// Follows one worker until the task is aborted: its KV events ([`follow_kv_events`]) and its
/// load ([`poll_load`]).
async fn follow_worker(shared: Arc<Shared>, info: WorkerInfo) {
    tokio::join!(
        follow_kv_events(Arc::clone(&shared), info.clone()),
        poll_load(shared, info)
    );
}

/// Reports the worker's `Load` to the router every `load_interval` while it is tracked. A failed
/// poll is skipped: the router's own accounting carries the estimate until the next report.
async fn poll_load(shared: Arc<Shared>, info: WorkerInfo) {
    let mut ticks = tokio::time::interval(shared.config().load_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Ok(mut client) = shared.client(&info.addresses.grpc) else {
            return;
        };
        let load = match client.load(v1::LoadRequest {}).await {
            Ok(load) => load.into_inner(),
            Err(status) => {
                tracing::debug!(role = %info.role, id = %info.id, %status, "load poll failed");
                // A worker that cannot be reached gets no requests until it answers again.
                if status.code() == tonic::Code::Unavailable
                    && shared.router().set_reachable(info.role, &info.id, false)
                {
                    tracing::warn!(role = %info.role, id = %info.id, %status, "worker unreachable");
                }
                continue;
            }
        };
        if shared.router().set_reachable(info.role, &info.id, true) {
            tracing::info!(role = %info.role, id = %info.id, "worker reachable again");
        }
        if shared
            .router()
            .report_load(info.role, &info.id, LoadReport::from(&load))
            .is_err()
        {
            return; // no longer tracked
        }
    }
}

/// Feeds one worker's KV events into the router until the task is aborted, resubscribing
/// after errors and asking for a snapshot whenever the router reports a gap.
async fn follow_kv_events(shared: Arc<Shared>, info: WorkerInfo) {
    let (role, id) = (info.role, info.id.clone());
    loop {
        if let Err(err) = subscribe_once(&shared, &info).await {
            tracing::debug!(%role, %id, %err, "KV-event stream ended");
        }
        if shared.router().slot(role, &id).is_err() {
            return;
        }
        tokio::time::sleep(RESUBSCRIBE_DELAY).await;
    }
}

async fn subscribe_once(shared: &Shared, info: &WorkerInfo) -> Result<(), Status> {
    let mut client = shared.client(&info.addresses.grpc).map_err(Status::from)?;
    let mut stream = client
        .subscribe_kv_events(v1::SubscribeKvEventsRequest {})
        .await?
        .into_inner();
    while let Some(batch) = stream.message().await? {
        // A batch with an invalid event is refused whole.
        let events = batch
            .events
            .into_iter()
            .map(KvEvent::try_from)
            .collect::<Result<Vec<_>, _>>()
            .map_err(Status::from)?;
        let report = shared
            .router()
            .apply_kv_events(info.role, &info.id, batch.instance_id, &events)
            .map_err(Status::from)?;
        metrics::kv_sync(info.role, &report);
        if matches!(report.status, SyncStatus::SnapshotNeeded(_)) {
            let snapshot = client
                .kv_snapshot(v1::KvSnapshotRequest {})
                .await?
                .into_inner();
            let report = shared
                .router()
                .apply_kv_snapshot(
                    info.role,
                    &info.id,
                    snapshot.instance_id,
                    &snapshot.to_domain(),
                )
                .map_err(Status::from)?;
            metrics::kv_sync(info.role, &report);
        }
    }
    Ok(())
}
