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

/// The block's squared error after a round trip under `rule`.
fn rule_error(x: &[f32; BLOCK], g: f32, rule: ScaleRule) -> (u8, f32) {
    let mut packed = [0u8; PACKED_BLOCK_BYTES];
    let scale = quantize_block_with(x, g, rule, &mut packed);
    let mut y = [0.0f32; BLOCK];
    dequantize_block(&packed, scale, g, &mut y);
    let err = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
    (scale, err)
}

#[test]
fn scale_rules_parse_by_name() {
    for rule in ScaleRule::ALL {
        assert_eq!(ScaleRule::parse(rule.name()), Ok(rule));
        assert_eq!(rule.to_string(), rule.name());
    }
    assert_eq!(ScaleRule::parse("MSE"), Ok(ScaleRule::Mse));
    let err = ScaleRule::parse("max").unwrap_err();
    assert!(
        err.contains("\"max\"") && err.contains("amax or mse"),
        "{err}"
    );
    assert_eq!(ScaleRule::default(), ScaleRule::Mse);
}

#[test]
fn mse_keeps_the_amax_code_when_it_is_exact() {
    // Every value on the E2M1 grid under s = 1: no other code can do better than zero error.
    let x: [f32; BLOCK] = std::array::from_fn(|i| e2m1::decode(i as u8));
    let (scale, err) = rule_error(&x, 1.0, ScaleRule::Mse);
    assert_eq!(scale, e4m3::encode(1.0));
    assert_eq!(err, 0.0);
}

#[test]
fn mse_picks_a_smaller_scale_when_one_outlier_costs_the_rest() {
    // One value at 6, fifteen at 4.9: under s = 1 the fifteen round down to 4 (E2M1 has nothing
    // between 4 and 6); at s = 0.875 they land on 6 x 0.875 = 5.25 and the 6 is clipped to 5.25.
    let mut x = [4.9f32; BLOCK];
    x[0] = 6.0;
    let (amax_scale, amax_err) = rule_error(&x, 1.0, ScaleRule::Amax);
    let (mse_scale, mse_err) = rule_error(&x, 1.0, ScaleRule::Mse);
    assert_eq!(amax_scale, e4m3::encode(1.0));
    assert_ne!(mse_scale, amax_scale);
    assert!(mse_err < amax_err, "{mse_err} !< {amax_err}");
}

#[test]
fn mse_never_does_worse_than_amax_and_lowers_gaussian_error() {
    let mut rng = StdRng::seed_from_u64(7);
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    let (mut amax_total, mut mse_total) = (0.0f64, 0.0f64);
    for _ in 0..2000 {
        let x: [f32; BLOCK] = std::array::from_fn(|_| normal.sample(&mut rng));
        let (_, a) = rule_error(&x, 1.0, ScaleRule::Amax);
        let (_, m) = rule_error(&x, 1.0, ScaleRule::Mse);
        assert!(m <= a, "mse {m} > amax {a} for {x:?}");
        amax_total += f64::from(a);
        mse_total += f64::from(m);
    }
    // At least 10% less squared error over Gaussian blocks.
    assert!(mse_total < 0.9 * amax_total, "{mse_total} vs {amax_total}");
}

#[test]
fn mse_stays_within_the_valid_codes() {
    // Saturated (amax code 0x7E: nothing above it) and the smallest subnormal (nothing below 1).
    let (big, _) = rule_error(&[1e6f32; BLOCK], 1.0, ScaleRule::Mse);
    assert!(big <= e4m3::MAX_CODE);
    let tiny = [e4m3::MIN_SUBNORMAL * 6.0; BLOCK];
    let (small, err) = rule_error(&tiny, 1.0, ScaleRule::Mse);
    assert!((1..=e4m3::MAX_CODE).contains(&small), "{small:#x}");
    assert!(err.is_finite());
    // An all-zero block keeps scale 0 under every rule.
    assert_eq!(rule_error(&[0.0; BLOCK], 1.0, ScaleRule::Mse), (0, 0.0));
}

#[test]
fn the_default_entry_points_keep_the_amax_bytes() {
    let mut rng = StdRng::seed_from_u64(11);
    let normal = Normal::new(0.0f32, 3.0).unwrap();
    let x: Vec<f32> = (0..64).map(|_| normal.sample(&mut rng)).collect();
    let (mut p1, mut s1) = (vec![0u8; 32], vec![0u8; 4]);
    let (mut p2, mut s2) = (vec![0u8; 32], vec![0u8; 4]);
    quantize(&x, 1.0, &mut p1, &mut s1).unwrap();
    quantize_with(&x, 1.0, ScaleRule::Amax, &mut p2, &mut s2).unwrap();
    assert_eq!((p1, s1), (p2, s2));
}
