//! Shared inputs for nibble's benchmarks (criterion benchmarks in `benches/`, serving
//! benchmarks that run a cluster in `examples/`).
//!
//! Inputs are seeded, so every run measures the same values. [`router`] builds the router
//! benchmark's cluster and prompts; [`cluster`] starts real gRPC workers and a router in this
//! process for the transfer and latency benchmarks.

pub mod cluster;
pub mod router;

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

/// Values per benchmark input: 1 Mi (2^20), a whole number of 16-value NVFP4 blocks.
pub const VALUES: usize = 1 << 20;

/// `len` KV-like values: normal with standard deviation `sigma`, from a fixed `seed`.
pub fn kv_values(len: usize, sigma: f32, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    // A standard deviation that is finite and positive is a valid Normal; anything else is a bug
    // in the benchmark that asks for it.
    let normal = Normal::new(0.0f32, sigma).expect("finite positive sigma");
    (0..len).map(|_| normal.sample(&mut rng)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_and_finite() {
        let a = kv_values(1024, 2.0, 7);
        assert_eq!(a, kv_values(1024, 2.0, 7));
        assert_ne!(a, kv_values(1024, 2.0, 8));
        assert!(a.iter().all(|v| v.is_finite()));
        assert_eq!(VALUES % 16, 0);
    }
}
