//! The normalized Hadamard rotation of head vectors, an option for NVFP4 K/V.
//!
//! `H = H_D / sqrt(D)` (Sylvester's construction, D a power of two) is orthonormal and symmetric,
//! so `H·H = I` and `(Hq)·(Hk) = q·k`. Rotating Q and K leaves attention scores unchanged;
//! rotating V rotates the output, which one more rotation undoes. What changes is the values that
//! get quantized: a rotation spreads a few large outlier coordinates across the whole vector, so a
//! 16-value block's scale is set by less extreme values. Pages written with the rotation hold
//! rotated vectors, so it is part of the KV format's fingerprint.

/// Whether `head_dim` allows the rotation (a power of two).
pub fn supported(head_dim: usize) -> bool {
    head_dim.is_power_of_two()
}

/// Rotates every `head_dim`-value vector of `x` in place by the normalized Hadamard matrix
/// (fast Walsh–Hadamard transform, O(D log D) per vector).
///
/// # Panics
/// If `head_dim` is not a power of two or `x` is not whole vectors.
pub fn rotate(x: &mut [f32], head_dim: usize) {
    assert!(
        supported(head_dim),
        "Hadamard rotation needs a power-of-two head dim"
    );
    assert_eq!(x.len() % head_dim, 0, "whole head vectors");
    let norm = 1.0 / (head_dim as f32).sqrt();
    for v in x.chunks_exact_mut(head_dim) {
        let mut h = 1;
        while h < head_dim {
            for block in v.chunks_exact_mut(2 * h) {
                let (a, b) = block.split_at_mut(h);
                for (x, y) in a.iter_mut().zip(b.iter_mut()) {
                    let (s, d) = (*x + *y, *x - *y);
                    *x = s;
                    *y = d;
                }
            }
            h *= 2;
        }
        for value in v.iter_mut() {
            *value *= norm;
        }
    }
}

#[cfg(test)]
mod tests {
    use nibble_kvfmt::{interchange, KvDtype};

    use super::*;

    #[test]
    fn is_its_own_inverse_and_keeps_dot_products() {
        let a: Vec<f32> = (0..128)
            .map(|i| ((i * 17 % 23) as f32 - 11.0) / 3.0)
            .collect();
        let b: Vec<f32> = (0..128)
            .map(|i| ((i * 5 % 13) as f32 - 6.0) / 2.0)
            .collect();
        let (mut ra, mut rb) = (a.clone(), b.clone());
        rotate(&mut ra, 64);
        rotate(&mut rb, 64);
        for h in 0..2 {
            let dot = |x: &[f32], y: &[f32]| -> f32 {
                x[h * 64..(h + 1) * 64]
                    .iter()
                    .zip(&y[h * 64..])
                    .map(|(p, q)| p * q)
                    .sum()
            };
            assert!((dot(&a, &b) - dot(&ra, &rb)).abs() < 1e-3);
        }
        rotate(&mut ra, 64);
        for (x, y) in a.iter().zip(&ra) {
            assert!((x - y).abs() < 1e-5);
        }
    }

    #[test]
    fn matches_the_matrix_definition() {
        // H_4 / 2 applied to e_1 is the second column of H_4 / 2: (1, -1, 1, -1) / 2... in 16 dims
        // the column of index 1 alternates in sign.
        let mut e = vec![0.0f32; 16];
        e[1] = 1.0;
        rotate(&mut e, 16);
        for (i, v) in e.iter().enumerate() {
            let expected = if i % 2 == 0 { 0.25 } else { -0.25 };
            assert_eq!(*v, expected);
        }
    }

    #[test]
    fn rotated_nvfp4_round_trip_stays_accurate() {
        // Whether the rotation helps is a property of real K/V (docs/ACCURACY.md measures it); here
        // only that quantizing in the rotated basis and rotating back reconstructs the vectors.
        let x: Vec<f32> = (0..64 * 64)
            .map(|i| ((i * 7919 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let mut y = x.clone();
        rotate(&mut y, 64);
        let bytes = interchange::encode(KvDtype::Nvfp4, 64, 1.0, &y).unwrap();
        let mut back = interchange::decode(KvDtype::Nvfp4, 64, 1.0, &bytes).unwrap();
        rotate(&mut back, 64);
        let dot: f32 = x.iter().zip(&back).map(|(a, b)| a * b).sum();
        let norms = x.iter().map(|a| a * a).sum::<f32>().sqrt()
            * back.iter().map(|a| a * a).sum::<f32>().sqrt();
        assert!(dot / norms > 0.99, "cosine {}", dot / norms);
    }
}
