//! Measures what a JSON-Schema constraint costs the serving engine on the CPU: decode tokens/s of
//! constrained requests against the same requests unconstrained, and the time to build the
//! vocabulary's token trie (once per tokenizer) and to compile the schema (once per request).
//!
//! `cargo run --release -p nibble-engine --example constrained_decode -- MODEL [threads] [streams]`
//!
//! Each of `streams` concurrent requests (default 1 and 4) asks, through the chat template, for a
//! JSON object listing 32 cities, under a schema that requires exactly 32 strings of at most 24
//! characters: the grammar decides every token's mask for a few hundred tokens. The unconstrained
//! run generates, greedily and ignoring end of sequence, as many tokens as its constrained
//! counterpart did. Decode speed is generated tokens over the time of the steps after the
//! first (the prompt's).

use std::sync::Arc;
use std::time::Instant;

use nibble_engine::grammar::Constraint;
use nibble_engine::sampling::SamplingParams;
use nibble_engine::scheduler::{SchedulerConfig, SeqId};
use nibble_engine::source::ModelSource;
use nibble_engine::Tokenizer;
use nibble_engine::{ChatMessage, CpuBackend, Engine, EngineConfig, Event, KvConfig, Model};
use nibble_kvfmt::KvDtype;

const SCHEMA: &str = r#"{
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 32,
            "maxItems": 32
        }
    },
    "required": ["cities"],
    "additionalProperties": false
}"#;

/// Runs `streams` copies of `params` on `prompt`; returns (tokens per stream, decode tok/s).
fn run(
    model: &Model<CpuBackend>,
    tokenizer: &Arc<Tokenizer>,
    prompt: &[u32],
    streams: usize,
    params: &SamplingParams,
) -> Result<(Vec<usize>, f64), Box<dyn std::error::Error>> {
    let config = EngineConfig {
        kv: KvConfig::new(KvDtype::Nvfp4),
        kv_budget_bytes: 64 << 20,
        scheduler: SchedulerConfig::default(),
    };
    let mut engine = Engine::new(model.clone(), Arc::clone(tokenizer), config)?;
    for s in 0..streams {
        engine.submit(SeqId(s as u64), prompt.to_vec(), params.clone())?;
    }
    let mut tokens = vec![0usize; streams];
    let mut first = true;
    let mut started = Instant::now();
    while engine.has_work() {
        for event in engine.step() {
            if let Event::Token { id, .. } = event {
                tokens[id.0 as usize] += 1;
            }
        }
        if first {
            first = false;
            started = Instant::now();
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    // The first step's tokens came with the prompt.
    let decoded = tokens.iter().sum::<usize>() - streams;
    Ok((tokens, decoded as f64 / seconds))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .ok_or("usage: constrained_decode MODEL [threads] [streams]")?;
    let threads: usize = args.get(2).map_or(Ok(2), |s| s.parse())?;
    let streams: Vec<usize> = match args.get(3) {
        Some(s) => vec![s.parse()?],
        None => vec![1, 4],
    };
    let source = ModelSource::open(path)?;
    let model = source.load_model(Arc::new(CpuBackend::new(threads)?))?;
    let tokenizer = Arc::new(source.load_tokenizer()?);

    let t = Instant::now();
    let compiler = tokenizer.grammars()?;
    println!(
        "token trie and parser factory: {:.1} ms (once per tokenizer)",
        t.elapsed().as_secs_f64() * 1e3
    );
    let constraint = Constraint::JsonSchema(SCHEMA.into());
    let compile = compiler.check(&constraint)?;
    let again = compiler.check(&constraint)?;
    println!(
        "schema compile: {:.2} ms first, {:.2} ms again",
        compile.as_secs_f64() * 1e3,
        again.as_secs_f64() * 1e3
    );

    let chat = tokenizer.render_chat(
        &[ChatMessage::new(
            "user",
            "List 32 cities of the world as JSON: {\"cities\": [...]}.",
        )],
        true,
    )?;
    let prompt = tokenizer.encode(&chat, false)?;
    for &n in &streams {
        let constrained = SamplingParams {
            constraint: Some(constraint.clone()),
            ..SamplingParams::greedy(1024)
        };
        let (tokens, with) = run(&model, &tokenizer, &prompt, n, &constrained)?;
        let free = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(tokens[0] as u32)
        };
        let (_, without) = run(&model, &tokenizer, &prompt, n, &free)?;
        println!(
            "streams {n}: {} tokens each; constrained {with:.1} tok/s, unconstrained {without:.1} tok/s: {:.1}%",
            tokens[0],
            100.0 * with / without
        );
    }
    Ok(())
}
