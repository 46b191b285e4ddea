//! NVFP4 blocks: 16 E2M1 values sharing one E4M3 block scale, under an FP32 global scale.
//!
//! For a block x of 16 values and the global scale g (a dequantization multiplier, 1.0 when
//! uncalibrated):
//!
//! ```text
//! amax = max |x_i|
//! s    = E4M3_RNE_SAT(amax / (6 * g))      the stored scale byte; amax = 0 gives s = 0
//! q_i  = E2M1_RNE_SAT(x_i / (s * g))       s decoded back to f32; q = 0 where s = 0
//! x^_i = (e2m1(q_i) * s) * g
//! ```
//!
//! That is [`ScaleRule::Amax`], the rule of the OCP and NVIDIA write-ups. [`ScaleRule::Mse`]
//! (nibble's default) then tries the codes near `s` and keeps the one whose block has the least
//! squared error:
//!
//! ```text
//! for c in [s, s-1, s+1, s-2, s-3]          E4M3 codes, skipping 0 and anything past 0x7E
//!     r       = 1 / (c * g)
//!     q_i(c)  = E2M1_RNE_SAT(x_i * r)
//!     err(c)  = sum over i = 0..15 in order of (x_i - (e2m1(q_i) * c) * g)^2
//! keep the first c with the smallest err    (a NaN err never wins)
//! ```
//!
//! and then encodes the block under the chosen code exactly as the amax rule does (dividing).
//! The search multiplies by one reciprocal per candidate instead of dividing 16 times: on the
//! GPU that is what keeps the search cheap enough for a decode step's quantize-on-write.
//!
//! Both rules write bytes any NVFP4 reader decodes the same way; only the encoder differs.
//! The f32 operations happen in exactly this order so that every implementation (this crate, the
//! CUDA quantize-on-write kernel) produces the same bytes. Two codes per byte: element 2j in the
//! low nibble, 2j+1 in the high nibble. A head vector of D values is D/2 packed bytes and D/16
//! scale bytes.

use crate::{check_finite, check_global_scale, e2m1, e4m3, Error, Result};

/// Values per block.
pub const BLOCK: usize = 16;
/// Packed bytes per block.
pub const PACKED_BLOCK_BYTES: usize = BLOCK / 2;

/// How an encoder chooses a block's E4M3 scale (see the module docs). Readers need not know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScaleRule {
    /// `E4M3(amax / 6g)`: the bytes other NVFP4 implementations write.
    Amax,
    /// The code near amax's with the least squared error over the block (the default: it
    /// lowers the cache's error at no cost to the reader).
    #[default]
    Mse,
}

impl ScaleRule {
    /// Every rule, in the order of their names.
    pub const ALL: [ScaleRule; 2] = [ScaleRule::Amax, ScaleRule::Mse];

    /// The rule's name, as flags and reports spell it.
    pub fn name(self) -> &'static str {
        match self {
            ScaleRule::Amax => "amax",
            ScaleRule::Mse => "mse",
        }
    }

    /// The rule named `name` (`amax` or `mse`).
    pub fn parse(name: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|r| r.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| format!("unknown NVFP4 scale rule {name:?} (expected amax or mse)"))
    }
}

impl std::fmt::Display for ScaleRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Offsets from the amax code that [`ScaleRule::Mse`] tries, in order (ties keep the earlier).
pub const MSE_CANDIDATES: [i32; 5] = [0, -1, 1, -2, -3];

/// Quantizes one block with the amax rule into 8 packed bytes and returns its scale byte.
#[inline]
pub fn quantize_block(x: &[f32; BLOCK], g: f32, packed: &mut [u8; PACKED_BLOCK_BYTES]) -> u8 {
    quantize_block_with(x, g, ScaleRule::Amax, packed)
}

/// Quantizes one block under `rule` into 8 packed bytes and returns its scale byte.
#[inline]
pub fn quantize_block_with(
    x: &[f32; BLOCK],
    g: f32,
    rule: ScaleRule,
    packed: &mut [u8; PACKED_BLOCK_BYTES],
) -> u8 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = e4m3::encode(amax / (e2m1::MAX * g));
    if e4m3::decode(scale) == 0.0 {
        *packed = [0; PACKED_BLOCK_BYTES];
        return scale;
    }
    let scale = match rule {
        ScaleRule::Amax => scale,
        ScaleRule::Mse => least_error_scale(x, g, scale),
    };
    encode_with_scale(x, g, e4m3::decode(scale), packed);
    scale
}

/// Packs the block's E2M1 codes under the decoded scale `s` (> 0).
#[inline]
fn encode_with_scale(x: &[f32; BLOCK], g: f32, s: f32, packed: &mut [u8; PACKED_BLOCK_BYTES]) {
    let denom = s * g;
    for (byte, pair) in packed.iter_mut().zip(x.chunks_exact(2)) {
        let lo = e2m1::encode(pair[0] / denom);
        let hi = e2m1::encode(pair[1] / denom);
        *byte = lo | (hi << 4);
    }
}

/// The squared error of the block quantized under the decoded scale `s`, summed in order; the
/// codes come from one reciprocal (see the module docs), each operation rounded on its own.
#[inline]
fn block_error(x: &[f32; BLOCK], g: f32, s: f32) -> f32 {
    let r = 1.0 / (s * g);
    let mut err = 0.0f32;
    for &v in x {
        let d = v - (e2m1::decode(e2m1::encode_counting(v * r)) * s) * g;
        err += d * d;
    }
    err
}

/// [`ScaleRule::Mse`]'s choice among the codes near `amax_code` (a positive, finite code).
fn least_error_scale(x: &[f32; BLOCK], g: f32, amax_code: u8) -> u8 {
    let mut best = amax_code;
    let mut best_err = f32::NAN;
    for offset in MSE_CANDIDATES {
        let code = i32::from(amax_code) + offset;
        if code < 1 || code > i32::from(e4m3::MAX_CODE) {
            continue;
        }
        let code = code as u8;
        let err = block_error(x, g, e4m3::decode(code));
        // The amax code (offset 0, first) always sets the bar, whatever its error.
        if offset == 0 || err < best_err {
            best = code;
            best_err = err;
        }
    }
    best
}

/// Dequantizes one block.
#[inline]
pub fn dequantize_block(
    packed: &[u8; PACKED_BLOCK_BYTES],
    scale: u8,
    g: f32,
    out: &mut [f32; BLOCK],
) {
    let s = e4m3::decode(scale);
    for (pair, byte) in out.chunks_exact_mut(2).zip(packed) {
        pair[0] = (e2m1::decode(byte & 0x0F) * s) * g;
        pair[1] = (e2m1::decode(byte >> 4) * s) * g;
    }
}

/// Quantizes `x` (a multiple of 16 values) into `packed` (len/2 bytes) and `scales` (len/16
/// bytes) without checking values.
///
/// # Panics
/// If the lengths disagree or `x.len()` is not a multiple of 16.
pub fn quantize_unchecked(x: &[f32], g: f32, packed: &mut [u8], scales: &mut [u8]) {
    quantize_unchecked_with(x, g, ScaleRule::Amax, packed, scales);
}

/// [`quantize_unchecked`] under `rule`.
///
/// # Panics
/// If the lengths disagree or `x.len()` is not a multiple of 16.
pub fn quantize_unchecked_with(
    x: &[f32],
    g: f32,
    rule: ScaleRule,
    packed: &mut [u8],
    scales: &mut [u8],
) {
    assert_eq!(x.len() % BLOCK, 0, "NVFP4 input must be whole blocks");
    assert_eq!(packed.len() * 2, x.len(), "packed length");
    assert_eq!(scales.len() * BLOCK, x.len(), "scales length");
    let blocks = x.chunks_exact(BLOCK);
    let packed_blocks = packed.chunks_exact_mut(PACKED_BLOCK_BYTES);
    for ((block, out), scale) in blocks.zip(packed_blocks).zip(scales.iter_mut()) {
        let block: &[f32; BLOCK] = block.try_into().expect("chunk of BLOCK");
        let out: &mut [u8; PACKED_BLOCK_BYTES] = out.try_into().expect("chunk of 8");
        *scale = quantize_block_with(block, g, rule, out);
    }
}

/// Dequantizes `packed` and `scales` into `out` (`out.len()` values).
///
/// # Panics
/// If the lengths disagree or `out.len()` is not a multiple of 16.
pub fn dequantize_unchecked(packed: &[u8], scales: &[u8], g: f32, out: &mut [f32]) {
    assert_eq!(out.len() % BLOCK, 0, "NVFP4 output must be whole blocks");
    assert_eq!(packed.len() * 2, out.len(), "packed length");
    assert_eq!(scales.len() * BLOCK, out.len(), "scales length");
    let packed_blocks = packed.chunks_exact(PACKED_BLOCK_BYTES);
    for ((out, block), scale) in out.chunks_exact_mut(BLOCK).zip(packed_blocks).zip(scales) {
        let out: &mut [f32; BLOCK] = out.try_into().expect("chunk of BLOCK");
        let block: &[u8; PACKED_BLOCK_BYTES] = block.try_into().expect("chunk of 8");
        dequantize_block(block, *scale, g, out);
    }
}

fn check_lengths(values: usize, packed: usize, scales: usize) -> Result<()> {
    if !values.is_multiple_of(BLOCK) {
        return Err(Error::BadLength {
            what: "NVFP4 values (a multiple of 16)",
            expected: values.next_multiple_of(BLOCK),
            actual: values,
        });
    }
    if packed * 2 != values {
        return Err(Error::BadLength {
            what: "NVFP4 packed bytes",
            expected: values / 2,
            actual: packed,
        });
    }
    if scales * BLOCK != values {
        return Err(Error::BadLength {
            what: "NVFP4 scale bytes",
            expected: values / BLOCK,
            actual: scales,
        });
    }
    Ok(())
}

/// Checked [`quantize_unchecked`]: rejects a bad global scale, bad lengths and non-finite values
/// (naming the first one's index) before writing anything.
pub fn quantize(x: &[f32], g: f32, packed: &mut [u8], scales: &mut [u8]) -> Result<()> {
    quantize_with(x, g, ScaleRule::Amax, packed, scales)
}

/// Checked [`quantize_unchecked_with`], as [`quantize`] checks.
pub fn quantize_with(
    x: &[f32],
    g: f32,
    rule: ScaleRule,
    packed: &mut [u8],
    scales: &mut [u8],
) -> Result<()> {
    check_global_scale(g)?;
    check_lengths(x.len(), packed.len(), scales.len())?;
    check_finite(x)?;
    quantize_unchecked_with(x, g, rule, packed, scales);
    Ok(())
}

/// Checked [`dequantize_unchecked`]. Rejects a scale byte that is NaN (0x7F or 0xFF, which no
/// encoder writes) as [`Error::NonFinite`] with the scale's index.
pub fn dequantize(packed: &[u8], scales: &[u8], g: f32, out: &mut [f32]) -> Result<()> {
    check_global_scale(g)?;
    check_lengths(out.len(), packed.len(), scales.len())?;
    if let Some(index) = scales.iter().position(|&s| s & 0x7F == e4m3::NAN_CODE) {
        return Err(Error::NonFinite {
            index,
            value: f32::NAN,
        });
    }
    dequantize_unchecked(packed, scales, g, out);
    Ok(())
}

pub mod feedback;

#[cfg(test)]
mod tests;
