//! Waiting for a decision to be applied: the [`Pending`] decision, the workers it still awaits,
//! and how it ends ([`Resolution`]).
//!
//! A decision is pending from its proposal until every changed worker has acknowledged it or is
//! gone (its registration vanished: a worker that died mid-flip must not leave the decision
//! stuck), or until the acknowledgement timeout passes. The planner proposes nothing while a
//! decision is pending.

use std::collections::BTreeSet;
use std::fmt;
use std::time::{Duration, Instant};

/// The decision the planner waits on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    decision: u64,
    awaiting: BTreeSet<String>,
    gone: BTreeSet<String>,
    proposed_at: Instant,
    deadline: Instant,
}

impl Pending {
    pub(crate) fn new<'a>(
        decision: u64,
        changed: impl IntoIterator<Item = &'a str>,
        proposed_at: Instant,
        timeout: Duration,
    ) -> Self {
        Self {
            decision,
            awaiting: changed.into_iter().map(str::to_string).collect(),
            gone: BTreeSet::new(),
            proposed_at,
            deadline: proposed_at + timeout,
        }
    }

    /// The decision's id.
    pub fn decision(&self) -> u64 {
        self.decision
    }

    /// The changed workers that have neither acknowledged the decision nor gone, by id.
    pub fn awaiting(&self) -> impl Iterator<Item = &str> {
        self.awaiting.iter().map(String::as_str)
    }

    /// When the decision was proposed.
    pub fn proposed_at(&self) -> Instant {
        self.proposed_at
    }

    /// When the planner stops waiting.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Records `worker`'s acknowledgement of `decision`; false when that is not this decision or
    /// not a worker it awaits.
    pub(crate) fn acknowledge(&mut self, worker: &str, decision: u64) -> bool {
        decision == self.decision && self.awaiting.remove(worker)
    }

    /// Records that `worker` is gone; false when it was not awaited.
    pub(crate) fn forget(&mut self, worker: &str) -> bool {
        let awaited = self.awaiting.remove(worker);
        if awaited {
            self.gone.insert(worker.to_string());
        }
        awaited
    }

    /// How the decision ended, if it has by `now`.
    pub(crate) fn resolve(&self, now: Instant) -> Option<Resolved> {
        let resolution = if self.awaiting.is_empty() {
            Resolution::Acknowledged {
                gone: self.gone.iter().cloned().collect(),
            }
        } else if now >= self.deadline {
            Resolution::TimedOut {
                after: self.deadline - self.proposed_at,
                missing: self.awaiting.iter().cloned().collect(),
            }
        } else {
            return None;
        };
        Some(Resolved {
            decision: self.decision,
            resolution,
        })
    }

    /// The hold reason while waiting.
    pub(crate) fn why(&self, now: Instant) -> String {
        let awaiting: Vec<&str> = self.awaiting().collect();
        let left = self.deadline.saturating_duration_since(now).as_secs();
        format!(
            "waiting for acknowledgement of decision {} from {} ({left} s left)",
            self.decision,
            awaiting.join(", ")
        )
    }
}

/// A decision that stopped being pending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub decision: u64,
    pub resolution: Resolution,
}

/// How a decision ended. [`Display`](fmt::Display) is the history's wording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// Every changed worker acknowledged it, or is gone (listed).
    Acknowledged { gone: Vec<String> },
    /// The acknowledgement timeout passed; `missing` never answered.
    TimedOut {
        after: Duration,
        missing: Vec<String>,
    },
    /// A newer decision replaced it before it resolved.
    Superseded,
}

impl fmt::Display for Resolution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resolution::Acknowledged { gone } if gone.is_empty() => f.write_str("acknowledged"),
            Resolution::Acknowledged { gone } => {
                write!(f, "acknowledged; {} left before answering", gone.join(", "))
            }
            Resolution::TimedOut { after, missing } => {
                write!(
                    f,
                    "timed out after {} s: {} never answered",
                    after.as_secs(),
                    missing.join(", ")
                )
            }
            Resolution::Superseded => f.write_str("superseded"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolutions_read_as_the_history_prints_them() {
        let acknowledged = Resolution::Acknowledged { gone: vec![] };
        assert_eq!(acknowledged.to_string(), "acknowledged");
        let gone = Resolution::Acknowledged {
            gone: vec!["decode-3".into()],
        };
        assert_eq!(
            gone.to_string(),
            "acknowledged; decode-3 left before answering"
        );
        let timed_out = Resolution::TimedOut {
            after: Duration::from_secs(60),
            missing: vec!["decode-3".into()],
        };
        assert_eq!(
            timed_out.to_string(),
            "timed out after 60 s: decode-3 never answered"
        );
        assert_eq!(Resolution::Superseded.to_string(), "superseded");
    }

    #[test]
    fn a_pending_decision_resolves_by_ack_gone_or_deadline() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(60);
        let mut pending = Pending::new(7, ["a", "b"], t0, timeout);
        assert_eq!(pending.deadline(), t0 + timeout);
        assert_eq!(pending.resolve(t0), None);
        // An ack of another decision, or from a worker not awaited, does not count.
        assert!(!pending.acknowledge("a", 6));
        assert!(!pending.acknowledge("c", 7));
        assert!(pending.acknowledge("a", 7));
        assert_eq!(pending.awaiting().collect::<Vec<_>>(), ["b"]);
        assert_eq!(
            pending.why(t0 + Duration::from_secs(15)),
            "waiting for acknowledgement of decision 7 from b (45 s left)"
        );
        assert_eq!(
            pending.resolve(t0 + timeout),
            Some(Resolved {
                decision: 7,
                resolution: Resolution::TimedOut {
                    after: timeout,
                    missing: vec!["b".into()]
                }
            })
        );
        assert!(pending.forget("b"));
        assert!(!pending.forget("b"));
        assert_eq!(
            pending.resolve(t0),
            Some(Resolved {
                decision: 7,
                resolution: Resolution::Acknowledged {
                    gone: vec!["b".into()]
                }
            })
        );
    }
}
