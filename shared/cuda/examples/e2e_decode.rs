//! e2e-decode: end-to-end decode tokens/s of a model with Llama-3-8B's shape and RANDOM weights,
//! for BF16, FP8 and NVFP4 KV at 32K context and matched batches, on the CUDA backend. One JSON
//! object per line (docs/BENCHMARKS.md, "End-to-end decode").
//!
//! * The model is `nibble_engine::synthetic::random_model` (seeded, uniform ±sqrt(3/fan-in)):
//!   random weights measure speed only, the tokens mean nothing. The CUDA backend keeps the
//!   weight matrices as it keeps a loaded model's: BF16 by default (cuBLAS GemmEx; 8.03 B
//!   parameters are 16.1 GB of device memory), f32 with `NIBBLE_CUDA_WEIGHTS=f32` (SGEMM, 32.1 GB).
//! * The measurement is `nibble_engine::decode_bench` through the engine's decode-worker path:
//!   each sequence's 32K-token prompt K/V arrive as page bytes (`Engine::reserve`,
//!   `import_page`, `start_decode`: the disaggregated hand-off) holding random values quantized
//!   by the reference quantize-on-write, instead of a 32K × batch prefill; then every
//!   `Engine::step` (the whole model, sampling, detokenization) is timed, device synchronized.
//! * A batch whose KV pool does not fit the device's free memory (less 4 GiB) is reported as
//!   such, not run.
//!
//! Run: `e2e_decode` (context 32768, batches 1,8,16,32,64, 4 warm-up and 32 timed steps per
//! batch, plus as many at context 16 for the context share); `e2e_decode --quick` (context 4096,
//! batches 1 and 8, 2 + 8 steps); `e2e_decode --device cpu --tiny` (the 2-layer test shape on the
//! CPU backend). Other flags: `--context N --batches 1,8 --warmup N --steps N --dtypes fp8,nvfp4
//! --seed N --no-baseline --threads N` (CPU threads), `--hadamard` (the cache Hadamard-rotated),
//! `--k-codes` (an nvfp4 cache choosing K's codes for the queries, with mixing factors),
//! `--graphs off|on|both` (decode steps as CUDA graphs or not; `both` measures each dtype without
//! then with them and reports whether every sequence's tokens are identical; the default is
//! `NIBBLE_CUDA_GRAPHS`'s). Exits 1, saying why, when the GPU cannot be used (no driver, no
//! device, no NVRTC).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nibble_cuda::CudaBackend;
use nibble_engine::decode_bench::{DecodeBench, Outcome, Run, Timing};
use nibble_engine::synthetic::{llama3_8b, random_model, tiny_llama, tokenizer};
use nibble_engine::{Backend, CpuBackend, ModelConfig};
use nibble_kvfmt::KvDtype;
use serde_json::json;

#[path = "support/args.rs"]
mod args;
use args::list;

/// Device memory left free beside the KV pool (workspace, cuBLAS, the driver).
const HEADROOM: usize = 4 << 30;
/// Pool budget on the CPU backend (the tiny shape needs a few MB).
const CPU_BUDGET: usize = 1 << 30;

struct Args {
    cpu: bool,
    tiny: bool,
    bench: DecodeBench,
    dtypes: Vec<KvDtype>,
    threads: usize,
    /// Graphs off and/or on, in this order; empty: as the backend starts.
    graphs: Vec<bool>,
}

fn parse() -> Result<Args> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let has = |f: &str| raw.iter().any(|a| a == f);
    let (tiny, quick) = (has("--tiny"), has("--quick"));
    let mut bench = DecodeBench {
        batches: vec![1, 8, 16, 32, 64],
        context: 32_768,
        warmup: 4,
        steps: 32,
        baseline_context: Some(16),
        distinct_pages: 16,
        seed: 0,
        hadamard: has("--hadamard"),
        k_codes: has("--k-codes"),
    };
    if quick {
        (bench.batches, bench.context, bench.warmup, bench.steps) = (vec![1, 8], 4096, 2, 8);
    }
    if tiny {
        (bench.batches, bench.context, bench.warmup, bench.steps) = (vec![1, 4], 256, 2, 8);
        bench.distinct_pages = 4;
    }
    let mut args = Args {
        cpu: false,
        tiny,
        bench,
        dtypes: KvDtype::ALL.to_vec(),
        threads: 2,
        graphs: Vec::new(),
    };
    let mut it = raw.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--tiny" | "--quick" | "--hadamard" | "--k-codes" => {}
            "--device" => match value()?.as_str() {
                "cuda" => args.cpu = false,
                "cpu" => args.cpu = true,
                other => bail!("--device is cuda or cpu, not {other}"),
            },
            "--context" => args.bench.context = value()?.parse()?,
            "--batches" => args.bench.batches = list(value()?)?,
            "--warmup" => args.bench.warmup = value()?.parse()?,
            "--steps" => args.bench.steps = value()?.parse()?,
            "--dtypes" => args.dtypes = list(value()?)?,
            "--seed" => args.bench.seed = value()?.parse()?,
            "--no-baseline" => args.bench.baseline_context = None,
            "--threads" => args.threads = value()?.parse()?,
            "--graphs" => {
                args.graphs = match value()?.as_str() {
                    "off" => vec![false],
                    "on" => vec![true],
                    "both" => vec![false, true],
                    other => bail!("--graphs is off, on or both, not {other}"),
                }
            }
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

fn main() -> Result<()> {
    // The backend's notes (kernel compiles, why a step ran without a graph) on stderr.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = parse()?;
    if args.cpu {
        if !args.graphs.is_empty() {
            bail!("--graphs needs the CUDA backend");
        }
        let backend = Arc::new(CpuBackend::new(args.threads)?);
        return measure(backend, &args, &|| {}, &|| Ok(None), &|_| json!(null));
    }
    let backend = Arc::new(CudaBackend::new(0).context(
        "e2e_decode needs a GPU for its CUDA mode (`--device cpu --tiny` runs on the CPU)",
    )?);
    let gpu = Arc::clone(&backend);
    let sync = move || {
        if let Err(e) = gpu.kernels().stream().synchronize() {
            panic!("CUDA: synchronize failed: {e}");
        }
    };
    let gpu = Arc::clone(&backend);
    let memory = move || -> Result<Option<(usize, usize)>> {
        Ok(Some(gpu.kernels().context().mem_get_info()?))
    };
    let gpu = Arc::clone(&backend);
    let graphs = move |on: Option<bool>| {
        if let Some(on) = on {
            gpu.set_decode_graphs(on);
        }
        let c = gpu.decode_graph_counts();
        json!({"on": gpu.decode_graphs(), "replayed": c.replayed, "captured": c.captured,
               "eager": c.eager})
    };
    measure(backend, &args, &sync, &memory, &graphs)
}

/// Builds the random model on `backend` and measures every dtype. `memory` gives the device's
/// (free, total) bytes, `None` on the CPU; `graphs` turns decode-step graphs on or off (`Some`)
/// and reports them (`null` on the CPU).
fn measure<B: Backend>(
    backend: Arc<B>,
    args: &Args,
    sync: &dyn Fn(),
    memory: &dyn Fn() -> Result<Option<(usize, usize)>>,
    graphs: &dyn Fn(Option<bool>) -> serde_json::Value,
) -> Result<()> {
    let bench = &args.bench;
    let (shape, config) = if args.tiny {
        ("tiny", tiny_llama(bench.max_tokens_held()))
    } else {
        ("llama3-8b", llama3_8b(bench.max_tokens_held()))
    };
    let before = memory()?;
    let started = Instant::now();
    let model = random_model(Arc::clone(&backend), config.clone(), bench.seed)?;
    let tokenizer = Arc::new(tokenizer(config.vocab_size)?);
    sync();
    let build_s = started.elapsed().as_secs_f64();
    let after = memory()?;
    emit(json!({
        "bench": "e2e_decode_model", "device": backend.name(), "shape": shape,
        "weights": format!("RANDOM (seed {}): speed only, outputs meaningless", bench.seed),
        "config": config_json(&config), "params": config.parameter_count(),
        // The weight precision is in `device` (the backend's name).
        "weight_bytes_on_device": before.zip(after).map(|(b, a)| b.0 - a.0), "build_s": build_s,
        "device_free_before": before.map(|m| m.0), "device_free_after": after.map(|m| m.0),
        "device_total": after.map(|m| m.1),
        "kv_fill": "prompt pages imported through Engine::import_page (decode-worker hand-off): \
                    random K/V quantized by the reference quantize-on-write, not a prefill",
        "warmup": bench.warmup, "steps": bench.steps,
    }));
    for &dtype in &args.dtypes {
        sync();
        let budget = match memory()? {
            Some((free, _)) => free.saturating_sub(HEADROOM),
            None => CPU_BUDGET,
        };
        eprintln!("e2e_decode: {dtype}, KV budget {:.1} GiB", gib(budget));
        let modes: Vec<Option<bool>> = match args.graphs.is_empty() {
            true => vec![None],
            false => args.graphs.iter().map(|&on| Some(on)).collect(),
        };
        let mut runs = Vec::new();
        for mode in modes {
            let state = graphs(mode);
            let ran = bench.run(&model, &tokenizer, dtype, budget, sync, &mut |o| {
                let mut r = row(o);
                r["graphs"] = state["on"].clone();
                emit(r)
            });
            match ran {
                Ok(outcomes) => runs.push(outcomes),
                Err(e) => {
                    // On stdout too, beside the rows that ran: the device tool keeps stdout files.
                    emit(json!({"bench": "e2e_decode", "dtype": dtype.to_string(),
                                "error": format!("{e:#}")}));
                    return Err(e.into());
                }
            }
            emit(
                json!({"bench": "e2e_decode_graphs", "dtype": dtype.to_string(),
                        "steps_after": graphs(None)}),
            );
        }
        if let [off, on] = &runs[..] {
            compare_graphs(dtype, off, on);
        }
    }
    Ok(())
}

/// The run of an outcome that ran.
fn ran(o: &Outcome) -> Option<&Run> {
    match o {
        Outcome::Ran(r) => Some(r),
        Outcome::DoesNotFit { .. } => None,
    }
}

/// One row per batch measured both without and with graphs: whether every sequence's tokens
/// are identical, and the speed-up.
fn compare_graphs(dtype: KvDtype, off: &[Outcome], on: &[Outcome]) {
    for (a, b) in off.iter().filter_map(ran).zip(on.iter().filter_map(ran)) {
        emit(json!({
            "bench": "e2e_decode_graphs", "dtype": dtype.to_string(), "batch": a.batch,
            "tokens_identical": a.tokens == b.tokens,
            "tokens_per_s_off": a.main.tokens_per_s(), "tokens_per_s_on": b.main.tokens_per_s(),
            "speedup": b.main.tokens_per_s() / a.main.tokens_per_s(),
        }));
    }
}

fn config_json(c: &ModelConfig) -> serde_json::Value {
    json!({
        "layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads,
        "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "ffn": c.intermediate_size,
        "vocab": c.vocab_size, "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
        "max_context": c.max_context,
    })
}

/// The engine's step phases (`nibble_engine::StepPhases`), in ms per timed step.
fn phase_ms(t: &Timing) -> serde_json::Value {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / t.steps.max(1) as f64;
    let p = t.phases;
    json!({"schedule": ms(p.schedule), "forward": ms(p.forward), "sample": ms(p.sample),
           "finish": ms(p.finish)})
}

fn row(outcome: &Outcome) -> serde_json::Value {
    match outcome {
        Outcome::Ran(r) => {
            let b = r.baseline;
            json!({
                "bench": "e2e_decode", "dtype": r.dtype.to_string(), "batch": r.batch,
                "context": r.main.context, "steps": r.main.steps,
                "tokens_per_s": r.main.tokens_per_s(), "ms_per_step": r.main.ms_per_step(),
                "seconds": r.main.seconds,
                "phase_ms_per_step": phase_ms(&r.main),
                "baseline_context": b.map(|b| b.context),
                "baseline_ms_per_step": b.map(|b| b.ms_per_step()),
                "baseline_tokens_per_s": b.map(|b| b.tokens_per_s()),
                "attn_share_est": r.context_share(),
                "seq_kv_bytes": r.seq_kv_bytes, "pool_bytes": r.pool_bytes,
                "fill_pages": r.fill.pages, "fill_cached_pages": r.fill.cached_pages,
                "fill_bytes": r.fill.bytes, "fill_s": r.fill.seconds,
                "fill_gb_per_s": r.fill.bytes as f64 / r.fill.seconds / 1e9,
                "seq0_tokens": r.tokens[0].iter().take(8).collect::<Vec<_>>(),
            })
        }
        Outcome::DoesNotFit {
            dtype,
            batch,
            needed_bytes,
            budget_bytes,
        } => json!({
            "bench": "e2e_decode", "dtype": dtype.to_string(), "batch": batch,
            "skipped": format!("does not fit: the KV pool needs {:.1} GiB, {:.1} GiB free",
                               gib(*needed_bytes), gib(*budget_bytes)),
            "needed_bytes": needed_bytes, "budget_bytes": budget_bytes,
        }),
    }
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn emit(value: serde_json::Value) {
    println!("{value}");
}
