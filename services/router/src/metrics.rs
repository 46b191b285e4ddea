//! Names of the router's metrics (Prometheus conventions), declared once so the service that
//! exports them and the dashboards that read them agree.
//!
//! The core records nothing itself: its results ([`Decision`](crate::Decision),
//! [`SyncReport`](crate::SyncReport), [`Router::stats`](crate::Router::stats)) carry what these
//! count, and the service updates them. Labels are bounded: `reason` takes
//! [`Reason::as_str`](crate::Reason::as_str) values, `role` is `prefill` or `decode`.

/// Counter: routing decisions, labelled `reason`.
pub const DECISIONS_TOTAL: &str = "nibble_router_decisions_total";
/// Histogram: time to make one routing decision.
pub const DECISION_DURATION_SECONDS: &str = "nibble_router_decision_duration_seconds";
/// Counter: prompt tokens routed.
pub const PROMPT_TOKENS_TOTAL: &str = "nibble_router_prompt_tokens_total";
/// Counter: prompt tokens the chosen decode worker already cached, per the index.
pub const CACHED_PROMPT_TOKENS_TOTAL: &str = "nibble_router_cached_prompt_tokens_total";
/// Counter: KV events applied to the prefix index, labelled `role`.
pub const KV_EVENTS_APPLIED_TOTAL: &str = "nibble_router_kv_events_applied_total";
/// Counter: gaps in a worker's KV-event ids (each asks for a snapshot), labelled `role`.
pub const KV_EVENT_GAPS_TOTAL: &str = "nibble_router_kv_event_gaps_total";
/// Counter: worker restarts seen on KV-event streams, labelled `role`.
pub const KV_STREAM_RESTARTS_TOTAL: &str = "nibble_router_kv_stream_restarts_total";
/// Gauge: distinct blocks in the prefix index.
pub const INDEX_BLOCKS: &str = "nibble_router_index_blocks";
/// Gauge: workers tracked, labelled `role`.
pub const WORKERS: &str = "nibble_router_workers";
/// Gauge: requests dispatched and not yet finished.
pub const IN_FLIGHT_REQUESTS: &str = "nibble_router_in_flight_requests";
