//! Weight matrices kept as their GGUF quantized blocks ([`BlockMatrix`]), and decoding them.
//!
//! A matrix is `rows × cols` values stored row by row, each row a whole number of blocks of one
//! GGML type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K), byte for byte as in the file. Every
//! value is produced by the per-block decoders of [`crate::gguf::dequant`], the same functions
//! that dequantize a whole tensor to f32, so a kernel reading these blocks sees exactly the weights
//! the f32 path would have used; only its summation order may differ.
//!
//! Kernels are written once as plain Rust and compiled twice: for the baseline target and with
//! AVX2+FMA+F16C, chosen at run time through [`Isa`].

use crate::error::{Error, Result};
use crate::gguf::dequant::{each_block, Q4K, Q4_0, Q4_1, Q5_0, Q5_1, Q6K, Q8_0};
use crate::gguf::GgmlType;
use std::fmt;
use std::ops::Range;

/// Which compiled copy of a kernel runs; later variants need more CPU features.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Isa {
    /// Baseline target features (whatever LLVM vectorizes without extra features).
    Scalar,
    /// AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512F as well (the fused few-row kernels use it; the rest runs the AVX2 copies).
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The best copy this CPU can run.
    pub(super) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Self::Avx512;
            }
            return Self::Avx2;
        }
        Self::Scalar
    }

    /// Every copy this CPU can run, scalar first (tests check each).
    #[cfg(test)]
    pub(super) fn all() -> Vec<Self> {
        let best = Self::detect();
        [
            Self::Scalar,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2,
            #[cfg(target_arch = "x86_64")]
            Self::Avx512,
        ]
        .into_iter()
        .filter(|&isa| isa <= best)
        .collect()
    }
}

/// A weight matrix as GGML blocks, one row per output feature.
#[derive(Clone, PartialEq)]
pub struct BlockMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    bytes: Vec<u8>,
}

impl fmt::Debug for BlockMatrix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

impl BlockMatrix {
    /// Whether rows of `cols` values of type `ty` are kept as blocks: a quantized type the
    /// kernels read, and rows that are whole blocks.
    pub fn keeps(ty: GgmlType, cols: usize) -> bool {
        matches!(
            ty,
            GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q8_0
                | GgmlType::Q4K
                | GgmlType::Q6K
        ) && ty.block_len().is_some_and(|l| cols.is_multiple_of(l))
    }

    /// Copies `bytes`, a `rows × cols` matrix of `ty` blocks.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        if !Self::keeps(ty, cols) {
            return Err(Error::InvalidInput(format!(
                "{ty} rows of {cols} values cannot be kept as blocks"
            )));
        }
        let row_bytes = ty.bytes_for(cols as u64).unwrap_or(0) as usize;
        if rows.checked_mul(row_bytes) != Some(bytes.len()) {
            return Err(Error::InvalidInput(format!(
                "{} bytes do not make a {rows}x{cols} {ty} matrix",
                bytes.len()
            )));
        }
        Ok(Self {
            ty,
            rows,
            cols,
            row_bytes,
            bytes: bytes.to_vec(),
        })
    }

    /// The block type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes per row.
    pub(super) fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The blocks of rows `rows`.
    pub(super) fn row_blocks(&self, rows: Range<usize>) -> &[u8] {
        &self.bytes[rows.start * self.row_bytes..rows.end * self.row_bytes]
    }

    /// Dequantizes rows `rows` into `out` (`rows.len() * cols` values).
    pub(super) fn decode_rows(&self, isa: Isa, rows: Range<usize>, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            rows.len() * self.cols,
            "decode_rows: output length"
        );
        let bytes = self.row_blocks(rows);
        match isa {
            Isa::Scalar => decode_generic(self.ty, bytes, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: these are only chosen when the CPU has AVX2, FMA and F16C.
            Isa::Avx2 | Isa::Avx512 => unsafe { decode_avx2(self.ty, bytes, out) },
        }
    }
}

#[inline(always)]
fn decode_generic(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::Q8_0 => each_block::<34, 32, Q8_0>(bytes, out),
        GgmlType::Q4_0 => each_block::<18, 32, Q4_0>(bytes, out),
        GgmlType::Q4_1 => each_block::<20, 32, Q4_1>(bytes, out),
        GgmlType::Q5_0 => each_block::<22, 32, Q5_0>(bytes, out),
        GgmlType::Q5_1 => each_block::<24, 32, Q5_1>(bytes, out),
        GgmlType::Q4K => each_block::<144, 256, Q4K>(bytes, out),
        GgmlType::Q6K => each_block::<210, 256, Q6K>(bytes, out),
        other => unreachable!("{other} is not kept as blocks"),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_avx2(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    decode_generic(ty, bytes, out)
}

/// Random bytes for `blocks` blocks of `ty`, with finite f16 scales.
#[cfg(test)]
pub(super) fn random_blocks(ty: GgmlType, blocks: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let bb = ty.block_bytes().unwrap();
    let mut bytes: Vec<u8> = (0..blocks * bb).map(|_| next() as u8).collect();
    // f16 fields: small normal scales of either sign (a random u16 could be inf/NaN).
    let scale_offsets: &[usize] = match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    for blk in bytes.chunks_exact_mut(bb) {
        for &o in scale_offsets {
            let v = half::f16::from_f32((next() % 2000) as f32 / 1e5 - 0.01);
            blk[o..o + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::dequant::dequantize;

    #[test]
    fn decoding_is_bit_identical_to_dequantize() {
        let isas = Isa::all();
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ] {
            let (rows, cols) = (3, 2 * ty.block_len().unwrap());
            let bytes = random_blocks(ty, rows * 2, 7);
            let mut want = vec![0.0f32; rows * cols];
            assert!(dequantize(ty, &bytes, &mut want));
            let m = BlockMatrix::new(ty, rows, cols, &bytes).unwrap();
            for &isa in &isas {
                let mut got = vec![f32::NAN; 2 * cols];
                m.decode_rows(isa, 1..3, &mut got);
                let same = got
                    .iter()
                    .zip(&want[cols..])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{ty} {isa:?} differs from dequantize");
            }
        }
    }

    #[test]
    fn rejects_partial_blocks_and_plain_types() {
        assert!(!BlockMatrix::keeps(GgmlType::Q4_1, 48));
        assert!(!BlockMatrix::keeps(GgmlType::F16, 64));
        assert!(BlockMatrix::new(GgmlType::Q8_0, 2, 32, &[0; 34]).is_err());
        assert!(BlockMatrix::new(GgmlType::Q8_0, 1, 32, &[0; 34]).is_ok());
    }
}
