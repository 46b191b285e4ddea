//! nibble's inference engine.
//!
//! * [`gguf`]: GGUF v3 reader and dequantizers.
pub mod error;
pub mod gguf;

pub use error::{Error, Result};
