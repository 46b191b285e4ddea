//! Errors of the CUDA crate: NVRTC missing, a source that does not compile, a driver error, a
//! geometry the kernels do not handle, or a bad `NIBBLE_CUDA_*` setting.

use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    NvrtcNotFound(String),
    #[error("kernel source {source_name}.cu does not compile for {arch}:\n{log}")]
    Compile {
        source_name: &'static str,
        arch: &'static str,
        log: String,
    },
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error("no usable CUDA device: {0}")]
    NoDevice(String),
    #[error("unsupported by the CUDA kernels: {0}")]
    Unsupported(String),
    #[error("{var}={value:?} is not valid: expected {expected}")]
    InvalidEnv {
        var: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("{what}: expected {expected}, got {actual}")]
    Shape {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
}

pub type Result<T> = std::result::Result<T, Error>;
