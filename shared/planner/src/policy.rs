//! [`Planner`]: the decision itself. Each [`decide`](Planner::decide) reads the window's latency
//! ratios and the workers' loads and either holds (saying why) or proposes moving one worker to
//! the other role; it also computes the [`Desired`] counts every time.
//!
//! State kept between decisions, and nothing else: the next decision id, per direction the
//! number of consecutive decisions that wanted a flip (patience), when the last change was
//! proposed (cooldown), the [`Pending`] decision (acknowledgements), and what the last
//! `decide` computed (desired counts, a resolved decision).

mod rules;

use std::collections::BTreeMap;
use std::time::Instant;

use self::rules::{Assessment, Measure};
use crate::acks::{Pending, Resolution, Resolved};
use crate::proposal::{Change, Desired, Proposal, Reason, Tally};
use crate::{Latency, PlannerConfig, Role, WorkerLoad};

/// What one decision came to.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// No change now; `why` is one short sentence with the numbers.
    Hold { why: String },
    /// Move a worker: write the decision and wait for its acknowledgement.
    Change(Proposal),
}

/// The planner's policy and the little state it keeps between decisions. Deterministic: the
/// same calls with the same arguments give the same outcomes.
#[derive(Debug, Clone)]
pub struct Planner {
    config: PlannerConfig,
    next_id: u64,
    /// Consecutive decisions that wanted a decode worker moved to prefill.
    toward_prefill: u32,
    /// Consecutive decisions that wanted a prefill worker moved to decode.
    toward_decode: u32,
    /// The last change proposed: its id and when.
    last_change: Option<(u64, Instant)>,
    pending: Option<Pending>,
    desired: Option<Desired>,
    resolved: Option<Resolved>,
}

impl Planner {
    /// A planner whose first decision is numbered `next_decision_id` (the id after the one in
    /// `planner/decision`, so ids keep increasing across leaders). `config` should have passed
    /// [`PlannerConfig::validate`].
    pub fn new(config: PlannerConfig, next_decision_id: u64) -> Self {
        Self {
            config,
            next_id: next_decision_id,
            toward_prefill: 0,
            toward_decode: 0,
            last_change: None,
            pending: None,
            desired: None,
            resolved: None,
        }
    }

    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// The id the next proposed change will have.
    pub fn next_decision_id(&self) -> u64 {
        self.next_id
    }

    /// The decision waiting for acknowledgements, if any.
    pub fn pending(&self) -> Option<&Pending> {
        self.pending.as_ref()
    }

    /// The worker counts the last [`decide`](Self::decide) found the cluster should have
    /// (`None` before the first); computed on holds too, so a cluster whose workers are all busy
    /// still says it wants more.
    pub fn desired(&self) -> Option<Desired> {
        self.desired
    }

    /// The decision the last [`decide`](Self::decide) resolved, if it resolved one.
    pub fn resolved(&self) -> Option<&Resolved> {
        self.resolved.as_ref()
    }

    /// Records that `worker` acknowledged `decision` (whether or not it could apply it: it
    /// answered). The pending decision resolves on the next `decide`. False when no pending
    /// decision awaits that worker under that id (a late or repeated acknowledgement).
    pub fn acknowledged(&mut self, worker: &str, decision: u64) -> bool {
        let counted = self
            .pending
            .as_mut()
            .is_some_and(|p| p.acknowledge(worker, decision));
        if !counted {
            tracing::debug!(worker, decision, "acknowledgement of no pending decision");
        }
        counted
    }

    /// Records that `worker`'s registration vanished: the pending decision stops waiting for
    /// it. False when it was not awaited.
    pub fn worker_gone(&mut self, worker: &str) -> bool {
        self.pending.as_mut().is_some_and(|p| p.forget(worker))
    }

    /// One decision at `now`, from every registered worker's load and the latencies over the
    /// window since the previous decision.
    pub fn decide(&mut self, now: Instant, workers: &[WorkerLoad], latency: &Latency) -> Outcome {
        self.resolve_pending(now);
        let ttft = Measure::of(latency.ttft_p90(), self.config.slo_ttft);
        let itl = Measure::of(latency.itl_p90(), self.config.slo_itl);
        let assessment = rules::assess(&self.config, ttft, itl);

        let toward = match &assessment {
            Assessment::Flip { to, .. } => Some(*to),
            _ => None,
        };
        self.toward_prefill = streak(self.toward_prefill, toward == Some(Role::Prefill));
        self.toward_decode = streak(self.toward_decode, toward == Some(Role::Decode));

        let roles = roles_of(workers);
        let (to, violation, ttft_seen, itl_seen) = match assessment {
            Assessment::Steady(why) => return self.hold(ttft, itl, &roles, None, why),
            Assessment::NoRoom { over, why } => {
                return self.hold(ttft, itl, &roles, Some(over), why)
            }
            Assessment::Flip { to, why, ttft, itl } => (to, why, ttft, itl),
        };

        let from = to.other();
        let tally = Tally::of(workers);
        let candidate = (tally.counts.of(from) > self.config.min(from))
            .then(|| pick(workers, from))
            .flatten();
        let gate = self.gate(now, to, candidate.is_some(), &tally);
        if let Some(gate) = gate {
            let stuck = candidate.is_none().then_some(to);
            return self.hold(ttft, itl, &roles, stuck, format!("{violation}; {gate}"));
        }
        let worker = candidate.expect("no gate without a candidate");

        let mut roles = roles;
        roles.insert(worker.id.clone(), to);
        let desired = rules::desired(&self.config, ttft, itl, counts(&roles), None);
        self.desired = Some(desired);
        let id = self.next_id;
        self.next_id += 1;
        self.pending = Some(Pending::new(
            id,
            [worker.id.as_str()],
            now,
            self.config.ack_timeout,
        ));
        self.last_change = Some((id, now));
        self.toward_prefill = 0;
        self.toward_decode = 0;

        let summary = format!(
            "{violation}: {} → {to} ({} prefill, {} decode workers; {} prompt tokens queued)",
            worker.id, tally.counts.prefill, tally.counts.decode, tally.queued_prefill_tokens
        );
        Outcome::Change(Proposal {
            id,
            roles,
            changes: vec![Change {
                worker: worker.id.clone(),
                from,
                to,
            }],
            reason: reason(&tally, ttft_seen, itl_seen, summary),
            desired,
        })
    }

    /// Why a wanted flip to `to` cannot be proposed now, if it cannot: no worker to spare, a
    /// decision pending, the cooldown, or patience.
    fn gate(&self, now: Instant, to: Role, candidate: bool, tally: &Tally) -> Option<String> {
        let from = to.other();
        let seen = match to {
            Role::Prefill => self.toward_prefill,
            Role::Decode => self.toward_decode,
        };
        if !candidate {
            Some(format!(
                "no {from} worker to spare ({} not draining, --min-{from} {})",
                tally.counts.of(from),
                self.config.min(from)
            ))
        } else if let Some(pending) = &self.pending {
            Some(pending.why(now))
        } else if let Some(cooling) = self.cooling(now) {
            Some(cooling)
        } else if seen < self.config.patience {
            Some(format!("patience {seen}/{}", self.config.patience))
        } else {
            None
        }
    }

    /// Ends the pending decision if every changed worker answered or is gone, or its time ran
    /// out.
    fn resolve_pending(&mut self, now: Instant) {
        self.resolved = self.pending.as_ref().and_then(|p| p.resolve(now));
        let Some(resolved) = &self.resolved else {
            return;
        };
        self.pending = None;
        match &resolved.resolution {
            Resolution::TimedOut { missing, .. } => tracing::warn!(
                decision = resolved.decision,
                missing = %missing.join(", "),
                "planner decision {}: {}", resolved.decision, resolved.resolution
            ),
            _ => tracing::info!(
                decision = resolved.decision,
                "planner decision {}: {}",
                resolved.decision,
                resolved.resolution
            ),
        }
    }

    /// A hold, recording the desired counts (`stuck`: a role over its SLO that no flip relieves).
    fn hold(
        &mut self,
        ttft: Option<Measure>,
        itl: Option<Measure>,
        roles: &BTreeMap<String, Role>,
        stuck: Option<Role>,
        why: String,
    ) -> Outcome {
        self.desired = Some(rules::desired(
            &self.config,
            ttft,
            itl,
            counts(roles),
            stuck,
        ));
        Outcome::Hold { why }
    }

    /// The hold reason while the last change is cooling down.
    fn cooling(&self, now: Instant) -> Option<String> {
        let (id, at) = self.last_change?;
        let since = now.saturating_duration_since(at);
        let left = self.config.min_change_interval.checked_sub(since)?;
        (!left.is_zero()).then(|| {
            let left = left.as_secs() + u64::from(left.subsec_nanos() > 0);
            format!(
                "cooling down since decision {id} {} s ago ({left} s left)",
                since.as_secs()
            )
        })
    }
}

/// The numbers of a change.
fn reason(tally: &Tally, ttft: Measure, itl: Measure, summary: String) -> Reason {
    Reason {
        ttft_p90_ms: ttft.p90 * 1e3,
        itl_p90_ms: itl.p90 * 1e3,
        slo_ttft_ms: ttft.slo * 1e3,
        slo_itl_ms: itl.slo * 1e3,
        queued_prefill_tokens: tally.queued_prefill_tokens,
        running_decodes: tally.running_decodes,
        waiting_decodes: tally.waiting_decodes,
        decode_pages_used: tally.decode_pages_used,
        decode_pages_total: tally.decode_pages_total,
        prefill_workers: tally.counts.prefill,
        decode_workers: tally.counts.decode,
        summary,
    }
}

fn streak(count: u32, seen: bool) -> u32 {
    if seen {
        count.saturating_add(1)
    } else {
        0
    }
}

/// The worker of `role` (not draining) that is cheapest to move: for decode, the fewest
/// requests (running and waiting), then the fewest used pages; for prefill, the fewest queued
/// prompt tokens; then the lowest id.
fn pick(workers: &[WorkerLoad], role: Role) -> Option<&WorkerLoad> {
    let serving = workers.iter().filter(|w| w.role == role && !w.draining);
    match role {
        Role::Decode => serving.min_by_key(|w| {
            (
                u64::from(w.running) + u64::from(w.waiting),
                w.used_pages,
                &w.id,
            )
        }),
        Role::Prefill => serving.min_by_key(|w| (w.queued_prefill_tokens, &w.id)),
    }
}

/// Every worker's desired role absent a change: the role it serves, or, while draining, the one
/// it is going to.
fn roles_of(workers: &[WorkerLoad]) -> BTreeMap<String, Role> {
    workers
        .iter()
        .map(|w| {
            let role = if w.draining { w.role.other() } else { w.role };
            (w.id.clone(), role)
        })
        .collect()
}

fn counts(roles: &BTreeMap<String, Role>) -> Desired {
    let mut counts = Desired::default();
    for &role in roles.values() {
        *counts.slot(role) += 1;
    }
    counts
}

#[cfg(test)]
mod tests;
