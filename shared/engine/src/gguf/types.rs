//! GGML tensor element types: their ids in the file and their block geometry.

use std::fmt;

/// A GGML tensor type. Quantized types store fixed-size blocks of `block_len()` values in
/// `block_bytes()` bytes; plain types are blocks of one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 values: f16 scale, 16 bytes of 4-bit values offset by 8.
    Q4_0,
    /// 32 values: f16 scale, f16 min, 16 bytes of 4-bit values.
    Q4_1,
    /// 32 values: f16 scale, 32 fifth bits, 16 bytes of low nibbles; 5-bit values offset by 16.
    Q5_0,
    /// 32 values: f16 scale, f16 min, 32 fifth bits, 16 bytes of low nibbles.
    Q5_1,
    /// 32 values: f16 scale, 32 signed bytes.
    Q8_0,
    /// 256-value super-block: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.
    Q4K,
    /// 256-value super-block: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 i8 scales, f16 d.
    Q6K,
    /// A type this reader knows by id but cannot dequantize.
    Other(u32),
}

impl GgmlType {
    /// Decodes a GGML type id.
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            14 => Self::Q6K,
            30 => Self::Bf16,
            other => Self::Other(other),
        }
    }

    /// Values per block.
    pub fn block_len(self) -> Option<usize> {
        Some(match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q6K => 256,
            Self::Other(_) => return None,
        })
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> Option<usize> {
        Some(match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 => 2 + 16,
            Self::Q4_1 => 2 + 2 + 16,
            Self::Q5_0 => 2 + 4 + 16,
            Self::Q5_1 => 2 + 2 + 4 + 16,
            Self::Q8_0 => 2 + 32,
            Self::Q4K => 2 + 2 + 12 + 128,
            Self::Q6K => 128 + 64 + 16 + 2,
            Self::Other(_) => return None,
        })
    }

    /// Bytes needed for `n` values, or `None` if the type is unknown or `n` is not a whole
    /// number of blocks.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let len = self.block_len()? as u64;
        if !n.is_multiple_of(len) {
            return None;
        }
        (n / len).checked_mul(self.block_bytes()? as u64)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::F32 => f.write_str("F32"),
            Self::F16 => f.write_str("F16"),
            Self::Bf16 => f.write_str("BF16"),
            Self::Q4_0 => f.write_str("Q4_0"),
            Self::Q4_1 => f.write_str("Q4_1"),
            Self::Q5_0 => f.write_str("Q5_0"),
            Self::Q5_1 => f.write_str("Q5_1"),
            Self::Q8_0 => f.write_str("Q8_0"),
            Self::Q4K => f.write_str("Q4_K"),
            Self::Q6K => f.write_str("Q6_K"),
            Self::Other(id) => write!(f, "ggml type {id}"),
        }
    }
}
