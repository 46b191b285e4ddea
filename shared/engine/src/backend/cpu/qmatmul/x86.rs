//! Fused decode-and-dot of 32-value blocks (Q4_0, Q4_1, Q8_0) with x86 intrinsics, in two
//! widths: AVX2 (a block is four vectors of eight) and AVX-512 (two vectors of sixteen).
//!
//! Each decoded value is the exact product `d·q` (plus `m` for Q4_1, added by one FMA whose
//! product is exact: an f16 scale has 11 significant bits and `q` at most 8), so it is the f32
//! that [`crate::gguf::dequant`] computes. A block is decoded once per group of up to eight
//! input rows, and its vectors are multiplied into running sums kept in registers.

use super::Task;
use crate::gguf::GgmlType;
use std::arch::x86_64::*;

/// How far ahead of the current block the weight row is requested from memory (a hint:
/// addresses past the row's end are harmless).
const PREFETCH_BYTES: usize = 1024;

/// Whether `ty` has a fused kernel here.
pub(super) fn fused(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// Runs the task with the AVX2 kernel of its block type.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `fused(task.w.ty())`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_avx2(task: Task<'_>) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match task.w.ty() {
            GgmlType::Q8_0 => rows_of::<avx2::Ymm<avx2::Q8_0>>(task),
            GgmlType::Q4_0 => rows_of::<avx2::Ymm<avx2::Q4_0>>(task),
            GgmlType::Q4_1 => rows_of::<avx2::Ymm<avx2::Q4_1>>(task),
            other => unreachable!("no fused kernel for {other}"),
        }
    }
}

/// Runs the task with the AVX-512 kernel of its block type.
///
/// # Safety
/// The CPU has AVX-512F, AVX2, FMA and F16C; `fused(task.w.ty())`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn rows_avx512(task: Task<'_>) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match task.w.ty() {
            GgmlType::Q8_0 => rows_of::<avx512::Zmm<avx512::Q8_0>>(task),
            GgmlType::Q4_0 => rows_of::<avx512::Zmm<avx512::Q4_0>>(task),
            GgmlType::Q4_1 => rows_of::<avx512::Zmm<avx512::Q4_1>>(task),
            other => unreachable!("no fused kernel for {other}"),
        }
    }
}

/// A block format's fused kernel at one vector width.
trait Kernel {
    /// `dot(decode(wrow), x[r])` for the `R` rows of `k` values at `x`, with `A` running sums
    /// per row (more when few rows leave registers free: independent FMA chains hide latency).
    ///
    /// # Safety
    /// `wrow` holds `k / 32` blocks, `x` points at `R·k` values, and the CPU has the kernel's
    /// features.
    unsafe fn dot<const R: usize, const A: usize>(wrow: &[u8], x: *const f32, k: usize)
        -> [f32; R];
}

/// Every weight row of the task against the input rows: eight at a time, then four, two, one,
/// so a block is decoded once per group of rows and the running sums fit in registers.
///
/// # Safety
/// The CPU has `K`'s features, and `K` decodes the task's block type.
#[inline(always)]
unsafe fn rows_of<K: Kernel>(task: Task<'_>) {
    let (k, n) = (task.w.cols(), task.n);
    let rows = task.w.row_blocks(task.j0..task.j0 + task.count);
    for (jj, wrow) in rows.chunks_exact(task.w.row_bytes()).enumerate() {
        let j = task.j0 + jj;
        let x = |i: usize, r: usize| task.x[i * k..(i + r) * k].as_ptr();
        let mut i = 0;
        // SAFETY (all calls): `wrow` is whole blocks of k values; `x(i, R)` holds R·k values;
        // i + r < n; j is this task's row; the caller has the features.
        unsafe {
            while i + 8 <= n {
                task.put_all(i, j, &K::dot::<8, 1>(wrow, x(i, 8), k));
                i += 8;
            }
            if i + 4 <= n {
                task.put_all(i, j, &K::dot::<4, 2>(wrow, x(i, 4), k));
                i += 4;
            }
            if i + 2 <= n {
                task.put_all(i, j, &K::dot::<2, 4>(wrow, x(i, 2), k));
                i += 2;
            }
            if i < n {
                task.put_all(i, j, &K::dot::<1, 4>(wrow, x(i, 1), k));
            }
        }
    }
}

/// The f16 at `p` as f32.
///
/// # Safety
/// Two readable bytes at `p`; the CPU has F16C.
#[inline(always)]
unsafe fn half(p: *const u8) -> f32 {
    // SAFETY: per the caller.
    unsafe {
        let bits = i32::from(u16::from_le_bytes([*p, *p.add(1)]));
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
    }
}

/// The low and high nibbles of the 16 bytes at `p`: values 0..16 and 16..32 of a 4-bit block.
///
/// # Safety
/// 16 readable bytes at `p`; the CPU has SSE2.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> [__m128i; 2] {
    // SAFETY: per the caller.
    unsafe {
        let raw = _mm_loadu_si128(p as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        [
            _mm_and_si128(raw, mask),
            _mm_and_si128(_mm_srli_epi16::<4>(raw), mask),
        ]
    }
}

mod avx2 {
    use super::{half, nibbles, Kernel, PREFETCH_BYTES};
    use std::arch::x86_64::*;
    use std::marker::PhantomData;

    /// A block as four vectors of eight values.
    pub(super) trait Decode {
        const BYTES: usize;
        /// # Safety
        /// `BYTES` readable bytes at `p`; AVX2, FMA and F16C.
        unsafe fn decode(p: *const u8) -> [__m256; 4];
    }

    /// Bytes 0..8 and 8..16 of `v` widened to f32 (exact).
    #[inline(always)]
    unsafe fn widen_u8(v: __m128i) -> [__m256; 2] {
        // SAFETY: AVX2 per the caller.
        unsafe {
            [
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v))),
            ]
        }
    }

    pub(super) struct Q8_0;

    impl Decode for Q8_0 {
        const BYTES: usize = 34;
        #[inline(always)]
        unsafe fn decode(p: *const u8) -> [__m256; 4] {
            // SAFETY: per the caller.
            unsafe {
                let d = _mm256_set1_ps(half(p));
                let q = |i: usize| {
                    let b = _mm_loadl_epi64(p.add(2 + 8 * i) as *const __m128i);
                    _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)))
                };
                [q(0), q(1), q(2), q(3)]
            }
        }
    }

    pub(super) struct Q4_0;

    impl Decode for Q4_0 {
        const BYTES: usize = 18;
        #[inline(always)]
        unsafe fn decode(p: *const u8) -> [__m256; 4] {
            // SAFETY: per the caller.
            unsafe {
                let d = _mm256_set1_ps(half(p));
                let eight = _mm256_set1_ps(8.0);
                let [lo, hi] = nibbles(p.add(2));
                let [a, b] = widen_u8(lo);
                let [c, e] = widen_u8(hi);
                let v = |q: __m256| _mm256_mul_ps(d, _mm256_sub_ps(q, eight));
                [v(a), v(b), v(c), v(e)]
            }
        }
    }

    pub(super) struct Q4_1;

    impl Decode for Q4_1 {
        const BYTES: usize = 20;
        #[inline(always)]
        unsafe fn decode(p: *const u8) -> [__m256; 4] {
            // SAFETY: per the caller.
            unsafe {
                let d = _mm256_set1_ps(half(p));
                let m = _mm256_set1_ps(half(p.add(2)));
                let [lo, hi] = nibbles(p.add(4));
                let [a, b] = widen_u8(lo);
                let [c, e] = widen_u8(hi);
                let v = |q: __m256| _mm256_fmadd_ps(d, q, m);
                [v(a), v(b), v(c), v(e)]
            }
        }
    }

    /// The AVX2 kernel of block format `F`.
    pub(super) struct Ymm<F>(PhantomData<F>);

    impl<F: Decode> Kernel for Ymm<F> {
        #[inline(always)]
        unsafe fn dot<const R: usize, const A: usize>(
            wrow: &[u8],
            x: *const f32,
            k: usize,
        ) -> [f32; R] {
            // SAFETY: per the caller.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); A]; R];
                let mut p = wrow.as_ptr();
                for c in (0..k).step_by(32) {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
                    let w = F::decode(p);
                    for (r, a) in acc.iter_mut().enumerate() {
                        let xr = x.add(r * k + c);
                        for (v, wv) in w.iter().enumerate() {
                            let xv = _mm256_loadu_ps(xr.add(8 * v));
                            a[v % A] = _mm256_fmadd_ps(*wv, xv, a[v % A]);
                        }
                    }
                    p = p.add(F::BYTES);
                }
                let mut out = [0.0f32; R];
                for (o, a) in out.iter_mut().zip(acc) {
                    let s = a[1..].iter().fold(a[0], |s, v| _mm256_add_ps(s, *v));
                    let h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
                    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                    *o = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<1>(h, h)));
                }
                out
            }
        }
    }
}

// AVX-512 intrinsics are stable since Rust 1.89, the workspace's `rust-version` (gemm's `x86-v4`
// kernels need it too).
mod avx512 {
    use super::{half, nibbles, Kernel, PREFETCH_BYTES};
    use std::arch::x86_64::*;
    use std::marker::PhantomData;

    /// A block as two vectors of sixteen values.
    pub(super) trait Decode {
        const BYTES: usize;
        /// # Safety
        /// `BYTES` readable bytes at `p`; AVX-512F, FMA and F16C.
        unsafe fn decode(p: *const u8) -> [__m512; 2];
    }

    pub(super) struct Q8_0;

    impl Decode for Q8_0 {
        const BYTES: usize = 34;
        #[inline(always)]
        unsafe fn decode(p: *const u8) -> [__m512; 2] {
            // SAFETY: per the caller.
            unsafe {
                let d = _mm512_set1_ps(half(p));
                let q = |i: usize| {
                    let b = _mm_loadu_si128(p.add(2 + 16 * i) as *const __m128i);
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)))
                };
                [q(0), q(1)]
            }
        }
    }

    pub(super) struct Q4_0;

    impl Decode for Q4_0 {
        const BYTES: usize = 18;
        #[inline(always)]
        unsafe fn decode(p: *const u8) -> [__m512; 2] {
            // SAFETY: per the caller.
            unsafe {
                let d = _mm512_set1_ps(half(p));
                let eight = _mm512_set1_ps(8.0);
                let v = |q: __m128i| {
                    let q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
                    _mm512_mul_ps(d, _mm512_sub_ps(q, eight))
                };
                let [lo, hi] = nibbles(p.add(2));
                [v(lo), v(hi)]
            }
        }
    }

    pub(super) struct Q4_1;

    impl Decode for Q4_1 {
        const BYTES: usize = 20;
        #[inline(always)]
        unsafe fn decode(p: *const u8) -> [__m512; 2] {
            // SAFETY: per the caller.
            unsafe {
                let d = _mm512_set1_ps(half(p));
                let m = _mm512_set1_ps(half(p.add(2)));
                let v =
                    |q: __m128i| _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), m);
                let [lo, hi] = nibbles(p.add(4));
                [v(lo), v(hi)]
            }
        }
    }

    /// The AVX-512 kernel of block format `F`.
    pub(super) struct Zmm<F>(PhantomData<F>);

    impl<F: Decode> Kernel for Zmm<F> {
        #[inline(always)]
        unsafe fn dot<const R: usize, const A: usize>(
            wrow: &[u8],
            x: *const f32,
            k: usize,
        ) -> [f32; R] {
            // SAFETY: per the caller.
            unsafe {
                let mut acc = [[_mm512_setzero_ps(); A]; R];
                let mut p = wrow.as_ptr();
                for c in (0..k).step_by(32) {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
                    let w = F::decode(p);
                    for (r, a) in acc.iter_mut().enumerate() {
                        let xr = x.add(r * k + c);
                        for (v, wv) in w.iter().enumerate() {
                            let xv = _mm512_loadu_ps(xr.add(16 * v));
                            a[v % A] = _mm512_fmadd_ps(*wv, xv, a[v % A]);
                        }
                        // With more sums than vectors, the next block feeds the others.
                        if A > 2 {
                            a.rotate_left(2);
                        }
                    }
                    p = p.add(F::BYTES);
                }
                let mut out = [0.0f32; R];
                for (o, a) in out.iter_mut().zip(acc) {
                    let s = a[1..].iter().fold(a[0], |s, v| _mm512_add_ps(s, *v));
                    *o = _mm512_reduce_add_ps(s);
                }
                out
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::blocks::random_blocks;
    use super::*;
    use crate::gguf::dequant::dequantize;

    /// The values a decoder puts in registers, stored in order.
    fn decoded(ty: GgmlType, blk: &[u8], wide: bool) -> Vec<f32> {
        let mut out = vec![0.0f32; 32];
        let p = blk.as_ptr();
        // SAFETY: `blk` is one whole block; callers check the CPU features first.
        unsafe {
            if wide {
                let v = match ty {
                    GgmlType::Q8_0 => <avx512::Q8_0 as avx512::Decode>::decode(p),
                    GgmlType::Q4_0 => <avx512::Q4_0 as avx512::Decode>::decode(p),
                    _ => <avx512::Q4_1 as avx512::Decode>::decode(p),
                };
                for (i, v) in v.iter().enumerate() {
                    _mm512_storeu_ps(out.as_mut_ptr().add(16 * i), *v);
                }
            } else {
                let v = match ty {
                    GgmlType::Q8_0 => <avx2::Q8_0 as avx2::Decode>::decode(p),
                    GgmlType::Q4_0 => <avx2::Q4_0 as avx2::Decode>::decode(p),
                    _ => <avx2::Q4_1 as avx2::Decode>::decode(p),
                };
                for (i, v) in v.iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), *v);
                }
            }
        }
        out
    }

    /// The register decoders give exactly `dequantize`'s values (the unit tests of the whole
    /// kernel only bound the dot products).
    #[test]
    fn register_decoders_are_bit_identical_to_dequantize() {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
        let avx512 = avx2 && std::arch::is_x86_feature_detected!("avx512f");
        if !avx2 {
            eprintln!("no AVX2 on this CPU: the x86 decoders are not run here");
            return;
        }
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let blocks = 64;
            let bytes = random_blocks(ty, blocks, 11);
            let mut want = vec![0.0f32; blocks * 32];
            assert!(dequantize(ty, &bytes, &mut want));
            let bb = ty.block_bytes().unwrap();
            for (b, blk) in bytes.chunks_exact(bb).enumerate() {
                let want = &want[32 * b..32 * (b + 1)];
                for wide in [false, true].into_iter().filter(|&w| !w || avx512) {
                    let got = decoded(ty, blk, wide);
                    let same = got
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{ty} block {b} (avx512: {wide}): {got:?} vs {want:?}");
                }
            }
        }
    }
}
