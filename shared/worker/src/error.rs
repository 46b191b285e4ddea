//! The worker's errors, classified where they arise and mapped to a gRPC status in one place:
//! [`From<Error> for tonic::Status`](Error).

use nibble_engine::scheduler::SubmitError;
use nibble_engine::RequestError;

/// Everything a worker operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request was refused by the engine (parameters, tokens, capacity).
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The engine failed (model loading, page bytes).
    #[error("engine: {0}")]
    Engine(#[from] nibble_engine::Error),
    /// A wire value was invalid.
    #[error(transparent)]
    Convert(#[from] nibble_proto::ConvertError),
    /// A field was invalid; the message names it.
    #[error("{0}")]
    InvalidArgument(String),
    /// A peer's KV format differs from ours: its pages would be misread.
    #[error(
        "KV-format fingerprint {theirs:016x} differs from this worker's {ours:016x} ({format}): \
         peers must run the same --kv-dtype, --page-size, --kv-window, --hadamard, --calibration \
         and --prefill-work"
    )]
    FingerprintMismatch {
        ours: u64,
        theirs: u64,
        /// This worker's format, described.
        format: String,
    },
    /// No pending reservation has this id.
    #[error("no pending reservation {0}")]
    UnknownReservation(u64),
    /// The reservation is not filled yet.
    #[error("reservation {id} has {filled} of {expected} pages")]
    Incomplete {
        id: u64,
        filled: usize,
        expected: usize,
    },
    /// A push named a page twice, or one an earlier push named.
    #[error("page_indices: page {0} of the reservation was already named")]
    DuplicatePage(u32),
    /// A received page holds bytes no writer produces; nothing of its push is used.
    #[error("page {index} of the reservation: {fault}")]
    BadPage {
        /// The page's position in the sequence, as the push named it.
        index: u32,
        fault: nibble_kvfmt::PageFault,
    },
    /// The request was aborted (by Abort, or a cancelled peer).
    #[error("request {0} was aborted")]
    Aborted(String),
    /// The engine failed while running the request: a device failure (UNAVAILABLE: the worker
    /// is stopping, another can serve it) or a failed step (INTERNAL).
    #[error("request failed: {0}")]
    Failed(nibble_engine::Failure),
    /// The engine thread ended with this reason (a device failure): the worker stops.
    #[error("{0}")]
    EngineFailed(String),
    /// The decode worker refused or failed a page push.
    #[error("page push to {address}: {status}")]
    Push {
        address: String,
        status: tonic::Status,
    },
    /// The decode worker could not be reached.
    #[error("connecting to {address}: {source}")]
    Connect {
        address: String,
        source: tonic::transport::Error,
    },
    /// The device link (NCCL) failed, timed out or is not set up; the request falls back to the
    /// gRPC stream.
    #[error("NCCL link: {0}")]
    Link(String),
    /// The sender's NCCL pair is unknown here (never set up, replaced, or dropped after an
    /// error): it must connect again.
    #[error("no NCCL communicator with sender {sender} at generation {generation}")]
    NoCommunicator { sender: String, generation: u64 },
    /// This worker does not offer NCCL.
    #[error("NCCL is not available on this worker ({0})")]
    NcclUnavailable(String),
    /// A CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] nibble_cuda::Error),
    /// `--device cuda` (or `auto` on a GPU it chose) could not start the CUDA backend.
    #[error("--device cuda: {0}")]
    DeviceStart(#[source] nibble_cuda::Error),
    /// NCCL or a device link failed; the transfer falls back to the gRPC stream.
    #[error("NCCL link: {0}")]
    Nccl(#[from] nibble_nccl::Error),
    /// The engine thread is gone.
    #[error("the engine has stopped")]
    EngineStopped,
    /// Work of a role this worker does not have now (UNAVAILABLE: another worker can take it).
    #[error("worker {worker} is a {role} worker, not {wanted} (it may have changed role)")]
    WrongRole {
        worker: String,
        role: &'static str,
        wanted: &'static str,
    },
    /// New work of the role this worker is leaving (UNAVAILABLE: another worker can take it).
    #[error("worker {worker} is leaving the {role} role: it takes no new {role} work")]
    LeavingRole { worker: String, role: &'static str },
    /// TLS files or the internal token are unusable, or a peer address cannot be dialed.
    #[error(transparent)]
    Security(#[from] nibble_security::Error),
    /// Membership registration failed.
    #[error("discovery: {0}")]
    Discovery(#[from] nibble_discovery::Error),
    /// Serving failed.
    #[error("server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether a decode worker refused pushed pages for what they held (INVALID_ARGUMENT): it
    /// released the reservation, so sending them again another way cannot succeed.
    pub fn is_refusal(&self) -> bool {
        matches!(self, Error::Push { status, .. } if status.code() == tonic::Code::InvalidArgument)
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Status;
        let message = e.to_string();
        match e {
            Error::Request(RequestError::Submit(submit)) => match submit {
                SubmitError::QueueFull { .. } | SubmitError::NoRoom { .. } => {
                    Status::resource_exhausted(message)
                }
                SubmitError::Duplicate(_) => Status::already_exists(message),
                SubmitError::Unknown(_) => Status::not_found(message),
                SubmitError::TooLong(e) => nibble_proto::request::invalid_param(&e),
                SubmitError::EmptyPrompt
                | SubmitError::TooLarge { .. }
                | SubmitError::Finished(_)
                | SubmitError::EmptyOutput(_) => Status::invalid_argument(message),
            },
            Error::Request(RequestError::Param(e)) => nibble_proto::request::invalid_param(&e),
            Error::Request(_)
            | Error::InvalidArgument(_)
            | Error::DuplicatePage(_)
            | Error::BadPage { .. } => Status::invalid_argument(message),
            Error::Convert(e) => e.into(),
            Error::FingerprintMismatch { .. } | Error::Incomplete { .. } => {
                Status::failed_precondition(message)
            }
            Error::UnknownReservation(_) | Error::NoCommunicator { .. } => {
                Status::not_found(message)
            }
            Error::NcclUnavailable(_) => Status::failed_precondition(message),
            Error::Link(_)
            | Error::Nccl(_)
            | Error::Discovery(nibble_discovery::Error::Timeout { .. }) => {
                Status::unavailable(message)
            }
            Error::Aborted(_) => Status::aborted(message),
            // What a decode worker said of this worker's push is never the caller's mistake:
            // the caller sent a valid request, and the pages (or the link) are the cluster's.
            // The message names the decode worker's address for the operator; the router tells
            // its client only a stable sentence for the code (`public` in its flow).
            Error::Push { status, .. } => match status.code() {
                // A reservation the decode worker no longer holds ran out of time (its TTL
                // passed while the prompt waited to be prefilled; or it was released): the
                // request took too long, which the router tells as such.
                tonic::Code::NotFound => Status::deadline_exceeded(message),
                // The decode worker refused the pages (they failed its checks) and released the
                // reservation: they are corrupt, and sending them again cannot succeed.
                tonic::Code::InvalidArgument => Status::data_loss(message),
                // The decode worker is gone or slow: another may serve the request.
                tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
                    Status::unavailable(message)
                }
                tonic::Code::DeadlineExceeded => Status::deadline_exceeded(message),
                // A fingerprint refusal, a missing token: the cluster is misconfigured.
                _ => Status::internal(message),
            },
            Error::Connect { .. }
            | Error::EngineStopped
            | Error::WrongRole { .. }
            | Error::LeavingRole { .. }
            | Error::Failed(nibble_engine::Failure::Device(_)) => Status::unavailable(message),
            Error::Engine(_)
            | Error::Cuda(_)
            | Error::DeviceStart(_)
            | Error::Failed(nibble_engine::Failure::Step(_))
            | Error::EngineFailed(_)
            | Error::Security(_)
            | Error::Discovery(_)
            | Error::Serve(_)
            | Error::Io(_) => Status::internal(message),
        }
    }
}
