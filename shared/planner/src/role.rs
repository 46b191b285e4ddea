//! [`Role`]: the two things a worker can be asked to do.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What the planner asks a worker to be. Written `"prefill"` / `"decode"` in JSON, keys and on
/// the command line (the router role is not the planner's to hand out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes prompts' KV and pushes pages to decode workers.
    Prefill,
    /// Holds pages and generates tokens (and prefills its own prompts when no prefill worker is
    /// left).
    Decode,
}

impl Role {
    /// Both roles.
    pub const ALL: [Role; 2] = [Role::Prefill, Role::Decode];

    /// The name used in JSON, keys and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The other role: where a worker leaving this one goes.
    pub fn other(self) -> Role {
        match self {
            Role::Prefill => Role::Decode,
            Role::Decode => Role::Prefill,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A role name that is neither `prefill` nor `decode`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role {0:?} (expected prefill or decode)")]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, UnknownRole> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| UnknownRole(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_display_from_str_and_json() {
        for role in Role::ALL {
            assert_eq!(role.to_string().parse::<Role>(), Ok(role));
            let json = serde_json::to_string(&role).unwrap();
            assert_eq!(json, format!("\"{}\"", role.name()));
            assert_eq!(serde_json::from_str::<Role>(&json).unwrap(), role);
        }
        assert_eq!(Role::Prefill.other(), Role::Decode);
        assert_eq!(Role::Decode.other(), Role::Prefill);
    }

    #[test]
    fn an_unknown_name_is_refused_naming_it() {
        let err = "gpu".parse::<Role>().unwrap_err();
        assert_eq!(err, UnknownRole("gpu".to_string()));
        assert_eq!(
            err.to_string(),
            "unknown role \"gpu\" (expected prefill or decode)"
        );
        // Case matters: keys and JSON are lowercase.
        assert!("Prefill".parse::<Role>().is_err());
        assert!(serde_json::from_str::<Role>("\"router\"").is_err());
    }
}
