//! Shared helpers of the model tests: finding the model file and loading it once.

use nibble_engine::gguf::GgufFile;
use std::path::PathBuf;

pub use nibble_testkit::model_path;

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
