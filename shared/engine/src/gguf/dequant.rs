//! Dequantization of GGML block formats to f32.
//!
//! Each function takes exactly the bytes of a whole number of blocks and writes
//! `blocks * block_len` values; [`dequantize`] dispatches on the type and checks lengths.
//! Layouts (little-endian, per block):
//!
//! * Q8_0 (32 values, 34 bytes): f16 `d`, 32 × i8 `q`; `x = d·q`.
//! * Q4_0 (32 values, 18 bytes): f16 `d`, 16 bytes; byte j holds value j in its low nibble and
//!   value j+16 in its high nibble; `x = d·(nibble − 8)`.
//! * Q4_1 (32 values, 20 bytes): f16 `d`, f16 `m`, 16 bytes as Q4_0; `x = d·nibble + m`.
//! * Q5_0 (32 values, 22 bytes): f16 `d`, 4 bytes `qh` (a little-endian u32 whose bit j is the
//!   fifth bit of value j), 16 bytes of low nibbles laid out as Q4_0; with
//!   `q = nibble | bit << 4`, `x = d·(q − 16)`.
//! * Q5_1 (32 values, 24 bytes): f16 `d`, f16 `m`, then `qh` and nibbles as Q5_0;
//!   `x = d·q + m`.
//! * Q4_K (256 values, 144 bytes): f16 `d`, f16 `dmin`, 12 bytes packing eight 6-bit
//!   (scale, min) pairs, 128 bytes of nibbles. Sub-block s (32 values) has
//!   `x = d·scale_s·nibble − dmin·min_s`; each 64-value group reads 32 bytes, low nibbles
//!   first (sub-block 2g), then high nibbles (sub-block 2g+1).
//! * Q6_K (256 values, 210 bytes): 128 bytes `ql` (low 4 bits), 64 bytes `qh` (high 2 bits),
//!   16 × i8 scales (one per 16 values), f16 `d`; `x = d·scale·(q − 32)` with q 6-bit.

use super::types::GgmlType;
use half::{bf16, f16};

/// Dequantizes `bytes` of type `ty` into `out`. Returns `false` if the type is unsupported or
/// the lengths do not describe the same number of whole blocks.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> bool {
    let (Some(block_len), Some(block_bytes)) = (ty.block_len(), ty.block_bytes()) else {
        return false;
    };
    if !bytes.len().is_multiple_of(block_bytes)
        || !out.len().is_multiple_of(block_len)
        || bytes.len() / block_bytes != out.len() / block_len
    {
        return false;
    }
    match ty {
        GgmlType::F32 => f32_to_f32(bytes, out),
        GgmlType::F16 => f16_to_f32(bytes, out),
        GgmlType::Bf16 => bf16_to_f32(bytes, out),
        GgmlType::Q8_0 => q8_0(bytes, out),
        GgmlType::Q4_0 => q4_0(bytes, out),
        GgmlType::Q4_1 => q4_1(bytes, out),
        GgmlType::Q5_0 => q5_0(bytes, out),
        GgmlType::Q5_1 => q5_1(bytes, out),
        GgmlType::Q4K => q4_k(bytes, out),
        GgmlType::Q6K => q6_k(bytes, out),
        GgmlType::Other(_) => return false,
    }
    true
}

#[inline(always)]
fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// A block format: `B` bytes decode to `L` values. The decoders are the single definition of
/// each format's values; the CPU backend's quantized kernels inline them too (compiled with
/// wider vector features there), so both paths produce bit-identical weights.
pub(crate) trait Block<const B: usize, const L: usize> {
    /// Decodes one block.
    fn decode(blk: &[u8; B], out: &mut [f32; L]);
}

/// Decodes every whole block of `bytes` into consecutive `L`-value runs of `out`.
#[inline(always)]
pub(crate) fn each_block<const B: usize, const L: usize, F: Block<B, L>>(
    bytes: &[u8],
    out: &mut [f32],
) {
    for (blk, o) in bytes.chunks_exact(B).zip(out.chunks_exact_mut(L)) {
        F::decode(blk.try_into().unwrap(), o.try_into().unwrap());
    }
}

fn f32_to_f32(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

fn f16_to_f32(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
    }
}

fn bf16_to_f32(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
    }
}

fn q8_0(bytes: &[u8], out: &mut [f32]) {
    each_block::<34, 32, Q8_0>(bytes, out);
}

fn q4_0(bytes: &[u8], out: &mut [f32]) {
    each_block::<18, 32, Q4_0>(bytes, out);
}

fn q4_1(bytes: &[u8], out: &mut [f32]) {
    each_block::<20, 32, Q4_1>(bytes, out);
}

fn q5_0(bytes: &[u8], out: &mut [f32]) {
    each_block::<22, 32, Q5_0>(bytes, out);
}

fn q5_1(bytes: &[u8], out: &mut [f32]) {
    each_block::<24, 32, Q5_1>(bytes, out);
}

fn q4_k(bytes: &[u8], out: &mut [f32]) {
    each_block::<144, 256, Q4K>(bytes, out);
}

fn q6_k(bytes: &[u8], out: &mut [f32]) {
    each_block::<210, 256, Q6K>(bytes, out);
}

/// The Q8_0 block format.
pub(crate) struct Q8_0;

impl Block<34, 32> for Q8_0 {
    #[inline(always)]
    fn decode(blk: &[u8; 34], o: &mut [f32; 32]) {
        let d = half_at(blk, 0);
        for (x, &q) in o.iter_mut().zip(&blk[2..]) {
            *x = d * f32::from(q as i8);
        }
    }
}

/// The Q4_0 block format.
pub(crate) struct Q4_0;

impl Block<18, 32> for Q4_0 {
    #[inline(always)]
    fn decode(blk: &[u8; 18], o: &mut [f32; 32]) {
        let d = half_at(blk, 0);
        let (lo, hi) = o.split_at_mut(16);
        for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&blk[2..]) {
            *l = d * (f32::from(q & 0x0f) - 8.0);
            *h = d * (f32::from(q >> 4) - 8.0);
        }
    }
}

/// The Q4_1 block format.
pub(crate) struct Q4_1;

impl Block<20, 32> for Q4_1 {
    #[inline(always)]
    fn decode(blk: &[u8; 20], o: &mut [f32; 32]) {
        let d = half_at(blk, 0);
        let m = half_at(blk, 2);
        let (lo, hi) = o.split_at_mut(16);
        for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&blk[4..]) {
            *l = d * f32::from(q & 0x0f) + m;
            *h = d * f32::from(q >> 4) + m;
        }
    }
}

/// The 5-bit codes of a Q5_0/Q5_1 block from its `qh` word (bit j = fifth bit of value j) and
/// 16 nibble bytes (byte j: value j low, value j+16 high), in value order. Both formats share
/// this packing and differ only in how a code becomes a value.
#[inline(always)]
fn q5_codes(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let bit = |j: usize| (((qh >> j) & 1) as u8) << 4;
    let mut codes = [0u8; 32];
    for (j, &q) in qs.iter().take(16).enumerate() {
        codes[j] = (q & 0x0f) | bit(j);
        codes[j + 16] = (q >> 4) | bit(j + 16);
    }
    codes
}

/// The Q5_0 block format.
pub(crate) struct Q5_0;

impl Block<22, 32> for Q5_0 {
    #[inline(always)]
    fn decode(blk: &[u8; 22], o: &mut [f32; 32]) {
        let d = half_at(blk, 0);
        for (x, q) in o.iter_mut().zip(q5_codes(&blk[2..6], &blk[6..])) {
            *x = d * (f32::from(q) - 16.0);
        }
    }
}

/// The Q5_1 block format.
pub(crate) struct Q5_1;

impl Block<24, 32> for Q5_1 {
    #[inline(always)]
    fn decode(blk: &[u8; 24], o: &mut [f32; 32]) {
        let d = half_at(blk, 0);
        let m = half_at(blk, 2);
        for (x, q) in o.iter_mut().zip(q5_codes(&blk[4..8], &blk[8..])) {
            *x = d * f32::from(q) + m;
        }
    }
}

/// The 6-bit (scale, min) of sub-block `j` (0..8) from Q4_K's 12 packed bytes: sub-blocks 0..4
/// use the low 6 bits of bytes j and j+4; sub-blocks 4..8 take their low 4 bits from byte j+4
/// and their top 2 bits from the spare top bits of bytes j−4 (scale) and j (min).
#[inline(always)]
fn q4_k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The Q4_K block format.
pub(crate) struct Q4K;

impl Block<144, 256> for Q4K {
    #[inline(always)]
    fn decode(blk: &[u8; 144], o: &mut [f32; 256]) {
        let d = half_at(blk, 0);
        let dmin = half_at(blk, 2);
        let scales = &blk[4..16];
        let qs = &blk[16..144];
        for g in 0..4 {
            let (sc0, m0) = q4_k_scale_min(2 * g, scales);
            let (sc1, m1) = q4_k_scale_min(2 * g + 1, scales);
            let (d0, min0) = (d * f32::from(sc0), dmin * f32::from(m0));
            let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
            let q = &qs[32 * g..32 * g + 32];
            let y = &mut o[64 * g..64 * g + 64];
            for l in 0..32 {
                y[l] = d0 * f32::from(q[l] & 0x0f) - min0;
                y[l + 32] = d1 * f32::from(q[l] >> 4) - min1;
            }
        }
    }
}

/// The Q6_K block format.
pub(crate) struct Q6K;

impl Block<210, 256> for Q6K {
    #[inline(always)]
    fn decode(blk: &[u8; 210], o: &mut [f32; 256]) {
        let d = half_at(blk, 208);
        for half in 0..2 {
            let ql = &blk[64 * half..64 * half + 64];
            let qh = &blk[128 + 32 * half..128 + 32 * half + 32];
            let sc = &blk[192 + 8 * half..192 + 8 * half + 8];
            let y = &mut o[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = i32::from((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
                let q2 = i32::from((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                let s = |k: usize| d * f32::from(sc[is + k] as i8);
                y[l] = s(0) * q1 as f32;
                y[l + 32] = s(2) * q2 as f32;
                y[l + 64] = s(4) * q3 as f32;
                y[l + 96] = s(6) * q4 as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests;
