//! A change waits for its acknowledgement: resolved by an ack, by the worker leaving, or by
//! the timeout.

use std::time::Duration;

use super::*;
use crate::Resolution;

/// A planner without cooldown that has just proposed decision 1, moving decode-0 to prefill.
fn proposed(clock: &Clock) -> (Planner, Vec<WorkerLoad>) {
    let workers = cluster(1, 3);
    let config = PlannerConfig {
        min_change_interval: Duration::ZERO,
        ..impatient()
    };
    let mut planner = Planner::new(config, 1);
    let proposal = change(planner.decide(clock.at(0), &workers, &prefill_starved()));
    assert_eq!(
        (proposal.id, proposal.changes[0].worker.as_str()),
        (1, "decode-0")
    );
    (planner, workers)
}

#[test]
fn nothing_is_proposed_while_a_decision_is_unacknowledged() {
    let clock = Clock::new();
    let (mut planner, workers) = proposed(&clock);
    let pending = planner.pending().expect("pending");
    assert_eq!(pending.decision(), 1);
    assert_eq!(pending.awaiting().collect::<Vec<_>>(), ["decode-0"]);
    assert_eq!(pending.proposed_at(), clock.at(0));
    assert_eq!(pending.deadline(), clock.at(60));
    let why = hold(planner.decide(clock.at(10), &workers, &prefill_starved()));
    assert_eq!(
        why,
        "TTFT p90 3.1 s > SLO 2.0 s while ITL p90 41 ms < 80 ms; \
         waiting for acknowledgement of decision 1 from decode-0 (50 s left)"
    );
    assert_eq!(planner.resolved(), None);
}

#[test]
fn an_acknowledgement_resolves_the_decision_on_the_next_decide() {
    let clock = Clock::new();
    let (mut planner, mut workers) = proposed(&clock);
    // Late, repeated or foreign acknowledgements do not count.
    assert!(!planner.acknowledged("decode-0", 0));
    assert!(!planner.acknowledged("decode-1", 1));
    assert!(planner.acknowledged("decode-0", 1));
    assert!(!planner.acknowledged("decode-0", 1));
    workers[1].role = Role::Prefill;
    let proposal = change(planner.decide(clock.at(10), &workers, &prefill_starved()));
    assert_eq!(
        planner.resolved(),
        Some(&Resolved {
            decision: 1,
            resolution: Resolution::Acknowledged { gone: vec![] }
        })
    );
    assert_eq!(
        (proposal.id, proposal.changes[0].worker.as_str()),
        (2, "decode-1")
    );
    assert_eq!(planner.pending().map(Pending::decision), Some(2));
    // The resolution is reported once.
    hold(planner.decide(clock.at(20), &workers, &prefill_starved()));
    assert_eq!(planner.resolved(), None);
}

#[test]
fn a_worker_that_vanished_mid_flip_does_not_leave_the_decision_stuck() {
    let clock = Clock::new();
    let (mut planner, workers) = proposed(&clock);
    assert!(!planner.worker_gone("decode-2"));
    assert!(planner.worker_gone("decode-0"));
    let remaining: Vec<WorkerLoad> = workers.into_iter().filter(|w| w.id != "decode-0").collect();
    let proposal = change(planner.decide(clock.at(10), &remaining, &prefill_starved()));
    assert_eq!(
        planner.resolved(),
        Some(&Resolved {
            decision: 1,
            resolution: Resolution::Acknowledged {
                gone: vec!["decode-0".into()]
            }
        })
    );
    assert_eq!(proposal.changes[0].worker, "decode-1");
    assert!(!proposal.roles.contains_key("decode-0"));
}

#[test]
fn the_ack_timeout_ends_the_wait_naming_who_never_answered() {
    let clock = Clock::new();
    let (mut planner, workers) = proposed(&clock);
    let calm = ratios(Some(0.5), Some(0.5));
    hold(planner.decide(clock.at(59), &workers, &calm));
    assert_eq!(planner.resolved(), None);
    assert!(planner.pending().is_some());
    let why = hold(planner.decide(clock.at(60), &workers, &calm));
    assert_eq!(
        why,
        "within SLOs: TTFT p90 1.0 s ≤ 2.0 s, ITL p90 50 ms ≤ 100 ms"
    );
    let resolved = planner.resolved().expect("resolved");
    assert_eq!(
        resolved.resolution,
        Resolution::TimedOut {
            after: Duration::from_secs(60),
            missing: vec!["decode-0".into()]
        }
    );
    assert_eq!(
        resolved.resolution.to_string(),
        "timed out after 60 s: decode-0 never answered"
    );
    assert_eq!(planner.pending(), None);
    // An answer after the timeout counts for nothing.
    assert!(!planner.acknowledged("decode-0", 1));
}
