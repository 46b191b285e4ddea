//! [`PlannerConfig`]: the planner's targets and pacing, and [`validate`](PlannerConfig::validate),
//! whose errors name the command-line flag to fix.

use std::time::Duration;

use crate::Role;

/// What the planner aims for and how fast it may act. The command line (`nibble planner`) parses
/// its flags into this; [`Default`] is what an unset flag means.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannerConfig {
    /// Target time to first token, at the 90th percentile (`--slo-ttft`, default 2 s).
    pub slo_ttft: Duration,
    /// Target inter-token latency, at the 90th percentile (`--slo-itl`, default 100 ms).
    pub slo_itl: Duration,
    /// How often the planner decides; also the latency window each decision looks at
    /// (`--interval`, default 10 s).
    pub interval: Duration,
    /// How often worker loads are read (`--load-poll`, default 1 s).
    pub load_poll: Duration,
    /// Cooldown: no change is proposed within this long of the last one
    /// (`--min-change-interval`, default 60 s).
    pub min_change_interval: Duration,
    /// How long the changed workers have to acknowledge a decision before the planner gives up
    /// waiting (`--ack-timeout`, default 60 s).
    pub ack_timeout: Duration,
    /// A role gives a worker away only while its own latency ratio (p90 / SLO) is below
    /// `1 − hysteresis` (`--hysteresis`, default 0.2), so latencies sitting near the SLO do not
    /// move workers back and forth.
    pub hysteresis: f64,
    /// Consecutive decisions a violation must be seen on before the planner acts
    /// (`--patience`, default 2).
    pub patience: u32,
    /// Fewest prefill workers the planner leaves (`--min-prefill`, default 0: with no prefill
    /// worker, decode workers prefill their own prompts).
    pub min_prefill: usize,
    /// Fewest decode workers the planner leaves (`--min-decode`, default 1, at least 1).
    pub min_decode: usize,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            slo_ttft: Duration::from_secs(2),
            slo_itl: Duration::from_millis(100),
            interval: Duration::from_secs(10),
            load_poll: Duration::from_secs(1),
            min_change_interval: Duration::from_secs(60),
            ack_timeout: Duration::from_secs(60),
            hysteresis: 0.2,
            patience: 2,
            min_prefill: 0,
            min_decode: 1,
        }
    }
}

/// A configuration the planner cannot run with; the message names the flag.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A duration that must be positive is zero.
    #[error("{flag} must be greater than zero: {why}")]
    Zero {
        flag: &'static str,
        why: &'static str,
    },
    /// Deciding more often than loads are read.
    #[error(
        "--interval ({interval:?}) must be at least --load-poll ({load_poll:?}): \
         each decision needs a fresh load reading"
    )]
    IntervalBelowLoadPoll {
        interval: Duration,
        load_poll: Duration,
    },
    /// Hysteresis outside `[0, 1)`.
    #[error(
        "--hysteresis must be in [0, 1), got {0}: \
         a role gives a worker away only while its latency ratio is below 1 - hysteresis"
    )]
    Hysteresis(f64),
    /// Acting on a violation seen zero times.
    #[error("--patience must be at least 1, got 0: a violation must be seen before acting on it")]
    Patience,
    /// A minimum of no decode worker.
    #[error(
        "--min-decode must be at least 1, got 0: that allows a split that leaves no decode worker"
    )]
    MinDecode,
}

impl PlannerConfig {
    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            (
                "--slo-ttft",
                self.slo_ttft,
                "a zero time-to-first-token target is always violated",
            ),
            (
                "--slo-itl",
                self.slo_itl,
                "a zero inter-token latency target is always violated",
            ),
            (
                "--interval",
                self.interval,
                "the planner would decide continuously",
            ),
            (
                "--load-poll",
                self.load_poll,
                "loads would be read continuously",
            ),
            (
                "--ack-timeout",
                self.ack_timeout,
                "no worker could acknowledge a decision in time",
            ),
        ];
        if let Some((flag, _, why)) = positive.into_iter().find(|(_, d, _)| d.is_zero()) {
            return Err(ConfigError::Zero { flag, why });
        }
        if self.interval < self.load_poll {
            return Err(ConfigError::IntervalBelowLoadPoll {
                interval: self.interval,
                load_poll: self.load_poll,
            });
        }
        // `contains` is false for NaN too.
        if !(0.0..1.0).contains(&self.hysteresis) {
            return Err(ConfigError::Hysteresis(self.hysteresis));
        }
        if self.patience == 0 {
            return Err(ConfigError::Patience);
        }
        if self.min_decode == 0 {
            return Err(ConfigError::MinDecode);
        }
        Ok(())
    }

    /// The latency ratio below which a role has room to give a worker away: `1 − hysteresis`.
    pub fn room(&self) -> f64 {
        1.0 - self.hysteresis
    }

    /// The fewest workers of `role` the planner leaves.
    pub fn min(&self, role: Role) -> usize {
        match role {
            Role::Prefill => self.min_prefill,
            Role::Decode => self.min_decode,
        }
    }
}

#[cfg(test)]
mod tests;
