//! Names of a worker's metrics (Prometheus conventions), declared once, and what records them.
//!
//! Every series carries `role` (`prefill` or `decode`), so the workers that `nibble up` runs in
//! one process stay apart. Counters of calls and transfers are counted where they happen;
//! gauges of the page pool and the engine's queues, and the prefix cache's counters (kept by
//! the engine), are read from the engine when the metrics are scraped ([`WorkerState`]'s
//! [`Collect`] implementation).
//!
//! Labels are bounded: `call` is `reserve`, `prefill`, `decode`, `push_pages`, `nccl_connect` or
//! `nccl_pages`; `code` a gRPC status code's name (`ok` for success); `direction` `sent` or
//! `received`; `backend` `grpc` or `nccl`; `reason` `connect`, `refused` or `transfer` for
//! fallbacks, the failed check for refused pushes.

use std::time::Duration;

use nibble_telemetry::{Collect, CollectFuture};

use crate::service::WorkerState;

/// Counter: calls handled, labelled `role`, `call` and `code` (`ok`, or the error's gRPC code;
/// a decode stream the router dropped counts as `cancelled`).
pub const REQUESTS_TOTAL: &str = "nibble_worker_requests_total";
/// Histogram: time to compute a prompt on a prefill worker (queueing included), to its first
/// token, before its pages are pushed.
pub const PREFILL_DURATION_SECONDS: &str = "nibble_worker_prefill_duration_seconds";
/// Counter: tokens a decode worker generated (the first token of a hand-off included).
pub const GENERATION_TOKENS_TOTAL: &str = "nibble_worker_generation_tokens_total";
/// Counter: KV pages moved between workers, labelled `direction` (`sent` by prefill workers,
/// `received` by decode workers).
pub const KV_TRANSFER_PAGES_TOTAL: &str = "nibble_worker_kv_transfer_pages_total";
/// Counter: KV page bytes (element data and scales) moved, labelled `direction`.
pub const KV_TRANSFER_BYTES_TOTAL: &str = "nibble_worker_kv_transfer_bytes_total";
/// Histogram: duration of one request's page transfer, labelled `direction` (the sender
/// measures connect to acknowledgement; the receiver the stream it read).
pub const KV_TRANSFER_DURATION_SECONDS: &str = "nibble_worker_kv_transfer_duration_seconds";
/// Counter: page transfers (one per request), labelled `direction` and `backend` (`grpc` or
/// `nccl`).
pub const KV_TRANSFERS_TOTAL: &str = "nibble_worker_kv_transfers_total";
/// Counter: transfers that tried NCCL and moved over the gRPC stream instead, labelled `reason`
/// (`connect`: the pair could not be set up; `refused`: the decode worker turned the NCCL
/// request down before anything moved; `transfer`: the link failed mid-way).
pub const KV_TRANSFER_FALLBACKS_TOTAL: &str = "nibble_worker_kv_transfer_fallbacks_total";
/// Counter: page pushes a decode worker refused for what they sent, releasing the reservation,
/// labelled `reason`: `nvfp4_scale`, `fp8_element`, `bf16_element`, `window_value` (a page held
/// a byte no writer produces), `duplicate_page` (a page named twice), `page` (a page of the
/// wrong length or past the sequence) or `invalid` (a page outside the reservation, a message
/// that does not decode, data of the wrong length).
pub const KV_TRANSFERS_REFUSED_TOTAL: &str = "nibble_worker_kv_transfers_refused_total";
/// Gauge: NCCL pairs with a live communicator (both roles).
pub const NCCL_LINKS: &str = "nibble_worker_nccl_links";
/// Counter: NCCL pair set-ups a prefill worker started, labelled `trigger` (`ahead`: a decode
/// worker's registration was seen; `request`: a transfer found its pair down) and `outcome`
/// (`ok` or `failed`). Requests pay the set-up only in `request`'s.
pub const NCCL_CONNECTS_TOTAL: &str = "nibble_worker_nccl_connects_total";
/// Histogram: time to set an NCCL pair up (id, both joins), labelled `trigger` and `outcome`.
pub const NCCL_CONNECT_DURATION_SECONDS: &str = "nibble_worker_nccl_connect_duration_seconds";
/// Gauge: bytes of idle NCCL staging buffers kept for reuse (at most
/// `--nccl-staging-pool-mb`).
pub const NCCL_STAGING_IDLE_BYTES: &str = "nibble_worker_nccl_staging_idle_bytes";
/// Gauge: bytes of NCCL staging buffers in use by transfers now.
pub const NCCL_STAGING_LENT_BYTES: &str = "nibble_worker_nccl_staging_lent_bytes";
/// Counter: NCCL staging buffers allocated (a transfer that reuses one allocates nothing;
/// steady growth means the pool bound is too small for the traffic).
pub const NCCL_STAGING_ALLOCATIONS_TOTAL: &str = "nibble_worker_nccl_staging_allocations_total";
/// Gauge: pages in the KV page pool.
pub const KV_PAGES_TOTAL: &str = "nibble_worker_kv_pages_total";
/// Gauge: pages no request and no cached block holds.
pub const KV_PAGES_FREE: &str = "nibble_worker_kv_pages_free";
/// Gauge: pages held by the prefix cache (evictable when no request holds them).
pub const KV_PAGES_CACHED: &str = "nibble_worker_kv_pages_cached";
/// Gauge: the share of the KV page pool in use, in `[0, 1]`: pages neither free nor held
/// only by the prefix cache (a cached page a request holds is in use), over all pages (vLLM's `vllm:kv_cache_usage_perc`; the router's
/// `nibble_router_kv_cache_usage` sums the same over its workers' load reports).
pub const KV_CACHE_USAGE: &str = "nibble_worker_kv_cache_usage";
/// Gauge: bytes of one KV page.
pub const KV_PAGE_BYTES: &str = "nibble_worker_kv_page_bytes";
/// Gauge: requests the engine is prefilling or decoding.
pub const RUNNING_REQUESTS: &str = "nibble_worker_running_requests";
/// Gauge: requests waiting for the engine to admit them.
pub const WAITING_REQUESTS: &str = "nibble_worker_waiting_requests";
/// Gauge: prompt tokens the engine still has to compute (running prompts' rest, waiting prompts
/// less their cached prefix).
pub const QUEUED_PREFILL_TOKENS: &str = "nibble_worker_queued_prefill_tokens";
/// Gauge: reservations waiting for their pages or their Decode call (decode workers).
pub const PENDING_RESERVATIONS: &str = "nibble_worker_pending_reservations";
/// Counter: prefix-cache lookups (one per admitted request or reservation).
pub const PREFIX_CACHE_LOOKUPS_TOTAL: &str = "nibble_worker_prefix_cache_lookups_total";
/// Counter: prompt tokens looked up in the prefix cache, in whole pages.
pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "nibble_worker_prefix_cache_queries_total";
/// Counter: of those, tokens found cached (hit rate: hits / queries).
pub const PREFIX_CACHE_HITS_TOTAL: &str = "nibble_worker_prefix_cache_hits_total";
/// Counter: cached blocks evicted to make room.
pub const PREFIX_CACHE_EVICTIONS_TOTAL: &str = "nibble_worker_prefix_cache_evictions_total";

/// Which way pages moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Sent,
    Received,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Sent => "sent",
            Direction::Received => "received",
        }
    }
}

/// Describes every metric (their `# HELP` lines) to the installed recorder.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        REQUESTS_TOTAL,
        "Worker calls handled, by call and gRPC code."
    );
    describe_histogram!(
        PREFILL_DURATION_SECONDS,
        Unit::Seconds,
        "Time to compute a prompt to its first token on a prefill worker."
    );
    describe_counter!(
        GENERATION_TOKENS_TOTAL,
        "Tokens generated by a decode worker."
    );
    describe_counter!(KV_TRANSFER_PAGES_TOTAL, "KV pages moved between workers.");
    describe_counter!(
        KV_TRANSFER_BYTES_TOTAL,
        Unit::Bytes,
        "KV page bytes moved between workers."
    );
    describe_histogram!(
        KV_TRANSFER_DURATION_SECONDS,
        Unit::Seconds,
        "Duration of one request's page transfer."
    );
    describe_counter!(KV_TRANSFERS_TOTAL, "Page transfers, by backend.");
    describe_counter!(
        KV_TRANSFER_FALLBACKS_TOTAL,
        "Transfers that fell back from NCCL to the gRPC stream."
    );
    describe_counter!(
        KV_TRANSFERS_REFUSED_TOTAL,
        "Page pushes refused for what they sent (their reservation released), by reason."
    );
    describe_gauge!(NCCL_LINKS, "NCCL pairs with a live communicator.");
    describe_counter!(
        NCCL_CONNECTS_TOTAL,
        "NCCL pair set-ups started, by trigger (ahead of traffic or on a request) and outcome."
    );
    describe_histogram!(
        NCCL_CONNECT_DURATION_SECONDS,
        Unit::Seconds,
        "Time to set an NCCL pair up, by trigger and outcome."
    );
    describe_gauge!(
        NCCL_STAGING_IDLE_BYTES,
        Unit::Bytes,
        "Bytes of idle NCCL staging buffers kept for reuse."
    );
    describe_gauge!(
        NCCL_STAGING_LENT_BYTES,
        Unit::Bytes,
        "Bytes of NCCL staging buffers in use by transfers."
    );
    describe_counter!(
        NCCL_STAGING_ALLOCATIONS_TOTAL,
        "NCCL staging buffers allocated (reuses allocate nothing)."
    );
    describe_gauge!(KV_PAGES_TOTAL, "Pages in the KV page pool.");
    describe_gauge!(
        KV_PAGES_FREE,
        "KV pages no request and no cached block holds."
    );
    describe_gauge!(KV_PAGES_CACHED, "KV pages held by the prefix cache.");
    describe_gauge!(KV_PAGE_BYTES, Unit::Bytes, "Bytes of one KV page.");
    describe_gauge!(
        KV_CACHE_USAGE,
        "Share of the KV page pool in use (0 to 1): neither free nor only cached."
    );
    describe_gauge!(RUNNING_REQUESTS, "Requests the engine is running.");
    describe_gauge!(WAITING_REQUESTS, "Requests waiting for the engine.");
    describe_gauge!(
        QUEUED_PREFILL_TOKENS,
        "Prompt tokens still to compute, less what the prefix cache holds."
    );
    describe_gauge!(
        PENDING_RESERVATIONS,
        "Reservations waiting for pages or Decode."
    );
    describe_counter!(PREFIX_CACHE_LOOKUPS_TOTAL, "Prefix-cache lookups.");
    describe_counter!(
        PREFIX_CACHE_QUERIES_TOTAL,
        "Prompt tokens looked up in the prefix cache."
    );
    describe_counter!(
        PREFIX_CACHE_HITS_TOTAL,
        "Prompt tokens found in the prefix cache."
    );
    describe_counter!(PREFIX_CACHE_EVICTIONS_TOTAL, "Prefix-cache blocks evicted.");
}

/// The `role` label of a worker.
pub(crate) fn role_label(state: &WorkerState) -> &'static str {
    match state.role() {
        nibble_proto::v1::WorkerRole::Prefill => "prefill",
        nibble_proto::v1::WorkerRole::Decode => "decode",
        _ => "router",
    }
}

/// The gauges a worker sets per `role` and `worker` at every scrape.
const ROLE_GAUGES: [&str; 12] = [
    KV_PAGES_TOTAL,
    KV_PAGES_FREE,
    KV_PAGES_CACHED,
    KV_PAGE_BYTES,
    KV_CACHE_USAGE,
    RUNNING_REQUESTS,
    WAITING_REQUESTS,
    QUEUED_PREFILL_TOKENS,
    PENDING_RESERVATIONS,
    NCCL_LINKS,
    NCCL_STAGING_IDLE_BYTES,
    NCCL_STAGING_LENT_BYTES,
];

/// Zeroes `worker`'s gauges labelled with the `role` it has left: a series cannot be removed
/// from the recorder, and left at its last values it would count the worker twice in sums over
/// workers of a role. Its counters stay as they are (rates over them end).
pub(crate) fn leave_role(role: nibble_discovery::Role, worker: &str) {
    let role = match role {
        nibble_discovery::Role::Prefill => "prefill",
        nibble_discovery::Role::Decode => "decode",
        nibble_discovery::Role::Router => "router",
    };
    for name in ROLE_GAUGES {
        metrics::gauge!(name, "role" => role, "worker" => worker.to_string()).set(0.0);
    }
}

/// Counts one call that ended with `code`.
pub(crate) fn call(role: &'static str, call: &'static str, code: tonic::Code) {
    metrics::counter!(
        REQUESTS_TOTAL,
        "role" => role,
        "call" => call,
        "code" => nibble_telemetry::code_label(code)
    )
    .increment(1);
}

/// Records how long one prompt took to prefill.
pub(crate) fn prefill_duration(role: &'static str, took: Duration) {
    metrics::histogram!(PREFILL_DURATION_SECONDS, "role" => role).record(took);
}

/// The counter of tokens a worker generated.
pub(crate) fn generation_tokens(role: &'static str) -> metrics::Counter {
    metrics::counter!(GENERATION_TOKENS_TOTAL, "role" => role)
}

/// Records how long one request's transfer took.
pub(crate) fn transfer_duration(role: &'static str, direction: Direction, took: Duration) {
    let d = direction.as_str();
    metrics::histogram!(KV_TRANSFER_DURATION_SECONDS, "role" => role, "direction" => d)
        .record(took);
}

/// Counts pages moved for one request.
pub(crate) fn transfer(role: &'static str, direction: Direction, pages: u64, bytes: u64) {
    let d = direction.as_str();
    metrics::counter!(KV_TRANSFER_PAGES_TOTAL, "role" => role, "direction" => d).increment(pages);
    metrics::counter!(KV_TRANSFER_BYTES_TOTAL, "role" => role, "direction" => d).increment(bytes);
}

/// Counts one transfer by the backend that moved it.
pub(crate) fn transfer_backend(
    role: &'static str,
    direction: Direction,
    backend: nibble_proto::v1::TransferBackend,
) {
    let backend = match backend {
        nibble_proto::v1::TransferBackend::Nccl => "nccl",
        _ => "grpc",
    };
    metrics::counter!(
        KV_TRANSFERS_TOTAL,
        "role" => role,
        "direction" => direction.as_str(),
        "backend" => backend
    )
    .increment(1);
}

/// Counts and times one NCCL pair set-up (the sender's, so `role` is `prefill`).
pub(crate) fn nccl_connect(trigger: &'static str, ok: bool, took: Duration) {
    let outcome = if ok { "ok" } else { "failed" };
    let labels = [
        ("role", "prefill"),
        ("trigger", trigger),
        ("outcome", outcome),
    ];
    metrics::counter!(NCCL_CONNECTS_TOTAL, &labels).increment(1);
    metrics::histogram!(NCCL_CONNECT_DURATION_SECONDS, &labels).record(took.as_secs_f64());
}

/// Counts one fall back from NCCL to gRPC.
pub(crate) fn fallback(role: &'static str, reason: &'static str) {
    metrics::counter!(KV_TRANSFER_FALLBACKS_TOTAL, "role" => role, "reason" => reason).increment(1);
}

/// Counts one push refused for what it sent.
pub(crate) fn refused(role: &'static str, reason: &'static str) {
    metrics::counter!(KV_TRANSFERS_REFUSED_TOTAL, "role" => role, "reason" => reason).increment(1);
}

impl Collect for WorkerState {
    fn collect(&self) -> CollectFuture<'_> {
        Box::pin(async move {
            // Published, not asked for: a scrape never waits behind a long step.
            let Ok(load) = self.engine().published_load() else {
                return; // the engine stopped: its last values stay
            };
            let role = role_label(self);
            // Several workers may share one process (`nibble up --decode-workers 2`) and so
            // one recorder: each sets its own series.
            let worker = self.identity().worker_id.clone();
            let page_size = self.engine().info().page_size as u64;
            let gauge = |name: &'static str, value: usize| {
                metrics::gauge!(name, "role" => role, "worker" => worker.clone()).set(value as f64);
            };
            gauge(KV_PAGES_TOTAL, load.total_pages);
            gauge(KV_PAGES_FREE, load.free_pages);
            gauge(KV_PAGES_CACHED, load.cached_pages);
            gauge(KV_PAGE_BYTES, self.engine().info().page_bytes);
            let used = load
                .total_pages
                .saturating_sub(load.free_pages + load.evictable_pages);
            let usage = match load.total_pages {
                0 => 0.0,
                total => used as f64 / total as f64,
            };
            metrics::gauge!(KV_CACHE_USAGE, "role" => role, "worker" => worker.clone()).set(usage);
            gauge(RUNNING_REQUESTS, load.running);
            gauge(WAITING_REQUESTS, load.waiting);
            gauge(QUEUED_PREFILL_TOKENS, load.prefill_backlog);
            gauge(PENDING_RESERVATIONS, self.pending_reservations());
            gauge(NCCL_LINKS, self.nccl().map_or(0, |n| n.live_links()));
            let staging = self.nccl().map(|n| n.staging()).unwrap_or_default();
            gauge(NCCL_STAGING_IDLE_BYTES, staging.idle_bytes);
            gauge(NCCL_STAGING_LENT_BYTES, staging.lent_bytes);
            let cache = load.cache;
            let counter = |name: &'static str, value: u64| {
                metrics::counter!(name, "role" => role, "worker" => worker.clone()).absolute(value);
            };
            counter(PREFIX_CACHE_LOOKUPS_TOTAL, cache.queries);
            counter(PREFIX_CACHE_QUERIES_TOTAL, cache.query_blocks * page_size);
            counter(PREFIX_CACHE_HITS_TOTAL, cache.hit_blocks * page_size);
            counter(PREFIX_CACHE_EVICTIONS_TOTAL, cache.evicted_blocks);
            counter(NCCL_STAGING_ALLOCATIONS_TOTAL, staging.allocations);
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_worker_leaving_a_role_zeroes_its_gauges_of_that_role_only() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let gauge = |role: &'static str, worker: &'static str, value: f64| {
                metrics::gauge!(super::RUNNING_REQUESTS, "role" => role, "worker" => worker)
                    .set(value)
            };
            gauge("decode", "w1", 3.0);
            gauge("decode", "w2", 2.0);
            super::leave_role(nibble_discovery::Role::Decode, "w1");
            gauge("prefill", "w1", 1.0);
        });
        let text = handle.render();
        let line = |series: &str| {
            let wanted = format!("{}{{{series}}} ", super::RUNNING_REQUESTS);
            let found = text.lines().find(|l| l.starts_with(&wanted));
            found.map(|l| l[wanted.len()..].to_string())
        };
        assert_eq!(
            line("role=\"decode\",worker=\"w1\"").as_deref(),
            Some("0"),
            "{text}"
        );
        assert_eq!(
            line("role=\"decode\",worker=\"w2\"").as_deref(),
            Some("2"),
            "{text}"
        );
        assert_eq!(
            line("role=\"prefill\",worker=\"w1\"").as_deref(),
            Some("1"),
            "{text}"
        );
    }
}
