//! BF16 (the top 16 bits of an f32), rounded to nearest with ties to even.
//!
//! Finite values too large for BF16 round to ±infinity, as IEEE rounding does; NaN stays a quiet
//! NaN of the same sign.

/// Encodes an f32 to BF16 bits, round to nearest even.
#[inline]
pub fn encode(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounding = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// Decodes BF16 bits to f32 (exact).
#[inline]
pub fn decode(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Rounds `x` to BF16, as f32 (what a BF16 operand holds).
#[inline]
pub fn round(x: f32) -> f32 {
    decode(encode(x))
}

/// Encodes `values` into `bytes` as little-endian BF16 (2 bytes each).
///
/// # Panics
/// If `bytes` is not twice as long as `values`.
pub fn encode_le(values: &[f32], bytes: &mut [u8]) {
    assert_eq!(bytes.len(), 2 * values.len(), "BF16 byte length");
    for (pair, v) in bytes.chunks_exact_mut(2).zip(values) {
        pair.copy_from_slice(&encode(*v).to_le_bytes());
    }
}

/// Decodes little-endian BF16 `bytes` into `out`.
///
/// # Panics
/// If `bytes` is not twice as long as `out`.
pub fn decode_le(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len(), 2 * out.len(), "BF16 byte length");
    for (o, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = decode(u16::from_le_bytes([pair[0], pair[1]]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_non_nan_code() {
        for bits in 0..=u16::MAX {
            let x = decode(bits);
            if x.is_nan() {
                assert!(decode(encode(x)).is_nan());
            } else {
                assert_eq!(encode(x), bits);
            }
        }
    }

    #[test]
    fn ties_to_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: goes to 1 (even).
        assert_eq!(decode(encode(1.0 + 1.0 / 256.0)), 1.0);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: goes to the even one.
        assert_eq!(decode(encode(1.0 + 3.0 / 256.0)), 1.0 + 2.0 / 128.0);
        assert_eq!(decode(encode(f32::MAX)), f32::INFINITY);
    }
}
