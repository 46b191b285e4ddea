//! [`KvDtype`]: the element type of a KV cache.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// How K and V values are stored in cache pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// BF16, 2 bytes per value.
    Bf16,
    /// FP8 E4M3 with one per-(layer, K|V) scale, 1 byte per value.
    Fp8,
    /// NVFP4: E2M1 values, one E4M3 scale per 16 values, one per-(layer, K|V) FP32 scale;
    /// 9 bytes per 16 values.
    Nvfp4,
}

impl KvDtype {
    /// Every dtype, in the order the docs list them.
    pub const ALL: [KvDtype; 3] = [KvDtype::Bf16, KvDtype::Fp8, KvDtype::Nvfp4];

    /// The name used on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8",
            KvDtype::Nvfp4 => "nvfp4",
        }
    }

    /// Bytes of element data for one head vector of `head_dim` values (no scales).
    pub fn data_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::Bf16 => 2 * head_dim,
            KvDtype::Fp8 => head_dim,
            KvDtype::Nvfp4 => head_dim / 2,
        }
    }

    /// Bytes of block scales for one head vector of `head_dim` values.
    pub fn scale_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::Bf16 | KvDtype::Fp8 => 0,
            KvDtype::Nvfp4 => head_dim / crate::nvfp4::BLOCK,
        }
    }

    /// Bytes of one head vector, data and scales together.
    pub fn vector_bytes(self, head_dim: usize) -> usize {
        self.data_bytes(head_dim) + self.scale_bytes(head_dim)
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl KvDtype {
    /// Parses a dtype name (the one parser of every command line and config): `bf16`, `fp8`
    /// (also `fp8_e4m3`, `e4m3`) or `nvfp4`, in any case.
    pub fn parse(s: &str) -> Result<Self, Error> {
        s.parse()
    }
}

impl FromStr for KvDtype {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(KvDtype::Bf16),
            "fp8" | "fp8_e4m3" | "e4m3" => Ok(KvDtype::Fp8),
            "nvfp4" => Ok(KvDtype::Nvfp4),
            _ => Err(Error::UnknownDtype(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for dtype in KvDtype::ALL {
            assert_eq!(dtype.name().parse::<KvDtype>().unwrap(), dtype);
        }
        let err = "fp16".parse::<KvDtype>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown KV dtype \"fp16\": expected one of bf16, fp8, nvfp4"
        );
    }

    #[test]
    fn vector_bytes() {
        assert_eq!(KvDtype::Nvfp4.vector_bytes(128), 72);
        assert_eq!(KvDtype::Fp8.vector_bytes(128), 128);
        assert_eq!(KvDtype::Bf16.vector_bytes(128), 256);
    }
}
