//! Membership: a worker registers under its role with its addresses, model, KV-format
//! fingerprint, page size, capacity and NCCL endpoint (when it offers NCCL), refreshes its
//! capacity periodically, and can change role in place.
//!
//! A role change ([`Membership::change_role`]) keeps the engine (weights, KV pool, prefix cache)
//! and moves only the registration:
//!
//! 1. the gate starts refusing new work of the old role ([`crate::role`]), and the registration
//!    is rewritten with `draining: true`, so routers stop placing work there;
//! 2. it waits until every call let in has ended and no reservation is pending (a prefill push
//!    in flight completes, running decodes finish);
//! 3. it deregisters the old role and registers the new one (fresh capacity, `draining` off),
//!    and the gate takes the new role's work.
//!
//! A change that cannot start (discovery unreachable) changes nothing: the worker keeps its role
//! and its registration. One that fails after leaving the old role retries registering the new
//! one until it succeeds or the worker stops: no work reaches it meanwhile, none is lost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nibble_discovery::{Addresses, Capacity, Discovery, OutageLog, Role, WorkerId, WorkerInfo};
use nibble_proto::v1;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::service::WorkerState;

/// How often a role change checks whether the old role's work has drained.
const DRAIN_POLL: Duration = Duration::from_millis(20);
/// Pause between attempts to register the new role after a failure.
const REGISTER_RETRY: Duration = Duration::from_millis(500);

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
        draining: false,
    })
}

/// What a completed role change did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleChange {
    pub from: Role,
    pub to: Role,
    /// How long the old role's work took to drain.
    pub drained_in: Duration,
}

/// One worker's registration (see the module docs).
pub struct Membership {
    discovery: Arc<dyn Discovery>,
    state: Arc<WorkerState>,
    id: WorkerId,
    /// The registration as last written; locked across every write, so a capacity refresh never
    /// interleaves with a role change.
    info: Mutex<WorkerInfo>,
}

impl Membership {
    /// Registers `state` under the role it has now, listening at `grpc_address`.
    pub async fn join(
        discovery: Arc<dyn Discovery>,
        state: Arc<WorkerState>,
        grpc_address: &str,
    ) -> Result<Arc<Self>> {
        let role = discovery_role(state.role())?;
        let info = worker_info(&state, role, grpc_address).await?;
        discovery.register(info.clone()).await?;
        tracing::info!(role = %role, id = %info.id, address = grpc_address, "registered");
        Ok(Arc::new(Self {
            discovery,
            state,
            id: info.id.clone(),
            info: Mutex::new(info),
        }))
    }

    pub fn id(&self) -> &WorkerId {
        &self.id
    }

    pub fn discovery(&self) -> &Arc<dyn Discovery> {
        &self.discovery
    }

    /// The role it is registered under (the old one while a change drains).
    pub async fn role(&self) -> Role {
        self.info.lock().await.role
    }

    /// Updates the registered capacity every `interval` in a background task (stopped by
    /// aborting the handle; the registration ends with the session). If the engine stops, the
    /// task deregisters the worker at once: routers stop sending it work without waiting for its
    /// lease to expire.
    pub fn refresh(self: &Arc<Self>, interval: Duration) -> JoinHandle<()> {
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let engine = this.state.engine().clone();
            tokio::select! {
                () = this.refresh_capacity(interval) => {}
                reason = engine.stopped() => tracing::error!(%reason, "deregistering"),
            }
            if let Err(err) = this.leave().await {
                tracing::warn!(%err, "deregistering failed; the registration expires with its lease");
            }
        })
    }

    /// Removes the registration (whatever role it is under now).
    pub async fn leave(&self) -> Result<()> {
        let info = self.info.lock().await;
        self.discovery.deregister(info.role, &info.id).await?;
        Ok(())
    }

    /// Updates the registered capacity every `interval` while the engine answers.
    async fn refresh_capacity(&self, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.tick().await;
        // While etcd is down every tick fails: logged once, then twice a minute at most.
        let mut outage = OutageLog::new("updating the registered capacity in etcd");
        loop {
            ticks.tick().await;
            let Ok(load) = self.state.engine().published_load() else {
                return; // the engine stopped
            };
            let capacity = Capacity {
                free_pages: load.free_pages as u64,
                total_pages: load.total_pages as u64,
            };
            let mut info = self.info.lock().await;
            // Unchanged: nothing to write, unless an update failed since the last one that
            // succeeded; then writing it again tells when etcd is back.
            if capacity == info.capacity && !outage.failing() {
                continue;
            }
            match self
                .discovery
                .update_capacity(info.role, &info.id, capacity)
                .await
            {
                Ok(()) => {
                    info.capacity = capacity;
                    outage.recover();
                }
                Err(e) => outage.fail(&e),
            }
        }
    }

    /// Makes this worker a `to` worker in place (see the module docs). A no-op when it already
    /// is one; refused while another change is under way.
    pub async fn change_role(&self, to: Role) -> Result<RoleChange> {
        let wire = wire_role(to)?;
        let from = discovery_role(self.state.role())?;
        if from == to {
            return Ok(RoleChange {
                from,
                to,
                drained_in: Duration::ZERO,
            });
        }
        let gate = self.state.gate();
        if !gate.start_leaving() {
            return Err(Error::InvalidArgument(format!(
                "worker {} is already changing role",
                self.id
            )));
        }
        let started = Instant::now();
        tracing::info!(%from, %to, "changing role: draining {from} work");
        {
            let mut info = self.info.lock().await;
            let draining = WorkerInfo {
                draining: true,
                ..info.clone()
            };
            if let Err(err) = self.discovery.register(draining.clone()).await {
                // Nothing changed: the worker keeps its role and its registration.
                gate.settle(self.state.role());
                return Err(err.into());
            }
            *info = draining;
        }
        while !self.state.drained() {
            if self.state.engine().stop_reason().is_some() {
                return Err(Error::EngineStopped);
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
        let drained_in = started.elapsed();
        let mut info = self.info.lock().await;
        if let Err(err) = self.discovery.deregister(from, &self.id).await {
            tracing::warn!(%err, "deregistering the old role failed; it expires with the lease");
        }
        gate.settle(wire);
        crate::metrics::leave_role(from, &self.state.identity().worker_id);
        let load = self.state.engine().load().await?;
        let next = WorkerInfo {
            role: to,
            draining: false,
            capacity: Capacity {
                free_pages: load.free_pages as u64,
                total_pages: load.total_pages as u64,
            },
            ..info.clone()
        };
        while let Err(err) = self.discovery.register(next.clone()).await {
            if self.state.engine().stop_reason().is_some() {
                return Err(Error::EngineStopped);
            }
            tracing::warn!(%err, "registering as {to} failed; retrying");
            tokio::time::sleep(REGISTER_RETRY).await;
        }
        *info = next;
        tracing::info!(
            %from,
            %to,
            drained_ms = drained_in.as_millis() as u64,
            "changed role"
        );
        Ok(RoleChange {
            from,
            to,
            drained_in,
        })
    }
}

/// Registers the worker and refreshes its capacity every `interval` ([`Membership::refresh`]).
pub async fn register(
    discovery: Arc<dyn Discovery>,
    state: Arc<WorkerState>,
    grpc_address: &str,
    interval: Duration,
) -> Result<(Arc<Membership>, JoinHandle<()>)> {
    let membership = Membership::join(discovery, state, grpc_address).await?;
    let refresh = membership.refresh(interval);
    Ok((membership, refresh))
}

fn discovery_role(role: v1::WorkerRole) -> Result<Role> {
    match role {
        v1::WorkerRole::Prefill => Ok(Role::Prefill),
        v1::WorkerRole::Decode => Ok(Role::Decode),
        other => Err(Error::InvalidArgument(format!(
            "a worker is prefill or decode, not {}",
            crate::role::role_name(other)
        ))),
    }
}

fn wire_role(role: Role) -> Result<v1::WorkerRole> {
    match role {
        Role::Prefill => Ok(v1::WorkerRole::Prefill),
        Role::Decode => Ok(v1::WorkerRole::Decode),
        Role::Router => Err(Error::InvalidArgument(
            "a worker is prefill or decode, not router".into(),
        )),
    }
}
