//! [`Error`]: everything the CLI can fail on. Each message is one line and names the file, value
//! or index that was wrong, so `error: {err}` is a complete diagnostic.

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
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
