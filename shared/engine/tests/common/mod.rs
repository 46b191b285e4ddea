//! What the engine's model tests share: opening the model file.

use nibble_engine::gguf::GgufFile;

use nibble_testkit::model_path;

/// Opens the model file.
pub fn open_model() -> GgufFile {
    let path = model_path();
    GgufFile::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}
