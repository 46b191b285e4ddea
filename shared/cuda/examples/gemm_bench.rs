//! gemm-bench: the CUDA backend's `matmul_t` with BF16 weights (the default) on Llama-3-8B's
//! weight shapes, at the batch sizes of decode steps. One JSON object per line
//! (docs/BENCHMARKS.md, "Decode GEMMs").
//!
//! For each (rows n, weight m x k): 8 copies of the weight matrix, or as many as make 512 MB,
//! so consecutive calls read their weights from memory and not from the 60 MB L2, as a model's
//! layers do; `matmul_t` called back to back over them, after 3 warm-up rounds, the stream
//! synchronized before and after; the time per call is the median of 9 rounds. GB/s counts the
//! weight bytes only (the activations are at most 2% of them at n = 64). The input is the same
//! tensor for every call, so its BF16 cast is made once, as for the Q, K and V projections of a
//! layer.
//!
//! A single matrix goes through `matmul_t_many` too (which runs it as `matmul_t`).
//!
//! Run: `gemm_bench [--rows 1,8,32]`; exits 1, saying why, when the GPU cannot be used.

use std::time::Instant;

use anyhow::{Context, Result};
use nibble_cuda::CudaBackend;
use nibble_engine::Backend;
use serde_json::json;

/// Llama-3-8B's decode GEMMs: (name, output features m of each matrix, input features k). A
/// group of several matrices reads one input and runs as one `matmul_t_many`, as the model
/// runs Q, K and V, and gate and up.
const SHAPES: [(&str, &[usize], usize); 7] = [
    ("q_proj/o_proj", &[4096], 4096),
    ("k_proj/v_proj", &[1024], 4096),
    ("q+k+v", &[4096, 1024, 1024], 4096),
    ("gate/up", &[14336], 4096),
    ("gate+up", &[14336, 14336], 4096),
    ("down", &[4096], 14336),
    ("lm_head", &[128256], 4096),
];

fn main() -> Result<()> {
    let rows: Vec<usize> = match std::env::args().skip_while(|a| a != "--rows").nth(1) {
        Some(list) => list
            .split(',')
            .map(|r| r.trim().parse().context("--rows takes a list of numbers"))
            .collect::<Result<_>>()?,
        None => vec![1, 8, 32, 64],
    };
    let gpu = CudaBackend::new(0).context("no usable GPU")?;
    println!(
        "{}",
        json!({"bench": "gemm_device", "backend": gpu.name(), "gemm": gpu.gemm_name()})
    );
    let stream = gpu.kernels().stream().clone();
    for (name, ms, k) in SHAPES {
        let m: usize = ms.iter().sum();
        let bytes = m * k * 2;
        let copies = (512usize << 20).div_ceil(bytes).clamp(1, 8);
        let mut state = 0x9e37_79b9u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32 - 0.5) * 0.05
        };
        let mut weights = Vec::new();
        for _ in 0..copies {
            let group = ms
                .iter()
                .map(|&mi| gpu.upload_matrix(mi, k, (0..mi * k).map(|_| next()).collect()))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            weights.push(group);
        }
        for &n in &rows {
            let x = gpu.upload(n, k, &(0..n * k).map(|_| next()).collect::<Vec<_>>())?;
            let mut outs: Vec<_> = ms.iter().map(|&mi| gpu.zeros(n, mi)).collect();
            let mut round = || -> Result<f64> {
                stream.synchronize()?;
                let t = Instant::now();
                for group in &weights {
                    let ws: Vec<_> = group.iter().collect();
                    let mut os: Vec<_> = outs.iter_mut().collect();
                    gpu.matmul_t_many(&x, &ws, &mut os).unwrap();
                }
                stream.synchronize()?;
                Ok(t.elapsed().as_secs_f64() / copies as f64)
            };
            for _ in 0..3 {
                round()?;
            }
            let mut times = (0..9).map(|_| round()).collect::<Result<Vec<_>>>()?;
            times.sort_by(f64::total_cmp);
            let s = times[times.len() / 2];
            println!(
                "{}",
                json!({"bench": "gemm", "shape": name, "n": n, "m": ms, "k": k, "copies": copies,
                       "us": s * 1e6, "weight_gbps": bytes as f64 / s / 1e9})
            );
        }
    }
    Ok(())
}
