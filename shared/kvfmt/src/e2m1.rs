//! FP4 E2M1: 1 sign bit (bit 3), 2 exponent bits, 1 mantissa bit.
//!
//! Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. There is no NaN or infinity. [`encode`] rounds to
//! nearest with ties to the even code and saturates at ±6; ±infinity saturates, and NaN (which has
//! no code) encodes as +6 — callers that can meet NaN use the checked NVFP4 API, which rejects it.
//! The sign is kept for values that round to zero (-0.1 encodes as 0x8, negative zero).

/// Largest magnitude.
pub const MAX: f32 = 6.0;

/// The value of every 4-bit code.
pub const TABLE: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Decodes a 4-bit code (the low nibble of `code`).
#[inline]
pub fn decode(code: u8) -> f32 {
    TABLE[(code & 0x0F) as usize]
}

/// Encodes an f32 to a 4-bit E2M1 code: round to nearest, ties to even, saturating at ±6.
#[inline]
pub fn encode(x: f32) -> u8 {
    let sign = if x.is_sign_negative() && !x.is_nan() {
        0x8
    } else {
        0x0
    };
    let a = x.abs();
    // Thresholds are the midpoints between neighbours; `<=` where the lower neighbour has the even
    // code (ties go down), `<` where the upper one does (ties go up).
    let magnitude = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    sign | magnitude
}

/// [`encode`] without branches, for loops that encode one value under many scales (the mse
/// block-scale search, where the chain's branches are unpredictable: twice as fast there, and
/// 40% slower than the chain where each value is encoded once, as in `nvfp4::quantize`).
///
/// The magnitude code is the number of rounding thresholds (the midpoints between neighbours) the
/// magnitude passes: strictly (`>`) where the lower neighbour has the even code, so ties go down,
/// and inclusively (`>=`) where the upper one does, so ties go up.
#[inline]
pub fn encode_counting(x: f32) -> u8 {
    let a = x.abs();
    let magnitude = u8::from(a > 0.25)
        + u8::from(a >= 0.75)
        + u8::from(a > 1.25)
        + u8::from(a >= 1.75)
        + u8::from(a > 2.5)
        + u8::from(a >= 3.5)
        + u8::from(a > 5.0);
    if x.is_nan() {
        return 7;
    }
    let sign = ((x.to_bits() >> 28) & 0x8) as u8;
    sign | magnitude
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counting_thresholds_encodes_as_the_comparison_chain() {
        // Every 4,099th bit pattern (both signs, subnormals, infinities and NaNs among them),
        // and each threshold with its neighbours a few ulps away.
        let mut bits = (0..=u32::MAX).step_by(4_099).collect::<Vec<_>>();
        for t in [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0] {
            for d in 0..4u32 {
                for v in [t.to_bits() + d, t.to_bits().saturating_sub(d)] {
                    bits.push(v);
                    bits.push(v | 0x8000_0000);
                }
            }
        }
        for b in bits {
            let x = f32::from_bits(b);
            assert_eq!(encode_counting(x), encode(x), "{x:e} ({b:#010x})");
        }
    }

    #[test]
    fn every_code_round_trips() {
        for code in 0..16u8 {
            let value = decode(code);
            assert_eq!(encode(value), code, "code {code:#x} value {value}");
        }
    }

    #[test]
    fn every_tie_goes_to_the_even_code() {
        // (midpoint, expected magnitude code)
        let ties = [
            (0.25, 0), // 0 | 0.5
            (0.75, 2), // 0.5 | 1
            (1.25, 2), // 1 | 1.5
            (1.75, 4), // 1.5 | 2
            (2.5, 4),  // 2 | 3
            (3.5, 6),  // 3 | 4
            (5.0, 6),  // 4 | 6
        ];
        for (mid, code) in ties {
            assert_eq!(encode(mid), code, "tie at {mid}");
            assert_eq!(encode(-mid), 0x8 | code, "tie at -{mid}");
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            assert!(
                decode(encode(below)) < decode(encode(above)),
                "around {mid}"
            );
        }
    }

    #[test]
    fn saturates_at_6() {
        for x in [6.0, 6.5, 7.0, 100.0, f32::MAX, f32::INFINITY] {
            assert_eq!(encode(x), 7);
            assert_eq!(encode(-x), 0xF);
        }
    }

    #[test]
    fn small_values_keep_their_sign() {
        assert_eq!(encode(0.0), 0x0);
        assert_eq!(encode(0.1), 0x0);
        assert_eq!(encode(-0.1), 0x8);
        assert_eq!(decode(0x8), 0.0);
    }
}
