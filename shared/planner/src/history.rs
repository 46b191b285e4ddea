//! [`History`]: `planner/history`, the last [`History::CAPACITY`] decisions and how each ended,
//! oldest first; what `nibble planner status` prints.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::wire::{from_json, to_json, ParseError};
use crate::{Decision, Resolution};

/// The last decisions, oldest first.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct History {
    pub entries: Vec<HistoryEntry>,
}

/// One decision and how it ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub decision: Decision,
    /// When it resolved, in milliseconds since the Unix epoch; `null` while pending.
    pub resolved_unix_ms: Option<u64>,
    /// How: `"acknowledged"`, `"timed out after 60 s: decode-3 never answered"`,
    /// `"superseded"` (the [`Resolution`] wording, or a caller's own); `null` while pending.
    pub resolution: Option<String>,
}

impl History {
    /// How many decisions are kept.
    pub const CAPACITY: usize = 20;

    /// Adds a new decision, pending. Earlier decisions still pending are superseded by it (at
    /// its issue time); the oldest are dropped beyond [`CAPACITY`](Self::CAPACITY).
    pub fn push(&mut self, decision: Decision) {
        let at = decision.issued_unix_ms;
        for entry in self.entries.iter_mut().filter(|e| e.resolution.is_none()) {
            entry.resolved_unix_ms = Some(at);
            entry.resolution = Some(Resolution::Superseded.to_string());
        }
        self.entries.push(HistoryEntry {
            decision,
            resolved_unix_ms: None,
            resolution: None,
        });
        let excess = self.entries.len().saturating_sub(Self::CAPACITY);
        self.entries.drain(..excess);
    }

    /// Records how `decision` ended (a [`Resolution`], or a caller's sentence such as one
    /// carrying a failed flip's detail). False when the history does not hold it or it had
    /// already ended.
    pub fn resolve(&mut self, decision: u64, outcome: impl fmt::Display, unix_ms: u64) -> bool {
        let Some(entry) = self
            .entries
            .iter_mut()
            .find(|e| e.decision.id == decision && e.resolution.is_none())
        else {
            return false;
        };
        entry.resolved_unix_ms = Some(unix_ms);
        entry.resolution = Some(outcome.to_string());
        true
    }

    /// The newest decision.
    pub fn latest(&self) -> Option<&HistoryEntry> {
        self.entries.last()
    }

    pub fn to_json(&self) -> Vec<u8> {
        to_json(self)
    }

    pub fn parse(bytes: &[u8]) -> Result<Self, ParseError> {
        from_json("planner history", bytes)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;
    use crate::{Desired, Reason, Role};

    fn decision(id: u64) -> Decision {
        Decision {
            id,
            issued_unix_ms: 1_000 * id,
            leader: "planner-a".into(),
            roles: BTreeMap::from([("decode-0".to_string(), Role::Decode)]),
            reason: Reason::default(),
            desired: Desired {
                prefill: 0,
                decode: 1,
            },
        }
    }

    #[test]
    fn push_keeps_the_last_twenty_and_supersedes_the_pending() {
        let mut history = History::default();
        for id in 1..=25 {
            history.push(decision(id));
            assert!(history.resolve(id, "acknowledged", 1_000 * id + 500));
        }
        assert_eq!(history.entries.len(), History::CAPACITY);
        let ids: Vec<u64> = history.entries.iter().map(|e| e.decision.id).collect();
        assert_eq!(ids, (6..=25).collect::<Vec<_>>());

        history.push(decision(26));
        history.push(decision(27));
        let superseded = &history.entries[history.entries.len() - 2];
        assert_eq!(superseded.decision.id, 26);
        assert_eq!(superseded.resolution.as_deref(), Some("superseded"));
        assert_eq!(superseded.resolved_unix_ms, Some(27_000));
        // An acknowledged decision stays acknowledged.
        let acknowledged = &history.entries[history.entries.len() - 3];
        assert_eq!(acknowledged.resolution.as_deref(), Some("acknowledged"));
        assert_eq!(acknowledged.resolved_unix_ms, Some(25_500));
        let latest = history.latest().unwrap();
        assert_eq!((latest.decision.id, latest.resolution.as_ref()), (27, None));
    }

    #[test]
    fn resolve_records_when_and_how_once() {
        let mut history = History::default();
        history.push(decision(3));
        let timed_out = Resolution::TimedOut {
            after: Duration::from_secs(60),
            missing: vec!["decode-3".into()],
        };
        assert!(history.resolve(3, &timed_out, 63_000));
        assert!(!history.resolve(3, "acknowledged", 64_000));
        assert!(!history.resolve(4, "acknowledged", 64_000));
        let entry = &history.entries[0];
        assert_eq!(
            entry.resolution.as_deref(),
            Some("timed out after 60 s: decode-3 never answered")
        );
        assert_eq!(entry.resolved_unix_ms, Some(63_000));
    }

    #[test]
    fn the_history_round_trips_with_its_field_names() {
        let mut history = History::default();
        history.push(decision(1));
        let json: serde_json::Value = serde_json::from_slice(&history.to_json()).unwrap();
        let entry = &json["entries"][0];
        assert_eq!(entry["decision"]["id"], 1);
        assert_eq!(entry["resolved_unix_ms"], serde_json::Value::Null);
        assert_eq!(entry["resolution"], serde_json::Value::Null);
        assert_eq!(History::parse(&history.to_json()).unwrap(), history);
        let err = History::parse(b"[]").unwrap_err().to_string();
        assert!(err.starts_with("malformed planner history: "), "{err}");
    }
}
