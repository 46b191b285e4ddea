//! The desired counts, computed on every decision.

use super::*;

fn desired_after(config: PlannerConfig, workers: &[WorkerLoad], latency: &Latency) -> Desired {
    let mut planner = Planner::new(config, 1);
    assert_eq!(planner.desired(), None);
    planner.decide(Clock::new().at(0), workers, latency);
    planner.desired().expect("computed by decide")
}

fn counts(prefill: usize, decode: usize) -> Desired {
    Desired { prefill, decode }
}

#[test]
fn both_over_slo_asks_for_one_more_of_the_worse_role() {
    let config = PlannerConfig::default();
    let workers = cluster(1, 2);
    let ttft_worse = ratios(Some(1.5), Some(1.2));
    assert_eq!(
        desired_after(config.clone(), &workers, &ttft_worse),
        counts(2, 2)
    );
    let itl_worse = ratios(Some(1.1), Some(1.6));
    assert_eq!(desired_after(config, &workers, &itl_worse), counts(1, 3));
}

#[test]
fn a_violation_no_flip_can_relieve_asks_for_more() {
    // No decode worker to spare (the minimum is 1): one more prefill worker wanted.
    assert_eq!(
        desired_after(impatient(), &cluster(2, 1), &prefill_starved()),
        counts(3, 1)
    );
    // ITL over but TTFT has no room to give a prefill worker away: one more decode worker.
    assert_eq!(
        desired_after(impatient(), &cluster(2, 2), &ratios(Some(0.9), Some(1.3))),
        counts(2, 3)
    );
    // A flip that is only waiting for patience is still coming: the counts stay.
    assert_eq!(
        desired_after(PlannerConfig::default(), &cluster(2, 2), &prefill_starved()),
        counts(2, 2)
    );
}

#[test]
fn an_idle_cluster_asks_for_one_fewer_never_below_the_minimums() {
    // Both ratios below (1 - 0.2) / 2 = 0.4: prefill has the smaller ratio.
    let idle = ratios(Some(0.2), Some(0.3));
    assert_eq!(
        desired_after(PlannerConfig::default(), &cluster(2, 3), &idle),
        counts(1, 3)
    );
    // Prefill at its minimum: decode gives one instead.
    let config = PlannerConfig {
        min_prefill: 2,
        ..PlannerConfig::default()
    };
    assert_eq!(desired_after(config, &cluster(2, 3), &idle), counts(2, 2));
    // At the minimums already.
    assert_eq!(
        desired_after(PlannerConfig::default(), &cluster(0, 1), &idle),
        counts(0, 1)
    );
    // Not idle enough (0.5 ≥ 0.4): the counts stay.
    let busy = ratios(Some(0.5), Some(0.3));
    assert_eq!(
        desired_after(PlannerConfig::default(), &cluster(2, 3), &busy),
        counts(2, 3)
    );
    // Without both ratios nothing is inferred.
    let unknown = ratios(Some(0.2), None);
    assert_eq!(
        desired_after(PlannerConfig::default(), &cluster(2, 3), &unknown),
        counts(2, 3)
    );
}

#[test]
fn draining_workers_count_where_they_go_and_minimums_are_floors() {
    let mut workers = cluster(1, 2);
    workers[1].draining = true;
    let calm = ratios(Some(0.6), Some(0.6));
    assert_eq!(
        desired_after(PlannerConfig::default(), &workers, &calm),
        counts(2, 1)
    );
    // A cluster short of its minimums asks for them.
    let config = PlannerConfig {
        min_prefill: 1,
        min_decode: 2,
        ..PlannerConfig::default()
    };
    assert_eq!(
        desired_after(config, &[], &ratios(None, None)),
        counts(1, 2)
    );
}
