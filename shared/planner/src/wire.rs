//! What the planner and the workers write to the cluster's key-value store, as JSON: the key
//! names (relative to the store's root) and the values' types. Field names are part of the
//! format: `etcdctl get` shows them and other versions read them.
//!
//! | key | value | written by |
//! |---|---|---|
//! | `planner/leader` | [`Leader`] | the elected planner, bound to its lease |
//! | `planner/decision` | [`Decision`] | the planner, on each change |
//! | `planner/applied/{worker}` | [`Ack`] | each worker, after acting on a decision |
//! | `planner/desired` | [`Desired`] | the planner, on each decision |
//! | `planner/history` | [`History`](crate::History) | the planner: the last 20 decisions |
//!
//! Workers read `planner/decision` with [`Decision::parse`], which keeps only entries naming a
//! registered worker and a real role, so a decision written by hand cannot make them do
//! something odd.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::{Desired, Proposal, Reason, Role};

/// Who leads: the planner instance holding the election.
pub const LEADER_KEY: &str = "planner/leader";
/// The current decision.
pub const DECISION_KEY: &str = "planner/decision";
/// The prefix of every worker's acknowledgement.
pub const APPLIED_PREFIX: &str = "planner/applied/";
/// The worker counts the cluster should have.
pub const DESIRED_KEY: &str = "planner/desired";
/// The last decisions and how they ended.
pub const HISTORY_KEY: &str = "planner/history";

/// The key of `worker`'s acknowledgement: `planner/applied/{worker}`.
pub fn applied_key(worker: &str) -> String {
    format!("{APPLIED_PREFIX}{worker}")
}

/// A value that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// Not JSON, or not JSON of that shape; the source says where and what.
    #[error("malformed {what}: {source}")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

pub(crate) fn from_json<T: DeserializeOwned>(
    what: &'static str,
    bytes: &[u8],
) -> Result<T, ParseError> {
    serde_json::from_slice(bytes).map_err(|source| ParseError::Json { what, source })
}

pub(crate) fn to_json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("plain data with string keys serializes")
}

/// `planner/leader`: the planner instance that holds the election, and since when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leader {
    /// The planner instance (its `--id`, or host name).
    pub id: String,
    /// When it won the election, in milliseconds since the Unix epoch.
    pub since_unix_ms: u64,
}

impl Leader {
    pub fn to_json(&self) -> Vec<u8> {
        to_json(self)
    }

    pub fn parse(bytes: &[u8]) -> Result<Self, ParseError> {
        from_json("planner leader", bytes)
    }
}

/// `planner/decision`: the role every worker should have. A worker whose role differs from its
/// entry drains and flips, then writes an [`Ack`] of this `id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Monotonic across leaders.
    pub id: u64,
    /// When it was written, in milliseconds since the Unix epoch.
    pub issued_unix_ms: u64,
    /// The [`Leader::id`] that wrote it.
    pub leader: String,
    /// Worker id → `"prefill"` or `"decode"`.
    pub roles: BTreeMap<String, Role>,
    /// The numbers it was made on.
    pub reason: Reason,
    /// The counts the cluster should have when it was made.
    pub desired: Desired,
}

/// A decision as stored, before its entries are checked.
#[derive(Deserialize)]
struct RawDecision {
    id: u64,
    #[serde(default)]
    issued_unix_ms: u64,
    #[serde(default)]
    leader: String,
    roles: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    reason: Reason,
    #[serde(default)]
    desired: Desired,
}

impl Decision {
    /// The decision to write for `proposal`, by planner `leader` at `issued_unix_ms`.
    pub fn from_proposal(proposal: &Proposal, leader: &str, issued_unix_ms: u64) -> Self {
        Self {
            id: proposal.id,
            issued_unix_ms,
            leader: leader.to_string(),
            roles: proposal.roles.clone(),
            reason: proposal.reason.clone(),
            desired: proposal.desired,
        }
    }

    /// The role `worker` should have, if the decision names it.
    pub fn role_of(&self, worker: &str) -> Option<Role> {
        self.roles.get(worker).copied()
    }

    pub fn to_json(&self) -> Vec<u8> {
        to_json(self)
    }

    /// Reads a stored decision. Malformed JSON, or a missing `id` or `roles`, is an error; an
    /// entry naming a worker not in `known_workers`, or a role other than `prefill` or
    /// `decode`, is dropped with a warning naming the worker and the value. `issued_unix_ms`,
    /// `leader`, `reason` and `desired` may be left out of a decision written by hand.
    pub fn parse(bytes: &[u8], known_workers: &[&str]) -> Result<(Self, Vec<String>), ParseError> {
        let raw: RawDecision = from_json("planner decision", bytes)?;
        let mut warnings = Vec::new();
        let mut roles = BTreeMap::new();
        for (worker, value) in raw.roles {
            if !known_workers.contains(&worker.as_str()) {
                warnings.push(format!(
                    "decision {}: worker {worker:?} is not registered; its entry {value} is ignored",
                    raw.id
                ));
                continue;
            }
            match value.as_str().map(str::parse::<Role>) {
                Some(Ok(role)) => {
                    roles.insert(worker, role);
                }
                _ => warnings.push(format!(
                    "decision {}: worker {worker:?} has role {value}, not prefill or decode; \
                     the entry is ignored",
                    raw.id
                )),
            }
        }
        let decision = Decision {
            id: raw.id,
            issued_unix_ms: raw.issued_unix_ms,
            leader: raw.leader,
            roles,
            reason: raw.reason,
            desired: raw.desired,
        };
        Ok((decision, warnings))
    }
}

/// `planner/applied/{worker}`: a worker's answer to a decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    /// The [`Decision::id`] answered.
    pub decision: u64,
    /// The worker answering.
    pub worker: String,
    /// The role it serves now.
    pub role: Role,
    /// Whether it now serves the role the decision gave it.
    pub applied: bool,
    /// What happened, e.g. why a flip failed; may be empty.
    pub detail: String,
}

impl Ack {
    pub fn to_json(&self) -> Vec<u8> {
        to_json(self)
    }

    pub fn parse(bytes: &[u8]) -> Result<Self, ParseError> {
        from_json("planner acknowledgement", bytes)
    }
}

impl Desired {
    pub fn to_json(&self) -> Vec<u8> {
        to_json(self)
    }

    pub fn parse(bytes: &[u8]) -> Result<Self, ParseError> {
        from_json("planner desired counts", bytes)
    }
}

#[cfg(test)]
mod tests;
