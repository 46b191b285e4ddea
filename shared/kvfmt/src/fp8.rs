//! FP8 E4M3 with one per-tensor scale g (a dequantization multiplier):
//! `q = E4M3_RNE_SAT(x / g)`, `x^ = e4m3(q) * g`.

use crate::{check_finite, check_global_scale, e4m3, Error, Result};

/// Quantizes without checking values. NaN becomes the E4M3 NaN code.
///
/// # Panics
/// If `x` and `out` differ in length.
pub fn quantize_unchecked(x: &[f32], g: f32, out: &mut [u8]) {
    assert_eq!(x.len(), out.len(), "FP8 output length");
    for (q, v) in out.iter_mut().zip(x) {
        *q = e4m3::encode(v / g);
    }
}

/// Dequantizes without checks.
///
/// # Panics
/// If `q` and `out` differ in length.
pub fn dequantize_unchecked(q: &[u8], g: f32, out: &mut [f32]) {
    assert_eq!(q.len(), out.len(), "FP8 output length");
    for (x, code) in out.iter_mut().zip(q) {
        *x = e4m3::decode(*code) * g;
    }
}

fn check_lengths(values: usize, bytes: usize) -> Result<()> {
    if values == bytes {
        Ok(())
    } else {
        Err(Error::BadLength {
            what: "FP8 bytes",
            expected: values,
            actual: bytes,
        })
    }
}

/// Checked quantize: rejects a bad global scale, a length mismatch and non-finite values.
pub fn quantize(x: &[f32], g: f32, out: &mut [u8]) -> Result<()> {
    check_global_scale(g)?;
    check_lengths(x.len(), out.len())?;
    check_finite(x)?;
    quantize_unchecked(x, g, out);
    Ok(())
}

/// Checked dequantize: rejects a bad global scale, a length mismatch and NaN codes.
pub fn dequantize(q: &[u8], g: f32, out: &mut [f32]) -> Result<()> {
    check_global_scale(g)?;
    check_lengths(out.len(), q.len())?;
    if let Some(index) = q.iter().position(|&c| c & 0x7F == e4m3::NAN_CODE) {
        return Err(Error::NonFinite {
            index,
            value: f32::NAN,
        });
    }
    dequantize_unchecked(q, g, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_divides_then_multiplies() {
        let x = [0.0, 1.0, -3.0, 900.0, 1e-4];
        let mut q = [0u8; 5];
        quantize(&x, 2.0, &mut q).unwrap();
        let mut y = [0.0f32; 5];
        dequantize(&q, 2.0, &mut y).unwrap();
        assert_eq!(y, [0.0, 1.0, -3.0, 896.0, 0.0]);
    }

    #[test]
    fn rejects_non_finite_and_bad_scale() {
        let mut q = [0u8; 3];
        let err = quantize(&[1.0, f32::INFINITY, 0.0], 1.0, &mut q).unwrap_err();
        assert_eq!(err.to_string(), "value at index 1 is not finite (inf)");
        assert!(quantize(&[1.0, 2.0, 3.0], 0.0, &mut q).is_err());
        assert!(quantize(&[1.0, 2.0], 1.0, &mut q).is_err());
        assert_eq!(q, [0, 0, 0], "nothing written on error");
    }

    /// Re-encoding with the scale a byte was decoded with gives the byte back, for every code
    /// (the NaN codes keep their sign) and any scale in [2^-100, 2^100]: the CUDA extend
    /// gather copies an fp8 cache's bytes on this ground (`kv_gather_work`) where the CPU
    /// decodes and encodes them.
    #[test]
    fn reencoding_with_the_same_scale_is_the_identity() {
        let mut scales = vec![
            2f32.powi(-100),
            2f32.powi(100),
            1.0,
            0.37,
            1.9,
            6.0,
            1e-3,
            3e7,
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // log2(g) uniform in [-100, 100]
            let t = (state >> 11) as f64 / (1u64 << 53) as f64;
            scales.push(2f64.powf(-100.0 + 200.0 * t) as f32);
        }
        let codes: Vec<u8> = (0..=255).collect();
        let (mut x, mut back) = (vec![0f32; 256], vec![0u8; 256]);
        for g in scales {
            dequantize_unchecked(&codes, g, &mut x);
            quantize_unchecked(&x, g, &mut back);
            for (c, b) in codes.iter().zip(&back) {
                assert_eq!(b, c, "code {c:#04x}, scale {g:e}");
            }
        }
    }
}
