//! [`ModelSource`]: the one entry point that opens a model by path, whatever its format.
//!
//! A directory is a Hugging Face checkpoint ([`HfModelDir`]); a file is GGUF ([`GgufFile`]).
//!
//! ```no_run
//! use nibble_engine::{CpuBackend, ModelSource};
//! use std::sync::Arc;
//!
//! # fn main() -> nibble_engine::Result<()> {
//! let source = ModelSource::open("models/Qwen2.5-0.5B-Instruct")?; // or a .gguf file
//! let model = source.load_model(Arc::new(CpuBackend::new(2)?))?;
//! let tokenizer = source.load_tokenizer()?;
//! # Ok(())
//! # }
//! ```

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::hf::HfModelDir;
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use crate::weights::LoadProgress;
use std::path::Path;
use std::sync::Arc;

/// An opened model, before its weights are loaded.
pub enum ModelSource {
    /// A GGUF file (metadata parsed, tensors mapped).
    Gguf(GgufFile),
    /// A Hugging Face model directory (config read, safetensors mapped).
    HuggingFace(HfModelDir),
}

impl ModelSource {
    /// The name a model at `path` is served under when none is given: its file or directory
    /// name without a `.gguf` extension (`models/SmolLM2-135M-Instruct.Q4_1.gguf` is
    /// `SmolLM2-135M-Instruct.Q4_1`). Workers and the router agree on it by default.
    pub fn default_name(path: &Path) -> String {
        let name = path
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
        match name.strip_suffix(".gguf") {
            Some(stem) if !stem.is_empty() => stem.to_string(),
            _ => name,
        }
    }

    /// Opens `path`: a directory as a Hugging Face model, anything else as a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            HfModelDir::open(path).map(Self::HuggingFace)
        } else {
            GgufFile::open(path).map(Self::Gguf)
        }
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            Self::Gguf(file) => ModelConfig::from_gguf(file),
            Self::HuggingFace(dir) => Ok(dir.config().clone()),
        }
    }

    /// Loads the weights onto `backend` (converted to f32 once, shared by the model's clones).
    pub fn load_model<B: Backend>(&self, backend: Arc<B>) -> Result<Model<B>> {
        self.load_model_observed(backend, &|_, _| {})
    }

    /// [`Self::load_model`], telling `progress(done, total)` as the blocks load (a progress
    /// bar's feed; see [`LoadProgress`]).
    pub fn load_model_observed<B: Backend>(
        &self,
        backend: Arc<B>,
        progress: LoadProgress<'_>,
    ) -> Result<Model<B>> {
        match self {
            Self::Gguf(file) => Model::from_gguf_observed(backend, file, progress),
            Self::HuggingFace(dir) => dir.load_model_observed(backend, progress),
        }
    }

    /// Loads the tokenizer (with special tokens and chat template).
    pub fn load_tokenizer(&self) -> Result<Tokenizer> {
        match self {
            Self::Gguf(file) => Tokenizer::from_gguf(file),
            Self::HuggingFace(dir) => dir.tokenizer(),
        }
    }
}

#[cfg(test)]
mod name_tests {
    use super::*;

    #[test]
    fn default_name_drops_the_gguf_extension_only() {
        let name = |p: &str| ModelSource::default_name(Path::new(p));
        assert_eq!(
            name("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            "SmolLM2-135M-Instruct.Q4_1"
        );
        assert_eq!(name("/srv/Qwen3-0.6B"), "Qwen3-0.6B");
        assert_eq!(name(".gguf"), ".gguf");
        assert_eq!(name("/"), "model");
    }
}
