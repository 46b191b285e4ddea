//! [`Histogram`]: one scrape of a Prometheus cumulative histogram, the observations between two
//! scrapes ([`delta`](Histogram::delta)) and its quantiles, as Prometheus's
//! `histogram_quantile` computes them.
//!
//! Invariants, checked by [`Histogram::new`]: bounds are non-negative seconds in increasing
//! order, at least one is finite and the last is `+Inf`; cumulative counts never decrease; the
//! total count is the `+Inf` bucket's.

use std::time::Duration;

/// A cumulative histogram snapshot: `(upper bound in seconds, observations ≤ bound)` pairs in
/// increasing bound order ending with `+Inf`, the sum of the observations and their count.
/// [`Default`] is the empty histogram: no buckets, no observations.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Histogram {
    buckets: Vec<(f64, u64)>,
    sum: f64,
    count: u64,
}

/// A snapshot that is not a cumulative histogram.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HistogramError {
    #[error("histogram bucket bound {0} is not a non-negative number of seconds")]
    BadBound(f64),
    #[error("histogram bucket bounds are not increasing: {0} after {1}")]
    Unordered(f64, f64),
    #[error("histogram has no +Inf bucket")]
    NoInfBucket,
    #[error("histogram has no finite bucket bound")]
    NoFiniteBucket,
    #[error("histogram bucket le={bound} counts {count}, fewer than the {before} below it")]
    Decreasing { bound: f64, count: u64, before: u64 },
    #[error("histogram count {count} differs from its +Inf bucket's {inf}")]
    CountMismatch { count: u64, inf: u64 },
    #[error("histograms with different bucket bounds cannot be merged")]
    DifferentBounds,
}

impl Histogram {
    /// A snapshot from its buckets (in increasing bound order, as the exposition lists them,
    /// `+Inf` last), sum and count.
    pub fn new(buckets: Vec<(f64, u64)>, sum: f64, count: u64) -> Result<Self, HistogramError> {
        let mut previous: Option<(f64, u64)> = None;
        for &(bound, cumulative) in &buckets {
            if bound.is_nan() || bound < 0.0 {
                return Err(HistogramError::BadBound(bound));
            }
            if let Some((before_bound, before)) = previous {
                if bound <= before_bound {
                    return Err(HistogramError::Unordered(bound, before_bound));
                }
                if cumulative < before {
                    return Err(HistogramError::Decreasing {
                        bound,
                        count: cumulative,
                        before,
                    });
                }
            }
            previous = Some((bound, cumulative));
        }
        let Some(&(last, inf)) = buckets.last() else {
            return Err(HistogramError::NoInfBucket);
        };
        if last != f64::INFINITY {
            return Err(HistogramError::NoInfBucket);
        }
        if buckets.len() < 2 {
            return Err(HistogramError::NoFiniteBucket);
        }
        if count != inf {
            return Err(HistogramError::CountMismatch { count, inf });
        }
        Ok(Self {
            buckets,
            sum,
            count,
        })
    }

    /// The `(bound, cumulative count)` pairs, `+Inf` last; empty for [`Default`].
    pub fn buckets(&self) -> &[(f64, u64)] {
        &self.buckets
    }

    /// The sum of the observations, in seconds.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// How many observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The observations made between `earlier` and this snapshot of the same series. When the
    /// series was reset in between (its process restarted: a count went down, or the bounds
    /// changed), the observations since the reset are this snapshot's own.
    pub fn delta(&self, earlier: &Histogram) -> Histogram {
        let same_bounds = self.buckets.len() == earlier.buckets.len()
            && self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .all(|(a, b)| a.0 == b.0);
        let reset = !same_bounds
            || self.count < earlier.count
            || self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .any(|(a, b)| a.1 < b.1);
        if reset {
            return self.clone();
        }
        Histogram {
            buckets: self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .map(|(a, b)| (a.0, a.1 - b.1))
                .collect(),
            sum: (self.sum - earlier.sum).max(0.0),
            count: self.count - earlier.count,
        }
    }

    /// This histogram plus `other`, e.g. the same metric scraped from two routers. The empty
    /// histogram merges with anything.
    pub fn merged(&self, other: &Histogram) -> Result<Histogram, HistogramError> {
        if self.buckets.is_empty() {
            return Ok(other.clone());
        }
        if other.buckets.is_empty() {
            return Ok(self.clone());
        }
        if self.buckets.len() != other.buckets.len()
            || self
                .buckets
                .iter()
                .zip(&other.buckets)
                .any(|(a, b)| a.0 != b.0)
        {
            return Err(HistogramError::DifferentBounds);
        }
        Ok(Histogram {
            buckets: self
                .buckets
                .iter()
                .zip(&other.buckets)
                .map(|(a, b)| (a.0, a.1 + b.1))
                .collect(),
            sum: self.sum + other.sum,
            count: self.count + other.count,
        })
    }

    /// The `q`-quantile (0 ≤ q ≤ 1) of the observations, as `histogram_quantile` estimates it:
    /// the bucket holding rank `q × count` is found and the value interpolated linearly between
    /// its lower bound (the previous bucket's bound, 0 for the first) and its upper bound. A rank
    /// in the `+Inf` bucket gives the largest finite bound. `None` without observations or for
    /// a `q` outside `[0, 1]`.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        if self.count == 0 || !(0.0..=1.0).contains(&q) {
            return None;
        }
        let rank = q * self.count as f64;
        let finite = &self.buckets[..self.buckets.len() - 1];
        // The first bucket reaching the rank (and holding an observation, so q = 0 gives the
        // lower bound of the first non-empty bucket rather than 0/0).
        let Some(b) = finite
            .iter()
            .position(|&(_, cumulative)| cumulative > 0 && cumulative as f64 >= rank)
        else {
            let largest = finite.last().expect("checked by new").0;
            return Some(Duration::from_secs_f64(largest));
        };
        let (end, cumulative) = finite[b];
        let (start, below) = if b == 0 { (0.0, 0) } else { finite[b - 1] };
        let in_bucket = (cumulative - below) as f64;
        let seconds = start + (end - start) * ((rank - below as f64) / in_bucket);
        Some(Duration::from_secs_f64(seconds.max(0.0)))
    }
}

#[cfg(test)]
mod tests;
