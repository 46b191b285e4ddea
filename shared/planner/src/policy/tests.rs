//! The policy's rules, one test each; shared fixtures for `acks` and `desired`.

mod acks;
mod desired;
mod holds;

use std::time::{Duration, Instant};

use super::*;
use crate::Histogram;

const INF: f64 = f64::INFINITY;

/// An idle worker.
pub(super) fn worker(id: &str, role: Role) -> WorkerLoad {
    WorkerLoad {
        id: id.to_string(),
        role,
        queued_prefill_tokens: 0,
        running: 0,
        waiting: 0,
        used_pages: 0,
        total_pages: 1000,
        draining: false,
    }
}

/// `prefill` prefill workers `prefill-0..` and `decode` decode workers `decode-0..`.
pub(super) fn cluster(prefill: usize, decode: usize) -> Vec<WorkerLoad> {
    let p = (0..prefill).map(|i| worker(&format!("prefill-{i}"), Role::Prefill));
    let d = (0..decode).map(|i| worker(&format!("decode-{i}"), Role::Decode));
    p.chain(d).collect()
}

/// A histogram of 10 observations whose p90 is exactly `seconds`.
fn p90_of(seconds: Option<f64>) -> Histogram {
    match seconds {
        Some(v) => Histogram::new(vec![(v, 9), (2.0 * v, 10), (INF, 10)], 9.0 * v, 10).unwrap(),
        None => Histogram::default(),
    }
}

/// A window whose TTFT and ITL p90s are these ratios of the default SLOs (2 s, 100 ms).
pub(super) fn ratios(ttft: Option<f64>, itl: Option<f64>) -> Latency {
    Latency {
        ttft: p90_of(ttft.map(|r| r * 2.0)),
        itl: p90_of(itl.map(|r| r * 0.1)),
    }
}

/// TTFT over its SLO while ITL has room.
pub(super) fn prefill_starved() -> Latency {
    ratios(Some(1.55), Some(0.41))
}

/// ITL over its SLO while TTFT has room.
pub(super) fn decode_starved() -> Latency {
    ratios(Some(0.3), Some(1.5))
}

pub(super) fn impatient() -> PlannerConfig {
    PlannerConfig {
        patience: 1,
        ..PlannerConfig::default()
    }
}

/// Seconds after a fixed start.
pub(super) struct Clock(Instant);

impl Clock {
    pub fn new() -> Self {
        Clock(Instant::now())
    }

    pub fn at(&self, seconds: u64) -> Instant {
        self.0 + Duration::from_secs(seconds)
    }
}

pub(super) fn hold(outcome: Outcome) -> String {
    match outcome {
        Outcome::Hold { why } => why,
        Outcome::Change(p) => panic!("expected a hold, got {p:?}"),
    }
}

pub(super) fn change(outcome: Outcome) -> Proposal {
    match outcome {
        Outcome::Change(p) => p,
        Outcome::Hold { why } => panic!("expected a change, got a hold: {why}"),
    }
}

/// The workers as they are once `proposal` is applied.
pub(super) fn apply(workers: &mut [WorkerLoad], proposal: &Proposal) {
    for w in workers {
        w.role = proposal.roles[&w.id];
    }
}

#[test]
fn ttft_over_slo_moves_the_idlest_decode_worker_to_prefill() {
    let clock = Clock::new();
    let mut workers = cluster(1, 4);
    workers[0].queued_prefill_tokens = 5120;
    let loads = [(3, 0, 90), (1, 0, 50), (0, 1, 10), (1, 0, 10)];
    for (w, (running, waiting, pages)) in workers[1..].iter_mut().zip(loads) {
        (w.running, w.waiting, w.used_pages) = (running, waiting, pages);
    }
    let mut planner = Planner::new(PlannerConfig::default(), 100);

    let why = hold(planner.decide(clock.at(10), &workers, &prefill_starved()));
    assert_eq!(
        why,
        "TTFT p90 3.1 s > SLO 2.0 s while ITL p90 41 ms < 80 ms; patience 1/2"
    );
    let proposal = change(planner.decide(clock.at(20), &workers, &prefill_starved()));
    // decode-1, -2 and -3 each have one request; -2 and -3 the fewest pages; -2 the lower id.
    assert_eq!(proposal.id, 100);
    assert_eq!(
        proposal.changes,
        [Change {
            worker: "decode-2".into(),
            from: Role::Decode,
            to: Role::Prefill
        }]
    );
    let roles: Vec<(&str, Role)> = proposal
        .roles
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(
        roles,
        [
            ("decode-0", Role::Decode),
            ("decode-1", Role::Decode),
            ("decode-2", Role::Prefill),
            ("decode-3", Role::Decode),
            ("prefill-0", Role::Prefill),
        ]
    );
    let r = &proposal.reason;
    assert!((r.ttft_p90_ms - 3100.0).abs() < 1e-6, "{}", r.ttft_p90_ms);
    assert!((r.itl_p90_ms - 41.0).abs() < 1e-6, "{}", r.itl_p90_ms);
    assert_eq!((r.slo_ttft_ms, r.slo_itl_ms), (2000.0, 100.0));
    assert_eq!(r.queued_prefill_tokens, 5120);
    assert_eq!((r.running_decodes, r.waiting_decodes), (5, 1));
    assert_eq!((r.decode_pages_used, r.decode_pages_total), (160, 4000));
    assert_eq!((r.prefill_workers, r.decode_workers), (1, 4));
    assert_eq!(
        r.summary,
        "TTFT p90 3.1 s > SLO 2.0 s while ITL p90 41 ms < 80 ms: decode-2 → prefill \
         (1 prefill, 4 decode workers; 5120 prompt tokens queued)"
    );
    assert_eq!(
        proposal.desired,
        Desired {
            prefill: 2,
            decode: 3
        }
    );
    assert_eq!(planner.desired(), Some(proposal.desired));
    assert_eq!(planner.next_decision_id(), 101);
}

#[test]
fn itl_over_slo_moves_the_least_queued_prefill_worker_to_decode() {
    let clock = Clock::new();
    let mut workers = cluster(3, 1);
    for (w, queued) in workers.iter_mut().zip([500, 100, 100]) {
        w.queued_prefill_tokens = queued;
    }
    let mut planner = Planner::new(impatient(), 1);
    let proposal = change(planner.decide(clock.at(0), &workers, &decode_starved()));
    assert_eq!(
        proposal.changes,
        [Change {
            worker: "prefill-1".into(),
            from: Role::Prefill,
            to: Role::Decode
        }]
    );
    assert_eq!(proposal.roles["prefill-1"], Role::Decode);
    assert_eq!(proposal.roles["prefill-2"], Role::Prefill);
    assert_eq!(
        proposal.reason.summary,
        "ITL p90 150 ms > SLO 100 ms while TTFT p90 600 ms < 1.6 s: prefill-1 → decode \
         (3 prefill, 1 decode workers; 700 prompt tokens queued)"
    );
    assert_eq!(
        proposal.desired,
        Desired {
            prefill: 2,
            decode: 2
        }
    );
}

#[test]
fn a_violation_must_persist_for_patience_consecutive_decisions() {
    let clock = Clock::new();
    let workers = cluster(1, 3);
    let config = PlannerConfig {
        patience: 3,
        ..PlannerConfig::default()
    };
    let mut planner = Planner::new(config, 1);
    let calm = ratios(Some(0.5), Some(0.5));
    let seq = [
        (prefill_starved(), "patience 1/3"),
        (prefill_starved(), "patience 2/3"),
        (calm.clone(), "within SLOs"),
        // The count starts again.
        (prefill_starved(), "patience 1/3"),
        // A violation the other way is another counter.
        (decode_starved(), "patience 1/3"),
        (prefill_starved(), "patience 1/3"),
        (prefill_starved(), "patience 2/3"),
    ];
    for (i, (latency, expected)) in seq.into_iter().enumerate() {
        let why = hold(planner.decide(clock.at(10 * i as u64), &workers, &latency));
        assert!(why.contains(expected), "decision {i}: {why}");
    }
    let proposal = change(planner.decide(clock.at(70), &workers, &prefill_starved()));
    assert_eq!(proposal.changes[0].to, Role::Prefill);
}

#[test]
fn no_change_within_the_cooldown_of_the_last() {
    let clock = Clock::new();
    let mut workers = cluster(1, 4);
    let mut planner = Planner::new(impatient(), 5);
    let first = change(planner.decide(clock.at(0), &workers, &prefill_starved()));
    assert!(planner.acknowledged("decode-0", 5));
    apply(&mut workers, &first);
    for t in [10, 30, 59] {
        let why = hold(planner.decide(clock.at(t), &workers, &prefill_starved()));
        assert_eq!(
            why,
            format!(
                "TTFT p90 3.1 s > SLO 2.0 s while ITL p90 41 ms < 80 ms; \
                 cooling down since decision 5 {t} s ago ({} s left)",
                60 - t
            )
        );
    }
    let second = change(planner.decide(clock.at(60), &workers, &prefill_starved()));
    assert_eq!(second.id, 6);
    assert_eq!(second.changes[0].worker, "decode-1");
}

#[test]
fn hysteresis_keeps_latencies_near_the_slo_from_flipping_back_and_forth() {
    // Ratios that wander around 1: after the first flip neither role is ever comfortably
    // (below 0.8) within its target while the other is over.
    let wander = [
        (0.85, 1.1),
        (1.1, 0.85),
        (0.95, 1.05),
        (1.05, 0.95),
        (0.9, 1.2),
        (1.2, 0.9),
    ];
    let run = |config: PlannerConfig| {
        let clock = Clock::new();
        let mut workers = cluster(2, 3);
        let mut planner = Planner::new(config, 1);
        let mut changes = 0;
        for i in 0..20 {
            let (ttft, itl) = if i < 2 {
                (1.3, 0.5)
            } else {
                wander[i % wander.len()]
            };
            let outcome = planner.decide(
                clock.at(10 * i as u64),
                &workers,
                &ratios(Some(ttft), Some(itl)),
            );
            if let Outcome::Change(p) = outcome {
                changes += 1;
                apply(&mut workers, &p);
                // The worker flips and answers at once: only the policy holds changes back.
                assert!(planner.acknowledged(&p.changes[0].worker, p.id));
            }
        }
        changes
    };
    assert_eq!(run(PlannerConfig::default()), 1);
    // Without hysteresis, patience and cooldown the same latencies flip a worker most decisions.
    let twitchy = PlannerConfig {
        hysteresis: 0.0,
        patience: 1,
        min_change_interval: Duration::ZERO,
        ..PlannerConfig::default()
    };
    assert!(run(twitchy) >= 10);
}

#[test]
fn no_role_is_taken_below_its_minimum() {
    let clock = Clock::new();
    let mut planner = Planner::new(impatient(), 1);
    let why = hold(planner.decide(clock.at(0), &cluster(2, 1), &prefill_starved()));
    assert_eq!(
        why,
        "TTFT p90 3.1 s > SLO 2.0 s while ITL p90 41 ms < 80 ms; \
         no decode worker to spare (1 not draining, --min-decode 1)"
    );
    let config = PlannerConfig {
        min_prefill: 1,
        ..impatient()
    };
    let mut planner = Planner::new(config, 1);
    let why = hold(planner.decide(clock.at(0), &cluster(1, 2), &decode_starved()));
    assert!(
        why.ends_with("no prefill worker to spare (1 not draining, --min-prefill 1)"),
        "{why}"
    );
    // The default minimum of prefill workers is 0: the last one may go.
    let mut planner = Planner::new(impatient(), 1);
    let proposal = change(planner.decide(clock.at(0), &cluster(1, 2), &decode_starved()));
    assert_eq!(proposal.changes[0].worker, "prefill-0");
    assert_eq!(
        proposal.desired,
        Desired {
            prefill: 0,
            decode: 3
        }
    );
}

#[test]
fn draining_workers_are_neither_counted_nor_chosen() {
    let clock = Clock::new();
    let mut workers = cluster(1, 3);
    // decode-0 is the idlest but already on its way to prefill.
    workers[1].draining = true;
    workers[2].running = 5;
    workers[3].running = 2;
    let mut planner = Planner::new(impatient(), 1);
    let proposal = change(planner.decide(clock.at(0), &workers, &prefill_starved()));
    assert_eq!(proposal.changes[0].worker, "decode-2");
    assert_eq!(proposal.reason.decode_workers, 2);
    // Its entry says where it is going, so the decision does not send it back.
    assert_eq!(proposal.roles["decode-0"], Role::Prefill);
    assert_eq!(proposal.roles["decode-2"], Role::Prefill);
    assert_eq!(
        proposal.desired,
        Desired {
            prefill: 3,
            decode: 1
        }
    );

    // With decode-0 draining only one decode worker is left to count: none to spare.
    let mut planner = Planner::new(impatient(), 1);
    let why = hold(planner.decide(clock.at(0), &workers[..3], &prefill_starved()));
    assert!(
        why.ends_with("no decode worker to spare (1 not draining, --min-decode 1)"),
        "{why}"
    );
}
