//! `out = x · wᵀ` for a few rows of `x` (decode steps): memory-bound on reading `w`, so each
//! weight row is streamed once and dotted with up to four input rows at a time. Output features
//! are split across threads. AVX2+FMA when the CPU has it, a scalar loop otherwise.

use rayon::prelude::*;

/// Largest number of input rows this path handles; beyond it a packed GEMM wins.
pub(super) const MAX_ROWS: usize = 16;

/// Parallel tasks per pool thread: enough to balance load on small matrices.
pub(super) const TASKS_PER_THREAD: usize = 8;

/// Fewest output features per task (keeps per-task overhead small).
pub(super) const MIN_FEATURES_PER_TASK: usize = 8;

/// A raw output pointer shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: each task writes only its own range of output columns.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out[i][j] = dot(x[i], w[j])`; `x` is `n × k`, `w` is `m × k`, `out` is `n × m`. Runs on the
/// current rayon pool.
pub(super) fn matmul_t_small(x: &[f32], w: &[f32], out: &mut [f32], n: usize, k: usize, m: usize) {
    assert!(n <= MAX_ROWS && x.len() == n * k && w.len() == m * k && out.len() == n * m);
    let out_ptr = OutPtr(out.as_mut_ptr());
    let per_task = m
        .div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD)
        .max(MIN_FEATURES_PER_TASK);
    w.par_chunks(per_task * k)
        .enumerate()
        .for_each(|(task, wblock)| {
            let j0 = task * per_task;
            for (jj, wrow) in wblock.chunks_exact(k).enumerate() {
                let mut i = 0;
                while i < n {
                    let rows = (n - i).min(4);
                    let mut dots = [0.0f32; 4];
                    dot_rows(wrow, &x[i * k..(i + rows) * k], k, &mut dots[..rows]);
                    for (r, &d) in dots[..rows].iter().enumerate() {
                        // SAFETY: (i + r) < n and j0 + jj < m, so the index is inside `out`;
                        // column j0 + jj belongs to this task only.
                        unsafe { *out_ptr.get().add((i + r) * m + j0 + jj) = d };
                    }
                    i += rows;
                }
            }
        });
}

/// `dots[r] = dot(w, xs[r*k..(r+1)*k])` for `r < dots.len() <= 4`.
fn dot_rows(w: &[f32], xs: &[f32], k: usize, dots: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA.
        unsafe { avx2::dot_rows(w, xs, k, dots) };
        return;
    }
    for (r, d) in dots.iter_mut().enumerate() {
        *d = w
            .iter()
            .zip(&xs[r * k..(r + 1) * k])
            .map(|(a, b)| a * b)
            .sum();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// How far ahead of the current weight the next cache lines are requested (prefetches
    /// past the end of the row are harmless hints; they read the next row).
    const PREFETCH_FLOATS: usize = 256;

    /// Horizontal sum of 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// See `super::dot_rows`. Two accumulators per input row hide FMA latency.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_rows(w: &[f32], xs: &[f32], k: usize, dots: &mut [f32]) {
        let rows = dots.len();
        debug_assert!(rows <= 4 && xs.len() >= rows * k && w.len() >= k);
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let main = k / 16 * 16;
        let wp = w.as_ptr();
        let xp = xs.as_ptr();
        let mut c = 0;
        while c < main {
            // SAFETY: c + 16 <= k, so every load is inside `w` and inside row r of `xs`.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(c + PREFETCH_FLOATS) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(c + PREFETCH_FLOATS + 16) as *const i8);
                let w0 = _mm256_loadu_ps(wp.add(c));
                let w1 = _mm256_loadu_ps(wp.add(c + 8));
                for (r, a) in acc.iter_mut().enumerate().take(rows) {
                    let x = xp.add(r * k + c);
                    a[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), a[0]);
                    a[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.add(8)), a[1]);
                }
            }
            c += 16;
        }
        for (r, d) in dots.iter_mut().enumerate() {
            let mut s = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
            for t in main..k {
                s += w[t] * xs[r * k + t];
            }
            *d = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_product() {
        for &(n, k, m) in &[(1, 576, 200), (3, 40, 130), (7, 1536, 70), (16, 17, 5)] {
            let x: Vec<f32> = (0..n * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let w: Vec<f32> = (0..m * k)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0)
                .collect();
            let mut out = vec![0.0; n * m];
            matmul_t_small(&x, &w, &mut out, n, k, m);
            for i in 0..n {
                for j in 0..m {
                    let want: f64 = (0..k)
                        .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                        .sum();
                    let got = out[i * m + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "({n},{k},{m}) [{i}][{j}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}
