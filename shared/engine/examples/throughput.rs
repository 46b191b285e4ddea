//! Measures CPU prefill and decode speed of a GGUF model.
//!
//! `cargo run --release -p nibble-engine --example throughput -- MODEL.gguf [threads] [prompt_len] [decode_steps] [streams]`
//!
//! Prefill: one sequence of `prompt_len` tokens (default 512), logits of the last token only.
//! Decode: after that prefill, `decode_steps` (default 64) greedy steps of one token, single
//! stream; then the same with 4 and 8 streams batched (one token per stream per step).
//! `streams` is a comma-separated list replacing the default `1,4,8`.

use nibble_engine::{eval, CpuBackend, Logits, Model, SeqInput};
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .ok_or("usage: throughput MODEL.gguf [threads] [prompt_len] [decode_steps]")?;
    let threads: usize = args.get(2).map_or(Ok(2), |s| s.parse())?;
    let prompt_len: usize = args.get(3).map_or(Ok(512), |s| s.parse())?;
    let steps: usize = args.get(4).map_or(Ok(64), |s| s.parse())?;
    let stream_counts: Vec<usize> = match args.get(5) {
        Some(list) => list.split(',').map(str::parse).collect::<Result<_, _>>()?,
        None => vec![1, 4, 8],
    };

    let t0 = Instant::now();
    let model = Model::load_gguf(Arc::new(CpuBackend::new(threads)?), path)?;
    println!(
        "loaded in {:.2}s on {threads} threads",
        t0.elapsed().as_secs_f64()
    );
    let vocab = model.config().vocab_size as u32;
    // A deterministic prompt of ordinary token ids.
    let prompt: Vec<u32> = (0..prompt_len as u32)
        .map(|i| 1000 + (i * 7919) % (vocab - 1000))
        .collect();

    let mut ws = model.workspace();
    let mut logits = Vec::new();
    for streams in stream_counts {
        let mut kvs: Vec<_> = (0..streams)
            .map(|_| model.new_kv(prompt_len + steps))
            .collect();
        let t = Instant::now();
        for kv in kvs.iter_mut() {
            model.forward(
                &mut ws,
                &mut [SeqInput {
                    tokens: &prompt,
                    kv,
                }],
                Logits::Last,
                &mut logits,
            )?;
        }
        let prefill = t.elapsed().as_secs_f64();
        if streams == 1 {
            println!(
                "prefill {prompt_len} tokens: {:.3}s, {:.1} tokens/s",
                prefill,
                prompt_len as f64 / prefill
            );
        }
        let mut next: Vec<u32> = vec![eval::argmax(&logits[..vocab as usize]); streams];
        let t = Instant::now();
        for _ in 0..steps {
            let mut batch: Vec<SeqInput<'_, CpuBackend>> = kvs
                .iter_mut()
                .zip(&next)
                .map(|(kv, tok)| SeqInput {
                    tokens: std::slice::from_ref(tok),
                    kv: kv as &mut dyn nibble_engine::KvStore<CpuBackend>,
                })
                .collect();
            model.forward(&mut ws, &mut batch, Logits::Last, &mut logits)?;
            drop(batch);
            for (i, n) in next.iter_mut().enumerate() {
                *n = eval::argmax(&logits[i * vocab as usize..(i + 1) * vocab as usize]);
            }
        }
        let dt = t.elapsed().as_secs_f64();
        println!(
            "decode {streams} stream(s), {steps} steps from context {prompt_len}: {:.1} steps/s, {:.1} tokens/s",
            steps as f64 / dt,
            (steps * streams) as f64 / dt
        );
    }
    Ok(())
}
