//! OCP FP8 E4M3FN: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities.
//!
//! Finite range ±448 (code 0x7E); 0x7F and 0xFF are NaN. Subnormals (exponent field 0) are
//! `m/8 · 2^-6`, the smallest being 2^-9.
//!
//! [`encode`] rounds to nearest with ties to even and saturates: every finite value beyond ±448,
//! and ±infinity, becomes ±448. NaN encodes as the NaN code of its sign (0x7F or 0xFF). The sign of
//! zero is kept (-0.0 encodes as 0x80). [`decode`] is exact: every code is an f32.

/// Largest finite magnitude.
pub const MAX: f32 = 448.0;
/// Code of +448, the largest finite value.
pub const MAX_CODE: u8 = 0x7E;
/// Code of +NaN (0xFF is -NaN).
pub const NAN_CODE: u8 = 0x7F;
/// Smallest normal magnitude, 2^-6.
pub const MIN_NORMAL: f32 = 1.0 / 64.0;
/// Smallest subnormal magnitude, 2^-9.
pub const MIN_SUBNORMAL: f32 = 1.0 / 512.0;

/// Decodes every code at compile time.
static TABLE: [f32; 256] = build_table();

const fn decode_bits(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let exp = ((code >> 3) & 0x0F) as u32;
    let mant = (code & 0x07) as u32;
    if exp == 0x0F && mant == 0x07 {
        // A quiet NaN carrying the code's sign.
        return f32::from_bits(0x7FC0_0000 | ((code as u32 & 0x80) << 24));
    }
    let magnitude = if exp == 0 {
        // Subnormal: m · 2^-9, exact in f32.
        mant as f32 * MIN_SUBNORMAL
    } else {
        f32::from_bits(((exp + 127 - 7) << 23) | (mant << 20))
    };
    sign * magnitude
}

const fn build_table() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        table[code] = decode_bits(code as u8);
        code += 1;
    }
    table
}

/// Decodes one E4M3 code to f32 (exact).
#[inline]
pub fn decode(code: u8) -> f32 {
    TABLE[code as usize]
}

/// Encodes an f32 to E4M3FN: round to nearest, ties to even, saturating at ±448.
#[inline]
pub fn encode(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) as u8) & 0x80;
    if x.is_nan() {
        return sign | NAN_CODE;
    }
    let a = x.abs();
    let magnitude = if a >= MAX {
        MAX_CODE
    } else if a >= MIN_NORMAL {
        // Normal: keep the top 3 mantissa bits, round the other 20 to nearest even. A carry out of
        // the mantissa moves into the exponent, which is the correct rounding.
        let abits = a.to_bits();
        let exp = (abits >> 23) as i32 - 127; // -6..=8
        let mant = abits & 0x7F_FFFF;
        let mut code = (((exp + 7) as u32) << 3) | (mant >> 20);
        let rest = mant & 0xF_FFFF;
        const HALF: u32 = 0x8_0000;
        if rest > HALF || (rest == HALF && code & 1 == 1) {
            code += 1;
        }
        // a < 448 keeps the result at or below 0x7E (448 itself).
        code.min(MAX_CODE as u32) as u8
    } else {
        // Subnormal range: multiples of 2^-9. Scaling by 512 is exact; 8 lands on the smallest
        // normal (code 0x08), as it should.
        (a * 512.0).round_ties_even() as u8
    };
    sign | magnitude
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_code_round_trips() {
        for code in 0..=255u8 {
            let value = decode(code);
            if code & 0x7F == NAN_CODE {
                assert!(value.is_nan(), "code {code:#04x} must be NaN");
                assert_eq!(encode(value), code, "NaN keeps its sign");
                continue;
            }
            assert!(value.is_finite());
            assert_eq!(encode(value), code, "code {code:#04x} value {value}");
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(decode(0x7E), 448.0);
        assert_eq!(decode(0xFE), -448.0);
        assert_eq!(decode(0x08), MIN_NORMAL);
        assert_eq!(decode(0x01), MIN_SUBNORMAL);
        assert_eq!(decode(0x07), 7.0 * MIN_SUBNORMAL);
        assert_eq!(decode(0x38), 1.0);
        assert_eq!(decode(0x39), 1.125);
        assert_eq!(encode(1.0), 0x38);
        assert_eq!(encode(-2.0), 0xC0);
    }

    #[test]
    fn saturates_at_448() {
        for x in [448.0, 449.0, 464.0, 480.0, 1e6, f32::MAX, f32::INFINITY] {
            assert_eq!(encode(x), MAX_CODE, "{x}");
            assert_eq!(encode(-x), 0x80 | MAX_CODE, "-{x}");
        }
        // Below the top the ordinary rounding applies: 432 is halfway between 416 (odd code 0x7D)
        // and 448 (even code 0x7E), so it goes to 448.
        assert_eq!(decode(encode(432.0)), 448.0);
        assert_eq!(decode(encode(431.0)), 416.0);
    }

    #[test]
    fn ties_go_to_even() {
        // Between consecutive codes c and c+1 the midpoint rounds to whichever is even.
        for code in 0..MAX_CODE {
            let lo = decode(code);
            let hi = decode(code + 1);
            let mid = (lo + hi) / 2.0; // exact: both have at most 4 significant bits
            let expected = if code % 2 == 0 { code } else { code + 1 };
            assert_eq!(encode(mid), expected, "midpoint of {lo} and {hi}");
            // Just off the midpoint, the nearer neighbour wins.
            assert_eq!(encode(f32::from_bits(mid.to_bits() - 1)), code);
            assert_eq!(encode(f32::from_bits(mid.to_bits() + 1)), code + 1);
        }
    }

    #[test]
    fn subnormals_and_zero() {
        assert_eq!(encode(0.0), 0x00);
        assert_eq!(encode(-0.0), 0x80);
        assert_eq!(
            encode(MIN_SUBNORMAL / 2.0),
            0x00,
            "half the smallest subnormal ties to 0"
        );
        assert_eq!(encode(MIN_SUBNORMAL * 0.5001), 0x01);
        assert_eq!(encode(MIN_SUBNORMAL * 1.5), 0x02, "1.5 ties to even 2");
        assert_eq!(encode(MIN_SUBNORMAL * 2.5), 0x02, "2.5 ties to even 2");
        assert_eq!(
            encode(MIN_SUBNORMAL * 7.5),
            0x08,
            "7.5 rounds up into the normals"
        );
        assert_eq!(encode(1e-30), 0x00);
    }
}
