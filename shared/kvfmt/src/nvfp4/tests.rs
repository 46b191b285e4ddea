use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, Normal};

use super::*;

fn roundtrip(x: &[f32], g: f32) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    let mut packed = vec![0u8; x.len() / 2];
    let mut scales = vec![0u8; x.len() / BLOCK];
    quantize(x, g, &mut packed, &mut scales).unwrap();
    let mut y = vec![0.0f32; x.len()];
    dequantize(&packed, &scales, g, &mut y).unwrap();
    (packed, scales, y)
}

/// Half the distance from `v` (an E2M1 magnitude) to its neighbours, the largest error rounding
/// may leave. Above 6 the top interval [4, 6] continues.
fn half_step(magnitude: f32) -> f32 {
    match magnitude {
        m if m < 2.0 => 0.25,
        m if m < 4.0 => 0.5,
        _ => 1.0,
    }
}

#[test]
fn all_zero_block_has_zero_scale_and_codes() {
    let (packed, scales, y) = roundtrip(&[0.0; 32], 1.0);
    assert_eq!(packed, vec![0; 16]);
    assert_eq!(scales, vec![0; 2]);
    assert!(y.iter().all(|v| *v == 0.0));
}

#[test]
fn exact_values_are_preserved() {
    // amax 6 with g = 1 gives s = 1, so every E2M1 value is exact.
    let x: Vec<f32> = (0..16).map(|i| e2m1::decode(i as u8)).collect();
    let (packed, scales, y) = roundtrip(&x, 1.0);
    assert_eq!(scales, vec![e4m3::encode(1.0)]);
    assert_eq!(packed, vec![0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]);
    for (a, b) in x.iter().zip(&y) {
        assert_eq!(a, b);
    }
}

#[test]
fn nibble_order_is_low_then_high() {
    let mut x = [0.0f32; 16];
    x[0] = 6.0; // code 7, low nibble of byte 0
    x[1] = -0.5; // code 9, high nibble of byte 0
    let mut packed = [0u8; 8];
    let scale = quantize_block(&x, 1.0, &mut packed);
    assert_eq!(scale, 0x38, "scale 1.0");
    assert_eq!(packed[0], 0x97);
}

#[test]
fn scale_saturates_at_448() {
    // amax / 6 = 1000 > 448: s saturates, values beyond 6·448 saturate at 6.
    let mut x = [0.0f32; 16];
    x[0] = 6000.0;
    x[1] = -6000.0;
    x[2] = 448.0 * 3.0;
    let mut packed = [0u8; 8];
    let scale = quantize_block(&x, 1.0, &mut packed);
    assert_eq!(scale, e4m3::MAX_CODE);
    let mut y = [0.0f32; 16];
    dequantize_block(&packed, scale, 1.0, &mut y);
    assert_eq!(y[0], 6.0 * 448.0);
    assert_eq!(y[1], -6.0 * 448.0);
    assert_eq!(y[2], 3.0 * 448.0);
}

#[test]
fn global_scale_brings_large_blocks_into_range() {
    let mut x = [0.0f32; 16];
    x[0] = 5760.0;
    let (_, scales, y) = roundtrip(&x, 10.0);
    assert_ne!(scales[0], e4m3::MAX_CODE);
    assert_eq!(y[0], 5760.0, "5760 / (6·10) = 96 is exact in E4M3");
}

#[test]
fn subnormal_block_scales() {
    // amax / 6 lands on E4M3 subnormals: s = 3·2^-9 exactly.
    let s = 3.0 * e4m3::MIN_SUBNORMAL;
    let mut x = [0.0f32; 16];
    x[0] = 6.0 * s;
    x[1] = -3.0 * s;
    x[2] = 0.5 * s;
    let mut packed = [0u8; 8];
    let scale = quantize_block(&x, 1.0, &mut packed);
    assert_eq!(scale, 0x03, "subnormal code 3");
    let mut y = [0.0f32; 16];
    dequantize_block(&packed, scale, 1.0, &mut y);
    assert_eq!(&y[..3], &[6.0 * s, -3.0 * s, 0.5 * s]);
    // A block whose amax/6 rounds to zero is stored as all zeros.
    let tiny = [e4m3::MIN_SUBNORMAL * 6.0 * 0.4; 16];
    let scale = quantize_block(&tiny, 1.0, &mut packed);
    assert_eq!((scale, packed), (0, [0; 8]));
}

#[test]
fn checked_api_rejects_bad_input_without_writing() {
    let mut x = vec![1.0f32; 32];
    x[17] = f32::NAN;
    let mut packed = vec![0xAAu8; 16];
    let mut scales = vec![0xAAu8; 2];
    let err = quantize(&x, 1.0, &mut packed, &mut scales).unwrap_err();
    assert_eq!(err.to_string(), "value at index 17 is not finite (NaN)");
    assert!(packed.iter().chain(&scales).all(|b| *b == 0xAA));
    let err = quantize(&x[..20], 1.0, &mut packed[..10], &mut scales[..1]).unwrap_err();
    assert!(matches!(err, Error::BadLength { .. }), "{err}");
    let err = quantize(&[0.0; 16], -1.0, &mut packed[..8], &mut scales[..1]).unwrap_err();
    assert_eq!(err, Error::BadGlobalScale(-1.0));
    let mut out = vec![0.0f32; 16];
    let err = dequantize(&[0; 8], &[0x7F], 1.0, &mut out).unwrap_err();
    assert!(matches!(err, Error::NonFinite { index: 0, .. }));
}

#[test]
fn gaussian_cosine_similarity_at_least_099() {
    let mut rng = StdRng::seed_from_u64(7);
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    for g in [1.0f32, 0.01, 3.0] {
        let x: Vec<f32> = (0..64 * 1024).map(|_| normal.sample(&mut rng)).collect();
        let (_, _, y) = roundtrip(&x, g);
        let dot: f64 = x
            .iter()
            .zip(&y)
            .map(|(a, b)| (*a as f64) * (*b as f64))
            .sum();
        let nx: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        let ny: f64 = y.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        let cosine = dot / (nx * ny);
        assert!(cosine >= 0.99, "g={g}: cosine {cosine}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// With a normal, unsaturated block scale, every value lands within half an E2M1 step (times
    /// s·g) of its input.
    #[test]
    fn error_within_half_a_step(
        x in prop::array::uniform16(-6.0f32..6.0),
        exponent in -5i32..8,
        g in prop::sample::select(vec![1.0f32, 0.5, 3.0, 0.0137, 250.0]),
    ) {
        // Block amax / (6g) lands in the E4M3 normal range [2^-6, 448) most of the time.
        let x = x.map(|v| v * 2f32.powi(exponent) * g);
        let mut packed = [0u8; 8];
        let scale = quantize_block(&x, g, &mut packed);
        let s = e4m3::decode(scale);
        prop_assume!(s >= e4m3::MIN_NORMAL && scale != e4m3::MAX_CODE);
        let mut y = [0.0f32; 16];
        dequantize_block(&packed, scale, g, &mut y);
        for i in 0..16 {
            let scaled = x[i] / (s * g);
            let code = e2m1::decode(e2m1::encode(scaled));
            let bound = half_step(code.abs()) * s * g;
            let err = (x[i] - y[i]).abs();
            // f32 rounding in the division and the multiplications adds a few ulps.
            let slack = 4.0 * f32::EPSILON * (x[i].abs() + y[i].abs());
            prop_assert!(err <= bound + slack, "x={} y={} s={} g={} bound={}", x[i], y[i], s, g, bound);
            // The rounding picked the nearest representable value.
            for cand in e2m1::TABLE {
                prop_assert!((scaled - code).abs() <= (scaled - cand).abs() + 1e-6 || scaled.abs() > 6.0);
            }
        }
    }

    /// Quantizing a dequantized block gives back the same bytes when g = 1.
    #[test]
    fn requantizing_is_stable(x in prop::array::uniform16(-100.0f32..100.0)) {
        let mut packed = [0u8; 8];
        let scale = quantize_block(&x, 1.0, &mut packed);
        prop_assume!(e4m3::decode(scale) >= e4m3::MIN_NORMAL);
        let mut y = [0.0f32; 16];
        dequantize_block(&packed, scale, 1.0, &mut y);
        let mut again = [0u8; 8];
        let scale_again = quantize_block(&y, 1.0, &mut again);
        let mut z = [0.0f32; 16];
        dequantize_block(&again, scale_again, 1.0, &mut z);
        prop_assert_eq!(y, z);
    }
}
