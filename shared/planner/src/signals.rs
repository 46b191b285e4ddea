//! What the planner decides from: each worker's load ([`WorkerLoad`], read every load poll) and
//! the cluster's latencies over the decision window ([`Latency`]).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::histogram::{Histogram, HistogramError};
use crate::Role;

/// The percentile the SLOs are stated at.
pub const SLO_QUANTILE: f64 = 0.9;

/// One worker's load, as its `Load` RPC and registration report it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerLoad {
    /// The worker's id (its registration's).
    pub id: String,
    /// The role it serves now.
    pub role: Role,
    /// Prompt tokens waiting to be prefilled on it.
    pub queued_prefill_tokens: u64,
    /// Requests it is running.
    pub running: u32,
    /// Requests waiting for a place in its batch.
    pub waiting: u32,
    /// KV pages in use.
    pub used_pages: u64,
    /// KV pages it has.
    pub total_pages: u64,
    /// It is leaving its role now (finishing its requests before a flip). A draining worker is
    /// neither counted in its role nor chosen to move.
    pub draining: bool,
}

/// The cluster's latency histograms over one decision window (the [`delta`](Histogram::delta)
/// of two scrapes, [`merged`](Histogram::merged) over the routers).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Latency {
    /// Time to first token.
    pub ttft: Histogram,
    /// Inter-token latency.
    pub itl: Histogram,
}

impl Latency {
    /// The observations between `earlier` and this snapshot (see [`Histogram::delta`]).
    pub fn delta(&self, earlier: &Latency) -> Latency {
        Latency {
            ttft: self.ttft.delta(&earlier.ttft),
            itl: self.itl.delta(&earlier.itl),
        }
    }

    /// Both histograms plus another source's (another router's).
    pub fn merged(&self, other: &Latency) -> Result<Latency, HistogramError> {
        Ok(Latency {
            ttft: self.ttft.merged(&other.ttft)?,
            itl: self.itl.merged(&other.itl)?,
        })
    }

    /// The 90th percentile time to first token; `None` without observations.
    pub fn ttft_p90(&self) -> Option<Duration> {
        self.ttft.quantile(SLO_QUANTILE)
    }

    /// The 90th percentile inter-token latency; `None` without observations.
    pub fn itl_p90(&self) -> Option<Duration> {
        self.itl.quantile(SLO_QUANTILE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p90s_come_from_the_window() {
        let inf = f64::INFINITY;
        let earlier = Latency {
            ttft: Histogram::new(vec![(1.0, 10), (5.0, 10), (inf, 10)], 5.0, 10).unwrap(),
            itl: Histogram::new(vec![(0.05, 100), (0.1, 100), (inf, 100)], 3.0, 100).unwrap(),
        };
        let later = Latency {
            // 10 more first tokens, all in (1, 5] s: p90 = 1 + 4 × 9/10.
            ttft: Histogram::new(vec![(1.0, 10), (5.0, 20), (inf, 20)], 40.0, 20).unwrap(),
            // 100 more tokens, 50 ≤ 50 ms and 50 in (50, 100] ms: p90 = 50 + 50 × 40/50 ms.
            itl: Histogram::new(vec![(0.05, 150), (0.1, 200), (inf, 200)], 10.0, 200).unwrap(),
        };
        let window = later.delta(&earlier);
        let ms = |d: Option<Duration>| (d.unwrap().as_secs_f64() * 1e3 * 1e3).round() / 1e3;
        assert_eq!(ms(window.ttft_p90()), 4600.0);
        assert_eq!(ms(window.itl_p90()), 90.0);
        assert_eq!(Latency::default().ttft_p90(), None);
        assert_eq!(Latency::default().itl_p90(), None);
        let both = window.merged(&Latency::default()).unwrap();
        assert_eq!(both, window);
    }
}
