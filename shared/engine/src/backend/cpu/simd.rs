//! Elementwise CPU kernels (exp, SiLU, softmax, RMSNorm, RoPE rows) written as plain loops that
//! LLVM vectorizes, compiled twice: once for the baseline target and once with AVX2+FMA,
//! picked at run time. No `target-cpu=native` is needed in build config.

/// Runs `$body` through a copy of itself compiled with AVX2 and FMA when the CPU has them.
macro_rules! dispatch {
    ($name:ident($($arg:ident: $ty:ty),*) $body:block) => {
        #[inline(always)]
        fn generic($($arg: $ty),*) $body

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2($($arg: $ty),*) {
            generic($($arg),*)
        }

        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports the features `avx2` was compiled for.
            return unsafe { avx2($($arg),*) };
        }
        generic($($arg),*)
    };
}

/// `e^x` with ~2e-7 relative error on the range where it is a normal f32, branch-free so it
/// vectorizes: range reduction by ln 2, then a degree-6 polynomial.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

/// `gate = silu(gate) * up`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    dispatch!(silu_mul(gate: &mut [f32], up: &[f32]) {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = *g / (1.0 + exp(-*g)) * u;
        }
    });
}

/// Maximum of `x` (−∞ when empty), in eight lanes so the loop vectorizes.
#[inline(always)]
fn lane_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    acc.iter().fold(tail, |m, &v| m.max(v))
}

/// Sum of `x` in eight lanes (vectorizes; also a little closer to a pairwise sum).
#[inline(always)]
fn lane_sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// `x = exp((x - max) * scale)` for every value, then returns their sum. The exponentials and
/// the sum are separate loops so both vectorize.
#[inline(always)]
fn exp_shifted(x: &mut [f32], max: f32, scale: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp((*v - max) * scale);
    }
    lane_sum(x)
}

/// In-place softmax of `x[..valid]` (scaled by `scale` first); `x[valid..]` is set to zero.
pub fn softmax_prefix(x: &mut [f32], valid: usize, scale: f32) {
    dispatch!(softmax_prefix(x: &mut [f32], valid: usize, scale: f32) {
        let (live, dead) = x.split_at_mut(valid);
        let max = lane_max(live);
        let inv = 1.0 / exp_shifted(live, max, scale);
        for v in live.iter_mut() {
            *v *= inv;
        }
        dead.fill(0.0);
    });
}

/// RMSNorm of each `weight.len()`-wide group of `x` into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    dispatch!(rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        let w = weight.len();
        for (xr, or) in x.chunks_exact(w).zip(out.chunks_exact_mut(w)) {
            // Eight partial sums: vectorizable, and closer to a pairwise sum than one chain.
            let mut acc = [0.0f32; 8];
            let mut chunks = xr.chunks_exact(8);
            for c in &mut chunks {
                for (a, &v) in acc.iter_mut().zip(c) {
                    *a += v * v;
                }
            }
            let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
            let ss = acc.iter().sum::<f32>() + tail;
            let inv = 1.0 / (ss / w as f32 + eps).sqrt();
            for ((o, &v), &g) in or.iter_mut().zip(xr).zip(weight) {
                *o = v * inv * g;
            }
        }
    });
}

/// Rotates interleaved pairs `(x[2i], x[2i+1])` of one head by `(cos[i], sin[i])`.
pub fn rope_interleaved(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    dispatch!(rope_interleaved(head: &mut [f32], cos: &[f32], sin: &[f32]) {
        for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * c - b * s;
            pair[1] = a * s + b * c;
        }
    });
}

/// Rotates pairs `(x[i], x[i + d/2])` of one head by `(cos[i], sin[i])`.
pub fn rope_half_split(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    dispatch!(rope_half_split(head: &mut [f32], cos: &[f32], sin: &[f32]) {
        let (lo, hi) = head.split_at_mut(head.len() / 2);
        for (((a, b), &c), &s) in lo.iter_mut().zip(hi.iter_mut()).zip(cos).zip(sin) {
            let (x, y) = (*a, *b);
            *a = x * c - y * s;
            *b = x * s + y * c;
        }
    });
}

/// One span of keys of a decode step: every query head of one token row against context rows
/// `keys` (token-major K/V, `stride` values per row, head `h` reading KV head `h / group`).
pub struct KeySpan<'a> {
    /// The token's queries, `heads × head_dim` values.
    pub q: &'a [f32],
    /// Keys, one row of `stride` values per position.
    pub k: &'a [f32],
    /// Values, laid out like `k`.
    pub v: &'a [f32],
    /// Values per K/V row.
    pub stride: usize,
    /// Context rows of this span.
    pub keys: std::ops::Range<usize>,
    /// Query heads per KV head.
    pub group: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// Score scale.
    pub scale: f32,
}

/// Partial attention of [`KeySpan`]: with `heads = q.len() / head_dim`, writes to `part` the
/// per-head maximum scaled score `[heads]`, the sum of `exp(score·scale − max)` `[heads]`, and
/// the unnormalized outputs `[heads][head_dim]`. `scores` is scratch of `heads × span` values.
pub fn attend_key_span(a: &KeySpan<'_>, scores: &mut [f32], part: &mut [f32]) {
    dispatch!(attend_key_span(a: &KeySpan<'_>, scores: &mut [f32], part: &mut [f32]) {
        let d = a.head_dim;
        let heads = a.q.len() / d;
        let len = a.keys.len();
        for (jj, j) in a.keys.clone().enumerate() {
            let krow = &a.k[j * a.stride..(j + 1) * a.stride];
            for h in 0..heads {
                let qh = &a.q[h * d..(h + 1) * d];
                let kh = &krow[(h / a.group) * d..(h / a.group + 1) * d];
                let mut acc = [0.0f32; 8];
                for (qc, kc) in qh.chunks_exact(8).zip(kh.chunks_exact(8)) {
                    for l in 0..8 {
                        acc[l] += qc[l] * kc[l];
                    }
                }
                scores[h * len + jj] = acc.iter().sum::<f32>() + dot_tail(qh, kh);
            }
        }
        let (stats, outs) = part.split_at_mut(2 * heads);
        for h in 0..heads {
            let s = &mut scores[h * len..(h + 1) * len];
            let max = lane_max(s);
            stats[heads + h] = exp_shifted(s, max, a.scale);
            stats[h] = max * a.scale;
        }
        outs.fill(0.0);
        for (jj, j) in a.keys.clone().enumerate() {
            let vrow = &a.v[j * a.stride..(j + 1) * a.stride];
            for h in 0..heads {
                let p = scores[h * len + jj];
                let vh = &vrow[(h / a.group) * d..(h / a.group + 1) * d];
                for (o, &x) in outs[h * d..(h + 1) * d].iter_mut().zip(vh) {
                    *o += p * x;
                }
            }
        }
    });
}

/// The part of `dot(q, k)` past the last whole group of eight values.
#[inline(always)]
fn dot_tail(q: &[f32], k: &[f32]) -> f32 {
    let start = q.len() / 8 * 8;
    q[start..].iter().zip(&k[start..]).map(|(x, y)| x * y).sum()
}

/// `x += y`.
pub fn add(x: &mut [f32], y: &[f32]) {
    dispatch!(add(x: &mut [f32], y: &[f32]) {
        for (a, &b) in x.iter_mut().zip(y) {
            *a += b;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0.0f64;
        for i in -8000..=8000 {
            let x = i as f32 * 0.01;
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert!(exp(-1000.0) < 1e-37);
    }

    #[test]
    fn softmax_sums_to_one_and_zeroes_the_tail() {
        let mut x = [1.0, 2.0, 3.0, 100.0];
        softmax_prefix(&mut x, 3, 1.0);
        let e: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|v| v.exp()).collect();
        let s: f64 = e.iter().sum();
        for i in 0..3 {
            assert!((x[i] as f64 - e[i] / s).abs() < 1e-6);
        }
        assert_eq!(x[3], 0.0);
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0, 2.0, 3.0, 4.0, -1.0, 0.0, 1.0, 0.0];
        let w = [1.0, 0.5, 2.0, 1.0];
        let mut out = [0.0; 8];
        rms_norm(&x, &w, 1e-5, &mut out);
        let r0 = (30.0f32 / 4.0 + 1e-5).sqrt();
        assert!((out[2] - 3.0 / r0 * 2.0).abs() < 1e-6);
        let r1 = (2.0f32 / 4.0 + 1e-5).sqrt();
        assert!((out[4] + 1.0 / r1).abs() < 1e-6);
    }

    #[test]
    fn rope_styles_pair_different_dims() {
        let (c, s) = ([0.0, 1.0], [1.0, 0.0]); // rotate pair 0 by 90°, leave pair 1
        let mut a = [1.0, 2.0, 3.0, 4.0];
        rope_interleaved(&mut a, &c, &s);
        assert_eq!(a, [-2.0, 1.0, 3.0, 4.0]);
        let mut b = [1.0, 2.0, 3.0, 4.0];
        rope_half_split(&mut b, &c, &s);
        assert_eq!(b, [-3.0, 2.0, 1.0, 4.0]);
    }

    #[test]
    fn silu_mul_matches_definition() {
        let g = [-2.0f32, 0.0, 3.0];
        let u = [1.0f32, 5.0, -2.0];
        let mut o = g;
        silu_mul(&mut o, &u);
        for i in 0..3 {
            let want = g[i] / (1.0 + (-g[i]).exp()) * u[i];
            assert!((o[i] - want).abs() < 1e-6);
        }
    }
}
