//! Measures the serving engine — continuous batching over the paged KV cache — on the CPU, for
//! each KV dtype: prefill speed of one prompt, then decode speed with 1, 4 and 8 concurrent
//! streams at that context.
//!
//! `cargo run --release -p nibble-engine --example serve_throughput -- MODEL [threads] [prompt_len] [decode_tokens]`
//!
//! Each stream gets its own prompt (no prefix sharing) of `prompt_len` tokens (default 512) and
//! generates `decode_tokens` (default 64) greedy tokens, ignoring end of sequence. Prefill time is
//! the first step's time (the whole prompt fits the token budget); decode speed is generated
//! tokens over the time of the remaining steps.

use std::sync::Arc;
use std::time::Instant;

use nibble_engine::sampling::SamplingParams;
use nibble_engine::scheduler::{SchedulerConfig, SeqId};
use nibble_engine::source::ModelSource;
use nibble_engine::{CpuBackend, Engine, EngineConfig, Event, KvConfig};
use nibble_kvfmt::KvDtype;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .ok_or("usage: serve_throughput MODEL [threads] [prompt_len] [decode_tokens]")?;
    let threads: usize = args.get(2).map_or(Ok(2), |s| s.parse())?;
    let prompt_len: usize = args.get(3).map_or(Ok(512), |s| s.parse())?;
    let decode_tokens: u32 = args.get(4).map_or(Ok(64), |s| s.parse())?;
    let source = ModelSource::open(path)?;
    let model = source.load_model(Arc::new(CpuBackend::new(threads)?))?;
    let tokenizer = Arc::new(source.load_tokenizer()?);
    let vocab = model.config().vocab_size as u32;
    println!(
        "{} threads, prompt {prompt_len}, {decode_tokens} decode tokens",
        threads
    );
    for dtype in KvDtype::ALL {
        for streams in [1usize, 4, 8] {
            let kv = KvConfig::new(dtype);
            let page_bytes = kv.layout(&model)?.page_bytes();
            let pages = streams * (prompt_len + decode_tokens as usize).div_ceil(16) + 8;
            let config = EngineConfig {
                kv,
                kv_budget_bytes: pages * page_bytes,
                scheduler: SchedulerConfig {
                    max_batch_tokens: prompt_len,
                    ..SchedulerConfig::default()
                },
            };
            let mut engine = Engine::new(model.clone(), Arc::clone(&tokenizer), config)?;
            let params = SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(decode_tokens)
            };
            // Prefill each stream's prompt, one step each, and time it.
            let mut prefill = 0.0;
            for s in 0..streams {
                let prompt: Vec<u32> = (0..prompt_len as u32)
                    .map(|i| 1000 + (i * 7919 + s as u32 * 104_729) % (vocab - 1000))
                    .collect();
                engine.submit(SeqId(s as u64), prompt, params.clone())?;
                let t = Instant::now();
                engine.step();
                prefill += t.elapsed().as_secs_f64();
            }
            let t = Instant::now();
            let mut generated = 0usize;
            while engine.has_work() {
                for event in engine.step() {
                    if let Event::Token { .. } = event {
                        generated += 1;
                    }
                }
            }
            let decode = t.elapsed().as_secs_f64();
            println!(
                "{dtype:>5} streams {streams}: prefill {:.1} tok/s, decode {:.1} tok/s ({generated} tokens in {decode:.2}s)",
                (streams * prompt_len) as f64 / prefill,
                generated as f64 / decode
            );
        }
    }
    Ok(())
}
