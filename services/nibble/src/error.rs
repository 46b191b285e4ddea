//! [`Error`]: everything the CLI can fail on. Each message is one line and names the file, value,
//! flag or index that was wrong, so `error: {err}` is a complete diagnostic.

use std::io;
use std::path::PathBuf;

/// A failed `nibble` command.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An input file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    /// An output file could not be created, written or moved into place.
    #[error("cannot write {}: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },
    /// An input file's length is not a whole number of records.
    #[error("{}: length {len} bytes is not a multiple of {unit} bytes ({what})", path.display())]
    Length {
        path: PathBuf,
        len: usize,
        unit: usize,
        what: String,
    },
    /// An f32 input value is NaN or infinite.
    #[error(
        "{}: value {index} (byte offset {}) is not finite ({value})",
        path.display(),
        index * 4
    )]
    NonFinite {
        path: PathBuf,
        index: usize,
        value: f32,
    },
    /// An encoded input holds a NaN code (which no encoder writes).
    #[error("{}: byte {index} is an E4M3 NaN code, which no encoder writes", path.display())]
    NanCode { path: PathBuf, index: usize },
    /// Any other format error while encoding or decoding a file.
    #[error("{}: {source}", path.display())]
    Format {
        path: PathBuf,
        source: nibble_kvfmt::Error,
    },
    /// A model geometry or format parameter was rejected.
    #[error("{0}")]
    Geometry(#[from] nibble_kvfmt::Error),
    /// Writing to standard output failed.
    #[error("cannot write to stdout: {0}")]
    Stdout(io::Error),
    /// Writing to standard error failed.
    #[error("cannot write to stderr: {0}")]
    Stderr(io::Error),
    /// The model path does not exist.
    #[error(
        "model {} not found: pass --model (or set NIBBLE_MODEL) to a GGUF file or a Hugging \
         Face model directory, or leave it out to use the default SmolLM2-135M-Instruct \
         (fetched on first use)",
        path.display()
    )]
    ModelMissing { path: PathBuf },
    /// The default model could not be fetched.
    #[error("cannot fetch the default model to {}: {reason}", path.display())]
    Fetch { path: PathBuf, reason: String },
    /// A cluster process (`nibble up`, `router`, `prefill`, `decode`) failed.
    #[error("{0}")]
    Cluster(String),
    /// `nibble bench` could not measure: a bad suite, an unreachable or unfit cluster.
    #[error("nibble bench: {0}")]
    Bench(String),
    /// The router (`generate --url`) refused or failed the request.
    #[error("{url}: {code:?}: {message}")]
    Remote {
        url: String,
        code: tonic::Code,
        message: String,
    },
    /// `generate --url` named a server that answers plain HTTP/1 (the OpenAI API's port).
    #[error(
        "{url} is an HTTP server (the OpenAI API?); --url wants the router's gRPC address, e.g. \
         127.0.0.1:50051 (`nibble up` and `nibble router` print it: `listening on ADDR`)"
    )]
    NotGrpc { url: String },
    /// The model could not be opened or loaded.
    #[error("cannot load model {}: {source}", path.display())]
    Model {
        path: PathBuf,
        source: nibble_engine::Error,
    },
    /// A calibration file could not be used.
    #[error("{}: {source}", path.display())]
    Calibration {
        path: PathBuf,
        source: nibble_engine::Error,
    },
    /// A text input is not UTF-8.
    #[error("{} is not UTF-8 text (invalid byte at offset {offset})", path.display())]
    NotUtf8 { path: PathBuf, offset: usize },
    /// A text input could not be tokenized.
    #[error("cannot tokenize {}: {source}", path.display())]
    Tokenize {
        path: PathBuf,
        source: nibble_engine::Error,
    },
    /// A text input holds fewer tokens than the command needs.
    #[error("{} has {tokens} tokens, fewer than {needed} ({what})", path.display())]
    TextTooShort {
        path: PathBuf,
        tokens: usize,
        needed: usize,
        what: String,
    },
    /// Two flags that do not go together, or a flag whose value is out of range.
    #[error("{flag}: {reason}")]
    Flag { flag: &'static str, reason: String },
    /// A sampling parameter is out of range (checked before the model loads).
    #[error("{0}")]
    Sampling(#[from] nibble_engine::sampling::InvalidParam),
    /// The engine refused the request.
    #[error("request refused: {0}")]
    Request(#[from] nibble_engine::RequestError),
    /// The engine failed while generating.
    #[error("generation failed: {0}")]
    Generation(String),
    /// Any other engine failure (chat template, tokenizer, cache setup, forward pass).
    #[error("{0}")]
    Engine(#[from] nibble_engine::Error),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
