//! Holds that are about the latencies alone: unknown ratios, both or neither over, no room.

use super::*;

#[test]
fn without_observations_no_change_is_proposed() {
    let clock = Clock::new();
    let workers = cluster(1, 3);
    let mut planner = Planner::new(impatient(), 1);
    let why = hold(planner.decide(clock.at(0), &workers, &ratios(None, None)));
    assert_eq!(why, "no samples: no TTFT or ITL observed in the window");
    let why = hold(planner.decide(clock.at(10), &workers, &ratios(Some(1.55), None)));
    assert_eq!(
        why,
        "no ITL samples in the window (TTFT p90 3.1 s, SLO 2.0 s)"
    );
    let why = hold(planner.decide(clock.at(20), &workers, &ratios(None, Some(1.5))));
    assert_eq!(
        why,
        "no TTFT samples in the window (ITL p90 150 ms, SLO 100 ms)"
    );
}

#[test]
fn both_over_neither_over_or_no_room_hold_with_the_numbers() {
    let clock = Clock::new();
    let workers = cluster(1, 3);
    let mut planner = Planner::new(impatient(), 1);
    let cases = [
        (
            ratios(Some(1.5), Some(1.2)),
            "both over SLO (TTFT p90 3.0 s > 2.0 s, ITL p90 120 ms > 100 ms): no flip helps",
        ),
        (
            ratios(Some(0.6), Some(0.9)),
            "within SLOs: TTFT p90 1.2 s ≤ 2.0 s, ITL p90 90 ms ≤ 100 ms",
        ),
        (
            ratios(Some(1.5), Some(0.9)),
            "TTFT p90 3.0 s > SLO 2.0 s but ITL p90 90 ms ≥ 80 ms leaves decode no room",
        ),
        (
            ratios(Some(0.85), Some(1.2)),
            "ITL p90 120 ms > SLO 100 ms but TTFT p90 1.7 s ≥ 1.6 s leaves prefill no room",
        ),
    ];
    for (i, (latency, expected)) in cases.into_iter().enumerate() {
        assert_eq!(
            hold(planner.decide(clock.at(i as u64), &workers, &latency)),
            expected
        );
    }
}
