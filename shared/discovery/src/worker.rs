//! What a registration says about a worker: [`WorkerInfo`] and its parts.
//!
//! Registrations are stored as JSON, so `etcdctl get --prefix /nibble/v1/workers` is readable; the
//! KV-format fingerprint is written as 16 hex digits (JSON numbers lose precision above 2^53).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// What a process does in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes prompts' KV and pushes pages to decode workers.
    Prefill,
    /// Holds pages and generates tokens.
    Decode,
    /// Serves the public API and places requests.
    Router,
}

impl Role {
    /// Every role, in key order.
    pub const ALL: [Role; 3] = [Role::Prefill, Role::Decode, Role::Router];

    /// The name used in keys and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Router => "router",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("unknown role {s:?} (expected prefill, decode or router)"))
    }
}

/// Longest worker id accepted.
pub const MAX_ID_LEN: usize = 128;

/// A worker's id: unique within its role, 1 to 128 characters of `[A-Za-z0-9._-]`, so it is
/// one key segment.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct WorkerId(String);

impl WorkerId {
    /// Validates an id.
    pub fn new(id: impl Into<String>) -> Result<Self, Error> {
        let id = id.into();
        let reason = if id.is_empty() {
            Some("must not be empty")
        } else if id.len() > MAX_ID_LEN {
            Some("must be at most 128 characters")
        } else if !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            Some("may contain only ASCII letters, digits, '.', '_' and '-'")
        } else if id == "." || id == ".." {
            Some("must not be '.' or '..'")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(Error::InvalidId { id, reason }),
            None => Ok(Self(id)),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for WorkerId {
    type Error = Error;

    fn try_from(id: String) -> Result<Self, Error> {
        Self::new(id)
    }
}

impl From<WorkerId> for String {
    fn from(id: WorkerId) -> String {
        id.0
    }
}

impl FromStr for WorkerId {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Self::new(s)
    }
}

/// Where a worker listens, as `host:port`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Addresses {
    /// The gRPC API (Worker for prefill and decode workers, Inference for routers).
    pub grpc: String,
    /// The KvTransfer endpoint decode workers receive pages on, when separate from `grpc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<String>,
    /// The OpenAI-compatible HTTP API (routers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<String>,
    /// Prometheus metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
}

/// A worker's KV page capacity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// Pages no request and no cached block holds.
    pub free_pages: u64,
    /// Pages in the pool.
    pub total_pages: u64,
}

/// One registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub role: Role,
    pub id: WorkerId,
    pub addresses: Addresses,
    /// The model served.
    pub model: String,
    /// Fingerprint of the worker's KV format (dtype, page size, geometry, global scales); peers
    /// exchange pages only when theirs are equal. 0 for routers.
    #[serde(with = "hex_u64")]
    pub kv_fingerprint: u64,
    /// Tokens per KV page (0 for routers).
    pub page_size: u32,
    /// Page capacity (zero for routers).
    pub capacity: Capacity,
    /// Present when the worker can move pages over NCCL (its engine runs on a GPU, NCCL loads,
    /// and it was not told to use gRPC only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl: Option<NcclEndpoint>,
    /// The worker is leaving this role (a planner told it to change role in place): it finishes
    /// what it holds and takes no new work of it. Routers place nothing new on it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
}

/// Where a worker's NCCL transfers start or end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NcclEndpoint {
    /// The machine (hostname, or `--host-id`): informational, NCCL crosses hosts by its own
    /// network transports.
    pub host: String,
    /// The GPU's UUID. NCCL refuses two ranks of one communicator on the same GPU, so pages
    /// between workers sharing a GPU move over gRPC.
    pub gpu: String,
}

impl WorkerInfo {
    /// Whether pages from this (prefill) worker to `decode` may move over NCCL: both advertise
    /// NCCL, on different GPUs.
    pub fn nccl_to(&self, decode: &WorkerInfo) -> bool {
        match (&self.nccl, &decode.nccl) {
            (Some(p), Some(d)) => p.gpu != d.gpu,
            _ => false,
        }
    }
}

/// A `u64` as a 16-digit hex string.
mod hex_u64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{value:016x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let text = String::deserialize(d)?;
        u64::from_str_radix(&text, 16).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_single_key_segments() {
        assert!(WorkerId::new("decode-0.gpu_1").is_ok());
        for (bad, reason) in [
            ("", "must not be empty"),
            ("a/b", "may contain only"),
            ("a b", "may contain only"),
            ("..", "must not be '.' or '..'"),
        ] {
            let err = WorkerId::new(bad).unwrap_err().to_string();
            assert!(err.contains(reason), "{bad:?}: {err}");
        }
        assert!(WorkerId::new("x".repeat(MAX_ID_LEN)).is_ok());
        assert!(WorkerId::new("x".repeat(MAX_ID_LEN + 1)).is_err());
    }

    #[test]
    fn roles_parse_and_print() {
        for role in Role::ALL {
            assert_eq!(role.name().parse::<Role>().unwrap(), role);
        }
        assert!("gpu".parse::<Role>().is_err());
    }

    #[test]
    fn nccl_needs_both_sides_on_different_gpus() {
        let base = |nccl: Option<(&str, &str)>| WorkerInfo {
            role: Role::Decode,
            id: WorkerId::new("w").unwrap(),
            addresses: Addresses::default(),
            model: "m".into(),
            kv_fingerprint: 1,
            page_size: 16,
            capacity: Capacity::default(),
            nccl: nccl.map(|(host, gpu)| NcclEndpoint {
                host: host.into(),
                gpu: gpu.into(),
            }),
            draining: false,
        };
        let (p, d) = (base(Some(("h", "GPU-a"))), base(Some(("h", "GPU-b"))));
        assert!(p.nccl_to(&d), "both CUDA + NCCL, two GPUs: NCCL");
        assert!(
            p.nccl_to(&base(Some(("other", "GPU-c")))),
            "across hosts too"
        );
        assert!(!p.nccl_to(&base(Some(("h", "GPU-a")))), "one GPU: gRPC");
        assert!(!p.nccl_to(&base(None)), "decode without NCCL: gRPC");
        assert!(!base(None).nccl_to(&d), "prefill without NCCL: gRPC");
        let json = serde_json::to_string(&base(None)).unwrap();
        assert!(!json.contains("nccl"), "absent when not capable: {json}");
        assert!(
            !json.contains("draining"),
            "absent when not draining: {json}"
        );
        let json = serde_json::to_string(&p).unwrap();
        assert!(
            json.contains(r#""nccl":{"host":"h","gpu":"GPU-a"}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<WorkerInfo>(&json).unwrap(), p);
    }

    #[test]
    fn json_is_readable_and_round_trips() {
        let info = WorkerInfo {
            role: Role::Decode,
            id: WorkerId::new("d0").unwrap(),
            addresses: Addresses {
                grpc: "127.0.0.1:5000".into(),
                transfer: Some("127.0.0.1:5001".into()),
                ..Addresses::default()
            },
            model: "smollm2-135m".into(),
            kv_fingerprint: u64::MAX - 1,
            page_size: 16,
            capacity: Capacity {
                free_pages: 10,
                total_pages: 20,
            },
            nccl: None,
            draining: false,
        };
        let json = serde_json::to_string(&info).unwrap();
        assert!(
            json.contains(r#""kv_fingerprint":"fffffffffffffffe""#),
            "{json}"
        );
        assert!(json.contains(r#""role":"decode""#), "{json}");
        assert!(
            !json.contains("http"),
            "absent addresses are left out: {json}"
        );
        assert_eq!(serde_json::from_str::<WorkerInfo>(&json).unwrap(), info);

        let bad_id = json.replace(r#""id":"d0""#, r#""id":"a/b""#);
        assert!(serde_json::from_str::<WorkerInfo>(&bad_id).is_err());
    }
}
