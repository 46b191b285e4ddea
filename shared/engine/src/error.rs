//! The engine's error type: one enum, classified at the point of failure, every variant naming
//! the thing (file, tensor, metadata key, architecture) that was wrong.

use std::path::PathBuf;

/// Errors from loading and running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file could not be opened or mapped.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// The file does not start with the GGUF magic.
    #[error("not a GGUF file (magic {0:#010x})")]
    BadMagic(u32),
    /// A GGUF version this reader does not understand.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    /// The file ended before a structure it declares.
    #[error("GGUF file truncated: {what} needs bytes {start}..{end} but the file has {len}")]
    Truncated {
        /// What was being read.
        what: String,
        /// First byte needed.
        start: u64,
        /// One past the last byte needed.
        end: u64,
        /// File length.
        len: u64,
    },
    /// Malformed content (bad string, bad value type, bad alignment, ...).
    #[error("malformed GGUF: {0}")]
    Malformed(String),
    /// A metadata key the model needs is absent.
    #[error("missing metadata key `{0}`")]
    MissingMetadata(String),
    /// A metadata key has the wrong value type.
    #[error("metadata key `{key}` should be {expected}, found {found}")]
    MetadataType {
        /// The key.
        key: String,
        /// The expected type.
        expected: &'static str,
        /// The type found.
        found: String,
    },
    /// A tensor the model needs is absent.
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    /// A tensor type this reader cannot dequantize.
    #[error("tensor `{name}` has unsupported type {ggml_type}")]
    UnsupportedTensorType {
        /// Tensor name.
        name: String,
        /// GGML type name or id.
        ggml_type: String,
    },
    /// A tensor's shape differs from what the model config implies.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Tensor name.
        name: String,
        /// Expected dims, in the file format's order (GGUF: fastest-varying first;
        /// safetensors: slowest-varying first).
        expected: Vec<u64>,
        /// Dims in the file.
        found: Vec<u64>,
    },
    /// A safetensors file's header is malformed or inconsistent with its size.
    #[error("malformed safetensors file {path}: {reason}")]
    MalformedSafetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the tensor where there is one.
        reason: String,
    },
    /// A safetensors tensor has a dtype this engine does not convert.
    #[error("tensor `{name}` has unsupported dtype {dtype} (supported: F32, F16, BF16)")]
    UnsupportedDtype {
        /// Tensor name.
        name: String,
        /// The safetensors dtype name.
        dtype: String,
    },
    /// A JSON file of a model directory (config.json, tokenizer_config.json, ...) does not parse.
    #[error("cannot parse {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The model uses a feature this engine does not implement (a RoPE scaling kind, an
    /// activation, an output-projection bias, ...); the message names it.
    #[error("unsupported model feature: {0}")]
    Unsupported(String),
    /// The model's architecture is not implemented.
    #[error("unsupported architecture `{0}` (supported: llama, mistral, qwen2, qwen3)")]
    UnsupportedArchitecture(String),
    /// The model config is inconsistent (e.g. heads do not divide the hidden size).
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// Building or running the tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Rendering the chat template failed.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A forward-pass input is invalid (token out of range, context full, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// The device failed: a launch, a copy or an allocation (a GPU backend's driver error).
    /// The backend's state is unknown afterwards; its engine stops.
    #[error("device: {0}")]
    Device(String),
    /// The paged KV cache refused an operation (pool exhausted, bad slot, ...).
    #[error("KV cache: {0}")]
    Kv(#[from] nibble_kvcache::Error),
    /// A paged attention call had inconsistent shapes.
    #[error("paged attention: {0}")]
    Attention(#[from] crate::paged::AttentionError),
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
