use std::time::Duration;

use super::*;

const INF: f64 = f64::INFINITY;

/// 100 observations: 10 ≤ 100 ms, 20 in (100, 250] ms, 50 in (250, 500] ms, 15 in (0.5, 1] s and
/// 5 above 1 s.
fn sample() -> Histogram {
    Histogram::new(
        vec![(0.1, 10), (0.25, 30), (0.5, 80), (1.0, 95), (INF, 100)],
        40.0,
        100,
    )
    .unwrap()
}

fn seconds(d: Option<Duration>) -> f64 {
    d.expect("a quantile").as_secs_f64()
}

fn assert_close(actual: f64, expected: f64) {
    assert!(
        (actual - expected).abs() < 1e-6,
        "{actual} s, expected {expected} s"
    );
}

#[test]
fn quantiles_interpolate_within_the_bucket() {
    let h = sample();
    // p90: rank 90 falls in (0.5, 1.0], which holds ranks 81..=95: 0.5 + 0.5 × 10/15.
    assert_close(seconds(h.quantile(0.9)), 0.5 + 0.5 * 10.0 / 15.0);
    assert_eq!(h.quantile(0.9).unwrap().as_millis(), 833);
    // p50: rank 50 in (0.25, 0.5], ranks 31..=80: 0.25 + 0.25 × 20/50 = 0.35.
    assert_close(seconds(h.quantile(0.5)), 0.35);
    // p5: rank 5 in the first bucket, whose lower bound is 0: 0.1 × 5/10.
    assert_close(seconds(h.quantile(0.05)), 0.05);
    // Exactly on a bucket's count: its upper bound.
    assert_close(seconds(h.quantile(0.8)), 0.5);
}

#[test]
fn ranks_in_the_inf_bucket_give_the_largest_finite_bound() {
    let h = sample();
    assert_close(seconds(h.quantile(0.99)), 1.0);
    assert_close(seconds(h.quantile(1.0)), 1.0);
    let all_slow = Histogram::new(vec![(0.1, 0), (1.0, 0), (INF, 7)], 70.0, 7).unwrap();
    assert_close(seconds(all_slow.quantile(0.5)), 1.0);
}

#[test]
fn q_zero_is_the_lower_bound_of_the_first_observed_bucket() {
    let h = Histogram::new(vec![(0.1, 0), (0.25, 4), (INF, 4)], 0.8, 4).unwrap();
    assert_close(seconds(h.quantile(0.0)), 0.1);
    // p50: rank 2 of 4 in (0.1, 0.25]: 0.1 + 0.15 × 2/4.
    assert_close(seconds(h.quantile(0.5)), 0.175);
}

#[test]
fn no_observations_or_a_bad_q_give_none() {
    let empty = Histogram::new(vec![(0.1, 0), (INF, 0)], 0.0, 0).unwrap();
    assert_eq!(empty.quantile(0.9), None);
    assert_eq!(Histogram::default().quantile(0.9), None);
    assert_eq!(sample().quantile(1.5), None);
    assert_eq!(sample().quantile(-0.1), None);
    assert_eq!(sample().quantile(f64::NAN), None);
}

#[test]
fn delta_keeps_the_observations_between_two_scrapes() {
    let earlier = Histogram::new(
        vec![(0.1, 4), (0.25, 10), (0.5, 20), (1.0, 30), (INF, 30)],
        9.0,
        30,
    )
    .unwrap();
    let delta = sample().delta(&earlier);
    assert_eq!(
        delta.buckets(),
        &[(0.1, 6), (0.25, 20), (0.5, 60), (1.0, 65), (INF, 70)]
    );
    assert_eq!(delta.count(), 70);
    assert_close(delta.sum(), 31.0);
    // p90 of the window: rank 63 in (0.5, 1.0], which holds ranks 61..=65: 0.5 + 0.5 × 3/5.
    assert_close(seconds(delta.quantile(0.9)), 0.8);
    // Nothing new: an empty window.
    let none = sample().delta(&sample());
    assert_eq!(none.count(), 0);
    assert_eq!(none.quantile(0.9), None);
}

#[test]
fn a_counter_reset_yields_the_later_snapshot_alone() {
    // The process restarted between the scrapes: 3 observations since.
    let later = Histogram::new(vec![(0.1, 1), (0.25, 3), (INF, 3)], 0.4, 3).unwrap();
    let earlier = Histogram::new(vec![(0.1, 10), (0.25, 30), (INF, 50)], 20.0, 50).unwrap();
    assert_eq!(later.delta(&earlier), later);
    // A first scrape (nothing earlier) is its own window as well.
    assert_eq!(sample().delta(&Histogram::default()), sample());
    // Different bounds mean a different series configuration: the later one alone.
    let other_bounds = Histogram::new(vec![(0.2, 1), (INF, 1)], 0.1, 1).unwrap();
    assert_eq!(sample().delta(&other_bounds), sample());
}

#[test]
fn merged_adds_series_with_the_same_bounds() {
    let a = Histogram::new(vec![(0.1, 1), (1.0, 3), (INF, 4)], 5.0, 4).unwrap();
    let b = Histogram::new(vec![(0.1, 2), (1.0, 2), (INF, 2)], 0.1, 2).unwrap();
    let sum = a.merged(&b).unwrap();
    assert_eq!(sum.buckets(), &[(0.1, 3), (1.0, 5), (INF, 6)]);
    assert_eq!(sum.count(), 6);
    assert_close(sum.sum(), 5.1);
    assert_eq!(Histogram::default().merged(&a).unwrap(), a);
    assert_eq!(a.merged(&Histogram::default()).unwrap(), a);
    assert_eq!(a.merged(&sample()), Err(HistogramError::DifferentBounds));
}

#[test]
fn malformed_snapshots_are_refused() {
    assert_eq!(
        Histogram::new(vec![(0.1, 1), (1.0, 2)], 0.0, 2),
        Err(HistogramError::NoInfBucket)
    );
    assert_eq!(
        Histogram::new(vec![], 0.0, 0),
        Err(HistogramError::NoInfBucket)
    );
    assert_eq!(
        Histogram::new(vec![(INF, 2)], 0.0, 2),
        Err(HistogramError::NoFiniteBucket)
    );
    assert_eq!(
        Histogram::new(vec![(1.0, 1), (0.1, 2), (INF, 2)], 0.0, 2),
        Err(HistogramError::Unordered(0.1, 1.0))
    );
    assert_eq!(
        Histogram::new(vec![(0.1, 5), (1.0, 2), (INF, 5)], 0.0, 5),
        Err(HistogramError::Decreasing {
            bound: 1.0,
            count: 2,
            before: 5
        })
    );
    assert_eq!(
        Histogram::new(vec![(-1.0, 0), (INF, 0)], 0.0, 0),
        Err(HistogramError::BadBound(-1.0))
    );
    let mismatch = Histogram::new(vec![(0.1, 1), (INF, 2)], 0.0, 3).unwrap_err();
    assert_eq!(mismatch, HistogramError::CountMismatch { count: 3, inf: 2 });
    assert_eq!(
        mismatch.to_string(),
        "histogram count 3 differs from its +Inf bucket's 2"
    );
}
