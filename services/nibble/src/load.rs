//! Opening a model and the inputs that go with it, checking each before the slow part.
//!
//! The order is fixed so that a bad input fails fast: the model path must exist, its config and
//! tokenizer are read (cheap: the weights are only memory-mapped), a calibration file is checked
//! against the model's layer count, and only then are the weights converted to f32 on the
//! `--device`'s backend: a [`CpuBackend`] with the requested threads, or a [`CudaBackend`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use nibble_cuda::{CudaBackend, Device, KvNeeds};
use nibble_engine::calibrate::Calibration;
use nibble_engine::{Backend, CpuBackend, KvConfig, Model, ModelConfig, ModelSource, Tokenizer};
use nibble_kvfmt::KvDtype;
use nibble_telemetry::progress::{Bar, Unit};

use crate::cli::{ModelArgs, QuantArgs};
use crate::{files, Error, Result};

/// An opened model whose weights are not loaded yet.
pub struct Opened {
    path: PathBuf,
    threads: usize,
    device: Device,
    source: ModelSource,
    config: ModelConfig,
    tokenizer: Tokenizer,
}

impl Opened {
    /// Opens `--model`, reading its config and tokenizer.
    pub fn open(args: &ModelArgs) -> Result<Self> {
        let path = args.model.clone();
        crate::fetch::ensure_default_model(&path)?;
        let fail = |source| Error::Model {
            path: path.clone(),
            source,
        };
        let source = ModelSource::open(&path).map_err(fail)?;
        let config = source.config().map_err(fail)?;
        let tokenizer = source.load_tokenizer().map_err(fail)?;
        Ok(Self {
            threads: args.threads(),
            device: args.device,
            path,
            source,
            config,
            tokenizer,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Tokenizes a UTF-8 text file whole, without a BOS token.
    pub fn tokenize_file(&self, path: &Path) -> Result<Vec<u32>> {
        let bytes = files::read(path)?;
        let text = String::from_utf8(bytes).map_err(|e| Error::NotUtf8 {
            path: path.to_path_buf(),
            offset: e.utf8_error().valid_up_to(),
        })?;
        self.tokenizer
            .encode(&text, false)
            .map_err(|source| Error::Tokenize {
                path: path.to_path_buf(),
                source,
            })
    }

    /// The KV config of a `dtype` cache with these flags, its calibration file read and checked
    /// against this model.
    pub fn kv_config(&self, dtype: KvDtype, quant: &QuantArgs) -> Result<KvConfig> {
        if quant.hadamard && !nibble_engine::hadamard::supported(self.config.head_dim) {
            return Err(Error::Flag {
                flag: "--hadamard",
                reason: format!(
                    "needs a power-of-two head dim; the model's is {}",
                    self.config.head_dim
                ),
            });
        }
        let calibration = match &quant.calibration {
            Some(path) => Some(read_calibration(path, self.config.num_layers)?),
            None => None,
        };
        let (window, from_file) = KvConfig::chosen_window(
            dtype,
            quant.page_size,
            quant.kv_window,
            calibration.as_ref(),
        );
        let flag = if from_file {
            "--calibration's nvfp4_window"
        } else {
            "--kv-window"
        };
        if !window.is_multiple_of(quant.page_size) {
            return Err(Error::Flag {
                flag,
                reason: format!(
                    "{window} tokens is not a multiple of the page size ({})",
                    quant.page_size
                ),
            });
        }
        if window > self.config.max_context {
            return Err(Error::Flag {
                flag,
                reason: format!(
                    "{window} tokens is larger than the model's context ({})",
                    self.config.max_context
                ),
            });
        }
        if let Some(work) = quant.prefill_work {
            work.check_cache(dtype).map_err(|why| Error::Flag {
                flag: "--prefill-work",
                reason: format!("{} {why}", work.name()),
            })?;
        }
        let kv = KvConfig {
            page_size: quant.page_size,
            hadamard: quant.hadamard,
            scale_rule: quant.scale_rule,
            window,
            prefill_work: quant.prefill_work,
            ..KvConfig::new(dtype)
        };
        match quant.calibration.as_ref().zip(calibration.as_ref()) {
            Some((path, calibration)) => kv
                .with_calibration(calibration, !quant.no_smooth_k)
                .and_then(|kv| {
                    kv.with_k_codes(calibration, self.config.head_dim, !quant.no_k_codes)
                })
                .map_err(|source| Error::Calibration {
                    path: path.clone(),
                    source,
                }),
            None => Ok(kv),
        }
    }

    /// Loads the weights on `--device`'s backend; returns the model and its tokenizer. Run
    /// the command on it with [`with_model!`](crate::with_model).
    /// `kv`: the cache the model will run with, if any (`auto` keeps a cache the CUDA backend
    /// cannot run on the CPU).
    pub fn load(self, kv: Option<&KvConfig>) -> Result<(LoadedModel, Tokenizer)> {
        let needs = KvNeeds::of(&self.config, kv.map_or(16, |kv| kv.page_size));
        let cuda = self
            .device
            .start(needs, |why| {
                eprintln!("nibble: --device auto: {why}; using the CPU")
            })
            .map_err(|e| Error::Flag {
                flag: "--device",
                reason: format!("cuda: {e}"),
            })?;
        let model = match cuda {
            Some(backend) => LoadedModel::Cuda(self.load_on(backend)?),
            None => {
                let backend = CpuBackend::new(self.threads).map_err(|source| Error::Model {
                    path: self.path.clone(),
                    source,
                })?;
                LoadedModel::Cpu(self.load_on(backend)?)
            }
        };
        Ok((model, self.tokenizer))
    }

    fn load_on<B: Backend>(&self, backend: B) -> Result<Model<B>> {
        let bar = Bar::new("loading weights", 0, Unit::Steps);
        self.source
            .load_model_observed(Arc::new(backend), &|done, total| bar.track(done, total))
            .map_err(|source| Error::Model {
                path: self.path.clone(),
                source,
            })
    }
}

/// A model on the backend `--device` chose.
pub enum LoadedModel {
    Cpu(Model<CpuBackend>),
    Cuda(Model<CudaBackend>),
}

/// Runs `$body` with `$model` bound to the [`LoadedModel`]'s `Model<B>`, whichever `B` it is
/// (the body is compiled once per backend).
#[macro_export]
macro_rules! with_model {
    ($loaded:expr, |$model:ident| $body:expr) => {
        match $loaded {
            $crate::load::LoadedModel::Cpu($model) => $body,
            $crate::load::LoadedModel::Cuda($model) => $body,
        }
    };
}

/// Reads a calibration file written by `nibble calibrate` for a model of `layers` layers.
pub fn read_calibration(path: &Path, layers: usize) -> Result<Calibration> {
    let bytes = files::read(path)?;
    let text = String::from_utf8(bytes).map_err(|e| Error::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })?;
    Calibration::from_json(&text, layers).map_err(|source| Error::Calibration {
        path: path.to_path_buf(),
        source,
    })
}
