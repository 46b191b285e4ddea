//! [`Error`]: what can go wrong in discovery, classified where it happens.

use std::time::Duration;

use crate::{Role, WorkerId};

/// A discovery error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A worker id that cannot be part of a key.
    #[error("invalid worker id {id:?}: {reason}")]
    InvalidId { id: String, reason: &'static str },
    /// A key-value key that cannot be used.
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },
    /// Another live session holds this registration.
    #[error("worker {role}/{id} is already registered by another process")]
    AlreadyRegistered { role: Role, id: WorkerId },
    /// This session holds no such registration.
    #[error("worker {role}/{id} is not registered by this process")]
    NotRegistered { role: Role, id: WorkerId },
    /// The session was closed.
    #[error("the discovery session is closed")]
    Closed,
    /// Nobody put the key in time.
    #[error("no value for key {key:?} after {waited:?}")]
    Timeout { key: String, waited: Duration },
    /// An etcd request failed.
    #[error("etcd {op}: {source}")]
    Etcd {
        op: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    /// An etcd request got no answer in time.
    #[error("etcd {op}: no answer after {after:?}")]
    EtcdTimeout { op: &'static str, after: Duration },
    /// A stored registration could not be decoded.
    #[error("malformed registration at {key}: {source}")]
    Malformed {
        key: String,
        #[source]
        source: serde_json::Error,
    },
}

/// Discovery's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
