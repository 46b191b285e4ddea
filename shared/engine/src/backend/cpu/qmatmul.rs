//! `out = x · wᵀ` with `w` a [`BlockMatrix`].
//!
//! * Few rows (decode, `n <= MAX_ROWS`): memory-bound on reading `w`, so each weight row is read
//!   once per group of up to eight input rows. Output features are split across the pool's
//!   threads. On x86 with AVX2 (and AVX-512 where present), Q4_0/Q4_1/Q8_0 blocks are decoded in
//!   registers and multiplied straight into running sums ([`x86`]); otherwise (Q5_0/Q5_1,
//!   K-quants, other targets, the scalar copy) each weight row is decoded into an L1-resident f32
//!   buffer and dotted with the input rows (plain loops that vectorize).
//! * Many rows (prefill): tiles of output features, at most 4 MiB of f32, are dequantized into a
//!   buffer (per calling thread, reused) and multiplied with the packed GEMM. A small model's
//!   layer matrix is one tile; an LM head is a few dozen.
//!
//! Weight values are those of [`crate::gguf::dequant`] bit for bit (its block decoders are
//! inlined here, and the x86 decoders compute the same exact products), so results differ from
//! an f32-weight GEMM only in summation order.

use super::blocks::{BlockMatrix, Isa};
use super::gemv::{OutPtr, MAX_ROWS, MIN_FEATURES_PER_TASK, TASKS_PER_THREAD};
use rayon::prelude::*;

/// Most f32 values in a prefill tile (4 MiB): a whole layer matrix of a small model, so its
/// product is the f32 path's single GEMM. Tiles also stay wider than 64 features (unless the
/// matrix is narrower), where the GEMM would switch to a small-matrix blocking whose summation
/// order depends on the number of rows: with wide tiles a row's result does not depend on how
/// many rows share the call, so prefill and chunked extend of the same tokens agree exactly.
const TILE_VALUES: usize = 1 << 20;

/// `out[i][j] = dot(x[i], w[j])`; `x` is `n × k`, `out` is `n × m` (`w` is `m × k`). Runs on the
/// current rayon pool.
pub(super) fn matmul_t(isa: Isa, x: &[f32], w: &BlockMatrix, out: &mut [f32], n: usize) {
    let (k, m) = (w.cols(), w.rows());
    assert!(x.len() == n * k && out.len() == n * m, "matmul_t: shapes");
    if n == 0 || m == 0 {
        return;
    }
    if n <= MAX_ROWS {
        few_rows(isa, x, w, out, n);
    } else {
        tiled(isa, x, w, out, n);
    }
}

/// One few-row task: weight rows `j0..j0 + count` against every input row.
#[derive(Clone, Copy)]
struct Task<'a> {
    w: &'a BlockMatrix,
    x: &'a [f32],
    n: usize,
    j0: usize,
    count: usize,
    out: OutPtr,
}

impl Task<'_> {
    /// `out[i][j] = d`.
    ///
    /// # Safety
    /// `i < n`, `j` is one of this task's rows, and no other task writes column `j`.
    #[inline(always)]
    unsafe fn put(&self, i: usize, j: usize, d: f32) {
        // SAFETY: the caller's contract keeps the index inside `out` (n × m) and unshared.
        unsafe { *self.out.get().add(i * self.w.rows() + j) = d };
    }

    /// `out[i + r][j] = d[r]`.
    ///
    /// # Safety
    /// As [`Self::put`], for every `i + r`.
    #[inline(always)]
    unsafe fn put_all(&self, i: usize, j: usize, d: &[f32]) {
        for (r, &v) in d.iter().enumerate() {
            // SAFETY: forwarded from the caller.
            unsafe { self.put(i + r, j, v) };
        }
    }
}

fn few_rows(isa: Isa, x: &[f32], w: &BlockMatrix, out: &mut [f32], n: usize) {
    let m = w.rows();
    let per_task = m
        .div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD)
        .max(MIN_FEATURES_PER_TASK);
    let out = OutPtr(out.as_mut_ptr());
    (0..m.div_ceil(per_task)).into_par_iter().for_each(|t| {
        let j0 = t * per_task;
        let task = Task {
            w,
            x,
            n,
            j0,
            count: per_task.min(m - j0),
            out,
        };
        match isa {
            Isa::Scalar => decoded_rows(Isa::Scalar, task),
            // SAFETY (x86 arms): an `Isa` is only chosen when the CPU has its features.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if x86::fused(w.ty()) => unsafe { x86::rows_avx512(task) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if x86::fused(w.ty()) => unsafe { x86::rows_avx2(task) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => unsafe { decoded_rows_avx2(task) },
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decoded_rows_avx2(task: Task<'_>) {
    decoded_rows(Isa::Avx2, task)
}

#[cfg(target_arch = "x86_64")]
mod x86;

/// The task's weight rows decoded one at a time into a buffer, each dotted with every input row.
#[inline(always)]
fn decoded_rows(isa: Isa, task: Task<'_>) {
    let k = task.w.cols();
    let mut row = vec![0.0f32; k];
    for j in task.j0..task.j0 + task.count {
        task.w.decode_rows(isa, j..j + 1, &mut row);
        for (i, xi) in task.x.chunks_exact(k).enumerate() {
            // SAFETY: i < n, and j is this task's row.
            unsafe { task.put(i, j, dot(&row, xi)) };
        }
    }
}

/// `dot(a, b)` in 16 lanes (vectorizes).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (ca, cb) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut w = 8;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0] + tail
}

/// Many rows: tiles of output features, each dequantized to f32 (in parallel) and multiplied
/// by the packed GEMM (itself parallel), one tile after another.
fn tiled(isa: Isa, x: &[f32], w: &BlockMatrix, out: &mut [f32], n: usize) {
    let (k, m) = (w.cols(), w.rows());
    let threads = rayon::current_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // Equal tiles, so none is much narrower than TILE_VALUES / k (see its note).
    let count = m.div_ceil((TILE_VALUES / k).max(1));
    // Taken out of the thread's slot (not borrowed), so a nested call on this thread while the
    // pool runs other work gets a buffer of its own.
    let mut tile = TILE.take();
    for t in 0..count {
        let (j0, j1) = (t * m / count, (t + 1) * m / count);
        tile.resize((j1 - j0) * k, 0.0);
        let rows_per_task = (j1 - j0).div_ceil(threads * TASKS_PER_THREAD).max(1);
        tile.par_chunks_mut(rows_per_task * k)
            .enumerate()
            .for_each(|(c, rows)| {
                let r0 = j0 + c * rows_per_task;
                w.decode_rows(isa, r0..r0 + rows.len() / k, rows);
            });
        // SAFETY: x is n×k and the tile (j1-j0)×k; the destination is columns j0..j1 of the
        // n×m output (row stride m), which `out` covers.
        unsafe {
            gemm::gemm(
                n,
                j1 - j0,
                k,
                out.as_mut_ptr().add(j0),
                1,
                m as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                tile.as_ptr(),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                par,
            )
        }
    }
    TILE.set(tile);
}

thread_local! {
    /// The prefill tile buffer of the thread calling [`tiled`], kept between calls.
    static TILE: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::super::blocks::random_blocks;
    use super::super::CpuBackend;
    use super::*;
    use crate::backend::Backend;
    use crate::gguf::dequant::dequantize;
    use crate::gguf::GgmlType;

    const TYPES: [GgmlType; 7] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
    ];

    fn inputs(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 37 % 101) as f32 - 50.0) / 50.0)
            .collect()
    }

    /// Every block type, odd shapes, every compiled copy this CPU runs (scalar included), the
    /// few-row kernels (1..16 rows: every grouping of 8/4/2/1) and the tiled GEMM: within f32
    /// rounding of a float64 product of the dequantized matrix, as the f32-weight path is.
    #[test]
    fn matches_the_f32_path_on_random_blocks() {
        let backend = CpuBackend::new(3).unwrap();
        for ty in TYPES {
            let bl = ty.block_len().unwrap();
            for &(n, k_blocks, m) in &[
                (1, 3, 37),
                (2, 1, 5),
                (3, 2, 131),
                (7, 1, 9),
                (8, 2, 33),
                (15, 1, 41),
                (16, 1, 9),
                (19, 2, 41),
                (40, 1, 300),
            ] {
                let k = k_blocks * if bl == 32 { 3 * bl } else { bl };
                let bytes = random_blocks(ty, m * k / bl, (n + m) as u64);
                let quantized = backend.upload_weight(m, k, ty, &bytes).unwrap();
                assert_eq!(quantized.block_type(), Some(ty));
                let mut wf = vec![0.0f32; m * k];
                assert!(dequantize(ty, &bytes, &mut wf));
                let f32_weights = backend.upload(m, k, &wf).unwrap();
                let x = backend.upload(n, k, &inputs(n * k, m)).unwrap();

                let mut f32_path = backend.zeros(n, m);
                backend.matmul_t(&x, &f32_weights, &mut f32_path).unwrap();
                let mut outs = vec![("f32 path".to_string(), f32_path)];
                for isa in Isa::all() {
                    let mut out = backend.zeros(n, m);
                    backend.scope(|| {
                        matmul_t(
                            isa,
                            x.as_slice(),
                            quantized.blocks.as_ref().unwrap(),
                            out.as_mut_slice(),
                            n,
                        )
                    });
                    outs.push((format!("{isa:?}"), out));
                }
                for i in 0..n {
                    for j in 0..m {
                        let (xr, wr) = (x.row(i), &wf[j * k..(j + 1) * k]);
                        let want: f64 = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let scale: f64 =
                            xr.iter().zip(wr).map(|(&a, &b)| (a * b).abs() as f64).sum();
                        for (name, out) in &outs {
                            let got = out.row(i)[j] as f64;
                            assert!(
                                (got - want).abs() <= 1e-6 * (1.0 + scale),
                                "{ty} {name} n={n} k={k} m={m} [{i}][{j}]: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A row's result does not depend on how many rows share the call (so prefill and chunked
    /// extend of the same tokens agree bit for bit), including across tiles of a wide matrix.
    #[test]
    fn many_rows_are_batch_invariant() {
        let backend = CpuBackend::new(2).unwrap();
        for (m, k) in [(192, 576), (2000, 576)] {
            let bytes = random_blocks(GgmlType::Q4_1, m * k / 32, 5);
            let w = BlockMatrix::new(GgmlType::Q4_1, m, k, &bytes).unwrap();
            let x = inputs(160 * k, 1);
            let run = |n: usize| {
                let mut out = vec![0.0f32; n * m];
                backend.scope(|| matmul_t(Isa::detect(), &x[..n * k], &w, &mut out, n));
                out
            };
            let full = run(160);
            for n in [17, 40, 64, 100] {
                let part = run(n);
                let same = part
                    .iter()
                    .zip(&full)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{m}x{k}: {n} rows differ from the same rows among 160"
                );
            }
        }
    }

    /// Embedding rows of a quantized table are the dequantized rows, exactly.
    #[test]
    fn embeds_dequantized_rows() {
        let backend = CpuBackend::new(2).unwrap();
        let (rows, cols) = (5, 64);
        let bytes = random_blocks(GgmlType::Q8_0, rows * 2, 3);
        let table = backend
            .upload_weight(rows, cols, GgmlType::Q8_0, &bytes)
            .unwrap();
        let mut want = vec![0.0f32; rows * cols];
        assert!(dequantize(GgmlType::Q8_0, &bytes, &mut want));
        let mut out = backend.zeros(2, cols);
        backend.embed(&table, &[4, 1], &mut out).unwrap();
        assert_eq!(out.row(0), &want[4 * cols..]);
        assert_eq!(out.row(1), &want[cols..2 * cols]);
    }

    /// Plain types are dequantized to f32 at upload, as the trait's default does.
    #[test]
    fn plain_types_upload_as_f32() {
        let backend = CpuBackend::new(1).unwrap();
        let bytes: Vec<u8> = [1.5f32, -2.0, 0.25, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let t = backend.upload_weight(2, 2, GgmlType::F32, &bytes).unwrap();
        assert_eq!(t.block_type(), None);
        assert_eq!(t.as_slice(), &[1.5, -2.0, 0.25, 4.0]);
        assert!(backend.upload_weight(2, 3, GgmlType::F32, &bytes).is_err());
    }
}
