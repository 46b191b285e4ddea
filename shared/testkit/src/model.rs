//! The test model, loaded once per process, and the tokens it gives.

use std::sync::{Arc, OnceLock};

use nibble_engine::sampling::SamplingParams;
use nibble_engine::scheduler::{SchedulerConfig, SeqId};
use nibble_engine::{
    CpuBackend, Engine, EngineConfig, Event, KvConfig, Model, ModelSource, Tokenizer,
};
use nibble_kvfmt::KvDtype;

use crate::model_path;

/// The model at [`model_path`] on the CPU (two threads) and its tokenizer, loaded on first use
/// and shared by every test of the process.
pub fn model() -> &'static (Model<CpuBackend>, Arc<Tokenizer>) {
    static MODEL: OnceLock<(Model<CpuBackend>, Arc<Tokenizer>)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let source = ModelSource::open(model_path()).unwrap();
        let model = source
            .load_model(Arc::new(CpuBackend::new(2).unwrap()))
            .unwrap();
        (model, Arc::new(source.load_tokenizer().unwrap()))
    })
}

/// The configuration of an engine over [`model()`]: a pool of `pages` KV pages of `dtype`,
/// scheduled by `scheduler`.
pub fn engine_config(dtype: KvDtype, pages: usize, scheduler: SchedulerConfig) -> EngineConfig {
    let kv = KvConfig::new(dtype);
    let page_bytes = kv.layout(&model().0).unwrap().page_bytes();
    EngineConfig {
        kv,
        kv_budget_bytes: pages * page_bytes,
        scheduler,
    }
}

/// The greedy tokens one engine over [`model()`] (its KV cache in `dtype`, 32 MiB of pages) gives
/// each prompt in turn, `max_tokens` each: what a cluster must give. Later prompts reuse the
/// pages of earlier ones, as a worker's prefix cache does.
pub fn reference(dtype: KvDtype, prompts: &[Vec<u32>], max_tokens: u32) -> Vec<Vec<u32>> {
    reference_with(dtype, prompts, &SamplingParams::greedy(max_tokens))
}

/// As [`reference`], with every prompt sampled by `params` (a constraint, say).
pub fn reference_with(
    dtype: KvDtype,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
) -> Vec<Vec<u32>> {
    let (model, tokenizer) = model();
    let config = EngineConfig {
        kv: KvConfig::new(dtype),
        kv_budget_bytes: 32 << 20,
        scheduler: SchedulerConfig::default(),
    };
    let mut engine = Engine::new(model.clone(), Arc::clone(tokenizer), config).unwrap();
    let mut out = Vec::new();
    for (n, prompt) in prompts.iter().enumerate() {
        engine
            .submit(SeqId(n as u64), prompt.clone(), params.clone())
            .unwrap();
        let mut tokens = Vec::new();
        while engine.has_work() {
            for event in engine.step() {
                if let Event::Token { token, .. } = event {
                    tokens.push(token);
                }
            }
        }
        out.push(tokens);
    }
    out
}
