//! Weight precision of the CUDA backend: the type `upload_weight` stores matrices in, the host
//! rounding to BF16 and the cuBLAS BF16 GEMM.
//!
//! * [`WeightPrecision::Bf16`] (the default): every matrix of `upload_weight` (the projections,
//!   the embedding table, the LM head) is dequantized on the host with the engine's GGML
//!   decoders, rounded to BF16 on the host ([`to_bf16`]: round to nearest even, NaN stays NaN,
//!   overflow goes to ±inf, as `nibble_kvfmt::bf16::encode`) and only the 2-byte codes are
//!   uploaded: no f32 copy of a weight ever exists on the device. `matmul_t` casts its f32
//!   activations to BF16 (`f32_to_bf16` of `cu/ops.cu`, the same rounding) and calls
//!   `cublasGemmEx` with BF16 A and B, an f32 C and `CUBLAS_COMPUTE_32F` (cuBLAS has no
//!   BF16 × f32 mixed-input GEMM). Vectors (norms, biases) stay f32.
//! * [`WeightPrecision::F32`]: weights stay f32 and `matmul_t` is SGEMM, bit-for-bit the values
//!   of the CPU backend's weights (the parity checks use it).

use std::env::VarError;

use cudarc::cublas::result::{gemm_ex, CublasError};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use crate::{Error, Result};

/// The environment variable [`WeightPrecision::from_env`] reads.
pub const WEIGHTS_ENV: &str = "NIBBLE_CUDA_WEIGHTS";

/// How the CUDA backend stores weight matrices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightPrecision {
    /// BF16 codes, multiplied by cuBLAS `GemmEx` (half the bytes of f32 per decode step).
    #[default]
    Bf16,
    /// f32, multiplied by cuBLAS SGEMM or the tiled kernel.
    F32,
}

impl WeightPrecision {
    /// "bf16" or "f32".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F32 => "f32",
        }
    }

    /// Parses "bf16" or "f32" (exactly).
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "bf16" => Some(Self::Bf16),
            "f32" => Some(Self::F32),
            _ => None,
        }
    }

    /// `NIBBLE_CUDA_WEIGHTS`: unset is the default (BF16); any value but "bf16" or "f32" is an
    /// error that names the variable.
    pub fn from_env() -> Result<Self> {
        Self::from_var(std::env::var(WEIGHTS_ENV))
    }

    fn from_var(var: std::result::Result<String, VarError>) -> Result<Self> {
        let value = match var {
            Err(VarError::NotPresent) => return Ok(Self::default()),
            Ok(v) => v,
            Err(VarError::NotUnicode(v)) => v.to_string_lossy().into_owned(),
        };
        Self::parse(&value).ok_or(Error::InvalidEnv {
            var: WEIGHTS_ENV,
            value,
            expected: "bf16 or f32",
        })
    }
}

/// `values` rounded to BF16 codes (round to nearest, ties to even; NaN stays a quiet NaN of the
/// same sign; finite values beyond the BF16 range become ±inf).
pub(crate) fn to_bf16(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| nibble_kvfmt::bf16::encode(v))
        .collect()
}

/// Shapes of one BF16 GEMM: row-major `out[n][m] = x[n][k] · w[m][k]ᵀ`.
pub(crate) struct Bf16Gemm {
    pub n: usize,
    pub m: usize,
    pub k: usize,
}

impl Bf16Gemm {
    /// Runs the GEMM on `stream` (the stream `blas` was created on). `w` holds `m * k` BF16
    /// codes, `x` `n * k` BF16 codes, `out` `n * m` f32 values; f32 accumulation.
    ///
    /// # Safety
    /// The buffers must hold at least the values above.
    pub unsafe fn run(
        &self,
        blas: &CudaBlas,
        stream: &CudaStream,
        w: &impl DevicePtr<u16>,
        x: &impl DevicePtr<u16>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> std::result::Result<(), CublasError> {
        let (n, m, k) = (self.n as i32, self.m as i32, self.k as i32);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (w, _w) = w.device_ptr(stream);
        let (x, _x) = x.device_ptr(stream);
        let (out, _out) = out.device_ptr_mut(stream);
        // Column-major, as the SGEMM path: outᵀ (m × n) = wᵀ (w read as k × m, transposed) · xᵀ.
        gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            m,
            n,
            k,
            (&alpha) as *const f32 as *const _,
            w as *const _,
            cudaDataType::CUDA_R_16BF,
            k,
            x as *const _,
            cudaDataType::CUDA_R_16BF,
            k,
            (&beta) as *const f32 as *const _,
            out as *mut _,
            cudaDataType::CUDA_R_32F,
            m,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(bits: u16) -> f32 {
        f32::from_bits(u32::from(bits) << 16)
    }

    #[test]
    fn rounds_to_nearest_with_ties_to_even() {
        let one = 1.0f32;
        let ulp = 1.0 / 128.0; // BF16 spacing in [1, 2)
        let got = to_bf16(&[
            one + ulp / 2.0,       // halfway, 1 is even: down
            one + 3.0 * ulp / 2.0, // halfway, 1 + 2ulp is even: up
            one + ulp / 2.0 + 1e-6,
            -(one + ulp / 2.0 + 1e-6),
            one + ulp / 4.0,
        ]);
        let want = [one, one + 2.0 * ulp, one + ulp, -(one + ulp), one];
        for (g, w) in got.iter().zip(want) {
            assert_eq!(decode(*g), w);
        }
        // Exact BF16 values pass through unchanged: signed zeros, a subnormal.
        for x in [
            0.0f32,
            -0.0,
            1.5,
            -2f32.powi(-70),
            65280.0,
            f32::from_bits(0x0001_0000),
        ] {
            assert_eq!(decode(to_bf16(&[x])[0]).to_bits(), x.to_bits());
        }
    }

    #[test]
    fn keeps_nan_and_infinities() {
        let got = to_bf16(&[
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7F80_0001), // signalling NaN whose payload is below bit 16
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
        ]);
        assert!(decode(got[0]).is_nan() && decode(got[0]).is_sign_positive());
        assert!(decode(got[1]).is_nan() && decode(got[1]).is_sign_negative());
        assert!(decode(got[2]).is_nan(), "a NaN must not round to infinity");
        assert_eq!(decode(got[3]), f32::INFINITY);
        assert_eq!(decode(got[4]), f32::NEG_INFINITY);
        assert_eq!(decode(got[5]), f32::INFINITY, "overflow rounds to inf");
        assert_eq!(decode(got[6]), f32::NEG_INFINITY);
    }

    #[test]
    fn parses_the_env_value_strictly() {
        let from = |v: &str| WeightPrecision::from_var(Ok(v.to_string()));
        assert_eq!(
            WeightPrecision::from_var(Err(VarError::NotPresent)).unwrap(),
            WeightPrecision::Bf16
        );
        assert_eq!(from("bf16").unwrap(), WeightPrecision::Bf16);
        assert_eq!(from("f32").unwrap(), WeightPrecision::F32);
        for bad in ["", "BF16", "fp32", "f16", " f32"] {
            let e = from(bad).unwrap_err().to_string();
            assert!(e.contains(WEIGHTS_ENV), "{e}");
        }
    }
}
