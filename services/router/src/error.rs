//! The router core's errors, classified where they arise.
//!
//! The service maps them to gRPC codes in one place, [`From<Error> for Status`](Error):
//! [`Error::NoDecodeWorkers`] is UNAVAILABLE, the prompt's errors are INVALID_ARGUMENT naming
//! the `prompt` field; the membership and event errors concern a worker, not a client request,
//! and are INTERNAL where one reaches a client (they are logged by whoever feeds the router).

use nibble_discovery::{Role, WorkerId};
use nibble_proto::ConvertError;

/// Result of the router core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in the router core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range.
    #[error("router config: {field} {reason}")]
    InvalidConfig {
        field: &'static str,
        reason: &'static str,
    },

    /// Every worker slot is taken.
    #[error("cannot track {role} worker {id}: the router already tracks {max} workers")]
    TooManyWorkers {
        role: Role,
        id: WorkerId,
        max: usize,
    },

    /// A registration for a role that does not hold KV (a router).
    #[error("{id} registered as a {role}, which is not a prefill or decode worker")]
    NotAWorker { role: Role, id: WorkerId },

    /// A worker whose KV format differs from the router's: its pages could not be paired with
    /// the others', so it is never placed.
    #[error(
        "{role} worker {id} has KV-format fingerprint {got:016x}, the router expects {expected:016x}"
    )]
    FingerprintMismatch {
        role: Role,
        id: WorkerId,
        expected: u64,
        got: u64,
    },

    /// A worker serving another model.
    #[error("{role} worker {id} serves model {got:?}, the router routes {expected:?}")]
    ModelMismatch {
        role: Role,
        id: WorkerId,
        expected: String,
        got: String,
    },

    /// A worker whose page size differs from the one the router hashes prompts with.
    #[error(
        "{role} worker {id} has page size {got}, the router hashes prompts in pages of {expected}"
    )]
    PageSizeMismatch {
        role: Role,
        id: WorkerId,
        expected: u32,
        got: u32,
    },

    /// Events, a snapshot or a load report for a worker the router does not track.
    #[error("unknown {role} worker {id}")]
    UnknownWorker { role: Role, id: WorkerId },

    /// A wire message that does not convert to a valid domain value.
    #[error(transparent)]
    Convert(#[from] ConvertError),

    /// A prompt with no tokens.
    #[error("prompt must not be empty")]
    EmptyPrompt,

    /// Block hashes that do not cover a prompt's full pages.
    #[error(
        "a prompt of {tokens} tokens has {expected} full pages of {page_size}, got {got} block hashes"
    )]
    HashCount {
        tokens: usize,
        page_size: u32,
        expected: usize,
        got: usize,
    },

    /// A prompt hashed with another page size than the router's.
    #[error("prompt was hashed in pages of {got} tokens, the router uses {expected}")]
    PromptPageSize { expected: u32, got: u32 },

    /// A ticket that is not (or no longer) in flight.
    #[error("request ticket {0} is not in flight")]
    UnknownTicket(u64),

    /// TLS settings or the internal token cannot be used to dial workers.
    #[error(transparent)]
    Security(#[from] nibble_security::Error),

    /// No decode worker can take the request.
    #[error("no decode worker is available")]
    NoDecodeWorkers,
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Status;
        match e {
            Error::NoDecodeWorkers => Status::unavailable(e.to_string()),
            Error::EmptyPrompt | Error::HashCount { .. } | Error::PromptPageSize { .. } => {
                nibble_proto::request::invalid_field("prompt", e)
            }
            Error::Convert(e) => e.into(),
            Error::InvalidConfig { .. }
            | Error::TooManyWorkers { .. }
            | Error::NotAWorker { .. }
            | Error::FingerprintMismatch { .. }
            | Error::ModelMismatch { .. }
            | Error::PageSizeMismatch { .. }
            | Error::UnknownWorker { .. }
            | Error::UnknownTicket(_)
            | Error::Security(_) => Status::internal(e.to_string()),
        }
    }
}
