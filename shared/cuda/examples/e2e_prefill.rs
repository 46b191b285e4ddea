//! e2e-prefill: time to first token of one long prompt through the serving engine, for a model
//! with Llama-3-8B's shape and RANDOM weights on the CUDA backend. One JSON object per line
//! (docs/BENCHMARKS.md, "Time to first token").
//!
//! * The model is `nibble_engine::synthetic::random_model` (seeded): speed only, the tokens mean
//!   nothing. Weights are BF16 on the device, as a loaded model's are.
//! * Each measurement submits one request of N random prompt tokens (no prefix cached) with one
//!   output token to an idle `Engine` in the serving configuration (the default scheduler: the
//!   prompt is computed in blocks of 256 tokens, each block's attention an extend over the
//!   blocks before it) and steps it until its first token, device synchronized: what a prefill
//!   worker does for a request, without the network.
//! * A 512-token request first warms the kernels, cuBLAS and the pool.
//!
//! Run: `e2e_prefill` (prompts of 4,096 and 32,768 tokens, NVFP4 KV, 2 runs each);
//! `NIBBLE_PREFILL_KERNEL=mma e2e_prefill` times the mma.sync attention instead of wgmma on
//! Hopper. Flags: `--prompts 4096,32768 --dtypes nvfp4,fp8 --runs N --seed N --prefill-work
//! fp8|bf16` (the prefill workspace's dtype; the cache's by default), `--k-codes` (an nvfp4 cache
//! choosing K's codes for the queries, with mixing factors: what the encoder costs a prompt); `--device cpu
//! --tiny` runs the 2-layer test shape on the CPU. Exits 1, saying why, when the GPU cannot be
//! used.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nibble_cuda::CudaBackend;
use nibble_engine::paged::WorkDtype;
use nibble_engine::sampling::SamplingParams;
use nibble_engine::scheduler::{SchedulerConfig, SeqId};
use nibble_engine::synthetic::{llama3_8b, random_model, tiny_llama, tokenizer};
use nibble_engine::{Backend, CpuBackend, Engine, EngineConfig, Event, KvConfig};
use nibble_kvfmt::nvfp4::feedback::KeyFactors;
use nibble_kvfmt::KvDtype;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

#[path = "support/args.rs"]
mod args;
use args::list;

struct Args {
    cpu: bool,
    tiny: bool,
    prompts: Vec<usize>,
    dtypes: Vec<KvDtype>,
    runs: usize,
    seed: u64,
    work: Option<WorkDtype>,
    /// An nvfp4 cache chooses K's codes for the queries (mixing factors): the encoder's cost.
    k_codes: bool,
}

fn parse() -> Result<Args> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let tiny = raw.iter().any(|a| a == "--tiny");
    let mut args = Args {
        cpu: false,
        tiny,
        prompts: if tiny { vec![300] } else { vec![4096, 32768] },
        dtypes: vec![KvDtype::Nvfp4],
        runs: 2,
        seed: 0,
        work: None,
        k_codes: raw.iter().any(|a| a == "--k-codes"),
    };
    let mut it = raw.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--tiny" | "--k-codes" => {}
            "--device" => match value()?.as_str() {
                "cuda" => args.cpu = false,
                "cpu" => args.cpu = true,
                other => bail!("--device is cuda or cpu, not {other}"),
            },
            "--prompts" => args.prompts = list(value()?)?,
            "--dtypes" => args.dtypes = list(value()?)?,
            "--runs" => args.runs = value()?.parse()?,
            "--seed" => args.seed = value()?.parse()?,
            "--prefill-work" => {
                args.work = Some(WorkDtype::parse(value()?).map_err(anyhow::Error::msg)?)
            }
            other => bail!("unknown argument {other}"),
        }
    }
    if args.prompts.is_empty() || args.prompts.contains(&0) || args.runs == 0 {
        bail!("--prompts needs lengths above 0 and --runs at least 1");
    }
    Ok(args)
}

fn main() -> Result<()> {
    let args = parse()?;
    if args.cpu {
        let backend = Arc::new(CpuBackend::new(2)?);
        return measure(backend, &args, "cpu", &|| {});
    }
    let backend = Arc::new(CudaBackend::new(0).context(
        "e2e_prefill needs a GPU for its CUDA mode (`--device cpu --tiny` runs on the CPU)",
    )?);
    let kernel = backend.kernels().prefill_kernel().to_string();
    let gpu = Arc::clone(&backend);
    let sync = move || {
        if let Err(e) = gpu.kernels().stream().synchronize() {
            panic!("CUDA: synchronize failed: {e}");
        }
    };
    measure(backend, &args, &kernel, &sync)
}

fn measure<B: Backend>(backend: Arc<B>, args: &Args, kernel: &str, sync: &dyn Fn()) -> Result<()> {
    let longest = args.prompts.iter().copied().max().unwrap_or(1).max(512);
    let context = longest + 16;
    let (shape, config) = if args.tiny {
        ("tiny", tiny_llama(context))
    } else {
        ("llama3-8b", llama3_8b(context))
    };
    let started = Instant::now();
    let model = random_model(Arc::clone(&backend), config.clone(), args.seed)?;
    let tokenizer = Arc::new(tokenizer(config.vocab_size)?);
    sync();
    emit(json!({
        "bench": "e2e_prefill_model", "device": backend.name(), "shape": shape,
        "weights": format!("RANDOM (seed {}): speed only, outputs meaningless", args.seed),
        "params": config.parameter_count(), "build_s": started.elapsed().as_secs_f64(),
        "prefill_kernel": kernel,
    }));
    let mut rng = StdRng::seed_from_u64(args.seed ^ 0x7f7f);
    for &dtype in &args.dtypes {
        let c = model.config();
        let k_codes = (args.k_codes && dtype == KvDtype::Nvfp4).then(|| {
            let factors = KeyFactors::mixing(c.num_layers, c.num_kv_heads, c.head_dim, args.seed);
            std::sync::Arc::new(factors)
        });
        let kv = KvConfig {
            prefill_work: args.work,
            k_codes,
            ..KvConfig::new(dtype)
        };
        let kv_work = kv.work();
        let with_k_codes = kv.k_codes.is_some();
        let layout = kv.layout(&model)?;
        let window = kv.window_layout(&layout).map_or(0, |w| w.pages());
        // one sequence of the longest prompt at a time, and the warm-up's
        let pages = 2 * (context.div_ceil(layout.page_size()) + window);
        let engine_config = EngineConfig {
            kv,
            kv_budget_bytes: pages * layout.page_bytes(),
            scheduler: SchedulerConfig {
                max_context: context,
                ..SchedulerConfig::default()
            },
        };
        let mut engine = Engine::new(model.clone(), Arc::clone(&tokenizer), engine_config)?;
        let mut id = 0u64;
        first_token(&mut engine, &mut id, 512, &mut rng, sync)?;
        for &prompt in &args.prompts {
            for run in 0..args.runs {
                let (seconds, steps) = first_token(&mut engine, &mut id, prompt, &mut rng, sync)?;
                emit(json!({
                    "bench": "e2e_prefill", "dtype": dtype.to_string(), "prompt": prompt,
                    "prefill_work": kv_work.name(), "k_codes": with_k_codes,
                    "run": run, "prefill_kernel": kernel, "ttft_ms": seconds * 1e3,
                    "steps": steps, "prompt_tokens_per_s": prompt as f64 / seconds,
                }));
            }
        }
    }
    Ok(())
}

/// Submits `prompt` random tokens with one output token and steps the engine until that token;
/// returns the seconds it took (device synchronized) and the steps.
fn first_token<B: Backend>(
    engine: &mut Engine<B>,
    id: &mut u64,
    prompt: usize,
    rng: &mut StdRng,
    sync: &dyn Fn(),
) -> Result<(f64, usize)> {
    let vocab = engine.model().config().vocab_size as u32;
    let tokens: Vec<u32> = (0..prompt).map(|_| rng.gen_range(0..vocab)).collect();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(1)
    };
    *id += 1;
    let seq = SeqId(*id);
    sync();
    let started = Instant::now();
    engine
        .submit(seq, tokens, params)
        .map_err(|e| anyhow::anyhow!("submit: {e}"))?;
    let mut steps = 0;
    loop {
        let events = engine.step();
        steps += 1;
        for event in &events {
            match event {
                Event::Finished {
                    error: Some(error), ..
                } => bail!("the request failed: {error}"),
                Event::Token { id, .. } if *id == seq => {
                    sync();
                    let seconds = started.elapsed().as_secs_f64();
                    // let the request finish so its pages return
                    while engine.has_work() {
                        engine.step();
                    }
                    return Ok((seconds, steps));
                }
                _ => {}
            }
        }
        if !engine.has_work() {
            bail!("the engine went idle without a first token");
        }
    }
}

fn emit(value: serde_json::Value) {
    println!("{value}");
}
