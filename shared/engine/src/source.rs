//! [`ModelSource`]: the one entry point that opens a model by path, whatever its format.
//!
//! A directory is a Hugging Face checkpoint ([`HfModelDir`]); a file is GGUF ([`GgufFile`]);
//! `synthetic:<shape>` ([`SyntheticModel`]) is a model of a known shape with random weights, for
//! measuring speed at a size whose checkpoint is not at hand (`synthetic:llama3-8b`).
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
use crate::error::Error;
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::hf::HfModelDir;
use crate::model::Model;
use crate::synthetic;
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
    /// Random weights of a named shape.
    Synthetic(SyntheticModel),
}

/// A `synthetic:<shape>[@<seed>]` model: random weights ([`synthetic::random_model`], the same
/// on every worker for one seed, 0 by default) and the synthetic tokenizer, in which every id
/// decodes and there is no end-of-sequence token. It measures speed, never quality: whatever
/// reports numbers from it must say the weights are random.
#[derive(Debug, Clone)]
pub struct SyntheticModel {
    /// The shape's name (`llama3-8b`, `tiny-llama`).
    pub shape: String,
    pub seed: u64,
    config: ModelConfig,
}

/// The prefix that names a synthetic model in place of a path.
pub const SYNTHETIC_PREFIX: &str = "synthetic:";

/// A synthetic shape: its name, its config for a context length, the context its RoPE tables
/// are built for.
type Shape = (&'static str, fn(usize) -> ModelConfig, usize);

/// The shapes `synthetic:` knows.
const SYNTHETIC_SHAPES: [Shape; 2] = [
    ("llama3-8b", synthetic::llama3_8b, 131_072),
    ("tiny-llama", synthetic::tiny_llama, 8_192),
];

impl SyntheticModel {
    /// Parses `synthetic:<shape>[@<seed>]`; `None` when `spec` does not start with `synthetic:`.
    pub fn parse(spec: &str) -> Option<Result<Self>> {
        let rest = spec.strip_prefix(SYNTHETIC_PREFIX)?;
        let (shape, seed) = match rest.split_once('@') {
            Some((shape, seed)) => match seed.parse::<u64>() {
                Ok(seed) => (shape, seed),
                Err(_) => {
                    return Some(Err(Error::InvalidConfig(format!(
                        "{spec}: the seed after '@' must be a whole number, not {seed:?}"
                    ))))
                }
            },
            None => (rest, 0),
        };
        let known = || {
            let names: Vec<&str> = SYNTHETIC_SHAPES.iter().map(|(n, ..)| *n).collect();
            names.join(", ")
        };
        Some(
            match SYNTHETIC_SHAPES.iter().find(|(name, ..)| *name == shape) {
                Some((name, config, context)) => Ok(Self {
                    shape: name.to_string(),
                    seed,
                    config: config(*context),
                }),
                None => Err(Error::InvalidConfig(format!(
                    "{spec}: no synthetic model shape {shape:?} (known: {})",
                    known()
                ))),
            },
        )
    }
}

impl ModelSource {
    /// The name a model at `path` is served under when none is given: its file or directory
    /// name without a `.gguf` extension (`models/SmolLM2-135M-Instruct.Q4_1.gguf` is
    /// `SmolLM2-135M-Instruct.Q4_1`). Workers and the router agree on it by default.
    /// A synthetic model is served as `synthetic-<shape>`.
    pub fn default_name(path: &Path) -> String {
        if let Some(Ok(model)) = Self::synthetic(path) {
            return format!("synthetic-{}", model.shape);
        }
        let name = path
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
        match name.strip_suffix(".gguf") {
            Some(stem) if !stem.is_empty() => stem.to_string(),
            _ => name,
        }
    }

    /// Opens `path`: `synthetic:<shape>` (when no file has that name) as a synthetic model, a
    /// directory as a Hugging Face model, anything else as a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if let Some(model) = Self::synthetic(path) {
            return model.map(Self::Synthetic);
        }
        if path.is_dir() {
            HfModelDir::open(path).map(Self::HuggingFace)
        } else {
            GgufFile::open(path).map(Self::Gguf)
        }
    }

    /// The synthetic model `path` names, unless a file or directory of that name exists.
    pub fn synthetic(path: &Path) -> Option<Result<SyntheticModel>> {
        if path.exists() {
            return None;
        }
        path.to_str().and_then(SyntheticModel::parse)
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            Self::Gguf(file) => ModelConfig::from_gguf(file),
            Self::HuggingFace(dir) => Ok(dir.config().clone()),
            Self::Synthetic(model) => Ok(model.config.clone()),
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
            Self::Synthetic(model) => synthetic::random_model_observed(
                backend,
                model.config.clone(),
                model.seed,
                progress,
            ),
        }
    }

    /// Loads the tokenizer (with special tokens and chat template).
    pub fn load_tokenizer(&self) -> Result<Tokenizer> {
        match self {
            Self::Gguf(file) => Tokenizer::from_gguf(file),
            Self::HuggingFace(dir) => dir.tokenizer(),
            Self::Synthetic(model) => synthetic::tokenizer(model.config.vocab_size),
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
        assert_eq!(name("synthetic:llama3-8b@3"), "synthetic-llama3-8b");
    }

    #[test]
    fn synthetic_specs_name_a_shape_and_a_seed() {
        let open = |s: &str| ModelSource::open(s);
        let Ok(ModelSource::Synthetic(m)) = open("synthetic:tiny-llama@7") else {
            panic!("synthetic:tiny-llama@7 opens as a synthetic model");
        };
        assert_eq!((m.shape.as_str(), m.seed), ("tiny-llama", 7));
        let Ok(ModelSource::Synthetic(m)) = open("synthetic:llama3-8b") else {
            panic!("synthetic:llama3-8b opens as a synthetic model");
        };
        assert_eq!(m.seed, 0);
        assert_eq!(m.config.num_layers, 32);
        let err = |s: &str| match open(s) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{s} opened"),
        };
        assert!(err("synthetic:llama9").contains("no synthetic model shape \"llama9\""));
        assert!(err("synthetic:llama9").contains("llama3-8b, tiny-llama"));
        assert!(err("synthetic:tiny-llama@x").contains("seed"));
    }

    #[test]
    fn a_synthetic_model_loads_and_its_tokenizer_covers_the_vocabulary() {
        let source = ModelSource::open("synthetic:tiny-llama").unwrap();
        let config = source.config().unwrap();
        let steps = std::sync::Mutex::new(Vec::new());
        let model = source
            .load_model_observed(Arc::new(crate::CpuBackend::new(1).unwrap()), &|d, t| {
                steps.lock().unwrap().push((d, t))
            })
            .unwrap();
        assert_eq!(model.config().vocab_size, config.vocab_size);
        let steps = steps.into_inner().unwrap();
        assert_eq!(
            steps.last(),
            Some(&(config.num_layers + 1, config.num_layers + 1))
        );
        let tokenizer = source.load_tokenizer().unwrap();
        assert_eq!(tokenizer.vocab_size(), config.vocab_size);
    }
}
