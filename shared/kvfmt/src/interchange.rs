//! The interchange layout of `nibble kv encode/decode` and of test fixtures: a flat sequence of
//! head vectors of D values each, every vector encoded on its own.
//!
//! * nvfp4: D/2 packed bytes, then D/16 scale bytes;
//! * fp8: D bytes;
//! * bf16: D little-endian u16.
//!
//! The global scale is not stored in the file; the reader passes the same one it was written with.

use crate::{bf16, check_finite, check_global_scale, fp8, nvfp4, Error, KvDtype, Result};

/// Largest head dimension nibble accepts.
pub const MAX_HEAD_DIM: usize = 1024;

/// Checks that `head_dim` is a positive multiple of 16, at most [`MAX_HEAD_DIM`].
pub fn check_head_dim(head_dim: usize) -> Result<()> {
    if head_dim == 0 || !head_dim.is_multiple_of(nvfp4::BLOCK) {
        return Err(Error::BadHeadDim {
            head_dim,
            multiple: nvfp4::BLOCK,
        });
    }
    if head_dim > MAX_HEAD_DIM {
        return Err(Error::BadGeometry {
            what: "head dim",
            value: head_dim,
            max: MAX_HEAD_DIM,
        });
    }
    Ok(())
}

/// Encodes `values` (whole head vectors of `head_dim`) into the interchange layout.
///
/// Fails, naming the problem, on a bad head dim or global scale, a length that is not whole
/// vectors, or a non-finite value (by its index in `values`).
pub fn encode(dtype: KvDtype, head_dim: usize, g: f32, values: &[f32]) -> Result<Vec<u8>> {
    check_head_dim(head_dim)?;
    check_global_scale(g)?;
    if !values.len().is_multiple_of(head_dim) {
        return Err(Error::BadLength {
            what: "values (whole head vectors)",
            expected: values.len().next_multiple_of(head_dim),
            actual: values.len(),
        });
    }
    check_finite(values)?;
    let vectors = values.len() / head_dim;
    let vector_bytes = dtype.vector_bytes(head_dim);
    let mut out = vec![0u8; vectors * vector_bytes];
    for (x, bytes) in values
        .chunks_exact(head_dim)
        .zip(out.chunks_exact_mut(vector_bytes))
    {
        match dtype {
            KvDtype::Nvfp4 => {
                let (packed, scales) = bytes.split_at_mut(head_dim / 2);
                nvfp4::quantize_unchecked(x, g, packed, scales);
            }
            KvDtype::Fp8 => fp8::quantize_unchecked(x, g, bytes),
            KvDtype::Bf16 => bf16::encode_le(x, bytes),
        }
    }
    Ok(out)
}

/// Decodes the interchange layout back to f32 values.
///
/// Fails on a bad head dim or global scale, a length that is not whole vectors, or an encoded
/// NaN (by its byte index).
pub fn decode(dtype: KvDtype, head_dim: usize, g: f32, bytes: &[u8]) -> Result<Vec<f32>> {
    check_head_dim(head_dim)?;
    check_global_scale(g)?;
    let vector_bytes = dtype.vector_bytes(head_dim);
    if !bytes.len().is_multiple_of(vector_bytes) {
        return Err(Error::BadLength {
            what: "encoded bytes (whole head vectors)",
            expected: bytes.len().next_multiple_of(vector_bytes),
            actual: bytes.len(),
        });
    }
    let vectors = bytes.len() / vector_bytes;
    let mut out = vec![0.0f32; vectors * head_dim];
    for (v, (x, chunk)) in out
        .chunks_exact_mut(head_dim)
        .zip(bytes.chunks_exact(vector_bytes))
        .enumerate()
    {
        let base = v * vector_bytes;
        let at = |e: Error| match e {
            Error::NonFinite { index, value } => Error::NonFinite {
                index: base + index,
                value,
            },
            other => other,
        };
        match dtype {
            KvDtype::Nvfp4 => {
                let (packed, scales) = chunk.split_at(head_dim / 2);
                nvfp4::dequantize(packed, scales, g, x).map_err(|e| match e {
                    Error::NonFinite { index, value } => Error::NonFinite {
                        index: base + head_dim / 2 + index,
                        value,
                    },
                    other => other,
                })?;
            }
            KvDtype::Fp8 => fp8::dequantize(chunk, g, x).map_err(at)?,
            KvDtype::Bf16 => bf16::decode_le(chunk, x),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_per_dtype() {
        let x: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) / 7.0).collect();
        assert_eq!(encode(KvDtype::Nvfp4, 64, 1.0, &x).unwrap().len(), 2 * 36);
        assert_eq!(encode(KvDtype::Fp8, 64, 1.0, &x).unwrap().len(), 128);
        assert_eq!(encode(KvDtype::Bf16, 64, 1.0, &x).unwrap().len(), 256);
    }

    #[test]
    fn nvfp4_vector_is_packed_then_scales() {
        let mut x = vec![0.0f32; 32];
        x[0] = 6.0;
        x[16] = 12.0;
        let bytes = encode(KvDtype::Nvfp4, 32, 1.0, &x).unwrap();
        assert_eq!(bytes.len(), 18);
        assert_eq!(bytes[0], 0x07);
        assert_eq!(bytes[8], 0x07);
        assert_eq!(
            &bytes[16..],
            &[0x38, 0x40],
            "scales 1.0 and 2.0 after the data"
        );
        let back = decode(KvDtype::Nvfp4, 32, 1.0, &bytes).unwrap();
        assert_eq!(back, x);
    }

    #[test]
    fn round_trip_all_dtypes() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
            .collect();
        for dtype in KvDtype::ALL {
            let bytes = encode(dtype, 64, 0.5, &x).unwrap();
            let y = decode(dtype, 64, 0.5, &bytes).unwrap();
            assert_eq!(y.len(), x.len());
            let worst = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b).abs() / a.abs().max(1.0))
                .fold(0.0f32, f32::max);
            let tolerance = match dtype {
                KvDtype::Bf16 => 0.004,
                KvDtype::Fp8 => 0.07,
                KvDtype::Nvfp4 => 0.5,
            };
            assert!(worst <= tolerance, "{dtype}: worst relative error {worst}");
        }
    }

    #[test]
    fn errors_name_the_problem() {
        let x = vec![1.0f32; 48];
        assert_eq!(
            encode(KvDtype::Nvfp4, 24, 1.0, &x).unwrap_err().to_string(),
            "head dim must be a positive multiple of 16, got 24"
        );
        assert_eq!(
            encode(KvDtype::Fp8, 32, 1.0, &x).unwrap_err().to_string(),
            "values (whole head vectors): expected 64 bytes or values, got 48"
        );
        let mut bad = x.clone();
        bad[40] = f32::NEG_INFINITY;
        assert_eq!(
            encode(KvDtype::Bf16, 16, 1.0, &bad)
                .unwrap_err()
                .to_string(),
            "value at index 40 is not finite (-inf)"
        );
        assert!(decode(KvDtype::Nvfp4, 16, 1.0, &[0u8; 10]).is_err());
        let err = decode(KvDtype::Nvfp4, 16, 1.0, &[0, 0, 0, 0, 0, 0, 0, 0, 0x7F]).unwrap_err();
        assert_eq!(err.to_string(), "value at index 8 is not finite (NaN)");
    }
}
