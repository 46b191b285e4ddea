//! The core of nibble's prefill and decode workers (the `nibble-prefill` and `nibble-decode`
//! binaries are thin wrappers around [`cli::run`]).
//!
//! * [`actor`]: the engine runs on its own OS thread; [`EngineHandle`] is the cloneable async
//!   handle that sends it commands (submit, prefill, reserve, page import/export, decode, abort,
//!   release, load, KV events).
//! * [`service`]: the `Worker` gRPC service (worker.proto) and, on decode workers, `KvTransfer`
//!   (transfer.proto), over one [`WorkerState`].
//! * [`transfer`]: moving a prefilled request's pages into a decode worker's reservation, over
//!   the gRPC stream or NCCL (GPU to GPU, with a fall back to gRPC), and the counters of pages
//!   and bytes moved.
//! * [`server`]: [`serve`] on a bound listener until a shutdown future completes, with
//!   `grpc.health.v1` and reflection.
//! * [`membership`]: registration through a [`nibble_discovery::Discovery`], and role changes in
//!   place ([`role`] gates the calls of each role; [`planned`] follows the planner's decisions).
//! * [`metrics`]: metric names and what records them; every call's logs carry its request id
//!   in a `request` span.
//! * [`error`]: [`Error`] and its one mapping to `tonic::Status`.
//!
//! The flow (DESIGN.md): the router calls `Reserve` on decode worker D, `Prefill` on prefill
//! worker P (which pushes exactly the pages D lacks to D's `KvTransfer`, over NCCL when both
//! offer it), then `Decode` on D.

pub mod actor;
pub mod cli;
pub mod config;
pub mod convert;
pub mod error;
pub mod format;
pub mod kv_events;
pub mod membership;
pub mod metrics;
pub mod planned;
pub mod role;
pub mod server;
pub mod service;
pub mod transfer;

pub use actor::{EngineHandle, EngineInfo, EventStream, LoadSnapshot};
pub use cli::{run, run_on, TransferArgs, WorkerArgs};
pub use config::WorkerConfig;
pub use error::{Error, Result};
pub use nibble_discovery::Role;
pub use nibble_telemetry::logging;
pub use server::serve;
pub use service::{TransferService, WorkerIdentity, WorkerService, WorkerState};
pub use transfer::{TransferCounters, TransferTotals};

/// Aborts a background task when dropped (a detached task would outlive a failed server).
pub(crate) struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
