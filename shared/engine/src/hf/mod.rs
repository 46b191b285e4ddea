//! Hugging Face model directories, as `save_pretrained` writes them: `config.json`, one or more
//! `*.safetensors` files (sharded through `model.safetensors.index.json`), `tokenizer.json`
//! and `tokenizer_config.json` (optionally `generation_config.json`, `chat_template.jinja`).
//!
//! Supported: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
//! `Qwen3ForCausalLM` checkpoints in F32, F16 or BF16. [`HfModelDir::open`] reads the config
//! and maps the safetensors files (headers parsed, nothing converted); weights are converted
//! to f32 when [`HfModelDir::load_model`] uploads them. [`crate::ModelSource`] picks between
//! this and GGUF by path.
//!
//! * [`config`]: `config.json` → [`ModelConfig`], refusing features the forward pass lacks.
//! * [`checkpoint`]: the safetensors files as one tensor namespace.
//! * [`weights`]: `Weights::from_hf`, by `transformers` tensor names.
//! * [`tokenizer`]: `Tokenizer::from_hf_dir` (reads tokenizer.json and its companions).

pub mod checkpoint;
pub mod config;
pub mod tokenizer;
pub mod weights;

pub use checkpoint::Checkpoint;

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use crate::weights::{LoadProgress, Weights};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An opened Hugging Face model directory: its config and its mapped checkpoint.
pub struct HfModelDir {
    dir: PathBuf,
    config: ModelConfig,
    checkpoint: Checkpoint,
}

impl HfModelDir {
    /// Reads `config.json` and opens the safetensors files of the model in `dir`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_hf_json(&checkpoint::read_json(&dir.join("config.json"))?)?;
        let checkpoint = Checkpoint::open(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            checkpoint,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The checkpoint's tensors.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// Converts and uploads every weight.
    pub fn load_weights<B: Backend>(&self, backend: &B) -> Result<Weights<B>> {
        Weights::from_hf(backend, &self.checkpoint, &self.config)
    }

    /// Loads the model onto `backend`.
    pub fn load_model<B: Backend>(&self, backend: Arc<B>) -> Result<Model<B>> {
        self.load_model_observed(backend, &|_, _| {})
    }

    /// [`Self::load_model`], telling `progress` as the blocks load.
    pub fn load_model_observed<B: Backend>(
        &self,
        backend: Arc<B>,
        progress: LoadProgress<'_>,
    ) -> Result<Model<B>> {
        let weights =
            Weights::from_hf_observed(&*backend, &self.checkpoint, &self.config, progress)?;
        Model::new(backend, self.config.clone(), weights)
    }

    /// Loads the directory's tokenizer.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        Tokenizer::from_hf_dir(&self.dir)
    }
}

#[cfg(test)]
mod tests;
