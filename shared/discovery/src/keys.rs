//! The key layout, one place: `{root}/workers/{role}/{id}` for registrations and
//! `{root}/kv/{key}` for coordination values.

use std::fmt;

use crate::{Error, Role, WorkerId};

/// The root of every key unless configured otherwise.
pub const DEFAULT_ROOT: &str = "/nibble/v1";

/// Longest key-value key accepted.
const MAX_KEY_LEN: usize = 512;

/// A key of the coordination store: 1 to 512 characters of `[A-Za-z0-9._-]` in `/`-separated
/// non-empty segments, such as `nccl/prefill-0/decode-1`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KvKey(String);

impl KvKey {
    /// Validates a key.
    pub fn new(key: impl Into<String>) -> Result<Self, Error> {
        let key = key.into();
        let reason = if key.is_empty() || key.len() > MAX_KEY_LEN {
            Some("must be 1 to 512 characters")
        } else if key
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
        {
            Some("segments between '/' must be non-empty and not '.' or '..'")
        } else if !key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'))
        {
            Some("may contain only ASCII letters, digits, '.', '_', '-' and '/'")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(Error::InvalidKey { key, reason }),
            None => Ok(Self(key)),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for KvKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The key layout under one root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    root: String,
}

impl Layout {
    /// A layout under `root` (a trailing `/` is ignored).
    pub(crate) fn new(root: &str) -> Self {
        Self {
            root: root.trim_end_matches('/').to_string(),
        }
    }

    /// The prefix of every registration, or of one role's.
    pub(crate) fn workers_prefix(&self, role: Option<Role>) -> String {
        match role {
            Some(role) => format!("{}/workers/{role}/", self.root),
            None => format!("{}/workers/", self.root),
        }
    }

    pub(crate) fn worker(&self, role: Role, id: &WorkerId) -> String {
        format!("{}/workers/{role}/{id}", self.root)
    }

    /// The role and id of a registration key; `None` for keys that are not one.
    pub(crate) fn parse_worker(&self, key: &str) -> Option<(Role, WorkerId)> {
        let rest = key.strip_prefix(&self.workers_prefix(None))?;
        let (role, id) = rest.split_once('/')?;
        Some((role.parse().ok()?, WorkerId::new(id).ok()?))
    }

    pub(crate) fn kv(&self, key: &KvKey) -> String {
        format!("{}/kv/{key}", self.root)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_keys_round_trip() {
        let layout = Layout::new("/nibble/v1/");
        let id = WorkerId::new("p-0").unwrap();
        let key = layout.worker(Role::Prefill, &id);
        assert_eq!(key, "/nibble/v1/workers/prefill/p-0");
        assert!(key.starts_with(&layout.workers_prefix(Some(Role::Prefill))));
        assert_eq!(layout.parse_worker(&key), Some((Role::Prefill, id)));
        assert_eq!(layout.parse_worker("/nibble/v1/workers/gpu/x"), None);
        assert_eq!(layout.parse_worker("/nibble/v1/workers/decode/a/b"), None);
        assert_eq!(layout.parse_worker("/other/workers/decode/a"), None);
    }

    #[test]
    fn kv_keys() {
        let layout = Layout::new(DEFAULT_ROOT);
        let key = KvKey::new("nccl/p0/d1").unwrap();
        assert_eq!(layout.kv(&key), "/nibble/v1/kv/nccl/p0/d1");
        for bad in ["", "/a", "a/", "a//b", "a/../b", "a b"] {
            assert!(KvKey::new(bad).is_err(), "{bad:?}");
        }
    }
}
