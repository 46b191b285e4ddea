//! The error type of this crate: every variant names what was wrong.

/// What can go wrong when encoding, decoding or laying out KV data.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// An input value is NaN or infinite.
    #[error("value at index {index} is not finite ({value})")]
    NonFinite { index: usize, value: f32 },
    /// A global scale is not a finite positive number.
    #[error("global scale must be finite and > 0, got {0}")]
    BadGlobalScale(f32),
    /// The head dimension does not fit the dtype's block structure.
    #[error("head dim must be a positive multiple of {multiple}, got {head_dim}")]
    BadHeadDim { head_dim: usize, multiple: usize },
    /// A buffer length does not match what the layout requires.
    #[error("{what}: expected {expected} bytes or values, got {actual}")]
    BadLength {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A geometry parameter is zero or too large.
    #[error("{what} must be between 1 and {max}, got {value}")]
    BadGeometry {
        what: &'static str,
        value: usize,
        max: usize,
    },
    /// A recent-window size that does not fit the page layout.
    #[error("bad KV window: {0}")]
    BadWindow(String),
    /// A dtype name is not one of bf16, fp8, nvfp4.
    #[error("unknown KV dtype {0:?}: expected one of bf16, fp8, nvfp4")]
    UnknownDtype(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
