//! The planner's metrics (`docs/OPERATIONS.md` lists them).

use nibble_planner::{Desired, Latency};

/// Gauge: 1 while this planner holds the office, else 0.
pub const LEADER: &str = "nibble_planner_leader";
/// Gauge: the worker counts the cluster should have, by `role` (an autoscaler follows it).
pub const DESIRED_WORKERS: &str = "nibble_planner_desired_workers";
/// Counter: decisions by `outcome` (`change`, `hold`).
pub const DECISIONS_TOTAL: &str = "nibble_planner_decisions_total";
/// Gauge: the TTFT p90 of the last decision window, in seconds (absent: no observations).
pub const TTFT_P90_SECONDS: &str = "nibble_planner_ttft_p90_seconds";
/// Gauge: the ITL p90 of the last decision window, in seconds.
pub const ITL_P90_SECONDS: &str = "nibble_planner_itl_p90_seconds";

pub fn describe() {
    use metrics::{describe_counter, describe_gauge, Unit};
    describe_gauge!(LEADER, "1 while this planner leads, else 0.");
    describe_gauge!(
        DESIRED_WORKERS,
        "Worker counts the planner wants the cluster to have, by role."
    );
    describe_counter!(DECISIONS_TOTAL, "Planner decisions by outcome.");
    describe_gauge!(
        TTFT_P90_SECONDS,
        Unit::Seconds,
        "TTFT p90 over the planner's last decision window."
    );
    describe_gauge!(
        ITL_P90_SECONDS,
        Unit::Seconds,
        "ITL p90 over the planner's last decision window."
    );
}

pub fn leading(leading: bool) {
    metrics::gauge!(LEADER).set(f64::from(u8::from(leading)));
}

pub fn desired(desired: Desired) {
    metrics::gauge!(DESIRED_WORKERS, "role" => "prefill").set(desired.prefill as f64);
    metrics::gauge!(DESIRED_WORKERS, "role" => "decode").set(desired.decode as f64);
}

pub fn decision(outcome: &'static str) {
    metrics::counter!(DECISIONS_TOTAL, "outcome" => outcome).increment(1);
}

pub fn latency(window: &Latency) {
    if let Some(p90) = window.ttft_p90() {
        metrics::gauge!(TTFT_P90_SECONDS).set(p90.as_secs_f64());
    }
    if let Some(p90) = window.itl_p90() {
        metrics::gauge!(ITL_P90_SECONDS).set(p90.as_secs_f64());
    }
}
