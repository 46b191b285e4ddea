//! The metrics of a nibble process: one Prometheus recorder for the whole process, the gauges
//! that are sampled when scraped, and the `GET /metrics` endpoint.
//!
//! Services record through the [`metrics`] facade (`metrics::counter!(NAME, "label" =>
//! value)`), with names declared once per crate as constants (`nibble_router::metrics`,
//! `nibble_worker::metrics`). Until [`install`] runs, recording goes nowhere and costs almost
//! nothing, so a library user who wants no metrics does nothing.
//!
//! * [`install`] installs the recorder, once per process; later calls return the same
//!   [`Metrics`]. `nibble up` runs a router and two workers in one process: they share it and
//!   one `/metrics` shows them all, told apart by their `role` labels.
//! * [`register`]: a service's gauges that are cheaper to read than to track (a worker's free
//!   pages, the router's queue) are set by a [`Collect`]or just before each scrape. Collectors
//!   are held weakly: one that is dropped stops being asked.
//! * [`serve`] answers `GET /metrics` on a listener the caller bound; [`spawn`] installs and
//!   serves in the background; [`route`] is the same endpoint for another axum server (the
//!   router's HTTP API port serves it too).
//! * [`scrape`] reads an endpoint back into [`Samples`] (tests and tools).
//!
//! Every histogram is in seconds and has the buckets [`LATENCY_BUCKETS`].
//!
//! Besides the metrics, what every process shares about what it tells its operator:
//! [`listen`] (binding listeners with errors that name the flag), [`logging`] (the log
//! subscriber, text or JSON lines on stderr) and [`progress`] (the
//! terminal's progress bars for the model download and weight loading, drawn only on a
//! terminal with text logs, log lines printed through them).

mod collect;
pub mod listen;
pub mod logging;
pub mod progress;
mod scrape;
mod server;

pub use collect::{register, Collect, CollectFuture};
pub use scrape::{scrape, Sample, Samples};
pub use server::{
    bind, route, serve, spawn, start, start_bound, upkeep, MetricsServer, CONTENT_TYPE,
};

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Bucket bounds of every histogram, in seconds: from 10 µs (a routing decision) to 2 minutes
/// (a long generation).
pub const LATENCY_BUCKETS: [f64; 22] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The process's metrics recorder.
#[derive(Debug)]
pub struct Metrics {
    handle: PrometheusHandle,
    /// Whether this recorder is the process's (false when another was installed first, and
    /// everything recorded goes there instead).
    global: bool,
}

static METRICS: OnceLock<Metrics> = OnceLock::new();

/// Installs the process's recorder (the first call) and returns it.
pub fn install() -> &'static Metrics {
    METRICS.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets(&LATENCY_BUCKETS)
            .expect("the buckets are not empty")
            .build_recorder();
        let handle = recorder.handle();
        let global = metrics::set_global_recorder(recorder).is_ok();
        if !global {
            tracing::warn!("another metrics recorder is installed: /metrics will be empty");
        }
        Metrics { handle, global }
    })
}

/// The recorder, if [`install`] ran.
pub fn installed() -> Option<&'static Metrics> {
    METRICS.get()
}

impl Metrics {
    /// Whether this recorder receives what the process records.
    pub fn is_global(&self) -> bool {
        self.global
    }

    /// The Prometheus text exposition of every metric, after asking every registered
    /// [`Collect`]or to set its gauges.
    pub async fn render(&self) -> String {
        collect::collect_all().await;
        self.handle.run_upkeep();
        self.handle.render()
    }

    /// Drains histogram samples into their buckets (every render does it too); run
    /// periodically so that an unscraped process does not accumulate samples.
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }
}

/// The label value of a gRPC status code (`ok`, `invalid_argument`, `resource_exhausted`, ...):
/// the bounded set of the `code` label.
pub fn code_label(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}
