//! [`OutageLog`]: how a process reports a recurring etcd operation (a capacity update every
//! second, a planner poll, a lease renewal) that keeps failing while etcd is down, without a
//! line per attempt: the first failure at WARN with its error, then at most one WARN per period
//! with the failures counted since, and one INFO when the operation succeeds again, saying how
//! long the outage lasted and how many attempts failed.
//!
//! The decisions ([`OutageLog::failed`], [`OutageLog::succeeded`]) are plain functions of the
//! time given, unit-tested without a clock or a logger; [`OutageLog::fail`] and
//! [`OutageLog::recover`] write the lines.

use std::fmt::Display;
use std::time::{Duration, Instant};

/// How often a continuing outage is logged, by default.
pub const OUTAGE_LOG_PERIOD: Duration = Duration::from_secs(30);

/// The reporting state of one recurring operation (module docs).
#[derive(Debug, Clone)]
pub struct OutageLog {
    /// What the operation is, for the log (`"updating the registered capacity"`).
    what: &'static str,
    period: Duration,
    outage: Option<Outage>,
}

#[derive(Debug, Clone, Copy)]
struct Outage {
    since: Instant,
    failures: u64,
    /// When the last line was written, and the failures counted then.
    logged_at: Instant,
    logged_failures: u64,
}

/// What a failure calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The first of an outage: say so, with the error.
    First,
    /// A period has passed since the last line: `failures` more since it, `total` in all.
    StillFailing {
        failures: u64,
        total: u64,
        lasted: Duration,
    },
    /// Nothing to log.
    Quiet,
}

/// An outage that ended: how long it lasted and how many attempts failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    pub failures: u64,
    pub lasted: Duration,
}

impl OutageLog {
    /// The log of `what`, at most one line per [`OUTAGE_LOG_PERIOD`] while it fails.
    pub fn new(what: &'static str) -> Self {
        Self::every(what, OUTAGE_LOG_PERIOD)
    }

    /// The log of `what`, at most one line per `period` while it fails.
    pub fn every(what: &'static str, period: Duration) -> Self {
        Self {
            what,
            period,
            outage: None,
        }
    }

    /// Whether the operation is failing now.
    pub fn failing(&self) -> bool {
        self.outage.is_some()
    }

    /// Notes a failure at `now`: what it calls for.
    pub fn failed(&mut self, now: Instant) -> Failure {
        let Some(outage) = &mut self.outage else {
            self.outage = Some(Outage {
                since: now,
                failures: 1,
                logged_at: now,
                logged_failures: 1,
            });
            return Failure::First;
        };
        outage.failures += 1;
        if now.saturating_duration_since(outage.logged_at) < self.period {
            return Failure::Quiet;
        }
        let failures = outage.failures - outage.logged_failures;
        outage.logged_at = now;
        outage.logged_failures = outage.failures;
        Failure::StillFailing {
            failures,
            total: outage.failures,
            lasted: now.saturating_duration_since(outage.since),
        }
    }

    /// Notes a success at `now`: the outage it ends, if one was under way.
    pub fn succeeded(&mut self, now: Instant) -> Option<Recovered> {
        self.outage.take().map(|outage| Recovered {
            failures: outage.failures,
            lasted: now.saturating_duration_since(outage.since),
        })
    }

    /// Notes a failure with `err` now and logs what it calls for.
    pub fn fail(&mut self, err: &dyn Display) {
        let what = self.what;
        let period = self.period.as_secs();
        match self.failed(Instant::now()) {
            Failure::First => tracing::warn!(
                %err,
                "{what} failed; retrying, and logging this at most every {period} s until it \
                 succeeds"
            ),
            Failure::StillFailing {
                failures,
                total,
                lasted,
            } => tracing::warn!(
                %err,
                failures,
                total,
                failing_for_s = lasted.as_secs(),
                "{what} still failing"
            ),
            Failure::Quiet => {}
        }
    }

    /// Notes a success now and logs the end of an outage, if one was under way.
    pub fn recover(&mut self) {
        if let Some(Recovered { failures, lasted }) = self.succeeded(Instant::now()) {
            tracing::info!(
                failures,
                failed_for_s = lasted.as_secs_f64(),
                "{} succeeded again",
                self.what
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_logged_once_then_once_a_period_then_its_end() {
        let mut log = OutageLog::every("updating the registered capacity", OUTAGE_LOG_PERIOD);
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        assert!(log.succeeded(at(0)).is_none(), "no outage, nothing to end");
        assert_eq!(log.failed(at(1)), Failure::First);
        assert!(log.failing());
        // A failure a second for 29 more seconds: quiet.
        for s in 2..31 {
            assert_eq!(log.failed(at(s)), Failure::Quiet, "at {s} s");
        }
        // 30 s after the first line: one line counting the 30 failures since.
        assert_eq!(
            log.failed(at(31)),
            Failure::StillFailing {
                failures: 30,
                total: 31,
                lasted: Duration::from_secs(30)
            }
        );
        assert_eq!(log.failed(at(32)), Failure::Quiet);
        assert_eq!(
            log.failed(at(61)),
            Failure::StillFailing {
                failures: 2,
                total: 33,
                lasted: Duration::from_secs(60)
            }
        );
        assert_eq!(
            log.succeeded(at(70)),
            Some(Recovered {
                failures: 33,
                lasted: Duration::from_secs(69)
            })
        );
        assert!(!log.failing());
        assert!(log.succeeded(at(71)).is_none(), "the end is told once");
        // The next outage starts afresh.
        assert_eq!(log.failed(at(80)), Failure::First);
    }

    #[test]
    fn an_hour_of_failures_a_second_is_120_lines() {
        let mut log = OutageLog::new("polling");
        let start = Instant::now();
        let lines = (0..3600)
            .map(|s| log.failed(start + Duration::from_secs(s)))
            .filter(|f| *f != Failure::Quiet)
            .count();
        assert_eq!(lines, 120, "the first, then one every 30 s");
    }
}
