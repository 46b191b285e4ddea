//! nibble's inference engine: model loading, tokenizer, the [`Backend`] compute seam with a CPU
//! reference backend, and the Llama-family forward pass.
//!
//! * [`source`]: [`ModelSource::open`], the entry point that opens a model by path (a GGUF
//!   file or a Hugging Face directory) and loads its model and tokenizer.
//! * [`gguf`]: GGUF v2/v3 reader and GGML dequantizers.
//! * [`hf`], [`safetensors`]: Hugging Face model directories (config.json, safetensors
//!   checkpoints, tokenizer.json).
//! * [`config`]: [`ModelConfig`] from model metadata; [`Architecture`], [`RopeStyle`].
//! * [`weights`]: weights uploaded to a backend once (matrices may stay quantized) and shared.
//! * [`tokenizer`], [`chat`]: BPE tokenizer rebuilt from GGUF metadata or read from
//!   tokenizer.json; chat templates.
//! * [`grammar`]: structured outputs: JSON Schema, regex and Lark constraints (llguidance)
//!   turned into token masks the sampler applies.
//! * [`backend`]: the [`Backend`] trait and [`CpuBackend`].
//! * [`kv`]: the [`KvStore`] seam through which every layer's attention runs, and the
//!   contiguous f32 [`ContiguousKv`] store.
//! * [`model`]: [`Model::forward`] over a batch of sequences.
//! * [`eval`]: NLL / perplexity helpers.
//! * [`synthetic`]: random weights for any shape and a tokenizer in which every id decodes.
//! * [`decode_bench`]: end-to-end decode throughput through the engine's decode-worker path.

pub mod backend;
pub mod calibrate;
pub mod chat;
pub mod config;
pub mod decode_bench;
pub mod detok;
pub mod engine;
pub mod error;
pub mod eval;
pub mod gguf;
pub mod grammar;
pub mod hadamard;
pub mod hf;
pub mod kv;
pub mod model;
pub mod paged;
pub mod safetensors;
pub mod sampling;
pub mod scheduler;
pub mod session;
pub mod source;
pub mod stop;
pub mod synthetic;
pub mod tokenizer;
pub mod tools;
pub mod weights;

pub use backend::cpu::{CpuBackend, CpuTensor};
pub use backend::{AttentionArgs, AttnGeometry, Backend, PageEncoding, PagedSeq, RopeArgs};
pub use chat::ChatMessage;
pub use config::{Architecture, ModelConfig, RopeStyle};
pub use engine::{Engine, EngineConfig, Event, Failure, RequestError, StepPhases, Usage};
pub use error::{Error, Result};
pub use hf::HfModelDir;
pub use kv::{ContiguousKv, KvBatch, KvStore, NewTokens, PagedBatch, PerSequence, StepTokens};
pub use model::{Logits, Model, SeqInput, Workspace};
pub use session::{KvConfig, PagedSession};
pub use source::{ModelSource, SyntheticModel};
pub use tokenizer::Tokenizer;
pub use weights::{LayerWeights, LoadProgress, Weights};
