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

impl Error {
    /// The cause in a few words, for a one-line message an operator reads: `connection
    /// refused`, `no answer after 3s`, ... (never a nested debug structure).
    pub fn brief(&self) -> String {
        match self {
            Error::Etcd { source, .. } => etcd_cause(source),
            Error::EtcdTimeout { after, .. } => format!("no answer after {after:?}"),
            other => other.to_string(),
        }
    }
}

/// The innermost cause of an etcd client error: the I/O error's kind when there is one (a
/// refused or reset connection), else the innermost message.
fn etcd_cause(error: &etcd_client::Error) -> String {
    use etcd_client::Error as E;
    let root: &(dyn std::error::Error + 'static) = match error {
        E::GRpcStatus(status) => status,
        E::TransportError(error) => error,
        E::IoError(error) => error,
        other => return other.to_string(),
    };
    let mut innermost = root;
    let mut next = Some(root);
    while let Some(error) = next {
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                std::io::ErrorKind::Other => io.to_string(),
                kind => kind.to_string(),
            };
        }
        innermost = error;
        next = error.source();
    }
    match innermost.downcast_ref::<tonic::Status>() {
        Some(status) => status.message().to_string(),
        None => innermost.to_string(),
    }
}

/// Discovery's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
