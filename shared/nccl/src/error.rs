//! Errors of NCCL and the device links: the library missing, an NCCL call failing, a wait
//! cancelled or past its deadline, a driver error, or a link that broke.

use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("NCCL: {0}")]
    NotFound(String),
    #[error("NCCL {op} failed ({code}): {message}")]
    Nccl {
        op: &'static str,
        code: i32,
        message: String,
    },
    #[error("{0}: cancelled")]
    Cancelled(&'static str),
    #[error("{what}: no completion after {after:?}")]
    Timeout {
        what: &'static str,
        after: std::time::Duration,
    },
    #[error("{what}: expected {expected}, got {actual}")]
    Shape {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("unsupported by NCCL here: {0}")]
    Unsupported(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error(transparent)]
    Cuda(#[from] nibble_cuda::Error),
    /// The link failed, or the peer went away or broke the protocol.
    #[error("{0}")]
    Link(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
