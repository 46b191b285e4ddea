//! What a decision says: the [`Proposal`] of a change, its [`Reason`] (the numbers it was made
//! on) and the [`Desired`] worker counts; and [`Tally`], the cluster's load summed from the
//! workers' reports.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Role, WorkerLoad};

/// A change the planner proposes: the desired role of every known worker, of which `changes`
/// differ from the role they serve now.
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    /// The decision's id: monotonic, from the `next_decision_id` the planner started with.
    pub id: u64,
    /// The desired role of every worker the decision was made on (draining workers at the role
    /// they are going to).
    pub roles: BTreeMap<String, Role>,
    /// The workers whose role changes (one at a time today).
    pub changes: Vec<Change>,
    /// Why, with the numbers.
    pub reason: Reason,
    /// The worker counts the cluster should have.
    pub desired: Desired,
}

/// One worker moving from one role to the other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub worker: String,
    pub from: Role,
    pub to: Role,
}

/// How many workers of each role the cluster should have, for an autoscaler that adds or
/// removes pods. JSON: `{"prefill": 2, "decode": 4}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Desired {
    pub prefill: usize,
    pub decode: usize,
}

impl Desired {
    /// Both counts together.
    pub fn total(&self) -> usize {
        self.prefill + self.decode
    }

    pub(crate) fn of(&self, role: Role) -> usize {
        match role {
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
        }
    }

    pub(crate) fn slot(&mut self, role: Role) -> &mut usize {
        match role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
        }
    }
}

/// The numbers a decision was made on, as written to `planner/decision` and the history.
/// Worker counts leave draining workers out; load sums include them (their requests are still
/// being served). Fields left out of a stored reason read as zero (a decision written by hand
/// may carry only a `summary`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Reason {
    /// Time to first token over the window, 90th percentile, in milliseconds.
    pub ttft_p90_ms: f64,
    /// Inter-token latency over the window, 90th percentile, in milliseconds.
    pub itl_p90_ms: f64,
    /// `--slo-ttft`, in milliseconds.
    pub slo_ttft_ms: f64,
    /// `--slo-itl`, in milliseconds.
    pub slo_itl_ms: f64,
    /// Prompt tokens queued on prefill workers (on every worker when there is none: decode
    /// workers then prefill their own prompts).
    pub queued_prefill_tokens: u64,
    /// Requests running on decode workers.
    pub running_decodes: u64,
    /// Requests waiting on decode workers.
    pub waiting_decodes: u64,
    /// KV pages in use on decode workers.
    pub decode_pages_used: u64,
    /// KV pages decode workers have.
    pub decode_pages_total: u64,
    /// Prefill workers, before the change.
    pub prefill_workers: usize,
    /// Decode workers, before the change.
    pub decode_workers: usize,
    /// One sentence with the numbers, e.g. `TTFT p90 3.1 s > SLO 2.0 s while ITL p90 41 ms <
    /// 80 ms: decode-2 → prefill (1 prefill, 3 decode workers; 5120 prompt tokens queued)`.
    pub summary: String,
}

/// The cluster's load, summed from the workers' reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Tally {
    /// Workers not draining, by the role they serve now.
    pub counts: Desired,
    pub queued_prefill_tokens: u64,
    pub running_decodes: u64,
    pub waiting_decodes: u64,
    pub decode_pages_used: u64,
    pub decode_pages_total: u64,
}

impl Tally {
    pub fn of(workers: &[WorkerLoad]) -> Self {
        let mut tally = Tally::default();
        let any_prefill = workers.iter().any(|w| w.role == Role::Prefill);
        for w in workers {
            if !w.draining {
                *tally.counts.slot(w.role) += 1;
            }
            if w.role == Role::Prefill || !any_prefill {
                tally.queued_prefill_tokens += w.queued_prefill_tokens;
            }
            if w.role == Role::Decode {
                tally.running_decodes += u64::from(w.running);
                tally.waiting_decodes += u64::from(w.waiting);
                tally.decode_pages_used += w.used_pages;
                tally.decode_pages_total += w.total_pages;
            }
        }
        tally
    }
}

/// A latency for people: `3.1 s` from a second up, `41 ms` below.
pub(crate) fn human(seconds: f64) -> String {
    if seconds >= 1.0 {
        format!("{seconds:.1} s")
    } else {
        format!("{:.0} ms", seconds * 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(id: &str, role: Role, queued: u64, running: u32, draining: bool) -> WorkerLoad {
        WorkerLoad {
            id: id.to_string(),
            role,
            queued_prefill_tokens: queued,
            running,
            waiting: 1,
            used_pages: 10,
            total_pages: 100,
            draining,
        }
    }

    #[test]
    fn tally_counts_serving_workers_and_sums_all_load() {
        let workers = [
            load("p0", Role::Prefill, 300, 0, false),
            load("p1", Role::Prefill, 200, 0, true),
            load("d0", Role::Decode, 50, 4, false),
            load("d1", Role::Decode, 0, 2, false),
        ];
        let tally = Tally::of(&workers);
        assert_eq!(
            tally.counts,
            Desired {
                prefill: 1,
                decode: 2
            }
        );
        // Prefill workers' queues only, the draining one's included.
        assert_eq!(tally.queued_prefill_tokens, 500);
        assert_eq!(tally.running_decodes, 6);
        assert_eq!(tally.waiting_decodes, 2);
        assert_eq!(tally.decode_pages_used, 20);
        assert_eq!(tally.decode_pages_total, 200);
    }

    #[test]
    fn without_prefill_workers_every_queue_counts() {
        let workers = [
            load("d0", Role::Decode, 50, 4, false),
            load("d1", Role::Decode, 70, 2, false),
        ];
        assert_eq!(Tally::of(&workers).queued_prefill_tokens, 120);
    }

    #[test]
    fn latencies_read_in_seconds_or_milliseconds() {
        assert_eq!(human(3.06), "3.1 s");
        assert_eq!(human(2.0), "2.0 s");
        assert_eq!(human(0.0412), "41 ms");
        assert_eq!(human(0.08), "80 ms");
    }
}
