//! Names of the router's metrics (Prometheus conventions), declared once so the service that
//! exports them and the dashboards that read them agree, and the helpers that record them.
//!
//! The core records nothing itself: its results ([`Decision`](crate::Decision),
//! [`SyncReport`](crate::SyncReport), [`Router::stats`](crate::Router::stats)) carry what these
//! count, and the service updates them. Gauges (queue, workers, index) are read from the
//! [`Shared`] state when the metrics are scraped. Labels are bounded: `reason` takes
//! [`Reason::as_str`](crate::Reason::as_str) values, `role` is `prefill` or `decode`, `outcome`
//! one of [`Outcome`]'s, `code` a gRPC status code's name, `model_name` the served model's name
//! ([`ServiceConfig::served_model`](crate::ServiceConfig::served_model); one per router), which
//! every per-request series carries, as vLLM's do.

use std::time::Duration;

use nibble_telemetry::{Collect, CollectFuture};

use crate::decision::Reason;
use crate::service::Shared;

/// Counter: generate requests by `outcome` (`finished`, `cancelled` by the client, `failed`
/// after dispatch, `refused` before it) and `code` (the gRPC status code's name; `ok` for
/// finished, `cancelled` for cancelled).
pub const REQUESTS_TOTAL: &str = "nibble_router_requests_total";
/// Counter: HTTP API responses, labelled `route` (the matched route, e.g.
/// `/v1/chat/completions`, or `unmatched`) and `status` (e.g. `200`, `400`, `429`). Requests
/// refused by the HTTP layer itself (a bad body, a wrong key) are counted only here.
pub const HTTP_RESPONSES_TOTAL: &str = "nibble_router_http_responses_total";
/// Histogram: from a request's arrival to its first generated token, queueing included.
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "nibble_router_time_to_first_token_seconds";
/// Histogram: between consecutive generated tokens of one request.
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "nibble_router_inter_token_latency_seconds";
/// Histogram: from a request's arrival to its last chunk, for finished requests.
pub const REQUEST_DURATION_SECONDS: &str = "nibble_router_request_duration_seconds";
/// Histogram: time a request waited for a running place (0 when one was free).
pub const QUEUE_WAIT_SECONDS: &str = "nibble_router_queue_wait_seconds";
/// Histogram: time to validate, tokenize (or render the chat template) and hash a prompt.
pub const PREPROCESS_DURATION_SECONDS: &str = "nibble_router_preprocess_duration_seconds";
/// Counter: generated tokens streamed to clients.
pub const GENERATION_TOKENS_TOTAL: &str = "nibble_router_generation_tokens_total";
/// Gauge: requests waiting in the admission queue.
pub const QUEUED_REQUESTS: &str = "nibble_router_queued_requests";
/// Gauge: requests holding a running place (dispatched, or about to be).
pub const RUNNING_REQUESTS: &str = "nibble_router_running_requests";
/// Counter: prefill calls retried on another prefill worker after a failure.
pub const PREFILL_RETRIES_TOTAL: &str = "nibble_router_prefill_retries_total";
/// Counter: requests moved to another decode worker because theirs could not be reached.
pub const DECODE_RETRIES_TOTAL: &str = "nibble_router_decode_retries_total";
/// Counter: prompts prefilled on their decode worker because no prefill worker could take them.
pub const LOCAL_PREFILL_FALLBACKS_TOTAL: &str = "nibble_router_local_prefill_fallbacks_total";
/// Counter: requests whose decode worker failed mid-stream, labelled `outcome`
/// ([`Resume::as_str`]): each resumption on another decode worker (`started`), a resumed request
/// that then finished (`completed`) or failed (`failed`), and a broken stream not resumed because
/// the request had used its `--max-resumes` (`exhausted`).
pub const RESUMES_TOTAL: &str = "nibble_router_resumes_total";
/// Gauge: workers marked unreachable (left out of placement until they answer again).
pub const UNREACHABLE_WORKERS: &str = "nibble_router_unreachable_workers";
/// Counter: routing decisions, labelled `reason`.
pub const DECISIONS_TOTAL: &str = "nibble_router_decisions_total";
/// Counter: HTTP connections the router closed or turned away for a limit, labelled `reason`
/// ([`ConnectionClosed::as_str`]): `refused` (the cap was reached and every connection under it
/// was serving a request), `evicted` (closed, idle or unfinished, to make room for a new one),
/// `header_timeout`, `body_timeout` and `idle_timeout`.
pub const HTTP_CONNECTIONS_CLOSED_TOTAL: &str = "nibble_router_http_connections_closed_total";
/// Histogram: time to make one routing decision (the router's own overhead per request).
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
/// Gauge: the share of the workers' KV pages in use, in `[0, 1]`, from their load reports:
/// 1 - (free + evictable) / total over the reachable workers of each `role` (vLLM's
/// `vllm:kv_cache_usage_perc`). Labelled `role` and `model_name`.
pub const KV_CACHE_USAGE: &str = "nibble_router_kv_cache_usage";
/// Gauge: tokens of KV the reachable workers of each `role` hold in all (their pages, from
/// their load reports, times the page size), labelled `role` and `model_name`.
pub const KV_CAPACITY_TOKENS: &str = "nibble_router_kv_capacity_tokens";

/// The label every per-request series carries: the served model's name.
pub const MODEL_NAME: &str = "model_name";

/// How a generate request ended (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It streamed to its end.
    Finished,
    /// The client went away first.
    Cancelled,
    /// It failed after it was dispatched to workers.
    Failed,
    /// It was refused before dispatch: invalid, over capacity, or no worker to take it.
    Refused,
}

/// What happened to a request whose decode stream broke (the `outcome` label of
/// [`RESUMES_TOTAL`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// It was resumed on another decode worker.
    Started,
    /// A resumed request streamed to its end.
    Completed,
    /// A resumed request failed after all (its new worker refused it, none was left).
    Failed,
    /// It had been resumed `--max-resumes` times: its stream ended with an error.
    Exhausted,
}

impl Resume {
    pub const ALL: [Resume; 4] = [
        Resume::Started,
        Resume::Completed,
        Resume::Failed,
        Resume::Exhausted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Resume::Started => "started",
            Resume::Completed => "completed",
            Resume::Failed => "failed",
            Resume::Exhausted => "exhausted",
        }
    }
}

/// Counts one resumption event of `outcome`.
pub(crate) fn resume(outcome: Resume) {
    metrics::counter!(RESUMES_TOTAL, "outcome" => outcome.as_str()).increment(1);
}

/// Why the HTTP API closed (or refused) a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionClosed {
    Refused,
    Evicted,
    HeaderTimeout,
    BodyTimeout,
    IdleTimeout,
}

impl ConnectionClosed {
    pub const ALL: [ConnectionClosed; 5] = [
        ConnectionClosed::Refused,
        ConnectionClosed::Evicted,
        ConnectionClosed::HeaderTimeout,
        ConnectionClosed::BodyTimeout,
        ConnectionClosed::IdleTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ConnectionClosed::Refused => "refused",
            ConnectionClosed::Evicted => "evicted",
            ConnectionClosed::HeaderTimeout => "header_timeout",
            ConnectionClosed::BodyTimeout => "body_timeout",
            ConnectionClosed::IdleTimeout => "idle_timeout",
        }
    }
}

/// Counts one HTTP connection closed (or refused) for `why`.
pub(crate) fn connection_closed(why: ConnectionClosed) {
    metrics::counter!(HTTP_CONNECTIONS_CLOSED_TOTAL, "reason" => why.as_str()).increment(1);
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Finished => "finished",
            Outcome::Cancelled => "cancelled",
            Outcome::Failed => "failed",
            Outcome::Refused => "refused",
        }
    }
}

/// Describes every metric (their `# HELP` lines) to the installed recorder, and starts the
/// series whose labels are known at zero (those of `model`, the served model's name).
pub fn describe(model: &str) {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        REQUESTS_TOTAL,
        "Generate requests by outcome and gRPC code."
    );
    describe_counter!(
        HTTP_RESPONSES_TOTAL,
        "HTTP API responses by route and status."
    );
    describe_histogram!(
        TIME_TO_FIRST_TOKEN_SECONDS,
        Unit::Seconds,
        "Time from a request's arrival to its first token."
    );
    describe_histogram!(
        INTER_TOKEN_LATENCY_SECONDS,
        Unit::Seconds,
        "Time between consecutive tokens of a request."
    );
    describe_histogram!(
        REQUEST_DURATION_SECONDS,
        Unit::Seconds,
        "Time from a request's arrival to its end, for finished requests."
    );
    describe_histogram!(
        QUEUE_WAIT_SECONDS,
        Unit::Seconds,
        "Time a request waited for a running place."
    );
    describe_histogram!(
        PREPROCESS_DURATION_SECONDS,
        Unit::Seconds,
        "Time to validate, tokenize and hash a prompt."
    );
    describe_counter!(
        GENERATION_TOKENS_TOTAL,
        "Generated tokens streamed to clients."
    );
    describe_gauge!(QUEUED_REQUESTS, "Requests waiting in the admission queue.");
    describe_gauge!(RUNNING_REQUESTS, "Requests holding a running place.");
    describe_counter!(
        PREFILL_RETRIES_TOTAL,
        "Prefill calls retried on another worker."
    );
    describe_gauge!(
        UNREACHABLE_WORKERS,
        "Workers marked unreachable, left out of placement until they answer again."
    );
    describe_counter!(
        DECODE_RETRIES_TOTAL,
        "Requests moved to another decode worker because theirs could not be reached."
    );
    describe_counter!(
        LOCAL_PREFILL_FALLBACKS_TOTAL,
        "Prompts prefilled on their decode worker because no prefill worker could take them."
    );
    describe_counter!(
        RESUMES_TOTAL,
        "Requests whose decode worker failed mid-stream, by what became of them."
    );
    describe_counter!(
        HTTP_CONNECTIONS_CLOSED_TOTAL,
        "HTTP connections closed or refused for a limit, by reason."
    );
    for why in ConnectionClosed::ALL {
        metrics::counter!(HTTP_CONNECTIONS_CLOSED_TOTAL, "reason" => why.as_str()).absolute(0);
    }
    describe_counter!(DECISIONS_TOTAL, "Routing decisions by reason.");
    describe_histogram!(
        DECISION_DURATION_SECONDS,
        Unit::Seconds,
        "Time to make one routing decision."
    );
    describe_counter!(PROMPT_TOKENS_TOTAL, "Prompt tokens routed.");
    describe_counter!(
        CACHED_PROMPT_TOKENS_TOTAL,
        "Prompt tokens the chosen decode worker cached, per the index."
    );
    describe_counter!(
        KV_EVENTS_APPLIED_TOTAL,
        "KV events applied to the prefix index."
    );
    describe_counter!(KV_EVENT_GAPS_TOTAL, "Gaps in workers' KV-event ids.");
    describe_counter!(
        KV_STREAM_RESTARTS_TOTAL,
        "Worker restarts seen on KV-event streams."
    );
    describe_gauge!(INDEX_BLOCKS, "Distinct blocks in the prefix index.");
    describe_gauge!(WORKERS, "Workers tracked.");
    describe_gauge!(
        IN_FLIGHT_REQUESTS,
        "Requests dispatched and not yet finished."
    );
    describe_gauge!(
        KV_CACHE_USAGE,
        "Share of the workers' KV pages in use (0 to 1), by role, from their load reports."
    );
    describe_gauge!(
        KV_CAPACITY_TOKENS,
        "Tokens of KV the reachable workers hold in all, by role, from their load reports."
    );
    for reason in Reason::ALL {
        metrics::counter!(DECISIONS_TOTAL, "reason" => reason.as_str()).absolute(0);
    }
    for outcome in Resume::ALL {
        metrics::counter!(RESUMES_TOTAL, "outcome" => outcome.as_str()).absolute(0);
    }
    for (outcome, code) in [
        (Outcome::Finished, tonic::Code::Ok),
        (Outcome::Cancelled, tonic::Code::Cancelled),
    ] {
        metrics::counter!(REQUESTS_TOTAL, MODEL_NAME => model.to_string(),
            "outcome" => outcome.as_str(), "code" => nibble_telemetry::code_label(code))
        .absolute(0);
    }
}

/// Counts a request for `model` that ended with `outcome` and `code`.
pub(crate) fn request(model: &str, outcome: Outcome, code: tonic::Code) {
    metrics::counter!(
        REQUESTS_TOTAL,
        MODEL_NAME => model.to_string(),
        "outcome" => outcome.as_str(),
        "code" => nibble_telemetry::code_label(code)
    )
    .increment(1);
}

/// Adds `n` to the counter `name` of `model`'s requests.
pub(crate) fn model_count(name: &'static str, model: &str, n: u64) {
    metrics::counter!(name, MODEL_NAME => model.to_string()).increment(n);
}

/// Records a duration of one of `model`'s requests in the histogram `name`.
pub(crate) fn model_duration(name: &'static str, model: &str, took: Duration) {
    metrics::histogram!(name, MODEL_NAME => model.to_string()).record(took);
}

/// Counts one HTTP response.
pub(crate) fn http_response(route: String, status: axum::http::StatusCode) {
    metrics::counter!(HTTP_RESPONSES_TOTAL, "route" => route, "status" => status.as_str().to_string())
        .increment(1);
}

/// Records one routing decision for a request of `model` and how long it took.
pub(crate) fn decision(
    model: &str,
    reason: Reason,
    took: Duration,
    prompt_tokens: usize,
    cached: usize,
) {
    metrics::counter!(DECISIONS_TOTAL, "reason" => reason.as_str()).increment(1);
    metrics::histogram!(DECISION_DURATION_SECONDS).record(took);
    model_count(PROMPT_TOKENS_TOTAL, model, prompt_tokens as u64);
    model_count(CACHED_PROMPT_TOKENS_TOTAL, model, cached as u64);
}

/// Adds `n` to the unlabelled counter `name`.
pub(crate) fn count(name: &'static str, n: u64) {
    metrics::counter!(name).increment(n);
}

/// Counts what one KV-event batch or snapshot did to the index.
pub(crate) fn kv_sync(role: nibble_discovery::Role, report: &crate::SyncReport) {
    let role = role_label(role);
    if report.applied > 0 {
        metrics::counter!(KV_EVENTS_APPLIED_TOTAL, "role" => role).increment(report.applied as u64);
    }
    if report.restarted {
        metrics::counter!(KV_STREAM_RESTARTS_TOTAL, "role" => role).increment(1);
    }
    if matches!(report.status, crate::SyncStatus::SnapshotNeeded(_)) {
        metrics::counter!(KV_EVENT_GAPS_TOTAL, "role" => role).increment(1);
    }
}

fn role_label(role: nibble_discovery::Role) -> &'static str {
    match role {
        nibble_discovery::Role::Prefill => "prefill",
        nibble_discovery::Role::Decode => "decode",
        nibble_discovery::Role::Router => "router",
    }
}

impl Collect for Shared {
    fn collect(&self) -> CollectFuture<'_> {
        Box::pin(async move {
            let admission = self.admission();
            metrics::gauge!(QUEUED_REQUESTS).set(admission.waiting() as f64);
            metrics::gauge!(RUNNING_REQUESTS).set(admission.running() as f64);
            let stats = self.router().stats();
            metrics::gauge!(WORKERS, "role" => "prefill").set(stats.prefill_workers as f64);
            metrics::gauge!(WORKERS, "role" => "decode").set(stats.decode_workers as f64);
            metrics::gauge!(INDEX_BLOCKS).set(stats.index_blocks as f64);
            metrics::gauge!(IN_FLIGHT_REQUESTS).set(stats.in_flight as f64);
            metrics::gauge!(UNREACHABLE_WORKERS).set(stats.unreachable_workers as f64);
            let model = self.config().served_model().to_string();
            for role in [
                nibble_discovery::Role::Prefill,
                nibble_discovery::Role::Decode,
            ] {
                let router = self.router();
                let (usage, (_, pages)) = (router.kv_cache_usage(role), router.kv_pages(role));
                let tokens = pages * u64::from(router.config().page_size);
                drop(router);
                metrics::gauge!(KV_CACHE_USAGE, "role" => role_label(role),
                    MODEL_NAME => model.clone())
                .set(usage);
                metrics::gauge!(KV_CAPACITY_TOKENS, "role" => role_label(role),
                    MODEL_NAME => model.clone())
                .set(tokens as f64);
            }
        })
    }
}
