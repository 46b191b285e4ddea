//! NVFP4 codes chosen for the queries that will read a vector rather than for the vector alone.
//!
//! A key's error reaches attention only through the scores `q·k̂`, so what should be small is
//! `E[(q·(k − k̂))²] = (k − k̂)ᵀ H (k − k̂)` with `H = E[q qᵀ]`, not `|k − k̂|²`. The codes are chosen
//! one value after another and each value's rounding error is pushed onto the values not yet
//! rounded, as GPTQ quantizes weights: with `U` the upper Cholesky factor of `H⁻¹` (`H⁻¹ = UᵀU`),
//! after value `i` is rounded to `q_i`, `w_j -= (w_i − q_i) / U_ii · U_ij` for every `j > i`. The
//! block scales are those of [`super::quantize_unchecked_with`] on the vector's own values, so
//! the bytes keep their format and a reader needs nothing new.
//!
//! Arithmetic is f32, each operation rounded on its own, in the order written here (value `i`
//! ascending, then `j` ascending), so that a GPU encoder can give the same bytes.

use super::{quantize_unchecked_with, ScaleRule, BLOCK};
use crate::{e2m1, e4m3};

/// The factor `U` for one vector length `d`: the upper Cholesky factor of `(H + λ·mean(diag H)·I)⁻¹`.
#[derive(Debug, Clone, PartialEq)]
pub struct QueryFactor {
    d: usize,
    /// Row-major `d × d`; entries below the diagonal are zero.
    u: Vec<f32>,
}

impl QueryFactor {
    /// The factor of the query second-moment matrix `h` (`d × d`, row-major, symmetric positive
    /// semi-definite) damped by `damp` times its mean diagonal. `None` when `h` is not `d × d`,
    /// not finite, or not positive definite once damped.
    pub fn from_second_moment(h: &[f64], d: usize, damp: f64) -> Option<Self> {
        if d == 0 || h.len() != d * d || h.iter().any(|v| !v.is_finite()) {
            return None;
        }
        let mean = (0..d).map(|i| h[i * d + i]).sum::<f64>() / d as f64;
        let mut a = h.to_vec();
        for i in 0..d {
            a[i * d + i] += damp * mean;
        }
        let linv = lower_inverse(&cholesky_lower(&a, d)?, d);
        // H⁻¹ = L⁻ᵀ L⁻¹, whose lower factor M gives U = Mᵀ.
        let mut hinv = vec![0.0; d * d];
        for i in 0..d {
            for j in 0..d {
                hinv[i * d + j] = (i.max(j)..d)
                    .map(|k| linv[k * d + i] * linv[k * d + j])
                    .sum();
            }
        }
        let m = cholesky_lower(&hinv, d)?;
        let mut u = vec![0.0f32; d * d];
        for i in 0..d {
            for j in i..d {
                u[i * d + j] = m[j * d + i] as f32;
            }
        }
        Some(Self { d, u })
    }

    /// The vector length.
    pub fn len(&self) -> usize {
        self.d
    }

    /// Whether the factor is for empty vectors (never: construction refuses `d = 0`).
    pub fn is_empty(&self) -> bool {
        self.d == 0
    }

    /// `U` row-major.
    pub fn upper(&self) -> &[f32] {
        &self.u
    }
}

/// K's factors for a whole model: one [`QueryFactor`] per (layer, KV head), layer-major, all of
/// one head dimension. What a page store writes K's codes with.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyFactors {
    kv_heads: usize,
    factors: Vec<QueryFactor>,
}

impl KeyFactors {
    /// `factors` of `kv_heads` heads per layer, layer-major. `None` when they are not whole
    /// layers or not all of one vector length.
    pub fn new(kv_heads: usize, factors: Vec<QueryFactor>) -> Option<Self> {
        let d = factors.first()?.len();
        (kv_heads > 0
            && factors.len().is_multiple_of(kv_heads)
            && factors.iter().all(|f| f.len() == d))
        .then_some(Self { kv_heads, factors })
    }

    pub fn layers(&self) -> usize {
        self.factors.len() / self.kv_heads
    }

    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// The vector length every factor is for.
    pub fn head_dim(&self) -> usize {
        self.factors[0].len()
    }

    /// The factor of `layer`'s KV head `head`.
    ///
    /// # Panics
    /// If either is out of range.
    pub fn get(&self, layer: usize, head: usize) -> &QueryFactor {
        assert!(head < self.kv_heads, "KV head {head} of {}", self.kv_heads);
        &self.factors[layer * self.kv_heads + head]
    }

    /// Factors of `layers × kv_heads` second moments `A Aᵀ` whose `A` (`d × d`) is a fixed
    /// pseudo-random function of `seed` and the head: every channel mixed with every other, across
    /// the scale blocks, as real queries' are. For tests and benchmarks of the encoders, where
    /// what matters is that the codes differ from the nearest ones, not the statistics.
    pub fn mixing(layers: usize, kv_heads: usize, d: usize, seed: u64) -> Self {
        let factors = (0..layers * kv_heads)
            .map(|n| {
                let phase = (seed as f64 * 0.618 + n as f64 * 13.0) % 1000.0;
                let a: Vec<f64> = (0..d * d)
                    .map(|i| ((i * 7) as f64 * 0.37 + phase).sin())
                    .collect();
                let h: Vec<f64> = (0..d * d)
                    .map(|ij| (0..d).map(|k| a[ij / d * d + k] * a[ij % d * d + k]).sum())
                    .collect();
                QueryFactor::from_second_moment(&h, d, 0.01)
                    .expect("A Aᵀ damped is positive definite")
            })
            .collect();
        Self::new(kv_heads, factors).expect("whole layers of one length")
    }

    /// Every factor's `U` (row-major `d × d`), in order: what a device encoder reads.
    pub fn uppers(&self) -> impl Iterator<Item = &[f32]> {
        self.factors.iter().map(QueryFactor::upper)
    }
}

fn cholesky_lower(a: &[f64], d: usize) -> Option<Vec<f64>> {
    let mut l = vec![0.0; d * d];
    for i in 0..d {
        for j in 0..=i {
            let s = a[i * d + j] - (0..j).map(|k| l[i * d + k] * l[j * d + k]).sum::<f64>();
            if i == j {
                if s.is_nan() || s <= 0.0 {
                    return None;
                }
                l[i * d + i] = s.sqrt();
            } else {
                l[i * d + j] = s / l[j * d + j];
            }
        }
    }
    Some(l)
}

fn lower_inverse(l: &[f64], d: usize) -> Vec<f64> {
    let mut inv = vec![0.0; d * d];
    for c in 0..d {
        for i in c..d {
            let s = if i == c { 1.0 } else { 0.0 }
                - (c..i).map(|k| l[i * d + k] * inv[k * d + c]).sum::<f64>();
            inv[i * d + c] = s / l[i * d + i];
        }
    }
    inv
}

/// Quantizes `x` (one vector of `factor.len()` values, a multiple of 16) like
/// [`super::quantize_unchecked_with`], with the codes chosen for the queries `factor` describes.
///
/// # Panics
/// If the lengths disagree with `factor` or each other.
pub fn quantize_for_queries(
    x: &[f32],
    g: f32,
    rule: ScaleRule,
    factor: &QueryFactor,
    packed: &mut [u8],
    scales: &mut [u8],
) {
    let d = factor.d;
    assert_eq!(x.len(), d, "vector length against the factor's");
    quantize_unchecked_with(x, g, rule, packed, scales);
    // The values still to round, on the stack for every head dim nibble serves (this runs for
    // each key a page store writes).
    let (mut stack, mut heap) = ([0.0f32; 256], Vec::new());
    let w = if d <= stack.len() {
        &mut stack[..d]
    } else {
        heap.resize(d, 0.0);
        &mut heap[..]
    };
    w.copy_from_slice(x);
    for i in 0..d {
        let s = e4m3::decode(scales[i / BLOCK]);
        let (code, q) = if s == 0.0 {
            (0u8, 0.0f32)
        } else {
            let code = e2m1::encode(w[i] / (s * g));
            (code, (e2m1::decode(code) * s) * g)
        };
        let byte = &mut packed[i / 2];
        *byte = if i % 2 == 0 {
            (*byte & 0xF0) | code
        } else {
            (*byte & 0x0F) | (code << 4)
        };
        let row = &factor.u[i * d..(i + 1) * d];
        let err = (w[i] - q) / row[i];
        for j in i + 1..d {
            w[j] -= err * row[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn decoded(packed: &[u8], scales: &[u8], g: f32) -> Vec<f32> {
        let mut out = vec![0.0; packed.len() * 2];
        super::super::dequantize_unchecked(packed, scales, g, &mut out);
        out
    }

    fn quadratic(h: &[f64], e: &[f32]) -> f64 {
        let d = e.len();
        (0..d)
            .flat_map(|i| (0..d).map(move |j| (i, j)))
            .map(|(i, j)| h[i * d + j] * e[i] as f64 * e[j] as f64)
            .sum()
    }

    #[test]
    fn a_diagonal_second_moment_gives_the_plain_codes() {
        let mut rng = StdRng::seed_from_u64(7);
        let d = 64;
        let h: Vec<f64> = (0..d * d)
            .map(|x| {
                if x / d == x % d {
                    rng.gen_range(0.5..4.0)
                } else {
                    0.0
                }
            })
            .collect();
        let factor = QueryFactor::from_second_moment(&h, d, 0.01).unwrap();
        for _ in 0..50 {
            let x: Vec<f32> = (0..d).map(|_| rng.gen_range(-8.0f32..8.0)).collect();
            let (mut p1, mut s1) = (vec![0; d / 2], vec![0; d / BLOCK]);
            let (mut p2, mut s2) = (p1.clone(), s1.clone());
            quantize_unchecked_with(&x, 1.0, ScaleRule::Mse, &mut p1, &mut s1);
            quantize_for_queries(&x, 1.0, ScaleRule::Mse, &factor, &mut p2, &mut s2);
            assert_eq!((p1, s1), (p2, s2));
        }
    }

    #[test]
    fn correlated_queries_see_less_score_error() {
        let mut rng = StdRng::seed_from_u64(11);
        let d = 64;
        // H = A Aᵀ with A's columns mixing channels across scale blocks.
        let a: Vec<f64> = (0..d * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut h = vec![0.0; d * d];
        for i in 0..d {
            for j in 0..d {
                h[i * d + j] = (0..d).map(|k| a[i * d + k] * a[j * d + k]).sum();
            }
        }
        let factor = QueryFactor::from_second_moment(&h, d, 0.01).unwrap();
        let (mut plain, mut fed) = (0.0, 0.0);
        for _ in 0..200 {
            let x: Vec<f32> = (0..d).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
            let (mut p, mut s) = (vec![0; d / 2], vec![0; d / BLOCK]);
            quantize_unchecked_with(&x, 1.0, ScaleRule::Mse, &mut p, &mut s);
            let scales = s.clone();
            let e: Vec<f32> = x
                .iter()
                .zip(decoded(&p, &s, 1.0))
                .map(|(a, b)| a - b)
                .collect();
            plain += quadratic(&h, &e);
            quantize_for_queries(&x, 1.0, ScaleRule::Mse, &factor, &mut p, &mut s);
            assert_eq!(s, scales, "the block scales are the plain ones");
            let e: Vec<f32> = x
                .iter()
                .zip(decoded(&p, &s, 1.0))
                .map(|(a, b)| a - b)
                .collect();
            fed += quadratic(&h, &e);
        }
        assert!(
            fed < 0.8 * plain,
            "score error {fed} against {plain} without feedback"
        );
    }

    #[test]
    fn a_matrix_that_is_not_positive_definite_is_refused() {
        assert!(QueryFactor::from_second_moment(&[1.0, 2.0, 2.0, 1.0], 2, 0.0).is_none());
        assert!(QueryFactor::from_second_moment(&[1.0; 3], 2, 0.0).is_none());
        assert!(QueryFactor::from_second_moment(&[f64::NAN, 0.0, 0.0, 1.0], 2, 0.0).is_none());
        assert!(QueryFactor::from_second_moment(&[], 0, 0.0).is_none());
    }
}
