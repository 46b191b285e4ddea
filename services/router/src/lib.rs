//! nibble's router core: where each request goes.
//!
//! The router keeps a cluster-wide [`PrefixIndex`] of which worker caches which prefix, fed by
//! every worker's KV-event stream (chained block hashes, the same keys workers compute), tracks
//! each worker's live [`Load`], and places each request on a decode worker D and, when the part
//! of the prompt D lacks is long enough, a prefill worker P of the same KV format
//! ([`Decision`]). The cost weighs uncached prompt tokens against load, and ties spread over
//! workers instead of herding ([`policy`]).
//!
//! Modules:
//! * [`slots`]: worker slots and bitmask sets of them;
//! * [`index`]: the prefix index and, in [`sync`], each worker's event-stream position (gaps,
//!   restarts, snapshot repair);
//! * [`load`]: live load from reports and this router's own in-flight accounting;
//! * [`policy`]: the cost and the tie-breaking choice;
//! * [`prompt`], [`decision`]: what goes in and what comes out;
//! * [`router`]: [`Router`], the plain state a service's actor owns, tying them together;
//! * [`metrics`]: metric names.
//!
//! * [`service`], [`server`]: the gRPC `Inference` service on top of a shared [`Router`], and
//!   [`serve`]; [`admission`]: the bounded queue in front of it;
//! * [`http`]: the OpenAI-compatible HTTP API over the same shared state and generate path;
//! * [`cli`]: the `nibble-router` (and `nibble router`) command line and [`cli::run`].
//!
//! The core is synchronous and needs no runtime; the gRPC service is built on top.

mod error;

pub mod admission;
pub mod cli;
pub mod decision;
#[cfg(test)]
mod fuzz;
pub mod http;
pub mod index;
pub mod load;
pub mod metrics;
pub mod policy;
pub mod prompt;
pub mod router;
pub mod server;
pub mod service;
pub mod slots;

pub use admission::{Admission, AdmissionConfig};
pub use decision::{Decision, Placement, Reason, Routed, Ticket};
pub use error::{Error, Result};
pub use http::HttpConfig;
pub use index::sync::{self, Gap, SyncReport, SyncStatus};
pub use index::{PrefixDepths, PrefixIndex, UnknownSlot};
pub use load::{Load, LoadReport};
pub use policy::{PolicyConfig, Routing};
pub use prompt::Prompt;
pub use router::{Router, RouterConfig, RouterStats, WorkerStatus};
pub use server::{
    serve, serve_shared, serve_shared_with_http, serve_with_http, HttpListener, ServeError,
};
pub use service::{InferenceService, ServiceConfig, Shared};
pub use slots::{WorkerSet, WorkerSlot, MAX_WORKERS};

/// Types of the crates this API speaks, re-exported so callers need not depend on them.
pub use nibble_discovery::{Capacity, Role, WorkerEvent, WorkerId, WorkerInfo};
pub use nibble_kvcache::hash::{hash_block, hash_blocks};
pub use nibble_kvcache::{BlockHash, KvEvent, KvEventData, KvSnapshot};
