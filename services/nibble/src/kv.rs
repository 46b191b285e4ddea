//! `nibble kv encode` and `nibble kv decode`: files to and from the interchange layout of
//! [`nibble_kvfmt::interchange`].
//!
//! Inputs are checked before any output is produced: the length must be a whole number of head
//! vectors (D little-endian f32 for encode, `dtype.vector_bytes(D)` for decode), f32 values must
//! be finite and encoded scales must not be NaN codes. Errors name the input file and the index of
//! the first bad value. Outputs are written with [`files::write_atomically`].

use std::path::Path;

use nibble_kvfmt::interchange::{self, check_head_dim};
use nibble_kvfmt::{check_global_scale, KvDtype};

use crate::{files, Error, Result};

/// Bytes of one f32 value in a file.
const F32_BYTES: usize = 4;

/// A validated choice of dtype, head dim and global scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Codec {
    dtype: KvDtype,
    head_dim: usize,
    global_scale: f32,
}

impl Codec {
    /// Checks that `head_dim` is a positive multiple of 16 (at most 1024) and the global scale is
    /// finite and positive.
    pub fn new(dtype: KvDtype, head_dim: usize, global_scale: f32) -> Result<Self> {
        check_head_dim(head_dim)?;
        check_global_scale(global_scale)?;
        Ok(Self {
            dtype,
            head_dim,
            global_scale,
        })
    }

    /// Encodes little-endian f32 bytes read from `path` into the interchange layout.
    pub fn encode_bytes(&self, path: &Path, input: &[u8]) -> Result<Vec<u8>> {
        let unit = self.head_dim * F32_BYTES;
        if !input.len().is_multiple_of(unit) {
            return Err(Error::Length {
                path: path.to_path_buf(),
                len: input.len(),
                unit,
                what: format!("one head vector of {} f32 values", self.head_dim),
            });
        }
        let values: Vec<f32> = input
            .chunks_exact(F32_BYTES)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        interchange::encode(self.dtype, self.head_dim, self.global_scale, &values).map_err(|e| {
            match e {
                nibble_kvfmt::Error::NonFinite { index, value } => Error::NonFinite {
                    path: path.to_path_buf(),
                    index,
                    value,
                },
                source => Error::Format {
                    path: path.to_path_buf(),
                    source,
                },
            }
        })
    }

    /// Decodes interchange bytes read from `path` into little-endian f32 bytes.
    pub fn decode_bytes(&self, path: &Path, input: &[u8]) -> Result<Vec<u8>> {
        let unit = self.dtype.vector_bytes(self.head_dim);
        if !input.len().is_multiple_of(unit) {
            return Err(Error::Length {
                path: path.to_path_buf(),
                len: input.len(),
                unit,
                what: format!("one {} head vector of {} values", self.dtype, self.head_dim),
            });
        }
        let values = interchange::decode(self.dtype, self.head_dim, self.global_scale, input)
            .map_err(|e| match e {
                nibble_kvfmt::Error::NonFinite { index, .. } => Error::NanCode {
                    path: path.to_path_buf(),
                    index,
                },
                source => Error::Format {
                    path: path.to_path_buf(),
                    source,
                },
            })?;
        Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// `nibble kv encode`: reads f32 values from `input`, writes their encoding to `output`.
pub fn encode_file(codec: &Codec, input: &Path, output: &Path) -> Result<()> {
    let bytes = files::read(input)?;
    let encoded = codec.encode_bytes(input, &bytes)?;
    files::write_atomically(output, &encoded)
}

/// `nibble kv decode`: reads encoded vectors from `input`, writes f32 values to `output`.
pub fn decode_file(codec: &Codec, input: &Path, output: &Path) -> Result<()> {
    let bytes = files::read(input)?;
    let decoded = codec.decode_bytes(input, &bytes)?;
    files::write_atomically(output, &decoded)
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn sample(len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
            .collect()
    }

    #[test]
    fn matches_the_library_byte_for_byte() {
        let x = sample(192);
        let path = Path::new("x.f32");
        for dtype in KvDtype::ALL {
            let codec = Codec::new(dtype, 64, 0.5).expect("valid codec");
            let encoded = codec.encode_bytes(path, &f32_bytes(&x)).expect("encodes");
            let expected = interchange::encode(dtype, 64, 0.5, &x).expect("library encodes");
            assert_eq!(encoded, expected, "{dtype}");
            let decoded = codec.decode_bytes(path, &encoded).expect("decodes");
            let expected = interchange::decode(dtype, 64, 0.5, &expected).expect("library decodes");
            assert_eq!(decoded, f32_bytes(&expected), "{dtype}");
        }
    }

    #[test]
    fn rejects_bad_codec_parameters() {
        let err = Codec::new(KvDtype::Nvfp4, 24, 1.0).expect_err("24 is not a multiple of 16");
        assert_eq!(
            err.to_string(),
            "head dim must be a positive multiple of 16, got 24"
        );
        assert!(Codec::new(KvDtype::Fp8, 0, 1.0).is_err());
        assert!(Codec::new(KvDtype::Fp8, 64, f32::NAN).is_err());
        assert!(Codec::new(KvDtype::Fp8, 64, -1.0).is_err());
    }

    #[test]
    fn length_errors_name_file_and_unit() {
        let codec = Codec::new(KvDtype::Nvfp4, 64, 1.0).expect("valid codec");
        let err = codec
            .encode_bytes(Path::new("in.f32"), &[0u8; 300])
            .expect_err("300 is not a multiple of 256");
        assert_eq!(
            err.to_string(),
            "in.f32: length 300 bytes is not a multiple of 256 bytes \
             (one head vector of 64 f32 values)"
        );
        let err = codec
            .decode_bytes(Path::new("in.bin"), &[0u8; 40])
            .expect_err("40 is not a multiple of 36");
        assert_eq!(
            err.to_string(),
            "in.bin: length 40 bytes is not a multiple of 36 bytes \
             (one nvfp4 head vector of 64 values)"
        );
    }

    #[test]
    fn non_finite_input_is_located() {
        let mut x = sample(64);
        x[37] = f32::NAN;
        let codec = Codec::new(KvDtype::Fp8, 32, 1.0).expect("valid codec");
        let err = codec
            .encode_bytes(Path::new("in.f32"), &f32_bytes(&x))
            .expect_err("NaN input");
        assert_eq!(
            err.to_string(),
            "in.f32: value 37 (byte offset 148) is not finite (NaN)"
        );
    }

    #[test]
    fn nan_codes_are_located() {
        let codec = Codec::new(KvDtype::Nvfp4, 16, 1.0).expect("valid codec");
        // Two vectors of 9 bytes; the second one's scale (byte 17) is the NaN code.
        let mut bytes = [0u8; 18];
        bytes[17] = 0x7F;
        let err = codec
            .decode_bytes(Path::new("in.bin"), &bytes)
            .expect_err("NaN scale");
        assert_eq!(
            err.to_string(),
            "in.bin: byte 17 is an E4M3 NaN code, which no encoder writes"
        );
    }

    #[test]
    fn failed_encode_leaves_existing_output_untouched() {
        let dir = tempfile::tempdir().expect("temp dir");
        let input = dir.path().join("in.f32");
        let output = dir.path().join("out.bin");
        fs::write(&input, f32_bytes(&[1.0, f32::INFINITY])).expect("write input");
        fs::write(&output, b"old").expect("write old output");
        let codec = Codec::new(KvDtype::Bf16, 16, 1.0).expect("valid codec");
        assert!(encode_file(&codec, &input, &output).is_err());
        assert_eq!(fs::read(&output).expect("still there"), b"old");
    }

    #[test]
    fn files_round_trip() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (input, encoded, decoded) = (
            dir.path().join("in.f32"),
            dir.path().join("kv.bin"),
            dir.path().join("out.f32"),
        );
        let x = sample(128);
        fs::write(&input, f32_bytes(&x)).expect("write input");
        let codec = Codec::new(KvDtype::Bf16, 32, 1.0).expect("valid codec");
        encode_file(&codec, &input, &encoded).expect("encode");
        decode_file(&codec, &encoded, &decoded).expect("decode");
        assert_eq!(fs::metadata(&encoded).expect("encoded").len(), 256);
        let y = fs::read(&decoded).expect("decoded");
        assert_eq!(y.len(), x.len() * 4);
        let back = interchange::decode(KvDtype::Bf16, 32, 1.0, &fs::read(&encoded).expect("kv"))
            .expect("library decodes");
        assert_eq!(y, f32_bytes(&back));
    }
}
