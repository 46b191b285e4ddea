//! The planner's policy: how many workers prefill and how many decode.
//!
//! One planner per cluster is elected leader; every `--interval` (10 s) it reads the workers'
//! loads ([`WorkerLoad`]) and the cluster's latency histograms over the window since its last
//! decision ([`Latency`]), and [`Planner::decide`] either holds, with a one-sentence reason, or
//! proposes moving **one** worker to the other role ([`Outcome::Change`]). This crate is the
//! decision alone: no I/O, no clock (the caller passes `now`), no election. The caller writes the
//! [`Decision`] to `planner/decision`, workers flip and answer with an [`Ack`] under
//! `planner/applied/{worker}`, and the caller feeds those back
//! ([`Planner::acknowledged`], [`Planner::worker_gone`]). Key names and JSON formats are in
//! [`wire`].
//!
//! **The rule.** Each latency is compared with its target at the 90th percentile:
//! `ttft_ratio = TTFT p90 / --slo-ttft`, `itl_ratio = ITL p90 / --slo-itl`. When time to first
//! token is over its target (ratio > 1) while inter-token latency has room (ratio below
//! `1 − --hysteresis`, 0.8 by default), a decode worker becomes a prefill worker: the one with
//! the fewest running and waiting requests, then the fewest KV pages in use, then the lowest id.
//! The mirror case moves the prefill worker with the fewest queued prompt tokens (then the lowest
//! id) to decode. Both over target, or neither: no flip; a flip would only move the problem. A
//! window without observations of a latency gives no ratio, and no change is made on it.
//!
//! **What keeps it calm.** The hysteresis margin means a role gives a worker away only while it
//! is comfortably within target, so latencies sitting near the SLOs do not move workers back and
//! forth. A violation must be seen on `--patience` (2) consecutive decisions. After a change the
//! planner proposes nothing until every changed worker has acknowledged it or its registration
//! is gone, or `--ack-timeout` (60 s) passes (the history then names who never answered), and
//! nothing within `--min-change-interval` (60 s) of the last change. Draining workers (leaving
//! their role now) are neither counted nor chosen. A role never drops below `--min-prefill` (0:
//! with no prefill worker, decode workers prefill their own prompts) or `--min-decode` (1).
//!
//! **Desired counts.** Every decision also computes [`Desired`], the worker counts the cluster
//! should have, for an autoscaler that adds or removes pods (`planner/desired`): one more worker
//! of the role with the larger ratio when both are over target, or of a role over target that no
//! flip can relieve (the other role has no room or no worker to spare); one fewer, of the role
//! with the smaller ratio, when both ratios are below `(1 − hysteresis) / 2` and the cluster is
//! above its minimums; otherwise the counts after the proposed flip. Draining workers count at
//! the role they are going to; counts never go below the minimums.

mod acks;
mod config;
mod histogram;
mod history;
mod policy;
mod proposal;
mod role;
mod signals;
pub mod wire;

pub use acks::{Pending, Resolution, Resolved};
pub use config::{ConfigError, PlannerConfig};
pub use histogram::{Histogram, HistogramError};
pub use history::{History, HistoryEntry};
pub use policy::{Outcome, Planner};
pub use proposal::{Change, Desired, Proposal, Reason};
pub use role::{Role, UnknownRole};
pub use signals::{Latency, WorkerLoad, SLO_QUANTILE};
pub use wire::{Ack, Decision, Leader, ParseError};
