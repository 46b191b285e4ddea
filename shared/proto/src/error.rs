//! [`ConvertError`]: why a wire message could not become a valid domain value.

/// A wire message that does not describe a valid value. Messages name the field, so a client
/// that sent it knows what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// A required field is absent.
    #[error("{0} is required")]
    Missing(&'static str),
    /// An enum field holds its UNSPECIFIED value (or one this build does not know).
    #[error("{field} must be set to a known value, got {value}")]
    Unspecified { field: &'static str, value: i32 },
    /// The page geometry is invalid.
    #[error("kv_format: {0}")]
    Layout(#[source] nibble_kvfmt::Error),
    /// The number of global scales does not match the number of layers.
    #[error("kv_format.{field} must have one entry per layer ({expected}), got {got}")]
    ScaleCount {
        field: &'static str,
        expected: usize,
        got: usize,
    },
    /// A global scale is not a positive finite number.
    #[error("kv_format.{field}[{layer}]: {source}")]
    Scale {
        field: &'static str,
        layer: usize,
        #[source]
        source: nibble_kvfmt::Error,
    },
}

impl From<ConvertError> for tonic::Status {
    fn from(err: ConvertError) -> Self {
        tonic::Status::invalid_argument(err.to_string())
    }
}
