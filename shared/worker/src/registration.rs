//! Membership: a worker registers under its role with its addresses, model, KV-format
//! fingerprint, page size, capacity and NCCL endpoint (when it offers NCCL), and refreshes its
//! capacity periodically until stopped.

use std::sync::Arc;
use std::time::Duration;

use nibble_discovery::{Addresses, Capacity, Discovery, Role, WorkerId, WorkerInfo};
use tokio::task::JoinHandle;

use crate::error::Result;
use crate::service::WorkerState;

/// The registration of `state` under `role`, listening at `grpc_address`.
pub async fn worker_info(
    state: &WorkerState,
    role: Role,
    grpc_address: &str,
) -> Result<WorkerInfo> {
    let info = state.engine().info();
    let load = state.engine().load().await?;
    let identity = state.identity();
    Ok(WorkerInfo {
        role,
        id: WorkerId::new(identity.worker_id.clone())?,
        addresses: Addresses {
            grpc: grpc_address.to_string(),
            transfer: (!identity.transfer_address.is_empty())
                .then(|| identity.transfer_address.clone()),
            ..Addresses::default()
        },
        model: identity.model.clone(),
        kv_fingerprint: info.fingerprint,
        page_size: info.page_size as u32,
        capacity: Capacity {
            free_pages: load.free_pages as u64,
            total_pages: load.total_pages as u64,
        },
        nccl: state.nccl().map(|n| n.endpoint().clone()),
    })
}

/// Registers the worker, then updates its capacity every `interval` in a background task
/// (stopped by aborting the returned handle; the registration ends with the session). If the
/// engine stops, the task deregisters the worker at once: routers stop sending it work without
/// waiting for its lease to expire.
pub async fn register(
    discovery: Arc<dyn Discovery>,
    state: Arc<WorkerState>,
    role: Role,
    grpc_address: &str,
    interval: Duration,
) -> Result<JoinHandle<()>> {
    let info = worker_info(&state, role, grpc_address).await?;
    discovery.register(info.clone()).await?;
    tracing::info!(role = %role, id = %info.id, address = grpc_address, "registered");
    Ok(tokio::spawn(async move {
        let engine = state.engine().clone();
        tokio::select! {
            () = refresh_capacity(&*discovery, &state, role, &info, interval) => {}
            reason = engine.stopped() => tracing::error!(%reason, "deregistering"),
        }
        if let Err(err) = discovery.deregister(role, &info.id).await {
            tracing::warn!(%err, "deregistering failed; the registration expires with its lease");
        }
    }))
}

/// Updates the registered capacity every `interval` while the engine answers.
async fn refresh_capacity(
    discovery: &dyn Discovery,
    state: &WorkerState,
    role: Role,
    info: &WorkerInfo,
    interval: Duration,
) {
    let mut last = info.capacity;
    let mut ticks = tokio::time::interval(interval);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Ok(load) = state.engine().load().await else {
            return; // the engine stopped
        };
        let capacity = Capacity {
            free_pages: load.free_pages as u64,
            total_pages: load.total_pages as u64,
        };
        if capacity == last {
            continue;
        }
        match discovery.update_capacity(role, &info.id, capacity).await {
            Ok(()) => last = capacity,
            Err(e) => tracing::warn!(error = %e, "capacity update failed"),
        }
    }
}
