//! What the engine's model tests share: opening the model file, an engine over it.

use std::sync::Arc;

use nibble_engine::gguf::GgufFile;
use nibble_engine::scheduler::SchedulerConfig;
use nibble_engine::{CpuBackend, Engine, EngineConfig, KvConfig, Model, Tokenizer};
use nibble_kvfmt::KvDtype;

use nibble_testkit::model_path;

/// Opens the model file.
pub fn open_model() -> GgufFile {
    let path = model_path();
    GgufFile::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}

/// An engine over `model` with a pool of 64 pages of `dtype`.
#[allow(dead_code)] // tests/handoff.rs, tests/resume.rs
pub fn engine(
    model: &Model<CpuBackend>,
    tokenizer: &Arc<Tokenizer>,
    dtype: KvDtype,
) -> Engine<CpuBackend> {
    let kv = KvConfig::new(dtype);
    let page_bytes = kv.layout(model).unwrap().page_bytes();
    let config = EngineConfig {
        kv,
        kv_budget_bytes: 64 * page_bytes,
        scheduler: SchedulerConfig::default(),
    };
    Engine::new(model.clone(), Arc::clone(tokenizer), config).unwrap()
}
